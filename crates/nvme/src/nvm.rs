//! The NVM command set's I/O commands (NVM command set specification 1.0, section 3; NVMe base
//! 2.0, 7 for reservations), decoded from a submission queue entry into what they ask, with
//! every field a controller must check checked. Running them is the engine's: it hands them to
//! the same logical unit an iSCSI initiator reaches, so reservations, write protection, ALUA/ANA
//! and the in-flight guards are decided in one place whatever the door.

use crate::sqe::{Sqe, Status};

/// NVM command set opcodes.
pub mod opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const COMPARE: u8 = 0x05;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
    pub const RESERVATION_REGISTER: u8 = 0x0D;
    pub const RESERVATION_REPORT: u8 = 0x0E;
    pub const RESERVATION_ACQUIRE: u8 = 0x11;
    pub const RESERVATION_RELEASE: u8 = 0x15;
}

/// A range of logical blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks {
    pub slba: u64,
    /// Number of blocks (not 0's based: 1..=65536).
    pub count: u32,
}

/// A reservation type (NVMe base 2.0, figure 548), numbered as on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReservationType {
    WriteExclusive = 1,
    ExclusiveAccess = 2,
    WriteExclusiveRegistrantsOnly = 3,
    ExclusiveAccessRegistrantsOnly = 4,
    WriteExclusiveAllRegistrants = 5,
    ExclusiveAccessAllRegistrants = 6,
}

impl ReservationType {
    pub fn from_u8(raw: u8) -> Option<ReservationType> {
        Some(match raw {
            1 => ReservationType::WriteExclusive,
            2 => ReservationType::ExclusiveAccess,
            3 => ReservationType::WriteExclusiveRegistrantsOnly,
            4 => ReservationType::ExclusiveAccessRegistrantsOnly,
            5 => ReservationType::WriteExclusiveAllRegistrants,
            6 => ReservationType::ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }

    /// The same reservation in SPC-4's numbering (PERSISTENT RESERVE OUT TYPE): the two
    /// protocols' six types are the same six.
    pub fn spc_type(self) -> u8 {
        match self {
            ReservationType::WriteExclusive => 1,
            ReservationType::ExclusiveAccess => 3,
            ReservationType::WriteExclusiveRegistrantsOnly => 5,
            ReservationType::ExclusiveAccessRegistrantsOnly => 6,
            ReservationType::WriteExclusiveAllRegistrants => 7,
            ReservationType::ExclusiveAccessAllRegistrants => 8,
        }
    }

    /// From SPC-4's numbering.
    pub fn from_spc(t: u8) -> Option<ReservationType> {
        Some(match t {
            1 => ReservationType::WriteExclusive,
            3 => ReservationType::ExclusiveAccess,
            5 => ReservationType::WriteExclusiveRegistrantsOnly,
            6 => ReservationType::ExclusiveAccessRegistrantsOnly,
            7 => ReservationType::WriteExclusiveAllRegistrants,
            8 => ReservationType::ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }
}

/// Reservation Register actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterAction {
    Register,
    Unregister,
    Replace,
}

/// Reservation Acquire actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireAction {
    Acquire,
    Preempt,
    PreemptAndAbort,
}

/// Change Persist Through Power Loss state (Reservation Register CDW10 bits 31:30).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cptpl {
    NoChange,
    Clear,
    Set,
}

/// An I/O command, as decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoCommand {
    Read {
        blocks: Blocks,
        fua: bool,
    },
    Write {
        blocks: Blocks,
        fua: bool,
    },
    Compare {
        blocks: Blocks,
    },
    Flush,
    WriteZeroes {
        blocks: Blocks,
        deallocate: bool,
        fua: bool,
    },
    /// Dataset Management with `ranges` 16-byte ranges in its data; `deallocate` (AD) is what
    /// does anything (the hints alone do nothing).
    DatasetManagement {
        ranges: u16,
        deallocate: bool,
    },
    ReservationRegister {
        action: RegisterAction,
        ignore_key: bool,
        cptpl: Cptpl,
    },
    ReservationReport {
        dwords: u32,
        extended: bool,
    },
    ReservationAcquire {
        action: AcquireAction,
        ignore_key: bool,
        rtype: Option<ReservationType>,
    },
    ReservationRelease {
        clear: bool,
        ignore_key: bool,
        rtype: Option<ReservationType>,
    },
}

fn blocks(sqe: &Sqe) -> Blocks {
    Blocks {
        slba: u64::from(sqe.cdw(10)) | u64::from(sqe.cdw(11)) << 32,
        count: (sqe.cdw(12) & 0xFFFF) + 1,
    }
}

/// CDW12's protection information action and check bits (29:26) and storage tag check (24):
/// a namespace without protection information takes none.
fn no_protection(cdw12: u32) -> Result<(), Status> {
    if cdw12 & (0xF << 26 | 1 << 24) != 0 {
        return Err(Status::INVALID_FIELD);
    }
    Ok(())
}

