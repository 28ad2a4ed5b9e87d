//! What one frame of `top` shows, from two samples of the daemon's `stats` (totals since
//! start): per session and per device the rates, average and p99 latency and queue depth
//! over the window, each table's totals, and the network workers' load.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};

use super::fit::{col, col_drop, name_col, name_col_drop, Row, Table};

/// Samples a rate spans (intervals = WINDOW - 1).
const WINDOW: usize = 4;

/// The samples of the current window, oldest first.
pub(super) struct Window(VecDeque<Sample>);

impl Window {
    pub fn new(first: Sample) -> Window {
        Window(VecDeque::from([first]))
    }

    /// Adds `now` and returns the frame from the oldest sample kept to it.
    pub fn push(&mut self, now: Sample) -> Frame {
        self.0.push_back(now);
        while self.0.len() > WINDOW {
            self.0.pop_front();
        }
        match (self.0.front(), self.0.back()) {
            (Some(old), Some(new)) => frame(old, new),
            _ => Frame::default(),
        }
    }
}

/// One sample of the daemon's totals.
pub(super) struct Sample {
    pub at: Instant,
    pub stats: Value,
}

pub(super) fn sample(socket: &PathBuf) -> Result<Sample, String> {
    let stats = crate::ctl::exchange(socket, &json!({"verb": "stats"}))?;
    if stats.get("ok").and_then(Value::as_bool) != Some(true) {
        return Err(stats
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the daemon refused `stats`")
            .to_string());
    }
    Ok(Sample {
        at: Instant::now(),
        stats,
    })
}

/// What one frame shows: a title, the workers' line and two tables.
#[derive(Default)]
pub(super) struct Frame {
    pub title: String,
    pub workers: String,
    pub sessions: Table,
    pub devices: Table,
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

/// The same item (session or device) in the earlier sample, if it was there.
fn earlier<'a>(
    before: &'a [Value],
    key: &str,
    key_of: impl Fn(&Value) -> String,
) -> Option<&'a Value> {
    before.iter().find(|b| key_of(b) == key)
}

/// The rate of `field` between `old` (absent: the item is new, its totals all recent) and `now`.
fn rate(old: Option<&Value>, now: &Value, field: &str, secs: f64) -> f64 {
    ((num(now, field) - old.map_or(0.0, |o| num(o, field))) / secs).max(0.0)
}

/// The p50 and p99 latency in ms of the commands timed between two samples of a `stats`
/// latency object (count, sum_ns, buckets over `bounds_ns` then +Inf), interpolated within
/// the bucket as Prometheus' histogram_quantile does; None without commands.
pub(super) fn percentiles(
    old: Option<&Value>,
    now: &Value,
    bounds_ns: &[f64],
) -> Option<(f64, f64)> {
    let new = buckets(now);
    let was = old.map(buckets).unwrap_or_default();
    let delta: Vec<f64> = new
        .iter()
        .enumerate()
        .map(|(i, n)| (n - was.get(i).copied().unwrap_or(0.0)).max(0.0))
        .collect();
    let total: f64 = delta.iter().sum();
    if total <= 0.0 {
        return None;
    }
    let quantile = |q: f64| {
        let rank = q * total;
        let mut below = 0.0;
        for (i, n) in delta.iter().enumerate() {
            if below + n >= rank && *n > 0.0 {
                let lower = if i == 0 {
                    0.0
                } else {
                    bounds_ns.get(i - 1).copied().unwrap_or(0.0)
                };
                // The +Inf bucket: its lower bound is all that is known.
                let Some(&upper) = bounds_ns.get(i) else {
                    return lower / 1e6;
                };
                return (lower + (upper - lower) * (rank - below) / n) / 1e6;
            }
            below += n;
        }
        bounds_ns.last().copied().unwrap_or(0.0) / 1e6
    };
    Some((quantile(0.5), quantile(0.99)))
}

fn buckets(v: &Value) -> Vec<f64> {
    v.get("buckets")
        .and_then(Value::as_array)
        .map(|b| b.iter().map(|n| n.as_f64().unwrap_or(0.0)).collect())
        .unwrap_or_default()
}

