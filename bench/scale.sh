#!/usr/bin/env bash
# The scale curves of docs/PERFORMANCE.md ("Cost as the array grows") in one run:
#
#   1. bench/session-scale.sh   idle sessions (1, 10, 100, 1000: memory and CPU each, one more
#      login, REPORT LUNS) and active sessions (1, 4, 16, 64 reading at once: IOPS, the
#      daemon's CPU per I/O)
#   2. bench/config-scale.sh    LUNs (1, 256, 4096, 16000 devices mapped: start-up, the idle
#      daemon's CPU, and right after a change, `ctl luns`, `ctl device list`, `ctl volume
#      list`, REPORT LUNS, a reload adding one device)
#   3. bench/config-scale.sh    volumes (10, 100, 1000, 4000 in one pool: `volume create`
#      unsaved and with --save)
#   4. bench/nvme-controllers.sh idle NVMe/TCP controllers (an admin and two I/O queues each)
#      beside idle iSCSI sessions (1, 10, 100, 1000: memory each, the daemon's idle CPU)
#
# then bench/scale_report.py: bench/results/scale-DATE.md (the tables) and .svg (the chart).
#
#   bench/scale.sh BIN
#
#   SESSIONS, ACTIVE, LUNS, VOLUMES, CONTROLLERS   the counts of each curve (space-separated)
#   ROUNDS                            calls per verb (default 5)
# Results: the three results files (bench/results/{session,config}-scale-*) and the report.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=scale
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/scale.sh BIN}
ROUNDS=${ROUNDS:-5}
STAMP=$(date +%Y-%m-%d-%H%M)
# The newest results file a script wrote ($1: its prefix).
newest() { ls -t bench/results/"$1"-*.txt | head -n 1; }

ACTIVE=${ACTIVE-1 4 16 64} TAG=scale \
    bench/session-scale.sh "$BIN" "${SESSIONS:-1 10 100 1000}" 20
sessions=$(newest session-scale)
OPS=startup,idle,changed,luns,devices,volumes,report-luns,reload CACHE=page TAG=scale-luns \
    bench/config-scale.sh "$BIN" "${LUNS:-1 256 4096 16000}" "$ROUNDS"
luns=$(newest config-scale)
OPS=create,create-save TAG=scale-volumes \
    bench/config-scale.sh "$BIN" "${VOLUMES:-10 100 1000 4000}" "$ROUNDS"
volumes=$(newest config-scale)
# shellcheck disable=SC2086 # the counts are words
TAG=scale bench/nvme-controllers.sh "$BIN" ${CONTROLLERS:-1 10 100 1000}
controllers=$(newest nvme-controllers)
python3 bench/scale_report.py "$sessions" "$luns" "$volumes" "$controllers" "bench/results/scale-$STAMP"
log "report: bench/results/scale-$STAMP.md and .svg (from $sessions, $luns, $volumes, $controllers)"
