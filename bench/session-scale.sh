#!/usr/bin/env bash
# What an idle session costs the target as sessions grow: one ferrosan daemon (one RAM LUN,
# pings at their defaults) and, for each N, N idle iSCSI sessions held by one process
# (bench/idle_sessions.py: they only answer the target's NOP-In pings), then
#
#   rss_kib      the daemon's resident memory with the N sessions logged in
#   per_kib      (rss_kib - the daemon's RSS with none) / N
#   idle_cpu_ms  the daemon's CPU per second of wall time while the N sessions idle (20 s)
#   login_ms     one more session's login, median of ROUNDS (a fresh TCP connection each)
#   report_ms    a REPORT LUNS on that session, median of ROUNDS
#
# Then, for each M of ACTIVE, M sessions all reading (fio's libiscsi engine, bench/fio-libiscsi.sh:
# one session per job, 4 KiB random reads at queue depth 8 each, 10 s):
#
#   iops         all sessions together
#   cpu_us_io    the daemon's CPU per I/O (user and system, /proc), in microseconds
#
# Each N and M starts a fresh daemon, so a row is the cost of N sessions, not of what earlier
# rows left behind.
#
#   bench/session-scale.sh BIN [SIZES] [ROUNDS]
#
#   SIZES   space- or comma-separated idle session counts (default "1 100 1000")
#   ROUNDS  logins timed per N (default 20)
#   ACTIVE="1 4 16 64"  active session counts ("" for none)
#   TAG=text  appended to the results file's name
# Results: bench/results/session-scale-DATE[-TAG].txt (one row per N, then one per M); fails if
# a session count was not reached, a probe failed or fio read nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=session-scale
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/session-scale.sh BIN [SIZES] [ROUNDS]}
SIZES=${2:-1 100 1000}
SIZES=${SIZES//,/ }
ROUNDS=${3:-20}
ACTIVE=${ACTIVE-1 4 16 64}
ACTIVE=${ACTIVE//,/ }
IQN=iqn.2026-12.org.ferrosan:session-scale
IDLE_S=20
STOP_GRACE=60
scratch /var/tmp/ferrosan-session-scale.XXXXXX

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$PID/status"; }

config() {
    cat <<CONFIG
[limits]
max_connections = 4096
max_sessions = 4096
max_connections_per_source = 128

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$1"]

[[device]]
name = "ram0"
store = "ram"
size = "16M"

[[target]]
iqn = "$IQN"

  [[target.group]]
  name = "g"
  any_initiator = true
  luns = [{ lun = 0, device = "ram0" }]
CONFIG
}

OUT=bench/results/session-scale-$(date +%Y-%m-%d-%H%M)${TAG:+-$TAG}.txt
{
    echo "# bench/session-scale.sh $(date -u +%FT%TZ): bin=$BIN sizes=$SIZES rounds=$ROUNDS idle=${IDLE_S}s"
    echo "# checkout at $(git rev-parse --short HEAD 2>/dev/null || echo '?') (BIN may be another build); $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# N      rss_kib  per_kib idle_cpu_ms_per_s  login_ms report_ms"
} >"$OUT"
# start: a fresh daemon on a free port ($port), answering its control socket.
start() {
    port=$(free_port)
    config "$port" >"$WORK/ferrosan.toml"
    rm -rf "$WORK/state" && mkdir -p "$WORK/state"
    start_daemon_ctl daemon "$WORK/ctl.sock" "$BIN" serve --config "$WORK/ferrosan.toml" \
        --control-socket "$WORK/ctl.sock" --state-dir "$WORK/state"
    sleep 1
}

for n in $SIZES; do
    start
    base=$(rss_kib)
    spawn_ready "N=$n: the sessions did not all log in" python3 bench/idle_sessions.py \
        "127.0.0.1:$port" "$IQN" "$n"
    sleep 2
    c0=$(ticks "$PID")
    sleep "$IDLE_S"
    c1=$(ticks "$PID")
    rss=$(rss_kib)
    python3 bench/idle_sessions.py "127.0.0.1:$port" "$IQN" --probe "$ROUNDS" >"$WORK/probe" ||
        die "N=$n: the login probe failed"
    login=$(awk '$1 == "login" { print $3 }' "$WORK/probe")
    report=$(awk '$1 == "report_luns" { print $3 }' "$WORK/probe")
    sessions=$("$BIN" ctl --socket "$WORK/ctl.sock" --json sessions | grep -o '"initiator"' | wc -l)
    ((sessions >= n)) || die "N=$n: the daemon lists $sessions sessions"
    awk -v n="$n" -v rss="$rss" -v base="$base" -v c=$((c1 - c0)) -v tick="$HZ" -v s="$IDLE_S" \
        -v login="$login" -v report="$report" \
        'BEGIN { printf "%-6d %8d %8.1f %17.2f %9s %9s\n", n, rss, (rss - base) / n, c * 1000 / tick / s, login, report }' |
        tee -a "$OUT"
    stop_spawned "$HOLDER"
    stop_spawned "$PID"
done

[[ -n ${ACTIVE// /} ]] || { log "results: $OUT"; exit 0; }
FIO=$(bench/fio-libiscsi.sh)
echo "# M  iops  cpu_us_io  (M sessions reading 4 KiB at random, queue depth 8 each, 10 s)" >>"$OUT"
for m in $ACTIVE; do
    start
    c0=$(ticks "$PID")
    # fio's file names take escaped colons.
    target="127.0.0.1:$port/$IQN/0"
    "$FIO" --name=active --ioengine=libiscsi --filename="iscsi\\://${target//:/\\:}" \
        --rw=randread --bs=4k --iodepth=8 --numjobs="$m" --time_based --runtime=10 \
        --group_reporting --output-format=json --output="$WORK/fio.json" 2>"$WORK/fio.err" ||
        die "M=$m: fio failed: $(tail -3 "$WORK/fio.err")"
    c1=$(ticks "$PID")
    read -r iops ios < <(python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print(round(j["iops"]), j["total_ios"])' "$WORK/fio.json")
    ((ios > 0)) || die "M=$m: fio read nothing"
    awk -v m="$m" -v iops="$iops" -v c=$((c1 - c0)) -v tick="$HZ" -v ios="$ios" \
        'BEGIN { printf "%-4d %8d %9.2f\n", m, iops, c * 1e6 / tick / ios }' | tee -a "$OUT"
    stop_spawned "$PID"
done
log "results: $OUT"
