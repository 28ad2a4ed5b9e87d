//! Adaptive busy polling: a worker about to sleep first polls its connections' sockets for a
//! short while (`busy_poll_us`), if its last idle stretch was that short.
//!
//! An initiator that waits for each answer (QD1) sends its next command tens of microseconds
//! after the answer left. A worker that slept meanwhile must be woken: on a VM the sender's
//! kernel sends an inter-processor interrupt and the sleeping vCPU leaves its halt, which costs
//! more than the command itself (docs/PERFORMANCE.md, *The QD1 wake-up*). Polling through that gap
//! answers sooner and saves the sender's wake-up. Like the kernel's `busy_poll` and haltpoll it
//! trades CPU for latency, so it runs only when it pays: when the worker has nothing else to do
//! (tokio calls [`before_park`] only then), one of its connections has an initiator with a
//! shallow queue (its commands arrive with fewer of our answers unseen than receive coalescing
//! starts at: QD1 to QD8, `coalesce::LOCKSTEP_BACKLOG_MAX`), none is collecting
//! a receive batch (an initiator with a deep queue is not waiting for us, and a poll would only
//! take CPU from it), and the worker's idle stretches have been no longer than the window. One
//! that waits on long gaps (an idle session) stops polling after two long waits in a row, so
//! polling costs at most two windows per long idle stretch.
//!
//! A wait on a device (an io_uring read or write in flight) has a window of its own, learnt
//! the same way from how long device waits last: a device that answers within the window is
//! polled for, a slower one slept through (`WorkerPoll::device_budget`), with a probe now and
//! then to notice a device that became fast.
//!
//! The poll is `epoll_wait` with no timeout on a second, per-worker epoll that watches the
//! sockets of those waiting initiators for input and the connections' rings (tokio's own epoll
//! is not reachable), plus a flag the I/O threads raise when a command they ran completes.

use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::time::Timespec;

use crate::metrics::Metrics;

/// Consecutive idle stretches longer than the window after which polling stops: one alone may
/// be a hiccup (the initiator's thread preempted) in a stream of short ones.
const LONG_IDLES_TO_STOP: u8 = 2;

/// Whether to poll before the next sleep: the sans-IO decision.
#[derive(Debug, Clone)]
pub struct SpinWindow {
    max: Duration,
    /// Idle stretches in a row longer than `max`; starts "stopped".
    long_idles: u8,
}

impl SpinWindow {
    pub fn new(max: Duration) -> SpinWindow {
        SpinWindow {
            max,
            long_idles: LONG_IDLES_TO_STOP,
        }
    }

    /// How long to poll before sleeping (zero: sleep at once).
    pub fn budget(&self) -> Duration {
        if self.long_idles < LONG_IDLES_TO_STOP {
            self.max
        } else {
            Duration::ZERO
        }
    }

    /// The worker woke after being idle (polling, then perhaps sleeping) for `idle`: keep
    /// polling while a poll as long as the window would have caught the worker's wake-ups.
    pub fn woke_after(&mut self, idle: Duration) {
        self.long_idles = if self.max.is_zero() || idle > self.max {
            self.long_idles.saturating_add(1).min(LONG_IDLES_TO_STOP)
        } else {
            0
        };
    }
}

/// A worker's polling state, kept in a thread-local: tokio's park hooks take no arguments.
struct WorkerPoll {
    epoll: OwnedFd,
    window: SpinWindow,
    /// Device I/Os (io_uring) in flight on this worker's connections.
    device_io: usize,
    /// Whether the current idle stretch began with device I/O in flight.
    parked_on_device: bool,
    /// Whether to poll through a device's wait: open while the device answers within the
    /// window (see [`before_park`]).
    device_window: SpinWindow,
    /// Device waits slept through since the last probe.
    device_sleeps: u32,
    /// Connections of this worker collecting a receive batch: no polling while any is.
    batching: usize,
    /// Connections whose initiator keeps a shallow queue (QD1 to QD8): polling needs one.
    waiting: usize,
    parked_at: Instant,
    completed: Arc<AtomicBool>,
    /// Since the last report: polls, those that ended before their window, time polling.
    polls: u64,
    hits: u64,
    polling: Duration,
}

