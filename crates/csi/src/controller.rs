//! The CSI Controller service: volumes, exports and snapshots of one ferrosan array, through
//! its remote API (docs/VOLUMES.md, *For orchestrators*). Every call is idempotent because
//! every verb it uses is; a second call on a volume while one runs answers ABORTED.

use std::collections::HashMap;

use bpfman_csi::v1::controller_server::Controller;
use bpfman_csi::v1::controller_service_capability::{rpc, Rpc, Type as CapType};
use bpfman_csi::v1::volume_content_source::{SnapshotSource, Type as Source, VolumeSource};
use bpfman_csi::v1::*;
use serde_json::{json, Value};
use tonic::{Code, Request, Response, Status};

use crate::array::{status, Array};
use crate::caps;
use crate::inflight::InFlight;
use crate::names::{volume_name, NodeId, SnapshotId, Transport};
use crate::required;

/// A volume's size when the CO asks for none.
const DEFAULT_SIZE: u64 = 1 << 30;
/// Sizes are whole MiB: every pool (a file, an LV's extents, an RBD image) takes them.
const ALIGN: u64 = 1 << 20;

pub struct ControllerService {
    pub array: Array,
    pub inflight: InFlight,
}

/// What the array says of one volume (`volume-list`).
#[derive(Debug, Clone)]
pub struct VolumeInfo {
    pub size: u64,
    pub clone_of: Option<String>,
    /// Each map's hosts: its group's initiators, or `None` for a group open to any.
    pub exports: Vec<Option<Vec<String>>>,
}

fn volume_info(entry: &Value) -> VolumeInfo {
    let exports = entry["exports"]
        .as_array()
        .map(|maps| {
            maps.iter()
                .map(|m| match m["any_initiator"].as_bool() {
                    Some(true) => None,
                    _ => Some(
                        m["initiators"]
                            .as_array()
                            .map(|i| {
                                i.iter()
                                    .filter_map(|n| n.as_str().map(String::from))
                                    .collect()
                            })
                            .unwrap_or_default(),
                    ),
                })
                .collect()
        })
        .unwrap_or_default();
    VolumeInfo {
        size: entry["size_bytes"].as_u64().unwrap_or(0),
        clone_of: entry["clone_of"].as_str().map(String::from),
        exports,
    }
}

/// The size to make for `range`: the required bytes rounded up to whole MiB, within the limit.
pub fn size_for(range: Option<&CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument("a negative capacity"));
    }
    let (required, limit) = (required as u64, limit as u64);
    let wanted = if required == 0 {
        DEFAULT_SIZE.min(if limit == 0 { u64::MAX } else { limit })
    } else {
        required
    };
    let size = wanted.div_ceil(ALIGN).saturating_mul(ALIGN).max(ALIGN);
    if limit != 0 && size > limit {
        return Err(Status::out_of_range(format!(
            "{wanted} bytes in whole MiB is {size}, over the limit of {limit}"
        )));
    }
    Ok(size)
}

fn rpc(kind: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(CapType::Rpc(Rpc {
            r#type: kind as i32,
        })),
    }
}

fn check_all(capabilities: &[VolumeCapability]) -> Result<(), Status> {
    if capabilities.is_empty() {
        return Err(Status::invalid_argument("volume capabilities are required"));
    }
    capabilities
        .iter()
        .try_for_each(caps::check)
        .map_err(Status::invalid_argument)
}

impl ControllerService {
    /// Every volume of the array, by name.
    async fn volumes(&self) -> Result<Vec<(String, VolumeInfo)>, Status> {
        self.listed(json!({})).await
    }

