#!/usr/bin/env python3
"""ferrosan vs tgt on loopback: same clients, same run, interleaved.

Called by bench/run.sh (which builds ferrosan); usable alone:

    bench/bench.py --ferrosan target/release/ferrosan [--quick] [--out DIR]

Targets (all started at the beginning, all idle while another is measured):
  fs-ram   ferrosan, RAM LUN 1 GiB (lazily allocated; preconditioned by writing it whole)
  fs-file  ferrosan, thin file LUN 1 GiB on tmpfs (/dev/shm)
  tgt      tgtd (Debian tgt), rdwr file LUN 1 GiB on tmpfs: tgt has no RAM store
Every workload runs once per target per round, rounds alternate the order
(A B C, C B A, ...), and the reported value is the median over rounds.

Per run: IOPS, MB/s (10^6), target CPU per I/O (utime+stime of the target
process from /proc/PID/stat fields 14+15, delta over the run, in µs), client
CPU (rusage of the client processes from wait4, as % of one core over the
client's wall time; ~100% means the client, not the target, was the limit).
"""
import argparse
import datetime
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import charts  # noqa: E402

IQN = "iqn.2024-01.dev.ferrosan:bench"
TCK = os.sysconf("SC_CLK_TCK")
KiB, MiB, GiB = 1024, 1024 * 1024, 1024 * 1024 * 1024
LUN_SIZE = 1 * GiB
STARTED = []  # Popen objects we started, stopped at exit
TGTD = "/usr/sbin/tgtd" if os.path.exists("/usr/sbin/tgtd") else "tgtd"
TGTADM = "/usr/sbin/tgtadm" if os.path.exists("/usr/sbin/tgtadm") else "tgtadm"


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes
def free_port():
    """A loopback port nothing listens on, below the kernel's ephemeral range: a port from
    bind(0) lies in that range and can become the local end of one of our own outgoing
    connections before the target binds it (as scripts/lib/common.sh and the Rust tests do)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 11000:
        low = 32768
    for _ in range(200):
        p = random.randrange(10000, low)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError(f"no free loopback port below {low}")


def wait_port(port, proc, secs=10):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {secs}s")


def start(args, logpath):
    f = open(logpath, "wb")
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    STARTED.append(p)
    return p


def stop(p, grace=5.0):
    """Stop one process we started, by PID: TERM, wait, then KILL."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if p in STARTED:
        STARTED.remove(p)


def stop_all():
    for p in list(STARTED):
        # tgtd -f ignores SIGTERM: no grace for it
        stop(p, 0.0 if os.path.basename(p.args[0]) == "tgtd" else 5.0)


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 (utime, stime)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Target:
    def __init__(self, name, kind, port, lun, proc, desc):
        self.name, self.kind, self.port, self.lun, self.proc, self.desc = name, kind, port, lun, proc, desc

    @property
    def pid(self):
        return self.proc.pid


def start_ferrosan(binary, name, lunspec, workdir, workers=None):
    port = free_port()
    args = [binary, "serve", "--listen", f"127.0.0.1:{port}", "--target", IQN, "--lun", lunspec]
    if workers:
        args += ["--workers", str(workers)]
    p = start(args, os.path.join(workdir, f"{name}.log"))
    wait_port(port, p)
    return Target(name, "ferrosan", port, 0, p, f"ferrosan --lun {lunspec}")