/// A latency in ms, with three decimals below 10 ms; "-" without commands.
fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v < 10.0 => format!("{v:.3}"),
        Some(v) => format!("{v:.1}"),
    }
}

pub(super) fn frame(before: &Sample, now: &Sample) -> Frame {
    let secs = now
        .at
        .saturating_duration_since(before.at)
        .as_secs_f64()
        .max(1e-3);
    let bounds: Vec<f64> = listed(now, "latency_bounds_ns")
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    let (old_sessions, sessions) = (listed(before, "sessions"), listed(now, "sessions"));
    let (old_devices, devices) = (listed(before, "devices"), listed(now, "devices"));
    let window = Span {
        secs,
        bounds: &bounds,
    };
    Frame {
        title: format!(
            "ferrosan top: {}, {}; rates over the last {secs:.1} s",
            crate::counted(sessions.len(), "session"),
            crate::counted(devices.len(), "device")
        ),
        workers: workers_line(&listed(now, "workers")),
        sessions: sessions_table(&old_sessions, &sessions, &window),
        devices: devices_table(&old_devices, &devices, &window),
    }
}

/// The window's length and the latency histogram's bounds.
struct Span<'a> {
    secs: f64,
    bounds: &'a [f64],
}

fn sessions_table(old: &[Value], now: &[Value], w: &Span<'_>) -> Table {
    let all = total(old, now, session_key);
    let total = Activity::of(&[], &all, |_| String::new(), w);
    let mut total_cells = vec![
        String::new(),
        String::new(),
        format!("all {}", crate::counted(now.len(), "session")),
        String::new(),
        String::new(),
        String::new(),
    ];
    total_cells.extend(total.cells());
    Table {
        columns: vec![
            col("ID"),
            col_drop("DOOR", 4),
            name_col("INITIATOR"),
            // Left out first as the width shrinks: the source, the I/O size, the target
            // (often the same on every row), the door, the read/write split, the path.
            name_col_drop("PORTAL", 6),
            name_col_drop("TARGET", 3),
            name_col_drop("SOURCE", 1),
            col("READ/s"),
            col("WRITE/s"),
            col("MB/s"),
            col_drop("KiB/IO", 2),
            col_drop("RD_ms", 5),
            col_drop("WR_ms", 5),
            col("P99_ms"),
            col("QD"),
        ],
        rows: now.iter().map(|s| session_row(old, s, w)).collect(),
        total: (now.len() > 1).then(|| total.row(total_cells, String::new())),
    }
}

fn devices_table(old: &[Value], now: &[Value], w: &Span<'_>) -> Table {
    let all = total(old, now, device_key);
    let total = Activity::of(&[], &all, |_| String::new(), w);
    let mut total_cells = vec![
        format!("all {}", crate::counted(now.len(), "device")),
        String::new(),
    ];
    total_cells.extend(total.cells());
    let queued: u64 = now.iter().filter_map(|d| d["in_flight"].as_u64()).sum();
    let errors = rate(None, &all, "errors", w.secs);
    total_cells.extend([queued.to_string(), format!("{errors:.0}"), String::new()]);
    Table {
        columns: vec![
            name_col("DEVICE"),
            name_col_drop("LUN", 5),
            col("READ/s"),
            col("WRITE/s"),
            col("MB/s"),
            col_drop("KiB/IO", 2),
            col_drop("RD_ms", 3),
            col_drop("WR_ms", 3),
            col("P99_ms"),
            col("QD"),
            col_drop("QUEUED", 1),
            col_drop("ERR/s", 4),
            col("STATE"),
        ],
        rows: now.iter().map(|d| device_row(old, d, w)).collect(),
        total: (now.len() > 1).then(|| total.row(total_cells, String::new())),
    }
}

