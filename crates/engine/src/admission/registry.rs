//! The session registry: TSIH allocation, session reinstatement by (initiator, ISID, target), and
//! the session limit. Control plane only: touched at login and at close, never per command.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use seam::name::NodeName;
use tokio::sync::watch;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SessionId {
    initiator: NodeName,
    instance: Instance,
    target: Option<NodeName>,
}

/// What tells two sessions of one initiator with one target apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instance {
    /// An iSCSI login's ISID: a new login with the same one reinstates the session.
    Isid([u8; 6]),
    /// An NVMe controller, numbered by the door: never reinstated (a host may run several
    /// through one port), each Connect its own.
    Controller(u64),
}

impl From<[u8; 6]> for Instance {
    fn from(isid: [u8; 6]) -> Instance {
        Instance::Isid(isid)
    }
}

struct Entry {
    tsih: u16,
    /// The address it came from (discovery sessions are bounded per source).
    source: IpAddr,
    /// Closing the session, and why: the connection driver watches this.
    kill: watch::Sender<Option<&'static str>>,
    /// Filled in when the session reaches full feature phase.
    info: Option<Arc<SessionInfo>>,
}

/// What `ctl sessions` shows of one session: fixed at login, plus counters the connection
/// adds to once a second.
#[derive(Debug)]
pub struct SessionInfo {
    pub initiator: String,
    pub initiator_alias: Option<String>,
    /// None for discovery sessions.
    pub target: Option<String>,
    /// The session's number in the one range both doors draw from (`ctl session-close`): an
    /// iSCSI session's TSIH, an NVMe controller's ID.
    pub tsih: u16,
    pub portal_group_tag: u16,
    /// Our address the initiator connected to.
    pub portal: SocketAddr,
    pub source: SocketAddr,
    pub chap_user: Option<String>,
    /// What only its door knows of it.
    pub door: DoorFacts,
    pub started: SystemTime,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Its reads' and writes' latency since it began (`stats`; `ferrosan top`'s percentiles).
    pub latency: Mutex<[crate::metrics::LatencyCounts; 2]>,
}

/// A session's facts in its own door's terms, as `ctl sessions` and `top` show them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DoorFacts {
    Iscsi(IscsiFacts),
    Nvme(NvmeFacts),
}

/// An iSCSI session's identity and negotiated keys (RFC 7143 §13).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IscsiFacts {
    pub isid: [u8; 6],
    pub cid: u16,
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_recv_data_segment_length: u32,
    pub max_xmit_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
}

/// An NVMe/TCP controller's transport settings: the admin queue's digests, the keep-alive
/// timeout it asked for, what a command may carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeFacts {
    pub header_digest: bool,
    pub data_digest: bool,
    pub kato_ms: u32,
    /// The most data one command transfers (MDTS), and what a command capsule may carry.
    pub max_transfer: u32,
    pub in_capsule: u32,
    /// The queue runs over TLS (a configured PSK).
    pub tls: bool,
}

impl DoorFacts {
    pub fn name(&self) -> &'static str {
        match self {
            DoorFacts::Iscsi(_) => "iscsi",
            DoorFacts::Nvme(_) => "nvme",
        }
    }
}

impl SessionInfo {
    /// Adds the latency of commands of `op` (0 read, 1 write) counted since the last report.
    pub fn add_latency(&self, op: usize, counts: &crate::metrics::LatencyCounts) {
        let mut latency = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mine) = latency.get_mut(op) {
            mine.add(counts);
        }
    }

    /// The latency of `op` (0 read, 1 write) since the session began.
    pub fn latency(&self, op: usize) -> crate::metrics::LatencyCounts {
        let latency = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        latency.get(op).copied().unwrap_or_default()
    }

    pub fn add_io(&self, reads: u64, writes: u64, read_bytes: u64, write_bytes: u64) {
        self.reads.fetch_add(reads, Ordering::Relaxed);
        self.writes.fetch_add(writes, Ordering::Relaxed);
        self.read_bytes.fetch_add(read_bytes, Ordering::Relaxed);
        self.write_bytes.fetch_add(write_bytes, Ordering::Relaxed);
    }
}

