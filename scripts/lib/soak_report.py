#!/usr/bin/env python3
"""The soak's report (scripts/soak.sh): PREFIX.csv (samples) and PREFIX.rounds.csv (fio rounds)
in, PREFIX.txt (a summary, the verdict last) and PREFIX.svg (a chart) out.

    soak_report.py PREFIX CHURN_ROUNDS MINUTES [--gateways]

Exit 1 when what the daemon holds grew: descriptors above the baseline's plus 16, threads above
plus 8, RSS above twice the baseline plus 32 MiB. The baseline is the first sample at least
30 s in (past the first rounds' allocations), the end the last sample. With --gateways, also
PREFIX.gateways.csv (each gateway's samples) and PREFIX.gateways.json (the verifying host's
counts) in: the same check for each gateway, with room for the cluster connections a takeover
opens and closes (librados starts ~16 threads and a few sockets for each)."""
import csv
import json
import sys

FDS_SLACK, THREADS_SLACK, RSS_SLACK_KIB = 16, 8, 32 * 1024
GATEWAY_FDS_SLACK, GATEWAY_THREADS_SLACK = 64, 48


def rows(path):
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def polyline(points, x0, y0, w, h, xmax, ymax, colour):
    if not points or xmax <= 0 or ymax <= 0:
        return ""
    xy = " ".join(
        f"{x0 + w * x / xmax:.1f},{y0 + h - h * y / ymax:.1f}" for x, y in points
    )
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{xy}"/>'


def panel(title, series, top, xmax, unit):
    """One chart panel: `series` is [(label, colour, [(x, y)])]."""
    x0, w, h = 70, 1000, 150
    ymax = max((y for _, _, pts in series for _, y in pts), default=1) * 1.15 or 1
    out = [
        f'<text x="{x0}" y="{top - 8}" font-size="14">{title}</text>',
        f'<rect x="{x0}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
        f'<text x="{x0 - 6}" y="{top + 10}" font-size="11" text-anchor="end">{ymax:.0f} {unit}</text>',
        f'<text x="{x0 - 6}" y="{top + h}" font-size="11" text-anchor="end">0</text>',
    ]
    for i, (label, colour, pts) in enumerate(series):
        out.append(polyline(pts, x0, top, w, h, xmax, ymax, colour))
        out.append(
            f'<text x="{x0 + w + 8}" y="{top + 14 + 16 * i}" font-size="12" fill="{colour}">{label}</text>'
        )
    return out


def growth(base, end, fds_slack, threads_slack):
    """What grew from `base` to `end` beyond the slack, as phrases."""
    grew = []
    if end["fds"] > base["fds"] + fds_slack:
        grew.append(f"descriptors {base['fds']:.0f} -> {end['fds']:.0f}")
    if end["threads"] > base["threads"] + threads_slack:
        grew.append(f"threads {base['threads']:.0f} -> {end['threads']:.0f}")
    if end["rss_kib"] > 2 * base["rss_kib"] + RSS_SLACK_KIB:
        grew.append(f"RSS {base['rss_kib']:.0f} -> {end['rss_kib']:.0f} KiB")
    return grew


def gateway_lines(prefix, churn):
    """The gateways' footprint and the verifying host's counts, what grew, and each gateway's
    RSS as a chart series."""
    with open(prefix + ".gateways.csv", newline="") as f:
        samples = list(csv.DictReader(f))
    host = json.load(open(prefix + ".gateways.json"))
    lines, grew, series = [], [], []
    for g, colour in (("a", "#8c564b"), ("b", "#17becf")):
        mine = [{k: float(v) for k, v in r.items() if k != "gateway"} for r in samples if r["gateway"] == g]
        if len(mine) < 2:
            return [f"gateway {g}: too few samples"], [f"gateway {g} unsampled"], []
        base = next((s for s in mine if s["seconds"] >= 30), mine[0])
        end = mine[-1]
        lines.append(
            f"gateway {g}: RSS {base['rss_kib']:.0f} -> {end['rss_kib']:.0f} KiB, threads "
            f"{base['threads']:.0f} -> {end['threads']:.0f}, descriptors {base['fds']:.0f} -> "
            f"{end['fds']:.0f}, {end['cpu_s']:.1f} s of CPU"
        )
        grew += [f"gateway {g} {p}" for p in growth(base, end, GATEWAY_FDS_SLACK, GATEWAY_THREADS_SLACK)]
        series.append((f"gateway {g} RSS MiB", colour, [(s["seconds"], s["rss_kib"] / 1024) for s in mine]))
    lines.insert(0, (
        f"gateways: {(churn + 1) // 6} takeovers; the host through both portals: {host['writes']} "
        f"writes, {host['verified_mib']:.0f} MiB read back verified, {host['not_ready']} NOT READY "
        f"retried, {host['path_switches']} path switches, worst command {host['worst_ms']} ms "
        f"({host['over_1s']} over 1 s)"
    ))
    return lines, grew, series


