#!/bin/bash
# The guest's half of scripts/lvm-pool.sh: ferrosan itself runs inside the test guest (whose
# Debian kernel has device-mapper and thin provisioning; the host's loads no modules) with an
# LVM thin pool made on a loop device, and the guest's own open-iscsi logs in to it over the
# guest's loopback. Checks the volumes' bar for an LVM pool: create → export → write from the
# initiator → snapshot → write more → clone the snapshot → export the clone: it reads exactly
# the data of the snapshot moment; rollback restores it; delete is refused while mapped; every
# verb repeated answers success with "existed"; a restart keeps what was saved; the host's
# discard returns the volume's blocks to the thin pool; a thin pool that fills warns the host,
# fails its writes as out of space, keeps what was written and takes writes again once grown.
#
# Reports on $REPORT (the second serial port): PLAN, CHECK and TIME lines (scripts/guest/lib.sh).
# The ferrosan binary is /host/ferrosan; its log is printed to the console at the end.
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
REPORT=${REPORT:-/dev/ttyS1}
WORK=/tmp/lvm
mkdir -p "$WORK/state.d"
: >"$WORK/state"
BIN=/host/ferrosan
IQN=iqn.2026-11.org.ferrosan:lvm-pool
INIT=iqn.2026-11.org.ferrosan.guest:lvm-node
VG=ferrosan-vg TP=thin PORTAL=127.0.0.1:3260
MIB=$((1 << 20))

CHECKS=(setup pool-add create export-write pool-list snapshot clone-reads-snapshot delete-refused rollback
    resize restart-keeps unmap-frees delete pool-full)

ctl() { "$BIN" ctl --socket "$WORK/control.sock" "$@"; }
# says JSON KEY VALUE: the ctl answer JSON says "KEY": VALUE.
says() { grep -Eq "\"$2\": ?$3([,}]|\$)" <<<"$1"; }
# number JSON KEY: the number the answer gives KEY first.
number() { grep -Eo "\"$2\": ?[0-9]+" <<<"$1" | head -1 | grep -Eo '[0-9]+$'; }
# ok_json WHAT ARGS...: ctl --json ARGS must succeed; prints its answer.
ok_json() {
    local what=$1 out
    shift
    out=$(ctl --json "$@") || fail "$what: ctl $* failed: $out"
    echo "$out"
}
# refused WHY ARGS...: ctl ARGS must fail, naming WHY.
refused() {
    local why=$1 out
    shift
    if out=$(ctl "$@" 2>&1); then fail "ctl $* was not refused: $out"; fi
    grep -q "$why" <<<"$out" || fail "ctl $* refused without saying \"$why\": $out"
}

# disk LUN: the sd device of LUN N of the session (udev's by-path link), waiting 20 s for it.
disk() {
    local link=/dev/disk/by-path/ip-$PORTAL-iscsi-$IQN-lun-$1
    wait_until 20 test -b "$link" || fail "no disk for LUN $1"
    readlink -f "$link"
}
# forget LUN: the guest drops LUN N's disk before ferrosan takes the LUN away.
forget() {
    local d
    d=$(readlink -f "/dev/disk/by-path/ip-$PORTAL-iscsi-$IQN-lun-$1")
    echo 1 >"/sys/block/${d##*/}/device/delete"
    udevadm settle --timeout=10 || true
}
# same DISK FILE: the disk's first bytes are FILE's.
same() {
    local n
    n=$(stat -c %s "$2")
    dd if="$1" bs=$MIB count=$((n / MIB)) iflag=direct status=none | cmp - "$2"
}
put() { dd if="$2" of="$1" bs=$MIB oflag=direct conv=fsync status=none; }

