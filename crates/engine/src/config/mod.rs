//! The configuration model of the target: what `serve` runs and `check-config` checks.
//!
//! Three ways lead to a validated [`Config`]: [`Config::demo`], [`Config::from_cli`] (quick
//! exports) and [`Config::from_toml_str`] / [`Config::load`] (the declarative file described in
//! docs/CONFIG.md). Every field of a `Config` is resolved (defaults applied, identities derived)
//! and validated, so the engine never re-checks it.

mod auth;
mod cli;
mod cx;
mod delta;
mod devices;
pub mod edit;
mod file;
mod names;
mod pools;
pub mod reread;
mod source;
mod store_kind;
#[cfg(test)]
mod tests;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use auth::SourceNet;
pub(crate) use delta::common_prefix;
pub use file::{alua_state_name, configured_alua_state};
pub use iscsi::chap::{Algorithm as ChapAlgorithm, Secret};
pub use names::{
    check_iscsi_name, check_lvm_lv_name, check_lvm_vg_name, check_object_name, check_path_text,
    check_rbd_pool_name, is_valid_iscsi_name, parse_listen, parse_nvme_discovery_listen,
    parse_nvme_listen, parse_size, portals_overlap, size_text, ISCSI_NAME_BYTES_MAX,
    ISCSI_PORT_DEFAULT, NVME_DISCOVERY_PORT, NVME_PORT_DEFAULT,
};
pub use seam::name::NodeName;
pub use source::{ConfigSource, LoadError, Unsaved};
pub use store_kind::StoreKind;

/// The target IQN of the demo and of quick exports that name none.
pub const DEMO_TARGET_IQN: &str = "iqn.2026-11.org.ferrosan:demo";

/// The largest config file [`Config::load`] reads, in bytes.
pub const CONFIG_FILE_BYTES_MAX: u64 = 4 * 1024 * 1024;
/// Largest RAM LUN. RAM LUNs allocate lazily, but their chunk index (24 bytes per MiB) is built
/// up front: 16 TiB costs a 384 MiB index; beyond, a typo like `16P` would exhaust memory.
pub const RAM_SIZE_BYTES_MAX: u64 = 16 << 40;

/// The most RBD gateways a config may name: each gives its own share of the NVMe controller
/// IDs (and TSIHs), 2047 of them (`topology::gateway::Gateways::session_ids`).
pub const GATEWAYS_MAX: usize = 32;

/// The file name used in errors about command-line arguments.
pub const COMMAND_LINE: &str = "<command line>";

/// A resolved, validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub server: ServerConfig,
    pub limits: Limits,
    pub portal_groups: Vec<PortalGroup>,
    /// Where volumes live (`ferrosan ctl volume`): each volume is a device of its pool.
    pub pools: Vec<PoolConfig>,
    /// Shared between the configs a change makes: copying a config of thousands of
    /// devices copies pointers, and comparing two finds the same ones at once.
    pub devices: Vec<std::sync::Arc<DeviceConfig>>,
    /// Shared as `devices` are: a change copies and compares the targets it did not touch
    /// (a LUN map of thousands) by pointer.
    pub targets: Vec<std::sync::Arc<TargetConfig>>,
    /// Authentication of discovery sessions.
    pub discovery: DiscoveryConfig,
}

/// A `[[pool]]`: where volumes live (`ctl volume`, docs/VOLUMES.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    pub name: String,
    pub kind: PoolKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolKind {
    /// A directory whose files are volumes (`NAME.img`) and whose `.snapshots/` holds their
    /// snapshots (`VOLUME@SNAPSHOT.img`), cloned by reflink where the filesystem can (XFS,
    /// btrfs), copied where it cannot. `path` is absolute.
    Dir { path: PathBuf },
    /// A Ceph pool whose images are volumes, snapshotted and cloned by librbd.
    Rbd {
        pool: String,
        conf: Option<PathBuf>,
        client: Option<String>,
    },
    /// An LVM thin pool `VG/POOL` whose thin LVs are volumes (`/dev/VG/NAME`), snapshotted
    /// and cloned by LVM's thin snapshots (`store::lvm`).
    Lvm(store::lvm::ThinPool),
}

impl PoolConfig {
    /// A directory pool's directory.
    pub fn dir(&self) -> Option<&Path> {
        match &self.kind {
            PoolKind::Dir { path } => Some(path),
            PoolKind::Rbd { .. } | PoolKind::Lvm(_) => None,
        }
    }
    /// An LVM pool's thin pool.
    pub fn thin(&self) -> Option<&store::lvm::ThinPool> {
        match &self.kind {
            PoolKind::Lvm(thin) => Some(thin),
            PoolKind::Dir { .. } | PoolKind::Rbd { .. } => None,
        }
    }

