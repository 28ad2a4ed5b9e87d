#!/usr/bin/env bash
# How much of the local device survives the target? One file or block device, measured side by
# side in one run with the same client (fio):
#
#   local        fio --ioengine=libaio --direct=1 on DEV itself
#   local-dsync  the same with --sync=dsync (O_DIRECT|O_DSYNC), for the workloads that write:
#                the local equivalent of a write-through LUN
#   ferrosan     ferrosan serve --lun file:DEV (block:DEV for a block device), default settings
#                (write-through), fio's libiscsi engine against iscsi://127.0.0.1:PORT/IQN/0
#   tgt-rdwr     tgtd (Debian tgt), rdwr backing store (buffered pread/pwrite) on DEV
#   tgt-aio      tgtd, aio backing store (libaio, O_DIRECT) on DEV
#   ferrosan-nvme  the same ferrosan daemon through its NVMe/TCP door (namespace 1 of the
#                target's NQN); CLIENT=bench only (fio has no NVMe/TCP engine of its own)
#
#   DEV=/path/to/file-or-device bench/device.sh
#
# Environment:
#   DEV              file or block device (required). A regular file that does not exist is
#                    created with SIZE bytes by writing it whole from /dev/urandom (fallocated or
#                    sparse extents would never reach the device) and left in place for the next
#                    run. An existing file or device is used as it is: the write workloads
#                    overwrite it.
#   SIZE             size of a file to create (default 4G; K/M/G/T are binary units)
#   SECONDS_PER_RUN  measured seconds per fio run (default 20), after RAMP seconds of ramp
#   RAMP             ramp seconds, not measured (default 5 if SECONDS_PER_RUN >= 20, else about
#                    a quarter of it)
#   ROUNDS           repetitions of the whole interleaved sequence (default 1); the table shows
#                    the median over rounds, the JSON every run
#   TAG              name part of the result file (default: DEV's base name)
#   WORKLOADS        comma-separated subset of: randread-qd1 randread-qd64 randwrite-qd64
#                    randrw70-qd64 seqread-qd16 seqwrite-qd16 (default: all)
#   TARGETS          comma-separated subset of: local ferrosan ferrosan-nvme tgt-rdwr tgt-aio (default: all;
#                    local includes local-dsync for the workloads that write)
#   TGT_WCE          0 (default): tgt's LUs get caching mode page 8 with WCE=0, so rdwr does
#                    fdatasync after every write -- write-through like ferrosan's default LUN.
#                    1: tgt's own default, WCE=1 (rdwr writes stay in the page cache). The aio
#                    store ignores WCE: it writes O_DIRECT and never flushes.
#   WRITE_OK=1       required when DEV is a block device and a selected workload writes
#   FERROSAN         ferrosan binary (default $FERROSAN_BIN, else release/ferrosan under the cargo target directory; this
#                    script never builds it)
#   CLIENT           fio (default) or bench: the client for every row. bench is ferrosan's own
#                    (`ferrosan bench`: 1 µs of client CPU per I/O where fio's libiscsi engine
#                    spends ~7, so on a small machine it shows the targets rather than the
#                    client); local rows then use its O_DIRECT engine (io_uring; RWF_DSYNC for
#                    local-dsync) instead of fio's libaio. Workloads, order, windows and CPU
#                    sampling are the same.
#   FIO              fio with both the libiscsi and libaio engines (default: what
#                    bench/fio-libiscsi.sh prints; libaio-dev is installed first if it must build)
#   OUT              result directory (default bench/results)
#
# Every run: page cache dropped first (sync; echo 3 > /proc/sys/vm/drop_caches), so this needs
# root. Order: for each round, for each workload, each target in turn (reversed on even rounds).
# Per run: IOPS, MB/s (10^6 B), mean and p99 total latency (fio lat_ns, submission to
# completion), CPU per I/O. For a target: utime+stime of the target process (/proc/PID/stat
# fields 14+15, all threads), sampled at the end of the ramp and again just before the runtime
# ends, so that the window lies inside fio's measured one (ramp, login and logout excluded);
# CPU seconds per second ÷ I/Os per second (total_ios ÷ runtime). The JSON also keeps the
# whole-run delta (launch to exit) ÷ total_ios, which overstates it by the ramp. For local
# rows: fio's own usr_cpu+sys_cpu over its runtime ÷ total_ios. dev-rd% is the share of the
# bytes fio read that the target read from storage (Δ read_bytes of /proc/PID/io over the same
# window, as a rate): below 100, page-cache hits (ferrosan and tgt-rdwr read buffered).
# Output: a table on stdout, every row in bench/results/device-DATE-TAG.json. Daemons are
# started on free loopback ports and stopped by PID on exit.
#
# Charts: `bench/device_charts.py RESULTS.json [OUTDIR]` renders two SVGs next to the JSON (or
# into OUTDIR): device-DATE-TAG.vs-local.svg, each target's median IOPS over local's (over
# local-dsync's for the workloads that write), with lines at 1.0 and at issue #17's 0.85; and
# device-DATE-TAG.cpu.svg, the target CPU µs per I/O above (cpu_us_per_io), on a log scale.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$PATH:/usr/sbin:/sbin"

