//! What the target knows of a command from its CDB before running it — what it moves, where
//! it may run, what it needs waited for, who may send it — in one table, [`facts`]. The
//! dispatcher (`LogicalUnit::run`), the implemented-commands table (`opcodes::OPS`) and this
//! table each list every command once; everything else that asks about a command asks here.

use crate::cdb::*;
use crate::IoKind;

/// Whether a nexus that does not hold a persistent reservation may run the command under it
/// (SPC-4 5.14.11, table 49).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrAccess {
    /// Allowed from every nexus under any reservation.
    Always,
    /// A read: allowed from non-holders under the Write Exclusive types.
    Read,
    /// Everything else: conflicts for non-holders of either type.
    Write,
}

/// What the command needs made durable before it completes (the LU adds its write cache
/// setting and the CDB's FUA bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Nothing: it completes without waiting for a device.
    None,
    /// Its data, when the write cache is off (WRITE (6): no FUA bit).
    UnlessWriteBack,
    /// Its data, when the write cache is off or FUA is set.
    UnlessWriteBackOrFua,
    /// Always: a flush, or a write or deallocation as a side effect.
    Always,
    /// When the LU has an owner: taking it over (a cluster round trip), or waiting for a
    /// takeover to end.
    Ownership,
    /// The reservations, when they are saved (APTPL or shared).
    Reservations,
    /// Nothing of its own, but shared reservations are read from their store first.
    SharedReservations,
}

/// What a command is, before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// What it moves, for I/O accounting.
    pub kind: IoKind,
    /// READ, WRITE (6/10/12/16) and SYNCHRONIZE CACHE: planned, then performed by the
    /// transport (`LogicalUnit::plan`).
    pub plans: bool,
    /// A plain WRITE (6/10/12/16), which a write-back cache may absorb.
    pub plain_write: bool,
    /// Its cost has no bound a network worker could afford: EXTENDED COPY (up to 1 GiB,
    /// between any LUs of the map), WRITE SAME (a whole LU with NUMBER OF LOGICAL BLOCKS 0),
    /// UNMAP (up to 4096 ranges).
    pub runs_long: bool,
    /// It changes what every initiator sees of the LU, not only its own nexus: ALUA states
    /// and owner, mode pages, reservations. Refused through a read-only mapping.
    pub changes_lu_state: bool,
    pub pr: PrAccess,
    /// Allowed from a nexus that does not hold an SPC-2 reservation of the LU.
    pub under_spc2_reservation: bool,
    /// Answered through a port in the standby ALUA state (SPC-4 5.15.2.4.4).
    pub in_standby: bool,
    /// Answered through a port in the unavailable ALUA state (SPC-4 5.15.2.4.5); implies
    /// `in_standby`.
    pub in_unavailable: bool,
    /// Answered through a port whose ALUA state is transitioning (SPC-4 5.15.2.5); implies
    /// `in_unavailable`.
    pub in_transition: bool,
    /// Asks whether this path is ready (TEST UNIT READY): answered by a port whose group is
    /// transitioning to active as well (a takeover through it runs, for well under a second).
    /// SPC-4 has it refused there, but multipathd's `tur` checker takes that refusal for a dead
    /// path and looks again only a checker interval later, after the path already serves.
    /// Standby and unavailable still refuse it (multipathd reads 04h/0Bh as a standby path).
    pub path_check: bool,
    /// Answered by a unit that is not ready (SPC-4 5.12): it does not need the medium.
    pub when_not_ready: bool,
    /// Neither reports nor clears a pending unit attention (SPC-4 5.14).
    pub keeps_unit_attention: bool,
    pub durability: Durability,
}

/// An unknown command's facts, and the base every other starts from.
const OTHER: Facts = Facts {
    kind: IoKind::Other,
    plans: false,
    plain_write: false,
    runs_long: false,
    changes_lu_state: false,
    pr: PrAccess::Write,
    under_spc2_reservation: false,
    in_standby: false,
    in_unavailable: false,
    in_transition: false,
    path_check: false,
    when_not_ready: false,
    keeps_unit_attention: false,
    durability: Durability::None,
};

