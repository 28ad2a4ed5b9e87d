#!/usr/bin/env bash
# ferrosan's test command (the README's, and what CI's .ci/run calls).
#
#   1. installs what the tests need when missing (Debian: libiscsi-bin,
#      qemu-utils, qemu-block-extra, tgt, iperf3, util-linux, mount, e2fsprogs,
#      prometheus, systemd, tmux, qemu-system-x86, mmdebstrap, curl;
#      apt-get update at most once; a second pass if an install removed one)
#   2. cargo fmt --check
#   3. cargo clippy --workspace --all-targets -- -D warnings
#   4. cargo test --workspace --no-fail-fast   (includes crates/ferrosan/tests: real initiators);
#      meanwhile, from step 2 on, scripts/guest-images.sh builds the guest images of steps 5-9
#      in the background (the tests run once it is done), and during the tests the release
#      binary of the later steps builds (at the lowest priority)
#   5. scripts/kernel-gateways.sh   (a QEMU guest, open-iscsi, dm-multipath and the NVMe/TCP
#      host, against two RBD gateways of one image: the owner killed, restarted and hung under
#      each multipath grouping; stalls, takeovers, fio verify), and beside it, at the lowest
#      priority, scripts/package-test.sh (the .deb: install, serve, remove, purge) and
#      scripts/fuzz-smoke.sh (every cargo-fuzz target, 15 s each)
#   6. scripts/conformance.sh ferrosan   (libiscsi iscsi-test-cu; 0 failures to pass), and
#      beside it scripts/soak.sh 5   (verified fio I/O for five minutes while logins, reloads,
#      volume verbs, offline/online and device changes churn; fails if a block reads back
#      wrong, a verb fails or the daemon's memory, threads or descriptors grow)
#   7. scripts/kernel-iscsi.sh   (that guest's Linux kernel initiator against ferrosan: SCSI,
#      ALUA, reservations, failover, restarts); steps 7-9 run two guests at a time: 7 beside the
#      first two runs of 8, 9 beside the third
#   8. scripts/kernel-nvme.sh   (that guest's NVMe/TCP host and nvme-cli against ferrosan's second
#      door: discovery, native multipath with ANA, both doors on one device, reservations across
#      them, a live ALUA change and a kill under fio verify), once with bookworm's 6.1 kernel,
#      once with bookworm-backports' 6.12, which adds DH-HMAC-CHAP authentication, and once in
#      a Debian 13 guest (6.12, nvme-cli 2.13, tlshd), which adds TLS with a pre-shared key
#   9. scripts/guest-suites.sh   (ferrosan inside that guest, one boot for three suites:
#      lvm-pool, an LVM thin pool whose volumes are created, snapshotted, cloned, rolled back,
#      grown and deleted while the guest's open-iscsi reads and writes them; csi-node,
#      ferrosan-csi's controller and node services staging, unstaging, growing, snapshotting
#      and restoring volumes over iSCSI and NVMe/TCP; faulty-disk, a disk with a failing range
#      (dm-error) and a slow one (dm-delay) as a host meets them)
#
#   scripts/test.sh --quick   for daily work: steps 2-4 and one conformance run (a RAM LUN,
#   the debug build), no guest, package or fuzzing
#
# Every step runs even if an earlier one failed, so one run shows everything;
# the exit status is non-zero if any step failed. Daemons are started only by
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

STEP_PID="" BG_PID=""
on_signal() {
    # Forward to the running steps (their own traps stop their daemons), then leave.
    local pid
    for pid in $STEP_PID $BG_PID; do
        kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    exit 130
}
trap on_signal INT TERM

NAMES=() RESULTS=() TIMES=()
# step NAME CMD...: run one step in the background (so a signal can reach it).
step() {
    local name=$1 t0 rc=0
    shift
    printf '\n==== %s: %s\n' "$name" "$*"
    t0=$(date +%s)
    "$@" </dev/null &
    STEP_PID=$!
    wait "$STEP_PID" || rc=$?
    STEP_PID=""
    NAMES+=("$name") TIMES+=("$(($(date +%s) - t0))s")
    if ((rc == 0)); then RESULTS+=(ok); else RESULTS+=("FAILED (exit $rc)"); fi
    return 0
}

# background NAME CMD...: run one step beside the next ones, its output kept for its
# `joined` (one at a time).
background() {
    BG_NAME=$1 BG_T0=$(date +%s) BG_LOG=$ROOT/target/$1.log
    shift
    mkdir -p "$ROOT/target"
    printf '\n==== %s (in the background): %s\n' "$BG_NAME" "$*"
    "$@" </dev/null >"$BG_LOG" 2>&1 &
    BG_PID=$!
}
# joined: wait for the background step, show its output, record it as a step.
joined() {
    local rc=0
    wait "$BG_PID" || rc=$?
    BG_PID=""
    printf '\n==== %s (joined)\n' "$BG_NAME"
    cat "$BG_LOG"
    NAMES+=("$BG_NAME") TIMES+=("$(($(date +%s) - BG_T0))s")
    if ((rc == 0)); then RESULTS+=(ok); else RESULTS+=("FAILED (exit $rc)"); fi
}

