//! ferrosan: a userspace iSCSI target. Thin CLI over the `engine` crate.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use engine::config::Config;
use engine::config::ConfigSource;

mod bench_cmd;
mod config_man;
mod ctl;
mod dropin;
mod generate;
mod man_extra;
mod top;

#[derive(Parser)]
#[command(
    name = "ferrosan",
    version,
    about = "A userspace SAN target: RAM, file, block-device and Ceph RBD devices over iSCSI and NVMe/TCP",
    arg_required_else_help = true
)]
pub(crate) struct Cli {
    /// Log format: text (colour only on a terminal) or json (one object per line).
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve targets. With no options: a demo target with a 1 GiB RAM LUN on 127.0.0.1:3260
    /// (iSCSI) and 127.0.0.1:4420 (NVMe/TCP).
    Serve {
        /// Declarative configuration file (TOML, see docs/CONFIG.md).
        #[arg(short, long, conflicts_with_all = ["listen", "nvme_listen", "target", "lun"])]
        config: Option<PathBuf>,
        /// Portal to listen on, ADDR:PORT or [V6ADDR]:PORT (repeatable; default 127.0.0.1:3260).
        #[arg(long)]
        listen: Vec<String>,
        /// NVMe/TCP listener for the same target, ADDR[:PORT] (port 4420 unless given;
        /// repeatable). The subsystem's NQN is the target's IQN with `nqn.` for `iqn.`. With
        /// neither --listen nor --nvme-listen, both 127.0.0.1:3260 and 127.0.0.1:4420.
        #[arg(long)]
        nvme_listen: Vec<String>,
        /// Target name (IQN) for a quick export.
        #[arg(long)]
        target: Option<String>,
        /// LUN for a quick export, numbered 0, 1, ... in order: ram:SIZE | file:PATH[,size=SIZE] |
        /// block:PATH | rbd:POOL/IMAGE[,conf=CEPH_CONF][,client=client.NAME], each optionally
        /// followed by ,block_size=512|4096, ,cache=auto|direct|page (auto: direct I/O on disk
        /// filesystems), ,write_cache (WCE=1: durable only after SYNCHRONIZE CACHE or FUA) and ,ro
        #[arg(long)]
        lun: Vec<String>,
        /// Worker threads (0 = one per core).
        #[arg(long)]
        workers: Option<usize>,
        /// Which gateway of the config this daemon is (portal groups with `gateway = NAME`;
        /// overrides [server] gateway).
        #[arg(long)]
        gateway: Option<String>,
        /// Serve Prometheus metrics at http://ADDR:PORT/metrics (overrides the config file's).
        #[arg(long)]
        metrics_listen: Option<String>,
        /// Directory for state kept across restarts: persistent reservations with APTPL
        /// (overrides the config file's; default /var/lib/ferrosan for root, else
        /// $XDG_STATE_HOME/ferrosan).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Control socket for `ferrosan ctl` (overrides the config file's; default
        /// /run/ferrosan/control.sock for root, else $XDG_RUNTIME_DIR/ferrosan/control.sock).
        #[arg(long)]
        control_socket: Option<PathBuf>,
        /// Start even when the config file names no target (to be filled live with `ctl`);
        /// without it such a config is refused: it would serve nothing.
        #[arg(long)]
        allow_empty: bool,
    },
    /// Control a running daemon through its control socket (see docs/OPERATIONS.md).
    Ctl(ctl::CtlArgs),
    /// A live view of sessions and devices (IOPS, MB/s, latency, queue) from the control socket.
    Top(top::TopArgs),
    /// Validate a configuration file without serving; errors name file, line and field.
    CheckConfig {
        /// The configuration file to check.
        file: PathBuf,
        /// Also check what starting it here would meet, changing nothing: files and block
        /// devices exist (or can be created) with the configured size and type and may be
        /// written, every listener's address can be bound, the state directory is writable.
        #[arg(long)]
        deep: bool,
        /// Accept a config that names no target (serve --allow-empty).
        #[arg(long)]
        allow_empty: bool,
    },
    /// Benchmark iSCSI LUNs and local devices side by side (the seeds' fio methodology):
    /// writes results.json and a self-contained report.html (see docs/BENCH.md).
    Bench(bench_cmd::BenchArgs),
    /// Print the systemd drop-in the packaged unit needs for a config's block devices and
    /// files outside /var/lib/ferrosan (docs/SECURITY.md, "Running unprivileged").
    SystemdDropin(dropin::DropinArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on stdout.
    Completions(generate::CompletionsArgs),
    /// Write the man pages (ferrosan(1) and one per command) into a directory.
    Man(generate::ManArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs(&cli.log_format);
    match cli.command {
        Command::Ctl(args) => ctl::run(args),
        Command::Top(args) => top::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Completions(args) => generate::completions(args),
        Command::SystemdDropin(args) => dropin::run(args),
        Command::Man(args) => generate::man(args),
        Command::CheckConfig {
            file,
            deep,
            allow_empty,
        } => check_config(&file, deep, allow_empty),
        Command::Serve {
            config,
            listen,
            nvme_listen,
            target,
            lun,
            workers,
            gateway,
            metrics_listen,
            state_dir,
            control_socket,
            allow_empty,
        } => {
            let source = ConfigSource {
                path: config,
                metrics_listen: None,
                state_dir,
                control_socket,
                workers,
                gateway,
                ..ConfigSource::default()
            };
            let source = resolve_source(source, metrics_listen);
            let loaded = source.and_then(|source| {
                let mut c = match &source.path {
                    Some(_) => source.read_file().map_err(|e| e.to_string())?,
                    None => Config::from_cli(
                        &listen,
                        &nvme_listen,
                        target.as_deref().unwrap_or(""),
                        &lun,
                    )
                    .map_err(|e| e.to_string())?,
                };
                source.apply_overrides(&mut c);
                if source.path.is_some() {
                    refuse_empty(&c, allow_empty)?;
                }
                Ok((c, source))
            });
            serve(loaded)
        }
    }
}

/// Logs to stderr, as text (coloured only on a terminal) or JSON lines; `FERROSAN_LOG` filters.
fn init_logs(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERROSAN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        logs.json().init();
    } else {
        // Colour codes only where a person reads them: not in files or the journal.
        use std::io::IsTerminal as _;
        logs.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// A config file that names no target serves nothing: refused unless asked for (the
/// operator means to fill it live). One rule for `serve` and `check-config`.
fn refuse_empty(config: &Config, allow_empty: bool) -> Result<(), String> {
    if config.targets.is_empty() && !allow_empty {
        return Err(
            "the config names no [[target]]: it would serve nothing (--allow-empty to start it \
             anyway and add targets live)"
                .into(),
        );
    }
    Ok(())
}

fn check_config(file: &Path, deep: bool, allow_empty: bool) -> ExitCode {
    match Config::load(file) {
        Ok(config) => {
            if let Some(warning) = config.exposed_secrets(file) {
                eprintln!("warning: {warning}");
            }
            if let Err(e) = refuse_empty(&config, allow_empty) {
                eprintln!("{}: {e}", file.display());
                return ExitCode::from(1);
            }
            if deep {
                let problems = engine::topology::preflight::preflight(&config);
                for p in &problems {
                    eprintln!("{}: {p}", file.display());
                }
                if !problems.is_empty() {
                    eprintln!(
                        "{}: {} problem(s) starting it here would meet",
                        file.display(),
                        problems.len()
                    );
                    return ExitCode::from(1);
                }
            }
            println!(
                "{}: ok ({}, {}, {})",
                file.display(),
                counted(config.targets.len(), "target"),
                counted(config.devices.len(), "device"),
                counted(config.portal_groups.len(), "portal group")
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::from(1)
        }
    }
}

/// The command line's config source with its paths made absolute (a reload re-reads them
/// whatever the working directory) and `--metrics-listen` parsed.
fn resolve_source(
    mut source: ConfigSource,
    metrics_listen: Option<String>,
) -> Result<ConfigSource, String> {
    let absolute = |flag: &str, p: Option<PathBuf>| {
        p.map(|p| std::path::absolute(&p).map_err(|e| format!("{flag} {}: {e}", p.display())))
            .transpose()
    };
    source.path = absolute("--config", source.path.take())?;
    source.state_dir = absolute("--state-dir", source.state_dir.take())?;
    source.control_socket = absolute("--control-socket", source.control_socket.take())?;
    source.metrics_listen = metrics_listen
        .map(|addr| {
            engine::config::parse_listen(&addr).map_err(|e| format!("--metrics-listen {addr}: {e}"))
        })
        .transpose()?;
    Ok(source)
}

fn serve(loaded: Result<(Config, ConfigSource), String>) -> ExitCode {
    let (config, source) = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferrosan: {e}");
            return ExitCode::from(2);
        }
    };
    // Signal handlers go in before the first connection can arrive, so an early SIGTERM is a
    // graceful shutdown too, not the default (immediate) death.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ferrosan: signal runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        let _runtime = runtime.enter();
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(term), Ok(int), Ok(hup)) => Signals { term, int, hup },
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                eprintln!("ferrosan: cannot install signal handlers: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let server = match engine::Server::start(&config, source) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrosan: {e}");
            return ExitCode::from(e.exit_code());
        }
    };
    print_banner(&config, &server);
    // Every portal listens and the workers run: systemd (Type=notify) may start what needs us.
    notify_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving on {}", join(&server.bound))),
    ]);
    runtime.block_on(run_until_signal(&server, signals))
}

