//! The one connection driver: a connection's life after its login or Connect, whichever door
//! it came through. The door ([`Door`]: the iSCSI session in `connection.rs`, an NVMe/TCP
//! queue in `nvme/`) turns received bytes into commands and answers; this module decides
//! everything else once for both: when a turn runs and what follows it (the ring submitted and
//! reaped, answers sent in one write), the receive buffer's policy (`recv.rs`), receive
//! coalescing and busy polling (`wakeups.rs`), the memory budget, time (one alarm for the
//! nearest deadline: the door's own, a receive batch's, the housekeeping that follows work;
//! nothing wakes an idle session but its door's next deadline), parking an idle connection
//! whose door allows it ([`Driven::Parked`]: its drive given back, the door waits small until
//! its host sends), what it follows (nudged by
//! `shared/nudge.rs` when a topology is published, an LU changes or the daemon shuts down: a
//! topology change, a lost RBD image, a removed portal or the shutdown — ask the host to leave
//! where the door can, close when nothing is left or the grace is over), and every way a
//! connection ends, each with its typed reason (`closed.rs`).
//!
//! ```text
//!   socket ─▶ RecvBuf ─▶ Door::input ─▶ Backend (route, LU gate, ring, pool)
//!                ▲                         │ answered / completed
//!   wait: read · alarm · completions · ring · TMF drained · told to close or look
//!                                          ▼
//!   socket ◀─ send.rs / wire.rs ◀─ Outbox ◀─ Door::answered / completed
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use seam::outbox::Outbox;
use seam::Activity;
use tokio::sync::{mpsc, watch};

use super::alarm::Alarm;
use super::backend::{first_drained, ring_ready, Backend, Completed};
use super::closed::{Closed, Ended};
use super::lifecycle::{Leave, Lifecycle, Pace};
use super::recv::RecvBuf;
use super::wakeups::Wakeups;
use super::wire::Wire;
use crate::admission::prelogin;
use crate::shared::Shared;

/// Answers queued by one burst of completions before they are sent (bounds a connection's
/// Data-In memory while a device completes faster than the peer reads).
pub(super) const TURN_BYTES_MAX: usize = 4 << 20;

/// Write data at least this long that is still arriving (an iSCSI Data-Out or a command's
/// immediate data, an NVMe/TCP H2CData PDU) is received straight into the memory its write
/// goes from instead of through the receive buffer: one copy fewer per byte written.
pub(super) const IN_PLACE_MIN: usize = 64 * 1024;

/// Answers to long writes received in place that may wait for the writes behind them: a
/// deep queue's answers then go out together, as they do through the receive buffer, but
/// never more than a burst of them late.
pub(super) const HELD_ANSWERS_MAX: usize = 16;

/// How long, and for how many bytes, a connection this end closed goes on reading what its
/// peer still sends ([`Conn::linger`]): a host closes its own end within milliseconds of
/// seeing the close, and a peer that does not is not waited for longer.
const LINGER_TIME: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// What the driver owns of a connection: its stream, its receive buffer and its outbox.
pub(super) struct Conn {
    pub(super) stream: Wire,
    pub(super) buf: RecvBuf,
    pub(super) out: Outbox,
    pub(super) peer: SocketAddr,
    /// Answers to payloads received in place that wait in `out` for the next send
    /// ([`Door::holds_answers`]).
    pub(super) held: usize,
}

impl Conn {
    pub(super) fn new(stream: Wire, largest_pdu: usize, peer: SocketAddr) -> Conn {
        Conn {
            stream,
            buf: RecvBuf::new(largest_pdu),
            out: Outbox::new(64),
            peer,
            held: 0,
        }
    }

    /// Sends everything queued (`send.rs`, or through TLS).
    pub(super) async fn flush(&mut self) -> Result<(), Closed> {
        self.held = 0;
        if self.out.is_empty() {
            return Ok(());
        }
        self.stream.send(&mut self.out, self.peer).await
    }

    /// Ends a session's or queue's connection the way a host still sending can take: this
    /// end's FIN first (after TLS's close_notify), then what the host sends meanwhile read
    /// from the socket and dropped until it closes its own end (or [`LINGER_TIME`],
    /// [`LINGER_BYTES`]). A socket closed with input unread, or sent to once closed, answers
    /// with a reset; under Linux's nvme-tcp host a reset raises SIGPIPE in the application
    /// whose command met it (docs/NVME.md, *Linux hosts when the daemon dies*).
    pub(super) async fn linger(&mut self, alarm: &mut Alarm) {
        if alarm.set(Instant::now() + LINGER_TIME).is_err() {
            return;
        }
        // A TLS close_notify waits for room in the socket: the alarm bounds it.
        let shut = tokio::select! {
            biased;
            shut = self.stream.shutdown() => shut.is_ok(),
            _ = alarm.rung() => false,
        };
        if !shut {
            return;
        }
        // Raw bytes, TLS or not: nothing of them is read as the protocol any more.
        let socket = self.stream.socket();
        let mut sink = vec![0u8; 16 << 10];
        let mut read = 0;
        while read < LINGER_BYTES {
            tokio::select! {
                biased;
                ready = socket.readable() => match ready.map(|()| socket.try_read(&mut sink)) {
                    Ok(Ok(n)) if n > 0 => read += n,
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    // The host closed its end, or reset it.
                    _ => return,
                },
                _ = alarm.rung() => return,
            }
        }
    }

    /// A payload was received in place and its command handled. Its answers may wait for the
    /// next payload's ([`Door::holds_answers`]) only if no write still expects data: an R2T
    /// the host waits for is never held back.
    pub(super) fn placed(&mut self, no_write_expects_data: bool) {
        self.held = if no_write_expects_data {
            self.held + 1
        } else {
            HELD_ANSWERS_MAX
        };
    }

    /// Whether the answers queued may wait while another long payload is received in place
    /// ([`Door::holds_answers`]): within [`HELD_ANSWERS_MAX`] of them.
    pub(super) fn may_hold(&self) -> bool {
        self.held < HELD_ANSWERS_MAX
    }

