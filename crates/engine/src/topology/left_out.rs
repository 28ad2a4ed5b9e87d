//! RBD devices the daemon started without because their cluster could not be reached (see
//! `server::build`): what the config said about them, so that they come back by themselves
//! when the cluster does (a retry thread applies the running config with them added), and so
//! that saving the running config (`ctl save`) keeps them in the file instead of deleting them.

use crate::config::{Config, DeviceConfig, LunMapping};

/// A device left out, with its LUN mappings as the config had them.
#[derive(Clone, Debug)]
pub struct LeftOut {
    pub device: DeviceConfig,
    /// Its place among the config's devices (a saved file keeps the order).
    pub position: usize,
    /// (target IQN, group name, mapping).
    pub mappings: Vec<(String, String, LunMapping)>,
}

impl LeftOut {
    /// Device `name` as `config` defines and maps it; None if it defines no such device.
    pub fn of(config: &Config, name: &str) -> Option<LeftOut> {
        let position = config.devices.iter().position(|d| d.name == name)?;
        let device = DeviceConfig::clone(&config.devices[position]);
        let mut mappings = Vec::new();
        for target in &config.targets {
            for group in &target.groups {
                for mapping in group.luns.iter().filter(|m| m.device == name) {
                    let iqn = target.iqn.as_str().to_string();
                    mappings.push((iqn, group.name.clone(), mapping.clone()));
                }
            }
        }
        Some(LeftOut {
            device,
            position,
            mappings,
        })
    }
}

/// `running` with the devices left out back in: each one not running is added, and mapped
/// again where its target and group still exist and its LUN is still free (a change made
/// meanwhile wins).
pub fn merged(running: &Config, left_out: &[LeftOut]) -> Config {
    let mut config = running.clone();
    for out in left_out {
        if config.device(&out.device.name).is_some() {
            continue;
        }
        let at = out.position.min(config.devices.len());
        config.devices.insert(at, out.device.clone().into());
        for (iqn, group, mapping) in &out.mappings {
            let Some(group) = config
                .targets
                .iter_mut()
                .filter(|t| t.iqn.as_str() == iqn)
                .flat_map(|t| std::sync::Arc::make_mut(t).groups.iter_mut())
                .find(|g| &g.name == group)
            else {
                continue;
            };
            if group.luns.iter().all(|m| m.lun != mapping.lun) {
                group.luns.push(mapping.clone());
                group.luns.sort_by_key(|m| m.lun);
            }
        }
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "test.toml";

    fn config(text: &str) -> Config {
        Config::from_toml_str(text, FILE).expect("valid config")
    }

    const FULL: &str = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]

[[device]]
name = "ram"
store = "ram"
size = "1M"

[[device]]
name = "vm"
store = "ram"
size = "2M"

[[device]]
name = "spare"
store = "ram"
size = "1M"

[[target]]
iqn = "iqn.2024-01.dev.ferrosan:t"

  [[target.group]]
  name = "hosts"
  any_initiator = true
  luns = [ { lun = 0, device = "ram" }, { lun = 1, device = "vm" } ]

  [[target.group]]
  name = "backup"
  initiators = ["iqn.2024-01.dev.ferrosan:backup"]
  luns = [ { lun = 3, device = "vm", read_only = true } ]
"#;

    /// `FULL` as a start that left "vm" out runs it.
    fn without_vm(full: &Config) -> Config {
        let mut running = full.clone();
        running.devices.retain(|d| d.name != "vm");
        for g in running
            .targets
            .iter_mut()
            .flat_map(|t| std::sync::Arc::make_mut(t).groups.iter_mut())
        {
            g.luns.retain(|m| m.device != "vm");
        }
        running
    }

    #[test]
    fn a_device_left_out_comes_back_with_its_mappings() {
        let full = config(FULL);
        let out = LeftOut::of(&full, "vm").expect("defined");
        assert_eq!(out.mappings.len(), 2);
        assert!(LeftOut::of(&full, "nope").is_none());
        let back = merged(&without_vm(&full), std::slice::from_ref(&out));
        assert_eq!(back, full);
        // Merging again (it runs now) changes nothing.
        assert_eq!(merged(&back, &[out]), full);
    }

    #[test]
    fn changes_made_meanwhile_win() {
        let full = config(FULL);
        let out = LeftOut::of(&full, "vm").expect("defined");
        let mut running = without_vm(&full);
        // LUN 1 of "hosts" went to another device, the group "backup" was removed.
        std::sync::Arc::make_mut(&mut running.targets[0]).groups[0]
            .luns
            .push(LunMapping {
                lun: 1,
                device: "spare".into(),
                read_only: false,
            });
        std::sync::Arc::make_mut(&mut running.targets[0])
            .groups
            .retain(|g| g.name != "backup");
        let back = merged(&running, &[out]);
        assert!(back.device("vm").is_some(), "the device is back");
        let hosts = &back.targets[0].groups[0];
        assert_eq!(hosts.luns.len(), 2);
        assert_eq!(
            hosts.luns[1].device, "spare",
            "LUN 1 stays where it was put"
        );
        assert_eq!(back.targets[0].groups.len(), 1, "no group comes back");
        // What comes back is a config the engine accepts (its text reads back the same).
        assert_eq!(
            Config::from_toml_str(&back.to_toml(), FILE).expect("valid"),
            back
        );
    }
}
