#!/usr/bin/env bash
# Weeks of uptime in minutes: one daemon serves verified I/O while everything an array lives
# through churns around it, and what it holds is sampled over time.
#
#   scripts/soak.sh [--gateways] [MINUTES]    # default 5; the docs record two-hour runs
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
# With --gateways, beside it: a single-node Ceph cluster (scripts/ceph-single-node.sh) and two
# RBD gateways of one 256 MiB image, which a host (crates/initiator/examples/verify_io.rs)
# writes and verifies through both portals, retrying a takeover's NOT READY as hosts do, while
# the churn moves the image to the other gateway (`ctl device take`) once a round; at the end
# every block the host wrote is read back and checked. Fails when it does not verify, when a
# command gets no GOOD within 60 s, or when a gateway dies.
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

GATEWAYS=0
[[ ${1:-} == --gateways ]] && { GATEWAYS=1; shift; }
MINUTES=${1:-5}
[[ $MINUTES =~ ^[0-9]+$ ]] && ((MINUTES > 0)) || die "usage: $0 [--gateways] [MINUTES]"
FERROSAN_DEPS=(libiscsi-bin:iscsi-ls python3:python3)
((GATEWAYS)) && FERROSAN_DEPS+=(ceph-mon:ceph-mon ceph-mgr:ceph-mgr ceph-osd:ceph-osd ceph-common:rbd librbd1:-)
ensure_deps
ferrosan_bin
FIO=$(bench/fio-libiscsi.sh)

