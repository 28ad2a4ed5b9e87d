use std::time::{Duration, Instant};

use serde_json::json;

use super::fit::{col, name_col, name_col_drop, Row, Table};
use super::frame::{frame, percentiles};
use super::*;

const BOUNDS: [f64; 3] = [1e6, 2e6, 4e6];

#[test]
fn percentiles_come_from_the_window_interpolated_in_the_bucket() {
    let at = |b: [u64; 4]| json!({ "buckets": b });
    // Before the window: 100 slow commands; in it, 10 in (0, 1 ms] and 10 in (1, 2 ms].
    let old = at([0, 0, 0, 100]);
    let now = at([10, 10, 0, 100]);
    let (p50, p99) = percentiles(Some(&old), &now, &BOUNDS).unwrap();
    assert!((p50 - 1.0).abs() < 1e-9, "{p50}");
    assert!((p99 - 1.98).abs() < 1e-9, "{p99}");
    assert_eq!(
        percentiles(Some(&now), &now, &BOUNDS),
        None,
        "no command: none"
    );
    // A new item: everything it has is recent; the +Inf bucket reports its lower bound.
    let (_, p99) = percentiles(None, &at([0, 0, 0, 5]), &BOUNDS).unwrap();
    assert_eq!(p99, 4.0);
}

fn row(name: &str, target: &str, iops: f64, p99: f64) -> Row {
    Row {
        cells: vec![
            "1".into(),
            name.into(),
            target.into(),
            "127.0.0.1:40000".into(),
            format!("{iops}"),
        ],
        iops,
        mb: iops / 10.0,
        p99,
        qd: iops / 10.0,
        name: name.into(),
    }
}

fn sessions() -> Table {
    Table {
        columns: vec![
            col("TSIH"),
            name_col("INITIATOR"),
            name_col_drop("TARGET", 2),
            name_col_drop("SOURCE", 1),
            col("IOPS"),
        ],
        total: None,
        rows: vec![
            row(
                "iqn.1993-08.org.debian:01:aaaa1111",
                "iqn.2026-11.org.ferrosan:one",
                10.0,
                5.0,
            ),
            row(
                "iqn.1991-05.com.microsoft:win-bbbb",
                "iqn.2026-11.org.ferrosan:two",
                30.0,
                1.0,
            ),
            row(
                "iqn.1998-01.com.vmware:esx-cccc",
                "iqn.2026-11.org.ferrosan:one",
                20.0,
                9.0,
            ),
        ],
    }
}

#[test]
fn rows_are_sorted_filtered_and_fitted() {
    let view = |sort, filter: &str, width| View {
        sort,
        filter: filter.into(),
        width,
    };
    let names = |(_, rows): (Vec<&str>, Vec<Vec<String>>)| -> Vec<String> {
        rows.into_iter().map(|r| r[1].clone()).collect()
    };
    let t = sessions();
    let by_iops = names(shown(&t, &view(Sort::Iops, "", None)));
    assert!(by_iops[0].contains("microsoft") && by_iops[2].contains("debian"));
    let by_p99 = names(shown(&t, &view(Sort::Latency, "", None)));
    assert!(by_p99[0].contains("vmware"));
    let by_qd = names(shown(&t, &view(Sort::Qd, "", None)));
    assert!(by_qd[0].contains("microsoft"));
    let by_name = names(shown(&t, &view(Sort::Name, "", None)));
    assert!(by_name[0].contains("1991"));
    // The filter looks in every cell, whatever the case.
    let one = shown(&t, &view(Sort::Iops, "FERROSAN:ONE", None));
    assert_eq!(one.1.len(), 2);
    // Whole without a width; at 60 columns the names keep their ends, SOURCE goes first.
    let (header, rows) = shown(&t, &view(Sort::Iops, "", None));
    assert_eq!(header.len(), 5);
    assert_eq!(rows[0][1], "iqn.1991-05.com.microsoft:win-bbbb");
    let (header, rows) = shown(&t, &view(Sort::Iops, "", Some(60)));
    assert_eq!(header, ["TSIH", "INITIATOR", "TARGET", "IOPS"]);
    let line: usize = rows[0].iter().map(|c| c.chars().count() + 2).sum();
    assert!(line <= 60, "{rows:?}");
    assert!(
        rows[0][1].starts_with('…') && rows[0][1].ends_with("win-bbbb"),
        "{rows:?}"
    );
    assert!(rows[0][2].ends_with("ferrosan:two"), "{rows:?}");
    // Narrower still: TARGET goes too, INITIATOR stays.
    let (header, _) = shown(&t, &view(Sort::Iops, "", Some(30)));
    assert_eq!(header, ["TSIH", "INITIATOR", "IOPS"]);
}

