#!/bin/bash
# The guest's half of scripts/kernel-nvme.sh: runs inside the test guest (scripts/lib/guest.sh)
# as /host/main.sh and checks ferrosan's NVMe/TCP door with the Linux kernel's host (nvme-tcp,
# native NVMe multipath) and nvme-cli, beside its iSCSI door (open-iscsi) on the same device.
#
# Reports on $REPORT (the second serial port), one line each:
#   PLAN name...                 every check this script will report, before the first
#   CHECK name: ok               a check passed
#   CHECK name: FAILED detail    a check failed, and why
#   TIME name SECONDS            how long a check took
#   HOST: restart-ferrosan KILL  asks the host to kill ferrosan and start it again; answered
#                                in /host/acks/restart-N once the daemon is back
#   HOST: alua GROUP STATE       asks the host to give portal group GROUP the ALUA state STATE
#                                live; answered in /host/acks/alua-N ("ok ..." or "FAILED ...")
#
# /host/params sets NQN, TARGET_IQN, HOST_ADDR, PORT_OPT and PORT_NONOPT (the NVMe/TCP
# listeners of portal groups 1, active/optimized, and 2, active/non-optimized), ISCSI_PORT
# (portal group 1's iSCSI portal), PORT_DISC (its NVMe/TCP discovery listener), HOSTNQN,
# HOSTID, INIT (the guest's iSCSI name), EUI64 (the device's NAA as nvme-cli prints an
# EUI-64), BLOCKS (its size in 512-byte blocks), and for the authenticated subsystem
# SECURE_NQN the host's and controller's DH-HMAC-CHAP secrets HOST_KEY and CTRL_KEY, and
# WRONG_KEY, which ferrosan does not hold; AUTH_CHECKS=1 runs the authentication checks; for
# the TLS subsystem TLS_NQN the host's pre-shared key TLS_KEY and one ferrosan does not hold,
# WRONG_TLS_KEY; for the subsystem TLS384_NQN the host's SHA-384 key TLS384_KEY; TLS_CHECKS=1
# runs the TLS checks (tlshd and nvme-cli's --tls).
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=/dev/null
source /host/params
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
: "${NQN:?}" "${TARGET_IQN:?}" "${HOST_ADDR:?}" "${PORT_OPT:?}" "${PORT_NONOPT:?}" "${ISCSI_PORT:?}" "${PORT_DISC:?}"
: "${HOSTNQN:?}" "${HOSTID:?}" "${INIT:?}" "${EUI64:?}" "${BLOCKS:?}"
: "${SECURE_NQN:?}" "${HOST_KEY:?}" "${CTRL_KEY:?}" "${WRONG_KEY:?}" "${AUTH_CHECKS:?}"
: "${TLS_NQN:?}" "${TLS_KEY:?}" "${WRONG_TLS_KEY:?}" "${TLS_CHECKS:?}" "${TLS384_NQN:?}" "${TLS384_KEY:?}"
REPORT=${REPORT:-/dev/ttyS1}
ACKS=/host/acks
WORK=/tmp/knvme
DISCOVERY_NQN=nqn.2014-08.org.nvmexpress.discovery
# A second host of the guest's, in no group until persistent-discovery adds a subsystem for it.
LIVE_HOSTID=0c1d2e3f-4a5b-4c6d-8e7f-8091a2b3c4d5
LIVE_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:$LIVE_HOSTID
LIVE_NQN=$NQN-live
mkdir -p "$WORK"
: >"$WORK/state"
FIO_SIZE=$((32 << 20))

CHECKS=(discover connect identify two-paths fio-verify one-device reservations
    ana-unavailable ana-optimized-again fio-verify-ana restart-kill fio-verify-restart disconnect
    no-sq-flow persistent-discovery)
# DH-HMAC-CHAP where the host asked for it (a kernel with NVMe in-band authentication).
((AUTH_CHECKS)) && CHECKS+=(auth-connect auth-refused)
# TLS where the guest has tlshd and nvme-cli --tls (Debian 13).
((TLS_CHECKS)) && CHECKS+=(tls-connect tls-refused tls-sha384)

connect_port() {
    nvme connect -t tcp -a "$HOST_ADDR" -s "$1" -n "$NQN" -q "$HOSTNQN" -I "$HOSTID" \
        --ctrl-loss-tmo=120 --reconnect-delay=1 --keep-alive-tmo=5
}

