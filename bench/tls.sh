#!/usr/bin/env bash
# What NVMe/TCP's TLS costs: one ferrosan daemon serving one RAM device as two subsystems, one
# in the clear and one whose host must use TLS 1.3 with a pre-shared key; the same client
# (`ferrosan bench`, the plain URL and the same with `?tls`), the same workloads, interleaved
# rounds; reports IOPS and the daemon's CPU per I/O (from /proc/PID/stat around each run).
#
#   bench/tls.sh BIN [ROUNDS] [WORKLOADS]
#
#   WORKLOADS  comma-separated `ferrosan bench` ids (default: randread-4k-qd1,
#              randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64)
# Results: bench/results/tls-DATE.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=tls
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/tls.sh BIN [ROUNDS] [WORKLOADS]}
ROUNDS=${2:-3}
WORKLOADS=${3:-randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16,randwrite-4k-qd64}
NQN=nqn.2026-11.org.ferrosan:tls-bench
HOSTNQN=nqn.2026-11.org.ferrosan:bench.tls
scratch

(umask 077 && python3 -c 'import base64, os, zlib
k = os.urandom(32)
print("NVMeTLSkey-1:01:%s:" % base64.b64encode(k + zlib.crc32(k).to_bytes(4, "little")).decode())' >"$WORK/tls.key")
PORT=$(free_port)
cat >"$WORK/ferrosan.toml" <<CONFIG
[server]
control_socket = "$WORK/ctl.sock"

[[portal_group]]
tag = 1
nvme_listen = ["127.0.0.1:$PORT"]

[[device]]
name = "mem"
store = "ram"
size = "1G"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:tls-bench-plain"
nqn = "$NQN-plain"
  [[target.group]]
  name = "bench"
  initiators = ["$HOSTNQN"]
  luns = [ { lun = 0, device = "mem" } ]

[[target]]
iqn = "iqn.2026-11.org.ferrosan:tls-bench"
nqn = "$NQN"
tls_keys = [ { host = "$HOSTNQN", key_file = "$WORK/tls.key" } ]
  [[target.group]]
  name = "bench"
  initiators = ["$HOSTNQN"]
  luns = [ { lun = 0, device = "mem" } ]
CONFIG
start_daemon daemon "$PORT" "$BIN" serve --config "$WORK/ferrosan.toml"
OUT=bench/results/tls-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/tls.sh $(date -u +%FT%TZ): bin=$BIN rounds=$ROUNDS lun=ram:1G"
    echo "# round wire workload iops cpu_us_per_io client_cpu_us_per_io"
} >"$OUT"
url() { # WIRE
    if [[ $1 == plain ]]; then echo "nvme+tcp://127.0.0.1:$PORT/$NQN-plain/1"; else echo "nvme+tcp://127.0.0.1:$PORT/$NQN/1?tls"; fi
}
for round in $(seq "$ROUNDS"); do
    for w in ${WORKLOADS//,/ }; do
        wires=(plain tls)
        ((round % 2 == 0)) && wires=(tls plain)
        for wire in "${wires[@]}"; do
            res=$WORK/$wire-$round-$w
            before=$(ticks "$PID")
            "$BIN" bench --destructive --only "$w" --ramp 0 --runtime 5 --out "$res" \
                --host-nqn "$HOSTNQN" --tls-key-file "$WORK/tls.key" "$(url "$wire")" \
                >"$WORK/bench.log" 2>&1 || die "ferrosan bench failed over $wire ($w): $(tail -3 "$WORK/bench.log")"
            after=$(ticks "$PID")
            python3 bench/side_by_side.py row "$res/results.json" "$round" "$wire" "$w" \
                "$((after - before))" "$HZ" >>"$OUT"
        done
    done
done
# The handshakes the daemon counted: the TLS runs must really have been TLS.
handshakes=$(grep -c "NVMe/TCP queue over TLS" "$WORK/daemon.log" || true)
((handshakes > 0)) || die "no TLS handshake in the daemon's log: the ?tls runs did not use TLS"
echo "# TLS queues opened: $handshakes" >>"$OUT"
python3 bench/side_by_side.py summary "$OUT" plain tls | tee -a "$OUT"
log "results: $OUT"
