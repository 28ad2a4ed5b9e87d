#!/usr/bin/env bash
# Two ferrosan builds serving one RBD image as a gateway (`serve --gateway a`: the image on a
# cluster connection of its own, as every gateway image is), one after the other on one
# single-node cluster, interleaved rounds with the order alternating; `ferrosan bench` (the
# first build's) measures IOPS and the daemon's CPU per I/O (its metrics) for each.
#
#   bench/rbd-gateway-ab.sh A_BIN B_BIN [ROUNDS]      # default 2 rounds
#
#   WORKLOADS  `ferrosan bench` ids (default seqread-1m-qd16,randread-4k-qd32,randwrite-4k-qd32)
# The image (1 GiB) is written whole first, so reads find data whichever build goes first.
# Results: bench/results/rbd-gateway-ab-DATE.txt, one line per build, round and workload.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=rbd-gateway-ab
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

A=${1:?usage: bench/rbd-gateway-ab.sh A_BIN B_BIN [ROUNDS]}
B=${2:?usage: bench/rbd-gateway-ab.sh A_BIN B_BIN [ROUNDS]}
cmp -s "$A" "$B" && die "$A and $B are the same build"
ROUNDS=${3:-2}
WORKLOADS=${WORKLOADS:-seqread-1m-qd16,randread-4k-qd32,randwrite-4k-qd32}
scratch /var/tmp/ferrosan-rbd-gateway-ab.XXXXXX
on_exit 'scripts/ceph-single-node.sh stop "$WORK/ceph" >/dev/null 2>&1'
scripts/ceph-single-node.sh start "$WORK/ceph" 4 >/dev/null 2>&1
export CEPH_CONF=$WORK/ceph/ceph.conf
rbd create --size 1G rbd/ab
rbd bench --io-type write --io-size 4M --io-threads 4 --io-total 1G --io-pattern seq rbd/ab >/dev/null
PORT=$(free_port)
METRICS=$(free_port)
gateways_config iqn.2026-12.org.ferrosan:ab rbd/ab "$CEPH_CONF" "$PORT" "$(free_port)" >"$WORK/gw.toml"
OUT=bench/results/rbd-gateway-ab-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/rbd-gateway-ab.sh $(date -u +%FT%TZ): A=$A B=$B rounds=$ROUNDS workloads=$WORKLOADS"
    echo "# checkout at $(git rev-parse --short HEAD); $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# build round workload iops daemon_cpu_us_per_io"
} >"$OUT"
# measure LABEL BIN ROUND: one daemon of BIN, the workloads, its lines into $OUT.
measure() {
    local label=$1 bin=$2 round=$3 out="$WORK/out-$1-$3"
    START_SECONDS=30 start_daemon a "$PORT" "$bin" serve --config "$WORK/gw.toml" --gateway a \
        --control-socket "$WORK/a.sock" --metrics-listen "127.0.0.1:$METRICS"
    sleep 3 # the gateway takes its image
    "$A" bench --destructive --runtime 8 --ramp 2 --only "$WORKLOADS" \
        --target-metrics "127.0.0.1:$METRICS" --out "$out" \
        "iscsi://127.0.0.1:$PORT/iqn.2026-12.org.ferrosan:ab/0" >"$WORK/bench.log" 2>&1 ||
        die "bench against $label failed: $(tail -5 "$WORK/bench.log")"
    python3 - "$out/results.json" "$label" "$round" >>"$OUT" <<'PY'
import json, sys
rows = []
def walk(x):
    if isinstance(x, dict):
        if isinstance(x.get("workload"), dict) and "iops" in x:
            rows.append(x)
        for v in x.values():
            walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
walk(json.load(open(sys.argv[1])))
if not rows or any(not r["iops"] for r in rows):
    sys.exit("a workload made no I/O")
for r in rows:
    cpu = r.get("target_cpu_us_per_io")
    print(sys.argv[2], sys.argv[3], r["workload"]["id"], "%.0f" % r["iops"], "-" if cpu is None else "%.1f" % cpu)
PY
    stop_spawned "$PID"
}
for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then order=(A B); else order=(B A); fi
    for label in "${order[@]}"; do
        bin=$A
        [[ $label == B ]] && bin=$B
        measure "$label" "$bin" "$r"
    done
done
log "results in $OUT"
cat "$OUT"