# shellcheck disable=SC2034 # read by common.sh's log
LOG_TAG=device
# log, die, free_port, wait_port, stop_pid: the test scripts' own helpers.
# shellcheck source=scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"

ALL_WORKLOADS=(randread-qd1 randread-qd64 randwrite-qd64 randrw70-qd64 seqread-qd16 seqwrite-qd16)
ALL_TARGETS=(local ferrosan ferrosan-nvme tgt-rdwr tgt-aio)
IQN=iqn.2026-11.org.ferrosan:device
NQN=nqn.2026-11.org.ferrosan:device # the quick export's NQN for IQN
CLIENT_IQN=iqn.2026-11.org.ferrosan:device-client
# tgt's default caching mode page (usr/sbc.c) with WCE (byte 0, bit 2) cleared: 0x14 -> 0x10
TGT_PAGE8_WT=8:0:18:0x10:0:0xff:0xff:0:0:0xff:0xff:0xff:0xff:0x80:0x14:0:0:0:0:0:0

DEV=${DEV:-}
SIZE=${SIZE:-4G}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-20}
ROUNDS=${ROUNDS:-1}
WORKLOADS=${WORKLOADS:-$(IFS=,; echo "${ALL_WORKLOADS[*]}")}
TARGETS=${TARGETS:-$(IFS=,; echo "${ALL_TARGETS[*]}")}
TGT_WCE=${TGT_WCE:-0}
WRITE_OK=${WRITE_OK:-0}
CLIENT=${CLIENT:-fio}
OUT=${OUT:-$ROOT/bench/results}
FERROSAN=${FERROSAN:-${FERROSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ferrosan}}

# ------------------------------------------------------------------ checks
[[ -n $DEV ]] || die "set DEV=/path/to/file-or-device (see the header of $0)"
[[ $SECONDS_PER_RUN =~ ^[1-9][0-9]*$ ]] || die "SECONDS_PER_RUN must be a positive integer"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
RAMP=${RAMP:-$((SECONDS_PER_RUN >= 20 ? 5 : (SECONDS_PER_RUN + 3) / 4))}
[[ $RAMP =~ ^[1-9][0-9]*$ ]] || die "RAMP must be a whole number of seconds, at least 1"
[[ $TGT_WCE == 0 || $TGT_WCE == 1 ]] || die "TGT_WCE must be 0 or 1"
[[ $CLIENT == fio || $CLIENT == bench ]] || die "CLIENT must be fio or bench"
[[ $(id -u) -eq 0 ]] || die "needs root (drop_caches, tgtd)"
[[ -x $FERROSAN ]] || die "no ferrosan binary at $FERROSAN (set FERROSAN=...; this script does not build it)"
for cmd in python3 tgtd tgtadm dd numfmt; do
    command -v "$cmd" >/dev/null || die "missing $cmd (apt-get install tgt coreutils python3)"
done
TAG=${TAG:-$(basename "$DEV")$(if [[ $CLIENT == bench ]]; then echo -bench; fi)}
TAG=$(tr -c 'A-Za-z0-9._\n-' '_' <<<"$TAG")

IFS=, read -ra SEL_W <<<"$WORKLOADS"
IFS=, read -ra SEL_T <<<"$TARGETS"
for w in "${SEL_W[@]}"; do
    [[ " ${ALL_WORKLOADS[*]} " == *" $w "* ]] || die "unknown workload '$w' (known: ${ALL_WORKLOADS[*]})"
done
for t in "${SEL_T[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || die "unknown target '$t' (known: ${ALL_TARGETS[*]})"
done
((${#SEL_W[@]})) || die "WORKLOADS is empty"
((${#SEL_T[@]})) || die "TARGETS is empty"
want_target() { [[ " ${SEL_T[*]} " == *" $1 "* ]]; }
if want_target ferrosan-nvme && [[ $CLIENT != bench ]]; then
    die "target ferrosan-nvme needs CLIENT=bench (fio has no NVMe/TCP engine of its own)"
fi

# name -> "rw bs iodepth extra-fio-option"
workload_spec() {
    case $1 in
        randread-qd1) echo "randread 4k 1 -" ;;
        randread-qd64) echo "randread 4k 64 -" ;;
        randwrite-qd64) echo "randwrite 4k 64 -" ;;
        randrw70-qd64) echo "randrw 4k 64 --rwmixread=70" ;;
        seqread-qd16) echo "read 1M 16 -" ;;
        seqwrite-qd16) echo "write 1M 16 -" ;;
    esac
}
writes() { [[ $(workload_spec "$1") == *write* || $(workload_spec "$1") == randrw* ]]; }
bench_id() { # the same workload in `ferrosan bench`'s plan
    case $1 in
        randread-qd1) echo randread-4k-qd1 ;;
        randread-qd64) echo randread-4k-qd64 ;;
        randwrite-qd64) echo randwrite-4k-qd64 ;;
        randrw70-qd64) echo randrw70-4k-qd64 ;;
        seqread-qd16) echo seqread-1m-qd16 ;;
        seqwrite-qd16) echo seqwrite-1m-qd16 ;;
    esac
}
ANY_WRITES=0
for w in "${SEL_W[@]}"; do if writes "$w"; then ANY_WRITES=1; fi; done

