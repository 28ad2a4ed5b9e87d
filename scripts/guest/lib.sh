# shellcheck shell=bash
# Helpers the guest's test scripts share (scripts/guest/*.sh). The host script copies
# this file beside main.sh into the share (/host/lib.sh); main.sh sources it.

# report LINE: a line to the host (the report channel, $REPORT) and to the console.
# Run as one of several suites in one boot (SUITE set, scripts/guest/suites.sh), each check's
# name is SUITE/CHECK.
report() {
    local line="$*" c named=()
    if [[ -n ${SUITE:-} ]]; then
        case $line in
            "PLAN "*)
                for c in ${line#PLAN }; do named+=("$SUITE/$c"); done
                line="PLAN ${named[*]}"
                ;;
            "CHECK "* | "TIME "*) line="${line%% *} $SUITE/${line#* }" ;;
        esac
    fi
    printf '%s\n' "$line" >"$REPORT"
    printf '>>> %s\n' "$line"
}

# The checks: each a function run by `run` in a subshell; WORK (the script's scratch
# directory, with the files `state` and `detail`) is set by the sourcing script.
now() { cut -d' ' -f1 /proc/uptime; }
# fail DETAIL: the running check's verdict (the first reason given wins), then return 1.
fail() {
    [[ -s $WORK/detail ]] || printf '%s' "$*" | tr '\n' ' ' >"$WORK/detail"
    echo "FAILED: $*"
    return 1
}
# save NAME=VALUE...: state a check hands to later ones (checks run in subshells).
save() { printf '%s\n' "$@" >>"$WORK/state"; }
# run CHECK FUNCTION: run one check with errexit in a subshell (any failing command fails it),
# report its verdict and time; LAST_RC is its exit status. Never call it as a condition: errexit
# would be off inside.
LAST_RC=0
run() {
    local name=$1 fn=$2 t0 rc
    t0=$(now)
    : >"$WORK/detail"
    printf '\n==== check %s\n' "$name"
    set +e
    (set -e; "$fn")
    rc=$?
    set -e
    LAST_RC=$rc
    # shellcheck source=/dev/null
    source "$WORK/state"
    if ((rc == 0)); then
        report "CHECK $name: ok"
    else
        [[ -s $WORK/detail ]] || echo "a command failed (exit $rc; see the console log)" >"$WORK/detail"
        report "CHECK $name: FAILED $(cat "$WORK/detail")"
    fi
    report "TIME $name $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
}
# run_all CHECK...: run each (check_NAME, dashes as underscores) in order.
run_all() {
    local c
    for c in "$@"; do run "$c" "check_${c//-/_}"; done
}
# skip_all REASON CHECK...: checks that cannot run because one they need failed: failures.
skip_all() {
    local why=$1 c
    shift
    for c in "$@"; do report "CHECK $c: FAILED not run: $why"; done
}

# without_sigpipe CMD...: run CMD with SIGPIPE ignored (the disposition survives exec). Linux's
# nvme-tcp host sends a command from the submitting task itself when it can (the queue's own
# CPU, nothing queued before it), without MSG_NOSIGNAL: once the target's end is gone (a FIN,
# then a reset for the next segment) that send raises SIGPIPE on the task, and a program that
# keeps SIGPIPE's default dies of it mid-I/O while the controller reconnects. QEMU ignores
# SIGPIPE; fio does not (docs/NVME.md, *Linux hosts when the daemon dies*).
without_sigpipe() { (exec_without_sigpipe "$@"); }
# exec_without_sigpipe CMD...: the same in place of this shell: for `CMD &`, whose $! is then
# CMD's own PID (signals sent to it reach CMD, not a shell waiting on it).
exec_without_sigpipe() {
    trap '' PIPE
    exec "$@"
}

# wait_until SECONDS CMD...: poll CMD every half second.
wait_until() {
    local secs=$1 i
    shift
    for ((i = 0; i < secs * 2; i++)); do
        "$@" && return 0
        sleep 0.5
    done
    return 1
}

# nvme_ctrl PORT: the controller (nvmeN) connected to HOST_ADDR:PORT.
nvme_ctrl() {
    local c addr
    for c in /sys/class/nvme/nvme*; do
        addr=$(cat "$c/address" 2>/dev/null) || continue
        [[ $addr == *"traddr=$HOST_ADDR,"*"trsvcid=$1"* ]] || continue
        echo "${c##*/}"
        return 0
    done
    return 1
}

# nvme_head: the namespace's head device (native multipath: nvmeXn1; its paths nvmeXcYn1
# are hidden).
nvme_head() {
    local b n
    for b in /sys/block/nvme*n1; do
        [[ -e $b ]] || continue
        n=${b##*/}
        [[ $n == *c* ]] && continue
        echo "$n"
        return 0
    done
    return 1
}

# nvme_path CTRL: the namespace's path device through controller CTRL (nvmeXcYn1).
nvme_path() {
    local p
    for p in /sys/block/nvme*c"${1#nvme}"n1; do
        [[ -e $p ]] && echo "${p##*/}" && return 0
    done
    return 1
}
