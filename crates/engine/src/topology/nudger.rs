//! What an LU's change tells: a flag that the session nudges (`shared/nudge.rs`) take, set from
//! any thread, holding any lock, as often as changes come; one look for many.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Default)]
pub struct Nudger {
    pending: Mutex<bool>,
    wake: Condvar,
}

impl Nudger {
    /// Something every session follows changed: each looks again soon. Cheap and callable
    /// from any thread, holding any lock (it takes only its own).
    pub fn nudge(&self) {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.notify_one();
    }

    /// What an LU tells of its changes.
    pub fn for_units(self: &Arc<Self>) -> scsi::Changed {
        let me = Arc::clone(self);
        Arc::new(move || me.nudge())
    }

    /// Waits up to `within` for a nudge; true when one came (and takes it).
    pub(crate) fn taken(&self, within: Duration) -> bool {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let (mut pending, _) = self
            .wake
            .wait_timeout_while(pending, within, |p| !*p)
            .unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nudges_coalesce_until_taken_and_none_is_lost() {
        let nudger = Arc::new(Nudger::default());
        assert!(!nudger.taken(Duration::ZERO));
        let changed = nudger.for_units();
        changed();
        nudger.nudge();
        assert!(nudger.taken(Duration::ZERO), "one look for both");
        assert!(!nudger.taken(Duration::ZERO));
        // From another thread while this one waits.
        let other = Arc::clone(&nudger);
        let t = std::thread::spawn(move || other.nudge());
        assert!(nudger.taken(Duration::from_secs(10)));
        t.join().unwrap();
    }
}
