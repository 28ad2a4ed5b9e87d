//! The logical unit: all per-LU state and the command dispatcher.

use crate::cdb::*;
use crate::mode::ModeState;
use crate::opcodes;
use crate::sense::{Sense, Stop};
use crate::unit_attention::{self, UnitAttentions};
use crate::{Command, Completion, Nexus};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use store::BlockStore;

/// What the LU reports about itself in INQUIRY and VPD pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuIdentity {
    /// T10 vendor identification, at most 8 ASCII characters ("FERROSAN").
    pub vendor: String,
    /// At most 16 ASCII characters.
    pub product: String,
    /// At most 4 ASCII characters.
    pub revision: String,
    /// Unit serial number (VPD 80h), printable ASCII, at most 64 characters.
    pub serial: String,
    /// NAA designator (VPD 83h); only the first `naa_len` bytes are used.
    pub naa: [u8; 16],
    /// 8 (NAA 5, registered) or 16 (NAA 6, registered extended).
    pub naa_len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LuSettings {
    /// 512 or 4096.
    pub block_size: u32,
    pub read_only: bool,
    /// Initial (and default) WCE bit of the caching mode page.
    pub write_cache: bool,
    /// Thin provisioned: UNMAP, WRITE SAME with UNMAP, LBPME/LBPRZ, GET LBA STATUS mapping.
    pub thin: bool,
}

impl Default for LuSettings {
    fn default() -> Self {
        LuSettings {
            block_size: 512,
            read_only: false,
            write_cache: true,
            thin: true,
        }
    }
}

/// Limits reported in the Block Limits VPD page and enforced on every command.
pub(crate) const TRANSFER_BYTES_MAX: u32 = 8 << 20;
pub(crate) const TRANSFER_BYTES_OPTIMAL: u32 = 1 << 20;
/// In blocks: libiscsi treats more than 2^20 as implausible, and it bounds a thick zero-fill.
pub(crate) const UNMAP_BLOCKS_MAX: u32 = 1 << 20;
pub(crate) const UNMAP_DESCRIPTORS_MAX: u32 = 256;
/// In blocks. Bounds the work of one command (at most 32 MiB at 512-byte blocks); below 2^16 so
/// libiscsi's WriteSame16.Unmap does not follow its 65536-block check with a 65536-block WRITE
/// (16), which would exceed the maximum transfer length.
pub(crate) const WRITE_SAME_BLOCKS_MAX: u32 = 0xFFFF;
pub(crate) const COMPARE_AND_WRITE_BLOCKS_MAX: u8 = 128;
/// WRITE ATOMIC (16) takes the LU's write lock exclusively, so any transfer the LU accepts is
/// atomic: the limit is the maximum transfer length, with no alignment or granularity rule.
pub(crate) const ATOMIC_BYTES_MAX: u32 = TRANSFER_BYTES_MAX;
/// Discard is exact to 4 KiB on every store (file hole punching works in filesystem blocks).
pub(crate) const UNMAP_GRANULARITY_BYTES: u32 = 4096;
/// Reported physical block size (READ CAPACITY (16)); equal to the UNMAP granularity.
pub(crate) const PHYSICAL_BLOCK_BYTES: u32 = 4096;
/// Whether READ CAPACITY (16) reports `PHYSICAL_BLOCK_BYTES` (see `physical_block_exponent`).
pub(crate) const REPORT_PHYSICAL_BLOCK: bool = false;

pub struct LogicalUnit {
    pub(crate) store: Arc<dyn BlockStore>,
    /// Replaced whole by [`LogicalUnit::set_identity`] (the NAA designator never changes).
    identity: parking_lot::RwLock<Arc<LuIdentity>>,
    /// Fixed for the LU's life, except `read_only` and `write_cache`, which live in
    /// `read_only` and `mode.default_wce` (the operator changes them on a running LU).
    pub(crate) settings: LuSettings,
    /// The device is write-protected (the operator's `read_only`, changeable live).
    read_only: AtomicBool,
    pub(crate) block_shift: u32,
    pub(crate) mode: ModeState,
    pub(crate) ua: UnitAttentions,
    /// Nexuses holding PREVENT MEDIUM REMOVAL.
    prevent: Mutex<HashSet<u64>>,
    /// Writers share it; COMPARE AND WRITE takes it exclusively so its read-compare-write is
    /// atomic against every other writer of this LU. An asynchronous write holds its share
    /// until the device answers (see [`crate::Plan`]), hence an `Arc` and owned guards.
    pub(crate) write_order: Arc<parking_lot::RwLock<()>>,
    /// Persistent and SPC-2 reservations.
    pub(crate) reservations: crate::pr::Reservations,
    /// SPC-2 RESERVE/RELEASE offered (see `set_spc2_reservations`).
    spc2_reservations: AtomicBool,
    /// COPY STATUS of finished EXTENDED COPY commands with LIST ID USAGE 00b, by nexus and list
    /// identifier; discarded when reported or when the nexus goes.
    pub(crate) copy_results: Mutex<HashMap<(u64, u8), crate::xcopy::CopyRecord>>,
    /// Commands that may still reach the medium; task management waits for them.
    in_flight: Arc<crate::inflight::InFlight>,
    /// Taken offline by the operator: commands that need the medium answer NOT READY,
    /// LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED (04h/03h) until it is back.
    offline: AtomicBool,
    /// Its saved reservation state could not be loaded: serving it could let a host the
    /// lost registrations fenced write, so commands that need the medium answer NOT READY,
    /// MANUAL INTERVENTION REQUIRED (04h/03h) for the LU's life.
    fenced: AtomicBool,
    /// Explicit ALUA across gateways (see [`crate::Ownership`]); unset: the target port
    /// groups' configured states apply and nothing is refused.
    ownership: std::sync::OnceLock<Arc<dyn crate::Ownership>>,
}

