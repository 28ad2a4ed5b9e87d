//! Latency and throughput of one workload on one target.

use hdrhistogram::Histogram;
use std::time::Duration;

/// The longest latency recorded (longer ones count as this); the histogram's unit is ns.
const LATENCY_MAX_NS: u64 = 120_000_000_000;

/// Upper edges of the latency distribution's buckets, in ns: fio's (`latency_ns`, `_us`,
/// `_ms` in its JSON), so the report's histogram and the fio-format files agree. A last,
/// open bucket holds everything above 2 s.
pub const BUCKET_EDGES_NS: [u64; 32] = {
    const STEPS: [u64; 10] = [2, 4, 10, 20, 50, 100, 250, 500, 750, 1000];
    let mut edges = [0u64; 32];
    let mut i = 0;
    while i < 30 {
        let unit = [1, 1_000, 1_000_000][i / 10];
        edges[i] = STEPS[i % 10] * unit;
        i += 1;
    }
    edges[30] = 2_000_000_000;
    edges[31] = u64::MAX;
    edges
};

fn histogram() -> Histogram<u64> {
    // 1 ns .. 120 s at 3 significant digits: a few tens of KiB per job.
    Histogram::new_with_bounds(1, LATENCY_MAX_NS, 3).expect("constant, valid histogram bounds")
}

/// What one job measured.
pub struct JobStats {
    pub read_ns: Histogram<u64>,
    pub write_ns: Histogram<u64>,
    pub bytes: u64,
    pub errors: u64,
    /// The first error, for the report.
    pub first_error: Option<String>,
    /// I/Os completed in each `interval` of the measured window.
    pub per_interval: Vec<u64>,
    pub interval: Duration,
    /// `interval` in ns (at least 1 ms, so never 0).
    interval_ns: u64,
    /// Reads in the window whose data was looked at, and whether any held a byte not 0.
    pub reads_sampled: u64,
    pub read_data_seen: bool,
}

impl JobStats {
    /// Stats for a window of `runtime`, counted over time in steps of `interval`.
    pub fn new(runtime: Duration, interval: Duration) -> JobStats {
        let interval = interval.max(Duration::from_millis(1));
        let steps = runtime.as_nanos().div_ceil(interval.as_nanos()).max(1);
        JobStats {
            read_ns: histogram(),
            write_ns: histogram(),
            bytes: 0,
            errors: 0,
            first_error: None,
            reads_sampled: 0,
            read_data_seen: false,
            per_interval: vec![0; usize::try_from(steps).unwrap_or(1).min(100_000)],
            interval,
            interval_ns: u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// An I/O of `bytes` that took `latency` and completed `at` into the measured window.
    pub fn record(&mut self, latency: Duration, read: bool, bytes: u32, at: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let h = if read {
            &mut self.read_ns
        } else {
            &mut self.write_ns
        };
        h.saturating_record(ns.clamp(1, LATENCY_MAX_NS));
        self.bytes += u64::from(bytes);
        // 64-bit division on the per-I/O path (a u128 one costs several times as much); the
        // window is far below 584 years.
        let at_ns = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        let step = usize::try_from(at_ns / self.interval_ns).unwrap_or(usize::MAX);
        if let Some(n) = self.per_interval.len().checked_sub(1) {
            self.per_interval[step.min(n)] += 1;
        }
    }

    pub fn reads(&self) -> u64 {
        self.read_ns.len()
    }

    pub fn writes(&self) -> u64 {
        self.write_ns.len()
    }

    /// A sampled read: whether its data held a byte other than 0.
    pub fn sampled_read(&mut self, data: bool) {
        self.reads_sampled += 1;
        self.read_data_seen |= data;
    }

    pub fn error(&mut self, what: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }

    pub fn merge(&mut self, other: &JobStats) {
        debug_assert_eq!(
            self.interval, other.interval,
            "jobs of one run share a window"
        );
        // Same bounds on both sides: add cannot fail.
        let _ = self.read_ns.add(&other.read_ns);
        let _ = self.write_ns.add(&other.write_ns);
        self.bytes += other.bytes;
        self.errors += other.errors;
        self.reads_sampled += other.reads_sampled;
        self.read_data_seen |= other.read_data_seen;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
        for (mine, theirs) in self.per_interval.iter_mut().zip(&other.per_interval) {
            *mine += theirs;
        }
    }
}

/// Latency figures in microseconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    pub min: f64,
    pub mean: f64,
    pub stddev: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            min: us(h.min()),
            mean: h.mean() / 1000.0,
            stddev: h.stdev() / 1000.0,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p99_9: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        }
    }
}

/// I/Os whose latency is at most `upto_ns` (and above the previous bucket's); `None`: the
/// open bucket above 2 s.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Bucket {
    pub upto_ns: Option<u64>,
    pub count: u64,
}

/// IOPS over the measured window, one value per `interval_s`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TimeSeries {
    pub interval_s: f64,
    pub iops: Vec<f64>,
}

