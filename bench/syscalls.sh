#!/usr/bin/env bash
# The daemon's system calls per I/O, by kind: one daemon per build given, one RAM LUN on both
# doors, the same client (`ferrosan bench` of the first build), each workload once per build
# with `perf stat` counting the daemon's syscall tracepoints. Counts, unlike timings, do not
# drift with this machine's noise: what a change saves in system calls shows in one run.
#
#   bench/syscalls.sh WORKLOAD BIN [BIN...]
#
#   WORKLOAD   a `ferrosan bench` id (randwrite-64k-qd16, ...)
#   DOOR=nvme  through NVMe/TCP instead of iSCSI
# Each LUN is written through once first (1 MiB writes for 3 s): a RAM LUN's first writes to
# a page allocate it, whose mprotect calls are the LUN filling up, not the I/O path.
# Results: bench/results/syscalls-DATE.txt. Needs root (perf's tracepoints).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=syscalls
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh
WORKLOAD=${1:?usage: bench/syscalls.sh WORKLOAD BIN [BIN...]}
shift
(($# > 0)) || die "usage: bench/syscalls.sh WORKLOAD BIN [BIN...]"
command -v perf >/dev/null || die "perf is needed (Debian: linux-perf)"
DOOR=${DOOR:-iscsi}
CLIENT=$1
IQN=iqn.2026-11.org.ferrosan:syscalls
NQN=nqn.2026-11.org.ferrosan:syscalls
KINDS=(recvfrom readv writev sendto setsockopt epoll_wait sched_yield io_uring_enter futex mprotect)
EVENTS=raw_syscalls:sys_enter
for k in "${KINDS[@]}"; do EVENTS+=",syscalls:sys_enter_$k"; done
scratch
OUT=bench/results/syscalls-$(date +%Y-%m-%d-%H%M%S).txt
{
    echo "# bench/syscalls.sh $(date -u +%FT%TZ): workload=$WORKLOAD door=$DOOR client=$CLIENT lun=ram:1G"
    echo "# bin ios all ${KINDS[*]} (system calls per I/O)"
} >"$OUT"
for bin in "$@"; do
    read -r port nvme_port < <(two_ports)
    start_daemon daemon "$port $nvme_port" "$bin" serve --listen "127.0.0.1:$port" \
        --nvme-listen "127.0.0.1:$nvme_port" --target "$IQN" --lun ram:1G \
        --control-socket "$WORK/ctl.sock"
    url="iscsi://127.0.0.1:$port/$IQN/0"
    [[ $DOOR == nvme ]] && url="nvme+tcp://127.0.0.1:$nvme_port/$NQN/1"
    "$CLIENT" bench --destructive --only seqwrite-1m-qd16 --ramp 0 --runtime 3 --out "$WORK/fill" "$url" >/dev/null 2>&1 ||
        die "the fill run failed against $bin"
    perf stat -x, -e "$EVENTS" -p "$PID" -o "$WORK/perf.csv" &
    perf_pid=$!
    sleep 0.3
    "$CLIENT" bench --destructive --only "$WORKLOAD" --ramp 0 --runtime 5 --out "$WORK/res" "$url" >/dev/null 2>&1 ||
        die "$WORKLOAD failed against $bin"
    kill -INT "$perf_pid"
    wait "$perf_pid" || true
    ios=$(python3 - "$WORK/res/results.json" "$WORKLOAD" <<'PY'
import json, sys
path, w = sys.argv[1:]
rows = [r for r in json.load(open(path))["rows"] if r["workload"]["id"] == w]
if not rows or not rows[0].get("iops") or rows[0].get("errors"):
    sys.exit(f"no result rows for {w} in {path}")
print(int(rows[0]["iops"] * 5))  # the run's --runtime
PY
    )
    ((ios > 0)) || die "no I/O measured against $bin"
    # perf -x, lines: COUNT,UNIT,EVENT,...; the events in the order asked.
    awk -F, -v bin="$bin" -v ios="$ios" '$3 ~ /sys_enter/ { v[n++] = $1 / ios }
        END { printf "%s %d", bin, ios; for (i = 0; i < n; i++) printf " %.2f", v[i]; printf "\n" }' "$WORK/perf.csv" >>"$OUT"
    stop_spawned "$PID"
    rm -rf "$WORK/res" "$WORK/fill"
done
sed -n '2,$p' "$OUT" | sed 's/^# //' | column -t | sed 's/^/  /' >&2
log "results: $OUT"
