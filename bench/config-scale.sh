#!/usr/bin/env bash
# How the control plane's time grows with the size of the config: one ferrosan daemon per N,
# started with a config of N file devices (the volumes of one directory pool, sparse 1 MiB
# files made beforehand), all mapped as LUNs 0..N-1 of one group of one target (as many as
# fit: LUN 16383 is the last); then it times, each ROUNDS times (one `ferrosan ctl` process a
# call, so a call's time includes starting ctl: the `status` row is that floor):
#
#   startup      spawn of `ferrosan serve` until `ctl status` answers (devices opened)
#   status       `ctl status`
#   luns         `ctl luns` (every LUN listed)
#   devices      `ctl device list` (every device's totals and LUN maps: what `ferrosan top`
#                asks each frame)
#   volumes      `ctl volume list` (every volume with its maps and exports: what a CSI
#                ListVolumes asks)
#   volume       `ctl volume list v00000` (one volume: what the CSI driver asks before a
#                snapshot or a capability check); fails unless it lists that one volume
#   report-luns  REPORT LUNS on a fresh session (bench/idle_sessions.py --probe; the median of
#                ROUNDS, each after its own login; its cpu_ms is not measured: 0)
#   idle         nothing for IDLE_S seconds (default 12: two of the space watch's checks) right
#                after the start-up's first check: its cpu_ms is the daemon's CPU per second
#                idle, its time the seconds idled
#   changed      as idle, but the IDLE_S seconds right after a `ctl volume create` (a topology
#                change, as a CSI create loop makes one every few seconds; the verb's own CPU
#                not counted)
#   create       `ctl volume create pool NAME 1M` (a new device, not mapped, not saved)
#   map          `ctl lun map TARGET g LUN NAME` of a volume made by `create` (not saved)
#   save         `ctl save` (the running config over the file)
#   create-save  `ctl volume create pool NAME 1M --save`
#   reload       one [[device]] appended to the file, then `ctl reload`
#
#   bench/config-scale.sh BIN [SIZES] [ROUNDS]
#
#   SIZES   space- or comma-separated device counts (default "10 1000 4000")
#   ROUNDS  calls per verb (default 3); the row gives the median, min and max
#   OPS=startup,reload   only these (comma-separated; default all of the above)
#   TAG=text             appended to the results file's name (e.g. a commit)
#   CACHE=page           the devices' `cache` (default: none given, "auto"); with "page" a
#                        device holds one descriptor, not two (16,000 devices in 20,000)
#   POOL=none            no [[pool]]: the files are devices of their own (the volume verbs
#                        then have no pool to work in)
# Results: bench/results/config-scale-DATE[-TAG].txt, one row per N and verb: the wall
# seconds of a call (median, min, max) and the daemon's CPU milliseconds a call took (its
# mean; /proc's clock ticks, so take many ROUNDS), which a busy machine leaves honest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LOG_TAG=config-scale
# shellcheck source=../scripts/lib/common.sh
source scripts/lib/common.sh

