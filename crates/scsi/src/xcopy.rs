//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 6.4, 6.18): the copy manager.
//!
//! Scope: identification descriptor target descriptors (E4h) naming a logical unit by its NAA
//! designator, block → block segment descriptors (02h), no inline or embedded data. The copy
//! source and destination are this LU or another LU of the same [`LunMap`] (the LUs the
//! initiator sees); a copy runs synchronously inside `execute`, after every segment has been
//! validated, so an error leaves the destinations untouched.

use crate::cdb::*;
use crate::lu::LogicalUnit;
use crate::lun_map::LunMap;
use crate::sense::{Sense, Stop, ILLEGAL_REQUEST};
use crate::{Command, Nexus};
use std::sync::atomic::Ordering;

pub const SA_EXTENDED_COPY_LID1: u16 = 0x00;
pub const SA_COPY_STATUS: u16 = 0x00;
pub const SA_OPERATING_PARAMETERS: u16 = 0x03;

/// Target descriptors per EXTENDED COPY.
pub(crate) const MAX_TARGET_DESCRIPTORS: u16 = 8;
/// Segment descriptors per EXTENDED COPY.
pub(crate) const MAX_SEGMENT_DESCRIPTORS: u16 = 32;
/// Bytes of target plus segment descriptors: exactly the maximum counts of the fixed-size
/// descriptors this copy manager accepts.
pub(crate) const MAX_DESCRIPTOR_LIST_BYTES: u32 = MAX_TARGET_DESCRIPTORS as u32
    * TARGET_DESCRIPTOR_BYTES as u32
    + MAX_SEGMENT_DESCRIPTORS as u32 * B2B_SEGMENT_BYTES as u32;
/// Bytes one segment may move.
pub(crate) const MAX_SEGMENT_BYTES: u32 = 32 << 20;
/// Bytes one EXTENDED COPY may move (the product of the two limits above: 1 GiB).
pub(crate) const MAX_COPY_BYTES: u64 = MAX_SEGMENT_DESCRIPTORS as u64 * MAX_SEGMENT_BYTES as u64;
/// Bytes read and written per step of a segment.
const CHUNK_BYTES: usize = 1 << 20;

const HEADER_BYTES: usize = 16;
const TARGET_DESCRIPTOR_BYTES: usize = 32;
const B2B_SEGMENT_BYTES: usize = 28;
const TYPE_BLOCK_TO_BLOCK: u8 = 0x02;
const TYPE_IDENTIFICATION: u8 = 0xE4;
/// Designator bytes an identification descriptor holds.
const DESIGNATOR_MAX: usize = 20;
const COPY_ABORTED: u8 = 0x0A;

