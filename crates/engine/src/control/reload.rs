//! Reload by difference. [`diff`] compares the running config with a new one and says what
//! changes, or why the new one cannot be applied live (a pure function, unit-tested);
//! [`apply`] is the only place with effects: it opens added devices, grows resized ones,
//! publishes the next topology and closes removed devices once their last command is done.
//! Sessions move to the new topology at their next turn (`dataplane/view.rs`, `View::follow`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{ReloadError, SaveError};
use crate::config::edit::FileBase;
use crate::config::{Config, ConfigSource, DeviceConfig, Invalid, NodeName};
use crate::shared::Shared;
use crate::topology::{Before, OpenDevice, OpenDevices, Topology};

/// A device attribute the operator changes on a running LU (`LogicalUnit::set_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribute {
    ReadOnly(bool),
    WriteCache(bool),
    /// The vendor, product or serial INQUIRY reports (never the NAA designator).
    Identity,
}

impl std::fmt::Display for Attribute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on_off = |on: bool| if on { "on" } else { "off" };
        match self {
            Attribute::ReadOnly(on) => write!(f, "read_only {}", on_off(*on)),
            Attribute::WriteCache(on) => write!(f, "write_cache {}", on_off(*on)),
            Attribute::Identity => f.write_str("vendor, product or serial changed"),
        }
    }
}

/// What a reload changes, by kind. Empty: the new config is the running one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub devices_added: Vec<String>,
    pub devices_removed: Vec<String>,
    /// Device name and its new size in bytes.
    pub devices_resized: Vec<(String, u64)>,
    /// Device name and whether it goes offline (`true`) or back online.
    pub devices_offline: Vec<(String, bool)>,
    /// Device name and an attribute its running LU takes.
    pub devices_attributes: Vec<(String, Attribute)>,
    pub targets_added: Vec<NodeName>,
    pub targets_removed: Vec<NodeName>,
    /// Targets whose groups, LUN maps, initiators, authentication or sources changed.
    pub targets_changed: Vec<NodeName>,
    pub discovery_changed: bool,
    /// `[[pool]]` tables changed (where `ctl volume` verbs work; nothing running changes).
    pub pools_changed: bool,
    /// Portal groups whose ALUA state changed, with the new state.
    pub alua_changed: Vec<(u16, scsi::AccessState)>,
    pub portal_groups_added: Vec<u16>,
    pub portal_groups_removed: Vec<u16>,
    /// Portal groups whose listen addresses changed.
    pub portal_groups_moved: Vec<u16>,
    /// What the listeners did (filled in when applied: `shared::listening::Plan::lines`).
    pub listeners: Vec<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        *self == Changes::default()
    }

    /// One line per change, for the log and the caller.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(
            self.devices_added
                .iter()
                .map(|d| format!("device {d} added")),
        );
        out.extend(
            self.devices_removed
                .iter()
                .map(|d| format!("device {d} removed")),
        );
        out.extend(
            self.devices_resized
                .iter()
                .map(|(d, n)| format!("device {d} resized to {n} bytes")),
        );
        out.extend(self.devices_offline.iter().map(|(d, offline)| {
            if *offline {
                format!("device {d} taken offline")
            } else {
                format!("device {d} back online")
            }
        }));
        out.extend(
            self.devices_attributes
                .iter()
                .map(|(d, a)| format!("device {d}: {a}")),
        );
        out.extend(
            self.targets_added
                .iter()
                .map(|t| format!("target {t} added")),
        );
        out.extend(
            self.targets_removed
                .iter()
                .map(|t| format!("target {t} removed")),
        );
        out.extend(
            self.targets_changed
                .iter()
                .map(|t| format!("target {t} changed")),
        );
        if self.discovery_changed {
            out.push("discovery authentication changed".into());
        }
        if self.pools_changed {
            out.push("pools changed".into());
        }
        out.extend(self.alua_changed.iter().map(|(tag, state)| {
            format!(
                "portal group {tag} ALUA state {}",
                crate::config::alua_state_name(*state)
            )
        }));
        let tags = |list: &[u16], what: &str| {
            list.iter()
                .map(|t| format!("portal group {t} {what}"))
                .collect::<Vec<_>>()
        };
        out.extend(tags(&self.portal_groups_added, "added"));
        out.extend(tags(&self.portal_groups_removed, "removed"));
        out.extend(tags(&self.portal_groups_moved, "listens elsewhere"));
        out.extend(self.listeners.iter().cloned());
        out
    }
}

