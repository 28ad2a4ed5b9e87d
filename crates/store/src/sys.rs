//! The two system calls the stores need that no maintained crate wraps: `cachestat(2)` (Linux
//! 6.5+; `rustix` lists it as not yet implemented, `libc` has no wrapper) and the `BLKDISCARD`
//! ioctl (rustix wraps a few block ioctls, not this one). The only `unsafe` of the crate.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `__NR_cachestat`: the same number on every Linux architecture Rust supports (new system
/// calls share one table since 5.x); the `libc` crate does not define it for x86_64 glibc yet.
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range` (include/uapi/linux/mman.h).
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` (include/uapi/linux/mman.h).
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// How many pages of `[offset, offset + len)` of `file` are in the page cache (`len` > 0).
pub fn cached_pages(file: &File, offset: u64, len: u64) -> io::Result<u64> {
    let range = CachestatRange { off: offset, len };
    let mut stat = Cachestat::default();
    let fd = libc::c_long::from(file.as_raw_fd());
    // SAFETY: cachestat(2) reads one cachestat_range and writes one cachestat through the two
    // pointers, which point to live, correctly laid out (repr(C)) values for the whole call;
    // the descriptor is open (borrowed from `file`) and flags is 0, the only defined value.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd,
            std::ptr::from_ref(&range),
            std::ptr::from_mut(&mut stat),
            0 as libc::c_long,
        )
    };
    if rc == 0 {
        Ok(stat.nr_cache)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `BLKDISCARD`, `_IO(0x12, 119)` (include/uapi/linux/fs.h).
const BLKDISCARD: libc::c_ulong = 0x1277;

/// Discards `[offset, offset + len)` of block device `file` (offset and len aligned to its
/// logical block size): the device may unmap the blocks; what they read afterwards is the
/// device's business (zeros for an LVM thin LV's whole chunks).
pub fn discard(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 (start, length) through the pointer, which points to a
    // live array of exactly that for the whole call; the descriptor is open (borrowed from
    // `file`).
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, range.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn written_pages_are_cached_and_holes_are_not() {
        let path = std::env::temp_dir().join(format!("ferrosan-cachestat-{}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 64 * 1024]).unwrap();
        f.set_len(1 << 20).unwrap();
        let page = rustix::param::page_size() as u64;
        let result = cached_pages(&f, 0, 64 * 1024);
        let hole = cached_pages(&f, 512 * 1024, 64 * 1024);
        std::fs::remove_file(&path).unwrap();
        match result {
            // Kernels before 6.5, or a sandbox that forbids the call: the store stops asking.
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {}
            other => {
                assert_eq!(other.unwrap(), 64 * 1024 / page);
                assert_eq!(hole.unwrap(), 0);
            }
        }
    }
}