/// `stats` as the daemon answers it: one session and two devices with `n` reads of 1 ms
/// each (so `n` ms of busy time) and `n` × 4 KiB.
fn stats(n: u64, secs: u64) -> Sample {
    let latency = |count: u64| json!({"count": count, "sum_ns": count * 1_000_000, "buckets": [0, count, 0, 0]});
    let io = |n: u64| {
        json!({"reads": n, "writes": 0, "read_bytes": n * 4096, "write_bytes": 0,
        "read_latency": latency(n), "write_latency": latency(0)})
    };
    let mut session = io(n);
    for (k, v) in [
        ("tsih", json!(7)),
        ("door", json!("nvme")),
        ("initiator", json!("iqn.1993-08.org.debian:01:host-a")),
        ("target", json!("iqn.2026-11.org.ferrosan:array")),
        ("portal", json!("192.0.2.10:3260")),
        ("source", json!("192.0.2.77:51234")),
    ] {
        session[k] = v;
    }
    let mut disk = io(n);
    disk["device"] = json!("disk0");
    disk["luns"] = json!([{"target": "t", "group": "g", "lun": 3}, {"target": "u", "group": "h", "lun": 0}, {"target": "v", "group": "h", "lun": 3}]);
    disk["in_flight"] = json!(2);
    let mut spare = io(0);
    spare["device"] = json!("spare");
    spare["luns"] = json!([]);
    Sample {
        at: START.with(|s| *s) + Duration::from_secs(secs),
        stats: json!({"latency_bounds_ns": BOUNDS, "sessions": [session], "devices": [disk, spare],
            "workers": [{"worker": 0, "busy": 0.5, "connections": 3}, {"worker": 1, "busy": 0.0, "connections": 0}]}),
    }
}

thread_local! {
    static START: Instant = Instant::now();
}

/// The columns a table's lines take: each column as wide as its header or widest cell, two
/// between columns.
fn used(header: &[&str], rows: &[Vec<String>]) -> usize {
    header
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let widest = rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0);
            widest.max(h.len()) + 2
        })
        .sum()
}

#[test]
fn a_frame_has_each_sessions_portal_and_queue_depth_and_each_devices_luns() {
    // 8 000 reads of 1 ms each in 2 s: 8 s busy per 2 s, 4 in flight on average.
    let f = frame(&stats(1000, 0), &stats(9000, 2));
    let view = View {
        sort: Sort::Iops,
        filter: String::new(),
        width: Some(80),
    };
    let (header, rows) = shown(&f.sessions, &view);
    assert_eq!(
        header,
        [
            "ID",
            "INITIATOR",
            "PORTAL",
            "READ/s",
            "WRITE/s",
            "MB/s",
            "RD_ms",
            "WR_ms",
            "P99_ms",
            "QD"
        ]
    );
    // At 80 columns names keep their distinctive ends: the host, the address and port.
    let cell = |rows: &[Vec<String>], header: &[&str], h: &str| {
        rows[0][header.iter().position(|x| *x == h).unwrap()].clone()
    };
    let initiator = cell(&rows, &header, "INITIATOR");
    assert!(
        initiator.starts_with('…') && initiator.ends_with("host-a"),
        "{initiator}"
    );
    assert!(
        cell(&rows, &header, "PORTAL").ends_with("10:3260"),
        "{rows:?}"
    );
    assert_eq!(cell(&rows, &header, "READ/s"), "4000");
    assert_eq!(cell(&rows, &header, "RD_ms"), "1.000");
    assert_eq!(cell(&rows, &header, "WR_ms"), "-", "no writes");
    assert_eq!(cell(&rows, &header, "QD"), "4.0");
    assert!(used(&header, &rows) <= 80, "{rows:?}");
    // Wide enough, every column, every name whole.
    let wide = View {
        width: Some(180),
        ..view.clone()
    };
    let (header, rows) = shown(&f.sessions, &wide);
    assert_eq!(header.len(), 14);
    assert_eq!(cell(&rows, &header, "DOOR"), "NVMe");
    assert_eq!(cell(&rows, &header, "KiB/IO"), "4.0");
    assert_eq!(
        cell(&rows, &header, "INITIATOR"),
        "iqn.1993-08.org.debian:01:host-a"
    );
    // In between, the room left goes back to the names: the line fills the width.
    let roomy = View {
        width: Some(120),
        ..view.clone()
    };
    let (header, rows) = shown(&f.sessions, &roomy);
    assert_eq!(cell(&rows, &header, "PORTAL"), "192.0.2.10:3260");
    assert!(
        cell(&rows, &header, "INITIATOR").ends_with(":01:host-a"),
        "{rows:?}"
    );
    let line = used(&header, &rows);
    assert!((117..=120).contains(&line), "{line} columns: {rows:?}");
    // One session: no total row. Two devices: theirs last, whatever the order.
    assert_eq!(shown(&f.sessions, &view).1.len(), 1);
    let (header, rows) = shown(&f.devices, &view);
    assert_eq!(header[..2], ["DEVICE", "LUN"]);
    assert_eq!(rows[0][..2], ["disk0", "0,3"]);
    assert_eq!(rows[1][..2], ["spare", "-"]);
    let qd = header.iter().position(|h| *h == "QD").unwrap();
    assert_eq!(rows[0][qd], "4.0");
    assert_eq!(rows[1][qd], "0.0");
    assert_eq!(rows[2][0], "all 2 devices");
    assert_eq!(rows[2][2], "4000", "the total's reads");
    assert_eq!(rows[2][qd], "4.0");
    let by_name = View {
        sort: Sort::Name,
        filter: "spare".into(),
        ..view.clone()
    };
    let (_, rows) = shown(&f.devices, &by_name);
    assert_eq!(rows.len(), 2, "the filtered row and the total: {rows:?}");
    // The filter finds a session by its portal.
    let by_portal = View {
        filter: "192.0.2.10".into(),
        ..view
    };
    assert_eq!(shown(&f.sessions, &by_portal).1.len(), 1);
    assert_eq!(
        f.workers,
        "workers: #0 50% busy, 3 connections; #1 0% busy, 0 connections"
    );
}