def main():
    prefix, churn, minutes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    gateways = sys.argv[4:] == ["--gateways"]
    samples = rows(prefix + ".csv")
    rounds = rows(prefix + ".rounds.csv")
    if len(samples) < 2 or not rounds:
        print(f"too few samples ({len(samples)}) or rounds ({len(rounds)})", file=sys.stderr)
        return 1
    base = next((s for s in samples if s["seconds"] >= 30), samples[0])
    end = samples[-1]
    verified = sum(r["verified_mib"] for r in rounds)
    grew = growth(base, end, FDS_SLACK, THREADS_SLACK)
    p99 = sorted(r["p99_write_us"] for r in rounds)
    lines = [
        f"soak of {minutes} min: {len(rounds)} fio rounds, {verified:.0f} MiB written and read "
        f"back verified (crc32c), {churn} churn rounds (logins, reloads, volume verbs, "
        f"offline/online, device add/remove{', takeovers' if gateways else ''})",
        f"baseline at {base['seconds']:.0f} s: RSS {base['rss_kib']:.0f} KiB, "
        f"{base['threads']:.0f} threads, {base['fds']:.0f} descriptors",
        f"end at {end['seconds']:.0f} s: RSS {end['rss_kib']:.0f} KiB, "
        f"{end['threads']:.0f} threads, {end['fds']:.0f} descriptors, "
        f"{end['cpu_s']:.1f} s of CPU",
        f"peak RSS {max(s['rss_kib'] for s in samples):.0f} KiB; write p99 per round: "
        f"median {p99[len(p99) // 2]:.0f} us, worst {p99[-1]:.0f} us",
    ]
    gateway_rss = []
    if gateways:
        more, grew_more, gateway_rss = gateway_lines(prefix, churn)
        lines += more
        grew += grew_more
    lines += [
        "verdict: " + ("grew: " + ", ".join(grew) if grew else "nothing grew"),
    ]
    with open(prefix + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    xmax = max(end["seconds"], rounds[-1]["seconds"])
    svg = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="1240" height="620" font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    svg += panel(
        "daemon RSS" + (" and the gateways'" if gateways else ""),
        [("RSS MiB", "#1f77b4", [(s["seconds"], s["rss_kib"] / 1024) for s in samples])] + gateway_rss,
        40, xmax, "MiB",
    )
    svg += panel(
        "threads and open descriptors",
        [
            ("threads", "#2ca02c", [(s["seconds"], s["threads"]) for s in samples]),
            ("descriptors", "#d62728", [(s["seconds"], s["fds"]) for s in samples]),
        ],
        240, xmax, "",
    )
    svg += panel(
        "write latency per fio round",
        [
            ("p99 µs", "#ff7f0e", [(r["seconds"], r["p99_write_us"]) for r in rounds]),
            ("mean µs", "#9467bd", [(r["seconds"], r["mean_write_us"]) for r in rounds]),
        ],
        440, xmax, "µs",
    )
    svg.append(f'<text x="70" y="610" font-size="12">seconds 0 to {xmax:.0f}</text>')
    svg.append("</svg>")
    with open(prefix + ".svg", "w") as f:
        f.write("\n".join(svg) + "\n")
    print("\n".join(lines))
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