fn too_many_target_descriptors() -> Sense {
    Sense::new(ILLEGAL_REQUEST, 0x26, 0x06)
}
fn unsupported_target_descriptor() -> Sense {
    Sense::new(ILLEGAL_REQUEST, 0x26, 0x07)
}
fn too_many_segment_descriptors() -> Sense {
    Sense::new(ILLEGAL_REQUEST, 0x26, 0x08)
}
fn unsupported_segment_descriptor() -> Sense {
    Sense::new(ILLEGAL_REQUEST, 0x26, 0x09)
}
/// COPY ABORTED / UNREACHABLE COPY TARGET (08h/04h): a segment names a target descriptor that
/// does not exist or a logical unit this copy manager cannot reach.
fn unreachable_target(segment: usize) -> Sense {
    Sense {
        info: Some(segment as u64),
        ..Sense::new(COPY_ABORTED, 0x08, 0x04)
    }
}
/// COPY ABORTED with no additional sense (00h/00h) and INFORMATION = the segment number: a
/// segment's blocks lie outside its source or destination.
fn segment_out_of_range(segment: usize) -> Sense {
    Sense {
        info: Some(segment as u64),
        ..Sense::new(COPY_ABORTED, 0x00, 0x00)
    }
}
fn bad_param(at: usize) -> Sense {
    Sense::invalid_field_in_parameter_list(at.min(u16::MAX as usize) as u16, None)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetDescriptor {
    /// Offset of the descriptor in the parameter list.
    pub offset: usize,
    pub code_set: u8,
    pub association: u8,
    pub designator_type: u8,
    pub designator: Vec<u8>,
    /// DISK BLOCK LENGTH (0: not given).
    pub block_len: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub offset: usize,
    pub src: u16,
    pub dst: u16,
    /// DC: NUMBER OF BLOCKS counts destination blocks.
    pub dc: bool,
    pub blocks: u16,
    pub src_lba: u64,
    pub dst_lba: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CopyParams {
    pub list_id: u8,
    pub list_id_usage: u8,
    pub targets: Vec<TargetDescriptor>,
    pub segments: Vec<Segment>,
}

/// Parses an EXTENDED COPY (LID1) parameter list; `None` for an empty one (no copy).
pub(crate) fn parse(p: &[u8]) -> Result<Option<CopyParams>, Sense> {
    if p.is_empty() {
        return Ok(None);
    }
    if p.len() < HEADER_BYTES {
        return Err(Sense::parameter_list_length_error());
    }
    let list_id = p[0];
    let list_id_usage = (p[1] >> 3) & 0x03;
    if list_id_usage == 0x01 {
        return Err(Sense::invalid_field_in_parameter_list(1, Some(4)));
    }
    let target_len = usize::from(param_be16(p, 2).unwrap_or(0));
    let segment_len = param_be32(p, 8).unwrap_or(0) as usize;
    let inline_len = param_be32(p, 12).unwrap_or(0) as usize;
    let needed = (HEADER_BYTES as u64) + target_len as u64 + segment_len as u64 + inline_len as u64;
    if needed > p.len() as u64 {
        return Err(Sense::parameter_list_length_error());
    }
    if target_len as u64 + segment_len as u64 > u64::from(MAX_DESCRIPTOR_LIST_BYTES) {
        return Err(Sense::parameter_list_length_error());
    }
    if inline_len != 0 {
        // MAXIMUM INLINE DATA LENGTH is zero.
        return Err(bad_param(12));
    }
    let targets_end = HEADER_BYTES + target_len;
    let mut targets = Vec::new();
    let mut at = HEADER_BYTES;
    while at < targets_end {
        if targets.len() >= usize::from(MAX_TARGET_DESCRIPTORS) {
            return Err(too_many_target_descriptors());
        }
        if p[at] != TYPE_IDENTIFICATION {
            return Err(unsupported_target_descriptor());
        }
        if at + TARGET_DESCRIPTOR_BYTES > targets_end {
            return Err(Sense::parameter_list_length_error());
        }
        let d = &p[at..at + TARGET_DESCRIPTOR_BYTES];
        // LU ID TYPE is ignored and NUL is obsolete (SPC-4); only block devices are copy targets.
        if d[1] & 0x1F != 0 {
            return Err(Sense::invalid_field_in_parameter_list(
                (at + 1) as u16,
                Some(4),
            ));
        }
        let designator_len = usize::from(d[7]);
        if designator_len > DESIGNATOR_MAX {
            return Err(bad_param(at + 7));
        }
        targets.push(TargetDescriptor {
            offset: at,
            code_set: d[4] & 0x0F,
            association: (d[5] >> 4) & 0x03,
            designator_type: d[5] & 0x0F,
            designator: d[8..8 + designator_len].to_vec(),
            block_len: (u32::from(d[29]) << 16) | (u32::from(d[30]) << 8) | u32::from(d[31]),
        });
        at += TARGET_DESCRIPTOR_BYTES;
    }
    let segments_end = targets_end + segment_len;
    let mut segments = Vec::new();
    while at < segments_end {
        if segments.len() >= usize::from(MAX_SEGMENT_DESCRIPTORS) {
            return Err(too_many_segment_descriptors());
        }
        if p[at] != TYPE_BLOCK_TO_BLOCK {
            return Err(unsupported_segment_descriptor());
        }
        if at + 4 > segments_end {
            return Err(Sense::parameter_list_length_error());
        }
        let len = usize::from(param_be16(p, at + 2).unwrap_or(0));
        if len != B2B_SEGMENT_BYTES - 4 {
            return Err(bad_param(at + 2));
        }
        if at + B2B_SEGMENT_BYTES > segments_end {
            return Err(Sense::parameter_list_length_error());
        }
        segments.push(Segment {
            offset: at,
            src: param_be16(p, at + 4).unwrap_or(0),
            dst: param_be16(p, at + 6).unwrap_or(0),
            dc: p[at + 1] & 0x02 != 0,
            blocks: param_be16(p, at + 10).unwrap_or(0),
            src_lba: param_be64(p, at + 12).unwrap_or(0),
            dst_lba: param_be64(p, at + 20).unwrap_or(0),
        });
        at += B2B_SEGMENT_BYTES;
    }
    Ok(Some(CopyParams {
        list_id,
        list_id_usage,
        targets,
        segments,
    }))
}

/// What COPY STATUS reports for a finished EXTENDED COPY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyRecord {
    pub segments: u16,
    pub bytes: u64,
}

/// A resolved copy target: the LU and whether the copy reaches it through a read-only
/// mapping.
struct Target<'a> {
    lu: &'a LogicalUnit,
    read_only_mapping: bool,
}

