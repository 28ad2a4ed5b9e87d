//! What a run measures: the seeds' methodology as a list of workloads (sans-IO, unit tested).

use std::time::Duration;

/// How offsets are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Uniformly random, aligned to the I/O size.
    Random,
    /// Each job walks its own slice of the range, wrapping at its end.
    Sequential,
}

/// Which part of the report a workload belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// The headline figures (seed 000's table): 4 KiB random at QD1/QD64, 1 MiB sequential.
    Headline,
    /// 4 KiB random I/O across queue depths.
    QueueDepth,
    /// Random reads (and writes) from 512 B to 1 MiB.
    SizeSweep,
    /// Queue depth × sessions (jobs).
    Matrix,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Workload {
    /// Stable identifier, e.g. `randread-4k-qd64` (the JSON's key).
    pub id: String,
    pub group: Group,
    pub pattern: Pattern,
    /// Percentage of reads: 100 read-only, 0 write-only, 70 the seeds' 70/30 mix.
    pub read_pct: u8,
    pub block_size: u32,
    /// I/Os in flight per job.
    pub queue_depth: u32,
    /// Parallel jobs, each with its own session (iSCSI) or ring (local).
    pub jobs: u32,
}

impl Workload {
    fn new(
        group: Group,
        pattern: Pattern,
        read_pct: u8,
        block_size: u32,
        qd: u32,
        jobs: u32,
    ) -> Self {
        let kind = match (pattern, read_pct) {
            (Pattern::Random, 100) => "randread".to_string(),
            (Pattern::Random, 0) => "randwrite".to_string(),
            (Pattern::Random, r) => format!("randrw{r}"),
            (Pattern::Sequential, 100) => "seqread".to_string(),
            (Pattern::Sequential, 0) => "seqwrite".to_string(),
            (Pattern::Sequential, r) => format!("seqrw{r}"),
        };
        let mut id = format!("{kind}-{}-qd{qd}", size_label(block_size));
        if jobs > 1 {
            id.push_str(&format!("-j{jobs}"));
        }
        Workload {
            id,
            group,
            pattern,
            read_pct,
            block_size,
            queue_depth: qd,
            jobs,
        }
    }

    pub fn writes(&self) -> bool {
        self.read_pct < 100
    }

    /// I/Os in flight in all.
    pub fn total_depth(&self) -> u32 {
        self.queue_depth * self.jobs
    }
}

/// `4k`, `1m`, `512`: the fio-style size label.
pub fn size_label(bytes: u32) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{}m", bytes >> 20)
    } else if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("{}k", bytes >> 10)
    } else {
        bytes.to_string()
    }
}

/// How long each workload runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Not measured: lets queues fill and caches settle.
    pub ramp: Duration,
    pub runtime: Duration,
}

impl Timing {
    pub fn quick() -> Timing {
        Timing {
            ramp: Duration::from_secs(1),
            runtime: Duration::from_secs(5),
        }
    }

    pub fn full() -> Timing {
        Timing {
            ramp: Duration::from_secs(2),
            runtime: Duration::from_secs(10),
        }
    }

    pub fn per_workload(&self) -> Duration {
        self.ramp + self.runtime
    }
}

const KIB: u32 = 1024;
const MIB: u32 = 1024 * 1024;
const QUEUE_DEPTHS: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Queue depths of the queue depth × sessions matrix.
pub const MATRIX_DEPTHS: [u32; 3] = [1, 8, 32];
/// Queue depth of the I/O-size sweep.
pub const SWEEP_DEPTH: u32 = 16;
const SIZES: [u32; 6] = [512, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB];

/// The workloads of a run, in order. Without `writes` only reads run (writes destroy data).
pub fn plan(quick: bool, writes: bool) -> Vec<Workload> {
    use Group::*;
    use Pattern::*;
    let mut w = vec![
        Workload::new(Headline, Random, 100, 4 * KIB, 1, 1),
        Workload::new(Headline, Random, 100, 4 * KIB, 64, 1),
    ];
    if writes {
        w.push(Workload::new(Headline, Random, 0, 4 * KIB, 64, 1));
        w.push(Workload::new(Headline, Random, 70, 4 * KIB, 64, 1));
    }
    w.push(Workload::new(Headline, Sequential, 100, MIB, 16, 1));
    if writes {
        w.push(Workload::new(Headline, Sequential, 0, MIB, 16, 1));
    }
    // The headline already has QD1 and QD64 of 4 KiB random reads (and QD64 writes). The quick
    // run sweeps the queue depths too: a curve through two points says nothing.
    for qd in QUEUE_DEPTHS.into_iter().filter(|&q| q != 1 && q != 64) {
        w.push(Workload::new(QueueDepth, Random, 100, 4 * KIB, qd, 1));
    }
    if writes {
        for qd in QUEUE_DEPTHS.into_iter().filter(|&q| q != 64) {
            w.push(Workload::new(QueueDepth, Random, 0, 4 * KIB, qd, 1));
        }
    }
    if quick {
        return w;
    }
    if writes {
        for qd in [1, 16] {
            w.push(Workload::new(QueueDepth, Random, 70, 4 * KIB, qd, 1));
        }
    }
    // 4 KiB at QD16 is in the queue-depth rows.
    for bs in SIZES.into_iter().filter(|&b| b != 4 * KIB) {
        w.push(Workload::new(SizeSweep, Random, 100, bs, SWEEP_DEPTH, 1));
    }
    if writes {
        for bs in SIZES.into_iter().filter(|&b| b != 4 * KIB) {
            w.push(Workload::new(SizeSweep, Random, 0, bs, SWEEP_DEPTH, 1));
        }
    }
    // Sessions 1 of the matrix are the queue-depth rows above.
    for jobs in [2, 4] {
        for qd in MATRIX_DEPTHS {
            w.push(Workload::new(Matrix, Random, 100, 4 * KIB, qd, jobs));
        }
    }
    w
}