def start_tgt(name, path, workdir):
    port = free_port()
    ctl = 1000 + port % 30000  # private management socket (abstract namespace)
    p = start([TGTD, "-f", "-C", str(ctl), "--iscsi", f"portal=127.0.0.1:{port}"],
              os.path.join(workdir, f"{name}.log"))
    wait_port(port, p)
    adm = [TGTADM, "-C", str(ctl), "--lld", "iscsi", "--op"]
    for _ in range(50):
        if subprocess.run(adm + ["new", "--mode", "target", "--tid", "1", "-T", IQN],
                          capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    subprocess.run(adm + ["new", "--mode", "logicalunit", "--tid", "1", "--lun", "1",
                          "--backing-store", path], check=True, capture_output=True)
    subprocess.run(adm + ["bind", "--mode", "target", "--tid", "1", "-I", "ALL"],
                   check=True, capture_output=True)
    return Target(name, "tgt", port, 1, p, f"tgtd, rdwr backing store {path}")


# ---------------------------------------------------------------- clients
def qemu_args(t, count, depth, size, write, step, session):
    opts = (f"driver=raw,file.driver=iscsi,file.transport=tcp,file.portal=127.0.0.1:{t.port},"
            f"file.target={IQN},file.lun={t.lun},"
            f"file.initiator-name=iqn.2024-01.dev.ferrosan:bench-client-{session}")
    a = ["qemu-img", "bench", "--image-opts", "-t", "none", "-c", str(count), "-d", str(depth),
         "-s", str(size)]
    if write:
        a.append("-w")
    if step:
        a += ["-S", str(step)]
    return a + [opts]


def run_clients(t, argvs, timeout=300):
    """Run client processes in parallel against target t; measure the target and clients."""
    c0 = cpu_ticks(t.pid)
    t0 = time.monotonic()
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for a in argvs]
    outs, client_cpu, walls = [], 0.0, []
    for p in procs:
        out = p.stdout.read().decode(errors="replace")
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        walls.append(time.monotonic() - t0)
        client_cpu += ru.ru_utime + ru.ru_stime
        outs.append(out)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:3])}... exit {p.returncode}: {out.strip()[-300:]}")
    wall = time.monotonic() - t0
    c1 = cpu_ticks(t.pid)
    return outs, (c1 - c0) / TCK, client_cpu, wall, max(walls)


def qemu_bench(t, count, depth, size, write=False, step=None, sessions=1):
    argvs = [qemu_args(t, count, depth, size, write, step, s) for s in range(sessions)]
    outs, tcpu, ccpu, wall, _ = run_clients(t, argvs)
    secs = []
    for o in outs:
        for line in o.splitlines():
            if line.startswith("Run completed in"):
                secs.append(float(line.split()[3]))
    if len(secs) != sessions:
        raise RuntimeError("qemu-img bench printed no completion time: " + outs[0][-300:])
    ios = count * sessions
    el = max(secs)  # I/O phase; excludes login (the clients start within ms of each other)
    return {"ios": ios, "secs": el, "iops": ios / el, "mbps": ios * size / el / 1e6,
            "target_cpu_s": tcpu, "target_us_per_io": tcpu / ios * 1e6,
            "target_cpu_pct": 100 * tcpu / wall,
            "client_cpu_s": ccpu, "client_cpu_pct": 100 * ccpu / sessions / wall}


def iscsi_perf(t, depth, blocks, secs, sessions=1):
    argvs = [["iscsi-perf", "-i", f"iqn.2024-01.dev.ferrosan:bench-perf-{s}", "-m", str(depth),
              "-b", str(blocks), "-r", "-t", str(secs),
              f"iscsi://127.0.0.1:{t.port}/{IQN}/{t.lun}"] for s in range(sessions)]
    outs, tcpu, ccpu, wall, _ = run_clients(t, argvs, timeout=secs + 60)
    iops = 0.0
    for o in outs:
        # last "iops average N" is the whole-run average
        avg = [seg for seg in o.replace("\r", "\n").split("iops average ")[1:]]
        if not avg:
            raise RuntimeError("iscsi-perf printed no average: " + o[-300:])
        iops += float(avg[-1].split()[0])
    ios = iops * secs  # iscsi-perf reports a rate, not a count: I/Os = average × duration
    size = blocks * 512
    return {"ios": int(ios), "secs": secs, "iops": iops, "mbps": iops * size / 1e6,
            "target_cpu_s": tcpu, "target_us_per_io": tcpu / ios * 1e6 if ios else None,
            "target_cpu_pct": 100 * tcpu / wall,
            "client_cpu_s": ccpu, "client_cpu_pct": 100 * ccpu / sessions / wall}


