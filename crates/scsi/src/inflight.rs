//! Commands of one logical unit that may still reach its medium, so that task management can
//! answer only once their effect is settled (SAM-5 §7.6, RFC 7143 §11.5.1): a LOGICAL UNIT
//! RESET answered while a write still runs would let that old write land after a new one the
//! initiator sends next, perhaps through another path.
//!
//! Every command holds an [`IoGuard`] while it runs (inline on a network worker, or handed to
//! an I/O thread, from the moment it is handed over). A reset closes the gate (no new command
//! starts), waits until the count is zero, applies its effects and opens the gate again.
//! Commands that meet a closed gate are declined on the network worker and wait on an I/O
//! thread ([`InFlight::begin_blocking`]), so a worker never waits for a reset.
//!
//! The count is sharded: a command adds and removes one on its own shard (chosen by its
//! nexus), so sessions on different workers do not contend for one cache line; a reset sums
//! the shards. The gate check after the increment and the reset's sum after closing the gate
//! are both sequentially consistent, so either the command sees the closed gate or the reset
//! sees the command (Dekker's pairing).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};

/// Shards of the count; more than any machine's workers would only waste memory.
const SHARDS: usize = 16;

#[repr(align(64))]
#[derive(Default)]
struct Shard(AtomicUsize);

#[derive(Default)]
pub struct InFlight {
    shards: [Shard; SHARDS],
    /// Resets in progress (several sessions may reset one LU at once); the gate is closed
    /// while this is non-zero.
    resets: AtomicU32,
    /// Commands waiting for the gate to open.
    gate: Mutex<()>,
    opened: Condvar,
    /// Resets waiting for the count to reach zero.
    drained: Mutex<Vec<Waker>>,
}

/// One command's hold on its LU; dropping it ends the hold.
pub struct IoGuard<'a> {
    inflight: &'a InFlight,
    shard: usize,
}

/// An [`IoGuard`] that can move to another thread with its command.
pub struct OwnedIoGuard {
    inflight: Arc<InFlight>,
    shard: usize,
}

impl InFlight {
    fn shard_of(nexus_id: u64) -> usize {
        (nexus_id % SHARDS as u64) as usize
    }

    /// Starts a command of nexus `nexus_id` unless a reset is in progress.
    pub fn try_begin(&self, nexus_id: u64) -> Option<IoGuard<'_>> {
        let shard = Self::shard_of(nexus_id);
        // `then`, not `then_some`: a guard built eagerly would be dropped on refusal, leaving
        // a command that never entered.
        self.enter(shard).then(|| IoGuard {
            inflight: self,
            shard,
        })
    }

    /// Like [`InFlight::try_begin`], for a command handed to another thread.
    pub fn try_begin_owned(self: &Arc<Self>, nexus_id: u64) -> Option<OwnedIoGuard> {
        let shard = Self::shard_of(nexus_id);
        self.enter(shard).then(|| OwnedIoGuard {
            inflight: Arc::clone(self),
            shard,
        })
    }

    /// Starts a command, waiting (on an I/O thread, never a network worker) while a reset is
    /// in progress.
    pub fn begin_blocking(self: &Arc<Self>, nexus_id: u64) -> OwnedIoGuard {
        loop {
            if let Some(guard) = self.try_begin_owned(nexus_id) {
                return guard;
            }
            let gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
            // Re-checked under the lock `end_reset` notifies under: no wake-up is missed.
            if self.resets.load(SeqCst) != 0 {
                drop(self.opened.wait(gate).unwrap_or_else(|e| e.into_inner()));
            }
        }
    }

    fn enter(&self, shard: usize) -> bool {
        let count = &self.shards[shard].0;
        count.fetch_add(1, SeqCst);
        if self.resets.load(SeqCst) == 0 {
            return true;
        }
        self.leave(shard);
        false
    }

    fn leave(&self, shard: usize) {
        let before = self.shards[shard].0.fetch_sub(1, SeqCst);
        debug_assert!(before > 0, "a command left that never entered");
        if self.resets.load(SeqCst) != 0 && self.count() == 0 {
            let wakers =
                std::mem::take(&mut *self.drained.lock().unwrap_or_else(|e| e.into_inner()));
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    /// Commands running now.
    pub fn count(&self) -> usize {
        self.shards.iter().map(|s| s.0.load(SeqCst)).sum()
    }

    /// Closes the gate: commands not yet started wait until [`InFlight::end_reset`].
    pub fn start_reset(&self) {
        self.resets.fetch_add(1, SeqCst);
    }

    /// Ready once every command started before the gate closed has finished. Only meaningful
    /// between [`InFlight::start_reset`] and [`InFlight::end_reset`].
    pub fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        debug_assert!(self.resets.load(SeqCst) > 0, "polled without a reset");
        if self.count() == 0 {
            return Poll::Ready(());
        }
        let mut wakers = self.drained.lock().unwrap_or_else(|e| e.into_inner());
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        drop(wakers);
        // A command that left between the first check and the registration found no waker.
        if self.count() == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Ends one reset; the gate opens when no other reset is in progress.
    pub fn end_reset(&self) {
        let before = self.resets.fetch_sub(1, SeqCst);
        assert!(before > 0, "end_reset without start_reset");
        if before == 1 {
            let _gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
            self.opened.notify_all();
        }
    }

    /// Whether a reset is in progress (the gate is closed).
    pub fn resetting(&self) -> bool {
        self.resets.load(SeqCst) != 0
    }
}

impl Drop for IoGuard<'_> {
    fn drop(&mut self) {
        self.inflight.leave(self.shard);
    }
}

