//! Page-aligned, zero-initialised byte buffers for direct I/O: O_DIRECT wants the memory, the
//! offset and the length aligned to the device's logical block size, and a page (4 KiB)
//! satisfies every logical block size Linux supports. The crate's second piece of `unsafe`:
//! `Vec<u8>` cannot promise an alignment, and std has no aligned buffer type.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// The alignment of every buffer: one page, at least any device's logical block size.
pub const DIRECT_ALIGN_BYTES: usize = 4096;

/// A heap buffer of `len` bytes starting on a [`DIRECT_ALIGN_BYTES`] boundary, zeroed when
/// made. Its address never changes, so the kernel may fill or read it while it is owned by an
/// I/O in flight.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    /// The huge-page region the buffer lies in ([`huge_buffers`]), None for a heap block.
    region: Option<Arc<memmap2::MmapMut>>,
}

// SAFETY: AlignedBuf owns its bytes exclusively (like Vec<u8>; buffers sharing a huge-page region
// own disjoint ranges of it, and the region lives while any of them does); shared access gives out
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
        Some(AlignedBuf {
            ptr,
            len,
            capacity,
            region: None,
        })
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
        if self.region.is_some() {
            return; // the region is unmapped with its last buffer
        }
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

/// The size of a huge page (x86-64, arm64 with 4 KiB pages): pooled buffers of
/// [`HUGE_BUFFER_MIN`] bytes and more lie in regions of whole huge pages.
const HUGE_PAGE_BYTES: usize = 2 << 20;
/// Pooled buffers from this size on are made in huge-page regions. A direct I/O pins its
/// buffer's pages for each transfer: for 1 MiB that is 256 pages, or a share of one huge page
/// (docs/PERFORMANCE.md, *Large I/O and the device path*).
const HUGE_BUFFER_MIN: usize = 1 << 20;

/// Buffers of `capacity` bytes (a power of two from [`HUGE_BUFFER_MIN`]) in one fresh mapping
/// of whole huge pages, aligned to one and advised to use them (`MADV_HUGEPAGE`; a kernel
/// without transparent huge pages maps small ones): two 1 MiB buffers share a huge page,
/// larger ones have a region each. Zeroed (fresh anonymous memory). None when mapping fails.
fn huge_buffers(capacity: usize) -> Option<Vec<AlignedBuf>> {
    debug_assert!(capacity.is_power_of_two() && capacity >= HUGE_BUFFER_MIN);
    let size = capacity.max(HUGE_PAGE_BYTES);
    // A huge page's worth more than needed, so that an aligned range of `size` lies inside.
    let mut map = memmap2::MmapMut::map_anon(size.checked_add(HUGE_PAGE_BYTES)?).ok()?;
    let start = map.as_mut_ptr() as usize;
    let offset = start.next_multiple_of(HUGE_PAGE_BYTES) - start;
    // Only advice: without it the buffers work the same on small pages. The whole mapping, so
    // that it stays one mapping (the unaligned edges are never touched, so never resident).
    let _ = map.advise(memmap2::Advice::HugePage);
    let base = map.as_mut_ptr().wrapping_add(offset);
    let region = Arc::new(map);
    let buffers = (0..size / capacity).map(|i| {
        Some(AlignedBuf {
            ptr: NonNull::new(base.wrapping_add(i * capacity))?,
            len: capacity,
            capacity,
            region: Some(Arc::clone(&region)),
        })
    });
    buffers.collect()
}

/// Pooled buffers hold at most this many bytes each; a larger request gets a buffer of its
/// own, freed after use. Covers the largest I/O the engine makes on the ring (16 MiB).
pub const POOL_BUFFER_BYTES_MAX: usize = 16 << 20;
/// Size classes: powers of two from one page to [`POOL_BUFFER_BYTES_MAX`].
const POOL_CLASSES: usize =
    (POOL_BUFFER_BYTES_MAX.trailing_zeros() - DIRECT_ALIGN_BYTES.trailing_zeros()) as usize + 1;

/// A bounded free list of [`AlignedBuf`]s, one per power-of-two size class, so a direct I/O
/// reuses a buffer whose pages are already mapped instead of allocating and zeroing a fresh one
/// (for 1 MiB, 256 page faults and a 1 MiB memset: a third of the target's CPU per write,
/// measured with `perf`). Idle buffers beyond `idle_bytes_max` are freed, never kept.
///
/// A reused buffer holds the bytes of its last I/O: callers fill it whole before it reaches a
/// device or a wire (a write copies its data over it; a read that comes back short fails).
#[derive(Clone)]
pub struct BufPool {
    shared: Arc<PoolShared>,
}

