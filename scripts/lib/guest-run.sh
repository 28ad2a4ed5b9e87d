# shellcheck shell=bash
# The host's half of a guest test (scripts/kernel-iscsi.sh, scripts/kernel-nvme.sh): ferrosan
# started and restarted on the test's config, the guest followed until it powers off (its
# requests carried out), and its CHECK lines judged. Source it after scripts/lib/common.sh and
# scripts/lib/guest.sh (kept apart from guest.sh, whose text is part of the image's cache key).
#
# The sourcing script sets OUT (results: ferrosan.toml, ferrosan.log, summary.txt), WORK (its
# share in WORK/share, the control socket in WORK/run), DAEMON_PORTS (the ports that must
# listen), RESTART_GAP (seconds down in a restart), GUEST_TIMEOUT, and after booting the guest
# CONSOLE, REPORT and T0.
#
#   guest_run_setup          traps (guest_run_cleanup on exit), dependencies, the binary,
#                            OUT emptied, the guest image; T_START, T_IMAGE
#   start_ferrosan           start ferrosan on OUT/ferrosan.toml, wait for DAEMON_PORTS
#   follow_guest             until the guest powers off: restart, ALUA and log requests carried
#                            out; sets T_BOOT, T_GUEST, timed_out; the guest and ferrosan stopped
#   guest_verdicts TAG       every planned check must report ok: OUT/summary.txt, printed;
#                            exits 1 if one failed or did not report
#   guest_suite TAG SCRIPT MEM_MIB FILE...
#                            a guest test with no daemon on this host (ferrosan runs in the
#                            guest): SCRIPT as the share's main.sh, lib.sh and each FILE
#                            (NAME=PATH) beside it as NAME, the guest booted, followed, judged
#   guest_suites TAG MEM_MIB SUITE... -- FILE...
#                            several such tests in one boot, one after the other
#                            (scripts/guest/SUITE.sh each, run by scripts/guest/suites.sh),
#                            their checks named SUITE/CHECK

DAEMON_PID=""

# guest_run_setup: how every guest test's host half begins: a cleanup on exit (the guest and
# the daemon stopped, WORK removed), the dependencies, the ferrosan binary, OUT emptied of the
# last run's logs, the guest image; sets T_START and T_IMAGE.
guest_run_setup() {
    trap guest_run_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    T_START=$(date +%s)
    ensure_deps
    ferrosan_bin
    mkdir -p "$OUT"
    rm -f "$OUT"/{guest-console.log,guest-console.log.qemu,guest-report.log,ferrosan.log,summary.txt}
    local t0
    t0=$(date +%s)
    guest_image
    T_IMAGE=$(($(date +%s) - t0))
}

guest_run_cleanup() {
    local rc=$?
    stop_pid "$GUEST_PID" 20
    GUEST_PID=""
    stop_pid "$DAEMON_PID" 50
    DAEMON_PID=""
    [[ -n ${WORK:-} ]] && rm -rf "$WORK"
    exit "$rc"
}

# start_ferrosan: start ferrosan on the config (its log appended to ferrosan.log) and wait for
# its ports.
start_ferrosan() {
    printf '\n==== %s: ferrosan serve --config %s\n' "$(date +%T)" "$OUT/ferrosan.toml" >>"$OUT/ferrosan.log"
    "$FERROSAN_BIN" serve --config "$OUT/ferrosan.toml" </dev/null >>"$OUT/ferrosan.log" 2>&1 &
    DAEMON_PID=$!
    local p wait=15
    for p in "${DAEMON_PORTS[@]}"; do
        if ! wait_port "$p" "$DAEMON_PID" "$wait"; then
            log "ferrosan did not start; the end of its log:"
            tail_indented "$OUT/ferrosan.log" 20
            return 1
        fi
        wait=5
    done
}

# restart_daemon MODE N: stop ferrosan (SIGKILL, or SIGTERM and its graceful shutdown), leave it
# down RESTART_GAP seconds, start it again, and answer the guest in acks/restart-N.
restart_daemon() {
    local mode=$1 n=$2 t0 down result=ok
    t0=$(date +%s)
    log "guest asks for restart $n ($mode) of ferrosan (PID $DAEMON_PID)"
    if [[ $mode == KILL ]]; then
        kill -KILL "$DAEMON_PID" 2>/dev/null || true
        wait "$DAEMON_PID" 2>/dev/null || true
    else
        # shutdown_grace_s (10 s) for the sessions to log out, then the LU flush: 20 s at most.
        kill -TERM "$DAEMON_PID" 2>/dev/null || true
        local i
        for ((i = 0; i < 200; i++)); do
            kill -0 "$DAEMON_PID" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$DAEMON_PID" 2>/dev/null; then
            result="FAILED ferrosan did not exit within 20 s of SIGTERM"
            kill -KILL "$DAEMON_PID" 2>/dev/null || true
        fi
        wait "$DAEMON_PID" 2>/dev/null || true
    fi
    down=$(($(date +%s) - t0))
    DAEMON_PID=""
    sleep "$RESTART_GAP"
    start_ferrosan || result="FAILED ferrosan did not start again"
    log "ferrosan restarted (PID ${DAEMON_PID:-none}): $down s to stop, down $(($(date +%s) - t0)) s"
    echo "$result $mode: stopped in $down s, down $(($(date +%s) - t0)) s" >"$WORK/share/acks/restart-$n.tmp"
    mv "$WORK/share/acks/restart-$n.tmp" "$WORK/share/acks/restart-$n"
}