/// What the items of `now` did since `old` (each found there by `key_of`; a new one counts
/// whole), added up: one item whose rates and latencies are the table's. Items gone since
/// `old` are not in it, so their counters cannot make the sum go back.
fn total(old: &[Value], now: &[Value], key_of: fn(&Value) -> String) -> Value {
    let mut sum = Counters::default();
    for item in now {
        let was = earlier(old, &key_of(item), key_of);
        sum.add(item, 1.0);
        if let Some(was) = was {
            sum.add(was, -1.0);
        }
    }
    sum.to_json()
}

/// The counters of `stats` items, added with a sign.
#[derive(Default)]
struct Counters {
    fields: [f64; 5],
    latency: [(Vec<f64>, f64, f64); 2],
}

const FIELDS: [&str; 5] = ["reads", "writes", "read_bytes", "write_bytes", "errors"];
const LATENCIES: [&str; 2] = ["read_latency", "write_latency"];

impl Counters {
    fn add(&mut self, item: &Value, sign: f64) {
        for (sum, field) in self.fields.iter_mut().zip(FIELDS) {
            *sum += sign * num(item, field);
        }
        for ((buckets, count, sum_ns), op) in self.latency.iter_mut().zip(LATENCIES) {
            let theirs = self::buckets(&item[op]);
            if buckets.len() < theirs.len() {
                buckets.resize(theirs.len(), 0.0);
            }
            for (b, n) in buckets.iter_mut().zip(theirs) {
                *b += sign * n;
            }
            *count += sign * num(&item[op], "count");
            *sum_ns += sign * num(&item[op], "sum_ns");
        }
    }

    fn to_json(&self) -> Value {
        let mut v = json!({});
        for (sum, field) in self.fields.iter().zip(FIELDS) {
            v[field] = json!(sum.max(0.0));
        }
        for ((buckets, count, sum_ns), op) in self.latency.iter().zip(LATENCIES) {
            let buckets: Vec<f64> = buckets.iter().map(|b| b.max(0.0)).collect();
            v[op] = json!({"buckets": buckets, "count": count.max(0.0), "sum_ns": sum_ns.max(0.0)});
        }
        v
    }
}

fn session_key(v: &Value) -> String {
    format!("{}/{}/{}", v["door"], v["target"], v["tsih"])
}

fn device_key(v: &Value) -> String {
    crate::ctl::text(&v["device"])
}

/// The workers' load: each one's busy share and connections.
fn workers_line(workers: &[Value]) -> String {
    if workers.is_empty() {
        return String::new();
    }
    let each: Vec<String> = workers
        .iter()
        .map(|w| {
            format!(
                "#{} {:.0}% busy, {}",
                w["worker"],
                num(w, "busy") * 100.0,
                crate::counted(
                    w["connections"].as_u64().unwrap_or(0) as usize,
                    "connection"
                )
            )
        })
        .collect();
    format!("workers: {}", each.join("; "))
}

fn listed(s: &Sample, key: &str) -> Vec<Value> {
    s.stats
        .get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// Reads and writes together: the p50 and p99 of all the item's commands in the window.
fn both_percentiles(old: Option<&Value>, now: &Value, bounds: &[f64]) -> Option<(f64, f64)> {
    let merged = |v: &Value| -> Value {
        let (r, w) = (buckets(&v["read_latency"]), buckets(&v["write_latency"]));
        let n = r.len().max(w.len());
        let sum: Vec<f64> = (0..n)
            .map(|i| r.get(i).unwrap_or(&0.0) + w.get(i).unwrap_or(&0.0))
            .collect();
        json!({ "buckets": sum })
    };
    percentiles(old.map(merged).as_ref(), &merged(now), bounds)
}

/// An item's I/O over the window (a session, a device or a table's total, found in the older
/// sample by `key_of`): what the tables show of it and sort it by.
struct Activity<'a> {
    was: Option<&'a Value>,
    reads: f64,
    writes: f64,
    bytes: f64,
    /// The average read and write latency in ms (None without such commands).
    read_ms: Option<f64>,
    write_ms: Option<f64>,
    latency: Option<(f64, f64)>,
    /// Reads and writes in flight on average (Little's law: their time in the target per
    /// second, as iostat's aqu-sz).
    qd: f64,
}

