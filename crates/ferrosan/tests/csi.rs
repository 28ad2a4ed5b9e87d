//! The CSI driver's Identity and Controller services against a running array, over gRPC on a
//! Unix socket as the Kubernetes sidecars call them: the cases of kubernetes-csi's csi-sanity
//! for every controller capability the driver advertises (idempotent repeats, ALREADY_EXISTS
//! for an incompatible repeat, NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, ABORTED page
//! tokens), written as a gRPC client since the Go tool cannot be fetched here.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use bpfman_csi::v1::controller_client::ControllerClient;
use bpfman_csi::v1::controller_server::ControllerServer;
use bpfman_csi::v1::controller_service_capability::{rpc, Type as CapType};
use bpfman_csi::v1::identity_client::IdentityClient;
use bpfman_csi::v1::identity_server::IdentityServer;
use bpfman_csi::v1::volume_capability::access_mode::Mode;
use bpfman_csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use bpfman_csi::v1::volume_content_source::{SnapshotSource, Type as Source, VolumeSource};
use bpfman_csi::v1::*;
use common::{api_array_config, free_port, Ctl, Daemon, Scratch};
use ferrosan_csi::array::Array;
use ferrosan_csi::controller::ControllerService;
use ferrosan_csi::identity::{IdentityService, DRIVER_NAME};
use ferrosan_csi::inflight::InFlight;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;

const IQN: &str = "iqn.2026-12.test:csi";
const NQN: &str = "nqn.2026-12.test:csi";
const NODE1: &str = "iqn.2026-12.test:node1,nqn.2026-12.test:node1";
const NODE2: &str = "iqn.2026-12.test:node2";
const MIB: i64 = 1 << 20;

/// The array (a directory pool, the API on loopback) and the driver's controller on a socket.
struct Csi {
    _daemon: Daemon,
    dir: Scratch,
    channel: Channel,
}

fn array(dir: &Scratch) -> (Daemon, String, PathBuf, PathBuf) {
    let ctl = Ctl::new();
    let (port, api_port) = (free_port(), free_port());
    let state = dir.file("state");
    let mut text = api_array_config("k8s", &dir.file("pool"), api_port, &state, &ctl, port);
    text.push_str(&format!(
        r#"
[[device]]
name = "admin"
store = "ram"
size = "1M"

[[target]]
iqn = "{IQN}"
nqn = "{NQN}"
  [[target.group]]
  name = "admin"
  initiators = ["iqn.2026-12.test:admin"]
  luns = [ {{ lun = 0, device = "admin" }} ]
"#
    ));
    let daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let made = ctl.json(&["token", "create", "csi", "--role", "admin"]);
    assert_eq!(made["ok"], true, "{made}");
    let token = dir.file("token");
    std::fs::write(&token, made["token"].as_str().unwrap()).unwrap();
    let url = format!("https://127.0.0.1:{api_port}");
    (daemon, url, token, state.join("api-cert.pem"))
}

async fn start() -> Csi {
    let dir = Scratch::new("csi");
    std::fs::create_dir_all(dir.file("pool")).unwrap();
    let (daemon, url, token, ca) = array(&dir);
    let remote = client::Remote::new(
        &url,
        &client::Credentials {
            token_file: Some(&token),
            certificate: None,
        },
        Some(&ca),
    )
    .unwrap();
    let array = Array::new(Arc::new(remote));
    let socket = dir.file("csi.sock");
    let incoming = UnixListenerStream::new(UnixListener::bind(&socket).unwrap());
    let server = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService {
            array: Some(array.clone()),
        }))
        .add_service(ControllerServer::new(ControllerService {
            array,
            inflight: InFlight::default(),
        }))
        .serve_with_incoming(incoming);
    tokio::spawn(server);
    let channel = Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            UnixStream::connect(socket.clone())
        }))
        .await
        .unwrap();
    Csi {
        _daemon: daemon,
        dir,
        channel,
    }
}

impl Csi {
    fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
    }
}

fn mount(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

fn block(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn params() -> HashMap<String, String> {
    HashMap::from([
        ("pool".into(), "k8s".into()),
        ("portals".into(), "127.0.0.1:3260".into()),
    ])
}

fn create(name: &str, bytes: i64) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount(Mode::SingleNodeWriter)],
        parameters: params(),
        ..Default::default()
    }
}

