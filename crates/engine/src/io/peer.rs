//! I/O shipping between RBD gateways: a gateway that does not own an image runs the commands
//! that need its medium on the owner, through an iSCSI session of its own to the owner's portal
//! (active/non-optimized paths, as dual-controller arrays ship I/O over their interconnect).
//! Only the owner ever writes the image, so the fence of a takeover still covers every write.
//!
//! The peer session logs in with the initiator name [`PEER_PREFIX`] + the LU's NAA and CHAP
//! with a secret kept in the image's metadata: only a client of the cluster (who could write
//! the image anyway) can ship. The owner admits that name only into a group of its own that
//! maps the device at LUN 0 (`topology/mod.rs`). Each nexus of the shipping gateway has a peer
//! session of its own, whose InitiatorAlias names that nexus ([`peer_alias`]); the owner runs
//! its commands as that initiator port through the shipping gateway's port
//! (`scsi::TargetPort::shipped`), so reservations, registrations and unit attentions are
//! those of the initiator's own I_T nexus. A session is driven by a thread of its own while it
//! has work (`drive`): the network workers queue commands and go on, so no thread of theirs
//! (nor an I/O thread) waits for another gateway.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use initiator::driver::Connection;
use initiator::scsi::Cdb;
use initiator::session::{Command, Completion, Residual, ScsiResult, Tmf, Transfer};
use initiator::{Auth, ChapConfig, ClientConfig, SessionConfig, SessionKind};

/// The image metadata key holding the peer sessions' CHAP secret.
pub const SECRET_KEY: &str = "ferrosan.gateway_peer_secret";

/// A shipped command not answered within this fails (NOT READY, transition: the initiator
/// retries), and the peer session is dropped.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Initiator names of peer sessions: this, then the LU's NAA in hex.
pub const PEER_PREFIX: &str = "iqn.2026-11.org.ferrosan:gateway-peer.";

/// How a peer session's InitiatorAlias names the nexus it ships for.
const ALIAS_PREFIX: &str = "ferrosan-peer-of ";

/// The InitiatorAlias of `nexus`'s peer session: its initiator port and this gateway's
/// relative target port.
pub fn peer_alias(nexus: &scsi::Nexus) -> String {
    format!(
        "{ALIAS_PREFIX}{} {}",
        nexus.target_port.relative_id, nexus.initiator_port
    )
}

/// The initiator port and relative target port a peer session's alias names.
pub fn parse_peer_alias(alias: &str) -> Option<(String, u16)> {
    let rest = alias.strip_prefix(ALIAS_PREFIX)?;
    let (port, initiator) = rest.split_once(' ')?;
    // 0 is an NVMe host's nexus (scsi::ANY_PORT): every other is a real port's ID.
    let port = port.parse().ok()?;
    (!initiator.is_empty() && initiator.len() <= 255 && !initiator.contains(char::is_whitespace))
        .then(|| (initiator.to_string(), port))
}

/// The peer sessions' initiator name for an LU with this identity.
pub fn peer_name(identity: &scsi::LuIdentity) -> String {
    let naa: String = identity
        .naa
        .iter()
        .take(identity.naa_len)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{PEER_PREFIX}{naa}")
}

/// Whether `initiator` (a login's initiator name) is a gateway's peer session.
pub fn is_peer_name(initiator: &str) -> bool {
    initiator.starts_with(PEER_PREFIX)
}

/// The image's peer secret: read, or made and stored by the first gateway to need it (a
/// compare-and-set, so two gateways starting together agree on one).
pub fn secret(image: &rbd::Image) -> Result<String, rbd::Error> {
    for _ in 0..4 {
        if let Some(secret) = image.metadata(SECRET_KEY)?.filter(|s| s.len() >= 32) {
            return Ok(secret);
        }
        let mut bytes = [0u8; 16];
        initiator::driver::random_bytes(&mut bytes);
        let made: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        if image.compare_and_set_metadata(SECRET_KEY, "", &made)? {
            return Ok(made);
        }
    }
    image
        .metadata(SECRET_KEY)?
        .ok_or_else(|| rbd::Error::Invalid("the gateway peer secret keeps changing".into()))
}

/// How this gateway reaches an image's owner: fixed while the device is open.
pub struct PeerRoute {
    /// The peer sessions' initiator name ([`peer_name`]).
    pub name: String,
    /// A target that maps the device on every gateway (the first in the config).
    pub target: String,
    pub secret: String,
    /// Each gateway's portal addresses, by its index in the ownership's gateway list.
    pub portals: Vec<Vec<String>>,
}