/// Tells systemd (when it started us with NOTIFY_SOCKET; otherwise nothing happens). A failure
/// is logged, never fatal: the daemon serves either way.
fn notify_systemd(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!("cannot notify systemd: {e}");
    }
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

/// Serves until SIGTERM or SIGINT, then shuts down gracefully (`Server::drain`: sessions are
/// asked to log out, LUs flushed); a second signal during the drain exits at once. SIGHUP
/// reloads the config file by difference (a bad file changes nothing; the error is logged).
async fn run_until_signal(server: &engine::Server, signals: Signals) -> ExitCode {
    let Signals {
        mut term,
        mut int,
        mut hup,
    } = signals;
    // WatchdogSec= in the unit: a keep-alive at half the interval from this (signal) thread,
    // which also answers SIGHUP and SIGTERM, sent while every worker runs.
    let watchdog = sd_notify::watchdog_enabled()
        .map(|interval| interval / 2)
        .filter(|half| !half.is_zero());
    let mut keep_alive =
        tokio::time::interval(watchdog.unwrap_or(std::time::Duration::from_secs(3600)));
    let name = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            _ = keep_alive.tick(), if watchdog.is_some() => {
                // Only while every network worker's runtime runs (each beats once a second):
                // a stuck worker makes systemd restart the daemon.
                if server.shared.workers_alive(std::time::Duration::from_secs(5)) {
                    notify_systemd(&[sd_notify::NotifyState::Watchdog]);
                } else {
                    tracing::error!("a network worker has not run for 5 s: withholding the watchdog keep-alive");
                }
            }
            _ = hup.recv() => reload(server).await,
        }
    };
    notify_systemd(&[sd_notify::NotifyState::Stopping]);
    let grace = server.shared.limits.shutdown_grace_s;
    tracing::info!(
        connections = server.shared.doors.open_connections(),
        "{name}: shutting down; sessions have {grace} s to log out (a second signal exits at once)"
    );
    tokio::select! {
        left = server.drain() => {
            if left == 0 {
                tracing::info!("shut down: every session closed, every LU flushed");
            } else {
                tracing::warn!(left, "shut down: connections still open after the grace period are closed; every LU flushed");
            }
            ExitCode::SUCCESS
        }
        _ = term.recv() => {
            tracing::warn!("SIGTERM again: exiting without waiting");
            ExitCode::FAILURE
        }
        _ = int.recv() => {
            tracing::warn!("SIGINT again: exiting without waiting");
            ExitCode::FAILURE
        }
    }
}

