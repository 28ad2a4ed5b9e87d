#!/usr/bin/env bash
# RBD gateway failover with the Linux kernel's iSCSI initiator and its NVMe/TCP host: a QEMU guest
# (scripts/lib/guest.sh: Debian 12's kernel, open-iscsi, dm-multipath, nvme-cli, fio) writes through two ferrosan gateways of one
# RBD image while the owner gateway is killed, restarted and hung, and the host measures what a
# Linux host gets out of the box: how long its I/O stalls, how many takeovers each fault causes,
# and whether every acknowledged write reads back (scripts/guest/kernel-gateways.sh is the guest's
# half; docs/RBD.md, "Two or more gateways").
#
#   scripts/kernel-gateways.sh
#
# The host starts a single-node Ceph cluster (scripts/ceph-single-node.sh, default timeouts:
# osd_client_watch_timeout 30 s) and, per run, a fresh 1 GiB image and two gateways a and b on one
# config (portal groups 1 and 2, gateways_config in scripts/lib/common.sh; default
# gateway_takeover_s), each with a metrics listener. The guest logs in to both portals with the
# timeouts an administrator sets for multipath (iscsid.conf: replacement_timeout 5 s, NOP-Out
# every 5 s, 5 s to answer), dm-multipath with ALUA priorities, the ALUA hardware handler, TUR
# checker, no_path_retry queue, failback manual, and one run per path_grouping_policy
# (KERNEL_GATEWAYS_POLICIES). The run named "nvme" serves the image through the gateways'
# NVMe/TCP listeners too (subsystem NQN, namespace 1; ANA states from the ownership) and the
# guest connects nvme-cli to both with its defaults (keep-alive 5 s, reconnect every 10 s): the
# kernel's native NVMe multipath joins the paths, with no tuning. In each run fio writes 4 KiB random blocks (crc32c, per-I/O
# completion log) while the guest asks the host (over its second serial port, "HOST: N VERB",
# answered through the share) to
#   1. SIGKILL the image's owner; once I/O flows again, restart it (same config and name) and
#      keep writing RETURN_S s: it must come back as a non-owner, with no second takeover;
#   2. SIGSTOP the (new) owner for STOP_S s, then SIGCONT it; no takeover after it resumes;
#   3. then fio's verify pass reads back every block written.
# The host scrapes both gateways' ferrosan_gateway_takeovers_total (summed over reasons; a
# restarted gateway's counters start from 0 and are added to its previous life's) and
# ferrosan_gateway_owner once a second and at each request.
#
# Pass bar, per run of a policy in KERNEL_GATEWAYS_GATED (the others are reported, not judged):
# fio's verify pass finds 0 errors over everything written (and the write phase outlasted the
# faults); exactly one takeover per fault and none while a gateway returns or resumes; the
# restarted gateway comes back as a non-owner, and one gateway owns the image at the end.
# Stalls, from fio's per-I/O completion log: after the SIGKILL the longest gap between two write
# completions is at most STALL_MAX_S (10 s), and so is the time from the kill to the end of the
# last gap over a second in its window ("disrupted until": a path that fails once more after a
# takeover makes a second stall); after the SIGSTOP, the end of the last gap over a second comes
# at most STALL_MAX_S after the guest's session to the stopped gateway failed (its first "ping
# timeout" or "detected conn error" in the kernel log; for NVMe/TCP, its controller's first
# keep-alive or I/O timeout or error recovery; the stall from the SIGSTOP itself is reported too). Fault times are the guest's, when it asked (the host acts within ~0.2 s).
# Beside each fault, not judged: the guest's own pulse (a timestamp every 0.1 s from shell
# builtins; its longest pause is a time the emulated guest itself did not run) and the gateways'
# device writes that took over a second, so a stall is placed in the guest, at a gateway or in
# Ceph.
#
# Results in target/kernel-gateways/: summary.txt (every number; for a run whose fio failed, when
# the guest found it gone, its last output and the kernel's I/O errors), guest-console.log (the guest's
# kernel log, fio output, multipath -ll at each step), guest-report.log (its RESULT lines and
# requests), POLICY/gateway-a.log and gateway-b.log (every life of each daemon, appended),
# POLICY/ferrosan.toml, POLICY/metrics.tsv (the scrapes: owner, takeovers, fencing, NOT READY
# answers, device writes and those over 1 s), POLICY/events.log (requests, signals,
# owner changes as the host saw them), ceph.log. Exit status: non-zero if a judged run failed.
#
# Environment: FERROSAN_BIN             prebuilt daemon (default: cargo build --release -p ferrosan)
#              KERNEL_GATEWAYS_POLICIES runs, in order (default "group_by_prio failover multibus nvme")
#              KERNEL_GATEWAYS_GATED    the runs the pass bar applies to (default: all four)
#              KERNEL_GATEWAYS_TIMEOUT  seconds the guest may run (default: from the runs)
#              KGW_FIO_RATE (100 write IOPS), KGW_FIO_SECONDS (120: fio's write phase; it must
#              outlast the faults, ~95 s when each passes the bar), KGW_STOP_S (30),
#              KGW_RETURN_S (20), KGW_RESUME_S (20), KGW_STALL_MAX_S (10),
#              KGW_TAKEOVER_S (the gateways' gateway_takeover_s; default: ferrosan's)
#              FERROSAN_GUEST_*         see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=kernel-gateways
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/kernel-gateways
IQN=iqn.2026-11.org.ferrosan:kernel-gateways
NQN=nqn.2026-11.org.ferrosan:kernel-gateways
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:0c3d5e7f-2a4b-4c6d-8e0f-1a2b3c4d5e6f
POLICIES=${KERNEL_GATEWAYS_POLICIES:-group_by_prio failover multibus nvme}
GATED=${KERNEL_GATEWAYS_GATED:-group_by_prio failover multibus nvme}
FIO_RATE=${KGW_FIO_RATE:-100}
FIO_SECONDS=${KGW_FIO_SECONDS:-120}
WARMUP_S=10
KILL_MAX_S=60
STOP_S=${KGW_STOP_S:-30}
RETURN_S=${KGW_RETURN_S:-20}
RESUME_S=${KGW_RESUME_S:-20}
STALL_MAX_S=${KGW_STALL_MAX_S:-10}
TAKEOVER_S=${KGW_TAKEOVER_S:-}
read -r -a RUNS <<<"$POLICIES"
((${#RUNS[@]} > 0)) || die "KERNEL_GATEWAYS_POLICIES is empty"
for p in "${RUNS[@]}"; do
    case $p in group_by_prio | failover | multibus | group_by_serial | group_by_node_name | group_by_tpg | nvme) ;;
    *) die "unknown path_grouping_policy $p" ;;
    esac
done
GUEST_TIMEOUT=${KERNEL_GATEWAYS_TIMEOUT:-$((180 + ${#RUNS[@]} * (FIO_SECONDS * 2 + 120)))}

declare -A HOST_T=() GW_PID=() GW_PORT=() GW_NPORT=() GW_MPORT=() GW_STOPPED=() OWN_LAST=() CUR=() BASE=() MARK_T=() MARK_TK=() MARK_OWN=()
WORK="" CEPH_DIR="" RUN_OUT="" RUN_N=""
CONT_AT="" CONT_GW="" CONT_REQ=""

stop_gateways() {
    local g
    for g in a b; do
        [[ -n ${GW_PID[$g]:-} ]] || continue
        kill -CONT "${GW_PID[$g]}" 2>/dev/null || true
        stop_pid "${GW_PID[$g]}" 150
        GW_PID[$g]=""
    done
}
cleanup() {
    local rc=$?
    stop_pid "$GUEST_PID" 20
    GUEST_PID=""
    stop_gateways
    [[ -n $CEPH_DIR ]] && scripts/ceph-single-node.sh stop "$CEPH_DIR" >/dev/null 2>&1
    [[ -n $WORK ]] && rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

T_START=$(date +%s)
ensure_deps
ferrosan_bin
command -v curl >/dev/null || die "curl is missing (the gateways' metrics are scraped with it)"
mkdir -p "$OUT"
rm -rf "${OUT:?}"/{guest-console.log,guest-console.log.qemu,guest-report.log,summary.txt,ceph.log}
for p in "${RUNS[@]}"; do rm -rf "${OUT:?}/$p"; done

T0=$(date +%s)
guest_image
T_IMAGE=$(($(date +%s) - T0))

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-kernel-gateways.XXXXXX")
mkdir -p "$WORK/share/acks"
cp scripts/guest/kernel-gateways.sh "$WORK/share/main.sh"
cp scripts/guest/lib.sh "$WORK/share/lib.sh"
cat >"$WORK/share/params" <<PARAMS
TARGET_IQN=$IQN
TARGET_NQN=$NQN
HOSTNQN=$HOSTNQN
HOST_ADDR=10.0.2.2
POLICIES="${RUNS[*]}"
FIO_RATE=$FIO_RATE
FIO_SECONDS=$FIO_SECONDS
WARMUP_S=$WARMUP_S
KILL_MAX_S=$KILL_MAX_S
RETURN_S=$RETURN_S
STOP_S=$STOP_S
RESUME_S=$RESUME_S
PARAMS

now() { date +%s.%3N; }
rel() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a - b }'; }
# event TEXT: a line in the run's events.log, with the host's time.
event() {
    [[ -n $RUN_OUT ]] || return 0
    printf '%s %s\n' "$(now)" "$*" >>"$RUN_OUT/events.log"
}
# answer N TEXT: the guest's acks/N (written whole, then renamed: the guest never reads half).
answer() {
    printf '%s\n' "$2" >"$WORK/share/acks/$1.tmp"
    mv "$WORK/share/acks/$1.tmp" "$WORK/share/acks/$1"
    event "answer $1: $2"
}

# ---------------------------------------------------------------------------------------------
# Gateways and their metrics

# start_gateway G: gateway G of the run's config (its log appended to G's), with a metrics
# listener; waits for its portal.
start_gateway() {
    local g=$1
    printf '\n==== %s: ferrosan serve --config %s --gateway %s\n' "$(date +%T)" "$RUN_OUT/ferrosan.toml" "$g" >>"$RUN_OUT/gateway-$g.log"
    "$FERROSAN_BIN" serve --config "$RUN_OUT/ferrosan.toml" --gateway "$g" \
        --state-dir "$WORK/state-$RUN_N-$g" --control-socket "$WORK/run-$RUN_N-$g.sock" \
        --metrics-listen "127.0.0.1:${GW_MPORT[$g]}" </dev/null >>"$RUN_OUT/gateway-$g.log" 2>&1 &
    GW_PID[$g]=$!
    GW_STOPPED[$g]=""
    event "start gateway $g (PID ${GW_PID[$g]})"
    if ! wait_port "${GW_PORT[$g]}" "${GW_PID[$g]}" 30 || ! wait_port "${GW_MPORT[$g]}" "${GW_PID[$g]}" 5 ||
        { [[ -n ${GW_NPORT[$g]:-} ]] && ! wait_port "${GW_NPORT[$g]}" "${GW_PID[$g]}" 5; }; then
        log "gateway $g did not start; the end of its log:"
        tail_indented "$RUN_OUT/gateway-$g.log" 20
        return 1
    fi
}

METRICS=(takeovers fenced shipfail notready slow)
# scrape G: read gateway G's metrics into CUR[G:...] and OWN_LAST[G]; a line in metrics.tsv.
# `slow` counts the writes its devices took over a second to complete (the latency histogram's
# count less its bucket le=1): a stall the guest sees with no slow write at either gateway lay
# on the guest's side (its SCSI or multipath layer), one with them at the gateway or below.
scrape() {
    local g=$1 text vals owner tk fenced shipfail notready writes slow reasons
    [[ -n ${GW_PID[$g]:-} && -z ${GW_STOPPED[$g]:-} ]] || return 0
    text=$(curl -s -m 1 "http://127.0.0.1:${GW_MPORT[$g]}/metrics" 2>/dev/null) || return 0
    [[ -n $text ]] || return 0
    vals=$(awk '
        /^ferrosan_gateway_owner\{/ { owner = $NF + 0; seen = 1 }
        /^ferrosan_gateway_takeovers_total\{/ { tk += $NF; r = $0; sub(/.*reason="/, "", r); sub(/".*/, "", r); reasons = reasons r ":" ($NF + 0) "," }
        /^ferrosan_gateway_fenced_total\{/ { fenced += $NF }
        /^ferrosan_gateway_ship_failures_total\{/ { shipfail += $NF }
        /^ferrosan_device_errors_total\{/ && /not_ready/ { notready += $NF }
        /^ferrosan_device_latency_seconds_count\{/ && /op="write"/ { writes += $NF }
        /^ferrosan_device_latency_seconds_bucket\{/ && /op="write"/ && /le="1(\.0)?"/ { second += $NF }
        END { if (!seen) owner = "?"; print owner, tk + 0, fenced + 0, shipfail + 0, notready + 0, writes + 0, writes - second, (reasons == "" ? "-" : reasons) }' <<<"$text")
    read -r owner tk fenced shipfail notready writes slow reasons <<<"$vals"
    CUR[$g:takeovers]=$tk CUR[$g:fenced]=$fenced CUR[$g:shipfail]=$shipfail CUR[$g:notready]=$notready CUR[$g:slow]=$slow
    if [[ ${OWN_LAST[$g]:-} != "$owner" ]]; then
        event "owner metric of gateway $g: ${OWN_LAST[$g]:-none} -> $owner"
        OWN_LAST[$g]=$owner
    fi
    printf '%s %s owner=%s takeovers=%s fenced=%s ship_failures=%s not_ready=%s writes=%s slow_writes=%s reasons=%s\n' \
        "$(now)" "$g" "$owner" "$tk" "$fenced" "$shipfail" "$notready" "$writes" "$slow" "$reasons" >>"$RUN_OUT/metrics.tsv"
}
# total METRIC: the run's sum over both gateways and all their lives.
total() {
    local g s=0
    for g in a b; do s=$((s + ${BASE[$g:$1]:-0} + ${CUR[$g:$1]:-0})); done
    echo "$s"
}
# snapshot NAME: scrape both, note the time, the takeovers so far and the owners.
snapshot() {
    scrape a
    scrape b
    MARK_T[$1]=$(now)
    MARK_TK[$1]=$(total takeovers)
    MARK_OWN[$1]="a=$(owner_of a) b=$(owner_of b)"
    local m line="$1 ${MARK_T[$1]}"
    for m in "${METRICS[@]}"; do line+=" $m=$(total "$m")"; done
    echo "$line owners:${MARK_OWN[$1]// /,}" >>"$RUN_OUT/marks"
    event "mark $1: takeovers so far ${MARK_TK[$1]}, owner metrics ${MARK_OWN[$1]}"
}
# owner_of G: G's owner metric as last scraped: 1 or 0; "down" while it is not running,
# "N(stopped)" while it is stopped (its last value before).
owner_of() {
    if [[ -z ${GW_PID[$1]:-} ]]; then
        echo down
    elif [[ -n ${GW_STOPPED[$1]:-} ]]; then
        echo "${OWN_LAST[$1]:-?}(stopped)"
    else
        echo "${OWN_LAST[$1]:-?}"
    fi
}
# owner: the gateway whose metrics say it owns the image (exactly one), else nothing.
owner() {
    local g found=()
    for g in a b; do
        [[ -n ${GW_PID[$g]:-} && ${OWN_LAST[$g]:-} == 1 ]] && found+=("$g")
    done
    ((${#found[@]} == 1)) && echo "${found[0]}"
    return 0
}

# ---------------------------------------------------------------------------------------------
# The guest's requests

run_start() {
    local req=$1 n=$2 p=$3 g
    stop_gateways
    RUN_N=$n RUN_OUT=$OUT/$p
    mkdir -p "$RUN_OUT"
    : >"$RUN_OUT/events.log"
    : >"$RUN_OUT/metrics.tsv"
    : >"$RUN_OUT/marks"
    OWN_LAST=() CUR=() BASE=() MARK_T=() MARK_TK=() MARK_OWN=() HOST_T=()
    GW_PORT[a]=$(free_port)
    GW_PORT[b]=$(free_port)
    GW_MPORT[a]=$(free_port)
    GW_MPORT[b]=$(free_port)
    GW_NPORT=()
    local nvme=()
    if [[ $p == nvme ]]; then
        GW_NPORT[a]=$(free_port)
        GW_NPORT[b]=$(free_port)
        nvme=("${GW_NPORT[a]}" "${GW_NPORT[b]}" "$NQN")
    fi
    if [[ $(printf '%s\n' "${GW_PORT[@]}" "${GW_MPORT[@]}" "${GW_NPORT[@]}" | sort -u | wc -l) != $((4 + ${#GW_NPORT[@]})) ]]; then
        answer "$req" "FAILED free_port gave one port twice"
        return 0
    fi
    if ! rbd create --size 1G "rbd/kgw-$n" 2>>"$OUT/ceph.log"; then
        answer "$req" "FAILED rbd create rbd/kgw-$n (see ceph.log)"
        return 0
    fi
    gateways_config "$IQN" "rbd/kgw-$n" "$CEPH_CONF" "${GW_PORT[a]}" "${GW_PORT[b]}" "${nvme[@]}" >"$RUN_OUT/ferrosan.toml"
    if [[ -n $TAKEOVER_S ]]; then
        printf '\n[limits]\ngateway_takeover_s = %s\n' "$TAKEOVER_S" >>"$RUN_OUT/ferrosan.toml"
    fi
    "$FERROSAN_BIN" check-config "$RUN_OUT/ferrosan.toml" >/dev/null
    # a first (it takes the image: nobody holds it), then b, which follows a.
    if ! start_gateway a; then
        answer "$req" "FAILED gateway a did not start"
        return 0
    fi
    wait_for_line "$RUN_OUT/gateway-a.log" "$GATEWAY_A_OWNS" 15 || true
    if ! start_gateway b; then
        answer "$req" "FAILED gateway b did not start"
        return 0
    fi
    if ! wait_for_line "$RUN_OUT/gateway-b.log" "$GATEWAY_B_SEES_A" 15; then
        answer "$req" "FAILED gateway b does not see a as the owner"
        return 0
    fi
    snapshot start
    log "run $n ($p): gateways a (PID ${GW_PID[a]}, 127.0.0.1:${GW_PORT[a]}) and b (PID ${GW_PID[b]}, 127.0.0.1:${GW_PORT[b]}), image rbd/kgw-$n; owner metrics ${MARK_OWN[start]}"
    answer "$req" "ok ${GW_PORT[a]} ${GW_PORT[b]} rbd/kgw-$n ${GW_NPORT[a]:-} ${GW_NPORT[b]:-}"
}

kill_owner() {
    local req=$1 g t
    snapshot kill
    g=$(owner)
    if [[ -z $g ]]; then
        answer "$req" "FAILED no single owner (owner metrics ${MARK_OWN[kill]})"
        return 0
    fi
    t=$(now)
    kill -KILL "${GW_PID[$g]}" 2>/dev/null || true
    wait "${GW_PID[$g]}" 2>/dev/null || true
    GW_PID[$g]=""
    # Its counters live on in BASE (this life's last scrape, just above).
    local m
    for m in "${METRICS[@]}"; do
        BASE[$g:$m]=$((${BASE[$g:$m]:-0} + ${CUR[$g:$m]:-0}))
        CUR[$g:$m]=0
    done
    OWN_LAST[$g]=""
    HOST_T[kill]=$t
    log "run $RUN_N: SIGKILL to the owner, gateway $g"
    event "SIGKILL gateway $g"
    answer "$req" "ok $g $t"
}

restart_gateway() {
    local req=$1 g=$2 t
    snapshot restart
    if [[ -n ${GW_PID[$g]:-} ]]; then
        answer "$req" "FAILED gateway $g is running"
        return 0
    fi
    t=$(now)
    HOST_T[restart]=$t
    if start_gateway "$g"; then
        log "run $RUN_N: gateway $g restarted (PID ${GW_PID[$g]})"
        answer "$req" "ok $g $t"
    else
        answer "$req" "FAILED gateway $g did not start again"
    fi
}

stop_owner() {
    local req=$1 secs=$2 g t
    snapshot stop
    g=$(owner)
    if [[ -z $g ]]; then
        answer "$req" "FAILED no single owner (owner metrics ${MARK_OWN[stop]})"
        return 0
    fi
    t=$(now)
    kill -STOP "${GW_PID[$g]}"
    GW_STOPPED[$g]=1
    HOST_T[stop]=$t
    CONT_AT=$(awk -v a="$t" -v s="$secs" 'BEGIN { printf "%.3f", a + s }') CONT_GW=$g CONT_REQ=$req
    log "run $RUN_N: SIGSTOP to the owner, gateway $g, for $secs s"
    event "SIGSTOP gateway $g"
    answer "$req" "ok $g $t"
}

# cont_due: SIGCONT the stopped gateway once its time has come.
cont_due() {
    [[ -n $CONT_AT ]] || return 0
    awk -v a="$(now)" -v b="$CONT_AT" 'BEGIN { exit !(a >= b) }' || return 0
    snapshot cont
    local t
    t=$(now)
    kill -CONT "${GW_PID[$CONT_GW]}" 2>/dev/null || true
    GW_STOPPED[$CONT_GW]=""
    HOST_T[cont]=$t
    log "run $RUN_N: SIGCONT to gateway $CONT_GW"
    event "SIGCONT gateway $CONT_GW"
    answer "$CONT_REQ.cont" "ok $CONT_GW $t"
    CONT_AT="" CONT_GW="" CONT_REQ=""
}

# run_end N: the run's last snapshot; its gateways stop; the host's side of its results.
run_end() {
    local req=$1
    cont_due
    if [[ -n $CONT_AT ]]; then # the guest ended the run early: continue the gateway first
        CONT_AT=$(now)
        cont_due
    fi
    snapshot run-end
    stop_gateways
    host_results >"$RUN_OUT/host-results"
    answer "$req" "ok run $RUN_N ended"
    RUN_OUT=""
}

OFFSET_MIN="" OFFSET_MAX=""
handle() {
    local line=$1 req verb args guest_t off
    # "HOST: N VERB [ARGS...] @GUEST_EPOCH"
    guest_t=${line##*@}
    read -r _ req verb args <<<"${line% @*}"
    off=$(awk -v h="$(now)" -v g="$guest_t" 'BEGIN { printf "%.3f", h - g }')
    if [[ -z $OFFSET_MIN ]] || awk -v a="$off" -v b="$OFFSET_MIN" 'BEGIN { exit !(a < b) }'; then OFFSET_MIN=$off; fi
    if [[ -z $OFFSET_MAX ]] || awk -v a="$off" -v b="$OFFSET_MAX" 'BEGIN { exit !(a > b) }'; then OFFSET_MAX=$off; fi
    event "request $req: $verb $args (the host's clock minus the guest's: $off s)"
    # shellcheck disable=SC2086 # ARGS are words
    case $verb in
    run-start) run_start "$req" $args ;;
    kill-owner) kill_owner "$req" ;;
    restart) restart_gateway "$req" $args ;;
    stop-owner) stop_owner "$req" $args ;;
    mark)
        snapshot "$args"
        answer "$req" "ok mark $args"
        ;;
    run-end) run_end "$req" ;;
    *) answer "$req" "FAILED unknown request: $verb $args" ;;
    esac
}

# ---------------------------------------------------------------------------------------------
# The host's results of a run (host-results: KEY=VALUE lines, read back by the summary)

# log_lines FROM TO: the gateways' lines about ownership between host epochs FROM and TO, as
# "SECONDS_AFTER_FROM GATEWAY TEXT".
log_lines() {
    local g
    for g in a b; do
        grep -E 'took .* over|taking .* (over|back)|fenced|owner of|no longer hears|lost an RBD image|cannot tell' "$RUN_OUT/gateway-$g.log" 2>/dev/null |
            while IFS= read -r l; do
                local ts e
                ts=${l%%Z *}
                e=$(date -u -d "${ts/T/ } UTC" +%s.%N 2>/dev/null) || continue
                awk -v e="$e" -v f="$1" -v t="$2" -v g="$g" -v l="${l#*Z }" 'BEGIN {
                    if (e >= f && e < t) { sub(/^ *[A-Z]+ +[a-z_:]+: /, "", l); sub(/ device=[a-z]+$/, "", l); printf "%.1f %s %s\n", e - f, g, l } }'
            done
    done | sort -n
}

host_results() {
    local w from to lines
    echo "owners_start=${MARK_OWN[start]:-?}"
    # A window is named by the fault or event that opens it: pre [start, kill), kill
    # [kill, restart), return [restart, stop), stop [stop, cont), resume [cont, run-end].
    for w in pre:start:kill kill:kill:restart return:restart:stop stop:stop:cont resume:cont:run-end; do
        IFS=: read -r name from to <<<"$w"
        if [[ -z ${MARK_T[$from]:-} || -z ${MARK_T[$to]:-} ]]; then
            echo "$name.takeovers=?"
            continue
        fi
        echo "$name.takeovers=$((MARK_TK[$to] - MARK_TK[$from]))"
        echo "$name.owners_after=${MARK_OWN[$to]}"
        echo "$name.seconds=$(rel "${MARK_T[$to]}" "${MARK_T[$from]}")"
        local m a b
        for m in fenced shipfail notready slow; do
            a=$(awk -v k="$m" '$1 == "'"$from"'" { for (i = 3; i <= NF; i++) if (index($i, k "=") == 1) { sub(/.*=/, "", $i); print $i } }' "$RUN_OUT/marks" | head -n1)
            b=$(awk -v k="$m" '$1 == "'"$to"'" { for (i = 3; i <= NF; i++) if (index($i, k "=") == 1) { sub(/.*=/, "", $i); print $i } }' "$RUN_OUT/marks" | head -n1)
            echo "$name.$m=$(( ${b:-0} - ${a:-0} ))"
        done
        lines=$(log_lines "${HOST_T[$from]:-${MARK_T[$from]}}" "${MARK_T[$to]}")
        echo "$name.took_lines=$(grep -cE ' took .* over|taking the image back' <<<"$lines" || true)"
        echo "$name.first_took=$(awk '/ took .* over|taking the image back/ { print $1 " (" $2 ")"; exit }' <<<"$lines")"
        echo "$name.first_fenced=$(awk '/fenced [^(]/ && !/this gateway was fenced/ { print $1 " (" $2 ")"; exit }' <<<"$lines")"
        [[ -z $lines ]] || printf '%s\n' "$lines" | head -n 12 | sed "s/^/$name.log=/"
    done
    echo "clock_offset=$OFFSET_MIN..$OFFSET_MAX"
}

# ---------------------------------------------------------------------------------------------

CONSOLE=$OUT/guest-console.log
REPORT=$OUT/guest-report.log
T0=$(date +%s)
guest_start "$WORK/share" "$CONSOLE" "$REPORT" 1024
log "guest booting (QEMU PID $GUEST_PID, ${FERROSAN_GUEST_ACCEL:-tcg}); console: $CONSOLE"
# The cluster starts while the guest boots (the guest's first request waits for it).
CEPH_DIR=$WORK/ceph
conf=$(scripts/ceph-single-node.sh start "$CEPH_DIR" 4 2>>"$OUT/ceph.log") || {
    tail_indented "$OUT/ceph.log" 20
    die "the Ceph test cluster did not start (see $OUT/ceph.log)"
}
export CEPH_CONF=${conf#CEPH_CONF=}
T_CEPH=$(($(date +%s) - T0))
log "Ceph cluster up after $T_CEPH s ($CEPH_CONF)"

T_BOOT="" handled=0 timed_out=0 last_scrape=0
while kill -0 "$GUEST_PID" 2>/dev/null; do
    if [[ -z $T_BOOT ]] && grep -q '^init: ready' "$CONSOLE" 2>/dev/null; then
        T_BOOT=$(($(date +%s) - T0))
        log "guest up after $T_BOOT s"
    fi
    mapfile -t requests < <(guest_requests "$REPORT" "HOST: ")
    while ((handled < ${#requests[@]})); do
        handled=$((handled + 1))
        handle "${requests[handled - 1]}"
    done
    cont_due
    if [[ -n $RUN_OUT ]] && (($(date +%s) > last_scrape)); then
        last_scrape=$(date +%s)
        scrape a
        scrape b
    fi
    if (($(date +%s) - T0 > GUEST_TIMEOUT)); then
        log "the guest is still running after $GUEST_TIMEOUT s: stopping it"
        timed_out=1
        break
    fi
    sleep 0.2
done
stop_pid "$GUEST_PID" 20
GUEST_PID=""
T_GUEST=$(($(date +%s) - T0))
if [[ -n $RUN_OUT ]]; then # the guest stopped in the middle of a run
    CONT_AT=${CONT_AT:+$(now)}
    cont_due
    snapshot run-end
    stop_gateways
    host_results >"$RUN_OUT/host-results"
fi
stop_gateways

# ---------------------------------------------------------------------------------------------
# Verdicts

tr -d '\r' <"$REPORT" >"$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
# res POLICY WHAT KEY: a value from the guest's "RESULT POLICY WHAT ... KEY=VALUE" line.
res() {
    awk -v p="$1" -v w="$2" -v k="$3" '$1 == "RESULT" && $2 == p && $3 == w {
        for (i = 4; i <= NF; i++) if (index($i, k "=") == 1) { v = substr($i, length(k) + 2); print v; exit } }' "$REPORT"
}
# hres POLICY KEY: a value from the host's results of the run.
hres() { sed -n "s/^$2=//p" "$OUT/$1/host-results" 2>/dev/null | head -n1; }
# own_val "a=0 b=1" G: G's value.
own_val() { sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" <<<"$1"; }
num() { [[ $1 =~ ^-?[0-9]+(\.[0-9]+)?$ ]]; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a - b }'; }

judged_failed=0
planned=()
read -r -a planned < <(sed -n 's/^PLAN //p' "$REPORT" | head -n1) || true
{
    printf 'kernel-gateways: ferrosan %s, guest %s (%s)\n' "$FERROSAN_BIN" "$(basename "$GUEST_DIR")" "${FERROSAN_GUEST_ACCEL:-tcg}"
    printf 'kernel-gateways: guest: %s\n' "$(guest_versions)"
    printf 'kernel-gateways: fio 4 KiB random writes, iodepth 16, %s IOPS for %s s; SIGSTOP %s s; pass bar: stall <= %s s, one takeover per fault\n' \
        "$FIO_RATE" "$FIO_SECONDS" "$STOP_S" "$STALL_MAX_S"
    echo "kernel-gateways: initiator: iscsid.conf replacement_timeout 5, noop_out_interval 5, noop_out_timeout 5; multipath.conf device FERROSAN: prio alua, hardware_handler \"1 alua\", path_checker tur, no_path_retry queue, failback manual, path_grouping_policy per run (guest-console.log has the files)"
    printf 'kernel-gateways: gateways: gateway_takeover_s %s\n' "${TAKEOVER_S:-default (4)}"
    echo "kernel-gateways: run nvme: nvme connect with nvme-cli's defaults (keep-alive 5 s, reconnect delay 10 s, ctrl-loss 600 s), native NVMe multipath"
    echo "kernel-gateways: times in seconds after the fault as the guest asked for it (the host acts within ~0.2 s); stall = longest gap between two write completions"
    if ((${#planned[@]} == 0)); then
        echo "  the guest reported no plan: it never ran (see $CONSOLE)"
        judged_failed=1
    fi
    for p in "${RUNS[@]}"; do
        fails=()
        gated=0
        [[ " $GATED " == *" $p "* ]] && gated=1
        echo
        while IFS= read -r l; do fails+=("guest: $l"); done < <(awk -v p="$p" '$1 == "GUEST_FAIL" && $2 == p { $1 = ""; $2 = ""; sub(/^ +/, ""); print }' "$REPORT")
        grep -qx "DONE $p" "$REPORT" || fails+=("the run did not finish$( ((timed_out)) && echo " (guest stopped after $GUEST_TIMEOUT s)")")
        [[ -f $OUT/$p/host-results ]] || fails+=("the host has no results for the run (it never started)")

        # Data: fio's verify pass over everything written.
        rc=$(res "$p" fio rc) err=$(res "$p" fio error) terr=$(res "$p" fio total_err)
        vmsg=$(res "$p" fio verify_messages) w=$(res "$p" fio written) r=$(res "$p" fio verified) exp=$(res "$p" fio expected)
        nw=$(res "$p" writes logged) last_end=$(res "$p" writes last_rel_end)
        if [[ -z $rc ]]; then
            fails+=("fio: no result")
        else
            [[ $rc == 0 && $err == 0 ]] || fails+=("fio: exit $rc, error $err")
            [[ $terr == 0 && $vmsg == 0 ]] || fails+=("fio: verify errors $terr (messages $vmsg)")
            { num "$w" && ((w > 0)) && [[ $w == "$exp" ]]; } || fails+=("fio wrote $w bytes of $exp")
            [[ $r == "$exp" ]] || fails+=("fio's verify pass read $r bytes of $exp")
        fi
        { num "${nw:-}" && ((nw > 0)); } || fails+=("no write in fio's completion log")
        { num "${last_end:-}" && le 0 "$last_end"; } || fails+=("fio's write phase ended ${last_end:-?} s after the scenario: the faults were not all under I/O")

        # Takeovers per window.
        for wnd in pre:0 kill:1 return:0 stop:1 resume:0; do
            name=${wnd%%:*} want=${wnd#*:}
            got=$(hres "$p" "$name.takeovers")
            [[ $got == "$want" ]] || fails+=("$name: ${got:-?} takeovers, expected $want")
        done

        # Owners: the survivor after the kill, the returned gateway a non-owner, one at the end.
        v1=$(awk -v p="$p" '$1 == "RESULT" && $2 == p && $3 == "mark" && $4 == "kill" { for (i = 5; i <= NF; i++) if ($i ~ /^victim=/) print substr($i, 8) }' "$REPORT")
        if [[ $v1 == a || $v1 == b ]]; then
            o1=a
            [[ $v1 == a ]] && o1=b
            [[ $(own_val "$(hres "$p" kill.owners_after)" "$o1") == 1 ]] ||
                fails+=("kill: gateway $o1 does not own the image when $v1 restarts ($(hres "$p" kill.owners_after))")
            [[ $(own_val "$(hres "$p" return.owners_after)" "$v1") == 0 && $(own_val "$(hres "$p" return.owners_after)" "$o1") == 1 ]] ||
                fails+=("return: gateway $v1 did not come back as a non-owner of $o1's image ($(hres "$p" return.owners_after))")
        fi
        ends=$(hres "$p" resume.owners_after)
        [[ $(own_val "$ends" a)$(own_val "$ends" b) == 10 || $(own_val "$ends" a)$(own_val "$ends" b) == 01 ]] ||
            fails+=("not one owner at the end of the run (${ends:-?})")

        # Stalls.
        wv() { awk -v p="$p" -v w="$1" -v k="$2" '$1 == "RESULT" && $2 == p && $3 == "window" && $4 == w {
            for (i = 5; i <= NF; i++) if (index($i, k "=") == 1) { print substr($i, length(k) + 2); exit } }' "$REPORT"; }
        ev() { awk -v p="$p" -v w="$1" -v k="$2" '$1 == "RESULT" && $2 == p && $3 == "events" && $4 == w {
            for (i = 5; i <= NF; i++) if (index($i, k "=") == 1) { print substr($i, length(k) + 2); exit } }' "$REPORT"; }
        pv() { awk -v p="$p" -v w="$1" -v k="$2" '$1 == "RESULT" && $2 == p && $3 == "pulse" && $4 == w {
            for (i = 5; i <= NF; i++) if (index($i, k "=") == 1) { print substr($i, length(k) + 2); exit } }' "$REPORT"; }
        # guest_events WINDOW: the guest kernel's view of the fault, per transport.
        guest_events() {
            if [[ $p == nvme ]]; then
                printf '      guest: controller error %s s (keep-alive timeout %s s), error recovery %s s, reconnect attempt %s s, reconnected %s s (after the %s)\n' \
                    "$(ev "$1" conn_error)" "$(ev "$1" ping_timeout)" "$(ev "$1" recovery)" "$(ev "$1" reconnect)" "$(ev "$1" live)" "$1"
            else
                printf '      guest: conn error %s s, session recovery timeout %s s, path failed %s s, ALUA on the other path %s s (after the %s)\n' \
                    "$(ev "$1" conn_error)" "$(ev "$1" recovery_timeout)" "$(ev "$1" path_failed)" "$(ev "$1" alua_other)" "$1"
            fi
            # A stall the guest's own pulse shares was the guest not running, not its storage.
            printf '      guest pulse: longest pause %s s at %s s, %s over 0.5 s (after the %s)\n' \
                "$(pv "$1" longest)" "$(pv "$1" at)" "$(pv "$1" over_half_s)" "$1"
        }
        # detection TIME: what the guest's first sign of the hang was.
        detection() {
            if [[ $(ev stop ping_timeout) != "$1" ]]; then
                [[ $p == nvme ]] && echo "I/O timeout or error recovery" || echo "connection error"
            else
                [[ $p == nvme ]] && echo "keep-alive timeout" || echo "NOP-Out ping timeout"
            fi
        }
        # The stall as the longest gap between two write completions, and the disruption: up to
        # the end of the last gap over a second in the fault's window (after a takeover a path
        # can fail once more and wait for multipathd's checker: a second stall).
        kgap=$(wv kill gap) kuntil=$(wv kill until) klat=$(wv kill max_lat)
        if num "${kgap:-}"; then
            le "$kgap" "$STALL_MAX_S" || fails+=("kill: I/O stalled $kgap s (longest gap; bar $STALL_MAX_S s)")
            if num "${kuntil:-}"; then
                le "$kuntil" "$STALL_MAX_S" || fails+=("kill: I/O disrupted until $kuntil s after the kill ($(wv kill stalls) gaps over 1 s; bar $STALL_MAX_S s)")
            fi
        else
            fails+=("kill: no stall measured (no writes around the kill)")
        fi
        sgap=$(wv stop gap) suntil=$(wv stop until) slat=$(wv stop max_lat) sdet=$(ev stop conn_error)
        num "${suntil:-}" || suntil=$(wv stop gap_end)
        if num "${suntil:-}" && num "${sdet:-}"; then
            from_det=$(minus "$suntil" "$sdet")
            le "$from_det" "$STALL_MAX_S" || fails+=("stop: I/O flowed again $from_det s after the initiator saw the hang ($(wv stop stalls) gaps over 1 s, the last ending $suntil s after the stop; bar $STALL_MAX_S s)")
        else
            from_det="?"
            fails+=("stop: cannot measure the stall after detection (I/O resumed at ${suntil:-?} s, session failed at ${sdet:-?} s)")
        fi

        verdict=PASS
        ((${#fails[@]} == 0)) || verdict=FAIL
        tag=""
        ((gated)) || tag=" (reported, not judged)"
        ((gated)) && [[ $verdict == FAIL ]] && judged_failed=1
        printf '%s: %s%s\n' "$p" "$verdict" "$tag"
        printf '  map at start: %s\n' "$(awk -v p="$p" '$1 == "RESULT" && $2 == p && $3 == "map" { $1 = $2 = $3 = ""; sub(/^ +/, ""); print; exit }' "$REPORT")"
        printf '  verify: fio exit %s, error %s, verify errors %s, written %s of %s bytes, read back %s; %s writes logged, max write latency %s s\n' \
            "${rc:-?}" "${err:-?}" "${terr:-?}" "${w:-?}" "${exp:-?}" "${r:-?}" "${nw:-?}" "$(res "$p" fio json_write_max_lat)"
        printf '  before the faults (from the gateways'"'"' start): takeovers %s, owners at the kill: %s; longest gap %s s (%s over 1 s), max latency %s s\n' \
            "$(hres "$p" pre.takeovers)" "$(hres "$p" pre.owners_after)" "$(wv pre gap)" "$(wv pre stalls)" "$(wv pre max_lat)"
        printf '  1 SIGKILL owner %s: stall %s s (longest gap between write completions, from %s to %s s after the kill); I/O disrupted until %s s (%s gaps over 1 s, %s s in all); max write latency %s s\n' \
            "$(res "$p" mark victim)" "${kgap:-?}" "$(wv kill gap_start)" "$(wv kill gap_end)" "${kuntil:-?}" "$(wv kill stalls)" "$(wv kill stalled)" "${klat:-?}"
        guest_events kill
        printf '      host: takeovers %s; first "took over" %s s, first "fenced" %s s after the SIGKILL; owners after: %s; NOT READY answers %s, ship failures %s, device writes over 1 s %s\n' \
            "$(hres "$p" kill.takeovers)" "$(hres "$p" kill.first_took)" "$(hres "$p" kill.first_fenced)" "$(hres "$p" kill.owners_after)" \
            "$(hres "$p" kill.notready)" "$(hres "$p" kill.shipfail)" "$(hres "$p" kill.slow)"
        printf '  return of the killed gateway (%s s): takeovers %s, owners after: %s; longest gap %s s (%s over 1 s), max latency %s s; NOT READY %s, ship failures %s\n' \
            "$(hres "$p" return.seconds)" "$(hres "$p" return.takeovers)" "$(hres "$p" return.owners_after)" "$(wv return gap)" "$(wv return stalls)" "$(wv return max_lat)" \
            "$(hres "$p" return.notready)" "$(hres "$p" return.shipfail)"
        printf '  2 SIGSTOP owner %s for %s s: stall from the stop %s s (%s gaps over 1 s, %s s in all; longest %s s, from %s to %s s); from detection %s s (session failed %s s after the stop: %s); max write latency %s s\n' \
            "$(awk -v p="$p" '$1 == "RESULT" && $2 == p && $3 == "mark" && $4 == "stop" { for (i = 5; i <= NF; i++) if ($i ~ /^victim=/) print substr($i, 8) }' "$REPORT")" \
            "$STOP_S" "${suntil:-?}" "$(wv stop stalls)" "$(wv stop stalled)" "${sgap:-?}" "$(wv stop gap_start)" "$(wv stop gap_end)" "$from_det" "${sdet:-?}" \
            "$(detection "$sdet")" "${slat:-?}"
        guest_events stop
        printf '      host: takeovers %s; first "took over" %s s, first "fenced" %s s after the SIGSTOP; owners at SIGCONT: %s; NOT READY %s, ship failures %s, device writes over 1 s %s\n' \
            "$(hres "$p" stop.takeovers)" "$(hres "$p" stop.first_took)" "$(hres "$p" stop.first_fenced)" "$(hres "$p" stop.owners_after)" \
            "$(hres "$p" stop.notready)" "$(hres "$p" stop.shipfail)" "$(hres "$p" stop.slow)"
        printf '  resume (SIGCONT to the end of the run, %s s): takeovers %s, owners at the end: %s; longest gap %s s (%s over 1 s), max latency %s s\n' \
            "$(hres "$p" resume.seconds)" "$(hres "$p" resume.takeovers)" "$(hres "$p" resume.owners_after)" "$(wv resume gap)" "$(wv resume stalls)" "$(wv resume max_lat)"
        echo "  gateway log lines (seconds after the window's start):"
        for name in pre kill return stop resume; do
            sed -n "s/^$name.log=/    $name +/p" "$OUT/$p/host-results" 2>/dev/null
        done
        printf '  clocks: host minus guest %s s (request latency included)\n' "$(hres "$p" clock_offset)"
        for f in "${fails[@]}"; do printf '  FAILED: %s\n' "$f"; done
        # What the guest noted when fio failed: its last output and the kernel's I/O errors.
        awk -v p="$p" '$1 == "NOTE" && $2 == p { $1 = ""; $2 = ""; sub(/^ +/, ""); print "    " $0 }' "$REPORT"
    done
    echo
    printf 'kernel-gateways: image %s s (%s), Ceph %s s, boot %s s, guest %s s, total %s s\n' "$T_IMAGE" \
        "$( ((GUEST_BUILT)) && echo built || echo cached)" "$T_CEPH" "${T_BOOT:-?}" "$T_GUEST" "$(($(date +%s) - T_START))"
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
if ((${#planned[@]} == 0)); then
    log "the guest never started; QEMU said:"
    tail_indented "$CONSOLE.qemu" 10
    log "the end of its console:"
    tail_indented "$CONSOLE" 30
fi
if ((judged_failed)); then
    log "FAILED (runs judged: $GATED); logs in $OUT"
    exit 1
fi
log "passed (runs judged: $GATED)"
