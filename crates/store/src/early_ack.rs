//! Writes answered before the backend has them: what a store with a write-back cache owes the
//! initiator afterwards.
//!
//! With the write cache enabled (WCE=1) SCSI lets a device answer a WRITE before its data is
//! on stable storage, as long as SYNCHRONIZE CACHE makes everything answered before it durable
//! and reports a write that failed after its answer. [`EarlyAcks`] keeps that account for a
//! store that answers early:
//! - which such writes are still in flight and where: a read or write overlapping one waits
//!   until it is over (the initiator believes it done; nothing may overtake it), a flush waits
//!   for the ones answered before it and not for later ones;
//! - how much they hold, bounded in bytes and in count (past either bound a write is answered
//!   when it is done);
//! - the first failure since the last report: the next flush reports it once, as a write error
//!   (never as a retryable condition, which would let a retried flush succeed over lost data),
//!   and until then no write is answered early.
//!
//! Sans-IO apart from a mutex: the store calls [`EarlyAcks::begin`] before it answers a write
//! early, [`EarlyAcks::end`] from the write's completion, [`EarlyAcks::overlapping`] before
//! any other read or write, and [`EarlyAcks::after_earlier`] with what waits.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// What runs once the early writes it waits for have ended.
pub type Waiter = Box<dyn FnOnce() + Send>;

/// Bytes of early-answered writes one store holds in flight at most (librbd's own write-around
/// cache allows 24 MiB by default, `rbd_cache_max_dirty`).
pub const EARLY_BYTES_MAX: usize = 32 << 20;
/// Early-answered writes one store holds in flight at most: the byte bound in 4 KiB writes, so
/// that, like librbd's cache (which bounds only bytes), 4 KiB writes meet the byte bound first;
/// it bounds the account's bookkeeping for smaller ones. (With 1024, 4 KiB random writes at
/// QD32 on an OSD-bound cluster kept the account full; with this, 2-3 K were in flight. Whether
/// that changed the OSD's rate could not be told apart from its drift: docs/RBD.md, *Speed*.)
pub const EARLY_WRITES_MAX: usize = 8192;
/// The largest write answered early; larger ones are answered when done. Also bounds the
/// search for overlaps.
pub const EARLY_WRITE_BYTES_MAX: u64 = 4 << 20;

#[derive(Default)]
pub struct EarlyAcks {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Sequence number → (offset, length) of the writes answered early and not yet done.
    in_flight: BTreeMap<u64, (u64, u64)>,
    /// The same writes by (offset, sequence number) → length, for finding overlaps.
    by_offset: BTreeMap<(u64, u64), u64>,
    bytes: u64,
    /// The first failure of an early-answered write since the last [`EarlyAcks::take_lost`].
    lost: Option<String>,
    /// Waiting for every early write numbered below theirs to end.
    waiters: Vec<(u64, Waiter)>,
}

impl State {
    fn oldest(&self) -> u64 {
        self.in_flight.keys().next().copied().unwrap_or(u64::MAX)
    }
}

impl EarlyAcks {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A write of `len` bytes at `offset` may be answered now: its number, for
    /// [`EarlyAcks::end`]. `None`: answer it when it is done (too large, a bound reached, a
    /// lost write not yet reported, or it overlaps an early write still in flight; the caller
    /// checks [`EarlyAcks::overlapping`] first).
    pub fn begin(&self, offset: u64, len: u64) -> Option<u64> {
        let mut s = self.state();
        if len > EARLY_WRITE_BYTES_MAX
            || s.lost.is_some()
            || s.in_flight.len() >= EARLY_WRITES_MAX
            || (!s.in_flight.is_empty() && s.bytes.saturating_add(len) > EARLY_BYTES_MAX as u64)
            || overlaps(&s, offset, len)
        {
            return None;
        }
        let seq = s.next;
        s.next += 1;
        s.in_flight.insert(seq, (offset, len));
        s.by_offset.insert((offset, seq), len);
        s.bytes += len;
        Some(seq)
    }

