//! `volume-export` and `volume-unexport`: what an orchestrator (a CSI controller's
//! ControllerPublish, a Proxmox storage plugin) asks of an array in one step: show this
//! volume to that host at a free LUN, and take it away again. Both edit the running config
//! as one transaction each (`transact`), and both are idempotent.
//!
//! A host (an initiator IQN or host NQN) is in at most one group of a target: the volume is
//! mapped in that group, or, when no group holds the host, in a new group of its own
//! (`host-…`). Unexporting the last LUN of such a group removes the group too, so a host that
//! comes and goes leaves nothing behind.

use serde_json::{json, Map, Value};

use super::edit::text;
use super::error::ControlError;
use super::Step;
use crate::config::{AuthConfig, Config, InitiatorGroup, LunMapping, NodeName, TargetConfig};
use crate::shared::Shared;

/// The LUNs a group may hold, per SAM's flat space addressing (`lun-map` allows them all).
const LUN_MAX: u64 = 16_383;

/// The name of the group `export` makes for `host` alone: `host-` and the host's name with
/// every character a group name may not hold (`:`, and anything a name from the wire may carry
/// beyond ASCII) as `.`, cut to the 64 characters a name may have from the front (the end
/// tells hosts apart).
pub fn own_group_name(host: &NodeName) -> String {
    let chars: Vec<char> = host
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '.'
            }
        })
        .collect();
    let keep = 64 - "host-".len();
    let tail: String = chars[chars.len().saturating_sub(keep)..].iter().collect();
    format!("host-{tail}")
}

/// The target named by `"target"`, or the only one there is.
fn target_index(config: &Config, args: &Map<String, Value>) -> Result<usize, ControlError> {
    match args.get("target").and_then(Value::as_str) {
        Some(name) => {
            let iqn = NodeName::from_wire(name).map_err(ControlError::bad_request)?;
            config
                .targets
                .iter()
                .position(|t| t.iqn == iqn)
                .ok_or_else(|| ControlError::NotFound(format!("no target {iqn}")))
        }
        None if config.targets.len() == 1 => Ok(0),
        None => Err(ControlError::BadRequest(format!(
            "{} targets: name one (\"target\")",
            config.targets.len()
        ))),
    }
}

/// What both verbs are asked: which volume, for which host, on which target.
struct Asked {
    device: String,
    host: NodeName,
    /// The target's index in the config, and its name.
    target: usize,
    iqn: String,
}

impl Asked {
    fn of(config: &Config, args: &Map<String, Value>) -> Result<Asked, ControlError> {
        let device = text(args, "volume")?;
        if config.device(device).is_none() {
            return Err(ControlError::NotFound(format!(
                "no volume or device {device}"
            )));
        }
        // As the config would take it: a name refused here is named as the user wrote it,
        // before any group is made for it.
        let raw = text(args, "initiator")?;
        let host = NodeName::from_config(raw)
            .map_err(|e| ControlError::BadRequest(format!("initiator {raw:?}: {e}")))?;
        let target = target_index(config, args)?;
        Ok(Asked {
            device: device.to_string(),
            host,
            target,
            iqn: config.targets[target].iqn.as_str().to_string(),
        })
    }
}

/// The lowest LUN `group` does not use.
fn free_lun(group: &InitiatorGroup) -> Result<u64, ControlError> {
    (0..=LUN_MAX)
        .find(|lun| !group.luns.iter().any(|m| m.lun == *lun))
        .ok_or_else(|| ControlError::Conflict(format!("group {} has no free LUN", group.name)))
}

/// The group of `target` that holds `host`, made (a group of its own) when none does.
fn group_for<'t>(target: &'t mut TargetConfig, host: &NodeName) -> &'t mut InitiatorGroup {
    if let Some(at) = target
        .groups
        .iter()
        .position(|g| g.initiators.contains(host))
    {
        return &mut target.groups[at];
    }
    let name = own_group_name(host);
    target.groups.push(InitiatorGroup {
        name,
        initiators: vec![host.clone()],
        any_initiator: false,
        luns: Vec::new(),
        // The target's rule (CHAP or none), as for every group that names none.
        auth: AuthConfig::default(),
        allowed_sources: Vec::new(),
    });
    let last = target.groups.len() - 1;
    &mut target.groups[last]
}

