#!/usr/bin/env bash
# ferrosan against the Linux kernel's iSCSI initiator: a QEMU guest (Debian 12's kernel,
# open-iscsi, dm-multipath, sg3-utils, fio; scripts/lib/guest.sh) logs in to ferrosan running on
# this host and checks SCSI commands, ALUA, persistent reservations, multipath failover over a
# cut path, and fio verify through daemon restarts (scripts/guest/kernel-iscsi.sh, the guest's
# half; docs/CONFORMANCE.md, "Linux kernel initiator").
#
#   scripts/kernel-iscsi.sh
#
# ferrosan serves one target on two loopback portals: portal group 1 active/optimized, portal
# group 2 active/non-optimized, LUN 0 a thin 512 MiB file. The guest reaches the host's loopback
# as 10.0.2.2 (QEMU user networking); it prints CHECK lines on its second serial port and asks
# for daemon restarts there ("HOST: restart-ferrosan KILL|TERM"), which this script carries out
# (by PID) and acknowledges through the guest's share.
#
# Results in target/kernel-iscsi/: guest-console.log (the guest's kernel, init and checks),
# guest-report.log (its CHECK lines), ferrosan.log (every daemon run, appended), ferrosan.toml,
# summary.txt. Exit status: non-zero if any check failed or did not report.
#
# Environment: FERROSAN_BIN          prebuilt daemon (default: cargo build --release -p ferrosan)
#              KERNEL_ISCSI_TIMEOUT  seconds the guest may run (default 600)
#              FERROSAN_GUEST_*      see scripts/lib/guest.sh (accelerator, mirror, cache)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=kernel-iscsi
# shellcheck source=lib/common.sh
source scripts/lib/common.sh
# shellcheck source=lib/guest.sh
source scripts/lib/guest.sh
# shellcheck source=lib/guest-run.sh
source scripts/lib/guest-run.sh
export PATH="$PATH:/usr/sbin:/sbin"

OUT=$ROOT/target/kernel-iscsi
GUEST_TIMEOUT=${KERNEL_ISCSI_TIMEOUT:-600}
IQN=iqn.2026-11.org.ferrosan:kernel-iscsi
INIT_A=iqn.2026-11.org.ferrosan.guest:node-a
INIT_B=iqn.2026-11.org.ferrosan.guest:node-b
# CHAP both ways: the initiators prove themselves (CHAP_USER) and the target proves itself back
# (mutual, MUTUAL_USER), with the strongest algorithm both sides offer.
CHAP_USER=guest CHAP_SECRET=kernel-initiator-s3cret
MUTUAL_USER=ferrosan-kernel-iscsi MUTUAL_SECRET=target-proves-itself-2026
# Discovery (SendTargets) needs CHAP of its own, as the ESXi guide sets it up: an initiator that
# offers only CHAP, as ESXi's "required" makes it, finds the target.
DISC_USER=discover DISC_SECRET=discovery-s3cret-2026
# Seconds ferrosan stays down in a restart: longer than the guest's replacement_timeout (5 s),
# so the sessions give up their commands and dm-multipath queues them with no path left.
RESTART_GAP=8

WORK=""
guest_run_setup

# On the disk (not tmpfs): the LUN takes ferrosan's direct-I/O path, as a real file LUN does.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferrosan-kernel-iscsi.XXXXXX")
mkdir -m 0700 "$WORK/run" "$WORK/state"
mkdir -p "$WORK/share/acks"
PORT_OPT=$(free_port)
PORT_NONOPT=$(free_port)
while [[ $PORT_NONOPT == "$PORT_OPT" ]]; do PORT_NONOPT=$(free_port); done

cat >"$OUT/ferrosan.toml" <<CONFIG
# scripts/kernel-iscsi.sh: one target on two portal groups, a thin file LUN.
[server]
state_dir = "$WORK/state"
control_socket = "$WORK/run/control.sock"

[discovery]
users = [ { user = "$DISC_USER", secret = "$DISC_SECRET" } ]

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$PORT_OPT"]

[[portal_group]]
tag = 2
listen = ["127.0.0.1:$PORT_NONOPT"]
alua_state = "active-non-optimized"

[[device]]
name = "lun0"
store = "file"
path = "$WORK/lun0.img"
size = "512M"
thin = true

[[target]]
iqn = "$IQN"
# portal_groups omitted: both
users = [ { user = "$CHAP_USER", secret = "$CHAP_SECRET" } ]
mutual = { user = "$MUTUAL_USER", secret = "$MUTUAL_SECRET" }

  [[target.group]]
  name = "guest"
  initiators = ["$INIT_A", "$INIT_B"]
  luns = [ { lun = 0, device = "lun0" } ]
CONFIG
"$FERROSAN_BIN" check-config "$OUT/ferrosan.toml" >/dev/null
chmod 0600 "$OUT/ferrosan.toml" # it holds the CHAP secrets

DAEMON_PORTS=("$PORT_OPT" "$PORT_NONOPT")
start_ferrosan || die "ferrosan did not start"
log "ferrosan (PID $DAEMON_PID) on 127.0.0.1:$PORT_OPT (optimized) and 127.0.0.1:$PORT_NONOPT (non-optimized)"

cp scripts/guest/kernel-iscsi.sh "$WORK/share/main.sh"
cp scripts/guest/lib.sh "$WORK/share/lib.sh"
cat >"$WORK/share/params" <<PARAMS
TARGET_IQN=$IQN
HOST_ADDR=10.0.2.2
PORT_OPT=$PORT_OPT
PORT_NONOPT=$PORT_NONOPT
INIT_A=$INIT_A
INIT_B=$INIT_B
CHAP_USER=$CHAP_USER
CHAP_SECRET=$CHAP_SECRET
MUTUAL_USER=$MUTUAL_USER
MUTUAL_SECRET=$MUTUAL_SECRET
DISC_USER=$DISC_USER
DISC_SECRET=$DISC_SECRET
PARAMS

CONSOLE=$OUT/guest-console.log
REPORT=$OUT/guest-report.log
T0=$(date +%s)
guest_start "$WORK/share" "$CONSOLE" "$REPORT" 1024
log "guest booting (QEMU PID $GUEST_PID, ${FERROSAN_GUEST_ACCEL:-tcg}); console: $CONSOLE"

follow_guest
guest_verdicts kernel-iscsi
