//! One connection from accept to close: login, then full feature phase. Owned by one worker
//! thread for its whole life (no hand-off per command). Each turn parses every complete PDU the
//! read returned, runs them, and sends all responses with one vectored write.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iscsi::login::{
    Admission, AuthRequirement, ChapRequirement, Established, Login, LoginLimits, LoginPolicy,
    LoginStatus, LoginStep, SessionKey,
};
use iscsi::negotiation::{SessionType, TargetLimits};
use iscsi::outbox::{Outbox, Part, ReadBuffers};
use iscsi::pdu::{self, FrameError, Framing, Opcode};
use iscsi::session::{
    Activity, DataOutBuf, DataOutMemory, DeferredCommand, DiscoveredTarget, Execution, Flow, Loan,
    ScsiBackend, ScsiOutcome, ScsiRequest, Session, SessionLimits, TmfAnswer, TmfFunction,
};
use rustix::net::{RecvFlags, SendAncillaryBuffer, SendFlags};
use scsi::{LunEntry, LunMap, Nexus};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use crate::dataplane::alarm::Alarm;
use crate::dataplane::busy_poll;
use crate::dataplane::coalesce::{Coalescer, Lockstep, Outcome, Plan};
use crate::dataplane::sys;
use crate::metrics::Metrics;

use super::closed::Closed;
use super::lifecycle::{self, Lifecycle, Shutdown};
use crate::admission::doors::ConnectionGuard;
use crate::admission::registry::SessionTicket;
use crate::admission::Refusal;
use crate::admission::{Admitted, Standing};
use crate::config::IscsiName;
use crate::config::ResolvedAuth;
use crate::dataplane::route;
use crate::io::group_commit::{Durability, GroupCommit};
use crate::io::ring::{self, DeviceRing, RingOp};
use crate::io::stall::WriteStalls;
use crate::metrics::{IoCounts, LatencyCounts};
use crate::shared::Shared;
use crate::topology::{DiskLun, GroupRuntime, Membership, Topology};

/// A connection the acceptor admitted and gave to this worker.
pub struct NewConnection {
    pub stream: std::net::TcpStream,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub portal_group_tag: u16,
    pub guard: ConnectionGuard,
    /// Its place among the connections still logging in, given up once it logged in.
    pub prelogin: crate::admission::prelogin::Ticket,
}

/// What a command of unbounded cost (`scsi::runs_long`: EXTENDED COPY, WRITE SAME, UNMAP)
/// counts against its connection's `memory_per_connection_bytes` while it runs on the I/O
/// threads: its copy buffer (up to 1 MiB) and the thread it holds. With the default budget
/// (64 MiB) a connection runs at most 8 at once, so it cannot take every I/O thread its
/// worker's other sessions need.
const LONG_COMMAND_HELD_BYTES: usize = 8 << 20;

/// Largest AHS a PDU may carry (TotalAHSLength is one byte of 4-byte words).
const AHS_BYTES_MAX: usize = 255 * 4;
/// Responses queued in one turn before they are sent (bounds Data-In memory per connection).
const TURN_BYTES_MAX: usize = 4 << 20;
/// Largest single write (EDTL) accepted.
const WRITE_BYTES_MAX: u32 = 64 << 20;
/// Slices per writev call (Linux IOV_MAX is 1024).
const IOV_BATCH: usize = 512;
/// Reads at least this long are sent straight from the page cache (`sendfile`) when the LU is a
/// file whose pages hold all of the range; shorter ones are copied, as are reads on connections
/// with data digests. Below it the extra system calls (cachestat, a sendfile per Data-In PDU, a
/// vectored write split around each) cost more than the copies they save.
const FILE_SEND_MIN_BYTES: u32 = 64 * 1024;
/// Write payloads (Data-Out, or a command's immediate data) at least this long that are still
/// arriving are received straight into the command's buffer instead of through the receive
/// buffer (one copy fewer per byte written).
const IN_PLACE_MIN: usize = 64 * 1024;
/// Idle direct-I/O buffers a worker keeps for reuse, at most (see `store::BufPool`): enough for
/// a QD16 stream of 1 MiB I/Os on each of two connections, and a bound on what idles.
const DIRECT_BUFFERS_IDLE_BYTES_MAX: usize = 32 << 20;

thread_local! {
    /// This worker's direct-I/O buffers. Per worker, not per connection: idle connections then
    /// hold none, and a buffer lent to a Data-In on another thread still comes home.
    static DIRECT_BUFFERS: store::BufPool = store::BufPool::new(DIRECT_BUFFERS_IDLE_BYTES_MAX);
}

pub async fn serve(shared: Arc<Shared>, conn: NewConnection) {
    let NewConnection {
        stream,
        peer,
        local,
        portal_group_tag,
        guard,
        prelogin,
    } = conn;
    let peer_only = guard.peer_only;
    let _guard = guard;
    let stream = match TcpStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, "cannot register connection: {e}");
            return;
        }
    };
    let mut driver = Driver::new(stream, peer, local, portal_group_tag, &shared);
    if let Err(reason) = driver.run(&shared, prelogin, peer_only).await {
        tracing::debug!(%peer, "connection closed: {reason}");
    }
}

struct Driver {
    stream: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    portal_group_tag: u16,
    /// Receive buffer: `RBUF_IDLE` bytes until the connection needs more, then `rbuf_full`.
    rbuf: Vec<u8>,
    rbuf_full: usize,
    start: usize,
    end: usize,
    /// Bytes arrived since the last tick (an idle second shrinks the buffer back).
    received: bool,
    /// Whether the last PDU handled carried a long data segment: reads then stop at the next
    /// header, so that a long payload behind it can be received in place.
    last_pdu_long: bool,
    out: Outbox,
}

/// The receive buffer of a connection that has not needed more: room for any login PDU
/// (8 KiB of data at most) and a few small commands. It grows to the full size (twice the
/// largest PDU, 514 KiB by default) when a read fills it or a PDU does not fit, and shrinks back
/// after a second with nothing received. Allocating the full size up front made every idle
/// session pin it: once glibc serves blocks that large from its arenas (after the first one is
/// freed) a zeroed one is written whole, so resident — 192–233 KiB of RSS per idle session
/// measured, 22 KiB with this.
const RBUF_IDLE: usize = 16 * 1024;

/// The login policy of one connection: knows which portal it arrived on and from where.
struct Policy<'a> {
    shared: &'a Shared,
    portal_group_tag: u16,
    peer: SocketAddr,
    ticket: Option<SessionTicket>,
    /// Admitted past its source's `max_connections_per_source`: a gateway peer's login only.
    peer_only: bool,
    /// The group the initiator was admitted as (normal sessions) and the authentication that
    /// required, in the topology it was admitted under: its session's LUN map comes from
    /// this, not from a second lookup.
    /// `None` as the membership: a discovery session, with discovery's authentication.
    admitted: Option<(Arc<Topology>, Option<Membership>, ResolvedAuth)>,
}

impl Policy<'_> {
    /// Refuses a login on a connection admitted for gateway peers only, unless it is a peer's,
    /// and every login from a source that failed too often lately (docs/CONFIG.md,
    /// `login_failures_max`).
    fn check_source(&self, initiator_name: &IscsiName) -> Result<(), LoginStatus> {
        // A connection past its source's limit is for a gateway peer only (admission/doors.rs).
        if self.peer_only && !crate::io::peer::is_peer_name(initiator_name.as_str()) {
            tracing::warn!(
                peer = %self.peer,
                initiator = %initiator_name,
                "login refused: max_connections_per_source"
            );
            self.shared.metrics.limit("max_connections_per_source");
            return Err(LoginStatus::OUT_OF_RESOURCES);
        }
        if self
            .shared
            .doors
            .login_blocked(self.peer.ip(), Instant::now())
        {
            tracing::warn!(
                peer = %self.peer,
                initiator = %initiator_name,
                "login refused: too many failed logins from this address"
            );
            self.shared.metrics.limit("login_failures_max");
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        Ok(())
    }

    fn requirement(&self, auth: ResolvedAuth) -> AuthRequirement {
        match auth {
            ResolvedAuth::None => AuthRequirement::None,
            ResolvedAuth::Chap { users, mutual } => AuthRequirement::Chap(ChapRequirement {
                users: users.iter().map(|u| u.credential()).collect(),
                mutual: mutual.map(|m| m.credential()),
                algorithms: self.shared.chap_algorithms.clone(),
            }),
        }
    }
}

impl LoginPolicy for Policy<'_> {
    fn admit(
        &mut self,
        initiator_name: &IscsiName,
        target_name: &IscsiName,
    ) -> Result<Admission, LoginStatus> {
        self.check_source(initiator_name)?;
        let topology = self.shared.topology();
        let admitted = topology.admit(
            initiator_name,
            target_name,
            self.portal_group_tag,
            self.peer.ip(),
        );
        let (membership, auth) = match admitted {
            Ok(admitted) => admitted,
            Err(Refusal::NoSuchTarget) => return Err(LoginStatus::NOT_FOUND),
            Err(refusal) => {
                let why = match refusal {
                    Refusal::SourceNotAllowed => "source address not in allowed_sources",
                    _ => "initiator not in any group",
                };
                tracing::warn!(
                    peer = %self.peer,
                    initiator = %initiator_name,
                    target = %target_name,
                    "login refused: {why}"
                );
                return Err(LoginStatus::FORBIDDEN);
            }
        };
        let alias = topology
            .targets
            .get(membership.target)
            .and_then(|t| t.alias.clone());
        let requirement = self.requirement(auth.clone());
        // The session's LUN map comes from this same membership, not from a second lookup.
        self.admitted = Some((topology, Some(membership), auth));
        Ok(Admission {
            target_alias: alias,
            portal_group_tag: self.portal_group_tag,
            auth: requirement,
        })
    }

    fn admit_discovery(&mut self, initiator_name: &IscsiName) -> Result<Admission, LoginStatus> {
        self.check_source(initiator_name)?;
        let topology = self.shared.topology();
        let auth = topology.config.discovery.resolved();
        let requirement = self.requirement(auth.clone());
        self.admitted = Some((topology, None, auth));
        Ok(Admission {
            target_alias: None,
            portal_group_tag: self.portal_group_tag,
            auth: requirement,
        })
    }

    fn fill_random(&mut self, buf: &mut [u8]) -> Result<(), LoginStatus> {
        os_random(buf).map_err(|e| {
            tracing::error!("cannot read the OS random source: {e}");
            LoginStatus::TARGET_ERROR
        })
    }

    fn open_session(
        &mut self,
        key: &SessionKey,
        _session_type: SessionType,
    ) -> Result<u16, LoginStatus> {
        let ticket = self
            .shared
            .registry
            .open(
                &key.initiator_name,
                key.isid,
                key.target_name.as_ref(),
                key.tsih,
            )
            .inspect_err(|status| {
                if *status == LoginStatus::OUT_OF_RESOURCES {
                    self.shared.metrics.limit("max_sessions");
                }
            })?;
        let tsih = ticket.tsih();
        self.ticket = Some(ticket);
        Ok(tsih)
    }
}

/// The SCSI side of one session: its LUN map and I_T nexus.
/// A command that ran on the blocking pool, on its way back to its connection.
struct Completed {
    itt: u32,
    /// For the I/O metrics: the LUN, what kind of command, and the Data-In it was allowed.
    lun: u64,
    kind: scsi::IoKind,
    expected_len: u32,
    outcome: ScsiOutcome,
    data_in: Vec<u8>,
    /// Data-In lent instead of copied: the aligned buffer a direct read landed in.
    lent: Option<scsi::SharedSlice>,
    sense: Vec<u8>,
    /// The start of the turn that handed it over (its latency runs from there).
    started: Instant,
    /// Data-Out bytes it held (released from the connection's budget).
    held_bytes: usize,
    /// Its Data-Out bytes (the buffer may have gone to the device).
    data_out_bytes: usize,
    /// Its Data-Out buffer, back to the connection's pool.
    data_out: DataOutBuf,
}

impl Completed {
    /// The answer to a deferred `command` that ran to `completion` with `data_in`; what it
    /// held comes back with it (its Data-Out buffer to the pool, `held_bytes` to the budget).
    fn answering(
        command: DeferredCommand,
        lun: u64,
        completion: &scsi::Completion,
        data_in: Vec<u8>,
        (started, held_bytes, data_out_bytes): (Instant, usize, usize),
    ) -> Completed {
        assert_eq!(
            scsi::lun_from_wire(command.lun),
            lun,
            "a completion answers the LUN its command addressed"
        );
        let mut sense = Vec::new();
        let outcome = outcome_of(completion, &mut sense);
        Completed {
            itt: command.itt,
            lun,
            kind: scsi::io_kind(&command.cdb),
            expected_len: command.expected_len,
            outcome,
            data_in,
            lent: None,
            sense,
            started,
            held_bytes,
            data_out_bytes,
            data_out: command.data_out,
        }
    }
}

