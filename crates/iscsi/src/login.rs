//! The login phase (RFC 7143 §6.3, §11.12-11.13): stages, text accumulation, names, admission,
//! authentication and operational negotiation, ending in full feature phase or a failure status.
//!
//! The state machine does no I/O: it takes one received PDU and appends one Login Response to an
//! output buffer. Decisions that need the target's configuration (does this target exist, may this
//! initiator log in, which TSIH) go through [`LoginPolicy`], implemented by the engine.

use crate::chap::{self, Algorithm, Credential};
use crate::negotiation::{Negotiator, SessionParams, SessionType, TargetLimits};
use crate::pdu::{self, off, Bhs, Framing, Opcode, Pdu};
use crate::text;
use seam::name::NodeName;

/// A Login Response status (class, detail), RFC 7143 §11.13.5.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoginStatus {
    pub class: u8,
    pub detail: u8,
}

impl LoginStatus {
    const fn new(class: u8, detail: u8) -> LoginStatus {
        LoginStatus { class, detail }
    }
    pub const SUCCESS: LoginStatus = LoginStatus::new(0, 0);
    pub const INITIATOR_ERROR: LoginStatus = LoginStatus::new(2, 0x00);
    pub const AUTH_FAILED: LoginStatus = LoginStatus::new(2, 0x01);
    pub const FORBIDDEN: LoginStatus = LoginStatus::new(2, 0x02);
    pub const NOT_FOUND: LoginStatus = LoginStatus::new(2, 0x03);
    pub const TARGET_REMOVED: LoginStatus = LoginStatus::new(2, 0x04);
    pub const UNSUPPORTED_VERSION: LoginStatus = LoginStatus::new(2, 0x05);
    pub const TOO_MANY_CONNECTIONS: LoginStatus = LoginStatus::new(2, 0x06);
    pub const MISSING_PARAMETER: LoginStatus = LoginStatus::new(2, 0x07);
    pub const CANT_INCLUDE_IN_SESSION: LoginStatus = LoginStatus::new(2, 0x08);
    pub const SESSION_TYPE_UNSUPPORTED: LoginStatus = LoginStatus::new(2, 0x09);
    pub const SESSION_DOES_NOT_EXIST: LoginStatus = LoginStatus::new(2, 0x0a);
    pub const INVALID_DURING_LOGIN: LoginStatus = LoginStatus::new(2, 0x0b);
    pub const TARGET_ERROR: LoginStatus = LoginStatus::new(3, 0x00);
    pub const SERVICE_UNAVAILABLE: LoginStatus = LoginStatus::new(3, 0x01);
    pub const OUT_OF_RESOURCES: LoginStatus = LoginStatus::new(3, 0x02);

    pub fn is_success(&self) -> bool {
        self.class == 0
    }
}

impl std::fmt::Display for LoginStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match (self.class, self.detail) {
            (0, _) => "success",
            (2, 0x00) => "initiator error",
            (2, 0x01) => "authentication failure",
            (2, 0x02) => "initiator not authorized",
            (2, 0x03) => "target not found",
            (2, 0x04) => "target removed",
            (2, 0x05) => "unsupported version",
            (2, 0x06) => "too many connections",
            (2, 0x07) => "missing parameter",
            (2, 0x08) => "cannot include in session",
            (2, 0x09) => "session type not supported",
            (2, 0x0a) => "session does not exist",
            (2, 0x0b) => "invalid request during login",
            (3, 0x00) => "target error",
            (3, 0x01) => "service unavailable",
            (3, 0x02) => "out of resources",
            _ => "other",
        };
        write!(f, "{:02x}{:02x} ({what})", self.class, self.detail)
    }
}

/// Login stages as carried in CSG/NSG.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    Security = 0,
    Operational = 1,
    FullFeature = 3,
}

impl Stage {
    fn from_bits(bits: u8) -> Option<Stage> {
        match bits & 3 {
            0 => Some(Stage::Security),
            1 => Some(Stage::Operational),
            3 => Some(Stage::FullFeature),
            _ => None,
        }
    }
}

/// What the target requires before a session may proceed past the security stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthRequirement {
    /// AuthMethod=None is acceptable (and CHAP is refused: there is nothing to check it with).
    None,
    /// AuthMethod=CHAP is required; an initiator offering only None fails with 0x0201.
    Chap(ChapRequirement),
}

/// The credentials of one CHAP login, resolved by the engine for this initiator and target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChapRequirement {
    /// The names and secrets the initiator may authenticate with (CHAP_N, compared exactly).
    pub users: Vec<Credential>,
    /// The target's own name and secret for mutual CHAP; `None`: an initiator asking the target
    /// to authenticate itself fails with 0x0201.
    pub mutual: Option<Credential>,
    /// Algorithms the target accepts, in order of preference (the first one the initiator also
    /// offers is chosen).
    pub algorithms: Vec<Algorithm>,
}

