#!/bin/bash
# The guest's half of scripts/kernel-iscsi.sh: runs inside the test guest (scripts/lib/guest.sh)
# as /host/main.sh, logs in to ferrosan on the host with the Linux kernel's iSCSI initiator
# (open-iscsi's iscsid + iscsi_tcp) and dm-multipath, and checks what a Linux host depends on.
#
# Reports on $REPORT (the second serial port), one line each:
#   PLAN name...                 every check this script will report, before the first
#   CHECK name: ok               a check passed
#   CHECK name: FAILED detail    a check failed, and why
#   TIME name SECONDS            how long a check took
#   HOST: restart-ferrosan KILL|TERM
#                                asks the host to restart ferrosan (SIGKILL, or SIGTERM: the
#                                graceful stop); the host answers with /host/acks/restart-N
#                                (N counts the requests from 1) once the daemon is back
#   HOST: alua GROUP STATE       asks the host to give portal group GROUP the ALUA state STATE
#                                live (`ferrosan ctl portal-group alua`); the host answers with
#                                /host/acks/alua-N ("ok ..." or "FAILED ...")
# Everything else (commands, their output, diagnostics) goes to the console (stdout).
#
# /host/params (written by the host) sets TARGET_IQN, HOST_ADDR, PORT_OPT (portal group 1,
# active/optimized), PORT_NONOPT (portal group 2, active/non-optimized), INIT_A, INIT_B (the
# two initiator names), CHAP_USER, CHAP_SECRET (what the initiators prove), MUTUAL_USER,
# MUTUAL_SECRET (what the target proves back).
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=/dev/null
source /host/params
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
: "${TARGET_IQN:?}" "${HOST_ADDR:?}" "${PORT_OPT:?}" "${PORT_NONOPT:?}" "${INIT_A:?}" "${INIT_B:?}"
: "${CHAP_USER:?}" "${CHAP_SECRET:?}" "${MUTUAL_USER:?}" "${MUTUAL_SECRET:?}" "${DISC_USER:?}" "${DISC_SECRET:?}"
REPORT=${REPORT:-/dev/ttyS1}
# The portals with their target portal group tags (ferrosan's portal groups 1 and 2).
PORTAL_OPT=$HOST_ADDR:$PORT_OPT,1 PORTAL_NONOPT=$HOST_ADDR:$PORT_NONOPT,2
ACKS=/host/acks
WORK=/tmp/kiscsi
mkdir -p "$WORK"
: >"$WORK/state"
# Block numbers (512-byte blocks) of the regions each check uses, so no check reads another's data.
LBA_PR=4096 LBA_CAW=8192 LBA_WS=16384 LBA_WSU=20480 LBA_UNMAP=24576 LBA_XSRC=32768 LBA_XDST=40960
FIO_OPT_OFFSET=64M FIO_CUT_OFFSET=128M FIO_KILL_OFFSET=256M FIO_TERM_OFFSET=320M FIO_ALUA_OFFSET=384M
FIO_CUT_SIZE=$((40 << 20)) FIO_RESTART_SIZE=$((32 << 20))

# The checks, in order (check_NAME, dashes as underscores, runs each): login, then the SCSI
# checks on the sd devices, then multipath-map, then those on the multipath device.
SCSI_CHECKS=(chap-refused discovery-chap inquiry vpd-di vpd-bl vpd-lbpv rtpg pr-register pr-reserve pr-conflict pr-read-both
    pr-preempt pr-release-clear caw-match caw-miscompare write-same write-same-unmap unmap xcopy)
MP_CHECKS=(multipath-optimized-io failover-cut failback fio-verify-cut
    alua-unavailable alua-optimized-again fio-verify-alua restart-kill fio-verify-restart-kill restart-term fio-verify-restart-term)
CHECKS=(login "${SCSI_CHECKS[@]}" multipath-map "${MP_CHECKS[@]}")

# ---------------------------------------------------------------------------------------------
# Sessions and disks

# node_setup PORTAL IFACE: a node record for the target at PORTAL (ADDRESS:PORT,TPGT) through
# IFACE, with timeouts short enough that a lost path fails over in seconds, not minutes: a
# NOP-Out every 2 s answered within 3 s, and the session's commands failed to dm-multipath 5 s
# after the connection is lost (replacement_timeout) while iscsid keeps trying to log in again.
# The portal group tag must be given: without it, records of one portal through two ifaces are
# one record (the second replaces the first).
node_setup() {
    local portal=$1 iface=$2 secret=${3:-$CHAP_SECRET} target_secret=${4:-$MUTUAL_SECRET} kv
    # Created by hand, not by discovery: ferrosan's SendTargets lists its 127.0.0.1 listeners,
    # which the guest cannot reach (it sees the host's loopback as 10.0.2.2).
    iscsiadm -m node -o new -T "$TARGET_IQN" -p "$portal" -I "$iface" >/dev/null
    # Mutual CHAP, the strongest algorithm first (ferrosan prefers SHA3-256 too).
    for kv in node.session.timeo.replacement_timeout=5 node.conn[0].timeo.noop_out_interval=2 \
        node.conn[0].timeo.noop_out_timeout=3 node.conn[0].timeo.login_timeout=5 \
        node.session.initial_login_retry_max=2 node.session.auth.authmethod=CHAP \
        node.session.auth.chap_algs=SHA3-256,SHA256,SHA1,MD5 \
        "node.session.auth.username=$CHAP_USER" "node.session.auth.password=$secret" \
        "node.session.auth.username_in=$MUTUAL_USER" "node.session.auth.password_in=$target_secret"; do
        iscsiadm -m node -T "$TARGET_IQN" -p "$portal" -I "$iface" -o update \
            -n "${kv%%=*}" -v "${kv#*=}"
    done
}

# node_login PORTAL IFACE
node_login() { iscsiadm -m node -T "$TARGET_IQN" -p "$1" -I "$2" --login; }

# session_disk PORT IFACE: the sd name of LUN 0 of the session to PORT through IFACE.
session_disk() {
    iscsiadm -m session -P3 2>/dev/null | awk -v p="$HOST_ADDR:$1," -v i="$2" '
        /Current Portal:/ { portal = $3 }
        /Iface Name:/ { iface = $3 }
        /Attached scsi disk/ { if (index(portal, p) == 1 && iface == i) print $4 }'
}

# wait_disk PORT IFACE: wait (20 s) for the session's disk; prints it.
wait_disk() {
    local i d
    for ((i = 0; i < 40; i++)); do
        d=$(session_disk "$1" "$2")
        if [[ -n $d && -b /dev/$d ]]; then
            echo "$d"
            return 0
        fi
        sleep 0.5
    done
    return 1
}

