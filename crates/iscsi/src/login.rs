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
    stage: Stage,
    identity: Option<Identity>,
    stat_sn: u32,
    requests: usize,
    continued_text: Vec<u8>,
    initiator_name: Option<NodeName>,
    initiator_alias: Option<String>,
    target_name: Option<NodeName>,
    admission: Option<Admission>,
    negotiator: Option<Negotiator>,
    authenticated: bool,
    auth: Auth,
    failure: Option<AuthFailure>,
    /// The request (by count) whose response carried the target's answer to the initiator's
    /// mutual CHAP challenge: the initiator judges it before it sends another.
    proved_at: Option<usize>,
}

impl Login {
    pub fn new(limits: LoginLimits, target_limits: TargetLimits, initial_stat_sn: u32) -> Login {
        Login {
            limits,
            target_limits,
            stage: Stage::Security,
            identity: None,
            stat_sn: initial_stat_sn,
            requests: 0,
            continued_text: Vec::new(),
            initiator_name: None,
            initiator_alias: None,
            target_name: None,
            admission: None,
            negotiator: None,
            authenticated: false,
            auth: Auth::Start,
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
        self.initiator_name.as_ref()
    }

    /// The TargetName of this login (normal sessions), once the first request named it.
    pub fn target_name(&self) -> Option<&NodeName> {
        self.target_name.as_ref()
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
        if pdu.bhs.opcode_raw() != Opcode::LoginRequest as u8 {
            return self.fail(pdu, LoginStatus::INVALID_DURING_LOGIN, out);
        }
        if self.requests > self.limits.max_requests {
            return self.fail(pdu, LoginStatus::INITIATOR_ERROR, out);
        }
        match self.step(pdu, policy, out) {
            Ok(step) => step,
            Err(status) => self.fail(pdu, status, out),
        }
    }

    fn step(
        &mut self,
        pdu: &Pdu<'_>,
        policy: &mut dyn LoginPolicy,
        out: &mut Vec<u8>,
    ) -> Result<LoginStep, LoginStatus> {
        let flags = pdu.bhs.flags();
        let cont = flags & 0x40 != 0;
        let (csg, next_stage) = self.check_header(&pdu.bhs)?;
        if self.continued_text.len() + pdu.data.len() > self.limits.max_text_bytes {
            return Err(LoginStatus::OUT_OF_RESOURCES);
        }
        if cont {
            // Part of a longer text: acknowledge with an empty response and wait for the rest.
            self.continued_text.extend_from_slice(pdu.data);
            self.respond(pdu, csg, None, &[], LoginStatus::SUCCESS, out);
            return Ok(LoginStep::Continue);
        }
        let text_bytes = if self.continued_text.is_empty() {
            pdu.data.to_vec()
        } else {
            let mut all = std::mem::take(&mut self.continued_text);
            all.extend_from_slice(pdu.data);
            all
        };
        let offers = text::parse(&text_bytes, self.limits.max_keys)
            .map_err(|_| LoginStatus::INITIATOR_ERROR)?;

        let mut answers: Vec<(String, String)> = Vec::new();
        if self.admission.is_none() {
            self.admit(&offers, policy, &mut answers)?;
        } else {
            self.check_names_unchanged(&offers)?;
        }

        self.stage_keys(csg, &offers, policy, &mut answers)?;
        let negotiator = self.negotiator.as_mut().ok_or(LoginStatus::TARGET_ERROR)?;
        negotiator
            .respond(&offers, &mut answers)
            .map_err(|_| LoginStatus::INITIATOR_ERROR)?;
        // Only in the operational stage: Linux's open-iscsi fails a login whose security-stage
        // response carries an operational key ("can't accept MaxRecvDataSegmentLength in
        // security stage"), also the one that moves on to the operational stage.
        if csg == Stage::Operational {
            negotiator.declarations(&mut answers);
        }

        // The target agrees to move on whenever the initiator asks and authentication is done.
        let agreed_next = match next_stage {
            Some(next) if self.authenticated => Some(next),
            _ => None,
        };
        if agreed_next == Some(Stage::FullFeature) {
            return self.complete(pdu, csg, answers, policy, out);
        }
        if let Some(next) = agreed_next {
            self.stage = next;
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
        let (version_max, version_min) = (bhs.0[2], bhs.0[3]);
        let mut isid = [0u8; 6];
        isid.copy_from_slice(&bhs.0[8..14]);
        let identity = Identity {
            isid,
            tsih: bhs.u16_at(14),
            cid: bhs.u16_at(20),
        };
        match self.identity {
            None => {
                // We speak version 0 only (RFC 7143 §11.12.4).
                if version_min > 0 || version_max < version_min {
                    return Err(LoginStatus::UNSUPPORTED_VERSION);
                }
                if csg == Stage::FullFeature {
                    return Err(LoginStatus::INITIATOR_ERROR);
                }
                self.stage = csg;
                self.identity = Some(identity);
            }
            Some(first) => {
                let same = first.isid == identity.isid
                    && first.tsih == identity.tsih
                    && first.cid == identity.cid;
                if !same || csg != self.stage {
                    return Err(LoginStatus::INITIATOR_ERROR);
                }
            }
        }
        if transit && cont {
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

    /// What the current stage requires of the keys: the security stage negotiates
    /// authentication; the operational stage takes no CHAP key (RFC 7143 §6.3) and, without
    /// authentication, needs a group that requires none.
    fn stage_keys(
        &mut self,
        csg: Stage,
        offers: &[(String, String)],
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), LoginStatus> {
        match csg {
            Stage::Security => self.security(offers, policy, answers),
            Stage::Operational => {
                if offers.iter().any(|(k, _)| k.starts_with("CHAP_")) {
                    return Err(self.auth_fail(
                        AuthFailure::Protocol("security key in the operational stage"),
                        LoginStatus::INITIATOR_ERROR,
                    ));
                }
                if !self.authenticated {
                    self.require_no_auth()?;
                }
                Ok(())
            }
            Stage::FullFeature => Err(LoginStatus::INITIATOR_ERROR),
        }
    }

    fn admit(
        &mut self,
        offers: &[(String, String)],
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), LoginStatus> {
        let get = |k: &str| {
            offers
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        let initiator = get("InitiatorName").ok_or(LoginStatus::MISSING_PARAMETER)?;
        if initiator.is_empty() {
            return Err(LoginStatus::MISSING_PARAMETER);
        }
        // Normalised once, here: every decision about who this initiator is compares this form.
        let initiator = NodeName::from_wire(initiator).map_err(|_| {
            self.failure = Some(AuthFailure::MalformedName);
            LoginStatus::INITIATOR_ERROR
        })?;
        // Known from here on, so that a refusal below is logged with the names it refused.
        self.initiator_name = Some(initiator.clone());
        let session_type = match get("SessionType").unwrap_or("Normal") {
            "Normal" => SessionType::Normal,
            "Discovery" => SessionType::Discovery,
            _ => return Err(LoginStatus::SESSION_TYPE_UNSUPPORTED),
        };
        let admission = match session_type {
            SessionType::Normal => {
                let target = get("TargetName").ok_or(LoginStatus::MISSING_PARAMETER)?;
                // No target has a name that is not one.
                let target = NodeName::from_wire(target).map_err(|_| {
                    self.failure = Some(AuthFailure::MalformedName);
                    LoginStatus::NOT_FOUND
                })?;
                self.target_name = Some(target.clone());
                let admission = policy.admit(&initiator, &target)?;
                answers.push((
                    "TargetPortalGroupTag".into(),
                    admission.portal_group_tag.to_string(),
                ));
                if let Some(alias) = &admission.target_alias {
                    answers.push(("TargetAlias".into(), alias.clone()));
                }
                admission
            }
            SessionType::Discovery => policy.admit_discovery(&initiator)?,
        };
        self.initiator_alias = get("InitiatorAlias").map(str::to_string);
        self.negotiator = Some(Negotiator::new(self.target_limits.clone(), session_type));
        self.admission = Some(admission);
        Ok(())
    }

    /// Names are fixed by the first request; a later request may repeat but not change them.
    fn check_names_unchanged(&self, offers: &[(String, String)]) -> Result<(), LoginStatus> {
        for (key, value) in offers {
            let fixed = match key.as_str() {
                "InitiatorName" => self.initiator_name.as_ref(),
                "TargetName" => self.target_name.as_ref(),
                _ => continue,
            };
            // The same name in another spelling is the same name.
            if fixed.is_none() || NodeName::from_wire(value).ok().as_ref() != fixed {
                return Err(LoginStatus::INITIATOR_ERROR);
            }
        }
        Ok(())
    }

    fn auth_fail(&mut self, why: AuthFailure, status: LoginStatus) -> LoginStatus {
        self.failure = Some(why);
        status
    }

    /// The security stage: AuthMethod, then (for CHAP) CHAP_A, then CHAP_N/CHAP_R (and the
    /// initiator's CHAP_I/CHAP_C for mutual CHAP), one step per request, RFC 7143 §12.1.3.
    fn security(
        &mut self,
        offers: &[(String, String)],
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), LoginStatus> {
        let requirement = self
            .admission
            .as_ref()
            .map(|a| a.auth.clone())
            .ok_or(LoginStatus::TARGET_ERROR)?;
        let get = |k: &str| {
            offers
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        let chap_keys = offers.iter().any(|(k, _)| k.starts_with("CHAP_"));
        if let Some(methods) = get("AuthMethod") {
            if self.auth != Auth::Start {
                // Already negotiated: a key may not be negotiated twice.
                return Err(self.auth_fail(
                    AuthFailure::Protocol("AuthMethod sent twice"),
                    LoginStatus::INITIATOR_ERROR,
                ));
            }
            if chap_keys {
                return Err(self.auth_fail(
                    AuthFailure::Protocol("CHAP keys before AuthMethod was agreed"),
                    LoginStatus::INITIATOR_ERROR,
                ));
            }
            let offered = |m: &str| methods.split(',').any(|x| x == m);
            match requirement {
                AuthRequirement::None => {
                    if offered("None") {
                        answers.push(("AuthMethod".into(), "None".into()));
                        self.auth = Auth::NoneAgreed;
                        self.authenticated = true;
                    } else {
                        // The initiator insists on a method we were not configured for.
                        return Err(
                            self.auth_fail(AuthFailure::MethodRefused, LoginStatus::AUTH_FAILED)
                        );
                    }
                }
                AuthRequirement::Chap(_) => {
                    if offered("CHAP") {
                        answers.push(("AuthMethod".into(), "CHAP".into()));
                        self.auth = Auth::ChapAgreed;
                    } else {
                        return Err(
                            self.auth_fail(AuthFailure::MethodRefused, LoginStatus::AUTH_FAILED)
                        );
                    }
                }
            }
            return Ok(());
        }
        match std::mem::replace(&mut self.auth, Auth::Start) {
            Auth::Start => {
                if chap_keys {
                    return Err(self.auth_fail(
                        AuthFailure::Protocol("CHAP keys before AuthMethod"),
                        LoginStatus::INITIATOR_ERROR,
                    ));
                }
                // No AuthMethod offered: the default is None.
                self.require_no_auth()?;
                self.auth = Auth::NoneAgreed;
            }
            state @ (Auth::NoneAgreed | Auth::ChapDone { .. }) => {
                self.auth = state;
                if chap_keys {
                    return Err(self.auth_fail(
                        AuthFailure::Protocol("CHAP keys after authentication"),
                        LoginStatus::INITIATOR_ERROR,
                    ));
                }
            }
            Auth::ChapAgreed => {
                let AuthRequirement::Chap(req) = &requirement else {
                    return Err(LoginStatus::TARGET_ERROR);
                };
                self.chap_algorithm(offers, req, policy, answers)?;
            }
            Auth::Challenged {
                algorithm,
                id,
                challenge,
            } => {
                let AuthRequirement::Chap(req) = &requirement else {
                    return Err(LoginStatus::TARGET_ERROR);
                };
                let user = self.chap_response(offers, req, algorithm, id, &challenge, answers)?;
                self.auth = Auth::ChapDone { user };
                self.authenticated = true;
            }
        }
        Ok(())
    }

    /// CHAP_A=<list> → CHAP_A, CHAP_I, CHAP_C.
    fn chap_algorithm(
        &mut self,
        offers: &[(String, String)],
        req: &ChapRequirement,
        policy: &mut dyn LoginPolicy,
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), LoginStatus> {
        if offers
            .iter()
            .any(|(k, _)| k.starts_with("CHAP_") && k != "CHAP_A")
        {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP key other than CHAP_A before the challenge"),
                LoginStatus::INITIATOR_ERROR,
            ));
        }
        let Some(list) = offers.iter().find(|(k, _)| k == "CHAP_A").map(|(_, v)| v) else {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP_A missing"),
                LoginStatus::MISSING_PARAMETER,
            ));
        };
        // Unknown or malformed entries are ignored (RFC 7143 §6.2: the responder picks from
        // what it understands); an empty intersection fails.
        let offered: Vec<Algorithm> = list
            .split(',')
            .filter_map(|v| v.trim().parse::<u32>().ok())
            .filter_map(Algorithm::from_code)
            .collect();
        let Some(&algorithm) = req.algorithms.iter().find(|a| offered.contains(a)) else {
            return Err(self.auth_fail(AuthFailure::NoCommonAlgorithm, LoginStatus::AUTH_FAILED));
        };
        let mut random = [0u8; 1 + chap::CHALLENGE_BYTES];
        policy.fill_random(&mut random)?;
        let id = random[0];
        let challenge = random[1..].to_vec();
        answers.push(("CHAP_A".into(), algorithm.code().to_string()));
        answers.push(("CHAP_I".into(), id.to_string()));
        answers.push(("CHAP_C".into(), chap::encode_hex(&challenge)));
        self.auth = Auth::Challenged {
            algorithm,
            id,
            challenge,
        };
        Ok(())
    }

    /// CHAP_N, CHAP_R [, CHAP_I, CHAP_C] → verified [; CHAP_N, CHAP_R for mutual CHAP].
    /// Returns the authenticated user name.
    fn chap_response(
        &mut self,
        offers: &[(String, String)],
        req: &ChapRequirement,
        algorithm: Algorithm,
        id: u8,
        challenge: &[u8],
        answers: &mut Vec<(String, String)>,
    ) -> Result<String, LoginStatus> {
        let get = |k: &str| {
            offers
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        if get("CHAP_A").is_some() {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP_A sent twice"),
                LoginStatus::INITIATOR_ERROR,
            ));
        }
        let (Some(name), Some(response)) = (get("CHAP_N"), get("CHAP_R")) else {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP_N or CHAP_R missing"),
                LoginStatus::MISSING_PARAMETER,
            ));
        };
        let mutual = match (get("CHAP_I"), get("CHAP_C")) {
            (None, None) => None,
            (Some(i), Some(c)) => Some((i, c)),
            _ => {
                return Err(self.auth_fail(
                    AuthFailure::Protocol("CHAP_I without CHAP_C or the reverse"),
                    LoginStatus::MISSING_PARAMETER,
                ))
            }
        };
        if name.is_empty() || name.len() > chap::USER_BYTES_MAX {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP_N empty or too long"),
                LoginStatus::INITIATOR_ERROR,
            ));
        }
        let Ok(received) = chap::decode_binary(response) else {
            return Err(self.auth_fail(
                AuthFailure::Protocol("CHAP_R is not a binary value"),
                LoginStatus::INITIATOR_ERROR,
            ));
        };
        // Compare against every configured user in constant time per user, so an unknown name
        // costs what a known one does.
        let mut matched = false;
        let mut known = false;
        for user in &req.users {
            // Hash and compare for every user, named or not, so the work done does not reveal
            // whether the name exists.
            let expected = algorithm.response(id, &user.secret, challenge);
            let response_ok = chap::responses_match(&expected, &received);
            let is_name = user.user == name;
            known |= is_name;
            matched |= is_name & response_ok;
        }
        if !known {
            return Err(self.auth_fail(AuthFailure::UnknownUser, LoginStatus::AUTH_FAILED));
        }
        if !matched {
            return Err(self.auth_fail(AuthFailure::WrongResponse, LoginStatus::AUTH_FAILED));
        }
        if let Some((peer_id, peer_challenge)) = mutual {
            let Some(target) = &req.mutual else {
                return Err(
                    self.auth_fail(AuthFailure::MutualNotConfigured, LoginStatus::AUTH_FAILED)
                );
            };
            let Some(peer_id) = chap::parse_identifier(peer_id) else {
                return Err(self.auth_fail(
                    AuthFailure::Protocol("CHAP_I is not a number in 0..=255"),
                    LoginStatus::INITIATOR_ERROR,
                ));
            };
            let Ok(peer_challenge) = chap::decode_binary(peer_challenge) else {
                return Err(self.auth_fail(
                    AuthFailure::Protocol("CHAP_C is not a binary value"),
                    LoginStatus::INITIATOR_ERROR,
                ));
            };
            if !(chap::PEER_CHALLENGE_BYTES_MIN..=chap::PEER_CHALLENGE_BYTES_MAX)
                .contains(&peer_challenge.len())
            {
                return Err(self.auth_fail(
                    AuthFailure::Protocol("CHAP_C length out of range"),
                    LoginStatus::INITIATOR_ERROR,
                ));
            }
            if peer_challenge == challenge {
                // RFC 7143 §12.1.3: a reflected challenge would make us answer our own question.
                return Err(
                    self.auth_fail(AuthFailure::ReflectedChallenge, LoginStatus::AUTH_FAILED)
                );
            }
            let answer = algorithm.response(peer_id, &target.secret, &peer_challenge);
            answers.push(("CHAP_N".into(), target.user.clone()));
            answers.push(("CHAP_R".into(), chap::encode_hex(&answer)));
            self.proved_at = Some(self.requests);
        }
        Ok(name.to_string())
    }

    fn require_no_auth(&mut self) -> Result<(), LoginStatus> {
        match self.admission.as_ref().map(|a| &a.auth) {
            Some(AuthRequirement::None) => {
                self.authenticated = true;
                Ok(())
            }
            Some(AuthRequirement::Chap(_)) => {
                Err(self.auth_fail(AuthFailure::NotAuthenticated, LoginStatus::AUTH_FAILED))
            }
            None => Err(LoginStatus::TARGET_ERROR),
        }
    }

    fn complete(
        &mut self,
        pdu: &Pdu<'_>,
        csg: Stage,
        answers: Vec<(String, String)>,
        policy: &mut dyn LoginPolicy,
        out: &mut Vec<u8>,
    ) -> Result<LoginStep, LoginStatus> {
        let identity = self.identity.ok_or(LoginStatus::TARGET_ERROR)?;
        let negotiator = self.negotiator.as_ref().ok_or(LoginStatus::TARGET_ERROR)?;
        let admission = self.admission.as_ref().ok_or(LoginStatus::TARGET_ERROR)?;
        let initiator_name = self
            .initiator_name
            .clone()
            .ok_or(LoginStatus::TARGET_ERROR)?;
        let mut params = negotiator.params;
        if !negotiator_declared(&answers, negotiator) {
            // We never told the initiator our limit, so it assumes the RFC default.
            params.max_recv_data_segment_length = 8192;
        }
        let key = SessionKey {
            initiator_name: initiator_name.clone(),
            isid: identity.isid,
            target_name: self.target_name.clone(),
            tsih: identity.tsih,
        };
        let tsih = policy.open_session(&key, negotiator.session_type)?;
        let established = Established {
            session_type: negotiator.session_type,
            initiator_name,
            initiator_alias: self.initiator_alias.clone(),
            target_name: self.target_name.clone(),
            portal_group_tag: admission.portal_group_tag,
            isid: identity.isid,
            tsih,
            cid: identity.cid,
            params,
            chap_user: match &self.auth {
                Auth::ChapDone { user } => Some(user.clone()),
                _ => None,
            },
            next_stat_sn: self.stat_sn.wrapping_add(1),
            // What this last Login Response tells the initiator (ExpCmdSN = its CmdSN), even if
            // an initiator changed CmdSN between its Login Requests (found by fuzz(login)).
            exp_cmd_sn: pdu.bhs.u32_at(off::CMD_SN),
        };
        self.stage = Stage::FullFeature;
        self.respond_full(
            pdu,
            csg,
            Some(Stage::FullFeature),
            &answers,
            LoginStatus::SUCCESS,
            tsih,
            out,
        );
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
        let tsih = self.identity.map_or(0, |i| i.tsih);
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
        let mut bhs = Bhs::new(Opcode::LoginResponse);
        let mut flags = 0u8;
        if status.is_success() {
            flags |= (csg as u8) << 2;
            if let Some(next) = next {
                flags |= 0x80 | next as u8;
            }
        }
        bhs.set_flags(flags);
        bhs.0[2] = 0; // VersionMax
        bhs.0[3] = 0; // VersionActive
        bhs.0[8..14].copy_from_slice(&pdu.bhs.0[8..14]);
        bhs.set_u16(14, tsih);
        bhs.set_itt(pdu.bhs.itt());
        bhs.set_u32(off::STAT_SN, self.stat_sn);
        let cmd_sn = pdu.bhs.u32_at(off::CMD_SN);
        bhs.set_u32(off::EXP_CMD_SN, cmd_sn);
        let window = if next == Some(Stage::FullFeature) {
            self.limits.queue_depth.max(1)
        } else {
            1
        };
        bhs.set_u32(off::MAX_CMD_SN, cmd_sn.wrapping_add(window - 1));
        bhs.0[36] = status.class;
        bhs.0[37] = status.detail;
        let data = text::encode(answers);
        // Every Login Response consumes a StatSN (RFC 7143 §11.13.4).
        self.stat_sn = self.stat_sn.wrapping_add(1);
        pdu::encode_into(out, &bhs, &data, &Framing::LOGIN);
    }
}

fn negotiator_declared(answers: &[(String, String)], negotiator: &Negotiator) -> bool {
    // Declared in this response or an earlier one (the negotiator remembers).
    answers.iter().any(|(k, _)| k == "MaxRecvDataSegmentLength") || negotiator.has_declared()
}

#[cfg(test)]
mod tests;
