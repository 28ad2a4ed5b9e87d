//! Volumes and snapshots of `[[pool]]`s (docs/VOLUMES.md). A volume is a device: a file
//! `DIR/NAME.img` of a directory pool, image `NAME` of an RBD pool, or thin LV `VG/NAME` of an
//! LVM pool (`store::lvm`); created, cloned and deleted here by editing the running config
//! through the one path every changing verb takes (`apply_edited`). A snapshot is made while
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
use crate::config::{Config, DeviceConfig, PoolConfig, PoolKind, StoreKind};
use crate::shared::Shared;
use crate::topology::OpenDevice;

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
    let running = shared.topology().config.clone();
    match verb {
        "pool-add" => pool_add(shared, running, args),
        "volume-create" => create(shared, running, args),
        "volume-snapshot" => snapshot(shared, &running, args),
        "volume-clone" => clone(shared, running, args),
        "volume-rollback" => rollback(shared, &running, args),
        "volume-delete" => delete(shared, running, args),
        "volume-flatten" => flatten(&running, args),
        "volume-list" => Ok(list(shared, &running)),
        "snapshot-list" => Ok(json!({ "snapshots": snapshots_json(shared, &running, args)? })),
        "volume-export" => super::export::export(shared, running, args),
        "volume-unexport" => super::export::unexport(shared, running, args),
        _ => snapshot_delete(shared, &running, args),
    }
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> ControlError {
    move |e| ControlError::Device(format!("{what}: {e}"))
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

fn pool_add(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
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
            conf: args
                .get("ceph_conf")
                .and_then(Value::as_str)
                .map(PathBuf::from),
            client: args
                .get("ceph_client")
                .and_then(Value::as_str)
                .map(str::to_string),
        },
        _ => {
            return Err(ControlError::BadRequest(
                "give a \"path\" (a directory pool), an \"rbd_pool\", or a \"vg\" and its \"thin_pool\" (an LVM pool)".into(),
            ))
        }
    };
    if let Some(p) = running.pools.iter().find(|p| p.name == name) {
        if p.kind == kind {
            return Ok(json!({ "pool": name, "existed": true }));
        }
        return Err(ControlError::Conflict(format!(
            "pool {name} exists, otherwise"
        )));
    }
    if let PoolKind::Dir { path } = &kind {
        std::fs::create_dir_all(path)
            .map_err(io_error(format!("pool {name}: {}", path.display())))?;
    }
    let new = PoolConfig {
        name: name.clone(),
        kind,
    };
    if let Some(thin) = new.thin() {
        thin.check().map_err(lvm_error(format!("pool {name}")))?;
    }
    running.pools.push(new);
    let what = format!("pool {name} added");
    let mut answer = super::apply_edited(shared, "pool-add", args, what, running)?;
    answer["existed"] = json!(false);
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

fn create(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let pool = pool(&running, text(args, "pool")?)?.clone();
    let name = object_name(args, "name")?;
    let mut size = crate::config::parse_size(text(args, "size")?)?;
    if let Some(thin) = pool.thin() {
        // LVM makes whole extents: the volume's size is the rounded one.
        size = thin
            .rounded(size)
            .map_err(lvm_error(format!("pool {}", pool.name)))?;
    }
    if let Some(existing) = running.device(&name) {
        let now = shared
            .topology()
            .devices
            .get(&name)
            .map(|d| d.unit.capacity_bytes());
        let same = running
            .pool_of(existing)
            .is_some_and(|p| p.name == pool.name)
            && now == Some(size);
        if same {
            return Ok(
                json!({ "volume": name, "pool": pool.name, "size_bytes": size, "existed": true }),
            );
        }
        return Err(ControlError::Conflict(format!(
            "device {name} exists and is not a {size}-byte volume of pool {}",
            pool.name
        )));
    }
    match (&pool.kind, pool.image(&name)) {
        (PoolKind::Dir { path }, _) => {
            std::fs::create_dir_all(path).map_err(io_error(format!("pool {}", pool.name)))?
        }
        (_, Some(spec)) => store::rbd::pool(&spec)
            .map_err(io_error(format!("pool {}", pool.name)))?
            .create(&name, size)
            .map_err(rbd_error(format!("volume {name}")))?,
        (PoolKind::Lvm(thin), _) => thin
            .create(&name, size)
            .map_err(lvm_error(format!("volume {name}")))?,
        _ => {}
    }
    running
        .devices
        .push(volume_device(&pool, &name, Some(size))?);
    let what = format!("volume {name} created in pool {} ({size} bytes)", pool.name);
    let mut answer = super::apply_edited(shared, "volume-create", args, what, running)
        .inspect_err(|_| forget_new(&pool, &name))?;
    answer["existed"] = json!(false);
    Ok(answer)
}

