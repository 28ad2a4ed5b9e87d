//! `ferrosan top`: a live view of sessions and devices in the spirit of esxtop, fed by the
//! control socket's `stats` (totals since start). The daemon's counters move once a second, so
//! a rate is taken over the last `WINDOW` intervals (at least 3 s by default), not the last
//! one alone, which would read 0 or twice the truth. A terminal UI (ratatui) by default;
//! `--batch N` prints N plain frames instead, for scripts and logs.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};

#[derive(Args)]
pub struct TopArgs {
    /// The daemon's control socket (default: the daemon's default for this user).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Seconds between samples.
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
    /// Print this many frames as plain text, one per interval, and exit (no terminal UI).
    #[arg(long)]
    batch: Option<u32>,
    /// Row order: iops (busiest first), latency (slowest p99 first), mb (most bytes first),
    /// qd (deepest average queue first) or name. In the terminal: the keys i, l, m, d, n.
    #[arg(long, value_enum, default_value_t = Sort::Iops)]
    sort: Sort,
    /// Only the rows that contain this text (initiator, target, portal, source, device or
    /// LUN; case-insensitive). In the terminal: / then the text, Enter; Esc clears it.
    #[arg(long)]
    filter: Option<String>,
}

/// How rows are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Sort {
    Iops,
    Latency,
    Mb,
    Qd,
    Name,
}

/// What the operator chose to see: the order, the filter, the width to fit.
#[derive(Clone, Debug)]
struct View {
    sort: Sort,
    filter: String,
    /// Columns available; None: as wide as the data (plain frames to a file or pipe).
    width: Option<usize>,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.1..=3600.0).contains(&v) {
        Ok(v)
    } else {
        Err("between 0.1 and 3600 seconds".into())
    }
}

/// Samples a rate spans (intervals = WINDOW - 1).
const WINDOW: usize = 4;

/// The samples of the current window, oldest first.
struct Window(VecDeque<Sample>);

impl Window {
    fn new(first: Sample) -> Window {
        Window(VecDeque::from([first]))
    }
    /// Adds `now` and returns the frame from the oldest sample kept to it.
    fn push(&mut self, now: Sample) -> Frame {
        self.0.push_back(now);
        while self.0.len() > WINDOW {
            self.0.pop_front();
        }
        match (self.0.front(), self.0.back()) {
            (Some(old), Some(new)) => frame(old, new),
            // Not reached: `now` was just pushed.
            _ => Frame::default(),
        }
    }
}

/// One sample of the daemon's totals.
struct Sample {
    at: Instant,
    stats: Value,
}

