//! What one initiator sees: LUN numbers mapped to logical units, REPORT LUNS, and the answers
//! for LUNs with no logical unit behind them.

use crate::cdb::*;
use crate::inquiry::standard_inquiry_no_lu;
use crate::lu::{put_sense, LogicalUnit};
use crate::sense::Sense;
use crate::{Command, Completion, Nexus};
use std::sync::Arc;

/// Flat space addressing reaches LUN 16383 (SAM-5 4.7.7).
pub const LUN_MAX: u64 = 0x3FFF;

pub struct LunEntry {
    pub lun: u64,
    pub lu: Arc<LogicalUnit>,
    /// Writes through this mapping get DATA PROTECT even if the LU is writable.
    pub read_only: bool,
}

pub struct LunMap {
    /// Sorted by LUN.
    entries: Vec<LunEntry>,
}

impl LunMap {
    pub fn new(entries: Vec<(u64, Arc<LogicalUnit>, bool)>) -> Result<Self, String> {
        let mut entries: Vec<LunEntry> = entries
            .into_iter()
            .map(|(lun, lu, read_only)| LunEntry { lun, lu, read_only })
            .collect();
        entries.sort_by_key(|e| e.lun);
        for pair in entries.windows(2) {
            if pair[0].lun == pair[1].lun {
                return Err(format!("LUN {} mapped twice", pair[0].lun));
            }
        }
        if let Some(e) = entries.iter().find(|e| e.lun > LUN_MAX) {
            return Err(format!("LUN {}: at most {LUN_MAX}", e.lun));
        }
        Ok(LunMap { entries })
    }

    pub fn get(&self, lun: u64) -> Option<&LunEntry> {
        self.entries
            .binary_search_by_key(&lun, |e| e.lun)
            .ok()
            .map(|i| &self.entries[i])
    }

    /// Takes the in-flight guard of the LU behind `lun` for a command handed to another
    /// thread: `None` when no LU is there; `Some(Err(lu))` while a reset drains it (the
    /// command must wait with [`crate::inflight::InFlight::begin_blocking`] where waiting is
    /// allowed).
    pub fn begin_owned(
        &self,
        nexus: &Nexus,
        lun: u64,
    ) -> Option<Result<crate::inflight::OwnedIoGuard, Arc<crate::inflight::InFlight>>> {
        let in_flight = self.get(lun)?.lu.in_flight();
        Some(
            in_flight
                .try_begin_owned(nexus.id)
                .ok_or_else(|| Arc::clone(in_flight)),
        )
    }

    pub fn entries(&self) -> &[LunEntry] {
        &self.entries
    }

    pub fn lun_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.iter().map(|e| e.lun)
    }

    /// Runs one command addressed to `lun` (already decoded with [`lun_from_wire`]); may wait
    /// for the device. The caller holds the LU's in-flight guard for it
    /// ([`LunMap::begin_owned`]) from the moment it took the command over.
    pub fn execute(
        &self,
        nexus: &Nexus,
        lun: u64,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Completion {
        crate::lu::waited(self.execute_io(nexus, lun, cmd, data_in, None))
    }

    /// Runs one command without waiting for the device, as a network worker must: a read lends
    /// a page-cached file range or the store's memory into `lending` where the store allows
    /// (zero-copy; `data_in` stays empty), else copies cached data into `data_in`. Returns
    /// `None`, having done nothing, when the read's data is not cached: run it with
    /// [`LunMap::execute`] where waiting is fine.
    pub fn try_execute(
        &self,
        nexus: &Nexus,
        lun: u64,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
        mut lending: crate::Lending<'_>,
    ) -> Option<Completion> {
        self.execute_io(nexus, lun, cmd, data_in, Some(&mut lending))
    }

    fn execute_io(
        &self,
        nexus: &Nexus,
        lun: u64,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
        io: Option<&mut crate::Lending<'_>>,
    ) -> Option<Completion> {
        let cdb = Cdb(cmd.cdb);
        let opcode = if cmd.cdb.is_empty() {
            None
        } else {
            Some(cdb.u8(0))
        };
        // REPORT LUNS answers for the whole map, whichever LUN it is sent to, and neither
        // reports nor clears unit attentions.
        if opcode == Some(REPORT_LUNS) {
            data_in.clear();
            let result = if cmd.cdb.len() < 12 {
                Err(Sense::invalid_field_in_cdb(0, None))
            } else {
                check_reserved(cdb, 11, 0xFA)
                    .and_then(|()| report_luns(cdb, cmd.data_in_limit, self.lun_ids(), data_in))
            };
            return Some(match result {
                Ok(transfer_len) => Completion::good(transfer_len),
                Err(sense) => {
                    data_in.clear();
                    Completion::check_condition(sense)
                }
            });
        }
        if let Some(entry) = self.get(lun) {
            // A network worker's command holds its LU for as long as it runs here; while a
            // reset drains the LU it is declined (nothing done) and waits on an I/O thread.
            let _guard = match io {
                Some(_) => Some(entry.lu.in_flight().try_begin(nexus.id)?),
                None => None,
            };
            return entry
                .lu
                .execute_io(nexus, cmd, data_in, io, entry.read_only, Some(self));
        }
        Some(no_lu(opcode, cdb, cmd, data_in))
    }
}

