//! Runs one workload on one target: a thread per job, each with its own engine (an iSCSI
//! session or an io_uring), keeping its queue depth full for the ramp and the measured window.

use crate::plan::{Pattern, Timing, Workload};
use crate::stats::{process_cpu, CpuUsed, JobStats, Summary};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// An I/O back from an engine: its tag and what happened.
pub type Done = (usize, Result<(), String>);

/// One job's access to a target: a session, a ring. Tags are 0..queue_depth; the engine owns
/// a buffer per tag (writes send its pattern, reads land in it).
pub trait Engine: Send {
    /// Queues an I/O of `len` bytes at byte `offset` (aligned to the target's block size).
    fn submit(&mut self, tag: usize, op: Op, offset: u64, len: u32) -> Result<(), String>;
    /// Sends what is queued and waits until at least `min` I/Os are done, appending them to
    /// `out`. An error here ends the job (the session or ring is unusable).
    fn complete(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), String>;
    /// What the last read of `tag` brought, from its first byte (at least the read's
    /// length), while the tag is free: the runner samples it for a target never written.
    fn data(&self, tag: usize) -> Option<&[u8]>;
}

/// Reads per job whose data is looked at for a target that was never written.
const ZERO_SAMPLES: u64 = 256;

/// What a target is, for the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TargetInfo {
    /// As given on the command line (an iSCSI URL without its password).
    pub name: String,
    /// `iscsi`, `file` or `block`.
    pub kind: String,
    pub capacity_bytes: u64,
    pub block_size: u32,
    /// Things the user should know about the numbers (a sparse file, say).
    pub notes: Vec<String>,
    /// The target IQN or subsystem NQN of a network target.
    pub node: Option<String>,
    /// The metrics endpoint its target CPU was read from (`--target-metrics`), if any.
    pub metrics: Option<String>,
}

/// Opens engines on one target, one per job.
pub trait Target: Send + Sync {
    fn info(&self) -> &TargetInfo;
    /// An engine for `queue_depth` I/Os of at most `max_len` bytes.
    fn open(&self, queue_depth: usize, max_len: u32) -> Result<Box<dyn Engine>, String>;
}

/// xorshift64*: offsets need speed and spread, not cryptographic quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            // The multiply-shift maps 64 random bits onto 0..n without a division.
            ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
        }
    }
}

/// Where a job's I/Os go.
#[derive(Debug)]
struct Offsets {
    pattern: Pattern,
    /// First byte of this job's slice (sequential) or of the range (random).
    base: u64,
    /// I/O-size units in the slice or range.
    slots: u64,
    next: u64,
    len: u64,
}

impl Offsets {
    fn new(pattern: Pattern, range: u64, len: u32, job: u32, jobs: u32) -> Offsets {
        let len = u64::from(len.max(1));
        let all = range / len;
        let (base, slots) = match pattern {
            Pattern::Random => (0, all),
            Pattern::Sequential => {
                let per_job = (all / u64::from(jobs.max(1))).max(1);
                (
                    (u64::from(job) * per_job).min(all.saturating_sub(1)) * len,
                    per_job,
                )
            }
        };
        Offsets {
            pattern,
            base,
            slots: slots.max(1),
            next: 0,
            len,
        }
    }

    fn next(&mut self, rng: &mut Rng) -> u64 {
        let slot = match self.pattern {
            Pattern::Random => rng.below(self.slots),
            Pattern::Sequential => {
                let s = self.next;
                self.next = (self.next + 1) % self.slots;
                s
            }
        };
        self.base + slot * self.len
    }
}

/// The target daemon's CPU time so far (from its metrics), where it can be had.
pub type TargetCpu<'a> = &'a dyn Fn() -> Option<Duration>;

/// The step of the IOPS-over-time series: about 100 points per window, none shorter than 100 ms.
pub fn series_step(runtime: Duration) -> Duration {
    (runtime / 100).max(Duration::from_millis(100))
}