# path_of PORT: the path device through the controller connected to PORT (found anew at each
# call: a command for wait_until).
path_of() {
    local c
    c=$(nvme_ctrl "$1") || return 1
    nvme_path "$c"
}
ana_state() { cat "/sys/block/$1/ana_state" 2>/dev/null; }
# ana_is PATH STATE (a command for wait_until: the state is read at each try).
ana_is() { [[ $(ana_state "$1") == "$2" ]]; }
stat_ios() { awk '{ print $1 + $5 }' "/sys/block/$1/stat"; }
io_moves() {
    local a i
    a=$(stat_ios "$1")
    for ((i = 0; i < $2 * 2; i++)); do
        sleep 0.5
        (($(stat_ios "$1") > a)) && return 0
    done
    return 1
}

fio_run() {
    local name=$1 offset=$2 size=$3
    shift 3
    without_sigpipe fio --name="$name" --filename="/dev/$DEV" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
        --iodepth=16 --offset="$offset" --size="$size" --verify=crc32c --do_verify=1 \
        --verify_fatal=1 --output-format=json --output="$WORK/fio-$name.json" "$@"
}
fio_start() {
    rm -f "$WORK/fio-$1.rc"
    (
        set +e
        fio_run "$1" "$2" "$3" --rate=,"$4" >"$WORK/fio-$1.out" 2>&1
        echo $? >"$WORK/fio-$1.rc"
    ) &
}
fio_running() { [[ ! -e $WORK/fio-$1.rc ]]; }
fio_wait() { wait_until "$2" test -e "$WORK/fio-$1.rc" || fail "fio $1 still running after $2 s"; }
fio_verdict() {
    local name=$1 bytes=$2 rc err w r
    rc=$(cat "$WORK/fio-$name.rc")
    # fio's own words (the shell's "Aborted" line repeats the command, options and all).
    ((rc == 0)) || fail "fio exited $rc: $(grep -v '^/host/' "$WORK/fio-$name.out" 2>/dev/null |
        grep -m3 -iE 'verify|error|assert|abort|fio:' | cut -c1-200 | tr '\n' ' ') (its last lines: $(
        tail -n 3 "$WORK/fio-$name.out" 2>/dev/null | cut -c1-160 | tr '\n' ' '))"
    read -r err w r < <(awk '
        /"error"/ && err == "" { gsub(/[^0-9]/, "", $0); err = $0 }
        /"read" : \{/ { sect = "read" }
        /"write" : \{/ { sect = "write" }
        /"trim" : \{/ { sect = "trim" }
        /"io_bytes"/ { v = $0; gsub(/[^0-9]/, "", v); if (sect == "read" && r == "") r = v; if (sect == "write" && w == "") w = v }
        END { print err, w, r }' "$WORK/fio-$name.json")
    echo "fio $name: error=$err written=$w verified=$r (expected $bytes)"
    ((err == 0)) || fail "fio reported error $err"
    ((w == bytes)) || fail "fio wrote $w bytes, expected $bytes"
    ((r == bytes)) || fail "the verify pass read $r bytes, expected $bytes"
}

# ask_host KIND ARGS...: a request to the host, waited for: restart MODE, alua GROUP STATE,
# ctl ARGS (`ferrosan ctl ARGS` on the daemon), or log PATTERN (ferrosan's log has a line
# matching it). The host numbers each kind's requests
# from 1; the counts outlive the checks' subshells through save.
RESTARTS=0 ALUA_CHANGES=0 LOG_QUERIES=0 CTL_REQUESTS=0
ask_host() {
    local kind=$1 n ack
    shift
    case $kind in
        restart)
            RESTARTS=$((RESTARTS + 1)) n=$((RESTARTS + 0))
            save "RESTARTS=$RESTARTS"
            report "HOST: restart-ferrosan $*"
            ;;
        alua)
            ALUA_CHANGES=$((ALUA_CHANGES + 1)) n=$((ALUA_CHANGES + 0))
            save "ALUA_CHANGES=$ALUA_CHANGES"
            report "HOST: alua $*"
            ;;
        log)
            LOG_QUERIES=$((LOG_QUERIES + 1)) n=$((LOG_QUERIES + 0))
            save "LOG_QUERIES=$LOG_QUERIES"
            report "HOST: log $*"
            ;;
        ctl)
            CTL_REQUESTS=$((CTL_REQUESTS + 1)) n=$((CTL_REQUESTS + 0))
            save "CTL_REQUESTS=$CTL_REQUESTS"
            report "HOST: ctl $*"
            ;;
    esac
    ack=$ACKS/$kind-$n
    wait_until 120 test -e "$ack" || fail "the host did not answer $kind $* within 120 s"
    echo "host: $(cat "$ack")"
    if [[ $kind == log ]]; then
        grep -q "^ok " "$ack" || fail "ferrosan's log has no line matching '$*'"
    else
        grep -q "^ok " "$ack" || fail "the host could not do $kind $*: $(cat "$ack")"
    fi
}

