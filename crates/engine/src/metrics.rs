//! Prometheus metrics (text exposition format) and the small HTTP endpoint that serves them.
//!
//! The per-command path stays free of shared counters, which would bounce one cache line between
//! cores: per-device I/O is counted by each connection in plain integers and added here once a
//! second (and when the connection closes).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::log_limit::LogLimiter;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why the target closed the session (`admission::Refusal::reason`).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControlLabel {
    /// The control socket's verb.
    pub verb: &'static str,
    /// `ok`, or the error's kind (`conflict`, `not_found`, ...).
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    /// The config key of the limit (docs/CONFIG.md), e.g. `max_connections_per_source`.
    pub limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's index, 0-based (its thread is `ferrosan-worker-N`).
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabel {
    pub device: String,
    /// `read` or `write`.
    pub op: &'static str,
}

/// Upper bounds of the command latency buckets, nanoseconds (2.5 µs to 2.5 s); +Inf follows.
pub const LATENCY_BOUNDS_NS: [u64; 18] = [
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
    2_500_000_000,
];

/// Command latencies one connection counted (per device and direction) between two reports:
/// plain integers, so the command path touches no shared memory. Serialized as `stats` and
/// `sessions` show it (`ferrosan top` takes percentiles of the difference of two): commands
/// (`count`), summed nanoseconds (`sum_ns`), and per bucket of [`LATENCY_BOUNDS_NS`] (then
/// +Inf) the commands that fell in it (`buckets`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LatencyCounts {
    /// Per bucket (not cumulative); the last one is +Inf.
    pub buckets: [u64; LATENCY_BOUNDS_NS.len() + 1],
    pub sum_ns: u64,
    pub count: u64,
}

impl LatencyCounts {
    pub fn observe(&mut self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BOUNDS_NS
            .iter()
            .position(|&bound| ns <= bound)
            .unwrap_or(LATENCY_BOUNDS_NS.len());
        if let Some(n) = self.buckets.get_mut(bucket) {
            *n += 1;
        }
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.count += 1;
    }

    /// As a JSON value (see the type's serialization).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!(self)
    }

    /// The bound a threshold is judged at: the first of [`LATENCY_BOUNDS_NS`] at or above it
    /// (the buckets cannot tell apart the commands between two bounds); the last bound past it.
    pub fn slow_bound(threshold_ns: u64) -> u64 {
        let last = LATENCY_BOUNDS_NS[LATENCY_BOUNDS_NS.len() - 1];
        (LATENCY_BOUNDS_NS.iter().copied())
            .find(|&bound| bound >= threshold_ns)
            .unwrap_or(last)
    }

    /// Of the commands counted, how many took longer than [`Self::slow_bound`] of
    /// `threshold_ns`, and the upper bound of the slowest one's bucket (None: beyond the last
    /// bound).
    pub fn slower_than(&self, threshold_ns: u64) -> (u64, Option<u64>) {
        let bound = Self::slow_bound(threshold_ns);
        let first = (LATENCY_BOUNDS_NS.iter())
            .position(|&b| b > bound)
            .unwrap_or(LATENCY_BOUNDS_NS.len());
        let slow = self.buckets.get(first..).unwrap_or(&[]);
        let slowest = (slow.iter().rposition(|&n| n > 0))
            .and_then(|i| LATENCY_BOUNDS_NS.get(first + i).copied());
        (slow.iter().sum(), slowest)
    }

    pub fn add(&mut self, other: &LatencyCounts) {
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine += theirs;
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.count += other.count;
    }
}

/// A Prometheus histogram fed in bulk — a connection's [`LatencyCounts`] once a second — rather
/// than one shared atomic update per command (prometheus-client's `Histogram` observes one value
/// at a time).
/// Clones share their counts (a device's [`DeviceSeries`] holds one beside its family).
#[derive(Debug, Default, Clone)]
pub struct BulkHistogram(Arc<Mutex<LatencyCounts>>);

impl BulkHistogram {
    pub fn add(&self, counts: &LatencyCounts) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).add(counts);
    }

    /// Everything observed since start: per bucket, summed, counted.
    pub fn totals(&self) -> LatencyCounts {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl TypedMetric for BulkHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for BulkHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let counts = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        let bounds = LATENCY_BOUNDS_NS
            .iter()
            .map(|&ns| ns as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY));
        let buckets: Vec<(f64, u64)> = bounds.zip(counts.buckets).collect();
        encoder.encode_histogram::<NoLabelSet>(
            counts.sum_ns as f64 / 1e9,
            counts.count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// How a device's reads and writes reach it: `io_uring` (direct, on the workers' rings),
/// `threads` (direct, on the I/O thread pool: io_uring off or unavailable), `page_cache`
/// (buffered), `memory` (RAM, tmpfs).
/// The values of [`IoPathLabel`]'s `path`.
pub const IO_PATHS: [&str; 5] = [
    "asynchronous",
    "io_uring",
    "threads",
    "page_cache",
    "memory",
];

/// The values of [`TakeoverLabel`]'s `reason`.
pub const TAKEOVER_REASONS: [&str; 4] = ["initiator", "operator", "owner_gone", "restart"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IoPathLabel {
    pub device: String,
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    /// The target's IQN (a subsystem's NQN), or `discovery` for a discovery session.
    pub target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    /// The `[[device]]` name.
    pub device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TakeoverLabel {
    pub device: String,
    /// `initiator` (SET TARGET PORT GROUPS), `operator` (`ferrosan ctl device take`),
    /// `owner_gone` (the owner's heartbeat stopped or its client left the cluster), `restart`
    /// (this gateway's crashed predecessor).
    pub reason: String,
}

/// Why a command did not end GOOD, for `device_errors_total{cause}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceErrorLabel {
    pub device: String,
    pub cause: &'static str,
}

/// The causes of `device_errors_total`: CHECK CONDITION by sense key, then the other statuses.
/// A UNIT ATTENTION is no error (every login and live change raises them): it is counted in
/// `device_unit_attentions_total` instead.
pub const ERROR_CAUSES: [&str; 11] = [
    "not_ready",
    "medium_error",
    "hardware_error",
    "illegal_request",
    "insufficient_resources",
    "data_protect",
    "aborted_command",
    "miscompare",
    "reservation_conflict",
    "busy",
    "other",
];

/// The outcome of a command that did not end GOOD: Some(index into [`ERROR_CAUSES`]), or None
/// for a unit attention. `sense` is the sense data (fixed or descriptor format).
pub fn error_cause(status: u8, sense: &[u8]) -> Option<usize> {
    let cause = match status {
        // CHECK CONDITION: by sense key (byte 2 of fixed format, byte 1 of descriptor format).
        0x02 => {
            let (key, asc) = match sense.first().map(|b| b & 0x7F) {
                Some(0x70 | 0x71) => (sense.get(2).map(|k| k & 0x0F), sense.get(12)),
                Some(0x72 | 0x73) => (sense.get(1).map(|k| k & 0x0F), sense.get(2)),
                _ => (None, None),
            };
            match key {
                Some(0x06) => return None,
                // INSUFFICIENT (REGISTRATION) RESOURCES: a limit of the target's was reached.
                Some(0x05) if asc == Some(&0x55) => "insufficient_resources",
                Some(0x02) => "not_ready",
                Some(0x03) => "medium_error",
                Some(0x04) => "hardware_error",
                Some(0x05) => "illegal_request",
                Some(0x07) => "data_protect",
                Some(0x0B) => "aborted_command",
                Some(0x0E) => "miscompare",
                _ => "other",
            }
        }
        0x18 => "reservation_conflict",
        // BUSY, TASK SET FULL.
        0x08 | 0x28 => "busy",
        _ => "other",
    };
    ERROR_CAUSES.iter().position(|&c| c == cause)
}

/// A target and an initiator logged in to it (`initiator_*_total`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InitiatorLabel {
    pub target: String,
    pub initiator: String,
}

/// Distinct (target, initiator) series at most; I/O of further pairs is counted under
/// `initiator="other"` of its target, so a churn of initiator names cannot grow the scrape
/// without bound.
pub const INITIATOR_SERIES_MAX: usize = 512;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    pub version: &'static str,
}

