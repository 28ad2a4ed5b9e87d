//! The space devices allocate from: checked every few seconds, its share in use published as
//! a metric, and each time it goes past `space_warning_percent` the device's initiators are
//! told THIN PROVISIONING SOFT THRESHOLD REACHED (38h/07h, SBC-4 4.7.3.7.2; VMware shows it as
//! an out-of-space warning), with a log line, before writes fail with SPACE ALLOCATION FAILED.
//! A file device allocates from its file's filesystem; a volume of an LVM thin pool from the
//! pool's data LV (its own LV is a block device, which the store sees as allocating nothing).

use std::collections::HashMap;
use std::time::Duration;

use store::Space;

use super::Topology;
use crate::config::{Config, PoolKind};
use crate::metrics::Metrics;

/// How often the space is looked at.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Points below the threshold the share must fall before a later crossing warns again (so a
/// share hovering at the threshold does not warn every check).
const REARM_POINTS: u64 = 5;

/// Which devices are past the threshold now (by name): warned once per crossing.
#[derive(Default)]
pub struct SpaceWatch {
    past: HashMap<String, bool>,
}

impl SpaceWatch {
    /// Looks at every open device of `topology` once.
    pub fn check(&mut self, topology: &Topology, metrics: &Metrics) {
        let threshold = u64::from(topology.config.limits.space_warning_percent);
        self.past
            .retain(|name, _| topology.devices.contains_key(name.as_str()));
        let pooled = thin_pool_spaces(&topology.config);
        for (name, device) in &topology.devices {
            let seen = match pooled.get(&**name) {
                Some(space) => Ok(*space),
                None => device.unit.space(),
            };
            let space = match seen {
                Ok(Some(space)) if space.total_bytes > 0 => space,
                Ok(_) => continue,
                Err(e) => {
                    tracing::debug!(device = %name, "cannot see its space: {e}");
                    continue;
                }
            };
            metrics.device_space_used(name, space.used_bytes as f64 / space.total_bytes as f64);
            let percent = space.used_percent();
            let past = self.past.entry(name.to_string()).or_insert(false);
            let Some(now) = crossing(*past, percent, threshold) else {
                continue;
            };
            *past = now;
            if now {
                let free_bytes = space.total_bytes - space.used_bytes.min(space.total_bytes);
                tracing::warn!(device = %name, used_percent = percent, space_warning_percent = threshold, free_bytes, "device space past its warning threshold: initiators told THIN PROVISIONING SOFT THRESHOLD REACHED; writes fail once it is full");
                metrics.device_space_warning(name);
                device.unit.space_threshold_reached();
            } else {
                tracing::info!(device = %name, used_percent = percent, space_warning_percent = threshold, "device space back below its warning threshold");
            }
        }
    }
}

/// The space of each device that is a volume of an LVM thin pool (by name): its pool's data
/// LV, asked of `lvs` once per pool. A pool `lvs` cannot answer for gives its volumes `None`
/// (skipped this round, as a filesystem that cannot answer).
fn thin_pool_spaces(config: &Config) -> HashMap<&str, Option<Space>> {
    let mut pools: HashMap<&str, Option<Space>> = HashMap::new();
    let mut spaces = HashMap::new();
    for device in &config.devices {
        let Some(pool) = config.pool_of(device) else {
            continue;
        };
        if !matches!(pool.kind, PoolKind::Lvm(_)) {
            continue;
        }
        let space = *pools
            .entry(pool.name.as_str())
            .or_insert_with(|| match pool.medium().capacity() {
                Ok(c) => {
                    tracing::debug!(pool = %pool.name, total_bytes = c.total_bytes, available_bytes = c.available_bytes, "thin pool space");
                    Some(Space {
                        total_bytes: c.total_bytes,
                        used_bytes: c.total_bytes - c.available_bytes,
                    })
                }
                Err(e) => {
                    tracing::debug!(pool = %pool.name, "cannot see the thin pool's space: {e}");
                    None
                }
            });
        spaces.insert(device.name.as_str(), space);
    }
    spaces
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