/// One row of results.json.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    pub iops: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    /// Decimal megabytes per second, as fio reports MB/s.
    pub mb_per_s: f64,
    /// Of every I/O, reads and writes together.
    pub latency_us: Latency,
    /// Of reads alone and of writes alone, where the workload had them.
    pub read_latency_us: Option<Latency>,
    pub write_latency_us: Option<Latency>,
    /// The latency distribution in fio's buckets (every I/O).
    pub latency_histogram: Vec<Bucket>,
    /// Every read sampled (up to 256 per job) returned only zeros: the target was probably
    /// never written there, and reads of it may not touch a medium at all.
    pub reads_only_zeros: bool,
    /// Latency at percentiles from p1 to p99.99 (every I/O), from the full-resolution
    /// histogram; a percentile is left out where fewer than one I/O lies above it.
    pub percentiles_us: Vec<Percentile>,
    pub iops_over_time: TimeSeries,
    /// CPU time of the benchmark process (user + system) per I/O: the client's cost.
    pub client_cpu_us_per_io: Option<f64>,
    /// The target daemon's CPU time per I/O, from its metrics (`--target-metrics`).
    pub target_cpu_us_per_io: Option<f64>,
    pub errors: u64,
    pub first_error: Option<String>,
}

/// CPU time used over the measured window, by the client and (where known) the target.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuUsed {
    pub client: Option<Duration>,
    pub target: Option<Duration>,
}

impl Summary {
    pub fn of(stats: &JobStats, measured: Duration, cpu: CpuUsed) -> Summary {
        let secs = measured.as_secs_f64().max(1e-9);
        let (reads, writes) = (stats.reads(), stats.writes());
        let ios = reads + writes;
        let mut all = stats.read_ns.clone();
        // Same bounds: add cannot fail.
        let _ = all.add(&stats.write_ns);
        let per_io = |c: Option<Duration>| {
            c.filter(|_| ios > 0)
                .map(|c| c.as_secs_f64() * 1e6 / ios as f64)
        };
        let step = stats.interval.as_secs_f64();
        Summary {
            iops: ios as f64 / secs,
            read_iops: reads as f64 / secs,
            write_iops: writes as f64 / secs,
            mb_per_s: stats.bytes as f64 / secs / 1e6,
            latency_us: Latency::of(&all),
            read_latency_us: (reads > 0).then(|| Latency::of(&stats.read_ns)),
            write_latency_us: (writes > 0).then(|| Latency::of(&stats.write_ns)),
            latency_histogram: buckets(&all),
            percentiles_us: percentiles(&all),
            reads_only_zeros: stats.reads_sampled > 0 && !stats.read_data_seen,
            iops_over_time: TimeSeries {
                interval_s: step,
                iops: stats
                    .per_interval
                    .iter()
                    .map(|&n| n as f64 / step)
                    .collect(),
            },
            client_cpu_us_per_io: per_io(cpu.client),
            target_cpu_us_per_io: per_io(cpu.target),
            errors: stats.errors,
            first_error: stats.first_error.clone(),
        }
    }
}

/// A latency percentile: `p` in percent, the latency in µs.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Percentile {
    pub p: f64,
    pub us: f64,
}

/// The percentiles the report's curve draws.
pub const PERCENTILES: [f64; 13] = [
    1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99,
];

/// `h` at each of [`PERCENTILES`] it holds at least one I/O above.
fn percentiles(h: &Histogram<u64>) -> Vec<Percentile> {
    let n = h.len() as f64;
    PERCENTILES
        .iter()
        .filter(|&&p| n * (1.0 - p / 100.0) >= 1.0)
        .map(|&p| Percentile {
            p,
            us: h.value_at_quantile(p / 100.0) as f64 / 1000.0,
        })
        .collect()
}

/// `h` counted into fio's buckets.
fn buckets(h: &Histogram<u64>) -> Vec<Bucket> {
    let mut below = 0u64;
    BUCKET_EDGES_NS
        .iter()
        .map(|&edge| {
            let upto = if edge == u64::MAX {
                h.len()
            } else {
                h.count_between(0, edge)
            };
            let count = upto.saturating_sub(below);
            below = below.max(upto);
            Bucket {
                upto_ns: (edge != u64::MAX).then_some(edge),
                count,
            }
        })
        .collect()
}

