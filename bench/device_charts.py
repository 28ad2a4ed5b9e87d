#!/usr/bin/env python3
"""SVG charts (standard library only) from a bench/device.sh results JSON.

    bench/device_charts.py RESULTS.json [OUTDIR]

Writes, next to RESULTS.json (or into OUTDIR), for RESULTS = BASE.json:

  BASE.vs-local.svg  per workload, each target's IOPS over the local device's: the median over
                     rounds of the target's `iops` ÷ the median of local's (local-dsync's for the
                     workloads that write -- the durability-matched baseline, as device.sh's
                     ×dsync column); dashed lines at 1.0 (the local device) and 0.85 (issue #17's
                     bar); under the QD1 group, the median mean latency (`lat_mean_us`) of local
                     and ferrosan.
  BASE.cpu.svg       per workload, each target's CPU µs per I/O on a log scale: the median over
                     rounds of `cpu_us_per_io`, the windowed figure device.sh prints as
                     "CPU µs/IO" (null where the sampler's window missed the run: those rounds are
                     left out, "n/a" where none is left).

Failed rows (ok: false) and null fields are skipped; missing workloads and targets are left out.
"""
import json
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charts import COLORS, esc  # noqa: E402  (bench/charts.py: the house palette and escaping)

WORKLOADS = ["randread-qd1", "randread-qd64", "randwrite-qd64", "randrw70-qd64", "seqread-qd16",
             "seqwrite-qd16"]
# two lines under each group: what, then queue depth (and, on the ratio chart, the baseline)
LABELS = {"randread-qd1": ("4K rand read", "QD1"), "randread-qd64": ("4K rand read", "QD64"),
          "randwrite-qd64": ("4K rand write", "QD64"), "randrw70-qd64": ("4K rand r/w 70/30", "QD64"),
          "seqread-qd16": ("1M seq read", "QD16"), "seqwrite-qd16": ("1M seq write", "QD16")}
TARGETS = ["ferrosan", "tgt-rdwr", "tgt-aio"]
# ferrosan in charts.py's fs-ram colour, tgt's two backing stores in its tgt blue and a lighter one
TCOLORS = {"ferrosan": COLORS["fs-ram"], "tgt-rdwr": COLORS["tgt"], "tgt-aio": "#74c0fc"}
ISSUE_BAR = 0.85  # issue #17: >= 0.85x the local device
HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'  # legible text over grid lines


# ---------------------------------------------------------------- data
def load(res):
    """{(workload, target): [ok rows]}, [workloads in chart order], {workload: writes?}, rounds"""
    rows = res.get("rows")
    if not rows:  # no per-run rows: one pseudo-row per summary line (its medians)
        rows = [dict(s, ok=True) for s in res.get("summary", []) if s.get("runs", 1)]
    cells, writes, rounds = {}, {}, set()
    for r in rows:
        w, t = r.get("workload"), r.get("target")
        if not w or not t:
            continue
        rounds.add(r.get("round"))
        rw = r.get("rw") or ""
        writes[w] = writes.get(w, False) or "write" in rw or rw == "randrw" or t == "local-dsync"
        cells.setdefault((w, t), [])
        if r.get("ok"):
            cells[(w, t)].append(r)
    present = {w for w, _ in cells}
    extra = [w for w in res.get("workloads", []) if w in present and w not in WORKLOADS]
    extra += sorted(present - set(WORKLOADS) - set(extra))
    order = [w for w in WORKLOADS if w in present] + extra
    rounds.discard(None)
    return cells, order, writes, len(rounds) or res.get("rounds") or 1


def median(cells, w, t, key):
    """(median over the ok rounds with a value, rounds with a value, ok rounds) or (None, 0, n)"""
    rs = cells.get((w, t), [])
    vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
    return (statistics.median(vals) if vals else None), len(vals), len(rs)


