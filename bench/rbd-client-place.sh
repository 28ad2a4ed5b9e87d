#!/usr/bin/env bash
# What the OSD spends per I/O, by where its client runs and how it acknowledges writes: one
# image of a single-node cluster on tmpfs (PLACEMENT=hosts: the cluster at CLUSTER_SHARE % of the
# first half of the CPUs), and per round one fio run of each path (RW, BS, QD), reporting fio's
# IOPS and latency, the OSD's operations and bytes in that direction per I/O (its perf counters),
# its CPU per I/O and the gateway's:
#   librbd      fio's rbd engine on the cluster's CPUs (bench/rbd-lib.sh CLIENT_CPUS), librbd's
#               default cache (write-around: a write answered once librbd has it)
#   librbd-far  fio's rbd engine on the other CPUs (LIBRBD_CPUS), as on a host of its own
#   gateway     fio's libiscsi engine on the cluster's CPUs, through a ferrosan gateway
#               alone on the other CPUs
#   gateway-far fio's libiscsi engine beside the gateway (LIBRBD_CPUS), the cluster alone
#   gateway-wc  as gateway, through a second gateway of the image whose LU has its write cache
#               on (`,write_cache`: a write answered once librbd has it, as librbd's cache does)
# Loopback TCP charges the sender for the receiver's side too, and less when the receiver
# shares its CPU: this shows how much, and so what bench/rbd.sh's hosts placement must avoid.
# With RW=randwrite it shows what each way of acknowledging writes asks of the OSD.
#
#   bench/rbd-client-place.sh [BIN]      # BIN: a ferrosan build (default: this tree's release)
#
# Env: ROUNDS (3), RUNTIME (10 s), RW (read; or randread, write, randwrite), BS (1m), QD (16),
# PATHS ("librbd librbd-far gateway gateway-far").
# Results: bench/results/rbd-client-place-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=rbd-client-place
# shellcheck source=rbd-lib.sh
source "$ROOT/bench/rbd-lib.sh"
BIN=${1:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan}
[[ -x $BIN ]] || cargo build --release -q -p ferrosan
FIO=$(bench/fio-libiscsi.sh)
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
RW=${RW:-read}
BS=${BS:-1m}
QD=${QD:-16}
case $RW in
    read | randread) DIR="read" ;;
    write | randwrite) DIR="write" ;;
    *) die "RW=$RW: read, randread, write or randwrite" ;;
esac
PATHS=${PATHS:-librbd librbd-far gateway gateway-far}
scratch /tmp/rbd-client-place.XXXXXX
CEPH=/dev/shm/rbd-client-place-$$
declare -A GW_PID=()
on_exit 'for gw in "${!GW_PID[@]}"; do rbd_gateway_stop "$gw"; done; rbd_cluster_stop "$CEPH"'
rbd_cluster_start "$CEPH" 6 hosts
rbd create --size 2G rbd/place
rbd_fill "$FIO" rbd place 2
rbd_gateway gw "$BIN" "$WORK/state" "$WORK/gw.log" rbd:rbd/place
URL_GW=$GW_URL
if [[ " $PATHS " == *" gateway-wc "* ]]; then
    rbd_gateway gwwc "$BIN" "$WORK/state-wc" "$WORK/gwwc.log" rbd:rbd/place,write_cache
    URL_WC=$GW_URL
fi
OSD=$(cat "$CEPH"/run/osd*.pid)
ASOK=$(echo "$CEPH"/run/ceph-osd.0.asok)
# osd_counters: the OSD's operations and bytes in the direction measured, and all its
# operations, so far.
osd_counters() {
    ceph --admin-daemon "$ASOK" perf dump | python3 -c 'import json, sys
d = json.load(sys.stdin)["osd"]
ops, nbytes = ("op_r", "op_out_bytes") if sys.argv[1] == "read" else ("op_w", "op_in_bytes")
print(d[ops], d[nbytes], d["op"])' "$DIR"
}
OUT=bench/results/rbd-client-place-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/rbd-client-place.sh $(date -u +%FT%TZ): bin=$BIN rounds=$ROUNDS rw=$RW bs=$BS qd=$QD runtime=${RUNTIME}s"
    echo "# round path iops mean_lat_us osd_${DIR}s_per_io osd_kib_${DIR}_per_io osd_ops_per_io osd_cpu_us_per_io gateway_cpu_us_per_io"
} >"$OUT"
for r in $(seq "$ROUNDS"); do
    for path in $PATHS; do
        gw=gw
        case $path in
            librbd) cpus=("${CLIENT_CPUS[@]}") engine=(--ioengine=rbd --pool=rbd --rbdname=place --clientname=admin) ;;
            librbd-far) cpus=("${LIBRBD_CPUS[@]}") engine=(--ioengine=rbd --pool=rbd --rbdname=place --clientname=admin) ;;
            gateway) cpus=("${CLIENT_CPUS[@]}") engine=(--ioengine=libiscsi "--filename=$URL_GW") ;;
            gateway-far) cpus=("${LIBRBD_CPUS[@]}") engine=(--ioengine=libiscsi "--filename=$URL_GW") ;;
            gateway-wc) cpus=("${CLIENT_CPUS[@]}") engine=(--ioengine=libiscsi "--filename=$URL_WC") gw=gwwc ;;
            *) die "unknown path $path" ;;
        esac
        before=$(osd_counters) o0=$(ticks "$OSD") g0=$(ticks "${GW_PID[$gw]}")
        "${cpus[@]}" "$FIO" --name=x --rw="$RW" --bs="$BS" --iodepth="$QD" "${engine[@]}" --size=2g \
            --time_based --runtime="$RUNTIME" --output-format=json >"$WORK/fio.json" 2>"$WORK/fio.err" ||
            die "fio on $path: $(tail -3 "$WORK/fio.err")"
        after=$(osd_counters) o1=$(ticks "$OSD") g1=$(ticks "${GW_PID[$gw]}")
        python3 - "$WORK/fio.json" "$before" "$after" $((o1 - o0)) $((g1 - g0)) "$HZ" "$r" "$path" "$DIR" >>"$OUT" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0][sys.argv[9]]
b, a = (list(map(int, s.split())) for s in sys.argv[2:4])
osd, gw, hz = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
ios = job["total_ios"]
if ios <= 0:
    sys.exit(f"{sys.argv[8]}: fio did no I/O ({sys.argv[9]})")
per = lambda x: x / ios
print(f"{sys.argv[7]} {sys.argv[8]} {job['iops']:.0f} {job['lat_ns']['mean'] / 1e3:.0f} "
      f"{per(a[0] - b[0]):.2f} {per(a[1] - b[1]) / 1024:.0f} {per(a[2] - b[2]):.2f} "
      f"{per(osd) / hz * 1e6:.0f} {per(gw) / hz * 1e6:.0f}")
PY
        tail -1 "$OUT"
    done
done
log "results: $OUT"
