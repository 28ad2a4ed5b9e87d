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
    // Per target: a series once the target has had a session, back at 0 when it ends.
    let of_target = format!("ferrosan_sessions{{target=\"{IQN}\"}} ");
    assert!(after.contains(&format!("{of_target}0")), "{after}");
    let session = initiator::driver::Client::connect(initiator::ClientConfig::new(
        format!("127.0.0.1:{}", daemon.port),
        initiator::SessionConfig::new(
            "iqn.2026-11.test:metrics",
            initiator::SessionKind::Normal {
                target_name: IQN.into(),
            },
        ),
    ))
    .expect("login");
    let during = wait_for(metrics_port, of_target.trim_end(), |v| v == 1.0);
    assert_eq!(value(&during, of_target.trim_end()), 1.0, "{during}");
    session.logout().ok();
    let later = wait_for(metrics_port, of_target.trim_end(), |v| v == 0.0);
    assert!(later.contains(&format!("{of_target}0")), "{later}");
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

/// `program args` with `stdin` fed in; its status, stdout and stderr.
fn run_with_input(program: &std::path::Path, args: &[&str], stdin: &[u8]) -> (bool, String) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The metric names (ferrosan_*, process_*) an expression text mentions.
fn names_in(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for start in ["ferrosan_", "process_"] {
        let mut rest = text;
        while let Some(at) = rest.find(start) {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

#[test]
fn promtool_accepts_the_scrape_and_the_rules_and_dashboards_name_real_series() {
    let promtool = common::require_tool("promtool");
    let dist = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist");
    let rules = dist.join("prometheus/ferrosan-rules.yml");
    let check = common::run_path(&promtool, &["check", "rules", &rules.display().to_string()]);
    assert!(
        check.success(),
        "promtool check rules:\n{}",
        check.describe()
    );

    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let body = format!(
        "[limits]\nmax_connections_per_source = 2\n{}",
        common::open_ram_target(IQN)
    );
    let daemon = Daemon::start_config_args(IQN, &body, &["--metrics-listen", &listen]);
    // Every series the rules and dashboard use exists once a session did I/O and a limit
    // refused someone (a third connection from one address).
    let held: Vec<_> = (0..3)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", daemon.port)).unwrap())
        .collect();
    wait_for(
        metrics_port,
        "ferrosan_limit_exceeded_total{limit=\"max_connections_per_source\"}",
        |v| v >= 1.0,
    );
    drop(held);
    // The daemon notices the closes asynchronously; until it has, a new connection from this
    // address would still be refused by the limit of 2.
    let closed = wait_for(metrics_port, "ferrosan_connections", |v| v == 0.0);
    assert_eq!(value(&closed, "ferrosan_connections"), 0.0, "{closed}");
    run("iscsi-ls", &["-s", &daemon.portal()]).expect_ok(&daemon);
    run(
        "qemu-img",
        &["bench", "-w", "-c", "64", "-f", "raw", &daemon.url(0)],
    )
    .expect_ok(&daemon);
    let writes = "ferrosan_device_writes_total{device=\"mem\"}";
    let text = wait_for(metrics_port, writes, |v| v >= 64.0);
    assert!(value(&text, writes) >= 64.0, "{text}");
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let (ok, said) = run_with_input(&promtool, &["check", "metrics"], body.as_bytes());
    assert!(ok, "promtool check metrics:\n{said}\n--- scrape\n{body}");
    assert!(!body.contains("# EOF"));

    // Asked for OpenMetrics, it gets OpenMetrics.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    use std::io::{Read as _, Write as _};
    s.write_all(
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
    )
    .unwrap();
    let mut om = String::new();
    s.read_to_string(&mut om).unwrap();
    assert!(
        om.contains("Content-Type: application/openmetrics-text; version=1.0.0"),
        "{om}"
    );
    assert!(om.trim_end().ends_with("# EOF"), "{om}");
    // A liveness probe's path answers on the same listener.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut health = String::new();
    s.read_to_string(&mut health).unwrap();
    assert!(
        health.starts_with("HTTP/1.0 200 OK") && health.ends_with("\r\n\r\nok\n"),
        "{health}"
    );

    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let dashboard_text =
        std::fs::read_to_string(dist.join("grafana/ferrosan-dashboard.json")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&dashboard_text).expect("the dashboard is JSON");
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 8));
    let used: std::collections::BTreeSet<String> = names_in(&rules_text)
        .into_iter()
        .chain(names_in(&dashboard_text))
        .collect();
    assert!(used.len() >= 10, "{used:?}");
    // Exported only by RBD gateways (a family without series is not written at all): the rbd
    // test scrapes these from real gateways.
    const GATEWAY_ONLY: [&str; 2] = ["ferrosan_gateway_owner", "ferrosan_gateway_takeovers_total"];
    for name in used.iter().filter(|n| !GATEWAY_ONLY.contains(&n.as_str())) {
        // A sample, or at least the family (a counter with no series yet, e.g. no limit hit).
        let declared = |l: &str| {
            l.strip_prefix("# TYPE ")
                .and_then(|t| t.split(' ').next())
                .is_some_and(|family| name.starts_with(family))
        };
        assert!(
            body.lines()
                .any(|l| l.starts_with(name.as_str()) || declared(l)),
            "{name} is used by dist/ but the daemon does not export it:\n{body}"
        );
    }
}

/// Each device served has a capacity and an offline gauge that follow `ctl resize` and
/// `ctl device offline`; a removed device's series all go.
#[test]
fn device_gauges_follow_live_changes_and_removed_devices_go() {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let _daemon = Daemon::start_with_args(
        IQN,
        &["ram:16M"],
        &["--metrics-listen", &listen, "--control-socket", &socket],
    );
    let scratch = common::Scratch::new("metrics-devices");
    let file = scratch.file("extra.img");
    let ok = |v: serde_json::Value| assert_eq!(v["ok"], true, "{v}");
    ok(ctl.json(&[
        "device",
        "add",
        "extra",
        &format!("file:{},size=8M", file.display()),
    ]));
    let capacity = "ferrosan_device_capacity_bytes{device=\"extra\"}";
    let offline = "ferrosan_device_offline{device=\"extra\"}";
    let text = wait_for(metrics_port, capacity, |v| v == (8 << 20) as f64);
    assert_eq!(value(&text, capacity), (8 << 20) as f64, "{text}");
    assert!(text.contains(&format!("{offline} 0")), "{text}");
    assert!(
        text.contains("ferrosan_device_capacity_bytes{device=\"lun0\"} 16777216"),
        "{text}"
    );
    ok(ctl.json(&["resize", "extra", "12M"]));
    let text = wait_for(metrics_port, capacity, |v| v == (12 << 20) as f64);
    assert_eq!(value(&text, capacity), (12 << 20) as f64, "{text}");
    ok(ctl.json(&["device", "offline", "extra"]));
    assert_eq!(value(&scrape(metrics_port), offline), 1.0);
    ok(ctl.json(&["device", "online", "extra"]));
    assert!(scrape(metrics_port).contains(&format!("{offline} 0")));
    assert!(scrape(metrics_port).contains("ferrosan_device_io_path{device=\"extra\""));
    ok(ctl.json(&["device", "remove", "extra"]));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut text = scrape(metrics_port);
    while text.contains("device=\"extra\"") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        text = scrape(metrics_port);
    }
    assert!(
        !text.contains("device=\"extra\""),
        "a removed device's series stay:\n{text}"
    );
    assert!(
        text.contains("ferrosan_device_capacity_bytes{device=\"lun0\"}"),
        "{text}"
    );
}
