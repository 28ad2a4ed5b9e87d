//! The running target: logical units built from the config, listeners, the acceptor and the
//! worker threads that own connections from accept to close.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};

use crate::admission::doors::Doors;
use crate::config::{Config, ConfigSource};
use crate::dataplane::alarm::Alarm;
use crate::dataplane::busy_poll;
use crate::dataplane::connection::{self, ListenerKind, NewConnection};
use crate::shared::listening::Accepting;
use crate::shared::Shared;
use crate::topology::{DeviceContext, OpenError, Topology};

/// Why the daemon did not start. Nothing was left behind: no device file was created or grown
/// before every port was bound.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Portal groups name gateways, and this daemon is none of them (or names none).
    #[error("{0}")]
    Gateway(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the remote API: {0}")]
    Api(#[from] crate::control::api::ApiError),
    #[error("the remote API cannot listen on {addr}: {source}")]
    ApiListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    ControlSocket(#[from] crate::control::SocketError),
    #[error("cannot start the {0} thread: {1}")]
    Thread(&'static str, std::io::Error),
}

impl StartError {
    /// The process's exit status: 2 for what the config says (fix the config), 1 for what
    /// the host refused (a port taken, a device missing, a cluster down).
    pub fn exit_code(&self) -> u8 {
        match self {
            StartError::Gateway(_) | StartError::Open(OpenError::Config(_)) => 2,
            _ => 1,
        }
    }
}

/// A started server: listeners bound, workers running.
pub struct Server {
    pub shared: Arc<Shared>,
    pub bound: Vec<SocketAddr>,
    /// The NVMe/TCP listeners, as bound.
    pub bound_nvme: Vec<SocketAddr>,
    /// The NVMe/TCP discovery listeners, as bound.
    pub bound_discovery: Vec<SocketAddr>,
    /// Where `ferrosan ctl` reaches this daemon; None if no control socket could be had.
    pub control_socket: Option<std::path::PathBuf>,
    control_inode: u64,
}

impl Server {
    /// Opens every store, binds every portal and starts the threads. Errors name what failed.
    pub fn start(config: &Config, source: ConfigSource) -> Result<Server, StartError> {
        raise_descriptor_limit(config.limits.max_connections);
        check_gateway(config)?;
        // Every port first: a start that cannot listen must not have created or grown any
        // device file.
        let listening = crate::shared::listening::Listening::default();
        let listeners = listening
            .prepare(&crate::topology::portals::listeners(config))
            .map_err(|e| StartError::Listen {
                addr: e.addr,
                source: e.source,
            })?;
        let bound = listeners.bound(ListenerKind::Iscsi);
        let bound_nvme = listeners.bound(ListenerKind::Nvme);
        let bound_discovery = listeners.bound(ListenerKind::NvmeDiscovery);
        let metrics_listener = match config.server.metrics_listen {
            Some(addr) => Some(
                crate::metrics::bind(addr)
                    .map_err(|source| StartError::Metrics { addr, source })?,
            ),
            None => None,
        };
        let api = bind_api(config)?;
        crate::control::recover_pools(config);
        let mut shared = build(config)?;
        if source.path.is_some() {
            *shared
                .file_base
                .get_mut()
                .unwrap_or_else(|e| e.into_inner()) =
                Some(crate::config::edit::FileBase::loaded(config.clone()));
        }
        shared.source = source;
        shared.listening = listening;
        let shared = Arc::new(shared);
        let workers = worker_count(config);
        let control = bind_control(config)?;
        let control_socket = control.as_ref().map(|c| c.path.clone());
        let control_inode = control.as_ref().map_or(0, |c| c.inode);
        let io_threads = io_threads_per_worker(config.limits.io_threads, workers);
        let senders = start_workers(&shared, workers, io_threads)?;
        start_watchers(&shared)?;
        let acceptor_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("ferrosan-accept".into())
            .spawn(move || {
                acceptor(
                    acceptor_shared,
                    listeners,
                    metrics_listener,
                    api,
                    control,
                    senders,
                )
            })
            .map_err(|e| StartError::Thread("acceptor", e))?;
        Ok(Server {
            shared,
            bound,
            bound_nvme,
            bound_discovery,
            control_socket,
            control_inode,
        })
    }

    /// Graceful shutdown: closes the listeners and logins in progress, asks every session to
    /// log out (each keeps serving its commands meanwhile), waits until all connections are
    /// gone or `shutdown_grace_s` (plus 3 s: sessions notice and close on a 1 s tick) has passed, then flushes
    /// every LU so what was acknowledged is on stable storage. Returns the connections still
    /// open, which end with the process.
    pub async fn drain(&self) -> usize {
        let grace = Duration::from_secs(self.shared.limits.shutdown_grace_s.into());
        self.shared.shut_down();
        // Connections notice within a second and close within a second of their grace's end.
        let deadline = tokio::time::Instant::now() + grace + Duration::from_secs(3);
        while self.shared.doors.open_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = self.shared.doors.open_connections();
        if let Some(path) = &self.control_socket {
            crate::control::remove_if_ours(path, self.control_inode);
        }
        for (name, device) in &self.shared.topology().devices {
            // A gateway that does not own its image wrote nothing to it (the owner did).
            if device.ownership.as_ref().is_some_and(|o| !o.owns_here()) {
                continue;
            }
            if let Err(e) = device.unit.flush() {
                tracing::error!(device = %name, "flush at shutdown failed: {e}");
            }
            device.unit.close();
        }
        left
    }
}

/// The remote API's listener and TLS identity, when `[server] api_listen` asks for it.
fn bind_api(
    config: &Config,
) -> Result<Option<(std::net::TcpListener, openssl::ssl::SslAcceptor)>, StartError> {
    let Some(addr) = config.server.api_listen else {
        return Ok(None);
    };
    let state_dir = crate::topology::state::state_dir(config.server.state_dir.as_deref());
    let (cert, key) = crate::control::api::identity(&config.server, state_dir.as_deref())?;
    let client_ca = config.server.api_client_ca.as_deref();
    let tls = crate::control::api::acceptor(&cert, &key, client_ca)?;
    let listener =
        crate::metrics::bind(addr).map_err(|source| StartError::ApiListen { addr, source })?;
    tracing::info!(%addr, cert = %cert.display(), "remote API over HTTPS");
    Ok(Some((listener, tls)))
}

/// The control socket: the configured path (a failure stops the start), else the default one
/// (a failure costs only the socket).
fn bind_control(config: &Config) -> Result<Option<crate::control::ControlSocket>, StartError> {
    let configured = config.server.control_socket.clone();
    let Some(path) = configured.or_else(crate::control::default_socket_path) else {
        tracing::warn!("no control socket: neither XDG_RUNTIME_DIR nor HOME is set (set control_socket or --control-socket)");
        return Ok(None);
    };
    Ok(crate::control::bind(
        &path,
        config.server.control_socket.is_some(),
        config.server.control_socket_group.as_deref(),
    )?)
}

/// Starts the network workers; the threads run until the process exits (after `drain`) and
/// nobody joins them.
fn start_workers(
    shared: &Arc<Shared>,
    workers: usize,
    io_threads: usize,
) -> Result<Vec<mpsc::UnboundedSender<NewConnection>>, StartError> {
    let mut senders = Vec::new();
    for index in 0..workers {
        let (tx, rx) = mpsc::unbounded_channel::<NewConnection>();
        senders.push(tx);
        let shared = Arc::clone(shared);
        std::thread::Builder::new()
            .name(format!("ferrosan-worker-{index}"))
            .spawn(move || worker(shared, index, rx, io_threads))
            .map_err(|e| StartError::Thread("worker", e))?;
    }
    Ok(senders)
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
    // A worker without connections is idle, whatever its last sample says: that share was
    // spent on connections gone since (a benchmark's previous run), and would otherwise send
    // every connection of the next second to the other workers.
    let loads: Vec<(f64, i64)> = loads
        .iter()
        .map(|&(busy, conns)| (if conns > 0 { busy } else { 0.0 }, conns))
        .collect();
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

/// Descriptors a connection holds: its socket and its timer (crate::dataplane::alarm), and
/// with direct-I/O LUNs its io_uring ring and the ring's eventfd (crate::io::ring).
const DESCRIPTORS_PER_CONNECTION: u64 = 4;
/// Descriptors besides connections: listeners, LU files, the runtimes' epoll and event fds, each
/// worker's busy-poll epoll and sampling timer, stdio, metrics scrapes.
const DESCRIPTORS_SPARE: u64 = 256;

/// Raises the soft limit on open descriptors to the hard one, as servers do: a shell's soft
/// limit is often 1,024, which `max_connections` (1,024 by default) would exhaust at about half
/// its value, each connection holding two to four. Warns if even the hard limit is too low.
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
    // CPU, measured). Timers here are timerfds (crate::dataplane::alarm); tokio::time would panic.
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
        shared.worker_heartbeat(index);
        tokio::spawn(sample_busy(Arc::clone(&shared), index));
        while let Some(conn) = rx.recv().await {
            let shared = Arc::clone(&shared);
            if conn.kind != ListenerKind::Iscsi {
                tokio::spawn(crate::dataplane::nvme::serve(shared, conn));
            } else {
                tokio::spawn(connection::serve(shared, conn));
            }
        }
        // The acceptor is gone (shutting down): this worker's connections keep running until
        // they close or the process exits; leaving block_on would cancel them.
        std::future::pending::<()>().await
    });
}

/// Samples a worker's busy share once a second (its thread's CPU time, less busy polling,
/// over the wall time) for placement, and beats its heartbeat for the systemd watchdog. Runs
/// on the worker's own runtime: a worker stuck in a system call or a loop stops beating.
async fn sample_busy(watched: Arc<Shared>, index: usize) {
    let busy = watched.metrics.worker_busy(index);
    let metrics = Arc::clone(&watched.metrics);
    let mut alarm = match Alarm::new() {
        Ok(alarm) => alarm,
        Err(e) => {
            // Placement then sees this worker as idle and balances by connections.
            tracing::warn!("worker {index}: no busy sampling or watchdog: timer: {e}");
            watched.worker_unwatched(index);
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
            watched.worker_unwatched(index);
            return;
        }
        // The worker's runtime runs: its heartbeat for the systemd watchdog.
        watched.worker_heartbeat(index);
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
}

fn acceptor(
    shared: Arc<Shared>,
    listeners: crate::shared::listening::Plan,
    metrics_listener: Option<std::net::TcpListener>,
    api: Option<(std::net::TcpListener, openssl::ssl::SslAcceptor)>,
    control: Option<crate::control::ControlSocket>,
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
    let workers = Arc::new(Workers::new(&shared, senders));
    runtime.block_on(async move {
        let mut tasks = Vec::new();
        if let Some(control) = control {
            tasks.push(tokio::spawn(crate::control::serve(
                Arc::clone(&shared),
                control,
            )));
        }
        if let Some((listener, tls)) = api {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => tasks.push(tokio::spawn(crate::control::api::serve(
                    Arc::clone(&shared),
                    l,
                    tls,
                ))),
                Err(e) => tracing::error!("the remote API's listener: {e}"),
            }
        }
        if let Some(l) = metrics_listener.and_then(|l| tokio::net::TcpListener::from_std(l).ok()) {
            tasks.push(tokio::spawn(crate::metrics::serve(
                l,
                Arc::clone(&shared.metrics),
            )));
        }
        // Every listener, those of the start and those a reload adds, is accepted on this
        // runtime.
        let runtime = tokio::runtime::Handle::current();
        let weak = Arc::downgrade(&shared);
        shared
            .listening
            .set_spawner(Box::new(move |accepting: Accepting| {
                let Some(shared) = weak.upgrade() else { return };
                let workers = Arc::clone(&workers);
                runtime.spawn(async move {
                    match tokio::net::TcpListener::from_std(accepting.listener) {
                        Ok(listener) => {
                            let on = (accepting.tag, accepting.kind, accepting.stop);
                            accept(listener, on, shared, workers).await
                        }
                        Err(e) => tracing::error!("listener: {e}"),
                    }
                });
            }));
        shared.listening.start(listeners);
        // The listeners' tasks live on this runtime: it runs until the daemon shuts down.
        let mut shutdown = shared.shutdown_signal();
        Shared::wait_for_shutdown(&mut shutdown).await;
        for t in tasks {
            let _ = t.await;
        }
    });
}

/// The network workers as the acceptor sees them: where to send a connection, and how loaded
/// each is.
struct Workers {
    senders: Vec<mpsc::UnboundedSender<NewConnection>>,
    /// Per worker: its open connections and its busy share.
    loads: Vec<(Gauge, Gauge<f64, AtomicU64>)>,
    /// The round-robin turn among equally loaded workers.
    next: AtomicUsize,
}

impl Workers {
    fn new(shared: &Shared, senders: Vec<mpsc::UnboundedSender<NewConnection>>) -> Workers {
        let loads = (0..senders.len())
            .map(|index| {
                (
                    shared.metrics.worker_connections(index),
                    shared.metrics.worker_busy(index),
                )
            })
            .collect();
        Workers {
            senders,
            loads,
            next: AtomicUsize::new(0),
        }
    }

    /// Gives an admitted connection to the least loaded worker (`least_loaded`).
    fn hand_over(&self, mut connection: NewConnection) {
        let now: Vec<(f64, i64)> = self
            .loads
            .iter()
            .map(|(conns, busy)| (busy.get(), conns.get()))
            .collect();
        let index = least_loaded(&now, self.next.fetch_add(1, Ordering::Relaxed));
        if let (Some(tx), Some((load, _))) = (self.senders.get(index), self.loads.get(index)) {
            connection.guard.place_on(load);
            let _ = tx.send(connection);
        }
    }
}

/// Accepts one listener's connections until the daemon shuts down: each passes the doors
/// (refusals logged at most once a second) and goes to a worker.
async fn accept(
    listener: tokio::net::TcpListener,
    (tag, kind, mut stop): (Arc<AtomicU16>, ListenerKind, watch::Receiver<bool>),
    shared: Arc<Shared>,
    workers: Arc<Workers>,
) {
    let mut refusal_log = crate::log_limit::LogLimiter::new(Duration::from_secs(1));
    let mut shutdown = shared.shutdown_signal();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Dropping the listener refuses new connections at the TCP level.
            () = Shared::wait_for_shutdown(&mut shutdown) => return,
            // A reload dropped it (or the registry went with the daemon).
            _ = stop.wait_for(|stopped| *stopped) => {
                tracing::info!(addr = ?listener.local_addr().ok(), "listener closed");
                return;
            }
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
        let (guard, prelogin) = match shared.doors.admit(peer.ip(), kind) {
            Ok(admitted) => admitted,
            Err(limit) => {
                shared.metrics.limit(limit);
                if let Some(suppressed) = refusal_log.admit(std::time::Instant::now()) {
                    tracing::warn!(%peer, limit, suppressed, "connection refused: limit reached");
                }
                continue;
            }
        };
        let local = stream.local_addr().unwrap_or(peer);
        let _ = stream.set_nodelay(true);
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        workers.hand_over(NewConnection {
            stream,
            peer,
            local,
            portal_group_tag: tag.load(Ordering::Relaxed),
            kind,
            guard,
            prelogin,
        });
    }
}

