//! The CSI Node service: a published volume reached from this node over iSCSI (open-iscsi:
//! a session per portal, dm-multipath over them when there are several) or NVMe/TCP
//! (nvme-cli: a controller per portal, the kernel's native multipath), a filesystem made when
//! the volume has none, mounted at the staging path and bind-mounted into each pod. What it
//! staged is recorded (`--state-dir`), so Unstage logs out only when no other staged volume
//! uses the same target.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bpfman_csi::v1::node_server::Node;
use bpfman_csi::v1::node_service_capability::{rpc, Rpc, Type as CapType};
use bpfman_csi::v1::volume_capability::AccessType;
use bpfman_csi::v1::*;
use serde_json::{json, Value};
use tonic::{Request, Response, Status};

use crate::caps;
use crate::host::{record_path, Host, HostError};
use crate::inflight::InFlight;
use crate::names::{NodeId, Transport};
use crate::required;

/// How long a LUN or namespace may take to appear after the login or connect.
const DEVICE_WAIT: Duration = Duration::from_secs(20);
/// open-iscsi's "session exists" and "no session" exit codes: a repeat's answers.
const ISCSI_SESSION_EXISTS: i32 = 15;
const ISCSI_NO_SESSION: i32 = 21;

pub struct NodeService {
    host: Arc<dyn Host>,
    node: NodeId,
    state_dir: PathBuf,
    inflight: InFlight,
}

/// What Stage connected, as recorded for Unstage.
#[derive(Debug, Clone, PartialEq)]
struct Staged {
    transport: Transport,
    /// The target's IQN (iSCSI) or NQN (NVMe/TCP).
    target: String,
    portals: Vec<String>,
    lun: u64,
    naa: String,
    device: String,
}

impl Staged {
    fn to_json(&self) -> String {
        json!({"transport": self.transport.as_str(), "target": self.target,
               "portals": self.portals, "lun": self.lun, "naa": self.naa,
               "device": self.device})
        .to_string()
    }

    fn from_json(text: &str) -> Option<Staged> {
        let v: Value = serde_json::from_str(text).ok()?;
        Some(Staged {
            transport: Transport::parse(v["transport"].as_str()?)?,
            target: v["target"].as_str()?.to_string(),
            portals: v["portals"]
                .as_array()?
                .iter()
                .filter_map(|p| p.as_str().map(String::from))
                .collect(),
            lun: v["lun"].as_u64()?,
            naa: v["naa"].as_str()?.to_string(),
            device: v["device"].as_str()?.to_string(),
        })
    }
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

/// `HOST:PORT` (or `[V6]:PORT`) as nvme-cli's address and service.
fn split_portal(portal: &str) -> Option<(&str, &str)> {
    let (host, port) = portal.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty() && port.parse::<u16>().is_ok()).then_some((host, port))
}

/// What Stage is asked to reach, from the volume's and the publish's contexts.
fn wanted(
    volume: &HashMap<String, String>,
    publish: &HashMap<String, String>,
) -> Result<Staged, Status> {
    let get = |key: &str| publish.get(key).or_else(|| volume.get(key));
    let transport = get("transport").map_or(Some(Transport::Iscsi), |t| Transport::parse(t));
    let transport = transport.ok_or_else(|| Status::invalid_argument("unknown transport"))?;
    let target = match transport {
        Transport::Iscsi => get("target"),
        Transport::Nvme => get("nqn"),
    };
    let missing =
        |what: &str| Status::invalid_argument(format!("the publish context has no {what}"));
    let portals: Vec<String> = get("portals")
        .ok_or_else(|| missing("portals"))?
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if portals.is_empty() || portals.iter().any(|p| split_portal(p).is_none()) {
        return Err(Status::invalid_argument("portals are HOST:PORT,…"));
    }
    Ok(Staged {
        transport,
        target: target.ok_or_else(|| missing("target name"))?.clone(),
        portals,
        lun: get("lun")
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| missing("LUN"))?,
        naa: get("naa").ok_or_else(|| missing("NAA"))?.to_lowercase(),
        device: String::new(),
    })
}

