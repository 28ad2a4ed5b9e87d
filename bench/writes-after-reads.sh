#!/usr/bin/env bash
# Target CPU per 4 KiB write after a read-heavy history, for one or more ferrosan builds in one
# run: on a fresh 1 GiB tmpfs file LUN per build, iscsi-perf 4 KiB random reads QD64 for 10 s,
# then qemu-img bench 20,000 reads QD1, 200,000 reads QD64, and 200,000 4 KiB writes QD64,
# whose IOPS and daemon CPU per write are reported (read from /proc around the last step).
#
#   bench/writes-after-reads.sh [ROUNDS] BIN...
#
# Results: bench/results/writes-after-reads-DATE.txt. Needs iscsi-perf (libiscsi-bin) and
# qemu-img (qemu-utils, qemu-block-extra).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=writes-after-reads
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

ROUNDS=1
if [[ ${1:-} =~ ^[0-9]+$ ]]; then ROUNDS=$1; shift; fi
(($# > 0)) || die "usage: bench/writes-after-reads.sh [ROUNDS] BIN..."
for cmd in iscsi-perf qemu-img; do command -v "$cmd" >/dev/null || die "missing $cmd"; done
scratch -p /dev/shm
OUT=bench/results/writes-after-reads-$(date +%Y-%m-%d-%H%M).txt
echo "# bench/writes-after-reads.sh $(date -u +%FT%TZ) rounds=$ROUNDS; round bin write_iops cpu_us_per_write" >"$OUT"

for round in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        rm -f "$WORK/lun.img"
        port=$(free_port)
        iqn=iqn.2026-11.org.ferrosan:war
        start_daemon daemon "$port" "$bin" serve --listen "127.0.0.1:$port" --target "$iqn" \
            --lun "file:$WORK/lun.img,size=1G"
        url=iscsi://127.0.0.1:$port/$iqn/0
        timeout 30 iscsi-perf -t 10 -b 8 -m 64 -r -n "$url" >/dev/null 2>&1 || true
        qemu-img bench -f raw -c 20000 -d 1 -s 4096 -S 4096 "$url" >/dev/null 2>&1
        qemu-img bench -f raw -c 200000 -d 64 -s 4096 -S 4096 "$url" >/dev/null 2>&1
        before=$(ticks "$PID")
        start=$(date +%s.%N)
        qemu-img bench -w -f raw -c 200000 -d 64 -s 4096 -S 4096 "$url" >/dev/null 2>&1
        end=$(date +%s.%N)
        after=$(ticks "$PID")
        python3 -c "
import sys
secs = $end - $start
ticks = $((after - before))
print(f'$round $bin {200000 / secs:.0f} {ticks / $HZ * 1e6 / 200000:.2f}')
" | tee -a "$OUT"
        stop_spawned "$PID"
    done
done
log "results: $OUT"
