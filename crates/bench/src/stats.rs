//! Latency and throughput of one workload on one target.

use hdrhistogram::Histogram;
use std::time::Duration;

/// The longest latency recorded (longer ones count as this); the histogram's unit is ns.
const LATENCY_MAX_NS: u64 = 120_000_000_000;

/// What one job measured.
pub struct JobStats {
    pub latency_ns: Histogram<u64>,
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    pub errors: u64,
    /// The first error, for the report.
    pub first_error: Option<String>,
}

impl JobStats {
    pub fn new() -> JobStats {
        JobStats {
            // 1 ns .. 120 s at 3 significant digits: a few tens of KiB per job.
            latency_ns: Histogram::new_with_bounds(1, LATENCY_MAX_NS, 3)
                .expect("constant, valid histogram bounds"),
            reads: 0,
            writes: 0,
            bytes: 0,
            errors: 0,
            first_error: None,
        }
    }

    pub fn record(&mut self, latency: Duration, read: bool, bytes: u32) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.latency_ns
            .saturating_record(ns.clamp(1, LATENCY_MAX_NS));
        if read {
            self.reads += 1;
        } else {
            self.writes += 1;
        }
        self.bytes += u64::from(bytes);
    }

    pub fn error(&mut self, what: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }

    pub fn merge(&mut self, other: &JobStats) {
        // Same bounds on both sides: add cannot fail.
        let _ = self.latency_ns.add(&other.latency_ns);
        self.reads += other.reads;
        self.writes += other.writes;
        self.bytes += other.bytes;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
    }
}

impl Default for JobStats {
    fn default() -> Self {
        JobStats::new()
    }
}

/// Latency figures in microseconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
}

/// One row of results.json.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    pub iops: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    /// Decimal megabytes per second, as fio reports MB/s.
    pub mb_per_s: f64,
    pub latency_us: Latency,
    /// CPU time of the benchmark process (user + system) per I/O: the client's cost.
    pub client_cpu_us_per_io: Option<f64>,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Summary {
    pub fn of(stats: &JobStats, measured: Duration, cpu: Option<Duration>) -> Summary {
        let secs = measured.as_secs_f64().max(1e-9);
        let ios = stats.reads + stats.writes;
        let h = &stats.latency_ns;
        let us = |ns: u64| ns as f64 / 1000.0;
        let latency_us = if h.is_empty() {
            Latency::default()
        } else {
            Latency {
                mean: h.mean() / 1000.0,
                p50: us(h.value_at_quantile(0.50)),
                p90: us(h.value_at_quantile(0.90)),
                p99: us(h.value_at_quantile(0.99)),
                p99_9: us(h.value_at_quantile(0.999)),
                max: us(h.max()),
            }
        };
        Summary {
            iops: ios as f64 / secs,
            read_iops: stats.reads as f64 / secs,
            write_iops: stats.writes as f64 / secs,
            mb_per_s: stats.bytes as f64 / secs / 1e6,
            latency_us,
            client_cpu_us_per_io: cpu
                .filter(|_| ios > 0)
                .map(|c| c.as_secs_f64() * 1e6 / ios as f64),
            errors: stats.errors,
            first_error: stats.first_error.clone(),
        }
    }
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

    #[test]
    fn a_summary_has_rates_percentiles_and_cpu_per_io() {
        let mut s = JobStats::new();
        for i in 1..=1000u64 {
            s.record(Duration::from_micros(i), i % 4 != 0, 4096);
        }
        let sum = Summary::of(&s, Duration::from_secs(2), Some(Duration::from_millis(10)));
        assert_eq!(sum.iops, 500.0);
        assert_eq!(sum.read_iops, 375.0);
        assert_eq!(sum.write_iops, 125.0);
        assert!((sum.mb_per_s - 1000.0 * 4096.0 / 2.0 / 1e6).abs() < 1e-9);
        let l = &sum.latency_us;
        assert!((l.mean - 500.5).abs() < 1.0, "{l:?}");
        assert!((l.p50 - 500.0).abs() <= 1.0, "{l:?}");
        assert!((l.p99 - 990.0).abs() <= 1.0, "{l:?}");
        assert!((l.max - 1000.0).abs() <= 1.0, "{l:?}");
        assert_eq!(sum.client_cpu_us_per_io, Some(10.0));
    }

    #[test]
    fn merging_jobs_adds_counts_and_keeps_the_first_error() {
        let mut a = JobStats::new();
        a.record(Duration::from_micros(10), true, 512);
        let mut b = JobStats::new();
        b.record(Duration::from_micros(30), false, 512);
        b.error("EIO at 4096".into());
        b.error("EIO at 8192".into());
        a.merge(&b);
        assert_eq!((a.reads, a.writes, a.bytes, a.errors), (1, 1, 1024, 2));
        assert_eq!(a.first_error.as_deref(), Some("EIO at 4096"));
        let sum = Summary::of(&a, Duration::from_secs(1), None);
        assert!((sum.latency_us.mean - 20.0).abs() < 0.1);
        assert_eq!(sum.client_cpu_us_per_io, None);
    }

    #[test]
    fn nothing_measured_gives_zeros_not_nan() {
        let sum = Summary::of(
            &JobStats::new(),
            Duration::from_secs(1),
            Some(Duration::ZERO),
        );
        assert_eq!(sum.iops, 0.0);
        assert_eq!(sum.latency_us, Latency::default());
        assert_eq!(sum.client_cpu_us_per_io, None);
        // Absurd latencies are clamped, never a panic.
        let mut s = JobStats::new();
        s.record(Duration::from_secs(1_000_000), true, 1);
        s.record(Duration::ZERO, true, 1);
        assert_eq!(s.reads, 2);
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
