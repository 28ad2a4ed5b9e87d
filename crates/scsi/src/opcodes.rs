//! The table of implemented commands. The dispatcher, the CDB length check and REPORT SUPPORTED
//! OPERATION CODES all read this one table, so the report cannot drift from what `execute` does.

use crate::cdb::*;
use crate::sense::Sense;

pub struct OpInfo {
    pub opcode: u8,
    pub service_action: Option<u16>,
    /// CDB usage data (SPC-4 6.35.3): which bits of each CDB byte the device server evaluates.
    /// Its length is the CDB length.
    pub usage: &'static [u8],
    /// Only on thin-provisioned LUs.
    pub thin_only: bool,
}

const fn op(opcode: u8, usage: &'static [u8]) -> OpInfo {
    OpInfo {
        opcode,
        service_action: None,
        usage,
        thin_only: false,
    }
}
const fn sa(opcode: u8, service_action: u16, usage: &'static [u8]) -> OpInfo {
    OpInfo {
        opcode,
        service_action: Some(service_action),
        usage,
        thin_only: false,
    }
}

const F: u8 = 0xFF;

pub static OPS: &[OpInfo] = &[
    op(TEST_UNIT_READY, &[TEST_UNIT_READY, 0, 0, 0, 0, 0]),
    op(REQUEST_SENSE, &[REQUEST_SENSE, 0x01, 0, 0, F, 0]),
    op(READ_6, &[READ_6, 0x1F, F, F, F, 0]),
    op(WRITE_6, &[WRITE_6, 0x1F, F, F, F, 0]),
    op(INQUIRY, &[INQUIRY, 0x01, F, F, F, 0]),
    op(RESERVE_6, &[RESERVE_6, 0, 0, 0, 0, 0]),
    op(RELEASE_6, &[RELEASE_6, 0, 0, 0, 0, 0]),
    op(MODE_SELECT_6, &[MODE_SELECT_6, 0x11, 0, 0, F, 0]),
    op(MODE_SENSE_6, &[MODE_SENSE_6, 0x08, F, F, F, 0]),
    op(START_STOP_UNIT, &[START_STOP_UNIT, 0x01, 0, 0x0F, 0xF7, 0]),
    op(
        PREVENT_ALLOW_MEDIUM_REMOVAL,
        &[PREVENT_ALLOW_MEDIUM_REMOVAL, 0, 0, 0, 0x03, 0],
    ),
    op(
        READ_CAPACITY_10,
        &[READ_CAPACITY_10, 0, F, F, F, F, 0, 0, 0x01, 0],
    ),
    op(READ_10, &[READ_10, 0x1A, F, F, F, F, 0, F, F, 0]),
    op(WRITE_10, &[WRITE_10, 0x1A, F, F, F, F, 0, F, F, 0]),
    op(
        WRITE_AND_VERIFY_10,
        &[WRITE_AND_VERIFY_10, 0x12, F, F, F, F, 0, F, F, 0],
    ),
    op(VERIFY_10, &[VERIFY_10, 0x16, F, F, F, F, 0, F, F, 0]),
    op(PRE_FETCH_10, &[PRE_FETCH_10, 0x02, F, F, F, F, 0, F, F, 0]),
    op(
        SYNCHRONIZE_CACHE_10,
        &[SYNCHRONIZE_CACHE_10, 0x02, F, F, F, F, 0, F, F, 0],
    ),
    op(
        READ_DEFECT_DATA_10,
        &[READ_DEFECT_DATA_10, 0, 0x1F, 0, 0, 0, 0, F, F, 0],
    ),
    op(
        WRITE_SAME_10,
        &[WRITE_SAME_10, 0x08, F, F, F, F, 0, F, F, 0],
    ),
    OpInfo {
        opcode: UNMAP,
        service_action: None,
        usage: &[UNMAP, 0, 0, 0, 0, 0, 0, F, F, 0],
        thin_only: true,
    },
    op(
        MODE_SELECT_10,
        &[MODE_SELECT_10, 0x11, 0, 0, 0, 0, 0, F, F, 0],
    ),
    op(
        MODE_SENSE_10,
        &[MODE_SENSE_10, 0x18, F, F, 0, 0, 0, F, F, 0],
    ),
    op(RESERVE_10, &[RESERVE_10, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
    op(RELEASE_10, &[RELEASE_10, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
    sa(
        PERSISTENT_RESERVE_IN,
        0,
        &[PERSISTENT_RESERVE_IN, 0, 0, 0, 0, 0, 0, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_IN,
        1,
        &[PERSISTENT_RESERVE_IN, 1, 0, 0, 0, 0, 0, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_IN,
        2,
        &[PERSISTENT_RESERVE_IN, 2, 0, 0, 0, 0, 0, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_IN,
        3,
        &[PERSISTENT_RESERVE_IN, 3, 0, 0, 0, 0, 0, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        0,
        &[PERSISTENT_RESERVE_OUT, 0, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        1,
        &[PERSISTENT_RESERVE_OUT, 1, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        2,
        &[PERSISTENT_RESERVE_OUT, 2, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        3,
        &[PERSISTENT_RESERVE_OUT, 3, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        4,
        &[PERSISTENT_RESERVE_OUT, 4, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        5,
        &[PERSISTENT_RESERVE_OUT, 5, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        PERSISTENT_RESERVE_OUT,
        6,
        &[PERSISTENT_RESERVE_OUT, 6, F, 0, 0, F, F, F, F, 0],
    ),
    sa(
        EXTENDED_COPY,
        crate::xcopy::SA_EXTENDED_COPY_LID1,
        &[EXTENDED_COPY, 0, 0, 0, 0, 0, 0, 0, 0, 0, F, F, F, F, 0, 0],
    ),
    sa(
        RECEIVE_COPY_RESULTS,
        crate::xcopy::SA_COPY_STATUS,
        &[
            RECEIVE_COPY_RESULTS,
            0,
            F,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    sa(
        RECEIVE_COPY_RESULTS,
        crate::xcopy::SA_OPERATING_PARAMETERS,
        &[
            RECEIVE_COPY_RESULTS,
            3,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    op(
        READ_16,
        &[READ_16, 0x1A, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(
        COMPARE_AND_WRITE,
        &[
            COMPARE_AND_WRITE,
            0x18,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
            0,
            F,
            0,
            0,
        ],
    ),
    op(
        WRITE_16,
        &[WRITE_16, 0x1A, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(
        ORWRITE_16,
        &[ORWRITE_16, 0x1A, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(
        WRITE_ATOMIC_16,
        &[
            WRITE_ATOMIC_16,
            0x18,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    op(
        WRITE_AND_VERIFY_16,
        &[
            WRITE_AND_VERIFY_16,
            0x12,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    op(
        VERIFY_16,
        &[VERIFY_16, 0x16, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(
        PRE_FETCH_16,
        &[PRE_FETCH_16, 0x02, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(
        SYNCHRONIZE_CACHE_16,
        &[
            SYNCHRONIZE_CACHE_16,
            0x02,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    op(
        WRITE_SAME_16,
        &[
            WRITE_SAME_16,
            0x09,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    sa(
        SERVICE_ACTION_IN_16,
        SA_READ_CAPACITY_16,
        &[
            SERVICE_ACTION_IN_16,
            0x10,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    sa(
        SERVICE_ACTION_IN_16,
        SA_GET_LBA_STATUS,
        &[
            SERVICE_ACTION_IN_16,
            0x12,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            F,
            0,
            0,
        ],
    ),
    op(REPORT_LUNS, &[REPORT_LUNS, 0, F, 0, 0, 0, F, F, F, F, 0, 0]),
    sa(
        MAINTENANCE_IN,
        SA_REPORT_TARGET_PORT_GROUPS,
        &[MAINTENANCE_IN, 0xEA, 0, 0, 0, 0, F, F, F, F, 0, 0],
    ),
    sa(
        MAINTENANCE_OUT,
        SA_SET_TARGET_PORT_GROUPS,
        &[MAINTENANCE_OUT, 0x0A, 0, 0, 0, 0, F, F, F, F, 0, 0],
    ),
    sa(
        MAINTENANCE_IN,
        SA_REPORT_SUPPORTED_OPCODES,
        &[MAINTENANCE_IN, 0x0C, 0x87, F, F, F, F, F, F, F, 0, 0],
    ),
    op(READ_12, &[READ_12, 0x1A, F, F, F, F, F, F, F, F, 0, 0]),
    op(WRITE_12, &[WRITE_12, 0x1A, F, F, F, F, F, F, F, F, 0, 0]),
    op(
        WRITE_AND_VERIFY_12,
        &[WRITE_AND_VERIFY_12, 0x12, F, F, F, F, F, F, F, F, 0, 0],
    ),
    op(VERIFY_12, &[VERIFY_12, 0x16, F, F, F, F, F, F, F, F, 0, 0]),
    op(
        READ_DEFECT_DATA_12,
        &[READ_DEFECT_DATA_12, 0x1F, 0, 0, 0, 0, F, F, F, F, 0, 0],
    ),
];

/// Which optional command sets an LU offers.
#[derive(Debug, Clone, Copy)]
pub struct Offered {
    /// Thin provisioning (UNMAP).
    pub thin: bool,
    /// SPC-2 RESERVE / RELEASE (6) and (10).
    pub spc2_reservations: bool,
    /// SET TARGET PORT GROUPS (explicit ALUA, an LU with an owner).
    pub explicit_alua: bool,
}

impl Offered {
    fn shows(&self, o: &OpInfo) -> bool {
        (self.thin || !o.thin_only)
            && (self.explicit_alua || o.opcode != MAINTENANCE_OUT)
            && (self.spc2_reservations
                || !matches!(o.opcode, RESERVE_6 | RELEASE_6 | RESERVE_10 | RELEASE_10))
    }
}

/// The entries of `opcode` in [`OPS`], in table order: looked up per command, so indexed once
/// instead of scanning the table (a whole-table scan was 4-5 % of a 4 KiB read's CPU).
fn of_opcode(opcode: u8) -> &'static [&'static OpInfo] {
    static INDEX: std::sync::OnceLock<Vec<Vec<&'static OpInfo>>> = std::sync::OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let mut index = vec![Vec::new(); 256];
        for o in OPS {
            index[usize::from(o.opcode)].push(o);
        }
        index
    });
    &index[usize::from(opcode)]
}

/// Whether `opcode` uses service actions at all (SERVACTV).
pub fn has_service_actions(opcode: u8, offered: Offered) -> bool {
    of_opcode(opcode)
        .iter()
        .any(|o| o.service_action.is_some() && offered.shows(o))
}

/// Finds the implemented command for a CDB, or the sense to answer with.
pub fn lookup(cdb: Cdb<'_>, offered: Offered) -> Result<&'static OpInfo, Sense> {
    let opcode = cdb.u8(0);
    let sa = if has_service_actions(opcode, offered) {
        Some(cdb.service_action())
    } else {
        None
    };
    let entries = of_opcode(opcode);
    let found = entries
        .iter()
        .copied()
        .find(|o| o.service_action == sa && offered.shows(o));
    match found {
        Some(o) => Ok(o),
        // A known opcode with an unknown service action is an invalid field, not an invalid
        // opcode (an opcode none of whose service actions this LU offers is unknown).
        None if sa.is_some() && entries.iter().any(|o| offered.shows(o)) => {
            Err(Sense::invalid_field_in_cdb(1, Some(4)))
        }
        None => Err(Sense::invalid_opcode()),
    }
}

/// Nominal and recommended command timeouts reported with RCTD, in seconds.
const TIMEOUT_NOMINAL_S: u32 = 1;
const TIMEOUT_RECOMMENDED_S: u32 = 30;

fn put_timeouts(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x00, 0x0A, 0, 0]);
    out.extend_from_slice(&TIMEOUT_NOMINAL_S.to_be_bytes());
    out.extend_from_slice(&TIMEOUT_RECOMMENDED_S.to_be_bytes());
}

/// REPORT SUPPORTED OPERATION CODES (SPC-4 6.35) parameter data, before allocation truncation.
pub fn report_supported(cdb: Cdb<'_>, offered: Offered, out: &mut Vec<u8>) -> Result<(), Sense> {
    let rctd = cdb.u8(2) & 0x80 != 0;
    let options = cdb.u8(2) & 0x07;
    let req_opcode = cdb.u8(3);
    let req_sa = cdb.be16(4);
    let visible = |o: &&OpInfo| offered.shows(o);
    match options {
        0 => {
            out.extend_from_slice(&[0; 4]);
            for o in OPS.iter().filter(visible) {
                out.push(o.opcode);
                out.push(0);
                out.extend_from_slice(&o.service_action.unwrap_or(0).to_be_bytes());
                out.push(0);
                out.push(if rctd { 0x02 } else { 0 } | u8::from(o.service_action.is_some()));
                out.extend_from_slice(&(o.usage.len() as u16).to_be_bytes());
                if rctd {
                    put_timeouts(out);
                }
            }
            let len = (out.len() - 4) as u32;
            out[..4].copy_from_slice(&len.to_be_bytes());
            Ok(())
        }
        1..=3 => {
            let servactv = has_service_actions(req_opcode, offered);
            let want_sa = match options {
                1 if servactv => return Err(Sense::invalid_field_in_cdb(3, None)),
                1 => None,
                2 if !servactv => return Err(Sense::invalid_field_in_cdb(3, None)),
                2 => Some(req_sa),
                _ => servactv.then_some(req_sa),
            };
            let found = OPS
                .iter()
                .filter(visible)
                .find(|o| o.opcode == req_opcode && o.service_action == want_sa);
            match found {
                Some(o) => {
                    out.push(0);
                    out.push(if rctd { 0x80 } else { 0 } | 0x03); // supported per standard
                    out.extend_from_slice(&(o.usage.len() as u16).to_be_bytes());
                    out.extend_from_slice(o.usage);
                    if rctd {
                        put_timeouts(out);
                    }
                }
                None => out.extend_from_slice(&[0, 0x01, 0, 0]), // not supported
            }
            Ok(())
        }
        _ => Err(Sense::invalid_field_in_cdb(2, Some(2))),
    }
}
