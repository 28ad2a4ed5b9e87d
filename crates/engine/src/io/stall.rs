//! Write stalls: keeping the page cache's waits off the network workers.
//!
//! A buffered (write-back, non-FUA) write to a disk-backed device costs a copy into the page
//! cache — about 0.25 µs per KiB on the reference VM — so it runs inline on the network worker:
//! handing it to a thread costs ~10 µs, and io_uring punts such writes to its own kernel threads
//! (13 µs of CPU per 4 KiB write measured, against 2.7 µs inline). But the kernel can make a
//! buffered write wait: the filesystem's own writeback of the file holding its block-allocation
//! lock, dirty-page throttling, a journal commit, reclaim. A waiting worker stalls every
//! connection it owns. Measured (ext4, sustained 1 MiB writes): 0.26 ms per write until
//! background writeback of the file starts (~500 MB dirty), 1.46 ms after — 65% of the worker's
//! time asleep in `pwrite`, in `ext4_da_get_block_prep` waiting for `i_data_sem`, held (most
//! likely) by the flusher allocating blocks for the same file.
//!
//! So every buffered write to such a device is timed, and the engine notes whether its thread
//! slept in the kernel meanwhile (a voluntary context switch). One that blocked *and* took much
//! longer than a copy (see [`WriteStalls::threshold`]) marks the device as stalling; time alone
//! is not enough: on a busy 2-core machine a preempted write looks just as slow, and offloading
//! such writes made 4 KiB writes cost 50–62 µs of target CPU each instead of 22 (A/B on ext4).
//! For the next [`HOLD`] a stalling device's buffered writes run on the blocking pool, where
//! they are checked the same way, so the hold lasts as long as the writes keep stalling and
//! lapses [`HOLD`] after the last stall. One write per episode waits on a worker; the rest wait
//! on pool threads.
//!
//! The state is per device and shared by every worker writing to it (one atomic deadline): the
//! page cache's pressure is a property of the device's filesystem, not of a connection.

use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long buffered writes stay off the workers after the last stall.
pub const HOLD: Duration = Duration::from_secs(1);
/// Allowance per KiB written on top of the base: ~3× the copy cost measured without contention
/// (0.26 ms per MiB) and below the cost while the flusher writes the file back (1.4 ms per MiB).
pub const ALLOWANCE_PER_KIB: Duration = Duration::from_nanos(800);

/// One device's stall state.
pub struct WriteStalls {
    /// Origin of the nanosecond deadline below (an `Instant` does not fit in an atomic).
    epoch: Instant,
    /// Fixed part of the threshold; zero means every buffered write runs off the workers.
    base: Duration,
    /// Until when (ns after `epoch`) buffered writes run on the blocking pool.
    offload_until_ns: AtomicU64,
    stalls: Counter,
    offloaded: Counter,
}

impl WriteStalls {
    /// `base` is the `write_stall_us` limit. The counters are the device's metrics.
    pub fn new(epoch: Instant, base: Duration, stalls: Counter, offloaded: Counter) -> Self {
        WriteStalls {
            epoch,
            base,
            offload_until_ns: AtomicU64::new(0),
            stalls,
            offloaded,
        }
    }

    /// The longest a buffered write of `bytes` may take before it counts as a stall.
    pub fn threshold(&self, bytes: usize) -> Duration {
        let kib = u32::try_from(bytes / 1024).unwrap_or(u32::MAX);
        self.base
            .saturating_add(ALLOWANCE_PER_KIB.saturating_mul(kib))
    }

    /// Whether buffered writes should run off the network workers now.
    pub fn offloading(&self, now: Instant) -> bool {
        self.base.is_zero() || self.nanos(now) < self.offload_until_ns.load(Ordering::Relaxed)
    }

    /// Counts a buffered write handed to the blocking pool.
    pub fn offloaded(&self) {
        self.offloaded.inc();
    }

    /// Records that a buffered write of `bytes` took `elapsed`, finishing at `now`; `blocked`:
    /// the thread slept in the kernel meanwhile (a voluntary context switch). Only a write that
    /// blocked *and* was slow stalled: one that was merely preempted on a busy machine took long
    /// for want of a CPU, which another thread would not have had either. Returns true when it
    /// stalled (the device's writes then stay off the workers until `now + HOLD`).
    pub fn record(&self, bytes: usize, elapsed: Duration, blocked: bool, now: Instant) -> bool {
        if !blocked || elapsed <= self.threshold(bytes) {
            return false;
        }
        self.stalls.inc();
        let until = self.nanos(now).saturating_add(HOLD.as_nanos() as u64);
        self.offload_until_ns.fetch_max(until, Ordering::Relaxed);
        true
    }

