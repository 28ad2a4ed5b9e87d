//! Where the running config came from (what a reload re-reads, with which command-line
//! overrides) and which live changes its file does not hold yet.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::reread::Read;

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
    /// The file as last read: the next read compares with it (`config::reread`).
    pub last_read: Arc<Mutex<Option<Read>>>,
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

    /// Reads and validates the config file, without the overrides. Where only `[[device]]`
    /// tables changed since the last read, those alone are parsed (`config::reread`).
    pub fn read_file(&self) -> Result<Config, LoadError> {
        let path = self.path.as_deref().ok_or(LoadError::NoFile)?;
        let text = Config::file_text(path)?;
        let mut last = self.last_read.lock().unwrap_or_else(|e| e.into_inner());
        let read = super::reread::read(text, &path.display().to_string(), last.as_ref())?;
        match read.by_difference() {
            Some(tables) => {
                tracing::debug!("config read by difference: {tables} [[device]] tables parsed")
            }
            None => tracing::debug!("config read whole"),
        }
        let config = read.config().clone();
        *last = Some(read);
        Ok(config)
    }

    /// Reads and validates the config file, overrides applied.
    pub fn load(&self) -> Result<Config, LoadError> {
        let path = self.path.as_deref().ok_or(LoadError::NoFile)?;
        let mut config = self.read_file()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reread_parses_what_changed() {
        let dir = std::env::temp_dir().join(format!("ferrosan-reread-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ferrosan.toml");
        let device =
            |name: &str| format!("[[device]]\nname = \"{name}\"\nstore = \"ram\"\nsize = \"1M\"\n");
        let text = format!("[server]\nworkers = 1\n\n{}\n{}", device("a"), device("b"));
        std::fs::write(&path, &text).unwrap();
        let source = ConfigSource {
            path: Some(path.clone()),
            ..ConfigSource::default()
        };
        let how = || {
            source
                .last_read
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .by_difference()
        };
        assert_eq!(source.read_file().unwrap().devices.len(), 2);
        assert_eq!(how(), None, "the first read is whole");
        std::fs::write(&path, format!("{text}\n{}", device("c"))).unwrap();
        let config = source.read_file().unwrap();
        assert_eq!(config.devices.len(), 3);
        // The new table, and the one its lines follow (the difference begins at its end).
        assert_eq!(how(), Some(2));
        // A refused file leaves the last read as it was.
        std::fs::write(&path, format!("{text}\n{}", device("a"))).unwrap();
        assert!(source.read_file().is_err());
        std::fs::write(&path, format!("{text}\n{}", device("c"))).unwrap();
        assert_eq!(source.read_file().unwrap().devices.len(), 3);
        assert_eq!(how(), Some(0), "unchanged since the last read");
        std::fs::write(&path, text.replace("workers = 1", "workers = 2")).unwrap();
        assert_eq!(source.read_file().unwrap().server.workers, 2);
        assert_eq!(how(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
