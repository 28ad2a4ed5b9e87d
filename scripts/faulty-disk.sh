#!/bin/bash
# A failing and a slow disk under ferrosan, as a host meets them: ferrosan runs inside the test
# command's QEMU guest (Debian 12), whose kernel has device-mapper (dm-error, dm-delay; this
# host's loads no modules), and serves the guest's own open-iscsi over the guest's loopback
# (scripts/guest/faulty-disk.sh says what is checked). Needs the release build (or
# FERROSAN_BIN) and the guest image (built and cached on first use).
#
# Output: target/faulty-disk/ (guest-console.log, guest-report.log, summary.txt).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=faulty-disk
source scripts/lib/common.sh
source scripts/lib/guest.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/faulty-disk
GUEST_TIMEOUT=${FAULTY_DISK_TIMEOUT:-600}

WORK=""
guest_run_setup
guest_suite faulty-disk scripts/guest/faulty-disk.sh 1024 "ferrosan=$FERROSAN_BIN"
