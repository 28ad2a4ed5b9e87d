#!/bin/bash
# Several guest-only suites in one boot (scripts/lib/guest-run.sh, guest_suites): each
# /host/SUITE.sh named in /host/suites, one after the other, with SUITE set so that its checks
# report as SUITE/CHECK. Between two suites what one may have left is put away, so the next
# starts as on a fresh boot: iSCSI sessions and node records, NVMe controllers, iscsid, and any
# ferrosan still running (a suite that failed midway may not have stopped its own).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
REPORT=${REPORT:-/dev/ttyS1}

tidy() {
    local p
    iscsiadm -m node -u >/dev/null 2>&1
    iscsiadm -m node -o delete >/dev/null 2>&1
    nvme disconnect-all >/dev/null 2>&1
    [[ -s /run/iscsid.pid ]] && kill "$(cat /run/iscsid.pid)" 2>/dev/null
    for p in $(pidof ferrosan); do kill "$p"; done
    wait_until 10 bash -c '! pidof iscsid ferrosan >/dev/null'
    rm -f /run/iscsid.pid
}

while read -r suite; do
    printf '\n======== suite %s\n' "$suite"
    SUITE=$suite bash "/host/$suite.sh"
    printf '======== suite %s exited with status %s\n' "$suite" "$?"
    tidy
done </host/suites
