//! `ferrosan bench`: argument parsing over the `bench` crate.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A short subset of 6 s each: 4 KiB random reads at queue depths 1 to 64 and 1 MiB
    /// sequential reads; with --destructive also 4 KiB random writes at queue depths 1 to 64,
    /// the 70/30 mix and 1 MiB sequential writes.
    #[arg(long)]
    quick: bool,
    /// Directory for results.json, report.html and fio-format JSON (fio/).
    #[arg(long, default_value = "ferrosan-bench")]
    out: PathBuf,
    /// Also run the write workloads. They overwrite data on every target named; a local device
    /// that is mounted, served (a running ferrosan claims its devices) or otherwise in use, or
    /// a file another process has open, is refused even then.
    #[arg(long)]
    destructive: bool,
    /// Local writes with RWF_DSYNC (each durable when it completes: compare with a
    /// write-through LUN). Default: plain O_DIRECT, like fio --direct=1.
    #[arg(long)]
    dsync: bool,
    /// Measured seconds per workload (default 5 with --quick, else 10; a ramp precedes each).
    #[arg(long)]
    runtime: Option<u64>,
    /// Unmeasured seconds before each workload's measurement (default 1 with --quick, else 2).
    #[arg(long)]
    ramp: Option<u64>,
    /// With --destructive: write to a local file even while another process has it open (a
    /// benchmark script that keeps a target serving the same file). Mounted or claimed devices
    /// and loop-device backing files are still refused.
    #[arg(long, requires = "destructive")]
    even_if_open: bool,
    /// Use only the first SIZE bytes of each target (e.g. 4G).
    #[arg(long)]
    size: Option<String>,
    /// Run only these workloads (comma-separated ids as in results.json, e.g.
    /// randread-4k-qd64,seqread-1m-qd16).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Initiator name for iSCSI sessions (default iqn.2026-11.org.ferrosan:bench.HOSTNAME).
    #[arg(long)]
    initiator_name: Option<String>,
    /// The CHAP secret for iscsi:// URLs that name a user without a password (one line; the
    /// file should be mode 0600). Else FERROSAN_CHAP_SECRET, else asked on the terminal. A
    /// password in the URL works too, but every user sees it in the process list.
    #[arg(long, value_name = "FILE")]
    chap_secret_file: Option<PathBuf>,
    /// A ferrosan daemon's metrics (http://HOST:PORT/metrics, or HOST:PORT): each row of a
    /// target it serves gets the daemon's CPU time per I/O. Repeat for several daemons.
    #[arg(long, value_name = "URL")]
    target_metrics: Vec<String>,
    /// Host NQN for nvme+tcp:// targets (default: /etc/nvme/hostnqn, else
    /// nqn.2026-11.org.ferrosan:bench.HOSTNAME).
    #[arg(long)]
    host_nqn: Option<String>,
    /// The TLS pre-shared key (NVMeTLSkey-1:01:...:, as `nvme gen-tls-key` writes it) for
    /// nvme+tcp://...?tls targets; the file should be mode 0600.
    #[arg(long, value_name = "FILE")]
    tls_key_file: Option<PathBuf>,
    /// How the target derives the TLS PSK from it: spec (default) or libnvme-1.15.
    #[arg(long, default_value = "spec", value_name = "HOW")]
    tls_derivation: String,
    /// Spin up to this many microseconds on the socket (or, for a local device, the
    /// io_uring) for each answer before sleeping: a polling host, as SPDK's initiator or
    /// Linux's NVMe/TCP poll queues. Lowers latency at low queue depths and costs a CPU per
    /// job. Default 0: sleep at once, as the kernel's initiators do.
    #[arg(long, default_value_t = 0, value_name = "US",
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    busy_poll_us: u64,
    /// iscsi://[USER[%PASSWORD]@]HOST[:PORT]/TARGET-IQN/LUN,
    /// nvme+tcp://HOST[:PORT]/SUBSYSTEM-NQN/NSID, a file, or a block device.
    #[arg(required = true)]
    targets: Vec<String>,
}