    /// Where volume `name` of a directory pool lives (`store::dir_pool` names it).
    pub fn volume_path(&self, name: &str) -> Option<PathBuf> {
        Some(store::dir_pool::DirPool::new(self.dir()?).volume_path(name))
    }
    /// The RBD image volume `name` of an RBD pool is.
    pub fn image(&self, name: &str) -> Option<store::RbdSpec> {
        match &self.kind {
            PoolKind::Rbd { pool, conf, client } => Some(store::RbdSpec {
                pool: pool.clone(),
                image: name.to_string(),
                conf: conf.clone(),
                client: client.clone(),
            }),
            PoolKind::Dir { .. } | PoolKind::Lvm(_) => None,
        }
    }
}

impl Config {
    /// The pool a device is a volume of (its file lies in the pool's directory as NAME.img).
    pub fn pool_of(&self, device: &DeviceConfig) -> Option<&PoolConfig> {
        self.pools.iter().find(|p| match &device.store {
            StoreKind::File { path, .. } => Some(path) == p.volume_path(&device.name).as_ref(),
            StoreKind::Block { path } => p
                .thin()
                .is_some_and(|t| t.device_path(&device.name) == *path),
            StoreKind::Rbd(spec) => p.image(&device.name).as_ref() == Some(spec),
            _ => false,
        })
    }
}

/// Process-wide settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Worker threads; 0 means one per core (the engine picks).
    pub workers: usize,
    /// CHAP algorithms accepted, in order of preference (never empty).
    pub chap_algorithms: Vec<ChapAlgorithm>,
    /// NVMe in-band authentication (DH-HMAC-CHAP): hashes and DH groups, in order of
    /// preference.
    pub dhchap: nvme::auth::controller::Policy,
    /// Where `/metrics` (Prometheus text format) is served; None = not served.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Direct-I/O devices are submitted to io_uring rings on the workers; false (or a kernel
    /// or sandbox without io_uring) runs them on the bounded I/O thread pool instead.
    pub io_uring: bool,
    /// Where state that survives a restart is kept (persistent reservations with APTPL);
    /// None: `/var/lib/ferrosan` for root, else `$XDG_STATE_HOME/ferrosan` (see `state.rs`).
    pub state_dir: Option<std::path::PathBuf>,
    /// The control socket of `ferrosan ctl`; None: `/run/ferrosan/control.sock` for root, else
    /// `$XDG_RUNTIME_DIR/ferrosan/control.sock` (see `control/mod.rs`).
    pub control_socket: Option<std::path::PathBuf>,
    /// A group whose members may use the control socket too (mode 0660); None: owner only.
    pub control_socket_group: Option<String>,
    /// Which gateway this daemon is, where portal groups name gateways (RBD gateways sharing
    /// one config): it listens on its own portal groups only and reports the others' as the
    /// other target port groups. `serve --gateway` overrides it.
    pub gateway: Option<String>,
    /// Gateways that do not own an RBD image refuse what needs its medium (standby) instead
    /// of shipping it to the owner (active/non-optimized, the default; docs/RBD.md).
    pub gateway_standby: bool,
    /// `gateway_alua = "explicit"`: the gateways report explicit ALUA too (TPGS = 11b) and an
    /// initiator's SET TARGET PORT GROUPS may take an image from an owner that is not known to
    /// be alive. Implicit only (the default): the gateways alone move images, and Linux's ALUA
    /// handler sends no SET TARGET PORT GROUPS when it activates a path.
    pub gateway_alua_explicit: bool,
    /// Directories (and device paths) that `file` and `block` devices must lie in, symlinks
    /// resolved; empty: any path the daemon can open.
    pub device_roots: Vec<PathBuf>,
    /// Where the remote management API is served over HTTPS (docs/OPERATIONS.md, *Remote
    /// API*); None = not served.
    pub api_listen: Option<std::net::SocketAddr>,
    /// The API's certificate chain and private key (PEM); None: a self-signed pair the
    /// daemon makes in its state directory at the first start with `api_listen`.
    pub api_cert: Option<PathBuf>,
    pub api_key: Option<PathBuf>,
    /// CA certificates (PEM) whose client certificates the API takes as proof: one whose
    /// subject's common name is a token's name is that token's caller. None: tokens only.
    pub api_client_ca: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers: 0,
            chap_algorithms: ChapAlgorithm::ALL.to_vec(),
            dhchap: Default::default(),
            metrics_listen: None,
            io_uring: true,
            state_dir: None,
            control_socket: None,
            control_socket_group: None,
            gateway: None,
            gateway_standby: false,
            gateway_alua_explicit: false,
            device_roots: Vec::new(),
            api_listen: None,
            api_cert: None,
            api_key: None,
            api_client_ca: None,
        }
    }
}

/// `auth = "none" | "chap"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    None,
    Chap,
}

/// A CHAP name and secret from the config. The secret never prints (see [`Secret`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapUser {
    pub user: String,
    pub secret: Secret,
    /// Where the secret was read from (`secret_file`); `None`: written inline (`secret`).
    pub secret_file: Option<PathBuf>,
}

