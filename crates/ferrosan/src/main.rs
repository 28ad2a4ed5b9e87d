//! ferrosan: a userspace iSCSI target. Thin CLI over the `target` engine.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use target::config::Config;

#[derive(Parser)]
#[command(
    name = "ferrosan",
    version,
    about = "A userspace iSCSI target: RAM, file and block-device LUNs over iSCSI"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve targets. With no options: a demo target with a 1 GiB RAM LUN on 127.0.0.1:3260.
    Serve {
        /// Declarative configuration file (TOML, see docs/CONFIG.md).
        #[arg(short, long, conflicts_with_all = ["listen", "target", "lun"])]
        config: Option<PathBuf>,
        /// Portal to listen on, ADDR:PORT or [V6ADDR]:PORT (repeatable; default 127.0.0.1:3260).
        #[arg(long)]
        listen: Vec<String>,
        /// Target name (IQN) for a quick export.
        #[arg(long)]
        target: Option<String>,
        /// LUN for a quick export, numbered 0, 1, ... in order: ram:SIZE | file:PATH[,size=SIZE] |
        /// block:PATH, each optionally followed by ,block_size=512|4096, ,cache=auto|direct|page
        /// (auto: direct I/O on disk filesystems) and ,ro
        #[arg(long)]
        lun: Vec<String>,
        /// Worker threads (0 = one per core).
        #[arg(long)]
        workers: Option<usize>,
        /// Serve Prometheus metrics at http://ADDR:PORT/metrics (overrides the config file's).
        #[arg(long)]
        metrics_listen: Option<String>,
        /// Directory for state kept across restarts: persistent reservations with APTPL
        /// (overrides the config file's; default /var/lib/ferrosan for root, else
        /// $XDG_STATE_HOME/ferrosan).
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Validate a configuration file without serving; errors name file, line and field.
    CheckConfig { file: PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERROSAN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Some(Command::CheckConfig { file }) => match Config::load(&file) {
            Ok(config) => {
                println!(
                    "{}: ok ({} targets, {} devices, {} portal groups)",
                    file.display(),
                    config.targets.len(),
                    config.devices.len(),
                    config.portal_groups.len()
                );
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::from(1)
            }
        },
        Some(Command::Serve {
            config,
            listen,
            target,
            lun,
            workers,
            metrics_listen,
            state_dir,
        }) => {
            let loaded = match config {
                Some(path) => Config::load(&path).map_err(|e| e.to_string()),
                None => Config::from_cli(&listen, target.as_deref().unwrap_or(""), &lun)
                    .map_err(|e| e.to_string()),
            };
            let loaded = loaded.and_then(|mut c| {
                if let Some(addr) = metrics_listen {
                    let addr = target::config::parse_listen(&addr)
                        .map_err(|e| format!("--metrics-listen {addr}: {e}"))?;
                    c.server.metrics_listen = Some(addr);
                }
                if let Some(dir) = state_dir {
                    c.server.state_dir = Some(
                        std::path::absolute(&dir)
                            .map_err(|e| format!("--state-dir {}: {e}", dir.display()))?,
                    );
                }
                Ok(c)
            });
            serve(loaded, workers)
        }
        None => serve(Ok(Config::demo()), None),
    }
}

fn serve(config: Result<Config, String>, workers: Option<usize>) -> ExitCode {
    let mut config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferrosan: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(w) = workers {
        config.server.workers = w;
    }
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
        ) {
            (Ok(term), Ok(int)) => Signals { term, int },
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("ferrosan: cannot install signal handlers: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let server = match target::Server::start(&config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrosan: {e}");
            return ExitCode::from(1);
        }
    };
    print_banner(&config, &server.bound);
    runtime.block_on(run_until_signal(&server, signals))
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

/// Serves until SIGTERM or SIGINT, then shuts down gracefully (`Server::drain`: sessions are
/// asked to log out, LUs flushed); a second signal during the drain exits at once.
async fn run_until_signal(server: &target::Server, signals: Signals) -> ExitCode {
    let Signals { mut term, mut int } = signals;
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    let grace = server.shared.limits.shutdown_grace_s;
    tracing::info!(
        connections = server.shared.open_connections(),
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

fn print_banner(config: &Config, bound: &[std::net::SocketAddr]) {
    let Some(portal) = bound.first() else {
        return;
    };
    println!(
        "ferrosan {} serving on {}",
        env!("CARGO_PKG_VERSION"),
        join(bound)
    );
    for t in &config.targets {
        let luns: Vec<u64> = t
            .groups
            .iter()
            .flat_map(|g| g.luns.iter().map(|l| l.lun))
            .collect();
        println!("  target {}  LUNs {:?}", t.iqn, luns);
        if let Some(first) = luns.first() {
            println!("    iscsi://{portal}/{}/{first}", t.iqn);
        }
        println!("    iscsiadm -m discovery -t sendtargets -p {portal}");
        println!("    iscsiadm -m node -T {} -p {portal} --login", t.iqn);
    }
}

fn join(addrs: &[std::net::SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
