//! A thin, safe binding of the librados/librbd calls ferrosan uses for Ceph RBD images.
//!
//! The libraries are loaded at run time (`dlopen` of librados.so.2 and librbd.so.1, through
//! `libloading`), on first use: ferrosan builds, tests and runs on machines without Ceph, and
//! only a configured RBD image needs the libraries (the error then says which is missing).
//!
//! Asynchronous I/O follows librbd's model: [`Image::submit`] hands librbd a buffer and a
//! completion; librbd calls back on one of its own threads, where the binding takes the
//! buffer back and passes a [`Finished`] to the caller's sink (a channel to the worker that
//! owns the command, in the engine). The buffer is owned by the in-flight operation until
//! that callback: nothing the caller holds is lent to the C library.
//!
//! Every `unsafe` block here is an FFI call; each states what it relies on.
#![allow(unsafe_code)]

use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt;
use std::sync::{Arc, OnceLock};

type RadosT = *mut c_void;
type IoctxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type WriteOpT = *mut c_void;
#[allow(non_camel_case_types)]
type libc_time_t = i64;
type Callback = extern "C" fn(CompletionT, *mut c_void);
type DiffCallback = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// `rbd_image_watcher_t`: one client watching an image's header.
#[repr(C)]
struct Watcher {
    addr: *mut c_char,
    id: i64,
    cookie: u64,
}

/// `rbd_snap_info_t`: one snapshot of an image.
#[repr(C)]
struct SnapInfo {
    id: u64,
    size: u64,
    name: *const c_char,
}

/// The C entry points, resolved once.
struct Api {
    rbd_create: unsafe extern "C" fn(IoctxT, *const c_char, u64, *mut c_int) -> c_int,
    rbd_remove: unsafe extern "C" fn(IoctxT, *const c_char) -> c_int,
    rbd_clone: unsafe extern "C" fn(
        IoctxT,
        *const c_char,
        *const c_char,
        IoctxT,
        *const c_char,
        u64,
        *mut c_int,
    ) -> c_int,
    rbd_snap_create: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    rbd_snap_remove: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    rbd_snap_rollback: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    rbd_snap_protect: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    rbd_snap_unprotect: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    rbd_snap_list: unsafe extern "C" fn(ImageT, *mut SnapInfo, *mut c_int) -> c_int,
    rbd_snap_list_end: unsafe extern "C" fn(*mut SnapInfo),
    rbd_flatten: unsafe extern "C" fn(ImageT) -> c_int,
    rados_create2: unsafe extern "C" fn(*mut RadosT, *const c_char, *const c_char, u64) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    rados_conf_parse_env: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    rados_conf_get: unsafe extern "C" fn(RadosT, *const c_char, *mut c_char, usize) -> c_int,
    rados_connect: unsafe extern "C" fn(RadosT) -> c_int,
    rados_shutdown: unsafe extern "C" fn(RadosT),
    rados_ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoctxT) -> c_int,
    rados_ioctx_destroy: unsafe extern "C" fn(IoctxT),
    rados_set_pool_full_try: unsafe extern "C" fn(IoctxT),
    rados_write_full: unsafe extern "C" fn(IoctxT, *const c_char, *const c_char, usize) -> c_int,
    rados_read: unsafe extern "C" fn(IoctxT, *const c_char, *mut c_char, usize, u64) -> c_int,
    rados_mon_command: unsafe extern "C" fn(
        RadosT,
        *mut *const c_char,
        usize,
        *const c_char,
        usize,
        *mut *mut c_char,
        *mut usize,
        *mut *mut c_char,
        *mut usize,
    ) -> c_int,
    rados_buffer_free: unsafe extern "C" fn(*mut c_char),
    rbd_open: unsafe extern "C" fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_get_size: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    rbd_resize: unsafe extern "C" fn(ImageT, u64) -> c_int,
    rbd_lock_acquire: unsafe extern "C" fn(ImageT, c_int) -> c_int,
    rbd_lock_release: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_metadata_get: unsafe extern "C" fn(ImageT, *const c_char, *mut c_char, *mut usize) -> c_int,
    rbd_is_exclusive_lock_owner: unsafe extern "C" fn(ImageT, *mut c_int) -> c_int,
    rbd_lock_get_owners:
        unsafe extern "C" fn(ImageT, *mut c_int, *mut *mut c_char, *mut usize) -> c_int,
    rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
    rbd_lock_break: unsafe extern "C" fn(ImageT, c_int, *const c_char) -> c_int,
    rbd_watchers_list: unsafe extern "C" fn(ImageT, *mut Watcher, *mut usize) -> c_int,
    rbd_get_id: unsafe extern "C" fn(ImageT, *mut c_char, usize) -> c_int,
    rados_create_write_op: unsafe extern "C" fn() -> WriteOpT,
    rados_release_write_op: unsafe extern "C" fn(WriteOpT),
    rados_write_op_omap_cmp:
        unsafe extern "C" fn(WriteOpT, *const c_char, u8, *const c_char, usize, *mut c_int),
    rados_write_op_omap_set: unsafe extern "C" fn(
        WriteOpT,
        *const *const c_char,
        *const *const c_char,
        *const usize,
        usize,
    ),
    rados_write_op_operate:
        unsafe extern "C" fn(WriteOpT, IoctxT, *const c_char, *mut libc_time_t, c_int) -> c_int,
    rbd_watchers_list_cleanup: unsafe extern "C" fn(*mut Watcher, usize),
    rbd_diff_iterate2: unsafe extern "C" fn(
        ImageT,
        *const c_char,
        u64,
        u64,
        u8,
        u8,
        DiffCallback,
        *mut c_void,
    ) -> c_int,
    rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, Callback, *mut CompletionT) -> c_int,
    rbd_aio_release: unsafe extern "C" fn(CompletionT),
    rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    rbd_aio_read: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, CompletionT) -> c_int,
    rbd_aio_write: unsafe extern "C" fn(ImageT, u64, usize, *const c_char, CompletionT) -> c_int,
    rbd_aio_flush: unsafe extern "C" fn(ImageT, CompletionT) -> c_int,
    rbd_aio_discard: unsafe extern "C" fn(ImageT, u64, u64, CompletionT) -> c_int,
    rbd_aio_write_zeroes:
        unsafe extern "C" fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int,
    rbd_aio_compare_and_write: unsafe extern "C" fn(
        ImageT,
        u64,
        usize,
        *const c_char,
        *const c_char,
        CompletionT,
        *mut u64,
        c_int,
    ) -> c_int,
    // Keeps the libraries mapped for as long as the pointers above are used (forever).
    _rados: Library,
    _rbd: Library,
}