struct PoolShared {
    idle: Mutex<PoolIdle>,
    idle_bytes_max: usize,
}

struct PoolIdle {
    classes: [Vec<AlignedBuf>; POOL_CLASSES],
    bytes: usize,
}

impl BufPool {
    /// A pool keeping at most `idle_bytes_max` bytes of idle buffers.
    pub fn new(idle_bytes_max: usize) -> BufPool {
        BufPool {
            shared: Arc::new(PoolShared {
                idle: Mutex::new(PoolIdle {
                    classes: std::array::from_fn(|_| Vec::new()),
                    bytes: 0,
                }),
                idle_bytes_max,
            }),
        }
    }

    /// A buffer of `len` bytes: an idle one of its size class (contents left over from its
    /// last use), else a new zeroed one. None when the allocator fails.
    pub fn take(&self, len: usize) -> Option<PooledBuf> {
        let Some(class) = size_class(len) else {
            return AlignedBuf::zeroed(len).map(PooledBuf::unpooled);
        };
        let reused = {
            let mut idle = self.shared.lock();
            let buf = idle.classes[class].pop();
            idle.bytes -= buf.as_ref().map_or(0, |b| b.capacity());
            buf
        };
        let mut buf = match reused {
            Some(buf) => buf,
            None => self.made(DIRECT_ALIGN_BYTES << class)?,
        };
        buf.set_len(len);
        Some(PooledBuf {
            buf: ManuallyDrop::new(buf),
            home: Some(Arc::clone(&self.shared)),
        })
    }

    /// A new buffer of `capacity` bytes; made with siblings in a huge-page region, the
    /// siblings go to the idle list (or are dropped past its limit: their memory then waits
    /// for the region's last buffer).
    fn made(&self, capacity: usize) -> Option<AlignedBuf> {
        if capacity < HUGE_BUFFER_MIN {
            return AlignedBuf::zeroed(capacity);
        }
        let mut buffers =
            huge_buffers(capacity).or_else(|| AlignedBuf::zeroed(capacity).map(|b| vec![b]))?;
        let buf = buffers.pop()?;
        for sibling in buffers {
            self.shared.give_back(sibling);
        }
        Some(buf)
    }

    /// Bytes held by idle buffers now.
    pub fn idle_bytes(&self) -> usize {
        self.shared.lock().bytes
    }
}

impl PoolShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolIdle> {
        // A panic while holding the lock leaves only a list of buffers behind: still usable.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn give_back(&self, buf: AlignedBuf) {
        let Some(class) = size_class(buf.capacity()) else {
            return;
        };
        if DIRECT_ALIGN_BYTES << class != buf.capacity() {
            return; // not one of ours
        }
        let mut idle = self.lock();
        if idle.bytes + buf.capacity() <= self.idle_bytes_max {
            idle.bytes += buf.capacity();
            idle.classes[class].push(buf);
        }
    }
}

/// The size class of a `len`-byte request, None above [`POOL_BUFFER_BYTES_MAX`].
fn size_class(len: usize) -> Option<usize> {
    if len > POOL_BUFFER_BYTES_MAX {
        return None;
    }
    let pages = len.max(1).div_ceil(DIRECT_ALIGN_BYTES).next_power_of_two();
    Some(pages.trailing_zeros() as usize)
}

/// An [`AlignedBuf`] that goes back to its [`BufPool`] when dropped (from any thread).
pub struct PooledBuf {
    buf: ManuallyDrop<AlignedBuf>,
    home: Option<Arc<PoolShared>>,
}

