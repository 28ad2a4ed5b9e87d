//! The changing verbs of the control plane as pure edits of a config: each takes the running
//! config and the request's arguments and says what it changed, or why not (nothing changed
//! then). The result is validated whole and applied by the caller (`control::change`), as a
//! reloaded file would be.

use std::collections::HashMap;
use std::path::PathBuf;

use serde_json::{Map, Value};

use super::error::ControlError;
use crate::config::{
    AuthMode, ChapUser, Config, DeviceConfig, InitiatorCredentials, InitiatorGroup, LunMapping,
    NodeName, TargetConfig,
};

/// The verbs that change the config (each also takes `"save": true`).
pub const EDIT_VERBS: &[&str] = &[
    "device-add",
    "device-remove",
    "resize",
    "lun-map",
    "lun-unmap",
    "initiator-add",
    "initiator-remove",
    "chap-set",
    "device-offline",
    "device-online",
    "portal-group-alua",
    "device-set",
    "target-add",
    "target-remove",
    "group-add",
    "group-remove",
    "auth-set",
    "portal-group-add",
    "portal-group-remove",
    "portal-group-listen",
    "portal-group-unlisten",
];

/// Applies one changing verb to `config` (pure: no effects) and says what it did.
pub fn edit(
    config: &mut Config,
    verb: &str,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    match verb {
        "device-add" => device_add(config, args),
        "device-remove" => device_remove(config, args),
        "resize" => resize(config, args),
        "lun-map" | "lun-unmap" | "initiator-add" | "initiator-remove" => {
            let (iqn, group_name) = (target_name(args)?, text(args, "group")?);
            let devices: Vec<String> = config.devices.iter().map(|d| d.name.clone()).collect();
            let group = group_mut(target_mut(config, &iqn)?, &iqn, group_name)?;
            let what = match verb {
                "lun-map" => lun_map(group, &devices, args)?,
                "lun-unmap" => lun_unmap(group, args)?,
                "initiator-add" => initiator_add(group, args)?,
                _ => initiator_remove(group, args)?,
            };
            Ok(format!("{iqn} group {group_name}: {what}"))
        }
        "device-offline" => set_offline(config, args, true),
        "device-online" => set_offline(config, args, false),
        "chap-set" => chap_set(config, args),
        "portal-group-alua" => portal_group_alua(config, args),
        "device-set" => device_set(config, args),
        "target-add" => target_add(config, args),
        "target-remove" => target_remove(config, args),
        "group-add" => {
            let iqn = target_name(args)?;
            group_add(target_mut(config, &iqn)?, &iqn, args)
        }
        "group-remove" => group_remove(config, args),
        "auth-set" => auth_set(config, args),
        "portal-group-add" => portal_group_add(config, args),
        "portal-group-remove" => portal_group_remove(config, args),
        "portal-group-listen" => portal_group_listen(config, args, true),
        "portal-group-unlisten" => portal_group_listen(config, args, false),
        other => Err(ControlError::BadRequest(format!("unknown verb {other}"))),
    }
}

pub(super) fn text<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, ControlError> {
    args.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ControlError::BadRequest(format!("\"{key}\" is required")))
}

fn number(args: &Map<String, Value>, key: &str) -> Result<u64, ControlError> {
    args.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| ControlError::BadRequest(format!("\"{key}\": a number is required")))
}

fn target_name(args: &Map<String, Value>) -> Result<NodeName, ControlError> {
    NodeName::from_wire(text(args, "target")?).map_err(ControlError::bad_request)
}

fn target_mut<'c>(
    config: &'c mut Config,
    iqn: &NodeName,
) -> Result<&'c mut TargetConfig, ControlError> {
    config
        .targets
        .iter_mut()
        .find(|t| t.iqn == *iqn)
        .map(std::sync::Arc::make_mut)
        .ok_or_else(|| ControlError::NotFound(format!("no target {iqn}")))
}

