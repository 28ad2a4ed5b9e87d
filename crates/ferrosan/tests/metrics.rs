//! The Prometheus endpoint reflects what happened on the wire.

mod common;

use common::{free_port, metric as value, run, scrape, wait_for_metric as wait_for, Daemon, IQN};

#[test]
fn logins_and_failures_are_counted() {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(IQN, &["ram:16M"], &["--metrics-listen", &listen]);
    let before = scrape(metrics_port);
    assert_eq!(
        value(&before, "ferrosan_logins_total{result=\"success\"}"),
        0.0,
        "{before}"
    );

    run("iscsi-inq", &[&daemon.url(0)]).expect_ok(&daemon);
    // portal() is "iscsi://127.0.0.1:PORT".
    let wrong = format!("{}/iqn.2026-11.org.ferrosan:nope/0", daemon.portal());
    let failed = run("iscsi-inq", &[&wrong]);
    assert!(!failed.success(), "a login to an unknown target must fail");

    let after = scrape(metrics_port);
    assert_eq!(
        value(&after, "ferrosan_logins_total{result=\"success\"}"),
        1.0,
        "{after}"
    );
    // 0203: target not found.
    assert_eq!(
        value(&after, "ferrosan_logins_total{result=\"0203\"}"),
        1.0,
        "{after}"
    );
    assert_eq!(value(&after, "ferrosan_sessions"), 0.0, "{after}");
}

#[test]
fn device_io_is_counted_per_device() {
    const IMAGE: usize = 4 << 20;
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon =
        Daemon::start_with_args(IQN, &["ram:16M", "ram:16M"], &["--metrics-listen", &listen]);
    let scratch = common::Scratch::new("metrics-io");
    let image = scratch.file("image.raw");
    std::fs::write(&image, common::pseudo_random_bytes(IMAGE, 3)).expect("write image");
    let image = image.display().to_string();
    common::upload(&daemon, 0, &image);
    let written = "ferrosan_device_write_bytes_total{device=\"lun0\"}";
    let text = wait_for(metrics_port, written, |v| v >= IMAGE as f64);
    assert_eq!(value(&text, written), IMAGE as f64, "{text}");
    assert!(
        value(&text, "ferrosan_device_writes_total{device=\"lun0\"}") >= 2.0,
        "qemu-img writes at most 2 MiB per command: {text}"
    );
    common::assert_identical(&daemon, 0, &image);
    let read = "ferrosan_device_read_bytes_total{device=\"lun0\"}";
    let text = wait_for(metrics_port, read, |v| v >= IMAGE as f64);
    let read_bytes = value(&text, read);
    assert!(
        read_bytes >= IMAGE as f64 && read_bytes % 512.0 == 0.0,
        "compare reads the image back: {read_bytes}\n{text}"
    );
    assert!(value(&text, "ferrosan_device_reads_total{device=\"lun0\"}") >= 2.0);
    // The other device saw no I/O: no reads or writes counted for it.
    assert_eq!(
        value(&text, "ferrosan_device_write_bytes_total{device=\"lun1\"}"),
        0.0
    );
    assert_eq!(
        value(&text, "ferrosan_device_read_bytes_total{device=\"lun1\"}"),
        0.0
    );
}

#[test]
fn new_connections_go_to_the_least_loaded_worker() {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(
        IQN,
        &["ram:16M"],
        &["--metrics-listen", &listen, "--workers", "2"],
    );
    // The two workers' open connections, fewest first.
    let loads = |text: &str| {
        let mut v = [0, 1].map(|n| {
            value(
                text,
                &format!("ferrosan_worker_connections{{worker=\"{n}\"}}"),
            )
        });
        v.sort_by(f64::total_cmp);
        v
    };
    let connect = || std::net::TcpStream::connect(("127.0.0.1", daemon.port)).expect("connect");
    let open = |want: f64| wait_for(metrics_port, "ferrosan_connections", |v| v == want);
    // Four connections (no login yet) alternate between the workers.
    let mut conns = Vec::new();
    for n in 1..=4 {
        conns.push(Some(connect()));
        open(f64::from(n));
    }
    let text = open(4.0);
    assert_eq!(loads(&text), [2.0, 2.0], "{text}");
    // The first and the third, on the same worker, close: the daemon reads EOF and drops them.
    conns[0] = None;
    conns[2] = None;
    let text = open(2.0);
    assert_eq!(loads(&text), [0.0, 2.0], "{text}");
    // Round-robin would now give one to each worker (1 and 3); both go to the idle one.
    conns.push(Some(connect()));
    open(3.0);
    conns.push(Some(connect()));
    let text = open(4.0);
    assert_eq!(loads(&text), [2.0, 2.0], "{text}");
    drop(conns);
}

