//! results.json and report.html: one self-contained page, charts as inline SVG, no outside
//! resource (it opens offline, in a mail attachment, from a ticket).

use crate::plan::{size_label, Group, Pattern, Workload, MATRIX_DEPTHS, SWEEP_DEPTH};
use crate::runner::TargetInfo;
use crate::stats::Summary;
use std::fmt::Write as _;

/// One workload on one target.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub target: String,
    pub workload: Workload,
    #[serde(flatten)]
    pub result: Summary,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Results {
    pub tool: String,
    pub version: String,
    /// Seconds since the Unix epoch when the run started.
    pub started_unix_s: u64,
    pub host: String,
    /// What the client ran on: the numbers mean little without it.
    pub machine: Machine,
    pub quick: bool,
    pub writes: bool,
    pub ramp_s: f64,
    pub runtime_s: f64,
    pub targets: Vec<TargetInfo>,
    pub rows: Vec<Row>,
    /// Workloads that could not run on a target, and why.
    pub skipped: Vec<Skipped>,
}

/// The client host: CPU, cores, memory and kernel, as /proc and uname say.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
}

impl Machine {
    /// This host's (a field the host does not tell stays empty or 0).
    pub fn here() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(String::new, |(_, v)| v.trim().to_string());
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| String::new(), |k| k.trim().to_string());
        Machine {
            cpu_model,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_bytes,
            kernel,
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Skipped {
    pub target: String,
    pub workload: String,
    pub reason: String,
}

/// A chart line: its name, colour and (x, y) points.
type Series = (String, &'static str, Vec<(f64, f64)>);

/// A bar chart group: its label and a (target, colour, value) bar per target.
type BarGroup = (String, Vec<(String, &'static str, f64)>);

const COLORS: [&str; 8] = [
    "#1c7ed6", "#d9480f", "#2b8a3e", "#ae3ec9", "#f59f00", "#0ca678", "#e64980", "#495057",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// 1234567 -> "1.23M", 45678 -> "45.7K".
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}K", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 || a == 0.0 {
        format!("{v:.1}")
    } else {
        // Two significant digits: 0.25, 0.01 (a log axis's lower decades).
        let digits = (1 - a.log10().floor() as i32).clamp(1, 9) as usize;
        format!("{v:.digits$}")
    }
}

/// A "nice" axis maximum above `v`: 1, 2 or 5 times a power of ten.
fn nice_max(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * p)
}

/// An SVG element of `w` × `h` with its accessible name and a centred title.
fn svg_open(w: f64, h: f64, title: &str) -> String {
    let t = esc(title);
    format!(
        r#"<svg class="chart" viewBox="0 0 {w} {h:.0}" role="img" aria-label="{t}"><title>{t}</title><text x="{}" y="22" class="title">{t}</text>"#,
        w / 2.0
    )
}

/// How an axis maps values: linear from 0, or logarithmic (latencies, queue depths, sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scale {
    Linear,
    Log,
}

/// A line chart's axes: labels, scales and how x values are written.
struct Axes<'a> {
    xlabel: &'a str,
    ylabel: &'a str,
    x: Scale,
    y: Scale,
    xfmt: fn(f64) -> String,
}

/// The x ticks drawn at most (more distinct points are thinned).
const MAX_X_TICKS: usize = 14;

/// A line chart. `series`: (name, colour, points).
fn line_chart(title: &str, axes: &Axes, series: &[Series]) -> String {
    let (w, h) = (1200.0, 420.0);
    let mut svg = svg_open(w, h, title);
    let points = || series.iter().flat_map(|s| s.2.iter().copied());
    let mut xs: Vec<f64> = points()
        .map(|p| p.0)
        .filter(|x| x.is_finite() && (axes.x == Scale::Linear || *x > 0.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (Some(&xmin), Some(&xmax)) = (xs.first(), xs.last()) else {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" class="axis" text-anchor="middle">no data</text></svg>"#,
            w / 2.0,
            h / 2.0
        );
        return svg;
    };
    let ys = points().map(|p| p.1).filter(|y| y.is_finite());
    let plot = Plot {
        w,
        h,
        x: Range::of(axes.x, xmin, xmax),
        y: match axes.y {
            Scale::Linear => Range::linear(0.0, nice_max(ys.fold(0.0, f64::max))),
            Scale::Log => Range::decades(ys),
        },
    };
    let xticks = match axes.x {
        Scale::Log => {
            let stride = xs.len().div_ceil(MAX_X_TICKS).max(1);
            xs.iter().step_by(stride).copied().collect()
        }
        Scale::Linear => linear_ticks(xmax),
    };
    plot.axes(&mut svg, &xticks, axes);
    for (i, (name, colour, points)) in series.iter().enumerate() {
        // A value that cannot be drawn (NaN, infinite, or not positive on a log x) is left out.
        let drawable = points
            .iter()
            .filter(|(x, y)| {
                x.is_finite() && y.is_finite() && (axes.x == Scale::Linear || *x > 0.0)
            })
            .copied()
            .collect();
        plot.series(&mut svg, i, &(name.clone(), *colour, drawable));
    }
    svg.push_str("</svg>");
    svg
}

/// Ticks from 0 to `max` at a 1, 2 or 5 step, about five of them.
fn linear_ticks(max: f64) -> Vec<f64> {
    let step = nice_max(max / 5.0);
    (0..=10)
        .map(|i| f64::from(i) * step)
        .take_while(|&t| t <= max * 1.0001)
        .collect()
}

/// One axis: the interval drawn, in the scale's units (log10 of the values for Log).
#[derive(Clone, Copy, Debug)]
struct Range {
    scale: Scale,
    lo: f64,
    hi: f64,
}

impl Range {
    fn linear(lo: f64, hi: f64) -> Range {
        Range {
            scale: Scale::Linear,
            lo,
            hi,
        }
    }

    fn of(scale: Scale, min: f64, max: f64) -> Range {
        match scale {
            Scale::Linear => Range::linear(min.min(0.0), max),
            Scale::Log => Range {
                scale,
                lo: min.log10(),
                hi: max.log10(),
            },
        }
    }

    /// Whole decades around the positive values (one decade when there is one value).
    fn decades(values: impl Iterator<Item = f64>) -> Range {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| *v > 0.0) {
            lo = lo.min(v.log10().floor());
            hi = hi.max(v.log10().ceil());
        }
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        Range {
            scale: Scale::Log,
            lo,
            hi: hi.max(lo + 1.0),
        }
    }

    /// Where `v` falls, 0 at `lo` and 1 at `hi` (values a log axis cannot show sit at 0).
    fn frac(&self, v: f64) -> f64 {
        let t = match self.scale {
            Scale::Linear => v,
            Scale::Log if v > 0.0 => v.log10(),
            Scale::Log => self.lo,
        };
        ((t - self.lo) / (self.hi - self.lo).max(1e-9)).clamp(-0.05, 1.05)
    }

    /// The grid lines: five on a linear axis, each decade on a log one.
    fn grid(&self) -> Vec<f64> {
        match self.scale {
            Scale::Linear => (0..=4)
                .map(|i| self.lo + (self.hi - self.lo) * f64::from(i) / 4.0)
                .collect(),
            Scale::Log => {
                let decades = (self.hi - self.lo).round().clamp(1.0, 12.0) as i32;
                (0..=decades)
                    .map(|d| 10f64.powf(self.lo + f64::from(d)))
                    .collect()
            }
        }
    }
}

