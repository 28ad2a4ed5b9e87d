#!/usr/bin/env bash
# The CPU idle NVMe/TCP controllers cost the daemon while their hosts keep them alive, and the
# memory it holds meanwhile, for one or more builds side by side. For each round and each BIN:
# a fresh daemon (one RAM LUN, both doors, bench/idle-lib.sh's config), COUNT controllers
# (bench/idle_nvme.py: an admin queue with an Asynchronous Event Request held and two I/O
# queues), each sending a Keep Alive every KEEP_ALIVE_S seconds (Linux's host: 2.5, half its
# default 5 s timeout), spread evenly over that interval as independent hosts' timers are
# (BURST=1: all at once). After SETTLE_S seconds the daemon's CPU is read over WINDOW_S.
#
#   bench/keepalive-cpu.sh BIN [BIN...]   (COUNT=1000, KEEP_ALIVE_S=2.5, ROUNDS=3, SETTLE_S=15,
#                                          WINDOW_S=30, BURST=, TAG=text)
#
#   cpu_ms_s     the daemon's CPU over the window, ms a second (all threads)
#   us_per_ka    that per Keep Alive answered in the window (all of it: what the daemon spends
#                idle is in it too)
#   parks_s      ferrosan_connection_parks_total's growth a second
#   parked       ferrosan_connections_parked at the window's end
#   rss_kib      the daemon's resident memory then
# Results: bench/results/keepalive-cpu-DATE-HHMM[-TAG].txt, a line per build and round, then
# each build's medians. Fails if a holder did not connect, ended early (a Keep Alive not
# answered), or sent no Keep Alive in the window.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=keepalive-cpu
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

(($# > 0)) || die "usage: bench/keepalive-cpu.sh BIN [BIN...]"
COUNT=${COUNT:-1000}
KEEP_ALIVE_S=${KEEP_ALIVE_S:-2.5}
ROUNDS=${ROUNDS:-3}
SETTLE_S=${SETTLE_S:-15}
WINDOW_S=${WINDOW_S:-30}
IQN=iqn.2026-12.org.ferrosan:keepalive-cpu
NQN=nqn.2026-12.org.ferrosan:keepalive-cpu
HZ=$(getconf CLK_TCK)
scratch /var/tmp/ferrosan-keepalive-cpu.XXXXXX
ulimit -n "$(ulimit -Hn)"

# shellcheck source=idle-lib.sh
source bench/idle-lib.sh

# metric PORT NAME: a metric's value (0 when absent).
metric() {
    curl -s "127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n { v = $2 } END { print v + 0 }'
}

# measure BIN: one daemon of BIN under COUNT controllers; prints its result line's fields.
measure() {
    local bin=$1 ports metrics daemon t0 t1 p0 p1 ka0 ka1
    read -r -a ports < <(two_ports)
    metrics=$(free_port)
    idle_config "${ports[0]}" "${ports[1]}" "$metrics" >"$WORK/ferrosan.toml"
    rm -rf "$WORK/state" && mkdir -p "$WORK/state"
    spawn "$WORK/daemon.log" "$bin" serve --config "$WORK/ferrosan.toml" --state-dir "$WORK/state"
    daemon=$SPAWNED
    wait_port "$metrics" "$daemon" 30 || die "the daemon did not start: $(tail -5 "$WORK/daemon.log")"
    spawn_ready "$COUNT controllers" python3 bench/idle_nvme.py "127.0.0.1:${ports[1]}" "$NQN" \
        "$COUNT" --keep-alive "$KEEP_ALIVE_S" --answered "$WORK/answered" ${BURST:+--burst}
    sleep "$SETTLE_S"
    t0=$(ticks "$daemon") p0=$(metric "$metrics" ferrosan_connection_parks_total)
    ka0=$(cat "$WORK/answered")
    sleep "$WINDOW_S"
    t1=$(ticks "$daemon") p1=$(metric "$metrics" ferrosan_connection_parks_total)
    ka1=$(cat "$WORK/answered")
    kill -0 "$HOLDER" 2>/dev/null || die "the holder ended: $(tail -3 "$WORK/holder.log")"
    ((ka1 > ka0)) || die "no Keep Alive answered in the window"
    awk -v t="$((t1 - t0))" -v hz="$HZ" -v w="$WINDOW_S" -v p="$((p1 - p0))" -v k="$((ka1 - ka0))" \
        -v parked="$(metric "$metrics" ferrosan_connections_parked)" \
        -v rss="$(awk '/^VmRSS/ { print $2 }' "/proc/$daemon/status")" \
        'BEGIN { ms = t * 1000 / hz; printf "%9.1f %10.1f %8.1f %7d %8d\n", ms / w, ms * 1000 / k, p / w, parked, rss }'
    stop_spawned "$HOLDER"
    stop_spawned "$daemon" 600
}

OUT=bench/results/keepalive-cpu-$(date +%Y-%m-%d-%H%M)${TAG:+-$TAG}.txt
{
    echo "# bench/keepalive-cpu.sh $(date -u +%FT%TZ): count=$COUNT (admin + 2 I/O queues, an AER held) keep_alive=${KEEP_ALIVE_S}s ${BURST:+all at once}${BURST:-spread} settle=${SETTLE_S}s window=${WINDOW_S}s rounds=$ROUNDS"
    echo "# checkout at $(git rev-parse --short HEAD 2>/dev/null || echo '?'); builds: $*"
    printf '# %-5s %-40s %9s %10s %8s %7s %8s\n' round bin cpu_ms_s us_per_ka parks_s parked rss_kib
} >"$OUT"
for round in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        printf '%-7s %-40s %s\n' "$round" "$bin" "$(measure "$bin")" | tee -a "$OUT"
    done
done
{
    echo "# medians: bin cpu_ms_s us_per_ka parks_s parked rss_kib"
    for bin in "$@"; do
        printf '# %-40s' "$bin"
        for col in 3 4 5 6 7; do
            printf ' %9s' "$(awk -v b="$bin" -v c="$col" '$1 !~ /^#/ && $2 == b { print $c }' "$OUT" | sort -g |
                awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')"
        done
        echo
    done
} | tee -a "$OUT"
log "results: $OUT"