fn group_mut<'t>(
    target: &'t mut TargetConfig,
    iqn: &NodeName,
    group_name: &str,
) -> Result<&'t mut InitiatorGroup, ControlError> {
    target
        .groups
        .iter_mut()
        .find(|g| g.name == group_name)
        .ok_or_else(|| ControlError::NotFound(format!("target {iqn} has no group {group_name}")))
}

fn device_mut<'c>(
    config: &'c mut Config,
    name: &str,
) -> Result<&'c mut DeviceConfig, ControlError> {
    config
        .devices
        .iter_mut()
        .find(|d| d.name == name)
        .map(std::sync::Arc::make_mut)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))
}

fn device_add(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    if config.device(name).is_some() {
        return Err(ControlError::Conflict(format!(
            "device {name} exists already"
        )));
    }
    let device = Config::device_from_spec(name, text(args, "spec")?)?;
    config.devices.push(device.into());
    Ok(format!("device {name} added"))
}

fn device_remove(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    let index = config
        .devices
        .iter()
        .position(|d| d.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
    let mapped = mappings_of(config, name);
    if !mapped.is_empty() {
        return Err(ControlError::Conflict(format!(
            "device {name} is mapped ({}): unmap it first",
            mapped.join("; ")
        )));
    }
    config.devices.remove(index);
    Ok(format!("device {name} removed"))
}

/// Where device `name` is mapped, as "TARGET group G LUN n".
pub(super) fn mappings_of(config: &Config, name: &str) -> Vec<String> {
    maps_of(config, name).map(map_line).collect()
}

/// A LUN map as "TARGET group G LUN n".
pub(super) fn map_line((t, g, m): MapOf<'_>) -> String {
    format!("{} group {} LUN {}", t.iqn, g.name, m.lun)
}

/// A LUN map: its target, its group and the map.
pub(super) type MapOf<'c> = (&'c TargetConfig, &'c InitiatorGroup, &'c LunMapping);

/// Every LUN map of the config, in its order.
fn all_maps(config: &Config) -> impl Iterator<Item = MapOf<'_>> {
    config
        .targets
        .iter()
        .flat_map(|t| t.groups.iter().map(move |g| (&**t, g)))
        .flat_map(|(t, g)| g.luns.iter().map(move |m| (t, g, m)))
}

/// Every LUN map of device `name`.
pub(super) fn maps_of<'c>(config: &'c Config, name: &'c str) -> impl Iterator<Item = MapOf<'c>> {
    all_maps(config).filter(move |(_, _, m)| m.device == name)
}

/// Every LUN map of the config by device, in one pass: for a listing that shows each device's
/// maps (a search per device made those listings quadratic: `ctl device list` took 1.4 s and
/// `ctl volume list` 2.1 s at 16,000 mapped volumes).
pub(super) fn maps_by_device(config: &Config) -> HashMap<&str, Vec<MapOf<'_>>> {
    let mut by: HashMap<&str, Vec<MapOf<'_>>> = HashMap::new();
    for map in all_maps(config) {
        by.entry(map.2.device.as_str()).or_default().push(map);
    }
    by
}

fn resize(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "device")?;
    let size = crate::config::parse_size(text(args, "size")?)?;
    let device = device_mut(config, name)?;
    device
        .store
        .set_size(size)
        .map_err(|why| ControlError::Conflict(format!("device {name} {why}")))?;
    Ok(format!("device {name} resized to {size} bytes"))
}

fn lun_map(
    group: &mut InitiatorGroup,
    devices: &[String],
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let group_name = &group.name;
    let lun = number(args, "lun")?;
    let device = text(args, "device")?;
    if !devices.iter().any(|d| d == device) {
        return Err(ControlError::NotFound(format!("no device {device}")));
    }
    if group.luns.iter().any(|m| m.lun == lun) {
        return Err(ControlError::Conflict(format!(
            "group {group_name} has a LUN {lun} already"
        )));
    }
    let read_only = args
        .get("read_only")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    group.luns.push(LunMapping {
        lun,
        device: device.to_string(),
        read_only,
    });
    group.luns.sort_by_key(|m| m.lun);
    Ok(format!("LUN {lun} maps device {device}"))
}