/// A line chart's area and axes.
struct Plot {
    w: f64,
    h: f64,
    x: Range,
    y: Range,
}

impl Plot {
    /// Margins: left, right (the legend), top, bottom.
    const L: f64 = 70.0;
    const R: f64 = 200.0;
    const T: f64 = 36.0;
    const B: f64 = 48.0;

    fn px(&self, x: f64) -> f64 {
        Self::L + self.x.frac(x) * (self.w - Self::L - Self::R)
    }

    fn py(&self, y: f64) -> f64 {
        self.h - Self::B - self.y.frac(y) * (self.h - Self::T - Self::B)
    }

    fn axes(&self, svg: &mut String, xticks: &[f64], axes: &Axes) {
        let (w, h, l, r, b) = (self.w, self.h, Self::L, Self::R, Self::B);
        for y in self.y.grid() {
            let _ = write!(
                svg,
                r#"<line x1="{l}" x2="{}" y1="{:.1}" y2="{:.1}" class="grid"/><text x="{}" y="{:.1}" class="axis" text-anchor="end">{}</text>"#,
                w - r,
                self.py(y),
                self.py(y),
                l - 6.0,
                self.py(y) + 4.0,
                short(y)
            );
        }
        // Labels closer than this (px) to the last one drawn would overlap: skipped.
        const MIN_GAP: f64 = 40.0;
        let mut last = f64::NEG_INFINITY;
        for &x in xticks {
            if self.px(x) - last < MIN_GAP {
                continue;
            }
            last = self.px(x);
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{}" class="axis" text-anchor="middle">{}</text>"#,
                self.px(x),
                h - b + 16.0,
                esc(&(axes.xfmt)(x))
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" class="axis" text-anchor="middle">{}</text>"#,
            (l + w - r) / 2.0,
            h - 8.0,
            esc(axes.xlabel)
        );
        let ylabel = match self.y.scale {
            Scale::Log => format!("{} (log scale)", axes.ylabel),
            Scale::Linear => axes.ylabel.to_string(),
        };
        let _ = write!(
            svg,
            r#"<text x="14" y="{}" class="axis" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>"#,
            h / 2.0,
            h / 2.0,
            esc(&ylabel)
        );
    }

    /// One series: its line, its points (with their value on hover) and its legend entry.
    fn series(&self, svg: &mut String, i: usize, (name, colour, points): &Series) {
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", self.px(x), self.py(y)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for &(x, y) in points {
            let _ = write!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"><title>{}: {}</title></circle>"#,
                self.px(x),
                self.py(y),
                esc(name),
                short(y)
            );
        }
        let ly = Self::T + 14.0 + 16.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="10" height="10" fill="{colour}"/><text x="{}" y="{}" class="legend">{}</text>"#,
            self.w - Self::R + 12.0,
            ly - 9.0,
            self.w - Self::R + 26.0,
            ly,
            esc(&legend_name(name))
        );
    }
}

/// A percentile as its nines: p90 is 1, p99 2, p99.9 3 (p50 0.3, p1 0.004).
fn nines(p: f64) -> f64 {
    -(1.0 - p / 100.0).max(1e-9).log10()
}

/// An axis label for `n` nines: `p90`, `p99`, `p99.9`.
fn nines_label(n: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-n));
    let text = format!("{p:.4}");
    format!("p{}", text.trim_end_matches('0').trim_end_matches('.'))
}