impl ChapRequirement {
    /// One user, no mutual CHAP, every algorithm.
    pub fn one_way(user: Credential) -> ChapRequirement {
        ChapRequirement {
            users: vec![user],
            mutual: None,
            algorithms: Algorithm::ALL.to_vec(),
        }
    }
}

/// Why a login failed, for the engine's log (never carries a secret or a response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// The initiator offered no AuthMethod the target accepts (e.g. only None, CHAP required).
    MethodRefused,
    /// CHAP_A listed no algorithm the target accepts.
    NoCommonAlgorithm,
    /// CHAP_N names no configured user.
    UnknownUser,
    /// CHAP_R is not the response the secret gives (or has the wrong length).
    WrongResponse,
    /// The initiator asked for mutual CHAP but the target has no credentials of its own.
    MutualNotConfigured,
    /// The initiator's challenge equals the target's (a reflection attack).
    ReflectedChallenge,
    /// The initiator tried to leave the security stage before authenticating.
    NotAuthenticated,
    /// A CHAP key out of order, repeated, missing or malformed.
    Protocol(&'static str),
    /// InitiatorName or TargetName is not an iSCSI name (a character RFC 3722 prohibits, too
    /// long): not an authentication failure, but the reason the login was refused.
    MalformedName,
}

impl std::fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthFailure::MethodRefused => f.write_str("no acceptable AuthMethod offered"),
            AuthFailure::NoCommonAlgorithm => f.write_str("no common CHAP algorithm"),
            AuthFailure::UnknownUser => f.write_str("unknown CHAP user"),
            AuthFailure::WrongResponse => f.write_str("wrong CHAP response"),
            AuthFailure::MutualNotConfigured => {
                f.write_str("mutual CHAP requested but not configured for the target")
            }
            AuthFailure::ReflectedChallenge => {
                f.write_str("initiator reflected the target's challenge")
            }
            AuthFailure::NotAuthenticated => f.write_str("left the security stage unauthenticated"),
            AuthFailure::Protocol(what) => write!(f, "CHAP protocol error: {what}"),
            AuthFailure::MalformedName => {
                f.write_str("InitiatorName or TargetName is not an iSCSI name (RFC 3722)")
            }
        }
    }
}

/// Where the CHAP exchange of this login stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Auth {
    /// No AuthMethod agreed yet.
    Start,
    /// AuthMethod=None agreed (or implied): CHAP keys are out of order.
    NoneAgreed,
    /// AuthMethod=CHAP answered: the next request carries CHAP_A.
    ChapAgreed,
    /// CHAP_A/CHAP_I/CHAP_C answered: the next request carries CHAP_N/CHAP_R.
    Challenged {
        algorithm: Algorithm,
        id: u8,
        challenge: Vec<u8>,
    },
    /// CHAP succeeded: no more CHAP keys.
    ChapDone { user: String },
}

/// The engine's answer to "may this initiator log in here?".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub target_alias: Option<String>,
    pub portal_group_tag: u16,
    pub auth: AuthRequirement,
}

/// Identity of the connection being logged in, passed to [`LoginPolicy::open_session`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionKey {
    pub initiator_name: NodeName,
    pub isid: [u8; 6],
    pub target_name: Option<NodeName>,
    pub tsih: u16,
}

pub trait LoginPolicy {
    /// A normal session to `target_name`: may `initiator_name` log in?
    fn admit(
        &mut self,
        initiator_name: &NodeName,
        target_name: &NodeName,
    ) -> Result<Admission, LoginStatus>;
    /// A discovery session.
    fn admit_discovery(&mut self, initiator_name: &NodeName) -> Result<Admission, LoginStatus>;
    /// The login is about to succeed: register the session (reinstating an older one with the same
    /// initiator name and ISID) and return its TSIH.
    fn open_session(
        &mut self,
        key: &SessionKey,
        session_type: SessionType,
    ) -> Result<u16, LoginStatus>;
    /// Fills `buf` with unpredictable bytes (CHAP identifiers and challenges). The core has no
    /// randomness of its own: the engine uses the OS's CSPRNG, tests a fixed pattern. An error
    /// (no randomness to be had) fails the login with that status: never a guessable challenge.
    fn fill_random(&mut self, buf: &mut [u8]) -> Result<(), LoginStatus>;
}

/// Everything full feature phase needs from a successful login.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Established {
    pub session_type: SessionType,
    pub initiator_name: NodeName,
    pub initiator_alias: Option<String>,
    pub target_name: Option<NodeName>,
    pub portal_group_tag: u16,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub cid: u16,
    pub params: SessionParams,
    /// The CHAP user the initiator authenticated as; `None` for AuthMethod=None.
    pub chap_user: Option<String>,
    /// The StatSN of the next response after the final Login Response.
    pub next_stat_sn: u32,
    /// The CmdSN the first full-feature command carries.
    pub exp_cmd_sn: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoginStep {
    /// A response was written; wait for the next Login Request.
    Continue,
    /// The final response was written: enter full feature phase.
    Complete(Box<Established>),
    /// A failure response was written (when one can be); close the connection after sending it.
    Failed(LoginStatus),
}

