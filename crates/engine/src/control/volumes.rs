//! Volumes and snapshots of `[[pool]]`s (docs/VOLUMES.md). A volume is a device: a file
//! `DIR/NAME.img` of a directory pool, image `NAME` of an RBD pool, or thin LV `VG/NAME` of an
//! LVM pool (`store::lvm`); created, cloned and deleted here by editing the running config
//! as one transaction each on the running config of its moment (`transact`). A snapshot is made while
//! the volume's writes are held (`LogicalUnit::quiesced`), so it holds every write
//! acknowledged before it and none after: a file `DIR/.snapshots/VOLUME@NAME.img` cloned by
//! the filesystem (`store::clone`: a reflink where it can), an RBD snapshot, or an LVM thin
//! snapshot `VG/VOLUME+NAME`. Every verb is idempotent: asked for what is already there, it
//! answers success with `"existed": true`; asked to delete what is gone, with
//! `"deleted": false`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::edit::text;
use super::error::ControlError;
use super::Step;
use crate::config::{Config, DeviceConfig, Lineage, PoolConfig, PoolKind, StoreKind};
use crate::shared::Shared;
use crate::topology::OpenDevice;
use store::dir_pool::{DirPool, Made};

pub const VERBS: &[&str] = &[
    "pool-add",
    "volume-create",
    "volume-snapshot",
    "volume-clone",
    "volume-rollback",
    "volume-delete",
    "volume-flatten",
    "volume-list",
    "snapshot-list",
    "snapshot-delete",
    "volume-export",
    "volume-unexport",
];

/// How long a deleted RBD volume's image is retried while its store closes (librbd refuses
/// to remove an image a client still has open).
const REMOVE_WAIT: Duration = Duration::from_secs(30);

pub fn handle(
    shared: &Shared,
    verb: &str,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    // What the verb's checks and slow work start from; each commit re-checks what it assumed
    // against the running config of its moment (`transact`).
    let seen = shared.topology().config.clone();
    match verb {
        "pool-add" => pool_add(shared, &seen, args),
        "volume-create" => create(shared, &seen, args),
        "volume-snapshot" => snapshot(shared, &seen, args),
        "volume-clone" => clone(shared, &seen, args),
        "volume-rollback" => rollback(shared, args),
        "volume-delete" => delete(shared, &seen, args),
        "volume-flatten" => flatten(&seen, args),
        "volume-list" => Ok(list(shared, &seen)),
        "snapshot-list" => Ok(json!({ "snapshots": snapshots_json(shared, &seen, args)? })),
        "volume-export" => super::export::export(shared, args),
        "volume-unexport" => super::export::unexport(shared, args),
        _ => snapshot_delete(shared, &seen, args),
    }
}

/// Removes what verbs a crash interrupted left in the directory pools (partial copies),
/// logging each: at start, before the control socket serves a verb.
pub fn sweep_partials(config: &Config) {
    for pool in &config.pools {
        let Some(dir) = dir_pool(pool) else { continue };
        match dir.sweep_partials() {
            Ok(swept) => {
                for path in swept {
                    tracing::warn!(pool = %pool.name, "removed {}, left by a verb a crash interrupted", path.display());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(pool = %pool.name, "cannot sweep its partial files: {e}"),
        }
    }
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> ControlError {
    move |e| match e.kind() {
        // There already, or not what a pool's entry must be (a link, another's directory).
        std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::InvalidInput => {
            ControlError::Conflict(format!("{what}: {e}"))
        }
        std::io::ErrorKind::NotFound => ControlError::NotFound(format!("{what}: {e}")),
        _ => ControlError::Device(format!("{what}: {e}")),
    }
}

fn rbd_error(what: String) -> impl FnOnce(rbd::Error) -> ControlError {
    move |e| match e.errno() {
        // EBUSY, EEXIST, ENOTEMPTY
        Some(16) | Some(17) | Some(39) => ControlError::Conflict(format!("{what}: {e}")),
        Some(2) => ControlError::NotFound(format!("{what}: {e}")),
        _ => ControlError::Device(format!("{what}: {e}")),
    }
}

fn lvm_error(what: String) -> impl FnOnce(store::lvm::LvmError) -> ControlError {
    use store::lvm::LvmErrorKind as K;
    move |e| match e.kind {
        K::Exists | K::Busy => ControlError::Conflict(format!("{what}: {e}")),
        K::NotFound => ControlError::NotFound(format!("{what}: {e}")),
        K::Failed => ControlError::Device(format!("{what}: {e}")),
    }
}

fn pool<'c>(config: &'c Config, name: &str) -> Result<&'c PoolConfig, ControlError> {
    config
        .pools
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("no pool {name}")))
}

/// The volume `name`: its pool and its device.
fn volume<'c>(
    config: &'c Config,
    name: &str,
) -> Result<(&'c PoolConfig, &'c DeviceConfig), ControlError> {
    let device = config
        .device(name)
        .ok_or_else(|| ControlError::NotFound(format!("no volume {name}")))?;
    let pool = config.pool_of(device).ok_or_else(|| {
        ControlError::Conflict(format!("device {name} is not a volume of any pool"))
    })?;
    Ok((pool, device))
}

/// The running device of volume `name`.
fn open_device(shared: &Shared, name: &str) -> Result<Arc<OpenDevice>, ControlError> {
    shared
        .topology()
        .devices
        .get(name)
        .cloned()
        .ok_or_else(|| ControlError::Conflict(format!("volume {name} is not open")))
}

/// The librbd image of an open RBD volume.
fn rbd_image(shared: &Shared, name: &str) -> Result<Arc<rbd::Image>, ControlError> {
    let device = open_device(shared, name)?;
    let store = device
        .rbd
        .as_ref()
        .ok_or_else(|| ControlError::Conflict(format!("volume {name} is no RBD image")))?;
    store.image().map_err(rbd_error(format!("volume {name}")))
}

fn object_name(args: &Map<String, Value>, key: &str) -> Result<String, ControlError> {
    let name = text(args, key)?;
    crate::config::check_object_name(name).map_err(ControlError::bad_request)?;
    Ok(name.to_string())
}

/// A directory pool's files (`store::dir_pool`), None for the other kinds.
fn dir_pool(pool: &PoolConfig) -> Option<DirPool> {
    pool.dir().map(DirPool::new)
}

/// `config` with `change` made, validated whole as a file would be: what a verb checks before
/// any side effect (a directory made, a tool run), so that nothing is made for a change the
/// config would refuse.
fn valid_with(
    config: &Config,
    verb: &str,
    change: impl FnOnce(&mut Config),
) -> Result<(), ControlError> {
    let mut candidate = config.clone();
    change(&mut candidate);
    Config::from_toml_str(&candidate.to_toml_with_secrets(), verb)
        .map(drop)
        .map_err(|mut errors| {
            for e in &mut errors.errors {
                (e.file, e.line, e.column) = (verb.to_string(), 0, 0);
            }
            ControlError::Invalid(errors)
        })
}

