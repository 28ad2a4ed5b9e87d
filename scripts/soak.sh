#!/usr/bin/env bash
# Weeks of uptime in minutes: one daemon serves verified I/O while everything an array lives
# through churns around it, and what it holds is sampled over time.
#
#   scripts/soak.sh [MINUTES]          # default 5; the docs record a two-hour run
#
# The daemon (FERROSAN_BIN, else the release build of this checkout) serves a 256 MiB file LUN
# on this machine's disk (the data under test) and a RAM LUN (the one taken offline and back),
# with a directory pool for volume verbs. Meanwhile:
#   I/O     fio (libiscsi engine, bench/fio-libiscsi.sh) writes a region at random, 4-64 KiB
#           blocks at QD16, then reads every block back and checks its crc32c; one such round
#           after another until the time is up (every block written is verified)
#   churn   every few seconds, in turn: a login and logout (iscsi-ls), a reload, a volume
#           created, exported to a host, unexported and deleted, the RAM device taken offline
#           and back online, a device added and removed
#   samples every 5 s: the daemon's RSS, threads, open descriptors and CPU seconds
# Results in bench/results/soak-DATE.{csv,txt,svg}: the samples, each fio round's mean and p99
# latency, and a chart. Fails (exit 1) when a block reads back wrong, a verb fails, the daemon
# dies, or what it holds grows: descriptors above the first sample's plus 16, threads above
# plus 8, RSS above twice the first sample after warm-up plus 32 MiB.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=soak
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
cd "$ROOT"

MINUTES=${1:-5}
[[ $MINUTES =~ ^[0-9]+$ ]] && ((MINUTES > 0)) || die "usage: $0 [MINUTES]"
FERROSAN_DEPS=(libiscsi-bin:iscsi-ls python3:python3)
ensure_deps
ferrosan_bin
FIO=$(bench/fio-libiscsi.sh)

WORK=$(mktemp -d /var/tmp/ferrosan-soak.XXXXXX)
DAEMON="" CHURN="" SAMPLER=""
cleanup() {
    stop_pid "$CHURN" 10
    stop_pid "$SAMPLER" 10
    stop_pid "$DAEMON"
    rm -rf "$WORK"
}
trap cleanup EXIT

STAMP=$(date -u +%Y-%m-%d-%H%M)
OUT=$ROOT/bench/results/soak-$STAMP
PORT=$(free_port)
IQN=iqn.2026-12.org.ferrosan:soak
HOST=iqn.2026-12.org.ferrosan:soak-host
SOCKET=$WORK/ctl.sock
mkdir -p "$WORK/pool"
cat >"$WORK/ferrosan.toml" <<EOF
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$PORT"]

[[device]]
name = "data"
store = "file"
path = "$WORK/data.img"
size = "256M"

[[device]]
name = "spare"
store = "ram"
size = "64M"

[[pool]]
name = "soak"
path = "$WORK/pool"

[[target]]
iqn = "$IQN"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "data" }, { lun = 1, device = "spare" } ]
EOF
"$FERROSAN_BIN" serve --config "$WORK/ferrosan.toml" --control-socket "$SOCKET" \
    >"$WORK/daemon.log" 2>&1 &
DAEMON=$!
wait_port "$PORT" "$DAEMON" 30 || { tail_indented "$WORK/daemon.log"; die "the daemon did not start"; }
log "daemon $DAEMON on 127.0.0.1:$PORT, $MINUTES min, results in $OUT.*"

ctl() { "$FERROSAN_BIN" ctl --socket "$SOCKET" "$@"; }
esc() { local s=$1; echo "${s//:/\\:}"; } # fio splits --filename at ':'

# The daemon's footprint now: seconds since start, RSS KiB, threads, descriptors, CPU s.
sample() {
    local rss threads fds ticks
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$DAEMON/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$DAEMON/status")
    fds=$(find "/proc/$DAEMON/fd" -mindepth 1 -maxdepth 1 | wc -l)
    ticks=$(awk '{print $14 + $15}' "/proc/$DAEMON/stat")
    echo "$SECONDS,$rss,$threads,$fds,$(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", t / hz}')"
}

