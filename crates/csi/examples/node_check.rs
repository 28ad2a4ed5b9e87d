//! The CSI driver's node side against a real kernel initiator: run inside the test guest by
//! scripts/guest/csi-node.sh (ferrosan on the guest's loopback, its API, a directory pool),
//! with the controller and the node services called as the sidecars and the kubelet call
//! them. Prints one `CHECK NAME: ok` or `CHECK NAME: FAILED WHY` line per check.
//!
//!   node_check API_URL TOKEN_FILE CA_FILE ISCSI_PORTAL NVME_PORTAL WORK_DIR

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use bpfman_csi::v1::controller_server::Controller;
use bpfman_csi::v1::node_server::Node;
use bpfman_csi::v1::volume_capability::access_mode::Mode;
use bpfman_csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use bpfman_csi::v1::volume_content_source::{SnapshotSource, Type as Source};
use bpfman_csi::v1::*;
use ferrosan_csi::array::Array;
use ferrosan_csi::controller::ControllerService;
use ferrosan_csi::host::System;
use ferrosan_csi::inflight::InFlight;
use ferrosan_csi::node::NodeService;
use tonic::Request;

const MIB: i64 = 1 << 20;
const TEXT: &str = "written through the CSI node before its unstage\n";

struct Check {
    controller: ControllerService,
    node: NodeService,
    work: String,
    iscsi_portal: String,
    nvme_portal: String,
    failed: bool,
}

fn capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