/// The pool a `pool-add` asks for.
fn asked_pool(args: &Map<String, Value>) -> Result<PoolConfig, ControlError> {
    let name = object_name(args, "name")?;
    let given = |key| args.get(key).and_then(Value::as_str);
    let kind = match (given("path"), given("rbd_pool"), given("vg")) {
        (Some(path), None, None) => PoolKind::Dir {
            path: PathBuf::from(path),
        },
        (None, None, Some(vg)) => PoolKind::Lvm(store::lvm::ThinPool {
            vg: vg.to_string(),
            pool: text(args, "thin_pool")?.to_string(),
        }),
        (None, Some(pool), None) => PoolKind::Rbd {
            pool: pool.to_string(),
            conf: given("ceph_conf").map(PathBuf::from),
            client: given("ceph_client").map(str::to_string),
        },
        _ => {
            return Err(ControlError::BadRequest(
                "give a \"path\" (a directory pool), an \"rbd_pool\", or a \"vg\" and its \"thin_pool\" (an LVM pool)".into(),
            ))
        }
    };
    Ok(PoolConfig { name, kind })
}

fn pool_add(
    shared: &Shared,
    seen: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let new = asked_pool(args)?;
    let name = new.name.clone();
    let existed = |running: &Config| -> Result<bool, ControlError> {
        match running.pools.iter().find(|p| p.name == name) {
            Some(p) if p.kind == new.kind => Ok(true),
            Some(_) => Err(ControlError::Conflict(format!(
                "pool {name} exists, otherwise"
            ))),
            None => Ok(false),
        }
    };
    if existed(seen)? {
        return Ok(json!({ "pool": name, "existed": true }));
    }
    // Its name, path (inside device_roots), VG and thin pool are the config's to judge, before
    // a directory is made or LVM is asked anything.
    // A directory not there yet is judged by its parent, which must exist and be allowed.
    new.check(&seen.server.device_roots)
        .map_err(|e| ControlError::BadRequest(format!("pool {name}: {e}")))?;
    valid_with(seen, "pool-add", |c| c.pools.push(new.clone()))?;
    if let Some(dir) = dir_pool(&new) {
        dir.make_dir()
            .map_err(io_error(format!("pool {name}: {}", dir.dir().display())))?;
    }
    if let Some(thin) = new.thin() {
        thin.check().map_err(lvm_error(format!("pool {name}")))?;
    }
    let mut answer = super::transact(shared, "pool-add", args, |running| {
        if existed(running)? {
            return Ok(Step::Answer(json!({ "pool": name, "existed": true })));
        }
        let mut config = running.clone();
        config.pools.push(new.clone());
        let what = format!("pool {name} added");
        Ok(Step::Apply {
            config: Box::new(config),
            what,
        })
    })?;
    answer
        .as_object_mut()
        .map(|a| a.entry("existed").or_insert(json!(false)));
    Ok(answer)
}

/// The device of a new volume `name` of `pool` (`size`: a new directory pool file's).
fn volume_device(
    pool: &PoolConfig,
    name: &str,
    size: Option<u64>,
) -> Result<DeviceConfig, ControlError> {
    if let Some(spec) = pool.image(name) {
        let mut device = Config::device_from_spec(name, &format!("rbd:{}/{name}", spec.pool))?;
        device.store = StoreKind::Rbd(spec);
        return Ok(device);
    }
    if let Some(thin) = pool.thin() {
        let spec = format!("block:{}", thin.device_path(name).display());
        return Ok(Config::device_from_spec(name, &spec)?);
    }
    let path = pool.volume_path(name).unwrap_or_default();
    let spec = match size {
        Some(size) => format!("file:{},size={size}", path.display()),
        None => format!("file:{}", path.display()),
    };
    Ok(Config::device_from_spec(name, &spec)?)
}

/// What a verb made in a pool for a volume not yet committed: removed again when the commit
/// does not happen, and only that (a directory pool's file by its inode; an image or LV this
/// verb's own create or clone call made, which fails on one that is there).
enum NewVolume {
    File(Made),
    Image(store::RbdSpec),
    Lv(store::lvm::ThinPool, String),
    /// Nothing made: an adopted file.
    Adopted,
}

impl NewVolume {
    fn forget(self) {
        let outcome = match self {
            NewVolume::File(made) => made.forget().map(drop).map_err(|e| e.to_string()),
            NewVolume::Image(spec) => store::rbd::pool(&spec)
                .map_err(|e| e.to_string())
                .and_then(|p| p.remove(&spec.image).map_err(|e| e.to_string())),
            NewVolume::Lv(thin, name) => thin.remove(&name, REMOVE_WAIT).map_err(|e| e.to_string()),
            NewVolume::Adopted => Ok(()),
        };
        if let Err(e) = outcome {
            tracing::warn!("a volume made for a verb that failed could not be removed: {e}");
        }
    }
}

/// The answer to a create or clone of `name` that is there already: the same thing asked
/// again (`same`) is success with `"existed": true`, anything else a conflict.
fn already(
    running: &Config,
    name: &str,
    same: impl FnOnce(&PoolConfig, &DeviceConfig) -> bool,
    answer: Value,
) -> Result<Option<Value>, ControlError> {
    let Some(existing) = running.device(name) else {
        return Ok(None);
    };
    match running.pool_of(existing) {
        Some(pool) if same(pool, existing) => Ok(Some(answer)),
        Some(pool) => Err(ControlError::Conflict(format!(
            "volume {name} of pool {} exists, and is not what was asked for",
            pool.name
        ))),
        None => Err(ControlError::Conflict(format!(
            "device {name} exists and is not a volume"
        ))),
    }
}

fn create(
    shared: &Shared,
    seen: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let pool = pool(seen, text(args, "pool")?)?.clone();
    let name = object_name(args, "name")?;
    pool.check_volume_name(&name)?;
    let mut size = crate::config::parse_size(text(args, "size")?)?;
    if let Some(thin) = pool.thin() {
        // LVM makes whole extents: the volume's size is the rounded one.
        size = thin
            .rounded(size)
            .map_err(lvm_error(format!("pool {}", pool.name)))?;
    }
    let adopt = args.get("adopt").and_then(Value::as_bool).unwrap_or(false);
    let existed = json!({ "volume": name, "pool": pool.name, "size_bytes": size, "existed": true });
    let same = |p: &PoolConfig, d: &DeviceConfig| {
        let now = shared
            .topology()
            .devices
            .get(&name)
            .map(|d| d.unit.capacity_bytes());
        p.name == pool.name && now == Some(size) && d.lineage.clone_of.is_none()
    };
    if let Some(answer) = already(seen, &name, same, existed.clone())? {
        return Ok(answer);
    }
    let mut device = volume_device(&pool, &name, (!adopt).then_some(size))?;
    device.lineage = Lineage::now(None);
    valid_with(seen, "volume-create", |c| c.devices.push(device.clone()))?;
    let made = match make_volume(&pool, &name, size, adopt) {
        Ok(made) => made,
        // Made meanwhile by the same request repeated: the commit below tells.
        Err(e) if e.kind() == "conflict" && seen.device(&name).is_none() => {
            let running = shared.topology().config.clone();
            return already(&running, &name, same, existed)?.ok_or(e);
        }
        Err(e) => return Err(e),
    };
    let what = format!("volume {name} created in pool {} ({size} bytes)", pool.name);
    let committed = super::transact(shared, "volume-create", args, |running| {
        commit_new(running, &pool, &name, device.clone(), what.clone())
    });
    finish_new(committed, made, &[("existed", json!(false))])
}

