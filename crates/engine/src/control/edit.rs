//! The changing verbs of the control plane as pure edits of a config: each takes the running
//! config and the request's arguments and says what it changed, or why not (nothing changed
//! then). The result is validated whole and applied by the caller (`control::change`), as a
//! reloaded file would be.

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::error::ControlError;
use crate::config::{
    AuthMode, ChapUser, Config, InitiatorCredentials, InitiatorGroup, IscsiName, LunMapping,
    TargetConfig,
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

fn target_name(args: &Map<String, Value>) -> Result<IscsiName, ControlError> {
    IscsiName::from_wire(text(args, "target")?).map_err(ControlError::bad_request)
}

fn target_mut<'c>(
    config: &'c mut Config,
    iqn: &IscsiName,
) -> Result<&'c mut TargetConfig, ControlError> {
    config
        .targets
        .iter_mut()
        .find(|t| t.iqn == *iqn)
        .ok_or_else(|| ControlError::NotFound(format!("no target {iqn}")))
}

fn group_mut<'t>(
    target: &'t mut TargetConfig,
    iqn: &IscsiName,
    group_name: &str,
) -> Result<&'t mut InitiatorGroup, ControlError> {
    target
        .groups
        .iter_mut()
        .find(|g| g.name == group_name)
        .ok_or_else(|| ControlError::NotFound(format!("target {iqn} has no group {group_name}")))
}

fn device_add(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    if config.device(name).is_some() {
        return Err(ControlError::Conflict(format!(
            "device {name} exists already"
        )));
    }
    let device = Config::device_from_spec(name, text(args, "spec")?)?;
    config.devices.push(device);
    Ok(format!("device {name} added"))
}

fn device_remove(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "name")?;
    let index = config
        .devices
        .iter()
        .position(|d| d.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
    let mapped: Vec<String> = config
        .targets
        .iter()
        .flat_map(|t| t.groups.iter().map(move |g| (t, g)))
        .flat_map(|(t, g)| {
            g.luns
                .iter()
                .filter(|m| m.device == name)
                .map(move |m| format!("{} group {} LUN {}", t.iqn, g.name, m.lun))
        })
        .collect();
    if !mapped.is_empty() {
        return Err(ControlError::Conflict(format!(
            "device {name} is mapped ({}): unmap it first",
            mapped.join("; ")
        )));
    }
    config.devices.remove(index);
    Ok(format!("device {name} removed"))
}

fn resize(config: &mut Config, args: &Map<String, Value>) -> Result<String, ControlError> {
    let name = text(args, "device")?;
    let size = crate::config::parse_size(text(args, "size")?)?;
    let device = config
        .devices
        .iter_mut()
        .find(|d| d.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
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
    let name = IscsiName::from_wire(text(args, "initiator")?).map_err(ControlError::bad_request)?;
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
    let name = IscsiName::from_wire(text(args, "initiator")?).map_err(ControlError::bad_request)?;
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
    let device = config
        .devices
        .iter_mut()
        .find(|d| d.name == name)
        .ok_or_else(|| ControlError::NotFound(format!("no device {name}")))?;
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
    let state = crate::config::configured_alua_state(name).map_err(ControlError::BadRequest)?;
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
    iqn: &IscsiName,
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
            let name = IscsiName::from_wire(name).map_err(ControlError::bad_request)?;
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
    iqn: &IscsiName,
    name: IscsiName,
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