impl NodeService {
    /// The node service; its node ID from `node_id` or the machine's initiator files.
    pub fn new(
        host: Arc<dyn Host>,
        node_id: Option<&str>,
        state_dir: PathBuf,
    ) -> Result<NodeService, String> {
        let node = match node_id {
            Some(id) => NodeId::parse(id).ok_or_else(|| format!("node ID {id:?}: IQN,NQN"))?,
            None => NodeId {
                iqn: host
                    .read(Path::new("/etc/iscsi/initiatorname.iscsi"))
                    .and_then(|t| {
                        t.lines()
                            .find_map(|l| l.trim().strip_prefix("InitiatorName=").map(String::from))
                    }),
                nqn: host
                    .read(Path::new("/etc/nvme/hostnqn"))
                    .map(|t| t.trim().to_string())
                    .filter(|n| n.starts_with("nqn.")),
            },
        };
        if node.iqn.is_none() && node.nqn.is_none() {
            return Err(
                "this node has neither an iSCSI initiator name nor an NVMe host NQN".into(),
            );
        }
        host.create_dir(&state_dir)
            .map_err(|e| format!("{}: {e}", state_dir.display()))?;
        Ok(NodeService {
            host,
            node,
            state_dir,
            inflight: InFlight::default(),
        })
    }

    pub fn node_id(&self) -> String {
        self.node.to_string()
    }

    fn records(&self) -> Vec<(String, Staged)> {
        self.host
            .list(&self.state_dir)
            .into_iter()
            .filter_map(|f| {
                let volume = f.strip_suffix(".json")?.to_string();
                let text = self.host.read(&self.state_dir.join(&f))?;
                Some((volume, Staged::from_json(&text)?))
            })
            .collect()
    }

    fn record(&self, volume: &str) -> Option<Staged> {
        let text = self.host.read(&record_path(&self.state_dir, volume))?;
        Staged::from_json(&text)
    }

    /// What is mounted at `path` (`findmnt`'s source), if anything.
    fn mounted(&self, path: &str) -> Option<String> {
        let out = self
            .host
            .run("findmnt", &["-n", "-o", "SOURCE", "--mountpoint", path])
            .ok()?;
        let source = out.lines().next()?.trim().to_string();
        (!source.is_empty()).then_some(source)
    }

    /// Unmounts `path` if anything is mounted there.
    fn unmount(&self, path: &str) -> Result<(), Status> {
        if self.mounted(path).is_some() {
            self.host.run("umount", &[path]).map_err(internal)?;
        }
        Ok(())
    }

    fn connect_iscsi(
        &self,
        want: &Staged,
        secrets: &HashMap<String, String>,
    ) -> Result<(), Status> {
        for portal in &want.portals {
            let node = ["-m", "node", "-T", &want.target, "-p", portal];
            // A record made before (a repeat) is updated, not refused.
            let _ = self
                .host
                .run("iscsiadm", &[&node[..], &["-o", "new"]].concat());
            let mut settings: Vec<(&str, &str)> = Vec::new();
            if let (Some(user), Some(secret)) = (
                secrets.get("node.session.auth.username"),
                secrets.get("node.session.auth.password"),
            ) {
                settings.extend([
                    ("node.session.auth.authmethod", "CHAP"),
                    ("node.session.auth.username", user),
                    ("node.session.auth.password", secret),
                ]);
                if let (Some(user_in), Some(secret_in)) = (
                    secrets.get("node.session.auth.username_in"),
                    secrets.get("node.session.auth.password_in"),
                ) {
                    settings.extend([
                        ("node.session.auth.username_in", user_in.as_str()),
                        ("node.session.auth.password_in", secret_in.as_str()),
                    ]);
                }
            }
            for (name, value) in settings {
                let update = ["-o", "update", "-n", name, "-v", value];
                self.host
                    .run("iscsiadm", &[&node[..], &update].concat())
                    .map_err(internal)?;
            }
            match self
                .host
                .run("iscsiadm", &[&node[..], &["--login"]].concat())
            {
                Ok(_) => {}
                Err(HostError {
                    code: Some(ISCSI_SESSION_EXISTS),
                    ..
                }) => {}
                Err(e) => return Err(internal(e)),
            }
        }
        Ok(())
    }

