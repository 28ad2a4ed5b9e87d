//! The space devices allocate from: checked every few seconds, its share in use published as
//! a metric, and each time it goes past `space_warning_percent` the device's initiators are
//! told THIN PROVISIONING SOFT THRESHOLD REACHED (38h/07h, SBC-4 4.7.3.7.2; VMware shows it as
//! an out-of-space warning), with a log line, before writes fail with SPACE ALLOCATION FAILED.
//! A file device allocates from its file's filesystem; a volume of an LVM thin pool from the
//! pool's data LV (its own LV is a block device, which the store sees as allocating nothing).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use store::Space;

use super::Topology;
use crate::config::DeviceConfig;
use crate::config::{PoolConfig, PoolKind, StoreKind};
use crate::metrics::Metrics;

/// How often the space is looked at.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Points below the threshold the share must fall before a later crossing warns again (so a
/// share hovering at the threshold does not warn every check).
const REARM_POINTS: u64 = 5;

/// What the space watch keeps between checks: which devices are past the threshold, and
/// the devices grouped by the pool or the filesystem whose space they share. A check that
/// finds a group's space where its members were last told it skips them, and tells only
/// those a change brought:
/// walking 16,000 devices' state cost ~0.05-0.2 s of CPU on this machine, their memory cold
/// since the last walk. A topology change is followed by what it changed (the config's
/// devices compared by identity with those last grouped), not by walking every device.
#[derive(Default)]
pub struct SpaceWatch {
    /// Devices past the threshold now (warned once per crossing).
    past: HashSet<Arc<str>>,
    /// The topology generation the groups follow.
    generation: Option<u64>,
    /// The config's devices as last grouped, in its order, held weakly: their identity is
    /// what a change is found by, and held, an allocation cannot come back as a new device's.
    seen: Vec<Weak<DeviceConfig>>,
    /// The pools they were grouped by; the groups, one per pool, in the same order.
    pools: Vec<PoolConfig>,
    groups: Vec<Group>,
    /// File devices outside pools, grouped by the filesystem their file is on (its `st_dev`):
    /// one member's `statfs` a check answers for all (a `statfs` and a metric update each
    /// cost an idle daemon 31 ms of CPU a second at 16,000 such devices).
    filesystems: HashMap<u64, Group>,
    /// Each such device's filesystem, by identity.
    filesystem_of: HashMap<usize, u64>,
    /// Other open devices outside a pool that shares its space (block devices, RBD images, a
    /// file whose filesystem could not be seen): each looks at its own.
    alone: HashMap<usize, Arc<str>>,
}

/// The devices of one pool that share its space (a directory pool's filesystem, an LVM thin
/// pool's data LV), by their config's identity; the share in use they were last told (per
/// mille, and the threshold), if any; and those not told it yet.
#[derive(Default)]
struct Group {
    members: HashMap<usize, Arc<str>>,
    told: Option<(u64, u64)>,
    /// Members that joined since `told` was told (none before anything was told).
    fresh: HashSet<usize>,
}

/// A device config's identity while the watch holds it (weakly or not).
fn identity(device: *const DeviceConfig) -> usize {
    device as usize
}

