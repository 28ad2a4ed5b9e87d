//! Group commit of one file's durable writes (sans-IO: the connection's ring does the I/O).
//!
//! A durable write (write-through LU, or FUA) goes to the device as a plain O_DIRECT write;
//! when it completes it waits here, and one fdatasync — started as soon as none is running —
//! makes every write that completed before it durable, and answers them all. Writes that
//! complete while a flush runs wait for the next one, which starts when it ends. So no write
//! is answered before a flush that started after it completed.
//!
//! Why: RWF_DSYNC on every write costs one device cache flush per write on a disk without
//! FUA (virtio, most SATA SSDs). At QD64 on this machine's disk one flush covered ~35 writes
//! and the machine's CPU per 4 KiB write-through write fell by ~21 % (measured 2026-11-25,
//! docs/PERFORMANCE-LOG.md).
//!
//! A durable write with no other of its file in flight, waiting or being flushed goes with
//! RWF_DSYNC instead: at QD1 the flush as a second I/O would add a trip through the event loop
//! (4 KiB writes QD1: 266–284 µs grouped against 218–233 µs with RWF_DSYNC).

/// How a durable write is made durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// RWF_DSYNC: durable when its I/O completes; answered then.
    Dsync,
    /// A plain write, answered after the group flush that follows its completion.
    Grouped,
}

/// The durable writes of one file on a connection's ring; `W` is what answers a write.
#[derive(Debug)]
pub struct GroupCommit<W> {
    /// Durable writes sent to the device and not completed (either kind).
    writes_in_flight: usize,
    /// Completed grouped writes, waiting for the next flush.
    waiting: Vec<W>,
    /// Completed grouped writes the flush in flight covers.
    flushing: Vec<W>,
    flush_in_flight: bool,
}

impl<W> Default for GroupCommit<W> {
    fn default() -> Self {
        GroupCommit {
            writes_in_flight: 0,
            waiting: Vec::new(),
            flushing: Vec::new(),
            flush_in_flight: false,
        }
    }
}

impl<W> GroupCommit<W> {
    /// How the next durable write should go: alone, with RWF_DSYNC; else grouped.
    pub fn durability(&self) -> Durability {
        if self.writes_in_flight == 0 && self.waiting.is_empty() && !self.flush_in_flight {
            Durability::Dsync
        } else {
            Durability::Grouped
        }
    }

    /// A durable write went to the device (with the durability [`Self::durability`] gave).
    pub fn sent(&mut self) {
        self.writes_in_flight += 1;
    }

    /// A durable write's I/O completed. Returns it when it is to be answered now (RWF_DSYNC,
    /// or a failed write: no flush makes a failed write good); a grouped write that succeeded
    /// waits for its flush.
    pub fn completed(&mut self, write: W, how: Durability, ok: bool) -> Option<W> {
        self.writes_in_flight = self.writes_in_flight.saturating_sub(1);
        match (how, ok) {
            (Durability::Grouped, true) => {
                self.waiting.push(write);
                None
            }
            _ => Some(write),
        }
    }

    /// Starts a flush when writes wait and none runs: the waiting writes are then covered by
    /// it. True when the caller must now send one fdatasync of the file.
    pub fn start_flush(&mut self) -> bool {
        if self.flush_in_flight || self.waiting.is_empty() {
            return false;
        }
        self.flush_in_flight = true;
        self.flushing = std::mem::take(&mut self.waiting);
        true
    }

    /// The flush [`Self::start_flush`] asked for could not be sent: the writes it was to
    /// cover, for the caller to make durable another way and answer.
    pub fn flush_not_sent(&mut self) -> Vec<W> {
        self.flush_in_flight = false;
        std::mem::take(&mut self.flushing)
    }

    /// The flush completed (well or not): the writes it covers, to be answered with its
    /// result.
    pub fn flush_done(&mut self) -> Vec<W> {
        self.flush_in_flight = false;
        std::mem::take(&mut self.flushing)
    }

