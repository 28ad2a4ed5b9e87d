#!/usr/bin/env bash
# ferrosan's test command (the README's, and what CI's .ci/run calls).
#
#   0. checks the disk has room for the run (FERROSAN_TEST_NEED_GIB, 10, and 2 % of the disk)
#   1. installs what the tests need when missing (Debian: libiscsi-bin,
#      qemu-utils, qemu-block-extra, tgt, iperf3, util-linux, mount, e2fsprogs,
#      prometheus, systemd, tmux, qemu-system-x86, mmdebstrap, curl;
#      apt-get update at most once; a second pass if an install removed one)
#   2. cargo fmt --check
#   3. cargo clippy --workspace --all-targets -- -D warnings
#   4. cargo test --workspace --no-fail-fast   (includes crates/ferrosan/tests: real initiators;
#      scripts/cargo-tests.sh runs the binaries that wait on a Ceph cluster beside the others);
#      meanwhile, from step 2 on, scripts/guest-images.sh builds the guest images of step 6
#      (the tests run once it is done), and during the tests, at the lowest priority, the
#      release binary of the later steps builds, then scripts/fuzz-smoke.sh (every cargo-fuzz
#      target, 15 s each; it may go on beside steps 6 and 7), and beside them
#      scripts/package-test.sh (the .deb: install, serve, remove, purge)
#   5. scripts/conformance.sh ferrosan   (libiscsi iscsi-test-cu; 0 failures to pass), and
#      beside it scripts/soak.sh --gateways 5   (verified fio I/O for five minutes while logins,
#      reloads, volume verbs, offline/online, device changes and RBD gateway takeovers churn,
#      a host verifying through both gateways; fails if a block reads back wrong, a verb
#      fails or the daemons' memory, threads or descriptors grow)
#   6. the QEMU guests, two at a time, in two lanes:
#      a. scripts/kernel-gateways.sh   (a guest's open-iscsi, dm-multipath and NVMe/TCP host
#         against two RBD gateways of one image: the owner killed, restarted and hung under
#         each multipath grouping; stalls, takeovers, fio verify), then
#         scripts/guest-suites.sh   (ferrosan inside the guest, one boot for three suites:
#         lvm-pool, an LVM thin pool whose volumes are created, snapshotted, cloned, rolled
#         back, grown and deleted while the guest's open-iscsi reads and writes them;
#         csi-node, ferrosan-csi's controller and node services staging, unstaging, growing,
#         snapshotting and restoring volumes over iSCSI and NVMe/TCP; faulty-disk, a disk with
#         a failing range (dm-error) and a slow one (dm-delay) as a host meets them)
#      b. scripts/kernel-iscsi.sh   (the guest's Linux kernel initiator against ferrosan: SCSI,
#         ALUA, reservations, failover, restarts), then scripts/kernel-nvme.sh   (its NVMe/TCP
#         host and nvme-cli against ferrosan's second door: discovery, native multipath with
#         ANA, both doors on one device, reservations across them, a live ALUA change and a
#         kill under fio verify), once with bookworm's 6.1 kernel, once with
#         bookworm-backports' 6.12, which adds DH-HMAC-CHAP authentication, and once in a
#         Debian 13 guest (6.12, nvme-cli 2.13, tlshd), which adds TLS with a pre-shared key
#   7. scripts/screenshots.sh   (headless Chromium renders `ferrosan top` at 80 and 150
#      columns under three benches and a bench report; each picture checked)
#
#   scripts/test.sh --quick   for daily work: steps 2-4 and one conformance run (a RAM LUN,
#   the debug build), no guest, package or fuzzing
#
# Every step runs even if an earlier one failed, so one run shows everything; the summary
# gives each step's result, its time and how busy the machine was meanwhile; the exit status
# is non-zero if any step failed. Daemons are started only by
# the steps themselves, which stop them (by PID) on success and on failure.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=test
QUICK=0
case ${1:-} in
    --quick) QUICK=1 ;;
    "") ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# The whole run builds from nothing: cargo's incremental caches (2.3 GiB of the debug build's
# 6) would only be written, never read. --quick is for daily work, where they pay.
((QUICK)) || export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

