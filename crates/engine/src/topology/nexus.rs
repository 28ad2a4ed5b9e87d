//! The numbering of I_T nexuses, in the order they are made (unique in the process): a
//! gateway that lost an image's ownership ships nothing for nexuses numbered before that
//! (`gateway.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

static NEXUS_IDS: AtomicU64 = AtomicU64::new(1);

/// A new I_T nexus's number.
pub fn new_id() -> u64 {
    NEXUS_IDS.fetch_add(1, Ordering::AcqRel)
}

/// The number the next nexus will get: every nexus made so far is below it.
pub fn next_id() -> u64 {
    NEXUS_IDS.load(Ordering::Acquire)
}
