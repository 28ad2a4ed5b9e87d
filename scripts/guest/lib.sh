# shellcheck shell=bash
# Helpers the guest's test scripts share (scripts/guest/kernel-*.sh). The host script copies
# this file beside main.sh into the share (/host/lib.sh); main.sh sources it.

# report LINE: a line to the host (the report channel, $REPORT) and to the console.
report() {
    printf '%s\n' "$*" >"$REPORT"
    printf '>>> %s\n' "$*"
}

# wait_until SECONDS CMD...: poll CMD every half second.
wait_until() {
    local secs=$1 i
    shift
    for ((i = 0; i < secs * 2; i++)); do
        "$@" && return 0
        sleep 0.5
    done
    return 1
}

# nvme_ctrl PORT: the controller (nvmeN) connected to HOST_ADDR:PORT.
nvme_ctrl() {
    local c addr
    for c in /sys/class/nvme/nvme*; do
        addr=$(cat "$c/address" 2>/dev/null) || continue
        [[ $addr == *"traddr=$HOST_ADDR,"*"trsvcid=$1"* ]] || continue
        echo "${c##*/}"
        return 0
    done
    return 1
}

# nvme_head: the namespace's head device (native multipath: nvmeXn1; its paths nvmeXcYn1
# are hidden).
nvme_head() {
    local b n
    for b in /sys/block/nvme*n1; do
        [[ -e $b ]] || continue
        n=${b##*/}
        [[ $n == *c* ]] && continue
        echo "$n"
        return 0
    done
    return 1
}

# nvme_path CTRL: the namespace's path device through controller CTRL (nvmeXcYn1).
nvme_path() {
    local p
    for p in /sys/block/nvme*c"${1#nvme}"n1; do
        [[ -e $p ]] && echo "${p##*/}" && return 0
    done
    return 1
}
