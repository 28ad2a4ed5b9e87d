//! `ferrosan-csi`: the CSI driver's one binary. `--mode controller` (one replica, with the
//! provisioner, attacher, resizer and snapshotter sidecars) drives the array through its
//! remote API; `--mode node` (a DaemonSet, privileged) connects, formats and mounts volumes
//! on its node. Both serve gRPC on a Unix socket (`--endpoint`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use bpfman_csi::v1::controller_server::ControllerServer;
use bpfman_csi::v1::identity_server::IdentityServer;
use bpfman_csi::v1::node_server::NodeServer;
use clap::{Parser, ValueEnum};
use ferrosan_csi::array::Array;
use ferrosan_csi::controller::ControllerService;
use ferrosan_csi::host::System;
use ferrosan_csi::identity::IdentityService;
use ferrosan_csi::inflight::InFlight;
use ferrosan_csi::node::NodeService;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Controller,
    Node,
}

#[derive(Parser)]
#[command(version, about = "ferrosan's CSI driver (docs/guides/kubernetes.md)")]
struct Args {
    /// Which services to run.
    #[arg(long, value_enum)]
    mode: Mode,
    /// The gRPC socket: a path, or unix:///path as the sidecars write it.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Controller: the array's remote API (https://HOST:PORT).
    #[arg(long, required_if_eq("mode", "controller"))]
    api_url: Option<String>,
    /// Controller: a file holding an admin token of the array (`ferrosan ctl token create`).
    #[arg(long)]
    api_token_file: Option<PathBuf>,
    /// Controller: a client certificate (PEM) instead of a token, from a CA of the array's
    /// `api_client_ca`, its common name an admin token's name.
    #[arg(long, requires = "api_key_file")]
    api_cert_file: Option<PathBuf>,
    /// Controller: the client certificate's private key (PEM, PKCS#8).
    #[arg(long, requires = "api_cert_file")]
    api_key_file: Option<PathBuf>,
    /// Controller: the API's certificate to trust (its self-signed api-cert.pem); the
    /// system's roots otherwise.
    #[arg(long)]
    api_ca_file: Option<PathBuf>,
    /// Node: its iSCSI initiator name and NVMe host NQN, as the node ID
    /// (default: from /etc/iscsi/initiatorname.iscsi and /etc/nvme/hostnqn).
    #[arg(long)]
    node_id: Option<String>,
    /// Node: where it records what it staged (a host path that outlives the driver's pod).
    #[arg(long, default_value = "/var/lib/ferrosan-csi")]
    state_dir: PathBuf,
}

fn socket_path(endpoint: &str) -> &Path {
    Path::new(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

async fn serve(args: Args) -> Result<(), String> {
    let path = socket_path(&args.endpoint);
    // A socket left by the previous run of this driver (its pod restarted).
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    let listener = UnixListener::bind(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let incoming = UnixListenerStream::new(listener);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let router = match args.mode {
        Mode::Controller => {
            let credentials = client::Credentials {
                token_file: args.api_token_file.as_deref(),
                certificate: (args.api_cert_file.as_deref()).zip(args.api_key_file.as_deref()),
            };
            let Some(url) = args.api_url.as_deref() else {
                return Err("--mode controller needs --api-url".into());
            };
            let remote = client::Remote::new(url, &credentials, args.api_ca_file.as_deref())
                .map_err(|e| e.to_string())?;
            let array = Array::new(Arc::new(remote));
            tonic::transport::Server::builder()
                .add_service(IdentityServer::new(IdentityService {
                    array: Some(array.clone()),
                }))
                .add_service(ControllerServer::new(ControllerService {
                    array,
                    inflight: InFlight::default(),
                }))
        }
        Mode::Node => {
            let node = NodeService::new(Arc::new(System), args.node_id.as_deref(), args.state_dir)?;
            tracing::info!(node_id = %node.node_id(), "node service");
            tonic::transport::Server::builder()
                .add_service(IdentityServer::new(IdentityService { array: None }))
                .add_service(NodeServer::new(node))
        }
    };
    tracing::info!(endpoint = %path.display(), "serving CSI");
    router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ferrosan-csi: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrosan-csi: {e}");
            ExitCode::FAILURE
        }
    }
}
