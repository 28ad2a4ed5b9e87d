//! A session's backend: how its SCSI commands run. Inline on the worker, or deferred to the
//! connection's io_uring ring, to a store that completes I/O itself, to the owner gateway, or
//! to the blocking pool — one entry (`ScsiBackend::defer`), one prelude (`Backend::hold`,
//! `Backend::plan`), one completion type (`Completed`) delivered back to the connection.

use std::sync::Arc;
use std::time::Instant;

use scsi::{LunEntry, Nexus};
use seam::outbox::ReadBuffers;
use seam::{
    DataOutBuf, DataOutMemory, DeferredCommand, Execution, Loan, ScsiBackend, ScsiOutcome,
    ScsiRequest, TmfAnswer, TmfFunction,
};

use crate::dataplane::busy_poll;
use crate::dataplane::closed::Ended;
use crate::dataplane::sys;

use crate::dataplane::route;
use crate::dataplane::view::{Verdict, View};
use crate::io::group_commit::{Durability, GroupCommit};
use crate::io::ring::{self, DeviceRing, RingOp};
use crate::io::stall::WriteStalls;
use crate::shared::Shared;
use crate::topology::{GroupRuntime, Topology};

/// What a command of unbounded cost (`scsi::runs_long`: EXTENDED COPY, WRITE SAME, UNMAP)
/// counts against its connection's `memory_per_connection_bytes` while it runs on the I/O
/// threads: its copy buffer (up to 1 MiB) and the thread it holds. With the default budget
/// (64 MiB) a connection runs at most 8 at once, so it cannot take every I/O thread its
/// worker's other sessions need.
const LONG_COMMAND_HELD_BYTES: usize = 8 << 20;
/// Reads at least this long are sent straight from the page cache (`sendfile`) when the LU is a
/// file whose pages hold all of the range; shorter ones are copied, as are reads on connections
/// with data digests. Below it the extra system calls (cachestat, a sendfile per Data-In PDU, a
/// vectored write split around each) cost more than the copies they save.
const FILE_SEND_MIN_BYTES: u32 = 64 * 1024;
/// Idle direct-I/O buffers a worker keeps for reuse, at most (see `store::BufPool`): enough for
/// a QD16 stream of 1 MiB I/Os on each of two connections, and a bound on what idles.
const DIRECT_BUFFERS_IDLE_BYTES_MAX: usize = 32 << 20;
thread_local! {
    /// This worker's direct-I/O buffers. Per worker, not per connection: idle connections then
    /// hold none, and a buffer lent to a Data-In on another thread still comes home.
    static DIRECT_BUFFERS: store::BufPool = store::BufPool::new(DIRECT_BUFFERS_IDLE_BYTES_MAX);
}

/// The SCSI side of one session: its LUN map and I_T nexus.
/// A command that ran on the blocking pool, on its way back to its connection.
pub(super) struct Completed {
    pub(super) tag: u32,
    /// For the I/O metrics: the LUN, what kind of command, and the Data-In it was allowed.
    pub(super) lun: u64,
    pub(super) kind: scsi::IoKind,
    pub(super) expected_len: u32,
    pub(super) outcome: ScsiOutcome,
    pub(super) data_in: Vec<u8>,
    /// Data-In lent instead of copied: the aligned buffer a direct read landed in.
    pub(super) lent: Option<scsi::SharedSlice>,
    pub(super) sense: Vec<u8>,
    /// The start of the turn that handed it over (its latency runs from there).
    pub(super) started: Instant,
    /// Data-Out bytes it held (released from the connection's budget).
    pub(super) held_bytes: usize,
    /// Its Data-Out bytes (the buffer may have gone to the device).
    pub(super) data_out_bytes: usize,
    /// Its Data-Out buffer, back to the connection's pool.
    pub(super) data_out: DataOutBuf,
}