/// Network worker threads: `workers`, or one per core.
/// The threads that watch the array beside the planes: one retrying devices left out at
/// start (only if some were), one waking sessions when what they follow changed, one
/// watching the space file devices allocate from.
fn start_watchers(shared: &Arc<Shared>) -> Result<(), StartError> {
    if !shared.left_out().is_empty() {
        let retrying = Arc::downgrade(shared);
        std::thread::Builder::new()
            .name("ferrosan-retry".into())
            .spawn(move || retry_left_out(&retrying))
            .map_err(|e| StartError::Thread("device retry", e))?;
    }
    let nudged = Arc::downgrade(shared);
    let nudger = Arc::clone(shared.device_context.nudger());
    std::thread::Builder::new()
        .name("ferrosan-nudge".into())
        .spawn(move || crate::shared::nudge::run(&nudger, &nudged))
        .map_err(|e| StartError::Thread("session nudges", e))?;
    let watched = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("ferrosan-space".into())
        .spawn(move || watch_space(&watched))
        .map_err(|e| StartError::Thread("space watch", e))?;
    Ok(())
}

fn worker_count(config: &Config) -> usize {
    if config.server.workers == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        config.server.workers
    }
}

/// The addresses the other RBD gateways of the config are known by (their portal groups'
/// specific `listen` and `peer_address` addresses): only from these may a gateway peer's
/// connection pass its source's `max_connections_per_source`.
fn gateway_sources(config: &Config) -> std::collections::HashSet<IpAddr> {
    let me = config.server.gateway.as_deref();
    config
        .portal_groups
        .iter()
        .filter(|p| p.gateway.is_some() && !p.served_by(me))
        .flat_map(|p| p.listen.iter().chain(&p.peer_address))
        .map(SocketAddr::ip)
        .filter(|ip| !ip.is_unspecified())
        .collect()
}

