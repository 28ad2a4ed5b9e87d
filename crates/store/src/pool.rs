//! Pools behind one interface (docs/VOLUMES.md): a directory of files ([`DirPool`]), a Ceph
//! pool of RBD images, or an LVM thin pool. Each makes, snapshots, clones, rolls back and
//! removes volumes by its own means (reflink, librbd, LVM's tools); the control plane asks
//! [`Pool`] and never which kind it has. What only the engine knows of a running volume —
//! holding its writes for a moment, whether hosts use it, the librbd image serving it — it
//! lends through [`Running`].
//!
//! Every failure is a [`PoolError`] of one [`PoolErrorKind`], which the control plane maps to
//! its answer (`conflict`, `not_found`, `device`) in one place.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clone::{CloneMethod, Progress};
use crate::dir_pool::{self, DirPool};
use crate::lvm::{self, LvmError, LvmErrorKind, ThinPool};
use crate::rbd::RbdSpec;

/// How long a removed RBD volume's image is retried while its store closes (librbd refuses to
/// remove an image a client still has open), and an LV while its device closes.
pub const REMOVE_WAIT: Duration = Duration::from_secs(30);

/// What a pool's failure means to the verb that asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolErrorKind {
    /// A name taken, an entry that is not what a pool's entry must be (a link, another's
    /// directory), something in use that must not be.
    Conflict,
    NotFound,
    /// What the pool cannot do (an RBD clone of no snapshot, adopting an image).
    Unsupported,
    /// The medium or its tool failed.
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolError {
    pub kind: PoolErrorKind,
    pub message: String,
}

impl std::fmt::Display for PoolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PoolError {}

impl PoolError {
    fn new(kind: PoolErrorKind, message: String) -> PoolError {
        PoolError { kind, message }
    }

    fn io(what: &str) -> impl FnOnce(io::Error) -> PoolError + '_ {
        move |e| {
            let kind = match e.kind() {
                io::ErrorKind::AlreadyExists | io::ErrorKind::InvalidInput => {
                    PoolErrorKind::Conflict
                }
                io::ErrorKind::NotFound => PoolErrorKind::NotFound,
                io::ErrorKind::Unsupported => PoolErrorKind::Unsupported,
                _ => PoolErrorKind::Failed,
            };
            PoolError::new(kind, format!("{what}: {e}"))
        }
    }

    fn rbd(what: &str) -> impl FnOnce(rbd::Error) -> PoolError + '_ {
        move |e| {
            let kind = match e.errno() {
                // EBUSY, EEXIST, ENOTEMPTY
                Some(16) | Some(17) | Some(39) => PoolErrorKind::Conflict,
                Some(2) => PoolErrorKind::NotFound,
                _ => PoolErrorKind::Failed,
            };
            PoolError::new(kind, format!("{what}: {e}"))
        }
    }

    /// An LVM tool's failure, sorted into the pool's kinds (the one table for LVM's errors).
    pub fn lvm(what: &str) -> impl FnOnce(LvmError) -> PoolError + '_ {
        move |e| {
            let kind = match e.kind {
                LvmErrorKind::Exists | LvmErrorKind::Busy => PoolErrorKind::Conflict,
                LvmErrorKind::NotFound => PoolErrorKind::NotFound,
                LvmErrorKind::Failed => PoolErrorKind::Failed,
            };
            PoolError::new(kind, format!("{what}: {e}"))
        }
    }
}

/// What the engine lends a pool of a running volume.
pub trait Running {
    /// Runs `f` with the volume's writes held: those in flight finished and flushed, new ones
    /// waiting until `f` returns (a crash-consistent moment).
    fn hold(
        &self,
        volume: &str,
        f: &mut dyn FnMut() -> io::Result<()>,
    ) -> Result<io::Result<()>, PoolError>;
    /// Whether hosts may write it now (mapped and online): a copy that takes as long as its
    /// data cannot hold its writes, so it is refused then.
    fn in_use(&self, volume: &str) -> bool;
    /// The librbd image the daemon serves the volume through.
    fn rbd_image(&self, volume: &str) -> Result<Arc<rbd::Image>, PoolError>;
    /// Told how far a long copy has come.
    fn progress(&self, what: &str) -> Box<dyn FnMut(u64, u64)>;
}

