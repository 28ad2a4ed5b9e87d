//! How CSI's names and IDs map onto the array's: a volume's ID is its ferrosan volume name, a
//! snapshot's is `VOLUME@SNAPSHOT` (`@` is in no ferrosan name), a node's lists its initiator
//! names (`IQN,NQN`). Pure functions: the controller and the node read IDs only through them.

use std::fmt;

/// The longest ferrosan object name (`check_object_name` in the engine).
const NAME_MAX: usize = 64;

/// The ferrosan name for a CSI name: the name itself when the array takes it (1 to 64 of
/// A-Z, a-z, 0-9, `.`, `_`, `-`, not starting with `-` or `.`), else `csi-` and the first 40
/// hex digits of its SHA-256. Deterministic, so a repeated CreateVolume finds its volume.
pub fn volume_name(csi_name: &str) -> String {
    let plain = !csi_name.is_empty()
        && csi_name.len() <= NAME_MAX
        && !csi_name.starts_with(['-', '.'])
        && csi_name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if plain {
        return csi_name.to_string();
    }
    let digest = openssl::sha::sha256(csi_name.as_bytes());
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("csi-{hex}")
}

/// A snapshot's ID: its volume and its name there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotId {
    pub volume: String,
    pub snapshot: String,
}

impl SnapshotId {
    /// Parses `VOLUME@SNAPSHOT`; `None` for anything else (an ID this driver never made).
    pub fn parse(id: &str) -> Option<SnapshotId> {
        let (volume, snapshot) = id.split_once('@')?;
        let valid = |s: &str| !s.is_empty() && volume_name(s) == s;
        (valid(volume) && valid(snapshot)).then(|| SnapshotId {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        })
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.volume, self.snapshot)
    }
}

/// A node's initiator names, as its node ID carries them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeId {
    /// Its iSCSI initiator name (`/etc/iscsi/initiatorname.iscsi`).
    pub iqn: Option<String>,
    /// Its NVMe host NQN (`/etc/nvme/hostnqn`).
    pub nqn: Option<String>,
}

impl NodeId {
    /// Parses `NAME[,NAME]`: each an iSCSI name (`iqn.`, `eui.`, `naa.`) or an NQN (`nqn.`),
    /// at most one of each; `None` for anything else.
    pub fn parse(id: &str) -> Option<NodeId> {
        let mut node = NodeId::default();
        for name in id.split(',') {
            let slot = match name.get(..4) {
                Some("iqn." | "eui." | "naa.") => &mut node.iqn,
                Some("nqn.") => &mut node.nqn,
                _ => return None,
            };
            if slot.is_some() || name.len() > 223 || name.chars().any(char::is_whitespace) {
                return None;
            }
            *slot = Some(name.to_string());
        }
        Some(node)
    }

    /// The name to export a volume to over `transport`.
    pub fn initiator(&self, transport: Transport) -> Option<&str> {
        match transport {
            Transport::Iscsi => self.iqn.as_deref(),
            Transport::Nvme => self.nqn.as_deref(),
        }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [self.iqn.as_deref(), self.nqn.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        f.write_str(&names.join(","))
    }
}

/// How a node reaches a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Iscsi,
    Nvme,
}

impl Transport {
    pub fn parse(s: &str) -> Option<Transport> {
        match s {
            "iscsi" => Some(Transport::Iscsi),
            "nvme" | "nvme-tcp" => Some(Transport::Nvme),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Iscsi => "iscsi",
            Transport::Nvme => "nvme",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_the_array_takes_is_kept_and_any_other_hashed_the_same_each_time() {
        assert_eq!(volume_name("pvc-0c8e1f"), "pvc-0c8e1f");
        let odd = "sanity Node Service 1/2";
        let mapped = volume_name(odd);
        assert_eq!(mapped, volume_name(odd));
        assert_eq!(mapped.len(), 44);
        assert!(mapped.starts_with("csi-"));
        assert_ne!(mapped, volume_name("sanity Node Service 1/3"));
        assert_ne!(volume_name(&"a".repeat(65)), "a".repeat(65));
        assert_ne!(volume_name("-rf"), "-rf");
        assert_ne!(volume_name(""), "");
    }

    #[test]
    fn snapshot_ids_go_both_ways_and_refuse_what_this_driver_never_made() {
        let id = SnapshotId {
            volume: "vol1".into(),
            snapshot: "snap1".into(),
        };
        assert_eq!(id.to_string(), "vol1@snap1");
        assert_eq!(SnapshotId::parse("vol1@snap1"), Some(id));
        for bad in ["vol1", "@snap", "vol@", "a@b@c", "../x@y", "vol 1@s"] {
            assert_eq!(SnapshotId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn node_ids_carry_one_name_per_transport() {
        let both = "iqn.2005-03.org.open-iscsi:node1,nqn.2014-08.org.nvmexpress:uuid:1";
        let node = NodeId::parse(both).unwrap();
        assert_eq!(
            node.initiator(Transport::Iscsi),
            Some("iqn.2005-03.org.open-iscsi:node1")
        );
        assert_eq!(
            node.initiator(Transport::Nvme),
            Some("nqn.2014-08.org.nvmexpress:uuid:1")
        );
        assert_eq!(node.to_string(), both);
        let only = NodeId::parse("iqn.2005-03.org.open-iscsi:node1").unwrap();
        assert_eq!(only.initiator(Transport::Nvme), None);
        for bad in ["", "node1", "iqn.a,iqn.b", "iqn.a b", "nqn.x,,iqn.y"] {
            assert_eq!(NodeId::parse(bad), None, "{bad}");
        }
    }
}