# ------------------------------------------------------------------ the device
CREATED=0
if [[ -b $DEV ]]; then
    KIND="block"
    LUNSPEC=block:$DEV
    if ((ANY_WRITES)) && [[ $WRITE_OK != 1 ]]; then
        die "$DEV is a block device and the selected workloads write to it: set WRITE_OK=1 to destroy its contents"
    fi
    if lsblk -nro MOUNTPOINT "$DEV" 2>/dev/null | grep -q .; then
        die "$DEV (or a partition of it) is mounted"
    fi
    BYTES=$(blockdev --getsize64 "$DEV")
elif [[ -e $DEV && ! -f $DEV ]]; then
    die "$DEV is neither a regular file nor a block device"
else
    KIND="file"
    LUNSPEC=file:$DEV
    DIR=$(dirname "$DEV")
    [[ -d $DIR ]] || die "no directory $DIR"
    case $(stat -f -c %T "$DIR") in
        tmpfs | ramfs) die "$DIR is $(stat -f -c %T "$DIR"): use a file on a disk filesystem or a block device" ;;
    esac
    if [[ ! -e $DEV ]]; then
        want=$(numfmt --from=iec "$SIZE") || die "SIZE=$SIZE: not a size"
        ((want >= 64 * 1048576 && want % 1048576 == 0)) || die "SIZE must be a multiple of 1 MiB, at least 64M"
        log "creating $DEV: $SIZE written from /dev/urandom (every block really allocated and written)"
        dd if=/dev/urandom of="$DEV" bs=1M count=$((want / 1048576)) iflag=fullblock conv=fsync status=none
        CREATED=1
    fi
    BYTES=$(stat -c %s "$DEV")
    read -r blocks bsize < <(stat -c '%b %B' "$DEV")
    if ((blocks * bsize < BYTES)); then
        log "warning: $DEV is sparse ($((blocks * bsize / 1048576)) of $((BYTES / 1048576)) MiB allocated): reads of holes never reach the device"
    fi
fi
BYTES=$((BYTES / 1048576 * 1048576))
((BYTES >= 64 * 1048576)) || die "$DEV is smaller than 64 MiB"
FSTYPE=$(if [[ $KIND == file ]]; then findmnt -no FSTYPE -T "$DEV" 2>/dev/null || true; fi)
log "DEV $DEV ($KIND${FSTYPE:+ on $FSTYPE}, $((BYTES / 1048576)) MiB used), ${SECONDS_PER_RUN}s runs after ${RAMP}s ramp, $ROUNDS round(s)"

# ------------------------------------------------------------------ fio
if [[ $CLIENT == fio ]]; then
    FIO_BIN=${FIO:-}
    if [[ -z $FIO_BIN ]]; then
        has_iscsi() { [[ -x $1 ]] && "$1" --enghelp 2>/dev/null | grep -qw libiscsi; }
        if ! has_iscsi "$(command -v fio || true)" && ! has_iscsi "$ROOT/target/bench-tools/fio" \
            && [[ ! -e /usr/include/libaio.h ]]; then
            # bench/fio-libiscsi.sh is about to build fio: with libaio.h it gets the libaio engine too
            log "installing libaio-dev so that the fio bench/fio-libiscsi.sh builds has the libaio engine"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >&2
        fi
        FIO_BIN=$("$ROOT/bench/fio-libiscsi.sh") || die "no fio with the libiscsi engine (bench/fio-libiscsi.sh)"
    fi
    ENGINES=$("$FIO_BIN" --enghelp 2>/dev/null || true)
    grep -qw libiscsi <<<"$ENGINES" || die "$FIO_BIN has no libiscsi engine"
    if ! grep -qw libaio <<<"$ENGINES"; then
        die "$FIO_BIN has no libaio engine (built without libaio.h): apt-get install libaio-dev," \
            "rm $ROOT/target/bench-tools/fio and run again (bench/fio-libiscsi.sh rebuilds it), or set FIO=..."
    fi
    log "fio: $FIO_BIN ($("$FIO_BIN" --version))"
else
    FIO_BIN=none
    log "client: $FERROSAN bench"
fi