impl ChapUser {
    pub fn credential(&self) -> iscsi::chap::Credential {
        iscsi::chap::Credential {
            user: self.user.clone(),
            secret: self.secret.clone(),
        }
    }
}

/// The authentication keys of one scope (discovery, a target, a group, one initiator).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthConfig {
    /// Explicit `auth`; `None`: CHAP when this scope has `users`, else inherited.
    pub mode: Option<AuthMode>,
    /// Credentials the initiator may authenticate with.
    pub users: Vec<ChapUser>,
    /// The target's credentials for mutual CHAP.
    pub mutual: Option<ChapUser>,
}

impl AuthConfig {
    /// The mode this scope decides on its own, if any.
    fn own_mode(&self) -> Option<AuthMode> {
        self.mode
            .or_else(|| (!self.users.is_empty()).then_some(AuthMode::Chap))
    }
}

/// What an initiator must do to log in: the result of the most specific scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedAuth {
    None,
    Chap {
        users: Vec<ChapUser>,
        mutual: Option<ChapUser>,
    },
}

/// `[discovery]`: who may run SendTargets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoveryConfig {
    pub auth: AuthConfig,
}

impl DiscoveryConfig {
    pub fn resolved(&self) -> ResolvedAuth {
        match self.auth.own_mode() {
            Some(AuthMode::Chap) => ResolvedAuth::Chap {
                users: self.auth.users.clone(),
                mutual: self.auth.mutual.clone(),
            },
            _ => ResolvedAuth::None,
        }
    }
}

/// `[[target.credentials]]`: CHAP credentials of one initiator of a target (the most specific).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitiatorCredentials {
    pub initiator: NodeName,
    pub users: Vec<ChapUser>,
    pub mutual: Option<ChapUser>,
}