/// The difference between the running config `old` and `new`, or every reason `new` cannot be
/// applied without a restart. Both configs are valid (validated whole when loaded).
pub fn diff(old: &Config, new: &Config) -> Result<Changes, Vec<String>> {
    let mut refused = Vec::new();
    let restart = |what: &str| format!("{what} changed: that needs a restart");
    if old.server != new.server {
        refused.push(restart("[server]"));
    }
    if old.limits != new.limits {
        refused.push(restart("[limits]"));
    }
    let mut changes = Changes {
        discovery_changed: old.discovery != new.discovery,
        pools_changed: old.pools != new.pools,
        ..Changes::default()
    };
    if let Err(why) = portal_group_changes(old, new, &mut changes) {
        refused.push(why.to_string());
    }
    // Both configs loaded (names unique): only what follows the devices both begin with can
    // differ, and only that is hashed.
    let same = crate::config::common_prefix(&old.devices, &new.devices);
    let (old_tail, new_tail) = (&old.devices[same..], &new.devices[same..]);
    let old_devices = first_by(old_tail, |d| d.name.as_str());
    let new_devices = first_by(new_tail, |d| d.name.as_str());
    for d in new_tail {
        match old_devices.get(d.name.as_str()).copied() {
            None => changes.devices_added.push(d.name.clone()),
            Some(was) if was == d => {}
            Some(was) => match device_changes(was, d) {
                Ok((size, attributes)) => {
                    if let Some(size) = size {
                        changes.devices_resized.push((d.name.clone(), size));
                    }
                    if was.offline != d.offline {
                        changes.devices_offline.push((d.name.clone(), d.offline));
                    }
                    let named = attributes.into_iter().map(|a| (d.name.clone(), a));
                    changes.devices_attributes.extend(named);
                }
                Err(why) => refused.push(format!("device {}: {why}", d.name)),
            },
        }
    }
    for d in old_tail {
        if !new_devices.contains_key(d.name.as_str()) {
            changes.devices_removed.push(d.name.clone());
        }
    }
    let (old_targets, new_targets) = (
        first_by(&old.targets, |t| &t.iqn),
        first_by(&new.targets, |t| &t.iqn),
    );
    for t in &new.targets {
        match old_targets.get(&t.iqn).copied() {
            None => changes.targets_added.push(t.iqn.clone()),
            Some(was) if was == t => {}
            Some(_) => changes.targets_changed.push(t.iqn.clone()),
        }
    }
    for t in &old.targets {
        if !new_targets.contains_key(&t.iqn) {
            changes.targets_removed.push(t.iqn.clone());
        }
    }
    if refused.is_empty() {
        Ok(changes)
    } else {
        Err(refused)
    }
}

/// Each item of `items` by its key; of items with the same key, the first (as a search from
/// the start finds it: [`Config::device`], [`Config::target`]). Lookups by name in a config
/// of thousands of devices, each O(1) rather than a walk of the list.
pub(crate) fn first_by<'a, T, K: std::hash::Hash + Eq + ?Sized>(
    items: &'a [T],
    key: impl Fn(&'a T) -> &'a K,
) -> HashMap<&'a K, &'a T> {
    let mut map = HashMap::with_capacity(items.len());
    for item in items {
        map.entry(key(item)).or_insert(item);
    }
    map
}

/// The devices of `config` by name ([`first_by`]).
pub(crate) fn devices_by_name(config: &Config) -> HashMap<&str, &Arc<DeviceConfig>> {
    first_by(&config.devices, |d| d.name.as_str())
}

/// How a running device changes: the size to grow it to (None: nothing to do on the store)
/// and the attributes its LU takes. Its medium, block size, NAA designator, provisioning and
/// caching mode are fixed while it runs: changing them is refused (remove the device in one
/// reload and add it back in the next).
fn device_changes(
    was: &DeviceConfig,
    now: &DeviceConfig,
) -> Result<(Option<u64>, Vec<Attribute>), Invalid> {
    let live = DeviceConfig {
        store: now.store.clone(),
        offline: now.offline,
        lineage: now.lineage.clone(),
        read_only: now.read_only,
        write_cache: now.write_cache,
        vendor: now.vendor.clone(),
        product: now.product.clone(),
        serial: now.serial.clone(),
        ..was.clone()
    };
    if live != *now {
        return Err(
            "its medium, block size, naa, thin or cache cannot change while it runs (size, \
             offline, read_only, write_cache, vendor, product and serial can): remove it in \
             one reload and add it back in the next"
                .into(),
        );
    }
    let mut attributes = Vec::new();
    if was.read_only != now.read_only {
        attributes.push(Attribute::ReadOnly(now.read_only));
    }
    if was.write_cache != now.write_cache {
        attributes.push(Attribute::WriteCache(now.write_cache));
    }
    if (&was.vendor, &was.product, &was.serial) != (&now.vendor, &now.product, &now.serial) {
        attributes.push(Attribute::Identity);
    }
    Ok((was.store.resized_to(&now.store)?, attributes))
}

/// What an applied reload did.
#[derive(Debug, Clone)]
pub struct Applied {
    pub generation: u64,
    pub changes: Changes,
}

/// Proof that the one apply lock is held: every change to the running config (a verb, a
/// reload, a save, a volume's commit, a device back from its cluster) is computed and applied
/// under it, from the config of that moment, so none undoes another (docs/OPERATIONS.md,
/// *What a client may rely on*).
pub struct ApplyLock<'a> {
    _held: std::sync::MutexGuard<'a, ()>,
}

/// Takes the apply lock (waits for the change in progress to finish).
pub fn lock(shared: &Shared) -> ApplyLock<'_> {
    ApplyLock {
        _held: shared.reloading.lock().unwrap_or_else(|e| e.into_inner()),
    }
}

/// Re-reads the config file and applies the difference (SIGHUP, `ctl reload`). Changes made
/// with `ctl` and not saved would be lost by it: unless `discard`, it is refused while there
/// are any, listing them ([`ReloadError::Unsaved`]).
pub fn reload_file(
    shared: &Shared,
    source: &ConfigSource,
    discard: bool,
) -> Result<Applied, ReloadError> {
    // The file is read under the lock: a save that lands between reading it and applying it
    // would otherwise be undone by the older text.
    let lock = lock(shared);
    let config = source.load()?;
    let base = config.clone();
    if !discard {
        let unsaved = unsaved_changes(shared, &lock);
        if !unsaved.is_empty() {
            return Err(ReloadError::Unsaved(unsaved));
        }
    }
    let applied = apply_locked(shared, &lock, config)?;
    // Every device of the file opened (or the file dropped it): none is left out.
    let names: Vec<String> = shared
        .left_out()
        .into_iter()
        .map(|out| out.device.name)
        .collect();
    shared.forget_left_out(&names);
    *shared.file_base.lock().unwrap_or_else(|e| e.into_inner()) = Some(FileBase::loaded(base));
    // The file is what runs now: what was unsaved is gone (discarded, or there was none).
    shared.unsaved.clear();
    Ok(applied)
}

