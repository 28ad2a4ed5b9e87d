#!/bin/bash
# The guest's half of scripts/kernel-gateways.sh: runs inside the test guest (scripts/lib/guest.sh)
# as /host/main.sh. For each multipath path grouping policy in $POLICIES it logs in to the two
# ferrosan RBD gateways the host started (open-iscsi, one session per gateway's portal), lets
# dm-multipath join the two paths (the run named "nvme": connects nvme-cli to both gateways'
# NVMe/TCP listeners and lets the kernel's native NVMe multipath join them), writes with fio (4 KiB random writes, crc32c, a per-I/O
# completion log) and asks the host to SIGKILL the image's owner, to restart it, to SIGSTOP the
# new owner for STOP_S seconds; after fio's write phase its verify phase reads back every block
# written. Then it measures the stalls from fio's completion log and the kernel's log.
#
# Reports on $REPORT (the second serial port), one line each:
#   PLAN POLICY...                  the runs this script will report, before the first
#   HOST: N VERB ARGS... @EPOCH     a request to the host, numbered from 1 (EPOCH: the guest's
#                                   clock when sent); the host answers in /host/acks/N ("ok ..."
#                                   or "FAILED ...") and, for stop-owner, /host/acks/N.cont once
#                                   it has continued the stopped gateway. Verbs:
#                                     run-start N POLICY  fresh image and gateways a, b: "ok PORT_A PORT_B IMAGE
#                                                         [NVME_A NVME_B]" (NVMe/TCP ports for the run "nvme")
#                                     kill-owner          SIGKILL the owner: "ok NAME HOST_EPOCH"
#                                     restart NAME        start gateway NAME again: "ok NAME HOST_EPOCH"
#                                     stop-owner SECS     SIGSTOP the owner, SIGCONT after SECS: "ok NAME HOST_EPOCH"
#                                     mark NAME           the host notes the moment (and the metrics)
#                                     run-end N           stop the run's gateways
#   RESULT POLICY WHAT key=value... a measurement (times in seconds; "rel" ones relative to
#                                   the fault the line names)
#   GUEST_FAIL POLICY reason        something the guest saw go wrong (the run fails)
#   DONE POLICY                     the run's results are all out
# Everything else (commands, their output, kernel lines) goes to the console (stdout).
#
# /host/params (written by the host) sets TARGET_IQN, TARGET_NQN, HOSTNQN, HOST_ADDR, POLICIES, FIO_RATE (write
# IOPS), FIO_SECONDS (length of fio's write phase at that rate), WARMUP_S, KILL_MAX_S (longest
# wait for I/O after the kill before the killed gateway is restarted anyway), RETURN_S (I/O
# time after the restart), STOP_S, RESUME_S (I/O time after SIGCONT).
set -uo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=/dev/null
source /host/params
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
: "${TARGET_IQN:?}" "${TARGET_NQN:?}" "${HOSTNQN:?}" "${HOST_ADDR:?}" "${POLICIES:?}" "${FIO_RATE:?}" "${FIO_SECONDS:?}"
: "${WARMUP_S:?}" "${KILL_MAX_S:?}" "${RETURN_S:?}" "${STOP_S:?}" "${RESUME_S:?}"
REPORT=${REPORT:-/dev/ttyS1}
ACKS=/host/acks
WORK=/tmp/kgw
mkdir -p "$WORK"
FIO_SIZE=$((FIO_RATE * FIO_SECONDS * 4096))