/// Every TSIH a daemon that is no RBD gateway gives: 0 is reserved, and above FFEFh an NVMe
/// controller ID would be (one range serves both doors).
pub const ALL_IDS: RangeInclusive<u16> = 1..=nvme::controller::CNTLID_MAX;

/// The bounds of the registry: each kind of session has its own, so that none can take the
/// places of another.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Sessions with a target (`max_sessions`).
    pub sessions: usize,
    /// Discovery sessions (iSCSI SendTargets sessions, NVMe discovery controllers), which
    /// need no credentials by default: `max_discovery_sessions` in all...
    pub discovery: usize,
    /// ...and `max_discovery_sessions_per_source` from one address.
    pub discovery_per_source: usize,
}

impl Bounds {
    pub fn of(limits: &crate::config::Limits) -> Bounds {
        Bounds {
            sessions: limits.max_sessions as usize,
            discovery: limits.max_discovery_sessions as usize,
            discovery_per_source: limits.max_discovery_sessions_per_source as usize,
        }
    }
}

/// The three kinds of session, each under a bound of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A gateway peer's (`peer.rs`), bounded by `peer::ADMITTED_MAX`.
    Peer,
    Discovery,
    Normal,
}

/// Why a session could not be registered, and the limit (its config key, for the metric and
/// the log) when one was reached. Each door answers it in its own terms (an iSCSI login status,
/// an NVMe Connect status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    pub why: Full,
    pub limit: Option<&'static str>,
}

/// What the registry had no room for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// A bound or the session numbers ran out.
    OutOfResources,
    /// A second connection for an existing session (one connection per session).
    TooManyConnections,
    /// A connection for a session number that does not exist.
    SessionDoesNotExist,
}

impl Refused {
    fn full(limit: &'static str) -> Refused {
        Refused {
            why: Full::OutOfResources,
            limit: Some(limit),
        }
    }
}

pub struct Registry {
    inner: Mutex<Inner>,
    bounds: Bounds,
    /// The TSIHs (and NVMe controller IDs) this daemon gives: all of them, or an RBD
    /// gateway's share (`Gateways::session_ids`), so that no two gateways of a subsystem give
    /// a host the same controller ID.
    ids: RangeInclusive<u16>,
}

struct Inner {
    sessions: HashMap<SessionId, Entry>,
    next_tsih: u16,
}

/// Held by a connection in full feature phase; unregisters the session when dropped.
pub struct SessionTicket {
    registry: Arc<Registry>,
    id: SessionId,
    tsih: u16,
    /// Set (with the reason) when the session must close: reinstated, or closed by `ctl`.
    pub kill: watch::Receiver<Option<&'static str>>,
}

impl Drop for SessionTicket {
    fn drop(&mut self) {
        let mut inner = self.registry.lock();
        // A reinstated session has been replaced already: only remove our own entry.
        if inner
            .sessions
            .get(&self.id)
            .is_some_and(|e| e.tsih == self.tsih)
        {
            inner.sessions.remove(&self.id);
        }
    }
}

