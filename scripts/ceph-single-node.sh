#!/usr/bin/env bash
# A throwaway single-node Ceph cluster on loopback for the RBD tests and benchmarks: one
# monitor, one manager, one OSD (BlueStore on a sparse file), pool `rbd`, all state under DIR.
# No cephadm, no systemd, nothing under /etc/ceph or /var/lib/ceph is touched.
#
#   scripts/ceph-single-node.sh start DIR [OSD_GIB]   # prints CEPH_CONF=DIR/ceph.conf on stdout
#   scripts/ceph-single-node.sh stop DIR              # kills the daemons it started (by PID)
#
# Clients then use CEPH_CONF=DIR/ceph.conf (client.admin's keyring is named there). Needs the
# Debian packages ceph-mon, ceph-mgr, ceph-osd and ceph-common (root, for the OSD's file).
# OSD_CACHE_MIB (128) sizes BlueStore's cache: small for the tests; benchmarks that overwrite
# gigabytes at random want more (the OSD slows down as fragmented objects miss the cache).
# PG_NUM (8) is pool rbd's placement groups. An OSD divides its PG log budget
# (osd_target_pg_log_entries_per_osd, 300000) among its PGs, up to 10000 entries each: with 8,
# every PG keeps 10000 and the OSD's log trimming walks them on every write once they are
# full (PeeringState::calc_trim_to_aggressive, measured at 67-73 % of the OSD's CPU after a few
# minutes of random 4 KiB writes). A production OSD holds ~100-200 PGs (~1500-3000 entries
# each): benchmarks pass PG_NUM=128 to get that.
# CEPH_ADDR (127.0.0.1) is the address the daemons bind and clients dial, and CEPH_NETWORK
# (127.0.0.0/8) its network: a test that runs the cluster in a network namespace of its own
# gives it an address there, so that cutting a link cuts the cluster off (tests/netcut.rs).
set -euo pipefail
CMD=${1:?usage: $0 start|stop DIR [OSD_GIB]}
DIR=${2:?usage: $0 start|stop DIR [OSD_GIB]}
OSD_GIB=${3:-4}
PG_NUM=${PG_NUM:-8}
ADDR=${CEPH_ADDR:-127.0.0.1}
NETWORK=${CEPH_NETWORK:-127.0.0.0/8}
log() { echo "[ceph] $*" >&2; }

stop() {
    local f pid
    for f in "$DIR"/run/*.pid; do
        [[ -e $f ]] || continue
        pid=$(cat "$f")
        # Only a process we started: its command line names our config.
        if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$DIR/ceph.conf"; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
}

if [[ $CMD == stop ]]; then
    stop
    exit 0
fi
[[ $CMD == start ]] || { echo "usage: $0 start|stop DIR [OSD_GIB]" >&2; exit 2; }
for tool in ceph-mon ceph-mgr ceph-osd ceph ceph-authtool monmaptool; do
    command -v "$tool" >/dev/null || { log "missing $tool (apt-get install ceph-mon ceph-mgr ceph-osd ceph-common)"; exit 1; }
done
DIR=$(mkdir -p "$DIR" && cd "$DIR" && pwd)
mkdir -p "$DIR"/{run,log,mon,mgr,osd}
trap 'rc=$?; ((rc == 0)) || { log "start failed; stopping what started"; stop; }' EXIT
FSID=$(cat /proc/sys/kernel/random/uuid)
# A free port for the monitor (msgr v2 only), from the ephemeral range's upper part.
MON_PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("'"$ADDR"'",0));print(s.getsockname()[1])')
CONF=$DIR/ceph.conf
cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:$ADDR:$MON_PORT]
public network = $NETWORK
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $DIR/\$cluster.\$name.keyring
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
# The manager's autoscaler would split or merge the pool's PGs while clients write (each change
# re-peers PGs and holds their I/O for seconds): PG_NUM stays what it is.
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
auth allow insecure global id reclaim = false
mon data avail warn = 2
mon data avail crit = 1
ms bind ipv4 = true
ms bind msgr1 = false
[mon]
admin socket = $DIR/run/\$cluster-\$name.asok
mon data = $DIR/mon/\$cluster-\$id
mon allow pool delete = true
[mgr]
admin socket = $DIR/run/\$cluster-\$name.asok
mgr data = $DIR/mgr/\$cluster-\$id
# The dashboard, prometheus and other modules are not needed and cost memory and start time.
mgr initial modules = 
[osd]
admin socket = $DIR/run/\$cluster-\$name.asok
osd data = $DIR/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block path = $DIR/osd/block-\$id
bluestore block create = true
bluestore block size = $((OSD_GIB << 30))
osd memory target = $(((${OSD_CACHE_MIB:-128} + 768) << 20))
bluestore cache autotune = false
bluestore cache size = $((${OSD_CACHE_MIB:-128} << 20))
osd max object size = 134217728
EOF
export CEPH_CONF=$CONF
started=$(date +%s.%N)
ceph-authtool --create-keyring "$DIR/ceph.mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool --create-keyring "$DIR/ceph.client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
ceph-authtool "$DIR/ceph.mon.keyring" --import-keyring "$DIR/ceph.client.admin.keyring" >/dev/null
monmaptool --create --addv a "[v2:$ADDR:$MON_PORT]" --fsid "$FSID" "$DIR/monmap" >/dev/null
ceph-mon --cluster ceph --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/ceph.mon.keyring" -c "$CONF"
ceph-mon -i a -c "$CONF"
log "monitor on $ADDR:$MON_PORT"
ceph -c "$CONF" --connect-timeout 30 mon enable-msgr2 >/dev/null 2>&1 || true

mkdir -p "$DIR/mgr/ceph-x"
ceph -c "$CONF" auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
    >"$DIR/mgr/ceph-x/keyring"
ceph-mgr -i x -c "$CONF" --keyring "$DIR/mgr/ceph-x/keyring"

OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSD_ID=$(ceph -c "$CONF" osd new "$OSD_UUID")
mkdir -p "$DIR/osd/ceph-$OSD_ID"
ceph -c "$CONF" auth get-or-create "osd.$OSD_ID" mon 'allow profile osd' mgr 'allow profile osd' osd 'allow *' \
    >"$DIR/osd/ceph-$OSD_ID/keyring"
ceph-osd -i "$OSD_ID" -c "$CONF" --mkfs --osd-uuid "$OSD_UUID" --keyring "$DIR/osd/ceph-$OSD_ID/keyring" >"$DIR/log/osd-mkfs.log" 2>&1 ||
    { log "ceph-osd --mkfs failed:"; tail -n 20 "$DIR/log/osd-mkfs.log" >&2; exit 1; }
ceph-osd -i "$OSD_ID" -c "$CONF" --keyring "$DIR/osd/ceph-$OSD_ID/keyring"
ceph -c "$CONF" osd pool create rbd "$PG_NUM" "$PG_NUM" >/dev/null
ceph -c "$CONF" osd pool set rbd size 1 --yes-i-really-mean-it >/dev/null 2>&1 || true
rbd -c "$CONF" pool init rbd
for _ in $(seq 120); do
    health=$(ceph -c "$CONF" health 2>/dev/null || true)
    [[ $health == HEALTH_OK* ]] && break
    sleep 0.5
done
[[ $health == HEALTH_OK* ]] || { log "not healthy after 60 s: $health"; ceph -c "$CONF" -s >&2 || true; exit 1; }
log "HEALTH_OK after $(python3 -c "import time;print(round(time.time()-$started,1))") s; state in $DIR"
echo "CEPH_CONF=$CONF"
