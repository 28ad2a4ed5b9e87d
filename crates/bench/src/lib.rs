//! `ferrosan bench`: the seeds' benchmark methodology (4 KiB random I/O across queue depths,
//! 70/30 mix, 1 MiB sequential, an I/O-size sweep, a queue-depth × sessions matrix) run side by
//! side on iSCSI LUNs and local files or devices, written up as results.json and a
//! self-contained report.html.
#![forbid(unsafe_code)]

pub mod iscsi;
pub mod local;
pub mod nvme;
pub mod plan;
pub mod report;
pub mod runner;
pub mod stats;

use plan::{eta, human_duration, plan, Timing, Workload};
use report::{Results, Row, Skipped};
use runner::Target;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    /// Only these workloads (ids as in results.json); empty: the whole plan.
    pub only: Vec<String>,
    pub targets: Vec<String>,
}

/// How the run went: the caller maps it to an exit status.
#[derive(Debug)]
pub struct Outcome {
    pub results_json: PathBuf,
    pub report_html: PathBuf,
    /// Rows with I/O errors, and workloads that could not run.
    pub rows_with_errors: usize,
    pub skipped: usize,
}

/// Opens a target named on the command line.
fn open_target(spec: &str, opts: &Options) -> Result<Box<dyn Target>, String> {
    if spec.starts_with("iscsi://") {
        // ferrosan cannot tell whether other hosts use a LUN: --destructive is the user's word.
        return Ok(Box::new(iscsi::IscsiTarget::open(
            spec,
            &opts.initiator_name,
            opts.chap_secret.as_ref(),
        )?));
    }
    if spec.starts_with("nvme+tcp://") {
        return Ok(Box::new(nvme::NvmeTarget::open(spec, &opts.host_nqn)?));
    }
    let path = Path::new(spec);
    if opts.destructive {
        if let Some(why) = local::in_use(path, opts.even_if_open) {
            return Err(format!("{why}; not writing to it"));
        }
    }
    Ok(Box::new(local::LocalTarget::open(
        path,
        opts.destructive,
        opts.dsync,
    )?))
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

/// Runs one workload on one target and records its row (or why it was not run).
fn run_one(
    t: &dyn Target,
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
    let outcome = runner::run(t, w, timing, range);
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
    for t in &targets {
        for note in &t.info().notes {
            eprintln!("note: {}: {note}", t.info().name);
        }
    }
    let total = workloads.len() * targets.len();
    let tty = std::io::stderr().is_terminal();
    let began = Instant::now();
    let mut done = 0;
    // Workload by workload, every target in turn: drift (a warming SSD, a neighbour's load)
    // then touches every target alike.
    for w in &workloads {
        for t in &targets {
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
            run_one(t.as_ref(), w, &timing, opts, tty, &mut results);
            done += 1;
        }
    }
    let results_json = opts.out.join("results.json");
    let report_html = opts.out.join("report.html");
    std::fs::write(&results_json, results.to_json())
        .map_err(|e| format!("{}: {e}", results_json.display()))?;
    std::fs::write(&report_html, results.to_html())
        .map_err(|e| format!("{}: {e}", report_html.display()))?;
    eprintln!(
        "{total} runs in {}; wrote {} and {}",
        human_duration(began.elapsed()),
        results_json.display(),
        report_html.display()
    );
    Ok(Outcome {
        results_json,
        report_html,
        rows_with_errors: results.rows.iter().filter(|r| r.result.errors > 0).count(),
        skipped: results.skipped.len(),
    })
}