def fio_url(t):
    # fio splits --filename at ':' unless escaped; the IQN has one too
    esc = lambda x: x.replace(":", "\\:")
    return esc(f"iscsi://127.0.0.1:{t.port}/{IQN}/{t.lun}")


def fio(t, binary, rw, size, depth, secs):
    """fio's libiscsi engine: true random I/O and per-I/O latency percentiles (µs)."""
    argv = [binary, "--name=bench", "--ioengine=libiscsi", f"--filename={fio_url(t)}",
            "--initiator=iqn.2024-01.dev.ferrosan:bench-fio", f"--rw={rw}", f"--bs={size}",
            f"--iodepth={depth}", f"--size={LUN_SIZE}", "--time_based", f"--runtime={secs}",
            "--output-format=json"]
    outs, tcpu, ccpu, wall, _ = run_clients(t, [argv], timeout=secs + 60)
    out = outs[0]
    if "{" not in out:
        raise RuntimeError("fio printed no JSON: " + out[-300:])
    job = json.loads(out[out.index("{"):])["jobs"][0]  # a "note:" line may precede the JSON
    d = job["read" if "read" in rw else "write"]
    ios, el = d["total_ios"], d["runtime"] / 1000
    if not ios or not el:
        raise RuntimeError(f"fio did no I/O: {job.get('error')}")
    pct = d["clat_ns"]["percentile"]
    return {"ios": ios, "secs": el, "iops": ios / el, "mbps": ios * size / el / 1e6,
            "target_cpu_s": tcpu, "target_us_per_io": tcpu / ios * 1e6,
            "target_cpu_pct": 100 * tcpu / wall,
            "client_cpu_s": ccpu, "client_cpu_pct": 100 * ccpu / wall,
            "lat_p50_us": pct["50.000000"] / 1e3, "lat_p99_us": pct["99.000000"] / 1e3,
            "lat_p999_us": pct["99.900000"] / 1e3, "lat_mean_us": d["clat_ns"]["mean"] / 1e3}


# ---------------------------------------------------------------- workloads
def est_count(size, depth, sessions, secs):
    """I/O count for ~secs of work on the faster target (rough loopback rates)."""
    iops = {1: 18000, 4: 45000, 16: 80000, 64: 90000}.get(depth, 80000)
    iops = min(iops, 2.0e9 / size)  # ~2 GB/s
    return max(200, int(iops * secs / sessions))


STRIDE = 4096 * 7919  # prime multiple of 4 KiB: a strided, cache-unfriendly pattern


def workloads(quick, with_fio):
    secs = 0.3 if quick else 0.8
    w = []
    for qd in (1, 64):
        if with_fio:
            for op in ("read", "write"):
                w.append(dict(id=f"fio-r{op[0]}4k-qd{qd}", group="headline", tool="fio", op=op,
                              pattern="random", size=4096, depth=qd, sessions=1,
                              secs=1 if quick else 3))
        w.append(dict(id=f"rr4k-qd{qd}", group="headline", tool="iscsi-perf", op="read",
                      pattern="random", size=4096, depth=qd, sessions=1, secs=1 if quick else 3))
        for op in ("read", "write"):
            w.append(dict(id=f"{op[0]}4k-qd{qd}", group="headline", tool="qemu-img", op=op,
                          pattern="strided", size=4096, depth=qd, sessions=1, step=STRIDE,
                          count=est_count(4096, qd, 1, secs)))
    sizes = [512 << i for i in range(12)]  # 512 B .. 1 MiB
    if quick:
        sizes = [512, 4096, 32768, 1048576]
    for size in sizes:
        for op in ("read", "write"):
            w.append(dict(id=f"sweep-{op}-{size}", group="sweep", tool="qemu-img", op=op,
                          pattern="sequential", size=size, depth=16, sessions=1,
                          count=est_count(size, 16, 1, secs)))
    for qd in (1, 4, 16, 64):
        for s in (1, 2, 4):
            w.append(dict(id=f"matrix-qd{qd}-s{s}", group="matrix", tool="qemu-img", op="read",
                          pattern="strided", size=4096, depth=qd, sessions=s, step=STRIDE,
                          count=est_count(4096, qd, s, secs)))
    return w


