//! A session's life beside its protocol, without I/O: when it next needs the clock, and what a
//! tick decides of the connection (the door's own verdict on a silent peer, and the
//! daemon's shutdown: ask for a logout, then close when its grace is over). The driver asks
//! [`Lifecycle::poll_timeout`] when to wake, and calls [`Lifecycle::handle_timeout`] when the
//! tick is due; every decision here is unit-tested with a clock the test moves.

use std::time::{Duration, Instant};

use seam::Liveness;

use super::closed::Ended;

/// How often a session ticks: NOP-In pings, idle and dead-peer verdicts, topology changes,
/// ownership loss and shutdown are decided this often; an idle receive buffer shrinks and the
/// connection's counts reach the metrics.
pub const TICK: Duration = Duration::from_secs(1);

/// What the daemon's shutdown asks of a session at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Nothing (not shutting down, or a logout was asked for and its grace runs).
    Nothing,
    /// Ask the initiator to log out within this many seconds.
    AskLogout(u16),
    Close(Ended),
}

#[derive(Debug)]
pub struct Lifecycle {
    next_tick: Instant,
    grace: Duration,
    /// Set once the initiator was asked to log out: the session ends then at the latest.
    logout_deadline: Option<Instant>,
}

impl Lifecycle {
    pub fn new(now: Instant, grace: Duration) -> Lifecycle {
        Lifecycle {
            next_tick: now + TICK,
            grace,
            logout_deadline: None,
        }
    }

    /// When the session next needs the clock.
    pub fn poll_timeout(&self) -> Instant {
        self.next_tick
    }

    /// Whether the tick is due at `now`; if so the next one is a whole tick away (a tick held
    /// up, by a long Data-Out say, is not made up for).
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        if now < self.next_tick {
            return false;
        }
        self.next_tick = now + TICK;
        true
    }

    /// The door's verdict on a silent connection.
    pub fn verdict(tick: Liveness) -> Option<Ended> {
        match tick {
            Liveness::Continue => None,
            Liveness::DeadPeer => Some(Ended::DeadPeer),
            Liveness::Idle => Some(Ended::Idle),
        }
    }

    /// What the shutdown asks at `now`: once the daemon shuts down, a logout within the grace
    /// (or the close at once, without one); the close once the grace is over.
    pub fn shutdown(&mut self, now: Instant, shutting_down: bool) -> Shutdown {
        match self.logout_deadline {
            None if !shutting_down => Shutdown::Nothing,
            None if self.grace.is_zero() => Shutdown::Close(Ended::Shutdown),
            None => {
                self.logout_deadline = Some(now + self.grace);
                Shutdown::AskLogout(u16::try_from(self.grace.as_secs()).unwrap_or(u16::MAX))
            }
            Some(deadline) if now >= deadline => Shutdown::Close(Ended::NoLogout),
            Some(_) => Shutdown::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_comes_once_a_second_and_a_late_one_is_not_made_up() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(life.poll_timeout(), t0 + TICK);
        assert!(!life.handle_timeout(t0 + Duration::from_millis(999)));
        assert_eq!(
            life.poll_timeout(),
            t0 + TICK,
            "an early wake-up moves nothing"
        );
        // Three seconds late: one tick, and the next a whole tick after it.
        let late = t0 + Duration::from_secs(4);
        assert!(life.handle_timeout(late));
        assert!(!life.handle_timeout(late));
        assert_eq!(life.poll_timeout(), late + TICK);
    }

    #[test]
    fn a_silent_peer_is_closed_on_the_sessions_verdict() {
        assert_eq!(Lifecycle::verdict(Liveness::Continue), None);
        assert_eq!(
            Lifecycle::verdict(Liveness::DeadPeer),
            Some(Ended::DeadPeer)
        );
        assert_eq!(Lifecycle::verdict(Liveness::Idle), Some(Ended::Idle));
        assert_eq!(Ended::Idle.reason(), "idle_timeout_s");
    }

    #[test]
    fn a_shutdown_asks_for_a_logout_once_then_closes_after_the_grace() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(life.shutdown(t0, false), Shutdown::Nothing);
        assert_eq!(life.shutdown(t0, true), Shutdown::AskLogout(5));
        let later = t0 + Duration::from_secs(4);
        assert_eq!(life.shutdown(later, true), Shutdown::Nothing, "asked once");
        let over = t0 + Duration::from_secs(5);
        assert_eq!(life.shutdown(over, true), Shutdown::Close(Ended::NoLogout));
    }

    #[test]
    fn a_shutdown_without_grace_closes_at_once() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::ZERO);
        assert_eq!(life.shutdown(t0, true), Shutdown::Close(Ended::Shutdown));
    }

    #[test]
    fn a_grace_longer_than_a_logout_can_say_is_capped() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::from_secs(100_000));
        assert_eq!(life.shutdown(t0, true), Shutdown::AskLogout(u16::MAX));
    }
}