fn check_identity(identity: &LuIdentity) -> Result<(), String> {
    check_ascii("vendor", &identity.vendor, 8)?;
    check_ascii("product", &identity.product, 16)?;
    check_ascii("revision", &identity.revision, 4)?;
    check_ascii("serial", &identity.serial, 64)?;
    if identity.serial.is_empty() {
        return Err("serial must not be empty".into());
    }
    if identity.naa_len != 8 && identity.naa_len != 16 {
        return Err(format!("NAA length {}: must be 8 or 16", identity.naa_len));
    }
    Ok(())
}

fn check_ascii(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.len() > max || !s.bytes().all(|b| (0x20..0x7F).contains(&b)) {
        return Err(format!(
            "{what} {s:?}: at most {max} printable ASCII characters"
        ));
    }
    Ok(())
}

/// Whether a command changes what every initiator sees of the LU, not only what its own
/// nexus sees ([`crate::facts::Facts::changes_lu_state`]). Refused through a read-only
/// mapping: read access is not a say in how others may write.
fn changes_lu_state(cdb: Cdb<'_>) -> bool {
    crate::facts::facts(cdb).changes_lu_state
}

/// Where a command that passed [`LogicalUnit::gate`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// On this gateway's own LU.
    Here,
    /// On the LU's owner, through another gateway (I/O shipping).
    Owner,
}

impl LogicalUnit {
    pub fn new(
        store: Arc<dyn BlockStore>,
        identity: LuIdentity,
        settings: LuSettings,
    ) -> Result<Self, String> {
        let block_shift = match settings.block_size {
            512 => 9,
            4096 => 12,
            other => {
                return Err(format!(
                    "block size {other}: only 512 and 4096 are supported"
                ))
            }
        };
        if store.size_bytes() < u64::from(settings.block_size) {
            return Err(format!(
                "store of {} bytes holds no block",
                store.size_bytes()
            ));
        }
        check_identity(&identity)?;
        Ok(LogicalUnit {
            store,
            identity: parking_lot::RwLock::new(Arc::new(identity)),
            read_only: AtomicBool::new(settings.read_only),
            mode: ModeState::new(settings.write_cache),
            settings,
            block_shift,
            ua: UnitAttentions::default(),
            prevent: Mutex::new(HashSet::new()),
            write_order: Arc::new(parking_lot::RwLock::new(())),
            reservations: crate::pr::Reservations::default(),
            spc2_reservations: AtomicBool::new(false),
            copy_results: Mutex::new(HashMap::new()),
            in_flight: Arc::default(),
            offline: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            ownership: std::sync::OnceLock::new(),
        })
    }

    /// Puts the LU under explicit ALUA (once; later calls are ignored): `ownership` says which
    /// target port group owns it, every other group is standby, and SET TARGET PORT GROUPS
    /// moves it.
    pub fn set_ownership(&self, ownership: Arc<dyn crate::Ownership>) {
        let _ = self.ownership.set(ownership);
    }

    /// Sets what is told whenever this LU changes in a way every host must learn (see
    /// [`crate::Changed`]); once, later calls are ignored.
    pub fn on_change(&self, changed: crate::Changed) {
        self.ua.on_change(changed);
    }

    pub(crate) fn ownership(&self) -> Option<&Arc<dyn crate::Ownership>> {
        self.ownership.get()
    }

    /// The asymmetric access state of this LU through target port group `group`, whose
    /// configured state is `configured`.
    pub fn access_state(&self, group: u16, configured: crate::AccessState) -> crate::AccessState {
        match self.ownership.get() {
            None => configured,
            Some(o) if o.transitioning(group) => crate::AccessState::Transitioning,
            Some(o) if o.is_active(group) => crate::AccessState::ActiveOptimized,
            Some(o) if o.non_owners_ship() => crate::AccessState::ActiveNonOptimized,
            Some(_) => crate::AccessState::Standby,
        }
    }

    /// Raises ASYMMETRIC ACCESS STATE CHANGED for every nexus but `except` (the engine calls it
    /// when the owner changed elsewhere).
    pub fn access_state_changed(&self, except: Option<u64>) {
        self.ua
            .raise_all(crate::alua::UA_ACCESS_STATE_CHANGED, except);
    }

    /// The settings now (`read_only` and `write_cache` as the operator last set them).
    pub fn settings(&self) -> LuSettings {
        LuSettings {
            read_only: self.read_only.load(Ordering::Relaxed),
            write_cache: self.mode.default_wce.load(Ordering::Relaxed),
            ..self.settings
        }
    }
    /// What INQUIRY reports now.
    pub fn identity(&self) -> Arc<LuIdentity> {
        Arc::clone(&self.identity.read())
    }

    /// The operator changed the device's write cache: the default and current WCE both
    /// become `on` (an initiator's MODE SELECT is overridden) and every nexus gets MODE
    /// PARAMETERS CHANGED (2Ah/01h). Turning it off first makes what was written durable:
    /// a write acknowledged from the cache before stays acknowledged. Returns whether the
    /// setting changed.
    pub fn set_write_cache(&self, on: bool) -> std::io::Result<bool> {
        let was_default = self.mode.default_wce.swap(on, Ordering::SeqCst);
        let was_current = self.mode.wce.swap(on, Ordering::SeqCst);
        if !on && was_current {
            self.store.flush()?;
        }
        let changed = was_default != on || was_current != on;
        if changed {
            self.ua
                .raise_all(unit_attention::MODE_PARAMETERS_CHANGED, None);
        }
        Ok(changed)
    }