#[test]
fn keys_sort_filter_and_quit() {
    let mut view = View {
        sort: Sort::Iops,
        filter: String::new(),
        width: None,
    };
    let mut typing = None;
    assert!(!act(Key::Char('l'), &mut view, &mut typing));
    assert_eq!(view.sort, Sort::Latency);
    assert!(!act(Key::Char('d'), &mut view, &mut typing));
    assert_eq!(view.sort, Sort::Qd);
    for k in [
        Key::Char('/'),
        Key::Char('e'),
        Key::Char('s'),
        Key::Char('x'),
        Key::Backspace,
    ] {
        assert!(!act(k, &mut view, &mut typing));
    }
    // Typed, q is text, not quit.
    assert!(!act(Key::Char('q'), &mut view, &mut typing));
    assert!(!act(Key::Enter, &mut view, &mut typing));
    assert_eq!(view.filter, "esq");
    assert!(!act(Key::Esc, &mut view, &mut typing));
    assert!(view.filter.is_empty());
    assert!(act(Key::Char('q'), &mut view, &mut typing));
}

#[test]
fn a_total_is_what_the_rows_did_even_when_one_went_away() {
    let session = |tsih: u64, reads: u64| {
        json!({"tsih": tsih, "door": "iscsi", "target": "t", "initiator": format!("i{tsih}"),
            "reads": reads, "writes": 0, "read_bytes": reads * 4096, "write_bytes": 0,
            "read_latency": {"count": reads, "sum_ns": reads * 1_000_000, "buckets": [0, reads, 0, 0]},
            "write_latency": {"count": 0, "sum_ns": 0, "buckets": [0, 0, 0, 0]}})
    };
    let at = |secs: u64, sessions: Vec<serde_json::Value>| Sample {
        at: START.with(|s| *s) + Duration::from_secs(secs),
        stats: json!({"latency_bounds_ns": BOUNDS, "sessions": sessions, "devices": []}),
    };
    // Session 1 read 1,000 more, session 3 is new with 500; session 2 (a million reads
    // before) is gone: it must not take its total out of the others'.
    let before = at(0, vec![session(1, 100), session(2, 1_000_000)]);
    let now = at(2, vec![session(1, 1_100), session(3, 500)]);
    let f = frame(&before, &now);
    let view = View {
        sort: Sort::Name,
        filter: String::new(),
        width: None,
    };
    let (header, rows) = shown(&f.sessions, &view);
    let reads = header.iter().position(|h| *h == "READ/s").unwrap();
    let rd = header.iter().position(|h| *h == "RD_ms").unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[2][2], "all 2 sessions");
    assert_eq!(rows[2][reads], "750", "(1,000 + 500) / 2 s");
    assert_eq!(rows[2][rd], "1.000");
}
