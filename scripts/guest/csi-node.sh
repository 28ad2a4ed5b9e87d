#!/bin/bash
# The guest's half of scripts/csi-node.sh: ferrosan runs inside the test guest (a directory
# pool, its remote API, iSCSI and NVMe/TCP on the guest's loopback) and ferrosan-csi's
# controller and node services (crates/csi/examples/node_check.rs, /host/node_check) take
# volumes through the guest kernel's iSCSI initiator and NVMe/TCP host as Kubernetes would:
# create, publish, stage (login, mkfs, mount), write a file, unstage (logout), stage again and
# read it back; a second node refused; expand (the mounted ext4 grows); a snapshot restored
# into a new volume holds the file; everything unstaged and logged out at the end.
#
# Reports on $REPORT (the second serial port): PLAN and CHECK lines (scripts/guest/lib.sh).
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source=scripts/guest/lib.sh
source /host/lib.sh
REPORT=${REPORT:-/dev/ttyS1}
WORK=/tmp/csi
mkdir -p "$WORK/pool" "$WORK/state.d"
: >"$WORK/state"
BIN=/host/ferrosan
IQN=iqn.2026-12.org.ferrosan:csi
NQN=nqn.2026-12.org.ferrosan:csi
CHECKS=()
for t in iscsi nvme; do
    CHECKS+=("$t-create" "$t-stage-write-unstage-stage" "$t-second-node-refused" "$t-expand"
        "$t-snapshot-restore" "$t-unstage-all")
done
CHECKS+=(no-session-left)

ctl() { "$BIN" ctl --socket "$WORK/control.sock" "$@"; }

cat >"$WORK/ferrosan.toml" <<CONFIG
[[pool]]
name = "k8s"
path = "$WORK/pool"

[server]
api_listen = "127.0.0.1:8443"
state_dir = "$WORK/state.d"
control_socket = "$WORK/control.sock"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
nvme_listen = ["127.0.0.1:4420"]

[[device]]
name = "boot"
store = "ram"
size = "8M"

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "others"
  initiators = ["iqn.2026-11.org.example:someone-else"]
  luns = [ { lun = 0, device = "boot" } ]
CONFIG

report "PLAN ${CHECKS[*]}"
echo "InitiatorName=iqn.2026-12.org.ferrosan.guest:csi-node" >/etc/iscsi/initiatorname.iscsi
mkdir -p /etc/nvme
echo "nqn.2026-12.org.ferrosan.guest:csi-node" >/etc/nvme/hostnqn
modprobe -a nvme-tcp
iscsid
"$BIN" serve --config "$WORK/ferrosan.toml" </dev/null >>"$WORK/ferrosan.log" 2>&1 &
FERROSAN_PID=$!
if ! wait_until 20 ctl status >/dev/null 2>&1; then
    skip_all "ferrosan did not start" "${CHECKS[@]}"
    cat "$WORK/ferrosan.log"
    exit 0
fi
token=$(ctl --json token create csi --role admin | sed -n 's/.*"token": *"\([^"]*\)".*/\1/p')
printf '%s\n' "$token" >"$WORK/token"
/host/node_check https://127.0.0.1:8443 "$WORK/token" "$WORK/state.d/api-cert.pem" \
    127.0.0.1:3260 127.0.0.1:4420 "$WORK/csi" 2>&1 | while IFS= read -r line; do
    case $line in
        "CHECK "*) report "$line" ;;
        *) printf '%s\n' "$line" ;;
    esac
done || true # its verdicts are its CHECK lines
check_no_session_left() {
    if iscsiadm -m session >/dev/null 2>&1; then fail "an iSCSI session is left: $(iscsiadm -m session)"; fi
    if ls /sys/class/nvme/nvme* >/dev/null 2>&1; then fail "an NVMe controller is left"; fi
}
run no-session-left check_no_session_left
kill -TERM "$FERROSAN_PID"
wait "$FERROSAN_PID" || true
echo "==== ferrosan's log"
cat "$WORK/ferrosan.log"