/// The `ctl` changes the config file does not hold: those listed as unsaved, unless the
/// running config is the file's again (a change undone by its opposite), when the list is
/// cleared.
pub fn unsaved_changes(shared: &Shared, _lock: &ApplyLock) -> Vec<String> {
    let listed = shared.unsaved.list();
    if listed.is_empty() {
        return listed;
    }
    let base = shared.file_base.lock().unwrap_or_else(|e| e.into_inner());
    let Some(base) = base.as_ref().map(|b| &b.config) else {
        return listed;
    };
    let mut running = shared.config_to_keep();
    // `[server]` holds the command line's overrides and never changes live.
    running.server = base.server.clone();
    if running == *base {
        shared.unsaved.clear();
        return Vec::new();
    }
    listed
}

/// A portal group change among RBD gateways that a reload cannot apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NeedsRestart {
    /// The set of tags, or whether there are gateways at all.
    PortalGroups,
    /// This group's gateway, peer address or listeners.
    PortalGroup(u16),
}

impl std::fmt::Display for NeedsRestart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NeedsRestart::PortalGroups => f.write_str(
                "[[portal_group]] tags or gateways changed among RBD gateways: that needs a restart",
            ),
            NeedsRestart::PortalGroup(tag) => write!(
                f,
                "[[portal_group]] {tag}: its gateway, peer_address or listeners changed among RBD gateways: that needs a restart"
            ),
        }
    }
}

/// How the portal groups change: added, removed, listening elsewhere, in another ALUA state.
/// All of it applies live, except among RBD gateways, whose portal groups name the cluster's
/// members (ship commands and own images through them): there only the ALUA state of a
/// group not a gateway's may change, the rest needs a restart of the gateways.
fn portal_group_changes(
    old: &Config,
    new: &Config,
    changes: &mut Changes,
) -> Result<(), NeedsRestart> {
    let gateways = |c: &Config| {
        c.server.gateway.is_some() || c.portal_groups.iter().any(|p| p.gateway.is_some())
    };
    let tags = |c: &Config| c.portal_groups.iter().map(|p| p.tag).collect::<Vec<_>>();
    if (gateways(old) || gateways(new)) && tags(old) != tags(new) {
        return Err(NeedsRestart::PortalGroups);
    }
    for is in &new.portal_groups {
        let Some(was) = old.portal_groups.iter().find(|p| p.tag == is.tag) else {
            changes.portal_groups_added.push(is.tag);
            continue;
        };
        let listening = |p: &crate::config::PortalGroup| {
            (
                p.listen.clone(),
                p.nvme_listen.clone(),
                p.nvme_discovery_listen.clone(),
            )
        };
        if (&was.gateway, &was.peer_address) != (&is.gateway, &is.peer_address)
            || (gateways(old) && listening(was) != listening(is))
        {
            return Err(NeedsRestart::PortalGroup(is.tag));
        }
        if listening(was) != listening(is) {
            changes.portal_groups_moved.push(is.tag);
        }
        if was.alua_state != is.alua_state {
            changes.alua_changed.push((is.tag, is.alua_state));
        }
    }
    let removed = (old.portal_groups.iter()).filter(|p| !tags(new).contains(&p.tag));
    changes.portal_groups_removed.extend(removed.map(|p| p.tag));
    Ok(())
}

/// [`apply_locked`] of the config `make` derives from the running one, both under the apply
/// lock (a change applied meanwhile is not undone); `on_success` runs under it too, after a
/// successful apply (or one with nothing to change).
pub fn apply_with(
    shared: &Shared,
    make: impl FnOnce(&Config) -> Config,
    on_success: impl FnOnce(&Shared),
) -> Result<Applied, ReloadError> {
    let lock = lock(shared);
    let new = make(&shared.topology().config);
    let applied = apply_locked(shared, &lock, new)?;
    on_success(shared);
    Ok(applied)
}

/// Applies `new`, derived from the running config under the same `lock`, to the running
/// daemon by difference. Everything that can fail (opening added devices, building the
/// topology) happens before anything is visible: on error nothing changed, except that a
/// device grown before a later failure stays grown (growing loses nothing; the error says so).
/// Devices a reload removes, by name, closed once idle.
type Removed = Vec<(String, Arc<OpenDevice>)>;

/// The open devices of the next topology: the running ones less those `changes` removes
/// (returned beside, to close once idle), plus those it adds, opened now.
fn open_devices_after(
    shared: &Shared,
    current: &Topology,
    new: &Config,
    changes: &Changes,
) -> Result<(OpenDevices, Removed), ReloadError> {
    let mut devices: OpenDevices = current.devices.clone();
    let mut removed = Vec::new();
    for name in &changes.devices_removed {
        if let Some(device) = devices.remove(name.as_str()) {
            removed.push((name.clone(), device));
        }
    }
    // An added device is none of those both configs begin with.
    let same = crate::config::common_prefix(&current.config.devices, &new.devices);
    let by_name = first_by(&new.devices[same..], |d| d.name.as_str());
    for name in &changes.devices_added {
        let config = by_name.get(name.as_str()).copied();
        // `diff` lists as added only devices of `new`.
        assert!(
            config.is_some(),
            "device {name}: added but not in the new config"
        );
        let Some(config) = config else { continue };
        devices.insert(
            name.as_str().into(),
            shared.device_context.open(config, new)?,
        );
    }
    Ok((devices, removed))
}

