//! Reservations: SPC-4 persistent reservations (PERSISTENT RESERVE IN/OUT) and SPC-2
//! RESERVE/RELEASE.
//!
//! Registrations belong to an I_T nexus named by (initiator port name, relative target port id),
//! so they survive the session going away and coming back with the same ISID. The command fast
//! path reads one atomic (`held`: some reservation of either kind exists) and locks only then.
//! With a [`PrPersistence`] set (the engine does for LUs on files and block devices), APTPL=1
//! is accepted (PTPL_C=1): while the last REGISTER asked for it, every change is handed to the
//! persistence before the command completes, and a failed save fails the command with the
//! state unchanged. Without one, APTPL=1 is refused (PTPL_C=0).

use crate::cdb::*;
use crate::lu::LogicalUnit;
use crate::sense::{Sense, Stop};
use crate::unit_attention::{
    REGISTRATIONS_PREEMPTED, RESERVATIONS_PREEMPTED, RESERVATIONS_RELEASED,
};
use crate::{Command, Nexus};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub const SA_PR_READ_KEYS: u16 = 0x00;
pub const SA_PR_READ_RESERVATION: u16 = 0x01;
pub const SA_PR_REPORT_CAPABILITIES: u16 = 0x02;
pub const SA_PR_READ_FULL_STATUS: u16 = 0x03;

pub const SA_PR_REGISTER: u16 = 0x00;
pub const SA_PR_RESERVE: u16 = 0x01;
pub const SA_PR_RELEASE: u16 = 0x02;
pub const SA_PR_CLEAR: u16 = 0x03;
pub const SA_PR_PREEMPT: u16 = 0x04;
pub const SA_PR_PREEMPT_AND_ABORT: u16 = 0x05;
pub const SA_PR_REGISTER_AND_IGNORE: u16 = 0x06;

pub const TYPE_WE: u8 = 1;
pub const TYPE_EA: u8 = 3;
pub const TYPE_WE_RO: u8 = 5;
pub const TYPE_EA_RO: u8 = 6;
pub const TYPE_WE_AR: u8 = 7;
pub const TYPE_EA_AR: u8 = 8;

/// Parameter list length of every PERSISTENT RESERVE OUT service action we implement.
const PROUT_PARAMETER_BYTES: usize = 24;

/// An I_T nexus as persistent reservations name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ItNexus {
    initiator: String,
    relative_port: u16,
}

impl ItNexus {
    fn of(nexus: &Nexus) -> ItNexus {
        ItNexus {
            initiator: nexus.initiator_port.clone(),
            relative_port: nexus.target_port.relative_id,
        }
    }

    /// The initiator node: its port name without the ISID (`,i,0x…`) or NVMe host
    /// identifier (`,h,0x…`).
    fn node(&self) -> &str {
        let port = self.initiator.as_str();
        port.rsplit_once(",i,0x")
            .or_else(|| port.rsplit_once(",h,0x"))
            .map_or(port, |(node, _)| node)
    }
}

#[derive(Debug, Clone)]
struct Reservation {
    holder: ItNexus,
    pr_type: u8,
}

fn all_registrants(pr_type: u8) -> bool {
    matches!(pr_type, TYPE_WE_AR | TYPE_EA_AR)
}
fn registrants_only(pr_type: u8) -> bool {
    matches!(pr_type, TYPE_WE_RO | TYPE_EA_RO)
}
fn valid_type(pr_type: u8) -> bool {
    matches!(
        pr_type,
        TYPE_WE | TYPE_EA | TYPE_WE_RO | TYPE_EA_RO | TYPE_WE_AR | TYPE_EA_AR
    )
}

#[derive(Default)]
struct State {
    /// Activate Persist Through Power Loss, from the last valid REGISTER (SPC-4 5.14.5).
    aptpl: bool,
    generation: u32,
    /// In registration order (READ KEYS reports them so).
    registrations: Vec<(ItNexus, u64)>,
    reservation: Option<Reservation>,
    /// SPC-2 RESERVE holder (a nexus id: released when that nexus goes).
    spc2: Option<u64>,
    /// Nexus ids seen sending PR commands or checked while a reservation existed, for
    /// delivering unit attentions to an I_T nexus.
    seen: HashMap<u64, Seen>,
    /// Unit attentions of changes made through any target sharing the state (the last
    /// [`NOTICES_KEPT`]; shared state only): each target raises them on its own nexuses.
    notices: Vec<PrNotice>,
    /// The highest notice number this LU has raised (or made itself).
    notices_raised: u64,
    /// Unit attentions a PERSISTENT RESERVE OUT raises, held until its change is saved (a
    /// change another gateway's save overtook is run again, and raises them then).
    pending_ua: Vec<NexusAttention>,
}

/// A unit attention (ASC, ASCQ) for a nexus id.
type NexusAttention = (u64, (u8, u8));

/// An I_T nexus as seen here.
#[derive(Debug, Clone)]
struct Seen {
    it: ItNexus,
    /// Its commands were shipped here by another gateway: that gateway raises the nexus's
    /// reservation unit attentions, from the shared notices.
    shipped: bool,
}

/// Registrations one LU holds (I_T nexuses with a key). A REGISTER beyond it is refused with
/// INSUFFICIENT REGISTRATION RESOURCES: without a bound, one initiator logging in again and
/// again with fresh ISIDs grows the saved state until it no longer loads. 256 is a 64-node
/// cluster with four paths per node.
pub const REGISTRATIONS_MAX: usize = 256;