impl Target<'_> {
    /// The LU's gate ([`LogicalUnit::gate`]) for a command `opcode` of it, within segment
    /// `segment`: an LU the copy could reach only through its owner is out of reach here.
    fn pass_gate(&self, nexus: &Nexus, opcode: u8, segment: usize) -> Result<(), Stop> {
        let mut cdb = [0u8; 16];
        cdb[0] = opcode;
        match self.lu.gate(nexus, Cdb(&cdb), self.read_only_mapping)? {
            crate::lu::Reach::Here => Ok(()),
            crate::lu::Reach::Owner => Err(unreachable_target(segment).into()),
        }
    }
}

/// One validated segment, in bytes.
struct Job<'a> {
    src: &'a LogicalUnit,
    dst: &'a LogicalUnit,
    src_off: u64,
    dst_off: u64,
    bytes: u64,
}

impl LogicalUnit {
    fn matches_designator(&self, t: &TargetDescriptor) -> bool {
        t.designator_type == 0x03 && t.association == 0 && t.code_set == 0x01 && {
            let identity = self.identity();
            t.designator == identity.naa[..identity.naa_len]
        }
    }

    fn resolve<'a>(
        &'a self,
        t: &TargetDescriptor,
        read_only_mapping: bool,
        peers: Option<&'a LunMap>,
    ) -> Option<Target<'a>> {
        if self.matches_designator(t) {
            return Some(Target {
                lu: self,
                read_only_mapping,
            });
        }
        let entry = peers?
            .entries()
            .iter()
            .find(|e| e.lu.matches_designator(t))?;
        Some(Target {
            lu: &entry.lu,
            read_only_mapping: entry.read_only,
        })
    }

    /// EXTENDED COPY (LID1).
    pub(crate) fn extended_copy(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        read_only_mapping: bool,
        peers: Option<&LunMap>,
    ) -> Result<u32, Stop> {
        let cdb = Cdb(cmd.cdb);
        for byte in 2..=9 {
            check_reserved(cdb, byte, 0)?;
        }
        check_reserved(cdb, 14, 0)?;
        let list_len = cdb.be32(10);
        let have = (list_len as usize).min(cmd.data_out.len());
        let Some(params) = parse(&cmd.data_out[..have])? else {
            return Ok(list_len);
        };
        // Validate every segment before moving a byte.
        let mut jobs = Vec::with_capacity(params.segments.len());
        for (n, seg) in params.segments.iter().enumerate() {
            let target = |index: u16| {
                let t = params
                    .targets
                    .get(usize::from(index))
                    .ok_or_else(|| unreachable_target(n))?;
                let resolved = self
                    .resolve(t, read_only_mapping, peers)
                    .ok_or_else(|| unreachable_target(n))?;
                if t.block_len != 0 && t.block_len != resolved.lu.settings.block_size {
                    return Err(bad_param(t.offset + 29));
                }
                Ok::<_, Sense>(resolved)
            };
            let src = target(seg.src)?;
            let dst = target(seg.dst)?;
            let shift = if seg.dc {
                dst.lu.block_shift
            } else {
                src.lu.block_shift
            };
            let bytes = u64::from(seg.blocks) << shift;
            let whole = |lu: &LogicalUnit| bytes & ((1u64 << lu.block_shift) - 1) == 0;
            if bytes > u64::from(MAX_SEGMENT_BYTES) || !whole(src.lu) || !whole(dst.lu) {
                return Err(bad_param(seg.offset + 10).into());
            }
            // Every LU the copy touches, this one too, passes the gate a READ or a WRITE of it
            // would: a copy reaches no LU a plain command could not.
            src.pass_gate(nexus, READ_16, n)?;
            dst.pass_gate(nexus, WRITE_16, n)?;
            if bytes == 0 {
                continue;
            }
            src.lu
                .check_lba(seg.src_lba, bytes >> src.lu.block_shift)
                .map_err(|_| segment_out_of_range(n))?;
            dst.lu
                .check_lba(seg.dst_lba, bytes >> dst.lu.block_shift)
                .map_err(|_| segment_out_of_range(n))?;
            jobs.push(Job {
                src: src.lu,
                dst: dst.lu,
                src_off: seg.src_lba << src.lu.block_shift,
                dst_off: seg.dst_lba << dst.lu.block_shift,
                bytes,
            });
        }
        let total: u64 = jobs.iter().map(|j| j.bytes).sum();
        debug_assert!(total <= MAX_COPY_BYTES);
        // The other LUs count the copy as in flight as their own commands do (this one's hold
        // is the transport's), so a reset of any of them waits for it. A reset under way
        // aborts the copy: waiting here could deadlock a target reset that waits for this
        // LU's count.
        let mut holds = Vec::new();
        for lu in jobs.iter().flat_map(|j| [j.src, j.dst]) {
            if std::ptr::eq(lu, self) || holds.iter().any(|(held, _)| std::ptr::eq(*held, lu)) {
                continue;
            }
            let hold = lu
                .in_flight()
                .try_begin(nexus.id)
                .ok_or(Sense::reset_in_progress())?;
            holds.push((lu, hold));
        }
        // Made only when a job copies through memory: a copy the stores make needs none.
        let mut buf = Vec::new();
        for job in &jobs {
            copy_job(job, &mut buf)?;
        }
        if params.list_id_usage == 0 {
            self.copy_results
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    (nexus.id, params.list_id),
                    CopyRecord {
                        segments: params.segments.len() as u16,
                        bytes: total,
                    },
                );
        }
        Ok(list_len)
    }

    /// RECEIVE COPY RESULTS: COPY STATUS and OPERATING PARAMETERS.
    pub(crate) fn receive_copy_results(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        for byte in 3..=9 {
            check_reserved(cdb, byte, 0)?;
        }
        check_reserved(cdb, 14, 0)?;
        match cdb.service_action() {
            SA_COPY_STATUS => {
                let list_id = cdb.u8(2);
                // Copies finish inside EXTENDED COPY, so a held status is always "completed";
                // it is discarded once reported.
                let record = self
                    .copy_results
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&(nexus.id, list_id))
                    .ok_or_else(|| Sense::invalid_field_in_cdb(2, None))?;
                put_copy_status(data_in, record);
            }
            _ => put_operating_parameters(data_in, self.block_shift),
        }
        Ok(finish_data_in(data_in, cdb.be32(10), cmd.data_in_limit))
    }

    /// Forgets the copy results held for a nexus.
    pub(crate) fn drop_copy_results(&self, nexus_id: u64) {
        self.copy_results
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(n, _), _| *n != nexus_id);
    }
}

