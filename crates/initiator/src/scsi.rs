//! SCSI pieces an initiator needs: CDBs (READ/WRITE 10/16, READ CAPACITY(16), TEST UNIT READY,
//! INQUIRY, REPORT LUNS, SYNCHRONIZE CACHE(10)), status codes, sense data parsing, and the
//! parsers of the answers the helpers need. Nothing here panics on short or hostile data.

use std::fmt;

/// SCSI status codes (SAM-5).
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const CONDITION_MET: u8 = 0x04;
    pub const BUSY: u8 = 0x08;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    pub const TASK_SET_FULL: u8 = 0x28;
    pub const ACA_ACTIVE: u8 = 0x30;
    pub const TASK_ABORTED: u8 = 0x40;
}

/// Sense keys (SPC-5 §4.4.2).
pub mod sense_key {
    pub const NO_SENSE: u8 = 0x0;
    pub const NOT_READY: u8 = 0x2;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const ABORTED_COMMAND: u8 = 0xb;
    pub const MISCOMPARE: u8 = 0xe;
}

/// The longest CDB without an additional header segment.
pub const CDB_MAX: usize = 16;

/// A command descriptor block of up to 16 bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Cdb {
    bytes: [u8; CDB_MAX],
    len: u8,
}

impl Cdb {
    /// `None` for an empty CDB or one longer than 16 bytes (extended CDBs are not supported).
    pub fn new(bytes: &[u8]) -> Option<Cdb> {
        if bytes.is_empty() || bytes.len() > CDB_MAX {
            return None;
        }
        let mut b = [0u8; CDB_MAX];
        b.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(Cdb {
            bytes: b,
            len: bytes.len() as u8,
        })
    }

    fn fixed<const N: usize>(bytes: [u8; N]) -> Cdb {
        const { assert!(N > 0 && N <= CDB_MAX) };
        let mut b = [0u8; CDB_MAX];
        b[..N].copy_from_slice(&bytes);
        Cdb {
            bytes: b,
            len: N as u8,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The 16-byte field of the SCSI Command PDU (zero padded).
    pub fn padded(&self) -> &[u8; CDB_MAX] {
        &self.bytes
    }

    pub fn opcode(&self) -> u8 {
        self.bytes[0]
    }
}

impl fmt::Debug for Cdb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cdb(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// READ(10). `blocks` is the transfer length in logical blocks.
pub fn read10(lba: u32, blocks: u16) -> Cdb {
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    Cdb::fixed([0x28, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0])
}

/// WRITE(10).
pub fn write10(lba: u32, blocks: u16) -> Cdb {
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    Cdb::fixed([0x2a, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0])
}

fn rw16(opcode: u8, lba: u64, blocks: u32, fua: bool) -> Cdb {
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    let flags = if fua { 0x08 } else { 0 };
    Cdb::fixed([
        opcode, flags, l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], n[0], n[1], n[2], n[3], 0, 0,
    ])
}

/// READ(16).
pub fn read16(lba: u64, blocks: u32) -> Cdb {
    rw16(0x88, lba, blocks, false)
}

/// WRITE(16); `fua` asks for the data to be durable before GOOD.
pub fn write16(lba: u64, blocks: u32, fua: bool) -> Cdb {
    rw16(0x8a, lba, blocks, fua)
}

/// TEST UNIT READY.
pub fn test_unit_ready() -> Cdb {
    Cdb::fixed([0u8; 6])
}

/// INQUIRY (standard data, or the VPD page `page` when given), allocation length `alloc`.
pub fn inquiry(page: Option<u8>, alloc: u16) -> Cdb {
    let a = alloc.to_be_bytes();
    let (evpd, p) = page.map_or((0, 0), |p| (1, p));
    Cdb::fixed([0x12, evpd, p, a[0], a[1], 0])
}

/// READ CAPACITY(16) (SERVICE ACTION IN(16), service action 0x10), 32 bytes.
pub fn read_capacity16() -> Cdb {
    Cdb::fixed([0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0])
}

/// REPORT LUNS (select report 0) with allocation length `alloc`.
pub fn report_luns(alloc: u32) -> Cdb {
    let a = alloc.to_be_bytes();
    Cdb::fixed([0xa0, 0, 0, 0, 0, 0, a[0], a[1], a[2], a[3], 0, 0])
}

/// SYNCHRONIZE CACHE(10) of the whole medium.
pub fn synchronize_cache10() -> Cdb {
    Cdb::fixed([0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0])
}

/// Sense data, fixed (0x70/0x71) or descriptor (0x72/0x73) format.
#[derive(Clone, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// Whether it describes a deferred error (response codes 0x71/0x73).
    pub deferred: bool,
    pub raw: Vec<u8>,
}

impl Sense {
    /// `None` for data too short for its format or an unknown response code.
    pub fn parse(raw: &[u8]) -> Option<Sense> {
        let code = raw.first()? & 0x7f;
        let (key, asc, ascq) = match code {
            0x70 | 0x71 => (
                raw.get(2)? & 0x0f,
                raw.get(12).copied().unwrap_or(0),
                raw.get(13).copied().unwrap_or(0),
            ),
            0x72 | 0x73 => (raw.get(1)? & 0x0f, *raw.get(2)?, *raw.get(3)?),
            _ => return None,
        };
        Some(Sense {
            key,
            asc,
            ascq,
            deferred: code == 0x71 || code == 0x73,
            raw: raw.to_vec(),
        })
    }

