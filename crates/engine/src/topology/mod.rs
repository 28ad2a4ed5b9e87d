//! The running topology: devices opened from the config, and targets with their groups' LUN
//! maps. Built purely from a [`Config`] plus the open devices, and published whole as one
//! immutable snapshot with a generation number; a reload (reload.rs) builds the next one,
//! reusing every device whose config did not change, and connections pick it up at their next
//! turn.

pub mod error;
pub mod gateway;
pub mod left_out;
pub mod nexus;
pub mod nudger;
pub mod portals;
pub mod preflight;
pub mod space;
pub mod state;
#[cfg(test)]
pub(crate) mod testing;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use scsi::{AccessState, LogicalUnit, LuIdentity, LuSettings, LunMap, PortGroup, TargetPort};
use store::{BlockStore, Caching, FileStore, RamStore};

use crate::config::{CacheMode, Config, DeviceConfig, NodeName, StoreKind, TargetConfig};
use crate::io::stall::WriteStalls;
pub use error::OpenError;

/// One initiator group of a target, with its LUN map built. Who belongs to it is the config's
/// to say (`TargetConfig::group_index`); this is what a member gets.
pub struct GroupRuntime {
    pub name: String,
    pub luns: Arc<LunMap>,
    /// LUNs backed by a real device: their durable operations (write-through writes, FUA,
    /// SYNCHRONIZE CACHE, UNMAP, ...) run on the blocking pool, never on a network worker, and
    /// so do their buffered writes while the device stalls (see `stall.rs`).
    pub disk_luns: Arc<Vec<DiskLun>>,
    /// The device name behind each LUN, for the per-device I/O metrics.
    pub lun_devices: Arc<Vec<(u64, Arc<str>)>>,
    /// A gateway peer group (`peer.rs`): its sessions ship for the nexus their alias names.
    pub peer: bool,
}

/// A LUN whose device is a real disk (not RAM, not tmpfs), with that device's stall state.
pub struct DiskLun {
    pub lun: u64,
    pub stalls: Arc<WriteStalls>,
    /// The store's O_DIRECT descriptor when its reads, writes and flushes go to the worker's
    /// io_uring; None for page-cache devices, and for every device when io_uring is off or
    /// unavailable (direct stores then run on the I/O thread pool).
    pub ring: Option<store::DirectIo>,
    /// The store does direct I/O (on the ring, or on the I/O threads without one): its reads
    /// and writes always wait for the device.
    pub direct: bool,
}

pub struct TargetRuntime {
    pub iqn: NodeName,
    pub alias: Option<String>,
    pub portal_groups: Vec<u16>,
    pub groups: Vec<GroupRuntime>,
    /// One SCSI target port per portal group tag.
    pub ports: HashMap<u16, Arc<TargetPort>>,
    /// Every LU reachable through this target (for target resets).
    pub units: Vec<Arc<LogicalUnit>>,
    /// The target's config: group membership, authentication and source checks. Its
    /// `groups[i]` is `groups[i]` above.
    pub config: TargetConfig,
}

/// Who an initiator is to one target, decided once from its normalised name: every decision
/// of a login and its session (authentication, allowed sources, LUN map, discovery) is taken
/// from this one lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Membership {
    /// Index in `Shared::targets`.
    pub target: usize,
    /// Index in that target's `groups` (and its config's).
    pub group: usize,
}

impl TargetRuntime {
    /// The config and runtime halves of group `index`.
    pub fn group(&self, index: usize) -> Option<(&crate::config::InitiatorGroup, &GroupRuntime)> {
        Some((self.config.groups.get(index)?, self.groups.get(index)?))
    }
}