    /// The volumes `volume-list` with `args` lists, by name.
    async fn listed(&self, args: Value) -> Result<Vec<(String, VolumeInfo)>, Status> {
        let list = self
            .array
            .call("volume-list", args)
            .await
            .map_err(|e| status(&e, Code::Internal))?;
        Ok(list["volumes"]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(|v| Some((v["volume"].as_str()?.to_string(), volume_info(v))))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// One volume, asked for alone: its answer does not grow with the array.
    async fn volume(&self, name: &str) -> Result<Option<VolumeInfo>, Status> {
        Ok(self
            .listed(json!({ "volume": name }))
            .await?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v))
    }

    /// The volume made for `request`: new, or the one an earlier same request made.
    async fn make(&self, name: &str, request: &CreateVolumeRequest) -> Result<u64, Status> {
        let size = size_for(request.capacity_range.as_ref())?;
        let params = &request.parameters;
        let pool = params
            .get("pool")
            .ok_or_else(|| Status::invalid_argument("the StorageClass names no \"pool\""))?;
        let source = request
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref());
        let clone = match source {
            None => {
                let args =
                    json!({"pool": pool, "name": name, "size": size.to_string(), "save": true});
                let made = self.array.call("volume-create", args).await;
                return made
                    .map(|a| a["size_bytes"].as_u64().unwrap_or(size))
                    .map_err(|e| status(&e, Code::AlreadyExists));
            }
            Some(Source::Snapshot(SnapshotSource { snapshot_id })) => {
                let id = SnapshotId::parse(snapshot_id)
                    .ok_or_else(|| Status::not_found(format!("no snapshot {snapshot_id}")))?;
                json!({"volume": id.volume, "name": name, "snapshot": id.snapshot, "save": true})
            }
            Some(Source::Volume(VolumeSource { volume_id })) => {
                if volume_name(volume_id) != *volume_id {
                    return Err(Status::not_found(format!("no volume {volume_id}")));
                }
                json!({"volume": volume_id, "name": name, "save": true})
            }
        };
        self.array
            .call("volume-clone", clone)
            .await
            .map_err(|e| status(&e, Code::AlreadyExists))?;
        self.grown_to(name, size, request.capacity_range.as_ref())
            .await
    }

    /// A clone has its source's size: grown to `size` when that is more, refused when its
    /// source is over the limit.
    async fn grown_to(
        &self,
        name: &str,
        size: u64,
        range: Option<&CapacityRange>,
    ) -> Result<u64, Status> {
        let now = self
            .volume(name)
            .await?
            .ok_or_else(|| Status::internal(format!("volume {name} made but not listed")))?
            .size;
        let limit = range.map_or(0, |r| r.limit_bytes.max(0) as u64);
        if limit != 0 && now > limit {
            return Err(Status::out_of_range(format!(
                "its source makes it {now} bytes, over the limit of {limit}"
            )));
        }
        if now >= size {
            return Ok(now);
        }
        let args = json!({"device": name, "size": size.to_string(), "save": true});
        self.array
            .call("resize", args)
            .await
            .map_err(|e| status(&e, Code::Internal))?;
        Ok(size)
    }

    /// The name of node `node_id` to export to over `transport`.
    fn initiator(node_id: &str, transport: Transport) -> Result<String, Status> {
        let node = NodeId::parse(node_id)
            .ok_or_else(|| Status::not_found(format!("no node {node_id:?}")))?;
        node.initiator(transport).map(String::from).ok_or_else(|| {
            Status::failed_precondition(format!(
                "node {node_id} has no {} initiator name",
                transport.as_str()
            ))
        })
    }
}

fn transport_of(context: &HashMap<String, String>) -> Result<Transport, Status> {
    match context.get("transport") {
        None => Ok(Transport::Iscsi),
        Some(t) => Transport::parse(t)
            .ok_or_else(|| Status::invalid_argument(format!("transport {t:?}: iscsi or nvme"))),
    }
}