fn code<T>(result: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_says_who_it_is_what_it_offers_and_that_it_is_ready() {
    let csi = start().await;
    let mut identity = IdentityClient::new(csi.channel.clone());
    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, DRIVER_NAME);
    assert!(!info.vendor_version.is_empty());
    let caps = identity
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 2, "{caps:?}");
    let probe = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    let offered: Vec<i32> = csi
        .controller()
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| c.r#type.map(|CapType::Rpc(r)| r.r#type))
        .collect();
    for wanted in [
        rpc::Type::CreateDeleteVolume,
        rpc::Type::PublishUnpublishVolume,
        rpc::Type::ListVolumes,
        rpc::Type::CreateDeleteSnapshot,
        rpc::Type::ListSnapshots,
        rpc::Type::CloneVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::GetCapacity,
    ] {
        assert!(offered.contains(&(wanted as i32)), "{wanted:?} not offered");
    }
}

/// df's (size, available) bytes of the filesystem holding `path`.
fn df(path: &std::path::Path) -> (i64, i64) {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=size,avail"])
        .arg(path)
        .output()
        .expect("df");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().nth(1).expect("df's numbers");
    let n: Vec<i64> = line
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    (n[0], n[1])
}

/// GetCapacity answers the pool's free space as its filesystem counts it (other tests write
/// to the same filesystem meanwhile, hence the margin, far below a unit's mistake), the sum
/// of every pool's without a StorageClass, NOT_FOUND for a pool the array lacks and nothing
/// for capabilities no volume can have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_the_pools_free_space() {
    let csi = start().await;
    let mut c = csi.controller();
    let asked =
        |parameters: HashMap<String, String>, caps: Vec<VolumeCapability>| GetCapacityRequest {
            volume_capabilities: caps,
            parameters,
            accessible_topology: None,
        };
    let pool = csi.dir.file("pool");
    let told = c
        .get_capacity(asked(params(), vec![mount(Mode::SingleNodeWriter)]))
        .await
        .unwrap()
        .into_inner();
    let (size, avail) = df(&pool);
    let margin = 512 * MIB;
    assert!(
        (told.available_capacity - avail).abs() < margin && told.available_capacity <= size,
        "told {told:?}, df: {avail} of {size}"
    );
    assert_eq!(told.maximum_volume_size, None, "every pool is thin");
    assert_eq!(told.minimum_volume_size, Some(MIB));
    let all = c
        .get_capacity(asked(HashMap::new(), Vec::new()))
        .await
        .unwrap()
        .into_inner();
    assert!(
        (all.available_capacity - told.available_capacity).abs() < margin,
        "one pool: {all:?} {told:?}"
    );
    let mut elsewhere = params();
    elsewhere.insert("pool".into(), "nowhere".into());
    assert_eq!(
        code(c.get_capacity(asked(elsewhere, Vec::new())).await),
        Code::NotFound
    );
    let shared_fs = mount(Mode::MultiNodeMultiWriter);
    let none = c.get_capacity(asked(params(), vec![shared_fs])).await;
    assert_eq!(none.unwrap().into_inner().available_capacity, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_made_repeated_listed_grown_and_deleted_as_csi_says() {
    let csi = start().await;
    let mut c = csi.controller();
    let mut nameless = create("", 8 * MIB);
    assert_eq!(
        code(c.create_volume(nameless.clone()).await),
        Code::InvalidArgument
    );
    nameless.name = "vol-nocaps".into();
    nameless.volume_capabilities.clear();
    assert_eq!(code(c.create_volume(nameless).await), Code::InvalidArgument);
    let mut poolless = create("vol-nopool", 8 * MIB);
    poolless.parameters.remove("pool");
    assert_eq!(code(c.create_volume(poolless).await), Code::InvalidArgument);

    let made = c
        .create_volume(create("pvc-1", 8 * MIB))
        .await
        .unwrap()
        .into_inner();
    let volume = made.volume.unwrap();
    assert_eq!(
        (volume.volume_id.as_str(), volume.capacity_bytes),
        ("pvc-1", 8 * MIB)
    );
    assert_eq!(volume.volume_context["transport"], "iscsi");
    let again = c
        .create_volume(create("pvc-1", 8 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.volume.unwrap().volume_id, "pvc-1");
    assert_eq!(
        code(c.create_volume(create("pvc-1", 16 * MIB)).await),
        Code::AlreadyExists
    );
    // A name the array would not take maps to one it does, the same each time.
    let odd = c
        .create_volume(create("sanity volume 1/2", MIB))
        .await
        .unwrap()
        .into_inner();
    let odd_id = odd.volume.unwrap().volume_id;
    assert!(odd_id.starts_with("csi-"), "{odd_id}");
    let odd_again = c
        .create_volume(create("sanity volume 1/2", MIB))
        .await
        .unwrap();
    assert_eq!(odd_again.into_inner().volume.unwrap().volume_id, odd_id);

    let listed = c
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 2);
    let first = c
        .list_volumes(ListVolumesRequest {
            max_entries: 1,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((first.entries.len(), first.next_token.as_str()), (1, "1"));
    let rest = c
        .list_volumes(ListVolumesRequest {
            max_entries: 1,
            starting_token: first.next_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((rest.entries.len(), rest.next_token.as_str()), (1, ""));
    let foreign = ListVolumesRequest {
        max_entries: 1,
        starting_token: "x".into(),
    };
    assert_eq!(code(c.list_volumes(foreign).await), Code::Aborted);

    let validate = |id: &str, caps: Vec<VolumeCapability>| ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: caps,
        ..Default::default()
    };
    let ok = c.validate_volume_capabilities(validate("pvc-1", vec![mount(Mode::SingleNodeWriter)]));
    assert!(ok.await.unwrap().into_inner().confirmed.is_some());
    let shared_fs = validate("pvc-1", vec![mount(Mode::MultiNodeMultiWriter)]);
    let refused = c
        .validate_volume_capabilities(shared_fs)
        .await
        .unwrap()
        .into_inner();
    assert!(refused.confirmed.is_none() && !refused.message.is_empty());
    let missing = validate("pvc-none", vec![mount(Mode::SingleNodeWriter)]);
    assert_eq!(
        code(c.validate_volume_capabilities(missing).await),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.validate_volume_capabilities(validate("pvc-1", vec![]))
                .await
        ),
        Code::InvalidArgument
    );

    let grow = |id: &str, bytes| ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capability: Some(mount(Mode::SingleNodeWriter)),
        ..Default::default()
    };
    let grown = c
        .controller_expand_volume(grow("pvc-1", 12 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (grown.capacity_bytes, grown.node_expansion_required),
        (12 * MIB, true)
    );
    let listed = c
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let size = listed
        .entries
        .iter()
        .find_map(|e| e.volume.as_ref().filter(|v| v.volume_id == "pvc-1"));
    assert_eq!(
        size.map(|v| v.capacity_bytes),
        Some(12 * MIB),
        "the array's size"
    );
    assert_eq!(
        code(c.controller_expand_volume(grow("pvc-none", 12 * MIB)).await),
        Code::NotFound
    );
    let mut rangeless = grow("pvc-1", 0);
    rangeless.capacity_range = None;
    assert_eq!(
        code(c.controller_expand_volume(rangeless).await),
        Code::InvalidArgument
    );

    let delete = |id: &str| DeleteVolumeRequest {
        volume_id: id.into(),
        ..Default::default()
    };
    assert_eq!(code(c.delete_volume(delete("pvc-1")).await), Code::Ok);
    assert_eq!(
        code(c.delete_volume(delete("pvc-1")).await),
        Code::Ok,
        "a repeat"
    );
    assert_eq!(
        code(c.delete_volume(delete("not/ours")).await),
        Code::Ok,
        "never made"
    );
    assert_eq!(
        code(c.delete_volume(delete("")).await),
        Code::InvalidArgument
    );
    let left = c
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(left.entries.len(), 1);
}

fn publish(id: &str, node: &str, capability: VolumeCapability) -> ControllerPublishVolumeRequest {
    ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(capability),
        volume_context: HashMap::from([("transport".into(), "iscsi".into())]),
        ..Default::default()
    }
}

fn unpublish(id: &str, node: &str) -> ControllerUnpublishVolumeRequest {
    ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_published_to_one_node_and_refused_to_a_second() {
    let csi = start().await;
    let mut c = csi.controller();
    c.create_volume(create("pvc-pub", 8 * MIB)).await.unwrap();
    let rw = mount(Mode::SingleNodeWriter);
    assert_eq!(
        code(
            c.controller_publish_volume(publish("pvc-pub", "", rw.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.controller_publish_volume(publish("", NODE1, rw.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    let mut capless = publish("pvc-pub", NODE1, rw.clone());
    capless.volume_capability = None;
    assert_eq!(
        code(c.controller_publish_volume(capless).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.controller_publish_volume(publish("pvc-none", NODE1, rw.clone()))
                .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.controller_publish_volume(publish("pvc-pub", "no-such-node", rw.clone()))
                .await
        ),
        Code::NotFound
    );

    let context = c
        .controller_publish_volume(publish("pvc-pub", NODE1, rw.clone()))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(context["target"], IQN);
    assert_eq!(context["nqn"], NQN);
    assert_eq!(context["lun"], "0");
    assert_eq!(context["naa"].len(), 16, "an 8-byte NAA: {context:?}");
    let again = c
        .controller_publish_volume(publish("pvc-pub", NODE1, rw.clone()))
        .await;
    assert_eq!(
        again.unwrap().into_inner().publish_context,
        context,
        "a repeat"
    );
    let mut read_only = publish("pvc-pub", NODE1, rw.clone());
    read_only.readonly = true;
    assert_eq!(
        code(c.controller_publish_volume(read_only).await),
        Code::AlreadyExists
    );
    assert_eq!(
        code(
            c.controller_publish_volume(publish("pvc-pub", NODE2, rw.clone()))
                .await
        ),
        Code::FailedPrecondition
    );
    // Over NVMe/TCP the node's NQN is the host: NODE2 has none.
    let mut nvme = publish("pvc-pub", NODE2, block(Mode::MultiNodeMultiWriter));
    nvme.volume_context
        .insert("transport".into(), "nvme".into());
    assert_eq!(
        code(c.controller_publish_volume(nvme).await),
        Code::FailedPrecondition
    );
    // A block volume every node may write is given to a second node.
    let shared =
        c.controller_publish_volume(publish("pvc-pub", NODE2, block(Mode::MultiNodeMultiWriter)));
    assert_eq!(
        shared.await.unwrap().into_inner().publish_context["lun"],
        "0"
    );

    let delete = DeleteVolumeRequest {
        volume_id: "pvc-pub".into(),
        ..Default::default()
    };
    assert_eq!(
        code(c.delete_volume(delete.clone()).await),
        Code::FailedPrecondition,
        "published"
    );
    assert_eq!(
        code(
            c.controller_unpublish_volume(unpublish("pvc-pub", NODE1))
                .await
        ),
        Code::Ok
    );
    assert_eq!(
        code(
            c.controller_unpublish_volume(unpublish("pvc-pub", NODE1))
                .await
        ),
        Code::Ok,
        "a repeat"
    );
    assert_eq!(
        code(
            c.controller_unpublish_volume(unpublish("pvc-none", NODE1))
                .await
        ),
        Code::Ok
    );
    // Once node 1 has let it go, node 2 may have it alone.
    assert_eq!(
        code(
            c.controller_unpublish_volume(unpublish("pvc-pub", ""))
                .await
        ),
        Code::Ok,
        "from all"
    );
    let alone = c
        .controller_publish_volume(publish("pvc-pub", NODE2, rw.clone()))
        .await;
    assert_eq!(code(alone), Code::Ok);
    c.controller_unpublish_volume(unpublish("pvc-pub", NODE2))
        .await
        .unwrap();
    assert_eq!(code(c.delete_volume(delete).await), Code::Ok);
}

fn snapshot(name: &str, source: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_taken_listed_restored_and_deleted_as_csi_says() {
    let csi = start().await;
    let mut c = csi.controller();
    c.create_volume(create("pvc-src", 8 * MIB)).await.unwrap();
    c.create_volume(create("pvc-other", 8 * MIB)).await.unwrap();
    assert_eq!(
        code(c.create_snapshot(snapshot("", "pvc-src")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.create_snapshot(snapshot("snap-1", "")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.create_snapshot(snapshot("snap-1", "pvc-none")).await),
        Code::NotFound
    );

    let taken = c
        .create_snapshot(snapshot("snap-1", "pvc-src"))
        .await
        .unwrap()
        .into_inner();
    let snap = taken.snapshot.unwrap();
    assert_eq!(snap.snapshot_id, "pvc-src@snap-1");
    assert_eq!(
        (
            snap.source_volume_id.as_str(),
            snap.size_bytes,
            snap.ready_to_use
        ),
        ("pvc-src", 8 * MIB, true)
    );
    assert!(snap.creation_time.is_some());
    let again = c
        .create_snapshot(snapshot("snap-1", "pvc-src"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.snapshot.unwrap().snapshot_id,
        snap.snapshot_id,
        "a repeat"
    );
    assert_eq!(
        code(c.create_snapshot(snapshot("snap-1", "pvc-other")).await),
        Code::AlreadyExists
    );
    c.create_snapshot(snapshot("snap-2", "pvc-src"))
        .await
        .unwrap();

    let list = |req: ListSnapshotsRequest| {
        let mut c = c.clone();
        async move { c.list_snapshots(req).await.map(|r| r.into_inner()) }
    };
    assert_eq!(
        list(ListSnapshotsRequest::default())
            .await
            .unwrap()
            .entries
            .len(),
        2
    );
    let by_id = ListSnapshotsRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    };
    assert_eq!(list(by_id).await.unwrap().entries.len(), 1);
    let by_source = ListSnapshotsRequest {
        source_volume_id: "pvc-other".into(),
        ..Default::default()
    };
    assert_eq!(list(by_source).await.unwrap().entries.len(), 0);
    let page = list(ListSnapshotsRequest {
        max_entries: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!((page.entries.len(), page.next_token.as_str()), (1, "1"));
    let foreign = ListSnapshotsRequest {
        starting_token: "9".into(),
        ..Default::default()
    };
    assert_eq!(list(foreign).await.unwrap_err().code(), Code::Aborted);

    // Restored into a new volume, bigger than the snapshot; cloned from a volume.
    let mut restore = create("pvc-restored", 16 * MIB);
    restore.volume_content_source = Some(VolumeContentSource {
        r#type: Some(Source::Snapshot(SnapshotSource {
            snapshot_id: snap.snapshot_id.clone(),
        })),
    });
    let restored = c
        .create_volume(restore.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(restored.capacity_bytes, 16 * MIB);
    assert!(restored.content_source.is_some());
    assert_eq!(code(c.create_volume(restore).await), Code::Ok, "a repeat");
    let mut clone = create("pvc-clone", 8 * MIB);
    clone.volume_content_source = Some(VolumeContentSource {
        r#type: Some(Source::Volume(VolumeSource {
            volume_id: "pvc-src".into(),
        })),
    });
    assert_eq!(code(c.create_volume(clone).await), Code::Ok);
    let mut gone = create("pvc-from-nothing", 8 * MIB);
    gone.volume_content_source = Some(VolumeContentSource {
        r#type: Some(Source::Snapshot(SnapshotSource {
            snapshot_id: "pvc-src@nope".into(),
        })),
    });
    assert_eq!(code(c.create_volume(gone).await), Code::NotFound);

    let delete_volume = DeleteVolumeRequest {
        volume_id: "pvc-src".into(),
        ..Default::default()
    };
    assert_eq!(
        code(c.delete_volume(delete_volume.clone()).await),
        Code::FailedPrecondition,
        "it has snapshots"
    );
    for id in [
        "pvc-src@snap-1",
        "pvc-src@snap-2",
        "pvc-src@snap-2",
        "never-made",
        "pvc-none@x",
    ] {
        let request = DeleteSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        assert_eq!(code(c.delete_snapshot(request).await), Code::Ok, "{id}");
    }
    let empty = DeleteSnapshotRequest::default();
    assert_eq!(code(c.delete_snapshot(empty).await), Code::InvalidArgument);
    assert_eq!(code(c.delete_volume(delete_volume).await), Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_create_sent_eight_times_at_once_makes_one_volume() {
    let csi = start().await;
    let calls = (0..8).map(|_| {
        let mut c = csi.controller();
        tokio::spawn(async move { code(c.create_volume(create("pvc-race", 8 * MIB)).await) })
    });
    let mut codes = Vec::new();
    for call in calls {
        codes.push(call.await.unwrap());
    }
    // Each is done or told another is in flight (the CO retries those); none fails.
    assert!(
        codes.iter().all(|c| matches!(c, Code::Ok | Code::Aborted)),
        "{codes:?}"
    );
    assert!(codes.contains(&Code::Ok));
    let mut c = csi.controller();
    assert_eq!(
        code(c.create_volume(create("pvc-race", 8 * MIB)).await),
        Code::Ok
    );
    let listed = c
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
}