/// A target's name shortened: `iSCSI demo/0` for `iscsi://h/iqn.2026-11.org.x:demo/0`,
/// `NVMe demo/1 TLS` for `nvme+tcp://h/nqn.2026-11.org.x:demo/1?tls`, `local sdb` for
/// `/dev/sdb`; `with_host` adds the address (`iSCSI demo/0 @h:3260`).
fn short_label(name: &str, with_host: bool) -> String {
    let (door, rest) = if let Some(rest) = name.strip_prefix("iscsi://") {
        ("iSCSI", rest)
    } else if let Some(rest) = name.strip_prefix("nvme+tcp://") {
        ("NVMe", rest)
    } else {
        let base = name.rsplit('/').find(|p| !p.is_empty()).unwrap_or(name);
        return format!("local {base}");
    };
    let (rest, tls) = match rest.split_once('?') {
        Some((r, q)) => (r, q.split('&').any(|k| k == "tls")),
        None => (rest, false),
    };
    let mut parts = rest.splitn(3, '/');
    let host = parts.next().unwrap_or_default();
    let host = host.rsplit('@').next().unwrap_or(host);
    let node = parts.next().unwrap_or_default();
    let unit = parts.next().unwrap_or_default();
    let node = node.rsplit(':').next().unwrap_or(node);
    let mut label = format!("{door} {node}/{unit}");
    if tls {
        label.push_str(" TLS");
    }
    if with_host {
        let _ = write!(label, " @{host}");
    }
    label
}

/// A legend entry: a long name keeps its tail (the targets table has it whole).
fn legend_name(name: &str) -> String {
    const MAX: usize = 30;
    let chars: Vec<char> = name.chars().collect();
    match chars.len().checked_sub(MAX - 1) {
        Some(skip) if skip > 0 => format!("…{}", chars[skip..].iter().collect::<String>()),
        _ => name.to_string(),
    }
}