on_signal() {
    # Forward to the running steps and lanes, this shell's jobs (their own traps stop their
    # daemons), then leave.
    local pid
    for pid in $(jobs -p); do
        kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    exit 130
}
trap on_signal INT TERM

NAMES=() RESULTS=() TIMES=() BUSY=()
# cpu_ticks: the machine's busy and idle jiffies so far (/proc/stat), to tell a step that
# computes from one that waits (what can run beside it).
cpu_ticks() {
    local _cpu user nice sys idle iowait irq softirq steal _rest
    read -r _cpu user nice sys idle iowait irq softirq steal _rest </proc/stat
    echo "$((user + nice + sys + irq + softirq + steal)) $((idle + iowait))"
}
# busy_since "BUSY IDLE": the machine's busy share since that mark, in per cent.
busy_since() {
    local b0 i0 b1 i1
    read -r b0 i0 <<<"$1"
    read -r b1 i1 <<<"$(cpu_ticks)"
    echo "$((100 * (b1 - b0) / (b1 - b0 + i1 - i0 + 1)))%"
}
# record NAME RC T0 C0: one step's result, wall time and the machine's busy share meanwhile.
record() {
    NAMES+=("$1") TIMES+=("$(($(date +%s) - $3))s") BUSY+=("$(busy_since "$4")")
    if (($2 == 0)); then RESULTS+=(ok); else RESULTS+=("FAILED (exit $2)"); fi
}

# step NAME CMD...: run one step in the background (so a signal can reach it).
step() {
    local name=$1 t0 c0 rc=0
    shift
    printf '\n==== %s: %s\n' "$name" "$*"
    t0=$(date +%s) c0=$(cpu_ticks)
    "$@" </dev/null &
    wait $! || rc=$?
    record "$name" "$rc" "$t0" "$c0"
    return 0
}

# lane STEP...: the steps one after another, beside the steps that follow; each STEP names a
# function run_STEP. Each step's output goes to target/steps/STEP.log and its result to
# STEP.result, which `joined` reads.
LANE_DIR=$ROOT/target/steps
declare -A LANE_OF=()
lane() {
    local name
    mkdir -p "$LANE_DIR"
    for name; do rm -f "$LANE_DIR/$name.result"; done
    printf '\n==== in the background, one after another: %s\n' "$*"
    (
        child=""
        # A signal goes on to the running step, whose own traps stop its daemons.
        trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null && wait "$child"; exit 143' INT TERM
        for name; do
            t0=$(date +%s) c0=$(cpu_ticks) rc=0
            "run_$name" </dev/null >"$LANE_DIR/$name.log" 2>&1 &
            child=$!
            wait "$child" || rc=$?
            child=""
            echo "$rc $(($(date +%s) - t0))s $(busy_since "$c0")" >"$LANE_DIR/$name.result"
        done
    ) &
    for name; do LANE_OF[$name]=$!; done
}
# joined STEP...: wait until those steps are over (the rest of their lanes may go on), show
# each one's output and record it.
joined() {
    local name rc time busy
    for name; do
        while [[ ! -f $LANE_DIR/$name.result ]] && kill -0 "${LANE_OF[$name]}" 2>/dev/null; do
            sleep 1
        done
        printf '\n==== %s (joined)\n' "$name"
        cat "$LANE_DIR/$name.log" 2>/dev/null
        read -r rc time busy <"$LANE_DIR/$name.result" 2>/dev/null || { rc=1 time=? busy=?; }
        NAMES+=("$name") TIMES+=("$time") BUSY+=("$busy")
        if ((rc == 0)); then RESULTS+=(ok); else RESULTS+=("FAILED (exit $rc)"); fi
    done
}