/// Where portal groups name gateways, this daemon must be one of them.
fn check_gateway(config: &Config) -> Result<(), StartError> {
    let named: Vec<&str> = config
        .portal_groups
        .iter()
        .filter_map(|p| p.gateway.as_deref())
        .collect();
    match config.server.gateway.as_deref() {
        None if !named.is_empty() => Err(StartError::Gateway(format!(
            "portal groups name gateways ({}): say which one this daemon is with [server] \
             gateway or serve --gateway",
            named.join(", ")
        ))),
        Some(me) if !named.contains(&me) => Err(StartError::Gateway(format!(
            "gateway {me:?} serves no portal group (portal groups name {})",
            if named.is_empty() {
                "no gateway".to_string()
            } else {
                named.join(", ")
            }
        ))),
        _ => Ok(()),
    }
}

/// Looks at the space the devices allocate from every few seconds until the daemon stops
/// (`topology::space`): off the workers, as a filesystem may be slow to answer. At the same
/// pace, trims the heap after many connections parked ([`trim_after_parking`]).
fn watch_space(shared: &std::sync::Weak<Shared>) {
    let mut watch = crate::topology::space::SpaceWatch::default();
    let mut parked_low = 0;
    loop {
        std::thread::sleep(crate::topology::space::CHECK_INTERVAL);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.is_shutting_down() {
            return;
        }
        let began = std::time::Instant::now();
        let topology = shared.topology();
        watch.check(&topology, &shared.metrics);
        let took = began.elapsed();
        tracing::debug!(
            devices = topology.devices.len(),
            took_us = took.as_micros() as u64,
            "space checked"
        );
        trim_after_parking(&shared, &mut parked_low);
    }
}