# stat_ios DISK: reads + writes the block layer completed on DISK (passthrough commands such as
# multipathd's TEST UNIT READY are not counted there).
stat_ios() { awk '{ print $1 + $5 }' "/sys/block/$1/stat"; }

# ---------------------------------------------------------------------------------------------
# Checks

# Three sessions: initiator A to both portals (the multipath pair) and initiator B to the
# optimized portal (the second I_T nexus of the reservation checks, its own initiator name
# through an open-iscsi iface).
check_login() {
    echo "InitiatorName=$INIT_A" >/etc/iscsi/initiatorname.iscsi
    iscsid
    local i
    for ((i = 0; i < 50; i++)); do
        iscsiadm -m session >/dev/null 2>&1 && break
        [[ $(iscsiadm -m session 2>&1) == *"No active sessions"* ]] && break
        sleep 0.2
    done
    # One open-iscsi iface per initiator name: A's two paths and B's session.
    local ifc
    for ifc in nodea nodeb; do
        iscsiadm -m iface -I $ifc -o new >/dev/null
        iscsiadm -m iface -I $ifc -o update -n iface.transport_name -v tcp >/dev/null
    done
    iscsiadm -m iface -I nodea -o update -n iface.initiatorname -v "$INIT_A" >/dev/null
    iscsiadm -m iface -I nodeb -o update -n iface.initiatorname -v "$INIT_B" >/dev/null
    node_setup "$PORTAL_OPT" nodea
    node_setup "$PORTAL_NONOPT" nodea
    node_setup "$PORTAL_OPT" nodeb
    node_login "$PORTAL_OPT" nodea || fail "initiator A: login to $PORTAL_OPT failed"
    node_login "$PORTAL_NONOPT" nodea || fail "initiator A: login to $PORTAL_NONOPT failed"
    node_login "$PORTAL_OPT" nodeb || fail "initiator B: login to $PORTAL_OPT failed"
    udevadm settle --timeout=20 || true
    iscsiadm -m session
    DISK_OPT=$(wait_disk "$PORT_OPT" nodea) || fail "no disk on initiator A's session to port $PORT_OPT"
    DISK_NONOPT=$(wait_disk "$PORT_NONOPT" nodea) || fail "no disk on initiator A's session to port $PORT_NONOPT"
    DISK_B=$(wait_disk "$PORT_OPT" nodeb) || fail "no disk on initiator B's session"
    echo "disks: A optimized $DISK_OPT, A non-optimized $DISK_NONOPT, B $DISK_B"
    save "DISK_OPT=$DISK_OPT" "DISK_NONOPT=$DISK_NONOPT" "DISK_B=$DISK_B"
}

# CHAP refuses: a wrong secret gets no session (the target refuses the initiator), nor does a
# target that cannot prove itself with the secret the initiator expects (mutual CHAP: the
# initiator refuses the target). Each through its own iface and node record, removed after.
check_chap_refused() {
    local before after case secret target_secret
    before=$(iscsiadm -m session 2>/dev/null | wc -l)
    for case in initiator target; do
        secret=$CHAP_SECRET target_secret=$MUTUAL_SECRET
        if [[ $case == initiator ]]; then secret=wrong-$CHAP_SECRET; else target_secret=wrong-$MUTUAL_SECRET; fi
        iscsiadm -m iface -I bad$case -o new >/dev/null
        iscsiadm -m iface -I bad$case -o update -n iface.transport_name -v tcp >/dev/null
        iscsiadm -m iface -I bad$case -o update -n iface.initiatorname -v "$INIT_B" >/dev/null
        node_setup "$PORTAL_OPT" bad$case "$secret" "$target_secret"
        if node_login "$PORTAL_OPT" bad$case; then
            fail "a login with a wrong $case secret succeeded"
        fi
        echo "a wrong $case secret: login refused, as it must be"
        iscsiadm -m node -T "$TARGET_IQN" -p "$PORTAL_OPT" -I bad$case -o delete || true
        iscsiadm -m iface -I bad$case -o delete >/dev/null || true
    done
    after=$(iscsiadm -m session 2>/dev/null | wc -l)
    ((after == before)) || fail "sessions went from $before to $after"
}

# SendTargets discovery as ESXi's software adapter does it with CHAP "required": the initiator
# offers CHAP only (open-iscsi's discovery.sendtargets.auth.authmethod = CHAP). With the
# discovery credentials ([discovery] users) the target is listed; with a wrong secret, or with
# no CHAP at all, discovery is refused. The records it makes (of the host's 127.0.0.1
# listeners, unreachable from here) are removed.
check_discovery_chap() {
    local portal=$HOST_ADDR:$PORT_OPT out secret
    for secret in "wrong-$DISC_SECRET" "$DISC_SECRET"; do
        iscsiadm -m discoverydb -t st -p "$portal" -o new >/dev/null
        iscsiadm -m discoverydb -t st -p "$portal" -o update \
            -n discovery.sendtargets.auth.authmethod -v CHAP >/dev/null
        iscsiadm -m discoverydb -t st -p "$portal" -o update \
            -n discovery.sendtargets.auth.username -v "$DISC_USER" >/dev/null
        iscsiadm -m discoverydb -t st -p "$portal" -o update \
            -n discovery.sendtargets.auth.password -v "$secret" >/dev/null
        if out=$(iscsiadm -m discoverydb -t st -p "$portal" --discover 2>&1); then
            [[ $secret == "$DISC_SECRET" ]] || fail "discovery with a wrong CHAP secret listed: $out"
            grep -q "$TARGET_IQN" <<<"$out" || fail "CHAP discovery did not list $TARGET_IQN: $out"
            echo "CHAP-only discovery lists: $out"
        else
            [[ $secret != "$DISC_SECRET" ]] || fail "CHAP-only discovery with the right secret failed: $out"
            echo "a wrong discovery secret: refused ($out)"
        fi
        iscsiadm -m discoverydb -t st -p "$portal" -o delete >/dev/null 2>&1 || true
    done
    if out=$(iscsiadm -m discovery -t st -p "$portal" 2>&1); then
        fail "discovery without CHAP listed targets though [discovery] requires it: $out"
    fi
    echo "discovery without CHAP: refused ($out)"
    iscsiadm -m discoverydb -t st -p "$portal" -o delete >/dev/null 2>&1 || true
    iscsiadm -m node 2>/dev/null | awk '$1 ~ /^127\.0\.0\.1:/ { print $1, $2 }' |
        while read -r p t; do iscsiadm -m node -T "$t" -p "${p%,*}" -o delete >/dev/null 2>&1 || true; done
}

