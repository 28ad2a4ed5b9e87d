//! The Prometheus endpoint reflects what happened on the wire.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{free_port, run, Daemon, IQN};

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .expect("read the metrics answer");
    assert!(answer.starts_with("HTTP/1.0 200 OK"), "{answer}");
    answer
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse::<f64>().unwrap_or(-1.0))
        })
        .unwrap_or(0.0)
}

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