/// Device waits slept through between two probes (a poll through a device's wait while its
/// window is shut): how a device that became fast again is noticed, at one window of polling
/// in this many waits on a slow one.
const DEVICE_PROBE_EVERY: u32 = 32;

/// The poll's tag of a ring's signal (an initiator's socket is 0).
const RING: u64 = 1;
/// Events one `epoll_wait` of the poll takes.
const POLL_EVENTS: usize = 8;

impl WorkerPoll {
    /// How long to poll through a device's wait. A device that answers within the window (a
    /// loop device, an NVMe SSD) is polled for, as the initiator's next command is: sleeping
    /// costs a wake-up, which on a VM is tens of microseconds. A slower one (this machine's
    /// virtual disk, 50-90 µs) is slept through: a vCPU spinning through its wait slowed the
    /// read itself (4 KiB QD1 reads: 107-113 µs mean polling, 94-103 sleeping; measured
    /// 2026-11-25), since a halted vCPU leaves the host's CPU to the disk's emulation.
    fn device_budget(&mut self) -> Duration {
        let budget = self.device_window.budget();
        if !budget.is_zero() {
            return budget;
        }
        self.device_sleeps += 1;
        if self.device_sleeps < DEVICE_PROBE_EVERY {
            return Duration::ZERO;
        }
        self.device_sleeps = 0;
        self.device_window.max
    }
}

thread_local! {
    static WORKER: RefCell<Option<WorkerPoll>> = const { RefCell::new(None) };
}

/// Sets up polling for the calling worker thread; a zero window (or an epoll the kernel refuses)
/// leaves it off. Call before building the worker's runtime with [`before_park`] and
/// [`after_unpark`] as its park hooks.
pub fn install(max: Duration) {
    if max.is_zero() {
        return;
    }
    let epoll = match epoll::create(epoll::CreateFlags::CLOEXEC) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!("busy polling off for this worker: epoll: {e}");
            return;
        }
    };
    WORKER.with(|w| {
        *w.borrow_mut() = Some(WorkerPoll {
            epoll,
            window: SpinWindow::new(max),
            device_io: 0,
            parked_on_device: false,
            device_window: SpinWindow::new(max),
            device_sleeps: 0,
            batching: 0,
            waiting: 0,
            parked_at: Instant::now(),
            completed: Arc::new(AtomicBool::new(false)),
            polls: 0,
            hits: 0,
            polling: Duration::ZERO,
        });
    });
}

/// The flag an I/O thread raises after handing a completed command back to this worker, so a
/// poll in progress ends (None when the worker does not poll).
pub fn completion_flag() -> Option<Arc<AtomicBool>> {
    WORKER.with(|w| w.borrow().as_ref().map(|w| Arc::clone(&w.completed)))
}

/// A connection of this worker starts (`true`) or stops collecting a receive batch.
pub fn set_batching(batching: bool) {
    count(batching, |w| &mut w.batching);
}

/// A connection of this worker now has an initiator that waits for each answer, or no longer:
/// its socket joins the worker's poll, or leaves it. Only such sockets are watched, so the
/// sockets of deep queues cost the kernel no second wake-up callback per segment. A socket also
/// leaves when its last descriptor closes. Returns whether the socket is now counted as waiting
/// (false when the worker does not poll or the kernel refused).
pub fn set_waiting(socket: impl AsFd, waiting: bool) -> bool {
    WORKER.with(|w| {
        let Ok(mut w) = w.try_borrow_mut() else {
            return false;
        };
        let Some(w) = w.as_mut() else {
            return false;
        };
        if waiting {
            // Level-triggered: input left unread (a congested connection) ends each poll at
            // once, so the worker polls in vain at most once before it sleeps.
            match epoll::add(
                &w.epoll,
                socket,
                epoll::EventData::new_u64(0),
                epoll::EventFlags::IN,
            ) {
                Ok(()) => {
                    w.waiting = w.waiting.saturating_add(1);
                    true
                }
                Err(e) => {
                    tracing::debug!("connection not busy-polled: epoll: {e}");
                    false
                }
            }
        } else {
            let _ = epoll::delete(&w.epoll, socket);
            w.waiting = w.waiting.saturating_sub(1);
            false
        }
    })
}

