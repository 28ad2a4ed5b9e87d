//! The iSCSI door's connection: login, then the session as the one connection driver's
//! [`Door`] (`driver.rs` decides the connection's life; this file, what iSCSI PDUs do). Owned
//! by one worker thread for its whole life (no hand-off per command). Each turn parses every
//! complete PDU the read returned, runs them, and sends all responses with one vectored write.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use iscsi::login::{Established, Login, LoginStatus, LoginStep};
use iscsi::pdu::{self, FrameError, Framing, Opcode};
use iscsi::session::{Flow, Session};
use tokio::net::TcpStream;

use crate::dataplane::alarm::Alarm;

use super::backend::{Backend, Completed};
use super::closed::{Closed, Ended};
use super::driver::{self, Conn, Door, Told, Turn, TURN_BYTES_MAX};
use super::iscsi_backend::{deliver, deliver_answered, facts};
use super::lifecycle::Lifecycle;
use super::login::{
    initial_stat_sn, logged_in, login_limits, new_session, nexus_of, target_shown, LoggedIn, Policy,
};
use super::view::Party;
use super::wire::Wire;

use crate::admission::doors::ConnectionGuard;
use crate::admission::Admitted;
use crate::config::NodeName;
use crate::shared::Shared;
use crate::topology::Topology;

/// A connection the acceptor admitted and gave to this worker.
pub use crate::topology::portals::ListenerKind;

pub struct NewConnection {
    pub stream: std::net::TcpStream,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub portal_group_tag: u16,
    /// What the listener it came in on serves.
    pub kind: ListenerKind,
    pub guard: ConnectionGuard,
    /// Its place among the connections still logging in, given up once it logged in.
    pub prelogin: crate::admission::prelogin::Ticket,
}

/// Largest AHS a PDU may carry (TotalAHSLength is one byte of 4-byte words).
const AHS_BYTES_MAX: usize = 255 * 4;
use super::driver::IN_PLACE_MIN;

/// Where a connection came in.
struct At {
    peer: SocketAddr,
    local: SocketAddr,
    portal_group_tag: u16,
}