macro_rules! limits {
    ($( $(#[doc = $doc:expr])* $name:ident : $ty:ty = $default:expr, $min:expr, $max:expr; )*) => {
        /// Bounds on every queue, buffer, count and wait. Exceeding one yields the standard
        /// protocol answer, a log line and a metric (see docs/CONFIG.md).
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct Limits {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl Default for Limits {
            fn default() -> Self {
                Limits { $( $name: $default, )* }
            }
        }

        /// `(key, default, min, max)` of every limit, for validation and documentation checks.
        pub(crate) const LIMIT_TABLE: &[(&str, u64, u64, u64)] = &[
            $( (stringify!($name), $default as u64, $min as u64, $max as u64), )*
        ];

        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct RawLimits {
            $( #[serde(default)] pub(crate) $name: Option<toml::Spanned<i64>>, )*
        }

        impl RawLimits {
            pub(crate) fn resolve(&self, cx: &mut cx::Cx<'_>) -> Limits {
                let mut limits = Limits::default();
                $(
                    if let Some(v) = &self.$name {
                        let field = concat!("limits: ", stringify!($name));
                        if let Some(x) = cx.int_in(v, $min as i64, $max as i64, field) {
                            limits.$name = x as $ty;
                        }
                    }
                )*
                limits
            }

            /// The limits as reading back their `[limits]` text would give them (every one
            /// written, in order); None for a value beyond TOML's integers.
            fn of(l: &Limits, pos: &mut cx::Pos) -> Option<RawLimits> {
                Some(RawLimits { $( $name: Some(pos.s(cx::int(l.$name)?)), )* })
            }

            /// The span of a limit's value, for cross-field errors.
            pub(crate) fn span_of(&self, key: &str) -> Option<std::ops::Range<usize>> {
                $( if key == stringify!($name) { return self.$name.as_ref().map(|v| v.span()); } )*
                None
            }
        }

        impl Limits {
            fn write_toml(&self, out: &mut String) {
                use std::fmt::Write as _;
                out.push_str("[limits]\n");
                $( let _ = writeln!(out, "{} = {}", stringify!($name), self.$name); )*
            }
        }
    };
}

limits! {
    /// Open connections, all portals together. Over: the new connection is closed at accept.
    max_connections: u32 = 1024, 1, 1_000_000;
    /// Open connections from one source IP address. Over: closed at accept.
    max_connections_per_source: u32 = 64, 1, 1_000_000;
    /// Connections that have not completed login, all portals together (at most
    /// max_connections). Full: a new connection evicts the oldest waiting one of the source
    /// with the most, and past half of it new connections get a 3 s login deadline.
    max_prelogin_connections: u32 = 256, 1, 1_000_000;
    /// Connections per session (MaxConnections offered). Over: login rejected (Too many
    /// connections). Only 1: multiple connections per session (MC/S) are not implemented.
    max_connections_per_session: u32 = 1, 1, 1;
    /// Sessions, all targets together. Over: login rejected (Out of resources).
    max_sessions: u32 = 256, 1, 1_000_000;
    /// Discovery sessions (iSCSI SendTargets sessions, NVMe discovery controllers), all
    /// sources together; not counted in max_sessions. Over: login rejected (Out of resources),
    /// NVMe Connect answered Controller Busy.
    max_discovery_sessions: u32 = 64, 1, 65_535;
    /// Discovery sessions from one source IP address (at most max_discovery_sessions).
    max_discovery_sessions_per_source: u32 = 8, 1, 65_535;
    /// Percent of the space a file device allocates from (its filesystem) in use past which
    /// its initiators are told THIN PROVISIONING SOFT THRESHOLD REACHED (38h/07h), once per
    /// nexus each time it is crossed, with a log line and a metric; 0 = never.
    space_warning_percent: u32 = 90, 0, 99;
    /// Commands in flight per session: the CmdSN window (MaxCmdSN - ExpCmdSN + 1).
    max_queue_depth: u32 = 128, 1, 65_535;
    /// Microseconds a connection may wait for more small commands before reading those that
    /// arrived, when its initiator keeps a deep queue (receive coalescing); 0 = off.
    coalesce_wait_us: u32 = 500, 0, 10_000;
    /// Microseconds a worker with nothing to do polls its connections before it sleeps, when
    /// its last idle stretch was no longer (adaptive busy polling); 0 = off.
    busy_poll_us: u32 = 50, 0, 1_000;
    /// Seconds an RBD image's owner gateway may be silent -- its heartbeat in the image not
    /// moving (the time of looks at the cluster that took over 1 s not counted), or nobody
    /// holding the lock -- before another gateway takes the image over by itself (fencing it); an owner whose cluster client left the cluster is taken over after
    /// 2 s. 0 = never by itself: only `ferrosan ctl device take` (or, with explicit ALUA, an
    /// initiator while the owner is silent).
    gateway_takeover_s: u32 = 4, 0, 3_600;
    /// Microseconds, plus 0.8 per KiB, a buffered write to a disk-backed device may take before
    /// it counts as a stall, moving that device's buffered writes off the network workers for a
    /// second; 0 = always run them off the workers.
    write_stall_us: u32 = 100, 0, 1_000_000;
    /// Milliseconds past which a read or write is slow: a device's slow commands are logged,
    /// one line per device every 10 s at most; 0 = never. Judged on the latency histogram's
    /// buckets: a value between two of its bounds acts as the next bound up.
    slow_command_ms: u32 = 1_000, 0, 2_500;
    /// Threads, all workers together, that run commands waiting for a device (durable writes,
    /// flushes, uncached reads, writes of a stalling device); each worker gets an equal share,
    /// at least one. Further such commands queue, bounded by each connection's memory.
    io_threads: u32 = 128, 1, 4_096;
    /// MaxRecvDataSegmentLength we declare and accept, in bytes (RFC 7143: 512..2^24-1).
    max_recv_data_segment_length: u32 = 262_144, 512, 16_777_215;
    /// MaxBurstLength offered, in bytes.
    max_burst_length: u32 = 1_048_576, 512, 16_777_215;
    /// FirstBurstLength offered, in bytes; at most max_burst_length.
    first_burst_length: u32 = 65_536, 512, 16_777_215;
    /// MaxOutstandingR2T offered, per task.
    max_outstanding_r2t: u32 = 8, 1, 65_535;
    /// Seconds from accept to the end of login. Over: the connection is closed.
    login_timeout_s: u32 = 15, 1, 3_600;
    /// Seconds a full-feature connection may stay without any PDU from the initiator; 0 = never.
    idle_timeout_s: u32 = 0, 0, 604_800;
    /// Seconds of silence after which the target sends a NOP-In ping; 0 = no pings.
    nop_in_interval_s: u32 = 5, 0, 3_600;
    /// Seconds to wait for the answer to a NOP-In ping before dropping the connection.
    nop_in_timeout_s: u32 = 30, 1, 3_600;
    /// Seconds, on SIGTERM or SIGINT, the daemon serves sessions after asking them to log out
    /// (Async Message) before it closes those left and exits; 0 = close at once.
    shutdown_grace_s: u32 = 10, 0, 3_600;
    /// key=value pairs in one login or text negotiation. Over: login rejected / Text Reject.
    max_text_key_count: u32 = 64, 1, 4_096;
    /// Bytes of key=value data in one negotiation sequence (with continuations).
    max_text_length: u32 = 8_192, 8_192, 1_048_576;
    /// Buffer memory of one connection, in bytes: at least max_recv_data_segment_length +
    /// max_burst_length. Reached: the engine stops reading and issues no R2T until it drains.
    memory_per_connection_bytes: u64 = 67_108_864, 1_024, 1_073_741_824;
    /// Failed logins (authentication or authorization) from one source address within
    /// login_failure_window_s after which its logins are refused (Service unavailable); 0 = no limit.
    login_failures_max: u32 = 5, 0, 1_000;
    /// Seconds over which login_failures_max is counted; a refused login does not count.
    login_failure_window_s: u32 = 60, 1, 86_400;
}

/// A target portal group: a tag and the addresses it listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortalGroup {
    /// Target portal group tag, 1..=65535.
    pub tag: u16,
    pub listen: Vec<SocketAddr>,
    /// NVMe/TCP listeners of the same port group (empty: none): the targets of this group
    /// that have an `nqn` are served there as NVMe subsystems, with the same ALUA state as
    /// their ANA state.
    pub nvme_listen: Vec<SocketAddr>,
    /// NVMe/TCP discovery listeners (only the discovery controller is served there). `None`:
    /// port 8009 at each `nvme_listen` address not otherwise taken; empty: none.
    pub nvme_discovery_listen: Option<Vec<SocketAddr>>,
    /// ALUA state of the target port group this portal group forms (in every target it serves).
    pub alua_state: scsi::AccessState,
    /// The gateway that serves it (None: this daemon, whichever gateway it is).
    pub gateway: Option<String>,
    /// Where the other gateways reach this group to ship commands, when `listen` names only
    /// wildcards (they cannot dial those).
    pub peer_address: Option<SocketAddr>,
}

impl PortalGroup {
    /// Whether the daemon that is `gateway` listens on this group.
    pub fn served_by(&self, gateway: Option<&str>) -> bool {
        match (&self.gateway, gateway) {
            (None, _) => true,
            (Some(g), Some(me)) => g == me,
            (Some(_), None) => false,
        }
    }
}

/// Where a device was defined (`FILE:LINE` of its `[[device]]` table), for errors found only
/// when it is opened (a missing file or RBD image). Equal to every other origin: a device that
/// only moved in its file is the same device (reload by difference leaves it alone).
#[derive(Debug, Clone, Default)]
pub struct Origin(pub Option<String>);

impl PartialEq for Origin {
    fn eq(&self, _: &Origin) -> bool {
        true
    }
}

impl Eq for Origin {}

/// A logical unit's backing store and identity, defined once and mapped by groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    pub name: String,
    pub store: StoreKind,
    /// 512 or 4096; the device size is a multiple of it.
    pub block_size: u32,
    /// Unit serial number (VPD page 0x80): 1..=20 printable ASCII.
    pub serial: String,
    /// INQUIRY's vendor identification (at most 8 printable ASCII); None: "FERROSAN".
    pub vendor: Option<String>,
    /// INQUIRY's product identification (at most 16 printable ASCII); None: by the store
    /// ("RAM DISK", "FILE DISK", …).
    pub product: Option<String>,
    /// NAA designator (VPD page 0x83): 8 bytes (type 2, 3, 5) or 16 bytes (type 6).
    pub naa: Vec<u8>,
    pub read_only: bool,
    /// Write cache enabled (WCE) at start; false = write-through.
    pub write_cache: bool,
    /// UNMAP / WRITE SAME with UNMAP release space (punch holes).
    pub thin: bool,
    /// How a file or block device's reads and writes reach it (ignored for RAM).
    pub cache: CacheMode,
    /// Taken offline by the operator: its LUNs stay listed but answer NOT READY (LOGICAL UNIT
    /// NOT READY, OFFLINE) to every command that needs the medium. Changes live.
    pub offline: bool,
    /// Where a volume came from and when it was made (`ctl volume create` and `clone`).
    pub lineage: Lineage,
    pub origin: Origin,
}

/// A volume's provenance, recorded when `ctl volume create` or `clone` makes it: what it is a
/// clone of (`VOLUME` as it was, or `VOLUME@SNAPSHOT`) and when it was made (RFC 3339, UTC).
/// It changes nothing served; a repeated clone is answered by it (the same source: `existed`,
/// another: `conflict`), and `volume list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lineage {
    pub clone_of: Option<String>,
    pub created: Option<String>,
}

impl Lineage {
    /// Made now, as a clone of `clone_of` (or new, without).
    pub fn now(clone_of: Option<String>) -> Lineage {
        let created = rfc3339(std::time::SystemTime::now());
        Lineage { clone_of, created }
    }
}

/// `t` as RFC 3339 in UTC, to the second (`2026-12-01T23:50:35Z`).
pub fn rfc3339(t: std::time::SystemTime) -> Option<String> {
    time::OffsetDateTime::from(t)
        .replace_nanosecond(0)
        .ok()?
        .format(&time::format_description::well_known::Rfc3339)
        .ok()
}

impl DeviceConfig {
    /// "FILE:LINE: device NAME" (or "device NAME" for one from the command line): how errors
    /// found when the device is opened begin.
    pub fn located(&self) -> String {
        match &self.origin.0 {
            Some(at) => format!("{at}: device {}", self.name),
            None => format!("device {}", self.name),
        }
    }
}

/// How a file or block device is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Direct I/O where the filesystem offers it and the LU's blocks are at least its
    /// alignment; the page cache otherwise (tmpfs, a 512-byte LU on a 4 KiB-sector device).
    Auto,
    /// Direct I/O (O_DIRECT), asynchronous on the workers' rings: the disk's own speed, no
    /// memory spent on caching. Refused at start where it cannot work.
    Direct,
    /// Through the page cache: repeated reads from memory, writes absorbed there (and made
    /// durable per the write-cache setting).
    Page,
}

