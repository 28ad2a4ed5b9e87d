//! CDB field access. Every read is bounds-checked (a short CDB reads as zeros) even though the
//! dispatcher already checked the length against the opcode table.

use crate::sense::Sense;

pub const TEST_UNIT_READY: u8 = 0x00;
pub const REQUEST_SENSE: u8 = 0x03;
pub const READ_6: u8 = 0x08;
pub const RESERVE_6: u8 = 0x16;
pub const RELEASE_6: u8 = 0x17;
pub const WRITE_6: u8 = 0x0A;
pub const INQUIRY: u8 = 0x12;
pub const MODE_SELECT_6: u8 = 0x15;
pub const MODE_SENSE_6: u8 = 0x1A;
pub const START_STOP_UNIT: u8 = 0x1B;
pub const PREVENT_ALLOW_MEDIUM_REMOVAL: u8 = 0x1E;
pub const READ_CAPACITY_10: u8 = 0x25;
pub const READ_10: u8 = 0x28;
pub const WRITE_10: u8 = 0x2A;
pub const WRITE_AND_VERIFY_10: u8 = 0x2E;
pub const VERIFY_10: u8 = 0x2F;
pub const PRE_FETCH_10: u8 = 0x34;
pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
pub const READ_DEFECT_DATA_10: u8 = 0x37;
pub const WRITE_SAME_10: u8 = 0x41;
pub const UNMAP: u8 = 0x42;
pub const MODE_SELECT_10: u8 = 0x55;
pub const RESERVE_10: u8 = 0x56;
pub const RELEASE_10: u8 = 0x57;
pub const MODE_SENSE_10: u8 = 0x5A;
pub const PERSISTENT_RESERVE_IN: u8 = 0x5E;
pub const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
pub const EXTENDED_COPY: u8 = 0x83;
pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
pub const READ_16: u8 = 0x88;
pub const COMPARE_AND_WRITE: u8 = 0x89;
pub const WRITE_16: u8 = 0x8A;
pub const ORWRITE_16: u8 = 0x8B;
pub const WRITE_AND_VERIFY_16: u8 = 0x8E;
pub const VERIFY_16: u8 = 0x8F;
pub const PRE_FETCH_16: u8 = 0x90;
pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
pub const WRITE_SAME_16: u8 = 0x93;
pub const WRITE_ATOMIC_16: u8 = 0x9C;
pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
pub const REPORT_LUNS: u8 = 0xA0;
pub const MAINTENANCE_IN: u8 = 0xA3;
pub const MAINTENANCE_OUT: u8 = 0xA4;
pub const READ_12: u8 = 0xA8;
pub const WRITE_12: u8 = 0xAA;
pub const WRITE_AND_VERIFY_12: u8 = 0xAE;
pub const VERIFY_12: u8 = 0xAF;
pub const READ_DEFECT_DATA_12: u8 = 0xB7;

pub const SA_READ_CAPACITY_16: u16 = 0x10;
pub const SA_GET_LBA_STATUS: u16 = 0x12;
pub const SA_REPORT_SUPPORTED_OPCODES: u16 = 0x0C;
pub const SA_REPORT_TARGET_PORT_GROUPS: u16 = 0x0A;
pub const SA_SET_TARGET_PORT_GROUPS: u16 = 0x0A;

/// Medium-modifying commands: refused on a write-protected LU or mapping.
pub fn is_medium_write(opcode: u8) -> bool {
    matches!(
        opcode,
        WRITE_6
            | WRITE_10
            | WRITE_12
            | WRITE_16
            | WRITE_AND_VERIFY_10
            | WRITE_AND_VERIFY_12
            | WRITE_AND_VERIFY_16
            | WRITE_SAME_10
            | WRITE_SAME_16
            | UNMAP
            | COMPARE_AND_WRITE
            | ORWRITE_16
            | WRITE_ATOMIC_16
    )
}

#[derive(Clone, Copy)]
pub struct Cdb<'a>(pub &'a [u8]);

