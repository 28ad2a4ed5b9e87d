//! NVM commands as SCSI block commands, and SCSI answers as NVMe status: the bridge that lets
//! a namespace be the same logical unit an iSCSI initiator reaches, with the same gates
//! (offline, ALUA, reservations, read-only, in-flight guards) deciding both. Bytes only: this
//! crate knows no SCSI semantics beyond the CDB layouts (SBC-4) and sense fields (SPC-4) it
//! writes and reads.

use std::borrow::Cow;

use crate::nvm::{self, AcquireAction, Blocks, Cptpl, IoCommand, RegisterAction, ReservationType};
use crate::queue::QUEUE_FULL;
use crate::sqe::Status;

/// A CDB of at most 16 bytes, held in place: a command translated per I/O allocates nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cdb {
    bytes: [u8; 16],
    len: u8,
}

impl Cdb {
    /// A zeroed CDB of `len` bytes (6, 10, 12 or 16).
    fn zeroed(len: usize) -> Cdb {
        assert!(len <= 16, "a CDB of {len} bytes");
        Cdb {
            bytes: [0; 16],
            len: len as u8,
        }
    }
}

impl std::ops::Deref for Cdb {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::ops::DerefMut for Cdb {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[..usize::from(self.len)]
    }
}

/// A SCSI command standing for an NVM command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScsiCommand<'a> {
    pub cdb: Cdb,
    /// Its Data-Out: the NVMe command's data where it lies (a write's, in the receive buffer),
    /// or built where SCSI's layout differs.
    pub data_out: Cow<'a, [u8]>,
    /// The Data-In it may return.
    pub data_in_len: u32,
    pub read: bool,
    pub write: bool,
}

const READ_16: u8 = 0x88;
const WRITE_16: u8 = 0x8A;
const VERIFY_16: u8 = 0x8F;
const SYNCHRONIZE_CACHE_16: u8 = 0x91;
const WRITE_SAME_16: u8 = 0x93;
const UNMAP: u8 = 0x42;
const MODE_SELECT_10: u8 = 0x55;
const COMPARE_AND_WRITE: u8 = 0x89;
const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
const PERSISTENT_RESERVE_IN: u8 = 0x5E;

/// What stops a command from becoming a SCSI one: answered with this status.
pub type Refusal = Status;

fn cdb16(op: u8, byte1: u8, blocks: Blocks) -> Cdb {
    let mut c = Cdb::zeroed(16);
    c[0] = op;
    c[1] = byte1;
    c[2..10].copy_from_slice(&blocks.slba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.count.to_be_bytes());
    c
}

fn bytes(blocks: Blocks, block_size: u32) -> Result<u32, Refusal> {
    u32::try_from(u64::from(blocks.count) * u64::from(block_size))
        .map_err(|_| Status::DATA_SGL_LENGTH_INVALID)
}

