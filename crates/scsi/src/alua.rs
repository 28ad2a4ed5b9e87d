//! Asymmetric logical unit access (SPC-4 5.15), implicit only: the INQUIRY TPGS field says so,
//! VPD page 83h names the port's target port group, and REPORT TARGET PORT GROUPS lists every
//! group of the target with its state (set by configuration: one group per iSCSI portal group).
//! There is no SET TARGET PORT GROUPS: initiators cannot change states, and the states offered
//! (active/optimized, active/non-optimized) never refuse a command, so no command checks them.

use crate::cdb::*;
use crate::sense::Sense;
use crate::{Command, Nexus};

/// Supported-states byte of every descriptor: AO_SUP and AN_SUP, the only states used.
const SUPPORTED_STATES: u8 = 0x01 | 0x02;
/// PARAMETER DATA FORMAT values (CDB byte 1, bits 7..5).
const FORMAT_LENGTH_ONLY: u8 = 0;
const FORMAT_EXTENDED: u8 = 1;
/// FORMAT TYPE of the extended header (byte 4, bits 6..4).
const EXTENDED_HEADER: u8 = 0x10;

/// REPORT TARGET PORT GROUPS (MAINTENANCE IN, service action 0Ah).
pub(crate) fn report_target_port_groups(
    nexus: &Nexus,
    cmd: &Command<'_>,
    data_in: &mut Vec<u8>,
) -> Result<u32, Sense> {
    let cdb = Cdb(cmd.cdb);
    for byte in [2, 3, 4, 5, 10] {
        check_reserved(cdb, byte, 0)?;
    }
    let extended = match cdb.u8(1) >> 5 {
        FORMAT_LENGTH_ONLY => false,
        FORMAT_EXTENDED => true,
        _ => return Err(Sense::invalid_field_in_cdb(1, Some(7))),
    };
    data_in.extend_from_slice(&[0; 4]); // RETURN DATA LENGTH, filled in below
    if extended {
        // No implicit transition time: states never change while the daemon runs.
        data_in.extend_from_slice(&[EXTENDED_HEADER, 0, 0, 0]);
    }
    for group in nexus.target_port.groups.iter() {
        // A descriptor counts at most 255 ports (one byte); a group here has one per target.
        let ports = &group.ports[..group.ports.len().min(usize::from(u8::MAX))];
        data_in.push(group.state.code()); // PREF = 0
        data_in.push(SUPPORTED_STATES);
        data_in.extend_from_slice(&group.id.to_be_bytes());
        data_in.push(0); // reserved
        data_in.push(0); // STATUS CODE: no status available
        data_in.push(0); // vendor specific
        data_in.push(ports.len() as u8);
        for port in ports {
            data_in.extend_from_slice(&[0, 0]);
            data_in.extend_from_slice(&port.to_be_bytes());
        }
    }
    // Everything after the length field, extended header included (Linux's ALUA handler reads
    // it that way too).
    let len = u32::try_from(data_in.len() - 4).unwrap_or(u32::MAX);
    data_in[..4].copy_from_slice(&len.to_be_bytes());
    Ok(finish_data_in(data_in, cdb.be32(6), cmd.data_in_limit))
}
