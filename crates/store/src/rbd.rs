//! Ceph RBD store: an image in a cluster, through librbd (the `rbd` crate, loaded at run time).
//!
//! Reads, writes and flushes are asynchronous ([`BlockStore::submit`]): librbd completes them
//! on its own threads and the engine's worker gets the completion. Everything else (UNMAP,
//! WRITE SAME, COMPARE AND WRITE, GET LBA STATUS, resize) runs synchronously on the engine's
//! I/O threads, each an asynchronous librbd call waited for there.
//!
//! Durability: librbd's client-side cache is turned off for ferrosan's connections
//! (`rbd_cache = false`), so librbd completes a write only once the OSDs have it. With the
//! LU's write cache on (WCE=1) a write without FUA may be answered as soon as librbd has it
//! (write-back, as librbd's own write-around cache does), with ferrosan keeping the account
//! ([`crate::early_ack`]): bounded, nothing overtakes such a write, SYNCHRONIZE CACHE (an
//! `rbd_aio_flush` after the writes answered before it) reports one that failed. librbd's
//! cache is not used for that because it reports such a failure only to a flush already
//! waiting when it happens. Never on a gateway's image (a dedicated connection): a gateway
//! that dies or is fenced must not take answered writes with it. Discards are written as zeroes (`rbd_aio_write_zeroes`):
//! librbd skips plain discards smaller than its discard granularity, which would leave old
//! data readable after an UNMAP; write-zeroes releases whole objects and zeroes the rest, so
//! deallocated blocks always read as zeros (LBPRZ).

use crate::early_ack::EarlyAcks;
use crate::{AsyncDone, AsyncIo, BlockStore, Capabilities, Extent};
use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

/// Where an image is and how to reach its cluster.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    /// ceph.conf; None: librados's default search (`$CEPH_CONF`, /etc/ceph/ceph.conf).
    pub conf: Option<PathBuf>,
    /// The cephx client name (`client.iscsi`); None: `client.admin`.
    pub client: Option<String>,
}

/// How far [`BlockStore::mapping`] looks ahead in one call (one librbd diff walk).
const MAPPING_WINDOW_BYTES: u64 = 256 << 20;

/// How long a close waits for the operations that still hold the image (each bounded by the
/// client's operation timeout, which a lost cluster makes them wait for).
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// One cluster connection per (config, client, role) shared by every image that names it, as
/// a gateway serving many images keeps one session with the monitors. `observer`: a second
/// connection for watching images (who owns them), which stays usable when the data
/// connection is blocklisted by a gateway that took an image over.
fn cluster(spec: &RbdSpec, observer: bool) -> Result<Arc<rbd::Cluster>, rbd::Error> {
    type Key = (Option<PathBuf>, Option<String>, bool);
    static CLUSTERS: Mutex<Option<HashMap<Key, Weak<rbd::Cluster>>>> = Mutex::new(None);
    let key = (spec.conf.clone(), spec.client.clone(), observer);
    let mut clusters = CLUSTERS.lock().unwrap_or_else(|p| p.into_inner());
    let map = clusters.get_or_insert_with(HashMap::new);
    if let Some(cluster) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(cluster);
    }
    let cluster = connect(spec)?;
    map.retain(|_, weak| weak.strong_count() > 0);
    map.insert(key, Arc::downgrade(&cluster));
    Ok(cluster)
}

/// A connection for managing images (`ctl volume` on an RBD pool: create, clone, remove,
/// unprotect), made per request with librados's own thread count. The data connections run
/// one librados thread on a small machine (`librados_threads`), and under that librbd was
/// measured (Ceph 16) to wait forever unprotecting a snapshot that has clones, where a client
/// with Ceph's default answered EBUSY at once: management never shares their threads.
fn maintenance(spec: &RbdSpec) -> io::Result<Arc<rbd::Cluster>> {
    let options = rbd::ClusterOptions {
        conf: spec.conf.clone(),
        client: spec.client.clone(),
        settings: vec![("rbd_cache".into(), "false".into())],
        defaults: Vec::new(),
    };
    rbd::Cluster::connect(&options).map_err(io_error)
}