/// Registrations one initiator node (one iSCSI name, one NVMe host NQN) may hold on one LU,
/// whatever its ISIDs or host identifiers: without it one node logging in with fresh ISIDs
/// takes every place of [`REGISTRATIONS_MAX`] and no other node can register. 32 is eight
/// paths to four target ports.
pub const REGISTRATIONS_PER_NODE_MAX: usize = 32;

/// ILLEGAL REQUEST, INSUFFICIENT REGISTRATION RESOURCES (55h/04h, SPC-4 5.14.7).
/// Saves a change made under the lock, while APTPL is on and once more when it goes off (the
/// saved copy then says so and is not restored), or always when the state is shared. A save
/// that fails restores `before`: nothing changes unless it is durable. The persistence logs
/// its own failure (this crate does no logging).
fn save_change(
    s: &mut State,
    persistence: &dyn PrPersistence,
    before: &PersistentReservations,
) -> Result<(), Attempt> {
    let after = s.persistent();
    if after == *before || !(after.aptpl || before.aptpl || persistence.shared()) {
        return Ok(());
    }
    let Err(e) = persistence.save(&after) else {
        return Ok(());
    };
    s.set_persistent(before);
    s.pending_ua.clear();
    Err(match SaveRefused::of(&e) {
        Some(SaveRefused::Conflict) => Attempt::Overtaken,
        Some(SaveRefused::TooLarge) => insufficient_registration_resources().into(),
        None => Sense::new(crate::sense::HARDWARE_ERROR, 0x44, 0x00).into(),
    })
}

pub(crate) fn insufficient_registration_resources() -> Sense {
    Sense::new(crate::sense::ILLEGAL_REQUEST, 0x55, 0x04)
}

/// Notices kept in a shared reservation state: a target that looks at it at least this many
/// changes apart raises every unit attention (targets look before each PERSISTENT RESERVE
/// command and, as RBD gateways, once a second).
pub const NOTICES_KEPT: usize = 16;

impl State {
    fn see(&mut self, nexus: &Nexus) {
        self.seen.entry(nexus.id).or_insert_with(|| Seen {
            it: ItNexus::of(nexus),
            shipped: nexus.target_port.shipped,
        });
    }
    fn key_of(&self, it: &ItNexus) -> Option<u64> {
        self.registrations
            .iter()
            .find(|(r, _)| r == it)
            .map(|(_, k)| *k)
    }
    fn is_holder(&self, it: &ItNexus) -> bool {
        match &self.reservation {
            None => false,
            Some(r) if all_registrants(r.pr_type) => self.key_of(it).is_some(),
            Some(r) => r.holder == *it,
        }
    }
    /// Nexus ids of I_T nexuses matching `pred`; with `direct_only`, not those of commands
    /// shipped here.
    fn nexus_ids(&self, direct_only: bool, pred: impl Fn(&ItNexus) -> bool) -> Vec<u64> {
        self.seen
            .iter()
            .filter(|(_, seen)| !(direct_only && seen.shipped) && pred(&seen.it))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Takes `stored` (saved by another target sharing the state) and returns the unit
    /// attentions of its notices not yet raised here, for this target's own nexuses.
    fn adopt(&mut self, stored: &PersistentReservations) -> Vec<NexusAttention> {
        self.set_persistent(stored);
        let mut raise = Vec::new();
        for notice in &self.notices {
            if notice.seq > self.notices_raised {
                let targets: Vec<ItNexus> = notice.nexuses.iter().map(ItNexus::from).collect();
                for id in self.nexus_ids(true, |it| targets.contains(it)) {
                    raise.push((id, notice.ua));
                }
            }
        }
        // (Lower when the stored notices were started over: numbering follows them.)
        self.notices_raised = self.last_notice();
        raise
    }

    fn last_notice(&self) -> u64 {
        self.notices.last().map_or(0, |n| n.seq)
    }
    /// RESERVE: taken when free; held already by `it` with the same type, GOOD; otherwise
    /// RESERVATION CONFLICT.
    fn reserve(&mut self, it: &ItNexus, pr_type: u8) -> Result<(), Stop> {
        match &self.reservation {
            None => {
                self.reservation = Some(Reservation {
                    holder: it.clone(),
                    pr_type,
                });
                Ok(())
            }
            Some(res) if self.is_holder(it) && res.pr_type == pr_type => Ok(()),
            Some(_) => Err(Stop::Conflict),
        }
    }

    /// The registered nexuses other than `it`.
    fn registrants_but(&self, it: &ItNexus) -> Vec<ItNexus> {
        self.registrations
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| n != it)
            .collect()
    }

    /// Removes a registration; releases the reservation it held. Returns the nexuses to tell
    /// RESERVATIONS RELEASED.
    fn unregister(&mut self, it: &ItNexus) -> Vec<ItNexus> {
        self.registrations.retain(|(r, _)| r != it);
        let mut notify = Vec::new();
        if let Some(r) = &self.reservation {
            if all_registrants(r.pr_type) {
                if self.registrations.is_empty() {
                    self.reservation = None;
                }
            } else if r.holder == *it {
                if registrants_only(r.pr_type) {
                    notify = self.registrations.iter().map(|(n, _)| n.clone()).collect();
                }
                self.reservation = None;
            }
        }
        notify
    }
}

