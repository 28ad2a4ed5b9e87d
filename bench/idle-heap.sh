#!/usr/bin/env bash
# The heap an idle NVMe/TCP controller and an idle iSCSI session hold, measured live with
# heaptrack: what bench/nvme-controllers.sh's RSS cannot show, since glibc keeps memory a
# process freed (a connect storm's drives, given back when their queues park) resident for
# its next allocations. For each door: a fresh daemon under heaptrack (one RAM LUN, both doors,
# bench/nvme-controllers.sh's config), COUNT idle controllers (bench/idle_nvme.py: an admin
# queue with an Asynchronous Event Request held and QUEUES I/O queues, a Keep Alive every
# 30 s) or sessions (bench/idle_sessions.py); after IDLE_S seconds the daemon is killed
# (SIGKILL) so heaptrack's "leaked" is what was live then. A daemon with no connection is the
# base.
#
#   bench/idle-heap.sh BIN [COUNT]     (COUNT default 300; QUEUES=2, IDLE_S=12, TAG=text,
#                                       KEEP_ALIVE_S=30: a Keep Alive per admin queue this often)
#
#   live_kib    the daemon's live heap after idling
#   per_kib     (live_kib - the base's) / COUNT
#   parked      the daemon's ferrosan_connections_parked then
# Results: bench/results/idle-heap-DATE-HHMM[-TAG].txt; fails if a holder did not connect or
# heaptrack saw nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=idle-heap
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/idle-heap.sh BIN [COUNT]}
COUNT=${2:-300}
QUEUES=${QUEUES:-2}
IDLE_S=${IDLE_S:-12}
KEEP_ALIVE_S=${KEEP_ALIVE_S:-30}
IQN=iqn.2026-12.org.ferrosan:idle-heap
NQN=nqn.2026-12.org.ferrosan:idle-heap
command -v heaptrack >/dev/null || die "heaptrack is not installed (apt-get install heaptrack)"
scratch /var/tmp/ferrosan-idle-heap.XXXXXX
ulimit -n "$(ulimit -Hn)"

# shellcheck source=idle-lib.sh
source bench/idle-lib.sh

# live DOOR N: a daemon under heaptrack holding N idle DOOR (nvme, iscsi, none) connections;
# sets RESULT to "live_kib parked".
live() {
    local door=$1 n=$2 ports metrics daemon heap parked
    read -r -a ports < <(two_ports)
    metrics=$(free_port)
    idle_config "${ports[0]}" "${ports[1]}" "$metrics" >"$WORK/ferrosan.toml"
    rm -rf "$WORK/state" && mkdir -p "$WORK/state"
    heap=$WORK/heap-$door-$n
    spawn "$WORK/daemon.log" heaptrack -o "$heap" "$BIN" serve --config "$WORK/ferrosan.toml" \
        --state-dir "$WORK/state"
    local tracker=$SPAWNED
    wait_port "$metrics" "$tracker" 30 || die "the daemon did not start: $(tail -5 "$WORK/daemon.log")"
    daemon=$(pgrep -P "$tracker" -f "^$BIN serve" || pgrep -f "^$BIN serve --config $WORK/")
    case $door in
    nvme) spawn_ready "$n controllers" python3 bench/idle_nvme.py "127.0.0.1:${ports[1]}" "$NQN" "$n" --queues "$QUEUES" --keep-alive "$KEEP_ALIVE_S" ;;
    iscsi) spawn_ready "$n sessions" python3 bench/idle_sessions.py "127.0.0.1:${ports[0]}" "$IQN" "$n" ;;
    none) HOLDER="" ;;
    esac
    sleep "$IDLE_S"
    parked=$(curl -s "127.0.0.1:$metrics/metrics" | awk '$1 == "ferrosan_connections_parked" { print $2 }')
    kill -KILL "$daemon"
    stop_spawned "$tracker" 600
    [[ -z $HOLDER ]] || stop_spawned "$HOLDER"
    RESULT="$(heaptrack_print -f "$heap".zst 2>/dev/null | awk '
        /^total memory leaked:/ {
            v = $4; u = substr(v, length(v)); n = v + 0
            if (u == "K") n *= 1; else if (u == "M") n *= 1024; else if (u == "G") n *= 1048576; else n /= 1024
            printf "%.1f", n
        }') ${parked:-0}"
    [[ $RESULT != " "* ]] || die "$door: heaptrack recorded nothing ($heap.zst)"
}

OUT=bench/results/idle-heap-$(date +%Y-%m-%d-%H%M)${TAG:+-$TAG}.txt
live none 0
read -r base _ <<<"$RESULT"
{
    echo "# bench/idle-heap.sh $(date -u +%FT%TZ): bin=$BIN count=$COUNT queues=$QUEUES (admin + $QUEUES I/O per controller, an AER held, a Keep Alive every ${KEEP_ALIVE_S} s) idle=${IDLE_S}s"
    echo "# checkout at $(git rev-parse --short HEAD 2>/dev/null || echo '?') (BIN may be another build); heaptrack's live heap at a SIGKILL after idling; base (no connection) ${base} KiB"
    printf '# %-6s %8s %12s %10s %8s\n' door count live_kib per_kib parked
} >"$OUT"
for door in nvme iscsi; do
    live "$door" "$COUNT"
    read -r kib parked <<<"$RESULT"
    awk -v d="$door" -v n="$COUNT" -v k="$kib" -v b="$base" -v p="$parked" \
        'BEGIN { printf "%-8s %8d %12.1f %10.2f %8d\n", d, n, k, (k - b) / n, p }' | tee -a "$OUT"
done
log "results: $OUT"