    /// The operator write-protects the device (`true`) or lifts it: medium writes admitted
    /// from now get DATA PROTECT; every nexus gets MODE PARAMETERS CHANGED (2Ah/01h), the
    /// WP bit being in the mode parameter header. Returns whether it changed.
    pub fn set_read_only(&self, on: bool) -> bool {
        let changed = self.read_only.swap(on, Ordering::SeqCst) != on;
        if changed {
            self.ua
                .raise_all(unit_attention::MODE_PARAMETERS_CHANGED, None);
        }
        changed
    }

    /// The operator renamed the device's vendor, product or serial: INQUIRY reports `new`
    /// from now and every nexus gets INQUIRY DATA HAS CHANGED (3Fh/03h). The NAA designator
    /// names the LU to multipath and to EXTENDED COPY: it cannot change. Returns whether
    /// anything changed.
    pub fn set_identity(&self, new: LuIdentity) -> Result<bool, String> {
        check_identity(&new)?;
        let mut identity = self.identity.write();
        if identity.naa[..identity.naa_len] != new.naa[..new.naa_len] {
            return Err("the NAA designator of a running LU cannot change".into());
        }
        if **identity == new {
            return Ok(false);
        }
        *identity = Arc::new(new);
        drop(identity);
        self.inquiry_data_changed();
        Ok(true)
    }
    /// Its commands in flight: a command holds a guard from here while it runs (see
    /// [`crate::inflight`]).
    pub fn in_flight(&self) -> &Arc<crate::inflight::InFlight> {
        &self.in_flight
    }
    /// What the store behind this LU can do (the engine plans from it).
    pub fn capabilities(&self) -> store::Capabilities {
        self.store.capabilities()
    }
    /// The writes its store answered early and still owes the medium (see
    /// [`store::BlockStore::write_back`]).
    pub fn write_back(&self) -> Option<store::WriteBack> {
        self.store.write_back()
    }
    /// The store's O_DIRECT descriptor, for a transport that submits planned I/O itself
    /// ([`crate::Plan`]); None unless the store does direct I/O.
    pub fn direct_io(&self) -> Option<store::DirectIo> {
        self.store.direct_io()
    }
    /// Starts a planned read, write or flush on the store ([`crate::Plan`]), for a transport
    /// whose LU's store says [`store::Capabilities::asynchronous`]: `done` is called once, on
    /// the store's thread, with the buffer and the outcome for [`LogicalUnit::finish`].
    pub fn submit(&self, io: store::AsyncIo, buf: Vec<u8>, done: store::AsyncDone) {
        self.store.submit(io, buf, done)
    }
    /// The store's size in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.store.size_bytes()
    }
    /// The medium's size now, in whole blocks of this LU (a file or device grown underneath
    /// shows here before [`LogicalUnit::resize`] takes it); None for RAM.
    pub fn medium_bytes(&self) -> std::io::Result<Option<u64>> {
        let block = u64::from(self.settings.block_size);
        Ok(self.store.medium_bytes()?.map(|b| b - b % block))
    }
    /// Makes everything written so far durable (the store's flush), as SYNCHRONIZE CACHE does;
    /// the daemon calls it for every LU when it shuts down.
    pub fn flush(&self) -> std::io::Result<()> {
        self.store.flush()
    }
    /// Runs `f` while no write of this LU runs: the writes in flight finish first (each holds
    /// its share of the write order until its device answered, as COMPARE AND WRITE waits for
    /// them), new ones wait until `f` returns, and what was written is flushed before `f`
    /// runs. A snapshot taken in `f` holds every write acknowledged before and none after.
    pub fn quiesced<R>(&self, f: impl FnOnce() -> R) -> std::io::Result<R> {
        let _all = self.write_order.write();
        self.store.flush()?;
        Ok(f())
    }
    /// Releases the store at shutdown, after the last flush ([`store::BlockStore::close`]).
    pub fn close(&self) {
        self.store.close()
    }
    /// Current WCE bit (write-back caching enabled).
    pub fn write_cache_enabled(&self) -> bool {
        self.mode.wce.load(Ordering::Relaxed)
    }

    /// Whether `cdb` makes this LU wait for its device to make data durable: write-through or
    /// FUA writes, cache flushes, the commands that write or deallocate as a side effect, and
    /// PERSISTENT RESERVE OUT where reservations are saved.
    /// A transport uses it to run such commands off its network threads (on a store where
    /// durability costs nothing, e.g. RAM, it need not ask).
    pub fn waits_for_device(&self, cdb: &[u8]) -> bool {
        use crate::facts::Durability;
        let fua = cdb.get(1).is_some_and(|b| b & 0x08 != 0);
        let write_back = self.write_cache_enabled();
        match crate::facts::facts(Cdb(cdb)).durability {
            Durability::None => false,
            Durability::UnlessWriteBack => !write_back,
            Durability::UnlessWriteBackOrFua => !write_back || fua,
            Durability::Always => true,
            // SET TARGET PORT GROUPS takes the LU over: a cluster round trip or several;
            // REPORT TARGET PORT GROUPS waits for a takeover through its group to end.
            Durability::Ownership => self.ownership.get().is_some(),
            // With APTPL the new state is saved (and fsynced) before it completes.
            Durability::Reservations => self.reservations.persists(),
            // Shared reservations are read from their store first.
            Durability::SharedReservations => self.reservations.shared(),
        }
    }

    /// Whether `cdb` is a plain write the store's cache absorbs (write-back, no FUA): cheap
    /// unless the page cache makes it wait, which a transport may time (see `waits_for_device`).
    pub fn is_buffered_write(&self, cdb: &[u8]) -> bool {
        crate::facts::facts(Cdb(cdb)).plain_write && !self.waits_for_device(cdb)
    }

    /// LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT (READ CAPACITY (16)). The stores work in
    /// 4 KiB units, so a 512-byte LU could report 2^3 blocks per physical block; it reports
    /// 2^0 while `REPORT_PHYSICAL_BLOCK` is off, because libiscsi 1.19's
    /// GetLBAStatus.UnmapSingle asks for LBA i+1 and then demands a first descriptor at
    /// i+LBPPB (right only when LBPPB is 1): reporting 8 turns 15 skips into passes but that
    /// test into a failure.
    pub(crate) fn physical_block_exponent(&self) -> u8 {
        if !REPORT_PHYSICAL_BLOCK {
            return 0;
        }
        (PHYSICAL_BLOCK_BYTES
            .trailing_zeros()
            .saturating_sub(self.block_shift)) as u8
    }
    pub(crate) fn block_count(&self) -> u64 {
        self.store.size_bytes() >> self.block_shift
    }

    /// A new I_T nexus: it gets POWER ON, RESET (29h/00h) on its first command.
    pub fn nexus_added(&self, nexus_id: u64) {
        self.ua.add_nexus(nexus_id);
    }

    /// A nexus that joined at `joined` ([`crate::unit_attention::stamp`]) and whose LUN map
    /// last changed at `map_changed` addresses this LU for the first time: it gets POWER ON,
    /// RESET, then what was raised for every nexus since it joined (see
    /// [`crate::unit_attention::UnitAttentions::join_since`]).
    pub fn nexus_first_use(&self, nexus_id: u64, joined: u64, map_changed: Option<u64>) {
        self.ua.join_since(nexus_id, joined, map_changed);
    }

    /// The nexus is gone: drop its unit attentions, release its PREVENT MEDIUM REMOVAL and its
    /// SPC-2 reservation (persistent reservations and registrations stay).
    pub fn nexus_lost(&self, nexus_id: u64) {
        if let Some(o) = self.ownership.get() {
            o.nexus_lost(nexus_id);
        }
        self.ua.remove_nexus(nexus_id);
        self.reservations.nexus_lost(nexus_id);
        self.drop_copy_results(nexus_id);
        self.prevent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&nexus_id);
    }

    /// LOGICAL UNIT RESET task management function: 29h/03h for every nexus, PREVENT cleared,
    /// SPC-2 reservation released, mode parameters back to their defaults. Persistent
    /// reservations survive (SPC-4 5.13.1).
    pub fn logical_unit_reset(&self, by: u64) {
        self.reset_with(by, unit_attention::LU_RESET);
    }

    /// This LU's part of a TARGET WARM/COLD RESET: the same as `logical_unit_reset`, but the
    /// unit attention is the generic POWER ON, RESET, OR BUS DEVICE RESET OCCURRED (29h/00h),
    /// which is what libiscsi's RESERVE(6) helper accepts after a target reset (its
    /// Reserve6.LUNReset runs right after Reserve6.TargetWarmReset on the same session).
    pub fn target_reset(&self, by: u64) {
        self.reset_with(by, unit_attention::POWER_ON_RESET);
    }

    fn reset_with(&self, by: u64, ua: (u8, u8)) {
        let _ = by; // SAM-5: the UA goes to every nexus, the requester's included.
        self.reservations.reset();
        self.prevent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.mode.reset();
        self.ua.raise_all(ua, None);
    }

    /// Grows the LU to `new_bytes` (a whole number of blocks) and raises CAPACITY DATA HAS
    /// CHANGED for every nexus. The store refuses to shrink, and says if it cannot grow.
    pub fn resize(&self, new_bytes: u64) -> Result<(), String> {
        if !new_bytes.is_multiple_of(u64::from(self.settings.block_size)) {
            return Err(format!(
                "{new_bytes} bytes is not a whole number of {}-byte blocks",
                self.settings.block_size
            ));
        }
        if new_bytes == self.store.size_bytes() {
            return Ok(());
        }
        self.store.resize(new_bytes).map_err(|e| e.to_string())?;
        self.capacity_changed();
        Ok(())
    }

    /// Takes the LU offline (`true`) or back online. Offline, every command but INQUIRY,
    /// REPORT LUNS, REQUEST SENSE and the MAINTENANCE IN reports answers NOT READY, LOGICAL
    /// UNIT NOT READY, MANUAL INTERVENTION REQUIRED (04h/03h, [`Sense::not_ready_offline`]); commands admitted before keep running (the caller
    /// waits for [`LogicalUnit::in_flight`] to drain before it touches the medium). Back
    /// online, every nexus gets NOT READY TO READY CHANGE (28h/00h): the medium may have
    /// changed meanwhile. Returns whether the state changed.
    pub fn set_offline(&self, offline: bool) -> bool {
        let was = self.offline.swap(offline, Ordering::SeqCst);
        if was && !offline {
            self.ua.raise_all(unit_attention::NOT_READY_TO_READY, None);
        }
        was != offline
    }

    /// Fences the LU for good (see `fenced`): its reservation state is unknown.
    pub fn fence(&self) {
        self.fenced.store(true, Ordering::SeqCst);
    }

    /// Why the LU's medium may not be used now, if it may not: fenced, or offline.
    fn not_ready(&self) -> Option<Sense> {
        if self.fenced.load(Ordering::Relaxed) {
            Some(Sense::not_ready_manual_intervention())
        } else if self.offline.load(Ordering::Relaxed) {
            Some(Sense::not_ready_offline())
        } else {
            None
        }
    }

    /// Whether the LU is offline (see [`LogicalUnit::set_offline`]).
    pub fn is_offline(&self) -> bool {
        self.offline.load(Ordering::Relaxed)
    }

    /// REPORTED LUNS DATA HAS CHANGED (3Fh/0Eh) for one nexus: the LUN map it sees this LU
    /// through changed.
    pub fn reported_luns_changed_for(&self, nexus_id: u64) {
        self.ua
            .raise_one(nexus_id, unit_attention::REPORTED_LUNS_CHANGED);
    }

    /// The store's size changed: CAPACITY DATA HAS CHANGED (2Ah/09h) for every nexus.
    pub fn capacity_changed(&self) {
        self.ua.raise_all(unit_attention::CAPACITY_CHANGED, None);
    }

    /// How full the space the store allocates from is (None: it allocates nothing).
    pub fn space(&self) -> std::io::Result<Option<store::Space>> {
        self.store.space()
    }

    /// The space the store allocates from went past the operator's threshold: THIN
    /// PROVISIONING SOFT THRESHOLD REACHED (38h/07h) for every nexus, once.
    pub fn space_threshold_reached(&self) {
        self.ua.raise_all(
            unit_attention::THIN_PROVISIONING_SOFT_THRESHOLD_REACHED,
            None,
        );
    }

    /// The LUN inventory seen through a map holding this LU changed: REPORTED LUNS DATA HAS
    /// CHANGED (3Fh/0Eh) for every nexus.
    pub fn reported_luns_changed(&self) {
        self.ua
            .raise_all(unit_attention::REPORTED_LUNS_CHANGED, None);
    }

    /// Identity or settings visible in INQUIRY changed: INQUIRY DATA HAS CHANGED (3Fh/03h).
    pub fn inquiry_data_changed(&self) {
        self.ua
            .raise_all(unit_attention::INQUIRY_DATA_CHANGED, None);
    }

    fn offered(&self) -> opcodes::Offered {
        opcodes::Offered {
            thin: self.settings.thin,
            spc2_reservations: self.spc2_reservations.load(Ordering::Relaxed),
            explicit_alua: self.explicit_alua(),
        }
    }

    /// Whether initiators may move this LU (explicit ALUA: TPGS = 11b, SET TARGET PORT GROUPS
    /// offered): an LU whose owner says so. INQUIRY, the opcode table and SET TARGET PORT
    /// GROUPS ask here.
    pub(crate) fn explicit_alua(&self) -> bool {
        self.ownership.get().is_some_and(|o| o.explicit())
    }

    /// Offers SPC-2 RESERVE/RELEASE (6) and (10), off by default: they work (conflicts, release
    /// on RELEASE, nexus loss, LU reset and target reset, exclusion with persistent
    /// reservations), but libiscsi 1.19's Reserve6.LUNReset logs a failure when the preceding
    /// Reserve6.TargetWarmReset leaves its own nexus the 29h/03h unit attention of
    /// `logical_unit_reset`: its RESERVE(6) helper tolerates only 29h/00h. A transport that
    /// resets LUs with `target_reset` for TARGET WARM/COLD RESET can switch them on. While off
    /// they answer INVALID COMMAND OPERATION CODE and are not listed in REPORT SUPPORTED
    /// OPERATION CODES.
    pub fn set_spc2_reservations(&self, on: bool) {
        self.spc2_reservations.store(on, Ordering::Relaxed);
    }

    /// Current PRgeneration of the persistent reservations.
    pub fn pr_generation(&self) -> u32 {
        self.reservations.generation()
    }

    /// Whether some persistent or SPC-2 reservation is held on the LU.
    pub fn reservation_held(&self) -> bool {
        self.reservations.is_held()
    }

    /// Whether `nexus_id` holds PREVENT MEDIUM REMOVAL (for tests and diagnostics).
    pub fn removal_prevented_by(&self, nexus_id: u64) -> bool {
        self.prevent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&nexus_id)
    }

    /// Runs one command. `data_in` is cleared and filled with the Data-In bytes (never more than
    /// `cmd.data_in_limit`); the caller reuses it so the fast path does not allocate. May wait
    /// for the device.
    pub fn execute(&self, nexus: &Nexus, cmd: &Command<'_>, data_in: &mut Vec<u8>) -> Completion {
        waited(self.execute_io(nexus, cmd, data_in, None, false, None))
    }

    /// Runs one command; `peers` is the map the LU was reached through (EXTENDED COPY finds its
    /// other copy targets there). `io` decides how reads move data: `None` copies into `data_in`
    /// and may wait; `Some(lending)` lends a cached file range or store memory where the store
    /// allows (zero-copy) and never waits for the device: a read whose data is not cached returns
    /// `None`, with no effect, for the caller to run with `execute` where waiting is fine.
    pub(crate) fn execute_io(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
        mut io: Option<&mut crate::Lending<'_>>,
        read_only_mapping: bool,
        peers: Option<&crate::LunMap>,
    ) -> Option<Completion> {
        // A read overwrites the whole buffer, so it keeps the bytes of the previous command to
        // avoid zero-filling up to a megabyte before copying over it; everything else starts
        // from an empty buffer.
        if crate::io_kind(cmd.cdb) != crate::IoKind::Read {
            data_in.clear();
        }
        let result = self.run(
            nexus,
            cmd,
            data_in,
            io.as_deref_mut(),
            read_only_mapping,
            peers,
        );
        if result.is_err() {
            data_in.clear();
            if let Some(lending) = io {
                lending.slices.clear();
                *lending.file = None;
            }
        }
        match result {
            Err(Stop::WouldWait) => None,
            Err(Stop::Ship) => Some(self.ship(nexus, cmd, data_in)),
            result => Some(self.completion(result)),
        }
    }

    /// Whether `nexus` existed when this gateway lost the LU to another (see
    /// [`crate::Ownership::nexus_outlived_ownership`]): its session should end.
    pub fn nexus_outlived_ownership(&self, nexus: &Nexus) -> bool {
        self.ownership
            .get()
            .is_some_and(|o| o.nexus_outlived_ownership(nexus.id))
    }

    /// Whether a command of `nexus` is run by the LU's owner through another gateway (I/O
    /// shipping, see [`crate::Ownership::ship`]): a transport runs it where waiting for the
    /// network is fine.
    pub fn ships_to_owner(&self, nexus: &Nexus, cdb: &[u8]) -> bool {
        self.ownership.get().is_some_and(|o| {
            !o.is_active(nexus.target_port.group)
                && o.ships()
                && !crate::alua::standby_allows(Cdb(cdb))
        })
    }

    /// This LU's own checks of a command [`LogicalUnit::ships_to_owner`] (unit attention,
    /// opcode, write protection), for a transport that ships without waiting: `Ok` when the
    /// owner is to run it ([`LogicalUnit::ship_then`]); otherwise its answer here — a failed
    /// check, or NOT READY, ASYMMETRIC ACCESS STATE TRANSITION when this gateway took the LU
    /// over meanwhile (the initiator retries and it runs here).
    pub fn admit_for_owner(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        read_only_mapping: bool,
    ) -> Result<(), Completion> {
        match self.admit(nexus, cmd, read_only_mapping) {
            Err(Stop::Ship) => Ok(()),
            Err(stop) => Err(self.completion(Err(stop))),
            Ok(_) => Err(path_check_answer(
                cmd.cdb.first().copied(),
                Completion::check_condition(Sense::not_ready_transition()),
            )),
        }
    }

    /// Runs a command [`LogicalUnit::admit_for_owner`] admitted on the owner; `done` gets its
    /// completion and Data-In (within the allowance) on a thread of the shipper's.
    pub fn ship_then(&self, nexus: &Nexus, cmd: crate::ShippedCommand, done: crate::ShipDone) {
        let Some(ownership) = self.ownership.get() else {
            return done(
                Completion::check_condition(crate::alua::STANDBY),
                Vec::new(),
            );
        };
        let limit = cmd.data_in_limit as usize;
        let opcode = cmd.cdb.first().copied();
        ownership.ship_then(
            nexus,
            cmd,
            Box::new(move |completion, mut data_in| {
                data_in.truncate(limit);
                done(path_check_answer(opcode, completion), data_in)
            }),
        );
    }

    /// Runs a command that passed this LU's checks on its owner (each nexus here has a nexus
    /// of its own there, so the owner's unit attentions reach it as they would directly).
    fn ship(&self, nexus: &Nexus, cmd: &Command<'_>, data_in: &mut Vec<u8>) -> Completion {
        let Some(ownership) = self.ownership.get() else {
            return Completion::check_condition(crate::alua::STANDBY);
        };
        data_in.clear();
        let completion = ownership.ship(nexus, cmd, data_in);
        data_in.truncate(cmd.data_in_limit as usize);
        path_check_answer(cmd.cdb.first().copied(), completion)
    }

    /// A LOGICAL UNIT RESET through a port that does not own the LU: resets it at the owner
    /// too (true when the owner confirmed). May wait for the network; false at once for an LU
    /// without a remote owner.
    pub fn reset_at_owner(&self, nexus: &Nexus) -> bool {
        match self.ownership.get() {
            Some(o) if !o.is_active(nexus.target_port.group) && o.ships() => o.reset_owner(nexus),
            _ => false,
        }
    }

    /// The checks every command passes before its own: a pending unit attention, a known
    /// opcode and CDB length, the control byte, then the LU's [`LogicalUnit::gate`]. Returns
    /// the opcode. Takes (reports) the nexus's unit attention. `read_only_mapping`: the LU is
    /// reached through a read-only mapping.
    pub(crate) fn admit(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        read_only_mapping: bool,
    ) -> Result<u8, Stop> {
        let cdb = Cdb(cmd.cdb);
        if cmd.cdb.is_empty() {
            return Err(Sense::invalid_opcode().into());
        }
        let opcode = cdb.u8(0);
        // SPC-4 5.14: INQUIRY, REPORT LUNS and REQUEST SENSE neither report nor clear one.
        if !crate::facts::facts(cdb).keeps_unit_attention {
            if let Some((asc, ascq)) = self.ua.take(nexus.id) {
                return Err(Sense::unit_attention(asc, ascq).into());
            }
        }
        let op = opcodes::lookup(cdb, self.offered())?;
        let cdb_len = op.usage.len();
        if cmd.cdb.len() < cdb_len {
            return Err(Sense::invalid_field_in_cdb(0, None).into());
        }
        // NACA and LINK are not supported (SAM-5 5.9).
        check_reserved(cdb, cdb_len - 1, 0xFA)?;
        match self.gate(nexus, cdb, read_only_mapping)? {
            Reach::Here => Ok(opcode),
            // The owner checks the rest (CDB fields, LBA range) as it runs it.
            Reach::Owner => Err(Stop::Ship),
        }
    }

    /// May `nexus` touch this LU now for `cdb`: the one gate every LU a command touches
    /// passes — the addressed LU (through [`LogicalUnit::admit`]) and every other LU of a
    /// multi-LU command such as EXTENDED COPY (as a READ or a WRITE of it). Not ready
    /// (offline, fenced), ALUA ownership, reservations, and write protection: the LU's own
    /// (`read_only`, SWP) and that of a read-only mapping (`read_only_mapping`), which also
    /// keeps its initiators from changing what others see of the LU (see
    /// [`changes_lu_state`]). The in-flight guard is the caller's to hold.
    /// `Reach::Owner`: the command is for this LU's owner through another gateway.
    pub(crate) fn gate(
        &self,
        nexus: &Nexus,
        cdb: Cdb<'_>,
        read_only_mapping: bool,
    ) -> Result<Reach, Stop> {
        let opcode = cdb.u8(0);
        let facts = crate::facts::facts(cdb);
        // SPC-4 5.12: a unit that is not ready still answers what does not need its medium.
        if !facts.when_not_ready {
            if let Some(sense) = self.not_ready() {
                return Err(sense.into());
            }
        }
        let mut reach = Reach::Here;
        match self.ownership.get() {
            Some(ownership) => {
                if ownership.transitioning(nexus.target_port.group) {
                    crate::alua::admit(crate::AccessState::Transitioning, &facts)?;
                }
                if !ownership.is_active(nexus.target_port.group) && !facts.in_standby {
                    if !ownership.ships() {
                        return Err(crate::alua::STANDBY.into());
                    }
                    reach = Reach::Owner;
                }
            }
            // Implicit ALUA: the state the configuration gives the port's group.
            None => crate::alua::admit(nexus.target_port.configured_state(), &facts)?,
        }
        // A shipped command meets the reservations at the owner, as its own initiator port
        // through this gateway's port (Ownership::ship): this gateway's copy may be stale.
        if reach == Reach::Here {
            self.reservations.check(nexus, cdb)?;
        }
        // Write protection as this gateway's mode pages and mapping say (MODE SELECT runs
        // where it arrives).
        if self.write_protected(read_only_mapping) && is_medium_write(opcode) {
            return Err(Sense::write_protected().into());
        }
        if read_only_mapping && changes_lu_state(cdb) {
            return Err(Sense::write_protected().into());
        }
        Ok(reach)
    }

    /// Whether the LU is write protected for a command that came through a mapping.
    pub(crate) fn write_protected(&self, read_only_mapping: bool) -> bool {
        read_only_mapping
            || self.read_only.load(Ordering::Relaxed)
            || self.mode.swp.load(Ordering::Relaxed)
    }

    /// The completion of a command that ran to `result` (not [`Stop::WouldWait`] or
    /// [`Stop::Ship`], which are not answers).
    pub(crate) fn completion(&self, result: Result<u32, Stop>) -> Completion {
        match result {
            Ok(transfer_len) => Completion::good(transfer_len),
            Err(Stop::Conflict) => Completion {
                status: crate::Status::ReservationConflict,
                sense: None,
                transfer_len: 0,
            },
            Err(Stop::Check(mut sense)) => {
                sense.descriptor_format = self.mode.d_sense.load(Ordering::Relaxed);
                Completion::check_condition(sense)
            }
            // Not answers: the caller runs the command elsewhere. Reaching here is an engine
            // bug; the initiator retries a transition.
            Err(Stop::WouldWait | Stop::Ship) => {
                debug_assert!(false, "a run-elsewhere outcome taken for an answer");
                Completion::check_condition(Sense::not_ready_transition())
            }
        }
    }

    fn run(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
        io: Option<&mut crate::Lending<'_>>,
        read_only_mapping: bool,
        peers: Option<&crate::LunMap>,
    ) -> Result<u32, Stop> {
        let cdb = Cdb(cmd.cdb);
        let opcode = self.admit(nexus, cmd, read_only_mapping)?;
        let write_protected = self.write_protected(read_only_mapping);
        // Arms that may stop short of an answer (would wait, reservation conflict, ship)
        // return their `Stop` at once; the rest answer with sense data.
        let answer: Result<u32, Sense> = match opcode {
            TEST_UNIT_READY => Ok(0),
            REQUEST_SENSE => self.request_sense(nexus, cmd, data_in),
            INQUIRY => self.inquiry(nexus, cmd, data_in),
            MODE_SENSE_6 | MODE_SENSE_10 => self.mode_sense(cmd, data_in, write_protected),
            MODE_SELECT_6 | MODE_SELECT_10 => self.mode_select(nexus, cmd),
            START_STOP_UNIT => self.start_stop_unit(cdb),
            PREVENT_ALLOW_MEDIUM_REMOVAL => self.prevent_allow(nexus, cdb),
            REPORT_LUNS => self.report_luns_single(cmd, data_in),
            MAINTENANCE_IN if cdb.service_action() == SA_REPORT_TARGET_PORT_GROUPS => {
                crate::alua::report_target_port_groups(self, nexus, cmd, data_in)
            }
            MAINTENANCE_OUT => crate::alua::set_target_port_groups(self, nexus, cmd),
            MAINTENANCE_IN => {
                check_reserved(cdb, 2, 0x87)?;
                opcodes::report_supported(cdb, self.offered(), data_in)?;
                Ok(finish_data_in(data_in, cdb.be32(6), cmd.data_in_limit))
            }
            READ_CAPACITY_10 => self.read_capacity_10(cmd, data_in),
            SERVICE_ACTION_IN_16 => match cdb.service_action() {
                SA_READ_CAPACITY_16 => self.read_capacity_16(cmd, data_in),
                _ => self.get_lba_status(cmd, data_in),
            },
            READ_6 | READ_10 | READ_12 | READ_16 => return self.read(cmd, data_in, io),
            WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 => return self.write(cmd, io.is_some()),
            WRITE_AND_VERIFY_10 | WRITE_AND_VERIFY_12 | WRITE_AND_VERIFY_16 => {
                self.write_and_verify(cmd)
            }
            VERIFY_10 | VERIFY_12 | VERIFY_16 => self.verify(cmd, data_in),
            SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => self.synchronize_cache(cmd),
            PRE_FETCH_10 | PRE_FETCH_16 => self.pre_fetch(cmd),
            WRITE_SAME_10 | WRITE_SAME_16 => self.write_same(cmd, data_in),
            UNMAP => self.unmap(cmd),
            COMPARE_AND_WRITE => self.compare_and_write(cmd, data_in),
            ORWRITE_16 => self.orwrite(cmd, data_in),
            WRITE_ATOMIC_16 => self.write_atomic(cmd),
            READ_DEFECT_DATA_10 | READ_DEFECT_DATA_12 => self.read_defect_data(cmd, data_in),
            RESERVE_6 | RESERVE_10 | RELEASE_6 | RELEASE_10 => {
                return self.reserve_release_spc2(nexus, cdb)
            }
            PERSISTENT_RESERVE_IN => return self.persistent_reserve_in(nexus, cmd, data_in),
            PERSISTENT_RESERVE_OUT => return self.prout_and_tell_owner(nexus, cmd),
            EXTENDED_COPY => return self.extended_copy(nexus, cmd, read_only_mapping, peers),
            RECEIVE_COPY_RESULTS => self.receive_copy_results(nexus, cmd, data_in),
            // The opcode table and this match must list the same commands.
            _ => Err(Sense::invalid_opcode()),
        };
        answer.map_err(Stop::from)
    }

    /// PERSISTENT RESERVE OUT; through a gateway that ships to the image's owner, the owner
    /// is told the reservations changed.
    fn prout_and_tell_owner(&self, nexus: &Nexus, cmd: &Command<'_>) -> Result<u32, Stop> {
        let done = self.persistent_reserve_out(nexus, cmd)?;
        if let Some(o) = self.ownership.get() {
            if !o.is_active(nexus.target_port.group) && o.ships() {
                o.reservations_changed(nexus);
            }
        }
        Ok(done)
    }

    fn request_sense(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x01)?;
        let descriptor_format = cdb.u8(1) & 0x01 != 0;
        // Autosense delivers every error with its command, so only a unit attention can be
        // pending here; reporting it clears it.
        // ... or the LU's not-ready state (SPC-4 5.12: REQUEST SENSE reports it).
        let sense = match self.ua.take(nexus.id) {
            Some((asc, ascq)) => Sense::unit_attention(asc, ascq),
            None => self
                .not_ready()
                .unwrap_or(Sense::new(crate::sense::NO_SENSE, 0, 0)),
        };
        put_sense(
            data_in,
            Sense {
                descriptor_format,
                ..sense
            },
        );
        Ok(finish_data_in(
            data_in,
            u32::from(cdb.u8(4)),
            cmd.data_in_limit,
        ))
    }

    fn start_stop_unit(&self, cdb: Cdb<'_>) -> Result<u32, Sense> {
        check_reserved(cdb, 1, 0x01)?;
        check_reserved(cdb, 3, 0x0F)?;
        check_reserved(cdb, 4, 0xF7)?;
        let power_condition = cdb.u8(4) >> 4;
        if power_condition != 0 {
            // START and LOEJ are ignored with a power condition (SBC-3 5.25); there is no
            // power state to change on a virtual disk.
            return Ok(0);
        }
        if cdb.u8(4) & 0x02 != 0 {
            // LOEJ: the medium is not removable (RMB=0).
            return Err(Sense::invalid_field_in_cdb(4, Some(1)));
        }
        let start = cdb.u8(4) & 0x01 != 0;
        let no_flush = cdb.u8(4) & 0x04 != 0;
        if !start && !no_flush {
            // Stopping writes the cache to the medium first.
            self.store
                .flush()
                .map_err(|_| Sense::medium_error_write())?;
        }
        // There is no motor: the unit stays ready, so START is a no-op.
        Ok(0)
    }

    fn prevent_allow(&self, nexus: &Nexus, cdb: Cdb<'_>) -> Result<u32, Sense> {
        check_reserved(cdb, 4, 0x03)?;
        let mut prevent = self.prevent.lock().unwrap_or_else(|p| p.into_inner());
        match cdb.u8(4) & 0x03 {
            0 => {
                prevent.remove(&nexus.id);
            }
            1 => {
                prevent.insert(nexus.id);
            }
            // 10b and 11b are obsolete (medium changer) values.
            _ => return Err(Sense::invalid_field_in_cdb(4, Some(1))),
        }
        Ok(0)
    }

    /// REPORT LUNS sent straight to an LU (no LUN map): the LU is LUN 0.
    fn report_luns_single(&self, cmd: &Command<'_>, data_in: &mut Vec<u8>) -> Result<u32, Sense> {
        crate::lun_map::report_luns(Cdb(cmd.cdb), cmd.data_in_limit, [0u64].into_iter(), data_in)
    }
}

