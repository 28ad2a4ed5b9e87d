#!/usr/bin/env bash
# ferrosan-csi's node service against the Linux kernel's initiators: ferrosan and the driver's
# controller and node services run inside the test guest (scripts/lib/guest.sh: Debian 12's
# kernel, open-iscsi, nvme-cli), which takes volumes over iSCSI and NVMe/TCP as Kubernetes'
# sidecars and kubelet would (scripts/guest/csi-node.sh, the guest's half;
# docs/guides/kubernetes.md).
#
#   scripts/csi-node.sh
#
# Results in target/csi-node/: guest-console.log (node_check's output and ferrosan's log),
# guest-report.log, summary.txt. Exit status: non-zero if any check failed or did not report.
#
# Environment: FERROSAN_BIN       prebuilt daemon (default: cargo build --release -p ferrosan);
#                                 it runs in the guest, a Debian 12 like this host
#              CSI_NODE_TIMEOUT   seconds the guest may run (default 600)
#              FERROSAN_GUEST_*   see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=csi-node
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
# shellcheck source=lib/guest-run.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/csi-node
GUEST_TIMEOUT=${CSI_NODE_TIMEOUT:-600}

WORK=""
guest_run_setup
log "building: cargo build -p ferrosan-csi --example node_check"
cargo build -q -p ferrosan-csi --example node_check
CHECK_BIN=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug/examples/node_check
guest_suite csi-node scripts/guest/csi-node.sh 1536 "ferrosan=$FERROSAN_BIN" "node_check=$CHECK_BIN"