impl CacheMode {
    pub fn parse(s: &str) -> Option<CacheMode> {
        match s {
            "auto" => Some(CacheMode::Auto),
            "direct" => Some(CacheMode::Direct),
            "page" => Some(CacheMode::Page),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Auto => "auto",
            CacheMode::Direct => "direct",
            CacheMode::Page => "page",
        }
    }
}

/// `POOL/IMAGE` of an RBD image (no namespace: `POOL/NS/IMAGE` is refused, as are empty
/// parts).
pub(crate) fn parse_rbd_image(s: &str) -> Result<(String, String), Invalid> {
    match s.split('/').collect::<Vec<_>>().as_slice() {
        [pool, image] if !pool.is_empty() && !image.is_empty() => {
            check_rbd_pool_name(pool)?;
            Ok((pool.to_string(), image.to_string()))
        }
        [_, _, _] => Err(Invalid(format!(
            "{s:?}: RBD namespaces (POOL/NAMESPACE/IMAGE) are not supported; expected POOL/IMAGE"
        ))),
        _ => Err(Invalid(format!("{s:?}: expected POOL/IMAGE"))),
    }
}

/// An iSCSI target: a name, the portal groups it is reachable on, and its initiator groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    pub iqn: NodeName,
    /// The NVMe subsystem name the same target is served under on its portal groups'
    /// `nvme_listen` addresses (None: iSCSI only).
    pub nqn: Option<NodeName>,
    pub alias: Option<String>,
    /// Tags of the portal groups; resolved (never empty).
    pub portal_groups: Vec<u16>,
    pub groups: Vec<InitiatorGroup>,
    pub auth: AuthConfig,
    /// Source addresses that may log in and see the target in discovery; empty = any.
    pub allowed_sources: Vec<SourceNet>,
    /// Per-initiator CHAP credentials.
    pub credentials: Vec<InitiatorCredentials>,
    /// NVMe/TCP hosts that must connect over TLS, with their pre-shared keys.
    pub tls_keys: Vec<TlsKey>,
}