    /// Receives the rest of a long payload straight into `dst`: the receive buffer begins
    /// with its PDU's header (`header` bytes) and the payload's first bytes, which are copied
    /// there; then `pad` bytes of padding are read past, and the next PDU's first
    /// `next_header` bytes land in the emptied buffer in the same read ([`read_placed`]).
    pub(super) async fn receive_placed(
        &mut self,
        dst: &mut [u8],
        header: usize,
        pad: usize,
        next_header: usize,
        wait: PlacedWait<'_>,
    ) -> Result<(), Closed> {
        let Some(buffered) = self.buf.pending().get(header..) else {
            return Err(Closed::Invariant("placed payload without its header"));
        };
        let have = buffered.len();
        let Some(into) = dst.get_mut(..have) else {
            return Err(Closed::Invariant("more buffered than the payload holds"));
        };
        into.copy_from_slice(buffered);
        self.buf.clear();
        let stop = self.buf.stop_at(next_header);
        let next = self.buf.tail(stop).unwrap_or_default();
        let unsent = Unsent {
            out: &mut self.out,
            peer: self.peer,
        };
        let payload = Placement { dst, have, pad };
        let behind = read_placed(&mut self.stream, unsent, payload, next, wait).await?;
        self.buf.received(behind);
        Ok(())
    }

    /// Whether the receive buffer may be given back while idle: only in the clear (through
    /// TLS, OpenSSL may hold decrypted bytes the socket does not show).
    fn may_give_back(&self) -> bool {
        self.stream.plain().is_some()
    }

    /// Gives the receive buffer back now if nothing is pending and the stream allows it.
    fn give_back_if_empty(&mut self) {
        let may = self.may_give_back();
        self.buf.give_back_if_empty(may);
    }
}

/// What a turn of input did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Turn {
    /// The session ends once the turn's answers are sent (a logout, a Disconnect).
    pub(super) close: bool,
    /// Every whole PDU buffered was handled (false: it stopped at a bound; run another).
    pub(super) drained: bool,
}

/// A door's part of a connection: its protocol. Every method runs on the connection's worker.
pub(super) trait Door {
    /// Whether the door can ask its host to leave (iSCSI: an Async Message asking for a
    /// logout); one that cannot is closed once nothing of its host's is outstanding.
    const CAN_ASK_TO_LEAVE: bool;

    fn conn(&mut self) -> &mut Conn;

