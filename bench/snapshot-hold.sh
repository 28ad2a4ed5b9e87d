#!/usr/bin/env bash
# What a crash-consistent snapshot costs a volume under load: 4 KiB random writes at QD16 to a
# volume of an XFS pool (a loop device; reflink snapshots), measured twice by `ferrosan bench`
# in one run: once quiet, once while `ctl volume snapshot` takes a snapshot every INTERVAL
# seconds (each holds the volume's writes while the file is flushed and reflinked). Reports
# both runs' IOPS and latency (p99, p99.9, max), the slowest step of their IOPS over time, and
# how long each snapshot took. Needs root.
#
#   bench/snapshot-hold.sh BIN [SECONDS] [INTERVAL]
#
# Results: bench/results/snapshot-hold-DATE.txt (and the two runs' results.json beside it).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=snapshot-hold
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/snapshot-hold.sh BIN [SECONDS] [INTERVAL]}
SECONDS_RUN=${2:-20}
INTERVAL=${3:-2}
IQN=iqn.2026-11.org.ferrosan:snapshot-hold
scratch
LOOP=""
on_exit 'xfs_unmount "$WORK/mnt" "$LOOP"'

STAMP=$(date -u +%Y-%m-%d-%H%M)
RESULT=bench/results/snapshot-hold-$STAMP.txt
mkdir -p bench/results
LOOP=$(xfs_mount "$WORK/fs.img" 4G "$WORK/mnt")
port=$(free_port)
cat > "$WORK/config.toml" <<TOML
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$port"]

[[pool]]
name = "fast"
path = "$WORK/mnt/pool"

[[device]]
name = "boot"
store = "ram"
size = "8M"

[[target]]
iqn = "$IQN"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "boot" } ]
TOML
START_SECONDS=30 start_daemon daemon "$port" "$BIN" serve --config "$WORK/config.toml" \
    --control-socket "$WORK/ctl.sock"
ctl() { "$BIN" ctl --socket "$WORK/ctl.sock" "$@"; }
ctl volume create fast vm1 1G > /dev/null
ctl lun map "$IQN" all 1 vm1 > /dev/null
URL="iscsi://127.0.0.1:$port/$IQN/1"
bench() { # OUT [ONLY] [RUNTIME]
    "$BIN" bench --destructive --only "${2:-randwrite-4k-qd16}" --ramp 2 --runtime "${3:-$SECONDS_RUN}" \
        --out "$WORK/$1" "$URL" 2> "$WORK/$1.log" || die "bench $1: $(tail -3 "$WORK/$1.log")"
}
log "writing the volume whole (the snapshots then share real extents)"
bench fill seqwrite-1m-qd16 5

extents() { echo "$1: $(filefrag "$WORK/mnt/pool/vm1.img" | sed 's/.*: //')" >> "$WORK/extents"; }
: > "$WORK/extents"
extents "after the fill"
log "quiet run: ${SECONDS_RUN} s of 4 KiB random writes, QD16"
bench quiet
extents "after the quiet run"
log "the same with a snapshot every ${INTERVAL} s"
bench snapshots &
BENCH=$!
sleep 3
: > "$WORK/snaps"
n=0
deadline=$(( $(date +%s) + SECONDS_RUN - 1 ))
while (( $(date +%s) < deadline )); do
    n=$((n + 1))
    t0=$(date +%s.%N)
    ctl volume snapshot vm1 "s$n" > /dev/null || die "snapshot s$n failed"
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" -v n="$n" 'BEGIN { printf "s%d %.3f\n", n, b - a }' >> "$WORK/snaps"
    sleep "$INTERVAL"
done
wait "$BENCH" || die "the bench under snapshots failed"
extents "after the run with snapshots"

summary() { # LABEL DIR
    python3 - "$1" "$2/results.json" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
row = json.load(open(path))["rows"][0]
if row["iops"] <= 0 or row["errors"]:
    sys.exit(f"{label}: no I/O measured or errors: {row['iops']} IOPS, {row['errors']} errors")
lat, series = row["latency_us"], row["iops_over_time"]
print(f"{label:<10} {row['iops']:>9.0f} IOPS  p99 {lat['p99']:>7.0f} us  p99.9 {lat['p99_9']:>8.0f} us  "
      f"max {lat['max']:>8.0f} us  slowest {series['interval_s']:.1f} s step {min(series['iops']):>8.0f} IOPS")
PY
}
{
    echo "# bench/snapshot-hold.sh $STAMP: bin=$BIN ${SECONDS_RUN} s of 4 KiB random writes QD16 to a 1 GiB volume (XFS reflink pool on a loop device), snapshot every ${INTERVAL} s"
    summary quiet "$WORK/quiet"
    summary snapshots "$WORK/snapshots"
    echo "# each snapshot's ctl call, seconds (writes held for part of it):"
    tr '\n' ' ' < "$WORK/snaps"; echo
    echo "# extents of the volume's file after each run (a reflink walks them all):"
    cat "$WORK/extents"
} | tee "$RESULT"
cp "$WORK/quiet/results.json" "${RESULT%.txt}-quiet.json"
cp "$WORK/snapshots/results.json" "${RESULT%.txt}-snapshots.json"
log "results: $RESULT"