/// Runs `workload` on `target` over the first `range` bytes; the measured window follows the
/// ramp. Errors opening the target (no session, say) fail the run; I/O errors are counted.
/// `target_cpu`, when given, is read at both ends of the window.
pub fn run(
    target: &dyn Target,
    workload: &Workload,
    timing: &Timing,
    range: u64,
    target_cpu: Option<TargetCpu>,
) -> Result<Summary, String> {
    let info = target.info();
    if u64::from(workload.block_size) > range {
        return Err(format!(
            "{} bytes per I/O do not fit in the {range}-byte range",
            workload.block_size
        ));
    }
    if info.block_size == 0 || !workload.block_size.is_multiple_of(info.block_size) {
        return Err(format!(
            "{}-byte I/Os on a {}-byte-block target",
            workload.block_size, info.block_size
        ));
    }
    let jobs = workload.jobs.max(1);
    let mut engines = Vec::new();
    for _ in 0..jobs {
        engines.push(target.open(workload.queue_depth as usize, workload.block_size)?);
    }
    let start_line = Arc::new(Barrier::new(jobs as usize + 1));
    let results = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (job, engine) in engines.into_iter().enumerate() {
            let start_line = Arc::clone(&start_line);
            let w = workload.clone();
            let timing = *timing;
            handles.push(
                scope.spawn(move || run_job(engine, &w, &timing, range, job as u32, &start_line)),
            );
        }
        start_line.wait();
        let started = Instant::now();
        // CPU over the measured window only: this process's, and the target's where known.
        let target_now = || target_cpu.and_then(|f| f());
        sleep_until(started + timing.ramp);
        let before = (process_cpu(), target_now());
        sleep_until(started + timing.ramp + timing.runtime);
        let after = (process_cpu(), target_now());
        let used =
            |a: Option<Duration>, b: Option<Duration>| a.zip(b).map(|(a, b)| b.saturating_sub(a));
        let cpu = CpuUsed {
            client: used(before.0, after.0),
            target: used(before.1, after.1),
        };
        let stats: Vec<_> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a job thread panicked".into()))
            })
            .collect();
        (stats, cpu)
    });
    let (per_job, cpu) = results;
    let mut all = JobStats::new(timing.runtime, series_step(timing.runtime));
    for job in per_job {
        all.merge(&job?);
    }
    Ok(Summary::of(&all, timing.runtime, cpu))
}