/// A device opened for the running topology, shared by every later topology in which its
/// config did not change (a resize keeps it). Its store closes when the last topology and the
/// last command holding it are gone.
pub struct OpenDevice {
    pub unit: Arc<LogicalUnit>,
    /// For a store that waits for a real device (not RAM, not tmpfs).
    pub disk: Option<DiskState>,
    /// An RBD image under gateways: who owns it (`ferrosan ctl device take`).
    pub ownership: Option<Arc<crate::topology::gateway::ImageOwnership>>,
    /// An RBD image's store: its librbd image for snapshots (`ctl volume snapshot`).
    pub rbd: Option<Arc<store::RbdStore>>,
}

/// The device-side state of a store on a real disk.
pub struct DiskState {
    pub stalls: Arc<WriteStalls>,
    /// The O_DIRECT descriptor for the workers' rings (None: no ring, or not direct).
    pub ring: Option<store::DirectIo>,
    /// The store does direct I/O (on the ring, or on the I/O threads without one).
    pub direct: bool,
}

/// What opening a device needs; fixed for the daemon's life.
pub struct DeviceContext {
    metrics: Arc<crate::metrics::Metrics>,
    epoch: Instant,
    stall_base: Duration,
    io_uring: bool,
    state_dir: Option<PathBuf>,
    /// This gateway's name and every portal group's gateway, when portal groups name
    /// gateways: RBD images are then owned by one gateway at a time (explicit ALUA,
    /// `gateway.rs`).
    gateways: Option<crate::topology::gateway::Gateways>,
    /// Told of every LU's change its hosts must learn: idle sessions look again.
    nudger: Arc<crate::topology::nudger::Nudger>,
}