impl Registry {
    /// A registry of sessions within `bounds`, given TSIHs from `ids` (never 0).
    pub fn new(bounds: Bounds, ids: RangeInclusive<u16>) -> Registry {
        assert!(
            *ids.start() >= 1 && ids.start() <= ids.end(),
            "TSIH 0 is reserved; the range is not empty"
        );
        Registry {
            inner: Mutex::new(Inner {
                sessions: HashMap::new(),
                next_tsih: *ids.start(),
            }),
            bounds,
            ids,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere must not wedge logins forever; the map stays consistent per operation.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn session_count(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Wakes every session to look at the shared state again (`shared/nudge.rs`): its
    /// `kill` watch changes, its reason staying none.
    pub fn nudge_all(&self) {
        for entry in self.lock().sessions.values() {
            entry.kill.send_modify(|_| {});
        }
    }

    /// Registers a new session (TSIH 0 in the request) from `source`. An existing session with
    /// the same initiator, instance (ISID) and target is told to close: session reinstatement (RFC 7143
    /// §6.3.5).
    pub fn open(
        self: &Arc<Self>,
        initiator: &NodeName,
        instance: impl Into<Instance>,
        target: Option<&NodeName>,
        requested_tsih: u16,
        source: IpAddr,
    ) -> Result<SessionTicket, Refused> {
        let id = SessionId {
            initiator: initiator.clone(),
            instance: instance.into(),
            target: target.cloned(),
        };
        let mut inner = self.lock();
        if requested_tsih != 0 {
            // Adding a connection to a session: we run one connection per session.
            let why = if inner.sessions.values().any(|e| e.tsih == requested_tsih) {
                Full::TooManyConnections
            } else {
                Full::SessionDoesNotExist
            };
            return Err(Refused { why, limit: None });
        }
        if let Some(old) = inner.sessions.remove(&id) {
            let _ = old.kill.send(Some("reinstated by a new login"));
        } else {
            self.check_bounds(&inner, &id, source)?;
        }
        let tsih = self.free_tsih(&inner).ok_or(Refused {
            why: Full::OutOfResources,
            limit: None,
        })?;
        inner.next_tsih = self.after(tsih);
        let (kill, kill_rx) = watch::channel(None);
        inner.sessions.insert(
            id.clone(),
            Entry {
                tsih,
                source,
                kill,
                info: None,
            },
        );
        Ok(SessionTicket {
            registry: Arc::clone(self),
            id,
            tsih,
            kill: kill_rx,
        })
    }
}

impl Registry {
    /// The TSIH after `tsih` in the range, wrapping around.
    fn after(&self, tsih: u16) -> u16 {
        if tsih >= *self.ids.end() {
            *self.ids.start()
        } else {
            tsih + 1
        }
    }

    /// The first TSIH from `next_tsih` on that no session holds; None when every one of the
    /// range is held.
    fn free_tsih(&self, inner: &Inner) -> Option<u16> {
        let mut tsih = inner.next_tsih;
        for _ in self.ids.clone() {
            if !inner.sessions.values().any(|e| e.tsih == tsih) {
                debug_assert!(self.ids.contains(&tsih) && tsih != 0);
                return Some(tsih);
            }
            tsih = self.after(tsih);
        }
        None
    }
}

impl SessionTicket {
    pub fn tsih(&self) -> u16 {
        self.tsih
    }

    /// Publishes what `ctl sessions` shows of this session.
    pub fn describe(&self, info: Arc<SessionInfo>) {
        let mut inner = self.registry.lock();
        if let Some(e) = inner
            .sessions
            .get_mut(&self.id)
            .filter(|e| e.tsih == self.tsih)
        {
            e.info = Some(info);
        }
    }
}

impl Registry {
    /// Every session in full feature phase, by TSIH.
    pub fn sessions(&self) -> Vec<Arc<SessionInfo>> {
        let mut out: Vec<Arc<SessionInfo>> = self
            .lock()
            .sessions
            .values()
            .filter_map(|e| e.info.clone())
            .collect();
        out.sort_by_key(|i| i.tsih);
        out
    }

    /// Asks the session with `tsih` to close; false if there is none.
    pub fn close(&self, tsih: u16, reason: &'static str) -> bool {
        let inner = self.lock();
        match inner.sessions.values().find(|e| e.tsih == tsih) {
            Some(e) => {
                let _ = e.kill.send(Some(reason));
                true
            }
            None => false,
        }
    }
}

impl Registry {
    /// Whether a new session `id` from `source` fits its kind's bounds. Called once the login
    /// authenticated: a peer name here passed its image's CHAP.
    fn check_bounds(&self, inner: &Inner, id: &SessionId, source: IpAddr) -> Result<(), Refused> {
        let kind = kind_of(id);
        let (mut all, mut mine) = (0, 0);
        for (_, e) in inner.sessions.iter().filter(|(k, _)| kind_of(k) == kind) {
            all += 1;
            mine += usize::from(e.source == source);
        }
        let refused = match kind {
            Kind::Peer => (all >= crate::io::peer::ADMITTED_MAX).then_some("gateway_peer_sessions"),
            Kind::Normal => (all >= self.bounds.sessions).then_some("max_sessions"),
            Kind::Discovery if all >= self.bounds.discovery => Some("max_discovery_sessions"),
            Kind::Discovery => (mine >= self.bounds.discovery_per_source)
                .then_some("max_discovery_sessions_per_source"),
        };
        refused.map_or(Ok(()), |limit| Err(Refused::full(limit)))
    }
}

fn kind_of(id: &SessionId) -> Kind {
    if crate::io::peer::is_peer_name(id.initiator.as_str()) {
        Kind::Peer
    } else if id.target.is_none() {
        Kind::Discovery
    } else {
        Kind::Normal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> NodeName {
        NodeName::from_wire(s).unwrap()
    }

    const SRC: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1));

    fn bounds(sessions: usize) -> Bounds {
        Bounds {
            sessions,
            discovery: 64,
            discovery_per_source: 8,
        }
    }

    fn refused(why: Full, limit: Option<&'static str>) -> Option<Refused> {
        Some(Refused { why, limit })
    }

    #[test]
    fn reinstatement_kills_the_old_session() {
        let r = Arc::new(Registry::new(bounds(4), ALL_IDS));
        let t = name("iqn.t");
        let a = r.open(&name("iqn.x:é"), [1; 6], Some(&t), 0, SRC).unwrap();
        assert!(a.kill.borrow().is_none());
        // The same name in another spelling is the same initiator.
        let b = r.open(&name("IQN.X:É"), [1; 6], Some(&t), 0, SRC).unwrap();
        assert!(
            a.kill.borrow().is_some(),
            "same initiator+ISID+target reinstates"
        );
        assert_ne!(a.tsih(), b.tsih());
        drop(a);
        assert_eq!(
            r.session_count(),
            1,
            "the old ticket does not remove the new entry"
        );
        drop(b);
        assert_eq!(r.session_count(), 0);
    }

    #[test]
    fn nvme_controllers_of_one_host_are_never_reinstated() {
        let r = Arc::new(Registry::new(bounds(4), ALL_IDS));
        let (host, sub) = (name("nqn.2014-08.org.h:a"), name("nqn.2026-11.org.s:b"));
        let a = r.open(&host, Instance::Controller(1), Some(&sub), 0, SRC);
        let b = r.open(&host, Instance::Controller(2), Some(&sub), 0, SRC);
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(a.kill.borrow().is_none() && b.kill.borrow().is_none());
        assert_ne!(a.tsih(), b.tsih());
        // Nor does an iSCSI login of the same name with any ISID touch them.
        let _c = r.open(&host, [0; 6], Some(&sub), 0, SRC).unwrap();
        assert!(a.kill.borrow().is_none() && b.kill.borrow().is_none());
        assert_eq!(r.session_count(), 3);
    }

    #[test]
    fn tsihs_come_from_the_range_and_run_out_with_it() {
        let r = Arc::new(Registry::new(bounds(10), 5..=7));
        let t = name("iqn.t");
        let open = |isid: u8| r.open(&name("iqn.a"), [isid; 6], Some(&t), 0, SRC);
        let (a, b, c) = (open(1).unwrap(), open(2).unwrap(), open(3).unwrap());
        assert_eq!([a.tsih(), b.tsih(), c.tsih()], [5, 6, 7]);
        assert_eq!(
            open(4).err(),
            refused(Full::OutOfResources, None),
            "all three TSIHs held: refused, not looped on"
        );
        drop(b);
        // The next one wraps to the range's start, passes 5 (held) and takes 6.
        assert_eq!(open(5).unwrap().tsih(), 6);
    }

    #[test]
    fn limits_and_tsih_rules() {
        let r = Arc::new(Registry::new(bounds(2), ALL_IDS));
        let t = name("iqn.t");
        let open = |isid: u8, tsih: u16| r.open(&name("iqn.a"), [isid; 6], Some(&t), tsih, SRC);
        let a = open(1, 0).unwrap();
        let _b = open(2, 0).unwrap();
        assert_eq!(
            open(3, 0).err(),
            refused(Full::OutOfResources, Some("max_sessions"))
        );
        assert_eq!(
            open(3, a.tsih()).err(),
            refused(Full::TooManyConnections, None)
        );
        assert_eq!(open(3, 999).err(), refused(Full::SessionDoesNotExist, None));
        // Reinstating does not count against the limit.
        assert!(open(1, 0).is_ok());
    }

    #[test]
    fn discovery_sessions_take_no_place_of_a_target_and_are_bounded_per_source() {
        let r = Arc::new(Registry::new(bounds(2), ALL_IDS));
        let t = name("iqn.t");
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        let mut held = Vec::new();
        for isid in 0..8 {
            held.push(r.open(&name("iqn.d"), [isid; 6], None, 0, SRC).unwrap());
        }
        assert_eq!(
            r.open(&name("iqn.d"), [9; 6], None, 0, SRC).err(),
            refused(
                Full::OutOfResources,
                Some("max_discovery_sessions_per_source")
            )
        );
        // Another source still discovers, and sessions with a target are all still there.
        for isid in 0..8 {
            held.push(r.open(&name("iqn.e"), [isid; 6], None, 0, other).unwrap());
        }
        let _a = r.open(&name("iqn.a"), [1; 6], Some(&t), 0, SRC).unwrap();
        let _b = r.open(&name("iqn.a"), [2; 6], Some(&t), 0, other).unwrap();
        // The total bound, from every source.
        let r = Arc::new(Registry::new(bounds(2), ALL_IDS));
        let mut held = Vec::new();
        for i in 0..64u8 {
            let source = IpAddr::from([192, 0, 2, 10 + i / 8]);
            held.push(r.open(&name("iqn.d"), [i; 6], None, 0, source).unwrap());
        }
        let source = IpAddr::from([192, 0, 2, 200]);
        assert_eq!(
            r.open(&name("iqn.d"), [99; 6], None, 0, source).err(),
            refused(Full::OutOfResources, Some("max_discovery_sessions"))
        );
        assert!(r.open(&name("iqn.a"), [1; 6], Some(&t), 0, source).is_ok());
    }

    #[test]
    fn gateway_peers_and_initiators_have_bounds_of_their_own() {
        let r = Arc::new(Registry::new(bounds(2), ALL_IDS));
        let t = name("iqn.t");
        let peer = name(&format!("{}x", crate::io::peer::PEER_PREFIX));
        // Initiators fill max_sessions: peers still log in, up to their own bound.
        let _a = r.open(&name("iqn.a"), [1; 6], Some(&t), 0, SRC).unwrap();
        let _b = r.open(&name("iqn.a"), [2; 6], Some(&t), 0, SRC).unwrap();
        let mut peers = Vec::new();
        for i in 0..crate::io::peer::ADMITTED_MAX {
            let isid = [0, 0, 0, 0, (i >> 8) as u8, i as u8];
            peers.push(
                r.open(&peer, isid, Some(&t), 0, SRC)
                    .expect("a peer session"),
            );
        }
        assert_eq!(
            r.open(&peer, [9; 6], Some(&t), 0, SRC).err(),
            refused(Full::OutOfResources, Some("gateway_peer_sessions"))
        );
        assert_eq!(
            r.open(&name("iqn.a"), [3; 6], Some(&t), 0, SRC).err(),
            refused(Full::OutOfResources, Some("max_sessions"))
        );
        // Peers take nothing from initiators either: one leaves, one logs in.
        drop(_b);
        assert!(r.open(&name("iqn.a"), [3; 6], Some(&t), 0, SRC).is_ok());
    }
}
