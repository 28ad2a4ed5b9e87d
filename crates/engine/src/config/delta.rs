//! Validation by difference: a config edited from one that loaded is checked in time that
//! grows with the edit, not with the config (an orchestrator's `volume create` at 4,000
//! volumes costs what it costs at 10).
//!
//! The rule stays [`Config::revalidated`]'s: the result is the config that loading
//! `to_toml_with_secrets()` of the edit gives. What a device's validity depends on is its own
//! table, the `[server]` (identity seed, device roots), and which names, media and NAAs the
//! other devices hold; what a LUN map's validity depends on is which device names exist. So
//! when only devices changed (added, removed or edited), the new and edited devices are
//! validated alone, in a config of their own beside the same `[server]`, then compared with
//! the others for a name, a medium or an NAA held twice, and the LUN maps are searched for a
//! device that is gone. Anything else, and every refusal (whose errors must name the places
//! the whole way names), goes the whole way. Debug builds check each answer against it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::{Config, ConfigErrors, DeviceConfig, StoreKind};

/// `edited` (an edit of `base`, which loaded) validated; see the module's comment.
pub(super) fn revalidate_from(
    mut edited: Config,
    base: &Config,
    file_name: &str,
) -> Result<Config, ConfigErrors> {
    #[cfg(debug_assertions)]
    let whole = edited.revalidated(file_name);
    if !by_difference(&mut edited, base, file_name) {
        return edited.revalidated(file_name);
    }
    #[cfg(debug_assertions)]
    assert!(
        whole.as_ref() == Ok(&edited),
        "validation by difference differs from the whole: {whole:?}"
    );
    Ok(edited)
}

/// Whether the difference from `base` shows `edited` valid; if so, `edited` is what the
/// whole way resolves it to (its new and edited devices resolved, keeping their origins; the
/// rest resolved around the devices when more than devices changed). False, with `edited`
/// untouched, when it must go the whole way (the `[server]` changed, or something is refused).
pub(super) fn by_difference(edited: &mut Config, base: &Config, file_name: &str) -> bool {
    // The `[server]` (identity seed, device roots) is what every device is resolved beside.
    if edited.server != base.server {
        return false;
    }
    let Some(changed) = changed_devices(edited, base) else {
        return false;
    };
    let Some(resolved) = changed_alone(edited, base, &changed, file_name) else {
        return false;
    };
    if !held_once(edited, &changed, &resolved) {
        return false;
    }
    let devices_only = edited.limits == base.limits
        && edited.portal_groups == base.portal_groups
        && edited.pools == base.pools
        && edited.discovery == base.discovery
        && edited.targets == base.targets;
    let mut devices = edited.devices.clone();
    for (i, device) in changed.into_iter().zip(resolved) {
        let origin = devices[i].origin.clone();
        devices[i] = Arc::new(DeviceConfig {
            origin,
            ..Arc::unwrap_or_clone(device)
        });
    }
    if devices_only {
        edited.devices = devices;
        return true;
    }
    // Targets, pools, portal groups, limits or discovery changed: those resolved whole, around
    // the devices (each valid now), which is what a LUN map's, a CHAP user's or an ALUA
    // state's change costs, not thousands of devices.
    let around = Config {
        devices,
        ..edited.clone()
    };
    match super::file::revalidate_around_devices(&around, file_name) {
        Some(config) => {
            *edited = config;
            true
        }
        None => false,
    }
}

/// The positions of `edited`'s devices that are new or differ from `base`'s of their name;
/// None if a name is held twice or a device a LUN map of `edited` names is gone. Only what follows the
/// devices both begin with is hashed (names are unique in `base`).
fn changed_devices(edited: &Config, base: &Config) -> Option<Vec<usize>> {
    let same = common_prefix(&edited.devices, &base.devices);
    let mut was: HashMap<&str, (&Arc<DeviceConfig>, bool)> = base.devices[same..]
        .iter()
        .map(|d| (d.name.as_str(), (d, false)))
        .collect();
    let (mut changed, mut new) = (Vec::new(), Vec::new());
    for (i, d) in edited.devices.iter().enumerate().skip(same) {
        match was.get_mut(d.name.as_str()) {
            Some((_, true)) => return None,
            Some((before, seen)) => {
                *seen = true;
                if *before != d {
                    changed.push(i);
                }
            }
            None => {
                changed.push(i);
                new.push(d.name.as_str());
            }
        }
    }
    // A new name may be one of the devices both begin with: held twice.
    if named_in(&edited.devices[..same], &new) {
        return None;
    }
    let gone: HashSet<&str> = was
        .iter()
        .filter(|(_, (_, seen))| !seen)
        .map(|(name, _)| *name)
        .collect();
    let maps_gone = !gone.is_empty()
        && edited
            .targets
            .iter()
            .flat_map(|t| &t.groups)
            .flat_map(|g| &g.luns)
            .any(|l| gone.contains(l.device.as_str()));
    (!maps_gone).then_some(changed)
}

/// Whether one of `devices` is named one of `names`: compared in turn for a few names (a
/// verb's), through a set for more.
fn named_in(devices: &[Arc<DeviceConfig>], names: &[&str]) -> bool {
    if names.len() <= 8 {
        return devices.iter().any(|d| names.contains(&d.name.as_str()));
    }
    let names: HashSet<&str> = names.iter().copied().collect();
    devices.iter().any(|d| names.contains(d.name.as_str()))
}

