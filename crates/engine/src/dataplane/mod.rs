//! The data plane: the connection drivers that carry commands from socket bytes to the
//! devices and back, the per-command route, receive coalescing, and busy polling.

pub(crate) mod alarm;
mod backend;
mod batched;
mod budget;
pub(crate) mod busy_poll;
pub mod closed;
pub mod coalesce;
pub mod connection;
mod driver;
mod iscsi_backend;
pub(crate) mod lifecycle;
mod login;
mod meter;
pub mod nvme;
mod recv;
pub mod route;
mod send;
pub(crate) mod sys;
#[cfg(test)]
mod testing;
mod view;
mod wakeups;
mod wire;

/// The receive buffer of a connection that has not needed more, through either door
/// (`recv.rs` has the policy): a login PDU, a Connect capsule or a few commands fit.
pub(crate) const RBUF_IDLE: usize = 16 * 1024;

/// The least a connection's receive buffer grows to once a read has filled it (a deep
/// queue's commands are waiting): 64 4 KiB writes fit, and are read in fewer calls.
pub(crate) const RBUF_BUSY: usize = 256 * 1024;