fn lun_unmap(
    group: &mut InitiatorGroup,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let group_name = &group.name;
    let lun = number(args, "lun")?;
    let before = group.luns.len();
    group.luns.retain(|m| m.lun != lun);
    if group.luns.len() == before {
        return Err(ControlError::NotFound(format!(
            "group {group_name} has no LUN {lun}"
        )));
    }
    Ok(format!("LUN {lun} unmapped"))
}

fn initiator_add(
    group: &mut InitiatorGroup,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let group_name = &group.name;
    let name = NodeName::from_wire(text(args, "initiator")?).map_err(ControlError::bad_request)?;
    if group.initiators.contains(&name) {
        return Err(ControlError::Conflict(format!(
            "{name} is in group {group_name} already"
        )));
    }
    group.initiators.push(name.clone());
    Ok(format!("initiator {name} added"))
}

fn initiator_remove(
    group: &mut InitiatorGroup,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let group_name = &group.name;
    let name = NodeName::from_wire(text(args, "initiator")?).map_err(ControlError::bad_request)?;
    let before = group.initiators.len();
    group.initiators.retain(|i| *i != name);
    if group.initiators.len() == before {
        return Err(ControlError::NotFound(format!(
            "{name} is not in group {group_name}"
        )));
    }
    Ok(format!("initiator {name} removed"))
}

fn set_offline(
    config: &mut Config,
    args: &Map<String, Value>,
    offline: bool,
) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    let device = device_mut(config, name)?;
    if device.offline == offline {
        return Err(ControlError::Conflict(format!(
            "device {name} is {} already",
            if offline { "offline" } else { "online" }
        )));
    }
    device.offline = offline;
    Ok(if offline {
        format!("device {name} taken offline")
    } else {
        format!("device {name} back online")
    })
}

/// Gives a portal group another ALUA state (implicit ALUA: not a gateway's group, whose state
/// follows the RBD image's owner).
fn portal_group_alua(
    config: &mut Config,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let tag = number(args, "tag")?;
    let name = text(args, "state")?;
    let state = crate::config::configured_alua_state(name)
        .map_err(|e| ControlError::BadRequest(e.to_string()))?;
    let group = config
        .portal_groups
        .iter_mut()
        .find(|p| u64::from(p.tag) == tag)
        .ok_or_else(|| ControlError::NotFound(format!("no portal group {tag}")))?;
    if let Some(gateway) = &group.gateway {
        return Err(ControlError::Conflict(format!(
            "portal group {tag} is gateway {gateway}'s: its state follows the owner of each RBD image (ctl device take)"
        )));
    }
    if group.alua_state == state {
        return Err(ControlError::Conflict(format!(
            "portal group {tag} is {name} already"
        )));
    }
    group.alua_state = state;
    Ok(format!("portal group {tag} is now {name}"))
}

fn chap_set(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let iqn = target_name(args)?;
    let user = text(args, "user")?;
    let (secret, secret_file) = chap_secret(args)?;
    let mutual = args.get("mutual").and_then(Value::as_bool).unwrap_or(false);
    let target = target_mut(config, &iqn)?;
    let credential = ChapUser {
        user: user.to_string(),
        secret: crate::config::Secret::new(secret.into_bytes()),
        secret_file,
    };
    let (auth_users, auth_mutual, scope) = chap_scope(target, args, &iqn, mutual)?;
    if mutual {
        *auth_mutual = Some(credential);
    } else {
        *auth_users = vec![credential];
    }
    // The secret itself never reaches the log or the reply.
    Ok(format!(
        "{iqn}: {} {user} set for {scope} (from the next login)",
        if mutual {
            "mutual CHAP name (the target's)"
        } else {
            "CHAP user"
        }
    ))
}

