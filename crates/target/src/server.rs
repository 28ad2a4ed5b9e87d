//! The running target: logical units built from the config, listeners, the acceptor and the
//! worker threads that own connections from accept to close.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use scsi::{AccessState, LogicalUnit, LuIdentity, LuSettings, LunMap, PortGroup, TargetPort};
use store::{BlockStore, Caching, FileStore, RamStore};
use tokio::sync::{mpsc, watch};

use crate::alarm::Alarm;
use crate::busy_poll;
use crate::config::{
    CacheMode, ChapAlgorithm, Config, DeviceConfig, DiscoveryConfig, IscsiName, Limits, StoreKind,
    TargetConfig,
};
use crate::connection;
use crate::registry::Registry;
use crate::stall::WriteStalls;

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
    pub iqn: IscsiName,
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

/// Why [`Shared::admit`] refused a login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such target on this portal (Login Response 0x0203).
    NoSuchTarget,
    /// The initiator is in no group and the target has no `any_initiator` group (0x0202).
    NotInAnyGroup,
    /// The source address is outside `allowed_sources` (0x0202).
    SourceNotAllowed,
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

/// State shared by all workers. Read-mostly; the registry and connection counters are the only
/// locked parts and are touched at accept, login and close only.
pub struct Shared {
    pub targets: Vec<TargetRuntime>,
    pub portals: Vec<(SocketAddr, u16)>,
    pub limits: Limits,
    pub registry: Arc<Registry>,
    pub next_nexus_id: AtomicU64,
    connections: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, u32>>,
    /// Authentication of discovery sessions.
    pub discovery: DiscoveryConfig,
    /// CHAP algorithms accepted, in order of preference.
    pub chap_algorithms: Vec<ChapAlgorithm>,
    login_failures: Mutex<LoginFailures>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Set when the daemon shuts down: listeners close, logins in progress end, and every
    /// session is asked to log out within `limits.shutdown_grace_s`.
    shutdown: watch::Sender<bool>,
}

/// Sources whose failures are remembered at most; past it, sources whose failures all expired
/// are forgotten first, and a new source is not tracked while none has expired (logged).
const FAILURE_SOURCES_MAX: usize = 4096;

/// Recent failed logins per source address (the rate limiter of docs/CONFIG.md,
/// `login_failures_max` per `login_failure_window_s`).
#[derive(Default)]
struct LoginFailures {
    by_source: HashMap<IpAddr, VecDeque<Instant>>,
}

impl Shared {
    /// Resolves once the daemon is shutting down.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// Resolves once the daemon is shutting down; the receiver comes from `shutdown_signal`.
    /// Holds no borrow of the watched value, so it can sit in a `select!` across awaits.
    pub async fn wait_for_shutdown(rx: &mut watch::Receiver<bool>) {
        if rx.wait_for(|down| *down).await.is_err() {
            // The sender lives as long as `Shared`: without it nobody can shut us down.
            std::future::pending::<()>().await;
        }
    }

    /// Whether the daemon is shutting down. Takes the watch's read lock: for checks once a
    /// second, not per command (connections read it on their tick).
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Open TCP connections (admitted ones, in login or full feature phase).
    pub fn open_connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    /// The target named `iqn`, with its index in `targets`.
    pub fn target(&self, iqn: &IscsiName) -> Option<(usize, &TargetRuntime)> {
        self.targets.iter().enumerate().find(|(_, t)| t.iqn == *iqn)
    }

    /// The group `initiator` belongs to in target `target` (an index in `targets`), if any.
    pub fn membership(&self, target: usize, initiator: &IscsiName) -> Option<Membership> {
        let group = self.targets.get(target)?.config.group_index(initiator)?;
        Some(Membership { target, group })
    }

    /// Whether `initiator`, coming from `source` to the portal group `portal_group_tag`, may
    /// log in to `target_name`; if so, as which member and with what authentication. One
    /// lookup decides the group; the authentication and the source check come from it, and
    /// so does the session's LUN map ([`Shared::group_of`]).
    pub fn admit(
        &self,
        initiator: &IscsiName,
        target_name: &IscsiName,
        portal_group_tag: u16,
        source: IpAddr,
    ) -> Result<(Membership, crate::config::ResolvedAuth), Refusal> {
        let (index, target) = self.target(target_name).ok_or(Refusal::NoSuchTarget)?;
        if !target.portal_groups.contains(&portal_group_tag) {
            // Not served on this portal: to this initiator it does not exist here.
            return Err(Refusal::NoSuchTarget);
        }
        let membership = self
            .membership(index, initiator)
            .ok_or(Refusal::NotInAnyGroup)?;
        let (group, _) = target
            .group(membership.group)
            .ok_or(Refusal::NotInAnyGroup)?;
        if !target.config.source_allowed(Some(group), source) {
            return Err(Refusal::SourceNotAllowed);
        }
        Ok((membership, target.config.auth_in(initiator, Some(group))))
    }

