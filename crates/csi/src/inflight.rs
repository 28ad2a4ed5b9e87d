//! CSI's "an operation is already in flight for this volume": a second call on a volume (or
//! a snapshot, or a name being created) while one runs answers ABORTED at once, for the CO to
//! retry, instead of racing the first.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tonic::Status;

#[derive(Clone, Default)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
}

/// A call's hold on its key, let go when the call ends (whatever way it ends).
pub struct Hold {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    /// Holds `key` for the caller, or ABORTED when a call holds it already.
    pub fn begin(&self, key: &str) -> Result<Hold, Status> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if !keys.insert(key.to_string()) {
            return Err(Status::aborted(format!(
                "an operation on {key} is in flight: retry once it ends"
            )));
        }
        Ok(Hold {
            keys: self.keys.clone(),
            key: key.to_string(),
        })
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let was = keys.remove(&self.key);
        debug_assert!(was, "a hold let go of a key it did not hold");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_call_on_a_key_is_aborted_until_the_first_ends() {
        let inflight = InFlight::default();
        let first = inflight.begin("vol1").unwrap();
        assert_eq!(
            inflight.begin("vol1").err().map(|s| s.code()),
            Some(tonic::Code::Aborted)
        );
        let other = inflight.begin("vol2").unwrap();
        drop(first);
        let again = inflight.begin("vol1").unwrap();
        drop((other, again));
        assert!(inflight.keys.lock().unwrap().is_empty());
    }
}
