#!/usr/bin/env bash
# Builds, or finds cached, the guest images the test command's guest suites boot: bookworm's
# (scripts/kernel-iscsi.sh, kernel-gateways.sh, kernel-nvme.sh, lvm-pool.sh), bookworm with
# the backports kernel and Debian 13's (kernel-nvme.sh's other two runs). scripts/test.sh runs
# it in the background while cargo compiles: mmdebstrap mostly downloads and unpacks, and a
# fresh machine (CI's) builds all three each run. See scripts/lib/guest.sh for the images.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=guest-images
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
for kernel in stable backports trixie; do
    (
        export FERROSAN_GUEST_KERNEL=$kernel
        # shellcheck source=lib/guest.sh
        source scripts/lib/guest.sh
        guest_image
    )
done
