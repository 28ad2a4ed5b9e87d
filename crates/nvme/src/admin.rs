//! The admin commands a fabrics controller takes (NVMe base 2.0, 5), decoded from a submission
//! queue entry: Identify, Get Log Page, Get/Set Features, Abort, Asynchronous Event Request and
//! Keep Alive. Fabrics commands (opcode 7Fh) are `fabrics`'.

use crate::log::GetLogPage;
use crate::sqe::{Sqe, Status};

/// Admin opcodes.
pub mod opcode {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// Feature identifiers this controller knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    /// Volatile write cache: CDW11 bit 0, write cache enable.
    VolatileWriteCache,
    /// Number of queues: submission and completion queues asked for (0's based, CDW11 15:0 and
    /// 31:16); the answer gives those allocated.
    NumberOfQueues,
    /// Asynchronous event configuration: which notices the host wants (CDW11).
    AsyncEventConfig,
    /// Keep-alive timer: milliseconds (CDW11).
    KeepAliveTimer,
}

impl Feature {
    fn from_fid(fid: u8) -> Option<Feature> {
        Some(match fid {
            0x06 => Feature::VolatileWriteCache,
            0x07 => Feature::NumberOfQueues,
            0x0B => Feature::AsyncEventConfig,
            0x0F => Feature::KeepAliveTimer,
            _ => return None,
        })
    }
}

/// Which value Get Features returns (SEL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Select {
    Current,
    Default,
    Saved,
    /// The feature's capabilities (saveable, per namespace, changeable).
    Capabilities,
}

/// An admin command, as decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminCommand {
    Identify {
        cns: u8,
        nsid: u32,
        cntid: u16,
        csi: u8,
    },
    GetLogPage(GetLogPage),
    GetFeatures {
        feature: Feature,
        select: Select,
    },
    /// `save`: the host asked the value to persist (not offered: Feature Identifier Not
    /// Saveable).
    SetFeatures {
        feature: Feature,
        value: u32,
        save: bool,
    },
    Abort {
        sqid: u16,
        cid: u16,
    },
    AsyncEventRequest,
    KeepAlive,
}

/// Feature Identifier Not Saveable (command specific, 0Dh).
pub const FEATURE_NOT_SAVEABLE: Status = Status {
    sct: 1,
    sc: 0x0D,
    dnr: true,
};

impl AdminCommand {
    /// Decodes an admin queue's command; Fabrics commands are not admin commands here.
    pub fn decode(sqe: &Sqe) -> Result<AdminCommand, Status> {
        let cdw10 = sqe.cdw(10);
        Ok(match sqe.opcode() {
            opcode::IDENTIFY => AdminCommand::Identify {
                cns: (cdw10 & 0xFF) as u8,
                nsid: sqe.nsid(),
                cntid: (cdw10 >> 16) as u16,
                csi: (sqe.cdw(11) >> 24) as u8,
            },
            opcode::GET_LOG_PAGE => AdminCommand::GetLogPage(GetLogPage::decode(sqe)?),
            opcode::GET_FEATURES => AdminCommand::GetFeatures {
                feature: feature(cdw10)?,
                select: match (cdw10 >> 8) & 0x7 {
                    0 => Select::Current,
                    1 => Select::Default,
                    2 => Select::Saved,
                    3 => Select::Capabilities,
                    _ => return Err(Status::INVALID_FIELD),
                },
            },
            opcode::SET_FEATURES => {
                let save = cdw10 & 1 << 31 != 0;
                let feature = feature(cdw10)?;
                if save {
                    return Err(FEATURE_NOT_SAVEABLE);
                }
                AdminCommand::SetFeatures {
                    feature,
                    value: sqe.cdw(11),
                    save,
                }
            }
            opcode::ABORT => AdminCommand::Abort {
                sqid: (cdw10 & 0xFFFF) as u16,
                cid: (cdw10 >> 16) as u16,
            },
            opcode::ASYNC_EVENT_REQUEST => AdminCommand::AsyncEventRequest,
            opcode::KEEP_ALIVE => AdminCommand::KeepAlive,
            _ => return Err(Status::INVALID_OPCODE),
        })
    }
}

