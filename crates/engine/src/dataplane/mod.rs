//! The data plane: the connection drivers that carry commands from socket bytes to the
//! devices and back, the per-command route, receive coalescing, and busy polling.

pub(crate) mod alarm;
mod backend;
pub(crate) mod busy_poll;
pub mod closed;
pub mod coalesce;
pub mod connection;
mod iscsi_backend;
pub(crate) mod lifecycle;
mod login;
pub mod nvme;
pub mod route;
mod send;
pub(crate) mod sys;
mod wakeups;

/// The receive buffer of a connection that has not needed more, through either door: room
/// for any login PDU or Connect capsule and a few small commands. It grows when a read fills
/// it or a PDU does not fit (iSCSI: to twice the largest PDU, 514 KiB by default; NVMe/TCP: to
/// [`RBUF_BUSY`], or what the PDU needs) and shrinks back after a second with nothing
/// received. Allocating the full size up front made every idle session pin it: once glibc
/// serves blocks that large from its arenas (after the first one is freed) a zeroed one is
/// written whole, so resident — 192–233 KiB of RSS per idle iSCSI session measured, 22 KiB
/// with this.
pub(crate) const RBUF_IDLE: usize = 16 * 1024;

/// A connection's receive buffer once a read has filled it (a deep queue's commands are
/// waiting): 64 4 KiB writes fit, and are read in fewer calls. Both doors grow to it.
pub(crate) const RBUF_BUSY: usize = 256 * 1024;
