//! The running daemon's state, shared by its workers and its control plane: the published
//! topology and its generation, the connection doors, the session registry, the shutdown
//! signal and the config's provenance. Read-mostly: the registry and the doors are the only
//! locked parts, touched at accept, login and close only.

pub mod listening;
pub mod nudge;
#[cfg(test)]
pub(crate) mod testing;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::admission::doors::Doors;
use crate::admission::registry::Registry;
use crate::config::{ChapAlgorithm, Config, ConfigSource, Limits, Unsaved};
use crate::metrics::Metrics;
use crate::topology::left_out::LeftOut;
use crate::topology::{DeviceContext, Topology};

pub struct Shared {
    /// The running targets and devices; replaced whole by a reload (see [`Shared::topology`]).
    topology: RwLock<Arc<Topology>>,
    /// The generation of `topology`, readable without its lock: connections compare it with
    /// their own at every turn.
    generation: AtomicU64,
    /// Opens the devices a reload adds.
    pub device_context: DeviceContext,
    /// Held while a reload computes and applies its difference: one at a time.
    pub reloading: Mutex<()>,
    pub limits: Limits,
    pub registry: Arc<Registry>,
    /// The NVMe/TCP controllers, found by ID when a host connects their I/O queues.
    pub nvme: crate::admission::controllers::Controllers,
    /// The listeners (`listening.rs`): bound at start, changed by reloads.
    pub listening: listening::Listening,
    /// The connection limits and counts; every accepted connection passes them.
    pub doors: Arc<Doors>,
    /// CHAP algorithms accepted, in order of preference.
    pub chap_algorithms: Vec<ChapAlgorithm>,
    /// What NVMe hosts may authenticate with (`[server] dhchap_hashes`, `dhchap_groups`).
    pub dhchap: nvme::auth::controller::Policy,
    pub metrics: Arc<Metrics>,
    /// Set when the daemon shuts down: listeners close, logins in progress end, and every
    /// session is asked to log out within `limits.shutdown_grace_s`.
    shutdown: watch::Sender<bool>,
    /// When the daemon started (for `ctl status`).
    pub started: std::time::SystemTime,
    /// Where the config came from (what a reload re-reads).
    pub source: ConfigSource,
    /// The config as its file last held it (loaded or saved by this daemon): the base of the
    /// merge that saves the running config into the file (`config::edit`).
    pub file_base: Mutex<Option<crate::config::edit::FileBase>>,
    /// RBD devices started without (their cluster unreachable): retried until they open,
    /// kept in a saved config meanwhile (`crate::topology::left_out`).
    left_out: Mutex<Vec<LeftOut>>,
    /// Changes made with `ctl` and not saved to the config file.
    pub unsaved: Unsaved,
    /// Who may use the remote management API (`admission/tokens.rs`).
    pub tokens: crate::admission::tokens::Tokens,
    /// The volumes a verb works on its medium now (a snapshot taken, a volume deleted): one
    /// such verb a volume at a time (`Shared::busy`).
    volumes_busy: Mutex<std::collections::HashMap<String, &'static str>>,
    /// Per network worker: milliseconds since `started_at` when its runtime last ran its
    /// once-a-second task (`u64::MAX`: not watched, its timer could not be had).
    worker_heartbeats: Vec<AtomicU64>,
    started_at: std::time::Instant,
}

impl Shared {
    /// The state of a daemon starting with `topology` (generation 1), built from `config`.
    pub(crate) fn new(
        config: &Config,
        topology: Topology,
        device_context: DeviceContext,
        metrics: Arc<Metrics>,
        left_out: Vec<LeftOut>,
        doors: Arc<Doors>,
        workers: usize,
    ) -> Shared {
        assert_eq!(topology.generation, 1, "a daemon starts at generation 1");
        let session_ids = device_context
            .session_ids()
            .unwrap_or(crate::admission::registry::ALL_IDS);
        Shared {
            left_out: Mutex::new(left_out),
            topology: RwLock::new(Arc::new(topology)),
            generation: AtomicU64::new(1),
            metrics,
            device_context,
            reloading: Mutex::new(()),
            limits: config.limits.clone(),
            registry: Arc::new(Registry::new(
                crate::admission::registry::Bounds::of(&config.limits),
                session_ids,
            )),
            nvme: Default::default(),
            listening: Default::default(),
            doors,
            chap_algorithms: config.server.chap_algorithms.clone(),
            dhchap: config.server.dhchap.clone(),
            shutdown: watch::Sender::new(false),
            started: std::time::SystemTime::now(),
            source: ConfigSource::default(),
            file_base: Mutex::new(None),
            unsaved: Unsaved::default(),
            tokens: crate::admission::tokens::Tokens::of_state_dir(
                crate::topology::state::state_dir(config.server.state_dir.as_deref()).as_deref(),
            ),
            volumes_busy: Mutex::default(),
            worker_heartbeats: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            started_at: std::time::Instant::now(),
        }
    }
}