# summary: every step's result and time, the conformance totals; exits.
summary() {
    local failed=0 i total=$(($(date +%s) - T_START))
    printf '\n==== summary (step, result, wall time, the machine busy meanwhile)\n'
    for i in "${!NAMES[@]}"; do
        printf '  %-16s %-20s %6s %5s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}" "${BUSY[$i]}"
        [[ ${RESULTS[$i]} == ok ]] || failed=1
    done
    printf '  %-16s %-20s %6s %5s\n' total "" "${total}s" "$(busy_since "$C_START")"
    grep '^conformance ' "$CONF_LOG" 2>/dev/null | sed 's/^/  /'
    if ((failed)); then echo "scripts/test.sh: FAILED"; else echo "scripts/test.sh: all steps passed"; fi
    # Last line: the conformance totals in the plain "N passed, N failed, N skipped" form.
    grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$CONF_LOG" 2>/dev/null | tail -n 1
    exit "$failed"
}

# once_more_on_emulator_panic DIR CMD...: a guest step (its results in target/DIR), run once
# more when it failed because a guest's kernel panicked on an int3 oops: a breakpoint the
# kernel's live code patching leaves for an instant, which TCG's emulated CPUs can run into
# (Debian's 6.12 in sched_clock_cpu while booting, 2026-12-02, and in nf_conntrack mid-run,
# 2026-12-04; both passed on the next run). That is the emulator, not a check, and it is said
# so in the step's output; the first run's console is kept as guest-console.log.panic. Any
# other failure stands.
once_more_on_emulator_panic() {
    local dir=$ROOT/target/$1 mark rc=0 panicked
    shift
    mark=$(mktemp)
    "$@" || rc=$?
    panicked=$(find "$dir" -name guest-console.log -newer "$mark" -exec grep -l 'Oops: int3' {} + 2>/dev/null |
        xargs -r grep -l 'Kernel panic' 2>/dev/null)
    rm -f "$mark"
    if ((rc == 0)) || [[ -z $panicked ]]; then
        return "$rc"
    fi
    echo "==== a guest's kernel panicked on an int3 oops (the emulator, not a check): the step once more"
    grep -h -m1 -A4 'Oops: int3' $panicked | sed 's/^/    /'
    for f in $panicked; do cp "$f" "$f.panic"; done
    "$@"
}

# The steps that run in lanes (`lane`), each a function.
run_guest-images() { scripts/guest-images.sh; }
# and the soak's verifying host (crates/initiator/examples/verify_io.rs)
run_release-build() {
    nice -n 19 cargo build --release -p ferrosan &&
        nice -n 19 cargo build --release -p initiator --example verify_io
}
# The .deb: built, installed, its config served, removed and purged (scripts/package-test.sh).
run_package() { nice -n 19 scripts/package-test.sh; }
# Every cargo-fuzz target for a short smoke (docs/SECURITY.md has the long runs).
run_fuzz-smoke() { FUZZ_SECONDS="${FUZZ_SECONDS:-15}" nice -n 19 scripts/fuzz-smoke.sh; }
# Weeks of uptime in five minutes (scripts/soak.sh): verified I/O while logins, reloads, volume
# verbs, offline/online, device changes and RBD gateway takeovers churn, the daemons' memory,
# threads and descriptors sampled.
run_soak() { scripts/soak.sh --gateways "${SOAK_MINUTES:-5}"; }
# RBD gateways failing over under dm-multipath (docs/CONFORMANCE.md, "RBD gateways under
# dm-multipath"): a Ceph cluster, two gateways and a guest whose fio writes around the faults.
run_kernel-gateways() { once_more_on_emulator_panic kernel-gateways scripts/kernel-gateways.sh; }
# The Linux kernel's initiator in a QEMU guest (docs/CONFORMANCE.md, "Linux kernel initiator").
run_kernel-iscsi() { once_more_on_emulator_panic kernel-iscsi scripts/kernel-iscsi.sh; }
# NVMe/TCP with the Linux kernel's host (docs/NVME.md, "Tested with"): bookworm's 6.1, then
# bookworm-backports' 6.12, the first Debian kernel with NVMe in-band authentication (the
# DH-HMAC-CHAP checks), then Debian 13's host, which adds TLS 1.3 with a pre-shared key
# (tlshd, nvme-cli --tls).
run_kernel-nvme() { once_more_on_emulator_panic kernel-nvme scripts/kernel-nvme.sh; }
run_kernel-nvme-6.12() {
    FERROSAN_GUEST_KERNEL=backports once_more_on_emulator_panic kernel-nvme-bpo scripts/kernel-nvme.sh
}
run_kernel-nvme-trixie() {
    FERROSAN_GUEST_KERNEL=trixie once_more_on_emulator_panic kernel-nvme-trixie scripts/kernel-nvme.sh
}
# ferrosan in the guest, where device-mapper is, in one boot: LVM thin pools (docs/VOLUMES.md),
# ferrosan-csi's node through the guest's iSCSI initiator and NVMe/TCP host
# (docs/guides/kubernetes.md), a failing and a slow disk (docs/OPERATIONS.md, *Faults*).
run_guest-suites() { once_more_on_emulator_panic guest-suites scripts/guest-suites.sh; }
# What people read, rendered by headless Chromium: top at 80 and 150 columns and a bench
# report (scripts/screenshots.sh; --docs refreshes docs/images/ from it).
run_screenshots() { scripts/screenshots.sh; }