pub fn apply_locked(
    shared: &Shared,
    _lock: &ApplyLock,
    new: Config,
) -> Result<Applied, ReloadError> {
    let current = shared.topology();
    let changes = diff(&current.config, &new).map_err(ReloadError::NeedsRestart)?;
    if changes.is_empty() {
        return Ok(Applied {
            generation: current.generation,
            changes,
        });
    }
    let (devices, removed) = open_devices_after(shared, &current, &new, &changes)?;
    let before = Before {
        topology: &current,
        removed: &changes.devices_removed,
    };
    let topology = Topology::assemble_after(Some(before), new, devices, current.generation + 1)?;
    let mut listeners = shared
        .listening
        .prepare(&crate::topology::portals::listeners(&topology.config))?;
    let mut changes = changes;
    changes.listeners = listeners.lines();
    prepare_attributes(&topology, &changes.devices_attributes)?;
    resize(&topology, &changes.devices_resized)?;
    set_attributes(&topology, &changes.devices_attributes);
    let generation = topology.generation;
    drop(current);
    shared.listening.retire(&mut listeners);
    shared.publish(topology);
    shared.listening.start(listeners);
    for line in changes.lines() {
        tracing::info!(generation, "reload: {line}");
    }
    for (name, offline) in &changes.devices_offline {
        if let Some(device) = shared.topology().devices.get(name.as_str()) {
            set_offline(name, device, *offline);
        }
    }
    for (name, device) in removed {
        close_when_idle(name, device);
    }
    announce_alua_changes(&shared.topology(), &changes.alua_changed);
    Ok(Applied {
        generation,
        changes,
    })
}

/// ASYMMETRIC ACCESS STATE CHANGED for every nexus of every LU a target serves through a
/// portal group whose state changed (an implicit transition, SPC-4 5.15.2.3): multipath
/// initiators read REPORT TARGET PORT GROUPS again and move their I/O. Sessions take the new
/// states with the topology, at their next turn, before they run another command.
fn announce_alua_changes(topology: &Topology, changed: &[(u16, scsi::AccessState)]) {
    let mut told: Vec<*const scsi::LogicalUnit> = Vec::new();
    for target in topology.targets.iter() {
        if !changed
            .iter()
            .any(|(tag, _)| target.portal_groups.contains(tag))
        {
            continue;
        }
        for unit in &target.units {
            if !told.contains(&Arc::as_ptr(unit)) {
                told.push(Arc::as_ptr(unit));
                unit.access_state_changed(None);
            }
        }
    }
}

/// What can fail in changing attributes, before anything changes: a device whose write cache
/// goes off is flushed first, so what it acknowledged from the cache is on the medium. (A new
/// identity cannot fail: the config validated its texts, `diff` refused a new NAA.)
fn prepare_attributes(
    topology: &Topology,
    attributes: &[(String, Attribute)],
) -> Result<(), ReloadError> {
    for (name, attribute) in attributes {
        let Some(device) = topology.devices.get(name.as_str()) else {
            continue;
        };
        if *attribute == Attribute::WriteCache(false) {
            device.unit.flush().map_err(|e| {
                ReloadError::Attribute(format!(
                    "device {name}: cannot turn its write cache off: flushing it failed: {e}"
                ))
            })?;
        }
    }
    Ok(())
}

/// Gives the running LUs their new attributes (each raises its unit attention, see
/// `LogicalUnit::set_*`), just before the topology saying so is published.
fn set_attributes(topology: &Topology, attributes: &[(String, Attribute)]) {
    if attributes.is_empty() {
        return;
    }
    let configs = devices_by_name(&topology.config);
    for (name, attribute) in attributes {
        let (Some(device), Some(config)) = (
            topology.devices.get(name.as_str()),
            configs.get(name.as_str()).copied(),
        ) else {
            continue;
        };
        let unit = &device.unit;
        let outcome = match attribute {
            Attribute::ReadOnly(on) => Ok(unit.set_read_only(*on)),
            Attribute::WriteCache(on) => unit.set_write_cache(*on).map_err(|e| e.to_string()),
            Attribute::Identity => unit.set_identity(crate::topology::lu_identity(config)),
        };
        if let Err(e) = outcome {
            // The flush succeeded in `prepare_attributes` a moment ago; the identity was
            // validated with the config.
            tracing::error!(device = %name, "{attribute}: {e}");
        }
    }
}

/// Grows the devices a reload resizes, before the topology is published. A failure names
/// the devices that grew already (growing loses nothing, so they stay grown).
fn resize(topology: &Topology, resized: &[(String, u64)]) -> Result<(), ReloadError> {
    let mut grown = Vec::new();
    for (name, size) in resized {
        let Some(device) = topology.devices.get(name.as_str()) else {
            continue;
        };
        let was = device.unit.capacity_bytes();
        device.unit.resize(*size).map_err(|e| {
            let mut message = format!("device {name}: cannot resize to {size} bytes: {e}");
            if !grown.is_empty() {
                message.push_str(&format!(
                    "; nothing else changed, but {} grew already",
                    grown.join(", ")
                ));
            }
            ReloadError::Resize(message)
        })?;
        if was != *size {
            grown.push(name.clone());
        }
    }
    Ok(())
}

/// How long taking a device offline waits for the commands it admitted before to finish.
const OFFLINE_DRAIN_WAIT: Duration = Duration::from_secs(30);

