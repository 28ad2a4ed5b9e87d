//! The iSCSI protocol core (RFC 7143), sans I/O: PDUs, text keys, negotiation, login, and the
//! full-feature connection state machine. Bytes and events in, bytes and actions out.
#![forbid(unsafe_code)]

pub mod chap;
pub mod digest;
pub mod login;
pub mod negotiation;
pub mod pdu;
pub mod serial;
pub mod session;
pub mod text;
