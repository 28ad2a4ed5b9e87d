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
# Results: bench/results/doors-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=doors
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/doors.sh BIN [ROUNDS] [WORKLOADS]}
ROUNDS=${2:-3}
WORKLOADS=${3:-randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64}
IQN=iqn.2026-11.org.ferrosan:doors
NQN=nqn.2026-11.org.ferrosan:doors
WORK=$(mktemp -d)
PID=""
cleanup() {
    stop_pid "$PID"
    rm -rf "$WORK"
    if [[ -n ${LUN_DIR:-} ]]; then rm -f "$LUN_DIR"/doors.img; fi
}
trap cleanup EXIT

lun=ram:1G
[[ -n ${LUN_DIR:-} ]] && lun=file:$LUN_DIR/doors.img,size=1G
PORT=$(free_port)
NVME_PORT=$(free_port)
while [[ $NVME_PORT == "$PORT" ]]; do NVME_PORT=$(free_port); done
"$BIN" serve --listen "127.0.0.1:$PORT" --nvme-listen "127.0.0.1:$NVME_PORT" --target "$IQN" \
    --lun "$lun" --control-socket "$WORK/ctl.sock" >"$WORK/daemon.log" 2>&1 &
PID=$!
wait_port "$PORT" "$PID" 10 && wait_port "$NVME_PORT" "$PID" 5 || die "the daemon did not start: $(cat "$WORK/daemon.log")"
# utime + stime of a process, in clock ticks.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)
OUT=bench/results/doors-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/doors.sh $(date -u +%FT%TZ): bin=$BIN rounds=$ROUNDS lun=$lun"
    echo "# round door workload iops cpu_us_per_io"
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
            "$BIN" bench --destructive --only "$w" --ramp 0 --runtime 5 --out "$res" "$(url "$door")" \
                >"$WORK/bench.log" 2>&1 || die "ferrosan bench failed on $door ($w): $(tail -3 "$WORK/bench.log")"
            after=$(ticks "$PID")
            python3 - "$res/results.json" "$round" "$door" "$w" "$((after - before))" "$HZ" >>"$OUT" <<'PY'
import json, sys
path, rnd, door, w, ticks, hz = sys.argv[1:]
results = json.load(open(path))
rows = [r for r in results["rows"] if r["workload"]["id"] == w]
if not rows or not rows[0].get("iops"):
    sys.exit(f"no result rows for {w} in {path}")
r = rows[0]
if r.get("errors"):
    sys.exit(f"{door} {w}: {r['errors']} I/O errors")
ios = r["iops"] * results["runtime_s"]
cpu_us = int(ticks) / int(hz) * 1e6
print(f"{rnd} {door} {w} {r['iops']:.0f} {cpu_us / ios:.2f}")
PY
        done
    done
done
python3 - "$OUT" <<'PY' | tee -a "$OUT"
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
for w in dict.fromkeys(r[2] for r in rows):
    def med(door, col):
        return statistics.median(float(r[col]) for r in rows if r[1] == door and r[2] == w)
    ratio = med("nvme", 3) / med("iscsi", 3)
    print(f"# {w}: iops iscsi {med('iscsi', 3):.0f} nvme {med('nvme', 3):.0f} (nvme/iscsi {ratio:.3f}); "
          f"daemon cpu us/io iscsi {med('iscsi', 4):.2f} nvme {med('nvme', 4):.2f}")
PY
log "results: $OUT"