def describe(res, path):
    dev = res.get("dev") or {}
    n = dev.get("bytes")
    size = (f"{n / 2 ** 30:g} GiB" if n and n >= 2 ** 30 else f"{n / 2 ** 20:g} MiB" if n else "")
    kind = dev.get("kind") or "device"
    what = f"{size} {'block device' if kind == 'block' else kind}".strip()
    if dev.get("fstype"):
        what += f" on {dev['fstype']}"
    if dev.get("path"):
        what += f" ({dev['path']})"
    date = (res.get("date") or "")[:10]
    if not date:
        m = re.search(r"\d{4}-\d{2}-\d{2}", os.path.basename(path))
        date = m.group(0) if m else ""
    return what, date


def footnote(res):
    client = "ferrosan bench" if res.get("client") == "bench" else "fio"
    bits = [f"client: {client}", f"tag {res.get('tag', '?')}"]
    head = (res.get("ferrosan") or {}).get("git_head")
    if head:
        bits.append(f"ferrosan {head}")
    if res.get("seconds_per_run"):
        bits.append(f"{res['seconds_per_run']} s runs")
    host = res.get("host") or {}
    if host.get("cpus"):
        bits.append(f"{host['cpus']} CPUs")
    return " · ".join(bits)


# ---------------------------------------------------------------- SVG
def frame(W, H, title, subtitle, legend_y, L):
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>',
         f'<text x="{W / 2}" y="40" text-anchor="middle" fill="#555">{esc(subtitle)}</text>']
    x = L
    for t in TARGETS:
        o.append(f'<rect x="{x}" y="{legend_y - 10}" width="14" height="12" fill="{TCOLORS[t]}"/>')
        o.append(f'<text x="{x + 20}" y="{legend_y}">{esc(t)}</text>')
        x += 30 + 8 * len(t)
    return o


def group_geometry(order, L, R, W):
    gw = (W - L - R) / max(len(order), 1)
    bw = min(40.0, gw * 0.8 / len(TARGETS))
    return gw, bw, lambda g, i: L + gw * g + (gw - bw * len(TARGETS)) / 2 + bw * i


def axes(o, L, R, T, B, W, H, ylabel):
    """The chart's two axes and its rotated y label."""
    o.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" stroke="black"/>')
    o.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" stroke="black"/>')
    o.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(T + H - B) / 2})">{esc(ylabel)}</text>')


def finish(o, res, W, H, path):
    """The footnote, the closing tag, and the file."""
    o.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="11" fill="#777">'
             f'{esc(footnote(res))}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def group_labels(o, order, L, gw, y0, baseline_of):
    for g, w in enumerate(order):
        cx = L + gw * g + gw / 2
        what, qd = LABELS.get(w, (w, ""))
        note = baseline_of(w) if baseline_of else ""
        o.append(f'<text x="{cx:.1f}" y="{y0}" text-anchor="middle" font-weight="bold">'
                 f'{esc(what)}</text>')
        o.append(f'<text x="{cx:.1f}" y="{y0 + 14}" text-anchor="middle" font-size="11">'
                 f'{esc(" ".join(x for x in (qd, note) if x))}</text>')