# ---------------------------------------------------------------------------------------------
# Checks

# entries KIND FILE: the "subnqn trsvcid traddr" of each entry of `nvme discover`'s output in
# FILE whose subtype is KIND ("nvme subsystem", "current discovery subsystem", ...).
entries() {
    awk -v kind="$1" '
        /^=====Discovery Log Entry/ { if (what == kind) print nqn, svc, addr; what = nqn = svc = addr = "" }
        $1 == "subtype:" { $1 = ""; what = substr($0, 2) }
        $1 == "subnqn:" { nqn = $2 }
        $1 == "trsvcid:" { svc = $2 }
        $1 == "traddr:" { addr = $2 }
        END { if (what == kind) print nqn, svc, addr }' "$2"
}

# Discovery through the well-known discovery NQN: the subsystem at both of its ports, and
# first the discovery service itself where the host reached it, as one a host may keep
# (explicit persistent connections).
check_discover() {
    nvme discover -t tcp -a "$HOST_ADDR" -s "$PORT_OPT" -q "$HOSTNQN" | tee "$WORK/discover"
    entries "nvme subsystem" "$WORK/discover" >"$WORK/subsystems"
    grep -q "^$NQN $PORT_OPT " "$WORK/subsystems" || fail "discovery does not list $NQN at port $PORT_OPT"
    grep -q "^$NQN $PORT_NONOPT " "$WORK/subsystems" || fail "discovery does not list $NQN at port $PORT_NONOPT"
    [[ $(entries "current discovery subsystem" "$WORK/discover") == "$DISCOVERY_NQN $PORT_OPT "* ]] \
        || fail "the log does not describe the discovery service at port $PORT_OPT"
    grep -q "eflags: *explicit discovery connections" "$WORK/discover" \
        || fail "the discovery service is not described as one a host may stay connected to"
    # The discovery listener lists the same subsystems, and itself as the discovery service.
    nvme discover -t tcp -a "$HOST_ADDR" -s "$PORT_DISC" -q "$HOSTNQN" | tee "$WORK/discover2"
    diff "$WORK/subsystems" <(entries "nvme subsystem" "$WORK/discover2") \
        || fail "the discovery listener answers another log than the I/O listener's"
    [[ $(entries "current discovery subsystem" "$WORK/discover2") == "$DISCOVERY_NQN $PORT_DISC "* ]] \
        || fail "the discovery listener does not describe itself"
}

check_connect() {
    connect_port "$PORT_OPT" || fail "nvme connect to $PORT_OPT failed"
    wait_until 20 nvme_head >/dev/null || fail "no namespace block device after connect"
    DEV=$(nvme_head)
    save "DEV=$DEV"
    nvme list-subsys | cat
    echo "namespace: /dev/$DEV"
}

check_identify() {
    local ctrl
    ctrl=$(find /sys/class/nvme -mindepth 1 -maxdepth 1 -name 'nvme*' -printf '%f\n' | sort | head -1)
    nvme id-ctrl "/dev/$ctrl" >"$WORK/id-ctrl"
    head -40 "$WORK/id-ctrl"
    grep -qE "^subnqn +: $NQN\$" "$WORK/id-ctrl" || fail "id-ctrl names another subsystem"
    grep -qE "^mdts +: 8\$" "$WORK/id-ctrl" || fail "MDTS is not 8 (1 MiB)"
    nvme id-ns "/dev/$DEV" >"$WORK/id-ns"
    head -30 "$WORK/id-ns"
    grep -qE "^nsze +: $(printf '%#x' "$BLOCKS")\$" "$WORK/id-ns" || fail "nsze is not $BLOCKS blocks"
    grep -qE "^nmic +: 0x1\$" "$WORK/id-ns" || fail "the namespace is not shared (nmic)"
    grep -qiE "^eui64 +: $EUI64\$" "$WORK/id-ns" || fail "eui64 is not the device's NAA ($EUI64)"
    [[ $(blockdev --getsize64 "/dev/$DEV") == $((BLOCKS * 512)) ]] || fail "the block device's size differs"
}

