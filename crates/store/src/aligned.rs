//! Page-aligned, zero-initialised byte buffers for direct I/O: O_DIRECT wants the memory, the
//! offset and the length aligned to the device's logical block size, and a page (4 KiB)
//! satisfies every logical block size Linux supports. The crate's second piece of `unsafe`:
//! `Vec<u8>` cannot promise an alignment, and std has no aligned buffer type.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// The alignment of every buffer: one page, at least any device's logical block size.
pub const DIRECT_ALIGN_BYTES: usize = 4096;

/// A heap buffer of `len` bytes starting on a [`DIRECT_ALIGN_BYTES`] boundary, zeroed when
/// made. Its address never changes, so the kernel may fill or read it while it is owned by an
/// I/O in flight.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); shared access gives out
// only `&[u8]`, so sending or sharing it between threads is as safe as for a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send: `&AlignedBuf` only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; its capacity is `len` rounded up to whole pages (at least
    /// one). None when the size cannot be laid out or the allocator fails.
    pub fn zeroed(len: usize) -> Option<AlignedBuf> {
        let capacity = len.max(1).checked_next_multiple_of(DIRECT_ALIGN_BYTES)?;
        let layout = Layout::from_size_align(capacity, DIRECT_ALIGN_BYTES).ok()?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len, capacity })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length for reuse; at most the capacity. The bytes keep what they held.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "{len} > capacity {}", self.capacity);
        self.len = len;
    }

    /// The buffer's address, for a system call that fills or reads it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this size and alignment (checked there).
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.capacity, DIRECT_ALIGN_BYTES),
            )
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity` bytes are allocated, initialised (zeroed at allocation,
        // written only through `&mut [u8]` or by the kernel since) and owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_whole_pages() {
        for len in [0, 1, 511, 512, 4096, 4097, 1 << 20] {
            let mut buf = AlignedBuf::zeroed(len).unwrap();
            assert_eq!(buf.as_mut_ptr() as usize % DIRECT_ALIGN_BYTES, 0, "{len}");
            assert_eq!(buf.len(), len);
            assert!(buf.capacity() >= len.max(1));
            assert_eq!(buf.capacity() % DIRECT_ALIGN_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
            buf.iter_mut().for_each(|b| *b = 0xA5);
            assert!(buf.iter().all(|&b| b == 0xA5));
        }
    }

    #[test]
    fn set_len_reuses_up_to_the_capacity() {
        let mut buf = AlignedBuf::zeroed(100).unwrap();
        buf.set_len(4096);
        assert_eq!(buf.len(), 4096);
        buf.set_len(0);
        assert!(buf.is_empty());
    }

    #[test]
    #[should_panic]
    fn set_len_beyond_the_capacity_is_a_bug() {
        AlignedBuf::zeroed(10).unwrap().set_len(8192);
    }

    #[test]
    fn impossible_sizes_are_refused_not_allocated() {
        assert!(AlignedBuf::zeroed(usize::MAX).is_none());
    }
}