def vs_local_chart(res, src, path):
    cells, order, writes, nrounds = load(res)
    what, date = describe(res, src)
    W, H, L, R, T, B = 960, 500, 60, 150, 74, 112

    def baseline(w):
        if writes.get(w) and median(cells, w, "local-dsync", "iops")[0]:
            return "local-dsync", "(vs O_DSYNC)"
        if median(cells, w, "local", "iops")[0]:
            return "local", "(vs local: no O_DSYNC run)" if writes.get(w) else "(vs O_DIRECT)"
        return None, "(no local run)"

    ratios, top = {}, 1.0
    for w in order:
        base = baseline(w)[0]
        b = median(cells, w, base, "iops")[0] if base else None
        for t in TARGETS:
            v = median(cells, w, t, "iops")[0]
            ratios[(w, t)] = v / b if v is not None and b else None
            top = max(top, ratios[(w, t)] or 0)
    ymax = math.ceil(top * 1.12 / 0.2) * 0.2

    def py(v):
        return H - B - v / ymax * (H - T - B)

    o = frame(W, H, f"{what}, {date} — through the target vs local, median of {nrounds} "
              f"round{'s' if nrounds != 1 else ''}",
              "IOPS ÷ local IOPS (O_DIRECT); workloads that write ÷ local-dsync (O_DIRECT|O_DSYNC), "
              "the durability-matched baseline", 60, L)
    k = 0
    while k * 0.2 <= ymax + 1e-9:
        y = py(k * 0.2)
        o.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{k * 0.2:.1f}</text>')
        k += 1
    gw, bw, bx = group_geometry(order, L, R, W)
    for g, w in enumerate(order):
        for i, t in enumerate(TARGETS):
            v, x = ratios[(w, t)], bx(g, i)
            if v is None:
                o.append(f'<text x="{x + bw / 2:.1f}" y="{H - B - 4}" text-anchor="middle" '
                         f'font-size="10" fill="#888">n/a</text>')
                continue
            o.append(f'<rect x="{x:.1f}" y="{py(v):.1f}" width="{bw - 2:.1f}" '
                     f'height="{H - B - py(v):.1f}" fill="{TCOLORS[t]}"><title>{esc(t)} '
                     f'{esc(w)}: {v:.3f}×</title></rect>')
            o.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{py(v) - 4:.1f}" text-anchor="middle" '
                     f'font-size="11" {HALO}>{v:.2f}</text>')
    for v, label, color, dash in ((1.0, "local = 1.0", "#333", "6 4"),
                                  (ISSUE_BAR, f"issue #17 bar ({ISSUE_BAR})", "#2f9e44", "3 3")):
        o.append(f'<line x1="{L}" x2="{W - R}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="{color}" '
                 f'stroke-width="1.5" stroke-dasharray="{dash}"/>')
        o.append(f'<text x="{W - R + 6}" y="{py(v) + 4:.1f}" fill="{color}">{esc(label)}</text>')
    axes(o, L, R, T, B, W, H, "× local (median IOPS ÷ median IOPS)")
    group_labels(o, order, L, gw, H - B + 18, lambda w: baseline(w)[1])
    for g, w in enumerate(order):  # mean latency at QD1, where it is the figure that matters
        depths = {r.get("iodepth") for (w2, _), rs in cells.items() if w2 == w for r in rs}
        if not (depths == {1} or w.endswith("-qd1")):
            continue
        lines = ["mean latency:"]
        a, b = (median(cells, w, t, "lat_mean_us")[0] for t in ("local", "ferrosan"))
        for t, v in (("local", a), ("ferrosan", b)):
            lines.append(f"{t} {v:.0f} µs" if v is not None else f"{t} n/a")
        if a is not None and b is not None:
            lines[-1] += f" ({b - a:+.0f})"
        cx = L + gw * g + gw / 2
        for j, s in enumerate(lines):
            o.append(f'<text x="{cx:.1f}" y="{H - B + 50 + 13 * j}" text-anchor="middle" '
                     f'font-size="11" fill="#444">{esc(s)}</text>')
    finish(o, res, W, H, path)
    return ratios