/// The secret of a `chap-set`: given inline, or a file's path. A secret file is read (and its
/// mode checked) when the edited config is validated; the config then names the file, never
/// the secret.
fn chap_secret(args: &Map<String, Value>) -> Result<(String, Option<PathBuf>), ControlError> {
    match (args.get("secret"), args.get("secret_file")) {
        (Some(_), Some(_)) => Err(ControlError::BadRequest(
            "give a secret or a secret_file, not both".into(),
        )),
        (_, Some(_)) => Ok((
            String::new(),
            Some(PathBuf::from(text(args, "secret_file")?)),
        )),
        _ => Ok((text(args, "secret")?.to_string(), None)),
    }
}

/// The users and the mutual credential a `chap-set` changes, and how the reply names them.
type ChapScope<'t> = (&'t mut Vec<ChapUser>, &'t mut Option<ChapUser>, String);

/// Where a `chap-set` goes: a group's, an initiator's or the target's credentials. Setting a
/// (non-mutual) user on a group or the target makes it require CHAP.
fn chap_scope<'t>(
    target: &'t mut TargetConfig,
    args: &Map<String, Value>,
    iqn: &NodeName,
    mutual: bool,
) -> Result<ChapScope<'t>, ControlError> {
    let group = args.get("group").and_then(Value::as_str);
    let initiator = args.get("initiator").and_then(Value::as_str);
    match (group, initiator) {
        (Some(_), Some(_)) => Err(ControlError::BadRequest(
            "give a group or an initiator, not both".into(),
        )),
        (Some(group_name), None) => {
            let group = group_mut(target, iqn, group_name)?;
            if !mutual {
                group.auth.mode = Some(AuthMode::Chap);
            }
            let auth = &mut group.auth;
            Ok((
                &mut auth.users,
                &mut auth.mutual,
                format!("group {group_name}"),
            ))
        }
        (None, Some(name)) => {
            let name = NodeName::from_wire(name).map_err(ControlError::bad_request)?;
            let entry = initiator_credentials(target, iqn, name.clone(), mutual)?;
            Ok((
                &mut entry.users,
                &mut entry.mutual,
                format!("initiator {name}"),
            ))
        }
        (None, None) => {
            if !mutual {
                target.auth.mode = Some(AuthMode::Chap);
            }
            let auth = &mut target.auth;
            Ok((&mut auth.users, &mut auth.mutual, "the target".to_string()))
        }
    }
}

/// An initiator's own credentials in `target`, made empty if it has none, unless the mutual
/// credential is being set (that needs the initiator's own user first).
fn initiator_credentials<'t>(
    target: &'t mut TargetConfig,
    iqn: &NodeName,
    name: NodeName,
    mutual: bool,
) -> Result<&'t mut InitiatorCredentials, ControlError> {
    let at = match target.credentials.iter().position(|c| c.initiator == name) {
        Some(at) => at,
        None if mutual => {
            return Err(ControlError::Conflict(format!(
                "initiator {name} has no CHAP user of its own in {iqn}: set one before its \
                 mutual credentials"
            )))
        }
        None => {
            target.credentials.push(InitiatorCredentials {
                initiator: name,
                users: Vec::new(),
                mutual: None,
            });
            target.credentials.len() - 1
        }
    };
    Ok(&mut target.credentials[at])
}

fn flag(args: &Map<String, Value>, key: &str) -> Result<Option<bool>, ControlError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ControlError::BadRequest(format!(
            "\"{key}\": true or false"
        ))),
    }
}

/// An INQUIRY text to set: `Some(None)` puts ferrosan's default back (an empty string).
fn inquiry_text(
    args: &Map<String, Value>,
    key: &str,
) -> Result<Option<Option<String>>, ControlError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(Some(None)),
        Some(Value::String(s)) => Ok(Some(Some(s.clone()))),
        Some(_) => Err(ControlError::BadRequest(format!("\"{key}\": a string"))),
    }
}

