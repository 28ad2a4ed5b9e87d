//! The full feature phase of one connection, sans IO (RFC 7143 §3, §11).
//!
//! [`Session::submit`] takes a [`Command`] with the caller's tag, gives it an ITT and sends it
//! as soon as the CmdSN window allows (queued locally until then; never past MaxCmdSN). Feed
//! received bytes to [`Session::receive`], send [`Session::output`], call
//! [`Session::handle_timeout`] at [`Session::next_timeout`], and take [`Event`]s from
//! [`Session::poll_event`]. Any protocol violation by the target fails the connection (error
//! recovery level 0): `receive` returns the error and every outstanding command completes
//! with [`CommandError::ConnectionLost`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use iscsi::pdu::{self, off, Bhs, Framing, Opcode, RESERVED_TAG};
use iscsi::serial;

use crate::config::{SessionConfig, SessionKind};
use crate::error::{CommandError, Error, ProtocolError};
use crate::login::{Negotiated, Outbuf};
use crate::scsi::{encode_lun, Cdb, Sense};

/// The longest text (SendTargets) response we accept, all continuation PDUs together.
pub const TEXT_RESPONSE_MAX: usize = 1 << 20;
/// Slots for requests other than SCSI commands (pings, task management, text, logout).
const CONTROL_SLOTS: usize = 16;
/// ITT index space: 16 bits, 0xffff never used (ITT 0xffffffff is reserved).
const SLOTS_MAX: usize = 0xfff0;
/// Events waiting to be taken above which unsolicited ones (async messages, stray rejects)
/// are dropped.
pub const UNSOLICITED_EVENTS_MAX: usize = 1024;

/// Data transfer of a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transfer {
    None,
    /// Read up to `len` bytes into `buf` (cleared and filled; pass a recycled buffer to avoid
    /// an allocation).
    Read {
        len: u32,
        buf: Vec<u8>,
    },
    /// Write these bytes (given back in the completion for reuse).
    Write(Vec<u8>),
    /// Write the first `len` bytes of a shared buffer, sent from where they lie rather than
    /// copied into the output (a benchmark writing one pattern many times); the completion
    /// gives back an empty buffer.
    WriteShared {
        data: std::sync::Arc<[u8]>,
        len: usize,
    },
}

/// SCSI task attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TaskAttr {
    Untagged = 0,
    #[default]
    Simple = 1,
    Ordered = 2,
    HeadOfQueue = 3,
    Aca = 4,
}

/// A SCSI command to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// The caller's tag, returned in the completion (not interpreted).
    pub tag: u64,
    pub lun: u64,
    pub cdb: Cdb,
    pub transfer: Transfer,
    pub attr: TaskAttr,
}

impl Command {
    /// A command that transfers no data.
    pub fn none(tag: u64, lun: u64, cdb: Cdb) -> Command {
        Command {
            tag,
            lun,
            cdb,
            transfer: Transfer::None,
            attr: TaskAttr::Simple,
        }
    }

    /// A command that reads `len` bytes.
    pub fn read(tag: u64, lun: u64, cdb: Cdb, len: u32) -> Command {
        Command {
            transfer: Transfer::Read {
                len,
                buf: Vec::new(),
            },
            ..Command::none(tag, lun, cdb)
        }
    }

    /// A command that writes `data`.
    pub fn write(tag: u64, lun: u64, cdb: Cdb, data: Vec<u8>) -> Command {
        Command {
            transfer: Transfer::Write(data),
            ..Command::none(tag, lun, cdb)
        }
    }

    /// A command that writes the first `len` bytes of `data`, without copying them.
    pub fn write_shared(
        tag: u64,
        lun: u64,
        cdb: Cdb,
        data: std::sync::Arc<[u8]>,
        len: usize,
    ) -> Command {
        Command {
            transfer: Transfer::WriteShared { data, len },
            ..Command::none(tag, lun, cdb)
        }
    }

    /// Reads into `buf` (its allocation is reused).
    pub fn with_buffer(mut self, buf: Vec<u8>) -> Command {
        if let Transfer::Read { buf: b, .. } = &mut self.transfer {
            *b = buf;
        }
        self
    }
}

/// Residual count of a finished command (RFC 7143 §11.4.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Residual {
    #[default]
    None,
    /// The target transferred this many bytes less than expected.
    Under(u32),
    /// The command wanted this many bytes more than expected.
    Over(u32),
}

/// A command's SCSI outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScsiResult {
    pub status: u8,
    /// Reads: the data received (as long as the highest byte received). Writes: the data
    /// buffer, given back for reuse. Otherwise empty.
    pub data: Vec<u8>,
    pub sense: Option<Sense>,
    pub residual: Residual,
}

impl ScsiResult {
    pub fn is_good(&self) -> bool {
        self.status == crate::scsi::status::GOOD
    }

    /// CHECK CONDITION with a UNIT ATTENTION sense key.
    pub fn is_unit_attention(&self) -> bool {
        self.status == crate::scsi::status::CHECK_CONDITION
            && self.sense.as_ref().is_some_and(Sense::is_unit_attention)
    }
}

/// A finished command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub tag: u64,
    pub result: Result<ScsiResult, CommandError>,
}

/// Task management functions (RFC 7143 §11.5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tmf {
    /// Abort the command submitted with caller tag `task`.
    AbortTask {
        lun: u64,
        task: u64,
    },
    AbortTaskSet {
        lun: u64,
    },
    ClearTaskSet {
        lun: u64,
    },
    LunReset {
        lun: u64,
    },
    TargetWarmReset,
    TargetColdReset,
}

impl Tmf {
    fn function(&self) -> u8 {
        match self {
            Tmf::AbortTask { .. } => 1,
            Tmf::AbortTaskSet { .. } => 2,
            Tmf::ClearTaskSet { .. } => 4,
            Tmf::LunReset { .. } => 5,
            Tmf::TargetWarmReset => 6,
            Tmf::TargetColdReset => 7,
        }
    }
    fn lun(&self) -> Option<u64> {
        match *self {
            Tmf::AbortTask { lun, .. }
            | Tmf::AbortTaskSet { lun }
            | Tmf::ClearTaskSet { lun }
            | Tmf::LunReset { lun } => Some(lun),
            Tmf::TargetWarmReset | Tmf::TargetColdReset => None,
        }
    }
}

/// The Task Management Function Response code (0 function complete, 1 task does not exist,
/// 2 LUN does not exist, 5 not supported, 6 authorization failed, 255 rejected, ...).
pub type TmfResponse = u8;

/// One target from a SendTargets answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredTarget {
    pub name: String,
    /// `TargetAddress` values: `host:port` (IPv6 in brackets) and the portal group tag.
    pub addresses: Vec<(String, Option<u16>)>,
}

/// An Asynchronous Message (RFC 7143 §11.9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AsyncMessage {
    /// AsyncEvent: 0 SCSI event (sense), 1 logout requested, 2 connection will drop,
    /// 3 session will drop, 4 renegotiation requested, 255 vendor specific.
    pub event: u8,
    pub lun: u64,
    pub sense: Option<Sense>,
    pub parameters: [u16; 3],
}

/// What the session reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Completed(Completion),
    TaskManagement {
        tag: u64,
        result: Result<TmfResponse, CommandError>,
    },
    /// Our ping (NOP-Out) was answered after `rtt`.
    Pong {
        tag: u64,
        result: Result<Duration, CommandError>,
    },
    SendTargets {
        tag: u64,
        result: Result<Vec<DiscoveredTarget>, CommandError>,
    },
    /// The Logout Response (response 0: closed).
    LoggedOut {
        tag: u64,
        result: Result<u8, CommandError>,
    },
    Async(AsyncMessage),
    /// The target asks us to log out within `within` (AsyncEvent 1).
    LogoutRequested {
        within: Duration,
    },
    /// A Reject of a PDU no outstanding request owns.
    Rejected {
        reason: u8,
        itt: u32,
    },
}

#[derive(Debug)]
enum Dir {
    None,
    Read,
    Write,
}

#[derive(Debug)]
struct ScsiTask {
    tag: u64,
    lun: u64,
    cdb: Cdb,
    attr: TaskAttr,
    dir: Dir,
    buf: Vec<u8>,
    /// A write's data when shared ([`Transfer::WriteShared`]): its first `edtl` bytes, and
    /// `buf` empty.
    shared: Option<std::sync::Arc<[u8]>>,
    edtl: u32,
    cmd_sn: u32,
    sent: bool,
    deadline: Instant,
    next_data_sn: u32,
    high: u32,
    /// Completed to the caller already (timeout); settled when the target says so.
    abandoned: bool,
}

impl ScsiTask {
    /// Bytes of its write data.
    fn write_len(&self) -> usize {
        match &self.shared {
            Some(_) => self.edtl as usize,
            None => self.buf.len(),
        }
    }

    /// A PDU `bhs` with its write data `range` as the data segment: the shared data spliced
    /// into the output, the task's own copied.
    fn put_data(&self, out: &mut Outbuf, bhs: &Bhs, range: std::ops::Range<usize>, tx: &Framing) {
        let bytes = match &self.shared {
            Some(data) => data.get(range.clone()),
            None => self.buf.get(range.clone()),
        }
        .unwrap_or(&[]);
        pdu::encode_head(out.vec(), bhs, bytes.len(), tx);
        match &self.shared {
            Some(data) if !bytes.is_empty() => out.splice(data, range),
            _ => out.vec().extend_from_slice(bytes),
        }
        pdu::encode_tail(out.vec(), bytes, tx);
    }
}

#[derive(Debug)]
enum Task {
    Scsi(ScsiTask),
    Tmf {
        tag: u64,
        tmf: Tmf,
        /// The referenced command's ITT (ABORT TASK).
        referenced: Option<u32>,
        cmd_sn: u32,
        deadline: Instant,
        /// Sent by the session itself (a timed-out command's ABORT TASK): no event.
        internal: bool,
    },
    Ping {
        tag: u64,
        sent: Instant,
        deadline: Instant,
        internal: bool,
    },
    Text {
        tag: u64,
        buf: Vec<u8>,
        deadline: Instant,
    },
    Logout {
        tag: u64,
        deadline: Instant,
    },
}

#[derive(Debug, Default)]
struct Slot {
    generation: u16,
    task: Option<Task>,
}

/// Where the session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    FullFeature,
    /// Logout sent: no new commands.
    LoggingOut,
    LoggedOut,
    /// The connection failed; every outstanding request was completed with an error.
    Failed,
}

