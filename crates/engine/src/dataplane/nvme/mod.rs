//! One NVMe/TCP queue from accept to close: connection initialization, the Connect that makes
//! it a controller's admin queue or joins it as an I/O queue, then its commands. Admin
//! commands are the `nvme` core's controller's; I/O commands become SCSI commands
//! (`nvme::translate`) run by the same backend, route and gates as an iSCSI session's, so a
//! device is one device whichever door a command came through.

mod abort;
mod connect;
mod discovery;
mod io;
pub(crate) mod view;
mod wire;

use std::future::Future as _;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use seam::outbox::Outbox;
use seam::ScsiBackend as _;

use crate::admission::registry::{DoorFacts, NvmeFacts};
use nvme::queue::{Queue, QueueLimits, Received, Refused};
use nvme::sqe::{Cqe, Status};
use tokio::net::TcpStream;

use super::alarm::Alarm;
use super::backend::{Backend, Completed};
use super::closed::{Closed, Ended};
use super::connection::NewConnection;
use super::driver::{self, Conn, Door, Driven, Heard, Told, Turn};
use super::lifecycle::{Pace, HOUSEKEEPING, SLACK};
use super::view::{Party, View};
use crate::admission::controllers::ControllerEntry;

use crate::shared::Shared;

/// I/O queues one controller may have (a host asks for one per CPU; more share the workers).
pub(crate) const IO_QUEUES_MAX: u16 = 8;
/// In-capsule data a command may carry (IOCCSZ): a write up to 64 KiB goes with its command,
/// as an iSCSI write within the default FirstBurstLength goes as immediate data, with no R2T
/// round trip and no H2CData PDUs.
pub(crate) const IN_CAPSULE_BYTES: u32 = 64 * 1024;
/// The longest keep-alive timeout a host may ask for: an hour.
pub(crate) const KATO_MS_MAX: u32 = 3_600_000;
/// The most data one command moves: 1 MiB (MDTS 8, in 4 KiB pages).
pub(crate) const TRANSFER_BYTES_MAX: u32 = 1 << 20;
/// A keep-alive is late after the timeout plus this (the host's timer and ours drift apart).
const KEEP_ALIVE_SLACK: Duration = Duration::from_secs(1);
/// How long a discovery controller that disabled keep-alive (KATO 0, as a one-shot
/// `nvme discover` does) may stay without a command before it is closed: it holds a place
/// among `max_discovery_sessions` and proves nothing by staying.
const DISCOVERY_IDLE: Duration = Duration::from_secs(60);

pub(crate) fn mdts(_limits: &crate::config::Limits) -> u8 {
    (TRANSFER_BYTES_MAX / 4096).trailing_zeros() as u8
}

fn queue_limits(limits: &crate::config::Limits) -> QueueLimits {
    // MAXH2CDATA: the largest PDU the iSCSI door takes too, a multiple of 4.
    let maxh2cdata = (limits.max_recv_data_segment_length & !3).max(4096);
    QueueLimits {
        maxh2cdata,
        in_capsule_max: IN_CAPSULE_BYTES,
        transfer_max: TRANSFER_BYTES_MAX,
        depth_max: limits.max_queue_depth.clamp(1, u32::from(u16::MAX)) as u16,
        solicited_max: u32::try_from(limits.memory_per_connection_bytes / 4)
            .unwrap_or(u32::MAX)
            .max(TRANSFER_BYTES_MAX),
    }
}

/// The largest PDU a host may send: an H2CData PDU of MAXH2CDATA or a command capsule with
/// the most in-capsule data, with both digests.
fn largest_pdu(limits: &crate::config::Limits) -> usize {
    use nvme::pdu::PduType;
    let digests = 2 * 4;
    let h2c = PduType::H2CData.hlen() + queue_limits(limits).maxh2cdata as usize;
    let capsule = PduType::CapsuleCmd.hlen() + IN_CAPSULE_BYTES as usize;
    h2c.max(capsule) + digests
}

/// A queue's first pace: an I/O queue's housekeeping comes a [`HOUSEKEEPING`] period after
/// its work, as a session's; an admin queue's a [`SLACK`] after, since its commands are its
/// controller's (Keep Alives, event requests, log pages), with no I/O to report. It parks that
/// much sooner after each of its host's Keep Alives: under Linux's, every 2.5 s, parked for
/// 2 s of them rather than 1.5.
fn pace(role: &Role) -> Pace {
    match role {
        Role::Admin(_) => Pace::every(SLACK),
        Role::Io(_) => Pace::every(HOUSEKEEPING),
    }
}

/// One NVMe/TCP queue's connection, from its first byte to its close. Every phase that
/// outlives an await is a future of its own on the heap, given back when it ends: the task
/// keeps only what a parked queue needs ([`Parked`]) and its wait.
pub fn serve(shared: Arc<Shared>, conn: NewConnection) -> impl std::future::Future<Output = ()> {
    let NewConnection {
        stream,
        peer,
        local,
        portal_group_tag,
        guard,
        prelogin,
        kind,
    } = conn;
    let at = connect::Arrival {
        peer,
        local,
        portal_group_tag,
        discovery_only: kind == super::connection::ListenerKind::NvmeDiscovery,
        tls: None,
    };
    let first = Box::pin(first_drive(Arc::clone(&shared), stream, at, prelogin));
    async move {
        let mut parked = first.await;
        while let Some(mut p) = parked {
            shared.metrics.connections_parked.inc();
            shared.metrics.connection_parks.inc();
            let woke = p.wait().await;
            shared.metrics.connections_parked.dec();
            parked = Box::pin(p.drive(&shared, woke)).await;
        }
        // The connection counts until its queue ended.
        drop(guard);
    }
}

/// The queue's first drive; None once it ended (logged).
async fn first_drive(
    shared: Arc<Shared>,
    stream: std::net::TcpStream,
    at: connect::Arrival,
    prelogin: crate::admission::prelogin::Ticket,
) -> Option<Box<Parked>> {
    let peer = at.peer;
    parked_or_closed(peer, connect_and_drive(shared, stream, at, prelogin).await)
}

/// A queue that parked, or None (its end logged).
fn parked_or_closed(
    peer: std::net::SocketAddr,
    driven: Result<Option<Box<Parked>>, Closed>,
) -> Option<Box<Parked>> {
    match driven {
        Ok(Some(parked)) => return Some(parked),
        Ok(None) => tracing::debug!(%peer, "NVMe/TCP queue closed"),
        Err(reason) => tracing::debug!(%peer, "NVMe/TCP queue closed: {reason}"),
    }
    None
}