/// The pool `spec` names, on a management connection (see `maintenance`).
pub fn pool(spec: &RbdSpec) -> io::Result<rbd::Pool> {
    rbd::Pool::open(&maintenance(spec)?, &spec.pool).map_err(io_error)
}

/// What Ceph says of pool `spec.pool`: (bytes stored, bytes it can still take), from the
/// monitors' `df detail` (see [`df_usage`]).
pub fn pool_usage(spec: &RbdSpec) -> io::Result<(u64, u64)> {
    let pool = pool(spec)?;
    usage_through(pool.cluster(), &spec.pool)
}

/// Pool `name`'s (stored, bytes it can still take), asked of the monitors through `cluster`.
fn usage_through(cluster: &rbd::Cluster, name: &str) -> io::Result<(u64, u64)> {
    let answer = cluster.mon_command(DF_DETAIL).map_err(io_error)?;
    df_usage(&answer, name).ok_or_else(|| {
        let why = format!("the monitors' df gives no usage of pool {name:?}");
        io::Error::new(io::ErrorKind::InvalidData, why)
    })
}

/// How long a pool's `df` answers every device of that pool: the space watch asks every few
/// seconds per device, and a gateway with hundreds of images in one pool asks the monitors
/// once per interval instead of once per image.
const POOL_USAGE_FRESH: std::time::Duration = std::time::Duration::from_secs(4);

/// Pool `spec.pool`'s (stored, bytes it can still take) through `cluster`, or a recent answer
/// for the same pool of the same cluster and user.
fn pool_usage_on(cluster: &rbd::Cluster, spec: &RbdSpec) -> io::Result<(u64, u64)> {
    type Key = (Option<PathBuf>, Option<String>, String);
    type Seen = HashMap<Key, (std::time::Instant, (u64, u64))>;
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let key = (spec.conf.clone(), spec.client.clone(), spec.pool.clone());
    let fresh = |seen: &Seen| {
        seen.get(&key)
            .filter(|(at, _)| at.elapsed() < POOL_USAGE_FRESH)
            .map(|(_, usage)| *usage)
    };
    if let Some(usage) = SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .and_then(fresh)
    {
        return Ok(usage);
    }
    let usage = usage_through(cluster, &spec.pool)?;
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let seen = seen.get_or_insert_with(HashMap::new);
    seen.retain(|_, (at, _)| at.elapsed() < POOL_USAGE_FRESH);
    seen.insert(key, (std::time::Instant::now(), usage));
    Ok(usage)
}

/// `ceph df detail`: with each pool's quota, which `max_avail` does not count (Ceph 16).
const DF_DETAIL: &str = r#"{"prefix": "df", "detail": "detail", "format": "json"}"#;

/// Pool `name`'s (stored, bytes it can still take) in the monitors' `df detail` answer: its
/// `max_avail`, or what is left of its `quota_bytes` when that is less.
fn df_usage(answer: &str, name: &str) -> Option<(u64, u64)> {
    let df: serde_json::Value = serde_json::from_str(answer).ok()?;
    let pool = df["pools"].as_array()?.iter().find(|p| p["name"] == name)?;
    let stats = &pool["stats"];
    let (stored, max_avail) = (stats["stored"].as_u64()?, stats["max_avail"].as_u64()?);
    let available = match stats["quota_bytes"].as_u64() {
        Some(quota) if quota > 0 => max_avail.min(quota.saturating_sub(stored)),
        _ => max_avail,
    };
    Some((stored, available))
}