/// One connection's full feature phase (one connection per session, ERL 0).
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    params: Negotiated,
    rx: Framing,
    tx: Framing,
    out: Outbuf,
    cmd_sn: u32,
    exp_stat_sn: u32,
    exp_cmd_sn: u32,
    max_cmd_sn: u32,
    slots: Vec<Slot>,
    free: Vec<u16>,
    queued: VecDeque<u32>,
    /// SCSI commands holding a slot (queued, sent, or abandoned).
    scsi_outstanding: usize,
    /// Of those, the ones the caller still waits for.
    scsi_waiting: usize,
    control_outstanding: usize,
    events: VecDeque<Event>,
    state: State,
    last_heard: Instant,
    ping_outstanding: bool,
    /// No command deadline falls before this (a lower bound; rescanned when reached).
    earliest_deadline: Option<Instant>,
    dropped_events: u64,
}

impl Session {
    pub(crate) fn new(
        config: SessionConfig,
        params: Negotiated,
        cmd_sn: u32,
        exp_stat_sn: u32,
        exp_cmd_sn: u32,
        max_cmd_sn: u32,
        now: Instant,
    ) -> Session {
        let rx = Framing {
            header_digest: params.header_digest,
            data_digest: params.data_digest,
            max_data_segment_len: params.max_recv_data_segment_length as usize,
        };
        let tx = Framing {
            max_data_segment_len: params.max_xmit_data_segment_length as usize,
            ..rx
        };
        let capacity = (config.max_outstanding_commands + CONTROL_SLOTS).min(SLOTS_MAX);
        let mut slots = Vec::with_capacity(capacity);
        slots.resize_with(capacity, Slot::default);
        let free = (0..capacity as u16).rev().collect();
        Session {
            config,
            params,
            rx,
            tx,
            out: Outbuf::default(),
            cmd_sn,
            exp_stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            slots,
            free,
            queued: VecDeque::new(),
            scsi_outstanding: 0,
            scsi_waiting: 0,
            control_outstanding: 0,
            events: VecDeque::new(),
            state: State::FullFeature,
            last_heard: now,
            ping_outstanding: false,
            earliest_deadline: None,
            dropped_events: 0,
        }
    }

    /// The negotiated parameters.
    pub fn negotiated(&self) -> &Negotiated {
        &self.params
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// Commands the caller still waits for (queued or sent).
    pub fn in_flight(&self) -> usize {
        self.scsi_waiting
    }

    /// Commands queued locally because the CmdSN window is closed.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// The next CmdSN, and the window the target granted (ExpCmdSN, MaxCmdSN).
    pub fn command_window(&self) -> (u32, u32, u32) {
        (self.cmd_sn, self.exp_cmd_sn, self.max_cmd_sn)
    }

    /// Bytes waiting to be sent, for a session that sends no shared write data
    /// ([`Transfer::WriteShared`]); else see [`Session::output_slices`].
    pub fn output(&self) -> &[u8] {
        self.out.pending()
    }

    /// What waits to be sent, shared write data in its place, as slices for one `writev`
    /// (at most 1,024; [`Session::output_len`] says how much is left in all).
    pub fn output_slices<'a>(&'a self, into: &mut Vec<std::io::IoSlice<'a>>) {
        self.out.slices(into);
    }