/// A pool: where its volumes are and by which means they are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pool {
    Dir(DirPool),
    /// Images of this Ceph pool (`image` empty: any volume's is the volume's name).
    Rbd(RbdSpec),
    Lvm(ThinPool),
}

/// What a pool can hold and has left, as its medium counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// A directory's filesystem; a thin pool's data LV; for Ceph, what the pool stores plus
    /// what it can still take.
    pub total_bytes: u64,
    /// What new writes can still take: a thin pool's volumes together may promise more.
    pub available_bytes: u64,
}

/// What a verb made for a volume not yet committed: removed again when the commit does not
/// happen, and only that (a directory pool's file by its inode; an image or LV this verb's own
/// create or clone call made, which fails on one that is there).
#[must_use = "made for a verb: kept, or forgotten when the verb fails"]
pub enum Made {
    File(dir_pool::Made),
    Image(RbdSpec),
    Lv(ThinPool, String),
    /// Nothing made: an adopted file.
    Adopted,
}

impl Made {
    /// The verb committed it to the config: kept for good (a directory pool's file loses its
    /// intent, `dir_pool::Made::committed`).
    pub fn committed(self) {
        if let Made::File(made) = self {
            made.committed();
        }
    }

    /// Removes what was made; a failure is logged (the verb reports its own error).
    pub fn forget(self) {
        let outcome = match self {
            Made::File(made) => made.forget().map(drop).map_err(|e| e.to_string()),
            Made::Image(spec) => crate::rbd::pool(&spec)
                .map_err(|e| e.to_string())
                .and_then(|p| p.remove(&spec.image).map_err(|e| e.to_string())),
            Made::Lv(thin, name) => thin.remove(&name, REMOVE_WAIT).map_err(|e| e.to_string()),
            Made::Adopted => Ok(()),
        };
        if let Err(e) = outcome {
            tracing::warn!("a volume made for a verb that failed could not be removed: {e}");
        }
    }
}

impl Pool {
    /// The RBD spec of volume `name` (its image of the same name).
    fn image(spec: &RbdSpec, name: &str) -> RbdSpec {
        RbdSpec {
            image: name.to_string(),
            ..spec.clone()
        }
    }

    /// What the pool holds and has left (a directory's `statvfs`, `lvs`' data percentage of
    /// the thin pool, the monitors' `df`).
    pub fn capacity(&self) -> Result<Capacity, PoolError> {
        let (total_bytes, available_bytes) = match self {
            Pool::Dir(dir) => dir.usage().map_err(PoolError::io("the pool's directory"))?,
            Pool::Lvm(thin) => {
                let (size, used) = thin.data_usage().map_err(PoolError::lvm("the pool"))?;
                (size, size - used)
            }
            Pool::Rbd(spec) => {
                let (stored, free) =
                    crate::rbd::pool_usage(spec).map_err(PoolError::io("the pool"))?;
                (stored.saturating_add(free), free)
            }
        };
        debug_assert!(available_bytes <= total_bytes);
        Ok(Capacity {
            total_bytes,
            available_bytes,
        })
    }

    /// The size a volume of `size` bytes gets (LVM: whole extents).
    pub fn rounded(&self, size: u64) -> Result<u64, PoolError> {
        match self {
            Pool::Lvm(thin) => thin.rounded(size).map_err(PoolError::lvm("the pool")),
            Pool::Dir(_) | Pool::Rbd(_) => Ok(size),
        }
    }

