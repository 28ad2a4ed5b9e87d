//! Volumes and snapshots of `[[pool]]`s (docs/VOLUMES.md). A volume is a device: a file
//! `DIR/NAME.img` of a directory pool, image `NAME` of an RBD pool, or thin LV `VG/NAME` of an
//! LVM pool. What a pool does by its own means (a file, librbd, LVM's tools) is
//! `store::pool::Pool`'s: this file never asks which kind a pool is, except for the LVM
//! rollback, which swaps LVs through transactions of its own. Every verb that changes the
//! config commits as one transaction on the running config of its moment (`transact`), after
//! its slow work, checking again what it assumed. A snapshot is made while the volume's writes
//! are held (`LogicalUnit::quiesced`, lent to the pool as [`Live::hold`]), so it holds every
//! write acknowledged before it and none after. Every verb is idempotent: asked for what is
//! already there, it answers success with `"existed": true`; asked to delete what is gone,
//! with `"deleted": false`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Map, Value};

use super::edit::{map_line, text, MapOf};
use super::error::ControlError;
use super::Step;
use crate::config::{Config, DeviceConfig, Lineage, PoolConfig, PoolKind, StoreKind};
use crate::shared::Shared;
use store::pool::{Made, Pool, PoolError, PoolErrorKind, Running, REMOVE_WAIT};

