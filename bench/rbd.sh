#!/usr/bin/env bash
# How much of librbd survives the gateway? fio's rbd engine on an RBD image (the physical limit
# a gateway is measured against) vs the same fio's libiscsi engine on that image exported by
# ferrosan (`--lun rbd:POOL/IMAGE`), interleaved rounds, the same client binary
# (bench/fio-libiscsi.sh builds one with both engines).
#
#   bench/rbd.sh                         # starts a single-node cluster, OSD on a file
#   CEPH_CONF=/etc/ceph/ceph.conf POOL=rbd bench/rbd.sh   # an existing cluster (creates and
#                                                           # removes image ferrosan-bench-$$)
#
# Env: ROUNDS (3), RUNTIME (10 s measured, after a 2 s ramp), IMAGE_GIB (2),
#      CEPH_DIR (target/bench-ceph: where the single-node cluster lives; /dev/shm/... puts the
#      OSD in memory, which takes the disk out and leaves CPU as the limit), OSD_CACHE_MIB
#      (1024; BlueStore's cache, 128 MiB in the tests' clusters), PG_NUM (128: the pool's placement
#      groups, as a production OSD holds; with the tests' 8 the OSD's PG log trimming takes most of
#      its CPU after a few minutes of random writes, scripts/ceph-single-node.sh), WORKLOADS (randread-4k-qd32,randwrite-4k-qd32,read-1m-qd16,write-1m-qd16),
#      PLACEMENT (shared: every process on every CPU; split: the cluster's daemons on the first
#      half of the CPUs, fio and the gateway on the other half — the cluster as on hosts of its
#      own, so a client's CPU is not taken from the OSD; hosts: every party as on a host of its
#      own — the gateway alone on the second half, the cluster and fio on the first half held
#      to fixed shares of it by CPU quotas, CLUSTER_SHARE 60 % and CLIENT_SHARE 40 %, root
#      needed; fio's rbd engine on the second half with its own CLIENT_SHARE, so that every
#      hop crosses CPUs as it would cross hosts (bench/rbd-lib.sh); split and hosts need this
#      script's own cluster).
# Two librbd references: fio's rbd engine as it comes (`librbd`: librbd's default write-around
# cache acknowledges a write once it is sent, before the OSD has it: a 4 KiB write at QD1 in
# ~90 us instead of ~490 us here), and with the librados settings the gateway itself runs
# (`librbd-gw`: rbd_cache=false, so a write is acknowledged when the OSD commits it, as the
# gateway acknowledges a SCSI WRITE with its write cache off; librados_thread_count as the
# gateway picks it). The first is what users compare with, the second isolates what the gateway
# adds. Two gateways, so that writes meet both at equal durability: `ferrosan` (write cache off,
# the default: a write answered once the OSD has it, like librbd-gw) and `ferrosan-wc`
# (`,write_cache`, WCE=1: a write answered once librbd has it, durable after SYNCHRONIZE CACHE,
# like fio's librbd with its write-around cache). Writes run on both, reads on `ferrosan` only.
# Prints a line per round and path and workload, then the median gateway/librbd ratios and the
# gateway's CPU per I/O (utime+stime of the ferrosan process over the run / I/Os).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
IMAGE_GIB=${IMAGE_GIB:-2}
WORKLOADS=${WORKLOADS:-randread-4k-qd32,randwrite-4k-qd32,read-1m-qd16,write-1m-qd16}
POOL=${POOL:-rbd}
IMAGE=ferrosan-bench-$$
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
FIO=$("$ROOT/bench/fio-libiscsi.sh")
[[ -x $BIN ]] || (cd "$ROOT" && cargo build --release -q -p ferrosan)
WORK=$(mktemp -d /tmp/bench-rbd.XXXXXX)
source "$ROOT/bench/rbd-lib.sh"
OWN_CLUSTER=""
declare -A GW_PID=() URL=()
cleanup() {
    for gw in "${!GW_PID[@]}"; do rbd_gateway_stop "$gw"; done
    rbd rm "$POOL/$IMAGE" >/dev/null 2>&1 || true
    [[ -z $OWN_CLUSTER ]] || rbd_cluster_stop "$OWN_CLUSTER"
    rm -rf "$WORK"
}
trap cleanup EXIT
log() { echo "[bench-rbd] $*" >&2; }

PLACEMENT=${PLACEMENT:-shared}
CLIENT_CPUS=()
LIBRBD_CPUS=()
GATEWAY_CPUS=()
if [[ -z ${CEPH_CONF:-} ]]; then
    OWN_CLUSTER=${CEPH_DIR:-$ROOT/target/bench-ceph}
    rbd_cluster_start "$OWN_CLUSTER" $((IMAGE_GIB * 2 + 2)) "$PLACEMENT"
elif [[ $PLACEMENT != shared ]]; then
    log "PLACEMENT=$PLACEMENT needs the script's own cluster (no CEPH_CONF)"
    exit 1
fi
rbd create --size "${IMAGE_GIB}G" "$POOL/$IMAGE"
log "filling $POOL/$IMAGE (${IMAGE_GIB} GiB) so reads find data"
rbd_fill "$FIO" "$POOL" "$IMAGE" "$IMAGE_GIB"

for gw in ferrosan ferrosan-wc; do # both open the image; librbd's exclusive lock moves with the writer
    options=""
    [[ $gw == ferrosan-wc ]] && options=,write_cache
    rbd_gateway "$gw" "$BIN" "$WORK/state-$gw" "$WORK/$gw.log" "rbd:$POOL/$IMAGE$options"
    URL[$gw]=$GW_URL