    /// Makes volume `name` of `size` bytes: a new file (exclusively; the one there only when
    /// `adopt`), an RBD image or a thin LV (whose tools refuse one that is there).
    pub fn create(&self, name: &str, size: u64, adopt: bool) -> Result<Made, PoolError> {
        let what = format!("volume {name}");
        match (self, adopt) {
            (Pool::Dir(dir), _) => {
                let at = format!("the pool's directory {}", dir.dir().display());
                dir.make_dir().map_err(PoolError::io(&at))?;
                if adopt {
                    dir.open_volume(name, true).map_err(PoolError::io(&what))?;
                    return Ok(Made::Adopted);
                }
                dir.create_volume(name, size)
                    .map(Made::File)
                    .map_err(PoolError::io(&what))
            }
            (_, true) => Err(PoolError::new(
                PoolErrorKind::Unsupported,
                "only a directory pool's file is adopted; RBD images and LVs are not".into(),
            )),
            (Pool::Rbd(spec), false) => {
                crate::rbd::pool(spec)
                    .map_err(PoolError::io("the pool"))?
                    .create(name, size)
                    .map_err(PoolError::rbd(&what))?;
                Ok(Made::Image(Pool::image(spec, name)))
            }
            (Pool::Lvm(thin), false) => {
                thin.create(name, size).map_err(PoolError::lvm(&what))?;
                Ok(Made::Lv(thin.clone(), name.to_string()))
            }
        }
    }

    /// The pool's snapshots (of `volume` only, when given): (volume, snapshot), sorted.
    pub fn snapshots(
        &self,
        running: &dyn Running,
        volume: Option<&str>,
    ) -> Result<Vec<(String, String)>, PoolError> {
        let mut out = match self {
            Pool::Dir(dir) => dir.snapshots(volume).map_err(PoolError::io("the pool"))?,
            Pool::Rbd(_) => {
                let Some(volume) = volume else {
                    return Err(PoolError::new(
                        PoolErrorKind::Unsupported,
                        "an RBD pool lists the snapshots of one volume at a time".into(),
                    ));
                };
                let image = running.rbd_image(volume)?;
                let names = image.snapshots().map_err(PoolError::rbd(volume))?;
                names
                    .into_iter()
                    .map(|(s, _)| (volume.to_string(), s))
                    .collect()
            }
            Pool::Lvm(thin) => {
                let lvs = thin.thin_lvs().map_err(PoolError::lvm("the pool"))?;
                lvs.iter()
                    .filter_map(|lv| lv.snapshot_of())
                    .filter(|(v, _)| volume.is_none_or(|o| o == *v))
                    .map(|(v, s)| (v.to_string(), s.to_string()))
                    .collect()
            }
        };
        out.sort();
        Ok(out)
    }

    /// Whether volume `volume` has snapshot `snap`.
    pub fn has_snapshot(
        &self,
        running: &dyn Running,
        volume: &str,
        snap: &str,
    ) -> Result<bool, PoolError> {
        let list = self.snapshots(running, Some(volume))?;
        Ok(list.iter().any(|(_, s)| s == snap))
    }

    /// When snapshot `snap` of `volume` was taken, where the pool keeps it (a directory
    /// pool's file time; librbd and LVM's are not read yet).
    pub fn snapshot_time(&self, volume: &str, snap: &str) -> Option<std::time::SystemTime> {
        match self {
            Pool::Dir(dir) => dir.snapshot_time(volume, snap).ok(),
            Pool::Rbd(_) | Pool::Lvm(_) => None,
        }
    }

