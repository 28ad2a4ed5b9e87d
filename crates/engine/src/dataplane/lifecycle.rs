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
    /// The housekeeping due only looks again at what the last could not finish (a receive
    /// buffer to give back once a period passes with nothing received): it has no work to
    /// report, so the session may be idle meanwhile ([`Lifecycle::look_again`]).
    looking_again: bool,
    grace: Duration,
    /// Set once the session began to leave: it ends then at the latest.
    leave_deadline: Option<Instant>,
    /// When it last worked: housekeeping comes again a period after it, so a session is idle
    /// ([`Lifecycle::idle`]) only once a whole period passed without work.
    last_work: Option<Instant>,
    /// Its housekeeping period, and how long without work makes it idle: a period, or longer
    /// for a connection whose host wakes it soon after it parks ([`Pace::after_park`]).
    pace: Pace,
    /// When it becomes idle, once housekeeping found it without work but `park_after` is
    /// longer than a period.
    idle_at: Option<Instant>,
}

/// The precision of the instants a session asks the clock for ([`Lifecycle::poll_timeout`]):
/// each is rounded up to the next multiple of this from one instant the process shares, so
/// connections whose housekeeping falls in the same slot are woken together, by one wake of
/// their worker, as the kernel rounds its own timers that need no precision (`round_jiffies`).
/// Without it an idle connection whose host wakes it every few seconds (an NVMe admin queue
/// under Linux's Keep Alive) wakes its worker twice more per Keep Alive, for its housekeeping
/// alone (docs/PERFORMANCE.md, *Cost as the array grows*).
pub const SLACK: Duration = Duration::from_millis(250);

/// `at` rounded up to [`SLACK`]: the same instant for every `at` in one slot.
pub fn coarse(at: Instant) -> Instant {
    const SLACK_NS: u64 = SLACK.as_millis() as u64 * 1_000_000;
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    // A u64 of nanoseconds lasts 584 years past the epoch; beyond, `at` as it is.
    u64::try_from(at.saturating_duration_since(epoch).as_nanos())
        .ok()
        .and_then(|since| since.div_ceil(SLACK_NS).checked_mul(SLACK_NS))
        .and_then(|ns| epoch.checked_add(Duration::from_nanos(ns)))
        .unwrap_or(at)
}

/// A park must last this long to pay for its rebuild (tens of µs of CPU): the wakes of
/// housekeeping it saves and the memory it gives back meanwhile. At 1,000 controllers under
/// Linux's Keep Alive pace, the build that parks each admin queue for 2 s of every 2.5 used
/// 0.63-0.81 of the daemon CPU of the build before, which kept them awake
/// (docs/PERFORMANCE.md, *Cost as the array grows*).
pub const PARK_WORTH: Duration = Duration::from_secs(1);
/// The longest a connection waits without work before it parks.
pub const PARK_AFTER_MAX: Duration = Duration::from_secs(16);

/// How soon a connection is looked after and may park.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Housekeeping comes this long after work: [`HOUSEKEEPING`], or less for a connection
    /// whose commands are its controller's, not I/O (an NVMe admin queue's: nothing to
    /// report, no latency to keep), so it parks sooner.
    pub period: Duration,
    /// How long without work makes it idle: at least a period.
    pub park_after: Duration,
}

impl Pace {
    /// Housekeeping every `period`; idle a period after work.
    pub const fn every(period: Duration) -> Pace {
        Pace {
            period,
            park_after: period,
        }
    }

    /// The pace after a park that lasted `parked_for`. Its host woke it `park_after +
    /// parked_for` after its last work; if it comes at that pace, parking a period after
    /// work leaves it parked that less a period. A connection whose host gives it
    /// [`PARK_WORTH`] that way parks a period after work; one it does not (an NVMe admin queue
    /// whose host sends Keep Alives less than that and a period apart) waits twice as long each
    /// time, up to [`PARK_AFTER_MAX`], which such a host's rhythm never leaves it.
    pub fn after_park(self, parked_for: Duration) -> Pace {
        let park_after = if (self.park_after + parked_for).saturating_sub(self.period) >= PARK_WORTH
        {
            self.period
        } else {
            self.park_after.saturating_mul(2).min(PARK_AFTER_MAX)
        };
        Pace { park_after, ..self }
    }
}

impl Lifecycle {
    /// `pace`: its housekeeping period, and how long without work makes it idle (at least a
    /// period).
    pub fn new(grace: Duration, pace: Pace) -> Lifecycle {
        Lifecycle {
            housekeeping: None,
            looking_again: false,
            grace,
            leave_deadline: None,
            last_work: None,
            pace: Pace {
                park_after: pace.park_after.max(pace.period),
                ..pace
            },
            idle_at: None,
        }
    }

