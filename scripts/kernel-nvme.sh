#!/usr/bin/env bash
# ferrosan's NVMe/TCP door against the Linux kernel's NVMe/TCP host: a QEMU guest (Debian 12's
# kernel, nvme-cli, open-iscsi, sg3-utils, fio; scripts/lib/guest.sh) discovers and connects to
# ferrosan on this host with native NVMe multipath over two portal groups, and checks identity,
# ANA states and their change notices, fio verify, one device through both doors, one
# reservation table across them, and a daemon killed under I/O (scripts/guest/kernel-nvme.sh,
# the guest's half; docs/NVME.md, "Tested with").
#
#   scripts/kernel-nvme.sh
#
# ferrosan serves one target on two portal groups, each with an iSCSI portal and an NVMe/TCP
# listener: group 1 active/optimized, group 2 active/non-optimized; LUN 0 (NSID 1) a thin
# 512 MiB file. The guest reaches the host's loopback as 10.0.2.2 (QEMU user networking).
#
# Results in target/kernel-nvme/: guest-console.log, guest-report.log, ferrosan.log,
# ferrosan.toml, summary.txt. Exit status: non-zero if any check failed or did not report.
#
# Environment: FERROSAN_BIN         prebuilt daemon (default: cargo build --release -p ferrosan)
#              KERNEL_NVME_TIMEOUT  seconds the guest may run (default 600)
#              FERROSAN_GUEST_*     see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=kernel-nvme
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/kernel-nvme
GUEST_TIMEOUT=${KERNEL_NVME_TIMEOUT:-600}
IQN=iqn.2026-11.org.ferrosan:kernel-nvme
NQN=nqn.2026-11.org.ferrosan:kernel-nvme
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b
HOSTID=6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b
INIT=iqn.2026-11.org.ferrosan.guest:nvme-node
NAA=5001405f3e7a2b1c
BLOCKS=$((512 << 20 >> 9))
RESTART_GAP=3