    fn connect_nvme(&self, want: &Staged, secrets: &HashMap<String, String>) -> Result<(), Status> {
        let hostnqn = self
            .node
            .nqn
            .as_deref()
            .ok_or_else(|| Status::failed_precondition("this node has no NVMe host NQN"))?;
        for portal in &want.portals {
            let Some((addr, port)) = split_portal(portal) else {
                continue;
            };
            if self.nvme_controller(&want.target, addr, port).is_some() {
                continue;
            }
            let mut args = vec![
                "connect",
                "-t",
                "tcp",
                "-a",
                addr,
                "-s",
                port,
                "-n",
                &want.target,
                "--hostnqn",
                hostnqn,
            ];
            if let Some(secret) = secrets.get("dhchap-secret") {
                args.extend(["--dhchap-secret", secret]);
            }
            if let Some(secret) = secrets.get("dhchap-ctrl-secret") {
                args.extend(["--dhchap-ctrl-secret", secret]);
            }
            self.host.run("nvme", &args).map_err(internal)?;
        }
        Ok(())
    }

    /// This node's controller of subsystem `nqn` through `addr`:`port`, if connected.
    fn nvme_controller(&self, nqn: &str, addr: &str, port: &str) -> Option<String> {
        let class = Path::new("/sys/class/nvme");
        self.host.list(class).into_iter().find(|c| {
            let attr = |name: &str| {
                self.host
                    .read(&class.join(c).join(name))
                    .unwrap_or_default()
            };
            let address = attr("address");
            attr("subsysnqn").trim() == nqn
                && address.contains(&format!("traddr={addr}"))
                && address.contains(&format!("trsvcid={port}"))
        })
    }

    /// The block device of `want` on this node, if it is there: the multipath map over its
    /// paths, or its one path.
    fn find_device(&self, want: &Staged) -> Option<String> {
        match want.transport {
            Transport::Iscsi => self.find_scsi(want),
            Transport::Nvme => self.find_namespace(&want.target, want.lun + 1),
        }
    }

    /// The LU's SCSI disks (`sdX`), one per portal's session: udev's by-path links name the
    /// portal, the target and the LUN, whatever designator the kernel takes for its WWID.
    fn scsi_paths(&self, staged: &Staged) -> Vec<String> {
        staged
            .portals
            .iter()
            .filter_map(|portal| {
                let link = format!(
                    "/dev/disk/by-path/ip-{portal}-iscsi-{}-lun-{}",
                    staged.target, staged.lun
                );
                let disk = self.host.resolve(Path::new(&link))?;
                Some(disk.file_name()?.to_str()?.to_string())
            })
            .collect()
    }

    fn find_scsi(&self, staged: &Staged) -> Option<String> {
        let paths = self.scsi_paths(staged);
        let block = Path::new("/sys/block");
        for path in &paths {
            for holder in self.host.list(&block.join(path).join("holders")) {
                if let Some(name) = self.host.read(&block.join(&holder).join("dm/name")) {
                    return Some(format!("/dev/mapper/{}", name.trim()));
                }
            }
        }
        paths.first().map(|p| format!("/dev/{p}"))
    }

    /// The sysfs directory of this node's subsystem `nqn`, if connected.
    fn nvme_subsystem(&self, nqn: &str) -> Option<PathBuf> {
        let class = Path::new("/sys/class/nvme-subsystem");
        let subsystem = self.host.list(class).into_iter().find(|s| {
            self.host
                .read(&class.join(s).join("subsysnqn"))
                .is_some_and(|n| n.trim() == nqn)
        })?;
        Some(class.join(subsystem))
    }

    /// The controllers (`nvmeN`) of subsystem `nqn` on this node.
    fn nvme_controllers(&self, nqn: &str) -> Vec<String> {
        let Some(dir) = self.nvme_subsystem(nqn) else {
            return Vec::new();
        };
        self.host
            .list(&dir)
            .into_iter()
            .filter(|n| {
                n.strip_prefix("nvme")
                    .is_some_and(|i| i.chars().all(|c| c.is_ascii_digit()))
            })
            .collect()
    }

    fn find_namespace(&self, nqn: &str, nsid: u64) -> Option<String> {
        let dir = self.nvme_subsystem(nqn)?;
        self.host
            .list(&dir)
            .into_iter()
            .filter(|n| n.starts_with("nvme") && !n.contains('c') && n.contains('n'))
            .find(|n| {
                self.host
                    .read(&dir.join(n).join("nsid"))
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    == Some(nsid)
            })
            .map(|n| format!("/dev/{n}"))
    }

