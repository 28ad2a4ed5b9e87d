//! The NVMe/TCP controllers of this daemon: one per admin queue a host connected, found again
//! by its controller ID when the host connects its I/O queues (each its own TCP connection,
//! possibly on another worker). Control plane only: touched at Connect and at close.
//!
//! A controller is a session of the session registry too (its controller ID is the TSIH the
//! registry allocated): `max_sessions` bounds both doors together, and `ctl sessions` lists
//! and closes NVMe controllers beside iSCSI sessions.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::registry::SessionTicket;
use super::Admitted;
use crate::config::NodeName;

pub use nvme::controller::CNTLID_MAX;

/// One controller, as its queues share it.
pub struct ControllerEntry {
    pub cntlid: u16,
    pub host: NodeName,
    pub host_id: [u8; 16],
    /// The subsystem (its target's NQN); None for a discovery controller.
    pub subsystem: Option<NodeName>,
    pub portal_group_tag: u16,
    /// The admin queue's peer: I/O queues must come from the same address.
    pub source: SocketAddr,
    /// What the admin queue's Connect was admitted as; each I/O queue starts from it and
    /// is readmitted on its own at every topology change.
    pub admitted: Admitted,
    /// The I_T nexus of the controller: the SCSI core's view of this host through this port.
    pub nexus: Option<scsi::Nexus>,
    pub state: Mutex<nvme::controller::Controller>,
    /// I/O queue IDs connected.
    pub io_queues: Mutex<Vec<u16>>,
    /// Set (with the reason) when the controller ends: every queue closes.
    pub kill: watch::Sender<Option<&'static str>>,
    /// Its place in the session registry (held while the controller lives).
    pub ticket: Mutex<Option<SessionTicket>>,
    /// What `ctl sessions` and `ferrosan top` show of it: its queues count their I/O and
    /// latency here, as an iSCSI session's connections do in theirs.
    pub info: Mutex<Option<Arc<crate::admission::registry::SessionInfo>>>,
    /// Aborts on their way between the admin queue that took them and the I/O queue holding
    /// the command (`dataplane/nvme/abort.rs`).
    pub aborts: Mutex<Aborts>,
}

/// Aborts of I/O queues' commands, between the queues of one controller.
#[derive(Debug, Default)]
pub struct Aborts {
    /// Asked, not yet looked at: (I/O queue, the command, the Abort's own identifier).
    pub asked: Vec<(u16, u16, u16)>,
    /// Looked at: (the Abort's identifier, whether its command was aborted).
    pub found: Vec<(u16, bool)>,
}

impl ControllerEntry {
    pub fn state(&self) -> std::sync::MutexGuard<'_, nvme::controller::Controller> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers I/O queue `qid` once: false if it is connected already or beyond what the
    /// host was granted.
    pub fn add_io_queue(&self, qid: u16) -> bool {
        let granted = self.state().io_queues();
        let mut queues = self.io_queues.lock().unwrap_or_else(|e| e.into_inner());
        if !free(&queues, granted, qid) {
            return false;
        }
        queues.push(qid);
        true
    }

    /// Whether I/O queue `qid` could be registered now (a queue that must authenticate first
    /// holds none until it has).
    pub fn io_queue_free(&self, qid: u16) -> bool {
        let granted = self.state().io_queues();
        free(
            &self.io_queues.lock().unwrap_or_else(|e| e.into_inner()),
            granted,
            qid,
        )
    }

    pub fn remove_io_queue(&self, qid: u16) {
        self.io_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&q| q != qid);
    }

    /// Ends the controller: its queues close at their next turn.
    pub fn end(&self, reason: &'static str) {
        self.kill.send_replace(Some(reason));
    }
}

/// Every live controller by ID.
#[derive(Default)]
pub struct Controllers {
    map: Mutex<HashMap<u16, Arc<ControllerEntry>>>,
}

impl Controllers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u16, Arc<ControllerEntry>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, entry: Arc<ControllerEntry>) {
        let old = self.lock().insert(entry.cntlid, entry);
        debug_assert!(
            old.is_none(),
            "controller IDs are the registry's TSIHs: unique"
        );
    }

    pub fn get(&self, cntlid: u16) -> Option<Arc<ControllerEntry>> {
        self.lock().get(&cntlid).cloned()
    }

    /// Removes controller `cntlid` (its admin queue closed) and ends its queues.
    pub fn remove(&self, cntlid: u16, reason: &'static str) {
        if let Some(entry) = self.lock().remove(&cntlid) {
            entry.end(reason);
            entry
                .ticket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
        }
    }

    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Wakes every queue of every controller to look at the shared state again
    /// (`shared/nudge.rs`): its `kill` watch changes, its reason staying none.
    pub fn nudge_all(&self) {
        for entry in self.lock().values() {
            entry.kill.send_modify(|_| {});
        }
    }
}

/// Queue `qid` is within the `granted` count and not among the `held` ones.
fn free(held: &[u16], granted: u16, qid: u16) -> bool {
    qid != 0 && qid <= granted && !held.contains(&qid)
}
