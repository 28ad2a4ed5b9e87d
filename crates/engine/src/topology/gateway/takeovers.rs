//! The takeovers one gateway runs for one image, one at a time, and what readers learn of
//! them: whether one runs now (its groups report transitioning), and whether one ran since a
//! mark (an observation made meanwhile may predate it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Takeovers by this gateway (the vigil's, `ctl device take`, SET TARGET PORT GROUPS).
#[derive(Default)]
pub(super) struct Takeovers {
    /// Twice the takeovers run: odd while one runs. Only [`Takeovers::run`] moves it, under
    /// `one`, so two at once cannot make it even while either runs.
    count: AtomicU64,
    one: Mutex<()>,
    /// Told when a takeover ends (under `ended_lock`, so a waiter between its look and its
    /// wait cannot miss it).
    ended: Condvar,
    ended_lock: Mutex<()>,
}

/// Where [`Takeovers::count`] stood when an observation began.
#[derive(Clone, Copy)]
pub(super) struct Mark(u64);

/// Ends a takeover however its closure ends (an early return or a panic): the count is never
/// left odd.
struct Ending<'a>(&'a Takeovers);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let _told = self
            .0
            .ended_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let was = self.0.count.fetch_add(1, Ordering::AcqRel);
        debug_assert_eq!(was % 2, 1, "a takeover ends only after it began");
        self.0.ended.notify_all();
    }
}

impl Takeovers {
    /// Runs `take` as one takeover, after any other this gateway runs for the image.
    pub(super) fn run<R>(&self, take: impl FnOnce() -> R) -> R {
        let _one = self.one.lock().unwrap_or_else(PoisonError::into_inner);
        let was = self.count.fetch_add(1, Ordering::AcqRel);
        debug_assert_eq!(was % 2, 0, "one takeover at a time");
        let _ending = Ending(self);
        take()
    }

    /// Waits, at most `within`, until no takeover runs; whether none does at the end.
    pub(super) fn settle(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut told = self
            .ended_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while self.running() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            told = self
                .ended
                .wait_timeout(told, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Whether a takeover runs now.
    pub(super) fn running(&self) -> bool {
        self.count.load(Ordering::Acquire) % 2 == 1
    }

    /// A mark to judge an observation by, taken before it begins.
    pub(super) fn mark(&self) -> Mark {
        Mark(self.count.load(Ordering::Acquire))
    }

    /// Whether a takeover ran at any time since `mark` was taken (or was running then).
    pub(super) fn since(&self, mark: Mark) -> bool {
        mark.0 % 2 == 1 || self.count.load(Ordering::Acquire) != mark.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    /// Two takeovers asked at once run one after the other, and the gateway reports one
    /// running from the first's start to the second's end (a shared count made even by the
    /// second's start hid the first).
    #[test]
    fn two_takeovers_at_once_run_in_turn_and_show_throughout() {
        let takeovers = Arc::new(Takeovers::default());
        let inside = Arc::new(AtomicBool::new(false));
        let (entered, first_in) = mpsc::channel();
        let (release, go) = mpsc::channel::<()>();
        let enter = |takeovers: &Takeovers, inside: &AtomicBool| {
            assert!(takeovers.running());
            assert!(
                !inside.swap(true, Ordering::AcqRel),
                "two takeovers at once"
            );
        };
        let first = {
            let (t, i) = (Arc::clone(&takeovers), Arc::clone(&inside));
            std::thread::spawn(move || {
                t.run(|| {
                    enter(&t, &i);
                    entered.send(()).unwrap();
                    go.recv().unwrap();
                    i.store(false, Ordering::Release);
                })
            })
        };
        first_in.recv().unwrap();
        let second = {
            let (t, i) = (Arc::clone(&takeovers), Arc::clone(&inside));
            std::thread::spawn(move || {
                t.run(|| {
                    enter(&t, &i);
                    i.store(false, Ordering::Release);
                })
            })
        };
        // The second waits for the first; the count stays odd meanwhile.
        std::thread::sleep(Duration::from_millis(50));
        assert!(takeovers.running());
        release.send(()).unwrap();
        first.join().unwrap();
        second.join().unwrap();
        assert!(!takeovers.running());
        assert_eq!(takeovers.count.load(Ordering::Acquire), 4);
    }

    #[test]
    fn an_observation_knows_whether_a_takeover_ran_meanwhile() {
        let takeovers = Takeovers::default();
        let before = takeovers.mark();
        assert!(!takeovers.since(before));
        takeovers.run(|| {
            // Taken while one runs: stale whatever happens next.
            assert!(takeovers.since(takeovers.mark()));
        });
        assert!(takeovers.since(before));
        let after = takeovers.mark();
        assert!(!takeovers.since(after));
    }

    /// A waiter learns of a takeover's end when it comes, not a poll later, and one that
    /// outlasts the wait leaves the waiter at its bound.
    #[test]
    fn settling_waits_for_the_takeover_to_end_and_no_longer_than_asked() {
        let takeovers = Arc::new(Takeovers::default());
        assert!(takeovers.settle(Duration::ZERO));
        let (entered, first_in) = mpsc::channel();
        let (release, go) = mpsc::channel::<()>();
        let taker = {
            let t = Arc::clone(&takeovers);
            std::thread::spawn(move || {
                t.run(|| {
                    entered.send(()).unwrap();
                    go.recv().unwrap();
                })
            })
        };
        first_in.recv().unwrap();
        let began = Instant::now();
        assert!(!takeovers.settle(Duration::from_millis(50)));
        assert!(began.elapsed() >= Duration::from_millis(50));
        let waiter = {
            let t = Arc::clone(&takeovers);
            std::thread::spawn(move || (t.settle(Duration::from_secs(60)), Instant::now()))
        };
        std::thread::sleep(Duration::from_millis(50));
        let released = Instant::now();
        release.send(()).unwrap();
        taker.join().unwrap();
        let (settled, at) = waiter.join().unwrap();
        assert!(settled);
        assert!(at >= released);
        // Told at the end: well inside the 60 s it would otherwise wait.
        assert!(
            at - released < Duration::from_secs(10),
            "{:?}",
            at - released
        );
    }

    #[test]
    fn a_takeover_that_panics_still_ends() {
        let takeovers = Takeovers::default();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            takeovers.run(|| panic!("a failed take"))
        }));
        assert!(caught.is_err());
        assert!(!takeovers.running());
        // The lock is not left poisoned for the next one's sake.
        assert_eq!(takeovers.run(|| 7), 7);
    }
}