# ------------------------------------------------------------------ processes and cleanup
WORK=$(mktemp -d /tmp/ferrosan-device.XXXXXX)
STARTED=()   # PIDs of the daemons this script started
declare -A GRACE_OF # tenths of a second between TERM and KILL, per started PID
FIO_PID=""
FAILED=0

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $FIO_PID ]]; then stop_pid "$FIO_PID" 20; fi
    local i
    for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
        stop_pid "${STARTED[i]}" "${GRACE_OF[${STARTED[i]}]:-30}"
    done
    if ((rc == 0 && FAILED == 0)); then
        rm -rf "$WORK"
    else
        log "daemon logs and fio output kept in $WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_listening() { # port pid name: common.sh's wait_port, with the daemon's log on failure
    wait_port "$1" "$2" 10 || die "$3: not listening on 127.0.0.1:$1: $(tail -n 5 "$WORK/$3.log")"
}

declare -A PID_OF PORT_OF LUN_OF DESC_OF
start_ferrosan() {
    local port nvme=() nport=0
    port=$(free_port)
    if want_target ferrosan-nvme; then
        nport=$(free_port)
        while [[ $nport == "$port" ]]; do nport=$(free_port); done
        nvme=(--nvme-listen "127.0.0.1:$nport")
    fi
    "$FERROSAN" serve --listen "127.0.0.1:$port" "${nvme[@]}" --target "$IQN" --lun "$LUNSPEC" \
        </dev/null >"$WORK/ferrosan.log" 2>&1 &
    local pid=$!
    STARTED+=("$pid")
    GRACE_OF[$pid]=50
    wait_listening "$port" "$pid" ferrosan
    local desc="ferrosan serve --lun $LUNSPEC (defaults: write-through; cache=auto, i.e. O_DIRECT on io_uring on a disk filesystem)"
    if want_target ferrosan; then
        PID_OF[ferrosan]=$pid
        PORT_OF[ferrosan]=$port
        LUN_OF[ferrosan]=0
        DESC_OF[ferrosan]=$desc
    fi
    if want_target ferrosan-nvme; then
        wait_listening "$nport" "$pid" ferrosan
        PID_OF[ferrosan-nvme]=$pid
        PORT_OF[ferrosan-nvme]=$nport
        LUN_OF[ferrosan-nvme]=1
        DESC_OF[ferrosan-nvme]="$desc, through NVMe/TCP ($NQN, namespace 1)"
    fi
}

start_tgt() { # name bstype
    local name=$1 bstype=$2 port ctl pid i
    port=$(free_port)
    ctl=$((1000 + port % 30000)) # private management socket, as bench.py
    tgtd -f -C "$ctl" --iscsi "portal=127.0.0.1:$port" </dev/null >"$WORK/$name.log" 2>&1 &
    pid=$!
    STARTED+=("$pid")
    GRACE_OF[$pid]=3 # tgtd -f ignores SIGTERM (as bench.py notes): KILL after 0.3 s
    PID_OF[$name]=$pid
    wait_listening "$port" "$pid" "$name"
    local adm=(tgtadm -C "$ctl" --lld iscsi --op)
    for ((i = 0; i < 50; i++)); do
        if "${adm[@]}" new --mode target --tid 1 -T "$IQN" >/dev/null 2>&1; then break; fi
        sleep 0.1
    done
    "${adm[@]}" new --mode logicalunit --tid 1 --lun 1 --bstype "$bstype" --backing-store "$DEV" \
        >>"$WORK/$name.log" 2>&1 || die "$name: tgtadm could not create the LU: $(tail -n 3 "$WORK/$name.log")"
    local cache="WCE=1 (tgt default)"
    if [[ $TGT_WCE == 0 ]]; then
        "${adm[@]}" update --mode logicalunit --tid 1 --lun 1 --params "mode_page=$TGT_PAGE8_WT" \
            >>"$WORK/$name.log" 2>&1 || die "$name: tgtadm could not clear WCE"
        cache="WCE=0"
    fi
    "${adm[@]}" bind --mode target --tid 1 -I ALL >>"$WORK/$name.log" 2>&1 || die "$name: tgtadm bind failed"
    PORT_OF[$name]=$port
    LUN_OF[$name]=1
    local version
    version=$(dpkg-query -W -f='${Version}' tgt 2>/dev/null || echo '?')
    case $bstype in
        rdwr)
            [[ $TGT_WCE == 1 ]] || cache+=": fdatasync after every write"
            DESC_OF[$name]="tgtd $version, rdwr backing store $DEV (buffered), $cache"
            ;;
        aio) DESC_OF[$name]="tgtd $version, aio backing store $DEV (O_DIRECT, never flushes), $cache" ;;
    esac
}