say() { printf '[%s] %s\n' "$(date +%T.%3N)" "$*"; }
# epoch: the guest's clock, seconds with milliseconds (fio's log has milliseconds).
epoch() { date +%s.%3N; }
# pulse_start: the guest's own pulse while a run writes: a timestamp every 0.1 s from shell
# builtins alone (no process started per beat), so a gap in it is a time the guest itself did
# not run (its emulated CPUs starved on the host), not a stall of the storage.
pulse_start() {
    pulse_stop # a run that returned early left its own
    rm -f "$WORK/never" "$WORK/pulse"
    mkfifo "$WORK/never"
    (
        # A FIFO opened both ways never has data nor ends: `read -t` on it is a builtin sleep.
        exec 9<>"$WORK/never"
        while :; do
            printf '%s\n' "$EPOCHREALTIME"
            read -r -t 0.1 -u 9 _
        done
    ) >"$WORK/pulse" &
    PULSE_PID=$!
}
pulse_stop() {
    [[ -n ${PULSE_PID:-} ]] || return 0
    kill "$PULSE_PID" 2>/dev/null
    wait "$PULSE_PID" 2>/dev/null
    PULSE_PID=""
}
# pulse_window NAME FROM TO REF: the longest gap in the guest's pulse that overlaps [FROM, TO]
# (longest, starting at: seconds after REF) and how many exceeded half a second.
pulse_window() {
    awk -v ws="$2" -v we="$3" -v ref="$4" -v name="$1" -v pol="$POLICY" '
        { t = $1 + 0; if (have && t >= ws && prev <= we) { g = t - prev; if (g > mg) { mg = g; gs = prev } if (g > 0.5) n++ } prev = t; have = 1 }
        END {
            printf "RESULT %s pulse %s", pol, name
            if (mg == 0) printf " longest=- at=- over_half_s=0\n"
            else printf " longest=%.3f at=%.3f over_half_s=%d\n", mg, gs - ref, n
        }' "$WORK/pulse"
}
# kmark NAME EPOCH: a line in the kernel's log, so that kernel events are timed against it.
kmark() { echo "kgw: $1 at $2" >/dev/kmsg; }
add() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a + b }'; }
sub_() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
# sleep_until EPOCH
sleep_until() {
    local d
    d=$(sub_ "$1" "$(epoch)")
    awk -v d="$d" 'BEGIN { exit !(d > 0) }' && sleep "$d"
    return 0
}
POLICY=""
gfail() {
    report "GUEST_FAIL $POLICY $*"
}

REQ=0
LAST_ACK=""
# host_request SECONDS VERB [ARGS...]: ask the host, wait SECONDS for its answer (LAST_ACK);
# true if it starts with "ok".
host_request() {
    local secs=$1 ack i
    shift
    REQ=$((REQ + 1))
    ack=$ACKS/$REQ
    LAST_ACK=""
    report "HOST: $REQ $* @$(epoch)"
    for ((i = 0; i < secs * 5; i++)); do
        [[ -e $ack ]] && break
        sleep 0.2
    done
    if [[ ! -e $ack ]]; then
        LAST_ACK="no answer from the host within $secs s"
        say "$*: $LAST_ACK"
        return 1
    fi
    LAST_ACK=$(cat "$ack")
    say "host: $* -> $LAST_ACK"
    [[ $LAST_ACK == "ok "* ]]
}
# wait_file FILE SECONDS
wait_file() {
    local i
    for ((i = 0; i < $2 * 5; i++)); do
        [[ -e $1 ]] && return 0
        sleep 0.2
    done
    return 1
}

# ---------------------------------------------------------------------------------------------
# open-iscsi and dm-multipath, as an administrator sets them up for a multipath array

# The initiator's timeouts, in iscsid.conf (node records made afterwards take them): a NOP-Out
# every 5 s answered within 5 s, and a lost session's commands failed to dm-multipath 5 s after
# the connection is lost (iscsid keeps trying to log in again).
iscsi_setup() {
    local conf=/etc/iscsi/iscsid.conf i
    echo "InitiatorName=iqn.2026-11.org.ferrosan.guest:kernel-gateways" >/etc/iscsi/initiatorname.iscsi
    sed -i -E '/^[[:space:]]*node\.(session\.timeo\.replacement_timeout|conn\[0\]\.timeo\.noop_out_(interval|timeout))[[:space:]]*=/d' "$conf"
    cat >>"$conf" <<CONF
node.session.timeo.replacement_timeout = 5
node.conn[0].timeo.noop_out_interval = 5
node.conn[0].timeo.noop_out_timeout = 5
CONF
    echo "iscsid.conf, the timeouts:"
    grep -E '^[[:space:]]*node\.(session\.timeo|conn\[0\]\.timeo|session\.initial_login|session\.err_timeo)' "$conf"
    iscsid
    for ((i = 0; i < 50; i++)); do
        iscsiadm -m session >/dev/null 2>&1 && break
        [[ $(iscsiadm -m session 2>&1) == *"No active sessions"* ]] && break
        sleep 0.2
    done
}