impl Drop for OwnedIoGuard {
    fn drop(&mut self) {
        self.inflight.leave(self.shard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::task::Wake;
    use std::time::Duration;

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, SeqCst);
        }
    }

    #[test]
    fn a_reset_waits_for_running_commands_and_holds_new_ones() {
        let lu = Arc::new(InFlight::default());
        let running = lu.try_begin_owned(1).unwrap();
        let inline = lu.try_begin(2).unwrap();
        assert_eq!(lu.count(), 2);
        lu.start_reset();
        assert!(lu.try_begin(3).is_none(), "the gate is closed");
        assert_eq!(lu.count(), 2, "a refused command leaves no trace");
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(Arc::clone(&flag));
        let mut cx = Context::from_waker(&waker);
        assert!(lu.poll_drained(&mut cx).is_pending());
        drop(inline);
        assert!(!flag.0.load(SeqCst), "one command still runs");
        assert!(lu.poll_drained(&mut cx).is_pending());
        // A command waiting for the gate, on another thread.
        let waiter = {
            let lu = Arc::clone(&lu);
            std::thread::spawn(move || drop(lu.begin_blocking(4)))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "held while the reset runs");
        drop(running);
        assert!(flag.0.load(SeqCst), "the last command wakes the reset");
        assert!(lu.poll_drained(&mut cx).is_ready());
        lu.end_reset();
        waiter.join().unwrap();
        assert_eq!(lu.count(), 0);
        assert!(lu.try_begin(5).is_some());
    }

    #[test]
    fn overlapping_resets_keep_the_gate_closed_until_the_last_ends() {
        let lu = InFlight::default();
        lu.start_reset();
        lu.start_reset();
        lu.end_reset();
        assert!(lu.resetting());
        assert!(lu.try_begin(1).is_none());
        lu.end_reset();
        assert!(!lu.resetting());
        assert!(lu.try_begin(1).is_some());
    }

    /// Racing commands and a reset: whenever the reset sees the count at zero, no command is
    /// running (each command checks that, via a second counter, inside its hold).
    #[test]
    fn no_command_runs_once_a_reset_has_drained() {
        let lu = Arc::new(InFlight::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..3u64)
            .map(|id| {
                let (lu, inside, stop) = (Arc::clone(&lu), Arc::clone(&inside), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(SeqCst) {
                        if let Some(_g) = lu.try_begin(id) {
                            inside.fetch_add(1, SeqCst);
                            std::hint::spin_loop();
                            inside.fetch_sub(1, SeqCst);
                        }
                    }
                })
            })
            .collect();
        for _ in 0..2000 {
            lu.start_reset();
            while lu.count() != 0 {
                std::hint::spin_loop();
            }
            assert_eq!(
                inside.load(SeqCst),
                0,
                "a command ran during a drained reset"
            );
            lu.end_reset();
        }
        stop.store(true, SeqCst);
        workers.into_iter().for_each(|w| w.join().unwrap());
    }
}
