#!/usr/bin/env bash
# What people read, as the docs show it, rendered by a real browser (headless Chromium):
# `ferrosan top` at 80 and 150 columns while three benches run against one daemon (iSCSI and
# NVMe/TCP), and the report of a bench of both doors. Each picture is checked to be one (a PNG
# of the expected size, most of it not blank), so a page or a screen that stops rendering fails
# the test command.
#
#   scripts/screenshots.sh [--docs]
#
# Writes target/screenshots/{top-80,top-150,report}.png; --docs copies them to docs/images/
# (what OPERATIONS.md and BENCH.md show). FERROSAN_BIN: the binary (default: a release build of
# this checkout). Installs chromium-headless-shell and tmux when missing.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=screenshots
source scripts/lib/common.sh

DOCS=0
[[ ${1:-} == --docs ]] && DOCS=1
FERROSAN_DEPS=(chromium-headless-shell:chromium-headless-shell tmux:tmux python3:python3)
ensure_deps
ferrosan_bin
OUT=$ROOT/target/screenshots
mkdir -p "$OUT"
WORK=$(mktemp -d)
DAEMON="" PIDS=() TMUX_SERVER=ferrosan-shots-$$
cleanup() {
    tmux -L "$TMUX_SERVER" kill-server 2>/dev/null || true
    for p in "${PIDS[@]}"; do stop_pid "$p" 20; done
    stop_pid "$DAEMON"
    cp "$WORK/daemon.log" "$OUT/daemon.log" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

ISCSI=$(free_port) NVME=$(free_port)
IQN=iqn.2026-12.org.ferrosan:shots NQN=nqn.2026-12.org.ferrosan:shots
cat >"$WORK/ferrosan.toml" <<CONFIG
[server]
state_dir = "$WORK/state"
control_socket = "$WORK/control.sock"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$ISCSI"]
nvme_listen = ["127.0.0.1:$NVME"]

[[device]]
name = "vm-store"
store = "ram"
size = "256M"

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "vm-store" } ]
CONFIG
"$FERROSAN_BIN" serve --config "$WORK/ferrosan.toml" >"$WORK/daemon.log" 2>&1 &
DAEMON=$!
wait_port "$ISCSI" "$DAEMON" 20 || { tail_indented "$WORK/daemon.log"; die "ferrosan did not start"; }
ISCSI_URL=iscsi://127.0.0.1:$ISCSI/$IQN/0 NVME_URL=nvme+tcp://127.0.0.1:$NVME/$NQN/1
bench() { "$FERROSAN_BIN" bench --size 256M --out "$WORK/$1" "${@:2}" >"$WORK/$1.log" 2>&1; }

# Every block written first: reads of pages never written would not be reads (and the report
# would say so).
bench fill --destructive --only seqwrite-1m-qd16 --ramp 0 --runtime 2 "$ISCSI_URL" \
    || die "filling the LUN failed: $(tail -3 "$WORK/fill.log")"

