#!/usr/bin/env bash
# What a command pays for coming through the gateway that does not own its image: two ferrosan
# gateways (a, the owner; b, which ships the commands that need the medium to a, docs/RBD.md)
# export one RBD image of a fresh single-node cluster, and `ferrosan bench` reads through each
# portal in turn, the same workloads, interleaved rounds. Also gateway a's CPU while b is read
# (a runs the shipped reads) and b's own.
#
#   bench/rbd-shipping.sh
#   ROUNDS=3 WORKLOADS=randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16 bench/rbd-shipping.sh
#
# Env: ROUNDS (2), WORKLOADS (randread-4k-qd1,randread-4k-qd64: ids as `ferrosan bench --only`
# takes them), RUNTIME (5 s measured, after a 1 s ramp), SIZE (256M: the part of the 1 GiB image
# written first and read), PLACEMENT (shared, or split as in bench/rbd.sh), CEPH_DIR
# (/dev/shm/bench-rbd-shipping-PID), FERROSAN_BIN (this tree's release build).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-2}
WORKLOADS=${WORKLOADS:-randread-4k-qd1,randread-4k-qd64}
RUNTIME=${RUNTIME:-5}
SIZE=${SIZE:-256M}
BIN=${FERROSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan}
[[ -x $BIN ]] || (cd "$ROOT" && cargo build --release -q -p ferrosan)
FIO=$("$ROOT/bench/fio-libiscsi.sh")
WORK=$(mktemp -d /tmp/bench-rbd-shipping.XXXXXX)
CLUSTER=${CEPH_DIR:-/dev/shm/bench-rbd-shipping-$$}
source "$ROOT/bench/rbd-lib.sh"
declare -A GW_PID=()
cleanup() {
    for gw in "${!GW_PID[@]}"; do rbd_gateway_stop "$gw"; done
    rbd_cluster_stop "$CLUSTER"
    rm -rf "$WORK"
}
trap cleanup EXIT
rbd_cluster_start "$CLUSTER" 4 "${PLACEMENT:-shared}"
rbd create --size 1G rbd/shipping
"${CLIENT_CPUS[@]}" "$FIO" --name=fill --ioengine=rbd --pool=rbd --rbdname=shipping --clientname=admin \
    --rw=write --bs=4m --iodepth=8 --size="$SIZE" >/dev/null

IQN=iqn.2026-11.org.ferrosan:shipping
PORT_A=$(free_port)
PORT_B=$(free_port)
while [[ $PORT_B == "$PORT_A" ]]; do PORT_B=$(free_port); done
gateways_config "$IQN" rbd/shipping "$CEPH_CONF" "$PORT_A" "$PORT_B" >"$WORK/gateways.toml"
for gw in a b; do # a first: it takes the image's lock and owns it
    port=$PORT_A
    [[ $gw == b ]] && port=$PORT_B
    "${GATEWAY_CPUS[@]}" "$BIN" serve --config "$WORK/gateways.toml" --gateway "$gw" \
        --state-dir "$WORK/state-$gw" >"$WORK/$gw.log" 2>&1 &
    GW_PID[$gw]=$!
    wait_port "$port" "${GW_PID[$gw]}" 10 || { echo "gateway $gw did not start:" >&2; cat "$WORK/$gw.log" >&2; exit 1; }
    # (a listens before it has locked the image: b waits for that.)
    [[ $gw == b ]] || wait_for_line "$WORK/a.log" "$GATEWAY_A_OWNS" 10 || true
done
wait_for_line "$WORK/b.log" "$GATEWAY_B_SEES_A" 10 || { echo "b does not see a as the owner:" >&2; cat "$WORK/b.log" >&2; exit 1; }

echo "round portal         workload            IOPS   mean-us  p99-us | gateway CPU us/IO: a  b"
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        for gw in a b; do
            port=$PORT_A
            [[ $gw == b ]] && port=$PORT_B
            a0=$(ticks "${GW_PID[a]}") b0=$(ticks "${GW_PID[b]}")
            "${CLIENT_CPUS[@]}" "$BIN" bench --quick --only "$w" --size "$SIZE" --runtime "$RUNTIME" \
                --out "$WORK/out" "iscsi://127.0.0.1:$port/$IQN/0" >"$WORK/bench.log" 2>&1 ||
                { cat "$WORK/bench.log" >&2; exit 1; }
            a1=$(ticks "${GW_PID[a]}") b1=$(ticks "${GW_PID[b]}")
            python3 - "$WORK/out/results.json" "$r" "$gw" "$((a1 - a0))" "$((b1 - b0))" \
                "$(getconf CLK_TCK)" <<'PY'
import json, sys
path, r, gw, a, b, hz = sys.argv[1:7]
results = json.load(open(path))
row = results["rows"][0]
# The gateways' CPU covers the ramp too: per I/O over ramp + run at the measured rate.
ios = row["iops"] * (results["ramp_s"] + results["runtime_s"]) or 1
per = lambda ticks: int(ticks) / int(hz) * 1e6 / ios
name = "a (owner)" if gw == "a" else "b (ships)"
lat = row["latency_us"]
print(f"{r:5} {name:14} {row['workload']['id']:18} {row['iops']:7.0f} {lat['mean']:8.0f} {lat['p99']:7.0f}"
      f" | {per(a):6.1f} {per(b):5.1f}", flush=True)
PY
        done
    done
done