fn sample(socket: &PathBuf) -> Result<Sample, String> {
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

/// What one frame shows: a title and two tables.
#[derive(Default)]
struct Frame {
    title: String,
    sessions: Table,
    devices: Table,
}

/// A table before the view is applied: its columns and rows.
#[derive(Default)]
struct Table {
    columns: Vec<Column>,
    rows: Vec<Row>,
}

/// A column: its header, whether it holds a name that may be shortened (keeping its
/// distinctive end) to fit the width, and whether it may be left out altogether.
#[derive(Clone, Copy)]
struct Column {
    header: &'static str,
    name: bool,
    droppable: bool,
}

const fn col(header: &'static str) -> Column {
    Column {
        header,
        name: false,
        droppable: false,
    }
}

const fn name_col(header: &'static str) -> Column {
    Column {
        header,
        name: true,
        droppable: false,
    }
}

const fn droppable_name_col(header: &'static str) -> Column {
    Column {
        header,
        name: true,
        droppable: true,
    }
}

/// One row: its cells and what it sorts by.
struct Row {
    cells: Vec<String>,
    iops: f64,
    mb: f64,
    /// The p99 latency in ms over the window (0 without commands).
    p99: f64,
    /// Reads and writes in flight on average over the window.
    qd: f64,
    name: String,
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

fn mb(bytes_per_s: f64) -> String {
    format!("{:.1}", bytes_per_s / 1e6)
}

/// The p50 and p99 latency in ms of the commands timed between two samples of a `stats`
/// latency object (count, sum_ns, buckets over `bounds_ns` then +Inf), interpolated within
/// the bucket as Prometheus' histogram_quantile does; None without commands.
fn percentiles(old: Option<&Value>, now: &Value, bounds_ns: &[f64]) -> Option<(f64, f64)> {
    let buckets = |v: &Value| -> Vec<f64> {
        v.get("buckets")
            .and_then(Value::as_array)
            .map(|b| b.iter().map(|n| n.as_f64().unwrap_or(0.0)).collect())
            .unwrap_or_default()
    };
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

fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v < 10.0 => format!("{v:.3}"),
        Some(v) => format!("{v:.1}"),
    }
}

fn frame(before: &Sample, now: &Sample) -> Frame {
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
    Frame {
        title: format!(
            "ferrosan top: {}, {}; rates over the last {secs:.1} s",
            crate::counted(sessions.len(), "session"),
            crate::counted(devices.len(), "device")
        ),
        sessions: Table {
            columns: vec![
                col("TSIH"),
                name_col("INITIATOR"),
                // Dropped last first as the width shrinks: a path (its portal) says more
                // than the target, which is often the same on every row.
                droppable_name_col("PORTAL"),
                droppable_name_col("TARGET"),
                droppable_name_col("SOURCE"),
                col("READ/s"),
                col("WRITE/s"),
                col("MB/s"),
                col("P50_ms"),
                col("P99_ms"),
                col("QD"),
            ],
            rows: sessions
                .iter()
                .map(|s| session_row(&old_sessions, s, secs, &bounds))
                .collect(),
        },
        devices: Table {
            columns: vec![
                name_col("DEVICE"),
                droppable_name_col("LUN"),
                col("READ/s"),
                col("WRITE/s"),
                col("MB/s"),
                col("P50_ms"),
                col("P99_ms"),
                col("QD"),
                col("QUEUED"),
                col("ERR/s"),
                col("STATE"),
            ],
            rows: devices
                .iter()
                .map(|d| device_row(&old_devices, d, secs, &bounds))
                .collect(),
        },
    }
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
        let b = |op: &str| -> Vec<f64> {
            v[op]["buckets"]
                .as_array()
                .map(|b| b.iter().map(|n| n.as_f64().unwrap_or(0.0)).collect())
                .unwrap_or_default()
        };
        let (r, w) = (b("read_latency"), b("write_latency"));
        let n = r.len().max(w.len());
        let sum: Vec<f64> = (0..n)
            .map(|i| r.get(i).unwrap_or(&0.0) + w.get(i).unwrap_or(&0.0))
            .collect();
        json!({ "buckets": sum })
    };
    percentiles(old.map(merged).as_ref(), &merged(now), bounds)
}