# Standard INQUIRY on both of A's paths: the same vendor and product, and byte 5's TPGS field
# = 01b (implicit ALUA: ferrosan changes states itself; SET TARGET PORT GROUPS is not offered
# outside RBD gateways), which is what makes Linux's ALUA handler and prioritizer apply.
check_inquiry() {
    local d out vendor product tpgs byte5 byte6
    for d in "$DISK_OPT" "$DISK_NONOPT"; do
        out=$(sg_inq "/dev/$d") || fail "sg_inq /dev/$d failed"
        echo "$out"
        vendor=$(sed -n 's/^ *Vendor identification: *//p' <<<"$out" | sed 's/ *$//')
        product=$(sed -n 's/^ *Product identification: *//p' <<<"$out" | sed 's/ *$//')
        tpgs=$(grep -o 'TPGS=[0-9]' <<<"$out" | cut -d= -f2)
        [[ $vendor == FERROSAN ]] || fail "/dev/$d: vendor '$vendor', expected FERROSAN"
        [[ -n $product ]] || fail "/dev/$d: empty product identification"
        [[ $tpgs == 1 ]] || fail "/dev/$d: TPGS=$tpgs in byte 5, expected 1 (implicit ALUA)"
        # Byte 5 from the raw bytes too (sg_inq decodes it; this shows what it decoded).
        byte5=$(sg_inq --raw "/dev/$d" | od -An -tx1 -j5 -N1 | tr -d ' ')
        (((0x$byte5 >> 4 & 3) == 1)) || fail "/dev/$d: INQUIRY byte 5 is 0x$byte5: TPGS bits are not 01b"
        # MULTIP (byte 6, bit 4): the target has more than one port.
        byte6=$(sg_inq --raw "/dev/$d" | od -An -tx1 -j6 -N1 | tr -d ' ')
        (((0x$byte6 & 0x10) != 0)) || fail "/dev/$d: INQUIRY byte 6 is 0x$byte6: MULTIP not set for a two-port target"
        printf '%s\n' "$vendor" >"$WORK/vendor.$d"
        printf '%s\n' "$product" >"$WORK/product.$d"
    done
    if ! cmp -s "$WORK/vendor.$DISK_OPT" "$WORK/vendor.$DISK_NONOPT" \
        || ! cmp -s "$WORK/product.$DISK_OPT" "$WORK/product.$DISK_NONOPT"; then
        fail "the two paths report different vendor/product"
    fi
    cp "$WORK/vendor.$DISK_OPT" "$WORK/vendor"
    cp "$WORK/product.$DISK_OPT" "$WORK/product"
}

# vpd_di DISK: VPD page 83h decoded, one designator per line as "KIND VALUE" (naa, tpg, rtp).
vpd_di() {
    sg_vpd -p di "/dev/$1" | awk '
        /designator type: NAA/ { want = "naa"; next }
        want == "naa" && /0x[0-9a-f]+/ { print "naa", $1; want = ""; next }
        /Relative target port:/ { print "rtp", $NF }
        /Target port group:/ { print "tpg", $NF }'
}

# VPD 83h: an NAA designator for the LU (the same through both ports: one LU, which is what lets
# multipath join the paths), and per port its target port group (1 behind the optimized portal,
# 2 behind the other) and relative target port (different ports).
check_vpd_di() {
    sg_vpd -p di "/dev/$DISK_OPT"
    local a b
    a=$(vpd_di "$DISK_OPT") b=$(vpd_di "$DISK_NONOPT")
    printf 'optimized path:\n%s\nnon-optimized path:\n%s\n' "$a" "$b"
    local naa_a naa_b
    naa_a=$(awk '$1 == "naa" { print $2 }' <<<"$a") naa_b=$(awk '$1 == "naa" { print $2 }' <<<"$b")
    [[ -n $naa_a ]] || fail "no NAA designator in VPD 83h of /dev/$DISK_OPT"
    [[ $naa_a == "$naa_b" ]] || fail "NAA differs between the paths: $naa_a / $naa_b"
    [[ $(awk '$1 == "tpg" { print $2 + 0 }' <<<"$a") == 1 ]] \
        || fail "target port group designator of the optimized path is not 1: $(grep tpg <<<"$a")"
    [[ $(awk '$1 == "tpg" { print $2 + 0 }' <<<"$b") == 2 ]] \
        || fail "target port group designator of the non-optimized path is not 2: $(grep tpg <<<"$b")"
    local rtp_a rtp_b
    rtp_a=$(awk '$1 == "rtp" { print $2 }' <<<"$a") rtp_b=$(awk '$1 == "rtp" { print $2 }' <<<"$b")
    [[ -n $rtp_a && -n $rtp_b ]] || fail "a relative target port designator is missing ($rtp_a / $rtp_b)"
    [[ $rtp_a != "$rtp_b" ]] || fail "both paths report relative target port $rtp_a"
}

# field TEXT LABEL: the value after "LABEL:" in sg3-utils' decoded output.
field() { sed -n "s/^ *$2: *\([^ ]*\).*/\1/p" <<<"$1" | head -n1; }

# Block Limits VPD (B0h): the limits Linux takes for discard and WRITE SAME: a thin LU must
# give a non-zero UNMAP LBA count and descriptor count, and COMPARE AND WRITE needs a
# non-zero maximum compare and write length.
check_vpd_bl() {
    local out v
    out=$(sg_vpd -p bl "/dev/$DISK_OPT") || fail "sg_vpd -p bl failed"
    echo "$out"
    for v in "Maximum unmap LBA count" "Maximum unmap block descriptor count" \
        "Maximum compare and write length" "Maximum write same length"; do
        local n
        n=$(field "$out" "$v")
        [[ $n =~ ^(0x)?[0-9a-f]+$ || $n == unlimited ]] || fail "B0h: no '$v' in the page"
        [[ $n == unlimited ]] || ((n > 0)) || fail "B0h: $v is $n"
    done
}

# Logical Block Provisioning VPD (B2h): UNMAP and WRITE SAME(16)/(10) with UNMAP supported (thin).
check_vpd_lbpv() {
    local out v
    out=$(sg_vpd -p lbpv "/dev/$DISK_OPT") || fail "sg_vpd -p lbpv failed"
    echo "$out"
    for v in "Unmap command supported (LBPU)" "Write same (16) with unmap bit supported (LBPWS)" \
        "Write same (10) with unmap bit supported (LBPWS10)"; do
        [[ $(field "$out" "$v") == 1 ]] || fail "B2h: '$v' is not 1"
    done
}

