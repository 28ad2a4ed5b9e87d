#!/usr/bin/env bash
# What an idle session costs when its group maps many LUNs: a daemon with LUNS (4,096) RAM
# devices in one group, its RSS at start, with SESSIONS (200) idle sessions logged in
# (bench/idle_sessions.py: login and NOP-Out answers, no command to any LUN), and after
# they ended. One line per binary, so builds compare side by side in one run:
#
#   bench/session-luns.sh BIN...        # e.g. the commit before a change and after it
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LUNS=${LUNS:-4096} SESSIONS=${SESSIONS:-200}
(($# > 0)) || { echo "usage: $0 BIN..." >&2; exit 2; }
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
one() {
    local bin=$1 dir pid idle port r0 r1 r2
    dir=$(mktemp -d) port=$(port)
    {
        printf '[[portal_group]]\ntag = 1\nlisten = ["127.0.0.1:%s"]\n\n' "$port"
        for ((i = 0; i < LUNS; i++)); do
            printf '[[device]]\nname = "r%d"\nstore = "ram"\nsize = "1MiB"\n\n' "$i"
        done
        printf '[[target]]\niqn = "iqn.2026-12.org.ferrosan:luns"\n  [[target.group]]\n'
        printf '  name = "g"\n  any_initiator = true\n  luns = [\n'
        for ((i = 0; i < LUNS; i++)); do printf '    { lun = %d, device = "r%d" },\n' "$i" "$i"; done
        printf '  ]\n[limits]\nmax_sessions = %d\n' $((SESSIONS + 16))
    } >"$dir/ferrosan.toml"
    "$bin" serve --config "$dir/ferrosan.toml" --control-socket "$dir/ctl.sock" >"$dir/log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do grep -q " serving on " "$dir/log" && break; sleep 0.1; done
    rss() { awk '/VmRSS/{print $2}' "/proc/$pid/status"; }
    r0=$(rss)
    python3 bench/idle_sessions.py "127.0.0.1:$port" iqn.2026-12.org.ferrosan:luns "$SESSIONS" \
        --hold 6 --ready "$dir/ready" >/dev/null 2>&1 &
    idle=$!
    for _ in $(seq 120); do [[ -s $dir/ready ]] && break; sleep 0.5; done
    grep -q "ready $SESSIONS" "$dir/ready" || { echo "$bin: not every session logged in" >&2; exit 1; }
    sleep 2
    r1=$(rss)
    wait "$idle" || true
    sleep 3
    r2=$(rss)
    echo "$bin: $LUNS LUNs: start $r0 KiB; $SESSIONS idle sessions $r1 KiB," \
        "$(((r1 - r0) / SESSIONS)) KiB each; after they ended $r2 KiB"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
for bin in "$@"; do one "$bin"; done
