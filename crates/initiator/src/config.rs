//! What a session asks for: names, authentication, operational offers, limits and timeouts.

use std::time::Duration;

use iscsi::chap::{Algorithm, Secret};

/// Normal session to a named target, or a discovery session (SendTargets only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionKind {
    /// `SessionType=Normal`, `TargetName=<iqn>`.
    Normal { target_name: String },
    /// `SessionType=Discovery`.
    Discovery,
}

/// A CHAP user and secret (ours, or the target's for mutual CHAP).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChapCredential {
    pub user: String,
    pub secret: Secret,
}

/// CHAP settings: our credential, the target's (mutual CHAP), and the algorithms we offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChapConfig {
    pub user: String,
    pub secret: Secret,
    /// The target's name and secret: set for mutual CHAP; the target must prove it knows them.
    pub mutual: Option<ChapCredential>,
    /// CHAP_A offer, in order of preference (the target picks the first it supports).
    pub algorithms: Vec<Algorithm>,
}

impl ChapConfig {
    /// One-way CHAP with the default algorithm list ([`ChapConfig::DEFAULT_ALGORITHMS`]).
    pub fn new(user: impl Into<String>, secret: impl Into<Vec<u8>>) -> ChapConfig {
        ChapConfig {
            user: user.into(),
            secret: Secret::new(secret),
            mutual: None,
            algorithms: ChapConfig::DEFAULT_ALGORITHMS.to_vec(),
        }
    }

    /// Adds the target's credential (mutual CHAP).
    pub fn with_mutual(mut self, user: impl Into<String>, secret: impl Into<Vec<u8>>) -> Self {
        self.mutual = Some(ChapCredential {
            user: user.into(),
            secret: Secret::new(secret),
        });
        self
    }

    /// MD5 first: tgt (and other older targets) accept only MD5 and some look only at the
    /// first value; the others follow, strongest first.
    pub const DEFAULT_ALGORITHMS: [Algorithm; 4] = [
        Algorithm::Md5,
        Algorithm::Sha3_256,
        Algorithm::Sha256,
        Algorithm::Sha1,
    ];
}

/// `AuthMethod`: None, or CHAP.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Auth {
    #[default]
    None,
    Chap(ChapConfig),
}

/// What we offer for HeaderDigest / DataDigest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DigestChoice {
    /// Offer `None` only.
    #[default]
    None,
    /// Offer `CRC32C` only (the login fails if the target refuses).
    Crc32c,
    /// Offer `CRC32C,None`: CRC32C if the target agrees.
    Prefer,
}

impl DigestChoice {
    pub(crate) fn offer(self) -> &'static str {
        match self {
            DigestChoice::None => "None",
            DigestChoice::Crc32c => "CRC32C",
            DigestChoice::Prefer => "CRC32C,None",
        }
    }
}

/// Everything the sans-IO core needs to log in and run a session.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub initiator_name: String,
    pub initiator_alias: Option<String>,
    pub kind: SessionKind,
    /// Initiator Session ID. Reusing it with TSIH 0 reinstates (replaces) an older session
    /// of the same initiator name. [`SessionConfig::new`] sets a fixed one (the core has no
    /// randomness); [`ClientConfig::new`] replaces it with a random one.
    pub isid: [u8; 6],
    /// 0 for a new session.
    pub tsih: u16,
    pub cid: u16,
    pub auth: Auth,
    pub header_digest: DigestChoice,
    pub data_digest: DigestChoice,
    /// Our MaxRecvDataSegmentLength: the largest data segment we accept (declared).
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub max_outstanding_r2t: u16,
    /// Commands that may be outstanding at once (sent, queued behind the CmdSN window, or
    /// abandoned after a timeout and not yet settled by the target). `submit` beyond it fails.
    pub max_outstanding_commands: usize,
    /// A command not answered within this is completed with a timeout and aborted (ABORT TASK).
    pub command_timeout: Duration,
    /// Ping the target (NOP-Out) after this long without hearing from it; `None`: never.
    pub nop_interval: Option<Duration>,
    /// A ping, task management or logout request not answered within this fails the session.
    pub response_timeout: Duration,
}

impl SessionConfig {
    /// Defaults for a normal session to `target_name`.
    pub fn new(initiator_name: impl Into<String>, kind: SessionKind) -> SessionConfig {
        SessionConfig {
            initiator_name: initiator_name.into(),
            initiator_alias: None,
            kind,
            isid: [0x80, 0, 0, 0, 0, 1],
            tsih: 0,
            cid: 0,
            auth: Auth::None,
            header_digest: DigestChoice::None,
            data_digest: DigestChoice::None,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            first_burst_length: 262_144,
            immediate_data: true,
            initial_r2t: false,
            max_outstanding_r2t: 8,
            max_outstanding_commands: 256,
            command_timeout: Duration::from_secs(30),
            nop_interval: Some(Duration::from_secs(5)),
            response_timeout: Duration::from_secs(10),
        }
    }
}

/// Timeouts of the driver (the session's own are in [`SessionConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect, per address tried.
    pub connect: Duration,
    /// The whole login, from connect to full feature phase.
    pub login: Duration,
    /// Logout and discovery exchanges.
    pub exchange: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            login: Duration::from_secs(10),
            exchange: Duration::from_secs(10),
        }
    }
}

/// Where to connect and how: the driver's configuration.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port`, `[v6]:port` or a bare host (port 3260).
    pub address: String,
    pub session: SessionConfig,
    /// The LUN the blocking helpers of [`crate::driver::Client`] address.
    pub lun: u64,
    pub timeouts: Timeouts,
    /// Blocking helpers: retries of BUSY / TASK SET FULL (with backoff from 1 ms, doubling,
    /// capped at 100 ms), and of a command that met a lost connection (after a reconnect).
    pub retries: u32,
    /// Blocking helpers: retry a command once more per unit attention it meets (up to
    /// `retries`) instead of returning it as an error.
    pub retry_unit_attention: bool,
    /// How long a wait for the target's answer spins on the socket before it sleeps in
    /// `poll(2)` (zero: it sleeps at once, as the kernel's initiators do). A polling host
    /// answers a queue depth of 1 without a wake-up per answer, at the price of a CPU.
    pub busy_poll: Duration,
}

impl ClientConfig {
    /// Gives the session a random ISID (see [`crate::driver::random_isid`]): two clients
    /// with one initiator name and the same ISID would reinstate — end — each other's
    /// sessions. A [`crate::driver::Client`] keeps its ISID across reconnects.
    pub fn new(address: impl Into<String>, mut session: SessionConfig) -> ClientConfig {
        session.isid = crate::driver::random_isid();
        ClientConfig {
            address: address.into(),
            session,
            lun: 0,
            timeouts: Timeouts::default(),
            retries: 5,
            retry_unit_attention: false,
            busy_poll: Duration::ZERO,
        }
    }
}