/// The SCSI command for I/O command `command` with its `data` (what the host sent), on a
/// namespace of `block_size`-byte blocks. Reservation Report is [`reservation_report`] (its
/// answer is reshaped by [`reservation_status`]).
pub fn scsi_command<'a>(
    command: &IoCommand,
    data: &'a [u8],
    block_size: u32,
) -> Result<ScsiCommand<'a>, Refusal> {
    const FUA: u8 = 0x08;
    let plain = |cdb, data_out: &'a [u8], data_in_len, read, write| ScsiCommand {
        cdb,
        data_out: Cow::Borrowed(data_out),
        data_in_len,
        read,
        write,
    };
    Ok(match *command {
        IoCommand::Read { blocks, fua } => {
            let len = bytes(blocks, block_size)?;
            let f = if fua { FUA } else { 0 };
            plain(cdb16(READ_16, f, blocks), data, len, true, false)
        }
        IoCommand::Write { blocks, fua } => {
            let len = bytes(blocks, block_size)?;
            if data.len() != len as usize {
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            let f = if fua { FUA } else { 0 };
            plain(cdb16(WRITE_16, f, blocks), data, 0, false, true)
        }
        IoCommand::Compare { blocks } => {
            let len = bytes(blocks, block_size)?;
            if data.len() != len as usize {
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            // VERIFY (16) with BYTCHK 01b: the medium against the data, MISCOMPARE if not.
            plain(cdb16(VERIFY_16, 0x02, blocks), data, 0, false, true)
        }
        IoCommand::Flush => {
            let whole = Blocks { slba: 0, count: 0 };
            plain(cdb16(SYNCHRONIZE_CACHE_16, 0, whole), data, 0, false, false)
        }
        IoCommand::WriteZeroes {
            blocks,
            deallocate,
            fua,
        } => {
            // WRITE SAME has no FUA: a write-back device would answer before the zeroes are
            // durable, which FUA forbids. The driver runs such a command as two
            // ([`split_fua_write_zeroes`]); one CDB cannot say it, so it is refused here.
            if fua {
                return Err(Status::INVALID_FIELD);
            }
            // NDOB: no Data-Out, the pattern is zeros; UNMAP where the host allows it.
            let f = 0x01 | if deallocate { 0x08 } else { 0 };
            plain(cdb16(WRITE_SAME_16, f, blocks), &[], 0, false, true)
        }
        IoCommand::DatasetManagement { ranges, .. } => {
            // Exactly the ranges NR says (at most 256): the UNMAP parameter list's lengths are
            // 16-bit, and data beyond them is the host's error, not more ranges.
            if data.len() != usize::from(ranges) * 16 {
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            unmap(&nvm::dsm_ranges(data))
        }
        IoCommand::ReservationRegister {
            action,
            ignore_key,
            cptpl,
        } => {
            let (crkey, nrkey) = nvm::reservation_keys(data).ok_or(Status::INVALID_FIELD)?;
            let sa = if ignore_key { 0x06 } else { 0x00 };
            let (key, sa_key) = match action {
                RegisterAction::Register => (if ignore_key { 0 } else { crkey }, nrkey),
                RegisterAction::Unregister => (crkey, 0),
                RegisterAction::Replace => (crkey, nrkey),
            };
            pr_out(sa, 0, key, sa_key, cptpl == Cptpl::Set)
        }
        IoCommand::ReservationAcquire {
            action,
            ignore_key,
            rtype,
        } => {
            if ignore_key {
                return Err(Status::INVALID_FIELD);
            }
            let (crkey, prkey) = nvm::reservation_keys(data).ok_or(Status::INVALID_FIELD)?;
            let rtype = rtype.ok_or(Status::INVALID_FIELD)?.spc_type();
            match action {
                AcquireAction::Acquire => pr_out(0x01, rtype, crkey, 0, false),
                AcquireAction::Preempt => pr_out(0x04, rtype, crkey, prkey, false),
                AcquireAction::PreemptAndAbort => pr_out(0x05, rtype, crkey, prkey, false),
            }
        }
        IoCommand::ReservationRelease {
            clear,
            ignore_key,
            rtype,
        } => {
            if ignore_key {
                return Err(Status::INVALID_FIELD);
            }
            let crkey = data
                .get(..8)
                .and_then(|k| k.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or(Status::INVALID_FIELD)?;
            if clear {
                pr_out(0x03, 0, crkey, 0, false)
            } else {
                let t = rtype.map_or(0, |t| t.spc_type());
                pr_out(0x02, t, crkey, 0, false)
            }
        }
        IoCommand::ReservationReport { .. } => reservation_report(),
    })
}

/// PERSISTENT RESERVE IN, READ FULL STATUS: the whole table, for a Reservation Report.
/// Write Zeroes with FUA as SCSI can run it: the same Write Zeroes without FUA, then
/// SYNCHRONIZE CACHE (16) of its blocks, the command answered when both are done (the
/// zeroes are then on the medium, as FUA asks). None for any other command.
pub fn split_fua_write_zeroes(command: &IoCommand) -> Option<(IoCommand, ScsiCommand<'static>)> {
    let IoCommand::WriteZeroes {
        blocks,
        deallocate,
        fua: true,
    } = *command
    else {
        return None;
    };
    let plain = IoCommand::WriteZeroes {
        blocks,
        deallocate,
        fua: false,
    };
    let sync = ScsiCommand {
        cdb: cdb16(SYNCHRONIZE_CACHE_16, 0, blocks),
        data_out: Cow::Borrowed(&[]),
        data_in_len: 0,
        read: false,
        write: false,
    };
    Some((plain, sync))
}

/// MODE SELECT (10) of the caching mode page with WCE `on`: Set Features (Volatile Write
/// Cache) is the device's write cache, one setting with the WCE an iSCSI initiator selects.
pub fn write_cache(on: bool) -> ScsiCommand<'static> {
    const LEN: usize = 8 + 20;
    let mut data = vec![0u8; LEN];
    data[8] = 0x08; // the caching mode page, 18 bytes after its header
    data[9] = 0x12;
    data[10] = if on { 0x04 } else { 0 };
    let mut cdb = Cdb::zeroed(10);
    cdb[0] = MODE_SELECT_10;
    cdb[1] = 0x10; // PF: the pages are in the standard format
    cdb[7..9].copy_from_slice(&(LEN as u16).to_be_bytes());
    ScsiCommand {
        cdb,
        data_out: Cow::Owned(data),
        data_in_len: 0,
        read: false,
        write: true,
    }
}

pub fn reservation_report() -> ScsiCommand<'static> {
    let mut cdb = Cdb::zeroed(10);
    cdb[0] = PERSISTENT_RESERVE_IN;
    cdb[1] = 0x03;
    cdb[7..9].copy_from_slice(&u16::MAX.to_be_bytes());
    ScsiCommand {
        cdb,
        data_out: Cow::Borrowed(&[]),
        data_in_len: u32::from(u16::MAX),
        read: true,
        write: false,
    }
}

/// The Reservation Status data structure (NVMe base 2.0, figures 564-566) a Reservation Report
/// answers, from READ FULL STATUS's parameter data: the generation, the reservation's type,
/// and a registrant entry per registration (an I_T nexus: a host through one port, with its
/// host identifier when it is an NVMe host's; controller ID FFFFh, as SCSI does not know it).
/// `extended`: 64-byte entries with 128-bit host identifiers. `ptpl`: the reservations persist
/// through power loss (APTPL is active), which READ FULL STATUS does not carry. Cut to `len`
/// bytes.
pub fn reservation_status(full: &[u8], extended: bool, ptpl: bool, len: usize) -> Vec<u8> {
    let be32 = |b: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
    };
    let generation = be32(full, 0).unwrap_or(0);
    let listed = be32(full, 4).unwrap_or(0) as usize;
    let body = full
        .get(8..8 + listed.min(full.len().saturating_sub(8)))
        .unwrap_or(&[]);
    let mut entries = Vec::new();
    let mut rtype = 0u8;
    let mut at = 0;
    while let Some(d) = body.get(at..at + 24) {
        let key = u64::from_be_bytes(d[..8].try_into().unwrap_or([0; 8]));
        let holder = d[12] & 1 != 0;
        if holder {
            rtype = ReservationType::from_spc(d[13] & 0x0F).map_or(0, |t| t as u8);
        }
        let tid_len = be32(d, 20).unwrap_or(0) as usize;
        let tid = body.get(at + 24..at + 24 + tid_len).unwrap_or(&[]);
        entries.push((key, holder, host_id(tid)));
        at += 24 + tid_len;
    }
    let (header, entry) = if extended { (64, 64) } else { (24, 24) };
    let mut d = vec![0u8; header];
    d[0..4].copy_from_slice(&generation.to_le_bytes());
    d[4] = rtype;
    d[5..7].copy_from_slice(&(entries.len().min(usize::from(u16::MAX)) as u16).to_le_bytes());
    d[9] = u8::from(ptpl);
    for (key, holder, id) in entries {
        let mut e = vec![0u8; entry];
        e[0..2].copy_from_slice(&u16::MAX.to_le_bytes());
        e[2] = u8::from(holder);
        if extended {
            e[8..16].copy_from_slice(&key.to_le_bytes());
            e[16..32].copy_from_slice(&id);
        } else {
            e[8..16].copy_from_slice(&id[..8]);
            e[16..24].copy_from_slice(&key.to_le_bytes());
        }
        d.extend_from_slice(&e);
    }
    d.resize(len, 0);
    d
}

