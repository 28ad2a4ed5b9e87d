# shellcheck shell=bash
# Helpers shared by scripts/test.sh, scripts/conformance.sh and the bench scripts. Source it.
# Everything here is loopback-only and kills nothing it did not start.

# Debian packages the tests need, and a command each one provides.
FERROSAN_DEPS=(
    "libiscsi-bin:iscsi-test-cu"
    "libiscsi-bin:iscsi-ls"
    "qemu-utils:qemu-img"
    "qemu-block-extra:-"   # a qemu module, no command: ask dpkg
    "tgt:tgtd"
    "iperf3:iperf3"
    "util-linux:prlimit"   # essential in Debian; listed because tests/descriptors.rs runs it
    "util-linux:fsfreeze"  # tests/task_management.rs holds a write in a frozen filesystem
    "iproute2:ip"          # tests/netcut.rs: gateways and a cluster in network namespaces
    "mount:losetup"
    "e2fsprogs:mkfs.ext4"
    "xfsprogs:mkfs.xfs"    # tests/volumes.rs and bench/xcopy.sh make a reflink pool on XFS
    "prometheus:promtool"  # tests/metrics.rs checks the scrape and dist/prometheus rules
    "systemd:systemd-analyze"  # tests/systemd.rs verifies dist/ferrosan.service
    "tmux:tmux"            # tests/top.rs runs `ferrosan top` in a tmux pane
    "lintian:lintian"      # scripts/package-test.sh: the .deb has no lintian error or warning
    "man-db:man"           # scripts/package-test.sh renders a packaged man page
    # the rbd tests (crates/rbd/tests, crates/ferrosan/tests/rbd.rs) and the ferrosan-rbd
    # conformance run start single-node Ceph clusters (scripts/ceph-single-node.sh)
    "ceph-mon:ceph-mon"
    "ceph-mgr:ceph-mgr"
    "ceph-osd:ceph-osd"
    "ceph-common:rbd"
    "librbd1:-"
    # scripts/kernel-iscsi.sh: a QEMU guest with the Linux kernel's initiator, built from
    # Debian's packages (scripts/lib/guest.sh)
    "qemu-system-x86:qemu-system-x86_64"
    "mmdebstrap:mmdebstrap"
    "curl:curl"            # scripts/kernel-gateways.sh scrapes the gateways' metrics; tests/api.rs
    "openssl:openssl"      # tests/api.rs makes a CA and client certificates
    # building: the openssl crate links the system's libssl (NVMe/TCP TLS, docs/NVME.md)
    "libssl-dev:-"
    "pkg-config:pkg-config"
)