/// A connection's io_uring joins the worker's poll for good (it leaves as its descriptor
/// closes): a read or write completing ends a poll through the device's wait. Edge-triggered:
/// a ring with deferred task work signals an eventfd nobody reads (reading it back at every
/// reap stalled write-through writes at QD64: docs/ARCHITECTURE.md), so a completion reaped
/// by a turn leaves its edge behind; a poll takes such stale edges first (`RING`).
pub fn watch_ring(ring: impl AsFd) {
    WORKER.with(|w| {
        let Ok(w) = w.try_borrow() else {
            return;
        };
        let Some(w) = w.as_ref() else {
            return;
        };
        if let Err(e) = epoll::add(
            &w.epoll,
            ring,
            epoll::EventData::new_u64(RING),
            epoll::EventFlags::IN | epoll::EventFlags::ET,
        ) {
            tracing::debug!("io_uring not busy-polled: epoll: {e}");
        }
    });
}

/// A connection's device I/Os in flight went from `before` to `after` (call on its worker).
pub fn device_io_changed(before: usize, after: usize) {
    if before == after {
        return;
    }
    WORKER.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if let Some(w) = w.as_mut() {
                w.device_io = w.device_io.saturating_sub(before).saturating_add(after);
            }
        }
    });
}

/// A connection counted as waiting ends (its socket leaves the poll as it closes).
pub fn waiting_ended() {
    count(false, |w| &mut w.waiting);
}

fn count(up: bool, counter: impl FnOnce(&mut WorkerPoll) -> &mut usize) {
    WORKER.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if let Some(w) = w.as_mut() {
                let n = counter(w);
                *n = if up {
                    n.saturating_add(1)
                } else {
                    n.saturating_sub(1)
                };
            }
        }
    });
}

/// tokio's `on_thread_park` hook: polls for up to the window when it is open.
pub fn before_park() {
    WORKER.with(|w| {
        let Ok(mut w) = w.try_borrow_mut() else {
            return;
        };
        let Some(w) = w.as_mut() else {
            return;
        };
        w.parked_at = Instant::now();
        w.parked_on_device = w.device_io > 0;
        // Only for an initiator that waits for each answer (a shallow queue), as below: one
        // with a deep queue keeps the device busy without us, and a poll through its device
        // waits took the CPU its client and the device's completions needed (4 KiB QD64 writes
        // to a loop device: 0.69x the IOPS, reads 0.91x).
        let budget = if w.waiting == 0 {
            Duration::ZERO
        } else if w.parked_on_device {
            w.device_budget()
        } else {
            w.window.budget()
        };
        if budget.is_zero() || w.batching > 0 {
            return;
        }
        let no_wait = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut events = [epoll::Event {
            flags: epoll::EventFlags::empty(),
            data: epoll::EventData::new_u64(0),
        }; POLL_EVENTS];
        w.polls += 1;
        // A ring's edge counts only through a device's wait, and not in the first look: that
        // one takes what completions already reaped left behind. (One that came since the last
        // reap is taken with them: this poll then lasts its window, and tokio, which saw the
        // edge too, runs it at once after.)
        let mut first = true;
        let hit = loop {
            if w.completed.swap(false, Ordering::Acquire) {
                break true;
            }
            match epoll::wait(&w.epoll, &mut events[..], Some(&no_wait)) {
                Ok(n) => {
                    let ready = events.get(..n).unwrap_or_default();
                    let input = ready.iter().any(|e| e.data.u64() != RING);
                    let ring = ready.iter().any(|e| e.data.u64() == RING);
                    // Ready (tokio's epoll has it too): run it.
                    if input || (ring && w.parked_on_device && !first) {
                        break true;
                    }
                }
                // Broken: sleep in tokio's epoll.
                Err(_) => break false,
            }
            first = false;
            if w.parked_at.elapsed() >= budget {
                break false;
            }
            // Any other runnable thread on this CPU (an initiator on the same machine, another
            // process) goes first: the poll only takes CPU time nobody else wants. Measured: on
            // 2 cores with 4 QD1 initiators, polling without yielding lost 19% of their IOPS.
            std::thread::yield_now();
        };
        w.hits += u64::from(hit);
        w.polling += w.parked_at.elapsed();
    });
}

