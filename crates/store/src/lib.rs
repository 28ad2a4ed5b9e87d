// `deny`, not `forbid`: sys.rs (one system call) and aligned.rs (an aligned allocation) hold
// the crate's only unsafe code.
#![deny(unsafe_code)]
//! Block stores behind one trait: RAM (lazily allocated chunks), regular files (sparse or thick)
//! and block devices. Every call is synchronous; the engine decides which thread runs it, and
//! may submit the reads and writes of a direct-I/O store asynchronously itself
//! ([`BlockStore::direct_io`]).

mod aligned;
mod claim;
pub mod clone;
pub mod dir_pool;
pub mod early_ack;
mod file;
#[cfg(any(test, feature = "test-support"))]
pub mod loopdev;
pub mod lvm;
pub mod pool;
mod ram;
pub mod rbd;
mod sys;

pub use aligned::{AlignedBuf, BufPool, PooledBuf, DIRECT_ALIGN_BYTES, POOL_BUFFER_BYTES_MAX};
pub use file::{path_space, Caching, FileStore, Inspection};
pub use ram::{RamStore, RAM_PAGE_BYTES};
pub use rbd::{errno_of, RbdSpec, RbdStore};

use std::io;
use std::ops::Range;
use std::sync::Arc;

/// Store memory lent to a reader instead of copied (zero-copy reads): the owner stays alive, and
/// unchanged, for as long as the slice is held. Built from std types only, so a transport can
/// name the same type without depending on this crate.
pub type SharedSlice = (Arc<dyn AsRef<[u8]> + Send + Sync>, Range<usize>);

/// A byte range of a store's backing file, `(file, offset, len)`, whose pages were all in the
/// page cache when it was lent: a transport sends it straight from the cache (`sendfile`), the
/// copy out of the cache and the buffer it would fill both skipped. std types only, like
/// [`SharedSlice`].
pub type FileRange = (Arc<std::fs::File>, u64, usize);

/// A run of bytes that are all mapped or all deallocated (for GET LBA STATUS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub mapped: bool,
    pub len: u64,
}

/// What a store can do, as the store states it: the engine plans from this (which thread runs
/// a command, whether a read may lend), never from the store's kind or path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Reads and durable writes may wait for a device (a disk behind the page cache), so they
    /// must not run on a network worker. False for memory: RAM, and files on tmpfs/ramfs.
    pub waits_for_device: bool,
    /// Reads can lend the store's own memory ([`BlockStore::read_shared`]).
    pub lends_memory: bool,
    /// Reads can lend page-cached ranges of a backing file ([`BlockStore::cached_file_range`]).
    pub lends_file_ranges: bool,
    /// I/O passes through the page cache (a direct-I/O store would say false).
    pub page_cache: bool,
    /// Reads and writes bypass the page cache (O_DIRECT): [`BlockStore::direct_io`] gives the
    /// descriptor for asynchronous submission.
    pub direct: bool,
    /// The store performs reads, writes and flushes asynchronously itself
    /// ([`BlockStore::submit`], e.g. librbd): a transport submits them and is called back.
    pub asynchronous: bool,
    /// Discard deallocates: UNMAP and WRITE SAME with UNMAP release space.
    pub thin: bool,
}

/// A direct-I/O store's descriptor (opened O_DIRECT) and the alignment its offsets, lengths
/// and buffers need. Byte `n` of the store is byte `n` of the file. std types only, like
/// [`SharedSlice`].
#[derive(Clone, Debug)]
pub struct DirectIo {
    pub file: Arc<std::fs::File>,
    /// O_DIRECT's alignment for offsets and lengths on this file (a power of two, at most
    /// [`DIRECT_ALIGN_BYTES`] on every device we know; buffers are page-aligned anyway).
    pub alignment: u32,
}

/// A read, write or flush a store performs asynchronously ([`BlockStore::submit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncIo {
    /// Read `len` bytes at `offset` into the buffer (resized to `len`).
    Read { offset: u64, len: usize },
    /// Write the whole buffer at `offset`; `durable`: on stable storage before completion.
    Write { offset: u64, durable: bool },
    /// Make everything completed so far durable.
    Flush,
}

/// Writes a store answered before its medium had them (a write-back cache), in flight now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteBack {
    pub bytes: u64,
    pub writes: u64,
}

/// Called exactly once when an asynchronous I/O ends, on whatever thread the store completes
/// on, with the buffer back (a read's data) and the outcome.
pub type AsyncDone = Box<dyn FnOnce(Vec<u8>, io::Result<()>) + Send>;

/// The space a store allocates from: its size and what of it is in use (by anyone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    pub total_bytes: u64,
    pub used_bytes: u64,
}

impl Space {
    /// The share in use, in whole percent (0 for an empty space).
    pub fn used_percent(&self) -> u64 {
        self.used_in(100)
    }

    /// The share in use, in whole thousandths (0 for an empty space): the same thousandths
    /// are the same whole percent.
    pub fn used_per_mille(&self) -> u64 {
        self.used_in(1000)
    }

    fn used_in(&self, parts: u64) -> u64 {
        let used = u128::from(self.used_bytes.min(self.total_bytes)) * u128::from(parts);
        used.checked_div(u128::from(self.total_bytes))
            .map_or(0, |share| share as u64)
    }
}

