//! Asymmetric logical unit access (SPC-4 5.15). VPD page 83h names the port's target port
//! group (one per iSCSI portal group) and REPORT TARGET PORT GROUPS lists every group of the
//! target with its state.
//!
//! Implicit ALUA (every LU by default): the states are set by configuration (active/optimized,
//! active/non-optimized, standby, unavailable), changed by the operator at once (no
//! transitioning phase); the inactive ones refuse what SPC-4 says they refuse ([`admit`]).
//!
//! An LU with an [`crate::Ownership`] (an RBD image several gateways export): the owner's
//! group is active/optimized, every other active/non-optimized (shipping to the owner) or
//! standby, transitioning while a takeover through it runs. Implicit unless the ownership is
//! explicit ([`crate::Ownership::explicit`]: TPGS = 11b), when SET TARGET PORT GROUPS through
//! a non-owner's port asks the ownership to take the LU over (it may refuse: 67h/0Ah).

use crate::cdb::*;
use crate::sense::Sense;
use crate::{Command, Nexus};

/// Supported-states byte of every descriptor under implicit ALUA: AO_SUP, AN_SUP, S_SUP and
/// U_SUP, the states the configuration can give a group.
const SUPPORTED_STATES: u8 = 0x01 | 0x02 | 0x04 | 0x08;
/// With explicit ALUA: AO_SUP, AN_SUP (a non-owner that ships to the owner), S_SUP and T_SUP
/// (a group while a takeover through it runs).
const SUPPORTED_STATES_EXPLICIT: u8 = 0x01 | 0x02 | 0x04 | 0x80;

/// ASYMMETRIC ACCESS STATE CHANGED (2Ah/06h).
pub(crate) const UA_ACCESS_STATE_CHANGED: (u8, u8) = (0x2A, 0x06);
/// LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY STATE (NOT READY, 04h/0Bh).
pub(crate) const STANDBY: Sense = Sense::new(crate::sense::NOT_READY, 0x04, 0x0B);
/// LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE (NOT READY, 04h/0Ch).
pub(crate) const UNAVAILABLE: Sense = Sense::new(crate::sense::NOT_READY, 0x04, 0x0C);
/// SET TARGET PORT GROUPS COMMAND FAILED (ABORTED COMMAND, 67h/0Ah).
const STPG_FAILED: Sense = Sense::new(crate::sense::ABORTED_COMMAND, 0x67, 0x0A);

/// Whether a standby port still takes the command (SPC-4 5.15.2.4.4): identification, sense,
/// mode pages, reservations, the target port group commands; and, as LIO does, READ CAPACITY,
/// so that an initiator probing a standby path learns the LU's size.
pub(crate) fn standby_allows(cdb: Cdb<'_>) -> bool {
    crate::facts::facts(cdb).in_standby
}

/// Whether a port in `state` answers the command whose facts are `f` (SPC-4 5.15.2.4,
/// 5.15.2.5), or the sense it gets instead.
pub(crate) fn admit(state: crate::AccessState, f: &crate::facts::Facts) -> Result<(), Sense> {
    use crate::AccessState::*;
    match state {
        ActiveOptimized | ActiveNonOptimized => Ok(()),
        Standby if f.in_standby => Ok(()),
        Standby => Err(STANDBY),
        Unavailable if f.in_unavailable => Ok(()),
        Unavailable => Err(UNAVAILABLE),
        Transitioning if f.in_transition || f.path_check => Ok(()),
        Transitioning => Err(Sense::not_ready_transition()),
    }
}

