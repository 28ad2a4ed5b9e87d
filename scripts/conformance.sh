#!/usr/bin/env bash
# Run libiscsi's conformance suite (iscsi-test-cu --dataloss, every test it
# lists: families ALL, SCSI, iSCSI and LINUX, 615 tests in libiscsi 1.19)
# against ferrosan and/or tgt on loopback.
#
#   scripts/conformance.sh [ferrosan|tgt|both]     (default: ferrosan)
#
# Runs:  ferrosan-ram   ferrosan, RAM LUN of 1 GiB
#        ferrosan-file  ferrosan, thin (sparse) file LUN of 1 GiB on tmpfs
#        ferrosan-disk  ferrosan, thin file LUN of 1 GiB on the disk filesystem under target/,
#                       cache = "page", write_stall_us = 0: every write, flush and uncached
#                       read runs on the blocking pool (the deferred path; tmpfs LUNs never
#                       take it)
#        ferrosan-direct  the same file, cache = "direct": reads, writes and flushes on the
#                       workers' io_uring rings (O_DIRECT), the default for disk files
#        ferrosan-rbd   ferrosan, a 1 GiB Ceph RBD image (librbd, asynchronous) in a single-node
#                       cluster this script starts and stops (scripts/ceph-single-node.sh, OSD
#                       on a file in the work directory); reported as skipped, not run, when
#                       the Ceph packages are not installed
#        ferrosan-rbd-wc  another 1 GiB image of that cluster with its write cache on
#                       (`,write_cache`: a write answered once librbd has it, docs/RBD.md)
#        ferrosan-rbd-gateways  two ferrosan gateways exporting one 1 GiB image of that cluster
#                       (docs/RBD.md): the suite through gateway a's portal, gateway b's as the
#                       second path of the MultipathIO tests (b ships to the owner a)
#        tgt-file       tgt (tgtd), 1 GiB sparse file LUN on tmpfs (baseline)
#        The runs run side by side, each with its own LUN or image and daemons (the RBD runs
#        once the cluster, started meanwhile, is up): each waits on its initiator, its disk or
#        the cluster far more than it computes.
# Results: target/conformance/<run>.tsv (test <TAB> pass|skip|fail <TAB> reason),
#          <run>.out / <run>.err (raw tool output), <run>.daemon.log.
# CUnit reports self-skipped tests as "passed"; scripts/lib/parse-cu.awk
# separates real passes, skips and failures (see docs/CONFORMANCE.md).
# Exit status: non-zero if any ferrosan test failed (or a tgt run broke).
#
# Environment: CONFORMANCE_TIMEOUT  seconds per run (default 900)
#              CONFORMANCE_RUNS     the ferrosan runs to make, comma-separated without the
#                                   "ferrosan-" (e.g. "ram"; default: every one above)
#              FERROSAN_BIN         prebuilt daemon (default: cargo build --release)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=conformance
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
export PATH="$PATH:/usr/sbin:/sbin"