# rtpg_states DISK: "GROUP STATE" per target port group of REPORT TARGET PORT GROUPS.
rtpg_states() {
    sg_rtpg -d "/dev/$1" | awk '
        /target port group id/ { g = $6; sub(",", "", g); g = g + 0 }
        /asymmetric access state/ { s = $0; sub(/.*\(/, "", s); sub(/\).*/, "", s); print g, s }'
}

# REPORT TARGET PORT GROUPS through both paths: group 1 active/optimized, group 2
# active/non-optimized, and both paths agree.
check_rtpg() {
    local d out
    for d in "$DISK_OPT" "$DISK_NONOPT"; do
        sg_rtpg -d "/dev/$d" || fail "sg_rtpg /dev/$d failed"
        out=$(rtpg_states "$d")
        echo "parsed: $out"
        grep -qx '1 active/optimized' <<<"$out" || fail "/dev/$d: group 1 is not active/optimized: $out"
        grep -qx '2 active/non optimized' <<<"$out" || fail "/dev/$d: group 2 is not active/non-optimized: $out"
        [[ $(wc -l <<<"$out") == 2 ]] || fail "/dev/$d: expected two target port groups: $out"
    done
}

# --- persistent reservations between initiator A ($DISK_OPT) and initiator B ($DISK_B) -------
KEY_A=0xa1 KEY_B=0xb2

# clear_ua DISK: consume pending unit attentions (a PR change raises them for other nexuses),
# so the next command reports its own status.
clear_ua() {
    local i
    for ((i = 0; i < 4; i++)); do
        sg_turs "/dev/$1" >/dev/null 2>&1 && return 0
    done
    return 0
}

# scsi_write DISK LBA FILE: WRITE(10) of one block from FILE by sg_raw; prints sg_raw's status
# line(s); the exit status is sg_raw's.
scsi_write() {
    local lba
    lba=$(printf '%08x' "$2")
    sg_raw -s 512 -i "$3" "/dev/$1" 2a 00 "${lba:0:2}" "${lba:2:2}" "${lba:4:2}" "${lba:6:2}" 00 00 01 00 2>&1
}
scsi_read() {
    local lba
    lba=$(printf '%08x' "$2")
    sg_raw -r 512 -o "$3" "/dev/$1" 28 00 "${lba:0:2}" "${lba:2:2}" "${lba:4:2}" "${lba:6:2}" 00 00 01 00 2>&1
}

read_keys() { sg_persist --no-inquiry --in --read-keys "/dev/$1"; }
read_resv() { sg_persist --no-inquiry --in --read-reservation "/dev/$1"; }

check_pr_register() {
    sg_persist --no-inquiry --out --register --param-sark=$KEY_A "/dev/$DISK_OPT" \
        || fail "REGISTER of key $KEY_A through A failed"
    sg_persist --no-inquiry --out --register --param-sark=$KEY_B "/dev/$DISK_B" \
        || fail "REGISTER of key $KEY_B through B failed"
    local keys
    keys=$(read_keys "$DISK_OPT")
    echo "$keys"
    if ! grep -qw "$KEY_A" <<<"$keys" || ! grep -qw "$KEY_B" <<<"$keys"; then
        fail "READ KEYS does not list both keys: $keys"
    fi
}

# Write Exclusive (type 1) held by A: B is registered but not the holder, so B may read and must
# get RESERVATION CONFLICT on a write; A writes. (Not Write Exclusive - Registrants Only: there
# the registered B could write.)
check_pr_reserve() {
    sg_persist --no-inquiry --out --reserve --param-rk=$KEY_A --prout-type=1 "/dev/$DISK_OPT" \
        || fail "RESERVE (Write Exclusive) through A failed"
    head -c 512 /dev/urandom >"$WORK/pr-a.bin"
    clear_ua "$DISK_OPT"
    scsi_write "$DISK_OPT" $LBA_PR "$WORK/pr-a.bin" || fail "the holder A cannot write: $(scsi_write "$DISK_OPT" $LBA_PR "$WORK/pr-a.bin")"
}

check_pr_conflict() {
    local out rc=0
    head -c 512 /dev/urandom >"$WORK/pr-b.bin"
    clear_ua "$DISK_B"
    out=$(scsi_write "$DISK_B" $LBA_PR "$WORK/pr-b.bin") || rc=$?
    echo "B's WRITE(10) under A's Write Exclusive: exit $rc: $out"
    grep -qi 'reservation conflict' <<<"$out" || fail "B's write was not refused with RESERVATION CONFLICT (exit $rc: $out)"
    scsi_read "$DISK_B" $LBA_PR "$WORK/pr-read.bin" || fail "B cannot read under Write Exclusive"
    cmp -s "$WORK/pr-read.bin" "$WORK/pr-a.bin" || fail "B reads other data than A wrote (did B's write land?)"
}

# READ KEYS and READ RESERVATION give the same answer through both nexuses.
check_pr_read_both() {
    local d r
    for d in "$DISK_OPT" "$DISK_B"; do
        r=$(read_resv "$d")
        echo "/dev/$d: $r"
        grep -qi "Key=$KEY_A" <<<"$r" || fail "/dev/$d: the reservation is not held by $KEY_A: $r"
        grep -qi 'Write Exclusive' <<<"$r" || fail "/dev/$d: the reservation type is not Write Exclusive: $r"
        grep -qiw "$KEY_B" <<<"$(read_keys "$d")" || fail "/dev/$d: READ KEYS lacks $KEY_B"
    done
}

# B preempts A, taking the reservation as Exclusive Access (type 3): A's registration goes, B
# holds the reservation, and A — no longer registered — gets RESERVATION CONFLICT on a write and,
# under Exclusive Access, on a read too.
check_pr_preempt() {
    sg_persist --no-inquiry --out --preempt --param-rk=$KEY_B --param-sark=$KEY_A --prout-type=3 "/dev/$DISK_B" \
        || fail "PREEMPT of $KEY_A by B failed"
    local keys r out rc=0
    keys=$(read_keys "$DISK_B")
    # A's nexus has a unit attention now (REGISTRATIONS PREEMPTED, SPC-4 5.14.11.2.4).
    clear_ua "$DISK_OPT"
    r=$(read_resv "$DISK_OPT")
    echo "$keys"
    echo "$r"
    ! grep -qiw "$KEY_A" <<<"$keys" || fail "A's key is still registered after the preempt: $keys"
    grep -qi "Key=$KEY_B" <<<"$r" || fail "B does not hold the reservation after the preempt: $r"
    grep -qi 'type: Exclusive Access' <<<"$r" || fail "the reservation is not Exclusive Access after the preempt: $r"
    clear_ua "$DISK_OPT"
    out=$(scsi_write "$DISK_OPT" $LBA_PR "$WORK/pr-a.bin") || rc=$?
    echo "A's WRITE(10) after the preempt: exit $rc: $out"
    grep -qi 'reservation conflict' <<<"$out" || fail "A's write after the preempt: no RESERVATION CONFLICT (exit $rc: $out)"
    rc=0
    out=$(scsi_read "$DISK_OPT" $LBA_PR "$WORK/pr-read.bin") || rc=$?
    echo "A's READ(10) under B's Exclusive Access: exit $rc: $out"
    grep -qi 'reservation conflict' <<<"$out" || fail "A's read under Exclusive Access: no RESERVATION CONFLICT (exit $rc: $out)"
    scsi_write "$DISK_B" $LBA_PR "$WORK/pr-b.bin" >/dev/null || fail "the holder B cannot write"
}