#[derive(Clone, Copy, Debug)]
struct Identity {
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
}

/// Limits on one login (DESIGN.md: everything bounded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoginLimits {
    pub max_keys: usize,
    /// Bytes of text across continued (C bit) Login Requests.
    pub max_text_bytes: usize,
    /// Login Requests per login before we give up on the initiator.
    pub max_requests: usize,
    /// The CmdSN window opened at the start of full feature phase.
    pub queue_depth: u32,
}

impl Default for LoginLimits {
    fn default() -> Self {
        LoginLimits {
            max_keys: 64,
            max_text_bytes: 32 * 1024,
            max_requests: 16,
            queue_depth: 128,
        }
    }
}

pub struct Login {
    limits: LoginLimits,
    target_limits: TargetLimits,
    state: State,
    stat_sn: u32,
    requests: usize,
    continued_text: Vec<u8>,
    /// Why the last step failed, when authentication (or a malformed name) was the reason.
    failure: Option<AuthFailure>,
    /// The request (by count) whose response carried the target's answer to the initiator's
    /// mutual CHAP challenge: the initiator judges it before it sends another.
    proved_at: Option<usize>,
}

/// Where a login stands: one type per stage, holding exactly what is known there, replaced on
/// each transition (as rustls' handshake states are). Nothing is half-known: a login that
/// negotiates has its identity, names, admission and negotiator; one refused keeps only the
/// names it gave, for the log.
enum State {
    /// No Login Request yet.
    Fresh,
    /// The first request's header fixed the connection's identity and current stage; its
    /// text continues (C bit) before it names who logs in.
    Identified(Identity, Stage),
    /// The first text named the initiator and was admitted: the stages and authentication.
    Negotiating(Box<Negotiating>),
    /// Admission refused: every later request fails too.
    Refused(Identity, Names),
    /// The final response was written: full feature phase belongs to the session.
    Complete,
}

/// The names a login gave, as far as it gave them (a refusal is logged with them).
#[derive(Default)]
struct Names {
    initiator: Option<NodeName>,
    target: Option<NodeName>,
}

/// An admitted login: everything fixed by its first text, and where it stands now.
struct Negotiating {
    identity: Identity,
    stage: Stage,
    initiator: NodeName,
    initiator_alias: Option<String>,
    /// None for a discovery session.
    target: Option<NodeName>,
    admission: Admission,
    negotiator: Negotiator,
    auth: Auth,
}

/// A step that failed: the status to answer with and, for the log, why authentication failed.
struct Failed {
    status: LoginStatus,
    why: Option<AuthFailure>,
}

impl From<LoginStatus> for Failed {
    fn from(status: LoginStatus) -> Failed {
        Failed { status, why: None }
    }
}

/// An authentication failure answered with `status`.
fn auth_failed(why: AuthFailure, status: LoginStatus) -> Failed {
    Failed {
        status,
        why: Some(why),
    }
}

fn get<'a>(offers: &'a [(String, String)], key: &str) -> Option<&'a str> {
    offers
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl Auth {
    /// Whether the login may leave the security stage.
    fn authenticated(&self) -> bool {
        matches!(self, Auth::NoneAgreed | Auth::ChapDone { .. })
    }
}

impl Login {
    pub fn new(limits: LoginLimits, target_limits: TargetLimits, initial_stat_sn: u32) -> Login {
        Login {
            limits,
            target_limits,
            state: State::Fresh,
            stat_sn: initial_stat_sn,
            requests: 0,
            continued_text: Vec::new(),
            failure: None,
            proved_at: None,
        }
    }

    /// Whether the last response carried the target's answer to the initiator's mutual CHAP
    /// challenge: a login the initiator ends now most likely did not accept the target's secret.
    pub fn proved_itself(&self) -> bool {
        self.proved_at == Some(self.requests)
    }

    /// Why authentication failed, when the last step failed because of it.
    pub fn auth_failure(&self) -> Option<AuthFailure> {
        self.failure
    }

    /// The InitiatorName of this login, once the first request named it.
    pub fn initiator_name(&self) -> Option<&NodeName> {
        match &self.state {
            State::Negotiating(n) => Some(&n.initiator),
            State::Refused(_, names) => names.initiator.as_ref(),
            _ => None,
        }
    }

    /// The TargetName of this login (normal sessions), once the first request named it.
    pub fn target_name(&self) -> Option<&NodeName> {
        match &self.state {
            State::Negotiating(n) => n.target.as_ref(),
            State::Refused(_, names) => names.target.as_ref(),
            _ => None,
        }
    }

    /// The framing used while logging in (no digests, 8 KiB segments).
    pub fn framing(&self) -> Framing {
        Framing::LOGIN
    }