log() { printf '[%s] %s\n' "${LOG_TAG:-ferrosan}" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ferrosan_bin: FERROSAN_BIN is the daemon the caller named, or the release build of this
# checkout (cargo build --release -p ferrosan; ROOT is the checkout); dies without one.
ferrosan_bin() {
    if [[ -z ${FERROSAN_BIN:-} ]]; then
        log "building: cargo build --release -p ferrosan"
        cargo build --release -p ferrosan
        FERROSAN_BIN=$ROOT/target/release/ferrosan
    fi
    [[ -x $FERROSAN_BIN ]] || die "no ferrosan binary at $FERROSAN_BIN"
}

# Install the missing packages (apt-get update at most once). Idempotent, quiet.
# Lists the packages of FERROSAN_DEPS whose command (or package) is missing.
missing_deps() {
    local missing=() entry pkg what
    for entry in "${FERROSAN_DEPS[@]}"; do
        pkg=${entry%%:*}; what=${entry#*:}
        if [[ $what == - ]]; then
            dpkg -s "$pkg" >/dev/null 2>&1 && continue
        else
            command -v "$what" >/dev/null 2>&1 && continue
            # tgtd lives in /usr/sbin, which a non-login PATH may lack.
            [[ -x /usr/sbin/$what ]] && continue
        fi
        [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
    done
    echo "${missing[*]}"
}

ensure_deps() {
    local missing pass
    # Two passes: installing one package can remove another. Seen on Debian 12 with a
    # backported qemu-utils: installing qemu-block-extra (bookworm's qemu) removes it, and
    # qemu-img is gone although it was there before the install.
    for pass in 1 2; do
        missing=$(missing_deps)
        [[ -z $missing ]] && return 0
        command -v apt-get >/dev/null || die "missing packages $missing and no apt-get to install them"
        local sudo=()
        ((EUID == 0)) || sudo=(sudo -n)
        log "installing $missing (apt-get, pass $pass)"
        export DEBIAN_FRONTEND=noninteractive
        if [[ -z ${FERROSAN_APT_UPDATED:-} ]]; then
            "${sudo[@]}" apt-get update -qq >/dev/null || die "apt-get update failed"
            export FERROSAN_APT_UPDATED=1
        fi
        # shellcheck disable=SC2086 # a list of package names
        "${sudo[@]}" apt-get install -y -qq --no-install-recommends $missing >/dev/null \
            || die "apt-get install $missing failed"
    done
    missing=$(missing_deps)
    [[ -z $missing ]] || die "still missing after installing: $missing"
}

# True if something accepts TCP connections on 127.0.0.1:$1.
port_open() {
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

# tail_indented FILE [N]: show the end of a log, indented, on stderr.
tail_indented() {
    if [[ -f $1 ]]; then tail -n "${2:-20}" "$1" | sed 's/^/    /' >&2 || true; fi
}

# Print a loopback TCP port that nothing listens on, below the kernel's ephemeral range (random
# in 10000 up to it): a port in that range can be taken between this check and the daemon's bind
# as the local end of some outgoing connection (seen in CI: "Address already in use").
# SRANDOM, not RANDOM: each $(free_port) is a subshell, and subshells forked close together
# drew the same RANDOM values (two gateways were handed one port: seen here).
free_port() {
    local i p low=32768
    read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
    ((low > 11000)) || low=32768
    for i in $(seq 1 200); do
        p=$((10000 + SRANDOM % (low - 10000)))
        port_open "$p" || { echo "$p"; return 0; }
    done
    die "no free loopback port found"
}

# wait_port PORT PID SECONDS: wait until PORT accepts; fail early if PID dies.
wait_port() {
    local port=$1 pid=$2 secs=$3 i
    for ((i = 0; i < secs * 10; i++)); do
        port_open "$port" && return 0
        kill -0 "$pid" 2>/dev/null || return 2
        sleep 0.1
    done
    return 1
}

# wait_for_line FILE ERE SECONDS: wait until FILE has a line matching ERE; fail after SECONDS.
wait_for_line() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        grep -qE "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# guest_requests FILE PREFIX: the lines of FILE (a guest's serial port) that start with PREFIX
# and are whole, without carriage returns. The emulated port delivers a line a few bytes at a
# time: a line without its newline yet is left for the next look, or a request would be read
# cut short ("stop-" for "stop-owner 30") and never read whole.
guest_requests() {
    PREFIX=$2 perl -ne 'next unless /\n\z/; s/\r//g; print if index($_, $ENV{PREFIX}) == 0' "$1" 2>/dev/null
}

# What a gateway started by gateways_config logs once it owns the image (gateway a at start),
# and what gateway b logs once it knows a owns it (at start, or when it next looks, a second
# later, if a had not locked the image yet: a listens before it has).
GATEWAY_A_OWNS="gateway a owns"
GATEWAY_B_SEES_A="is owned by gateway a|owner of .* is now gateway a"

# gateways_config IQN IMAGE CEPH_CONF PORT_A PORT_B [NVME_A NVME_B NQN]: prints a config for two
# RBD gateways, a and b (portal groups 1 and 2 on 127.0.0.1:PORT_A and PORT_B), exporting rbd
# IMAGE (POOL/NAME) of the cluster CEPH_CONF names as LUN 0 of IQN to any initiator
# (docs/RBD.md); each gateway runs it with `serve --config FILE --gateway a|b`. With NVME_A,
# NVME_B and NQN, each portal group also has an NVMe/TCP listener (127.0.0.1:NVME_A, NVME_B)
# and the target serves the image as namespace 1 of subsystem NQN (docs/NVME.md).
gateways_config() {
    local nvme_a="" nvme_b="" nqn=""
    if (($# >= 8)); then
        nvme_a=$'\n'"nvme_listen = [\"127.0.0.1:$6\"]"$'\n'"nvme_discovery_listen = []"
        nvme_b=$'\n'"nvme_listen = [\"127.0.0.1:$7\"]"$'\n'"nvme_discovery_listen = []"
        nqn=$'\n'"nqn = \"$8\""
    fi
    cat <<CONFIG
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$4"]$nvme_a
gateway = "a"

[[portal_group]]
tag = 2
listen = ["127.0.0.1:$5"]$nvme_b
gateway = "b"

[[device]]
name = "image"
store = "rbd"
image = "$2"
ceph_conf = "$3"

[[target]]
iqn = "$1"$nqn

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "image" } ]
CONFIG
}

# stop_pid PID [GRACE_TENTHS]: stop one process we started: TERM, up to
# GRACE_TENTHS/10 s (default 5 s) for it to exit, then KILL; reap it.
stop_pid() {
    local pid=$1 grace=${2:-50} i
    [[ -n $pid ]] || return 0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
}

# A script's scratch directory and the processes it starts, undone by one EXIT trap (INT and
# TERM exit through it too), so no script forgets a part of its cleanup:
#   scratch [MKTEMP-ARGS...]   WORK: a new directory (mktemp -d), removed last at exit
#   spawn LOG COMMAND...       COMMAND in the background, its output in LOG, its PID in
#                              SPAWNED; stopped at exit (stop_pid) unless stopped before
#   stop_spawned PID [GRACE]   stops it now and forgets it (a reaped PID may be reused);
#                              GRACE as stop_pid's, STOP_GRACE (50) at exit
#   on_exit 'COMMAND'          runs COMMAND at exit after the processes stop, before WORK
#                              goes; the last given runs first
# Call spawn from the script's own shell, not from $(...): the process must be its child.
_SCRATCH_PIDS=()
_SCRATCH_UNDO=()
scratch() {
    WORK=$(mktemp -d "$@")
    trap _scratch_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}
spawn() {
    local log=$1
    shift
    "$@" >"$log" 2>&1 &
    SPAWNED=$!
    _SCRATCH_PIDS+=("$SPAWNED")
}
stop_spawned() {
    local i
    stop_pid "$1" "${2:-${STOP_GRACE:-50}}"
    for i in "${!_SCRATCH_PIDS[@]}"; do
        [[ ${_SCRATCH_PIDS[i]} != "$1" ]] || unset '_SCRATCH_PIDS[i]'
    done
}
on_exit() { _SCRATCH_UNDO+=("$1"); }
_scratch_cleanup() {
    local pid i
    for pid in "${_SCRATCH_PIDS[@]}"; do stop_pid "$pid" "${STOP_GRACE:-50}"; done
    for ((i = ${#_SCRATCH_UNDO[@]} - 1; i >= 0; i--)); do eval "${_SCRATCH_UNDO[i]}" || true; done
    [[ -z ${WORK:-} ]] || rm -rf "$WORK"
}

# start_daemon NAME PORTS COMMAND...: spawns COMMAND (a daemon; its log WORK/NAME.log, its PID
# in PID) and waits until it accepts on each of PORTS (a space-separated list); dies with its
# log if it does not within START_SECONDS (10).
start_daemon() {
    local name=$1 ports=$2 port
    shift 2
    spawn "$WORK/$name.log" "$@"
    PID=$SPAWNED
    for port in $ports; do
        wait_port "$port" "$PID" "${START_SECONDS:-10}" ||
            die "$name did not start: $(cat "$WORK/$name.log")"
    done
}

# start_daemon_ctl NAME SOCKET COMMAND...: start_daemon's twin for a ferrosan daemon (COMMAND's
# first word) whose start may take long (a large config): ready once its control socket SOCKET
# answers `ctl status`, however long that takes while the daemon lives.
start_daemon_ctl() {
    local name=$1 socket=$2
    shift 2
    spawn "$WORK/$name.log" "$@"
    PID=$SPAWNED
    until "$1" ctl --socket "$socket" status >/dev/null 2>&1; do
        kill -0 "$PID" 2>/dev/null || die "$name did not start: $(tail -5 "$WORK/$name.log")"
        sleep 0.01
    done
}

# spawn_ready WHAT COMMAND...: spawns COMMAND with `--ready WORK/ready` (a holder that writes
# that file once it has done its part: bench/idle_sessions.py, bench/idle_nvme.py; its output
# in WORK/holder.log, its PID in HOLDER) and waits for the file; dies saying WHAT did not
# happen if COMMAND ends first.
spawn_ready() {
    local what=$1
    shift
    rm -f "$WORK/ready"
    spawn "$WORK/holder.log" "$@" --ready "$WORK/ready"
    HOLDER=$SPAWNED
    until [[ -s $WORK/ready ]]; do
        kill -0 "$HOLDER" 2>/dev/null || die "$what: $(tail -3 "$WORK/holder.log")"
        sleep 0.1
    done
}

# two_ports: two distinct free loopback ports (free_port), on one line.
two_ports() {
    local a b
    a=$(free_port)
    b=$(free_port)
    while [[ $b == "$a" ]]; do b=$(free_port); done
    echo "$a $b"
}

# ticks PID: the CPU a process has used, all its threads (utime + stime), in clock ticks (HZ
# a second). Fields counted after the command's name: the name may hold spaces.
ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'; }
HZ=$(getconf CLK_TCK)

# xfs_mount FILE SIZE DIR: an XFS filesystem of SIZE in FILE, on a loop device, mounted at DIR
# (reflinks: a volume pool's snapshots and clones share extents). Prints the loop device;
# xfs_unmount undoes it. Needs root.
xfs_mount() {
    local loop
    truncate -s "$2" "$1"
    mkfs.xfs -q -f "$1"
    loop=$(losetup -f --show "$1")
    mkdir -p "$3"
    mount "$loop" "$3" || { losetup -d "$loop"; return 1; }
    echo "$loop"
}

# xfs_unmount DIR LOOP: xfs_mount undone (quietly: it runs from cleanup traps).
xfs_unmount() {
    umount "$1" 2>/dev/null || true
    [[ -n $2 ]] && losetup -d "$2" 2>/dev/null || true
}
