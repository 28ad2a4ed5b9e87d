//! When a connection wakes: the receive coalescer's plans carried out on the socket (its
//! low-water mark) and the batch's deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use seam::Activity;
use tokio::net::TcpStream;

use crate::dataplane::busy_poll;
use crate::dataplane::coalesce::{Coalescer, Lockstep, Outcome, Plan};
use crate::dataplane::sys;
use crate::metrics::Metrics;

/// Carries out the [`Coalescer`]'s plans on one connection: the socket's low-water mark, and
/// the deadline the connection's [`Alarm`] is set for while a batch collects (tokio's timers
/// tick in milliseconds, too coarse for a wait of a few hundred microseconds).
pub(super) struct Wakeups {
    pub(super) coalescer: Coalescer,
    /// The low-water mark the socket has now (1 = the default).
    pub(super) applied_low_water: usize,
    /// The current batch's deadline, if a batch is collecting.
    pub(super) deadline: Option<Instant>,
    /// Setting the low-water mark failed once: coalescing stays off for this connection.
    pub(super) unavailable: bool,
    /// Whether the worker's busy poll counts this connection as collecting a batch, and as
    /// one whose initiator waits for answers.
    pub(super) counted_batching: bool,
    pub(super) counted_waiting: bool,
    /// Whether the initiator waits for each answer (then the worker busy-polls for it), and
    /// its last verdict: the worker is asked only when that changes, so a kernel that refuses
    /// to watch the socket (or a worker that does not poll) costs nothing per turn.
    pub(super) lockstep: Lockstep,
    pub(super) lockstep_waiting: bool,
    pub(super) batches: u64,
    pub(super) misses: u64,
    pub(super) metrics: Arc<Metrics>,
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
    pub(super) fn new(max_wait: Duration, metrics: Arc<Metrics>) -> Wakeups {
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
    pub(super) fn after_turn(
        &mut self,
        socket: &TcpStream,
        activity: &Activity,
        timed_out: bool,
        now: Instant,
    ) {
        self.follow_lockstep(socket, activity);
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

    /// Whether the initiator waits for each answer (a shallow queue): then its socket is one
    /// the worker busy-polls before it sleeps. The only part of the plan a TLS queue takes
    /// (a receive low-water mark would count ciphertext, not commands).
    pub(super) fn follow_lockstep(&mut self, socket: &TcpStream, activity: &Activity) {
        let waiting = self.lockstep.after_turn(activity);
        if waiting != self.lockstep_waiting {
            self.lockstep_waiting = waiting;
            if waiting {
                self.counted_waiting = busy_poll::set_waiting(socket, true);
            } else if self.counted_waiting {
                self.counted_waiting = busy_poll::set_waiting(socket, false);
            }
        }
    }

    pub(super) fn set_low_water(&mut self, socket: &TcpStream, bytes: usize) -> bool {
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

    /// The socket's low-water mark was set back to one byte behind the plan's back (a
    /// payload received in place, `driver::read_placed`): the batch it served is over, and the
    /// next plan sets the mark again.
    pub(super) fn low_water_dropped(&mut self) {
        self.applied_low_water = 1;
        self.deadline = None;
        if self.counted_batching {
            busy_poll::set_batching(false);
            self.counted_batching = false;
        }
    }

    /// When the connection must read whatever has arrived, though less than the low-water mark:
    /// the batch's deadline, while the socket holds readiness back (a raised mark).
    pub(super) fn batch_deadline(&self) -> Option<Instant> {
        self.deadline.filter(|_| self.applied_low_water > 1)
    }

    /// Adds the counts since the last report to the daemon's metrics (once a second and at
    /// the end, so the command path touches no shared counter).
    pub(super) fn report(&mut self) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::testing::{loopback, runtime};

    /// A deep queue of small commands, sent without waiting for answers.
    fn pipelined() -> Activity {
        Activity {
            commands: 8,
            command_bytes: 8 * 48,
            other_pdus: 0,
            initiator_backlog: 32,
            in_flight: 32,
        }
    }

    #[test]
    fn without_a_coalescing_wait_the_socket_is_never_held_back() {
        let rt = runtime();
        let (sock, _host, _) = loopback(&rt);
        let mut w = Wakeups::new(Duration::ZERO, Arc::new(Metrics::new()));
        let mut now = Instant::now();
        for _ in 0..50 {
            now += Duration::from_micros(20);
            w.after_turn(&sock, &pipelined(), false, now);
        }
        assert_eq!(w.applied_low_water, 1);
        assert_eq!(w.batch_deadline(), None);
    }

    #[test]
    fn a_raised_low_water_mark_always_has_its_deadline_and_goes_back_to_one() {
        let rt = runtime();
        let (sock, _host, _) = loopback(&rt);
        let mut w = Wakeups::new(Duration::from_micros(200), Arc::new(Metrics::new()));
        assert!(w.set_low_water(&sock, 4096), "the kernel takes SO_RCVLOWAT");
        assert_eq!(w.applied_low_water, 4096);
        // A deadline only counts while the socket holds bytes back.
        w.deadline = Some(Instant::now());
        assert!(w.batch_deadline().is_some());
        assert!(w.set_low_water(&sock, 1));
        assert_eq!(w.applied_low_water, 1);
        assert_eq!(w.batch_deadline(), None);
    }

    #[test]
    fn batch_counts_reach_the_metrics_only_when_reported() {
        let metrics = Arc::new(Metrics::new());
        let mut w = Wakeups::new(Duration::from_micros(200), Arc::clone(&metrics));
        w.batches = 3;
        w.misses = 1;
        assert!(!metrics.render().contains("receive_batches_total 3"));
        w.report();
        let text = metrics.render();
        assert!(text.contains("receive_batches_total 3"), "{text}");
        assert!(text.contains("receive_batch_misses_total 1"), "{text}");
        assert_eq!((w.batches, w.misses), (0, 0), "reported once");
    }
}