    /// The early write `seq` is over, with `failure` if it did not reach the backend; whatever
    /// waited only for it (and earlier ones) goes on, on this thread.
    pub fn end(&self, seq: u64, failure: Option<String>) {
        let ready = {
            let mut s = self.state();
            let Some((offset, len)) = s.in_flight.remove(&seq) else {
                debug_assert!(false, "early write {seq} ended twice or never began");
                return;
            };
            s.by_offset.remove(&(offset, seq));
            s.bytes -= len;
            if s.lost.is_none() {
                s.lost = failure;
            }
            let oldest = s.oldest();
            let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut s.waiters)
                .into_iter()
                .partition(|(barrier, _)| *barrier <= oldest);
            s.waiters = waiting;
            ready
        };
        // Outside the lock: a waiter submits or answers a command, which may begin a write.
        for (_, waiter) in ready {
            waiter();
        }
    }

    /// Whether `[offset, offset + len)` overlaps an early write still in flight: then the
    /// barrier to wait for with [`EarlyAcks::after_earlier`] before touching it.
    pub fn overlapping(&self, offset: u64, len: u64) -> Option<u64> {
        let s = self.state();
        overlaps(&s, offset, len).then_some(s.next)
    }

    /// The number a flush starting now waits up to: the writes answered before it.
    pub fn barrier(&self) -> u64 {
        self.state().next
    }

    /// Runs `waiter` once no early write numbered below `barrier` is in flight: now, on this
    /// thread, if none is; otherwise on the thread that ends the last of them.
    pub fn after_earlier(&self, barrier: u64, waiter: Waiter) {
        {
            let mut s = self.state();
            if s.oldest() < barrier {
                s.waiters.push((barrier, waiter));
                return;
            }
        }
        waiter();
    }

    /// Blocks until every early write answered before now has ended (synchronous callers).
    pub fn drain(&self) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.after_earlier(
            self.barrier(),
            Box::new(move || {
                let _ = tx.send(());
            }),
        );
        // The waiter always runs: every early write ends exactly once.
        let _ = rx.recv();
    }

    /// The first failure of an early-answered write since the last call, reported once.
    pub fn take_lost(&self) -> Option<String> {
        self.state().lost.take()
    }

    /// Early-answered writes in flight, and their bytes, read together.
    pub fn in_flight(&self) -> crate::WriteBack {
        let s = self.state();
        crate::WriteBack {
            bytes: s.bytes,
            writes: s.in_flight.len() as u64,
        }
    }
}

