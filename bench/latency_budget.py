#!/usr/bin/env python3
"""Where a QD1 I/O's time goes, from a system-wide trace of syscalls and context switches
(`perf record -e raw_syscalls:sys_enter,raw_syscalls:sys_exit,sched:sched_switch`, read with
`perf script --ns -F comm,pid,tid,time,event,trace` on standard input).

At queue depth 1 each I/O is one round: the client sends a command, the target receives it,
answers, the client receives the answer and sends the next. Socket traffic is told from other
reads and writes (eventfds, timerfds: 8 bytes) by its size: 24 bytes or more, the smallest PDU
of either door.

    latency_budget.py CLIENT_PID TARGET_PID LABEL < perf-script-output

Prints one line: LABEL, the I/Os seen, then the mean of each stage in microseconds:
  client_send   the client's send syscall
  to_target     from its return until the target's receive returns with the command
                (loopback delivery, the target's wake-up or poll, its receive syscall), with
                `target_late`: the part of it the receiving thread was still running in user
                space, on the previous answer or its runtime, before it looked
  target        from there until the target enters its send (parse, route, the device, the
                answer), with `in_syscalls`: the target's syscalls inside it (io_uring, futex)
  target_send   the target's send syscall
  to_client     from its return until the client's last receive of the answer returns
  client        from there until the client sends the next command
  total         one I/O, send to send
  after_answer  the target thread's user-space time after its send returned until its next
                syscall (bookkeeping, its runtime; overlaps to_client and client), with
                `preempted`: the part of it another thread ran on its CPU (on two cores, the
                woken client preempting the target that woke it)
Fails when it saw fewer than 1,000 I/Os: a trace that caught nothing measures nothing.
"""

import re
import sys

SEND = {1, 20, 44, 46}  # write, writev, sendto, sendmsg
RECV = {0, 19, 45, 47}  # read, readv, recvfrom, recvmsg
SOCKET_BYTES = 24
LINE = re.compile(
    r"^\s*\S.*?\s+(\d+)/(\d+)\s+(\d+\.\d+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)(?: = (-?\d+))?"
)
STAGES = [
    "client_send", "to_target", "target_late", "target", "in_syscalls", "target_send",
    "to_client", "client", "total", "after_answer", "preempted",
]
SWITCH = re.compile(
    r"^\s*\S.*?\s+\d+/\d+\s+(\d+\.\d+):\s+sched:sched_switch:.*prev_pid=(\d+).*prev_state=(\S+) ==> .*next_pid=(\d+)"
)


def ns(stamp):
    secs, frac = stamp.split(".")
    return int(secs) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])


class Preemption:
    """Each thread's time off its CPU while runnable (switched out in state R), summed."""

    def __init__(self):
        self.since = {}
        self.total = {}

    def switch(self, t, prev, state, nxt):
        if state.startswith("R"):
            self.since[prev] = t
        began = self.since.pop(nxt, None)
        if began is not None:
            self.total[nxt] = self.total.get(nxt, 0) + t - began

    def of(self, tid):
        return self.total.get(tid, 0)


def events(stream, pids, preemption):
    """(time in ns, pid, tid, 'enter'|'exit', nr, ret) for the two processes."""
    for line in stream:
        if "sched_switch" in line:
            m = SWITCH.match(line)
            if m:
                preemption.switch(ns(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)))
            continue
        m = LINE.match(line)
        if not m or int(m.group(1)) not in pids:
            continue
        t = ns(m.group(3))
        ret = int(m.group(6)) if m.group(6) is not None else None
        yield t, int(m.group(1)), int(m.group(2)), m.group(4), int(m.group(5)), ret


class Round:
    """One I/O's timestamps, filled in as its events come."""

    def __init__(self, send_enter, send_exit):
        self.c_send = (send_enter, send_exit)
        self.t_recv = None
        self.t_send = None
        self.c_recv = None
        self.t_sys = 0
        # Target threads in user space when the command was sent, and their first syscall
        # after it.
        self.busy_at_send = set()
        self.first_enter = {}
        self.late = 0
        self.after = None
        self.t_tid = None
        self.preempted_at_send = 0
        self.preempted = 0

    def stages(self, next_send):
        if self.t_recv is None or self.t_send is None or self.c_recv is None:
            return None
        (cs0, cs1), tr, (ts0, ts1), cr = self.c_send, self.t_recv, self.t_send, self.c_recv
        return {
            "client_send": cs1 - cs0,
            "to_target": tr - cs1,
            "target": ts0 - tr,
            "in_syscalls": self.t_sys,
            "target_send": ts1 - ts0,
            "to_client": cr - ts1,
            "client": next_send - cr,
            "total": next_send - cs0,
            "target_late": self.late,
            "after_answer": self.after if self.after is not None else 0,
            "preempted": self.preempted,
        }


def budget(stream, client, target):
    entered = {}
    # The target's threads seen, and those inside a syscall now.
    target_tids, in_sys = set(), set()
    # The round whose answer the target sent last, until that thread's next syscall.
    answered = None
    rounds = []
    cur = None
    preemption = Preemption()
    for t, pid, tid, kind, nr, ret in events(stream, {client, target}, preemption):
        if kind == "enter":
            entered[tid] = (t, nr)
            if pid == target:
                target_tids.add(tid)
                in_sys.add(tid)
                if cur is not None and cur.t_recv is None:
                    cur.first_enter.setdefault(tid, t)
                if answered is not None and tid == answered.t_tid:
                    answered.after = t - answered.t_send[1]
                    answered.preempted = preemption.of(tid) - answered.preempted_at_send
                    answered = None
            continue
        if pid == target:
            in_sys.discard(tid)
        began, was = entered.pop(tid, (None, None))
        if began is None or was != nr:
            continue
        sock = ret is not None and ret >= SOCKET_BYTES
        if pid == client:
            if nr in SEND and sock:
                if cur is not None and cur.c_recv is not None:
                    cur.next_send = began
                    rounds.append(cur)
                    cur = None
                if cur is None:
                    cur = Round(began, t)
                    cur.busy_at_send = target_tids - in_sys
            elif nr in RECV and sock and cur is not None and cur.t_send is not None:
                cur.c_recv = t
        elif cur is not None:
            if nr in RECV and sock and cur.t_recv is None:
                cur.t_recv = t
                if tid in cur.busy_at_send and tid in cur.first_enter:
                    cur.late = max(0, cur.first_enter[tid] - cur.c_send[1])
            elif nr in SEND and sock and cur.t_recv is not None and cur.t_send is None:
                cur.t_send = (began, t)
                cur.t_tid = tid
                cur.preempted_at_send = preemption.of(tid)
                answered = cur
            elif cur.t_recv is not None and cur.t_send is None and began >= cur.t_recv:
                cur.t_sys += t - began
    # A round whose target side was not seen (another command's traffic) is not one I/O.
    stages = [r.stages(r.next_send) for r in rounds]
    return [s for s in stages if s is not None and min(s.values()) >= 0]


def main():
    client, target, label = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rounds = budget(sys.stdin, client, target)
    if len(rounds) < 1000:
        sys.exit(f"{label}: only {len(rounds)} I/Os in the trace")
    means = {s: sum(r[s] for r in rounds) / len(rounds) / 1000 for s in STAGES}
    print(label, len(rounds), " ".join(f"{s}={means[s]:.1f}" for s in STAGES))


if __name__ == "__main__":
    main()
