#!/usr/bin/env bash
# A/B of gateway builds or librados settings on one cluster: per workload, fio's rbd engine
# (the reference) and then fio's libiscsi engine through each variant, a gateway started for
# each run, CPU per I/O by process (client, gateway, OSD) as in bench/rbd-cpu.sh.
#
#   VARIANTS="base:/tmp/ferrosan-old: new:target/release/ferrosan: nba:target/release/ferrosan:--rbd_non_blocking_aio=false" \
#       bench/rbd-ab.sh
#
# A variant is NAME:BINARY:CEPH_ARGS (CEPH_ARGS with commas for spaces; may be empty).
# Env: ROUNDS (2), RUNTIME (8 s), WORKLOADS (randread-4k-qd32,read-1m-qd16,write-1m-qd16),
# PLACEMENT (shared, or split: the cluster on CPU 0, fio and the gateway on CPU 1; see
# bench/rbd.sh). The cluster (OSD on tmpfs, 1 GiB BlueStore cache) is removed at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-8}
WORKLOADS=${WORKLOADS:-randread-4k-qd32,read-1m-qd16,write-1m-qd16}
PLACEMENT=${PLACEMENT:-shared}
: "${VARIANTS:?set VARIANTS=\"NAME:BINARY:CEPH_ARGS ...\"}"
FIO=$("$ROOT/bench/fio-libiscsi.sh")
WORK=$(mktemp -d /tmp/bench-rbd-ab.XXXXXX)
CEPH=$(mktemp -d /dev/shm/bench-rbd-ab-ceph.XXXXXX)
GW=""
cleanup() {
    [[ -n $GW ]] && { kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; }
    "$ROOT/scripts/ceph-single-node.sh" stop "$CEPH" || true
    rm -rf "$WORK" "$CEPH"
}
trap cleanup EXIT
conf=$(OSD_CACHE_MIB=1024 "$ROOT/scripts/ceph-single-node.sh" start "$CEPH" 6)
export CEPH_CONF=${conf#CEPH_CONF=}
CLIENT_CPUS=()
if [[ $PLACEMENT == split ]]; then
    for f in "$CEPH"/run/*.pid; do taskset -a -p -c 0 "$(cat "$f")" >/dev/null; done
    CLIENT_CPUS=(taskset -c 1)
fi
rbd create --size 2G rbd/ab
"${CLIENT_CPUS[@]}" "$FIO" --name=fill --ioengine=rbd --pool=rbd --rbdname=ab --clientname=admin \
    --rw=write --bs=4m --iodepth=8 --size=2g >/dev/null
OSD=$(cat "$CEPH"/run/osd*.pid)
IQN=iqn.2026-11.org.ferrosan:rbd-ab
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() { # label workload fio-engine-args... -> one line
    local label=$1 w=$2 rw bs qd g0=0 g1=0 o0 o1
    shift 2
    read -r rw bs qd < <(echo "${w%%-*} ${w#*-}" | sed -E 's/-qd/ /')
    [[ -n $GW ]] && g0=$(ticks "$GW")
    o0=$(ticks "$OSD")
    /usr/bin/time -o "$WORK/time" -f "%U %S" "${CLIENT_CPUS[@]}" "$FIO" --name=x --rw="$rw" \
        --bs="$bs" --iodepth="$qd" "$@" --size=2g --time_based --runtime="$RUNTIME" \
        --norandommap --randrepeat=0 --output-format=json >"$WORK/out.json"
    [[ -n $GW ]] && g1=$(ticks "$GW")
    o1=$(ticks "$OSD")
    python3 - "$WORK/out.json" "$label" "$w" "$((g1 - g0))" "$((o1 - o0))" \
        "$(getconf CLK_TCK)" "$(cat "$WORK/time")" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if job["read"]["total_ios"] > 0 else job["write"]
ios, hz = side["total_ios"], int(sys.argv[6])
user, system = (float(x) for x in sys.argv[7].split())
per = lambda seconds: seconds / ios * 1e6
client, gw, osd = per(user + system), per(int(sys.argv[4]) / hz), per(int(sys.argv[5]) / hz)
print(f"{sys.argv[2]:10s} {sys.argv[3]:17s} {side['iops']:7.0f} | client {client:7.1f}"
      f"  gateway {gw:7.1f}  OSD {osd:7.1f}  total {client + gw + osd:7.1f}", flush=True)
PY
}
echo "variant    workload             IOPS | CPU per I/O (us)"
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        GW=""
        measure librbd "$w" --ioengine=rbd --pool=rbd --rbdname=ab --clientname=admin
        for v in $VARIANTS; do
            IFS=: read -r name bin args <<<"$v"
            port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
            CEPH_ARGS="${args//,/ }" "${CLIENT_CPUS[@]}" "$bin" serve --listen "127.0.0.1:$port" \
                --target "$IQN" --lun rbd:rbd/ab --state-dir "$WORK/state-$name" \
                >"$WORK/$name.log" 2>&1 &
            GW=$!
            for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
            measure "$name" "$w" --ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio \
                "--filename=iscsi\\://127.0.0.1\\:$port/${IQN//:/\\:}/0"
            kill "$GW"
            wait "$GW" 2>/dev/null || true
            GW=""
        done
    done
done
