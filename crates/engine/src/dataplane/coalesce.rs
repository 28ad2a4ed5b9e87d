//! Receive coalescing: when an initiator keeps many small commands in flight, wake the worker
//! once per several commands instead of once per command.
//!
//! On a busy link each command arriving alone costs a full turn (wake-up, read, write of the
//! answer); on a 2-vCPU VM the cross-CPU wake-up dominates everything else we do for a 4 KiB
//! command. NICs solve this with interrupt moderation; we do the same with the socket's receive
//! low-water mark (`SO_RCVLOWAT`, set by the connection) plus a short timer as backstop, and only
//! when the initiator's own queue says more commands are on their way: a command's ExpStatSN
//! tells how many of our answers the initiator had not yet seen when it sent it
//! ([`seam::Activity`]). An initiator waiting for each answer (queue depth 1) shows
//! none and is never delayed, nor is one whose commands already arrive in bursts (each wake-up
//! brings a batch by itself). A batch the timer ends with commands waiting but not half of it
//! read switches coalescing off for a while (doubling each time it happens again), so a
//! pipeline that stops costs at most one timer wait. A timer that finds nothing new delayed no
//! command: the batch only halves and the next command wakes the worker at once.
//!
//! This module only decides; it does no I/O, so every rule is unit tested.

use std::time::{Duration, Instant};

use seam::Activity;

/// Coalesce only when the initiator had at least this many answers unseen.
pub const BACKLOG_MIN: u32 = 8;
/// Never wait for more than this many commands.
const BATCH_MAX: u32 = 24;
/// A wake-up that brings this many commands (or twice the batch waited for) needs no
/// coalescing: the commands arrive in bursts.
const BURST_MIN: u32 = BATCH_MAX / 2;
/// Commands larger than this (header plus immediate data, on average) already amortize a turn.
const SMALL_COMMAND_MAX: u64 = 8 * 1024 + 512;
/// Ceiling of the low-water mark, in bytes (24 commands of 4 KiB); the connection's receive
/// buffer is far larger.
pub const LOW_WATER_MAX: usize = 96 * 1024;
/// Shortest backstop wait.
pub const WAIT_MIN: Duration = Duration::from_micros(20);
/// Turns coalescing stays off after a batch did not fill in time, first and at most.
const BACKOFF_MIN: u32 = 16;
const BACKOFF_MAX: u32 = 4096;
/// Successful turns after which the backoff length returns to its minimum.
const FORGIVE_AFTER: u32 = 256;

/// How the next read should wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Wake on the first byte (the socket's default).
    Immediate,
    /// Wake once `low_water` bytes are queued, or at `deadline` with whatever arrived.
    Batch { low_water: usize, deadline: Instant },
}

/// Why the coalescer stopped coalescing; counted in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The plan is unchanged in kind.
    Steady,
    /// A batch's deadline passed with commands waiting but not half the batch read.
    Missed,
}

#[derive(Debug)]
pub struct Coalescer {
    /// Longest backstop wait; zero disables coalescing.
    max_wait: Duration,
    /// Commands per wake-up aimed at; 1 = not coalescing.
    batch: u32,
    /// Average command PDU size, bytes (exponentially weighted, 1/8 per turn).
    avg_command_bytes: u64,
    /// Average time between two commands, nanoseconds (exponentially weighted, 1/8 per turn).
    avg_gap_ns: u64,
    last_commands_at: Option<Instant>,
    /// Turns left before coalescing may start again.
    backoff: u32,
    /// The next backoff length.
    penalty: u32,
    successes: u32,
    plan: Plan,
}

impl Coalescer {
    pub fn new(max_wait: Duration) -> Coalescer {
        Coalescer {
            max_wait,
            batch: 1,
            avg_command_bytes: 0,
            avg_gap_ns: 0,
            last_commands_at: None,
            backoff: 0,
            penalty: BACKOFF_MIN,
            successes: 0,
            plan: Plan::Immediate,
        }
    }