impl SpaceWatch {
    /// Looks at every open device of `topology` once: a system call per pool, per filesystem
    /// of file devices outside pools and per other device, and the devices of a pool or a
    /// filesystem whose share in use moved or that joined it.
    pub fn check(&mut self, topology: &Topology, metrics: &Metrics) {
        if self.generation != Some(topology.generation) {
            self.follow(topology);
        }
        let threshold = u64::from(topology.config.limits.space_warning_percent);
        for g in 0..self.groups.len() {
            let Some(space) = pool_space(&self.pools[g]).filter(|s| s.total_bytes > 0) else {
                continue;
            };
            let mut group = std::mem::take(&mut self.groups[g]);
            self.tell(topology, metrics, &mut group, space, threshold);
            self.groups[g] = group;
        }
        let filesystems: Vec<u64> = self.filesystems.keys().copied().collect();
        for dev in filesystems {
            let Some(mut group) = self.filesystems.remove(&dev) else {
                continue;
            };
            if let Some(space) = member_space(topology, &group) {
                self.tell(topology, metrics, &mut group, space, threshold);
            }
            self.filesystems.insert(dev, group);
        }
        let alone: Vec<Arc<str>> = self.alone.values().cloned().collect();
        for name in alone {
            let Some(device) = topology.devices.get(&name) else {
                continue;
            };
            match device.unit.space() {
                Ok(Some(space)) if space.total_bytes > 0 => {
                    self.saw(topology, metrics, &name, space, threshold);
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(device = %name, "cannot see its space: {e}"),
            }
        }
    }

    /// Tells `group`'s members the share in use of the `space` they share: every member when
    /// it moved since they were last told (or the threshold did), else only those that joined
    /// since.
    fn tell(
        &mut self,
        topology: &Topology,
        metrics: &Metrics,
        group: &mut Group,
        space: Space,
        threshold: u64,
    ) {
        let told = (space.used_per_mille(), threshold);
        let fresh = std::mem::take(&mut group.fresh);
        if group.told == Some(told) {
            for name in fresh.iter().filter_map(|id| group.members.get(id)) {
                self.saw(topology, metrics, name, space, threshold);
            }
        } else {
            for name in group.members.values() {
                self.saw(topology, metrics, name, space, threshold);
            }
        }
        group.told = Some(told);
    }

    /// Follows `topology`'s devices: those between the longest runs its config shares with
    /// the devices last grouped, at its start and at its end, leave their groups and the new
    /// ones join theirs, fresh. Other pools than last time: grouped anew.
    fn follow(&mut self, topology: &Topology) {
        let config = &topology.config;
        self.past.retain(|name| topology.devices.contains_key(name));
        self.generation = Some(topology.generation);
        if self.pools != config.pools {
            *self = SpaceWatch {
                past: std::mem::take(&mut self.past),
                generation: self.generation,
                pools: config.pools.clone(),
                groups: config.pools.iter().map(|_| Group::default()).collect(),
                ..SpaceWatch::default()
            };
        }
        let new = &config.devices;
        let (head, tail) = shared_ends(&self.seen, new);
        let gone: Vec<usize> = (self.seen.drain(head..self.seen.len() - tail))
            .map(|w| identity(w.as_ptr()))
            .collect();
        for id in gone {
            self.leave(id);
        }
        let came = &new[head..new.len() - tail];
        for device in came {
            self.join(topology, device);
        }
        let held = came.iter().map(Arc::downgrade);
        self.seen.splice(head..head, held);
        debug_assert_eq!(self.seen.len(), new.len());
    }

    /// Device `id` is gone (or changed): out of its group or of those alone.
    fn leave(&mut self, id: usize) {
        if self.alone.remove(&id).is_some() {
            return;
        }
        if let Some(dev) = self.filesystem_of.remove(&id) {
            if let Some(group) = self.filesystems.get_mut(&dev) {
                group.members.remove(&id);
                group.fresh.remove(&id);
                if group.members.is_empty() {
                    self.filesystems.remove(&dev);
                }
            }
            return;
        }
        for group in &mut self.groups {
            if group.members.remove(&id).is_some() {
                group.fresh.remove(&id);
                return;
            }
        }
    }

    /// `device` came with the topology: into the group of the pool whose space it shares,
    /// fresh, or alone. A device that did not open is not looked at.
    fn join(&mut self, topology: &Topology, device: &Arc<DeviceConfig>) {
        let config = &topology.config;
        let Some((name, _)) = topology.devices.get_key_value(device.name.as_str()) else {
            return;
        };
        let id = identity(Arc::as_ptr(device));
        let pool = config.pool_of(device).and_then(|p| {
            let shares = matches!(p.kind, PoolKind::Dir { .. } | PoolKind::Lvm(_));
            shares.then(|| config.pools.iter().position(|q| std::ptr::eq(q, p)))?
        });
        let group = match pool.and_then(|p| self.groups.get_mut(p)) {
            Some(group) => group,
            None => match filesystem(device) {
                Some(dev) => {
                    self.filesystem_of.insert(id, dev);
                    self.filesystems.entry(dev).or_default()
                }
                None => {
                    self.alone.insert(id, Arc::clone(name));
                    return;
                }
            },
        };
        group.members.insert(id, Arc::clone(name));
        if group.told.is_some() {
            group.fresh.insert(id);
        }
    }

    /// Device `name` allocates from `space`: published, and a crossing of the threshold
    /// warned (logged, the metric, its initiators told) or re-armed.
    fn saw(
        &mut self,
        topology: &Topology,
        metrics: &Metrics,
        name: &Arc<str>,
        space: Space,
        threshold: u64,
    ) {
        metrics.device_space_used(name, space.used_bytes as f64 / space.total_bytes as f64);
        let percent = space.used_percent();
        let Some(now) = crossing(self.past.contains(name), percent, threshold) else {
            return;
        };
        if !now {
            self.past.remove(name);
            tracing::info!(device = %name, used_percent = percent, space_warning_percent = threshold, "device space back below its warning threshold");
            return;
        }
        self.past.insert(Arc::clone(name));
        let free_bytes = space.total_bytes - space.used_bytes.min(space.total_bytes);
        tracing::warn!(device = %name, used_percent = percent, space_warning_percent = threshold, free_bytes, "device space past its warning threshold: initiators told THIN PROVISIONING SOFT THRESHOLD REACHED; writes fail once it is full");
        metrics.device_space_warning(name);
        if let Some(device) = topology.devices.get(name) {
            device.unit.space_threshold_reached();
        }
    }
}

/// How many of `seen` and `new` are the same allocations at the start (head) and, of the
/// rest, at the end (tail): what lies between changed.
fn shared_ends<T>(seen: &[Weak<T>], new: &[Arc<T>]) -> (usize, usize) {
    let same = |(was, is): (&Weak<T>, &Arc<T>)| std::ptr::eq(was.as_ptr(), Arc::as_ptr(is));
    let head = seen.iter().zip(new).take_while(|&p| same(p)).count();
    let room = seen.len().min(new.len()) - head;
    let tail = (seen.iter().rev().zip(new.iter().rev()))
        .take(room)
        .take_while(|&p| same(p))
        .count();
    (head, tail)
}

/// The filesystem a file device's file is on (its `st_dev`), looked at once as it joins;
/// None for other devices, a block device, or a file that cannot be seen (it then looks at its
/// own space).
fn filesystem(device: &DeviceConfig) -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let StoreKind::File { path, .. } = &device.store else {
        return None;
    };
    // A `file` device may name a block device, which allocates from nothing.
    let seen = std::fs::metadata(path).ok()?;
    (!seen.file_type().is_block_device()).then(|| seen.dev())
}

