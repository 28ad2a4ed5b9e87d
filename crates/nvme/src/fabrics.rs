//! Fabrics commands (NVMe over Fabrics 1.1, section 3): Connect with its data, Property Get and
//! Set over the controller's registers, Disconnect. Parsing checks every field a controller
//! must refuse and says which (Connect Invalid Parameters names the byte).

use crate::sqe::{Sqe, Status};

/// Fabrics command types (SQE byte 4).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTH_SEND: u8 = 0x05;
    pub const AUTH_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Length of the Connect command's data.
pub const CONNECT_DATA_LEN: usize = 1024;
/// An NQN is at most 223 bytes (UTF-8), NUL-terminated in a 256-byte field.
pub const NQN_MAX: usize = 223;
/// The discovery subsystem's well-known NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// The controller ID that asks for a dynamic controller (the admin queue's Connect).
pub const DYNAMIC_CONTROLLER: u16 = 0xFFFF;
/// The admin queue holds at least 32 entries (SQSIZE, 0's based, at least 31).
pub const ADMIN_SQSIZE_MIN: u16 = 31;

/// A Connect command and its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connect {
    /// The queue to create: 0 the admin queue (and the controller), else an I/O queue.
    pub qid: u16,
    /// Submission queue size, 0's based.
    pub sqsize: u16,
    /// Connect attributes (byte 46): priority class, and bit 2 "disable SQ flow control".
    pub cattr: u8,
    /// Keep-alive timeout in milliseconds (admin queue only; 0: none).
    pub kato_ms: u32,
    pub host_id: [u8; 16],
    /// The controller asked for: [`DYNAMIC_CONTROLLER`] on the admin queue, the one the admin
    /// queue's Connect returned on an I/O queue.
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

/// Connect attributes bit 2: the host asks that SQ flow control be disabled. Its completions
/// then report SQ head FFFFh, and a successful read's last C2HData PDU may carry the SUCCESS
/// flag in place of a response capsule (transport specification 1.0, 3.6.2.8).
pub const CATTR_DISABLE_SQ_FLOW: u8 = 0x04;

impl Connect {
    /// Whether the host asked that SQ flow control be disabled on the queue.
    pub fn sq_flow_control_disabled(&self) -> bool {
        self.cattr & CATTR_DISABLE_SQ_FLOW != 0
    }
}

/// Where a Connect parameter was wrong, as the Invalid Parameters completion reports it (DW0:
/// IATTR byte 0 — 0 the command, 1 the data — and the byte offset in bytes 2..4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidParameter {
    pub in_data: bool,
    pub offset: u16,
}

impl InvalidParameter {
    /// The completion's dword 0.
    pub fn dw0(&self) -> u32 {
        u32::from(self.in_data) | u32::from(self.offset) << 16
    }
}

/// Why a Connect is refused, with the status a controller answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectError {
    /// RECFMT is not 0: Connect Incompatible Format.
    Format,
    /// A field is out of range: Connect Invalid Parameters, naming it.
    Invalid(InvalidParameter),
}

impl ConnectError {
    pub fn status(&self) -> Status {
        match self {
            ConnectError::Format => Status::CONNECT_INCOMPATIBLE_FORMAT,
            ConnectError::Invalid(_) => Status::CONNECT_INVALID_PARAMETERS,
        }
    }

    /// The completion's dword 0.
    pub fn dw0(&self) -> u32 {
        match self {
            ConnectError::Format => 0,
            ConnectError::Invalid(p) => p.dw0(),
        }
    }
}

fn invalid(in_data: bool, offset: u16) -> ConnectError {
    ConnectError::Invalid(InvalidParameter { in_data, offset })
}

/// An NQN field: NUL-terminated UTF-8 of 1..=[`NQN_MAX`] bytes in 256.
fn nqn(field: &[u8]) -> Option<String> {
    let len = field.iter().position(|&b| b == 0)?;
    if len == 0 || len > NQN_MAX {
        return None;
    }
    let text = std::str::from_utf8(&field[..len]).ok()?;
    text.starts_with("nqn.").then(|| text.to_string())
}

