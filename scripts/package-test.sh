#!/usr/bin/env bash
# Builds the .deb (the release binary that ships; PACKAGE_PROFILE=debug for a quicker check
# where no release build is at hand), installs it with dpkg,
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

DEB=$(scripts/package-deb.sh --profile "${PACKAGE_PROFILE:-release}" --out "$WORK")
log "built $(basename "$DEB") ($(du -k "$DEB" | cut -f1) KiB)"
INFO=$(dpkg-deb --info "$DEB")
grep -q '^ Package: ferrosan$' <<<"$INFO" || die "no package name in $DEB"
CONTENTS=$(dpkg-deb --contents "$DEB")
for f in ./usr/bin/ferrosan ./usr/lib/systemd/system/ferrosan.service ./etc/ferrosan/ferrosan.toml \
    ./usr/share/doc/ferrosan/docs/OPERATIONS.md ./usr/share/doc/ferrosan/examples/ferrosan.toml \
    ./usr/share/ferrosan/prometheus/ferrosan-rules.yml ./usr/share/ferrosan/grafana/ferrosan-dashboard.json \
    ./usr/share/man/man1/ferrosan.1.gz ./usr/share/man/man1/ferrosan-serve.1.gz \
    ./usr/share/man/man1/ferrosan-ctl-chap-set.1.gz ./usr/share/man/man5/ferrosan.toml.5.gz \
    ./usr/share/bash-completion/completions/ferrosan \
    ./usr/share/zsh/vendor-completions/_ferrosan ./usr/share/fish/vendor_completions.d/ferrosan.fish; do
    grep -q " $f\$" <<<"$CONTENTS" || die "$f is missing from the package"
done
# Every doc README links to is in the package where its relative link finds it (the unit it
# links to is installed as the unit).
for link in $(grep -o '](\(docs\|examples\)/[^)#]*' README.md | cut -c3- | sort -u); do
    grep -q " ./usr/share/doc/ferrosan/$link\$" <<<"$CONTENTS" || die "README links to $link: not in the package"
done
# An upgrade leaves a serving daemon alone: no maintainer script restarts it, and the one run
# before an upgrade stops it only for a removal.
SCRIPTS=$WORK/control
dpkg-deb -e "$DEB" "$SCRIPTS"
! grep -q 'restart' "$SCRIPTS/postinst" || die "postinst restarts the daemon: $(cat "$SCRIPTS/postinst")"
if [[ -f $SCRIPTS/prerm ]] && grep -q 'deb-systemd-invoke stop' "$SCRIPTS/prerm"; then
    grep -q '"$1" = remove\|"$1" = "remove"' "$SCRIPTS/prerm" || die "prerm stops the daemon on upgrade: $(cat "$SCRIPTS/prerm")"
fi
UNIT=$(dpkg-deb --fsys-tarfile "$DEB" | tar -xO ./usr/lib/systemd/system/ferrosan.service)
grep -q 'ExecStart=/usr/bin/ferrosan serve' <<<"$UNIT" || die "the packaged unit does not run /usr/bin/ferrosan"
# lintian (Debian's package checker) finds nothing: no error, no warning.
LINT=$(lintian --fail-on error,warning "$DEB" 2>&1) || die "lintian: $LINT"
LINT=$(grep -v 'running with root privileges' <<<"$LINT" || true)
[[ -z $LINT ]] || die "lintian: $LINT"
log "lintian: no error, no warning"

dpkg -i "$DEB" >/dev/null || die "dpkg -i failed"
FILES=$(dpkg -L ferrosan)
# The packaged man pages render (read from the .deb: a minimal image's dpkg may be told to
# leave /usr/share/man out), and bash completes ferrosan's commands.
page() { dpkg-deb --fsys-tarfile "$DEB" | tar -xO "./usr/share/man/man1/$1.1.gz" | zcat; }
page ferrosan-ctl-chap-set | grep -q 'secret' || die "ferrosan-ctl-chap-set(1) does not say what it does"
page ferrosan-serve | MANWIDTH=80 man -l - 2>/dev/null | grep -q 'nvme' || die "ferrosan-serve(1) does not render"
page ferrosan-serve | MANWIDTH=80 man -l - 2>/dev/null | grep -q "^EXIT STATUS" || die "ferrosan-serve(1) has no EXIT STATUS"
dpkg-deb --fsys-tarfile "$DEB" | tar -xO ./usr/share/man/man5/ferrosan.toml.5.gz | zcat |
    MANWIDTH=80 man -l - 2>/dev/null | grep -q 'identity_seed' || die "ferrosan.toml(5) does not render"
