//! Why a device could not be opened, or a topology not be built from the devices opened.

/// A device that cannot be opened, or a topology that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The RBD cluster cannot be reached now (down, a timeout, no libraries). This may pass:
    /// a starting daemon serves without the device and retries it (`topology::left_out`).
    #[error("{located}: {what}: cluster unavailable: {reason}")]
    Unavailable {
        located: String,
        what: String,
        reason: String,
    },
    /// The device's medium cannot be opened or used as configured (a missing file or image,
    /// an alignment its block size cannot meet, damaged ownership records).
    #[error("{located}: {reason}")]
    Device { located: String, reason: String },
    /// What the config asks of the opened devices cannot be built (a LUN map, a peer group).
    #[error("{0}")]
    Config(String),
}

impl OpenError {
    /// The error's kind, as `ctl` reports it and the log line's `kind` field names it.
    pub fn kind(&self) -> &'static str {
        match self {
            OpenError::Unavailable { .. } => "unavailable",
            OpenError::Device { .. } => "device",
            OpenError::Config(_) => "config",
        }
    }

    /// A `Device` error of `located` (what `DeviceConfig::located` says of the device).
    pub(crate) fn device(located: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        OpenError::Device {
            located: located.into(),
            reason: reason.to_string(),
        }
    }
}