impl IoCommand {
    /// Decodes an I/O queue's command; an unknown opcode is Invalid Command Opcode, a field
    /// this controller does not take is Invalid Field in Command.
    pub fn decode(sqe: &Sqe) -> Result<IoCommand, Status> {
        let cdw12 = sqe.cdw(12);
        let fua = cdw12 & 1 << 30 != 0;
        let cdw10 = sqe.cdw(10);
        Ok(match sqe.opcode() {
            opcode::READ => {
                no_protection(cdw12)?;
                IoCommand::Read {
                    blocks: blocks(sqe),
                    fua,
                }
            }
            opcode::WRITE => {
                no_protection(cdw12)?;
                IoCommand::Write {
                    blocks: blocks(sqe),
                    fua,
                }
            }
            opcode::COMPARE => {
                no_protection(cdw12)?;
                IoCommand::Compare {
                    blocks: blocks(sqe),
                }
            }
            opcode::FLUSH => IoCommand::Flush,
            opcode::WRITE_ZEROES => {
                no_protection(cdw12)?;
                IoCommand::WriteZeroes {
                    blocks: blocks(sqe),
                    deallocate: cdw12 & 1 << 25 != 0,
                    fua,
                }
            }
            opcode::DATASET_MANAGEMENT => IoCommand::DatasetManagement {
                ranges: (cdw10 & 0xFF) as u16 + 1,
                deallocate: sqe.cdw(11) & 1 << 2 != 0,
            },
            opcode::RESERVATION_REGISTER
            | opcode::RESERVATION_REPORT
            | opcode::RESERVATION_ACQUIRE
            | opcode::RESERVATION_RELEASE => reservation(sqe)?,
            _ => return Err(Status::INVALID_OPCODE),
        })
    }

    /// The bytes of data the command moves from the host (None: none), for a namespace of
    /// `block_size`-byte blocks.
    pub fn data_out_len(&self, block_size: u32) -> Option<u64> {
        match self {
            IoCommand::Write { blocks, .. } | IoCommand::Compare { blocks } => {
                Some(u64::from(blocks.count) * u64::from(block_size))
            }
            IoCommand::DatasetManagement { ranges, .. } => Some(u64::from(*ranges) * 16),
            IoCommand::ReservationRegister { .. } | IoCommand::ReservationAcquire { .. } => {
                Some(16)
            }
            IoCommand::ReservationRelease { .. } => Some(8),
            _ => None,
        }
    }
}

/// The reservation commands (NVMe base 2.0, 7.2 to 7.5).
fn reservation(sqe: &Sqe) -> Result<IoCommand, Status> {
    let cdw10 = sqe.cdw(10);
    let ignore_key = cdw10 & 1 << 3 != 0;
    Ok(match sqe.opcode() {
        opcode::RESERVATION_REGISTER => IoCommand::ReservationRegister {
            action: match cdw10 & 0x7 {
                0 => RegisterAction::Register,
                1 => RegisterAction::Unregister,
                2 => RegisterAction::Replace,
                _ => return Err(Status::INVALID_FIELD),
            },
            ignore_key,
            cptpl: match cdw10 >> 30 {
                0 => Cptpl::NoChange,
                2 => Cptpl::Clear,
                3 => Cptpl::Set,
                _ => return Err(Status::INVALID_FIELD),
            },
        },
        opcode::RESERVATION_REPORT => IoCommand::ReservationReport {
            dwords: cdw10.saturating_add(1),
            extended: sqe.cdw(11) & 1 != 0,
        },
        opcode::RESERVATION_ACQUIRE => IoCommand::ReservationAcquire {
            action: match cdw10 & 0x7 {
                0 => AcquireAction::Acquire,
                1 => AcquireAction::Preempt,
                2 => AcquireAction::PreemptAndAbort,
                _ => return Err(Status::INVALID_FIELD),
            },
            ignore_key,
            rtype: rtype(cdw10)?,
        },
        opcode::RESERVATION_RELEASE => IoCommand::ReservationRelease {
            clear: match cdw10 & 0x7 {
                0 => false,
                1 => true,
                _ => return Err(Status::INVALID_FIELD),
            },
            ignore_key,
            rtype: rtype(cdw10)?,
        },
        _ => return Err(Status::INVALID_OPCODE),
    })
}

/// RTYPE (CDW10 bits 15:8): 0 is "none" where an action takes no type.
fn rtype(cdw10: u32) -> Result<Option<ReservationType>, Status> {
    match ((cdw10 >> 8) & 0xFF) as u8 {
        0 => Ok(None),
        t => ReservationType::from_u8(t)
            .map(Some)
            .ok_or(Status::INVALID_FIELD),
    }
}

/// The ranges of a Dataset Management command's data (each 16 bytes: context attributes, a
/// block count, the starting block).
pub fn dsm_ranges(data: &[u8]) -> Vec<Blocks> {
    data.chunks_exact(16)
        .map(|r| Blocks {
            count: u32::from_le_bytes([r[4], r[5], r[6], r[7]]),
            slba: u64::from_le_bytes(r[8..16].try_into().unwrap_or([0; 8])),
        })
        .collect()
}

/// The keys of Reservation Register / Acquire data (current key, new or preempt key) and of
/// Release data (current key, second 0).
pub fn reservation_keys(data: &[u8]) -> Option<(u64, u64)> {
    let crkey = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let second = match data.get(8..16) {
        Some(b) => u64::from_le_bytes(b.try_into().ok()?),
        None => 0,
    };
    Some((crkey, second))
}

#[cfg(test)]
mod tests;