def cpu_chart(res, src, path):
    cells, order, writes, nrounds = load(res)
    what, date = describe(res, src)
    W, H, L, R, T, B = 960, 480, 60, 150, 74, 80
    meds = {(w, t): median(cells, w, t, "cpu_us_per_io") for w in order for t in TARGETS}
    vals = [m[0] for m in meds.values() if m[0] and m[0] > 0]
    lo = 10 ** math.floor(math.log10(min(vals))) if vals else 1
    hi = 10 ** math.ceil(math.log10(max(vals) * 1.6)) if vals else 10
    lo = min(lo, 1.0)

    def py(v):
        return H - B - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (H - T - B)

    o = frame(W, H, f"{what}, {date} — target CPU per I/O, median of {nrounds} "
              f"round{'s' if nrounds != 1 else ''}",
              "utime+stime of the target process over a window inside the client's measured run "
              "÷ its I/Os (µs, log scale)", 60, L)
    d = lo
    while d <= hi * 1.0001:
        for m in (1, 2, 5):
            v = d * m
            if v > hi * 1.0001:
                break
            y = py(v)
            o.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="{"#ccc" if m == 1 else "#eee"}"/>')
            minor = "" if m == 1 else ' fill="#888" font-size="10"'
            o.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end"{minor}>{v:g}</text>')
        d *= 10
    gw, bw, bx = group_geometry(order, L, R, W)
    for g, w in enumerate(order):
        for i, t in enumerate(TARGETS):
            v, have, ok = meds[(w, t)]
            x = bx(g, i)
            if v is None or v <= 0:
                o.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{H - B - 4}" text-anchor="middle" '
                         f'font-size="10" fill="#888">n/a</text>')
                continue
            o.append(f'<rect x="{x:.1f}" y="{py(v):.1f}" width="{bw - 2:.1f}" '
                     f'height="{H - B - py(v):.1f}" fill="{TCOLORS[t]}"><title>{esc(t)} {esc(w)}: '
                     f'{v:.2f} µs/IO ({have} of {ok} rounds)</title></rect>')
            label = f"{v:.1f}" if v < 100 else f"{v:.0f}"
            o.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{py(v) - 4:.1f}" text-anchor="middle" '
                     f'font-size="11" {HALO}>{label}</text>')
            if have < ok:  # some rounds had no window sample: say on how many the median stands
                inside = H - B - py(v) > 18  # inside the bar's top, white; above the value if short
                ink = "#0b3d66" if t == "tgt-aio" else "white"  # legible on the light blue too
                y, paint = (py(v) + 12, f'fill="{ink}"') if inside else (py(v) - 17, HALO)
                o.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{y:.1f}" text-anchor="middle" '
                         f'font-size="9" {paint}>{have}/{ok} rds</text>')
    axes(o, L, R, T, B, W, H, "target CPU µs per I/O (log)")
    group_labels(o, order, L, gw, H - B + 18, None)
    notes = ["n/a: no windowed", "CPU sample (the", "client's run ended", "before the sampler's",
             "window closed)"]
    for j, s in enumerate(notes):
        o.append(f'<text x="{W - R + 10}" y="{T + 20 + 13 * j}" font-size="10" fill="#777">'
                 f'{esc(s)}</text>')
    finish(o, res, W, H, path)
    return meds


def missing(res):
    """Lines naming the rows and the medians these charts could not use."""
    cells, order, writes, _ = load(res)
    out = []
    for r in res.get("rows", []):
        where = f"round {r.get('round')} {r.get('workload')} {r.get('target')}"
        if not r.get("ok"):
            out.append(f"{where}: failed ({r.get('error', '?')})")
        elif r.get("target") in TARGETS and r.get("cpu_us_per_io") is None:
            out.append(f"{where}: cpu_us_per_io null (target_window_ok={r.get('target_window_ok')})")
        elif r.get("iops") is None:
            out.append(f"{where}: iops null")
    for w in order:
        for t in TARGETS + ["local"] + (["local-dsync"] if writes.get(w) else []):
            if (w, t) not in cells:
                out.append(f"{w} {t}: no row")
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(src) or "."
    os.makedirs(out, exist_ok=True)
    with open(src) as f:
        res = json.load(f)
    base = os.path.join(out, re.sub(r"\.json$", "", os.path.basename(src)))
    vs_local_chart(res, src, base + ".vs-local.svg")
    cpu_chart(res, src, base + ".cpu.svg")
    print(f"wrote {base}.vs-local.svg {base}.cpu.svg")
    for line in missing(res):
        print(f"  missing: {line}")