/// Grouped horizontal bars: one group per label, a bar per target.
fn bar_chart(title: &str, unit: &str, groups: &[BarGroup]) -> String {
    let bars: usize = groups.iter().map(|g| g.1.len()).sum();
    let (w, l, r, t, bar_h, gap) = (1200.0, 220.0, 110.0, 36.0, 16.0, 14.0);
    let h = t + bars as f64 * bar_h + groups.len() as f64 * gap + 10.0;
    let vmax = nice_max(
        groups
            .iter()
            .flat_map(|g| g.1.iter().map(|b| b.2))
            .fold(0.0, f64::max),
    );
    let mut svg = svg_open(w, h, title);
    let mut y = t;
    for (label, group) in groups {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{:.1}" class="axis" text-anchor="end">{}</text>"#,
            l - 8.0,
            y + bar_h * group.len() as f64 / 2.0 + 4.0,
            esc(label)
        );
        for (name, colour, v) in group {
            let len = (v / vmax).clamp(0.0, 1.0) * (w - l - r);
            let _ = write!(
                svg,
                r#"<rect x="{l}" y="{y:.1}" width="{len:.1}" height="{:.1}" fill="{colour}"><title>{}: {} {}</title></rect><text x="{:.1}" y="{:.1}" class="value">{} {}</text>"#,
                bar_h - 2.0,
                esc(name),
                short(*v),
                esc(unit),
                l + len + 4.0,
                y + bar_h - 5.0,
                short(*v),
                esc(unit)
            );
            y += bar_h;
        }
        y += gap;
    }
    svg.push_str("</svg>");
    svg
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1400px;padding:0 1em;color:#212529}\
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #dee2e6;padding:3px 7px;text-align:right}\
th{background:#f1f3f5}td.l,th.l{text-align:left}.chart{width:100%;display:block;margin:1em 0}\
.title{font-size:15px;font-weight:600;text-anchor:middle}.axis{font-size:11px;fill:#495057}\
.legend{font-size:12px}.value{font-size:11px;fill:#212529}.grid{stroke:#e9ecef}.note{color:#c92a2a}";

impl Results {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    fn colour(&self, target: &str) -> &'static str {
        let i = self
            .targets
            .iter()
            .position(|t| t.name == target)
            .unwrap_or(0);
        COLORS[i % COLORS.len()]
    }

    /// A target's short name for legends and tables: its door and what tells it from the
    /// others (`iSCSI demo/0`, `NVMe demo/1`, `local sdb`), with its address where two would
    /// read alike; the targets table has the whole name.
    fn label(&self, target: &str) -> String {
        let short = |name: &str, with_host: bool| short_label(name, with_host);
        let mine = short(target, false);
        let clash = self
            .targets
            .iter()
            .filter(|t| short(&t.name, false) == mine)
            .count()
            > 1;
        if !clash {
            return mine;
        }
        let mine = short(target, true);
        let still = self
            .targets
            .iter()
            .filter(|t| short(&t.name, true) == mine)
            .count()
            > 1;
        match self.targets.iter().position(|t| t.name == target) {
            Some(i) if still => format!("{mine} #{}", i + 1),
            _ => mine,
        }
    }

    fn rows_where(&self, f: impl Fn(&Workload) -> bool) -> Vec<&Row> {
        self.rows.iter().filter(|r| f(&r.workload)).collect()
    }

    /// (target, colour, points) for a line chart of `value` over `x` of the matching rows.
    fn series(
        &self,
        rows: &[&Row],
        x: fn(&Workload) -> f64,
        value: fn(&Summary) -> f64,
    ) -> Vec<Series> {
        self.targets
            .iter()
            .map(|t| {
                let mut pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.target == t.name)
                    .map(|r| (x(&r.workload), value(&r.result)))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (self.label(&t.name), self.colour(&t.name), pts)
            })
            .filter(|s| !s.2.is_empty())
            .collect()
    }

    pub fn to_html(&self) -> String {
        let mut h = String::new();
        self.html_head(&mut h);
        self.html_headline(&mut h);
        self.html_queue_depths(&mut h);
        self.html_sizes(&mut h);
        self.html_matrix(&mut h);
        self.html_workloads(&mut h);
        self.html_all(&mut h);
        h.push_str("</body></html>\n");
        h
    }

    /// The page head, the run and its targets.
    fn html_head(&self, h: &mut String) {
        let _ = write!(h, "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>ferrosan bench report</title><style>{STYLE}</style></head><body>");
        let _ = write!(h, "<h1>Storage benchmark</h1><p>{} {} on {}, {} run ({} s ramp + {} s measured per workload{}). Rows: {}.</p>",
            esc(&self.tool), esc(&self.version), esc(&self.host),
            if self.quick { "quick" } else { "full" }, self.ramp_s, self.runtime_s,
            if self.writes { "; writes included" } else { "; reads only" }, self.rows.len());
        let m = &self.machine;
        let _ = write!(
            h,
            "<p>Client: {} cores ({}), {:.1} GiB of memory, Linux {}.</p>",
            m.cores,
            esc(if m.cpu_model.is_empty() {
                "CPU model unknown"
            } else {
                &m.cpu_model
            }),
            m.memory_bytes as f64 / (1u64 << 30) as f64,
            esc(&m.kernel)
        );
        h.push_str("<h2>Targets</h2><table><tr><th class=\"l\">label</th><th class=\"l\">target</th><th class=\"l\">kind</th><th>capacity</th><th>block</th><th class=\"l\">target CPU from</th><th class=\"l\">notes</th></tr>");
        for t in &self.targets {
            let _ = write!(h, "<tr><td class=\"l\" style=\"color:{}\">&#9632; {}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{:.1} GiB</td><td>{}</td><td class=\"l\">{}</td><td class=\"l note\">{}</td></tr>",
                self.colour(&t.name), esc(&self.label(&t.name)), esc(&t.name), esc(&t.kind), t.capacity_bytes as f64 / (1u64 << 30) as f64, t.block_size,
                // Without its scheme: the page names no outside resource, not even as text.
                esc(t.metrics.as_deref().map_or("–", |m| m.trim_start_matches("http://"))),
                esc(&t.notes.join("; ")));
        }
        h.push_str("</table>");
        self.html_zeros(h);
    }

    /// A warning for each target whose reads returned only zeros: a LUN never written is
    /// read from no medium (a RAM device lends pages never touched, a thin file or image
    /// reads holes), so its figures are not those of reads.
    fn html_zeros(&self, h: &mut String) {
        for t in &self.targets {
            let zeros: Vec<&str> = self
                .rows
                .iter()
                .filter(|r| r.target == t.name && r.result.reads_only_zeros)
                .map(|r| r.workload.id.as_str())
                .collect();
            if zeros.is_empty() {
                continue;
            }
            let _ = write!(
                h,
                "<p class=\"note\">&#9888; {}: every read sampled returned only zeros ({}). \
                 The target was probably never written where these reads went: a RAM device \
                 answers such reads without touching memory, a thin file or image from its \
                 holes, so these are not the figures of real reads. Fill it first (for example \
                 <code>dd if=/dev/urandom bs=1M oflag=direct</code> onto it).</p>",
                esc(&self.label(&t.name)),
                esc(&zeros.join(", "))
            );
        }
    }

    /// Headline: IOPS for 4 KiB, MB/s for 1 MiB, mean latency for QD1.
    fn html_headline(&self, h: &mut String) {
        let headline = self.rows_where(|w| w.group == Group::Headline);
        if !headline.is_empty() {
            h.push_str("<h2>Headline</h2>");
            let mut ids: Vec<&Workload> = headline.iter().map(|r| &r.workload).collect();
            ids.dedup_by(|a, b| a.id == b.id);
            let group_of = |pred: &dyn Fn(&Workload) -> bool, value: &dyn Fn(&Summary) -> f64| {
                let mut groups = Vec::new();
                for w in ids.iter().filter(|w| pred(w)) {
                    let bars = headline
                        .iter()
                        .filter(|r| r.workload.id == w.id)
                        .map(|r| {
                            (
                                self.label(&r.target),
                                self.colour(&r.target),
                                value(&r.result),
                            )
                        })
                        .collect();
                    groups.push((w.id.clone(), bars));
                }
                groups
            };
            let iops = group_of(&|w| w.block_size < 1 << 20, &|s| s.iops);
            if !iops.is_empty() {
                h.push_str(&bar_chart("Small random I/O", "IOPS", &iops));
            }
            let mbs = group_of(&|w| w.block_size >= 1 << 20, &|s| s.mb_per_s);
            if !mbs.is_empty() {
                h.push_str(&bar_chart("Large sequential I/O", "MB/s", &mbs));
            }
            let lat = group_of(&|w| w.queue_depth == 1 && w.jobs == 1, &|s| {
                s.latency_us.mean
            });
            if !lat.is_empty() {
                h.push_str(&bar_chart(
                    "Queue depth 1: mean latency (lower is better)",
                    "µs",
                    &lat,
                ));
            }
            let target_cpu: Vec<BarGroup> =
                group_of(&|_| true, &|s| s.target_cpu_us_per_io.unwrap_or(f64::NAN))
                    .into_iter()
                    .map(|(id, bars)| (id, bars.into_iter().filter(|b| b.2.is_finite()).collect()))
                    .filter(|g: &BarGroup| !g.1.is_empty())
                    .collect();
            if !target_cpu.is_empty() {
                h.push_str(&bar_chart(
                    "Target CPU per I/O, from its metrics (lower is better)",
                    "µs",
                    &target_cpu,
                ));
            }
        }
    }

    /// 4 KiB random reads and writes across queue depths.
    fn html_queue_depths(&self, h: &mut String) {
        let qd_x = |w: &Workload| f64::from(w.queue_depth);
        let axes = |ylabel, y| Axes {
            xlabel: "queue depth",
            ylabel,
            x: Scale::Log,
            y,
            xfmt: |x| format!("{x:.0}"),
        };
        for (read_pct, name) in [(100u8, "read"), (0, "write")] {
            let rows = self.rows_where(|w| {
                w.pattern == Pattern::Random
                    && w.block_size == 4096
                    && w.jobs == 1
                    && w.read_pct == read_pct
                    && matches!(w.group, Group::Headline | Group::QueueDepth)
            });
            if rows.len() > self.targets.len() {
                let _ = write!(h, "<h2>4 KiB random {name} across queue depths</h2>");
                h.push_str(&line_chart(
                    &format!("4 KiB random {name}: IOPS"),
                    &axes("IOPS", Scale::Linear),
                    &self.series(&rows, qd_x, |s| s.iops),
                ));
                h.push_str(&line_chart(
                    &format!("4 KiB random {name}: p99 latency"),
                    &axes("µs", Scale::Log),
                    &self.series(&rows, qd_x, |s| s.latency_us.p99),
                ));
            }
        }
    }

    /// Random reads and writes across I/O sizes.
    fn html_sizes(&self, h: &mut String) {
        let size_x = |w: &Workload| f64::from(w.block_size);
        let axes = |ylabel| Axes {
            xlabel: "I/O size",
            ylabel,
            x: Scale::Log,
            y: Scale::Linear,
            xfmt: |x| size_label(x as u32),
        };
        for (read_pct, name) in [(100u8, "read"), (0, "write")] {
            // The sweep's 4 KiB point is a queue-depth row.
            let swept = self
                .rows
                .iter()
                .any(|r| r.workload.group == Group::SizeSweep && r.workload.read_pct == read_pct);
            let rows = self.rows_where(|w| {
                w.pattern == Pattern::Random
                    && w.read_pct == read_pct
                    && w.queue_depth == SWEEP_DEPTH
                    && w.jobs == 1
            });
            if swept {
                let _ = write!(h, "<h2>Random {name}s from 512 B to 1 MiB (QD16)</h2>");
                h.push_str(&line_chart(
                    &format!("Random {name}: MB/s by I/O size"),
                    &axes("MB/s"),
                    &self.series(&rows, size_x, |s| s.mb_per_s),
                ));
                h.push_str(&line_chart(
                    &format!("Random {name}: IOPS by I/O size"),
                    &axes("IOPS"),
                    &self.series(&rows, size_x, |s| s.iops),
                ));
            }
        }
    }

    /// Queue depth × sessions.
    fn html_matrix(&self, h: &mut String) {
        // The matrix's one-session column comes from the queue-depth rows.
        let matrix = if self.rows.iter().any(|r| r.workload.group == Group::Matrix) {
            self.rows_where(|w| {
                w.pattern == Pattern::Random
                    && w.read_pct == 100
                    && w.block_size == 4096
                    && MATRIX_DEPTHS.contains(&w.queue_depth)
            })
        } else {
            Vec::new()
        };
        if !matrix.is_empty() {
            h.push_str("<h2>Queue depth × sessions (4 KiB random read IOPS)</h2><table><tr><th class=\"l\">target</th><th>QD per session</th>");
            let mut jobs: Vec<u32> = matrix.iter().map(|r| r.workload.jobs).collect();
            jobs.sort_unstable();
            jobs.dedup();
            let mut qds: Vec<u32> = matrix.iter().map(|r| r.workload.queue_depth).collect();
            qds.sort_unstable();
            qds.dedup();
            for j in &jobs {
                let _ = write!(h, "<th>{j} session{}</th>", if *j == 1 { "" } else { "s" });
            }
            h.push_str("</tr>");
            let best = matrix
                .iter()
                .map(|r| r.result.iops)
                .fold(0.0, f64::max)
                .max(1.0);
            for t in &self.targets {
                for q in &qds {
                    let _ = write!(
                        h,
                        "<tr><td class=\"l\">{}</td><td>{q}</td>",
                        esc(&self.label(&t.name))
                    );
                    for j in &jobs {
                        match matrix.iter().find(|r| {
                            r.target == t.name
                                && r.workload.queue_depth == *q
                                && r.workload.jobs == *j
                        }) {
                            Some(r) => {
                                let shade = 255.0 - 120.0 * r.result.iops / best;
                                let _ = write!(
                                    h,
                                    "<td style=\"background:rgb({shade:.0},{:.0},255)\">{}</td>",
                                    255.0 - 60.0 * r.result.iops / best,
                                    short(r.result.iops)
                                );
                            }
                            None => h.push_str("<td>–</td>"),
                        }
                    }
                    h.push_str("</tr>");
                }
            }
            h.push_str("</table>");
        }
    }

    /// Each headline workload's latency distribution and IOPS over the measured window
    /// (every row's are in results.json and the fio-format files).
    fn html_workloads(&self, h: &mut String) {
        let mut ids: Vec<&str> = Vec::new();
        for r in self
            .rows
            .iter()
            .filter(|r| r.workload.group == Group::Headline)
        {
            if !ids.contains(&r.workload.id.as_str()) {
                ids.push(&r.workload.id);
            }
        }
        if ids.is_empty() {
            return;
        }
        h.push_str("<h2>Latency by percentile and IOPS over time</h2>");
        for id in ids {
            let rows = self.rows_where(|w| w.id == id);
            let _ = write!(h, "<h3>{}</h3>", esc(id));
            h.push_str(&line_chart(
                &format!("{id}: latency by percentile"),
                &Axes {
                    xlabel: "percentile of I/Os (p90, p99, p99.9: one more nine each step)",
                    ylabel: "µs",
                    x: Scale::Linear,
                    y: Scale::Log,
                    xfmt: nines_label,
                },
                &self.percentile_curves(&rows),
            ));
            h.push_str(&line_chart(
                &format!("{id}: IOPS over time"),
                &Axes {
                    xlabel: "seconds into the measured window",
                    ylabel: "IOPS",
                    x: Scale::Linear,
                    y: Scale::Linear,
                    xfmt: |x| short(x).trim_end_matches(".0").to_string(),
                },
                &self.over_time(&rows),
            ));
        }
    }

    /// Per target: the latency at each percentile (x in nines: p90 at 1, p99 at 2, ...).
    fn percentile_curves(&self, rows: &[&Row]) -> Vec<Series> {
        self.series_by_target(rows, |r| {
            r.result
                .percentiles_us
                .iter()
                .map(|p| (nines(p.p), p.us))
                .collect()
        })
    }

    /// Per target: IOPS in each step of the measured window, at the step's end.
    fn over_time(&self, rows: &[&Row]) -> Vec<Series> {
        self.series_by_target(rows, |r| {
            let t = &r.result.iops_over_time;
            t.iops
                .iter()
                .enumerate()
                .map(|(i, &v)| ((i + 1) as f64 * t.interval_s, v))
                .collect()
        })
    }

    fn series_by_target(
        &self,
        rows: &[&Row],
        points: impl Fn(&Row) -> Vec<(f64, f64)>,
    ) -> Vec<Series> {
        self.targets
            .iter()
            .filter_map(|t| {
                let row = rows.iter().find(|r| r.target == t.name)?;
                Some((self.label(&t.name), self.colour(&t.name), points(row)))
            })
            .filter(|s| !s.2.is_empty())
            .collect()
    }

    /// The rows grouped by workload (in the order the workloads first ran), each group's
    /// targets in the order they were given.
    fn by_workload(&self) -> Vec<&Row> {
        let mut ids: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !ids.contains(&r.workload.id.as_str()) {
                ids.push(&r.workload.id);
            }
        }
        let target_index = |r: &Row| self.targets.iter().position(|t| t.name == r.target);
        let mut rows: Vec<&Row> = self.rows.iter().collect();
        rows.sort_by_key(|r| {
            (
                ids.iter().position(|i| *i == r.workload.id),
                target_index(r),
            )
        });
        rows
    }

    /// Every row, and what was not run.
    fn html_all(&self, h: &mut String) {
        h.push_str("<h2>All results</h2><p>By workload, in the order run; the targets in the order given.</p><table><tr><th class=\"l\">workload</th><th class=\"l\">target</th><th>IOPS</th><th>MB/s</th><th>mean µs</th><th>p50</th><th>p99</th><th>p99.9</th><th>max</th><th>client CPU µs/IO</th><th>target CPU µs/IO</th><th>errors</th></tr>");
        for r in self.by_workload() {
            let s = &r.result;
            let zeros = if s.reads_only_zeros {
                " &#9888; zeros"
            } else {
                ""
            };
            let _ = write!(h, "<tr><td class=\"l\">{}{zeros}</td><td class=\"l\">{}</td><td>{}</td><td>{:.1}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&r.workload.id), esc(&self.label(&r.target)), short(s.iops), s.mb_per_s, s.latency_us.mean, s.latency_us.p50, s.latency_us.p99, s.latency_us.p99_9, s.latency_us.max,
                s.client_cpu_us_per_io.map_or("–".into(), |c| format!("{c:.1}")),
                s.target_cpu_us_per_io.map_or("–".into(), |c| format!("{c:.1}")),
                if s.errors == 0 { "0".to_string() } else { format!("{} ({})", s.errors, esc(s.first_error.as_deref().unwrap_or(""))) });
        }
        h.push_str("</table>");
        if !self.skipped.is_empty() {
            h.push_str("<h2>Not run</h2><ul>");
            for s in &self.skipped {
                let _ = write!(
                    h,
                    "<li>{} on {}: {}</li>",
                    esc(&s.workload),
                    esc(&s.target),
                    esc(&s.reason)
                );
            }
            h.push_str("</ul>");
        }
    }
}

