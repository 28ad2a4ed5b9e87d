//! The space devices allocate from: checked every few seconds, its share in use published as
//! a metric, and each time it goes past `space_warning_percent` the device's initiators are
//! told THIN PROVISIONING SOFT THRESHOLD REACHED (38h/07h, SBC-4 4.7.3.7.2; VMware shows it as
//! an out-of-space warning), with a log line, before writes fail with SPACE ALLOCATION FAILED.
//! A file device allocates from its file's filesystem; a volume of an LVM thin pool from the
//! pool's data LV (its own LV is a block device, which the store sees as allocating nothing).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use store::Space;

use super::Topology;
use crate::config::{PoolConfig, PoolKind};
use crate::metrics::Metrics;

/// How often the space is looked at.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Points below the threshold the share must fall before a later crossing warns again (so a
/// share hovering at the threshold does not warn every check).
const REARM_POINTS: u64 = 5;

/// What the space watch keeps between checks: which devices are past the threshold, and
/// the devices grouped by the pool whose space they share (made again when the topology
/// changes). A check that finds a pool's space where its volumes were last told it skips
/// them: walking 16,000 devices' state every 5 s cost ~0.2 s of CPU a check on this machine,
/// their memory cold since the last walk.
#[derive(Default)]
pub struct SpaceWatch {
    /// Devices past the threshold now (warned once per crossing).
    past: HashSet<Arc<str>>,
    /// The topology generation `groups` and `alone` were made from.
    generation: Option<u64>,
    groups: Vec<Group>,
    /// Open devices outside a pool whose space is looked at once: each looks at its own.
    alone: Vec<Arc<str>>,
}

/// The open devices of one pool that share its space (a directory pool's filesystem, an LVM
/// thin pool's data LV), and the share in use they were last told (per mille), if any.
struct Group {
    pool: usize,
    devices: Vec<Arc<str>>,
    told: Option<(u64, u64)>,
}

impl SpaceWatch {
    /// Looks at every open device of `topology` once: a system call per pool and per device
    /// outside pools, and the devices of a pool whose share in use moved.
    pub fn check(&mut self, topology: &Topology, metrics: &Metrics) {
        if self.generation != Some(topology.generation) {
            self.regroup(topology);
        }
        let threshold = u64::from(topology.config.limits.space_warning_percent);
        for g in 0..self.groups.len() {
            // The groups were made from this generation's config, so the pool is there.
            let Some(pool) = topology.config.pools.get(self.groups[g].pool) else {
                debug_assert!(false, "a group's pool is not in its generation's config");
                continue;
            };
            let Some(space) = pool_space(pool).filter(|s| s.total_bytes > 0) else {
                continue;
            };
            let told = (space.used_per_mille(), threshold);
            if self.groups[g].told == Some(told) {
                continue;
            }
            self.groups[g].told = Some(told);
            for name in std::mem::take(&mut self.groups[g].devices) {
                self.saw(topology, metrics, &name, space, threshold);
                self.groups[g].devices.push(name);
            }
        }
        for i in 0..self.alone.len() {
            let name = Arc::clone(&self.alone[i]);
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

    /// Groups the open devices of `topology` by the pool they share space with.
    fn regroup(&mut self, topology: &Topology) {
        let config = &topology.config;
        self.past.retain(|name| topology.devices.contains_key(name));
        let mut by_pool: HashMap<usize, Vec<Arc<str>>> = HashMap::new();
        self.alone.clear();
        for device in &config.devices {
            let Some((name, _)) = topology.devices.get_key_value(device.name.as_str()) else {
                continue;
            };
            let pool = config.pool_of(device).and_then(|p| {
                let shares = matches!(p.kind, PoolKind::Dir { .. } | PoolKind::Lvm(_));
                shares.then(|| config.pools.iter().position(|q| std::ptr::eq(q, p)))?
            });
            match pool {
                Some(pool) => by_pool.entry(pool).or_default().push(Arc::clone(name)),
                None => self.alone.push(Arc::clone(name)),
            }
        }
        self.groups = by_pool
            .into_iter()
            .map(|(pool, devices)| Group {
                pool,
                devices,
                told: None,
            })
            .collect();
        self.generation = Some(topology.generation);
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