done
# What crates/store/src/rbd.rs sets on the gateway's connections (where ceph.conf is silent).
GATEWAY_CEPH_ARGS="--rbd_cache=false"
if (($(nproc) < 8)); then GATEWAY_CEPH_ARGS="$GATEWAY_CEPH_ARGS --librados_thread_count=1"; fi
log "librbd-gw runs with CEPH_ARGS=$GATEWAY_CEPH_ARGS"

fio_args() { # workload -> rw bs iodepth
    local w=$1
    echo "${w%%-*} ${w#*-}" | sed -E 's/-qd/ /' | awk '{print $1, $2, $3}'
}
cpu_ticks() { # path -> utime+stime of its gateway (0 for librbd)
    [[ -n ${GW_PID[$1]:-} ]] && awk '{print $14 + $15}' "/proc/${GW_PID[$1]}/stat" || echo 0
}
run() { # path workload -> "iops mbps mean_us cpu_us_per_io"
    local path=$1 w=$2 rw bs qd engine t0 t1
    read -r rw bs qd < <(fio_args "$w")
    local ceph_args=${CEPH_ARGS:-} cpus=("${CLIENT_CPUS[@]}")
    if [[ $path == librbd* ]]; then
        cpus=("${LIBRBD_CPUS[@]}")
        engine=(--ioengine=rbd --pool="$POOL" --rbdname="$IMAGE" --clientname=admin)
        if [[ $path == librbd-gw ]]; then ceph_args="$ceph_args $GATEWAY_CEPH_ARGS"; fi
    else
        engine=(--ioengine=libiscsi --initiator=iqn.2026-11.org.ferrosan:fio --filename="${URL[$path]}")
    fi
    t0=$(cpu_ticks "$path")
    CEPH_ARGS=$ceph_args "${cpus[@]}" "$FIO" --name=x --rw="$rw" --bs="$bs" --iodepth="$qd" "${engine[@]}" --size="${IMAGE_GIB}g" \
        --time_based --runtime="$RUNTIME" --ramp_time=2 --norandommap --randrepeat=0 \
        --output-format=json >"$WORK/out.json" 2>"$WORK/fio.err" || { cat "$WORK/fio.err" >&2; exit 1; }
    t1=$(cpu_ticks "$path")
    python3 - "$WORK/out.json" "$((t1 - t0))" "$(getconf CLK_TCK)" "$path" "$RUNTIME" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
ticks, hz, path, runtime = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
iops, mbps, lat = side["iops"], side["bw_bytes"] / 1e6, side["lat_ns"]["mean"] / 1e3
# The gateway's CPU covers the ramp too: per I/O over ramp + run at the measured rate.
ios = iops * (runtime + 2)
cpu = "-" if path.startswith("librbd") or ios == 0 else f"{ticks / hz * 1e6 / ios:.1f}"
print(f"{iops:.0f} {mbps:.1f} {lat:.0f} {cpu}")
PY
}

echo "round path     workload           |      IOPS    MB/s  mean-us | gateway CPU us/IO"
RESULTS=$WORK/results
for r in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        # Each round starts with another path: none always meets the OSD fresher than the rest.
        paths=(librbd librbd-gw ferrosan)
        [[ $w == *write* ]] && paths+=(ferrosan-wc)
        first=$(((r - 1) % ${#paths[@]}))
        for path in "${paths[@]:first}" "${paths[@]:0:first}"; do
            read -r iops mbps lat cpu < <(run "$path" "$w")
            printf '%s     %-8s %-18s | %9s %7s %8s | %s\n' "$r" "$path" "$w" "$iops" "$mbps" "$lat" "$cpu"
            echo "$path $w $iops $cpu" >>"$RESULTS"
        done
    done
done
# Ratios are taken within each round (the three paths run back to back) and then the median:
# the OSD drifts between rounds (random 4 KiB writes slow it down round after round as its
# small cache meets fragmented objects), which a ratio of medians would mix in.
echo "median over rounds of the per-round ratio, at equal durability: the bar (>= 0.9) is the"
echo "gateway / librbd as it comes (reads: ferrosan, writes: ferrosan-wc, both answering before the OSD"
echo "has a write); 'like' is ferrosan / librbd-gw (writes answered once the OSD has them):"
python3 - "$RESULTS" <<'PY'
import sys, statistics, collections
rows = [line.split() for line in open(sys.argv[1])]
iops = collections.defaultdict(list); cpu = collections.defaultdict(list)
for path, w, i, c in rows:
    iops[(path, w)].append(float(i))
    if c != "-": cpu[(path, w)].append(float(c))
med = statistics.median
def ratio(a, b, w):
    return med(x / y for x, y in zip(iops[(a, w)], iops[(b, w)]))
for w in dict.fromkeys(w for _, w, _, _ in rows):
    gw = "ferrosan-wc" if (("ferrosan-wc", w) in iops) else "ferrosan"
    line = (f"  {w:<18} librbd {med(iops[('librbd', w)]):7.0f}  librbd-gw {med(iops[('librbd-gw', w)]):7.0f}"
            f"  ferrosan {med(iops[('ferrosan', w)]):7.0f}")
    if gw == "ferrosan-wc":
        line += f"  ferrosan-wc {med(iops[(gw, w)]):7.0f}"
    line += f"  bar {gw}/librbd {ratio(gw, 'librbd', w):.2f}  like {ratio('ferrosan', 'librbd-gw', w):.2f}"
    line += "  gateway CPU us/IO " + " ".join(
        f"{p} {med(cpu[(p, w)]):.1f}" for p in ("ferrosan", "ferrosan-wc") if (p, w) in cpu)
    print(line)
PY
