//! RAM store: memory is allocated per 4 KiB page on first write, so a large thin LUN costs only
//! what was written. Pages are reference-counted so a read can lend them to the transport instead
//! of copying (zero-copy Data-In): a write to a page that is still lent copies it first
//! (copy-on-write), so a lent page never changes under the reader. Pages are grouped in 1 MiB
//! chunks, each with its own lock, so workers touching different chunks never contend and one
//! lock covers a whole large I/O.

use crate::{check_range, BlockStore, Extent, SharedSlice};
use std::io;
use std::sync::{Arc, RwLock};

/// Copy-on-write and thin-provisioning granularity.
pub const RAM_PAGE_BYTES: usize = 4096;
/// Pages per lock.
pub const RAM_CHUNK_BYTES: u64 = 1 << 20;
const PAGES_PER_CHUNK: usize = (RAM_CHUNK_BYTES as usize) / RAM_PAGE_BYTES;

#[derive(Clone)]
struct Page([u8; RAM_PAGE_BYTES]);

impl AsRef<[u8]> for Page {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A chunk's pages; `None` until the chunk's first write. A `None` page reads as zeros.
type Chunk = Option<Box<[Option<Arc<Page>>]>>;

pub struct RamStore {
    size_bytes: u64,
    chunks: Vec<RwLock<Chunk>>,
    /// Lent for reads of unwritten pages.
    zero_page: Arc<Page>,
}

impl RamStore {
    pub fn new(size_bytes: u64) -> Self {
        let count = size_bytes.div_ceil(RAM_CHUNK_BYTES);
        let count = usize::try_from(count).expect("RAM store size exceeds the address space");
        let mut chunks = Vec::with_capacity(count);
        chunks.resize_with(count, || RwLock::new(None));
        RamStore {
            size_bytes,
            chunks,
            zero_page: Arc::new(Page([0; RAM_PAGE_BYTES])),
        }
    }

    /// Calls `f(chunk_index, offset_in_chunk, position_in_range, len)` for each chunk's share of
    /// `[offset, offset + len)`, so each chunk's lock is taken once per I/O.
    fn for_each_chunk(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(usize, usize, usize, usize) -> io::Result<()>,
    ) -> io::Result<()> {
        check_range(self.size_bytes, offset, len)?;
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let index = (at / RAM_CHUNK_BYTES) as usize;
            let within = (at % RAM_CHUNK_BYTES) as usize;
            let piece = (len - done).min(RAM_CHUNK_BYTES - within as u64) as usize;
            f(index, within, done as usize, piece)?;
            done += piece as u64;
        }
        Ok(())
    }

    /// Zeroes a range; whole pages are freed (they read as zeros), partial ones are cleared.
    fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        self.for_each_chunk(offset, len, |index, within, _, len| {
            let mut chunk = self.chunks[index].write().map_err(|_| poisoned())?;
            let Some(pages) = chunk.as_mut() else {
                return Ok(());
            };
            for_each_page(within, len, |page, in_page, _, piece| {
                if piece == RAM_PAGE_BYTES {
                    pages[page] = None;
                } else if let Some(p) = pages[page].as_mut() {
                    Arc::make_mut(p).0[in_page..in_page + piece].fill(0);
                }
            });
            Ok(())
        })?;
        // Chunks left with no page at all are freed too.
        let first = (offset / RAM_CHUNK_BYTES) as usize;
        let last = (offset + len).div_ceil(RAM_CHUNK_BYTES) as usize;
        for lock in &self.chunks[first..last.min(self.chunks.len())] {
            let mut chunk = lock.write().map_err(|_| poisoned())?;
            if chunk
                .as_ref()
                .is_some_and(|p| p.iter().all(Option::is_none))
            {
                *chunk = None;
            }
        }
        Ok(())
    }
}

