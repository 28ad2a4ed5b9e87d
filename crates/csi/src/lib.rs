//! ferrosan's CSI driver: the Controller service drives a ferrosan array through its remote
//! API; the Node service logs a node in over iSCSI (open-iscsi) or NVMe/TCP (nvme-cli), makes
//! a filesystem when the volume has none, and mounts it (docs/guides/kubernetes.md).

// Every gRPC method answers a `tonic::Status` (176 bytes) by the generated trait's signature;
// the helpers return what the methods return rather than box it twice.
#![allow(clippy::result_large_err)]

pub mod array;
pub mod caps;
pub mod controller;
pub mod host;
pub mod identity;
pub mod inflight;
pub mod names;
pub mod node;

/// `value`, or INVALID_ARGUMENT naming `what` when the CO left it empty.
pub(crate) fn required<'a>(value: &'a str, what: &str) -> Result<&'a str, tonic::Status> {
    if value.is_empty() {
        return Err(tonic::Status::invalid_argument(format!(
            "{what} is required"
        )));
    }
    Ok(value)
}