/// The queue's connection opened (TLS or not) and its Connect, then its first drive.
async fn connect_and_drive(
    shared: Arc<Shared>,
    stream: std::net::TcpStream,
    mut at: connect::Arrival,
    prelogin: crate::admission::prelogin::Ticket,
) -> Result<Option<Box<Parked>>, Closed> {
    let peer = at.peer;
    let stream = TcpStream::from_std(stream).map_err(|e| {
        tracing::warn!(%peer, "cannot register NVMe/TCP connection: {e}");
        Closed::Io(e)
    })?;
    let Some((stream, tls)) = open(stream, &shared, &prelogin, peer).await else {
        return Ok(None);
    };
    at.tls = tls;
    let queue = Queue::new(queue_limits(&shared.limits));
    let driver = Driver::new(stream, at, queue, &shared.limits);
    driver.serve(&shared, prelogin).await
}

/// The queue's stream (TLS or not, `wire::open`) within the login timeout; None when the
/// queue ended first (logged and counted).
async fn open(
    stream: TcpStream,
    shared: &Arc<Shared>,
    prelogin: &crate::admission::prelogin::Ticket,
    peer: std::net::SocketAddr,
) -> Option<(wire::Wire, Option<crate::admission::TlsProof>)> {
    // The workers' runtimes have no timer wheel: the alarm is a timerfd.
    let armed = Alarm::new().and_then(|mut a| {
        a.set(Instant::now() + prelogin.login_timeout)?;
        Ok(a)
    });
    let mut alarm = match armed {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(%peer, "NVMe/TCP connection closed: no timer for its login: {e}");
            return None;
        }
    };
    let opened = tokio::select! {
        opened = wire::open(stream, shared) => Ok(opened),
        _ = alarm.rung() => Err(()),
        () = prelogin.evicted() => return None,
    };
    let failed = match opened {
        Ok(Ok((wire, tls))) => {
            if let Some(p) = &tls {
                shared.metrics.nvme_tls("success");
                let suite = match &wire {
                    wire::Wire::Tls(s) => s.ssl().current_cipher().map(|c| c.name()),
                    wire::Wire::Plain(_) => None,
                };
                tracing::info!(%peer, host = %p.host, subsystem = %p.subsystem, suite, "NVMe/TCP queue over TLS 1.3 (PSK)");
            }
            return Some((wire, tls));
        }
        Err(_) => {
            shared.metrics.limit("login_timeout_s");
            tracing::debug!(%peer, "NVMe/TCP connection closed: nothing within login_timeout_s");
            return None;
        }
        Ok(Err(wire::NotOpened::Closed)) => return None,
        Ok(Err(wire::NotOpened::Io(e))) => {
            tracing::debug!(%peer, "NVMe/TCP connection failed: {e}");
            return None;
        }
        Ok(Err(wire::NotOpened::Tls(label, why))) => (label, why),
    };
    // A failed handshake is a failed login: it counts toward the source's login_failures_max.
    shared.metrics.nvme_tls(failed.0);
    shared.doors.record_login_failure(peer.ip(), Instant::now());
    tracing::warn!(%peer, "NVMe/TCP TLS handshake failed: {}", failed.1);
    None
}

/// What a queue is once its Connect was accepted.
enum Role {
    Admin(Arc<ControllerEntry>),
    Io(Arc<ControllerEntry>),
}

impl Role {
    fn entry(&self) -> &Arc<ControllerEntry> {
        match self {
            Role::Admin(e) | Role::Io(e) => e,
        }
    }
}

struct Driver {
    /// The stream, the receive buffer and the outbox (`conn.out`: what the turn sends, `out`'s
    /// bytes and read data where it lies — lent store memory, a page-cached file range, a
    /// read buffer from the outbox's pool — sent as the iSCSI door's are).
    conn: Conn,
    at: connect::Arrival,
    /// The bytes the queue encodes (headers, digests, completions, small answers), moved to
    /// the outbox before the next data it references and at the flush.
    out: Vec<u8>,
    queue: Queue,
    qid: u16,
    /// An I/O queue holds its queue ID in its controller: from its Connect, or, when its host
    /// must authenticate, from when it has (no ID is taken from a host before its proof).
    qid_held: bool,
    /// The first command of a fused pair, waiting for its second.
    fused: Option<(Received, nvme::nvm::IoCommand)>,
    /// Fused pairs running as one COMPARE AND WRITE: (the write's identifier, the compare's).
    fused_pairs: Vec<(u16, u16)>,
    /// Reservation Reports running as READ FULL STATUS: (identifier, extended, bytes asked,
    /// whether the reservations persist through power loss).
    reports: Vec<(u16, bool, usize, bool)>,
    /// Commands that run as several SCSI commands, one after another: (identifier, the LUN
    /// of one still to run, that command). A Write Zeroes with FUA (WRITE SAME, then the
    /// SYNCHRONIZE CACHE of its blocks); a Set Features (Volatile Write Cache) (a MODE SELECT
    /// per namespace).
    synced: Vec<(u16, u64, nvme::translate::ScsiCommand<'static>)>,
    /// A Disconnect was answered: close once it is sent.
    closing: bool,
    /// The queue's DH-HMAC-CHAP transaction, when its host must authenticate: until it has,
    /// only Authentication Send and Receive run (`Driver::command`).
    auth: Option<Box<nvme::auth::controller::Transaction>>,
    /// When a queue that has not authenticated yet is closed.
    auth_deadline: Option<Instant>,
    /// The hash and group the transaction in progress settled on (for its log line).
    auth_chosen: Option<(nvme::auth::HashId, nvme::auth::DhGroup)>,
    /// On an admin queue, Aborts waiting for their I/O queue's verdict: (the Abort's
    /// identifier, when it is answered "not aborted" without one).
    aborts_held: Vec<(u16, Instant)>,
}

/// What a parked queue keeps of its [`Driver`]: its stream, its queue's
/// state (the commands it holds open, its SQ head, its digests), its ID and its
/// authentication; the rest is empty while it may park ([`Driver::parkable`]) and made anew.
struct Kept {
    stream: wire::Wire,
    /// Where it came from is its view's party's, but for this.
    discovery_only: bool,
    queue: Queue,
    qid: u16,
    qid_held: bool,
    auth: Option<Box<nvme::auth::controller::Transaction>>,
}

/// A connected queue between drives ([`driver::Driven::Parked`]): what outlives a drive.
/// Its view keeps who the queue is, what it was admitted to and the topology it follows (a
/// queue parked through a reload is readmitted at its next turn, as one that was not).
struct Parked {
    kept: Kept,
    carried: Carried,
    /// When it parked, and how long it had to be idle first: a host that wakes it soon
    /// makes it wait longer next time (`lifecycle::Pace::after_park`).
    parked_at: Instant,
    pace: Pace,
    /// Set for the door's deadline (an admin queue's keep-alive); None when it has none (an
    /// I/O queue's): a new one is made when the queue drives again.
    alarm: Option<Alarm>,
}

/// What a connected queue carries from drive to drive besides its driver.
struct Carried {
    role: Role,
    life: io::Life,
    view: View,
    told: Told,
}

impl Parked {
    /// Drives the queue again (`woke`: what it heard while parked) until it parks, or None
    /// once it ended (logged).
    async fn drive(
        self: Box<Self>,
        shared: &Arc<Shared>,
        woke: Option<Heard>,
    ) -> Option<Box<Parked>> {
        let Parked {
            kept,
            carried,
            parked_at,
            pace,
            alarm,
        } = *self;
        let pace = pace.after_park(parked_at.elapsed());
        let peer = carried.view.party.peer;
        let queue = Driver::resume(kept, &carried.view.party, shared);
        let alarm = match alarm.map_or_else(Alarm::new, Ok) {
            Ok(alarm) => alarm,
            Err(e) => {
                // Ended as a drive would end it, with no drive.
                let Carried { role, view, .. } = carried;
                let (completions, _) = tokio::sync::mpsc::unbounded_channel();
                let mut backend = backend_of(shared, view, role.entry(), completions);
                let result = Err(Closed::timer(e));
                end_queue(&queue, &role, &mut backend, shared, &result);
                return parked_or_closed(peer, result.map(|()| None));
            }
        };
        let drive = drive_queue(queue, carried, alarm, shared, (woke, pace));
        parked_or_closed(peer, drive.await)
    }