impl Connect {
    /// Parses a Connect command (`sqe`, FCTYPE 01h) and its 1024 bytes of data.
    pub fn parse(sqe: &Sqe, data: &[u8]) -> Result<Connect, ConnectError> {
        debug_assert_eq!(sqe.fctype(), fctype::CONNECT);
        if sqe.u16_at(40) != 0 {
            return Err(ConnectError::Format);
        }
        if data.len() != CONNECT_DATA_LEN {
            return Err(invalid(false, 32));
        }
        let qid = sqe.u16_at(42);
        let sqsize = sqe.u16_at(44);
        // A queue of one entry is no queue (SQSIZE is 0's based); the admin queue holds 32.
        if sqsize == 0 || (qid == 0 && sqsize < ADMIN_SQSIZE_MIN) {
            return Err(invalid(false, 44));
        }
        let kato_ms = sqe.u32_at(48);
        let cntlid = u16::from_le_bytes([data[16], data[17]]);
        if qid == 0 && cntlid != DYNAMIC_CONTROLLER {
            // Static controllers are not offered: every admin queue gets a new controller.
            return Err(invalid(true, 16));
        }
        let subnqn = nqn(&data[256..512]).ok_or(invalid(true, 256))?;
        let hostnqn = nqn(&data[512..768]).ok_or(invalid(true, 512))?;
        let mut host_id = [0u8; 16];
        host_id.copy_from_slice(&data[..16]);
        Ok(Connect {
            qid,
            sqsize,
            cattr: sqe.0[46],
            kato_ms,
            host_id,
            cntlid,
            subnqn,
            hostnqn,
        })
    }

    /// Builds a Connect command's SQE (a host's; the data goes with it, [`Connect::data`]).
    pub fn sqe(&self, cid: u16) -> Sqe {
        let mut s = [0u8; crate::sqe::SQE_LEN];
        s[0] = crate::sqe::FABRICS;
        s[1] = 0x40; // SGL
        s[2..4].copy_from_slice(&cid.to_le_bytes());
        s[4] = fctype::CONNECT;
        // The data in the capsule: an SGL data block descriptor, offset subtype.
        s[32..36].copy_from_slice(&(CONNECT_DATA_LEN as u32).to_le_bytes());
        s[39] = 0x01;
        s[42..44].copy_from_slice(&self.qid.to_le_bytes());
        s[44..46].copy_from_slice(&self.sqsize.to_le_bytes());
        s[46] = self.cattr;
        s[48..52].copy_from_slice(&self.kato_ms.to_le_bytes());
        Sqe(s)
    }

    /// The Connect data.
    pub fn data(&self) -> Vec<u8> {
        let mut d = vec![0u8; CONNECT_DATA_LEN];
        d[..16].copy_from_slice(&self.host_id);
        d[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        let put = |d: &mut Vec<u8>, at: usize, s: &str| {
            let b = &s.as_bytes()[..s.len().min(NQN_MAX)];
            d[at..at + b.len()].copy_from_slice(b);
        };
        put(&mut d, 256, &self.subnqn);
        put(&mut d, 512, &self.hostnqn);
        d
    }
}

/// Controller register offsets (NVMe base 2.0, 3.1.4) a fabrics host reads and writes with
/// Property Get / Set.
pub mod reg {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1C;
}

/// The controller's properties: capabilities it was made with, and the configuration and
/// status the host drives (enable, shutdown).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registers {
    /// Maximum queue entries supported, 0's based (CAP.MQES).
    pub mqes: u16,
    pub cc: u32,
    pub csts: u32,
}

/// CC.EN, CSTS.RDY, and the shutdown fields.
const CC_EN: u32 = 1;
const CC_SHN_SHIFT: u32 = 14;
const CSTS_RDY: u32 = 1;
const CSTS_SHST_COMPLETE: u32 = 2 << 2;
/// CC's writable fields: EN, CSS (6:4), MPS (10:7), AMS (13:11), SHN (15:14), IOSQES (19:16),
/// IOCQES (23:20).
const CC_WRITABLE: u32 = 0x00FF_FFF1;

impl Registers {
    pub fn new(mqes: u16) -> Registers {
        Registers {
            mqes,
            cc: 0,
            csts: 0,
        }
    }

