//! RBD gateways: several ferrosan daemons export one image, each as a target port group of the
//! same target. The gateway that owns the image holds RBD's exclusive lock and is
//! active/optimized; the others are active/non-optimized (they ship commands to the owner) or
//! standby. The owner's heartbeat (one object per gateway and pool, `beat`) names the images it
//! owns and moves every second; a non-owner
//! takes the image over by itself when the owner falls silent or the cluster stops hearing
//! from its client (`policy`), breaking the owner's lock, which blocklists the owner's client
//! in the cluster first: nothing the old owner still has in flight or sends later can land
//! after the takeover. The owner's name is recorded in the image's metadata so that every
//! gateway reports the same states. ALUA is implicit by default (the gateways move the image,
//! initiators follow); with `gateway_alua = "explicit"` an initiator's SET TARGET PORT GROUPS
//! takes the image only from an owner that is not known to be alive.

mod beat;
mod policy;
mod reservations;
mod takeovers;

pub use reservations::{ImageReservations, RESERVATIONS_KEY};

use crate::config::GATEWAYS_MAX;
use nvme::controller::CNTLID_MAX;
use policy::{Asker, Doubt, OwnerVigil, Sight, Vigil};
use scsi::{LogicalUnit, Ownership};
use std::collections::BTreeSet;
use std::io;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use store::RbdStore;
use takeovers::Takeovers;

/// The image metadata key naming the gateway that owns the image and, after a space, the
/// lock holder as librbd names it (the client's address: `NAME 10.0.0.5:0/3052916102`; one
/// key, so one write sets both). A gateway restarted after a crash knows its predecessor's
/// lock by that holder.
pub const OWNER_KEY: &str = "ferrosan.alua_owner";

/// The image metadata key a gateway of an earlier release writes its heartbeat for the image
/// under (`HOLDER COUNT`): read when the owner writes no heartbeat object (`beat`).
pub const HEARTBEAT_KEY: &str = "ferrosan.alua_heartbeat";

pub use beat::BEAT_OBJECT_PREFIX;

/// A data connection that never held the image's lock cannot have been fenced by a takeover;
/// it is still probed every this many looks (an operator may blocklist any client).
const FENCE_PROBE_EVERY: u64 = 10;

/// errno of a blocklisted (fenced) client's calls.
const ESHUTDOWN: i32 = 108;

/// How often a gateway looks at who owns its images (ownership moved by another gateway is
/// reported within this, plus the cluster's answer time).
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// The gateways of a config, as this daemon sees them.
pub struct Gateways {
    /// This gateway's name.
    pub me: String,
    /// Every portal group's tag with the gateway that serves it.
    pub groups: Vec<(u16, String)>,
    /// `gateway_takeover_s`.
    pub takeover_after: Duration,
    /// `gateway_standby`: a non-owner refuses what needs the medium instead of shipping it.
    pub standby: bool,
    /// `gateway_alua = "explicit"`: initiators may move the image (SET TARGET PORT GROUPS).
    pub explicit: bool,
    /// Every gateway's portal addresses (concrete ones: a wildcard cannot be connected to).
    pub portals: Vec<(String, Vec<String>)>,
}

impl Gateways {
    /// This gateway's share of the TSIHs and NVMe controller IDs. A host connected to several
    /// gateways of one subsystem must see a different controller ID through each (Linux
    /// rejects a duplicate), and each gateway gives them alone: the IDs are cut into
    /// [`GATEWAYS_MAX`] shares, the gateways' names in order taking one each.
    pub fn session_ids(&self) -> RangeInclusive<u16> {
        session_ids(&self.me, self.groups.iter().map(|(_, g)| g.as_str()))
    }
}

/// `me`'s share of the IDs among the gateways `named` (itself included whether named or not).
fn session_ids<'a>(me: &'a str, named: impl Iterator<Item = &'a str>) -> RangeInclusive<u16> {
    let names: BTreeSet<&str> = named.chain([me]).collect();
    let rank = names.iter().position(|&n| n == me).unwrap_or(0);
    // The config allows at most GATEWAYS_MAX; a daemon whose own name serves no portal group
    // (one more) gives no controller, so sharing the last share does no harm.
    let rank = rank.min(GATEWAYS_MAX - 1) as u16;
    let width = CNTLID_MAX / GATEWAYS_MAX as u16;
    let start = 1 + rank * width;
    start..=start + width - 1
}

