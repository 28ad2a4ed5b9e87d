//! What starting a config here would meet, found without changing anything: the devices'
//! files and block devices (through the store's own inspection, the checks its open makes),
//! the listeners' addresses, the state directory. `ferrosan check-config --deep` reports
//! it, so that a config that passes starts.

use super::portals::ListenerKind;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;

use store::FileStore;

use crate::config::{Config, StoreKind};

/// One thing the daemon would fail on: what (a device, a listener, a directory) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub what: String,
    pub why: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, self.why)
    }
}

/// Every problem starting `config` here would meet; empty when it would start.
pub fn preflight(config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    devices(config, &mut problems);
    listeners(config, &mut problems);
    if let Some(dir) = super::state::state_dir(config.server.state_dir.as_deref()) {
        if let Err(why) = writable_or_creatable(&dir) {
            problems.push(Problem {
                what: format!("state directory {}", dir.display()),
                why: why.to_string(),
            });
        }
    }
    problems
}

fn devices(config: &Config, problems: &mut Vec<Problem>) {
    for d in &config.devices {
        let why = match &d.store {
            StoreKind::File { path, size_bytes } => FileStore::inspect(path, *size_bytes)
                .err()
                .map(|e| e.to_string()),
            // The start opens a block device as a file of its own size: the same inspection.
            StoreKind::Block { path } => {
                FileStore::inspect(path, None).err().map(|e| e.to_string())
            }
            StoreKind::Rbd(spec) => spec.conf.as_ref().and_then(|conf| {
                std::fs::File::open(conf)
                    .err()
                    .map(|e| format!("{}: {e}", conf.display()))
            }),
            StoreKind::Ram { .. } => None,
        };
        if let Some(why) = why {
            problems.push(Problem {
                what: d.located(),
                why,
            });
        }
    }
}

/// Each address this daemon would listen on (iSCSI, NVMe/TCP, configured discovery, metrics)
/// is bound and let go at once.
fn listeners(config: &Config, problems: &mut Vec<Problem>) {
    let mut addresses: Vec<(SocketAddr, &str)> = super::portals::listeners(config)
        .into_iter()
        .filter(|l| l.required)
        .map(|l| {
            let what = match l.kind {
                ListenerKind::Iscsi => "iSCSI portal",
                ListenerKind::Nvme => "NVMe/TCP listener",
                ListenerKind::NvmeDiscovery => "NVMe/TCP discovery listener",
            };
            (l.addr, what)
        })
        .collect();
    addresses.extend(
        config
            .server
            .metrics_listen
            .map(|a| (a, "metrics listener")),
    );
    for (address, kind) in addresses {
        if let Err(e) = TcpListener::bind(address) {
            problems.push(Problem {
                what: format!("{kind} {address}"),
                why: format!("cannot listen: {e}"),
            });
        }
    }
}

/// `dir` is a writable directory, or the nearest directory above it that exists is (the
/// daemon creates the rest).
fn writable_or_creatable(dir: &Path) -> Result<(), NotWritable> {
    let mut at = dir;
    while !at.exists() {
        at = at.parent().ok_or(NotWritable::NothingAbove)?;
    }
    if !at.is_dir() {
        return Err(NotWritable::NotADirectory(at.to_path_buf()));
    }
    let access = rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK;
    rustix::fs::access(at, access).map_err(|e| NotWritable::Denied(at.to_path_buf(), e))
}

/// Why a directory the daemon writes to could not be.
#[derive(Debug)]
enum NotWritable {
    NothingAbove,
    NotADirectory(std::path::PathBuf),
    Denied(std::path::PathBuf, rustix::io::Errno),
}

impl std::fmt::Display for NotWritable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotWritable::NothingAbove => f.write_str("no existing directory above it"),
            NotWritable::NotADirectory(at) => write!(f, "{} is not a directory", at.display()),
            NotWritable::Denied(at, e) => write!(f, "{} is not writable: {e}", at.display()),
        }
    }
}