/// More connections parked than at any check since the last trim, by this many, make a trim
/// worth its walk of the heap: each gave back its drive's memory (several KiB).
const TRIM_AFTER_PARKED: i64 = 64;

/// Gives the heap's free pages back to the kernel once [`TRIM_AFTER_PARKED`] more connections
/// are parked than the fewest seen since the last trim (`low`). glibc keeps what a process
/// freed resident for its next allocations, so the memory a reconnect storm's queues gave back
/// when they parked would otherwise stay in the daemon's RSS at the storm's peak. Counted on
/// the parked connections, not the parks: queues their hosts wake and park again every few
/// seconds (NVMe admin queues under Linux's Keep Alive) take back what they give, and a trim
/// for them would walk the heap for nothing. Off the workers: a trim walks every arena.
fn trim_after_parking(shared: &Shared, low: &mut i64) {
    let parked = shared.metrics.connections_parked.get();
    *low = (*low).min(parked);
    if parked - *low < TRIM_AFTER_PARKED {
        return;
    }
    *low = parked;
    let began = std::time::Instant::now();
    let released = crate::dataplane::sys::trim_heap();
    tracing::debug!(
        parked,
        released,
        took_us = began.elapsed().as_micros() as u64,
        "heap trimmed after connections parked"
    );
}

