# shellcheck shell=bash
# ferrosan's test guest: a small Debian 12 (bookworm) QEMU guest with the Linux kernel's iSCSI
# and NVMe/TCP initiators, for tests that need a real kernel initiator (the host loads no
# modules). Source it after scripts/lib/common.sh.
#
#   guest_image            build the image, or reuse the cached one; sets GUEST_DIR, and
#                          GUEST_BUILT to 1 if it was built now
#   guest_versions         one line: the guest's kernel and tested packages' versions
#   guest_start SHARE CONSOLE REPORT [MEM_MIB]
#                          boot it in the background (sets GUEST_PID): SHARE is a host
#                          directory the guest mounts at /host (read-only) and whose main.sh it
#                          runs; the console (ttyS0: kernel, init, main.sh's output) goes to
#                          the file CONSOLE, the second serial port (ttyS1, $REPORT in the guest)
#                          to the file REPORT. The guest powers off when main.sh returns.
#
# The image (GUEST_DIR: vmlinuz, initrd.img, root.img) is built with mmdebstrap from Debian's
# packages — the distribution's own kernel, open-iscsi, multipath-tools — and cached in
# ${XDG_CACHE_HOME:-$HOME/.cache}/ferrosan/guest-HASH, HASH covering the package list, this file
# and the guest's init (scripts/guest/init.sh), so a change to any of them builds a new image.
# Test scripts reach the guest through the share, so changing them rebuilds nothing.
#
# Boot: QEMU loads the extracted kernel and Debian's initrd, root is an ext4 image on a virtio
# disk made with `mke2fs -d` (no loop mount) and opened as a snapshot (the image is never
# written), and init= is scripts/guest/init.sh instead of systemd: under software emulation
# (TCG) a systemd boot costs tens of seconds more.
#
# Environment: FERROSAN_GUEST_ACCEL   QEMU accelerator (default tcg; "kvm" where KVM works:
#                                     here /dev/kvm opens but a KVM guest never gets going)
#              FERROSAN_GUEST_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#              FERROSAN_GUEST_CACHE   cache directory (default ${XDG_CACHE_HOME:-$HOME/.cache}/ferrosan)
#              FERROSAN_GUEST_KERNEL  "stable" (default: bookworm's 6.1), "backports" (the
#                                     newest bookworm-backports kernel: 6.12, the first Debian
#                                     kernel with NVMe in-band authentication, CONFIG_NVME_AUTH)
#                                     or "trixie" (a Debian 13 guest: Linux 6.12, nvme-cli 2.13
#                                     and tlshd from ktls-utils, the host's half of NVMe/TCP TLS)

GUEST_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GUEST_KERNEL=${FERROSAN_GUEST_KERNEL:-stable}
GUEST_SUITE=bookworm
[[ $GUEST_KERNEL == trixie ]] && GUEST_SUITE=trixie
# The tests' tools; nvme-cli for the NVMe/TCP tests; lvm2 and thin-provisioning-tools for
# ferrosan's LVM pools (scripts/lvm-pool.sh); e2fsprogs for ferrosan-csi's node, which makes
# ext4 (scripts/csi-node.sh). mount, procps, kmod, udev: the init and the
# daemons need them (the "essential" variant has none of them).
GUEST_PACKAGES=(
    linux-image-amd64 open-iscsi multipath-tools sg3-utils fio nvme-cli e2fsprogs
    iproute2 nftables kmod udev mount procps lvm2 thin-provisioning-tools
)
# NVMe/TCP TLS on the host's side: tlshd does the handshake, keyctl reads the .nvme keyring.
[[ $GUEST_KERNEL == trixie ]] && GUEST_PACKAGES+=(ktls-utils keyutils)
# Module directories no test needs (~160 MiB): dropped to keep the image and its cache small.
GUEST_DROP_MODULES=(
    drivers/gpu drivers/media drivers/net/wireless drivers/infiniband drivers/iio
    drivers/staging drivers/bluetooth drivers/isdn sound net/bluetooth net/mac80211 net/wireless
)
GUEST_DIR=""
GUEST_BUILT=0
GUEST_PID=""

# The cache key: everything that decides the image's content.
guest_hash() {
    {
        printf '%s\n' "$GUEST_SUITE" "$GUEST_KERNEL" "${GUEST_PACKAGES[@]}" "${GUEST_DROP_MODULES[@]}"
        cat "$GUEST_LIB_DIR/guest.sh" "$GUEST_LIB_DIR/../guest/init.sh"
    } | sha256sum | cut -c1-16
}

