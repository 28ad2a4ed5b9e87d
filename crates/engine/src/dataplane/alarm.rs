//! A one-shot timer on a timerfd: the only timer of the worker runtimes.
//!
//! The workers' runtimes are built without tokio's time driver. With it, every park of the
//! runtime reads the clock and turns the timer wheel, whether or not any timer is due: A/Bs at
//! QD1 measured the target's CPU 3-6 % lower per I/O with this module than with it
//! (A/B of 2026-11-22, docs/PERFORMANCE.md). Each connection instead holds one `Alarm`, armed for its
//! nearest deadline (the once-a-second housekeeping, a receive batch's deadline, the login
//! deadline, a stalled Data-Out's bound), so it costs one descriptor and a `timerfd_settime`
//! only when that deadline changes. Calling a `tokio::time` function on a worker panics, so none
//! may run there.

use std::io;
use std::os::fd::OwnedFd;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
use tokio::io::unix::AsyncFd;

use crate::dataplane::sys;

pub struct Alarm {
    fd: AsyncFd<OwnedFd>,
    /// The instant it is armed for; None when disarmed or already rung.
    armed: Option<Instant>,
}

impl Alarm {
    /// A disarmed alarm, registered with the current runtime's reactor (call inside a runtime).
    pub fn new() -> io::Result<Alarm> {
        Ok(Alarm {
            fd: sys::microsecond_timer()?,
            armed: None,
        })
    }

    /// Arms the alarm for `at` (at once if that has passed), replacing any earlier setting.
    /// A no-op when it is armed for `at` already, so a caller may set it every turn.
    pub fn set(&mut self, at: Instant) -> io::Result<()> {
        if self.armed == Some(at) {
            return Ok(());
        }
        let spec = Itimerspec {
            it_interval: ZERO,
            it_value: time_until(at, Instant::now()),
        };
        timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
        self.armed = Some(at);
        Ok(())
    }

    /// Resolves once the armed instant has passed; never while disarmed. After it resolves the
    /// alarm is disarmed until the next [`Alarm::set`]. Cancel safe: dropping the future before
    /// it resolves leaves the alarm armed.
    pub async fn rung(&mut self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_rung(cx)).await
    }

    /// [`Alarm::rung`] as a poll, for a waiter that keeps no future per source (a parked
    /// connection's).
    pub fn poll_rung(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.armed.is_none() {
            return Poll::Pending;
        }
        loop {
            let mut ready = ready!(self.fd.poll_read_ready(cx))?;
            let mut expirations = [0u8; 8];
            match rustix::io::read(self.fd.get_ref(), &mut expirations) {
                Ok(_) => {
                    // Read until the next setting: a timerfd rings once per setting, so the
                    // next wait need not read it only to find it empty.
                    ready.clear_ready();
                    self.armed = None;
                    return Poll::Ready(Ok(()));
                }
                // Readiness left from an expiry that a later `set` cancelled.
                Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }
}

const ZERO: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 0,
};

/// The relative expiry for `at` seen from `now`: at least 1 ns, since all zero disarms.
fn time_until(at: Instant, now: Instant) -> Timespec {
    let wait = at
        .saturating_duration_since(now)
        .max(Duration::from_nanos(1));
    Timespec {
        tv_sec: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(wait.subsec_nanos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime like the workers': I/O driver only, no time driver.
    fn worker_like_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap()
    }

    #[test]
    fn expiry_is_relative_with_whole_seconds_and_never_zero() {
        let now = Instant::now();
        let t = time_until(now + Duration::from_millis(2_500), now);
        assert_eq!((t.tv_sec, t.tv_nsec), (2, 500_000_000));
        let t = time_until(now + Duration::from_micros(300), now);
        assert_eq!((t.tv_sec, t.tv_nsec), (0, 300_000));
        // Past and present instants ring at once, not never.
        let t = time_until(now, now + Duration::from_secs(1));
        assert_eq!((t.tv_sec, t.tv_nsec), (0, 1));
        let t = time_until(now, now);
        assert_eq!((t.tv_sec, t.tv_nsec), (0, 1));
    }

    #[test]
    fn rings_after_the_instant_without_tokio_timers() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            let start = Instant::now();
            let at = start + Duration::from_millis(20);
            alarm.set(at).unwrap();
            assert_eq!(alarm.armed, Some(at));
            alarm.rung().await.unwrap();
            assert!(Instant::now() >= at, "rang early");
            assert_eq!(alarm.armed, None, "a rung alarm is disarmed");
        });
    }

    #[test]
    fn a_rung_alarm_shows_no_readiness_until_it_rings_again() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            alarm.set(Instant::now()).unwrap();
            alarm.rung().await.unwrap();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let shown = alarm.fd.poll_read_ready(&mut cx);
            assert!(shown.is_pending(), "read once, it shows readable again");
            alarm.set(Instant::now()).unwrap();
            alarm.rung().await.unwrap();
        });
    }

    #[test]
    fn a_past_instant_rings_at_once() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            alarm.set(Instant::now() - Duration::from_secs(1)).unwrap();
            alarm.rung().await.unwrap();
        });
    }

    #[test]
    fn a_later_setting_replaces_an_earlier_one() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            let start = Instant::now();
            alarm.set(start + Duration::from_millis(5)).unwrap();
            let later = start + Duration::from_millis(60);
            alarm.set(later).unwrap();
            alarm.rung().await.unwrap();
            assert!(Instant::now() >= later, "the earlier setting rang");
        });
    }

    #[test]
    fn a_stale_expiry_does_not_ring_a_rearmed_alarm() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            alarm.set(Instant::now()).unwrap();
            // Let it expire unread, then re-arm: the old expiry is cancelled.
            std::thread::sleep(Duration::from_millis(5));
            let later = Instant::now() + Duration::from_millis(40);
            alarm.set(later).unwrap();
            alarm.rung().await.unwrap();
            assert!(Instant::now() >= later, "rang for the cancelled expiry");
        });
    }

    #[test]
    fn a_disarmed_alarm_never_rings() {
        worker_like_runtime().block_on(async {
            let mut alarm = Alarm::new().unwrap();
            assert!(!poll_once(alarm.rung()), "rang without being set");
            alarm.set(Instant::now()).unwrap();
            alarm.rung().await.unwrap();
            std::thread::sleep(Duration::from_millis(2));
            assert!(!poll_once(alarm.rung()), "rang twice for one setting");
        });
    }

    /// Polls a future once with a no-op waker: whether it was ready.
    fn poll_once<F: std::future::Future>(future: F) -> bool {
        let mut future = std::pin::pin!(future);
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        future.as_mut().poll(&mut cx).is_ready()
    }
}
