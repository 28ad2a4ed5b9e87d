//! The seam between the doors and the array: what the iSCSI and NVMe/TCP protocol cores map their
//! PDUs onto, and what the engine's backend implements once for both. Neither protocol core owns
//! it, so neither door needs the other's crate (docs/ARCHITECTURE.md, "The seam").
//!
//! - [`ScsiBackend`]: runs a [`ScsiRequest`] inline or takes it as a [`DeferredCommand`], answers
//!   task management;
//! - [`outbox::Outbox`]: everything a connection sends in one turn, with lent (zero-copy) reads;
//! - [`Activity`]: what a turn's input says about the host's pipeline (wake-up coalescing);
//! - [`name::NodeName`]: the one name type for IQNs, EUIs, NAAs and NQNs.
#![forbid(unsafe_code)]

pub mod name;
pub mod outbox;
pub mod request;
pub mod task;

pub use request::{
    status, DataOutBuf, DataOutMemory, DeferredCommand, Execution, Loan, ScsiOutcome, ScsiRequest,
};
pub use task::{tmf_response, TmfAnswer, TmfFunction};

/// A door's verdict on its peer at a tick of the connection's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Continue,
    /// The peer did not answer our ping in time (iSCSI: a NOP-In within `nop_timeout`): the
    /// connection is dead.
    DeadPeer,
    /// Nothing from the peer for the idle limit: the session ends.
    Idle,
}

use outbox::ReadBuffers;

/// The array as a door sees it: the one interface both doors' commands run through.
pub trait ScsiBackend {
    /// Runs one command, or answers [`Execution::Deferred`] (without side effects) to run it
    /// elsewhere. `lent` and `sense` arrive empty; `data_in` arrives empty except for reads, where
    /// it may hold bytes of an earlier read on this connection so the read can overwrite instead
    /// of zero-fill. When the command is done, `data_in` holds exactly its Data-In (cleared if
    /// there is none), or, for a zero-copy read, `data_in` is empty and `lent` holds slices of
    /// the store's memory or (if `req.may_lend_file`) a page-cached file range.
    fn execute(
        &mut self,
        req: &ScsiRequest<'_>,
        data_in: &mut Vec<u8>,
        lent: &mut Loan,
        sense: &mut Vec<u8>,
    ) -> Execution;
    /// Takes over a command `execute` answered [`Execution::Deferred`] for. A read that will
    /// fill a buffer of its own may take one from `buffers` (its Data-In returns through the
    /// same outbox).
    fn defer(&mut self, command: DeferredCommand, buffers: ReadBuffers<'_>);
    /// Does this LUN exist for this session? (TMF answers "LUN does not exist" otherwise.)
    fn lun_exists(&mut self, lun: [u8; 8]) -> bool;
    /// LU-level effects of the task management function tagged `tag` (the door has already
    /// dropped its own pending tasks and will itself wait for its own aborted running tasks).
    /// [`TmfAnswer::Later`] when the answer must wait for commands of other sessions: the engine
    /// then tells the door once they can no longer reach the medium.
    fn task_management(&mut self, tag: u32, function: TmfFunction, lun: [u8; 8]) -> TmfAnswer;
    /// Memory of exactly `len` bytes for the Data-Out of a write to `lun` the engine will run
    /// itself (e.g. aligned for direct I/O), or None for a buffer of the connection's pool. Its
    /// contents need not be zeroed: every byte is written before the command runs.
    fn data_out_memory(&mut self, _lun: [u8; 8], _len: usize) -> Option<Box<dyn DataOutMemory>> {
        None
    }
}

/// What the input handled in one turn says about the host's pipeline; the connection driver uses
/// it to decide whether to coalesce wake-ups.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Commands received (iSCSI SCSI Command PDUs, NVMe command capsules).
    pub commands: u32,
    /// Their bytes: header and what came in the same PDU (immediate or in-capsule data).
    pub command_bytes: u64,
    /// Every other PDU (Data-Out or H2CData, NOP-Out, task management, text, logout, ...).
    pub other_pdus: u32,
    /// The most answers the host had not yet seen when it sent one of those commands (iSCSI:
    /// our StatSN minus its ExpStatSN, bounded by the command window; NVMe/TCP, which does not
    /// acknowledge answers, counts what the host sent without waiting). A pipelining initiator
    /// shows its queue depth here; one that waits for each answer shows 0.
    pub initiator_backlog: u32,
    /// The most commands of this session still in the target (waiting for Data-Out or
    /// running) when one of those commands arrived. An initiator with a deep queue of slow
    /// commands (large writes, a disk) has seen every answer when it sends the next one, so
    /// only this tells it from one that waits for each answer.
    pub in_flight: u32,
}
