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
STOP_GRACE=60
scratch /var/tmp/ferrosan-map-change.XXXXXX
mkdir -p "$WORK/state"
PORT=$(free_port)
IQN=iqn.2026-12.org.ferrosan:scale
python3 - "$WORK" "$N" "$PORT" <<'PY'
import sys
w, n, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out=['[limits]\nmax_sessions = 64\n[[portal_group]]\ntag = 1\nlisten = ["127.0.0.1:' + port + '"]\n\n']
out += [f'[[device]]\nname = "v{i:05d}"\nstore = "ram"\nsize = "1M"\n\n' for i in range(n)]
out.append('[[target]]\niqn = "iqn.2026-12.org.ferrosan:scale"\n\n  [[target.group]]\n  name = "g"\n  any_initiator = true\n  luns = [\n')
out += [f'    {{ lun = {i}, device = "v{i:05d}" }},\n' for i in range(n)]
out.append('  ]\n')
open(f'{w}/f.toml','w').write(''.join(out))
PY
start_daemon_ctl daemon "$WORK/c.sock" "$BIN" serve --config "$WORK/f.toml" \
    --control-socket "$WORK/c.sock" --state-dir "$WORK/state"
spawn_ready "the sessions did not all log in" python3 bench/idle_sessions.py "127.0.0.1:$PORT" \
    "$IQN" "$S"
sleep 1
ctl() { "$BIN" ctl --socket "$WORK/c.sock" "$@" >/dev/null; }
last=$((N - 1))
c0=$(ticks "$PID")
t0=$(date +%s%N)
for _ in 1 2 3 4 5; do
    ctl lun unmap "$IQN" g "$last"
    ctl lun map "$IQN" g "$last" "v$(printf %05d "$last")"
done
sleep 2
c1=$(ticks "$PID")
t1=$(date +%s%N)
echo "$(basename "$BIN"): 10 map changes with $S sessions at $N LUNs:" \
    "daemon CPU $(((c1 - c0) * 1000 / HZ)) ms, wall $(((t1 - t0) / 1000000 - 2000)) ms"
