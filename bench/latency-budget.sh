#!/usr/bin/env bash
# Where a QD1 4 KiB I/O's microseconds go, door by door: one ferrosan daemon serving a RAM LUN
# and a file LUN on this machine's disk over iSCSI and NVMe/TCP, `ferrosan bench` at queue
# depth 1 (reads, then writes). Each run is measured twice: untraced (the latency a user sees)
# and under a system-wide syscall trace (`perf record -e raw_syscalls:*`), which
# bench/latency_budget.py cuts into stages (client send, to the target, the target, its send,
# to the client, the client). The trace slows every syscall a little: the traced total is
# printed beside the untraced latency. The local file at QD1 (the same client's local engine;
# writes with RWF_DSYNC, as the file LUN writes through) is the device's own time, and a
# loopback TCP ping-pong of 4 KiB (sockperf, when installed) the network's: once with both
# sides sleeping in recv, once with both spinning.
#
#   bench/latency-budget.sh BIN [DIR]     # DIR: where the 1 GiB file LUN goes (default /var/tmp)
#
# Results: bench/results/latency-budget-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=latency-budget
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/latency-budget.sh BIN [DIR]}
DIR=${2:-/var/tmp}
command -v perf >/dev/null || die "perf is needed (apt-get install linux-perf)"
IQN=iqn.2026-11.org.ferrosan:budget
NQN=nqn.2026-11.org.ferrosan:budget
scratch
FILE=$DIR/ferrosan-budget-$$.img
on_exit 'rm -f "$FILE"'

# Written whole first: reads come from the disk's blocks, not a hole.
dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none
read -r PORT NVME_PORT < <(two_ports)
start_daemon daemon "$PORT $NVME_PORT" "$BIN" serve --listen "127.0.0.1:$PORT" \
    --nvme-listen "127.0.0.1:$NVME_PORT" --target "$IQN" --lun ram:1G --lun "file:$FILE" \
    --control-socket "$WORK/ctl.sock"
OUT=bench/results/latency-budget-$(date +%Y-%m-%d-%H%M).txt
echo "# bench/latency-budget.sh $(date -u +%FT%TZ): bin=$BIN file=$FILE; stages in us (bench/latency_budget.py)" >"$OUT"

# mean_us RESULTS_DIR: the run's mean latency in microseconds.
mean_us() {
    python3 -c 'import json,sys; rows=json.load(open(sys.argv[1]))["rows"]
assert rows and rows[0].get("iops") and not rows[0].get("errors"), "no result rows"
print(round(rows[0]["latency_us"]["mean"], 1))' "$1/results.json"
}
# run LABEL WORKLOAD URL: untraced, then traced.
run() {
    local label=$1 w=$2 url=$3 bench
    local dsync=()
    [[ $url != *://* && $w == randwrite* ]] && dsync=(--dsync)
    "$BIN" bench --destructive --even-if-open "${dsync[@]}" --only "$w" --ramp 1 --runtime 5 --out "$WORK/plain" "$url" \
        >"$WORK/bench.log" 2>&1 || die "ferrosan bench failed on $label: $(tail -3 "$WORK/bench.log")"
    local plain
    plain=$(mean_us "$WORK/plain")
    if [[ $url != *://* ]]; then
        # The local device: no target to trace.
        echo "$label untraced_mean=$plain" | tee -a "$OUT"
        return
    fi
    "$BIN" bench --destructive --even-if-open --only "$w" --ramp 2 --runtime 4 --out "$WORK/traced" "$url" \
        >"$WORK/bench.log" 2>&1 &
    bench=$!
    sleep 2.5
    perf record -q -e raw_syscalls:sys_enter,raw_syscalls:sys_exit,sched:sched_switch -a -o "$WORK/perf.data" -- sleep 2 2>/dev/null
    wait "$bench" || die "ferrosan bench failed under the trace on $label: $(tail -3 "$WORK/bench.log")"
    local line
    # A trace that caught too few I/Os (the disk stalled) is reported, and the script goes on.
    line=$(perf script -i "$WORK/perf.data" --ns -F comm,pid,tid,time,event,trace 2>/dev/null |
        python3 bench/latency_budget.py "$bench" "$PID" "$label" 2>&1) || FAILED=1
    echo "$line untraced_mean=$plain" | tee -a "$OUT"
}
FAILED=0
# pingpong NAME [--nonblocked]: sockperf's mean round trip (it prints half of it).
pingpong() {
    local name=$1 srv half
    shift
    spawn "$WORK/sockperf-sr.log" sockperf sr --tcp -i 127.0.0.1 -p "$SP_PORT" "$@"
    srv=$SPAWNED
    sleep 1
    half=$(sockperf pp --tcp -i 127.0.0.1 -p "$SP_PORT" -m 4096 -t 5 "$@" 2>&1 |
        sed -n 's/.*Summary: Latency is \([0-9.]*\) usec.*/\1/p')
    stop_spawned "$srv"
    [[ -n $half ]] || die "sockperf measured nothing"
    echo "loopback-tcp-4k-pingpong-$name round_trip=$(echo "2 * $half" | bc)" | tee -a "$OUT"
}
if command -v sockperf >/dev/null; then
    SP_PORT=$(free_port)
    pingpong sleeping
    pingpong spinning --nonblocked
fi
for w in randread-4k-qd1 randwrite-4k-qd1; do
    run "local-file-$w" "$w" "$FILE"
    for lun in 0 1; do
        dev=ram
        ((lun == 1)) && dev=file
        run "iscsi-$dev-$w" "$w" "iscsi://127.0.0.1:$PORT/$IQN/$lun"
        run "nvme-$dev-$w" "$w" "nvme+tcp://127.0.0.1:$NVME_PORT/$NQN/$((lun + 1))"
    done
done
log "results: $OUT"
((FAILED == 0)) || die "a trace measured too few I/Os (see $OUT)"
