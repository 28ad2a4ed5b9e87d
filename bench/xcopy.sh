#!/usr/bin/env bash
# An ESXi-style full clone through EXTENDED COPY, two ferrosan builds side by side in one run:
# a SIZE volume of random data and an empty one, files of an XFS filesystem on a loop device
# (a reflink pool), copied by the same client (crates/bench/examples/xcopy.rs: 4 MiB
# segments, one per command, 8 in flight, as ESXi's data mover sends them), read back and
# compared. Interleaved rounds; the destination is made fresh for each. Needs root.
#
#   bench/xcopy.sh BEFORE_BIN AFTER_BIN [SIZE] [ROUNDS]
#
#   STORE=ram  two RAM devices instead (the client fills the source with pseudo-random data
#              before the timed copy; each daemon starts empty)
#
# Results: bench/results/xcopy-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=xcopy
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BEFORE=${1:?usage: bench/xcopy.sh BEFORE_BIN AFTER_BIN [SIZE] [ROUNDS]}
AFTER=${2:?usage: bench/xcopy.sh BEFORE_BIN AFTER_BIN [SIZE] [ROUNDS]}
SIZE=${3:-4G}
ROUNDS=${4:-2}
scratch
LOOP=""
on_exit 'xfs_unmount "$WORK/mnt" "$LOOP"'

cargo build --release -q -p bench --example xcopy
CLIENT=target/release/examples/xcopy
bytes=$(numfmt --from=iec "$SIZE")
STORE=${STORE:-file}
if [[ $STORE == file ]]; then
    LOOP=$(xfs_mount "$WORK/fs.img" $((bytes * 2 + (1 << 30))) "$WORK/mnt")
    log "writing $SIZE of random data into the source volume"
    head -c "$bytes" /dev/urandom > "$WORK/mnt/src.img"
    sync
fi

devices() { # the two devices' config
    local name
    for name in src dst; do
        if [[ $STORE == ram ]]; then
            printf '[[device]]\nname = "%s"\nstore = "ram"\nsize = "%s"\n\n' "$name" "$bytes"
        else
            printf '[[device]]\nname = "%s"\nstore = "file"\npath = "%s"\n\n' "$name" "$WORK/mnt/$name.img"
        fi
    done
}

run_one() { # LABEL BIN
    if [[ $STORE == file ]]; then
        rm -f "$WORK/mnt/dst.img"
        truncate -s "$bytes" "$WORK/mnt/dst.img"
    fi
    local port; port=$(free_port)
    cat > "$WORK/config.toml" <<TOML
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$port"]

$(devices)
[[target]]
iqn = "iqn.2026-11.org.ferrosan:xcopy"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "src" }, { lun = 1, device = "dst" } ]
TOML
    START_SECONDS=30 start_daemon "$1" "$port" "$2" serve --config "$WORK/config.toml" \
        --control-socket "$WORK/$1.sock"
    local out
    local fill=""
    [[ $STORE == ram ]] && fill=fill
    out=$("$CLIENT" "127.0.0.1:$port" iqn.2026-11.org.ferrosan:xcopy 0 1 4194304 8 $fill) \
        || die "$1: the copy failed"
    stop_spawned "$PID"
    echo "$1 $out" | tee -a "$RESULT"
}

RESULT=bench/results/xcopy-$(date -u +%Y-%m-%d-%H%M).txt
{
    echo "# bench/xcopy.sh $(date -u +%FT%TZ) on $(nproc) cores, $(uname -r); SIZE=$SIZE STORE=$STORE"
    echo "# before: $BEFORE ($("$BEFORE" --version))"
    echo "# after:  $AFTER ($("$AFTER" --version))"
} | tee "$RESULT"
for round in $(seq "$ROUNDS"); do
    run_one "before-$round" "$BEFORE"
    run_one "after-$round" "$AFTER"
done
before=$(grep '^before' "$RESULT" | sed 's/.*"seconds": \([0-9.]*\).*/\1/' | sort -n | head -1)
after=$(grep '^after' "$RESULT" | sed 's/.*"seconds": \([0-9.]*\).*/\1/' | sort -n | head -1)
[[ -n $before && -n $after ]] || die "no timings"
ratio=$(awk -v b="$before" -v a="$after" 'BEGIN { printf "%.1f", b / a }')
echo "# best of $ROUNDS: before ${before} s, after ${after} s: ${ratio}x faster" | tee -a "$RESULT"
