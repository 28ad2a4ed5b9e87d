//! Full feature phase of one connection (= one session: MaxConnections=1, ERL 0).
//!
//! Input: one received PDU at a time (borrowing the receive buffer) plus the current time.
//! Output: response PDUs appended to an [`Outbox`], SCSI work handed synchronously to a
//! [`ScsiBackend`], and a [`Flow`] telling the engine whether to keep the connection.
//!
//! Commands are delivered in CmdSN order; out-of-order commands inside the window wait (bounded),
//! commands outside it are dropped silently (RFC 7143 §4.2.2.1). Writes collect their data
//! (immediate, unsolicited, solicited by R2T) into one buffer and run once complete; a write whose
//! data arrived whole in the command PDU runs straight from the receive buffer.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use seam::name::NodeName;
use seam::outbox::Outbox;
use seam::{
    status, tmf_response, Activity, DataOutBuf, DeferredCommand, Execution, Liveness, Loan,
    ScsiBackend, ScsiOutcome, ScsiRequest, TmfAnswer, TmfFunction,
};

use crate::negotiation::{SessionParams, SessionType};
use crate::pdu::{self, off, Bhs, Framing, Opcode, Pdu, RejectReason, RESERVED_TAG};
use crate::serial;
use crate::text;

/// The backend as an iSCSI session needs it: the seam's, and SendTargets.
pub trait IscsiBackend: ScsiBackend {
    /// Targets this initiator may see; `filter` is None for SendTargets=All.
    fn send_targets(&mut self, filter: Option<&str>) -> Vec<DiscoveredTarget>;
}

/// The task management function an iSCSI TMF Request's function code names (RFC 7143
/// §11.5.1).
pub fn tmf_function(code: u8) -> Option<TmfFunction> {
    Some(match code {
        1 => TmfFunction::AbortTask,
        2 => TmfFunction::AbortTaskSet,
        3 => TmfFunction::ClearAca,
        4 => TmfFunction::ClearTaskSet,
        5 => TmfFunction::LogicalUnitReset,
        6 => TmfFunction::TargetWarmReset,
        7 => TmfFunction::TargetColdReset,
        8 => TmfFunction::TaskReassign,
        _ => return None,
    })
}

/// A SCSI Command's immediate data: where it is.
enum Immediate<'a> {
    /// In the receive buffer (the PDU's data segment).
    Received(&'a [u8]),
    /// Received straight into the first `len` bytes of a buffer for the whole write.
    Placed { buf: DataOutBuf, len: usize },
}

impl Immediate<'_> {
    fn len(&self) -> usize {
        match self {
            Immediate::Received(data) => data.len(),
            Immediate::Placed { len, .. } => *len,
        }
    }

    /// Gives a placed buffer the command did not take back to the pool.
    fn recycle(self, out: &mut Outbox) {
        if let Immediate::Placed { buf, .. } = self {
            buf.recycle(out);
        }
    }
}

/// Why a SCSI Command is refused before it runs, and so how it is answered.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    Reject(RejectReason),
    /// Status TASK SET FULL.
    TaskSetFull,
    /// CHECK CONDITION, ILLEGAL REQUEST, INVALID FIELD IN CDB.
    InvalidField,
}

/// A TMF whose response waits until the commands it aborted can no longer reach the medium.
#[derive(Debug)]
struct PendingTmf {
    itt: u32,
    response: u8,
    /// This session's aborted tasks still running elsewhere.
    awaiting_tasks: Vec<u32>,
    /// The backend has not yet called [`Session::task_management_done`].
    awaiting_backend: bool,
    /// TARGET COLD RESET: the connection closes once the response is out.
    close: bool,
}

/// TMFs waiting for their aborted tasks at once; beyond it a TMF is answered "function
/// rejected" (initiators send one at a time).
const PENDING_TMFS_MAX: usize = 16;

/// A target as SendTargets reports it: name and `address:port,tpgt` strings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredTarget {
    pub name: String,
    pub addresses: Vec<String>,
}

/// Whether a Data-Out PDU is accepted, and where its data goes.
enum DataOutTarget {
    Accept {
        index: usize,
        start: usize,
    },
    /// Unsolicited data for a task no longer pending: ignored.
    Drop,
    /// Solicited data for an unknown task: Reject.
    UnknownTask,
    /// Wrong offset, DataSN, TTT or length for pending task `index`: the task fails.
    Bad {
        index: usize,
    },
}

/// What became of a running task that finished.
enum Settled {
    /// No such task (answered or dropped already).
    Unknown,
    /// It was aborted: no answer.
    Aborted,
    Answer(RunningTask),
}

/// A finished command's Data-In: bytes the backend built or copied, or what the store lent.
enum DataIn<'a> {
    Bytes(Vec<u8>),
    Lent(&'a mut Loan),
}

/// What the engine should do with the connection after this input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Send what is queued, then close (logout, fatal protocol error, cold reset, dead peer).
    Close,
}

/// Session limits enforced by the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLimits {
    /// The CmdSN window (commands the initiator may have outstanding).
    pub queue_depth: u32,
    /// Largest write (EDTL) accepted; larger ones get CHECK CONDITION.
    pub max_write_bytes: u32,
    /// Bytes of write data buffered across pending writes.
    pub max_pending_write_bytes: usize,
    /// Silence after which a NOP-In ping goes out; zero = never ping.
    pub nop_interval: Duration,
    pub nop_timeout: Duration,
    /// No command (nor NOP-Out of its own) from the initiator for this long ends the session;
    /// zero = never.
    pub idle_timeout: Duration,
    pub max_text_bytes: usize,
    pub max_keys: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            queue_depth: 128,
            max_write_bytes: 64 * 1024 * 1024,
            max_pending_write_bytes: 64 * 1024 * 1024,
            nop_interval: Duration::from_secs(5),
            nop_timeout: Duration::from_secs(30),
            idle_timeout: Duration::ZERO,
            max_text_bytes: 64 * 1024,
            max_keys: 64,
        }
    }
}

#[derive(Debug)]
struct R2tState {
    ttt: u32,
    offset: u32,
    len: u32,
    received: u32,
    next_data_sn: u32,
}

/// A write waiting for its data.
#[derive(Debug)]
struct PendingWrite {
    itt: u32,
    lun: [u8; 8],
    cdb: Vec<u8>,
    task_attr: u8,
    buf: DataOutBuf,
    edtl: u32,
    /// Unsolicited region end (immediate + unsolicited Data-Out), and how far it has arrived.
    unsolicited_end: u32,
    unsolicited_received: u32,
    unsolicited_next_data_sn: u32,
    /// Next offset to solicit with an R2T.
    solicit_next: u32,
    r2ts: Vec<R2tState>,
    next_r2t_sn: u32,
    received: u32,
}

/// A command the backend is running elsewhere.
#[derive(Debug)]
struct RunningTask {
    itt: u32,
    lun: [u8; 8],
    expected_len: u32,
    read: bool,
    /// Aborted by a TMF while running: its completion sends nothing (RFC 7143 §11.5.1).
    aborted: bool,
}

#[derive(Debug)]
struct TextContinuation {
    ttt: u32,
    remaining: Vec<u8>,
}

/// While commands run, how often the idle timeout looks again (a running command is not
/// idleness; its end is not an event the clock sees).
pub const BUSY_RECHECK: Duration = Duration::from_secs(1);

pub struct Session {
    kind: SessionType,
    initiator_name: NodeName,
    params: SessionParams,
    limits: SessionLimits,
    framing: Framing,
    stat_sn: u32,
    exp_cmd_sn: u32,
    pending: Vec<PendingWrite>,
    pending_write_bytes: usize,
    /// Out-of-order commands inside the window: (CmdSN, the PDU's bytes).
    out_of_order: Vec<(u32, Vec<u8>)>,
    /// Commands the backend is running elsewhere.
    running: Vec<RunningTask>,
    /// The highest MaxCmdSN granted so far: the window may shrink as tasks pile up, but MaxCmdSN
    /// never goes back (RFC 7143 §4.2.2.1).
    max_cmd_sn_granted: u32,
    next_ttt: u32,
    text_in: Vec<u8>,
    text_out: Option<TextContinuation>,
    last_rx: Instant,
    /// Last PDU the initiator sent of its own accord (not an answer to our NOP-In ping).
    last_activity: Instant,
    ping: Option<Ping>,
    data_in_buf: Vec<u8>,
    /// Reused for the lent slices of zero-copy reads (the outbox takes them, the capacity stays).
    lent_buf: Loan,
    sense_buf: Vec<u8>,
    logged_out: bool,
    activity: Activity,
    /// TMFs answered once their aborted tasks are done.
    tmfs: Vec<PendingTmf>,
    /// A SCSI Command whose immediate data the engine is receiving in place.
    staged: Option<(Bhs, DataOutBuf)>,
}

/// A NOP-In ping waiting for its NOP-Out.
#[derive(Debug, Clone, Copy)]
struct Ping {
    ttt: u32,
    sent: Instant,
    /// Not answered within `nop_interval`: its timeout is the next deadline.
    late: bool,
}