MODE=${1:-ferrosan}
case $MODE in ferrosan | tgt | both) ;; *) die "usage: $0 [ferrosan|tgt|both]" ;; esac
RUN_TIMEOUT=${CONFORMANCE_TIMEOUT:-900}
WANTED=${CONFORMANCE_RUNS:-ram,file,disk,direct,rbd,rbd-wc,rbd-gateways}
# wanted RUN: whether ferrosan's run RUN (ferrosan-RUN) is asked for.
wanted() { [[ ,$WANTED, == *,${1#ferrosan-},* ]]; }
OUT=$ROOT/target/conformance
IQN=iqn.2024-01.dev.ferrosan:conformance
INIT1=iqn.2024-01.dev.ferrosan:initiator-1
INIT2=iqn.2024-01.dev.ferrosan:initiator-2

DAEMON_PID=""
GATEWAY_B_PID=""
WORK=""
CEPH_DIR=""
cleanup() {
    local rc=$? pid
    stop_pid "$DAEMON_PID" "${DAEMON_GRACE:-50}"
    DAEMON_PID=""
    stop_pid "$GATEWAY_B_PID" 50
    GATEWAY_B_PID=""
    # The daemons and tools of the runs made side by side (`start_side`), should one be left.
    if [[ -n $WORK && -f $WORK/side-pids ]]; then
        for pid in $(cat "$WORK/side-pids"); do stop_pid "$pid" 50; done
    fi
    [[ -n $CEPH_DIR ]] && scripts/ceph-single-node.sh stop "$CEPH_DIR"
    [[ -n $WORK ]] && rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ensure_deps
mkdir -p "$OUT"
# tmpfs when there is one: a thin 1 GiB file costs only what the tests write.
if [[ -d /dev/shm && -w /dev/shm ]]; then
    WORK=$(mktemp -d /dev/shm/ferrosan-conformance.XXXXXX)
else
    WORK=$(mktemp -d)
fi
iscsi-test-cu --list >"$OUT/tests.list"
TOTAL_LISTED=$(awk -F. 'NF == 3' "$OUT/tests.list" | wc -l)

# start_ferrosan RUN LUNSPEC: start the daemon on a free port; sets PORT, LUN.
# A LUNSPEC of config-CACHE:FILE names a device file and its cache mode: the daemon runs from
# a config file instead.
start_ferrosan() {
    local run=$1 lunspec=$2 rc=0 args
    PORT=$(free_port)
    LUN=0
    if [[ $lunspec == config-* ]]; then
        local cache=${lunspec#config-}
        disk_config "${cache#*:}" "${cache%%:*}" >"$OUT/$run.toml"
        args=(--config "$OUT/$run.toml")
    else
        args=(--listen "127.0.0.1:$PORT" --target "$IQN" --lun "$lunspec")
    fi
    # Reservations a test makes durable (APTPL) stay with this run, not in /var/lib/ferrosan.
    args+=(--state-dir "$WORK/state-$run")
    log "$run: starting $FERROSAN_BIN serve ${args[*]}"
    "$FERROSAN_BIN" serve "${args[@]}" </dev/null >"$OUT/$run.daemon.log" 2>&1 &
    DAEMON_PID=$!
    DAEMON_GRACE=50
    wait_port "$PORT" "$DAEMON_PID" 10 || rc=$?
    if ((rc != 0)); then
        if ((rc == 2)); then log "$run: ferrosan exited before listening on 127.0.0.1:$PORT"
        else log "$run: ferrosan did not accept connections on 127.0.0.1:$PORT within 10 s"; fi
        log "$run: last lines of the daemon's output ($OUT/$run.daemon.log):"
        tail_indented "$OUT/$run.daemon.log" 20
        stop_pid "$DAEMON_PID"; DAEMON_PID=""
        return 1
    fi
}

# disk_config FILE CACHE: a disk run's config (portal $PORT, target $IQN, LUN 0 = FILE with
# cache = CACHE).
disk_config() {
    cat <<CONFIG
[limits]
write_stall_us = 0

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$PORT"]

[[device]]
name = "disk"
store = "file"
path = "$1"
size = "1G"
thin = true
cache = "$2"

[[target]]
iqn = "$IQN"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "disk" } ]
CONFIG
}

# start_gateways RUN IMAGE: gateways a (DAEMON_PID, portal PORT, the owner: it starts first)
# and b (GATEWAY_B_PID, portal PORT2) exporting rbd IMAGE of $CEPH_CONF as LUN 0 of $IQN;
# b ships the commands that need the medium to a.
start_gateways() {
    local run=$1 image=$2 g port rc
    PORT=$(free_port)
    PORT2=$(free_port)
    while [[ $PORT2 == "$PORT" ]]; do PORT2=$(free_port); done
    LUN=0
    gateways_config "$IQN" "$image" "$CEPH_CONF" "$PORT" "$PORT2" >"$OUT/$run.toml"
    for g in a b; do
        port=$PORT
        [[ $g == b ]] && port=$PORT2
        log "$run: starting gateway $g: $FERROSAN_BIN serve --config $OUT/$run.toml --gateway $g"
        "$FERROSAN_BIN" serve --config "$OUT/$run.toml" --gateway "$g" \
            --state-dir "$WORK/state-$run-$g" --control-socket "$WORK/$run-$g.sock" \
            </dev/null >"$OUT/$run.$g.daemon.log" 2>&1 &
        if [[ $g == a ]]; then DAEMON_PID=$!; else GATEWAY_B_PID=$!; fi
        rc=0
        wait_port "$port" "$!" 20 || rc=$?
        if ((rc != 0)); then
            log "$run: gateway $g did not listen on 127.0.0.1:$port; its output ($OUT/$run.$g.daemon.log):"
            tail_indented "$OUT/$run.$g.daemon.log" 20
            return 1
        fi
        # a listens before it has locked and recorded the image: b, started before that, would
        # find no owner (standby until its follow loop looks, a second later).
        if [[ $g == a ]]; then
            wait_for_line "$OUT/$run.a.daemon.log" "$GATEWAY_A_OWNS" 10 || true
        fi
    done
    wait_for_line "$OUT/$run.b.daemon.log" "$GATEWAY_B_SEES_A" 10 && return 0
    log "$run: gateway b does not see a as the owner after 10 s; its output:"
    tail_indented "$OUT/$run.b.daemon.log" 20
    return 1
}

# start_tgt RUN FILE: tgtd on a free port with a private control socket.
start_tgt() {
    local run=$1 file=$2 rc=0 i
    PORT=$(free_port)
    LUN=1 # tgt's LUN 0 is its controller LU
    # -C N selects tgtd's management socket (abstract namespace, suffix N), so
    # we never talk to (or clash with) a system tgtd.
    CTL=$((1000 + PORT % 30000)) # tgtd accepts -C up to 32767
    log "$run: starting tgtd -f -C $CTL --iscsi portal=127.0.0.1:$PORT"
    tgtd -f -C "$CTL" --iscsi "portal=127.0.0.1:$PORT" </dev/null >"$OUT/$run.daemon.log" 2>&1 &
    DAEMON_PID=$!
    DAEMON_GRACE=0
    wait_port "$PORT" "$DAEMON_PID" 10 || rc=$?
    if ((rc != 0)); then
        log "$run: tgtd did not come up; its output:"
        tail_indented "$OUT/$run.daemon.log" 20
        stop_daemon 0
        return 1
    fi
    for ((i = 0; i < 50; i++)); do # the management socket may lag the portal
        tgtadm -C "$CTL" --lld iscsi --op new --mode target --tid 1 -T "$IQN" 2>/dev/null && break
        sleep 0.1
    done
    tgtadm -C "$CTL" --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 --backing-store "$file" &&
        tgtadm -C "$CTL" --lld iscsi --op bind --mode target --tid 1 -I ALL || {
        log "$run: configuring tgtd with tgtadm failed"
        stop_daemon 0
        return 1
    }
}

declare -A R_PASS R_FAIL R_SKIP
RUNS=()
# run_suite RUN [URL2]: run the tool against $PORT/$LUN (and URL2, a second path to the same
# LU for the MultipathIO tests), parse, summarise.
run_suite() {
    suite "$@"
    finish_run "$1" "$(cut -d' ' -f1 "$OUT/$1.meta")" "$(cut -d' ' -f2 "$OUT/$1.meta")"
}

# suite RUN [URL2]: run_suite's run and parse, its seconds and exit status in $OUT/RUN.meta.
suite() {
    local run=$1 url="iscsi://127.0.0.1:$PORT/$IQN/$LUN" t0 t1 rc=0
    local urls=("$url" ${2:+"$2"})
    log "$run: iscsi-test-cu --dataloss ${urls[*]} (timeout ${RUN_TIMEOUT}s)"
    t0=$(date +%s)
    # In the background, its PID where the cleanup finds it: a run stopped midway (the test
    # command interrupted) must not leave the tool retrying a daemon that is gone.
    timeout -k 10 "$RUN_TIMEOUT" iscsi-test-cu --dataloss -i "$INIT1" -I "$INIT2" "${urls[@]}" \
        </dev/null >"$OUT/$run.out" 2>"$OUT/$run.err" &
    local tool=$!
    echo "$tool" >>"$WORK/side-pids"
    wait "$tool" || rc=$?
    t1=$(date +%s)
    ((rc == 124 || rc == 137)) && log "$run: TIMED OUT after ${RUN_TIMEOUT}s; unfinished tests count as failed"
    awk -v LIST="$OUT/tests.list" -f scripts/lib/parse-cu.awk "$OUT/$run.out" >"$OUT/$run.tsv"
    echo "$((t1 - t0)) $rc" >"$OUT/$run.meta"
}

# finish_run RUN SECONDS RC: count the .tsv, print the summary line.
finish_run() {
    local run=$1 secs=$2 rc=$3 p f s
    p=$(awk -F'\t' '$2 == "pass"' "$OUT/$run.tsv" | wc -l)
    f=$(awk -F'\t' '$2 == "fail"' "$OUT/$run.tsv" | wc -l)
    s=$(awk -F'\t' '$2 == "skip"' "$OUT/$run.tsv" | wc -l)
    R_PASS[$run]=$p R_FAIL[$run]=$f R_SKIP[$run]=$s
    RUNS+=("$run")
    if ((p + s == 0)) && [[ $rc != - ]]; then
        log "$run: no test ran (iscsi-test-cu exit $rc); its stderr ($OUT/$run.err):"
        tail_indented "$OUT/$run.err" 10
    elif ((f > 0 && p + s > 0)); then
        { awk -F'\t' '$2 == "fail" { print "    FAIL " $1 ": " $3 }' "$OUT/$run.tsv" | head -n 40 >&2; } || true
        ((f <= 40)) || log "$run: ... $((f - 40)) more failures in $OUT/$run.tsv"
    fi
    echo "conformance $run: $p passed, $f failed, $s skipped (of $TOTAL_LISTED, ${secs}s)"
}

# A run whose daemon never came up: every listed test failed.
not_run() {
    local run=$1 why=$2
    awk -F. -v why="$why" 'NF == 3 { print $0 "\tfail\t" why }' "$OUT/tests.list" >"$OUT/$run.tsv"
    finish_run "$run" 0 -
}

# tgtd -f ignores SIGTERM (it only leaves on SIGKILL), and keeps no state we
# need, so it gets no grace period.
stop_daemon() { stop_pid "$DAEMON_PID" "${1:-50}"; DAEMON_PID=""; }

# rbd_run RUN: one RBD run, its daemons its own (their PIDs in $WORK/side-pids for the
# cleanup): the suite's results in $OUT/RUN.tsv and .meta, or a not-run line in .notrun.
rbd_run() {
    local run=$1
    DAEMON_PID="" GATEWAY_B_PID=""
    case $run in
        ferrosan-rbd)
            rbd create --size 1G rbd/conformance 2>>"$OUT/$run.ceph.log" &&
                start_ferrosan "$run" rbd:rbd/conformance ;;
        ferrosan-rbd-wc)
            rbd create --size 1G rbd/conformance-wc 2>>"$OUT/$run.ceph.log" &&
                start_ferrosan "$run" rbd:rbd/conformance-wc,write_cache ;;
        ferrosan-rbd-gateways)
            rbd create --size 1G rbd/gateways 2>>"$OUT/$run.ceph.log" &&
                start_gateways "$run" rbd/gateways ;;
    esac
    local started=$?
    echo "$DAEMON_PID $GATEWAY_B_PID" >>"$WORK/side-pids"
    if ((started != 0)); then
        echo "a daemon or the image did not start (see $run*.daemon.log, $run.ceph.log)" >"$OUT/$run.notrun"
    elif [[ $run == ferrosan-rbd-gateways ]]; then
        suite "$run" "iscsi://127.0.0.1:$PORT2/$IQN/$LUN"
    else
        suite "$run"
    fi
    stop_pid "$GATEWAY_B_PID" 50
    stop_daemon
}

# local_run RUN LUNSPEC: one run on this host's memory or disk, its daemon its own (its PID in
# $WORK/side-pids for the cleanup): results in $OUT/RUN.tsv and .meta, or a not-run line in
# .notrun.
local_run() {
    local run=$1 spec=$2
    DAEMON_PID=""
    if start_ferrosan "$run" "$spec"; then
        echo "$DAEMON_PID" >>"$WORK/side-pids"
        suite "$run"
    else
        echo "daemon did not start (see $run.daemon.log)" >"$OUT/$run.notrun"
    fi
    stop_daemon
}

# start_side RUN...: the runs asked for, each in the background (their PIDs added to SIDE):
# each waits on its initiator's round trips, its disk or the cluster far more than it
# computes, so seven take little more than the longest.
SIDE=()
start_side() {
    local run
    for run in "$@"; do
        wanted "$run" || continue
        rm -f "$OUT/$run.meta" "$OUT/$run.notrun"
        case $run in
            ferrosan-rbd*) rbd_run "$run" & ;;
            *) local_run "$run" "${LOCAL_SPEC[$run]}" & ;;
        esac
        SIDE+=("$!")
    done
}