fn run_job(
    mut engine: Box<dyn Engine>,
    w: &Workload,
    timing: &Timing,
    range: u64,
    job: u32,
    start_line: &Barrier,
) -> Result<JobStats, String> {
    let qd = w.queue_depth.max(1) as usize;
    let mut rng =
        Rng(0x9E37_79B9_7F4A_7C15 ^ (u64::from(job) + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut offsets = Offsets::new(w.pattern, range, w.block_size, job, w.jobs);
    let mut stats = JobStats::new(timing.runtime, series_step(timing.runtime));
    let mut free: Vec<usize> = (0..qd).rev().collect();
    let mut issued: Vec<(Instant, Op)> = vec![(Instant::now(), Op::Read); qd];
    let mut done = Vec::with_capacity(qd);
    start_line.wait();
    let started = Instant::now();
    let measure_from = started + timing.ramp;
    let end = measure_from + timing.runtime;
    let mut in_flight = 0usize;
    loop {
        let now = Instant::now();
        if now < end {
            while let Some(tag) = free.pop() {
                let op = if w.read_pct >= 100
                    || (w.read_pct > 0 && rng.below(100) < u64::from(w.read_pct))
                {
                    Op::Read
                } else {
                    Op::Write
                };
                let offset = offsets.next(&mut rng);
                engine.submit(tag, op, offset, w.block_size)?;
                issued[tag] = (Instant::now(), op);
                in_flight += 1;
            }
        }
        if in_flight == 0 {
            break;
        }
        engine.complete(1, &mut done)?;
        let now = Instant::now();
        for (tag, result) in done.drain(..) {
            let Some(&(at, op)) = issued.get(tag) else {
                return Err(format!("engine returned unknown tag {tag}"));
            };
            in_flight = in_flight.saturating_sub(1);
            free.push(tag);
            // Counted when it completes inside the window (fio counts the same way).
            if now < measure_from || now > end {
                continue;
            }
            match result {
                Ok(()) => stats.record(now - at, op == Op::Read, w.block_size, now - measure_from),
                Err(e) => stats.error(e),
            }
            if op == Op::Read && stats.reads_sampled < ZERO_SAMPLES {
                let data = engine.data(tag).unwrap_or_default();
                let len = (w.block_size as usize).min(data.len());
                stats.sampled_read(data[..len].iter().any(|&b| b != 0));
            }
        }
    }
    // Every I/O reaped: the engine (and its buffers) may go.
    drop(engine);
    Ok(stats)
}

fn sleep_until(at: Instant) {
    std::thread::sleep(at.saturating_duration_since(Instant::now()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Group};

    #[test]
    fn random_offsets_are_aligned_spread_and_inside_the_range() {
        let mut rng = Rng(42);
        let mut o = Offsets::new(Pattern::Random, 1 << 30, 4096, 0, 1);
        let mut seen = std::collections::HashSet::new();
        let mut top_half = 0;
        for _ in 0..10_000 {
            let off = o.next(&mut rng);
            assert_eq!(off % 4096, 0);
            assert!(off + 4096 <= 1 << 30);
            top_half += u32::from(off >= 1 << 29);
            seen.insert(off);
        }
        // 10 000 draws from 262 144 slots: ~9 810 distinct expected by the birthday bound.
        assert!(seen.len() > 9_700, "{} distinct", seen.len());
        assert!((4_500..5_500).contains(&top_half), "{top_half}");
    }

    #[test]
    fn sequential_jobs_walk_their_own_slices_and_wrap() {
        let mut rng = Rng(1);
        let mut a = Offsets::new(Pattern::Sequential, 8 << 20, 1 << 20, 0, 2);
        let mut b = Offsets::new(Pattern::Sequential, 8 << 20, 1 << 20, 1, 2);
        let a_offs: Vec<_> = (0..5).map(|_| a.next(&mut rng) >> 20).collect();
        let b_offs: Vec<_> = (0..5).map(|_| b.next(&mut rng) >> 20).collect();
        assert_eq!(a_offs, [0, 1, 2, 3, 0]);
        assert_eq!(b_offs, [4, 5, 6, 7, 4]);
        // A range smaller than jobs x size still stays inside it.
        let mut tiny = Offsets::new(Pattern::Sequential, 4096, 4096, 3, 4);
        assert_eq!(tiny.next(&mut rng), 0);
    }

    /// An engine that completes every I/O after a fixed delay, checking what it is given.
    struct FakeEngine {
        queued: Vec<(usize, Op, u64, u32)>,
        range: u64,
        delay: Duration,
        fail_writes: bool,
        in_flight: std::collections::HashSet<usize>,
        /// What every read brings.
        data: Vec<u8>,
    }

    impl Engine for FakeEngine {
        fn submit(&mut self, tag: usize, op: Op, offset: u64, len: u32) -> Result<(), String> {
            assert!(
                offset + u64::from(len) <= self.range,
                "offset {offset} out of range"
            );
            assert!(
                self.in_flight.insert(tag),
                "tag {tag} reused while in flight"
            );
            self.queued.push((tag, op, offset, len));
            Ok(())
        }
        fn complete(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), String> {
            assert!(min >= 1 && !self.queued.is_empty());
            std::thread::sleep(self.delay);
            for (tag, op, offset, _) in self.queued.drain(..) {
                self.in_flight.remove(&tag);
                let r = if op == Op::Write && self.fail_writes {
                    Err(format!("write at {offset} failed"))
                } else {
                    Ok(())
                };
                out.push((tag, r));
            }
            Ok(())
        }
        fn data(&self, _tag: usize) -> Option<&[u8]> {
            Some(&self.data)
        }
    }

    struct FakeTarget {
        info: TargetInfo,
        fail_writes: bool,
        /// Whether reads bring data (a byte other than 0) or zeros.
        written: bool,
    }

    impl Target for FakeTarget {
        fn info(&self) -> &TargetInfo {
            &self.info
        }
        fn open(&self, _qd: usize, _max: u32) -> Result<Box<dyn Engine>, String> {
            Ok(Box::new(FakeEngine {
                queued: Vec::new(),
                range: self.info.capacity_bytes,
                delay: Duration::from_millis(1),
                fail_writes: self.fail_writes,
                in_flight: Default::default(),
                data: vec![u8::from(self.written); 1 << 20],
            }))
        }
    }

    fn fake(fail_writes: bool) -> FakeTarget {
        FakeTarget {
            info: TargetInfo {
                name: "fake".into(),
                kind: "file".into(),
                capacity_bytes: 64 << 20,
                block_size: 512,
                notes: vec![],
                node: None,
                metrics: None,
            },
            fail_writes,
            written: true,
        }
    }

    #[test]
    fn a_run_keeps_the_queue_full_and_measures_only_the_window() {
        let timing = Timing {
            ramp: Duration::from_millis(100),
            runtime: Duration::from_millis(400),
        };
        let w = plan(true, true)
            .into_iter()
            .find(|w| w.id == "randrw70-4k-qd64")
            .unwrap();
        let s = run(&fake(false), &w, &timing, 64 << 20, None).unwrap();
        // 64 I/Os every ~1 ms (plus scheduling) for 0.4 s.
        assert!(s.iops > 64.0 * 200.0 && s.iops < 64.0 * 1100.0, "{s:?}");
        let read_share = s.read_iops / s.iops;
        assert!((0.6..0.8).contains(&read_share), "{read_share}");
        assert!(s.latency_us.p50 >= 1000.0, "{s:?}");
        assert_eq!(s.errors, 0);
        let jobs = Workload {
            jobs: 3,
            group: Group::Matrix,
            ..w
        };
        let s3 = run(&fake(false), &jobs, &timing, 64 << 20, None).unwrap();
        assert!(s3.iops > 2.0 * s.iops, "3 jobs {} vs 1 {}", s3.iops, s.iops);
    }

    #[test]
    fn reads_of_a_target_never_written_are_flagged() {
        let timing = Timing {
            ramp: Duration::ZERO,
            runtime: Duration::from_millis(100),
        };
        let w = plan(true, false)
            .into_iter()
            .find(|w| w.id == "randread-4k-qd64")
            .unwrap();
        let s = run(&fake(false), &w, &timing, 64 << 20, None).unwrap();
        assert!(!s.reads_only_zeros, "data came back");
        let blank = FakeTarget {
            written: false,
            ..fake(false)
        };
        let s = run(&blank, &w, &timing, 64 << 20, None).unwrap();
        assert!(s.iops > 0.0 && s.reads_only_zeros, "{s:?}");
        // Writes alone: nothing sampled, nothing flagged.
        let writes = plan(true, true)
            .into_iter()
            .find(|w| w.id == "randwrite-4k-qd64")
            .unwrap();
        assert!(
            !run(&blank, &writes, &timing, 64 << 20, None)
                .unwrap()
                .reads_only_zeros
        );
    }

    #[test]
    fn io_errors_are_counted_with_the_first_one_kept() {
        let timing = Timing {
            ramp: Duration::ZERO,
            runtime: Duration::from_millis(100),
        };
        let w = plan(true, true)
            .into_iter()
            .find(|w| w.id == "randwrite-4k-qd64")
            .unwrap();
        let s = run(&fake(true), &w, &timing, 64 << 20, None).unwrap();
        assert!(s.errors > 0 && s.iops == 0.0, "{s:?}");
        assert!(s.first_error.unwrap().contains("failed"));
    }

    #[test]
    fn impossible_sizes_are_refused_before_any_io() {
        let timing = Timing::quick();
        let w = plan(true, false)
            .into_iter()
            .find(|w| w.id == "seqread-1m-qd16")
            .unwrap();
        assert!(run(&fake(false), &w, &timing, 4096, None)
            .unwrap_err()
            .contains("do not fit"));
        let mut t = fake(false);
        t.info.block_size = 4096;
        let small = Workload {
            block_size: 512,
            ..w
        };
        assert!(run(&t, &small, &timing, 1 << 20, None)
            .unwrap_err()
            .contains("4096-byte-block"));
    }
}