/// SIGHUP: re-reads the config file and applies the difference, telling systemd it reloads.
async fn reload(server: &engine::Server) {
    let mut reloading = vec![sd_notify::NotifyState::Reloading];
    if let Ok(now) = sd_notify::NotifyState::monotonic_usec_now() {
        reloading.push(now);
    }
    notify_systemd(&reloading);
    let shared = std::sync::Arc::clone(&server.shared);
    // Opening devices may block: not on this (signal) thread's runtime.
    let outcome = tokio::task::spawn_blocking(move || {
        engine::control::reload::reload_file(&shared, &shared.source, false)
    })
    .await;
    match outcome {
        Ok(Ok(applied)) if applied.changes.is_empty() => {
            tracing::info!("SIGHUP: config unchanged")
        }
        Ok(Ok(applied)) => tracing::info!(
            generation = applied.generation,
            "SIGHUP: reloaded ({} changes)",
            applied.changes.lines().len()
        ),
        Ok(Err(e)) => tracing::error!(
            kind = e.kind(),
            "SIGHUP: reload refused, nothing changed: {e}"
        ),
        Err(e) => tracing::error!("SIGHUP: reload failed: {e}"),
    }
    // A refused reload leaves the old config serving: ready either way.
    notify_systemd(&[sd_notify::NotifyState::Ready]);
}

