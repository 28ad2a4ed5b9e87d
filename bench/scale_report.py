#!/usr/bin/env python3
"""The scale curves of one bench/scale.sh run: a Markdown table and an SVG chart.

    bench/scale_report.py SESSION_RESULTS LUN_RESULTS VOLUME_RESULTS NVME_RESULTS OUT_PREFIX

Reads the results files of bench/session-scale.sh, bench/config-scale.sh and
bench/nvme-controllers.sh (standard library only) and writes OUT_PREFIX.md (the tables) and OUT_PREFIX.svg (four panels, a log
x axis each: what grows with the count, against a flat line). Exits non-zero when a file
holds no row, so a run that measured nothing cannot pass as a curve.
"""
import math
import sys

COLOURS = ["#d9480f", "#1c7ed6", "#2b8a3e", "#ae3ec9"]


def rows(path, width):
    """The data rows of a results file: lists of fields, comments skipped."""
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            fields = line.split()
            if len(fields) == width:
                out.append(fields)
    return out


def sessions(path):
    idle = [r for r in rows(path, 6)]
    active = [r for r in rows(path, 3)]
    if not idle:
        sys.exit(f"{path}: no idle-session row")
    return idle, active


def controllers(path):
    """[(N, KiB per NVMe controller, KiB per iSCSI session, ms/s idle NVMe, iSCSI)]."""
    out = [(int(r[0]), float(r[2]), float(r[4]), float(r[5]), float(r[6])) for r in rows(path, 7)]
    if not out:
        sys.exit(f"{path}: no row")
    return out


def verbs(path):
    """{verb: [(N, median seconds, daemon cpu ms)]} from a config-scale results file."""
    by = {}
    for n, verb, median, _lo, _hi, _calls, cpu in rows(path, 7):
        by.setdefault(verb, []).append((int(n), float(median), float(cpu)))
    if not by:
        sys.exit(f"{path}: no row")
    return by


def panel(title, unit, series, left, top, w=420, h=240):
    """One chart: {name: [(x, y)]} on a log10 x axis and a linear y axis from 0."""
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ymax = max((y for pts in series.values() for _, y in pts), default=1) * 1.1 or 1
    lx0, lx1 = math.log10(xs[0]), math.log10(xs[-1])

    def px(x):
        return left + 50 + (math.log10(x) - lx0) / ((lx1 - lx0) or 1) * (w - 70)

    def py(y):
        return top + h - 30 - y / ymax * (h - 60)

    o = [f'<text x="{left + w / 2}" y="{top + 16}" text-anchor="middle" font-size="13">{title}</text>',
         f'<line x1="{left + 50}" y1="{top + h - 30}" x2="{left + w - 20}" y2="{top + h - 30}" stroke="#000"/>',
         f'<line x1="{left + 50}" y1="{top + 30}" x2="{left + 50}" y2="{top + h - 30}" stroke="#000"/>',
         f'<text x="{left + 4}" y="{top + 30}" font-size="10">{ymax / 1.1:.3g}</text>',
         f'<text x="{left + 4}" y="{top + 42}" font-size="10">{unit}</text>']
    for x in xs:
        o.append(f'<text x="{px(x):.1f}" y="{top + h - 14}" text-anchor="middle" font-size="10">{x}</text>')
    for i, (name, pts) in enumerate(series.items()):
        c = COLOURS[i % len(COLOURS)]
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
        o.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
        o += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}"/>' for x, y in pts]
        o.append(f'<text x="{left + 60}" y="{top + 32 + 13 * i}" font-size="11" fill="{c}">{name}</text>')
    return o


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    idle, active = sessions(sys.argv[1])
    luns = verbs(sys.argv[2])
    volumes = verbs(sys.argv[3])
    nvme = controllers(sys.argv[4])
    out = sys.argv[5]
    md = ["| idle sessions | daemon RSS (KiB) | per session (KiB) | idle CPU (ms/s) | one more login (ms) | REPORT LUNS (ms) |",
          "|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {n} | {rss} | {per} | {cpu} | {login} | {rep} |" for n, rss, per, cpu, login, rep in idle]
    if active:
        md += ["", "| active sessions | IOPS (4 KiB random reads, QD8 each) | daemon CPU per I/O (µs) |",
               "|---:|---:|---:|"]
        md += [f"| {m} | {int(iops):,} | {cpu} |" for m, iops, cpu in active]
    md += ["", "| idle NVMe/TCP controllers (iSCSI sessions) | per controller, 3 queues (KiB) | per iSCSI session (KiB) | idle CPU, controllers (ms/s) | idle CPU, sessions (ms/s) |",
           "|---:|---:|---:|---:|---:|"]
    md += [f"| {n} | {c} | {s} | {cc} | {sc} |" for n, c, s, cc, sc in nvme]
    for title, by in (("LUNs", luns), ("volumes", volumes)):
        heads = ({"idle": "idle CPU (ms/s)", "changed": "idle CPU after a change (ms/s)"}.get(v, f"{v} (ms)")
                 for v in by)
        md += ["", f"| {title} | " + " | ".join(heads) + " |",
               "|---:|" + "---:|" * len(by)]
        counts = sorted({n for pts in by.values() for n, _, _ in pts})
        for n in counts:
            # An idle row's time is the seconds idled; its CPU (ms per s) is the measure.
            cells = [next((f"{c:.2f}" if v in ("idle", "changed") else f"{t * 1000:.2f}"
                           for m, t, c in by[v] if m == n), "–") for v in by]
            md.append(f"| {n} | " + " | ".join(cells) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="880" height="520" font-family="sans-serif">',
           '<rect width="880" height="520" fill="white"/>']
    # The daemon's whole idle CPU, not per session: /proc counts 10 ms ticks, so a few
    # sessions' share is below what it can tell.
    svg += panel("idle sessions and controllers: memory each, CPU in all", "", {
        "KiB per iSCSI session": [(int(r[0]), float(r[2])) for r in idle],
        "idle CPU, ms per s (all sessions)": [(int(r[0]), float(r[3])) for r in idle],
        "KiB per NVMe/TCP controller (3 queues)": [(n, c) for n, c, _, _, _ in nvme]}, 0, 0)
    svg += panel("idle sessions: one more login", "ms", {
        "login": [(int(r[0]), float(r[4])) for r in idle]}, 440, 0)
    svg += panel("LUNs: start-up, reload, listing", "ms", {
        v: [(n, t * 1000) for n, t, _ in luns[v]] for v in ("startup", "reload", "luns", "report-luns") if v in luns}
        | {"idle CPU, ms per s": [(n, float(c)) for n, _, c in luns.get("idle", [])]}
        | {"idle CPU after a change, ms per s": [(n, float(c)) for n, _, c in luns.get("changed", [])]}, 0, 260)
    svg += panel("volumes: one verb", "ms", {
        v: [(n, t * 1000) for n, t, _ in volumes[v]] for v in volumes}, 440, 260)
    svg.append("</svg>")
    with open(out + ".svg", "w") as f:
        f.write("\n".join(svg) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