    /// Handles the whole PDUs buffered, stopping early at a turn's bound or the memory
    /// budget.
    fn input(&mut self, backend: &mut Backend<'_>) -> Result<Turn, Closed>;

    /// Answers the commands in `backend.answered`; true when the session ends.
    fn answered(&mut self, backend: &mut Backend<'_>) -> bool;

    /// Answers a command completed off this thread; true when the session ends.
    fn completed(&mut self, backend: &mut Backend<'_>, done: Completed) -> bool;

    /// Answers the task management function `tag` whose LUs drained; true when the session
    /// ends.
    fn task_done(&mut self, tag: u32) -> bool;

    /// What the turns since the last call saw of the host's pipeline.
    fn take_activity(&mut self) -> Activity;

    /// Moves what the door encoded into the outbox, before a send.
    fn stage(&mut self) {}

    /// Between a drained turn and the wait: `Some(close)` when it handled input itself
    /// (iSCSI: a long write payload received straight into its command's buffer).
    fn between_turns(
        &mut self,
        _backend: &mut Backend<'_>,
        _wait: PlacedWait<'_>,
    ) -> impl Future<Output = Result<Option<bool>, Closed>> {
        async { Ok(None) }
    }

    /// Whether the answers queued may wait for the next turn's: the receive buffer begins
    /// with the header of a long payload [`Door::between_turns`] receives in place, which
    /// sends them before it waits on the socket ([`read_placed`]). A deep queue of long
    /// writes is then answered in bursts, one send and one wake-up of the host for several
    /// writes, instead of one each.
    fn holds_answers(&self) -> bool {
        false
    }

    /// Where the next read into the receive buffer stops.
    fn read_stop(&mut self) -> usize {
        self.conn().buf.capacity()
    }

    /// When the door next has something of its own to decide ([`Door::tick`]): a ping due,
    /// a silent peer's, a keep-alive's or an authentication's deadline. None: nothing until
    /// the host sends. May move at every turn; the driver arms the earliest it has seen.
    fn deadline(&self) -> Option<Instant>;

    /// The door's own verdicts once its deadline passed (pings, keep-alive, an authentication
    /// deadline); `Some` ends the session, logged and counted by the door. `congested`: the
    /// connection stopped reading (silence then proves nothing). Harmless when nothing is due.
    fn tick(&mut self, backend: &mut Backend<'_>, now: Instant, congested: bool) -> Option<Ended>;

    /// Something the session follows changed (the LUs it maps, their state): what the door
    /// tells its host unasked (NVMe: asynchronous events). Also called once before the first
    /// turn, to see what is shown then.
    fn look(&mut self, _backend: &mut Backend<'_>) {}

    /// Asks the host to leave within `within` seconds (only if [`Door::CAN_ASK_TO_LEAVE`]).
    fn ask_to_leave(&mut self, _within: u16) {}

    /// Nothing of the host's is outstanding in the target.
    fn quiescent(&self) -> bool;

    /// Whether the connection may park while idle ([`Driven::Parked`]): nothing of its host's
    /// outstanding but what outlives the drive (an NVMe admin queue's held event requests,
    /// which its controller keeps). A door that never parks says false.
    fn parkable(&self) -> bool {
        false
    }
}

/// How a drive ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Driven {
    /// The session ends.
    Ended,
    /// It parked: idle for a housekeeping period, its door [`Door::parkable`], nothing in
    /// the connection's buffers, ring or budget. The door gives back what an idle connection
    /// need not hold (the drive's state, its backend's buffers and ring) and waits for its
    /// socket, its alarm (set for the door's deadline) and its [`Told`] in a small future,
    /// then drives again ([`drive`]'s `woke`). Idle connections are most of a large
    /// array's: parked, one costs its socket and the state its protocol keeps.
    Parked,
}

/// What closes a session from outside: the session registry or `ctl` (a reinstatement, `ctl
/// session close`), a controller's end for its queues.
pub(super) struct Told {
    first: Watch,
    second: Option<Watch>,
}

struct Watch {
    rx: watch::Receiver<Option<&'static str>>,
    /// The reason when the sender goes; None: its going closes nothing.
    gone: Option<&'static str>,
}

impl Told {
    pub(super) fn by(
        rx: watch::Receiver<Option<&'static str>>,
        gone: Option<&'static str>,
    ) -> Told {
        Told {
            first: Watch { rx, gone },
            second: None,
        }
    }

    pub(super) fn and(
        mut self,
        rx: watch::Receiver<Option<&'static str>>,
        gone: Option<&'static str>,
    ) -> Told {
        self.second = Some(Watch { rx, gone });
        self
    }

    /// Waits until something is heard from outside.
    pub(super) async fn heard(&mut self) -> Heard {
        let second = async {
            match &mut self.second {
                Some(w) => w.heard().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            h = self.first.heard() => h,
            h = second => h,
        }
    }
}

/// What a session heard from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Heard {
    /// It closes, for this reason.
    Close(&'static str),
    /// Something it follows changed (`shared/nudge.rs`): it looks again.
    Look,
}

impl Watch {
    async fn heard(&mut self) -> Heard {
        if self.rx.changed().await.is_err() {
            return match self.gone {
                Some(r) => Heard::Close(r),
                None => std::future::pending().await,
            };
        }
        match *self.rx.borrow_and_update() {
            Some(r) => Heard::Close(r),
            None => Heard::Look,
        }
    }
}

/// Runs `step` (a login's, a Connect's) within the connection's login deadline: the alarm is
/// set for it. A connection not logged in yet also ends when the daemon shuts down or a newer
/// connection evicts it from the pre-login budget.
pub(super) async fn before_login<T>(
    shared: &Shared,
    prelogin: &prelogin::Ticket,
    alarm: &mut Alarm,
    step: impl Future<Output = Result<T, Closed>>,
) -> Result<T, Closed> {
    let mut shutdown = shared.shutdown_signal();
    tokio::select! {
        done = step => done,
        rung = alarm.rung() => {
            rung.map_err(Closed::timer)?;
            shared.metrics.limit("login_timeout_s");
            Err(Closed::Limit("login timed out (login_timeout_s)"))
        }
        () = Shared::wait_for_shutdown(&mut shutdown) => {
            Err(Closed::Limit("shutting down during login"))
        }
        () = prelogin.evicted() => {
            Err(Closed::Limit("evicted before login: max_prelogin_connections reached"))
        }
    }
}

/// How long a sender may stop in the middle of a payload received in place before the
/// connection is dropped: the dead-peer bound of the usual path (a ping, then its timeout),
/// which cannot run while the payload is read.
pub(super) fn stall_bound(limits: &crate::config::Limits) -> Duration {
    let s = u64::from(limits.nop_in_interval_s) + u64::from(limits.nop_in_timeout_s.max(5));
    Duration::from_secs(s)
}

/// Reads the rest of a payload into `dst` (its first `have` bytes are there), then `pad`
/// bytes of padding (discarded), and in the same system call as much of `next` (the receive
/// buffer up to the next PDU's header) as has arrived behind them: the next header does not
/// cost a `recv` of its own. Returns how many bytes went into `next`. The answers in `unsent`
/// (held back by [`Door::holds_answers`]) are sent before it would wait. A sender that stops
/// mid-payload is dropped within `stall` ([`stall_bound`]). The alarm stays set for the
/// connection's next deadline (no system call when the payload arrives in time); should it
/// ring meanwhile, it is set for the stall bound instead. The socket's receive low-water
/// mark goes back to one byte first: a mark the receive coalescer raised would hold back a
/// payload's last bytes (fewer than the mark) until the stall bound, while the host waits for
/// the write's answer; the driver re-plans the mark after ([`Wakeups::low_water_dropped`]).
pub(super) async fn read_placed(
    stream: &mut Wire,
    unsent: Unsent<'_>,
    payload: Placement<'_>,
    next: &mut [u8],
    wait: PlacedWait<'_>,
) -> Result<usize, Closed> {
    let PlacedWait {
        alarm,
        stall,
        low_water_raised,
    } = wait;
    if !unsent.out.is_empty() && stream.plain().is_none() {
        stream.send(unsent.out, unsent.peer).await?;
    }
    let Some(socket) = stream.plain() else {
        read_placed_tls(stream, payload, alarm, stall).await?;
        return Ok(0);
    };
    if low_water_raised {
        super::sys::set_receive_low_water(socket, 1).map_err(Closed::Io)?;
    }
    let stalled_at = Instant::now() + stall;
    let Placement { dst, have, pad } = payload;
    let len = dst.len();
    let mut filled = have;
    let mut padding = [0u8; 3];
    loop {
        let Some(socket) = stream.plain() else {
            return Err(Closed::Invariant("a socket in the clear became TLS"));
        };
        let want = (len + pad).saturating_sub(filled);
        let (data, pad_from) = match dst.get_mut(filled..) {
            Some(rest) => (rest, 0),
            None => (&mut [][..], filled - len),
        };
        let Some(padding) = padding.get_mut(pad_from..pad) else {
            return Err(Closed::Invariant("payload placement out of range"));
        };
        let mut iov = [
            std::io::IoSliceMut::new(data),
            std::io::IoSliceMut::new(padding),
            std::io::IoSliceMut::new(next),
        ];
        match socket.try_read_vectored(&mut iov) {
            Ok(0) => return Err(Closed::Limit("peer closed")),
            Ok(n) if n >= want => return Ok(n - want),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if unsent.out.is_empty() {
                    wait_placed(socket, alarm, stalled_at).await?;
                } else {
                    // The answers held back go before the wait (the host may wait for them).
                    stream.send(unsent.out, unsent.peer).await?;
                }
            }
            Err(e) => return Err(Closed::Io(e)),
        }
    }
}

/// How a placed read waits: on the connection's alarm, dropping a sender silent for `stall`;
/// with the socket's low-water mark back at one byte first if the receive coalescer raised it.
pub(super) struct PlacedWait<'a> {
    pub(super) alarm: &'a mut Alarm,
    pub(super) stall: Duration,
    pub(super) low_water_raised: bool,
}

/// Answers queued to send before a placed read waits on the socket.
pub(super) struct Unsent<'a> {
    pub(super) out: &'a mut Outbox,
    pub(super) peer: SocketAddr,
}

/// Where a payload goes: `dst`, whose first `have` bytes are there, then `pad` bytes of
/// padding to read past.
pub(super) struct Placement<'a> {
    pub(super) dst: &'a mut [u8],
    pub(super) have: usize,
    pub(super) pad: usize,
}

/// Waits until the socket is readable; should the alarm ring first, past the stall bound
/// the sender is dropped, before it the alarm is set for the bound.
async fn wait_placed(
    socket: &tokio::net::TcpStream,
    alarm: &mut Alarm,
    stalled_at: Instant,
) -> Result<(), Closed> {
    tokio::select! {
        ready = socket.readable() => ready.map_err(Closed::Io),
        rung = alarm.rung() => {
            rung.map_err(Closed::timer)?;
            if Instant::now() >= stalled_at {
                return Err(Closed::Limit("peer stalled in the middle of a write's data"));
            }
            alarm.set(stalled_at).map_err(Closed::timer)
        }
    }
}

/// [`read_placed`] through TLS: record by record, nothing behind the payload.
async fn read_placed_tls(
    stream: &mut Wire,
    Placement { dst, have, pad }: Placement<'_>,
    alarm: &mut Alarm,
    stall: Duration,
) -> Result<(), Closed> {
    let stalled_at = Instant::now() + stall;
    let len = dst.len();
    let mut filled = have;
    let mut padding = [0u8; 3];
    while filled < len + pad {
        let into = if filled < len {
            dst.get_mut(filled..)
        } else {
            padding.get_mut(filled - len..pad)
        };
        let Some(into) = into else {
            return Err(Closed::Invariant("payload placement out of range"));
        };
        tokio::select! {
            read = stream.read(into) => match read {
                Ok(0) => return Err(Closed::Limit("peer closed")),
                Ok(n) => filled += n,
                Err(e) => return Err(Closed::Io(e)),
            },
            rung = alarm.rung() => {
                rung.map_err(Closed::timer)?;
                if Instant::now() >= stalled_at {
                    return Err(Closed::Limit("peer stalled in the middle of a write's data"));
                }
                alarm.set(stalled_at).map_err(Closed::timer)?;
            }
        }
    }
    Ok(())
}

/// What a session waits with besides its door and backend.
struct Waits<'w> {
    life: Lifecycle,
    wakeups: Wakeups,
    completed: &'w mut mpsc::UnboundedReceiver<Box<Completed>>,
    told: &'w mut Told,
    /// The last wait ended with a receive batch's deadline.
    timed_out: bool,
    congested: bool,
    /// The door's deadline the alarm is armed for: the earliest seen since it last passed (a
    /// later one, as a busy peer's ping moves on, would cost a timer system call a turn; an
    /// early ring finds nothing due and arms the next).
    door_due: Option<Instant>,
    /// The last wait's input came to a connection holding no receive buffer: after its turn
    /// the buffer goes back at once unless commands came (a ping's answer, say).
    woke_empty: bool,
}