/// Makes the volume's medium: a new file (exclusively; an existing one only when `adopt`),
/// an RBD image or a thin LV (whose tools refuse one that is there).
fn make_volume(
    pool: &PoolConfig,
    name: &str,
    size: u64,
    adopt: bool,
) -> Result<NewVolume, ControlError> {
    let what = || format!("volume {name}");
    if let Some(dir) = dir_pool(pool) {
        dir.make_dir()
            .map_err(io_error(format!("pool {}", pool.name)))?;
        if adopt {
            dir.open_volume(name, true).map_err(io_error(what()))?;
            return Ok(NewVolume::Adopted);
        }
        return match dir.create_volume(name, size) {
            Ok(made) => Ok(NewVolume::File(made)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(ControlError::Conflict(format!(
                    "volume {name}: {e}; a file left by someone else (or by a verb a crash \
                     interrupted) is never taken over silently: remove it, or take it as the \
                     volume with \"adopt\": true"
                )))
            }
            Err(e) => Err(io_error(what())(e)),
        };
    }
    if adopt {
        return Err(ControlError::BadRequest(
            "\"adopt\" takes over a file of a directory pool; RBD images and LVs are not adopted"
                .into(),
        ));
    }
    if let Some(spec) = pool.image(name) {
        store::rbd::pool(&spec)
            .map_err(io_error(format!("pool {}", pool.name)))?
            .create(name, size)
            .map_err(rbd_error(what()))?;
        return Ok(NewVolume::Image(spec));
    }
    let Some(thin) = pool.thin() else {
        unreachable!("a pool is a directory, RBD or LVM pool")
    };
    thin.create(name, size).map_err(lvm_error(what()))?;
    Ok(NewVolume::Lv(thin.clone(), name.to_string()))
}

/// The commit of a new volume: its pool unchanged and its name still free in the running
/// config of this moment, else `conflict`.
fn commit_new(
    running: &Config,
    pool: &PoolConfig,
    name: &str,
    device: DeviceConfig,
    what: String,
) -> Result<Step, ControlError> {
    if running.pools.iter().all(|p| p != pool) {
        return Err(ControlError::Conflict(format!(
            "pool {} changed while volume {name} was made",
            pool.name
        )));
    }
    if running.device(name).is_some() {
        return Err(ControlError::Conflict(format!(
            "device {name} was made by another request meanwhile"
        )));
    }
    let mut config = running.clone();
    config.devices.push(device);
    Ok(Step::Apply {
        config: Box::new(config),
        what,
    })
}

/// A new volume's answer once its commit ran: what it made stays if it committed, else goes.
fn finish_new(
    committed: Result<Value, ControlError>,
    made: NewVolume,
    extra: &[(&str, Value)],
) -> Result<Value, ControlError> {
    match committed {
        // Applied and kept, even when only the save failed (`not_saved`: it runs).
        Ok(mut answer) => {
            for (key, value) in extra {
                answer[*key] = value.clone();
            }
            Ok(answer)
        }
        Err(e @ ControlError::NotSaved(_)) => Err(e),
        Err(e) => {
            made.forget();
            Err(e)
        }
    }
}

/// How often a copy that the filesystem cannot reflink logs how far it has come.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Logs a copy's progress (`what`: "copy of volume …") every [`PROGRESS_EVERY`]: the bytes
/// passed, of how many, and the rate, so an operator watching a long copy sees it move.
fn copy_progress(what: String) -> impl FnMut(u64, u64) {
    let started = Instant::now();
    let mut last = started;
    move |done, len| {
        let now = Instant::now();
        if now.duration_since(last) < PROGRESS_EVERY || done >= len {
            return;
        }
        last = now;
        let mib_s = done as f64 / (1 << 20) as f64 / now.duration_since(started).as_secs_f64();
        let percent = done as f64 * 100.0 / len.max(1) as f64;
        tracing::info!("{what}: {done} of {len} bytes ({percent:.0} %), {mib_s:.0} MiB/s");
    }
}

/// Runs `f` with the volume's writes held (see `LogicalUnit::quiesced`).
fn with_writes_held<R>(
    shared: &Shared,
    name: &str,
    f: impl FnOnce() -> R,
) -> Result<R, ControlError> {
    open_device(shared, name)?
        .unit
        .quiesced(f)
        .map_err(io_error(format!("volume {name}: flushing it")))
}

/// Copies volume `name`'s file `from` into the new file `to` as it is at one moment: a
/// reflink while its writes are held (milliseconds). Where the filesystem cannot share
/// extents the copy takes as long as the data does, too long to hold the writes of a volume
/// in use: then the volume must be unmapped or offline (no writes can come), or the copy is
/// refused.
fn live_copy(
    shared: &Shared,
    seen: &Config,
    name: &str,
    from: &std::fs::File,
    to: &std::fs::File,
) -> Result<store::clone::CloneMethod, ControlError> {
    let what = || format!("copy of volume {name}");
    let reflinked = with_writes_held(shared, name, || store::clone::reflink(from, to))?
        .map_err(io_error(what()))?;
    if reflinked {
        return Ok(store::clone::CloneMethod::Reflink);
    }
    let in_use = !mappings(seen, name).is_empty() && !seen.device(name).is_some_and(|d| d.offline);
    if in_use {
        return Err(ControlError::Conflict(format!(
            "volume {name} is in use and its pool's filesystem cannot reflink: the copy would \
             hold its writes for as long as copying its data takes; take it offline (ctl device \
             offline) or unmap it first, or put the pool on XFS or btrfs"
        )));
    }
    let method =
        store::clone::clone_into(from, to, &mut copy_progress(what())).map_err(io_error(what()))?;
    to.sync_all().map_err(io_error(what()))?;
    Ok(method)
}

/// The snapshots of volume `volume` of `pool`.
fn snapshot_names(
    shared: &Shared,
    pool: &PoolConfig,
    volume: &str,
) -> Result<Vec<String>, ControlError> {
    match &pool.kind {
        PoolKind::Dir { path } => Ok(DirPool::new(path)
            .snapshots(Some(volume))
            .map_err(io_error(format!("pool {}", pool.name)))?
            .into_iter()
            .map(|(_, s)| s)
            .collect()),
        PoolKind::Rbd { .. } => Ok(rbd_image(shared, volume)?
            .snapshots()
            .map_err(rbd_error(format!("volume {volume}")))?
            .into_iter()
            .map(|(name, _)| name)
            .collect()),
        PoolKind::Lvm(_) => Ok(thin_snapshots(pool, Some(volume))?
            .into_iter()
            .map(|(_, snap)| snap)
            .collect()),
    }
}