/// What a host is told of an exported volume: where it is (the target's iSCSI name and, when
/// it has one, its NVMe subsystem NQN: the namespace's ID is the LUN + 1) and who it is.
fn exported(shared: &Shared, target: &str, group: &str, mapping: &LunMapping) -> Value {
    let topology = shared.topology();
    let identity = topology
        .devices
        .get(mapping.device.as_str())
        .map(|d| d.unit.identity());
    let nqn = topology
        .config
        .targets
        .iter()
        .find(|t| t.iqn.as_str() == target)
        .and_then(|t| t.nqn.as_ref().map(|n| n.as_str().to_string()));
    json!({
        "volume": mapping.device,
        "target": target,
        "nqn": nqn,
        "group": group,
        "lun": mapping.lun,
        "read_only": mapping.read_only,
        "serial": identity.as_ref().map(|i| i.serial.clone()),
        "naa": identity.as_ref().map(|i| i.naa[..i.naa_len].iter().map(|b| format!("{b:02x}")).collect::<String>()),
    })
}

/// `volume-export`, a transaction on the running config of its moment: two exports at once
/// both land, each at its own LUN.
pub fn export(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let mut new = None;
    let answer = super::transact(shared, "volume-export", args, |running| {
        let mut config = running.clone();
        match map_for_host(shared, &mut config, args)? {
            Mapped::There(answer) => Ok(Step::Answer(answer)),
            Mapped::New {
                what,
                iqn,
                group,
                mapping,
            } => {
                new = Some((iqn, group, mapping));
                Ok(Step::Apply {
                    config: Box::new(config),
                    what,
                })
            }
        }
    })?;
    let Some((iqn, group, mapping)) = new else {
        return Ok(answer);
    };
    let mut out = exported(shared, &iqn, &group, &mapping);
    out["existed"] = json!(false);
    for key in ["generation", "saved", "applied"] {
        out[key] = answer[key].clone();
    }
    Ok(out)
}

/// What mapping a volume for a host found.
enum Mapped {
    /// It is mapped already: the answer.
    There(Value),
    /// Mapped now, in `group` of target `iqn`.
    New {
        what: String,
        iqn: String,
        group: String,
        mapping: LunMapping,
    },
}

/// Maps the asked volume for the asked host in `config` (its group, or one of its own),
/// or answers that it is there already.
fn map_for_host(
    shared: &Shared,
    running: &mut Config,
    args: &Map<String, Value>,
) -> Result<Mapped, ControlError> {
    let Asked {
        device,
        host,
        target,
        iqn,
    } = Asked::of(running, args)?;
    let read_only = args
        .get("read_only")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let wanted_lun = args.get("lun").and_then(Value::as_u64);
    let exclusive = args
        .get("exclusive")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if exclusive {
        seen_by_others(running, &device, &host)?;
    }
    let group = group_for(
        std::sync::Arc::make_mut(&mut running.targets[target]),
        &host,
    );
    if exclusive && (group.any_initiator || group.initiators.iter().any(|i| *i != host)) {
        return Err(ControlError::InUse(format!(
            "{host} is in group {}, which lets in other hosts: not an exclusive export",
            group.name
        )));
    }
    if let Some(m) = group.luns.iter().find(|m| m.device == device) {
        if m.read_only != read_only || wanted_lun.is_some_and(|l| l != m.lun) {
            return Err(ControlError::Conflict(format!(
                "volume {device} is exported to {host} already, as LUN {}{}",
                m.lun,
                if m.read_only { ", read-only" } else { "" }
            )));
        }
        let mut answer = exported(shared, &iqn, &group.name, &m.clone());
        answer["existed"] = json!(true);
        return Ok(Mapped::There(answer));
    }
    let lun = match wanted_lun {
        Some(lun) if group.luns.iter().any(|m| m.lun == lun) => {
            return Err(ControlError::Conflict(format!(
                "group {} has a LUN {lun} already",
                group.name
            )))
        }
        Some(lun) => lun,
        None => free_lun(group)?,
    };
    let mapping = LunMapping {
        lun,
        device: device.clone(),
        read_only,
    };
    group.luns.push(mapping.clone());
    group.luns.sort_by_key(|m| m.lun);
    let group_name = group.name.clone();
    let what = format!("volume {device} exported to {host}: {iqn} group {group_name} LUN {lun}");
    Ok(Mapped::New {
        what,
        iqn,
        group: group_name,
        mapping,
    })
}

/// For an exclusive export (one host's alone, as a CSI single-node volume): refused when a
/// group that maps `device` lets in anyone but `host`, decided on the config of the moment.
fn seen_by_others(config: &Config, device: &str, host: &NodeName) -> Result<(), ControlError> {
    let others = super::edit::maps_of(config, device)
        .find(|(_, g, _)| g.any_initiator || g.initiators.iter().any(|i| i != host));
    match others {
        Some((t, g, m)) => Err(ControlError::InUse(format!(
            "volume {device} is exported to other hosts ({} group {} LUN {}): not exclusively \
             to {host}",
            t.iqn, g.name, m.lun
        ))),
        None => Ok(()),
    }
}