/// An NVMe host's identifier from the TransportID of its registration (its initiator port is
/// `HOSTNQN,h,0x<32 hex digits>`); zeros for an iSCSI initiator's.
fn host_id(tid: &[u8]) -> [u8; 16] {
    let mut id = [0u8; 16];
    let name = tid.get(4..).unwrap_or(&[]);
    let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
    let Ok(name) = std::str::from_utf8(name) else {
        return id;
    };
    let Some((_, hex)) = name.rsplit_once(",h,0x") else {
        return id;
    };
    if hex.len() != 32 {
        return id;
    }
    for (i, byte) in id.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap_or(0);
    }
    id
}

/// UNMAP with a descriptor per range (SBC-4 5.32): a range of no blocks is dropped.
fn unmap(ranges: &[Blocks]) -> ScsiCommand<'static> {
    let ranges: Vec<&Blocks> = ranges.iter().filter(|r| r.count > 0).collect();
    let mut p = vec![0u8; 8];
    for r in &ranges {
        p.extend_from_slice(&r.slba.to_be_bytes());
        p.extend_from_slice(&r.count.to_be_bytes());
        p.extend_from_slice(&[0; 4]);
    }
    let len = p.len();
    p[0..2].copy_from_slice(&((len - 2) as u16).to_be_bytes());
    p[2..4].copy_from_slice(&((len - 8) as u16).to_be_bytes());
    let mut cdb = Cdb::zeroed(10);
    cdb[0] = UNMAP;
    cdb[7..9].copy_from_slice(&(len as u16).to_be_bytes());
    ScsiCommand {
        cdb,
        data_out: Cow::Owned(p),
        data_in_len: 0,
        read: false,
        write: true,
    }
}