/// The snapshots in an LVM pool (of one volume): (volume, snapshot).
fn thin_snapshots(
    pool: &PoolConfig,
    volume: Option<&str>,
) -> Result<Vec<(String, String)>, ControlError> {
    let Some(thin) = pool.thin() else {
        return Ok(Vec::new());
    };
    let lvs = thin
        .thin_lvs()
        .map_err(lvm_error(format!("pool {}", pool.name)))?;
    Ok(lvs
        .iter()
        .filter_map(|lv| lv.snapshot_of())
        .filter(|(v, _)| volume.is_none_or(|o| o == *v))
        .map(|(v, s)| (v.to_string(), s.to_string()))
        .collect())
}

fn snapshot(
    shared: &Shared,
    running: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let (pool, device) = volume(running, text(args, "volume")?)?;
    let name = device.name.clone();
    let snap = object_name(args, "snapshot")?;
    pool.check_snapshot_name(&name, &snap)?;
    if snapshot_names(shared, pool, &name)?.contains(&snap) {
        return Ok(json!({ "volume": name, "snapshot": snap, "existed": true }));
    }
    let started = Instant::now();
    let method = match &pool.kind {
        PoolKind::Dir { path } => match dir_snapshot(shared, running, path, &name, &snap) {
            Err(ControlError::Conflict(_))
                if snapshot_names(shared, pool, &name)?.contains(&snap) =>
            {
                // Taken meanwhile by the same request repeated.
                return Ok(json!({ "volume": name, "snapshot": snap, "existed": true }));
            }
            made => made?.name(),
        },
        PoolKind::Rbd { .. } => {
            let image = rbd_image(shared, &name)?;
            with_writes_held(shared, &name, || image.snap_create(&snap))?
                .map_err(rbd_error(format!("snapshot {name}@{snap}")))?;
            "rbd"
        }
        PoolKind::Lvm(thin) => {
            let lv = store::lvm::snapshot_lv(&name, &snap);
            // LVM suspends the origin for the moment of the snapshot, flushing what reached
            // it; the held writes are those not acknowledged yet.
            with_writes_held(shared, &name, || thin.snapshot(&name, &lv, false))?
                .map_err(lvm_error(format!("snapshot {name}@{snap}")))?;
            "lvm thin snapshot"
        }
    };
    tracing::info!(volume = %name, snapshot = %snap, method, "ctl: snapshot taken");
    Ok(json!({
        "volume": name, "snapshot": snap, "existed": false,
        "method": method, "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// Snapshot `snap` of volume `name` of the directory pool at `path`: copied into a partial
/// file (a reflink while its writes are held), published under its name once durable.
fn dir_snapshot(
    shared: &Shared,
    seen: &Config,
    path: &std::path::Path,
    name: &str,
    snap: &str,
) -> Result<store::clone::CloneMethod, ControlError> {
    let dir = DirPool::new(path);
    let what = || format!("snapshot {name}@{snap}");
    let from = dir.open_volume(name, false).map_err(io_error(what()))?;
    let (to, partial) = dir.begin_snapshot(name, snap).map_err(io_error(what()))?;
    let method = match live_copy(shared, seen, name, &from, &to) {
        Ok(method) => method,
        Err(e) => {
            let _ = partial.forget();
            return Err(e);
        }
    };
    let kept = dir
        .publish(partial, &DirPool::snapshot_file(name, snap))
        .map_err(io_error(what()))?;
    drop(kept);
    Ok(method)
}

fn clone(shared: &Shared, seen: &Config, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (pool, source) = volume(seen, text(args, "volume")?)?;
    let (pool, source) = (pool.clone(), source.name.clone());
    let name = object_name(args, "name")?;
    pool.check_volume_name(&name)?;
    let snap = match args.get("snapshot").and_then(Value::as_str) {
        Some(_) => Some(object_name(args, "snapshot")?),
        None => None,
    };
    // Idempotent by what it is a clone of, not only by name: a clone of another source (or a
    // volume that is no clone) of that name is a conflict.
    let clone_of = match &snap {
        Some(snap) => format!("{source}@{snap}"),
        None => source.clone(),
    };
    let existed = json!({ "volume": name, "existed": true, "clone_of": clone_of });
    let same = |p: &PoolConfig, d: &DeviceConfig| {
        p.name == pool.name && d.lineage.clone_of.as_deref() == Some(clone_of.as_str())
    };
    if let Some(answer) = already(seen, &name, same, existed.clone())? {
        return Ok(answer);
    }
    let mut device = volume_device(&pool, &name, None)?;
    device.lineage = Lineage::now(Some(clone_of.clone()));
    valid_with(seen, "volume-clone", |c| c.devices.push(device.clone()))?;
    if let Some(snap) = &snap {
        if !snapshot_names(shared, &pool, &source)?.contains(snap) {
            return Err(ControlError::NotFound(format!(
                "volume {source} has no snapshot {snap}"
            )));
        }
    }
    let started = Instant::now();
    let (method, made, taken) = match (&snap, pool.image(&source)) {
        // librbd clones only snapshots: the volume as it is now is one taken for the clone.
        (None, Some(_)) => {
            let snap = snapshot_for_clone(shared, &pool, &source, &name)?;
            match clone_data(shared, seen, &pool, &source, Some(&snap), &name) {
                Ok((method, made)) => (method, made, Some(snap)),
                Err(e) => {
                    drop_clone_snapshot(shared, &source, &snap);
                    return Err(e);
                }
            }
        }
        _ => {
            let (method, made) = clone_data(shared, seen, &pool, &source, snap.as_deref(), &name)?;
            (method, made, None)
        }
    };
    let what = format!("volume {name} cloned from {source} ({method})");
    let committed = super::transact(shared, "volume-clone", args, |running| {
        let same_source = running
            .device(&source)
            .is_some_and(|d| running.pool_of(d) == Some(&pool));
        if !same_source {
            return Err(ControlError::Conflict(format!(
                "volume {source} was deleted or changed while it was cloned"
            )));
        }
        commit_new(running, &pool, &name, device.clone(), what.clone())
    });
    if committed.as_ref().is_err_and(|e| e.kind() != "not_saved") {
        if let Some(snap) = &taken {
            // After the clone image is gone (`finish_new`): librbd keeps a parent snapshot.
            let answer = finish_new(committed, made, &[]);
            drop_clone_snapshot(shared, &source, snap);
            return answer;
        }
    }
    let mut extra = vec![
        ("existed", json!(false)),
        ("clone_of", json!(clone_of)),
        ("method", json!(method)),
        ("seconds", json!(started.elapsed().as_secs_f64())),
    ];
    if let Some(snap) = taken {
        extra.push(("snapshot", json!(snap)));
    }
    finish_new(committed, made, &extra)
}

/// Removes the snapshot a clone of `source` as it is now was made from, after the clone
/// failed.
fn drop_clone_snapshot(shared: &Shared, source: &str, snap: &str) {
    if let Ok(image) = rbd_image(shared, source) {
        let _ = image.snap_unprotect(snap);
        let _ = image.snap_remove(snap);
    }
}

/// Takes the snapshot an RBD clone of `source` as it is now is made from: named after the
/// clone `name`, crash-consistent like any snapshot, and kept while the clone depends on it
/// (`volume flatten` frees it). A snapshot of that name made by someone else is refused, not
/// reused: it holds another moment.
fn snapshot_for_clone(
    shared: &Shared,
    pool: &PoolConfig,
    source: &str,
    name: &str,
) -> Result<String, ControlError> {
    if snapshot_names(shared, pool, source)?
        .iter()
        .any(|s| s == name)
    {
        return Err(ControlError::Conflict(format!(
            "volume {source} has a snapshot {name} already, and a clone of it as it is now is \
             made from a new snapshot of that name: clone that one with --snapshot {name}, or \
             give the clone another name"
        )));
    }
    let image = rbd_image(shared, source)?;
    with_writes_held(shared, source, || image.snap_create(name))?
        .map_err(rbd_error(format!("snapshot {source}@{name}")))?;
    Ok(name.to_string())
}

/// Makes volume `name` of `pool` a copy of `source` (of its snapshot `snap`, or of it now):
/// how, and what it made.
fn clone_data(
    shared: &Shared,
    seen: &Config,
    pool: &PoolConfig,
    source: &str,
    snap: Option<&str>,
    name: &str,
) -> Result<(&'static str, NewVolume), ControlError> {
    if let Some(thin) = pool.thin() {
        let what = format!("clone {name} of {source}");
        match snap {
            // A thin snapshot of the snapshot, active: a volume of its own.
            Some(snap) => thin.snapshot(&store::lvm::snapshot_lv(source, snap), name, true),
            None => with_writes_held(shared, source, || thin.snapshot(source, name, true))?,
        }
        .map_err(lvm_error(what))?;
        return Ok((
            "lvm thin snapshot",
            NewVolume::Lv(thin.clone(), name.to_string()),
        ));
    }
    if let Some(dir) = dir_pool(pool) {
        let (method, made) = clone_file(shared, seen, &dir, source, snap, name)?;
        return Ok((method.name(), NewVolume::File(made)));
    }
    // `clone` takes the snapshot of a volume cloned as it is now.
    let Some(snap) = snap else {
        return Err(ControlError::BadRequest(format!(
            "an RBD volume is cloned from a snapshot: clone {source}@SNAPSHOT"
        )));
    };
    let image = rbd_image(shared, source)?;
    // A format-1 clone needs its parent snapshot protected; already protected is fine.
    match image.snap_protect(snap) {
        Err(e) if e.errno() != Some(16) => {
            return Err(rbd_error(format!("protecting {source}@{snap}"))(e))
        }
        _ => {}
    }
    let spec = pool
        .image(name)
        .unwrap_or_else(|| unreachable!("an RBD pool's image"));
    let rados = store::rbd::pool(&spec).map_err(io_error(format!("pool {}", pool.name)))?;
    rados
        .clone_image(&rados, source, snap, name)
        .map_err(rbd_error(format!("clone {name} of {source}@{snap}")))?;
    Ok(("rbd clone", NewVolume::Image(spec)))
}

/// A directory pool's clone: copied into a partial file, published as volume `name` once
/// complete and durable (never over a file that is there).
fn clone_file(
    shared: &Shared,
    seen: &Config,
    dir: &DirPool,
    source: &str,
    snap: Option<&str>,
    name: &str,
) -> Result<(store::clone::CloneMethod, Made), ControlError> {
    let what = || format!("clone {name} of {source}");
    let (to, partial) = dir.begin_volume(name).map_err(io_error(what()))?;
    let copied = match snap {
        Some(snap) => dir
            .open_snapshot(source, snap)
            .and_then(|from| {
                let progress = &mut copy_progress(format!("clone {name} of {source}@{snap}"));
                let method = store::clone::clone_into(&from, &to, progress)?;
                to.sync_all().map(|()| method)
            })
            .map_err(io_error(what())),
        None => dir
            .open_volume(source, false)
            .map_err(io_error(what()))
            .and_then(|from| live_copy(shared, seen, source, &from, &to)),
    };
    let method = match copied {
        Ok(method) => method,
        Err(e) => {
            let _ = partial.forget();
            return Err(e);
        }
    };
    let made = dir
        .publish(partial, &DirPool::volume_file(name))
        .map_err(io_error(what()))?;
    Ok((method, made))
}

/// Makes an RBD clone independent of its parent snapshot (librbd copies the blocks it still
/// shares); a directory pool's clones depend on nothing (`"flattened": false`).
fn flatten(running: &Config, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (pool, device) = volume(running, text(args, "volume")?)?;
    let name = device.name.clone();
    let Some(spec) = pool.image(&name) else {
        return Ok(json!({ "volume": name, "flattened": false }));
    };
    let started = Instant::now();
    let image = store::rbd::maintenance_image(&spec).map_err(io_error(format!("volume {name}")))?;
    match image.flatten() {
        // Not a clone (any more): nothing depends on a parent.
        Err(e) if e.errno() == Some(22) => Ok(json!({ "volume": name, "flattened": false })),
        Err(e) => Err(rbd_error(format!("volume {name}"))(e)),
        Ok(()) => Ok(json!({
            "volume": name, "flattened": true, "seconds": started.elapsed().as_secs_f64(),
        })),
    }
}

/// `resize` of an LVM volume to `size`: LVM grows its LV (to whole extents) first; the
/// verb then goes on as for any device grown underneath (`size` taken out of `args`), true.
/// Other devices are left to `resize` as they are (false).
pub(super) fn grow_thin(
    running: &Config,
    args: &mut Map<String, Value>,
) -> Result<bool, ControlError> {
    let Some((pool, device)) = running
        .device(text(args, "device")?)
        .and_then(|d| Some((running.pool_of(d)?, d)))
    else {
        return Ok(false);
    };
    let Some(thin) = pool.thin() else {
        return Ok(false);
    };
    let name = &device.name;
    let size = crate::config::parse_size(text(args, "size")?)?;
    let size = thin
        .rounded(size)
        .map_err(lvm_error(format!("volume {name}")))?;
    let now = thin
        .get(name)
        .map_err(lvm_error(format!("volume {name}")))?
        .map_or(0, |lv| lv.size_bytes);
    if size < now {
        return Err(ControlError::Conflict(format!(
            "volume {name} has {now} bytes, more than {size}: shrinking a LUN would cut off \
             data its initiators may hold"
        )));
    }
    thin.extend(name, size).map_err(lvm_error(format!(
        "volume {name}: growing it to {size} bytes"
    )))?;
    args.remove("size");
    Ok(true)
}

/// Where a volume is mapped ("TARGET group G LUN n"), as `device-remove` says it.
fn mappings(config: &Config, name: &str) -> Vec<String> {
    super::edit::mappings_of(config, name)
}

fn rollback(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    let snap = object_name(args, "snapshot")?;
    let seen = shared.topology().config.clone();
    let (pool, device) = volume(&seen, &name)?;
    if !snapshot_names(shared, pool, &name)?.contains(&snap) {
        return Err(ControlError::NotFound(format!(
            "volume {name} has no snapshot {snap}"
        )));
    }
    if let Some(thin) = pool.thin() {
        return rollback_thin(shared, args, thin, device, &snap);
    }
    // Under the apply lock: no map or online can come between the check and the restore.
    let lock = super::reload::lock(shared);
    let running = shared.topology().config.clone();
    let (pool, device) = volume(&running, &name)?;
    let mapped = mappings(&running, &name);
    if !mapped.is_empty() && !device.offline {
        return Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): take it offline (ctl device offline) or unmap it first; \
             its initiators would see its blocks change under them",
            mapped.join("; ")
        )));
    }
    let method = match dir_pool(pool) {
        Some(dir) => {
            let restore = || restore_file(&dir, &name, &snap);
            with_writes_held(shared, &name, restore)?
                .map_err(io_error(format!("rollback of {name} to {snap}")))?
                .name()
        }
        None => {
            let image = rbd_image(shared, &name)?;
            with_writes_held(shared, &name, || image.snap_rollback(&snap))?
                .map_err(rbd_error(format!("rollback of {name} to {snap}")))?;
            "rbd"
        }
    };
    drop(lock);
    tracing::info!(volume = %name, snapshot = %snap, "ctl: volume rolled back");
    Ok(json!({ "volume": name, "snapshot": snap, "method": method }))
}