/// A child process killed (by PID) when dropped, so a failing assertion leaves none behind.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn new_connections_avoid_a_busy_worker() {
    common::require_tool("qemu-img");
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(
        IQN,
        &["ram:64M"],
        &["--metrics-listen", &listen, "--workers", "2"],
    );
    // One saturating initiator: 4 KiB reads at QD16, far more than the test waits for.
    let _load = KillOnDrop(
        std::process::Command::new("qemu-img")
            .args([
                "bench",
                "-f",
                "raw",
                "-t",
                "none",
                "-c",
                "100000000",
                "-d",
                "16",
                "-s",
                "4096",
            ])
            .arg(daemon.url(0))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start qemu-img bench"),
    );
    let busy = |text: &str, n: usize| {
        value(
            text,
            &format!("ferrosan_worker_busy_ratio{{worker=\"{n}\"}}"),
        )
    };
    let conns = |text: &str, n: usize| {
        value(
            text,
            &format!("ferrosan_worker_connections{{worker=\"{n}\"}}"),
        )
    };
    // Wait for a worker to show the load (sampled once a second).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let busy_worker = loop {
        let text = scrape(metrics_port);
        if let Some(n) = (0..2).find(|&n| busy(&text, n) >= 0.2 && conns(&text, n) == 1.0) {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no worker became busy:\n{text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let idle_worker = 1 - busy_worker;
    // Three idle connections: connection counts alone would put the third (1 vs 2) on the
    // busy worker, and the second on it every other turn; all three go to the idle one.
    let mut idle = Vec::new();
    for n in 1..=3 {
        idle.push(std::net::TcpStream::connect(("127.0.0.1", daemon.port)).expect("connect"));
        wait_for(metrics_port, "ferrosan_connections", |v| {
            v == f64::from(n + 1)
        });
    }
    let text = scrape(metrics_port);
    assert!(busy(&text, busy_worker) >= 0.2, "the load stopped:\n{text}");
    assert_eq!(
        (conns(&text, busy_worker), conns(&text, idle_worker)),
        (1.0, 3.0),
        "{text}"
    );
}

/// The `_bucket` series of one latency histogram, in order (cumulative counts).
fn latency_buckets(text: &str, device: &str, op: &str) -> Vec<f64> {
    let labels = format!("device=\"{device}\",op=\"{op}\"}}");
    text.lines()
        .filter(|l| l.starts_with("ferrosan_device_latency_seconds_bucket{") && l.contains(&labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

#[test]
fn command_latency_is_a_histogram_per_device_and_op() {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let scratch = common::Scratch::new("metrics-latency");
    // A file on a disk filesystem, write-through by default: its writes run on the blocking pool.
    let disk = format!("file:{},size=16M", scratch.file("disk.img").display());
    let daemon = Daemon::start_with_args(IQN, &["ram:16M", &disk], &["--metrics-listen", &listen]);
    let bench = |lun: u32, write: bool| {
        let url = daemon.url(lun);
        let mut args = vec![
            "bench", "-f", "raw", "-t", "none", "-c", "200", "-d", "4", "-s", "4096",
        ];
        if write {
            args.push("-w");
        }
        args.push(&url);
        run("qemu-img", &args).expect_ok(&daemon);
    };
    bench(0, false);
    bench(1, true);
    let count = |device: &str, op: &str| {
        format!("ferrosan_device_latency_seconds_count{{device=\"{device}\",op=\"{op}\"}}")
    };
    let text = wait_for(metrics_port, &count("lun1", "write"), |v| v >= 200.0);
    for (device, op, counter) in [("lun0", "read", "reads"), ("lun1", "write", "writes")] {
        let n = value(&text, &count(device, op));
        let commands = value(
            &text,
            &format!("ferrosan_device_{counter}_total{{device=\"{device}\"}}"),
        );
        assert!(
            n >= 200.0 && n == commands,
            "{device} {op}: {n} timed, {commands} done\n{text}"
        );
        let buckets = latency_buckets(&text, device, op);
        assert_eq!(buckets.len(), 19, "18 bounds and +Inf:\n{text}");
        assert!(
            buckets.windows(2).all(|w| w[0] <= w[1]),
            "cumulative:\n{text}"
        );
        assert_eq!(
            buckets.last().copied(),
            Some(n),
            "+Inf holds them all:\n{text}"
        );
        let sum = value(
            &text,
            &format!("ferrosan_device_latency_seconds_sum{{device=\"{device}\",op=\"{op}\"}}"),
        );
        assert!(
            sum > 0.0 && sum < n,
            "{device} {op}: {sum} s in all\n{text}"
        );
    }
    // Nothing was written to the RAM device nor read from the disk one.
    assert_eq!(value(&text, &count("lun0", "write")), 0.0, "{text}");
    assert_eq!(value(&text, &count("lun1", "read")), 0.0, "{text}");
    // A write-through write waits for the disk (fdatasync): slower than the RAM reads.
    let mean = |device: &str, op: &str| {
        value(
            &text,
            &format!("ferrosan_device_latency_seconds_sum{{device=\"{device}\",op=\"{op}\"}}"),
        ) / value(&text, &count(device, op))
    };
    assert!(
        mean("lun1", "write") > mean("lun0", "read"),
        "durable writes {} s vs RAM reads {} s on average",
        mean("lun1", "write"),
        mean("lun0", "read")
    );
}