/// SET TARGET PORT GROUPS (MAINTENANCE OUT, service action 0Ah): the only change a gateway
/// can make itself is to take the LU over through its own port's group (the group the
/// command came through) — the change Linux's ALUA handler asks for. Descriptors that ask a
/// group to become active must name that group; standby for any other group is what taking
/// over means anyway.
pub(crate) fn set_target_port_groups(
    lu: &crate::LogicalUnit,
    nexus: &Nexus,
    cmd: &Command<'_>,
) -> Result<u32, Sense> {
    let cdb = Cdb(cmd.cdb);
    for byte in [2, 3, 4, 5, 10] {
        check_reserved(cdb, byte, 0)?;
    }
    let Some(ownership) = lu.ownership().filter(|_| lu.explicit_alua()) else {
        return Err(Sense::invalid_opcode());
    };
    let list_len = cdb.be32(6) as usize;
    if list_len == 0 {
        return Ok(0);
    }
    if list_len < 4 || !(list_len - 4).is_multiple_of(4) || cmd.data_out.len() < list_len {
        return Err(Sense::parameter_list_length_error());
    }
    let own = nexus.target_port.group;
    let mut take = false;
    for (i, d) in cmd.data_out[4..list_len].chunks_exact(4).enumerate() {
        // The descriptor's byte in the list (for the sense's field pointer), saturated.
        let at = u16::try_from(4 + 4 * i).unwrap_or(u16::MAX);
        let state = d[0] & 0x0F;
        let group = u16::from_be_bytes([d[2], d[3]]);
        if !nexus.target_port.groups.iter().any(|g| g.id == group) {
            return Err(Sense::invalid_field_in_parameter_list(
                at.saturating_add(2),
                None,
            ));
        }
        match state {
            // Active/optimized or active/non-optimized: only through the group's own port.
            0x0 | 0x1 if group == own => take = true,
            0x0 | 0x1 if ownership.is_active(group) => {}
            0x0 | 0x1 => return Err(Sense::invalid_field_in_parameter_list(at, Some(3))),
            // Standby, unavailable, offline: fine for any group that will not own the LU.
            0x2 | 0x3 | 0xE if group != own => {}
            _ => return Err(Sense::invalid_field_in_parameter_list(at, Some(3))),
        }
    }
    if take && !ownership.is_active(own) {
        ownership.take(own).map_err(|_| STPG_FAILED)?;
        // The owner checks writes against its copy of the reservations: the latest, before
        // the first one it runs.
        lu.follow_shared_reservations();
        // Every other nexus of this gateway sees the change; the old owner's see it when
        // their gateway notices.
        lu.access_state_changed(Some(nexus.id));
    }
    Ok(0)
}
/// PARAMETER DATA FORMAT values (CDB byte 1, bits 7..5).
const FORMAT_LENGTH_ONLY: u8 = 0;
const FORMAT_EXTENDED: u8 = 1;
/// FORMAT TYPE of the extended header (byte 4, bits 6..4).
const EXTENDED_HEADER: u8 = 0x10;

/// How long REPORT TARGET PORT GROUPS waits for a takeover through its group to end. A
/// takeover takes 0.3-1 s (docs/PERFORMANCE.md, *RBD gateway takeover*); Linux's ALUA handler
/// looks again 2 s after it saw a group transitioning, so waiting longer than that for one that
/// does not end would only delay the same answer.
pub(crate) const RTPG_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits (at most [`RTPG_SETTLE`]) for the takeovers through `nexus`'s groups to end, so that
/// the report shows where they ended: a host that moves to this path while the takeover runs
/// then uses it at once, where a transitioning group had its ALUA handler look again only
/// seconds later.
fn settle(lu: &crate::LogicalUnit, nexus: &Nexus) {
    let Some(ownership) = lu.ownership() else {
        return;
    };
    let deadline = std::time::Instant::now() + RTPG_SETTLE;
    for group in nexus.target_port.groups.iter() {
        if ownership.transitioning(group.id) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            ownership.settle(group.id, left);
        }
    }
}

/// REPORT TARGET PORT GROUPS (MAINTENANCE IN, service action 0Ah).
pub(crate) fn report_target_port_groups(
    lu: &crate::LogicalUnit,
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
    settle(lu, nexus);
    data_in.extend_from_slice(&[0; 4]); // RETURN DATA LENGTH, filled in below
    if extended {
        // IMPLICIT TRANSITION TIME 0: an operator's change takes effect at once.
        data_in.extend_from_slice(&[EXTENDED_HEADER, 0, 0, 0]);
    }
    for group in nexus.target_port.groups.iter() {
        // A descriptor counts at most 255 ports (one byte); a group here has one per target.
        let ports = &group.ports[..group.ports.len().min(usize::from(u8::MAX))];
        data_in.push(lu.access_state(group.id, group.state).code()); // PREF = 0
        data_in.push(if lu.ownership().is_some() {
            SUPPORTED_STATES_EXPLICIT
        } else {
            SUPPORTED_STATES
        });
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