    /// The runtime group (LUN map) of an admitted initiator.
    pub fn group_of(&self, membership: Membership) -> Option<(&TargetRuntime, &GroupRuntime)> {
        let target = self.targets.get(membership.target)?;
        Some((target, target.group(membership.group)?.1))
    }

    /// Admits a new TCP connection under the connection limits; the guard releases it.
    fn admit_connection(self: &Arc<Self>, source: IpAddr) -> Result<ConnectionGuard, &'static str> {
        let total = self.connections.fetch_add(1, Ordering::AcqRel);
        if total >= self.limits.max_connections as usize {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            return Err("max_connections");
        }
        let mut per = self.per_source.lock().unwrap_or_else(|e| e.into_inner());
        let n = per.entry(source).or_insert(0);
        if *n >= self.limits.max_connections_per_source {
            drop(per);
            self.connections.fetch_sub(1, Ordering::AcqRel);
            return Err("max_connections_per_source");
        }
        *n += 1;
        self.metrics.connections.inc();
        Ok(ConnectionGuard {
            shared: Arc::clone(self),
            source,
            worker_load: None,
        })
    }

    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    fn failure_window(&self) -> Duration {
        Duration::from_secs(self.limits.login_failure_window_s.into())
    }

    /// Whether logins from `source` are refused for now: `login_failures_max` failures within
    /// the window. The refusal lifts when the oldest of them leaves the window.
    pub fn login_blocked(&self, source: IpAddr, now: Instant) -> bool {
        let max = self.limits.login_failures_max as usize;
        if max == 0 {
            return false;
        }
        let window = self.failure_window();
        let mut log = self
            .login_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(times) = log.by_source.get_mut(&source) else {
            return false;
        };
        while times
            .front()
            .is_some_and(|t| now.duration_since(*t) >= window)
        {
            times.pop_front();
        }
        if times.is_empty() {
            log.by_source.remove(&source);
            return false;
        }
        times.len() >= max
    }

    /// Counts a failed login (authentication or authorization) from `source`.
    pub fn record_login_failure(&self, source: IpAddr, now: Instant) {
        let max = self.limits.login_failures_max as usize;
        if max == 0 {
            return;
        }
        let window = self.failure_window();
        let mut log = self
            .login_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !log.by_source.contains_key(&source) && log.by_source.len() >= FAILURE_SOURCES_MAX {
            log.by_source.retain(|_, times| {
                times
                    .back()
                    .is_some_and(|t| now.duration_since(*t) < window)
            });
            if log.by_source.len() >= FAILURE_SOURCES_MAX {
                tracing::warn!(%source, "login failure not tracked: {FAILURE_SOURCES_MAX} sources already are");
                return;
            }
        }
        let times = log.by_source.entry(source).or_default();
        times.push_back(now);
        // Only the newest `max` matter.
        while times.len() > max {
            times.pop_front();
        }
    }
}

pub struct ConnectionGuard {
    shared: Arc<Shared>,
    source: IpAddr,
    /// The open-connection gauge of the worker the connection was given to.
    worker_load: Option<Gauge>,
}

impl ConnectionGuard {
    /// Counts the connection on its worker until the guard drops.
    fn place_on(&mut self, worker_load: &Gauge) {
        worker_load.inc();
        self.worker_load = Some(worker_load.clone());
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if let Some(load) = &self.worker_load {
            load.dec();
        }
        self.shared.connections.fetch_sub(1, Ordering::AcqRel);
        self.shared.metrics.connections.dec();
        let mut per = self
            .shared
            .per_source
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = per.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per.remove(&self.source);
            }
        }
    }
}

pub struct NewConnection {
    pub stream: std::net::TcpStream,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub portal_group_tag: u16,
    pub guard: ConnectionGuard,
}

/// A started server: listeners bound, workers running.
pub struct Server {
    pub shared: Arc<Shared>,
    pub bound: Vec<SocketAddr>,
}