cpu_ticks() { # utime+stime of a process, all threads (/proc/PID/stat fields 14 and 15)
    local s f
    s=$(<"/proc/$1/stat")
    s=${s##*) }
    read -ra f <<<"$s"
    echo $((f[11] + f[12]))
}
read_bytes() { # bytes the process caused to be fetched from storage
    awk '/^read_bytes:/ {print $2}' "/proc/$1/io"
}

# ------------------------------------------------------------------ parsing and reporting
cat >"$WORK/report.py" <<'PY'
import json, os, statistics, sys

def tail(path, n=300):
    try:
        return open(path, errors="replace").read().strip()[-n:]
    except OSError:
        return ""

def row(a):
    """One fio run -> one JSON line.
    a: out err rc meta clk_tck dticks dread window_s window_ok dticks_whole"""
    out, err, rc, meta, tck, dticks, dread, window, window_ok, dwhole = a
    r = json.loads(meta)
    rc = int(rc)
    text = open(out, errors="replace").read()
    try:
        job = json.loads(text[text.index("{"):])["jobs"][0]  # a "note:" line may precede it
    except (ValueError, KeyError, IndexError):
        r.update(ok=False, error=f"fio exit {rc}, no JSON: {tail(err) or text[-300:]}")
        return r
    m = job.get("mixed") or job["read"]  # --unified_rw_reporting=both: 'mixed' sums both directions
    ios, secs = m["total_ios"], m["runtime"] / 1000
    if rc != 0 or job.get("error") or not ios or not secs:
        r.update(ok=False, error=f"fio exit {rc}, error {job.get('error')}, {ios} I/Os: {tail(err)}")
        return r
    lat = m["lat_ns"]
    pct = lat.get("percentile", {})
    fio_cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    r.update(ok=True, ios=ios, runtime_s=secs, iops=ios / secs, mbps=m["io_bytes"] / secs / 1e6,
             read_iops=job["read"]["total_ios"] / secs, write_iops=job["write"]["total_ios"] / secs,
             lat_mean_us=lat["mean"] / 1e3,
             lat_p50_us=pct.get("50.000000", 0) / 1e3, lat_p99_us=pct.get("99.000000", 0) / 1e3,
             lat_p999_us=pct.get("99.900000", 0) / 1e3,
             fio_cpu_s=fio_cpu_s, fio_cpu_us_per_io=fio_cpu_s / ios * 1e6)
    if r["target"].startswith("local"):
        r.update(cpu_source="fio", cpu_us_per_io=r["fio_cpu_us_per_io"], dev_read_pct=None)
    else:
        # CPU and storage reads over a window inside fio's measured one, as rates; per I/O =
        # CPU rate / I/O rate. The whole-run figure (launch to exit, ramp and login included,
        # divided by the measured I/Os) overstates it and is kept only as a cross-check.
        tcpu, win, tck = int(dticks) / int(tck), float(window), int(tck)
        ok = window_ok == "1" and win > 0
        rd_rate = job["read"]["io_bytes"] / secs
        r.update(cpu_source="target", target_window_s=win, target_window_ok=ok,
                 target_cpu_s=tcpu, target_cpu_pct=100 * tcpu / win if ok else None,
                 cpu_us_per_io=tcpu / win / r["iops"] * 1e6 if ok else None,
                 target_read_bytes=int(dread),
                 dev_read_pct=100 * int(dread) / win / rd_rate if ok and rd_rate else None,
                 target_cpu_whole_run_s=int(dwhole) / tck,
                 cpu_us_per_io_whole_run=int(dwhole) / tck / ios * 1e6)
    return r

def bench2fio(a):
    """A `ferrosan bench` results.json (one row) -> the parts of fio's JSON `row` reads."""
    src, dst, bs = a
    try:
        res = json.load(open(src))
        r = res["rows"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return  # no JSON for `row`: it reports the run as failed, with the client's stderr
    secs = res["runtime_s"]
    block = {"4k": 4096, "1M": 1 << 20}[bs]
    ios = r["iops"] * secs
    cpu_s = (r.get("client_cpu_us_per_io") or 0) * ios / 1e6
    lat = r["latency_us"]
    side = lambda iops: {"total_ios": round(iops * secs), "io_bytes": round(iops * secs) * block}
    job = {"error": 1 if r.get("errors") else 0,
           "usr_cpu": 100 * cpu_s / secs, "sys_cpu": 0.0, "job_runtime": secs * 1000,
           "read": side(r["read_iops"]), "write": side(r["write_iops"]),
           "mixed": {"total_ios": round(ios), "runtime": secs * 1000,
                     "io_bytes": r["mb_per_s"] * 1e6 * secs,
                     "lat_ns": {"mean": lat["mean"] * 1e3,
                                "percentile": {"50.000000": lat["p50"] * 1e3,
                                               "99.000000": lat["p99"] * 1e3,
                                               "99.900000": lat["p99_9"] * 1e3}}}}
    json.dump({"jobs": [job]}, open(dst, "w"))

def report(a):
    rows_path, out_path, meta_path = a
    rows = [json.loads(l) for l in open(rows_path) if l.strip()]
    meta = json.load(open(meta_path))
    keys = ("iops", "mbps", "lat_mean_us", "lat_p99_us", "cpu_us_per_io", "dev_read_pct")
    order_w = meta["workloads"]
    order_t = ["local", "local-dsync", "ferrosan", "ferrosan-nvme", "tgt-rdwr", "tgt-aio"]
    summary = []
    for w in order_w:
        med = {}
        for t in order_t:
            ok = [r for r in rows if r["workload"] == w and r["target"] == t and r["ok"]]
            bad = [r for r in rows if r["workload"] == w and r["target"] == t and not r["ok"]]
            if not ok and not bad:
                continue
            s = {"workload": w, "target": t, "runs": len(ok), "failed": len(bad)}
            for k in keys:
                v = [r[k] for r in ok if r.get(k) is not None]
                s[k] = statistics.median(v) if v else None
            med[t] = s
            summary.append(s)
        for t, s in med.items():
            for base in ("local", "local-dsync"):
                b = med.get(base, {}).get("iops")
                s["x_" + base.replace("-", "_")] = (s["iops"] / b) if (b and s["iops"] and t != base
                                                     and not t.startswith("local")) else None
    meta["rows"] = rows
    meta["summary"] = summary
    with open(out_path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    hdr = ("workload", "target", "IOPS", "MB/s", "mean µs", "p99 µs", "CPU µs/IO", "×local",
           "×dsync", "dev-rd%")
    lines = [hdr]
    for s in summary:
        if s["runs"] == 0:
            lines.append((s["workload"], s["target"], "FAILED") + ("",) * 7)
            continue
        cpu = num(s["cpu_us_per_io"], ".1f") + ("*" if s["target"].startswith("local") else "")
        lines.append((s["workload"], s["target"], num(s["iops"], ".0f"), num(s["mbps"], ".1f"),
                      num(s["lat_mean_us"], ".0f"), num(s["lat_p99_us"], ".0f"), cpu,
                      num(s.get("x_local"), ".2f"), num(s.get("x_local_dsync"), ".2f"),
                      num(s["dev_read_pct"], ".0f")))
    widths = [max(len(l[i]) for l in lines) for i in range(len(hdr))]
    for n, l in enumerate(lines):
        if n > 1 and l[0] != lines[n - 1][0]:
            print()
        print("  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(l)).rstrip())
    print(f"\nmedian of {meta['rounds']} round(s), {meta['seconds_per_run']} s each after a "
          f"{meta['ramp_seconds']} s ramp; DEV {meta['dev']['path']} ({meta['dev']['kind']}, "
          f"{meta['dev']['bytes'] // 1048576} MiB)")
    client = "fio" if meta.get("client", "fio") == "fio" else "ferrosan bench"
    print(f"client: {client} for every row")
    print(f"CPU µs/IO: target process (utime+stime) per I/O; * = local rows: {client}'s own CPU per I/O")
    print("×local, ×dsync: IOPS relative to local (O_DIRECT) and local-dsync (O_DIRECT|O_DSYNC)")
    print(f"dev-rd%: bytes the target read from storage / bytes {client} read (below 100: page-cache hits)")
    if any(not r["ok"] for r in rows):
        print("\nfailed runs:")
        for r in rows:
            if not r["ok"]:
                print(f"  round {r['round']} {r['workload']} {r['target']}: {r['error']}")

if __name__ == "__main__":
    if sys.argv[1] == "row":
        print(json.dumps(row(sys.argv[2:])))
    elif sys.argv[1] == "bench2fio":
        bench2fio(sys.argv[2:])
    else:
        report(sys.argv[2:])
PY

# ------------------------------------------------------------------ runs
esc() { local s=$1; echo "${s//:/\\:}"; } # fio splits --filename at ':'

drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
    # Back into the cache at once: the programs the CPU sampler runs during the window, and the
    # client's own binary. Left out, they are read from the device under test behind the
    # benchmark's I/O -- with 16 MiB of 1 MiB reads queued that took seconds, so the sampler
    # overslept the client's run and 1 MiB reads got no CPU figure.
    sleep 0
    awk 'BEGIN {}' </dev/null
    if [[ $CLIENT == fio ]]; then "$FIO_BIN" --version >/dev/null; else "$FERROSAN" --version >/dev/null; fi
}

RUN_N=0
CLK_TCK=$(getconf CLK_TCK)
SAMPLE_SECS=$(awk -v s="$SECONDS_PER_RUN" 'BEGIN { print (s > 1 ? s - 0.2 : s * 0.8) }')
run_one() { # round workload target
    local round=$1 w=$2 t=$3 rw bs qd extra
    read -r rw bs qd extra <<<"$(workload_spec "$w")"
    local args=(--name="$w" --rw="$rw" --bs="$bs" --iodepth="$qd" --size="$BYTES"
        --time_based --runtime="$SECONDS_PER_RUN" --ramp_time="$RAMP"
        --norandommap --randrepeat=0 --lat_percentiles=1 --unified_rw_reporting=both
        --output-format=json)
    [[ $extra == - ]] || args+=("$extra")
    case $t in
        local) args+=(--ioengine=libaio --direct=1 --filename="$(esc "$DEV")") ;;
        local-dsync) args+=(--ioengine=libaio --direct=1 --sync=dsync --filename="$(esc "$DEV")") ;;
        *) args+=(--ioengine=libiscsi --initiator="$CLIENT_IQN"
            --filename="$(esc "iscsi://127.0.0.1:${PORT_OF[$t]}/$IQN/${LUN_OF[$t]}")") ;;
    esac
    RUN_N=$((RUN_N + 1))
    local base="$WORK/run$RUN_N-$w-$t" pid=${PID_OF[$t]:-} rc=0 window_ok=0
    local w0=0 w1=0 c0=0 c1=0 r0=0 r1=0 t0=0 t1=0
    drop_caches
    if [[ -n $pid ]]; then w0=$(cpu_ticks "$pid"); fi
    if [[ $CLIENT == bench ]]; then
        local bargs=(bench --only "$(bench_id "$w")" --runtime "$SECONDS_PER_RUN" --ramp "$RAMP"
            --out "$base.d")
        # The daemons keep DEV open all along: the local writes go ahead anyway.
        if writes "$w"; then bargs+=(--destructive --even-if-open); fi
        case $t in
            local) bargs+=("$DEV") ;;
            local-dsync) bargs+=(--dsync "$DEV") ;;
            ferrosan-nvme) bargs+=("nvme+tcp://127.0.0.1:${PORT_OF[$t]}/$NQN/${LUN_OF[$t]}") ;;
            *) bargs+=(--initiator-name "$CLIENT_IQN"
                "iscsi://127.0.0.1:${PORT_OF[$t]}/$IQN/${LUN_OF[$t]}") ;;
        esac
        "$FERROSAN" "${bargs[@]}" >"$base.out" 2>"$base.err" &
    else
        "$FIO_BIN" "${args[@]}" >"$base.json" 2>"$base.err" &
    fi
    FIO_PID=$!
    if [[ -n $pid ]]; then
        # Sample the target inside fio's measured window: from the end of the ramp (fio counts
        # no I/O before it) to just before the runtime ends (fio's start-up -- fork, login --
        # shifts its window later than ours, never earlier).
        sleep "$RAMP"
        c0=$(cpu_ticks "$pid"); r0=$(read_bytes "$pid"); t0=$EPOCHREALTIME
        sleep "$SAMPLE_SECS"
        c1=$(cpu_ticks "$pid"); r1=$(read_bytes "$pid"); t1=$EPOCHREALTIME
        if kill -0 "$FIO_PID" 2>/dev/null; then window_ok=1; fi
    fi
    wait "$FIO_PID" || rc=$?
    FIO_PID=""
    if [[ $CLIENT == bench ]]; then
        python3 "$WORK/report.py" bench2fio "$base.d/results.json" "$base.json" "$bs" || true
    fi
    if [[ -n $pid ]]; then
        kill -0 "$pid" 2>/dev/null || die "$t exited during $w: $(tail -n 5 "$WORK/$t.log")"
        w1=$(cpu_ticks "$pid")
    fi
    local meta line
    meta=$(printf '{"round": %d, "workload": "%s", "target": "%s", "rw": "%s", "bs": "%s", "iodepth": %d}' \
        "$round" "$w" "$t" "$rw" "$bs" "$qd")
    line=$(python3 "$WORK/report.py" row "$base.json" "$base.err" "$rc" "$meta" "$CLK_TCK" \
        "$((c1 - c0))" "$((r1 - r0))" "$(python3 -c "print(max(0.0, $t1 - $t0))")" "$window_ok" \
        "$((w1 - w0))")
    echo "$line" >>"$WORK/rows.jsonl"
    python3 - "$line" <<'PY' >&2
