//! SBC-3 block commands: reads, writes, verification, cache, provisioning, capacity.

use crate::cdb::*;
use crate::lu::*;
use crate::sense::{Sense, Stop};
use crate::Command;
use std::sync::atomic::Ordering;

/// Scratch bound for comparisons and WRITE SAME patterns (reuses the caller's Data-In Vec).
const SCRATCH_BYTES_MAX: usize = 1 << 20;
/// GET LBA STATUS descriptors returned at most per command.
const LBA_STATUS_DESCRIPTORS_MAX: u32 = 64;

/// LBA, number of blocks, and the byte offset of the length field (for field pointers).
struct Range {
    lba: u64,
    blocks: u32,
    len_field: u16,
}

/// Decodes LBA and transfer length of the READ/WRITE/VERIFY families by CDB size.
fn rw_range(cdb: Cdb<'_>) -> Range {
    match cdb.u8(0) {
        READ_6 | WRITE_6 => {
            let blocks = match cdb.u8(4) {
                0 => 256, // SBC-3 5.15: zero means 256 blocks
                n => u32::from(n),
            };
            Range {
                lba: u64::from(cdb.be24(1) & 0x1F_FFFF),
                blocks,
                len_field: 4,
            }
        }
        op if op < 0x80 => Range {
            lba: u64::from(cdb.be32(2)),
            blocks: u32::from(cdb.be16(7)),
            len_field: 7,
        },
        op if op < 0xA0 => Range {
            lba: cdb.be64(2),
            blocks: cdb.be32(10),
            len_field: 10,
        },
        _ => Range {
            lba: u64::from(cdb.be32(2)),
            blocks: cdb.be32(6),
            len_field: 6,
        },
    }
}

/// `dst |= src`, byte by byte (ORWRITE).
pub(crate) fn or_into(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d |= *s;
    }
}

/// A checked READ: `len` bytes at byte `offset` (what the transport will take), of the
/// `bytes` the CDB asked for.
pub(crate) struct ReadExtent {
    pub offset: u64,
    pub len: u32,
    pub bytes: u32,
}

/// A checked WRITE: `data` (the whole blocks that arrived) at byte `offset`, of the `bytes` the
/// CDB describes; `durable` for FUA or write-through.
pub(crate) struct WriteExtent<'d> {
    pub offset: u64,
    pub data: &'d [u8],
    pub bytes: u32,
    pub durable: bool,
}

pub(crate) fn read_error(e: std::io::Error) -> Sense {
    if backend_unreachable(&e) {
        return Sense::not_ready_transition();
    }
    Sense::medium_error_unrecovered_read()
}

/// Whether a read that failed with `e` failed on the medium, whose first bad block
/// [`LogicalUnit::read_failure`] then locates (by reading: only where waiting is fine).
pub(crate) fn read_failed_on_medium(e: &std::io::Error) -> bool {
    !backend_unreachable(e)
}

/// How long locating a failed read's first bad block may go on starting reads: past it, a disk
/// that fails slowly is answered without the INFORMATION field rather than holding the command
/// (hosts abort at 30 s). The answer comes at most one read after it.
const LOCATE_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);
pub(crate) fn write_error(e: std::io::Error) -> Sense {
    const ENOSPC: i32 = 28;
    const EDQUOT: i32 = 122;
    if backend_unreachable(&e) {
        return Sense::not_ready_transition();
    }
    // The filesystem or device under the LU is full (a thin file LU outgrew its disk, a
    // quota): not a medium error.
    if matches!(store::errno_of(&e), Some(ENOSPC | EDQUOT)) {
        return Sense::space_allocation_failed();
    }
    Sense::medium_error_write()
}

/// Whether an I/O failed because the store's backend could not be reached or fenced this
/// client off (a Ceph cluster timing out, this gateway blocklisted), not because the medium
/// failed: the command may succeed later or through another path, so the initiator is told
/// to retry (NOT READY, ASYMMETRIC ACCESS STATE TRANSITION) instead of failing the I/O.
fn backend_unreachable(e: &std::io::Error) -> bool {
    const ENOTCONN: i32 = 107;
    const ESHUTDOWN: i32 = 108;
    const ETIMEDOUT: i32 = 110;
    const ECONNREFUSED: i32 = 111;
    const EHOSTUNREACH: i32 = 113;
    matches!(
        store::errno_of(e),
        Some(ENOTCONN | ESHUTDOWN | ETIMEDOUT | ECONNREFUSED | EHOSTUNREACH)
    )
}

