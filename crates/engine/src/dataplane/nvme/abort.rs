//! Abort (NVMe base 2.0, 5.1) across a controller's queues. The admin queue takes it; the I/O
//! queue holding the command decides, as only its transport knows whether the command still
//! waits for its data — the one state in which it can be stopped (a command the engine runs
//! finishes: an I/O handed to the kernel or the cluster cannot be called back); the admin
//! queue then answers with what was found, or "not aborted" when the I/O queue did not look
//! within [`ABORT_WAIT`] (it is gone).

use std::time::{Duration, Instant};

use nvme::controller::{ABORTS_MAX, ABORT_LIMIT_EXCEEDED};
use nvme::queue::Aborting;
use nvme::sqe::Status;

use super::Driver;
use crate::admission::controllers::{Aborts, ControllerEntry};

/// How long an Abort waits for its I/O queue to look: a queue alive looks within a turn; the
/// margin is for a busy machine (a host waits tens of seconds for an admin command).
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// Dword 0 of an Abort's completion: bit 0 set when the command was not aborted.
fn dw0(aborted: bool) -> u32 {
    u32::from(!aborted)
}

fn mailbox(entry: &ControllerEntry) -> std::sync::MutexGuard<'_, Aborts> {
    entry.aborts.lock().unwrap_or_else(|e| e.into_inner())
}

impl Driver {
    /// On the admin queue: Abort `abort` of command `cid` on I/O queue `sqid`, handed to that
    /// queue (every queue of the controller is woken to look).
    pub(super) fn abort_asked(&mut self, entry: &ControllerEntry, abort: u16, sqid: u16, cid: u16) {
        if self.aborts_held.len() >= usize::from(ABORTS_MAX) {
            return self.answer(abort, ABORT_LIMIT_EXCEEDED, 0, &[]);
        }
        let connected = entry
            .io_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&sqid);
        if !connected {
            return self.answer(abort, Status::SUCCESS, dw0(false), &[]);
        }
        mailbox(entry).asked.push((sqid, cid, abort));
        self.aborts_held.push((abort, Instant::now() + ABORT_WAIT));
        entry.kill.send_modify(|_| {});
    }

    /// On an I/O queue's look: the Aborts of its commands. A write whose data was not asked
    /// for yet is answered Command Abort Requested now; one whose data is on the way when
    /// the last of it arrives (the transport drops it); anything else was not aborted.
    pub(super) fn aborts_of_this_queue(&mut self, entry: &ControllerEntry) {
        let mine: Vec<(u16, u16, u16)> = {
            let mut m = mailbox(entry);
            let (mine, rest) = m.asked.drain(..).partition(|&(q, ..)| q == self.qid);
            m.asked = rest;
            mine
        };
        if mine.is_empty() {
            return;
        }
        let mut found = Vec::with_capacity(mine.len());
        for (_, cid, abort) in mine {
            let aborted = match self.queue.abort(cid) {
                Aborting::Withdrawn => {
                    self.answer(cid, Status::ABORTED_BY_REQUEST, 0, &[]);
                    true
                }
                Aborting::OnArrival => true,
                Aborting::NotWaiting => false,
            };
            tracing::debug!(peer = %self.at.peer, qid = self.qid, cid, aborted, "NVMe Abort");
            found.push((abort, aborted));
        }
        mailbox(entry).found.extend(found);
        entry.kill.send_modify(|_| {});
    }

    /// On the admin queue's look: the Aborts its I/O queues decided, answered.
    pub(super) fn aborts_found(&mut self, entry: &ControllerEntry) {
        let found = std::mem::take(&mut mailbox(entry).found);
        for (abort, aborted) in found {
            // One answered "not aborted" when its wait ran out is not answered twice.
            if let Some(i) = self.aborts_held.iter().position(|&(a, _)| a == abort) {
                self.aborts_held.swap_remove(i);
                self.answer(abort, Status::SUCCESS, dw0(aborted), &[]);
            }
        }
    }

    /// On the admin queue, once an Abort's wait ran out: "not aborted", and its request
    /// withdrawn if its I/O queue has not taken it.
    pub(super) fn aborts_late(&mut self, entry: &ControllerEntry, now: Instant) {
        while let Some(i) = self.aborts_held.iter().position(|&(_, d)| now >= d) {
            let (abort, _) = self.aborts_held.swap_remove(i);
            mailbox(entry).asked.retain(|&(.., a)| a != abort);
            self.answer(abort, Status::SUCCESS, dw0(false), &[]);
        }
    }

    /// When the first Abort held on the admin queue runs out of wait.
    pub(super) fn abort_deadline(&self) -> Option<Instant> {
        self.aborts_held.iter().map(|&(_, d)| d).min()
    }
}
