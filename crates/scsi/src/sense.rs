//! Sense data (SPC-4 4.5): one value type, encoded in fixed (70h) or descriptor (72h) format
//! depending on the D_SENSE bit of the control mode page at the time of the error.

pub const NO_SENSE: u8 = 0x0;
pub const NOT_READY: u8 = 0x2;
pub const MEDIUM_ERROR: u8 = 0x3;
pub const HARDWARE_ERROR: u8 = 0x4;
pub const ILLEGAL_REQUEST: u8 = 0x5;
pub const UNIT_ATTENTION: u8 = 0x6;
pub const DATA_PROTECT: u8 = 0x7;
pub const ABORTED_COMMAND: u8 = 0xB;
pub const MISCOMPARE: u8 = 0xE;

/// Largest sense buffer SPC allows (additional length is one byte).
pub const SENSE_BYTES_MAX: usize = 252;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// INFORMATION field (e.g. the first miscomparing byte offset).
    pub info: Option<u64>,
    /// Sense-key-specific bytes, SKSV bit included in byte 0.
    pub sense_key_specific: Option<[u8; 3]>,
    pub descriptor_format: bool,
}

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Sense {
        Sense {
            key,
            asc,
            ascq,
            info: None,
            sense_key_specific: None,
            descriptor_format: false,
        }
    }

    /// INVALID FIELD IN CDB with a field pointer at `byte` (and `bit`, if known).
    pub fn invalid_field_in_cdb(byte: u16, bit: Option<u8>) -> Sense {
        Sense {
            sense_key_specific: Some(field_pointer(true, byte, bit)),
            ..Sense::new(ILLEGAL_REQUEST, 0x24, 0x00)
        }
    }

    /// INVALID FIELD IN PARAMETER LIST with a field pointer into the Data-Out buffer.
    pub fn invalid_field_in_parameter_list(byte: u16, bit: Option<u8>) -> Sense {
        Sense {
            sense_key_specific: Some(field_pointer(false, byte, bit)),
            ..Sense::new(ILLEGAL_REQUEST, 0x26, 0x00)
        }
    }

    pub const fn invalid_opcode() -> Sense {
        Sense::new(ILLEGAL_REQUEST, 0x20, 0x00)
    }
    pub const fn lba_out_of_range() -> Sense {
        Sense::new(ILLEGAL_REQUEST, 0x21, 0x00)
    }
    pub const fn parameter_list_length_error() -> Sense {
        Sense::new(ILLEGAL_REQUEST, 0x1A, 0x00)
    }
    pub const fn lu_not_supported() -> Sense {
        Sense::new(ILLEGAL_REQUEST, 0x25, 0x00)
    }
    pub const fn saving_parameters_not_supported() -> Sense {
        Sense::new(ILLEGAL_REQUEST, 0x39, 0x00)
    }
    pub const fn write_protected() -> Sense {
        Sense::new(DATA_PROTECT, 0x27, 0x00)
    }
    pub fn miscompare(offset: u64) -> Sense {
        Sense {
            info: Some(offset),
            ..Sense::new(MISCOMPARE, 0x1D, 0x00)
        }
    }
    pub const fn medium_error_unrecovered_read() -> Sense {
        Sense::new(MEDIUM_ERROR, 0x11, 0x00)
    }
    pub const fn medium_error_write() -> Sense {
        Sense::new(MEDIUM_ERROR, 0x0C, 0x00)
    }
    /// SPACE ALLOCATION FAILED WRITE PROTECT (SBC-3 4.7.3.7): a thin LU's backing storage is
    /// full. Initiators treat it as out of space, not as a failing disk (ESXi pauses the VMs
    /// on the datastore instead of failing their I/O).
    pub const fn space_allocation_failed() -> Sense {
        Sense::new(DATA_PROTECT, 0x27, 0x07)
    }
    pub const fn internal_target_failure() -> Sense {
        Sense::new(HARDWARE_ERROR, 0x44, 0x00)
    }
    /// The operator took the LU offline: LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED
    /// (04h/03h), as an operator brings it back. OFFLINE (04h/12h) names the state better,
    /// but Linux's sd, revalidating a disk that answers any 04h but a few (03h, 0Bh, 0Ch, 1Bh,
    /// 24h, 25h), sends START STOP UNIT and waits 100 s for it to spin up, holding the
    /// disk's rescan meanwhile (seen in scripts/faulty-disk.sh's guest).
    pub const fn not_ready_offline() -> Sense {
        Sense::not_ready_manual_intervention()
    }
    /// LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED: the LU is fenced until the
    /// operator acts (its saved reservations could not be loaded).
    pub const fn not_ready_manual_intervention() -> Sense {
        Sense::new(NOT_READY, 0x04, 0x03)
    }
    /// LOGICAL UNIT NOT READY, OPERATION IN PROGRESS: another LU the command touches is
    /// being reset (initiators retry after a delay).
    pub const fn reset_in_progress() -> Sense {
        Sense::new(NOT_READY, 0x04, 0x07)
    }
    /// LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION: not now, retry (the
    /// path's backend is unreachable or the LU is moving between target port groups).
    pub const fn not_ready_transition() -> Sense {
        Sense::new(NOT_READY, 0x04, 0x0A)
    }
    pub const fn unit_attention(asc: u8, ascq: u8) -> Sense {
        Sense::new(UNIT_ATTENTION, asc, ascq)
    }

    /// Writes the sense data into `out` and returns its length (18 bytes fixed; 8 + descriptors).
    pub fn encode(&self, out: &mut [u8; SENSE_BYTES_MAX]) -> usize {
        if self.descriptor_format {
            self.encode_descriptor(out)
        } else {
            self.encode_fixed(out)
        }
    }

    /// Reads sense data another device server sent (fixed or descriptor format, current or
    /// deferred): key, ASC/ASCQ, the INFORMATION field when VALID and the sense-key-specific
    /// bytes when SKSV is set. `None` for an unknown response code or data too short for its
    /// header; fields past the end of short data are left out.
    pub fn decode(raw: &[u8]) -> Option<Sense> {
        let code = raw.first()? & 0x7F;
        match code {
            0x70 | 0x71 => {
                let mut sense = Sense::new(
                    raw.get(2)? & 0x0F,
                    raw.get(12).copied().unwrap_or(0),
                    raw.get(13).copied().unwrap_or(0),
                );
                if raw[0] & 0x80 != 0 {
                    let info = raw.get(3..7)?;
                    sense.info = Some(u64::from(u32::from_be_bytes(info.try_into().ok()?)));
                }
                if let Some(sks) = raw.get(15..18).filter(|b| b[0] & 0x80 != 0) {
                    sense.sense_key_specific = sks.try_into().ok();
                }
                Some(sense)
            }
            0x72 | 0x73 => {
                let mut sense = Sense::new(raw.get(1)? & 0x0F, *raw.get(2)?, *raw.get(3)?);
                sense.descriptor_format = true;
                let additional = usize::from(raw.get(7).copied().unwrap_or(0));
                let end = raw.len().min(8 + additional);
                let mut at = 8;
                while at + 2 <= end {
                    let (kind, len) = (raw[at], usize::from(raw[at + 1]));
                    let Some(d) = raw.get(at..at + 2 + len).filter(|_| at + 2 + len <= end) else {
                        break;
                    };
                    match kind {
                        0x00 if d.len() >= 12 && d[2] & 0x80 != 0 => {
                            sense.info = Some(u64::from_be_bytes(d[4..12].try_into().ok()?));
                        }
                        0x02 if d.len() >= 7 && d[4] & 0x80 != 0 => {
                            sense.sense_key_specific = d[4..7].try_into().ok();
                        }
                        _ => {}
                    }
                    at += 2 + len;
                }
                Some(sense)
            }
            _ => None,
        }
    }

    fn encode_fixed(&self, out: &mut [u8; SENSE_BYTES_MAX]) -> usize {
        const LEN: usize = 18;
        out[..LEN].fill(0);
        out[0] = 0x70;
        out[2] = self.key & 0x0F;
        if let Some(info) = self.info {
            // The fixed INFORMATION field holds 32 bits; VALID only when the value fits.
            if let Ok(v) = u32::try_from(info) {
                out[0] |= 0x80;
                out[3..7].copy_from_slice(&v.to_be_bytes());
            }
        }
        out[7] = (LEN - 8) as u8;
        out[12] = self.asc;
        out[13] = self.ascq;
        if let Some(sks) = self.sense_key_specific {
            out[15..18].copy_from_slice(&sks);
        }
        LEN
    }

    fn encode_descriptor(&self, out: &mut [u8; SENSE_BYTES_MAX]) -> usize {
        out[..8].fill(0);
        out[0] = 0x72;
        out[1] = self.key & 0x0F;
        out[2] = self.asc;
        out[3] = self.ascq;
        let mut len = 8;
        if let Some(info) = self.info {
            let d = &mut out[len..len + 12];
            d.fill(0);
            d[0] = 0x00; // information descriptor
            d[1] = 0x0A;
            d[2] = 0x80; // VALID
            d[4..12].copy_from_slice(&info.to_be_bytes());
            len += 12;
        }
        if let Some(sks) = self.sense_key_specific {
            let d = &mut out[len..len + 8];
            d.fill(0);
            d[0] = 0x02; // sense key specific descriptor
            d[1] = 0x06;
            d[4..7].copy_from_slice(&sks);
            len += 8;
        }
        out[7] = (len - 8) as u8;
        len
    }
}