    /// Waits for what wakes a parked queue: its host's bytes (or its close), its alarm (the
    /// door's deadline it was set for: a keep-alive's), or word from outside. Whatever it is,
    /// the next drive finds it.
    async fn wait(&mut self) -> Option<Heard> {
        let Parked {
            kept,
            carried,
            alarm,
            ..
        } = self;
        let told = &mut carried.told;
        let socket = kept.stream.socket();
        // Polled in place (no future per source): a parked queue's task stays small.
        let mut heard = std::pin::pin!(told.heard());
        let mut byte = [0u8; 1];
        std::future::poll_fn(|cx| {
            // A peek, not the readiness alone: readiness a drive left set (its last read took
            // all there was without meeting WouldBlock) would wake the queue for nothing, and
            // each early wake makes it wait longer before it parks again.
            if socket
                .poll_peek(cx, &mut tokio::io::ReadBuf::new(&mut byte))
                .is_ready()
            {
                return Poll::Ready(None);
            }
            if alarm.as_mut().is_some_and(|a| a.poll_rung(cx).is_ready()) {
                return Poll::Ready(None);
            }
            heard.as_mut().poll(cx).map(Some)
        })
        .await
    }
}

/// Drives a connected queue until it ends (None: ended, its end counted, its connection
/// lingered) or parks: what woke it, and how long it must be idle to park.
async fn drive_queue(
    mut queue: Driver,
    carried: Carried,
    mut alarm: Alarm,
    shared: &Arc<Shared>,
    (woke, pace): (Option<Heard>, Pace),
) -> Result<Option<Box<Parked>>, Closed> {
    let (completions, mut completed) = tokio::sync::mpsc::unbounded_channel();
    let Carried {
        role,
        life,
        view,
        mut told,
    } = carried;
    let mut backend = backend_of(shared, view, role.entry(), completions);
    let mut door = Connected {
        queue: &mut queue,
        role,
        life,
        activity: seam::Activity::default(),
        scratch: (Vec::new(), Vec::new()),
    };
    let driven = driver::drive(
        &mut door,
        &mut backend,
        &mut completed,
        &mut told,
        &mut alarm,
        woke,
        pace,
    )
    .await;
    let keeps_time = door.deadline().is_some();
    let Connected { role, life, .. } = door;
    if let Ok(Driven::Parked) = driven {
        let view = backend.into_view();
        return Ok(Some(Box::new(Parked {
            kept: queue.park(),
            carried: Carried {
                role,
                life,
                view,
                told,
            },
            parked_at: Instant::now(),
            pace,
            alarm: keeps_time.then_some(alarm),
        })));
    }
    let result = driven.map(|_| ());
    end_queue(&queue, &role, &mut backend, shared, &result);
    drop(backend);
    queue.conn.linger(&mut alarm).await;
    result.map(|()| None)
}

/// A connected queue's end: its counts reported, its controller (an admin queue's) or its
/// place in one given up, logged and counted.
fn end_queue(
    queue: &Driver,
    role: &Role,
    backend: &mut Backend<'_>,
    shared: &Shared,
    result: &Result<(), Closed>,
) {
    backend.meter.report_io();
    shared.metrics.nvme_queues.dec();
    queue.end(shared, role, backend, result);
}

/// Where a queue came from, as its view's party says.
fn arrival(party: &Party, discovery_only: bool) -> connect::Arrival {
    connect::Arrival {
        peer: party.peer,
        local: party.local,
        portal_group_tag: party.portal_group_tag,
        discovery_only,
        tls: party.tls.as_deref().cloned(),
    }
}

/// The backend a connected queue runs its commands on, through `view`: its I/O and latency
/// counted as its controller's, whichever queue carried it.
fn backend_of<'s>(
    shared: &'s Arc<Shared>,
    view: View,
    entry: &ControllerEntry,
    completions: tokio::sync::mpsc::UnboundedSender<Box<Completed>>,
) -> Backend<'s> {
    let mut backend = Backend::with_view(shared, view, completions);
    backend.meter.info = entry.info.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some((_, group)) = backend.view.group() {
        let devices = Arc::clone(&group.lun_devices);
        backend.meter.count_for(&devices);
    }
    backend
}

impl Driver {
    /// The queue from its first byte to its Connect, then driven until it ends (None) or
    /// parks.
    async fn serve(
        mut self,
        shared: &Arc<Shared>,
        prelogin: crate::admission::prelogin::Ticket,
    ) -> Result<Option<Box<Parked>>, Closed> {
        let mut alarm = Alarm::new().map_err(Closed::timer)?;
        alarm
            .set(Instant::now() + prelogin.login_timeout)
            .map_err(Closed::timer)?;
        let connected = self.until_connected(shared);
        let Some(role) = driver::before_login(shared, &prelogin, &mut alarm, connected).await?
        else {
            // The Connect was refused (its answer sent).
            return Ok(None);
        };
        drop(prelogin);
        shared.metrics.nvme_queues.inc();
        let carried = Carried {
            view: self.view(shared, role.entry()),
            life: io::Life::new(matches!(role, Role::Admin(_))),
            told: told(role.entry()),
            role,
        };
        let pace = pace(&carried.role);
        drive_queue(self, carried, alarm, shared, (None, pace)).await
    }