pub trait BlockStore: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    /// What this store can do (see [`Capabilities`]); fixed for the store's life.
    fn capabilities(&self) -> Capabilities;
    /// The O_DIRECT descriptor of a direct-I/O store, for an engine that submits reads, writes
    /// and flushes itself (io_uring); None for other stores.
    fn direct_io(&self) -> Option<DirectIo> {
        None
    }
    /// Starts `io` and returns; `done` gets the buffer back with the outcome. Stores that say
    /// [`Capabilities::asynchronous`] complete on their own threads; the rest run it here,
    /// synchronously (so every store takes the call).
    fn submit(&self, io: AsyncIo, mut buf: Vec<u8>, done: AsyncDone) {
        let result = match io {
            AsyncIo::Read { offset, len } => {
                buf.resize(len, 0);
                self.read_at(&mut buf, offset)
            }
            AsyncIo::Write { offset, durable } => self.write_at(&buf, offset, durable),
            AsyncIo::Flush => self.flush(),
        };
        done(buf, result)
    }
    /// Fills `buf` entirely; unwritten or discarded ranges read as zeros.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Zero-copy read: appends slices of the store's own memory covering `[offset, offset+len)`
    /// in order and returns true; false (nothing appended) if this store cannot lend memory.
    fn read_shared(&self, offset: u64, len: u64, out: &mut Vec<SharedSlice>) -> io::Result<bool> {
        let _ = (offset, len, out);
        Ok(false)
    }
    /// Zero-copy read from the page cache: the backing file's range for `[offset, offset+len)`
    /// when every page of it is cached, so sending it never waits for the device; `None` when
    /// some page is not (or the kernel cannot tell), and for stores without a backing file.
    fn cached_file_range(&self, offset: u64, len: u64) -> io::Result<Option<FileRange>> {
        let _ = (offset, len);
        Ok(None)
    }
    /// Like `read_at`, but returns false instead of waiting for the device (data not cached).
    /// `buf` may then be partly filled. Stores that never wait just read.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        self.read_at(buf, offset).map(|()| true)
    }
    /// `durable`: the bytes are on stable storage before this returns (FUA / write-through).
    fn write_at(&self, buf: &[u8], offset: u64, durable: bool) -> io::Result<()>;
    /// Like `write_at` (not durable), but returns false instead of waiting for the kernel
    /// (writeback of the same file, dirty-page throttling, a lock): part of `buf` may then be
    /// written already, so the caller must write all of it again elsewhere. Stores that cannot
    /// ask just write.
    fn try_write_at(&self, buf: &[u8], offset: u64) -> io::Result<bool> {
        self.write_at(buf, offset, false).map(|()| true)
    }
    /// Everything written so far becomes durable.
    fn flush(&self) -> io::Result<()>;
    /// What this store answered early and still owes its medium; None for stores that never
    /// answer a write before their medium has it (whose writes then sit in the page cache or
    /// memory, not in a queue of their own).
    fn write_back(&self) -> Option<WriteBack> {
        None
    }
    /// The daemon is leaving: release what others may wait for (an RBD image's exclusive
    /// lock). Commands after it fail.
    fn close(&self) {}
    /// Deallocate; the range reads back as zeros afterwards.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()>;
    /// The mapped or deallocated extent starting at `offset` (clipped to the store's end).
    fn mapping(&self, offset: u64) -> io::Result<Extent>;
    fn is_thin(&self) -> bool;
    /// How large the medium behind the store is now (a file or device may have grown under
    /// it); None for stores whose medium is their own (RAM).
    /// The file behind this store, for copies the kernel makes between two stores
    /// ([`clone::copy_range`]); None for stores that are not a regular file.
    fn copy_file(&self) -> Option<&std::fs::File> {
        None
    }
    /// This store as a RAM store, for copies that share its pages ([`RamStore::share_from`]);
    /// None for every other store.
    fn ram(&self) -> Option<&RamStore> {
        None
    }
    fn medium_bytes(&self) -> io::Result<Option<u64>> {
        Ok(None)
    }
    /// How full the space the store allocates its blocks from is (a file's filesystem); None
    /// for stores that allocate nothing as they are written (RAM, a block device).
    fn space(&self) -> io::Result<Option<Space>> {
        Ok(None)
    }
    /// Grows the store to `new_bytes` (a live resize); stores that cannot say `Unsupported`.
    fn resize(&self, new_bytes: u64) -> io::Result<()> {
        let _ = new_bytes;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this store cannot be resized while it runs",
        ))
    }
}

/// The bytes from `offset` to the end of a store of `size` bytes (for `mapping`): an error
/// unless `offset` names a byte of it.
pub(crate) fn bytes_to_end(size: u64, offset: u64) -> io::Result<u64> {
    if offset >= size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("offset {offset} outside store of {size} bytes"),
        ));
    }
    Ok(size - offset)
}

/// Checks that `[offset, offset + len)` lies inside a store of `size` bytes.
pub(crate) fn check_range(size: u64, offset: u64, len: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("range {offset}+{len} outside store of {size} bytes"),
        )),
    }
}
