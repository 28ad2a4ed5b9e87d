//! Reload by difference. [`diff`] compares the running config with a new one and says what
//! changes, or why the new one cannot be applied live (a pure function, unit-tested);
//! [`apply`] is the only place with effects: it opens added devices, grows resized ones,
//! publishes the next topology and closes removed devices once their last command is done.
//! Sessions move to the new topology at their next turn (`dataplane/backend.rs`, `follow_topology`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{ReloadError, SaveError};
use crate::config::{Config, ConfigSource, DeviceConfig, Invalid, IscsiName};
use crate::shared::Shared;
use crate::topology::{OpenDevice, Topology};

/// What a reload changes, by kind. Empty: the new config is the running one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub devices_added: Vec<String>,
    pub devices_removed: Vec<String>,
    /// Device name and its new size in bytes.
    pub devices_resized: Vec<(String, u64)>,
    /// Device name and whether it goes offline (`true`) or back online.
    pub devices_offline: Vec<(String, bool)>,
    pub targets_added: Vec<IscsiName>,
    pub targets_removed: Vec<IscsiName>,
    /// Targets whose groups, LUN maps, initiators, authentication or sources changed.
    pub targets_changed: Vec<IscsiName>,
    pub discovery_changed: bool,
    /// Portal groups whose ALUA state changed, with the new state.
    pub alua_changed: Vec<(u16, scsi::AccessState)>,
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
        out.extend(
            self.alua_changed
                .iter()
                .map(|(tag, state)| format!("portal group {tag} ALUA state {state:?}")),
        );
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
        ..Changes::default()
    };
    match alua_changes(old, new) {
        Some(alua) => changes.alua_changed = alua,
        None => refused.push(restart("[[portal_group]] (tags, listeners, gateways)")),
    }
    for d in &new.devices {
        match old.device(&d.name) {
            None => changes.devices_added.push(d.name.clone()),
            Some(was) if was == d => {}
            Some(was) => {
                match resized(was, d) {
                    Ok(Some(size)) => changes.devices_resized.push((d.name.clone(), size)),
                    Ok(None) => {}
                    Err(why) => refused.push(format!("device {}: {why}", d.name)),
                }
                if was.offline != d.offline {
                    changes.devices_offline.push((d.name.clone(), d.offline));
                }
            }
        }
    }
    for d in &old.devices {
        if new.device(&d.name).is_none() {
            changes.devices_removed.push(d.name.clone());
        }
    }
    for t in &new.targets {
        match old.target(&t.iqn) {
            None => changes.targets_added.push(t.iqn.clone()),
            Some(was) if was == t => {}
            Some(_) => changes.targets_changed.push(t.iqn.clone()),
        }
    }
    for t in &old.targets {
        if new.target(&t.iqn).is_none() {
            changes.targets_removed.push(t.iqn.clone());
        }
    }
    if refused.is_empty() {
        Ok(changes)
    } else {
        Err(refused)
    }
}

/// How a device's size changed, when only its size and state may have: `Ok(Some(bytes))` to
/// grow it to, `Ok(None)` for nothing to do on the store. Anything else changing under a
/// running LU (its medium, block size, identity, caching) is refused: remove the device in one
/// reload and add it back in the next.
fn resized(was: &DeviceConfig, now: &DeviceConfig) -> Result<Option<u64>, Invalid> {
    let same_but_size_and_state = DeviceConfig {
        store: now.store.clone(),
        offline: now.offline,
        ..was.clone()
    };
    if same_but_size_and_state != *now {
        return Err(
            "only `size` and `offline` can change while it runs (its medium, block size, \
             identity or caching cannot): remove it in one reload and add it back in the next"
                .into(),
        );
    }
    was.store.resized_to(&now.store)
}

/// What an applied reload did.
#[derive(Debug, Clone)]
pub struct Applied {
    pub generation: u64,
    pub changes: Changes,
}

/// Re-reads the config file and applies the difference (SIGHUP, `ctl reload`).
pub fn reload_file(shared: &Shared, source: &ConfigSource) -> Result<Applied, ReloadError> {
    let config = source.load()?;
    let base = config.clone();
    apply_with(
        shared,
        |_| config,
        |shared| {
            // Every device of the file opened (or the file dropped it): none is left out.
            let names: Vec<String> = shared
                .left_out()
                .into_iter()
                .map(|out| out.device.name)
                .collect();
            shared.forget_left_out(&names);
            *shared.file_base.lock().unwrap_or_else(|e| e.into_inner()) = Some(base);
        },
    )
}