    async fn wait_device(&self, want: &Staged) -> Result<String, Status> {
        let deadline = tokio::time::Instant::now() + DEVICE_WAIT;
        loop {
            if let Some(device) = self.find_device(want) {
                return Ok(device);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Status::deadline_exceeded(format!(
                    "LUN {} of {} did not appear within {} s",
                    want.lun,
                    want.target,
                    DEVICE_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Makes `fs` on `device` unless it holds a filesystem already (never over data).
    fn format(&self, device: &str, fs: &str) -> Result<(), Status> {
        let found = self
            .host
            .run("blkid", &["-p", "-s", "TYPE", "-o", "value", device])
            .unwrap_or_default();
        let found = found.trim();
        if !found.is_empty() {
            return match found == fs {
                true => Ok(()),
                false => Err(Status::failed_precondition(format!(
                    "{device} holds {found}, not {fs}: not formatting over it"
                ))),
            };
        }
        let mkfs = format!("mkfs.{fs}");
        let args: &[&str] = match fs {
            "ext4" => &["-q", "-F", device],
            _ => &["-q", device],
        };
        self.host.run(&mkfs, args).map_err(internal)?;
        Ok(())
    }

    /// Logs out of what `staged` used once no other staged volume uses it; otherwise only its
    /// own LUN's devices go.
    fn disconnect(&self, volume: &str, staged: &Staged) -> Result<(), Status> {
        let shared = self.records().into_iter().any(|(v, s)| {
            v != volume && s.transport == staged.transport && s.target == staged.target
        });
        match (staged.transport, shared) {
            (Transport::Iscsi, false) => {
                for portal in &staged.portals {
                    let node = ["-m", "node", "-T", &staged.target, "-p", portal];
                    match self
                        .host
                        .run("iscsiadm", &[&node[..], &["--logout"]].concat())
                    {
                        Ok(_) => {}
                        Err(HostError {
                            code: Some(ISCSI_NO_SESSION),
                            ..
                        }) => {}
                        Err(e) => return Err(internal(e)),
                    }
                    let _ = self
                        .host
                        .run("iscsiadm", &[&node[..], &["-o", "delete"]].concat());
                }
            }
            (Transport::Iscsi, true) => {
                if let Some(map) = staged.device.strip_prefix("/dev/mapper/") {
                    self.host.run("multipath", &["-f", map]).map_err(internal)?;
                }
                for path in self.scsi_paths(staged) {
                    let delete = Path::new("/sys/block").join(path).join("device/delete");
                    self.host.write(&delete, "1").map_err(internal)?;
                }
            }
            (Transport::Nvme, false) => {
                self.host
                    .run("nvme", &["disconnect", "-n", &staged.target])
                    .map_err(internal)?;
            }
            // The namespace stays until the last volume of the subsystem goes: the controller's
            // unpublish unmaps it, and the host hears of it from the target.
            (Transport::Nvme, true) => {}
        }
        Ok(())
    }
}

fn mount_of(capability: &VolumeCapability) -> Option<&volume_capability::MountVolume> {
    match &capability.access_type {
        Some(AccessType::Mount(m)) => Some(m),
        _ => None,
    }
}

fn node_rpc(kind: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(CapType::Rpc(Rpc {
            r#type: kind as i32,
        })),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = required(&request.volume_id, "a volume ID")?;
        let staging = required(&request.staging_target_path, "a staging path")?;
        let capability = caps::given(request.volume_capability.as_ref())?;
        let mut want = wanted(&request.volume_context, &request.publish_context)?;
        let _hold = self.inflight.begin(volume)?;
        match want.transport {
            Transport::Iscsi => self.connect_iscsi(&want, &request.secrets)?,
            Transport::Nvme => self.connect_nvme(&want, &request.secrets)?,
        }
        want.device = self.wait_device(&want).await?;
        self.host
            .write(&record_path(&self.state_dir, volume), &want.to_json())
            .map_err(internal)?;
        if let Some(mount) = mount_of(capability) {
            if self.mounted(staging).is_none() {
                let fs = if mount.fs_type.is_empty() {
                    "ext4"
                } else {
                    &mount.fs_type
                };
                self.format(&want.device, fs)?;
                self.host.create_dir(Path::new(staging)).map_err(internal)?;
                let mut args = vec!["-t", fs];
                let options = mount.mount_flags.join(",");
                if !options.is_empty() {
                    args.extend(["-o", &options]);
                }
                args.extend([want.device.as_str(), staging]);
                self.host.run("mount", &args).map_err(internal)?;
            }
        }
        tracing::info!(volume, device = %want.device, "NodeStageVolume");
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = required(&request.volume_id, "a volume ID")?;
        let staging = required(&request.staging_target_path, "a staging path")?;
        let _hold = self.inflight.begin(volume)?;
        self.unmount(staging)?;
        if let Some(staged) = self.record(volume) {
            self.disconnect(volume, &staged)?;
        }
        self.host
            .remove(&record_path(&self.state_dir, volume))
            .map_err(internal)?;
        tracing::info!(volume, "NodeUnstageVolume");
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = required(&request.volume_id, "a volume ID")?;
        let target = required(&request.target_path, "a target path")?;
        let staging = required(&request.staging_target_path, "a staging path")?;
        let capability = caps::given(request.volume_capability.as_ref())?;
        let _hold = self.inflight.begin(volume)?;
        if self.mounted(target).is_some() {
            return Ok(Response::new(NodePublishVolumeResponse {}));
        }
        let source = match mount_of(capability) {
            Some(_) => {
                self.host.create_dir(Path::new(target)).map_err(internal)?;
                staging.to_string()
            }
            None => {
                let staged = self.record(volume).ok_or_else(|| {
                    Status::failed_precondition(format!("volume {volume} is not staged"))
                })?;
                self.host.create_file(Path::new(target)).map_err(internal)?;
                staged.device
            }
        };
        self.host
            .run("mount", &["--bind", &source, target])
            .map_err(internal)?;
        if request.readonly || caps::read_only(capability) {
            let remount = ["-o", "remount,bind,ro", target];
            self.host.run("mount", &remount).map_err(internal)?;
        }
        tracing::info!(volume, target, "NodePublishVolume");
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = required(&request.volume_id, "a volume ID")?;
        let target = required(&request.target_path, "a target path")?;
        let _hold = self.inflight.begin(volume)?;
        self.unmount(target)?;
        self.host.remove(Path::new(target)).map_err(internal)?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let request = request.into_inner();
        required(&request.volume_id, "a volume ID")?;
        let path = required(&request.volume_path, "a volume path")?;
        if self.mounted(path).is_none() {
            return Err(Status::not_found(format!("nothing is mounted at {path}")));
        }
        let usage = usage(
            &self
                .host
                .run("df", &["-B1", "--output=size,used,avail", path])
                .map_err(internal)?,
            volume_usage::Unit::Bytes,
        )
        .into_iter()
        .chain(usage(
            &self
                .host
                .run("df", &["--output=itotal,iused,iavail", path])
                .map_err(internal)?,
            volume_usage::Unit::Inodes,
        ))
        .collect();
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: None,
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = required(&request.volume_id, "a volume ID")?;
        let path = required(&request.volume_path, "a volume path")?;
        let _hold = self.inflight.begin(volume)?;
        let staged = self
            .record(volume)
            .ok_or_else(|| Status::not_found(format!("volume {volume} is not staged here")))?;
        self.rescan(&staged)?;
        let block = matches!(
            request
                .volume_capability
                .as_ref()
                .and_then(|c| c.access_type.as_ref()),
            Some(AccessType::Block(_))
        );
        if !block {
            let fs = self
                .host
                .run("findmnt", &["-n", "-o", "FSTYPE", "--mountpoint", path])
                .map_err(internal)?;
            match fs.trim() {
                "xfs" => self.host.run("xfs_growfs", &[path]),
                _ => self.host.run("resize2fs", &[&staged.device]),
            }
            .map_err(internal)?;
        }
        let size = self
            .host
            .run("blockdev", &["--getsize64", &staged.device])
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .unwrap_or(0);
        tracing::info!(volume, size, "NodeExpandVolume");
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: size,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::ExpandVolume,
        ]
        .into_iter()
        .map(node_rpc)
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node.to_string(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

impl NodeService {
    /// Has the kernel read the LU's new size: each path rescanned, the multipath map resized.
    fn rescan(&self, staged: &Staged) -> Result<(), Status> {
        match staged.transport {
            Transport::Iscsi => {
                for path in self.scsi_paths(staged) {
                    let rescan = Path::new("/sys/block").join(path).join("device/rescan");
                    self.host.write(&rescan, "1").map_err(internal)?;
                }
                if let Some(map) = staged.device.strip_prefix("/dev/mapper/") {
                    self.host
                        .run("multipathd", &["resize", "map", map])
                        .map_err(internal)?;
                }
            }
            // A rescan is a controller's: each of the subsystem's controllers on this node.
            Transport::Nvme => {
                for controller in self.nvme_controllers(&staged.target) {
                    self.host
                        .run("nvme", &["ns-rescan", &format!("/dev/{controller}")])
                        .map_err(internal)?;
                }
            }
        }
        Ok(())
    }
}

/// `df`'s one data line (total, used, available) as a usage entry.
fn usage(df: &str, unit: volume_usage::Unit) -> Option<VolumeUsage> {
    let numbers: Vec<i64> = df
        .lines()
        .nth(1)?
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    let [total, used, available] = numbers[..] else {
        return None;
    };
    Some(VolumeUsage {
        available,
        total,
        used,
        unit: unit as i32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::tests::{block, mount};
    use bpfman_csi::v1::volume_capability::access_mode::Mode;
    use std::collections::HashSet;
    use std::sync::Mutex;

    const NAA: &str = "35ce4e558aa54711";
    const IQN: &str = "iqn.2026-12.test:array";
    const NQN: &str = "nqn.2026-12.test:array";

    /// A machine whose kernel makes the LU's paths appear on login, whose mounts are a set.
    #[derive(Default)]
    struct Fake {
        files: Mutex<HashMap<PathBuf, String>>,
        mounts: Mutex<HashMap<String, String>>,
        ran: Mutex<Vec<String>>,
        formatted: Mutex<HashSet<String>>,
        /// A filesystem the device holds before any mkfs.
        holds: Option<&'static str>,
    }

    impl Fake {
        fn put(&self, path: &str, text: &str) {
            self.files.lock().unwrap().insert(path.into(), text.into());
        }
        fn ran(&self) -> Vec<String> {
            std::mem::take(&mut *self.ran.lock().unwrap())
        }
        /// The kernel after a login: two paths of the LU under one multipath map.
        fn login(&self, lun_naa: &str, lun: u64, paths: &[&str], map: &str) {
            let portals = ["127.0.0.1:3260", "127.0.0.2:3260"];
            for (p, portal) in paths.iter().zip(portals) {
                let link = format!("/dev/disk/by-path/ip-{portal}-iscsi-{IQN}-lun-{lun}");
                self.put(&link, &format!("/dev/{p}"));
                self.put(&format!("/sys/block/{p}/holders/{map}"), "");
            }
            self.put(
                &format!("/sys/block/{map}/dm/name"),
                &format!("3{lun_naa}\n"),
            );
        }
    }

    impl Host for Fake {
        fn run(&self, program: &str, args: &[&str]) -> Result<String, HostError> {
            let line = format!("{program} {}", args.join(" "));
            self.ran.lock().unwrap().push(line.clone());
            let mut mounts = self.mounts.lock().unwrap();
            match program {
                "iscsiadm" if args.contains(&"--login") => {
                    self.login(NAA, 0, &["sdb", "sdc"], "dm-0");
                    self.login("36aa", 1, &["sdd", "sde"], "dm-1");
                }
                "nvme" if args[0] == "connect" => {
                    self.put("/sys/class/nvme-subsystem/nvme-subsys0/subsysnqn", NQN);
                    self.put("/sys/class/nvme-subsystem/nvme-subsys0/nvme0n1/nsid", "1\n");
                }
                "findmnt" => {
                    return Ok(mounts
                        .get(args[args.len() - 1])
                        .cloned()
                        .unwrap_or_default())
                }
                "mount" => {
                    mounts.insert(args[args.len() - 1].into(), args[args.len() - 2].into());
                }
                "umount" => {
                    mounts.remove(args[0]);
                }
                "blkid" => {
                    let device = args[args.len() - 1];
                    let formatted = self.formatted.lock().unwrap().contains(device);
                    return Ok(match (formatted, self.holds) {
                        (true, _) => "ext4\n".into(),
                        (false, Some(fs)) => format!("{fs}\n"),
                        (false, None) => String::new(),
                    });
                }
                p if p.starts_with("mkfs.") => {
                    self.formatted
                        .lock()
                        .unwrap()
                        .insert(args[args.len() - 1].into());
                }
                _ => {}
            }
            Ok(String::new())
        }
        fn read(&self, path: &Path) -> Option<String> {
            self.files.lock().unwrap().get(path).cloned()
        }
        fn resolve(&self, link: &Path) -> Option<PathBuf> {
            self.read(link).map(PathBuf::from)
        }
        fn list(&self, dir: &Path) -> Vec<String> {
            let files = self.files.lock().unwrap();
            let mut names: Vec<String> = files
                .keys()
                .filter_map(|p| {
                    p.strip_prefix(dir)
                        .ok()?
                        .iter()
                        .next()?
                        .to_str()
                        .map(String::from)
                })
                .collect();
            names.sort();
            names.dedup();
            names
        }
        fn write(&self, path: &Path, text: &str) -> std::io::Result<()> {
            self.ran
                .lock()
                .unwrap()
                .push(format!("write {} {text}", path.display()));
            self.files.lock().unwrap().insert(path.into(), text.into());
            Ok(())
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            self.files.lock().unwrap().remove(path);
            Ok(())
        }
        fn create_dir(&self, _: &Path) -> std::io::Result<()> {
            Ok(())
        }
        fn create_file(&self, _: &Path) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn service(fake: &Arc<Fake>) -> NodeService {
        let node = "iqn.2026-12.test:node1,nqn.2026-12.test:node1";
        NodeService::new(fake.clone(), Some(node), "/state".into()).unwrap()
    }

    fn stage(
        volume: &str,
        lun: u64,
        transport: &str,
        capability: VolumeCapability,
    ) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: volume.into(),
            staging_target_path: format!("/staging/{volume}"),
            volume_capability: Some(capability),
            publish_context: HashMap::from([
                ("transport".into(), transport.into()),
                ("target".into(), IQN.into()),
                ("nqn".into(), NQN.into()),
                ("lun".into(), lun.to_string()),
                ("naa".into(), NAA.into()),
            ]),
            volume_context: HashMap::from([(
                "portals".into(),
                "127.0.0.1:3260,127.0.0.2:3260".into(),
            )]),
            secrets: HashMap::from([
                ("node.session.auth.username".into(), "k8s".into()),
                ("node.session.auth.password".into(), "secret-of-12".into()),
            ]),
        }
    }

    fn unstage(volume: &str) -> NodeUnstageVolumeRequest {
        NodeUnstageVolumeRequest {
            volume_id: volume.into(),
            staging_target_path: format!("/staging/{volume}"),
        }
    }

    #[tokio::test]
    async fn an_iscsi_volume_is_logged_in_on_every_portal_formatted_once_and_logged_out() {
        let fake = Arc::new(Fake::default());
        let node = service(&fake);
        let fs = mount("ext4", Mode::SingleNodeWriter);
        node.node_stage_volume(Request::new(stage("pvc-1", 0, "iscsi", fs.clone())))
            .await
            .unwrap();
        let ran = fake.ran();
        let logins = ran.iter().filter(|l| l.ends_with("--login")).count();
        assert_eq!(logins, 2, "{ran:#?}");
        assert!(ran
            .iter()
            .any(|l| l.contains("-n node.session.auth.authmethod -v CHAP")));
        assert!(
            ran.iter()
                .any(|l| l == &format!("mkfs.ext4 -q -F /dev/mapper/3{NAA}")),
            "{ran:#?}"
        );
        assert!(ran
            .iter()
            .any(|l| l == &format!("mount -t ext4 /dev/mapper/3{NAA} /staging/pvc-1")));
        // A repeat: logged in already, formatted and mounted already.
        node.node_stage_volume(Request::new(stage("pvc-1", 0, "iscsi", fs)))
            .await
            .unwrap();
        let again = fake.ran();
        assert!(
            !again
                .iter()
                .any(|l| l.starts_with("mkfs") || l.starts_with("mount ")),
            "{again:#?}"
        );
        node.node_unstage_volume(Request::new(unstage("pvc-1")))
            .await
            .unwrap();
        let out = fake.ran();
        assert!(
            out.contains(&"umount /staging/pvc-1".to_string()),
            "{out:#?}"
        );
        assert_eq!(
            out.iter().filter(|l| l.ends_with("--logout")).count(),
            2,
            "{out:#?}"
        );
        node.node_unstage_volume(Request::new(unstage("pvc-1")))
            .await
            .unwrap();
        let repeat = fake.ran();
        assert!(
            !repeat
                .iter()
                .any(|l| l.contains("--logout") || l.starts_with("umount")),
            "{repeat:#?}"
        );
    }

    #[tokio::test]
    async fn the_session_stays_while_another_staged_volume_uses_its_target() {
        let fake = Arc::new(Fake::default());
        let node = service(&fake);
        let raw = block(Mode::SingleNodeWriter);
        node.node_stage_volume(Request::new(stage("pvc-a", 0, "iscsi", raw.clone())))
            .await
            .unwrap();
        node.node_stage_volume(Request::new(stage("pvc-b", 1, "iscsi", raw)))
            .await
            .unwrap();
        fake.ran();
        node.node_unstage_volume(Request::new(unstage("pvc-a")))
            .await
            .unwrap();
        let first = fake.ran();
        assert!(!first.iter().any(|l| l.contains("--logout")), "{first:#?}");
        assert!(
            first.contains(&format!("multipath -f 3{NAA}")),
            "{first:#?}"
        );
        assert!(first
            .iter()
            .any(|l| l.starts_with("write /sys/block/sdb/device/delete")));
        node.node_unstage_volume(Request::new(unstage("pvc-b")))
            .await
            .unwrap();
        assert_eq!(
            fake.ran()
                .iter()
                .filter(|l| l.ends_with("--logout"))
                .count(),
            2
        );
    }

    #[tokio::test]
    async fn a_volume_holding_another_filesystem_is_never_formatted() {
        let fake = Arc::new(Fake {
            holds: Some("xfs"),
            ..Default::default()
        });
        let node = service(&fake);
        let staged = node
            .node_stage_volume(Request::new(stage(
                "pvc-x",
                0,
                "iscsi",
                mount("ext4", Mode::SingleNodeWriter),
            )))
            .await;
        assert_eq!(staged.unwrap_err().code(), tonic::Code::FailedPrecondition);
        assert!(!fake.ran().iter().any(|l| l.starts_with("mkfs")));
    }

    #[tokio::test]
    async fn an_nvme_volume_connects_as_the_nodes_host_nqn_and_disconnects() {
        let fake = Arc::new(Fake::default());
        let node = service(&fake);
        let mut request = stage("pvc-n", 0, "nvme", mount("xfs", Mode::SingleNodeWriter));
        request
            .volume_context
            .insert("portals".into(), "[::1]:4420".into());
        request.secrets = HashMap::from([("dhchap-secret".into(), "DHHC-1:00:abc:".into())]);
        node.node_stage_volume(Request::new(request)).await.unwrap();
        let ran = fake.ran();
        let connect = format!("nvme connect -t tcp -a ::1 -s 4420 -n {NQN} --hostnqn nqn.2026-12.test:node1 --dhchap-secret DHHC-1:00:abc:");
        assert!(ran.contains(&connect), "{ran:#?}");
        assert!(
            ran.contains(&"mkfs.xfs -q /dev/nvme0n1".to_string()),
            "{ran:#?}"
        );
        node.node_unstage_volume(Request::new(unstage("pvc-n")))
            .await
            .unwrap();
        assert!(fake.ran().contains(&format!("nvme disconnect -n {NQN}")));
    }

    #[test]
    fn df_lines_become_usage() {
        let df = "     1B-blocks     Used    Avail\n  1023303680  2564096 950210560\n";
        let u = usage(df, volume_usage::Unit::Bytes).unwrap();
        assert_eq!(
            (u.total, u.used, u.available),
            (1_023_303_680, 2_564_096, 950_210_560)
        );
        assert!(usage("header only\n", volume_usage::Unit::Bytes).is_none());
    }
}