pub fn run(args: BenchArgs) -> ExitCode {
    let size = match args
        .size
        .as_deref()
        .map(engine::config::parse_size)
        .transpose()
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrosan bench: --size: {e}");
            return ExitCode::from(2);
        }
    };
    let chap_secret = match chap_secret(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrosan bench: {e}");
            return ExitCode::from(2);
        }
    };
    let tls_key = match tls_key(&args) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("ferrosan bench: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = bench::Options {
        tls_key,
        quick: args.quick,
        out: args.out,
        destructive: args.destructive,
        dsync: args.dsync,
        runtime: args.runtime.map(Duration::from_secs),
        ramp: args.ramp.map(Duration::from_secs),
        even_if_open: args.even_if_open,
        size,
        only: args.only,
        target_metrics: args.target_metrics,
        busy_poll: Duration::from_micros(args.busy_poll_us),
        host_nqn: args.host_nqn.unwrap_or_else(default_host_nqn),
        initiator_name: args.initiator_name.unwrap_or_else(default_initiator_name),
        chap_secret,
        targets: args.targets,
    };
    match bench::run(&opts) {
        Ok(outcome) if outcome.rows_with_errors == 0 && outcome.skipped == 0 => ExitCode::SUCCESS,
        Ok(outcome) => {
            eprintln!(
                "ferrosan bench: {} results with I/O errors, {} workloads not run (see {})",
                outcome.rows_with_errors,
                outcome.skipped,
                outcome.report_html.display()
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("ferrosan bench: {e}");
            ExitCode::from(2)
        }
    }
}

/// The `--tls-key-file` key, with its derivation.
fn tls_key(args: &BenchArgs) -> Result<Option<initiator::nvme::TlsPsk>, String> {
    let Some(path) = &args.tls_key_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--tls-key-file {}: {e}", path.display()))?;
    initiator::nvme::TlsPsk::parse(&text, &args.tls_derivation)
        .map(Some)
        .map_err(|e| format!("--tls-key-file {}: {e}", path.display()))
}

/// This host's NQN as nvme-cli keeps it (/etc/nvme/hostnqn), else ferrosan's bench name.
fn default_host_nqn() -> String {
    let kept = std::fs::read_to_string("/etc/nvme/hostnqn").unwrap_or_default();
    let kept = kept.trim();
    if kept.starts_with("nqn.") {
        return kept.to_string();
    }
    default_initiator_name().replacen("iqn.", "nqn.", 1)
}

/// `iqn.2026-11.org.ferrosan:bench.HOST`, the host name reduced to what an IQN allows.
fn default_initiator_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
        .collect();
    if host.is_empty() {
        "iqn.2026-11.org.ferrosan:bench".into()
    } else {
        format!("iqn.2026-11.org.ferrosan:bench.{host}")
    }
}

/// The CHAP secret for URLs with a user but no password: from `--chap-secret-file`, else
/// `FERROSAN_CHAP_SECRET`, else asked on the terminal (not echoed); `None` when no URL needs
/// one, or none can be had (the target's open then says what to give).
fn chap_secret(args: &BenchArgs) -> Result<Option<initiator::Secret>, String> {
    let trimmed = |s: &str| s.trim_end_matches(['\r', '\n']).as_bytes().to_vec();
    if let Some(path) = &args.chap_secret_file {
        use std::io::Read as _;
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(4096).read_to_string(&mut text))
            .map_err(|e| format!("--chap-secret-file {}: {e}", path.display()))?;
        return Ok(Some(initiator::Secret::new(trimmed(&text))));
    }
    if let Some(secret) = std::env::var_os("FERROSAN_CHAP_SECRET") {
        return Ok(Some(initiator::Secret::new(trimmed(
            &secret.to_string_lossy(),
        ))));
    }
    let needed = args
        .targets
        .iter()
        .find_map(|t| initiator::url::IscsiUrl::parse(t).ok()?.user_without_secret);
    match needed {
        Some(user) if std::io::IsTerminal::is_terminal(&std::io::stdin()) => {
            let secret = rpassword::prompt_password(format!("CHAP secret of {user}: "))
                .map_err(|e| format!("reading the CHAP secret: {e}"))?;
            Ok(Some(initiator::Secret::new(trimmed(&secret))))
        }
        _ => Ok(None),
    }
}