start_ferrosan() {
    "$BIN" serve --config "$WORK/ferrosan.toml" </dev/null >>"$WORK/ferrosan.log" 2>&1 &
    FERROSAN_PID=$!
    wait_until 20 ctl status >/dev/null 2>&1
}
stop_ferrosan() {
    kill -TERM "$FERROSAN_PID"
    wait "$FERROSAN_PID" || true
}
login() {
    iscsiadm -m discovery -t st -p "$PORTAL" >/dev/null
    iscsiadm -m node -T "$IQN" -p "$PORTAL" --login >/dev/null
    udevadm settle --timeout=20 || true
}

# ---------------------------------------------------------------------------------------------
# Checks

# A 1 GiB loop device, a volume group on it, a 768 MiB thin pool and a plain LV; iscsid. (ferrosan
# starts after this check, with one target and no pool: check_pool_add adds it.)
check_setup() {
    modprobe -a loop dm_thin_pool
    truncate -s 1G "$WORK/pv.img"
    local loop
    loop=$(losetup --find --show "$WORK/pv.img")
    pvcreate -q "$loop"
    vgcreate -q "$VG" "$loop"
    lvcreate -q --type thin-pool -L 768M -n "$TP" "$VG"
    # A plain LV: what a pool refuses as its thin pool.
    lvcreate -q -L 4M -n plain "$VG"
    lvs "$VG"
    echo "InitiatorName=$INIT" >/etc/iscsi/initiatorname.iscsi
    iscsid
    wait_until 10 bash -c 'iscsiadm -m session 2>&1 | grep -Eq "No active sessions|tcp:"'
}

check_pool_add() {
    local r
    refused "not a thin pool" pool add bad --vg "$VG" --thin-pool plain
    r=$(ok_json "pool add" pool add lv --vg "$VG" --thin-pool "$TP" --save)
    says "$r" existed false || fail "the first pool add says it existed: $r"
    r=$(ok_json "pool add again" pool add lv --vg "$VG" --thin-pool "$TP")
    says "$r" existed true || fail "the repeated pool add does not say it existed: $r"
    refused "not found" pool add nope --vg no-such-vg --thin-pool "$TP"
    grep -q 'kind = "lvm"' "$WORK/ferrosan.toml" || fail "the saved config has no LVM pool"
    # LVM's default thin pool queues writes when full, for longer than hosts wait: said.
    grep -q "queues writes when it is full" "$WORK/ferrosan.log" ||
        fail "no warning that thin pool $TP queues writes when full"
}

check_create() {
    local r size
    # 60 MiB: LVM makes whole 4 MiB extents; 62 MiB is rounded up to 64.
    r=$(ok_json create volume create lv vm1 62M --save)
    says "$r" existed false || fail "the first create says it existed: $r"
    r=$(ok_json "create again" volume create lv vm1 62M)
    says "$r" existed true || fail "the repeated create does not say it existed: $r"
    refused "exists" volume create lv vm1 32M
    size=$(lvs --noheadings --nosuffix --units b -o lv_size "$VG/vm1" | tr -d ' ')
    ((size == 64 * MIB)) || fail "vm1 is $size bytes, not 64 MiB"
}

check_export_write() {
    local r
    r=$(ok_json export volume export vm1 --initiator "$INIT" --target "$IQN" --save)
    says "$r" lun 0 || fail "vm1 is not at LUN 0: $r"
    r=$(ok_json "export again" volume export vm1 --initiator "$INIT" --target "$IQN")
    says "$r" existed true || fail "the repeated export does not say it existed: $r"
    login
    head -c $((4 * MIB)) /dev/urandom >"$WORK/a.bin"
    head -c $((4 * MIB)) /dev/urandom >"$WORK/b.bin"
    put "$(disk 0)" "$WORK/a.bin"
    same "$(disk 0)" "$WORK/a.bin" || fail "vm1 does not read back what was written"
}

