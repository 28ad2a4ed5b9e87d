//! RBD gateways: several ferrosan daemons export one image, each as a target port group of the
//! same target (explicit ALUA, see `scsi::alua`). The gateway that owns the image holds RBD's
//! exclusive lock and is active/optimized; the others are standby. Taking the image over
//! (SET TARGET PORT GROUPS through a standby gateway's port) breaks the owner's lock, which
//! blocklists the owner's client in the cluster first: nothing the old owner still has in
//! flight or sends later can land after the takeover. The owner's name is recorded in the
//! image's metadata so that every gateway reports the same states. A standby also takes the
//! image over by itself when the cluster stops hearing from the owner's client (its watch on
//! the image gone) for `gateway_takeover_s`: implicit ALUA, for initiators that never move it.

use scsi::{LogicalUnit, Ownership, PrPersistence};
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use store::RbdStore;

/// The image metadata key naming the gateway that owns the image and, after a space, the
/// lock holder as librbd names it (the client's address: `NAME 10.0.0.5:0/3052916102`; one
/// key, so one write sets both). A gateway restarted after a crash knows its predecessor's
/// lock by that holder.
pub const OWNER_KEY: &str = "ferrosan.alua_owner";

/// What the owner key holds.
#[derive(Debug, PartialEq, Eq)]
struct OwnerRecord<'a> {
    gateway: &'a str,
    /// The lock holder it recorded; absent in records written before holders were kept.
    holder: Option<&'a str>,
}

fn parse_owner(value: &str) -> Option<OwnerRecord<'_>> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    Some(match value.split_once(char::is_whitespace) {
        Some((gateway, holder)) => OwnerRecord {
            gateway,
            holder: Some(holder.trim()).filter(|h| !h.is_empty()),
        },
        None => OwnerRecord {
            gateway: value,
            holder: None,
        },
    })
}
/// What a standby gateway makes of one look at the image: is the client holding its lock
/// (the owner gateway's) still heard from by the cluster?
#[derive(Debug, Clone, PartialEq, Eq)]
enum OwnerSeen {
    /// The holder watches the image: the owner lives (or several clients hold the lock, which
    /// is no lock a gateway took: never acted on).
    Present,
    /// The lock is held by a client that no longer watches the image: dead, or cut off from the
    /// cluster for longer than the OSDs' watch timeout.
    Gone { holder: String },
    /// Nobody holds the lock (the owner closed the image: a clean shutdown).
    Unlocked,
}

fn judge(holders: &[String], watchers: &[String]) -> OwnerSeen {
    match holders {
        [] => OwnerSeen::Unlocked,
        [holder] => {
            let address = rbd::plain_address(holder);
            if watchers.iter().any(|w| rbd::plain_address(w) == address) {
                OwnerSeen::Present
            } else {
                OwnerSeen::Gone {
                    holder: holder.clone(),
                }
            }
        }
        _ => OwnerSeen::Present,
    }
}

/// What a standby does after a look.
#[derive(Debug, PartialEq, Eq)]
enum Vigil {
    /// Nothing (the owner is present, or has not been gone long enough).
    Wait,
    /// The owner was just seen gone: worth a log line.
    Noticed,
    /// Gone for the whole grace: take the image (fencing this holder, if any).
    Take(OwnerSeen),
}

/// A standby's patience: the owner must be seen gone -- the same holder absent, or the lock
/// free -- on every look for `grace` before the image is taken over. Zero: never.
#[derive(Debug)]
struct OwnerVigil {
    grace: Duration,
    gone_since: Option<(OwnerSeen, Instant)>,
}

impl OwnerVigil {
    fn new(grace: Duration) -> OwnerVigil {
        OwnerVigil {
            grace,
            gone_since: None,
        }
    }

    fn look(&mut self, seen: OwnerSeen, now: Instant) -> Vigil {
        if self.grace.is_zero() || seen == OwnerSeen::Present {
            self.gone_since = None;
            return Vigil::Wait;
        }
        match &self.gone_since {
            Some((before, since)) if *before == seen => {
                if now.saturating_duration_since(*since) >= self.grace {
                    self.gone_since = None;
                    Vigil::Take(seen)
                } else {
                    Vigil::Wait
                }
            }
            _ => {
                self.gone_since = Some((seen, now));
                Vigil::Noticed
            }
        }
    }