    pub fn plan(&self) -> Plan {
        self.plan
    }

    /// Decides the next wait from one turn's activity. `timed_out`: this turn began because the
    /// previous plan's deadline passed, not because the low-water mark was reached.
    pub fn after_turn(&mut self, a: &Activity, timed_out: bool, now: Instant) -> Outcome {
        if self.max_wait.is_zero() {
            return Outcome::Steady;
        }
        self.learn(a, now);
        let shrink_to = match self.after_batch_wait(a, timed_out) {
            Ok(shrink_to) => shrink_to,
            Err(outcome) => return outcome,
        };
        if a.commands == 0 && a.other_pdus == 0 {
            // Nothing new arrived (a completion, a tick): the current plan stands.
            return Outcome::Steady;
        }
        if self.backoff > 0 {
            self.backoff -= 1;
            self.stop();
            return Outcome::Steady;
        }
        if a.commands >= (2 * self.batch).max(BURST_MIN) {
            // The wake-up brought a batch by itself (a host that sends its queue in bursts,
            // as the Linux NVMe/TCP host and our bench client do): waiting for more would
            // only add a socket option and a timer per turn.
            self.stop();
            return Outcome::Steady;
        }
        let pipelined = a.initiator_backlog >= BACKLOG_MIN && a.other_pdus == 0;
        if !pipelined || self.avg_command_bytes > SMALL_COMMAND_MAX {
            self.stop();
            return Outcome::Steady;
        }
        if self.batch > 1 {
            self.successes += 1;
            if self.successes >= FORGIVE_AFTER {
                self.penalty = BACKOFF_MIN;
            }
        }
        self.plan_batch(a, shrink_to, now);
        Outcome::Steady
    }

    /// After a turn the batch's deadline began: `Err` with the outcome when that ends the
    /// decision (nothing arrived: a smaller batch next; at most half a batch: back off),
    /// else the batch to shrink to when most of it came.
    fn after_batch_wait(&mut self, a: &Activity, timed_out: bool) -> Result<Option<u32>, Outcome> {
        if !timed_out || self.batch <= 1 {
            return Ok(None);
        }
        if a.commands == 0 && a.other_pdus == 0 {
            // Nothing arrived while the batch waited, so nothing was delayed: a client busy
            // with its answers (fio at 100% CPU pauses like this between bursts) or a pipeline
            // that stopped. The next command wakes the worker at once; its turn plans a
            // smaller batch. Backing off here would turn a deep queue's pauses into thousands
            // of uncoalesced turns (fio QD64 reads: up to 3x the turns per command).
            self.batch = (self.batch / 2).max(1);
            self.plan = Plan::Immediate;
            return Err(Outcome::Steady);
        }
        if a.commands >= self.batch {
            return Ok(None);
        }
        if a.commands.saturating_mul(2) <= self.batch {
            // At most half a batch in twice the time it should take to fill: the arrival
            // rate fell at least fourfold, or the pipeline stopped. Stop waiting for it.
            self.backoff = self.penalty;
            self.penalty = (self.penalty * 2).min(BACKOFF_MAX);
            self.successes = 0;
            self.stop();
            return Err(Outcome::Missed);
        }
        // Most of the batch came: the arrival rate dipped, aim lower.
        Ok(Some(a.commands))
    }

