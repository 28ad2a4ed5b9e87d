//! Wakes every session to look at the shared state again, instead of each polling it on a
//! clock: a session sleeps until its own next deadline (a ping due, a keep-alive's timeout)
//! or until something it follows changed — a reload published a topology, the daemon began
//! to shut down, an LU changed in a way its hosts must learn (its capacity, mode, identity,
//! access state: [`scsi::Changed`], which also carries an RBD image's new owner). The change
//! only sets a flag; one thread then tells each registered session and NVMe controller once,
//! however many changes came meanwhile (a reload moving 4,096 LUs' access state wakes each
//! session once, not 4,096 times).

use std::sync::Weak;
use std::time::Duration;

use super::Shared;
use crate::topology::nudger::Nudger;

/// How often the thread checks that its daemon is still there while nothing changes.
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// The thread's loop: tells every session of each nudge, until the daemon is gone.
pub(crate) fn run(nudger: &Nudger, shared: &Weak<Shared>) {
    loop {
        let nudged = nudger.taken(IDLE_CHECK);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if nudged {
            shared.registry.nudge_all();
            shared.nvme.nudge_all();
        }
    }
}