sampler() {
    echo "seconds,rss_kib,threads,fds,cpu_s" >"$OUT.csv"
    while kill -0 "$DAEMON" 2>/dev/null; do
        sample >>"$OUT.csv" || true
        sleep 5
    done
}

# One round of each verb that changes the array, in turn, forever; any failure ends the soak.
churn() {
    local n=0
    while true; do
        n=$((n + 1))
        case $((n % 5)) in
            0) iscsi-ls -s "iscsi://127.0.0.1:$PORT" >/dev/null || { echo "login $n" >"$WORK/churn.failed"; return 1; } ;;
            1) ctl reload >/dev/null || { echo "reload $n" >"$WORK/churn.failed"; return 1; } ;;
            2) { ctl volume create soak "v$n" 16M >/dev/null &&
                ctl volume export "v$n" --initiator "$HOST" >/dev/null &&
                ctl volume unexport "v$n" --initiator "$HOST" >/dev/null &&
                ctl volume delete "v$n" >/dev/null; } || { echo "volume verbs $n" >"$WORK/churn.failed"; return 1; } ;;
            3) { ctl device offline spare >/dev/null && ctl device online spare >/dev/null; } ||
                { echo "offline/online $n" >"$WORK/churn.failed"; return 1; } ;;
            4) { ctl device add "extra$n" ram:8M >/dev/null && ctl device remove "extra$n" >/dev/null; } ||
                { echo "device add/remove $n" >"$WORK/churn.failed"; return 1; } ;;
        esac
        echo "$n" >"$WORK/churn.rounds"
        sleep 2
    done
}

sampler &
SAMPLER=$!
churn &
CHURN=$!

# Verified I/O rounds until the time is up.
END=$((SECONDS + MINUTES * 60))
ROUND=0
echo "round,seconds,write_iops,mean_write_us,p99_write_us,verified_mib" >"$OUT.rounds.csv"
while ((SECONDS < END)); do
    ROUND=$((ROUND + 1))
    "$FIO" --name=soak --ioengine=libiscsi --filename="$(esc "iscsi://127.0.0.1:$PORT/$IQN/0")" \
        --rw=randwrite --bsrange=4k-64k --iodepth=16 --size=64M --offset=$(((ROUND % 3) * 64))M \
        --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --randrepeat=0 \
        --output-format=json \
        >"$WORK/fio.json" 2>"$WORK/fio.err" || {
        cat "$WORK/fio.err" >&2
        die "round $ROUND: fio failed (a block read back wrong, or the target refused)"
    }
    python3 - "$WORK/fio.json" "$ROUND" "$SECONDS" >>"$OUT.rounds.csv" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print a notice first
w, r = job["write"], job["read"]
p99 = w["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
print(f'{sys.argv[2]},{sys.argv[3]},{w["iops"]:.0f},{w["clat_ns"]["mean"] / 1000:.0f},{p99:.0f},{r["io_bytes"] / 2**20:.0f}')
PY
    [[ ! -f $WORK/churn.failed ]] || die "churn failed: $(cat "$WORK/churn.failed")"
    kill -0 "$DAEMON" 2>/dev/null || die "the daemon died: $(tail -5 "$WORK/daemon.log")"
done
[[ ! -f $WORK/churn.failed ]] || die "churn failed: $(cat "$WORK/churn.failed")"
stop_pid "$CHURN" 10
CHURN=""
sleep 6 # one more sample with the churn over
stop_pid "$SAMPLER" 10
SAMPLER=""
python3 "$ROOT/scripts/lib/soak_report.py" "$OUT" "$(cat "$WORK/churn.rounds" 2>/dev/null || echo 0)" \
    "$MINUTES" || die "the daemon's footprint grew: $OUT.txt"
log "passed: $(tail -1 "$OUT.txt")"