impl DeviceContext {
    /// Probes io_uring once and resolves the state directory.
    pub fn new(config: &Config, metrics: Arc<crate::metrics::Metrics>) -> DeviceContext {
        let io_uring = config.server.io_uring && {
            match crate::io::ring::DeviceRing::<()>::probe() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(
                        "io_uring unavailable ({e}): direct-I/O devices run on the I/O thread pool"
                    );
                    false
                }
            }
        };
        DeviceContext {
            metrics,
            nudger: Arc::default(),
            epoch: Instant::now(),
            stall_base: Duration::from_micros(config.limits.write_stall_us.into()),
            io_uring,
            state_dir: crate::topology::state::state_dir(config.server.state_dir.as_deref()),
            gateways: config
                .server
                .gateway
                .as_ref()
                .map(|me| crate::topology::gateway::Gateways {
                    me: me.clone(),
                    groups: config
                        .portal_groups
                        .iter()
                        .filter_map(|p| Some((p.tag, p.gateway.clone()?)))
                        .collect(),
                    takeover_after: Duration::from_secs(config.limits.gateway_takeover_s.into()),
                    standby: config.server.gateway_standby,
                    explicit: config.server.gateway_alua_explicit,
                    portals: config
                        .portal_groups
                        .iter()
                        .filter_map(|p| {
                            let addresses = p
                                .peer_address
                                .iter()
                                .chain(p.listen.iter().filter(|a| !a.ip().is_unspecified()))
                                .map(|a| a.to_string())
                                .collect();
                            Some((p.gateway.clone()?, addresses))
                        })
                        .collect(),
                }),
        }
    }

    /// What wakes sessions to look at the shared state again (`shared/nudge.rs`).
    pub fn nudger(&self) -> &Arc<crate::topology::nudger::Nudger> {
        &self.nudger
    }

    /// An RBD gateway's share of the TSIHs and NVMe controller IDs; None for any other daemon.
    pub fn session_ids(&self) -> Option<std::ops::RangeInclusive<u16>> {
        self.gateways.as_ref().map(|g| g.session_ids())
    }

    /// Opens a device's store, builds its LU and restores its saved reservations.
    /// `config` is the config the device comes from (its targets decide where peer sessions
    /// of gateways log in).
    pub fn open(
        &self,
        device: &DeviceConfig,
        config: &Config,
    ) -> Result<Arc<OpenDevice>, OpenError> {
        let (unit, rbd) = open_unit(device, self.gateways.is_some())?;
        unit.on_change(self.nudger.for_units());
        let ownership = match &rbd {
            Some(store) => self.open_image(device, config, &unit, Arc::clone(store))?,
            None => None,
        };
        if device.offline {
            unit.set_offline(true);
            tracing::warn!(device = %device.name, "device is offline (offline = true): its LUNs answer NOT READY");
        }
        self.restore_reservations(device, &unit);
        let disk = self.io_path(device, &unit);
        Ok(Arc::new(OpenDevice {
            unit,
            disk,
            ownership,
            rbd,
        }))
    }

    /// An RBD image's shared state: its reservations (kept in the image, shared by every
    /// gateway) and, under gateways, its ownership.
    fn open_image(
        &self,
        device: &DeviceConfig,
        config: &Config,
        unit: &Arc<LogicalUnit>,
        store: Arc<store::RbdStore>,
    ) -> Result<Option<Arc<crate::topology::gateway::ImageOwnership>>, OpenError> {
        // An image's reservations live in the image, shared by every gateway.
        let observer = store
            .observer()
            .map(Arc::new)
            .map_err(|e| OpenError::Unavailable {
                located: device.located(),
                what: "watching the image".into(),
                reason: e.to_string(),
            })?;
        let reservations =
            crate::topology::gateway::ImageReservations::new(Arc::clone(&observer), &device.name);
        if let Some(state) = scsi::PrPersistence::load(&*reservations).map_err(|e| {
            OpenError::device(device.located(), format!("persistent reservations: {e}"))
        })? {
            unit.replace_reservations(&state);
        }
        unit.set_pr_persistence(Arc::clone(&reservations) as Arc<dyn scsi::PrPersistence>);
        if let Some(gateways) = &self.gateways {
            // Peer sessions log in to the first target that maps the device (the same on
            // every gateway: they share the config).
            let peer_target = config
                .targets
                .iter()
                .find(|t| {
                    t.groups
                        .iter()
                        .any(|g| g.luns.iter().any(|m| m.device == device.name))
                })
                .map(|t| t.iqn.to_string())
                .unwrap_or_default();
            let ownership = crate::topology::gateway::ImageOwnership::new(
                store,
                observer,
                &device.name,
                gateways,
                Arc::clone(&self.metrics),
                (&unit.identity(), &peer_target),
            )?;
            ownership.start().map_err(|e| {
                OpenError::device(
                    format!("device {}", device.name),
                    format!("taking or following the image's owner: {e}"),
                )
            })?;
            unit.set_ownership(Arc::clone(&ownership) as Arc<dyn scsi::Ownership>);
            ownership.follow(unit);
            return Ok(Some(ownership));
        }
        Ok(None)
    }

    /// Files and block devices keep their reservations across restarts when asked (APTPL).
    /// A RAM LU's medium does not survive a restart, nor do its reservations.
    fn restore_reservations(&self, device: &DeviceConfig, unit: &Arc<LogicalUnit>) {
        let medium = device.store.path();
        if let (Some(medium), Some(dir)) = (medium, &self.state_dir) {
            let path = crate::topology::state::reservation_file(dir, &device.name, medium);
            let file = crate::topology::state::ReservationFile::new(path, medium, &device.name);
            match file.load() {
                Ok(saved) => {
                    if let Some(saved) = saved {
                        restored(&device.name, unit, &saved);
                    }
                    unit.set_pr_persistence(Arc::new(file));
                }
                // Serving without the registrations an initiator made durable could let a
                // fenced host write; stopping every other device for it would let one
                // initiator keep the array down. This device alone waits for the operator,
                // and its file is left as it is (nothing is saved over it).
                Err(e) => {
                    tracing::error!(
                        device = %device.name,
                        "persistent reservations cannot be loaded: {e}; the device answers NOT READY, MANUAL INTERVENTION REQUIRED (04h/03h) until the file is repaired or removed and the daemon restarted"
                    );
                    unit.fence();
                    self.metrics.device_fenced(&device.name);
                }
            }
        }
    }

    /// The path the device's I/O takes (logged and counted), and for a store that waits for
    /// a device, its disk state: the stall watch and the ring.
    fn io_path(&self, device: &DeviceConfig, unit: &Arc<LogicalUnit>) -> Option<DiskState> {
        // The store says whether it waits for a device; nothing is guessed from its kind.
        let caps = unit.capabilities();
        let path = match (caps.direct, self.io_uring) {
            _ if caps.asynchronous => "asynchronous",
            (true, true) => "io_uring",
            (true, false) => "threads",
            (false, _) if caps.page_cache && caps.waits_for_device => "page_cache",
            (false, _) => "memory",
        };
        self.metrics.device_io_path(&device.name, path);
        self.metrics.watch_device(&device.name, unit);
        tracing::info!("device {}: I/O path {path}", device.name);
        let ring = if self.io_uring {
            unit.direct_io()
        } else {
            None
        };

        caps.waits_for_device.then(|| {
            let (stalls, offloaded) = self.metrics.device_writes(&device.name);
            DiskState {
                stalls: Arc::new(WriteStalls::new(
                    self.epoch,
                    self.stall_base,
                    stalls,
                    offloaded,
                )),
                ring,
                // A store that completes I/O itself (librbd) waits for it on every read and
                // write, as direct I/O does.
                direct: caps.direct || caps.asynchronous,
            }
        })
    }
}

