#!/usr/bin/env python3
"""Where a device I/O served through ferrosan waits: reads `perf script` output of the
tracepoints bench/ring-trace.sh records and prints, per I/O, the time from its submission to
the device (io_uring_submit_req -> block_rq_issue), in the device (block_rq_issue ->
block_rq_complete, paired by sector), and from the device's completion until the worker ran it
(block_rq_complete -> io_uring_local_work_run: a ring with deferred task work posts the
completion only when its worker enters the kernel for it). The last is split by what the
worker was doing when the first completion of a batch arrived: on a CPU (it finishes its turn
first), or asleep (the wake-up: waking -> on a CPU -> the run; the interrupt that completes
a burst runs before the worker it woke, when both are on one CPU). Exits non-zero when the trace
holds no paired I/O (nothing measured is not a result).

  ring_trace.py [--device-only] < perf-script-output

--device-only: the device's side alone (for a local run's trace, whose ring does not defer its
completions: submission -> device, in the device, bursts)."""
import bisect
import re
import statistics
import sys
from collections import Counter, deque

# Completions closer together than this (µs) count as one burst of the device's.
BURST_GAP = 20.0

LINE = re.compile(r"^\s*(.*?)\s+(\d+)\s+\[(\d+)\]\s+(\d+\.\d+):\s+(\S+):(.*)$")


def parse(stream):
    events = []
    for line in stream:
        m = LINE.match(line)
        if m:
            events.append((float(m.group(4)) * 1e6, m.group(5), int(m.group(2)), m.group(6)))
    events.sort(key=lambda e: e[0])
    return events


def field(rest, name):
    m = re.search(name + r"[= ](\S+)", rest)
    return m.group(1).rstrip(",") if m else None


def sector(rest):
    m = re.search(r"\) (\d+) \+", rest)
    return m.group(1) if m else None


def summary(name, xs):
    if not xs:
        return f"{name:34s} n=0"
    xs = sorted(xs)
    q = lambda p: xs[int(p * (len(xs) - 1))]
    return (f"{name:34s} n={len(xs):6d} mean={statistics.mean(xs):7.1f} p50={q(.5):7.1f} "
            f"p90={q(.9):7.1f} p99={q(.99):7.1f} us")


def main():
    events = parse(sys.stdin)
    submitters = Counter(pid for _, n, pid, _ in events if n == "io_uring:io_uring_submit_req")
    if not submitters:
        sys.exit("ring_trace: no io_uring submission in the trace")
    worker = submitters.most_common(1)[0][0]
    submitted, issued, pending = deque(), {}, []
    to_issue, in_device, to_run = [], [], []
    runs = 0
    last_was_issue = False
    bursts, spreads, issues_since, issue_times = [], [], [], []
    busy, since = 0.0, None  # the worker's time on a CPU, and since when it is on one
    on_cpu = None
    batch = None  # (first completion, worker on a CPU then, waking, on a CPU)
    by_state = {"on a CPU": [], "asleep": []}
    wake_parts = []
    for t, name, pid, rest in events:
        if name == "sched:sched_switch":
            if field(rest, "prev_pid") == str(worker):
                on_cpu = False
                if since is not None:
                    busy += t - since
                    since = None
            if field(rest, "next_pid") == str(worker):
                on_cpu = True
                since = t
                if batch and not batch[1] and batch[3] is None:
                    batch[3] = t
        elif name == "sched:sched_waking":
            if field(rest, "pid") == str(worker) and batch and not batch[1] and batch[2] is None:
                batch[2] = t
        elif name == "io_uring:io_uring_submit_req" and pid == worker:
            if last_was_issue:
                # A new io_uring_enter: what the last left unpaired (a lost event) is dropped.
                submitted.clear()
                last_was_issue = False
            submitted.append(t)
        elif name == "block:block_rq_issue" and pid == worker and submitted:
            # In submission order within the worker's io_uring_enter (one plug per call).
            last_was_issue = True
            to_issue.append(t - submitted.popleft())
            issues_since.append(t)
            issue_times.append(t)
            issued[sector(rest)] = t
        elif name == "block:block_rq_complete":
            start = issued.pop(sector(rest), None)
            if start is None:
                continue
            in_device.append(t - start)
            # A burst: completions less than BURST_GAP apart (the device answering together).
            if bursts and t - bursts[-1][2] < BURST_GAP:
                bursts[-1][0] += 1
                bursts[-1][2] = t
            else:
                bursts.append([1, t, t])
                if len(issues_since) > 1:
                    spreads.append(issues_since[-1] - issues_since[0])
                issues_since = []
            pending.append(t)
            if batch is None:
                batch = [t, bool(on_cpu), None, None]
        elif name == "io_uring:io_uring_local_work_run" and pid == worker and pending:
            runs += 1
            to_run.extend(t - p for p in pending)
            first, running, waking, oncpu = batch
            by_state["on a CPU" if running else "asleep"].append(t - first)
            if not running and waking is not None and oncpu is not None:
                wake_parts.append((waking - first, oncpu - waking, t - oncpu))
            pending, batch = [], None
    device_only = "--device-only" in sys.argv[1:]
    if not in_device or not (to_run or device_only):
        sys.exit("ring_trace: no device I/O paired in the trace")
    print(summary("submission -> device", to_issue))
    print(summary("in the device", in_device))
    if not device_only:
        print(summary("device done -> worker runs it", to_run))
        print(f"{'completions per run':34s} {len(to_run) / max(runs, 1):.1f} ({runs} runs)")
    sizes = [b[0] for b in bursts]
    print(f"{'device completions per burst':34s} mean={statistics.mean(sizes):.1f} "
          f"({len(sizes)} bursts, <{BURST_GAP:.0f} us apart)")
    # The kernel completes a burst's requests in one interrupt, on one CPU.
    print(summary("a burst, first to last completion", [b[2] - b[1] for b in bursts if b[0] > 1]))
    print(summary("first to last issue between bursts", spreads))
    # How soon the device gets work again once a burst is answered: the submitter's turnaround
    # (here the worker's turn and the client's; locally the benchmark's own loop).
    turnaround = []
    for _, _, end in bursts[:-1]:
        i = bisect.bisect_right(issue_times, end)
        if i < len(issue_times):
            turnaround.append(issue_times[i] - end)
    print(summary("a burst's last completion -> issue", turnaround))
    if device_only:
        return
    print(f"{'the worker on a CPU, per burst':34s} mean={busy / max(len(bursts), 1):7.1f} us")
    for state, xs in by_state.items():
        print(summary(f"first of a batch, worker {state}", xs))
    if wake_parts:
        a, b, c = zip(*wake_parts)
        print(f"{'asleep: done -> waking':34s} mean={statistics.mean(a):7.1f} us")
        print(f"{'asleep: waking -> on a CPU':34s} mean={statistics.mean(b):7.1f} us "
              "(the interrupt completing the burst runs first)")
        print(f"{'asleep: on a CPU -> the run':34s} mean={statistics.mean(c):7.1f} us")


if __name__ == "__main__":
    main()