/// An item's I/O over the window (a session or a device, found in the older sample by
/// `key_of`): what both tables show of it and sort it by.
struct Activity<'a> {
    was: Option<&'a Value>,
    reads: f64,
    writes: f64,
    bytes: f64,
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
        secs: f64,
        bounds: &[f64],
    ) -> Activity<'a> {
        let was = earlier(old, &key_of(now), key_of);
        let r = |f: &str| rate(was, now, f, secs);
        let busy_ns = |op: &str| {
            let sum = |v: &Value| v[op]["sum_ns"].as_f64().unwrap_or(0.0);
            (sum(now) - was.map_or(0.0, sum)).max(0.0)
        };
        Activity {
            was,
            reads: r("reads"),
            writes: r("writes"),
            bytes: r("read_bytes") + r("write_bytes"),
            latency: both_percentiles(was, now, bounds),
            qd: (busy_ns("read_latency") + busy_ns("write_latency")) / 1e9 / secs,
        }
    }

    /// READ/s, WRITE/s, MB/s, P50_ms, P99_ms, QD.
    fn cells(&self) -> [String; 6] {
        [
            format!("{:.0}", self.reads),
            format!("{:.0}", self.writes),
            mb(self.bytes),
            ms(self.latency.map(|l| l.0)),
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

fn session_row(old: &[Value], s: &Value, secs: f64, bounds: &[f64]) -> Row {
    let key_of = |v: &Value| format!("{}/{}", v["target"], v["tsih"]);
    let a = Activity::of(old, s, key_of, secs, bounds);
    let initiator = crate::ctl::text(&s["initiator"]);
    let mut cells = vec![
        crate::ctl::text(&s["tsih"]),
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

fn device_row(old: &[Value], d: &Value, secs: f64, bounds: &[f64]) -> Row {
    let key_of = |v: &Value| crate::ctl::text(&v["device"]);
    let a = Activity::of(old, d, key_of, secs, bounds);
    let name = crate::ctl::text(&d["device"]);
    let mut cells = vec![name.clone(), lun_numbers(d)];
    cells.extend(a.cells());
    cells.extend([
        crate::ctl::text(&d["in_flight"]),
        format!("{:.0}", rate(a.was, d, "errors", secs)),
        if d["offline"].as_bool() == Some(true) {
            "OFFLINE".into()
        } else {
            "online".into()
        },
    ]);
    a.row(cells, name)
}

/// A table as the view shows it: filtered, sorted, and fitted to the width (name columns
/// shortened from the front, then SOURCE-like name columns dropped, last first).
fn shown(table: &Table, view: &View) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let needle = view.filter.to_lowercase();
    let mut rows: Vec<&Row> = table
        .rows
        .iter()
        .filter(|r| needle.is_empty() || r.cells.iter().any(|c| c.to_lowercase().contains(&needle)))
        .collect();
    match view.sort {
        Sort::Iops => rows.sort_by(|a, b| b.iops.total_cmp(&a.iops)),
        Sort::Latency => rows.sort_by(|a, b| b.p99.total_cmp(&a.p99)),
        Sort::Mb => rows.sort_by(|a, b| b.mb.total_cmp(&a.mb)),
        Sort::Qd => rows.sort_by(|a, b| b.qd.total_cmp(&a.qd)),
        Sort::Name => rows.sort_by(|a, b| a.name.cmp(&b.name)),
    }
    let mut keep: Vec<bool> = vec![true; table.columns.len()];
    let widths = |keep: &[bool], cap: usize| -> Vec<usize> {
        table
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let widest = rows
                    .iter()
                    .filter_map(|r| r.cells.get(i))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
                    .max(c.header.len());
                match (keep[i], c.name) {
                    (false, _) => 0,
                    (true, true) => widest.min(cap.max(c.header.len())),
                    (true, false) => widest,
                }
            })
            .collect()
    };
    let total = |w: &[usize], keep: &[bool]| -> usize {
        w.iter()
            .zip(keep)
            .filter(|(_, k)| **k)
            .map(|(w, _)| w + 2)
            .sum()
    };
    let mut cap = usize::MAX;
    if let Some(width) = view.width {
        // Names shortened to 18 characters, then the rightmost droppable column left out,
        // names down to 10, then the next one.
        let steps = [
            Some(40),
            Some(32),
            Some(24),
            Some(18),
            None,
            Some(14),
            Some(12),
            Some(10),
        ];
        for step in steps
            .into_iter()
            .chain(std::iter::repeat_n(None, keep.len()))
        {
            if total(&widths(&keep, cap), &keep) <= width {
                break;
            }
            match step {
                Some(c) => cap = c,
                None => {
                    let last = (0..keep.len())
                        .rev()
                        .find(|&i| keep[i] && table.columns[i].droppable);
                    match last {
                        Some(i) => keep[i] = false,
                        None => break,
                    }
                }
            }
        }
    }
    // Leaving columns out may have made room: names as long as now fits.
    if let Some(width) = view.width {
        if let Some(wider) = [40, 32, 24, 18, 14, 12]
            .into_iter()
            .find(|&c| c > cap && total(&widths(&keep, c), &keep) <= width)
        {
            cap = wider;
        }
    }
    let w = widths(&keep, cap);
    let header = table
        .columns
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(c, _)| c.header)
        .collect();
    let rows = rows
        .iter()
        .map(|r| {
            r.cells
                .iter()
                .enumerate()
                .filter(|(i, _)| keep[*i])
                .map(|(i, c)| {
                    if table.columns[i].name {
                        fit(c, w[i])
                    } else {
                        c.clone()
                    }
                })
                .collect()
        })
        .collect();
    (header, rows)
}

/// `s` in at most `width` characters: its end kept (an IQN's distinctive part), "…" before.
fn fit(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width || width == 0 {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - (width - 1)).collect();
    format!("…{tail}")
}

fn plain(frame: &Frame, view: &View) -> String {
    let (sh, sr) = shown(&frame.sessions, view);
    let (dh, dr) = shown(&frame.devices, view);
    format!(
        "{}\n\n{}\n{}",
        frame.title,
        crate::ctl::table(&sh, sr),
        crate::ctl::table(&dh, dr)
    )
}

