#!/usr/bin/env bash
# Where the CPU of one RBD I/O goes, by process: fio's rbd engine (fio + librbd in one process)
# against fio's libiscsi engine -> ferrosan -> librbd, on one image of a single-node cluster
# with its OSD on tmpfs (the disk out of the way: CPU is the limit), interleaved rounds. Per
# I/O: the client process (all its threads, /usr/bin/time), the gateway and the OSD
# (utime+stime from /proc). On a machine where all three share the cores, the throughput ratio
# follows the sums. Env: ROUNDS (2), RUNTIME (10), WORKLOADS (randread-4k-qd32; also e.g.
# read-1m-qd16,write-1m-qd16: RW-BS-qdDEPTH as in bench/rbd.sh), PLACEMENT (shared, or split:
# the cluster on the first half of the CPUs, fio and the gateway on the other, as in
# bench/rbd.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-10}
WORKLOADS=${WORKLOADS:-randread-4k-qd32}
FIO=$("$ROOT/bench/fio-libiscsi.sh")
BIN=$ROOT/target/release/ferrosan
[[ -x $BIN ]] || (cd "$ROOT" && cargo build --release -q -p ferrosan)
WORK=$(mktemp -d /tmp/bench-rbd-cpu.XXXXXX)
CEPH=$(mktemp -d /dev/shm/bench-rbd-cpu-ceph.XXXXXX)
GW=""
cleanup() {
    [[ -n $GW ]] && { kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; }
    "$ROOT/scripts/ceph-single-node.sh" stop "$CEPH" || true
    rm -rf "$WORK" "$CEPH"
}
trap cleanup EXIT
conf=$(OSD_CACHE_MIB=${OSD_CACHE_MIB:-1024} "$ROOT/scripts/ceph-single-node.sh" start "$CEPH" 6)
export CEPH_CONF=${conf#CEPH_CONF=}
CLIENT_CPUS=()
if [[ ${PLACEMENT:-shared} == split ]]; then
    half=$(($(nproc) / 2))
    for f in "$CEPH"/run/*.pid; do taskset -a -p -c "0-$((half - 1))" "$(cat "$f")" >/dev/null; done
    CLIENT_CPUS=(taskset -c "$half-$(($(nproc) - 1))")
fi
rbd create --size 2G rbd/cpu
"$FIO" --name=fill --ioengine=rbd --pool=rbd --rbdname=cpu --clientname=admin \
    --rw=write --bs=4m --iodepth=8 --size=2g >/dev/null
PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
IQN=iqn.2026-11.org.ferrosan:rbd-cpu
"${CLIENT_CPUS[@]}" "$BIN" serve --listen "127.0.0.1:$PORT" --target "$IQN" --lun rbd:rbd/cpu \
    --state-dir "$WORK/state" >"$WORK/gateway.log" 2>&1 &
GW=$!
for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.1; done
OSD=$(cat "$CEPH"/run/osd*.pid)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "round workload          path      IOPS | CPU per I/O (us): client  gateway  OSD  total"
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        read -r rw bs qd < <(echo "${w%%-*} ${w#*-}" | sed -E 's/-qd/ /')
        for path in librbd gateway; do
            if [[ $path == librbd ]]; then
                engine=(--ioengine=rbd --pool=rbd --rbdname=cpu --clientname=admin)
            else
                engine=(--ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio
                    "--filename=iscsi\\://127.0.0.1\\:$PORT/${IQN//:/\\:}/0")
            fi
            g0=$(ticks "$GW") o0=$(ticks "$OSD")
            /usr/bin/time -o "$WORK/time" -f "%U %S" "${CLIENT_CPUS[@]}" "$FIO" --name=x \
                --rw="$rw" --bs="$bs" --iodepth="$qd" "${engine[@]}" --size=2g --time_based \
                --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json \
                >"$WORK/out.json"
            g1=$(ticks "$GW") o1=$(ticks "$OSD")
            python3 - "$WORK/out.json" "$r" "$path" "$((g1 - g0))" "$((o1 - o0))" \
                "$(getconf CLK_TCK)" "$(cat "$WORK/time")" "$w" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
r, path, gw, osd, hz = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
user, system = (float(x) for x in sys.argv[7].split())
side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
ios = side["total_ios"]
per = lambda seconds: seconds / ios * 1e6
client, gateway, osd_us = per(user + system), per(gw / hz) if path == "gateway" else 0.0, per(osd / hz)
print(f"{r}     {sys.argv[8]:17s} {path:8s} {side['iops']:6.0f} | {client:6.1f} {gateway:8.1f} {osd_us:6.1f} {client + gateway + osd_us:6.1f}")
PY
        done
    done
done