/// Changes the attributes of a running device: `read_only`, `write_cache`, `vendor`,
/// `product`, `serial` (each optional; at least one). Applied to its LU live
/// (`reload::Attribute`).
fn device_set(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    let device = device_mut(config, name)?;
    let before = device.clone();
    let mut said = Vec::new();
    if let Some(on) = flag(args, "read_only")? {
        device.read_only = on;
        said.push(format!("read_only {on}"));
    }
    if let Some(on) = flag(args, "write_cache")? {
        device.write_cache = on;
        said.push(format!("write_cache {on}"));
    }
    if let Some(vendor) = inquiry_text(args, "vendor")? {
        said.push(format!(
            "vendor {}",
            vendor.as_deref().unwrap_or("(default)")
        ));
        device.vendor = vendor;
    }
    if let Some(product) = inquiry_text(args, "product")? {
        said.push(format!(
            "product {}",
            product.as_deref().unwrap_or("(default)")
        ));
        device.product = product;
    }
    if let Some(serial) = args.get("serial").filter(|v| !v.is_null()) {
        let serial = serial
            .as_str()
            .ok_or_else(|| ControlError::BadRequest("\"serial\": a string".into()))?;
        device.serial = serial.to_string();
        said.push(format!("serial {serial}"));
    }
    if said.is_empty() {
        return Err(ControlError::BadRequest(
            "nothing to set: give read_only, write_cache, vendor, product or serial".into(),
        ));
    }
    if *device == before {
        return Err(ControlError::Conflict(format!(
            "device {name} has {} already",
            said.join(", ")
        )));
    }
    Ok(format!("device {name}: {}", said.join(", ")))
}

/// The initiators a new group admits: `initiators` (a list of names), or any initiator not in
/// another group of the target (`any_initiator`).
fn new_group(args: &Map<String, Value>) -> Result<InitiatorGroup, ControlError> {
    let name = text(args, "group")?.to_string();
    let any_initiator = flag(args, "any_initiator")?.unwrap_or(false);
    let initiators = match args.get("initiators") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| {
                let name = v.as_str().ok_or_else(|| {
                    ControlError::BadRequest("\"initiators\": a list of names".into())
                })?;
                NodeName::from_wire(name).map_err(ControlError::bad_request)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ControlError::BadRequest(
                "\"initiators\": a list of names".into(),
            ))
        }
    };
    Ok(InitiatorGroup {
        name,
        initiators,
        any_initiator,
        luns: Vec::new(),
        auth: crate::config::AuthConfig::default(),
        allowed_sources: Vec::new(),
    })
}

/// Adds a target with one initiator group (and no LUNs yet), served on the portal groups
/// `portal_groups` names (default: every one).
fn target_add(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let iqn = target_name(args)?;
    if config.target(&iqn).is_some() {
        return Err(ControlError::Conflict(format!(
            "target {iqn} exists already"
        )));
    }
    let nqn = match args.get("nqn").and_then(Value::as_str) {
        Some(n) => Some(NodeName::from_wire(n).map_err(ControlError::bad_request)?),
        None => None,
    };
    let portal_groups = match args.get("portal_groups") {
        None | Some(Value::Null) => config.portal_groups.iter().map(|p| p.tag).collect(),
        Some(Value::Array(tags)) => tags
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u16::try_from(t).ok())
                    .ok_or_else(|| {
                        ControlError::BadRequest("\"portal_groups\": a list of tags".into())
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ControlError::BadRequest(
                "\"portal_groups\": a list of tags".into(),
            ))
        }
    };
    let group = new_group(args)?;
    let group_name = group.name.clone();
    config.targets.push(std::sync::Arc::new(TargetConfig {
        iqn: iqn.clone(),
        nqn,
        alias: args
            .get("alias")
            .and_then(Value::as_str)
            .map(str::to_string),
        portal_groups,
        groups: vec![group],
        auth: crate::config::AuthConfig::default(),
        allowed_sources: Vec::new(),
        credentials: Vec::new(),
        tls_keys: Vec::new(),
    }));
    Ok(format!("target {iqn} added with group {group_name}"))
}

/// Removes a target: its sessions end, its devices stay (unmapped from it).
fn target_remove(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let iqn = target_name(args)?;
    let before = config.targets.len();
    config.targets.retain(|t| t.iqn != iqn);
    if config.targets.len() == before {
        return Err(ControlError::NotFound(format!("no target {iqn}")));
    }
    Ok(format!("target {iqn} removed (its sessions end)"))
}