/// What a node needs to reach a volume, from the StorageClass: how, where, on which target.
fn volume_context(params: &HashMap<String, String>) -> Result<HashMap<String, String>, Status> {
    let transport = transport_of(params)?;
    let mut context = HashMap::from([("transport".to_string(), transport.as_str().to_string())]);
    for key in ["portals", "target", "pool"] {
        if let Some(value) = params.get(key) {
            context.insert(key.to_string(), value.clone());
        }
    }
    if !context.contains_key("portals") {
        return Err(Status::invalid_argument(
            "the StorageClass names no \"portals\" (HOST:PORT,… the nodes connect to)",
        ));
    }
    Ok(context)
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let request = request.into_inner();
        let name = volume_name(required(&request.name, "a name")?);
        check_all(&request.volume_capabilities)?;
        let context = volume_context(&request.parameters)?;
        let _hold = self.inflight.begin(&name)?;
        let size = self.make(&name, &request).await?;
        tracing::info!(volume = %name, size, "CreateVolume");
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: size as i64,
                volume_id: name,
                volume_context: context,
                content_source: request.volume_content_source,
                accessible_topology: Vec::new(),
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let id = request.into_inner().volume_id;
        required(&id, "a volume ID")?;
        // An ID this driver never made names no volume: deleted already.
        if volume_name(&id) != id {
            return Ok(Response::new(DeleteVolumeResponse {}));
        }
        let _hold = self.inflight.begin(&id)?;
        self.array
            .call("volume-delete", json!({"volume": id, "save": true}))
            .await
            .map_err(|e| status(&e, Code::FailedPrecondition))?;
        tracing::info!(volume = %id, "DeleteVolume");
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let id = required(&request.volume_id, "a volume ID")?;
        required(&request.node_id, "a node ID")?;
        let capability = caps::given(request.volume_capability.as_ref())?;
        let transport = transport_of(&request.volume_context)?;
        let host = Self::initiator(&request.node_id, transport)?;
        let _hold = self.inflight.begin(id)?;
        // The array decides, in the transaction of the export, whether another node has the
        // volume (`in_use`: FAILED_PRECONDITION); a read-only mismatch is ALREADY_EXISTS.
        let mut args = json!({"volume": id, "initiator": host, "save": true,
                              "read_only": request.readonly || caps::read_only(capability),
                              "exclusive": caps::single_node(capability)});
        if let Some(target) = request.volume_context.get("target") {
            args["target"] = json!(target);
        }
        let answer = self
            .array
            .call("volume-export", args)
            .await
            .map_err(|e| status(&e, Code::AlreadyExists))?;
        let mut context = HashMap::from([("transport".to_string(), transport.as_str().into())]);
        for key in ["target", "nqn", "lun", "naa", "serial"] {
            match &answer[key] {
                Value::String(s) => context.insert(key.into(), s.clone()),
                Value::Number(n) => context.insert(key.into(), n.to_string()),
                _ => None,
            };
        }
        tracing::info!(volume = %id, node = %request.node_id, "ControllerPublishVolume");
        Ok(Response::new(ControllerPublishVolumeResponse {
            publish_context: context,
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let id = required(&request.volume_id, "a volume ID")?;
        if volume_name(id) != id {
            return Ok(Response::new(ControllerUnpublishVolumeResponse {}));
        }
        let _hold = self.inflight.begin(id)?;
        // Both of its names: whichever the volume was published to. No node: from every host.
        let hosts: Vec<String> = match NodeId::parse(&request.node_id) {
            Some(node) => [node.iqn, node.nqn].into_iter().flatten().collect(),
            None if request.node_id.is_empty() => self.hosts_of(id).await?,
            None => Vec::new(),
        };
        for host in hosts {
            let args = json!({"volume": id, "initiator": host, "save": true});
            match self.array.call("volume-unexport", args).await {
                Ok(_) => {}
                Err(e) if e.kind() == "not_found" => {}
                Err(e) => return Err(status(&e, Code::Internal)),
            }
        }
        tracing::info!(volume = %id, node = %request.node_id, "ControllerUnpublishVolume");
        Ok(Response::new(ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let request = request.into_inner();
        let id = required(&request.volume_id, "a volume ID")?;
        if request.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume capabilities are required"));
        }
        if self.volume(id).await?.is_none() {
            return Err(Status::not_found(format!("no volume {id}")));
        }
        let refused = request
            .volume_capabilities
            .iter()
            .find_map(|c| caps::check(c).err());
        let confirmed =
            refused
                .is_none()
                .then(|| validate_volume_capabilities_response::Confirmed {
                    volume_context: request.volume_context.clone(),
                    volume_capabilities: request.volume_capabilities.clone(),
                    parameters: request.parameters.clone(),
                    mutable_parameters: HashMap::new(),
                });
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed,
            message: refused.unwrap_or_default(),
        }))
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let request = request.into_inner();
        let all = self.volumes().await?;
        let (page, next) = page(&all, request.max_entries, &request.starting_token)?;
        let entries = page
            .iter()
            .map(|(name, info)| list_volumes_response::Entry {
                volume: Some(Volume {
                    capacity_bytes: info.size as i64,
                    volume_id: name.clone(),
                    ..Default::default()
                }),
                status: None,
            })
            .collect();
        Ok(Response::new(ListVolumesResponse {
            entries,
            next_token: next,
        }))
    }

    /// The bytes new writes can still take in the StorageClass's pool (`pool-list`), or in
    /// all the array's pools when no pool is named; none for capabilities the driver cannot
    /// give. No largest volume is told: every pool is thin, so a volume may be larger than
    /// what is free.
    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let request = request.into_inner();
        let answer = |bytes: u64| {
            Ok(Response::new(GetCapacityResponse {
                available_capacity: i64::try_from(bytes).unwrap_or(i64::MAX),
                maximum_volume_size: None,
                minimum_volume_size: Some(ALIGN as i64),
            }))
        };
        if request
            .volume_capabilities
            .iter()
            .any(|c| caps::check(c).is_err())
        {
            return answer(0);
        }
        let pool = request.parameters.get("pool");
        let listed = self
            .array
            .call("pool-list", json!({ "pool": pool }))
            .await
            .map_err(|e| status(&e, Code::Internal))?;
        let available = listed["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["available_bytes"].as_u64())
            .fold(0u64, u64::saturating_add);
        answer(available)
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use rpc::Type::*;
        let capabilities = [
            CreateDeleteVolume,
            PublishUnpublishVolume,
            ListVolumes,
            CreateDeleteSnapshot,
            ListSnapshots,
            CloneVolume,
            PublishReadonly,
            ExpandVolume,
            GetCapacity,
        ]
        .into_iter()
        .map(rpc)
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let request = request.into_inner();
        let source = required(&request.source_volume_id, "a source volume ID")?;
        let snap = volume_name(required(&request.name, "a name")?);
        let _hold = self.inflight.begin(&format!("snapshot {snap}"))?;
        // CSI's snapshot names are the array's, ferrosan's are its volume's: a name taken on
        // another volume is another snapshot.
        if let Some(other) = self
            .snapshots()
            .await?
            .into_iter()
            .find(|s| s.id.snapshot == snap && s.id.volume != source)
        {
            return Err(Status::already_exists(format!(
                "snapshot name {} is taken by a snapshot of volume {}",
                request.name, other.id.volume
            )));
        }
        let volume = match volume_name(source) == source {
            true => self.volume(source).await?,
            false => None,
        }
        .ok_or_else(|| Status::not_found(format!("no volume {source}")))?;
        let _volume_hold = self.inflight.begin(source)?;
        self.array
            .call(
                "volume-snapshot",
                json!({"volume": source, "snapshot": snap}),
            )
            .await
            // The name is this volume's (checked above): a conflict is the volume's state.
            .map_err(|e| status(&e, Code::FailedPrecondition))?;
        let id = SnapshotId {
            volume: source.to_string(),
            snapshot: snap,
        };
        let created = self
            .snapshots()
            .await?
            .into_iter()
            .find(|s| s.id == id)
            .and_then(|s| s.created);
        tracing::info!(snapshot = %id, "CreateSnapshot");
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(snapshot(&id, volume.size, created)),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let id = request.into_inner().snapshot_id;
        required(&id, "a snapshot ID")?;
        let Some(id) = SnapshotId::parse(&id) else {
            return Ok(Response::new(DeleteSnapshotResponse {}));
        };
        let _hold = self.inflight.begin(&format!("snapshot {}", id.snapshot))?;
        let args = json!({"volume": id.volume, "snapshot": id.snapshot});
        match self.array.call("snapshot-delete", args).await {
            Ok(_) => {}
            Err(e) if e.kind() == "not_found" => {}
            Err(e) => return Err(status(&e, Code::FailedPrecondition)),
        }
        tracing::info!(snapshot = %id, "DeleteSnapshot");
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let request = request.into_inner();
        let sizes: HashMap<String, u64> = self
            .volumes()
            .await?
            .into_iter()
            .map(|(n, v)| (n, v.size))
            .collect();
        let wanted = |s: &Listed| {
            (request.snapshot_id.is_empty() || s.id.to_string() == request.snapshot_id)
                && (request.source_volume_id.is_empty() || s.id.volume == request.source_volume_id)
        };
        let all: Vec<Listed> = self.snapshots().await?.into_iter().filter(wanted).collect();
        let (page, next) = page(&all, request.max_entries, &request.starting_token)?;
        let entries = page
            .iter()
            .map(|s| list_snapshots_response::Entry {
                snapshot: Some(snapshot(
                    &s.id,
                    sizes.get(&s.id.volume).copied().unwrap_or(0),
                    s.created.clone(),
                )),
            })
            .collect();
        Ok(Response::new(ListSnapshotsResponse {
            entries,
            next_token: next,
        }))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let request = request.into_inner();
        let id = required(&request.volume_id, "a volume ID")?;
        let range = request
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("a capacity range is required"))?;
        let size = size_for(Some(range))?;
        let _hold = self.inflight.begin(id)?;
        let now = self
            .volume(id)
            .await?
            .ok_or_else(|| Status::not_found(format!("no volume {id}")))?
            .size;
        if size > now {
            let args = json!({"device": id, "size": size.to_string(), "save": true});
            self.array
                .call("resize", args)
                .await
                .map_err(|e| status(&e, Code::Internal))?;
        }
        let block = matches!(
            request
                .volume_capability
                .as_ref()
                .and_then(|c| c.access_type.as_ref()),
            Some(volume_capability::AccessType::Block(_))
        );
        tracing::info!(volume = %id, size = size.max(now), "ControllerExpandVolume");
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: size.max(now) as i64,
            node_expansion_required: !block,
        }))
    }

    async fn controller_get_volume(
        &self,
        _request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        Err(Status::unimplemented("ControllerGetVolume is not offered"))
    }

    async fn controller_modify_volume(
        &self,
        _request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerModifyVolume is not offered",
        ))
    }
}