    /// Nothing in flight, waiting or being flushed.
    pub fn is_idle(&self) -> bool {
        self.writes_in_flight == 0
            && self.waiting.is_empty()
            && self.flushing.is_empty()
            && !self.flush_in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_write_goes_dsync_and_is_answered_when_it_completes() {
        let mut g = GroupCommit::default();
        assert_eq!(g.durability(), Durability::Dsync);
        g.sent();
        assert_eq!(g.completed(1, Durability::Dsync, true), Some(1));
        assert!(!g.start_flush());
        assert!(g.is_idle());
    }

    #[test]
    fn writes_beside_another_are_grouped_and_answered_by_the_flush_after_them() {
        let mut g = GroupCommit::default();
        g.sent();
        assert_eq!(g.durability(), Durability::Grouped);
        g.sent();
        g.sent();
        assert_eq!(g.completed(1, Durability::Dsync, true), Some(1));
        assert_eq!(g.completed(2, Durability::Grouped, true), None);
        assert!(g.start_flush());
        // Completed while the flush runs: not covered by it.
        assert_eq!(g.completed(3, Durability::Grouped, true), None);
        assert!(!g.start_flush(), "one flush at a time");
        assert_eq!(g.durability(), Durability::Grouped);
        assert_eq!(g.flush_done(), vec![2]);
        assert!(g.start_flush());
        assert_eq!(g.flush_done(), vec![3]);
        assert!(g.is_idle());
        assert_eq!(g.durability(), Durability::Dsync);
    }

    #[test]
    fn a_failed_grouped_write_is_answered_at_once() {
        let mut g = GroupCommit::default();
        g.sent();
        g.sent();
        assert_eq!(g.completed(7, Durability::Grouped, false), Some(7));
        assert!(!g.start_flush());
    }

    #[test]
    fn a_flush_that_could_not_be_sent_hands_its_writes_back() {
        let mut g = GroupCommit::default();
        g.sent();
        g.sent();
        assert_eq!(g.completed(1, Durability::Grouped, true), None);
        assert_eq!(g.completed(2, Durability::Grouped, true), None);
        assert!(g.start_flush());
        assert_eq!(g.flush_not_sent(), vec![1, 2]);
        assert!(g.is_idle());
    }

    /// Random interleavings of sends, completions (some failing), flush starts and flush
    /// completions, checked against the rule: every write is answered exactly once, a
    /// grouped write that succeeded only by a flush that started after it completed, and
    /// RWF_DSYNC only for a write with nothing else of its file under way.
    #[test]
    fn every_write_is_answered_once_and_never_before_a_flush_that_followed_it() {
        #[derive(Debug)]
        struct Write {
            id: usize,
            completed_at: usize,
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _round in 0..500 {
            let mut g: GroupCommit<Write> = GroupCommit::default();
            let mut in_flight: Vec<(usize, Durability)> = Vec::new();
            let mut answered: Vec<bool> = Vec::new();
            let mut flush_started_at: Option<usize> = None;
            let mut now = 0;
            let answer = |w: Write, answered: &mut Vec<bool>| {
                assert!(!answered[w.id], "write {} answered twice", w.id);
                answered[w.id] = true;
            };
            let steps = 20 + next(200);
            for step in 0..steps + 1000 {
                now += 1;
                let draining = step >= steps;
                match next(4) {
                    0 if !draining => {
                        let how = g.durability();
                        if how == Durability::Dsync {
                            assert!(in_flight.is_empty() && flush_started_at.is_none());
                        }
                        g.sent();
                        answered.push(false);
                        in_flight.push((answered.len() - 1, how));
                    }
                    1 | 0 if !in_flight.is_empty() => {
                        let (id, how) = in_flight.swap_remove(next(in_flight.len()));
                        let ok = next(10) != 0;
                        let w = Write {
                            id,
                            completed_at: now,
                        };
                        if let Some(w) = g.completed(w, how, ok) {
                            assert!(how == Durability::Dsync || !ok);
                            answer(w, &mut answered);
                        }
                    }
                    2 => {
                        if g.start_flush() {
                            assert!(flush_started_at.is_none());
                            flush_started_at = Some(now);
                        }
                    }
                    _ => {
                        if let Some(started) = flush_started_at.take() {
                            for w in g.flush_done() {
                                assert!(w.completed_at < started, "{w:?} flushed at {started}");
                                answer(w, &mut answered);
                            }
                        }
                    }
                }
            }
            // Drain: let the last flush finish and run one for what still waits.
            if flush_started_at.take().is_some() {
                for w in g.flush_done() {
                    answer(w, &mut answered);
                }
            }
            if g.start_flush() {
                for w in g.flush_done() {
                    answer(w, &mut answered);
                }
            }
            assert!(in_flight.is_empty());
            assert!(g.is_idle(), "{g:?}");
            assert!(answered.iter().all(|&a| a), "every write answered");
        }
    }
}
