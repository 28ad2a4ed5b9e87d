//! Submit, then complete: the commands that move blocks (READ, WRITE, SYNCHRONIZE CACHE) can be
//! planned instead of run. [`LogicalUnit::plan`] makes every check the command owes (unit
//! attention, reservations, CDB fields, range, write protection) and describes the one block
//! I/O it needs; the transport performs it however it likes (asynchronously, on its own ring)
//! and hands the result to [`LogicalUnit::finish`] for the status. SPDK's lib/scsi splits its
//! bdev commands the same way (submit returns pending, the completion sets the status).

use crate::cdb::*;
use crate::lu::LogicalUnit;
use crate::{Command, Completion, LunMap, Nexus};

/// What a planned block I/O does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    /// Read `len` bytes at `offset` into the Data-In buffer.
    Read,
    /// Write the first `len` bytes of the Data-Out at `offset`; `durable`: on stable storage
    /// before the status (write-through or FUA: RWF_DSYNC).
    Write { durable: bool },
    /// Make everything written so far durable (fdatasync).
    Flush,
}

/// One block I/O a planned command needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIo {
    pub op: BlockOp,
    /// Byte offset in the store (0 for a flush).
    pub offset: u64,
    /// Bytes to move: a read's Data-In (never more than the transport takes), a write's whole
    /// blocks that arrived (a prefix of its Data-Out); 0 for a flush.
    pub len: u32,
    /// What the CDB asked to move, for the residual in the completion.
    pub transfer_len: u32,
}

impl BlockIo {
    /// Whether this I/O, failed with `e`, is answered by [`LogicalUnit::finish_located`]: a
    /// read the medium failed, whose failing block a host is told.
    pub fn failure_is_located(&self, e: &std::io::Error) -> bool {
        self.op == BlockOp::Read && crate::sbc::read_failed_on_medium(e)
    }
}

/// A write's share of its LU's write order, held until the device has answered, so that
/// COMPARE AND WRITE (which takes the order exclusively) never runs between a write's
/// submission and its completion.
pub struct WriteShare(
    #[allow(dead_code)] // held for its Drop
    parking_lot::ArcRwLockReadGuard<parking_lot::RawRwLock, ()>,
);

/// The outcome of planning a command.
pub enum Plan {
    /// Perform the I/O, then [`LogicalUnit::finish`] it; a write's share travels with it.
    Io(BlockIo, Option<WriteShare>),
    /// Answered already: a check failed, a unit attention was reported, or there is nothing
    /// to move.
    Done(Completion),
    /// Not a command that plans, one that must wait for a COMPARE AND WRITE, or one through
    /// a port that does not own the LU: nothing was done or checked; run it the ordinary way
    /// (`execute`, where waiting is fine).
    Execute,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Plan::Io(io, share) => write!(f, "Io({io:?}, share: {})", share.is_some()),
            Plan::Done(c) => write!(f, "Done({c:?})"),
            Plan::Execute => write!(f, "Execute"),
        }
    }
}

/// Whether `cdb` is a command that plans (READ, WRITE, SYNCHRONIZE CACHE): a transport may
/// route it to its asynchronous path before looking further ([`crate::facts::Facts::plans`]).
pub fn plans(cdb: &[u8]) -> bool {
    crate::facts::facts(Cdb(cdb)).plans
}

impl LogicalUnit {
    /// Plans one command of `nexus` (see [`Plan`]); `read_only_mapping`: the LUN is mapped
    /// read-only. Only READ, WRITE (6/10/12/16) and SYNCHRONIZE CACHE (10/16) plan; everything
    /// else is [`Plan::Execute`] with no effect, the unit attention still pending.
    pub fn plan(&self, nexus: &Nexus, cmd: &Command<'_>, read_only_mapping: bool) -> Plan {
        let Some(&opcode) = cmd.cdb.first().filter(|_| plans(cmd.cdb)) else {
            return Plan::Execute;
        };
        // Through a port that does not own the LU: refused or shipped to the owner, never
        // planned here.
        if self
            .ownership()
            .is_some_and(|o| !o.is_active(nexus.target_port.group))
        {
            return Plan::Execute;
        }
        let share = match opcode {
            READ_6 | READ_10 | READ_12 | READ_16 | SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => {
                None
            }
            WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 => {
                // A COMPARE AND WRITE holds the order: wait for it where waiting is fine.
                match self.write_order.try_read_arc() {
                    Some(guard) => Some(WriteShare(guard)),
                    None => return Plan::Execute,
                }
            }
            _ => return Plan::Execute,
        };
        let planned = self.admit(nexus, cmd, read_only_mapping).and_then(|_| {
            match opcode {
                READ_6 | READ_10 | READ_12 | READ_16 => {
                    let read = self.read_extent(cmd)?;
                    Ok(BlockIo {
                        op: BlockOp::Read,
                        offset: read.offset,
                        len: read.len,
                        transfer_len: read.bytes,
                    })
                }
                SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => {
                    self.check_synchronize_cache(cmd)?;
                    Ok(BlockIo {
                        op: BlockOp::Flush,
                        offset: 0,
                        len: 0,
                        transfer_len: 0,
                    })
                }
                _ => {
                    let write = self.write_extent(cmd)?;
                    Ok(BlockIo {
                        op: BlockOp::Write {
                            durable: write.durable,
                        },
                        offset: write.offset,
                        // At most TRANSFER_BYTES_MAX (check_transfer).
                        len: u32::try_from(write.data.len()).unwrap_or(u32::MAX),
                        transfer_len: write.bytes,
                    })
                }
            }
        });
        match planned {
            // Nothing to move (zero blocks, or no Data-In room): done as it is.
            Ok(io) if io.len == 0 && io.op != BlockOp::Flush => {
                Plan::Done(Completion::good(io.transfer_len))
            }
            Ok(io) => Plan::Io(io, share),
            Err(stop) => Plan::Done(self.completion(Err(stop))),
        }
    }

    /// The completion of a planned read the medium failed ([`BlockIo::failure_is_located`]):
    /// MEDIUM ERROR, UNRECOVERED READ ERROR with the first failing block in its INFORMATION
    /// field. Reads the range again to find it: call it where waiting is fine.
    pub fn finish_located(&self, io: &BlockIo, e: std::io::Error) -> Completion {
        debug_assert!(
            io.failure_is_located(&e),
            "only a read's medium error is located"
        );
        self.completion(Err(self
            .read_failure(io.offset, u64::from(io.len), e)
            .into()))
    }

    /// The completion of a planned I/O from what the device answered: GOOD with the CDB's
    /// transfer length, or MEDIUM ERROR (unrecovered read error / write error) on failure
    /// (without the failing block: see [`LogicalUnit::finish_located`]).
    pub fn finish(&self, io: &BlockIo, result: std::io::Result<()>) -> Completion {
        self.completion(match result {
            Ok(()) => Ok(io.transfer_len),
            Err(e) => Err(match io.op {
                BlockOp::Read => crate::sbc::read_error(e),
                BlockOp::Write { .. } | BlockOp::Flush => crate::sbc::write_error(e),
            }
            .into()),
        })
    }
}

impl LunMap {
    /// Plans a command addressed to `lun` (see [`LogicalUnit::plan`]): [`Plan::Execute`] for a
    /// LUN with no LU and for REPORT LUNS, which the map answers itself.
    pub fn plan(&self, nexus: &Nexus, lun: u64, cmd: &Command<'_>) -> Plan {
        match self.get(lun) {
            Some(entry) => entry.lu.plan(nexus, cmd, entry.read_only),
            None => Plan::Execute,
        }
    }
}
