#!/usr/bin/env bash
# What idle RBD images cost a gateway pair: for each count N, two gateways (`serve --gateway
# a|b`) of one config with N images as LUNs of one group, no host I/O; 15 s after both start,
# the OSD's write, read and total operations per second over 10 s (its perf counters), and
# each gateway's threads and RSS. Then gateway a, the owner of every image (it starts first),
# is SIGKILLed, and the time until b owns the first image and every image is taken from b's
# metrics (`ferrosan_gateway_owner`), polled every 100 ms. One line per count.
#
#   bench/rbd-images.sh BIN [COUNT...]     # default counts: 1 8 32
#
# Starts a single-node cluster of its own (scripts/ceph-single-node.sh), stopped at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=rbd-images
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"
BIN=${1:?usage: $0 BIN [COUNT...]}
shift
COUNTS=("${@:-1 8 32}")
read -r -a COUNTS <<<"${COUNTS[*]}"
scratch /var/tmp/ferrosan-rbd-images.XXXXXX
on_exit '"$ROOT/scripts/ceph-single-node.sh" stop "$WORK/ceph"'
PIDS=()
"$ROOT/scripts/ceph-single-node.sh" start "$WORK/ceph" 4 >/dev/null
export CEPH_CONF=$WORK/ceph/ceph.conf
max=0
for n in "${COUNTS[@]}"; do ((n > max)) && max=$n; done
for ((i = 1; i <= max; i++)); do rbd create --size 16M "rbd/img$i"; done
declare -A metrics
# owned G: how many images gateway G's metrics say it owns.
owned() {
    python3 -c "
import urllib.request
text = urllib.request.urlopen('http://127.0.0.1:${metrics[$1]}/metrics', timeout=5).read().decode()
print(sum(1 for l in text.splitlines() if l.startswith('ferrosan_gateway_owner{') and l.endswith(' 1')))"
}
# takeover N: SIGKILLs gateway a (owning all N images), then the seconds until b owns the
# first image and all of them.
takeover() {
    local n=$1 first="" start now got
    [[ $(owned a) == "$n" ]] || { echo "gateway a owns $(owned a) of $n images" >&2; exit 1; }
    start=$(date +%s.%N)
    kill -KILL "${PIDS[0]}"
    while :; do
        got=$(owned b)
        now=$(date +%s.%N)
        [[ -z $first && $got -gt 0 ]] && first=$(echo "$now - $start" | bc)
        ((got == n)) && break
        (($(echo "$now - $start > 300" | bc))) && { echo "b owns $got of $n after 300 s" >&2; exit 1; }
        sleep 0.1
    done
    printf '; takeover after SIGKILL: first image %.1f s, all %.1f s' "$first" "$(echo "$now - $start" | bc)"
}
ops() {
    ceph --admin-daemon "$WORK/ceph/run/ceph-osd.0.asok" perf dump |
        python3 -c 'import json,sys; d=json.load(sys.stdin)["osd"]; print(d["op_w"], d["op_r"], d["op"])'
}
for n in "${COUNTS[@]}"; do
    {
        printf '[[portal_group]]\ntag = 1\nlisten = ["127.0.0.1:%s"]\ngateway = "a"\n\n' "$(free_port)"
        printf '[[portal_group]]\ntag = 2\nlisten = ["127.0.0.1:%s"]\ngateway = "b"\n\n' "$(free_port)"
        for ((i = 1; i <= n; i++)); do
            printf '[[device]]\nname = "v%d"\nstore = "rbd"\nimage = "rbd/img%d"\nceph_conf = "%s"\n\n' \
                "$i" "$i" "$CEPH_CONF"
        done
        printf '[[target]]\niqn = "iqn.2026-12.org.ferrosan:images"\n  [[target.group]]\n'
        printf '  name = "g"\n  any_initiator = true\n  luns = [\n'
        for ((i = 1; i <= n; i++)); do printf '    { lun = %d, device = "v%d" },\n' $((i - 1)) "$i"; done
        printf '  ]\n'
    } >"$WORK/gw.toml"
    PIDS=()
    for g in a b; do
        metrics[$g]=$(free_port)
        spawn "$WORK/$g.log" "$BIN" serve --config "$WORK/gw.toml" --gateway "$g" \
            --control-socket "$WORK/$g.sock" --metrics-listen "127.0.0.1:${metrics[$g]}"
        PIDS+=("$SPAWNED")
        sleep 6
    done
    sleep 9
    before=$(ops)
    sleep 10
    after=$(ops)
    line=$(python3 -c "
a, b = '$before'.split(), '$after'.split()
print('%s images: OSD writes %.1f/s, reads %.1f/s, ops %.1f/s' % (('$n',) + tuple((int(y) - int(x)) / 10 for x, y in zip(a, b))))")
    for k in 0 1; do
        pid=${PIDS[$k]}
        kill -0 "$pid" || { tail -5 "$WORK/$([[ $k == 0 ]] && echo a || echo b).log" >&2; exit 1; }
        line+="; gateway $([[ $k == 0 ]] && echo a || echo b): $(awk '/^Threads/{print $2}' "/proc/$pid/status") threads,"
        line+=" $(awk '/^VmRSS/{print $2}' "/proc/$pid/status") KiB RSS"
    done
    line+=$(takeover "$n")
    echo "$line"
    for pid in "${PIDS[@]}"; do stop_spawned "$pid"; done
    PIDS=()
done
