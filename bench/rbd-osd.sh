#!/usr/bin/env bash
# What the OSD does for each client of one RBD image: 4 KiB random writes QD32 (or QD after
# `@`) from a sequence of paths, one 10 s run each, on a fresh single-node cluster with the
# cluster's daemons on CPU 0 and the clients on CPU 1 (bench/rbd.sh's PLACEMENT=split), and
# per run: fio's IOPS and latency, each CPU's busy share, the gateway's CPU per write, and the
# OSD's own counters (writes, their latency, BlueStore's KV syncs and commit latency).
#
#   bench/rbd-osd.sh                                  # PATHS="librbd wc librbd wc"
#   PATHS="wc librbd librbd-nocache@1024" bench/rbd-osd.sh
#   PERF=1 bench/rbd-osd.sh                           # also `perf record` the OSD 4 s per run
#   IOPS_LOG=1 bench/rbd-osd.sh                       # fio's IOPS per 0.5 s, per run
#   PG_NUM=8 bench/rbd-osd.sh                         # the tests' pool: see the OSD's PG log
#                                                     # trimming take over (default 128)
# Files go to target/rbd-osd-RUN-PATH* and the gateways' logs to target/wc.log, target/wt.log.
#
# Paths: librbd (fio's rbd engine as it comes: write-around cache), librbd-nocache
# (rbd_cache=false), librbd-wt (rbd_cache_policy=writethrough), wc (fio's libiscsi engine
# through ferrosan with `,write_cache`), wt (the same without it). The runs go in the order
# given, on one OSD that slows down as it takes random writes (docs/RBD.md, *Speed*): compare
# neighbours, and run the same sequence in another order before believing a difference.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PATHS=${PATHS:-librbd wc librbd wc}
FIO=$("$ROOT/bench/fio-libiscsi.sh")
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
[[ -x $BIN ]] || (cd "$ROOT" && cargo build --release -q -p ferrosan)
(($(nproc) >= 2)) || { echo "needs 2 CPUs" >&2; exit 1; }
WORK=$(mktemp -d /tmp/bench-rbd-osd.XXXXXX)
CLUSTER=/dev/shm/bench-rbd-osd-$$
source "$ROOT/bench/rbd-lib.sh"
declare -A GW_PID=() URL=()
cleanup() {
    for name in "${!GW_PID[@]}"; do rbd_gateway_stop "$name"; done
    rbd_cluster_stop "$CLUSTER"
    cp "$WORK"/*.log "$ROOT/target/" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
rbd_cluster_start "$CLUSTER" 6 split 2>/dev/null
OSD_PID=$(cat "$CLUSTER"/run/osd*.pid)
rbd create --size 2G rbd/img
rbd_fill "$FIO" rbd img 2
needed=" "
for path in $PATHS; do needed+="${path%@*} "; done
for gw in wc wt; do
    [[ $needed == *" $gw "* ]] || continue
    options=""
    [[ $gw == wc ]] && options=,write_cache
    rbd_gateway "$gw" "$BIN" "$WORK/state-$gw" "$WORK/$gw.log" "rbd:rbd/img$options"
    URL[$gw]=$GW_URL
done

run=0
for path in $PATHS; do
    run=$((run + 1))
    name=${path%@*} qd=32
    [[ $path == *@* ]] && qd=${path#*@}
    ceph tell osd.0 perf dump 2>/dev/null >"$WORK/p0.json"
    grep '^cpu[01] ' /proc/stat >"$WORK/s0"
    gw_pid=${GW_PID[$name]:-}
    [[ -n $gw_pid ]] && awk '{print $14+$15}' "/proc/$gw_pid/stat" >"$WORK/g0" || echo 0 >"$WORK/g0"
    (sleep 6; ceph tell osd.0 dump_ops_in_flight 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["num_ops"])' >"$WORK/inflight") &
    sampler=$!
    recorder=""
    if [[ -n ${PERF:-} ]]; then
        (sleep 3; perf record -g -o "$ROOT/target/rbd-osd-$run-$path.perf" -p "$OSD_PID" -- sleep 4 >/dev/null 2>&1) &
        recorder=$!
    fi
    ceph_args=""
    case $name in
        librbd-nocache) ceph_args="--rbd_cache=false" ;;
        librbd-wt) ceph_args="--rbd_cache_policy=writethrough" ;;
    esac
    if [[ $name == librbd* ]]; then
        engine=(--ioengine=rbd --pool=rbd --rbdname=img --clientname=admin)
    else
        engine=(--ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio --filename="${URL[$name]}")
    fi
    CEPH_ARGS=$ceph_args "${CLIENT_CPUS[@]}" "$FIO" --name=x --rw=randwrite --bs=4k --iodepth="$qd" "${engine[@]}" \
        --size=2g --time_based --runtime=10 --norandommap --randrepeat=0 ${IOPS_LOG:+--write_iops_log=$ROOT/target/rbd-osd-$run-$path --log_avg_msec=500} \
        --output-format=json >"$WORK/out.json"
    wait "$sampler"
    grep '^cpu[01] ' /proc/stat >"$WORK/s1"
    [[ -n $gw_pid ]] && awk '{print $14+$15}' "/proc/$gw_pid/stat" >"$WORK/g1" || echo 0 >"$WORK/g1"
    [[ -z $recorder ]] || wait "$recorder"
    ceph tell osd.0 perf dump 2>/dev/null >"$WORK/p1.json"
    python3 - "$WORK" "$path" "$(getconf CLK_TCK)" <<'PY'
import json, sys
work, path, hz = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(f"{work}/out.json").read()
job = json.loads(text[text.index("{"):])["jobs"][0]["write"]
a, b = (json.load(open(f"{work}/p{i}.json")) for i in (0, 1))
def busy(f):
    out = {}
    for line in open(f):
        x = line.split(); v = list(map(int, x[1:])); out[x[0]] = (sum(v) - v[3] - v[4], sum(v))
    return out
s0, s1 = busy(f"{work}/s0"), busy(f"{work}/s1")
cpus = " ".join(f"{c} {100 * (s1[c][0] - s0[c][0]) / (s1[c][1] - s0[c][1]):.0f}%" for c in ("cpu0", "cpu1"))
ios = job["total_ios"]
gw = (int(open(f"{work}/g1").read()) - int(open(f"{work}/g0").read())) / hz * 1e6 / max(ios, 1)
def avg(sec, key):
    x, y = a[sec][key], b[sec][key]
    n = y["avgcount"] - x["avgcount"]
    return n, ((y["sum"] - x["sum"]) / n * 1e3 if n else 0.0)
writes = b["osd"]["op_w"] - a["osd"]["op_w"]
syncs, sync_ms = avg("bluestore", "kv_sync_lat")
_, commit_ms = avg("bluestore", "commit_lat")
_, op_ms = avg("osd", "op_w_latency")
print(f"{path:<22} {job['iops']:7.0f} IOPS  {job['lat_ns']['mean'] / 1e6:5.1f} ms  {cpus}"
      f"  gateway {gw:5.1f} us/write | OSD: {writes} writes, {op_ms:.1f} ms each,"
      f" {open(f'{work}/inflight').read().strip()} in flight, {syncs} KV syncs of {sync_ms:.2f} ms,"
      f" commit {commit_ms:.2f} ms")
PY
done