    pub fn is_unit_attention(&self) -> bool {
        self.key == sense_key::UNIT_ATTENTION
    }
}

impl fmt::Debug for Sense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Sense(key={:#x} asc={:#04x} ascq={:#04x}{})",
            self.key,
            self.asc,
            self.ascq,
            if self.deferred { " deferred" } else { "" }
        )
    }
}

/// What READ CAPACITY(16) answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Number of logical blocks (last LBA + 1).
    pub blocks: u64,
    pub block_size: u32,
}

impl Capacity {
    pub fn parse(data: &[u8]) -> Option<Capacity> {
        let last: [u8; 8] = data.get(0..8)?.try_into().ok()?;
        let size: [u8; 4] = data.get(8..12)?.try_into().ok()?;
        Some(Capacity {
            blocks: u64::from_be_bytes(last).checked_add(1)?,
            block_size: u32::from_be_bytes(size),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(u64::from(self.block_size))
    }
}

/// The LUNs of a REPORT LUNS answer (8-byte SAM LUNs decoded by [`decode_lun`]).
pub fn parse_report_luns(data: &[u8]) -> Option<Vec<u64>> {
    let len: [u8; 4] = data.get(0..4)?.try_into().ok()?;
    let len = u32::from_be_bytes(len) as usize;
    let list = data.get(8..)?;
    let list = list.get(..len.min(list.len()))?;
    Some(
        list.chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                decode_lun(b)
            })
            .collect(),
    )
}

/// Encodes a LUN the way targets expect it: peripheral addressing below 256, flat space
/// addressing below 16384, and anything larger as the 8 raw bytes of the value.
pub fn encode_lun(lun: u64) -> [u8; 8] {
    if lun < 256 {
        [0, lun as u8, 0, 0, 0, 0, 0, 0]
    } else if lun < 16384 {
        [0x40 | (lun >> 8) as u8, lun as u8, 0, 0, 0, 0, 0, 0]
    } else {
        lun.to_be_bytes()
    }
}

/// The inverse of [`encode_lun`] for single-level peripheral and flat addressing; other
/// encodings come back as their raw 8 bytes.
pub fn decode_lun(b: [u8; 8]) -> u64 {
    let rest_zero = b[2..].iter().all(|&x| x == 0);
    match b[0] >> 6 {
        0 if b[0] == 0 && rest_zero => u64::from(b[1]),
        1 if rest_zero => (u64::from(b[0] & 0x3f) << 8) | u64::from(b[1]),
        _ => u64::from_be_bytes(b),
    }
}

/// The fields of standard INQUIRY data a test or bench prints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inquiry {
    pub peripheral_type: u8,
    pub vendor: String,
    pub product: String,
    pub revision: String,
}

