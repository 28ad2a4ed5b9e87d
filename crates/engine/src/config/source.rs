//! Where the running config came from (what a reload re-reads, with which command-line
//! overrides) and which live changes its file does not hold yet.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;

use super::{Config, ConfigErrors};

/// Why the config file could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "nothing to reload: serving the demo or a quick export from the command line, not a config file"
    )]
    NoFile,
    #[error(transparent)]
    Invalid(#[from] ConfigErrors),
}

/// Where the running config came from, so a reload reads the same file and applies the same
/// command-line overrides to it.
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// The config file; None for the demo and quick exports (nothing to reload).
    pub path: Option<PathBuf>,
    pub metrics_listen: Option<SocketAddr>,
    pub state_dir: Option<PathBuf>,
    pub control_socket: Option<PathBuf>,
    pub workers: Option<usize>,
    /// `serve --gateway`: which gateway of the config this daemon is.
    pub gateway: Option<String>,
}

impl ConfigSource {
    /// The command-line overrides, applied on top of the file's values.
    pub fn apply_overrides(&self, config: &mut Config) {
        if let Some(addr) = self.metrics_listen {
            config.server.metrics_listen = Some(addr);
        }
        if let Some(dir) = &self.state_dir {
            config.server.state_dir = Some(dir.clone());
        }
        if let Some(path) = &self.control_socket {
            config.server.control_socket = Some(path.clone());
        }
        if let Some(w) = self.workers {
            config.server.workers = w;
        }
        if let Some(g) = &self.gateway {
            config.server.gateway = Some(g.clone());
        }
    }

    /// Reads and validates the config file, overrides applied.
    pub fn load(&self) -> Result<Config, LoadError> {
        let path = self.path.as_deref().ok_or(LoadError::NoFile)?;
        let mut config = Config::load(path)?;
        if let Some(warning) = config.exposed_secrets(path) {
            tracing::warn!("{warning}");
        }
        self.apply_overrides(&mut config);
        Ok(config)
    }
}

/// Whether unchanged edits were applied but not written to the config file: `ctl status`
/// reports them so that no change is lost at the next restart without a word.
#[derive(Default)]
pub struct Unsaved {
    changes: Mutex<Vec<String>>,
}

impl Unsaved {
    pub fn add(&self, what: String) {
        let mut c = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        c.push(what);
        // Bounded: the count is what matters past a screenful.
        if c.len() > 100 {
            c.remove(0);
        }
    }
    pub fn clear(&self) {
        self.changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
    pub fn list(&self) -> Vec<String> {
        self.changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
