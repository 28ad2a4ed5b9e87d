//! The data plane: the connection drivers that carry commands from socket bytes to the
//! devices and back, the per-command route, receive coalescing, and busy polling.

pub(crate) mod alarm;
pub(crate) mod busy_poll;
pub mod closed;
pub mod coalesce;
pub mod connection;
pub(crate) mod lifecycle;
pub mod route;
pub(crate) mod sys;