    /// `n` bytes of [`Session::output`] were sent.
    pub fn advance_output(&mut self, n: usize) {
        self.out.advance(n);
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Submits a SCSI command; returns the ITT it got. It is sent at once if the CmdSN window
    /// is open, else queued until the target opens it.
    pub fn submit(&mut self, cmd: Command, now: Instant) -> Result<u32, Error> {
        if self.state != State::FullFeature {
            return Err(Error::NotConnected);
        }
        if matches!(self.config.kind, SessionKind::Discovery) {
            return Err(Error::InvalidCommand(
                "no SCSI commands in a discovery session",
            ));
        }
        if self.scsi_outstanding >= self.config.max_outstanding_commands {
            return Err(Error::Full);
        }
        let mut shared = None;
        let (dir, buf, edtl) = match cmd.transfer {
            Transfer::None => (Dir::None, Vec::new(), 0),
            Transfer::Read { len, mut buf } => {
                if !self.params.data_pdu_in_order {
                    // Data may arrive in any order: what never arrives must read as zeros.
                    buf.clear();
                }
                // In order, data fills the buffer from 0 without holes and is cut to what
                // arrived: a recycled buffer needs no zeroing.
                buf.truncate(len as usize);
                buf.resize(len as usize, 0);
                (Dir::Read, buf, len)
            }
            Transfer::Write(data) => {
                let len = u32::try_from(data.len())
                    .map_err(|_| Error::InvalidCommand("write longer than 4 GiB"))?;
                (Dir::Write, data, len)
            }
            Transfer::WriteShared { data, len } => {
                if len > data.len() {
                    return Err(Error::InvalidCommand("write longer than its shared data"));
                }
                let len = u32::try_from(len)
                    .map_err(|_| Error::InvalidCommand("write longer than 4 GiB"))?;
                shared = Some(data);
                (Dir::Write, Vec::new(), len)
            }
        };
        let deadline = now + self.config.command_timeout;
        let task = Task::Scsi(ScsiTask {
            tag: cmd.tag,
            lun: cmd.lun,
            cdb: cmd.cdb,
            attr: cmd.attr,
            dir,
            buf,
            shared,
            edtl,
            cmd_sn: 0,
            sent: false,
            deadline,
            next_data_sn: 0,
            high: 0,
            abandoned: false,
        });
        let itt = self.alloc(task).ok_or(Error::Full)?;
        self.scsi_outstanding += 1;
        self.scsi_waiting += 1;
        self.earliest_deadline = Some(self.earliest_deadline.map_or(deadline, |d| d.min(deadline)));
        self.queued.push_back(itt);
        self.flush_queue();
        Ok(itt)
    }

    /// Sends a task management request (immediate). Its answer is an
    /// [`Event::TaskManagement`] with `tag`; commands it ends complete with
    /// [`CommandError::Aborted`].
    pub fn task_management(&mut self, tag: u64, tmf: Tmf, now: Instant) -> Result<(), Error> {
        self.tmf(tag, tmf, now, false)
    }

    fn tmf(&mut self, tag: u64, tmf: Tmf, now: Instant, internal: bool) -> Result<(), Error> {
        if !matches!(self.state, State::FullFeature) {
            return Err(Error::NotConnected);
        }
        let referenced = match tmf {
            Tmf::AbortTask { task, .. } => Some(
                self.find_scsi(|t| t.tag == task && t.sent)
                    .ok_or(Error::InvalidCommand("no such task sent"))?,
            ),
            _ => None,
        };
        let ref_cmd_sn = referenced
            .and_then(|itt| match self.task(itt) {
                Some(Task::Scsi(t)) => Some(t.cmd_sn),
                _ => None,
            })
            .unwrap_or(self.cmd_sn);
        let cmd_sn = self.cmd_sn;
        let itt = self.alloc_control(Task::Tmf {
            tag,
            tmf,
            referenced,
            cmd_sn,
            deadline: now + self.config.response_timeout,
            internal,
        })?;
        let mut bhs = Bhs::new(Opcode::TaskMgmtRequest);
        bhs.set_immediate(true);
        bhs.set_flags(0x80 | tmf.function());
        bhs.set_lun(encode_lun(tmf.lun().unwrap_or(0)));
        bhs.set_itt(itt);
        bhs.set_u32(off::TTT, referenced.unwrap_or(RESERVED_TAG));
        bhs.set_u32(off::CMD_SN, cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        bhs.set_u32(off::REF_CMD_SN, ref_cmd_sn);
        self.push(&bhs, &[]);
        Ok(())
    }

    /// Pings the target (NOP-Out); the answer is an [`Event::Pong`] with `tag`.
    pub fn ping(&mut self, tag: u64, now: Instant) -> Result<(), Error> {
        self.send_ping(tag, now, false)
    }

    fn send_ping(&mut self, tag: u64, now: Instant, internal: bool) -> Result<(), Error> {
        if !matches!(self.state, State::FullFeature | State::LoggingOut) {
            return Err(Error::NotConnected);
        }
        let itt = self.alloc_control(Task::Ping {
            tag,
            sent: now,
            deadline: now + self.config.response_timeout,
            internal,
        })?;
        if internal {
            self.ping_outstanding = true;
        }
        let mut bhs = Bhs::new(Opcode::NopOut);
        bhs.set_immediate(true);
        bhs.set_flags(0x80);
        bhs.set_itt(itt);
        bhs.set_u32(off::TTT, RESERVED_TAG);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        self.push(&bhs, &[]);
        Ok(())
    }

    /// Asks for `SendTargets=All` (discovery sessions; normal sessions get their own target).
    /// The answer is an [`Event::SendTargets`] with `tag`.
    pub fn send_targets(&mut self, tag: u64, now: Instant) -> Result<(), Error> {
        if self.state != State::FullFeature {
            return Err(Error::NotConnected);
        }
        let value = match self.config.kind {
            SessionKind::Discovery => "All",
            SessionKind::Normal { .. } => "",
        };
        let itt = self.alloc_control(Task::Text {
            tag,
            buf: Vec::new(),
            deadline: now + self.config.response_timeout,
        })?;
        let mut bhs = Bhs::new(Opcode::TextRequest);
        bhs.set_immediate(true);
        bhs.set_flags(0x80);
        bhs.set_itt(itt);
        bhs.set_u32(off::TTT, RESERVED_TAG);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        let mut text = Vec::new();
        iscsi::text::encode_pair(&mut text, "SendTargets", value);
        self.push(&bhs, &text);
        Ok(())
    }

    /// Logs out (close the session). The answer is an [`Event::LoggedOut`] with `tag`.
    pub fn logout(&mut self, tag: u64, now: Instant) -> Result<(), Error> {
        if self.state != State::FullFeature {
            return Err(Error::NotConnected);
        }
        let itt = self.alloc_control(Task::Logout {
            tag,
            deadline: now + self.config.response_timeout,
        })?;
        self.state = State::LoggingOut;
        let mut bhs = Bhs::new(Opcode::LogoutRequest);
        bhs.set_immediate(true);
        bhs.set_flags(0x80);
        bhs.set_itt(itt);
        bhs.set_u16(off::CID, self.config.cid);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        self.push(&bhs, &[]);
        Ok(())
    }

    /// The connection is gone (EOF, I/O error, a timeout of the driver): every outstanding
    /// request completes with [`CommandError::ConnectionLost`].
    pub fn connection_lost(&mut self, why: &str) {
        if matches!(self.state, State::Failed) {
            return;
        }
        let logged_out = self.state == State::LoggedOut;
        self.state = State::Failed;
        if logged_out {
            self.state = State::LoggedOut;
        }
        self.queued.clear();
        let err = CommandError::ConnectionLost(why.to_string());
        for i in 0..self.slots.len() {
            let Some(slot) = self.slots.get_mut(i) else {
                continue;
            };
            let Some(task) = slot.task.take() else {
                continue;
            };
            slot.generation = slot.generation.wrapping_add(1);
            self.free.push(i as u16);
            let event = match task {
                Task::Scsi(t) if !t.abandoned => Some(Event::Completed(Completion {
                    tag: t.tag,
                    result: Err(err.clone()),
                })),
                Task::Scsi(_) => None,
                Task::Tmf { internal: true, .. } | Task::Ping { internal: true, .. } => None,
                Task::Tmf { tag, .. } => Some(Event::TaskManagement {
                    tag,
                    result: Err(err.clone()),
                }),
                Task::Ping { tag, .. } => Some(Event::Pong {
                    tag,
                    result: Err(err.clone()),
                }),
                Task::Text { tag, .. } => Some(Event::SendTargets {
                    tag,
                    result: Err(err.clone()),
                }),
                Task::Logout { tag, .. } => Some(Event::LoggedOut {
                    tag,
                    result: Err(err.clone()),
                }),
            };
            self.events.extend(event);
        }
        self.scsi_outstanding = 0;
        self.scsi_waiting = 0;
        self.control_outstanding = 0;
        self.ping_outstanding = false;
    }

    /// When [`Session::handle_timeout`] next has work (a command deadline, a ping to send
    /// or one overdue).
    pub fn next_timeout(&self) -> Option<Instant> {
        if !matches!(self.state, State::FullFeature | State::LoggingOut) {
            return None;
        }
        let mut next = self.earliest_deadline;
        if self.control_outstanding > 0 {
            for slot in &self.slots {
                let d = match &slot.task {
                    Some(Task::Tmf { deadline, .. })
                    | Some(Task::Ping { deadline, .. })
                    | Some(Task::Text { deadline, .. })
                    | Some(Task::Logout { deadline, .. }) => *deadline,
                    _ => continue,
                };
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        if let (Some(interval), false) = (self.config.nop_interval, self.ping_outstanding) {
            let d = self.last_heard + interval;
            next = Some(next.map_or(d, |n| n.min(d)));
        }
        next
    }

    /// Runs the timers: commands past their deadline complete with
    /// [`CommandError::Timeout`] (and are aborted); a silent target is pinged; a ping, task
    /// management, text or logout request not answered in time fails the connection.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), Error> {
        if !matches!(self.state, State::FullFeature | State::LoggingOut) {
            return Ok(());
        }
        if self.control_outstanding > 0 {
            let overdue = self.slots.iter().any(|s| match &s.task {
                Some(Task::Tmf { deadline, .. })
                | Some(Task::Ping { deadline, .. })
                | Some(Task::Text { deadline, .. })
                | Some(Task::Logout { deadline, .. }) => *deadline <= now,
                _ => false,
            });
            if overdue {
                let after = self.config.response_timeout;
                self.connection_lost("the target did not answer in time");
                return Err(Error::Timeout {
                    what: "the target's answer to a ping, task management, text or logout",
                    after,
                });
            }
        }
        if self.earliest_deadline.is_some_and(|d| d <= now) {
            self.expire_commands(now);
        }
        if let (Some(interval), false) = (self.config.nop_interval, self.ping_outstanding) {
            if self.last_heard + interval <= now && self.state == State::FullFeature {
                self.send_ping(u64::MAX, now, true)?;
            }
        }
        Ok(())
    }

    fn expire_commands(&mut self, now: Instant) {
        let mut earliest: Option<Instant> = None;
        let mut expired = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some(Task::Scsi(t)) = &slot.task {
                if t.abandoned {
                    continue;
                }
                if t.deadline <= now {
                    expired.push(itt_of(i, slot.generation));
                } else {
                    earliest = Some(earliest.map_or(t.deadline, |e| e.min(t.deadline)));
                }
            }
        }
        self.earliest_deadline = earliest;
        for itt in expired {
            let Some(Task::Scsi(t)) = self.task_mut(itt) else {
                continue;
            };
            let (tag, sent, lun) = (t.tag, t.sent, t.lun);
            self.events.push_back(Event::Completed(Completion {
                tag,
                result: Err(CommandError::Timeout),
            }));
            self.scsi_waiting -= 1;
            if !sent {
                self.queued.retain(|&q| q != itt);
                self.release(itt);
                continue;
            }
            // The target may still answer; ABORT TASK settles it (the slot stays reserved
            // until the target answers for the task or the abort).
            let _ = self.tmf(u64::MAX, Tmf::AbortTask { lun, task: tag }, now, true);
            if let Some(Task::Scsi(t)) = self.task_mut(itt) {
                t.abandoned = true;
            }
        }
    }

    /// Consumes complete PDUs from `buf`; returns how many bytes it used (the rest is an
    /// incomplete PDU: keep it and call again with more).
    pub fn receive(&mut self, buf: &[u8], now: Instant) -> Result<usize, Error> {
        if self.state == State::Failed {
            return Err(Error::NotConnected);
        }
        let mut used = 0usize;
        loop {
            let rest = buf.get(used..).unwrap_or(&[]);
            let len = match pdu::frame_len(rest, &self.rx) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => return Err(self.violation(ProtocolError::Frame(e))),
            };
            let frame = rest.get(..len).unwrap_or(&[]);
            let result = match pdu::parse_frame(frame, &self.rx) {
                Ok(p) => self.handle(&p.bhs, p.data, now),
                Err((e, _)) => Err(ProtocolError::Frame(e)),
            };
            if let Err(e) = result {
                return Err(self.violation(e));
            }
            used += len;
            if self.state == State::LoggedOut {
                break;
            }
        }
        Ok(used)
    }

    fn violation(&mut self, e: ProtocolError) -> Error {
        self.connection_lost(&e.to_string());
        Error::Protocol(e)
    }

    fn handle(&mut self, bhs: &Bhs, data: &[u8], now: Instant) -> Result<(), ProtocolError> {
        self.last_heard = now;
        let raw = bhs.opcode_raw();
        let op = Opcode::from_target(raw).ok_or(ProtocolError::UnknownOpcode(raw))?;
        if !matches!(op, Opcode::DataIn | Opcode::R2t) {
            // Data-In without status and R2T carry no StatSN of their own.
            self.stat_sn(bhs.u32_at(off::STAT_SN), op, bhs);
        }
        self.window(bhs.u32_at(off::EXP_CMD_SN), bhs.u32_at(off::MAX_CMD_SN));
        match op {
            Opcode::NopIn => self.nop_in(bhs, data, now)?,
            Opcode::ScsiResponse => self.scsi_response(bhs, data)?,
            Opcode::DataIn => self.data_in(bhs, data)?,
            Opcode::R2t => self.r2t(bhs)?,
            Opcode::TaskMgmtResponse => self.tmf_response(bhs)?,
            Opcode::TextResponse => self.text_response(bhs, data)?,
            Opcode::LogoutResponse => self.logout_response(bhs)?,
            Opcode::AsyncMessage => self.async_message(bhs, data)?,
            Opcode::Reject => self.reject(bhs, data)?,
            _ => return Err(ProtocolError::UnexpectedOpcode(raw)),
        }
        // The window may have opened.
        self.flush_queue();
        Ok(())
    }

    fn stat_sn(&mut self, stat_sn: u32, op: Opcode, bhs: &Bhs) {
        // A NOP-In that answers nothing carries the next StatSN without consuming it.
        let advances = !(op == Opcode::NopIn && bhs.itt() == RESERVED_TAG);
        let next = if advances {
            stat_sn.wrapping_add(1)
        } else {
            stat_sn
        };
        if serial::lt(self.exp_stat_sn, next) {
            self.exp_stat_sn = next;
        }
    }

    fn window(&mut self, exp: u32, max: u32) {
        // RFC 7143 §4.2.2.1: ignore values with MaxCmdSN < ExpCmdSN - 1.
        if serial::lt(max, exp.wrapping_sub(1)) {
            return;
        }
        if serial::lt(self.exp_cmd_sn, exp) {
            self.exp_cmd_sn = exp;
        }
        if serial::lt(self.max_cmd_sn, max) {
            self.max_cmd_sn = max;
        }
    }

    fn window_open(&self) -> bool {
        serial::le(self.cmd_sn, self.max_cmd_sn)
    }

    fn flush_queue(&mut self) {
        while self.window_open() {
            let Some(itt) = self.queued.pop_front() else {
                break;
            };
            self.send_command(itt);
        }
    }

    fn send_command(&mut self, itt: u32) {
        let cmd_sn = self.cmd_sn;
        let exp_stat_sn = self.exp_stat_sn;
        let p = &self.params;
        let max_seg = p.max_xmit_data_segment_length.max(512) as usize;
        let (immediate_data, initial_r2t, first_burst) = (
            p.immediate_data,
            p.initial_r2t,
            p.first_burst_length as usize,
        );
        let (slots, out, tx) = (&mut self.slots, &mut self.out, &self.tx);
        let Some(Task::Scsi(t)) = slot_task(slots, itt) else {
            return;
        };
        self.cmd_sn = cmd_sn.wrapping_add(1);
        t.cmd_sn = cmd_sn;
        t.sent = true;
        let mut bhs = Bhs::new(Opcode::ScsiCommand);
        let mut flags = t.attr as u8;
        match t.dir {
            Dir::Read => flags |= 0x40,
            Dir::Write => flags |= 0x20,
            Dir::None => {}
        }
        let lun = encode_lun(t.lun);
        bhs.set_lun(lun);
        bhs.set_itt(itt);
        bhs.set_u32(off::EDTL, t.edtl);
        bhs.set_u32(off::CMD_SN, cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, exp_stat_sn);
        bhs.0[off::CDB..off::CDB + 16].copy_from_slice(t.cdb.padded());
        let len = t.write_len();
        let (imm, unsolicited_end) = match t.dir {
            Dir::Write => {
                let imm = if immediate_data {
                    len.min(first_burst).min(max_seg)
                } else {
                    0
                };
                let end = if initial_r2t {
                    imm
                } else {
                    len.min(first_burst).max(imm)
                };
                (imm, end)
            }
            _ => (0, 0),
        };
        if unsolicited_end <= imm {
            flags |= 0x80;
        }
        bhs.set_flags(flags);
        t.put_data(out, &bhs, 0..imm.min(len), tx);
        if unsolicited_end > imm {
            data_out(
                out,
                tx,
                lun,
                itt,
                RESERVED_TAG,
                exp_stat_sn,
                t,
                imm..unsolicited_end,
                max_seg,
            );
        }
    }

    fn nop_in(&mut self, bhs: &Bhs, data: &[u8], now: Instant) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        if itt != RESERVED_TAG {
            let Some(Task::Ping { .. }) = self.task(itt) else {
                return Err(unknown(bhs));
            };
            if let Some(Task::Ping {
                tag,
                sent,
                internal,
                ..
            }) = self.release(itt)
            {
                if internal {
                    self.ping_outstanding = false;
                } else {
                    self.events.push_back(Event::Pong {
                        tag,
                        result: Ok(now.saturating_duration_since(sent)),
                    });
                }
            }
            return Ok(());
        }
        let ttt = bhs.u32_at(off::TTT);
        if ttt != RESERVED_TAG {
            // The target pings us: answer with its TTT and its data.
            let mut reply = Bhs::new(Opcode::NopOut);
            reply.set_immediate(true);
            reply.set_flags(0x80);
            reply.set_lun(bhs.lun());
            reply.set_itt(RESERVED_TAG);
            reply.set_u32(off::TTT, ttt);
            reply.set_u32(off::CMD_SN, self.cmd_sn);
            reply.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
            let echo = data
                .get(..data.len().min(self.tx.max_data_segment_len))
                .unwrap_or(&[]);
            self.push(&reply, echo);
        }
        Ok(())
    }