# The thin pool's size and what it has left as `pool list` says: LVM's own figures (its data
# percentage, to a hundredth of a percent), less than all of it once vm1 has data.
check_pool_list() {
    local r total avail size pct expect
    r=$(ok_json "pool list" pool list lv)
    total=$(number "$r" total_bytes)
    avail=$(number "$r" available_bytes)
    read -r size pct < <(lvs --noheadings --nosuffix --units b -o lv_size,data_percent "$VG/$TP")
    echo "pool list: $total bytes, $avail available; lvs: $size bytes, $pct % data"
    ((total == size)) || fail "pool list says $total bytes, lvs $size"
    expect=$(awk -v s="$size" -v p="$pct" 'BEGIN { printf "%d", s - s * p / 100 }')
    ((avail < size && (avail - expect) ** 2 <= (size / 10000) ** 2)) ||
        fail "pool list says $avail bytes available, lvs' percentage $expect"
    says "$r" volumes 1 || fail "pool list does not count vm1: $r"
    ctl pool list | grep -q "^lv " || fail "pool list's table has no row for lv"
}

check_snapshot() {
    local r
    r=$(ok_json snapshot volume snapshot vm1 s1)
    says "$r" existed false || fail "the first snapshot says it existed: $r"
    says "$r" method '"lvm thin snapshot"' || fail "not an LVM thin snapshot: $r"
    r=$(ok_json "snapshot again" volume snapshot vm1 s1)
    says "$r" existed true || fail "the repeated snapshot does not say it existed: $r"
    lvs "$VG/vm1+s1" >/dev/null || fail "no thin snapshot LV vm1+s1"
    # Written after the snapshot: not in it.
    put "$(disk 0)" "$WORK/b.bin"
}

check_clone_reads_snapshot() {
    local r
    r=$(ok_json clone volume clone vm1 c1 --snapshot s1 --save)
    says "$r" existed false || fail "the first clone says it existed: $r"
    r=$(ok_json "clone again" volume clone vm1 c1 --snapshot s1)
    says "$r" existed true || fail "the repeated clone does not say it existed: $r"
    r=$(ok_json "export clone" volume export c1 --initiator "$INIT" --target "$IQN" --save)
    says "$r" lun 1 || fail "c1 is not at LUN 1: $r"
    iscsiadm -m session --rescan >/dev/null
    udevadm settle --timeout=20 || true
    same "$(disk 1)" "$WORK/a.bin" || fail "the clone does not read the snapshot's data"
    same "$(disk 0)" "$WORK/b.bin" || fail "vm1 lost what was written after the snapshot"
}

check_delete_refused() {
    refused "mapped" volume delete vm1
    refused "mapped" volume delete c1
    refused "mapped" volume rollback vm1 s1
    lvs "$VG/vm1" "$VG/c1" >/dev/null
}

check_rollback() {
    local r
    forget 0
    ok_json unexport volume unexport vm1 --initiator "$INIT" --save >/dev/null
    r=$(ok_json rollback volume rollback vm1 s1)
    says "$r" method '"lvm thin snapshot"' || fail "not rolled back by LVM: $r"
    lvs "$VG/vm1+s1" >/dev/null || fail "the rollback took the snapshot"
    ! lvs "$VG/vm1+" >/dev/null 2>&1 || fail "the set-aside LV vm1+ was left"
    r=$(ok_json "export again" volume export vm1 --initiator "$INIT" --target "$IQN" --lun 0 --save)
    iscsiadm -m session --rescan >/dev/null
    udevadm settle --timeout=20 || true
    same "$(disk 0)" "$WORK/a.bin" || fail "vm1 does not read the snapshot's data after the rollback"
}

check_resize() {
    local d
    ok_json resize volume resize c1 128M --save >/dev/null
    refused "shrinking" volume resize c1 32M
    d=$(disk 1)
    iscsiadm -m session --rescan >/dev/null
    wait_until 20 test "$(blockdev --getsize64 "$d")" -eq $((128 * MIB)) ||
        fail "the initiator sees $(blockdev --getsize64 "$d") bytes, not 128 MiB"
    same "$d" "$WORK/a.bin" || fail "c1 lost its data growing"
}