# top: three sessions busy (a 70/30 mix and 1 MiB reads over iSCSI, 4 KiB reads over NVMe/TCP).
bench mix --destructive --only randrw70-4k-qd16 --ramp 0 --runtime 40 "$ISCSI_URL" & PIDS+=($!)
bench large --only seqread-1m-qd16 --ramp 0 --runtime 40 "$ISCSI_URL" & PIDS+=($!)
bench small --only randread-4k-qd16 --ramp 0 --runtime 40 "$NVME_URL" & PIDS+=($!)
# capture WIDTH: the top screen at that width, with its colours and bold as ANSI escapes, once
# it shows the three sessions with a whole window of rates (up to 15 s on a busy machine).
capture() {
    local i
    tmux -L "$TMUX_SERVER" new-session -d -s "top$1" -x "$1" -y 22 \
        "$FERROSAN_BIN top --socket $WORK/control.sock"
    for i in $(seq 1 15); do
        sleep 1
        tmux -L "$TMUX_SERVER" capture-pane -e -p -t "top$1" >"$WORK/top-$1.ansi"
        ((i >= 5)) && grep -q 'all 3 sessions' "$WORK/top-$1.ansi" && break
    done
    tmux -L "$TMUX_SERVER" kill-session -t "top$1"
    grep -q 'all 3 sessions' "$WORK/top-$1.ansi" || die "top at $1 columns does not show the 3 sessions"
}
capture 80
capture 150
for p in "${PIDS[@]}"; do
    wait "$p" || die "a bench under top failed: $(tail -n 2 "$WORK"/{mix,large,small}.log; python3 -c "import json,sys; [print(json.load(open(f))[\"skipped\"]) for f in sys.argv[1:]]" "$WORK"/*/results.json)"
done
PIDS=()

# The report: 4 KiB random reads at depths 1 and 64 and 1 MiB reads, both doors.
bench report --quick --only randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16 \
    "$ISCSI_URL" "$NVME_URL" || die "the report's bench failed: $(tail -3 "$WORK/report.log")"
if grep -q 'only zeros' "$WORK/report/report.html"; then die "the report's LUN read as never written"; fi

# A terminal screen as an HTML page: ANSI bold and colours to spans, on a dark terminal.
python3 - "$WORK" <<'PY'
import html, re, sys
work = sys.argv[1]
COLORS = {30: "#2e3436", 31: "#ef2929", 32: "#8ae234", 33: "#fce94f", 34: "#729fcf",
          35: "#ad7fa8", 36: "#34e2e2", 37: "#eeeeec"}
for width in (80, 150):
    text = open(f"{work}/top-{width}.ansi", encoding="utf-8").read()
    out, bold, color = [], False, None
    for part in re.split(r"(\x1b\[[0-9;]*m)", text):
        m = re.fullmatch(r"\x1b\[([0-9;]*)m", part)
        if not m:
            style = ("font-weight:bold;" if bold else "") + (f"color:{color};" if color else "")
            out.append(f'<span style="{style}">{html.escape(part)}</span>' if style else html.escape(part))
            continue
        for code in [int(c) for c in (m.group(1) or "0").split(";") if c]:
            if code == 0: bold, color = False, None
            elif code == 1: bold = True
            elif code == 22: bold = False
            elif code in COLORS: color = COLORS[code]
            elif code == 39: color = None
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><style>body{margin:0;background:#1e1e1e}"
            "pre{margin:0;padding:12px;color:#d3d7cf;font:15px/1.25 'DejaVu Sans Mono',monospace}"
            "</style></head><body><pre>" + "".join(out) + "</pre></body></html>")
    open(f"{work}/top-{width}.html", "w", encoding="utf-8").write(page)
PY

# shot PAGE PNG WIDTH HEIGHT: the page rendered at that window size.
shot() {
    timeout 120 chromium-headless-shell --no-sandbox --disable-gpu --hide-scrollbars \
        --window-size="$3,$4" --screenshot="$2" "file://$1" >"$WORK/chromium.log" 2>&1 \
        || { tail_indented "$WORK/chromium.log"; die "chromium could not render $1"; }
}
# A character cell of DejaVu Sans Mono at 15 px is about 9 px wide and 19 px tall.
shot "$WORK/top-80.html" "$OUT/top-80.png" 760 450
shot "$WORK/top-150.html" "$OUT/top-150.png" 1390 450
shot "$WORK/report/report.html" "$OUT/report.png" 1400 2400

# Each a PNG of its size, and a picture: at least a tenth of its rows not one colour.
python3 - "$OUT" <<'PY'
import struct, sys, zlib
out = sys.argv[1]
for name, (w, h) in {"top-80": (760, 450), "top-150": (1390, 450), "report": (1400, 2400)}.items():
    data = open(f"{out}/{name}.png", "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{name}: not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (w, h), f"{name}: {width}x{height}, not {w}x{h}"
    chunks, at = [], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"IDAT":
            chunks.append(data[at + 8:at + 8 + length])
        at += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = len(raw) // height
    busy = sum(1 for y in range(height) if len(set(raw[y * stride + 1:(y + 1) * stride])) > 8)
    assert busy >= height // 10, f"{name}: only {busy} of {height} rows hold anything"
    print(f"{name}.png: {width}x{height}, {busy} rows with content, {len(data)} bytes")
PY
if ((DOCS)); then
    mkdir -p docs/images
    cp "$OUT"/top-80.png "$OUT"/top-150.png "$OUT"/report.png docs/images/
    log "copied to docs/images/"
fi
log "screenshots in $OUT"