    /// Reads and answers until a Connect was accepted (`Some`) or refused (`None`).
    async fn until_connected(&mut self, shared: &Shared) -> Result<Option<Role>, Closed> {
        loop {
            let mut ready = Vec::new();
            let mut refused = Vec::new();
            let base = self.take_pdus(&mut ready, &mut refused)?;
            self.answer_refused(&refused);
            let mut ready = ready.into_iter();
            if let Some(first) = ready.next() {
                let first = first.into_owned(self.conn.buf.since(base));
                self.conn.buf.make_room();
                let role = self.connect(shared, &first);
                // Commands pipelined behind a refused Connect, or behind an accepted one
                // before its answer could be seen: answered as out of sequence.
                for r in ready {
                    self.answer(
                        r.sqe.cid(),
                        nvme::controller::COMMAND_SEQUENCE_ERROR,
                        0,
                        &[],
                    );
                }
                self.flush().await?;
                return Ok(role);
            }
            self.flush().await?;
            self.conn.buf.fill(&mut self.conn.stream).await?;
        }
    }

    /// The first command: it must be a Connect.
    fn connect(&mut self, shared: &Shared, first: &Received) -> Option<Role> {
        let sqe = &first.sqe;
        if sqe.opcode() != nvme::sqe::FABRICS || sqe.fctype() != nvme::fabrics::fctype::CONNECT {
            self.answer(sqe.cid(), nvme::controller::COMMAND_SEQUENCE_ERROR, 0, &[]);
            shared.metrics.nvme_connect("sequence");
            return None;
        }
        let parsed = match nvme::fabrics::Connect::parse(sqe, first.data(&[])) {
            Ok(c) => c,
            Err(e) => {
                self.answer(sqe.cid(), e.status(), e.dw0(), &[]);
                shared.metrics.nvme_connect("invalid_parameters");
                return None;
            }
        };
        if shared
            .doors
            .login_blocked(self.at.peer.ip(), Instant::now())
        {
            tracing::warn!(peer = %self.at.peer, host = %parsed.hostnqn, "NVMe Connect refused: too many failed logins from this address");
            shared.metrics.limit("login_failures_max");
            self.answer(sqe.cid(), Status::CONNECT_CONTROLLER_BUSY, 0, &[]);
            shared.metrics.nvme_connect("controller_busy");
            return None;
        }
        let result = if parsed.qid == 0 {
            connect::admin(shared, &parsed, &self.at).map(|(e, k)| (Role::Admin(e), k))
        } else {
            connect::io(shared, &parsed, &self.at).map(|(e, k)| (Role::Io(e), k))
        };
        match result {
            Ok((role, keys)) => {
                let entry = role.entry();
                self.qid = parsed.qid;
                self.queue
                    .connected(parsed.sqsize, parsed.sq_flow_control_disabled());
                let must_authenticate = keys.is_some();
                self.qid_held = matches!(role, Role::Io(_)) && !must_authenticate;
                self.require_auth(shared, &parsed, keys);
                // Connect's dword 0: the controller ID, and ATR (bit 17) when the queue must
                // authenticate before anything else.
                let dw0 = u32::from(entry.cntlid) | u32::from(must_authenticate) << 17;
                self.answer(sqe.cid(), Status::SUCCESS, dw0, &[]);
                shared.metrics.nvme_connect("success");
                if let Role::Admin(entry) = &role {
                    shared.metrics.nvme_controllers.inc();
                    // Its authentication user once the admin queue has proved it.
                    self.describe(entry, None);
                    tracing::info!(peer = %self.at.peer, host = %entry.host, subsystem = entry.subsystem.as_ref().map_or(nvme::fabrics::DISCOVERY_NQN, |s| s.as_str()), cntlid = entry.cntlid, kato_ms = parsed.kato_ms, authenticate = must_authenticate, sq_flow_control = self.queue.sq_flow_control(), "NVMe controller connected");
                }
                Some(role)
            }
            Err(refused) => {
                self.answer(sqe.cid(), refused.status, refused.dw0, &[]);
                shared.metrics.nvme_connect(refused.why);
                if refused.status == Status::CONNECT_INVALID_HOST {
                    // Refused who it is: counted toward the source's failed logins.
                    shared
                        .doors
                        .record_login_failure(self.at.peer.ip(), Instant::now());
                }
                None
            }
        }
    }

    /// Starts the queue's authentication when its host must authenticate: a transaction with
    /// the host's keys and NQNs as the Connect gave them, and the deadline to finish by.
    fn require_auth(
        &mut self,
        shared: &Shared,
        parsed: &nvme::fabrics::Connect,
        keys: Option<nvme::auth::controller::Keys>,
    ) {
        let Some(keys) = keys else { return };
        let parties = nvme::auth::Parties {
            host_nqn: parsed.hostnqn.clone(),
            subsystem_nqn: parsed.subnqn.clone(),
        };
        self.auth = Some(Box::new(nvme::auth::controller::Transaction::new(
            keys,
            parties,
            shared.dhchap.clone(),
        )));
        self.auth_deadline =
            Some(Instant::now() + Duration::from_secs(shared.limits.login_timeout_s.into()));
    }