impl Server {
    /// Opens every store, binds every portal and starts the threads. Errors name what failed.
    pub fn start(config: &Config) -> Result<Server, String> {
        raise_descriptor_limit(config.limits.max_connections);
        let shared = Arc::new(build(config)?);
        let workers = if config.server.workers == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            config.server.workers
        };
        let mut listeners = Vec::new();
        let mut bound = Vec::new();
        for &(addr, tag) in &shared.portals {
            let socket = bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            let local = socket.local_addr().map_err(|e| e.to_string())?;
            bound.push(local);
            listeners.push((socket, tag));
        }
        let metrics_listener = match config.server.metrics_listen {
            Some(addr) => Some(
                crate::metrics::bind(addr)
                    .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?,
            ),
            None => None,
        };
        let io_threads = io_threads_per_worker(config.limits.io_threads, workers);
        // The threads run until the process exits (after `drain`); nobody joins them.
        let mut senders = Vec::new();
        for index in 0..workers {
            let (tx, rx) = mpsc::unbounded_channel::<NewConnection>();
            senders.push(tx);
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("ferrosan-worker-{index}"))
                .spawn(move || worker(shared, index, rx, io_threads))
                .map_err(|e| format!("cannot start worker thread: {e}"))?;
        }
        let acceptor_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("ferrosan-accept".into())
            .spawn(move || acceptor(acceptor_shared, listeners, metrics_listener, senders))
            .map_err(|e| format!("cannot start acceptor thread: {e}"))?;
        Ok(Server { shared, bound })
    }

    /// Graceful shutdown: closes the listeners and logins in progress, asks every session to
    /// log out (each keeps serving its commands meanwhile), waits until all connections are
    /// gone or `shutdown_grace_s` (plus 3 s: sessions notice and close on a 1 s tick) has passed, then flushes
    /// every LU so what was acknowledged is on stable storage. Returns the connections still
    /// open, which end with the process.
    pub async fn drain(&self) -> usize {
        let grace = Duration::from_secs(self.shared.limits.shutdown_grace_s.into());
        self.shared.shutdown.send_replace(true);
        // Connections notice within a second and close within a second of their grace's end.
        let deadline = tokio::time::Instant::now() + grace + Duration::from_secs(3);
        while self.shared.open_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = self.shared.open_connections();
        for target in &self.shared.targets {
            for unit in &target.units {
                if let Err(e) = unit.flush() {
                    tracing::error!(serial = %unit.identity().serial, "flush at shutdown failed: {e}");
                }
            }
        }
        left
    }
}