/// Image `spec` opened on a management connection (see `maintenance`), for snapshot
/// maintenance the handle serving I/O should not run.
pub fn maintenance_image(spec: &RbdSpec) -> io::Result<rbd::Image> {
    rbd::Image::open(&maintenance(spec)?, &spec.pool, &spec.image).map_err(io_error)
}

/// A cluster connection of its own (see [`RbdStore::open_dedicated`]).
fn connect(spec: &RbdSpec) -> Result<Arc<rbd::Cluster>, rbd::Error> {
    let options = rbd::ClusterOptions {
        conf: spec.conf.clone(),
        client: spec.client.clone(),
        settings: vec![("rbd_cache".into(), "false".into())],
        defaults: librados_threads(cores())
            .map(|n| ("librados_thread_count".to_string(), n.to_string()))
            .into_iter()
            .collect(),
    };
    rbd::Cluster::connect(&options)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// librados's I/O threads (`librados_thread_count`, Ceph's default 2) for a gateway with
/// `cores` CPUs, where ceph.conf does not choose: every librbd completion passes through one
/// of them, and on a small machine two of them only take turns waking each other up beside
/// ferrosan's workers and the messenger. Measured on 2 cores, 4 KiB random reads at QD32
/// (docs/RBD.md): one thread cut the gateway's CPU per read from ~40 to ~30 us and lost
/// nothing on 1 MiB transfers. From 8 cores on, Ceph's own default stays (not measured here).
pub fn librados_threads(cores: usize) -> Option<u32> {
    (cores < 8).then_some(1)
}

/// An `io::Error` from a librbd failure, keeping its errno (ETIMEDOUT, ESHUTDOWN for a
/// blocklisted client, ...) so the SCSI layer can tell a lost cluster from a failed medium.
pub fn io_error(e: rbd::Error) -> io::Error {
    match e.errno() {
        Some(errno) => {
            let kind = io::Error::from_raw_os_error(errno).kind();
            // Keep the errno reachable: the message names it, the kind classifies it.
            io::Error::new(
                kind,
                RbdError {
                    errno,
                    message: e.to_string(),
                },
            )
        }
        None => io::Error::other(e.to_string()),
    }
}

/// A librbd failure inside an `io::Error` (see [`errno_of`]).
#[derive(Debug)]
struct RbdError {
    errno: i32,
    message: String,
}

impl std::fmt::Display for RbdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RbdError {}

/// The errno behind an I/O error: the OS's own, or a librbd failure's.
pub fn errno_of(e: &io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<RbdError>())
            .map(|r| r.errno)
    })
}

/// The error of an I/O on an image: [`io_error`], except that on a gateway's image (a
/// `dedicated` connection) EROFS is reported as ESHUTDOWN. librbd answers a write with EROFS
/// when another client holds the image's exclusive lock and this one may not take it back
/// (`rbd_lock_acquire`'s manual mode): another gateway took the image over. Like a fenced
/// client's, the write did not happen and may succeed through the owner, so the SCSI layer
/// answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION (the host retries, as after a fence)
/// rather than a medium error. On an image of one gateway EROFS stays what it is.
fn image_io_error(e: rbd::Error, dedicated: bool) -> io::Error {
    const EROFS: i32 = 30;
    const ESHUTDOWN: i32 = 108;
    match e {
        rbd::Error::Ceph { what, errno: EROFS } if dedicated => io::Error::new(
            io::ErrorKind::NotConnected,
            RbdError {
                errno: ESHUTDOWN,
                message: format!("{what}: another gateway holds the image's lock (EROFS)"),
            },
        ),
        e => io_error(e),
    }
}

