//! One connection from accept to close: login, then full feature phase. Owned by one worker
//! thread for its whole life (no hand-off per command). Each turn parses every complete PDU the
//! read returned, runs them, and sends all responses with one vectored write.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iscsi::login::{Established, Login, LoginStatus, LoginStep};
use iscsi::pdu::{self, FrameError, Framing, Opcode};
use iscsi::session::{Flow, Session};
use rustix::net::RecvFlags;
use seam::outbox::Outbox;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::dataplane::alarm::Alarm;

use super::backend::{first_drained, ring_ready, Backend, Completed, Party};
use super::closed::{Closed, Ended};
use super::iscsi_backend::{deliver, deliver_answered, facts};
use super::login::{
    initial_stat_sn, logged_in, login_limits, new_session, nexus_of, target_shown, LoggedIn, Policy,
};
use super::wakeups::Wakeups;
use super::RBUF_IDLE;

use super::lifecycle::{Lifecycle, Shutdown};
use crate::admission::doors::ConnectionGuard;
use crate::admission::registry::SessionTicket;
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
/// Responses queued in one turn before they are sent (bounds Data-In memory per connection).
const TURN_BYTES_MAX: usize = 4 << 20;
/// Write payloads (Data-Out, or a command's immediate data) at least this long that are still
/// arriving are received straight into the command's buffer instead of through the receive
/// buffer (one copy fewer per byte written).
const IN_PLACE_MIN: usize = 64 * 1024;

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
        let rbuf_full = (frame_max * 2).max(super::RBUF_BUSY);
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
                backend.nexus = Some(nexus_of(&established, t, group, port));
                for entry in group.luns.entries() {
                    backend.nexus_joins(&entry.lu);
                }
                backend.use_group(group);
            }
        }
        // The backend follows the topologies from here; holding the login's would keep every
        // device it had open (a removed device's store, an RBD image's lock) for the
        // session's life.
        drop(topology);
        let info = self.session_info(&established);
        self.log_established(&established);
        ticket.describe(Arc::clone(&info));
        backend.info = Some(info);
        let established_at = Instant::now();
        let mut session = new_session(&established, &shared.limits);
        let sessions = shared
            .metrics
            .sessions_of(established.target_name.as_ref().map(|t| t.as_str()));
        sessions.inc();
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
                step = self.next_login_step(&mut login, &mut policy) => {
                    step.inspect_err(|closed| self.login_abandoned(shared, &login, closed))?
                }
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
        let party = Party {
            door: crate::admission::Door::Iscsi,
            tls: None,
            admitted,
            target_name: established.target_name.clone(),
            initiator: established.initiator_name.clone(),
            peer: self.peer,
            local: self.local,
            portal_group_tag: self.portal_group_tag,
        };
        Backend::new(shared, topology, party, completions)
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
            portal_group_tag: self.portal_group_tag,
            portal: self.local,
            source: self.peer,
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
        backend
            .shared
            .metrics
            .sessions_of(established.target_name.as_ref().map(|t| t.as_str()))
            .dec();
        if let (Some(luns), Some(nexus)) = (&backend.luns, &backend.nexus) {
            for entry in luns.entries() {
                entry.lu.nexus_lost(nexus.id);
            }
        }
        let reason = Closed::reason(result, backend.close_reason, "logout or connection closed");
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
        let initiator = login.initiator_name().map_or("(unnamed)", NodeName::as_str);
        let target = login.target_name().map_or("(discovery)", NodeName::as_str);
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

    /// A login the initiator ended before it completed. Right after the target's answer to a
    /// mutual CHAP challenge, that is how an initiator refuses the target (open-iscsi logs
    /// only on its side): said here, so the operator can find the mismatched secret.
    fn login_abandoned(&self, shared: &Shared, login: &Login, closed: &Closed) {
        if !login.proved_itself() {
            return;
        }
        let initiator = login.initiator_name().map_or("(unnamed)", NodeName::as_str);
        let target = login.target_name().map_or("(discovery)", NodeName::as_str);
        tracing::warn!(
            peer = %self.peer,
            initiator,
            target,
            "login ended by the initiator right after the target's mutual CHAP answer ({closed}): it most likely does not accept the target's secret (the target's `mutual` secret must be the initiator's secret for the target, open-iscsi's password_in)"
        );
        shared.metrics.login("mutual_chap_refused".into());
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
                    backend.close_reason = Some(Ended::Told(reason));
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
                Ended::Idle => {
                    tracing::info!(peer = %self.peer, "closing idle session (idle_timeout_s)");
                    backend.shared.metrics.limit("idle_timeout_s");
                }
                _ => {
                    tracing::warn!(peer = %self.peer, "closing dead connection (no answer to NOP-In)")
                }
            }
            backend.close_reason = Some(close);
            return Ok(false);
        }
        if !backend.still_admitted() {
            return Ok(false);
        }
        if backend.lost_an_image() {
            // A command this session holds could be stale (docs/RBD.md); the initiator logs in
            // again and its new session ships to the new owner.
            tracing::warn!(peer = %self.peer, "closing the session: this gateway lost an RBD image it maps (log in again to reach the new owner)");
            backend.close_reason = Some(Ended::LostImage);
            return Ok(false);
        }
        // Shutdown is noticed here, within a second: a flag read once a second costs nothing,
        // where a wake-up channel shared by every connection would be polled (and locked) on
        // every turn.
        let grace_s = backend.shared.limits.shutdown_grace_s;
        // A portal a reload removed ends its sessions as a shutdown ends them all.
        let why = if backend.portal_gone {
            "its portal was removed"
        } else {
            "shutting down"
        };
        let ending = backend.shared.is_shutting_down() || backend.portal_gone;
        match life.shutdown(Instant::now(), ending) {
            Shutdown::Nothing => Ok(true),
            Shutdown::AskLogout(within) => {
                session.request_logout(within, &mut self.out);
                self.flush().await?;
                tracing::info!(peer = %self.peer, "{why}: asked the initiator to log out within {grace_s} s");
                Ok(true)
            }
            Shutdown::Close(close) => {
                match close {
                    Ended::NoLogout => {
                        tracing::warn!(peer = %self.peer, "{why}: no logout within {grace_s} s; closing the session")
                    }
                    _ => tracing::info!(peer = %self.peer, "{why}: closing the session"),
                }
                backend.close_reason = Some(close);
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
        let itt = wait.tag;
        // The LUs take commands again (before the answer goes out).
        drop(wait);
        let flow = session.task_management_done(itt, seam::tmf_response::COMPLETE, &mut self.out);
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
        if !backend.still_admitted() {
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

    /// Reads the rest of a placed PDU's payload into `dst` (its first `have` bytes are there),
    /// then its padding. A sender that stops mid-PDU is dropped within `stall`, the dead-peer
    /// bound of the usual path (a ping, then its timeout), which cannot run while this waits.
    /// The alarm stays set for the connection's next deadline (no system call when the payload
    /// arrives in time); should it ring meanwhile, it is set for the stall bound instead.
    async fn read_placed(
        &mut self,
        dst: &mut [u8],
        have: usize,
        len: usize,
        alarm: &mut Alarm,
        stall: Duration,
    ) -> Result<(), Closed> {
        let stalled_at = Instant::now() + stall;
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
        Ok(())
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
        let limits = &backend.shared.limits;
        let stall = u64::from(limits.nop_in_interval_s) + u64::from(limits.nop_in_timeout_s.max(5));
        self.read_placed(dst, have, len, alarm, Duration::from_secs(stall))
            .await?;
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

    /// Sends everything queued (dataplane/send.rs, the one way both doors send).
    async fn flush(&mut self) -> Result<(), Closed> {
        super::send::send(&mut self.stream, &mut self.out, self.peer).await
    }
}

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