/// At most one log line per interval; the lines it held back are counted into the next one, so a
/// connection flood cannot flood the log.
struct LogLimiter {
    interval: Duration,
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl LogLimiter {
    fn new(interval: Duration) -> LogLimiter {
        LogLimiter {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(lines suppressed since the last one)` when a line may be logged now.
    fn admit(&mut self, now: std::time::Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < self.interval)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Workers whose busy shares differ by no more than this count as equally busy.
const BUSY_BAND: f64 = 0.10;
/// How often each worker samples its own CPU time for `worker_busy_ratio`.
const BUSY_SAMPLE: Duration = Duration::from_secs(1);

/// The worker to give a new connection to, from each worker's (busy share over the last
/// second, open connections): among the workers within `BUSY_BAND` of the least busy, the one
/// with the fewest connections, ties broken round-robin from `turn` so equal loads still spread.
/// Connections alone would stack a new one on a worker carrying one saturating initiator rather
/// than on one holding two idle sessions; busy share alone would follow one second's noise.
/// Round-robin alone drifts: once connections close unevenly, it keeps stacking new ones on
/// the busier workers.
fn least_loaded(loads: &[(f64, i64)], turn: usize) -> usize {
    let n = loads.len().max(1);
    let least_busy = loads.iter().map(|l| l.0).fold(f64::INFINITY, f64::min);
    (0..n)
        .map(|i| (turn + i) % n)
        .filter_map(|i| loads.get(i).map(|&(busy, conns)| (i, busy, conns)))
        .filter(|&(_, busy, _)| busy <= least_busy + BUSY_BAND)
        .min_by_key(|&(_, _, conns)| conns)
        .map_or(0, |(i, _, _)| i)
}

/// The calling thread's CPU time so far.
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// Each worker's share of the `io_threads` limit (its blocking pool), at least one.
fn io_threads_per_worker(io_threads: u32, workers: usize) -> usize {
    (io_threads as usize / workers.max(1)).max(1)
}

/// Descriptors a connection holds: its socket and its timer (crate::alarm).
const DESCRIPTORS_PER_CONNECTION: u64 = 2;
/// Descriptors besides connections: listeners, LU files, the runtimes' epoll and event fds, each
/// worker's busy-poll epoll and sampling timer, stdio, metrics scrapes.
const DESCRIPTORS_SPARE: u64 = 256;

/// Raises the soft limit on open descriptors to the hard one, as servers do: a shell's soft
/// limit is often 1,024, which `max_connections` (1,024 by default) would exhaust at about half
/// its value, each connection holding two. Warns if even the hard limit is too low.
/// (`dist/ferrosan.service` sets `LimitNOFILE` for the systemd case.)
fn raise_descriptor_limit(max_connections: u32) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let need = u64::from(max_connections)
        .saturating_mul(DESCRIPTORS_PER_CONNECTION)
        .saturating_add(DESCRIPTORS_SPARE);
    let limit = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    if limit.current != limit.maximum {
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::debug!(
                "open descriptor limit raised from {:?} to {:?}",
                limit.current,
                limit.maximum
            ),
            Err(e) => tracing::warn!("cannot raise the open descriptor limit: {e}"),
        }
    }
    // `None` is unlimited.
    if let Some(soft) = getrlimit(Resource::Nofile)
        .current
        .filter(|&soft| soft < need)
    {
        tracing::warn!(
            "open descriptor limit {soft} is below the {need} that max_connections = \
             {max_connections} may need; connections beyond it are refused at accept"
        );
    }
}

fn worker(
    shared: Arc<Shared>,
    index: usize,
    mut rx: mpsc::UnboundedReceiver<NewConnection>,
    io_threads: usize,
) {
    // No time driver: its clock reads and timer wheel run on every park (3-6% of a QD1 I/O's
    // CPU, measured). Timers here are timerfds (crate::alarm); tokio::time would panic.
    busy_poll::install(Duration::from_micros(shared.limits.busy_poll_us.into()));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .on_thread_park(busy_poll::before_park)
        .on_thread_unpark(busy_poll::after_unpark)
        .max_blocking_threads(io_threads)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("worker runtime: {e}");
            return;
        }
    };
    runtime.block_on(async move {
        // The worker measures itself (its thread's CPU time, once a second) for placement.
        let busy = shared.metrics.worker_busy(index);
        let metrics = Arc::clone(&shared.metrics);
        tokio::spawn(async move {
            let mut alarm = match Alarm::new() {
                Ok(alarm) => alarm,
                Err(e) => {
                    // Placement then sees this worker as idle and balances by connections.
                    tracing::warn!("worker {index}: no busy sampling: timer: {e}");
                    return;
                }
            };
            // The first sample after a whole period: one taken at once would publish the share
            // of a few microseconds (0.01 on an idle machine, 0.26 under a CPU hog), and
            // placement would follow that noise for the daemon's first second.
            let mut last = (std::time::Instant::now(), thread_cpu_time());
            loop {
                let rung = match alarm.set(last.0 + BUSY_SAMPLE) {
                    Ok(()) => alarm.rung().await,
                    Err(e) => Err(e),
                };
                if let Err(e) = rung {
                    tracing::warn!("worker {index}: busy sampling stopped: timer: {e}");
                    return;
                }
                let now = (std::time::Instant::now(), thread_cpu_time());
                let wall = now.0.saturating_duration_since(last.0);
                // Busy polling happens only when the worker had nothing else to do.
                let polled = busy_poll::report(&metrics);
                if !wall.is_zero() {
                    let cpu = now.1.saturating_sub(last.1).saturating_sub(polled);
                    busy.set((cpu.as_secs_f64() / wall.as_secs_f64()).min(1.0));
                }
                last = now;
            }
        });
        while let Some(conn) = rx.recv().await {
            let shared = Arc::clone(&shared);
            tokio::spawn(connection::serve(shared, conn));
        }
        // The acceptor is gone (shutting down): this worker's connections keep running until
        // they close or the process exits; leaving block_on would cancel them.
        std::future::pending::<()>().await
    });
}

fn acceptor(
    shared: Arc<Shared>,
    listeners: Vec<(std::net::TcpListener, u16)>,
    metrics_listener: Option<std::net::TcpListener>,
    senders: Vec<mpsc::UnboundedSender<NewConnection>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("acceptor runtime: {e}");
            return;
        }
    };
    let loads: Vec<(Gauge, Gauge<f64, AtomicU64>)> = (0..senders.len())
        .map(|index| {
            (
                shared.metrics.worker_connections(index),
                shared.metrics.worker_busy(index),
            )
        })
        .collect();
    let workers = Arc::new((senders, loads));
    let next = Arc::new(AtomicUsize::new(0));
    runtime.block_on(async move {
        let mut tasks = Vec::new();
        if let Some(l) = metrics_listener.and_then(|l| tokio::net::TcpListener::from_std(l).ok()) {
            tasks.push(tokio::spawn(crate::metrics::serve(
                l,
                Arc::clone(&shared.metrics),
            )));
        }
        for (listener, tag) in listeners {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!("listener: {e}");
                    continue;
                }
            };
            let shared = Arc::clone(&shared);
            let workers = Arc::clone(&workers);
            let next = Arc::clone(&next);
            tasks.push(tokio::spawn(async move {
                let mut refusal_log = LogLimiter::new(Duration::from_secs(1));
                let mut shutdown = shared.shutdown_signal();
                loop {
                    let accepted = tokio::select! {
                        accepted = listener.accept() => accepted,
                        // Dropping the listener refuses new connections at the TCP level.
                        () = Shared::wait_for_shutdown(&mut shutdown) => return,
                    };
                    let (stream, peer) = match accepted {
                        Ok(x) => x,
                        Err(e) => {
                            // EMFILE and friends: back off instead of spinning.
                            tracing::warn!("accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let mut guard = match shared.admit_connection(peer.ip()) {
                        Ok(g) => g,
                        Err(limit) => {
                            shared.metrics.limit(limit);
                            if let Some(suppressed) = refusal_log.admit(std::time::Instant::now()) {
                                tracing::warn!(
                                    %peer,
                                    limit,
                                    suppressed,
                                    "connection refused: limit reached"
                                );
                            }
                            continue;
                        }
                    };
                    let local = stream.local_addr().unwrap_or(peer);
                    let _ = stream.set_nodelay(true);
                    let Ok(std_stream) = stream.into_std() else {
                        continue;
                    };
                    let (senders, loads) = &*workers;
                    let now: Vec<(f64, i64)> = loads
                        .iter()
                        .map(|(conns, busy)| (busy.get(), conns.get()))
                        .collect();
                    let index = least_loaded(&now, next.fetch_add(1, Ordering::Relaxed));
                    if let (Some(tx), Some((load, _))) = (senders.get(index), loads.get(index)) {
                        guard.place_on(load);
                        let _ = tx.send(NewConnection {
                            stream: std_stream,
                            peer,
                            local,
                            portal_group_tag: tag,
                            guard,
                        });
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });
}

/// Opens a device's store and builds its logical unit.
fn open_unit(device: &DeviceConfig) -> Result<Arc<LogicalUnit>, String> {
    let store: Arc<dyn BlockStore> = match &device.store {
        StoreKind::Ram { size_bytes } => Arc::new(RamStore::new(*size_bytes)),
        StoreKind::File { path, size_bytes } => {
            Arc::new(open_file_store(device, path, *size_bytes)?)
        }
        StoreKind::Block { path } => Arc::new(open_file_store(device, path, None)?),
    };
    let mut naa = [0u8; 16];
    let naa_len = device.naa.len().min(16);
    naa[..naa_len].copy_from_slice(&device.naa[..naa_len]);
    let identity = LuIdentity {
        vendor: "FERROSAN".into(),
        product: product_name(&device.store).into(),
        revision: revision(),
        serial: device.serial.clone(),
        naa,
        naa_len,
    };
    let settings = LuSettings {
        block_size: device.block_size,
        read_only: device.read_only,
        write_cache: device.write_cache,
        thin: device.thin,
    };
    let unit = LogicalUnit::new(store, identity, settings)
        .map_err(|e| format!("device {}: {e}", device.name))?;
    // SPC-2 RESERVE/RELEASE stay off: with them on, libiscsi 1.19's Reserve6.LUNReset trips over
    // the 29h/03h unit attention a LOGICAL UNIT RESET leaves on the requesting nexus (tgt fails
    // that test too). See `LogicalUnit::set_spc2_reservations` and docs/CONFORMANCE.md.
    Ok(Arc::new(unit))
}

/// Opens a file or block device as its `cache` setting asks (see [`CacheMode`]): `auto` takes
/// direct I/O where it works and says in the log why not where it does not.
fn open_file_store(
    device: &DeviceConfig,
    path: &std::path::Path,
    size: Option<u64>,
) -> Result<FileStore, String> {
    let located = |e: std::io::Error| format!("device {}: {}: {e}", device.name, path.display());
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
                Some(alignment) => Err(format!(
                    "device {}: {}: direct I/O needs {alignment}-byte alignment, larger than \
                     block_size {}: set block_size = {alignment}, or cache = \"page\"",
                    device.name,
                    path.display(),
                    device.block_size
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

/// Whether this store sits on a real device, so that making data durable waits for it and
/// buffered writes can stall in the kernel. RAM never does; files on tmpfs/ramfs have nothing to
/// flush or write back; anything else (disk filesystems, block devices) does.
fn product_name(kind: &StoreKind) -> &'static str {
    match kind {
        StoreKind::Ram { .. } => "RAM DISK",
        StoreKind::File { .. } => "FILE DISK",
        StoreKind::Block { .. } => "BLOCK DISK",
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

fn build(config: &Config) -> Result<Shared, String> {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let epoch = Instant::now();
    let stall_base = Duration::from_micros(config.limits.write_stall_us.into());
    let mut units: HashMap<&str, Arc<LogicalUnit>> = HashMap::new();
    let mut disk_devices: HashMap<&str, (Arc<WriteStalls>, Option<store::DirectIo>, bool)> =
        HashMap::new();
    let io_uring = config.server.io_uring && {
        match crate::ring::DeviceRing::<()>::probe() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "io_uring unavailable ({e}): direct-I/O devices run on the I/O thread pool"
                );
                false
            }
        }
    };
    let state_dir = crate::state::state_dir(config.server.state_dir.as_deref());
    for device in &config.devices {
        let unit = open_unit(device)?;
        // Files and block devices keep their reservations across restarts when asked (APTPL);
        // a RAM LU's medium does not survive a restart, nor do its reservations.
        let medium = match &device.store {
            StoreKind::File { path, .. } | StoreKind::Block { path } => Some(path),
            StoreKind::Ram { .. } => None,
        };
        if let (Some(medium), Some(dir)) = (medium, &state_dir) {
            let path = crate::state::reservation_file(dir, &device.name, medium);
            let file = crate::state::ReservationFile::new(path, medium, &device.name);
            let saved = file.load().map_err(|e| {
                format!(
                    "device {}: persistent reservations: {e} (remove the file to start without them)",
                    device.name
                )
            })?;
            if let Some(saved) = saved {
                unit.restore_reservations(&saved);
                tracing::info!(
                    "device {}: restored persistent reservations ({} registrations{})",
                    device.name,
                    saved.registrations.len(),
                    if saved.reservation.is_some() {
                        ", reserved"
                    } else {
                        ""
                    }
                );
            }
            unit.set_pr_persistence(Arc::new(file));
        }
        // The store says whether it waits for a device; nothing is guessed from its kind.
        let caps = unit.capabilities();
        let path = match (caps.direct, io_uring) {
            (true, true) => "io_uring",
            (true, false) => "threads",
            (false, _) if caps.page_cache && caps.waits_for_device => "page_cache",
            (false, _) => "memory",
        };
        metrics.device_io_path(&device.name, path);
        tracing::info!("device {}: I/O path {path}", device.name);
        let ring = if io_uring { unit.direct_io() } else { None };
        units.insert(device.name.as_str(), unit);
        if caps.waits_for_device {
            let (stalls, offloaded) = metrics.device_writes(&device.name);
            let state = WriteStalls::new(epoch, stall_base, stalls, offloaded);
            disk_devices.insert(device.name.as_str(), (Arc::new(state), ring, caps.direct));
        }
    }
    let mut targets = Vec::new();
    for t in &config.targets {
        let portal_groups = if t.portal_groups.is_empty() {
            config.portal_groups.iter().map(|p| p.tag).collect()
        } else {
            t.portal_groups.clone()
        };
        let mut groups = Vec::new();
        let mut target_units: Vec<Arc<LogicalUnit>> = Vec::new();
        for g in &t.groups {
            let mut entries = Vec::new();
            let mut disk_luns = Vec::new();
            let mut lun_devices = Vec::new();
            for m in &g.luns {
                lun_devices.push((m.lun, Arc::<str>::from(m.device.as_str())));
                if let Some((stalls, ring, direct)) = disk_devices.get(m.device.as_str()) {
                    disk_luns.push(DiskLun {
                        lun: m.lun,
                        stalls: Arc::clone(stalls),
                        ring: ring.clone(),
                        direct: *direct,
                    });
                }
                let unit = units
                    .get(m.device.as_str())
                    .ok_or_else(|| format!("target {}: unknown device {}", t.iqn, m.device))?;
                if !target_units.iter().any(|u| Arc::ptr_eq(u, unit)) {
                    target_units.push(Arc::clone(unit));
                }
                entries.push((m.lun, Arc::clone(unit), m.read_only));
            }
            let luns = LunMap::new(entries)
                .map_err(|e| format!("target {} group {}: {e}", t.iqn, g.name))?;
            groups.push(GroupRuntime {
                name: g.name.clone(),
                luns: Arc::new(luns),
                disk_luns: Arc::new(disk_luns),
                lun_devices: Arc::new(lun_devices),
            });
        }
        // ALUA: each portal group is one target port of this target and a target port group of
        // its own, numbered by its tag, in the state the config gives it.
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
        let ports = portal_groups
            .iter()
            .map(|&tag| {
                (
                    tag,
                    Arc::new(TargetPort {
                        relative_id: tag,
                        name: format!("{},t,0x{tag:04x}", t.iqn),
                        target_name: t.iqn.to_string(),
                        group: tag,
                        groups: Arc::clone(&alua_groups),
                    }),
                )
            })
            .collect();
        if t.groups.iter().any(|g| g.any_initiator) {
            tracing::warn!(target = %t.iqn, "target is open to any initiator (any_initiator = true)");
        }
        assert_eq!(
            groups.len(),
            t.groups.len(),
            "one runtime group per configured group"
        );
        targets.push(TargetRuntime {
            iqn: t.iqn.clone(),
            alias: t.alias.clone(),
            portal_groups,
            groups,
            ports,
            units: target_units,
            config: t.clone(),
        });
    }
    let portals = config
        .portal_groups
        .iter()
        .flat_map(|p| p.listen.iter().map(move |a| (*a, p.tag)))
        .collect();
    Ok(Shared {
        targets,
        portals,
        limits: config.limits.clone(),
        registry: Arc::new(Registry::new(config.limits.max_sessions as usize)),
        next_nexus_id: AtomicU64::new(1),
        connections: AtomicUsize::new(0),
        per_source: Mutex::new(HashMap::new()),
        discovery: config.discovery.clone(),
        chap_algorithms: config.server.chap_algorithms.clone(),
        login_failures: Mutex::new(LoginFailures::default()),
        metrics,
        shutdown: watch::Sender::new(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_connections_go_to_the_least_loaded_worker() {
        // Equally idle workers: fewest connections.
        let idle = |conns: &[i64]| conns.iter().map(|&c| (0.0, c)).collect::<Vec<_>>();
        assert_eq!(least_loaded(&idle(&[3, 1, 2]), 0), 1);
        assert_eq!(least_loaded(&idle(&[3, 1, 2]), 2), 1);
        // Ties go round-robin from the turn, so equal loads still spread.
        assert_eq!(least_loaded(&idle(&[0, 0, 0]), 0), 0);
        assert_eq!(least_loaded(&idle(&[0, 0, 0]), 1), 1);
        assert_eq!(least_loaded(&idle(&[0, 0, 0]), 5), 2);
        assert_eq!(least_loaded(&idle(&[2, 1, 1]), 0), 1);
        assert_eq!(least_loaded(&idle(&[2, 1, 1]), 2), 2);
        // Round-robin would give the next two to workers 0 and 1 here; both go to 0.
        assert_eq!(least_loaded(&idle(&[0, 2]), 4), 0);
        assert_eq!(least_loaded(&idle(&[1, 2]), 5), 0);
        // One worker, or none configured: index 0.
        assert_eq!(least_loaded(&idle(&[7]), 3), 0);
        assert_eq!(least_loaded(&[], 3), 0);
    }

    #[test]
    fn a_busy_worker_gets_no_new_connection_while_another_idles() {
        // One saturating initiator against two idle sessions: the idle worker, whatever the turn.
        for turn in 0..4 {
            assert_eq!(least_loaded(&[(0.9, 1), (0.02, 2)], turn), 1);
            assert_eq!(least_loaded(&[(0.02, 5), (0.9, 1), (0.5, 0)], turn), 0);
        }
        // Within the band, busy shares are noise: connections decide, then round-robin.
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 2)], 0), 0);
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 1)], 0), 0);
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 1)], 1), 1);
        // Just outside the band: the less busy one.
        assert_eq!(least_loaded(&[(0.17, 0), (0.06, 3)], 0), 1);
        // A nonsense share (NaN) never wins over a measured one, nor breaks the choice.
        assert_eq!(least_loaded(&[(f64::NAN, 0), (0.3, 4)], 0), 1);
    }

    #[test]
    fn io_threads_are_shared_out_and_never_zero() {
        assert_eq!(io_threads_per_worker(128, 2), 64);
        assert_eq!(io_threads_per_worker(128, 3), 42);
        assert_eq!(io_threads_per_worker(1, 16), 1, "every worker can defer");
        assert_eq!(io_threads_per_worker(4096, 0), 4096);
    }

    #[test]
    fn log_limiter_counts_what_it_holds_back() {
        let mut l = LogLimiter::new(Duration::from_secs(1));
        let t0 = std::time::Instant::now();
        assert_eq!(l.admit(t0), Some(0));
        assert_eq!(l.admit(t0 + Duration::from_millis(10)), None);
        assert_eq!(l.admit(t0 + Duration::from_millis(500)), None);
        assert_eq!(l.admit(t0 + Duration::from_millis(1000)), Some(2));
        assert_eq!(l.admit(t0 + Duration::from_millis(1001)), None);
    }

    /// The reproduction of the authorization bypass (docs/SECURITY.md): group `plain` lists an
    /// initiator with a non-ASCII name and needs no CHAP, the any-initiator group `protected`
    /// needs CHAP. Every spelling of a name must land in one group, and the authentication a
    /// login demands must be that group's, as must the LUN map its session gets.
    const IDENTITY_CONFIG: &str = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "small"
store = "ram"
size = "16M"
[[device]]
name = "big"
store = "ram"
size = "48M"
[[device]]
name = "mid"
store = "ram"
size = "32M"
[[target]]
iqn = "iqn.2026-11.test:target"
  [[target.group]]
  name = "plain"
  auth = "none"
  initiators = ["iqn.2026-11.test:é", "iqn.2026-11.test:strasse"]
  luns = [ { lun = 0, device = "small" } ]
  [[target.group]]
  name = "kelvin"
  auth = "none"
  initiators = ["iqn.2026-11.test:k-a", "eui.02004567a425678d"]
  luns = [ { lun = 0, device = "mid" } ]
  [[target.group]]
  name = "protected"
  any_initiator = true
  auth = "chap"
  users = [ { user = "u", secret = "protected-s3cret-2026" } ]
  luns = [ { lun = 0, device = "big" } ]
"#;

    /// Spellings of one name an initiator may send: case changes, decomposed accents,
    /// characters stringprep maps to nothing, compatibility forms.
    fn respell(name: &str, mut seed: u64) -> String {
        let mut out = String::new();
        for c in name.chars() {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let pick = (seed >> 33) % 6;
            match (c, pick) {
                ('é', 0) => out.push('É'),
                ('é', 1) => out.push_str("e\u{301}"),
                ('é', 2) => out.push_str("E\u{301}"),
                ('k', 0) => out.push('\u{212a}'), // Kelvin sign
                ('s', 1) => out.push('S'),
                (c, 3) if c.is_ascii_lowercase() => out.push(c.to_ascii_uppercase()),
                (c, 4) if c.is_ascii_lowercase() => {
                    // Fullwidth form (NFKC maps it back).
                    out.push(char::from_u32(c as u32 - 'a' as u32 + 0xff41).unwrap_or(c));
                }
                (c, 5) => {
                    out.push(c);
                    out.push('\u{ad}'); // soft hyphen: mapped to nothing
                }
                (c, _) => out.push(c),
            }
        }
        out
    }

    #[test]
    fn authentication_and_lun_map_come_from_one_group_for_any_spelling() {
        let config = Config::from_toml_str(IDENTITY_CONFIG, "identity.toml").unwrap();
        let shared = build(&config).unwrap();
        let target = IscsiName::from_wire("iqn.2026-11.test:target").unwrap();
        let source: IpAddr = "127.0.0.1".parse().unwrap();
        let bases = [
            "iqn.2026-11.test:é",
            "iqn.2026-11.test:strasse",
            "iqn.2026-11.test:straße",
            "iqn.2026-11.test:k-a",
            "eui.02004567a425678d",
            "iqn.2026-11.test:e",
            "iqn.2026-11.test:other",
        ];
        let mut checked = 0;
        for (b, base) in bases.iter().enumerate() {
            for round in 0..400u64 {
                let spelling = respell(base, round * 7919 + b as u64);
                let Ok(name) = IscsiName::from_wire(&spelling) else {
                    continue;
                };
                // The oracle: the group listing the normal form, else the any-initiator group.
                let oracle = config.targets[0]
                    .groups
                    .iter()
                    .position(|g| g.initiators.iter().any(|i| i.as_str() == name.as_str()))
                    .unwrap_or(2);
                let (membership, auth) = shared.admit(&name, &target, 1, source).unwrap();
                assert_eq!(membership.group, oracle, "{spelling:?}");
                let (_, group) = shared.group_of(membership).unwrap();
                assert_eq!(group.name, config.targets[0].groups[oracle].name);
                let oracle_auth =
                    config.targets[0].auth_in(&name, Some(&config.targets[0].groups[oracle]));
                assert_eq!(auth, oracle_auth, "{spelling:?}");
                // Every spelling of a base is the base.
                let normal = IscsiName::from_wire(base).unwrap();
                assert_eq!(name, normal, "{spelling:?} is {base:?}");
                checked += 1;
            }
        }
        assert!(checked > 2000, "only {checked} spellings were names");
        // The reproduction, concretely: É is é, which needs no CHAP and gets the 16 MiB LU.
        let upper = IscsiName::from_wire("iqn.2026-11.test:É").unwrap();
        let (membership, auth) = shared.admit(&upper, &target, 1, source).unwrap();
        assert_eq!(auth, crate::config::ResolvedAuth::None);
        let (_, group) = shared.group_of(membership).unwrap();
        let lu = &group.luns.get(0).unwrap().lu;
        assert_eq!(lu.capacity_bytes(), 16 << 20);
    }

    fn shared(max: u32, window_s: u32) -> Shared {
        let mut config = Config::demo();
        config.devices.clear();
        config.targets.clear();
        config.limits.login_failures_max = max;
        config.limits.login_failure_window_s = window_s;
        build(&config).unwrap()
    }

    #[test]
    fn failed_logins_are_rate_limited_per_source() {
        let s = shared(3, 60);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        for i in 0..3 {
            assert!(!s.login_blocked(a, t0), "blocked after {i} failures");
            s.record_login_failure(a, t0 + Duration::from_secs(i));
        }
        assert!(s.login_blocked(a, t0 + Duration::from_secs(10)));
        assert!(
            !s.login_blocked(b, t0 + Duration::from_secs(10)),
            "per source"
        );
        // The oldest failure leaves the window: one more attempt is allowed.
        assert!(!s.login_blocked(a, t0 + Duration::from_secs(60)));
        assert!(!s.login_blocked(a, t0 + Duration::from_secs(200)));
    }

    #[test]
    fn zero_disables_the_rate_limit() {
        let s = shared(0, 60);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..100 {
            s.record_login_failure(a, t0);
        }
        assert!(!s.login_blocked(a, t0));
    }
}