/// `volume-unexport`, a transaction on the running config of its moment.
pub fn unexport(shared: &Shared, args: &Map<String, Value>) -> Result<Value, ControlError> {
    let mut taken = None;
    let mut answer = super::transact(shared, "volume-unexport", args, |running| {
        let mut config = running.clone();
        match unmap_for_host(&mut config, args)? {
            Unmapped::NotThere(answer) => Ok(Step::Answer(answer)),
            Unmapped::Taken { what, extra } => {
                taken = Some(extra);
                Ok(Step::Apply {
                    config: Box::new(config),
                    what,
                })
            }
        }
    })?;
    if let Some(extra) = taken {
        for (key, value) in extra {
            answer[key] = value;
        }
    }
    Ok(answer)
}

/// What taking a volume from a host found.
enum Unmapped {
    NotThere(Value),
    /// Taken away: what, and the answer's fields.
    Taken {
        what: String,
        extra: Vec<(&'static str, Value)>,
    },
}

fn unmap_for_host(
    running: &mut Config,
    args: &Map<String, Value>,
) -> Result<Unmapped, ControlError> {
    let Asked {
        device,
        host,
        target,
        iqn,
    } = Asked::of(running, args)?;
    let target = std::sync::Arc::make_mut(&mut running.targets[target]);
    let Some(at) = target
        .groups
        .iter()
        .position(|g| g.initiators.contains(&host) && g.luns.iter().any(|m| m.device == device))
    else {
        return Ok(Unmapped::NotThere(
            json!({ "volume": device, "target": iqn, "unexported": false }),
        ));
    };
    let group = &mut target.groups[at];
    let lun = group
        .luns
        .iter()
        .find(|m| m.device == device)
        .map(|m| m.lun);
    group.luns.retain(|m| m.device != device);
    let group_name = group.name.clone();
    // A group export made for this host alone goes with its last LUN.
    let own = group.luns.is_empty()
        && group.initiators == [host.clone()]
        && group_name == own_group_name(&host)
        && target.groups.len() > 1;
    if own {
        target.groups.remove(at);
    }
    let what = format!(
        "volume {device} unexported from {host} ({iqn} group {group_name}{})",
        if own { ", removed" } else { "" }
    );
    let extra = vec![
        ("volume", json!(device)),
        ("target", json!(iqn)),
        ("lun", json!(lun)),
        ("group_removed", json!(own)),
        ("unexported", json!(true)),
    ];
    Ok(Unmapped::Taken { what, extra })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hosts_own_group_is_named_after_its_end() {
        let short = NodeName::from_wire("iqn.1993-08.org.debian:01:abcd").unwrap();
        assert_eq!(
            own_group_name(&short),
            "host-iqn.1993-08.org.debian.01.abcd"
        );
        let long = NodeName::from_wire(
            "nqn.2014-08.org.nvmexpress:uuid:5f1c2c7e-0d7a-4c55-9a57-1b2c3d4e5f60",
        )
        .unwrap();
        let name = own_group_name(&long);
        assert_eq!(name.len(), 64);
        assert!(name.ends_with("1b2c3d4e5f60"), "{name}");
        crate::config::check_object_name(&name).unwrap();
        crate::config::check_object_name(&own_group_name(&short)).unwrap();
        // A name from the wire may hold more than ASCII: still a valid group name, no panic.
        let wide =
            NodeName::from_wire(&format!("iqn.2026-11.org.example:{}", "é".repeat(80))).unwrap();
        let name = own_group_name(&wide);
        crate::config::check_object_name(&name).unwrap();
        assert_eq!(name.chars().count(), 64);
    }

    #[test]
    fn the_lowest_free_lun_is_taken() {
        let mut g = InitiatorGroup {
            name: "g".into(),
            initiators: Vec::new(),
            any_initiator: false,
            luns: Vec::new(),
            auth: AuthConfig::default(),
            allowed_sources: Vec::new(),
        };
        assert_eq!(free_lun(&g).unwrap(), 0);
        for lun in [0, 1, 3] {
            g.luns.push(LunMapping {
                lun,
                device: format!("d{lun}"),
                read_only: false,
            });
        }
        assert_eq!(free_lun(&g).unwrap(), 2);
    }
}