fn group_add(
    target: &mut TargetConfig,
    iqn: &NodeName,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let group = new_group(args)?;
    if target.groups.iter().any(|g| g.name == group.name) {
        return Err(ControlError::Conflict(format!(
            "target {iqn} has a group {} already",
            group.name
        )));
    }
    let what = format!("{iqn}: group {} added", group.name);
    target.groups.push(group);
    Ok(what)
}

/// Removes an initiator group: its sessions end, its LUN maps go with it.
fn group_remove(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let iqn = target_name(args)?;
    let name = text(args, "group")?;
    let target = target_mut(config, &iqn)?;
    let at = target
        .groups
        .iter()
        .position(|g| g.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("target {iqn} has no group {name}")))?;
    if target.groups.len() == 1 {
        return Err(ControlError::Conflict(format!(
            "group {name} is target {iqn}'s only group: remove the target instead"
        )));
    }
    target.groups.remove(at);
    Ok(format!("{iqn}: group {name} removed (its sessions end)"))
}

/// Turns authentication of a target or one of its groups to `mode`: "none" (its CHAP users
/// and mutual credentials go), "chap" (with the users it has or inherits) or, for a group,
/// "inherit" (the target's rule). Sessions logged in before keep running; logins from now
/// follow the new rule.
fn auth_set(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let iqn = target_name(args)?;
    let mode = text(args, "mode")?;
    let target = target_mut(config, &iqn)?;
    let (auth, scope) = match args.get("group").and_then(Value::as_str) {
        Some(group_name) => (
            &mut group_mut(target, &iqn, group_name)?.auth,
            format!("group {group_name}"),
        ),
        None => (&mut target.auth, "the target".to_string()),
    };
    let before = auth.clone();
    match mode {
        "none" => {
            *auth = crate::config::AuthConfig {
                mode: Some(AuthMode::None),
                ..Default::default()
            }
        }
        "chap" => auth.mode = Some(AuthMode::Chap),
        "inherit" if scope != "the target" => *auth = crate::config::AuthConfig::default(),
        other => {
            return Err(ControlError::BadRequest(format!(
                "\"mode\": none, chap or (for a group) inherit, not {other:?}"
            )))
        }
    }
    if *auth == before {
        return Err(ControlError::Conflict(format!(
            "{iqn}: {scope} has authentication {mode} already"
        )));
    }
    Ok(format!(
        "{iqn}: authentication of {scope} is now {mode} (from the next login)"
    ))
}

fn tag(args: &Map<String, Value>) -> Result<u16, ControlError> {
    u16::try_from(number(args, "tag")?)
        .ok()
        .filter(|t| *t > 0)
        .ok_or_else(|| ControlError::BadRequest("\"tag\": 1..65535".into()))
}

fn address(args: &Map<String, Value>) -> Result<std::net::SocketAddr, ControlError> {
    let text = text(args, "address")?;
    text.parse()
        .map_err(|e| ControlError::BadRequest(format!("\"address\": {text:?} is no IP:PORT ({e})")))
}

/// Which of a portal group's lists an address goes to: iSCSI (`listen`) or NVMe/TCP
/// (`nvme_listen`, with `"nvme": true`).
fn listen_list<'p>(
    group: &'p mut crate::config::PortalGroup,
    args: &Map<String, Value>,
) -> Result<(&'p mut Vec<std::net::SocketAddr>, &'static str), ControlError> {
    Ok(if flag(args, "nvme")?.unwrap_or(false) {
        (&mut group.nvme_listen, "NVMe/TCP")
    } else {
        (&mut group.listen, "iSCSI")
    })
}