/// One snapshot as `snapshot-list` gives it.
struct Listed {
    id: SnapshotId,
    created: Option<String>,
}

impl ControllerService {
    async fn snapshots(&self) -> Result<Vec<Listed>, Status> {
        let list = self
            .array
            .call("snapshot-list", json!({}))
            .await
            .map_err(|e| status(&e, Code::Internal))?;
        Ok(list["snapshots"]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(|s| {
                        Some(Listed {
                            id: SnapshotId {
                                volume: s["volume"].as_str()?.to_string(),
                                snapshot: s["snapshot"].as_str()?.to_string(),
                            },
                            created: s["created"].as_str().map(String::from),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Every host a volume is exported to by name.
    async fn hosts_of(&self, id: &str) -> Result<Vec<String>, Status> {
        Ok(self
            .volume(id)
            .await?
            .map(|v| v.exports.into_iter().flatten().flatten().collect())
            .unwrap_or_default())
    }
}

fn snapshot(id: &SnapshotId, size: u64, created: Option<String>) -> Snapshot {
    let creation_time = created
        .as_deref()
        .and_then(|t| t.parse::<prost_types::Timestamp>().ok());
    Snapshot {
        size_bytes: size as i64,
        snapshot_id: id.to_string(),
        source_volume_id: id.volume.clone(),
        creation_time,
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

/// One page of `all` from `token` (an index this driver gave), at most `max` (0: all) long;
/// the next page's token. A token it did not give is ABORTED, as CSI asks.
fn page<'a, T>(all: &'a [T], max: i32, token: &str) -> Result<(&'a [T], String), Status> {
    if max < 0 {
        return Err(Status::invalid_argument("max_entries is negative"));
    }
    let start = match token {
        "" => 0,
        t => t
            .parse::<usize>()
            .ok()
            .filter(|s| *s <= all.len())
            .ok_or_else(|| Status::aborted(format!("starting token {t:?} is not one of ours")))?,
    };
    let end = match max {
        0 => all.len(),
        m => all.len().min(start + m as usize),
    };
    let next = if end < all.len() {
        end.to_string()
    } else {
        String::new()
    };
    Ok((&all[start..end], next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_whole_mib_within_the_limit() {
        let range = |required, limit| CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&range(1, 0))).unwrap(), ALIGN);
        assert_eq!(size_for(Some(&range(0, 10 << 20))).unwrap(), 10 << 20);
        assert_eq!(size_for(Some(&range((5 << 20) + 1, 0))).unwrap(), 6 << 20);
        let over = size_for(Some(&range((5 << 20) + 1, 5 << 20))).unwrap_err();
        assert_eq!(over.code(), Code::OutOfRange);
        assert_eq!(
            size_for(Some(&range(-1, 0))).unwrap_err().code(),
            Code::InvalidArgument
        );
    }

    #[test]
    fn pages_follow_their_tokens_and_refuse_a_foreign_one() {
        let all: Vec<u32> = (0..5).collect();
        let (first, next) = page(&all, 2, "").unwrap();
        assert_eq!((first, next.as_str()), (&[0, 1][..], "2"));
        let (second, next) = page(&all, 2, &next).unwrap();
        assert_eq!((second, next.as_str()), (&[2, 3][..], "4"));
        let (last, next) = page(&all, 2, &next).unwrap();
        assert_eq!((last, next.as_str()), (&[4][..], ""));
        assert_eq!(page(&all, 0, "").unwrap().0.len(), 5);
        assert_eq!(page(&all, 1, "x").unwrap_err().code(), Code::Aborted);
        assert_eq!(page(&all, 1, "6").unwrap_err().code(), Code::Aborted);
    }
}