/// The answer at a LUN with no logical unit (SPC-4 6.6.2, 6.39): a standard INQUIRY says so
/// (peripheral qualifier 3), REQUEST SENSE returns LOGICAL UNIT NOT SUPPORTED, anything else
/// fails with it.
fn no_lu(opcode: Option<u8>, cdb: Cdb<'_>, cmd: &Command<'_>, data_in: &mut Vec<u8>) -> Completion {
    data_in.clear();
    match opcode {
        Some(INQUIRY) if cdb.u8(1) & 0x01 == 0 && cdb.u8(2) == 0 => {
            standard_inquiry_no_lu(data_in);
            Completion::good(finish_data_in(
                data_in,
                u32::from(cdb.be16(3)),
                cmd.data_in_limit,
            ))
        }
        Some(REQUEST_SENSE) => {
            let descriptor_format = cdb.u8(1) & 0x01 != 0;
            put_sense(
                data_in,
                Sense {
                    descriptor_format,
                    ..Sense::lu_not_supported()
                },
            );
            Completion::good(finish_data_in(
                data_in,
                u32::from(cdb.u8(4)),
                cmd.data_in_limit,
            ))
        }
        _ => Completion::check_condition(Sense::lu_not_supported()),
    }
}

/// REPORT LUNS parameter data (SPC-4 6.33) for `luns` (ascending).
pub(crate) fn report_luns(
    cdb: Cdb<'_>,
    data_in_limit: u32,
    luns: impl Iterator<Item = u64>,
    out: &mut Vec<u8>,
) -> Result<u32, Sense> {
    let all = match cdb.u8(2) {
        0x00 | 0x02 | 0x11 => true,
        // Well-known and administrative logical units: there are none.
        0x01 | 0x10 | 0x12 => false,
        _ => return Err(Sense::invalid_field_in_cdb(2, None)),
    };
    out.extend_from_slice(&[0; 8]);
    if all {
        for lun in luns {
            out.extend_from_slice(&lun_to_wire(lun));
        }
    }
    let list_len = u32::try_from(out.len() - 8).unwrap_or(u32::MAX);
    out[..4].copy_from_slice(&list_len.to_be_bytes());
    Ok(finish_data_in(out, cdb.be32(6), data_in_limit))
}

/// Decodes an 8-byte LUN. Peripheral (below 256) and flat (below 16384) single-level addresses give the
/// LUN number; any other address comes back as its raw big-endian value, which is above
/// the highest LUN a map holds (16383) and so never matches a mapping.
pub fn lun_from_wire(raw: [u8; 8]) -> u64 {
    let single_level = raw[2..].iter().all(|&b| b == 0);
    match raw[0] >> 6 {
        0b00 if single_level && raw[0] == 0 => u64::from(raw[1]),
        0b01 if single_level => (u64::from(raw[0] & 0x3F) << 8) | u64::from(raw[1]),
        _ => u64::from_be_bytes(raw),
    }
}

/// Encodes a LUN: peripheral addressing below 256, flat space below 16384, and the raw value
/// (the inverse of [`lun_from_wire`]'s fallback) otherwise.
pub fn lun_to_wire(lun: u64) -> [u8; 8] {
    let mut raw = [0u8; 8];
    if lun < 256 {
        raw[1] = lun as u8;
    } else if lun <= LUN_MAX {
        raw[0] = 0x40 | (lun >> 8) as u8;
        raw[1] = lun as u8;
    } else {
        raw = lun.to_be_bytes();
    }
    raw
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lun_encoding_round_trips() {
        for lun in [0, 1, 255, 256, 1000, LUN_MAX] {
            assert_eq!(lun_from_wire(lun_to_wire(lun)), lun);
        }
        assert_eq!(lun_to_wire(5), [0, 5, 0, 0, 0, 0, 0, 0]);
        assert_eq!(lun_to_wire(256), [0x41, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(lun_from_wire([0x40, 7, 0, 0, 0, 0, 0, 0]), 7);
        // A bus number, a second level or another method never decodes into range.
        assert!(lun_from_wire([0x01, 0, 0, 0, 0, 0, 0, 0]) > LUN_MAX);
        assert!(lun_from_wire([0, 1, 0, 2, 0, 0, 0, 0]) > LUN_MAX);
        assert!(lun_from_wire([0xC0, 1, 0, 0, 0, 0, 0, 0]) > LUN_MAX);
        let raw = [0x80, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(lun_to_wire(lun_from_wire(raw)), raw);
    }
}