impl PooledBuf {
    /// A buffer that belongs to no pool: dropping it frees it.
    pub fn unpooled(buf: AlignedBuf) -> PooledBuf {
        PooledBuf {
            buf: ManuallyDrop::new(buf),
            home: None,
        }
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken exactly once, here, and never used afterwards.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        if let Some(home) = self.home.take() {
            home.give_back(buf);
        }
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        &self.buf
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        &mut self.buf
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuf")
            .field("len", &self.buf.len())
            .field("capacity", &self.buf.capacity())
            .field("pooled", &self.home.is_some())
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
    fn a_huge_page_holds_two_1_mib_buffers_each_its_own() {
        let pool = BufPool::new(64 << 20);
        let mut a = pool.take(1 << 20).unwrap();
        // Its sibling waits in the pool, and is what the next take gets.
        assert_eq!(pool.idle_bytes(), 1 << 20);
        let mut b = pool.take(1 << 20).unwrap();
        assert_eq!(pool.idle_bytes(), 0);
        let (pa, pb) = (a.as_mut_ptr() as usize, b.as_mut_ptr() as usize);
        assert_eq!(
            pa.min(pb) % HUGE_PAGE_BYTES,
            0,
            "the pair starts a huge page"
        );
        assert_eq!(pa.abs_diff(pb), 1 << 20);
        assert!(a.iter().chain(b.iter()).all(|&x| x == 0), "made zeroed");
        a.iter_mut().for_each(|x| *x = 0xA5);
        assert!(
            b.iter().all(|&x| x == 0),
            "writing one leaves the other alone"
        );
        drop(a);
        // The region outlives the buffer dropped first.
        b.iter_mut().for_each(|x| *x = 0x5A);
        assert!(b.iter().all(|&x| x == 0x5A));
        drop(b);
        assert_eq!(pool.idle_bytes(), 2 << 20);
    }

    #[test]
    fn larger_buffers_have_a_region_each_and_siblings_past_the_limit_are_dropped() {
        let pool = BufPool::new(0);
        let mut big = pool.take(3 << 20).unwrap();
        assert_eq!(big.capacity(), 4 << 20);
        assert_eq!(big.as_mut_ptr() as usize % HUGE_PAGE_BYTES, 0);
        // No room for the sibling: dropped at once, its half kept mapped for this one.
        let mut one = pool.take(1 << 20).unwrap();
        assert_eq!(pool.idle_bytes(), 0);
        one.iter_mut().for_each(|x| *x = 1);
        big.iter_mut().for_each(|x| *x = 2);
        assert!(one.iter().all(|&x| x == 1) && big.iter().all(|&x| x == 2));
        // Smaller classes stay heap blocks.
        assert!(pool.take(512 << 10).unwrap().region.is_none());
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

    #[test]
    fn size_classes_are_powers_of_two_pages() {
        assert_eq!(size_class(0), Some(0));
        assert_eq!(size_class(1), Some(0));
        assert_eq!(size_class(4096), Some(0));
        assert_eq!(size_class(4097), Some(1));
        assert_eq!(size_class(1 << 20), Some(8));
        assert_eq!(size_class((1 << 20) + 1), Some(9));
        assert_eq!(size_class(POOL_BUFFER_BYTES_MAX), Some(POOL_CLASSES - 1));
        assert_eq!(size_class(POOL_BUFFER_BYTES_MAX + 1), None);
    }

    #[test]
    fn pooled_buffers_come_back_and_are_reused() {
        let pool = BufPool::new(4 << 20);
        let mut a = pool.take(3000).unwrap();
        assert_eq!(a.len(), 3000);
        assert_eq!(a.capacity(), 4096);
        assert!(a.iter().all(|&b| b == 0), "a new buffer is zeroed");
        a.fill(7);
        let addr = a.as_mut_ptr() as usize;
        drop(a);
        assert_eq!(pool.idle_bytes(), 4096);
        let mut b = pool.take(4096).unwrap();
        assert_eq!(b.as_mut_ptr() as usize, addr, "the idle buffer is reused");
        assert_eq!(b.len(), 4096);
        assert_eq!(pool.idle_bytes(), 0);
        // A different class does not take it.
        let c = pool.take(8192).unwrap();
        assert_eq!(c.capacity(), 8192);
        drop((b, c));
        assert_eq!(pool.idle_bytes(), 4096 + 8192);
    }

    #[test]
    fn idle_bytes_stay_within_the_bound() {
        let pool = BufPool::new(1 << 20);
        let bufs: Vec<_> = (0..3).map(|_| pool.take(512 << 10).unwrap()).collect();
        drop(bufs);
        assert_eq!(pool.idle_bytes(), 1 << 20, "the third buffer was freed");
        let big = pool.take(POOL_BUFFER_BYTES_MAX + 1).unwrap();
        assert_eq!(big.len(), POOL_BUFFER_BYTES_MAX + 1);
        drop(big);
        assert_eq!(
            pool.idle_bytes(),
            1 << 20,
            "oversized buffers are never pooled"
        );
    }

    #[test]
    fn buffers_return_from_other_threads() {
        let pool = BufPool::new(1 << 20);
        let buf = pool.take(4096).unwrap();
        std::thread::spawn(move || drop(buf)).join().unwrap();
        assert_eq!(pool.idle_bytes(), 4096);
        let unpooled = PooledBuf::unpooled(AlignedBuf::zeroed(4096).unwrap());
        drop(unpooled);
        assert_eq!(pool.idle_bytes(), 4096);
    }
}
