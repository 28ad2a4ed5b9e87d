#!/usr/bin/env bash
# Where the CPU of one RBD I/O goes, by process: fio's rbd engine (fio + librbd in one process)
# against fio's libiscsi engine -> ferrosan -> librbd, on one image of a single-node cluster
# with its OSD on tmpfs (the disk out of the way: CPU is the limit), interleaved rounds. Per
# I/O: the client process (all its threads, /usr/bin/time), the gateway and the OSD
# (utime+stime from /proc), and how idle each CPU was during the run. On a machine where all
# three share the cores, the throughput ratio follows the sums; with PLACEMENT=split, the idle
# shares say whether a side was saturated. Also an A/B of gateway builds or librados settings on one cluster: each
# variant gets a gateway of its own for each run.
#
#   bench/rbd-cpu.sh
#   VARIANTS="old:/tmp/ferrosan-old: new:target/release/ferrosan: nba:target/release/ferrosan:--rbd_non_blocking_aio=false" \
#       WORKLOADS=randread-4k-qd32,read-1m-qd16 bench/rbd-cpu.sh
#
# Env: ROUNDS (2), RUNTIME (10 s), WORKLOADS (randread-4k-qd32; RW-BS-qdDEPTH as in
# bench/rbd.sh), VARIANTS (NAME:BINARY:CEPH_ARGS[:LUN_OPTIONS], CEPH_ARGS with commas for
# spaces and maybe empty, LUN_OPTIONS appended to the `--lun rbd:rbd/cpu` spec, e.g.
# `,write_cache`; default one, `gateway`, this tree's release build), PLACEMENT (shared, split
# or hosts, as in bench/rbd.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-10}
WORKLOADS=${WORKLOADS:-randread-4k-qd32}
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
VARIANTS=${VARIANTS:-gateway:$BIN:}
if [[ $VARIANTS == "gateway:$BIN:" && ! -x $BIN ]]; then
    (cd "$ROOT" && cargo build --release -q -p ferrosan)
fi
FIO=$("$ROOT/bench/fio-libiscsi.sh")
WORK=$(mktemp -d /tmp/bench-rbd-cpu.XXXXXX)
CEPH=$(mktemp -d /dev/shm/bench-rbd-cpu-ceph.XXXXXX)
source "$ROOT/bench/rbd-lib.sh"
declare -A GW_PID=()
GW=""
cleanup() {
    for name in "${!GW_PID[@]}"; do rbd_gateway_stop "$name"; done
    rbd_cluster_stop "$CEPH"
    rm -rf "$WORK"
}
trap cleanup EXIT
rbd_cluster_start "$CEPH" 6 "${PLACEMENT:-shared}"
rbd create --size 2G rbd/cpu
rbd_fill "$FIO" rbd cpu 2
OSD=$(cat "$CEPH"/run/osd*.pid)
# Per CPU: idle (+iowait) and all ticks so far, "cpu0:IDLE:ALL cpu1:...".
cpu_ticks() { awk '$1 ~ /^cpu[0-9]+$/ {all = 0; for (i = 2; i <= NF; i++) all += $i; printf "%s:%d:%d ", $1, $5 + $6, all}' /proc/stat; }
measure() { # round path workload fio-engine-args... -> one line
    local r=$1 path=$2 w=$3 rw bs qd g0=0 g1=0 o0 o1
    shift 3
    read -r rw bs qd < <(echo "${w%%-*} ${w#*-}" | sed -E 's/-qd/ /')
    [[ -n $GW ]] && g0=$(ticks "$GW")
    o0=$(ticks "$OSD")
    local c0 c1
    c0=$(cpu_ticks)
    local cpus=("${CLIENT_CPUS[@]}")
    [[ -n $GW ]] || cpus=("${LIBRBD_CPUS[@]}")
    /usr/bin/time -o "$WORK/time" -f "%U %S" "${cpus[@]}" "$FIO" --name=x --rw="$rw" \
        --bs="$bs" --iodepth="$qd" "$@" --size=2g --time_based --runtime="$RUNTIME" \
        --norandommap --randrepeat=0 --output-format=json >"$WORK/out.json"
    [[ -n $GW ]] && g1=$(ticks "$GW")
    o1=$(ticks "$OSD")
    c1=$(cpu_ticks)
    python3 - "$WORK/out.json" "$r" "$path" "$w" "$((g1 - g0))" "$((o1 - o0))" \
        "$(getconf CLK_TCK)" "$(cat "$WORK/time")" "$c0" "$c1" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
ios, hz = side["total_ios"], int(sys.argv[7])
user, system = (float(x) for x in sys.argv[8].split())
per = lambda seconds: seconds / ios * 1e6
client, gw, osd = per(user + system), per(int(sys.argv[5]) / hz), per(int(sys.argv[6]) / hz)
def cpus(text):
    return {c: (int(i), int(a)) for c, i, a in (x.split(":") for x in text.split())}
before, after = cpus(sys.argv[9]), cpus(sys.argv[10])
idle = " ".join(
    f"{100 * (after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]):3.0f}"
    for c in sorted(after, key=lambda c: int(c[3:]))
)
print(f"{sys.argv[2]:5s} {sys.argv[4]:17s} {sys.argv[3]:10s} {side['iops']:7.0f} |"
      f" {client:7.1f} {gw:8.1f} {osd:6.1f} {client + gw + osd:7.1f} | {idle}", flush=True)
PY
}
echo "round workload          path         IOPS | CPU per I/O (us): client  gateway  OSD  total | idle % per CPU"
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        GW=""
        measure "$r" librbd "$w" --ioengine=rbd --pool=rbd --rbdname=cpu --clientname=admin
        for v in $VARIANTS; do
            IFS=: read -r name bin args options <<<"$v"
            rbd_gateway "$name" "$bin" "$WORK/state-$name" "$WORK/$name.log" "rbd:rbd/cpu${options:-}" "${args//,/ }"
            GW=${GW_PID[$name]}
            measure "$r" "$name" "$w" --ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio \
                "--filename=$GW_URL"
            rbd_gateway_stop "$name"
            GW=""
        done
    done
done