pub struct ImageOwnership {
    store: Arc<RbdStore>,
    /// The image through the observer connection: who owns it stays readable after this
    /// gateway's data connection was blocklisted.
    observer: Arc<rbd::Image>,
    device: String,
    /// Every gateway of the config by name, sorted; `owner` indexes it.
    gateways: Vec<String>,
    /// Each target port group's gateway (an index in `gateways`).
    group_gateway: Vec<(u16, usize)>,
    /// This gateway (an index in `gateways`).
    me: usize,
    /// The owner's index in `gateways` + 1; 0 while no gateway owns the image (as far as this
    /// one knows).
    owner: AtomicU32,
    /// Takeovers by this gateway, one at a time: an observation made while one ran is stale.
    takeovers: Takeovers,
    /// Whether the owner is known to be alive, as this gateway's last look judged it (true
    /// while this gateway owns the image or has not judged yet).
    owner_alive: AtomicBool,
    /// The lock holder this gateway recorded with its name (its data connection, as librbd
    /// names it): what its heartbeat names.
    holder: Mutex<Option<String>>,
    /// This gateway's heartbeat in the image's pool.
    beat: Arc<beat::PoolBeat>,
    /// The data connection may have held the image's lock since it was made: only then can a
    /// takeover have fenced it, and it is probed for that at every look.
    may_hold_lock: AtomicBool,
    /// `gateway_alua = "explicit"`.
    explicit: bool,
    /// How long the owner must be gone before this gateway, standby, takes the image over by
    /// itself (`gateway_takeover_s`; zero: only when told).
    takeover_after: Duration,
    metrics: Arc<crate::metrics::Metrics>,
    /// The session to the owner that commands through this gateway are shipped on while it
    /// does not own the image (None: `gateway_standby`, standby instead).
    link: Option<crate::io::peer::PeerLink>,
    /// The image's peer secret (the owner admits peer sessions with it).
    peer_secret: String,
    /// Nexuses numbered below this ship nothing: they existed when this gateway lost the
    /// image, and a command of theirs may have waited (unread, or hung with this gateway)
    /// since before the takeover — shipped now, it would land after writes the initiator
    /// made through the new owner. New sessions ship.
    ship_floor: AtomicU64,
}

/// Each gateway's portals, in the order of `gateways`: where a command ships to reach it.
fn portals_of(gateways: &[String], settings: &Gateways) -> Vec<Vec<String>> {
    gateways
        .iter()
        .map(|g| {
            settings
                .portals
                .iter()
                .filter(|(name, _)| name == g)
                .flat_map(|(_, addresses)| addresses.iter().cloned())
                .collect()
        })
        .collect()
}

impl ImageOwnership {
    /// `groups`: every portal group tag with its gateway's name; `me`: this gateway's name
    /// (one of them).
    pub fn new(
        store: Arc<RbdStore>,
        observer: Arc<rbd::Image>,
        device: &str,
        settings: &Gateways,
        metrics: Arc<crate::metrics::Metrics>,
        (peer_identity, peer_target): (&scsi::LuIdentity, &str),
    ) -> Result<Arc<ImageOwnership>, super::OpenError> {
        let (groups, me) = (&settings.groups, settings.me.as_str());
        let takeover_after = settings.takeover_after;
        let mut gateways: Vec<String> = groups.iter().map(|(_, g)| g.clone()).collect();
        gateways.sort();
        gateways.dedup();
        let index = |name: &str| gateways.iter().position(|g| g == name);
        let group_gateway = groups
            .iter()
            .filter_map(|(tag, g)| Some((*tag, index(g)?)))
            .collect();
        let me = index(me).ok_or_else(|| {
            super::OpenError::Config(format!(
                "device {device}: gateway {me:?} serves no portal group"
            ))
        })?;
        let peer_secret = crate::io::peer::secret(&observer).map_err(|e| {
            super::OpenError::device(
                format!("device {device}"),
                format!("the gateway peer secret of {}: {e}", observer.name()),
            )
        })?;
        let beat = beat::PoolBeat::of(&store, &gateways[me]).map_err(|e| {
            super::OpenError::device(
                format!("device {device}"),
                format!("the gateway heartbeat in pool {}: {e}", store.spec().pool),
            )
        })?;
        let link = (!settings.standby).then(|| {
            crate::io::peer::PeerLink::new(
                crate::io::peer::PeerRoute {
                    name: crate::io::peer::peer_name(peer_identity),
                    target: peer_target.to_string(),
                    secret: peer_secret.clone(),
                    portals: portals_of(&gateways, settings),
                },
                device,
                metrics.gateway_shipping(device),
            )
        });
        let ownership = Arc::new(ImageOwnership {
            beat,
            may_hold_lock: AtomicBool::new(false),
            link,
            peer_secret,
            ship_floor: AtomicU64::new(0),
            observer,
            store,
            device: device.to_string(),
            gateways,
            group_gateway,
            me,
            owner: AtomicU32::new(0),
            takeovers: Takeovers::default(),
            owner_alive: AtomicBool::new(true),
            holder: Mutex::new(None),
            explicit: settings.explicit,
            takeover_after,
            metrics,
        });
        ownership.beat.join(&ownership);
        Ok(ownership)
    }