/// Copies snapshot `snap` of volume `name` over the volume's file (both opened in the pool,
/// never through a link), durably. A volume grown since keeps its size: the blocks past the
/// snapshot read as zeros.
fn restore_file(
    dir: &DirPool,
    name: &str,
    snap: &str,
) -> std::io::Result<store::clone::CloneMethod> {
    let from = dir.open_snapshot(name, snap)?;
    let to = dir.open_volume(name, true)?;
    let size = to.metadata()?.len();
    let mut progress = copy_progress(format!("rollback of {name} to {snap}"));
    let method = store::clone::clone_into(&from, &to, &mut progress)?;
    if to.metadata()?.len() < size {
        to.set_len(size)?;
    }
    to.sync_all()?;
    Ok(method)
}

/// Rolls an LVM volume back. LVM has no in-place revert that keeps the snapshot, so the
/// volume becomes a new thin snapshot of its snapshot: its device leaves the running config
/// (the store closes), its LV is set aside as `NAME+`, the snapshot's active thin snapshot
/// is made `NAME`, and the device opens again; the set-aside LV goes once the old store has
/// closed. The volume must be unmapped: a mapped LUN cannot lose its device for a moment.
fn rollback_thin(
    shared: &Shared,
    args: &Map<String, Value>,
    thin: &store::lvm::ThinPool,
    device: &DeviceConfig,
    snap: &str,
) -> Result<Value, ControlError> {
    let name = device.name.clone();
    let started = Instant::now();
    let size = thin
        .get(&name)
        .map_err(lvm_error(format!("volume {name}")))?
        .map_or(0, |lv| lv.size_bytes);
    // Only the client's precondition: the closing and reopening are not saved (the config
    // comes back as it was).
    let mut first = Map::new();
    if let Some(generation) = args.get("if_generation") {
        first.insert("if_generation".into(), generation.clone());
    }
    let mut at = 0;
    let what = format!("volume {name} closed for its rollback to {snap}");
    super::transact(shared, "volume-rollback", &first, |running| {
        if running.device(&name) != Some(device) {
            return Err(ControlError::Conflict(format!(
                "volume {name} changed while its rollback was prepared"
            )));
        }
        let mapped = mappings(running, &name);
        if !mapped.is_empty() {
            return Err(ControlError::Conflict(format!(
                "volume {name} is mapped ({}): an LVM volume rolls back by replacing its thin \
                 LV, which closes its device; unmap it first",
                mapped.join("; ")
            )));
        }
        let mut config = running.clone();
        at = config
            .devices
            .iter()
            .position(|d| d.name == name)
            .unwrap_or(0);
        config.devices.retain(|d| d.name != name);
        Ok(Step::Apply {
            config: Box::new(config),
            what,
        })
    })?;
    // The device comes back into the running config where it was, on whichever LV then
    // bears its name.
    let mut reopen = |what: &str| {
        let what = format!("volume {name} {what}");
        super::transact(shared, "volume-rollback", &Map::new(), |running| {
            let mut config = running.clone();
            let at = at.min(config.devices.len());
            config.devices.insert(at, device.clone());
            Ok(Step::Apply {
                config: Box::new(config),
                what,
            })
        })
        .map(drop)
    };
    swap_to_snapshot(thin, &name, snap, size, &mut reopen)?;
    tracing::info!(volume = %name, snapshot = %snap, "ctl: volume rolled back");
    Ok(json!({
        "volume": name, "snapshot": snap, "method": "lvm thin snapshot",
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// The LV operations of a thin rollback: LVM's tools in the daemon, a fake in the tests.
trait RollbackLvs {
    fn rename(&self, from: &str, to: &str) -> Result<(), store::lvm::LvmError>;
    /// An active, writable thin snapshot `name` of `origin`.
    fn snapshot(&self, origin: &str, name: &str) -> Result<(), store::lvm::LvmError>;
    fn extend(&self, name: &str, size: u64) -> Result<(), store::lvm::LvmError>;
    fn remove(&self, name: &str) -> Result<(), store::lvm::LvmError>;
}

impl RollbackLvs for store::lvm::ThinPool {
    fn rename(&self, from: &str, to: &str) -> Result<(), store::lvm::LvmError> {
        store::lvm::ThinPool::rename(self, from, to)
    }
    fn snapshot(&self, origin: &str, name: &str) -> Result<(), store::lvm::LvmError> {
        store::lvm::ThinPool::snapshot(self, origin, name, true)
    }
    fn extend(&self, name: &str, size: u64) -> Result<(), store::lvm::LvmError> {
        store::lvm::ThinPool::extend(self, name, size)
    }
    fn remove(&self, name: &str) -> Result<(), store::lvm::LvmError> {
        store::lvm::ThinPool::remove(self, name, REMOVE_WAIT)
    }
}

/// With volume `name`'s device closed: sets its LV aside, makes an active thin snapshot of
/// its snapshot `snap` (grown back to `size`) the volume, opens the device (`reopen`) and
/// removes the set-aside LV. When any step fails, the old LV gets its name back and the
/// device opens on it: the volume is as it was, and the error says so. Only when even that
/// open fails is the device left out of the running config, and the error says that too.
fn swap_to_snapshot(
    lvs: &impl RollbackLvs,
    name: &str,
    snap: &str,
    size: u64,
    reopen: &mut dyn FnMut(&str) -> Result<(), ControlError>,
) -> Result<(), ControlError> {
    let aside = format!("{name}{}", store::lvm::SNAPSHOT_SEPARATOR);
    let failed = match swap_lvs(
        lvs,
        name,
        &aside,
        &store::lvm::snapshot_lv(name, snap),
        size,
    ) {
        Err(e) => format!("{e}"),
        Ok(()) => match reopen(&format!("rolled back to {snap}")) {
            Ok(()) => {
                return lvs
                    .remove(&aside)
                    .map_err(lvm_error(format!("rollback of {name}: the old LV {aside}")));
            }
            Err(e) => {
                // The rolled-back LV would not open: it goes, the old one comes back.
                let undo = lvs.remove(name).and_then(|()| lvs.rename(&aside, name));
                if let Err(undo) = undo {
                    return Err(ControlError::Device(format!(
                        "rollback of {name} to {snap}: its device would not open ({e}), and \
                         the old LV could not be put back ({undo}); it is {aside}, and device \
                         {name} is out of the running config"
                    )));
                }
                format!("its device would not open: {e}")
            }
        },
    };
    match reopen("reopened as it was: its rollback failed") {
        Ok(()) => Err(ControlError::Device(format!(
            "rollback of {name} to {snap}: {failed}; the volume is as it was"
        ))),
        Err(again) => Err(ControlError::Device(format!(
            "rollback of {name} to {snap}: {failed}; the volume's old LV is back, but its \
             device would not open again ({again}): device {name} is out of the running config"
        ))),
    }
}

/// Renames `name` to `aside` and makes `name` an active snapshot of `origin` of `size`
/// bytes; on failure, `name` is the old LV again.
fn swap_lvs(
    lvs: &impl RollbackLvs,
    name: &str,
    aside: &str,
    origin: &str,
    size: u64,
) -> Result<(), store::lvm::LvmError> {
    lvs.rename(name, aside)?;
    let made = lvs.snapshot(origin, name).and_then(|()| {
        // A volume grown since the snapshot keeps its size (the blocks past it read zeros).
        lvs.extend(name, size).inspect_err(|_| {
            let _ = lvs.remove(name);
        })
    });
    if made.is_err() {
        let _ = lvs.rename(aside, name);
    }
    made
}

fn delete(
    shared: &Shared,
    seen: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    let gone = json!({ "volume": name, "deleted": false });
    if seen.device(&name).is_none() {
        return Ok(gone);
    }
    let (pool, _) = volume(seen, &name)?;
    let pool = pool.clone();
    let unmapped = |running: &Config| {
        let mapped = mappings(running, &name);
        if mapped.is_empty() {
            return Ok(());
        }
        Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): unmap it first",
            mapped.join("; ")
        )))
    };
    unmapped(seen)?;
    let snaps = snapshot_names(shared, &pool, &name)?;
    if !snaps.is_empty() {
        return Err(ControlError::Conflict(format!(
            "volume {name} has snapshots ({}): delete them first",
            snaps.join(", ")
        )));
    }
    let what = format!("volume {name} deleted from pool {}", pool.name);
    let mut answer = super::transact(shared, "volume-delete", args, |running| {
        let Some(device) = running.device(&name) else {
            return Ok(Step::Answer(gone.clone()));
        };
        if running.pool_of(device) != Some(&pool) {
            return Err(ControlError::Conflict(format!(
                "volume {name} changed while it was deleted"
            )));
        }
        unmapped(running)?;
        let mut config = running.clone();
        config.devices.retain(|d| d.name != name);
        Ok(Step::Apply {
            config: Box::new(config),
            what,
        })
    })?;
    if answer.get("deleted").is_some() {
        return Ok(answer);
    }
    remove_medium(&pool, &name)?;
    answer["deleted"] = json!(true);
    Ok(answer)
}