/// The space of a filesystem group: the first member's that answers (through its open file:
/// the path may have been renamed or removed meanwhile).
fn member_space(topology: &Topology, group: &Group) -> Option<Space> {
    let mut errors = 0;
    for name in group.members.values() {
        let Some(device) = topology.devices.get(name) else {
            continue;
        };
        match device.unit.space() {
            Ok(Some(space)) if space.total_bytes > 0 => return Some(space),
            Ok(_) => {}
            Err(e) if errors == 0 => {
                errors += 1;
                tracing::debug!(device = %name, "cannot see its space: {e}");
            }
            Err(_) => {}
        }
    }
    None
}

/// A pool's shared space: a directory pool's filesystem, `statfs`'d as a file device's own
/// would be, or an LVM thin pool's data LV, asked of `lvs`. None when it cannot answer
/// (its volumes skipped this round, as a filesystem that cannot answer) or for an RBD pool,
/// whose images each report their cluster.
fn pool_space(pool: &PoolConfig) -> Option<Space> {
    let seen = match &pool.kind {
        PoolKind::Dir { path } => store::path_space(path).map_err(|e| e.to_string()),
        PoolKind::Lvm(_) => pool
            .medium()
            .capacity()
            .map(|c| Space {
                total_bytes: c.total_bytes,
                used_bytes: c.total_bytes - c.available_bytes,
            })
            .map_err(|e| e.to_string()),
        PoolKind::Rbd { .. } => return None,
    };
    match seen {
        Ok(space) => {
            tracing::debug!(pool = %pool.name, total_bytes = space.total_bytes, used_bytes = space.used_bytes, "pool space");
            Some(space)
        }
        Err(e) => {
            tracing::debug!(pool = %pool.name, "cannot see the pool's space: {e}");
            None
        }
    }
}