/// Why something failed: a librados/librbd error number with what was being done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The Ceph client libraries could not be loaded (not installed).
    Library(String),
    /// A call returned `-errno`.
    Ceph { what: String, errno: i32 },
    /// A name with a NUL byte, an offset past the image, and the like.
    Invalid(String),
}

impl Error {
    /// The errno of a failed call (ENOENT for a missing image or pool, ETIMEDOUT, ...).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Ceph { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Library(why) => write!(f, "Ceph client libraries unavailable: {why}"),
            Error::Ceph { what, errno } => {
                write!(f, "{what}: {}", std::io::Error::from_raw_os_error(*errno))
            }
            Error::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for Error {}

fn check(what: impl FnOnce() -> String, rc: c_int) -> Result<(), Error> {
    if rc < 0 {
        Err(Error::Ceph {
            what: what(),
            errno: -rc,
        })
    } else {
        Ok(())
    }
}

fn cstring(what: &str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Invalid(format!("{what} {s:?} contains a NUL byte")))
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn api() -> Result<&'static Api, Error> {
    API.get_or_init(load)
        .as_ref()
        .map_err(|e| Error::Library(e.clone()))
}

/// Whether the Ceph client libraries can be loaded here (and if not, why).
pub fn available() -> Result<(), Error> {
    api().map(drop)
}

fn load() -> Result<Api, String> {
    // SAFETY: loading a shared library runs its initialisers; librados and librbd are the
    // system's own, meant to be loaded into any process.
    let rados =
        unsafe { Library::new("librados.so.2") }.map_err(|e| format!("librados.so.2: {e}"))?;
    let rbd = unsafe { Library::new("librbd.so.1") }.map_err(|e| format!("librbd.so.1: {e}"))?;
    macro_rules! sym {
        ($lib:expr, $name:literal) => {
            // SAFETY: the symbol's type is the one librados.h / librbd.h declare for it
            // (checked against Ceph 16's headers); the library stays loaded in `Api`.
            *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{}: {e}", $name))?
        };
    }
    Ok(Api {
        rbd_create: sym!(rbd, "rbd_create"),
        rbd_remove: sym!(rbd, "rbd_remove"),
        rbd_clone: sym!(rbd, "rbd_clone"),
        rbd_snap_create: sym!(rbd, "rbd_snap_create"),
        rbd_snap_remove: sym!(rbd, "rbd_snap_remove"),
        rbd_snap_rollback: sym!(rbd, "rbd_snap_rollback"),
        rbd_snap_protect: sym!(rbd, "rbd_snap_protect"),
        rbd_snap_unprotect: sym!(rbd, "rbd_snap_unprotect"),
        rbd_snap_list: sym!(rbd, "rbd_snap_list"),
        rbd_snap_list_end: sym!(rbd, "rbd_snap_list_end"),
        rbd_flatten: sym!(rbd, "rbd_flatten"),
        rados_create2: sym!(rados, "rados_create2"),
        rados_conf_read_file: sym!(rados, "rados_conf_read_file"),
        rados_conf_parse_env: sym!(rados, "rados_conf_parse_env"),
        rados_conf_set: sym!(rados, "rados_conf_set"),
        rados_conf_get: sym!(rados, "rados_conf_get"),
        rados_connect: sym!(rados, "rados_connect"),
        rados_shutdown: sym!(rados, "rados_shutdown"),
        rados_ioctx_create: sym!(rados, "rados_ioctx_create"),
        rados_ioctx_destroy: sym!(rados, "rados_ioctx_destroy"),
        rados_set_pool_full_try: sym!(rados, "rados_set_pool_full_try"),
        rados_write_full: sym!(rados, "rados_write_full"),
        rados_read: sym!(rados, "rados_read"),
        rados_mon_command: sym!(rados, "rados_mon_command"),
        rados_buffer_free: sym!(rados, "rados_buffer_free"),
        rbd_open: sym!(rbd, "rbd_open"),
        rbd_close: sym!(rbd, "rbd_close"),
        rbd_get_size: sym!(rbd, "rbd_get_size"),
        rbd_resize: sym!(rbd, "rbd_resize"),
        rbd_lock_acquire: sym!(rbd, "rbd_lock_acquire"),
        rbd_lock_release: sym!(rbd, "rbd_lock_release"),
        rbd_metadata_get: sym!(rbd, "rbd_metadata_get"),
        rbd_is_exclusive_lock_owner: sym!(rbd, "rbd_is_exclusive_lock_owner"),
        rbd_lock_get_owners: sym!(rbd, "rbd_lock_get_owners"),
        rbd_lock_get_owners_cleanup: sym!(rbd, "rbd_lock_get_owners_cleanup"),
        rbd_lock_break: sym!(rbd, "rbd_lock_break"),
        rbd_watchers_list: sym!(rbd, "rbd_watchers_list"),
        rbd_get_id: sym!(rbd, "rbd_get_id"),
        rados_create_write_op: sym!(rados, "rados_create_write_op"),
        rados_release_write_op: sym!(rados, "rados_release_write_op"),
        rados_write_op_omap_cmp: sym!(rados, "rados_write_op_omap_cmp"),
        rados_write_op_omap_set: sym!(rados, "rados_write_op_omap_set"),
        rados_write_op_operate: sym!(rados, "rados_write_op_operate"),
        rbd_watchers_list_cleanup: sym!(rbd, "rbd_watchers_list_cleanup"),
        rbd_diff_iterate2: sym!(rbd, "rbd_diff_iterate2"),
        rbd_aio_create_completion: sym!(rbd, "rbd_aio_create_completion"),
        rbd_aio_release: sym!(rbd, "rbd_aio_release"),
        rbd_aio_get_return_value: sym!(rbd, "rbd_aio_get_return_value"),
        rbd_aio_read: sym!(rbd, "rbd_aio_read"),
        rbd_aio_write: sym!(rbd, "rbd_aio_write"),
        rbd_aio_flush: sym!(rbd, "rbd_aio_flush"),
        rbd_aio_discard: sym!(rbd, "rbd_aio_discard"),
        rbd_aio_write_zeroes: sym!(rbd, "rbd_aio_write_zeroes"),
        rbd_aio_compare_and_write: sym!(rbd, "rbd_aio_compare_and_write"),
        _rados: rados,
        _rbd: rbd,
    })
}

/// How to reach a cluster, as Ceph's own tools take it.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// ceph.conf; None: librados's default search (`$CEPH_CONF`, /etc/ceph/ceph.conf, ...).
    pub conf: Option<std::path::PathBuf>,
    /// The client's name, e.g. `client.iscsi` (None: `client.admin`).
    pub client: Option<String>,
    /// Options set after the file and `$CEPH_ARGS`, over whatever they say.
    pub settings: Vec<(String, String)>,
    /// Options set only where ceph.conf and `$CEPH_ARGS` left Ceph's built-in value (the
    /// caller's choice of default, which an operator's config still overrides).
    pub defaults: Vec<(String, String)>,
}