/// Appends `sense` in its own format to `out` (REQUEST SENSE parameter data).
pub(crate) fn put_sense(out: &mut Vec<u8>, sense: Sense) {
    let mut buf = [0u8; crate::sense::SENSE_BYTES_MAX];
    let n = sense.encode(&mut buf);
    out.extend_from_slice(&buf[..n]);
}

/// The completion of an execution that was allowed to wait (`io` = `None`), which never declines.
pub(crate) fn waited(completion: Option<Completion>) -> Completion {
    completion.unwrap_or_else(|| {
        debug_assert!(false, "a blocking execution never declines to wait");
        Completion::check_condition(Sense::internal_target_failure())
    })
}

/// The answer to a shipped command, for `opcode`: a TEST UNIT READY the owner could not be
/// asked (the ship failed, NOT READY, ASYMMETRIC ACCESS STATE TRANSITION: the owner is gone or
/// changing) is GOOD -- it passed this path's own checks, and this path serves again as soon
/// as the owner answers or this gateway takes the LU over (commands that need the medium are
/// retried meanwhile). Path checkers such as multipathd's `tur` count a transition as a dead
/// path and look again only a checker interval later. Every other answer is the owner's.
fn path_check_answer(opcode: Option<u8>, completion: Completion) -> Completion {
    let ship_failed = completion.sense == Some(Sense::not_ready_transition());
    if opcode == Some(crate::cdb::TEST_UNIT_READY) && ship_failed {
        return Completion::good(0);
    }
    completion
}