/// Copies a segment without its bytes passing through here and says whether it did: between
/// two file stores inside the kernel (`store::clone::copy_range`: shared extents on XFS and
/// btrfs, an in-kernel copy elsewhere), between two RAM stores by sharing pages
/// (`RamStore::share_from`). False when the stores cannot (block devices and RBD images have
/// no range clone; a kernel that refuses; RAM offsets that lie differently within a page),
/// and the copy goes through memory.
fn copied_by_store(job: &Job<'_>, durable: bool) -> Result<bool, Sense> {
    if let (Some(from), Some(to)) = (job.src.store.ram(), job.dst.store.ram()) {
        let _order = job.dst.write_order.read();
        return to
            .share_from(from, job.src_off, job.dst_off, job.bytes)
            .map_err(|_| Sense::medium_error_write());
    }
    let (Some(from), Some(to)) = (job.src.store.copy_file(), job.dst.store.copy_file()) else {
        return Ok(false);
    };
    let _order = job.dst.write_order.read();
    match store::clone::copy_range(from, job.src_off, to, job.dst_off, job.bytes) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::Unsupported => return Ok(false),
        Err(_) => return Err(Sense::medium_error_write()),
    }
    if durable {
        job.dst
            .store
            .flush()
            .map_err(|_| Sense::medium_error_write())?;
    }
    Ok(true)
}