/// A volume a verb works on (`Shared::busy`): free again when dropped.
pub struct Busy<'a> {
    shared: &'a Shared,
    volume: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut busy = self
            .shared
            .volumes_busy
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let was = busy.remove(&self.volume);
        debug_assert!(was.is_some(), "volume {} was not busy", self.volume);
    }
}

impl Shared {
    /// Whether a verb may work on `volume`'s medium now, and if so that it does (`doing`, as a
    /// conflict names it to the next) until the guard drops: the one place that keeps a
    /// snapshot from landing between a delete's check for snapshots and its removal, or a
    /// rollback from running under a snapshot. Err: the verb busy with it.
    pub fn busy(&self, volume: &str, doing: &'static str) -> Result<Busy<'_>, &'static str> {
        let mut busy = self.volumes_busy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = busy.get(volume) {
            return Err(other);
        }
        busy.insert(volume.to_string(), doing);
        Ok(Busy {
            shared: self,
            volume: volume.to_string(),
        })
    }
}

impl Shared {
    /// The running topology (a snapshot: a reload publishes a new one, this one stays valid).
    pub fn topology(&self) -> Arc<Topology> {
        Arc::clone(&self.topology.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The generation of the running topology (one atomic load).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Publishes the next topology; its generation must be the current one plus one. Only
    /// the reload, holding `reloading`, calls this.
    pub(crate) fn publish(&self, topology: Topology) {
        let generation = topology.generation;
        let new = Arc::new(topology);
        let old = std::mem::replace(
            &mut *self.topology.write().unwrap_or_else(|e| e.into_inner()),
            new,
        );
        self.generation.store(generation, Ordering::Release);
        // Idle sessions follow it now, not at their next command.
        self.device_context.nudger().nudge();
        // The previous topology (every target's LUN maps, the config) is freed here if
        // nothing else holds it, after the write lock is released: at thousands of devices
        // that takes milliseconds, which sessions reading the topology need not wait out.
        drop(old);
    }

    /// Starts the shutdown: listeners close, logins in progress end, sessions are asked to
    /// log out.
    pub(crate) fn shut_down(&self) {
        self.shutdown.send_replace(true);
        self.device_context.nudger().nudge();
    }

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

    /// Whether the daemon is shutting down. Takes the watch's read lock: not for every
    /// command (a session reads it when nudged, `nudge.rs`).
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// The RBD devices started without and not back yet (see [`crate::topology::left_out`]).
    pub fn left_out(&self) -> Vec<LeftOut> {
        self.left_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Devices `names` run now (or the config no longer has them): no longer left out.
    pub fn forget_left_out(&self, names: &[String]) {
        self.left_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|out| !names.contains(&out.device.name));
    }

    /// The running config with the devices left out at start added back: what the config
    /// file should keep (`ctl save`).
    pub fn config_to_keep(&self) -> Config {
        crate::topology::left_out::merged(&self.topology().config, &self.left_out())
    }

    /// Whether every network worker's runtime ran within `within` (the systemd watchdog's
    /// question: a worker stuck in a system call or a loop stops answering its connections).
    pub fn workers_alive(&self, within: Duration) -> bool {
        let now = self.started_at.elapsed().as_millis() as u64;
        let within = within.as_millis() as u64;
        self.worker_heartbeats.iter().all(|beat| {
            let last = beat.load(Ordering::Relaxed);
            last == u64::MAX || now.saturating_sub(last) <= within
        })
    }

    /// The network workers' count.
    pub fn workers(&self) -> usize {
        self.worker_heartbeats.len()
    }

    pub(crate) fn worker_heartbeat(&self, index: usize) {
        if let Some(beat) = self.worker_heartbeats.get(index) {
            beat.store(
                self.started_at.elapsed().as_millis() as u64,
                Ordering::Relaxed,
            );
        }
    }

    pub(crate) fn worker_unwatched(&self, index: usize) {
        if let Some(beat) = self.worker_heartbeats.get(index) {
            beat.store(u64::MAX, Ordering::Relaxed);
        }
    }
}