DAEMON_PID=""
WORK=""
cleanup() {
    local rc=$?
    stop_pid "$GUEST_PID" 20
    GUEST_PID=""
    stop_pid "$DAEMON_PID" 50
    DAEMON_PID=""
    [[ -n $WORK ]] && rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

T_START=$(date +%s)
ensure_deps
ferrosan_bin
mkdir -p "$OUT"
rm -f "$OUT"/{guest-console.log,guest-console.log.qemu,guest-report.log,ferrosan.log,summary.txt}

T0=$(date +%s)
guest_image
T_IMAGE=$(($(date +%s) - T0))

# On the disk (not tmpfs): the LUN takes ferrosan's direct-I/O path, as a real file LUN does.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-kernel-nvme.XXXXXX")
mkdir -m 0700 "$WORK/run" "$WORK/state"
mkdir -p "$WORK/share/acks"
# Four distinct free ports: each group's iSCSI portal and NVMe/TCP listener.
PORTS=()
while ((${#PORTS[@]} < 4)); do
    p=$(free_port)
    [[ " ${PORTS[*]} " == *" $p "* ]] || PORTS+=("$p")
done
ISCSI_PORT=${PORTS[0]} ISCSI_PORT2=${PORTS[1]} PORT_OPT=${PORTS[2]} PORT_NONOPT=${PORTS[3]}

cat >"$OUT/ferrosan.toml" <<CONFIG
# scripts/kernel-nvme.sh: one target on two portal groups, each with an NVMe/TCP listener.
[server]
state_dir = "$WORK/state"
control_socket = "$WORK/run/control.sock"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$ISCSI_PORT"]
nvme_listen = ["127.0.0.1:$PORT_OPT"]

[[portal_group]]
tag = 2
listen = ["127.0.0.1:$ISCSI_PORT2"]
nvme_listen = ["127.0.0.1:$PORT_NONOPT"]
alua_state = "active-non-optimized"

[[device]]
name = "lun0"
store = "file"
path = "$WORK/lun0.img"
size = "512M"
naa = "0x$NAA"
thin = true

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "guest"
  initiators = ["$HOSTNQN", "$INIT"]
  luns = [ { lun = 0, device = "lun0" } ]
CONFIG
"$FERROSAN_BIN" check-config "$OUT/ferrosan.toml" >/dev/null

# start_daemon: start ferrosan on the config (its log appended to ferrosan.log) and wait for
# both portals.
start_daemon() {
    printf '\n==== %s: ferrosan serve --config %s\n' "$(date +%T)" "$OUT/ferrosan.toml" >>"$OUT/ferrosan.log"
    "$FERROSAN_BIN" serve --config "$OUT/ferrosan.toml" </dev/null >>"$OUT/ferrosan.log" 2>&1 &
    DAEMON_PID=$!
    wait_port "$PORT_OPT" "$DAEMON_PID" 15 && wait_port "$PORT_NONOPT" "$DAEMON_PID" 5 && return 0
    log "ferrosan did not start; the end of its log:"
    tail_indented "$OUT/ferrosan.log" 20
    return 1
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
    start_daemon || result="FAILED ferrosan did not start again"
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

start_daemon || die "ferrosan did not start"
log "ferrosan (PID $DAEMON_PID): NVMe/TCP on 127.0.0.1:$PORT_OPT (optimized) and 127.0.0.1:$PORT_NONOPT (non-optimized), iSCSI on 127.0.0.1:$ISCSI_PORT"

cp scripts/guest/kernel-nvme.sh "$WORK/share/main.sh"
cat >"$WORK/share/params" <<PARAMS
NQN=$NQN
TARGET_IQN=$IQN
HOST_ADDR=10.0.2.2
PORT_OPT=$PORT_OPT
PORT_NONOPT=$PORT_NONOPT
ISCSI_PORT=$ISCSI_PORT
HOSTNQN=$HOSTNQN
HOSTID=$HOSTID
INIT=$INIT
EUI64=$NAA
BLOCKS=$BLOCKS
PARAMS

CONSOLE=$OUT/guest-console.log
REPORT=$OUT/guest-report.log
T0=$(date +%s)
guest_start "$WORK/share" "$CONSOLE" "$REPORT" 1024
log "guest booting (QEMU PID $GUEST_PID, ${FERROSAN_GUEST_ACCEL:-tcg}); console: $CONSOLE"

# Follow the guest until it powers off: carry out its restart and ALUA requests, note when it
# is up.
T_BOOT="" handled=0 alua_handled=0 timed_out=0
while kill -0 "$GUEST_PID" 2>/dev/null; do
    if [[ -z $T_BOOT ]] && grep -q '^init: ready' "$CONSOLE" 2>/dev/null; then
        T_BOOT=$(($(date +%s) - T0))
        log "guest up after $T_BOOT s"
    fi
    mapfile -t requests < <(tr -d '\r' <"$REPORT" | grep '^HOST: restart-ferrosan ' || true)
    while ((handled < ${#requests[@]})); do
        handled=$((handled + 1))
        restart_daemon "${requests[handled - 1]##* }" "$handled"
    done
    mapfile -t requests < <(tr -d '\r' <"$REPORT" | grep '^HOST: alua ' || true)
    while ((alua_handled < ${#requests[@]})); do
        alua_handled=$((alua_handled + 1))
        read -r _ _ group state <<<"${requests[alua_handled - 1]}"
        alua_change "$group" "$state" "$alua_handled"
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

# Verdicts: every check the guest planned must report ok.
tr -d '\r' <"$REPORT" >"$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
planned=()
read -r -a planned < <(sed -n 's/^PLAN //p' "$REPORT" | head -n1) || true
passed=0 failed=0
{
    printf 'kernel-nvme: ferrosan %s, guest %s (%s)\n' "$FERROSAN_BIN" "$(basename "$GUEST_DIR")" \
        "${FERROSAN_GUEST_ACCEL:-tcg}"
    printf 'kernel-nvme: guest: %s\n' "$(guest_versions)"
    if ((${#planned[@]} == 0)); then
        echo "  the guest reported no plan: it never ran its checks (see $CONSOLE)"
        failed=1
    fi
    for c in "${planned[@]}"; do
        line=$(grep -m1 "^CHECK $c: " "$REPORT" || true)
        secs=$(sed -n "s/^TIME $c //p" "$REPORT" | head -n1)
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
    printf 'kernel-nvme: image %s s (%s), boot %s s, guest %s s, total %s s\n' "$T_IMAGE" \
        "$( ((GUEST_BUILT)) && echo built || echo cached)" "${T_BOOT:-?}" "$T_GUEST" "$(($(date +%s) - T_START))"
    printf 'kernel-nvme: %d passed, %d failed\n' "$passed" "$failed"
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
