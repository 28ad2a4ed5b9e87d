//! RAM store: memory is allocated per chunk on first write, so a large thin LUN costs only what
//! was written. Each chunk has its own lock, so workers touching different chunks never contend.

use crate::{check_range, BlockStore, Extent};
use std::io;
use std::sync::RwLock;

/// Allocation and discard granularity.
pub const RAM_CHUNK_BYTES: u64 = 1 << 20;

pub struct RamStore {
    size_bytes: u64,
    chunks: Vec<RwLock<Option<Box<[u8]>>>>,
}

impl RamStore {
    pub fn new(size_bytes: u64) -> Self {
        let count = size_bytes.div_ceil(RAM_CHUNK_BYTES);
        let count = usize::try_from(count).expect("RAM store size exceeds the address space");
        let mut chunks = Vec::with_capacity(count);
        chunks.resize_with(count, || RwLock::new(None));
        RamStore { size_bytes, chunks }
    }

    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * RAM_CHUNK_BYTES;
        (self.size_bytes - start).min(RAM_CHUNK_BYTES) as usize
    }

    /// Calls `f(chunk_index, offset_in_chunk, position_in_range, len)` for each chunk piece.
    fn for_each_piece(
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

    fn zero_range(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()> {
        self.for_each_piece(offset, len, |index, within, _, piece| {
            let mut chunk = self.chunks[index].write().map_err(|_| poisoned())?;
            if within == 0 && piece == self.chunk_len(index) && deallocate {
                *chunk = None;
            } else if let Some(data) = chunk.as_mut() {
                data[within..within + piece].fill(0);
            }
            Ok(())
        })
    }
}

fn poisoned() -> io::Error {
    io::Error::other("RAM store chunk lock poisoned")
}

impl BlockStore for RamStore {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.for_each_piece(offset, buf.len() as u64, |index, within, pos, piece| {
            let chunk = self.chunks[index].read().map_err(|_| poisoned())?;
            let out = &mut buf[pos..pos + piece];
            match chunk.as_ref() {
                Some(data) => out.copy_from_slice(&data[within..within + piece]),
                None => out.fill(0),
            }
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, _durable: bool) -> io::Result<()> {
        self.for_each_piece(offset, buf.len() as u64, |index, within, pos, piece| {
            let mut chunk = self.chunks[index].write().map_err(|_| poisoned())?;
            let len = self.chunk_len(index);
            let data = chunk.get_or_insert_with(|| vec![0u8; len].into_boxed_slice());
            data[within..within + piece].copy_from_slice(&buf[pos..pos + piece]);
            Ok(())
        })
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero_range(offset, len, true)
    }

    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> io::Result<()> {
        // Zeroing an unallocated chunk is free, and a whole zeroed chunk reads the same whether it
        // is kept or freed, so freeing it is always allowed.
        let _ = deallocate;
        self.zero_range(offset, len, true)
    }

    fn mapping(&self, offset: u64) -> io::Result<Extent> {
        if offset >= self.size_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("offset {offset} outside store of {} bytes", self.size_bytes),
            ));
        }
        let first = (offset / RAM_CHUNK_BYTES) as usize;
        let is_mapped = |i: usize| -> io::Result<bool> {
            Ok(self.chunks[i].read().map_err(|_| poisoned())?.is_some())
        };
        let mapped = is_mapped(first)?;
        let mut end = first + 1;
        while end < self.chunks.len() && is_mapped(end)? == mapped {
            end += 1;
        }
        let end_bytes = (end as u64 * RAM_CHUNK_BYTES).min(self.size_bytes);
        Ok(Extent {
            mapped,
            len: end_bytes - offset,
        })
    }

    fn is_thin(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn unwritten_reads_zero_and_round_trip() {
        let s = RamStore::new(3 * RAM_CHUNK_BYTES + 512);
        let mut buf = vec![0xAAu8; 4096];
        s.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        // A write spanning a chunk boundary.
        let data: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let off = RAM_CHUNK_BYTES - 4096;
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
    }

    #[test]
    fn discard_frees_whole_chunks_and_zeroes_partials() {
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
        // Discard [0.5, 2.5) chunks: chunk 1 freed, halves of 0 and 2 zeroed.
        let half = RAM_CHUNK_BYTES / 2;
        s.discard(half, 2 * RAM_CHUNK_BYTES).unwrap();
        let mut back = vec![9u8; (4 * RAM_CHUNK_BYTES) as usize];
        s.read_at(&mut back, 0).unwrap();
        for (i, &b) in back.iter().enumerate() {
            let i = i as u64;
            let expect = if (half..half + 2 * RAM_CHUNK_BYTES).contains(&i) {
                0
            } else {
                1
            };
            assert_eq!(b, expect, "byte {i}");
        }
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: true,
                len: RAM_CHUNK_BYTES
            }
        );
        assert_eq!(
            s.mapping(RAM_CHUNK_BYTES + 5).unwrap(),
            Extent {
                mapped: false,
                len: RAM_CHUNK_BYTES - 5
            }
        );
        assert_eq!(
            s.mapping(2 * RAM_CHUNK_BYTES).unwrap(),
            Extent {
                mapped: true,
                len: 2 * RAM_CHUNK_BYTES
            }
        );
        s.write_zeroes(0, 4 * RAM_CHUNK_BYTES, true).unwrap();
        assert_eq!(
            s.mapping(0).unwrap(),
            Extent {
                mapped: false,
                len: 4 * RAM_CHUNK_BYTES
            }
        );
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
