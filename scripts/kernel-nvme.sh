#!/usr/bin/env bash
# ferrosan's NVMe/TCP door against the Linux kernel's NVMe/TCP host: a QEMU guest (Debian 12's
# kernel, nvme-cli, open-iscsi, sg3-utils, fio; scripts/lib/guest.sh) discovers and connects to
# ferrosan on this host with native NVMe multipath over two portal groups, and checks identity,
# ANA states and their change notices, fio verify, one device through both doors, one
# reservation table across them, a daemon killed under I/O, a persistent discovery connection
# that hears of a subsystem added live (connect-all then connects it), and in-band authentication
# (DH-HMAC-CHAP, both ways) to a second subsystem (scripts/guest/kernel-nvme.sh,
# the guest's half; docs/NVME.md, "Tested with").
#
#   scripts/kernel-nvme.sh
#
# ferrosan serves one target on two portal groups, each with an iSCSI portal and an NVMe/TCP
# listener: group 1 active/optimized, group 2 active/non-optimized; LUN 0 (NSID 1) a thin
# 512 MiB file. The guest reaches the host's loopback as 10.0.2.2 (QEMU user networking).
#
# Results in target/kernel-nvme/: guest-console.log, guest-report.log, ferrosan.log,
# ferrosan.toml, summary.txt. Exit status: non-zero if any check failed or did not report.
#
# With FERROSAN_GUEST_KERNEL=backports (Linux 6.12) the guest also authenticates to a second
# subsystem with DH-HMAC-CHAP (results then in target/kernel-nvme-bpo/); with
# FERROSAN_GUEST_KERNEL=trixie (Debian 13: Linux 6.12, nvme-cli 2.13, tlshd) it does that and
# connects to a third subsystem over TLS 1.3 with a pre-shared key (target/kernel-nvme-trixie/).
#
# Environment: FERROSAN_BIN         prebuilt daemon (default: cargo build --release -p ferrosan)
#              KERNEL_NVME_TIMEOUT  seconds the guest may run (default 600)
#              FERROSAN_GUEST_*     see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=kernel-nvme
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
# shellcheck source=lib/guest-run.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

# The guest's kernel (scripts/lib/guest.sh): bookworm's 6.1 has no NVMe in-band
# authentication (CONFIG_NVME_AUTH unset), so only the backports kernel runs those checks.
# TLS needs the host's tlshd and an nvme-cli with --tls: Debian 13's.
case ${FERROSAN_GUEST_KERNEL:-stable} in
    backports) OUT=$ROOT/target/kernel-nvme-bpo AUTH_CHECKS=1 TLS_CHECKS=0 ;;
    trixie) OUT=$ROOT/target/kernel-nvme-trixie AUTH_CHECKS=1 TLS_CHECKS=1 ;;
    *) OUT=$ROOT/target/kernel-nvme AUTH_CHECKS=0 TLS_CHECKS=0 ;;
esac
GUEST_TIMEOUT=${KERNEL_NVME_TIMEOUT:-600}
IQN=iqn.2026-11.org.ferrosan:kernel-nvme
NQN=nqn.2026-11.org.ferrosan:kernel-nvme
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b
HOSTID=6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b
INIT=iqn.2026-11.org.ferrosan.guest:nvme-node
NAA=5001405f3e7a2b1c
BLOCKS=$((512 << 20 >> 9))
RESTART_GAP=3

WORK=""
guest_run_setup