/// The state of persistent reservations that survives a restart (with APTPL): what
/// [`PrPersistence`] stores and [`LogicalUnit::restore_reservations`] loads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PersistentReservations {
    pub aptpl: bool,
    pub generation: u32,
    /// In registration order.
    pub registrations: Vec<PrRegistration>,
    /// The holder (for all-registrants types, any registrant: the first) and its type.
    pub reservation: Option<(PrNexus, u8)>,
    /// Shared state only: the unit attentions of the last changes, oldest first.
    pub notices: Vec<PrNotice>,
}

/// A unit attention a PERSISTENT RESERVE OUT raised for I_T nexuses, kept in a shared state
/// so that every target sharing it tells its own nexuses (a PREEMPT through one RBD gateway
/// reaches the preempted initiator connected to another).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrNotice {
    /// Numbered from 1, one up per notice.
    pub seq: u64,
    /// ASC and ASCQ (UNIT ATTENTION).
    pub ua: (u8, u8),
    pub nexuses: Vec<PrNexus>,
}

/// An I_T nexus of a registration: initiator port name (`iqn...,i,0x<ISID>`) and relative
/// target port id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrNexus {
    pub initiator_port: String,
    pub relative_port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrRegistration {
    pub nexus: PrNexus,
    pub key: u64,
}

/// Where an LU's persistent reservations go when APTPL is set. `save` must be durable when it
/// returns (the command completes after it); it is called with the LU's reservation lock held,
/// from PERSISTENT RESERVE OUT only.
/// How a [`PrPersistence`] refuses a save, carried inside the `io::Error` it returns; any other
/// error is a failed save (HARDWARE ERROR).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveRefused {
    /// A shared persistence's state changed since this target loaded it (another target
    /// saved in between): the PERSISTENT RESERVE OUT is run again on the state as now stored.
    Conflict,
    /// The state would be larger than can be stored and loaded back: the PERSISTENT RESERVE
    /// OUT fails with INSUFFICIENT REGISTRATION RESOURCES, nothing changed.
    TooLarge,
}

impl SaveRefused {
    pub fn error(self) -> std::io::Error {
        std::io::Error::other(self)
    }

    /// The refusal `e` carries, if it is one.
    pub fn of(e: &std::io::Error) -> Option<SaveRefused> {
        e.get_ref()?.downcast_ref::<SaveRefused>().copied()
    }
}

impl std::fmt::Display for SaveRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SaveRefused::Conflict => "the shared reservation state changed since it was loaded",
            SaveRefused::TooLarge => {
                "the reservation state would be larger than can be loaded back"
            }
        })
    }
}

impl std::error::Error for SaveRefused {}

/// Times a PERSISTENT RESERVE OUT is run again after another target's save overtook it,
/// before it fails (NOT READY, retry).
const SAVE_ATTEMPTS_MAX: u32 = 8;

/// How one attempt at a PERSISTENT RESERVE OUT ended, when not in success.
enum Attempt {
    Failed(Stop),
    Overtaken,
}

impl From<Stop> for Attempt {
    fn from(stop: Stop) -> Attempt {
        Attempt::Failed(stop)
    }
}

impl From<Sense> for Attempt {
    fn from(sense: Sense) -> Attempt {
        Attempt::Failed(Stop::Check(sense))
    }
}

pub trait PrPersistence: Send + Sync {
    /// Stores `state`. A shared persistence saves only over the state it last loaded (an
    /// atomic compare-and-set in the medium's store) and returns [`SaveRefused::Conflict`]
    /// when another target saved in between.
    fn save(&self, state: &PersistentReservations) -> std::io::Result<()>;
    /// The state is shared with other targets exporting the same medium (RBD gateways): it is
    /// loaded before every PERSISTENT RESERVE IN/OUT ([`PrPersistence::load`]) and saved after
    /// every change, APTPL or not. False: saved only while APTPL is on, never reloaded.
    fn shared(&self) -> bool {
        false
    }
    /// The shared state as stored now (None: nothing stored yet); only asked when `shared`.
    fn load(&self) -> std::io::Result<Option<PersistentReservations>> {
        Ok(None)
    }
}

impl From<&ItNexus> for PrNexus {
    fn from(it: &ItNexus) -> PrNexus {
        PrNexus {
            initiator_port: it.initiator.clone(),
            relative_port: it.relative_port,
        }
    }
}

impl From<&PrNexus> for ItNexus {
    fn from(n: &PrNexus) -> ItNexus {
        ItNexus {
            initiator: n.initiator_port.clone(),
            relative_port: n.relative_port,
        }
    }
}

impl State {
    fn persistent(&self) -> PersistentReservations {
        PersistentReservations {
            aptpl: self.aptpl,
            generation: self.generation,
            registrations: self
                .registrations
                .iter()
                .map(|(it, key)| PrRegistration {
                    nexus: it.into(),
                    key: *key,
                })
                .collect(),
            reservation: self
                .reservation
                .as_ref()
                .map(|r| ((&r.holder).into(), r.pr_type)),
            notices: self.notices.clone(),
        }
    }

    fn set_persistent(&mut self, p: &PersistentReservations) {
        self.aptpl = p.aptpl;
        self.generation = p.generation;
        self.registrations = p
            .registrations
            .iter()
            .map(|r| ((&r.nexus).into(), r.key))
            .collect();
        self.reservation = p.reservation.as_ref().map(|(holder, pr_type)| Reservation {
            holder: holder.into(),
            pr_type: *pr_type,
        });
        self.notices = p.notices.clone();
    }
}