    /// The next batch: grown by one (or shrunk to what came), small enough to fill twice over
    /// within the longest wait, and its low-water mark and deadline.
    fn plan_batch(&mut self, a: &Activity, shrink_to: Option<u32>, now: Instant) {
        // Small enough to fill twice over within the longest wait.
        let fits_in_wait = match self.avg_gap_ns {
            0 => 2,
            gap => {
                (self.max_wait.as_nanos() / (2 * u128::from(gap))).min(u128::from(BATCH_MAX)) as u32
            }
        };
        let fits_in_low_water = (LOW_WATER_MAX as u64 / self.avg_command_bytes.max(1)) as u32;
        let grown = shrink_to.unwrap_or(self.batch + 1);
        self.batch = grown
            // Hold back at most half of what the initiator has in flight, so it always has
            // answers to work on while a batch fills.
            .min(a.initiator_backlog / 2)
            .min(fits_in_wait)
            .min(fits_in_low_water)
            .clamp(2, BATCH_MAX);
        let low_water = (u64::from(self.batch) * self.avg_command_bytes.max(1))
            .min(LOW_WATER_MAX as u64) as usize;
        let expected =
            Duration::from_nanos(self.avg_gap_ns.saturating_mul(2 * u64::from(self.batch)));
        let wait = expected.clamp(WAIT_MIN, self.max_wait.max(WAIT_MIN));
        self.plan = Plan::Batch {
            low_water,
            deadline: now + wait,
        };
    }

    fn learn(&mut self, a: &Activity, now: Instant) {
        if a.commands == 0 {
            return;
        }
        let size = a.command_bytes / u64::from(a.commands);
        self.avg_command_bytes = ewma(self.avg_command_bytes, size);
        if let Some(before) = self.last_commands_at {
            let gap = now.saturating_duration_since(before).as_nanos() / u128::from(a.commands);
            self.avg_gap_ns = ewma(self.avg_gap_ns, u64::try_from(gap).unwrap_or(u64::MAX));
        }
        self.last_commands_at = Some(now);
    }

    fn stop(&mut self) {
        self.batch = 1;
        self.plan = Plan::Immediate;
    }
}

/// `avg + (sample - avg) / 8`, starting at the first sample.
fn ewma(avg: u64, sample: u64) -> u64 {
    if avg == 0 {
        sample
    } else {
        avg - avg / 8 + sample / 8
    }
}

/// An initiator whose commands arrive with at most this many of our answers unseen keeps a
/// shallow queue (QD1 to QD8), and its worker busy-polls for the next command
/// (crate::dataplane::busy_poll); from `BACKLOG_MIN` on, receive coalescing serves it instead.
/// A/B against polling at QD1–2 only (bench/results/lockstep-2026-11-28.txt): one session of
/// 4 KiB reads at QD4 ×2.1 IOPS (`ferrosan bench`, the same target CPU per I/O) and ×1.9
/// (qemu-img, +10–35 % CPU per I/O), QD8 ×1.9 and ×1.35 (+60 % CPU per I/O); two sessions at
/// QD8 on loopback, where the poll competes with the client for the same two cores, -8 %.
pub const LOCKSTEP_BACKLOG_MAX: u32 = BACKLOG_MIN - 1;
/// Nor may more than this many of its other commands still be in the target when one arrives:
/// with a deep queue of slow commands (QD16 of 1 MiB writes, QD64 on a disk) each new command
/// follows an answer the initiator has just seen, so the backlog alone reads as lockstep, and
/// polling there cost 2 µs per 4 KiB disk read and ~100 µs per 1 MiB write for no gain (A/B
/// of 2026-11-25, docs/PERFORMANCE-LOG.md).
pub const LOCKSTEP_IN_FLIGHT_MAX: u32 = 1;
/// Turns in a row of such commands before an initiator counts as waiting for each answer: a
/// deep queue shows a short backlog now and then (after a pause), which must not count (each
/// change costs two `epoll_ctl` calls).
pub const LOCKSTEP_AFTER_TURNS: u32 = 8;

/// Tells from the turns' activity whether the initiator waits for each answer before it sends
/// its next command (the case busy polling serves, and coalescing never does).
#[derive(Debug, Default)]
pub struct Lockstep {
    /// Turns in a row whose commands came with at most `LOCKSTEP_BACKLOG_MAX` answers unseen
    /// and at most `LOCKSTEP_IN_FLIGHT_MAX` other commands in the target.
    answered_turns: u32,
}