# alua_change GROUP STATE N: give portal group GROUP the ALUA state STATE live (ferrosan ctl)
# and answer the guest in acks/alua-N.
alua_change() {
    local result
    log "guest asks for portal group $1 to become $2"
    if result=$("$FERROSAN_BIN" ctl --socket "$WORK/run/control.sock" portal-group alua "$1" "$2" 2>&1); then
        result="ok $1 $2: $result"
    else
        result="FAILED $1 $2: $result"
    fi
    echo "$result" | tr '\n' ' ' >"$WORK/share/acks/alua-$3.tmp"
    mv "$WORK/share/acks/alua-$3.tmp" "$WORK/share/acks/alua-$3"
}

# log_query N PATTERN: how many lines of ferrosan's log match PATTERN (grep -E), answered in
# acks/log-N: "ok COUNT", or "none 0".
log_query() {
    local n=$1 count
    shift
    count=$(grep -cE -- "$*" "$OUT/ferrosan.log" || true)
    log "guest asks for ferrosan's log lines matching '$*': ${count:-0}"
    if ((${count:-0} > 0)); then echo "ok $count"; else echo "none 0"; fi >"$WORK/share/acks/log-$n.tmp"
    mv "$WORK/share/acks/log-$n.tmp" "$WORK/share/acks/log-$n"
}

# ctl_request N ARGS...: run `ferrosan ctl ARGS` on the daemon (a live change the guest needs),
# answered in acks/ctl-N: "ok OUTPUT" or "FAILED OUTPUT".
ctl_request() {
    local n=$1 result words
    shift
    log "guest asks for ferrosan ctl $*"
    # Split at blanks as the guest wrote them, never globbed.
    read -r -a words <<<"$*"
    if result=$("$FERROSAN_BIN" ctl --socket "$WORK/run/control.sock" "${words[@]}" 2>&1); then
        result="ok $result"
    else
        result="FAILED $result"
    fi
    echo "$result" | tr '\n' ' ' >"$WORK/share/acks/ctl-$n.tmp"
    mv "$WORK/share/acks/ctl-$n.tmp" "$WORK/share/acks/ctl-$n"
}

