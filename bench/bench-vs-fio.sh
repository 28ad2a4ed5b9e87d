#!/usr/bin/env bash
# Does `ferrosan bench` measure what fio measures? Same target, same workload, same queue depth,
# interleaved rounds: fio (libaio, O_DIRECT) on a local file, and fio's libiscsi engine
# (bench/fio-libiscsi.sh) on that file exported by ferrosan and by tgt (aio backing store).
#
#   DEV=/var/tmp/disk.img bench/bench-vs-fio.sh        # needs root (tgtd); DEV must hold data
#
# Env: ROUNDS (3), RUNTIME (5 s measured, after a 2 s ramp), WORKLOADS (the three headline
# reads: randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16). Prints one line per round and
# target and workload, and a median ratio bench/fio per target and workload.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=bench-vs-fio
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"
DEV=${DEV:?set DEV to a file with real data (not sparse) on the disk under test}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
WORKLOADS=${WORKLOADS:-randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16}
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
FIO=$("$ROOT/bench/fio-libiscsi.sh")
[[ -x $BIN ]] || (cd "$ROOT" && cargo build --release -q -p ferrosan)
scratch /tmp/bench-vs-fio.XXXXXX

IQN=iqn.2026-11.org.ferrosan:benchcheck
read -r FPORT TPORT < <(two_ports)
start_daemon ferrosan "$FPORT" "$BIN" serve --listen "127.0.0.1:$FPORT" --target "$IQN" \
    --lun "file:$DEV"
CTL=$((1000 + TPORT % 30000))
start_daemon tgt "$TPORT" tgtd -f -C "$CTL" --iscsi "portal=127.0.0.1:$TPORT"
for _ in $(seq 50); do tgtadm -C $CTL --lld iscsi --op new --mode target --tid 1 -T $IQN 2>/dev/null && break; sleep 0.1; done
tgtadm -C $CTL --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 --bstype aio --backing-store "$DEV"
tgtadm -C $CTL --lld iscsi --op bind --mode target --tid 1 -I ALL

declare -A URL=(
    [local]=$DEV
    [ferrosan]=iscsi://127.0.0.1:$FPORT/$IQN/0
    [tgt-aio]=iscsi://127.0.0.1:$TPORT/$IQN/1
)
fio_args() { # workload -> rw bs iodepth
    case $1 in
    randread-4k-qd*) echo "randread 4k ${1##*qd}" ;;
    seqread-1m-qd*) echo "read 1m ${1##*qd}" ;;
    *) echo "unsupported workload $1" >&2; exit 1 ;;
    esac
}
run_fio() { # target workload -> "iops mbps mean_us"
    local t=$1 w=$2 rw bs qd engine file
    read -r rw bs qd < <(fio_args "$w")
    if [[ $t == local ]]; then
        engine=(--ioengine=libaio --direct=1) file=$DEV
    else
        engine=(--ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio)
        file=${URL[$t]//:/\\:}
    fi
    "$FIO" --name=x --rw=$rw --bs=$bs --iodepth=$qd "${engine[@]}" --filename="$file" \
        --time_based --runtime=$RUNTIME --ramp_time=2 --norandommap --randrepeat=0 \
        --output-format=json 2>/dev/null |
        python3 -c 'import json,sys;t=sys.stdin.read();j=json.loads(t[t.index("{"):])["jobs"][0]["read"];print(j["iops"], j["bw_bytes"]/1e6, j["lat_ns"]["mean"]/1e3)'
}
run_bench() { # target workload -> "iops mbps mean_us"
    "$BIN" bench --only "$2" --runtime "$RUNTIME" --out "$WORK/b" "${URL[$1]}" >/dev/null 2>&1
    python3 -c 'import json,sys;r=json.load(open(sys.argv[1]))["rows"][0];print(r["iops"], r["mb_per_s"], r["latency_us"]["mean"])' "$WORK/b/results.json"
}
echo "round target workload | fio: IOPS MB/s mean-us | bench: IOPS MB/s mean-us | bench/fio IOPS"
RESULTS=$WORK/ratios
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        for t in local ferrosan tgt-aio; do
            sync; echo 3 >/proc/sys/vm/drop_caches
            read -r fi fm fl < <(run_fio $t "$w")
            sync; echo 3 >/proc/sys/vm/drop_caches
            read -r bi bm bl < <(run_bench $t "$w")
            ratio=$(python3 -c "print(f'{$bi/$fi:.3f}')")
            printf '%s %-9s %-17s | %9.0f %7.1f %7.0f | %9.0f %7.1f %7.0f | %s\n' "$r" "$t" "$w" "$fi" "$fm" "$fl" "$bi" "$bm" "$bl" "$ratio"
            echo "$t $w $ratio" >>"$RESULTS"
        done
    done
done
echo "median bench/fio IOPS per target and workload:"
python3 - "$RESULTS" <<'PY'
import sys, statistics, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    t, w, r = line.split(); d[(t, w)].append(float(r))
for (t, w), rs in sorted(d.items()):
    print(f"  {t:<9} {w:<17} {statistics.median(rs):.3f}  (rounds: {', '.join(f'{x:.2f}' for x in rs)})")
PY