/// What woke a waiting session.
enum Woken {
    /// Bytes, completions, a deadline or a look: run a turn.
    Work,
    /// The batch's wait is over: run a turn with what arrived (and say so to the coalescer).
    BatchOver,
    /// The session ends.
    End,
    /// The connection parks ([`Driven::Parked`]).
    Park,
}

/// What the wait's select saw, handled once the select has let go of its borrows.
enum Event {
    Read(std::io::Result<usize>),
    /// The socket of a connection holding no receive buffer became readable.
    Readable(std::io::Result<()>),
    Rung(std::io::Result<()>),
    Completed(Completed),
    Ring(std::io::Result<()>),
    Drained(usize),
    Heard(Heard),
}

/// A logged-in session's life to its end, or until it parks once idle as its `pace` says
/// (`lifecycle::Pace`). `woke`: what a parked connection heard from outside,
/// handled first.
pub(super) async fn drive<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    completed: &mut mpsc::UnboundedReceiver<Box<Completed>>,
    told: &mut Told,
    alarm: &mut Alarm,
    woke: Option<Heard>,
    pace: Pace,
) -> Result<Driven, Closed> {
    let limits = &backend.shared.limits;
    let grace = Duration::from_secs(limits.shutdown_grace_s.into());
    let mut w = Waits {
        life: Lifecycle::new(grace, pace),
        wakeups: Wakeups::new(
            Duration::from_micros(limits.coalesce_wait_us.into()),
            Arc::clone(&backend.shared.metrics),
        ),
        completed,
        told,
        timed_out: false,
        congested: false,
        door_due: None,
        woke_empty: false,
    };
    // A session parks no sooner than a period after it (re)started.
    w.life.worked(Instant::now());
    let result = match woke {
        Some(heard) => match handle(door, backend, &mut w, Event::Heard(heard), None).await {
            Ok(Woken::End) => Ok(Driven::Ended),
            Ok(_) => turns(door, backend, &mut w, alarm).await,
            Err(e) => Err(e),
        },
        None => {
            door.look(backend);
            // The buffer the login was read into goes back now unless something came behind
            // it: an idle session wakes for nothing after its login but to park.
            door.conn().give_back_if_empty();
            turns(door, backend, &mut w, alarm).await
        }
    };
    w.wakeups.report();
    result
}