/// The devices at `changed` validated alone, beside `base`'s `[server]`, limits and pools:
/// each as the whole way resolves it (defaults applied, identity derived), or None if any
/// is refused (a name, medium or NAA held twice among them included).
fn changed_alone(
    edited: &Config,
    base: &Config,
    changed: &[usize],
    file_name: &str,
) -> Option<Vec<Arc<DeviceConfig>>> {
    if changed.is_empty() {
        return Some(Vec::new());
    }
    let devices = changed
        .iter()
        .map(|&i| Arc::clone(&edited.devices[i]))
        .collect();
    alone(base, devices, file_name)
}

/// `devices` validated in a config of their own beside `base`'s `[server]`, limits and
/// pools; None if any is refused.
fn alone(
    base: &Config,
    devices: Vec<Arc<DeviceConfig>>,
    file_name: &str,
) -> Option<Vec<Arc<DeviceConfig>>> {
    let count = devices.len();
    let alone = Config {
        server: base.server.clone(),
        limits: base.limits.clone(),
        portal_groups: base.portal_groups.clone(),
        pools: base.pools.clone(),
        devices,
        targets: Vec::new(),
        discovery: base.discovery.clone(),
    };
    let resolved = super::file::revalidate(&alone, file_name).ok()?;
    debug_assert_eq!(resolved.devices.len(), count);
    Some(resolved.devices)
}

/// Whether no device at `changed` (`resolved`: as validated alone) shares a medium or an NAA
/// with a device of `edited` that did not change (the changed ones among themselves were
/// checked together, alone).
fn held_once(edited: &Config, changed: &[usize], resolved: &[Arc<DeviceConfig>]) -> bool {
    if changed.is_empty() {
        return true;
    }
    let new: HashSet<usize> = changed.iter().copied().collect();
    let others = edited
        .devices
        .iter()
        .enumerate()
        .filter(|(i, _)| !new.contains(i))
        .map(|(_, d)| &**d);
    !clash(resolved, others)
}

/// Whether a device of `mine` shares a medium or an NAA with one of `others`.
fn clash<'a>(
    mine: &[Arc<DeviceConfig>],
    mut others: impl Iterator<Item = &'a DeviceConfig>,
) -> bool {
    others.any(|other| {
        mine.iter()
            .any(|d| shared_medium(d, other) || shared_naa(d, other))
    })
}

/// Whether `base` (a config that loaded) with `device` added loads: `Ok`, or the errors the
/// whole way gives; in time that grows with `base` only by a comparison a device.
pub(super) fn check_added(
    base: &Config,
    device: &DeviceConfig,
    file_name: &str,
) -> Result<(), ConfigErrors> {
    let quick = base.devices.iter().all(|d| d.name != device.name)
        && alone(base, vec![Arc::new(device.clone())], file_name)
            .is_some_and(|resolved| !clash(&resolved, base.devices.iter().map(|d| &**d)));
    let whole = || {
        let mut edited = base.clone();
        edited.devices.push(Arc::new(device.clone()));
        edited.revalidated(file_name).map(drop)
    };
    #[cfg(debug_assertions)]
    if quick {
        assert!(whole().is_ok(), "a device added: by difference, not whole");
    }
    match quick {
        true => Ok(()),
        false => whole(),
    }
}

/// Whether two devices use one medium, as the whole way tells it (paths as `PathBuf`s, equal
/// by their components): a file's or block device's path, an RBD image by `POOL/IMAGE`.
/// Paths whose last components differ are told apart without walking the rest.
fn shared_medium(a: &DeviceConfig, b: &DeviceConfig) -> bool {
    use StoreKind::{Block, File, Rbd};
    match (&a.store, &b.store) {
        (File { path: p, .. } | Block { path: p }, File { path: q, .. } | Block { path: q }) => {
            !named_apart(p, q) && p == q
        }
        (Rbd(x), Rbd(y)) => x.pool == y.pool && x.image == y.image,
        _ => false,
    }
}

/// Whether the bytes after the last `/` of each path are a plain name (not empty, `.` or
/// `..`) and differ: then the paths' last components differ, and so do the paths, without
/// walking their components (thousands of paths of one pool share all but the last).
fn named_apart(p: &std::path::Path, q: &std::path::Path) -> bool {
    matches!((last_name(p), last_name(q)), (Some(a), Some(b)) if a != b)
}

/// The bytes after a path's last `/` if they are a plain name (not empty, `.` or `..`).
fn last_name(p: &std::path::Path) -> Option<&[u8]> {
    use std::os::unix::ffi::OsStrExt as _;
    let bytes = p.as_os_str().as_bytes();
    let name = bytes.rsplit(|&b| b == b'/').next().unwrap_or(bytes);
    (!matches!(name, b"" | b"." | b"..")).then_some(name)
}

fn shared_naa(a: &DeviceConfig, b: &DeviceConfig) -> bool {
    !a.naa.is_empty() && a.naa == b.naa
}

/// How many items at the start of `a` and `b` are equal: what a change left alone where
/// verbs append or remove near the end, compared in order without hashing.
pub(crate) fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