    /// Takes snapshot `snap` of `volume`, crash-consistent: its writes held for the moment.
    pub fn snapshot(
        &self,
        running: &dyn Running,
        volume: &str,
        snap: &str,
    ) -> Result<&'static str, PoolError> {
        let what = format!("snapshot {volume}@{snap}");
        match self {
            Pool::Dir(dir) => {
                let from = dir
                    .open_volume(volume, false)
                    .map_err(PoolError::io(&what))?;
                let (to, partial) = dir
                    .begin_snapshot(volume, snap)
                    .map_err(PoolError::io(&what))?;
                let method = match live_copy(running, volume, &from, &to) {
                    Ok(method) => method,
                    Err(e) => {
                        let _ = partial.forget();
                        return Err(e);
                    }
                };
                let name = DirPool::snapshot_file(volume, snap);
                drop(dir.publish(partial, &name).map_err(PoolError::io(&what))?);
                Ok(method.name())
            }
            Pool::Rbd(_) => {
                let image = running.rbd_image(volume)?;
                held(running, volume, &mut || io_of(image.snap_create(snap)))
                    .map_err(PoolError::io(&what))?;
                Ok("rbd")
            }
            Pool::Lvm(thin) => {
                let lv = lvm::snapshot_lv(volume, snap);
                // LVM suspends the origin for the moment of the snapshot, flushing what
                // reached it; the held writes are those not acknowledged yet.
                let mut made = Ok(());
                held(running, volume, &mut || {
                    made = thin.snapshot(volume, &lv, false);
                    Ok(())
                })
                .map_err(PoolError::io(&what))?;
                made.map_err(PoolError::lvm(&what))?;
                Ok("lvm thin snapshot")
            }
        }
    }

    /// Makes volume `name` a copy of `source` (of its snapshot `snap`, or of it as it is now):
    /// how, and what it made. An RBD pool clones snapshots only: the caller takes one of the
    /// volume as it is now first ([`Pool::snapshot`]).
    pub fn clone_volume(
        &self,
        running: &dyn Running,
        source: &str,
        snap: Option<&str>,
        name: &str,
    ) -> Result<(&'static str, Made), PoolError> {
        let what = format!("clone {name} of {source}");
        match self {
            Pool::Dir(dir) => {
                let (method, made) = clone_file(running, dir, source, snap, name)?;
                Ok((method.name(), Made::File(made)))
            }
            Pool::Lvm(thin) => {
                let made = match snap {
                    // A thin snapshot of the snapshot, active: a volume of its own.
                    Some(snap) => thin.snapshot(&lvm::snapshot_lv(source, snap), name, true),
                    None => {
                        let mut made = Ok(());
                        held(running, source, &mut || {
                            made = thin.snapshot(source, name, true);
                            Ok(())
                        })
                        .map_err(PoolError::io(&what))?;
                        made
                    }
                };
                made.map_err(PoolError::lvm(&what))?;
                Ok((
                    "lvm thin snapshot",
                    Made::Lv(thin.clone(), name.to_string()),
                ))
            }
            Pool::Rbd(spec) => {
                let Some(snap) = snap else {
                    return Err(PoolError::new(
                        PoolErrorKind::Unsupported,
                        format!("an RBD volume is cloned from a snapshot: clone {source}@SNAPSHOT"),
                    ));
                };
                let image = running.rbd_image(source)?;
                // A format-1 clone needs its parent snapshot protected; already protected is
                // fine.
                match image.snap_protect(snap) {
                    Err(e) if e.errno() != Some(16) => {
                        return Err(PoolError::rbd(&format!("protecting {source}@{snap}"))(e))
                    }
                    _ => {}
                }
                let rados = crate::rbd::pool(spec).map_err(PoolError::io("the pool"))?;
                rados
                    .clone_image(&rados, source, snap, name)
                    .map_err(PoolError::rbd(&what))?;
                Ok(("rbd clone", Made::Image(Pool::image(spec, name))))
            }
        }
    }

    /// Removes snapshot `snap` that an RBD clone of `volume` as it was was made from, after
    /// the clone failed.
    pub fn drop_clone_snapshot(&self, running: &dyn Running, volume: &str, snap: &str) {
        if let (Pool::Rbd(_), Ok(image)) = (self, running.rbd_image(volume)) {
            let _ = image.snap_unprotect(snap);
            let _ = image.snap_remove(snap);
        }
    }

    /// Puts snapshot `snap`'s blocks back into `volume` (unused by hosts: the caller checks),
    /// its writes held. An LVM pool replaces the volume's LV instead, which closes its device:
    /// `Unsupported` here, the caller swaps the LVs.
    pub fn rollback(
        &self,
        running: &dyn Running,
        volume: &str,
        snap: &str,
    ) -> Result<&'static str, PoolError> {
        let what = format!("rollback of {volume} to {snap}");
        match self {
            Pool::Dir(dir) => {
                let mut method = None;
                held(running, volume, &mut || {
                    let progress = &mut running.progress(&what);
                    method = Some(dir.restore(volume, snap, progress)?);
                    Ok(())
                })
                .map_err(PoolError::io(&what))?;
                Ok(method.map_or("copy", CloneMethod::name))
            }
            Pool::Rbd(_) => {
                let image = running.rbd_image(volume)?;
                held(running, volume, &mut || io_of(image.snap_rollback(snap)))
                    .map_err(PoolError::io(&what))?;
                Ok("rbd")
            }
            Pool::Lvm(_) => Err(PoolError::new(
                PoolErrorKind::Unsupported,
                "an LVM volume rolls back by replacing its LV".into(),
            )),
        }
    }

    /// Makes an RBD clone independent of its parent snapshot (true when it was a clone); other
    /// pools' clones depend on nothing (false).
    pub fn flatten(&self, name: &str) -> Result<bool, PoolError> {
        let Pool::Rbd(spec) = self else {
            return Ok(false);
        };
        let image =
            crate::rbd::maintenance_image(&Pool::image(spec, name)).map_err(PoolError::io(name))?;
        match image.flatten() {
            // Not a clone (any more): nothing depends on a parent.
            Err(e) if e.errno() == Some(22) => Ok(false),
            Err(e) => Err(PoolError::rbd(name)(e)),
            Ok(()) => Ok(true),
        }
    }

    /// Removes volume `name`'s medium (its device gone from the config): false when it was
    /// gone already. The store closes with its last command; an image or LV still open is
    /// retried for [`REMOVE_WAIT`].
    pub fn remove(&self, name: &str) -> Result<bool, PoolError> {
        let what = format!("volume {name}");
        match self {
            Pool::Dir(dir) => dir.remove_volume(name).map_err(PoolError::io(&what)),
            Pool::Rbd(spec) => remove_image(&Pool::image(spec, name)),
            Pool::Lvm(thin) => match thin.remove(name, REMOVE_WAIT) {
                Err(e) if e.kind == LvmErrorKind::NotFound => Ok(false),
                other => other.map(|()| true).map_err(PoolError::lvm(&what)),
            },
        }
    }

    /// Removes snapshot `snap` of `volume` (the volume may be gone): false when it was gone
    /// already. An RBD snapshot with dependent clones is a conflict.
    pub fn remove_snapshot(&self, volume: &str, snap: &str) -> Result<bool, PoolError> {
        let what = format!("snapshot {volume}@{snap}");
        match self {
            Pool::Dir(dir) => dir
                .remove_snapshot(volume, snap)
                .map_err(PoolError::io(&what)),
            // A thin snapshot's clones share its blocks, not its life: nothing depends on it.
            Pool::Lvm(thin) => match thin.remove(&lvm::snapshot_lv(volume, snap), Duration::ZERO) {
                Err(e) if e.kind == LvmErrorKind::NotFound => Ok(false),
                other => other.map(|()| true).map_err(PoolError::lvm(&what)),
            },
            Pool::Rbd(spec) => remove_rbd_snapshot(&Pool::image(spec, volume), snap),
        }
    }
}