guest_image() {
    local cache=${FERROSAN_GUEST_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ferrosan} dir t0
    dir=$cache/$(guest_prefix)$(guest_hash)
    if [[ -f $dir/ready ]]; then
        GUEST_DIR=$dir
        log "guest image: cached $dir"
        return 0
    fi
    ((EUID == 0)) || die "building the guest image needs root (mmdebstrap --mode=root, mke2fs -d keeps owners)"
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap)"
    mkdir -p "$cache"
    t0=$(date +%s)
    log "guest image: building $dir (mmdebstrap $GUEST_SUITE: ${GUEST_PACKAGES[*]})"
    guest_build "$dir" || die "building the guest image failed"
    log "guest image: built in $(($(date +%s) - t0)) s"
    # shellcheck disable=SC2034 # for the script that sources this file
    GUEST_BUILT=1
    # Older images (other hashes) are dead weight: ~550 MiB each.
    local old
    # A *.build.* left by an interrupted build too.
    for old in "$cache/$(guest_prefix)"*; do
        [[ $old == "$dir" || ! -d $old ]] && continue
        # The other kernel's images are not stale.
        [[ $GUEST_KERNEL == stable && ($old == "$cache"/guest-bpo-* || $old == "$cache"/guest-trixie-*) ]] && continue
        log "guest image: removing the stale $old"
        guest_rm_tree "$old"
    done
    GUEST_DIR=$dir
}

# The image directory's prefix: each kernel variant keeps its own image.
guest_prefix() {
    case $GUEST_KERNEL in
        backports) echo guest-bpo- ;;
        trixie) echo guest-trixie- ;;
        *) echo guest- ;;
    esac
}

# guest_rm_tree DIR: rm -rf, unless something is mounted below DIR: a build killed mid-way can
# leave mmdebstrap's mounts (/proc, /sys, /dev nodes) in its tree, and rm -rf would descend into
# them. Such a tree is left, with a warning.
guest_rm_tree() {
    if awk -v d="$1/" 'index($2, d) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        log "guest image: not removing $1: something is mounted below it"
        return 0
    fi
    rm -rf "$1"
}

# guest_build DIR: build into a scratch directory beside DIR, then rename it, so an interrupted
# build never leaves a half image that looks ready.
guest_build() {
    local dir=$1 tmp
    tmp=$(mktemp -d "$dir.build.XXXXXX")
    if ! guest_build_into "$tmp"; then
        guest_rm_tree "$tmp"
        return 1
    fi
    rm -rf "$dir"
    mv "$tmp" "$dir"
}

# guest_build_into TMP: the image's files in TMP (TMP/rootfs is the scratch tree).
guest_build_into() {
    local tmp=$1 kver m size_mib include rc=0
    local mirror=${FERROSAN_GUEST_MIRROR:-http://deb.debian.org/debian}
    local sources=("deb $mirror $GUEST_SUITE main")
    local packages=("${GUEST_PACKAGES[@]}")
    case $GUEST_KERNEL in
        stable | trixie) ;;
        backports)
            sources+=("deb $mirror $GUEST_SUITE-backports main")
            packages=("linux-image-amd64/$GUEST_SUITE-backports" "${packages[@]:1}")
            ;;
        *) log "FERROSAN_GUEST_KERNEL must be stable, backports or trixie, not $GUEST_KERNEL"; return 1 ;;
    esac
    include=$(IFS=,; echo "${packages[*]}")
    # "essential" plus the packages: no apt, no docs, man pages or locales in the guest.
    mmdebstrap --variant=essential --mode=root --include="$include" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        "$GUEST_SUITE" "$tmp/rootfs" "${sources[@]}" \
        >"$tmp/mmdebstrap.log" 2>&1 || rc=$?
    if ((rc != 0)); then
        log "mmdebstrap failed (exit $rc); its last lines:"
        tail_indented "$tmp/mmdebstrap.log" 30
        return 1
    fi
    install -m 0755 "$GUEST_LIB_DIR/../guest/init.sh" "$tmp/rootfs/sbin/ferrosan-init" || return 1
    # What went in, for the reports (guest_versions).
    # shellcheck disable=SC2016 # dpkg-query's format, not the shell's
    chroot "$tmp/rootfs" dpkg-query -W -f '${Package} ${Version}\n' >"$tmp/packages.txt" || return 1
    kver=$(basename "$(ls -d "$tmp"/rootfs/usr/lib/modules/*)") || return 1
    for m in "${GUEST_DROP_MODULES[@]}"; do
        rm -rf "$tmp/rootfs/usr/lib/modules/$kver/kernel/$m"
    done
    chroot "$tmp/rootfs" depmod "$kver" || return 1
    cp "$tmp/rootfs/boot/vmlinuz-$kver" "$tmp/vmlinuz" || return 1
    cp "$tmp/rootfs/boot/initrd.img-$kver" "$tmp/initrd.img" || return 1
    rm -f "$tmp"/rootfs/boot/{vmlinuz,initrd.img,System.map}-*
    # Sparse: the file takes what the tree takes; 256 MiB spare for what the tests write to /.
    size_mib=$(($(du -sm "$tmp/rootfs" | cut -f1) + 256))
    mke2fs -q -t ext4 -L ferrosan-guest -E root_owner=0:0 -d "$tmp/rootfs" \
        "$tmp/root.img" "${size_mib}M" >/dev/null || return 1
    guest_rm_tree "$tmp/rootfs"
    echo "$kver" >"$tmp/kernel-version"
    touch "$tmp/ready"
}