    /// What `ctl sessions` shows of a controller; `chap_user`: the DH-HMAC-CHAP user (the
    /// host NQN) its admin queue authenticated as.
    fn describe(&self, entry: &ControllerEntry, chap_user: Option<&str>) {
        let info = Arc::new(crate::admission::registry::SessionInfo {
            initiator: entry.host.to_string(),
            initiator_alias: None,
            target: entry.subsystem.as_ref().map(|s| s.to_string()),
            tsih: entry.cntlid,
            portal_group_tag: self.at.portal_group_tag,
            portal: self.at.local,
            source: self.at.peer,
            chap_user: chap_user.map(str::to_string),
            door: DoorFacts::Nvme(self.facts(entry)),
            started: std::time::SystemTime::now(),
            reads: Default::default(),
            writes: Default::default(),
            read_bytes: Default::default(),
            write_bytes: Default::default(),
            latency: Default::default(),
        });
        if let Some(ticket) = entry
            .ticket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            ticket.describe(Arc::clone(&info));
        }
        *entry.info.lock().unwrap_or_else(|e| e.into_inner()) = Some(info);
    }

    /// The controller's transport settings as `ctl sessions` shows them: its admin queue's.
    fn facts(&self, entry: &ControllerEntry) -> NvmeFacts {
        let (header_digest, data_digest) = self.queue.digests();
        NvmeFacts {
            header_digest,
            data_digest,
            kato_ms: entry.state().kato_ms(),
            max_transfer: TRANSFER_BYTES_MAX,
            in_capsule: IN_CAPSULE_BYTES,
            tls: self.at.tls.is_some(),
        }
    }

    /// The view a connected queue runs its commands through: the controller's admission,
    /// nexus and LUN map, as an iSCSI session's.
    fn view(&self, shared: &Arc<Shared>, entry: &ControllerEntry) -> View {
        let party = Party {
            door: crate::admission::Door::Nvme,
            tls: self.at.tls.clone().map(Box::new),
            admitted: entry.admitted.clone(),
            target_name: entry.subsystem.clone(),
            initiator: entry.host.clone(),
            peer: self.at.peer,
            local: self.at.local,
            portal_group_tag: self.at.portal_group_tag,
        };
        let topology = shared.topology();
        let mut view = View::new(party, &topology);
        view.nexus = entry.nexus.clone();
        if let Some((_, group)) = entry
            .admitted
            .membership()
            .and_then(|m| topology.group_of(m))
        {
            view.use_group(group);
        }
        view
    }

    /// Whether the queue may park: nothing of its host's open but the event requests its
    /// controller holds, no Abort waiting for a verdict, no command split in parts
    /// or waiting for its fused half, its authentication (if any) done, and no Disconnect.
    fn parkable(&self, role: &Role) -> bool {
        let kept = match role {
            Role::Admin(entry) => entry.state().held_requests(),
            Role::Io(_) => 0,
        };
        self.queue.open() == kept
            && self.fused.is_none()
            && self.fused_pairs.is_empty()
            && self.reports.is_empty()
            && self.synced.is_empty()
            && self.aborts_held.is_empty()
            && !self.closing
            && self.auth.as_ref().is_none_or(|a| a.authenticated())
            && self.auth_deadline.is_none()
    }

    /// A queue on `stream`, before its Connect (`queue` fresh) or resumed from its [`Kept`].
    fn new(
        stream: wire::Wire,
        at: connect::Arrival,
        queue: Queue,
        limits: &crate::config::Limits,
    ) -> Driver {
        Driver {
            conn: Conn::new(stream, largest_pdu(limits), at.peer),
            at,
            out: Vec::new(),
            queue,
            qid: 0,
            qid_held: false,
            fused: None,
            fused_pairs: Vec::new(),
            reports: Vec::new(),
            synced: Vec::new(),
            aborts_held: Vec::new(),
            closing: false,
            auth: None,
            auth_deadline: None,
            auth_chosen: None,
        }
    }

    /// What a parked queue keeps ([`Driver::parkable`]); the rest, empty, is given back.
    fn park(self) -> Kept {
        let Driver {
            conn,
            at,
            out,
            queue,
            qid,
            qid_held,
            fused,
            fused_pairs,
            reports,
            synced,
            aborts_held,
            closing,
            auth,
            auth_deadline,
            auth_chosen: _,
        } = self;
        debug_assert!(conn.out.is_empty() && conn.buf.pending().is_empty() && out.is_empty());
        debug_assert!(fused.is_none() && fused_pairs.is_empty() && reports.is_empty());
        debug_assert!(synced.is_empty() && aborts_held.is_empty() && !closing);
        debug_assert!(auth_deadline.is_none());
        Kept {
            stream: conn.stream,
            discovery_only: at.discovery_only,
            queue,
            qid,
            qid_held,
            auth,
        }
    }

    /// A parked queue driven again, from where its view says it came.
    fn resume(kept: Kept, party: &Party, shared: &Shared) -> Driver {
        let Kept {
            stream,
            discovery_only,
            queue,
            qid,
            qid_held,
            auth,
        } = kept;
        Driver {
            qid,
            qid_held,
            auth,
            ..Driver::new(
                stream,
                arrival(party, discovery_only),
                queue,
                &shared.limits,
            )
        }
    }

    /// Runs what is buffered: every whole PDU's command. Returns what the commands say of
    /// the host's pipeline.
    fn input(
        &mut self,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut io::Life,
        (ready, refused): &mut (Vec<Received>, Vec<Refused>),
    ) -> Result<seam::Activity, Closed> {
        let base = self.take_pdus(ready, refused)?;
        // Writes solicited this turn get the memory their I/O will write from, before their
        // data can arrive (their R2Ts go out with this turn's answers).
        self.queue
            .place(&mut |sqe, len| write_memory(backend, sqe, len).map(seam::DataOutBuf::Engine));
        // Refusals answered first: the activity counts what stays open.
        self.answer_refused(refused);
        refused.clear();
        let activity = activity(self.queue.take_counts(), self.queue.open());
        // The receive buffer is lent to the commands (a write's in-capsule data goes from it
        // to the device); nothing reads the socket meanwhile.
        let rbuf = self.conn.buf.lend();
        let input = &rbuf[base..self.conn.buf.end()];
        self.run_ready(role, backend, life, (ready, refused), input);
        self.conn.buf.restore(rbuf);
        self.conn.buf.make_room();
        Ok(activity)
    }

    /// Answers the commands the transport refused and runs those taken (`input`: where their
    /// in-capsule data lies, read in place, copied only to be kept); both lists end empty.
    fn run_ready(
        &mut self,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut io::Life,
        (ready, refused): (&mut Vec<Received>, &mut Vec<Refused>),
        input: &[u8],
    ) {
        self.answer_refused(refused);
        refused.clear();
        for r in ready.iter_mut() {
            self.command(role, backend, life, r, input);
        }
        ready.clear();
    }

    /// When the receive buffer ends in the first part of an H2CData PDU with a long payload
    /// for a write that is waiting for it (no digests on the queue): the PDU, whose data is
    /// then received straight into the write's memory ([`Driver::receive_h2c`]).
    fn h2c_in_place(&self) -> Option<nvme::queue::PlacedH2C> {
        let pending = self.conn.buf.pending();
        let h2c = self.queue.placed_h2c(pending, driver::IN_PLACE_MIN)?;
        // Whole already: the usual way costs nothing more.
        (pending.len() < h2c.header_len() + h2c.data_len()).then_some(h2c)
    }

    /// Receives the data of `h2c` in place (what is buffered of it copied there first), then
    /// takes the PDU and runs the write it completes, answering as a turn does. Returns
    /// whether the queue closes.
    async fn receive_h2c(
        &mut self,
        h2c: nvme::queue::PlacedH2C,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut io::Life,
        (ready, refused): &mut (Vec<Received>, Vec<Refused>),
        wait: driver::PlacedWait<'_>,
    ) -> Result<bool, Closed> {
        let out = &mut self.conn.out;
        let Some(dst) = self.queue.placed_data(&h2c, |len| recycled(out, len)) else {
            return Err(Closed::Invariant("H2CData placement out of range"));
        };
        take_bytes(&mut self.conn.out, &mut self.out);
        let next_header = nvme::pdu::PduType::H2CData.hlen();
        self.conn
            .receive_placed(dst, h2c.header_len(), 0, next_header, wait)
            .await?;
        if let Err(fatal) = self
            .queue
            .receive_placed(&h2c, &mut self.out, ready, refused)
        {
            self.terminate();
            return Err(Closed::Protocol(format!("NVMe/TCP: {fatal:?}")));
        }
        backend.meter.turn_started = Instant::now();
        self.run_ready(role, backend, life, (ready, refused), &[]);
        backend.meter.finish_turn();
        self.conn.placed(!self.queue.awaits_data(1));
        if self.closing {
            self.flush().await?;
        }
        Ok(self.closing)
    }

    /// Where the next read into the receive buffer stops. While a write waits for a long
    /// payload, a read ends with the next PDU's header (with nothing buffered, the header
    /// alone; in the middle of a long PDU, its rest and the header after it), so the payload
    /// behind it can go straight into place ([`Driver::receive_h2c`]) instead of being copied;
    /// the read that ends a payload in place brings the next header with it
    /// ([`driver::read_placed`]). Otherwise reads fill the buffer.
    fn read_end(&self) -> usize {
        let buf = &self.conn.buf;
        let full = buf.capacity();
        if !self.queue.awaits_data(driver::IN_PLACE_MIN) {
            return full;
        }
        let header = nvme::pdu::PduType::H2CData.hlen();
        let pending = buf.pending();
        let stop = if pending.len() < nvme::pdu::CH_LEN {
            buf.start() + header
        } else {
            match self.queue.next_len(pending) {
                len if len >= driver::IN_PLACE_MIN => buf.start() + len + header,
                _ => return full,
            }
        };
        buf.stop_at(stop)
    }

    /// When [`Driver::tick`] next has something to decide: the authentication deadline, and
    /// for an admin queue the keep-alive's (a discovery controller without keep-alive: its
    /// idle limit).
    fn deadline(&self, role: &Role, life: &io::Life) -> Option<Instant> {
        let admin = match role {
            Role::Admin(entry) if entry.subsystem.is_none() => life
                .keep_alive_deadline(KEEP_ALIVE_SLACK)
                .or_else(|| life.idle_deadline(DISCOVERY_IDLE)),
            Role::Admin(_) => life.keep_alive_deadline(KEEP_ALIVE_SLACK),
            Role::Io(_) => None,
        };
        let admin = match (admin, self.abort_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match (self.auth_deadline, admin) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Once its deadline passed: the authentication deadline, and for an admin queue the
    /// keep-alive. `Some` when the queue ends.
    fn tick(
        &mut self,
        role: &Role,
        backend: &mut Backend<'_>,
        life: &mut io::Life,
        now: Instant,
    ) -> Option<Ended> {
        let peer = self.at.peer;
        if self.auth_deadline.is_some_and(|d| now >= d) {
            tracing::warn!(%peer, host = %role.entry().host, "NVMe queue closed: not authenticated within login_timeout_s");
            backend.shared.metrics.limit("login_timeout_s");
            return Some(Ended::NotAuthenticated);
        }
        let Role::Admin(entry) = role else {
            return None;
        };
        self.aborts_late(entry, now);
        if life.keep_alive_late(now, KEEP_ALIVE_SLACK) {
            tracing::warn!(%peer, host = %entry.host, cntlid = entry.cntlid, kato_ms = entry.state().kato_ms(), "NVMe controller ended: no Keep Alive within its timeout");
            backend.shared.metrics.limit("nvme_keep_alive");
            return Some(Ended::KeepAliveTimeout);
        }
        if entry.subsystem.is_none() && life.idle_without_keep_alive(now, DISCOVERY_IDLE) {
            tracing::info!(%peer, host = %entry.host, cntlid = entry.cntlid, "NVMe discovery controller closed: idle for {} s without keep-alive", DISCOVERY_IDLE.as_secs());
            backend.shared.metrics.limit("nvme_discovery_idle");
            return Some(Ended::DiscoveryIdle);
        }
        None
    }

    /// Takes every whole PDU buffered; a PDU the transport refuses ends the connection (its
    /// termination request sent first). Returns where the input began in `rbuf`: the commands'
    /// in-capsule data stays there until [`Driver::make_room`].
    fn take_pdus(
        &mut self,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) -> Result<usize, Closed> {
        let base = self.conn.buf.start();
        match self
            .queue
            .receive(self.conn.buf.pending(), &mut self.out, ready, refused)
        {
            Ok(used) => {
                self.conn.buf.consume(used);
                Ok(base)
            }
            Err(fatal) => {
                self.terminate();
                Err(Closed::Protocol(format!("NVMe/TCP: {fatal:?}")))
            }
        }
    }

    /// Sends what is queued, the termination request last, as far as the socket takes it
    /// without waiting: the connection closes next.
    fn terminate(&mut self) {
        let conn = &mut self.conn;
        take_bytes(&mut conn.out, &mut self.out);
        let _ = conn.stream.try_write(&conn.out.to_vec());
    }

    fn answer_refused(&mut self, refused: &[Refused]) {
        for r in refused {
            self.answer(r.cid, r.status, 0, &[]);
        }
    }

    /// Queues command `cid`'s answer: `data` for the host, then its completion.
    fn answer(&mut self, cid: u16, status: Status, dw0: u32, data: &[u8]) {
        self.answer_parts(cid, status, dw0, &[data]);
    }

    /// As [`Driver::answer`], the data in parts.
    fn answer_parts(&mut self, cid: u16, status: Status, dw0: u32, parts: &[&[u8]]) {
        let cqe = self.cqe(cid, status, dw0);
        let parts = if status.is_success() { parts } else { &[] };
        self.queue.answer_parts(&cqe, parts, &mut self.out);
    }

    /// As [`Driver::answer`], the data the outbox holds as `payload` (its first `len`
    /// bytes), sent from where it lies.
    fn answer_queued(&mut self, cid: u16, status: Status, payload: Option<usize>, len: usize) {
        let cqe = self.cqe(cid, status, 0);
        let Some(payload) = payload.filter(|_| status.is_success() && len > 0) else {
            return self.queue.answer(&cqe, &[], &mut self.out);
        };
        let mut data = Queued {
            outbox: &mut self.conn.out,
            payload,
            len,
        };
        self.queue.answer_with(&cqe, &mut data, &mut self.out);
    }

    fn cqe(&mut self, cid: u16, status: Status, dw0: u32) -> Cqe {
        Cqe {
            dw0,
            dw1: 0,
            sqhd: self.queue.next_sqhd(),
            sqid: self.qid,
            cid,
            status,
        }
    }

    async fn flush(&mut self) -> Result<(), Closed> {
        take_bytes(&mut self.conn.out, &mut self.out);
        self.conn.flush().await
    }

    /// A queue's end: a controller's admin queue takes the controller with it (its I/O queues
    /// close, its nexus leaves its LUs); an I/O queue gives its queue ID back.
    fn end(
        &self,
        shared: &Shared,
        role: &Role,
        backend: &Backend<'_>,
        result: &Result<(), Closed>,
    ) {
        let entry = role.entry();
        if self
            .auth
            .as_ref()
            .is_some_and(|a| !a.authenticated() && a.failed().is_none())
        {
            // Closed before it authenticated (a failure was counted when it failed): counted
            // toward the source's failed logins too, so no host can make the controller run
            // exchanges it never finishes, over and over.
            shared.metrics.nvme_auth("abandoned");
            shared
                .doors
                .record_login_failure(self.at.peer.ip(), Instant::now());
        }
        let reason = Closed::reason(result, backend.close_reason, "disconnected");
        match role {
            Role::Io(entry) if self.qid_held => entry.remove_io_queue(self.qid),
            Role::Io(_) => {}
            Role::Admin(entry) => {
                shared
                    .nvme
                    .remove(entry.cntlid, "the controller's admin queue closed");
                shared.metrics.nvme_controllers.dec();
                if let (Some(luns), Some(nexus)) = (&backend.view.luns, &entry.nexus) {
                    for e in luns.entries() {
                        e.lu.nexus_lost(nexus.id);
                    }
                }
                tracing::info!(peer = %self.at.peer, host = %entry.host, cntlid = entry.cntlid, reason, "NVMe controller closed");
            }
        }
        let _ = entry;
    }
}

/// Memory for the data of a write solicited with an R2T: the aligned buffer of a direct-I/O
/// namespace's ring write (`Backend::data_out_memory`), so the H2CData lands where the device
/// writes from. Only a Write: other commands' data is rebuilt in SCSI's layout.
/// A buffer of `len` bytes from the connection's pool, its old bytes kept (the write's data
/// overwrites every one before it runs): zero-filling it would be a pass over each byte more.
fn recycled(out: &mut Outbox, len: usize) -> Vec<u8> {
    let mut buf = out.take_scratch();
    if buf.len() >= len {
        buf.truncate(len);
    } else {
        buf.resize(len, 0);
    }
    buf
}

fn write_memory(
    backend: &mut Backend<'_>,
    sqe: &nvme::sqe::Sqe,
    len: usize,
) -> Option<Box<dyn seam::DataOutMemory>> {
    if sqe.opcode() != nvme::nvm::opcode::WRITE {
        return None;
    }
    let lun = view::lun_of(sqe.nsid())?;
    backend.view.luns.as_ref()?.get(lun)?;
    backend.data_out_memory(scsi::lun_to_wire(lun), len)
}

/// What a turn's input says of the host's pipeline, in the terms the worker's busy poll and
/// the receive coalescer judge an iSCSI turn by: the command capsules and their bytes, the
/// data PDUs (as iSCSI's Data-Out), how many commands were still in the target when they came,
/// and the host's backlog. NVMe/TCP has no acknowledgement of answers (iSCSI's ExpStatSN), so
/// the backlog is what the host had sent without waiting: the commands still in the target,
/// or those that came together less the one it may have waited for (0 for a host that waits
/// for each answer).
fn activity(taken: nvme::queue::Taken, open_now: usize) -> seam::Activity {
    let earlier = (open_now as u32).saturating_sub(taken.capsules);
    let together = taken.capsules.saturating_sub(1);
    seam::Activity {
        commands: taken.capsules,
        command_bytes: taken.capsule_bytes,
        other_pdus: taken.data_pdus,
        initiator_backlog: earlier.max(together),
        in_flight: earlier,
    }
}

/// Moves the bytes the queue encoded into the outbox, behind what it holds.
fn take_bytes(outbox: &mut Outbox, out: &mut Vec<u8>) {
    if !out.is_empty() {
        outbox.push_bytes(out);
        out.clear();
    }
}

/// An answer's data that the outbox holds (lent store memory, a file range, a read buffer):
/// each C2HData PDU's range is queued after its header, from where the data lies.
struct Queued<'a> {
    outbox: &'a mut Outbox,
    payload: usize,
    len: usize,
}