/// Whether a device that was `past` the threshold (percent, 0 = off) is now past it
/// (`Some(true)`: it crossed up), back below it by the re-arm margin (`Some(false)`), or
/// neither changed (`None`).
fn crossing(past: bool, percent: u64, threshold: u64) -> Option<bool> {
    if threshold == 0 {
        return past.then_some(false);
    }
    if !past && percent >= threshold {
        Some(true)
    } else if past && percent + REARM_POINTS < threshold {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_found_between_the_ends_both_configs_share() {
        let devices = |n: usize| (0..n).map(Arc::new).collect::<Vec<_>>();
        let held = |v: &[Arc<usize>]| v.iter().map(Arc::downgrade).collect::<Vec<_>>();
        let was = devices(6);
        let seen = held(&was);
        assert_eq!(shared_ends(&seen, &was), (6, 0), "nothing changed");
        let mut added = was.clone();
        added.push(Arc::new(6));
        assert_eq!(shared_ends(&seen, &added), (6, 0), "one appended");
        let mut inserted = was.clone();
        inserted.insert(2, Arc::new(9));
        assert_eq!(shared_ends(&seen, &inserted), (2, 4), "one inserted");
        let mut removed = was.clone();
        removed.remove(3);
        assert_eq!(shared_ends(&seen, &removed), (3, 2), "one removed");
        let mut changed = was.clone();
        changed[4] = Arc::new(4);
        assert_eq!(shared_ends(&seen, &changed), (4, 1), "equal, not the same");
        assert_eq!(shared_ends(&seen, &devices(6)), (0, 0), "all new");
        assert_eq!(shared_ends(&seen, &[]), (0, 0), "all gone");
        assert_eq!(shared_ends(&[], &was), (0, 0), "the first look");
    }

    #[test]
    fn file_devices_outside_pools_are_grouped_by_their_filesystem() {
        let dir = std::env::temp_dir().join(format!("ferrosan-space-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str| {
            format!(
                "[[device]]\nname = \"{name}\"\nstore = \"file\"\npath = \"{}\"\nsize = \"1M\"\n",
                dir.join(format!("{name}.img")).display()
            )
        };
        let config = format!(
            "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n{}{}\
             [[device]]\nname = \"r\"\nstore = \"ram\"\nsize = \"1M\"\n\
             [[target]]\niqn = \"iqn.2026-12.test:t\"\n  [[target.group]]\n  name = \"all\"\n  \
             any_initiator = true\n  luns = [ {{ lun = 0, device = \"a\" }} ]\n",
            file("a"),
            file("b"),
        );
        let super::super::testing::Opened {
            topology, metrics, ..
        } = super::super::testing::opened(&config);
        let mut watch = SpaceWatch::default();
        watch.check(&topology, &metrics);
        assert_eq!(watch.filesystems.len(), 1, "one filesystem");
        let group = watch.filesystems.values().next().unwrap();
        let mut members: Vec<&str> = group.members.values().map(|n| &**n).collect();
        members.sort_unstable();
        assert_eq!(members, ["a", "b"]);
        assert!(group.told.is_some(), "told its share");
        assert_eq!(watch.alone.len(), 1, "the RAM device looks at its own");
        let text = metrics.render();
        for name in ["a", "b"] {
            let series = format!("ferrosan_device_space_used_ratio{{device=\"{name}\"}}");
            assert!(text.contains(&series), "{name}: {text}");
        }
        // Gone from the config, a device leaves its group; the last one takes the group along.
        for id in watch.filesystem_of.keys().copied().collect::<Vec<_>>() {
            watch.leave(id);
        }
        assert!(watch.filesystems.is_empty() && watch.filesystem_of.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_crossing_warns_once_and_rearms_only_well_below() {
        assert_eq!(crossing(false, 89, 90), None);
        assert_eq!(crossing(false, 90, 90), Some(true));
        assert_eq!(crossing(true, 95, 90), None, "once per crossing");
        assert_eq!(crossing(true, 86, 90), None, "hovering near it");
        assert_eq!(crossing(true, 84, 90), Some(false));
        assert_eq!(crossing(false, 100, 0), None, "off");
        assert_eq!(crossing(true, 100, 0), Some(false), "turned off: re-armed");
    }
}