/// PERSISTENT RESERVE OUT, scope LU, with a 24-byte parameter list. A registration is the
/// host's through the port it came by (SPC-4's I_T nexus), as for an iSCSI initiator; NVMe
/// makes it the host's through every controller (docs/NVME.md names the difference).
fn pr_out(sa: u8, rtype: u8, key: u64, sa_key: u64, aptpl: bool) -> ScsiCommand<'static> {
    let mut cdb = Cdb::zeroed(10);
    cdb[0] = PERSISTENT_RESERVE_OUT;
    cdb[1] = sa;
    cdb[2] = rtype & 0x0F;
    cdb[8] = 24;
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p[20] = u8::from(aptpl);
    ScsiCommand {
        cdb,
        data_out: Cow::Owned(p),
        data_in_len: 0,
        read: false,
        write: false,
    }
}

/// The fused Compare and Write pair as COMPARE AND WRITE (SBC-4 5.3): the first command's data
/// to compare, the second's to write, the same blocks (at most 255).
pub fn compare_and_write(
    compare: &IoCommand,
    compare_data: &[u8],
    write: &IoCommand,
    write_data: &[u8],
    block_size: u32,
) -> Result<ScsiCommand<'static>, Refusal> {
    let (IoCommand::Compare { blocks: c }, IoCommand::Write { blocks: w, fua }) = (compare, write)
    else {
        return Err(Status::ABORTED_FUSE_FAILED);
    };
    if c != w || c.count > 255 {
        return Err(Status::INVALID_FIELD);
    }
    let len = bytes(*c, block_size)? as usize;
    if compare_data.len() != len || write_data.len() != len {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    let mut cdb = Cdb::zeroed(16);
    cdb[0] = COMPARE_AND_WRITE;
    cdb[1] = if *fua { 0x08 } else { 0 };
    cdb[2..10].copy_from_slice(&c.slba.to_be_bytes());
    cdb[13] = c.count as u8;
    let mut data_out = Vec::with_capacity(len * 2);
    data_out.extend_from_slice(compare_data);
    data_out.extend_from_slice(write_data);
    Ok(ScsiCommand {
        cdb,
        data_out: Cow::Owned(data_out),
        data_in_len: 0,
        read: false,
        write: true,
    })
}