# Native NVMe multipath: a second controller through portal group 2; each path's ANA state is
# its portal group's ALUA state.
check_two_paths() {
    connect_port "$PORT_NONOPT" || fail "nvme connect to $PORT_NONOPT failed"
    wait_until 20 path_of "$PORT_NONOPT" >/dev/null || fail "no path device through $PORT_NONOPT"
    P_OPT=$(path_of "$PORT_OPT") P_NONOPT=$(path_of "$PORT_NONOPT")
    save "P_OPT=$P_OPT" "P_NONOPT=$P_NONOPT"
    echo "paths: $P_OPT (port $PORT_OPT) $P_NONOPT (port $PORT_NONOPT)"
    nvme list-subsys | cat
    wait_until 10 ana_is "$P_OPT" optimized || fail "$P_OPT is $(ana_state "$P_OPT"), not optimized"
    [[ $(ana_state "$P_NONOPT") == non-optimized ]] || fail "$P_NONOPT is $(ana_state "$P_NONOPT"), not non-optimized"
}

# fio with crc32c verify through the head device: the I/O takes the optimized path.
check_fio_verify() {
    local before_non
    before_non=$(stat_ios "$P_NONOPT")
    local rc=0
    fio_run base 0 $FIO_SIZE >"$WORK/fio-base.out" 2>&1 || rc=$?
    echo "$rc" >"$WORK/fio-base.rc"
    fio_verdict base $FIO_SIZE
    (($(stat_ios "$P_NONOPT") - before_non < 64)) || fail "the I/O went down the non-optimized path"
}

# The same device through the iSCSI door: what one door wrote the other reads.
check_one_device() {
    echo "InitiatorName=$INIT" >/etc/iscsi/initiatorname.iscsi
    iscsid
    sleep 1
    iscsiadm -m node -o new -T "$TARGET_IQN" -p "$HOST_ADDR:$ISCSI_PORT,1" >/dev/null
    iscsiadm -m node -T "$TARGET_IQN" -p "$HOST_ADDR:$ISCSI_PORT,1" --login || fail "iSCSI login failed"
    udevadm settle --timeout=20 || true
    local sd i
    for ((i = 0; i < 40; i++)); do
        sd=$(iscsiadm -m session -P3 2>/dev/null | awk '/Attached scsi disk/ { print $4 }' | head -1)
        [[ -n $sd && -e /dev/$sd ]] && break
        sleep 0.5
    done
    [[ -n $sd ]] || fail "no SCSI disk on the iSCSI session"
    save "SD=$sd"
    head -c 1048576 /dev/urandom >"$WORK/a"
    head -c 1048576 /dev/urandom >"$WORK/b"
    dd if="$WORK/a" of="/dev/$DEV" bs=1M seek=400 oflag=direct status=none
    dd if="/dev/$sd" of="$WORK/a.back" bs=1M skip=400 count=1 iflag=direct status=none
    cmp "$WORK/a" "$WORK/a.back" || fail "iSCSI reads other data than NVMe wrote"
    dd if="$WORK/b" of="/dev/$sd" bs=1M seek=401 oflag=direct status=none
    dd if="/dev/$DEV" of="$WORK/b.back" bs=1M skip=401 count=1 iflag=direct status=none
    cmp "$WORK/b" "$WORK/b.back" || fail "NVMe reads other data than iSCSI wrote"
}