# guest_versions: the kernel and the versions of the tested packages in the image, one line.
guest_versions() {
    local p v out
    out="kernel $(cat "$GUEST_DIR/kernel-version")"
    for p in open-iscsi multipath-tools sg3-utils fio nvme-cli lvm2 ktls-utils; do
        v=$(awk -v p="$p" '$1 == p { print $2 }' "$GUEST_DIR/packages.txt" 2>/dev/null)
        out+=", $p ${v:-?}"
    done
    echo "$out"
}

# guest_start SHARE CONSOLE REPORT [MEM_MIB]: boot the guest in the background; GUEST_PID.
# Returns once the guest's init has started. A boot that does not get there is the emulator's,
# not a check's (no check has run yet), and the guest is booted once more: a kernel that dies
# before its init runs (under TCG bookworm-backports' 6.12.95 panicked on an int3 oops in
# sched_clock_cpu while booting, once in the test command of 2026-12-02), and a boot that
# reaches no init within GUEST_BOOT_WAIT_S (300 s; boots take 14-50 s here, and one wrote
# nothing at all for 600 s in the test command of 2026-12-06, the next boot of the same image
# going through). The first console is kept as CONSOLE.boot-1. After a second such boot it
# returns anyway: the caller's own time limit ends the step.
guest_start() {
    local attempt why
    for attempt in 1 2; do
        guest_qemu "$@"
        why=$(guest_booted "$2") && return 0
        ((attempt == 2)) && return 0
        stop_pid "$GUEST_PID" 20
        cp "$2" "$2.boot-$attempt"
        log "$why (console: $2.boot-$attempt): booting it once more"
    done
}

# guest_booted CONSOLE: true once the guest's init has written its first line; otherwise false,
# saying why, once QEMU ended before it did or GUEST_BOOT_WAIT_S went by without it.
guest_booted() {
    local console=$1 waited=0 limit=${GUEST_BOOT_WAIT_S:-300}
    while kill -0 "$GUEST_PID" 2>/dev/null; do
        grep -q '^init: ' "$console" 2>/dev/null && return 0
        if ((waited++ >= limit * 2)); then
            echo "the guest's init did not start within $limit s"
            return 1
        fi
        sleep 0.5
    done
    grep -q '^init: ' "$console" 2>/dev/null && return 0
    echo "the guest's kernel died before its init ran"
    return 1
}

# guest_qemu SHARE CONSOLE REPORT [MEM_MIB]: one boot of the guest in the background.
guest_qemu() {
    local share=$1 console=$2 report=$3 mem=${4:-1024}
    [[ -n $GUEST_DIR ]] || die "guest_start before guest_image"
    : >"$console"
    : >"$report"
    # -nodefaults: no VGA, no default NIC, no floppy/CD: less to emulate and probe.
    # panic=1 with -no-reboot: a guest that crashes ends QEMU instead of hanging.
    qemu-system-x86_64 -accel "${FERROSAN_GUEST_ACCEL:-tcg}" -smp 2 -m "$mem" \
        -nodefaults -display none -no-reboot \
        -kernel "$GUEST_DIR/vmlinuz" -initrd "$GUEST_DIR/initrd.img" \
        -append "console=ttyS0 root=/dev/vda ro rootfstype=ext4 init=/sbin/ferrosan-init net.ifnames=0 panic=1 quiet" \
        -drive "file=$GUEST_DIR/root.img,if=virtio,format=raw,snapshot=on" \
        -netdev user,id=net0 -device virtio-net-pci,netdev=net0 \
        -virtfs "local,path=$share,mount_tag=host,security_model=none,readonly=on" \
        -serial "file:$console" -serial "file:$report" \
        </dev/null >"$console.qemu" 2>&1 &
    # shellcheck disable=SC2034 # for the script that sources this file
    GUEST_PID=$!
}
