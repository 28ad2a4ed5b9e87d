//! The Prometheus endpoint reflects what happened on the wire.

mod common;

use common::{free_port, run, scrape, Daemon, IQN};

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