/// CPU time (user + system) this process has used, from /proc/self/stat (clock ticks).
pub fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces and parentheses: fields count from its last ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split_ascii_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let hz = rustix::param::clock_ticks_per_second();
    Some(Duration::from_secs_f64((utime + stime) as f64 / hz as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(2);
    const STEP: Duration = Duration::from_millis(500);

    fn cpu(client: Option<Duration>) -> CpuUsed {
        CpuUsed {
            client,
            target: None,
        }
    }

    #[test]
    fn a_summary_has_rates_percentiles_and_cpu_per_io() {
        let mut s = JobStats::new(WINDOW, STEP);
        for i in 1..=1000u64 {
            let at = Duration::from_millis(i * 2 - 1);
            s.record(Duration::from_micros(i), i % 4 != 0, 4096, at);
        }
        let sum = Summary::of(
            &s,
            WINDOW,
            CpuUsed {
                client: Some(Duration::from_millis(10)),
                target: Some(Duration::from_millis(5)),
            },
        );
        assert_eq!(sum.iops, 500.0);
        assert_eq!(sum.read_iops, 375.0);
        assert_eq!(sum.write_iops, 125.0);
        assert!((sum.mb_per_s - 1000.0 * 4096.0 / 2.0 / 1e6).abs() < 1e-9);
        let l = &sum.latency_us;
        assert!((l.mean - 500.5).abs() < 1.0, "{l:?}");
        assert!((l.p50 - 500.0).abs() <= 1.0, "{l:?}");
        assert!((l.p99 - 990.0).abs() <= 1.0, "{l:?}");
        assert!((l.max - 1000.0).abs() <= 1.0, "{l:?}");
        assert!((l.min - 1.0).abs() < 0.01, "{l:?}");
        // Uniform 1..1000: sd = 1000 / sqrt(12).
        assert!((l.stddev - 288.7).abs() < 1.0, "{l:?}");
        // Writes are every fourth: 4, 8, .. 1000 µs.
        let w = sum.write_latency_us.as_ref().unwrap();
        assert!(
            (w.min - 4.0).abs() < 0.01 && (w.mean - 502.0).abs() < 1.0,
            "{w:?}"
        );
        assert!(sum.read_latency_us.is_some());
        assert_eq!(sum.client_cpu_us_per_io, Some(10.0));
        assert_eq!(sum.target_cpu_us_per_io, Some(5.0));
        // 250 I/Os in each half second.
        assert_eq!(sum.iops_over_time.interval_s, 0.5);
        assert_eq!(sum.iops_over_time.iops, [500.0; 4]);
    }

    #[test]
    fn the_distribution_uses_fios_buckets_and_counts_every_io() {
        assert_eq!(BUCKET_EDGES_NS[0], 2);
        assert_eq!(BUCKET_EDGES_NS[9], 1_000);
        assert_eq!(BUCKET_EDGES_NS[10], 2_000);
        assert_eq!(BUCKET_EDGES_NS[29], 1_000_000_000);
        assert!(BUCKET_EDGES_NS.windows(2).all(|w| w[0] < w[1]));
        let mut s = JobStats::new(WINDOW, STEP);
        let at = Duration::ZERO;
        for us in [3u64, 3, 7, 90, 90, 90, 3_000_000] {
            s.record(Duration::from_micros(us), true, 512, at);
        }
        let sum = Summary::of(&s, WINDOW, cpu(None));
        let h = &sum.latency_histogram;
        assert_eq!(h.len(), BUCKET_EDGES_NS.len());
        assert_eq!(h.iter().map(|b| b.count).sum::<u64>(), 7);
        let count = |upto: Option<u64>| h.iter().find(|b| b.upto_ns == upto).unwrap().count;
        assert_eq!(count(Some(4_000)), 2);
        assert_eq!(count(Some(10_000)), 1);
        assert_eq!(count(Some(100_000)), 3);
        assert_eq!(count(None), 1, "3 s is above the last edge");
        assert!(sum.write_latency_us.is_none());
    }

    #[test]
    fn merging_jobs_adds_counts_series_and_keeps_the_first_error() {
        let mut a = JobStats::new(WINDOW, STEP);
        a.record(Duration::from_micros(10), true, 512, Duration::ZERO);
        let mut b = JobStats::new(WINDOW, STEP);
        b.record(
            Duration::from_micros(30),
            false,
            512,
            Duration::from_millis(1900),
        );
        // Past the window's end (a last completion): counted in the last step.
        b.record(
            Duration::from_micros(30),
            false,
            512,
            Duration::from_secs(9),
        );
        b.error("EIO at 4096".into());
        b.error("EIO at 8192".into());
        a.merge(&b);
        assert_eq!((a.reads(), a.writes(), a.bytes, a.errors), (1, 2, 1536, 2));
        assert_eq!(a.first_error.as_deref(), Some("EIO at 4096"));
        assert_eq!(a.per_interval, [1, 0, 0, 2]);
        let sum = Summary::of(&a, WINDOW, cpu(None));
        assert!((sum.latency_us.mean - 70.0 / 3.0).abs() < 0.1);
        assert_eq!(sum.client_cpu_us_per_io, None);
    }

    #[test]
    fn nothing_measured_gives_zeros_not_nan() {
        let sum = Summary::of(
            &JobStats::new(WINDOW, STEP),
            Duration::from_secs(1),
            cpu(Some(Duration::ZERO)),
        );
        assert_eq!(sum.iops, 0.0);
        assert_eq!(sum.latency_us, Latency::default());
        assert_eq!(sum.client_cpu_us_per_io, None);
        assert!(sum.latency_histogram.iter().all(|b| b.count == 0));
        // Absurd latencies and windows are clamped, never a panic.
        let mut s = JobStats::new(Duration::ZERO, Duration::ZERO);
        s.record(Duration::from_secs(1_000_000), true, 1, Duration::MAX);
        s.record(Duration::ZERO, true, 1, Duration::ZERO);
        assert_eq!(s.reads(), 2);
        assert_eq!(s.per_interval, [2]);
    }

    #[test]
    fn this_process_has_used_some_cpu() {
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        assert!(process_cpu().is_some());
    }
}