/// Takes a device offline (new commands get NOT READY), waits for the commands admitted before
/// to finish and flushes it, so that what its initiators wrote is on the medium when the
/// operator is told it is offline; or brings it back online.
fn set_offline(name: &str, device: &OpenDevice, offline: bool) {
    device.unit.set_offline(offline);
    if !offline {
        return;
    }
    let start = Instant::now();
    while device.unit.in_flight().count() > 0 && start.elapsed() < OFFLINE_DRAIN_WAIT {
        std::thread::sleep(Duration::from_millis(2));
    }
    let still = device.unit.in_flight().count();
    if still > 0 {
        tracing::warn!(
            device = %name,
            "offline: {still} commands still running after {} s; flushing anyway",
            OFFLINE_DRAIN_WAIT.as_secs()
        );
    }
    if let Err(e) = device.unit.flush() {
        tracing::error!(device = %name, "offline: flush failed: {e}");
    }
}

/// How long a removed device waits for sessions to move off it and its commands to finish
/// before it is flushed anyway (its store then closes with its last command).
const REMOVAL_WAIT: Duration = Duration::from_secs(120);

/// Flushes a removed device and lets its store close once nothing else holds its LU: every
/// session has moved to the new topology (within a turn, a second at most when idle) and every
/// command it had in flight has finished.
fn close_when_idle(name: String, device: Arc<OpenDevice>) {
    let spawned = std::thread::Builder::new()
        .name("ferrosan-remove".into())
        .spawn(move || {
            let start = Instant::now();
            // A direct I/O on a worker's ring holds the LU's in-flight count, not the LU.
            let busy = || {
                Arc::strong_count(&device.unit) > 1 || device.unit.in_flight().count() > 0
            };
            while busy() && start.elapsed() < REMOVAL_WAIT {
                std::thread::sleep(Duration::from_millis(50));
            }
            let busy = busy();
            match device.unit.flush() {
                Ok(()) if busy => tracing::warn!(
                    device = %name,
                    "removed device still in use after {} s: flushed; it closes with its last command",
                    REMOVAL_WAIT.as_secs()
                ),
                Ok(()) => tracing::info!(device = %name, "removed device flushed and closed"),
                Err(e) => tracing::error!(device = %name, "removed device: flush failed: {e}"),
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the thread closing a removed device: {e}");
    }
}

/// Saves `running` into the config file at `path` (a symlink is followed): the file is
/// edited where `running` differs from `base`, the file as this daemon last loaded or wrote
/// it (`config::edit`), so comments, order, units, `secret_file` references and edits made to
/// it meanwhile stay; a missing file is written whole. What is written is checked to load
/// first; the previous file is kept as `NAME.bak`. Written atomically (a temporary file in the
/// same directory, fsynced, renamed over it, the directory fsynced): a crash leaves the old
/// file or the new one. `base` becomes the file as saved; a failed save leaves it the file's.
pub fn save_config(
    path: &Path,
    base: &mut Option<FileBase>,
    running: &Config,
    source: Option<&ConfigSource>,
) -> Result<(), SaveError> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let name = path.display().to_string();
    let old = match std::fs::read_to_string(&path) {
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let text = running.to_toml_with_secrets();
            let saved = Config::from_toml_str(&text, &name).map_err(SaveError::WouldNotLoad)?;
            write_atomically(&path, &text, saved.has_inline_secrets())?;
            *base = Some(FileBase::loaded(saved));
            return Ok(());
        }
        Err(e) => return Err(SaveError::io(&path)(e)),
    };
    let was = match base {
        Some(was) => was,
        None => base.insert(FileBase::loaded(
            Config::from_toml_str(&old, &name).map_err(SaveError::FileInvalid)?,
        )),
    };
    let (mut doc, layout) = was.document(&old)?;
    let kept = layout.as_ref().map(|layout| (old.as_str(), layout));
    let rendered = crate::config::edit::merge_into(&mut doc, kept, &was.config, running)?;
    let saved = if layout.is_some() {
        debug_check_own_save(&old, &rendered.text, &was.config, running);
        running.clone()
    } else {
        saved_config(&rendered.text, &old, &name, source)?
    };
    keep_backup(&path, &old)?;
    write_atomically(&path, &rendered.text, saved.has_inline_secrets())?;
    *base = Some(FileBase::written(saved, rendered, doc));
    Ok(())
}

/// The config a save's `text` holds: read by difference from the file's `old` text where
/// that is the text `source` last read (`config::reread`; the read then follows the file),
/// else parsed whole. At 16,000 devices the whole parse was two fifths of a first save.
fn saved_config(
    text: &str,
    old: &str,
    name: &str,
    source: Option<&ConfigSource>,
) -> Result<Config, SaveError> {
    let whole = || Config::from_toml_str(text, name).map_err(SaveError::WouldNotLoad);
    let Some((path, cache)) = source.and_then(|s| Some((s.path.as_deref()?, &s.last_read))) else {
        return whole();
    };
    let mut last = cache.lock().unwrap_or_else(|e| e.into_inner());
    if last.as_ref().is_none_or(|read| read.text() != old) {
        return whole();
    }
    let read =
        crate::config::reread::read(text.to_string(), &path.display().to_string(), last.as_ref())
            .map_err(SaveError::WouldNotLoad)?;
    let config = read.config().clone();
    *last = Some(read);
    Ok(config)
}

/// Debug builds: a save into this daemon's own document writes what merging into the file's
/// text parsed again writes, and that text loads as the running config.
fn debug_check_own_save(old: &str, text: &str, base: &Config, running: &Config) {
    if !cfg!(debug_assertions) {
        return;
    }
    let again = crate::config::edit::merge(old, base, running).expect("the file merges");
    assert_eq!(
        again, text,
        "the kept document and the file's text merge alike"
    );
    let mut loaded = Config::from_toml_str(text, "saved").expect("a save of its own text loads");
    // `[server]` is never written: the file keeps its own, the daemon runs with overrides.
    loaded.server = running.server.clone();
    let mut running = running.clone();
    in_name_order(&mut loaded);
    in_name_order(&mut running);
    assert_eq!(
        loaded.to_toml_with_secrets(),
        running.to_toml_with_secrets(),
        "the saved text loads as the running config"
    );
}