    /// Handles one PDU received during login and appends the response to `out`.
    pub fn handle(
        &mut self,
        pdu: &Pdu<'_>,
        policy: &mut dyn LoginPolicy,
        out: &mut Vec<u8>,
    ) -> LoginStep {
        self.requests += 1;
        self.failure = None;
        if pdu.bhs.opcode_raw() != Opcode::LoginRequest as u8 {
            return self.fail(pdu, LoginStatus::INVALID_DURING_LOGIN, out);
        }
        if self.requests > self.limits.max_requests {
            return self.fail(pdu, LoginStatus::INITIATOR_ERROR, out);
        }
        match self.step(pdu, policy, out) {
            Ok(step) => step,
            Err(failed) => {
                self.failure = failed.why;
                self.fail(pdu, failed.status, out)
            }
        }
    }

    fn step(
        &mut self,
        pdu: &Pdu<'_>,
        policy: &mut dyn LoginPolicy,
        out: &mut Vec<u8>,
    ) -> Result<LoginStep, Failed> {
        let (csg, next_stage) = self.check_header(&pdu.bhs)?;
        if self.continued_text.len() + pdu.data.len() > self.limits.max_text_bytes {
            return Err(LoginStatus::OUT_OF_RESOURCES.into());
        }
        if pdu.bhs.flags() & 0x40 != 0 {
            // Part of a longer text: acknowledge with an empty response and wait for the rest.
            self.continued_text.extend_from_slice(pdu.data);
            self.respond(pdu, csg, None, &[], LoginStatus::SUCCESS, out);
            return Ok(LoginStep::Continue);
        }
        let mut text_bytes = std::mem::take(&mut self.continued_text);
        text_bytes.extend_from_slice(pdu.data);
        let offers = text::parse(&text_bytes, self.limits.max_keys)
            .map_err(|_| LoginStatus::INITIATOR_ERROR)?;

        let mut answers: Vec<(String, String)> = Vec::new();
        match self.state {
            State::Identified(identity, stage) => {
                let admitted = admit(identity, stage, &offers, policy, &self.target_limits);
                self.state = match admitted {
                    Ok((negotiating, told)) => {
                        answers = told;
                        State::Negotiating(Box::new(negotiating))
                    }
                    Err((names, failed)) => {
                        self.state = State::Refused(identity, names);
                        return Err(failed);
                    }
                };
            }
            State::Negotiating(ref n) => n.check_names_unchanged(&offers)?,
            _ => return Err(LoginStatus::TARGET_ERROR.into()),
        }
        let State::Negotiating(n) = &mut self.state else {
            return Err(LoginStatus::TARGET_ERROR.into());
        };
        if n.stage_keys(csg, &offers, policy, &mut answers)? {
            self.proved_at = Some(self.requests);
        }
        n.negotiator
            .respond(&offers, &mut answers)
            .map_err(|_| LoginStatus::INITIATOR_ERROR)?;
        // Only in the operational stage: Linux's open-iscsi fails a login whose security-stage
        // response carries an operational key ("can't accept MaxRecvDataSegmentLength in
        // security stage"), also the one that moves on to the operational stage.
        if csg == Stage::Operational {
            n.negotiator.declarations(&mut answers);
        }

        // The target agrees to move on whenever the initiator asks and authentication is done.
        let agreed_next = next_stage.filter(|_| n.auth.authenticated());
        if agreed_next == Some(Stage::FullFeature) {
            return self.complete(pdu, csg, answers, policy, out);
        }
        if let Some(next) = agreed_next {
            n.stage = next;
        }
        self.respond(pdu, csg, agreed_next, &answers, LoginStatus::SUCCESS, out);
        Ok(LoginStep::Continue)
    }

    /// The Login Request's header against the login so far: the same ISID, TSIH and CID as
    /// the first request (which sets them, with version 0 and a stage before full feature),
    /// the current stage, and a next stage after it when T is set (never with C). Returns the
    /// current stage and the next one asked for.
    fn check_header(&mut self, bhs: &Bhs) -> Result<(Stage, Option<Stage>), LoginStatus> {
        let flags = bhs.flags();
        let transit = flags & 0x80 != 0;
        let cont = flags & 0x40 != 0;
        let csg = Stage::from_bits(flags >> 2).ok_or(LoginStatus::INITIATOR_ERROR)?;
        let identity = Identity {
            isid: bhs.isid(),
            tsih: bhs.u16_at(off::TSIH),
            cid: bhs.u16_at(off::CID),
        };
        let (first, stage) = match &self.state {
            State::Fresh => {
                // We speak version 0 only (RFC 7143 §11.12.4).
                let version_max = bhs.byte(off::VERSION_MAX);
                let version_min = bhs.byte(off::VERSION_MIN);
                if version_min > 0 || version_max < version_min {
                    return Err(LoginStatus::UNSUPPORTED_VERSION);
                }
                if csg == Stage::FullFeature {
                    return Err(LoginStatus::INITIATOR_ERROR);
                }
                self.state = State::Identified(identity, csg);
                (identity, csg)
            }
            State::Identified(first, stage) => (*first, *stage),
            State::Negotiating(n) => (n.identity, n.stage),
            State::Refused(..) | State::Complete => return Err(LoginStatus::INITIATOR_ERROR),
        };
        if !first.same(&identity) || csg != stage || (transit && cont) {
            return Err(LoginStatus::INITIATOR_ERROR);
        }
        if !transit {
            return Ok((csg, None));
        }
        let nsg = Stage::from_bits(flags & 3).ok_or(LoginStatus::INITIATOR_ERROR)?;
        if nsg <= csg {
            return Err(LoginStatus::INITIATOR_ERROR);
        }
        Ok((csg, Some(nsg)))
    }