    fn owner_index(&self) -> Option<usize> {
        match self.owner.load(Ordering::Acquire) {
            0 => None,
            n => Some(n as usize - 1),
        }
    }

    /// Records the owner; true if it changed.
    fn set_owner(&self, owner: Option<usize>) -> bool {
        let new = owner.map_or(0, |i| i as u32 + 1);
        self.metrics
            .gateway_owner(&self.device, owner == Some(self.me));
        if owner != Some(self.me) && self.owner_index() == Some(self.me) {
            // Raised before the new owner is visible: no command can ship in between.
            self.ship_floor
                .store(crate::topology::nexus::next_id(), Ordering::Release);
            // No heartbeat in this gateway's name from here on (a fenced gateway's new
            // connection must not write one for the client it lost).
            *self.holder.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let changed = self.owner.swap(new, Ordering::AcqRel) != new;
        if changed {
            // A new owner is not judged yet (the vigil's next look does): alive until then, so
            // neither shipping to it nor an initiator's takeover acts on the old owner's state.
            self.owner_alive.store(true, Ordering::Release);
        }
        changed
    }

    /// The secret peer sessions to this image's owner log in with (CHAP).
    pub fn peer_secret(&self) -> &str {
        &self.peer_secret
    }

    fn recorded_owner(&self) -> Result<Option<usize>, rbd::Error> {
        Ok(self.recorded()?.0)
    }

    /// The recorded owner (an index in `gateways`) and its lock holder as recorded.
    fn recorded(&self) -> Result<(Option<usize>, Option<String>), rbd::Error> {
        let recorded = self.observer.metadata(OWNER_KEY)?.unwrap_or_default();
        let Some(record) = policy::parse_owner(&recorded) else {
            return Ok((None, None));
        };
        let index = self.gateways.iter().position(|g| g == record.gateway);
        Ok((index, record.holder.map(str::to_string)))
    }

    /// Records this gateway as the owner, with the lock holder as librbd names it (this
    /// gateway's data connection: it holds the lock now).
    fn record_self(&self, image: &rbd::Image) -> Result<(), rbd::Error> {
        let me = &self.gateways[self.me];
        let holder = match image.lock_owners()?.as_slice() {
            [holder] => Some(holder.clone()),
            _ => None,
        };
        let value = match &holder {
            Some(holder) => format!("{me} {holder}"),
            None => me.clone(),
        };
        // Without librbd's header-update notice: it would wait for the fenced client's answer.
        image.put_metadata(OWNER_KEY, &value)?;
        *self.holder.lock().unwrap_or_else(|p| p.into_inner()) = holder;
        Ok(())
    }

    /// Records this gateway as the owner here, and vouches for it in the heartbeat at once, not
    /// a beat interval later: an owner that dies before its first beat would be judged by the
    /// cluster's watch alone (30 s by default; seen in tests/rbd.rs, an owner killed within a
    /// second of taking the image).
    fn became_owner(&self) {
        self.set_owner(Some(self.me));
        // (A failure is logged by `publish`; the beat's thread writes again within a second.)
        let _ = self.beat.publish();
    }

    /// Takes the image's exclusive lock through the data connection.
    fn lock(&self, image: &rbd::Image) -> Result<(), rbd::Error> {
        self.may_hold_lock.store(true, Ordering::Release);
        image.lock_exclusive()
    }

    /// The image's name in its pool.
    fn image_name(&self) -> &str {
        &self.store.spec().image
    }

    /// The lock holder the heartbeat vouches for: this gateway's, while it owns the image.
    fn vouched_holder(&self) -> Option<String> {
        if !self.owns_here() {
            return None;
        }
        self.holder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// When the record named no holder (the lock's owners were not one client at that moment),
    /// finds the one holding it now for the heartbeat to vouch for. On the image's own thread,
    /// never the heartbeat's: a slow answer about one image must not hold up every beat.
    fn find_holder(&self) {
        let mut holder = self.holder.lock().unwrap_or_else(|p| p.into_inner());
        if holder.is_none() {
            // Only a lock this connection holds: never a heartbeat in another client's name.
            let owners = self.store.image().and_then(|image| {
                Ok(if image.owns_exclusive_lock()? {
                    image.lock_owners()?
                } else {
                    Vec::new()
                })
            });
            if let Ok([one]) = owners.as_deref() {
                tracing::info!(device = %self.device, "heartbeat of {} in the name of {one}", self.observer.name());
                *holder = Some(one.clone());
            }
        }
    }

    /// Who owns the image now, as the cluster says: this gateway while it holds the lock,
    /// otherwise the gateway the metadata names (None when that is this one: the lock was
    /// broken, this gateway fenced).
    fn observe(&self) -> Result<Option<usize>, rbd::Error> {
        match self
            .store
            .image()
            .and_then(|image| image.owns_exclusive_lock())
        {
            Ok(true) => return Ok(Some(self.me)),
            Ok(false) => {}
            // Blocklisted (fenced): the data connection owns nothing any more.
            Err(e) if e.errno() == Some(ESHUTDOWN) => {}
            // (librbd may refresh the image header here, which can fail like any call.)
            Err(e) => return Err(e),
        }
        Ok(self.recorded_owner()?.filter(|&i| i != self.me))
    }

    /// At start: takes the image when no other gateway holds or claims it (first start, or
    /// this gateway owned it before a restart); otherwise follows the recorded owner. A lock
    /// still held by the holder this gateway recorded with its name is its predecessor's (killed
    /// before it could close the image; its watch lingers for ~30 s, so librbd would not break
    /// it yet): that client is fenced and the image taken back.
    pub fn start(&self) -> Result<(), rbd::Error> {
        let image = self.store.image()?;
        let holders = image.lock_owners()?;
        let (recorded, recorded_holder) = self.recorded()?;
        let ours_or_nobodys = recorded.is_none_or(|i| i == self.me);
        let me = &self.gateways[self.me];
        // (Never this very connection: a lock it holds already is simply kept.)
        let mine = image.owns_exclusive_lock()?;
        if mine {
            self.may_hold_lock.store(true, Ordering::Release);
        }
        let predecessor = match (
            recorded == Some(self.me),
            recorded_holder,
            holders.as_slice(),
        ) {
            (true, Some(client), [holder]) if *holder == client && !mine => Some(client),
            _ => None,
        };
        if let Some(client) = &predecessor {
            // Blocklisted first: whatever the predecessor still had in flight cannot land.
            image.break_lock(client)?;
            tracing::warn!(device = %self.device, "the lock of {} was held by {client}, this gateway's previous instance: fenced (blocklisted), taking the image back", image.name());
            self.metrics.gateway_takeover(&self.device, "restart");
        }
        if (holders.is_empty() || predecessor.is_some() || mine) && ours_or_nobodys {
            if !mine {
                self.lock(&image)?;
            }
            self.record_self(&image)?;
            self.became_owner();
            tracing::info!(device = %self.device, "gateway {me} owns {}", image.name());
        } else {
            let owner = self.observe()?;
            self.set_owner(owner);
            let name = owner.map_or("none", |i| self.gateways[i].as_str());
            let role = if self.link.is_some() && owner.is_some() {
                "active/non-optimized (ships commands to the owner)"
            } else {
                "standby"
            };
            tracing::info!(device = %self.device, "{} is owned by gateway {name}: {me} is {role}", image.name());
        }
        Ok(())
    }

    /// Follows the owner every [`FOLLOW_INTERVAL`] on a thread of its own, raising ASYMMETRIC
    /// ACCESS STATE CHANGED when it moves; ends when the LU is gone.
    pub fn follow(self: &Arc<Self>, lu: &Arc<LogicalUnit>) {
        let me = Arc::clone(self);
        let lu: Weak<LogicalUnit> = Arc::downgrade(lu);
        let spawned = std::thread::Builder::new()
            .name("ferrosan-alua".into())
            .spawn(move || me.follow_while(&lu));
        if let Err(e) = spawned {
            tracing::error!(device = %self.device, "cannot follow the image's owner: {e}");
        }
    }

    /// The follow loop: a look every [`FOLLOW_INTERVAL`] while the LU lives.
    fn follow_while(&self, lu: &Weak<LogicalUnit>) {
        let mut vigil = OwnerVigil::new(self.takeover_after);
        let mut sight = Sight::default();
        let mut look = 0u64;
        loop {
            std::thread::sleep(FOLLOW_INTERVAL);
            look = look.wrapping_add(1);
            let Some(lu) = lu.upgrade() else {
                return;
            };
            // Registrations another gateway changed (through its PERSISTENT RESERVE OUT)
            // are enforced here within a period.
            lu.follow_shared_reservations();
            let mark = self.takeovers.mark();
            let looked = Instant::now();
            let observed = self.observe();
            if self.takeovers.since(mark) {
                // A takeover ran meanwhile: what was observed may predate it.
                continue;
            }
            // Fenced by another gateway's takeover: this gateway's data connection is
            // blocklisted; a new one makes it a standby that can take the image back.
            let standby = observed.as_ref().is_ok_and(|owner| *owner != Some(self.me));
            if standby {
                self.recover_if_fenced(look);
            }
            self.note_observed(observed, &mut sight, looked, &lu);
            if standby {
                self.keep_vigil(&mut vigil, &lu);
            } else {
                if self.owns_here() {
                    self.find_holder();
                }
                vigil.reset();
                self.metrics
                    .gateway_owner_silence(&self.device, Duration::ZERO);
            }
            if let Some(link) = &self.link {
                link.follow(self.owner_index().filter(|&o| o != self.me));
            }
        }
    }

    /// Takes in a look at who owns the image (begun at `looked`), telling the LU's nexuses
    /// when the owner changed.
    fn note_observed(
        &self,
        observed: Result<Option<usize>, rbd::Error>,
        sight: &mut Sight,
        looked: Instant,
        lu: &LogicalUnit,
    ) {
        match observed {
            Ok(owner) => {
                sight.seen();
                if self.set_owner(owner) {
                    let name = owner.map_or("none", |i| self.gateways[i].as_str());
                    tracing::warn!(device = %self.device, "owner of {} is now gateway {name}", self.observer.name());
                    lu.access_state_changed(None);
                }
            }
            // Blocklisted (fenced), or the cluster unreachable for BLIND_GRACE: this gateway
            // cannot serve the image now; it is standby until the cluster says otherwise. A
            // shorter failure keeps the last view.
            Err(e) => {
                let fenced = e.errno() == Some(ESHUTDOWN);
                if !sight.failed(looked, Instant::now(), fenced) {
                    tracing::debug!(device = %self.device, "cannot see who owns {} ({e}): keeping the last view for now", self.observer.name());
                } else if self.set_owner(None) {
                    tracing::warn!(device = %self.device, "owner of {} unknown ({e}): standby", self.observer.name());
                    lu.access_state_changed(None);
                }
            }
        }
    }
}

impl ImageOwnership {
    /// The peer link and owner `nexus`'s commands ship to; None when they must not ship: a
    /// peer's command is never shipped on (two gateways that disagree on the owner would pass
    /// it back and forth), nor one of a nexus from before this gateway lost the image, nor one
    /// while this gateway owns it or knows no owner.
    fn ship_route(&self, nexus: &scsi::Nexus) -> Option<(&crate::io::peer::PeerLink, usize)> {
        if nexus.target_port.shipped || nexus.id < self.ship_floor.load(Ordering::Acquire) {
            return None;
        }
        // An owner whose heartbeat stopped may be hung: a command shipped to it would wait for
        // the peer timeout; NOT READY, transition now has the initiator retry, here once this
        // gateway took over.
        if !self.owner_alive.load(Ordering::Acquire) {
            return None;
        }
        match (&self.link, self.owner_index()) {
            (Some(link), Some(owner)) if owner != self.me => Some((link, owner)),
            _ => None,
        }
    }
}

impl Ownership for ImageOwnership {
    fn is_active(&self, group: u16) -> bool {
        let Some(owner) = self.owner_index() else {
            return false;
        };
        self.group_gateway
            .iter()
            .any(|&(tag, gateway)| tag == group && gateway == owner)
    }

    fn ships(&self) -> bool {
        self.link.is_some() && self.owner_index().is_some_and(|o| o != self.me)
    }

    fn non_owners_ship(&self) -> bool {
        // The same config on every gateway: what this one does, the others do.
        self.link.is_some() && self.owner_index().is_some()
    }

    fn ship(
        &self,
        nexus: &scsi::Nexus,
        cmd: &scsi::Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> scsi::Completion {
        match self.ship_route(nexus) {
            Some((link, owner)) => link.ship(nexus, owner, cmd, data_in),
            None => scsi::Completion::check_condition(scsi::Sense::not_ready_transition()),
        }
    }

    fn ship_then(&self, nexus: &scsi::Nexus, cmd: scsi::ShippedCommand, done: scsi::ShipDone) {
        match self.ship_route(nexus) {
            Some((link, owner)) => link.ship_then(nexus, owner, cmd, done),
            None => done(
                scsi::Completion::check_condition(scsi::Sense::not_ready_transition()),
                Vec::new(),
            ),
        }
    }

    fn reset_owner(&self, nexus: &scsi::Nexus) -> bool {
        match (&self.link, self.owner_index()) {
            (Some(link), Some(owner)) if owner != self.me => link.reset(nexus, owner),
            _ => false,
        }
    }

    fn reservations_changed(&self, nexus: &scsi::Nexus) {
        if let (Some(link), Some(owner)) = (&self.link, self.owner_index()) {
            if owner != self.me {
                link.refresh_reservations(nexus, owner);
            }
        }
    }

    fn nexus_lost(&self, nexus_id: u64) {
        if let Some(link) = &self.link {
            link.nexus_lost(nexus_id);
        }
    }

    fn nexus_outlived_ownership(&self, nexus_id: u64) -> bool {
        self.link.is_some()
            && nexus_id < self.ship_floor.load(Ordering::Acquire)
            && self.owner_index() != Some(self.me)
    }

    fn explicit(&self) -> bool {
        self.explicit
    }

    fn take(&self, group: u16) -> io::Result<()> {
        // The SCSI layer tells the nexuses once this returns (SET TARGET PORT GROUPS).
        self.take_for(group, Asker::Initiator, None)
    }

    fn transitioning(&self, group: u16) -> bool {
        self.takeovers.running() && self.serves(group)
    }

    fn settle(&self, group: u16, within: std::time::Duration) {
        if self.serves(group) {
            self.takeovers.settle(within);
        }
    }
}

impl ImageOwnership {
    /// An operator's takeover (`ferrosan ctl device take`): this gateway's first group becomes
    /// active, with the same fence as SET TARGET PORT GROUPS; every nexus here is told.
    pub fn take_here(&self, lu: &LogicalUnit) -> io::Result<&str> {
        let group = self
            .group_gateway
            .iter()
            .find(|&&(_, gateway)| gateway == self.me)
            .map(|&(tag, _)| tag)
            .ok_or_else(|| io::Error::other("this gateway serves no portal group"))?;
        if !self.is_active(group) {
            self.take_for(group, Asker::Operator, Some(lu))?;
        }
        Ok(&self.gateways[self.me])
    }

    /// Replaces the data connection when the cluster refuses it (ESHUTDOWN: blocklisted).
    /// `look` counts the follow loop's looks.
    fn recover_if_fenced(&self, look: u64) {
        if !self.may_hold_lock.load(Ordering::Acquire) && !look.is_multiple_of(FENCE_PROBE_EVERY) {
            return;
        }
        let probe = self
            .store
            .image()
            .and_then(|image| image.metadata(OWNER_KEY));
        if probe.as_ref().err().and_then(rbd::Error::errno) != Some(ESHUTDOWN) {
            return;
        }
        match self.store.reconnect() {
            Ok(()) => {
                self.may_hold_lock.store(false, Ordering::Release);
                self.metrics.gateway_fenced(&self.device);
                tracing::warn!(device = %self.device, "this gateway was fenced (blocklisted) for {}: reconnected, standby", self.observer.name())
            }
            Err(e) => {
                tracing::error!(device = %self.device, "this gateway was fenced for {}; reconnecting failed: {e} (retried in a second)", self.observer.name())
            }
        }
    }

    /// A non-owner's look at the owner (`policy::OwnerVigil`): when the owner's heartbeat
    /// stopped for `takeover_after`, the cluster stopped hearing from its client, or nobody
    /// held the image for `takeover_after`, this gateway takes the image over, fencing exactly
    /// that client. Initiators do not move the image under implicit ALUA (the default): the
    /// gateways must. Also keeps `owner_alive` for the initiators' takeovers and for shipping.
    fn keep_vigil(&self, vigil: &mut OwnerVigil, lu: &LogicalUnit) {
        // Through the observer connection: it keeps working after this gateway's data
        // connection was fenced.
        let observer = &self.observer;
        let began = Instant::now();
        let looked = observer.lock_owners().and_then(|holders| {
            let seen = policy::judge(&holders, &observer.watchers()?);
            let beat = match &seen {
                policy::OwnerSeen::Present {
                    holder: Some(holder),
                } => self.heartbeat_of(holder)?,
                _ => None,
            };
            Ok((seen, beat))
        });
        let (seen, beat) = match looked {
            Ok(looked) => looked,
            Err(e) => {
                // Keeps the last judgement of `owner_alive`: no takeover on a failed look.
                tracing::debug!(device = %self.device, "cannot tell whether the owner of {} lives: {e}", observer.name());
                vigil.reset();
                return;
            }
        };
        let now = Instant::now();
        let vigil_said = vigil.look(seen, beat.as_deref(), began, now);
        self.owner_alive
            .store(vigil.owner_alive(now), Ordering::Release);
        self.metrics
            .gateway_owner_silence(&self.device, vigil.silence(now));
        match vigil_said {
            Vigil::Wait => {}
            Vigil::Noticed(doubt) => self.log_doubt(doubt),
            Vigil::Take(fence) => {
                let taken = self.transition(Some(lu), || self.take_from(fence.as_deref()));
                if let Err(e) = taken {
                    tracing::error!(device = %self.device, "taking {} over from its gone owner: {e}", observer.name());
                    vigil.reset();
                }
            }
        }
    }

    /// The heartbeat vouching for `holder` of this image (`HOLDER COUNT`), from the other
    /// gateways' heartbeat objects. An owner whose heartbeat vouches for no holder of this
    /// image (it cannot tell its own, or lost the image) gives a value that never moves: a
    /// heartbeat that stopped. An owner that writes no heartbeat object (an earlier release)
    /// is read from the image's own key.
    fn heartbeat_of(&self, holder: &str) -> Result<Option<String>, rbd::Error> {
        let owner = self.owner_index();
        let mut owner_beats = false;
        let peers = self
            .gateways
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != self.me);
        for (i, peer) in peers {
            match self.beat.peer_says(peer, self.image_name(), holder)? {
                beat::PeerSays::Beat(value) => return Ok(Some(value)),
                beat::PeerSays::Silent if owner == Some(i) => owner_beats = true,
                _ => {}
            }
        }
        if owner_beats {
            return Ok(Some(policy::beat_value(holder, "unvouched")));
        }
        self.observer.metadata(HEARTBEAT_KEY)
    }

    fn log_doubt(&self, doubt: Doubt) {
        let after = self.takeover_after.as_secs();
        let image = self.observer.name();
        let owner = self.owner_name().unwrap_or("none");
        let then = if after == 0 {
            "not taking it over (gateway_takeover_s = 0)".to_string()
        } else {
            format!("taking it over in {after} s unless it returns")
        };
        match doubt {
            Doubt::Gone => {
                tracing::warn!(device = %self.device, "the cluster no longer hears from gateway {owner}'s client (the owner of {image}): taking it over in {} s unless it returns", policy::GONE_CONFIRM.min(self.takeover_after).as_secs())
            }
            Doubt::Silent => {
                tracing::warn!(device = %self.device, "gateway {owner}'s heartbeat for {image} stopped: {then}")
            }
            Doubt::Unlocked => {
                tracing::warn!(device = %self.device, "nobody holds {image}: {then}")
            }
        }
    }

    /// Takes the image whose owner was judged gone: breaks exactly the lock of the client seen
    /// gone or silent (blocklisting it first; librbd refuses if the lock has moved since),
    /// then locks.
    fn take_from(&self, fence: Option<&str>) -> Result<(), rbd::Error> {
        let image = self.store.image()?;
        let started = Instant::now();
        if let Some(holder) = fence {
            image.break_lock(holder)?;
            tracing::warn!(device = %self.device, "fenced {holder}: blocklisted, its lock of {} broken", image.name());
        }
        self.lock(&image)?;
        self.record_self(&image)?;
        self.became_owner();
        tracing::warn!(device = %self.device, "gateway {} took {} over from its gone owner (active/optimized) in {} ms", self.gateways[self.me], image.name(), started.elapsed().as_millis());
        self.metrics.gateway_takeover(&self.device, "owner_gone");
        Ok(())
    }

    /// Whether this gateway owns the image (its groups are active/optimized).
    pub fn owns_here(&self) -> bool {
        self.owner_index() == Some(self.me)
    }

    /// The owner's name, as this gateway knows it.
    pub fn owner_name(&self) -> Option<&str> {
        self.owner_index().map(|i| self.gateways[i].as_str())
    }

    /// Whether target port group `group` is one of this gateway's.
    fn serves(&self, group: u16) -> bool {
        self.group_gateway
            .iter()
            .any(|&(tag, gateway)| tag == group && gateway == self.me)
    }

    /// Takes the image for `asker` if the policy allows (`policy::may_take`): an initiator
    /// only from an owner not known to be alive. `lu`: see [`ImageOwnership::transition`].
    fn take_for(&self, group: u16, asker: Asker, lu: Option<&LogicalUnit>) -> io::Result<()> {
        if !self.serves(group) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("target port group {group} is not this gateway's"),
            ));
        }
        let alive = self.owner_alive.load(Ordering::Acquire) && self.owner_index().is_some();
        if !policy::may_take(asker, alive) {
            let owner = self.owner_name().unwrap_or("none");
            tracing::info!(device = %self.device, "SET TARGET PORT GROUPS through group {group} refused: gateway {owner} owns {} and is alive (failback is the operator's: ferrosan ctl device take)", self.observer.name());
            self.metrics.gateway_takeover_refused(&self.device);
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!("gateway {owner} owns the image and is alive"),
            ));
        }
        self.transition(lu, || self.take_over(asker))
    }

    /// Runs `take`, one takeover by this gateway, with its groups transitioning meanwhile
    /// (commands through them are answered ASYMMETRIC ACCESS STATE TRANSITION).
    /// When it succeeds, `lu` (every path but SET TARGET PORT GROUPS, whose SCSI layer does
    /// it) follows the shared reservations and tells its nexuses before the transition ends:
    /// the new owner serves nothing against stale registrations, and a host that sees the new
    /// state in REPORT TARGET PORT GROUPS has had its unit attention first.
    fn transition<E>(
        &self,
        lu: Option<&LogicalUnit>,
        take: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        self.takeovers.run(|| {
            let result = take();
            if let (Ok(()), Some(lu)) = (&result, lu) {
                lu.follow_shared_reservations();
                lu.access_state_changed(None);
            }
            result
        })
    }

    fn take_over(&self, asker: Asker) -> io::Result<()> {
        let started = Instant::now();
        let image = self.store.image().map_err(store::rbd::io_error)?;
        let fail = |e: rbd::Error| {
            tracing::error!(device = %self.device, "taking {} over: {e}", image.name());
            store::rbd::io_error(e)
        };
        if !image.owns_exclusive_lock().map_err(fail)? {
            for holder in image.lock_owners().map_err(fail)? {
                // Blocklists the holder before the lock goes: its writes cannot land later.
                image.break_lock(&holder).map_err(fail)?;
                tracing::warn!(device = %self.device, "fenced {holder}: blocklisted, its lock of {} broken", image.name());
            }
            self.lock(&image).map_err(fail)?;
        }
        let me = &self.gateways[self.me];
        self.record_self(&image).map_err(fail)?;
        self.became_owner();
        let (reason, by) = match asker {
            Asker::Initiator => ("initiator", "SET TARGET PORT GROUPS"),
            Asker::Operator => ("operator", "ctl device take"),
        };
        tracing::warn!(device = %self.device, "gateway {me} took {} over (active/optimized; {by}) in {} ms", image.name(), started.elapsed().as_millis());
        self.metrics.gateway_takeover(&self.device, reason);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gateway_gives_its_own_share_of_the_controller_ids() {
        let named = || ["b", "a", "b", "c"].into_iter();
        let (a, b, c) = (
            session_ids("a", named()),
            session_ids("b", named()),
            session_ids("c", named()),
        );
        // In the names' order, whatever the portal groups' order.
        assert_eq!((*a.start(), *a.end()), (1, 2047));
        assert_eq!((*b.start(), *c.start()), (2048, 4095));
        // A name no portal group gives is among the names too.
        assert_eq!(session_ids("aa", named()), 2048..=4094);
        // The most a config may name: disjoint, nonzero, within the controller IDs.
        let names: Vec<String> = (0..GATEWAYS_MAX).map(|i| format!("g{i:02}")).collect();
        let shares: Vec<_> = names
            .iter()
            .map(|me| session_ids(me, names.iter().map(String::as_str)))
            .collect();
        assert!(shares.windows(2).all(|w| w[0].end() < w[1].start()));
        assert_eq!(*shares[0].start(), 1);
        assert!(*shares[GATEWAYS_MAX - 1].end() <= CNTLID_MAX);
    }
}