/// Whether `[offset, offset + len)` meets an in-flight early write. Every early write is at
/// most [`EARLY_WRITE_BYTES_MAX`] long, so only those starting that far before can reach in.
fn overlaps(s: &State, offset: u64, len: u64) -> bool {
    if s.in_flight.is_empty() || len == 0 {
        return false;
    }
    let end = offset.saturating_add(len);
    let from = offset.saturating_sub(EARLY_WRITE_BYTES_MAX - 1);
    s.by_offset
        .range((from, 0)..(end, 0))
        .any(|(&(start, _), &l)| start.saturating_add(l) > offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn counter() -> (Arc<AtomicUsize>, impl Fn() -> Waiter) {
        let runs = Arc::new(AtomicUsize::new(0));
        let make = {
            let runs = Arc::clone(&runs);
            move || -> Waiter {
                let runs = Arc::clone(&runs);
                Box::new(move || {
                    runs.fetch_add(1, Ordering::SeqCst);
                })
            }
        };
        (runs, make)
    }

    #[test]
    fn a_flush_waits_for_the_writes_answered_before_it_and_not_for_later_ones() {
        let acks = EarlyAcks::default();
        let (runs, waiter) = counter();
        // Nothing in flight: the flush goes on at once.
        acks.after_earlier(acks.barrier(), waiter());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let a = acks.begin(0, 4096).unwrap();
        let b = acks.begin(4096, 4096).unwrap();
        let barrier = acks.barrier();
        let c = acks.begin(8192, 4096).unwrap(); // answered after the flush started
        acks.after_earlier(barrier, waiter());
        acks.end(b, None);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "a is still in flight");
        acks.end(a, None);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "c came later: not waited for"
        );
        acks.end(c, None);
        assert_eq!(acks.in_flight(), crate::WriteBack::default());
        assert_eq!(acks.take_lost(), None);
    }

    #[test]
    fn a_lost_write_is_reported_once_the_first_failure_kept_and_none_answered_early_meanwhile() {
        let acks = EarlyAcks::default();
        let a = acks.begin(0, 512).unwrap();
        let b = acks.begin(512, 512).unwrap();
        acks.end(a, Some("first".into()));
        assert_eq!(acks.begin(4096, 512), None, "a loss not yet reported");
        acks.end(b, Some("second".into()));
        assert_eq!(acks.take_lost().as_deref(), Some("first"));
        assert_eq!(acks.take_lost(), None, "reported once");
        assert!(
            acks.begin(4096, 512).is_some(),
            "reported: early answers again"
        );
    }

    #[test]
    fn early_bytes_and_writes_are_bounded_and_large_writes_never_answered_early() {
        let acks = EarlyAcks::default();
        assert_eq!(acks.begin(0, EARLY_WRITE_BYTES_MAX + 1), None);
        let step = EARLY_WRITE_BYTES_MAX;
        let fill = (EARLY_BYTES_MAX as u64 / step) as usize;
        let seqs: Vec<u64> = (0..fill)
            .map(|i| acks.begin(i as u64 * step, step).unwrap())
            .collect();
        assert_eq!(acks.in_flight().bytes, EARLY_BYTES_MAX as u64);
        assert_eq!(acks.begin(1 << 40, 1), None, "past the byte bound");
        acks.end(seqs[0], None);
        assert!(acks.begin(1 << 40, 1).is_some());
        for &seq in &seqs[1..] {
            acks.end(seq, None);
        }

        let acks = EarlyAcks::default();
        for i in 0..EARLY_WRITES_MAX as u64 {
            acks.begin(i * 512, 512).unwrap();
        }
        assert_eq!(acks.begin(1 << 40, 512), None, "past the count bound");
    }

    #[test]
    fn overlaps_are_found_at_every_edge_and_only_while_in_flight() {
        let acks = EarlyAcks::default();
        let big = acks.begin(10 << 20, EARLY_WRITE_BYTES_MAX).unwrap();
        let small = acks.begin(100, 50).unwrap();
        let end_big = (10 << 20) + EARLY_WRITE_BYTES_MAX;
        for (offset, len, hit) in [
            (0u64, 100u64, false),      // ends where `small` starts
            (0, 101, true),             // its first byte
            (149, 1, true),             // its last byte
            (150, 1000, false),         // starts where it ends
            (120, 5, true),             // inside
            (0, u64::MAX, true),        // everything
            (10 << 20, 1, true),        // the big one's first byte
            (end_big - 1, 1, true),     // its last byte, found from 4 MiB back
            (end_big, 4096, false),     // just after
            ((10 << 20) - 1, 1, false), // just before
            (u64::MAX - 1, 1, false),   // the end of the range space
            (120, 0, false),            // nothing
        ] {
            assert_eq!(
                acks.overlapping(offset, len).is_some(),
                hit,
                "{offset}+{len}"
            );
        }
        assert_eq!(
            acks.begin(120, 8),
            None,
            "a write over an early one is not early"
        );
        acks.end(small, None);
        acks.end(big, None);
        assert_eq!(acks.overlapping(0, u64::MAX), None);
    }

    #[test]
    fn an_overlapping_read_waits_for_the_early_write_under_it() {
        let acks = EarlyAcks::default();
        let (runs, waiter) = counter();
        let a = acks.begin(0, 4096).unwrap();
        let b = acks.begin(1 << 20, 4096).unwrap();
        let barrier = acks.overlapping(2048, 512).expect("overlaps a");
        acks.after_earlier(barrier, waiter());
        acks.end(b, None);
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        acks.end(a, None);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn waiters_run_outside_the_lock_and_drain_returns_once_earlier_writes_end() {
        // A waiter that begins a write (an answer that lets the next command run) must not
        // deadlock on the account.
        let acks = Arc::new(EarlyAcks::default());
        let a = acks.begin(0, 8).unwrap();
        let inner = Arc::clone(&acks);
        acks.after_earlier(
            acks.barrier(),
            Box::new(move || {
                let seq = inner.begin(0, 8).unwrap();
                inner.end(seq, None);
            }),
        );
        acks.end(a, None);
        assert_eq!(acks.in_flight().bytes, 0);

        acks.drain(); // nothing in flight: returns at once
        let b = acks.begin(0, 8).unwrap();
        let ender = {
            let acks = Arc::clone(&acks);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                acks.end(b, None);
            })
        };
        acks.drain();
        assert_eq!(acks.in_flight().writes, 0, "drained only after b ended");
        ender.join().unwrap();
    }
}