/// Seconds an operation may wait for the cluster before it fails with ETIMEDOUT: a lost
/// cluster fails commands in bounded time instead of holding them forever. Overridable
/// through `settings`.
pub const OP_TIMEOUT_S: u32 = 30;

/// The longest image metadata value read ([`Image::metadata`]).
pub const METADATA_BYTES_MAX: usize = 1 << 20;

/// How long [`Image::run`] waits for an answer: past librbd's own operation timeout, so that
/// one normally answers first.
pub const RUN_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(OP_TIMEOUT_S as u64 + 15);

/// A connection to a cluster (librados `rados_t`).
pub struct Cluster {
    handle: RadosT,
    api: &'static Api,
}

// SAFETY: librados handles are thread-safe (the C API documents concurrent use of one
// rados_t from many threads).
unsafe impl Send for Cluster {}
unsafe impl Sync for Cluster {}

impl Cluster {
    pub fn connect(options: &ClusterOptions) -> Result<Arc<Cluster>, Error> {
        let api = api()?;
        let name = cstring(
            "client name",
            options.client.as_deref().unwrap_or("client.admin"),
        )?;
        let cluster_name = cstring("cluster name", "ceph")?;
        let mut handle: RadosT = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the names are NUL-terminated and outlive the call.
        let rc =
            unsafe { (api.rados_create2)(&mut handle, cluster_name.as_ptr(), name.as_ptr(), 0) };
        check(|| "rados_create2".into(), rc)?;
        // From here the handle is shut down on every path (Drop).
        let cluster = Cluster { handle, api };
        // Bounded waits (300 s to mount and no limit on operations are Ceph's own), then the
        // caller's defaults: each replaces Ceph's built-in value only, read here before the
        // file and the environment can change it.
        let timeout = OP_TIMEOUT_S.to_string();
        let defaults: Vec<(&str, &str)> = [
            ("client_mount_timeout", timeout.as_str()),
            ("rados_mon_op_timeout", timeout.as_str()),
            ("rados_osd_op_timeout", timeout.as_str()),
        ]
        .into_iter()
        .chain(
            options
                .defaults
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .collect();
        let builtin = defaults
            .iter()
            .map(|(key, _)| cluster.option(key))
            .collect::<Result<Vec<_>, _>>()?;
        let conf = match &options.conf {
            Some(p) => Some(cstring("config path", &p.to_string_lossy())?),
            None => None,
        };
        // SAFETY: a valid handle; the path is NUL-terminated or NULL (default search).
        let rc = unsafe {
            (api.rados_conf_read_file)(
                handle,
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        check(
            || match &options.conf {
                Some(p) => format!("reading {}", p.display()),
                None => "reading the default ceph.conf ($CEPH_CONF, /etc/ceph/ceph.conf)".into(),
            },
            rc,
        )?;
        // SAFETY: a valid handle; NULL selects $CEPH_ARGS.
        let rc = unsafe { (api.rados_conf_parse_env)(handle, std::ptr::null()) };
        check(|| "parsing $CEPH_ARGS".into(), rc)?;
        for ((key, ours), builtin) in defaults.iter().zip(&builtin) {
            if cluster.option(key)? == *builtin {
                cluster.set(key, ours)?;
            }
        }
        for (k, v) in &options.settings {
            cluster.set(k, v)?;
        }
        // SAFETY: a configured handle.
        let rc = unsafe { (api.rados_connect)(handle) };
        check(|| "connecting to the cluster".into(), rc)?;
        Ok(Arc::new(cluster))
    }

    /// The value of a configuration option as this connection has it.
    pub fn option(&self, key: &str) -> Result<String, Error> {
        let k = cstring("option", key)?;
        let mut buf = [0u8; 64];
        // SAFETY: a valid handle; `buf` has room for `len` bytes, NUL included (librados
        // returns ENAMETOOLONG rather than overflow).
        let rc = unsafe {
            (self.api.rados_conf_get)(self.handle, k.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        };
        check(|| format!("reading {key}"), rc)?;
        let text = buf.split(|&b| b == 0).next().unwrap_or(&[]);
        Ok(String::from_utf8_lossy(text).into_owned())
    }

    /// A monitor command (JSON, as `ceph` sends it) and its JSON answer, e.g.
    /// `{"prefix": "df", "format": "json"}`: bounded by `rados_mon_op_timeout`.
    pub fn mon_command(&self, command: &str) -> Result<String, Error> {
        let cmd = cstring("command", command)?;
        let mut cmds = [cmd.as_ptr()];
        let (mut out, mut out_len) = (std::ptr::null_mut(), 0usize);
        let (mut status, mut status_len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a connected handle; one NUL-terminated command alive for the call; no input
        // buffer; out-pointers to locals, whose buffers librados allocates and we free below.
        let rc = unsafe {
            (self.api.rados_mon_command)(
                self.handle,
                cmds.as_mut_ptr(),
                1,
                std::ptr::null(),
                0,
                &mut out,
                &mut out_len,
                &mut status,
                &mut status_len,
            )
        };
        let answer = if out.is_null() {
            String::new()
        } else {
            // SAFETY: librados wrote `out_len` bytes at `out`.
            let bytes = unsafe { std::slice::from_raw_parts(out.cast::<u8>(), out_len) };
            String::from_utf8_lossy(bytes).into_owned()
        };
        for buffer in [out, status] {
            if !buffer.is_null() {
                // SAFETY: a buffer librados allocated for this call, freed once.
                unsafe { (self.api.rados_buffer_free)(buffer) }
            }
        }
        check(|| format!("monitor command {command}"), rc)?;
        Ok(answer)
    }

    fn set(&self, key: &str, value: &str) -> Result<(), Error> {
        let k = cstring("option", key)?;
        let v = cstring("value", value)?;
        // SAFETY: a valid handle; both strings NUL-terminated and alive for the call.
        let rc = unsafe { (self.api.rados_conf_set)(self.handle, k.as_ptr(), v.as_ptr()) };
        check(|| format!("setting {key}"), rc)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and every Pool/Image holds an Arc<Cluster>, so none is
        // still using it.
        unsafe { (self.api.rados_shutdown)(self.handle) }
        give_back_freed_memory();
    }
}

/// Hands the pages glibc's allocator holds free back to the kernel. A connection's dozen
/// threads each allocate from an arena of their own, and what they free stays resident when
/// they end: a gateway whose connection is replaced after every takeover grew ~160 KiB of RSS
/// a takeover while its live heap stayed flat (heaptrack, 62 takeovers in 12 minutes, live
/// heap 8.2-8.6 MiB throughout, anonymous RSS 30 -> 40 MiB; one `malloc_trim` gave back 6 MiB).
/// Runs where a connection ends (a takeover, a removed device, a volume verb), not per I/O.
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own arenas under their locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// An open image (librbd `rbd_image_t`) and the pool context it lives in.
pub struct Image {
    image: ImageT,
    ioctx: IoctxT,
    name: String,
    api: &'static Api,
    // Dropped after the image and context (fields drop in order).
    cluster: Arc<Cluster>,
}

// SAFETY: librbd images may be used from several threads (librbd serialises internally);
// ferrosan submits from worker threads and librbd completes on its own.
unsafe impl Send for Image {}
unsafe impl Sync for Image {}

/// One asynchronous operation.
pub enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
    },
    /// Deallocate (`UNMAP`); reads return zeros after it.
    Discard {
        offset: u64,
        len: u64,
    },
    /// Write zeros (`WRITE SAME` of zeros), allocating or not as librbd chooses.
    WriteZeroes {
        offset: u64,
        len: usize,
    },
    /// Persist every completed write (`SYNCHRONIZE CACHE`, FUA).
    Flush,
    /// Write the second half of the buffer where the first half matches the image
    /// (`COMPARE AND WRITE`); on a mismatch, [`Finished::mismatch_at`] is set.
    CompareAndWrite {
        offset: u64,
    },
}

/// A completed operation: its tag, its buffer back, and what librbd said.
pub struct Finished<T> {
    pub tag: T,
    pub buf: Vec<u8>,
    /// Bytes transferred (reads, writes) or 0.
    pub result: Result<usize, Error>,
    /// COMPARE AND WRITE: the image offset of the first byte that differed.
    pub mismatch_at: Option<u64>,
}

/// Where completions go (called on a librbd thread: keep it short, e.g. a channel send).
pub type Sink<T> = Arc<dyn Fn(Finished<T>) + Send + Sync>;

/// What librbd holds while an operation runs; owned by the callback's argument.
struct InFlight<T> {
    tag: T,
    buf: Vec<u8>,
    sink: Sink<T>,
    completion: CompletionT,
    api: &'static Api,
    mismatch: u64,
    what: &'static str,
    offset: u64,
}

extern "C" fn on_complete<T>(_c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the Box<InFlight<T>> leaked by `submit` for exactly this callback,
    // which librbd calls once per completion.
    let op = unsafe { Box::from_raw(arg.cast::<InFlight<T>>()) };
    // SAFETY: the completion is ours and complete (we are its callback); released once.
    let rc = unsafe { (op.api.rbd_aio_get_return_value)(op.completion) };
    unsafe { (op.api.rbd_aio_release)(op.completion) };
    let InFlight {
        tag,
        buf,
        sink,
        mismatch,
        what,
        offset,
        ..
    } = *op;
    let (result, mismatch_at) = if rc >= 0 {
        // librbd returns the byte count for reads and 0 for the rest: report what was done.
        let done = match what {
            "read" => rc as usize,
            "write" => buf.len(),
            "compare-and-write" => buf.len() / 2,
            _ => 0,
        };
        (Ok(done), None)
    } else if what == "compare-and-write" && -rc == 84 {
        // EILSEQ: the compare failed; `mismatch` is the image offset of the first difference.
        (
            Err(Error::Ceph {
                what: format!("{what} at {offset}: miscompare"),
                errno: 84,
            }),
            Some(mismatch),
        )
    } else {
        (
            Err(Error::Ceph {
                what: format!("{what} at {offset}"),
                errno: (-rc) as i32,
            }),
            None,
        )
    };
    sink(Finished {
        tag,
        buf,
        result,
        mismatch_at,
    });
}

/// An operation's name and offset (for errors), its buffer made ready: a read's resized to
/// its length; a compare-and-write's checked to hold two halves of equal length.
fn prepare(op: &Op, buf: &mut Vec<u8>) -> Result<(&'static str, u64), Error> {
    Ok(match op {
        Op::Read { offset, len } => {
            buf.resize(*len, 0);
            ("read", *offset)
        }
        Op::Write { offset } => ("write", *offset),
        Op::Discard { offset, .. } => ("discard", *offset),
        Op::WriteZeroes { offset, .. } => ("write-zeroes", *offset),
        Op::Flush => ("flush", 0),
        Op::CompareAndWrite { offset } => {
            if !buf.len().is_multiple_of(2) || buf.is_empty() {
                return Err(Error::Invalid(
                    "compare-and-write needs two halves of equal length".into(),
                ));
            }
            ("compare-and-write", *offset)
        }
    })
}

/// The features of a clone: layering (it has a parent), exclusive-lock, object-map,
/// fast-diff and deep-flatten, librbd's default set for a new image.
const CLONE_FEATURES: u64 = 1 | 4 | 8 | 16 | 32;

/// A pool of a cluster, for making and removing its images.
pub struct Pool {
    ioctx: IoctxT,
    name: String,
    api: &'static Api,
    cluster: Arc<Cluster>,
}

// SAFETY: an ioctx may be used from any thread (librados serialises internally); its
// settings (snapshot context, namespace) are never changed after it is made.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    pub fn open(cluster: &Arc<Cluster>, pool: &str) -> Result<Pool, Error> {
        let api = cluster.api;
        let pool_c = cstring("pool", pool)?;
        let mut ioctx: IoctxT = std::ptr::null_mut();
        // SAFETY: a connected cluster handle; out-pointer to a local.
        let rc = unsafe { (api.rados_ioctx_create)(cluster.handle, pool_c.as_ptr(), &mut ioctx) };
        check(|| format!("pool {pool:?}"), rc)?;
        Ok(Pool {
            ioctx,
            name: pool.to_string(),
            api,
            cluster: Arc::clone(cluster),
        })
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cluster the pool is of.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Replaces object `object`'s data with `data` (one write; made if missing).
    pub fn write_object(&self, object: &str, data: &[u8]) -> Result<(), Error> {
        let object_c = cstring("object", object)?;
        // SAFETY: a valid ioctx; `data` outlives the synchronous call.
        let rc = unsafe {
            (self.api.rados_write_full)(
                self.ioctx,
                object_c.as_ptr(),
                data.as_ptr().cast(),
                data.len(),
            )
        };
        check(|| format!("writing {}/{object}", self.name), rc)
    }

    /// Object `object`'s first `max` bytes at most; None when it does not exist.
    pub fn read_object(&self, object: &str, max: usize) -> Result<Option<Vec<u8>>, Error> {
        let object_c = cstring("object", object)?;
        let mut buf = vec![0u8; max];
        // SAFETY: a valid ioctx; `buf` holds `max` bytes and outlives the synchronous call.
        let rc = unsafe {
            (self.api.rados_read)(
                self.ioctx,
                object_c.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
            )
        };
        if rc == -2 {
            // ENOENT: no such object.
            return Ok(None);
        }
        check(|| format!("reading {}/{object}", self.name), rc)?;
        buf.truncate(rc as usize);
        Ok(Some(buf))
    }

    /// Creates image `name` of `bytes` (librbd's default format, features and object size).
    pub fn create(&self, name: &str, bytes: u64) -> Result<(), Error> {
        let name_c = cstring("image", name)?;
        let mut order: c_int = 0;
        // SAFETY: a valid ioctx; out-pointer to a local (0: the default object size).
        let rc = unsafe { (self.api.rbd_create)(self.ioctx, name_c.as_ptr(), bytes, &mut order) };
        check(|| format!("creating {}/{name}", self.name), rc)
    }

    /// Removes image `name` (EBUSY while a client has it open, ENOTEMPTY with snapshots).
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let name_c = cstring("image", name)?;
        // SAFETY: a valid ioctx.
        let rc = unsafe { (self.api.rbd_remove)(self.ioctx, name_c.as_ptr()) };
        check(|| format!("removing {}/{name}", self.name), rc)
    }

    /// Makes image `child` of this pool a clone of snapshot `snap` of `parent` (of `from`),
    /// which must be protected (clone format 1) or not (format 2: librbd decides).
    pub fn clone_image(
        &self,
        from: &Pool,
        parent: &str,
        snap: &str,
        child: &str,
    ) -> Result<(), Error> {
        let (parent_c, snap_c) = (cstring("image", parent)?, cstring("snapshot", snap)?);
        let child_c = cstring("image", child)?;
        let mut order: c_int = 0;
        // SAFETY: valid ioctxs and strings; out-pointer to a local.
        let rc = unsafe {
            (self.api.rbd_clone)(
                from.ioctx,
                parent_c.as_ptr(),
                snap_c.as_ptr(),
                self.ioctx,
                child_c.as_ptr(),
                CLONE_FEATURES,
                &mut order,
            )
        };
        check(
            || {
                format!(
                    "cloning {}/{parent}@{snap} to {}/{child}",
                    from.name, self.name
                )
            },
            rc,
        )
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: ours, used by nothing else now.
        unsafe { (self.api.rados_ioctx_destroy)(self.ioctx) };
    }
}

impl Image {
    /// The connection the image was opened on.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Creates snapshot `snap` of the image as it is now (what was written and answered).
    pub fn snap_create(&self, snap: &str) -> Result<(), Error> {
        self.snap_call("creating snapshot", snap, self.api.rbd_snap_create)
    }