fn feature(cdw10: u32) -> Result<Feature, Status> {
    Feature::from_fid((cdw10 & 0xFF) as u8).ok_or(Status::INVALID_FIELD)
}

/// Number of Queues: the host asks for `asked` (CDW11: submission queues 15:0, completion
/// queues 31:16, each 0's based; 65535 is invalid); the controller allocates at most `limit`
/// I/O queue pairs and answers what it allocated in the same layout (Completion DW0).
pub fn number_of_queues(asked: u32, limit: u16) -> Result<u32, Status> {
    let (nsqr, ncqr) = ((asked & 0xFFFF) as u16, (asked >> 16) as u16);
    if nsqr == u16::MAX || ncqr == u16::MAX || limit == 0 {
        return Err(Status::INVALID_FIELD);
    }
    let granted = nsqr.max(ncqr).min(limit - 1);
    Ok(u32::from(granted) | u32::from(granted) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admin(op: u8, nsid: u32, cdw10: u32, cdw11: u32) -> Sqe {
        let mut s = Sqe([0; 64]);
        s.0[0] = op;
        s.0[4..8].copy_from_slice(&nsid.to_le_bytes());
        s.0[40..44].copy_from_slice(&cdw10.to_le_bytes());
        s.0[44..48].copy_from_slice(&cdw11.to_le_bytes());
        s
    }

    #[test]
    fn admin_commands_decode_their_fields() {
        assert_eq!(
            AdminCommand::decode(&admin(opcode::IDENTIFY, 1, 0x0005_0001, 0)),
            Ok(AdminCommand::Identify {
                cns: 1,
                nsid: 1,
                cntid: 5,
                csi: 0
            })
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::GET_FEATURES, 0, 0x07 | 3 << 8, 0)),
            Ok(AdminCommand::GetFeatures {
                feature: Feature::NumberOfQueues,
                select: Select::Capabilities
            })
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::SET_FEATURES, 0, 0x0F, 15_000)),
            Ok(AdminCommand::SetFeatures {
                feature: Feature::KeepAliveTimer,
                value: 15_000,
                save: false
            })
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::SET_FEATURES, 0, 0x0F | 1 << 31, 1)),
            Err(FEATURE_NOT_SAVEABLE)
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::GET_FEATURES, 0, 0x7E, 0)),
            Err(Status::INVALID_FIELD)
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::GET_FEATURES, 0, 0x06 | 4 << 8, 0)),
            Err(Status::INVALID_FIELD)
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::ABORT, 0, 0x0009_0002, 0)),
            Ok(AdminCommand::Abort { sqid: 2, cid: 9 })
        );
        assert_eq!(
            AdminCommand::decode(&admin(opcode::KEEP_ALIVE, 0, 0, 0)),
            Ok(AdminCommand::KeepAlive)
        );
        // Create/Delete I/O queue (not on fabrics), Format NVM: not offered.
        for op in [0x01, 0x05, 0x80] {
            assert_eq!(
                AdminCommand::decode(&admin(op, 0, 0, 0)),
                Err(Status::INVALID_OPCODE)
            );
        }
    }

    #[test]
    fn number_of_queues_grants_at_most_the_limit_as_pairs() {
        // Linux asks for as many as it has CPUs (0's based: 7 = 8 queues).
        assert_eq!(number_of_queues(7 | 7 << 16, 4), Ok(3 | 3 << 16));
        assert_eq!(number_of_queues(1 | 1 << 16, 4), Ok(1 | 1 << 16));
        assert_eq!(number_of_queues(0, 4), Ok(0));
        // Unequal asks get the larger, as pairs.
        assert_eq!(number_of_queues(2, 8), Ok(2 | 2 << 16));
        assert_eq!(number_of_queues(0xFFFF, 4), Err(Status::INVALID_FIELD));
    }
}
