#!/usr/bin/env bash
# QD1 latency against the device underneath, with a sleeping and with a polling client: the
# same `ferrosan bench` reads (and, with WRITES=1, writes) 4 KiB at queue depth 1 from a
# device locally, then through one ferrosan daemon serving it over iSCSI and NVMe/TCP, once
# with the client sleeping for each answer (as the kernel's initiators do) and once spinning
# for it (`--busy-poll-us`, as SPDK's initiator or Linux's NVMe/TCP poll queues do; locally it
# spins on its io_uring's completions). The daemon is stopped while the local rows run (it
# claims its devices), and the order alternates by round. A local file is read with direct I/O
# and the bench refuses to write one the daemon holds open, so the two never overlap either.
#
#   bench/qd1.sh BIN [ROUNDS]
#
#   DEV=PATH     a block device, or a regular file served as a file LUN (direct I/O; default:
#                a loop device over a 1 GiB file of random data in /var/tmp, made and removed
#                here); WRITES=1 overwrites it
#   POLL_US=N    the polling client's spin (default 1000)
#   WRITES=1     also 4 KiB writes (local ones with RWF_DSYNC: the device's durable write)
#   LIMITS='busy_poll_us = 1000'  lines for the daemon's [limits] (default: none, the defaults)
# Results: bench/results/qd1-DATE.txt: per round, client and target the IOPS, the mean
# latency and the daemon's CPU per I/O; then per client the medians and each door's latency
# over the local device's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=qd1
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/qd1.sh BIN [ROUNDS]}
ROUNDS=${2:-2}
POLL_US=${POLL_US:-1000}
IQN=iqn.2026-12.org.ferrosan:qd1
NQN=nqn.2026-12.org.ferrosan:qd1
WORKLOADS=randread-4k-qd1
[[ ${WRITES:-0} == 1 ]] && WORKLOADS+=,randwrite-4k-qd1
scratch /var/tmp/ferrosan-qd1.XXXXXX

if [[ -z ${DEV:-} ]]; then
    head -c 1G /dev/urandom >"$WORK/dev.img"
    DEV=$(losetup -f --show "$WORK/dev.img")
    on_exit "losetup -d $DEV"
fi
if [[ -b $DEV ]]; then STORE="block"
elif [[ -f $DEV ]]; then STORE="file"
else die "$DEV is neither a block device nor a file"; fi
OUT=bench/results/qd1-$(date +%Y-%m-%d-%H%M).txt
{
    echo "# bench/qd1.sh $(date -u +%FT%TZ): bin=$BIN rounds=$ROUNDS dev=$DEV poll_us=$POLL_US limits=${LIMITS:-none}"
    echo "# round client target workload iops mean_latency_us daemon_cpu_us_per_io"
} >"$OUT"

# run ROUND CLIENT TARGET URL-OR-DEV: every workload once; the daemon's CPU when it runs.
run() {
    local round=$1 client=$2 target=$3 spec=$4 w res before after poll=0 extra=()
    [[ $client == poll ]] && poll=$POLL_US
    [[ ${WRITES:-0} == 1 ]] && extra=(--destructive)
    [[ $target == local && ${WRITES:-0} == 1 ]] && extra+=(--dsync)
    for w in ${WORKLOADS//,/ }; do
        res=$WORK/$round-$client-$target-$w
        before=$( [[ $target == local ]] && echo 0 || ticks "$PID")
        "$BIN" bench "${extra[@]}" --busy-poll-us "$poll" --only "$w" --ramp 1 --runtime 5 \
            --out "$res" "$spec" >"$WORK/bench.log" 2>&1 ||
            die "ferrosan bench failed on $target ($client, $w): $(tail -3 "$WORK/bench.log")"
        after=$( [[ $target == local ]] && echo 0 || ticks "$PID")
        python3 - "$res/results.json" "$round $client $target $w" "$((after - before))" "$HZ" <<'EOF' >>"$OUT"
import json, sys
results = json.load(open(sys.argv[1]))
row = results["rows"][0] if results["rows"] else None
if not row or not row["iops"] or row.get("errors"):
    sys.exit(f"{sys.argv[2]}: no rows or I/O errors in {sys.argv[1]}")
ios = row["iops"] * results["runtime_s"]
cpu = int(sys.argv[3]) / int(sys.argv[4]) * 1e6 / ios
print(f"{sys.argv[2]} {row['iops']:.0f} {row['latency_us']['mean']:.1f} "
      f"{cpu:.2f}" if int(sys.argv[3]) else f"{sys.argv[2]} {row['iops']:.0f} "
      f"{row['latency_us']['mean']:.1f} -")
EOF
    done
}

HZ=$(getconf CLK_TCK)
for round in $(seq "$ROUNDS"); do
    clients=(sleep poll)
    ((round % 2 == 0)) && clients=(poll sleep)
    for client in "${clients[@]}"; do run "$round" "$client" local "$DEV"; done
    read -r PORT NVME_PORT < <(two_ports)
    cat >"$WORK/ferrosan.toml" <<EOF
[limits]
${LIMITS:-}

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$PORT"]
nvme_listen = ["127.0.0.1:$NVME_PORT"]

[[device]]
name = "dev"
store = "$STORE"
path = "$DEV"

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "dev" } ]
EOF
    start_daemon daemon "$PORT $NVME_PORT" "$BIN" serve --config "$WORK/ferrosan.toml"
    for client in "${clients[@]}"; do
        doors=(iscsi nvme)
        ((round % 2 == 0)) && doors=(nvme iscsi)
        for door in "${doors[@]}"; do
            if [[ $door == iscsi ]]; then url=iscsi://127.0.0.1:$PORT/$IQN/0
            else url=nvme+tcp://127.0.0.1:$NVME_PORT/$NQN/1; fi
            run "$round" "$client" "$door" "$url"
        done
    done
    stop_spawned "$PID"
done
python3 - "$OUT" <<'EOF' | tee -a "$OUT"
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
def med(client, target, w, col):
    v = [float(r[col]) for r in rows if r[1:4] == [client, target, w]]
    return statistics.median(v) if v else None
for w in dict.fromkeys(r[3] for r in rows):
    for client in ("sleep", "poll"):
        local = med(client, "local", w, 5)
        parts = [f"local {local:.1f} us"]
        for door in ("iscsi", "nvme"):
            lat = med(client, door, w, 5)
            parts.append(f"{door} {lat:.1f} us ({lat - local:+.1f}, daemon {med(client, door, w, 6):.1f} us cpu/io)")
        print(f"# {w}, client {client}: " + "; ".join(parts))
EOF
log "results: $OUT"