    /// Removes snapshot `snap` (EBUSY while protected).
    pub fn snap_remove(&self, snap: &str) -> Result<(), Error> {
        self.snap_call("removing snapshot", snap, self.api.rbd_snap_remove)
    }

    /// Puts snapshot `snap`'s data back into the image.
    pub fn snap_rollback(&self, snap: &str) -> Result<(), Error> {
        self.snap_call("rolling back to snapshot", snap, self.api.rbd_snap_rollback)
    }

    /// Protects snapshot `snap` from removal (clones of format 1 need it); EBUSY if it is.
    pub fn snap_protect(&self, snap: &str) -> Result<(), Error> {
        self.snap_call("protecting snapshot", snap, self.api.rbd_snap_protect)
    }

    /// Lifts the protection; EBUSY while clones depend on it, EINVAL if it was not protected.
    pub fn snap_unprotect(&self, snap: &str) -> Result<(), Error> {
        self.snap_call("unprotecting snapshot", snap, self.api.rbd_snap_unprotect)
    }

    fn snap_call(
        &self,
        what: &str,
        snap: &str,
        call: unsafe extern "C" fn(ImageT, *const c_char) -> c_int,
    ) -> Result<(), Error> {
        let snap_c = cstring("snapshot", snap)?;
        // SAFETY: an open image and a NUL-terminated name; `call` is one of librbd's
        // snapshot entry points of this signature.
        let rc = unsafe { call(self.image, snap_c.as_ptr()) };
        check(|| format!("{what} {}@{snap}", self.name), rc)
    }

