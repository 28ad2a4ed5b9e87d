#!/usr/bin/env bash
# Builds the Debian package with dpkg-deb (no packaging tool beyond dpkg itself):
#   scripts/package-deb.sh [--profile release|debug] [--out DIR]
# Prints the .deb's path. The package installs /usr/bin/ferrosan, the hardened unit
# (/lib/systemd/system/ferrosan.service, Type=notify), a loopback-only RAM demo config as a
# conffile (/etc/ferrosan/ferrosan.toml), docs and examples (/usr/share/doc/ferrosan) and the
# Prometheus rules and Grafana dashboard (/usr/share/ferrosan). Install and start:
#   apt install ./ferrosan_VERSION_ARCH.deb && systemctl enable --now ferrosan
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROFILE=release OUT=$ROOT/target/debian
while (($#)); do
    case $1 in
        --profile) PROFILE=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "usage: $0 [--profile release|debug] [--out DIR]" >&2; exit 2 ;;
    esac
done
case $PROFILE in
    release) cargo build --release -q -p ferrosan; BIN=target/release/ferrosan ;;
    debug) cargo build -q -p ferrosan; BIN=target/debug/ferrosan ;;
    *) echo "unknown profile $PROFILE" >&2; exit 2 ;;
esac
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' crates/ferrosan/Cargo.toml | head -n 1)
[[ -n $VERSION ]] || VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
ARCH=$(dpkg --print-architecture)
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
install -D -m 0755 "$BIN" "$STAGE/usr/bin/ferrosan"
strip --strip-unneeded "$STAGE/usr/bin/ferrosan" 2>/dev/null || true
sed 's#/usr/local/bin/ferrosan#/usr/bin/ferrosan#g' dist/ferrosan.service \
    | install -D -m 0644 /dev/stdin "$STAGE/lib/systemd/system/ferrosan.service"
install -D -m 0644 dist/deb/ferrosan.toml "$STAGE/etc/ferrosan/ferrosan.toml"
for doc in README.md docs/OPERATIONS.md docs/CONFIG.md docs/SECURITY.md docs/ARCHITECTURE.md; do
    install -D -m 0644 "$doc" "$STAGE/usr/share/doc/ferrosan/$(basename "$doc")"
done
install -D -m 0644 examples/ferrosan.toml "$STAGE/usr/share/doc/ferrosan/examples/ferrosan.toml"
install -D -m 0644 dist/prometheus/ferrosan-rules.yml "$STAGE/usr/share/ferrosan/prometheus/ferrosan-rules.yml"
install -D -m 0644 dist/grafana/ferrosan-dashboard.json "$STAGE/usr/share/ferrosan/grafana/ferrosan-dashboard.json"
install -D -m 0644 /dev/stdin "$STAGE/usr/share/doc/ferrosan/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: ferrosan
Files: *
License: $(sed -n 's/^license = "\(.*\)"/\1/p' Cargo.toml crates/ferrosan/Cargo.toml | head -n 1)
COPYRIGHT
# The libraries the binary links, for Depends (what dpkg-shlibdeps would say, from ldd).
DEPENDS=$(ldd "$BIN" | awk '/=>/ {print $3}' | xargs -r dpkg -S 2>/dev/null \
    | cut -d: -f1 | sort -u | paste -sd, - | sed 's/,/, /g')
mkdir -p "$STAGE/DEBIAN"
cat > "$STAGE/DEBIAN/control" <<CONTROL
Package: ferrosan
Version: $VERSION
Architecture: $ARCH
Maintainer: ferrosan developers <ferrosan@localhost>
Depends: ${DEPENDS:-libc6}, passwd
Section: net
Priority: optional
Installed-Size: $(du -sk "$STAGE" | cut -f1)
Description: userspace iSCSI target (SAN storage array software)
 ferrosan exports RAM, files and block devices as iSCSI LUNs to Linux,
 VMware, Windows and QEMU initiators: LUN masking per initiator group,
 CHAP, ALUA multipath, persistent reservations, live reconfiguration
 (ferrosan ctl), Prometheus metrics. The packaged config serves a RAM
 demo LUN on loopback only.
CONTROL
echo /etc/ferrosan/ferrosan.toml > "$STAGE/DEBIAN/conffiles"
cat > "$STAGE/DEBIAN/postinst" <<'SCRIPT'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    # The daemon's user (the unit's User=): it may write its own config (ctl ... --save).
    if ! getent passwd ferrosan >/dev/null; then
        useradd --system --user-group --home-dir /var/lib/ferrosan --no-create-home \
            --shell /usr/sbin/nologin --comment "ferrosan iSCSI target" ferrosan
    fi
    # On first install only: an admin's own modes and owners are kept on upgrades.
    if [ -z "$2" ]; then
        chown root:ferrosan /etc/ferrosan /etc/ferrosan/ferrosan.toml
        chmod 0770 /etc/ferrosan
        chmod 0640 /etc/ferrosan/ferrosan.toml
    fi
fi
# Enabling and starting is the admin's choice: systemctl enable --now ferrosan
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
SCRIPT
cat > "$STAGE/DEBIAN/prerm" <<'SCRIPT'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop ferrosan.service >/dev/null 2>&1 || true
    systemctl disable ferrosan.service >/dev/null 2>&1 || true
fi
SCRIPT
cat > "$STAGE/DEBIAN/postrm" <<'SCRIPT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
# LUN files in /var/lib/ferrosan are data: never removed by the package, not even on purge
# (nor is the user ferrosan that owns them). The daemon's backup of its config goes with it.
if [ "$1" = purge ]; then
    rm -f /etc/ferrosan/ferrosan.toml.bak /etc/ferrosan/.ferrosan.toml.tmp \
        /etc/ferrosan/.ferrosan.toml.bak.tmp
    rmdir --ignore-fail-on-non-empty /etc/ferrosan 2>/dev/null || true
fi
SCRIPT
chmod 0755 "$STAGE/DEBIAN/postinst" "$STAGE/DEBIAN/prerm" "$STAGE/DEBIAN/postrm"
mkdir -p "$OUT"
DEB=$OUT/ferrosan_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