BIN=${1:?usage: bench/config-scale.sh BIN [SIZES] [ROUNDS]}
SIZES=${2:-10 1000 4000}
SIZES=${SIZES//,/ }
ROUNDS=${3:-3}
OPS=${OPS:-startup,idle,changed,status,luns,devices,volumes,volume,report-luns,create,map,save,create-save,reload}
IDLE_S=${IDLE_S:-12}
IQN=iqn.2026-12.org.ferrosan:scale
# A daemon holding 16,000 devices may take long to stop.
STOP_GRACE=300
scratch /var/tmp/ferrosan-config-scale.XXXXXX
PID=""

wants() { [[ ,$OPS, == *,$1,* ]]; }
now() { echo "${EPOCHREALTIME/./}"; } # microseconds
ctl() { "$BIN" ctl --socket "$WORK/ctl.sock" "$@"; }
# timed LABEL CMD...: runs CMD, appends its seconds to $WORK/t.LABEL; dies if it fails.
# Also appends the daemon's CPU ticks (user and system) the call took to $WORK/c.LABEL: on a
# busy machine the wall time is noise's, the daemon's CPU time is the verb's.
timed() {
    local label=$1 t0 t1 c0 c1
    shift
    c0=$(cpu_ticks)
    t0=$(now)
    "$@" >"$WORK/out" 2>&1 || die "$label: $* failed: $(tail -5 "$WORK/out")"
    t1=$(now)
    c1=$(cpu_ticks)
    awk -v d=$((t1 - t0)) 'BEGIN { printf "%.6f\n", d / 1e6 }' >>"$WORK/t.$label"
    echo $((c1 - c0)) >>"$WORK/c.$label"
}
# cpu_ticks: the daemon's CPU so far, in clock ticks (0 before it runs).
cpu_ticks() {
    if [[ -n $PID && -r /proc/$PID/stat ]]; then ticks "$PID"; else echo 0; fi
}
# row N LABEL: median, min and max of the times taken, into the results.
row() {
    [[ -s $WORK/t.$2 ]] || return 0
    local cpu_ms
    cpu_ms=$(awk -v tick="$HZ" '{ s += $1 } END { printf "%.2f", NR ? s * 1000 / tick / NR : 0 }' "$WORK/c.$2" 2>/dev/null || echo 0)
    sort -g "$WORK/t.$2" | awk -v n="$1" -v l="$2" -v cpu="$cpu_ms" '
        { t[NR] = $1 }
        END { printf "%-6s %-12s %10.6f %10.6f %10.6f %5d %9s\n", n, l, t[int((NR + 1) / 2)], t[1], t[NR], NR, cpu }' \
        | tee -a "$OUT"
    rm -f "$WORK/t.$2" "$WORK/c.$2"
}

# idled N LABEL: the daemon's CPU per second over IDLE_S seconds from now, as a row (its time
# the seconds idled; ticks over IDLE_S seconds as a rate: row's mean of one sample).
idled() {
    local c0 c1
    c0=$(cpu_ticks)
    sleep "$IDLE_S"
    c1=$(cpu_ticks)
    echo "$IDLE_S" >"$WORK/t.$2"
    awk -v d=$((c1 - c0)) -v s="$IDLE_S" 'BEGIN { printf "%.2f\n", d / s }' >"$WORK/c.$2"
    row "$1" "$2"
}

# config N: the config file of N devices in the pool (all mapped that fit), on stdout.
config() {
    local n=$1 port=$2 i last=$(($1 < 16384 ? $1 : 16384)) cache=""
    [[ -n ${CACHE:-} ]] && cache="cache = \"$CACHE\""$'\n'
    cat <<CONFIG
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$port"]

CONFIG
    # POOL=none: the same files as devices of their own, outside any pool.
    [[ ${POOL:-} == none ]] || printf '[[pool]]\nname = "pool"\npath = "%s/pool"\n\n' "$WORK"
    for ((i = 0; i < n; i++)); do
        printf '[[device]]\nname = "v%05d"\nstore = "file"\npath = "%s/pool/v%05d.img"\nsize = "1M"\n%s\n' \
            "$i" "$WORK" "$i" "$cache"
    done
    printf '[[target]]\niqn = "%s"\n\n  [[target.group]]\n  name = "g"\n  any_initiator = true\n  luns = [\n' "$IQN"
    for ((i = 0; i < last; i++)); do
        printf '    { lun = %d, device = "v%05d" },\n' "$i" "$i"
    done
    printf '  ]\n'
}

OUT=bench/results/config-scale-$(date +%Y-%m-%d-%H%M)${TAG:+-$TAG}.txt
{
    echo "# bench/config-scale.sh $(date -u +%FT%TZ): bin=$BIN sizes=$SIZES rounds=$ROUNDS ops=$OPS cache=${CACHE:-auto}"
    echo "# checkout at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') (BIN may be another build); $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg); work dir on $(df --output=fstype "$WORK" | tail -1)"
    echo "# N      verb           median_s      min_s      max_s calls  cpu_ms (the daemon's, a call's mean)"
} >"$OUT"
for n in $SIZES; do
    rm -rf "$WORK/pool" "$WORK/state" "$WORK/ctl.sock"
    mkdir -p "$WORK/pool" "$WORK/state"
    # Sparse files, many per truncate.
    (cd "$WORK/pool" && seq -f 'v%05g.img' 0 $((n - 1)) | xargs truncate -s 1M)
    # A file device holds two descriptors with direct I/O (cache "auto" on a disk), one with
    # the page cache.
    per=2
    [[ ${CACHE:-} == page ]] && per=1
    if (($(ulimit -n) < per * n + 512)); then
        log "N=$n: $((per * n)) descriptors for the devices and a limit of $(ulimit -n): the start may fail (CACHE=page halves the need)"
    fi
    port=$(free_port)
    config "$n" "$port" >"$WORK/ferrosan.toml"
    log "N=$n: $(wc -c <"$WORK/ferrosan.toml") bytes of config"
    t0=$(now)
    start_daemon_ctl daemon "$WORK/ctl.sock" "$BIN" serve --config "$WORK/ferrosan.toml" \
        --control-socket "$WORK/ctl.sock" --state-dir "$WORK/state"
    t1=$(now)
    if wants startup; then
        awk -v d=$((t1 - t0)) 'BEGIN { printf "%.6f\n", d / 1e6 }' >"$WORK/t.startup"
        cpu_ticks >"$WORK/c.startup"
        row "$n" startup
    fi
    if wants idle; then
        # The space watch's first check (5 s after the start) walks every device once.
        sleep 6
        idled "$n" idle
    fi
    if wants changed; then
        ctl volume create pool changed 1M >/dev/null
        idled "$n" changed
    fi
    # Before the verbs below add LUNs: the config's own N.
    if wants luns; then
        for ((r = 0; r < ROUNDS; r++)); do timed luns ctl luns; done
        row "$n" luns
    fi
    if wants devices; then
        for ((r = 0; r < ROUNDS; r++)); do timed devices ctl device list; done
        row "$n" devices
    fi
    if wants volumes; then
        for ((r = 0; r < ROUNDS; r++)); do timed volumes ctl volume list; done
        row "$n" volumes
    fi
    if wants volume; then
        for ((r = 0; r < ROUNDS; r++)); do timed volume ctl --json volume list v00000; done
        listed=$(python3 -c 'import json,sys; print(",".join(v["volume"] for v in json.load(sys.stdin)["volumes"]))' <"$WORK/out")
        [[ $listed == v00000 ]] || die "N=$n: volume list v00000 listed \"$listed\", not that one volume"
        row "$n" volume
    fi
    if wants report-luns; then
        # A fresh login each round, then REPORT LUNS: the median of the REPORT LUNS alone.
        python3 bench/idle_sessions.py "127.0.0.1:$port" "$IQN" --probe "$ROUNDS" >"$WORK/probe" ||
            die "N=$n: the REPORT LUNS probe failed"
        luns=$(awk '$1 == "report_luns" { print $7 }' "$WORK/probe")
        ((luns == (n < 16384 ? n : 16384))) || die "N=$n: REPORT LUNS listed $luns LUNs"
        awk '$1 == "report_luns" { printf "%.6f\n", $3 / 1000 }' "$WORK/probe" >"$WORK/t.report-luns"
        echo 0 >"$WORK/c.report-luns"
        row "$n" report-luns
    fi
    for ((r = 0; r < ROUNDS; r++)); do
        wants status && timed status ctl status
        if wants create || wants map; then
            timed create ctl volume create pool "new$r" 1M
        fi
        wants map && timed map ctl lun map "$IQN" g $((16384 - ROUNDS + r)) "new$r"
    done
    row "$n" status
    wants create && row "$n" create
    wants map && row "$n" map
    if wants save; then
        timed save ctl save
        row "$n" save
    fi
    if wants create-save; then
        for ((r = 0; r < ROUNDS; r++)); do
            timed create-save ctl volume create pool "saved$r" 1M --save
        done
        row "$n" create-save
    fi
    if wants reload; then
        # Whatever is unsaved goes into the file, the base of the reloads (a reload is refused
        # while there are unsaved changes).
        if wants create || wants map; then
            ctl save >/dev/null
        fi
        for ((r = 0; r < ROUNDS; r++)); do
            truncate -s 1M "$WORK/pool/added$r.img"
            printf '\n[[device]]\nname = "added%d"\nstore = "file"\npath = "%s/pool/added%d.img"\nsize = "1M"\n' \
                "$r" "$WORK" "$r" >>"$WORK/ferrosan.toml"
            timed reload ctl reload
        done
        row "$n" reload
    fi
    stop_spawned "$PID"
    PID=""
done
log "results: $OUT"
