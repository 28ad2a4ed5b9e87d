//! Submission and completion queue entries (NVMe base specification 2.0, 4.2 and 4.6), the
//! data pointer's SGL descriptor as NVMe/TCP uses it (transport specification 1.0, 3.3), and
//! the status codes a controller answers with.

/// A submission queue entry's length.
pub const SQE_LEN: usize = 64;
/// A completion queue entry's length.
pub const CQE_LEN: usize = 16;

/// The Fabrics command opcode (its type is in byte 4).
pub const FABRICS: u8 = 0x7F;

/// A submission queue entry (a command capsule's command), with typed field access.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_LEN]);

impl std::fmt::Debug for Sqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Sqe(op={:#04x} cid={} nsid={})",
            self.opcode(),
            self.cid(),
            self.nsid()
        )
    }
}

/// Where a command's data is, from its SGL descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataPointer {
    /// In the command capsule, after the command, at this offset of the in-capsule data.
    InCapsule { offset: u64, len: u32 },
    /// Moved by H2CData / C2HData PDUs (the transport's data block).
    Transport { len: u32 },
}

/// The SGL descriptor types NVMe/TCP allows (byte 15: type in the high nibble, subtype low).
const SGL_DATA_BLOCK_OFFSET: u8 = 0x01;
const SGL_TRANSPORT_DATA_BLOCK: u8 = 0x5A;

impl Sqe {
    pub fn from_slice(raw: &[u8]) -> Option<Sqe> {
        Some(Sqe(raw.get(..SQE_LEN)?.try_into().ok()?))
    }

    pub fn opcode(&self) -> u8 {
        self.0[0]
    }
    /// Fused operation: 0 normal, 1 the first of a fused pair, 2 the second.
    pub fn fuse(&self) -> u8 {
        self.0[1] & 0x03
    }
    /// PRP or SGL for data transfer: NVMe over Fabrics requires SGLs (01b).
    pub fn psdt(&self) -> u8 {
        self.0[1] >> 6
    }
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.0[2], self.0[3]])
    }
    pub fn nsid(&self) -> u32 {
        self.u32_at(4)
    }
    /// Command dword `n` (10..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        debug_assert!((10..=15).contains(&n));
        self.u32_at(n * 4)
    }
    /// A Fabrics command's type (byte 4, where other commands have NSID).
    pub fn fctype(&self) -> u8 {
        self.0[4]
    }
    pub fn u16_at(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.0[at], self.0[at + 1]])
    }
    pub fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes([self.0[at], self.0[at + 1], self.0[at + 2], self.0[at + 3]])
    }
    pub fn u64_at(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().unwrap_or([0; 8]))
    }

    /// The data pointer (an SGL descriptor in DPTR, bytes 24..40): in-capsule (data block,
    /// offset subtype) or the transport's data block; anything else is refused (the caller
    /// answers SGL DESCRIPTOR TYPE INVALID).
    pub fn data_pointer(&self) -> Result<DataPointer, Status> {
        if self.psdt() != 0x01 {
            return Err(Status::INVALID_FIELD);
        }
        let len = self.u32_at(32);
        match self.0[39] {
            SGL_DATA_BLOCK_OFFSET => Ok(DataPointer::InCapsule {
                offset: self.u64_at(24),
                len,
            }),
            SGL_TRANSPORT_DATA_BLOCK => Ok(DataPointer::Transport { len }),
            _ => Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }
}

/// A completion's status field (without the phase bit): status code type and status code,
/// plus Do Not Retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
}