# finish_side RUN...: wait for the runs started, then their results in order.
finish_side() {
    local run pid
    for pid in "${SIDE[@]}"; do wait "$pid" || true; done
    SIDE=()
    # All ended: their PIDs are no longer ours to signal.
    : >"$WORK/side-pids"
    for run in "$@"; do
        wanted "$run" || continue
        if [[ -f $OUT/$run.meta ]]; then
            finish_run "$run" "$(cut -d' ' -f1 "$OUT/$run.meta")" "$(cut -d' ' -f2 "$OUT/$run.meta")"
        else
            not_run "$run" "$(cat "$OUT/$run.notrun" 2>/dev/null || echo "it did not finish")"
        fi
    done
}

# start_ceph: the single-node cluster of the RBD runs, in the background while the local runs
# run (CEPH_PID; its CEPH_CONF line in $WORK/ceph.out).
start_ceph() {
    CEPH_DIR=$WORK/ceph
    scripts/ceph-single-node.sh start "$CEPH_DIR" 4 >"$WORK/ceph.out" 2>"$OUT/ferrosan-rbd.ceph.log" &
    CEPH_PID=$!
}

# rbd_runs: once the cluster is up, the three RBD runs beside the local ones; or each marked
# not run with the cluster's log.
rbd_runs() {
    local run=ferrosan-rbd conf r
    if wait "$CEPH_PID" && conf=$(cat "$WORK/ceph.out") && [[ $conf == CEPH_CONF=* ]]; then
        export CEPH_CONF=${conf#CEPH_CONF=}
        start_side ferrosan-rbd ferrosan-rbd-wc ferrosan-rbd-gateways
        return 0
    fi
    log "$run: the Ceph test cluster did not start; its log ($OUT/$run.ceph.log):"
    tail_indented "$OUT/$run.ceph.log" 20
    for r in "$run" "$run-wc" "$run-gateways"; do
        wanted "$r" && echo "the Ceph test cluster did not start (see $run.ceph.log)" >"$OUT/$r.notrun"
    done
}

if [[ $MODE == ferrosan || $MODE == both ]]; then
    ferrosan_bin
    DISK_DIR=$(mktemp -d "$OUT/disk.XXXXXX")
    declare -A LOCAL_SPEC=(
        [ferrosan-ram]=ram:1G
        [ferrosan-file]=file:$WORK/ferrosan-file.img,size=1G
        [ferrosan-disk]=config-page:$DISK_DIR/ferrosan-disk.img
        [ferrosan-direct]=config-direct:$DISK_DIR/ferrosan-direct.img
    )
    RBD=0
    if ! wanted rbd && ! wanted rbd-wc && ! wanted rbd-gateways; then
        log "the RBD runs are not asked for (CONFORMANCE_RUNS=$WANTED)"
    elif ! command -v ceph-mon >/dev/null || ! command -v rbd >/dev/null; then
        log "ferrosan-rbd, ferrosan-rbd-gateways: SKIPPED, not run: the Ceph packages (ceph-mon, ceph-mgr, ceph-osd, ceph-common) are not installed"
    else
        RBD=1
        start_ceph
    fi
    start_side ferrosan-ram ferrosan-file ferrosan-disk ferrosan-direct
    ((RBD)) && rbd_runs
    finish_side ferrosan-ram ferrosan-file ferrosan-disk ferrosan-direct \
        ferrosan-rbd ferrosan-rbd-wc ferrosan-rbd-gateways
    rm -rf "$DISK_DIR"
    if ((RBD)); then
        unset CEPH_CONF
        scripts/ceph-single-node.sh stop "$CEPH_DIR"
        CEPH_DIR=""
    fi
fi

if [[ $MODE == tgt || $MODE == both ]]; then
    run=tgt-file
    rm -f "$WORK/tgt-disk.img"
    truncate -s 1G "$WORK/tgt-disk.img"
    if start_tgt "$run" "$WORK/tgt-disk.img"; then
        run_suite "$run"
        stop_daemon 0
    else
        not_run "$run" "tgtd did not start (see $run.daemon.log)"
    fi
fi

# Final line: the ferrosan runs summed (the tgt run alone in tgt mode).
P=0 F=0 S=0 status=0
for run in "${RUNS[@]}"; do
    if [[ $MODE == tgt || $run == ferrosan-* ]]; then
        P=$((P + R_PASS[$run])) F=$((F + R_FAIL[$run])) S=$((S + R_SKIP[$run]))
    fi
    if [[ $run == ferrosan-* ]]; then
        ((R_FAIL[$run] == 0)) || status=1
    elif ((R_PASS[$run] + R_SKIP[$run] == 0)); then
        status=1 # the tgt baseline itself broke
    fi
done
log "per-test results: $OUT/<run>.tsv"
echo "$P passed, $F failed, $S skipped"
exit "$status"