WORK=$(mktemp -d /var/tmp/ferrosan-soak.XXXXXX)
DAEMON="" CHURN="" SAMPLER="" VERIFIER="" GW_A="" GW_B=""
cleanup() {
    stop_pid "$CHURN" 10
    stop_pid "$SAMPLER" 10
    stop_pid "$VERIFIER" 10
    stop_pid "$DAEMON"
    stop_pid "$GW_A"
    stop_pid "$GW_B"
    ((GATEWAYS)) && "$ROOT/scripts/ceph-single-node.sh" stop "$WORK/ceph" >/dev/null 2>&1
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

# --gateways: the cluster, the image, gateways a and b, and the verifying host through both.
GW_IQN=iqn.2026-12.org.ferrosan:soak-gateways
start_gateways() {
    local conf port_a port_b verify_io
    verify_io=${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/verify_io
    cargo build --release -q -p initiator --example verify_io || die "verify_io did not build"
    conf=$("$ROOT/scripts/ceph-single-node.sh" start "$WORK/ceph" 4 | sed -n 's/^CEPH_CONF=//p')
    [[ -n $conf ]] || die "the Ceph cluster did not start"
    CEPH_CONF=$conf rbd create --size 256M rbd/soak || die "rbd create failed"
    port_a=$(free_port) port_b=$(free_port)
    gateways_config "$GW_IQN" rbd/soak "$conf" "$port_a" "$port_b" >"$WORK/gateways.toml"
    "$FERROSAN_BIN" serve --config "$WORK/gateways.toml" --gateway a \
        --control-socket "$WORK/a.sock" >"$WORK/a.log" 2>&1 &
    GW_A=$!
    wait_port "$port_a" "$GW_A" 60 || { tail_indented "$WORK/a.log"; die "gateway a did not start"; }
    "$FERROSAN_BIN" serve --config "$WORK/gateways.toml" --gateway b \
        --control-socket "$WORK/b.sock" >"$WORK/b.log" 2>&1 &
    GW_B=$!
    wait_port "$port_b" "$GW_B" 60 || { tail_indented "$WORK/b.log"; die "gateway b did not start"; }
    "$verify_io" $((MINUTES * 60)) 64 2 "$GW_IQN" "127.0.0.1:$port_a" "127.0.0.1:$port_b" \
        >"$WORK/verify.json" 2>"$WORK/verify.err" &
    VERIFIER=$!
    log "gateways $GW_A and $GW_B on 127.0.0.1:$port_a and :$port_b, verifying host $VERIFIER"
}
((GATEWAYS)) && start_gateways

# Dies when a gateway died or the verifying host ended early (it failed).
gateways_alive() {
    local g pid
    for g in a b; do
        pid=GW_${g^^}
        kill -0 "${!pid}" 2>/dev/null || die "gateway $g died: $(tail -5 "$WORK/$g.log")"
    done
    [[ -z $VERIFIER ]] || kill -0 "$VERIFIER" 2>/dev/null || finish_verifier
}

# The verifying host's end: its counts into OUT.gateways.json, or its error.
finish_verifier() {
    local rc=0
    wait "$VERIFIER" || rc=$?
    VERIFIER=""
    if ((rc != 0)); then
        local g
        for g in a b; do
            log "gateway $g's last warnings (its log: $OUT.gateway-$g.log):"
            grep -E 'WARN|ERROR' "$WORK/$g.log" | tail -n 15 | sed 's/^/    /' >&2
            cp "$WORK/$g.log" "$OUT.gateway-$g.log"
        done
        die "the host through the gateways failed: $(cat "$WORK/verify.err")"
    fi
    cp "$WORK/verify.json" "$OUT.gateways.json"
    log "gateways: $(cat "$OUT.gateways.json")"
}
esc() { local s=$1; echo "${s//:/\\:}"; } # fio splits --filename at ':'

# Process PID's footprint now: RSS KiB, threads, descriptors, CPU s.
sample() {
    local rss threads fds ticks
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$1/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$1/status")
    fds=$(find "/proc/$1/fd" -mindepth 1 -maxdepth 1 | wc -l)
    ticks=$(awk '{print $14 + $15}' "/proc/$1/stat")
    echo "$rss,$threads,$fds,$(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", t / hz}')"
}

sampler() {
    echo "seconds,rss_kib,threads,fds,cpu_s" >"$OUT.csv"
    ((GATEWAYS)) && echo "seconds,gateway,rss_kib,threads,fds,cpu_s" >"$OUT.gateways.csv"
    while kill -0 "$DAEMON" 2>/dev/null; do
        echo "$SECONDS,$(sample "$DAEMON")" >>"$OUT.csv" || true
        if ((GATEWAYS)); then
            { echo "$SECONDS,a,$(sample "$GW_A")" && echo "$SECONDS,b,$(sample "$GW_B")"; } \
                >>"$OUT.gateways.csv" 2>/dev/null || true
        fi
        sleep 5
    done
}

# One round of each verb that changes the array, in turn, forever; any failure ends the soak.
churn() {
    local n=0
    while true; do
        n=$((n + 1))
        case $((n % (5 + GATEWAYS))) in
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
            5) # the image to the gateway that does not own it (a, b, a, ...)
                local to=a
                (((n / 6) % 2)) && to=b
                "$FERROSAN_BIN" ctl --socket "$WORK/$to.sock" device take image >/dev/null ||
                    { echo "take by gateway $to, $n" >"$WORK/churn.failed"; return 1; } ;;
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
    ((GATEWAYS)) && gateways_alive
done
[[ ! -f $WORK/churn.failed ]] || die "churn failed: $(cat "$WORK/churn.failed")"
if ((GATEWAYS)) && [[ -n $VERIFIER ]]; then
    finish_verifier # it reads back every block it wrote after its time is up
    [[ ! -f $WORK/churn.failed ]] || die "churn failed: $(cat "$WORK/churn.failed")"
fi
stop_pid "$CHURN" 10
CHURN=""
sleep 6 # one more sample with the churn over
stop_pid "$SAMPLER" 10
SAMPLER=""
python3 "$ROOT/scripts/lib/soak_report.py" "$OUT" "$(cat "$WORK/churn.rounds" 2>/dev/null || echo 0)" \
    "$MINUTES" $( ((GATEWAYS)) && echo --gateways) || die "the daemon's footprint grew: $OUT.txt"
log "passed: $(tail -1 "$OUT.txt")"
