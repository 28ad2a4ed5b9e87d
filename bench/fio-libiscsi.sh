#!/usr/bin/env bash
# Prints the path of a fio that has the libiscsi engine (fio's own iSCSI initiator) and the rbd
# engine (librbd: the physical limit a gateway is measured against), building one if there is
# none.
#
#   bench/fio-libiscsi.sh          # path on stdout, progress on stderr
#   FIO=/path/to/fio bench/fio-libiscsi.sh   # use this one (checked for the engine)
#
# Debian's fio package is built without --enable-libiscsi. This fetches the source of the same
# release's fio with apt (deb-src of the running Debian suite, through a private sources list
# and state directory: nothing under /etc/apt changes), installs the build dependencies
# (libiscsi-dev, librbd-dev, pkg-config, gcc, make; needs root), builds it without -march=native and keeps
# the binary in target/bench-tools/ for the next run. Takes about a minute on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS=$ROOT/target/bench-tools
CACHED=$TOOLS/fio

has_engine() {
    [[ -x $1 ]] || return 1
    local engines
    engines=$("$1" --enghelp 2>/dev/null)
    grep -qw libiscsi <<<"$engines" && grep -qw rbd <<<"$engines"
}

if [[ -n ${FIO:-} ]]; then
    has_engine "$FIO" || { echo "fio-libiscsi: $FIO lacks the libiscsi or the rbd engine" >&2; exit 1; }
    echo "$FIO"
    exit 0
fi
for candidate in "$(command -v fio || true)" "$CACHED"; do
    if [[ -n $candidate ]] && has_engine "$candidate"; then
        echo "$candidate"
        exit 0
    fi
done

log() { echo "[fio-libiscsi] $*" >&2; }
[[ $(id -u) -eq 0 ]] || { log "building fio needs root (apt-get); set FIO=... instead"; exit 1; }
. /etc/os-release
SUITE=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
WORK=$TOOLS/fio-build
rm -rf "$WORK"
mkdir -p "$WORK/lists/partial" "$WORK/src"
cat >"$WORK/deb-src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
APT=(-o "Dir::Etc::SourceList=$WORK/deb-src.sources" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$WORK/lists")
log "installing build dependencies"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q libiscsi-dev librbd-dev librados-dev pkg-config gcc make >&2
log "fetching fio source ($SUITE)"
apt-get "${APT[@]}" update >&2
(cd "$WORK/src" && apt-get "${APT[@]}" source --download-only fio >&2)
tar -xzf "$WORK"/src/fio_*.orig.tar.gz -C "$WORK/src"
SRC=$(find "$WORK/src" -maxdepth 1 -type d -name 'fio-*' | head -n1)
log "building $(basename "$SRC") with the libiscsi and rbd engines"
(cd "$SRC" && ./configure --enable-libiscsi --disable-native >&2 && make -j"$(nproc)" -s >&2)
install -m 0755 "$SRC/fio" "$CACHED"
rm -rf "$WORK"
has_engine "$CACHED" || { log "built fio lacks the libiscsi or the rbd engine"; exit 1; }
echo "$CACHED"