pub async fn serve(shared: Arc<Shared>, conn: NewConnection) {
    let NewConnection {
        stream,
        peer,
        local,
        portal_group_tag,
        guard,
        prelogin,
        ..
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
    let conn = Conn::new(Wire::Plain(stream), largest_pdu(&shared.limits), peer);
    let at = At {
        peer,
        local,
        portal_group_tag,
    };
    if let Err(reason) = run(&shared, conn, &at, prelogin, peer_only).await {
        tracing::debug!(%peer, "connection closed: {reason}");
    }
}

/// The largest PDU the target takes: a header, the largest AHS, a header digest, the
/// largest data segment and its digest.
fn largest_pdu(limits: &crate::config::Limits) -> usize {
    pdu::BHS_LEN + AHS_BYTES_MAX + 4 + limits.max_recv_data_segment_length as usize + 8
}

async fn run(
    shared: &Arc<Shared>,
    mut conn: Conn,
    at: &At,
    prelogin: crate::admission::prelogin::Ticket,
    peer_only: bool,
) -> Result<(), Closed> {
    // The connection's one timer: the login deadline now, its other deadlines later.
    let mut alarm = Alarm::new().map_err(Closed::timer)?;
    let Some(logged_in) = login(shared, &mut conn, at, prelogin, peer_only, &mut alarm).await?
    else {
        return Ok(());
    };
    let LoggedIn {
        established,
        ticket,
        topology,
        membership,
        admitted,
    } = logged_in;
    let (completions, mut completed) = tokio::sync::mpsc::unbounded_channel();
    let mut backend = backend(shared, at, &topology, admitted, &established, completions);
    if let Some((t, group)) = membership.and_then(|m| topology.group_of(m)) {
        if let Some(port) = t.ports.get(&at.portal_group_tag).cloned() {
            let nexus = nexus_of(&established, t, group, port);
            backend.view.join(nexus, group);
            backend.use_group(group);
        }
    }
    // The backend follows the topologies from here; holding the login's would keep every
    // device it had open (a removed device's store, an RBD image's lock) for the
    // session's life.
    drop(topology);
    let info = session_info(at, &established);
    log_established(at, &established);
    ticket.describe(Arc::clone(&info));
    backend.meter.info = Some(info);
    let established_at = Instant::now();
    let sessions = shared
        .metrics
        .sessions_of(established.target_name.as_ref().map(|t| t.as_str()));
    sessions.inc();
    let mut door = IscsiDoor {
        conn,
        session: new_session(&established, &shared.limits),
        last_pdu_long: false,
    };
    let mut told = Told::by(ticket.kill.clone(), Some("registry gone"));
    let result = driver::drive(
        &mut door,
        &mut backend,
        &mut completed,
        &mut told,
        &mut alarm,
        None,
        super::lifecycle::Pace::every(super::lifecycle::HOUSEKEEPING),
    )
    .await
    .and_then(|driven| match driven {
        driver::Driven::Ended => Ok(()),
        driver::Driven::Parked => Err(Closed::Invariant("an iSCSI session parked")),
    });
    end_session(at, &mut backend, &established, established_at, &result);
    drop(ticket);
    // Nothing of the array is held while the connection lingers (a removed device's store,
    // an RBD image's lock).
    drop(backend);
    door.conn.linger(&mut alarm).await;
    result
}

/// The login phase, to its end: `None` when the login failed (its response was sent).
async fn login(
    shared: &Arc<Shared>,
    conn: &mut Conn,
    at: &At,
    prelogin: crate::admission::prelogin::Ticket,
    peer_only: bool,
    alarm: &mut Alarm,
) -> Result<Option<LoggedIn>, Closed> {
    let mut policy = Policy {
        shared,
        portal_group_tag: at.portal_group_tag,
        peer: at.peer,
        ticket: None,
        peer_only,
        admitted: None,
    };
    let (login_limits, target_limits) = login_limits(&shared.limits);
    let mut login = Login::new(login_limits, target_limits, initial_stat_sn());
    alarm
        .set(Instant::now() + prelogin.login_timeout)
        .map_err(Closed::timer)?;
    let established = loop {
        let next = async {
            let step = next_login_step(conn, &mut login, &mut policy).await;
            if let Err(closed) = &step {
                login_abandoned(shared, at, &login, closed);
            }
            step
        };
        let step = driver::before_login(shared, &prelogin, alarm, next).await?;
        // Count and log before the response goes out, so anyone who saw it sees the count.
        match &step {
            LoginStep::Continue => {}
            LoginStep::Failed(status) => {
                let result = format!("{:02x}{:02x}", status.class, status.detail);
                shared.metrics.login(result);
                login_failed(shared, at, &login, *status);
            }
            LoginStep::Complete(_) => shared.metrics.login("success".into()),
        }
        conn.flush().await?;
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

/// The backend of a session admitted as `admitted` under `topology` (its nexus and LUN map
/// are set next).
fn backend<'s>(
    shared: &'s Arc<Shared>,
    at: &At,
    topology: &Arc<Topology>,
    admitted: Admitted,
    established: &Established,
    completions: tokio::sync::mpsc::UnboundedSender<Box<Completed>>,
) -> Backend<'s> {
    let party = Party {
        door: crate::admission::Door::Iscsi,
        tls: None,
        admitted,
        target_name: established.target_name.clone(),
        initiator: established.initiator_name.clone(),
        peer: at.peer,
        local: at.local,
        portal_group_tag: at.portal_group_tag,
    };
    Backend::new(shared, topology, party, completions)
}

fn session_info(
    at: &At,
    established: &Established,
) -> Arc<crate::admission::registry::SessionInfo> {
    Arc::new(crate::admission::registry::SessionInfo {
        initiator: established.initiator_name.to_string(),
        initiator_alias: established.initiator_alias.clone(),
        target: established.target_name.as_ref().map(|t| t.to_string()),
        tsih: established.tsih,
        portal_group_tag: at.portal_group_tag,
        portal: at.local,
        source: at.peer,
        chap_user: established.chap_user.clone(),
        door: facts(established),
        started: std::time::SystemTime::now(),
        reads: Default::default(),
        writes: Default::default(),
        read_bytes: Default::default(),
        write_bytes: Default::default(),
        latency: Default::default(),
    })
}

fn log_established(at: &At, established: &Established) {
    tracing::info!(
        peer = %at.peer,
        initiator = %established.initiator_name,
        target = target_shown(established),
        tsih = established.tsih,
        chap_user = established.chap_user.as_deref().unwrap_or("(none)"),
        "session established"
    );
}

/// A session's end: its counts reported, its nexus gone from its LUs, its close logged.
fn end_session(
    at: &At,
    backend: &mut Backend<'_>,
    established: &Established,
    established_at: Instant,
    result: &Result<(), Closed>,
) {
    backend.meter.report_io();
    backend
        .shared
        .metrics
        .sessions_of(established.target_name.as_ref().map(|t| t.as_str()))
        .dec();
    if let (Some(luns), Some(nexus)) = (&backend.view.luns, &backend.view.nexus) {
        for entry in luns.entries() {
            entry.lu.nexus_lost(nexus.id);
        }
    }
    let reason = Closed::reason(result, backend.close_reason, "logout or connection closed");
    tracing::info!(
        peer = %at.peer,
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
fn login_failed(shared: &Shared, at: &At, login: &Login, status: LoginStatus) {
    let initiator = login.initiator_name().map_or("(unnamed)", NodeName::as_str);
    let target = login.target_name().map_or("(discovery)", NodeName::as_str);
    let counted = status == LoginStatus::AUTH_FAILED || status == LoginStatus::FORBIDDEN;
    match login.auth_failure() {
        Some(reason) => tracing::warn!(
            peer = %at.peer,
            initiator,
            target,
            "login failed: {status}: {reason}"
        ),
        None if counted => {
            tracing::warn!(peer = %at.peer, initiator, target, "login failed: {status}")
        }
        None => {
            tracing::info!(peer = %at.peer, initiator, target, "login failed: {status}")
        }
    }
    if counted {
        shared
            .doors
            .record_login_failure(at.peer.ip(), Instant::now());
    }
}

/// A login the initiator ended before it completed. Right after the target's answer to a
/// mutual CHAP challenge, that is how an initiator refuses the target (open-iscsi logs
/// only on its side): said here, so the operator can find the mismatched secret.
fn login_abandoned(shared: &Shared, at: &At, login: &Login, closed: &Closed) {
    if !login.proved_itself() {
        return;
    }
    let initiator = login.initiator_name().map_or("(unnamed)", NodeName::as_str);
    let target = login.target_name().map_or("(discovery)", NodeName::as_str);
    tracing::warn!(
        peer = %at.peer,
        initiator,
        target,
        "login ended by the initiator right after the target's mutual CHAP answer ({closed}): it most likely does not accept the target's secret (the target's `mutual` secret must be the initiator's secret for the target, open-iscsi's password_in)"
    );
    shared.metrics.login("mutual_chap_refused".into());
}

/// Reads until one login PDU is complete and handles it.
async fn next_login_step(
    conn: &mut Conn,
    login: &mut Login,
    policy: &mut Policy<'_>,
) -> Result<LoginStep, Closed> {
    let framing = login.framing();
    loop {
        match pdu::frame_len(conn.buf.pending(), &framing) {
            Ok(Some(len)) => {
                let frame = &conn.buf.pending()[..len];
                let pdu = pdu::parse_frame(frame, &framing)
                    .map_err(|(e, _)| Closed::Protocol(e.to_string()))?;
                let mut bytes = Vec::new();
                let step = login.handle(&pdu, policy, &mut bytes);
                conn.buf.consume(len);
                conn.out.push_bytes(&bytes);
                return Ok(step);
            }
            Ok(None) => conn.buf.fill(&mut conn.stream).await?,
            Err(e) => return Err(Closed::Protocol(format!("bad login PDU: {e}"))),
        }
    }
}

/// A logged-in iSCSI session: the driver's door.
struct IscsiDoor {
    conn: Conn,
    session: Session,
    /// Whether the last PDU handled carried a long data segment: reads then stop at the next
    /// header, so that a long payload behind it can be received in place.
    last_pdu_long: bool,
}

impl Door for IscsiDoor {
    const CAN_ASK_TO_LEAVE: bool = true;

    fn conn(&mut self) -> &mut Conn {
        &mut self.conn
    }

    /// Handles the complete PDUs in the buffer, stopping early once a turn's responses reach
    /// `TURN_BYTES_MAX` or the backend is congested, so memory stays bounded.
    fn input(&mut self, backend: &mut Backend<'_>) -> Result<Turn, Closed> {
        let now = backend.meter.turn_started;
        let framing: Framing = self.session.framing();
        let more = |close| Turn {
            close,
            drained: false,
        };
        let done = |close| Turn {
            close,
            drained: true,
        };
        loop {
            if backend.congested() {
                return Ok(more(false));
            }
            let available = self.conn.buf.pending();
            let len = match pdu::frame_len(available, &framing) {
                Ok(Some(len)) => len,
                Ok(None) => return Ok(done(false)),
                Err(e @ FrameError::DataSegmentTooLong { .. }) => {
                    return Err(Closed::Protocol(format!("protocol error: {e}")));
                }
                Err(e) => return Err(Closed::Protocol(e.to_string())),
            };
            let frame = &available[..len];
            self.last_pdu_long = len >= in_place_min(available) + pdu::BHS_LEN;
            let out = &mut self.conn.out;
            let flow = match pdu::parse_frame(frame, &framing) {
                Ok(pdu) => self.session.handle(&pdu, now, backend, out),
                Err((FrameError::DataDigest, Some(bhs))) => {
                    self.session.data_digest_error(&bhs, out)
                }
                Err((e, _)) => return Err(Closed::Protocol(format!("protocol error: {e}"))),
            };
            self.conn.buf.consume(len);
            if flow == Flow::Close {
                return Ok(done(true));
            }
            if self.conn.out.len() >= TURN_BYTES_MAX {
                return Ok(more(false));
            }
        }
    }

    fn answered(&mut self, backend: &mut Backend<'_>) -> bool {
        deliver_answered(&mut self.session, backend, &mut self.conn.out)
    }

    fn completed(&mut self, backend: &mut Backend<'_>, done: Completed) -> bool {
        deliver(&mut self.session, backend, &mut self.conn.out, done)
    }

    fn task_done(&mut self, tag: u32) -> bool {
        let complete = seam::tmf_response::COMPLETE;
        self.session
            .task_management_done(tag, complete, &mut self.conn.out)
            == Flow::Close
    }

    fn take_activity(&mut self) -> seam::Activity {
        self.session.take_activity()
    }

    async fn between_turns(
        &mut self,
        backend: &mut Backend<'_>,
        wait: driver::PlacedWait<'_>,
    ) -> Result<Option<bool>, Closed> {
        let placed = self.receive_in_place(backend, wait).await?;
        Ok(placed.map(|flow| flow == Flow::Close))
    }

    fn read_stop(&mut self) -> usize {
        self.read_end()
    }

    fn holds_answers(&self) -> bool {
        self.conn.may_hold() && self.long_payload_next().is_some()
    }

    fn deadline(&self) -> Option<Instant> {
        self.session.next_deadline()
    }

    /// The session's pings and its verdict on a silent initiator.
    fn tick(&mut self, backend: &mut Backend<'_>, now: Instant, congested: bool) -> Option<Ended> {
        let verdict = self.session.tick(now, !congested, &mut self.conn.out);
        let close = Lifecycle::verdict(verdict)?;
        let peer = self.conn.peer;
        match close {
            Ended::Idle => {
                tracing::info!(%peer, "closing idle session (idle_timeout_s)");
                backend.shared.metrics.limit("idle_timeout_s");
            }
            _ => tracing::warn!(%peer, "closing dead connection (no answer to NOP-In)"),
        }
        Some(close)
    }

    fn ask_to_leave(&mut self, within: u16) {
        self.session.request_logout(within, &mut self.conn.out);
    }

    fn quiescent(&self) -> bool {
        self.session.outstanding() == 0
    }
}

impl IscsiDoor {
    /// When the receive buffer ends in the first part of a PDU with a long payload that the
    /// session takes in place — a Data-Out, or a write's SCSI Command with immediate data (no
    /// digests on the connection) — receives the rest of the payload straight into the
    /// command's Data-Out buffer (the bytes already here are copied there) and hands the PDU
    /// over: the receive buffer never holds it whole, and the session does not copy it again.
    /// None when this does not apply: the PDU takes the usual way.
    async fn receive_in_place(
        &mut self,
        backend: &mut Backend<'_>,
        wait: driver::PlacedWait<'_>,
    ) -> Result<Option<Flow>, Closed> {
        let Some((bhs, len)) = self.long_payload_next() else {
            return Ok(None);
        };
        let session = &mut self.session;
        let opcode = Opcode::from_initiator(bhs.opcode_raw());
        let dst = match opcode {
            Some(Opcode::DataOut) => session.data_out_destination(&bhs),
            Some(Opcode::ScsiCommand) => {
                session.command_data_destination(&bhs, backend, &mut self.conn.out)
            }
            _ => None,
        };
        let Some(dst) = dst else {
            return Ok(None);
        };
        let Some(dst) = dst.get_mut(..len) else {
            return Err(Closed::Protocol("Data-Out placement out of range".into()));
        };
        let pad = pdu::padded(len) - len;
        self.conn
            .receive_placed(dst, pdu::BHS_LEN, pad, pdu::BHS_LEN, wait)
            .await?;
        let now = Instant::now();
        backend.meter.turn_started = now;
        let flow = if opcode == Some(Opcode::DataOut) {
            session.handle_placed_data_out(&bhs, now, backend, &mut self.conn.out)
        } else {
            session.handle_placed_command(now, backend, &mut self.conn.out)
        };
        self.last_pdu_long = true;
        backend.meter.finish_turn();
        self.conn.placed(!self.session.awaits_data_out(1));
        if flow == Flow::Close {
            self.conn.flush().await?;
        }
        Ok(Some(flow))
    }

    /// The header of the PDU the receive buffer begins with and its data segment's length,
    /// when the PDU may be one to receive in place: a long
    /// payload, still arriving, without additional headers. Whether the session takes it in
    /// place is the session's question ([`IscsiDoor::receive_in_place`]).
    fn long_payload_next(&self) -> Option<(pdu::Bhs, usize)> {
        let available = self.conn.buf.pending();
        let header = available.get(..pdu::BHS_LEN)?;
        let bhs = pdu::Bhs(<[u8; pdu::BHS_LEN]>::try_from(header).ok()?);
        let len = bhs.data_segment_len();
        let have = available.len() - pdu::BHS_LEN;
        let long =
            (in_place_min(header)..=self.session.framing().max_data_segment_len).contains(&len);
        (bhs.total_ahs_len() == 0 && long && have < len).then_some((bhs, len))
    }

    /// Where the next read into the buffer stops. When a long PDU is likely next — a write
    /// awaits its Data-Out, or the last PDU was long (a stream of large writes: commands with
    /// immediate data, then their Data-Out) — a read ends with the next PDU's header: with
    /// nothing buffered, the header alone; in the middle of a long PDU, that PDU's rest and the
    /// header after it. A long write payload then goes straight into place
    /// ([`IscsiDoor::receive_in_place`]) instead of arriving in this buffer whole and being copied
    /// out of it, and the read that ends a payload in place brings the next header with it
    /// ([`driver::read_placed`]). Otherwise (short PDUs) reads fill the buffer.
    fn read_end(&self) -> usize {
        let buf = &self.conn.buf;
        let full = buf.capacity();
        if !self.last_pdu_long && !self.session.awaits_data_out(IN_PLACE_MIN) {
            return full;
        }
        let buffered = buf.pending();
        let stop = if buffered.is_empty() {
            buf.end() + pdu::BHS_LEN
        } else {
            match pdu::declared_frame_len(buffered, &self.session.framing()) {
                Ok(None) => buf.start() + pdu::BHS_LEN,
                Ok(Some(len)) if len >= in_place_min(buffered) + pdu::BHS_LEN => {
                    buf.start() + len + pdu::BHS_LEN
                }
                _ => return full,
            }
        };
        buf.stop_at(stop)
    }
}

/// The shortest data segment received in place for the PDU whose header `bhs` begins with: a
/// Data-Out's, or the immediate data of a write whose Data-Out follows, from [`IN_PLACE_MIN`];
/// immediate data that is all of its write only past 64 KiB (the default FirstBurstLength), as
/// NVMe/TCP's in-capsule data (64 KiB at most) never is. Such a write then arrives with the
/// commands around it in one read and is copied, which costs less than reads of its own: 64 KiB
/// writes at QD16 made 1.44x the IOPS at 0.78 of the CPU per write, 256 KiB and 1 MiB writes
/// level (`ab-2026-12-06-0823.txt`).
fn in_place_min(header: &[u8]) -> usize {
    let Some(bhs) = header
        .get(..pdu::BHS_LEN)
        .and_then(|h| <[u8; pdu::BHS_LEN]>::try_from(h).ok())
        .map(pdu::Bhs)
    else {
        return IMMEDIATE_IN_PLACE_MIN;
    };
    let data_out_follows = || bhs.u32_at(pdu::off::EDTL) as usize > bhs.data_segment_len();
    match Opcode::from_initiator(bhs.opcode_raw()) {
        Some(Opcode::DataOut) => IN_PLACE_MIN,
        Some(Opcode::ScsiCommand) if data_out_follows() => IN_PLACE_MIN,
        _ => IMMEDIATE_IN_PLACE_MIN,
    }
}

/// See [`in_place_min`].
const IMMEDIATE_IN_PLACE_MIN: usize = 64 * 1024 + 1;

#[cfg(test)]
mod tests {

    use super::*;

    /// Immediate data that is all of its write arrives through the receive buffer up to 64
    /// KiB; a Data-Out, or immediate data with Data-Out behind it, in place from 64 KiB.
    #[test]
    fn immediate_data_is_received_in_place_only_when_long_or_data_out_follows() {
        let header = |opcode: Opcode, dsl: u32, edtl: u32| {
            let mut b = pdu::Bhs::new(opcode);
            b.set_data_segment_len(dsl as usize);
            b.set_u32(pdu::off::EDTL, edtl);
            b.0
        };
        const K64: u32 = 64 * 1024;
        assert_eq!(in_place_min(&header(Opcode::DataOut, K64, 0)), IN_PLACE_MIN);
        let whole = header(Opcode::ScsiCommand, K64, K64);
        assert_eq!(in_place_min(&whole), K64 as usize + 1);
        let more = header(Opcode::ScsiCommand, K64, 1 << 20);
        assert_eq!(in_place_min(&more), IN_PLACE_MIN);
        assert_eq!(
            in_place_min(&[]),
            K64 as usize + 1,
            "no header: not in place"
        );
    }
    use crate::dataplane::recv::RecvBuf;
    use crate::dataplane::testing::{loopback, runtime};

    /// A logged-in session's door on one end of a loopback connection (the other end kept).
    fn door(rt: &tokio::runtime::Runtime) -> (IscsiDoor, std::net::TcpStream) {
        let (target, client, peer) = loopback(rt);
        let wire = Wire::Plain(target);
        let limits = crate::config::Limits::default();
        let established = super::super::login::established_for_test(&limits);
        let door = IscsiDoor {
            conn: Conn::new(wire, largest_pdu(&limits), peer),
            session: new_session(&established, &limits),
            last_pdu_long: false,
        };
        (door, client)
    }

    /// A Data-Out header announcing `len` bytes of data.
    fn data_out_header(len: usize) -> [u8; pdu::BHS_LEN] {
        let mut bhs = [0u8; pdu::BHS_LEN];
        bhs[0] = Opcode::DataOut as u8;
        bhs[5..8].copy_from_slice(&(len as u32).to_be_bytes()[1..]);
        bhs
    }

    fn buffered(buf: &mut RecvBuf, bytes: &[u8]) {
        let full = buf.capacity();
        buf.tail(full).unwrap()[..bytes.len()].copy_from_slice(bytes);
        buf.received(bytes.len());
    }

    #[test]
    fn after_a_long_pdu_reads_stop_at_the_next_header_and_otherwise_fill_the_buffer() {
        let rt = runtime();
        let (mut door, _client) = door(&rt);
        // A busy connection's buffer: grown by a read that filled it.
        let idle = door.conn.buf.capacity();
        buffered(&mut door.conn.buf, &vec![0; idle]);
        door.conn.buf.consume(idle);
        door.conn.buf.make_room();
        let full = door.conn.buf.capacity();
        assert!(full > 200_000);
        assert_eq!(door.read_end(), full, "short PDUs: batched reads");
        door.last_pdu_long = true;
        assert_eq!(
            door.read_end(),
            pdu::BHS_LEN,
            "nothing buffered: the header alone"
        );
        buffered(&mut door.conn.buf, &[0; 10]);
        assert_eq!(
            door.read_end(),
            pdu::BHS_LEN,
            "a partial header: the rest of it"
        );
        door.conn.buf.consume(10);
        door.conn.buf.make_room();
        let long = 100_000;
        buffered(&mut door.conn.buf, &data_out_header(long));
        let stop = door.read_end();
        assert_eq!(
            stop,
            (pdu::BHS_LEN + long) + pdu::BHS_LEN,
            "its rest and the next header"
        );
        door.conn.buf.consume(pdu::BHS_LEN);
        buffered(&mut door.conn.buf, &data_out_header(512));
        assert_eq!(
            door.read_end(),
            door.conn.buf.capacity(),
            "a short one next: a full read"
        );
        assert!(door.quiescent(), "nothing outstanding");
    }

    #[test]
    fn answers_wait_only_for_a_long_payload_already_arriving_and_never_past_the_bound() {
        let rt = runtime();
        let (mut door, _client) = door(&rt);
        door.conn.placed(true);
        assert!(
            !door.holds_answers(),
            "nothing buffered: the answers go now"
        );
        buffered(&mut door.conn.buf, &data_out_header(512));
        assert!(
            !door.holds_answers(),
            "a short PDU next: no payload to wait for"
        );
        door.conn.buf.clear();
        buffered(&mut door.conn.buf, &data_out_header(IN_PLACE_MIN));
        assert!(
            door.holds_answers(),
            "a long payload arriving: they wait for its answer"
        );
        door.conn.placed(false);
        assert!(
            !door.holds_answers(),
            "a write expects data: its R2T is never held"
        );
        rt.block_on(door.conn.flush()).unwrap();
        for _ in 1..driver::HELD_ANSWERS_MAX {
            door.conn.placed(true);
        }
        assert!(door.holds_answers());
        door.conn.placed(true);
        assert!(!door.holds_answers(), "a burst's worth held: they go");
    }

    #[test]
    fn the_receive_buffer_holds_two_of_the_largest_pdus_the_target_takes() {
        let limits = crate::config::Limits::default();
        let largest = largest_pdu(&limits);
        assert!(largest > limits.max_recv_data_segment_length as usize + pdu::BHS_LEN);
        let mut buf = RecvBuf::new(largest);
        let idle = buf.capacity();
        buffered(&mut buf, &vec![0; idle]);
        assert!(buf.capacity() >= 2 * largest);
    }
}