fn io_of(r: Result<(), rbd::Error>) -> io::Result<()> {
    r.map_err(|e| match e.errno() {
        Some(errno) => io::Error::from_raw_os_error(errno),
        None => io::Error::other(e.to_string()),
    })
}

/// `f` with `volume`'s writes held, its error and the hold's as one.
fn held(
    running: &dyn Running,
    volume: &str,
    f: &mut dyn FnMut() -> io::Result<()>,
) -> io::Result<()> {
    match running.hold(volume, f) {
        Ok(result) => result,
        Err(e) => Err(io::Error::other(e.message)),
    }
}

/// Copies volume `name`'s file `from` into the new file `to` as it is at one moment: a
/// reflink while its writes are held (milliseconds). Where the filesystem cannot share
/// extents the copy takes as long as the data does, too long to hold the writes of a volume
/// in use: then it must be unmapped or offline, or the copy is refused — asked before the
/// copy and again after it, so a volume mapped (or brought online) meanwhile, whose writes
/// may have torn the copy, gives no copy.
fn live_copy(
    running: &dyn Running,
    name: &str,
    from: &std::fs::File,
    to: &std::fs::File,
) -> Result<CloneMethod, PoolError> {
    let what = format!("copy of volume {name}");
    let mut reflinked = false;
    held(running, name, &mut || {
        reflinked = crate::clone::reflink(from, to)?;
        Ok(())
    })
    .map_err(PoolError::io(&what))?;
    if reflinked {
        return Ok(CloneMethod::Reflink);
    }
    if running.in_use(name) {
        return Err(PoolError::new(
            PoolErrorKind::Conflict,
            format!(
                "volume {name} is in use and its pool's filesystem cannot reflink: the copy \
                 would hold its writes for as long as copying its data takes; take it offline \
                 (ctl device offline) or unmap it first, or put the pool on XFS or btrfs"
            ),
        ));
    }
    let progress: Progress<'_> = &mut running.progress(&what);
    let method = crate::clone::clone_into(from, to, progress).map_err(PoolError::io(&what))?;
    if running.in_use(name) {
        return Err(PoolError::new(
            PoolErrorKind::Conflict,
            format!("volume {name} was mapped or brought online while it was copied: no copy"),
        ));
    }
    to.sync_all().map_err(PoolError::io(&what))?;
    Ok(method)
}