    /// CAP: MQES, contiguous queues required, a 7.5 s ready timeout (TO = 15 × 500 ms), the
    /// NVM command set, 4 KiB memory pages.
    pub fn cap(&self) -> u64 {
        u64::from(self.mqes) | 1 << 16 | 15 << 24 | 1 << 37
    }

    /// NVMe 2.0.
    pub const VS: u32 = 0x0002_0000;

    /// Property Get of `offset` (`size8`: an 8-byte property).
    pub fn get(&self, offset: u32, size8: bool) -> Result<u64, Status> {
        match (offset, size8) {
            (reg::CAP, true) => Ok(self.cap()),
            (reg::VS, false) => Ok(u64::from(Self::VS)),
            (reg::CC, false) => Ok(u64::from(self.cc)),
            (reg::CSTS, false) => Ok(u64::from(self.csts)),
            _ => Err(Status::INVALID_FIELD),
        }
    }

    /// Property Set of `offset`: only CC, 4 bytes. Enabling makes the controller ready at once
    /// (it has nothing to initialize); a shutdown request completes at once; clearing EN is a
    /// controller reset.
    pub fn set(&mut self, offset: u32, size8: bool, value: u64) -> Result<(), Status> {
        if offset != reg::CC || size8 {
            return Err(Status::INVALID_FIELD);
        }
        let cc = u32::try_from(value).map_err(|_| Status::INVALID_FIELD)? & CC_WRITABLE;
        self.cc = cc;
        let shn = (cc >> CC_SHN_SHIFT) & 0x3;
        self.csts = match (cc & CC_EN != 0, shn) {
            (_, 1 | 2) => CSTS_SHST_COMPLETE | (self.csts & CSTS_RDY),
            (true, _) => CSTS_RDY,
            (false, _) => 0,
        };
        Ok(())
    }

    /// Whether the host enabled the controller and it is ready (I/O queues may connect, and
    /// commands other than Fabrics ones run).
    pub fn ready(&self) -> bool {
        self.csts & CSTS_RDY != 0 && self.cc & CC_EN != 0
    }
}

/// A Property Get or Set command's offset and size (byte 40 ATTRIB: 0 four bytes, 1 eight).
pub fn property(sqe: &Sqe) -> Result<(u32, bool), Status> {
    match sqe.0[40] & 0x07 {
        0 => Ok((sqe.u32_at(44), false)),
        1 => Ok((sqe.u32_at(44), true)),
        _ => Err(Status::INVALID_FIELD),
    }
}

/// An Authentication Send or Receive command's length (TL or AL, bytes 44..48), once its
/// security protocol is DH-HMAC-CHAP's (SECP E9h, SPSP0 and SPSP1 01h) and the length is not 0.
pub fn auth_length(sqe: &Sqe) -> Result<u32, Status> {
    let (spsp0, spsp1, secp) = (sqe.0[41], sqe.0[42], sqe.0[43]);
    if secp != crate::auth::SECP_DHCHAP || spsp0 != crate::auth::SPSP || spsp1 != crate::auth::SPSP
    {
        return Err(Status::INVALID_FIELD);
    }
    match sqe.u32_at(44) {
        0 => Err(Status::INVALID_FIELD),
        len => Ok(len),
    }
}

/// Builds an Authentication Send (`data` in the capsule) or Receive (`len` bytes asked) SQE
/// (a host's).
pub fn auth_sqe(cid: u16, send: bool, len: u32) -> Sqe {
    let mut s = [0u8; crate::sqe::SQE_LEN];
    s[0] = crate::sqe::FABRICS;
    s[1] = 0x40; // SGL
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4] = if send {
        fctype::AUTH_SEND
    } else {
        fctype::AUTH_RECEIVE
    };
    s[32..36].copy_from_slice(&len.to_le_bytes());
    // Send: the data in the capsule (data block, offset); Receive: the transport's.
    s[39] = if send { 0x01 } else { 0x5A };
    s[41] = crate::auth::SPSP;
    s[42] = crate::auth::SPSP;
    s[43] = crate::auth::SECP_DHCHAP;
    s[44..48].copy_from_slice(&len.to_le_bytes());
    Sqe(s)
}

#[cfg(test)]
mod tests;