COMPLETED=$(bash -c 'source /usr/share/bash-completion/completions/ferrosan
    COMP_WORDS=(ferrosan ct); COMP_CWORD=1; COMP_LINE="ferrosan ct"; COMP_POINT=${#COMP_LINE}
    _ferrosan ferrosan ct ferrosan; echo "${COMPREPLY[*]}"')
[[ $COMPLETED == *ctl* ]] || die "bash does not complete 'ferrosan ct' to ctl (got: $COMPLETED)"
/usr/bin/ferrosan check-config /etc/ferrosan/ferrosan.toml >/dev/null || die "the packaged config does not check"
# The unit's user, and the config's directory it may write (--save).
getent passwd ferrosan >/dev/null || die "the package made no user ferrosan"
[[ $(stat -c '%U:%G %a' /etc/ferrosan) == "root:ferrosan 770" ]] \
    || die "/etc/ferrosan is $(stat -c '%U:%G %a' /etc/ferrosan), not root:ferrosan 770"
[[ $(stat -c '%U:%G %a' /etc/ferrosan/ferrosan.toml) == "root:ferrosan 640" ]] \
    || die "the config is $(stat -c '%U:%G %a' /etc/ferrosan/ferrosan.toml), not root:ferrosan 640"

# Serve the packaged config as the unit does (its ExecStart), on 3260 unless that is taken.
CONFIG=/etc/ferrosan/ferrosan.toml PORT=3260
if port_open 3260; then
    # A port nothing listens on (no python3 needed on a minimal machine).
    PORT=3261
    while port_open "$PORT"; do PORT=$((PORT + 1)); done
    CONFIG=/etc/ferrosan/test.toml
    sed "s/:3260/:$PORT/g" /etc/ferrosan/ferrosan.toml > "$CONFIG"
    chown root:ferrosan "$CONFIG" && chmod 0640 "$CONFIG"
    log "port 3260 is in use here: serving the packaged config on $PORT instead"
fi
# As the unit runs it: the user ferrosan, its socket in a directory of its own (in a
# root-owned directory it may pass through, as /run/ferrosan is in /run).
chmod 0755 "$WORK"
install -d -o ferrosan -g ferrosan -m 0755 "$WORK/run"
SOCKET=$WORK/run/control.sock
setpriv --reuid=ferrosan --regid=ferrosan --init-groups \
    /usr/bin/ferrosan serve --config "$CONFIG" --control-socket "$SOCKET" >"$WORK/daemon.log" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do
    port_open "$PORT" && break
    sleep 0.1
done
LISTED=$(iscsi-ls -s "iscsi://127.0.0.1:$PORT" 2>&1) || { cat "$WORK/daemon.log" >&2; die "iscsi-ls failed: $LISTED"; }
grep -q 'iqn.2026-11.org.ferrosan:demo' <<<"$LISTED" && grep -q 'Lun:0 *Type:DIRECT_ACCESS' <<<"$LISTED" \
    || die "the demo LUN is not listed: $LISTED"
/usr/bin/ferrosan ctl --socket "$SOCKET" status >/dev/null || die "ctl status failed"
# A live change saved by the daemon's user into its file: edited in place, comments kept, the
# previous file kept beside it.
/usr/bin/ferrosan ctl --socket "$SOCKET" device add extra ram:4M --save >/dev/null \
    || { cat "$WORK/daemon.log" >&2; die "ctl device add --save failed"; }
grep -q '^name = "extra"' "$CONFIG" || die "the saved config has no device extra"
grep -q '^# /etc/ferrosan/ferrosan.toml: the configuration the Debian package installs' "$CONFIG" \
    || die "saving lost the config's comments"
[[ -f $CONFIG.bak ]] || die "no backup of the config beside it"
/usr/bin/ferrosan check-config "$CONFIG" >/dev/null || die "the saved config does not check"
kill -TERM "$DAEMON"
wait "$DAEMON" || die "the daemon did not exit cleanly on SIGTERM"
DAEMON=""
[[ $CONFIG == /etc/ferrosan/test.toml ]] && rm -f "$CONFIG" "$CONFIG.bak"
log "installed; the packaged config serves the demo LUN as the user ferrosan, and --save edits it: $(grep -o 'Lun:0.*' <<<"$LISTED")"

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