check_pr_release_clear() {
    sg_persist --no-inquiry --out --release --param-rk=$KEY_B --prout-type=3 "/dev/$DISK_B" \
        || fail "RELEASE by B failed"
    local r keys
    r=$(read_resv "$DISK_OPT")
    echo "$r"
    grep -qi 'no reservation' <<<"$r" || fail "a reservation is still held after RELEASE: $r"
    clear_ua "$DISK_OPT"
    scsi_write "$DISK_OPT" $LBA_PR "$WORK/pr-a.bin" >/dev/null || fail "A cannot write after the release"
    sg_persist --no-inquiry --out --clear --param-rk=$KEY_B "/dev/$DISK_B" || fail "CLEAR by B failed"
    keys=$(read_keys "$DISK_OPT")
    echo "$keys"
    grep -qi 'there are NO registered reservation keys' <<<"$keys" || fail "keys remain after CLEAR: $keys"
    clear_ua "$DISK_OPT"
    clear_ua "$DISK_B"
}

# read_blocks DISK LBA COUNT FILE: read through the block layer, bypassing the page cache
# (sg3-utils' commands bypass it too, so a cached read could show stale data).
# 64 KiB requests: block-sized ones crawl under emulation.
read_blocks() {
    dd if="/dev/$1" of="$4" bs=64k skip=$(($2 * 512)) count=$(($3 * 512)) \
        iflag=direct,skip_bytes,count_bytes status=none
}
write_blocks() {
    dd if="$4" of="/dev/$1" bs=64k seek=$(($2 * 512)) count=$(($3 * 512)) \
        iflag=count_bytes oflag=direct,seek_bytes conv=notrunc status=none
}

# COMPARE AND WRITE: with the right old data the new data is written; with the wrong old data
# the target answers MISCOMPARE (sg_compare_and_write exits 14) and writes nothing.
check_caw_match() {
    head -c 512 /dev/urandom >"$WORK/caw-old.bin"
    head -c 512 /dev/urandom >"$WORK/caw-new.bin"
    write_blocks "$DISK_OPT" $LBA_CAW 1 "$WORK/caw-old.bin"
    cat "$WORK/caw-old.bin" "$WORK/caw-new.bin" >"$WORK/caw-1.bin"
    sg_compare_and_write --in="$WORK/caw-1.bin" --lba=$LBA_CAW --num=1 --xferlen=1024 "/dev/$DISK_OPT" \
        || fail "COMPARE AND WRITE with matching data failed (exit $?)"
    read_blocks "$DISK_OPT" $LBA_CAW 1 "$WORK/caw-read.bin"
    cmp -s "$WORK/caw-read.bin" "$WORK/caw-new.bin" || fail "the block does not hold the new data after COMPARE AND WRITE"
}

check_caw_miscompare() {
    local rc=0
    head -c 512 /dev/urandom >"$WORK/caw-other.bin"
    # The block holds caw-new.bin now: comparing against caw-old.bin must miscompare.
    cat "$WORK/caw-old.bin" "$WORK/caw-other.bin" >"$WORK/caw-2.bin"
    sg_compare_and_write --in="$WORK/caw-2.bin" --lba=$LBA_CAW --num=1 --xferlen=1024 "/dev/$DISK_OPT" || rc=$?
    ((rc == 14)) || fail "COMPARE AND WRITE with wrong old data: exit $rc, expected 14 (MISCOMPARE)"
    read_blocks "$DISK_OPT" $LBA_CAW 1 "$WORK/caw-read.bin"
    cmp -s "$WORK/caw-read.bin" "$WORK/caw-new.bin" || fail "a miscompared COMPARE AND WRITE changed the block"
}

# lba_status DISK LBA: GET LBA STATUS's answer for the extent starting at LBA: "BLOCKS STATE",
# from sg_get_lba_status lines such as "[1] LBA: 0x0000000000001000  blocks:  2048  deallocated".
lba_status() {
    local out idx _l start _b blocks state
    out=$(sg_get_lba_status --lba="$2" "/dev/$1") || return 1
    echo "$out" >&2
    while read -r idx _l start _b blocks state; do
        [[ $idx == '[1]' && $start == 0x* ]] || continue
        ((start == $2)) && echo "$blocks $state"
    done <<<"$out"
}

# expect_zero_and_unmapped DISK LBA COUNT WHAT: reads zeros (LBPRZ) and GET LBA STATUS reports
# the extent deallocated.
expect_zero_and_unmapped() {
    read_blocks "$1" "$2" "$3" "$WORK/zero-read.bin"
    cmp -s "$WORK/zero-read.bin" <(head -c $(($3 * 512)) /dev/zero) || fail "$4: the range does not read back as zeros"
    local st
    st=$(lba_status "$1" "$2")
    echo "GET LBA STATUS at $2: $st"
    [[ $st == *deallocated* ]] || fail "$4: GET LBA STATUS does not report the range deallocated: '$st'"
    (($(awk '{ print $1 }' <<<"$st") >= $3)) || fail "$4: only part of the range is deallocated: '$st'"
}

# WRITE SAME without UNMAP: one block's pattern repeated over 2048 blocks.
check_write_same() {
    head -c 512 /dev/urandom >"$WORK/ws-block.bin"
    sg_write_same --in="$WORK/ws-block.bin" --lba=$LBA_WS --num=2048 "/dev/$DISK_OPT" || fail "WRITE SAME failed"
    read_blocks "$DISK_OPT" $LBA_WS 2048 "$WORK/ws-read.bin"
    # The block 2048 times: doubled 11 times (a loop of 2048 cats takes a minute under TCG).
    local i
    cp "$WORK/ws-block.bin" "$WORK/ws-expect.bin"
    for ((i = 0; i < 11; i++)); do
        cat "$WORK/ws-expect.bin" "$WORK/ws-expect.bin" >"$WORK/ws-double.bin"
        mv "$WORK/ws-double.bin" "$WORK/ws-expect.bin"
    done
    cmp "$WORK/ws-read.bin" "$WORK/ws-expect.bin" || fail "WRITE SAME: the range does not repeat the block"
}

