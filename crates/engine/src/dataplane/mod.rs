//! The data plane: the connection drivers that carry commands from socket bytes to the
//! devices and back, the per-command route, receive coalescing, busy polling and the write
//! stall watch.

pub(crate) mod alarm;
pub(crate) mod busy_poll;
pub mod coalesce;
pub mod connection;
pub mod route;
pub mod stall;
pub(crate) mod sys;