/// SPC-4 4.5.2.4.2 field pointer: SKSV, C/D, BPV + bit pointer, 16-bit byte pointer.
fn field_pointer(in_cdb: bool, byte: u16, bit: Option<u8>) -> [u8; 3] {
    let mut b0 = 0x80;
    if in_cdb {
        b0 |= 0x40;
    }
    if let Some(bit) = bit {
        b0 |= 0x08 | (bit & 0x07);
    }
    let [hi, lo] = byte.to_be_bytes();
    [b0, hi, lo]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_invalid_field_in_cdb_is_byte_exact() {
        let mut out = [0xFFu8; SENSE_BYTES_MAX];
        let n = Sense::invalid_field_in_cdb(2, Some(5)).encode(&mut out);
        assert_eq!(n, 18);
        assert_eq!(
            &out[..18],
            &[0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0, 0, 0xCD, 0x00, 0x02]
        );
    }

    #[test]
    fn decode_reads_back_what_encode_wrote_in_both_formats() {
        let mut cases = vec![
            Sense::invalid_field_in_cdb(2, Some(5)),
            Sense::miscompare(0x1234),
            Sense::unit_attention(0x29, 0x03),
            Sense::not_ready_transition(),
            Sense::invalid_field_in_parameter_list(6, None),
        ];
        for mut s in cases.clone() {
            s.descriptor_format = true;
            cases.push(s);
        }
        let mut wide = Sense::miscompare(0x1_0000_0000);
        wide.descriptor_format = true;
        cases.push(wide);
        for s in cases {
            let mut out = [0u8; SENSE_BYTES_MAX];
            let n = s.encode(&mut out);
            assert_eq!(Sense::decode(&out[..n]), Some(s), "{s:?}");
        }
        // An INFORMATION value too wide for the fixed format is sent without VALID.
        let mut out = [0u8; SENSE_BYTES_MAX];
        let n = Sense::miscompare(0x1_0000_0000).encode(&mut out);
        assert_eq!(Sense::decode(&out[..n]).and_then(|s| s.info), None);
    }

    #[test]
    fn decode_refuses_or_trims_malformed_sense() {
        assert_eq!(Sense::decode(&[]), None);
        assert_eq!(Sense::decode(&[0x00; 18]), None);
        assert_eq!(Sense::decode(&[0x70, 0]), None);
        assert_eq!(Sense::decode(&[0x72, 0x05, 0x24]), None);
        // VALID set but the INFORMATION bytes missing.
        assert_eq!(Sense::decode(&[0xF0, 0, 0x0E]), None);
        // Short fixed data: ASC/ASCQ default to 0.
        assert_eq!(Sense::decode(&[0x70, 0, 0x06]), Some(Sense::new(6, 0, 0)));
        // Descriptors running past the data, or past the ADDITIONAL LENGTH, are ignored.
        let mut d = vec![
            0x72, 0x0E, 0x1D, 0x00, 0, 0, 0, 40, 0x00, 0x0A, 0x80, 0, 0, 0,
        ];
        let s = Sense::decode(&d).expect("header is enough");
        assert_eq!((s.key, s.asc, s.info), (0x0E, 0x1D, None));
        d[7] = 2;
        d.extend_from_slice(&[0; 8]);
        assert_eq!(Sense::decode(&d).and_then(|s| s.info), None);
        for len in 0..40 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37 + 0x70) as u8).collect();
            let _ = Sense::decode(&junk);
        }
    }

    #[test]
    fn fixed_info_sets_valid_only_when_it_fits() {
        let mut out = [0u8; SENSE_BYTES_MAX];
        Sense::miscompare(0x1234).encode(&mut out);
        assert_eq!(&out[..8], &[0xF0, 0, 0x0E, 0, 0, 0x12, 0x34, 10]);
        assert_eq!((out[12], out[13]), (0x1D, 0x00));
        Sense::miscompare(1 << 40).encode(&mut out);
        assert_eq!(out[0], 0x70);
        assert_eq!(&out[3..7], &[0, 0, 0, 0]);
    }

    #[test]
    fn descriptor_format_is_byte_exact() {
        let mut out = [0u8; SENSE_BYTES_MAX];
        let s = Sense {
            descriptor_format: true,
            ..Sense::unit_attention(0x29, 0x00)
        };
        assert_eq!(s.encode(&mut out), 8);
        assert_eq!(&out[..8], &[0x72, 0x06, 0x29, 0x00, 0, 0, 0, 0]);

        let s = Sense {
            descriptor_format: true,
            info: Some(0x0102_0304_0506_0708),
            ..Sense::invalid_field_in_parameter_list(9, None)
        };
        assert_eq!(s.encode(&mut out), 28);
        assert_eq!(&out[..8], &[0x72, 0x05, 0x26, 0x00, 0, 0, 0, 20]);
        assert_eq!(&out[8..20], &[0, 10, 0x80, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&out[20..28], &[2, 6, 0, 0, 0x80, 0x00, 0x09, 0]);
    }
}

/// How a command stops short of GOOD inside the core, before it becomes a
/// [`crate::Completion`]: a CHECK CONDITION with its sense data, RESERVATION CONFLICT status,
/// or one of two outcomes that are not answers yet (the caller runs the command elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// CHECK CONDITION with this sense.
    Check(Sense),
    /// RESERVATION CONFLICT status (no sense data).
    Conflict,
    /// Running it here would wait for the device where the caller may not wait (a read not
    /// in the page cache, a write-back write the kernel would hold): nothing was done; run it
    /// where waiting is fine.
    WouldWait,
    /// It is for the LU's owner, through another gateway (I/O shipping): this LU's own checks
    /// passed; nothing was done here.
    Ship,
}

impl From<Sense> for Stop {
    fn from(sense: Sense) -> Stop {
        Stop::Check(sense)
    }
}