/// Namespace Is Write Protected (generic 20h).
pub const WRITE_PROTECTED: Status = Status {
    sct: 0,
    sc: 0x20,
    dnr: true,
};
/// Media errors (type 2): Write Fault, Unrecovered Read Error.
pub const WRITE_FAULT: Status = Status {
    sct: 2,
    sc: 0x80,
    dnr: false,
};
pub const UNRECOVERED_READ_ERROR: Status = Status {
    sct: 2,
    sc: 0x81,
    dnr: false,
};

/// The sense key, ASC and ASCQ of fixed (70h/71h) or descriptor (72h/73h) sense data.
pub fn sense_fields(sense: &[u8]) -> Option<(u8, u8, u8)> {
    match sense.first()? & 0x7F {
        0x70 | 0x71 => Some((sense.get(2)? & 0x0F, *sense.get(12)?, *sense.get(13)?)),
        0x72 | 0x73 => Some((sense.get(1)? & 0x0F, *sense.get(2)?, *sense.get(3)?)),
        _ => None,
    }
}

/// The NVMe status for a SCSI status and its sense data: one table, so both doors fail the
/// same way for the same reason.
pub fn status_of(scsi_status: u8, sense: &[u8]) -> Status {
    match scsi_status {
        0x00 => Status::SUCCESS,
        0x18 => Status::RESERVATION_CONFLICT,
        0x08 | 0x28 => QUEUE_FULL,
        0x02 => match sense_fields(sense) {
            Some((key, asc, ascq)) => check_condition(key, asc, ascq),
            None => Status::INTERNAL_ERROR,
        },
        _ => Status::INTERNAL_ERROR,
    }
}

fn check_condition(key: u8, asc: u8, ascq: u8) -> Status {
    match (key, asc, ascq) {
        (0x05, 0x20, _) => Status::INVALID_OPCODE,
        (0x05, 0x21, _) => Status::LBA_OUT_OF_RANGE,
        (0x05, 0x25, _) => Status::INVALID_NAMESPACE,
        // INSUFFICIENT REGISTRATION RESOURCES: NVMe has no status of its own for a full
        // registrant table. Not Invalid Field (the command was well formed): an internal
        // error without DNR, as SPDK answers it, which the host may retry once an operator
        // cleared the table (`ctl device clear-reservations`).
        (0x05, 0x55, 0x04) => Status::INTERNAL_ERROR,
        (0x05, _, _) => Status::INVALID_FIELD,
        // SPACE ALLOCATION FAILED WRITE PROTECT: the thin store is out of room (Linux turns
        // both into ENOSPC).
        (0x07, 0x27, 0x07) => Status::CAPACITY_EXCEEDED,
        (0x07, 0x27, _) => WRITE_PROTECTED,
        (0x07, _, _) => Status::ACCESS_DENIED,
        (0x0E, _, _) => Status::COMPARE_FAILURE,
        (0x02, 0x04, 0x0A) => Status::ANA_TRANSITION,
        (0x02, 0x04, 0x0B | 0x0C) => Status::ANA_INACCESSIBLE,
        (0x02, _, _) => Status::NAMESPACE_NOT_READY,
        (0x03, 0x11, _) => UNRECOVERED_READ_ERROR,
        (0x03, _, _) => WRITE_FAULT,
        // An NVMe nexus is given no unit attentions; one that arrives anyway, or a command
        // aborted on the way, is retried by the host.
        (0x06 | 0x0B, _, _) => QUEUE_FULL,
        _ => Status::INTERNAL_ERROR,
    }
}

#[cfg(test)]
mod tests;