impl Lockstep {
    /// Learns from a turn; returns whether the initiator now counts as waiting for each answer.
    /// A turn without commands (a header whose data is still on its way) changes nothing.
    pub fn after_turn(&mut self, a: &Activity) -> bool {
        if a.commands > 0 {
            let lockstep = a.initiator_backlog <= LOCKSTEP_BACKLOG_MAX
                && a.in_flight <= LOCKSTEP_IN_FLIGHT_MAX;
            self.answered_turns = if lockstep {
                self.answered_turns.saturating_add(1)
            } else {
                0
            };
        }
        self.answered_turns >= LOCKSTEP_AFTER_TURNS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CMD_4K_WRITE: u64 = 48 + 4096;

    fn busy(commands: u32, bytes_each: u64, backlog: u32) -> Activity {
        Activity {
            commands,
            command_bytes: u64::from(commands) * bytes_each,
            other_pdus: 0,
            initiator_backlog: backlog,
            in_flight: 0,
        }
    }

    /// Feeds `turns` turns of `a`, `gap` apart, none timed out; returns the final time.
    fn run(c: &mut Coalescer, a: Activity, turns: u32, gap: Duration, mut now: Instant) -> Instant {
        for _ in 0..turns {
            now += gap;
            assert_eq!(c.after_turn(&a, false, now), Outcome::Steady);
        }
        now
    }

    fn batch_of(c: &Coalescer) -> Option<(usize, Instant)> {
        match c.plan() {
            Plan::Immediate => None,
            Plan::Batch {
                low_water,
                deadline,
            } => Some((low_water, deadline)),
        }
    }

    #[test]
    fn disabled_never_coalesces() {
        let mut c = Coalescer::new(Duration::ZERO);
        run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            100,
            Duration::from_micros(15),
            Instant::now(),
        );
        assert_eq!(c.plan(), Plan::Immediate);
    }