impl RamStore {
    /// Copies `len` bytes at `src_off` of `from` to `dst_off` of this store, sharing whole
    /// pages instead of copying them: a shared page is copied only when either side writes it
    /// (as for a lent page), and an unwritten page stays unwritten. False, with nothing done,
    /// when the two offsets do not lie alike within a page, or when the destination overlaps
    /// the source above it (a forward copy would read what it wrote): the caller copies the
    /// bytes, from the end.
    pub fn share_from(
        &self,
        from: &RamStore,
        src_off: u64,
        dst_off: u64,
        len: u64,
    ) -> io::Result<bool> {
        let page = RAM_PAGE_BYTES as u64;
        check_range(from.size_bytes, src_off, len)?;
        check_range(self.size_bytes, dst_off, len)?;
        let upwards = std::ptr::eq(self, from) && dst_off > src_off && dst_off < src_off + len;
        if src_off % page != dst_off % page || upwards {
            return Ok(false);
        }
        // A partial first and last page are copied; the pages between are shared.
        let head = ((page - dst_off % page) % page).min(len);
        let body = (len - head) / page * page;
        let tail = len - head - body;
        let mut buf = vec![0; head.max(tail) as usize];
        let mut copy = |at: u64, n: u64| -> io::Result<()> {
            let buf = &mut buf[..n as usize];
            from.read_at(buf, src_off + at)?;
            self.write_at(buf, dst_off + at, false)
        };
        copy(0, head)?;
        let mut done = 0;
        while done < body {
            // A chunk's worth at a time: the source pages are taken under its lock, which is
            // let go before the destination's is taken (the two may be one store).
            let (src, dst) = (src_off + head + done, dst_off + head + done);
            let n = (body - done)
                .min(RAM_CHUNK_BYTES - src % RAM_CHUNK_BYTES)
                .min(RAM_CHUNK_BYTES - dst % RAM_CHUNK_BYTES);
            let pages = from.pages(src, n)?;
            self.put_pages(dst, &pages)?;
            done += n;
        }
        copy(head + body, tail)?;
        Ok(true)
    }

    /// The pages of a page-aligned range within one chunk (None: unwritten).
    fn pages(&self, offset: u64, len: u64) -> io::Result<Vec<Option<Arc<Page>>>> {
        let chunk = self.chunks[(offset / RAM_CHUNK_BYTES) as usize]
            .read()
            .map_err(|_| poisoned())?;
        let first = (offset % RAM_CHUNK_BYTES) as usize / RAM_PAGE_BYTES;
        let count = len as usize / RAM_PAGE_BYTES;
        Ok(match chunk.as_deref() {
            Some(pages) => pages[first..first + count].to_vec(),
            None => vec![None; count],
        })
    }

    /// Puts `pages` at a page-aligned offset, within one chunk.
    fn put_pages(&self, offset: u64, pages: &[Option<Arc<Page>>]) -> io::Result<()> {
        let mut chunk = self.chunks[(offset / RAM_CHUNK_BYTES) as usize]
            .write()
            .map_err(|_| poisoned())?;
        if chunk.is_none() && pages.iter().all(Option::is_none) {
            return Ok(());
        }
        let first = (offset % RAM_CHUNK_BYTES) as usize / RAM_PAGE_BYTES;
        let slots = chunk.get_or_insert_with(|| vec![None; PAGES_PER_CHUNK].into());
        slots[first..first + pages.len()].clone_from_slice(pages);
        Ok(())
    }
}

/// Calls `f(page_index, offset_in_page, position_in_piece, len)` for each page of a chunk piece.
fn for_each_page(within: usize, len: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut done = 0;
    while done < len {
        let at = within + done;
        let in_page = at % RAM_PAGE_BYTES;
        let piece = (len - done).min(RAM_PAGE_BYTES - in_page);
        f(at / RAM_PAGE_BYTES, in_page, done, piece);
        done += piece;
    }
}

fn poisoned() -> io::Error {
    io::Error::other("RAM store chunk lock poisoned")
}

impl BlockStore for RamStore {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn ram(&self) -> Option<&RamStore> {
        Some(self)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.for_each_chunk(offset, buf.len() as u64, |index, within, pos, len| {
            let chunk = self.chunks[index].read().map_err(|_| poisoned())?;
            let out = &mut buf[pos..pos + len];
            let Some(pages) = chunk.as_ref() else {
                out.fill(0);
                return Ok(());
            };
            for_each_page(within, len, |page, in_page, at, piece| {
                let out = &mut out[at..at + piece];
                match pages[page].as_ref() {
                    Some(p) => out.copy_from_slice(&p.0[in_page..in_page + piece]),
                    None => out.fill(0),
                }
            });
            Ok(())
        })
    }

    fn read_shared(&self, offset: u64, len: u64, out: &mut Vec<SharedSlice>) -> io::Result<bool> {
        self.for_each_chunk(offset, len, |index, within, _, len| {
            let chunk = self.chunks[index].read().map_err(|_| poisoned())?;
            let pages = chunk.as_deref().unwrap_or(&[]);
            for_each_page(within, len, |page, in_page, _, piece| {
                let lent = pages
                    .get(page)
                    .and_then(Option::as_ref)
                    .unwrap_or(&self.zero_page);
                let lent: Arc<dyn AsRef<[u8]> + Send + Sync> = lent.clone();
                out.push((lent, in_page..in_page + piece));
            });
            Ok(())
        })?;
        Ok(true)
    }

