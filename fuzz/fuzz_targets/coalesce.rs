//! Receive coalescing's decisions (`engine::dataplane::coalesce::Coalescer`, sans-IO) over
//! arbitrary turn sequences: any activity counts (the connection derives them from the
//! initiator's PDUs), timer turns or not, any clock steps. Invariants: with coalescing off, never a batch and never a
//! miss; a miss only on a timer turn; a new batch plan waits at least one command's worth of
//! bytes and at most `LOW_WATER_MAX`, with a deadline `WAIT_MIN`..max(`max_wait`, `WAIT_MIN`)
//! after its turn; a turn that brought commands from an initiator with a short backlog (or with
//! other PDUs) plans no batch; no arithmetic overflows (debug assertions are on).
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use engine::dataplane::coalesce::{Coalescer, Outcome, Plan, BACKLOG_MIN, LOW_WATER_MAX, WAIT_MIN};
use libfuzzer_sys::fuzz_target;
use seam::Activity;

#[derive(Arbitrary, Debug)]
struct Turn {
    commands: u32,
    command_bytes: u64,
    other_pdus: u32,
    initiator_backlog: u32,
    in_flight: u32,
    timed_out: bool,
    /// Nanoseconds since the previous turn.
    step_ns: u32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    max_wait_us: u16,
    turns: Vec<Turn>,
}

fuzz_target!(|input: Input| {
    let max_wait = Duration::from_micros(u64::from(input.max_wait_us));
    let longest = max_wait.max(WAIT_MIN);
    let mut c = Coalescer::new(max_wait);
    let mut now = Instant::now();
    for t in input.turns.iter().take(4096) {
        now += Duration::from_nanos(u64::from(t.step_ns));
        let a = Activity {
            commands: t.commands,
            command_bytes: t.command_bytes,
            other_pdus: t.other_pdus,
            initiator_backlog: t.initiator_backlog,
            in_flight: t.in_flight,
        };
        let before = c.plan();
        let out = c.after_turn(&a, t.timed_out, now);
        let plan = c.plan();
        if max_wait.is_zero() {
            assert_eq!(plan, Plan::Immediate);
            assert_eq!(out, Outcome::Steady);
        }
        if out == Outcome::Missed {
            assert!(t.timed_out, "a miss on a turn the timer did not start");
            assert!(
                a.commands > 0 || a.other_pdus > 0,
                "a timer that found nothing delayed nothing: not a miss"
            );
            assert_eq!(plan, Plan::Immediate);
        }
        if a.commands > 0 && (a.initiator_backlog < BACKLOG_MIN || a.other_pdus > 0) {
            assert_eq!(plan, Plan::Immediate, "{a:?}");
        }
        if let Plan::Batch {
            low_water,
            deadline,
        } = plan
        {
            assert!((2..=LOW_WATER_MAX).contains(&low_water), "{low_water}");
            if plan != before {
                let wait = deadline.saturating_duration_since(now);
                assert!(deadline >= now + WAIT_MIN && wait <= longest, "{wait:?}");
            }
        }
    }
});
