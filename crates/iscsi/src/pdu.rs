//! PDU framing and the Basic Header Segment (RFC 7143 §11).
//!
//! A PDU on the wire is: BHS (48 bytes), AHS (TotalAHSLength * 4 bytes), an optional header digest
//! (4), the data segment padded to 4 bytes, and an optional data digest (4). Nothing here trusts the
//! wire: every length is checked against the negotiated limits before a byte is consumed.

use crate::digest;

pub const BHS_LEN: usize = 48;
/// The reserved tag value (ITT/TTT 0xffffffff).
pub const RESERVED_TAG: u32 = 0xffff_ffff;
/// Largest DataSegmentLength the 24-bit field can carry.
pub const DATA_SEGMENT_LEN_MAX: usize = (1 << 24) - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    NopOut = 0x00,
    ScsiCommand = 0x01,
    TaskMgmtRequest = 0x02,
    LoginRequest = 0x03,
    TextRequest = 0x04,
    DataOut = 0x05,
    LogoutRequest = 0x06,
    SnackRequest = 0x10,
    NopIn = 0x20,
    ScsiResponse = 0x21,
    TaskMgmtResponse = 0x22,
    LoginResponse = 0x23,
    TextResponse = 0x24,
    DataIn = 0x25,
    LogoutResponse = 0x26,
    R2t = 0x31,
    AsyncMessage = 0x32,
    Reject = 0x3f,
}

impl Opcode {
    /// Initiator opcodes a target may receive; anything else is unknown to us.
    pub fn from_initiator(raw: u8) -> Option<Opcode> {
        Some(match raw & 0x3f {
            0x00 => Opcode::NopOut,
            0x01 => Opcode::ScsiCommand,
            0x02 => Opcode::TaskMgmtRequest,
            0x03 => Opcode::LoginRequest,
            0x04 => Opcode::TextRequest,
            0x05 => Opcode::DataOut,
            0x06 => Opcode::LogoutRequest,
            0x10 => Opcode::SnackRequest,
            _ => return None,
        })
    }

    /// Target opcodes (what we send; also what a test initiator decodes).
    pub fn from_target(raw: u8) -> Option<Opcode> {
        Some(match raw & 0x3f {
            0x20 => Opcode::NopIn,
            0x21 => Opcode::ScsiResponse,
            0x22 => Opcode::TaskMgmtResponse,
            0x23 => Opcode::LoginResponse,
            0x24 => Opcode::TextResponse,
            0x25 => Opcode::DataIn,
            0x26 => Opcode::LogoutResponse,
            0x31 => Opcode::R2t,
            0x32 => Opcode::AsyncMessage,
            0x3f => Opcode::Reject,
            _ => return None,
        })
    }
}

/// Reject reasons (RFC 7143 §11.17.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    DataDigestError = 0x02,
    SnackReject = 0x03,
    ProtocolError = 0x04,
    CommandNotSupported = 0x05,
    ImmediateCommandReject = 0x06,
    TaskInProgress = 0x07,
    InvalidDataAck = 0x08,
    InvalidPduField = 0x09,
    OutOfResources = 0x0a,
    WaitingForLogout = 0x0c,
}

/// A Basic Header Segment with typed field access. Offsets follow RFC 7143 §11.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bhs(op={:#04x} flags={:#04x} itt={:#010x} dsl={})",
            self.opcode_raw(),
            self.flags(),
            self.itt(),
            self.data_segment_len()
        )
    }
}

impl Bhs {
    pub fn new(opcode: Opcode) -> Bhs {
        let mut b = [0u8; BHS_LEN];
        b[0] = opcode as u8;
        Bhs(b)
    }

    pub fn from_slice(raw: &[u8]) -> Option<Bhs> {
        let arr: [u8; BHS_LEN] = raw.get(..BHS_LEN)?.try_into().ok()?;
        Some(Bhs(arr))
    }