/// The way back to the connection for a command finished on another thread.
#[derive(Clone)]
struct Answers {
    completions: tokio::sync::mpsc::UnboundedSender<Completed>,
    /// Raised with each answer, to end the worker's busy poll.
    flag: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl Answers {
    fn send(&self, done: Completed) {
        // The connection may be gone by now; then nobody waits for the answer.
        let _ = self.completions.send(done);
        // End the worker's busy poll, if one runs: the answer is ready to go.
        if let Some(flag) = &self.flag {
            flag.store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

struct Backend<'a> {
    shared: &'a Shared,
    /// LUNs of this session backed by a real disk: durable operations, and buffered writes while
    /// the device stalls, run on the blocking pool.
    disk_luns: Arc<Vec<DiskLun>>,
    /// Where commands finished on another thread (the blocking pool, a store's own thread)
    /// send their answers.
    answers: Answers,
    /// Memory held by commands on the blocking pool (their Data-Out and expected Data-In). At
    /// the budget the connection handles no further PDU until some complete: the initiator is
    /// held back by TCP, and the worker never waits for the device itself.
    deferred_bytes: usize,
    deferred_bytes_max: usize,
    /// The initiator's address: discovery lists only targets whose `allowed_sources` admit it.
    peer: SocketAddr,
    /// What `ctl sessions` shows of this session (its counters get `io`'s once a second).
    info: Option<Arc<crate::admission::registry::SessionInfo>>,
    /// Why the session closed, when the target decided it (for the log).
    close_reason: Option<&'static str>,
    /// The route `execute` decided for the command it just deferred, for the `defer` that
    /// follows it at once (ITT, route).
    routed: Option<(u32, route::Route)>,
    /// The topology the session's LUN map and membership come from; replaced by a newer one at
    /// the start of a turn after a reload ([`Backend::follow_topology`]).
    topology: Arc<Topology>,
    /// The session's target, group and login proof (normal sessions), decided at login and
    /// confirmed by every topology since ([`Backend::follow_topology`]); its membership is
    /// `topology`'s.
    admitted: Admitted,
    /// The session's target (normal sessions).
    target_name: Option<IscsiName>,
    initiator: IscsiName,
    luns: Option<Arc<LunMap>>,
    nexus: Option<Nexus>,
    local: SocketAddr,
    portal_group_tag: u16,
    /// I/O per mapped LUN since the last report to the shared metrics (once a second).
    io: Vec<DeviceIo>,
    /// When the current turn started handling PDUs: a command is complete in the target then.
    turn_started: Instant,
    /// Reads and writes (slot in `io`, op index) run inline this turn; their latency is taken once, when
    /// the turn has queued all its responses.
    turn_inline: Vec<(usize, usize)>,
    /// When the last turn that ran reads or writes inline had queued its responses: the
    /// coalescer plans from it instead of reading the clock again (one read per turn saved).
    turn_ended: Option<Instant>,
    /// Resets (LU, target) and CLEAR TASK SETs waiting for their LUs' commands to finish.
    tmf_waits: Vec<TmfWait>,
    /// This connection's io_uring for direct-I/O LUNs, made at the first such command.
    ring: Option<DeviceRing<RingTag>>,
    /// Durable writes on the ring, per file, and the fdatasyncs that make them so.
    group_commits: Vec<(Arc<std::fs::File>, GroupCommit<Written>)>,
    /// The ring's I/Os in flight as last told to the worker's busy poll.
    ring_reported: usize,
    /// Making the ring failed once (logged): direct LUNs use the I/O thread pool instead.
    ring_failed: bool,
    /// Commands answered while planned (a check failed) or reaped from the ring: delivered
    /// at the end of the turn.
    answered: Vec<Completed>,
    /// Reused by every reap of the ring.
    ring_finished: Vec<ring::Finished<RingTag>>,
    /// Reused by every read answered from a ring buffer.
    loan: Loan,
}

/// I/Os a turn queues on its ring before handing them to the kernel (the rest go at its end).
const RING_SUBMIT_BATCH: usize = 4;

/// What an I/O on the connection's ring is for.
/// A deferred command's LU, held in flight for it ([`Backend::hold`]).
struct Held {
    lu: Arc<scsi::LogicalUnit>,
    /// The LU is mapped read-only to this session.
    read_only: bool,
    hold: scsi::inflight::OwnedIoGuard,
    /// What the command holds of the connection's memory budget, and its Data-Out's length.
    held_bytes: usize,
    data_out_bytes: usize,
}

/// What planning a held command gave ([`Backend::plan`]).
enum Planned {
    Io(scsi::BlockIo, Option<scsi::WriteShare>, DeferredCommand),
    /// Answered without I/O.
    Answered,
    /// Run it whole on the blocking pool.
    Execute(DeferredCommand),
}

enum RingTag {
    /// A command's read, write or flush.
    Command(RingIo),
    /// The fdatasync of a file's group commit.
    GroupFlush(Arc<std::fs::File>),
}

impl Drop for Backend<'_> {
    fn drop(&mut self) {
        // Its ring's I/Os no longer count as the worker's device waits.
        busy_poll::device_io_changed(self.ring_reported, 0);
    }
}

/// A write done on the device and its buffer, waiting for its group's flush.
type Written = (RingIo, Option<store::PooledBuf>);

/// A command whose block I/O is on the connection's ring.
struct RingIo {
    command: DeferredCommand,
    lun: u64,
    io: scsi::BlockIo,
    lu: Arc<scsi::LogicalUnit>,
    started: Instant,
    held_bytes: usize,
    data_out_bytes: usize,
    /// Its LU counts it in flight (resets wait) until the device answers.
    _hold: scsi::inflight::OwnedIoGuard,
    /// A write's share of its LU's write order (COMPARE AND WRITE waits).
    _share: Option<scsi::WriteShare>,
    /// A durable write's file and how it is made durable (its group commit's choice).
    durable: Option<(Arc<std::fs::File>, Durability)>,
}

/// A task management function waiting until no command of its LUs can still reach the medium;
/// then its effects apply and it is answered. Its LUs hold new commands meanwhile (see
/// `scsi::inflight`); dropping it (the connection closed first) lets them go on.
struct TmfWait {
    itt: u32,
    function: TmfFunction,
    /// The nexus that asked: its own unit attentions are not raised.
    by: u64,
    units: Vec<Arc<scsi::LogicalUnit>>,
    /// A LOGICAL UNIT RESET through a gateway that does not own the LU: the nexus it came
    /// through, to pass the reset on to the owner before answering.
    at_owner: Option<scsi::Nexus>,
}

impl TmfWait {
    fn new(itt: u32, function: TmfFunction, by: u64, units: Vec<Arc<scsi::LogicalUnit>>) -> Self {
        for unit in &units {
            unit.in_flight().start_reset();
        }
        TmfWait {
            itt,
            function,
            by,
            units,
            at_owner: None,
        }
    }

    /// Passes a LOGICAL UNIT RESET on to the LU's owner when this gateway does not own it
    /// (waits for the network: an I/O thread's call). Without an owner elsewhere, nothing.
    fn reset_at_owner(&self) {
        if let (TmfFunction::LogicalUnitReset, Some(nexus)) = (self.function, &self.at_owner) {
            for unit in &self.units {
                if !unit.reset_at_owner(nexus) {
                    tracing::warn!("a LUN reset could not be passed on to the LU's owner");
                }
            }
        }
    }

    /// Ready when none of its LUs has a command running.
    fn poll_drained(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let mut pending = false;
        for unit in &self.units {
            pending |= unit.in_flight().poll_drained(cx).is_pending();
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    }

    /// Applies the function's effects on its drained LUs (unit attentions, reservations);
    /// the LUs take commands again when `self` drops.
    fn apply(&self) {
        for unit in &self.units {
            debug_assert_eq!(unit.in_flight().count(), 0, "applied before draining");
            match self.function {
                TmfFunction::LogicalUnitReset => unit.logical_unit_reset(self.by),
                TmfFunction::TargetWarmReset | TmfFunction::TargetColdReset => {
                    unit.target_reset(self.by)
                }
                // Every command of the task set has finished: nothing else to clear.
                _ => {}
            }
        }
    }
}

impl Drop for TmfWait {
    fn drop(&mut self) {
        for unit in &self.units {
            unit.in_flight().end_reset();
        }
    }
}

/// Resolves when the first of `waits` has drained (pending while there are none).
async fn first_drained(waits: &[TmfWait]) -> usize {
    std::future::poll_fn(|cx| {
        for (i, wait) in waits.iter().enumerate() {
            if wait.poll_drained(cx).is_ready() {
                return std::task::Poll::Ready(i);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// Hands a finished command to the session: its answer is queued in `out`, its memory and
/// counts settled. True when the session is closing (a cold reset's last task finished).
fn deliver(
    session: &mut Session,
    backend: &mut Backend<'_>,
    out: &mut Outbox,
    done: Completed,
) -> bool {
    debug_assert!(
        backend.deferred_bytes >= done.held_bytes,
        "a completion gives back no more of the budget than its command took"
    );
    backend.deferred_bytes = backend.deferred_bytes.saturating_sub(done.held_bytes);
    let lent_bytes = done.lent.as_ref().map_or(0, |(_, range)| range.len());
    let data_bytes = match done.kind {
        scsi::IoKind::Read => (done.data_in.len() + lent_bytes).min(done.expected_len as usize),
        _ => done.data_out_bytes,
    };
    let slot = backend.record_io(
        done.lun,
        done.kind,
        done.outcome.status,
        &done.sense,
        data_bytes,
    );
    if let (Some(slot), Some(op)) = (slot, op_index(done.kind)) {
        backend.record_latency(slot, op, done.started.elapsed());
    }
    match done.lent {
        Some(slice) => {
            // One Vec for every lent read of the connection (the outbox empties it).
            backend.loan.slices.push(slice);
            session.complete_lent(done.itt, done.outcome, &mut backend.loan, &done.sense, out);
        }
        None => {
            session.complete(done.itt, done.outcome, done.data_in, &done.sense, out);
        }
    }
    done.data_out.recycle(out);
    session.closing()
}

/// Delivers the commands answered this turn (planned ones that failed a check, ring
/// completions); their Vec keeps its capacity for the next turn. True when the session closes.
fn deliver_answered(session: &mut Session, backend: &mut Backend<'_>, out: &mut Outbox) -> bool {
    let mut answered = std::mem::take(&mut backend.answered);
    let mut closing = false;
    for done in answered.drain(..) {
        closing |= deliver(session, backend, out, done);
    }
    backend.answered = answered;
    closing
}

/// Resolves when the connection's ring has completions (never without a ring).
async fn ring_ready<T>(ring: &Option<DeviceRing<T>>) -> std::io::Result<()> {
    match ring {
        Some(ring) => ring.ready().await,
        None => std::future::pending().await,
    }
}

/// One LUN's I/O on this connection, counted without atomics.
struct DeviceIo {
    lun: u64,
    device: Arc<str>,
    counts: IoCounts,
    /// Latencies of reads ([`OP_READ`]) and writes ([`OP_WRITE`]).
    latency: [LatencyCounts; 2],
}

const OP_READ: usize = 0;
const OP_WRITE: usize = 1;
const OP_NAMES: [&str; 2] = ["read", "write"];

fn op_index(kind: scsi::IoKind) -> Option<usize> {
    match kind {
        scsi::IoKind::Read => Some(OP_READ),
        scsi::IoKind::Write => Some(OP_WRITE),
        scsi::IoKind::Other => None,
    }
}

impl Backend<'_> {
    /// Counts one finished command: `data_bytes` is its Data-In (reads) or Data-Out (writes).
    /// Returns the LUN's slot in `io` (None for a LUN not mapped to this session) for the
    /// command's other statistics, so the slot is looked up once per command.
    fn record_io(
        &mut self,
        lun: u64,
        kind: scsi::IoKind,
        status: u8,
        sense: &[u8],
        data_bytes: usize,
    ) -> Option<usize> {
        let index = self.io.iter().position(|d| d.lun == lun)?;
        let slot = self.io.get_mut(index)?;
        let good = status == 0;
        let counts = &mut slot.counts;
        if !good {
            match crate::metrics::error_cause(status, sense) {
                Some(cause) => {
                    if let Some(n) = counts.errors.get_mut(cause) {
                        // A limit of the target's refused the command: said once per
                        // connection, LUN and second (counts are reset once a second).
                        if *n == 0
                            && crate::metrics::ERROR_CAUSES.get(cause)
                                == Some(&"insufficient_resources")
                        {
                            tracing::warn!(peer = %self.peer, initiator = %self.initiator, lun, device = %slot.device, "a command was refused for lack of resources (INSUFFICIENT RESOURCES, 55h): e.g. the device's persistent reservation registrations are at their limit ({})", scsi::REGISTRATIONS_MAX);
                        }
                        *n += 1;
                    }
                }
                None => counts.unit_attentions += 1,
            }
        }
        let bytes = if good { data_bytes as u64 } else { 0 };
        match kind {
            scsi::IoKind::Read => {
                counts.reads += 1;
                counts.read_bytes += bytes;
            }
            scsi::IoKind::Write => {
                counts.writes += 1;
                counts.write_bytes += bytes;
            }
            scsi::IoKind::Other => {}
        }
        Some(index)
    }

    /// Counts the latency of one read or write of the LUN in slot `slot` of `io`.
    fn record_latency(&mut self, slot: usize, op: usize, latency: Duration) {
        if let Some(counts) = self
            .io
            .get_mut(slot)
            .and_then(|device| device.latency.get_mut(op))
        {
            counts.observe(latency);
        }
    }

    /// The turn has queued its responses: the reads and writes it ran inline took until now.
    fn finish_turn(&mut self) {
        if self.turn_inline.is_empty() {
            self.turn_ended = None;
            return;
        }
        let ended = Instant::now();
        self.turn_ended = Some(ended);
        let latency = ended.saturating_duration_since(self.turn_started);
        let mut inline = std::mem::take(&mut self.turn_inline);
        for &(slot, op) in &inline {
            self.record_latency(slot, op, latency);
        }
        inline.clear();
        self.turn_inline = inline;
    }

    /// Adds what this connection counted to the shared per-device metrics.
    /// Takes the LUN map (and what goes with it) of `group` for this session.
    fn use_group(&mut self, group: &GroupRuntime) {
        self.luns = Some(Arc::clone(&group.luns));
        self.disk_luns = Arc::clone(&group.disk_luns);
        self.io = group
            .lun_devices
            .iter()
            .map(|(lun, device)| DeviceIo {
                lun: *lun,
                device: Arc::clone(device),
                counts: IoCounts::default(),
                latency: [LatencyCounts::default(); 2],
            })
            .collect();
    }

    /// Moves the session to the newest topology, if a reload published one: admitted again by
    /// the login's own decision ([`Topology::readmit`]), then its group's LUN map as the
    /// reload left it, with REPORTED LUNS DATA HAS CHANGED on its nexus when that map changed.
    /// `Err` when the answer changed (its target, portal or group is gone, its initiator or
    /// source no longer belongs, it belongs to another group now, or its login's proof no
    /// longer meets the group's authentication): the session must close.
    /// Called at the start of a turn, when no command of the turn is half-handled, and by the
    /// once-a-second tick, so an idle session is closed too.
    fn follow_topology(&mut self) -> Result<(), Refusal> {
        let next = self.shared.topology();
        if next.generation == self.topology.generation {
            return Ok(());
        }
        let standing = Standing {
            initiator: &self.initiator,
            target_name: self.target_name.as_ref(),
            portal_group_tag: self.portal_group_tag,
            source: self.peer.ip(),
        };
        let admitted = next.readmit(&standing, &self.admitted)?;
        let group = admitted.membership().and_then(|m| next.group_of(m));
        if let Some((_, group)) = group {
            self.follow_lun_map(group);
        }
        self.admitted = admitted;
        self.topology = next;
        Ok(())
    }

    /// Takes `group`'s LUN map of a newer topology (the session's own group).
    fn follow_lun_map(&mut self, group: &GroupRuntime) {
        let unchanged = self
            .luns
            .as_deref()
            .is_some_and(|old| same_lun_map(old, &group.luns));
        if let (Some(nexus), false) = (&self.nexus, unchanged) {
            let old: &[LunEntry] = self.luns.as_deref().map_or(&[], LunMap::entries);
            let reaches = |entries: &[LunEntry], lu: &Arc<scsi::LogicalUnit>| {
                entries.iter().any(|e| Arc::ptr_eq(&e.lu, lu))
            };
            for entry in group.luns.entries() {
                if !reaches(old, &entry.lu) {
                    entry.lu.nexus_added(nexus.id);
                }
            }
            for entry in old {
                if !reaches(group.luns.entries(), &entry.lu) {
                    entry.lu.nexus_lost(nexus.id);
                }
            }
            for entry in group.luns.entries() {
                entry.lu.reported_luns_changed_for(nexus.id);
            }
        }
        if unchanged {
            // The same LUNs: only the new topology's handles, nothing for the initiator to see.
            self.luns = Some(Arc::clone(&group.luns));
            self.disk_luns = Arc::clone(&group.disk_luns);
        } else {
            // Counts so far go to the devices they were made on.
            self.report_io();
            self.use_group(group);
        }
    }

    /// [`Backend::follow_topology`]; on `Err`, the log line, the metric and the close reason.
    fn follow_or_close(&mut self) -> bool {
        match self.follow_topology() {
            Ok(()) => true,
            Err(refusal) => {
                tracing::warn!(
                    peer = %self.peer,
                    initiator = %self.initiator,
                    reason = refusal.reason(),
                    "closing the session after a change: a login now would not be admitted to the same group with the same proof"
                );
                self.shared.metrics.session_closed(refusal.reason());
                self.close_reason = Some(refusal.reason());
                false
            }
        }
    }

    /// Whether this gateway lost the ownership of an RBD image the session maps since the
    /// session's nexus was made.
    fn lost_an_image(&self) -> bool {
        match (&self.luns, &self.nexus) {
            (Some(luns), Some(nexus)) => luns
                .entries()
                .iter()
                .any(|e| e.lu.nexus_outlived_ownership(nexus)),
            _ => false,
        }
    }

    fn report_io(&mut self) {
        for slot in &mut self.io {
            if slot.counts != IoCounts::default() {
                self.shared.metrics.add_io(&slot.device, &slot.counts);
                if let Some(info) = &self.info {
                    let c = &slot.counts;
                    info.add_io(c.reads, c.writes, c.read_bytes, c.write_bytes);
                    if let Some(target) = &info.target {
                        self.shared
                            .metrics
                            .add_initiator_io(target, &info.initiator, c);
                    }
                }
                slot.counts = IoCounts::default();
            }
            for (op, counts) in slot.latency.iter_mut().enumerate() {
                if counts.count > 0 {
                    let name = OP_NAMES.get(op).copied().unwrap_or("other");
                    self.shared.metrics.add_latency(&slot.device, name, counts);
                    *counts = LatencyCounts::default();
                }
            }
        }
    }

    /// Counts a command run inline in the device's I/O metrics (its latency at the turn's end).
    fn record_inline(
        &mut self,
        lun: u64,
        req: &ScsiRequest<'_>,
        data_in: &[u8],
        lent: &Loan,
        sense: &[u8],
        status: u8,
    ) {
        let kind = scsi::io_kind(req.cdb);
        let data_bytes = match kind {
            scsi::IoKind::Read => {
                // Per the ScsiBackend contract `lent` arrived empty and `data_in` now holds exactly
                // the Data-In (a reused read buffer's old length says nothing).
                let lent_bytes: usize = lent
                    .slices
                    .iter()
                    .map(|(_, range)| range.len())
                    .sum::<usize>()
                    + lent.file.as_ref().map_or(0, |(_, _, len)| *len);
                (data_in.len() + lent_bytes).min(req.expected_len as usize)
            }
            _ => req.data_out.len(),
        };
        if let Some(slot) = self.record_io(lun, kind, status, sense, data_bytes) {
            if let Some(op) = op_index(kind) {
                self.turn_inline.push((slot, op));
            }
            if let (Some((_, _, len)), Some(device)) = (&lent.file, self.io.get_mut(slot)) {
                device.counts.sendfile_bytes += (*len).min(req.expected_len as usize) as u64;
            }
        }
    }

    /// Runs a deferred command whole on tokio's blocking pool (where waiting is fine); its
    /// answer comes back to this connection.
    fn run_blocking(&mut self, command: DeferredCommand, lun: u64, buffers: &mut ReadBuffers<'_>) {
        let (Some(luns), Some(nexus)) = (&self.luns, &self.nexus) else {
            debug_assert!(false, "only commands of a session with LUNs are deferred");
            return;
        };
        // The command counts as in flight on its LU from now on: a reset waits for it.
        let hold = luns.begin_owned(nexus, lun);
        let (luns, nexus) = (Arc::clone(luns), nexus.clone());
        // Buffered writes are watched there too: they keep the device's hold while they stall.
        let stalls = self
            .disk_lu(lun)
            .filter(|(_, entry)| entry.lu.is_buffered_write(&command.cdb))
            .map(|(disk, _)| Arc::clone(&disk.stalls));
        // A command of unbounded cost also holds an I/O thread for as long as it runs: it
        // counts as LONG_COMMAND_HELD_BYTES more, so one connection runs a bounded number at
        // once (8 with the default budget) and the rest wait in TCP, as other commands do.
        let long = if scsi::runs_long(&command.cdb) {
            LONG_COMMAND_HELD_BYTES
        } else {
            0
        };
        let held_bytes =
            Self::held_bytes(command.data_out.len(), command.read, command.expected_len) + long;
        self.deferred_bytes += held_bytes;
        let answers = self.answers.clone();
        let started = self.turn_started;
        // The LU overwrites a read's recycled buffer whole (and clears it for other commands).
        let mut data_in = if command.read {
            buffers.take()
        } else {
            Vec::new()
        };
        tokio::task::spawn_blocking(move || {
            // A reset was draining the LU at hand-over: wait here (never on the worker) until
            // it is done, then run.
            let _hold = match hold {
                Some(Ok(guard)) => Some(guard),
                Some(Err(in_flight)) => Some(in_flight.begin_blocking(nexus.id)),
                None => None,
            };
            let cmd = scsi::Command {
                cdb: &command.cdb,
                data_out: &command.data_out,
                data_in_limit: command.expected_len,
            };
            let probe = stalls.as_ref().map(|_| StallProbe::start(Instant::now()));
            let completion = luns.execute(&nexus, lun, &cmd, &mut data_in);
            if let (Some(stalls), Some(probe)) = (stalls, probe) {
                probe.finish(&stalls, command.data_out.len());
            }
            let held = (started, held_bytes, command.data_out.len());
            answers.send(Completed::answering(
                command,
                lun,
                &completion,
                data_in,
                held,
            ));
        });
    }

    /// The LU a deferred command addresses, held in flight for it from here to its answer (a
    /// reset waits for the hold): the lookup every submit path starts with. None, the command
    /// untouched, when the session has no LUN map or the LUN is unmapped, when the path does
    /// not `take` the command, or while a reset drains the LU (it then waits on the blocking
    /// pool).
    fn hold(
        &self,
        command: &DeferredCommand,
        lun: u64,
        takes: impl FnOnce(&LunEntry, &Nexus) -> bool,
    ) -> Option<Held> {
        let (luns, nexus) = (self.luns.as_ref()?, self.nexus.as_ref()?);
        let entry = luns.get(lun).filter(|entry| takes(entry, nexus))?;
        let hold = entry.lu.in_flight().try_begin_owned(nexus.id)?;
        let data_out_bytes = command.data_out.len();
        Some(Held {
            lu: Arc::clone(&entry.lu),
            read_only: entry.read_only,
            hold,
            held_bytes: Self::held_bytes(data_out_bytes, command.read, command.expected_len),
            data_out_bytes,
        })
    }

    /// Plans a held command: its I/O, or its answer (a check failed, nothing to move; sent
    /// at the end of the turn), or back to run whole where waiting is fine.
    fn plan(&mut self, held: &Held, command: DeferredCommand, lun: u64) -> Planned {
        let Some(nexus) = self.nexus.as_ref() else {
            return Planned::Execute(command);
        };
        let cmd = scsi::Command {
            cdb: &command.cdb,
            data_out: &command.data_out,
            data_in_limit: command.expected_len,
        };
        match held.lu.plan(nexus, &cmd, held.read_only) {
            scsi::Plan::Execute => Planned::Execute(command),
            scsi::Plan::Done(completion) => {
                self.answer_planned(command, lun, &completion);
                Planned::Answered
            }
            scsi::Plan::Io(io, share) => Planned::Io(io, share, command),
        }
    }

    /// Plans `command` and puts its I/O on the ring. Hands the command back, untouched in
    /// effect, when it must run on the blocking pool instead: no ring for its LU, a reset
    /// draining the LU, a command that does not plan, a COMPARE AND WRITE holding the order,
    /// a full ring.
    fn submit_to_ring(
        &mut self,
        command: DeferredCommand,
        lun: u64,
    ) -> Result<(), DeferredCommand> {
        let Some(direct) = self
            .disk_luns
            .iter()
            .find(|d| d.lun == lun)
            .and_then(|d| d.ring.clone())
            .filter(|_| !self.ring_failed)
        else {
            return Err(command);
        };
        let Some(held) = self.hold(&command, lun, |_, _| true) else {
            return Err(command);
        };
        let (io, share, mut command) = match self.plan(&held, command, lun) {
            Planned::Io(io, share, command) => (io, share, command),
            Planned::Answered => return Ok(()),
            Planned::Execute(command) => return Err(command),
        };
        let Held {
            lu,
            hold,
            held_bytes,
            data_out_bytes,
            ..
        } = held;
        if !self.has_ring() {
            return Err(command);
        }
        let Some((op, buf)) = ring_buffer(&io, direct.alignment, &mut command) else {
            return Err(command);
        };
        let (op, durable) = match op {
            RingOp::Write { .. } if io.op == (scsi::BlockOp::Write { durable: true }) => {
                let how = self.group_commit(&direct.file).durability();
                let dsync = how == Durability::Dsync;
                (
                    RingOp::Write { dsync },
                    Some((Arc::clone(&direct.file), how)),
                )
            }
            op => (op, None),
        };
        let tag = RingIo {
            command,
            lun,
            io,
            lu,
            started: self.turn_started,
            held_bytes,
            data_out_bytes,
            _hold: hold,
            _share: share,
            durable,
        };
        self.push_to_ring(op, &direct.file, io.offset, buf, tag)
    }

    /// Makes the connection's ring at its first direct I/O; false (and never again) when the
    /// kernel gives none: direct I/O of this connection runs on the I/O threads.
    fn has_ring(&mut self) -> bool {
        if self.ring.is_some() {
            return true;
        }
        if self.ring_failed {
            return false;
        }
        match DeviceRing::new() {
            Ok(ring) => {
                busy_poll::watch_ring(ring.fd());
                self.ring = Some(ring);
                true
            }
            Err(e) => {
                tracing::warn!(peer = %self.peer, "io_uring ring: {e}: direct I/O of this connection runs on the I/O threads");
                self.ring_failed = true;
                false
            }
        }
    }

    /// Puts a planned I/O on the ring; a full ring hands the command back.
    fn push_to_ring(
        &mut self,
        op: RingOp,
        file: &Arc<std::fs::File>,
        offset: u64,
        buf: Option<store::PooledBuf>,
        tag: RingIo,
    ) -> Result<(), DeferredCommand> {
        let (held_bytes, is_durable) = (tag.held_bytes, tag.durable.is_some());
        let Some(ring) = self.ring.as_mut() else {
            return Err(tag.command);
        };
        match ring.push(op, file, offset, buf, RingTag::Command(tag)) {
            Ok(()) => {
                self.deferred_bytes += held_bytes;
                // A long turn hands its I/Os to the kernel in groups instead of all at its end:
                // the device starts on the first ones while the rest are decoded (4 KiB random
                // reads at QD64 +13 %, ~0.3 µs more CPU per I/O; after every push: +10 % at
                // +2 µs; measured 2026-11-24).
                if ring.queued() >= RING_SUBMIT_BATCH {
                    if let Err(e) = ring.submit() {
                        // They stay queued and go with the turn's final submit.
                        tracing::debug!("io_uring submit: {e}");
                    }
                }
                if is_durable {
                    self.group_commit(file).sent();
                }
                Ok(())
            }
            // The ring is full: the share and the hold are released as the tag drops. A write
            // whose Data-Out went into the ring's buffer gets it back for the blocking path.
            Err((buf, tag)) => {
                let RingTag::Command(tag) = tag else {
                    unreachable!("pushed as a command above")
                };
                let mut command = tag.command;
                if let (Some(buf), RingOp::Write { .. }) = (buf, op) {
                    if command.data_out.is_empty() {
                        command.data_out = DataOutBuf::Engine(Box::new(DirectDataOut(buf)));
                    }
                }
                Err(command)
            }
        }
    }

    /// A planned command answered without I/O (a check failed, nothing to move): delivered
    /// at the end of the turn like the connection's other completions.
    fn answer_planned(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        completion: &scsi::Completion,
    ) {
        let data_out_bytes = command.data_out.len();
        let held_bytes = Self::held_bytes(data_out_bytes, command.read, command.expected_len);
        self.deferred_bytes += held_bytes;
        let held = (self.turn_started, held_bytes, data_out_bytes);
        let answer = Completed::answering(command, lun, completion, Vec::new(), held);
        self.answered.push(answer);
    }

    /// Plans `command` and starts its I/O on a store that performs it asynchronously itself
    /// (librbd): the store's thread finishes it and sends the answer to this connection, as
    /// the blocking pool does, with no thread of ours waiting. Hands the command back when it
    /// must run on the blocking pool instead: not such a store, a reset draining the LU, a
    /// command that does not plan, a COMPARE AND WRITE holding the order.
    fn submit_async(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        buffers: &mut ReadBuffers<'_>,
    ) -> Result<(), DeferredCommand> {
        let asynchronous = |entry: &LunEntry, _: &Nexus| entry.lu.capabilities().asynchronous;
        let Some(held) = self.hold(&command, lun, asynchronous) else {
            return Err(command);
        };
        let (io, share, mut command) = match self.plan(&held, command, lun) {
            Planned::Io(io, share, command) => (io, share, command),
            Planned::Answered => return Ok(()),
            Planned::Execute(command) => return Err(command),
        };
        let Held {
            lu,
            hold,
            held_bytes,
            data_out_bytes,
            ..
        } = held;
        let Some((op, buf)) = async_io(&io, &mut command, buffers) else {
            return Err(command);
        };
        self.deferred_bytes += held_bytes;
        let answers = self.answers.clone();
        let started = self.turn_started;
        let finishing = Arc::clone(&lu);
        let done: store::AsyncDone = Box::new(move |buf, result| {
            if let Err(e) = &result {
                tracing::warn!(
                    lun,
                    "device I/O failed: {:?} at {}+{}: {e}",
                    io.op,
                    io.offset,
                    io.len
                );
            }
            let completion = finishing.finish(&io, result);
            let mut command = command;
            let data_in = match io.op {
                // Only a read that succeeded sends its buffer (a recycled one holds old bytes
                // wherever the store did not write).
                scsi::BlockOp::Read if completion.status == scsi::Status::Good => buf,
                // The Data-Out's own buffer went to the store: it returns to the pool.
                scsi::BlockOp::Write { .. } if command.data_out.is_empty() => {
                    command.data_out = DataOutBuf::Pooled(buf);
                    Vec::new()
                }
                _ => Vec::new(),
            };
            let held = (started, held_bytes, data_out_bytes);
            answers.send(Completed::answering(
                command,
                lun,
                &completion,
                data_in,
                held,
            ));
            // Only now may a reset waiting for the LU, or a COMPARE AND WRITE, go on.
            drop(share);
            drop(hold);
        });
        lu.submit(op, buf, done);
        Ok(())
    }

    /// Ships `command` to its LU's owner (another gateway) without a thread of ours waiting:
    /// this gateway's checks run here, the peer session's driver thread sends it and hands the
    /// owner's answer to this connection. A hung owner then holds no I/O thread that other
    /// devices' commands need. Hands the command back for the blocking pool when its LU does
    /// not ship it or a reset is draining the LU.
    fn submit_shipped(
        &mut self,
        mut command: DeferredCommand,
        lun: u64,
    ) -> Result<(), DeferredCommand> {
        let ships = |entry: &LunEntry, nexus: &Nexus| entry.lu.ships_to_owner(nexus, &command.cdb);
        let Some(held) = self.hold(&command, lun, ships) else {
            return Err(command);
        };
        let Some(nexus) = self.nexus.clone() else {
            return Err(command);
        };
        let cmd = scsi::Command {
            cdb: &command.cdb,
            data_out: &command.data_out,
            data_in_limit: command.expected_len,
        };
        if let Err(completion) = held.lu.admit_for_owner(&nexus, &cmd, held.read_only) {
            self.answer_planned(command, lun, &completion);
            return Ok(());
        }
        let Held {
            lu,
            hold,
            held_bytes,
            data_out_bytes,
            ..
        } = held;
        // The Data-Out's own buffer travels to the owner when it has one.
        let shipped_data = match std::mem::take(&mut command.data_out) {
            DataOutBuf::Pooled(buf) => buf,
            other => {
                let copy = other.to_vec();
                command.data_out = other;
                copy
            }
        };
        let shipped = scsi::ShippedCommand {
            cdb: command.cdb.clone(),
            data_out: shipped_data,
            data_in_limit: command.expected_len,
        };
        self.deferred_bytes += held_bytes;
        let answers = self.answers.clone();
        let started = self.turn_started;
        let done: scsi::ShipDone = Box::new(move |completion, data_in| {
            let held = (started, held_bytes, data_out_bytes);
            answers.send(Completed::answering(
                command,
                lun,
                &completion,
                data_in,
                held,
            ));
            // Only now may a reset waiting for the LU go on.
            drop(hold);
        });
        lu.ship_then(&nexus, shipped, done);
        Ok(())
    }

    /// Hands the turn's ring I/Os to the kernel in one system call.
    fn submit_ring(&mut self) {
        if let Some(ring) = self.ring.as_mut() {
            if let Err(e) = ring.submit() {
                // They stay queued and go with the next submit.
                tracing::debug!(peer = %self.peer, "io_uring submit: {e}");
            }
            // The worker's busy poll learns device waits apart from initiator waits.
            let in_flight = ring.in_flight();
            busy_poll::device_io_changed(self.ring_reported, in_flight);
            self.ring_reported = in_flight;
        }
    }

    /// Moves the completions the ring has (reading its shared memory: no system call) to
    /// `answered`, for delivery like the connection's other completions.
    fn reap_ring(&mut self) {
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        if ring.in_flight() == 0 {
            return;
        }
        let mut finished = std::mem::take(&mut self.ring_finished);
        ring.reap(&mut finished);
        for f in finished.drain(..) {
            match f.tag {
                RingTag::Command(mut tag) => match tag.durable.take() {
                    None => self.answer_reaped(tag, f.buf, f.result),
                    Some((file, how)) => {
                        let ok = f.result.is_ok();
                        if let Some((tag, buf)) =
                            self.group_commit(&file).completed((tag, f.buf), how, ok)
                        {
                            self.answer_reaped(tag, buf, f.result);
                        }
                    }
                },
                RingTag::GroupFlush(file) => {
                    let covered = self.group_commit(&file).flush_done();
                    let metrics = &self.shared.metrics;
                    metrics.group_commit_flushes.inc();
                    metrics.group_commit_writes.inc_by(covered.len() as u64);
                    if let Err(e) = &f.result {
                        tracing::warn!(
                            "device flush failed: {e}: {} write-through writes fail",
                            covered.len()
                        );
                    }
                    for (tag, buf) in covered {
                        self.answer_reaped(tag, buf, same_result(&f.result));
                    }
                }
            }
        }
        self.start_group_flushes();
        self.ring_finished = finished;
        // Retries queued by the reap go out now.
        self.submit_ring();
    }

    /// Answers a command whose ring I/O is over (delivered at the end of the turn).
    fn answer_reaped(
        &mut self,
        tag: RingIo,
        buf: Option<store::PooledBuf>,
        result: std::io::Result<()>,
    ) {
        if let Err(e) = &result {
            tracing::warn!(
                lun = tag.lun,
                "device I/O failed: {:?} at {}+{}: {e}",
                tag.io.op,
                tag.io.offset,
                tag.io.len
            );
        }
        assert_eq!(
            scsi::lun_from_wire(tag.command.lun),
            tag.lun,
            "a ring completion answers the LUN its command addressed"
        );
        let completion = tag.lu.finish(&tag.io, result);
        let mut sense = Vec::new();
        let outcome = outcome_of(&completion, &mut sense);
        let good = completion.status == scsi::Status::Good;
        let lent = match (buf, tag.io.op) {
            (Some(mut buf), scsi::BlockOp::Read) if good => {
                // Read whole aligned blocks; the Data-In is the planned length.
                debug_assert!(
                    buf.len() >= tag.io.len as usize,
                    "a ring read's buffer holds the bytes planned"
                );
                let len = (tag.io.len as usize).min(buf.len());
                buf.set_len(len);
                Some((Arc::new(buf) as Arc<dyn AsRef<[u8]> + Send + Sync>, 0..len))
            }
            _ => None,
        };
        self.answered.push(Completed {
            itt: tag.command.itt,
            lun: tag.lun,
            kind: scsi::io_kind(&tag.command.cdb),
            expected_len: tag.command.expected_len,
            outcome,
            data_in: Vec::new(),
            lent,
            sense,
            started: tag.started,
            held_bytes: tag.held_bytes,
            data_out_bytes: tag.data_out_bytes,
            data_out: tag.command.data_out,
        });
    }

    /// The group commit of `file` (one per direct-I/O file this connection wrote durably).
    fn group_commit(&mut self, file: &Arc<std::fs::File>) -> &mut GroupCommit<Written> {
        let index = match self
            .group_commits
            .iter()
            .position(|(f, _)| Arc::ptr_eq(f, file))
        {
            Some(index) => index,
            None => {
                self.group_commits
                    .push((Arc::clone(file), GroupCommit::default()));
                self.group_commits.len() - 1
            }
        };
        &mut self.group_commits[index].1
    }

    /// Starts the flush of every file with completed durable writes and no flush running.
    fn start_group_flushes(&mut self) {
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        let mut unflushed = Vec::new();
        for (file, group) in &mut self.group_commits {
            if !group.start_flush() {
                continue;
            }
            let tag = RingTag::GroupFlush(Arc::clone(file));
            if ring.push(RingOp::Flush, file, 0, None, tag).is_err() {
                // The ring refused it (its kernel no longer takes entries): nothing else
                // would ever flush these writes, so flush here, once, blocking the worker
                // for it -- never leave a write unanswered or answer it undurable.
                let result = file.sync_data();
                unflushed.push((group.flush_not_sent(), result));
            }
        }
        for (writes, result) in unflushed {
            for (tag, buf) in writes {
                self.answer_reaped(tag, buf, same_result(&result));
            }
        }
        // An idle group holds its file open for nothing (a device removed by a reload).
        self.group_commits.retain(|(_, group)| !group.is_idle());
    }

    /// Whether commands already on the blocking pool hold the connection's whole budget.
    fn congested(&self) -> bool {
        self.deferred_bytes >= self.deferred_bytes_max
    }

    /// Memory a command holds while it runs on the blocking pool: its Data-Out, and the Data-In
    /// it will produce.
    fn held_bytes(data_out_len: usize, read: bool, expected_len: u32) -> usize {
        data_out_len + if read { expected_len as usize } else { 0 }
    }

    /// The facts of `cdb` on LUN `lun` and the one route decision from them
    /// ([`route::route`]); with the time read for a buffered write's stall watch.
    fn route(&self, lun: u64, cdb: &[u8]) -> (route::Route, Option<Instant>) {
        let (Some(luns), Some(nexus)) = (&self.luns, &self.nexus) else {
            return (route::Route::Inline, None);
        };
        let entry = luns.get(lun);
        let mut facts = route::Facts {
            runs_long: scsi::runs_long(cdb),
            ships: entry.is_some_and(|e| e.lu.ships_to_owner(nexus, cdb)),
            disk: None,
        };
        let mut started = None;
        if let Some((disk, entry)) = self.disk_lu(lun) {
            // Each fact only where the decision reads it: this runs for every command.
            let lu = &entry.lu;
            let plans = scsi::plans(cdb);
            let direct_io = disk.direct && plans;
            let ring = direct_io && disk.ring.is_some() && !self.ring_failed;
            let buffered_write = !direct_io && lu.is_buffered_write(cdb);
            let offloading = buffered_write && {
                let now = Instant::now();
                started = Some(now);
                disk.stalls.offloading(now)
            };
            facts.disk = Some(route::Disk {
                direct: disk.direct,
                ring,
                asynchronous: direct_io && !ring && lu.capabilities().asynchronous,
                plans,
                buffered_write,
                offloading,
                waits_for_device: !direct_io && !buffered_write && lu.waits_for_device(cdb),
            });
        }
        let route = route::route(&facts);
        if route == route::Route::Offload {
            if let Some((disk, _)) = self.disk_lu(lun) {
                disk.stalls.offloaded();
            }
        }
        (route, started)
    }

    /// [`Execution::Deferred`] for command `itt`, its route kept for the `defer` that follows.
    fn deferred(&mut self, itt: u32, route: route::Route) -> Execution {
        debug_assert!(!route.inline(), "deferred on the worker's own route");
        debug_assert!(
            self.routed.is_none(),
            "a route left over from an earlier command"
        );
        self.routed = Some((itt, route));
        Execution::Deferred
    }

    /// The LU behind `lun` and its device's stall state, when it is backed by a real disk.
    fn disk_lu(&self, lun: u64) -> Option<(&DiskLun, &LunEntry)> {
        let disk = self.disk_luns.iter().find(|d| d.lun == lun)?;
        Some((disk, self.luns.as_deref()?.get(lun)?))
    }
}

/// `result` again, for each of the writes one flush answers (`io::Error` is not `Clone`).
/// The operation and buffer of a planned I/O on a store that performs it itself; None when a
/// write's Data-Out is shorter than planned (the blocking pool's path reports it).
fn async_io(
    io: &scsi::BlockIo,
    command: &mut DeferredCommand,
    buffers: &mut ReadBuffers<'_>,
) -> Option<(store::AsyncIo, Vec<u8>)> {
    match io.op {
        // A recycled buffer: the store overwrites every byte of a read that succeeds, and a
        // failed read's buffer is never sent (see `submit_async`'s answer).
        scsi::BlockOp::Read => Some((
            store::AsyncIo::Read {
                offset: io.offset,
                len: io.len as usize,
            },
            buffers.take(),
        )),
        scsi::BlockOp::Write { durable } => {
            // The planned length is a prefix of the Data-Out (whole blocks received); the
            // Data-Out's own buffer goes to the store when it has one.
            let len = io.len as usize;
            let buf = match std::mem::take(&mut command.data_out) {
                DataOutBuf::Pooled(mut buf) if buf.len() >= len => {
                    buf.truncate(len);
                    buf
                }
                other => {
                    let copy = other.get(..len).map(<[u8]>::to_vec);
                    command.data_out = other;
                    copy?
                }
            };
            let op = store::AsyncIo::Write {
                offset: io.offset,
                durable,
            };
            Some((op, buf))
        }
        scsi::BlockOp::Flush => Some((store::AsyncIo::Flush, Vec::new())),
    }
}

/// The operation and buffer of a planned I/O on the ring; None when it cannot go there (a
/// write's Data-Out shorter than planned, no memory for the buffer): the blocking pool's path
/// runs it and reports the failure. Pooled buffers hold earlier I/Os' bytes: a read's is
/// filled whole by the device (a short read fails), a write's is overwritten whole here.
fn ring_buffer(
    io: &scsi::BlockIo,
    alignment: u32,
    command: &mut DeferredCommand,
) -> Option<(RingOp, Option<store::PooledBuf>)> {
    let (op, buf) = match io.op {
        // A read the transport truncated (EDTL not a whole block) still reads whole aligned
        // blocks from the device; only `io.len` bytes are sent.
        scsi::BlockOp::Read => (
            RingOp::Read,
            DIRECT_BUFFERS.with(|pool| {
                pool.take((io.len as usize).next_multiple_of(alignment.max(1) as usize))
            }),
        ),
        scsi::BlockOp::Write { .. } => {
            // The planned length is a prefix of the Data-Out (whole blocks received).
            let len = io.len as usize;
            if command.data_out.len() < len {
                return None;
            }
            let buf = match take_direct_data_out(&mut command.data_out) {
                // Received straight into a pooled aligned buffer: it goes to the device.
                Some(mut buf) => {
                    buf.set_len(len);
                    Some(buf)
                }
                None => DIRECT_BUFFERS.with(|pool| pool.take(len)).map(|mut buf| {
                    buf.copy_from_slice(&command.data_out[..len]);
                    buf
                }),
            };
            (RingOp::Write { dsync: false }, buf)
        }
        scsi::BlockOp::Flush => (RingOp::Flush, None),
    };
    (op == RingOp::Flush || buf.is_some()).then_some((op, buf))
}

fn same_result(result: &std::io::Result<()>) -> std::io::Result<()> {
    match result {
        Ok(()) => Ok(()),
        Err(e) => Err(match e.raw_os_error() {
            Some(errno) => std::io::Error::from_raw_os_error(errno),
            None => std::io::Error::new(e.kind(), e.to_string()),
        }),
    }
}

/// A write's Data-Out received into a pooled, aligned buffer (see
/// [`ScsiBackend::data_out_memory`]): the ring writes it to the device as it is.
#[derive(Debug)]
struct DirectDataOut(store::PooledBuf);

impl iscsi::session::DataOutMemory for DirectDataOut {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// The pooled buffer `data_out` was received into, if it was; `data_out` is left empty then.
fn take_direct_data_out(data_out: &mut DataOutBuf) -> Option<store::PooledBuf> {
    let DataOutBuf::Engine(memory) = data_out else {
        return None;
    };
    let any: &dyn std::any::Any = memory.as_ref();
    if !any.is::<DirectDataOut>() {
        return None;
    }
    let DataOutBuf::Engine(memory) = std::mem::take(data_out) else {
        return None;
    };
    let any: Box<dyn std::any::Any + Send + Sync> = memory;
    any.downcast::<DirectDataOut>().ok().map(|direct| direct.0)
}

/// Watches one buffered write for a stall: its duration, and whether its thread slept in the
/// kernel meanwhile (see `stall.rs`).
struct StallProbe {
    started: Instant,
    switches: u64,
}

impl StallProbe {
    fn start(started: Instant) -> StallProbe {
        StallProbe {
            started,
            switches: sys::voluntary_context_switches(),
        }
    }

    /// Reports the finished write of `bytes` to `stalls`; true if it stalled.
    fn finish(self, stalls: &WriteStalls, bytes: usize) -> bool {
        let now = Instant::now();
        let blocked = sys::voluntary_context_switches() != self.switches;
        stalls.record(bytes, now - self.started, blocked, now)
    }
}

/// The transport's view of a SCSI completion: status and transfer length, sense bytes appended.
fn outcome_of(completion: &scsi::Completion, sense: &mut Vec<u8>) -> ScsiOutcome {
    if let Some(s) = completion.sense {
        let mut buf = [0u8; scsi::sense::SENSE_BYTES_MAX];
        let n = s.encode(&mut buf);
        sense.extend_from_slice(&buf[..n]);
    }
    ScsiOutcome {
        status: completion.status.code(),
        transfer_len: completion.transfer_len,
    }
}

impl ScsiBackend for Backend<'_> {
    fn execute(
        &mut self,
        req: &ScsiRequest<'_>,
        data_in: &mut Vec<u8>,
        lent: &mut Loan,
        sense: &mut Vec<u8>,
    ) -> Execution {
        let (Some(luns), Some(nexus)) = (&self.luns, &self.nexus) else {
            data_in.clear();
            return Execution::Done(ScsiOutcome {
                status: 0x02,
                transfer_len: 0,
            });
        };
        let lun = scsi::lun_from_wire(req.lun);
        let (route, started) = self.route(lun, req.cdb);
        if !route.inline() {
            return self.deferred(req.itt, route);
        }
        // On a disk, buffered writes are watched (two clock reads, two getrusage calls) for
        // the kernel making them wait.
        let buffered_write = match (route, started) {
            (route::Route::InlineWatched, Some(started)) => self
                .disk_lu(lun)
                .map(|(disk, _)| (&disk.stalls, StallProbe::start(started))),
            _ => None,
        };
        let cmd = scsi::Command {
            cdb: req.cdb,
            data_out: req.data_out,
            data_in_limit: req.expected_len,
        };
        // Reads of RAM LUs lend their pages (zero-copy); reads of file LUs lend the file range
        // when it is long and all cached (sent with sendfile), are copied inline when cached,
        // and otherwise go to the blocking pool.
        let lending = scsi::Lending {
            slices: &mut lent.slices,
            file: &mut lent.file,
            file_min_bytes: if req.may_lend_file {
                FILE_SEND_MIN_BYTES
            } else {
                0
            },
        };
        let completion = match luns.try_execute(nexus, lun, &cmd, data_in, lending) {
            Some(completion) => completion,
            // Declined (a read's data is not cached, or the kernel would make a write-back write
            // wait — RWF_NOWAIT, where the filesystem supports it): it runs again, whole, on
            // the blocking pool.
            None => {
                if let Some((stalls, _)) = buffered_write {
                    stalls.offloaded();
                }
                return self.deferred(req.itt, route::Route::Blocking);
            }
        };
        if let Some((stalls, probe)) = buffered_write {
            if probe.finish(stalls, req.data_out.len()) {
                tracing::debug!(lun, "buffered write stalled a network worker");
            }
        }
        let outcome = outcome_of(&completion, sense);
        self.record_inline(lun, req, data_in, lent, sense, outcome.status);
        Execution::Done(outcome)
    }

    /// Submits the command's block I/O to the connection's ring where its LU does direct I/O
    /// on io_uring; otherwise runs it on tokio's blocking pool. Either way its completion comes
    /// back to this connection's event loop.
    fn defer(&mut self, command: DeferredCommand, mut buffers: ReadBuffers<'_>) {
        let lun = scsi::lun_from_wire(command.lun);
        // The route `execute` decided for this very command, just before.
        let routed = self.routed.take();
        debug_assert_eq!(
            routed.map(|(itt, _)| itt),
            Some(command.itt),
            "defer pairs with execute"
        );
        let route = routed.map_or(route::Route::Blocking, |(_, route)| route);
        // A path that cannot take the command now hands it back: it runs on the I/O threads.
        let submitted = match route {
            route::Route::Ring => self.submit_to_ring(command, lun),
            route::Route::Async => self.submit_async(command, lun, &mut buffers),
            route::Route::Owner => self.submit_shipped(command, lun),
            _ => Err(command),
        };
        if let Err(command) = submitted {
            self.run_blocking(command, lun, &mut buffers);
        }
    }

    fn lun_exists(&mut self, lun: [u8; 8]) -> bool {
        self.luns
            .as_ref()
            .is_some_and(|m| m.get(scsi::lun_from_wire(lun)).is_some())
    }

    fn task_management(&mut self, itt: u32, function: TmfFunction, lun: [u8; 8]) -> TmfAnswer {
        let by = self.nexus.as_ref().map_or(0, |n| n.id);
        // The LUs whose every command (of any session) must finish first.
        let units: Vec<Arc<scsi::LogicalUnit>> = match function {
            TmfFunction::LogicalUnitReset | TmfFunction::ClearTaskSet => self
                .luns
                .as_ref()
                .and_then(|m| m.get(scsi::lun_from_wire(lun)))
                .map(|entry| vec![Arc::clone(&entry.lu)])
                .unwrap_or_default(),
            TmfFunction::TargetWarmReset | TmfFunction::TargetColdReset => self
                .admitted
                .membership()
                .and_then(|m| self.topology.targets.get(m.target))
                .map(|t| t.units.clone())
                .unwrap_or_default(),
            // ABORT TASK SET concerns this nexus's tasks only, which the session waits for.
            _ => Vec::new(),
        };
        if units.is_empty() {
            return TmfAnswer::Now(iscsi::session::tmf_response::COMPLETE);
        }
        let mut wait = TmfWait::new(itt, function, by, units);
        wait.at_owner = self.nexus.clone().filter(|nexus| {
            function == TmfFunction::LogicalUnitReset
                && wait
                    .units
                    .iter()
                    .any(|u| u.ships_to_owner(nexus, &[0u8; 6]))
        });
        self.tmf_waits.push(wait);
        TmfAnswer::Later
    }

    fn send_targets(&mut self, filter: Option<&str>) -> Vec<DiscoveredTarget> {
        let mut found = Vec::new();
        // A name that is not one names no target.
        let named = filter
            .filter(|f| !f.is_empty())
            .map(|f| IscsiName::from_wire(f).ok());
        let topology = Arc::clone(&self.topology);
        // The host's addresses, asked once per request and only if needed.
        let mut host: Option<Vec<std::net::IpAddr>> = None;
        for (index, t) in topology.targets.iter().enumerate() {
            let wanted = match (&named, filter) {
                (None, None) => true,
                // Empty value: the session's own target.
                (None, Some(_)) => self
                    .admitted
                    .membership()
                    .is_some_and(|m| m.target == index),
                (Some(name), _) => name.as_ref() == Some(&t.iqn),
            };
            if !wanted {
                continue;
            }
            // The same decision as a login's: visible exactly to those who could log in.
            if topology
                .member(index, &self.initiator, self.peer.ip())
                .is_err()
            {
                continue;
            }
            // Every portal of every portal group of the target: each one a path.
            let mut addresses = Vec::new();
            for &(addr, tag) in &self.shared.portals {
                if !t.portal_groups.contains(&tag) {
                    continue;
                }
                let host = host.get_or_insert_with(crate::topology::portals::host_addresses);
                for shown in crate::topology::portals::advertised(addr, self.local.ip(), host) {
                    let entry = format!("{shown},{tag}");
                    if !addresses.contains(&entry) {
                        addresses.push(entry);
                    }
                }
            }
            found.push(DiscoveredTarget {
                name: t.iqn.to_string(),
                addresses,
            });
        }
        found
    }

    fn data_out_memory(&mut self, lun: [u8; 8], len: usize) -> Option<Box<dyn DataOutMemory>> {
        // Only where the ring will take it: a direct-I/O LUN of a connection whose ring works.
        let lun = scsi::lun_from_wire(lun);
        if len == 0 || self.ring_failed {
            return None;
        }
        self.disk_luns
            .iter()
            .find(|d| d.lun == lun)?
            .ring
            .as_ref()?;
        let buf = DIRECT_BUFFERS.with(|pool| pool.take(len))?;
        Some(Box::new(DirectDataOut(buf)))
    }
}

impl Driver {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        local: SocketAddr,
        portal_group_tag: u16,
        shared: &Shared,
    ) -> Driver {
        let limits = &shared.limits;
        // Room for the largest PDU we accept plus slack, so a full window of small PDUs is read at once.
        let frame_max =
            pdu::BHS_LEN + AHS_BYTES_MAX + 4 + limits.max_recv_data_segment_length as usize + 8;
        let rbuf_full = (frame_max * 2).max(256 * 1024);
        Driver {
            stream,
            peer,
            local,
            portal_group_tag,
            rbuf: vec![0; RBUF_IDLE.min(rbuf_full)],
            rbuf_full,
            start: 0,
            end: 0,
            received: false,
            last_pdu_long: false,
            out: Outbox::new(64),
        }
    }

    async fn run(
        &mut self,
        shared: &Arc<Shared>,
        prelogin: crate::admission::prelogin::Ticket,
        peer_only: bool,
    ) -> Result<(), Closed> {
        // The connection's one timer: the login deadline now, its other deadlines later.
        let mut alarm = Alarm::new().map_err(Closed::timer)?;
        let Some(logged_in) = self.login(shared, prelogin, peer_only, &mut alarm).await? else {
            return Ok(());
        };
        let LoggedIn {
            established,
            mut ticket,
            topology,
            membership,
            admitted,
        } = logged_in;
        let (completions, mut completed) = tokio::sync::mpsc::unbounded_channel();
        let mut backend = self.backend(shared, &topology, admitted, &established, completions);
        if let Some((t, group)) = membership.and_then(|m| topology.group_of(m)) {
            if let Some(port) = t.ports.get(&self.portal_group_tag).cloned() {
                let nexus = nexus_of(&established, t, group, port);
                for entry in group.luns.entries() {
                    entry.lu.nexus_added(nexus.id);
                }
                backend.nexus = Some(nexus);
                backend.use_group(group);
            }
        }
        let info = self.session_info(&established);
        self.log_established(&established);
        ticket.describe(Arc::clone(&info));
        backend.info = Some(info);
        let established_at = Instant::now();
        let mut session = new_session(&established, &shared.limits);
        shared.metrics.sessions.inc();
        let mut wakeups = Wakeups::new(
            Duration::from_micros(shared.limits.coalesce_wait_us.into()),
            Arc::clone(&shared.metrics),
        );
        let result = self
            .full_feature(
                &mut session,
                &mut backend,
                &mut ticket,
                &mut completed,
                &mut wakeups,
                &mut alarm,
            )
            .await;
        wakeups.report();
        self.end_session(&mut backend, &established, established_at, &result);
        drop(ticket);
        result
    }

    /// The login phase, to its end: `None` when the login failed (its response was sent).
    async fn login(
        &mut self,
        shared: &Arc<Shared>,
        prelogin: crate::admission::prelogin::Ticket,
        peer_only: bool,
        alarm: &mut Alarm,
    ) -> Result<Option<LoggedIn>, Closed> {
        let mut policy = Policy {
            shared,
            portal_group_tag: self.portal_group_tag,
            peer: self.peer,
            ticket: None,
            peer_only,
            admitted: None,
        };
        let (login_limits, target_limits) = login_limits(&shared.limits);
        let mut login = Login::new(login_limits, target_limits, initial_stat_sn());
        alarm
            .set(Instant::now() + prelogin.login_timeout)
            .map_err(Closed::timer)?;
        let mut shutdown = shared.shutdown_signal();
        let established = loop {
            let step = tokio::select! {
                step = self.next_login_step(&mut login, &mut policy) => step?,
                rung = alarm.rung() => {
                    rung.map_err(Closed::timer)?;
                    shared.metrics.limit("login_timeout_s");
                    return Err(Closed::Limit("login timed out"));
                }
                () = Shared::wait_for_shutdown(&mut shutdown) => return Err(Closed::Limit("shutting down during login")),
                () = prelogin.evicted() => {
                    return Err(Closed::Limit("evicted before login: max_prelogin_connections reached"))
                }
            };
            // Count and log before the response goes out, so anyone who saw it sees the count.
            match &step {
                LoginStep::Continue => {}
                LoginStep::Failed(status) => {
                    let result = format!("{:02x}{:02x}", status.class, status.detail);
                    shared.metrics.login(result);
                    self.login_failed(shared, &login, *status);
                }
                LoginStep::Complete(_) => shared.metrics.login("success".into()),
            }
            self.flush().await?;
            match step {
                LoginStep::Continue => continue,
                LoginStep::Failed(_) => return Ok(None),
                LoginStep::Complete(est) => break est,
            }
        };
        // Logged in: no longer in the pre-login budget, never evicted from here on.
        drop(prelogin);
        logged_in(policy, established).map(Some)
    }

    /// The backend of a session admitted as `admitted` under `topology` (its nexus and LUN
    /// map are set next).
    fn backend<'s>(
        &self,
        shared: &'s Arc<Shared>,
        topology: &Arc<Topology>,
        admitted: Admitted,
        established: &Established,
        completions: tokio::sync::mpsc::UnboundedSender<Completed>,
    ) -> Backend<'s> {
        Backend {
            shared,
            disk_luns: Arc::new(Vec::new()),
            answers: Answers {
                completions,
                flag: busy_poll::completion_flag(),
            },
            deferred_bytes: 0,
            deferred_bytes_max: shared.limits.memory_per_connection_bytes as usize,
            peer: self.peer,
            topology: Arc::clone(topology),
            admitted,
            target_name: established.target_name.clone(),
            initiator: established.initiator_name.clone(),
            luns: None,
            nexus: None,
            local: self.local,
            portal_group_tag: self.portal_group_tag,
            io: Vec::new(),
            turn_started: Instant::now(),
            turn_inline: Vec::new(),
            turn_ended: None,
            tmf_waits: Vec::new(),
            ring: None,
            ring_failed: false,
            ring_reported: 0,
            answered: Vec::new(),
            ring_finished: Vec::new(),
            group_commits: Vec::new(),
            loan: Loan::default(),
            info: None,
            close_reason: None,
            routed: None,
        }
    }

    fn session_info(
        &self,
        established: &Established,
    ) -> Arc<crate::admission::registry::SessionInfo> {
        Arc::new(crate::admission::registry::SessionInfo {
            initiator: established.initiator_name.to_string(),
            initiator_alias: established.initiator_alias.clone(),
            target: established.target_name.as_ref().map(|t| t.to_string()),
            tsih: established.tsih,
            isid: established.isid,
            cid: established.cid,
            portal_group_tag: self.portal_group_tag,
            portal: self.local,
            source: self.peer,
            chap_user: established.chap_user.clone(),
            params: established.params,
            started: std::time::SystemTime::now(),
            reads: Default::default(),
            writes: Default::default(),
            read_bytes: Default::default(),
            write_bytes: Default::default(),
        })
    }

    fn log_established(&self, established: &Established) {
        tracing::info!(
            peer = %self.peer,
            initiator = %established.initiator_name,
            target = target_shown(established),
            tsih = established.tsih,
            chap_user = established.chap_user.as_deref().unwrap_or("(none)"),
            "session established"
        );
    }

    /// A session's end: its counts reported, its nexus gone from its LUs, its close logged.
    fn end_session(
        &self,
        backend: &mut Backend<'_>,
        established: &Established,
        established_at: Instant,
        result: &Result<(), Closed>,
    ) {
        backend.report_io();
        backend.shared.metrics.sessions.dec();
        if let (Some(luns), Some(nexus)) = (&backend.luns, &backend.nexus) {
            for entry in luns.entries() {
                entry.lu.nexus_lost(nexus.id);
            }
        }
        let reason = match (result, backend.close_reason) {
            (_, Some(reason)) => reason.to_string(),
            (Err(e), None) => e.to_string(),
            (Ok(()), None) => "logout or connection closed".to_string(),
        };
        tracing::info!(
            peer = %self.peer,
            initiator = %established.initiator_name,
            target = target_shown(established),
            tsih = established.tsih,
            duration_s = established_at.elapsed().as_secs(),
            reason,
            "session closed"
        );
    }

    /// Logs a failed login (initiator, source, reason; never a secret or a response) and counts
    /// authentication and authorization failures for the per-source rate limit.
    fn login_failed(&self, shared: &Shared, login: &Login, status: LoginStatus) {
        let initiator = login
            .initiator_name()
            .map_or("(unnamed)", IscsiName::as_str);
        let target = login.target_name().map_or("(discovery)", IscsiName::as_str);
        let counted = status == LoginStatus::AUTH_FAILED || status == LoginStatus::FORBIDDEN;
        match login.auth_failure() {
            Some(reason) => tracing::warn!(
                peer = %self.peer,
                initiator,
                target,
                "login failed: {status}: {reason}"
            ),
            None if counted => {
                tracing::warn!(peer = %self.peer, initiator, target, "login failed: {status}")
            }
            None => {
                tracing::info!(peer = %self.peer, initiator, target, "login failed: {status}")
            }
        }
        if counted {
            shared
                .doors
                .record_login_failure(self.peer.ip(), Instant::now());
        }
    }

    /// Reads until one login PDU is complete and handles it.
    async fn next_login_step(
        &mut self,
        login: &mut Login,
        policy: &mut Policy<'_>,
    ) -> Result<LoginStep, Closed> {
        let framing = login.framing();
        loop {
            match pdu::frame_len(&self.rbuf[self.start..self.end], &framing) {
                Ok(Some(len)) => {
                    let frame = &self.rbuf[self.start..self.start + len];
                    let pdu = pdu::parse_frame(frame, &framing)
                        .map_err(|(e, _)| Closed::Protocol(e.to_string()))?;
                    let mut bytes = Vec::new();
                    let step = login.handle(&pdu, policy, &mut bytes);
                    self.start += len;
                    self.out.push_bytes(&bytes);
                    return Ok(step);
                }
                Ok(None) => self.fill().await?,
                Err(e) => return Err(Closed::Protocol(format!("bad login PDU: {e}"))),
            }
        }
    }

    async fn full_feature(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        ticket: &mut SessionTicket,
        completed: &mut tokio::sync::mpsc::UnboundedReceiver<Completed>,
        wakeups: &mut Wakeups,
        alarm: &mut Alarm,
    ) -> Result<(), Closed> {
        let grace = Duration::from_secs(backend.shared.limits.shutdown_grace_s.into());
        let mut life = Lifecycle::new(Instant::now(), grace);
        let mut timed_out = false;
        let mut was_congested = false;
        loop {
            // First run whatever is already buffered (pipelined behind the login).
            let (flow, drained) = self.process(session, backend)?;
            self.flush().await?;
            if flow == Flow::Close {
                return Ok(());
            }
            // At its memory budget the connection reads and handles nothing more until commands
            // on the blocking pool complete (TCP holds the initiator back).
            let congested = backend.congested();
            if congested && !was_congested {
                backend.shared.metrics.limit("memory_per_connection_bytes");
                tracing::debug!(peer = %self.peer, "memory budget reached; waiting for completions");
            }
            was_congested = congested;
            if !drained && !congested {
                continue;
            }
            if !congested {
                // A long write payload still arriving goes straight into its command's buffer.
                match self.receive_in_place(session, backend, alarm).await? {
                    Some(Flow::Close) => return Ok(()),
                    Some(Flow::Continue) => continue,
                    None => {}
                }
                let now = backend.turn_ended.take().unwrap_or_else(Instant::now);
                wakeups.after_turn(&self.stream, &session.take_activity(), timed_out, now);
                timed_out = false;
                self.make_room();
            }
            let mut waiting = Waiting {
                session,
                backend,
                ticket,
                completed,
                wakeups,
                life: &mut life,
                congested,
            };
            match self.wait(&mut waiting, alarm).await? {
                Woken::Work => {}
                Woken::BatchOver => timed_out = true,
                Woken::End => return Ok(()),
            }
        }
    }

    /// Waits for the next thing to do: bytes from the initiator (unless congested), the alarm
    /// (a batch's wait over, the session's tick), a completion from another thread or the
    /// ring, a task management function's LUs drained, the registry closing the session.
    async fn wait(&mut self, w: &mut Waiting<'_, '_>, alarm: &mut Alarm) -> Result<Woken, Closed> {
        let (session, backend) = (&mut *w.session, &mut *w.backend);
        let read_end = self.read_end(session);
        // While congested only the tick (and completions) may wake the connection.
        let batch_deadline = w.wakeups.batch_deadline().filter(|_| !w.congested);
        let next_tick = w.life.poll_timeout();
        let wake_at = batch_deadline.map_or(next_tick, |d| d.min(next_tick));
        alarm.set(wake_at).map_err(Closed::timer)?;
        let end_if = |close: bool| if close { Woken::End } else { Woken::Work };
        tokio::select! {
            read = self.stream.read(&mut self.rbuf[self.end..read_end]), if !w.congested => {
                match read {
                    Ok(0) => Ok(Woken::End),
                    Ok(n) => {
                        self.received_into_buffer(n);
                        Ok(Woken::Work)
                    }
                    Err(e) => Err(Closed::Io(e)),
                }
            }
            rung = alarm.rung() => {
                rung.map_err(Closed::timer)?;
                let now = Instant::now();
                let batch_over = batch_deadline.is_some_and(|d| now >= d);
                if batch_over && !self.read_held_back()? {
                    return Ok(Woken::End);
                }
                if w.life.handle_timeout(now)
                    && !self.tick(session, backend, w.wakeups, w.life, w.congested).await?
                {
                    return Ok(Woken::End);
                }
                Ok(if batch_over { Woken::BatchOver } else { Woken::Work })
            }
            Some(done) = w.completed.recv() => {
                let closing = self.deliver_burst(session, backend, w.completed, done);
                if closing {
                    // A TARGET COLD RESET answered once its last aborted task finished.
                    self.flush().await?;
                }
                Ok(end_if(closing))
            }
            ready = ring_ready(&backend.ring), if backend.ring.as_ref().is_some_and(|r| r.in_flight() > 0) => {
                ready.map_err(|e| Closed::Failed(format!("io_uring: {e}")))?;
                backend.reap_ring();
                let closing = deliver_answered(session, backend, &mut self.out);
                if closing {
                    self.flush().await?;
                }
                Ok(end_if(closing))
            }
            drained = first_drained(&backend.tmf_waits), if !backend.tmf_waits.is_empty() => {
                let flow = self.finish_tmf(session, backend, drained).await?;
                Ok(end_if(flow == Flow::Close))
            }
            changed = w.ticket.kill.changed() => {
                let reason = *w.ticket.kill.borrow();
                if changed.is_err() || reason.is_some() {
                    let reason = reason.unwrap_or("registry gone");
                    tracing::info!(peer = %self.peer, "closing the session: {reason}");
                    backend.close_reason = Some(reason);
                    return Ok(Woken::End);
                }
                Ok(Woken::Work)
            }
        }
    }

    /// Reads what the receive low-water mark held back once the batch's wait is over; false at
    /// the end of the stream.
    fn read_held_back(&mut self) -> Result<bool, Closed> {
        match rustix::net::recv(
            &self.stream,
            &mut self.rbuf[self.end..],
            RecvFlags::DONTWAIT,
        ) {
            Ok((0, _)) => Ok(false),
            Ok((n, _)) => {
                self.received_into_buffer(n);
                Ok(true)
            }
            Err(rustix::io::Errno::AGAIN) => Ok(true),
            Err(e) => Err(Closed::Io(e.into())),
        }
    }

    /// The session's tick: the iSCSI session's pings and verdicts, then the decisions made for
    /// an idle session too (a topology change, an RBD image's ownership lost, the shutdown).
    /// False when the session ends.
    async fn tick(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        wakeups: &mut Wakeups,
        life: &mut Lifecycle,
        congested: bool,
    ) -> Result<bool, Closed> {
        self.shrink_if_idle();
        wakeups.report();
        backend.report_io();
        let now = Instant::now();
        let verdict = session.tick(now, !congested, &mut self.out);
        self.flush().await?;
        if let Some(close) = Lifecycle::verdict(verdict) {
            match close {
                lifecycle::Close::Idle => {
                    tracing::info!(peer = %self.peer, "closing idle session (idle_timeout_s)");
                    backend.shared.metrics.limit("idle_timeout_s");
                }
                _ => {
                    tracing::warn!(peer = %self.peer, "closing dead connection (no answer to NOP-In)")
                }
            }
            backend.close_reason = Some(close.reason());
            return Ok(false);
        }
        if backend.shared.generation() != backend.topology.generation && !backend.follow_or_close()
        {
            return Ok(false);
        }
        if backend.lost_an_image() {
            // A command this session holds could be stale (docs/RBD.md); the initiator logs in
            // again and its new session ships to the new owner.
            tracing::warn!(peer = %self.peer, "closing the session: this gateway lost an RBD image it maps (log in again to reach the new owner)");
            backend.close_reason = Some("the gateway lost an image the session maps");
            return Ok(false);
        }
        // Shutdown is noticed here, within a second: a flag read once a second costs nothing,
        // where a wake-up channel shared by every connection would be polled (and locked) on
        // every turn.
        let grace_s = backend.shared.limits.shutdown_grace_s;
        match life.shutdown(Instant::now(), backend.shared.is_shutting_down()) {
            Shutdown::Nothing => Ok(true),
            Shutdown::AskLogout(within) => {
                session.request_logout(within, &mut self.out);
                self.flush().await?;
                tracing::info!(peer = %self.peer, "shutting down: asked the initiator to log out within {grace_s} s");
                Ok(true)
            }
            Shutdown::Close(close) => {
                match close {
                    lifecycle::Close::NoLogout => {
                        tracing::warn!(peer = %self.peer, "shutting down: no logout within {grace_s} s; closing the session")
                    }
                    _ => tracing::info!(peer = %self.peer, "shutting down: closing the session"),
                }
                backend.close_reason = Some(close.reason());
                Ok(false)
            }
        }
    }

    /// Answers a completion and those that arrived meanwhile, in a single write: a device that
    /// completes in bursts (librbd's thread hands several over per wake-up) then costs one
    /// send, not one per command. True when the session closes.
    fn deliver_burst(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        completed: &mut tokio::sync::mpsc::UnboundedReceiver<Completed>,
        done: Completed,
    ) -> bool {
        let mut closing = deliver(session, backend, &mut self.out, done);
        while !closing && self.out.len() < TURN_BYTES_MAX {
            let Ok(done) = completed.try_recv() else {
                break;
            };
            closing = deliver(session, backend, &mut self.out, done);
        }
        closing
    }

    /// Answers a task management function whose LUs drained. Through a gateway that does not
    /// own the LU, the owner resets it too before the answer (its nexuses get the unit
    /// attention); this connection waits meanwhile, its LU holding new commands anyway.
    async fn finish_tmf(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        drained: usize,
    ) -> Result<Flow, Closed> {
        let wait = backend.tmf_waits.swap_remove(drained);
        let wait = if wait.at_owner.is_some() {
            tokio::task::spawn_blocking(move || {
                wait.reset_at_owner();
                wait
            })
            .await
            .map_err(|e| Closed::Failed(format!("LUN reset at the owner: {e}")))?
        } else {
            wait
        };
        wait.apply();
        let itt = wait.itt;
        // The LUs take commands again (before the answer goes out).
        drop(wait);
        let flow = session.task_management_done(
            itt,
            iscsi::session::tmf_response::COMPLETE,
            &mut self.out,
        );
        self.flush().await?;
        Ok(flow)
    }

    /// Handles the complete PDUs in the buffer, stopping early once a turn's responses reach
    /// `TURN_BYTES_MAX` or the backend is congested, so memory stays bounded. Returns whether the
    /// buffer was drained.
    fn process(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
    ) -> Result<(Flow, bool), Closed> {
        if backend.shared.generation() != backend.topology.generation && !backend.follow_or_close()
        {
            return Ok((Flow::Close, true));
        }
        let now = Instant::now();
        backend.turn_started = now;
        let result = self.process_pdus(session, backend, now);
        backend.submit_ring();
        // Completions the kernel posted meanwhile (it runs the ring's work at every system
        // call of this thread) are answered with this turn: a busy connection may not return
        // to tokio's epoll for a while, which alone would tell it the ring is readable.
        backend.reap_ring();
        let closing = deliver_answered(session, backend, &mut self.out);
        backend.finish_turn();
        if closing {
            return Ok((Flow::Close, true));
        }
        result
    }

    fn process_pdus(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        now: Instant,
    ) -> Result<(Flow, bool), Closed> {
        let framing: Framing = session.framing();
        loop {
            if backend.congested() {
                return Ok((Flow::Continue, false));
            }
            let available = &self.rbuf[self.start..self.end];
            let len = match pdu::frame_len(available, &framing) {
                Ok(Some(len)) => len,
                Ok(None) => return Ok((Flow::Continue, true)),
                Err(e @ FrameError::DataSegmentTooLong { .. }) => {
                    return Err(Closed::Protocol(format!("protocol error: {e}")));
                }
                Err(e) => return Err(Closed::Protocol(e.to_string())),
            };
            let frame = &self.rbuf[self.start..self.start + len];
            self.last_pdu_long = len >= IN_PLACE_MIN;
            let flow = match pdu::parse_frame(frame, &framing) {
                Ok(pdu) => session.handle(&pdu, now, backend, &mut self.out),
                Err((FrameError::DataDigest, Some(bhs))) => {
                    session.data_digest_error(&bhs, &mut self.out)
                }
                Err((e, _)) => return Err(Closed::Protocol(format!("protocol error: {e}"))),
            };
            self.start += len;
            if flow == Flow::Close {
                return Ok((Flow::Close, true));
            }
            if self.out.len() >= TURN_BYTES_MAX {
                return Ok((Flow::Continue, false));
            }
        }
    }

    /// When the receive buffer ends in the first part of a PDU with a long payload that the
    /// session takes in place — a Data-Out, or a write's SCSI Command with immediate data (no
    /// digests on the connection) — receives the rest of the payload straight into the
    /// command's Data-Out buffer (the bytes already here are copied there) and hands the PDU
    /// over: the receive buffer never holds it whole, and the session does not copy it again.
    /// None when this does not apply: the PDU takes the usual way.
    async fn receive_in_place(
        &mut self,
        session: &mut Session,
        backend: &mut Backend<'_>,
        alarm: &mut Alarm,
    ) -> Result<Option<Flow>, Closed> {
        let framing = session.framing();
        let available = &self.rbuf[self.start..self.end];
        let Some(header) = available.get(..pdu::BHS_LEN) else {
            return Ok(None);
        };
        let Ok(bytes) = <[u8; pdu::BHS_LEN]>::try_from(header) else {
            return Ok(None);
        };
        let bhs = pdu::Bhs(bytes);
        let len = bhs.data_segment_len();
        let have = available.len() - pdu::BHS_LEN;
        // Whether the session takes it in place is the session's question (below).
        if bhs.total_ahs_len() != 0
            || len < IN_PLACE_MIN
            || len > framing.max_data_segment_len
            || have >= len
        {
            return Ok(None);
        }
        let opcode = Opcode::from_initiator(bhs.opcode_raw());
        let dst = match opcode {
            Some(Opcode::DataOut) => session.data_out_destination(&bhs),
            Some(Opcode::ScsiCommand) => {
                session.command_data_destination(&bhs, backend, &mut self.out)
            }
            _ => None,
        };
        let Some(dst) = dst else {
            return Ok(None);
        };
        dst[..have].copy_from_slice(&self.rbuf[self.start + pdu::BHS_LEN..self.end]);
        self.start = 0;
        self.end = 0;
        // A sender that stops mid-PDU is dropped within the dead-peer bound of the usual path
        // (a ping, then its timeout), which cannot run while this waits. The alarm stays set for
        // the connection's next deadline (no system call when the payload arrives in time);
        // should it ring meanwhile, it is set for the stall bound instead.
        let limits = &backend.shared.limits;
        let stalled_at = Instant::now()
            + Duration::from_secs(
                u64::from(limits.nop_in_interval_s) + u64::from(limits.nop_in_timeout_s.max(5)),
            );
        let mut filled = have;
        let mut pad = [0u8; 3];
        let pad_len = pdu::padded(len) - len;
        while filled < len + pad_len {
            // The payload, then its padding (discarded).
            let into = if filled < len {
                dst.get_mut(filled..len)
            } else {
                pad.get_mut(filled - len..pad_len)
            };
            let Some(into) = into else {
                return Err(Closed::Protocol("Data-Out placement out of range".into()));
            };
            tokio::select! {
                read = self.stream.read(into) => match read {
                    Ok(0) => return Err(Closed::Limit("peer closed")),
                    Ok(n) => filled += n,
                    Err(e) => return Err(Closed::Io(e)),
                },
                rung = alarm.rung() => {
                    rung.map_err(Closed::timer)?;
                    if Instant::now() >= stalled_at {
                        return Err(Closed::Limit("peer stalled in the middle of a Data-Out PDU"));
                    }
                    alarm.set(stalled_at).map_err(Closed::timer)?;
                }
            }
        }
        let now = Instant::now();
        backend.turn_started = now;
        let flow = if opcode == Some(Opcode::DataOut) {
            session.handle_placed_data_out(&bhs, now, backend, &mut self.out)
        } else {
            session.handle_placed_command(now, backend, &mut self.out)
        };
        self.last_pdu_long = true;
        backend.finish_turn();
        self.flush().await?;
        Ok(Some(flow))
    }

    /// Where the next read into the buffer stops. When a long PDU is likely next — a write
    /// awaits its Data-Out, or the last PDU was long (a stream of large writes: commands with
    /// immediate data, then their Data-Out) — a read ends with the next PDU's header: with
    /// nothing buffered, the header alone; in the middle of a long PDU, that PDU's rest and the
    /// header after it. A long write payload then goes straight into place
    /// ([`Driver::receive_in_place`]) instead of arriving in this buffer whole and being copied
    /// out of it: one more `recv` per long PDU instead of a copy of up to 256 KiB. Otherwise
    /// (short PDUs) reads fill the buffer.
    fn read_end(&self, session: &Session) -> usize {
        let full = self.rbuf.len();
        if !self.last_pdu_long && !session.awaits_data_out(IN_PLACE_MIN) {
            return full;
        }
        let buffered = &self.rbuf[self.start..self.end];
        let stop = if buffered.is_empty() {
            self.end + pdu::BHS_LEN
        } else {
            match pdu::declared_frame_len(buffered, &session.framing()) {
                Ok(None) => self.start + pdu::BHS_LEN,
                Ok(Some(len)) if len >= IN_PLACE_MIN => self.start + len + pdu::BHS_LEN,
                _ => return full,
            }
        };
        // Never an empty range: a read into one returns 0, which means the peer closed.
        let stop = stop.min(full);
        if stop > self.end {
            stop
        } else {
            full
        }
    }

    /// Moves a partial PDU to the front when the tail of the buffer is short, and grows a small
    /// buffer that one partial PDU fills.
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.rbuf.len() - self.end < self.rbuf.len() / 4 {
            self.rbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        self.grow_if_full();
    }

    /// Counts `n` bytes read into the buffer's free tail. A read that filled the buffer means
    /// more is waiting: from then on the connection reads in full-size batches.
    fn received_into_buffer(&mut self, n: usize) {
        self.end += n;
        self.received = true;
        self.grow_if_full();
    }

    /// Grows the buffer to its full size when it has no room left (contents kept): after a
    /// read, more is waiting; after `make_room`, one partial PDU is longer than the small size.
    fn grow_if_full(&mut self) {
        if self.end == self.rbuf.len() && self.rbuf.len() < self.rbuf_full {
            self.rbuf.resize(self.rbuf_full, 0);
        }
    }

    /// Once a second: a connection that received nothing since the last tick and holds no
    /// partial PDU goes back to the small buffer.
    fn shrink_if_idle(&mut self) {
        if !self.received && self.start == self.end && self.rbuf.len() > RBUF_IDLE {
            self.rbuf = vec![0; RBUF_IDLE];
            self.start = 0;
            self.end = 0;
        }
        self.received = false;
    }

    async fn fill(&mut self) -> Result<(), Closed> {
        self.make_room();
        if self.end == self.rbuf.len() {
            return Err(Closed::Limit("receive buffer full"));
        }
        match self.stream.read(&mut self.rbuf[self.end..]).await {
            Ok(0) => Err(Closed::Limit("peer closed")),
            Ok(n) => {
                self.received_into_buffer(n);
                Ok(())
            }
            Err(e) => Err(Closed::Io(e)),
        }
    }

    /// Sends everything queued with as few system calls as possible: one vectored write for the
    /// memory parts between file ranges, one `sendfile` per file range.
    async fn flush(&mut self) -> Result<(), Closed> {
        if self.out.is_broken() {
            // A bug, not the initiator's doing: what is queued no longer matches its headers.
            tracing::error!(peer = %self.peer, "outbox invariant broken (a payload range out of bounds); closing the connection");
            return Err(Closed::Invariant("outbox invariant broken"));
        }
        while let Some(first) = self.out.parts().first() {
            let written = if let &Part::File { offset, len, .. } = first {
                let Some(file) = self.out.file(first) else {
                    return Err(Closed::Invariant("outbox: file part without its file"));
                };
                let sent = self
                    .stream
                    .async_io(Interest::WRITABLE, || {
                        let mut at = offset;
                        rustix::fs::sendfile(&self.stream, file, Some(&mut at), len)
                            .map_err(std::io::Error::from)
                    })
                    .await
                    .map_err(|e| Closed::Failed(format!("sendfile: {e}")))?;
                if sent == 0 {
                    // Only past the end of the file: it shrank under the LU.
                    return Err(Closed::Failed(
                        "sendfile: LU file shorter than its size".into(),
                    ));
                }
                sent
            } else {
                let mut file_follows = false;
                let slices: Vec<IoSlice<'_>> = self
                    .out
                    .parts()
                    .iter()
                    .take(IOV_BATCH)
                    .take_while(|p| {
                        file_follows = matches!(p, Part::File { .. });
                        !file_follows
                    })
                    .map(|p: &Part| IoSlice::new(self.out.slice(p)))
                    .collect();
                if file_follows {
                    // MSG_MORE: the headers wait for the file data instead of leaving alone in
                    // a small segment (the socket has TCP_NODELAY).
                    self.stream
                        .async_io(Interest::WRITABLE, || {
                            rustix::net::sendmsg(
                                &self.stream,
                                &slices,
                                &mut SendAncillaryBuffer::default(),
                                SendFlags::MORE | SendFlags::NOSIGNAL,
                            )
                            .map_err(std::io::Error::from)
                        })
                        .await?
                } else {
                    self.stream.write_vectored(&slices).await?
                }
            };
            if written == 0 {
                return Err(Closed::Limit("peer stopped reading"));
            }
            self.out.consume(written);
        }
        self.out.clear();
        Ok(())
    }
}

/// Carries out the [`Coalescer`]'s plans on one connection: the socket's low-water mark, and
/// the deadline the connection's [`Alarm`] is set for while a batch collects (tokio's timers
/// tick in milliseconds, too coarse for a wait of a few hundred microseconds).
struct Wakeups {
    coalescer: Coalescer,
    /// The low-water mark the socket has now (1 = the default).
    applied_low_water: usize,
    /// The current batch's deadline, if a batch is collecting.
    deadline: Option<Instant>,
    /// Setting the low-water mark failed once: coalescing stays off for this connection.
    unavailable: bool,
    /// Whether the worker's busy poll counts this connection as collecting a batch, and as
    /// one whose initiator waits for answers.
    counted_batching: bool,
    counted_waiting: bool,
    /// Whether the initiator waits for each answer (then the worker busy-polls for it), and
    /// its last verdict: the worker is asked only when that changes, so a kernel that refuses
    /// to watch the socket (or a worker that does not poll) costs nothing per turn.
    lockstep: Lockstep,
    lockstep_waiting: bool,
    batches: u64,
    misses: u64,
    metrics: Arc<Metrics>,
}

impl Drop for Wakeups {
    fn drop(&mut self) {
        if self.counted_batching {
            busy_poll::set_batching(false);
        }
        if self.counted_waiting {
            busy_poll::waiting_ended();
        }
    }
}

impl Wakeups {
    fn new(max_wait: Duration, metrics: Arc<Metrics>) -> Wakeups {
        Wakeups {
            metrics,
            coalescer: Coalescer::new(max_wait),
            applied_low_water: 1,
            deadline: None,
            unavailable: max_wait.is_zero(),
            counted_batching: false,
            counted_waiting: false,
            lockstep: Lockstep::default(),
            lockstep_waiting: false,
            batches: 0,
            misses: 0,
        }
    }

    /// Plans the next wait from the turn just run and applies it.
    /// `now`: the turn's end (a few microseconds before its responses were flushed).
    fn after_turn(
        &mut self,
        socket: &TcpStream,
        activity: &Activity,
        timed_out: bool,
        now: Instant,
    ) {
        let waiting = self.lockstep.after_turn(activity);
        if waiting != self.lockstep_waiting {
            self.lockstep_waiting = waiting;
            if waiting {
                self.counted_waiting = busy_poll::set_waiting(socket, true);
            } else if self.counted_waiting {
                self.counted_waiting = busy_poll::set_waiting(socket, false);
            }
        }
        if self.unavailable {
            return;
        }
        match self.coalescer.after_turn(activity, timed_out, now) {
            Outcome::Missed => self.misses += 1,
            Outcome::Steady if timed_out || self.applied_low_water > 1 => self.batches += 1,
            Outcome::Steady => {}
        }
        let (low_water, deadline) = match self.coalescer.plan() {
            Plan::Immediate => (1, None),
            // The wait counts from now, after the turn's responses went out, not from the
            // turn's end the plan was made at: a wait of some tens of microseconds loses a
            // fifth to the flush otherwise, and batches time out before they fill.
            Plan::Batch {
                low_water,
                deadline,
            } => (
                low_water,
                Some(Instant::now() + deadline.saturating_duration_since(now)),
            ),
        };
        self.deadline = deadline;
        if !self.set_low_water(socket, low_water) {
            self.unavailable = true;
            self.deadline = None;
        }
        let batching = self.batch_deadline().is_some();
        if batching != self.counted_batching {
            busy_poll::set_batching(batching);
            self.counted_batching = batching;
        }
    }

    fn set_low_water(&mut self, socket: &TcpStream, bytes: usize) -> bool {
        if bytes == self.applied_low_water {
            return true;
        }
        match sys::set_receive_low_water(socket, bytes) {
            Ok(()) => {
                self.applied_low_water = bytes;
                true
            }
            Err(e) => {
                tracing::warn!("receive coalescing off for this connection: SO_RCVLOWAT: {e}");
                // Never leave a raised low-water mark without its deadline.
                let _ = sys::set_receive_low_water(socket, 1);
                self.applied_low_water = 1;
                false
            }
        }
    }

    /// When the connection must read whatever has arrived, though less than the low-water mark:
    /// the batch's deadline, while the socket holds readiness back (a raised mark).
    fn batch_deadline(&self) -> Option<Instant> {
        self.deadline.filter(|_| self.applied_low_water > 1)
    }

    /// Adds the counts since the last report to the daemon's metrics (once a second and at
    /// the end, so the command path touches no shared counter).
    fn report(&mut self) {
        if self.batches > 0 {
            self.metrics
                .receive_batches
                .inc_by(std::mem::take(&mut self.batches));
        }
        if self.misses > 0 {
            self.metrics
                .receive_batch_misses
                .inc_by(std::mem::take(&mut self.misses));
        }
    }
}

/// Unpredictable bytes from the kernel's CSPRNG (CHAP identifiers and challenges).
/// /dev/urandom never blocks once the system's pool is initialized, which is long done by the
/// time a daemon accepts connections.
/// What a full feature session waits with.
struct Waiting<'w, 'b> {
    session: &'w mut Session,
    backend: &'w mut Backend<'b>,
    ticket: &'w mut SessionTicket,
    completed: &'w mut tokio::sync::mpsc::UnboundedReceiver<Completed>,
    wakeups: &'w mut Wakeups,
    life: &'w mut Lifecycle,
    congested: bool,
}

/// What woke a waiting session.
enum Woken {
    /// Bytes, completions or a tick: run a turn.
    Work,
    /// The batch's wait is over: run a turn with what arrived (and say so to the coalescer).
    BatchOver,
    /// The session ends.
    End,
}

/// What a completed login hands to the full feature phase.
struct LoggedIn {
    established: Box<Established>,
    ticket: SessionTicket,
    /// The topology the session was admitted under, its group in it (`None`: discovery) and
    /// what it proved.
    topology: Arc<Topology>,
    membership: Option<Membership>,
    admitted: Admitted,
}

/// What the login policy decided, taken once the login completed.
fn logged_in(mut policy: Policy<'_>, established: Box<Established>) -> Result<LoggedIn, Closed> {
    let ticket = policy
        .ticket
        .take()
        .ok_or(Closed::Invariant("login completed without a session"))?;
    // A normal session was admitted as a member of one group of its target; discovery
    // sessions have no target.
    let (topology, membership, required) = policy
        .admitted
        .take()
        .ok_or(Closed::Invariant("login completed without an admission"))?;
    let admitted = Admitted::of_login(
        &topology,
        membership,
        &required,
        established.chap_user.as_deref(),
    )
    .ok_or(Closed::Invariant(
        "the admitted group is not in its topology",
    ))?;
    assert_eq!(
        membership.is_some(),
        established.target_name.is_some(),
        "a normal session's membership is decided at its admission"
    );
    debug_assert!(membership.is_none_or(|m| topology
        .targets
        .get(m.target)
        .is_some_and(|t| Some(&t.iqn) == established.target_name.as_ref())));
    Ok(LoggedIn {
        established,
        ticket,
        topology,
        membership,
        admitted,
    })
}

/// The limits a login negotiates within.
fn login_limits(limits: &crate::config::Limits) -> (LoginLimits, TargetLimits) {
    let target_limits = TargetLimits {
        max_recv_data_segment_length: limits.max_recv_data_segment_length,
        max_burst_length: limits.max_burst_length,
        first_burst_length: limits.first_burst_length,
        max_outstanding_r2t: limits.max_outstanding_r2t.min(u16::MAX as u32) as u16,
        header_digest_allowed: true,
        data_digest_allowed: true,
    };
    let login_limits = LoginLimits {
        max_keys: limits.max_text_key_count as usize,
        max_text_bytes: limits.max_text_length as usize,
        max_requests: 16,
        queue_depth: limits.max_queue_depth,
    };
    (login_limits, target_limits)
}

/// The I_T nexus of a session in `group` through `port`. A gateway peer's session ships for
/// the nexus its alias names: the initiator's own port through that gateway's port, in this
/// gateway's group.
fn nexus_of(
    established: &Established,
    t: &crate::topology::TargetRuntime,
    group: &GroupRuntime,
    port: Arc<scsi::TargetPort>,
) -> Nexus {
    let id = crate::topology::nexus::new_id();
    let shipped_for = group
        .peer
        .then_some(established.initiator_alias.as_deref())
        .flatten()
        .and_then(crate::io::peer::parse_peer_alias)
        .and_then(|(initiator, relative)| {
            let theirs = t.ports.values().find(|p| p.relative_id == relative)?;
            Some((initiator, theirs))
        });
    match shipped_for {
        Some((initiator_port, theirs)) => Nexus {
            id,
            initiator_port,
            target_port: Arc::new(scsi::TargetPort {
                relative_id: theirs.relative_id,
                name: theirs.name.clone(),
                target_name: theirs.target_name.clone(),
                group: port.group,
                groups: Arc::clone(&port.groups),
                shipped: true,
            }),
        },
        None => {
            let isid: String = established
                .isid
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            Nexus {
                id,
                initiator_port: format!("{},i,0x{isid}", established.initiator_name),
                target_port: port,
            }
        }
    }
}

/// The full feature session a login established.
fn new_session(established: &Established, limits: &crate::config::Limits) -> Session {
    let session_limits = SessionLimits {
        queue_depth: limits.max_queue_depth,
        max_write_bytes: WRITE_BYTES_MAX,
        // The largest single write must always fit, or it could never run.
        max_pending_write_bytes: (limits.memory_per_connection_bytes as usize)
            .max(WRITE_BYTES_MAX as usize),
        nop_interval: Duration::from_secs(limits.nop_in_interval_s.into()),
        nop_timeout: Duration::from_secs(limits.nop_in_timeout_s.into()),
        idle_timeout: Duration::from_secs(limits.idle_timeout_s.into()),
        max_text_bytes: limits.max_text_length as usize,
        max_keys: limits.max_text_key_count as usize,
    };
    Session::new(
        established.session_type,
        established.initiator_name.clone(),
        established.params,
        session_limits,
        established.next_stat_sn,
        established.exp_cmd_sn,
        Instant::now(),
    )
}

fn target_shown(established: &Established) -> &str {
    established
        .target_name
        .as_ref()
        .map_or("(discovery)", IscsiName::as_str)
}

fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// The first StatSN of a connection. Any value is valid; varying it per connection makes stale
/// acknowledgements from an older connection stand out.
fn initial_stat_sn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.subsec_nanos());
    nanos.max(1)
}

/// Whether two LUN maps show an initiator the same LUNs: same numbers, same LUs, same
/// read-only flags.
fn same_lun_map(a: &LunMap, b: &LunMap) -> bool {
    a.entries().len() == b.entries().len()
        && a.entries()
            .iter()
            .zip(b.entries())
            .all(|(x, y)| x.lun == y.lun && Arc::ptr_eq(&x.lu, &y.lu) && x.read_only == y.read_only)
}