    fn nanos(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    #[cfg(test)]
    fn counts(&self) -> (u64, u64) {
        (self.stalls.get(), self.offloaded.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn stalls(base_us: u64) -> (WriteStalls, Instant) {
        let epoch = Instant::now();
        let s = WriteStalls::new(
            epoch,
            Duration::from_micros(base_us),
            Counter::default(),
            Counter::default(),
        );
        (s, epoch)
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn threshold_is_base_plus_allowance_per_kib() {
        let (s, _) = stalls(100);
        assert_eq!(s.threshold(0), us(100));
        assert_eq!(s.threshold(1023), us(100), "partial KiB gets no allowance");
        assert_eq!(s.threshold(4096), us(100) + Duration::from_nanos(3_200));
        assert_eq!(s.threshold(MIB), us(100) + Duration::from_nanos(819_200));
        // Absurd sizes saturate instead of overflowing.
        assert!(s.threshold(usize::MAX) >= s.threshold(MIB));
    }

    #[test]
    fn measured_costs_classify_as_measured() {
        let (s, epoch) = stalls(100);
        // Uncontended: 4 KiB in ~3 µs, 1 MiB in 0.26 ms (p99 0.32 ms).
        assert!(!s.record(4096, us(3), true, epoch));
        assert!(!s.record(MIB, us(320), true, epoch));
        assert!(!s.offloading(epoch));
        // Behind the flusher: 1 MiB in 1.46 ms.
        assert!(s.record(MIB, us(1_460), true, epoch));
        assert!(s.offloading(epoch));
        assert_eq!(s.counts(), (1, 0));
    }

    #[test]
    fn a_slow_write_that_never_blocked_is_not_a_stall() {
        let (s, epoch) = stalls(100);
        // Preempted for 5 ms on a busy machine, but never asleep in the kernel.
        assert!(!s.record(MIB, us(5_000), false, epoch));
        assert!(!s.record(4096, us(5_000), false, epoch));
        assert!(!s.offloading(epoch));
        assert_eq!(s.counts(), (0, 0));
        // Blocked but fast (a short lock wait): not a stall either.
        assert!(!s.record(MIB, us(300), true, epoch));
        assert!(!s.offloading(epoch));
    }

    #[test]
    fn small_write_stall_starts_the_hold() {
        let (s, epoch) = stalls(100);
        let t = epoch + us(5_000);
        assert!(s.record(4096, us(2_000), true, t), "a 2 ms journal wait");
        assert!(s.offloading(t));
        assert!(s.offloading(t + HOLD - us(1)));
        assert!(!s.offloading(t + HOLD), "the hold lapses");
    }

    #[test]
    fn offloaded_stalls_extend_the_hold_and_fast_writes_do_not() {
        let (s, epoch) = stalls(100);
        assert!(s.record(MIB, us(5_000), true, epoch));
        // Timed on the pool: another stall half-way pushes the end out.
        let mid = epoch + HOLD / 2;
        assert!(s.record(MIB, us(5_000), true, mid));
        assert!(s.offloading(epoch + HOLD));
        assert!(!s.offloading(mid + HOLD));
        // Fast writes while offloading leave the deadline alone.
        assert!(!s.record(MIB, us(200), true, mid + HOLD / 2));
        assert!(!s.offloading(mid + HOLD));
    }

    #[test]
    fn an_older_stall_reported_late_never_shortens_the_hold() {
        let (s, epoch) = stalls(100);
        let late = epoch + us(900_000);
        assert!(s.record(4096, us(1_000), true, late));
        // A pool thread finishing a write that began earlier reports an earlier `now`.
        assert!(s.record(4096, us(1_000), true, epoch + us(10)));
        assert!(s.offloading(late + HOLD - us(1)));
    }

    #[test]
    fn zero_base_always_offloads() {
        let (s, epoch) = stalls(0);
        assert!(s.offloading(epoch));
        assert!(s.offloading(epoch + Duration::from_secs(3_600)));
        // It still counts real stalls.
        assert!(!s.record(MIB, us(100), true, epoch));
        assert!(s.record(MIB, us(1_000), true, epoch));
        s.offloaded();
        assert_eq!(s.counts(), (1, 1));
    }

    #[test]
    fn a_clock_before_the_epoch_is_not_a_panic() {
        let (s, epoch) = stalls(100);
        let before = epoch.checked_sub(us(10)).unwrap_or(epoch);
        assert!(!s.offloading(before));
        assert!(s.record(4096, us(1_000), true, before));
        assert!(s.offloading(before));
    }
}