def run_workload(t, w, fio_bin):
    if w["tool"] == "fio":
        return fio(t, fio_bin, "rand" + w["op"], w["size"], w["depth"], w["secs"])
    if w["tool"] == "iscsi-perf":
        return iscsi_perf(t, w["depth"], w["size"] // 512, w["secs"], w["sessions"])
    return qemu_bench(t, w["count"], w["depth"], w["size"], w["op"] == "write", w.get("step"),
                      w["sessions"])


def median_of(runs):
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


# ---------------------------------------------------------------- extras
def iperf_ceiling(workdir, secs):
    port = free_port()
    srv = start(["iperf3", "-s", "-p", str(port)], os.path.join(workdir, "iperf3.log"))
    try:
        for _ in range(50):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.2)
        r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(secs),
                            "-l", "1M", "-J"], capture_output=True, text=True, timeout=secs + 30)
        j = json.loads(r.stdout)
        bps = j["end"]["sum_received"]["bits_per_second"]
        return {"gbit_s": bps / 1e9, "mb_s": bps / 8 / 1e6, "secs": secs,
                "sender_cpu_pct": j["end"]["cpu_utilization_percent"]["host_total"],
                "receiver_cpu_pct": j["end"]["cpu_utilization_percent"]["remote_total"]}
    finally:
        stop(srv, 2.0)


def wait_ready(path, proc, secs=60):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if os.path.exists(path) and open(path).read().startswith("ready"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"idle_sessions.py exited {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("idle sessions not ready")


def memory_checks(binary, workdir, quick):
    """RSS of ferrosan: idle, 100 idle sessions, 16 busy sessions; 64M vs 4G RAM LUN."""
    res = {}
    for size in ("64M", "4G"):
        t = start_ferrosan(binary, f"mem-{size}", f"ram:{size}", workdir)
        try:
            time.sleep(0.3)
            r = {"start_kib": rss_kib(t.pid)}
            ready = os.path.join(workdir, f"idle-{size}.ready")
            idle = start([sys.executable, os.path.join(HERE, "idle_sessions.py"),
                          f"127.0.0.1:{t.port}", IQN, "100", "--ready", ready],
                         os.path.join(workdir, f"idle-{size}.log"))
            wait_ready(ready, idle)
            time.sleep(1.0)
            r["idle100_kib"] = rss_kib(t.pid)
            stop(idle, 2.0)
            # 16 busy sessions, QD16 each, half reading half writing 4 KiB blocks
            # sequentially over the first 64 MiB (the whole of the small LUN): both
            # LUNs end up with the same 64 MiB allocated.
            peak = [0]
            argvs = [qemu_args(t, 4096 if quick else 16384, 16, 4096, s % 2 == 1, None, s)
                     for s in range(16)]
            procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for a in argvs]
            while any(p.poll() is None for p in procs):
                peak[0] = max(peak[0], rss_kib(t.pid))
                time.sleep(0.05)
            r["busy16_peak_kib"] = peak[0]
            r["after_busy_kib"] = rss_kib(t.pid)
            res[f"ram_{size}"] = r
        finally:
            stop(t.proc)
    return res


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrosan", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--fio", help="fio with the libiscsi engine (bench/fio-libiscsi.sh finds or builds one)")
    ap.add_argument("--only", help="comma-separated workload groups (headline,sweep,matrix)")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    workdir = tempfile.mkdtemp(prefix="ferrosan-bench.", dir=shm)
    t_start = time.time()
    try:
        return run(args, rounds, workdir, t_start)
    finally:
        stop_all()
        for f in os.listdir(workdir):
            if f.endswith(".img"):
                os.unlink(os.path.join(workdir, f))
        log(f"daemon logs: {workdir}")


