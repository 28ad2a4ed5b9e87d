#![forbid(unsafe_code)]
//! Transport-agnostic SCSI block device (SPC-4 / SBC-3).
//!
//! The transport (iSCSI today, NVMe-oF or iSER later) decodes its own PDUs and hands this crate
//! a CDB, the Data-Out bytes it received and the Data-In room it expects; this crate runs the
//! command synchronously against a [`store::BlockStore`] and returns a status, sense data and
//! the CDB's own transfer length (for the transport's residual accounting). Block-moving
//! commands can instead be planned and finished ([`Plan`]) so the transport performs their I/O
//! asynchronously. No sockets, threads or clocks live here.

mod alua;
mod cdb;
pub mod facts;
pub mod inflight;
mod inquiry;
mod lu;
mod lun_map;
mod mode;
mod opcodes;
mod plan;
mod pr;
mod sbc;
pub mod sense;
pub mod unit_attention;
mod xcopy;

pub use lu::{LogicalUnit, LuIdentity, LuSettings};
pub use lun_map::{lun_from_wire, lun_to_wire, LunEntry, LunMap, LUN_MAX};
pub use plan::{plans, BlockIo, BlockOp, Plan, WriteShare};
pub use pr::{
    PersistentReservations, PrNexus, PrNotice, PrPersistence, PrRegistration, SaveRefused,
    NOTICES_KEPT, REGISTRATIONS_MAX, REGISTRATIONS_PER_NODE_MAX,
};
pub use sense::Sense;
pub use store::{FileRange, SharedSlice};
pub use unit_attention::Changed;

/// Where a read run by a network worker may lend data instead of copying it into `data_in`.
pub struct Lending<'a> {
    /// Slices of store memory (RAM LUs).
    pub slices: &'a mut Vec<SharedSlice>,
    /// A page-cached range of a file LU's backing file, for the transport to send with
    /// `sendfile`: only for reads of at least `file_min_bytes` (0: never).
    pub file: &'a mut Option<FileRange>,
    pub file_min_bytes: u32,
}

use std::sync::Arc;

/// The relative target port ID of every NVMe host's nexus. NVMe makes a reservation
/// registration the host's through all of a subsystem's controllers (NVMe base 2.0, 8.19),
/// where SPC-4 makes it one I_T nexus's: with one port ID for all of them, a host registered
/// through one path is registered through its others. (0 is no SCSI port's ID.)
pub const ANY_PORT: u16 = 0;

/// A SCSI target port (for iSCSI: a target portal group of one target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPort {
    pub relative_id: u16,
    /// SCSI name of the port, e.g. "iqn.2026-11.org.ferrosan:demo,t,0x0001".
    pub name: String,
    /// SCSI name of the target device (the iSCSI target name).
    pub target_name: String,
    /// The target port group (ALUA) this port belongs to.
    pub group: u16,
    /// Every target port group of this port's target, as REPORT TARGET PORT GROUPS lists them;
    /// shared by all the target's ports.
    pub groups: Arc<[PortGroup]>,
    /// A gateway's port as seen by the LU's owner through a peer session: commands through it
    /// were shipped by that gateway ([`Ownership::ship`]) for the initiator port the nexus
    /// names; `relative_id` is that gateway's port, `group` the owner's. Never shipped on.
    pub shipped: bool,
}

impl TargetPort {
    /// The configured state of this port's own target port group (active/optimized if the
    /// group list does not name it).
    pub fn configured_state(&self) -> AccessState {
        self.groups
            .iter()
            .find(|g| g.id == self.group)
            .map_or(AccessState::ActiveOptimized, |g| g.state)
    }

    /// This port as an NVMe host's nexus carries it: the same port group (its ALUA state is the
    /// namespaces' ANA state), the relative ID [`ANY_PORT`].
    pub fn any_port(&self) -> TargetPort {
        TargetPort {
            relative_id: ANY_PORT,
            ..self.clone()
        }
    }

    /// A target with this one port, in a target port group of its own (same number),
    /// active/optimized.
    pub fn alone(relative_id: u16, name: String, target_name: String) -> TargetPort {
        TargetPort {
            relative_id,
            name,
            target_name,
            group: relative_id,
            groups: Arc::new([PortGroup {
                id: relative_id,
                state: AccessState::ActiveOptimized,
                ports: vec![relative_id],
            }]),
            shipped: false,
        }
    }
}

/// Asymmetric access state of a target port group (SPC-4 5.15.2.4). In the active states every
/// command works and the state tells multipath initiators which paths to prefer; the others
/// answer fewer commands each ([`crate::facts::Facts`]: `in_standby`, `in_unavailable`,
/// `in_transition`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessState {
    ActiveOptimized,
    ActiveNonOptimized,
    /// Only identification, sense, mode and reservation commands (SPC-4 5.15.2.4.4): the LU
    /// is owned through another target port group ([`Ownership`]) that cannot be reached, or
    /// the operator keeps the group in reserve.
    Standby,
    /// Only identification, sense and the target port group commands (SPC-4 5.15.2.4.5): the
    /// operator took the group out of service (maintenance of its network, say).
    Unavailable,
    /// Changing between states (SPC-4 5.15.2.5): only identification, sense and REPORT TARGET
    /// PORT GROUPS; everything else is NOT READY, ASYMMETRIC ACCESS STATE TRANSITION, which
    /// initiators retry.
    Transitioning,
}