/// A volume made for a verb that then failed: its file or image goes, so a retry starts
/// clean.
fn forget_new(pool: &PoolConfig, name: &str) {
    if let Some(path) = pool.volume_path(name) {
        let _ = std::fs::remove_file(path);
    } else if let Some(spec) = pool.image(name) {
        if let Ok(p) = store::rbd::pool(&spec) {
            let _ = p.remove(name);
        }
    } else if let Some(thin) = pool.thin() {
        let _ = thin.remove(name, REMOVE_WAIT);
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

/// Copies volume `name`'s file `from` to `to` as it is at one moment: a reflink while its
/// writes are held (milliseconds). Where the filesystem cannot share extents the copy takes
/// as long as the data does, too long to hold the writes of a volume in use: then the volume
/// must be unmapped or offline (no writes can come), or the copy is refused.
fn live_copy(
    shared: &Shared,
    running: &Config,
    name: &str,
    from: &std::path::Path,
    to: &std::path::Path,
) -> Result<store::clone::CloneMethod, ControlError> {
    let what = || format!("copy of volume {name}");
    let reflinked = with_writes_held(shared, name, || store::clone::reflink_file(from, to))?
        .map_err(io_error(what()))?;
    if reflinked {
        return Ok(store::clone::CloneMethod::Reflink);
    }
    let in_use =
        !mappings(running, name).is_empty() && !running.device(name).is_some_and(|d| d.offline);
    if in_use {
        return Err(ControlError::Conflict(format!(
            "volume {name} is in use and its pool's filesystem cannot reflink: the copy would \
             hold its writes for as long as copying its data takes; take it offline (ctl device \
             offline) or unmap it first, or put the pool on XFS or btrfs"
        )));
    }
    store::clone::clone_file(from, to, &mut copy_progress(what())).map_err(io_error(what()))
}

/// The snapshots of volume `volume` of `pool`.
fn snapshot_names(
    shared: &Shared,
    pool: &PoolConfig,
    volume: &str,
) -> Result<Vec<String>, ControlError> {
    match &pool.kind {
        PoolKind::Dir { .. } => Ok(dir_snapshots(pool, Some(volume))
            .map_err(io_error(format!("pool {}", pool.name)))?
            .into_iter()
            .map(|(_, s, _)| s)
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
    if snapshot_names(shared, pool, &name)?.contains(&snap) {
        return Ok(json!({ "volume": name, "snapshot": snap, "existed": true }));
    }
    let started = Instant::now();
    let method = match &pool.kind {
        PoolKind::Dir { path } => {
            let to = pool.snapshot_path(&name, &snap).unwrap_or_default();
            std::fs::create_dir_all(to.parent().unwrap_or(path))
                .map_err(io_error(format!("pool {}", pool.name)))?;
            let from = pool.volume_path(&name).unwrap_or_default();
            live_copy(shared, running, &name, &from, &to)?.name()
        }
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

fn clone(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let (pool, source) = volume(&running, text(args, "volume")?)?;
    let (pool, source) = (pool.clone(), source.name.clone());
    let name = object_name(args, "name")?;
    if let Some(existing) = running.device(&name) {
        if running
            .pool_of(existing)
            .is_some_and(|p| p.name == pool.name)
        {
            return Ok(json!({ "volume": name, "existed": true }));
        }
        return Err(ControlError::Conflict(format!(
            "device {name} exists and is not a volume of pool {}",
            pool.name
        )));
    }
    let snap = args.get("snapshot").and_then(Value::as_str);
    if let Some(snap) = snap {
        if !snapshot_names(shared, &pool, &source)?
            .iter()
            .any(|s| s == snap)
        {
            return Err(ControlError::NotFound(format!(
                "volume {source} has no snapshot {snap}"
            )));
        }
    }
    let started = Instant::now();
    let (method, taken) = match (snap, pool.image(&source)) {
        // librbd clones only snapshots: the volume as it is now is one taken for the clone.
        (None, Some(_)) => {
            let snap = snapshot_for_clone(shared, &pool, &source, &name)?;
            let made = clone_data(shared, &pool, &source, Some(&snap), &name);
            if made.is_err() {
                if let Ok(image) = rbd_image(shared, &source) {
                    let _ = image.snap_unprotect(&snap);
                    let _ = image.snap_remove(&snap);
                }
            }
            (made?, Some(snap))
        }
        _ => (clone_data(shared, &pool, &source, snap, &name)?, None),
    };
    running.devices.push(volume_device(&pool, &name, None)?);
    let what = format!("volume {name} cloned from {source} ({method})");
    let mut answer = super::apply_edited(shared, "volume-clone", args, what, running)
        .inspect_err(|_| forget_new(&pool, &name))?;
    answer["existed"] = json!(false);
    answer["method"] = json!(method);
    if let Some(snap) = taken {
        answer["snapshot"] = json!(snap);
    }
    answer["seconds"] = json!(started.elapsed().as_secs_f64());
    Ok(answer)
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

/// Makes volume `name` of `pool` a copy of `source` (of its snapshot `snap`, or of it now).
fn clone_data(
    shared: &Shared,
    pool: &PoolConfig,
    source: &str,
    snap: Option<&str>,
    name: &str,
) -> Result<&'static str, ControlError> {
    if let Some(thin) = pool.thin() {
        let what = format!("clone {name} of {source}");
        match snap {
            // A thin snapshot of the snapshot, active: a volume of its own.
            Some(snap) => thin.snapshot(&store::lvm::snapshot_lv(source, snap), name, true),
            None => with_writes_held(shared, source, || thin.snapshot(source, name, true))?,
        }
        .map_err(lvm_error(what))?;
        return Ok("lvm thin snapshot");
    }
    if let Some(dst) = pool.volume_path(name) {
        let made = match snap {
            Some(snap) => store::clone::clone_file(
                &pool.snapshot_path(source, snap).unwrap_or_default(),
                &dst,
                &mut copy_progress(format!("clone {name} of {source}@{snap}")),
            ),
            None => {
                let running = shared.topology().config.clone();
                let from = pool.volume_path(source).unwrap_or_default();
                return Ok(live_copy(shared, &running, source, &from, &dst)?.name());
            }
        };
        return Ok(made
            .map_err(io_error(format!("clone {name} of {source}")))?
            .name());
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
    Ok("rbd clone")
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

fn rollback(
    shared: &Shared,
    running: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let (pool, device) = volume(running, text(args, "volume")?)?;
    let name = device.name.clone();
    let snap = object_name(args, "snapshot")?;
    if !snapshot_names(shared, pool, &name)?.contains(&snap) {
        return Err(ControlError::NotFound(format!(
            "volume {name} has no snapshot {snap}"
        )));
    }
    if let Some(thin) = pool.thin() {
        return rollback_thin(shared, running, thin, device, &snap);
    }
    let mapped = mappings(running, &name);
    if !mapped.is_empty() && !device.offline {
        return Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): take it offline (ctl device offline) or unmap it first; \
             its initiators would see its blocks change under them",
            mapped.join("; ")
        )));
    }
    let method = match pool.volume_path(&name) {
        Some(path) => {
            let from = pool.snapshot_path(&name, &snap).unwrap_or_default();
            let restore = || -> std::io::Result<store::clone::CloneMethod> {
                let to = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)?;
                let size = to.metadata()?.len();
                let mut progress = copy_progress(format!("rollback of {name} to {snap}"));
                let method =
                    store::clone::clone_into(&std::fs::File::open(&from)?, &to, &mut progress)?;
                // A volume grown since keeps its size: the blocks past the snapshot read
                // as zeros.
                if to.metadata()?.len() < size {
                    to.set_len(size)?;
                }
                to.sync_all()?;
                Ok(method)
            };
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
    tracing::info!(volume = %name, snapshot = %snap, "ctl: volume rolled back");
    Ok(json!({ "volume": name, "snapshot": snap, "method": method }))
}

/// Rolls an LVM volume back. LVM has no in-place revert that keeps the snapshot, so the
/// volume becomes a new thin snapshot of its snapshot: its device leaves the running config
/// (the store closes), its LV is set aside as `NAME+`, the snapshot's active thin snapshot
/// is made `NAME`, and the device opens again; the set-aside LV goes once the old store has
/// closed. The volume must be unmapped: a mapped LUN cannot lose its device for a moment.
fn rollback_thin(
    shared: &Shared,
    running: &Config,
    thin: &store::lvm::ThinPool,
    device: &DeviceConfig,
    snap: &str,
) -> Result<Value, ControlError> {
    let name = device.name.clone();
    let mapped = mappings(running, &name);
    if !mapped.is_empty() {
        return Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): an LVM volume rolls back by replacing its thin LV, \
             which closes its device; unmap it first",
            mapped.join("; ")
        )));
    }
    let started = Instant::now();
    let size = thin
        .get(&name)
        .map_err(lvm_error(format!("volume {name}")))?
        .map_or(0, |lv| lv.size_bytes);
    let at = running.devices.iter().position(|d| d.name == name);
    let mut without = running.clone();
    without.devices.retain(|d| d.name != name);
    let quiet = Map::new();
    let what = format!("volume {name} closed for its rollback to {snap}");
    super::apply_edited(shared, "volume-rollback", &quiet, what, without)?;
    // The device comes back into the running config where it was, on whichever LV then
    // bears its name.
    let mut reopen = |what: &str| {
        let mut with = shared.topology().config.clone();
        let at = at.unwrap_or(with.devices.len()).min(with.devices.len());
        with.devices.insert(at, device.clone());
        let what = format!("volume {name} {what}");
        super::apply_edited(shared, "volume-rollback", &quiet, what, with).map(drop)
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
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    if running.device(&name).is_none() {
        return Ok(json!({ "volume": name, "deleted": false }));
    }
    let (pool, _) = volume(&running, &name)?;
    let pool = pool.clone();
    let mapped = mappings(&running, &name);
    if !mapped.is_empty() {
        return Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): unmap it first",
            mapped.join("; ")
        )));
    }
    let snaps = snapshot_names(shared, &pool, &name)?;
    if !snaps.is_empty() {
        return Err(ControlError::Conflict(format!(
            "volume {name} has snapshots ({}): delete them first",
            snaps.join(", ")
        )));
    }
    running.devices.retain(|d| d.name != name);
    let what = format!("volume {name} deleted from pool {}", pool.name);
    let mut answer = super::apply_edited(shared, "volume-delete", args, what, running)?;
    match (pool.volume_path(&name), pool.image(&name)) {
        // The store closes with its last command; the space is freed when it does.
        (Some(path), _) => {
            std::fs::remove_file(path).map_err(io_error(format!("volume {name}")))?
        }
        (_, Some(spec)) => remove_image(&spec)?,
        _ => {
            if let Some(thin) = pool.thin() {
                thin.remove(&name, REMOVE_WAIT)
                    .map_err(lvm_error(format!("volume {name}")))?;
            }
        }
    }
    answer["deleted"] = json!(true);
    Ok(answer)
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