# One reservation table: an NVMe host's Write Exclusive fences the iSCSI initiator, and
# sg_persist through iSCSI sees the NVMe host's key and reservation.
check_reservations() {
    nvme resv-register "/dev/$DEV" -n 1 --nrkey=0x4e564d65 --rrega=0 || fail "resv-register failed"
    nvme resv-acquire "/dev/$DEV" -n 1 --crkey=0x4e564d65 --rtype=1 --racqa=0 || fail "resv-acquire failed"
    sg_persist --in --read-keys "/dev/$SD" | tee "$WORK/keys"
    grep -qi "0x4e564d65" "$WORK/keys" || fail "iSCSI READ KEYS does not show the NVMe host's key"
    sg_persist --in --read-reservation "/dev/$SD" | tee "$WORK/resv"
    grep -qi "Write Exclusive" "$WORK/resv" || fail "iSCSI READ RESERVATION does not show Write Exclusive"
    if dd if=/dev/zero of="/dev/$SD" bs=4k seek=1000 count=1 oflag=direct status=none 2>"$WORK/dd.err"; then
        fail "the iSCSI initiator wrote through the NVMe host's Write Exclusive reservation"
    fi
    cat "$WORK/dd.err"
    dd if=/dev/zero of="/dev/$DEV" bs=4k seek=1000 count=1 oflag=direct status=none || fail "the holder cannot write"
    nvme resv-release "/dev/$DEV" -n 1 --crkey=0x4e564d65 --rtype=1 --rrela=0 || fail "resv-release failed"
    nvme resv-register "/dev/$DEV" -n 1 --crkey=0x4e564d65 --rrega=1 || fail "unregister failed"
    dd if=/dev/zero of="/dev/$SD" bs=4k seek=1000 count=1 oflag=direct status=none || fail "iSCSI still fenced after the release"
    iscsiadm -m node -T "$TARGET_IQN" -p "$HOST_ADDR:$ISCSI_PORT,1" --logout || true
}

# The operator takes portal group 1 out of service under I/O: the ANA change notice reaches the
# host, the path goes inaccessible, the I/O moves to the non-optimized path without an error.
check_ana_unavailable() {
    fio_start ana 64M $FIO_SIZE 1m
    io_moves "$P_OPT" 20 || fail "fio's writes do not reach the optimized path"
    local t0
    t0=$(now)
    ask_host alua 1 unavailable
    wait_until 20 ana_is "$P_OPT" inaccessible \
        || fail "$P_OPT is still $(ana_state "$P_OPT") 20 s after the change"
    echo "inaccessible after $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s"
    io_moves "$P_NONOPT" 20 || fail "no I/O on the non-optimized path"
}

check_ana_optimized_again() {
    ask_host alua 1 active-optimized
    wait_until 20 ana_is "$P_OPT" optimized \
        || fail "$P_OPT is still $(ana_state "$P_OPT") 20 s after the change"
    io_moves "$P_OPT" 20 || fail "the I/O does not come back to the optimized path"
}

check_fio_verify_ana() {
    fio_wait ana 300
    fio_verdict ana $FIO_SIZE
}

# SIGKILL under I/O: the host's controllers reconnect (reconnect-delay 1 s) once ferrosan is
# back, and fio's verify finds every write.
check_restart_kill() {
    fio_start restart 128M $FIO_SIZE 1m
    # The head device keeps no I/O statistics on this kernel: its optimized path does.
    io_moves "$P_OPT" 20 || fail "fio's writes do not reach the optimized path"
    ask_host restart KILL
    fio_running restart || fail "fio ended before ferrosan was back: the restart did not happen under I/O"
    wait_until 90 io_moves "$P_OPT" 1 || fail "no I/O on the optimized path 90 s after the restart"
    [[ $(ana_state "$P_OPT") == optimized ]] || fail "$P_OPT is $(ana_state "$P_OPT") after the restart"
}

check_fio_verify_restart() {
    fio_wait restart 300
    fio_verdict restart $FIO_SIZE
}

check_disconnect() {
    nvme disconnect -n "$NQN" | tee "$WORK/disc"
    grep -q "disconnected 2 controller" "$WORK/disc" || fail "not both controllers disconnected"
    wait_until 10 bash -c '! ls /sys/block/nvme*n1 >/dev/null 2>&1' || fail "the namespace is still there"
}

# A controller without SQ flow control, as libnvme's connect-all asks for where the discovery
# entry allows it (TREQ bit 2, as ferrosan's does; connect-all itself cannot run here: the
# entries name the host's loopback address, which the guest reaches as 10.0.2.2). ferrosan then
# ends each successful read on its data (C2HData with SUCCESS, no response capsule): fio
# verifies through the controller, and ferrosan's log names it as connected without SQ flow
# control.
check_no_sq_flow() {
    grep -q "sq flow control disable supported" "$WORK/discover" \
        || fail "the discovery entries do not offer to disable SQ flow control"
    nvme connect -t tcp -a "$HOST_ADDR" -s "$PORT_OPT" -n "$NQN" -q "$HOSTNQN" -I "$HOSTID" \
        --ctrl-loss-tmo=120 --reconnect-delay=1 --disable-sqflow || fail "nvme connect --disable-sqflow failed"
    wait_until 20 nvme_head >/dev/null || fail "no namespace after the connect"
    DEV=$(nvme_head)
    ask_host log 'NVMe controller connected.*sq_flow_control=false'
    local rc=0
    fio_run sqflow 256M $FIO_SIZE >"$WORK/fio-sqflow.out" 2>&1 || rc=$?
    echo "$rc" >"$WORK/fio-sqflow.rc"
    fio_verdict sqflow $FIO_SIZE
    nvme disconnect -n "$NQN" >/dev/null || fail "nvme disconnect failed"
}

