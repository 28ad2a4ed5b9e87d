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
    /// How long without work makes it idle: a housekeeping period, or longer for a connection
    /// whose host wakes it soon after it parks ([`next_park_after`]).
    park_after: Duration,
    /// When it becomes idle, once housekeeping found it without work but `park_after` is
    /// longer than a period.
    idle_at: Option<Instant>,
}

/// A park that lasts this long paid for its rebuild (tens of µs of CPU).
pub const PARK_WORTH: Duration = Duration::from_secs(4);
/// The longest a connection waits without work before it parks.
pub const PARK_AFTER_MAX: Duration = Duration::from_secs(16);

/// How long a connection must be idle before it parks next, from how long its last park
/// lasted: a connection its host woke within [`PARK_WORTH`] (an NVMe admin queue under Linux's
/// Keep Alive every 2.5 s) waits twice as long each time, up to [`PARK_AFTER_MAX`], which such
/// a host's rhythm never leaves it; one that stayed parked longer parks after a period again.
pub fn next_park_after(was: Duration, parked_for: Duration) -> Duration {
    if parked_for >= PARK_WORTH {
        HOUSEKEEPING
    } else {
        was.saturating_mul(2).min(PARK_AFTER_MAX)
    }
}

impl Lifecycle {
    /// `park_after`: how long without work makes it idle (at least a housekeeping period).
    pub fn new(grace: Duration, park_after: Duration) -> Lifecycle {
        Lifecycle {
            housekeeping: None,
            grace,
            leave_deadline: None,
            last_work: None,
            park_after: park_after.max(HOUSEKEEPING),
            idle_at: None,
        }
    }

    /// When the session next needs the clock for itself (None: not until it works or is
    /// told something).
    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.housekeeping, self.leave_deadline, self.idle_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// The session did work at `now` (commands, completions): housekeeping follows within a
    /// period, unless it is due already.
    pub fn worked(&mut self, now: Instant) {
        self.last_work = Some(now);
        self.idle_at = None;
        self.housekeeping.get_or_insert(now + HOUSEKEEPING);
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
            if self.housekeeping.is_none() {
                self.idle_at = self
                    .last_work
                    .map(|at| at + self.park_after)
                    .filter(|&at| at > now);
            }
            return true;
        }
        false
    }

    /// Whether housekeeping is pending (a cheap test before [`Lifecycle::idle`]).
    pub fn housekeeping_armed(&self) -> bool {
        self.housekeeping.is_some()
    }

    /// Idle at `now`: `park_after` passed since its last work (its counts reported), and it
    /// is not leaving. Only then may a connection park (`driver.rs`).
    pub fn idle(&mut self, now: Instant) -> bool {
        if self.housekeeping.is_some() || self.leave_deadline.is_some() {
            return false;
        }
        match self.idle_at {
            Some(at) if now < at => false,
            _ => {
                self.idle_at = None;
                true
            }
        }
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
        let mut life = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
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
        assert!(life.idle(t0 + Duration::from_secs(4)));
    }

    #[test]
    fn a_session_is_idle_only_a_whole_period_after_its_last_work() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
        life.worked(t0);
        assert!(!life.idle(t0), "housekeeping is due");
        let last = t0 + Duration::from_millis(900);
        life.worked(last);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle(t0 + HOUSEKEEPING), "it worked within the period");
        assert_eq!(life.poll_timeout(), Some(last + HOUSEKEEPING));
        assert!(!life.housekeeping_due(last + Duration::from_millis(999)));
        assert!(life.housekeeping_due(last + HOUSEKEEPING));
        assert!(life.idle(last + HOUSEKEEPING));
        assert_eq!(life.poll_timeout(), None, "an idle session needs no clock");
        life.worked(last + HOUSEKEEPING * 2);
        assert!(!life.idle(last + HOUSEKEEPING * 2), "work wakes it");
    }

    #[test]
    fn a_longer_wait_before_parking_is_kept_by_the_clock() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), Duration::from_secs(4));
        life.worked(t0);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        let idle_at = t0 + Duration::from_secs(4);
        assert_eq!(life.poll_timeout(), Some(idle_at), "woken to park");
        assert!(!life.idle(t0 + Duration::from_secs(3)));
        assert!(life.idle(idle_at));
        assert_eq!(life.poll_timeout(), None, "once idle, no clock");
        assert!(life.idle(idle_at), "and idle it stays until it works");
        life.worked(idle_at + HOUSEKEEPING);
        assert!(!life.idle(idle_at + HOUSEKEEPING));
    }

    #[test]
    fn a_host_that_wakes_its_parked_connection_soon_makes_it_wait_longer_to_park() {
        let short = Duration::from_millis(500);
        assert_eq!(next_park_after(HOUSEKEEPING, short), 2 * HOUSEKEEPING);
        assert_eq!(next_park_after(2 * HOUSEKEEPING, short), 4 * HOUSEKEEPING);
        assert_eq!(next_park_after(PARK_AFTER_MAX, short), PARK_AFTER_MAX);
        assert_eq!(next_park_after(PARK_AFTER_MAX, PARK_WORTH), HOUSEKEEPING);
    }

    #[test]
    fn a_leaving_session_is_never_idle() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
        assert_eq!(life.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn a_leaving_session_is_checked_each_period_and_at_its_deadline() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
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
        let mut life = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
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
        let mut quiet = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
        assert_eq!(
            quiet.leave(t0, gone, false, true),
            Leave::Close(Ended::ListenerRemoved)
        );
        let mut busy = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
        assert_eq!(busy.leave(t0, gone, false, false), Leave::Stay);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(busy.leave(later, gone, false, false), Leave::Stay);
        assert_eq!(
            busy.leave(later, gone, false, true),
            Leave::Close(Ended::ListenerRemoved),
            "its last command answered"
        );
        let mut stuck = Lifecycle::new(Duration::from_secs(5), HOUSEKEEPING);
        assert_eq!(stuck.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert_eq!(
            stuck.leave(t0 + Duration::from_secs(5), SHUTDOWN, false, false),
            Leave::Close(Ended::NoLogout)
        );
    }

    #[test]
    fn leaving_without_grace_closes_at_once() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::ZERO, HOUSEKEEPING);
        assert_eq!(
            life.leave(t0, SHUTDOWN, true, false),
            Leave::Close(Ended::Shutdown)
        );
    }

    #[test]
    fn a_grace_longer_than_a_logout_can_say_is_capped() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(100_000), HOUSEKEEPING);
        assert_eq!(life.leave(t0, SHUTDOWN, true, false), Leave::Ask(u16::MAX));
    }
}