    /// When the session next needs the clock for itself (None: not until it works or is
    /// told something), rounded up to [`SLACK`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.housekeeping, self.leave_deadline, self.idle_at]
            .into_iter()
            .flatten()
            .min()
            .map(coarse)
    }

    /// The session did work at `now` (commands, completions): housekeeping follows within a
    /// period, unless it is due already.
    pub fn worked(&mut self, now: Instant) {
        self.last_work = Some(now);
        self.idle_at = None;
        self.looking_again = false;
        self.housekeeping.get_or_insert(now + self.pace.period);
    }

    /// Housekeeping at `now` left something to look at again a period later; that is not
    /// work: the session's last work, and when it becomes idle, stay.
    pub fn look_again(&mut self, now: Instant) {
        if self.housekeeping.is_none() {
            self.housekeeping = Some(now + self.pace.period);
            self.looking_again = true;
        }
    }

    /// The session parks: a look again is moot (parking gives back what it would look at)
    /// and comes off its clock.
    pub fn parks(&mut self) {
        if std::mem::take(&mut self.looking_again) {
            self.housekeeping = None;
        }
    }

    /// Whether housekeeping is due at `now`; if so it is taken. The next is due a period
    /// after the last work, if that is still ahead (a busy session keeps one a period), else
    /// it comes with the next work.
    pub fn housekeeping_due(&mut self, now: Instant) -> bool {
        if self.housekeeping.is_some_and(|due| now >= due) {
            self.looking_again = false;
            self.housekeeping = self
                .last_work
                .map(|at| at + self.pace.period)
                .filter(|&next| next > now);
            if self.housekeeping.is_none() {
                self.idle_at = self
                    .last_work
                    .map(|at| at + self.pace.park_after)
                    .filter(|&at| at > now);
            }
            return true;
        }
        false
    }

    /// Whether housekeeping with work to report is pending (a cheap test before
    /// [`Lifecycle::idle`]).
    pub fn housekeeping_armed(&self) -> bool {
        self.housekeeping.is_some() && !self.looking_again
    }

    /// Idle at `now`: `park_after` passed since its last work (its counts reported), and it
    /// is not leaving. Only then may a connection park (`driver.rs`).
    pub fn idle(&mut self, now: Instant) -> bool {
        if self.housekeeping_armed() || self.leave_deadline.is_some() {
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
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert_eq!(life.poll_timeout(), None, "nothing done, nothing due");
        life.worked(t0);
        life.worked(t0 + Duration::from_millis(500));
        assert_eq!(
            life.poll_timeout(),
            Some(coarse(t0 + HOUSEKEEPING)),
            "more work does not put it off"
        );
        assert!(!life.housekeeping_due(t0 + Duration::from_millis(999)));
        assert!(life.housekeeping_due(t0 + Duration::from_secs(4)));
        assert!(!life.housekeeping_due(t0 + Duration::from_secs(4)));
        assert_eq!(life.poll_timeout(), None);
        assert!(life.idle(t0 + Duration::from_secs(4)));
    }

    #[test]
    fn instants_are_rounded_up_to_one_slot_for_all() {
        let t0 = Instant::now();
        for ms in [0, 1, 99, 250, 251, 999, 1_000, 3_600_000] {
            let at = t0 + Duration::from_millis(ms);
            let c = coarse(at);
            assert!(c >= at && c < at + SLACK, "{ms} ms: within a slot after");
            assert_eq!(coarse(c), c, "a rounded instant stays");
            let later = (c - at).min(Duration::from_millis(1)) / 2;
            assert_eq!(coarse(at + later), c, "{ms} ms: the same slot");
        }
        assert_ne!(coarse(t0), coarse(coarse(t0) + Duration::from_nanos(1)));
    }

    #[test]
    fn a_session_is_idle_only_a_whole_period_after_its_last_work() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        life.worked(t0);
        assert!(!life.idle(t0), "housekeeping is due");
        let last = t0 + Duration::from_millis(900);
        life.worked(last);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle(t0 + HOUSEKEEPING), "it worked within the period");
        assert_eq!(life.poll_timeout(), Some(coarse(last + HOUSEKEEPING)));
        assert!(!life.housekeeping_due(last + Duration::from_millis(999)));
        assert!(life.housekeeping_due(last + HOUSEKEEPING));
        assert!(life.idle(last + HOUSEKEEPING));
        assert_eq!(life.poll_timeout(), None, "an idle session needs no clock");
        life.worked(last + HOUSEKEEPING * 2);
        assert!(!life.idle(last + HOUSEKEEPING * 2), "work wakes it");
    }

    #[test]
    fn looking_again_is_not_work_and_parking_drops_it() {
        let t0 = Instant::now();
        let t1 = t0 + HOUSEKEEPING;
        let looked = || {
            let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
            life.worked(t0);
            assert!(life.housekeeping_due(t1));
            life.look_again(t1);
            life
        };
        let mut life = looked();
        assert!(!life.housekeeping_armed());
        assert_eq!(life.poll_timeout(), Some(coarse(t1 + HOUSEKEEPING)));
        assert!(
            life.idle(t1),
            "a period after its last work, idle all the same"
        );
        life.parks();
        assert_eq!(life.poll_timeout(), None, "parked: nothing left to look at");
        // Not parked, the look comes; work meanwhile makes it housekeeping to report.
        let mut life = looked();
        assert!(life.housekeeping_due(t1 + HOUSEKEEPING));
        assert_eq!(life.poll_timeout(), None);
        let mut life = looked();
        let t2 = t1 + Duration::from_millis(500);
        life.worked(t2);
        assert!(life.housekeeping_armed() && !life.idle(t2));
        life.parks();
        assert_eq!(
            life.poll_timeout(),
            Some(coarse(t1 + HOUSEKEEPING)),
            "still due"
        );
    }

    #[test]
    fn a_longer_wait_before_parking_is_kept_by_the_clock() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(
            Duration::from_secs(5),
            Pace {
                period: HOUSEKEEPING,
                park_after: Duration::from_secs(4),
            },
        );
        life.worked(t0);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        let idle_at = t0 + Duration::from_secs(4);
        assert_eq!(life.poll_timeout(), Some(coarse(idle_at)), "woken to park");
        assert!(!life.idle(t0 + Duration::from_secs(3)));
        assert!(life.idle(idle_at));
        assert_eq!(life.poll_timeout(), None, "once idle, no clock");
        assert!(life.idle(idle_at), "and idle it stays until it works");
        life.worked(idle_at + HOUSEKEEPING);
        assert!(!life.idle(idle_at + HOUSEKEEPING));
    }

    #[test]
    fn a_host_that_wakes_its_parked_connection_soon_makes_it_wait_longer_to_park() {
        for period in [HOUSEKEEPING, SLACK] {
            let pace = |park_after| Pace { period, park_after };
            let first = Pace::every(period);
            let soon = PARK_WORTH - Duration::from_millis(1);
            assert_eq!(first.after_park(soon), pace(2 * period));
            assert_eq!(first.after_park(PARK_WORTH), first);
            // Woken early once (a stray wake), then at a pace that pays: back to a period.
            let pays = (period + PARK_WORTH).saturating_sub(2 * period);
            assert_eq!(pace(2 * period).after_park(pays), first);
            // A host that came back soon after a long wait still left it that long.
            assert_eq!(pace(PARK_AFTER_MAX).after_park(Duration::ZERO), first);
            // The wait doubles while parks do not pay, and stops at the longest.
            let mut p = first;
            while p.park_after.saturating_sub(period) < PARK_WORTH {
                let next = p.after_park(Duration::ZERO);
                assert!(next.park_after == (2 * p.park_after).min(PARK_AFTER_MAX));
                assert!(next.park_after > p.park_after && next.period == period);
                p = next;
            }
            assert!(p.park_after <= PARK_AFTER_MAX);
        }
    }

    #[test]
    fn a_shorter_period_makes_a_connection_idle_sooner() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(SLACK));
        life.worked(t0);
        assert_eq!(life.poll_timeout(), Some(coarse(t0 + SLACK)));
        assert!(!life.idle(t0 + SLACK), "housekeeping first");
        assert!(life.housekeeping_due(t0 + SLACK));
        assert!(life.idle(t0 + SLACK));
    }

    #[test]
    fn a_leaving_session_is_never_idle() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert_eq!(life.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert!(!life.idle(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn a_leaving_session_is_checked_each_period_and_at_its_deadline() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert!(!life.leaving());
        assert_eq!(life.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert!(life.leaving());
        assert_eq!(life.poll_timeout(), Some(coarse(t0 + HOUSEKEEPING)));
        assert!(life.housekeeping_due(t0 + HOUSEKEEPING));
        assert_eq!(
            life.poll_timeout(),
            Some(coarse(t0 + Duration::from_secs(5)))
        );
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
        let mut life = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
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
        let mut quiet = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert_eq!(
            quiet.leave(t0, gone, false, true),
            Leave::Close(Ended::ListenerRemoved)
        );
        let mut busy = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert_eq!(busy.leave(t0, gone, false, false), Leave::Stay);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(busy.leave(later, gone, false, false), Leave::Stay);
        assert_eq!(
            busy.leave(later, gone, false, true),
            Leave::Close(Ended::ListenerRemoved),
            "its last command answered"
        );
        let mut stuck = Lifecycle::new(Duration::from_secs(5), Pace::every(HOUSEKEEPING));
        assert_eq!(stuck.leave(t0, SHUTDOWN, false, false), Leave::Stay);
        assert_eq!(
            stuck.leave(t0 + Duration::from_secs(5), SHUTDOWN, false, false),
            Leave::Close(Ended::NoLogout)
        );
    }

    #[test]
    fn leaving_without_grace_closes_at_once() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::ZERO, Pace::every(HOUSEKEEPING));
        assert_eq!(
            life.leave(t0, SHUTDOWN, true, false),
            Leave::Close(Ended::Shutdown)
        );
    }

    #[test]
    fn a_grace_longer_than_a_logout_can_say_is_capped() {
        let t0 = Instant::now();
        let mut life = Lifecycle::new(Duration::from_secs(100_000), Pace::every(HOUSEKEEPING));
        assert_eq!(life.leave(t0, SHUTDOWN, true, false), Leave::Ask(u16::MAX));
    }
}