impl Ping {
    fn sent(ttt: u32, sent: Instant) -> Ping {
        Ping {
            ttt,
            sent,
            late: false,
        }
    }
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: SessionType,
        initiator_name: NodeName,
        params: SessionParams,
        limits: SessionLimits,
        next_stat_sn: u32,
        exp_cmd_sn: u32,
        now: Instant,
    ) -> Session {
        let framing = Framing {
            header_digest: params.header_digest,
            data_digest: params.data_digest,
            max_data_segment_len: params.max_recv_data_segment_length as usize,
        };
        Session {
            kind,
            initiator_name,
            params,
            limits,
            framing,
            stat_sn: next_stat_sn,
            exp_cmd_sn,
            pending: Vec::new(),
            pending_write_bytes: 0,
            out_of_order: Vec::new(),
            running: Vec::new(),
            max_cmd_sn_granted: exp_cmd_sn.wrapping_add(limits.queue_depth.max(1) - 1),
            next_ttt: 1,
            text_in: Vec::new(),
            text_out: None,
            last_rx: now,
            last_activity: now,
            ping: None,
            data_in_buf: Vec::new(),
            lent_buf: Loan::default(),
            sense_buf: Vec::with_capacity(256),
            logged_out: false,
            activity: Activity::default(),
            tmfs: Vec::new(),
            staged: None,
        }
    }

    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// The activity since the last call (see [`Activity`]), resetting it.
    pub fn take_activity(&mut self) -> Activity {
        std::mem::take(&mut self.activity)
    }

    fn note_activity(&mut self, opcode: Option<Opcode>, pdu: &Pdu<'_>, data_len: usize) {
        if opcode != Some(Opcode::ScsiCommand) {
            self.activity.other_pdus = self.activity.other_pdus.saturating_add(1);
            return;
        }
        let bytes = pdu::BHS_LEN + pdu.ahs.len() + data_len;
        self.activity.commands = self.activity.commands.saturating_add(1);
        self.activity.command_bytes = self.activity.command_bytes.saturating_add(bytes as u64);
        // ExpStatSN is the initiator's word, so it is bounded: one "ahead" of our StatSN, or
        // further behind than the window allows, counts as no backlog / a full window.
        let exp_stat_sn = pdu.bhs.u32_at(off::EXP_STAT_SN);
        let backlog = if serial::lt(self.stat_sn, exp_stat_sn) {
            0
        } else {
            self.stat_sn
                .wrapping_sub(exp_stat_sn)
                .min(self.limits.queue_depth)
        };
        self.activity.initiator_backlog = self.activity.initiator_backlog.max(backlog);
        let in_flight = u32::try_from(self.pending.len() + self.running.len()).unwrap_or(u32::MAX);
        self.activity.in_flight = self.activity.in_flight.max(in_flight);
    }

    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    pub fn exp_cmd_sn(&self) -> u32 {
        self.exp_cmd_sn
    }

    /// The end of the command window as last granted to the initiator.
    pub fn max_cmd_sn(&self) -> u32 {
        self.max_cmd_sn_granted
    }

    /// Commands running elsewhere (deferred by the backend).
    pub fn running_tasks(&self) -> usize {
        self.running.len()
    }

    /// Commands the initiator sent that are not answered yet: waiting for their data, or
    /// running elsewhere.
    pub fn outstanding(&self) -> usize {
        self.pending.len() + self.running.len()
    }

    /// The window to advertise now: the queue depth minus tasks still outstanding (pending data or
    /// running elsewhere), so a slow backend throttles the initiator instead of queueing without
    /// bound. Never below what was granted before.
    fn grant_window(&mut self) -> u32 {
        let outstanding = (self.pending.len() + self.running.len()) as u32;
        let slots = self.limits.queue_depth.max(1).saturating_sub(outstanding);
        // slots == 0 closes the window: MaxCmdSN = ExpCmdSN - 1.
        let candidate = self.exp_cmd_sn.wrapping_add(slots).wrapping_sub(1);
        let before = self.max_cmd_sn_granted;
        if serial::lt(self.max_cmd_sn_granted, candidate) {
            self.max_cmd_sn_granted = candidate;
        }
        debug_assert!(
            !serial::lt(self.max_cmd_sn_granted, before),
            "MaxCmdSN never goes backwards"
        );
        self.max_cmd_sn_granted
    }

    /// The session's invariants, checked in debug builds (and by the fuzz targets) after each
    /// input (PDU, completion, TMF answer): the write-memory count is the sum of its parts, outstanding tasks
    /// stay within the queue depth, waiting TMFs within their bound.
    fn check_invariants(&self) {
        debug_assert_eq!(
            self.pending_write_bytes,
            self.pending.iter().map(|p| p.edtl as usize).sum::<usize>(),
            "pending write bytes are the sum of the pending writes"
        );
        debug_assert!(
            self.pending.len() + self.running.len() <= self.limits.queue_depth.max(1) as usize,
            "{} pending + {} running tasks exceed the queue depth {}",
            self.pending.len(),
            self.running.len(),
            self.limits.queue_depth
        );
        debug_assert!(self.tmfs.len() <= PENDING_TMFS_MAX);
        debug_assert!(self.out_of_order.len() <= self.limits.queue_depth as usize);
    }

    /// How long the initiator has sent nothing of its own accord (answers to our pings do not
    /// count): what `idle_timeout_s` is measured against.
    pub fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_activity)
    }

    /// Writes waiting for data (for metrics and tests).
    pub fn pending_writes(&self) -> usize {
        self.pending.len()
    }

    /// Whether some write still waits for at least `min_bytes` of Data-Out that could be
    /// received in place: an engine that does so reads the next PDU's header alone then, so the
    /// payload behind it is not read into the shared receive buffer first. Never with digests
    /// on, as for [`Session::data_out_destination`].
    pub fn awaits_data_out(&self, min_bytes: usize) -> bool {
        !self.framing.header_digest
            && !self.framing.data_digest
            && self
                .pending
                .iter()
                .any(|t| t.edtl.saturating_sub(t.received) as usize >= min_bytes)
    }

    /// A frame that failed its data digest: Reject it by header (RFC 7143 §7.8) and fail the
    /// connection, since at ERL 0 the lost data cannot be recovered.
    pub fn data_digest_error(&mut self, bhs: &Bhs, out: &mut Outbox) -> Flow {
        self.reject(bhs, RejectReason::DataDigestError, out);
        Flow::Close
    }

    /// When [`Session::tick`] next has something to decide: a ping due on a silent
    /// connection, an unanswered ping's timeout, the idle timeout (looked at again every
    /// [`BUSY_RECHECK`] while work is outstanding, which is not idleness). None: nothing until
    /// the initiator sends. Moves later as PDUs arrive; calling `tick` early is harmless.
    pub fn next_deadline(&self) -> Option<Instant> {
        let ping = match self.ping {
            Some(p) if self.last_rx <= p.sent && p.late => Some(p.sent + self.limits.nop_timeout),
            // Where the next ping falls if this one is answered by then: the alarm armed for
            // it stays armed through a prompt answer.
            Some(p) if self.last_rx <= p.sent => {
                Some(p.sent + self.limits.nop_interval.min(self.limits.nop_timeout))
            }
            Some(_) => None,
            None if self.limits.nop_interval.is_zero() => None,
            None => Some(self.last_rx + self.limits.nop_interval),
        };
        let idle = match self.limits.idle_timeout {
            t if t.is_zero() => None,
            _ if self.running_tasks() > 0 || !self.pending.is_empty() => {
                Some(self.last_activity + BUSY_RECHECK)
            }
            t => Some(self.last_activity + t),
        };
        match (ping, idle) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// NOP-In pings on silent connections, and the verdicts on dead and idle ones, once
    /// [`Session::next_deadline`] passed.
    /// `reading`: false while the connection itself stops reading (its memory budget is full,
    /// so TCP holds the initiator back). Silence then proves nothing: no ping is sent, no
    /// verdict given, and the clocks start afresh once it reads again.
    pub fn tick(&mut self, now: Instant, reading: bool, out: &mut Outbox) -> Liveness {
        // Work outstanding (commands running, or unread ones held back) is not idleness.
        if !reading || self.running_tasks() > 0 || !self.pending.is_empty() {
            self.last_activity = now;
        }
        if !reading {
            self.last_rx = now;
            if let Some(p) = &mut self.ping {
                *p = Ping::sent(p.ttt, now);
            }
            return Liveness::Continue;
        }
        if let Some(p) = &mut self.ping {
            if self.last_rx <= p.sent {
                let waited = now.saturating_duration_since(p.sent);
                if waited >= self.limits.nop_timeout {
                    return Liveness::DeadPeer;
                }
                // Not answered within an interval: its timeout is the next deadline.
                p.late |= waited >= self.limits.nop_interval;
            }
        }
        if !self.limits.idle_timeout.is_zero() && self.idle_for(now) >= self.limits.idle_timeout {
            return Liveness::Idle;
        }
        if self.ping.is_none()
            && !self.limits.nop_interval.is_zero()
            && now.saturating_duration_since(self.last_rx) >= self.limits.nop_interval
        {
            let ttt = self.alloc_ttt();
            let mut bhs = Bhs::new(Opcode::NopIn);
            bhs.set_flags(0x80);
            bhs.set_itt(RESERVED_TAG);
            bhs.set_u32(off::TTT, ttt);
            self.stamp(&mut bhs, false);
            self.push_pdu(out, &bhs, &[]);
            self.ping = Some(Ping::sent(ttt, now));
        }
        Liveness::Continue
    }

    /// Asks the initiator to log out within `within_s` seconds (Async Message, AsyncEvent 1,
    /// RFC 7143 §11.9.1): sent when the target is shutting down, so the initiator logs out
    /// cleanly once its commands are answered and logs in again later (libiscsi and open-iscsi
    /// both reconnect after such a logout). Commands keep being served meanwhile.
    pub fn request_logout(&mut self, within_s: u16, out: &mut Outbox) {
        let mut bhs = Bhs::new(Opcode::AsyncMessage);
        bhs.set_flags(0x80);
        bhs.set_itt(RESERVED_TAG);
        // Status-bearing: consumes a StatSN like any other response.
        self.stamp(&mut bhs, true);
        bhs.set_byte(off::ASYNC_EVENT, ASYNC_EVENT_REQUEST_LOGOUT);
        bhs.set_u16(off::PARAMETER3, within_s); // the time the initiator has to log out
        self.push_pdu(out, &bhs, &[]);
    }

    /// Handles one PDU received in full feature phase.
    pub fn handle(
        &mut self,
        pdu: &Pdu<'_>,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let flow = self.handle_pdu(pdu, now, backend, out);
        self.check_invariants();
        flow
    }

    fn handle_pdu(
        &mut self,
        pdu: &Pdu<'_>,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        if let Some(flow) = self.arrived(pdu, pdu.data.len(), now) {
            return flow;
        }
        let bhs = &pdu.bhs;
        let Some(opcode) = Opcode::from_initiator(bhs.opcode_raw()) else {
            self.reject(bhs, RejectReason::CommandNotSupported, out);
            return Flow::Continue;
        };
        match opcode {
            // Data-Out and SNACK carry no CmdSN.
            Opcode::DataOut => return self.data_out(pdu, backend, out),
            Opcode::SnackRequest => {
                self.reject(bhs, RejectReason::SnackReject, out);
                return Flow::Continue;
            }
            Opcode::LoginRequest => {
                self.reject(bhs, RejectReason::ProtocolError, out);
                return Flow::Continue;
            }
            _ => {}
        }
        // A NOP-Out answering our ping (ITT reserved) is not a command.
        if opcode == Opcode::NopOut && bhs.itt() == RESERVED_TAG {
            if self.ping.is_some_and(|p| bhs.u32_at(off::TTT) == p.ttt) {
                self.ping = None;
            }
            return Flow::Continue;
        }
        let cmd_sn = bhs.u32_at(off::CMD_SN);
        if bhs.immediate() {
            return self.dispatch(opcode, pdu, backend, out);
        }
        if cmd_sn == self.exp_cmd_sn && serial::le(cmd_sn, self.max_cmd_sn_granted) {
            return self.in_order(now, backend, out, |s, backend, out| {
                s.dispatch(opcode, pdu, backend, out)
            });
        }
        if serial::in_window(cmd_sn, self.exp_cmd_sn, self.max_cmd_sn())
            && self.out_of_order.len() < self.limits.queue_depth as usize
            && !self.out_of_order.iter().any(|(sn, _)| *sn == cmd_sn)
        {
            // A gap before it: keep a copy until the missing commands arrive.
            let mut copy = Vec::with_capacity(pdu::BHS_LEN + pdu.ahs.len() + pdu.data.len());
            copy.extend_from_slice(&bhs.0);
            copy.extend_from_slice(pdu.ahs);
            copy.extend_from_slice(pdu.data);
            self.out_of_order.push((cmd_sn, copy));
        }
        // Outside the window (or a duplicate): silently ignored.
        Flow::Continue
    }

    /// Runs the command the session expects next (CmdSN = ExpCmdSN, inside the window), then
    /// the commands that arrived early and were waiting for it.
    fn in_order(
        &mut self,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
        run: impl FnOnce(&mut Self, &mut dyn IscsiBackend, &mut Outbox) -> Flow,
    ) -> Flow {
        self.exp_cmd_sn = self.exp_cmd_sn.wrapping_add(1);
        if run(self, backend, out) == Flow::Close {
            return Flow::Close;
        }
        self.run_out_of_order(now, backend, out)
    }

    /// What every received PDU does to the session before it is handled: liveness clocks and
    /// the turn's activity. `Some(Close)` once the session has logged out.
    /// `data_len`: the data segment's length (a payload received in place is not in `pdu`).
    fn arrived(&mut self, pdu: &Pdu<'_>, data_len: usize, now: Instant) -> Option<Flow> {
        let bhs = &pdu.bhs;
        let answers_ping =
            bhs.opcode_raw() & 0x3f == Opcode::NopOut as u8 && bhs.itt() == RESERVED_TAG;
        self.last_rx = match self.ping {
            // The answer to our ping proves the peer alive as of the ping: the next one is
            // due an interval after this one, as armed when it went out (one timer setting a
            // ping on an idle connection, not two).
            Some(p) if answers_ping && bhs.u32_at(off::TTT) == p.ttt => self.last_rx.max(p.sent),
            _ => now,
        };
        if self.logged_out {
            return Some(Flow::Close);
        }
        if !answers_ping {
            self.last_activity = now;
        }
        self.note_activity(Opcode::from_initiator(bhs.opcode_raw()), pdu, data_len);
        None
    }

    fn run_out_of_order(
        &mut self,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        while let Some(pos) = self
            .out_of_order
            .iter()
            .position(|(sn, _)| *sn == self.exp_cmd_sn)
        {
            let (_, raw) = self.out_of_order.swap_remove(pos);
            // These bytes are a PDU `handle` parsed and kept whole, so they parse again. If
            // they did not, skipping the command would stall ExpCmdSN for good: an invariant,
            // and in release builds the connection closes (the engine logs it).
            let Some((bhs, ahs, data, opcode)) = reparse(&raw) else {
                debug_assert!(false, "a kept out-of-order PDU does not parse again");
                self.logged_out = true;
                return Flow::Close;
            };
            self.exp_cmd_sn = self.exp_cmd_sn.wrapping_add(1);
            self.last_rx = now;
            let pdu = Pdu { bhs, ahs, data };
            if self.dispatch(opcode, &pdu, backend, out) == Flow::Close {
                return Flow::Close;
            }
        }
        Flow::Continue
    }

    fn dispatch(
        &mut self,
        opcode: Opcode,
        pdu: &Pdu<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        match opcode {
            Opcode::NopOut => self.nop_out(pdu, out),
            Opcode::ScsiCommand => {
                self.scsi_command(pdu, Immediate::Received(pdu.data), backend, out)
            }
            Opcode::TaskMgmtRequest => self.task_management(pdu, backend, out),
            Opcode::TextRequest => self.text_request(pdu, backend, out),
            Opcode::LogoutRequest => self.logout(pdu, out),
            _ => {
                self.reject(&pdu.bhs, RejectReason::ProtocolError, out);
                Flow::Continue
            }
        }
    }

    fn nop_out(&mut self, pdu: &Pdu<'_>, out: &mut Outbox) -> Flow {
        let mut bhs = Bhs::new(Opcode::NopIn);
        bhs.set_flags(0x80);
        bhs.set_lun(pdu.bhs.lun());
        bhs.set_itt(pdu.bhs.itt());
        bhs.set_u32(off::TTT, RESERVED_TAG);
        self.stamp(&mut bhs, true);
        let echo_len = pdu
            .data
            .len()
            .min(self.params.max_xmit_data_segment_length as usize);
        self.push_pdu(out, &bhs, &pdu.data[..echo_len]);
        Flow::Continue
    }

    /// Why a SCSI Command with `immediate_len` bytes of immediate data would be refused before
    /// anything runs, in the order the answers are chosen; None when it is taken. `cdb_valid`:
    /// its AHS (an extended CDB) parsed. One place for these checks: the usual path answers
    /// with them, and [`Session::command_data_destination`] places only what passes them all.
    fn command_refusal(&self, bhs: &Bhs, immediate_len: usize, cdb_valid: bool) -> Option<Refusal> {
        let flags = bhs.flags();
        let (read, write) = (flags & 0x40 != 0, flags & 0x20 != 0);
        let edtl = bhs.u32_at(off::EDTL);
        if self.kind == SessionType::Discovery {
            return Some(Refusal::Reject(RejectReason::ProtocolError));
        }
        if !cdb_valid {
            return Some(Refusal::Reject(RejectReason::InvalidPduField));
        }
        if flags & 0x80 == 0 && !write {
            // F=0 only makes sense when unsolicited Data-Out follows.
            return Some(Refusal::Reject(RejectReason::ProtocolError));
        }
        if immediate_len != 0
            && (!write
                || !self.params.immediate_data
                || immediate_len > edtl as usize
                || immediate_len > self.params.first_burst_length as usize)
        {
            return Some(Refusal::Reject(RejectReason::ProtocolError));
        }
        if self.pending.iter().any(|p| p.itt == bhs.itt()) {
            return Some(Refusal::Reject(RejectReason::TaskInProgress));
        }
        // Commands inside the window never exceed the queue depth (the window shrinks as tasks
        // pile up); immediate commands come outside it, and are refused rather than queued
        // without bound.
        if self.pending.len() + self.running.len() >= self.limits.queue_depth.max(1) as usize {
            return Some(Refusal::TaskSetFull);
        }
        if read && write {
            // Bidirectional commands are not supported by any SCSI command we implement.
            return Some(Refusal::InvalidField);
        }
        let data_to_come = write && edtl != 0 && immediate_len != edtl as usize;
        if data_to_come && edtl > self.limits.max_write_bytes {
            return Some(Refusal::InvalidField);
        }
        if data_to_come
            && (self.pending_write_bytes + edtl as usize > self.limits.max_pending_write_bytes
                || self.pending.len() >= self.limits.queue_depth as usize)
        {
            return Some(Refusal::TaskSetFull);
        }
        None
    }

    /// `immediate`: the command's immediate data, in the receive buffer or already in place in
    /// a buffer for the whole write ([`Session::command_data_destination`]). A placed buffer
    /// the command does not take goes back to the pool.
    fn scsi_command(
        &mut self,
        pdu: &Pdu<'_>,
        immediate: Immediate<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let bhs = &pdu.bhs;
        let immediate_len = immediate.len();
        let flags = bhs.flags();
        let h = CommandHeader {
            itt: bhs.itt(),
            lun: bhs.lun(),
            edtl: bhs.u32_at(off::EDTL),
            read: flags & 0x40 != 0,
            write: flags & 0x20 != 0,
            task_attr: flags & 0x07,
            final_unsolicited: flags & 0x80 != 0,
        };
        let cdb = cdb_of(pdu);
        let refusal = self.command_refusal(bhs, immediate_len, cdb.is_some());
        let (Some(cdb), None) = (cdb, refusal) else {
            match refusal {
                Some(Refusal::Reject(reason)) => self.reject(bhs, reason, out),
                Some(Refusal::TaskSetFull) => {
                    self.respond_status(h.itt, status::TASK_SET_FULL, out)
                }
                Some(Refusal::InvalidField) => {
                    self.respond_sense(h.itt, h.lun, h.edtl, &INVALID_FIELD_IN_CDB, out)
                }
                None => debug_assert!(false, "a CDB that does not parse is refused"),
            }
            immediate.recycle(out);
            return Flow::Continue;
        };
        if !h.write || h.edtl == 0 || immediate_len == h.edtl as usize {
            self.run_command(&h, &cdb, immediate, backend, out);
        } else {
            self.start_write(&h, &cdb, immediate, backend, out);
        }
        Flow::Continue
    }

    /// A command with all its data here: run at once, or handed to the backend (deferred)
    /// with its Data-Out.
    fn run_command(
        &mut self,
        h: &CommandHeader,
        cdb: &[u8],
        immediate: Immediate<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) {
        let deferred = {
            let data_out = match &immediate {
                _ if !h.write => &[][..],
                Immediate::Received(data) => data,
                Immediate::Placed { buf, len } => buf.get(..*len).unwrap_or_default(),
            };
            let req = ScsiRequest {
                tag: h.itt,
                lun: h.lun,
                cdb,
                data_out,
                expected_len: h.edtl,
                read: h.read,
                write: h.write,
                task_attr: h.task_attr,
                // Untagged (0) or SIMPLE (1): the data of an ORDERED read must not change
                // after it completes, which a page still being sent could.
                may_lend_file: h.read && !self.framing.data_digest && h.task_attr <= 1,
            };
            self.execute(&req, backend, out)
        };
        if !deferred {
            immediate.recycle(out);
            return;
        }
        let buf = match immediate {
            // All of it, in place: the buffer is EDTL bytes long.
            Immediate::Placed { buf, .. } => buf,
            Immediate::Received([]) => DataOutBuf::default(),
            // Immediate data in the receive buffer: the only Data-Out copied here.
            Immediate::Received(data_out) => deferred_data_out(h.lun, data_out, backend, out),
        };
        backend.defer(
            DeferredCommand {
                tag: h.itt,
                lun: h.lun,
                cdb: cdb.to_vec(),
                data_out: buf,
                expected_len: h.edtl,
                read: h.read,
                write: h.write,
                task_attr: h.task_attr,
            },
            out.read_buffers(),
        );
    }

    /// A write whose data is still to come: its buffer takes the immediate data, and R2Ts
    /// solicit the rest (after the unsolicited burst, if any).
    fn start_write(
        &mut self,
        h: &CommandHeader,
        cdb: &[u8],
        immediate: Immediate<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) {
        let immediate_len = immediate.len() as u32;
        let buf = match immediate {
            // Already in place, in a buffer of EDTL bytes.
            Immediate::Placed { buf, .. } => buf,
            Immediate::Received(data) => {
                let mut buf = self.write_buffer(h.lun, h.edtl, backend, out);
                let Some(head) = buf.get_mut(..data.len()) else {
                    // Checked already: immediate data never exceeds EDTL.
                    buf.recycle(out);
                    return;
                };
                head.copy_from_slice(data);
                buf
            }
        };
        let unsolicited_end = if self.params.initial_r2t || h.final_unsolicited {
            immediate_len
        } else {
            self.params
                .first_burst_length
                .min(h.edtl)
                .max(immediate_len)
        };
        let mut task = PendingWrite {
            itt: h.itt,
            lun: h.lun,
            cdb: cdb.to_vec(),
            task_attr: h.task_attr,
            buf,
            edtl: h.edtl,
            unsolicited_end,
            unsolicited_received: immediate_len,
            unsolicited_next_data_sn: 0,
            solicit_next: unsolicited_end,
            r2ts: Vec::new(),
            next_r2t_sn: 0,
            received: immediate_len,
        };
        self.pending_write_bytes += h.edtl as usize;
        self.issue_r2ts(&mut task, out);
        self.pending.push(task);
    }

    /// A buffer for the `edtl` bytes of a write's data: memory the engine runs the write from
    /// (aligned for direct I/O), else one of the connection's pool. A recycled buffer keeps its
    /// old bytes (this connection's own earlier data) instead of being zero-filled, a pass over
    /// up to megabytes per write: the command runs only once `received` reaches EDTL, and the
    /// accepted ranges are disjoint (each offset is checked against its burst), so by then every
    /// byte of it has been overwritten.
    fn write_buffer(
        &mut self,
        lun: [u8; 8],
        edtl: u32,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> DataOutBuf {
        match backend.data_out_memory(lun, edtl as usize) {
            Some(memory) if memory.bytes().len() == edtl as usize => DataOutBuf::Engine(memory),
            _ => {
                let mut buf = out.take_scratch();
                if buf.len() >= edtl as usize {
                    buf.truncate(edtl as usize);
                } else {
                    buf.resize(edtl as usize, 0);
                }
                DataOutBuf::Pooled(buf)
            }
        }
    }

    /// For an engine that receives long immediate data straight into place: the slice of a
    /// buffer for the whole write that this SCSI Command header's data segment belongs in, when
    /// the session takes the command now (in CmdSN order, every check of
    /// [`Session::handle`] passing, nothing to answer first). Fill it, then call
    /// [`Session::handle_placed_command`]. Never with digests on (a placed payload skips the
    /// frame parser, so its digest would go unchecked), never for a command with an AHS.
    pub fn command_data_destination(
        &mut self,
        bhs: &Bhs,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Option<&mut [u8]> {
        let len = bhs.data_segment_len();
        let edtl = bhs.u32_at(off::EDTL);
        let cmd_sn = bhs.u32_at(off::CMD_SN);
        // What placing needs beyond the command's own checks: the next command in CmdSN
        // order (not kept for later), immediate data, a plain CDB, no digests.
        let placeable = !self.logged_out
            && !self.framing.header_digest
            && !self.framing.data_digest
            && self.staged.is_none()
            && Opcode::from_initiator(bhs.opcode_raw()) == Some(Opcode::ScsiCommand)
            && bhs.total_ahs_len() == 0
            && !bhs.immediate()
            && cmd_sn == self.exp_cmd_sn
            && serial::le(cmd_sn, self.max_cmd_sn_granted)
            && len > 0;
        if !placeable || self.command_refusal(bhs, len, true).is_some() {
            return None;
        }
        let buf = self.write_buffer(bhs.lun(), edtl, backend, out);
        let (_, buf) = self.staged.insert((*bhs, buf));
        buf.get_mut(..len)
    }

    /// [`Session::handle`] for the SCSI Command whose immediate data the engine received into
    /// the slice [`Session::command_data_destination`] returned.
    pub fn handle_placed_command(
        &mut self,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let Some((bhs, buf)) = self.staged.take() else {
            debug_assert!(false, "handle_placed_command without a destination");
            return Flow::Continue;
        };
        let len = bhs.data_segment_len();
        let pdu = Pdu {
            bhs,
            ahs: &[],
            data: &[],
        };
        if let Some(flow) = self.arrived(&pdu, len, now) {
            buf.recycle(out);
            return flow;
        }
        // command_data_destination took it as the next in CmdSN order, inside the window.
        let flow = self.in_order(now, backend, out, |s, backend, out| {
            s.scsi_command(&pdu, Immediate::Placed { buf, len }, backend, out)
        });
        self.check_invariants();
        flow
    }

    fn issue_r2ts(&mut self, task: &mut PendingWrite, out: &mut Outbox) {
        while task.solicit_next < task.edtl
            && task.r2ts.len() < self.params.max_outstanding_r2t.max(1) as usize
        {
            let len = (task.edtl - task.solicit_next).min(self.params.max_burst_length.max(512));
            let ttt = self.alloc_ttt();
            let mut bhs = Bhs::new(Opcode::R2t);
            bhs.set_flags(0x80);
            bhs.set_lun(task.lun);
            bhs.set_itt(task.itt);
            bhs.set_u32(off::TTT, ttt);
            self.stamp(&mut bhs, false);
            bhs.set_u32(off::DATA_SN, task.next_r2t_sn);
            bhs.set_u32(off::BUFFER_OFFSET, task.solicit_next);
            bhs.set_u32(off::DESIRED_LENGTH, len);
            self.push_pdu(out, &bhs, &[]);
            task.r2ts.push(R2tState {
                ttt,
                offset: task.solicit_next,
                len,
                received: 0,
                next_data_sn: 0,
            });
            task.next_r2t_sn = task.next_r2t_sn.wrapping_add(1);
            task.solicit_next += len;
        }
    }

    /// Where a Data-Out PDU's data segment of `len` bytes goes, if the session accepts it whole:
    /// the pending task's index and the byte offset in its buffer. Checks only, no effects.
    fn data_out_target(&self, bhs: &Bhs, len: u32) -> DataOutTarget {
        let itt = bhs.itt();
        let ttt = bhs.u32_at(off::TTT);
        let Some(index) = self.pending.iter().position(|p| p.itt == itt) else {
            // Unsolicited data for a command we already answered (e.g. refused) is dropped.
            return if ttt == RESERVED_TAG {
                DataOutTarget::Drop
            } else {
                DataOutTarget::UnknownTask
            };
        };
        let offset = bhs.u32_at(off::BUFFER_OFFSET);
        let data_sn = bhs.u32_at(off::DATA_SN);
        let task = &self.pending[index];
        let accepted = if ttt == RESERVED_TAG {
            offset == task.unsolicited_received
                && data_sn == task.unsolicited_next_data_sn
                && offset
                    .checked_add(len)
                    .is_some_and(|end| end <= task.unsolicited_end)
        } else if let Some(r2t) = task.r2ts.iter().find(|r| r.ttt == ttt) {
            offset == r2t.offset + r2t.received
                && data_sn == r2t.next_data_sn
                && r2t.received.checked_add(len).is_some_and(|n| n <= r2t.len)
        } else {
            false
        };
        let start = offset as usize;
        if accepted && task.buf.len() >= start + len as usize {
            DataOutTarget::Accept { index, start }
        } else {
            DataOutTarget::Bad { index }
        }
    }

    /// For an engine that receives large Data-Out payloads straight into place: the buffer slice
    /// the data segment of this Data-Out header belongs in, when the session would accept the
    /// PDU whole (the checks of [`Session::handle`], none of its effects). Fill it, then call
    /// [`Session::handle_placed_data_out`] with the same header. Never with digests on.
    pub fn data_out_destination(&mut self, bhs: &Bhs) -> Option<&mut [u8]> {
        // A placed payload never passes through the frame parser, so its digests would go
        // unchecked: with digests on, every PDU takes the usual way.
        if self.logged_out
            || self.framing.header_digest
            || self.framing.data_digest
            || Opcode::from_initiator(bhs.opcode_raw()) != Some(Opcode::DataOut)
        {
            return None;
        }
        let len = bhs.data_segment_len();
        match self.data_out_target(bhs, u32::try_from(len).ok()?) {
            DataOutTarget::Accept { index, start } => {
                self.pending.get_mut(index)?.buf.get_mut(start..start + len)
            }
            _ => None,
        }
    }

    /// [`Session::handle`] for a Data-Out PDU whose data segment the engine already received into
    /// the slice [`Session::data_out_destination`] returned for this header.
    pub fn handle_placed_data_out(
        &mut self,
        bhs: &Bhs,
        now: Instant,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let pdu = Pdu {
            bhs: *bhs,
            ahs: &[],
            data: &[],
        };
        if let Some(flow) = self.arrived(&pdu, 0, now) {
            return flow;
        }
        let flow = self.data_out_inner(&pdu, bhs.data_segment_len(), true, backend, out);
        self.check_invariants();
        flow
    }

    fn data_out(
        &mut self,
        pdu: &Pdu<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        self.data_out_inner(pdu, pdu.data.len(), false, backend, out)
    }

    /// `placed`: the `len` data bytes are already in the task's buffer (`pdu.data` is empty).
    fn data_out_inner(
        &mut self,
        pdu: &Pdu<'_>,
        len: usize,
        placed: bool,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let bhs = &pdu.bhs;
        let Ok(len) = u32::try_from(len) else {
            self.reject(bhs, RejectReason::ProtocolError, out);
            return Flow::Continue;
        };
        let (index, start) = match self.data_out_target(bhs, len) {
            DataOutTarget::Accept { index, start } => (index, start),
            DataOutTarget::Drop => return Flow::Continue,
            DataOutTarget::UnknownTask => {
                self.reject(bhs, RejectReason::InvalidPduField, out);
                return Flow::Continue;
            }
            DataOutTarget::Bad { index } => {
                // Wrong offset, DataSN or TTT: at ERL 0 the data cannot be recovered, so the task
                // ends with CHECK CONDITION while the session lives on. Later Data-Out PDUs of
                // the task are dropped (unsolicited) or rejected (solicited).
                self.reject(bhs, RejectReason::ProtocolError, out);
                let task = self.take_pending(index);
                self.respond_sense(task.itt, task.lun, task.edtl, &DATA_PHASE_ERROR, out);
                task.buf.recycle(out);
                return Flow::Continue;
            }
        };
        let ttt = bhs.u32_at(off::TTT);
        let task = &mut self.pending[index];
        if ttt == RESERVED_TAG {
            task.unsolicited_received += len;
            task.unsolicited_next_data_sn = task.unsolicited_next_data_sn.wrapping_add(1);
        } else if let Some(r2t) = task.r2ts.iter_mut().find(|r| r.ttt == ttt) {
            r2t.received += len;
            r2t.next_data_sn = r2t.next_data_sn.wrapping_add(1);
        }
        if !placed {
            let Some(dst) = task.buf.get_mut(start..start + pdu.data.len()) else {
                return Flow::Continue; // data_out_target checked the bounds
            };
            dst.copy_from_slice(pdu.data);
        }
        task.received += len;
        task.r2ts.retain(|r| r.received < r.len);
        if task.received < task.edtl {
            let mut task = self.pending.swap_remove(index);
            self.issue_r2ts(&mut task, out);
            self.pending.push(task);
            return Flow::Continue;
        }
        let task = self.take_pending(index);
        let req = ScsiRequest {
            tag: task.itt,
            lun: task.lun,
            cdb: &task.cdb,
            data_out: &task.buf,
            expected_len: task.edtl,
            read: false,
            write: true,
            task_attr: task.task_attr,
            may_lend_file: false,
        };
        if self.execute(&req, backend, out) {
            backend.defer(
                DeferredCommand {
                    tag: task.itt,
                    lun: task.lun,
                    cdb: task.cdb,
                    data_out: task.buf,
                    expected_len: task.edtl,
                    read: false,
                    write: true,
                    task_attr: task.task_attr,
                },
                out.read_buffers(),
            );
        } else {
            task.buf.recycle(out);
        }
        Flow::Continue
    }

    /// Runs `req` through the backend and answers it, or, when the backend defers it, records it
    /// as running and returns true: the caller then hands it over with [`ScsiBackend::defer`].
    fn execute(
        &mut self,
        req: &ScsiRequest<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> bool {
        let data_in = if req.read {
            out.take_scratch()
        } else {
            let mut buf = std::mem::take(&mut self.data_in_buf);
            buf.clear();
            buf
        };
        let mut data_in = data_in;
        self.sense_buf.clear();
        let mut lent = std::mem::take(&mut self.lent_buf);
        lent.clear();
        let deferred = match backend.execute(req, &mut data_in, &mut lent, &mut self.sense_buf) {
            Execution::Done(mut outcome) => {
                if lent.file.is_some() && !req.may_lend_file {
                    // A backend bug: a file range has no bytes in memory to digest, or may
                    // change under an ORDERED task. Fail the command rather than send data the
                    // initiator would have to catch as a digest error (or could not catch).
                    lent.clear();
                    data_in.clear();
                    self.sense_buf.clear();
                    self.sense_buf.extend_from_slice(&INTERNAL_TARGET_FAILURE);
                    outcome = ScsiOutcome {
                        status: status::CHECK_CONDITION,
                        transfer_len: 0,
                    };
                }
                // Lent store memory, when there is any, is sent instead of `data_in`.
                let data = if lent.is_empty() {
                    DataIn::Bytes(data_in)
                } else {
                    self.recycle_data_in(req.read, data_in, out);
                    DataIn::Lent(&mut lent)
                };
                self.finish(
                    req.tag,
                    req.lun,
                    req.expected_len,
                    req.read,
                    outcome,
                    data,
                    out,
                );
                false
            }
            Execution::Deferred => {
                self.recycle_data_in(req.read, data_in, out);
                self.running.push(RunningTask {
                    itt: req.tag,
                    lun: req.lun,
                    expected_len: req.expected_len,
                    read: req.read,
                    aborted: false,
                });
                true
            }
        };
        lent.clear();
        self.lent_buf = lent;
        deferred
    }

    /// Keeps an unsent Data-In buffer for reuse: read buffers return to the outbox's pool.
    fn recycle_data_in(&mut self, read: bool, buf: Vec<u8>, out: &mut Outbox) {
        if read {
            out.give_back(buf);
        } else {
            self.data_in_buf = buf;
        }
    }

    /// A deferred command finished: send its Data-In and status (nothing if a TMF aborted it).
    /// Returns false for an ITT that is not running (e.g. the session was reset meanwhile).
    pub fn complete(
        &mut self,
        itt: u32,
        outcome: ScsiOutcome,
        data_in: Vec<u8>,
        sense: &[u8],
        out: &mut Outbox,
    ) -> bool {
        self.complete_with(itt, outcome, DataIn::Bytes(data_in), sense, out)
    }

    /// Takes the running task `itt` off the list: to be answered, or, when it was aborted,
    /// settled silently (the TMFs that aborted it may answer now).
    fn settle(&mut self, itt: u32, out: &mut Outbox) -> Settled {
        let Some(index) = self.running.iter().position(|t| t.itt == itt) else {
            return Settled::Unknown;
        };
        let task = self.running.swap_remove(index);
        if !task.aborted {
            return Settled::Answer(task);
        }
        for tmf in &mut self.tmfs {
            tmf.awaiting_tasks.retain(|&t| t != task.itt);
        }
        if self.answer_settled_tmfs(out) == Flow::Close {
            debug_assert!(self.logged_out, "a cold reset closes the session");
        }
        Settled::Aborted
    }

    /// Like [`Session::complete`], for a command whose Data-In the backend lends (`loan`, left
    /// empty) instead of copying: a buffer its device read into, sent as it is.
    pub fn complete_lent(
        &mut self,
        itt: u32,
        outcome: ScsiOutcome,
        loan: &mut Loan,
        sense: &[u8],
        out: &mut Outbox,
    ) -> bool {
        self.complete_with(itt, outcome, DataIn::Lent(loan), sense, out)
    }

    /// The answer of a finished command (see [`Session::complete`]); a loan is left empty.
    fn complete_with(
        &mut self,
        itt: u32,
        outcome: ScsiOutcome,
        data: DataIn<'_>,
        sense: &[u8],
        out: &mut Outbox,
    ) -> bool {
        let task = match self.settle(itt, out) {
            Settled::Answer(task) => task,
            unanswered => {
                if let DataIn::Lent(loan) = data {
                    loan.clear();
                }
                return matches!(unanswered, Settled::Aborted);
            }
        };
        self.sense_buf.clear();
        self.sense_buf.extend_from_slice(sense);
        self.finish(
            task.itt,
            task.lun,
            task.expected_len,
            task.read,
            outcome,
            data,
            out,
        );
        true
    }

    /// Builds the Data-In PDUs and/or SCSI Response of a finished command from `data_in` and
    /// `self.sense_buf`.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &mut self,
        itt: u32,
        lun: [u8; 8],
        expected_len: u32,
        read: bool,
        outcome: ScsiOutcome,
        data: DataIn<'_>,
        out: &mut Outbox,
    ) {
        let edtl = expected_len as usize;
        // The SCSI layer reports what the CDB itself moves; the difference is the residual.
        let actual = outcome.transfer_len as usize;
        let (residual_flag, residual) = match actual.cmp(&edtl) {
            std::cmp::Ordering::Less => (0x02u8, (edtl - actual) as u32),
            std::cmp::Ordering::Greater => (0x04u8, (actual - edtl) as u32),
            std::cmp::Ordering::Equal => (0, 0),
        };
        let sense_len = self.sense_buf.len();
        // Only a read's Data-In is sent; never more than the initiator expects.
        let payload = match data {
            DataIn::Bytes(buf) if read && !buf.is_empty() => {
                let len = buf.len();
                Some((out.adopt(buf), len))
            }
            DataIn::Bytes(buf) => {
                self.recycle_data_in(read, buf, out);
                None
            }
            DataIn::Lent(loan) if read => {
                let index = match loan.file.take() {
                    Some(range) => out.lend_file(range),
                    None => out.lend(&mut loan.slices),
                };
                Some((index, out.payload_len(index)))
            }
            DataIn::Lent(loan) => {
                loan.clear();
                None
            }
        };
        if let Some((index, send_len)) = payload
            .map(|(index, len)| (index, len.min(edtl)))
            .filter(|&(_, len)| len > 0)
        {
            // Status rides in the last Data-In when there is no sense data (RFC 7143 §11.7.4).
            let with_status = sense_len == 0;
            self.data_in_pdus(
                itt,
                lun,
                index,
                send_len,
                with_status,
                outcome.status,
                residual_flag,
                residual,
                out,
            );
            if with_status {
                return;
            }
        }
        let mut bhs = Bhs::new(Opcode::ScsiResponse);
        bhs.set_flags(0x80 | residual_flag);
        bhs.set_byte(off::RESPONSE, 0); // command completed at target
        bhs.set_byte(off::STATUS, outcome.status);
        bhs.set_itt(itt);
        self.stamp(&mut bhs, true);
        bhs.set_u32(off::RESIDUAL, residual);
        if sense_len == 0 {
            self.push_pdu(out, &bhs, &[]);
        } else {
            let mut data = [0u8; 2 + 260];
            let n = sense_len.min(data.len() - 2);
            data[..2].copy_from_slice(&(n as u16).to_be_bytes());
            data[2..2 + n].copy_from_slice(&self.sense_buf[..n]);
            self.push_pdu(out, &bhs, &data[..2 + n]);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn data_in_pdus(
        &mut self,
        itt: u32,
        lun: [u8; 8],
        index: usize,
        len: usize,
        with_status: bool,
        status: u8,
        residual_flag: u8,
        residual: u32,
        out: &mut Outbox,
    ) {
        let seg_max = (self.params.max_xmit_data_segment_length as usize).max(512);
        let burst = (self.params.max_burst_length as usize).max(seg_max);
        let mut offset = 0usize;
        let mut data_sn = 0u32;
        while offset < len {
            let in_burst = burst - (offset % burst);
            let seg = seg_max.min(len - offset).min(in_burst);
            let last = offset + seg == len;
            let mut bhs = Bhs::new(Opcode::DataIn);
            let mut flags = 0u8;
            if last || seg == in_burst {
                flags |= 0x80;
            }
            bhs.set_itt(itt);
            bhs.set_u32(off::TTT, RESERVED_TAG);
            bhs.set_u32(off::DATA_SN, data_sn);
            bhs.set_u32(off::BUFFER_OFFSET, offset as u32);
            if last && with_status {
                flags |= 0x01 | residual_flag;
                bhs.set_byte(off::STATUS, status);
                bhs.set_u32(off::RESIDUAL, residual);
                self.stamp(&mut bhs, true);
            } else {
                bhs.set_lun(lun);
                self.stamp_no_status(&mut bhs);
            }
            bhs.set_flags(flags);
            bhs.set_data_segment_len(seg);
            self.push_header(out, &bhs);
            out.push_payload(index, offset..offset + seg);
            let pad = pdu::padded(seg) - seg;
            if pad > 0 {
                out.push_bytes(&[0u8; 3][..pad]);
            }
            if self.framing.data_digest {
                debug_assert!(
                    !out.is_file_payload(index),
                    "file ranges have no bytes to digest"
                );
                let mut crc = 0;
                out.for_each_payload_piece(index, offset..offset + seg, |piece| {
                    crc = crc32c::crc32c_append(crc, piece);
                });
                let crc = crc32c::crc32c_append(crc, &[0u8; 3][..pad]);
                out.push_bytes(&crc.to_le_bytes());
            }
            offset += seg;
            data_sn = data_sn.wrapping_add(1);
        }
        assert_eq!(
            offset, len,
            "the Data-In PDUs carry the bytes planned, no more"
        );
    }

    fn respond_status(&mut self, itt: u32, status: u8, out: &mut Outbox) {
        let mut bhs = Bhs::new(Opcode::ScsiResponse);
        bhs.set_flags(0x80);
        bhs.set_byte(off::STATUS, status);
        bhs.set_itt(itt);
        self.stamp(&mut bhs, true);
        self.push_pdu(out, &bhs, &[]);
    }

    fn respond_sense(
        &mut self,
        itt: u32,
        _lun: [u8; 8],
        edtl: u32,
        sense: &[u8],
        out: &mut Outbox,
    ) {
        let mut bhs = Bhs::new(Opcode::ScsiResponse);
        let underflow = if edtl > 0 { 0x02 } else { 0 };
        bhs.set_flags(0x80 | underflow);
        bhs.set_byte(off::STATUS, status::CHECK_CONDITION);
        bhs.set_itt(itt);
        self.stamp(&mut bhs, true);
        bhs.set_u32(off::RESIDUAL, edtl);
        let mut data = Vec::with_capacity(2 + sense.len());
        data.extend_from_slice(&(sense.len() as u16).to_be_bytes());
        data.extend_from_slice(sense);
        self.push_pdu(out, &bhs, &data);
    }

    fn task_management(
        &mut self,
        pdu: &Pdu<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let bhs = &pdu.bhs;
        let itt = bhs.itt();
        let lun = bhs.lun();
        let function = tmf_function(bhs.flags() & 0x7f);
        if function.is_some() && self.tmfs.len() >= PENDING_TMFS_MAX {
            self.respond_tmf(itt, tmf_response::REJECTED, out);
            return Flow::Continue;
        }
        // Running tasks the function aborts: their completions will send nothing, and the
        // response waits for them (SAM-5 §7.1: an aborted task may not change the medium after
        // the TMF completes; a running task cannot be stopped midway, so it is waited for).
        let mut awaiting_tasks = Vec::new();
        let mut close = false;
        let answer = match function {
            None => TmfAnswer::Now(tmf_response::NOT_SUPPORTED),
            Some(_) if self.kind == SessionType::Discovery => {
                TmfAnswer::Now(tmf_response::NOT_SUPPORTED)
            }
            Some(TmfFunction::AbortTask) => {
                let referenced = bhs.u32_at(off::REFERENCED_TASK_TAG);
                let ref_cmd_sn = bhs.u32_at(off::REF_CMD_SN);
                if let Some(i) = self.pending.iter().position(|p| p.itt == referenced) {
                    let task = self.take_pending(i);
                    task.buf.recycle(out);
                    TmfAnswer::Now(tmf_response::COMPLETE)
                } else if let Some(task) = self.running.iter_mut().find(|t| t.itt == referenced) {
                    task.aborted = true;
                    awaiting_tasks.push(referenced);
                    TmfAnswer::Now(tmf_response::COMPLETE)
                } else if serial::lt(ref_cmd_sn, self.exp_cmd_sn) {
                    // Received and already completed: nothing left to abort.
                    TmfAnswer::Now(tmf_response::TASK_DOES_NOT_EXIST)
                } else if serial::in_window(ref_cmd_sn, self.exp_cmd_sn, self.max_cmd_sn()) {
                    // Never received (RFC 7143 §11.5.1): consider it received, the function done.
                    TmfAnswer::Now(tmf_response::COMPLETE)
                } else {
                    TmfAnswer::Now(tmf_response::TASK_DOES_NOT_EXIST)
                }
            }
            Some(
                f @ (TmfFunction::AbortTaskSet
                | TmfFunction::ClearTaskSet
                | TmfFunction::LogicalUnitReset),
            ) => {
                if !backend.lun_exists(lun) {
                    TmfAnswer::Now(tmf_response::LUN_DOES_NOT_EXIST)
                } else {
                    self.drop_pending(|p| p.lun == lun, out);
                    awaiting_tasks = self.abort_running(|t| t.lun == lun);
                    backend.task_management(itt, f, lun)
                }
            }
            Some(TmfFunction::ClearAca) => TmfAnswer::Now(tmf_response::NOT_SUPPORTED),
            Some(f @ (TmfFunction::TargetWarmReset | TmfFunction::TargetColdReset)) => {
                self.drop_pending(|_| true, out);
                awaiting_tasks = self.abort_running(|_| true);
                close = f == TmfFunction::TargetColdReset;
                backend.task_management(itt, f, lun)
            }
            Some(TmfFunction::TaskReassign) => TmfAnswer::Now(tmf_response::REASSIGN_NOT_SUPPORTED),
        };
        let (response, awaiting_backend) = match answer {
            TmfAnswer::Now(response) => (response, false),
            TmfAnswer::Later => (tmf_response::COMPLETE, true),
        };
        self.tmfs.push(PendingTmf {
            itt,
            response,
            awaiting_tasks,
            awaiting_backend,
            close,
        });
        self.answer_settled_tmfs(out)
    }

    /// The engine's part of TMF `itt` is done (see [`TmfAnswer::Later`]): `response` is its
    /// answer. Sends the response if the session's own aborted tasks are done too. Returns
    /// `Close` after a TARGET COLD RESET's response.
    pub fn task_management_done(&mut self, itt: u32, response: u8, out: &mut Outbox) -> Flow {
        match self
            .tmfs
            .iter_mut()
            .find(|t| t.itt == itt && t.awaiting_backend)
        {
            Some(tmf) => {
                tmf.awaiting_backend = false;
                tmf.response = response;
            }
            None => debug_assert!(false, "TMF {itt:#x} was not waiting for the backend"),
        }
        self.answer_settled_tmfs(out)
    }

    /// Whether the session has ended (logout, TARGET COLD RESET): the engine sends what is
    /// queued and closes the connection.
    pub fn closing(&self) -> bool {
        self.logged_out
    }

    /// TMFs still waiting for their aborted tasks or the backend.
    pub fn pending_tmfs(&self) -> usize {
        self.tmfs.len()
    }

    /// Responds to every TMF nothing is left to wait for, in arrival order.
    fn answer_settled_tmfs(&mut self, out: &mut Outbox) -> Flow {
        let mut flow = Flow::Continue;
        while let Some(i) = self
            .tmfs
            .iter()
            .position(|t| t.awaiting_tasks.is_empty() && !t.awaiting_backend)
        {
            let tmf = self.tmfs.remove(i);
            self.respond_tmf(tmf.itt, tmf.response, out);
            if tmf.close {
                self.logged_out = true;
                flow = Flow::Close;
            }
        }
        flow
    }

    fn respond_tmf(&mut self, itt: u32, response: u8, out: &mut Outbox) {
        let mut resp = Bhs::new(Opcode::TaskMgmtResponse);
        resp.set_flags(0x80);
        resp.set_byte(off::RESPONSE, response);
        resp.set_itt(itt);
        self.stamp(&mut resp, true);
        self.push_pdu(out, &resp, &[]);
    }

    /// Removes a pending write and releases its share of the write-memory budget.
    fn take_pending(&mut self, index: usize) -> PendingWrite {
        let task = self.pending.swap_remove(index);
        self.pending_write_bytes -= task.edtl as usize;
        task
    }

    /// Marks the running tasks `which` selects aborted; returns their ITTs.
    fn abort_running(&mut self, which: impl Fn(&RunningTask) -> bool) -> Vec<u32> {
        let mut aborted = Vec::new();
        for task in self.running.iter_mut().filter(|t| which(t)) {
            task.aborted = true;
            aborted.push(task.itt);
        }
        aborted
    }

    fn drop_pending(&mut self, which: impl Fn(&PendingWrite) -> bool, out: &mut Outbox) {
        let mut i = 0;
        while i < self.pending.len() {
            if which(&self.pending[i]) {
                let task = self.take_pending(i);
                task.buf.recycle(out);
            } else {
                i += 1;
            }
        }
    }

    fn text_request(
        &mut self,
        pdu: &Pdu<'_>,
        backend: &mut dyn IscsiBackend,
        out: &mut Outbox,
    ) -> Flow {
        let bhs = &pdu.bhs;
        let ttt = bhs.u32_at(off::TTT);
        let continued = bhs.flags() & 0x40 != 0;
        // A request for the next piece of a long answer.
        if ttt != RESERVED_TAG {
            match self.text_out.take() {
                Some(cont) if cont.ttt == ttt && pdu.data.is_empty() => {
                    self.send_text_piece(bhs, cont.remaining, out);
                    return Flow::Continue;
                }
                _ => {
                    self.reject(bhs, RejectReason::InvalidPduField, out);
                    return Flow::Continue;
                }
            }
        }
        self.text_out = None;
        if self.text_in.len() + pdu.data.len() > self.limits.max_text_bytes {
            self.text_in.clear();
            self.reject(bhs, RejectReason::OutOfResources, out);
            return Flow::Continue;
        }
        self.text_in.extend_from_slice(pdu.data);
        if continued {
            // Acknowledge and wait for the rest of the initiator's text.
            let mut resp = Bhs::new(Opcode::TextResponse);
            resp.set_itt(bhs.itt());
            let t = self.alloc_ttt();
            resp.set_u32(off::TTT, t);
            self.stamp(&mut resp, true);
            self.push_pdu(out, &resp, &[]);
            return Flow::Continue;
        }
        let request = std::mem::take(&mut self.text_in);
        let Ok(pairs) = text::parse(&request, self.limits.max_keys) else {
            self.reject(bhs, RejectReason::ProtocolError, out);
            return Flow::Continue;
        };
        let mut answer = Vec::new();
        for (key, value) in &pairs {
            match key.as_str() {
                "SendTargets" => {
                    let filter = match (value.as_str(), self.kind) {
                        ("All", SessionType::Discovery) => None,
                        // RFC 7143 Appendix C: All is for discovery sessions only.
                        ("All", SessionType::Normal) => {
                            text::encode_pair(&mut answer, "SendTargets", "Reject");
                            continue;
                        }
                        // Empty: the session's own target (the backend knows which).
                        ("", _) => Some(""),
                        (name, _) => Some(name),
                    };
                    for target in backend.send_targets(filter) {
                        text::encode_pair(&mut answer, "TargetName", &target.name);
                        for addr in &target.addresses {
                            text::encode_pair(&mut answer, "TargetAddress", addr);
                        }
                    }
                }
                k if k.starts_with("X-") || k.starts_with("X#") => {
                    text::encode_pair(&mut answer, k, "NotUnderstood");
                }
                "MaxRecvDataSegmentLength" => {
                    // Declarative, may change in full feature phase (RFC 7143 §13.12).
                    if let Some(v) = crate::negotiation::parse_number(value)
                        .filter(|v| (512..=16_777_215).contains(v))
                    {
                        self.params.max_xmit_data_segment_length = v as u32;
                    } else {
                        text::encode_pair(&mut answer, key, "Reject");
                    }
                }
                _ => text::encode_pair(&mut answer, key, "NotUnderstood"),
            }
        }
        self.send_text_piece(bhs, answer, out);
        Flow::Continue
    }

    fn send_text_piece(&mut self, req: &Bhs, mut remaining: Vec<u8>, out: &mut Outbox) {
        let max = (self.params.max_xmit_data_segment_length as usize).max(512);
        let mut resp = Bhs::new(Opcode::TextResponse);
        resp.set_itt(req.itt());
        if remaining.len() > max {
            let rest = remaining.split_off(max);
            let ttt = self.alloc_ttt();
            resp.set_flags(0x40);
            resp.set_u32(off::TTT, ttt);
            self.stamp(&mut resp, true);
            self.push_pdu(out, &resp, &remaining);
            self.text_out = Some(TextContinuation {
                ttt,
                remaining: rest,
            });
        } else {
            resp.set_flags(0x80);
            resp.set_u32(off::TTT, RESERVED_TAG);
            self.stamp(&mut resp, true);
            self.push_pdu(out, &resp, &remaining);
        }
    }

    fn logout(&mut self, pdu: &Pdu<'_>, out: &mut Outbox) -> Flow {
        let bhs = &pdu.bhs;
        let reason = bhs.flags() & 0x7f;
        let response = match reason {
            0 | 1 => 0,
            2 => 2, // connection recovery is not supported at ERL 0
            _ => {
                self.reject(bhs, RejectReason::InvalidPduField, out);
                return Flow::Continue;
            }
        };
        let mut resp = Bhs::new(Opcode::LogoutResponse);
        resp.set_flags(0x80);
        resp.set_byte(off::RESPONSE, response);
        resp.set_itt(bhs.itt());
        self.stamp(&mut resp, true);
        resp.set_u16(off::TIME2WAIT, 0);
        resp.set_u16(off::TIME2RETAIN, 0);
        self.push_pdu(out, &resp, &[]);
        if response == 0 {
            self.drop_pending(|_| true, out);
            self.abort_running(|_| true);
            self.logged_out = true;
            Flow::Close
        } else {
            Flow::Continue
        }
    }

    fn reject(&mut self, rejected: &Bhs, reason: RejectReason, out: &mut Outbox) {
        let mut bhs = Bhs::new(Opcode::Reject);
        bhs.set_flags(0x80);
        bhs.set_byte(off::REASON, reason as u8);
        bhs.set_itt(RESERVED_TAG);
        // The StatSN is advanced after a Reject (RFC 7143 §11.17).
        self.stamp(&mut bhs, true);
        self.push_pdu(out, &bhs, &rejected.0);
    }

    /// Fills StatSN/ExpCmdSN/MaxCmdSN; `advance` consumes a StatSN.
    fn stamp(&mut self, bhs: &mut Bhs, advance: bool) {
        bhs.set_u32(off::STAT_SN, self.stat_sn);
        if advance {
            self.stat_sn = self.stat_sn.wrapping_add(1);
        }
        self.stamp_no_status(bhs);
    }

    fn stamp_no_status(&mut self, bhs: &mut Bhs) {
        bhs.set_u32(off::EXP_CMD_SN, self.exp_cmd_sn);
        let max = self.grant_window();
        bhs.set_u32(off::MAX_CMD_SN, max);
    }

    fn alloc_ttt(&mut self) -> u32 {
        let t = self.next_ttt;
        self.next_ttt = self.next_ttt.wrapping_add(1);
        if self.next_ttt == RESERVED_TAG {
            self.next_ttt = 1;
        }
        t
    }

    fn push_header(&self, out: &mut Outbox, bhs: &Bhs) {
        out.push_bytes(&bhs.0);
        if self.framing.header_digest {
            out.push_bytes(&crate::digest::crc32c(&bhs.0).to_le_bytes());
        }
    }

    fn push_pdu(&self, out: &mut Outbox, bhs: &Bhs, data: &[u8]) {
        let mut bhs = *bhs;
        bhs.set_data_segment_len(data.len());
        self.push_header(out, &bhs);
        if !data.is_empty() {
            out.push_bytes(data);
            let pad = pdu::padded(data.len()) - data.len();
            out.push_bytes(&[0u8; 3][..pad]);
            if self.framing.data_digest {
                out.push_bytes(&crate::digest::crc32c_padded(data).to_le_bytes());
            }
        }
    }

    /// The initiator this session belongs to.
    pub fn initiator_name(&self) -> &NodeName {
        &self.initiator_name
    }
}

/// AsyncEvent code of an Async Message asking the initiator to log out (RFC 7143 §11.9.1).
const ASYNC_EVENT_REQUEST_LOGOUT: u8 = 1;

/// Fixed-format sense data (SPC-4 4.5.3) for the few answers the iSCSI core gives itself.
const fn fixed_sense(key: u8, asc: u8, ascq: u8) -> [u8; 18] {
    [
        0x70, 0, key, 0, 0, 0, 0, 10, 0, 0, 0, 0, asc, ascq, 0, 0, 0, 0,
    ]
}

/// ABORTED COMMAND, DATA PHASE ERROR (4Bh/00h).
const DATA_PHASE_ERROR: [u8; 18] = fixed_sense(0x0b, 0x4b, 0x00);
/// ILLEGAL REQUEST, INVALID FIELD IN CDB (24h/00h).
const INVALID_FIELD_IN_CDB: [u8; 18] = fixed_sense(0x05, 0x24, 0x00);
/// HARDWARE ERROR, INTERNAL TARGET FAILURE (44h/00h): the answer to a backend that broke its
/// contract.
const INTERNAL_TARGET_FAILURE: [u8; 18] = fixed_sense(0x04, 0x44, 0x00);

/// The CDB: 16 bytes in the BHS, extended by an Extended CDB AHS (type 1) when longer. Borrowed
/// in the common case so the fast path does not allocate.
/// A PDU kept for later as one byte string: its header, AHS, data and opcode.
fn reparse(raw: &[u8]) -> Option<(Bhs, &[u8], &[u8], Opcode)> {
    let bhs = Bhs::from_slice(raw)?;
    let ahs_end = pdu::BHS_LEN + bhs.total_ahs_len();
    let ahs = raw.get(pdu::BHS_LEN..ahs_end)?;
    let data = raw.get(ahs_end..)?;
    let opcode = Opcode::from_initiator(bhs.opcode_raw())?;
    Some((bhs, ahs, data, opcode))
}

/// What a SCSI Command PDU's header says of its command.
struct CommandHeader {
    itt: u32,
    lun: [u8; 8],
    edtl: u32,
    read: bool,
    write: bool,
    task_attr: u8,
    /// F: no unsolicited Data-Out follows the immediate data.
    final_unsolicited: bool,
}

/// A deferred command's immediate data, copied out of the receive buffer: into memory the
/// engine runs it from when it offers some, else a buffer of the connection's pool.
fn deferred_data_out(
    lun: [u8; 8],
    data_out: &[u8],
    backend: &mut dyn IscsiBackend,
    out: &mut Outbox,
) -> DataOutBuf {
    match backend
        .data_out_memory(lun, data_out.len())
        .filter(|m| m.bytes().len() == data_out.len())
    {
        Some(mut memory) => {
            memory.bytes_mut().copy_from_slice(data_out);
            DataOutBuf::Engine(memory)
        }
        None => {
            let mut buf = out.take_buffer();
            buf.extend_from_slice(data_out);
            DataOutBuf::Pooled(buf)
        }
    }
}

fn cdb_of<'a>(pdu: &'a Pdu<'_>) -> Option<Cow<'a, [u8]>> {
    let base = pdu.bhs.0.get(off::CDB..off::CDB + 16)?;
    let mut ahs = pdu.ahs;
    while ahs.len() >= 4 {
        let len = u16::from_be_bytes([ahs[0], ahs[1]]) as usize;
        let kind = ahs[2];
        let total = pdu::padded(3 + len);
        let body = ahs.get(4..3 + len)?;
        if kind == 1 {
            let mut cdb = base.to_vec();
            // The AHS length counts its reserved byte (RFC 7143 §11.2.2.3).
            cdb.extend_from_slice(body);
            return Some(Cow::Owned(cdb));
        }
        ahs = ahs.get(total..)?;
    }
    Some(Cow::Borrowed(base))
}

#[cfg(test)]
mod tests;