impl Completed {
    /// The answer to a deferred `command` that ran to `completion` with `data_in`; what it
    /// held comes back with it (its Data-Out buffer to the pool, `held_bytes` to the budget).
    pub(super) fn answering(
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
            tag: command.tag,
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

/// The way back to the connection for a command finished on another thread. Boxed: tokio
/// allocates a channel's first block of 32 slots with the channel, and 32 of these inline
/// were ~5.4 KiB of every idle connection (heaptrack, 2026-12-04).
#[derive(Clone)]
pub(super) struct Answers {
    pub(super) completions: tokio::sync::mpsc::UnboundedSender<Box<Completed>>,
    /// Raised with each answer, to end the worker's busy poll.
    pub(super) flag: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl Answers {
    pub(super) fn send(&self, done: Completed) {
        // The connection may be gone by now; then nobody waits for the answer.
        let _ = self.completions.send(Box::new(done));
        // End the worker's busy poll, if one runs: the answer is ready to go.
        if let Some(flag) = &self.flag {
            flag.store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

pub(super) struct Backend<'a> {
    pub(super) shared: &'a Shared,
    /// Where commands finished on another thread (the blocking pool, a store's own thread)
    /// send their answers.
    pub(super) answers: Answers,
    /// Memory held by commands running elsewhere (`budget.rs`).
    pub(super) budget: super::budget::Budget,
    /// Why the session closed, when the target decided it (for the log).
    pub(super) close_reason: Option<Ended>,
    /// The route `execute` decided for the command it just deferred, for the `defer` that
    /// follows it at once (tag, route).
    pub(super) routed: Option<(u32, route::Route)>,
    /// Who the session is, the topology it runs on, its LUN map and nexus (`view.rs`).
    pub(super) view: View,
    /// What the session's commands counted, and when its turn started (`meter.rs`).
    pub(super) meter: super::meter::Meter,
    /// Resets (LU, target) and CLEAR TASK SETs waiting for their LUs' commands to finish.
    pub(super) tmf_waits: Vec<TmfWait>,
    /// This connection's io_uring for direct-I/O LUNs, made at the first such command.
    pub(super) ring: Option<DeviceRing<RingTag>>,
    /// Durable writes on the ring, per file, and the fdatasyncs that make them so.
    pub(super) group_commits: Vec<(Arc<std::fs::File>, GroupCommit<Written>)>,
    /// The ring's I/Os in flight as last told to the worker's busy poll.
    pub(super) ring_reported: usize,
    /// Making the ring failed once (logged): direct LUNs use the I/O thread pool instead.
    pub(super) ring_failed: bool,
    /// Commands answered while planned (a check failed) or reaped from the ring: delivered
    /// at the end of the turn.
    pub(super) answered: Vec<Completed>,
    /// Reused by every reap of the ring.
    pub(super) ring_finished: Vec<ring::Finished<RingTag>>,
    /// Reused by every read answered from a ring buffer.
    pub(super) loan: Loan,
}

/// I/Os a turn queues on its ring before handing them to the kernel (the rest go at its end).
pub(super) const RING_SUBMIT_BATCH: usize = 4;

/// What an I/O on the connection's ring is for.
/// A deferred command's LU, held in flight for it ([`Backend::hold`]).
pub(super) struct Held {
    pub(super) lu: Arc<scsi::LogicalUnit>,
    /// The LU is mapped read-only to this session.
    pub(super) read_only: bool,
    pub(super) hold: scsi::inflight::OwnedIoGuard,
    /// What the command holds of the connection's memory budget, and its Data-Out's length.
    pub(super) held_bytes: usize,
    pub(super) data_out_bytes: usize,
}

/// A held command with its planned I/O ([`Backend::hold_and_plan`]).
pub(super) struct PlannedIo {
    pub(super) held: Held,
    pub(super) io: scsi::BlockIo,
    pub(super) share: Option<scsi::WriteShare>,
    pub(super) command: DeferredCommand,
}

/// What planning a held command gave ([`Backend::plan`]).
pub(super) enum Planned {
    Io(scsi::BlockIo, Option<scsi::WriteShare>, DeferredCommand),
    /// Answered without I/O.
    Answered,
    /// Run it whole on the blocking pool.
    Execute(DeferredCommand),
}

pub(super) enum RingTag {
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
pub(super) type Written = (RingIo, Option<store::PooledBuf>);

/// A command whose block I/O is on the connection's ring.
pub(super) struct RingIo {
    pub(super) command: DeferredCommand,
    pub(super) lun: u64,
    pub(super) io: scsi::BlockIo,
    pub(super) lu: Arc<scsi::LogicalUnit>,
    pub(super) started: Instant,
    pub(super) held_bytes: usize,
    pub(super) data_out_bytes: usize,
    /// Its LU counts it in flight (resets wait) until the device answers.
    pub(super) _hold: scsi::inflight::OwnedIoGuard,
    /// A write's share of its LU's write order (COMPARE AND WRITE waits).
    pub(super) _share: Option<scsi::WriteShare>,
    /// A durable write's file and how it is made durable (its group commit's choice).
    pub(super) durable: Option<(Arc<std::fs::File>, Durability)>,
}

/// A task management function waiting until no command of its LUs can still reach the medium;
/// then its effects apply and it is answered. Its LUs hold new commands meanwhile (see
/// `scsi::inflight`); dropping it (the connection closed first) lets them go on.
pub(super) struct TmfWait {
    pub(super) tag: u32,
    pub(super) function: TmfFunction,
    /// The nexus that asked: its own unit attentions are not raised.
    pub(super) by: u64,
    pub(super) units: Vec<Arc<scsi::LogicalUnit>>,
    /// A LOGICAL UNIT RESET through a gateway that does not own the LU: the nexus it came
    /// through, to pass the reset on to the owner before answering.
    pub(super) at_owner: Option<scsi::Nexus>,
    /// When it began waiting (its answer's log line says how long it waited).
    pub(super) since: std::time::Instant,
}

impl TmfWait {
    pub(super) fn new(
        tag: u32,
        function: TmfFunction,
        by: u64,
        units: Vec<Arc<scsi::LogicalUnit>>,
    ) -> Self {
        for unit in &units {
            unit.in_flight().start_reset();
        }
        TmfWait {
            tag,
            function,
            by,
            units,
            at_owner: None,
            since: std::time::Instant::now(),
        }
    }

    /// Passes a LOGICAL UNIT RESET on to the LU's owner when this gateway does not own it
    /// (waits for the network: an I/O thread's call). Without an owner elsewhere, nothing.
    pub(super) fn reset_at_owner(&self) {
        if let (TmfFunction::LogicalUnitReset, Some(nexus)) = (self.function, &self.at_owner) {
            for unit in &self.units {
                if !unit.reset_at_owner(nexus) {
                    tracing::warn!("a LUN reset could not be passed on to the LU's owner");
                }
            }
        }
    }

    /// Ready when none of its LUs has a command running.
    pub(super) fn poll_drained(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
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
    pub(super) fn apply(&self) {
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
pub(super) async fn first_drained(waits: &[TmfWait]) -> usize {
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

/// Resolves when the connection's ring has completions (never without a ring).
pub(super) async fn ring_ready<T>(ring: &Option<DeviceRing<T>>) -> std::io::Result<()> {
    match ring {
        Some(ring) => ring.ready().await,
        None => std::future::pending().await,
    }
}

impl<'s> Backend<'s> {
    /// A backend for `party` under `topology`, its answers to `completions`; its nexus and
    /// LUN map are set next.
    pub(super) fn new(
        shared: &'s Shared,
        topology: &Arc<Topology>,
        party: super::view::Party,
        completions: tokio::sync::mpsc::UnboundedSender<Box<Completed>>,
    ) -> Backend<'s> {
        Backend::with_view(shared, View::new(party, topology), completions)
    }

    /// The backend of a session whose view outlived its last one (a parked connection's):
    /// who it is, what it was admitted to and the topology it follows are the view's.
    pub(super) fn with_view(
        shared: &'s Shared,
        view: View,
        completions: tokio::sync::mpsc::UnboundedSender<Box<Completed>>,
    ) -> Backend<'s> {
        let party = &view.party;
        Backend {
            shared,
            answers: Answers {
                completions,
                flag: busy_poll::completion_flag(),
            },
            budget: super::budget::Budget::new(shared.limits.memory_per_connection_bytes as usize),
            meter: super::meter::Meter::new(
                Arc::clone(&shared.metrics),
                party.peer,
                party.initiator.clone(),
            ),
            view,
            tmf_waits: Vec::new(),
            ring: None,
            ring_failed: false,
            ring_reported: 0,
            answered: Vec::new(),
            ring_finished: Vec::new(),
            group_commits: Vec::new(),
            loan: Loan::default(),
            close_reason: None,
            routed: None,
        }
    }

    /// A command finished elsewhere is back: the budget it held given back, its I/O and
    /// latency counted (`data_bytes`: its Data-In or Data-Out, as the transport moved it).
    pub(super) fn settle(&mut self, done: &Completed) {
        self.budget.release(done.held_bytes);
        let lent_bytes = done.lent.as_ref().map_or(0, |(_, range)| range.len());
        let data_bytes = match done.kind {
            scsi::IoKind::Read => (done.data_in.len() + lent_bytes).min(done.expected_len as usize),
            _ => done.data_out_bytes,
        };
        let slot = self.meter.record_io(
            done.lun,
            done.kind,
            done.outcome.status,
            &done.sense,
            data_bytes,
        );
        if let (Some(slot), Some(op)) = (slot, super::meter::op_index(done.kind)) {
            self.meter.record_latency(slot, op, done.started.elapsed());
        }
    }
}

impl Backend<'_> {
    /// Takes the LUN map (and what goes with it) of `group` for this session.
    /// Nothing of the session's runs or waits here: no task management function, nothing on
    /// the ring or the blocking pool, nothing answered and not yet delivered.
    pub(super) fn idle(&self) -> bool {
        self.tmf_waits.is_empty()
            && self.ring.as_ref().is_none_or(|r| r.in_flight() == 0)
            && self.group_commits.iter().all(|(_, g)| g.is_idle())
            && self.answered.is_empty()
            && self.budget.held() == 0
    }

    /// The session's view, to outlive this backend (a parked connection's, [`Backend::idle`]);
    /// what the session counted is reported first.
    pub(super) fn into_view(mut self) -> View {
        debug_assert!(self.idle(), "only an idle backend gives its view away");
        self.meter.report_io();
        let left = View::new(self.view.party.clone(), &self.view.topology);
        std::mem::replace(&mut self.view, left)
    }

    pub(super) fn use_group(&mut self, group: &GroupRuntime) {
        self.view.use_group(group);
        self.meter.count_for(&group.lun_devices);
    }

    /// Whether the session may go on: at once while the topology it runs on is the current
    /// one, else as [`View::follow`] decides, with the log line, the metric and the close
    /// reason of its verdict. Every door asks this, at every turn and tick.
    pub(super) fn still_admitted(&mut self) -> bool {
        if self.shared.generation() == self.view.topology.generation {
            return true;
        }
        match self
            .view
            .follow(self.shared.topology(), &self.shared.listening)
        {
            Verdict::Stay { map_changed: false } => true,
            Verdict::Stay { map_changed: true } => {
                // Counts so far go to the devices they were made on.
                self.meter.report_io();
                if let Some((_, group)) = self.view.group() {
                    self.meter.count_for(&group.lun_devices);
                }
                true
            }
            Verdict::PortalGone => {
                // It leaves at its next tick as at shutdown (`driver.rs`: an iSCSI host is
                // asked to log out; an NVMe/TCP queue closes once its commands are answered,
                // its host reconnecting through its other paths).
                tracing::warn!(
                    peer = %self.view.party.peer,
                    initiator = %self.view.party.initiator,
                    portal = %self.view.party.local,
                    "the portal this session came in through was removed (or moved to another portal group)"
                );
                true
            }
            Verdict::Close(refusal) => {
                tracing::warn!(
                    peer = %self.view.party.peer,
                    initiator = %self.view.party.initiator,
                    reason = refusal.reason(),
                    "closing the session after a change: a login now would not be admitted to the same group with the same proof"
                );
                self.shared.metrics.session_closed(refusal.reason());
                self.close_reason = Some(Ended::NoLongerAdmitted(refusal.reason()));
                false
            }
        }
    }

    /// Runs a deferred command whole on tokio's blocking pool (where waiting is fine); its
    /// answer comes back to this connection.
    pub(super) fn run_blocking(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        buffers: &mut ReadBuffers<'_>,
    ) {
        let (Some(luns), Some(nexus)) = (&self.view.luns, &self.view.nexus) else {
            debug_assert!(false, "only commands of a session with LUNs are deferred");
            return;
        };
        // The command counts as in flight on its LU from now on: a reset waits for it.
        let hold = luns.begin_owned(nexus, lun);
        let (luns, nexus) = (Arc::clone(luns), nexus.clone());
        // Buffered writes are watched there too: they keep the device's hold while they stall.
        let stalls = self
            .view
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
        self.budget.hold(held_bytes);
        let answers = self.answers.clone();
        let started = self.meter.turn_started;
        // The LU overwrites a read's recycled buffer whole (and clears it for other commands).
        let mut data_in = if command.read {
            buffers.take()
        } else {
            Vec::new()
        };
        tokio::task::spawn_blocking(move || {
            // A reset was draining the LU at hand-over: wait here (never on the worker) until
            // it is done, then run.
            let hold = match hold {
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
            // The command's effect is settled: the LU lets go of it before the answer leaves,
            // so the budget the answer gives back never admits a command while this one still
            // counts (the session orders its own answers and task management replies).
            drop(hold);
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
    pub(super) fn hold(
        &self,
        command: &DeferredCommand,
        lun: u64,
        takes: impl FnOnce(&LunEntry, &Nexus) -> bool,
    ) -> Option<Held> {
        let (luns, nexus) = (self.view.luns.as_ref()?, self.view.nexus.as_ref()?);
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
    pub(super) fn plan(&mut self, held: &Held, command: DeferredCommand, lun: u64) -> Planned {
        let Some(nexus) = self.view.nexus.as_ref() else {
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

    /// The prelude of the submit paths that plan (the ring, an asynchronous store): the LU
    /// held ([`Backend::hold`]) and the command planned ([`Backend::plan`]). `Ok(None)`: the
    /// command was answered without I/O; `Err`: it goes back, untouched, for the blocking pool.
    pub(super) fn hold_and_plan(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        takes: impl FnOnce(&LunEntry, &Nexus) -> bool,
    ) -> Result<Option<PlannedIo>, DeferredCommand> {
        let Some(held) = self.hold(&command, lun, takes) else {
            return Err(command);
        };
        match self.plan(&held, command, lun) {
            Planned::Io(io, share, command) => Ok(Some(PlannedIo {
                held,
                io,
                share,
                command,
            })),
            Planned::Answered => Ok(None),
            Planned::Execute(command) => Err(command),
        }
    }

    /// Plans `command` and puts its I/O on the ring. Hands the command back, untouched in
    /// effect, when it must run on the blocking pool instead: no ring for its LU, a reset
    /// draining the LU, a command that does not plan, a COMPARE AND WRITE holding the order,
    /// a full ring.
    pub(super) fn submit_to_ring(
        &mut self,
        command: DeferredCommand,
        lun: u64,
    ) -> Result<(), DeferredCommand> {
        let Some(direct) = self
            .view
            .disk(lun)
            .and_then(|d| d.ring.clone())
            .filter(|_| !self.ring_failed)
        else {
            return Err(command);
        };
        let Some(planned) = self.hold_and_plan(command, lun, |_, _| true)? else {
            return Ok(());
        };
        let PlannedIo {
            held:
                Held {
                    lu,
                    hold,
                    held_bytes,
                    data_out_bytes,
                    ..
                },
            io,
            share,
            mut command,
        } = planned;
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
            started: self.meter.turn_started,
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
    pub(super) fn has_ring(&mut self) -> bool {
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
                tracing::warn!(peer = %self.view.party.peer, "io_uring ring: {e}: direct I/O of this connection runs on the I/O threads");
                self.ring_failed = true;
                false
            }
        }
    }

    /// Puts a planned I/O on the ring; a full ring hands the command back.
    pub(super) fn push_to_ring(
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
                self.budget.hold(held_bytes);
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
    pub(super) fn answer_planned(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        completion: &scsi::Completion,
    ) {
        let data_out_bytes = command.data_out.len();
        let held_bytes = Self::held_bytes(data_out_bytes, command.read, command.expected_len);
        self.budget.hold(held_bytes);
        let held = (self.meter.turn_started, held_bytes, data_out_bytes);
        let answer = Completed::answering(command, lun, completion, Vec::new(), held);
        self.answered.push(answer);
    }

    /// Plans `command` and starts its I/O on a store that performs it asynchronously itself
    /// (librbd): the store's thread finishes it and sends the answer to this connection, as
    /// the blocking pool does, with no thread of ours waiting. Hands the command back when it
    /// must run on the blocking pool instead: not such a store, a reset draining the LU, a
    /// command that does not plan, a COMPARE AND WRITE holding the order.
    pub(super) fn submit_async(
        &mut self,
        command: DeferredCommand,
        lun: u64,
        buffers: &mut ReadBuffers<'_>,
    ) -> Result<(), DeferredCommand> {
        let asynchronous = |entry: &LunEntry, _: &Nexus| entry.lu.capabilities().asynchronous;
        let Some(planned) = self.hold_and_plan(command, lun, asynchronous)? else {
            return Ok(());
        };
        let PlannedIo {
            held:
                Held {
                    lu,
                    hold,
                    held_bytes,
                    data_out_bytes,
                    ..
                },
            io,
            share,
            mut command,
        } = planned;
        let Some((op, buf)) = async_io(&io, &mut command, buffers) else {
            return Err(command);
        };
        self.budget.hold(held_bytes);
        let answers = self.answers.clone();
        let started = self.meter.turn_started;
        let finishing = Arc::clone(&lu);
        let done: store::AsyncDone = Box::new(move |buf, result| {
            if let Err(e) = &result {
                crate::log_limit::device_io_failed(lun, &io.op, io.offset, io.len, e);
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
    pub(super) fn submit_shipped(
        &mut self,
        mut command: DeferredCommand,
        lun: u64,
    ) -> Result<(), DeferredCommand> {
        let ships = |entry: &LunEntry, nexus: &Nexus| entry.lu.ships_to_owner(nexus, &command.cdb);
        let Some(held) = self.hold(&command, lun, ships) else {
            return Err(command);
        };
        let cmd = scsi::Command {
            cdb: &command.cdb,
            data_out: &command.data_out,
            data_in_limit: command.expected_len,
        };
        let Some(nexus) = self.view.nexus.as_ref() else {
            return Err(command);
        };
        if let Err(completion) = held.lu.admit_for_owner(nexus, &cmd, held.read_only) {
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
        self.budget.hold(held_bytes);
        let answers = self.answers.clone();
        let started = self.meter.turn_started;
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
        lu.ship_then(nexus, shipped, done);
        Ok(())
    }

    /// Hands the turn's ring I/Os to the kernel in one system call.
    pub(super) fn submit_ring(&mut self) {
        if let Some(ring) = self.ring.as_mut() {
            if let Err(e) = ring.submit() {
                // They stay queued and go with the next submit.
                tracing::debug!(peer = %self.view.party.peer, "io_uring submit: {e}");
            }
            // The worker's busy poll learns device waits apart from initiator waits.
            let in_flight = ring.in_flight();
            busy_poll::device_io_changed(self.ring_reported, in_flight);
            self.ring_reported = in_flight;
        }
    }

    /// Moves the completions the ring has (reading its shared memory: no system call) to
    /// `answered`, for delivery like the connection's other completions.
    pub(super) fn reap_ring(&mut self) {
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
    pub(super) fn answer_reaped(
        &mut self,
        tag: RingIo,
        buf: Option<store::PooledBuf>,
        result: std::io::Result<()>,
    ) {
        if let Err(e) = &result {
            crate::log_limit::device_io_failed(tag.lun, &tag.io.op, tag.io.offset, tag.io.len, e);
        }
        assert_eq!(
            scsi::lun_from_wire(tag.command.lun),
            tag.lun,
            "a ring completion answers the LUN its command addressed"
        );
        let result = match result {
            Err(e) if tag.io.failure_is_located(&e) => return self.answer_located(tag, e),
            result => result,
        };
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
            tag: tag.command.tag,
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

    /// Answers a ring read the medium failed once its failing block is located, which takes
    /// reads: on the blocking pool, never the worker. The LU counts the command in flight (a
    /// reset waits) until the answer is on its way.
    fn answer_located(&mut self, tag: RingIo, e: std::io::Error) {
        let answers = self.answers.clone();
        tokio::task::spawn_blocking(move || {
            let completion = tag.lu.finish_located(&tag.io, e);
            let held = (tag.started, tag.held_bytes, tag.data_out_bytes);
            answers.send(Completed::answering(
                tag.command,
                tag.lun,
                &completion,
                Vec::new(),
                held,
            ));
            drop(tag._hold);
        });
    }

    /// The group commit of `file` (one per direct-I/O file this connection wrote durably).
    pub(super) fn group_commit(&mut self, file: &Arc<std::fs::File>) -> &mut GroupCommit<Written> {
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
    pub(super) fn start_group_flushes(&mut self) {
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
    pub(super) fn congested(&self) -> bool {
        self.budget.congested()
    }

    /// Memory a command holds while it runs on the blocking pool: its Data-Out, and the Data-In
    /// it will produce.
    pub(super) fn held_bytes(data_out_len: usize, read: bool, expected_len: u32) -> usize {
        data_out_len + if read { expected_len as usize } else { 0 }
    }

    /// The facts of `cdb` on LUN `lun` and the one route decision from them
    /// ([`route::route`]); with the time read for a buffered write's stall watch.
    pub(super) fn route(&self, lun: u64, cdb: &[u8]) -> (route::Route, Option<Instant>) {
        let (Some(luns), Some(nexus)) = (&self.view.luns, &self.view.nexus) else {
            return (route::Route::Inline, None);
        };
        let entry = luns.get(lun);
        let mut facts = route::Facts {
            runs_long: scsi::runs_long(cdb),
            ships: entry.is_some_and(|e| e.lu.ships_to_owner(nexus, cdb)),
            disk: None,
        };
        let mut started = None;
        if let Some((disk, entry)) = self.view.disk_lu(lun) {
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
            if let Some((disk, _)) = self.view.disk_lu(lun) {
                disk.stalls.offloaded();
            }
        }
        (route, started)
    }

    /// [`Execution::Deferred`] for command `tag`, its route kept for the `defer` that follows.
    pub(super) fn deferred(&mut self, tag: u32, route: route::Route) -> Execution {
        debug_assert!(!route.inline(), "deferred on the worker's own route");
        debug_assert!(
            self.routed.is_none(),
            "a route left over from an earlier command"
        );
        self.routed = Some((tag, route));
        Execution::Deferred
    }
}

/// `result` again, for each of the writes one flush answers (`io::Error` is not `Clone`).
/// The operation and buffer of a planned I/O on a store that performs it itself; None when a
/// write's Data-Out is shorter than planned (the blocking pool's path reports it).
pub(super) fn async_io(
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
pub(super) fn ring_buffer(
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

pub(super) fn same_result(result: &std::io::Result<()>) -> std::io::Result<()> {
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
pub(super) struct DirectDataOut(pub(super) store::PooledBuf);

impl seam::DataOutMemory for DirectDataOut {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// The pooled buffer `data_out` was received into, if it was; `data_out` is left empty then.
pub(super) fn take_direct_data_out(data_out: &mut DataOutBuf) -> Option<store::PooledBuf> {
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
pub(super) struct StallProbe {
    pub(super) started: Instant,
    pub(super) switches: u64,
}

impl StallProbe {
    pub(super) fn start(started: Instant) -> StallProbe {
        StallProbe {
            started,
            switches: sys::voluntary_context_switches(),
        }
    }

    /// Reports the finished write of `bytes` to `stalls`; true if it stalled.
    pub(super) fn finish(self, stalls: &WriteStalls, bytes: usize) -> bool {
        let now = Instant::now();
        let blocked = sys::voluntary_context_switches() != self.switches;
        stalls.record(bytes, now - self.started, blocked, now)
    }
}

/// The transport's view of a SCSI completion: status and transfer length, sense bytes appended.
pub(super) fn outcome_of(completion: &scsi::Completion, sense: &mut Vec<u8>) -> ScsiOutcome {
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
        let lun = scsi::lun_from_wire(req.lun);
        self.view.first_use(lun);
        let (Some(luns), Some(nexus)) = (&self.view.luns, &self.view.nexus) else {
            data_in.clear();
            return Execution::Done(ScsiOutcome {
                status: 0x02,
                transfer_len: 0,
            });
        };
        let (route, started) = self.route(lun, req.cdb);
        if !route.inline() {
            return self.deferred(req.tag, route);
        }
        // On a disk, buffered writes are watched (two clock reads, two getrusage calls) for
        // the kernel making them wait.
        let buffered_write = match (route, started) {
            (route::Route::InlineWatched, Some(started)) => self
                .view
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
                return self.deferred(req.tag, route::Route::Blocking);
            }
        };
        if let Some((stalls, probe)) = buffered_write {
            if probe.finish(stalls, req.data_out.len()) {
                tracing::debug!(lun, "buffered write stalled a network worker");
            }
        }
        let outcome = outcome_of(&completion, sense);
        self.meter
            .record_inline(lun, req, data_in, lent, sense, outcome.status);
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
            routed.map(|(tag, _)| tag),
            Some(command.tag),
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
        self.view
            .luns
            .as_ref()
            .is_some_and(|m| m.get(scsi::lun_from_wire(lun)).is_some())
    }

    fn task_management(&mut self, tag: u32, function: TmfFunction, lun: [u8; 8]) -> TmfAnswer {
        let by = self.view.nexus.as_ref().map_or(0, |n| n.id);
        // The LUs whose every command (of any session) must finish first.
        let units: Vec<Arc<scsi::LogicalUnit>> = match function {
            TmfFunction::LogicalUnitReset | TmfFunction::ClearTaskSet => self
                .view
                .luns
                .as_ref()
                .and_then(|m| m.get(scsi::lun_from_wire(lun)))
                .map(|entry| vec![Arc::clone(&entry.lu)])
                .unwrap_or_default(),
            TmfFunction::TargetWarmReset | TmfFunction::TargetColdReset => self
                .view
                .party
                .admitted
                .membership()
                .and_then(|m| self.view.topology.targets.get(m.target))
                .map(|t| t.units.clone())
                .unwrap_or_default(),
            // ABORT TASK SET concerns this nexus's tasks only, which the session waits for.
            _ => Vec::new(),
        };
        if units.is_empty() {
            return TmfAnswer::Now(seam::tmf_response::COMPLETE);
        }
        let mut wait = TmfWait::new(tag, function, by, units);
        wait.at_owner = self.view.nexus.clone().filter(|nexus| {
            function == TmfFunction::LogicalUnitReset
                && wait
                    .units
                    .iter()
                    .any(|u| u.ships_to_owner(nexus, &[0u8; 6]))
        });
        self.tmf_waits.push(wait);
        TmfAnswer::Later
    }

    fn data_out_memory(&mut self, lun: [u8; 8], len: usize) -> Option<Box<dyn DataOutMemory>> {
        // Only where the ring will take it: a direct-I/O LUN of a connection whose ring works.
        let lun = scsi::lun_from_wire(lun);
        if len == 0 || self.ring_failed {
            return None;
        }
        self.view.disk(lun)?.ring.as_ref()?;
        let buf = DIRECT_BUFFERS.with(|pool| pool.take(len))?;
        Some(Box::new(DirectDataOut(buf)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use seam::outbox::Outbox;

    const CONFIG: &str = r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "d0"
store = "ram"
size = "1M"
[[target]]
iqn = "iqn.2026-12.test:t"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "d0" } ]
"#;

    fn backend(
        shared: &Shared,
    ) -> (
        Backend<'_>,
        tokio::sync::mpsc::UnboundedReceiver<Box<Completed>>,
    ) {
        super::super::testing::logged_in(shared, "iqn.2026-12.test:i", "iqn.2026-12.test:t")
    }

    /// WRITE SAME (16) of one 512-byte block over `blocks` blocks at LBA 0.
    fn write_same(tag: u32, blocks: u32) -> DeferredCommand {
        let mut cdb = vec![0x93, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
        DeferredCommand {
            tag,
            lun: [0; 8],
            cdb,
            data_out: DataOutBuf::Pooled(vec![0xA5; 512]),
            expected_len: 512,
            read: false,
            write: true,
            task_attr: 0,
        }
    }

    /// `command` through the session's entry, as a door hands it over: executed, and deferred
    /// when the backend says so. Whether it was deferred.
    fn submit(backend: &mut Backend<'_>, outbox: &mut Outbox, command: DeferredCommand) -> bool {
        let req = ScsiRequest {
            tag: command.tag,
            lun: command.lun,
            cdb: &command.cdb,
            data_out: &command.data_out,
            expected_len: command.expected_len,
            read: command.read,
            write: command.write,
            task_attr: command.task_attr,
            may_lend_file: true,
        };
        let (mut data_in, mut lent, mut sense) = (Vec::new(), Loan::default(), Vec::new());
        match backend.execute(&req, &mut data_in, &mut lent, &mut sense) {
            Execution::Done(_) => false,
            Execution::Deferred => {
                backend.defer(command, outbox.read_buffers());
                true
            }
        }
    }

    #[test]
    fn a_ram_read_runs_on_the_worker_and_lends_the_lus_pages() {
        let shared = super::super::testing::shared(CONFIG);
        let (mut backend, _answers) = backend(&shared);
        // The nexus's first command gets its POWER ON unit attention; then the read.
        let cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        let req = ScsiRequest {
            tag: 1,
            lun: [0; 8],
            cdb: &cdb,
            data_out: &[],
            expected_len: 4096,
            read: true,
            write: false,
            task_attr: 0,
            may_lend_file: true,
        };
        let (mut data_in, mut lent, mut sense) = (Vec::new(), Loan::default(), Vec::new());
        let first = backend.execute(&req, &mut data_in, &mut lent, &mut sense);
        assert!(
            matches!(first, Execution::Done(o) if o.status == 0x02),
            "a unit attention"
        );
        assert_eq!(
            (sense[2] & 0x0F, sense[12]),
            (scsi::sense::UNIT_ATTENTION, 0x29)
        );
        sense.clear();
        let Execution::Done(outcome) = backend.execute(&req, &mut data_in, &mut lent, &mut sense)
        else {
            panic!("a RAM read is deferred");
        };
        assert_eq!((outcome.status, outcome.transfer_len), (0, 4096));
        let lent_bytes: usize = lent.slices.iter().map(|(_, range)| range.len()).sum();
        assert_eq!((data_in.len(), lent_bytes), (0, 4096), "lent, not copied");
        assert!(backend.routed.is_none(), "nothing left for a defer");
    }

    #[test]
    fn long_commands_run_on_the_io_threads_each_holding_its_share_of_the_budget() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let _entered = rt.enter();
        let shared = super::super::testing::shared(CONFIG);
        assert_eq!(shared.limits.memory_per_connection_bytes, 64 << 20);
        let (mut backend, mut answers) = backend(&shared);
        let mut outbox = Outbox::new(4);
        let held = LONG_COMMAND_HELD_BYTES + 512;
        // Routed before any check: even the nexus's unit attention is answered from there.
        assert!(submit(&mut backend, &mut outbox, write_same(0, 8)));
        let first = answers.blocking_recv().expect("an answer");
        assert_eq!((first.outcome.status, first.held_bytes), (0x02, held));
        backend.settle(&first);
        for tag in 1..=8 {
            assert!(!backend.congested(), "congested after {} commands", tag - 1);
            assert!(submit(&mut backend, &mut outbox, write_same(tag, 8)));
            assert_eq!(backend.budget.held(), tag as usize * held);
        }
        // Eight hold the default budget: the next waits in TCP.
        assert!(backend.congested());
        for _ in 1..=8 {
            let done = answers.blocking_recv().expect("an answer");
            assert_eq!((done.outcome.status, done.held_bytes), (0, held));
            backend.settle(&done);
        }
        assert_eq!(backend.budget.held(), 0);
        assert!(!backend.congested());
    }

    #[test]
    fn a_command_is_held_only_for_a_mapped_lun_taken_by_its_path_and_not_during_a_reset() {
        let shared = super::super::testing::shared(CONFIG);
        let (backend, _answers) = backend(&shared);
        let command = write_same(1, 8);
        assert!(backend.hold(&command, 7, |_, _| true).is_none(), "unmapped");
        assert!(
            backend.hold(&command, 0, |_, _| false).is_none(),
            "not taken"
        );
        let held = backend.hold(&command, 0, |_, _| true).expect("held");
        assert_eq!((held.held_bytes, held.data_out_bytes), (512, 512));
        let in_flight = Arc::clone(held.lu.in_flight());
        assert_eq!(in_flight.count(), 1);
        drop(held);
        in_flight.start_reset();
        assert!(
            backend.hold(&command, 0, |_, _| true).is_none(),
            "a reset drains it"
        );
        in_flight.end_reset();
        assert!(backend.hold(&command, 0, |_, _| true).is_some());
    }

    #[test]
    fn only_a_direct_buffer_is_taken_from_a_writes_data_out() {
        let buf = DIRECT_BUFFERS
            .with(|pool| pool.take(4096))
            .expect("an aligned buffer");
        let mut direct = DataOutBuf::Engine(Box::new(DirectDataOut(buf)));
        assert_eq!(
            take_direct_data_out(&mut direct).map(|b| b.len()),
            Some(4096)
        );
        assert!(matches!(&direct, DataOutBuf::Pooled(v) if v.is_empty()));
        let mut pooled = DataOutBuf::Pooled(vec![1; 512]);
        assert!(take_direct_data_out(&mut pooled).is_none());
        assert!(matches!(&pooled, DataOutBuf::Pooled(v) if v.len() == 512));
    }
}
