//! The CSI Identity service: who the driver is, what it offers, whether it is ready.

use bpfman_csi::v1::identity_server::Identity;
use bpfman_csi::v1::plugin_capability::{
    service, volume_expansion, Service, Type, VolumeExpansion,
};
use bpfman_csi::v1::*;
use tonic::{Request, Response, Status};

use crate::array::Array;

/// The driver's name (a CSIDriver object's, a StorageClass's `provisioner`).
pub const DRIVER_NAME: &str = "csi.ferrosan.dev";

pub struct IdentityService {
    /// The array, when this instance runs the controller: ready once it answers.
    pub array: Option<Array>,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let service = PluginCapability {
            r#type: Some(Type::Service(Service {
                r#type: service::Type::ControllerService as i32,
            })),
        };
        // A volume grows while a pod uses it: the array's LU grows live and the node grows
        // the mounted filesystem.
        let expansion = PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: volume_expansion::Type::Online as i32,
            })),
        };
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![service, expansion],
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        let ready = match &self.array {
            Some(array) => array.call("status", serde_json::json!({})).await.is_ok(),
            None => true,
        };
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}
