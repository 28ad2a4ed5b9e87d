//! Why a connection ended other than by logout or the initiator closing it: the `reason` of
//! the connection's last log line. [`Closed`] when something went wrong on the wire or below
//! it; [`Ended`] when the target ended a connection whose peer broke nothing: one list for
//! both doors, each reason typed where it is decided.

/// Why the target ended a connection whose peer did nothing wrong on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The door's ping went unanswered (an iSCSI NOP-In within `nop_in_timeout_s`).
    DeadPeer,
    /// Nothing was received for `idle_timeout_s`.
    Idle,
    /// An NVMe controller saw no command within its keep-alive timeout.
    KeepAliveTimeout,
    /// An NVMe discovery controller without keep-alive stayed idle (`DISCOVERY_IDLE`).
    DiscoveryIdle,
    /// The daemon shuts down (no grace, or nothing left to wait for).
    Shutdown,
    /// The daemon shut down, or the portal went, and the host did not log out (iSCSI) or
    /// its last command did not end (NVMe/TCP) within `shutdown_grace_s`.
    NoLogout,
    /// NVMe in-band authentication was not done within `login_timeout_s`.
    NotAuthenticated,
    /// NVMe in-band authentication failed.
    AuthenticationFailed,
    /// An NVMe I/O queue's ID was taken by the time it authenticated.
    QueueIdTaken,
    /// This gateway lost an RBD image the session maps (docs/RBD.md).
    LostImage,
    /// A reload removed the listener the connection came through (its host was asked to
    /// leave, or had nothing outstanding).
    ListenerRemoved,
    /// A topology change would no longer admit the session; the admission's reason.
    NoLongerAdmitted(&'static str),
    /// The session registry or `ctl` ended it (reinstated by a new login, `ctl session
    /// close`, its controller gone): their reason.
    Told(&'static str),
}

impl Ended {
    pub fn reason(self) -> &'static str {
        match self {
            Ended::DeadPeer => "dead peer (no answer to NOP-In)",
            Ended::Idle => "idle_timeout_s",
            Ended::KeepAliveTimeout => "keep-alive timeout",
            Ended::DiscoveryIdle => "discovery controller idle without keep-alive",
            Ended::Shutdown => "shutdown",
            Ended::NoLogout => "no logout within shutdown_grace_s",
            Ended::NotAuthenticated => "not authenticated within login_timeout_s",
            Ended::AuthenticationFailed => "authentication failed",
            Ended::QueueIdTaken => "queue ID taken",
            Ended::LostImage => "the gateway lost an image the session maps",
            Ended::ListenerRemoved => "its listener was removed",
            Ended::NoLongerAdmitted(why) | Ended::Told(why) => why,
        }
    }
}

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
    /// The reason a connection's last log line gives: what the target decided (`ended`), else
    /// what went wrong, else `clean` (a logout, the host closing).
    pub(crate) fn reason(result: &Result<(), Closed>, ended: Option<Ended>, clean: &str) -> String {
        match (result, ended) {
            (_, Some(ended)) => ended.reason().to_string(),
            (Err(e), None) => e.to_string(),
            (Ok(()), None) => clean.to_string(),
        }
    }

    pub(crate) fn timer(e: std::io::Error) -> Closed {
        Closed::Failed(format!("timer: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_closed_cleanly_says_so_and_any_other_end_says_why() {
        let clean: Result<(), Closed> = Ok(());
        assert_eq!(Closed::reason(&clean, None, "logout"), "logout");
        // The target's reason wins over a clean close it caused.
        let told = Some(Ended::Told("closed by ctl"));
        assert_eq!(Closed::reason(&clean, told, "logout"), "closed by ctl");
        let broken: Result<(), Closed> = Err(Closed::Limit("peer stalled"));
        assert!(Closed::reason(&broken, None, "logout").contains("peer stalled"));
    }

    #[test]
    fn every_reason_the_target_gives_is_words_not_a_code() {
        let all = [
            Ended::DeadPeer,
            Ended::Idle,
            Ended::KeepAliveTimeout,
            Ended::DiscoveryIdle,
            Ended::Shutdown,
            Ended::NoLogout,
            Ended::NotAuthenticated,
            Ended::AuthenticationFailed,
            Ended::QueueIdTaken,
            Ended::LostImage,
            Ended::ListenerRemoved,
            Ended::NoLongerAdmitted("its group is gone"),
            Ended::Told("reinstated"),
        ];
        let reasons: std::collections::HashSet<_> = all.iter().map(|e| e.reason()).collect();
        assert_eq!(reasons.len(), all.len(), "each reason tells its end apart");
        assert!(reasons.iter().all(|r| r.len() > 5));
    }
}