    pub fn opcode_raw(&self) -> u8 {
        self.0[0] & 0x3f
    }
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }
    pub fn set_immediate(&mut self, on: bool) {
        if on {
            self.0[0] |= 0x40;
        } else {
            self.0[0] &= !0x40;
        }
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn set_flags(&mut self, flags: u8) {
        self.0[1] = flags;
    }
    /// The final (F) bit, bit 7 of byte 1 for most opcodes.
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    pub fn total_ahs_len(&self) -> usize {
        self.0[4] as usize * 4
    }
    pub fn data_segment_len(&self) -> usize {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]]) as usize
    }
    /// Sets DataSegmentLength. Callers never build segments beyond the 24-bit field.
    pub fn set_data_segment_len(&mut self, len: usize) {
        debug_assert!(len <= DATA_SEGMENT_LEN_MAX);
        let v = (len.min(DATA_SEGMENT_LEN_MAX) as u32).to_be_bytes();
        self.0[5..8].copy_from_slice(&v[1..4]);
    }
    pub fn lun(&self) -> [u8; 8] {
        let mut l = [0u8; 8];
        l.copy_from_slice(&self.0[8..16]);
        l
    }
    pub fn set_lun(&mut self, lun: [u8; 8]) {
        self.0[8..16].copy_from_slice(&lun);
    }
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    pub fn set_itt(&mut self, itt: u32) {
        self.set_u32(16, itt);
    }
    /// The one-byte field at `offset` (an `off` constant).
    pub fn byte(&self, offset: usize) -> u8 {
        self.0[offset]
    }
    pub fn set_byte(&mut self, offset: usize, v: u8) {
        self.0[offset] = v;
    }
    /// A login's ISID.
    pub fn isid(&self) -> [u8; 6] {
        let mut isid = [0u8; 6];
        isid.copy_from_slice(&self.0[off::ISID..off::ISID + 6]);
        isid
    }
    pub fn set_isid(&mut self, isid: [u8; 6]) {
        self.0[off::ISID..off::ISID + 6].copy_from_slice(&isid);
    }
    pub fn u16_at(&self, offset: usize) -> u16 {
        debug_assert!(offset + 2 <= BHS_LEN);
        u16::from_be_bytes([self.0[offset], self.0[offset + 1]])
    }
    pub fn set_u16(&mut self, offset: usize, v: u16) {
        self.0[offset..offset + 2].copy_from_slice(&v.to_be_bytes());
    }
    pub fn u32_at(&self, offset: usize) -> u32 {
        debug_assert!(offset + 4 <= BHS_LEN);
        u32::from_be_bytes([
            self.0[offset],
            self.0[offset + 1],
            self.0[offset + 2],
            self.0[offset + 3],
        ])
    }
    pub fn set_u32(&mut self, offset: usize, v: u32) {
        self.0[offset..offset + 4].copy_from_slice(&v.to_be_bytes());
    }
}

/// Field offsets of the BHS, by name (RFC 7143 §11); each opcode uses those its section names.
pub mod off {
    /// SCSI Response, Task Management Response, Logout Response: Response.
    pub const RESPONSE: usize = 2;
    /// Reject, Logout Request: Reason (Code).
    pub const REASON: usize = 2;
    /// SCSI Response: Status.
    pub const STATUS: usize = 3;
    /// Login Request: Version-max / Version-min; Login Response: Version-max / Version-active.
    pub const VERSION_MAX: usize = 2;
    pub const VERSION_MIN: usize = 3;
    /// Login: ISID (6 bytes), TSIH, CID.
    pub const ISID: usize = 8;
    pub const TSIH: usize = 14;
    pub const CID: usize = 20;
    /// Task Management Request: Referenced Task Tag, RefCmdSN.
    pub const REFERENCED_TASK_TAG: usize = 20;
    pub const REF_CMD_SN: usize = 32;
    /// Login Response: Status-Class, Status-Detail.
    pub const STATUS_CLASS: usize = 36;
    pub const STATUS_DETAIL: usize = 37;
    /// Asynchronous Message: AsyncEvent, Parameter1-3.
    pub const ASYNC_EVENT: usize = 36;
    pub const PARAMETER1: usize = 38;
    pub const PARAMETER2: usize = 40;
    pub const PARAMETER3: usize = 42;
    /// Logout Response: Time2Wait, Time2Retain.
    pub const TIME2WAIT: usize = 40;
    pub const TIME2RETAIN: usize = 42;
    /// R2T: Desired Data Transfer Length.
    pub const DESIRED_LENGTH: usize = 44;
    pub const TTT: usize = 20;
    pub const EDTL: usize = 20;
    pub const CMD_SN: usize = 24;
    pub const STAT_SN: usize = 24;
    pub const EXP_STAT_SN: usize = 28;
    pub const EXP_CMD_SN: usize = 28;
    pub const MAX_CMD_SN: usize = 32;
    pub const DATA_SN: usize = 36;
    pub const BUFFER_OFFSET: usize = 40;
    pub const RESIDUAL: usize = 44;
    pub const CDB: usize = 32;
}