# The addresses the discovery log names (the host's loopback, where ferrosan listens) reached
# from the guest: its connections to 127.0.0.1 at ferrosan's ports go to the host (QEMU's
# 10.0.2.2), as they would on a network where the log's addresses are the host's own.
loopback_to_host() {
    sysctl -qw net.ipv4.conf.all.route_localnet=1
    nft -f - <<NFT
table ip hostloop {
    chain out { type nat hook output priority -100; ip daddr 127.0.0.1 tcp dport { $PORT_OPT, $PORT_DISC } dnat to $HOST_ADDR; }
    chain post { type nat hook postrouting priority 100; ip saddr 127.0.0.0/8 oifname != "lo" masquerade; }
}
NFT
}

# discovery_ctrl PORT: the discovery controller connected to 127.0.0.1:PORT.
discovery_ctrl() {
    local c
    for c in /sys/class/nvme/nvme*; do
        [[ $(cat "$c/subsysnqn" 2>/dev/null) == "$DISCOVERY_NQN" ]] || continue
        [[ $(cat "$c/address" 2>/dev/null) == *"traddr=127.0.0.1,trsvcid=$1"* ]] || continue
        echo "${c##*/}"
        return 0
    done
    return 1
}

# A persistent discovery connection, as `nvme discover --persistent` and the boot-time
# autoconnect keep one: it stays (keep-alive), and when the operator adds a subsystem for the
# host live, the kernel hears of it (an Asynchronous Event, Discovery Log Page Change: the
# uevent NVME_AEN=0x70f002 that nvme-cli's udev rule turns into `connect-all --device`), and
# connect-all through that controller connects the new subsystem, whose namespace reads what
# was written.
check_persistent_discovery() {
    loopback_to_host || fail "cannot route the guest's loopback to the host"
    udevadm monitor --kernel --property --subsystem-match=nvme >"$WORK/uevents" 2>&1 &
    local monitor=$! dc ns
    nvme discover -t tcp -a 127.0.0.1 -s "$PORT_DISC" -q "$LIVE_HOSTNQN" -I "$LIVE_HOSTID" \
        --persistent | tee "$WORK/discover-live"
    [[ -z $(entries "nvme subsystem" "$WORK/discover-live") ]] || fail "a host in no group discovers subsystems"
    dc=$(discovery_ctrl "$PORT_DISC") || fail "the discovery controller did not stay connected"
    echo "persistent discovery controller: $dc (kato $(cat /sys/class/nvme/"$dc"/kato 2>/dev/null || echo ?))"
    ask_host ctl device add live ram:16M
    ask_host ctl target add "$TARGET_IQN-live" --nqn "$LIVE_NQN" --initiator "$LIVE_HOSTNQN" --portal-group 1
    ask_host ctl lun map "$TARGET_IQN-live" hosts 0 live
    wait_until 20 grep -q "NVME_AEN=0x70f002" "$WORK/uevents" \
        || fail "no discovery log change event on $dc"
    kill "$monitor" 2>/dev/null || true
    grep -B8 "NVME_AEN=0x70f002" "$WORK/uevents" | head -n 20
    # What nvme-cli's udev rule runs for the event.
    nvme connect-all --device="$dc" -t tcp -a 127.0.0.1 -s "$PORT_DISC" -q "$LIVE_HOSTNQN" -I "$LIVE_HOSTID" \
        || fail "connect-all through $dc failed"
    wait_until 20 live_namespace >/dev/null || fail "no namespace of $LIVE_NQN after connect-all"
    ns=$(live_namespace)
    head -c 4096 /dev/urandom >"$WORK/live-block"
    dd if="$WORK/live-block" of="/dev/$ns" bs=4096 count=1 oflag=direct status=none || fail "cannot write $ns"
    cmp <(dd if="/dev/$ns" bs=4096 count=1 iflag=direct status=none) "$WORK/live-block" \
        || fail "$ns reads back other data"
    discovery_ctrl "$PORT_DISC" >/dev/null || fail "the discovery controller is gone"
    nvme disconnect -n "$LIVE_NQN" >/dev/null || fail "nvme disconnect of $LIVE_NQN failed"
    nvme disconnect -d "$dc" >/dev/null || fail "nvme disconnect of $dc failed"
}