fn print_banner(config: &Config, server: &engine::Server) {
    let bound = &server.bound;
    // The examples must be addresses an initiator can dial, not 0.0.0.0.
    let host = engine::topology::portals::host_addresses();
    let portal = bound
        .first()
        .map(|&a| engine::topology::portals::dialable(a, &host));
    let nvme = server
        .bound_nvme
        .first()
        .map(|&a| engine::topology::portals::dialable(a, &host));
    // An NVMe/TCP-only config still says where it serves.
    let first_line = if bound.is_empty() {
        &server.bound_nvme
    } else {
        bound
    };
    println!(
        "ferrosan {} serving on {}",
        env!("CARGO_PKG_VERSION"),
        join(first_line)
    );
    if !server.bound_nvme.is_empty() {
        println!("  NVMe/TCP on {}", join(&server.bound_nvme));
    }
    if !server.bound_discovery.is_empty() {
        println!("  NVMe/TCP discovery on {}", join(&server.bound_discovery));
    }
    if let Some(metrics) = config.server.metrics_listen {
        println!("  metrics  http://{metrics}/metrics");
    }
    if let Some(socket) = &server.control_socket {
        println!(
            "  control  {}  (ferrosan ctl --socket {} status)",
            socket.display(),
            socket.display()
        );
    }
    for t in &config.targets {
        print_target(t, portal, nvme, &server.bound_discovery);
    }
}

/// A target's lines of the banner: its LUNs, and how an initiator or host reaches them.
fn print_target(
    t: &engine::config::TargetConfig,
    portal: Option<std::net::SocketAddr>,
    nvme: Option<std::net::SocketAddr>,
    bound_discovery: &[std::net::SocketAddr],
) {
    // Each group numbers its own LUNs: list each number once.
    let luns: Vec<u64> = t
        .groups
        .iter()
        .flat_map(|g| g.luns.iter().map(|l| l.lun))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!("  target {}  LUNs {:?}", t.iqn, luns);
    if let Some(portal) = portal {
        if let Some(first) = luns.first() {
            println!("    iscsi://{portal}/{}/{first}", t.iqn);
        }
        println!("    iscsiadm -m discovery -t sendtargets -p {portal}");
        println!("    iscsiadm -m node -T {} -p {portal} --login", t.iqn);
    }
    if let (Some(nqn), Some(nvme)) = (&t.nqn, nvme) {
        // NSID = LUN + 1.
        if let Some(first) = luns.first() {
            println!("    nvme+tcp://{nvme}/{nqn}/{}", first + 1);
        }
        let (ip, port) = (nvme.ip(), nvme.port());
        // The discovery port where it is served at this address, else the I/O port's
        // discovery controller.
        let discovery = bound_discovery
            .iter()
            .find(|d| d.ip() == ip)
            .map_or(port, |d| d.port());
        println!("    nvme discover -t tcp -a {ip} -s {discovery}");
        println!("    nvme connect -t tcp -a {ip} -s {port} -n {nqn}");
    }
}

fn join(addrs: &[std::net::SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `n` things in words: "1 target", "3 targets".
pub(crate) fn counted(n: usize, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}