impl nvme::queue::DataSink for Queued<'_> {
    fn data_len(&self) -> usize {
        self.len
    }

    fn data(&mut self, out: &mut Vec<u8>, range: std::ops::Range<usize>, digest: bool) -> u32 {
        take_bytes(self.outbox, out);
        let mut crc = 0;
        if digest {
            // Never a file payload: a queue with data digests does not take file ranges.
            debug_assert!(!self.outbox.is_file_payload(self.payload));
            self.outbox
                .for_each_payload_piece(self.payload, range.clone(), |piece| {
                    crc = crc32c::crc32c_append(crc, piece);
                });
        }
        self.outbox.push_payload(self.payload, range);
        crc
    }
}

/// What closes a connected queue from outside: its controller's end (for an I/O queue, the
/// admin queue's), and `ctl session close` through the controller's registry entry.
fn told(entry: &ControllerEntry) -> Told {
    let told = Told::by(entry.kill.subscribe(), Some("controller gone"));
    let ticket = entry.ticket.lock().unwrap_or_else(|e| e.into_inner());
    match ticket.as_ref() {
        Some(t) => told.and(t.kill.clone(), None),
        None => told,
    }
}

/// A connected queue: the driver's door.
struct Connected<'q> {
    queue: &'q mut Driver,
    role: Role,
    life: io::Life,
    /// What the last turn's commands said of the host's pipeline.
    activity: seam::Activity,
    /// A turn's commands and refusals (their Vecs kept for the next turn).
    scratch: (Vec<Received>, Vec<Refused>),
}