import json, sys
r = json.loads(sys.argv[1])
if r["ok"]:
    c = r["cpu_us_per_io"]
    cpu = ("-" if c is None else f"{c:.1f}") + f" µs/IO ({r['cpu_source']})"
    print(f"[device] r{r['round']} {r['workload']:<15} {r['target']:<12} {r['iops']:>9.0f} IOPS "
          f"{r['mbps']:>8.1f} MB/s  mean {r['lat_mean_us']:>7.0f} µs  p99 {r['lat_p99_us']:>7.0f} µs  {cpu}")
else:
    print(f"[device] r{r['round']} {r['workload']:<15} {r['target']:<12} FAILED: {r['error']}")
PY
    if ! grep -q '"ok": true' <<<"$line"; then FAILED=$((FAILED + 1)); fi
}

if want_target ferrosan || want_target ferrosan-nvme; then start_ferrosan; fi
want_target tgt-rdwr && start_tgt tgt-rdwr rdwr
want_target tgt-aio && start_tgt tgt-aio aio
for t in ferrosan ferrosan-nvme tgt-rdwr tgt-aio; do
    if [[ -n ${PID_OF[$t]:-} ]]; then log "$t: pid ${PID_OF[$t]}, 127.0.0.1:${PORT_OF[$t]}, ${DESC_OF[$t]}"; fi