/// Time left for `remaining` workload runs (each workload on each target is one run).
pub fn eta(remaining: usize, timing: &Timing) -> Duration {
    // Opening sessions and rings adds a little per run; half a second is generous on loopback.
    (timing.per_workload() + Duration::from_millis(500)) * remaining as u32
}

/// `1h02m`, `3m05s`, `42s`.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_reads_only_has_the_headline_reads_and_the_queue_depth_sweep() {
        let ids: Vec<_> = plan(true, false).into_iter().map(|w| w.id).collect();
        assert_eq!(
            ids,
            [
                "randread-4k-qd1",
                "randread-4k-qd64",
                "seqread-1m-qd16",
                "randread-4k-qd2",
                "randread-4k-qd4",
                "randread-4k-qd8",
                "randread-4k-qd16",
                "randread-4k-qd32"
            ]
        );
    }

    #[test]
    fn writes_appear_only_when_allowed() {
        assert!(plan(false, false).iter().all(|w| !w.writes()));
        let quick = plan(true, true);
        let ids: Vec<_> = quick.iter().map(|w| w.id.as_str()).collect();
        assert_eq!(
            ids[..6],
            [
                "randread-4k-qd1",
                "randread-4k-qd64",
                "randwrite-4k-qd64",
                "randrw70-4k-qd64",
                "seqread-1m-qd16",
                "seqwrite-1m-qd16"
            ]
        );
        // Every queue depth of 4 KiB random reads and writes, as in the full run.
        for qd in QUEUE_DEPTHS {
            assert!(ids.contains(&format!("randread-4k-qd{qd}").as_str()));
            assert!(ids.contains(&format!("randwrite-4k-qd{qd}").as_str()));
        }
        assert_eq!(ids.len(), 17);
        assert!(plan(false, true).iter().filter(|w| w.writes()).count() > 10);
    }

    #[test]
    fn the_full_plan_covers_the_seeds_methodology_once_each() {
        let full = plan(false, true);
        let mut ids: Vec<_> = full.iter().map(|w| w.id.clone()).collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "workload ids are unique");
        // Every queue depth 1..64 of 4 KiB random reads and writes.
        for qd in QUEUE_DEPTHS {
            assert!(ids.contains(&format!("randread-4k-qd{qd}")));
            assert!(ids.contains(&format!("randwrite-4k-qd{qd}")));
        }
        // The size sweep from 512 B to 1 MiB.
        for bs in SIZES {
            assert!(ids.contains(&format!("randread-{}-qd16", size_label(bs))));
        }
        // The matrix: 3 depths x 2 and 4 sessions (1 session is in the queue-depth rows).
        assert_eq!(full.iter().filter(|w| w.group == Group::Matrix).count(), 6);
        for qd in MATRIX_DEPTHS {
            assert!(ids.contains(&format!("randread-4k-qd{qd}")));
        }
        assert!(ids.contains(&"randread-4k-qd32-j4".to_string()));
        assert!(full.iter().all(|w| w.total_depth() <= 128));
    }

    #[test]
    fn labels_and_durations_read_like_fio() {
        assert_eq!(size_label(512), "512");
        assert_eq!(size_label(4096), "4k");
        assert_eq!(size_label(1 << 20), "1m");
        assert_eq!(size_label(1536), "1536");
        assert_eq!(human_duration(Duration::from_secs(42)), "42s");
        assert_eq!(human_duration(Duration::from_secs(185)), "3m05s");
        assert_eq!(human_duration(Duration::from_secs(3720)), "1h02m");
        let t = Timing::quick();
        assert_eq!(eta(2, &t), Duration::from_secs(13));
        assert_eq!(eta(0, &t), Duration::ZERO);
    }
}
