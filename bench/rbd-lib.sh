# What bench/rbd.sh, bench/rbd-cpu.sh, bench/rbd-osd.sh and bench/rbd-shipping.sh share: sourced,
# not run (ROOT set). Ports and processes through scripts/lib/common.sh (free_port, wait_port,
# stop_pid), as the tests do.
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"

# rbd_cluster_start DIR OSD_GIB PLACEMENT: a fresh single-node cluster in DIR (on /dev/shm the
# OSD is in memory) as a benchmark needs it: PG_NUM placement groups (128 unless set: with the
# tests' 8 the OSD's PG log trimming takes most of its CPU after minutes of random writes) and
# an OSD_CACHE_MIB BlueStore cache (1024 unless set). Exports CEPH_CONF. Sets CLIENT_CPUS and
# GATEWAY_CPUS (command prefixes for fio and for the gateways) by PLACEMENT:
# - shared: every process on every CPU (empty prefixes);
# - split: the cluster's daemons on the first half of the CPUs, fio and the gateways on the
#   other half (the cluster as on hosts of its own; the initiator shares the gateway's CPUs);
# - hosts: every party as on a host of its own: the gateways alone on the second half; the
#   cluster and fio on the first half, each held to a fixed share of it by a CPU quota
#   (CLUSTER_SHARE % of it, 60 unless set, and CLIENT_SHARE %, 40; cgroup v1 or v2, root), so
#   that neither gets CPU the other leaves: a client with less to do (fio's libiscsi engine
#   against its rbd engine) must not hand the OSD more CPU. Both paths' clients get the same
#   share, as librbd's client host and the initiator's host would be the same machine.
#   Every hop crosses CPUs, as it would cross hosts: fio's rbd engine, whose peer is the OSD,
#   runs on the second half (LIBRBD_CPUS, its own CLIENT_SHARE % there; the gateways serve
#   nothing meanwhile), fio's libiscsi engine, whose peer is a gateway, on the first. Loopback
#   TCP to a process on the sender's own CPU costs the sender less: an OSD whose librbd client
#   shared its CPU spent 1.01-1.16x less per 1 MiB read than for one elsewhere, in all 7
#   rounds of bench/rbd-client-place.sh (docs/PERFORMANCE.md, *Every hop across cores*).
# Sets LIBRBD_CPUS (the command prefix for fio's rbd engine: CLIENT_CPUS but under hosts) and
# CLUSTER_PIDS (its daemons' pids).
rbd_cluster_start() {
    local dir=$1 gib=$2 placement=$3 half conf f cluster_cg="" client_cg far_cg
    CLIENT_CPUS=()
    GATEWAY_CPUS=()
    CLUSTER_PIDS=()
    half=$(($(nproc) / 2))
    case $placement in
        shared) ;;
        split | hosts)
            ((half >= 1)) || { echo "PLACEMENT=$placement needs 2 CPUs or more" >&2; return 1; }
            CLIENT_CPUS=(taskset -c "$half-$(($(nproc) - 1))")
            GATEWAY_CPUS=("${CLIENT_CPUS[@]}")
            ;;
        *) echo "PLACEMENT is shared, split or hosts, not $placement" >&2; return 1 ;;
    esac
    if [[ $placement == hosts ]]; then
        cluster_cg=$(rbd_cgroup cluster "${CLUSTER_SHARE:-60}" "$half") || return 1
        client_cg=$(rbd_cgroup client "${CLIENT_SHARE:-40}" "$half") || return 1
        # (sh moves itself into the cgroup, then becomes the command.)
        # shellcheck disable=SC2016
        CLIENT_CPUS=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$client_cg" taskset -c "0-$((half - 1))")
        far_cg=$(rbd_cgroup client-far "${CLIENT_SHARE:-40}" "$(($(nproc) - half))") || return 1
        # shellcheck disable=SC2016
        LIBRBD_CPUS=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$far_cg" "${GATEWAY_CPUS[@]}")
    else
        LIBRBD_CPUS=("${CLIENT_CPUS[@]}")
    fi
    "$ROOT/scripts/ceph-single-node.sh" stop "$dir" 2>/dev/null || true
    rm -rf "$dir"
    conf=$(OSD_CACHE_MIB=${OSD_CACHE_MIB:-1024} PG_NUM=${PG_NUM:-128} \
        "$ROOT/scripts/ceph-single-node.sh" start "$dir" "$gib")
    export CEPH_CONF=${conf#CEPH_CONF=}
    for f in "$dir"/run/*.pid; do CLUSTER_PIDS+=("$(cat "$f")"); done
    if [[ $placement != shared ]]; then
        for f in "${CLUSTER_PIDS[@]}"; do
            taskset -a -p -c "0-$((half - 1))" "$f" >/dev/null
            [[ -z $cluster_cg ]] || echo "$f" >"$cluster_cg/cgroup.procs"
        done
    fi
    case $placement in
        split) echo "[bench] placement: the cluster on CPUs 0-$((half - 1)), fio and the gateways on ${CLIENT_CPUS[2]}" >&2 ;;
        hosts) echo "[bench] placement: the cluster (${CLUSTER_SHARE:-60} %) and fio's libiscsi engine (${CLIENT_SHARE:-40} %) on CPUs 0-$((half - 1)), the gateways alone on ${GATEWAY_CPUS[2]}, and fio's rbd engine there (${CLIENT_SHARE:-40} %) while the gateways serve nothing" >&2 ;;
    esac
}

# rbd_cgroup NAME PERCENT NCPUS: a CPU cgroup held to PERCENT % of NCPUS CPUs (10 ms periods,
# so a throttled party waits at most that long); prints its directory. Removed by
# rbd_cluster_stop once empty (named after this shell: $$).
rbd_cgroup() {
    local name=$1 percent=$2 ncpus=$3 period=10000 quota dir
    quota=$((period * ncpus * percent / 100))
    if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
        grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control ||
            echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
        dir=/sys/fs/cgroup/ferrosan-bench-$name-$$
        mkdir -p "$dir" && echo "$quota $period" >"$dir/cpu.max"
    elif [[ -d /sys/fs/cgroup/cpu ]]; then
        dir=/sys/fs/cgroup/cpu/ferrosan-bench-$name-$$
        mkdir -p "$dir" && echo "$period" >"$dir/cpu.cfs_period_us" && echo "$quota" >"$dir/cpu.cfs_quota_us"
    else
        echo "PLACEMENT=hosts needs a CPU cgroup controller (cgroup v1 or v2)" >&2
        return 1
    fi || { echo "cannot make CPU cgroup $dir (root needed)" >&2; return 1; }
    echo "$dir"
}

# rbd_cluster_stop DIR: stops the cluster and removes DIR (on /dev/shm it holds the OSD's memory).
rbd_cluster_stop() {
    "$ROOT/scripts/ceph-single-node.sh" stop "$1" || true
    rm -rf "$1"
    local dir
    for dir in /sys/fs/cgroup/ferrosan-bench-*-$$ /sys/fs/cgroup/cpu/ferrosan-bench-*-$$; do
        [[ -d $dir ]] && rmdir "$dir" 2>/dev/null || true
    done
}

# rbd_fill FIO POOL IMAGE GIB: writes the whole image once (4 MiB writes through fio's rbd
# engine, on the client CPUs), so reads find data in every object.
rbd_fill() {
    "${CLIENT_CPUS[@]}" "$1" --name=fill --ioengine=rbd --pool="$2" --rbdname="$3" --clientname=admin \
        --rw=write --bs=4m --iodepth=8 --size="$4g" >/dev/null
}

# rbd_gateway NAME BIN STATE_DIR LOG LUN [CEPH_ARGS]: starts (CEPH_ARGS added to the caller's) `ferrosan serve` exporting LUN (an
# `rbd:POOL/IMAGE[,...]` spec) as iqn.2026-11.org.ferrosan:bench-rbd on a free loopback port,
# on the gateway CPUs; sets GW_PID[NAME] (an associative array the caller declares and whose
# gateways its cleanup stops) and GW_URL (the LUN's iscsi:// URL, colons escaped for fio).
rbd_gateway() {
    local name=$1 bin=$2 state=$3 log=$4 lun=$5 port url
    port=$(free_port)
    CEPH_ARGS="${CEPH_ARGS:-}${6:+ $6}" "${GATEWAY_CPUS[@]}" "$bin" serve --listen "127.0.0.1:$port" \
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