    /// Forgets what was seen (the cluster did not answer, a takeover failed): the grace starts
    /// over.
    fn reset(&mut self) {
        self.gone_since = None;
    }
}

/// How long a gateway keeps its last view of an image's owner while it cannot look (the
/// cluster refused or did not answer): a single slow or failed call under load must not flap
/// every initiator's path state (each flip is a unit attention, and a non-owner that knows no
/// owner answers NOT READY instead of shipping). Keeping the view is safe: the fence, not this
/// view, keeps a stale owner's writes out.
pub const BLIND_GRACE: Duration = Duration::from_secs(3);

/// errno of a blocklisted (fenced) client's calls.
const ESHUTDOWN: i32 = 108;

/// How long a gateway has been unable to see who owns an image.
#[derive(Debug, Default)]
struct Sight {
    /// When the first look of the current run of failed looks began.
    failing_since: Option<Instant>,
}

impl Sight {
    /// A look succeeded.
    fn seen(&mut self) {
        self.failing_since = None;
    }

    /// The look begun at `started` failed at `now`: whether to give up the last view (the
    /// looks have failed for [`BLIND_GRACE`] since the first of them began, or this gateway
    /// was fenced, which it must act on at once).
    fn failed(&mut self, started: Instant, now: Instant, fenced: bool) -> bool {
        let since = *self.failing_since.get_or_insert(started);
        fenced || now.saturating_duration_since(since) >= BLIND_GRACE
    }
}

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
    /// Every gateway's portal addresses (concrete ones: a wildcard cannot be connected to).
    pub portals: Vec<(String, Vec<String>)>,
}

pub struct ImageOwnership {
    store: Arc<RbdStore>,
    /// The image through the observer connection: who owns it stays readable after this
    /// gateway's data connection was blocklisted.
    observer: Arc<rbd::Image>,
    /// The image's reservations, followed with the owner.
    reservations: Arc<ImageReservations>,
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
    /// Counts takeovers by this gateway, twice each (odd while one runs): an observation made
    /// while one ran is stale.
    takes: std::sync::atomic::AtomicU64,
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

impl ImageOwnership {
    /// `groups`: every portal group tag with its gateway's name; `me`: this gateway's name
    /// (one of them).
    pub fn new(
        store: Arc<RbdStore>,
        observer: Arc<rbd::Image>,
        reservations: Arc<ImageReservations>,
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
        let link = (!settings.standby).then(|| {
            let portals = gateways
                .iter()
                .map(|g| {
                    settings
                        .portals
                        .iter()
                        .filter(|(name, _)| name == g)
                        .flat_map(|(_, addresses)| addresses.iter().cloned())
                        .collect()
                })
                .collect();
            crate::io::peer::PeerLink::new(
                crate::io::peer::PeerRoute {
                    name: crate::io::peer::peer_name(peer_identity),
                    target: peer_target.to_string(),
                    secret: peer_secret.clone(),
                    portals,
                },
                device,
                metrics.gateway_shipping(device),
            )
        });
        Ok(Arc::new(ImageOwnership {
            link,
            peer_secret,
            ship_floor: AtomicU64::new(0),
            observer,
            reservations,
            store,
            device: device.to_string(),
            gateways,
            group_gateway,
            me,
            owner: AtomicU32::new(0),
            takes: std::sync::atomic::AtomicU64::new(0),
            takeover_after,
            metrics,
        }))
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
        }
        self.owner.swap(new, Ordering::AcqRel) != new
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
        let Some(record) = parse_owner(&recorded) else {
            return Ok((None, None));
        };
        let index = self.gateways.iter().position(|g| g == record.gateway);
        Ok((index, record.holder.map(str::to_string)))
    }