/// Explicit ALUA for an LU that several gateways export, each a target port group of the same
/// target: one group owns the LU (active/optimized), every other is standby. The engine says
/// who owns it (an RBD image's exclusive lock) and moves it on SET TARGET PORT GROUPS.
pub trait Ownership: Send + Sync {
    /// Whether target port group `group` belongs to the gateway that owns the LU now (false
    /// for every group while none does: all standby).
    fn is_active(&self, group: u16) -> bool;
    /// Makes `group` (a group of this gateway) the owner, fencing the previous owner so that
    /// nothing it still sends can land; may wait for a cluster (an I/O thread's call).
    fn take(&self, group: u16) -> std::io::Result<()>;
    /// Whether initiators may move the LU (explicit ALUA: TPGS = 11b, SET TARGET PORT GROUPS
    /// calls [`Ownership::take`]); false: implicit only (TPGS = 01b), SET TARGET PORT GROUPS
    /// is refused as for an LU without an owner, and the owners move the LU themselves.
    fn explicit(&self) -> bool {
        false
    }
    /// Whether target port group `group` is on its way to owning the LU (a takeover through it
    /// is running: fencing the old owner, taking the lock): transitioning, so that its commands
    /// are retried instead of going to an owner that is being fenced.
    fn transitioning(&self, group: u16) -> bool {
        let _ = group;
        false
    }
    /// Waits, at most `within`, for a takeover through `group` to end (REPORT TARGET PORT
    /// GROUPS asks before it answers, so that a host moving to this path mid-takeover learns
    /// the state the takeover ends in rather than retrying seconds later). An I/O thread's
    /// call: the command waits for the device wherever its LU has an owner
    /// ([`crate::LogicalUnit::waits_for_device`]). The default returns at once.
    fn settle(&self, group: u16, within: std::time::Duration) {
        let _ = (group, within);
    }
    /// Whether this gateway's groups that do not own the LU are active/non-optimized: a
    /// command that needs the medium is run by the owner ([`Ownership::ship`]) instead of
    /// refused (standby). False while no owner is known.
    fn ships(&self) -> bool {
        false
    }
    /// Whether the groups that do not own the LU are active/non-optimized (every gateway's
    /// non-owner ships), as REPORT TARGET PORT GROUPS says on every gateway alike. False
    /// while no owner is known.
    fn non_owners_ship(&self) -> bool {
        false
    }
    /// Runs `cmd` of `nexus` on the owner (I/O shipping) and returns its completion, Data-In
    /// in `data_in` (at most `cmd.data_in_limit` bytes): the owner runs it as `nexus`'s
    /// initiator port through this gateway's port (a [`TargetPort::shipped`] nexus there), so
    /// its reservations are checked there, where they are current. Called after this LU's own
    /// checks (unit attention, opcode, write protection) passed; may wait for the network.
    fn ship(&self, nexus: &Nexus, cmd: &Command<'_>, data_in: &mut Vec<u8>) -> Completion {
        let _ = (nexus, cmd, data_in);
        Completion::check_condition(crate::alua::STANDBY)
    }
    /// [`Ownership::ship`] without waiting: `done` gets the completion and the Data-In, on a
    /// thread of the shipper's, so that no thread of the transport waits for the owner. The
    /// default ships on the calling thread.
    fn ship_then(&self, nexus: &Nexus, cmd: ShippedCommand, done: ShipDone) {
        let mut data_in = Vec::new();
        let completion = self.ship(nexus, &cmd.command(), &mut data_in);
        done(completion, data_in);
    }
    /// A LOGICAL UNIT RESET of `nexus` through a non-owner's port: the owner resets too (its
    /// nexuses get the unit attention). Returns whether the owner confirmed it. May wait for
    /// the network.
    fn reset_owner(&self, nexus: &Nexus) -> bool {
        let _ = nexus;
        false
    }
    /// A PERSISTENT RESERVE OUT through a non-owner's port changed the stored reservations:
    /// the owner takes them up before the command is answered (so a reservation made here
    /// holds there at once). May wait for the network.
    fn reservations_changed(&self, nexus: &Nexus) {
        let _ = nexus;
    }
    /// Whether the nexus existed when this gateway lost the LU: a command it holds could be
    /// stale, so its commands are never shipped and the transport ends its session (the
    /// initiator logs in again, as a new nexus that ships).
    fn nexus_outlived_ownership(&self, nexus_id: u64) -> bool {
        let _ = nexus_id;
        false
    }
    /// The nexus is gone: what the owner keeps for it (its peer session) can go too.
    fn nexus_lost(&self, nexus_id: u64) {
        let _ = nexus_id;
    }
}

impl AccessState {
    /// The ASYMMETRIC ACCESS STATE code.
    pub fn code(self) -> u8 {
        match self {
            AccessState::ActiveOptimized => 0x0,
            AccessState::ActiveNonOptimized => 0x1,
            AccessState::Standby => 0x2,
            AccessState::Unavailable => 0x3,
            AccessState::Transitioning => 0xF,
        }
    }
}