/// The running targets and the devices they map, as one snapshot.
/// Every open device by name. Names are shared (`Arc<str>`): a change copies the map, not
/// thousands of names.
pub type OpenDevices = HashMap<Arc<str>, Arc<OpenDevice>>;

pub struct Topology {
    /// Increases by one with every applied reload; connections compare it at each turn.
    pub generation: u64,
    /// The config this topology was built from.
    pub config: Config,
    /// Shared with the next topology where nothing of a target changed (`assemble_after`).
    pub targets: Vec<Arc<TargetRuntime>>,
    /// Every open device by name (also those no LUN maps).
    pub devices: OpenDevices,
}

/// The topology a new one is assembled after, and the devices closed since (the only open
/// devices a kept target could have lost: one the old config did not hold, it did not map).
pub struct Before<'a> {
    pub topology: &'a Topology,
    pub removed: &'a [String],
}

impl Before<'_> {
    /// The runtime of target `k` of `config` if building it anew would give the same: the
    /// same target config, portal groups and `[server]` (its ports), and no device it maps
    /// closed. Looked for at the same place first (targets rarely move), so that thousands of
    /// targets are not searched for each.
    fn unchanged_target(&self, config: &Config, k: usize) -> Option<Arc<TargetRuntime>> {
        let was = &self.topology.config;
        if was.portal_groups != config.portal_groups || was.server != config.server {
            return None;
        }
        let t = &config.targets[k];
        let i = match was.targets.get(k) {
            Some(o) if o == t => k,
            _ => was.targets.iter().position(|o| o == t)?,
        };
        let mut mapped = t
            .groups
            .iter()
            .flat_map(|g| &g.luns)
            .map(|m| m.device.as_str());
        let closed = match self.removed.len() {
            0 => false,
            // A verb's few, compared in turn; a reload's many, through a set.
            1..=8 => mapped.any(|m| self.removed.iter().any(|r| r == m)),
            _ => {
                let removed: HashSet<&str> = self.removed.iter().map(String::as_str).collect();
                mapped.any(|m| removed.contains(m))
            }
        };
        (!closed).then(|| Arc::clone(&self.topology.targets[i]))
    }
}