# live_namespace: the namespace of the subsystem added live.
live_namespace() {
    local s n
    for s in /sys/class/nvme-subsystem/nvme-subsys*; do
        [[ $(cat "$s/subsysnqn" 2>/dev/null) == "$LIVE_NQN" ]] || continue
        for n in "$s"/nvme*n1; do
            [[ -e $n ]] && echo "${n##*/}" && return 0
        done
    done
    return 1
}

# In-band authentication with Linux's DH-HMAC-CHAP: every queue of the controller
# authenticates (and authenticates ferrosan back) before the namespace appears.
secure_connect() {
    nvme connect -t tcp -a "$HOST_ADDR" -s "$PORT_OPT" -n "$SECURE_NQN" -q "$HOSTNQN" -I "$HOSTID" \
        --ctrl-loss-tmo=0 "$@"
}
check_auth_connect() {
    grep -qE '^CONFIG_NVME_(HOST_)?AUTH=y' "/boot/config-$(uname -r)" \
        || fail "this guest kernel ($(uname -r)) has no NVMe in-band authentication"
    secure_connect --dhchap-secret="$HOST_KEY" --dhchap-ctrl-secret="$CTRL_KEY" \
        || fail "nvme connect with the DH-HMAC-CHAP secrets failed"
    wait_until 20 nvme_head >/dev/null || fail "no namespace after the authenticated connect"
    local dev
    dev=$(nvme_head)
    dmesg | grep -iE 'nvme.*(authenticat|dhchap)' | tail -n 8 | tee "$WORK/auth-dmesg"
    grep -qi "qid 0: .*authenticated" "$WORK/auth-dmesg" || fail "the kernel does not report the admin queue authenticated"
    head -c 1048576 /dev/urandom >"$WORK/s"
    dd if="$WORK/s" of="/dev/$dev" bs=1M oflag=direct status=none || fail "write through the authenticated controller failed"
    dd if="/dev/$dev" of="$WORK/s.back" bs=1M count=1 iflag=direct status=none
    cmp "$WORK/s" "$WORK/s.back" || fail "read back other data"
    nvme disconnect -n "$SECURE_NQN" | cat
    wait_until 10 bash -c '! ls /sys/block/nvme*n1 >/dev/null 2>&1' || fail "the namespace is still there"
}
# A wrong secret, or none, never shows the namespace.
check_auth_refused() {
    if secure_connect --dhchap-secret="$WRONG_KEY"; then
        fail "nvme connect with a wrong secret succeeded"
    fi
    if secure_connect; then
        fail "nvme connect without a secret succeeded"
    fi
    sleep 2
    if ls /sys/block/nvme*n1 >/dev/null 2>&1; then
        fail "a namespace appeared without authentication"
    fi
    nvme disconnect -n "$SECURE_NQN" >/dev/null 2>&1 || true
}