/// Pools, devices and targets by name. Their order means nothing (each is found by name), and
/// the file and the running config may order them differently: one removed and made again
/// between two saves keeps its table's place in the file and is last in the running config.
/// (A target's groups keep their order.)
fn in_name_order(config: &mut Config) {
    config.pools.sort_by(|a, b| a.name.cmp(&b.name));
    config.devices.sort_by(|a, b| a.name.cmp(&b.name));
    config.targets.sort_by(|a, b| a.iqn.cmp(&b.iqn));
}

/// `NAME.bak` beside `path`, with the file's previous text (and no wider mode than it had).
/// The file itself becomes the backup (a link to it renamed over `NAME.bak`; the new text then
/// replaces it at `path`): its text is not written a second time, which at thousands of
/// devices was a third of a save's writing. A directory that takes no links gets a copy.
fn keep_backup(path: &Path, old: &str) -> Result<(), SaveError> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let backup = path.with_file_name(format!("{name}.bak"));
    let link = path.with_file_name(format!(".{name}.bak.tmp"));
    let _ = std::fs::remove_file(&link);
    match std::fs::hard_link(path, &link).and_then(|()| std::fs::rename(&link, &backup)) {
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::debug!("config backup: no link ({e}): copying the file's text");
            let _ = std::fs::remove_file(&link);
            write_atomically(&backup, old, true)
        }
    }
}