/// A command under a reservation it does not hold (see [`crate::facts::PrAccess`]).
use crate::facts::PrAccess as Class;

fn class(cdb: Cdb<'_>) -> Class {
    crate::facts::facts(cdb).pr
}

/// Whether a command of `class` from a nexus (registered or not) conflicts with a persistent
/// reservation of `pr_type` that the nexus does not hold.
fn pr_conflicts(pr_type: u8, class: Class, registered: bool) -> bool {
    if class == Class::Always {
        return false;
    }
    let exclusive_access = matches!(pr_type, TYPE_EA | TYPE_EA_RO | TYPE_EA_AR);
    if registered && !matches!(pr_type, TYPE_WE | TYPE_EA) {
        // Registrants-only and all-registrants types: every registrant has full access.
        return false;
    }
    exclusive_access || class == Class::Write
}

pub(crate) struct Reservations {
    /// Some reservation (persistent or SPC-2) is held: commands must be checked.
    held: AtomicBool,
    state: Mutex<State>,
    persistence: OnceLock<Arc<dyn PrPersistence>>,
}

impl Default for Reservations {
    fn default() -> Self {
        Reservations {
            held: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            persistence: OnceLock::new(),
        }
    }
}

impl Reservations {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn update_held(&self, s: &State) {
        self.held.store(
            s.reservation.is_some() || s.spc2.is_some(),
            Ordering::Release,
        );
    }

    /// RESERVATION CONFLICT ([`Stop::Conflict`]) if the command may not run for this nexus.
    pub(crate) fn check(&self, nexus: &Nexus, cdb: Cdb<'_>) -> Result<(), Stop> {
        if !self.held.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut s = self.lock();
        s.see(nexus);
        if let Some(holder) = s.spc2 {
            if holder != nexus.id && !crate::facts::facts(cdb).under_spc2_reservation {
                return Err(Stop::Conflict);
            }
        }
        if let Some(r) = &s.reservation {
            let it = ItNexus::of(nexus);
            if !s.is_holder(&it) && pr_conflicts(r.pr_type, class(cdb), s.key_of(&it).is_some()) {
                return Err(Stop::Conflict);
            }
        }
        Ok(())
    }

    pub fn nexus_lost(&self, nexus_id: u64) {
        let mut s = self.lock();
        s.seen.remove(&nexus_id);
        if s.spc2 == Some(nexus_id) {
            s.spc2 = None;
        }
        self.update_held(&s);
    }

    /// LU reset and target reset release an SPC-2 reservation; persistent reservations stay.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.spc2 = None;
        self.update_held(&s);
    }

    /// Current PRgeneration (for tests and diagnostics).
    pub fn generation(&self) -> u32 {
        self.lock().generation
    }

    /// Whether changes may be saved (a persistence is set: APTPL is accepted).
    pub fn persists(&self) -> bool {
        self.persistence.get().is_some()
    }

    /// Whether the state is shared through its store (see [`PrPersistence::shared`]): every
    /// PERSISTENT RESERVE command then reads it from there first.
    pub fn shared(&self) -> bool {
        self.persistence.get().is_some_and(|p| p.shared())
    }

    /// Takes the shared state as stored (another gateway may have changed it) before a
    /// PERSISTENT RESERVE command works on it; a store that cannot be read fails the command
    /// (NOT READY, ASYMMETRIC ACCESS STATE TRANSITION: retry) rather than act on a stale copy.
    /// Returns the unit attentions its new notices raise here.
    fn refresh_shared(&self, s: &mut State) -> Result<Vec<NexusAttention>, Sense> {
        let Some(p) = self.persistence.get().filter(|p| p.shared()) else {
            return Ok(Vec::new());
        };
        match p.load() {
            Ok(Some(stored)) if s.persistent() != stored => {
                let raise = s.adopt(&stored);
                self.update_held(s);
                Ok(raise)
            }
            Ok(_) => Ok(Vec::new()),
            Err(_) => Err(Sense::not_ready_transition()),
        }
    }

    /// Whether some persistent or SPC-2 reservation is held.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }
}

impl LogicalUnit {
    /// Queues `ua` for the nexuses of `targets`; raised by [`Self::raise_pending`] once the
    /// command's change stands. With a shared state it is also noticed there, for the other
    /// targets' nexuses; nexuses shipped here are told by the gateway that shipped them.
    fn notify(&self, s: &mut State, targets: &[ItNexus], ua: (u8, u8)) {
        let shared = self.reservations.shared();
        for id in s.nexus_ids(shared, |it| targets.contains(it)) {
            s.pending_ua.push((id, ua));
        }
        if shared && !targets.is_empty() {
            let seq = s.last_notice().max(s.notices_raised) + 1;
            s.notices.push(PrNotice {
                seq,
                ua,
                nexuses: targets.iter().map(PrNexus::from).collect(),
            });
            let excess = s.notices.len().saturating_sub(NOTICES_KEPT);
            s.notices.drain(..excess);
        }
    }

    fn raise_now(&self, raise: Vec<NexusAttention>) {
        for (id, ua) in raise {
            self.ua.raise_one(id, ua);
        }
    }

    fn raise_pending(&self, s: &mut State) {
        for (id, ua) in s.pending_ua.drain(..) {
            self.ua.raise_one(id, ua);
        }
    }