/// Peer sessions beyond this many (per image) are not opened: the command gets NOT READY,
/// transition (retry), as when the owner cannot be reached.
const SESSIONS_MAX: usize = 256;

/// Peer sessions (and their connections) the owner admits beyond `max_sessions` and a
/// source's `max_connections_per_source`, all other gateways and images together: peers log
/// in from the other gateways' addresses, one session per initiator nexus that ships, so
/// counting them among the initiators' would let one initiator with many sessions on a
/// non-owner take every place its gateway's address has at the owner.
pub const ADMITTED_MAX: usize = 1024;

/// Why a shipped command got no answer from the owner: the initiator is answered NOT READY,
/// transition, and retries.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ShipError {
    /// No portal of the owner let the peer session log in.
    #[error("{0}")]
    Unreachable(String),
    /// The peer session closed, broke or failed with the command queued or in flight.
    #[error("{0}")]
    Broken(String),
}

/// A shipped command's outcome as the peer session delivers it.
type Outcome = Result<ScsiResult, ShipError>;

/// Where a shipped command's outcome goes (called on the session's driver thread).
type Reply = Box<dyn FnOnce(Outcome) + Send>;

/// Tags of shipped commands start here (the driver's own exchanges use small ones and
/// `u64::MAX - 1`).
const TAG_BASE: u64 = 1 << 48;

/// How long a session's driver thread stays for more work once nothing is queued or in flight
/// (the session itself stays logged in).
const DRIVER_IDLE: Duration = Duration::from_secs(2);

/// How long a waiting caller of [`PeerLink::ship`] or [`PeerLink::reset`] waits at most: past
/// the session's own command timeout, which normally answers first.
const CALLER_WAIT: Duration = Duration::from_secs(COMMAND_TIMEOUT.as_secs() + 15);

/// What a peer session's driver does for its callers.
enum Job {
    Command {
        cdb: Cdb,
        transfer: Transfer,
        reply: Reply,
    },
    /// LOGICAL UNIT RESET at the owner; true when it answered *function complete*.
    Reset(Box<dyn FnOnce(bool) + Send>),
}

impl Job {
    fn fail(self, why: &ShipError) {
        match self {
            Job::Command { reply, .. } => reply(Err(why.clone())),
            Job::Reset(reply) => reply(false),
        }
    }
}

/// One peer session, driven by a thread of its own while it has work: callers (the network
/// workers, which never wait for the owner) queue commands and raise `wake`; the driver sends
/// them, pipelined, and delivers each completion to its caller's reply.
struct PeerSession {
    /// Its InitiatorAlias ([`peer_alias`]).
    alias: String,
    /// The gateway it is logged in to.
    owner: usize,
    /// An eventfd: written when a job is queued or the session closes, ending the driver's
    /// wait for the owner's answers.
    wake: OwnedFd,
    /// Set when the session is no longer this nexus's (the owner moved, the nexus went).
    closed: AtomicBool,
    /// None until logged in (at the first command), and again after it broke. Held by the
    /// driver while it runs; kept between drivers, so the owner keeps the nexus (its unit
    /// attentions) as long as the nexus lives here.
    connection: Mutex<Option<Connection>>,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    /// Not sent yet.
    queued: VecDeque<Job>,
    /// Sent, by tag.
    waiting: HashMap<u64, Reply>,
    next_tag: u64,
    /// Whether a driver thread runs (or is starting) for the session.
    driven: bool,
}

impl PeerSession {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn raise(&self) {
        // A full counter (never, at 2^64 - 2) still reads as raised.
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn lower(&self) {
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut counter);
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.raise();
    }

    /// Every job queued or in flight fails with `why` (the connection is gone).
    fn fail_all(&self, why: &ShipError) {
        let (queued, waiting) = {
            let mut pending = self.pending();
            (
                std::mem::take(&mut pending.queued),
                std::mem::take(&mut pending.waiting),
            )
        };
        for job in queued {
            job.fail(why);
        }
        for (_, reply) in waiting {
            reply(Err(why.clone()));
        }
    }
}

/// The peer sessions to the current owner: one per nexus of this gateway that ships, so the
/// owner sees one nexus per initiator nexus (its unit attentions, copy results and task
/// management then work per nexus as they would directly).
pub struct PeerLink {
    route: Arc<LinkRoute>,
    sessions: Mutex<Sessions>,
    metrics: crate::metrics::ShippingMetrics,
}