impl Topology {
    /// Builds the targets of `config` over `devices` (which must hold every device it names).
    pub fn assemble(
        config: Config,
        devices: OpenDevices,
        generation: u64,
    ) -> Result<Topology, OpenError> {
        Topology::assemble_after(None, config, devices, generation)
    }

    /// As [`Topology::assemble`], keeping each target of `before` that building anew would
    /// give again: a change costs what it changes, not what the array holds (a volume made
    /// at 4,000 LUNs rebuilds no LUN map).
    pub fn assemble_after(
        before: Option<Before<'_>>,
        config: Config,
        devices: OpenDevices,
        generation: u64,
    ) -> Result<Topology, OpenError> {
        let mut targets = Vec::with_capacity(config.targets.len());
        for (k, t) in config.targets.iter().enumerate() {
            let kept = before.as_ref().and_then(|b| b.unchanged_target(&config, k));
            targets.push(match kept {
                Some(runtime) => runtime,
                None => Arc::new(assemble_target(&config, t, &devices)?),
            });
        }
        Ok(Topology {
            generation,
            config,
            targets,
            devices,
        })
    }

    /// The target named `name`: its iSCSI name, or the NQN it is served under as an NVMe
    /// subsystem (one target, two doors, one admission).
    pub fn target(&self, name: &NodeName) -> Option<(usize, &TargetRuntime)> {
        self.targets
            .iter()
            .enumerate()
            .find(|(_, t)| match name.is_nqn() {
                true => t.config.nqn.as_ref() == Some(name),
                false => t.iqn == *name,
            })
            .map(|(i, t)| (i, &**t))
    }

    /// The group `initiator` belongs to in target `target` (an index in `targets`), if any.
    pub fn membership(&self, target: usize, initiator: &NodeName) -> Option<Membership> {
        let group = self.targets.get(target)?.config.group_index(initiator)?;
        Some(Membership { target, group })
    }

    /// The runtime group (LUN map) of an admitted initiator.
    pub fn group_of(&self, membership: Membership) -> Option<(&TargetRuntime, &GroupRuntime)> {
        let target = self.targets.get(membership.target)?;
        Some((target, target.group(membership.group)?.1))
    }
}

fn assemble_target(
    config: &Config,
    t: &TargetConfig,
    devices: &OpenDevices,
) -> Result<TargetRuntime, OpenError> {
    let portal_groups = if t.portal_groups.is_empty() {
        config.portal_groups.iter().map(|p| p.tag).collect()
    } else {
        t.portal_groups.clone()
    };
    let mut groups = Vec::new();
    let mut target_units = TargetUnits::default();
    for g in &t.groups {
        groups.push(assemble_group(t, g, devices, &mut target_units)?);
    }
    let ports = target_ports(config, t, &portal_groups);
    if t.groups.iter().any(|g| g.any_initiator) {
        tracing::warn!(target = %t.iqn, "target is open to any initiator (any_initiator = true)");
    }
    assert_eq!(
        groups.len(),
        t.groups.len(),
        "one runtime group per configured group"
    );
    let mut target_config = t.clone();
    add_peer_groups(&mut target_config, &mut groups, devices)?;
    Ok(TargetRuntime {
        iqn: t.iqn.clone(),
        alias: t.alias.clone(),
        portal_groups,
        groups,
        ports,
        units: target_units.units,
        config: target_config,
    })
}

/// Every LU a target's groups map, once each, in the order first mapped.
#[derive(Default)]
struct TargetUnits {
    units: Vec<Arc<LogicalUnit>>,
    /// The LUs in `units`, by address.
    seen: HashSet<*const LogicalUnit>,
}

impl TargetUnits {
    fn add(&mut self, unit: &Arc<LogicalUnit>) {
        if self.seen.insert(Arc::as_ptr(unit)) {
            self.units.push(Arc::clone(unit));
        }
    }
}