/// Removes a deleted volume's file, image or LV. The store closes with its last command; the
/// space is freed when it does.
fn remove_medium(pool: &PoolConfig, name: &str) -> Result<(), ControlError> {
    let what = || format!("volume {name}");
    if let Some(dir) = dir_pool(pool) {
        dir.remove_volume(name).map_err(io_error(what()))?;
    } else if let Some(spec) = pool.image(name) {
        remove_image(&spec)?;
    } else if let Some(thin) = pool.thin() {
        thin.remove(name, REMOVE_WAIT).map_err(lvm_error(what()))?;
    }
    Ok(())
}

/// Removes an RBD image once the store of the device that was it has closed (librbd refuses
/// while a client has it open: the store closes when its last command is done).
fn remove_image(spec: &store::RbdSpec) -> Result<(), ControlError> {
    let what = format!("image {}/{}", spec.pool, spec.image);
    let pool = store::rbd::pool(spec).map_err(io_error(what.clone()))?;
    let started = Instant::now();
    loop {
        match pool.remove(&spec.image) {
            Ok(()) => return Ok(()),
            Err(e) if e.errno() == Some(16) && started.elapsed() < REMOVE_WAIT => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(rbd_error(what)(e)),
        }
    }
}

/// Every volume of `config`: its pool and device.
fn volumes(config: &Config) -> impl Iterator<Item = (&PoolConfig, &DeviceConfig)> {
    config
        .devices
        .iter()
        .filter_map(|d| Some((config.pool_of(d)?, d)))
}