/// A directory pool's clone: copied into a partial file, published as volume `name` once
/// complete and durable (never over a file that is there).
fn clone_file(
    running: &dyn Running,
    dir: &DirPool,
    source: &str,
    snap: Option<&str>,
    name: &str,
) -> Result<(CloneMethod, dir_pool::Made), PoolError> {
    let what = format!("clone {name} of {source}");
    let (to, partial) = dir.begin_volume(name).map_err(PoolError::io(&what))?;
    let copied = match snap {
        Some(snap) => dir
            .open_snapshot(source, snap)
            .and_then(|from| {
                let progress = &mut running.progress(&format!("{what}@{snap}"));
                let method = crate::clone::clone_into(&from, &to, progress)?;
                to.sync_all().map(|()| method)
            })
            .map_err(PoolError::io(&what)),
        None => dir
            .open_volume(source, false)
            .map_err(PoolError::io(&what))
            .and_then(|from| live_copy(running, source, &from, &to)),
    };
    let method = match copied {
        Ok(method) => method,
        Err(e) => {
            let _ = partial.forget();
            return Err(e);
        }
    };
    let made = dir
        .publish_volume(partial, name)
        .map_err(PoolError::io(&what))?;
    Ok((method, made))
}

/// Removes an RBD image once the store of the device that was it has closed (librbd refuses
/// while a client has it open). False when it was gone.
fn remove_image(spec: &RbdSpec) -> Result<bool, PoolError> {
    let what = format!("image {}/{}", spec.pool, spec.image);
    let pool = crate::rbd::pool(spec).map_err(PoolError::io(&what))?;
    let started = Instant::now();
    loop {
        match pool.remove(&spec.image) {
            Ok(()) => return Ok(true),
            Err(e) if e.errno() == Some(2) => return Ok(false),
            Err(e) if e.errno() == Some(16) && started.elapsed() < REMOVE_WAIT => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(PoolError::rbd(&what)(e)),
        }
    }
}

/// Removes RBD snapshot `snap` of `spec`'s image: protected for a clone, EBUSY while clones
/// depend on it (a conflict: they would lose their parent), EINVAL when it never was.
fn remove_rbd_snapshot(spec: &RbdSpec, snap: &str) -> Result<bool, PoolError> {
    let what = format!("snapshot {}@{snap}", spec.image);
    let image = match crate::rbd::maintenance_image(spec) {
        Ok(image) => image,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(PoolError::io(&what)(e)),
    };
    let exists = image
        .snapshots()
        .map_err(PoolError::rbd(&what))?
        .iter()
        .any(|(s, _)| s == snap);
    if !exists {
        return Ok(false);
    }
    match image.snap_unprotect(snap) {
        Err(e) if e.errno() == Some(16) => {
            return Err(PoolError::new(
                PoolErrorKind::Conflict,
                format!("{what} has dependent clones: delete (or flatten) them first"),
            ))
        }
        Err(e) if e.errno() != Some(22) => return Err(PoolError::rbd(&what)(e)),
        _ => {}
    }
    image.snap_remove(snap).map_err(PoolError::rbd(&what))?;
    Ok(true)
}
