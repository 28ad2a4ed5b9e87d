//! `ferrosan bench`: the seeds' benchmark methodology (4 KiB random I/O across queue depths,
//! 70/30 mix, 1 MiB sequential, an I/O-size sweep, a queue-depth × sessions matrix) run side by
//! side on iSCSI LUNs and local files or devices, written up as results.json and a
//! self-contained report.html.
#![forbid(unsafe_code)]

pub mod fio;
pub mod iscsi;
pub mod local;
pub mod nvme;
pub mod plan;
pub mod report;
pub mod runner;
pub mod stats;
pub mod target_metrics;

use plan::{eta, human_duration, plan, Timing, Workload};
use report::{Results, Row, Skipped};
use runner::{Target, TargetInfo};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use target_metrics::TargetMetrics;

/// What the user asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// Writes allowed (they destroy the data on every target).
    pub destructive: bool,
    /// Local writes with RWF_DSYNC (durable on completion, like a write-through LUN).
    pub dsync: bool,
    /// Overrides the measured seconds per workload.
    pub runtime: Option<Duration>,
    /// Overrides the unmeasured seconds before each workload's measurement.
    pub ramp: Option<Duration>,
    /// With `destructive`: write to a local file even when another process has it open.
    pub even_if_open: bool,
    /// Only the first this-many bytes of each target.
    pub size: Option<u64>,
    /// The initiator name iSCSI sessions log in with.
    pub initiator_name: String,
    /// The CHAP secret for iSCSI URLs that name a user without a password.
    pub chap_secret: Option<initiator::Secret>,
    /// The host NQN NVMe/TCP controllers connect with.
    pub host_nqn: String,
    /// The TLS pre-shared key of `?tls` NVMe/TCP URLs.
    pub tls_key: Option<initiator::nvme::TlsPsk>,
    /// Only these workloads (ids as in results.json); empty: the whole plan.
    pub only: Vec<String>,
    /// ferrosan metrics endpoints to read target CPU from (`http://HOST:PORT/metrics`).
    pub target_metrics: Vec<String>,
    /// How long a job spins on its socket (or its local ring) for an answer before it sleeps
    /// (zero: it sleeps at once, as the kernel's initiators do).
    pub busy_poll: Duration,
    pub targets: Vec<String>,
}

/// How the run went: the caller maps it to an exit status.
#[derive(Debug)]
pub struct Outcome {
    pub results_json: PathBuf,
    pub report_html: PathBuf,
    /// fio-format JSON files, one per target and workload.
    pub fio_dir: PathBuf,
    /// Rows with I/O errors, and workloads that could not run.
    pub rows_with_errors: usize,
    pub skipped: usize,
}

/// The note a target's rows carry when its client polls: its latency is a polling host's.
fn busy_poll_note(spin: Duration) -> Option<String> {
    (!spin.is_zero()).then(|| {
        format!(
            "the client spins up to {} µs for each answer before it sleeps (--busy-poll-us)",
            spin.as_micros()
        )
    })
}

/// Opens a target named on the command line.
fn open_target(spec: &str, opts: &Options) -> Result<Box<dyn Target>, String> {
    if spec.starts_with("iscsi://") {
        // ferrosan cannot tell whether other hosts use a LUN: --destructive is the user's word.
        return Ok(Box::new(iscsi::IscsiTarget::open(
            spec,
            &opts.initiator_name,
            opts.chap_secret.as_ref(),
            opts.busy_poll,
        )?));
    }
    if spec.starts_with("nvme+tcp://") {
        return Ok(Box::new(nvme::NvmeTarget::open(
            spec,
            &opts.host_nqn,
            opts.tls_key.as_ref(),
            opts.busy_poll,
        )?));
    }
    let path = Path::new(spec);
    if opts.destructive {
        if let Some(why) = local::in_use(path, opts.even_if_open) {
            return Err(format!("{why}; not writing to it"));
        }
    }
    Ok(Box::new(
        local::LocalTarget::open(path, opts.destructive, opts.dsync)?.busy_polling(opts.busy_poll),
    ))
}