# After a logout and a restart of ferrosan (between the checks): the saved pool, volumes and
# exports are back, the snapshot is listed, the data is there.
check_restart_keeps() {
    local r
    r=$(ok_json list volume list)
    grep -q '"vm1"' <<<"$r" && grep -q '"c1"' <<<"$r" || fail "volumes missing after the restart: $r"
    grep -q '"s1"' <<<"$r" || fail "vm1's snapshot is not listed after the restart: $r"
    login
    same "$(disk 0)" "$WORK/a.bin" || fail "vm1 lost its data in the restart"
    same "$(disk 1)" "$WORK/a.bin" || fail "c1 lost its data in the restart"
}

# The host's discard (UNMAP) frees the thin pool's blocks under the volume, and the volume reads
# zeros there.
check_unmap_frees() {
    local d before after
    d=$(disk 0)
    mapped() { lvs --noheadings -o data_percent "$VG/vm1" | tr -d ' '; }
    before=$(mapped)
    blkdiscard "$d"
    after=$(mapped)
    echo "vm1: $before % of its blocks mapped before the discard, $after % after"
    awk -v b="$before" -v a="$after" 'BEGIN { exit !(b > 0 && a < b / 2) }' ||
        fail "the discard did not free vm1's blocks ($before % mapped before, $after % after)"
    cmp -n $((4 * MIB)) "$d" /dev/zero || fail "vm1 does not read zeros after the discard"
}

check_delete() {
    local r
    forget 1
    forget 0
    # The last unexport takes the guest's group and closes its session: logged out first, so
    # that iscsid does not retry into the failed-login limit.
    iscsiadm -m node -u >/dev/null
    ok_json unexport volume unexport c1 --initiator "$INIT" --save >/dev/null
    ok_json unexport volume unexport vm1 --initiator "$INIT" --save >/dev/null
    r=$(ok_json delete volume delete c1 --save)
    says "$r" deleted true || fail "c1 was not deleted: $r"
    r=$(ok_json "delete again" volume delete c1)
    says "$r" deleted false || fail "the repeated delete does not say it was gone: $r"
    refused "snapshots" volume delete vm1
    r=$(ok_json "snapshot delete" snapshot delete vm1 s1)
    says "$r" deleted true || fail "s1 was not deleted: $r"
    r=$(ok_json "snapshot delete again" snapshot delete vm1 s1)
    says "$r" deleted false || fail "the repeated snapshot delete does not say it was gone: $r"
    ok_json delete volume delete vm1 --save >/dev/null
    r=$(lvs --noheadings -o lv_name "$VG" | tr -d ' ' | sort | tr '\n' ' ')
    [[ $r == "plain $TP " ]] || fail "LVs left besides the thin pool and the plain LV: $r"
}