# WRITE SAME(16) with UNMAP over data: zeros read back and the range is deallocated.
check_write_same_unmap() {
    head -c $((2048 * 512)) /dev/urandom >"$WORK/wsu-data.bin"
    write_blocks "$DISK_OPT" $LBA_WSU 2048 "$WORK/wsu-data.bin"
    sg_write_same --16 --unmap --lba=$LBA_WSU --num=2048 "/dev/$DISK_OPT" || fail "WRITE SAME(16) with UNMAP failed"
    expect_zero_and_unmapped "$DISK_OPT" $LBA_WSU 2048 "WRITE SAME with UNMAP"
}

check_unmap() {
    head -c $((2048 * 512)) /dev/urandom >"$WORK/unmap-data.bin"
    write_blocks "$DISK_OPT" $LBA_UNMAP 2048 "$WORK/unmap-data.bin"
    local st
    st=$(lba_status "$DISK_OPT" $LBA_UNMAP)
    [[ $st == *mapped* && $st != *deallocated* ]] || fail "written data is not reported mapped: '$st'"
    # --force: no 15 s "data will be LOST" countdown.
    sg_unmap --force --lba=$LBA_UNMAP --num=2048 "/dev/$DISK_OPT" || fail "UNMAP failed"
    expect_zero_and_unmapped "$DISK_OPT" $LBA_UNMAP 2048 "UNMAP"
}

# EXTENDED COPY (LID1) from the LU through the optimized port to the same LU through the other
# port (sg_xcopy names both by their VPD 83h designators): the target copies 2 MiB itself.
check_xcopy() {
    head -c $((4096 * 512)) /dev/urandom >"$WORK/xcopy-src.bin"
    write_blocks "$DISK_OPT" $LBA_XSRC 4096 "$WORK/xcopy-src.bin"
    write_blocks "$DISK_OPT" $LBA_XDST 4096 /dev/zero
    sg_xcopy if="/dev/$DISK_OPT" of="/dev/$DISK_NONOPT" bs=512 skip=$LBA_XSRC seek=$LBA_XDST count=4096 \
        || fail "sg_xcopy failed (exit $?)"
    read_blocks "$DISK_NONOPT" $LBA_XDST 4096 "$WORK/xcopy-read.bin"
    cmp "$WORK/xcopy-read.bin" "$WORK/xcopy-src.bin" || fail "the copied range differs from the source"
}

# --- dm-multipath ---------------------------------------------------------------------------

# The map's paths as "DEV PRIO GROUP_STATUS DM_STATE": from multipath -ll's topology.
map_paths() {
    multipath -ll "$MAP" 2>/dev/null | awk '
        /policy=/ { prio = $0; sub(/.*prio=/, "", prio); sub(/ .*/, "", prio)
                    st = $0; sub(/.*status=/, "", st); sub(/ .*/, "", st) }
        /[0-9]+:[0-9]+:[0-9]+:[0-9]+ sd/ { for (i = 1; i <= NF; i++) if ($i ~ /^sd/) print $i, prio, st, $(i + 2), $(i + 3) }'
}

# path_state DEV: dm's view of the path (active/failed) and the checker's (ready/faulty/...).
path_state() { multipathd show paths raw format "%d %t %T" 2>/dev/null | awk -v d="$1" '$1 == d { print $2, $3 }'; }

# The optimized path is in the active group (prio 50 for active/optimized with prio alua).
opt_group_active() { map_paths | awk -v d="$DISK_OPT" '$1 == d && $3 == "active" { f = 1 } END { exit !f }'; }


# multipath.conf for ferrosan's LUs as INQUIRY reports them, as a Linux host would set it: ALUA
# groups by priority, the ALUA hardware handler, I/O queued while no path is left (no_path_retry
# queue: a daemon restart must not fail I/O), and back to the optimized group as soon as it is up.
write_multipath_conf() {
    local vendor product
    vendor=$(cat "$WORK/vendor") product=$(cat "$WORK/product")
    mkdir -p /etc/multipath
    cat >/etc/multipath.conf <<CONF
defaults {
    user_friendly_names no
    find_multipaths no
    polling_interval 2
}
blacklist {
    devnode "^vd[a-z]"
}
devices {
    device {
        vendor "^${vendor}\$"
        product "^${product}\$"
        path_grouping_policy group_by_prio
        prio alua
        hardware_handler "1 alua"
        path_checker tur
        path_selector "service-time 0"
        no_path_retry queue
        failback immediate
    }
}
CONF
    cat /etc/multipath.conf
}

two_paths() { [[ $(map_paths | wc -l) == 2 ]]; }
paths_ready() { [[ $(multipathd show paths raw format '%d %t %T' | grep -c 'active ready') == 2 ]]; }
have_map() {
    local maps
    maps=$(dmsetup ls --target multipath 2>/dev/null)
    [[ -n $maps && $maps != *"No devices"* ]]
}

# Initiator B's session goes (it is not a multipath path; reservation checks are done), then
# multipathd builds the map of A's two paths.
check_multipath_map() {
    iscsiadm -m node -T "$TARGET_IQN" -p "$PORTAL_OPT" -I nodeb --logout >/dev/null
    write_multipath_conf
    multipathd -d -s -v3 >/tmp/multipathd.log 2>&1 &
    wait_until 30 have_map || fail "multipathd made no map within 30 s"
    MAP=$(dmsetup ls --target multipath | awk 'NR == 1 { print $1 }')
    save "MAP=$MAP"
    wait_until 30 two_paths || true
    multipath -ll "$MAP" | cat
    local paths
    paths=$(map_paths)
    echo "parsed: $paths"
    [[ $(dmsetup ls --target multipath | wc -l) == 1 ]] || fail "more than one map: $(dmsetup ls --target multipath)"
    [[ $(wc -l <<<"$paths") == 2 ]] || fail "the map does not have two paths: $paths"
    grep -q "^$DISK_OPT 50 active " <<<"$paths" || fail "the optimized path $DISK_OPT is not in an active group of prio 50: $paths"
    grep -q "^$DISK_NONOPT 10 enabled " <<<"$paths" || fail "the non-optimized path $DISK_NONOPT is not in an enabled group of prio 10: $paths"
    # (A whole output in a variable, not grep -q on a pipe: with pipefail, grep leaving early
    # could fail the check.)
    local ll
    ll=$(multipath -ll "$MAP")
    grep -q "hwhandler='1 alua'" <<<"$ll" || fail "the map has no ALUA hardware handler"
    # queue_if_no_path comes from no_path_retry queue: it shows that our device section applied
    # (multipath-tools' own default is to fail I/O when no path is left).
    grep -q "queue_if_no_path" <<<"$ll" || fail "the map does not queue without paths"
}