fn timing(opts: &Options) -> Timing {
    let mut timing = if opts.quick {
        Timing::quick()
    } else {
        Timing::full()
    };
    if let Some(r) = opts.runtime {
        timing.runtime = r;
    }
    if let Some(r) = opts.ramp {
        timing.ramp = r;
    }
    timing
}

/// The workloads to run: the plan, or those `--only` names (from the full plan, whatever
/// `--quick` says).
fn workloads(opts: &Options) -> Result<Vec<Workload>, String> {
    if opts.only.is_empty() {
        return Ok(plan(opts.quick, opts.destructive));
    }
    let mut workloads = plan(false, opts.destructive);
    for id in &opts.only {
        if !workloads.iter().any(|w| &w.id == id) {
            let known: Vec<_> = workloads.iter().map(|w| w.id.as_str()).collect();
            return Err(format!(
                "--only {id}: no such workload{}; known: {}",
                if opts.destructive {
                    ""
                } else {
                    " (writes need --destructive)"
                },
                known.join(", ")
            ));
        }
    }
    workloads.retain(|w| opts.only.contains(&w.id));
    Ok(workloads)
}

/// The results of a run starting now, with no row yet.
fn new_results(opts: &Options, timing: &Timing, targets: &[Box<dyn Target>]) -> Results {
    let started_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Results {
        tool: "ferrosan bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        started_unix_s,
        host: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map_or_else(|_| "?".into(), |h| h.trim().to_string()),
        machine: report::Machine::here(),
        quick: opts.quick,
        writes: opts.destructive,
        ramp_s: timing.ramp.as_secs_f64(),
        runtime_s: timing.runtime.as_secs_f64(),
        targets: targets.iter().map(|t| t.info().clone()).collect(),
        rows: Vec::new(),
        skipped: Vec::new(),
    }
}

/// A progress line: rewritten in place on a terminal, one line each elsewhere.
fn progress(tty: bool, line: &str) {
    if tty {
        eprint!("\r\x1b[2K{line}");
    } else {
        eprintln!("{line}");
    }
    let _ = std::io::stderr().flush();
}

/// The `--target-metrics` endpoints, and for each target the one that serves its IQN or NQN
/// (recorded in its info; a network target none serves gets a note instead).
struct Metrics {
    endpoints: Vec<TargetMetrics>,
    of_target: Vec<Option<usize>>,
}

impl Metrics {
    fn open(opts: &Options, targets: &mut [TargetInfo]) -> Result<Metrics, String> {
        let endpoints = opts
            .target_metrics
            .iter()
            .map(|spec| TargetMetrics::open(spec))
            .collect::<Result<Vec<_>, _>>()?;
        let mut of_target = Vec::new();
        for info in targets.iter_mut() {
            let found = info
                .node
                .as_deref()
                .and_then(|node| endpoints.iter().position(|m| m.serves(node)));
            match found {
                Some(i) => info.metrics = Some(endpoints[i].url.clone()),
                None if info.node.is_some() && !endpoints.is_empty() => info
                    .notes
                    .push("no --target-metrics endpoint serves it: no target CPU".into()),
                None => {}
            }
            of_target.push(found);
        }
        for (i, m) in endpoints.iter().enumerate() {
            if !of_target.contains(&Some(i)) {
                eprintln!("note: {} serves none of the targets named", m.url);
            }
        }
        Ok(Metrics {
            endpoints,
            of_target,
        })
    }

    fn of(&self, target: usize) -> Option<&TargetMetrics> {
        self.endpoints
            .get(self.of_target.get(target).copied().flatten()?)
    }
}

