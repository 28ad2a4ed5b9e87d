//! Volumes and snapshots of `[[pool]]` directories (docs/VOLUMES.md). A volume is a device
//! whose file is `POOL/NAME.img`: created, cloned and deleted here by editing the running
//! config through the one path every changing verb takes (`apply_edited`). A snapshot is a
//! file `POOL/.snapshots/VOLUME@NAME.img`, made by the filesystem (`store::clone`: a reflink
//! where it can) while the volume's writes are held (`LogicalUnit::quiesced`), so it holds
//! every write acknowledged before it and none after. Every verb is idempotent: asked for
//! what is already there, it answers success with `"existed": true`.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::edit::text;
use super::error::ControlError;
use crate::config::{Config, DeviceConfig, PoolConfig};
use crate::shared::Shared;

pub const VERBS: &[&str] = &[
    "pool-add",
    "volume-create",
    "volume-snapshot",
    "volume-clone",
    "volume-rollback",
    "volume-delete",
    "volume-list",
    "snapshot-list",
    "snapshot-delete",
];

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
        "volume-list" => Ok(list(&running)),
        "snapshot-list" => Ok(json!({ "snapshots": snapshots_json(&running, args)? })),
        _ => snapshot_delete(&running, args),
    }
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> ControlError {
    move |e| ControlError::Device(format!("{what}: {e}"))
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

fn pool_add(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let name = object_name(args, "name")?;
    let path = PathBuf::from(text(args, "path")?);
    if let Some(p) = running.pools.iter().find(|p| p.name == name) {
        if p.path == path {
            return Ok(json!({ "pool": name, "existed": true }));
        }
        return Err(ControlError::Conflict(format!(
            "pool {name} exists with path {}",
            p.path.display()
        )));
    }
    std::fs::create_dir_all(&path).map_err(io_error(format!("pool {name}: {}", path.display())))?;
    running.pools.push(PoolConfig {
        name: name.clone(),
        path,
    });
    let mut answer = super::apply_edited(
        shared,
        "pool-add",
        args,
        format!("pool {name} added"),
        running,
    )?;
    answer["existed"] = json!(false);
    Ok(answer)
}

fn create(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let pool = pool(&running, text(args, "pool")?)?.clone();
    let name = object_name(args, "name")?;
    let size = crate::config::parse_size(text(args, "size")?)?;
    if let Some(existing) = running.device(&name) {
        let same = running
            .pool_of(existing)
            .is_some_and(|p| p.name == pool.name)
            && file_bytes(&pool.volume_path(&name)) == size;
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
    std::fs::create_dir_all(&pool.path).map_err(io_error(format!("pool {}", pool.name)))?;
    let path = pool.volume_path(&name);
    let spec = format!("file:{},size={size}", path.display());
    running
        .devices
        .push(Config::device_from_spec(&name, &spec)?);
    let what = format!("volume {name} created in pool {} ({size} bytes)", pool.name);
    let mut answer = super::apply_edited(shared, "volume-create", args, what, running)?;
    answer["existed"] = json!(false);
    answer["path"] = json!(path);
    Ok(answer)
}

/// Runs `f` with the volume's writes held, if it is open (a volume the running topology does
/// not hold cannot be written).
fn with_writes_held<R>(
    shared: &Shared,
    name: &str,
    f: impl FnOnce() -> R,
) -> Result<R, ControlError> {
    let topology = shared.topology();
    match topology.devices.get(name) {
        Some(device) => device
            .unit
            .quiesced(f)
            .map_err(io_error(format!("volume {name}: flushing it"))),
        None => Ok(f()),
    }
}

fn snapshot(
    shared: &Shared,
    running: &Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let (pool, device) = volume(running, text(args, "volume")?)?;
    let snap = object_name(args, "snapshot")?;
    let path = pool.snapshot_path(&device.name, &snap);
    if path.exists() {
        return Ok(json!({ "volume": device.name, "snapshot": snap, "existed": true }));
    }
    let dir = path.parent().unwrap_or(&pool.path);
    std::fs::create_dir_all(dir).map_err(io_error(format!("pool {}", pool.name)))?;
    let source = pool.volume_path(&device.name);
    let started = std::time::Instant::now();
    let method = with_writes_held(shared, &device.name, || {
        store::clone::clone_file(&source, &path)
    })?
    .map_err(io_error(format!("snapshot {}@{snap}", device.name)))?;
    tracing::info!(volume = %device.name, snapshot = %snap, method = method.name(), "ctl: snapshot taken");
    Ok(json!({
        "volume": device.name, "snapshot": snap, "existed": false,
        "method": method.name(), "seconds": started.elapsed().as_secs_f64(),
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
    let dst = pool.volume_path(&name);
    let started = std::time::Instant::now();
    let method = match args.get("snapshot").and_then(Value::as_str) {
        Some(snap) => {
            let from = pool.snapshot_path(&source, snap);
            if !from.exists() {
                return Err(ControlError::NotFound(format!(
                    "volume {source} has no snapshot {snap}"
                )));
            }
            store::clone::clone_file(&from, &dst)
        }
        None => with_writes_held(shared, &source, || {
            store::clone::clone_file(&pool.volume_path(&source), &dst)
        })?,
    }
    .map_err(io_error(format!("clone {name} of {source}")))?;
    running.devices.push(Config::device_from_spec(
        &name,
        &format!("file:{}", dst.display()),
    )?);
    let what = format!("volume {name} cloned from {source} ({})", method.name());
    let mut answer =
        super::apply_edited(shared, "volume-clone", args, what, running).inspect_err(|_| {
            // Not added: the file goes too, so a retry starts clean.
            let _ = std::fs::remove_file(&dst);
        })?;
    answer["existed"] = json!(false);
    answer["method"] = json!(method.name());
    answer["seconds"] = json!(started.elapsed().as_secs_f64());
    Ok(answer)
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
    let snap = object_name(args, "snapshot")?;
    let from = pool.snapshot_path(&device.name, &snap);
    if !from.exists() {
        return Err(ControlError::NotFound(format!(
            "volume {} has no snapshot {snap}",
            device.name
        )));
    }
    let mapped = mappings(running, &device.name);
    if !mapped.is_empty() && !device.offline {
        return Err(ControlError::Conflict(format!(
            "volume {} is mapped ({}): take it offline (ctl device offline) or unmap it first; \
             its initiators would see its blocks change under them",
            device.name,
            mapped.join("; ")
        )));
    }
    let path = pool.volume_path(&device.name);
    let restore = || -> std::io::Result<store::clone::CloneMethod> {
        let to = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        let size = to.metadata()?.len();
        let method = store::clone::clone_into(&std::fs::File::open(&from)?, &to)?;
        // A volume grown since keeps its size: the blocks past the snapshot read as zeros.
        if to.metadata()?.len() < size {
            to.set_len(size)?;
        }
        to.sync_all()?;
        Ok(method)
    };
    let method = with_writes_held(shared, &device.name, restore)?
        .map_err(io_error(format!("rollback of {} to {snap}", device.name)))?;
    tracing::info!(volume = %device.name, snapshot = %snap, "ctl: volume rolled back");
    Ok(json!({ "volume": device.name, "snapshot": snap, "method": method.name() }))
}

fn delete(
    shared: &Shared,
    mut running: Config,
    args: &Map<String, Value>,
) -> Result<Value, ControlError> {
    let name = object_name(args, "volume")?;
    if running.device(&name).is_none() {
        return Ok(json!({ "volume": name, "existed": false }));
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
    let snaps =
        snapshots_of(&pool, Some(&name)).map_err(io_error(format!("pool {}", pool.name)))?;
    if !snaps.is_empty() {
        let names: Vec<&str> = snaps.iter().map(|(_, s, _)| s.as_str()).collect();
        return Err(ControlError::Conflict(format!(
            "volume {name} has snapshots ({}): delete them first",
            names.join(", ")
        )));
    }
    running.devices.retain(|d| d.name != name);
    let what = format!("volume {name} deleted from pool {}", pool.name);
    let mut answer = super::apply_edited(shared, "volume-delete", args, what, running)?;
    // The store closes with its last command; the space is freed when it does.
    std::fs::remove_file(pool.volume_path(&name)).map_err(io_error(format!("volume {name}")))?;
    answer["existed"] = json!(true);
    Ok(answer)
}

/// The snapshots in a pool (of one volume): (volume, snapshot, path).
fn snapshots_of(
    pool: &PoolConfig,
    volume: Option<&str>,
) -> std::io::Result<Vec<(String, String, PathBuf)>> {
    let dir = pool.path.join(".snapshots");
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

fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

fn snapshots_json(config: &Config, args: &Map<String, Value>) -> Result<Vec<Value>, ControlError> {
    let only = args.get("volume").and_then(Value::as_str);
    let mut out = Vec::new();
    for pool in &config.pools {
        let found = snapshots_of(pool, only).map_err(io_error(format!("pool {}", pool.name)))?;
        for (volume, snapshot, path) in found {
            out.push(json!({
                "pool": pool.name, "volume": volume, "snapshot": snapshot,
                "size_bytes": file_bytes(&path), "path": path,
            }));
        }
    }
    Ok(out)
}

fn list(config: &Config) -> Value {
    let volumes: Vec<Value> = config
        .devices
        .iter()
        .filter_map(|d| Some((config.pool_of(d)?, d)))
        .map(|(pool, d)| {
            let snapshots: Vec<String> = snapshots_of(pool, Some(&d.name))
                .unwrap_or_default()
                .into_iter()
                .map(|(_, s, _)| s)
                .collect();
            json!({
                "pool": pool.name, "volume": d.name,
                "size_bytes": file_bytes(&pool.volume_path(&d.name)),
                "mapped": mappings(config, &d.name), "snapshots": snapshots,
                "serial": d.serial,
            })
        })
        .collect();
    let pools: Vec<Value> = config
        .pools
        .iter()
        .map(|p| json!({ "pool": p.name, "path": p.path }))
        .collect();
    json!({ "pools": pools, "volumes": volumes })
}

fn snapshot_delete(running: &Config, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let volume_name = object_name(args, "volume")?;
    let snap = object_name(args, "snapshot")?;
    let pool = match running.device(&volume_name) {
        Some(d) => running.pool_of(d),
        // A volume deleted already: its pool is whichever holds the snapshot.
        None => running
            .pools
            .iter()
            .find(|p| p.snapshot_path(&volume_name, &snap).exists()),
    };
    let Some(pool) = pool else {
        return Ok(json!({ "volume": volume_name, "snapshot": snap, "existed": false }));
    };
    let path = pool.snapshot_path(&volume_name, &snap);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(json!({ "volume": volume_name, "snapshot": snap, "existed": true })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(json!({ "volume": volume_name, "snapshot": snap, "existed": false }))
        }
        Err(e) => Err(io_error(format!("snapshot {volume_name}@{snap}"))(e)),
    }
}
