//! An iSCSI initiator (RFC 7143), built on the project's own protocol crate (`iscsi`).
//!
//! Two layers:
//! - a **sans-IO core**: [`login::Login`] (security and operational negotiation, CHAP one-way
//!   and mutual) and [`session::Session`] (full feature phase: ITTs, the CmdSN window, Data-In
//!   reassembly, R2T/Data-Out, NOP, task management, logout, async messages, rejects). Bytes
//!   and `Instant`s go in; bytes to send, [`session::Event`]s and typed errors come out. No
//!   sockets, no clocks, no randomness inside: every exchange is reproducible in a test.
//! - a **driver** ([`driver::Connection`], [`driver::Client`]): one `std::net::TcpStream` per
//!   session, non-blocking and multiplexed with `poll(2)`, so one thread keeps many commands in
//!   flight; blocking helpers (`read`, `write`, `command`) with retries and reconnect.
//!
//! ```no_run
//! use initiator::{driver::Connection, session::Command, url::IscsiUrl, scsi};
//! let url = IscsiUrl::parse("iscsi://127.0.0.1:3260/iqn.2024-01.example:t/0").unwrap();
//! let mut conn = Connection::connect(&url.client_config("iqn.2024-01.example:me")).unwrap();
//! for tag in 0..32u64 {
//!     conn.submit(Command::read(tag, 0, scsi::read16(tag * 8, 8), 4096)).unwrap();
//! }
//! while conn.in_flight() > 0 {
//!     let done = conn.next_completion().unwrap();
//!     assert!(done.result.is_ok());
//! }
//! ```
#![forbid(unsafe_code)]

pub mod config;
pub mod driver;
pub mod error;
pub mod login;
pub mod nvme;
pub mod scsi;
pub mod session;
mod splice;
pub mod url;

#[cfg(test)]
mod fake;

pub use config::{
    Auth, ChapConfig, ClientConfig, DigestChoice, SessionConfig, SessionKind, Timeouts,
};
pub use error::{AuthError, CommandError, Error, LoginError, ProtocolError};
/// A CHAP secret (its `Debug` prints `<redacted>`).
pub use iscsi::chap::Secret;
pub use session::{Command, Completion, Event, ScsiResult, Session};