fn copy_job(job: &Job<'_>, buf: &mut Vec<u8>) -> Result<(), Sense> {
    let same = std::ptr::eq(job.src, job.dst);
    // Overlapping ranges of one LU with the destination above the source are copied from the
    // end, so no block is read after it was overwritten.
    let backwards = same && job.dst_off > job.src_off && job.dst_off < job.src_off + job.bytes;
    let durable = !job.dst.mode.wce.load(Ordering::Relaxed);
    if !backwards && copied_by_store(job, durable)? {
        return Ok(());
    }
    let want = (job.bytes as usize).min(CHUNK_BYTES);
    if buf.len() < want {
        buf.resize(want, 0);
    }
    let mut done = 0u64;
    while done < job.bytes {
        let n = (job.bytes - done).min(buf.len() as u64);
        let at = if backwards {
            job.bytes - done - n
        } else {
            done
        };
        let chunk = &mut buf[..n as usize];
        job.src
            .store
            .read_at(chunk, job.src_off + at)
            .map_err(|_| Sense::medium_error_unrecovered_read())?;
        let _order = job.dst.write_order.read();
        job.dst
            .store
            .write_at(chunk, job.dst_off + at, durable)
            .map_err(|_| Sense::medium_error_write())?;
        done += n;
    }
    Ok(())
}

fn put_copy_status(out: &mut Vec<u8>, r: CopyRecord) {
    out.extend_from_slice(&8u32.to_be_bytes());
    out.push(0x00); // HDD=0, COPY MANAGER STATUS: completed without errors
    out.extend_from_slice(&r.segments.to_be_bytes());
    out.push(0x00); // TRANSFER COUNT UNITS: bytes
    out.extend_from_slice(&(r.bytes.min(u64::from(u32::MAX)) as u32).to_be_bytes());
}

