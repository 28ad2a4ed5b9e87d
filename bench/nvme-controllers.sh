#!/usr/bin/env bash
# What an idle NVMe/TCP controller costs the daemon beside an idle iSCSI session. For each
# COUNT: a fresh ferrosan daemon (one RAM LUN, on an iSCSI and an NVMe/TCP listener) and COUNT
# idle NVMe/TCP controllers held by one process (bench/idle_nvme.py: an admin queue and
# QUEUES I/O queues each, a TCP connection per queue, an Asynchronous Event Request held on
# the admin queue as Linux hosts leave one, nothing but a Keep Alive every 30 s);
# then another fresh daemon and COUNT idle iSCSI sessions (bench/idle_sessions.py: one
# connection each, answering the target's NOP-In pings). For each:
#
#   rss_kib     the daemon's resident memory (VmRSS) after the COUNT idled IDLE_S seconds
#   per_kib     (rss_kib - the same daemon's RSS before the first connection) / COUNT
#   cpu_ms_s    the daemon's CPU (user and system) per second of wall time over those IDLE_S
#
#   bench/nvme-controllers.sh BIN [COUNT...]
#
#   COUNT     idle controllers / sessions, each its own row (default 1 10 100)
#   QUEUES=2  I/O queues per NVMe controller
#   IDLE_S=10 seconds idled before the samples
#   TAG=text  appended to the results file's name
# Results: bench/results/nvme-controllers-DATE-HHMM[-TAG].txt; fails if a controller or session did
# not connect, or the daemon does not list them all.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=nvme-controllers
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/nvme-controllers.sh BIN [COUNT...]}
shift
COUNTS=("$@")
((${#COUNTS[@]})) || COUNTS=(1 10 100)
QUEUES=${QUEUES:-2}
IDLE_S=${IDLE_S:-10}
IQN=iqn.2026-12.org.ferrosan:nvme-controllers
NQN=nqn.2026-12.org.ferrosan:nvme-controllers
STOP_GRACE=60
scratch /var/tmp/ferrosan-nvme-controllers.XXXXXX
RESULT=""

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$PID/status"; }

# shellcheck source=idle-lib.sh
source bench/idle-lib.sh

# start: a fresh daemon on free ports ($iscsi_port, $nvme_port), answering its control socket.
start() {
    read -r iscsi_port nvme_port < <(two_ports)
    idle_config "$iscsi_port" "$nvme_port" >"$WORK/ferrosan.toml"
    rm -rf "$WORK/state" && mkdir -p "$WORK/state"
    start_daemon_ctl daemon "$WORK/ctl.sock" "$BIN" serve --config "$WORK/ferrosan.toml" \
        --control-socket "$WORK/ctl.sock" --state-dir "$WORK/state"
    sleep 1
}

# measure DOOR COUNT: a fresh daemon, COUNT idle controllers or sessions through DOOR (nvme or
# iscsi); sets RESULT to "rss_kib per_kib cpu_ms_per_s".
measure() {
    local door=$1 n=$2 base c0 c1 rss sessions conns want
    start
    base=$(rss_kib)
    if [[ $door == nvme ]]; then
        spawn_ready "$door N=$n: not all connected" python3 bench/idle_nvme.py \
            "127.0.0.1:$nvme_port" "$NQN" "$n" --queues "$QUEUES"
        want=$((n * (QUEUES + 1)))
    else
        spawn_ready "$door N=$n: not all connected" python3 bench/idle_sessions.py \
            "127.0.0.1:$iscsi_port" "$IQN" "$n"
        want=$n
    fi
    local holder=$HOLDER
    sleep 2
    c0=$(ticks "$PID")
    sleep "$IDLE_S"
    c1=$(ticks "$PID")
    rss=$(rss_kib)
    kill -0 "$holder" 2>/dev/null || die "$door N=$n: the holder ended: $(tail -3 "$WORK/holder.log")"
    sessions=$("$BIN" ctl --socket "$WORK/ctl.sock" status | awk '$1 == "sessions" { print $2 }')
    conns=$("$BIN" ctl --socket "$WORK/ctl.sock" status | awk '$1 == "connections" { print $2 }')
    ((sessions == n && conns == want)) ||
        die "$door N=$n: the daemon lists $sessions sessions and $conns connections (want $n and $want)"
    stop_spawned "$holder"
    stop_spawned "$PID"
    RESULT=$(awk -v n="$n" -v rss="$rss" -v base="$base" -v c=$((c1 - c0)) -v tick="$HZ" \
        -v s="$IDLE_S" 'BEGIN { printf "%d %.1f %.2f", rss, (rss - base) / n, c * 1000 / tick / s }')
}

OUT=bench/results/nvme-controllers-$(date +%Y-%m-%d-%H%M)${TAG:+-$TAG}.txt
{
    echo "# bench/nvme-controllers.sh $(date -u +%FT%TZ): bin=$BIN counts=${COUNTS[*]} queues=$QUEUES (admin + $QUEUES I/O per controller) idle=${IDLE_S}s"
    echo "# checkout at $(git rev-parse --short HEAD 2>/dev/null || echo '?') (BIN may be another build); $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# per_kib: (VmRSS after idling - VmRSS of the fresh daemon) / count; cpu: daemon ms per s idle"
    printf '# %-5s %12s %12s %13s %13s %10s %10s\n' count nvme_rss_kib nvme_per_kib \
        iscsi_rss_kib iscsi_per_kib nvme_cpu iscsi_cpu
} >"$OUT"
for n in "${COUNTS[@]}"; do
    measure nvme "$n"
    read -r nrss nper ncpu <<<"$RESULT"
    measure iscsi "$n"
    read -r irss iper icpu <<<"$RESULT"
    printf '%-7d %12d %12.1f %13d %13.1f %10.2f %10.2f\n' "$n" "$nrss" "$nper" "$irss" "$iper" \
        "$ncpu" "$icpu" | tee -a "$OUT"
done
log "results: $OUT"