/// The first retry of devices left out at start comes this long after it, each next one twice
/// as long after the last, up to [`LEFT_OUT_RETRY_MAX`].
const LEFT_OUT_RETRY_FIRST: Duration = Duration::from_secs(5);
const LEFT_OUT_RETRY_MAX: Duration = Duration::from_secs(60);

/// Retries the devices left out at start until every one runs (or the daemon stops): each
/// round first checks that their clusters answer (outside the reload lock: a `ctl` command
/// never waits for a cluster that is down), then applies the running config with them added.
fn retry_left_out(shared: &std::sync::Weak<Shared>) {
    let mut wait = LEFT_OUT_RETRY_FIRST;
    loop {
        std::thread::sleep(wait);
        wait = (wait * 2).min(LEFT_OUT_RETRY_MAX);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.is_shutting_down() {
            return;
        }
        let left_out = shared.left_out();
        if left_out.is_empty() {
            return;
        }
        let (reachable, unreachable): (Vec<_>, Vec<_>) = left_out.into_iter().partition(|out| {
            out.device
                .store
                .rbd()
                .is_none_or(|spec| store::RbdStore::reachable(spec).is_ok())
        });
        if reachable.is_empty() {
            let names: Vec<&str> = unreachable.iter().map(|o| o.device.name.as_str()).collect();
            tracing::debug!(
                "devices left out, clusters still unreachable: {}",
                names.join(", ")
            );
            continue;
        }
        let retried: Vec<String> = reachable.iter().map(|o| o.device.name.clone()).collect();
        let mut back = Vec::new();
        // Derived under the reload lock from what is left out *then* (a reload meanwhile may
        // have opened or dropped these devices) and from the running config then.
        let applied = crate::control::reload::apply_with(
            &shared,
            |running| {
                let still: Vec<_> = shared
                    .left_out()
                    .into_iter()
                    .filter(|o| retried.contains(&o.device.name))
                    .collect();
                crate::topology::left_out::merged(running, &still)
            },
            |shared| {
                let running = shared.topology();
                back = retried
                    .iter()
                    .filter(|name| running.devices.contains_key(name.as_str()))
                    .cloned()
                    .collect();
                shared.forget_left_out(&back);
            },
        );
        match applied {
            Ok(_) if !back.is_empty() => {
                tracing::info!(
                    "the cluster can be reached again: device {} served",
                    back.join(", ")
                );
                wait = LEFT_OUT_RETRY_FIRST;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("devices left out at start, not yet back: {e}"),
        }
    }
}

fn build(config: &Config) -> Result<Shared, OpenError> {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    metrics.set_slow_command_ms(config.limits.slow_command_ms);
    let device_context = DeviceContext::new(config, Arc::clone(&metrics));
    let mut devices = HashMap::new();
    let mut unavailable = Vec::new();
    for device in &config.devices {
        match device_context.open(device, config) {
            Ok(open) => {
                devices.insert(device.name.as_str().into(), open);
            }
            // A cluster that is down must not keep the other LUNs from being served: the RBD
            // device is left out of the running config (its LUNs unmapped), and a reload
            // (`ferrosan ctl reload`, SIGHUP) opens it once the cluster is back.
            Err(e @ OpenError::Unavailable { .. }) => {
                tracing::error!(
                    "{e}: its LUNs are not served until the cluster can be reached (retried \
                     every {} s at most, or at a reload)",
                    LEFT_OUT_RETRY_MAX.as_secs()
                );
                unavailable.push(device.name.clone());
            }
            Err(e) => return Err(e),
        }
    }
    let mut running = config.clone();
    if !unavailable.is_empty() {
        running.devices.retain(|d| !unavailable.contains(&d.name));
        for target in running.targets.iter_mut().map(Arc::make_mut) {
            for group in &mut target.groups {
                group.luns.retain(|m| !unavailable.contains(&m.device));
            }
        }
    }
    let topology = Topology::assemble(running, devices, 1)?;
    let left_out = unavailable
        .iter()
        .filter_map(|name| crate::topology::left_out::LeftOut::of(config, name))
        .collect();
    let doors = Doors::new(
        &config.limits,
        gateway_sources(config),
        Arc::clone(&metrics),
    );
    Ok(Shared::new(
        config,
        topology,
        device_context,
        metrics,
        left_out,
        Arc::new(doors),
        worker_count(config),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeName;

    #[test]
    fn only_the_other_gateways_addresses_may_bring_peers_past_a_sources_limit() {
        let config = Config::from_toml_str(
            r#"
[server]
gateway = "a"
[[portal_group]]
tag = 1
listen = ["10.0.0.1:3260"]
gateway = "a"
[[portal_group]]
tag = 2
listen = ["10.0.0.2:3260"]
peer_address = "10.0.1.2:3260"
gateway = "b"
[[portal_group]]
tag = 3
listen = ["10.0.0.9:3260"]
"#,
            "test",
        )
        .unwrap();
        let sources = gateway_sources(&config);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            sources,
            [ip("10.0.0.2"), ip("10.0.1.2")].into_iter().collect(),
            "b's listen and peer addresses; not this gateway's, not a group without a gateway"
        );
    }

    /// One medium verb a volume at a time: a second is refused naming the first, a volume
    /// free once the first is done, other volumes unaffected.
    #[test]
    fn a_volume_is_worked_on_by_one_verb_at_a_time() {
        let shared = build(&Config::demo()).unwrap();
        let delete = shared.busy("vm1", "a delete").unwrap();
        assert_eq!(shared.busy("vm1", "a snapshot").err(), Some("a delete"));
        let other = shared.busy("vm2", "a snapshot").unwrap();
        drop(delete);
        let snapshot = shared.busy("vm1", "a snapshot").unwrap();
        assert_eq!(shared.busy("vm2", "a rollback").err(), Some("a snapshot"));
        drop((snapshot, other));
        assert!(shared.busy("vm1", "a rollback").is_ok());
    }

    /// A change rebuilds the targets it touches and keeps the others as they ran: a volume
    /// made beside thousands of LUNs costs no LUN map.
    #[test]
    fn a_change_rebuilds_only_the_targets_it_touches() {
        let text = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "d1"
store = "ram"
size = "1M"
[[device]]
name = "d2"
store = "ram"
size = "1M"
[[target]]
iqn = "iqn.2026-12.org.ferrosan:one"
  [[target.group]]
  name = "g"
  any_initiator = true
  luns = [ { lun = 0, device = "d1" } ]
[[target]]
iqn = "iqn.2026-12.org.ferrosan:two"
  [[target.group]]
  name = "g"
  any_initiator = true
  luns = [ { lun = 0, device = "d2" } ]
"#;
        let shared = build(&Config::from_toml_str(text, "t").unwrap()).unwrap();
        let targets = |s: &Shared| s.topology().targets.clone();
        let apply = |edit: &dyn Fn(&mut Config)| {
            let lock = crate::control::reload::lock(&shared);
            let mut next = shared.topology().config.clone();
            edit(&mut next);
            let next = next
                .revalidated_from(&shared.topology().config, "t")
                .unwrap();
            crate::control::reload::apply_locked(&shared, &lock, next).unwrap();
        };
        let before = targets(&shared);
        apply(&|c| {
            c.devices
                .push(Config::device_from_spec("d3", "ram:1M").unwrap().into())
        });
        let after = targets(&shared);
        assert!(Arc::ptr_eq(&before[0], &after[0]) && Arc::ptr_eq(&before[1], &after[1]));
        // d3 mapped by target one: it is rebuilt and serves it; target two is kept.
        apply(&|c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0]
                .luns
                .push(crate::config::LunMapping {
                    lun: 1,
                    device: "d3".into(),
                    read_only: false,
                })
        });
        let mapped = targets(&shared);
        assert!(!Arc::ptr_eq(&after[0], &mapped[0]) && Arc::ptr_eq(&after[1], &mapped[1]));
        assert_eq!(mapped[0].groups[0].luns.entries().len(), 2);
        // d2 and its LUN removed: target two rebuilt, target one kept.
        apply(&|c| {
            std::sync::Arc::make_mut(&mut c.targets[1]).groups[0]
                .luns
                .clear();
            c.devices.retain(|d| d.name != "d2");
        });
        let removed = targets(&shared);
        assert!(Arc::ptr_eq(&mapped[0], &removed[0]) && !Arc::ptr_eq(&mapped[1], &removed[1]));
        assert_eq!(removed[1].groups[0].luns.entries().len(), 0);
        // A portal group's ALUA state is every target's ports: all rebuilt.
        apply(&|c| c.portal_groups[0].alua_state = scsi::AccessState::Standby);
        let alua = targets(&shared);
        assert!(!Arc::ptr_eq(&removed[0], &alua[0]) && !Arc::ptr_eq(&removed[1], &alua[1]));
    }

    #[test]
    fn the_watchdog_asks_that_every_worker_ran_lately() {
        let mut config = Config::demo();
        config.server.workers = 2;
        let shared = build(&config).unwrap();
        let window = Duration::from_millis(200);
        // Both beat at start (0 ms): alive within the window, then stale past it.
        assert!(shared.workers_alive(window));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!shared.workers_alive(window));
        shared.worker_heartbeat(0);
        assert!(!shared.workers_alive(window), "worker 1 still silent");
        shared.worker_heartbeat(1);
        assert!(shared.workers_alive(window));
        // A worker whose timer could not be had is not watched (it cannot beat).
        std::thread::sleep(Duration::from_millis(300));
        shared.worker_unwatched(0);
        shared.worker_heartbeat(1);
        assert!(shared.workers_alive(window));
        // Out-of-range indexes are ignored.
        shared.worker_heartbeat(7);
    }

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
            assert_eq!(least_loaded(&[(0.02, 5), (0.9, 1), (0.5, 1)], turn), 0);
        }
        // Within the band, busy shares are noise: connections decide, then round-robin.
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 2)], 0), 0);
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 1)], 0), 0);
        assert_eq!(least_loaded(&[(0.15, 1), (0.06, 1)], 1), 1);
        // Just outside the band: the less busy one.
        assert_eq!(least_loaded(&[(0.17, 1), (0.06, 3)], 0), 1);
        // A nonsense share (NaN) never wins over a measured one, nor breaks the choice.
        assert_eq!(least_loaded(&[(f64::NAN, 1), (0.3, 4)], 0), 1);
    }

    #[test]
    fn a_worker_whose_connections_have_gone_counts_as_idle() {
        // Worker 0 was saturated by a run that just ended: its share is a second old. The
        // next run's connections spread over both, not all onto worker 1.
        let just_ended = [(0.98, 0), (0.0, 0)];
        assert_eq!(least_loaded(&just_ended, 0), 0);
        assert_eq!(least_loaded(&just_ended, 1), 1);
        assert_eq!(least_loaded(&[(0.98, 0), (0.0, 1)], 1), 0);
        // With connections, its share stands.
        assert_eq!(least_loaded(&[(0.98, 1), (0.0, 3)], 0), 1);
    }

    #[test]
    fn io_threads_are_shared_out_and_never_zero() {
        assert_eq!(io_threads_per_worker(128, 2), 64);
        assert_eq!(io_threads_per_worker(128, 3), 42);
        assert_eq!(io_threads_per_worker(1, 16), 1, "every worker can defer");
        assert_eq!(io_threads_per_worker(4096, 0), 4096);
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
        let topology = shared.topology();
        let target = NodeName::from_wire("iqn.2026-11.test:target").unwrap();
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
                let Ok(name) = NodeName::from_wire(&spelling) else {
                    continue;
                };
                // The oracle: the group listing the normal form, else the any-initiator group.
                let oracle = config.targets[0]
                    .groups
                    .iter()
                    .position(|g| g.initiators.iter().any(|i| i.as_str() == name.as_str()))
                    .unwrap_or(2);
                let (membership, auth) = topology
                    .admit(
                        crate::admission::Door::Iscsi,
                        &name,
                        &target,
                        1,
                        source,
                        None,
                    )
                    .unwrap();
                assert_eq!(membership.group, oracle, "{spelling:?}");
                let (_, group) = topology.group_of(membership).unwrap();
                assert_eq!(group.name, config.targets[0].groups[oracle].name);
                let oracle_auth =
                    config.targets[0].auth_in(&name, Some(&config.targets[0].groups[oracle]));
                assert_eq!(auth, oracle_auth, "{spelling:?}");
                // Every spelling of a base is the base.
                let normal = NodeName::from_wire(base).unwrap();
                assert_eq!(name, normal, "{spelling:?} is {base:?}");
                checked += 1;
            }
        }
        assert!(checked > 2000, "only {checked} spellings were names");
        // The reproduction, concretely: É is é, which needs no CHAP and gets the 16 MiB LU.
        let upper = NodeName::from_wire("iqn.2026-11.test:É").unwrap();
        let (membership, auth) = topology
            .admit(
                crate::admission::Door::Iscsi,
                &upper,
                &target,
                1,
                source,
                None,
            )
            .unwrap();
        assert_eq!(auth, crate::config::ResolvedAuth::None);
        let (_, group) = topology.group_of(membership).unwrap();
        let lu = &group.luns.get(0).unwrap().lu;
        assert_eq!(lu.capacity_bytes(), 16 << 20);
    }
}