fn put_operating_parameters(out: &mut Vec<u8>, block_shift: u32) {
    out.extend_from_slice(&[0; 4]);
    out.push(0x01); // SNLID: list identifiers are held (LIST ID USAGE 00b)
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&MAX_TARGET_DESCRIPTORS.to_be_bytes());
    out.extend_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
    out.extend_from_slice(&MAX_DESCRIPTOR_LIST_BYTES.to_be_bytes());
    out.extend_from_slice(&MAX_SEGMENT_BYTES.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes()); // maximum inline data length
    out.extend_from_slice(&0u32.to_be_bytes()); // held data limit
    out.extend_from_slice(&0u32.to_be_bytes()); // maximum stream device transfer size
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&1u16.to_be_bytes()); // total concurrent copies
    out.push(1); // maximum concurrent copies
    out.push(block_shift as u8); // data segment granularity (log2 bytes)
    out.push(0); // inline data granularity
    out.push(0); // held data granularity
    out.extend_from_slice(&[0; 3]);
    let implemented = [TYPE_BLOCK_TO_BLOCK, TYPE_IDENTIFICATION];
    out.push(implemented.len() as u8);
    out.extend_from_slice(&implemented);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAA: [u8; 8] = [0x50, 1, 2, 3, 4, 5, 6, 7];

    fn target(naa: &[u8]) -> Vec<u8> {
        let mut d = vec![0u8; 32];
        d[0] = TYPE_IDENTIFICATION;
        d[4] = 0x01;
        d[5] = 0x03;
        d[7] = naa.len() as u8;
        d[8..8 + naa.len()].copy_from_slice(naa);
        d[30] = 0x02; // 512
        d
    }

    fn segment(src: u16, dst: u16, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
        let mut d = vec![0u8; 28];
        d[0] = TYPE_BLOCK_TO_BLOCK;
        d[3] = 0x18;
        d[4..6].copy_from_slice(&src.to_be_bytes());
        d[6..8].copy_from_slice(&dst.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&src_lba.to_be_bytes());
        d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
        d
    }

    fn list(list_id: u8, usage: u8, targets: &[Vec<u8>], segments: &[Vec<u8>]) -> Vec<u8> {
        let t: Vec<u8> = targets.concat();
        let s: Vec<u8> = segments.concat();
        let mut p = vec![0u8; 16];
        p[0] = list_id;
        p[1] = usage << 3;
        p[2..4].copy_from_slice(&(t.len() as u16).to_be_bytes());
        p[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
        p.extend_from_slice(&t);
        p.extend_from_slice(&s);
        p
    }

    fn asc(s: Sense) -> (u8, u8, u8) {
        (s.key, s.asc, s.ascq)
    }

    #[test]
    fn parses_one_target_one_segment() {
        let p = list(7, 0, &[target(&NAA)], &[segment(0, 0, 2048, 1, 9000)]);
        let c = parse(&p).unwrap().unwrap();
        assert_eq!(c.list_id, 7);
        assert_eq!(c.list_id_usage, 0);
        assert_eq!(c.targets.len(), 1);
        assert_eq!(c.targets[0].designator, NAA);
        assert_eq!(c.targets[0].designator_type, 3);
        assert_eq!(c.targets[0].code_set, 1);
        assert_eq!(c.targets[0].block_len, 512);
        assert_eq!(
            c.segments,
            vec![Segment {
                offset: 48,
                src: 0,
                dst: 0,
                dc: false,
                blocks: 2048,
                src_lba: 1,
                dst_lba: 9000
            }]
        );
    }

    #[test]
    fn empty_list_is_no_copy() {
        assert_eq!(parse(&[]).unwrap(), None);
    }

    #[test]
    fn length_errors() {
        let p = list(1, 0, &[target(&NAA)], &[segment(0, 0, 1, 0, 0)]);
        let plle = (ILLEGAL_REQUEST, 0x1A, 0x00);
        assert_eq!(asc(parse(&p[..10]).unwrap_err()), plle);
        assert_eq!(asc(parse(&p[..16 + 31]).unwrap_err()), plle);
        assert_eq!(asc(parse(&p[..p.len() - 1]).unwrap_err()), plle);
        // A target descriptor list that is not a whole descriptor.
        let mut q = list(1, 0, &[target(&NAA)[..20].to_vec()], &[]);
        q.extend_from_slice(&[0; 12]);
        assert_eq!(asc(parse(&q).unwrap_err()), plle);
        // A segment cut short inside its list.
        let q = list(
            1,
            0,
            &[target(&NAA)],
            &[segment(0, 0, 1, 0, 0)[..20].to_vec()],
        );
        assert_eq!(asc(parse(&q).unwrap_err()), plle);
        // Descriptor lists beyond the maximum descriptor list length.
        let t = vec![target(&NAA); MAX_TARGET_DESCRIPTORS as usize + 1];
        let s = vec![segment(0, 0, 1, 0, 0); MAX_SEGMENT_DESCRIPTORS as usize + 1];
        assert_eq!(asc(parse(&list(1, 0, &t, &s)).unwrap_err()), plle);
    }

    #[test]
    fn descriptor_count_limits() {
        let t = vec![target(&NAA); MAX_TARGET_DESCRIPTORS as usize + 1];
        let s = vec![segment(0, 0, 1, 0, 0)];
        assert_eq!(
            asc(parse(&list(1, 0, &t, &s)).unwrap_err()),
            (ILLEGAL_REQUEST, 0x26, 0x06)
        );
        let s = vec![segment(0, 0, 1, 0, 0); MAX_SEGMENT_DESCRIPTORS as usize + 1];
        assert_eq!(
            asc(parse(&list(2, 0, &[target(&NAA)], &s)).unwrap_err()),
            (ILLEGAL_REQUEST, 0x26, 0x08)
        );
        // Exactly at the limits is accepted.
        let t = vec![target(&NAA); MAX_TARGET_DESCRIPTORS as usize];
        let s = vec![segment(0, 0, 1, 0, 0); MAX_SEGMENT_DESCRIPTORS as usize];
        assert!(parse(&list(3, 0, &t, &s)).is_ok());
    }

    #[test]
    fn unsupported_descriptor_types() {
        let mut t = target(&NAA);
        t[0] = 0xE0;
        assert_eq!(
            asc(parse(&list(1, 0, &[t], &[segment(0, 0, 1, 0, 0)])).unwrap_err()),
            (ILLEGAL_REQUEST, 0x26, 0x07)
        );
        let mut s = segment(0, 0, 1, 0, 0);
        s[0] = 0x03;
        assert_eq!(
            asc(parse(&list(1, 0, &[target(&NAA)], &[s])).unwrap_err()),
            (ILLEGAL_REQUEST, 0x26, 0x09)
        );
    }

    #[test]
    fn invalid_fields() {
        let bad = |p: &[u8]| asc(parse(p).unwrap_err());
        let ifpl = (ILLEGAL_REQUEST, 0x26, 0x00);
        // LIST ID USAGE 01b is reserved.
        assert_eq!(bad(&list(1, 1, &[target(&NAA)], &[])), ifpl);
        // Inline data is not supported.
        let mut p = list(1, 0, &[target(&NAA)], &[]);
        p[15] = 4;
        p.extend_from_slice(&[0; 4]);
        assert_eq!(bad(&p), ifpl);
        // A peripheral device type other than block.
        let mut t = target(&NAA);
        t[1] = 0x01;
        assert_eq!(bad(&list(1, 0, &[t], &[])), ifpl);
        // A designator longer than the descriptor holds.
        let mut t = target(&NAA);
        t[7] = 21;
        assert_eq!(bad(&list(1, 0, &[t], &[])), ifpl);
        // A block → block descriptor with the wrong DESCRIPTOR LENGTH.
        let mut s = segment(0, 0, 1, 0, 0);
        s[3] = 0x14;
        assert_eq!(bad(&list(1, 0, &[target(&NAA)], &[s])), ifpl);
    }

    #[test]
    fn lu_id_type_and_nul_are_ignored() {
        let mut t = target(&NAA);
        t[1] = 0x80 | 0x20;
        assert!(parse(&list(1, 0, &[t], &[segment(0, 0, 1, 0, 0)])).is_ok());
    }

    #[test]
    fn operating_parameters_are_consistent() {
        let mut out = Vec::new();
        put_operating_parameters(&mut out, 9);
        assert_eq!(out.len(), 46);
        assert_eq!(u32::from_be_bytes(out[0..4].try_into().unwrap()), 42);
        assert_eq!(u16::from_be_bytes([out[8], out[9]]), MAX_TARGET_DESCRIPTORS);
        assert_eq!(
            u16::from_be_bytes([out[10], out[11]]),
            MAX_SEGMENT_DESCRIPTORS
        );
        assert_eq!(
            u32::from_be_bytes(out[12..16].try_into().unwrap()),
            MAX_DESCRIPTOR_LIST_BYTES
        );
        assert_eq!(out[43], 2);
        assert_eq!(&out[44..], &[0x02, 0xE4]);
        assert_eq!(MAX_COPY_BYTES, 1 << 30);
        // libiscsi's descriptor-limit probes: one descriptor over either count fits the list
        // length (so the count error is reported), both over do not.
        let t = TARGET_DESCRIPTOR_BYTES as u32;
        let s = B2B_SEGMENT_BYTES as u32;
        let (mt, ms) = (
            u32::from(MAX_TARGET_DESCRIPTORS),
            u32::from(MAX_SEGMENT_DESCRIPTORS),
        );
        assert!((mt + 1) * t + s <= MAX_DESCRIPTOR_LIST_BYTES);
        assert!(t + (ms + 1) * s <= MAX_DESCRIPTOR_LIST_BYTES);
        assert!((mt + 1) * t + (ms + 1) * s > MAX_DESCRIPTOR_LIST_BYTES);
    }
}