pub const VERBS: &[&str] = &[
    "pool-add",
    "pool-list",
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

pub fn handle(
    shared: &Shared,
    verb: &str,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    // What the verb's checks and slow work start from; each commit re-checks what it assumed
    // against the running config of its moment (`transact`).
    let seen = shared.topology().config.clone();
    let live = Live {
        shared,
        seen: &seen,
    };
    match verb {
        "pool-add" => pool_add(shared, &seen, args),
        "pool-list" => pool_list(&live, args),
        "volume-create" => create(&live, args),
        "volume-snapshot" => snapshot(&live, args),
        "volume-clone" => clone(&live, args),
        "volume-rollback" => rollback(shared, args),
        "volume-delete" => delete(&live, args),
        "volume-flatten" => flatten(&seen, args),
        "snapshot-list" => Ok(json!({ "snapshots": snapshots_json(&live, args)? })),
        "volume-export" => super::export::export(shared, args),
        "volume-unexport" => super::export::unexport(shared, args),
        "snapshot-delete" => snapshot_delete(&live, args),
        // `volume-list` is answered as text (`list`), before the verbs answered as values.
        _ => Err(ControlError::BadRequest(format!(
            "{verb} is not a volume verb here"
        ))),
    }
}

/// Puts right what verbs a crash interrupted in the directory pools (a rollback finished from
/// its intent, partial copies removed, a volume made and never committed removed unless the
/// config holds it), logging each: at start, before any device opens or the control socket
/// serves a verb.
pub fn recover_pools(config: &Config) {
    for pool in &config.pools {
        let Pool::Dir(dir) = pool.medium() else {
            continue;
        };
        // Whether the config holds the volume: a device of this pool's file of that name.
        let committed = |volume: &str| {
            config
                .device(volume)
                .is_some_and(|d| config.pool_of(d) == Some(pool))
        };
        match dir.recover(&committed) {
            Ok(done) => {
                for line in done {
                    tracing::warn!(pool = %pool.name, "{line}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::error!(pool = %pool.name, "cannot recover what a crash interrupted: {e}")
            }
        }
    }
}

/// A pool's failure as the verb's answer (one table).
impl From<PoolError> for ControlError {
    fn from(e: PoolError) -> ControlError {
        match e.kind {
            PoolErrorKind::Conflict => ControlError::Conflict(e.message),
            PoolErrorKind::NotFound => ControlError::NotFound(e.message),
            PoolErrorKind::Unsupported => ControlError::BadRequest(e.message),
            PoolErrorKind::Failed => ControlError::Device(e.message),
        }
    }
}

fn lvm_error(what: String) -> impl FnOnce(store::lvm::LvmError) -> ControlError {
    move |e| PoolError::lvm(&what)(e).into()
}

/// What the engine lends a pool of its running volumes, as the verb saw the config.
struct Live<'a> {
    shared: &'a Shared,
    seen: &'a Config,
}

impl Running for Live<'_> {
    fn hold(
        &self,
        volume: &str,
        f: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, PoolError> {
        let device = self.shared.topology().devices.get(volume).cloned();
        let device = device.ok_or_else(|| PoolError {
            kind: PoolErrorKind::Conflict,
            message: format!("volume {volume} is not open"),
        })?;
        device.unit.quiesced(f).map_err(|e| PoolError {
            kind: PoolErrorKind::Failed,
            message: format!("volume {volume}: flushing it: {e}"),
        })
    }

    /// Asked of the running config of the moment, not of the verb's first look: a volume
    /// mapped since must not be copied without its writes held.
    fn in_use(&self, volume: &str) -> bool {
        in_use(&self.shared.topology().config, volume)
    }

    fn rbd_image(&self, volume: &str) -> Result<Arc<rbd::Image>, PoolError> {
        let not = |message| PoolError {
            kind: PoolErrorKind::Conflict,
            message,
        };
        let topology = self.shared.topology();
        let device = topology.devices.get(volume);
        let device = device.ok_or_else(|| not(format!("volume {volume} is not open")))?;
        let store = device.rbd.as_ref();
        let store = store.ok_or_else(|| not(format!("volume {volume} is no RBD image")))?;
        store.image().map_err(|e| PoolError {
            kind: PoolErrorKind::Failed,
            message: format!("volume {volume}: {e}"),
        })
    }

    fn progress(&self, what: &str) -> Box<dyn FnMut(u64, u64)> {
        Box::new(copy_progress(what.to_string()))
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

fn object_name(args: &Map<String, Value>, key: &str) -> Result<String, ControlError> {
    let name = text(args, key)?;
    crate::config::check_object_name(name).map_err(ControlError::bad_request)?;
    Ok(name.to_string())
}

/// `config` with `change` made, validated as a file would be (by difference): what a verb checks before
/// any side effect (a directory made, a tool run), so that nothing is made for a change the
/// config would refuse.
fn valid_with(
    config: &Config,
    verb: &str,
    change: impl FnOnce(&mut Config),
) -> Result<(), ControlError> {
    let mut candidate = config.clone();
    change(&mut candidate);
    candidate
        .revalidated_from(config, verb)
        .map(drop)
        .map_err(|errors| ControlError::Invalid(super::of_the_verb(errors, verb)))
}

/// Whether `config` with `device` added is valid (as [`valid_with`], by difference).
fn valid_device(config: &Config, verb: &str, device: &DeviceConfig) -> Result<(), ControlError> {
    config
        .check_added(device, verb)
        .map_err(|errors| ControlError::Invalid(super::of_the_verb(errors, verb)))
}

/// `volume` taken for this verb's work on its medium (`Shared::busy`), or `conflict` naming
/// the verb busy with it (a client retries).
fn busy<'s>(
    shared: &'s Shared,
    volume: &str,
    doing: &'static str,
) -> Result<crate::shared::Busy<'s>, ControlError> {
    shared.busy(volume, doing).map_err(|other| {
        ControlError::Conflict(format!(
            "volume {volume} is busy: {other} is running on it; try again when it is done"
        ))
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
    // a directory is made or LVM is asked anything. A directory not there yet is judged by
    // its parent, which must exist and be allowed.
    new.check(&seen.server.device_roots)
        .map_err(|e| ControlError::BadRequest(format!("pool {name}: {e}")))?;
    valid_with(seen, "pool-add", |c| c.pools.push(new.clone()))?;
    match new.medium() {
        Pool::Dir(dir) => dir.make_dir().map_err(|e| {
            ControlError::Device(format!("pool {name}: {}: {e}", dir.dir().display()))
        })?,
        Pool::Lvm(thin) => thin.check().map_err(lvm_error(format!("pool {name}")))?,
        Pool::Rbd(_) => {}
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
    if let Some(fields) = answer.as_object_mut() {
        fields.entry("existed").or_insert(json!(false));
    }
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

fn create(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (shared, seen) = (live.shared, live.seen);
    let pool = pool(seen, text(args, "pool")?)?.clone();
    let name = object_name(args, "name")?;
    pool.check_volume_name(&name)?;
    let medium = pool.medium();
    // LVM makes whole extents: the volume's size is the rounded one.
    let size = medium.rounded(crate::config::parse_size(text(args, "size")?)?)?;
    let adopt = args.get("adopt").and_then(Value::as_bool).unwrap_or(false);
    let existed = json!({ "volume": name, "pool": pool.name, "size_bytes": size, "existed": true });
    let same = |p: &PoolConfig, d: &DeviceConfig| {
        let now = shared
            .topology()
            .devices
            .get(name.as_str())
            .map(|d| d.unit.capacity_bytes());
        p.name == pool.name && now == Some(size) && d.lineage.clone_of.is_none()
    };
    if let Some(answer) = already(seen, &name, same, existed.clone())? {
        return Ok(answer);
    }
    let mut device = volume_device(&pool, &name, (!adopt).then_some(size))?;
    device.lineage = Lineage::now(None);
    valid_device(seen, "volume-create", &device)?;
    let made = match medium.create(&name, size, adopt) {
        Ok(made) => made,
        Err(e) if e.kind == PoolErrorKind::Conflict => {
            // Made meanwhile by the same request repeated: the running config tells.
            let running = shared.topology().config.clone();
            if let Some(answer) = already(&running, &name, same, existed)? {
                return Ok(answer);
            }
            return Err(ControlError::Conflict(format!(
                "{e}; a volume left by someone else (or by a verb a crash interrupted) is \
                 never taken over silently: remove it, or take a directory pool's file as \
                 the volume with \"adopt\": true"
            )));
        }
        Err(e) => return Err(e.into()),
    };
    let what = format!(
        "volume {name} created in pool {} ({})",
        pool.name,
        crate::config::size_text(size)
    );
    let committed = super::transact(shared, "volume-create", args, |running| {
        commit_new(running, &pool, &name, device.clone(), what.clone())
    });
    finish_new(committed, made, &[("existed", json!(false))])
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
    config.devices.push(device.into());
    Ok(Step::Apply {
        config: Box::new(config),
        what,
    })
}

/// A new volume's answer once its commit ran: what it made stays if it committed, else goes.
fn finish_new(
    committed: Result<Value, ControlError>,
    made: Made,
    extra: &[(&str, Value)],
) -> Result<Value, ControlError> {
    match committed {
        // Applied and kept, even when only the save failed (`not_saved`: it runs).
        Ok(mut answer) => {
            made.committed();
            for (key, value) in extra {
                answer[*key] = value.clone();
            }
            Ok(answer)
        }
        Err(e @ ControlError::NotSaved(_)) => {
            made.committed();
            Err(e)
        }
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

/// The snapshots of volume `volume` of `pool`.
fn snapshot_names(
    live: &Live,
    pool: &PoolConfig,
    volume: &str,
) -> Result<Vec<String>, ControlError> {
    let list = pool.medium().snapshots(live, Some(volume))?;
    Ok(list.into_iter().map(|(_, s)| s).collect())
}

fn snapshot(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (pool, device) = volume(live.seen, text(args, "volume")?)?;
    let name = device.name.clone();
    let snap = object_name(args, "snapshot")?;
    pool.check_snapshot_name(&name, &snap)?;
    let there = json!({ "volume": name, "snapshot": snap, "existed": true });
    let _busy = busy(live.shared, &name, "a snapshot")?;
    let medium = pool.medium();
    if medium.has_snapshot(live, &name, &snap)? {
        return Ok(there);
    }
    let started = Instant::now();
    let method = match medium.snapshot(live, &name, &snap) {
        Ok(method) => method,
        // Taken meanwhile by the same request repeated.
        Err(e)
            if e.kind == PoolErrorKind::Conflict && medium.has_snapshot(live, &name, &snap)? =>
        {
            return Ok(there)
        }
        Err(e) => return Err(e.into()),
    };
    tracing::info!(volume = %name, snapshot = %snap, method, "ctl: snapshot taken");
    Ok(json!({
        "volume": name, "snapshot": snap, "existed": false,
        "method": method, "seconds": started.elapsed().as_secs_f64(),
    }))
}

fn clone(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (shared, seen) = (live.shared, live.seen);
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
    valid_device(seen, "volume-clone", &device)?;
    let medium = pool.medium();
    if let Some(snap) = &snap {
        if !medium.has_snapshot(live, &source, snap)? {
            return Err(ControlError::NotFound(format!(
                "volume {source} has no snapshot {snap}"
            )));
        }
    }
    let started = Instant::now();
    let (method, made, taken) = clone_medium(live, &medium, &source, snap.as_deref(), &name)?;
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
    let failed = committed.as_ref().is_err_and(|e| e.kind() != "not_saved");
    let mut extra = vec![
        ("existed", json!(false)),
        ("clone_of", json!(clone_of)),
        ("method", json!(method)),
        ("seconds", json!(started.elapsed().as_secs_f64())),
    ];
    if let Some(snap) = &taken {
        extra.push(("snapshot", json!(snap)));
    }
    let answer = finish_new(committed, made, &extra);
    if let (true, Some(snap)) = (failed, &taken) {
        // After the clone image is gone: librbd keeps a parent snapshot while clones need it.
        medium.drop_clone_snapshot(live, &source, snap);
    }
    answer
}

/// The pool's copy of `source` (its snapshot `snap`, or it now) as volume `name`: how, what it
/// made, and the snapshot taken for it. An RBD pool clones only snapshots: the volume as it is
/// now is first a snapshot named after the clone, crash-consistent like any, kept while the
/// clone depends on it (`volume flatten` frees it); one of that name made by someone else is
/// refused, not reused: it holds another moment.
fn clone_medium(
    live: &Live,
    medium: &Pool,
    source: &str,
    snap: Option<&str>,
    name: &str,
) -> Result<(&'static str, Made, Option<String>), ControlError> {
    if snap.is_some() || !matches!(medium, Pool::Rbd(_)) {
        let (method, made) = medium.clone_volume(live, source, snap, name)?;
        return Ok((method, made, None));
    }
    if medium.has_snapshot(live, source, name)? {
        return Err(ControlError::Conflict(format!(
            "volume {source} has a snapshot {name} already, and a clone of it as it is now is \
             made from a new snapshot of that name: clone that one with --snapshot {name}, or \
             give the clone another name"
        )));
    }
    medium.snapshot(live, source, name)?;
    match medium.clone_volume(live, source, Some(name), name) {
        Ok((method, made)) => Ok((method, made, Some(name.to_string()))),
        Err(e) => {
            medium.drop_clone_snapshot(live, source, name);
            Err(e.into())
        }
    }
}

/// Makes an RBD clone independent of its parent snapshot (librbd copies the blocks it still
/// shares); other pools' clones depend on nothing (`"flattened": false`).
fn flatten(running: &Config, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (pool, device) = volume(running, text(args, "volume")?)?;
    let name = device.name.clone();
    let started = Instant::now();
    let flattened = pool.medium().flatten(&name)?;
    let mut answer = json!({ "volume": name, "flattened": flattened });
    if flattened {
        answer["seconds"] = json!(started.elapsed().as_secs_f64());
    }
    Ok(answer)
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

/// Whether hosts may write volume `name` in `config`: mapped and online.
fn in_use(config: &Config, name: &str) -> bool {
    !mappings(config, name).is_empty() && !config.device(name).is_some_and(|d| d.offline)
}

/// Where a volume is mapped ("TARGET group G LUN n"), as `device-remove` says it.
fn mappings(config: &Config, name: &str) -> Vec<String> {
    super::edit::mappings_of(config, name)
}

/// Who sees a volume (`maps`, its maps), per map: what an orchestrator checks before it gives
/// a volume to one host only.
/// Where a volume is exported: a LUN map with who may reach it.
#[derive(Serialize)]
struct Export<'c> {
    target: &'c str,
    nqn: Option<&'c str>,
    group: &'c str,
    lun: u64,
    read_only: bool,
    initiators: Vec<&'c str>,
    any_initiator: bool,
}

fn exports<'c>(maps: Option<&Vec<MapOf<'c>>>) -> Vec<Export<'c>> {
    (maps.into_iter().flatten())
        .map(|&(t, g, m)| Export {
            target: t.iqn.as_str(),
            nqn: t.nqn.as_ref().map(|n| n.as_str()),
            group: &g.name,
            lun: m.lun,
            read_only: m.read_only,
            initiators: g.initiators.iter().map(|i| i.as_str()).collect(),
            any_initiator: g.any_initiator,
        })
        .collect()
}

fn rollback(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    let snap = object_name(args, "snapshot")?;
    let seen = shared.topology().config.clone();
    let live = Live {
        shared,
        seen: &seen,
    };
    let (pool, device) = volume(&seen, &name)?;
    let _busy = busy(shared, &name, "a rollback")?;
    if !pool.medium().has_snapshot(&live, &name, &snap)? {
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
    let (pool, _) = volume(&running, &name)?;
    if in_use(&running, &name) {
        return Err(ControlError::Conflict(format!(
            "volume {name} is mapped ({}): take it offline (ctl device offline) or unmap it first; \
             its initiators would see its blocks change under them",
            mappings(&running, &name).join("; ")
        )));
    }
    let live = Live {
        shared,
        seen: &running,
    };
    let method = pool.medium().rollback(&live, &name, &snap)?;
    drop(lock);
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
            config.devices.insert(at, device.clone().into());
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

fn delete(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let (shared, seen) = (live.shared, live.seen);
    let name = object_name(args, "volume")?;
    let gone = json!({ "volume": name, "deleted": false });
    if seen.device(&name).is_none() {
        return Ok(gone);
    }
    let (pool, _) = volume(seen, &name)?;
    let pool = pool.clone();
    // No snapshot may land between the check for snapshots below and the removal.
    let _busy = busy(shared, &name, "a delete")?;
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
    let snaps = snapshot_names(live, &pool, &name)?;
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
    // The device is out of the config first, the medium goes after: a crash between leaves
    // an unused medium, never a device without one.
    pool.medium().remove(&name)?;
    answer["deleted"] = json!(true);
    Ok(answer)
}

/// Every volume of `config`: its pool and device.
fn volumes(config: &Config) -> impl Iterator<Item = (&PoolConfig, &DeviceConfig)> {
    config
        .devices
        .iter()
        .filter_map(|d| Some((config.pool_of(d)?, &**d)))
}

fn snapshots_json(live: &Live, args: &Map<String, Value>) -> Result<Vec<Value>, ControlError> {
    let only = args.get("volume").and_then(Value::as_str);
    let mut out = Vec::new();
    let mut snapshots = Snapshots::default();
    for (pool, device) in volumes(live.seen).filter(|(_, d)| only.is_none_or(|o| o == d.name)) {
        let medium = pool.medium();
        let names = match only {
            Some(_) => snapshot_names(live, pool, &device.name)?,
            None => snapshots.of(live, pool, &device.name)?,
        };
        for snapshot in names {
            let created = medium
                .snapshot_time(&device.name, &snapshot)
                .and_then(crate::config::rfc3339);
            out.push(
                json!({ "pool": pool.name, "volume": device.name, "snapshot": snapshot,
                             "created": created }),
            );
        }
    }
    Ok(out)
}

/// Every volume (`volume`: only that one, or none if there is no such volume) with its size,
/// maps, exports and snapshots. Each is looked up, not searched for: the maps by device and
/// each pool's snapshots listed once (a search or a listing per volume made this quadratic in
/// the volumes). One volume's listing lists only its snapshots: a CSI driver asks for one
/// volume before a snapshot or a capability check, and every volume's answer grows with the
/// array (9.6 µs of the daemon's CPU a volume).
/// `volume-list`'s answer (`ok` included: a rendered answer is a successful one).
#[derive(Serialize)]
struct VolumeList<'c> {
    ok: bool,
    pools: Vec<Value>,
    volumes: Vec<VolumeRow<'c>>,
}

/// One volume: its pool, size, LUN maps (as lines and as exports), snapshots and lineage.
#[derive(Serialize)]
struct VolumeRow<'c> {
    pool: &'c str,
    volume: &'c str,
    size_bytes: Option<u64>,
    mapped: Vec<String>,
    exports: Vec<Export<'c>>,
    snapshots: Vec<String>,
    serial: &'c str,
    clone_of: Option<&'c str>,
    created: Option<&'c str>,
}

/// `volume-list` (`volume`: that one), as the text of its answer. Its rows are typed and
/// written straight to text, as `stats`' are (`listings.rs`): built as `serde_json::Value`s,
/// the whole list cost the daemon ~100 ms of CPU at 16,000 volumes, most of it allocating,
/// writing and freeing the values.
pub(super) fn list(shared: &Shared, args: &Map<String, Value>) -> Result<String, ControlError> {
    let only = match args.get("volume") {
        None | Some(Value::Null) => None,
        Some(_) => Some(text(args, "volume")?),
    };
    let topology = shared.topology();
    let config = &topology.config;
    let live = Live {
        shared,
        seen: config,
    };
    // One volume's maps found by a walk, not every device's gathered.
    let maps = match only {
        Some(name) => HashMap::from([(name, super::edit::maps_of(config, name).collect())]),
        None => super::edit::maps_by_device(config),
    };
    let mut snapshots_of = Snapshots::default();
    let mut rows = Vec::new();
    for (pool, d) in volumes(config).filter(|(_, d)| only.is_none_or(|o| o == d.name)) {
        let snapshots = match only {
            Some(_) => snapshot_names(&live, pool, &d.name),
            None => snapshots_of.of(&live, pool, &d.name),
        }
        .unwrap_or_default();
        let own = maps.get(d.name.as_str());
        rows.push(VolumeRow {
            pool: &pool.name,
            volume: &d.name,
            size_bytes: (topology.devices.get(d.name.as_str())).map(|o| o.unit.capacity_bytes()),
            mapped: own.into_iter().flatten().copied().map(map_line).collect(),
            exports: exports(own),
            snapshots,
            serial: &d.serial,
            clone_of: d.lineage.clone_of.as_deref(),
            created: d.lineage.created.as_deref(),
        });
    }
    let answer = VolumeList {
        ok: true,
        pools: config.pools.iter().map(pool_json).collect(),
        volumes: rows,
    };
    Ok(super::listings::rendered(&answer))
}

/// The snapshots of many volumes, for a listing: each pool's listed once (sorted, as one
/// volume's are) where it can list them all; a listing per volume made listings quadratic.
#[derive(Default)]
struct Snapshots<'c> {
    /// By pool: its snapshots by volume, or None where it lists one volume's at a time (RBD)
    /// or its whole listing failed (each volume then asks, and says why).
    pools: HashMap<&'c str, Option<HashMap<String, Vec<String>>>>,
}

impl<'c> Snapshots<'c> {
    fn of(
        &mut self,
        live: &Live,
        pool: &'c PoolConfig,
        volume: &str,
    ) -> Result<Vec<String>, ControlError> {
        let listed = self.pools.entry(pool.name.as_str()).or_insert_with(|| {
            let all = pool.medium().snapshots(live, None).ok()?;
            let mut by: HashMap<String, Vec<String>> = HashMap::new();
            for (volume, snapshot) in all {
                by.entry(volume).or_default().push(snapshot);
            }
            Some(by)
        });
        match listed {
            Some(by) => Ok(by.get(volume).cloned().unwrap_or_default()),
            None => snapshot_names(live, pool, volume),
        }
    }
}

/// A pool as the lists show it: its name, kind and where its volumes are.
fn pool_json(p: &PoolConfig) -> Value {
    match &p.kind {
        PoolKind::Dir { path } => json!({ "pool": p.name, "kind": "dir", "path": path }),
        PoolKind::Rbd { pool, .. } => json!({ "pool": p.name, "kind": "rbd", "rbd_pool": pool }),
        PoolKind::Lvm(thin) => {
            json!({ "pool": p.name, "kind": "lvm", "vg": thin.vg, "thin_pool": thin.pool })
        }
    }
}

/// The pools (`pool`: that one), each with what its medium holds and has left
/// (`store::pool::Capacity`) beside what its volumes promise. Listing all, a pool whose
/// medium cannot answer says why and the others are still listed; asked for one, its failure
/// is the verb's.
fn pool_list(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let only = match args.get("pool") {
        None | Some(Value::Null) => None,
        Some(_) => Some(object_name(args, "pool")?),
    };
    let chosen: Vec<&PoolConfig> = live
        .seen
        .pools
        .iter()
        .filter(|p| only.as_ref().is_none_or(|o| *o == p.name))
        .collect();
    if let (Some(name), true) = (&only, chosen.is_empty()) {
        return Err(ControlError::NotFound(format!("no pool {name}")));
    }
    let topology = live.shared.topology();
    let mut pools = Vec::with_capacity(chosen.len());
    for pool in chosen {
        let mut entry = pool_json(pool);
        let sizes: Vec<u64> = volumes(live.seen)
            .filter(|(p, _)| p.name == pool.name)
            .map(|(_, d)| {
                let open = topology.devices.get(d.name.as_str());
                open.map_or(0, |o| o.unit.capacity_bytes())
            })
            .collect();
        entry["volumes"] = json!(sizes.len());
        entry["provisioned_bytes"] = json!(sizes.iter().sum::<u64>());
        match pool.medium().capacity() {
            Ok(c) => {
                entry["total_bytes"] = json!(c.total_bytes);
                entry["available_bytes"] = json!(c.available_bytes);
            }
            Err(e) if only.is_some() => return Err(e.into()),
            Err(e) => entry["error"] = json!(e.message),
        }
        pools.push(entry);
    }
    Ok(json!({ "pools": pools }))
}

fn snapshot_delete(live: &Live, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let running = live.seen;
    let name = object_name(args, "volume")?;
    let snap = object_name(args, "snapshot")?;
    let gone = json!({ "volume": name, "snapshot": snap, "deleted": false });
    let deleted = json!({ "volume": name, "snapshot": snap, "deleted": true });
    if let Some(device) = running.device(&name) {
        let Some(pool) = running.pool_of(device) else {
            return Ok(gone);
        };
        // Not under a rollback to it.
        let _busy = busy(live.shared, &name, "a snapshot's delete")?;
        let removed = pool.medium().remove_snapshot(&name, &snap)?;
        return Ok(if removed { deleted } else { gone });
    }
    // A volume deleted already: the pool that holds the snapshot (its snapshots outlive it).
    for pool in &running.pools {
        if pool.medium().remove_snapshot(&name, &snap)? {
            return Ok(deleted);
        }
    }
    Ok(gone)
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

#[cfg(test)]
mod list_tests {
    use serde_json::{json, Value};

    /// A directory pool of two volumes (one a clone, mapped in two groups) and a RAM device
    /// outside it; the pool's directory, removed by the caller.
    fn config(dir: &std::path::Path) -> String {
        std::fs::create_dir_all(dir).expect("pool directory");
        for (name, mib) in [("v0", 1), ("v1", 2)] {
            let file = std::fs::File::create(dir.join(format!("{name}.img"))).expect("volume");
            file.set_len(mib << 20).expect("volume's size");
        }
        let path = dir.display();
        format!(
            r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[pool]]
name = "p"
path = "{path}"
[[device]]
name = "v0"
store = "file"
path = "{path}/v0.img"
[[device]]
name = "v1"
store = "file"
path = "{path}/v1.img"
clone_of = "v0"
created = "2026-12-07T19:00:00Z"
[[device]]
name = "ram"
store = "ram"
size = "1M"
[[target]]
iqn = "iqn.2026-12.test:t"
nqn = "nqn.2026-12.test:t"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "v1" }}, {{ lun = 1, device = "ram" }} ]
  [[target.group]]
  name = "hosts"
  initiators = ["iqn.2026-12.test:h"]
  luns = [ {{ lun = 3, device = "v1", read_only = true }} ]
"#
        )
    }

    /// The answer as the socket sends it, checked against the remote API's value.
    fn listed(shared: &crate::shared::Shared, request: &str) -> Value {
        let line = super::super::handle_line(shared, request.as_bytes());
        let sent: Value = serde_json::from_str(&line).expect("the line is JSON");
        let value = super::super::handle(shared, request.as_bytes());
        assert_eq!(sent, value, "the line and the value are one answer");
        sent
    }

    #[test]
    fn every_volume_has_its_pool_size_maps_exports_and_lineage() {
        let dir = std::env::temp_dir().join(format!("ferrosan-volume-list-{}", std::process::id()));
        let shared = crate::shared::testing::shared(&config(&dir));
        let all = listed(&shared, r#"{"verb":"volume-list"}"#);
        let one = listed(&shared, r#"{"verb":"volume-list","volume":"v1"}"#);
        let none = listed(&shared, r#"{"verb":"volume-list","volume":"ram"}"#);
        let bad = listed(&shared, r#"{"verb":"volume-list","volume":7}"#);
        std::fs::remove_dir_all(&dir).expect("the pool's directory removed");
        assert_eq!(all["ok"], true);
        assert_eq!(
            all["pools"],
            json!([{ "pool": "p", "kind": "dir", "path": dir }])
        );
        let volumes = all["volumes"].as_array().expect("volumes");
        let names: Vec<&str> = volumes
            .iter()
            .filter_map(|v| v["volume"].as_str())
            .collect();
        assert_eq!(
            names,
            ["v0", "v1"],
            "a device outside the pool is no volume"
        );
        let (v0, v1) = (&volumes[0], &volumes[1]);
        assert_eq!(
            (&v0["pool"], &v0["size_bytes"]),
            (&json!("p"), &json!(1 << 20))
        );
        assert_eq!((&v0["mapped"], &v0["exports"]), (&json!([]), &json!([])));
        assert_eq!(
            (&v0["clone_of"], &v0["created"]),
            (&Value::Null, &Value::Null)
        );
        assert_eq!(v1["size_bytes"], 2 << 20);
        assert_eq!(
            v1["mapped"],
            json!([
                "iqn.2026-12.test:t group all LUN 0",
                "iqn.2026-12.test:t group hosts LUN 3"
            ])
        );
        assert_eq!(
            v1["exports"],
            json!([
                { "target": "iqn.2026-12.test:t", "nqn": "nqn.2026-12.test:t", "group": "all",
                  "lun": 0, "read_only": false, "initiators": [], "any_initiator": true },
                { "target": "iqn.2026-12.test:t", "nqn": "nqn.2026-12.test:t", "group": "hosts",
                  "lun": 3, "read_only": true, "initiators": ["iqn.2026-12.test:h"],
                  "any_initiator": false },
            ])
        );
        assert_eq!(
            (&v1["clone_of"], &v1["created"]),
            (&json!("v0"), &json!("2026-12-07T19:00:00Z"))
        );
        assert_eq!(v1["snapshots"], json!([]));
        assert!(v1["serial"].as_str().is_some_and(|s| !s.is_empty()));
        assert_ne!(v0["serial"], v1["serial"]);
        // One volume asked for is that volume's row of the whole list; a name that is no
        // volume lists none; a name that is not a string is refused.
        assert_eq!(one["volumes"], json!([v1]));
        assert_eq!((&none["ok"], &none["volumes"]), (&json!(true), &json!([])));
        assert_eq!(
            (&bad["ok"], &bad["kind"]),
            (&json!(false), &json!("bad_request"))
        );
    }
}