# A thin pool that fills (32 MiB, errorwhenfull, in a VG of its own, under a 64 MiB volume): past
# space_warning_percent (90 %) the host is told THIN PROVISIONING SOFT THRESHOLD REACHED; a write
# past full fails as SPACE ALLOCATION FAILED WRITE PROTECT (07h/27h/07h), not as a medium error;
# every block written before reads back; once the pool is grown (lvextend), writing resumes in
# the same session.
check_pool_full() {
    local d written mark
    local vg=ferrosan-full loop
    truncate -s 128M "$WORK/pv-full.img"
    loop=$(losetup --find --show "$WORK/pv-full.img")
    pvcreate -q "$loop"
    vgcreate -q "$vg" "$loop"
    lvcreate -q --type thin-pool -L 32M -n full "$vg"
    lvchange -q --errorwhenfull y "$vg/full"
    # A volume's device is /dev/VG/NAME: a second pool in the VG of one could not tell whose.
    refused "pool lv's already" pool add twin --vg "$VG" --thin-pool "$TP"
    ok_json "pool add" pool add tight --vg "$vg" --thin-pool full >/dev/null
    ok_json create volume create tight big 64M >/dev/null
    ok_json export volume export big --initiator "$INIT" --target "$IQN" --lun 2 >/dev/null
    login
    d=$(disk 2)
    head -c $((64 * MIB)) /dev/urandom >"$WORK/fill.bin"
    mark=$(dmesg | wc -l)
    if dd if="$WORK/fill.bin" of="$d" bs=$MIB oflag=direct 2>"$WORK/dd.err"; then
        fail "64 MiB went into a 32 MiB thin pool"
    fi
    written=$(grep -Eo '^[0-9]+\+0 records out' "$WORK/dd.err" | grep -Eo '^[0-9]+')
    echo "the host wrote $written MiB before the pool was full: $(grep -v records "$WORK/dd.err")"
    ((written >= 24 && written < 64)) || fail "$written MiB written into a 32 MiB pool"
    dmesg | tail -n +"$mark" | grep -qi "space allocation failed write protect" ||
        fail "the host was not told SPACE ALLOCATION FAILED: $(dmesg | tail -n +"$mark" | tail -5)"
    # The watch looks every 5 s; the warning comes with the host's next command.
    soft() {
        dd if="$d" of=/dev/null bs=4096 count=1 iflag=direct status=none
        dmesg | tail -n +"$mark" | grep -qi "thin provisioning soft threshold"
    }
    wait_until 30 soft ||
        fail "the host was not told THIN PROVISIONING SOFT THRESHOLD REACHED: $(dmesg | tail -n 8)"
    grep -q 'device space past its warning threshold.*device=big\|device=big.*device space past' \
        "$WORK/ferrosan.log" || fail "ferrosan logged no space warning for big"
    dd if="$d" bs=$MIB count="$written" iflag=direct status=none |
        cmp - <(head -c $((written * MIB)) "$WORK/fill.bin") ||
        fail "what was written before the pool filled does not read back"
    lvextend -q -L +48M "$vg/full"
    dd if="$WORK/fill.bin" of="$d" bs=$MIB skip="$written" seek="$written" oflag=direct \
        conv=fsync status=none || fail "writing did not resume once the pool was grown"
    same "$d" "$WORK/fill.bin" || fail "big does not read back all 64 MiB after the pool grew"
}

diagnostics() {
    local rc=$?
    set +e
    echo "==== lvs"
    lvs -a "$VG"
    echo "==== ferrosan.log (the end)"
    tail -n 60 "$WORK/ferrosan.log"
    [[ -n ${FERROSAN_PID:-} ]] && kill -TERM "$FERROSAN_PID" 2>/dev/null && wait "$FERROSAN_PID"
    exit "$rc"
}
trap diagnostics EXIT

cat >"$WORK/ferrosan.toml" <<CONFIG
# scripts/guest/lvm-pool.sh: one target; the LVM pool is added live (ctl pool add --save).
[server]
state_dir = "$WORK/state.d"
control_socket = "$WORK/control.sock"

[[portal_group]]
tag = 1
listen = ["$PORTAL"]

[[device]]
name = "boot"
store = "ram"
size = "8M"

# A target needs a group; the guest's own group comes with its first export.
[[target]]
iqn = "$IQN"

  [[target.group]]
  name = "others"
  initiators = ["iqn.2026-11.org.example:someone-else"]
  luns = [ { lun = 0, device = "boot" } ]
CONFIG

report "PLAN ${CHECKS[*]}"
FERROSAN_PID=""
run setup check_setup
if ((LAST_RC != 0)) || ! start_ferrosan; then
    skip_all "setting up the thin pool or starting ferrosan failed" "${CHECKS[@]:1}"
    exit 0
fi
run_all pool-add create export-write pool-list snapshot clone-reads-snapshot delete-refused rollback resize
iscsiadm -m node -u >/dev/null 2>&1 || true
stop_ferrosan
if ! start_ferrosan; then
    skip_all "ferrosan did not start again" restart-keeps unmap-frees delete pool-full
    exit 0
fi
run_all restart-keeps unmap-frees delete pool-full