type Step = Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Check {
    fn report(&mut self, name: &str, result: Step) {
        match result {
            Ok(()) => println!("CHECK {name}: ok"),
            Err(why) => {
                self.failed = true;
                println!("CHECK {name}: FAILED {}", why.replace('\n', " "));
            }
        }
    }

    fn params(&self, transport: &str) -> HashMap<String, String> {
        let portals = match transport {
            "nvme" => &self.nvme_portal,
            _ => &self.iscsi_portal,
        };
        HashMap::from([
            ("pool".into(), "k8s".into()),
            ("transport".into(), transport.into()),
            ("portals".into(), portals.clone()),
        ])
    }

    async fn create(
        &self,
        name: &str,
        transport: &str,
        source: Option<Source>,
    ) -> Result<Volume, String> {
        let request = CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![capability()],
            parameters: self.params(transport),
            volume_content_source: source.map(|s| VolumeContentSource { r#type: Some(s) }),
            ..Default::default()
        };
        let made = self
            .controller
            .create_volume(Request::new(request))
            .await
            .map_err(err)?;
        made.into_inner().volume.ok_or_else(|| "no volume".into())
    }

    fn paths(&self, volume: &str) -> (String, String) {
        (
            format!("{}/{volume}/staging", self.work),
            format!("{}/{volume}/pod", self.work),
        )
    }

    /// ControllerPublish, NodeStage and NodePublish of `volume` on this node.
    async fn attach(&self, volume: &Volume) -> Step {
        let published = self
            .controller
            .controller_publish_volume(Request::new(ControllerPublishVolumeRequest {
                volume_id: volume.volume_id.clone(),
                node_id: self.node.node_id(),
                volume_capability: Some(capability()),
                volume_context: volume.volume_context.clone(),
                ..Default::default()
            }))
            .await
            .map_err(err)?
            .into_inner();
        let (staging, pod) = self.paths(&volume.volume_id);
        self.node
            .node_stage_volume(Request::new(NodeStageVolumeRequest {
                volume_id: volume.volume_id.clone(),
                publish_context: published.publish_context,
                staging_target_path: staging.clone(),
                volume_capability: Some(capability()),
                volume_context: volume.volume_context.clone(),
                ..Default::default()
            }))
            .await
            .map_err(err)?;
        self.node
            .node_publish_volume(Request::new(NodePublishVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: staging,
                target_path: pod,
                volume_capability: Some(capability()),
                ..Default::default()
            }))
            .await
            .map_err(err)?;
        Ok(())
    }

    /// NodeUnpublish, NodeUnstage and ControllerUnpublish.
    async fn detach(&self, volume: &str) -> Step {
        let (staging, pod) = self.paths(volume);
        let unpublish = NodeUnpublishVolumeRequest {
            volume_id: volume.into(),
            target_path: pod,
        };
        self.node
            .node_unpublish_volume(Request::new(unpublish))
            .await
            .map_err(err)?;
        let unstage = NodeUnstageVolumeRequest {
            volume_id: volume.into(),
            staging_target_path: staging,
        };
        self.node
            .node_unstage_volume(Request::new(unstage))
            .await
            .map_err(err)?;
        let unpublish = ControllerUnpublishVolumeRequest {
            volume_id: volume.into(),
            node_id: self.node.node_id(),
            ..Default::default()
        };
        self.controller
            .controller_unpublish_volume(Request::new(unpublish))
            .await
            .map_err(err)?;
        Ok(())
    }

    fn file(&self, volume: &str) -> String {
        format!("{}/hello.txt", self.paths(volume).1)
    }

    fn reads_back(&self, volume: &str) -> Step {
        let text = std::fs::read_to_string(self.file(volume)).map_err(err)?;
        match text == TEXT {
            true => Ok(()),
            false => Err(format!("read back {text:?}")),
        }
    }

    /// Stage → write → unstage → stage again → the file is there.
    async fn survives_unstage(&self, volume: &Volume) -> Step {
        self.attach(volume).await?;
        std::fs::write(self.file(&volume.volume_id), TEXT).map_err(err)?;
        self.detach(&volume.volume_id).await?;
        if Path::new(&self.file(&volume.volume_id)).exists() {
            return Err("the file is still there after the unstage".into());
        }
        self.attach(volume).await?;
        self.reads_back(&volume.volume_id)
    }

    /// ControllerExpand and NodeExpand: the mounted filesystem grows.
    async fn expands(&self, volume: &str) -> Step {
        let grow = ControllerExpandVolumeRequest {
            volume_id: volume.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 128 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(capability()),
            ..Default::default()
        };
        self.controller
            .controller_expand_volume(Request::new(grow))
            .await
            .map_err(err)?;
        let pod = self.paths(volume).1;
        let expand = NodeExpandVolumeRequest {
            volume_id: volume.into(),
            volume_path: pod.clone(),
            volume_capability: Some(capability()),
            ..Default::default()
        };
        let size = self
            .node
            .node_expand_volume(Request::new(expand))
            .await
            .map_err(err)?;
        let stats = NodeGetVolumeStatsRequest {
            volume_id: volume.into(),
            volume_path: pod,
            ..Default::default()
        };
        let usage = self
            .node
            .node_get_volume_stats(Request::new(stats))
            .await
            .map_err(err)?;
        let total = usage.into_inner().usage.first().map_or(0, |u| u.total);
        let device = size.into_inner().capacity_bytes;
        match device == 128 * MIB && total > 100 * MIB {
            true => Ok(()),
            false => Err(format!("device {device} bytes, filesystem {total}")),
        }
    }

    /// A second node may not have a single-node volume published here.
    async fn second_node_refused(&self, volume: &Volume) -> Step {
        let other = ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: "iqn.2026-12.test:another-node,nqn.2026-12.test:another-node".into(),
            volume_capability: Some(capability()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        };
        match self
            .controller
            .controller_publish_volume(Request::new(other))
            .await
        {
            Err(s) if s.code() == tonic::Code::FailedPrecondition => Ok(()),
            other => Err(format!("answered {other:?}")),
        }
    }

    /// A snapshot restored into a new volume holds the file. The guest's pool is on tmpfs,
    /// which cannot reflink, and there the array copies a snapshot only of a volume no host
    /// has (docs/VOLUMES.md): the volume is detached first.
    async fn restores(&self, volume: &str, transport: &str) -> Result<String, String> {
        self.detach(volume).await?;
        let snapshot = CreateSnapshotRequest {
            source_volume_id: volume.into(),
            name: format!("{volume}-snap"),
            ..Default::default()
        };
        let taken = self
            .controller
            .create_snapshot(Request::new(snapshot))
            .await
            .map_err(err)?;
        let id = taken
            .into_inner()
            .snapshot
            .ok_or("no snapshot")?
            .snapshot_id;
        let source = Source::Snapshot(SnapshotSource { snapshot_id: id });
        let restored = self
            .create(&format!("{volume}-restored"), transport, Some(source))
            .await?;
        self.attach(&restored).await?;
        self.reads_back(&restored.volume_id)?;
        Ok(restored.volume_id)
    }

    async fn transport(&mut self, transport: &str) {
        let name = format!("pvc-{transport}");
        let volume = match self.create(&name, transport, None).await {
            Ok(v) => v,
            Err(why) => return self.report(&format!("{transport}-create"), Err(why)),
        };
        self.report(&format!("{transport}-create"), Ok(()));
        let kept = self.survives_unstage(&volume).await;
        self.report(&format!("{transport}-stage-write-unstage-stage"), kept);
        let refused = self.second_node_refused(&volume).await;
        self.report(&format!("{transport}-second-node-refused"), refused);
        let grown = self.expands(&name).await;
        self.report(&format!("{transport}-expand"), grown);
        let restored = self.restores(&name, transport).await;
        let clone = restored.as_ref().ok().cloned();
        self.report(&format!("{transport}-snapshot-restore"), restored.map(drop));
        let mut cleanup = self.detach(&name).await;
        if let Some(clone) = clone {
            cleanup = cleanup.and(self.detach(&clone).await);
        }
        self.report(&format!("{transport}-unstage-all"), cleanup);
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, token, ca, iscsi_portal, nvme_portal, work] = &args[..] else {
        eprintln!("usage: node_check API_URL TOKEN_FILE CA_FILE ISCSI_PORTAL NVME_PORTAL WORK_DIR");
        return std::process::ExitCode::from(2);
    };
    let remote = match client::Remote::new(
        url,
        &client::Credentials {
            token_file: Some(Path::new(token)),
            certificate: None,
        },
        Some(Path::new(ca)),
    ) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("node_check: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let node = match NodeService::new(Arc::new(System), None, format!("{work}/state").into()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("node_check: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut check = Check {
        controller: ControllerService {
            array: Array::new(Arc::new(remote)),
            inflight: InFlight::default(),
        },
        node,
        work: work.clone(),
        iscsi_portal: iscsi_portal.clone(),
        nvme_portal: nvme_portal.clone(),
        failed: false,
    };
    check.transport("iscsi").await;
    check.transport("nvme").await;
    match check.failed {
        true => std::process::ExitCode::FAILURE,
        false => std::process::ExitCode::SUCCESS,
    }
}
