//! The data plane: the connection drivers that carry commands from socket bytes to the
//! devices and back, the per-command route, receive coalescing, and busy polling.

pub(crate) mod alarm;
mod backend;
pub(crate) mod busy_poll;
pub mod closed;
pub mod coalesce;
pub mod connection;
pub(crate) mod lifecycle;
mod login;
pub mod nvme;
pub mod route;
mod send;
pub(crate) mod sys;
mod wakeups;

/// A connection's receive buffer once a read has filled it (a deep queue's commands are
/// waiting): 64 4 KiB writes fit, and are read in fewer calls. Both doors grow to it.
pub(crate) const RBUF_BUSY: usize = 256 * 1024;