    /// Copies what a clone still reads from its parent into the clone, so that it no longer
    /// depends on the parent's snapshot (EINVAL for an image that is no clone).
    pub fn flatten(&self) -> Result<(), Error> {
        // SAFETY: an open image.
        let rc = unsafe { (self.api.rbd_flatten)(self.image) };
        check(|| format!("flattening {}", self.name), rc)
    }

    /// The image's snapshots: name and size in bytes.
    pub fn snapshots(&self) -> Result<Vec<(String, u64)>, Error> {
        let mut max: c_int = 16;
        // Snapshots made meanwhile can make the room short again; a few rounds settle it.
        for _ in 0..8 {
            let mut list: Vec<SnapInfo> = (0..max)
                .map(|_| SnapInfo {
                    id: 0,
                    size: 0,
                    name: std::ptr::null(),
                })
                .collect();
            // SAFETY: an open image; `list` has room for `max` entries.
            let rc = unsafe { (self.api.rbd_snap_list)(self.image, list.as_mut_ptr(), &mut max) };
            if rc == -libc_erange() {
                continue; // `max` now says how many there are
            }
            check(|| format!("snapshots of {}", self.name), rc)?;
            let n = usize::try_from(rc).unwrap_or(0).min(list.len());
            let out = list[..n]
                .iter()
                .map(|s| {
                    // SAFETY: librbd filled `name` with a NUL-terminated string, valid until
                    // rbd_snap_list_end.
                    let name = unsafe { std::ffi::CStr::from_ptr(s.name) };
                    (name.to_string_lossy().into_owned(), s.size)
                })
                .collect();
            // SAFETY: the list librbd filled, released once.
            unsafe { (self.api.rbd_snap_list_end)(list.as_mut_ptr()) };
            return Ok(out);
        }
        Err(Error::Ceph {
            what: format!("snapshots of {}: the list kept growing", self.name),
            errno: libc_erange(),
        })
    }
}

/// ERANGE (Linux): a snapshot list larger than the room given.
fn libc_erange() -> c_int {
    34
}

impl Image {
    /// Opens `pool/image` (write access; `rbd_open` with no snapshot).
    pub fn open(cluster: &Arc<Cluster>, pool: &str, name: &str) -> Result<Image, Error> {
        let api = cluster.api;
        let pool_c = cstring("pool", pool)?;
        let name_c = cstring("image", name)?;
        let mut ioctx: IoctxT = std::ptr::null_mut();
        // SAFETY: a connected cluster handle; out-pointer to a local.
        let rc = unsafe { (api.rados_ioctx_create)(cluster.handle, pool_c.as_ptr(), &mut ioctx) };
        check(|| format!("pool {pool:?}"), rc)?;
        // A pool at its quota or the cluster at its full ratio: writes fail at once (EDQUOT,
        // ENOSPC: SPACE ALLOCATION FAILED to the host) instead of waiting, paused in the
        // client, until the op timeout. librbd copies the flag into the image's own contexts.
        // SAFETY: a valid ioctx, not yet shared.
        unsafe { (api.rados_set_pool_full_try)(ioctx) };
        let mut image: ImageT = std::ptr::null_mut();
        // SAFETY: a valid ioctx; out-pointer to a local; NULL snapshot = the head.
        let rc = unsafe { (api.rbd_open)(ioctx, name_c.as_ptr(), &mut image, std::ptr::null()) };
        if let Err(e) = check(|| format!("image {pool}/{name}"), rc) {
            // SAFETY: created above, used by nothing else.
            unsafe { (api.rados_ioctx_destroy)(ioctx) };
            return Err(e);
        }
        Ok(Image {
            image,
            ioctx,
            name: format!("{pool}/{name}"),
            api,
            cluster: Arc::clone(cluster),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> Result<u64, Error> {
        let mut size = 0u64;
        // SAFETY: an open image; out-pointer to a local.
        let rc = unsafe { (self.api.rbd_get_size)(self.image, &mut size) };
        check(|| format!("size of {}", self.name), rc)?;
        Ok(size)
    }

    pub fn resize(&self, bytes: u64) -> Result<(), Error> {
        // SAFETY: an open image.
        let rc = unsafe { (self.api.rbd_resize)(self.image, bytes) };
        check(|| format!("resizing {} to {bytes}", self.name), rc)
    }

    /// Takes the image's exclusive lock (blocking other clients' writes until it is released
    /// or this client is blocklisted).
    pub fn lock_exclusive(&self) -> Result<(), Error> {
        // SAFETY: an open image; RBD_LOCK_MODE_EXCLUSIVE is 0.
        let rc = unsafe { (self.api.rbd_lock_acquire)(self.image, 0) };
        check(|| format!("exclusive lock of {}", self.name), rc)
    }

    /// The image metadata value under `key` (None when unset), at most
    /// [`METADATA_BYTES_MAX`] bytes.
    pub fn metadata(&self, key: &str) -> Result<Option<String>, Error> {
        let key_c = cstring("metadata key", key)?;
        let mut value = vec![0u8; 1024];
        let mut len = value.len();
        loop {
            // SAFETY: an open image; `value` has room for `len` bytes, which librbd never
            // exceeds (it returns ERANGE with the length it needs instead).
            let rc = unsafe {
                (self.api.rbd_metadata_get)(
                    self.image,
                    key_c.as_ptr(),
                    value.as_mut_ptr().cast(),
                    &mut len,
                )
            };
            match rc {
                -2 => return Ok(None),
                -34 if len > value.len() && len <= METADATA_BYTES_MAX => {
                    value.resize(len, 0);
                }
                _ => {
                    check(|| format!("metadata {key} of {}", self.name), rc)?;
                    break;
                }
            }
        }
        let bytes = &value[..len.min(value.len())];
        let text = bytes.split(|&b| b == 0).next().unwrap_or(&[]);
        Ok(Some(String::from_utf8_lossy(text).into_owned()))
    }

    /// Sets the image metadata `key` to `value` only if it still holds `expected` (an absent
    /// key holds ""), atomically in the cluster: one RADOS operation on the image's header
    /// object comparing and setting the omap entry librbd keeps the key in. False when the
    /// value differed (nothing was written). Like [`Image::put_metadata`] it sends no notice.
    pub fn compare_and_set_metadata(
        &self,
        key: &str,
        expected: &str,
        value: &str,
    ) -> Result<bool, Error> {
        self.write_metadata(key, Some(expected), value)
    }

    /// Sets the image metadata `key` to `value` with one RADOS write to the image's header
    /// object. Unlike librbd's `rbd_metadata_set` it sends the image's other clients no
    /// header-update notice (which only librbd's own `conf_` keys need): that notice waits
    /// up to 5 s for every watcher's answer, a dead client's included, so a takeover that
    /// records its owner with it would wait out the client it just fenced.
    pub fn put_metadata(&self, key: &str, value: &str) -> Result<(), Error> {
        self.write_metadata(key, None, value).map(|_| ())
    }

    /// One write operation on the header object's omap entry for `key`, compared with
    /// `expected` first when given (false: it differed, nothing written).
    fn write_metadata(
        &self,
        key: &str,
        expected: Option<&str>,
        value: &str,
    ) -> Result<bool, Error> {
        // librbd's layout (cls_rbd): format-2 header object, keys prefixed "metadata_".
        let oid = cstring("header object", &format!("rbd_header.{}", self.id()?))?;
        let omap_key = cstring("metadata key", &format!("metadata_{key}"))?;
        cstring("metadata value", value)?;
        const LIBRADOS_CMPXATTR_OP_EQ: u8 = 1;
        // SAFETY: librados allocates the operation; released below on every path.
        let op = unsafe { (self.api.rados_create_write_op)() };
        if op.is_null() {
            return Err(Error::Invalid("rados_create_write_op failed".into()));
        }
        let mut compared: c_int = 0;
        let keys = [omap_key.as_ptr()];
        let values = [value.as_ptr().cast::<c_char>()];
        let lens = [value.len()];
        // SAFETY: `op` is live; every pointer (key, expected, value, the arrays) outlives the
        // synchronous operate call, which copies what it sends; `compared` too.
        let rc = unsafe {
            if let Some(expected) = expected {
                (self.api.rados_write_op_omap_cmp)(
                    op,
                    omap_key.as_ptr(),
                    LIBRADOS_CMPXATTR_OP_EQ,
                    expected.as_ptr().cast(),
                    expected.len(),
                    &mut compared,
                );
            }
            (self.api.rados_write_op_omap_set)(
                op,
                keys.as_ptr(),
                values.as_ptr(),
                lens.as_ptr(),
                1,
            );
            let rc = (self.api.rados_write_op_operate)(
                op,
                self.ioctx,
                oid.as_ptr(),
                std::ptr::null_mut(),
                0,
            );
            (self.api.rados_release_write_op)(op);
            rc
        };
        const ECANCELED: c_int = 125;
        if rc == -ECANCELED && expected.is_some() {
            return Ok(false);
        }
        check(|| format!("setting metadata {key} of {}", self.name), rc)?;
        Ok(true)
    }

    /// The image's id (names its header object).
    fn id(&self) -> Result<String, Error> {
        let mut id = [0u8; 64];
        // SAFETY: an open image; `id` has room for `id.len()` bytes including the NUL.
        let rc = unsafe { (self.api.rbd_get_id)(self.image, id.as_mut_ptr().cast(), id.len()) };
        check(|| format!("id of {}", self.name), rc)?;
        let text = id.split(|&b| b == 0).next().unwrap_or(&[]);
        Ok(String::from_utf8_lossy(text).into_owned())
    }

    /// Gives the exclusive lock up (another gateway may take it without fencing this one).
    pub fn unlock_exclusive(&self) -> Result<(), Error> {
        // SAFETY: an open image.
        let rc = unsafe { (self.api.rbd_lock_release)(self.image) };
        check(
            || format!("releasing the exclusive lock of {}", self.name),
            rc,
        )
    }

    /// Whether this client holds the image's exclusive lock now (false once another client
    /// broke it and blocklisted this one).
    pub fn owns_exclusive_lock(&self) -> Result<bool, Error> {
        let mut owner: c_int = 0;
        // SAFETY: an open image; out-pointer to a local.
        let rc = unsafe { (self.api.rbd_is_exclusive_lock_owner)(self.image, &mut owner) };
        check(|| format!("lock owner of {}", self.name), rc)?;
        Ok(owner != 0)
    }

    /// The clients holding the image's exclusive lock (at most one), as librbd names them.
    pub fn lock_owners(&self) -> Result<Vec<String>, Error> {
        const OWNERS_MAX: usize = 8;
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; OWNERS_MAX] = [std::ptr::null_mut(); OWNERS_MAX];
        let mut count = OWNERS_MAX;
        // SAFETY: an open image; `owners` has room for `count` pointers, which librbd fills
        // with strings freed by the cleanup call below.
        let rc = unsafe {
            (self.api.rbd_lock_get_owners)(self.image, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if rc == -2 {
            // ENOENT: nobody holds it.
            return Ok(Vec::new());
        }
        check(|| format!("lock owners of {}", self.name), rc)?;
        let count = count.min(OWNERS_MAX);
        let names = owners[..count]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: NUL-terminated strings librbd allocated; read before the cleanup.
            .map(|&p| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        // SAFETY: the array librbd filled, with the count it returned.
        unsafe { (self.api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
        Ok(names)
    }

    /// Breaks `owner`'s exclusive lock: librbd blocklists the owner's client in the cluster
    /// first (`rbd_blocklist_on_break_lock`, on by default), so no write it still has in
    /// flight or sends later can land. The fence of a gateway takeover.
    pub fn break_lock(&self, owner: &str) -> Result<(), Error> {
        let owner_c = cstring("lock owner", owner)?;
        // SAFETY: an open image; RBD_LOCK_MODE_EXCLUSIVE is 0; the string outlives the call.
        let rc = unsafe { (self.api.rbd_lock_break)(self.image, 0, owner_c.as_ptr()) };
        check(|| format!("breaking {owner}'s lock of {}", self.name), rc)
    }

    /// The addresses of the clients watching the image (every client that has it open, as
    /// long as the cluster hears from it: a dead client's watch lasts until the OSD's
    /// `osd_client_watch_timeout`, 30 s by default), in the form [`Image::lock_owners`] uses.
    pub fn watchers(&self) -> Result<Vec<String>, Error> {
        const WATCHERS_MAX: usize = 1024;
        let mut capacity = 16;
        loop {
            let mut list: Vec<Watcher> = (0..capacity)
                .map(|_| Watcher {
                    addr: std::ptr::null_mut(),
                    id: 0,
                    cookie: 0,
                })
                .collect();
            let mut count = capacity;
            // SAFETY: an open image; `list` has room for `count` entries, which librbd fills
            // (strings freed by the cleanup call below) or answers ERANGE with the count needed.
            let rc =
                unsafe { (self.api.rbd_watchers_list)(self.image, list.as_mut_ptr(), &mut count) };
            if rc == -34 && capacity < WATCHERS_MAX {
                capacity = count.clamp(capacity * 2, WATCHERS_MAX);
                continue;
            }
            check(|| format!("watchers of {}", self.name), rc)?;
            let count = count.min(capacity);
            let addresses = list[..count]
                .iter()
                .filter(|w| !w.addr.is_null())
                // SAFETY: NUL-terminated strings librbd allocated; read before the cleanup.
                .map(|w| unsafe { std::ffi::CStr::from_ptr(w.addr) }.to_string_lossy())
                .map(|a| plain_address(&a).to_string())
                .collect();
            // SAFETY: the entries librbd filled, with the count it returned.
            unsafe { (self.api.rbd_watchers_list_cleanup)(list.as_mut_ptr(), count) };
            return Ok(addresses);
        }
    }

    /// The allocated extents of `[offset, offset + len)` as `(offset, len)` runs in order
    /// (`rbd_diff_iterate2` from the image's creation, whole objects where the object map is
    /// on); at most `runs_max` runs, the rest of the range unreported.
    pub fn allocated(
        &self,
        offset: u64,
        len: u64,
        runs_max: usize,
    ) -> Result<Vec<(u64, u64)>, Error> {
        struct Runs {
            runs: Vec<(u64, u64)>,
            max: usize,
        }
        extern "C" fn on_extent(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `Runs` borrowed for the duration of the call below.
            let runs = unsafe { &mut *arg.cast::<Runs>() };
            if exists == 0 {
                return 0;
            }
            if runs.runs.len() >= runs.max {
                // Stop early: enough runs for the caller.
                return -125;
            }
            let len = len as u64;
            match runs.runs.last_mut() {
                Some((start, run)) if *start + *run == off => *run += len,
                _ => runs.runs.push((off, len)),
            }
            0
        }
        let mut runs = Runs {
            runs: Vec::new(),
            max: runs_max.max(1),
        };
        // SAFETY: an open image; NULL snapshot = since creation; the callback's argument is a
        // local that outlives the (synchronous) call.
        let rc = unsafe {
            (self.api.rbd_diff_iterate2)(
                self.image,
                std::ptr::null(),
                offset,
                len,
                1,
                0,
                on_extent,
                (&mut runs as *mut Runs).cast(),
            )
        };
        // ECANCELED: stopped by the callback with all it wanted.
        if rc != -125 {
            check(|| format!("allocation map of {}", self.name), rc)?;
        }
        Ok(runs.runs)
    }

    /// Starts `op`; `buf` is the data to write (CompareAndWrite: compare then write halves),
    /// or room for a read (resized to the read's length). `sink` gets the [`Finished`].
    pub fn submit<T: Send + 'static>(
        &self,
        op: Op,
        mut buf: Vec<u8>,
        tag: T,
        sink: Sink<T>,
    ) -> Result<(), (Error, T, Vec<u8>)> {
        let (what, offset) = match prepare(&op, &mut buf) {
            Ok(named) => named,
            Err(e) => return Err((e, tag, buf)),
        };
        let mut op_box = Box::new(InFlight {
            tag,
            buf,
            sink,
            completion: std::ptr::null_mut(),
            api: self.api,
            mismatch: 0,
            what,
            offset,
        });
        let arg: *mut InFlight<T> = &mut *op_box;
        let mut completion: CompletionT = std::ptr::null_mut();
        // SAFETY: `arg` points at the boxed InFlight, which is leaked below before librbd can
        // call back, and reclaimed here if it never will.
        let rc = unsafe {
            (self.api.rbd_aio_create_completion)(arg.cast(), on_complete::<T>, &mut completion)
        };
        if rc < 0 {
            let op = *op_box;
            return Err((
                Error::Ceph {
                    what: "rbd_aio_create_completion".into(),
                    errno: -rc,
                },
                op.tag,
                op.buf,
            ));
        }
        op_box.completion = completion;
        let ptr = op_box.buf.as_mut_ptr().cast::<c_char>();
        let len = op_box.buf.len();
        let mismatch: *mut u64 = &mut op_box.mismatch;
        let raw = Box::into_raw(op_box);
        // SAFETY: the buffer and the mismatch slot live in the leaked box until the callback
        // frees it (the Vec's heap memory does not move when the box does). The image is open.
        let rc = unsafe { self.start(op, ptr, len, mismatch, completion) };
        if rc < 0 {
            // Refused at submission: librbd will not call back; take everything back.
            // SAFETY: `raw` is the box leaked above and the callback will not run.
            let op = unsafe { Box::from_raw(raw) };
            unsafe { (self.api.rbd_aio_release)(op.completion) };
            let op = *op;
            return Err((
                Error::Ceph {
                    what: format!("{what} at {offset}"),
                    errno: -rc,
                },
                op.tag,
                op.buf,
            ));
        }
        Ok(())
    }

    /// Hands `op` to librbd with its completion.
    ///
    /// # Safety
    /// `ptr` points at `len` bytes and `mismatch` at a u64, both valid until `completion`
    /// fires; `completion` was made for this operation and not used before.
    unsafe fn start(
        &self,
        op: Op,
        ptr: *mut c_char,
        len: usize,
        mismatch: *mut u64,
        completion: CompletionT,
    ) -> c_int {
        let api = self.api;
        match op {
            Op::Read { offset, .. } => (api.rbd_aio_read)(self.image, offset, len, ptr, completion),
            Op::Write { offset } => (api.rbd_aio_write)(self.image, offset, len, ptr, completion),
            Op::Discard { offset, len } => {
                (api.rbd_aio_discard)(self.image, offset, len, completion)
            }
            Op::WriteZeroes { offset, len } => {
                (api.rbd_aio_write_zeroes)(self.image, offset, len, completion, 0, 0)
            }
            Op::Flush => (api.rbd_aio_flush)(self.image, completion),
            Op::CompareAndWrite { offset } => {
                let half = len / 2;
                (api.rbd_aio_compare_and_write)(
                    self.image,
                    offset,
                    half,
                    ptr,
                    ptr.add(half),
                    completion,
                    mismatch,
                    0,
                )
            }
        }
    }

    /// [`Image::submit`] and wait (for tools and tests; the engine never blocks on librbd).
    pub fn run(&self, op: Op, buf: Vec<u8>) -> Finished<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        let sink: Sink<()> = Arc::new(move |f| {
            let _ = tx.send(f);
        });
        match self.submit(op, buf, (), sink) {
            // Bounded even where librbd's own timeouts do not reach (a flush behind writes
            // paused by a full cluster waits forever): the operation is then abandoned to
            // librbd, which still owns its buffer, and reported as timed out.
            Ok(()) => match rx.recv_timeout(RUN_TIMEOUT) {
                Ok(finished) => finished,
                Err(e) => Finished {
                    tag: (),
                    buf: Vec::new(),
                    result: Err(match e {
                        std::sync::mpsc::RecvTimeoutError::Timeout => Error::Ceph {
                            what: format!(
                                "{} gave no answer in {} s",
                                self.name,
                                RUN_TIMEOUT.as_secs()
                            ),
                            errno: 110,
                        },
                        std::sync::mpsc::RecvTimeoutError::Disconnected => {
                            Error::Invalid("librbd dropped a completion".into())
                        }
                    }),
                    mismatch_at: None,
                },
            },
            Err((e, (), buf)) => Finished {
                tag: (),
                buf,
                result: Err(e),
                mismatch_at: None,
            },
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: ours to close; rbd_close waits for the image's in-flight operations (whose
        // callbacks own their buffers), then the pool context goes.
        unsafe {
            (self.api.rbd_close)(self.image);
            (self.api.rados_ioctx_destroy)(self.ioctx);
        }
    }
}

/// A client address without the messenger prefix the watcher list may give it (`v2:`, `v1:`,
/// `any:`): `127.0.0.1:0/3052916102`, as lock owners are named.
pub fn plain_address(address: &str) -> &str {
    let address = address.trim();
    ["v1:", "v2:", "any:"]
        .iter()
        .find_map(|prefix| address.strip_prefix(prefix))
        .unwrap_or(address)
}

/// The errno name of a librbd failure, for messages (`ENOENT` ...).
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        2 => "ENOENT",
        5 => "EIO",
        16 => "EBUSY",
        22 => "EINVAL",
        30 => "EROFS",
        84 => "EILSEQ",
        108 => "ESHUTDOWN",
        110 => "ETIMEDOUT",
        _ => "errno",
    }
}

#[cfg(test)]
mod tests {
    use super::plain_address;

    #[test]
    fn addresses_compare_without_their_messenger_prefix() {
        assert_eq!(
            plain_address("v2:127.0.0.1:0/3052916102"),
            "127.0.0.1:0/3052916102"
        );
        assert_eq!(plain_address("any:10.0.0.5:0/42"), "10.0.0.5:0/42");
        assert_eq!(plain_address("v1:[::1]:0/7"), "[::1]:0/7");
        assert_eq!(plain_address(" 127.0.0.1:0/1 "), "127.0.0.1:0/1");
        assert_eq!(plain_address(""), "");
    }
}