/// Adds this worker's polling counts since the last report to the metrics (call on the worker,
/// once a second: the park hooks touch no shared counter). Returns the time spent polling.
pub fn report(metrics: &Metrics) -> Duration {
    WORKER.with(|w| {
        let Ok(mut w) = w.try_borrow_mut() else {
            return Duration::ZERO;
        };
        let Some(w) = w.as_mut() else {
            return Duration::ZERO;
        };
        let polling = std::mem::take(&mut w.polling);
        metrics.busy_polls.inc_by(std::mem::take(&mut w.polls));
        metrics.busy_poll_hits.inc_by(std::mem::take(&mut w.hits));
        metrics.busy_poll_seconds.inc_by(polling.as_secs_f64());
        polling
    })
}

/// tokio's `on_thread_unpark` hook: learns from the idle stretch that just ended.
pub fn after_unpark() {
    WORKER.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if let Some(w) = w.as_mut() {
                // A device's wait says nothing of how soon the initiator sends, and the
                // reverse.
                let idle = w.parked_at.elapsed();
                if w.parked_on_device {
                    w.device_window.woke_after(idle);
                } else {
                    w.window.woke_after(idle);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn polls_only_after_an_idle_stretch_no_longer_than_the_window() {
        let mut w = SpinWindow::new(50 * US);
        assert_eq!(w.budget(), Duration::ZERO, "no poll before any evidence");
        w.woke_after(30 * US);
        assert_eq!(w.budget(), 50 * US);
        w.woke_after(50 * US);
        assert_eq!(w.budget(), 50 * US, "the window's own length still counts");
        w.woke_after(51 * US);
        assert_eq!(w.budget(), 50 * US, "one long wait may be a hiccup");
        w.woke_after(20 * US);
        w.woke_after(Duration::from_millis(2));
        assert_eq!(w.budget(), 50 * US, "long waits count only in a row");
        w.woke_after(Duration::from_secs(3));
        assert_eq!(
            w.budget(),
            Duration::ZERO,
            "two long waits in a row stop polling"
        );
        for _ in 0..300 {
            w.woke_after(Duration::from_secs(1));
        }
        assert_eq!(w.budget(), Duration::ZERO);
        w.woke_after(Duration::ZERO);
        assert_eq!(w.budget(), 50 * US, "one short wait restarts it");
    }

    #[test]
    fn a_zero_window_never_polls() {
        let mut w = SpinWindow::new(Duration::ZERO);
        for idle in [Duration::ZERO, US, Duration::from_secs(1)] {
            w.woke_after(idle);
            assert_eq!(w.budget(), Duration::ZERO);
        }
    }

    #[test]
    fn a_poll_ends_early_on_input_and_otherwise_at_the_window() {
        use std::io::Write;
        std::thread::spawn(|| {
            // Long enough that a loaded CI machine's scheduling delays (milliseconds) stay far
            // below the "ended early" margin of half a window.
            let window = Duration::from_millis(200);
            install(window);
            let (server, mut client) = waiting_initiator();
            // Open the window: the last idle stretch was short.
            before_park();
            after_unpark();
            // Nothing arrives: the poll lasts the window.
            let start = Instant::now();
            before_park();
            assert!(start.elapsed() >= window, "ended early without input");
            after_unpark();
            // No poll without a connection whose initiator waits for answers.
            assert!(!set_waiting(&server, false));
            let start = Instant::now();
            before_park();
            after_unpark();
            assert!(start.elapsed() < window / 2, "polled for nobody");
            assert!(set_waiting(&server, true));
            // Input waiting: the poll ends at once.
            client.write_all(b"x").unwrap();
            std::thread::sleep(Duration::from_millis(1));
            let start = Instant::now();
            before_park();
            assert!(start.elapsed() < window / 2, "did not notice the input");
            after_unpark();
            // No poll while a connection collects a batch, though input waits no longer.
            set_batching(true);
            let start = Instant::now();
            before_park();
            after_unpark();
            set_batching(false);
            assert!(start.elapsed() < window / 2, "polled while batching");
            // A completion ends it too.
            let mut buf = [0u8; 1];
            std::io::Read::read(&mut &server, &mut buf).unwrap();
            let flag = completion_flag().unwrap();
            flag.store(true, Ordering::Release);
            let start = Instant::now();
            before_park();
            assert!(
                start.elapsed() < window / 2,
                "did not notice the completion"
            );
        })
        .join()
        .unwrap();
    }

    /// Polls made on this thread so far (the count [`report`] takes).
    fn polls() -> u64 {
        WORKER.with(|w| w.borrow().as_ref().map_or(0, |w| w.polls))
    }

    /// A connection whose initiator waits for each answer, counted as waiting (keep both ends).
    fn waiting_initiator() -> (std::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert!(set_waiting(&server, true));
        (server, client)
    }

    /// A stand-in for a ring's eventfd, watched as a ring is.
    fn ring() -> OwnedFd {
        let event = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        watch_ring(&event);
        event
    }

    #[test]
    fn a_device_wait_is_polled_through_while_the_device_answers_within_the_window() {
        std::thread::spawn(|| {
            let window = Duration::from_millis(200);
            install(window);
            let event = ring();
            let (server, _client) = waiting_initiator();
            device_io_changed(0, 1);
            // No evidence yet: sleep through the device's wait.
            before_park();
            assert_eq!(polls(), 0, "polled through a device wait of unknown length");
            // The device answered at once: its window opens.
            after_unpark();
            before_park();
            assert_eq!(
                polls(),
                1,
                "no poll for a device that answers within the window"
            );
            after_unpark();
            // Its completion ends the poll.
            let signal = std::thread::spawn({
                let event = event.try_clone().unwrap();
                move || {
                    std::thread::sleep(Duration::from_millis(20));
                    rustix::io::write(&event, &1u64.to_ne_bytes()).unwrap();
                }
            });
            let start = Instant::now();
            before_park();
            assert!(
                start.elapsed() < window,
                "the completion did not end the poll"
            );
            signal.join().unwrap();
            after_unpark();
            // A completion a turn reaped leaves its edge behind: the next poll outlasts it.
            rustix::io::write(&event, &1u64.to_ne_bytes()).unwrap();
            let start = Instant::now();
            before_park();
            assert!(start.elapsed() >= window, "a stale edge ended the poll");
            after_unpark();
            // Two waits longer than the window in a row shut it.
            for _ in 0..LONG_IDLES_TO_STOP {
                before_park();
                std::thread::sleep(window);
                after_unpark();
            }
            let before = polls();
            before_park();
            assert_eq!(polls(), before, "polled through a slow device's wait");
            // Fast again (the probe's wait was short), but only initiators with deep queues
            // are left: no poll.
            after_unpark();
            assert!(!set_waiting(&server, false));
            before_park();
            assert_eq!(
                polls(),
                before,
                "polled for an initiator that does not wait"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_long_device_wait_leaves_the_initiators_window_open() {
        std::thread::spawn(|| {
            let window = Duration::from_millis(200);
            install(window);
            let _initiator = waiting_initiator();
            before_park();
            after_unpark();
            device_io_changed(0, 1);
            before_park();
            std::thread::sleep(window * 2);
            after_unpark();
            device_io_changed(1, 0);
            let before = polls();
            before_park();
            assert_eq!(polls(), before + 1, "the initiator's window closed");
            after_unpark();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_slow_device_is_probed_now_and_then() {
        std::thread::spawn(|| {
            let window = Duration::from_millis(2);
            install(window);
            let _event = ring();
            let _initiator = waiting_initiator();
            device_io_changed(0, 1);
            let mut probes = 0;
            for _ in 0..DEVICE_PROBE_EVERY * 3 {
                let before = polls();
                before_park();
                probes += polls() - before;
                // Every wait lasts longer than the window: the device is slow.
                std::thread::sleep(window * 3);
                after_unpark();
            }
            assert_eq!(probes, 3, "one probe every {DEVICE_PROBE_EVERY} waits");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn hooks_are_no_ops_on_a_thread_without_polling() {
        std::thread::spawn(|| {
            install(Duration::ZERO);
            assert!(completion_flag().is_none());
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            assert!(!set_waiting(&listener, true), "counted without polling");
            let start = Instant::now();
            before_park();
            after_unpark();
            // No window to poll for: back at once (the bound only leaves room for scheduling).
            assert!(start.elapsed() < Duration::from_millis(100));
        })
        .join()
        .unwrap();
    }
}