def run(args, rounds, workdir, t_start):
    res = {"date": datetime.date.today().isoformat(), "quick": args.quick, "rounds": rounds,
           "host": {"cpus": os.cpu_count(), "kernel": os.uname().release,
                    "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                       if l.startswith("model name")), "?")},
           "clk_tck": TCK,
           "ferrosan_bin": {"path": args.ferrosan, "mtime": datetime.datetime.fromtimestamp(
               os.path.getmtime(args.ferrosan)).isoformat(timespec="seconds"),
               "git_head": subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()}}
    log("loopback TCP ceiling (iperf3)")
    res["iperf3"] = iperf_ceiling(workdir, 2 if args.quick else 5)
    log(f"  {res['iperf3']['gbit_s']:.1f} Gbit/s = {res['iperf3']['mb_s']:.0f} MB/s")

    fimg, timg = os.path.join(workdir, "fs-file.img"), os.path.join(workdir, "tgt.img")
    with open(timg, "wb") as f:
        f.truncate(LUN_SIZE)
    targets = [start_ferrosan(args.ferrosan, "fs-ram", "ram:1G", workdir),
               start_ferrosan(args.ferrosan, "fs-file", f"file:{fimg},size=1G", workdir),
               start_tgt("tgt", timg, workdir)]
    res["targets"] = {t.name: t.desc for t in targets}
    log("preconditioning: write each LUN whole (1 MiB, QD16) so reads hit real data")
    for t in targets:
        qemu_bench(t, LUN_SIZE // MiB, 16, MiB, write=True)
    res["rss_kib_after_precondition"] = {t.name: rss_kib(t.pid) for t in targets}

    if not args.fio:
        log("no fio with the libiscsi engine (bench/fio-libiscsi.sh): fio workloads skipped")
    ws = workloads(args.quick, bool(args.fio))
    if args.only:
        ws = [w for w in ws if w["group"] in args.only.split(",")]
    res["workloads"] = []
    rss_trace = []
    for i, w in enumerate(ws):
        per = {t.name: [] for t in targets}
        tl = targets if w["group"] != "matrix" else [t for t in targets if t.name != "fs-file"]
        for r in range(rounds):
            order = tl if r % 2 == 0 else list(reversed(tl))
            for t in order:
                per[t.name].append(run_workload(t, w, args.fio))
        entry = dict(w)
        entry["rounds"] = {k: v for k, v in per.items() if v}
        entry["median"] = {k: median_of(v) for k, v in per.items() if v}
        res["workloads"].append(entry)
        m = entry["median"]
        rss_trace.append({"workload": w["id"], **{t.name: rss_kib(t.pid) for t in targets}})
        log(f"[{i + 1}/{len(ws)}] {w['id']:<22} " + "  ".join(
            f"{k} {v['iops']:>8.0f} IOPS {v['mbps']:>7.1f} MB/s {v['target_us_per_io']:>6.1f} µs/IO "
            f"cli {v['client_cpu_pct']:>3.0f}%" for k, v in m.items()))
    res["rss_kib_trace"] = rss_trace
    for t in list(targets):
        stop(t.proc, 0.0 if t.kind == "tgt" else 5.0)

    log("memory: 100 idle sessions, 16 busy sessions, RAM LUN 64M vs 4G")
    res["memory"] = memory_checks(args.ferrosan, workdir, args.quick)
    res["elapsed_s"] = time.time() - t_start

    os.makedirs(args.out, exist_ok=True)
    latest = os.path.join(args.out, "latest.json")
    with open(latest, "w") as f:
        json.dump(res, f, indent=1)
    md = charts.render_all(res, args.out)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"wrote {latest}, latest.md and SVG charts in {args.out} ({res['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
