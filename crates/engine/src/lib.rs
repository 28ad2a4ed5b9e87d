//! The ferrosan engine: the running target around the iSCSI and SCSI cores.
//!
//! Its rooms, and the only direction their imports run (docs/ARCHITECTURE.md, *Rooms of the engine*):
//! [`server`] → {[`control`], [`dataplane`]} → [`shared`] → [`admission`] → [`topology`] →
//! {[`io`], [`config`], [`metrics`]}. The control plane and the data plane never import each
//! other; nothing imports the server.
// `deny`, not `forbid`: dataplane/sys.rs (system calls the crates lack) and io/ring.rs
// (io_uring submissions) hold the crate's only unsafe code.
#![deny(unsafe_code)]

pub mod admission;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod io;
mod log_limit;
pub mod metrics;
pub mod server;
pub mod shared;
pub mod topology;

pub use server::Server;