/// The runtime group (LUN map) of `g`; the LUs it maps join `units`, the target's.
fn assemble_group(
    t: &TargetConfig,
    g: &crate::config::InitiatorGroup,
    devices: &OpenDevices,
    units: &mut TargetUnits,
) -> Result<GroupRuntime, OpenError> {
    let mut entries = Vec::new();
    let mut disk_luns = Vec::new();
    let mut lun_devices = Vec::new();
    for m in &g.luns {
        lun_devices.push((m.lun, Arc::<str>::from(m.device.as_str())));
        let device = devices.get(m.device.as_str()).ok_or_else(|| {
            OpenError::Config(format!("target {}: unknown device {}", t.iqn, m.device))
        })?;
        if let Some(disk) = &device.disk {
            disk_luns.push(DiskLun {
                lun: m.lun,
                stalls: Arc::clone(&disk.stalls),
                ring: disk.ring.clone(),
                direct: disk.direct,
            });
        }
        let unit = &device.unit;
        units.add(unit);
        entries.push((m.lun, Arc::clone(unit), m.read_only));
    }
    let luns = LunMap::new(entries)
        .map_err(|e| OpenError::Config(format!("target {} group {}: {e}", t.iqn, g.name)))?;
    // By LUN: every command finds its LUN's disk by binary search (`View::disk`).
    disk_luns.sort_by_key(|d| d.lun);
    Ok(GroupRuntime {
        name: g.name.clone(),
        luns: Arc::new(luns),
        disk_luns: Arc::new(disk_luns),
        lun_devices: Arc::new(lun_devices),
        peer: false,
    })
}

/// The target ports of `t`, by tag. ALUA: each portal group is one target port of this target
/// and a target port group of its own, numbered by its tag, in the state the config gives it.
fn target_ports(
    config: &Config,
    t: &TargetConfig,
    portal_groups: &[u16],
) -> HashMap<u16, Arc<TargetPort>> {
    let alua_groups: Arc<[PortGroup]> = portal_groups
        .iter()
        .map(|&tag| PortGroup {
            id: tag,
            state: config
                .portal_groups
                .iter()
                .find(|p| p.tag == tag)
                .map_or(AccessState::ActiveOptimized, |p| p.alua_state),
            ports: vec![tag],
        })
        .collect();
    portal_groups
        .iter()
        .map(|&tag| {
            let port = TargetPort {
                relative_id: tag,
                name: format!("{},t,0x{tag:04x}", t.iqn),
                target_name: t.iqn.to_string(),
                group: tag,
                groups: Arc::clone(&alua_groups),
                shipped: false,
            };
            (tag, Arc::new(port))
        })
        .collect()
}

/// For each RBD image under gateways that `target` maps, a group of its own for the other
/// gateways' peer sessions (`peer.rs`): only the peer name of that image's LU, with CHAP and
/// the image's peer secret, the device at LUN 0.
fn add_peer_groups(
    target: &mut TargetConfig,
    groups: &mut Vec<GroupRuntime>,
    devices: &OpenDevices,
) -> Result<(), OpenError> {
    let mut mapped: Vec<&str> = target
        .groups
        .iter()
        .flat_map(|g| g.luns.iter().map(|m| m.device.as_str()))
        .collect();
    mapped.sort_unstable();
    mapped.dedup();
    let mut peer_groups = Vec::new();
    for name in mapped {
        let Some(device) = devices.get(name) else {
            continue;
        };
        let Some(ownership) = &device.ownership else {
            continue;
        };
        let peer = crate::io::peer::peer_name(&device.unit.identity());
        let initiator = NodeName::from_wire(&peer)
            .map_err(|e| OpenError::Config(format!("device {name}: peer name {peer}: {e:?}")))?;
        let luns = LunMap::new(vec![(0, Arc::clone(&device.unit), false)])
            .map_err(|e| OpenError::Config(format!("device {name}: peer group: {e}")))?;
        let disk_luns = device
            .disk
            .iter()
            .map(|disk| DiskLun {
                lun: 0,
                stalls: Arc::clone(&disk.stalls),
                ring: disk.ring.clone(),
                direct: disk.direct,
            })
            .collect();
        groups.push(GroupRuntime {
            name: format!("gateway-peer:{name}"),
            luns: Arc::new(luns),
            disk_luns: Arc::new(disk_luns),
            lun_devices: Arc::new(vec![(0, Arc::<str>::from(name))]),
            peer: true,
        });
        peer_groups.push(crate::config::InitiatorGroup {
            name: format!("gateway-peer:{name}"),
            initiators: vec![initiator],
            any_initiator: false,
            luns: vec![crate::config::LunMapping {
                lun: 0,
                device: name.to_string(),
                read_only: false,
            }],
            auth: crate::config::AuthConfig {
                mode: Some(crate::config::AuthMode::Chap),
                users: vec![crate::config::ChapUser {
                    user: peer,
                    secret: iscsi::chap::Secret::new(ownership.peer_secret().as_bytes()),
                    secret_file: None,
                }],
                mutual: None,
            },
            allowed_sources: Vec::new(),
        });
    }
    target.groups.extend(peer_groups);
    Ok(())
}