/// What a session's driver needs to log in.
struct LinkRoute {
    route: PeerRoute,
    device: String,
}

#[derive(Default)]
struct Sessions {
    /// The owner every session below is logged in to.
    owner: Option<usize>,
    by_nexus: HashMap<u64, Arc<PeerSession>>,
}

impl Sessions {
    fn close_all(&mut self) {
        for (_, session) in self.by_nexus.drain() {
            session.close();
        }
    }
}

impl PeerLink {
    pub fn new(
        route: PeerRoute,
        device: &str,
        metrics: crate::metrics::ShippingMetrics,
    ) -> PeerLink {
        PeerLink {
            route: Arc::new(LinkRoute {
                route,
                device: device.to_string(),
            }),
            sessions: Mutex::new(Sessions::default()),
            metrics,
        }
    }

    fn count_sessions(&self, sessions: &Sessions) {
        let open = i64::try_from(sessions.by_nexus.len()).unwrap_or(i64::MAX);
        self.metrics.peer_sessions.set(open);
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The owner moved (or this gateway took it, None): every session to the old one goes.
    pub fn follow(&self, owner: Option<usize>) {
        let mut sessions = self.sessions();
        if sessions.owner != owner {
            sessions.close_all();
            sessions.owner = owner;
            self.count_sessions(&sessions);
        }
    }

    /// The nexus is gone here: its peer session goes too.
    pub fn nexus_lost(&self, nexus: u64) {
        let mut sessions = self.sessions();
        if let Some(session) = sessions.by_nexus.remove(&nexus) {
            session.close();
            self.count_sessions(&sessions);
        }
    }

    /// `nexus`'s session to `owner` (made, not yet logged in, at its first use); None beyond
    /// [`SESSIONS_MAX`] or without an eventfd.
    fn session(&self, nexus: &scsi::Nexus, owner: usize) -> Option<Arc<PeerSession>> {
        let mut sessions = self.sessions();
        if sessions.owner != Some(owner) {
            sessions.close_all();
            sessions.owner = Some(owner);
            self.count_sessions(&sessions);
        }
        let full = sessions.by_nexus.len() >= SESSIONS_MAX;
        let device = &self.route.device;
        match sessions.by_nexus.get(&nexus.id) {
            Some(session) => Some(Arc::clone(session)),
            None if full => {
                tracing::warn!(%device, "{SESSIONS_MAX} peer sessions open already: not shipping");
                None
            }
            None => {
                let flags =
                    rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
                let wake = match rustix::event::eventfd(0, flags) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!(%device, "no eventfd for a peer session: {e}");
                        return None;
                    }
                };
                let session = Arc::new(PeerSession {
                    alias: peer_alias(nexus),
                    owner,
                    wake,
                    closed: AtomicBool::new(false),
                    connection: Mutex::new(None),
                    pending: Mutex::new(Pending::default()),
                });
                sessions.by_nexus.insert(nexus.id, Arc::clone(&session));
                self.count_sessions(&sessions);
                Some(session)
            }
        }
    }

    /// Queues `job` on `nexus`'s session to `owner`, starting its driver if none runs. The
    /// job is handed back when no session can be had.
    fn enqueue(&self, nexus: &scsi::Nexus, owner: usize, job: Job) -> Result<(), Job> {
        let Some(session) = self.session(nexus, owner) else {
            return Err(job);
        };
        let start = {
            let mut pending = session.pending();
            pending.queued.push_back(job);
            !std::mem::replace(&mut pending.driven, true)
        };
        if start {
            let (route, driven) = (Arc::clone(&self.route), Arc::clone(&session));
            let spawned = std::thread::Builder::new()
                .name("ferrosan-peer".into())
                .spawn(move || drive(&route, &driven));
            if let Err(e) = spawned {
                session.pending().driven = false;
                session.fail_all(&ShipError::Broken(format!(
                    "no thread for the peer session: {e}"
                )));
            }
        }
        session.raise();
        Ok(())
    }

    /// Runs `cmd` of `nexus` on `owner` without waiting: `done` gets the owner's completion
    /// (status, sense, residual) and Data-In, on the session's driver thread. A session that
    /// cannot be had or breaks answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION (retry).
    pub fn ship_then(
        &self,
        nexus: &scsi::Nexus,
        owner: usize,
        cmd: scsi::ShippedCommand,
        done: scsi::ShipDone,
    ) {
        let Some(cdb) = Cdb::new(&cmd.cdb) else {
            return done(
                scsi::Completion::check_condition(scsi::Sense::invalid_opcode()),
                Vec::new(),
            );
        };
        let reads = cmd.data_out.is_empty() && cmd.data_in_limit > 0;
        let limit = cmd.data_in_limit;
        let (transfer, expected) = if !cmd.data_out.is_empty() {
            let len = u32::try_from(cmd.data_out.len()).unwrap_or(u32::MAX);
            (Transfer::Write(cmd.data_out), len)
        } else if reads {
            (
                Transfer::Read {
                    len: limit,
                    buf: Vec::new(),
                },
                limit,
            )
        } else {
            (Transfer::None, 0)
        };
        let device = self.route.device.clone();
        self.metrics.shipped.inc();
        let failures = self.metrics.failures.clone();
        let reply: Reply = Box::new(move |outcome| {
            if outcome.is_err() {
                failures.inc();
            }
            let (completion, data_in) = answer(&device, expected, reads, limit, outcome);
            done(completion, data_in)
        });
        if let Err(job) = self.enqueue(
            nexus,
            owner,
            Job::Command {
                cdb,
                transfer,
                reply,
            },
        ) {
            job.fail(&ShipError::Broken("no peer session".into()));
        }
    }

    /// [`PeerLink::ship_then`], waiting for the answer (Data-In appended to `data_in`).
    pub fn ship(
        &self,
        nexus: &scsi::Nexus,
        owner: usize,
        cmd: &scsi::Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> scsi::Completion {
        let (tx, rx) = mpsc::channel();
        self.ship_then(
            nexus,
            owner,
            scsi::ShippedCommand::new(cmd),
            Box::new(move |completion, data| {
                let _ = tx.send((completion, data));
            }),
        );
        match rx.recv_timeout(CALLER_WAIT) {
            Ok((completion, data)) => {
                data_in.extend_from_slice(&data);
                completion
            }
            Err(_) => scsi::Completion::check_condition(scsi::Sense::not_ready_transition()),
        }
    }

    /// LOGICAL UNIT RESET at `owner` through `nexus`'s peer session (after the commands queued
    /// on it before); the unit attention it leaves the peer nexus itself is taken (this
    /// gateway raises its own). True when the owner answered *function complete*.
    pub fn reset(&self, nexus: &scsi::Nexus, owner: usize) -> bool {
        let (tx, rx) = mpsc::channel();
        let job = Job::Reset(Box::new(move |done| {
            let _ = tx.send(done);
        }));
        if self.enqueue(nexus, owner, job).is_err() {
            return false;
        }
        rx.recv_timeout(CALLER_WAIT).unwrap_or(false)
    }

    /// Makes the owner take up the reservations as stored (a PERSISTENT RESERVE IN, which reads
    /// them first, through `nexus`'s peer session): after a PERSISTENT RESERVE OUT here, before
    /// it is answered.
    pub fn refresh_reservations(&self, nexus: &scsi::Nexus, owner: usize) {
        let read_keys = scsi::Command {
            cdb: &[0x5E, 0x00, 0, 0, 0, 0, 0, 0, 8, 0],
            data_out: &[],
            data_in_limit: 8,
        };
        let done = self.ship(nexus, owner, &read_keys, &mut Vec::new());
        if done.status != scsi::Status::Good {
            tracing::warn!(device = %self.route.device, "the owner did not re-read the reservations: {:?}", done.sense);
        }
    }
}

