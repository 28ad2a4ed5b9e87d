//! RBD gateways: several ferrosan daemons export one image, each as a target port group of the
//! same target (explicit ALUA, see `scsi::alua`). The gateway that owns the image holds RBD's
//! exclusive lock and is active/optimized; the others are standby. Taking the image over
//! (SET TARGET PORT GROUPS through a standby gateway's port) breaks the owner's lock, which
//! blocklists the owner's client in the cluster first: nothing the old owner still has in
//! flight or sends later can land after the takeover. The owner's name is recorded in the
//! image's metadata so that every gateway reports the same states.

use scsi::{LogicalUnit, Ownership, PrPersistence};
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
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
/// How often a gateway looks at who owns its images (ownership moved by another gateway is
/// reported within this, plus the cluster's answer time).
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

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
}

impl ImageOwnership {
    /// `groups`: every portal group tag with its gateway's name; `me`: this gateway's name
    /// (one of them).
    pub fn new(
        store: Arc<RbdStore>,
        observer: Arc<rbd::Image>,
        reservations: Arc<ImageReservations>,
        device: &str,
        groups: &[(u16, String)],
        me: &str,
    ) -> Result<Arc<ImageOwnership>, String> {
        let mut gateways: Vec<String> = groups.iter().map(|(_, g)| g.clone()).collect();
        gateways.sort();
        gateways.dedup();
        let index = |name: &str| gateways.iter().position(|g| g == name);
        let group_gateway = groups
            .iter()
            .filter_map(|(tag, g)| Some((*tag, index(g)?)))
            .collect();
        let me = index(me).ok_or_else(|| format!("gateway {me:?} serves no portal group"))?;
        Ok(Arc::new(ImageOwnership {
            observer,
            reservations,
            store,
            device: device.to_string(),
            gateways,
            group_gateway,
            me,
            owner: AtomicU32::new(0),
            takes: std::sync::atomic::AtomicU64::new(0),
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
        self.owner.swap(new, Ordering::AcqRel) != new
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
        // A blocklisted data connection fails here: it owns nothing any more.
        if self
            .store
            .image()
            .and_then(|image| image.owns_exclusive_lock())
            .unwrap_or(false)
        {
            return Ok(Some(self.me));
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
            tracing::info!(device = %self.device, "{} is owned by gateway {name}: {me} is standby", image.name());
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
            .spawn(move || loop {
                std::thread::sleep(FOLLOW_INTERVAL);
                let Some(lu) = lu.upgrade() else {
                    return;
                };
                // Registrations another gateway changed (through its PERSISTENT RESERVE OUT)
                // are enforced here within a tick.
                if let Ok(Some(state)) = me.reservations.load() {
                    lu.replace_reservations(&state);
                }
                let takes = me.takes.load(Ordering::Acquire);
                let observed = me.observe();
                if takes % 2 == 1 || me.takes.load(Ordering::Acquire) != takes {
                    // A takeover ran meanwhile: what was observed may predate it.
                    continue;
                }
                // Fenced by another gateway's takeover: this gateway's data connection is
                // blocklisted; a new one makes it a standby that can take the image back.
                if observed.as_ref().is_ok_and(|owner| *owner != Some(me.me)) {
                    me.recover_if_fenced();
                }
                match observed {
                    Ok(owner) => {
                        if me.set_owner(owner) {
                            let name = owner.map_or("none", |i| me.gateways[i].as_str());
                            tracing::warn!(device = %me.device, "owner of {} is now gateway {name}", me.observer.name());
                            lu.access_state_changed(None);
                        }
                    }
                    // Blocklisted (fenced) or the cluster unreachable: this gateway cannot
                    // serve the image now; it is standby until the cluster says otherwise.
                    Err(e) => {
                        if me.set_owner(None) {
                            tracing::warn!(device = %me.device, "owner of {} unknown ({e}): standby", me.observer.name());
                            lu.access_state_changed(None);
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(device = %self.device, "cannot follow the image's owner: {e}");
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
        const ESHUTDOWN: i32 = 108;
        let probe = self
            .store
            .image()
            .and_then(|image| image.metadata(OWNER_KEY));
        if probe.as_ref().err().and_then(rbd::Error::errno) != Some(ESHUTDOWN) {
            return;
        }
        match self.store.reconnect() {
            Ok(()) => {
                tracing::warn!(device = %self.device, "this gateway was fenced (blocklisted) for {}: reconnected, standby", self.observer.name())
            }
            Err(e) => {
                tracing::error!(device = %self.device, "this gateway was fenced for {}; reconnecting failed: {e} (retried in a second)", self.observer.name())
            }
        }
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
}

/// The image metadata key holding the reservations (the TOML of a reservation file).
pub const RESERVATIONS_KEY: &str = "ferrosan.persistent_reservations";

impl ImageReservations {
    pub fn new(observer: Arc<rbd::Image>, device: &str) -> Arc<ImageReservations> {
        Arc::new(ImageReservations {
            medium: format!("rbd:{}", observer.name()),
            observer,
            device: device.to_string(),
        })
    }
}

impl PrPersistence for ImageReservations {
    fn save(&self, state: &scsi::PersistentReservations) -> io::Result<()> {
        let text = crate::state::reservations_to_text(state, &self.medium)?;
        self.observer
            .set_metadata(RESERVATIONS_KEY, &text)
            .map_err(|e| {
                tracing::error!(device = %self.device, "cannot save persistent reservations in the image: {e}; the PERSISTENT RESERVE OUT fails");
                store::rbd::io_error(e)
            })
    }

    fn shared(&self) -> bool {
        true
    }

    fn load(&self) -> io::Result<Option<scsi::PersistentReservations>> {
        let Some(text) = self
            .observer
            .metadata(RESERVATIONS_KEY)
            .map_err(store::rbd::io_error)?
        else {
            return Ok(None);
        };
        crate::state::reservations_from_text(&text, &self.medium)
            .map(Some)
            .map_err(|e| {
                tracing::error!(device = %self.device, "persistent reservations in the image: {e}");
                io::Error::new(io::ErrorKind::InvalidData, e)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
