//! Typed errors: connection-level ([`Error`]), login ([`LoginError`], [`AuthError`]), protocol
//! violations by the target ([`ProtocolError`]) and per-command failures ([`CommandError`]).

use std::fmt;
use std::time::Duration;

use iscsi::pdu::FrameError;
use iscsi::text::TextError;

/// Something the target sent that breaks the protocol. At ErrorRecoveryLevel 0 every one of
/// these ends the connection (and fails its outstanding commands).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    Frame(FrameError),
    /// An opcode no target sends.
    UnknownOpcode(u8),
    /// A valid target opcode at a time it makes no sense (e.g. a SCSI Response during login).
    UnexpectedOpcode(u8),
    /// A PDU naming an ITT we have no task for.
    UnknownItt {
        opcode: u8,
        itt: u32,
    },
    /// Data-In past the command's expected transfer length.
    DataBeyondLength {
        itt: u32,
        end: u64,
        expected: u32,
    },
    /// Data-In with an unexpected DataSN.
    DataSn {
        itt: u32,
        got: u32,
        want: u32,
    },
    /// Data-In for a command that reads nothing, or an R2T for one that writes nothing.
    WrongDirection {
        itt: u32,
        opcode: u8,
    },
    /// An R2T asking for data outside the command's buffer, or more than MaxBurstLength.
    BadR2t {
        itt: u32,
        offset: u32,
        len: u32,
    },
    /// Text (login or text response) that does not parse.
    Text(TextError),
    /// A text response longer than we accept.
    TextTooLong(usize),
    /// A login response at odds with the request (stage, ISID, version, transit).
    Login(&'static str),
    /// A key value that is not valid for its key.
    BadValue {
        key: String,
        value: String,
    },
    /// A data segment longer than its PDU allows (e.g. sense length past the segment).
    Malformed(&'static str),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Frame(e) => write!(f, "framing: {e}"),
            ProtocolError::UnknownOpcode(op) => write!(f, "unknown opcode {op:#04x}"),
            ProtocolError::UnexpectedOpcode(op) => write!(f, "unexpected opcode {op:#04x}"),
            ProtocolError::UnknownItt { opcode, itt } => {
                write!(f, "opcode {opcode:#04x} for unknown ITT {itt:#010x}")
            }
            ProtocolError::DataBeyondLength { itt, end, expected } => write!(
                f,
                "Data-In for ITT {itt:#010x} ends at {end}, past the expected {expected} bytes"
            ),
            ProtocolError::DataSn { itt, got, want } => {
                write!(f, "ITT {itt:#010x}: DataSN {got}, expected {want}")
            }
            ProtocolError::WrongDirection { itt, opcode } => write!(
                f,
                "opcode {opcode:#04x} for ITT {itt:#010x}, which transfers no data that way"
            ),
            ProtocolError::BadR2t { itt, offset, len } => write!(
                f,
                "R2T for ITT {itt:#010x} asks for {len} bytes at {offset}, outside the command"
            ),
            ProtocolError::Text(e) => write!(f, "text: {e}"),
            ProtocolError::TextTooLong(n) => write!(f, "text response longer than {n} bytes"),
            ProtocolError::Login(why) => write!(f, "login response: {why}"),
            ProtocolError::BadValue { key, value } => write!(f, "bad value {key}={value}"),
            ProtocolError::Malformed(why) => write!(f, "malformed PDU: {why}"),
        }
    }
}

/// CHAP failures, ours or the target's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// The target chose an AuthMethod we did not offer (or refused ours).
    MethodRefused(String),
    /// CHAP_A not one we offered.
    Algorithm(String),
    /// CHAP_I missing or not a number in 0..=255.
    Identifier(String),
    /// CHAP_C missing, not a binary value, empty, too long, or our own challenge reflected.
    Challenge(&'static str),
    /// Mutual CHAP: the target's CHAP_N is not the name we expect.
    TargetName(String),
    /// Mutual CHAP: the target's CHAP_R is missing or wrong — the target is not who it says.
    TargetResponse,
    /// A CHAP key missing from a response that needs it.
    Missing(&'static str),
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::MethodRefused(m) => write!(f, "target answered AuthMethod={m}"),
            AuthError::Algorithm(a) => write!(f, "target chose CHAP_A={a}, which we did not offer"),
            AuthError::Identifier(i) => write!(f, "bad CHAP_I {i:?}"),
            AuthError::Challenge(why) => write!(f, "bad CHAP_C: {why}"),
            AuthError::TargetName(n) => write!(f, "mutual CHAP: unexpected target name {n:?}"),
            AuthError::TargetResponse => {
                write!(f, "mutual CHAP: the target's response is wrong")
            }
            AuthError::Missing(k) => write!(f, "CHAP: {k} missing"),
        }
    }
}

/// Why a login failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoginError {
    /// Status class 1: the target is elsewhere (`TargetAddress`).
    Redirect {
        permanent: bool,
        address: String,
    },
    /// Status class 2 (initiator error), with its detail (1 authentication failure,
    /// 2 authorization failure, 3 not found, 4 removed, ...).
    Initiator {
        detail: u8,
    },
    /// Status class 3 (target error: 0 target error, 1 service unavailable, 2 out of resources).
    Target {
        detail: u8,
    },
    /// Any other status class.
    Status {
        class: u8,
        detail: u8,
    },
    Auth(AuthError),
    /// The target answered an operational key with a value we cannot work with.
    Negotiation {
        key: String,
        value: String,
    },
    /// More login exchanges than we allow.
    TooManyRounds,
}