# On the disk (not tmpfs): the LUN takes ferrosan's direct-I/O path, as a real file LUN does.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-kernel-nvme.XXXXXX")
mkdir -m 0700 "$WORK/run" "$WORK/state"
mkdir -p "$WORK/share/acks"
# Five distinct free ports: each group's iSCSI portal and NVMe/TCP listener, and group 1's
# discovery listener (not 8009: another daemon on this host may hold it).
PORTS=()
while ((${#PORTS[@]} < 5)); do
    p=$(free_port)
    [[ " ${PORTS[*]} " == *" $p "* ]] || PORTS+=("$p")
done
ISCSI_PORT=${PORTS[0]} ISCSI_PORT2=${PORTS[1]} PORT_OPT=${PORTS[2]} PORT_NONOPT=${PORTS[3]}
PORT_DISC=${PORTS[4]}

# DH-HMAC-CHAP secrets in their standard form (as `nvme gen-dhchap-key` writes them): the
# host's with the SHA-256 transform, the controller's without; and one nobody holds.
SECURE_NQN=$NQN-secure
dhchap_key() {
    python3 -c 'import base64, os, sys, zlib
k = os.urandom(32)
print("DHHC-1:%s:%s:" % (sys.argv[1], base64.b64encode(k + zlib.crc32(k).to_bytes(4, "little")).decode()))' "$1"
}
HOST_KEY=$(dhchap_key 01) CTRL_KEY=$(dhchap_key 00) WRONG_KEY=$(dhchap_key 01)
(umask 077 && echo "$HOST_KEY" >"$WORK/host.key" && echo "$CTRL_KEY" >"$WORK/ctrl.key")
# A TLS pre-shared key in its interchange form (as `nvme gen-tls-key` writes one: HASH 01 for
# SHA-256, 32 bytes; 02 for SHA-384, 48 bytes), and one ferrosan does not hold.
TLS_NQN=$NQN-tls TLS384_NQN=$NQN-tls384
tls_key() {
    python3 -c 'import base64, os, sys, zlib
k = os.urandom(16 + 16 * int(sys.argv[1]))
print("NVMeTLSkey-1:%s:%s:" % (sys.argv[1], base64.b64encode(k + zlib.crc32(k).to_bytes(4, "little")).decode()))' "${1:-01}"
}
TLS_KEY=$(tls_key) WRONG_TLS_KEY=$(tls_key) TLS384_KEY=$(tls_key 02)
(umask 077 && echo "$TLS_KEY" >"$WORK/tls.key" && echo "$TLS384_KEY" >"$WORK/tls384.key")

cat >"$OUT/ferrosan.toml" <<CONFIG
# scripts/kernel-nvme.sh: one target on two portal groups, each with an NVMe/TCP listener.
[server]
state_dir = "$WORK/state"
control_socket = "$WORK/run/control.sock"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$ISCSI_PORT"]
nvme_listen = ["127.0.0.1:$PORT_OPT"]
nvme_discovery_listen = ["127.0.0.1:$PORT_DISC"]

[[portal_group]]
tag = 2
listen = ["127.0.0.1:$ISCSI_PORT2"]
nvme_listen = ["127.0.0.1:$PORT_NONOPT"]
alua_state = "active-non-optimized"

[[device]]
name = "lun0"
store = "file"
path = "$WORK/lun0.img"
size = "512M"
naa = "0x$NAA"
thin = true

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "guest"
  initiators = ["$HOSTNQN", "$INIT"]
  luns = [ { lun = 0, device = "lun0" } ]

# A second subsystem whose hosts authenticate (DH-HMAC-CHAP, both ways).
[[device]]
name = "secure"
store = "ram"
size = "64M"

[[target]]
iqn = "$IQN-secure"
nqn = "$SECURE_NQN"

  [[target.group]]
  name = "guest"
  initiators = ["$HOSTNQN"]
  auth = "chap"
  users = [ { user = "$HOSTNQN", secret_file = "$WORK/host.key" } ]
  mutual = { user = "ferrosan", secret_file = "$WORK/ctrl.key" }
  luns = [ { lun = 0, device = "secure" } ]

CONFIG
# tls_subsystem NAME NQN KEY_FILE: a device and a subsystem whose host must connect over TLS 1.3
# with the pre-shared key in KEY_FILE. Debian 13's nvme-cli (libnvme 1.13) derives the TLS PSK
# the way libnvme 1.15 and older do.
tls_subsystem() {
    cat <<SUBSYSTEM

[[device]]
name = "$1"
store = "ram"
size = "64M"

[[target]]
iqn = "$IQN-$1"
nqn = "$2"
tls_keys = [ { host = "$HOSTNQN", key_file = "$3", derivation = "libnvme-1.15" } ]

  [[target.group]]
  name = "guest"
  initiators = ["$HOSTNQN"]
  luns = [ { lun = 0, device = "$1" } ]
SUBSYSTEM
}
# A SHA-256 key (identity NVMe0R01) and a SHA-384 one (NVMe0R02).
tls_subsystem tls "$TLS_NQN" "$WORK/tls.key" >>"$OUT/ferrosan.toml"
tls_subsystem tls384 "$TLS384_NQN" "$WORK/tls384.key" >>"$OUT/ferrosan.toml"
"$FERROSAN_BIN" check-config "$OUT/ferrosan.toml" >/dev/null

DAEMON_PORTS=("$PORT_OPT" "$PORT_NONOPT" "$ISCSI_PORT")
start_ferrosan || die "ferrosan did not start"
log "ferrosan (PID $DAEMON_PID): NVMe/TCP on 127.0.0.1:$PORT_OPT (optimized) and 127.0.0.1:$PORT_NONOPT (non-optimized), iSCSI on 127.0.0.1:$ISCSI_PORT"

cp scripts/guest/kernel-nvme.sh "$WORK/share/main.sh"
cp scripts/guest/lib.sh "$WORK/share/lib.sh"
cat >"$WORK/share/params" <<PARAMS
NQN=$NQN
TARGET_IQN=$IQN
HOST_ADDR=10.0.2.2
PORT_OPT=$PORT_OPT
PORT_NONOPT=$PORT_NONOPT
PORT_DISC=$PORT_DISC
ISCSI_PORT=$ISCSI_PORT
HOSTNQN=$HOSTNQN
HOSTID=$HOSTID
INIT=$INIT
EUI64=$NAA
BLOCKS=$BLOCKS
SECURE_NQN=$SECURE_NQN
HOST_KEY=$HOST_KEY
CTRL_KEY=$CTRL_KEY
WRONG_KEY=$WRONG_KEY
AUTH_CHECKS=$AUTH_CHECKS
TLS_NQN=$TLS_NQN
TLS_KEY=$TLS_KEY
WRONG_TLS_KEY=$WRONG_TLS_KEY
TLS_CHECKS=$TLS_CHECKS
TLS384_NQN=$TLS384_NQN
TLS384_KEY=$TLS384_KEY
PARAMS

CONSOLE=$OUT/guest-console.log
REPORT=$OUT/guest-report.log
T0=$(date +%s)
guest_start "$WORK/share" "$CONSOLE" "$REPORT" 1024
log "guest booting (QEMU PID $GUEST_PID, ${FERROSAN_GUEST_ACCEL:-tcg}); console: $CONSOLE"

follow_guest
# Which suite each subsystem's TLS queues used (the tls-* checks), from ferrosan's log.
if ((TLS_CHECKS)); then
    grep -F 'over TLS 1.3' "$OUT/ferrosan.log" | grep -oE 'subsystem=[^ ]+ suite="?[A-Z0-9_]+' |
        tr -d '"' | sort | uniq -c | while read -r line; do log "TLS queues: $line"; done || true
fi
guest_verdicts kernel-nvme