async fn turns<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    alarm: &mut Alarm,
) -> Result<Driven, Closed> {
    loop {
        // First whatever is buffered (pipelined behind the login).
        let turn = turn(door, backend)?;
        if turn.close || !door.holds_answers() {
            flush(door).await?;
        }
        if turn.close {
            return Ok(Driven::Ended);
        }
        let was_congested = w.congested;
        watch_budget(backend, door.conn().peer, w);
        if was_congested && !w.congested && !door_tick(door, backend, Instant::now(), true).await? {
            // Its clocks start afresh: the silence while it did not read proves nothing.
            return Ok(Driven::Ended);
        }
        if !turn.drained && !w.congested {
            continue;
        }
        if !w.congested {
            let wait = PlacedWait {
                alarm: &mut *alarm,
                stall: stall_bound(&backend.shared.limits),
                low_water_raised: w.wakeups.applied_low_water > 1,
            };
            let placed = door.between_turns(backend, wait).await?;
            if placed.is_some() {
                // It received a payload in place: the low-water mark is one byte now.
                w.wakeups.low_water_dropped();
            }
            match placed {
                Some(true) => return Ok(Driven::Ended),
                Some(false) => continue,
                None => {}
            }
            let now = backend.meter.turn_ended.take().unwrap_or_else(Instant::now);
            plan_wakeup(door, w, now);
            door.conn().buf.make_room();
        }
        // Nothing held back goes into a wait.
        flush(door).await?;
        match wait(door, backend, w, alarm).await? {
            Woken::Work => {}
            Woken::BatchOver => w.timed_out = true,
            Woken::End => return Ok(Driven::Ended),
            Woken::Park => return Ok(Driven::Parked),
        }
    }
}

/// One turn: the door's input, then the ring submitted, what completed meanwhile answered (a
/// busy connection may not return to epoll for a while, which alone would say the ring has
/// completions).
fn turn<D: Door>(door: &mut D, backend: &mut Backend<'_>) -> Result<Turn, Closed> {
    // Whether the session may go on, asked before any of its input runs.
    if !backend.still_admitted() {
        return Ok(Turn {
            close: true,
            drained: true,
        });
    }
    backend.meter.turn_started = Instant::now();
    let input = door.input(backend);
    backend.submit_ring();
    backend.reap_ring();
    let closing = door.answered(backend);
    backend.meter.finish_turn();
    let turn = input?;
    Ok(Turn {
        close: turn.close || closing,
        drained: turn.drained || closing,
    })
}

async fn flush<D: Door>(door: &mut D) -> Result<(), Closed> {
    door.stage();
    door.conn().flush().await
}

/// At its memory budget a connection reads and handles nothing more until commands on the
/// blocking pool complete (TCP holds the host back).
fn watch_budget(backend: &Backend<'_>, peer: SocketAddr, w: &mut Waits<'_>) {
    let congested = backend.congested();
    if congested && !w.congested {
        backend.shared.metrics.limit("memory_per_connection_bytes");
        tracing::debug!(%peer, "memory budget reached; waiting for completions");
    }
    w.congested = congested;
}

/// The receive coalescer's and busy poll's plan from the turns since the last wait, when they
/// brought anything or a batch's wait ended (a turn of completions only leaves the plan).
fn plan_wakeup<D: Door>(door: &mut D, w: &mut Waits<'_>, now: Instant) {
    let activity = door.take_activity();
    let brought = activity.commands > 0 || activity.other_pdus > 0;
    let woke_empty = std::mem::take(&mut w.woke_empty);
    if activity.commands > 0 {
        w.life.worked(now);
    } else if woke_empty {
        door.conn().give_back_if_empty();
    }
    if brought || w.timed_out {
        let stream = &door.conn().stream;
        match stream.plain() {
            Some(socket) => w.wakeups.after_turn(socket, &activity, w.timed_out, now),
            None => w.wakeups.follow_lockstep(stream.socket(), &activity),
        }
    }
    w.timed_out = false;
}

/// Waits for the next thing to do: bytes from the host (unless congested), the alarm (a
/// batch's wait over, the door's deadline, housekeeping), a completion from another thread or
/// the ring, a task management function's LUs drained, the session told to close or to look.
async fn wait<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    alarm: &mut Alarm,
) -> Result<Woken, Closed> {
    // While congested only deadlines (and completions) may wake the connection.
    let batch = w.wakeups.batch_deadline().filter(|_| !w.congested);
    w.door_due = earliest(w.door_due, door.deadline());
    // Asked before the alarm is set: becoming idle takes its own deadline off the clock.
    let park = may_park(door, backend, w);
    if let Some(at) = earliest(earliest(batch, w.door_due), w.life.poll_timeout()) {
        alarm.set(at).map_err(Closed::timer)?;
    }
    if park {
        // The alarm stays set for the door's deadline, which the parked wait watches.
        return Ok(Woken::Park);
    }
    let stop = door.read_stop();
    let event = {
        let conn = door.conn();
        let tail = match w.congested {
            true => None,
            false => Some(conn.buf.wait_tail(stop)?),
        };
        let stream = &mut conn.stream;
        let read = async {
            match tail {
                Some(Some(tail)) => Event::Read(stream.read(tail).await),
                Some(None) => Event::Readable(stream.socket().readable().await),
                None => std::future::pending().await,
            }
        };
        let ring_busy = backend.ring.as_ref().is_some_and(|r| r.in_flight() > 0);
        tokio::select! {
            read = read => read,
            rung = alarm.rung() => Event::Rung(rung),
            Some(done) = w.completed.recv() => Event::Completed(*done),
            ready = ring_ready(&backend.ring), if ring_busy => Event::Ring(ready),
            drained = first_drained(&backend.tmf_waits), if !backend.tmf_waits.is_empty() => {
                Event::Drained(drained)
            }
            heard = w.told.heard() => Event::Heard(heard),
        }
    };
    handle(door, backend, w, event, batch).await
}