/// Opens a device's store and builds its logical unit (with the RBD store, for gateways).
/// `gateway`: portal groups name gateways, so an RBD image gets a cluster connection of its own
/// (a fence blocklists only it).
fn open_unit(
    device: &DeviceConfig,
    gateway: bool,
) -> Result<(Arc<LogicalUnit>, Option<Arc<store::RbdStore>>), OpenError> {
    let mut rbd = None;
    let store: Arc<dyn BlockStore> = match &device.store {
        StoreKind::Ram { size_bytes } => Arc::new(RamStore::new(*size_bytes)),
        StoreKind::File { path, size_bytes } => {
            Arc::new(open_file_store(device, path, *size_bytes)?)
        }
        StoreKind::Block { path } => Arc::new(open_file_store(device, path, None)?),
        StoreKind::Rbd(spec) => {
            let opened = if gateway {
                store::RbdStore::open_dedicated(spec)
            } else {
                store::RbdStore::open(spec)
            };
            let store = Arc::new(opened.map_err(|e| {
                let what = format!("rbd image {}/{}", spec.pool, spec.image);
                // A missing image or pool is the config's error; anything else (a cluster
                // down, a timeout, no libraries) may pass.
                if e.kind() == std::io::ErrorKind::NotFound {
                    OpenError::device(device.located(), format!("{what}: {e}"))
                } else {
                    OpenError::Unavailable {
                        located: device.located(),
                        what,
                        reason: e.to_string(),
                    }
                }
            })?);
            rbd = Some(Arc::clone(&store));
            store
        }
    };
    let identity = lu_identity(device);
    let settings = LuSettings {
        block_size: device.block_size,
        read_only: device.read_only,
        write_cache: device.write_cache,
        thin: device.thin,
    };
    let unit = LogicalUnit::new(store, identity, settings)
        .map_err(|e| OpenError::device(device.located(), e))?;
    // SPC-2 RESERVE/RELEASE stay off: with them on, libiscsi 1.19's Reserve6.LUNReset trips over
    // the 29h/03h unit attention a LOGICAL UNIT RESET leaves on the requesting nexus (tgt fails
    // that test too). See `LogicalUnit::set_spc2_reservations` and docs/CONFORMANCE.md.
    Ok((Arc::new(unit), rbd))
}