impl LogicalUnit {
    fn block_size(&self) -> usize {
        self.settings.block_size as usize
    }

    fn wce(&self) -> bool {
        self.mode.wce.load(Ordering::Relaxed)
    }

    /// LBA OUT OF RANGE unless `[lba, lba + blocks)` lies inside the medium and `lba` names a
    /// block (SBC-3 4.5).
    pub(crate) fn check_lba(&self, lba: u64, blocks: u64) -> Result<(), Sense> {
        let capacity = self.block_count();
        match lba.checked_add(blocks) {
            Some(end) if lba < capacity && end <= capacity => Ok(()),
            _ => Err(Sense::lba_out_of_range()),
        }
    }

    fn check_transfer(&self, r: &Range) -> Result<(), Sense> {
        if r.blocks > TRANSFER_BYTES_MAX >> self.block_shift {
            return Err(Sense::invalid_field_in_cdb(r.len_field, None));
        }
        self.check_lba(r.lba, u64::from(r.blocks))
    }

    /// Flags byte of READ/WRITE 10/12/16: protection fields must be zero (no PI), DPO, FUA and
    /// FUA_NV are accepted.
    fn check_rw_flags(&self, cdb: Cdb<'_>) -> Result<(), Sense> {
        if matches!(cdb.u8(0), READ_6 | WRITE_6) {
            return Ok(());
        }
        check_reserved(cdb, 1, 0x1A)
    }

    /// What a READ (6/10/12/16) reads, once its CDB passed every check.
    pub(crate) fn read_extent(&self, cmd: &Command<'_>) -> Result<ReadExtent, Sense> {
        let cdb = Cdb(cmd.cdb);
        self.check_rw_flags(cdb)?;
        let r = rw_range(cdb);
        self.check_transfer(&r)?;
        let bytes = r.blocks << self.block_shift; // bounded by TRANSFER_BYTES_MAX
        Ok(ReadExtent {
            offset: r.lba << self.block_shift,
            // Read no further than the transport will send; the rest is its overflow residual.
            len: bytes.min(cmd.data_in_limit),
            bytes,
        })
    }

