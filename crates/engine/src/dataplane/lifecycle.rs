//! A session's life beside its protocol, without I/O: when it next needs the clock, and what a
//! tick decides of the connection (the door's own verdict on a silent peer, and
//! leaving — the daemon's shutdown or a removed portal: ask the host to leave, then close). The driver asks
//! [`Lifecycle::poll_timeout`] when to wake, and calls [`Lifecycle::handle_timeout`] when the
//! tick is due; every decision here is unit-tested with a clock the test moves.

use std::time::{Duration, Instant};

use seam::Liveness;

use super::closed::Ended;

/// How often a session ticks: NOP-In pings, idle and dead-peer verdicts, topology changes,
/// ownership loss and shutdown are decided this often; an idle receive buffer shrinks and the
/// connection's counts reach the metrics.
pub const TICK: Duration = Duration::from_secs(1);

/// What leaving (the daemon shutting down, the session's portal removed) asks of a session
/// at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leave {
    /// Nothing (not leaving, or the host was asked and its grace runs).
    Stay,
    /// Ask the host to leave (an iSCSI logout) within this many seconds.
    Ask(u16),
    Close(Ended),
}

#[derive(Debug)]
pub struct Lifecycle {
    next_tick: Instant,
    grace: Duration,
    /// Set once the session began to leave: it ends then at the latest.
    leave_deadline: Option<Instant>,
}

impl Lifecycle {
    pub fn new(now: Instant, grace: Duration) -> Lifecycle {
        Lifecycle {
            next_tick: now + TICK,
            grace,
            leave_deadline: None,
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

    /// What leaving asks at `now` (`leaving`: why the session leaves, None while it stays):
    /// a host whose door can ask is asked once to leave within the grace; a door that cannot
    /// ask is closed once `quiescent` (nothing of its host's outstanding); any is closed at
    /// once without a grace, and when the grace is over.
    pub fn leave(
        &mut self,
        now: Instant,
        leaving: Option<Ended>,
        can_ask: bool,
        quiescent: bool,
    ) -> Leave {
        let Some(why) = leaving else {
            return Leave::Stay;
        };
        match self.leave_deadline {
            None if self.grace.is_zero() => Leave::Close(why),
            None => {
                self.leave_deadline = Some(now + self.grace);
                match (can_ask, quiescent) {
                    (true, _) => {
                        Leave::Ask(u16::try_from(self.grace.as_secs()).unwrap_or(u16::MAX))
                    }
                    (false, true) => Leave::Close(why),
                    (false, false) => Leave::Stay,
                }
            }
            Some(deadline) if now >= deadline => Leave::Close(Ended::NoLogout),
            Some(_) if !can_ask && quiescent => Leave::Close(why),
            Some(_) => Leave::Stay,
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

    const SHUTDOWN: Option<Ended> = Some(Ended::Shutdown);

    #[test]
    fn a_host_that_can_be_asked_is_asked_once_then_closed_after_the_grace() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(life.leave(t0, None, true, false), Leave::Stay);
        assert_eq!(life.leave(t0, SHUTDOWN, true, false), Leave::Ask(5));
        let later = t0 + Duration::from_secs(4);
        assert_eq!(
            life.leave(later, SHUTDOWN, true, true),
            Leave::Stay,
            "asked once; quiet or not, it may still log out"
        );
        let over = t0 + Duration::from_secs(5);
        assert_eq!(
            life.leave(over, SHUTDOWN, true, false),
            Leave::Close(Ended::NoLogout)
        );
    }

    #[test]
    fn a_host_that_cannot_be_asked_is_closed_once_quiet_or_after_the_grace() {
        let t0 = Instant::now();
        let gone = Some(Ended::ListenerRemoved);
        let mut quiet = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(
            quiet.leave(t0, gone, false, true),
            Leave::Close(Ended::ListenerRemoved)
        );
        let mut busy = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(busy.leave(t0, gone, false, false), Leave::Stay);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(busy.leave(later, gone, false, false), Leave::Stay);
        assert_eq!(
            busy.leave(later, gone, false, true),
            Leave::Close(Ended::ListenerRemoved),
            "its last command answered"
        );
        let mut stuck = Lifecycle::new(t0, Duration::from_secs(5));
        assert_eq!(stuck.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert_eq!(
            stuck.leave(t0 + Duration::from_secs(5), SHUTDOWN, false, false),
            Leave::Close(Ended::NoLogout)
        );
    }

    #[test]
    fn leaving_without_grace_closes_at_once() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::ZERO);
        assert_eq!(
            life.leave(t0, SHUTDOWN, true, false),
            Leave::Close(Ended::Shutdown)
        );
    }

    #[test]
    fn a_grace_longer_than_a_logout_can_say_is_capped() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(t0, Duration::from_secs(100_000));
        assert_eq!(life.leave(t0, SHUTDOWN, true, false), Leave::Ask(u16::MAX));
    }
}
