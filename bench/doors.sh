#!/usr/bin/env bash
# One device through both doors, side by side in one run: one ferrosan daemon serving one LUN
# over iSCSI and NVMe/TCP, the same client (`ferrosan bench`, an iscsi:// and an nvme+tcp://
# URL), the same workloads, interleaved rounds; reports IOPS and the daemon's CPU per I/O
# (from /proc/PID/stat around each run).
#
#   bench/doors.sh BIN [ROUNDS] [WORKLOADS]
#
#   WORKLOADS  comma-separated `ferrosan bench` ids (default: randread-4k-qd1,
#              randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64)
#   LUN_DIR=DIR  a 1 GiB file LUN in DIR instead of a RAM LUN (removed after)
#   CLIENT=BIN2  run `ferrosan bench` from BIN2 (another build's client against BIN's daemon)
# Results: bench/results/doors-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=doors
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/doors.sh BIN [ROUNDS] [WORKLOADS]}
ROUNDS=${2:-3}
CLIENT=${CLIENT:-$BIN}
WORKLOADS=${3:-randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64}
IQN=iqn.2026-11.org.ferrosan:doors
NQN=nqn.2026-11.org.ferrosan:doors
scratch

lun=ram:1G
if [[ -n ${LUN_DIR:-} ]]; then
    lun=file:$LUN_DIR/doors.img,size=1G
    on_exit 'rm -f "$LUN_DIR"/doors.img'
fi
read -r PORT NVME_PORT < <(two_ports)
start_daemon daemon "$PORT $NVME_PORT" "$BIN" serve --listen "127.0.0.1:$PORT" \
    --nvme-listen "127.0.0.1:$NVME_PORT" --target "$IQN" --lun "$lun" \
    --control-socket "$WORK/ctl.sock"
OUT=bench/results/doors-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/doors.sh $(date -u +%FT%TZ): bin=$BIN client=$CLIENT rounds=$ROUNDS lun=$lun"
    echo "# round door workload iops cpu_us_per_io client_cpu_us_per_io"
} >"$OUT"
url() { # DOOR
    if [[ $1 == iscsi ]]; then echo "iscsi://127.0.0.1:$PORT/$IQN/0"; else echo "nvme+tcp://127.0.0.1:$NVME_PORT/$NQN/1"; fi
}
for round in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        # Both doors back to back, the order alternating by round.
        doors=(iscsi nvme)
        ((round % 2 == 0)) && doors=(nvme iscsi)
        for door in "${doors[@]}"; do
            res=$WORK/$door-$round-$w
            before=$(ticks "$PID")
            "$CLIENT" bench --destructive --only "$w" --ramp 0 --runtime 5 --out "$res" "$(url "$door")" \
                >"$WORK/bench.log" 2>&1 || die "ferrosan bench failed on $door ($w): $(tail -3 "$WORK/bench.log")"
            after=$(ticks "$PID")
            python3 bench/side_by_side.py row "$res/results.json" "$round" "$door" "$w" \
                "$((after - before))" "$HZ" >>"$OUT"
        done
    done
done
python3 bench/side_by_side.py summary "$OUT" iscsi nvme | tee -a "$OUT"
log "results: $OUT"