/// Logs in to `owner`'s first portal that answers, and takes the new nexus's unit attentions
/// (its POWER ON): they are the peer session's, not the LU's.
fn connect(route: &LinkRoute, owner: usize, alias: &str) -> Result<Connection, ShipError> {
    let portals = route
        .route
        .portals
        .get(owner)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| {
            ShipError::Unreachable("the owner has no portal address to ship to".into())
        })?;
    let mut last = String::new();
    for address in portals {
        let name = route.route.name.clone();
        let mut session = SessionConfig::new(
            name.clone(),
            SessionKind::Normal {
                target_name: route.route.target.clone(),
            },
        );
        session.auth = Auth::Chap(ChapConfig::new(
            name,
            route.route.secret.as_bytes().to_vec(),
        ));
        session.initiator_alias = Some(alias.to_string());
        session.command_timeout = COMMAND_TIMEOUT;
        let mut config = ClientConfig::new(address.clone(), session);
        config.timeouts.connect = Duration::from_secs(2);
        config.timeouts.login = Duration::from_secs(5);
        match Connection::connect(&config) {
            Ok(mut connection) => {
                take_unit_attentions(&mut connection);
                tracing::debug!(device = %route.device, "peer session to the owner at {address}");
                return Ok(connection);
            }
            Err(e) => last = format!("{address}: {e}"),
        }
    }
    Err(ShipError::Unreachable(last))
}