impl Door for Connected<'_> {
    /// NVMe/TCP has no logout to ask for: the host reconnects through its other paths.
    const CAN_ASK_TO_LEAVE: bool = false;

    fn conn(&mut self) -> &mut Conn {
        &mut self.queue.conn
    }

    fn input(&mut self, backend: &mut Backend<'_>) -> Result<Turn, Closed> {
        let (role, life, scratch) = (&self.role, &mut self.life, &mut self.scratch);
        self.activity = self.queue.input(role, backend, life, scratch)?;
        Ok(Turn {
            close: self.queue.closing,
            drained: true,
        })
    }

    fn answered(&mut self, backend: &mut Backend<'_>) -> bool {
        let mut answered = std::mem::take(&mut backend.answered);
        for done in answered.drain(..) {
            self.queue.complete(backend, done);
        }
        backend.answered = answered;
        self.queue.closing
    }

    fn completed(&mut self, backend: &mut Backend<'_>, done: Completed) -> bool {
        self.queue.complete(backend, done);
        self.queue.closing
    }

    /// Never called: no NVMe command waits on a task management function's drain (an Abort
    /// is answered at once).
    fn task_done(&mut self, _tag: u32) -> bool {
        false
    }

    fn take_activity(&mut self) -> seam::Activity {
        std::mem::take(&mut self.activity)
    }

    fn stage(&mut self) {
        take_bytes(&mut self.queue.conn.out, &mut self.queue.out);
    }

    async fn between_turns(
        &mut self,
        backend: &mut Backend<'_>,
        wait: driver::PlacedWait<'_>,
    ) -> Result<Option<bool>, Closed> {
        let Some(h2c) = self.queue.h2c_in_place() else {
            return Ok(None);
        };
        let (role, life, scratch) = (&self.role, &mut self.life, &mut self.scratch);
        self.queue
            .receive_h2c(h2c, role, backend, life, scratch, wait)
            .await
            .map(Some)
    }

    fn read_stop(&mut self) -> usize {
        self.queue.read_end()
    }

    fn holds_answers(&self) -> bool {
        self.queue.conn.may_hold() && self.queue.h2c_in_place().is_some()
    }

    fn deadline(&self) -> Option<Instant> {
        self.queue.deadline(&self.role, &self.life)
    }

    fn tick(&mut self, backend: &mut Backend<'_>, now: Instant, _congested: bool) -> Option<Ended> {
        self.queue.tick(&self.role, backend, &mut self.life, now)
    }

    /// An admin queue tells its host of the changes it asked to hear of (ANA, namespace
    /// attributes) as asynchronous events, and answers the Aborts its I/O queues decided; an
    /// I/O queue decides the Aborts of its commands.
    fn look(&mut self, backend: &mut Backend<'_>) {
        match &self.role {
            Role::Admin(entry) => {
                self.queue.notices(entry, backend, &mut self.life);
                self.queue.aborts_found(entry);
            }
            Role::Io(entry) => self.queue.aborts_of_this_queue(entry),
        }
    }

    fn quiescent(&self) -> bool {
        self.queue.queue.open() == 0
    }

    fn parkable(&self) -> bool {
        self.queue.parkable(&self.role)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queues_limits_follow_the_daemons_within_the_transports_rules() {
        let mut limits = crate::config::Limits::default();
        let q = queue_limits(&limits);
        assert_eq!(q.maxh2cdata % 4, 0, "MAXH2CDATA is a multiple of 4");
        assert_eq!(q.maxh2cdata, limits.max_recv_data_segment_length & !3);
        assert!(
            q.solicited_max >= TRANSFER_BYTES_MAX,
            "one largest write fits"
        );
        // A tiny PDU limit still leaves the transport's minimum; a tiny memory budget still
        // lets one largest write be solicited.
        limits.max_recv_data_segment_length = 1001;
        limits.memory_per_connection_bytes = 1024;
        let q = queue_limits(&limits);
        assert_eq!(q.maxh2cdata, 4096);
        assert_eq!(q.solicited_max, TRANSFER_BYTES_MAX);
        assert_eq!(q.transfer_max, TRANSFER_BYTES_MAX);
    }

    #[test]
    fn a_turns_activity_tells_a_waiting_host_from_a_pipelining_one_and_counts_data_apart() {
        let taken = |capsules, data_pdus| nvme::queue::Taken {
            capsules,
            capsule_bytes: u64::from(capsules) * 72,
            data_pdus,
        };
        // One command, nothing else in the target: a host that waits for each answer.
        let a = activity(taken(1, 0), 1);
        assert_eq!((a.commands, a.initiator_backlog, a.in_flight), (1, 0, 0));
        // Eight that came together, or one while seven are running: a pipeline.
        assert_eq!(activity(taken(8, 0), 8).initiator_backlog, 7);
        let a = activity(taken(1, 0), 8);
        assert_eq!((a.initiator_backlog, a.in_flight), (7, 7));
        // A write's data is not a command: iSCSI's Data-Out counts the same way.
        let a = activity(taken(0, 4), 3);
        assert_eq!((a.commands, a.other_pdus, a.command_bytes), (0, 4, 0));
    }

    /// A queue's driver on one end of a loopback connection (the host's end returned).
    fn queue(rt: &tokio::runtime::Runtime) -> (Driver, std::net::TcpStream) {
        let (target, client, peer) = crate::dataplane::testing::loopback(rt);
        let limits = crate::config::Limits::default();
        let at = connect::Arrival {
            peer,
            local: peer,
            portal_group_tag: 1,
            discovery_only: false,
            tls: None,
        };
        let queue = Queue::new(queue_limits(&limits));
        let driver = Driver {
            qid: 1,
            ..Driver::new(wire::Wire::Plain(target), at, queue, &limits)
        };
        (driver, client)
    }

    #[test]
    fn while_a_write_waits_for_long_data_reads_stop_at_each_header_so_it_lands_in_place() {
        let rt = crate::dataplane::testing::runtime();
        let (mut d, _host) = queue(&rt);
        let mut host = nvme::host::HostQueue::new();
        let mut bytes = Vec::new();
        host.icreq((false, false), &mut bytes);
        let (mut ready, mut refused) = (Vec::new(), Vec::new());
        d.queue
            .receive(&bytes, &mut d.out, &mut ready, &mut refused)
            .unwrap();
        assert!(d.queue.initialized());
        assert_eq!(
            d.read_end(),
            d.conn.buf.capacity(),
            "nothing awaited: full reads"
        );
        // A 128 KiB write: solicited with an R2T, its data still to come.
        let mut sqe = nvme::sqe::Sqe([0; nvme::sqe::SQE_LEN]);
        sqe.0[0] = nvme::nvm::opcode::WRITE;
        let mut capsule = Vec::new();
        host.submit(sqe, vec![5; 128 * 1024], 0, &mut capsule);
        d.queue
            .receive(&capsule, &mut d.out, &mut ready, &mut refused)
            .unwrap();
        assert!(
            ready.is_empty() && refused.is_empty(),
            "waiting for its data"
        );
        let header = nvme::pdu::PduType::H2CData.hlen();
        assert_eq!(
            d.read_end(),
            header,
            "nothing buffered: the next header alone"
        );
        assert!(d.h2c_in_place().is_none(), "no header yet");
    }
}