    /// Records this gateway as the owner, with the lock holder as librbd names it (this
    /// gateway's data connection: it holds the lock now).
    fn record_self(&self, image: &rbd::Image) -> Result<(), rbd::Error> {
        let me = &self.gateways[self.me];
        let value = match image.lock_owners()?.as_slice() {
            [holder] => format!("{me} {holder}"),
            _ => me.clone(),
        };
        image.set_metadata(OWNER_KEY, &value)
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
                image.lock_exclusive()?;
            }
            self.record_self(&image)?;
            self.set_owner(Some(self.me));
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
            .spawn(move || {
                let mut vigil = OwnerVigil::new(me.takeover_after);
                let mut sight = Sight::default();
                loop {
                std::thread::sleep(FOLLOW_INTERVAL);
                let Some(lu) = lu.upgrade() else {
                    return;
                };
                // Registrations another gateway changed (through its PERSISTENT RESERVE OUT)
                // are enforced here within a tick.
                if let Ok(Some(state)) = me.reservations.current() {
                    lu.replace_reservations(&state);
                }
                let takes = me.takes.load(Ordering::Acquire);
                let looked = Instant::now();
                let observed = me.observe();
                if takes % 2 == 1 || me.takes.load(Ordering::Acquire) != takes {
                    // A takeover ran meanwhile: what was observed may predate it.
                    continue;
                }
                // Fenced by another gateway's takeover: this gateway's data connection is
                // blocklisted; a new one makes it a standby that can take the image back.
                let standby = observed.as_ref().is_ok_and(|owner| *owner != Some(me.me));
                if standby {
                    me.recover_if_fenced();
                }
                match observed {
                    Ok(owner) => {
                        sight.seen();
                        if me.set_owner(owner) {
                            let name = owner.map_or("none", |i| me.gateways[i].as_str());
                            tracing::warn!(device = %me.device, "owner of {} is now gateway {name}", me.observer.name());
                            lu.access_state_changed(None);
                        }
                    }
                    // Blocklisted (fenced), or the cluster unreachable for BLIND_GRACE: this
                    // gateway cannot serve the image now; it is standby until the cluster says
                    // otherwise. A shorter failure keeps the last view.
                    Err(e) => {
                        let fenced = e.errno() == Some(ESHUTDOWN);
                        if !sight.failed(looked, Instant::now(), fenced) {
                            tracing::debug!(device = %me.device, "cannot see who owns {} ({e}): keeping the last view for now", me.observer.name());
                        } else if me.set_owner(None) {
                            tracing::warn!(device = %me.device, "owner of {} unknown ({e}): standby", me.observer.name());
                            lu.access_state_changed(None);
                        }
                    }
                }
                if standby {
                    me.keep_vigil(&mut vigil, &lu);
                } else {
                    vigil.reset();
                }
                if let Some(link) = &me.link {
                    link.follow(me.owner_index().filter(|&o| o != me.me));
                }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(device = %self.device, "cannot follow the image's owner: {e}");
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

    fn take(&self, group: u16) -> io::Result<()> {
        if !self
            .group_gateway
            .iter()
            .any(|&(tag, gateway)| tag == group && gateway == self.me)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("target port group {group} is not this gateway's"),
            ));
        }
        self.takes.fetch_add(1, Ordering::AcqRel);
        let result = self.take_over();
        self.takes.fetch_add(1, Ordering::AcqRel);
        result
    }

