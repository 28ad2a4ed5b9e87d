#!/usr/bin/env bash
# Where a deep queue's device reads wait inside the target: one ferrosan serving a file (direct
# I/O on io_uring), `ferrosan bench` reading it at QD64, and `perf record` of the kernel's
# io_uring, block and scheduler tracepoints for one second of the run, read by
# bench/ring_trace.py (submission -> device, in the device, device done -> the worker runs the
# completion, and what the worker was doing meanwhile). A second run without tracing gives the
# IOPS the trace's own cost is measured against. Then the same workload on DEV itself
# (`ferrosan bench`'s local engine, O_DIRECT on io_uring), traced alike, for the device's side
# without the target: its bursts and the spread of its submissions.
#
#   DEV=/path/to/file bench/ring-trace.sh
#
#   DEV        a file on a disk (required; read only)
#   WORKLOAD   a `ferrosan bench` id (default randread-4k-qd64)
#   FERROSAN   the binary (default $FERROSAN_BIN, else release/ferrosan under the cargo target
#              directory; this script never builds it)
# Results: bench/results/ring-trace-DATE.txt. Needs root (perf's tracepoints, drop_caches).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck disable=SC2034 # read by common.sh's log
LOG_TAG=ring-trace
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh
DEV=${DEV:?DEV=/path/to/file bench/ring-trace.sh}
[[ -f $DEV ]] || die "DEV must be a file: $DEV"
command -v perf >/dev/null || die "perf is needed (Debian: linux-perf)"
WORKLOAD=${WORKLOAD:-randread-4k-qd64}
BIN=${FERROSAN:-${FERROSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan}}
[[ -x $BIN ]] || die "no ferrosan binary at $BIN (build it: cargo build --release -p ferrosan)"
IQN=iqn.2026-12.org.ferrosan:ring-trace
scratch
OUT=bench/results/ring-trace-$(date +%Y-%m-%d-%H%M).txt
EVENTS=(io_uring:io_uring_submit_req io_uring:io_uring_local_work_run block:block_rq_issue
    block:block_rq_complete sched:sched_switch sched:sched_waking)

# result FILE: the IOPS and latency of a `ferrosan bench` results.json (none measured fails).
result() {
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]
if r["iops"] <= 0:
    sys.exit("the bench measured no I/O")
lat = r["latency_us"]
print("%d IOPS, mean %.0f us, p99 %.0f us" % (r["iops"], lat["mean"], lat["p99"]))
PY
}

# One run: a fresh daemon, the page cache dropped, the bench; with TRACE=1 one second of
# tracepoints from the middle of its measured window.
run() {
    local trace=$1 port
    port=$(free_port)
    sync
    echo 3 >/proc/sys/vm/drop_caches
    start_daemon daemon "$port" "$BIN" serve --listen "127.0.0.1:$port" --target "$IQN" \
        --lun "file:$DEV" --control-socket "$WORK/ctl.sock" --state-dir "$WORK/state"
    "$BIN" bench --only "$WORKLOAD" --ramp 2 --runtime 8 --out "$WORK/bench" \
        "iscsi://127.0.0.1:$port/$IQN/0" >"$WORK/bench.log" 2>&1 &
    local bench=$!
    if ((trace)); then
        sleep 5
        local args=()
        for e in "${EVENTS[@]}"; do args+=(-e "$e"); done
        perf record -q -a -o "$WORK/trace.data" "${args[@]}" -- sleep 1 2>/dev/null
    fi
    wait "$bench" || die "the bench failed: $(tail -3 "$WORK/bench.log")"
    stop_spawned "$PID"
    result "$WORK/bench/results.json"
}

# The local run: the bench on DEV itself, traced from the middle of its window; prints its
# result line and leaves the trace in $WORK/local.data.
local_run() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
    "$BIN" bench --only "$WORKLOAD" --ramp 2 --runtime 8 --out "$WORK/local" "$DEV" \
        >"$WORK/local.log" 2>&1 &
    local bench=$!
    sleep 5
    perf record -q -a -o "$WORK/local.data" -e io_uring:io_uring_submit_req \
        -e block:block_rq_issue -e block:block_rq_complete -- sleep 1 2>/dev/null
    wait "$bench" || die "the local bench failed: $(tail -3 "$WORK/local.log")"
    result "$WORK/local/results.json"
}

# Not in command substitutions: a failure must reach the trap that stops the daemon.
run 0 >"$WORK/untraced.txt"
run 1 >"$WORK/traced.txt"
local_run >"$WORK/local.txt"
{
    echo "# bench/ring-trace.sh $(date -u +%FT%TZ): $WORKLOAD from $DEV, $BIN ($("$BIN" --version)), checkout $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "# ferrosan bench, one iSCSI session; times per I/O from the kernel's tracepoints"
    echo "untraced run: $(cat "$WORK/untraced.txt")"
    echo "traced run:   $(cat "$WORK/traced.txt")"
    perf script -i "$WORK/trace.data" 2>/dev/null | python3 bench/ring_trace.py
    echo "# the same workload on $DEV itself (ferrosan bench's local engine), traced alike"
    echo "local run:    $(cat "$WORK/local.txt")"
    perf script -i "$WORK/local.data" 2>/dev/null | python3 bench/ring_trace.py --device-only
} | tee "$OUT"
log "results in $OUT"