/// `tls_keys` of a target: an NVMe host that connects to the subsystem over TLS 1.3 with this
/// pre-shared key, and only so (docs/NVME.md, *TLS*).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsKey {
    pub host: NodeName,
    pub key: std::sync::Arc<nvme::tls::ConfiguredKey>,
    /// How the host's nvme-cli derived the TLS PSK it holds.
    pub derivation: nvme::tls::Derivation,
    /// Where the key was read from (for the config's text; the key itself is never written).
    pub key_file: String,
}

/// Who sees what (an SCST GROUP): initiators and their own LUN numbering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitiatorGroup {
    pub name: String,
    pub initiators: Vec<NodeName>,
    /// This group applies to every initiator not listed in another group of the target.
    pub any_initiator: bool,
    pub luns: Vec<LunMapping>,
    pub auth: AuthConfig,
    /// Source addresses this group's initiators may come from; empty = any (the target's
    /// `allowed_sources` applies as well).
    pub allowed_sources: Vec<SourceNet>,
}

/// One LUN of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunMapping {
    /// 0..=16383 (flat addressing).
    pub lun: u64,
    pub device: String,
    /// Effective: the mapping's `read_only` or the device's.
    pub read_only: bool,
}

impl TargetConfig {
    /// The index (in `groups`) of the group an initiator belongs to: the group listing it,
    /// else the `any_initiator` group, else `None` (login refused). The one place group
    /// membership is decided: the engine calls it once per login and takes authentication,
    /// allowed sources and the LUN map from the group it returns.
    pub fn group_index(&self, initiator: &NodeName) -> Option<usize> {
        self.groups
            .iter()
            .position(|g| g.initiators.contains(initiator))
            .or_else(|| self.groups.iter().position(|g| g.any_initiator))
    }

    /// The TLS key `host` must connect with, if it must.
    pub fn tls_key(&self, host: &NodeName) -> Option<&TlsKey> {
        self.tls_keys.iter().find(|k| k.host == *host)
    }

    /// The group an initiator belongs to (see [`TargetConfig::group_index`]).
    pub fn group_for(&self, initiator: &NodeName) -> Option<&InitiatorGroup> {
        self.group_index(initiator).and_then(|i| self.groups.get(i))
    }

