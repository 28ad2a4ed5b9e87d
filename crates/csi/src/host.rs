//! What the node service does to its machine, behind one trait: run a tool (iscsiadm,
//! nvme, mkfs, mount), read sysfs, keep its records. The node's decisions are tested against
//! a fake machine (`node.rs`'s tests); [`System`] is the real one.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tool that did not succeed.
#[derive(Debug, thiserror::Error)]
#[error("{program} {args}: {why}")]
pub struct HostError {
    pub program: String,
    pub args: String,
    /// Its exit code, when it ran and exited.
    pub code: Option<i32>,
    pub why: String,
}

pub trait Host: Send + Sync + 'static {
    /// Runs `program` with `args`; its standard output.
    fn run(&self, program: &str, args: &[&str]) -> Result<String, HostError>;
    /// A file's text (sysfs attributes, the node's names, records), if it is there.
    fn read(&self, path: &Path) -> Option<String>;
    /// Where a symbolic link (udev's) leads, if it leads anywhere.
    fn resolve(&self, link: &Path) -> Option<PathBuf>;
    /// The names in a directory (none if it is not there).
    fn list(&self, dir: &Path) -> Vec<String>;
    fn write(&self, path: &Path, text: &str) -> io::Result<()>;
    fn remove(&self, path: &Path) -> io::Result<()>;
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Creates an empty file at `path` (a block volume's publish target), if none is there.
    fn create_file(&self, path: &Path) -> io::Result<()>;
}

#[derive(Default)]
pub struct System;

impl Host for System {
    fn run(&self, program: &str, args: &[&str]) -> Result<String, HostError> {
        let failed = |code, why: String| HostError {
            program: program.to_string(),
            args: args.join(" "),
            code,
            why,
        };
        let out = Command::new(program)
            .args(args)
            .output()
            .map_err(|e| failed(None, e.to_string()))?;
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
            return Err(failed(out.status.code(), why));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn read(&self, path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }

    fn resolve(&self, link: &Path) -> Option<PathBuf> {
        std::fs::canonicalize(link).ok()
    }

    fn list(&self, dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn write(&self, path: &Path, text: &str) -> io::Result<()> {
        std::fs::write(path, text)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::IsADirectory => std::fs::remove_dir(path),
            other => other,
        }
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn create_file(&self, path: &Path) -> io::Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map(drop)
    }
}

/// Where the node keeps what it staged (one JSON record per volume): what Unstage, which gets
/// no publish context, logs out from.
pub fn record_path(state_dir: &Path, volume: &str) -> PathBuf {
    state_dir.join(format!("{volume}.json"))
}