impl Status {
    const fn generic(sc: u8, dnr: bool) -> Status {
        Status { sct: 0, sc, dnr }
    }
    pub const SUCCESS: Status = Status::generic(0x00, false);
    pub const INVALID_OPCODE: Status = Status::generic(0x01, true);
    pub const INVALID_FIELD: Status = Status::generic(0x02, true);
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03, true);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04, false);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06, false);
    pub const ABORTED_BY_REQUEST: Status = Status::generic(0x07, false);
    pub const ABORTED_FUSE_FAILED: Status = Status::generic(0x09, false);
    pub const ABORTED_FUSE_MISSING: Status = Status::generic(0x0A, true);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0B, true);
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11, true);
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0F, true);
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82, false);
    pub const RESERVATION_CONFLICT: Status = Status::generic(0x83, true);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80, true);
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81, true);
    /// Command specific (type 1) for Connect: incompatible format, controller busy, invalid
    /// parameters, restart discovery, invalid host.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status {
        sct: 1,
        sc: 0x80,
        dnr: true,
    };
    pub const CONNECT_CONTROLLER_BUSY: Status = Status {
        sct: 1,
        sc: 0x81,
        dnr: false,
    };
    pub const CONNECT_INVALID_PARAMETERS: Status = Status {
        sct: 1,
        sc: 0x82,
        dnr: true,
    };
    pub const CONNECT_INVALID_HOST: Status = Status {
        sct: 1,
        sc: 0x84,
        dnr: true,
    };
    /// Command specific (type 1): the queue must authenticate first (DH-HMAC-CHAP).
    pub const AUTH_REQUIRED: Status = Status {
        sct: 1,
        sc: 0x91,
        dnr: true,
    };
    /// Media and data integrity errors (type 2): Compare Failure, Access Denied.
    pub const COMPARE_FAILURE: Status = Status {
        sct: 2,
        sc: 0x85,
        dnr: true,
    };
    pub const ACCESS_DENIED: Status = Status {
        sct: 2,
        sc: 0x86,
        dnr: true,
    };
    /// Path related (type 3): the namespace's ANA group is inaccessible, or changing.
    pub const ANA_INACCESSIBLE: Status = Status {
        sct: 3,
        sc: 0x02,
        dnr: false,
    };
    pub const ANA_TRANSITION: Status = Status {
        sct: 3,
        sc: 0x03,
        dnr: false,
    };

    /// The status field's 15 bits above the phase tag (CQE dword 3 bits 31:17).
    pub fn field(&self) -> u16 {
        u16::from(self.sc) << 1 | u16::from(self.sct & 0x07) << 9 | u16::from(self.dnr) << 15
    }

    pub fn from_field(field: u16) -> Status {
        Status {
            sc: (field >> 1) as u8,
            sct: ((field >> 9) & 0x07) as u8,
            dnr: field & 0x8000 != 0,
        }
    }

    pub fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific dword 0 (Connect: the controller ID; Property Get: the value's low
    /// half; Set Features: the value set).
    pub dw0: u32,
    pub dw1: u32,
    /// Submission queue head pointer (NVMe/TCP controllers that disable SQ flow control send 0
    /// or the head as they track it).
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

/// The SQ head a completion reports on a queue whose host disabled SQ flow control.
pub const SQHD_DISABLED: u16 = 0xFFFF;

impl Cqe {
    /// The completion a C2HData PDU with SUCCESS stands for (no response capsule came).
    pub fn success_in_data(cid: u16) -> Cqe {
        Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: SQHD_DISABLED,
            sqid: 0,
            cid,
            status: Status::SUCCESS,
        }
    }

    pub fn encode(&self, out: &mut [u8; CQE_LEN]) {
        out[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        out[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        out[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        out[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        out[12..14].copy_from_slice(&self.cid.to_le_bytes());
        out[14..16].copy_from_slice(&self.status.field().to_le_bytes());
    }

    pub fn parse(raw: &[u8; CQE_LEN]) -> Cqe {
        let u32_at =
            |at: usize| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
        let u16_at = |at: usize| u16::from_le_bytes([raw[at], raw[at + 1]]);
        Cqe {
            dw0: u32_at(0),
            dw1: u32_at(4),
            sqhd: u16_at(8),
            sqid: u16_at(10),
            cid: u16_at(12),
            status: Status::from_field(u16_at(14)),
        }
    }

    /// A response capsule PDU carrying this completion (and the header digest when on).
    pub fn encode_capsule(&self, header_digest: bool, out: &mut Vec<u8>) {
        use crate::pdu::{ch, digest, flags, PduType, CH_LEN, DIGEST_LEN};
        let start = out.len();
        let hd = if header_digest { DIGEST_LEN } else { 0 };
        let plen = (PduType::CapsuleResp.hlen() + hd) as u32;
        let f = if header_digest { flags::HDGSTF } else { 0 };
        // Built whole and appended once: one capacity check per answer.
        let mut cqe = [0u8; CQE_LEN];
        self.encode(&mut cqe);
        let mut pdu = [0u8; CH_LEN + CQE_LEN];
        pdu[..CH_LEN].copy_from_slice(&ch(PduType::CapsuleResp, f, 0, plen));
        pdu[CH_LEN..].copy_from_slice(&cqe);
        out.extend_from_slice(&pdu);
        if header_digest {
            let d = digest(&out[start..]);
            out.extend_from_slice(&d.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_round_trip_with_their_bits_where_the_spec_puts_them() {
        // Invalid Field in Command, DNR: SC 02h in bits 8:1, DNR bit 15.
        assert_eq!(Status::INVALID_FIELD.field(), 0x8004);
        // Path related, ANA transition: SCT 3 in bits 11:9, SC 03h.
        assert_eq!(Status::ANA_TRANSITION.field(), 0x0606);
        assert_eq!(Status::RESERVATION_CONFLICT.field(), 0x8106);
        for s in [
            Status::SUCCESS,
            Status::INVALID_OPCODE,
            Status::CONNECT_INVALID_HOST,
            Status::COMPARE_FAILURE,
            Status::ANA_INACCESSIBLE,
        ] {
            assert_eq!(Status::from_field(s.field()), s);
        }
        assert!(Status::SUCCESS.is_success());
        assert!(!Status::ABORTED_BY_REQUEST.is_success());
    }

    #[test]
    fn a_completion_encodes_little_endian_and_parses_back() {
        let cqe = Cqe {
            dw0: 0x0102_0304,
            dw1: 0,
            sqhd: 7,
            sqid: 1,
            cid: 0xBEEF,
            status: Status::LBA_OUT_OF_RANGE,
        };
        let mut raw = [0u8; CQE_LEN];
        cqe.encode(&mut raw);
        assert_eq!(&raw[0..4], &[4, 3, 2, 1]);
        assert_eq!(&raw[12..14], &[0xEF, 0xBE]);
        assert_eq!(Cqe::parse(&raw), cqe);
        let mut pdu = Vec::new();
        cqe.encode_capsule(true, &mut pdu);
        assert_eq!(pdu.len(), 8 + 16 + 4);
        assert_eq!(&pdu[..4], &[0x05, 0x01, 24, 0]);
        assert_eq!(u32::from_le_bytes(pdu[4..8].try_into().unwrap()), 28);
        assert!(crate::pdu::header_digest_ok(
            &pdu[..24],
            pdu[24..28].try_into().unwrap()
        ));
    }

    #[test]
    fn the_data_pointer_is_in_capsule_or_the_transports_and_nothing_else() {
        let mut sqe = Sqe([0; SQE_LEN]);
        sqe.0[0] = 0x01; // Write
        sqe.0[1] = 0x40; // PSDT = 01b: SGL
        sqe.0[2..4].copy_from_slice(&9u16.to_le_bytes());
        sqe.0[4..8].copy_from_slice(&1u32.to_le_bytes());
        sqe.0[32..36].copy_from_slice(&4096u32.to_le_bytes());
        sqe.0[39] = 0x01;
        assert_eq!(
            sqe.data_pointer(),
            Ok(DataPointer::InCapsule {
                offset: 0,
                len: 4096
            })
        );
        assert_eq!((sqe.cid(), sqe.nsid(), sqe.fuse()), (9, 1, 0));
        sqe.0[39] = 0x5A;
        assert_eq!(sqe.data_pointer(), Ok(DataPointer::Transport { len: 4096 }));
        // A keyed data block, a segment, a bit bucket: not what NVMe/TCP carries.
        for t in [0x00, 0x20, 0x40, 0x10, 0x5B] {
            sqe.0[39] = t;
            assert_eq!(
                sqe.data_pointer(),
                Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
                "{t:#x}"
            );
        }
        // PRPs are not for fabrics.
        sqe.0[1] = 0x00;
        assert_eq!(sqe.data_pointer(), Err(Status::INVALID_FIELD));
    }
}
