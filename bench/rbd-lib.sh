# What bench/rbd.sh, bench/rbd-cpu.sh, bench/rbd-osd.sh and bench/rbd-shipping.sh share: sourced,
# not run (ROOT set). Ports and processes through scripts/lib/common.sh (free_port, wait_port,
# stop_pid), as the tests do.
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"

# rbd_cluster_start DIR OSD_GIB PLACEMENT: a fresh single-node cluster in DIR (on /dev/shm the
# OSD is in memory) as a benchmark needs it: PG_NUM placement groups (128 unless set: with the
# tests' 8 the OSD's PG log trimming takes most of its CPU after minutes of random writes) and
# an OSD_CACHE_MIB BlueStore cache (1024 unless set). Exports CEPH_CONF. PLACEMENT=split pins
# the cluster's daemons to the first half of the CPUs and sets CLIENT_CPUS (a command prefix)
# to the other half, for fio and the gateways; shared leaves every process on every CPU.
# Sets CLUSTER_PIDS (its daemons' pids).
rbd_cluster_start() {
    local dir=$1 gib=$2 placement=$3 half conf f
    CLIENT_CPUS=()
    CLUSTER_PIDS=()
    case $placement in
        shared) ;;
        split)
            half=$(($(nproc) / 2))
            ((half >= 1)) || { echo "PLACEMENT=split needs 2 CPUs or more" >&2; return 1; }
            CLIENT_CPUS=(taskset -c "$half-$(($(nproc) - 1))")
            ;;
        *) echo "PLACEMENT is shared or split, not $placement" >&2; return 1 ;;
    esac
    "$ROOT/scripts/ceph-single-node.sh" stop "$dir" 2>/dev/null || true
    rm -rf "$dir"
    conf=$(OSD_CACHE_MIB=${OSD_CACHE_MIB:-1024} PG_NUM=${PG_NUM:-128} \
        "$ROOT/scripts/ceph-single-node.sh" start "$dir" "$gib")
    export CEPH_CONF=${conf#CEPH_CONF=}
    for f in "$dir"/run/*.pid; do CLUSTER_PIDS+=("$(cat "$f")"); done
    if [[ $placement == split ]]; then
        for f in "${CLUSTER_PIDS[@]}"; do taskset -a -p -c "0-$((half - 1))" "$f" >/dev/null; done
        echo "[bench] placement: the cluster on CPUs 0-$((half - 1)), fio and the gateways on ${CLIENT_CPUS[2]}" >&2
    fi
}

# rbd_cluster_stop DIR: stops the cluster and removes DIR (on /dev/shm it holds the OSD's memory).
rbd_cluster_stop() {
    "$ROOT/scripts/ceph-single-node.sh" stop "$1" || true
    rm -rf "$1"
}

# rbd_fill FIO POOL IMAGE GIB: writes the whole image once (4 MiB writes through fio's rbd
# engine, on the client CPUs), so reads find data in every object.
rbd_fill() {
    "${CLIENT_CPUS[@]}" "$1" --name=fill --ioengine=rbd --pool="$2" --rbdname="$3" --clientname=admin \
        --rw=write --bs=4m --iodepth=8 --size="$4g" >/dev/null
}

# rbd_gateway NAME BIN STATE_DIR LOG LUN [CEPH_ARGS]: starts (CEPH_ARGS added to the caller's) `ferrosan serve` exporting LUN (an
# `rbd:POOL/IMAGE[,...]` spec) as iqn.2026-11.org.ferrosan:bench-rbd on a free loopback port,
# on the client CPUs; sets GW_PID[NAME] (an associative array the caller declares and whose
# gateways its cleanup stops) and GW_URL (the LUN's iscsi:// URL, colons escaped for fio).
rbd_gateway() {
    local name=$1 bin=$2 state=$3 log=$4 lun=$5 port url
    port=$(free_port)
    CEPH_ARGS="${CEPH_ARGS:-}${6:+ $6}" "${CLIENT_CPUS[@]}" "$bin" serve --listen "127.0.0.1:$port" \
        --target iqn.2026-11.org.ferrosan:bench-rbd --lun "$lun" --state-dir "$state" >"$log" 2>&1 &
    GW_PID[$name]=$!
    wait_port "$port" "${GW_PID[$name]}" 10 || { echo "gateway $name did not start:" >&2; cat "$log" >&2; return 1; }
    url=iscsi://127.0.0.1:$port/iqn.2026-11.org.ferrosan:bench-rbd/0
    GW_URL=${url//:/\\:} # fio splits file names at every unescaped colon
}

# rbd_gateway_stop NAME: stops that gateway (started by rbd_gateway) and forgets it.
rbd_gateway_stop() {
    stop_pid "${GW_PID[$1]:-}"
    unset "GW_PID[$1]"
}