/// [`crate::config::edit::write_atomically`], its failure located.
fn write_atomically(path: &Path, text: &str, secret: bool) -> Result<(), SaveError> {
    if path.file_name().is_none() {
        return Err(SaveError::NotAFile(path.to_path_buf()));
    }
    crate::config::edit::write_atomically(path, text, secret)
        .map_err(|(at, e)| SaveError::io(&at)(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "a"
store = "ram"
size = "16M"
[[device]]
name = "f"
store = "file"
path = "/var/tmp/ferrosan-diff-test.img"
size = "32M"
[[target]]
iqn = "iqn.2026-11.test:t"
  [[target.group]]
  name = "g"
  any_initiator = true
  luns = [ { lun = 0, device = "a" }, { lun = 1, device = "f" } ]
"#;

    fn config(text: &str) -> Config {
        Config::from_toml_str(text, "test.toml").unwrap()
    }

    #[test]
    fn saving_follows_a_symlink_keeps_a_backup_and_edits_in_place() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("ferrosan-save-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).unwrap();
        let real = dir.join("real/ferrosan.toml");
        let text = format!("# hand-written\n{BASE}");
        std::fs::write(&real, &text).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
        let link = dir.join("ferrosan.toml");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let base = config(BASE);
        let mut running = base.clone();
        std::sync::Arc::make_mut(&mut running.targets[0]).groups[0]
            .luns
            .retain(|m| m.lun == 0);
        let mut file = Some(FileBase::loaded(base));
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let was = inode(&real);
        save_config(&link, &mut file, &running, None).unwrap();
        assert_eq!(file.map(|f| f.config), Some(running.clone()));
        // The file the save replaced is the backup, not a copy of its text.
        assert_eq!(inode(&dir.join("real/ferrosan.toml.bak")), was);
        assert_ne!(inode(&real), was);
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let now = std::fs::read_to_string(&real).unwrap();
        assert!(now.starts_with("# hand-written\n"), "{now}");
        assert_eq!(config(&now), running);
        assert_eq!(
            std::fs::read_to_string(dir.join("real/ferrosan.toml.bak")).unwrap(),
            text
        );
        assert_eq!(
            std::fs::metadata(&real).unwrap().permissions().mode() & 0o777,
            0o640
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `config` with a copy of its RAM device `a` named `name` (its own NAA and serial).
    fn with_device(config: &Config, name: &str, tag: u8) -> Config {
        let mut next = config.clone();
        let mut device = (*next.devices[0]).clone();
        assert_eq!(device.name, "a");
        device.name = name.into();
        device.serial = name.into();
        *device.naa.last_mut().unwrap() ^= tag;
        next.devices.push(Arc::new(device));
        next
    }

    /// An empty scratch directory of this process and the config path in it.
    fn scratch_config(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("ferrosan-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ferrosan.toml");
        (dir, path)
    }

    /// Saves in a row edit the document the last one wrote (the file still holds its text),
    /// and an edit made to the file in between is parsed, merged and kept.
    #[test]
    fn saves_in_a_row_edit_their_own_document_and_keep_edits_made_between() {
        let (dir, path) = scratch_config("saves");
        std::fs::write(&path, format!("# hand-written\n{BASE}")).unwrap();
        let one = with_device(&config(BASE), "one", 1);
        let mut file = Some(FileBase::loaded(config(BASE)));
        save_config(&path, &mut file, &one, None).unwrap();
        let two = with_device(&one, "two", 2);
        save_config(&path, &mut file, &two, None).unwrap();
        let now = std::fs::read_to_string(&path).unwrap();
        assert!(now.starts_with("# hand-written\n"), "{now}");
        assert_eq!(config(&now), two);
        std::fs::write(&path, format!("{now}# added by hand\n")).unwrap();
        let three = with_device(&two, "three", 3);
        save_config(&path, &mut file, &three, None).unwrap();
        let now = std::fs::read_to_string(&path).unwrap();
        assert!(now.contains("# added by hand"), "{now}");
        assert_eq!(config(&now), three);
        assert_eq!(file.map(|f| f.config), Some(config(&now)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A first save whose file is the text the daemon last read reads what it writes by
    /// difference from that text, and the read follows the file.
    #[test]
    fn a_first_save_reads_what_it_wrote_by_difference() {
        let (dir, path) = scratch_config("first-save");
        std::fs::write(&path, BASE).unwrap();
        let source = ConfigSource {
            path: Some(path.clone()),
            ..ConfigSource::default()
        };
        let loaded = source.read_file().unwrap();
        let one = with_device(&loaded, "one", 1);
        let mut file = Some(FileBase::loaded(loaded));
        save_config(&path, &mut file, &one, Some(&source)).unwrap();
        let now = std::fs::read_to_string(&path).unwrap();
        let last = source.last_read.lock().unwrap();
        let last = last.as_ref().unwrap();
        assert_eq!(last.text(), now, "the read follows the file");
        assert!(last.by_difference().is_some(), "read whole");
        assert_eq!(file.map(|f| f.config), Some(config(&now)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A device removed and made again between two saves keeps its table's place in the
    /// file, where the running config has it last: the save is the running config all the
    /// same (debug builds check it; a seed of the model test found it).
    #[test]
    fn a_device_made_again_between_saves_keeps_its_place_in_the_file() {
        let (dir, path) = scratch_config("again");
        std::fs::write(&path, BASE).unwrap();
        let two = with_device(&with_device(&config(BASE), "x", 1), "b", 2);
        let mut file = Some(FileBase::loaded(config(BASE)));
        save_config(&path, &mut file, &two, None).unwrap();
        let mut again = two.clone();
        again.devices.retain(|d| d.name != "x");
        let again = with_device(&again, "x", 3);
        let names = |c: &Config| c.devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>();
        assert!(names(&again).ends_with(&["b".into(), "x".into()]));
        save_config(&path, &mut file, &again, None).unwrap();
        let mut saved = config(&std::fs::read_to_string(&path).unwrap());
        assert!(names(&saved).ends_with(&["x".into(), "b".into()]));
        let mut running = again.clone();
        in_name_order(&mut saved);
        in_name_order(&mut running);
        assert_eq!(saved, running);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn first_by_finds_what_a_search_from_the_start_finds() {
        let items = [("a", 1), ("b", 2), ("a", 3), ("c", 4)];
        let map = first_by(&items, |(k, _)| *k);
        assert_eq!(map.len(), 3);
        for (key, _) in &items {
            let searched = items.iter().find(|(k, _)| k == key);
            assert_eq!(map.get(key).copied(), searched, "{key}");
        }
        assert!(!map.contains_key("d"));
        let c = config(BASE);
        let by_name = devices_by_name(&c);
        assert_eq!(by_name.len(), 2);
        assert!(std::ptr::eq(&**by_name["f"], c.device("f").unwrap()));
    }

    #[test]
    fn many_devices_added_and_removed_at_once() {
        let old = config(BASE);
        let mut text = BASE
            .replace(
                "[[device]]\nname = \"a\"\nstore = \"ram\"\nsize = \"16M\"\n",
                "",
            )
            .replace("{ lun = 0, device = \"a\" }, ", "");
        for i in 0..50 {
            text.push_str(&format!(
                "\n[[device]]\nname = \"n{i}\"\nstore = \"ram\"\nsize = \"1M\"\n"
            ));
        }
        let new = config(&text);
        let c = diff(&old, &new).unwrap();
        let added: Vec<String> = (0..50).map(|i| format!("n{i}")).collect();
        assert_eq!(c.devices_added, added, "in the new config's order");
        assert_eq!(c.devices_removed, vec!["a"]);
        assert_eq!(c.targets_changed.len(), 1);
        let back = diff(&new, &old).unwrap();
        assert_eq!(back.devices_added, vec!["a"]);
        assert_eq!(back.devices_removed, added);
    }

    #[test]
    fn the_same_config_is_no_change() {
        let c = config(BASE);
        assert!(diff(&c, &c).unwrap().is_empty());
        // Written out and read back: still the same.
        assert!(diff(&c, &config(&c.to_toml())).unwrap().is_empty());
    }

    #[test]
    fn a_file_device_grows_and_never_shrinks() {
        let old = config(BASE);
        let grown = config(&BASE.replace("\"32M\"", "\"64M\""));
        assert_eq!(
            diff(&old, &grown).unwrap().devices_resized,
            vec![("f".to_string(), 64 << 20)]
        );
        let shrunk = config(&BASE.replace("\"32M\"", "\"8M\""));
        let refused = diff(&old, &shrunk).unwrap_err();
        assert!(refused[0].contains("shrinking"), "{refused:?}");
        let ram = config(&BASE.replace("\"16M\"", "\"32M\""));
        assert!(diff(&old, &ram).unwrap_err()[0].contains("RAM"));
    }

    #[test]
    fn alua_states_listeners_and_portal_groups_change_live() {
        let old = config(BASE);
        let standby = config(&BASE.replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3260\"]\nalua_state = \"standby\"",
        ));
        let c = diff(&old, &standby).unwrap();
        assert_eq!(c.alua_changed, vec![(1, scsi::AccessState::Standby)]);
        assert_eq!(c.lines(), vec!["portal group 1 ALUA state standby"]);
        assert!(
            diff(&standby, &old).unwrap().alua_changed
                == vec![(1, scsi::AccessState::ActiveOptimized)]
        );
        let moved = config(&BASE.replace("3260", "3262"));
        assert_eq!(diff(&old, &moved).unwrap().portal_groups_moved, vec![1]);
        // A new state and a new listener at once: both.
        let both = config(&BASE.replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3262\"]\nalua_state = \"standby\"",
        ));
        let c = diff(&old, &both).unwrap();
        assert_eq!((c.alua_changed.len(), c.portal_groups_moved.len()), (1, 1));
        let second = config(&BASE.replace(
            "[[device]]\nname = \"a\"",
            "[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:3263\"]\n[[device]]\nname = \"a\"",
        ));
        assert_eq!(diff(&old, &second).unwrap().portal_groups_added, vec![2]);
        assert_eq!(diff(&second, &old).unwrap().portal_groups_removed, vec![2]);
    }

    #[test]
    fn the_portal_groups_of_rbd_gateways_change_only_their_alua_state() {
        let gateways = |listen: &str| {
            config(&BASE.replace(
                "listen = [\"127.0.0.1:3260\"]",
                &format!("listen = [\"{listen}\"]\ngateway = \"a\"\n[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.2:3260\"]\ngateway = \"b\""),
            ))
        };
        let old = gateways("127.0.0.1:3260");
        let refused = diff(&old, &gateways("127.0.0.1:3261")).unwrap_err();
        assert!(refused[0].contains("RBD gateways"), "{refused:?}");
    }

    #[test]
    fn device_attributes_change_live_its_medium_does_not() {
        let old = config(BASE);
        let set =
            |key: &str| config(&BASE.replace("size = \"16M\"", &format!("size = \"16M\"\n{key}")));
        let cases = [
            ("read_only = true", Attribute::ReadOnly(true)),
            ("write_cache = true", Attribute::WriteCache(true)),
            ("product = \"VM STORE\"", Attribute::Identity),
            ("vendor = \"ACME\"", Attribute::Identity),
            ("serial = \"array-1\"", Attribute::Identity),
        ];
        for (key, attribute) in cases {
            let c = diff(&old, &set(key)).unwrap();
            assert_eq!(
                c.devices_attributes,
                vec![("a".to_string(), attribute)],
                "{key}"
            );
            assert!(c.targets_changed.is_empty(), "{key}: no mapping changes");
        }
        for fixed in [
            "thin = false",
            "naa = \"0x6001405123456789abcdef0123456789\"",
        ] {
            let refused = diff(&old, &set(fixed)).unwrap_err();
            assert!(refused[0].contains("naa, thin"), "{fixed}: {refused:?}");
        }
    }

    #[test]
    fn offline_changes_live_and_alone() {
        let old = config(BASE);
        let offline = config(&BASE.replace("size = \"32M\"", "size = \"32M\"\noffline = true"));
        let c = diff(&old, &offline).unwrap();
        assert_eq!(c.devices_offline, vec![("f".to_string(), true)]);
        assert!(c.devices_resized.is_empty(), "the same size is no resize");
        assert_eq!(c.lines(), vec!["device f taken offline"]);
        let c = diff(&offline, &old).unwrap();
        assert_eq!(c.devices_offline, vec![("f".to_string(), false)]);
        // Offline and grown at once: both.
        let both = config(&BASE.replace("size = \"32M\"", "size = \"64M\"\noffline = true"));
        let c = diff(&old, &both).unwrap();
        assert_eq!(c.devices_resized.len(), 1);
        assert_eq!(c.devices_offline.len(), 1);
        // It survives being written out and read back.
        assert!(diff(&offline, &config(&offline.to_toml()))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn lun_maps_devices_and_targets() {
        let old = config(BASE);
        let mapped = config(&format!(
            "{BASE}\n[[device]]\nname = \"b\"\nstore = \"ram\"\nsize = \"8M\"\n"
        ));
        let c = diff(&old, &mapped).unwrap();
        assert_eq!(c.devices_added, vec!["b"]);
        assert!(
            c.targets_changed.is_empty(),
            "an unmapped device changes no target"
        );
        let unmapped = config(&BASE.replace(", { lun = 1, device = \"f\" }", ""));
        let c = diff(&old, &unmapped).unwrap();
        assert_eq!(c.targets_changed.len(), 1);
        assert!(c.devices_removed.is_empty(), "the device stays, unmapped");
        let c = diff(&unmapped, &old).unwrap();
        assert_eq!(c.targets_changed.len(), 1);
        let renamed = config(&BASE.replace("test:t\"", "test:u\""));
        let c = diff(&old, &renamed).unwrap();
        assert_eq!(c.targets_added.len(), 1);
        assert_eq!(c.targets_removed.len(), 1);
        let initiator = config(&BASE.replace(
            "any_initiator = true",
            "initiators = [\"iqn.2026-11.test:i\"]",
        ));
        assert_eq!(diff(&old, &initiator).unwrap().targets_changed.len(), 1);
    }

    #[test]
    fn what_needs_a_restart_is_refused_whole() {
        let old = config(BASE);
        let limits = config(&format!("[limits]\nmax_sessions = 7\n{BASE}"));
        assert!(diff(&old, &limits).unwrap_err()[0].contains("[limits]"));
        let block = config(&BASE.replace(
            "name = \"a\"\nstore = \"ram\"",
            "name = \"a\"\nstore = \"ram\"\nblock_size = 4096",
        ));
        let refused = diff(&old, &block).unwrap_err();
        assert!(refused[0].contains("device a"), "{refused:?}");
        // Every reason is reported, not just the first.
        let both = config(&format!("[limits]\nmax_sessions = 7\n{BASE}").replace(
            "name = \"a\"\nstore = \"ram\"",
            "name = \"a\"\nstore = \"ram\"\nthin = false",
        ));
        assert_eq!(diff(&old, &both).unwrap_err().len(), 2);
    }
}
