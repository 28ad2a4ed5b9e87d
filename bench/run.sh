#!/usr/bin/env bash
# ferrosan vs tgt (Debian tgt) on loopback, same external clients, same run.
#
#   bench/run.sh [--quick] [extra bench.py options, e.g. --rounds 5 --only headline]
#
# Builds ferrosan (release), starts ferrosan (RAM LUN and tmpfs file LUN) and
# tgtd (tmpfs file LUN) on free loopback ports, runs every workload against
# each target in interleaved rounds, measures the loopback TCP ceiling and
# ferrosan's RSS, stops everything it started (by PID), and prints the table.
#   --quick   small counts, one round (< 3 minutes): a smoke test
#   default   three rounds (< 20 minutes on 2 cores)
# Results: bench/results/latest.json, latest.md and SVG charts (see docs/PERFORMANCE.md).
# Needs: qemu-img (qemu-utils + qemu-block-extra for iscsi://), iscsi-perf
# (libiscsi-bin), tgtd/tgtadm (tgt), iperf3, python3 (stdlib only); fio with the
# libiscsi engine, which bench/fio-libiscsi.sh finds or builds from Debian's source
# (without it the fio workloads are skipped, with a warning).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PATH="$PATH:/usr/sbin:/sbin"

for cmd in qemu-img iscsi-perf tgtd tgtadm iperf3 python3; do
    command -v "$cmd" >/dev/null || { echo "bench: missing $cmd (apt-get install qemu-utils qemu-block-extra libiscsi-bin tgt iperf3)" >&2; exit 1; }
done
if [[ -z ${FERROSAN_BIN:-} ]]; then
    echo "[bench] building: cargo build --release -p ferrosan" >&2
    cargo build --release -p ferrosan >&2
    FERROSAN_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan
fi

FIO_ARGS=()
if FIO_BIN=$("$ROOT/bench/fio-libiscsi.sh"); then
    FIO_ARGS=(--fio "$FIO_BIN")
else
    echo "[bench] warning: no fio with the libiscsi engine; the fio workloads are skipped" >&2
fi

# bench.py stops the daemons it starts (by PID, in a finally block); this trap
# covers the harness itself being interrupted.
PY_PID=""
cleanup() {
    local rc=$?
    if [[ -n $PY_PID ]] && kill -0 "$PY_PID" 2>/dev/null; then
        kill -TERM "$PY_PID" 2>/dev/null || true
        wait "$PY_PID" 2>/dev/null || true
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

python3 "$ROOT/bench/bench.py" --ferrosan "$FERROSAN_BIN" "${FIO_ARGS[@]}" "$@" &
PY_PID=$!
wait "$PY_PID"