async fn handle<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    event: Event,
    batch: Option<Instant>,
) -> Result<Woken, Closed> {
    let completes = matches!(
        event,
        Event::Completed(_) | Event::Ring(_) | Event::Drained(_)
    );
    if completes && !w.life.housekeeping_armed() {
        // What completes is counted: reported within a housekeeping period.
        w.life.worked(Instant::now());
    }
    let closing = match event {
        Event::Read(Ok(0)) => return Ok(Woken::End),
        Event::Read(Ok(n)) => {
            door.conn().buf.received(n);
            false
        }
        Event::Heard(Heard::Look) => return look(door, backend, w).await,
        Event::Heard(Heard::Close(reason)) => {
            tracing::info!(peer = %door.conn().peer, "closing the session: {reason}");
            backend.close_reason = Some(Ended::Told(reason));
            return Ok(Woken::End);
        }
        Event::Read(Err(e)) | Event::Readable(Err(e)) => return Err(Closed::Io(e)),
        Event::Readable(Ok(())) => {
            door.conn().buf.hold()?;
            let stop = door.read_stop();
            let conn = door.conn();
            if !conn.buf.read_ready(&conn.stream, stop)? {
                return Ok(Woken::End);
            }
            w.woke_empty = true;
            false
        }
        Event::Rung(rung) => {
            rung.map_err(Closed::timer)?;
            return rung_at(door, backend, w, batch).await;
        }
        Event::Completed(done) => burst(door, backend, w, done),
        Event::Ring(ready) => {
            ready.map_err(|e| Closed::Failed(format!("io_uring: {e}")))?;
            backend.reap_ring();
            door.answered(backend)
        }
        Event::Drained(i) => finish_tmf(door, backend, i).await?,
    };
    if closing {
        // A TARGET COLD RESET answered once its last aborted task finished, say.
        flush(door).await?;
        return Ok(Woken::End);
    }
    Ok(Woken::Work)
}

/// The alarm rang: a batch's wait is over (what the low-water mark held back is read now),
/// the door's deadline passed, or housekeeping is due.
async fn rung_at<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    batch: Option<Instant>,
) -> Result<Woken, Closed> {
    let now = Instant::now();
    let batch_over = batch.is_some_and(|d| now >= d);
    if batch_over {
        let conn = door.conn();
        if !conn.buf.read_held_back(&conn.stream)? {
            return Ok(Woken::End);
        }
    }
    if w.door_due.is_some_and(|d| now >= d) {
        w.door_due = None;
        if !door_tick(door, backend, now, w.congested).await? {
            return Ok(Woken::End);
        }
    }
    if w.life.housekeeping_due(now) && !housekeeping(door, backend, w, now).await? {
        return Ok(Woken::End);
    }
    Ok(if batch_over {
        Woken::BatchOver
    } else {
        Woken::Work
    })
}

/// Whether the connection parks instead of waiting ([`Driven::Parked`]): idle as its pace
/// says (`Lifecycle::idle`), not congested nor batching receives (the socket's low-water mark
/// at one byte, as a new drive assumes), nothing received, queued or held to send, nothing of
/// its backend's running or waiting, and its door [`Door::parkable`]. Only in the clear:
/// through TLS, OpenSSL may hold decrypted bytes its socket does not show. When it parks, its
/// receive buffer is given back here and a pending look at it comes off its clock.
fn may_park<D: Door>(door: &mut D, backend: &Backend<'_>, w: &mut Waits<'_>) -> bool {
    // A busy connection's wait stops at the first test.
    if w.life.housekeeping_armed() || !w.life.idle(Instant::now()) {
        return false;
    }
    if w.congested || w.wakeups.applied_low_water > 1 || !w.completed.is_empty() {
        return false;
    }
    let conn = door.conn();
    let quiet = conn.stream.plain().is_some()
        && conn.buf.pending().is_empty()
        && conn.out.is_empty()
        && conn.held == 0;
    if !(quiet && backend.idle() && door.parkable()) {
        return false;
    }
    // Idle a whole period: its receive buffer goes back now, not a period later.
    let conn = door.conn();
    conn.give_back_if_empty();
    debug_assert!(!conn.buf.holds());
    w.life.parks();
    true
}

/// Answers a completion and those that arrived meanwhile, in a single write: a device that
/// completes in bursts (librbd's thread hands several over per wake-up) then costs one send,
/// not one per command. True when the session ends.
fn burst<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    done: Completed,
) -> bool {
    let mut closing = door.completed(backend, done);
    while !closing {
        door.stage();
        if door.conn().out.len() >= TURN_BYTES_MAX {
            break;
        }
        let Ok(done) = w.completed.try_recv() else {
            break;
        };
        closing = door.completed(backend, *done);
    }
    closing
}

/// A task management function whose LUs drained. Through a gateway that does not own the LU,
/// the owner resets it too before the answer (its nexuses get the unit attention); this
/// connection waits meanwhile, its LU holding new commands anyway. True when the session ends.
async fn finish_tmf<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    drained: usize,
) -> Result<bool, Closed> {
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
    crate::log_limit::reset_answered(&wait.function, wait.units.len(), wait.since.elapsed());
    let tag = wait.tag;
    // The LUs take commands again (before the answer goes out).
    drop(wait);
    let closing = door.task_done(tag);
    flush(door).await?;
    Ok(closing)
}

/// The door's deadline passed: its verdict (a ping sent, a silent peer or a missed
/// keep-alive closed). False when the session ends.
async fn door_tick<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    now: Instant,
    congested: bool,
) -> Result<bool, Closed> {
    let verdict = door.tick(backend, now, congested);
    flush(door).await?;
    match verdict {
        Some(end) => {
            backend.close_reason = Some(end);
            Ok(false)
        }
        None => Ok(true),
    }
}

/// A housekeeping period after work: the counts reach the metrics, an idle receive buffer
/// is given back (looked at again each period while one is held), and a leaving session is checked
/// (each period until it ends). False when the session ends.
async fn housekeeping<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
    now: Instant,
) -> Result<bool, Closed> {
    let conn = door.conn();
    let may_release = conn.may_give_back();
    conn.buf.shrink_if_idle(may_release);
    w.wakeups.report();
    backend.meter.report_io();
    if w.life.leaving() && !leave(door, backend, &mut w.life, now).await? {
        return Ok(false);
    }
    if w.life.leaving() {
        w.life.worked(now);
    } else if door.conn().buf.shrinks_later(may_release) {
        w.life.look_again(now);
    }
    Ok(true)
}