impl Cdb<'_> {
    pub fn u8(&self, at: usize) -> u8 {
        self.0.get(at).copied().unwrap_or(0)
    }
    pub fn be16(&self, at: usize) -> u16 {
        u16::from_be_bytes([self.u8(at), self.u8(at + 1)])
    }
    pub fn be24(&self, at: usize) -> u32 {
        u32::from_be_bytes([0, self.u8(at), self.u8(at + 1), self.u8(at + 2)])
    }
    pub fn be32(&self, at: usize) -> u32 {
        u32::from_be_bytes([
            self.u8(at),
            self.u8(at + 1),
            self.u8(at + 2),
            self.u8(at + 3),
        ])
    }
    pub fn be64(&self, at: usize) -> u64 {
        (u64::from(self.be32(at)) << 32) | u64::from(self.be32(at + 4))
    }
    /// Service action: the low 5 bits of byte 1.
    pub fn service_action(&self) -> u16 {
        u16::from(self.u8(1) & 0x1F)
    }
}

/// Bounds-checked big-endian reads from a parameter list (Data-Out).
pub fn param_be16(p: &[u8], at: usize) -> Option<u16> {
    let b = p.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([b[0], b[1]]))
}
pub fn param_be32(p: &[u8], at: usize) -> Option<u32> {
    let b = p.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}
pub fn param_be64(p: &[u8], at: usize) -> Option<u64> {
    Some((u64::from(param_be32(p, at)?) << 32) | u64::from(param_be32(p, at + 4)?))
}

/// Rejects any bit of `cdb[byte]` outside `allowed` with INVALID FIELD IN CDB pointing at the
/// highest offending bit.
pub fn check_reserved(cdb: Cdb<'_>, byte: usize, allowed: u8) -> Result<(), Sense> {
    let bad = cdb.u8(byte) & !allowed;
    if bad == 0 {
        Ok(())
    } else {
        let bit = 7 - bad.leading_zeros() as u8;
        Err(Sense::invalid_field_in_cdb(byte as u16, Some(bit)))
    }
}

/// Truncates a built response to the allocation length and the transport's limit; returns the
/// transfer length the command reports.
pub fn finish_data_in(data_in: &mut Vec<u8>, allocation_len: u32, data_in_limit: u32) -> u32 {
    let produced = u32::try_from(data_in.len()).unwrap_or(u32::MAX);
    let transfer = produced.min(allocation_len);
    data_in.truncate(transfer.min(data_in_limit) as usize);
    transfer
}

/// Appends `s` to `out` as a fixed-width ASCII field, space padded (SPC-4 4.4.1).
pub fn put_ascii(out: &mut Vec<u8>, s: &str, width: usize) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(width);
    out.extend_from_slice(&bytes[..n]);
    out.resize(out.len() + (width - n), b' ');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_cdb_reads_zero() {
        let c = Cdb(&[0x28, 0xFF]);
        assert_eq!(c.be32(2), 0);
        assert_eq!(c.be16(1), 0xFF00);
        assert_eq!(c.be64(0), 0x28FF_0000_0000_0000);
    }

    #[test]
    fn reserved_bits_point_at_highest_bad_bit() {
        let c = Cdb(&[0x28, 0x21]);
        let s = check_reserved(c, 1, 0x18).unwrap_err();
        assert_eq!(s.sense_key_specific, Some([0xCD, 0, 1]));
        assert!(check_reserved(c, 1, 0x21).is_ok());
    }

    #[test]
    fn parameter_reads_are_bounded() {
        assert_eq!(param_be16(&[1, 2], 0), Some(0x0102));
        assert_eq!(param_be16(&[1, 2], 1), None);
        assert_eq!(param_be32(&[1, 2, 3], 0), None);
        assert_eq!(param_be64(&[0; 8], usize::MAX - 2), None);
    }

    #[test]
    fn data_in_truncation() {
        let mut v = vec![1u8; 100];
        assert_eq!(finish_data_in(&mut v, 40, 30), 40);
        assert_eq!(v.len(), 30);
        let mut v = vec![1u8; 10];
        assert_eq!(finish_data_in(&mut v, 40, 30), 10);
        assert_eq!(v.len(), 10);
    }
}