/// A session's driver: runs while the session has work (and [`DRIVER_IDLE`] longer), sending
/// queued jobs and delivering completions. The connection is logged in at the first job, and
/// again after it broke (what it carried fails: NOT READY, transition, for the initiator to
/// retry). Bounded: the session times out a command the owner does not answer
/// (`COMMAND_TIMEOUT`), which breaks the connection.
fn drive(route: &LinkRoute, session: &PeerSession) {
    let device = &route.device;
    let mut held = session.connection.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        session.lower();
        if session.closed.load(Ordering::Acquire) {
            *held = None;
            session.fail_all(&ShipError::Broken("the peer session closed".into()));
            session.pending().driven = false;
            // A job queued between the failing and now finds `driven` false and starts a
            // driver of its own, which fails it here.
            return;
        }
        let (has_jobs, has_waiting) = {
            let pending = session.pending();
            (!pending.queued.is_empty(), !pending.waiting.is_empty())
        };
        if !has_jobs && !has_waiting {
            if !readable(&session.wake, DRIVER_IDLE) {
                let mut pending = session.pending();
                if pending.queued.is_empty() && !session.closed.load(Ordering::Acquire) {
                    pending.driven = false;
                    return;
                }
            }
            continue;
        }
        if held.as_ref().is_some_and(|c| c.broken().is_some()) {
            *held = None;
            session.fail_all(&ShipError::Broken("the peer session broke".into()));
            continue;
        }
        if held.is_none() {
            match connect(route, session.owner, &session.alias) {
                Ok(connection) => *held = Some(connection),
                Err(e) => {
                    tracing::warn!(%device, "cannot reach the owner: {e}");
                    session.fail_all(&e);
                    continue;
                }
            }
        }
        let Some(connection) = held.as_mut() else {
            continue;
        };
        if let Err(e) = run_queued(session, connection) {
            tracing::warn!(%device, "the peer session to the owner failed: {e}");
            *held = None;
            session.fail_all(&e);
            continue;
        }
        let reaped = connection
            .wait_completion_or_wake(Duration::from_secs(1), session.wake.as_fd())
            .and_then(|mut next| {
                while let Some(completion) = next {
                    let reply = session.pending().waiting.remove(&completion.tag);
                    if let Some(reply) = reply {
                        reply(completion.result.map_err(broken));
                    }
                    next = connection.try_completion()?;
                }
                Ok(())
            });
        if let Err(e) = reaped {
            tracing::warn!(%device, "the peer session to the owner failed: {e}");
            *held = None;
            session.fail_all(&ShipError::Broken(e.to_string()));
        }
    }
}

/// Sends every queued command (and runs a queued reset, in order), then flushes.
fn run_queued(session: &PeerSession, connection: &mut Connection) -> Result<(), ShipError> {
    loop {
        let job = {
            let mut pending = session.pending();
            match pending.queued.pop_front() {
                Some(Job::Command {
                    cdb,
                    transfer,
                    reply,
                }) => {
                    let tag = TAG_BASE + pending.next_tag;
                    pending.next_tag = pending.next_tag.wrapping_add(1);
                    let command = Command {
                        tag,
                        lun: 0,
                        cdb,
                        transfer,
                        attr: Default::default(),
                    };
                    match connection.submit(command) {
                        Ok(_) => {
                            pending.waiting.insert(tag, reply);
                            continue;
                        }
                        Err(e) => {
                            drop(pending);
                            reply(Err(ShipError::Broken(e.to_string())));
                            continue;
                        }
                    }
                }
                Some(reset @ Job::Reset(_)) => reset,
                None => break,
            }
        };
        let Job::Reset(reply) = job else {
            continue;
        };
        connection.flush().map_err(broken)?;
        match connection.task_management(Tmf::LunReset { lun: 0 }) {
            Ok(0) => {
                take_unit_attentions(connection);
                reply(true);
            }
            Ok(response) => {
                tracing::warn!("the owner answered a LUN reset with {response}");
                reply(false);
            }
            Err(e) => {
                reply(false);
                return Err(ShipError::Broken(format!(
                    "passing a LUN reset to the owner: {e}"
                )));
            }
        }
    }
    connection.flush().map_err(broken)
}