# TLS 1.3 with a pre-shared key: nvme-cli derives the TLS PSK into the kernel's .nvme keyring,
# the kernel asks tlshd (userspace) for the handshake, then runs kTLS; every queue is its own
# TLS connection.
# tls_insert KEY [SUBNQN], tls_connect [--tls] (to TLS_NQN, or SUBNQN when set).
tls_insert() {
    nvme check-tls-key --keydata="$1" -n "$HOSTNQN" -c "${2:-$TLS_NQN}" --identity=0 --insert
}
tls_connect() {
    nvme connect -t tcp -a "$HOST_ADDR" -s "$PORT_OPT" -n "${SUBNQN:-$TLS_NQN}" -q "$HOSTNQN" \
        -I "$HOSTID" --ctrl-loss-tmo=0 "$@"
}
start_tlshd() {
    [[ -n ${TLSHD_PID:-} ]] && return 0
    printf '[debug]\nloglevel=1\ntls=0\nnl=0\n[authenticate]\nkeyrings=.nvme\n' >/etc/tlshd.conf
    tlshd >"$WORK/tlshd.log" 2>&1 &
    TLSHD_PID=$!
    sleep 1
}
check_tls_connect() {
    start_tlshd
    # Discovery tells the host TLS is required there (TREQ, TSAS), as connect-all reads it.
    nvme discover -t tcp -a "$HOST_ADDR" -s "$PORT_OPT" -q "$HOSTNQN" >"$WORK/discover-tls"
    awk -v nqn="$TLS_NQN" 'BEGIN { RS = "=====Discovery Log Entry" } index($0, nqn "\n")' \
        "$WORK/discover-tls" | tee "$WORK/tls-entry"
    grep -q "treq: *required" "$WORK/tls-entry" || fail "discovery does not say TLS is required for $TLS_NQN"
    grep -q "sectype: *tls13" "$WORK/tls-entry" || fail "discovery does not say TLS 1.3 for $TLS_NQN"
    tls_insert "$TLS_KEY" || fail "nvme check-tls-key --insert failed"
    tls_connect --tls || fail "nvme connect --tls failed"
    tls_io_disconnect "$TLS_NQN"
}
# tls_io_disconnect SUBNQN: 1 MiB written and read back through the namespace over TLS, then
# the subsystem disconnected.
tls_io_disconnect() {
    wait_until 20 nvme_head >/dev/null || fail "no namespace after the TLS connect"
    local dev
    dev=$(nvme_head)
    head -c 1048576 /dev/urandom >"$WORK/t"
    dd if="$WORK/t" of="/dev/$dev" bs=1M oflag=direct status=none || fail "write over TLS failed"
    dd if="/dev/$dev" of="$WORK/t.back" bs=1M count=1 iflag=direct status=none
    cmp "$WORK/t" "$WORK/t.back" || fail "read back other data over TLS"
    dmesg | grep -iE 'nvme.*tls|tls.*nvme' | tail -n 4 || true
    nvme disconnect -n "$1" | cat
    wait_until 10 bash -c '! ls /sys/block/nvme*n1 >/dev/null 2>&1' || fail "the namespace is still there"
}
# A SHA-384 key (NVMeTLSkey-1:02, identity NVMe0R02): this tlshd binds it with the hash its
# GnuTLS picks, and ferrosan serves the suite the binder names.
check_tls_sha384() {
    start_tlshd
    tls_insert "$TLS384_KEY" "$TLS384_NQN" || fail "nvme check-tls-key --insert (SHA-384) failed"
    keyctl show %:.nvme 2>/dev/null | grep -o 'NVMe0R0[12] [^ ]*' | sort -u || true
    SUBNQN=$TLS384_NQN tls_connect --tls || fail "nvme connect --tls (SHA-384 key) failed"
    tls_io_disconnect "$TLS384_NQN"
}
# In the clear, or with a key ferrosan does not hold, the namespace never shows.
check_tls_refused() {
    start_tlshd
    if tls_connect; then
        fail "nvme connect without TLS to a subsystem that requires it succeeded"
    fi
    tls_insert "$WRONG_TLS_KEY" || fail "nvme check-tls-key --insert (wrong key) failed"
    if tls_connect --tls; then
        fail "nvme connect --tls with a wrong key succeeded"
    fi
    sleep 2
    if ls /sys/block/nvme*n1 >/dev/null 2>&1; then
        fail "a namespace appeared without the right TLS key"
    fi
    nvme disconnect -n "$TLS_NQN" >/dev/null 2>&1 || true
}

diagnostics() {
    printf '\n==== diagnostics\n'
    nvme list-subsys 2>/dev/null | cat || true
    printf '\n---- kernel log (NVMe)\n'
    dmesg | grep -iE 'nvme|I/O error|reservation' | tail -n 150 || true
    if [[ -s $WORK/tlshd.log ]]; then
        printf '\n---- tlshd\n'
        tail -n 40 "$WORK/tlshd.log"
    fi
}
trap diagnostics EXIT

report "PLAN ${CHECKS[*]}"
run discover check_discover
run connect check_connect
if [[ -z ${DEV:-} ]]; then
    # Nothing else can run without the namespace: each reported as not run.
    for c in "${CHECKS[@]:2}"; do report "CHECK $c: FAILED not run: no namespace after connect"; done
    exit 0
fi
for c in "${CHECKS[@]:2}"; do run "$c" "check_${c//-/_}"; done