/// Something the session follows changed (`shared/nudge.rs`): the topology (it follows or
/// is closed), an RBD image's owner, an LU's state its door tells unasked, the shutdown or a
/// removed portal.
async fn look<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    w: &mut Waits<'_>,
) -> Result<Woken, Closed> {
    if !backend.still_admitted() {
        return Ok(Woken::End);
    }
    if backend.view.lost_an_image() {
        // A command this session holds could be stale (docs/RBD.md); the host logs in or
        // connects again, and its new session ships to the new owner.
        tracing::warn!(peer = %door.conn().peer, "closing the session: this gateway lost an RBD image it maps (the host reconnects to reach the new owner)");
        backend.close_reason = Some(Ended::LostImage);
        return Ok(Woken::End);
    }
    door.look(backend);
    flush(door).await?;
    Ok(
        match leave(door, backend, &mut w.life, Instant::now()).await? {
            true => Woken::Work,
            false => Woken::End,
        },
    )
}

/// The earlier of two optional instants.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The one rule for a session whose daemon shuts down or whose portal a reload removed: the
/// host is asked to leave within the grace where its door can ask; a door that cannot is
/// closed once nothing of its host's is outstanding; either is closed when the grace is over.
async fn leave<D: Door>(
    door: &mut D,
    backend: &mut Backend<'_>,
    life: &mut Lifecycle,
    now: Instant,
) -> Result<bool, Closed> {
    let leaving = if backend.view.portal_gone {
        Some(Ended::ListenerRemoved)
    } else if backend.shared.is_shutting_down() {
        Some(Ended::Shutdown)
    } else {
        None
    };
    let why = match leaving {
        Some(Ended::ListenerRemoved) => "its portal was removed",
        _ => "shutting down",
    };
    let grace_s = backend.shared.limits.shutdown_grace_s;
    let peer = door.conn().peer;
    match life.leave(now, leaving, D::CAN_ASK_TO_LEAVE, door.quiescent()) {
        Leave::Stay => Ok(true),
        Leave::Ask(within) => {
            door.ask_to_leave(within);
            flush(door).await?;
            tracing::info!(%peer, "{why}: asked the initiator to log out within {grace_s} s");
            Ok(true)
        }
        Leave::Close(close) => {
            match close {
                Ended::NoLogout => {
                    tracing::warn!(%peer, "{why}: no logout within {grace_s} s; closing the session")
                }
                _ => tracing::info!(%peer, "{why}: closing the session"),
            }
            backend.close_reason = Some(close);
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;
    use crate::dataplane::testing::{loopback, runtime};

    /// What `told` has heard, without waiting.
    fn now_or_never(rt: &tokio::runtime::Runtime, told: &mut Told) -> Option<Heard> {
        rt.block_on(async {
            tokio::select! {
                biased;
                h = told.heard() => Some(h),
                () = std::future::ready(()) => None,
            }
        })
    }

    #[test]
    fn a_session_is_told_to_close_or_to_look_by_either_watch() {
        let rt = runtime();
        let (registry, rx) = watch::channel(None);
        let (controller, rx2) = watch::channel(None);
        let mut told = Told::by(rx, Some("registry gone")).and(rx2, None);
        assert_eq!(now_or_never(&rt, &mut told), None);
        // A nudge (`shared/nudge.rs`): no reason, look once.
        registry.send_modify(|_| {});
        assert_eq!(now_or_never(&rt, &mut told), Some(Heard::Look));
        assert_eq!(now_or_never(&rt, &mut told), None, "heard once");
        controller.send_replace(Some("reinstated"));
        assert_eq!(
            now_or_never(&rt, &mut told),
            Some(Heard::Close("reinstated"))
        );
        // A sender that goes: its own reason, or nothing when it has none.
        drop(controller);
        assert_eq!(now_or_never(&rt, &mut told), None);
        drop(registry);
        assert_eq!(
            now_or_never(&rt, &mut told),
            Some(Heard::Close("registry gone"))
        );
    }

    /// A placed read's wait, with the low-water mark raised (as the coalescer may leave it).
    fn waiting(alarm: &mut Alarm, stall: Duration) -> PlacedWait<'_> {
        PlacedWait {
            alarm,
            stall,
            low_water_raised: true,
        }
    }

    /// A placed read of all of `dst` (nothing buffered, no padding, no room behind).
    async fn place_all(
        wire: &mut Wire,
        (out, peer): (&mut Outbox, SocketAddr),
        dst: &mut [u8],
        alarm: &mut Alarm,
        stall: Duration,
    ) -> Result<usize, Closed> {
        let placement = Placement {
            dst,
            have: 0,
            pad: 0,
        };
        let unsent = Unsent { out, peer };
        read_placed(wire, unsent, placement, &mut [], waiting(alarm, stall)).await
    }

    /// Places a 10-byte payload whose first 3 bytes were buffered, with 2 bytes of padding,
    /// "NEXT" behind it; `next` is the room given for what follows. Returns the payload as
    /// placed, what went into `next`, and what the socket still had.
    fn place_with_room(room: usize) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let rt = runtime();
        let (target, mut client, peer) = loopback(&rt);
        let mut wire = Wire::Plain(target);
        let mut out = Outbox::new(4);
        let payload: Vec<u8> = (1..=10).collect();
        // One write: the payload's rest, the padding and what follows arrive together.
        let rest: &[&[u8]] = &[&payload[3..], &[0, 0], b"NEXT"];
        client.write_all(&rest.concat()).unwrap();
        let mut dst = vec![0u8; 10];
        dst[..3].copy_from_slice(&payload[..3]);
        let mut next = vec![0u8; room];
        let (behind, rest) = rt.block_on(async {
            let mut alarm = Alarm::new().unwrap();
            alarm.set(Instant::now() + Duration::from_secs(1)).unwrap();
            let placement = Placement {
                dst: &mut dst,
                have: 3,
                pad: 2,
            };
            let stall = Duration::from_secs(5);
            let unsent = Unsent {
                out: &mut out,
                peer,
            };
            let behind = read_placed(
                &mut wire,
                unsent,
                placement,
                &mut next,
                waiting(&mut alarm, stall),
            )
            .await
            .unwrap();
            let mut rest = vec![0u8; 4 - behind];
            let mut got = 0;
            while got < rest.len() {
                got += wire.read(&mut rest[got..]).await.unwrap();
            }
            (behind, rest)
        });
        assert_eq!(dst, payload, "the payload is in place");
        next.truncate(behind);
        (dst, next, rest)
    }

    #[test]
    fn a_placed_payload_lands_in_place_and_its_padding_is_read_past() {
        let (_, next, rest) = place_with_room(0);
        assert!(next.is_empty());
        assert_eq!(rest, b"NEXT", "the padding, and nothing more, was consumed");
    }

    #[test]
    fn what_follows_a_placed_payload_comes_in_the_same_read_up_to_the_room_given() {
        // Everything was sent before the read: one readv takes the payload, the padding and
        // as much of the next PDU as there is room for.
        let (_, next, rest) = place_with_room(3);
        assert_eq!(next, b"NEX");
        assert_eq!(rest, b"T", "nothing past the room was consumed");
        let (_, next, rest) = place_with_room(16);
        assert_eq!(next, b"NEXT");
        assert!(rest.is_empty());
    }

    #[test]
    fn a_payloads_last_bytes_arrive_though_the_low_water_mark_was_raised() {
        // The receive coalescer may leave the mark above what is left of a payload: its
        // last bytes (77 of a 64 KiB H2CData PDU, seen) must still wake the reader.
        let rt = runtime();
        let (target, mut client, peer) = loopback(&rt);
        super::super::sys::set_receive_low_water(&target, 4096).unwrap();
        let mut wire = Wire::Plain(target);
        let mut out = Outbox::new(4);
        let payload: Vec<u8> = (0..1000u32).map(|i| (i % 253) as u8).collect();
        let mut dst = vec![0u8; 1000];
        let read = rt.block_on(async {
            let mut alarm = Alarm::new().unwrap();
            alarm.set(Instant::now() + Duration::from_secs(4)).unwrap();
            let stall = Duration::from_secs(3);
            let placed = place_all(&mut wire, (&mut out, peer), &mut dst, &mut alarm, stall);
            let sender = async {
                client.write_all(&payload[..900]).unwrap();
                tokio::task::yield_now().await;
                client.write_all(&payload[900..]).unwrap();
            };
            tokio::join!(placed, sender).0
        });
        // Held back, the read ends in the stall error when the alarm rings: the cause, not a
        // wall-clock bound, is what fails.
        read.unwrap();
        assert_eq!(dst, payload);
    }

    #[test]
    fn answers_held_back_go_out_before_a_placed_read_waits_and_not_while_data_flows() {
        let rt = runtime();
        let (target, mut client, peer) = loopback(&rt);
        let mut wire = Wire::Plain(target);
        let mut out = Outbox::new(4);
        let mut dst = vec![0u8; 8];
        // The whole payload is there: the answer held stays held.
        out.push_bytes(b"ANSWER1");
        client.write_all(&[1; 8]).unwrap();
        // A busy connection's socket is known readable (a fresh one is not until the
        // reactor has looked).
        rt.block_on(wire.socket().readable()).unwrap();
        let mut alarm = rt.block_on(async { Alarm::new().unwrap() });
        let mut place = |dst: &mut [u8], out: &mut Outbox, wire: &mut Wire| {
            rt.block_on(async {
                alarm.set(Instant::now() + Duration::from_secs(5)).unwrap();
                let stall = Duration::from_secs(5);
                place_all(wire, (out, peer), dst, &mut alarm, stall).await
            })
        };
        place(&mut dst, &mut out, &mut wire).unwrap();
        assert_eq!(out.len(), 7, "sent while the payload was all there");
        // Half of the next payload: the read would wait, so the answer goes first, and the
        // host, which sends the rest only once it has its answer, is not kept waiting.
        client.write_all(&[2; 4]).unwrap();
        let host = std::thread::spawn(move || {
            let mut answer = [0u8; 7];
            std::io::Read::read_exact(&mut client, &mut answer).unwrap();
            client.write_all(&[2; 4]).unwrap();
            (answer, client)
        });
        place(&mut dst, &mut out, &mut wire).unwrap();
        let (answer, _client) = host.join().unwrap();
        assert_eq!(&answer, b"ANSWER1");
        assert!(out.is_empty());
        assert_eq!(dst, [2; 8]);
    }

    #[test]
    fn a_sender_that_stops_in_the_middle_of_a_payload_is_dropped_after_the_stall_bound() {
        let rt = runtime();
        let (target, mut client, peer) = loopback(&rt);
        let mut wire = Wire::Plain(target);
        let mut out = Outbox::new(4);
        client.write_all(&[9; 100]).unwrap();
        let mut dst = vec![0u8; 1000];
        let started = Instant::now();
        let stall = Duration::from_millis(300);
        let read = rt.block_on(async {
            let mut alarm = Alarm::new().unwrap();
            // The connection's next deadline (its tick) rings first; the bound holds anyway.
            alarm
                .set(Instant::now() + Duration::from_millis(50))
                .unwrap();
            place_all(&mut wire, (&mut out, peer), &mut dst, &mut alarm, stall).await
        });
        assert!(
            matches!(&read, Err(Closed::Limit(why)) if why.contains("stalled")),
            "{read:?}"
        );
        let waited = started.elapsed();
        assert!(waited >= stall, "dropped before its bound: {waited:?}");
        assert!(waited < Duration::from_secs(10), "not dropped: {waited:?}");
        assert_eq!(&dst[..100], &[9; 100][..], "what came is in place");
        drop(client);
    }
}
