#!/usr/bin/env bash
# Write stalls: does a write storm to a disk-backed LU slow the other connections of its worker?
#
# One worker (so both initiators share it), a file LU on a disk filesystem and a RAM LU. qemu-img
# writes GIB GiB in 1 MiB writes at QD16 to the file LU while QD1 4 KiB reads of the RAM LU run
# in rounds of 1000; reported: the reader's IOPS alone and during the storm, the writer's time,
# and the stall counters. Runs alternate write_stall_us = 1000000 (writes stay inline) and the
# default 100, ROUNDS times.
#
# usage: bench/stall.sh [DIR (default /var/tmp; must not be tmpfs)] [GIB (default 8)] [ROUNDS (default 2)]
#        PREALLOCATE=1 bench/stall.sh ...   the same on a file whose blocks are allocated up front
#        PREWRITE=1 bench/stall.sh ...      the same on a file written through once (overwrites only)
#        FERROSAN_BIN=path bench/stall.sh ... that binary instead of building target/release/ferrosan
set -euo pipefail
DIR=${1:-/var/tmp}
GIB=${2:-8}
ROUNDS=${3:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG_TAG=stall
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"
if [[ -n ${FERROSAN_BIN:-} ]]; then
  BIN=$FERROSAN_BIN
else
  BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
  (cd "$ROOT" && cargo build --release -q)
fi
case $(stat -f -c %T "$DIR") in tmpfs|ramfs) echo "$DIR is $(stat -f -c %T "$DIR"): use a disk filesystem" >&2; exit 2;; esac
scratch
LUN=$DIR/ferrosan-stall-$$.img
on_exit 'rm -f "$LUN"'
read -r PORT METRICS < <(two_ports)
IQN=iqn.2026-11.org.ferrosan:stall
URL=iscsi://127.0.0.1:$PORT/$IQN

run_one() { # $1 = write_stall_us
  rm -f "$LUN"; sync
  # PREALLOCATE=1: the LUN file's blocks are allocated up front (fallocate), so writes find them.
  if [ "${PREALLOCATE:-0}" = 1 ]; then fallocate -l "$((GIB + 1))G" "$LUN"; sync; fi
  # PREWRITE=1: every block written once (zeros) first, like a LUN in service for a while.
  if [ "${PREWRITE:-0}" = 1 ]; then
    dd if=/dev/zero of="$LUN" bs=1M count=$(((GIB + 1) * 1024)) conv=fsync status=none
  fi
  cat > "$WORK/c.toml" <<CFG
[server]
workers = 1
metrics_listen = "127.0.0.1:$METRICS"
[limits]
write_stall_us = $1
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$PORT"]
[[device]]
name = "disk"
store = "file"
path = "$LUN"
size = "$((GIB + 1))G"
write_cache = true
[[device]]
name = "mem"
store = "ram"
size = "1G"
[[target]]
iqn = "$IQN"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "disk" }, { lun = 1, device = "mem" } ]
CFG
  start_daemon daemon "$PORT $METRICS" "$BIN" serve --config "$WORK/c.toml"
  local t0 t1 alone n=0
  t0=$(date +%s.%N)
  qemu-img bench -c 20000 -d 1 -s 4096 -S 4096 "$URL/1" > /dev/null
  t1=$(date +%s.%N)
  alone=$(python3 -c "print(int(20000/($t1-$t0)))")
  t0=$(date +%s.%N)
  qemu-img bench -w -c $((GIB * 1024)) -d 16 -s 1M -S 1M "$URL/0" > "$WORK/w.log" 2>&1 &
  local writer=$!
  while kill -0 $writer 2>/dev/null; do
    qemu-img bench -c 1000 -d 1 -s 4096 -S 4096 "$URL/1" > /dev/null && n=$((n + 1000))
  done
  t1=$(date +%s.%N)
  wait $writer
  local metrics stalls offloaded
  metrics=$(curl -s "127.0.0.1:$METRICS/metrics")
  stalls=$(echo "$metrics" | awk '/^ferrosan_write_stalls_total\{device="disk"\}/ {print $2}')
  offloaded=$(echo "$metrics" | awk '/^ferrosan_writes_offloaded_total\{device="disk"\}/ {print $2}')
  printf '| %s | %s | %s | %s | %s | %s |\n' "$1" "$alone" \
    "$(python3 -c "print(int($n/($t1-$t0)))")" \
    "$(grep -o '[0-9.]* seconds' "$WORK/w.log" | cut -d' ' -f1)" "${stalls:-0}" "${offloaded:-0}"
  stop_spawned "$PID"
}

echo "host: $(nproc) cores, $(uname -r), $DIR on $(stat -f -c %T "$DIR"), $GIB GiB per storm"
echo
echo "| write_stall_us | reader IOPS alone | reader IOPS during storm | writer s | stalls | offloaded |"
echo "|---:|---:|---:|---:|---:|---:|"
for _ in $(seq "$ROUNDS"); do
  run_one 1000000
  run_one 100
done
