#!/usr/bin/env bash
# The cost of a LUN map change to the sessions that follow it: one daemon with N RAM devices
# mapped as LUNs 0..N-1 of one group (default 16,000), SESSIONS idle sessions logged in
# (bench/idle_sessions.py), then 5 unmaps and 5 maps of the last LUN by ctl; prints the
# daemon's CPU over them (/proc, 10 ms ticks) and their wall time.
#
#   bench/map-change.sh BIN [N] [SESSIONS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh
BIN=${1:?usage: bench/map-change.sh BIN [N] [SESSIONS]}; N=${2:-16000}; S=${3:-4}
W=$(mktemp -d /var/tmp/ferrosan-map-change.XXXXXX); mkdir -p "$W/state"
PORT=$(free_port) D="" H=""
cleanup() {
    [[ -n $H ]] && kill "$H" 2>/dev/null && wait "$H" 2>/dev/null
    stop_pid "$D" 60
    rm -rf "$W"
}
trap cleanup EXIT
python3 - "$W" "$N" "$PORT" <<'PY'
import sys
w, n, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out=['[limits]\nmax_sessions = 64\n[[portal_group]]\ntag = 1\nlisten = ["127.0.0.1:' + port + '"]\n\n']
out += [f'[[device]]\nname = "v{i:05d}"\nstore = "ram"\nsize = "1M"\n\n' for i in range(n)]
out.append('[[target]]\niqn = "iqn.2026-12.org.ferrosan:scale"\n\n  [[target.group]]\n  name = "g"\n  any_initiator = true\n  luns = [\n')
out += [f'    {{ lun = {i}, device = "v{i:05d}" }},\n' for i in range(n)]
out.append('  ]\n')
open(f'{w}/f.toml','w').write(''.join(out))
PY
$BIN serve --config $W/f.toml --control-socket $W/c.sock --state-dir $W/state >$W/d.log 2>&1 & D=$!
until $BIN ctl --socket $W/c.sock status >/dev/null 2>&1; do sleep 0.1; done
python3 bench/idle_sessions.py 127.0.0.1:$PORT iqn.2026-12.org.ferrosan:scale $S --ready $W/ready >/dev/null 2>&1 & H=$!
until [[ -s $W/ready ]]; do sleep 0.1; done; sleep 1
c0=$(sed 's/.*) //' /proc/$D/stat | awk '{print $12+$13}'); t0=$(date +%s%N)
for r in 1 2 3 4 5; do $BIN ctl --socket $W/c.sock lun unmap iqn.2026-12.org.ferrosan:scale g $((N - 1)) >/dev/null; $BIN ctl --socket $W/c.sock lun map iqn.2026-12.org.ferrosan:scale g $((N - 1)) v$(printf %05d $((N - 1))) >/dev/null; done
sleep 2
c1=$(sed 's/.*) //' /proc/$D/stat | awk '{print $12+$13}'); t1=$(date +%s%N)
echo "$(basename $BIN): 10 map changes with $S sessions at $N LUNs: daemon CPU $(( (c1-c0)*10 )) ms, wall $(( (t1-t0)/1000000 - 2000 )) ms"