/// A Login Request's header (RFC 7143 §11.12), as an initiator sends it: the one builder
/// of the initiator crate, the target's tests and the hostile-client tests.
#[derive(Clone, Copy, Debug)]
pub struct LoginRequest {
    /// The current stage (CSG) and, with the T bit, the next one asked for (NSG).
    pub csg: u8,
    pub transit_to: Option<u8>,
    /// The C bit: the text continues in the next request.
    pub continues: bool,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub itt: u32,
    pub cid: u16,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
}

impl LoginRequest {
    pub fn bhs(&self) -> Bhs {
        let mut bhs = Bhs::new(Opcode::LoginRequest);
        bhs.set_immediate(true);
        bhs.set_flags(stage_flags(self.csg, self.transit_to) | u8::from(self.continues) << 6);
        bhs.set_isid(self.isid);
        bhs.set_u16(off::TSIH, self.tsih);
        bhs.set_itt(self.itt);
        bhs.set_u16(off::CID, self.cid);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        bhs
    }
}

/// A Login Response's header (RFC 7143 §11.13), as a target answers `request`: the one
/// builder of the target's login and the initiator crate's test target. The stage bits are
/// sent on success only.
#[derive(Clone, Copy, Debug)]
pub struct LoginResponse<'a> {
    pub request: &'a Bhs,
    pub csg: u8,
    pub transit_to: Option<u8>,
    pub tsih: u16,
    pub stat_sn: u32,
    /// MaxCmdSN is ExpCmdSN (the request's CmdSN) plus this, less one.
    pub window: u32,
    pub status: (u8, u8),
}

impl LoginResponse<'_> {
    pub fn bhs(&self) -> Bhs {
        let mut bhs = Bhs::new(Opcode::LoginResponse);
        if self.status.0 == 0 {
            bhs.set_flags(stage_flags(self.csg, self.transit_to));
        }
        // Version-max and Version-active: 0, the only version (RFC 7143 §11.13.2).
        bhs.set_isid(self.request.isid());
        bhs.set_u16(off::TSIH, self.tsih);
        bhs.set_itt(self.request.itt());
        bhs.set_u32(off::STAT_SN, self.stat_sn);
        let cmd_sn = self.request.u32_at(off::CMD_SN);
        bhs.set_u32(off::EXP_CMD_SN, cmd_sn);
        bhs.set_u32(off::MAX_CMD_SN, cmd_sn.wrapping_add(self.window.max(1) - 1));
        bhs.set_byte(off::STATUS_CLASS, self.status.0);
        bhs.set_byte(off::STATUS_DETAIL, self.status.1);
        bhs
    }
}

/// A login PDU's stage bits: CSG, and the T bit with NSG when it moves on.
fn stage_flags(csg: u8, transit_to: Option<u8>) -> u8 {
    let next = transit_to.map_or(0, |nsg| 0x80 | (nsg & 3));
    (csg & 3) << 2 | next
}

/// Per-connection framing parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framing {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment we accept (our MaxRecvDataSegmentLength, or the login limit).
    pub max_data_segment_len: usize,
}

