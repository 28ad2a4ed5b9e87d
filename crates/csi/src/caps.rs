//! Which volume capabilities the driver offers, decided once for the controller and the node.

use bpfman_csi::v1::volume_capability::access_mode::Mode;
use bpfman_csi::v1::volume_capability::AccessType;
use bpfman_csi::v1::VolumeCapability;
use tonic::Status;

/// The filesystems the node makes and mounts.
pub const FILESYSTEMS: &[&str] = &["ext4", "xfs"];

/// Whether `capability` is one the driver serves; why not otherwise. A filesystem is one
/// node's at a time (mounted on two it is corrupted) unless every node reads only; a block
/// volume may be shared, as clustered filesystems and databases share LUNs.
pub fn check(capability: &VolumeCapability) -> Result<(), String> {
    let mode = mode(capability);
    if mode == Mode::Unknown {
        return Err("an access mode is required".into());
    }
    match &capability.access_type {
        None => Err("an access type (block or mount) is required".into()),
        Some(AccessType::Block(_)) => Ok(()),
        Some(AccessType::Mount(mount)) => {
            if !mount.fs_type.is_empty() && !FILESYSTEMS.contains(&mount.fs_type.as_str()) {
                return Err(format!(
                    "filesystem {:?}: the node makes {}",
                    mount.fs_type,
                    FILESYSTEMS.join(" or ")
                ));
            }
            match mode {
                Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter => Err(format!(
                    "{}: a filesystem volume is one node's at a time (block volumes may be shared)",
                    mode.as_str_name()
                )),
                _ => Ok(()),
            }
        }
    }
}

/// The request's capability, required and served (INVALID_ARGUMENT otherwise).
pub fn given(capability: Option<&VolumeCapability>) -> Result<&VolumeCapability, Status> {
    let capability =
        capability.ok_or_else(|| Status::invalid_argument("a volume capability is required"))?;
    check(capability).map_err(Status::invalid_argument)?;
    Ok(capability)
}

fn mode(capability: &VolumeCapability) -> Mode {
    capability
        .access_mode
        .as_ref()
        .and_then(|m| Mode::try_from(m.mode).ok())
        .unwrap_or(Mode::Unknown)
}

/// Whether `capability` lets one node only have the volume.
pub fn single_node(capability: &VolumeCapability) -> bool {
    matches!(
        mode(capability),
        Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter
    )
}

/// Whether `capability` only reads.
pub fn read_only(capability: &VolumeCapability) -> bool {
    matches!(
        mode(capability),
        Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bpfman_csi::v1::volume_capability::{AccessMode, BlockVolume, MountVolume};

    pub fn mount(fs: &str, mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            })),
        }
    }

    pub fn block(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        }
    }

    #[test]
    fn a_filesystem_is_one_nodes_and_a_block_volume_may_be_shared() {
        assert!(check(&mount("ext4", Mode::SingleNodeWriter)).is_ok());
        assert!(check(&mount("", Mode::MultiNodeReaderOnly)).is_ok());
        assert!(check(&mount("xfs", Mode::MultiNodeMultiWriter)).is_err());
        assert!(check(&mount("zfs", Mode::SingleNodeWriter)).is_err());
        assert!(check(&block(Mode::MultiNodeMultiWriter)).is_ok());
        assert!(check(&block(Mode::Unknown)).is_err());
        let mut none = block(Mode::SingleNodeWriter);
        none.access_type = None;
        assert!(check(&none).is_err());
        assert!(single_node(&mount("ext4", Mode::SingleNodeSingleWriter)));
        assert!(!single_node(&block(Mode::MultiNodeReaderOnly)));
        assert!(read_only(&block(Mode::MultiNodeReaderOnly)));
        assert!(!read_only(&block(Mode::SingleNodeWriter)));
    }
}