impl LoginError {
    /// A short name of the status (as RFC 7143 §11.13.5 names it).
    pub fn describe(&self) -> String {
        match self {
            LoginError::Initiator { detail } => {
                let name = match detail {
                    0x00 => "initiator error",
                    0x01 => "authentication failure",
                    0x02 => "authorization failure",
                    0x03 => "target not found",
                    0x04 => "target removed",
                    0x05 => "unsupported version",
                    0x06 => "too many connections",
                    0x07 => "missing parameter",
                    0x08 => "can't include in session",
                    0x09 => "session type not supported",
                    0x0a => "session does not exist",
                    0x0b => "invalid request during login",
                    _ => "initiator error (unknown detail)",
                };
                format!("{name} (02{detail:02x})")
            }
            LoginError::Target { detail } => {
                let name = match detail {
                    0x00 => "target error",
                    0x01 => "service unavailable",
                    0x02 => "out of resources",
                    _ => "target error (unknown detail)",
                };
                format!("{name} (03{detail:02x})")
            }
            other => other.to_string(),
        }
    }
}

impl fmt::Display for LoginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoginError::Redirect { permanent, address } => write!(
                f,
                "redirected ({}) to {address}",
                if *permanent {
                    "permanently"
                } else {
                    "temporarily"
                }
            ),
            LoginError::Initiator { .. } | LoginError::Target { .. } => {
                write!(f, "login refused: {}", self.describe())
            }
            LoginError::Status { class, detail } => {
                write!(f, "login status {class:02x}{detail:02x}")
            }
            LoginError::Auth(e) => write!(f, "authentication: {e}"),
            LoginError::Negotiation { key, value } => {
                write!(f, "target answered {key}={value}, which we cannot use")
            }
            LoginError::TooManyRounds => write!(f, "too many login exchanges"),
        }
    }
}

/// A connection- or session-level error.
#[derive(Debug)]
pub enum Error {
    Io(std::io::Error),
    /// Nothing arrived within the time allowed (`what` names the wait).
    Timeout {
        what: &'static str,
        after: Duration,
    },
    /// The target closed the connection.
    Closed,
    Protocol(ProtocolError),
    Login(LoginError),
    /// Too many commands outstanding ([`crate::config::SessionConfig::max_outstanding_commands`]).
    Full,
    /// A command the session cannot send (CDB too long, data larger than the EDTL field).
    InvalidCommand(&'static str),
    /// The session is not (or no longer) in full feature phase.
    NotConnected,
    /// A bad `iscsi://` URL or address.
    Url(String),
    /// A command failed (blocking helpers only).
    Command(CommandError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(e) => write!(f, "I/O: {e}"),
            Error::Timeout { what, after } => write!(f, "timed out after {after:?}: {what}"),
            Error::Closed => write!(f, "the target closed the connection"),
            Error::Protocol(e) => write!(f, "protocol error: {e}"),
            Error::Login(e) => write!(f, "login failed: {e}"),
            Error::Full => write!(f, "too many commands outstanding"),
            Error::InvalidCommand(why) => write!(f, "invalid command: {why}"),
            Error::NotConnected => write!(f, "not in full feature phase"),
            Error::Url(why) => write!(f, "bad iSCSI URL: {why}"),
            Error::Command(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}
impl From<ProtocolError> for Error {
    fn from(e: ProtocolError) -> Self {
        Error::Protocol(e)
    }
}
impl From<LoginError> for Error {
    fn from(e: LoginError) -> Self {
        Error::Login(e)
    }
}
impl From<AuthError> for Error {
    fn from(e: AuthError) -> Self {
        Error::Login(LoginError::Auth(e))
    }
}

impl Error {
    /// Whether a new connection may help (the target went away, stopped answering, or broke
    /// the protocol), as opposed to a refusal or a bad request.
    pub fn is_connection_loss(&self) -> bool {
        match self {
            Error::Io(_) | Error::Timeout { .. } | Error::Closed | Error::Protocol(_) => true,
            Error::NotConnected => true,
            Error::Command(c) => c.is_connection_loss(),
            _ => false,
        }
    }
}

/// Why a command has no SCSI status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandError {
    /// Not answered within the command timeout (the session sent ABORT TASK for it).
    Timeout,
    /// The connection failed before its status arrived; the command may or may not have run.
    ConnectionLost(String),
    /// The target rejected the PDU (Reject reason code).
    Rejected(u8),
    /// SCSI Response with a non-zero iSCSI response code (1: target failure).
    TargetFailure(u8),
    /// Aborted by task management (ours) before its status arrived.
    Aborted,
}

impl CommandError {
    pub fn is_connection_loss(&self) -> bool {
        matches!(
            self,
            CommandError::ConnectionLost(_) | CommandError::Timeout
        )
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandError::Timeout => write!(f, "command timed out"),
            CommandError::ConnectionLost(why) => write!(f, "connection lost: {why}"),
            CommandError::Rejected(r) => write!(f, "rejected by the target (reason {r:#04x})"),
            CommandError::TargetFailure(r) => write!(f, "target failure (response {r:#04x})"),
            CommandError::Aborted => write!(f, "aborted by task management"),
        }
    }
}

impl std::error::Error for CommandError {}
impl std::error::Error for ProtocolError {}
impl std::error::Error for LoginError {}
impl std::error::Error for AuthError {}