/// The process's own figures, read from /proc at each scrape (the names Prometheus's client
/// libraries use, so the usual dashboards and alerts apply).
#[derive(Debug)]
struct ProcessCollector {
    started: std::time::SystemTime,
}

/// CPU seconds (user + system) and resident bytes of this process, from /proc/self/stat.
fn process_stat() -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    // After the name: state is field 3, utime 14, stime 15, rss 24 (proc(5)).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = rustix::param::clock_ticks_per_second().max(1) as f64;
    let cpu = (field(14)? + field(15)?) as f64 / ticks;
    let rss = field(24)?.saturating_mul(rustix::param::page_size() as u64);
    Some((cpu, rss))
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        if let Some((cpu, rss)) = process_stat() {
            let m = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(m)?;
            let m = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size, in bytes",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(rss as i64).encode(m)?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            let m = encoder.encode_descriptor(
                "process_open_fds",
                "Open file descriptors",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(fds.count() as i64).encode(m)?;
        }
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        if let Some(max) = limit.current {
            let m = encoder.encode_descriptor(
                "process_max_fds",
                "The open file descriptor limit",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX)).encode(m)?;
        }
        let started = self
            .started
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let m = encoder.encode_descriptor(
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch, in seconds",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(started).encode(m)?;
        Ok(())
    }
}

/// The devices served, read at each scrape: their capacity and offline state (a gauge kept
/// by every resize and offline path would be one more thing each must remember), and the
/// write-back queues of those whose store answers writes before its medium has them (RBD
/// images with the write cache on; they change with every write, so a gauge kept up to date
/// would cost the I/O path a shared counter). A device whose LU is gone (removed, its last
/// command done) is forgotten, with its other series ([`Metrics::render`]).
#[derive(Clone, Default)]
struct DeviceCollector {
    devices: Arc<Mutex<std::collections::BTreeMap<String, std::sync::Weak<scsi::LogicalUnit>>>>,
}

impl std::fmt::Debug for DeviceCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCollector")
    }
}

