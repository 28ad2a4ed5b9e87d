#!/usr/bin/env bash
# ferrosan's LVM thin pools, where device-mapper is: this host's kernel loads no modules, so
# ferrosan runs inside the test guest (scripts/lib/guest.sh: Debian 12's kernel, lvm2,
# thin-provisioning-tools, open-iscsi) on a thin pool the guest makes on a loop device, and the
# guest's open-iscsi logs in to it over the guest's own loopback
# (scripts/guest/lvm-pool.sh, the guest's half; docs/VOLUMES.md).
#
#   scripts/lvm-pool.sh
#
# Results in target/lvm-pool/: guest-console.log (with ferrosan's log at the end),
# guest-report.log, summary.txt. Exit status: non-zero if any check failed or did not report.
#
# Environment: FERROSAN_BIN       prebuilt daemon (default: cargo build --release -p ferrosan);
#                                 it runs in the guest, a Debian 12 like this host
#              LVM_POOL_TIMEOUT   seconds the guest may run (default 600)
#              FERROSAN_GUEST_*   see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=lvm-pool
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
# shellcheck source=lib/guest-run.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/lvm-pool
GUEST_TIMEOUT=${LVM_POOL_TIMEOUT:-600}

WORK=""
guest_run_setup

guest_suite lvm-pool scripts/guest/lvm-pool.sh 1536 "ferrosan=$FERROSAN_BIN"
