//! The ferrosan engine: config model, portals, connection drivers, session registry.
// `deny`, not `forbid`: sys.rs (two system calls) and ring.rs (io_uring submissions) hold the
// crate's only unsafe code.
#![deny(unsafe_code)]

pub mod admission;
mod alarm;
mod busy_poll;
pub mod coalesce;
pub mod config;
pub mod connection;
pub mod control;
pub mod gateway;
mod group_commit;
pub mod left_out;
pub mod metrics;
pub mod peer;
pub mod portals;
pub mod prelogin;
pub mod registry;
pub mod reload;
pub mod ring;
pub mod route;
pub mod server;
pub mod stall;
pub mod state;
mod sys;
pub mod topology;

pub use server::Server;
