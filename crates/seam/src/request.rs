//! One command as both doors hand it to the backend: its request, where its data is, how it ran.

use crate::outbox::{FileRange, Outbox, SharedSlice};

/// SCSI status codes the core itself produces or inspects.
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const TASK_SET_FULL: u8 = 0x28;
}

/// One SCSI command handed to the backend.
#[derive(Clone, Copy, Debug)]
pub struct ScsiRequest<'a> {
    /// The door's name for the command (an iSCSI initiator task tag, an NVMe command ID): it
    /// names the task when a deferred execution completes.
    pub tag: u32,
    pub lun: [u8; 8],
    pub cdb: &'a [u8],
    pub data_out: &'a [u8],
    /// Expected Data Transfer Length from the initiator.
    pub expected_len: u32,
    pub read: bool,
    pub write: bool,
    pub task_attr: u8,
    /// The Data-In may be lent as a file range ([`Loan::file`]): a read of a SIMPLE (or
    /// untagged) task on a connection without data digests, whose CRC would need the bytes.
    pub may_lend_file: bool,
}

/// What a zero-copy read lends instead of filling `data_in`.
#[derive(Default)]
pub struct Loan {
    /// Slices of store memory.
    pub slices: Vec<SharedSlice>,
    /// A page-cached file range, sent with `sendfile` (only when the request allows it).
    pub file: Option<FileRange>,
}

impl Loan {
    pub fn is_empty(&self) -> bool {
        self.slices.is_empty() && self.file.is_none()
    }

    pub fn clear(&mut self) {
        self.slices.clear();
        self.file = None;
    }
}

/// What the backend reports back; Data-In bytes and sense bytes go into the buffers it was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScsiOutcome {
    pub status: u8,
    /// Bytes the CDB itself transfers out (writes); reads use the Data-In length.
    pub transfer_len: u32,
}

/// How the backend ran a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Execution {
    /// Finished: `data_in` and `sense` hold its results.
    Done(ScsiOutcome),
    /// To run elsewhere (e.g. a durable write on a disk-backed LU, off the network worker),
    /// nothing done yet: the session hands the command over, owning its Data-Out, with
    /// [`ScsiBackend::defer`](crate::ScsiBackend::defer); the engine hands the outcome back to the
    /// door with the task's tag when it finishes.
    Deferred,
}

/// Memory the engine supplies for a write's Data-Out (see [`ScsiBackend::data_out_memory`](crate::ScsiBackend::data_out_memory)),
/// e.g. aligned for direct I/O so that the data goes from the socket to the device without
/// another copy. Exactly as long as the write's expected data transfer length.
/// `Any`, so the engine can take its own type back (trait upcasting, then a downcast).
pub trait DataOutMemory: std::any::Any + Send + Sync + std::fmt::Debug {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// A write's Data-Out: in a buffer of the connection's pool, or in memory the engine supplied.
#[derive(Debug)]
pub enum DataOutBuf {
    Pooled(Vec<u8>),
    Engine(Box<dyn DataOutMemory>),
}

impl Default for DataOutBuf {
    fn default() -> Self {
        DataOutBuf::Pooled(Vec::new())
    }
}

impl DataOutBuf {
    /// Returns a pooled buffer to the outbox's pool; engine memory goes back to the engine as it
    /// drops.
    pub fn recycle(self, out: &mut Outbox) {
        if let DataOutBuf::Pooled(buf) = self {
            out.give_back(buf);
        }
    }
}

impl std::ops::Deref for DataOutBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            DataOutBuf::Pooled(buf) => buf,
            DataOutBuf::Engine(memory) => memory.bytes(),
        }
    }
}

impl std::ops::DerefMut for DataOutBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            DataOutBuf::Pooled(buf) => buf,
            DataOutBuf::Engine(memory) => memory.bytes_mut(),
        }
    }
}

/// A command handed to the backend to run elsewhere, owning what it needs.
#[derive(Debug)]
pub struct DeferredCommand {
    /// As [`ScsiRequest::tag`].
    pub tag: u32,
    pub lun: [u8; 8],
    pub cdb: Vec<u8>,
    /// The Data-Out (empty for reads): the write's own assembly buffer when it came in Data-Out
    /// PDUs, so it is not copied again. Give it back with [`DataOutBuf::recycle`] when done.
    pub data_out: DataOutBuf,
    pub expected_len: u32,
    pub read: bool,
    pub write: bool,
    pub task_attr: u8,
}