/// Adds a portal group listening on `address` (iSCSI, or NVMe/TCP with `nvme`), in ALUA
/// state `state` (default active-optimized), served by every target, or by `targets`.
fn portal_group_add(
    config: &mut Config,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let tag = tag(args)?;
    if config.portal_groups.iter().any(|p| p.tag == tag) {
        return Err(ControlError::Conflict(format!(
            "portal group {tag} exists already"
        )));
    }
    let alua_state = match args.get("state").and_then(Value::as_str) {
        Some(name) => crate::config::configured_alua_state(name)
            .map_err(|e| ControlError::BadRequest(e.to_string()))?,
        None => scsi::AccessState::ActiveOptimized,
    };
    let mut group = crate::config::PortalGroup {
        tag,
        listen: Vec::new(),
        nvme_listen: Vec::new(),
        nvme_discovery_listen: None,
        alua_state,
        gateway: None,
        peer_address: None,
    };
    let (list, kind) = listen_list(&mut group, args)?;
    let at = address(args)?;
    list.push(at);
    let only: Option<Vec<NodeName>> = match args.get("targets") {
        None | Some(Value::Null) => None,
        Some(Value::Array(names)) => Some(
            names
                .iter()
                .map(|n| {
                    NodeName::from_wire(n.as_str().unwrap_or_default())
                        .map_err(ControlError::bad_request)
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(_) => {
            return Err(ControlError::BadRequest(
                "\"targets\": a list of IQNs".into(),
            ))
        }
    };
    if let Some(names) = &only {
        if let Some(missing) = names.iter().find(|n| config.target(n).is_none()) {
            return Err(ControlError::NotFound(format!("no target {missing}")));
        }
    }
    config.portal_groups.push(group);
    for t in &mut config.targets {
        if only.as_ref().is_none_or(|names| names.contains(&t.iqn)) {
            std::sync::Arc::make_mut(t).portal_groups.push(tag);
        }
    }
    Ok(format!(
        "portal group {tag} added, listening on {at} ({kind})"
    ))
}

/// Removes a portal group: its listeners close, its sessions are asked to log out, the
/// targets stop naming it (a target it was the only group of is refused: remove that first).
fn portal_group_remove(
    config: &mut Config,
    args: &Map<String, Value>,
) -> Result<String, ControlError> {
    let tag = tag(args)?;
    let at = config
        .portal_groups
        .iter()
        .position(|p| p.tag == tag)
        .ok_or_else(|| ControlError::NotFound(format!("no portal group {tag}")))?;
    if let Some(t) = config.targets.iter().find(|t| t.portal_groups == [tag]) {
        return Err(ControlError::Conflict(format!(
            "portal group {tag} is the only one of target {}: give it another first",
            t.iqn
        )));
    }
    config.portal_groups.remove(at);
    for t in config
        .targets
        .iter_mut()
        .filter(|t| t.portal_groups.contains(&tag))
    {
        std::sync::Arc::make_mut(t)
            .portal_groups
            .retain(|x| *x != tag);
    }
    Ok(format!(
        "portal group {tag} removed (its sessions are asked to log out)"
    ))
}

/// Adds an address to a portal group's listeners, or (`add` false) takes one away: the
/// listener is bound, or closed and its sessions asked to log out.
fn portal_group_listen(
    config: &mut Config,
    args: &Map<String, Value>,
    add: bool,
) -> Result<String, ControlError> {
    let tag = tag(args)?;
    let at = address(args)?;
    let group = config
        .portal_groups
        .iter_mut()
        .find(|p| p.tag == tag)
        .ok_or_else(|| ControlError::NotFound(format!("no portal group {tag}")))?;
    let (list, kind) = listen_list(group, args)?;
    match (add, list.contains(&at)) {
        (true, true) => Err(ControlError::Conflict(format!(
            "portal group {tag} listens on {at} ({kind}) already"
        ))),
        (false, false) => Err(ControlError::NotFound(format!(
            "portal group {tag} does not listen on {at} ({kind})"
        ))),
        (true, false) => {
            list.push(at);
            Ok(format!("portal group {tag} listens on {at} ({kind})"))
        }
        (false, true) => {
            list.retain(|a| *a != at);
            Ok(format!(
                "portal group {tag} no longer listens on {at} ({kind}); its sessions there are asked to log out"
            ))
        }
    }
}