fn snapshots_json(
    shared: &Shared,
    config: &Config,
    args: &Map<String, Value>,
) -> Result<Vec<Value>, ControlError> {
    let only = args.get("volume").and_then(Value::as_str);
    let mut out = Vec::new();
    for (pool, device) in volumes(config).filter(|(_, d)| only.is_none_or(|o| o == d.name)) {
        for snapshot in snapshot_names(shared, pool, &device.name)? {
            out.push(json!({ "pool": pool.name, "volume": device.name, "snapshot": snapshot }));
        }
    }
    Ok(out)
}

fn list(shared: &Shared, config: &Config) -> Value {
    let topology = shared.topology();
    let volumes: Vec<Value> = volumes(config)
        .map(|(pool, d)| {
            let snapshots = snapshot_names(shared, pool, &d.name).unwrap_or_default();
            let size = topology
                .devices
                .get(&d.name)
                .map(|o| o.unit.capacity_bytes());
            json!({
                "pool": pool.name, "volume": d.name, "size_bytes": size,
                "mapped": mappings(config, &d.name), "snapshots": snapshots,
                "serial": d.serial, "clone_of": d.lineage.clone_of,
                "created": d.lineage.created,
            })
        })
        .collect();
    let pools: Vec<Value> = config
        .pools
        .iter()
        .map(|p| match &p.kind {
            PoolKind::Dir { path } => json!({ "pool": p.name, "kind": "dir", "path": path }),
            PoolKind::Rbd { pool, .. } => {
                json!({ "pool": p.name, "kind": "rbd", "rbd_pool": pool })
            }
            PoolKind::Lvm(thin) => {
                json!({ "pool": p.name, "kind": "lvm", "vg": thin.vg, "thin_pool": thin.pool })
            }
        })
        .collect();
    json!({ "pools": pools, "volumes": volumes })
}