pub fn run(args: TopArgs) -> ExitCode {
    let Some(socket) = args
        .socket
        .clone()
        .or_else(engine::control::default_socket_path)
    else {
        eprintln!("ferrosan top: no default control socket (neither XDG_RUNTIME_DIR nor HOME is set): give --socket PATH");
        return ExitCode::from(2);
    };
    let interval = Duration::from_secs_f64(args.interval);
    let first = match sample(&socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrosan top: {e}");
            return ExitCode::from(2);
        }
    };
    let view = View {
        sort: args.sort,
        filter: args.filter.clone().unwrap_or_default(),
        width: None,
    };
    let result = match args.batch {
        Some(frames) => batch(&socket, first, interval, frames, view),
        None => interactive(&socket, first, interval, view),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrosan top: {e}");
            ExitCode::from(1)
        }
    }
}

fn batch(
    socket: &PathBuf,
    first: Sample,
    interval: Duration,
    frames: u32,
    mut view: View,
) -> Result<(), String> {
    use std::io::IsTerminal as _;
    // On a terminal, fitted to it; into a file or a pipe, every column whole.
    if std::io::stdout().is_terminal() {
        view.width = ratatui::crossterm::terminal::size()
            .ok()
            .map(|(w, _)| usize::from(w));
    }
    let mut window = Window::new(first);
    for _ in 0..frames {
        std::thread::sleep(interval);
        println!("{}", plain(&window.push(sample(socket)?), &view));
    }
    Ok(())
}

fn interactive(
    socket: &PathBuf,
    first: Sample,
    interval: Duration,
    mut view: View,
) -> Result<(), String> {
    let mut window = Window::new(first);
    let mut terminal = ratatui::try_init().map_err(|e| format!("terminal: {e}"))?;
    let mut shown: Option<Frame> = None;
    let mut typing: Option<String> = None;
    let mut next = Instant::now() + interval;
    let outcome = loop {
        if Instant::now() >= next {
            match sample(socket) {
                Ok(now) => shown = Some(window.push(now)),
                Err(e) => break Err(e),
            }
            next = Instant::now() + interval;
        }
        if let Err(e) = terminal.draw(|f| draw(f, shown.as_ref(), &view, typing.as_deref())) {
            break Err(format!("terminal: {e}"));
        }
        match key(next.saturating_duration_since(Instant::now())) {
            Ok(None) => {}
            Ok(Some(k)) => {
                if act(k, &mut view, &mut typing) {
                    break Ok(());
                }
            }
            Err(e) => break Err(e),
        }
    };
    ratatui::restore();
    outcome
}

/// What a key does to the view (or the filter being typed); true to quit.
fn act(key: Key, view: &mut View, typing: &mut Option<String>) -> bool {
    if let Some(text) = typing {
        match key {
            Key::Char(c) => text.push(c),
            Key::Backspace => {
                text.pop();
            }
            Key::Enter => view.filter = typing.take().unwrap_or_default(),
            Key::Esc => *typing = None,
            Key::Quit => return true,
        }
        return false;
    }
    match key {
        Key::Char('q') | Key::Quit => return true,
        Key::Esc => view.filter.clear(),
        Key::Char('i') => view.sort = Sort::Iops,
        Key::Char('l') => view.sort = Sort::Latency,
        Key::Char('m') => view.sort = Sort::Mb,
        Key::Char('d') => view.sort = Sort::Qd,
        Key::Char('n') => view.sort = Sort::Name,
        Key::Char('/') => *typing = Some(String::new()),
        _ => {}
    }
    false
}

/// Draws a frame: its title, the sessions and devices tables fitted to the terminal, the
/// help line (or the filter being typed).
fn draw(f: &mut ratatui::Frame<'_>, latest: Option<&Frame>, view: &View, typing: Option<&str>) {
    use ratatui::layout::{Constraint, Layout};
    use ratatui::widgets::Paragraph;
    let [title, sessions, devices, help] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Percentage(55),
        Constraint::Fill(1),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let Some(frame) = latest else {
        f.render_widget(Paragraph::new("ferrosan top: sampling..."), title);
        return;
    };
    // The tables' borders take 2 columns.
    let view = View {
        width: Some(usize::from(f.area().width.saturating_sub(2))),
        ..view.clone()
    };
    f.render_widget(Paragraph::new(frame.title.as_str()), title);
    f.render_widget(
        widget_table(shown(&frame.sessions, &view), "sessions"),
        sessions,
    );
    f.render_widget(
        widget_table(shown(&frame.devices, &view), "devices"),
        devices,
    );
    let line = match typing {
        Some(text) => format!("filter: {text}_  (Enter: apply, Esc: cancel)"),
        None => format!(
            "q quit  sort: i iops  l p99  m MB/s  d queue  n name [{}]  / filter{}",
            match view.sort {
                Sort::Iops => "iops",
                Sort::Latency => "p99",
                Sort::Mb => "MB/s",
                Sort::Qd => "queue",
                Sort::Name => "name",
            },
            if view.filter.is_empty() {
                String::new()
            } else {
                format!(" [{}] (Esc clears)", view.filter)
            }
        ),
    };
    f.render_widget(Paragraph::new(line), help);
}