    /// What `initiator`, a member of `group`, must do to log in: its own
    /// `[[target.credentials]]` entry, else its group's auth keys, else the target's (most
    /// specific wins, key by key for `mutual`).
    pub fn auth_in(&self, initiator: &NodeName, group: Option<&InitiatorGroup>) -> ResolvedAuth {
        let group_auth = group.map(|g| &g.auth);
        let mutual = || {
            group_auth
                .and_then(|a| a.mutual.clone())
                .or_else(|| self.auth.mutual.clone())
        };
        if let Some(c) = self.credentials.iter().find(|c| c.initiator == *initiator) {
            return ResolvedAuth::Chap {
                users: c.users.clone(),
                mutual: c.mutual.clone().or_else(mutual),
            };
        }
        let mode = group_auth
            .and_then(AuthConfig::own_mode)
            .or_else(|| self.auth.own_mode())
            .unwrap_or(AuthMode::None);
        match mode {
            AuthMode::None => ResolvedAuth::None,
            AuthMode::Chap => {
                let users = match group_auth {
                    Some(a) if !a.users.is_empty() => a.users.clone(),
                    _ => self.auth.users.clone(),
                };
                ResolvedAuth::Chap {
                    users,
                    mutual: mutual(),
                }
            }
        }
    }

    /// Whether a login from `source` passes the target's and the group's `allowed_sources`.
    pub fn source_allowed(&self, group: Option<&InitiatorGroup>, source: std::net::IpAddr) -> bool {
        let ok = |nets: &[SourceNet]| nets.is_empty() || nets.iter().any(|n| n.contains(source));
        ok(&self.allowed_sources) && group.is_none_or(|g| ok(&g.allowed_sources))
    }
}

impl Config {
    /// What `ferrosan serve` runs without arguments: target `iqn.2026-11.org.ferrosan:demo`
    /// on 127.0.0.1:3260, one 1 GiB RAM LUN 0, open to any initiator.
    pub fn demo() -> Config {
        cli::demo()
    }

    /// A quick export from command-line arguments (see docs/CONFIG.md, "Quick exports").
    /// `listen` empty: 127.0.0.1:3260. `target` empty: the demo IQN. `luns` empty: `ram:1G`.
    pub fn from_cli(
        listen: &[String],
        nvme_listen: &[String],
        target: &str,
        luns: &[String],
    ) -> Result<Config, ConfigError> {
        cli::from_cli(listen, nvme_listen, target, luns)
    }

    /// Parses and validates a config file's text; `file_name` is used in error messages.
    /// Returns every semantic error found (a TOML syntax or type error stops at the first).
    pub fn from_toml_str(text: &str, file_name: &str) -> Result<Config, ConfigErrors> {
        file::from_toml_str(text, file_name)
    }

    /// This config validated whole, exactly as loading `self.to_toml_with_secrets()` would
    /// validate it (the rule: the running config is always one that loads), without writing
    /// and parsing that text, so in time linear in the config and a fraction of the text's.
    /// Returns the config that text loads as, each device keeping its origin from `self`; the
    /// errors, in the text's order, have no line (there is no text to point into), and
    /// `file_name` is their file. Debug builds check every call against the text's way.
    pub fn revalidated(&self, file_name: &str) -> Result<Config, ConfigErrors> {
        file::revalidate(self, file_name)
    }

    /// What [`Config::revalidated`] answers for `self`, an edit of `base` (a config that
    /// loaded, such as the running one), in time that grows with the edit where only devices
    /// changed (`volume create`, `delete`, `clone` at thousands of devices): the new and
    /// edited devices are validated alone, then against the others (`config::delta`).
    pub fn revalidated_from(self, base: &Config, file_name: &str) -> Result<Config, ConfigErrors> {
        delta::revalidate_from(self, base, file_name)
    }

    /// Whether `self` (a config that loaded) with `device` added would load: what a verb
    /// that adds a device checks before its side effects, in time that does not grow with
    /// the devices beyond a comparison each. The errors are the whole way's.
    pub fn check_added(&self, device: &DeviceConfig, file_name: &str) -> Result<(), ConfigErrors> {
        delta::check_added(self, device, file_name)
    }

    /// Reads (at most [`CONFIG_FILE_BYTES_MAX`] bytes) and validates a config file.
    pub fn load(path: impl AsRef<Path>) -> Result<Config, ConfigErrors> {
        let path = path.as_ref();
        let name = path.display().to_string();
        Config::from_toml_str(&Config::file_text(path)?, &name)
    }

    /// A config file's text (at most [`CONFIG_FILE_BYTES_MAX`] bytes).
    pub fn file_text(path: &Path) -> Result<String, ConfigErrors> {
        use std::io::Read as _;
        let name = path.display().to_string();
        let io_error = |message: String| ConfigErrors {
            errors: vec![ConfigError {
                file: name.clone(),
                line: 0,
                column: 0,
                field: "file".into(),
                message,
            }],
        };
        let file = std::fs::File::open(path).map_err(|e| io_error(format!("cannot open: {e}")))?;
        let mut text = String::new();
        file.take(CONFIG_FILE_BYTES_MAX + 1)
            .read_to_string(&mut text)
            .map_err(|e| io_error(format!("cannot read: {e}")))?;
        if text.len() as u64 > CONFIG_FILE_BYTES_MAX {
            return Err(io_error(format!(
                "larger than {CONFIG_FILE_BYTES_MAX} bytes"
            )));
        }
        Ok(text)
    }