impl Framing {
    /// Login phase: no digests, 8 KiB text segments (RFC 7143 §13.12 default).
    pub const LOGIN: Framing = Framing {
        header_digest: false,
        data_digest: false,
        max_data_segment_len: 8192,
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// DataSegmentLength exceeds what we negotiated: the peer broke the rules.
    DataSegmentTooLong { len: usize, max: usize },
    /// Header digest mismatch: the BHS cannot be trusted, the connection must go.
    HeaderDigest,
    /// Data digest mismatch: the header is good, the payload is not.
    DataDigest,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::DataSegmentTooLong { len, max } => {
                write!(
                    f,
                    "data segment of {len} bytes exceeds the negotiated {max}"
                )
            }
            FrameError::HeaderDigest => write!(f, "header digest mismatch"),
            FrameError::DataDigest => write!(f, "data digest mismatch"),
        }
    }
}

pub fn padded(len: usize) -> usize {
    (len + 3) & !3
}

/// How many bytes the PDU at the start of `buf` occupies, or `None` if more bytes are needed.
pub fn frame_len(buf: &[u8], framing: &Framing) -> Result<Option<usize>, FrameError> {
    Ok(declared_frame_len(buf, framing)?.filter(|&total| buf.len() >= total))
}

/// The length of the frame that `buf` begins with, as its header declares it, once the whole
/// header is in `buf` (the frame itself may not be yet): None before that.
pub fn declared_frame_len(buf: &[u8], framing: &Framing) -> Result<Option<usize>, FrameError> {
    let Some(bhs) = buf.get(..BHS_LEN) else {
        return Ok(None);
    };
    let ahs_len = bhs[4] as usize * 4;
    let dsl = u32::from_be_bytes([0, bhs[5], bhs[6], bhs[7]]) as usize;
    if dsl > framing.max_data_segment_len {
        return Err(FrameError::DataSegmentTooLong {
            len: dsl,
            max: framing.max_data_segment_len,
        });
    }
    let mut total = BHS_LEN + ahs_len + padded(dsl);
    if framing.header_digest {
        total += 4;
    }
    if framing.data_digest && dsl > 0 {
        total += 4;
    }
    Ok(Some(total))
}

/// One received PDU, borrowing the receive buffer.
#[derive(Clone, Copy, Debug)]
pub struct Pdu<'a> {
    pub bhs: Bhs,
    pub ahs: &'a [u8],
    /// The data segment without padding or digest.
    pub data: &'a [u8],
}

/// Splits a complete frame (as measured by [`frame_len`]) into its parts and checks the digests.
/// A data digest error still returns the header so the caller can Reject that PDU by name.
pub fn parse_frame<'a>(
    frame: &'a [u8],
    framing: &Framing,
) -> Result<Pdu<'a>, (FrameError, Option<Bhs>)> {
    let bhs = Bhs::from_slice(frame).ok_or((FrameError::HeaderDigest, None))?;
    let ahs_len = bhs.total_ahs_len();
    let dsl = bhs.data_segment_len();
    let header_end = BHS_LEN + ahs_len;
    let ahs = frame
        .get(BHS_LEN..header_end)
        .ok_or((FrameError::HeaderDigest, None))?;
    let mut pos = header_end;
    if framing.header_digest {
        let got = read_u32_le(frame, pos).ok_or((FrameError::HeaderDigest, None))?;
        let header = frame
            .get(..header_end)
            .ok_or((FrameError::HeaderDigest, None))?;
        if digest::crc32c(header) != got {
            return Err((FrameError::HeaderDigest, None));
        }
        pos += 4;
    }
    let data = frame
        .get(pos..pos + dsl)
        .ok_or((FrameError::HeaderDigest, Some(bhs)))?;
    let padded_data = frame
        .get(pos..pos + padded(dsl))
        .ok_or((FrameError::HeaderDigest, Some(bhs)))?;
    pos += padded(dsl);
    if framing.data_digest && dsl > 0 {
        let got = read_u32_le(frame, pos).ok_or((FrameError::DataDigest, Some(bhs)))?;
        if digest::crc32c(padded_data) != got {
            return Err((FrameError::DataDigest, Some(bhs)));
        }
    }
    Ok(Pdu { bhs, ahs, data })
}