/// A table whose columns are as wide as their widest cell.
fn widget_table(
    (header, rows): (Vec<&'static str>, Vec<Vec<String>>),
    name: &'static str,
) -> ratatui::widgets::Table<'static> {
    use ratatui::layout::Constraint;
    use ratatui::style::{Modifier, Style};
    use ratatui::widgets::{Block, Row, Table};
    let widths: Vec<Constraint> = header
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let widest = rows
                .iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
                .max(h.len());
            Constraint::Length(widest as u16)
        })
        .collect();
    Table::new(rows.into_iter().map(Row::new), widths)
        .header(Row::new(header).style(Style::new().add_modifier(Modifier::BOLD)))
        .column_spacing(2)
        .block(Block::bordered().title(name))
}

/// A key that means something to `top`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Char(char),
    Backspace,
    Enter,
    Esc,
    /// Ctrl-C.
    Quit,
}

/// Waits up to `wait` for a key.
fn key(wait: Duration) -> Result<Option<Key>, String> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    let terminal = |e: std::io::Error| format!("terminal: {e}");
    if !event::poll(wait).map_err(terminal)? {
        return Ok(None);
    }
    Ok(match event::read().map_err(terminal)? {
        Event::Key(k) if k.kind == KeyEventKind::Press => match k.code {
            KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => Some(Key::Quit),
            KeyCode::Char(c) => Some(Key::Char(c)),
            KeyCode::Backspace => Some(Key::Backspace),
            KeyCode::Enter => Some(Key::Enter),
            KeyCode::Esc => Some(Key::Esc),
            _ => None,
        },
        _ => None,
    })
}

#[cfg(test)]
mod tests {
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
                droppable_name_col("TARGET"),
                droppable_name_col("SOURCE"),
                col("IOPS"),
            ],
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
            stats: json!({"latency_bounds_ns": BOUNDS, "sessions": [session], "devices": [disk, spare]}),
        }
    }

    thread_local! {
        static START: Instant = Instant::now();
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
                "TSIH",
                "INITIATOR",
                "PORTAL",
                "READ/s",
                "WRITE/s",
                "MB/s",
                "P50_ms",
                "P99_ms",
                "QD"
            ]
        );
        // At 80 columns names keep their distinctive ends: the host, the address and port.
        assert_eq!(rows[0][1], "…n:01:host-a");
        assert_eq!(rows[0][2], "…0.2.10:3260");
        assert_eq!(rows[0][3], "4000");
        assert_eq!(rows[0][8], "4.0");
        let line: usize = rows[0].iter().map(|c| c.chars().count() + 2).sum();
        assert!(line <= 80, "{rows:?}");
        // Wide enough, the target and the source come back.
        let wide = View {
            width: Some(160),
            ..view.clone()
        };
        assert_eq!(shown(&f.sessions, &wide).0.len(), 11);
        let roomy = View {
            width: Some(120),
            ..view.clone()
        };
        let (header, rows) = shown(&f.sessions, &roomy);
        assert_eq!(header[2], "PORTAL");
        assert_eq!(rows[0][2], "192.0.2.10:3260");
        let line: usize = rows[0].iter().map(|c| c.chars().count() + 2).sum();
        assert!(line <= 120, "{rows:?}");
        let (header, rows) = shown(&f.devices, &view);
        assert_eq!(header[..2], ["DEVICE", "LUN"]);
        assert_eq!(rows[0][..2], ["disk0", "0,3"]);
        assert_eq!(rows[1][..2], ["spare", "-"]);
        let qd = header.iter().position(|h| *h == "QD").unwrap();
        assert_eq!(rows[0][qd], "4.0");
        assert_eq!(rows[1][qd], "0.0");
        // The filter finds a session by its portal.
        let by_portal = View {
            filter: "192.0.2.10".into(),
            ..view
        };
        assert_eq!(shown(&f.sessions, &by_portal).1.len(), 1);
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
}