fn snapshot_delete(
    shared: &Shared,
    running: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    let snap = object_name(args, "snapshot")?;
    let gone = json!({ "volume": name, "snapshot": snap, "deleted": false });
    let pool = match running.device(&name) {
        Some(d) => running.pool_of(d),
        // A volume deleted already: its pool is the directory or LVM pool that holds the
        // snapshot.
        None => running.pools.iter().find(|p| {
            dir_pool(p).is_some_and(|d| {
                d.snapshots(Some(&name))
                    .is_ok_and(|s| s.iter().any(|(_, s)| *s == snap))
            }) || p.thin().is_some_and(|t| {
                t.get(&store::lvm::snapshot_lv(&name, &snap))
                    .is_ok_and(|lv| lv.is_some())
            })
        }),
    };
    let Some(pool) = pool else {
        return Ok(gone);
    };
    if let Some(dir) = dir_pool(pool) {
        return match dir.remove_snapshot(&name, &snap) {
            Ok(true) => Ok(json!({ "volume": name, "snapshot": snap, "deleted": true })),
            Ok(false) => Ok(gone),
            Err(e) => Err(io_error(format!("snapshot {name}@{snap}"))(e)),
        };
    }
    if let Some(thin) = pool.thin() {
        let lv = store::lvm::snapshot_lv(&name, &snap);
        // A thin snapshot's clones share its blocks, not its life: nothing depends on it.
        return match thin.remove(&lv, Duration::ZERO) {
            Ok(()) => Ok(json!({ "volume": name, "snapshot": snap, "deleted": true })),
            Err(e) if e.kind == store::lvm::LvmErrorKind::NotFound => Ok(gone),
            Err(e) => Err(lvm_error(format!("snapshot {name}@{snap}"))(e)),
        };
    }
    if !snapshot_names(shared, pool, &name)?.contains(&snap) {
        return Ok(gone);
    }
    let spec = pool
        .image(&name)
        .unwrap_or_else(|| unreachable!("an RBD pool's image"));
    let image = store::rbd::maintenance_image(&spec).map_err(io_error(format!("volume {name}")))?;
    // Protected for a clone: EBUSY while clones depend on it (refused: they would lose their
    // parent), EINVAL when it never was.
    match image.snap_unprotect(&snap) {
        Err(e) if e.errno() == Some(16) => {
            return Err(ControlError::Conflict(format!(
                "snapshot {name}@{snap} has dependent clones: delete (or flatten) them first"
            )))
        }
        Err(e) if e.errno() != Some(22) => {
            return Err(rbd_error(format!("snapshot {name}@{snap}"))(e))
        }
        _ => {}
    }
    image
        .snap_remove(&snap)
        .map_err(rbd_error(format!("snapshot {name}@{snap}")))?;
    Ok(json!({ "volume": name, "snapshot": snap, "deleted": true }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use store::lvm::{LvmError, LvmErrorKind};

    /// LVs by name and what each holds.
    type Lvs = Vec<(String, String)>;

    /// LVs by name, each with what it holds; `fail` names the one operation that fails.
    struct FakeLvs {
        lvs: RefCell<BTreeMap<String, String>>,
        fail: &'static str,
    }

    impl FakeLvs {
        fn new(fail: &'static str) -> FakeLvs {
            let lvs = [("vol", "new data"), ("vol+monday", "monday's data")];
            FakeLvs {
                lvs: RefCell::new(lvs.map(|(n, d)| (n.into(), d.into())).into()),
                fail,
            }
        }

        fn check(&self, op: &str) -> Result<(), LvmError> {
            match self.fail == op {
                true => Err(LvmError {
                    kind: LvmErrorKind::Failed,
                    command: op.into(),
                    message: "refused by the test".into(),
                }),
                false => Ok(()),
            }
        }

        fn holds(&self) -> Lvs {
            self.lvs.borrow().clone().into_iter().collect()
        }
    }

    impl RollbackLvs for FakeLvs {
        fn rename(&self, from: &str, to: &str) -> Result<(), LvmError> {
            self.check("rename")?;
            let mut lvs = self.lvs.borrow_mut();
            assert!(!lvs.contains_key(to), "renaming over {to}");
            let data = lvs.remove(from).expect("renaming an LV that is there");
            lvs.insert(to.into(), data);
            Ok(())
        }
        fn snapshot(&self, origin: &str, name: &str) -> Result<(), LvmError> {
            self.check("snapshot")?;
            let mut lvs = self.lvs.borrow_mut();
            assert!(!lvs.contains_key(name), "a snapshot over {name}");
            let data = lvs[origin].clone();
            lvs.insert(name.into(), data);
            Ok(())
        }
        fn extend(&self, name: &str, _size: u64) -> Result<(), LvmError> {
            self.check("extend")?;
            assert!(self.lvs.borrow().contains_key(name));
            Ok(())
        }
        fn remove(&self, name: &str) -> Result<(), LvmError> {
            self.check("remove")?;
            self.lvs
                .borrow_mut()
                .remove(name)
                .expect("removing an LV that is there");
            Ok(())
        }
    }

    /// Runs a rollback of `vol` to `monday` whose opens answer `opens` in turn; returns the
    /// result, the LVs after it, and what each open was for.
    fn rollback(lvs: &FakeLvs, opens: &[bool]) -> (Result<(), ControlError>, Lvs, Vec<String>) {
        let mut opened = Vec::new();
        let mut answers = opens.iter();
        let mut reopen = |what: &str| {
            opened.push(what.to_string());
            match answers.next() {
                Some(true) => Ok(()),
                _ => Err(ControlError::Device("the device would not open".into())),
            }
        };
        let result = swap_to_snapshot(lvs, "vol", "monday", 1 << 30, &mut reopen);
        (result, lvs.holds(), opened)
    }

    fn lvs(list: &[(&str, &str)]) -> Lvs {
        list.iter()
            .map(|(n, d)| (n.to_string(), d.to_string()))
            .collect()
    }

    #[test]
    fn a_thin_rollback_makes_the_snapshot_the_volume_and_drops_the_old_lv() {
        let (result, after, opened) = rollback(&FakeLvs::new(""), &[true]);
        result.unwrap();
        let expected = [("vol", "monday's data"), ("vol+monday", "monday's data")];
        assert_eq!(after, lvs(&expected));
        assert_eq!(opened, ["rolled back to monday"]);
    }

    #[test]
    fn a_thin_rollback_that_fails_leaves_the_volume_as_it_was_and_open() {
        let before = lvs(&[("vol", "new data"), ("vol+monday", "monday's data")]);
        for fail in ["rename", "snapshot", "extend"] {
            let (result, after, opened) = rollback(&FakeLvs::new(fail), &[true]);
            let e = result.unwrap_err().to_string();
            assert!(
                e.contains(fail) && e.contains("the volume is as it was"),
                "{e}"
            );
            assert_eq!(after, before, "{fail}");
            assert_eq!(
                opened,
                ["reopened as it was: its rollback failed"],
                "{fail}"
            );
        }
        // The rolled-back LV would not open: the old one is back and opens.
        let (result, after, opened) = rollback(&FakeLvs::new(""), &[false, true]);
        let e = result.unwrap_err().to_string();
        assert!(
            e.contains("would not open") && e.contains("as it was"),
            "{e}"
        );
        assert_eq!(after, before);
        assert_eq!(opened.len(), 2);
    }

    #[test]
    fn a_thin_rollback_says_when_its_device_is_left_out_of_the_running_config() {
        let (result, after, _) = rollback(&FakeLvs::new(""), &[false, false]);
        let e = result.unwrap_err().to_string();
        assert!(e.contains("out of the running config"), "{e}");
        assert_eq!(after[0], ("vol".into(), "new data".into()));
        // The old LV could not be put back: the error names where it is.
        let (result, after, opened) = rollback(&FakeLvs::new("remove"), &[false]);
        let e = result.unwrap_err().to_string();
        assert!(
            e.contains("vol+") && e.contains("out of the running config"),
            "{e}"
        );
        assert!(after.iter().any(|(n, d)| n == "vol+" && d == "new data"));
        assert_eq!(opened.len(), 1);
    }
}