# fio_run NAME OFFSET SIZE [EXTRA...]: 16 KiB random writes, crc32c verified (the verify pass
# reads back every block written and stops at the first mismatch), direct I/O on the map.
# JSON result in $WORK/fio-NAME.json.
fio_run() {
    local name=$1 offset=$2 size=$3
    shift 3
    fio --name="$name" --filename="/dev/mapper/$MAP" --direct=1 --ioengine=libaio --iodepth=8 \
        --rw=randwrite --bs=16k --offset="$offset" --size="$size" \
        --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_dump=1 \
        --output-format=json --output="$WORK/fio-$name.json" "$@"
}

# fio_verdict NAME SIZE: fio exited 0 (in $WORK/fio-NAME.rc), no error, everything written
# and all of it read back by the verify pass.
fio_verdict() {
    local name=$1 bytes=$2 rc err w r
    rc=$(cat "$WORK/fio-$name.rc")
    ((rc == 0)) || fail "fio exited $rc: $(grep -m2 -iE 'verify|error' "$WORK/fio-$name.out" 2>/dev/null | tr '\n' ' ')"
    read -r err w r < <(fio_json "$WORK/fio-$name.json")
    echo "fio $name: error=$err written=$w verified=$r (expected $bytes)"
    ((err == 0)) || fail "fio reported error $err"
    ((w == bytes)) || fail "fio wrote $w bytes, expected $bytes"
    ((r == bytes)) || fail "the verify pass read $r bytes, expected $bytes"
}

