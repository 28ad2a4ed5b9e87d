//! The control plane's errors. Each has a kind: the `kind` of `ctl`'s JSON error answer and
//! of the log line that reports it.

use std::path::PathBuf;

use crate::config::edit::MergeError;
use crate::config::{ConfigErrors, LoadError};
use crate::topology::OpenError;

/// Why a reload (SIGHUP, `ctl reload`, a `ctl` change) was not applied. Nothing changed,
/// except what [`ReloadError::Resize`] says grew already.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Something changed that only a restart applies (one reason a line).
    #[error("{}", .0.join("\n"))]
    NeedsRestart(Vec<String>),
    #[error(transparent)]
    Open(#[from] OpenError),
    /// A device could not be resized (the message names what grew before it).
    #[error("{0}")]
    Resize(String),
    /// A new listener could not be bound.
    #[error(transparent)]
    Listen(#[from] crate::shared::listening::ListenError),
    /// A device could not take a new attribute (its write cache could not be flushed).
    #[error("{0}")]
    Attribute(String),
    /// Re-reading the file would drop changes made with `ctl` and not saved (listed).
    #[error(
        "the running config has changes the file does not hold, which a reload would undo: {}; \
         save them first (ferrosan ctl save), or reload with --discard to drop them",
        .0.join("; ")
    )]
    Unsaved(Vec<String>),
}

impl ReloadError {
    pub fn kind(&self) -> &'static str {
        match self {
            ReloadError::Load(LoadError::NoFile) => "no_config_file",
            ReloadError::Load(LoadError::Invalid(_)) => "invalid_config",
            ReloadError::NeedsRestart(_) => "needs_restart",
            ReloadError::Open(e) => e.kind(),
            ReloadError::Resize(_) => "resize",
            ReloadError::Attribute(_) => "device",
            ReloadError::Listen(_) => "listen",
            ReloadError::Unsaved(_) => "conflict",
        }
    }
}

/// Why the running config was not saved into its file. The file is unchanged.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(
        "no config file to save to: the daemon runs the demo or a quick export (serve --config FILE)"
    )]
    NoFile,
    #[error("the file no longer loads ({0}); not saving over it")]
    FileInvalid(ConfigErrors),
    #[error(transparent)]
    Merge(#[from] MergeError),
    #[error("the edited file would not load ({0}); not saved")]
    WouldNotLoad(ConfigErrors),
    #[error("{}: not a file name", .0.display())]
    NotAFile(PathBuf),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl SaveError {
    pub(crate) fn io(path: &std::path::Path) -> impl Fn(std::io::Error) -> SaveError + '_ {
        move |source| SaveError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Why a `ctl` request failed. Nothing changed, except for [`ControlError::NotSaved`] (the
/// change runs, its file does not hold it) and what a [`ReloadError::Resize`] names.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The request is malformed: an unknown verb, a missing or invalid argument.
    #[error("{0}")]
    BadRequest(String),
    /// It names a device, target, group, LUN, initiator or session that is not there.
    #[error("{0}")]
    NotFound(String),
    /// It contradicts what runs: a name taken, a device still mapped, a shrink.
    #[error("{0}")]
    Conflict(String),
    /// An exclusive export of a volume another host sees (or that would be seen by others).
    #[error("{0}")]
    InUse(String),
    /// The edited config does not validate.
    #[error(transparent)]
    Invalid(ConfigErrors),
    /// The device refused the operation (a resize, taking an image over).
    #[error("{0}")]
    Device(String),
    #[error(transparent)]
    Reload(#[from] ReloadError),
    #[error(transparent)]
    Save(#[from] SaveError),
    #[error("applied, but not saved: {0}")]
    NotSaved(SaveError),
}

impl From<crate::config::Invalid> for ControlError {
    fn from(invalid: crate::config::Invalid) -> ControlError {
        ControlError::BadRequest(invalid.0)
    }
}

impl ControlError {
    pub(crate) fn bad_request(e: impl std::fmt::Display) -> ControlError {
        ControlError::BadRequest(e.to_string())
    }

    /// The `kind` of `ctl`'s JSON error answer.
    pub fn kind(&self) -> &'static str {
        match self {
            ControlError::BadRequest(_) => "bad_request",
            ControlError::NotFound(_) => "not_found",
            ControlError::Conflict(_) => "conflict",
            ControlError::InUse(_) => "in_use",
            ControlError::Invalid(_) => "invalid_config",
            ControlError::Device(_) => "device",
            ControlError::Reload(e) => e.kind(),
            ControlError::Save(_) => "save_failed",
            ControlError::NotSaved(_) => "not_saved",
        }
    }
}

/// The control socket could not be had (a configured path: the start fails).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SocketError(pub String);

impl From<crate::admission::tokens::TokenError> for ControlError {
    fn from(e: crate::admission::tokens::TokenError) -> ControlError {
        use crate::admission::tokens::TokenError;
        match e {
            TokenError::BadRequest(m) => ControlError::BadRequest(m),
            TokenError::NotFound(m) => ControlError::NotFound(m),
            TokenError::Conflict(m) => ControlError::Conflict(m),
            e @ TokenError::Unreadable { .. } => ControlError::Conflict(e.to_string()),
        }
    }
}