impl<'a> Activity<'a> {
    fn of(
        old: &'a [Value],
        now: &Value,
        key_of: impl Fn(&Value) -> String,
        w: &Span<'_>,
    ) -> Activity<'a> {
        let was = earlier(old, &key_of(now), key_of);
        let r = |f: &str| rate(was, now, f, w.secs);
        let delta = |op: &str, key: &str| {
            let of = |v: &Value| num(&v[op], key);
            (of(now) - was.map_or(0.0, of)).max(0.0)
        };
        let average = |op: &str| {
            let n = delta(op, "count");
            (n > 0.0).then(|| delta(op, "sum_ns") / n / 1e6)
        };
        Activity {
            was,
            reads: r("reads"),
            writes: r("writes"),
            bytes: r("read_bytes") + r("write_bytes"),
            read_ms: average("read_latency"),
            write_ms: average("write_latency"),
            latency: both_percentiles(was, now, w.bounds),
            qd: (delta("read_latency", "sum_ns") + delta("write_latency", "sum_ns")) / 1e9 / w.secs,
        }
    }

    /// READ/s, WRITE/s, MB/s, KiB/IO, RD_ms, WR_ms, P99_ms, QD.
    fn cells(&self) -> [String; 8] {
        let ios = self.reads + self.writes;
        [
            format!("{:.0}", self.reads),
            format!("{:.0}", self.writes),
            format!("{:.1}", self.bytes / 1e6),
            if ios > 0.0 {
                format!("{:.1}", self.bytes / ios / 1024.0)
            } else {
                "-".into()
            },
            ms(self.read_ms),
            ms(self.write_ms),
            ms(self.latency.map(|l| l.1)),
            format!("{:.1}", self.qd),
        ]
    }

    fn row(&self, cells: Vec<String>, name: String) -> Row {
        Row {
            cells,
            iops: self.reads + self.writes,
            mb: self.bytes,
            p99: self.latency.map_or(0.0, |l| l.1),
            qd: self.qd,
            name,
        }
    }
}

/// A session's door as people name it.
fn door(s: &Value) -> String {
    match s["door"].as_str() {
        Some(d) if d.starts_with("nvme") => "NVMe".into(),
        Some("iscsi") => "iSCSI".into(),
        Some(other) => other.into(),
        None => "-".into(),
    }
}

fn session_row(old: &[Value], s: &Value, w: &Span<'_>) -> Row {
    let a = Activity::of(old, s, session_key, w);
    let initiator = crate::ctl::text(&s["initiator"]);
    let mut cells = vec![
        crate::ctl::text(&s["tsih"]),
        door(s),
        initiator.clone(),
        crate::ctl::text(&s["portal"]),
        crate::ctl::text(&s["target"]),
        crate::ctl::text(&s["source"]),
    ];
    cells.extend(a.cells());
    a.row(cells, initiator)
}

/// The LUN numbers a device is mapped as (`0`, `0,3`), `-` where it is mapped nowhere.
fn lun_numbers(d: &Value) -> String {
    let mut luns: Vec<u64> = d["luns"]
        .as_array()
        .map(|l| l.iter().filter_map(|m| m["lun"].as_u64()).collect())
        .unwrap_or_default();
    luns.sort_unstable();
    luns.dedup();
    if luns.is_empty() {
        return "-".into();
    }
    luns.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn device_row(old: &[Value], d: &Value, w: &Span<'_>) -> Row {
    let a = Activity::of(old, d, device_key, w);
    let name = crate::ctl::text(&d["device"]);
    let mut cells = vec![name.clone(), lun_numbers(d)];
    cells.extend(a.cells());
    cells.extend([
        crate::ctl::text(&d["in_flight"]),
        format!("{:.0}", rate(a.was, d, "errors", w.secs)),
        if d["offline"].as_bool() == Some(true) {
            "OFFLINE".into()
        } else {
            "online".into()
        },
    ]);
    a.row(cells, name)
}
