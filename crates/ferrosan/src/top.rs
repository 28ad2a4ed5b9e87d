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

/// What one frame shows: a title and two tables (header, rows).
#[derive(Default)]
struct Frame {
    title: String,
    sessions: (Vec<&'static str>, Vec<Vec<String>>),
    devices: (Vec<&'static str>, Vec<Vec<String>>),
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

/// Rates between `before` and `now` for the items of `list` matched by `key`.
fn rate(
    before: &[Value],
    item: &Value,
    key_of: impl Fn(&Value) -> String,
    field: &str,
    secs: f64,
) -> f64 {
    let key = key_of(item);
    // Absent before: it is new (a session that logged in since), its totals are all recent.
    let earlier = before
        .iter()
        .find(|b| key_of(b) == key)
        .map_or(0.0, |b| num(b, field));
    ((num(item, field) - earlier) / secs).max(0.0)
}

fn mb(bytes_per_s: f64) -> String {
    format!("{:.1}", bytes_per_s / 1e6)
}

fn frame(before: &Sample, now: &Sample) -> Frame {
    let secs = now
        .at
        .saturating_duration_since(before.at)
        .as_secs_f64()
        .max(1e-3);
    let (old_sessions, sessions) = (listed(before, "sessions"), listed(now, "sessions"));
    let (old_devices, devices) = (listed(before, "devices"), listed(now, "devices"));
    Frame {
        title: format!(
            "ferrosan top: {} sessions, {} devices; rates over the last {secs:.1} s",
            sessions.len(),
            devices.len()
        ),
        sessions: (
            vec![
                "TSIH",
                "INITIATOR",
                "TARGET",
                "SOURCE",
                "READ/s",
                "WRITE/s",
                "RMB/s",
                "WMB/s",
            ],
            session_rows(&old_sessions, &sessions, secs),
        ),
        devices: (
            vec![
                "DEVICE", "READ/s", "WRITE/s", "RMB/s", "WMB/s", "RLAT_ms", "WLAT_ms", "QUEUED",
                "ERR/s", "STATE",
            ],
            devices
                .iter()
                .map(|d| device_row(&old_devices, d, secs))
                .collect(),
        ),
    }
}

fn listed(s: &Sample, key: &str) -> Vec<Value> {
    s.stats
        .get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// One row per session, the busiest first.
fn session_rows(old: &[Value], sessions: &[Value], secs: f64) -> Vec<Vec<String>> {
    let session_key = |v: &Value| format!("{}/{}", v["target"], v["tsih"]);
    let mut rows: Vec<(f64, Vec<String>)> = sessions
        .iter()
        .map(|s| {
            let r = |f: &str| rate(old, s, session_key, f, secs);
            let (reads, writes) = (r("reads"), r("writes"));
            (
                reads + writes,
                vec![
                    crate::ctl::text(&s["tsih"]),
                    crate::ctl::text(&s["initiator"]),
                    crate::ctl::text(&s["target"]),
                    crate::ctl::text(&s["source"]),
                    format!("{reads:.0}"),
                    format!("{writes:.0}"),
                    mb(r("read_bytes")),
                    mb(r("write_bytes")),
                ],
            )
        })
        .collect();
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    rows.into_iter().map(|(_, row)| row).collect()
}

fn device_row(old: &[Value], d: &Value, secs: f64) -> Vec<String> {
    let device_key = |v: &Value| crate::ctl::text(&v["device"]);
    let r = |f: &str| rate(old, d, device_key, f, secs);
    // Mean latency of the commands finished in the interval.
    let latency = |op: &str| {
        let n = r(&format!("{op}_latency_count"));
        let ns = r(&format!("{op}_latency_ns"));
        if n > 0.0 {
            format!("{:.3}", ns / n / 1e6)
        } else {
            "-".into()
        }
    };
    vec![
        crate::ctl::text(&d["device"]),
        format!("{:.0}", r("reads")),
        format!("{:.0}", r("writes")),
        mb(r("read_bytes")),
        mb(r("write_bytes")),
        latency("read"),
        latency("write"),
        crate::ctl::text(&d["in_flight"]),
        format!("{:.0}", r("errors")),
        if d["offline"].as_bool() == Some(true) {
            "OFFLINE".into()
        } else {
            "online".into()
        },
    ]
}

fn plain(frame: &Frame) -> String {
    format!(
        "{}\n\n{}\n{}",
        frame.title,
        crate::ctl::table(&frame.sessions.0, frame.sessions.1.clone()),
        crate::ctl::table(&frame.devices.0, frame.devices.1.clone())
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
    let result = match args.batch {
        Some(frames) => batch(&socket, first, interval, frames),
        None => interactive(&socket, first, interval),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrosan top: {e}");
            ExitCode::from(1)
        }
    }
}

fn batch(socket: &PathBuf, first: Sample, interval: Duration, frames: u32) -> Result<(), String> {
    let mut window = Window::new(first);
    for _ in 0..frames {
        std::thread::sleep(interval);
        println!("{}", plain(&window.push(sample(socket)?)));
    }
    Ok(())
}

fn interactive(socket: &PathBuf, first: Sample, interval: Duration) -> Result<(), String> {
    let mut window = Window::new(first);
    let mut terminal = ratatui::try_init().map_err(|e| format!("terminal: {e}"))?;
    let mut shown: Option<Frame> = None;
    let mut next = Instant::now() + interval;
    let outcome = loop {
        if Instant::now() >= next {
            match sample(socket) {
                Ok(now) => shown = Some(window.push(now)),
                Err(e) => break Err(e),
            }
            next = Instant::now() + interval;
        }
        if let Err(e) = terminal.draw(|f| draw(f, shown.as_ref())) {
            break Err(format!("terminal: {e}"));
        }
        match quit_pressed(next.saturating_duration_since(Instant::now())) {
            Ok(false) => {}
            Ok(true) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    ratatui::restore();
    outcome
}

/// Draws a frame: its title, the sessions and devices tables, the help line.
fn draw(f: &mut ratatui::Frame<'_>, shown: Option<&Frame>) {
    use ratatui::layout::{Constraint, Layout};
    use ratatui::widgets::Paragraph;
    let [title, sessions, devices, help] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Percentage(55),
        Constraint::Fill(1),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let Some(frame) = shown else {
        f.render_widget(Paragraph::new("ferrosan top: sampling..."), title);
        return;
    };
    f.render_widget(Paragraph::new(frame.title.as_str()), title);
    f.render_widget(widget_table(&frame.sessions, "sessions"), sessions);
    f.render_widget(widget_table(&frame.devices, "devices"), devices);
    f.render_widget(Paragraph::new("q: quit"), help);
}

/// A table whose columns are as wide as their widest cell.
fn widget_table<'a>(
    (header, rows): &'a (Vec<&'static str>, Vec<Vec<String>>),
    name: &'static str,
) -> ratatui::widgets::Table<'a> {
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
    Table::new(rows.iter().map(|r| Row::new(r.clone())), widths)
        .header(Row::new(header.clone()).style(Style::new().add_modifier(Modifier::BOLD)))
        .column_spacing(2)
        .block(Block::bordered().title(name))
}

/// Waits up to `wait` for a key: true for q, Esc or Ctrl-C.
fn quit_pressed(wait: Duration) -> Result<bool, String> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    let terminal = |e: std::io::Error| format!("terminal: {e}");
    if !event::poll(wait).map_err(terminal)? {
        return Ok(false);
    }
    match event::read().map_err(terminal)? {
        Event::Key(k) if k.kind == KeyEventKind::Press => {
            let ctrl_c =
                k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
            Ok(matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
        }
        _ => Ok(false),
    }
}