    /// The final step: the session opened with the policy, then the login complete.
    fn complete(
        &mut self,
        pdu: &Pdu<'_>,
        csg: Stage,
        answers: Vec<(String, String)>,
        policy: &mut dyn LoginPolicy,
        out: &mut Vec<u8>,
    ) -> Result<LoginStep, Failed> {
        let State::Negotiating(n) = &self.state else {
            return Err(LoginStatus::TARGET_ERROR.into());
        };
        let key = SessionKey {
            initiator_name: n.initiator.clone(),
            isid: n.identity.isid,
            target_name: n.target.clone(),
            tsih: n.identity.tsih,
        };
        // Opened before the state is given up: a refusal here is logged with the login's names.
        let tsih = policy.open_session(&key, n.negotiator.session_type)?;
        let State::Negotiating(n) = std::mem::replace(&mut self.state, State::Complete) else {
            unreachable!("matched above");
        };
        let mut params = n.negotiator.params;
        if !negotiator_declared(&answers, &n.negotiator) {
            // We never told the initiator our limit, so it assumes the RFC default.
            params.max_recv_data_segment_length = 8192;
        }
        let established = Established {
            session_type: n.negotiator.session_type,
            initiator_name: n.initiator,
            initiator_alias: n.initiator_alias,
            target_name: n.target,
            portal_group_tag: n.admission.portal_group_tag,
            isid: n.identity.isid,
            tsih,
            cid: n.identity.cid,
            params,
            chap_user: match n.auth {
                Auth::ChapDone { user } => Some(user),
                _ => None,
            },
            next_stat_sn: self.stat_sn.wrapping_add(1),
            // What this last Login Response tells the initiator (ExpCmdSN = its CmdSN), even if
            // an initiator changed CmdSN between its Login Requests (found by fuzz(login)).
            exp_cmd_sn: pdu.bhs.u32_at(off::CMD_SN),
        };
        let next = Some(Stage::FullFeature);
        self.respond_full(pdu, csg, next, &answers, LoginStatus::SUCCESS, tsih, out);
        Ok(LoginStep::Complete(Box::new(established)))
    }

    fn fail(&mut self, pdu: &Pdu<'_>, status: LoginStatus, out: &mut Vec<u8>) -> LoginStep {
        let csg = Stage::from_bits(pdu.bhs.flags() >> 2).unwrap_or(Stage::Security);
        self.respond(pdu, csg, None, &[], status, out);
        LoginStep::Failed(status)
    }

