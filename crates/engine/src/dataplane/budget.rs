//! A connection's memory budget: what its commands hold while they run elsewhere (on the
//! blocking pool, the ring, a store's own thread, the owner gateway) — their Data-Out and
//! the Data-In they will produce. At `memory_per_connection_bytes` the connection handles no
//! further PDU until some complete: the host is held back by TCP, and the worker never waits
//! for the device itself.

#[derive(Debug)]
pub(super) struct Budget {
    held: usize,
    max: usize,
}

impl Budget {
    pub(super) fn new(max: usize) -> Budget {
        Budget { held: 0, max }
    }

    /// A command that runs elsewhere takes `bytes` until it is back.
    pub(super) fn hold(&mut self, bytes: usize) {
        self.held = self.held.saturating_add(bytes);
    }

    /// A command is back with the `bytes` it took.
    pub(super) fn release(&mut self, bytes: usize) {
        debug_assert!(
            self.held >= bytes,
            "a completion gives back no more of the budget than its command took"
        );
        self.held = self.held.saturating_sub(bytes);
    }

    /// At the budget: read nothing more until commands complete.
    pub(super) fn congested(&self) -> bool {
        self.held >= self.max
    }

    pub(super) fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_congested_from_its_budget_until_commands_give_it_back() {
        let mut b = Budget::new(1000);
        b.hold(600);
        assert!(!b.congested());
        b.hold(400);
        assert!(b.congested(), "at the budget");
        b.release(400);
        assert!(!b.congested());
        b.release(600);
        assert_eq!(b.held(), 0);
    }

    #[test]
    #[should_panic(expected = "no more of the budget than its command took")]
    #[cfg(debug_assertions)]
    fn giving_back_more_than_was_taken_is_a_bug_caught_in_debug_builds() {
        let mut b = Budget::new(1000);
        b.hold(10);
        b.release(11);
    }
}
