//! The kinds of store a device can have, and everything about a device that depends on its
//! kind outside opening it (which is `topology::open_unit`'s): what it is called, where its
//! medium is, who sets its size, whether its reservations live in a file. A new store kind is
//! a variant here, a branch there, and the store itself (`crates/store`).

use std::path::{Path, PathBuf};

use super::Invalid;

/// Where a device's blocks live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    Ram {
        size_bytes: u64,
    },
    /// `size_bytes`: create the file sparse with this size when missing (or check it).
    File {
        path: PathBuf,
        size_bytes: Option<u64>,
    },
    Block {
        path: PathBuf,
    },
    /// A Ceph RBD image, `pool/image`, reached through librbd.
    Rbd(store::RbdSpec),
}

impl StoreKind {
    /// The kind's name in the config (`store = "..."`), `ctl luns` and the metrics.
    pub fn name(&self) -> &'static str {
        match self {
            StoreKind::Ram { .. } => "ram",
            StoreKind::File { .. } => "file",
            StoreKind::Block { .. } => "block",
            StoreKind::Rbd(_) => "rbd",
        }
    }

    /// INQUIRY's product identification (16 bytes at most).
    pub fn product(&self) -> &'static str {
        match self {
            StoreKind::Ram { .. } => "RAM DISK",
            StoreKind::File { .. } => "FILE DISK",
            StoreKind::Block { .. } => "BLOCK DISK",
            StoreKind::Rbd(_) => "RBD DISK",
        }
    }

    /// The medium as an operator names it: a path, or `POOL/IMAGE`; none for RAM.
    pub fn medium(&self) -> Option<String> {
        match self {
            StoreKind::Ram { .. } => None,
            StoreKind::File { path, .. } | StoreKind::Block { path } => {
                Some(path.display().to_string())
            }
            StoreKind::Rbd(spec) => Some(format!("{}/{}", spec.pool, spec.image)),
        }
    }

    /// The file or block device, for the kinds that have one. Their persistent reservations
    /// live in a state file named after it; a RAM LU's medium does not survive a restart, nor
    /// do its reservations, and an RBD image keeps them in the image.
    pub fn path(&self) -> Option<&Path> {
        match self {
            StoreKind::File { path, .. } | StoreKind::Block { path } => Some(path),
            StoreKind::Ram { .. } | StoreKind::Rbd(_) => None,
        }
    }

    /// The RBD image, for an RBD device.
    pub fn rbd(&self) -> Option<&store::RbdSpec> {
        match self {
            StoreKind::Rbd(spec) => Some(spec),
            _ => None,
        }
    }

    /// Whether the device's size is its medium's own (a block device, an RBD image): it grows
    /// underneath, and the LU takes its new size; the config records none.
    pub fn sized_by_medium(&self) -> bool {
        matches!(self, StoreKind::Block { .. } | StoreKind::Rbd(_))
    }

    /// Sets the size the config records (a file's, a RAM device's); the kinds sized by their
    /// medium refuse, saying how to grow them.
    pub fn set_size(&mut self, size: u64) -> Result<(), &'static str> {
        match self {
            StoreKind::File { size_bytes, .. } => *size_bytes = Some(size),
            StoreKind::Ram { size_bytes } => *size_bytes = size,
            StoreKind::Block { .. } => {
                return Err(
                    "is a block device: grow the device itself, then resize it without \
                            a size to take the device's size",
                )
            }
            StoreKind::Rbd(_) => {
                return Err(
                    "is an RBD image: grow it with `rbd resize`, then resize it without \
                            a size to take the image's size",
                )
            }
        }
        Ok(())
    }

    /// How a running device's store may change into `now`: `Ok(Some(bytes))` to grow it to,
    /// `Ok(None)` for nothing to do on the store. A RAM device keeps its size, a file may only
    /// grow, and no kind changes its medium while it runs.
    pub fn resized_to(&self, now: &StoreKind) -> Result<Option<u64>, Invalid> {
        match (self, now) {
            (StoreKind::Ram { size_bytes: a }, StoreKind::Ram { size_bytes: b }) if a != b => {
                Err("a RAM device cannot be resized while it runs".into())
            }
            (
                StoreKind::File {
                    path: p,
                    size_bytes: a,
                },
                StoreKind::File {
                    path: q,
                    size_bytes: b,
                },
            ) if p == q => match (a, b) {
                (Some(a), Some(b)) if b < a => Err(Invalid(format!(
                    "size {b} is smaller than the running {a}: shrinking a LUN would cut off data \
                     its initiators may hold"
                ))),
                (Some(a), Some(b)) if a == b => Ok(None),
                // Growing, or a size for a device that had none: the store checks it against
                // the file (it never shrinks).
                (_, Some(b)) => Ok(Some(*b)),
                // No size: the file keeps the size it has.
                (_, None) => Ok(None),
            },
            (a, b) if a == b => Ok(None),
            _ => Err(
                "its store kind or path changed: remove it in one reload and add it back in the \
                 next"
                    .into(),
            ),
        }
    }
}
