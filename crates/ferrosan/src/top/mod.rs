//! `ferrosan top`: a live view of sessions and devices in the spirit of esxtop, fed by the
//! control socket's `stats` (totals since start). The daemon's counters move once a second, so
//! a rate is taken over the last `WINDOW` intervals (at least 3 s by default), not the last
//! one alone, which would read 0 or twice the truth. A terminal UI (ratatui) by default;
//! `--batch N` prints N plain frames instead, for scripts and logs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;

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

mod fit;
mod frame;

use fit::shown;
use frame::{sample, Frame, Sample, Window};

fn plain(frame: &Frame, view: &View) -> String {
    let (sh, sr) = shown(&frame.sessions, view);
    let (dh, dr) = shown(&frame.devices, view);
    format!(
        "{}\n{}\n\n{}\n{}",
        frame.title,
        frame.workers,
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
    let area = f.area();
    let Some(frame) = latest else {
        f.render_widget(Paragraph::new("ferrosan top: sampling..."), area);
        return;
    };
    // The tables' borders take 2 columns.
    let view = View {
        width: Some(usize::from(area.width.saturating_sub(2))),
        ..view.clone()
    };
    let (sessions_shown, devices_shown) =
        (shown(&frame.sessions, &view), shown(&frame.devices, &view));
    // Each box as tall as its rows (borders and header: 3 lines), the sessions' at most
    // 60 % of the screen; what is left stays blank above the help line.
    let tall = |rows: usize| u16::try_from(rows + 3).unwrap_or(u16::MAX);
    let [title, workers, sessions, devices, _, help] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Max(tall(sessions_shown.1.len()).min(area.height.saturating_mul(3) / 5)),
        Constraint::Max(tall(devices_shown.1.len())),
        Constraint::Fill(1),
        Constraint::Length(1),
    ])
    .areas(area);
    f.render_widget(Paragraph::new(frame.title.as_str()), title);
    f.render_widget(Paragraph::new(frame.workers.as_str()), workers);
    f.render_widget(widget_table(sessions_shown, "sessions"), sessions);
    f.render_widget(widget_table(devices_shown, "devices"), devices);
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
mod tests;