pub struct RbdStore {
    /// Replaced whole by [`RbdStore::reconnect`], taken by [`BlockStore::close`]; I/O holds
    /// the read lock only to submit.
    image: RwLock<Option<Arc<rbd::Image>>>,
    /// The image has a cluster connection of its own (it can be fenced and reconnected
    /// without touching other images).
    dedicated: bool,
    spec: RbdSpec,
    /// The size the LU serves (the image may have grown since: [`BlockStore::medium_bytes`]).
    size_bytes: AtomicU64,
    /// Where every asynchronous completion goes: its tag is the caller's `done`, called on
    /// the librbd thread that completed it.
    sink: rbd::Sink<AsyncDone>,
    /// Writes answered before librbd completed them (write-back); None on a dedicated
    /// connection (a gateway's image), which always writes through.
    early: Option<Arc<EarlyAcks>>,
    /// `POOL/IMAGE`, for messages from librbd's threads.
    label: Arc<str>,
}

impl RbdStore {
    /// Connects (or shares the connection) and opens `pool/image`; ENOENT names which is
    /// missing.
    pub fn open(spec: &RbdSpec) -> io::Result<RbdStore> {
        let cluster = cluster(spec, false).map_err(io_error)?;
        Self::open_on(spec, &cluster, false)
    }

    /// Like [`RbdStore::open`], on a cluster connection of its own: blocklisting this client
    /// (a gateway fenced for this image) touches no other image, and
    /// [`RbdStore::reconnect`] can replace it (LIO's tcmu-runner keeps one per image for the
    /// same reason). Costs a connection's threads per image.
    pub fn open_dedicated(spec: &RbdSpec) -> io::Result<RbdStore> {
        let cluster = connect(spec).map_err(io_error)?;
        Self::open_on(spec, &cluster, true)
    }