    fn write_at(&self, buf: &[u8], offset: u64, _durable: bool) -> io::Result<()> {
        self.for_each_chunk(offset, buf.len() as u64, |index, within, pos, len| {
            let mut chunk = self.chunks[index].write().map_err(|_| poisoned())?;
            let pages = chunk.get_or_insert_with(|| vec![None; PAGES_PER_CHUNK].into());
            for_each_page(within, len, |page, in_page, at, piece| {
                let data = &buf[pos + at..pos + at + piece];
                match pages[page].as_mut() {
                    // Copy-on-write when the page is lent to a read still in flight.
                    Some(p) => Arc::make_mut(p).0[in_page..in_page + piece].copy_from_slice(data),
                    None => {
                        let mut fresh = Page([0; RAM_PAGE_BYTES]);
                        fresh.0[in_page..in_page + piece].copy_from_slice(data);
                        pages[page] = Some(Arc::new(fresh));
                    }
                }
            });
            Ok(())
        })
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero_range(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()> {
        // An unwritten page reads as zeros and costs nothing, so freeing is always allowed.
        let _ = deallocate;
        self.zero_range(offset, len)
    }

    fn mapping(&self, offset: u64) -> io::Result<Extent> {
        crate::bytes_to_end(self.size_bytes, offset)?;
        // Walk page by page from `offset`, one lock per chunk, until the state changes.
        let page_bytes = RAM_PAGE_BYTES as u64;
        let mut mapped = None;
        let mut at = offset - offset % page_bytes;
        'chunks: while at < self.size_bytes {
            let index = (at / RAM_CHUNK_BYTES) as usize;
            let chunk = self.chunks[index].read().map_err(|_| poisoned())?;
            let chunk_end = ((index as u64 + 1) * RAM_CHUNK_BYTES).min(self.size_bytes);
            while at < chunk_end {
                let page = ((at % RAM_CHUNK_BYTES) / page_bytes) as usize;
                let here = chunk
                    .as_ref()
                    .is_some_and(|pages| pages.get(page).is_some_and(Option::is_some));
                if *mapped.get_or_insert(here) != here {
                    break 'chunks;
                }
                if chunk.is_none() {
                    at = chunk_end; // a whole unallocated chunk at once
                } else {
                    at += page_bytes;
                }
            }
        }
        Ok(Extent {
            mapped: mapped.unwrap_or(false),
            len: at.min(self.size_bytes) - offset,
        })
    }

    fn is_thin(&self) -> bool {
        true
    }

    fn capabilities(&self) -> crate::Capabilities {
        crate::Capabilities {
            waits_for_device: false,
            lends_memory: true,
            lends_file_ranges: false,
            page_cache: false,
            direct: false,
            asynchronous: false,
            thin: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(slices: &[SharedSlice]) -> Vec<u8> {
        let mut v = Vec::new();
        for (owner, range) in slices {
            v.extend_from_slice(&(**owner).as_ref()[range.clone()]);
        }
        v
    }

    fn read(s: &RamStore, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        s.read_at(&mut buf, offset).unwrap();
        buf
    }

    #[test]
    fn a_shared_copy_reads_as_a_byte_copy_and_each_side_changes_alone() {
        let size = 4 * RAM_CHUNK_BYTES;
        let src = RamStore::new(size);
        // Written data with an unwritten hole, across a chunk boundary.
        let data: Vec<u8> = (0..3 * RAM_CHUNK_BYTES as usize)
            .map(|i| (i % 251) as u8)
            .collect();
        src.write_at(&data, 0, false).unwrap();
        src.discard(RAM_CHUNK_BYTES - 8192, 16384).unwrap();
        let expected = read(&src, 512, 2 * RAM_CHUNK_BYTES as usize);
        let dst = RamStore::new(size);
        // The destination's old data, hole included, is replaced.
        dst.write_at(&vec![0xEE; size as usize], 0, false).unwrap();
        // Not page-aligned, the same way on both sides: partial first and last pages.
        let at = RAM_CHUNK_BYTES + 512;
        assert!(dst.share_from(&src, 512, at, 2 * RAM_CHUNK_BYTES).unwrap());
        assert_eq!(read(&dst, at, expected.len()), expected);
        assert_eq!(read(&dst, 0, 512), vec![0xEE; 512]);
        assert_eq!(read(&dst, at + 2 * RAM_CHUNK_BYTES, 512), vec![0xEE; 512]);
        // Whole pages are shared, not copied.
        let shared = |d: u64, s_: u64| {
            let (a, b) = (dst.pages(d, 4096).unwrap(), src.pages(s_, 4096).unwrap());
            matches!((&a[0], &b[0]), (Some(x), Some(y)) if Arc::ptr_eq(x, y))
        };
        assert!(shared(at - 512 + 8192, 8192));
        // A write to either side leaves the other as it was.
        src.write_at(&[1; 4096], 8192, false).unwrap();
        dst.write_at(&[2; 4096], at - 512 + 16384, false).unwrap();
        assert_eq!(read(&dst, at, expected.len()), {
            let mut e = expected.clone();
            e[16384 - 512..16384 - 512 + 4096].fill(2);
            e
        });
        assert_eq!(read(&src, 8192, 4096), vec![1; 4096]);
        assert_eq!(read(&src, 16384, 4096), data[16384..16384 + 4096]);
    }

    #[test]
    fn a_shared_copy_within_one_store_and_its_refusals() {
        let s = RamStore::new(2 * RAM_CHUNK_BYTES);
        let data: Vec<u8> = (0..RAM_CHUNK_BYTES as usize)
            .map(|i| (i % 13) as u8)
            .collect();
        s.write_at(&data, 0, false).unwrap();
        // Overlapping, the destination below the source.
        assert!(s.share_from(&s, 8192, 4096, 65536).unwrap());
        assert_eq!(read(&s, 4096, 65536), data[8192..8192 + 65536]);
        // Overlapping with the destination above the source: nothing done, the caller copies
        // from the end.
        assert!(!s.share_from(&s, 4096, 8192, 65536).unwrap());
        assert_eq!(read(&s, 4096, 65536), data[8192..8192 + 65536]);
        // Offsets that lie differently within a page: nothing done, the caller copies.
        assert!(!s.share_from(&s, 0, RAM_CHUNK_BYTES + 512, 4096).unwrap());
        assert_eq!(read(&s, RAM_CHUNK_BYTES, 8192), vec![0; 8192]);
        // Beyond either end: an error.
        assert!(s
            .share_from(&s, 2 * RAM_CHUNK_BYTES - 4096, 0, 8192)
            .is_err());
        assert!(s
            .share_from(&s, 0, 2 * RAM_CHUNK_BYTES - 4096, 8192)
            .is_err());
    }

    #[test]
    fn unwritten_reads_zero_and_round_trip() {
        let s = RamStore::new(3 * RAM_CHUNK_BYTES + 512);
        let mut buf = vec![0xAAu8; 4096];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        // A write spanning a chunk boundary and not aligned to pages.
        let data: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let off = RAM_CHUNK_BYTES - 4000;
        s.write_at(&data, off, false).unwrap();
        let mut back = vec![0u8; 8192];
        s.read_at(&mut back, off).unwrap();
        assert_eq!(back, data);
        // The tail of an odd-sized store.
        s.write_at(&[7u8; 512], 3 * RAM_CHUNK_BYTES, true).unwrap();
        let mut tail = [0u8; 512];
        s.read_at(&mut tail, 3 * RAM_CHUNK_BYTES).unwrap();
        assert_eq!(tail, [7u8; 512]);
    }

    #[test]
    fn shared_reads_match_copied_reads() {
        let s = RamStore::new(2 * RAM_CHUNK_BYTES);
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7) as u8).collect();
        s.write_at(&data, RAM_CHUNK_BYTES - 10_000, false).unwrap();
        for (offset, len) in [
            (0u64, 512u64),
            (RAM_CHUNK_BYTES - 10_001, 20_002),
            (RAM_CHUNK_BYTES - 4096, 8192),
            (100, 2 * RAM_CHUNK_BYTES - 100),
            (2 * RAM_CHUNK_BYTES, 0),
        ] {
            let mut copied = vec![0u8; len as usize];
            s.read_at(&mut copied, offset).unwrap();
            let mut slices = Vec::new();
            assert!(s.read_shared(offset, len, &mut slices).unwrap());
            assert_eq!(gather(&slices), copied, "{offset}+{len}");
            assert!(slices.iter().all(|(_, r)| r.len() <= RAM_PAGE_BYTES));
        }
        let mut slices = Vec::new();
        assert!(s
            .read_shared(2 * RAM_CHUNK_BYTES - 1, 2, &mut slices)
            .is_err());
    }

    #[test]
    fn a_lent_page_never_changes_under_its_reader() {
        let s = RamStore::new(RAM_CHUNK_BYTES);
        s.write_at(&[1u8; 8192], 0, false).unwrap();
        let mut lent = Vec::new();
        s.read_shared(0, 8192, &mut lent).unwrap();
        // Overwrite, partially zero and discard while the read is still "in flight".
        s.write_at(&[2u8; 100], 10, false).unwrap();
        s.write_zeroes(4096 + 5, 10, false).unwrap();
        s.discard(0, 8192).unwrap();
        assert_eq!(gather(&lent), vec![1u8; 8192]);
        let mut now = vec![9u8; 8192];
        s.read_at(&mut now, 0).unwrap();
        assert!(now.iter().all(|&b| b == 0));
        // Writes after the lender is gone go in place again, and reads see them.
        drop(lent);
        s.write_at(&[3u8; 4096], 0, false).unwrap();
        let mut again = Vec::new();
        s.read_shared(0, 4096, &mut again).unwrap();
        assert_eq!(gather(&again), vec![3u8; 4096]);
    }

    #[test]
    fn out_of_range_is_an_error() {
        let s = RamStore::new(RAM_CHUNK_BYTES);
        let mut buf = [0u8; 512];
        assert!(s.read_at(&mut buf, RAM_CHUNK_BYTES - 511).is_err());
        assert!(s.write_at(&buf, u64::MAX - 10, false).is_err());
        assert!(s.discard(u64::MAX, 2).is_err());
        assert!(s.write_zeroes(RAM_CHUNK_BYTES, 1, false).is_err());
        assert!(s.mapping(RAM_CHUNK_BYTES).is_err());
        // Zero-length at the end is fine.
        s.read_at(&mut [], RAM_CHUNK_BYTES).unwrap();
        s.discard(RAM_CHUNK_BYTES, 0).unwrap();
    }

    #[test]
    fn discard_frees_whole_pages_and_zeroes_partials() {
        let s = RamStore::new(4 * RAM_CHUNK_BYTES);
        let ones = vec![1u8; (4 * RAM_CHUNK_BYTES) as usize];
        s.write_at(&ones, 0, false).unwrap();
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: true,
                len: 4 * RAM_CHUNK_BYTES
            }
        );
        // Discard [0.5, 2.5) chunks plus 100 bytes: the pages inside are freed, the partial
        // page at the end is zeroed but stays mapped.
        let half = RAM_CHUNK_BYTES / 2;
        let len = 2 * RAM_CHUNK_BYTES + 100;
        s.discard(half, len).unwrap();
        let mut back = vec![9u8; (4 * RAM_CHUNK_BYTES) as usize];
        s.read_at(&mut back, 0).unwrap();
        for (i, &b) in back.iter().enumerate() {
            let i = i as u64;
            let expect = if (half..half + len).contains(&i) {
                0
            } else {
                1
            };
            assert_eq!(b, expect, "byte {i}");
        }
        let extents = [(0, true, half), (half, false, 2 * RAM_CHUNK_BYTES)];
        for (offset, mapped, len) in extents {
            assert_eq!(
                s.mapping(offset).unwrap(),
                Extent { mapped, len },
                "{offset}"
            );
        }
        assert_eq!(
            s.mapping(half + 5).unwrap(),
            Extent {
                mapped: false,
                len: 2 * RAM_CHUNK_BYTES - 5
            }
        );
        assert_eq!(
            s.mapping(half + 2 * RAM_CHUNK_BYTES).unwrap(),
            Extent {
                mapped: true,
                len: 4 * RAM_CHUNK_BYTES - half - 2 * RAM_CHUNK_BYTES
            }
        );
        // The fully freed chunk holds no page table any more.
        assert!(s.chunks[1].read().unwrap().is_none());
        s.write_zeroes(0, 4 * RAM_CHUNK_BYTES, true).unwrap();
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: false,
                len: 4 * RAM_CHUNK_BYTES
            }
        );
        assert!(s.chunks.iter().all(|c| c.read().unwrap().is_none()));
        assert!(s.is_thin());
    }

    #[test]
    fn concurrent_writers_on_different_chunks() {
        let s = Arc::new(RamStore::new(2 * RAM_CHUNK_BYTES));
        let handles: Vec<_> = (0..2u8)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..256u64 {
                        s.write_at(&[t + 1; 4096], t as u64 * RAM_CHUNK_BYTES + i * 4096, false)
                            .unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut buf = vec![0u8; (2 * RAM_CHUNK_BYTES) as usize];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf[..RAM_CHUNK_BYTES as usize].iter().all(|&b| b == 1));
        assert!(buf[RAM_CHUNK_BYTES as usize..].iter().all(|&b| b == 2));
    }
}
