//! Adaptive busy polling (crates/engine/src/busy_poll.rs) against the real daemon: a raw
//! initiator that waits for each answer (QD1) makes its worker poll, and the polls catch its
//! next commands (`ferrosan_busy_poll_hits_total`); with `busy_poll_us = 0` the same initiator
//! makes it poll never. Both answer every command correctly.

mod common;

use std::time::Duration;

use common::raw::{rw10, Raw};
use common::{free_port, metric, scrape, wait_for_metric, Daemon};

const IQN: &str = "iqn.2024-01.dev.ferrosan:busy-poll";
const READS: u32 = 2_000;

/// Logs in and runs `READS` 4 KiB reads one at a time, each answered before the next is sent.
fn qd1_reads(port: u16) {
    let mut raw = Raw::login(port, IQN, 1);
    let mut itt = 1u32;
    raw.until_ready(&mut itt);
    for i in 0..READS {
        let bhs = raw.command(itt, &rw10(0x28, i * 8, 8), 0xc0, 4096);
        itt += 1;
        raw.send(&bhs, &[]);
        let data = raw.read_data();
        assert_eq!(data.len(), 4096);
        // A RAM device reads zeros where nothing was written.
        assert!(data.iter().all(|&b| b == 0), "read {i} returned other data");
    }
}

fn config(metrics_port: u16, busy_poll_us: u32) -> String {
    format!(
        "[server]\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n[limits]\nbusy_poll_us = {busy_poll_us}\n{}",
        common::open_ram_target(IQN)
    )
}

#[test]
fn a_worker_polls_for_an_initiator_that_waits_for_each_answer() {
    let metrics_port = free_port();
    let daemon = Daemon::start_config(IQN, &config(metrics_port, 50));
    qd1_reads(daemon.port);
    // Counts reach the metrics once a second.
    let text = wait_for_metric(metrics_port, "ferrosan_busy_poll_hits_total", |v| v > 0.0);
    let polls = metric(&text, "ferrosan_busy_polls_total");
    let hits = metric(&text, "ferrosan_busy_poll_hits_total");
    let seconds = metric(&text, "ferrosan_busy_poll_seconds_total");
    assert!(hits <= polls, "{text}");
    assert!(seconds > 0.0, "{text}");
    // At most two windows per command (a header and its data may arrive apart) plus the idle
    // stretches' two each: polling is bounded by the work.
    assert!(
        polls <= f64::from(2 * READS + 50),
        "{polls} polls for {READS} reads"
    );
}

#[test]
fn busy_poll_us_0_never_polls() {
    let metrics_port = free_port();
    let daemon = Daemon::start_config(IQN, &config(metrics_port, 0));
    qd1_reads(daemon.port);
    std::thread::sleep(Duration::from_millis(1_200));
    let text = scrape(metrics_port);
    // Present and zero (metric() reads an absent series as 0 too).
    assert!(
        text.lines()
            .any(|l| l.starts_with("ferrosan_busy_polls_total ")),
        "{text}"
    );
    assert_eq!(metric(&text, "ferrosan_busy_polls_total"), 0.0, "{text}");
    assert_eq!(
        metric(&text, "ferrosan_busy_poll_seconds_total"),
        0.0,
        "{text}"
    );
}