    fn scsi_response(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let Some(Task::Scsi(_)) = self.task(itt) else {
            return Err(unknown(bhs));
        };
        let response = bhs.byte(off::RESPONSE);
        let status = bhs.byte(off::STATUS);
        let residual = residual(bhs.flags(), bhs.u32_at(off::RESIDUAL));
        let sense = match data.get(..2) {
            Some(len) => {
                let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
                let raw = data.get(2..2 + len).ok_or(ProtocolError::Malformed(
                    "sense length past the data segment",
                ))?;
                Sense::parse(raw)
            }
            None => None,
        };
        let result = if response != 0 {
            Err(CommandError::TargetFailure(response))
        } else {
            Ok((status, sense, residual))
        };
        self.finish_scsi(itt, result);
        Ok(())
    }

    fn finish_scsi(
        &mut self,
        itt: u32,
        result: Result<(u8, Option<Sense>, Residual), CommandError>,
    ) {
        let Some(Task::Scsi(t)) = self.release(itt) else {
            return;
        };
        self.scsi_outstanding -= 1;
        if t.abandoned {
            return;
        }
        self.scsi_waiting -= 1;
        let result = result.map(|(status, sense, residual)| {
            let mut data = t.buf;
            if matches!(t.dir, Dir::Read) {
                data.truncate(t.high as usize);
            }
            ScsiResult {
                status,
                data,
                sense,
                residual,
            }
        });
        self.events
            .push_back(Event::Completed(Completion { tag: t.tag, result }));
    }

    fn data_in(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let flags = bhs.flags();
        let status_here = flags & 0x01 != 0;
        let in_order = self.params.data_pdu_in_order;
        let Some(Task::Scsi(t)) = self.task_mut(itt) else {
            return Err(unknown(bhs));
        };
        if !matches!(t.dir, Dir::Read) {
            return Err(ProtocolError::WrongDirection {
                itt,
                opcode: bhs.opcode_raw(),
            });
        }
        let data_sn = bhs.u32_at(off::DATA_SN);
        if data_sn != t.next_data_sn {
            return Err(ProtocolError::DataSn {
                itt,
                got: data_sn,
                want: t.next_data_sn,
            });
        }
        t.next_data_sn = data_sn.wrapping_add(1);
        let offset = bhs.u32_at(off::BUFFER_OFFSET);
        if in_order && offset != t.high {
            return Err(ProtocolError::Malformed(
                "Data-In out of order though DataPDUInOrder=Yes",
            ));
        }
        let end = u64::from(offset) + data.len() as u64;
        if end > u64::from(t.edtl) {
            return Err(ProtocolError::DataBeyondLength {
                itt,
                end,
                expected: t.edtl,
            });
        }
        // `end` <= edtl == buf.len(), so the range exists.
        if let Some(dst) = t.buf.get_mut(offset as usize..end as usize) {
            dst.copy_from_slice(data);
        }
        t.high = t.high.max(end as u32);
        if status_here {
            if flags & 0x80 == 0 {
                return Err(ProtocolError::Malformed("Data-In with S but not F"));
            }
            self.stat_sn(bhs.u32_at(off::STAT_SN), Opcode::DataIn, bhs);
            let residual = residual(flags, bhs.u32_at(off::RESIDUAL));
            self.finish_scsi(itt, Ok((bhs.byte(off::STATUS), None, residual)));
        }
        Ok(())
    }