impl Inquiry {
    pub fn parse(data: &[u8]) -> Option<Inquiry> {
        let text = |r: std::ops::Range<usize>| {
            data.get(r)
                .map(|b| String::from_utf8_lossy(b).trim().to_string())
                .unwrap_or_default()
        };
        Some(Inquiry {
            peripheral_type: data.first()? & 0x1f,
            vendor: text(8..16),
            product: text(16..32),
            revision: text(32..36),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdbs_encode_their_fields() {
        assert_eq!(
            read10(0x01020304, 0x0506).as_bytes(),
            [0x28, 0, 1, 2, 3, 4, 0, 5, 6, 0]
        );
        assert_eq!(write10(7, 1).as_bytes()[0], 0x2a);
        let r = read16(0x0102030405060708, 0x0a0b0c0d);
        assert_eq!(r.as_bytes().len(), 16);
        assert_eq!(
            &r.as_bytes()[2..14],
            [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]
        );
        assert_eq!(write16(0, 1, true).as_bytes()[1], 0x08);
        assert_eq!(test_unit_ready().as_bytes(), [0; 6]);
        assert_eq!(
            inquiry(Some(0x80), 255).as_bytes(),
            [0x12, 1, 0x80, 0, 255, 0]
        );
        assert_eq!(read_capacity16().as_bytes()[..2], [0x9e, 0x10]);
        assert_eq!(report_luns(4096).as_bytes()[6..10], [0, 0, 0x10, 0]);
        assert_eq!(synchronize_cache10().opcode(), 0x35);
        assert!(Cdb::new(&[]).is_none());
        assert!(Cdb::new(&[0; 17]).is_none());
        assert_eq!(
            Cdb::new(&[1, 2]).map(|c| c.padded()[..3].to_vec()),
            Some(vec![1, 2, 0])
        );
    }

    #[test]
    fn sense_fixed_and_descriptor() {
        let mut fixed = [0u8; 18];
        fixed[0] = 0x70;
        fixed[2] = 0x06;
        fixed[7] = 10;
        fixed[12] = 0x29;
        fixed[13] = 0x02;
        let s = Sense::parse(&fixed).expect("fixed");
        assert_eq!((s.key, s.asc, s.ascq, s.deferred), (6, 0x29, 0x02, false));
        assert!(s.is_unit_attention());
        let s = Sense::parse(&[0xf2, 0x05, 0x24, 0x01, 0, 0, 0, 0]).expect("descriptor");
        assert_eq!((s.key, s.asc, s.ascq), (5, 0x24, 1));
        assert_eq!(
            Sense::parse(&[0x73, 0x03, 0x11, 0x00]).map(|s| s.deferred),
            Some(true)
        );
        // Short fixed sense without ASC bytes still has a key.
        assert_eq!(Sense::parse(&[0x70, 0, 0x02]).map(|s| s.key), Some(2));
        for bad in [&[][..], &[0x70, 0], &[0x72, 5, 0x24], &[0x12, 0, 0, 0]] {
            assert_eq!(Sense::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn capacity_luns_inquiry() {
        let mut cap = [0u8; 32];
        cap[7] = 0xff;
        cap[10] = 0x02;
        assert_eq!(
            Capacity::parse(&cap),
            Some(Capacity {
                blocks: 256,
                block_size: 512
            })
        );
        assert_eq!(Capacity::parse(&cap[..11]), None);
        assert_eq!(Capacity::parse(&[0xff; 12]), None, "last LBA + 1 overflows");
        let mut luns = vec![0, 0, 0, 24, 0, 0, 0, 0];
        luns.extend(encode_lun(0));
        luns.extend(encode_lun(5));
        luns.extend(encode_lun(300));
        assert_eq!(parse_report_luns(&luns), Some(vec![0, 5, 300]));
        // A length larger than the data: what arrived is used.
        luns[3] = 200;
        assert_eq!(parse_report_luns(&luns), Some(vec![0, 5, 300]));
        assert_eq!(parse_report_luns(&[0, 0]), None);
        assert_eq!(decode_lun(encode_lun(70_000)), 70_000);
        let mut inq = vec![0u8; 36];
        inq[8..16].copy_from_slice(b"FERROSAN");
        let i = Inquiry::parse(&inq).expect("inquiry");
        assert_eq!(i.vendor, "FERROSAN");
        assert_eq!(
            Inquiry::parse(&inq[..10]).map(|i| i.product),
            Some(String::new())
        );
        assert_eq!(Inquiry::parse(&[]), None);
    }
}