impl DeviceCollector {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::BTreeMap<String, std::sync::Weak<scsi::LogicalUnit>>,
    > {
        self.devices.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The devices whose LU is gone since the last look, forgotten here.
    fn gone(&self) -> Vec<String> {
        let mut devices = self.lock();
        let gone: Vec<String> = devices
            .iter()
            .filter(|(_, lu)| lu.strong_count() == 0)
            .map(|(name, _)| name.clone())
            .collect();
        devices.retain(|_, lu| lu.strong_count() > 0);
        gone
    }

    /// The devices still served.
    fn sample(&self) -> Vec<(String, Arc<scsi::LogicalUnit>)> {
        self.lock()
            .iter()
            .filter_map(|(name, lu)| Some((name.clone(), lu.upgrade()?)))
            .collect()
    }
}

impl prometheus_client::collector::Collector for DeviceCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::gauge::ConstGauge;
        type Read = fn(&scsi::LogicalUnit) -> Option<u64>;
        let sample = self.sample();
        if sample.is_empty() {
            return Ok(());
        }
        for (name, help, value) in [
            (
                "device_capacity_bytes",
                "The device's size as its initiators see it (READ CAPACITY), changed by a resize",
                (|lu: &scsi::LogicalUnit| Some(lu.capacity_bytes())) as Read,
            ),
            (
                "device_offline",
                "1 while the device is offline (ferrosan ctl device offline: its LUNs answer NOT READY), else 0",
                |lu| Some(u64::from(lu.is_offline())),
            ),
            (
                "device_write_back_bytes",
                "Bytes of writes answered from the device's write cache that its medium does not have yet (RBD write-back)",
                |lu| lu.write_back().map(|w| w.bytes),
            ),
            (
                "device_write_back_writes",
                "Writes answered from the device's write cache that its medium does not have yet (RBD write-back)",
                |lu| lu.write_back().map(|w| w.writes),
            ),
        ] {
            let values: Vec<(&String, u64)> = sample
                .iter()
                .filter_map(|(device, lu)| Some((device, value(lu)?)))
                .collect();
            if values.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (device, v) in values {
                let label = DeviceLabel {
                    device: device.clone(),
                };
                let m = family.encode_family(&label)?;
                ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoginLabel {
    /// `success` or the failure's status class and detail, e.g. `0202`.
    pub result: String,
}

/// What a gateway's I/O shipping counts for one device ([`Metrics::gateway_shipping`]).
#[derive(Clone, Default)]
pub struct ShippingMetrics {
    pub shipped: Counter,
    pub failures: Counter,
    pub peer_sessions: Gauge,
}

/// Declares every plainly registered series once: its field, its type, its name (under the
/// `ferrosan_` prefix) and its help, which is also the field's documentation.
macro_rules! series {
    ($($(#[doc = $help:literal])+ $field:ident: $ty:ty = $name:literal;)*) => {
        /// Every series registered as it is (the [`Metrics`] deref to it).
        pub struct Series {
            $($(#[doc = $help])+ pub $field: $ty,)*
        }

        impl Series {
            fn register(registry: &mut Registry) -> Series {
                let series = Series {
                    $($field: <$ty>::default(),)*
                };
                $(registry.register($name, concat!($($help),+).trim(), series.$field.clone());)*
                series
            }
        }
    };
}

series! {
    /// Times a configured limit refused or cut off a client
    limit_exceeded: Family<LimitLabel, Counter> = "limit_exceeded";
    /// Sessions the target closed because a change (reload, ctl verb) took their admission away: a login now would go to another group, need another proof, or be refused; by reason
    sessions_closed: Family<ReasonLabel, Counter> = "sessions_closed";
    /// Completed login attempts by result
    logins: Family<LoginLabel, Counter> = "logins";
    /// Control socket requests (ctl verbs) by verb and result: `ok` or the error's kind (`conflict` counts changes refused because the state moved under them)
    control_requests: Family<ControlLabel, Counter> = "control_requests";
    /// Open TCP connections
    connections: Gauge = "connections";
    /// iSCSI sessions in full feature phase, by target (`discovery` for discovery sessions); a target's series stays (at 0) once it has had a session
    sessions: Family<TargetLabel, Gauge> = "sessions";
    /// NVMe/TCP controllers (each an admin queue with its I/O queues), discovery controllers included
    nvme_controllers: Gauge = "nvme_controllers";
    /// NVMe/TCP queues connected (admin and I/O), each one TCP connection
    nvme_queues: Gauge = "nvme_queues";
    /// Connections parked while idle (NVMe/TCP queues): their socket and their protocol's state kept, their driver's memory given back until their host sends or a deadline comes
    connections_parked: Gauge = "connections_parked";
    /// Times a connection parked; after many, the daemon gives the heap's free pages back to the kernel (the memory the parked connections gave back)
    connection_parks: Counter = "connection_parks";
    /// NVMe/TCP Connect commands by result: success, or why refused (invalid_host, invalid_parameters, controller_busy, sequence)
    nvme_connects: Family<LoginLabel, Counter> = "nvme_connects";
    /// NVMe/TCP queue authentications (DH-HMAC-CHAP) by result: success, or why they failed (failed: a wrong secret; hash_unusable, dh_group_unusable, incorrect_payload, incorrect_message, ...)
    nvme_authentications: Family<LoginLabel, Counter> = "nvme_authentications";
    /// NVMe/TCP TLS handshakes by result: success, or why they failed (unknown_identity: no key for the identity the host offered; handshake: a wrong key, or a TLS error)
    nvme_tls_handshakes: Family<LoginLabel, Counter> = "nvme_tls_handshakes";
    /// Open TCP connections per network worker (the acceptor gives each new one to the least loaded)
    worker_connections: Family<WorkerLabel, Gauge> = "worker_connections";
    /// Share of the last second each network worker's thread was on the CPU (the acceptor prefers the least busy)
    worker_busy: Family<WorkerLabel, Gauge<f64, AtomicU64>> = "worker_busy_ratio";
    /// Reads that waited for several small commands (receive coalescing)
    receive_batches: Counter = "receive_batches";
    /// Coalesced reads the timer ended with commands waiting but under half the batch read; coalescing then backs off
    receive_batch_misses: Counter = "receive_batch_misses";
    /// Times a network worker polled its connections before sleeping (busy_poll_us)
    busy_polls: Counter = "busy_polls";
    /// Busy polls that ended with input or a completion before their window
    busy_poll_hits: Counter = "busy_poll_hits";
    /// Time network workers spent busy polling
    busy_poll_seconds: Counter<f64, AtomicU64> = "busy_poll_seconds";
    /// fdatasyncs on direct-I/O devices that answered a group of write-through/FUA writes
    group_commit_flushes: Counter = "group_commit_flushes";
    /// Write-through/FUA writes on direct-I/O devices made durable by a group flush (the rest carry RWF_DSYNC)
    group_commit_writes: Counter = "group_commit_writes";
    /// Buffered writes to a disk-backed device that waited in the kernel (writeback, throttling, journal)
    write_stalls: Family<DeviceLabel, Counter> = "write_stalls";
    /// Buffered writes run off the network workers because their device was stalling
    writes_offloaded: Family<DeviceLabel, Counter> = "writes_offloaded";
    /// READ commands completed, per device
    device_reads: Family<DeviceLabel, Counter> = "device_reads";
    /// Commands that write the medium (WRITE, WRITE AND VERIFY, WRITE SAME, COMPARE AND WRITE, ORWRITE, WRITE ATOMIC) completed, per device
    device_writes: Family<DeviceLabel, Counter> = "device_writes";
    /// Bytes read by successful READ commands, per device
    device_read_bytes: Family<DeviceLabel, Counter> = "device_read_bytes";
    /// Data-Out bytes of successful writing commands, per device
    device_write_bytes: Family<DeviceLabel, Counter> = "device_write_bytes";
    /// Commands of any kind answered with a status other than GOOD, per device and cause: the sense key of a CHECK CONDITION (not_ready, medium_error, hardware_error, illegal_request, data_protect, aborted_command, miscompare), reservation_conflict, busy (BUSY, TASK SET FULL) or other; unit attentions are not errors (device_unit_attentions)
    device_errors: Family<DeviceErrorLabel, Counter> = "device_errors";
    /// Commands answered with a UNIT ATTENTION (power on after a login, reset, capacity or LUN map change, ...), per device
    device_unit_attentions: Family<DeviceLabel, Counter> = "device_unit_attentions";
    /// The share of the space a file device allocates from (its filesystem) in use, checked every 5 s
    device_space_used: Family<DeviceLabel, Gauge<f64, AtomicU64>> = "device_space_used_ratio";
    /// Times the space a device allocates from went past space_warning_percent (each time, its initiators got THIN PROVISIONING SOFT THRESHOLD REACHED)
    device_space_warnings: Family<DeviceLabel, Counter> = "device_space_warnings";
    /// 1 for the path a device's reads and writes take (asynchronous, io_uring, threads, page_cache, memory)
    device_io_path: Family<IoPathLabel, Gauge> = "device_io_path";
    /// RBD gateways: 1 while this gateway owns the device's image (its target port groups active/optimized), 0 while standby
    gateway_owner: Family<DeviceLabel, Gauge> = "gateway_owner";
    /// RBD gateways, on a non-owner: milliseconds since the owner's heartbeat last moved (as this gateway saw it; 0 while it moves each second, on the owner, or for an owner that writes none). The image is taken over at gateway_takeover_s
    gateway_owner_silence_milliseconds: Family<DeviceLabel, Gauge> = "gateway_owner_silence_milliseconds";
    /// 1 for a device whose saved persistent reservations could not be loaded at start: it answers NOT READY, MANUAL INTERVENTION REQUIRED until the file is repaired or removed and the daemon restarted
    device_fenced: Family<DeviceLabel, Gauge> = "device_fenced";
    /// RBD gateways: times this gateway took the device's image over, by reason (initiator, operator, owner_gone, restart)
    gateway_takeovers: Family<TakeoverLabel, Counter> = "gateway_takeovers";
    /// RBD gateways: SET TARGET PORT GROUPS through this gateway refused because the image's owner is alive (failback is the operator's)
    gateway_takeovers_refused: Family<DeviceLabel, Counter> = "gateway_takeovers_refused";
    /// RBD gateways: times this gateway found itself fenced (blocklisted) by another gateway's takeover of the device's image
    gateway_fenced: Family<DeviceLabel, Counter> = "gateway_fenced";
    /// RBD gateways: commands this gateway shipped to the image's owner (they came through a non-optimized path)
    gateway_shipped: Family<DeviceLabel, Counter> = "gateway_shipped";
    /// RBD gateways: shipped commands that did not reach the owner or got no answer from it (answered NOT READY, transition, for a retry)
    gateway_ship_failures: Family<DeviceLabel, Counter> = "gateway_ship_failures";
    /// RBD gateways: peer sessions open (or being opened) from this gateway to the image's owner, one per shipping nexus
    gateway_peer_sessions: Family<DeviceLabel, Gauge> = "gateway_peer_sessions";
    /// Bytes of successful READ commands sent straight from the page cache (sendfile, file devices; part of device_read_bytes), per device
    device_sendfile_bytes: Family<DeviceLabel, Counter> = "device_sendfile_bytes";
    /// READ and WRITE commands, per device and op: time from the command being complete in the target (CDB and all its Data-Out) to its response being queued to send
    device_latency: Family<LatencyLabel, BulkHistogram> = "device_latency_seconds";
    /// READ commands completed, per target and initiator (at most 512 pairs; then initiator="other")
    initiator_reads: Family<InitiatorLabel, Counter> = "initiator_reads";
    /// Writing commands completed, per target and initiator (at most 512 pairs; then initiator="other")
    initiator_writes: Family<InitiatorLabel, Counter> = "initiator_writes";
    /// Bytes read by successful READ commands, per target and initiator
    initiator_read_bytes: Family<InitiatorLabel, Counter> = "initiator_read_bytes";
    /// Data-Out bytes of successful writing commands, per target and initiator
    initiator_write_bytes: Family<InitiatorLabel, Counter> = "initiator_write_bytes";
}

/// The daemon's metrics: every [`Series`] (a `Metrics` derefs to them) and the registry that
/// renders them.
pub struct Metrics {
    registry: Registry,
    series: Series,
    /// The pairs that have their own series (at most [`INITIATOR_SERIES_MAX`]).
    initiator_pairs: Mutex<std::collections::HashSet<InitiatorLabel>>,
    devices: DeviceCollector,
    /// Each device's series by name, made at its first report or `stats` (see
    /// [`DeviceSeries`]); dropped with the series when the device goes.
    device_series: std::sync::RwLock<HashMap<String, Arc<DeviceSeries>>>,
    /// Past this a read or write is slow and logged: the config's `slow_command_ms`, set by
    /// the server at start (its default lives in the config's limits); 0 = never.
    slow_command_ns: AtomicU64,
}

/// The ops of `device_latency_seconds`, in [`DeviceSeries::latency`]'s order.
const LATENCY_OPS: [&str; 2] = ["read", "write"];

/// One device's I/O series, found once by name. A connection reports its I/O on each device
/// once a second and `stats` (what `ferrosan top` asks every second) reads every device's:
/// through the families, each took a label's `String` and a family's lock per series, 17 a
/// device, a quarter of a `stats` line's cost (`perf`, 16,000 devices).
struct DeviceSeries {
    reads: Counter,
    writes: Counter,
    read_bytes: Counter,
    write_bytes: Counter,
    unit_attentions: Counter,
    sendfile_bytes: Counter,
    /// By [`ERROR_CAUSES`] index.
    errors: [Counter; ERROR_CAUSES.len()],
    /// By [`LATENCY_OPS`] index.
    latency: [BulkHistogram; LATENCY_OPS.len()],
    /// The log lines of its slow commands ([`DeviceSeries::say_slow`]).
    slow_log: Mutex<LogLimiter>,
}

/// At most one line a device per this long: every connection that used a stalled device
/// reports its slow commands each second.
const SLOW_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl DeviceSeries {
    /// Logs the commands of one connection's report that took over `threshold_ns` (0: none
    /// is slow), at most once per [`SLOW_LOG_INTERVAL`], counting the reports held back since
    /// the last line: an admin reading the journal learns which device stalled a host and
    /// when. True if it logged.
    fn say_slow(
        &self,
        device: &str,
        op: &str,
        counts: &LatencyCounts,
        threshold_ns: u64,
        now: Instant,
    ) -> bool {
        if threshold_ns == 0 {
            return false;
        }
        let (slow, slowest) = counts.slower_than(threshold_ns);
        if slow == 0 {
            return false;
        }
        let admitted = (self.slow_log.lock().unwrap_or_else(|p| p.into_inner())).admit(now);
        let Some(held_back) = admitted else {
            return false;
        };
        let seconds = |ns: u64| ns as f64 / 1e9;
        let slowest = match slowest {
            Some(bound) => format!("the slowest within {} s", seconds(bound)),
            None => format!(
                "the slowest over {} s",
                seconds(LATENCY_BOUNDS_NS[LATENCY_BOUNDS_NS.len() - 1])
            ),
        };
        tracing::warn!(
            device,
            op,
            slow,
            reports_held_back = held_back,
            "device {device}: {slow} {op}s took over {} s to complete ({slowest}): the device, or what it stands on, was slow",
            seconds(LatencyCounts::slow_bound(threshold_ns))
        );
        true
    }
}

impl std::ops::Deref for Metrics {
    type Target = Series;

    fn deref(&self) -> &Series {
        &self.series
    }
}

/// See [`Metrics::device_totals`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTotals {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub read_latency: LatencyCounts,
    pub write_latency: LatencyCounts,
}

/// One connection's I/O on one device since its last report.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoCounts {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Commands not ended GOOD, by [`ERROR_CAUSES`] index.
    pub errors: [u64; ERROR_CAUSES.len()],
    pub unit_attentions: u64,
    /// Of `read_bytes`, those lent as a file range and sent with sendfile.
    pub sendfile_bytes: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // Process metrics carry their conventional unprefixed names (process_*), next to ours.
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector {
            started: std::time::SystemTime::now(),
        }));
        let registry = root.sub_registry_with_prefix("ferrosan");
        let devices = DeviceCollector::default();
        registry.register_collector(Box::new(devices.clone()));
        let build_info = Family::<BuildLabel, Gauge>::default();
        build_info
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "build_info",
            "1, labelled with the running ferrosan's version",
            build_info,
        );
        let series = Series::register(registry);
        Metrics {
            registry: root,
            series,
            initiator_pairs: Mutex::new(std::collections::HashSet::new()),
            devices,
            device_series: std::sync::RwLock::default(),
            slow_command_ns: AtomicU64::new(0),
        }
    }

    /// Reads and writes slower than `ms` milliseconds are logged from now on (the config's
    /// `slow_command_ms`); 0: none.
    pub fn set_slow_command_ms(&self, ms: u32) {
        let ns = u64::from(ms) * 1_000_000;
        self.slow_command_ns.store(ns, Ordering::Relaxed);
    }

    /// `device`'s series (see [`DeviceSeries`]), made in the families on first use: every
    /// series exists from a device's first report on, zero or not.
    fn series(&self, device: &str) -> Arc<DeviceSeries> {
        let known = self.device_series.read().unwrap_or_else(|p| p.into_inner());
        if let Some(series) = known.get(device) {
            return Arc::clone(series);
        }
        drop(known);
        // Made under the write lock, which `forget_device` holds while it drops the families'
        // series: a device's series are never made half before and half after it goes.
        let mut known = self
            .device_series
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let series = known.entry(device.to_owned()).or_insert_with(|| {
            let label = DeviceLabel {
                device: device.to_owned(),
            };
            let counter =
                |family: &Family<DeviceLabel, Counter>| family.get_or_create(&label).clone();
            Arc::new(DeviceSeries {
                reads: counter(&self.device_reads),
                writes: counter(&self.device_writes),
                read_bytes: counter(&self.device_read_bytes),
                write_bytes: counter(&self.device_write_bytes),
                unit_attentions: counter(&self.device_unit_attentions),
                sendfile_bytes: counter(&self.device_sendfile_bytes),
                errors: ERROR_CAUSES.map(|cause| {
                    self.device_errors
                        .get_or_create(&DeviceErrorLabel {
                            device: device.to_owned(),
                            cause,
                        })
                        .clone()
                }),
                latency: LATENCY_OPS.map(|op| {
                    self.device_latency
                        .get_or_create(&LatencyLabel {
                            device: device.to_owned(),
                            op,
                        })
                        .clone()
                }),
                slow_log: Mutex::new(LogLimiter::new(SLOW_LOG_INTERVAL)),
            })
        });
        Arc::clone(series)
    }

    /// Adds one connection's I/O on `device` (see [`IoCounts`]).
    pub fn add_io(&self, device: &str, io: &IoCounts) {
        let series = self.series(device);
        for (counter, n) in [
            (&series.reads, io.reads),
            (&series.writes, io.writes),
            (&series.read_bytes, io.read_bytes),
            (&series.write_bytes, io.write_bytes),
            (&series.unit_attentions, io.unit_attentions),
            (&series.sendfile_bytes, io.sendfile_bytes),
        ] {
            counter.inc_by(n);
        }
        for (counter, n) in series.errors.iter().zip(io.errors) {
            counter.inc_by(n);
        }
    }

    /// Adds one session's I/O to its target and initiator's series (see
    /// [`INITIATOR_SERIES_MAX`]).
    pub fn add_initiator_io(&self, target: &str, initiator: &str, io: &IoCounts) {
        let mut label = InitiatorLabel {
            target: target.to_string(),
            initiator: initiator.to_string(),
        };
        {
            let mut pairs = self
                .initiator_pairs
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if !pairs.contains(&label) {
                if pairs.len() < INITIATOR_SERIES_MAX {
                    pairs.insert(label.clone());
                } else {
                    label.initiator = "other".into();
                }
            }
        }
        for (family, n) in [
            (&self.initiator_reads, io.reads),
            (&self.initiator_writes, io.writes),
            (&self.initiator_read_bytes, io.read_bytes),
            (&self.initiator_write_bytes, io.write_bytes),
        ] {
            family.get_or_create(&label).inc_by(n);
        }
    }

    /// Adds one connection's command latencies on `device` (`op`: "read" or "write").
    pub fn add_latency(&self, device: &str, op: &'static str, counts: &LatencyCounts) {
        match LATENCY_OPS.iter().position(|&known| known == op) {
            Some(i) => {
                let series = self.series(device);
                series.latency[i].add(counts);
                let threshold = self.slow_command_ns.load(Ordering::Relaxed);
                series.say_slow(device, op, counts, threshold, Instant::now());
            }
            None => self
                .device_latency
                .get_or_create(&LatencyLabel {
                    device: device.to_string(),
                    op,
                })
                .add(counts),
        }
    }

    /// One device's totals since start, for `ferrosan top` (the control socket's `stats`):
    /// reads, writes, read bytes, write bytes, errors, and per op (read, write) the commands
    /// timed and their summed latency in nanoseconds.
    pub fn device_totals(&self, device: &str) -> DeviceTotals {
        let series = self.series(device);
        let [read_latency, write_latency] = series.latency.each_ref().map(BulkHistogram::totals);
        DeviceTotals {
            reads: series.reads.get(),
            writes: series.writes.get(),
            read_bytes: series.read_bytes.get(),
            write_bytes: series.write_bytes.get(),
            errors: series.errors.iter().map(Counter::get).sum(),
            read_latency,
            write_latency,
        }
    }

    pub fn session_closed(&self, reason: &'static str) {
        self.sessions_closed
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub fn control_request(&self, verb: &'static str, result: &'static str) {
        self.control_requests
            .get_or_create(&ControlLabel { verb, result })
            .inc();
    }

    pub fn limit(&self, limit: &'static str) {
        self.limit_exceeded
            .get_or_create(&LimitLabel { limit })
            .inc();
    }

    /// The open-connection gauge of worker `index`: the acceptor's measure of its load.
    pub fn worker_connections(&self, index: usize) -> Gauge {
        self.worker_connections
            .get_or_create(&WorkerLabel {
                worker: index.to_string(),
            })
            .clone()
    }

    /// One worker's busy share (0..=1), sampled by the worker itself once a second.
    pub fn worker_busy(&self, index: usize) -> Gauge<f64, AtomicU64> {
        self.worker_busy
            .get_or_create(&WorkerLabel {
                worker: index.to_string(),
            })
            .clone()
    }

    /// The stall and offload counters of one device (see `stall.rs`).
    pub fn device_writes(&self, device: &str) -> (Counter, Counter) {
        let label = DeviceLabel {
            device: device.to_owned(),
        };
        (
            self.write_stalls.get_or_create(&label).clone(),
            self.writes_offloaded.get_or_create(&label).clone(),
        )
    }

    /// Reports `lu` as `device` from now on (its capacity, offline state and write-back
    /// queue, read at each scrape); it replaces a device of that name served before.
    pub fn watch_device(&self, device: &str, lu: &Arc<scsi::LogicalUnit>) {
        self.devices
            .lock()
            .insert(device.to_owned(), Arc::downgrade(lu));
    }

    /// Drops every series of `device` (removed, its LU gone): a scrape shows only devices
    /// served, and a device added again under the name starts from zero.
    fn forget_device(&self, device: &str) {
        // Held to the end: `series` makes none of this device's meanwhile.
        let mut known = self
            .device_series
            .write()
            .unwrap_or_else(|p| p.into_inner());
        known.remove(device);
        let label = DeviceLabel {
            device: device.to_owned(),
        };
        for family in [
            &self.write_stalls,
            &self.writes_offloaded,
            &self.device_reads,
            &self.device_writes,
            &self.device_read_bytes,
            &self.device_write_bytes,
            &self.device_unit_attentions,
            &self.gateway_takeovers_refused,
            &self.gateway_fenced,
            &self.gateway_shipped,
            &self.gateway_ship_failures,
            &self.device_sendfile_bytes,
            &self.device_space_warnings,
        ] {
            family.remove(&label);
        }
        self.device_space_used.remove(&label);
        for family in [
            &self.gateway_owner,
            &self.gateway_owner_silence_milliseconds,
            &self.device_fenced,
            &self.gateway_peer_sessions,
        ] {
            family.remove(&label);
        }
        for cause in ERROR_CAUSES {
            self.device_errors.remove(&DeviceErrorLabel {
                device: device.to_owned(),
                cause,
            });
        }
        for op in ["read", "write"] {
            self.device_latency.remove(&LatencyLabel {
                device: device.to_owned(),
                op,
            });
        }
        for path in IO_PATHS {
            self.device_io_path.remove(&IoPathLabel {
                device: device.to_owned(),
                path: path.to_owned(),
            });
        }
        for reason in TAKEOVER_REASONS {
            self.gateway_takeovers.remove(&TakeoverLabel {
                device: device.to_owned(),
                reason: reason.to_owned(),
            });
        }
    }

    /// The share of `device`'s space in use (0.0 to 1.0).
    pub fn device_space_used(&self, device: &str, ratio: f64) {
        self.device_space_used
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .set(ratio);
    }

    /// `device`'s space went past the warning threshold.
    pub fn device_space_warning(&self, device: &str) {
        self.device_space_warnings
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    /// Records the I/O path of a device (see [`IoPathLabel`]).
    pub fn device_io_path(&self, device: &str, path: &str) {
        self.device_io_path
            .get_or_create(&IoPathLabel {
                device: device.to_owned(),
                path: path.to_owned(),
            })
            .set(1);
    }

    /// Records whether this gateway owns `device`'s image.
    pub fn device_fenced(&self, device: &str) {
        self.device_fenced
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .set(1);
    }

    pub fn gateway_owner(&self, device: &str, owns: bool) {
        self.gateway_owner
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .set(i64::from(owns));
    }

    pub fn gateway_owner_silence(&self, device: &str, silence: std::time::Duration) {
        self.gateway_owner_silence_milliseconds
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .set(i64::try_from(silence.as_millis()).unwrap_or(i64::MAX));
    }

    pub fn gateway_takeover(&self, device: &str, reason: &str) {
        self.gateway_takeovers
            .get_or_create(&TakeoverLabel {
                device: device.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn gateway_takeover_refused(&self, device: &str) {
        self.gateway_takeovers_refused
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    pub fn gateway_fenced(&self, device: &str) {
        self.gateway_fenced
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    /// A device's shipping series, taken once: the handles share the values, so shipped
    /// commands count without a label lookup each.
    pub fn gateway_shipping(&self, device: &str) -> ShippingMetrics {
        let label = DeviceLabel {
            device: device.to_owned(),
        };
        ShippingMetrics {
            shipped: self.gateway_shipped.get_or_create(&label).clone(),
            failures: self.gateway_ship_failures.get_or_create(&label).clone(),
            peer_sessions: self.gateway_peer_sessions.get_or_create(&label).clone(),
        }
    }

    /// The session gauge of `target` (None: a discovery session), taken once per session.
    pub fn sessions_of(&self, target: Option<&str>) -> Gauge {
        let target = target.unwrap_or("discovery").to_owned();
        self.sessions.get_or_create(&TargetLabel { target }).clone()
    }

    pub fn login(&self, result: String) {
        self.logins.get_or_create(&LoginLabel { result }).inc();
    }

    /// Counts an NVMe/TCP Connect by its result.
    pub fn nvme_connect(&self, result: &str) {
        self.nvme_connects
            .get_or_create(&LoginLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// Counts a queue's TLS handshake outcome.
    pub fn nvme_tls(&self, result: &str) {
        self.nvme_tls_handshakes
            .get_or_create(&LoginLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// Counts a queue's DH-HMAC-CHAP outcome.
    pub fn nvme_auth(&self, result: &str) {
        self.nvme_authentications
            .get_or_create(&LoginLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// The exposition text (of the devices served: a removed one's series go once its LU
    /// has gone).
    pub fn render(&self) -> String {
        for device in self.devices.gone() {
            self.forget_device(&device);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The exposition is OpenMetrics text (`# EOF` at its end, counters as `_total` samples of a
/// family named without the suffix), and says so: a Prometheus-0.0.4 parser given it as
/// text/plain would lose the counters' metadata.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a scraper that does not ask for OpenMetrics gets (curl, promtool, older Prometheus).
const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The Prometheus 0.0.4 text form of an OpenMetrics exposition: a counter family's HELP and
/// TYPE lines name its `_total` samples, and there is no `# EOF`. Samples are the same.
pub fn to_text_004(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE ", "# UNIT "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some(("# UNIT ", _)) => continue,
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Request bytes read before answering (a scrape request is a few hundred bytes).
const REQUEST_BYTES_MAX: usize = 8192;
/// Metrics connections open at once, all sources together; more are closed at accept.
const SCRAPES_MAX: usize = 64;
/// Metrics connections open at once from one address: a client holding connections open
/// delays nobody else's scrape (Prometheus opens one per scrape).
const SCRAPES_PER_SOURCE_MAX: usize = 4;
/// Time a client has to send its request head.
const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Time a whole answer may take (a slow reader of a large page).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections open per source address (and in all), for the bounds above.
#[derive(Default)]
struct ScrapeCount(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl ScrapeCount {
    /// Counts a connection from `source` in, unless a bound is reached: which one.
    fn enter(&self, source: std::net::IpAddr) -> Result<(), &'static str> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if open.values().sum::<usize>() >= SCRAPES_MAX {
            return Err("metrics_connections");
        }
        let n = open.entry(source).or_default();
        if *n >= SCRAPES_PER_SOURCE_MAX {
            return Err("metrics_connections_per_source");
        }
        *n += 1;
        Ok(())
    }

    fn leave(&self, source: std::net::IpAddr) {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                open.remove(&source);
            }
        }
    }
}

/// Serves `GET /metrics` (and `GET /healthz`: 200 while the daemon's runtime answers, for a
/// liveness probe) until the process ends. Anything else gets 404; slow, oversized or
/// too many requests are cut off (per source and in all), each refusal logged and counted.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    let open = Arc::new(ScrapeCount::default());
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if let Err(limit) = open.enter(peer.ip()) {
            tracing::debug!(%peer, "metrics connection refused: {limit}");
            metrics.limit(limit);
            continue;
        }
        let metrics = Arc::clone(&metrics);
        let open = Arc::clone(&open);
        tokio::spawn(async move {
            if let Err(why) = respond(&mut stream, &metrics).await {
                tracing::debug!(%peer, "metrics request: {why}");
            }
            open.leave(peer.ip());
        });
    }
}

/// Why a scrape was cut off.
#[derive(Debug, thiserror::Error)]
enum ScrapeError {
    #[error("no request head within 2 s")]
    SlowHead,
    #[error("request head too long")]
    HeadTooLong,
    #[error("answer not taken within 10 s")]
    SlowReader,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

async fn respond(stream: &mut tokio::net::TcpStream, metrics: &Metrics) -> Result<(), ScrapeError> {
    let mut request = vec![0u8; REQUEST_BYTES_MAX];
    let head = tokio::time::timeout(REQUEST_HEAD_TIMEOUT, read_head(stream, &mut request));
    let len = match head.await {
        Err(_) => return Err(ScrapeError::SlowHead),
        Ok(Err(e)) => return Err(e.into()),
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(len))) => len,
    };
    if len == 0 {
        let refusal = b"HTTP/1.0 431 Request Header Fields Too Large\r\n\r\n";
        let _ = tokio::time::timeout(ANSWER_TIMEOUT, stream.write_all(refusal)).await;
        return Err(ScrapeError::HeadTooLong);
    }
    let line = request[..len]
        .split(|&b| b == b'\r')
        .next()
        .unwrap_or_default();
    let head = String::from_utf8_lossy(&request[..len]).to_ascii_lowercase();
    let wants_openmetrics = head
        .lines()
        .any(|l| l.starts_with("accept:") && l.contains("application/openmetrics-text"));
    let plain = "text/plain; charset=utf-8";
    let route = route(line);
    let (status, content_type, body) = match route {
        Route::Metrics { .. } if wants_openmetrics => ("200 OK", OPENMETRICS, metrics.render()),
        Route::Metrics { .. } => ("200 OK", TEXT_004, to_text_004(&metrics.render())),
        Route::Health { .. } => ("200 OK", plain, "ok\n".to_string()),
        Route::NotFound => (
            "404 Not Found",
            plain,
            "try /metrics or /healthz\n".to_string(),
        ),
        Route::MethodNotAllowed => ("405 Method Not Allowed", plain, "GET or HEAD\n".to_string()),
    };
    let allow = if route == Route::MethodNotAllowed {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let head = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        body.len()
    );
    // HEAD: the GET's head (its length included), no body.
    let body = if matches!(
        route,
        Route::Metrics { head: true } | Route::Health { head: true }
    ) {
        ""
    } else {
        body.as_str()
    };
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await
    };
    match tokio::time::timeout(ANSWER_TIMEOUT, answer).await {
        Ok(result) => result.map_err(ScrapeError::Io),
        Err(_) => Err(ScrapeError::SlowReader),
    }
}

/// What a request line asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// `GET` or `HEAD` of `/metrics`, whatever its query string (`?name[]=...` from
    /// federation, a cache buster): the whole exposition.
    Metrics {
        head: bool,
    },
    /// `GET` or `HEAD` of `/healthz`: a liveness probe's.
    Health {
        head: bool,
    },
    NotFound,
    MethodNotAllowed,
}

fn route(line: &[u8]) -> Route {
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => Route::Metrics { head: false },
        (b"HEAD", b"/metrics") => Route::Metrics { head: true },
        (b"GET", b"/healthz") => Route::Health { head: false },
        (b"HEAD", b"/healthz") => Route::Health { head: true },
        (b"GET" | b"HEAD", _) => Route::NotFound,
        _ => Route::MethodNotAllowed,
    }
}

/// Reads up to the end of a request head into `request`: its length, `Some(0)` when the
/// head does not fit, `None` when the client closed first.
async fn read_head(
    stream: &mut tokio::net::TcpStream,
    request: &mut [u8],
) -> std::io::Result<Option<usize>> {
    let mut len = 0;
    while !request[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        if len == request.len() {
            return Ok(Some(0));
        }
        let n = stream.read(&mut request[len..]).await?;
        if n == 0 {
            return Ok(None);
        }
        len += n;
    }
    Ok(Some(len))
}

/// Binds the metrics endpoint (at start-up, so a bad address fails loudly).
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_forgotten_and_added_again_starts_from_zero_in_both_views() {
        let metrics = Metrics::new();
        let io = |reads| IoCounts {
            reads,
            ..IoCounts::default()
        };
        let scraped = |metrics: &Metrics, line: &str| metrics.render().lines().any(|l| l == line);
        metrics.add_io("d", &io(3));
        assert_eq!(metrics.device_totals("d").reads, 3);
        assert!(scraped(
            &metrics,
            "ferrosan_device_reads_total{device=\"d\"} 3"
        ));
        metrics.forget_device("d");
        assert!(
            !metrics.render().contains("device=\"d\""),
            "its series are gone"
        );
        metrics.add_io("d", &io(2));
        assert_eq!(metrics.device_totals("d").reads, 2, "from zero");
        assert!(scraped(
            &metrics,
            "ferrosan_device_reads_total{device=\"d\"} 2"
        ));
        let mut latency = LatencyCounts::default();
        latency.observe(Duration::from_micros(1));
        metrics.add_latency("d", "write", &latency);
        assert_eq!(metrics.device_totals("d").write_latency.count, 1);
        assert!(scraped(
            &metrics,
            "ferrosan_device_latency_seconds_count{device=\"d\",op=\"write\"} 1"
        ));
    }

    #[test]
    fn errors_are_classified_by_sense_key_and_unit_attentions_are_not_errors() {
        let cause = |status, sense: &[u8]| error_cause(status, sense).map(|i| ERROR_CAUSES[i]);
        let fixed = |key: u8| {
            let mut s = [0u8; 18];
            s[0] = 0x70;
            s[2] = key;
            s
        };
        assert_eq!(cause(0x02, &fixed(0x06)), None);
        assert_eq!(
            cause(0x02, &[0x72, 0x06, 0x29, 0]),
            None,
            "descriptor format"
        );
        assert_eq!(cause(0x02, &fixed(0x03)), Some("medium_error"));
        assert_eq!(cause(0x02, &[0x72, 0x04, 0x44, 0]), Some("hardware_error"));
        assert_eq!(cause(0x02, &fixed(0x05)), Some("illegal_request"));
        assert_eq!(cause(0x02, &fixed(0x02)), Some("not_ready"));
        assert_eq!(cause(0x02, &fixed(0x07)), Some("data_protect"));
        assert_eq!(cause(0x02, &fixed(0x0B)), Some("aborted_command"));
        assert_eq!(cause(0x02, &fixed(0x0E)), Some("miscompare"));
        assert_eq!(cause(0x02, &fixed(0x01)), Some("other"));
        // Sense data too short or of no known format: still an error, of no known cause.
        assert_eq!(cause(0x02, &[]), Some("other"));
        assert_eq!(cause(0x02, &[0x70, 0]), Some("other"));
        assert_eq!(cause(0x18, &[]), Some("reservation_conflict"));
        assert_eq!(cause(0x28, &[]), Some("busy"));
        assert_eq!(cause(0x08, &[]), Some("busy"));
        assert_eq!(cause(0x40, &[]), Some("other"));
    }

    #[test]
    fn initiator_series_are_bounded() {
        let m = Metrics::new();
        let io = IoCounts {
            reads: 1,
            ..IoCounts::default()
        };
        for i in 0..INITIATOR_SERIES_MAX + 10 {
            m.add_initiator_io("iqn.t", &format!("iqn.i{i}"), &io);
        }
        // A known pair keeps its own series once the bound is reached.
        m.add_initiator_io("iqn.t", "iqn.i0", &io);
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("ferrosan_initiator_reads_total{"))
            .count();
        assert_eq!(
            series,
            INITIATOR_SERIES_MAX + 1,
            "the pairs and one \"other\""
        );
        assert!(text
            .contains("ferrosan_initiator_reads_total{target=\"iqn.t\",initiator=\"other\"} 10"));
        assert!(text
            .contains("ferrosan_initiator_reads_total{target=\"iqn.t\",initiator=\"iqn.i0\"} 2"));
    }

    #[test]
    fn the_004_form_names_counters_by_their_samples_and_has_no_eof() {
        let om = "# HELP ferrosan_logins Completed logins.\n# TYPE ferrosan_logins counter\n\
                  ferrosan_logins_total{result=\"success\"} 3\n\
                  # HELP ferrosan_sessions Sessions.\n# TYPE ferrosan_sessions gauge\n\
                  ferrosan_sessions 1\n# EOF\n";
        assert_eq!(
            to_text_004(om),
            "# HELP ferrosan_logins_total Completed logins.\n# TYPE ferrosan_logins_total counter\n\
             ferrosan_logins_total{result=\"success\"} 3\n\
             # HELP ferrosan_sessions Sessions.\n# TYPE ferrosan_sessions gauge\n\
             ferrosan_sessions 1\n"
        );
        // The daemon's own exposition converts whole.
        let m = Metrics::new();
        m.login("success".into());
        let text = to_text_004(&m.render());
        assert!(
            text.contains("# TYPE ferrosan_logins_total counter"),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn latencies_fall_in_the_first_bucket_that_holds_them() {
        let mut c = LatencyCounts::default();
        for us in [0, 2, 3, 10, 11, 999, 1000, 3_000_000] {
            c.observe(Duration::from_micros(us));
        }
        // Bounds: 2.5, 5, 10, 25, ... µs, 1 ms at index 8, 2.5 s last; then +Inf.
        let mut want = [0u64; LATENCY_BOUNDS_NS.len() + 1];
        want[0] = 2; // 0 and 2 µs
        want[1] = 1; // 3 µs
        want[2] = 1; // exactly 10 µs
        want[3] = 1; // 11 µs
        want[8] = 2; // 999 µs and exactly 1 ms
        want[LATENCY_BOUNDS_NS.len()] = 1; // 3 s
        assert_eq!(c.buckets, want);
        assert_eq!(c.count, 8);
        assert_eq!(c.sum_ns, (2 + 3 + 10 + 11 + 999 + 1000 + 3_000_000) * 1000);
        // A huge value saturates the sum instead of wrapping.
        c.observe(Duration::from_secs(u64::MAX));
        assert_eq!(c.sum_ns, u64::MAX);
    }

    #[test]
    fn a_report_with_slow_commands_is_logged_once_per_interval_a_device() {
        let mut fast = LatencyCounts::default();
        fast.observe(Duration::from_millis(100));
        fast.observe(Duration::from_secs(1));
        let at = 1_000_000_000;
        assert_eq!(fast.slower_than(at), (0, None), "1 s is not slow");
        // Between two bounds, the next one up: 150 ms is judged at 250 ms.
        assert_eq!(LatencyCounts::slow_bound(150_000_000), 250_000_000);
        assert_eq!(fast.slower_than(150_000_000), (1, Some(1_000_000_000)));
        assert_eq!(fast.slower_than(100_000_000), (1, Some(1_000_000_000)));
        let mut slow = LatencyCounts::default();
        slow.observe(Duration::from_millis(1500));
        slow.observe(Duration::from_secs(2));
        slow.observe(Duration::from_millis(100));
        assert_eq!(slow.slower_than(at), (2, Some(2_500_000_000)));
        let mut stuck = LatencyCounts::default();
        stuck.observe(Duration::from_secs(30));
        assert_eq!(stuck.slower_than(at), (1, None));

        let m = Metrics::new();
        let (d, e) = (m.series("d"), m.series("e"));
        let t0 = Instant::now();
        assert!(!d.say_slow("d", "write", &fast, at, t0), "nothing slow");
        assert!(!d.say_slow("d", "write", &slow, 0, t0), "0: never");
        assert!(d.say_slow("d", "write", &slow, at, t0));
        let soon = t0 + SLOW_LOG_INTERVAL - Duration::from_millis(1);
        assert!(!d.say_slow("d", "read", &stuck, at, soon), "held back");
        assert!(
            e.say_slow("e", "write", &stuck, at, soon),
            "each device its own"
        );
        assert!(d.say_slow("d", "read", &stuck, at, t0 + SLOW_LOG_INTERVAL));
        let later = t0 + 2 * SLOW_LOG_INTERVAL;
        assert!(
            d.say_slow("d", "read", &fast, 100_000_000, later),
            "a lower threshold"
        );
    }

    #[test]
    fn bulk_histograms_add_up_and_render_cumulative_buckets() {
        let m = Metrics::new();
        let mut a = LatencyCounts::default();
        a.observe(Duration::from_micros(3));
        a.observe(Duration::from_micros(40));
        let mut b = LatencyCounts::default();
        b.observe(Duration::from_millis(7));
        m.add_latency("disk0", "write", &a);
        m.add_latency("disk0", "write", &b);
        let text = m.render();
        let series = |suffix: &str, le: Option<&str>| {
            let le = le.map(|l| format!("le=\"{l}\",")).unwrap_or_default();
            format!("ferrosan_device_latency_seconds_{suffix}{{{le}device=\"disk0\",op=\"write\"}}")
        };
        for (line, want) in [
            (series("count", None), "3"),
            (series("bucket", Some("0.0000025")), "0"),
            (series("bucket", Some("0.000005")), "1"),
            (series("bucket", Some("0.00005")), "2"),
            (series("bucket", Some("0.005")), "2"),
            (series("bucket", Some("0.01")), "3"),
            (series("bucket", Some("+Inf")), "3"),
        ] {
            assert!(
                text.contains(&format!("{line} {want}\n")),
                "{line} {want}:\n{text}"
            );
        }
        assert!(
            text.contains(&format!("{} 0.007043", series("sum", None))),
            "{text}"
        );
    }

    #[test]
    fn requests_are_routed_by_method_and_path_not_query() {
        for (line, want) in [
            (
                &b"GET /metrics HTTP/1.1"[..],
                Route::Metrics { head: false },
            ),
            (b"GET /metrics", Route::Metrics { head: false }),
            (
                b"GET /metrics?name[]=up&x=1 HTTP/1.1",
                Route::Metrics { head: false },
            ),
            (b"HEAD /metrics HTTP/1.1", Route::Metrics { head: true }),
            (b"GET /metricsx HTTP/1.1", Route::NotFound),
            (b"GET /healthz HTTP/1.1", Route::Health { head: false }),
            (b"HEAD /healthz HTTP/1.1", Route::Health { head: true }),
            (b"GET / HTTP/1.1", Route::NotFound),
            (b"POST /metrics HTTP/1.1", Route::MethodNotAllowed),
            (b"", Route::MethodNotAllowed),
        ] {
            assert_eq!(route(line), want, "{}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn renders_counters_with_labels() {
        let m = Metrics::new();
        m.limit("max_connections_per_source");
        m.limit("max_connections_per_source");
        m.login("success".into());
        m.connections.inc();
        let text = m.render();
        assert!(
            text.contains("ferrosan_limit_exceeded_total{limit=\"max_connections_per_source\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("ferrosan_logins_total{result=\"success\"} 1"),
            "{text}"
        );
        assert!(text.contains("ferrosan_connections 1"), "{text}");
        assert!(
            !text.contains("ferrosan_sessions{"),
            "no series before a session: {text}"
        );
        let t = m.sessions_of(Some("iqn.2026-11.org.ferrosan:t"));
        t.inc();
        m.sessions_of(None).inc();
        m.sessions_of(None).dec();
        let text = m.render();
        assert!(
            text.contains("ferrosan_sessions{target=\"iqn.2026-11.org.ferrosan:t\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ferrosan_sessions{target=\"discovery\"} 0"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn endpoint_serves_metrics_and_refuses_other_paths() {
        let std_listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
        let metrics = Arc::new(Metrics::new());
        metrics.limit("max_sessions");
        metrics.control_request("volume-create", "conflict");
        tokio::spawn(serve(listener, Arc::clone(&metrics)));
        let ask = |request: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("{request} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).await.unwrap();
            answer
        };
        let sample = "ferrosan_limit_exceeded_total{limit=\"max_sessions\"} 1";
        let control =
            "ferrosan_control_requests_total{verb=\"volume-create\",result=\"conflict\"} 1";
        for request in ["GET /metrics", "GET /metrics?name[]=up"] {
            let answer = ask(request).await;
            assert!(answer.contains(control), "{answer}");
            assert!(
                answer.starts_with("HTTP/1.0 200 OK") && answer.contains(sample),
                "{answer}"
            );
        }
        // HEAD says the length a GET gets. The process's own series (CPU seconds, memory)
        // may change a digit between two scrapes on a busy machine: a few tries.
        let mut same_length = None;
        for _ in 0..10 {
            let get = ask("GET /metrics").await;
            let head = ask("HEAD /metrics").await;
            let (get_head, body) = get.split_once("\r\n\r\n").unwrap();
            assert!(
                head.starts_with("HTTP/1.0 200 OK") && head.ends_with("\r\n\r\n"),
                "{head}"
            );
            if head.contains(&format!("Content-Length: {}", body.len())) {
                same_length = Some(());
                break;
            }
            eprintln!("HEAD and GET differ, asking again:\n{head}\n{get_head}");
        }
        assert!(same_length.is_some(), "HEAD never gave a GET's length");
        assert!(ask("GET /other").await.starts_with("HTTP/1.0 404"));
        let post = ask("POST /metrics").await;
        assert!(
            post.starts_with("HTTP/1.0 405") && post.contains("Allow: GET, HEAD"),
            "{post}"
        );
    }
}