# fio_json FILE: the first job's error, write and read io_bytes from fio's JSON, without python
# or jq in the guest (fio's JSON puts one key per line).
fio_json() {
    awk '
        /"error"/ && err == "" { gsub(/[^0-9]/, "", $0); err = $0 }
        /"read" : \{/ { sect = "read" }
        /"write" : \{/ { sect = "write" }
        /"trim" : \{/ { sect = "trim" }
        /"io_bytes"/ { v = $0; gsub(/[^0-9]/, "", v); if (sect == "read" && r == "") r = v; if (sect == "write" && w == "") w = v }
        END { print err, w, r }' "$1"
}

# A short mixed load on the map: the block layer's counters show where it went. With ALUA
# groups, all of it must take the optimized path (prio 50) and none the non-optimized one.
check_multipath_optimized_io() {
    local o0 n0 o1 n1
    o0=$(stat_ios "$DISK_OPT") n0=$(stat_ios "$DISK_NONOPT")
    fio --name=opt --filename="/dev/mapper/$MAP" --direct=1 --ioengine=libaio --iodepth=8 \
        --rw=randrw --bs=16k --offset=$FIO_OPT_OFFSET --size=16M --output-format=terse >/dev/null \
        || fail "fio on the map failed"
    o1=$(stat_ios "$DISK_OPT") n1=$(stat_ios "$DISK_NONOPT")
    echo "I/Os: optimized $DISK_OPT +$((o1 - o0)), non-optimized $DISK_NONOPT +$((n1 - n0))"
    # 16 MiB in 16 KiB I/Os: 1024 I/Os (the block layer may split or merge a few).
    ((o1 - o0 >= 900)) || fail "the optimized path carried only $((o1 - o0)) I/Os of ~1024"
    ((n1 - n0 <= 8)) || fail "the non-optimized path carried $((n1 - n0)) I/Os (optimized: $((o1 - o0)))"
}

# fio_start NAME OFFSET SIZE RATE: fio_run in the background, its write phase held to RATE
# bytes/s so that it is still writing when a path is cut or the daemon restarted (the verify
# pass runs at full speed). It outlives the check that starts it: $WORK/fio-NAME.rc appears
# when it ends.
fio_start() {
    rm -f "$WORK/fio-$1.rc"
    (
        set +e
        fio_run "$1" "$2" "$3" --rate=,"$4" >"$WORK/fio-$1.out" 2>&1
        echo $? >"$WORK/fio-$1.rc"
    ) &
}
fio_running() { [[ ! -e $WORK/fio-$1.rc ]]; }
# fio_wait NAME SECONDS: wait for fio NAME to end.
fio_wait() { wait_until "$2" test -e "$WORK/fio-$1.rc" || fail "fio $1 still running after $2 s"; }

# io_moves DISK SECONDS: DISK completes I/O within SECONDS.
io_moves() {
    local a i
    a=$(stat_ios "$1")
    for ((i = 0; i < $2 * 2; i++)); do
        sleep 0.5
        (($(stat_ios "$1") > a)) && return 0
    done
    return 1
}

path_failed() { [[ $(path_state "$DISK_OPT") == failed* ]]; }
path_back() { [[ $(path_state "$DISK_OPT") == "active ready" ]] && opt_group_active; }

# Cut the optimized path with a packet filter (a logout would be an orderly exit, not a lost
# path): NOP-Outs go unanswered, iscsid drops the connection, after replacement_timeout the
# session fails its commands and dm-multipath retries them on the non-optimized path.
check_failover_cut() {
    fio_start cut $FIO_CUT_OFFSET $FIO_CUT_SIZE 1m
    io_moves "$DISK_OPT" 20 || fail "fio's writes do not reach the optimized path"
    sleep 2
    local t0
    t0=$(now)
    nft add table inet kiscsi
    nft add chain inet kiscsi out '{ type filter hook output priority 0; }'
    nft add rule inet kiscsi out ip daddr "$HOST_ADDR" tcp dport "$PORT_OPT" drop
    echo "cut: TCP to $HOST_ADDR:$PORT_OPT dropped at $(now)"
    wait_until 60 path_failed || fail "the optimized path was not failed within 60 s of the cut: $(path_state "$DISK_OPT")"
    echo "the optimized path failed $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s after the cut"
    multipath -ll "$MAP" | cat
    fio_running cut || fail "fio ended before the failover was observed"
    io_moves "$DISK_NONOPT" 30 || fail "no I/O on the non-optimized path while the optimized one is cut"
    fio_running cut || fail "fio ended while the path was cut"
}

# Restore the path: iscsid logs in again, the TUR checker reinstates the path and, with
# failback immediate, the optimized group takes the I/O back.
check_failback() {
    nft delete table inet kiscsi 2>/dev/null || true
    local t0
    t0=$(now)
    echo "restored at $t0"
    wait_until 90 path_back || fail "the optimized path was not back in the active group within 90 s: $(path_state "$DISK_OPT"); $(map_paths | tr '\n' ';')"
    echo "back $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s after the restore"
    multipath -ll "$MAP" | cat
    io_moves "$DISK_OPT" 30 || fail "no I/O on the optimized path after the failback"
}

check_fio_verify_cut() {
    nft delete table inet kiscsi 2>/dev/null || true
    fio_wait cut 300
    cat "$WORK/fio-cut.out" 2>/dev/null || true
    fio_verdict cut $FIO_CUT_SIZE
}

ALUA_CHANGES=0
# alua_request GROUP STATE: ask the host to change portal group GROUP's ALUA state live, and
# wait for its answer.
alua_request() {
    local ack
    ALUA_CHANGES=$((ALUA_CHANGES + 1))
    save "ALUA_CHANGES=$ALUA_CHANGES"
    ack=$ACKS/alua-$ALUA_CHANGES
    report "HOST: alua $1 $2"
    wait_until 60 test -e "$ack" || fail "the host did not change portal group $1 within 60 s"
    echo "host: $(cat "$ack")"
    grep -q "^ok " "$ack" || fail "the host could not make portal group $1 $2: $(cat "$ack")"
}

opt_unavailable() { [[ $(path_state "$DISK_OPT") != "active ready" ]] && ! opt_group_active; }

# The operator takes the optimized group out of service under I/O (unavailable, live): every
# nexus gets ASYMMETRIC ACCESS STATE CHANGED, the kernel's ALUA handler reads the new state and
# dm-multipath moves the I/O to the non-optimized path, with no packet lost and no error.
check_alua_unavailable() {
    fio_start alua $FIO_ALUA_OFFSET $FIO_RESTART_SIZE 1m
    io_moves "$DISK_OPT" 20 || fail "fio's writes do not reach the optimized path"
    sleep 1
    local t0
    t0=$(now)
    alua_request 1 unavailable
    wait_until 60 opt_unavailable || fail "dm-multipath still uses group 1 60 s after it became unavailable: $(map_paths | tr '\n' ';')"
    echo "group 1 left $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s after the change"
    sg_rtpg --decode "/dev/$DISK_NONOPT" | cat
    multipath -ll "$MAP" | cat
    fio_running alua || fail "fio ended before the I/O moved"
    io_moves "$DISK_NONOPT" 30 || fail "no I/O on the non-optimized path while group 1 is unavailable"
    local a
    a=$(stat_ios "$DISK_OPT")
    sleep 2
    (($(stat_ios "$DISK_OPT") == a)) || fail "the unavailable path still completes I/O"
}

# Back in service, optimized: the I/O returns to it (failback immediate).
check_alua_optimized_again() {
    local t0
    t0=$(now)
    alua_request 1 active-optimized
    wait_until 90 path_back || fail "group 1 is not back in the active group 90 s after it became optimized: $(path_state "$DISK_OPT"); $(map_paths | tr '\n' ';')"
    echo "group 1 back $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s after the change"
    io_moves "$DISK_OPT" 30 || fail "no I/O on the optimized path after it was optimized again"
}

check_fio_verify_alua() {
    fio_wait alua 300
    cat "$WORK/fio-alua.out" 2>/dev/null || true
    fio_verdict alua $FIO_RESTART_SIZE
}

RESTARTS=0
# restart_during_fio MODE NAME OFFSET: ask the host to restart ferrosan (MODE KILL or TERM)
# while fio writes to the map, wait for the host's answer, then for I/O to flow again.
restart_during_fio() {
    local mode=$1 name=$2 offset=$3 t0 ack
    fio_start "$name" "$offset" $FIO_RESTART_SIZE 1m
    io_moves "$DISK_OPT" 20 || fail "fio's writes do not reach the optimized path"
    sleep 2
    # The host numbers requests from 1 in the order it reads them; RESTARTS outlives this
    # subshell through save, so each request waits for its own answer.
    RESTARTS=$((RESTARTS + 1))
    save "RESTARTS=$RESTARTS"
    ack=$ACKS/restart-$RESTARTS
    [[ ! -e $ack ]] || fail "an answer to restart $RESTARTS exists before the request"
    t0=$(now)
    report "HOST: restart-ferrosan $mode"
    wait_until 120 test -e "$ack" || fail "the host did not restart ferrosan within 120 s"
    echo "host: $(cat "$ack")"
    grep -q "^ok $mode:" "$ack" || fail "the host could not restart ferrosan ($mode): $(cat "$ack")"
    fio_running "$name" || fail "fio ended before ferrosan was back: the restart did not happen under I/O"
    wait_until 90 paths_ready \
        || fail "the paths are not back 90 s after ferrosan restarted: $(multipathd show paths raw format '%d %t %T' | tr '\n' ';')"
    io_moves "$DISK_OPT" 30 || fail "no I/O on the optimized path after the restart"
    echo "I/O flows again $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }') s after the request"
    multipath -ll "$MAP" | cat
}

check_restart_kill() { restart_during_fio KILL kill $FIO_KILL_OFFSET; }
check_fio_verify_restart_kill() {
    fio_wait kill 300
    cat "$WORK/fio-kill.out" 2>/dev/null || true
    fio_verdict kill $FIO_RESTART_SIZE
}
check_restart_term() { restart_during_fio TERM term $FIO_TERM_OFFSET; }
check_fio_verify_restart_term() {
    fio_wait term 300
    cat "$WORK/fio-term.out" 2>/dev/null || true
    fio_verdict term $FIO_RESTART_SIZE
}

# ---------------------------------------------------------------------------------------------

diagnostics() {
    printf '\n==== diagnostics\n'
    iscsiadm -m session -P1 || true
    multipath -ll | cat || true
    printf '\n---- multipathd log (last 60 lines)\n'
    tail -n 60 /tmp/multipathd.log 2>/dev/null || true
    printf '\n---- kernel log (iSCSI, SCSI, device-mapper)\n'
    dmesg | grep -iE 'iscsi|connection|session|sd[a-z]|scsi|alua|device-mapper|multipath|reservation|I/O error' | tail -n 150 || true
}
trap diagnostics EXIT

report "PLAN ${CHECKS[*]}"
run login check_login
if ((LAST_RC != 0)); then
    skip_all "login failed" "${SCSI_CHECKS[@]}" multipath-map "${MP_CHECKS[@]}"
    exit 0
fi
run_all "${SCSI_CHECKS[@]}"
run multipath-map check_multipath_map
if ((LAST_RC != 0)) && [[ -z ${MAP:-} ]]; then
    skip_all "no multipath map" "${MP_CHECKS[@]}"
    exit 0
fi
run_all "${MP_CHECKS[@]}"