    fn respond(
        &mut self,
        pdu: &Pdu<'_>,
        csg: Stage,
        next: Option<Stage>,
        answers: &[(String, String)],
        status: LoginStatus,
        out: &mut Vec<u8>,
    ) {
        let tsih = match &self.state {
            State::Identified(identity, _) | State::Refused(identity, _) => identity.tsih,
            State::Negotiating(n) => n.identity.tsih,
            State::Fresh | State::Complete => 0,
        };
        self.respond_full(pdu, csg, next, answers, status, tsih, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn respond_full(
        &mut self,
        pdu: &Pdu<'_>,
        csg: Stage,
        next: Option<Stage>,
        answers: &[(String, String)],
        status: LoginStatus,
        tsih: u16,
        out: &mut Vec<u8>,
    ) {
        let window = if next == Some(Stage::FullFeature) {
            self.limits.queue_depth
        } else {
            1
        };
        let bhs = pdu::LoginResponse {
            request: &pdu.bhs,
            csg: csg as u8,
            transit_to: next.map(|n| n as u8),
            tsih,
            stat_sn: self.stat_sn,
            window,
            status: (status.class, status.detail),
        }
        .bhs();
        let data = text::encode(answers);
        // Every Login Response consumes a StatSN (RFC 7143 §11.13.4).
        self.stat_sn = self.stat_sn.wrapping_add(1);
        pdu::encode_into(out, &bhs, &data, &Framing::LOGIN);
    }
}

/// Keys, in the order sent.
type Keys = Vec<(String, String)>;

/// The first text of a login: who logs in (InitiatorName; TargetName for a normal session),
/// asked of the policy. The session's negotiation state and the keys to answer, or the names
/// given (for the log) and why it was refused.
fn admit(
    identity: Identity,
    stage: Stage,
    offers: &[(String, String)],
    policy: &mut dyn LoginPolicy,
    target_limits: &TargetLimits,
) -> Result<(Negotiating, Keys), (Names, Failed)> {
    let mut names = Names::default();
    let mut answers = Vec::new();
    let refused = |names, failed: Failed| Err((names, failed));
    let initiator = match get(offers, "InitiatorName") {
        None | Some("") => return refused(names, LoginStatus::MISSING_PARAMETER.into()),
        Some(name) => name,
    };
    // Normalised once, here: every decision about who this initiator is compares this form.
    let Ok(initiator) = NodeName::from_wire(initiator) else {
        let failed = auth_failed(AuthFailure::MalformedName, LoginStatus::INITIATOR_ERROR);
        return refused(names, failed);
    };
    // Known from here on, so that a refusal below is logged with the names it refused.
    names.initiator = Some(initiator.clone());
    let session_type = match get(offers, "SessionType").unwrap_or("Normal") {
        "Normal" => SessionType::Normal,
        "Discovery" => SessionType::Discovery,
        _ => return refused(names, LoginStatus::SESSION_TYPE_UNSUPPORTED.into()),
    };
    let admission = match session_type {
        SessionType::Normal => {
            let Some(target) = get(offers, "TargetName") else {
                return refused(names, LoginStatus::MISSING_PARAMETER.into());
            };
            // No target has a name that is not one.
            let Ok(target) = NodeName::from_wire(target) else {
                let failed = auth_failed(AuthFailure::MalformedName, LoginStatus::NOT_FOUND);
                return refused(names, failed);
            };
            names.target = Some(target.clone());
            let admission = match policy.admit(&initiator, &target) {
                Ok(admission) => admission,
                Err(status) => return refused(names, status.into()),
            };
            let tag = admission.portal_group_tag.to_string();
            answers.push(("TargetPortalGroupTag".into(), tag));
            if let Some(alias) = &admission.target_alias {
                answers.push(("TargetAlias".into(), alias.clone()));
            }
            admission
        }
        SessionType::Discovery => match policy.admit_discovery(&initiator) {
            Ok(admission) => admission,
            Err(status) => return refused(names, status.into()),
        },
    };
    let negotiating = Negotiating {
        identity,
        stage,
        initiator,
        initiator_alias: get(offers, "InitiatorAlias").map(str::to_string),
        target: names.target,
        admission,
        negotiator: Negotiator::new(target_limits.clone(), session_type),
        auth: Auth::Start,
    };
    Ok((negotiating, answers))
}

impl Identity {
    fn same(&self, other: &Identity) -> bool {
        self.isid == other.isid && self.tsih == other.tsih && self.cid == other.cid
    }
}

impl Negotiating {
    /// Names are fixed by the first request; a later request may repeat but not change them.
    fn check_names_unchanged(&self, offers: &[(String, String)]) -> Result<(), LoginStatus> {
        for (key, value) in offers {
            let fixed = match key.as_str() {
                "InitiatorName" => Some(&self.initiator),
                "TargetName" => self.target.as_ref(),
                _ => continue,
            };
            // The same name in another spelling is the same name.
            if fixed.is_none() || NodeName::from_wire(value).ok().as_ref() != fixed {
                return Err(LoginStatus::INITIATOR_ERROR);
            }
        }
        Ok(())
    }

    /// What the current stage requires of the keys: the security stage negotiates
    /// authentication; the operational stage takes no CHAP key (RFC 7143 §6.3) and, without
    /// authentication, needs a group that requires none. True when the answers carry the
    /// target's proof to the initiator's mutual CHAP challenge.
    fn stage_keys(
        &mut self,
        csg: Stage,
        offers: &[(String, String)],
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<bool, Failed> {
        match csg {
            Stage::Security => self.security(offers, policy, answers),
            Stage::Operational => {
                if offers.iter().any(|(k, _)| k.starts_with("CHAP_")) {
                    return Err(auth_failed(
                        AuthFailure::Protocol("security key in the operational stage"),
                        LoginStatus::INITIATOR_ERROR,
                    ));
                }
                if !self.auth.authenticated() {
                    self.require_no_auth()?;
                }
                Ok(false)
            }
            Stage::FullFeature => Err(LoginStatus::INITIATOR_ERROR.into()),
        }
    }

    /// Without authentication: allowed when the admission requires none (AuthMethod=None,
    /// agreed or implied).
    fn require_no_auth(&mut self) -> Result<(), Failed> {
        match self.admission.auth {
            AuthRequirement::None => {
                self.auth = Auth::NoneAgreed;
                Ok(())
            }
            AuthRequirement::Chap(_) => Err(auth_failed(
                AuthFailure::NotAuthenticated,
                LoginStatus::AUTH_FAILED,
            )),
        }
    }

    /// The security stage: AuthMethod, then (for CHAP) CHAP_A, then CHAP_N/CHAP_R (and the
    /// initiator's CHAP_I/CHAP_C for mutual CHAP), one step per request, RFC 7143 §12.1.3.
    /// True when the answers carry the target's proof (mutual CHAP).
    fn security(
        &mut self,
        offers: &[(String, String)],
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<bool, Failed> {
        let chap_keys = offers.iter().any(|(k, _)| k.starts_with("CHAP_"));
        if let Some(methods) = get(offers, "AuthMethod") {
            self.auth_method(methods, chap_keys, answers)?;
            return Ok(false);
        }
        let protocol =
            |what| auth_failed(AuthFailure::Protocol(what), LoginStatus::INITIATOR_ERROR);
        match std::mem::replace(&mut self.auth, Auth::Start) {
            Auth::Start if chap_keys => Err(protocol("CHAP keys before AuthMethod")),
            // No AuthMethod offered: the default is None.
            Auth::Start => self.require_no_auth().map(|()| false),
            state @ (Auth::NoneAgreed | Auth::ChapDone { .. }) => {
                self.auth = state;
                match chap_keys {
                    true => Err(protocol("CHAP keys after authentication")),
                    false => Ok(false),
                }
            }
            Auth::ChapAgreed => {
                let AuthRequirement::Chap(req) = &self.admission.auth else {
                    return Err(LoginStatus::TARGET_ERROR.into());
                };
                self.auth = chap_algorithm(offers, req, policy, answers)?;
                Ok(false)
            }
            Auth::Challenged {
                algorithm,
                id,
                challenge,
            } => {
                let AuthRequirement::Chap(req) = &self.admission.auth else {
                    return Err(LoginStatus::TARGET_ERROR.into());
                };
                let asked = Asked {
                    algorithm,
                    id,
                    challenge: &challenge,
                };
                let (user, proved) = chap_response(offers, req, asked, answers)?;
                self.auth = Auth::ChapDone { user };
                Ok(proved)
            }
        }
    }

    /// AuthMethod=<list>: the method the admission requires, if offered.
    fn auth_method(
        &mut self,
        methods: &str,
        chap_keys: bool,
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), Failed> {
        let protocol =
            |what| auth_failed(AuthFailure::Protocol(what), LoginStatus::INITIATOR_ERROR);
        if self.auth != Auth::Start {
            // Already negotiated: a key may not be negotiated twice.
            return Err(protocol("AuthMethod sent twice"));
        }
        if chap_keys {
            return Err(protocol("CHAP keys before AuthMethod was agreed"));
        }
        let (method, agreed) = match self.admission.auth {
            AuthRequirement::None => ("None", Auth::NoneAgreed),
            AuthRequirement::Chap(_) => ("CHAP", Auth::ChapAgreed),
        };
        if !methods.split(',').any(|m| m == method) {
            // The initiator insists on a method we were not configured for.
            return Err(auth_failed(
                AuthFailure::MethodRefused,
                LoginStatus::AUTH_FAILED,
            ));
        }
        answers.push(("AuthMethod".into(), method.into()));
        self.auth = agreed;
        Ok(())
    }
}

/// The target's challenge, as the CHAP_A step sent it.
struct Asked<'a> {
    algorithm: Algorithm,
    id: u8,
    challenge: &'a [u8],
}

/// CHAP_A=<list> → CHAP_A, CHAP_I, CHAP_C: the next state, challenged.
fn chap_algorithm(
    offers: &[(String, String)],
    req: &ChapRequirement,
    policy: &mut dyn LoginPolicy,
    answers: &mut Vec<(String, String)>,
) -> Result<Auth, Failed> {
    let protocol = |what, status| auth_failed(AuthFailure::Protocol(what), status);
    if offers
        .iter()
        .any(|(k, _)| k.starts_with("CHAP_") && k != "CHAP_A")
    {
        return Err(protocol(
            "CHAP key other than CHAP_A before the challenge",
            LoginStatus::INITIATOR_ERROR,
        ));
    }
    let Some(list) = get(offers, "CHAP_A") else {
        return Err(protocol("CHAP_A missing", LoginStatus::MISSING_PARAMETER));
    };
    // Unknown or malformed entries are ignored (RFC 7143 §6.2: the responder picks from
    // what it understands); an empty intersection fails.
    let offered: Vec<Algorithm> = list
        .split(',')
        .filter_map(|v| v.trim().parse::<u32>().ok())
        .filter_map(Algorithm::from_code)
        .collect();
    let Some(&algorithm) = req.algorithms.iter().find(|a| offered.contains(a)) else {
        return Err(auth_failed(
            AuthFailure::NoCommonAlgorithm,
            LoginStatus::AUTH_FAILED,
        ));
    };
    let mut random = [0u8; 1 + chap::CHALLENGE_BYTES];
    policy.fill_random(&mut random)?;
    let id = random[0];
    let challenge = random[1..].to_vec();
    answers.push(("CHAP_A".into(), algorithm.code().to_string()));
    answers.push(("CHAP_I".into(), id.to_string()));
    answers.push(("CHAP_C".into(), chap::encode_hex(&challenge)));
    Ok(Auth::Challenged {
        algorithm,
        id,
        challenge,
    })
}

/// CHAP_N, CHAP_R [, CHAP_I, CHAP_C] → verified [; CHAP_N, CHAP_R for mutual CHAP].
/// Returns the authenticated user name, and whether the answers carry the target's proof.
fn chap_response(
    offers: &[(String, String)],
    req: &ChapRequirement,
    asked: Asked<'_>,
    answers: &mut Vec<(String, String)>,
) -> Result<(String, bool), Failed> {
    let protocol = |what, status| auth_failed(AuthFailure::Protocol(what), status);
    if get(offers, "CHAP_A").is_some() {
        return Err(protocol("CHAP_A sent twice", LoginStatus::INITIATOR_ERROR));
    }
    let (Some(name), Some(response)) = (get(offers, "CHAP_N"), get(offers, "CHAP_R")) else {
        return Err(protocol(
            "CHAP_N or CHAP_R missing",
            LoginStatus::MISSING_PARAMETER,
        ));
    };
    let mutual = match (get(offers, "CHAP_I"), get(offers, "CHAP_C")) {
        (None, None) => None,
        (Some(i), Some(c)) => Some((i, c)),
        _ => {
            return Err(protocol(
                "CHAP_I without CHAP_C or the reverse",
                LoginStatus::MISSING_PARAMETER,
            ))
        }
    };
    if name.is_empty() || name.len() > chap::USER_BYTES_MAX {
        return Err(protocol(
            "CHAP_N empty or too long",
            LoginStatus::INITIATOR_ERROR,
        ));
    }
    let Ok(received) = chap::decode_binary(response) else {
        return Err(protocol(
            "CHAP_R is not a binary value",
            LoginStatus::INITIATOR_ERROR,
        ));
    };
    verify_user(req, &asked, name, &received)?;
    let Some((peer_id, peer_challenge)) = mutual else {
        return Ok((name.to_string(), false));
    };
    let answer = mutual_answer(req, &asked, peer_id, peer_challenge)?;
    answers.extend(answer);
    Ok((name.to_string(), true))
}

/// Whether `name` is a configured user whose secret gives `received` for the challenge asked.
/// Every user's response is computed and compared in constant time, named or not, so the work
/// done does not reveal whether the name exists.
fn verify_user(
    req: &ChapRequirement,
    asked: &Asked<'_>,
    name: &str,
    received: &[u8],
) -> Result<(), Failed> {
    let mut matched = false;
    let mut known = false;
    for user in &req.users {
        let expected = asked
            .algorithm
            .response(asked.id, &user.secret, asked.challenge);
        let response_ok = chap::responses_match(&expected, received);
        let is_name = user.user == name;
        known |= is_name;
        matched |= is_name & response_ok;
    }
    match (known, matched) {
        (false, _) => Err(auth_failed(
            AuthFailure::UnknownUser,
            LoginStatus::AUTH_FAILED,
        )),
        (true, false) => Err(auth_failed(
            AuthFailure::WrongResponse,
            LoginStatus::AUTH_FAILED,
        )),
        (true, true) => Ok(()),
    }
}

/// The target's CHAP_N and CHAP_R answering the initiator's own challenge (mutual CHAP).
fn mutual_answer(
    req: &ChapRequirement,
    asked: &Asked<'_>,
    peer_id: &str,
    peer_challenge: &str,
) -> Result<[(String, String); 2], Failed> {
    let protocol = |what| auth_failed(AuthFailure::Protocol(what), LoginStatus::INITIATOR_ERROR);
    let Some(target) = &req.mutual else {
        return Err(auth_failed(
            AuthFailure::MutualNotConfigured,
            LoginStatus::AUTH_FAILED,
        ));
    };
    let Some(peer_id) = chap::parse_identifier(peer_id) else {
        return Err(protocol("CHAP_I is not a number in 0..=255"));
    };
    let Ok(peer_challenge) = chap::decode_binary(peer_challenge) else {
        return Err(protocol("CHAP_C is not a binary value"));
    };
    if !(chap::PEER_CHALLENGE_BYTES_MIN..=chap::PEER_CHALLENGE_BYTES_MAX)
        .contains(&peer_challenge.len())
    {
        return Err(protocol("CHAP_C length out of range"));
    }
    if peer_challenge == asked.challenge {
        // RFC 7143 §12.1.3: a reflected challenge would make us answer our own question.
        return Err(auth_failed(
            AuthFailure::ReflectedChallenge,
            LoginStatus::AUTH_FAILED,
        ));
    }
    let answer = asked
        .algorithm
        .response(peer_id, &target.secret, &peer_challenge);
    Ok([
        ("CHAP_N".into(), target.user.clone()),
        ("CHAP_R".into(), chap::encode_hex(&answer)),
    ])
}

fn negotiator_declared(answers: &[(String, String)], negotiator: &Negotiator) -> bool {
    // Declared in this response or an earlier one (the negotiator remembers).
    answers.iter().any(|(k, _)| k == "MaxRecvDataSegmentLength") || negotiator.has_declared()
}

#[cfg(test)]
mod tests;
