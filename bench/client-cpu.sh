#!/usr/bin/env bash
# The bench client's CPU beside the daemon's, per I/O, through each door: whether a row of
# bench/doors.sh or device.sh measures the target or the client. For each BIN (its daemon and
# its `ferrosan bench` together), one RAM LUN served through both doors, one run of WORKLOAD
# per door and round; client CPU from /usr/bin/time (user+sys), daemon CPU from /proc/PID/stat.
#
#   bench/client-cpu.sh ROUNDS WORKLOAD BIN...
#
# Results: bench/results/client-cpu-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=client-cpu
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

ROUNDS=${1:?usage: bench/client-cpu.sh ROUNDS WORKLOAD BIN...}
WORKLOAD=${2:?usage: bench/client-cpu.sh ROUNDS WORKLOAD BIN...}
shift 2
(($# > 0)) || die "usage: bench/client-cpu.sh ROUNDS WORKLOAD BIN..."
IQN=iqn.2026-12.org.ferrosan:client-cpu
NQN=nqn.2026-12.org.ferrosan:client-cpu
scratch
OUT=bench/results/client-cpu-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/client-cpu.sh $(date -u +%FT%TZ): rounds=$ROUNDS workload=$WORKLOAD, RAM LUN"
    echo "# round bin door ios client_us_per_io daemon_us_per_io"
} >"$OUT"
for round in $(seq 1 "$ROUNDS"); do
    for bin in "$@"; do
        read -r PORT NVME_PORT < <(two_ports)
        start_daemon daemon "$PORT $NVME_PORT" "$bin" serve --listen "127.0.0.1:$PORT" \
            --nvme-listen "127.0.0.1:$NVME_PORT" --target "$IQN" --lun ram:1G \
            --control-socket "$WORK/ctl.sock"
        for door in iscsi nvme; do
            url="iscsi://127.0.0.1:$PORT/$IQN/0"
            [[ $door == nvme ]] && url="nvme+tcp://127.0.0.1:$NVME_PORT/$NQN/1"
            before=$(ticks "$PID")
            /usr/bin/time -f '%U %S' -o "$WORK/time" "$bin" bench --destructive --only "$WORKLOAD" \
                --ramp 0 --runtime 5 --out "$WORK/res" "$url" >"$WORK/bench.log" 2>&1 \
                || die "ferrosan bench failed on $door: $(tail -3 "$WORK/bench.log")"
            after=$(ticks "$PID")
            ios=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1]+"/results.json")); r=[r for r in j["rows"] if r["workload"]["id"]==sys.argv[2]][0]; assert not r.get("errors"), r["errors"]; print(round(r["iops"]*j["runtime_s"]))' "$WORK/res" "$WORKLOAD")
            ((ios > 0)) || die "$door: no I/O completed"
            read -r user sys <"$WORK/time"
            python3 - "$round" "$bin" "$door" "$ios" "$user" "$sys" "$before" "$after" "$HZ" >>"$OUT" <<'PY'
import sys
r, b, door, ios, user, sys_, before, after, hz = sys.argv[1:]
ios = int(ios)
client = (float(user) + float(sys_)) * 1e6 / ios
daemon = (int(after) - int(before)) / int(hz) * 1e6 / ios
print(f"{r} {b} {door} {ios} {client:.0f} {daemon:.0f}")
PY
        done
        stop_spawned "$PID"
    done
done
cat "$OUT"