/// Digests travel in the byte order the CRC32C register is defined in, which RFC 7143 §13.1
/// (by way of its examples) fixes as least significant byte first.
fn read_u32_le(buf: &[u8], pos: usize) -> Option<u32> {
    let b = buf.get(pos..pos + 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Appends a complete PDU (header, optional digests, padded data) to `out`.
pub fn encode_into(out: &mut Vec<u8>, bhs: &Bhs, data: &[u8], framing: &Framing) {
    encode_head(out, bhs, data.len(), framing);
    out.extend_from_slice(data);
    encode_tail(out, data, framing);
}

/// A PDU's header (and its digest) for a data segment of `data_len` bytes that the caller
/// sends after it, then ends with [`encode_tail`].
pub fn encode_head(out: &mut Vec<u8>, bhs: &Bhs, data_len: usize, framing: &Framing) {
    let mut bhs = *bhs;
    bhs.set_data_segment_len(data_len);
    out.extend_from_slice(&bhs.0);
    if framing.header_digest {
        out.extend_from_slice(&digest::crc32c(&bhs.0).to_le_bytes());
    }
}

/// What follows a data segment `data`: its padding and, when negotiated, its digest.
pub fn encode_tail(out: &mut Vec<u8>, data: &[u8], framing: &Framing) {
    if !data.is_empty() {
        let pad = padded(data.len()) - data.len();
        out.extend_from_slice(&[0u8; 3][..pad]);
        if framing.data_digest {
            let crc = digest::crc32c_padded(data);
            out.extend_from_slice(&crc.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_login_response_answers_its_request_field_by_field() {
        let request = LoginRequest {
            csg: 1,
            transit_to: Some(3),
            continues: false,
            isid: [0x80, 1, 2, 3, 4, 5],
            tsih: 0,
            itt: 0x1234,
            cid: 9,
            cmd_sn: 40,
            exp_stat_sn: 7,
        }
        .bhs();
        assert_eq!(request.opcode_raw(), Opcode::LoginRequest as u8);
        assert!(request.immediate());
        assert_eq!(request.flags(), 0x80 | 1 << 2 | 3);
        assert_eq!(
            (request.u16_at(off::CID), request.u32_at(off::EXP_STAT_SN)),
            (9, 7)
        );
        let answer = |status, window| {
            LoginResponse {
                request: &request,
                csg: 1,
                transit_to: Some(3),
                tsih: 0x42,
                stat_sn: 100,
                window,
                status,
            }
            .bhs()
        };
        let ok = answer((0, 0), 32);
        assert_eq!(ok.flags(), 0x80 | 1 << 2 | 3);
        assert_eq!((ok.isid(), ok.itt()), ([0x80, 1, 2, 3, 4, 5], 0x1234));
        assert_eq!((ok.u16_at(off::TSIH), ok.u32_at(off::STAT_SN)), (0x42, 100));
        assert_eq!(
            (ok.u32_at(off::EXP_CMD_SN), ok.u32_at(off::MAX_CMD_SN)),
            (40, 71)
        );
        // A failure carries its status and no stage bits; a window of 0 is one command.
        let refused = answer((2, 1), 0);
        assert_eq!(refused.flags(), 0);
        let status = (
            refused.byte(off::STATUS_CLASS),
            refused.byte(off::STATUS_DETAIL),
        );
        assert_eq!(status, (2, 1));
        assert_eq!(refused.u32_at(off::MAX_CMD_SN), 40);
    }

    fn framing(hd: bool, dd: bool) -> Framing {
        Framing {
            header_digest: hd,
            data_digest: dd,
            max_data_segment_len: 8192,
        }
    }

    #[test]
    fn round_trip_all_digest_combinations() {
        for (hd, dd) in [(false, false), (true, false), (false, true), (true, true)] {
            let f = framing(hd, dd);
            let mut bhs = Bhs::new(Opcode::TextResponse);
            bhs.set_flags(0x80);
            bhs.set_itt(0x1234_5678);
            bhs.set_u32(off::STAT_SN, 77);
            for data in [&b""[..], b"a", b"ab", b"abc", b"abcd", b"abcde"] {
                let mut wire = Vec::new();
                encode_into(&mut wire, &bhs, data, &f);
                assert_eq!(wire.len() % 4, 0);
                assert_eq!(frame_len(&wire, &f), Ok(Some(wire.len())));
                assert_eq!(frame_len(&wire[..wire.len() - 1], &f), Ok(None));
                // The header alone declares the whole frame's length.
                let header = BHS_LEN + if hd { 4 } else { 0 };
                assert_eq!(
                    declared_frame_len(&wire[..header], &f),
                    Ok(Some(wire.len()))
                );
                assert_eq!(declared_frame_len(&wire[..BHS_LEN - 1], &f), Ok(None));
                let pdu = parse_frame(&wire, &f).expect("valid frame");
                assert_eq!(pdu.data, data);
                assert_eq!(pdu.bhs.itt(), 0x1234_5678);
                assert_eq!(pdu.bhs.u32_at(off::STAT_SN), 77);
                assert_eq!(pdu.bhs.data_segment_len(), data.len());
            }
        }
    }

    #[test]
    fn short_buffers_need_more() {
        let f = framing(false, false);
        assert_eq!(frame_len(&[], &f), Ok(None));
        assert_eq!(frame_len(&[0u8; 47], &f), Ok(None));
        assert_eq!(frame_len(&[0u8; 48], &f), Ok(Some(48)));
    }

    #[test]
    fn oversized_segment_is_refused_before_buffering() {
        let f = framing(false, false);
        let mut bhs = Bhs::new(Opcode::DataOut);
        bhs.set_data_segment_len(8193);
        assert_eq!(
            frame_len(&bhs.0, &f),
            Err(FrameError::DataSegmentTooLong {
                len: 8193,
                max: 8192
            })
        );
        bhs.set_data_segment_len(DATA_SEGMENT_LEN_MAX);
        assert!(frame_len(&bhs.0, &f).is_err());
    }

    #[test]
    fn ahs_counts_in_length() {
        let f = framing(false, false);
        let mut raw = [0u8; 48 + 20];
        raw[4] = 5; // 20 bytes of AHS
        assert_eq!(frame_len(&raw[..48], &f), Ok(None));
        assert_eq!(frame_len(&raw, &f), Ok(Some(68)));
        let pdu = parse_frame(&raw, &f).expect("frame");
        assert_eq!(pdu.ahs.len(), 20);
    }

    #[test]
    fn corrupted_digests_are_detected() {
        let f = framing(true, true);
        let mut bhs = Bhs::new(Opcode::DataOut);
        bhs.set_itt(9);
        let mut wire = Vec::new();
        encode_into(&mut wire, &bhs, b"hello", &f);
        let mut bad_header = wire.clone();
        bad_header[20] ^= 1;
        assert_eq!(
            parse_frame(&bad_header, &f).unwrap_err().0,
            FrameError::HeaderDigest
        );
        let mut bad_data = wire.clone();
        bad_data[52] ^= 1;
        let (err, hdr) = parse_frame(&bad_data, &f).unwrap_err();
        assert_eq!(err, FrameError::DataDigest);
        assert_eq!(hdr.map(|h| h.itt()), Some(9));
        let mut bad_digest = wire.clone();
        let n = bad_digest.len();
        bad_digest[n - 1] ^= 0x80;
        assert_eq!(
            parse_frame(&bad_digest, &f).unwrap_err().0,
            FrameError::DataDigest
        );
    }

    #[test]
    fn opcode_tables() {
        for raw in 0u8..=0x3f {
            let i = Opcode::from_initiator(raw);
            let t = Opcode::from_target(raw);
            assert!(i.is_none() || t.is_none());
            if let Some(op) = i.or(t) {
                assert_eq!(op as u8, raw);
            }
        }
        assert_eq!(Opcode::from_initiator(0x41), Some(Opcode::ScsiCommand));
        assert_eq!(Opcode::from_initiator(0x07), None);
    }

    #[test]
    fn field_accessors() {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_immediate(true);
        assert!(b.immediate());
        assert_eq!(b.opcode_raw(), 1);
        b.set_immediate(false);
        assert!(!b.immediate());
        b.set_data_segment_len(0x123456);
        assert_eq!(b.data_segment_len(), 0x123456);
        b.set_lun([1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(b.lun(), [1, 2, 3, 4, 5, 6, 7, 8]);
        b.set_u16(36, 0xbeef);
        assert_eq!(b.u16_at(36), 0xbeef);
    }
}