/// The snapshots in a directory pool (of one volume): (volume, snapshot, path).
fn dir_snapshots(
    pool: &PoolConfig,
    volume: Option<&str>,
) -> std::io::Result<Vec<(String, String, PathBuf)>> {
    let Some(dir) = pool.dir().map(|d| d.join(".snapshots")) else {
        return Ok(Vec::new());
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let path = entry?.path();
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".img"))
        else {
            continue;
        };
        let Some((vol, snap)) = stem.split_once('@') else {
            continue;
        };
        if volume.is_none_or(|v| v == vol) {
            out.push((vol.to_string(), snap.to_string(), path.clone()));
        }
    }
    out.sort();
    Ok(out)
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
                "serial": d.serial,
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
            p.snapshot_path(&name, &snap)
                .is_some_and(|path| path.exists())
                || p.thin().is_some_and(|t| {
                    t.get(&store::lvm::snapshot_lv(&name, &snap))
                        .is_ok_and(|lv| lv.is_some())
                })
        }),
    };
    let Some(pool) = pool else {
        return Ok(gone);
    };
    if let Some(path) = pool.snapshot_path(&name, &snap) {
        return match std::fs::remove_file(&path) {
            Ok(()) => Ok(json!({ "volume": name, "snapshot": snap, "deleted": true })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(gone),
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