fn broken(e: impl std::fmt::Display) -> ShipError {
    ShipError::Broken(e.to_string())
}

/// Whether `fd` became readable within `timeout`.
fn readable(fd: &OwnedFd, timeout: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    let ts = rustix::event::Timespec::try_from(timeout).ok();
    matches!(rustix::event::poll(&mut fds, ts.as_ref()), Ok(n) if n > 0)
}

/// A shipped command's completion here from the owner's answer: its status, sense and
/// residual, and its Data-In (within the allowance). What cannot be relayed (no session, an
/// unknown status, CHECK CONDITION without sense) is NOT READY, transition: retry.
fn answer(
    device: &str,
    expected: u32,
    reads: bool,
    limit: u32,
    outcome: Outcome,
) -> (scsi::Completion, Vec<u8>) {
    let transition = || {
        (
            scsi::Completion::check_condition(scsi::Sense::not_ready_transition()),
            Vec::new(),
        )
    };
    let mut result = match outcome {
        Ok(result) => result,
        Err(e) => {
            tracing::warn!(%device, "shipping to the owner failed: {e}");
            return transition();
        }
    };
    let data_in = if reads {
        let mut data = std::mem::take(&mut result.data);
        data.truncate(limit as usize);
        data
    } else {
        Vec::new()
    };
    let transfer_len = match result.residual {
        Residual::None => expected,
        Residual::Under(n) => expected.saturating_sub(n),
        Residual::Over(n) => expected.saturating_add(n),
    };
    let status = match result.status {
        0x00 => scsi::Status::Good,
        0x02 => scsi::Status::CheckCondition,
        0x04 => scsi::Status::ConditionMet,
        0x08 => scsi::Status::Busy,
        0x18 => scsi::Status::ReservationConflict,
        0x28 => scsi::Status::TaskSetFull,
        0x40 => scsi::Status::TaskAborted,
        other => {
            tracing::warn!(%device, "the owner answered status {other:#04x}");
            return transition();
        }
    };
    let sense = result
        .sense
        .as_ref()
        .and_then(|s| scsi::Sense::decode(&s.raw));
    if status == scsi::Status::CheckCondition && sense.is_none() {
        return transition();
    }
    (
        scsi::Completion {
            status,
            sense,
            transfer_len,
        },
        data_in,
    )
}

/// Takes a new (or just reset) peer nexus's unit attentions: TEST UNIT READY until none (its
/// other commands' completions stay queued for their reaper).
fn take_unit_attentions(connection: &mut Connection) {
    for tag in 0..8u64 {
        match connection.run(Command::none(tag + 1, 0, tur())) {
            Ok(Completion { result: Ok(r), .. }) if r.is_unit_attention() => continue,
            _ => break,
        }
    }
}

fn tur() -> Cdb {
    initiator::scsi::test_unit_ready()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_alias_names_the_nexus_and_nothing_else_parses() {
        let nexus = scsi::Nexus {
            id: 4,
            initiator_port: "iqn.1994-05.com.redhat:host,i,0x023d00000001".into(),
            target_port: std::sync::Arc::new(scsi::TargetPort::alone(
                7,
                "iqn.2026-11.org.ferrosan:x,t,0x0007".into(),
                "iqn.2026-11.org.ferrosan:x".into(),
            )),
        };
        let alias = peer_alias(&nexus);
        assert_eq!(
            parse_peer_alias(&alias),
            Some(("iqn.1994-05.com.redhat:host,i,0x023d00000001".into(), 7))
        );
        for bad in [
            "",
            "host1",
            "ferrosan-peer-of ",
            "ferrosan-peer-of 7",
            "ferrosan-peer-of 70000 iqn.x,i,0x01",
            "ferrosan-peer-of x iqn.x,i,0x01",
            "ferrosan-peer-of 7 iqn.x,i,0x01 extra",
            "ferrosan-peer-of 7 ",
        ] {
            assert_eq!(parse_peer_alias(bad), None, "{bad:?}");
        }
        let long = format!("ferrosan-peer-of 7 {}", "a".repeat(300));
        assert_eq!(parse_peer_alias(&long), None);
        // An NVMe host's nexus ships as port 0 (scsi::ANY_PORT).
        assert_eq!(
            parse_peer_alias("ferrosan-peer-of 0 nqn.2014-08.org.nvmexpress:uuid:x,h,0x00"),
            Some(("nqn.2014-08.org.nvmexpress:uuid:x,h,0x00".into(), 0))
        );
    }
}
