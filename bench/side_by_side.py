#!/usr/bin/env python3
"""Rows and medians of the side-by-side bench scripts (bench/doors.sh, bench/tls.sh).

  side_by_side.py row RESULTS.json ROUND LABEL WORKLOAD TICKS HZ
      one line "ROUND LABEL WORKLOAD IOPS CPU_US_PER_IO CLIENT_CPU_US_PER_IO" from a
      `ferrosan bench` run and the daemon's CPU ticks over it (the client's as the bench
      measured it, "-" when it did not); fails on a run with no rows or with I/O errors
  side_by_side.py summary FILE A B
      per workload, the medians of A and B (IOPS, B/A, the daemon's and the client's CPU
      per I/O)
"""
import json
import statistics
import sys


def row(path, rnd, label, workload, ticks, hz):
    results = json.load(open(path))
    rows = [r for r in results["rows"] if r["workload"]["id"] == workload]
    if not rows or not rows[0].get("iops"):
        sys.exit(f"no result rows for {workload} in {path}")
    r = rows[0]
    if r.get("errors"):
        sys.exit(f"{label} {workload}: {r['errors']} I/O errors")
    ios = r["iops"] * results["runtime_s"]
    cpu_us = int(ticks) / int(hz) * 1e6
    client = r.get("client_cpu_us_per_io")
    client = "-" if client is None else f"{client:.2f}"
    print(f"{rnd} {label} {workload} {r['iops']:.0f} {cpu_us / ios:.2f} {client}")


def summary(path, a, b):
    rows = [l.split() for l in open(path) if not l.startswith("#")]
    for w in dict.fromkeys(r[2] for r in rows):
        def med(label, col):
            return statistics.median(float(r[col]) for r in rows if r[1] == label and r[2] == w)
        ratio = med(b, 3) / med(a, 3)
        line = (f"# {w}: iops {a} {med(a, 3):.0f} {b} {med(b, 3):.0f} ({b}/{a} {ratio:.3f}); "
                f"daemon cpu us/io {a} {med(a, 4):.2f} {b} {med(b, 4):.2f}")
        if all(len(r) > 5 and r[5] != "-" for r in rows if r[2] == w):
            line += f"; client cpu us/io {a} {med(a, 5):.2f} {b} {med(b, 5):.2f}"
        print(line)


if __name__ == "__main__":
    {"row": row, "summary": summary}[sys.argv[1]](*sys.argv[2:])