    fn transitioning(&self, group: u16) -> bool {
        // Odd while a takeover by this gateway runs (SET TARGET PORT GROUPS, `ctl device
        // take`, or the vigil's).
        self.takes.load(Ordering::Acquire) % 2 == 1
            && self
                .group_gateway
                .iter()
                .any(|&(tag, gateway)| tag == group && gateway == self.me)
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
            self.take(group)?;
            lu.access_state_changed(None);
        }
        Ok(&self.gateways[self.me])
    }

    /// Replaces the data connection when the cluster refuses it (ESHUTDOWN: blocklisted).
    fn recover_if_fenced(&self) {
        let probe = self
            .store
            .image()
            .and_then(|image| image.metadata(OWNER_KEY));
        if probe.as_ref().err().and_then(rbd::Error::errno) != Some(ESHUTDOWN) {
            return;
        }
        match self.store.reconnect() {
            Ok(()) => {
                self.metrics.gateway_fenced(&self.device);
                tracing::warn!(device = %self.device, "this gateway was fenced (blocklisted) for {}: reconnected, standby", self.observer.name())
            }
            Err(e) => {
                tracing::error!(device = %self.device, "this gateway was fenced for {}; reconnecting failed: {e} (retried in a second)", self.observer.name())
            }
        }
    }

    /// A standby's look at the owner: when the client holding the image's lock has not watched
    /// the image for `takeover_after` (or nobody has held the lock that long), this gateway
    /// takes the image over, fencing exactly that client. Initiators that never send SET
    /// TARGET PORT GROUPS (ESXi's default SATP, implicit ALUA) need the array to do this.
    fn keep_vigil(&self, vigil: &mut OwnerVigil, lu: &LogicalUnit) {
        if self.takeover_after.is_zero() {
            return;
        }
        // Through the observer connection: it keeps working after this gateway's data
        // connection was fenced.
        let seen = self
            .observer
            .lock_owners()
            .and_then(|holders| Ok(judge(&holders, &self.observer.watchers()?)));
        let seen = match seen {
            Ok(seen) => seen,
            Err(e) => {
                tracing::debug!(device = %self.device, "cannot tell whether the owner of {} lives: {e}", self.observer.name());
                vigil.reset();
                return;
            }
        };
        let after = self.takeover_after.as_secs();
        match vigil.look(seen, Instant::now()) {
            Vigil::Wait => {}
            Vigil::Noticed => match self.owner_name() {
                Some(owner) => {
                    tracing::warn!(device = %self.device, "the cluster no longer hears from gateway {owner}'s client (the owner of {}): taking it over in {after} s unless it returns", self.observer.name())
                }
                None => {
                    tracing::warn!(device = %self.device, "nobody holds {}: taking it over in {after} s unless another gateway does", self.observer.name())
                }
            },
            Vigil::Take(seen) => {
                self.takes.fetch_add(1, Ordering::AcqRel);
                let taken = self.take_from(&seen);
                self.takes.fetch_add(1, Ordering::AcqRel);
                match taken {
                    Ok(()) => lu.access_state_changed(None),
                    Err(e) => {
                        tracing::error!(device = %self.device, "taking {} over from its gone owner: {e}", self.observer.name());
                        vigil.reset();
                    }
                }
            }
        }
    }

    /// Takes the image whose owner was judged gone: breaks exactly the lock of the client seen
    /// gone (blocklisting it first; librbd refuses if the lock has moved since), then locks.
    fn take_from(&self, seen: &OwnerSeen) -> Result<(), rbd::Error> {
        let image = self.store.image()?;
        if let OwnerSeen::Gone { holder } = seen {
            image.break_lock(holder)?;
            tracing::warn!(device = %self.device, "fenced {holder}: blocklisted, its lock of {} broken", image.name());
        }
        image.lock_exclusive()?;
        self.record_self(&image)?;
        self.set_owner(Some(self.me));
        tracing::warn!(device = %self.device, "gateway {} took {} over from its gone owner (active/optimized)", self.gateways[self.me], image.name());
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

    fn take_over(&self) -> io::Result<()> {
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
            image.lock_exclusive().map_err(fail)?;
        }
        let me = &self.gateways[self.me];
        self.record_self(&image).map_err(fail)?;
        self.set_owner(Some(self.me));
        tracing::warn!(device = %self.device, "gateway {me} took {} over (active/optimized)", image.name());
        self.metrics.gateway_takeover(&self.device, "told");
        Ok(())
    }
}

/// An RBD image's persistent reservations, kept in the image's metadata (through the observer
/// connection, which a fenced gateway keeps): every gateway reads them before each PERSISTENT
/// RESERVE command and the owner follows them once a second, so the registrations an initiator
/// made through one gateway hold on all of them and survive a takeover. APTPL is kept too.
pub struct ImageReservations {
    observer: Arc<rbd::Image>,
    medium: String,
    device: String,
    /// The stored text the last PERSISTENT RESERVE command loaded ("" when none): its save
    /// replaces exactly that, or is refused. (The core loads and saves under the LU's
    /// reservation lock, so this is the command's own load.)
    loaded: std::sync::Mutex<Option<String>>,
}