    fn r2t(&mut self, bhs: &Bhs) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let ttt = bhs.u32_at(off::TTT);
        let offset = bhs.u32_at(off::BUFFER_OFFSET);
        let len = bhs.u32_at(off::DESIRED_LENGTH);
        let max_burst = self.params.max_burst_length;
        let max_seg = self.params.max_xmit_data_segment_length.max(512) as usize;
        let exp_stat_sn = self.exp_stat_sn;
        let (slots, out, tx) = (&mut self.slots, &mut self.out, &self.tx);
        let Some(Task::Scsi(t)) = slot_task(slots, itt) else {
            return Err(unknown(bhs));
        };
        if !matches!(t.dir, Dir::Write) {
            return Err(ProtocolError::WrongDirection {
                itt,
                opcode: bhs.opcode_raw(),
            });
        }
        let end = u64::from(offset) + u64::from(len);
        if len == 0 || len > max_burst || end > t.write_len() as u64 || ttt == RESERVED_TAG {
            return Err(ProtocolError::BadR2t { itt, offset, len });
        }
        let lun = encode_lun(t.lun);
        data_out(
            out,
            tx,
            lun,
            itt,
            ttt,
            exp_stat_sn,
            t,
            offset as usize..end as usize,
            max_seg,
        );
        Ok(())
    }

    fn tmf_response(&mut self, bhs: &Bhs) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let Some(Task::Tmf { .. }) = self.task(itt) else {
            return Err(unknown(bhs));
        };
        let Some(Task::Tmf {
            tag,
            tmf,
            referenced,
            cmd_sn,
            internal,
            ..
        }) = self.release(itt)
        else {
            return Ok(());
        };
        let response = bhs.byte(off::RESPONSE);
        // What the function ended: the target sends no status for those commands.
        let ended: Vec<u32> = match (tmf, response) {
            (Tmf::AbortTask { .. }, 0 | 1) => referenced.into_iter().collect(),
            (Tmf::AbortTask { .. }, _) => Vec::new(),
            (_, 0) => {
                let lun = tmf.lun();
                self.slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| match &s.task {
                        Some(Task::Scsi(t))
                            if t.sent
                                && serial::lt(t.cmd_sn, cmd_sn)
                                && lun.is_none_or(|l| l == t.lun) =>
                        {
                            Some(itt_of(i, s.generation))
                        }
                        _ => None,
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        for done in ended {
            if let Some(Task::Scsi(_)) = self.task(done) {
                self.finish_scsi(done, Err(CommandError::Aborted));
            }
        }
        if !internal {
            self.events.push_back(Event::TaskManagement {
                tag,
                result: Ok(response),
            });
        }
        Ok(())
    }

    fn text_response(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let Some(Task::Text { buf, .. }) = self.task_mut(itt) else {
            return Err(unknown(bhs));
        };
        if buf.len() + data.len() > TEXT_RESPONSE_MAX {
            return Err(ProtocolError::TextTooLong(TEXT_RESPONSE_MAX));
        }
        buf.extend_from_slice(data);
        let flags = bhs.flags();
        if flags & 0x40 != 0 {
            if flags & 0x80 != 0 {
                return Err(ProtocolError::Malformed("Text Response with both F and C"));
            }
            // Ask for the rest with the target's TTT.
            let mut req = Bhs::new(Opcode::TextRequest);
            req.set_immediate(true);
            req.set_flags(0x80);
            req.set_itt(itt);
            req.set_u32(off::TTT, bhs.u32_at(off::TTT));
            req.set_u32(off::CMD_SN, self.cmd_sn);
            req.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
            self.push(&req, &[]);
            return Ok(());
        }
        let Some(Task::Text { tag, buf, .. }) = self.release(itt) else {
            return Ok(());
        };
        let targets = parse_send_targets(&buf)?;
        self.events.push_back(Event::SendTargets {
            tag,
            result: Ok(targets),
        });
        Ok(())
    }

    fn logout_response(&mut self, bhs: &Bhs) -> Result<(), ProtocolError> {
        let itt = bhs.itt();
        let Some(Task::Logout { .. }) = self.task(itt) else {
            return Err(unknown(bhs));
        };
        if let Some(Task::Logout { tag, .. }) = self.release(itt) {
            self.events.push_back(Event::LoggedOut {
                tag,
                result: Ok(bhs.byte(off::RESPONSE)),
            });
        }
        self.connection_lost("logged out");
        self.state = State::LoggedOut;
        Ok(())
    }

    fn async_message(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), ProtocolError> {
        let event = bhs.byte(off::ASYNC_EVENT);
        let parameters =
            [off::PARAMETER1, off::PARAMETER2, off::PARAMETER3].map(|at| bhs.u16_at(at));
        let sense = match data.get(..2) {
            Some(len) => {
                let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
                data.get(2..2 + len).and_then(Sense::parse)
            }
            None => None,
        };
        if event == 1 {
            self.unsolicited(Event::LogoutRequested {
                within: Duration::from_secs(u64::from(parameters[2])),
            });
        }
        self.unsolicited(Event::Async(AsyncMessage {
            event,
            lun: crate::scsi::decode_lun(bhs.lun()),
            sense,
            parameters,
        }));
        Ok(())
    }

    fn reject(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), ProtocolError> {
        let reason = bhs.byte(off::REASON);
        let rejected = Bhs::from_slice(data).ok_or(ProtocolError::Malformed(
            "Reject without the rejected header",
        ))?;
        let itt = rejected.itt();
        match self.task(itt) {
            Some(Task::Scsi(_)) => {
                self.finish_scsi(itt, Err(CommandError::Rejected(reason)));
            }
            Some(_) => {
                let err = CommandError::Rejected(reason);
                let event = match self.release(itt) {
                    Some(Task::Tmf {
                        tag,
                        internal: false,
                        ..
                    }) => Some(Event::TaskManagement {
                        tag,
                        result: Err(err),
                    }),
                    Some(Task::Ping { internal: true, .. }) => {
                        self.ping_outstanding = false;
                        None
                    }
                    Some(Task::Ping { tag, .. }) => Some(Event::Pong {
                        tag,
                        result: Err(err),
                    }),
                    Some(Task::Text { tag, .. }) => Some(Event::SendTargets {
                        tag,
                        result: Err(err),
                    }),
                    Some(Task::Logout { tag, .. }) => {
                        self.state = State::FullFeature;
                        Some(Event::LoggedOut {
                            tag,
                            result: Err(err),
                        })
                    }
                    _ => None,
                };
                self.events.extend(event);
            }
            None => self.unsolicited(Event::Rejected { reason, itt }),
        }
        Ok(())
    }

    /// Queues an event the target sent on its own (async message, stray reject): at most
    /// [`UNSOLICITED_EVENTS_MAX`] wait at a time, later ones are dropped and counted.
    fn unsolicited(&mut self, event: Event) {
        if self.events.len() >= UNSOLICITED_EVENTS_MAX {
            self.dropped_events += 1;
            return;
        }
        self.events.push_back(event);
    }

    /// Events the target sent on its own that were dropped because too many were waiting.
    pub fn dropped_events(&self) -> u64 {
        self.dropped_events
    }

    fn push(&mut self, bhs: &Bhs, data: &[u8]) {
        pdu::encode_into(self.out.vec(), bhs, data, &self.tx);
    }

    /// Bytes queued for sending (for the driver's flow control).
    pub fn output_len(&self) -> usize {
        self.out.len()
    }

    fn alloc(&mut self, task: Task) -> Option<u32> {
        let index = self.free.pop()?;
        let slot = self.slots.get_mut(usize::from(index))?;
        slot.task = Some(task);
        Some(itt_of(usize::from(index), slot.generation))
    }

    fn alloc_control(&mut self, task: Task) -> Result<u32, Error> {
        if self.control_outstanding >= CONTROL_SLOTS {
            return Err(Error::Full);
        }
        let itt = self.alloc(task).ok_or(Error::Full)?;
        self.control_outstanding += 1;
        Ok(itt)
    }

    fn task(&self, itt: u32) -> Option<&Task> {
        let (index, generation) = split_itt(itt);
        let slot = self.slots.get(index)?;
        (slot.generation == generation)
            .then_some(slot.task.as_ref())
            .flatten()
    }

    fn task_mut(&mut self, itt: u32) -> Option<&mut Task> {
        slot_task(&mut self.slots, itt)
    }

    /// Frees the slot of `itt` (the ITT is never valid again) and returns its task.
    fn release(&mut self, itt: u32) -> Option<Task> {
        let (index, generation) = split_itt(itt);
        let slot = self.slots.get_mut(index)?;
        if slot.generation != generation {
            return None;
        }
        let task = slot.task.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(index as u16);
        if !matches!(task, Task::Scsi(_)) {
            self.control_outstanding = self.control_outstanding.saturating_sub(1);
        }
        Some(task)
    }

    fn find_scsi(&self, pred: impl Fn(&ScsiTask) -> bool) -> Option<u32> {
        self.slots
            .iter()
            .enumerate()
            .find_map(|(i, s)| match &s.task {
                Some(Task::Scsi(t)) if !t.abandoned && pred(t) => Some(itt_of(i, s.generation)),
                _ => None,
            })
    }
}

fn itt_of(index: usize, generation: u16) -> u32 {
    (u32::from(generation) << 16) | (index as u32 & 0xffff)
}

fn split_itt(itt: u32) -> (usize, u16) {
    ((itt & 0xffff) as usize, (itt >> 16) as u16)
}

fn slot_task(slots: &mut [Slot], itt: u32) -> Option<&mut Task> {
    let (index, generation) = split_itt(itt);
    let slot = slots.get_mut(index)?;
    if slot.generation != generation {
        return None;
    }
    slot.task.as_mut()
}

fn unknown(bhs: &Bhs) -> ProtocolError {
    ProtocolError::UnknownItt {
        opcode: bhs.opcode_raw(),
        itt: bhs.itt(),
    }
}

fn residual(flags: u8, count: u32) -> Residual {
    if flags & 0x02 != 0 {
        Residual::Under(count)
    } else if flags & 0x04 != 0 {
        Residual::Over(count)
    } else {
        Residual::None
    }
}

/// Data-Out PDUs for bytes `range` of task `t`'s write data: DataSN from 0, segments of at
/// most `max_seg`, F on the last.
#[allow(clippy::too_many_arguments)]
fn data_out(
    out: &mut Outbuf,
    tx: &Framing,
    lun: [u8; 8],
    itt: u32,
    ttt: u32,
    exp_stat_sn: u32,
    t: &ScsiTask,
    range: std::ops::Range<usize>,
    max_seg: usize,
) {
    let max_seg = max_seg.max(1);
    let count = range.len().div_ceil(max_seg);
    for sn in 0..count {
        let start = range.start + sn * max_seg;
        let end = (start + max_seg).min(range.end);
        let mut bhs = Bhs::new(Opcode::DataOut);
        if sn + 1 == count {
            bhs.set_flags(0x80);
        }
        bhs.set_lun(lun);
        bhs.set_itt(itt);
        bhs.set_u32(off::TTT, ttt);
        bhs.set_u32(off::EXP_STAT_SN, exp_stat_sn);
        bhs.set_u32(off::DATA_SN, sn as u32);
        bhs.set_u32(off::BUFFER_OFFSET, start as u32);
        t.put_data(out, &bhs, start..end, tx);
    }
}

/// Parses a SendTargets answer: `TargetName=` starts a target, `TargetAddress=` values
/// (`address[,tpgt]`) belong to the last one.
pub fn parse_send_targets(text: &[u8]) -> Result<Vec<DiscoveredTarget>, ProtocolError> {
    let mut targets: Vec<DiscoveredTarget> = Vec::new();
    for item in text.split(|&b| b == 0).filter(|i| !i.is_empty()) {
        let item = std::str::from_utf8(item)
            .map_err(|_| ProtocolError::Text(iscsi::text::TextError::NotUtf8))?;
        let (key, value) = item
            .split_once('=')
            .ok_or(ProtocolError::Text(iscsi::text::TextError::MissingEquals))?;
        match key {
            "TargetName" => targets.push(DiscoveredTarget {
                name: value.to_string(),
                addresses: Vec::new(),
            }),
            "TargetAddress" => {
                let target = targets
                    .last_mut()
                    .ok_or(ProtocolError::Malformed("TargetAddress before TargetName"))?;
                let (addr, tpgt) = match value.rsplit_once(',') {
                    Some((a, t)) => (
                        a,
                        Some(t.parse::<u16>().map_err(|_| ProtocolError::BadValue {
                            key: key.into(),
                            value: value.into(),
                        })?),
                    ),
                    None => (value, None),
                };
                target.addresses.push((addr.to_string(), tpgt));
            }
            _ => {}
        }
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{self, events, feed, take, target_pdu, Sent};
    use crate::scsi;

    fn new_session(max_cmd_sn: u32) -> (Session, Instant) {
        let now = Instant::now();
        (
            fake::session(fake::config(), fake::params(), max_cmd_sn, now),
            now,
        )
    }

    fn completions(s: &mut Session) -> Vec<Completion> {
        events(s)
            .into_iter()
            .filter_map(|e| match e {
                Event::Completed(c) => Some(c),
                _ => None,
            })
            .collect()
    }

    fn data_in(itt: u32, data_sn: u32, offset: u32, status: Option<u8>) -> Bhs {
        let mut b = target_pdu(Opcode::DataIn, itt, 100, 11, 40);
        b.set_u32(off::DATA_SN, data_sn);
        b.set_u32(off::BUFFER_OFFSET, offset);
        if let Some(st) = status {
            b.set_flags(0x81);
            b.set_byte(off::STATUS, st);
        }
        b
    }

    fn response(itt: u32, stat_sn: u32, status: u8) -> Bhs {
        let mut b = target_pdu(Opcode::ScsiResponse, itt, stat_sn, 11, 40);
        b.set_flags(0x80);
        b.set_byte(off::STATUS, status);
        b
    }

    /// An R2T (TTT 0xabc, StatSN 100) for `len` bytes at `offset` of command `itt`.
    fn r2t(itt: u32, offset: u32, len: u32) -> Bhs {
        let mut b = target_pdu(Opcode::R2t, itt, 100, 11, 40);
        b.set_flags(0x80);
        b.set_u32(off::TTT, 0xabc);
        b.set_u32(off::BUFFER_OFFSET, offset);
        b.set_u32(off::DESIRED_LENGTH, len);
        b
    }

    fn submit_read(s: &mut Session, tag: u64, len: u32, now: Instant) -> (u32, Sent) {
        let itt = s
            .submit(
                Command::read(tag, 0, scsi::read10(0, (len / 512) as u16), len),
                now,
            )
            .unwrap();
        let mut sent = take(s);
        assert_eq!(sent.len(), 1);
        (itt, sent.remove(0))
    }

    #[test]
    fn read_reassembles_data_in_and_takes_the_collapsed_status() {
        let now = Instant::now();
        let mut p = fake::params();
        p.data_pdu_in_order = false;
        let mut s = fake::session(fake::config(), p, 40, now);
        let (itt, cmd) = submit_read(&mut s, 77, 8192, now);
        assert_eq!(cmd.op(), Opcode::ScsiCommand as u8);
        assert_eq!(cmd.bhs.flags(), 0x80 | 0x40 | 1, "F, R, SIMPLE");
        assert_eq!(cmd.bhs.u32_at(off::EDTL), 8192);
        assert_eq!(cmd.bhs.u32_at(off::CMD_SN), 10);
        assert_eq!(cmd.bhs.u32_at(off::EXP_STAT_SN), 100);
        assert_eq!(
            &cmd.bhs.0[off::CDB..off::CDB + 10],
            scsi::read10(0, 16).as_bytes()
        );
        assert_eq!(s.in_flight(), 1);
        // Second half first: reassembly is by offset.
        let a: Vec<u8> = (0..4096).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
        feed(&mut s, &data_in(itt, 0, 4096, None), &b, now).unwrap();
        feed(&mut s, &data_in(itt, 1, 0, Some(0)), &a, now).unwrap();
        let c = completions(&mut s);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].tag, 77);
        let r = c[0].result.as_ref().unwrap();
        assert!(r.is_good());
        assert_eq!(&r.data[..4096], &a[..]);
        assert_eq!(&r.data[4096..], &b[..]);
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.command_window(), (11, 11, 40));
        // The ExpStatSN moved past the status's StatSN.
        s.submit(Command::none(1, 0, scsi::test_unit_ready()), now)
            .unwrap();
        assert_eq!(take(&mut s)[0].bhs.u32_at(off::EXP_STAT_SN), 101);
    }

    #[test]
    fn in_order_reads_need_no_zeroing_and_refuse_disorder() {
        let (mut s, now) = new_session(40);
        // A recycled buffer with old bytes: the answer overwrites what it covers and the
        // result is cut to what arrived.
        let cmd = Command::read(1, 0, scsi::read10(0, 8), 4096).with_buffer(vec![0xee; 8192]);
        let itt = s.submit(cmd, now).unwrap();
        take(&mut s);
        feed(&mut s, &data_in(itt, 0, 0, None), &[1; 1024], now).unwrap();
        let mut last = data_in(itt, 1, 1024, Some(0));
        last.set_flags(0x80 | 0x02 | 0x01);
        last.set_u32(off::RESIDUAL, 2048);
        feed(&mut s, &last, &[2; 1024], now).unwrap();
        let r = completions(&mut s).remove(0).result.unwrap();
        assert_eq!(r.data.len(), 2048);
        assert!(r.data[..1024].iter().all(|&b| b == 1) && r.data[1024..].iter().all(|&b| b == 2));
        assert_eq!(r.residual, Residual::Under(2048));
        // Out of order although DataPDUInOrder=Yes.
        let (itt, _) = submit_read(&mut s, 2, 4096, now);
        let e = feed(&mut s, &data_in(itt, 0, 512, None), &[0; 512], now).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ProtocolError::Malformed(_))),
            "{e}"
        );
    }

    #[test]
    fn short_read_reports_the_residual_and_sense() {
        let (mut s, now) = new_session(40);
        let (itt, _) = submit_read(&mut s, 1, 4096, now);
        feed(&mut s, &data_in(itt, 0, 0, None), &[9u8; 512], now).unwrap();
        let mut r = response(itt, 100, 0);
        r.set_flags(0x80 | 0x02);
        r.set_u32(off::RESIDUAL, 3584);
        feed(&mut s, &r, &[], now).unwrap();
        let c = completions(&mut s);
        let res = c[0].result.as_ref().unwrap();
        assert_eq!(res.data, vec![9u8; 512]);
        assert_eq!(res.residual, Residual::Under(3584));

        let (itt, _) = submit_read(&mut s, 2, 4096, now);
        let mut sense = vec![0u8; 20];
        sense[1] = 18;
        sense[2] = 0x70;
        sense[4] = 0x06;
        sense[14] = 0x29;
        feed(
            &mut s,
            &response(itt, 101, scsi::status::CHECK_CONDITION),
            &sense,
            now,
        )
        .unwrap();
        let c = completions(&mut s);
        let res = c[0].result.as_ref().unwrap();
        assert!(res.is_unit_attention());
        assert_eq!(res.sense.as_ref().map(|s| s.asc), Some(0x29));

        // Sense length past the data segment: malformed, the connection fails.
        let (itt, _) = submit_read(&mut s, 3, 4096, now);
        let e = feed(&mut s, &response(itt, 102, 2), &[0, 40, 0x70, 0], now).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ProtocolError::Malformed(_))),
            "{e}"
        );
        assert_eq!(s.state(), State::Failed);
        let c = completions(&mut s);
        assert!(matches!(c[0].result, Err(CommandError::ConnectionLost(_))));
    }

    #[test]
    fn data_in_violations_fail_the_connection() {
        type Case = fn(u32) -> (Bhs, Vec<u8>);
        let cases: [(Case, &str); 6] = [
            (|itt| (data_in(itt, 0, 4000, None), vec![0; 200]), "beyond"),
            (|itt| (data_in(itt, 0, 0, None), vec![0; 4100]), "beyond"),
            (|itt| (data_in(itt, 1, 0, None), vec![0; 10]), "datasn"),
            (
                |itt| (data_in(itt ^ 0x0001_0000, 0, 0, None), vec![0; 10]),
                "stale itt",
            ),
            (
                |_| (data_in(0x1234, 0, 0, None), vec![0; 10]),
                "unknown itt",
            ),
            (
                |itt| (data_in(itt, 0, u32::MAX, None), vec![0; 10]),
                "offset overflow",
            ),
        ];
        for (case, what) in cases {
            // Out-of-order data allowed, so offsets are checked against the length alone.
            let now = Instant::now();
            let mut p = fake::params();
            p.data_pdu_in_order = false;
            let mut s = fake::session(fake::config(), p, 40, now);
            let (itt, _) = submit_read(&mut s, 5, 4096, now);
            let (bhs, data) = case(itt);
            let e = feed(&mut s, &bhs, &data, now).unwrap_err();
            let ok = match what {
                "beyond" | "offset overflow" => {
                    matches!(e, Error::Protocol(ProtocolError::DataBeyondLength { .. }))
                }
                "datasn" => matches!(
                    e,
                    Error::Protocol(ProtocolError::DataSn {
                        got: 1,
                        want: 0,
                        ..
                    })
                ),
                _ => matches!(e, Error::Protocol(ProtocolError::UnknownItt { .. })),
            };
            assert!(ok, "{what}: {e}");
            let c = completions(&mut s);
            assert_eq!(c.len(), 1, "{what}");
            assert!(matches!(c[0].result, Err(CommandError::ConnectionLost(_))));
            assert!(s
                .submit(Command::none(1, 0, scsi::test_unit_ready()), now)
                .is_err());
        }
        // Data-In for a write.
        let (mut s, now) = new_session(40);
        let itt = s
            .submit(Command::write(1, 0, scsi::write10(0, 1), vec![0; 512]), now)
            .unwrap();
        let e = feed(&mut s, &data_in(itt, 0, 0, None), &[0; 4], now).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ProtocolError::WrongDirection { .. })),
            "{e}"
        );
    }

    #[test]
    fn write_sends_immediate_unsolicited_then_solicited_data() {
        let (mut s, now) = new_session(40);
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let itt = s
            .submit(
                Command::write(9, 2, scsi::write10(0, 40), data.clone()),
                now,
            )
            .unwrap();
        let sent = take(&mut s);
        // Immediate data: min(FirstBurst 8192, target MRDSL 4096); then one unsolicited
        // Data-Out up to the first burst.
        assert_eq!(sent.len(), 2);
        assert_eq!(
            sent[0].bhs.flags(),
            0x20 | 1,
            "W, no F: unsolicited Data-Out follows"
        );
        assert_eq!(sent[0].bhs.lun(), scsi::encode_lun(2));
        assert_eq!(sent[0].data, &data[..4096]);
        assert_eq!(sent[1].op(), Opcode::DataOut as u8);
        assert_eq!(sent[1].bhs.flags(), 0x80);
        assert_eq!(sent[1].bhs.u32_at(off::TTT), RESERVED_TAG);
        assert_eq!(sent[1].bhs.u32_at(off::BUFFER_OFFSET), 4096);
        assert_eq!(sent[1].bhs.u32_at(off::DATA_SN), 0);
        assert_eq!(sent[1].data, &data[4096..8192]);
        // R2T for the rest.
        feed(&mut s, &r2t(itt, 8192, 20_000 - 8192), &[], now).unwrap();
        let outs = take(&mut s);
        assert_eq!(outs.len(), 3);
        let mut offset = 8192;
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.bhs.u32_at(off::TTT), 0xabc);
            assert_eq!(o.bhs.u32_at(off::DATA_SN), i as u32);
            assert_eq!(o.bhs.u32_at(off::BUFFER_OFFSET), offset);
            assert_eq!(o.bhs.flags() & 0x80 != 0, i == 2);
            assert!(o.data.len() <= 4096);
            assert_eq!(
                o.data,
                &data[offset as usize..offset as usize + o.data.len()]
            );
            offset += o.data.len() as u32;
        }
        assert_eq!(offset, 20_000);
        feed(&mut s, &response(itt, 100, 0), &[], now).unwrap();
        let c = completions(&mut s);
        assert_eq!(c[0].tag, 9);
        assert_eq!(
            c[0].result.as_ref().unwrap().data,
            data,
            "the buffer comes back"
        );
    }

    /// The wire bytes a session sends for a write: the command with immediate and
    /// unsolicited data, then the Data-Out an R2T asks for (as one stream, as `writev`
    /// sends it), and what the completion gives back.
    fn write_wire(p: &Negotiated, command: Command) -> (Vec<u8>, Vec<u8>) {
        let now = Instant::now();
        let mut s = fake::session(fake::config(), p.clone(), 40, now);
        let itt = s.submit(command, now).unwrap();
        let mut wire = Vec::new();
        let mut drain = |s: &mut Session| {
            let mut slices = Vec::new();
            s.output_slices(&mut slices);
            let bytes: Vec<u8> = slices.iter().flat_map(|p| p.iter().copied()).collect();
            assert_eq!(bytes.len(), s.output_len());
            wire.extend_from_slice(&bytes);
            // Sent in two writes: the cut may fall inside a spliced piece.
            let half = bytes.len() / 2;
            s.advance_output(half);
            s.advance_output(bytes.len() - half);
            assert_eq!(s.output_len(), 0);
        };
        drain(&mut s);
        feed(&mut s, &r2t(itt, 8192, 20_001 - 8192), &[], now).unwrap();
        drain(&mut s);
        feed(&mut s, &response(itt, 100, 0), &[], now).unwrap();
        let c = completions(&mut s);
        (wire, c[0].result.as_ref().unwrap().data.clone())
    }

    /// A write of shared data sends byte for byte what a write of its own copy sends
    /// (padding and digests included); its completion gives back an empty buffer.
    #[test]
    fn a_shared_write_sends_the_bytes_an_owned_one_does() {
        let data: Vec<u8> = (0..30_000u32).map(|i| (i % 251) as u8).collect();
        let shared: std::sync::Arc<[u8]> = data.clone().into();
        for digests in [false, true] {
            let mut p = fake::params();
            p.header_digest = digests;
            p.data_digest = digests;
            // 20,001 bytes: the last Data-Out is padded.
            let cdb = scsi::write10(0, 40);
            let owned = Command::write(9, 2, cdb, data[..20_001].to_vec());
            let (owned_wire, back) = write_wire(&p, owned);
            assert_eq!(back, &data[..20_001], "the owned buffer comes back");
            let (shared_wire, back) =
                write_wire(&p, Command::write_shared(9, 2, cdb, shared.clone(), 20_001));
            assert!(back.is_empty());
            assert_eq!(shared_wire, owned_wire, "digests {digests}");
        }
        let (mut s, now) = new_session(40);
        let cdb = scsi::write10(0, 40);
        let long = Command::write_shared(1, 0, cdb, shared.clone(), 30_001);
        assert!(matches!(s.submit(long, now), Err(Error::InvalidCommand(_))));
    }

    #[test]
    fn write_with_initial_r2t_and_no_immediate_data_waits_for_r2t() {
        let mut p = fake::params();
        p.initial_r2t = true;
        p.immediate_data = false;
        let now = Instant::now();
        let mut s = fake::session(fake::config(), p, 40, now);
        s.submit(Command::write(1, 0, scsi::write10(0, 1), vec![1; 512]), now)
            .unwrap();
        let sent = take(&mut s);
        assert_eq!(sent.len(), 1);
        assert!(sent[0].data.is_empty());
        assert_eq!(sent[0].bhs.flags(), 0x80 | 0x20 | 1);
    }

    #[test]
    fn bad_r2ts_fail_the_connection() {
        let cases: [(u32, u32, u32, &str); 5] = [
            (0, 0, 512, "unknown itt"),
            (1, 0, 0, "empty"),
            (1, 256, 512, "past the end"),
            (1, 0, 16_385, "over MaxBurstLength"),
            (1, u32::MAX, 2, "offset overflow"),
        ];
        for (which, offset, len, what) in cases {
            let (mut s, now) = new_session(40);
            let itt = s
                .submit(Command::write(1, 0, scsi::write10(0, 1), vec![0; 512]), now)
                .unwrap();
            take(&mut s);
            let mut r2t = target_pdu(
                Opcode::R2t,
                if which == 0 { 0x0042_0042 } else { itt },
                0,
                11,
                40,
            );
            r2t.set_u32(off::TTT, 5);
            r2t.set_u32(off::BUFFER_OFFSET, offset);
            r2t.set_u32(off::DESIRED_LENGTH, len);
            let e = feed(&mut s, &r2t, &[], now).unwrap_err();
            let ok = if which == 0 {
                matches!(
                    e,
                    Error::Protocol(ProtocolError::UnknownItt { opcode: 0x31, .. })
                )
            } else {
                matches!(e, Error::Protocol(ProtocolError::BadR2t { .. }))
            };
            assert!(ok, "{what}: {e}");
        }
        // R2T for a read.
        let (mut s, now) = new_session(40);
        let (itt, _) = submit_read(&mut s, 1, 512, now);
        let mut r2t = target_pdu(Opcode::R2t, itt, 0, 11, 40);
        r2t.set_u32(off::TTT, 5);
        r2t.set_u32(off::DESIRED_LENGTH, 512);
        let e = feed(&mut s, &r2t, &[], now).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ProtocolError::WrongDirection { .. })),
            "{e}"
        );
    }

    #[test]
    fn closed_window_queues_and_never_sends_past_max_cmd_sn() {
        // CmdSN 10, MaxCmdSN 11: two may go.
        let (mut s, now) = new_session(11);
        let mut itts = Vec::new();
        for tag in 0..5 {
            itts.push(
                s.submit(Command::none(tag, 0, scsi::test_unit_ready()), now)
                    .unwrap(),
            );
        }
        let sent = take(&mut s);
        assert_eq!(
            sent.iter()
                .map(|p| p.bhs.u32_at(off::CMD_SN))
                .collect::<Vec<_>>(),
            [10, 11]
        );
        assert_eq!(s.queued(), 3);
        assert_eq!(s.in_flight(), 5);
        // A NOP-In that moves nothing: still closed. A stale MaxCmdSN (< ExpCmdSN - 1) is ignored.
        let mut nop = target_pdu(Opcode::NopIn, RESERVED_TAG, 100, 12, 5);
        nop.set_u32(off::TTT, RESERVED_TAG);
        feed(&mut s, &nop, &[], now).unwrap();
        assert!(take(&mut s).is_empty());
        // The first status opens the window by one.
        let mut r = response(itts[0], 100, 0);
        r.set_u32(off::MAX_CMD_SN, 11);
        feed(&mut s, &r, &[], now).unwrap();
        assert!(take(&mut s).is_empty());
        let mut r = response(itts[1], 101, 0);
        r.set_u32(off::MAX_CMD_SN, 12);
        feed(&mut s, &r, &[], now).unwrap();
        let sent = take(&mut s);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].bhs.u32_at(off::CMD_SN), 12);
        assert_eq!(s.queued(), 2);
        // A wide window sends the rest.
        let mut nop = target_pdu(Opcode::NopIn, RESERVED_TAG, 102, 13, 100);
        nop.set_u32(off::TTT, RESERVED_TAG);
        feed(&mut s, &nop, &[], now).unwrap();
        assert_eq!(take(&mut s).len(), 2);
        assert_eq!(s.queued(), 0);
        // Immediate requests (ping) go even when the window is closed.
        let (mut s, now) = new_session(9);
        s.submit(Command::none(0, 0, scsi::test_unit_ready()), now)
            .unwrap();
        assert!(take(&mut s).is_empty());
        s.ping(1, now).unwrap();
        let sent = take(&mut s);
        assert_eq!(sent.len(), 1);
        assert!(sent[0].bhs.immediate());
    }

    #[test]
    fn outstanding_commands_are_bounded() {
        let mut c = fake::config();
        c.max_outstanding_commands = 3;
        let now = Instant::now();
        let mut s = fake::session(c, fake::params(), 2, now);
        for tag in 0..3 {
            s.submit(Command::none(tag, 0, scsi::test_unit_ready()), now)
                .unwrap();
        }
        assert!(matches!(
            s.submit(Command::none(3, 0, scsi::test_unit_ready()), now),
            Err(Error::Full)
        ));
        let long = Command {
            tag: 9,
            lun: 0,
            cdb: scsi::Cdb::new(&[0u8; 16]).unwrap(),
            transfer: Transfer::None,
            attr: TaskAttr::Simple,
        };
        assert!(s.submit(long, now).is_err());
    }

    #[test]
    fn target_pings_are_answered_and_ours_time_out() {
        let (mut s, now) = new_session(40);
        let mut nop = target_pdu(Opcode::NopIn, RESERVED_TAG, 100, 10, 40);
        nop.set_u32(off::TTT, 0x55);
        nop.set_lun(scsi::encode_lun(3));
        feed(&mut s, &nop, b"ping", now).unwrap();
        let sent = take(&mut s);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].op(), Opcode::NopOut as u8);
        assert_eq!(sent[0].bhs.itt(), RESERVED_TAG);
        assert_eq!(sent[0].bhs.u32_at(off::TTT), 0x55);
        assert_eq!(sent[0].bhs.lun(), scsi::encode_lun(3));
        assert_eq!(sent[0].data, b"ping");
        // It carried StatSN 100 without consuming it.
        s.ping(1, now).unwrap();
        let p = take(&mut s);
        assert_eq!(p[0].bhs.u32_at(off::EXP_STAT_SN), 100);
        let mut pong = target_pdu(Opcode::NopIn, p[0].bhs.itt(), 100, 10, 40);
        pong.set_u32(off::TTT, RESERVED_TAG);
        feed(&mut s, &pong, &[], now + Duration::from_millis(3)).unwrap();
        assert_eq!(
            events(&mut s),
            vec![Event::Pong {
                tag: 1,
                result: Ok(Duration::from_millis(3))
            }]
        );
        // Silence: after the NOP interval the session pings, and fails if unanswered.
        let interval = s.config.nop_interval.unwrap();
        assert_eq!(
            s.next_timeout(),
            Some(now + Duration::from_millis(3) + interval)
        );
        let t1 = now + interval + Duration::from_millis(3);
        s.handle_timeout(t1).unwrap();
        let ping = take(&mut s);
        assert_eq!(ping.len(), 1);
        assert_ne!(ping[0].bhs.itt(), RESERVED_TAG);
        let t2 = t1 + s.config.response_timeout;
        assert_eq!(s.next_timeout(), Some(t2));
        assert!(matches!(s.handle_timeout(t2), Err(Error::Timeout { .. })));
        assert_eq!(s.state(), State::Failed);
    }

    #[test]
    fn timed_out_commands_complete_and_are_aborted() {
        let (mut s, now) = new_session(40);
        let (itt, _) = submit_read(&mut s, 4, 4096, now);
        let deadline = now + s.config.command_timeout;
        assert!(s.next_timeout().unwrap() <= deadline);
        s.handle_timeout(deadline - Duration::from_millis(1)).ok();
        take(&mut s); // a keep-alive ping may go out
        s.handle_timeout(deadline).unwrap();
        let c = completions(&mut s);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].result, Err(CommandError::Timeout));
        assert_eq!(s.in_flight(), 0);
        let abort = take(&mut s)
            .into_iter()
            .find(|p| p.op() == Opcode::TaskMgmtRequest as u8)
            .expect("ABORT TASK");
        assert_eq!(abort.bhs.flags(), 0x81);
        assert_eq!(abort.bhs.u32_at(off::TTT), itt);
        assert_eq!(abort.bhs.u32_at(off::REF_CMD_SN), 10, "RefCmdSN");
        // Late data for the abandoned command is dropped; the abort's answer settles it.
        feed(&mut s, &data_in(itt, 0, 0, None), &[1; 100], now).unwrap();
        let mut tmf = target_pdu(Opcode::TaskMgmtResponse, abort.bhs.itt(), 100, 11, 40);
        tmf.set_flags(0x80);
        feed(&mut s, &tmf, &[], now).unwrap();
        assert!(events(&mut s).is_empty(), "internal abort: no event");
        assert_eq!(s.scsi_outstanding, 0);
        // A command never sent (window closed) just completes.
        let (mut s, now) = new_session(9);
        s.submit(Command::none(1, 0, scsi::test_unit_ready()), now)
            .unwrap();
        s.handle_timeout(now + s.config.command_timeout).unwrap();
        assert_eq!(completions(&mut s)[0].result, Err(CommandError::Timeout));
        assert_eq!(s.queued(), 0);
        assert!(take(&mut s)
            .iter()
            .all(|p| p.op() != Opcode::TaskMgmtRequest as u8));
    }

    #[test]
    fn lun_reset_ends_the_commands_it_aborted() {
        let (mut s, now) = new_session(40);
        let (a, _) = submit_read(&mut s, 1, 512, now);
        s.submit(Command::none(2, 1, scsi::test_unit_ready()), now)
            .unwrap();
        take(&mut s);
        let (_b, _) = submit_read(&mut s, 3, 512, now);
        take(&mut s);
        assert!(s
            .task_management(50, Tmf::AbortTask { lun: 0, task: 999 }, now)
            .is_err());
        s.task_management(51, Tmf::LunReset { lun: 0 }, now)
            .unwrap();
        let t = take(&mut s);
        assert_eq!(t[0].bhs.flags(), 0x85);
        assert!(t[0].bhs.immediate());
        // The first read finished before the reset.
        feed(&mut s, &data_in(a, 0, 0, Some(0)), &[0; 512], now).unwrap();
        let mut tmf = target_pdu(Opcode::TaskMgmtResponse, t[0].bhs.itt(), 101, 13, 40);
        tmf.set_flags(0x80);
        feed(&mut s, &tmf, &[], now).unwrap();
        let ev = events(&mut s);
        let tags: Vec<(u64, bool)> = ev
            .iter()
            .filter_map(|e| match e {
                Event::Completed(c) => Some((c.tag, c.result == Err(CommandError::Aborted))),
                _ => None,
            })
            .collect();
        assert_eq!(
            tags,
            vec![(1, false), (3, true)],
            "LUN 1's command is not touched"
        );
        assert!(ev.contains(&Event::TaskManagement {
            tag: 51,
            result: Ok(0)
        }));
        assert_eq!(s.in_flight(), 1);
        // TMF response for an ITT we never used.
        let bogus = target_pdu(Opcode::TaskMgmtResponse, 0x00ff_0001, 102, 13, 40);
        assert!(feed(&mut s, &bogus, &[], now).is_err());
    }

    #[test]
    fn rejects_fail_their_command() {
        let (mut s, now) = new_session(40);
        let (_, cmd) = submit_read(&mut s, 8, 512, now);
        let rej = target_pdu(Opcode::Reject, RESERVED_TAG, 100, 11, 40);
        let mut r = rej;
        r.set_byte(off::REASON, 0x09);
        feed(&mut s, &r, &cmd.bhs.0, now).unwrap();
        assert_eq!(
            completions(&mut s)[0].result,
            Err(CommandError::Rejected(9))
        );
        // A Reject of something nobody owns is an event; one without a header is malformed.
        let mut other = Bhs::new(Opcode::DataOut);
        other.set_itt(0x7777);
        feed(&mut s, &r, &other.0, now).unwrap();
        assert_eq!(
            events(&mut s),
            vec![Event::Rejected {
                reason: 9,
                itt: 0x7777
            }]
        );
        assert!(feed(&mut s, &r, &[1, 2, 3], now).is_err());
    }

    #[test]
    fn async_messages_become_events() {
        let (mut s, now) = new_session(40);
        let mut a = target_pdu(Opcode::AsyncMessage, RESERVED_TAG, 100, 10, 40);
        a.set_byte(off::ASYNC_EVENT, 1);
        a.set_u16(off::PARAMETER3, 7);
        feed(&mut s, &a, &[], now).unwrap();
        let ev = events(&mut s);
        assert_eq!(
            ev[0],
            Event::LogoutRequested {
                within: Duration::from_secs(7)
            }
        );
        let mut a = target_pdu(Opcode::AsyncMessage, RESERVED_TAG, 101, 10, 40);
        a.set_lun(scsi::encode_lun(2));
        let sense = [0u8, 4, 0x72, 0x06, 0x2a, 0x09];
        feed(&mut s, &a, &sense, now).unwrap();
        match &events(&mut s)[0] {
            Event::Async(m) => {
                assert_eq!((m.event, m.lun), (0, 2));
                assert_eq!(
                    m.sense.as_ref().map(|s| (s.key, s.asc, s.ascq)),
                    Some((6, 0x2a, 9))
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_flood_of_async_messages_is_bounded() {
        let (mut s, now) = new_session(40);
        let mut bytes = Vec::new();
        let f = fake::framing(s.negotiated());
        for sn in 0..(UNSOLICITED_EVENTS_MAX as u32 + 500) {
            let mut a = target_pdu(Opcode::AsyncMessage, RESERVED_TAG, 100 + sn, 10, 40);
            a.set_byte(off::ASYNC_EVENT, 4);
            bytes.extend(fake::encode(&a, &[], &f));
        }
        assert_eq!(s.receive(&bytes, now).unwrap(), bytes.len());
        assert_eq!(events(&mut s).len(), UNSOLICITED_EVENTS_MAX);
        assert_eq!(s.dropped_events(), 500);
        // Completions are never dropped.
        let (itt, _) = submit_read(&mut s, 1, 512, now);
        for sn in 0..(UNSOLICITED_EVENTS_MAX as u32) {
            let mut a = target_pdu(Opcode::AsyncMessage, RESERVED_TAG, 2000 + sn, 10, 40);
            a.set_byte(off::ASYNC_EVENT, 4);
            feed(&mut s, &a, &[], now).unwrap();
        }
        feed(&mut s, &data_in(itt, 0, 0, Some(0)), &[0; 512], now).unwrap();
        assert_eq!(completions(&mut s).len(), 1);
    }

    #[test]
    fn logout_ends_the_session() {
        let (mut s, now) = new_session(40);
        s.logout(5, now).unwrap();
        let l = take(&mut s);
        assert_eq!(l[0].op(), Opcode::LogoutRequest as u8);
        assert_eq!(l[0].bhs.flags(), 0x80);
        assert!(s
            .submit(Command::none(1, 0, scsi::test_unit_ready()), now)
            .is_err());
        let mut resp = target_pdu(Opcode::LogoutResponse, l[0].bhs.itt(), 100, 10, 40);
        resp.set_flags(0x80);
        feed(&mut s, &resp, &[], now).unwrap();
        assert_eq!(
            events(&mut s),
            vec![Event::LoggedOut {
                tag: 5,
                result: Ok(0)
            }]
        );
        assert_eq!(s.state(), State::LoggedOut);
    }

    #[test]
    fn send_targets_follows_continuations() {
        let now = Instant::now();
        let mut c = fake::config();
        c.kind = SessionKind::Discovery;
        let mut s = fake::session(c, fake::params(), 40, now);
        assert!(matches!(
            s.submit(Command::none(1, 0, scsi::test_unit_ready()), now),
            Err(Error::InvalidCommand(_))
        ));
        s.send_targets(3, now).unwrap();
        let req = take(&mut s);
        assert_eq!(req[0].key("SendTargets").as_deref(), Some("All"));
        let itt = req[0].bhs.itt();
        let text = fake::text(&[
            ("TargetName", "iqn.a:one"),
            ("TargetAddress", "10.0.0.1:3260,1"),
            ("TargetAddress", "[fe80::1]:3260,2"),
            ("TargetName", "iqn.a:two"),
        ]);
        let (p1, p2) = text.split_at(20);
        let mut r = target_pdu(Opcode::TextResponse, itt, 100, 10, 40);
        r.set_flags(0x40);
        r.set_u32(off::TTT, 0x99);
        feed(&mut s, &r, p1, now).unwrap();
        let cont = take(&mut s);
        assert_eq!(cont[0].bhs.u32_at(off::TTT), 0x99);
        assert!(cont[0].data.is_empty());
        let mut r = target_pdu(Opcode::TextResponse, itt, 101, 10, 40);
        r.set_flags(0x80);
        r.set_u32(off::TTT, RESERVED_TAG);
        feed(&mut s, &r, p2, now).unwrap();
        assert_eq!(
            events(&mut s),
            vec![Event::SendTargets {
                tag: 3,
                result: Ok(vec![
                    DiscoveredTarget {
                        name: "iqn.a:one".into(),
                        addresses: vec![
                            ("10.0.0.1:3260".into(), Some(1)),
                            ("[fe80::1]:3260".into(), Some(2))
                        ]
                    },
                    DiscoveredTarget {
                        name: "iqn.a:two".into(),
                        addresses: vec![]
                    }
                ])
            }]
        );
        assert!(parse_send_targets(b"TargetAddress=x\0").is_err());
        assert!(parse_send_targets(b"TargetName=a\0TargetAddress=x,y\0").is_err());
        assert!(parse_send_targets(b"TargetName\0").is_err());
    }

    #[test]
    fn header_digests_are_checked() {
        let mut p = fake::params();
        p.header_digest = true;
        p.data_digest = true;
        let now = Instant::now();
        let mut s = fake::session(fake::config(), p, 40, now);
        let (itt, cmd) = submit_read(&mut s, 1, 512, now);
        assert_eq!(cmd.bhs.itt(), itt, "our output carries valid digests");
        let f = fake::framing(s.negotiated());
        let mut bytes = fake::encode(&data_in(itt, 0, 0, Some(0)), &[5; 512], &f);
        assert_eq!(s.receive(&bytes[..60], now).unwrap(), 0);
        bytes[20] ^= 0xff;
        assert!(matches!(
            s.receive(&bytes, now),
            Err(Error::Protocol(ProtocolError::Frame(_)))
        ));
    }

    #[test]
    fn unexpected_and_unknown_opcodes_fail_the_connection() {
        for op in [0x23u8, 0x3e, 0x01, 0x10] {
            let (mut s, now) = new_session(40);
            let mut raw = [0u8; 48];
            raw[0] = op;
            assert!(s.receive(&raw, now).is_err(), "{op:#x}");
            assert_eq!(s.state(), State::Failed);
        }
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = fake::XorShift(0x9e37_79b9_7f4a_7c15);
        for round in 0..3000 {
            let (mut s, now) = new_session(40);
            let _ = submit_read(&mut s, 1, 8192, now);
            s.submit(
                Command::write(2, 0, scsi::write10(0, 16), vec![0; 8192]),
                now,
            )
            .unwrap();
            take(&mut s);
            // A plausible header with random fields, or pure noise.
            let len = (rng.next() % 200) as usize;
            let mut bytes = rng.bytes(48 + len);
            if round % 2 == 0 {
                let ops = [0x20u8, 0x21, 0x22, 0x24, 0x25, 0x26, 0x31, 0x32, 0x3f];
                bytes[0] = ops[(rng.next() % ops.len() as u64) as usize];
                bytes[4] = 0;
                bytes[5] = 0;
                bytes[6] = 0;
                bytes[7] = len as u8;
                // Point at a real ITT half of the time.
                if rng.next().is_multiple_of(2) {
                    bytes[16..20].copy_from_slice(&[0, 0, 0, (rng.next() % 2) as u8]);
                }
            }
            match s.receive(&bytes, now) {
                Ok(used) => assert!(used <= bytes.len()),
                Err(_) => assert_eq!(s.state(), State::Failed),
            }
            let _ = s.handle_timeout(now + Duration::from_secs(100));
            let _ = events(&mut s);

            let mut login = crate::login::Login::new(fake::config(), [0; 17]);
            take_login_bytes(&mut login);
            let _ = login.receive(&bytes);
        }
    }

    fn take_login_bytes(login: &mut crate::login::Login) {
        let n = login.output().len();
        login.advance_output(n);
    }
}
