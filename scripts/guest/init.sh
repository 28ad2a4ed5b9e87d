#!/bin/bash
# PID 1 of ferrosan's test guest (scripts/lib/guest.sh bakes it into the image as /sbin/ferrosan-init).
#
# Not systemd: under software emulation (TCG) a full systemd boot costs tens of seconds, and the
# tests need only a handful of daemons, which the test script starts itself (iscsid, multipathd).
# This init mounts the pseudo filesystems, loads the modules the tests use, starts udev (multipathd
# and device-mapper wait for udev events), configures QEMU's user network, mounts the host's share
# (9p, tag "host") at /host and runs /host/main.sh with its output on the console (ttyS0); the
# second serial port (ttyS1) is the report channel the host reads. Then it powers the guest off,
# whatever main.sh did, so QEMU exits.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8

say() { echo "init: $* ($(cut -d' ' -f1 /proc/uptime)s)"; }
power_off() {
    sync
    echo o >/proc/sysrq-trigger
    sleep 30
}
trap power_off EXIT

mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mountpoint -q /dev/pts || mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# The root disk is a QEMU snapshot (writes are dropped at exit): writable, nothing persists.
mount -o remount,rw /
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/lock /run/udev
mount -t tmpfs tmpfs /tmp
hostname ferrosan-guest
exec </dev/null >/dev/ttyS0 2>&1
say "up"

# 9p for the share; the rest for the tests (loaded now so no test waits for udev to load them).
modprobe -a virtio_net 9pnet_virtio 9p iscsi_tcp dm_multipath dm_round_robin dm_service_time \
    scsi_dh_alua sg nvme_tcp nf_tables || say "some modules did not load"
/lib/systemd/systemd-udevd --daemon
udevadm trigger --action=add
udevadm settle --timeout=30

# QEMU's user network (slirp): the guest is 10.0.2.15, the host's loopback is 10.0.2.2.
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2

mkdir -p /host
if ! mount -t 9p -o trans=virtio,version=9p2000.L,cache=none host /host; then
    say "cannot mount the host's share"
    exit 1
fi
say "ready"
export REPORT=/dev/ttyS1
stty -F "$REPORT" raw -echo 2>/dev/null || true
if [[ -f /host/main.sh ]]; then
    bash /host/main.sh
    say "main.sh exited with status $?"
else
    say "no /host/main.sh"
fi