/// Runs one workload on one target and records its row (or why it was not run).
fn run_one(
    t: &dyn Target,
    metrics: Option<&TargetMetrics>,
    w: &Workload,
    timing: &Timing,
    opts: &Options,
    tty: bool,
    results: &mut Results,
) {
    let info = t.info();
    let range = opts
        .size
        .unwrap_or(info.capacity_bytes)
        .min(info.capacity_bytes);
    let cpu = metrics.map(|m| move || m.cpu());
    let outcome = runner::run(
        t,
        w,
        timing,
        range,
        cpu.as_ref().map(|f| f as runner::TargetCpu),
    );
    if tty {
        eprint!("\r\x1b[2K");
    }
    match outcome {
        Ok(result) => {
            eprintln!(
                "{:<22} {:<40} {:>10.0} IOPS {:>9.1} MB/s  mean {:>7.0} µs  p99 {:>7.0} µs{}",
                w.id,
                info.name,
                result.iops,
                result.mb_per_s,
                result.latency_us.mean,
                result.latency_us.p99,
                if result.errors > 0 {
                    format!("  {} errors", result.errors)
                } else {
                    String::new()
                }
            );
            results.rows.push(Row {
                target: info.name.clone(),
                workload: w.clone(),
                result,
            });
        }
        Err(reason) => {
            eprintln!("{:<22} {:<40} not run: {reason}", w.id, info.name);
            results.skipped.push(Skipped {
                target: info.name.clone(),
                workload: w.id.clone(),
                reason,
            });
        }
    }
}

/// Runs the benchmark; errors that stop it before any I/O (a target that cannot be opened,
/// an output directory that cannot be written) come back as Err.
pub fn run(opts: &Options) -> Result<Outcome, String> {
    if opts.targets.is_empty() {
        return Err(
            "name at least one target (an iscsi:// or nvme+tcp:// URL, a file or a block device)"
                .into(),
        );
    }
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    let mut targets = Vec::new();
    for spec in &opts.targets {
        targets.push(open_target(spec, opts)?);
    }
    let timing = timing(opts);
    let workloads = workloads(opts)?;
    let mut results = new_results(opts, &timing, &targets);
    let metrics = Metrics::open(opts, &mut results.targets)?;
    for t in &results.targets {
        for note in &t.notes {
            eprintln!("note: {}: {note}", t.name);
        }
    }
    let total = workloads.len() * targets.len();
    let tty = std::io::stderr().is_terminal();
    let began = Instant::now();
    let mut done = 0;
    // Workload by workload, every target in turn: drift (a warming SSD, a neighbour's load)
    // then touches every target alike.
    for w in &workloads {
        for (i, t) in targets.iter().enumerate() {
            let left = human_duration(eta(total - done, &timing));
            progress(
                tty,
                &format!(
                    "[{:>3}/{total}] {:<22} {}  (ETA {left})",
                    done + 1,
                    w.id,
                    t.info().name
                ),
            );
            run_one(
                t.as_ref(),
                metrics.of(i),
                w,
                &timing,
                opts,
                tty,
                &mut results,
            );
            done += 1;
        }
    }
    let results_json = opts.out.join("results.json");
    let report_html = opts.out.join("report.html");
    std::fs::write(&results_json, results.to_json())
        .map_err(|e| format!("{}: {e}", results_json.display()))?;
    std::fs::write(&report_html, results.to_html())
        .map_err(|e| format!("{}: {e}", report_html.display()))?;
    // A run replaces the previous run's files (as results.json), never mixes with them.
    let fio_dir = opts.out.join("fio");
    match std::fs::remove_dir_all(&fio_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", fio_dir.display())),
    }
    let fio_files = fio::write_all(&results, &fio_dir)?;
    eprintln!(
        "{total} runs in {}; wrote {}, {} and {fio_files} fio-format files under {}",
        human_duration(began.elapsed()),
        results_json.display(),
        report_html.display(),
        fio_dir.display()
    );
    for t in &results.targets {
        let zeros = results
            .rows
            .iter()
            .filter(|r| r.target == t.name && r.result.reads_only_zeros)
            .count();
        if zeros > 0 {
            eprintln!(
                "warning: {}: every read sampled in {zeros} workload(s) returned only zeros: \
                 probably never written there, so those reads may not touch a medium (fill it \
                 first for the figures of real reads)",
                t.name
            );
        }
    }
    Ok(Outcome {
        results_json,
        report_html,
        fio_dir,
        rows_with_errors: results.rows.iter().filter(|r| r.result.errors > 0).count(),
        skipped: results.skipped.len(),
    })
}
