#![forbid(unsafe_code)]
//! Block stores behind one trait: RAM (lazily allocated chunks), regular files (sparse or thick)
//! and block devices. Every call is synchronous; the engine decides which thread runs it.

mod file;
mod ram;

pub use file::FileStore;
pub use ram::RamStore;

use std::io;

/// A run of bytes that are all mapped or all deallocated (for GET LBA STATUS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub mapped: bool,
    pub len: u64,
}

pub trait BlockStore: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    /// Fills `buf` entirely; unwritten or discarded ranges read as zeros.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// `durable`: the bytes are on stable storage before this returns (FUA / write-through).
    fn write_at(&self, buf: &[u8], offset: u64, durable: bool) -> io::Result<()>;
    /// Everything written so far becomes durable.
    fn flush(&self) -> io::Result<()>;
    /// Deallocate; the range reads back as zeros afterwards.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()>;
    /// The mapped or deallocated extent starting at `offset` (clipped to the store's end).
    fn mapping(&self, offset: u64) -> io::Result<Extent>;
    fn is_thin(&self) -> bool;
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
