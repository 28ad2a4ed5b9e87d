#!/usr/bin/env bash
# The test command's guest-only suites in one boot of the QEMU guest: scripts/lvm-pool.sh,
# scripts/csi-node.sh and scripts/faulty-disk.sh each boot a guest of their own for one suite;
# this runs their guest halves (scripts/guest/SUITE.sh) one after the other in a single boot,
# which saves a boot per suite. Each check reports as SUITE/CHECK.
#
#   scripts/guest-suites.sh [SUITE...]   (default: lvm-pool csi-node faulty-disk)
#
# Results in target/guest-suites/: guest-console.log (each suite's ferrosan log at its end),
# guest-report.log, summary.txt. Exit status: non-zero if any check failed or did not report.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=guest-suites
source scripts/lib/common.sh
source scripts/lib/guest.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

SUITES=("$@")
((${#SUITES[@]})) || SUITES=(lvm-pool csi-node faulty-disk)
OUT=$ROOT/target/guest-suites
GUEST_TIMEOUT=${GUEST_SUITES_TIMEOUT:-$((600 * ${#SUITES[@]}))}

WORK=""
guest_run_setup
files=("ferrosan=$FERROSAN_BIN")
if [[ " ${SUITES[*]} " == *" csi-node "* ]]; then
    log "building: cargo build -p ferrosan-csi --example node_check"
    cargo build -q -p ferrosan-csi --example node_check
    target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    files+=("node_check=$target/debug/examples/node_check")
fi
guest_suites guest-suites 1536 "${SUITES[@]}" -- "${files[@]}"