/// The portal groups whose ALUA state changed, when nothing else of them did (None: something
/// else did, which needs a restart: listeners are bound at start).
fn alua_changes(old: &Config, new: &Config) -> Option<Vec<(u16, scsi::AccessState)>> {
    if old.portal_groups.len() != new.portal_groups.len() {
        return None;
    }
    let mut changed = Vec::new();
    for (was, is) in old.portal_groups.iter().zip(&new.portal_groups) {
        let same_but_state = crate::config::PortalGroup {
            alua_state: was.alua_state,
            ..is.clone()
        };
        if same_but_state != *was {
            return None;
        }
        if was.alua_state != is.alua_state {
            changed.push((is.tag, is.alua_state));
        }
    }
    Some(changed)
}

/// Applies `new` to the running daemon by difference. Everything that can fail (opening added
/// devices, building the topology) happens before anything is visible: on error nothing
/// changed, except that a device grown before a later failure stays grown (growing loses
/// nothing; the error says so).
pub fn apply(shared: &Shared, new: Config) -> Result<Applied, ReloadError> {
    apply_with(shared, |_| new, |_| {})
}

/// [`apply`] of the config `make` derives from the running one, both under the reload lock (a
/// change applied meanwhile is not undone); `on_success` runs under it too, after a successful
/// apply (or one with nothing to change).
pub fn apply_with(
    shared: &Shared,
    make: impl FnOnce(&Config) -> Config,
    on_success: impl FnOnce(&Shared),
) -> Result<Applied, ReloadError> {
    let _one_at_a_time = shared.reloading.lock().unwrap_or_else(|e| e.into_inner());
    let current = shared.topology();
    let new = make(&current.config);
    let changes = diff(&current.config, &new).map_err(ReloadError::NeedsRestart)?;
    if changes.is_empty() {
        on_success(shared);
        return Ok(Applied {
            generation: current.generation,
            changes,
        });
    }
    let mut devices: HashMap<String, Arc<OpenDevice>> = current.devices.clone();
    let mut removed = Vec::new();
    for name in &changes.devices_removed {
        if let Some(device) = devices.remove(name) {
            removed.push((name.clone(), device));
        }
    }
    for name in &changes.devices_added {
        let config = new.device(name);
        // `diff` lists as added only devices of `new`.
        assert!(
            config.is_some(),
            "device {name}: added but not in the new config"
        );
        let Some(config) = config else { continue };
        devices.insert(name.clone(), shared.device_context.open(config, &new)?);
    }
    let topology = Topology::assemble(new, devices, current.generation + 1)?;
    resize(&topology, &changes.devices_resized)?;
    let generation = topology.generation;
    drop(current);
    shared.publish(topology);
    for line in changes.lines() {
        tracing::info!(generation, "reload: {line}");
    }
    for (name, offline) in &changes.devices_offline {
        if let Some(device) = shared.topology().devices.get(name) {
            set_offline(name, device, *offline);
        }
    }
    for (name, device) in removed {
        close_when_idle(name, device);
    }
    announce_alua_changes(&shared.topology(), &changes.alua_changed);
    on_success(shared);
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

/// Grows the devices a reload resizes, before the topology is published. A failure names
/// the devices that grew already (growing loses nothing, so they stay grown).
fn resize(topology: &Topology, resized: &[(String, u64)]) -> Result<(), ReloadError> {
    let mut grown = Vec::new();
    for (name, size) in resized {
        let Some(device) = topology.devices.get(name) else {
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
/// edited where `running` differs from `base`, the config it last held (`config::edit`), so
/// comments, order, units, `secret_file` references and edits made to it meanwhile stay; a
/// missing file is written whole. The previous file is kept as `NAME.bak`. Written atomically
/// (a temporary file in the same directory, fsynced, renamed over it, the directory fsynced):
/// a crash leaves the old file or the new one. Returns the config the file now holds.
pub fn save_config(
    path: &Path,
    base: Option<&Config>,
    running: &Config,
) -> Result<Config, SaveError> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let text = match std::fs::read_to_string(&path) {
        Ok(old) => {
            let loaded;
            let base = match base {
                Some(b) => b,
                None => {
                    loaded = Config::from_toml_str(&old, &path.display().to_string())
                        .map_err(SaveError::FileInvalid)?;
                    &loaded
                }
            };
            let text = crate::config::edit::merge(&old, base, running)?;
            keep_backup(&path, &old)?;
            text
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => running.to_toml_with_secrets(),
        Err(e) => return Err(SaveError::io(&path)(e)),
    };
    let saved = Config::from_toml_str(&text, &path.display().to_string())
        .map_err(SaveError::WouldNotLoad)?;
    write_atomically(&path, &text, saved.has_inline_secrets())?;
    Ok(saved)
}

/// `NAME.bak` beside `path`, with the file's previous text (and no wider mode than it had).
fn keep_backup(path: &Path, old: &str) -> Result<(), SaveError> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".bak");
    let backup = path.with_file_name(name);
    write_atomically(&backup, old, true)
}

/// Writes `text` to `path` through a temporary file and a rename. The file's mode is kept,
/// but never more open than 0640 when `secret` (it holds CHAP secrets).
fn write_atomically(path: &Path, text: &str, secret: bool) -> Result<(), SaveError> {
    use std::io::Write as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| SaveError::NotAFile(path.to_path_buf()))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let located = SaveError::io(&tmp);
    let mode = std::fs::metadata(path).map_or(0o600, |m| {
        use std::os::unix::fs::PermissionsExt as _;
        m.permissions().mode() & 0o777
    });
    let mode = if secret { mode & 0o640 } else { mode };
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .map_err(&located)?
    };
    // The mode of a file left by an earlier attempt is not changed by open: set it.
    {
        use std::os::unix::fs::PermissionsExt as _;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(&located)?;
    }
    file.write_all(text.as_bytes()).map_err(&located)?;
    file.sync_all().map_err(&located)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(SaveError::io(path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
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
        running.targets[0].groups[0].luns.retain(|m| m.lun == 0);
        let saved = save_config(&link, Some(&base), &running).unwrap();
        assert_eq!(saved, running);
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
    fn an_alua_state_changes_live_a_listener_does_not() {
        let old = config(BASE);
        let standby = config(&BASE.replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3260\"]\nalua_state = \"standby\"",
        ));
        let c = diff(&old, &standby).unwrap();
        assert_eq!(c.alua_changed, vec![(1, scsi::AccessState::Standby)]);
        assert_eq!(c.lines(), vec!["portal group 1 ALUA state Standby"]);
        assert!(
            diff(&standby, &old).unwrap().alua_changed
                == vec![(1, scsi::AccessState::ActiveOptimized)]
        );
        let moved = config(&BASE.replace("3260", "3262"));
        assert!(diff(&old, &moved).unwrap_err()[0].contains("listeners"));
        // A new state and a new listener at once: refused whole.
        let both = config(&BASE.replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3262\"]\nalua_state = \"standby\"",
        ));
        assert!(diff(&old, &both).is_err());
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
        let moved = config(&BASE.replace("127.0.0.1:3260", "127.0.0.1:3261"));
        let refused = diff(&old, &moved).unwrap_err();
        assert!(refused[0].contains("portal_group"), "{refused:?}");
        let limits = config(&format!("[limits]\nmax_sessions = 7\n{BASE}"));
        assert!(diff(&old, &limits).unwrap_err()[0].contains("[limits]"));
        let block = config(&BASE.replace(
            "name = \"a\"\nstore = \"ram\"",
            "name = \"a\"\nstore = \"ram\"\nblock_size = 4096",
        ));
        let refused = diff(&old, &block).unwrap_err();
        assert!(refused[0].contains("device a"), "{refused:?}");
        // Every reason is reported, not just the first.
        let both = config(
            &format!("[limits]\nmax_sessions = 7\n{BASE}")
                .replace("127.0.0.1:3260", "127.0.0.1:3261"),
        );
        assert_eq!(diff(&old, &both).unwrap_err().len(), 2);
    }
}