    fn open_on(
        spec: &RbdSpec,
        cluster: &Arc<rbd::Cluster>,
        dedicated: bool,
    ) -> io::Result<RbdStore> {
        let image = rbd::Image::open(cluster, &spec.pool, &spec.image).map_err(io_error)?;
        let size = image.size().map_err(io_error)?;
        Ok(RbdStore {
            image: RwLock::new(Some(Arc::new(image))),
            dedicated,
            spec: spec.clone(),
            size_bytes: AtomicU64::new(size),
            sink: Arc::new(move |f: rbd::Finished<AsyncDone>| {
                // librbd reports what it moved: a read or write of fewer bytes than the
                // buffer holds failed, whatever its return code says.
                let result = match f.result {
                    Ok(n) if n == f.buf.len() => Ok(()),
                    Ok(n) => Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("librbd moved {n} of {} bytes", f.buf.len()),
                    )),
                    Err(e) => Err(image_io_error(e, dedicated)),
                };
                (f.tag)(f.buf, result)
            }),
            early: (!dedicated).then(Default::default),
            label: format!("{}/{}", spec.pool, spec.image).into(),
        })
    }

    /// Whether the cluster `spec` names answers (a connection made and dropped): for retrying
    /// a device whose cluster was down without holding anything meanwhile.
    pub fn reachable(spec: &RbdSpec) -> io::Result<()> {
        connect(spec).map(drop).map_err(io_error)
    }

    /// The image again, through the observer connection (see `cluster`): for reading its
    /// metadata and lock state, never for I/O.
    pub fn observer(&self) -> io::Result<rbd::Image> {
        let cluster = cluster(&self.spec, true).map_err(io_error)?;
        rbd::Image::open(&cluster, &self.spec.pool, &self.spec.image).map_err(io_error)
    }

    /// The image's pool through the observer connection (see `cluster`): for the gateways'
    /// own objects beside the images (their heartbeats), never for an image's data.
    pub fn observer_pool(&self) -> io::Result<rbd::Pool> {
        let cluster = cluster(&self.spec, true).map_err(io_error)?;
        rbd::Pool::open(&cluster, &self.spec.pool).map_err(io_error)
    }

    pub fn spec(&self) -> &RbdSpec {
        &self.spec
    }

    /// The librbd image (exclusive lock, fencing); an error once closed.
    pub fn image(&self) -> Result<Arc<rbd::Image>, rbd::Error> {
        self.current()
            .clone()
            .ok_or_else(|| rbd::Error::Invalid(format!("{}: closed", self.spec.image)))
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Option<Arc<rbd::Image>>> {
        self.image.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces a dedicated connection (blocklisted after another gateway took the image
    /// over) with a new one and reopens the image on it; commands from then on use it. The
    /// old image closes when its last operation has answered (they fail once blocklisted).
    pub fn reconnect(&self) -> io::Result<()> {
        if !self.dedicated {
            return Err(io::Error::other(
                "the image shares its cluster connection; only a dedicated one is replaced",
            ));
        }
        let cluster = connect(&self.spec).map_err(io_error)?;
        let image =
            rbd::Image::open(&cluster, &self.spec.pool, &self.spec.image).map_err(io_error)?;
        let mut current = self.image.write().unwrap_or_else(|p| p.into_inner());
        if current.is_none() {
            return Err(io::Error::other("closed"));
        }
        let old = current.replace(Arc::new(image));
        drop(current);
        drop(old);
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        crate::check_range(self.size_bytes(), offset, len)
    }

    /// Waits for the writes answered early before now (synchronous callers: what they do
    /// must not overtake them).
    fn drain(&self) {
        if let Some(early) = &self.early {
            early.drain();
        }
    }

    /// A write answered early that failed, as SYNCHRONIZE CACHE reports it.
    fn lost_write(&self) -> Option<io::Error> {
        let lost = self.early.as_ref()?.take_lost()?;
        Some(lost_write_error(&lost))
    }

    /// Runs one operation and waits for it (the engine's I/O threads only), after the writes
    /// answered early before it.
    fn run(&self, op: rbd::Op, buf: Vec<u8>) -> io::Result<rbd::Finished<()>> {
        self.drain();
        let image = self.image().map_err(io_error)?;
        let finished = image.run(op, buf);
        match finished.result {
            Ok(_) => Ok(finished),
            Err(e) => Err(image_io_error(e, self.dedicated)),
        }
    }
}

impl BlockStore for RbdStore {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Relaxed)
    }

    /// The image's pool: what it stores against what it can still take (the monitors'
    /// `max_avail`, which counts replication, the cluster's full ratio and the pool's quota).
    /// An image allocates its objects from there as it is written.
    fn space(&self) -> io::Result<Option<crate::Space>> {
        // The cluster, not the image: a look that outlasts a close must not hold the image
        // open (its last holder closes it and releases its lock).
        let cluster = self
            .current()
            .as_ref()
            .map(|image| Arc::clone(image.cluster()));
        let Some(cluster) = cluster else {
            return Ok(None);
        };
        let (stored, available) = pool_usage_on(&cluster, &self.spec)?;
        Ok(Some(crate::Space {
            total_bytes: stored.saturating_add(available),
            used_bytes: stored,
        }))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            waits_for_device: true,
            lends_memory: false,
            lends_file_ranges: false,
            page_cache: false,
            direct: false,
            asynchronous: true,
            thin: true,
        }
    }

    fn submit(&self, io: AsyncIo, buf: Vec<u8>, done: AsyncDone) {
        let (op, offset, len) = match io {
            AsyncIo::Read { offset, len } => (rbd::Op::Read { offset, len }, offset, len as u64),
            AsyncIo::Write { offset, .. } => (rbd::Op::Write { offset }, offset, buf.len() as u64),
            AsyncIo::Flush => (rbd::Op::Flush, 0, 0),
        };
        if let Err(e) = self.check_range(offset, len) {
            done(buf, Err(e));
            return;
        }
        let to = Submission {
            image: self.current().clone(),
            sink: Arc::clone(&self.sink),
            label: Arc::clone(&self.label),
        };
        let Some(early) = &self.early else {
            to.start(op, buf, done);
            return;
        };
        match io {
            AsyncIo::Flush => flush_after_early(early, to, op, buf, done),
            _ => {
                if let Some(barrier) = early.overlapping(offset, len) {
                    // Over a write the initiator already has an answer for: after it. Not
                    // answered early itself (rare; keeps the wait simple).
                    early.after_earlier(barrier, Box::new(move || to.start(op, buf, done)));
                    return;
                }
                let seq = match io {
                    AsyncIo::Write { durable: false, .. } => early.begin(offset, len),
                    _ => None,
                };
                let Some(seq) = seq else {
                    to.start(op, buf, done);
                    return;
                };
                let account = Arc::clone(early);
                let label = Arc::clone(&self.label);
                let ended: AsyncDone = Box::new(move |_buf, result| {
                    let failure = result.err().map(|e| {
                        // The initiator has GOOD for it: the log says so now, the next
                        // SYNCHRONIZE CACHE says so to the initiator.
                        tracing::error!(
                            "{label}: a write answered from the write cache failed at byte \
                             {offset} (+{len}): {e}"
                        );
                        e.to_string()
                    });
                    account.end(seq, failure);
                });
                match to.submit(op, buf, ended) {
                    Ok(()) => done(Vec::new(), Ok(())),
                    Err((e, _ended, buf)) => {
                        // Refused at once: answered with the failure, not early.
                        early.end(seq, None);
                        done(buf, Err(io_error(e)));
                    }
                }
            }
        }
    }

    fn write_back(&self) -> Option<crate::WriteBack> {
        self.early.as_ref().map(|early| early.in_flight())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        let finished = self.run(
            rbd::Op::Read {
                offset,
                len: buf.len(),
            },
            Vec::new(),
        )?;
        if finished.buf.len() != buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: short read at {offset}: {} of {} bytes",
                    self.spec.image,
                    finished.buf.len(),
                    buf.len()
                ),
            ));
        }
        buf.copy_from_slice(&finished.buf);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, _durable: bool) -> io::Result<()> {
        // Without librbd's cache every write that returns is on the OSDs: durable either way.
        self.check_range(offset, buf.len() as u64)?;
        self.run(rbd::Op::Write { offset }, buf.to_vec()).map(drop)
    }

    fn flush(&self) -> io::Result<()> {
        let flushed = self.run(rbd::Op::Flush, Vec::new()).map(drop);
        match self.lost_write() {
            Some(lost) => Err(lost),
            None => flushed,
        }
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len, true)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _deallocate: bool) -> io::Result<()> {
        self.check_range(offset, len)?;
        // librbd takes the length as size_t: one call per 1 GiB keeps every call bounded.
        const STEP_BYTES: u64 = 1 << 30;
        let mut done = 0;
        while done < len {
            let step = (len - done).min(STEP_BYTES);
            self.run(
                rbd::Op::WriteZeroes {
                    offset: offset + done,
                    len: step as usize,
                },
                Vec::new(),
            )?;
            done += step;
        }
        Ok(())
    }

    fn mapping(&self, offset: u64) -> io::Result<Extent> {
        // A block written early is mapped once its write is over.
        self.drain();
        let window = crate::bytes_to_end(self.size_bytes(), offset)?.min(MAPPING_WINDOW_BYTES);
        let runs = self
            .image()
            .and_then(|image| image.allocated(offset, window, 1))
            .map_err(io_error)?;
        Ok(match runs.first() {
            Some(&(start, len)) if start <= offset => Extent {
                mapped: true,
                // Runs come from librbd: never trusted to stay inside the window.
                len: start
                    .saturating_add(len)
                    .saturating_sub(offset)
                    .clamp(1, window),
            },
            Some(&(start, _)) => Extent {
                mapped: false,
                len: (start - offset).min(window),
            },
            None => Extent {
                mapped: false,
                len: window,
            },
        })
    }

    fn is_thin(&self) -> bool {
        true
    }

    /// Closes the image (librbd waits for its operations and releases the exclusive lock), so
    /// that a gateway or a restarted daemon does not wait for this client's lock to time out.
    fn close(&self) {
        // A write answered early is over before the image closes (its failure is logged:
        // nobody is left to report it to).
        self.drain();
        let Some(image) = self.image.write().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        // An operation that took the image a moment before (one in flight, a look at its
        // owners) holds it too, and the last holder closes it: waited for here, so that the
        // close, and the lock's release with it, is over before a stopping daemon exits.
        if !drop_as_last(image, CLOSE_WAIT) {
            tracing::warn!(
                image = %self.spec.image,
                "still in use {CLOSE_WAIT:?} after its close: closed when its last operation ends"
            );
        }
    }

    fn medium_bytes(&self) -> io::Result<Option<u64>> {
        self.image()
            .and_then(|image| image.size())
            .map(Some)
            .map_err(io_error)
    }

    fn resize(&self, new_bytes: u64) -> io::Result<()> {
        self.drain();
        let image = self.image().map_err(io_error)?;
        let now = image.size().map_err(io_error)?;
        if new_bytes > now {
            image.resize(new_bytes).map_err(io_error)?;
        }
        self.size_bytes.store(new_bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// Drops `shared` once no other holder is left (within `wait`), so that its destructor runs on
/// this thread; false when others still hold it then (the last of them drops it).
fn drop_as_last<T>(mut shared: Arc<T>, wait: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        match Arc::try_unwrap(shared) {
            Ok(only) => {
                drop(only);
                return true;
            }
            Err(still) if std::time::Instant::now() < deadline => {
                shared = still;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(_) => return false,
        }
    }
}

/// What SYNCHRONIZE CACHE answers when a write answered early failed: a write error (no
/// errno, so never "retry", which would let a second flush succeed over the lost data).
fn lost_write_error(lost: &str) -> io::Error {
    io::Error::other(format!(
        "a write answered before it reached the cluster failed: {lost}"
    ))
}

/// Where one operation goes, taken from the store when it is submitted and carried by value
/// (to librbd's thread when it waits for early writes): the image then (None: closed), the
/// completion sink and the image's name. Clones of `Arc`s only: nothing allocated per command.
/// A flush of an image that answers writes early: it runs after the writes answered before
/// it, then reports one of them lost if one was.
fn flush_after_early(
    early: &Arc<EarlyAcks>,
    to: Submission,
    op: rbd::Op,
    buf: Vec<u8>,
    done: AsyncDone,
) {
    let account = Arc::clone(early);
    let done: AsyncDone = Box::new(move |buf, result| {
        let result = match account.take_lost() {
            Some(lost) => Err(lost_write_error(&lost)),
            None => result,
        };
        done(buf, result)
    });
    early.after_earlier(early.barrier(), Box::new(move || to.start(op, buf, done)));
}

struct Submission {
    image: Option<Arc<rbd::Image>>,
    sink: rbd::Sink<AsyncDone>,
    label: Arc<str>,
}

impl Submission {
    /// Submits `op`; `done` gets the outcome from librbd's thread, or comes back with the error
    /// when librbd refuses it at once.
    fn submit(
        self,
        op: rbd::Op,
        buf: Vec<u8>,
        done: AsyncDone,
    ) -> Result<(), (rbd::Error, AsyncDone, Vec<u8>)> {
        match self.image {
            Some(image) => image.submit(op, buf, done, self.sink),
            None => Err((
                rbd::Error::Invalid(format!("{}: closed", self.label)),
                done,
                buf,
            )),
        }
    }

    /// [`Submission::submit`], answering a refusal at once (no callback will come).
    fn start(self, op: rbd::Op, buf: Vec<u8>, done: AsyncDone) {
        if let Err((e, done, buf)) = self.submit(op, buf, done) {
            done(buf, Err(io_error(e)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{df_usage, drop_as_last, errno_of, image_io_error, librados_threads};
    use std::sync::Arc;
    use std::time::Duration;

    /// Records the thread its destructor ran on (an image's close, its lock's release).
    struct Closes(std::sync::mpsc::Sender<std::thread::ThreadId>);

    impl Drop for Closes {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    /// A close waits for another holder that lets go within the wait, and then closes on its
    /// own thread (a stopping daemon's, before it exits); one that outlasts the wait closes
    /// the image itself when it lets go.
    #[test]
    fn an_image_is_closed_by_its_closer_once_other_holders_let_go() {
        let (tx, closed_on) = std::sync::mpsc::channel();
        let image = Arc::new(Closes(tx));
        let held = Arc::clone(&image);
        let holder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(held);
        });
        assert!(drop_as_last(image, Duration::from_secs(30)));
        assert_eq!(closed_on.recv().unwrap(), std::thread::current().id());
        holder.join().unwrap();

        let (tx, closed_on) = std::sync::mpsc::channel();
        let image = Arc::new(Closes(tx));
        let held = Arc::clone(&image);
        assert!(!drop_as_last(image, Duration::from_millis(30)));
        assert!(closed_on.try_recv().is_err(), "closed under its holder");
        let holder = std::thread::spawn(move || drop(held));
        let holder_id = holder.thread().id();
        holder.join().unwrap();
        assert_eq!(closed_on.recv().unwrap(), holder_id);
    }

    /// A gateway's write refused for want of the lock is a fenced write; elsewhere EROFS stays.
    #[test]
    fn a_gateway_image_without_its_lock_answers_as_fenced() {
        let refused = || rbd::Error::Ceph {
            what: "write".into(),
            errno: 30,
        };
        let gateway = image_io_error(refused(), true);
        assert_eq!(errno_of(&gateway), Some(108));
        assert!(gateway.to_string().contains("EROFS"), "{gateway}");
        assert_eq!(errno_of(&image_io_error(refused(), false)), Some(30));
        let timeout = rbd::Error::Ceph {
            what: "write".into(),
            errno: 110,
        };
        assert_eq!(errno_of(&image_io_error(timeout, true)), Some(110));
    }

    #[test]
    fn a_pools_usage_is_read_from_the_monitors_df() {
        // As Ceph 16's `ceph df --format json` answers (trimmed).
        let df = r#"{"stats":{"total_bytes":32212254720},"pools":[
            {"name":"device_health_metrics","id":1,"stats":{"stored":0,"max_avail":10200547328}},
            {"name":"rbd","id":2,"stats":{"stored":4194304,"objects":3,"bytes_used":12582912,
             "percent_used":0.0004,"max_avail":10196353024}}]}"#;
        assert_eq!(df_usage(df, "rbd"), Some((4194304, 10196353024)));
        assert_eq!(df_usage(df, "other"), None);
        // `df detail` adds the quota; past it nothing is left, whatever the cluster has.
        let detail = r#"{"pools":[
            {"name":"q","stats":{"stored":3145728,"max_avail":2747409920,"quota_bytes":4194304}},
            {"name":"full","stats":{"stored":8388681,"max_avail":2747409920,"quota_bytes":4194304}},
            {"name":"none","stats":{"stored":5,"max_avail":100,"quota_bytes":0}}]}"#;
        assert_eq!(df_usage(detail, "q"), Some((3145728, 1048576)));
        assert_eq!(df_usage(detail, "full"), Some((8388681, 0)));
        assert_eq!(df_usage(detail, "none"), Some((5, 100)));
        assert_eq!(df_usage("not json", "rbd"), None);
    }

    #[test]
    fn small_gateways_run_librados_on_one_thread_larger_ones_keep_cephs_default() {
        assert_eq!(librados_threads(1), Some(1));
        assert_eq!(librados_threads(2), Some(1));
        assert_eq!(librados_threads(7), Some(1));
        assert_eq!(librados_threads(8), None);
        assert_eq!(librados_threads(64), None);
    }
}