/// A target port group: its number, state and the relative identifiers of its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortGroup {
    pub id: u16,
    pub state: AccessState,
    pub ports: Vec<u16>,
}

/// What a command moves, for I/O accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// READ (6/10/12/16): Data-In from the medium.
    Read,
    /// Commands that write the medium with the Data-Out they carry: WRITE, WRITE AND VERIFY,
    /// WRITE SAME, COMPARE AND WRITE, ORWRITE, WRITE ATOMIC.
    Write,
    Other,
}

/// Classifies a command by its opcode alone (it may still fail); see [`facts::facts`].
pub fn io_kind(cdb: &[u8]) -> IoKind {
    facts::facts(cdb::Cdb(cdb)).kind
}

/// Whether a command's cost has no bound a network worker could afford, whatever store the
/// addressed LU has ([`facts::Facts::runs_long`]). A transport runs these where waiting is
/// fine, never where other sessions' commands wait behind them.
pub fn runs_long(cdb: &[u8]) -> bool {
    facts::facts(cdb::Cdb(cdb)).runs_long
}

/// One I_T nexus: an initiator port talking to a target port.
#[derive(Debug, Clone)]
pub struct Nexus {
    /// Unique per I_T nexus in this process; per-nexus LU state is keyed by it.
    pub id: u64,
    /// SCSI name of the initiator port, e.g. `iqn...,i,0x<isid hex>`.
    pub initiator_port: String,
    pub target_port: Arc<TargetPort>,
}

/// One command as the transport received it.
#[derive(Debug, Clone, Copy)]
pub struct Command<'a> {
    pub cdb: &'a [u8],
    /// All Data-Out bytes the transport received (its expected transfer length, which may differ
    /// from what the CDB asks for).
    pub data_out: &'a [u8],
    /// The transport's expected Data-In length; `data_in` is never filled beyond it.
    pub data_in_limit: u32,
}

/// A command handed to the LU's owner whole ([`Ownership::ship_then`]): it outlives the
/// transport's buffers.
#[derive(Debug, Clone, Default)]
pub struct ShippedCommand {
    pub cdb: Vec<u8>,
    pub data_out: Vec<u8>,
    pub data_in_limit: u32,
}

impl ShippedCommand {
    pub fn new(cmd: &Command<'_>) -> ShippedCommand {
        ShippedCommand {
            cdb: cmd.cdb.to_vec(),
            data_out: cmd.data_out.to_vec(),
            data_in_limit: cmd.data_in_limit,
        }
    }

    pub fn command(&self) -> Command<'_> {
        Command {
            cdb: &self.cdb,
            data_out: &self.data_out,
            data_in_limit: self.data_in_limit,
        }
    }
}

/// Where a shipped command's completion and Data-In go ([`Ownership::ship_then`]).
pub type ShipDone = Box<dyn FnOnce(Completion, Vec<u8>) + Send>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Good,
    CheckCondition,
    ConditionMet,
    Busy,
    ReservationConflict,
    TaskSetFull,
    TaskAborted,
}

impl Status {
    /// SAM-5 status code.
    pub fn code(&self) -> u8 {
        match self {
            Status::Good => 0x00,
            Status::CheckCondition => 0x02,
            Status::ConditionMet => 0x04,
            Status::Busy => 0x08,
            Status::ReservationConflict => 0x18,
            Status::TaskSetFull => 0x28,
            Status::TaskAborted => 0x40,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub status: Status,
    pub sense: Option<Sense>,
    /// Bytes the CDB itself asked to move (in or out): for Data-In commands the amount the
    /// command produced after allocation-length truncation, for Data-Out commands the amount the
    /// CDB describes. The transport compares it with its expected length for residuals.
    pub transfer_len: u32,
}

impl Completion {
    pub fn good(transfer_len: u32) -> Completion {
        Completion {
            status: Status::Good,
            sense: None,
            transfer_len,
        }
    }
    pub fn check_condition(sense: Sense) -> Completion {
        Completion {
            status: Status::CheckCondition,
            sense: Some(sense),
            transfer_len: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_kind_by_opcode() {
        for op in [0x08, 0x28, 0xA8, 0x88] {
            assert_eq!(io_kind(&[op, 0, 0]), IoKind::Read, "{op:02x}");
        }
        for op in [
            0x0A, 0x2A, 0xAA, 0x8A, 0x2E, 0xAE, 0x8E, 0x41, 0x93, 0x89, 0x8B, 0x9C,
        ] {
            assert_eq!(io_kind(&[op, 0, 0]), IoKind::Write, "{op:02x}");
        }
        // Data-In that is not medium data, and commands that move none.
        for op in [0x12, 0x25, 0x1A, 0x00, 0x35, 0x42, 0xA3, 0x2F] {
            assert_eq!(io_kind(&[op, 0, 0]), IoKind::Other, "{op:02x}");
        }
        assert_eq!(io_kind(&[]), IoKind::Other);
    }
}