/// Two targets with every workload of the full plan, measured from synthetic I/Os: target
/// `i` (from 1) does `i` × depth I/Os per 100 ms step at `i` × depth × 10 µs (± 20 %), and
/// the first target's daemon used 2 µs of CPU per I/O.
#[cfg(test)]
pub(crate) fn sample_results() -> Results {
    use crate::stats::{CpuUsed, JobStats};
    use std::time::Duration;
    let targets = ["iscsi://127.0.0.1:3260/iqn.x:<t>/0", "/var/tmp/a&b.img"];
    let window = Duration::from_secs(10);
    let step = Duration::from_millis(100);
    let mut rows = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        for w in crate::plan::plan(false, true) {
            let k = (i as u64 + 1) * u64::from(w.total_depth());
            let mut stats = JobStats::new(window, step);
            for n in 0..100 * k {
                let at = step * u32::try_from(n / k).unwrap();
                let lat = Duration::from_micros(k * 10 * (80 + n % 41) / 100);
                let read = n % 100 < u64::from(w.read_pct);
                stats.record(lat, read, w.block_size, at);
            }
            let ios = 100 * k;
            let cpu = CpuUsed {
                client: Some(Duration::from_micros(3 * ios)),
                target: (i == 0).then(|| Duration::from_micros(2 * ios)),
            };
            rows.push(Row {
                target: t.to_string(),
                workload: w.clone(),
                result: Summary::of(&stats, window, cpu),
            });
        }
    }
    Results {
        tool: "ferrosan bench".into(),
        version: "0.1.0".into(),
        started_unix_s: 0,
        host: "test<host>".into(),
        machine: Machine {
            cpu_model: "Test <CPU>".into(),
            cores: 2,
            memory_bytes: 24 << 30,
            kernel: "6.1.0".into(),
        },
        quick: false,
        writes: true,
        ramp_s: 2.0,
        runtime_s: 10.0,
        targets: targets
            .iter()
            .enumerate()
            .map(|(i, t)| TargetInfo {
                name: t.to_string(),
                kind: if i == 0 { "iscsi" } else { "file" }.into(),
                capacity_bytes: 1 << 30,
                block_size: 512,
                notes: vec!["sparse".into()],
                node: (i == 0).then(|| "iqn.x:<t>".into()),
                metrics: (i == 0).then(|| "http://127.0.0.1:9100/metrics".into()),
            })
            .collect(),
        rows,
        skipped: vec![Skipped {
            target: "x".into(),
            workload: "randread-512-qd16".into(),
            reason: "4096-byte blocks".into(),
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::plan;

    fn results() -> Results {
        sample_results()
    }

    #[test]
    fn this_machine_is_described() {
        let m = Machine::here();
        assert!(m.cores >= 1, "{m:?}");
        assert!(m.memory_bytes > 0, "{m:?}");
        assert!(!m.kernel.is_empty(), "{m:?}");
    }

    #[test]
    fn the_report_is_self_contained_with_inline_svg_charts() {
        let html = results().to_html();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(
            html.matches("<svg ").count() >= 8,
            "charts: {}",
            html.matches("<svg ").count()
        );
        for outside in [
            "http:", "https:", "src=", "<link", "@import", "url(", "<script",
        ] {
            assert!(
                !html.contains(outside),
                "the report refers outside: {outside}"
            );
        }
        // Names are escaped, never markup.
        assert!(
            html.contains("iqn.x:&lt;t&gt;")
                && html.contains("a&amp;b.img")
                && html.contains("test&lt;host&gt;")
        );
        assert!(!html.contains("<t>"));
        // The client machine is named, escaped too.
        assert!(
            html.contains("2 cores (Test &lt;CPU&gt;), 24.0 GiB of memory, Linux 6.1.0"),
            "the machine"
        );
        assert!(html.contains("randread-512-qd16 on x"));
        assert!(html.contains("Queue depth × sessions"));
    }

    #[test]
    fn the_json_has_a_row_per_target_and_workload_with_the_figures() {
        let r = results();
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2 * plan(false, true).len());
        let row = rows
            .iter()
            .find(|x| {
                x["workload"]["id"] == "randread-4k-qd64" && x["target"] == "/var/tmp/a&b.img"
            })
            .unwrap();
        // 2 x 64 I/Os per 100 ms step.
        assert_eq!(row["iops"], 1280.0);
        assert_eq!(row["workload"]["queue_depth"], 64);
        // Latencies from 0.8 to 1.2 x 1280 µs.
        let p99 = row["latency_us"]["p99"].as_f64().unwrap();
        assert!((1500.0..1540.0).contains(&p99), "{p99}");
        assert_eq!(row["read_latency_us"], row["latency_us"]);
        assert!(row["write_latency_us"].is_null());
        assert_eq!(row["workload"]["pattern"], "random");
        assert_eq!(row["target_cpu_us_per_io"], serde_json::Value::Null);
        assert_eq!(row["client_cpu_us_per_io"], 3.0);
        assert_eq!(row["iops_over_time"]["iops"].as_array().unwrap().len(), 100);
        assert_eq!(v["targets"][0]["block_size"], 512);
        let theirs = rows
            .iter()
            .find(|x| x["workload"]["id"] == "randrw70-4k-qd64" && x["target"] != row["target"])
            .unwrap();
        assert_eq!(theirs["target_cpu_us_per_io"], 2.0);
        assert!(theirs["write_latency_us"]["mean"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn latencies_are_drawn_on_log_axes_with_percentile_curves_and_series_per_workload() {
        let html = results().to_html();
        // p99 across queue depths spans 10 µs .. 1.5 ms: decades, on a log axis.
        assert!(html.contains("µs (log scale)"));
        for id in ["randread-4k-qd1", "randwrite-4k-qd64", "seqread-1m-qd16"] {
            assert!(
                html.contains(&format!("{id}: latency by percentile")),
                "{id}"
            );
            assert!(html.contains(&format!("{id}: IOPS over time")), "{id}");
        }
        // Only the headline workloads get their own charts.
        assert!(!html.contains("randread-4k-qd8: latency by percentile"));
        assert!(html.contains("Target CPU per I/O, from its metrics"));
        assert!(html.contains("127.0.0.1:9100/metrics"));
        assert!(!html.contains("NaN") && !html.contains("inf\""));
    }

    #[test]
    fn targets_are_labelled_by_door_and_name_with_the_address_where_two_read_alike() {
        let iscsi = "iscsi://u%p@127.0.0.1:3260/iqn.2026-11.org.ferrosan:demo/0";
        let nvme = "nvme+tcp://127.0.0.1:4420/nqn.2026-11.org.ferrosan:demo/1?tls";
        assert_eq!(short_label(iscsi, false), "iSCSI demo/0");
        assert_eq!(short_label(iscsi, true), "iSCSI demo/0 @127.0.0.1:3260");
        assert_eq!(short_label(nvme, false), "NVMe demo/1 TLS");
        assert_eq!(short_label("/dev/sdb", false), "local sdb");
        let mut r = results();
        let other = "iscsi://127.0.0.2:3260/iqn.2026-11.org.ferrosan:demo/0";
        for name in [iscsi, other] {
            let mut t = r.targets[0].clone();
            t.name = name.into();
            r.targets.push(t);
        }
        assert_eq!(r.label(iscsi), "iSCSI demo/0 @127.0.0.1:3260");
        assert_eq!(r.label(other), "iSCSI demo/0 @127.0.0.2:3260");
        assert_eq!(r.label("/var/tmp/a&b.img"), "local a&b.img");
        let html = results().to_html();
        assert!(html.contains(">iSCSI &lt;t&gt;/0</text>"), "the legend");
    }

    #[test]
    fn reads_of_only_zeros_are_warned_of() {
        let mut r = results();
        assert!(!r.to_html().contains("only zeros"));
        r.rows[0].result.reads_only_zeros = true;
        let html = r.to_html();
        let id = &r.rows[0].workload.id;
        assert!(
            html.contains(&format!("every read sampled returned only zeros ({id})")),
            "{id}"
        );
        assert!(html.contains(&format!("{id} &#9888; zeros")));
    }

    #[test]
    fn the_table_of_all_results_is_grouped_by_workload() {
        let r = results();
        let rows = r.by_workload();
        assert_eq!(rows.len(), r.rows.len());
        // Each workload's two targets side by side, in the order given.
        for pair in rows.chunks(2) {
            assert_eq!(pair[0].workload.id, pair[1].workload.id);
            assert_eq!(pair[0].target, r.targets[0].name);
            assert_eq!(pair[1].target, r.targets[1].name);
        }
        assert_eq!(rows[0].workload.id, r.rows[0].workload.id);
    }

    #[test]
    fn percentiles_reach_as_far_as_the_ios_allow() {
        let r = results();
        // randread-4k-qd1 on the first target: 100 I/Os, so up to p99 (one I/O above it).
        let qd1 = r
            .rows
            .iter()
            .find(|row| row.workload.id == "randread-4k-qd1")
            .unwrap();
        let ps: Vec<f64> = qd1.result.percentiles_us.iter().map(|p| p.p).collect();
        assert_eq!(ps.first(), Some(&1.0));
        assert_eq!(ps.last(), Some(&99.0), "{ps:?}");
        let us: Vec<f64> = qd1.result.percentiles_us.iter().map(|p| p.us).collect();
        assert!(us.windows(2).all(|w| w[0] <= w[1]), "{us:?}");
        assert!(us[0] >= 8.0 && us[us.len() - 1] <= 12.1, "{us:?}");
    }

    #[test]
    fn axes_map_values_linearly_or_by_decades() {
        let d = Range::decades([12.0, 950.0, 0.0, -1.0].into_iter());
        assert_eq!((d.lo, d.hi), (1.0, 3.0));
        assert_eq!(d.grid(), [10.0, 100.0, 1000.0]);
        assert!((d.frac(100.0) - 0.5).abs() < 1e-9);
        // What a log axis cannot show sits at its foot.
        assert_eq!(d.frac(0.0), 0.0);
        let one = Range::decades([5.0].into_iter());
        assert_eq!((one.lo, one.hi), (0.0, 1.0));
        let none = Range::decades(std::iter::empty());
        assert_eq!((none.lo, none.hi), (0.0, 1.0));
        let lin = Range::linear(0.0, 200.0);
        assert_eq!(lin.grid(), [0.0, 50.0, 100.0, 150.0, 200.0]);
        assert_eq!(linear_ticks(10.0), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(linear_ticks(5.0), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(nines_label(1.0), "p90");
        assert_eq!(nines_label(2.0), "p99");
        assert_eq!(nines_label(4.0), "p99.99");
        assert_eq!(nines_label(0.0), "p0");
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        assert!((nines(50.0) - std::f64::consts::LOG10_2).abs() < 1e-9);
        assert_eq!(short(0.25), "0.25");
        assert_eq!(short(0.01), "0.010");
    }

    #[test]
    fn charts_survive_empty_and_degenerate_data() {
        for (x, y) in [(Scale::Log, Scale::Log), (Scale::Linear, Scale::Linear)] {
            let axes = Axes {
                xlabel: "x",
                ylabel: "y",
                x,
                y,
                xfmt: |x| format!("{x}"),
            };
            let svg = line_chart("t", &axes, &[]);
            assert!(svg.contains("no data"));
            let one = line_chart("t", &axes, &[("a".into(), "#000", vec![(1.0, 0.0)])]);
            assert!(!one.contains("NaN") && !one.contains("inf"), "{one}");
            let odd = line_chart(
                "t",
                &axes,
                &[(
                    "a".into(),
                    "#000",
                    vec![(0.0, f64::NAN), (f64::INFINITY, 1.0)],
                )],
            );
            assert!(!odd.contains("NaN") && !odd.contains("inf"), "{odd}");
        }
        let bars = bar_chart(
            "t",
            "IOPS",
            &[("w".into(), vec![("a".into(), "#000", 0.0)])],
        );
        assert!(!bars.contains("NaN"), "{bars}");
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(73_000.0), 100_000.0);
        assert_eq!(nice_max(150.0), 200.0);
        assert_eq!(short(1_234_567.0), "1.23M");
        assert_eq!(short(45_678.0), "45.7K");
    }
}