/// The facts of the command `cdb` carries.
pub fn facts(cdb: Cdb<'_>) -> Facts {
    let f = OTHER;
    let write = Facts {
        kind: IoKind::Write,
        durability: Durability::Always,
        ..f
    };
    let anywhere = Facts {
        pr: PrAccess::Always,
        in_standby: true,
        ..f
    };
    match cdb.u8(0) {
        READ_6 | READ_10 | READ_12 | READ_16 => Facts {
            kind: IoKind::Read,
            plans: true,
            pr: PrAccess::Read,
            ..f
        },
        WRITE_6 => Facts {
            plans: true,
            plain_write: true,
            durability: Durability::UnlessWriteBack,
            ..write
        },
        WRITE_10 | WRITE_12 | WRITE_16 => Facts {
            plans: true,
            plain_write: true,
            durability: Durability::UnlessWriteBackOrFua,
            ..write
        },
        WRITE_ATOMIC_16 => Facts {
            durability: Durability::UnlessWriteBackOrFua,
            ..write
        },
        WRITE_AND_VERIFY_10 | WRITE_AND_VERIFY_12 | WRITE_AND_VERIFY_16 | COMPARE_AND_WRITE
        | ORWRITE_16 => write,
        WRITE_SAME_10 | WRITE_SAME_16 => Facts {
            runs_long: true,
            ..write
        },
        UNMAP | EXTENDED_COPY => Facts {
            runs_long: true,
            durability: Durability::Always,
            ..f
        },
        SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => Facts {
            plans: true,
            durability: Durability::Always,
            ..f
        },
        VERIFY_10 | VERIFY_12 | VERIFY_16 | READ_DEFECT_DATA_10 | READ_DEFECT_DATA_12
        | PRE_FETCH_10 | PRE_FETCH_16 | RECEIVE_COPY_RESULTS => Facts {
            pr: PrAccess::Read,
            ..f
        },
        MODE_SENSE_6 | MODE_SENSE_10 => Facts {
            pr: PrAccess::Read,
            in_standby: true,
            ..f
        },
        MODE_SELECT_6 | MODE_SELECT_10 => Facts {
            changes_lu_state: true,
            in_standby: true,
            ..f
        },
        INQUIRY | REPORT_LUNS | REQUEST_SENSE => Facts {
            under_spc2_reservation: true,
            when_not_ready: true,
            keeps_unit_attention: true,
            in_unavailable: true,
            in_transition: true,
            ..anywhere
        },
        // REPORT TARGET PORT GROUPS (and the other reports): how an initiator learns the state.
        // The former waits for a takeover through its group to end (`alua::settle`).
        MAINTENANCE_IN => Facts {
            under_spc2_reservation: true,
            when_not_ready: true,
            in_unavailable: true,
            in_transition: true,
            durability: if cdb.service_action() == SA_REPORT_TARGET_PORT_GROUPS {
                Durability::Ownership
            } else {
                Durability::None
            },
            ..anywhere
        },
        READ_CAPACITY_10 => anywhere,
        PERSISTENT_RESERVE_IN => Facts {
            durability: Durability::SharedReservations,
            ..anywhere
        },
        PERSISTENT_RESERVE_OUT => Facts {
            changes_lu_state: true,
            durability: Durability::Reservations,
            ..anywhere
        },
        TEST_UNIT_READY => Facts {
            pr: PrAccess::Always,
            path_check: true,
            ..f
        },
        RELEASE_6 | RELEASE_10 => Facts {
            pr: PrAccess::Always,
            under_spc2_reservation: true,
            ..f
        },
        RESERVE_6 | RESERVE_10 => Facts {
            changes_lu_state: true,
            ..f
        },
        SERVICE_ACTION_IN_16 if cdb.service_action() == SA_READ_CAPACITY_16 => anywhere,
        SERVICE_ACTION_IN_16 => Facts {
            pr: PrAccess::Read,
            ..f
        },
        MAINTENANCE_OUT => Facts {
            changes_lu_state: cdb.service_action() == SA_SET_TARGET_PORT_GROUPS,
            in_standby: true,
            in_unavailable: true,
            durability: Durability::Ownership,
            ..f
        },
        // PREVENT=0 (allow) is allowed under a reservation; establishing a prevention is not.
        PREVENT_ALLOW_MEDIUM_REMOVAL if cdb.u8(4) & 0x03 == 0 => Facts {
            pr: PrAccess::Always,
            ..f
        },
        _ => f,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opcodes::OPS;

    fn of(cdb: &[u8]) -> Facts {
        facts(Cdb(cdb))
    }

    #[test]
    fn the_table_and_the_implemented_commands_agree() {
        // Every implemented command that moves data says so; every command the table calls a
        // read or a write is implemented.
        for op in OPS {
            let mut cdb = vec![op.opcode, 0, 0, 0, 0, 0];
            if let Some(sa) = op.service_action {
                cdb[1] = sa as u8;
            }
            let f = of(&cdb);
            assert!(!f.plans || f.kind != IoKind::Other || f.durability == Durability::Always);
            assert_eq!(
                f.plain_write,
                f.plans && f.kind == IoKind::Write,
                "{:02x}",
                op.opcode
            );
        }
        for opcode in 0..=255u8 {
            if of(&[opcode, 0, 0, 0, 0, 0]).kind != IoKind::Other {
                assert!(
                    OPS.iter().any(|o| o.opcode == opcode),
                    "{opcode:02x} not implemented"
                );
            }
        }
    }

    #[test]
    fn unbounded_commands_and_lu_state_changes() {
        for op in [EXTENDED_COPY, WRITE_SAME_10, WRITE_SAME_16, UNMAP] {
            assert!(of(&[op, 0]).runs_long, "{op:02x}");
        }
        assert!(!of(&[WRITE_10, 0]).runs_long);
        for op in [
            MODE_SELECT_6,
            MODE_SELECT_10,
            PERSISTENT_RESERVE_OUT,
            RESERVE_6,
            RESERVE_10,
        ] {
            assert!(of(&[op, 0]).changes_lu_state, "{op:02x}");
        }
        let set_tpg = SA_SET_TARGET_PORT_GROUPS as u8;
        assert!(of(&[MAINTENANCE_OUT, set_tpg]).changes_lu_state);
        assert!(!of(&[MAINTENANCE_OUT, 0x0B]).changes_lu_state);
        assert!(!of(&[PERSISTENT_RESERVE_IN, 0]).changes_lu_state);
    }

    #[test]
    fn standby_answers_only_what_spc_lists() {
        for op in [
            INQUIRY,
            REPORT_LUNS,
            REQUEST_SENSE,
            MODE_SENSE_6,
            MODE_SELECT_10,
            READ_CAPACITY_10,
        ] {
            assert!(of(&[op, 0]).in_standby, "{op:02x}");
        }
        let rc16 = SA_READ_CAPACITY_16 as u8;
        assert!(of(&[SERVICE_ACTION_IN_16, rc16]).in_standby);
        assert!(!of(&[SERVICE_ACTION_IN_16, SA_GET_LBA_STATUS as u8]).in_standby);
        assert!(!of(&[READ_10, 0]).in_standby);
        assert!(!of(&[TEST_UNIT_READY, 0]).in_standby);
    }

    #[test]
    fn each_alua_state_answers_a_subset_of_the_one_before() {
        for op in 0..=u8::MAX {
            for sa in [0u8, 0x0A, 0x0C, 0x10] {
                let f = of(&[op, sa, 0, 0, 0, 0]);
                assert!(!f.in_transition || f.in_unavailable, "{op:02x}/{sa:02x}");
                assert!(!f.in_unavailable || f.in_standby, "{op:02x}/{sa:02x}");
            }
        }
        assert!(of(&[INQUIRY, 0]).in_transition);
        // Only TEST UNIT READY checks a path, and standby refuses it all the same.
        for op in 0..=255u8 {
            assert_eq!(of(&[op, 0]).path_check, op == TEST_UNIT_READY, "{op:02x}");
        }
        assert!(!of(&[TEST_UNIT_READY, 0]).in_standby);
        assert!(of(&[MAINTENANCE_OUT, SA_SET_TARGET_PORT_GROUPS as u8]).in_unavailable);
        assert!(!of(&[MAINTENANCE_OUT, SA_SET_TARGET_PORT_GROUPS as u8]).in_transition);
        assert!(!of(&[PERSISTENT_RESERVE_IN, 0]).in_unavailable);
        assert!(!of(&[MODE_SENSE_6, 0]).in_unavailable);
    }

    #[test]
    fn what_a_reserved_or_not_ready_unit_still_answers() {
        for op in [INQUIRY, REPORT_LUNS, REQUEST_SENSE] {
            let f = of(&[op, 0]);
            assert!(f.keeps_unit_attention && f.when_not_ready && f.under_spc2_reservation);
        }
        let f = of(&[MAINTENANCE_IN, 0x0A]);
        assert!(f.when_not_ready && f.under_spc2_reservation && !f.keeps_unit_attention);
        assert!(of(&[RELEASE_10, 0]).under_spc2_reservation);
        assert!(!of(&[TEST_UNIT_READY, 0]).when_not_ready);
        assert!(!of(&[READ_10, 0]).under_spc2_reservation);
    }

    #[test]
    fn durability_follows_the_cache_only_for_plain_writes() {
        assert_eq!(of(&[WRITE_6]).durability, Durability::UnlessWriteBack);
        assert_eq!(of(&[WRITE_16]).durability, Durability::UnlessWriteBackOrFua);
        assert_eq!(of(&[COMPARE_AND_WRITE]).durability, Durability::Always);
        assert_eq!(of(&[READ_16]).durability, Durability::None);
        assert_eq!(of(&[]).durability, Durability::None);
        assert_eq!(of(&[]).kind, IoKind::Other);
    }
}
