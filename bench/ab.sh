#!/usr/bin/env bash
# Two ferrosan builds side by side in one run: the same client (`ferrosan bench`, the newer
# build's), the same workloads, a RAM LUN each, interleaved rounds; reports IOPS and each
# daemon's CPU per I/O (from /proc/PID/stat around each round).
#
#   bench/ab.sh OLD_BIN NEW_BIN [ROUNDS] [WORKLOADS]
#
#   WORKLOADS  comma-separated `ferrosan bench` ids (default: randread-4k-qd1,
#              randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64)
#   LUN_DIR=DIR  each daemon serves a 1 GiB file LUN in DIR instead of a RAM LUN (on a disk's
#              filesystem: direct I/O through the io_uring ring); the files are removed after
#   DOOR=nvme    measure through NVMe/TCP (namespace 1 of the target's NQN) instead of iSCSI
#   CLIENT=fio   measure with fio's libiscsi engine (bench/fio-libiscsi.sh) instead of `ferrosan
#              bench`: fio sends each command as its own write, where `ferrosan bench` sends
#              its queue in bursts (receive coalescing sees the two differently); iSCSI only
# Results: bench/results/ab-DATE.txt (and the raw results.json of each round under target/).
# A change is judged against the commit before it in the same run, never against old files, and
# both builds come from one target directory and one worktree (docs/PERFORMANCE.md, "A/B of two
# builds").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=ab
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

OLD=${1:?usage: bench/ab.sh OLD_BIN NEW_BIN [ROUNDS] [WORKLOADS]}
NEW=${2:?usage: bench/ab.sh OLD_BIN NEW_BIN [ROUNDS] [WORKLOADS]}
# A build that reused the other's artifacts is the same file: nothing would be compared.
cmp -s "$OLD" "$NEW" && die "$OLD and $NEW are the same build (build both from one worktree: docs/PERFORMANCE.md)"
ROUNDS=${3:-3}
WORKLOADS=${4:-randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64}
scratch
[[ -z ${LUN_DIR:-} ]] || on_exit 'rm -f "$LUN_DIR"/ab-old.img "$LUN_DIR"/ab-new.img'

lun_spec() { # NAME
    if [[ -n ${LUN_DIR:-} ]]; then echo "file:$LUN_DIR/ab-$1.img,size=1G"; else echo ram:1G; fi
}
DOOR=${DOOR:-iscsi}
start() { # NAME BIN PORT (NVMe/TCP on PORT + 1)
    local nvme=()
    [[ $DOOR == nvme ]] && nvme=(--nvme-listen "127.0.0.1:$(($3 + 1))")
    start_daemon "$1" "$3" "$2" serve --listen "127.0.0.1:$3" "${nvme[@]}" \
        --target "iqn.2026-11.org.ferrosan:$1" --lun "$(lun_spec "$1")" \
        --control-socket "$WORK/$1.sock"
}
RUNTIME=5
CLIENT=${CLIENT:-bench}
[[ $CLIENT == fio && $DOOR != iscsi ]] && die "CLIENT=fio measures iSCSI only"
[[ $CLIENT == fio ]] && FIO=$(bench/fio-libiscsi.sh)
# IOPS of workload W through URL by the chosen client (RES: a directory for its output).
measure() { # W URL RES
    if [[ $CLIENT == bench ]]; then
        "$NEW" bench --destructive --only "$1" --ramp 0 --runtime "$RUNTIME" --out "$3" "$2" >/dev/null 2>&1 || return 1
        python3 - "$3/results.json" "$1" <<'PY'
import json, sys
path, w = sys.argv[1:]
rows = [r for r in json.load(open(path))["rows"] if r["workload"]["id"] == w]
if not rows or not rows[0].get("iops") or rows[0].get("errors"):
    sys.exit(f"no result rows for {w} in {path}")
print(rows[0]["iops"])
PY
    else
        # ferrosan bench's workload ids: (rand|seq)(read|write)-SIZE-qdDEPTH.
        [[ $1 =~ ^(rand|seq)(read|write)-([0-9]+[km])-qd([0-9]+)$ ]] || return 1
        local rw=${BASH_REMATCH[2]}
        [[ ${BASH_REMATCH[1]} == rand ]] && rw=rand$rw
        local target=${2#iscsi://}
        mkdir -p "$3"
        "$FIO" --name=ab --ioengine=libiscsi --filename="iscsi\\://${target//:/\\:}" --rw="$rw" \
            --bs="${BASH_REMATCH[3]}" --iodepth="${BASH_REMATCH[4]}" --runtime="$RUNTIME" --time_based \
            --output-format=json --output="$3/fio.json" >/dev/null 2>&1 || return 1
        python3 -c 'import json, sys; j = json.load(open(sys.argv[1]))["jobs"][0]; print(j["read"]["iops"] + j["write"]["iops"])' "$3/fio.json"
    fi
}

PORT_OLD=$(free_port)
start old "$OLD" "$PORT_OLD"
PID_OLD=$PID
PORT_NEW=$(free_port)
start new "$NEW" "$PORT_NEW"
PID_NEW=$PID
OUT=bench/results/ab-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/ab.sh $(date -u +%FT%TZ): old=$OLD new=$NEW rounds=$ROUNDS lun=$(lun_spec new) door=$DOOR client=$CLIENT"
    echo "# round side workload iops cpu_us_per_io"
} >"$OUT"
for round in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        # The two sides of a workload back to back, the order alternating by round, so
        # neither always runs first nor in a different minute of the machine's noise.
        sides=(old new)
        ((round % 2 == 0)) && sides=(new old)
        for side in "${sides[@]}"; do
            if [[ $side == old ]]; then port=$PORT_OLD pid=$PID_OLD; else port=$PORT_NEW pid=$PID_NEW; fi
            res=$WORK/$side-$round-$w
            before=$(ticks "$pid")
            # No ramp: the daemon's CPU between the two reads is the measured I/O's (and one
            # login's, the same on both sides).
            url="iscsi://127.0.0.1:$port/iqn.2026-11.org.ferrosan:$side/0"
            [[ $DOOR == nvme ]] && url="nvme+tcp://127.0.0.1:$((port + 1))/nqn.2026-11.org.ferrosan:$side/1"
            iops=$(measure "$w" "$url" "$res") || die "the client failed on $side ($w)"
            after=$(ticks "$pid")
            python3 - "$iops" "$round" "$side" "$w" "$((after - before))" "$HZ" "$RUNTIME" >>"$OUT" <<'PY'
import sys
iops, rnd, side, w, ticks, hz, runtime = sys.argv[1:]
if float(iops) <= 0:
    sys.exit(f"no I/O measured for {w} on {side}")
cpu_us = int(ticks) / int(hz) * 1e6
print(f"{rnd} {side} {w} {float(iops):.0f} {cpu_us / (float(iops) * int(runtime)):.2f}")
PY
        done
    done
done
python3 - "$OUT" <<'PY' | tee -a "$OUT"
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
for w in dict.fromkeys(r[2] for r in rows):
    def med(side, col):
        return statistics.median(float(r[col]) for r in rows if r[1] == side and r[2] == w)
    ratio = med("new", 3) / med("old", 3)
    print(f"# {w}: iops old {med('old', 3):.0f} new {med('new', 3):.0f} (new/old {ratio:.3f}); "
          f"cpu us/io old {med('old', 4):.2f} new {med('new', 4):.2f}")
PY
log "results: $OUT"
