#!/usr/bin/env bash
# Builds the .deb (debug binary: the test needs no release build), installs it with dpkg,
# checks its files, serves the packaged config as the unit's ExecStart would and reaches the
# demo LUN with iscsi-ls, then removes and purges it and checks nothing it installed is left
# (LUN data in /var/lib/ferrosan is never removed). Under systemd as PID 1 it also starts the
# unit; elsewhere (a container) it says so: the unit itself is checked by systemd-analyze in
# crates/ferrosan/tests/systemd.rs. Refuses to touch a ferrosan package installed before.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=package
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

if dpkg -s ferrosan >/dev/null 2>&1; then
    die "a ferrosan package is installed already: not touching it (dpkg -P ferrosan first)"
fi
WORK=$(mktemp -d)
DAEMON=""
cleanup() {
    [[ -n $DAEMON ]] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
    if dpkg -s ferrosan >/dev/null 2>&1; then dpkg -P ferrosan >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

DEB=$(scripts/package-deb.sh --profile debug --out "$WORK")
log "built $(basename "$DEB") ($(du -k "$DEB" | cut -f1) KiB)"
INFO=$(dpkg-deb --info "$DEB")
grep -q '^ Package: ferrosan$' <<<"$INFO" || die "no package name in $DEB"
CONTENTS=$(dpkg-deb --contents "$DEB")
for f in ./usr/bin/ferrosan ./lib/systemd/system/ferrosan.service ./etc/ferrosan/ferrosan.toml \
    ./usr/share/doc/ferrosan/OPERATIONS.md ./usr/share/doc/ferrosan/examples/ferrosan.toml \
    ./usr/share/ferrosan/prometheus/ferrosan-rules.yml ./usr/share/ferrosan/grafana/ferrosan-dashboard.json; do
    grep -q " $f\$" <<<"$CONTENTS" || die "$f is missing from the package"
done
UNIT=$(dpkg-deb --fsys-tarfile "$DEB" | tar -xO ./lib/systemd/system/ferrosan.service)
grep -q 'ExecStart=/usr/bin/ferrosan serve' <<<"$UNIT" || die "the packaged unit does not run /usr/bin/ferrosan"

dpkg -i "$DEB" >/dev/null || die "dpkg -i failed"
FILES=$(dpkg -L ferrosan)
/usr/bin/ferrosan check-config /etc/ferrosan/ferrosan.toml >/dev/null || die "the packaged config does not check"

# Serve the packaged config as the unit does (its ExecStart), on 3260 unless that is taken.
CONFIG=/etc/ferrosan/ferrosan.toml PORT=3260
if port_open 3260; then
    # A port nothing listens on (no python3 needed on a minimal machine).
    PORT=3261
    while port_open "$PORT"; do PORT=$((PORT + 1)); done
    CONFIG=$WORK/ferrosan.toml
    sed "s/:3260/:$PORT/g" /etc/ferrosan/ferrosan.toml > "$CONFIG"
    log "port 3260 is in use here: serving the packaged config on $PORT instead"
fi
/usr/bin/ferrosan serve --config "$CONFIG" --control-socket "$WORK/control.sock" >"$WORK/daemon.log" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do
    port_open "$PORT" && break
    sleep 0.1
done
LISTED=$(iscsi-ls -s "iscsi://127.0.0.1:$PORT" 2>&1) || { cat "$WORK/daemon.log" >&2; die "iscsi-ls failed: $LISTED"; }
grep -q 'iqn.2026-11.org.ferrosan:demo' <<<"$LISTED" && grep -q 'Lun:0 *Type:DIRECT_ACCESS' <<<"$LISTED" \
    || die "the demo LUN is not listed: $LISTED"
/usr/bin/ferrosan ctl --socket "$WORK/control.sock" status >/dev/null || die "ctl status failed"
kill -TERM "$DAEMON"
wait "$DAEMON" || die "the daemon did not exit cleanly on SIGTERM"
DAEMON=""
log "installed; the packaged config serves the demo LUN: $(grep -o 'Lun:0.*' <<<"$LISTED")"

if [[ $(cat /proc/1/comm 2>/dev/null) == systemd ]]; then
    systemctl enable --now ferrosan || die "systemctl enable --now ferrosan failed"
    systemctl is-active --quiet ferrosan || die "the service is not active"
    systemctl disable --now ferrosan
    log "systemctl enable --now: active"
else
    log "systemd is not PID 1 here: the unit was not started (systemd-analyze checks it in tests/systemd.rs)"
fi

dpkg -r ferrosan >/dev/null || die "dpkg -r failed"
[[ ! -e /usr/bin/ferrosan ]] || die "/usr/bin/ferrosan left after removal"
[[ -e /etc/ferrosan/ferrosan.toml ]] || die "the conffile went with remove (it must stay until purge)"
dpkg -P ferrosan >/dev/null || die "dpkg -P failed"
left=0
while read -r f; do
    [[ -f $f ]] && { log "left after purge: $f"; left=1; }
done <<<"$FILES"
((left == 0)) || die "files left after purge"
log "removed and purged cleanly"
