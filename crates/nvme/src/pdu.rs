//! NVMe/TCP PDU framing (transport specification 1.0, section 3.6): an 8-byte common header,
//! a PDU-specific header, an optional header digest, padding to the receiver's alignment, the
//! data, and an optional data digest. [`frame`] checks a received common header against what
//! the receiver accepts before a byte more is read; every refusal names the fatal error status
//! and field a C2HTermReq / H2CTermReq reports.

/// Length of the common header.
pub const CH_LEN: usize = 8;
/// Length of a digest (CRC32C).
pub const DIGEST_LEN: usize = 4;
/// The data a termination request may carry: the header in error, at most this long.
pub const TERM_DATA_MAX: usize = 152;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PduType {
    ICReq = 0x00,
    ICResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_u8(raw: u8) -> Option<PduType> {
        Some(match raw {
            0x00 => PduType::ICReq,
            0x01 => PduType::ICResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// The header length (common header plus PDU-specific header) every PDU of this type has.
    pub fn hlen(self) -> usize {
        match self {
            PduType::ICReq | PduType::ICResp => 128,
            PduType::CapsuleCmd => CH_LEN + crate::sqe::SQE_LEN,
            PduType::CapsuleResp => CH_LEN + crate::sqe::CQE_LEN,
            PduType::H2CTermReq
            | PduType::C2HTermReq
            | PduType::H2CData
            | PduType::C2HData
            | PduType::R2T => 24,
        }
    }

    /// Sent by a host (and received by a controller).
    pub fn from_host(self) -> bool {
        matches!(
            self,
            PduType::ICReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData
        )
    }

    /// May carry data.
    fn carries_data(self) -> bool {
        matches!(
            self,
            PduType::H2CTermReq
                | PduType::C2HTermReq
                | PduType::CapsuleCmd
                | PduType::H2CData
                | PduType::C2HData
        )
    }

    /// Covered by the negotiated digests (every PDU after connection initialization but the
    /// termination requests).
    fn digested(self) -> bool {
        !matches!(
            self,
            PduType::ICReq | PduType::ICResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }
}

/// Common header flags.
pub mod flags {
    /// A header digest follows the header.
    pub const HDGSTF: u8 = 0x01;
    /// A data digest follows the data.
    pub const DDGSTF: u8 = 0x02;
    /// H2CData / C2HData: the last data PDU of the command's transfer.
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command succeeded and no response capsule follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a termination request (transport specification 1.0, figure 19).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Fatal {
    InvalidHeaderField = 0x01,
    SequenceError = 0x02,
    HeaderDigestError = 0x03,
    DataOutOfRange = 0x04,
    DataLimitExceeded = 0x05,
    UnsupportedParameter = 0x06,
}

/// Why a received PDU cannot be taken: the fatal error status and, for an invalid header field,
/// the byte offset of the field in the header (the fatal error information).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: Fatal,
    pub field: u32,
}

impl Refusal {
    fn field(offset: u32) -> Refusal {
        Refusal {
            status: Fatal::InvalidHeaderField,
            field: offset,
        }
    }
}

/// What the receiver of a connection accepts, as connection initialization settled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    /// This end is the controller (it receives host PDUs).
    pub controller: bool,
    /// The ICReq / ICResp exchange is done: every other PDU is now allowed, the first not.
    pub initialized: bool,
    pub header_digest: bool,
    pub data_digest: bool,
    /// The receiver's data alignment (HPDA at a controller, CPDA at a host), 0's based
    /// dwords.
    pub alignment: u8,
    /// The most data one PDU may carry to this receiver (in-capsule data, H2CData: MAXH2CDATA).
    pub data_max: u32,
}

/// How a PDU whose common header was accepted lies on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub pdu_type: PduType,
    pub flags: u8,
    /// Header length (common header and PDU-specific header).
    pub hlen: usize,
    /// A header digest follows the header.
    pub header_digest: bool,
    /// Offset of the data from the start of the PDU (0: none).
    pub data_offset: usize,
    pub data_len: usize,
    /// A data digest follows the data.
    pub data_digest: bool,
    /// The whole PDU's length.
    pub len: usize,
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Checks a received common header: the PDU type for this direction and phase, its fixed header
/// length, the digest flags the connection negotiated, the data offset the alignment implies,
/// and the lengths against the receiver's limit. Nothing after the common header is read.
pub fn frame(ch: &[u8; CH_LEN], accept: &Accept) -> Result<Frame, Refusal> {
    let pdu_type = PduType::from_u8(ch[0]).ok_or(Refusal::field(0))?;
    if pdu_type.from_host() != accept.controller {
        return Err(Refusal::field(0));
    }
    // Before initialization only the ICReq / ICResp (or a termination); after, never again.
    let init = matches!(pdu_type, PduType::ICReq | PduType::ICResp);
    let term = matches!(pdu_type, PduType::H2CTermReq | PduType::C2HTermReq);
    if init == accept.initialized && !term {
        return Err(Refusal {
            status: Fatal::SequenceError,
            field: 0,
        });
    }
    let flags = ch[1];
    let hlen = usize::from(ch[2]);
    if hlen != pdu_type.hlen() {
        return Err(Refusal::field(2));
    }
    let digested = pdu_type.digested();
    let header_digest = flags & flags::HDGSTF != 0;
    if header_digest != (digested && accept.header_digest) {
        return Err(Refusal::field(1));
    }
    let len = le32(&ch[4..8]) as usize;
    let header_end = hlen + if header_digest { DIGEST_LEN } else { 0 };
    let pdo = usize::from(ch[3]);
    if len < header_end {
        return Err(Refusal::field(4));
    }
    let has_data = len > header_end;
    if has_data && !pdu_type.carries_data() {
        return Err(Refusal::field(4));
    }
    let data_digest = flags & flags::DDGSTF != 0;
    if data_digest != (has_data && digested && accept.data_digest) {
        return Err(Refusal::field(1));
    }
    if !has_data {
        // A data offset without data, or data the type cannot carry, is a malformed header.
        if pdo != 0 && pdo != header_end {
            return Err(Refusal::field(3));
        }
        return Ok(Frame {
            pdu_type,
            flags,
            hlen,
            header_digest,
            data_offset: 0,
            data_len: 0,
            data_digest: false,
            len,
        });
    }
    let expected_pdo = if term {
        header_end
    } else {
        let align = (usize::from(accept.alignment) + 1) * 4;
        header_end.div_ceil(align) * align
    };
    if pdo != expected_pdo {
        return Err(Refusal::field(3));
    }
    let trailer = if data_digest { DIGEST_LEN } else { 0 };
    let data_len = len
        .checked_sub(pdo + trailer)
        .filter(|&n| n > 0)
        .ok_or(Refusal::field(4))?;
    let limit = if term {
        TERM_DATA_MAX
    } else {
        accept.data_max as usize
    };
    if data_len > limit {
        return Err(Refusal {
            status: Fatal::DataLimitExceeded,
            field: 4,
        });
    }
    Ok(Frame {
        pdu_type,
        flags,
        hlen,
        header_digest,
        data_offset: pdo,
        data_len,
        data_digest,
        len,
    })
}

/// Writes a common header.
pub fn put_ch(out: &mut Vec<u8>, pdu_type: PduType, flags: u8, pdo: u8, plen: u32) {
    out.extend_from_slice(&ch(pdu_type, flags, pdo, plen));
}

/// A common header's bytes.
pub fn ch(pdu_type: PduType, flags: u8, pdo: u8, plen: u32) -> [u8; CH_LEN] {
    let p = plen.to_le_bytes();
    [
        pdu_type as u8,
        flags,
        pdu_type.hlen() as u8,
        pdo,
        p[0],
        p[1],
        p[2],
        p[3],
    ]
}

/// The CRC32C digest of a header or of data (the same polynomial as iSCSI's).
pub fn digest(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Checks the header digest that follows `header` (its `hlen` bytes).
pub fn header_digest_ok(header: &[u8], digest_bytes: &[u8; DIGEST_LEN]) -> bool {
    digest(header) == u32::from_le_bytes(*digest_bytes)
}

/// The connection request a host opens with (ICReq).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ICReq {
    /// Host PDU data alignment, 0's based dwords (0..=31).
    pub hpda: u8,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Outstanding R2Ts per command the host supports, 0's based.
    pub maxr2t: u32,
}

impl ICReq {
    /// Parses an ICReq's 128-byte header (after [`frame`]); an unknown PDU format version,
    /// alignment or digest bit is refused as a field in error.
    pub fn parse(header: &[u8]) -> Result<ICReq, Refusal> {
        if header.len() != PduType::ICReq.hlen() {
            return Err(Refusal::field(2));
        }
        let pfv = u16::from_le_bytes([header[8], header[9]]);
        if pfv != 0 {
            return Err(Refusal {
                status: Fatal::UnsupportedParameter,
                field: 8,
            });
        }
        let hpda = header[10];
        if hpda > 31 {
            return Err(Refusal::field(10));
        }
        let dgst = header[11];
        if dgst & !0x03 != 0 {
            return Err(Refusal::field(11));
        }
        Ok(ICReq {
            hpda,
            header_digest: dgst & 0x01 != 0,
            data_digest: dgst & 0x02 != 0,
            maxr2t: le32(&header[12..16]),
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        put_ch(out, PduType::ICReq, 0, 0, 128);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.push(self.hpda);
        out.push(u8::from(self.header_digest) | u8::from(self.data_digest) << 1);
        out.extend_from_slice(&self.maxr2t.to_le_bytes());
        out.resize(start + 128, 0);
    }
}

/// The controller's answer (ICResp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ICResp {
    /// Controller PDU data alignment, 0's based dwords.
    pub cpda: u8,
    pub header_digest: bool,
    pub data_digest: bool,
    /// The most data in one H2CData PDU (at least 4096, a multiple of 4).
    pub maxh2cdata: u32,
}

impl ICResp {
    pub fn encode(&self, out: &mut Vec<u8>) {
        debug_assert!(self.maxh2cdata >= 4096 && self.maxh2cdata.is_multiple_of(4));
        let start = out.len();
        put_ch(out, PduType::ICResp, 0, 0, 128);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.push(self.cpda);
        out.push(u8::from(self.header_digest) | u8::from(self.data_digest) << 1);
        out.extend_from_slice(&self.maxh2cdata.to_le_bytes());
        out.resize(start + 128, 0);
    }

    pub fn parse(header: &[u8]) -> Result<ICResp, Refusal> {
        if header.len() != PduType::ICResp.hlen() {
            return Err(Refusal::field(2));
        }
        if u16::from_le_bytes([header[8], header[9]]) != 0 {
            return Err(Refusal {
                status: Fatal::UnsupportedParameter,
                field: 8,
            });
        }
        let maxh2cdata = le32(&header[12..16]);
        if maxh2cdata < 4096 || !maxh2cdata.is_multiple_of(4) {
            return Err(Refusal::field(12));
        }
        Ok(ICResp {
            cpda: header[10],
            header_digest: header[11] & 0x01 != 0,
            data_digest: header[11] & 0x02 != 0,
            maxh2cdata,
        })
    }
}

/// The PDU-specific header of H2CData, C2HData and R2T: which command, which transfer, where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The command capsule's command identifier.
    pub cccid: u16,
    /// The transfer tag (the controller's, from its R2T; reserved in C2HData).
    pub ttag: u16,
    pub offset: u32,
    pub len: u32,
}

impl Transfer {
    /// The transfer a 24-byte data or R2T header names (None for a shorter slice).
    pub fn parse(header: &[u8]) -> Option<Transfer> {
        let h = header.get(..20)?;
        Some(Transfer {
            cccid: u16::from_le_bytes([h[8], h[9]]),
            ttag: u16::from_le_bytes([h[10], h[11]]),
            offset: le32(&h[12..16]),
            len: le32(&h[16..20]),
        })
    }

    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.cccid.to_le_bytes());
        out.extend_from_slice(&self.ttag.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
    }

    /// An R2T asking the host for this part of the command's data.
    pub fn encode_r2t(&self, header_digest: bool, out: &mut Vec<u8>) {
        let start = out.len();
        let hd = if header_digest { DIGEST_LEN } else { 0 };
        let plen = (PduType::R2T.hlen() + hd) as u32;
        put_ch(
            out,
            PduType::R2T,
            if header_digest { flags::HDGSTF } else { 0 },
            0,
            plen,
        );
        self.put(out);
        if header_digest {
            let d = digest(&out[start..]);
            out.extend_from_slice(&d.to_le_bytes());
        }
    }

    /// The header (and header digest) of a C2HData PDU carrying `self.len` bytes of data at
    /// `self.offset`; `extra` is [`flags::LAST_PDU`] and [`flags::SUCCESS`] as they apply. The
    /// data and its digest follow, the caller's.
    pub fn encode_c2h_header(&self, extra: u8, digests: (bool, bool), out: &mut Vec<u8>) {
        debug_assert!(extra & !(flags::LAST_PDU | flags::SUCCESS) == 0);
        self.encode_data_header(PduType::C2HData, extra, digests, out);
    }

    /// The header of an H2CData PDU (a host's), as [`Transfer::encode_c2h_header`].
    pub fn encode_h2c_header(&self, last: bool, digests: (bool, bool), out: &mut Vec<u8>) {
        let extra = if last { flags::LAST_PDU } else { 0 };
        self.encode_data_header(PduType::H2CData, extra, digests, out);
    }

    fn encode_data_header(
        &self,
        pdu_type: PduType,
        extra: u8,
        digests: (bool, bool),
        out: &mut Vec<u8>,
    ) {
        let (hdgst, ddgst) = digests;
        let start = out.len();
        let pdo = pdu_type.hlen() + if hdgst { DIGEST_LEN } else { 0 };
        let plen = pdo + self.len as usize + if ddgst { DIGEST_LEN } else { 0 };
        let mut f = extra;
        if hdgst {
            f |= flags::HDGSTF;
        }
        if ddgst {
            f |= flags::DDGSTF;
        }
        put_ch(
            out,
            pdu_type,
            f,
            pdo as u8,
            u32::try_from(plen).unwrap_or(u32::MAX),
        );
        self.put(out);
        if hdgst {
            let d = digest(&out[start..]);
            out.extend_from_slice(&d.to_le_bytes());
        }
    }
}

/// A termination request (C2HTermReq from a controller, H2CTermReq from a host): the fatal
/// error and up to [`TERM_DATA_MAX`] bytes of the header in error. The connection ends after.
pub fn encode_term(refusal: &Refusal, from_controller: bool, header: &[u8], out: &mut Vec<u8>) {
    let pdu_type = if from_controller {
        PduType::C2HTermReq
    } else {
        PduType::H2CTermReq
    };
    let data = &header[..header.len().min(TERM_DATA_MAX)];
    let hlen = pdu_type.hlen();
    let pdo = if data.is_empty() { 0 } else { hlen as u8 };
    put_ch(out, pdu_type, 0, pdo, (hlen + data.len()) as u32);
    out.extend_from_slice(&(refusal.status as u16).to_le_bytes());
    out.extend_from_slice(&refusal.field.to_le_bytes());
    out.extend_from_slice(&[0; 10]);
    out.extend_from_slice(data);
}

#[cfg(test)]
mod tests;