# session_of PORT: "SID DISK" of the session to HOST_ADDR:PORT.
session_of() {
    iscsiadm -m session -P3 2>/dev/null | awk -v p="$HOST_ADDR:$1," '
        /Current Portal:/ { portal = $3 }
        /SID:/ { sid = $2 }
        /Attached scsi disk/ { if (index(portal, p) == 1) print sid, $4 }'
}
wait_session() {
    local i s
    for ((i = 0; i < 60; i++)); do
        s=$(session_of "$1")
        if [[ -n $s && -b /dev/${s#* } ]]; then
            echo "$s"
            return 0
        fi
        sleep 0.5
    done
    return 1
}

# login PORT TPGT: a node record made by hand (ferrosan's SendTargets lists its 127.0.0.1
# listeners, which the guest cannot reach: it sees the host's loopback as 10.0.2.2).
login() {
    local portal=$HOST_ADDR:$1,$2
    iscsiadm -m node -o new -T "$TARGET_IQN" -p "$portal" >/dev/null || return 1
    iscsiadm -m node -T "$TARGET_IQN" -p "$portal" | grep -E 'timeo\.(replacement_timeout|noop_out)'
    iscsiadm -m node -T "$TARGET_IQN" -p "$portal" --login
}

map_paths() {
    multipath -ll "$MAP" 2>/dev/null | awk '
        /policy=/ { prio = $0; sub(/.*prio=/, "", prio); sub(/ .*/, "", prio)
                    st = $0; sub(/.*status=/, "", st); sub(/ .*/, "", st) }
        /[0-9]+:[0-9]+:[0-9]+:[0-9]+ sd/ { for (i = 1; i <= NF; i++) if ($i ~ /^sd/) print $i, prio, st, $(i + 2), $(i + 3) }'
}
two_paths() { [[ $(map_paths | wc -l) == 2 ]]; }
paths_ready() { [[ $(multipathd show paths raw format '%d %t %T' 2>/dev/null | grep -c 'active ready') == 2 ]]; }
have_map() {
    local maps
    maps=$(dmsetup ls --target multipath 2>/dev/null)
    [[ -n $maps && $maps != *"No devices"* ]]
}

# rx STRING: STRING as an extended regular expression that matches only itself.
rx() { sed 's/[][\.*^$+?(){}|/]/\\&/g' <<<"$1"; }

# write_multipath_conf POLICY VENDOR PRODUCT: the device section for ferrosan's LUs as INQUIRY
# reports them: ALUA priorities and hardware handler, TUR checker, I/O queued while no path is
# left, no automatic failback; the path grouping POLICY is what the run is about. Everything
# else is multipath-tools' default (polling_interval 5, path_selector service-time 0).
write_multipath_conf() {
    cat >/etc/multipath.conf <<CONF
defaults {
    user_friendly_names no
    find_multipaths no
}
blacklist {
    devnode "^vd[a-z]"
}
devices {
    device {
        vendor "^$(rx "$2")\$"
        product "^$(rx "$3")\$"
        path_grouping_policy $1
        prio alua
        hardware_handler "1 alua"
        path_checker tur
        no_path_retry queue
        failback manual
    }
}
CONF
    cat /etc/multipath.conf
}

# ---------------------------------------------------------------------------------------------
# nvme-cli and native NVMe multipath, with nvme-cli's defaults (keep-alive 5 s, reconnect every
# 10 s for 600 s): no tuning, as the kernel's host comes

nvme_connect() {
    nvme connect -t tcp -a "$HOST_ADDR" -s "$1" -n "$TARGET_NQN" -q "$HOSTNQN"
}
# nvme_paths: "a=ana:STATE,CTRL_STATE b=..." for the RESULT map line.
nvme_paths() {
    local g c p
    for g in a b; do
        c=$CTRL_A
        [[ $g == b ]] && c=$CTRL_B
        p=$(nvme_path "$c" 2>/dev/null)
        printf '%s=ana:%s,%s ' "$g" "$(cat "/sys/block/$p/ana_state" 2>/dev/null || echo -)" "$(cat "/sys/class/nvme/$c/state" 2>/dev/null || echo -)"
    done
}
nvme_settled() { [[ $(nvme_paths) == "a=ana:optimized,live b=ana:non-optimized,live " ]]; }
nvme_ready() {
    [[ $(cat "/sys/class/nvme/$CTRL_A/state" 2>/dev/null) == live && $(cat "/sys/class/nvme/$CTRL_B/state" 2>/dev/null) == live ]]
}

# The run's transport: show the paths, tell whether both are ready.
show_paths() {
    if [[ $POLICY == nvme ]]; then
        nvme list-subsys 2>&1 | cat
        echo "paths: $(nvme_paths)"
    else
        multipath -ll "$MAP" | cat
    fi
}
both_ready() {
    if [[ $POLICY == nvme ]]; then nvme_ready; else paths_ready; fi
}
both_ready_text() {
    if [[ $POLICY == nvme ]]; then nvme_paths; else multipathd show paths raw format '%d %t %T' | tr '\n' ';'; fi
}

MPD_PID=""
stop_multipathd() {
    [[ -n $MPD_PID ]] || return 0
    kill "$MPD_PID" 2>/dev/null
    wait "$MPD_PID" 2>/dev/null
    MPD_PID=""
}

# ---------------------------------------------------------------------------------------------
# I/O

# dm_writes: the writes the map (or the NVMe paths: Linux 6.1 keeps no statistics for the
# namespace's head device) has completed.
dm_writes() {
    if [[ $POLICY == nvme ]]; then
        cat /sys/block/nvme*c*n1/stat | awk '{ n += $5 } END { print n + 0 }'
    else
        awk '{ print $5 }' "/sys/block/$DM/stat"
    fi
}
# wait_io_flowing AFTER SECONDS: wait (at most SECONDS) until the map completes writes at half
# fio's rate or more over 2 s that all lie after the epoch AFTER; prints the time.
wait_io_flowing() {
    local after=$1 secs=$2 need i now w
    local -a ts=() ws=()
    need=$((FIO_RATE / 2 > 2 ? FIO_RATE / 2 : 2))
    for ((i = 0; i < secs * 2 + 4; i++)); do
        now=$(epoch) w=$(dm_writes)
        ts+=("$now") ws+=("$w")
        if ((${#ts[@]} > 4)); then
            local j=$((${#ts[@]} - 5))
            if awk -v a="${ts[j]}" -v b="$after" 'BEGIN { exit !(a >= b) }' && ((w - ws[j] >= need)); then
                echo "$now"
                return 0
            fi
        fi
        sleep 0.5
    done
    return 1
}

FIO_PID="" FIO_RC=""
# Up to 16 writes in flight: the rate is fio's, the depth only lets it keep that rate through
# an RBD write's latency on a loaded host (at 4, one run wrote at 37 a second instead of 100,
# and its write phase ran 131 s past the faults).
fio_start() {
    FIO_RC=""
    exec_without_sigpipe fio --name=kgw --filename="/dev/$DM" --direct=1 --ioengine=libaio --iodepth=16 \
        --rw=randwrite --bs=4k --size="$FIO_SIZE" --rate_iops=,"$FIO_RATE" \
        --verify=crc32c --do_verify=1 --verify_fatal=0 --continue_on_error=verify \
        --write_lat_log="$WORK/lat" --log_avg_msec=0 --log_unix_epoch=1 \
        --output-format=json --output="$WORK/fio.json" >"$WORK/fio.out" 2>&1 &
    FIO_PID=$!
}
fio_running() { [[ -n $FIO_PID ]] && kill -0 "$FIO_PID" 2>/dev/null; }
# fio_check STEP: a note, the first time fio is found gone before its time, of when that was.
FIO_GONE=""
fio_check() {
    [[ -z $FIO_GONE ]] && ! fio_running || return 0
    FIO_GONE=$1
    report "NOTE $POLICY fio had ended by the $1 (guest epoch $(epoch))"
}
# fio_notes POLICY: fio's last words and the kernel's I/O errors, for a run whose fio failed.
fio_notes() {
    local l
    while IFS= read -r l; do report "NOTE $1 fio: $l"; done < <(tail -n 15 "$WORK/fio.out")
    while IFS= read -r l; do report "NOTE $1 kernel: $l"; done < <(dmesg | grep -E 'I/O error|I/O Cmd|blk_update|fio|segfault|traps:|nvme.*(error|fail|status)' | tail -n 15)
}
# fio_wait SECONDS: wait for fio to end; FIO_RC its exit status.
fio_wait() {
    local i
    for ((i = 0; i < $1 * 2; i++)); do
        fio_running || break
        sleep 0.5
    done
    fio_running && return 1
    [[ -n $FIO_PID ]] || return 1
    wait "$FIO_PID"
    FIO_RC=$?
    FIO_PID=""
}

# fio_json FILE: error, total_err, write io_bytes, read io_bytes, write lat_ns max of the job
# (fio's JSON has one key per line; no jq or python in the guest).
fio_json() {
    awk '
        /"error"/ && err == "" { v = $0; gsub(/[^0-9]/, "", v); err = v }
        /"total_err"/ && terr == "" { v = $0; gsub(/[^0-9]/, "", v); terr = v }
        /"read" : \{/ { sect = "read" }
        /"write" : \{/ { sect = "write" }
        /"trim" : \{/ { sect = "trim" }
        /"lat_ns" : \{/ { lat = 1 }
        /"io_bytes"/ { v = $0; gsub(/[^0-9]/, "", v); if (sect == "read" && r == "") r = v; if (sect == "write" && w == "") w = v }
        lat && /"max"/ && sect == "write" && wmax == "" { v = $0; sub(/.*: */, "", v); sub(/,.*/, "", v); wmax = v; lat = 0 }
        /\}/ { lat = 0 }
        END { print (err == "" ? "?" : err), (terr == "" ? "?" : terr), (w == "" ? 0 : w), (r == "" ? 0 : r), (wmax == "" ? 0 : wmax) }' "$1"
}

# window NAME FROM TO REF MODE: in fio's log (sorted), between FROM and TO: the longest gap
# between consecutive write completions (gap, from gap_start to gap_end), the gaps over a
# second (stalls: how many, stalled: their sum, until: where the last one ends) and the longest
# latency of a write completed in [FROM, TO] (max_lat); times relative to REF. MODE overlap:
# gaps that overlap [FROM, TO] count (a stall that began before FROM, or ends after TO);
# within: only gaps that begin at FROM or later.
window() {
    local name=$1
    awk -F', *' -v ws="$2" -v we="$3" -v ref="$4" -v mode="$5" -v name="$name" -v pol="$POLICY" '
        $3 == 1 {
            t = $1 / 1000
            if (have && t >= ws && prev <= we && (mode == "overlap" || prev >= ws)) {
                g = t - prev
                if (g > mg) { mg = g; gs = prev; ge = t }
                if (g > 1) { ns++; st += g; su = t }
            }
            if (t >= ws && t <= we) { n++; if ($2 + 0 > ml) ml = $2 + 0 }
            prev = t; have = 1
        }
        END {
            printf "RESULT %s window %s", pol, name
            if (mg == 0) printf " gap=- gap_start=- gap_end=-"
            else printf " gap=%.3f gap_start=%.3f gap_end=%.3f", mg, gs - ref, ge - ref
            if (ns == 0) printf " stalls=0 stalled=0 until=-"
            else printf " stalls=%d stalled=%.3f until=%.3f", ns, st, su - ref
            printf " max_lat=%.3f writes=%d\n", ml / 1e9, n
        }' "$WORK/lat.sorted"
}

# kev MARKER ERE: seconds from the kernel log's "kgw: MARKER" line to the first line after it
# that matches ERE, or "-".
kev() {
    awk -v m="kgw: $1 at " -v re="$2" '
        { ts = $0; sub(/^\[ */, "", ts); sub(/\].*/, "", ts) }
        !fm && index($0, m) { mt = ts; fm = 1; next }
        fm && $0 ~ re { printf "%.3f\n", ts - mt; found = 1; exit }
        END { if (!found) print "-" }' "$WORK/dmesg.txt"
}

# ---------------------------------------------------------------------------------------------
# One run

# fault_events NAME MARKER GATEWAY: kernel events on the faulted gateway's path after MARKER.
fault_events() {
    local name=$1 marker=$2 g=$3 sid disk majmin other hctl
    if [[ $g == a ]]; then sid=$SID_A disk=$DISK_A other=$DISK_B; else sid=$SID_B disk=$DISK_B other=$DISK_A; fi
    majmin=$(cat "/sys/block/$disk/dev" 2>/dev/null || echo "?")
    hctl=$(basename "$(readlink -f "/sys/block/$other/device")")
    report "RESULT $POLICY events $name gateway=$g" \
        "conn_error=$(kev "$marker" "connection$sid:0: (detected conn error|ping timeout)")" \
        "ping_timeout=$(kev "$marker" "connection$sid:0: ping timeout")" \
        "recovery_timeout=$(kev "$marker" "session$sid: session recovery timed out")" \
        "path_failed=$(kev "$marker" "Failing path $majmin")" \
        "alua_other=$(kev "$marker" "sd $hctl: alua: port group")"
}

# nvme_fault_events NAME MARKER GATEWAY: the same for the NVMe/TCP controller to the gateway:
# conn_error is its first sign of trouble (a keep-alive or I/O timeout, or error recovery on a
# closed connection), ping_timeout its keep-alive timing out (a timeout on the admin queue,
# queue 0, where Keep Alive is the only command while I/O runs), recovery the start of error
# recovery, reconnect its first attempt to connect again, live the controller live again.
nvme_fault_events() {
    local name=$1 marker=$2 g=$3 c
    c=$CTRL_A
    [[ $g == b ]] && c=$CTRL_B
    report "RESULT $POLICY events $name gateway=$g" \
        "conn_error=$(kev "$marker" "$c: .*(timeout|starting error recovery|keep_alive|Keep Alive)")" \
        "ping_timeout=$(kev "$marker" "$c: (queue 0: timeout|.*keep_alive|.*Keep Alive)")" \
        "recovery=$(kev "$marker" "$c: starting error recovery")" \
        "reconnect=$(kev "$marker" "$c: (Reconnecting in|Failed reconnect attempt|failed to connect)")" \
        "live=$(kev "$marker" "$c: Successfully reconnected")"
}

# nvme_setup PORT_A PORT_B: connect to both gateways' NVMe/TCP listeners; sets CTRL_A, CTRL_B
# and DM (the head device fio writes to).
nvme_setup() {
    nvme_connect "$1" || { gfail "nvme connect to gateway a ($1) failed"; return 1; }
    nvme_connect "$2" || { gfail "nvme connect to gateway b ($2) failed"; return 1; }
    wait_until 20 nvme_head >/dev/null || { gfail "no namespace head device after connecting"; return 1; }
    CTRL_A=$(nvme_ctrl "$1") || { gfail "no controller to gateway a"; return 1; }
    CTRL_B=$(nvme_ctrl "$2") || { gfail "no controller to gateway b"; return 1; }
    DM=$(nvme_head)
    wait_until 20 nvme_path "$CTRL_B" >/dev/null || { gfail "no path through gateway b's controller"; return 1; }
    local paths=(/sys/block/nvme*c*n1)
    ((${#paths[@]} == 2)) || { gfail "not one namespace with two paths: ${paths[*]##*/}"; return 1; }
    echo "native multipath: $(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null), iopolicy $(cat /sys/class/nvme-subsystem/*/iopolicy 2>/dev/null | head -n1)"
    say "gateway a: controller $CTRL_A, gateway b: controller $CTRL_B; head /dev/$DM"
    # The owner's path optimized, the other's non-optimized (ANA from the ownership).
    wait_until 30 nvme_settled ||
        say "the paths are not a optimized, b non-optimized: $(nvme_paths)"
    show_paths
    report "RESULT $POLICY map $(nvme_paths)"
}

run_policy() {
    local n=$1 p=$2 i
    POLICY=$p
    printf '\n==== run %s: path_grouping_policy %s\n' "$n" "$p"
    dmesg -C
    if ! host_request 240 run-start "$n" "$p"; then
        gfail "the host did not start the gateways: $LAST_ACK"
        return 1
    fi
    local port_a port_b image nvme_a nvme_b
    read -r _ port_a port_b image nvme_a nvme_b <<<"$LAST_ACK"
    if [[ $p == nvme ]]; then
        say "gateways: a on $HOST_ADDR:$nvme_a, b on $HOST_ADDR:$nvme_b (NVMe/TCP), image $image"
        nvme_setup "$nvme_a" "$nvme_b" || return 1
    else
        say "gateways: a on $HOST_ADDR:$port_a, b on $HOST_ADDR:$port_b, image $image"
        iscsi_paths "$port_a" "$port_b" || return 1
    fi
    run_faults "$p"
}

# iscsi_paths PORT_A PORT_B: log in to both gateways' portals and let dm-multipath join them
# with the run's path grouping policy; sets SID_A, DISK_A, SID_B, DISK_B, MAP and DM.
iscsi_paths() {
    local p=$POLICY port_a=$1 port_b=$2
    login "$port_a" 1 || gfail "login to gateway a ($port_a) failed"
    login "$port_b" 2 || gfail "login to gateway b ($port_b) failed"
    local sa sb
    sa=$(wait_session "$port_a") || { gfail "no disk on the session to gateway a"; return 1; }
    sb=$(wait_session "$port_b") || { gfail "no disk on the session to gateway b"; return 1; }
    SID_A=${sa% *} DISK_A=${sa#* } SID_B=${sb% *} DISK_B=${sb#* }
    iscsiadm -m session
    say "gateway a: session $SID_A, /dev/$DISK_A; gateway b: session $SID_B, /dev/$DISK_B"
    local d out vendor="" product="" v pr
    for d in "$DISK_A" "$DISK_B"; do
        out=$(sg_inq "/dev/$d") || { gfail "sg_inq /dev/$d failed"; return 1; }
        echo "$out" | grep -E 'identification|TPGS|revision'
        v=$(sed -n 's/^ *Vendor identification: *//p' <<<"$out" | sed 's/ *$//')
        pr=$(sed -n 's/^ *Product identification: *//p' <<<"$out" | sed 's/ *$//')
        if [[ -z $vendor ]]; then
            vendor=$v product=$pr
        elif [[ $v != "$vendor" || $pr != "$product" ]]; then
            gfail "the two paths report different INQUIRY data: '$vendor/$product' and '$v/$pr'"
        fi
        sg_rtpg -d "/dev/$d" | grep -E 'target port group id|asymmetric access state|T_SUP|pref' || true
    done
    report "RESULT $p inquiry vendor=\"$vendor\" product=\"$product\""
    write_multipath_conf "$p" "$vendor" "$product"
    multipathd -d -v2 >"$WORK/multipathd.log" 2>&1 &
    MPD_PID=$!
    wait_until 30 have_map || { gfail "multipathd made no map within 30 s"; return 1; }
    MAP=$(dmsetup ls --target multipath | awk 'NR == 1 { print $1 }')
    DM=dm-$(dmsetup info -c --noheadings -o minor "$MAP" | tr -d ' ')
    # fio writes to the kernel's node of the map (/dev/mapper/ may lag behind udev, and fio
    # would create a plain file there).
    wait_until 10 test -b "/dev/$DM" || { gfail "no block device /dev/$DM for the map $MAP"; return 1; }
    wait_until 30 two_paths || { gfail "the map does not have two paths: $(map_paths | tr '\n' ';')"; return 1; }
    wait_until 30 paths_ready || say "not both paths active ready: $(multipathd show paths raw format '%d %t %T' | tr '\n' ';')"
    show_paths
    report "RESULT $p map $(map_paths | awk -v a="$DISK_A" '{ printf "%s=prio:%s,%s,%s ", ($1 == a ? "a" : "b"), $2, $3, $4 }')"
}

# run_faults POLICY: fio, and the faults while it writes; then the measurements.
run_faults() {
    local p=$1

    # fio, and the faults while it writes.
    rm -f "$WORK"/lat* "$WORK"/fio.*
    FIO_GONE=""
    local t0 t_kill t_res t_restart t_stop t_cont t_end victim1="" victim2=""
    t0=$(epoch)
    pulse_start
    fio_start
    if ! wait_io_flowing "$t0" 30 >/dev/null; then
        gfail "fio's writes do not reach the map"
        cat "$WORK/fio.out"
        pulse_stop
        return 1
    fi
    sleep_until "$(add "$t0" "$WARMUP_S")"

    # 1: SIGKILL the owner; once I/O flows again (or after KILL_MAX_S), restart it.
    t_kill=$(epoch)
    fio_check kill
    kmark fault-kill "$t_kill"
    if host_request 30 kill-owner; then
        victim1=$(awk '{ print $2 }' <<<"$LAST_ACK")
    else
        gfail "the host could not kill the owner: $LAST_ACK"
    fi
    report "RESULT $p mark kill guest_epoch=$t_kill victim=${victim1:--}"
    if t_res=$(wait_io_flowing "$t_kill" "$KILL_MAX_S"); then
        say "I/O flows again $(sub_ "$t_res" "$t_kill") s after the kill (2 s of writes at half fio's rate)"
        sleep 5
    else
        say "no I/O flows $KILL_MAX_S s after the kill: restarting the killed gateway anyway"
    fi
    show_paths
    t_restart=$(epoch)
    fio_check restart
    kmark restart "$t_restart"
    if [[ -n $victim1 ]]; then
        host_request 90 restart "$victim1" || gfail "the host could not restart gateway $victim1: $LAST_ACK"
    fi
    report "RESULT $p mark restart guest_epoch=$t_restart"
    if wait_until 60 both_ready; then
        say "both paths ready $(sub_ "$(epoch)" "$t_restart") s after the restart request"
    else
        say "not both paths ready 60 s after the restart: $(both_ready_text)"
    fi
    show_paths
    sleep_until "$(add "$t_restart" "$RETURN_S")"
    host_request 10 mark return-end || true

    # 2: SIGSTOP the owner for STOP_S seconds.
    t_stop=$(epoch)
    fio_check stop
    kmark fault-stop "$t_stop"
    local stop_req
    if host_request 30 stop-owner "$STOP_S"; then
        victim2=$(awk '{ print $2 }' <<<"$LAST_ACK")
        stop_req=$REQ
    else
        gfail "the host could not stop the owner: $LAST_ACK"
        stop_req=""
    fi
    report "RESULT $p mark stop guest_epoch=$t_stop victim=${victim2:--}"
    if [[ -n $stop_req ]]; then
        sleep "$((STOP_S / 2))"
        show_paths
        wait_file "$ACKS/$stop_req.cont" "$((STOP_S + 30))" || gfail "the host did not continue gateway $victim2"
        say "host: $(cat "$ACKS/$stop_req.cont" 2>/dev/null)"
    fi
    t_cont=$(epoch)
    fio_check SIGCONT
    kmark cont "$t_cont"
    report "RESULT $p mark cont guest_epoch=$t_cont"
    if t_res=$(wait_io_flowing "$t_stop" 60); then
        say "I/O flowing $(sub_ "$t_res" "$t_cont") s after the SIGCONT"
    else
        say "no I/O 60 s after the SIGCONT"
    fi
    sleep_until "$(add "$t_cont" "$RESUME_S")"
    show_paths
    t_end=$(epoch)
    kmark end "$t_end"
    report "RESULT $p mark end guest_epoch=$t_end"
    fio_check end
    [[ -z $FIO_GONE ]] || gfail "fio's write phase ended before the faults did (by the $FIO_GONE)"
    host_request 10 mark end || true

    # fio: the rest of its write phase, then its verify pass over everything written.
    pulse_stop
    if ! fio_wait $((FIO_SECONDS * 3 + 300)); then
        gfail "fio did not finish"
        return 1
    fi
    cat "$WORK/fio.out"
    local rc=$FIO_RC err terr w r wmax verr
    [[ $rc == 0 && -z $FIO_GONE ]] || fio_notes "$p"
    read -r err terr w r wmax < <(fio_json "$WORK/fio.json")
    verr=$(grep -ciE 'verify failed|bad magic|bad header|verify:' "$WORK/fio.out" || true)
    report "RESULT $p fio rc=$rc error=$err total_err=$terr verify_messages=$verr written=$w verified=$r expected=$FIO_SIZE json_write_max_lat=$(awk -v v="$wmax" 'BEGIN { printf "%.3f", v / 1e9 }')"

    # The stalls, from fio's per-I/O log (completion time in ms since the epoch, latency in ns,
    # direction: 1 = write).
    local lat=$WORK/lat_lat.1.log first last nw
    if [[ ! -s $lat ]]; then
        gfail "fio wrote no latency log"
    else
        sort -t, -k1,1n "$lat" >"$WORK/lat.sorted"
        read -r nw first last < <(awk -F', *' '$3 == 1 { n++; if (f == "") f = $1; l = $1 } END { printf "%d %.3f %.3f\n", n, f / 1000, l / 1000 }' "$WORK/lat.sorted")
        report "RESULT $p writes logged=$nw first_rel_start=$(sub_ "$first" "$t0") last_rel_end=$(sub_ "$last" "$t_end")"
        window pre "$t0" "$t_kill" "$t_kill" within | report_stdin
        window kill "$t_kill" "$t_restart" "$t_kill" overlap | report_stdin
        window return "$t_restart" "$t_stop" "$t_restart" within | report_stdin
        window stop "$t_stop" "$t_cont" "$t_stop" overlap | report_stdin
        window resume "$t_cont" "$t_end" "$t_cont" within | report_stdin
        window all "$t0" "$t_end" "$t0" overlap | report_stdin
        pulse_window kill "$t_kill" "$t_restart" "$t_kill" | report_stdin
        pulse_window stop "$t_stop" "$t_cont" "$t_stop" | report_stdin
        # The gaps over a second, for the console.
        awk -F', *' -v t0="$t0" '$3 == 1 { t = $1 / 1000; if (have && t - prev > 1) printf "gap %.3f s: %.3f .. %.3f (s after fio started)\n", t - prev, prev - t0, t - t0; prev = t; have = 1 }' "$WORK/lat.sorted"
    fi

    # The kernel's view of the faults.
    dmesg >"$WORK/dmesg.txt"
    local events=fault_events
    [[ $p == nvme ]] && events=nvme_fault_events
    [[ -n $victim1 ]] && $events kill fault-kill "$victim1"
    [[ -n $victim1 ]] && $events return restart "$victim1"
    [[ -n $victim2 ]] && $events stop fault-stop "$victim2"
    [[ -n $victim2 ]] && $events resume cont "$victim2"
    printf '\n---- kernel log (iSCSI, SCSI, ALUA, device-mapper, NVMe)\n'
    grep -E 'kgw:|iscsi|connection|session|sd |alua|device-mapper|multipath|I/O error|Sense|sense|nvme' "$WORK/dmesg.txt" | tail -n 200 || true
    if [[ $p != nvme ]]; then
        printf '\n---- multipathd (last 80 lines)\n'
        tail -n 80 "$WORK/multipathd.log" || true
    fi
    return 0
}

report_stdin() {
    local line
    while IFS= read -r line; do report "$line"; done
}

# Back to no sessions and no map for the next run.
run_teardown() {
    if fio_running; then
        kill -INT "$FIO_PID" 2>/dev/null
        fio_wait 30 || kill -KILL "$FIO_PID" 2>/dev/null
        FIO_PID=""
    fi
    stop_multipathd
    multipath -F >/dev/null 2>&1 || true
    iscsiadm -m node -u >/dev/null 2>&1 || true
    iscsiadm -m node -o delete >/dev/null 2>&1 || true
    nvme disconnect -n "$TARGET_NQN" >/dev/null 2>&1 || true
    MAP="" DM="" CTRL_A="" CTRL_B=""
}

trap 'stop_multipathd' EXIT
read -r -a RUNS <<<"$POLICIES"
report "PLAN ${RUNS[*]}"
iscsi_setup
n=0
for p in "${RUNS[@]}"; do
    n=$((n + 1))
    run_policy "$n" "$p" || true
    run_teardown
    host_request 120 run-end "$n" || report "GUEST_FAIL $p the host did not stop the run's gateways: $LAST_ACK"
    report "DONE $p"
done