/// The image metadata key holding the reservations (the TOML of a reservation file).
pub const RESERVATIONS_KEY: &str = "ferrosan.persistent_reservations";

impl ImageReservations {
    pub fn new(observer: Arc<rbd::Image>, device: &str) -> Arc<ImageReservations> {
        Arc::new(ImageReservations {
            medium: format!("rbd:{}", observer.name()),
            observer,
            device: device.to_string(),
            loaded: std::sync::Mutex::new(None),
        })
    }

    fn stored_text(&self) -> io::Result<Option<String>> {
        self.observer
            .metadata(RESERVATIONS_KEY)
            .map_err(store::rbd::io_error)
    }

    fn parse(&self, text: &str) -> io::Result<scsi::PersistentReservations> {
        crate::topology::state::reservations_from_text(text, &self.medium).map_err(|e| {
            tracing::error!(device = %self.device, "persistent reservations in the image: {e}");
            io::Error::new(io::ErrorKind::InvalidData, e)
        })
    }

    /// The reservations as stored now, for following them (leaves the PERSISTENT RESERVE
    /// commands' compare-and-set alone).
    pub fn current(&self) -> io::Result<Option<scsi::PersistentReservations>> {
        match self.stored_text()? {
            Some(text) => self.parse(&text).map(Some),
            None => Ok(None),
        }
    }
}

impl PrPersistence for ImageReservations {
    /// Saves over the text the command loaded, atomically: another gateway's save in between
    /// (two PERSISTENT RESERVE OUTs through two gateways at once) makes this one
    /// [`scsi::SaveRefused::Conflict`], and the core runs the command again on the new state.
    fn save(&self, state: &scsi::PersistentReservations) -> io::Result<()> {
        let text = crate::topology::state::reservations_to_text(state, &self.medium)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let Some(expected) = loaded.take() else {
            // Nothing loaded first (the core always loads a shared state): load, run again.
            return Err(scsi::SaveRefused::Conflict.error());
        };
        match self
            .observer
            .compare_and_set_metadata(RESERVATIONS_KEY, &expected, &text)
        {
            Ok(true) => {
                *loaded = Some(text);
                Ok(())
            }
            Ok(false) => {
                tracing::info!(device = %self.device, "persistent reservations changed through another gateway meanwhile: the PERSISTENT RESERVE OUT runs again");
                Err(scsi::SaveRefused::Conflict.error())
            }
            Err(e) => {
                tracing::error!(device = %self.device, "cannot save persistent reservations in the image: {e}; the PERSISTENT RESERVE OUT fails");
                Err(store::rbd::io_error(e))
            }
        }
    }

    fn shared(&self) -> bool {
        true
    }