    #[test]
    fn an_initiator_waiting_for_each_answer_is_never_delayed() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        for backlog in [0, 1, BACKLOG_MIN - 1] {
            run(
                &mut c,
                busy(1, CMD_4K_WRITE, backlog),
                100,
                Duration::from_micros(40),
                Instant::now(),
            );
            assert_eq!(c.plan(), Plan::Immediate, "backlog {backlog}");
        }
    }

    #[test]
    fn a_deep_pipeline_of_small_commands_is_batched_up_to_half_its_depth() {
        let mut c = Coalescer::new(Duration::from_millis(1));
        let t0 = Instant::now();
        let now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 32),
            1,
            Duration::from_micros(15),
            t0,
        );
        let (low, _) = batch_of(&c).expect("engaged at once");
        assert_eq!(low, 2 * CMD_4K_WRITE as usize, "starts at two commands");
        // Grows one command per turn up to backlog / 2.
        let now = run(
            &mut c,
            busy(2, CMD_4K_WRITE, 32),
            20,
            Duration::from_micros(30),
            now,
        );
        let (low, deadline) = batch_of(&c).unwrap();
        assert_eq!(low, 16 * CMD_4K_WRITE as usize);
        // Twice the expected fill time: 16 commands 15 µs apart.
        assert_eq!(deadline - now, Duration::from_micros(480));
    }

    #[test]
    fn a_batch_fills_twice_over_within_the_longest_wait() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        let now = run(
            &mut c,
            busy(2, CMD_4K_WRITE, 64),
            30,
            Duration::from_micros(30),
            Instant::now(),
        );
        let (low, deadline) = batch_of(&c).unwrap();
        // 15 µs per command: 6 commands take 90 µs, twice that fits in 200 µs, 7 would not.
        assert_eq!(low, 6 * CMD_4K_WRITE as usize);
        assert_eq!(deadline - now, Duration::from_micros(180));
    }

    #[test]
    fn a_batch_that_mostly_filled_shrinks_to_what_came() {
        const CMD_1K_WRITE: u64 = 48 + 1024;
        let mut c = Coalescer::new(Duration::from_millis(1));
        let now = run(
            &mut c,
            busy(1, CMD_1K_WRITE, 64),
            12,
            Duration::from_micros(15),
            Instant::now(),
        );
        let (low, _) = batch_of(&c).unwrap();
        assert_eq!(low, 13 * CMD_1K_WRITE as usize);
        let out = c.after_turn(
            &busy(9, CMD_1K_WRITE, 64),
            true,
            now + Duration::from_micros(400),
        );
        assert_eq!(out, Outcome::Steady, "9 of 13 is not a stopped pipeline");
        let (low, _) = batch_of(&c).unwrap();
        assert_eq!(low, 9 * CMD_1K_WRITE as usize);
    }

    #[test]
    fn a_timer_turn_with_half_a_batch_is_a_miss() {
        // A slow initiator (60 µs between commands) keeps the batch at two; when its pipeline
        // stops, the one command that still arrives comes by the timer. Counting that as "most
        // of the batch" kept the connection waiting a full timer for every later lone command.
        let mut c = Coalescer::new(Duration::from_micros(200));
        let now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            10,
            Duration::from_micros(60),
            Instant::now(),
        );
        let (low, _) = batch_of(&c).unwrap();
        assert_eq!(low, 2 * CMD_4K_WRITE as usize);
        let out = c.after_turn(
            &busy(1, CMD_4K_WRITE, 64),
            true,
            now + Duration::from_micros(200),
        );
        assert_eq!(out, Outcome::Missed);
        assert_eq!(c.plan(), Plan::Immediate);
    }

    #[test]
    fn the_wait_follows_the_arrival_rate() {
        let mut c = Coalescer::new(Duration::from_millis(1));
        let now = run(
            &mut c,
            busy(4, 48, 64),
            40,
            Duration::from_micros(8),
            Instant::now(),
        );
        let (low, deadline) = batch_of(&c).unwrap();
        assert_eq!(low, 24 * 48, "batch capped at BATCH_MAX");
        // 2 µs per command, 24 commands, twice: 96 µs.
        let wait = deadline - now;
        assert!(
            wait > Duration::from_micros(80) && wait < Duration::from_micros(115),
            "{wait:?}"
        );
    }

    #[test]
    fn the_low_water_mark_is_capped() {
        let mut c = Coalescer::new(Duration::from_millis(2));
        let cmd = 8 * 1024 + 48;
        run(
            &mut c,
            busy(1, cmd, 128),
            40,
            Duration::from_micros(20),
            Instant::now(),
        );
        let (low, _) = batch_of(&c).unwrap();
        // As many whole commands as fit under the cap.
        assert_eq!(low, (LOW_WATER_MAX / cmd as usize) * cmd as usize);
        assert!(low <= LOW_WATER_MAX);
    }

    #[test]
    fn large_commands_or_other_pdus_are_left_alone() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        run(
            &mut c,
            busy(1, 48 + 32 * 1024, 64),
            50,
            Duration::from_micros(30),
            Instant::now(),
        );
        assert_eq!(c.plan(), Plan::Immediate, "32 KiB immediate data");
        let mut c = Coalescer::new(Duration::from_micros(200));
        let now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            5,
            Duration::from_micros(15),
            Instant::now(),
        );
        assert!(batch_of(&c).is_some());
        let mut a = busy(1, CMD_4K_WRITE, 64);
        a.other_pdus = 1; // a Data-Out, NOP-Out or task management request
        c.after_turn(&a, false, now + Duration::from_micros(15));
        assert_eq!(c.plan(), Plan::Immediate);
    }

    #[test]
    fn commands_that_arrive_in_bursts_are_not_held_back() {
        let mut c = Coalescer::new(Duration::from_millis(1));
        let gap = Duration::from_micros(100);
        // A host that sends its queue of 64 in bursts: each wake-up brings a batch.
        let now = run(
            &mut c,
            busy(BURST_MIN, CMD_4K_WRITE, 64),
            50,
            gap,
            Instant::now(),
        );
        assert_eq!(c.plan(), Plan::Immediate);
        // One command at a time from the same deep queue is coalesced...
        let now = run(&mut c, busy(1, CMD_4K_WRITE, 64), 10, gap / 20, now);
        let (low, _) = batch_of(&c).expect("coalescing one at a time");
        let batch = (low / CMD_4K_WRITE as usize) as u32;
        assert!(batch > 2, "{batch}");
        // ... until a wake-up brings twice the batch waited for: a burst again.
        run(&mut c, busy(2 * batch - 1, CMD_4K_WRITE, 64), 1, gap, now);
        assert!(
            batch_of(&c).is_some(),
            "under twice the batch keeps coalescing"
        );
        run(
            &mut c,
            busy(2 * batch + 2, CMD_4K_WRITE, 64),
            1,
            gap,
            now + gap,
        );
        assert_eq!(c.plan(), Plan::Immediate);
    }

    #[test]
    fn a_turn_with_nothing_new_keeps_the_plan() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        let now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            5,
            Duration::from_micros(15),
            Instant::now(),
        );
        let before = c.plan();
        c.after_turn(&Activity::default(), false, now + Duration::from_micros(3));
        assert_eq!(c.plan(), before);
    }

    #[test]
    fn a_batch_that_does_not_fill_stops_coalescing_with_growing_backoff() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        let mut now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            5,
            Duration::from_micros(15),
            Instant::now(),
        );
        let mut expected_backoff = BACKOFF_MIN;
        for _ in 0..10 {
            // The deadline passed with one command read: the initiator stopped sending, and
            // that command waited the whole timer.
            now += Duration::from_micros(200);
            assert_eq!(
                c.after_turn(&busy(1, CMD_4K_WRITE, 64), true, now),
                Outcome::Missed
            );
            assert_eq!(c.plan(), Plan::Immediate);
            // Off for exactly the backoff, however busy the initiator looks.
            for _ in 0..expected_backoff {
                now += Duration::from_micros(15);
                c.after_turn(&busy(1, CMD_4K_WRITE, 64), false, now);
                assert_eq!(c.plan(), Plan::Immediate);
            }
            now += Duration::from_micros(15);
            c.after_turn(&busy(1, CMD_4K_WRITE, 64), false, now);
            assert!(
                batch_of(&c).is_some(),
                "re-engages after {expected_backoff} turns"
            );
            expected_backoff = (expected_backoff * 2).min(BACKOFF_MAX);
        }
        // A long good run forgives.
        let now = run(
            &mut c,
            busy(8, CMD_4K_WRITE, 64),
            FORGIVE_AFTER,
            Duration::from_micros(120),
            now,
        );
        assert_eq!(
            c.after_turn(
                &busy(1, CMD_4K_WRITE, 64),
                true,
                now + Duration::from_micros(300)
            ),
            Outcome::Missed
        );
        let mut turns_off = 0;
        let mut now = now;
        while batch_of(&c).is_none() {
            now += Duration::from_micros(15);
            c.after_turn(&busy(1, CMD_4K_WRITE, 64), false, now);
            turns_off += 1;
        }
        assert_eq!(turns_off, BACKOFF_MIN + 1);
    }

    #[test]
    fn a_timer_that_finds_nothing_halves_the_batch_without_backing_off() {
        let mut c = Coalescer::new(Duration::from_micros(500));
        let now = run(
            &mut c,
            busy(8, 48, 64),
            40,
            Duration::from_micros(80),
            Instant::now(),
        );
        let (low, _) = batch_of(&c).unwrap();
        let batch = low / 48;
        assert!(batch >= 8, "{batch}");
        // The client paused (busy with its answers): the timer fires with nothing read.
        let now = now + Duration::from_micros(500);
        assert_eq!(
            c.after_turn(&Activity::default(), true, now),
            Outcome::Steady
        );
        assert_eq!(c.plan(), Plan::Immediate, "the next command wakes at once");
        // Its next commands plan a batch again, straight away, from half the size.
        let now = now + Duration::from_micros(80);
        c.after_turn(&busy(8, 48, 64), false, now);
        let (low, _) = batch_of(&c).expect("no backoff");
        assert_eq!(low / 48, batch / 2 + 1);
    }

    #[test]
    fn a_timer_turn_that_filled_the_batch_is_not_a_miss() {
        let mut c = Coalescer::new(Duration::from_micros(200));
        let now = run(
            &mut c,
            busy(1, CMD_4K_WRITE, 64),
            10,
            Duration::from_micros(15),
            Instant::now(),
        );
        let batch = match c.plan() {
            Plan::Batch { low_water, .. } => (low_water / CMD_4K_WRITE as usize) as u32,
            Plan::Immediate => panic!("not engaged"),
        };
        let out = c.after_turn(
            &busy(batch, CMD_4K_WRITE, 64),
            true,
            now + Duration::from_micros(150),
        );
        assert_eq!(out, Outcome::Steady);
        assert!(batch_of(&c).is_some());
    }

    #[test]
    fn ewma_starts_at_the_first_sample_and_moves_an_eighth() {
        assert_eq!(ewma(0, 800), 800);
        assert_eq!(ewma(800, 0), 700);
        assert_eq!(ewma(800, 1600), 900);
    }

    #[test]
    fn lockstep_after_eight_answered_turns_and_not_after_one_deep_one() {
        let mut l = Lockstep::default();
        for turn in 1..LOCKSTEP_AFTER_TURNS {
            assert!(!l.after_turn(&busy(1, CMD_4K_WRITE, 0)), "turn {turn}");
        }
        assert!(l.after_turn(&busy(1, CMD_4K_WRITE, LOCKSTEP_BACKLOG_MAX)));
        // Turns without commands change nothing either way.
        let idle = busy(0, 0, 0);
        for _ in 0..100 {
            assert!(l.after_turn(&idle));
        }
        // One turn from a deeper queue ends it, and it takes the full count to come back.
        assert!(!l.after_turn(&busy(4, CMD_4K_WRITE, LOCKSTEP_BACKLOG_MAX + 1)));
        for _ in 1..LOCKSTEP_AFTER_TURNS {
            assert!(!l.after_turn(&busy(1, CMD_4K_WRITE, 0)));
        }
        assert!(l.after_turn(&busy(1, CMD_4K_WRITE, 0)));
    }

    #[test]
    fn a_deep_queue_of_slow_commands_is_not_lockstep_though_every_answer_was_seen() {
        let mut l = Lockstep::default();
        // QD16 of 1 MiB writes: each command follows an answer just seen (backlog 0), with the
        // other 15 still in the target.
        let deep = Activity {
            in_flight: 15,
            ..busy(1, 48, 0)
        };
        for _ in 0..1_000 {
            assert!(!l.after_turn(&deep));
        }
        // QD2 on a disk: one other command in flight is still lockstep.
        let qd2 = Activity {
            in_flight: LOCKSTEP_IN_FLIGHT_MAX,
            ..busy(1, 48, 0)
        };
        for _ in 1..LOCKSTEP_AFTER_TURNS {
            assert!(!l.after_turn(&qd2));
        }
        assert!(l.after_turn(&qd2));
        // One deep turn ends it.
        assert!(!l.after_turn(&deep));
    }

    #[test]
    fn a_deep_queue_never_counts_as_lockstep() {
        let mut l = Lockstep::default();
        for backlog in [BACKLOG_MIN, 63, u32::MAX] {
            for _ in 0..1_000 {
                assert!(!l.after_turn(&busy(3, CMD_4K_WRITE, backlog)));
            }
        }
        // Short backlogs now and then, fewer than the count in a row, never do either.
        for i in 0..1_000u32 {
            let backlog = if i % LOCKSTEP_AFTER_TURNS == 0 { 9 } else { 0 };
            assert!(!l.after_turn(&busy(1, CMD_4K_WRITE, backlog)));
        }
    }
}