# follow_guest: follow the guest until it powers off: carry out its restart, ALUA, ctl and log
# requests, note when it is up; then stop it and ferrosan.
follow_guest() {
    local handled=0 alua_handled=0 log_handled=0 ctl_handled=0 requests group state
    T_BOOT="" timed_out=0
    while kill -0 "$GUEST_PID" 2>/dev/null; do
        if [[ -z $T_BOOT ]] && grep -q '^init: ready' "$CONSOLE" 2>/dev/null; then
            T_BOOT=$(($(date +%s) - T0))
            log "guest up after $T_BOOT s"
        fi
        mapfile -t requests < <(guest_requests "$REPORT" "HOST: restart-ferrosan ")
        while ((handled < ${#requests[@]})); do
            handled=$((handled + 1))
            restart_daemon "${requests[handled - 1]##* }" "$handled"
        done
        mapfile -t requests < <(guest_requests "$REPORT" "HOST: alua ")
        while ((alua_handled < ${#requests[@]})); do
            alua_handled=$((alua_handled + 1))
            read -r _ _ group state <<<"${requests[alua_handled - 1]}"
            alua_change "$group" "$state" "$alua_handled"
        done
        mapfile -t requests < <(guest_requests "$REPORT" "HOST: log ")
        while ((log_handled < ${#requests[@]})); do
            log_handled=$((log_handled + 1))
            log_query "$log_handled" "${requests[log_handled - 1]#HOST: log }"
        done
        mapfile -t requests < <(guest_requests "$REPORT" "HOST: ctl ")
        while ((ctl_handled < ${#requests[@]})); do
            ctl_handled=$((ctl_handled + 1))
            ctl_request "$ctl_handled" "${requests[ctl_handled - 1]#HOST: ctl }"
        done
        if (($(date +%s) - T0 > GUEST_TIMEOUT)); then
            log "the guest is still running after $GUEST_TIMEOUT s: stopping it"
            timed_out=1
            break
        fi
        sleep 0.5
    done
    stop_pid "$GUEST_PID" 20
    GUEST_PID=""
    T_GUEST=$(($(date +%s) - T0))
    stop_pid "$DAEMON_PID" 150
    DAEMON_PID=""
}

# guest_verdicts TAG: every check the guest planned must report ok.
guest_verdicts() {
    local tag=$1 planned=() passed=0 failed=0 c line secs verdict
    tr -d '\r' <"$REPORT" >"$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
    # One PLAN line per suite the guest ran.
    read -r -a planned < <(sed -n 's/^PLAN //p' "$REPORT" | tr '\n' ' ') || true
    {
        printf '%s: ferrosan %s, guest %s (%s)\n' "$tag" "$FERROSAN_BIN" "$(basename "$GUEST_DIR")" \
            "${FERROSAN_GUEST_ACCEL:-tcg}"
        printf '%s: guest: %s\n' "$tag" "$(guest_versions)"
        if ((${#planned[@]} == 0)); then
            echo "  the guest reported no plan: it never ran its checks (see $CONSOLE)"
            failed=1
        fi
        for c in "${planned[@]}"; do
            line=$(grep -m1 "^CHECK $c: " "$REPORT" || true)
            secs=$(sed -n "s|^TIME $c ||p" "$REPORT" | head -n1)
            if [[ $line == "CHECK $c: ok" ]]; then
                passed=$((passed + 1))
                printf '  %-26s ok      %6ss\n' "$c" "${secs:--}"
            else
                failed=$((failed + 1))
                verdict=${line#"CHECK $c: FAILED "}
                ((timed_out)) && [[ -z $line ]] && verdict="no result (guest stopped after $GUEST_TIMEOUT s)"
                printf '  %-26s FAILED  %6ss  %s\n' "$c" "${secs:--}" "${verdict:-no result (the guest stopped early)}"
            fi
        done
        printf '%s: image %s s (%s), boot %s s, guest %s s, total %s s\n' "$tag" "$T_IMAGE" \
            "$( ((GUEST_BUILT)) && echo built || echo cached)" "${T_BOOT:-?}" "$T_GUEST" "$(($(date +%s) - T_START))"
        printf '%s: %d passed, %d failed\n' "$tag" "$passed" "$failed"
    } >"$OUT/summary.txt"
    cat "$OUT/summary.txt"
    if ((${#planned[@]} == 0)); then
        log "the guest never started its checks; QEMU said:"
        tail_indented "$CONSOLE.qemu" 10
        log "the end of its console:"
        tail_indented "$CONSOLE" 30
    fi
    if ((failed)); then
        log "logs: $CONSOLE, $OUT/ferrosan.log"
        exit 1
    fi
}

# guest_suite TAG SCRIPT MEM_MIB FILE...: see the header.
guest_suite() {
    local tag=$1 script=$2 mem=$3 f
    shift 3
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-$tag.XXXXXX")
    mkdir -p "$WORK/share"
    cp "$script" "$WORK/share/main.sh"
    cp scripts/guest/lib.sh "$WORK/share/lib.sh"
    for f in "$@"; do cp "${f#*=}" "$WORK/share/${f%%=*}"; done
    guest_boot_and_judge "$tag" "$mem"
}

# guest_suites TAG MEM_MIB SUITE... -- FILE...: see the header.
guest_suites() {
    local tag=$1 mem=$2 s suites=()
    shift 2
    while (($#)) && [[ $1 != -- ]]; do suites+=("$1"); shift; done
    (($#)) && shift
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-$tag.XXXXXX")
    mkdir -p "$WORK/share"
    cp scripts/guest/suites.sh "$WORK/share/main.sh"
    cp scripts/guest/lib.sh "$WORK/share/lib.sh"
    for s in "${suites[@]}"; do cp "scripts/guest/$s.sh" "$WORK/share/$s.sh"; done
    printf '%s\n' "${suites[@]}" >"$WORK/share/suites"
    for f in "$@"; do cp "${f#*=}" "$WORK/share/${f%%=*}"; done
    guest_boot_and_judge "$tag" "$mem"
}

# guest_boot_and_judge TAG MEM_MIB: the share's main.sh run in a guest booted with MEM_MIB,
# followed until it powers off, its checks judged.
guest_boot_and_judge() {
    local tag=$1 mem=$2
    CONSOLE=$OUT/guest-console.log
    REPORT=$OUT/guest-report.log
    T0=$(date +%s)
    guest_start "$WORK/share" "$CONSOLE" "$REPORT" "$mem"
    log "guest booting (QEMU PID $GUEST_PID, ${FERROSAN_GUEST_ACCEL:-tcg}); console: $CONSOLE"
    # No daemon on this host: follow_guest only waits for the guest (and stops it at the timeout).
    follow_guest
    guest_verdicts "$tag"
}