    fn load(&self) -> io::Result<Option<scsi::PersistentReservations>> {
        let text = self.stored_text();
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        *loaded = None;
        let Some(text) = text? else {
            *loaded = Some(String::new());
            return Ok(None);
        };
        let state = self.parse(&text)?;
        *loaded = Some(text);
        Ok(Some(state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_gateway_keeps_its_view_of_the_owner_through_brief_blindness() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut sight = Sight::default();
        // Quick failures, one look a second: the view is kept until the first failed look
        // began BLIND_GRACE ago.
        assert!(!sight.failed(at(0), at(10), false));
        assert!(!sight.failed(at(1000), at(1010), false));
        assert!(!sight.failed(at(2000), at(2010), false));
        assert!(sight.failed(at(3000), at(3010), false));
        // A success starts the count over.
        sight.seen();
        assert!(!sight.failed(at(4000), at(4010), false));
        assert!(!sight.failed(at(5000), at(6999), false));
        assert!(sight.failed(at(6000), at(7000), false));
        // One look that hung for the whole grace (a cluster gone: calls time out) is enough.
        sight.seen();
        assert!(sight.failed(
            at(10_000),
            at(10_000 + BLIND_GRACE.as_millis() as u64),
            false
        ));
        // Fenced: at once.
        sight.seen();
        assert!(sight.failed(at(20_000), at(20_001), true));
        // A clock that seems to run back counts as no time.
        let mut sight = Sight::default();
        assert!(!sight.failed(at(5000), at(4000), false));
    }

    #[test]
    fn an_owner_is_gone_when_its_lock_holder_no_longer_watches_the_image() {
        let holder = "127.0.0.1:0/1001";
        let watchers = names(&["v2:127.0.0.1:0/1001", "127.0.0.1:0/2002"]);
        assert_eq!(judge(&names(&[holder]), &watchers), OwnerSeen::Present);
        assert_eq!(
            judge(&names(&[holder]), &names(&["127.0.0.1:0/2002"])),
            OwnerSeen::Gone {
                holder: holder.to_string()
            }
        );
        assert_eq!(
            judge(&names(&[holder]), &[]),
            OwnerSeen::Gone {
                holder: holder.to_string()
            }
        );
        // A nonce is part of the name: a restarted client on the same address is another.
        assert_eq!(
            judge(&names(&[holder]), &names(&["127.0.0.1:0/10011"])),
            OwnerSeen::Gone {
                holder: holder.to_string()
            }
        );
        assert_eq!(judge(&[], &watchers), OwnerSeen::Unlocked);
        // Shared locks are not a gateway's: never acted on.
        assert_eq!(
            judge(&names(&[holder, "127.0.0.1:0/3"]), &[]),
            OwnerSeen::Present
        );
    }

    #[test]
    fn a_standby_takes_over_only_after_the_owner_was_gone_for_the_whole_grace() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let gone = |h: &str| OwnerSeen::Gone {
            holder: h.to_string(),
        };
        let mut vigil = OwnerVigil::new(10 * s);
        assert_eq!(vigil.look(OwnerSeen::Present, t0), Vigil::Wait);
        assert_eq!(vigil.look(gone("a"), t0 + s), Vigil::Noticed);
        assert_eq!(vigil.look(gone("a"), t0 + 10 * s), Vigil::Wait);
        // Back before the grace ran out: the count starts over.
        assert_eq!(vigil.look(OwnerSeen::Present, t0 + 11 * s), Vigil::Wait);
        assert_eq!(vigil.look(gone("a"), t0 + 12 * s), Vigil::Noticed);
        assert_eq!(vigil.look(gone("a"), t0 + 21 * s), Vigil::Wait);
        assert_eq!(vigil.look(gone("a"), t0 + 22 * s), Vigil::Take(gone("a")));
        // Taken (or failed): a new grace for whatever is seen next.
        assert_eq!(vigil.look(gone("a"), t0 + 23 * s), Vigil::Noticed);
        // Another holder gone is another owner: its own grace.
        assert_eq!(vigil.look(gone("b"), t0 + 40 * s), Vigil::Noticed);
        assert_eq!(vigil.look(OwnerSeen::Unlocked, t0 + 50 * s), Vigil::Noticed);
        assert_eq!(
            vigil.look(OwnerSeen::Unlocked, t0 + 60 * s),
            Vigil::Take(OwnerSeen::Unlocked)
        );
        // A failed takeover or a cluster that did not answer: the grace starts over.
        vigil.look(gone("c"), t0 + 70 * s);
        vigil.reset();
        assert_eq!(vigil.look(gone("c"), t0 + 90 * s), Vigil::Noticed);
        // Zero: never by itself.
        let mut never = OwnerVigil::new(Duration::ZERO);
        assert_eq!(never.look(gone("a"), t0), Vigil::Wait);
        assert_eq!(never.look(gone("a"), t0 + 1000 * s), Vigil::Wait);
    }

    #[test]
    fn the_owner_record_names_the_gateway_and_its_lock_holder() {
        assert_eq!(
            parse_owner("gw-a 10.0.0.5:0/3052916102"),
            Some(OwnerRecord {
                gateway: "gw-a",
                holder: Some("10.0.0.5:0/3052916102")
            })
        );
        // Written before holders were kept: the gateway alone.
        assert_eq!(
            parse_owner(" gw-b\n"),
            Some(OwnerRecord {
                gateway: "gw-b",
                holder: None
            })
        );
        assert_eq!(parse_owner(""), None);
        assert_eq!(parse_owner("   "), None);
    }
}
