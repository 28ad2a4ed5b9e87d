#!/usr/bin/env bash
# Where the CPU of one RBD I/O goes, by process: fio's rbd engine (fio + librbd in one process)
# against fio's libiscsi engine -> ferrosan -> librbd, on one image of a single-node cluster
# with its OSD on tmpfs (the disk out of the way: CPU is the limit), interleaved rounds. Per
# I/O: the client process (all its threads, /usr/bin/time), the gateway and the OSD
# (utime+stime from /proc). On a machine where all three share the cores, the throughput ratio
# follows the sums. Also an A/B of gateway builds or librados settings on one cluster: each
# variant gets a gateway of its own for each run.
#
#   bench/rbd-cpu.sh
#   VARIANTS="old:/tmp/ferrosan-old: new:target/release/ferrosan: nba:target/release/ferrosan:--rbd_non_blocking_aio=false" \
#       WORKLOADS=randread-4k-qd32,read-1m-qd16 bench/rbd-cpu.sh
#
# Env: ROUNDS (2), RUNTIME (10 s), WORKLOADS (randread-4k-qd32; RW-BS-qdDEPTH as in
# bench/rbd.sh), VARIANTS (NAME:BINARY:CEPH_ARGS, CEPH_ARGS with commas for spaces and maybe
# empty; default one, `gateway`, this tree's release build), PLACEMENT (shared, or split: the
# cluster on the first half of the CPUs, fio and the gateways on the other, as in bench/rbd.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-10}
WORKLOADS=${WORKLOADS:-randread-4k-qd32}
BIN=$ROOT/target/release/ferrosan
VARIANTS=${VARIANTS:-gateway:$BIN:}
if [[ $VARIANTS == "gateway:$BIN:" && ! -x $BIN ]]; then
    (cd "$ROOT" && cargo build --release -q -p ferrosan)
fi
FIO=$("$ROOT/bench/fio-libiscsi.sh")
WORK=$(mktemp -d /tmp/bench-rbd-cpu.XXXXXX)
CEPH=$(mktemp -d /dev/shm/bench-rbd-cpu-ceph.XXXXXX)
GW=""
cleanup() {
    [[ -n $GW ]] && { kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; }
    "$ROOT/scripts/ceph-single-node.sh" stop "$CEPH" || true
    rm -rf "$WORK" "$CEPH"
}
trap cleanup EXIT
conf=$(OSD_CACHE_MIB=${OSD_CACHE_MIB:-1024} PG_NUM=${PG_NUM:-128} "$ROOT/scripts/ceph-single-node.sh" start "$CEPH" 6)
export CEPH_CONF=${conf#CEPH_CONF=}
CLIENT_CPUS=()
if [[ ${PLACEMENT:-shared} == split ]]; then
    half=$(($(nproc) / 2))
    for f in "$CEPH"/run/*.pid; do taskset -a -p -c "0-$((half - 1))" "$(cat "$f")" >/dev/null; done
    CLIENT_CPUS=(taskset -c "$half-$(($(nproc) - 1))")
fi
rbd create --size 2G rbd/cpu
"${CLIENT_CPUS[@]}" "$FIO" --name=fill --ioengine=rbd --pool=rbd --rbdname=cpu \
    --clientname=admin --rw=write --bs=4m --iodepth=8 --size=2g >/dev/null
OSD=$(cat "$CEPH"/run/osd*.pid)
IQN=iqn.2026-11.org.ferrosan:rbd-cpu
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() { # round path workload fio-engine-args... -> one line
    local r=$1 path=$2 w=$3 rw bs qd g0=0 g1=0 o0 o1
    shift 3
    read -r rw bs qd < <(echo "${w%%-*} ${w#*-}" | sed -E 's/-qd/ /')
    [[ -n $GW ]] && g0=$(ticks "$GW")
    o0=$(ticks "$OSD")
    /usr/bin/time -o "$WORK/time" -f "%U %S" "${CLIENT_CPUS[@]}" "$FIO" --name=x --rw="$rw" \
        --bs="$bs" --iodepth="$qd" "$@" --size=2g --time_based --runtime="$RUNTIME" \
        --norandommap --randrepeat=0 --output-format=json >"$WORK/out.json"
    [[ -n $GW ]] && g1=$(ticks "$GW")
    o1=$(ticks "$OSD")
    python3 - "$WORK/out.json" "$r" "$path" "$w" "$((g1 - g0))" "$((o1 - o0))" \
        "$(getconf CLK_TCK)" "$(cat "$WORK/time")" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
ios, hz = side["total_ios"], int(sys.argv[7])
user, system = (float(x) for x in sys.argv[8].split())
per = lambda seconds: seconds / ios * 1e6
client, gw, osd = per(user + system), per(int(sys.argv[5]) / hz), per(int(sys.argv[6]) / hz)
print(f"{sys.argv[2]:5s} {sys.argv[4]:17s} {sys.argv[3]:10s} {side['iops']:7.0f} |"
      f" {client:7.1f} {gw:8.1f} {osd:6.1f} {client + gw + osd:7.1f}", flush=True)
PY
}
echo "round workload          path         IOPS | CPU per I/O (us): client  gateway  OSD  total"
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        GW=""
        measure "$r" librbd "$w" --ioengine=rbd --pool=rbd --rbdname=cpu --clientname=admin
        for v in $VARIANTS; do
            IFS=: read -r name bin args <<<"$v"
            port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
            CEPH_ARGS="${args//,/ }" "${CLIENT_CPUS[@]}" "$bin" serve --listen "127.0.0.1:$port" \
                --target "$IQN" --lun rbd:rbd/cpu --state-dir "$WORK/state-$name" \
                >"$WORK/$name.log" 2>&1 &
            GW=$!
            for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
            measure "$r" "$name" "$w" --ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio \
                "--filename=iscsi\\://127.0.0.1\\:$port/${IQN//:/\\:}/0"
            kill "$GW"
            wait "$GW" 2>/dev/null || true
            GW=""
        done
    done
done
