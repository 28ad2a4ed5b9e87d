//! The NVMe over TCP core (NVMe/TCP transport specification 1.0, NVMe base and fabrics
//! specifications 2.0), sans I/O in the style of the `iscsi` crate: bytes and time in, actions
//! out, every rule unit-tested and fuzzed. Byte order on the wire is little-endian throughout.
//!
//! This crate holds the PDU framing (`pdu`), the queue entries (`sqe`), the Fabrics commands
//! with the controller's properties (`fabrics`), the Identify data (`identify`), the log pages
//! (`log`), the admin commands (`admin`) and the NVM I/O commands (`nvm`), decoded. The
//! controller's queues, the subsystems and the engine's listener are built on it; until they
//! are, ferrosan serves no NVMe/TCP (docs/ARCHITECTURE.md, *Crates*).
#![forbid(unsafe_code)]

pub mod admin;
pub mod auth;
pub mod controller;
pub mod fabrics;
pub mod host;
pub mod identify;
mod keytext;
pub mod log;
pub mod nvm;
pub mod pdu;
pub mod queue;
pub mod sqe;
pub mod tls;
pub mod translate;