/// Opens a file or block device as its `cache` setting asks (see [`CacheMode`]): `auto` takes
/// direct I/O where it works and says in the log why not where it does not.
fn open_file_store(
    device: &DeviceConfig,
    path: &std::path::Path,
    size: Option<u64>,
) -> Result<FileStore, OpenError> {
    let located =
        |e: std::io::Error| OpenError::device(device.located(), format!("{}: {e}", path.display()));
    let open = |caching| FileStore::open_with(path, size, device.thin, caching).map_err(located);
    let too_coarse = |store: &FileStore| {
        store
            .direct_io()
            .map(|d| d.alignment)
            .filter(|&alignment| alignment > device.block_size)
    };
    match device.cache {
        CacheMode::Page => open(Caching::Page),
        CacheMode::Direct => {
            let store = open(Caching::Direct)?;
            match too_coarse(&store) {
                Some(alignment) => Err(OpenError::device(
                    format!("device {}", device.name),
                    format!(
                        "{}: direct I/O needs {alignment}-byte alignment, larger than \
                         block_size {}: set block_size = {alignment}, or cache = \"page\"",
                        path.display(),
                        device.block_size
                    ),
                )),
                None => Ok(store),
            }
        }
        CacheMode::Auto => {
            let paged = open(Caching::Page)?;
            // A file in memory (tmpfs) is fastest through its cache: nothing waits there.
            if !paged.capabilities().waits_for_device {
                return Ok(paged);
            }
            match FileStore::open_with(path, size, device.thin, Caching::Direct) {
                Ok(direct) => match too_coarse(&direct) {
                    None => Ok(direct),
                    Some(alignment) => {
                        tracing::warn!(
                            "device {}: {} needs {alignment}-byte direct I/O but the LU has \
                             {}-byte blocks: using the page cache (block_size = {alignment} \
                             would allow direct I/O)",
                            device.name,
                            path.display(),
                            device.block_size
                        );
                        Ok(paged)
                    }
                },
                Err(e) => {
                    tracing::warn!(
                        "device {}: no direct I/O on {} ({e}): using the page cache",
                        device.name,
                        path.display()
                    );
                    Ok(paged)
                }
            }
        }
    }
}

/// What INQUIRY reports of `device`: its vendor and product (ferrosan's by default), serial
/// and NAA designator. A reload that renames a device gives its LU the new one.
pub fn lu_identity(device: &DeviceConfig) -> LuIdentity {
    let mut naa = [0u8; 16];
    let naa_len = device.naa.len().min(16);
    naa[..naa_len].copy_from_slice(&device.naa[..naa_len]);
    LuIdentity {
        vendor: device.vendor.as_deref().unwrap_or("FERROSAN").into(),
        product: device
            .product
            .as_deref()
            .unwrap_or(device.store.product())
            .into(),
        revision: revision(),
        serial: device.serial.clone(),
        naa,
        naa_len,
    }
}

/// INQUIRY's 4-character product revision, from the crate version ("0.1.0" -> "0.1").
fn revision() -> String {
    env!("CARGO_PKG_VERSION")
        .chars()
        .take(4)
        .collect::<String>()
        .trim_end_matches('.')
        .to_string()
}

/// Applies reservations loaded from a device's state file, and says so.
fn restored(device: &str, unit: &LogicalUnit, saved: &scsi::PersistentReservations) {
    unit.restore_reservations(saved);
    tracing::info!(
        "device {device}: restored persistent reservations ({} registrations{})",
        saved.registrations.len(),
        if saved.reservation.is_some() {
            ", reserved"
        } else {
            ""
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_targets_units_are_listed_once_each_in_the_order_first_mapped() {
        let unit = |name: &str| {
            let device = Config::device_from_spec(name, "ram:1M").unwrap();
            open_unit(&device, false).unwrap().0
        };
        let (a, b, c) = (unit("a"), unit("b"), unit("c"));
        let mut units = TargetUnits::default();
        for u in [&b, &a, &b, &c, &a, &b] {
            units.add(u);
        }
        let order: Vec<*const LogicalUnit> = units.units.iter().map(Arc::as_ptr).collect();
        assert_eq!(
            order,
            vec![Arc::as_ptr(&b), Arc::as_ptr(&a), Arc::as_ptr(&c)]
        );
    }
}
