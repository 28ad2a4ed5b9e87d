//! Why a connection ended other than by logout or the initiator closing it: the `reason` of
//! the connection's last log line.

/// Why a connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum Closed {
    /// The socket failed (reset, broken pipe).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The initiator broke the protocol: a malformed PDU, a digest error, data out of range.
    #[error("{0}")]
    Protocol(String),
    /// A bound or a timer ended it: a login too slow, an eviction, a peer that stopped
    /// mid-PDU, a receive buffer full, the daemon shutting down.
    #[error("{0}")]
    Limit(&'static str),
    /// Something the connection relies on failed: a timer, the io_uring ring, `sendfile`, the
    /// owner gateway.
    #[error("{0}")]
    Failed(String),
    /// The engine broke one of its own invariants (a bug, logged at error where found).
    #[error("{0}")]
    Invariant(&'static str),
}

impl Closed {
    pub(crate) fn timer(e: std::io::Error) -> Closed {
        Closed::Failed(format!("timer: {e}"))
    }
}