    /// Whether any CHAP secret is written in the config itself (`secret`), not read from a
    /// `secret_file`: such a file must be readable by no one but its owner (and group).
    pub fn has_inline_secrets(&self) -> bool {
        let inline = |a: &AuthConfig| {
            a.users
                .iter()
                .chain(&a.mutual)
                .any(|u| u.secret_file.is_none())
        };
        inline(&self.discovery.auth)
            || self.targets.iter().any(|t| {
                inline(&t.auth)
                    || t.groups.iter().any(|g| inline(&g.auth))
                    || t.credentials.iter().any(|c| {
                        c.users
                            .iter()
                            .chain(&c.mutual)
                            .any(|u| u.secret_file.is_none())
                    })
            })
    }

    /// A warning when the config at `path` holds inline CHAP secrets and users other than its
    /// owner and group may read it (`serve` logs it at each load, `check-config` prints it).
    pub fn exposed_secrets(&self, path: &Path) -> Option<String> {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
        (self.has_inline_secrets() && mode & 0o007 != 0).then(|| {
            format!(
                "{} holds CHAP secrets and is readable by every user (mode {mode:04o}): chmod 640 it, or move the secrets to secret_file (docs/CONFIG.md, Authentication)",
                path.display()
            )
        })
    }

    /// A device from a quick-export LUN spec (`ram:64M`, `file:/path,size=1G`, ...).
    pub fn device_from_spec(name: &str, spec: &str) -> Result<DeviceConfig, Invalid> {
        cli::device_from_spec(name, spec)
    }

    /// The device named `name`.
    pub fn device(&self, name: &str) -> Option<&DeviceConfig> {
        self.devices.iter().find(|d| d.name == name).map(|d| &**d)
    }

    /// The target named `iqn`.
    pub fn target(&self, iqn: &NodeName) -> Option<&TargetConfig> {
        self.targets.iter().find(|t| t.iqn == *iqn).map(|t| &**t)
    }

    /// The config as a file with every value explicit (derived identities included), such
    /// that `from_toml_str(&c.to_toml(), _) == Ok(c)`. Used to persist live changes.
    pub fn to_toml(&self) -> String {
        file::to_toml(self, false)
    }

    /// Like [`Config::to_toml`], with inline secrets written as they are: for saving the
    /// running config over its file (whose secrets were inline already), never for showing it.
    pub fn to_toml_with_secrets(&self) -> String {
        file::to_toml(self, true)
    }
}

/// One configuration error, located in its file. Displays as `file:line:column: field: message`
/// (`file: field: message` when there is no line, e.g. for command-line arguments).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    /// 1-based; 0 when the error has no line (command line, I/O).
    pub line: usize,
    /// 1-based, in characters.
    pub column: usize,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}: {}", self.file, self.field, self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}: {}",
                self.file, self.line, self.column, self.field, self.message
            )
        }
    }
}

/// A value that is not valid where it was given (a size, a name, an address, a device or LUN
/// spec, a secret file), and why. A config file reports it at the value's line; the command
/// line and `ctl` report it as the argument's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl From<&str> for Invalid {
    fn from(why: &str) -> Invalid {
        Invalid(why.to_string())
    }
}

impl From<String> for Invalid {
    fn from(why: String) -> Invalid {
        Invalid(why)
    }
}

/// The message of a config error ([`ConfigError::message`], a `cx.err`).
impl From<Invalid> for String {
    fn from(invalid: Invalid) -> String {
        invalid.0
    }
}

/// Every error found in one config file, in file order. Displays one error per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors {
    pub errors: Vec<ConfigError>,
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl IntoIterator for ConfigErrors {
    type Item = ConfigError;
    type IntoIter = std::vec::IntoIter<ConfigError>;
    fn into_iter(self) -> Self::IntoIter {
        self.errors.into_iter()
    }
}

/// Whether `path` lies in one of `roots` (each a directory, or the very device or file),
/// symlinks resolved: a path that does not exist yet counts by its directory. Every root
/// when `roots` is empty.
pub fn within_roots(path: &Path, roots: &[PathBuf]) -> Result<(), Invalid> {
    if roots.is_empty() {
        return Ok(());
    }
    let resolved = match std::fs::canonicalize(path) {
        Ok(p) => p,
        // Not there yet (a file to create): its directory must be.
        Err(_) => match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) => std::fs::canonicalize(dir)
                .map_err(|e| format!("{}: {e}", dir.display()))?
                .join(name),
            _ => return Err(Invalid(format!("{}: not a file path", path.display()))),
        },
    };
    let inside = roots.iter().any(|root| {
        std::fs::canonicalize(root).is_ok_and(|r| resolved == r || resolved.starts_with(&r))
    });
    if inside {
        Ok(())
    } else {
        Err(Invalid(format!(
            "{} (resolved: {}) is outside server.device_roots",
            path.display(),
            resolved.display()
        )))
    }
}