    /// What a WRITE (6/10/12/16) writes, once its CDB passed every check.
    pub(crate) fn write_extent<'d>(&self, cmd: &Command<'d>) -> Result<WriteExtent<'d>, Sense> {
        let cdb = Cdb(cmd.cdb);
        self.check_rw_flags(cdb)?;
        let r = rw_range(cdb);
        self.check_transfer(&r)?;
        let fua = !matches!(cdb.u8(0), WRITE_6) && cdb.u8(1) & 0x08 != 0;
        Ok(WriteExtent {
            offset: r.lba << self.block_shift,
            data: self.blocks_sent(cmd.data_out, &r),
            bytes: r.blocks << self.block_shift,
            durable: fua || !self.wce(),
        })
    }

    /// READ (6/10/12/16). With `io` (a network worker), store memory is lent into it where the
    /// store allows, and data that is not cached gives [`Stop::WouldWait`] instead of a wait.
    pub(crate) fn read(
        &self,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
        io: Option<&mut crate::Lending<'_>>,
    ) -> Result<u32, Stop> {
        let ReadExtent { offset, len, bytes } = self.read_extent(cmd)?;
        let nonblocking = io.is_some();
        // A medium error met where waiting is not allowed goes where it is, to be located.
        let failed = |e: std::io::Error| -> Stop {
            if nonblocking && read_failed_on_medium(&e) {
                Stop::WouldWait
            } else {
                self.read_failure(offset, len.into(), e).into()
            }
        };
        if let Some(lending) = io {
            if lending.file_min_bytes > 0 && len >= lending.file_min_bytes {
                if let Some(range) = self
                    .store
                    .cached_file_range(offset, len.into())
                    .map_err(failed)?
                {
                    *lending.file = Some(range);
                    data_in.clear();
                    return Ok(bytes);
                }
            }
            if self
                .store
                .read_shared(offset, len.into(), lending.slices)
                .map_err(failed)?
            {
                data_in.clear();
                return Ok(bytes);
            }
        }
        // Only bytes beyond the previous length are zero-filled: the read overwrites them all.
        let len = len as usize;
        if data_in.len() >= len {
            data_in.truncate(len);
        } else {
            data_in.resize(len, 0);
        }
        if nonblocking {
            if !self.store.try_read_at(data_in, offset).map_err(failed)? {
                return Err(Stop::WouldWait);
            }
        } else {
            self.store.read_at(data_in, offset).map_err(failed)?;
        }
        Ok(bytes)
    }

    /// The sense for a read of `len` bytes at byte `offset` that failed with `e`: NOT READY
    /// for a backend out of reach; else MEDIUM ERROR, UNRECOVERED READ ERROR with the LBA of
    /// the first block that fails to read in its INFORMATION field, as a disk reports it
    /// (SBC-3 4.18): Linux then completes the blocks before it and fails only the rest. Reads
    /// the range again, halving it (a log2 of its blocks, within [`LOCATE_BUDGET`]): call it
    /// where waiting is fine.
    pub(crate) fn read_failure(&self, offset: u64, len: u64, e: std::io::Error) -> Sense {
        if !read_failed_on_medium(&e) {
            return read_error(e);
        }
        Sense {
            info: self.first_unreadable_block(offset, len),
            ..Sense::medium_error_unrecovered_read()
        }
    }

    /// The first block of `[offset, offset + len)`, whose read as a whole failed, that fails
    /// to read by itself; None when the failure did not repeat (a flaky device) or locating it
    /// ran out of time.
    fn first_unreadable_block(&self, offset: u64, len: u64) -> Option<u64> {
        let shift = self.block_shift;
        let (mut lo, mut hi) = (offset >> shift, (offset + len.max(1)).div_ceil(1 << shift));
        // Whether [lo, hi) was read as a range and failed: the whole command's read did.
        let mut failed = true;
        let deadline = std::time::Instant::now() + LOCATE_BUDGET;
        let mut scratch = Vec::new();
        while hi - lo > 1 || !failed {
            if std::time::Instant::now() >= deadline {
                return None;
            }
            let mid = if hi - lo > 1 { lo + (hi - lo) / 2 } else { hi };
            scratch.resize(usize::try_from((mid - lo) << shift).ok()?, 0);
            if self.store.read_at(&mut scratch, lo << shift).is_err() {
                (hi, failed) = (mid, true);
            } else if mid == hi {
                return None;
            } else {
                (lo, failed) = (mid, false);
            }
        }
        debug_assert_eq!(hi - lo, 1, "located to one block");
        Some(lo)
    }

    /// `nonblocking`: a write-back write the kernel would make wait is declined ([`Stop::WouldWait`]) to
    /// run again, whole, where waiting is fine; part of it may have been written meanwhile,
    /// which the second run writes over with the same bytes.
    pub(crate) fn write(&self, cmd: &Command<'_>, nonblocking: bool) -> Result<u32, Stop> {
        let extent = self.write_extent(cmd)?;
        if nonblocking && !extent.durable {
            return self.try_write_blocks(&extent);
        }
        Ok(self.write_blocks(&extent)?)
    }

    /// The whole blocks of `data_out` that the CDB asked for: when the transport received less
    /// than the CDB describes, only what arrived is written (its overflow residual).
    fn blocks_sent<'d>(&self, data_out: &'d [u8], r: &Range) -> &'d [u8] {
        let have_blocks = (data_out.len() >> self.block_shift).min(r.blocks as usize);
        data_out
            .get(..have_blocks << self.block_shift)
            .unwrap_or(&[])
    }

    fn write_blocks(&self, w: &WriteExtent<'_>) -> Result<u32, Sense> {
        if !w.data.is_empty() {
            let _order = self.write_order.read();
            self.store
                .write_at(w.data, w.offset, w.durable)
                .map_err(write_error)?;
        }
        Ok(w.bytes)
    }

    fn try_write_blocks(&self, w: &WriteExtent<'_>) -> Result<u32, Stop> {
        if !w.data.is_empty() {
            let _order = self.write_order.read();
            let written = self
                .store
                .try_write_at(w.data, w.offset)
                .map_err(write_error)?;
            if !written {
                return Err(Stop::WouldWait);
            }
        }
        Ok(w.bytes)
    }

    pub(crate) fn write_and_verify(&self, cmd: &Command<'_>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x12)?;
        let r = rw_range(cdb);
        self.check_transfer(&r)?;
        // What was just written verifies by construction; "verify" asks for the medium, so the
        // write is made durable.
        self.write_blocks(&WriteExtent {
            offset: r.lba << self.block_shift,
            data: self.blocks_sent(cmd.data_out, &r),
            bytes: r.blocks << self.block_shift,
            durable: true,
        })
    }

    pub(crate) fn verify(&self, cmd: &Command<'_>, scratch: &mut Vec<u8>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x16)?;
        let r = rw_range(cdb);
        let bytchk = (cdb.u8(1) >> 1) & 0x03;
        if bytchk == 2 {
            return Err(Sense::invalid_field_in_cdb(1, Some(2)));
        }
        self.check_transfer(&r)?;
        let bs = self.block_size();
        let total = (r.blocks as usize) << self.block_shift;
        let expected = match bytchk {
            0 => 0,
            1 => total,
            _ => bs,
        };
        if r.blocks == 0 {
            return Ok(expected as u32);
        }
        if cmd.data_out.len() < expected {
            return Err(Sense::parameter_list_length_error());
        }
        let chunk_max = SCRATCH_BYTES_MAX.max(bs);
        let mut done = 0usize;
        while done < total {
            let n = (total - done).min(chunk_max);
            scratch.resize(n, 0);
            let offset = (r.lba << self.block_shift) + done as u64;
            // BYTCHK 0 verifies the medium only: every block must read (SBC-3 5.31).
            self.store
                .read_at(scratch, offset)
                .map_err(|e| self.read_failure(offset, n as u64, e))?;
            if bytchk == 0 {
                done += n;
                continue;
            }
            // Compare block by block with slice equality (memcmp); only a differing block is
            // searched byte by byte for the INFORMATION field.
            for (k, got) in scratch.chunks(bs).enumerate() {
                let at = done + k * bs;
                let want = if bytchk == 1 {
                    &cmd.data_out[at..at + got.len()]
                } else {
                    &cmd.data_out[..got.len()]
                };
                if got != want {
                    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
                    scratch.clear();
                    return Err(Sense::miscompare((at + i) as u64));
                }
            }
            done += n;
        }
        scratch.clear();
        Ok(expected as u32)
    }

    /// The checks of SYNCHRONIZE CACHE (10/16) before it flushes.
    pub(crate) fn check_synchronize_cache(&self, cmd: &Command<'_>) -> Result<(), Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x02)?;
        let (lba, blocks) = if cdb.u8(0) == SYNCHRONIZE_CACHE_10 {
            (u64::from(cdb.be32(2)), u64::from(cdb.be16(7)))
        } else {
            (cdb.be64(2), u64::from(cdb.be32(10)))
        };
        self.check_lba(lba, blocks)
    }

    pub(crate) fn synchronize_cache(&self, cmd: &Command<'_>) -> Result<u32, Sense> {
        self.check_synchronize_cache(cmd)?;
        // IMMED is honoured by finishing before the status: always correct, never early.
        self.store.flush().map_err(write_error)?;
        Ok(0)
    }

    pub(crate) fn pre_fetch(&self, cmd: &Command<'_>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x02)?;
        let (lba, blocks) = if cdb.u8(0) == PRE_FETCH_10 {
            (u64::from(cdb.be32(2)), u64::from(cdb.be16(7)))
        } else {
            (cdb.be64(2), u64::from(cdb.be32(10)))
        };
        self.check_lba(lba, blocks)?;
        // There is no cache to load: GOOD (not CONDITION MET) says so (SBC-3 5.9).
        Ok(0)
    }

    pub(crate) fn write_same(
        &self,
        cmd: &Command<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        let is_16 = cdb.u8(0) == WRITE_SAME_16;
        if cdb.u8(1) & 0x10 != 0 {
            // ANCHOR: anchored LBAs are not supported (ANC_SUP=0).
            return Err(Sense::invalid_field_in_cdb(1, Some(4)));
        }
        check_reserved(cdb, 1, if is_16 { 0x09 } else { 0x08 })?;
        let (lba, blocks, len_field) = if is_16 {
            (cdb.be64(2), cdb.be32(10), 10)
        } else {
            (u64::from(cdb.be32(2)), u32::from(cdb.be16(7)), 7)
        };
        let unmap = cdb.u8(1) & 0x08 != 0;
        if unmap && !self.settings.thin {
            // LBPWS/LBPWS10 are zero on a fully provisioned LU (SBC-3 5.42, 5.43).
            return Err(Sense::invalid_field_in_cdb(1, Some(3)));
        }
        let ndob = is_16 && cdb.u8(1) & 0x01 != 0;
        // WSNZ=1: zero blocks is an error rather than "to the end of the medium".
        if blocks == 0 || blocks > WRITE_SAME_BLOCKS_MAX {
            return Err(Sense::invalid_field_in_cdb(len_field, None));
        }
        self.check_lba(lba, u64::from(blocks))?;
        let bs = self.block_size();
        // Exactly one block of Data-Out (none with NDOB): anything else means initiator and
        // target disagree about the command, so nothing is written.
        let pattern: &[u8] = if ndob { &[] } else { cmd.data_out };
        if !ndob && pattern.len() != bs {
            return Err(Sense::invalid_field_in_cdb(len_field, None));
        }
        let offset = lba << self.block_shift;
        let len = u64::from(blocks) << self.block_shift;
        {
            let _order = self.write_order.read();
            if unmap && self.settings.thin {
                // UNMAP deallocates whatever the data block holds (SBC-3 5.42: the LBAs are
                // unmapped; with LBPRZ they then read as zeros). Linux LIO does the same and
                // libiscsi's WriteSame10.UnmapUntilEnd expects it.
                self.store
                    .write_zeroes(offset, len, true)
                    .map_err(write_error)?;
            } else if pattern.iter().all(|&b| b == 0) {
                self.store
                    .write_zeroes(offset, len, false)
                    .map_err(write_error)?;
            } else {
                self.write_pattern(pattern, offset, len, scratch)?;
            }
        }
        if !self.wce() {
            self.store.flush().map_err(write_error)?;
        }
        Ok(pattern.len() as u32)
    }

    /// Writes `pattern` (one block) over `len` bytes at `offset`, a scratch buffer of
    /// repeated patterns at a time (at most `SCRATCH_BYTES_MAX`); the scratch is left empty.
    fn write_pattern(
        &self,
        pattern: &[u8],
        offset: u64,
        len: u64,
        scratch: &mut Vec<u8>,
    ) -> Result<(), Sense> {
        let bs = pattern.len();
        let per_write = (SCRATCH_BYTES_MAX / bs).max(1) * bs;
        scratch.clear();
        while scratch.len() < per_write.min(len as usize) {
            scratch.extend_from_slice(pattern);
        }
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(scratch.len() as u64) as usize;
            let r = self.store.write_at(&scratch[..n], offset + done, false);
            if let Err(e) = r {
                scratch.clear();
                return Err(write_error(e));
            }
            done += n as u64;
        }
        scratch.clear();
        Ok(())
    }

    pub(crate) fn unmap(&self, cmd: &Command<'_>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x00)?; // ANCHOR unsupported
        let param_len = cdb.be16(7) as usize;
        if param_len == 0 {
            return Ok(0);
        }
        let p = &cmd.data_out[..param_len.min(cmd.data_out.len())];
        if param_len < 8 || p.len() < 8 {
            return Err(Sense::parameter_list_length_error());
        }
        let descriptor_bytes = param_be16(p, 2).unwrap_or(0) as usize;
        // A trailing partial descriptor is ignored (SBC-3 5.28.2).
        let count = descriptor_bytes.min(p.len() - 8) / 16;
        if count > UNMAP_DESCRIPTORS_MAX as usize {
            return Err(Sense::invalid_field_in_parameter_list(2, None));
        }
        let max_blocks = u64::from(UNMAP_BLOCKS_MAX);
        let mut total = 0u64;
        for i in 0..count {
            let at = 8 + 16 * i;
            let lba = param_be64(p, at).unwrap_or(0);
            let blocks = u64::from(param_be32(p, at + 8).unwrap_or(0));
            if blocks == 0 {
                continue;
            }
            self.check_lba(lba, blocks)?;
            total = total.saturating_add(blocks);
            if total > max_blocks {
                return Err(Sense::invalid_field_in_parameter_list(at as u16 + 8, None));
            }
        }
        {
            let _order = self.write_order.read();
            for i in 0..count {
                let at = 8 + 16 * i;
                let lba = param_be64(p, at).unwrap_or(0);
                let blocks = u64::from(param_be32(p, at + 8).unwrap_or(0));
                if blocks > 0 {
                    self.store
                        .discard(lba << self.block_shift, blocks << self.block_shift)
                        .map_err(write_error)?;
                }
            }
        }
        if !self.wce() {
            self.store.flush().map_err(write_error)?;
        }
        Ok(param_len as u32)
    }

    pub(crate) fn compare_and_write(
        &self,
        cmd: &Command<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x18)?;
        let lba = cdb.be64(2);
        let blocks = cdb.u8(13);
        if blocks > COMPARE_AND_WRITE_BLOCKS_MAX {
            return Err(Sense::invalid_field_in_cdb(13, None));
        }
        let bytes = usize::from(blocks) << self.block_shift;
        // Verify data then write data, nothing more and nothing less: a different amount means
        // the NUMBER OF LOGICAL BLOCKS is not what the initiator meant (e.g. 256 truncated to
        // 0 in the one-byte field), so nothing is compared or written.
        if cmd.data_out.len() != 2 * bytes {
            return Err(Sense::invalid_field_in_cdb(13, None));
        }
        if blocks == 0 {
            return Ok(0);
        }
        self.check_lba(lba, u64::from(blocks))?;
        let (verify, write) = cmd.data_out.split_at(bytes);
        let durable = cdb.u8(1) & 0x08 != 0 || !self.wce();
        let offset = lba << self.block_shift;
        let _order = self.write_order.write();
        scratch.resize(bytes, 0);
        let result = self
            .store
            .read_at(scratch, offset)
            .map_err(read_error)
            .and_then(|()| match scratch[..] == *verify {
                false => {
                    let at = scratch.iter().zip(verify).position(|(a, b)| a != b);
                    Err(Sense::miscompare(at.unwrap_or(0) as u64))
                }
                true => self
                    .store
                    .write_at(&write[..bytes], offset, durable)
                    .map_err(write_error),
            });
        scratch.clear();
        result.map(|()| (2 * bytes) as u32)
    }

    /// ORWRITE (16), SBC-3 5.8: the Data-Out blocks are ORed into the medium. The exclusive
    /// write lock makes the read-modify-write atomic against every other writer of the LU.
    pub(crate) fn orwrite(&self, cmd: &Command<'_>, scratch: &mut Vec<u8>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        // ORPROTECT must be zero (no protection information); DPO, FUA, FUA_NV accepted.
        check_reserved(cdb, 1, 0x1A)?;
        let r = rw_range(cdb);
        self.check_transfer(&r)?;
        let bytes = r.blocks << self.block_shift;
        let len =
            ((cmd.data_out.len() >> self.block_shift).min(r.blocks as usize)) << self.block_shift;
        if len == 0 {
            return Ok(bytes);
        }
        let durable = cdb.u8(1) & 0x08 != 0 || !self.wce();
        let offset = r.lba << self.block_shift;
        let _order = self.write_order.write();
        scratch.resize(len, 0);
        let result = self
            .store
            .read_at(scratch, offset)
            .map_err(read_error)
            .and_then(|()| {
                or_into(scratch, &cmd.data_out[..len]);
                self.store
                    .write_at(scratch, offset, durable)
                    .map_err(write_error)
            });
        scratch.clear();
        result.map(|()| bytes)
    }

    /// WRITE ATOMIC (16), SBC-4 5.48: all of the blocks or none of them with respect to every
    /// other writer of the LU (the write lock is taken exclusively). Reads take no lock, so a
    /// READ racing with it may see part of it; a store failure midway may leave part written.
    pub(crate) fn write_atomic(&self, cmd: &Command<'_>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x18)?; // WRPROTECT 0; DPO, FUA
        if cdb.be16(10) != 0 {
            // ATOMIC BOUNDARY: boundaries are not supported (maximum atomic boundary size 0).
            return Err(Sense::invalid_field_in_cdb(10, None));
        }
        let r = Range {
            lba: cdb.be64(2),
            blocks: u32::from(cdb.be16(12)),
            len_field: 12,
        };
        if r.blocks > ATOMIC_BYTES_MAX >> self.block_shift {
            return Err(Sense::invalid_field_in_cdb(12, None));
        }
        self.check_lba(r.lba, u64::from(r.blocks))?;
        let bytes = r.blocks << self.block_shift;
        // A partial transfer cannot be written atomically: nothing is written.
        if r.blocks > 0 && cmd.data_out.len() < bytes as usize {
            return Err(Sense::invalid_field_in_cdb(12, None));
        }
        if r.blocks == 0 {
            return Ok(0);
        }
        let durable = cdb.u8(1) & 0x08 != 0 || !self.wce();
        let _order = self.write_order.write();
        self.store
            .write_at(
                &cmd.data_out[..bytes as usize],
                r.lba << self.block_shift,
                durable,
            )
            .map_err(write_error)?;
        Ok(bytes)
    }

    pub(crate) fn read_capacity_10(
        &self,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 8, 0x01)?;
        if cdb.u8(8) & 0x01 == 0 && cdb.be32(2) != 0 {
            return Err(Sense::invalid_field_in_cdb(2, None));
        }
        // Beyond 32 bits the initiator must use READ CAPACITY (16).
        let last = u32::try_from(self.block_count() - 1).unwrap_or(u32::MAX);
        data_in.extend_from_slice(&last.to_be_bytes());
        data_in.extend_from_slice(&self.settings.block_size.to_be_bytes());
        Ok(finish_data_in(data_in, 8, cmd.data_in_limit))
    }

    pub(crate) fn read_capacity_16(
        &self,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 14, 0x01)?; // PMI (obsolete) only
        data_in.extend_from_slice(&(self.block_count() - 1).to_be_bytes());
        data_in.extend_from_slice(&self.settings.block_size.to_be_bytes());
        data_in.push(0); // no protection information
        data_in.push(self.physical_block_exponent());
        // LBPME and LBPRZ (deallocated blocks read back as zeros on every store); lowest
        // aligned LBA 0.
        data_in.push(if self.settings.thin { 0xC0 } else { 0 });
        data_in.resize(32, 0);
        Ok(finish_data_in(data_in, cdb.be32(10), cmd.data_in_limit))
    }

    pub(crate) fn get_lba_status(
        &self,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        let start = cdb.be64(2);
        let allocation = cdb.be32(10);
        let capacity = self.block_count();
        if start >= capacity {
            return Err(Sense::lba_out_of_range());
        }
        let bs = u64::from(self.settings.block_size);
        let wanted = (allocation.saturating_sub(8) / 16).clamp(1, LBA_STATUS_DESCRIPTORS_MAX);
        data_in.extend_from_slice(&[0; 8]);
        let mut lba = start;
        for _ in 0..wanted {
            if lba >= capacity {
                break;
            }
            let extent = self
                .store
                .mapping(lba << self.block_shift)
                .map_err(read_error)?;
            let end_byte = (lba << self.block_shift).saturating_add(extent.len);
            // A block only partly deallocated still holds data: it counts as mapped.
            let (mapped, mut end) = if extent.mapped {
                (true, end_byte.div_ceil(bs))
            } else {
                (false, end_byte / bs)
            };
            let mapped = mapped || end <= lba;
            if end <= lba {
                end = lba + 1;
            }
            let end = end.min(capacity);
            let blocks = u32::try_from(end - lba).unwrap_or(u32::MAX);
            data_in.extend_from_slice(&lba.to_be_bytes());
            data_in.extend_from_slice(&blocks.to_be_bytes());
            data_in.push(if mapped { 0 } else { 1 });
            data_in.extend_from_slice(&[0; 3]);
            lba += u64::from(blocks);
        }
        let len = (data_in.len() - 4) as u32;
        data_in[..4].copy_from_slice(&len.to_be_bytes());
        Ok(finish_data_in(data_in, allocation, cmd.data_in_limit))
    }

    pub(crate) fn read_defect_data(
        &self,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        // An emulated disk has no defects: an empty list in the requested format.
        if cdb.u8(0) == READ_DEFECT_DATA_10 {
            check_reserved(cdb, 2, 0x1F)?;
            data_in.extend_from_slice(&[0, cdb.u8(2) & 0x1F, 0, 0]);
            Ok(finish_data_in(
                data_in,
                u32::from(cdb.be16(7)),
                cmd.data_in_limit,
            ))
        } else {
            check_reserved(cdb, 1, 0x1F)?;
            data_in.extend_from_slice(&[0, cdb.u8(1) & 0x1F, 0, 0, 0, 0, 0, 0]);
            Ok(finish_data_in(data_in, cdb.be32(6), cmd.data_in_limit))
        }
    }
}