# Room for the run on the disk that holds the tree: its builds, the guests' disks, Ceph's OSD
# files and the steps' LUN files took 6.6 GiB at their peak (a run of 2026-12-07, sampled every
# 10 s; NEED_GIB leaves half as much again), and Ceph's monitor stops the test
# clusters when less than 2 % of its disk is left (scripts/ceph-single-node.sh, `mon data
# avail warn`). Out of room, a run fails twenty minutes in where it first writes (a monitor
# low on space, a soak's write refused); it is said here at once instead.
NEED_GIB=${FERROSAN_TEST_NEED_GIB:-10}
check_space() {
    local size avail need
    read -r size avail < <(df --output=size,avail -k "$ROOT" | tail -n 1)
    need=$((NEED_GIB * 1024 * 1024 + size / 50))
    log "$((avail / 1048576)) GiB free on the disk of $ROOT; the run needs $((need / 1048576)) GiB" \
        "($NEED_GIB GiB for its files, 2 % of the disk for Ceph's monitor)"
    ((avail >= need)) || die "not enough room: free $(((need - avail) / 1048576 + 1)) GiB more and run again"
}

T_START=$(date +%s) C_START=$(cpu_ticks)
step space check_space
step deps ensure_deps
# The guest images are built while cargo compiles (mmdebstrap mostly downloads and unpacks);
# the tests wait for them, so that their timing checks have the machine to themselves.
((QUICK)) || lane guest-images
step fmt cargo fmt --all --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
# --no-fail-fast: a failing test binary must not hide the ones after it.
step test-build cargo test --workspace --no-fail-fast --no-run
((QUICK)) || joined guest-images
# What only computes runs beside the tests, at the lowest priority: the tests wait on sockets
# and timers far more than they compute (the machine is about a fifth busy in them). The
# release binary first, which the later steps need; fuzzing may go on beside them.
((QUICK)) || lane release-build fuzz-smoke
((QUICK)) || lane package
step test scripts/cargo-tests.sh
CONF_LOG=$ROOT/target/conformance.log
mkdir -p "$ROOT/target"
if ((QUICK)); then
    step conformance-ram env CONFORMANCE_RUNS=ram FERROSAN_BIN="$ROOT/target/debug/ferrosan" \
        bash -c 'set -o pipefail; scripts/conformance.sh ferrosan 2>&1 | tee "$0"' "$CONF_LOG"
    summary
fi
joined release-build package
# Conformance and the soak side by side: neither counts on timers.
lane soak
step conformance bash -c 'set -o pipefail; scripts/conformance.sh ferrosan 2>&1 | tee "$0"' "$CONF_LOG"
joined soak
# The guest steps, two guests at a time, in two lanes of about equal length: each spends most
# of its time waiting on the timeouts it checks (multipath failover, restarts, keep-alives),
# each has its own daemons, ports and directory under target/, and a guest needs a core.
lane kernel-gateways guest-suites
lane kernel-iscsi kernel-nvme kernel-nvme-6.12 kernel-nvme-trixie
joined fuzz-smoke kernel-gateways kernel-iscsi kernel-nvme kernel-nvme-6.12 guest-suites \
    kernel-nvme-trixie
# Alone at the end: its benches would take the cores the timing checks above count on.
step screenshots run_screenshots

summary