# summary: every step's result and time, the conformance totals; exits.
summary() {
    local failed=0 i total=$(($(date +%s) - T_START))
    printf '\n==== summary\n'
    for i in "${!NAMES[@]}"; do
        printf '  %-16s %-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
        [[ ${RESULTS[$i]} == ok ]] || failed=1
    done
    printf '  %-16s %-20s %s\n' total "" "${total}s"
    grep '^conformance ' "$CONF_LOG" 2>/dev/null | sed 's/^/  /'
    if ((failed)); then echo "scripts/test.sh: FAILED"; else echo "scripts/test.sh: all steps passed"; fi
    # Last line: the conformance totals in the plain "N passed, N failed, N skipped" form.
    grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$CONF_LOG" 2>/dev/null | tail -n 1
    exit "$failed"
}

T_START=$(date +%s)
step deps ensure_deps
# The guest images are built while cargo compiles (mmdebstrap mostly downloads and unpacks);
# the tests wait for them, so that their timing checks have the machine to themselves.
((QUICK)) || background guest-images scripts/guest-images.sh
step fmt cargo fmt --all --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
# --no-fail-fast: a failing test binary must not hide the ones after it.
step test-build cargo test --workspace --no-fail-fast --no-run
((QUICK)) || joined
# The release binary of the later steps builds beside the tests, at the lowest priority: the
# tests wait on sockets and timers more than they compute.
((QUICK)) || background release-build nice -n 19 cargo build --release -p ferrosan
step test cargo test --workspace --no-fail-fast
((QUICK)) || joined
CONF_LOG=$ROOT/target/conformance.log
mkdir -p "$ROOT/target"
if ((QUICK)); then
    step conformance-ram env CONFORMANCE_RUNS=ram FERROSAN_BIN="$ROOT/target/debug/ferrosan" \
        bash -c 'set -o pipefail; scripts/conformance.sh ferrosan 2>&1 | tee "$0"' "$CONF_LOG"
    summary
fi
# RBD gateways failing over under dm-multipath (docs/CONFORMANCE.md, "RBD gateways under
# dm-multipath"): most of its 12 minutes are fio writing 100 blocks a second around the faults,
# so it runs beside the two steps that only compute, which run at the lowest priority to leave
# its daemons and guest the time their timeouts count on.
background kernel-gateways scripts/kernel-gateways.sh
# The .deb: built, installed, its config served, removed and purged (scripts/package-test.sh).
step package nice -n 19 scripts/package-test.sh
# Every cargo-fuzz target for a short smoke (docs/SECURITY.md has the long runs).
step fuzz-smoke env FUZZ_SECONDS="${FUZZ_SECONDS:-15}" nice -n 19 scripts/fuzz-smoke.sh
joined
# Weeks of uptime in five minutes (scripts/soak.sh): verified I/O while logins, reloads, volume
# verbs, offline/online and device changes churn, the daemon's memory, threads and descriptors
# sampled; beside conformance, neither of which counts on timers.
background soak scripts/soak.sh "${SOAK_MINUTES:-5}"
step conformance bash -c 'set -o pipefail; scripts/conformance.sh ferrosan 2>&1 | tee "$0"' "$CONF_LOG"
joined
# The guest steps, two guests at a time: each spends most of its time waiting on the timeouts
# it checks (multipath failover, restarts, keep-alives), each has its own ferrosan, ports and
# directory under target/, and a guest needs one core.
# The Linux kernel's initiator in a QEMU guest (docs/CONFORMANCE.md, "Linux kernel initiator").
background kernel-iscsi scripts/kernel-iscsi.sh
# NVMe/TCP with the Linux kernel's host (docs/NVME.md, "Tested with"): bookworm's 6.1, then
# bookworm-backports' 6.12, the first Debian kernel with NVMe in-band authentication, which
# adds the DH-HMAC-CHAP checks.
step kernel-nvme scripts/kernel-nvme.sh
step kernel-nvme-6.12 env FERROSAN_GUEST_KERNEL=backports scripts/kernel-nvme.sh
joined
# ferrosan in the guest, where device-mapper is, in one boot: LVM thin pools (docs/VOLUMES.md),
# ferrosan-csi's node through the guest's iSCSI initiator and NVMe/TCP host
# (docs/guides/kubernetes.md), a failing and a slow disk (docs/OPERATIONS.md, *Faults*).
background guest-suites scripts/guest-suites.sh
# Debian 13's host: the same checks, and TLS 1.3 with a pre-shared key (tlshd, nvme-cli --tls).
step kernel-nvme-trixie env FERROSAN_GUEST_KERNEL=trixie scripts/kernel-nvme.sh
joined

summary