done

T_START=$(date +%s)
for ((round = 1; round <= ROUNDS; round++)); do
    for w in "${SEL_W[@]}"; do
        order=()
        for t in "${SEL_T[@]}"; do
            order+=("$t")
            if [[ $t == local ]] && writes "$w"; then order+=(local-dsync); fi
        done
        if ((round % 2 == 0)); then # reversed on even rounds, so no target always goes first
            rev=()
            for ((i = ${#order[@]} - 1; i >= 0; i--)); do rev+=("${order[i]}"); done
            order=("${rev[@]}")
        fi
        for t in "${order[@]}"; do run_one "$round" "$w" "$t"; done
    done
done

# ------------------------------------------------------------------ results
FIO_VERSION=-
if [[ $CLIENT == fio ]]; then FIO_VERSION=$("$FIO_BIN" --version); fi
mkdir -p "$OUT"
RESULT=$OUT/device-$(date +%F)-$TAG.json
n=2
while [[ -e $RESULT ]]; do RESULT=$OUT/device-$(date +%F)-$TAG-$n.json; n=$((n + 1)); done
TARGET_DESC=$(for t in ferrosan ferrosan-nvme tgt-rdwr tgt-aio; do
    if [[ -n ${DESC_OF[$t]:-} ]]; then printf '%s\t%s\n' "$t" "${DESC_OF[$t]}"; fi
done)
DEV_PATH=$DEV KIND=$KIND BYTES=$BYTES FSTYPE=$FSTYPE CREATED=$CREATED TAG=$TAG ROUNDS=$ROUNDS \
SECONDS_PER_RUN=$SECONDS_PER_RUN RAMP=$RAMP WORKLOADS="${SEL_W[*]}" TARGETS="${SEL_T[*]}" \
TGT_WCE=$TGT_WCE FIO_BIN=$FIO_BIN FERROSAN=$FERROSAN CLIENT=$CLIENT FIO_VERSION=$FIO_VERSION \
TARGET_DESC=$TARGET_DESC ELAPSED=$(($(date +%s) - T_START)) ROOT=$ROOT \
python3 - "$WORK/meta.json" <<'PY'
import datetime, json, os, subprocess, sys
e = os.environ
meta = {
    "date": datetime.datetime.now().isoformat(timespec="seconds"), "tag": e["TAG"],
    "dev": {"path": e["DEV_PATH"], "kind": e["KIND"], "bytes": int(e["BYTES"]),
            "fstype": e["FSTYPE"] or None, "created_by_this_run": e["CREATED"] == "1"},
    "rounds": int(e["ROUNDS"]), "seconds_per_run": int(e["SECONDS_PER_RUN"]),
    "ramp_seconds": int(e["RAMP"]), "workloads": e["WORKLOADS"].split(),
    "targets_selected": e["TARGETS"].split(), "tgt_wce": int(e["TGT_WCE"]),
    "client": e["CLIENT"],
    "targets": {"local": "fio libaio, direct=1",
                "local-dsync": "fio libaio, direct=1, sync=dsync (O_DIRECT|O_DSYNC), workloads that write"}
               if e["CLIENT"] == "fio" else
               {"local": "ferrosan bench, O_DIRECT on io_uring",
                "local-dsync": "ferrosan bench --dsync, O_DIRECT with RWF_DSYNC, workloads that write"},
    "fio": {"path": e["FIO_BIN"], "version": e["FIO_VERSION"]},
    "ferrosan": {"path": e["FERROSAN"],
                 "mtime": datetime.datetime.fromtimestamp(os.path.getmtime(e["FERROSAN"])).isoformat(timespec="seconds"),
                 "git_head": subprocess.run(["git", "-C", e["ROOT"], "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()},
    "host": {"cpus": os.cpu_count(), "kernel": os.uname().release,
             "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                if l.startswith("model name")), "?")},
    "elapsed_s": int(e["ELAPSED"]),
    "method": "fio --output-format=json --unified_rw_reporting=both (figures from 'mixed'); "
              "latency = lat_ns (submission to completion); target CPU per I/O = (delta "
              "utime+stime of the target process over a window from the end of the ramp to just "
              "before the runtime ends / window) / (total_ios / runtime); "
              "cpu_us_per_io_whole_run = delta from fio launch to exit / total_ios (includes the "
              "ramp); local CPU = fio usr_cpu+sys_cpu over its runtime / total_ios; dev_read_pct "
              "= /proc/PID/io read_bytes rate over the window / fio's read byte rate; page cache "
              "dropped before every run",
}
for line in e["TARGET_DESC"].splitlines():
    name, desc = line.split("\t", 1)
    meta["targets"][name] = desc
json.dump(meta, open(sys.argv[1], "w"))
PY
python3 "$WORK/report.py" report "$WORK/rows.jsonl" "$RESULT" "$WORK/meta.json"
log "wrote $RESULT"
if ((CREATED)); then log "$DEV was created by this run and is kept for the next one (rm it when done)"; fi
if ((FAILED)); then
    log "$FAILED run(s) failed"
    exit 1
fi
