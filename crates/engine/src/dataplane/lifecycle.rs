//! A session's life beside its protocol, without I/O: when it next needs the clock for
//! itself, and what leaving decides (the daemon's shutdown or a removed portal: ask the host
//! to leave, then close). A session that does nothing needs no clock here: housekeeping
//! follows work, and leaving follows a nudge (`shared/nudge.rs`). The driver asks
//! [`Lifecycle::poll_timeout`] when to wake; every decision here is unit-tested with a clock
//! the test moves.

use std::time::{Duration, Instant};

use seam::Liveness;

use super::closed::Ended;

/// How long after work a session reports its counts to the metrics and looks whether its
/// receive buffer can shrink; how often a leaving session is checked until it ends.
pub const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// What leaving (the daemon shutting down, the session's portal removed) asks of a session
/// when it looks.
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
    /// When housekeeping is due; None while nothing was done since the last.
    housekeeping: Option<Instant>,
    grace: Duration,
    /// Set once the session began to leave: it ends then at the latest.
    leave_deadline: Option<Instant>,
    /// When it last worked: housekeeping comes again a period after it, so a session is idle
    /// ([`Lifecycle::idle`]) only once a whole period passed without work.
    last_work: Option<Instant>,
}

impl Lifecycle {
    pub fn new(grace: Duration) -> Lifecycle {
        Lifecycle {
            housekeeping: None,
            grace,
            leave_deadline: None,
            last_work: None,
        }
    }

    /// When the session next needs the clock for itself (None: not until it works or is
    /// told something).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.housekeeping, self.leave_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The session did work at `now` (commands, completions): housekeeping follows within a
    /// period, unless it is due already.
    pub fn worked(&mut self, now: Instant) {
        self.last_work = Some(now);
        self.housekeeping.get_or_insert(now + HOUSEKEEPING);
    }

    pub fn housekeeping_armed(&self) -> bool {
        self.housekeeping.is_some()
    }

    /// Whether housekeeping is due at `now`; if so it is taken. The next is due a period
    /// after the last work, if that is still ahead (a busy session keeps one a period), else
    /// it comes with the next work.
    pub fn housekeeping_due(&mut self, now: Instant) -> bool {
        if self.housekeeping.is_some_and(|due| now >= due) {
            self.housekeeping = self
                .last_work
                .map(|at| at + HOUSEKEEPING)
                .filter(|&next| next > now);
            return true;
        }
        false
    }

    /// Idle: a whole housekeeping period passed since its last work (its counts reported),
    /// and it is not leaving. Only then may a connection park (`driver.rs`).
    pub fn idle(&self) -> bool {
        self.housekeeping.is_none() && self.leave_deadline.is_none()
    }

    /// Whether the session began to leave.
    pub fn leaving(&self) -> bool {
        self.leave_deadline.is_some()
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
                // Checked each period from now until it ends.
                self.worked(now);
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
    fn housekeeping_follows_work_once_and_an_idle_session_needs_no_clock() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5));
        assert_eq!(life.poll_timeout(), None, "nothing done, nothing due");
        life.worked(t0);
        life.worked(t0 + Duration::from_millis(500));
        assert_eq!(
            life.poll_timeout(),
            Some(t0 + HOUSEKEEPING),
            "more work does not put it off"
        );
        assert!(!life.housekeeping_due(t0 + Duration::from_millis(999)));
        assert!(life.housekeeping_due(t0 + Duration::from_secs(4)));
        assert!(!life.housekeeping_due(t0 + Duration::from_secs(4)));
        assert_eq!(life.poll_timeout(), None);
        assert!(life.idle());
    }

    #[test]
    fn a_session_is_idle_only_a_whole_period_after_its_last_work() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5));
        life.worked(t0);
        assert!(!life.idle(), "housekeeping is due");
        let last = t0 + Duration::from_millis(900);
        life.worked(last);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle(), "it worked within the period");
        assert_eq!(life.poll_timeout(), Some(last + HOUSEKEEPING));
        assert!(!life.housekeeping_due(last + Duration::from_millis(999)));
        assert!(life.housekeeping_due(last + HOUSEKEEPING));
        assert!(life.idle());
        assert_eq!(life.poll_timeout(), None, "an idle session needs no clock");
        life.worked(last + HOUSEKEEPING * 2);
        assert!(!life.idle(), "work wakes it");
    }

    #[test]
    fn a_leaving_session_is_never_idle() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5));
        assert_eq!(life.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle());
    }

    #[test]
    fn a_leaving_session_is_checked_each_period_and_at_its_deadline() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5));
        assert!(!life.leaving());
        assert_eq!(life.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert!(life.leaving());
        assert_eq!(life.poll_timeout(), Some(t0 + HOUSEKEEPING));
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert_eq!(life.poll_timeout(), Some(t0 + Duration::from_secs(5)));
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
        let mut life = Lifecycle::new(Duration::from_secs(5));
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
        let mut quiet = Lifecycle::new(Duration::from_secs(5));
        assert_eq!(
            quiet.leave(t0, gone, false, true),
            Leave::Close(Ended::ListenerRemoved)
        );
        let mut busy = Lifecycle::new(Duration::from_secs(5));
        assert_eq!(busy.leave(t0, gone, false, false), Leave::Stay);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(busy.leave(later, gone, false, false), Leave::Stay);
        assert_eq!(
            busy.leave(later, gone, false, true),
            Leave::Close(Ended::ListenerRemoved),
            "its last command answered"
        );
        let mut stuck = Lifecycle::new(Duration::from_secs(5));
        assert_eq!(stuck.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert_eq!(
            stuck.leave(t0 + Duration::from_secs(5), SHUTDOWN, false, false),
            Leave::Close(Ended::NoLogout)
        );
    }

    #[test]
    fn leaving_without_grace_closes_at_once() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::ZERO);
        assert_eq!(
            life.leave(t0, SHUTDOWN, true, false),
            Leave::Close(Ended::Shutdown)
        );
    }

    #[test]
    fn a_grace_longer_than_a_logout_can_say_is_capped() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(100_000));
        assert_eq!(life.leave(t0, SHUTDOWN, true, false), Leave::Ask(u16::MAX));
    }
}