    pub(crate) fn reserve_release_spc2(&self, nexus: &Nexus, cdb: Cdb<'_>) -> Result<u32, Stop> {
        let opcode = cdb.u8(0);
        // Extents (6) and third-party reservations / long identifiers (10) are not supported.
        check_reserved(cdb, 1, 0x00)?;
        let r = &self.reservations;
        let mut s = r.lock();
        s.see(nexus);
        // CRH=0: with persistent reservations in use, RESERVE and RELEASE conflict.
        if s.reservation.is_some() || !s.registrations.is_empty() {
            return Err(Stop::Conflict);
        }
        if matches!(opcode, RESERVE_6 | RESERVE_10) {
            match s.spc2 {
                Some(holder) if holder != nexus.id => return Err(Stop::Conflict),
                _ => s.spc2 = Some(nexus.id),
            }
        } else if s.spc2 == Some(nexus.id) {
            s.spc2 = None;
        }
        // RELEASE from a nexus that holds nothing is GOOD and changes nothing.
        r.update_held(&s);
        Ok(0)
    }

    pub(crate) fn persistent_reserve_in(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Stop> {
        let cdb = Cdb(cmd.cdb);
        let mut s = self.reservations.lock();
        let noticed = self.reservations.refresh_shared(&mut s)?;
        self.raise_now(noticed);
        s.see(nexus);
        let generation = s.generation;
        match cdb.service_action() {
            SA_PR_READ_KEYS => {
                data_in.extend_from_slice(&generation.to_be_bytes());
                let len = (s.registrations.len() * 8) as u32;
                data_in.extend_from_slice(&len.to_be_bytes());
                for (_, key) in &s.registrations {
                    data_in.extend_from_slice(&key.to_be_bytes());
                }
            }
            SA_PR_READ_RESERVATION => {
                data_in.extend_from_slice(&generation.to_be_bytes());
                match &s.reservation {
                    None => data_in.extend_from_slice(&0u32.to_be_bytes()),
                    Some(r) => {
                        data_in.extend_from_slice(&16u32.to_be_bytes());
                        // All-registrants reservations report key 0 (SPC-4 6.15.3.3).
                        let key = if all_registrants(r.pr_type) {
                            0
                        } else {
                            s.key_of(&r.holder).unwrap_or(0)
                        };
                        data_in.extend_from_slice(&key.to_be_bytes());
                        data_in.extend_from_slice(&[0; 5]); // obsolete, reserved
                        data_in.push(r.pr_type); // scope 0 (LU)
                        data_in.extend_from_slice(&[0; 2]);
                    }
                }
            }
            SA_PR_REPORT_CAPABILITIES => {
                data_in.extend_from_slice(&8u16.to_be_bytes());
                // RLR_C=0, CRH=0, SIP_C=0, ATP_C=0; PTPL_C: persistence through power loss.
                let capable = self.reservations.persistence.get().is_some();
                data_in.push(u8::from(capable));
                // TMV=1, ALLOW COMMANDS 000b, PTPL_A: APTPL is active.
                data_in.push(0x80 | u8::from(capable && s.aptpl));
                // Type mask: WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX; EX_AC_AR.
                data_in.push(0x80 | 0x40 | 0x20 | 0x08 | 0x02);
                data_in.push(0x01);
                data_in.extend_from_slice(&[0; 2]);
            }
            SA_PR_READ_FULL_STATUS => {
                data_in.extend_from_slice(&generation.to_be_bytes());
                data_in.extend_from_slice(&[0; 4]);
                for (it, key) in &s.registrations {
                    let holder = s.is_holder(it);
                    data_in.extend_from_slice(&key.to_be_bytes());
                    data_in.extend_from_slice(&[0; 4]);
                    data_in.push(u8::from(holder)); // ALL_TG_PT=0, R_HOLDER
                    data_in.push(match (&s.reservation, holder) {
                        (Some(r), true) => r.pr_type,
                        _ => 0,
                    });
                    data_in.extend_from_slice(&[0; 4]);
                    data_in.extend_from_slice(&it.relative_port.to_be_bytes());
                    // iSCSI TransportID, format 01b: "name,i,0x<ISID>", NUL-terminated,
                    // padded to a multiple of four, at least 24 bytes in all.
                    let name = &it.initiator.as_bytes()[..it.initiator.len().min(250)];
                    let padded = ((name.len() + 1).div_ceil(4) * 4).max(20);
                    data_in.extend_from_slice(&((4 + padded) as u32).to_be_bytes());
                    data_in.extend_from_slice(&[0x40 | 0x05, 0]);
                    data_in.extend_from_slice(&(padded as u16).to_be_bytes());
                    data_in.extend_from_slice(name);
                    data_in.resize(data_in.len() + padded - name.len(), 0);
                }
                let len = (data_in.len() - 8) as u32;
                data_in[4..8].copy_from_slice(&len.to_be_bytes());
            }
            _ => return Err(Sense::invalid_field_in_cdb(1, Some(4)).into()),
        }
        drop(s);
        Ok(finish_data_in(
            data_in,
            u32::from(cdb.be16(7)),
            cmd.data_in_limit,
        ))
    }

    pub(crate) fn persistent_reserve_out(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
    ) -> Result<u32, Stop> {
        let cdb = Cdb(cmd.cdb);
        let sa = cdb.service_action();
        let scope = cdb.u8(2) >> 4;
        let pr_type = cdb.u8(2) & 0x0F;
        let param_len = cdb.be32(5) as usize;
        if param_len != PROUT_PARAMETER_BYTES || cmd.data_out.len() < PROUT_PARAMETER_BYTES {
            return Err(Sense::parameter_list_length_error().into());
        }
        let p = &cmd.data_out[..PROUT_PARAMETER_BYTES];
        let key = param_be64(p, 0).unwrap_or(0);
        let sa_key = param_be64(p, 8).unwrap_or(0);
        let flags = p[20];
        if flags & 0x08 != 0 {
            return Err(Sense::invalid_field_in_parameter_list(20, Some(3)).into());
            // SPEC_I_PT
        }
        if flags & 0x04 != 0 {
            return Err(Sense::invalid_field_in_parameter_list(20, Some(2)).into());
            // ALL_TG_PT
        }
        let persistence = self.reservations.persistence.get();
        let aptpl = flags & 0x01 != 0;
        let registering = matches!(sa, SA_PR_REGISTER | SA_PR_REGISTER_AND_IGNORE);
        if aptpl && registering && persistence.is_none() {
            return Err(Sense::invalid_field_in_parameter_list(20, Some(0)).into());
            // APTPL
        }
        let needs_type = matches!(sa, SA_PR_RESERVE | SA_PR_RELEASE)
            || (matches!(sa, SA_PR_PREEMPT | SA_PR_PREEMPT_AND_ABORT));
        if needs_type {
            if scope != 0 {
                return Err(Sense::invalid_field_in_cdb(2, Some(7)).into());
            }
            if !valid_type(pr_type) {
                return Err(Sense::invalid_field_in_cdb(2, Some(3)).into());
            }
        }
        let it = ItNexus::of(nexus);
        let mut overtaken = 0;
        loop {
            match self.prout_once(&it, nexus, sa, pr_type, key, sa_key, aptpl) {
                Err(Attempt::Overtaken) if overtaken < SAVE_ATTEMPTS_MAX => overtaken += 1,
                // Overtaken every time: the medium's state keeps moving; the initiator retries.
                Err(Attempt::Overtaken) => return Err(Sense::not_ready_transition().into()),
                Err(Attempt::Failed(sense)) => return Err(sense),
                Ok(len) => return Ok(len),
            }
        }
    }

    /// One PERSISTENT RESERVE OUT on the state as loaded; `Overtaken` when another gateway
    /// saved a change in between (nothing of this one stands: it is run again).
    #[allow(clippy::too_many_arguments)]
    fn prout_once(
        &self,
        it: &ItNexus,
        nexus: &Nexus,
        sa: u16,
        pr_type: u8,
        key: u64,
        sa_key: u64,
        aptpl: bool,
    ) -> Result<u32, Attempt> {
        let it = it.clone();
        self.change_once(Some(nexus), |s| {
            let registered = s.key_of(&it);
            match sa {
                SA_PR_REGISTER | SA_PR_REGISTER_AND_IGNORE => {
                    if sa == SA_PR_REGISTER && registered.unwrap_or(0) != key {
                        return Err(Stop::Conflict);
                    }
                    // The last valid REGISTER's APTPL governs (SPC-4 5.14.5).
                    s.aptpl = aptpl;
                    self.register(s, &it, registered, sa_key)
                }
                _ if registered != Some(key) => Err(Stop::Conflict),
                SA_PR_RESERVE => s.reserve(&it, pr_type),
                SA_PR_RELEASE => self.release(s, &it, pr_type),
                SA_PR_CLEAR => {
                    let others = s.registrants_but(&it);
                    self.clear(s, &others);
                    Ok(())
                }
                SA_PR_PREEMPT | SA_PR_PREEMPT_AND_ABORT => {
                    // Commands run to completion, so PREEMPT AND ABORT has nothing left to abort.
                    self.preempt(s, &it, sa_key, pr_type)
                }
                _ => Err(Sense::invalid_field_in_cdb(1, Some(4)).into()),
            }
        })
        .map(|()| PROUT_PARAMETER_BYTES as u32)
    }

    /// Every registration and the reservation gone; `told` are given RESERVATIONS PREEMPTED.
    fn clear(&self, s: &mut State, told: &[ItNexus]) {
        s.registrations.clear();
        s.reservation = None;
        s.generation = s.generation.wrapping_add(1);
        self.notify(s, told, RESERVATIONS_PREEMPTED);
    }

    /// Runs `change` on the reservation state as loaded (by `nexus`, if a nexus asked), saves
    /// it where it persists and raises its unit attentions; `Overtaken` when another gateway
    /// saved a change in between (nothing of this one stands: it is run again). A change that
    /// fails, or whose save fails, leaves the state as it was.
    fn change_once(
        &self,
        nexus: Option<&Nexus>,
        change: impl FnOnce(&mut State) -> Result<(), Stop>,
    ) -> Result<(), Attempt> {
        let persistence = self.reservations.persistence.get();
        let r = &self.reservations;
        let mut s = r.lock();
        let noticed = r.refresh_shared(&mut s)?;
        self.raise_now(noticed);
        s.pending_ua.clear();
        if let Some(nexus) = nexus {
            s.see(nexus);
            if s.spc2.is_some_and(|h| h != nexus.id) {
                return Err(Stop::Conflict.into());
            }
        }
        // What a failed save restores: nothing changes unless it is durable.
        let before = persistence.map(|_| s.persistent());
        let result = change(&mut s);
        if let (Ok(()), Some(persistence), Some(before)) = (&result, persistence, before) {
            if let Err(refused) = save_change(&mut s, persistence.as_ref(), &before) {
                r.update_held(&s);
                return Err(refused);
            }
        }
        if result.is_ok() {
            self.raise_pending(&mut s);
            // Raised here already (or nothing to raise): not again when read back.
            s.notices_raised = s.last_notice();
        } else {
            s.pending_ua.clear();
        }
        r.update_held(&s);
        result.map_err(Attempt::Failed)
    }

    /// Clears every registration and the reservation as PERSISTENT RESERVE OUT CLEAR does,
    /// for an operator (`ferrosan ctl device clear-reservations`): no key is needed, and every
    /// registrant is told RESERVATIONS PREEMPTED. Returns how many registrations went.
    pub fn clear_reservations(&self) -> Result<usize, Sense> {
        let mut overtaken = 0;
        loop {
            let mut cleared = 0;
            let attempt = self.change_once(None, |s| {
                cleared = s.registrations.len();
                let everyone: Vec<ItNexus> =
                    s.registrations.iter().map(|(n, _)| n.clone()).collect();
                self.clear(s, &everyone);
                Ok(())
            });
            match attempt {
                Ok(()) => return Ok(cleared),
                Err(Attempt::Overtaken) if overtaken < SAVE_ATTEMPTS_MAX => overtaken += 1,
                Err(Attempt::Overtaken) => return Err(Sense::not_ready_transition()),
                Err(Attempt::Failed(Stop::Check(sense))) => return Err(sense),
                Err(Attempt::Failed(_)) => return Err(Sense::not_ready_transition()),
            }
        }
    }

    /// REGISTER (AND IGNORE EXISTING KEY) of a nexus whose registration is `registered`:
    /// `sa_key` 0 unregisters it, another key registers it or changes its key. At
    /// [`REGISTRATIONS_MAX`], or at [`REGISTRATIONS_PER_NODE_MAX`] of its node, a new
    /// registration is refused (INSUFFICIENT REGISTRATION RESOURCES).
    fn register(
        &self,
        s: &mut State,
        it: &ItNexus,
        registered: Option<u64>,
        sa_key: u64,
    ) -> Result<(), Stop> {
        match (registered, sa_key) {
            (None, 0) => return Ok(()), // nothing to do, and no new generation
            (None, _) if s.registrations.len() >= REGISTRATIONS_MAX => {
                return Err(insufficient_registration_resources().into());
            }
            (None, _)
                if s.registrations
                    .iter()
                    .filter(|(r, _)| r.node().eq_ignore_ascii_case(it.node()))
                    .count()
                    >= REGISTRATIONS_PER_NODE_MAX =>
            {
                return Err(insufficient_registration_resources().into());
            }
            (None, k) => s.registrations.push((it.clone(), k)),
            (Some(_), 0) => {
                let notify = s.unregister(it);
                self.notify(s, &notify, RESERVATIONS_RELEASED);
            }
            (Some(_), k) => {
                if let Some(e) = s.registrations.iter_mut().find(|(r, _)| r == it) {
                    e.1 = k;
                }
            }
        }
        s.generation = s.generation.wrapping_add(1);
        Ok(())
    }

    /// RELEASE by the holder: the reservation goes (its registrants told when they shared
    /// it); a type other than the reservation's is INVALID RELEASE OF PERSISTENT RESERVATION.
    /// No reservation, or one another nexus holds: GOOD, nothing changes.
    fn release(&self, s: &mut State, it: &ItNexus, pr_type: u8) -> Result<(), Stop> {
        let Some(res) = s.reservation.clone().filter(|_| s.is_holder(it)) else {
            return Ok(());
        };
        if res.pr_type != pr_type {
            return Err(Sense::new(crate::sense::ILLEGAL_REQUEST, 0x26, 0x04).into());
        }
        s.reservation = None;
        if registrants_only(res.pr_type) || all_registrants(res.pr_type) {
            let others = s.registrants_but(it);
            self.notify(s, &others, RESERVATIONS_RELEASED);
        }
        Ok(())
    }

    /// Lets APTPL=1 be accepted: the reservation state goes to `persistence` while it is set.
    /// Once per LU (a second call changes nothing and returns false).
    pub fn set_pr_persistence(&self, persistence: Arc<dyn PrPersistence>) -> bool {
        self.reservations.persistence.set(persistence).is_ok()
    }

    /// Loads reservations saved with APTPL (at start, before any command). A saved state
    /// whose APTPL is off is not restored.
    pub fn restore_reservations(&self, saved: &PersistentReservations) {
        if !saved.aptpl {
            return;
        }
        let r = &self.reservations;
        let mut s = r.lock();
        s.set_persistent(saved);
        s.notices_raised = s.last_notice();
        r.update_held(&s);
    }

    /// Replaces the reservation state with `stored`, APTPL or not: an image's state as it is
    /// opened. (Following it later is [`LogicalUnit::follow_shared_reservations`]: a copy
    /// read outside the lock may predate a change made meanwhile.)
    /// The unit attentions of changes made through another target are raised here.
    pub fn replace_reservations(&self, stored: &PersistentReservations) {
        let r = &self.reservations;
        let mut s = r.lock();
        if s.persistent() != *stored {
            let raise = s.adopt(stored);
            r.update_held(&s);
            drop(s);
            self.raise_now(raise);
        }
    }

    /// Follows the shared state another gateway changed (a PERSISTENT RESERVE OUT through
    /// it): loaded under the reservations' lock, as every PERSISTENT RESERVE command loads it,
    /// so a copy read before a change made here is never applied after it — which undid a
    /// RESERVE until the next follow (an unregistered host wrote through a Write Exclusive –
    /// Registrants Only reservation) or brought back a preempted key. A store that cannot be
    /// read leaves the state as it is (the next command fails until it can).
    pub fn follow_shared_reservations(&self) {
        let r = &self.reservations;
        let mut s = r.lock();
        let raise = r.refresh_shared(&mut s).unwrap_or_default();
        drop(s);
        self.raise_now(raise);
    }

    /// The reservation state as it would be saved.
    pub fn persistent_reservations(&self) -> PersistentReservations {
        self.reservations.lock().persistent()
    }

    fn preempt(&self, s: &mut State, it: &ItNexus, sa_key: u64, pr_type: u8) -> Result<(), Stop> {
        let reservation = s.reservation.clone();
        let holder_key = reservation
            .as_ref()
            .filter(|r| !all_registrants(r.pr_type))
            .and_then(|r| s.key_of(&r.holder));
        let preempts_reservation = match &reservation {
            Some(r) if all_registrants(r.pr_type) => sa_key == 0,
            Some(_) => holder_key == Some(sa_key),
            None => false,
        };
        if sa_key == 0 && !preempts_reservation {
            return Err(Sense::invalid_field_in_parameter_list(8, None).into());
        }
        // The registrations removed: every one with the key (with an all-registrants
        // reservation and key 0: everyone else), never the preempting nexus itself.
        let removed: Vec<ItNexus> = s
            .registrations
            .iter()
            .filter(|(n, k)| n != it && (*k == sa_key || (sa_key == 0 && preempts_reservation)))
            .map(|(n, _)| n.clone())
            .collect();
        if removed.is_empty() && !preempts_reservation {
            return Err(Stop::Conflict);
        }
        s.registrations.retain(|(n, _)| !removed.contains(n));
        if preempts_reservation {
            let old_type = reservation.map(|r| r.pr_type);
            s.reservation = Some(Reservation {
                holder: it.clone(),
                pr_type,
            });
            if old_type != Some(pr_type) {
                let others: Vec<ItNexus> = s
                    .registrations
                    .iter()
                    .map(|(n, _)| n.clone())
                    .filter(|n| n != it)
                    .collect();
                self.notify(s, &others, RESERVATIONS_RELEASED);
            }
        }
        self.notify(s, &removed, REGISTRATIONS_PREEMPTED);
        s.generation = s.generation.wrapping_add(1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_matrix() {
        use Class::*;
        // (type, class, registered) -> conflicts, for a nexus not holding the reservation.
        let cases = [
            (TYPE_WE, Read, false, false),
            (TYPE_WE, Write, false, true),
            (TYPE_WE, Read, true, false),
            (TYPE_WE, Write, true, true),
            (TYPE_EA, Read, false, true),
            (TYPE_EA, Write, true, true),
            (TYPE_EA, Read, true, true),
            (TYPE_WE_RO, Read, false, false),
            (TYPE_WE_RO, Write, false, true),
            (TYPE_WE_RO, Write, true, false),
            (TYPE_EA_RO, Read, false, true),
            (TYPE_EA_RO, Read, true, false),
            (TYPE_EA_RO, Write, true, false),
            (TYPE_WE_AR, Read, false, false),
            (TYPE_WE_AR, Write, false, true),
            (TYPE_WE_AR, Write, true, false),
            (TYPE_EA_AR, Read, false, true),
            (TYPE_EA_AR, Write, false, true),
            (TYPE_EA_AR, Read, true, false),
        ];
        for (t, c, reg, conflict) in cases {
            assert_eq!(pr_conflicts(t, c, reg), conflict, "{t} {c:?} {reg}");
        }
        for t in [
            TYPE_WE, TYPE_EA, TYPE_WE_RO, TYPE_EA_RO, TYPE_WE_AR, TYPE_EA_AR,
        ] {
            assert!(!pr_conflicts(t, Always, false));
        }
    }

    #[test]
    fn command_classes() {
        assert_eq!(class(Cdb(&[INQUIRY])), Class::Always);
        assert_eq!(class(Cdb(&[TEST_UNIT_READY])), Class::Always);
        assert_eq!(class(Cdb(&[SERVICE_ACTION_IN_16, 0x10])), Class::Always);
        assert_eq!(class(Cdb(&[SERVICE_ACTION_IN_16, 0x12])), Class::Read);
        assert_eq!(class(Cdb(&[READ_10])), Class::Read);
        assert_eq!(class(Cdb(&[MODE_SENSE_6])), Class::Read);
        assert_eq!(class(Cdb(&[WRITE_10])), Class::Write);
        assert_eq!(class(Cdb(&[SYNCHRONIZE_CACHE_10])), Class::Write);
        assert_eq!(class(Cdb(&[MODE_SELECT_6])), Class::Write);
        assert_eq!(class(Cdb(&[RESERVE_6])), Class::Write);
        assert_eq!(
            class(Cdb(&[PREVENT_ALLOW_MEDIUM_REMOVAL, 0, 0, 0, 1])),
            Class::Write
        );
        assert_eq!(
            class(Cdb(&[PREVENT_ALLOW_MEDIUM_REMOVAL, 0, 0, 0, 0])),
            Class::Always
        );
    }
}
