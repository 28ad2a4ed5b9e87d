//! The doors of the daemon: how many TCP connections it holds, from which sources, and which
//! sources failed to log in lately. Every accepted connection passes [`Doors::admit`] before
//! a byte of it is read; its [`ConnectionGuard`] gives its place back when it closes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

use super::prelogin::{PreLogin, Ticket};
use crate::config::Limits;
use crate::metrics::Metrics;
use crate::topology::portals::ListenerKind;

/// The connection limits of docs/CONFIG.md and their counts.
pub struct Doors {
    limits: Limits,
    connections: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, u32>>,
    /// Connections admitted past their source's limit, for gateway peers only.
    peer_only_connections: AtomicUsize,
    /// The other gateways' addresses (`server::gateway_sources`).
    gateway_sources: HashSet<IpAddr>,
    /// Connections still logging in, under their own budget.
    prelogin: Arc<PreLogin>,
    login_failures: Mutex<LoginFailures>,
    metrics: Arc<Metrics>,
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

impl Doors {
    pub fn new(limits: &Limits, gateway_sources: HashSet<IpAddr>, metrics: Arc<Metrics>) -> Doors {
        Doors {
            limits: limits.clone(),
            connections: AtomicUsize::new(0),
            per_source: Mutex::new(HashMap::new()),
            peer_only_connections: AtomicUsize::new(0),
            gateway_sources,
            prelogin: PreLogin::new(
                limits.max_prelogin_connections.min(limits.max_connections) as usize
            ),
            login_failures: Mutex::new(LoginFailures::default()),
            metrics,
        }
    }

    /// Open TCP connections (admitted ones, in login or full feature phase).
    pub fn open_connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    /// Admits a new TCP connection under the connection limits; the guard releases it, the
    /// ticket its place among the connections still logging in. At `max_connections` a
    /// connection still logging in is evicted to make room (sessions are never refused because
    /// of clients that do not log in); the evicted ones close within a turn, so the count may
    /// pass `max_connections` by at most the pre-login budget meanwhile.
    /// Past its source's limit only a connection that may carry a gateway peer's login (an
    /// iSCSI listener's, from another gateway's address) is admitted, as `peer_only`.
    pub fn admit(
        self: &Arc<Self>,
        source: IpAddr,
        kind: ListenerKind,
    ) -> Result<(ConnectionGuard, Ticket), &'static str> {
        let max = self.limits.max_connections as usize;
        let total = self.connections.fetch_add(1, Ordering::AcqRel);
        let refuse = |limit| {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            Err(limit)
        };
        if total >= max {
            if total >= max + self.limits.max_prelogin_connections as usize {
                return refuse("max_connections");
            }
            match self.prelogin.evict_one() {
                Some(_) => self.metrics.limit("max_prelogin_connections"),
                None => return refuse("max_connections"),
            }
        }
        // Past its source's limit a connection from another gateway's address may still be
        // a gateway peer's (peer.rs): it is admitted within the peers' own bound, and must
        // log in as a peer.
        let mut peer_only = false;
        {
            let mut per = self.per_source.lock().unwrap_or_else(|e| e.into_inner());
            let n = per.entry(source).or_insert(0);
            if *n >= self.limits.max_connections_per_source {
                drop(per);
                if !kind.carries_gateway_peers() || !self.gateway_sources.contains(&source) {
                    return refuse("max_connections_per_source");
                }
                let peers = self.peer_only_connections.fetch_add(1, Ordering::AcqRel);
                if peers >= crate::io::peer::ADMITTED_MAX {
                    self.peer_only_connections.fetch_sub(1, Ordering::AcqRel);
                    return refuse("max_connections_per_source");
                }
                peer_only = true;
            } else {
                *n += 1;
            }
        }
        let login_timeout = Duration::from_secs(self.limits.login_timeout_s.into());
        let (ticket, evicted) = self.prelogin.enter(source, login_timeout);
        if evicted.is_some() {
            self.metrics.limit("max_prelogin_connections");
        }
        self.metrics.connections.inc();
        Ok((
            ConnectionGuard {
                doors: Arc::clone(self),
                source,
                worker_load: None,
                peer_only,
            },
            ticket,
        ))
    }

    /// Connections that have not completed their login.
    pub fn prelogin_connections(&self) -> usize {
        self.prelogin.count()
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
    doors: Arc<Doors>,
    source: IpAddr,
    /// The open-connection gauge of the worker the connection was given to.
    worker_load: Option<Gauge>,
    /// Admitted past its source's `max_connections_per_source`: only a gateway peer may log
    /// in on it (counted in `peer_only_connections`, not in `per_source`).
    pub peer_only: bool,
}

impl ConnectionGuard {
    /// Counts the connection on its worker until the guard drops.
    pub fn place_on(&mut self, worker_load: &Gauge) {
        worker_load.inc();
        self.worker_load = Some(worker_load.clone());
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if let Some(load) = &self.worker_load {
            load.dec();
        }
        if self.peer_only {
            self.doors
                .peer_only_connections
                .fetch_sub(1, Ordering::AcqRel);
        } else {
            let mut per = self
                .doors
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
        self.doors.connections.fetch_sub(1, Ordering::AcqRel);
        // Last, so that a scraper seeing the gauge fall may rely on every limit being released.
        self.doors.metrics.connections.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doors(max: u32, window_s: u32) -> Doors {
        let mut limits = crate::config::Config::demo().limits;
        limits.login_failures_max = max;
        limits.login_failure_window_s = window_s;
        Doors::new(&limits, HashSet::new(), Arc::new(Metrics::new()))
    }

    #[test]
    fn failed_logins_are_rate_limited_per_source() {
        let s = doors(3, 60);
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
    fn only_an_iscsi_connection_from_a_gateway_passes_its_source_limit() {
        let mut limits = crate::config::Config::demo().limits;
        limits.max_connections_per_source = 1;
        let gateway: IpAddr = "192.0.2.7".parse().unwrap();
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        let d = Arc::new(Doors::new(
            &limits,
            HashSet::from([gateway]),
            Arc::new(Metrics::new()),
        ));
        let _first = d.admit(gateway, ListenerKind::Nvme).unwrap();
        // NVMe carries no peer logins: a second NVMe connection from the gateway is refused.
        for kind in [ListenerKind::Nvme, ListenerKind::NvmeDiscovery] {
            assert_eq!(
                d.admit(gateway, kind).err(),
                Some("max_connections_per_source")
            );
        }
        let (peer, _) = d.admit(gateway, ListenerKind::Iscsi).unwrap();
        assert!(peer.peer_only, "must log in as a peer");
        let _other = d.admit(other, ListenerKind::Iscsi).unwrap();
        assert!(
            d.admit(other, ListenerKind::Iscsi).is_err(),
            "not a gateway"
        );
        assert_eq!(d.open_connections(), 3);
    }

    #[test]
    fn zero_disables_the_rate_limit() {
        let s = doors(0, 60);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..100 {
            s.record_login_failure(a, t0);
        }
        assert!(!s.login_blocked(a, t0));
    }
}
