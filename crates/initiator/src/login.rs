//! The login phase, sans IO (RFC 7143 §6.3, §11.12–11.13): security negotiation
//! (AuthMethod=None or CHAP, one-way or mutual), operational negotiation, then full feature
//! phase.
//!
//! [`Login::new`] queues the first Login Request; feed received bytes to [`Login::receive`],
//! send what [`Login::output`] holds, until [`Login::is_complete`]; then
//! [`Login::into_session`] gives the full-feature [`Session`].

use std::time::Instant;

use iscsi::chap::{self, Algorithm};
use iscsi::pdu::{self, off, Bhs, Framing, Opcode};
use iscsi::text;

use crate::config::{Auth, DigestChoice, SessionConfig, SessionKind};
use crate::error::{AuthError, Error, LoginError, ProtocolError};
use crate::session::Session;

/// Login Request / Response flag bits.
const TRANSIT: u8 = 0x80;
const CONTINUE: u8 = 0x40;
/// Stages (CSG/NSG values).
const SECURITY: u8 = 0;
const OPERATIONAL: u8 = 1;
const FULL_FEATURE: u8 = 3;
/// At most this many Login Requests per login.
pub const LOGIN_ROUNDS_MAX: u32 = 16;
/// The longest login response text we accept (all continuation PDUs together).
pub const LOGIN_TEXT_MAX: usize = 64 * 1024;
/// The longest challenge we answer (RFC 7143 §12.1.3).
const CHALLENGE_MAX: usize = 1024;
/// Bytes of randomness a login needs: CHAP_I and a 16-byte CHAP_C for mutual CHAP.
pub const LOGIN_RANDOM_BYTES: usize = 17;
const LOGIN_ITT: u32 = 0;
const INITIAL_CMD_SN: u32 = 1;

/// Bytes to send, kept until the driver says they went out, with pieces of shared write data
/// spliced between them (sent from where they lie, not copied in).
#[derive(Debug, Default)]
pub(crate) struct Outbuf {
    buf: Vec<u8>,
    /// Bytes already sent, of `buf` and the spliced pieces together.
    pos: usize,
    spliced: Vec<Spliced>,
    spliced_len: usize,
}

/// `data[range]` goes out before byte `at` of the buffer.
#[derive(Debug)]
struct Spliced {
    at: usize,
    data: std::sync::Arc<[u8]>,
    range: std::ops::Range<usize>,
}

impl Outbuf {
    /// What is left to send, when nothing is spliced in (login, and callers that never send
    /// shared write data); else see [`Outbuf::slices`].
    pub(crate) fn pending(&self) -> &[u8] {
        debug_assert!(self.spliced.is_empty(), "spliced output read as one slice");
        self.buf.get(self.pos..).unwrap_or(&[])
    }
    /// What is left to send, in order, as slices for one `writev`.
    pub(crate) fn slices<'a>(&'a self, into: &mut Vec<std::io::IoSlice<'a>>) {
        let pieces = self
            .spliced
            .iter()
            .map(|s| (s.at, s.data.get(s.range.clone()).unwrap_or(&[])));
        crate::splice::gather(&self.buf, pieces, self.pos, into);
    }
    pub(crate) fn advance(&mut self, n: usize) {
        let total = self.buf.len() + self.spliced_len;
        self.pos = self.pos.saturating_add(n).min(total);
        if self.pos == total {
            self.buf.clear();
            self.spliced.clear();
            self.spliced_len = 0;
            self.pos = 0;
        }
    }
    pub(crate) fn vec(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
    /// `data[range]` goes out next, from where it lies.
    pub(crate) fn splice(&mut self, data: &std::sync::Arc<[u8]>, range: std::ops::Range<usize>) {
        debug_assert!(range.end <= data.len(), "a spliced piece within its data");
        self.spliced_len += range.len();
        self.spliced.push(Spliced {
            at: self.buf.len(),
            data: std::sync::Arc::clone(data),
            range,
        });
    }
    pub(crate) fn len(&self) -> usize {
        self.buf.len() + self.spliced_len - self.pos
    }
}

/// Parameters in force after login (RFC 7143 §13).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Ours: the largest data segment the target may send us.
    pub max_recv_data_segment_length: u32,
    /// The target's MaxRecvDataSegmentLength: the largest data segment we may send.
    pub max_xmit_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub max_outstanding_r2t: u16,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub max_connections: u16,
    /// Target Session Identifying Handle the target gave this session.
    pub tsih: u16,
    pub target_portal_group_tag: Option<u16>,
    pub target_alias: Option<String>,
}

impl Negotiated {
    fn rfc_defaults(config: &SessionConfig) -> Negotiated {
        Negotiated {
            header_digest: false,
            data_digest: false,
            max_recv_data_segment_length: config.max_recv_data_segment_length,
            max_xmit_data_segment_length: 8192,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            immediate_data: true,
            initial_r2t: true,
            max_outstanding_r2t: 1,
            default_time2wait: 2,
            default_time2retain: 20,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            max_connections: 1,
            tsih: 0,
            target_portal_group_tag: None,
            target_alias: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// AuthMethod=None sent, T=1 towards the operational stage.
    SecurityNone,
    /// AuthMethod=CHAP sent.
    AuthMethod,
    /// CHAP_A sent; expecting CHAP_A, CHAP_I, CHAP_C.
    Challenge,
    /// CHAP_N/CHAP_R (and our CHAP_I/CHAP_C) sent.
    ChapResult,
    /// Operational keys sent.
    Operational,
    Complete,
    Failed,
}

/// The login state machine of one connection.
#[derive(Debug)]
pub struct Login {
    config: SessionConfig,
    step: Step,
    out: Outbuf,
    /// Stage of the last request, and whether it asked to transit, to where.
    csg: u8,
    transit: bool,
    nsg: u8,
    exp_stat_sn: u32,
    stat_sn_seen: bool,
    exp_cmd_sn: u32,
    max_cmd_sn: u32,
    rounds: u32,
    text_in: Vec<u8>,
    random: [u8; LOGIN_RANDOM_BYTES],
    /// Mutual CHAP: our identifier and challenge, once sent.
    our_challenge: Option<(u8, Vec<u8>)>,
    /// The algorithm the target chose.
    algorithm: Option<Algorithm>,
    negotiated: Negotiated,
    /// Operational keys we offered (answers to anything else are offers from the target).
    offered: Vec<&'static str>,
}

impl Login {
    /// Starts a login: the first Login Request is queued at once. `random` supplies the CHAP
    /// identifier and challenge for mutual CHAP (take it from a real random source).
    pub fn new(config: SessionConfig, random: [u8; LOGIN_RANDOM_BYTES]) -> Login {
        let negotiated = Negotiated::rfc_defaults(&config);
        let mut login = Login {
            config,
            step: Step::SecurityNone,
            out: Outbuf::default(),
            csg: SECURITY,
            transit: false,
            nsg: OPERATIONAL,
            exp_stat_sn: 0,
            stat_sn_seen: false,
            exp_cmd_sn: INITIAL_CMD_SN,
            max_cmd_sn: INITIAL_CMD_SN,
            rounds: 0,
            text_in: Vec::new(),
            random,
            our_challenge: None,
            algorithm: None,
            negotiated,
            offered: Vec::new(),
        };
        let mut keys: Vec<(String, String)> =
            vec![("InitiatorName".into(), login.config.initiator_name.clone())];
        if let Some(alias) = &login.config.initiator_alias {
            keys.push(("InitiatorAlias".into(), alias.clone()));
        }
        match &login.config.kind {
            SessionKind::Normal { target_name } => {
                keys.push(("SessionType".into(), "Normal".into()));
                keys.push(("TargetName".into(), target_name.clone()));
            }
            SessionKind::Discovery => keys.push(("SessionType".into(), "Discovery".into())),
        }
        match login.config.auth {
            Auth::None => {
                keys.push(("AuthMethod".into(), "None".into()));
                login.send(SECURITY, true, OPERATIONAL, &keys);
            }
            Auth::Chap(_) => {
                keys.push(("AuthMethod".into(), "CHAP".into()));
                login.step = Step::AuthMethod;
                login.send(SECURITY, false, OPERATIONAL, &keys);
            }
        }
        login
    }

    /// Bytes waiting to be sent.
    pub fn output(&self) -> &[u8] {
        self.out.pending()
    }

    /// `n` bytes of [`Login::output`] were sent.
    pub fn advance_output(&mut self, n: usize) {
        self.out.advance(n);
    }

    /// Whether the target accepted the login (full feature phase reached).
    pub fn is_complete(&self) -> bool {
        self.step == Step::Complete
    }

    /// The parameters negotiated so far (all of them once complete).
    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }

    /// Consumes complete PDUs from `buf` and returns how many bytes it used; stops after the
    /// final Login Response (bytes after it belong to the session). An error ends the login.
    pub fn receive(&mut self, buf: &[u8]) -> Result<usize, Error> {
        if self.step == Step::Failed {
            return Err(Error::NotConnected);
        }
        let framing = Framing {
            header_digest: false,
            data_digest: false,
            max_data_segment_len: (self.config.max_recv_data_segment_length as usize).max(8192),
        };
        let mut used = 0usize;
        while self.step != Step::Complete {
            let rest = buf.get(used..).unwrap_or(&[]);
            let len = match pdu::frame_len(rest, &framing) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => return Err(self.fail(ProtocolError::Frame(e).into())),
            };
            let frame = rest.get(..len).unwrap_or(&[]);
            let parsed =
                pdu::parse_frame(frame, &framing).map_err(|(e, _)| ProtocolError::Frame(e).into());
            let result = parsed.and_then(|p| self.handle(&p.bhs, p.data));
            if let Err(e) = result {
                return Err(self.fail(e));
            }
            used += len;
        }
        Ok(used)
    }

    /// The full-feature session, once [`Login::is_complete`].
    pub fn into_session(self, now: Instant) -> Result<Session, Error> {
        if self.step != Step::Complete {
            return Err(Error::NotConnected);
        }
        Ok(Session::new(
            self.config,
            self.negotiated,
            self.exp_cmd_sn.max(INITIAL_CMD_SN),
            self.exp_stat_sn,
            self.exp_cmd_sn,
            self.max_cmd_sn,
            now,
        ))
    }

    fn fail(&mut self, e: Error) -> Error {
        self.step = Step::Failed;
        e
    }

    fn send(&mut self, csg: u8, transit: bool, nsg: u8, keys: &[(String, String)]) {
        self.rounds += 1;
        self.csg = csg;
        self.transit = transit;
        self.nsg = nsg;
        let bhs = pdu::LoginRequest {
            csg,
            transit_to: transit.then_some(nsg),
            continues: false,
            isid: self.config.isid,
            tsih: self.config.tsih,
            itt: LOGIN_ITT,
            cid: self.config.cid,
            cmd_sn: INITIAL_CMD_SN,
            exp_stat_sn: self.exp_stat_sn,
        }
        .bhs();
        let data = text::encode(keys);
        pdu::encode_into(self.out.vec(), &bhs, &data, &Framing::LOGIN);
    }

    fn handle(&mut self, bhs: &Bhs, data: &[u8]) -> Result<(), Error> {
        let op = bhs.opcode_raw();
        match Opcode::from_target(op) {
            Some(Opcode::LoginResponse) => {}
            Some(_) => return Err(ProtocolError::UnexpectedOpcode(op).into()),
            None => return Err(ProtocolError::UnknownOpcode(op).into()),
        }
        let flags = bhs.flags();
        let (class, detail) = (bhs.byte(off::STATUS_CLASS), bhs.byte(off::STATUS_DETAIL));
        if class != 0 {
            return Err(refused(class, detail, data).into());
        }
        if bhs.itt() != LOGIN_ITT {
            return Err(ProtocolError::Login("ITT is not the request's").into());
        }
        if bhs.isid() != self.config.isid {
            return Err(ProtocolError::Login("ISID is not ours").into());
        }
        if bhs.byte(off::VERSION_MIN) != 0 {
            return Err(ProtocolError::Login("unsupported version").into());
        }
        let stat_sn = bhs.u32_at(off::STAT_SN);
        self.exp_stat_sn = stat_sn.wrapping_add(1);
        self.stat_sn_seen = true;
        self.exp_cmd_sn = bhs.u32_at(off::EXP_CMD_SN);
        self.max_cmd_sn = bhs.u32_at(off::MAX_CMD_SN);
        let csg = (flags >> 2) & 3;
        if csg != self.csg {
            return Err(ProtocolError::Login("CSG differs from the request's").into());
        }
        if self.text_in.len() + data.len() > LOGIN_TEXT_MAX {
            return Err(ProtocolError::TextTooLong(LOGIN_TEXT_MAX).into());
        }
        self.text_in.extend_from_slice(data);
        if flags & CONTINUE != 0 {
            if flags & TRANSIT != 0 {
                return Err(ProtocolError::Login("both C and T set").into());
            }
            // More text follows: an empty request (same stage and transit wish) asks for it.
            self.check_rounds()?;
            let (csg, transit, nsg) = (self.csg, self.transit, self.nsg);
            self.send(csg, transit, nsg, &[]);
            return Ok(());
        }
        let text_in = std::mem::take(&mut self.text_in);
        let keys = text::parse(&text_in, 256).map_err(ProtocolError::Text)?;
        let target_transit = flags & TRANSIT != 0;
        let target_nsg = flags & 3;
        if target_transit {
            if !self.transit {
                return Err(ProtocolError::Login("T set though we did not ask to transit").into());
            }
            if target_nsg != self.nsg {
                return Err(ProtocolError::Login("NSG is not one we asked for").into());
            }
            let tsih = bhs.u16_at(off::TSIH);
            if target_nsg == FULL_FEATURE {
                if tsih == 0 {
                    return Err(ProtocolError::Login("final response without a TSIH").into());
                }
                self.negotiated.tsih = tsih;
            }
        }
        self.declarations(&keys)?;
        self.next_step(&keys, target_transit, target_nsg)
    }

    /// What the target declares in any stage's response: its portal group tag, its alias,
    /// how much it receives per PDU.
    fn declarations(&mut self, keys: &[(String, String)]) -> Result<(), Error> {
        for (k, v) in keys {
            match k.as_str() {
                "TargetPortalGroupTag" => {
                    self.negotiated.target_portal_group_tag =
                        Some(v.parse().map_err(|_| bad_value(k, v))?);
                }
                "TargetAlias" => self.negotiated.target_alias = Some(v.clone()),
                // A declaration, which a target may make in the security stage's response
                // too (ferrosan does; libiscsi takes it there). Missed, our Data-Out PDUs
                // stayed at the default 8 KiB.
                "MaxRecvDataSegmentLength" => {
                    self.negotiated.max_xmit_data_segment_length = number(k, v, 512, 16_777_215)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The login's next step after a complete response.
    fn next_step(
        &mut self,
        keys: &[(String, String)],
        target_transit: bool,
        target_nsg: u8,
    ) -> Result<(), Error> {
        match self.step {
            Step::SecurityNone => {
                if let Some(m) = value(keys, "AuthMethod") {
                    if m != "None" {
                        return Err(AuthError::MethodRefused(m.to_string()).into());
                    }
                }
                self.after_security(target_transit)
            }
            Step::AuthMethod => {
                let m = value(keys, "AuthMethod").unwrap_or("");
                if m != "CHAP" {
                    return Err(AuthError::MethodRefused(m.to_string()).into());
                }
                let list = self
                    .chap()
                    .map(|c| c.algorithms.iter().map(|a| a.code().to_string()))
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(",");
                self.check_rounds()?;
                self.step = Step::Challenge;
                self.send(SECURITY, false, OPERATIONAL, &[("CHAP_A".into(), list)]);
                Ok(())
            }
            Step::Challenge => self.answer_challenge(keys),
            Step::ChapResult => {
                self.verify_target(keys)?;
                self.after_security(target_transit)
            }
            Step::Operational => self.operational_response(keys, target_transit, target_nsg),
            Step::Complete | Step::Failed => {
                Err(ProtocolError::Login("response after the end").into())
            }
        }
    }

    fn check_rounds(&self) -> Result<(), Error> {
        if self.rounds >= LOGIN_ROUNDS_MAX {
            return Err(LoginError::TooManyRounds.into());
        }
        Ok(())
    }

    fn chap(&self) -> Option<&crate::config::ChapConfig> {
        match &self.config.auth {
            Auth::Chap(c) => Some(c),
            Auth::None => None,
        }
    }

    /// The security stage is done on our side: move to the operational stage (or ask again
    /// to transit if the target did not).
    fn after_security(&mut self, target_transit: bool) -> Result<(), Error> {
        self.check_rounds()?;
        if !target_transit {
            self.send(SECURITY, true, OPERATIONAL, &[]);
            return Ok(());
        }
        self.step = Step::Operational;
        let keys = self.operational_offers();
        self.send(OPERATIONAL, true, FULL_FEATURE, &keys);
        Ok(())
    }

    fn answer_challenge(&mut self, keys: &[(String, String)]) -> Result<(), Error> {
        let Some(chap) = self.chap().cloned() else {
            return Err(AuthError::MethodRefused("CHAP".into()).into());
        };
        let a = value(keys, "CHAP_A").ok_or(AuthError::Missing("CHAP_A"))?;
        let algorithm = a
            .parse::<u32>()
            .ok()
            .and_then(Algorithm::from_code)
            .filter(|alg| chap.algorithms.contains(alg))
            .ok_or_else(|| AuthError::Algorithm(a.to_string()))?;
        let i = value(keys, "CHAP_I").ok_or(AuthError::Missing("CHAP_I"))?;
        let id = chap::parse_identifier(i).ok_or_else(|| AuthError::Identifier(i.to_string()))?;
        let c = value(keys, "CHAP_C").ok_or(AuthError::Missing("CHAP_C"))?;
        let challenge = chap::decode_binary(c).map_err(|e| {
            AuthError::Challenge(match e {
                chap::DecodeError::Empty => "empty",
                _ => "not a binary value",
            })
        })?;
        if challenge.len() > CHALLENGE_MAX {
            return Err(AuthError::Challenge("longer than 1024 bytes").into());
        }
        self.algorithm = Some(algorithm);
        let response = algorithm.response(id, &chap.secret, &challenge);
        let mut answer: Vec<(String, String)> = vec![
            ("CHAP_N".into(), chap.user.clone()),
            ("CHAP_R".into(), chap::encode_hex(&response)),
        ];
        if chap.mutual.is_some() {
            let [our_id, rest @ ..] = self.random;
            let ours = rest.to_vec();
            if ours == challenge {
                // Reflection: the target asks us to answer our own challenge.
                return Err(AuthError::Challenge("our own challenge reflected").into());
            }
            answer.push(("CHAP_I".into(), our_id.to_string()));
            answer.push(("CHAP_C".into(), chap::encode_hex(&ours)));
            self.our_challenge = Some((our_id, ours));
        }
        self.check_rounds()?;
        self.step = Step::ChapResult;
        self.send(SECURITY, true, OPERATIONAL, &answer);
        Ok(())
    }

    fn verify_target(&mut self, keys: &[(String, String)]) -> Result<(), Error> {
        let Some(mutual) = self.chap().and_then(|c| c.mutual.clone()) else {
            return Ok(());
        };
        let (Some((id, challenge)), Some(algorithm)) = (self.our_challenge.clone(), self.algorithm)
        else {
            return Err(AuthError::TargetResponse.into());
        };
        let n = value(keys, "CHAP_N").ok_or(AuthError::TargetResponse)?;
        let r = value(keys, "CHAP_R").ok_or(AuthError::TargetResponse)?;
        let got = chap::decode_binary(r).map_err(|_| AuthError::TargetResponse)?;
        let want = algorithm.response(id, &mutual.secret, &challenge);
        // Compare the response first (constant time), then the name.
        let response_ok = chap::responses_match(&want, &got);
        if n != mutual.user {
            return Err(AuthError::TargetName(n.to_string()).into());
        }
        if !response_ok {
            return Err(AuthError::TargetResponse.into());
        }
        Ok(())
    }

    fn operational_offers(&mut self) -> Vec<(String, String)> {
        let c = &self.config;
        let mut keys: Vec<(&'static str, String)> = vec![
            ("HeaderDigest", c.header_digest.offer().into()),
            ("DataDigest", c.data_digest.offer().into()),
            (
                "MaxRecvDataSegmentLength",
                c.max_recv_data_segment_length.to_string(),
            ),
            ("DefaultTime2Wait", "0".into()),
            ("DefaultTime2Retain", "0".into()),
        ];
        if matches!(c.kind, SessionKind::Normal { .. }) {
            keys.extend([
                ("MaxConnections", "1".to_string()),
                ("InitialR2T", yes_no(c.initial_r2t).into()),
                ("ImmediateData", yes_no(c.immediate_data).into()),
                ("MaxBurstLength", c.max_burst_length.to_string()),
                (
                    "FirstBurstLength",
                    c.first_burst_length.min(c.max_burst_length).to_string(),
                ),
                (
                    "MaxOutstandingR2T",
                    c.max_outstanding_r2t.max(1).to_string(),
                ),
                ("DataPDUInOrder", "Yes".into()),
                ("DataSequenceInOrder", "Yes".into()),
                ("ErrorRecoveryLevel", "0".into()),
            ]);
        }
        self.offered = keys.iter().map(|(k, _)| *k).collect();
        keys.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    fn operational_response(
        &mut self,
        keys: &[(String, String)],
        target_transit: bool,
        target_nsg: u8,
    ) -> Result<(), Error> {
        let mut answers: Vec<(String, String)> = Vec::new();
        for (k, v) in keys {
            if self.offered.contains(&k.as_str()) {
                self.apply_answer(k, v)?;
            } else if let Some(answer) = self.answer_target_offer(k, v)? {
                answers.push((k.clone(), answer));
            }
        }
        if target_transit && target_nsg == FULL_FEATURE {
            self.finish_negotiation();
            self.step = Step::Complete;
            return Ok(());
        }
        self.check_rounds()?;
        self.send(OPERATIONAL, true, FULL_FEATURE, &answers);
        Ok(())
    }

    /// The first burst can never exceed the burst (RFC 7143 §13.14).
    fn finish_negotiation(&mut self) {
        let n = &mut self.negotiated;
        n.first_burst_length = n.first_burst_length.min(n.max_burst_length);
    }

    /// Applies the target's answer to a key we offered.
    fn apply_answer(&mut self, key: &str, v: &str) -> Result<(), Error> {
        let c = &self.config;
        let n = &mut self.negotiated;
        if matches!(v, "Reject" | "Irrelevant" | "NotUnderstood") {
            // The default stands; a digest we insist on cannot.
            let insisted = match key {
                "HeaderDigest" => c.header_digest == DigestChoice::Crc32c,
                "DataDigest" => c.data_digest == DigestChoice::Crc32c,
                "ErrorRecoveryLevel" => v == "Reject",
                _ => false,
            };
            if insisted {
                return Err(negotiation(key, v));
            }
            return Ok(());
        }
        match key {
            "HeaderDigest" | "DataDigest" => {
                let choice = if key == "HeaderDigest" {
                    c.header_digest
                } else {
                    c.data_digest
                };
                let on = match v {
                    "CRC32C" if choice != DigestChoice::None => true,
                    "None" if choice != DigestChoice::Crc32c => false,
                    _ => return Err(negotiation(key, v)),
                };
                if key == "HeaderDigest" {
                    n.header_digest = on;
                } else {
                    n.data_digest = on;
                }
            }
            "MaxRecvDataSegmentLength" => {
                n.max_xmit_data_segment_length = number(key, v, 512, 16_777_215)?;
            }
            "MaxBurstLength" => {
                n.max_burst_length = number(key, v, 512, 16_777_215)?.min(c.max_burst_length);
            }
            "FirstBurstLength" => {
                n.first_burst_length = number(key, v, 512, 16_777_215)?.min(c.first_burst_length);
            }
            "MaxOutstandingR2T" => {
                let r = number(key, v, 1, 65_535)?.min(u32::from(c.max_outstanding_r2t.max(1)));
                n.max_outstanding_r2t = r as u16;
            }
            "MaxConnections" => {
                n.max_connections = number(key, v, 1, 65_535)? as u16;
            }
            "DefaultTime2Wait" => n.default_time2wait = number(key, v, 0, 3600)? as u16,
            "DefaultTime2Retain" => n.default_time2retain = number(key, v, 0, 3600)? as u16,
            "InitialR2T" => n.initial_r2t = boolean(key, v)?,
            "ImmediateData" => n.immediate_data = boolean(key, v)?,
            "DataPDUInOrder" => n.data_pdu_in_order = boolean(key, v)?,
            "DataSequenceInOrder" => n.data_sequence_in_order = boolean(key, v)?,
            "ErrorRecoveryLevel" if number(key, v, 0, 2)? != 0 => {
                return Err(negotiation(key, v));
            }
            _ => {}
        }
        // An AND/OR result can only move the way its function allows.
        if (key == "ImmediateData" && n.immediate_data && !c.immediate_data)
            || (key == "InitialR2T" && !n.initial_r2t && c.initial_r2t)
        {
            return Err(negotiation(key, v));
        }
        Ok(())
    }

    /// Our answer to a key the target offered or declared on its own.
    fn answer_target_offer(&mut self, key: &str, v: &str) -> Result<Option<String>, Error> {
        Ok(match key {
            // Declarations: nothing to answer.
            "TargetPortalGroupTag" | "TargetAlias" | "TargetAddress" => None,
            "MaxRecvDataSegmentLength" => {
                self.negotiated.max_xmit_data_segment_length = number(key, v, 512, 16_777_215)?;
                None
            }
            "IFMarker" | "OFMarker" => Some("No".into()),
            "IFMarkInt" | "OFMarkInt" => Some("Irrelevant".into()),
            _ => Some("NotUnderstood".into()),
        })
    }
}

fn value<'a>(keys: &'a [(String, String)], key: &str) -> Option<&'a str> {
    keys.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

/// A Login Response with a non-zero status class: a redirect (with the address to try), or
/// the initiator's or the target's error.
fn refused(class: u8, detail: u8, data: &[u8]) -> LoginError {
    let keys = text::parse(data, 256).unwrap_or_default();
    let get = |k: &str| keys.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    match class {
        1 => LoginError::Redirect {
            permanent: detail == 2,
            address: get("TargetAddress").unwrap_or_default(),
        },
        2 => LoginError::Initiator { detail },
        3 => LoginError::Target { detail },
        _ => LoginError::Status { class, detail },
    }
}

fn bad_value(key: &str, value: &str) -> Error {
    ProtocolError::BadValue {
        key: key.into(),
        value: value.into(),
    }
    .into()
}

fn negotiation(key: &str, value: &str) -> Error {
    LoginError::Negotiation {
        key: key.into(),
        value: value.into(),
    }
    .into()
}

fn number(key: &str, v: &str, min: u32, max: u32) -> Result<u32, Error> {
    iscsi::negotiation::parse_number(v)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| bad_value(key, v))
}

fn boolean(key: &str, v: &str) -> Result<bool, Error> {
    match v {
        "Yes" => Ok(true),
        "No" => Ok(false),
        _ => Err(bad_value(key, v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ChapConfig;
    use crate::fake::{self, login_response, take_login, Sent};

    const RANDOM: [u8; LOGIN_RANDOM_BYTES] =
        [42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
    const USER: &str = "alice";
    const SECRET: &[u8] = b"alice-secret-2026";
    const TUSER: &str = "target-user";
    const TSECRET: &[u8] = b"target-secret-26";

    fn chap_config(mutual: bool) -> SessionConfig {
        let mut c = fake::config();
        let mut chap = ChapConfig::new(USER, SECRET);
        if mutual {
            chap = chap.with_mutual(TUSER, TSECRET);
        }
        c.auth = Auth::Chap(chap);
        c
    }

    fn one(login: &mut Login) -> Sent {
        let mut sent = take_login(login);
        assert_eq!(sent.len(), 1, "one request at a time: {sent:?}");
        sent.remove(0)
    }

    fn answer(login: &mut Login, bytes: &[u8]) -> Result<usize, Error> {
        login.receive(bytes)
    }

    /// Operational stage: the target's final answer.
    fn finish_operational(login: &mut Login, req: &Sent, keys: &[(&str, &str)]) {
        assert_eq!(req.bhs.flags(), 0x80 | (1 << 2) | 3, "CSG=1 NSG=3 T");
        let bytes = login_response(&req.bhs, keys, true, (0, 0), 2);
        assert_eq!(answer(login, &bytes).unwrap(), bytes.len());
        assert!(login.is_complete());
    }

    #[test]
    fn no_auth_login_negotiates_and_reaches_full_feature() {
        let mut login = Login::new(fake::config(), RANDOM);
        let first = one(&mut login);
        assert_eq!(first.op(), Opcode::LoginRequest as u8);
        assert!(first.bhs.immediate());
        assert_eq!(first.bhs.flags(), 0x80 | 1, "CSG=0 NSG=1 T");
        assert_eq!(first.bhs.isid(), fake::config().isid);
        assert_eq!(first.key("InitiatorName").as_deref(), Some(fake::INITIATOR));
        assert_eq!(first.key("TargetName").as_deref(), Some(fake::TARGET));
        assert_eq!(first.key("SessionType").as_deref(), Some("Normal"));
        assert_eq!(first.key("AuthMethod").as_deref(), Some("None"));
        // The target declares its receive limit already in the security stage's response.
        let bytes = login_response(
            &first.bhs,
            &[
                ("AuthMethod", "None"),
                ("TargetPortalGroupTag", "1"),
                ("MaxRecvDataSegmentLength", "131072"),
            ],
            true,
            (0, 0),
            5,
        );
        answer(&mut login, &bytes).unwrap();
        assert_eq!(login.negotiated().max_xmit_data_segment_length, 131_072);
        let op = one(&mut login);
        assert_eq!(op.bhs.u32_at(off::EXP_STAT_SN), 6);
        for (k, v) in [
            ("HeaderDigest", "None"),
            ("DataDigest", "None"),
            ("ErrorRecoveryLevel", "0"),
            ("MaxConnections", "1"),
            ("InitialR2T", "No"),
            ("ImmediateData", "Yes"),
            ("MaxRecvDataSegmentLength", "262144"),
        ] {
            assert_eq!(op.key(k).as_deref(), Some(v), "{k}");
        }
        // The target offers an unknown key first: we answer NotUnderstood.
        let bytes = login_response(
            &op.bhs,
            &[
                ("X-com.example.Frob", "yes"),
                ("MaxRecvDataSegmentLength", "65536"),
            ],
            false,
            (0, 0),
            6,
        );
        answer(&mut login, &bytes).unwrap();
        let again = one(&mut login);
        assert_eq!(
            again.key("X-com.example.Frob").as_deref(),
            Some("NotUnderstood")
        );
        finish_operational(
            &mut login,
            &again,
            &[
                ("HeaderDigest", "None"),
                ("DataDigest", "None"),
                ("InitialR2T", "Yes"),
                ("ImmediateData", "Yes"),
                ("MaxBurstLength", "131072"),
                ("FirstBurstLength", "65536"),
                ("MaxOutstandingR2T", "1"),
                ("ErrorRecoveryLevel", "0"),
                ("TargetAlias", "fake"),
            ],
        );
        let n = login.negotiated().clone();
        assert_eq!(n.max_xmit_data_segment_length, 65536);
        assert_eq!(n.max_burst_length, 131_072);
        assert_eq!(n.first_burst_length, 65_536);
        assert!(n.initial_r2t && n.immediate_data);
        assert_eq!(n.tsih, 7);
        assert_eq!(n.target_portal_group_tag, Some(1));
        assert_eq!(n.target_alias.as_deref(), Some("fake"));
        let s = login.into_session(Instant::now()).unwrap();
        assert_eq!(s.command_window(), (1, 1, 32));
    }

    /// Drives CHAP up to our CHAP_N/CHAP_R; returns the request carrying them.
    fn chap_until_response(login: &mut Login, challenge: &str, id: &str) -> Result<Sent, Error> {
        let first = one(login);
        assert_eq!(first.key("AuthMethod").as_deref(), Some("CHAP"));
        assert_eq!(
            first.bhs.flags() & 0x80,
            0,
            "no transit before CHAP is done"
        );
        answer(
            login,
            &login_response(&first.bhs, &[("AuthMethod", "CHAP")], false, (0, 0), 0),
        )?;
        let a = one(login);
        assert_eq!(a.key("CHAP_A").as_deref(), Some("5,8,7,6"), "MD5 first");
        answer(
            login,
            &login_response(
                &a.bhs,
                &[("CHAP_A", "5"), ("CHAP_I", id), ("CHAP_C", challenge)],
                false,
                (0, 0),
                1,
            ),
        )?;
        Ok(one(login))
    }

    #[test]
    fn one_way_chap_answers_the_challenge() {
        let mut login = Login::new(chap_config(false), RANDOM);
        let r = chap_until_response(&mut login, "0x00010203", "7").unwrap();
        let want = Algorithm::Md5.response(7, &chap::Secret::new(SECRET), &[0, 1, 2, 3]);
        assert_eq!(r.key("CHAP_N").as_deref(), Some(USER));
        assert_eq!(r.key("CHAP_R"), Some(chap::encode_hex(&want)));
        assert_eq!(r.key("CHAP_C"), None, "no mutual challenge");
        assert_eq!(r.bhs.flags(), 0x80 | 1);
        answer(&mut login, &login_response(&r.bhs, &[], true, (0, 0), 2)).unwrap();
        let op = one(&mut login);
        finish_operational(&mut login, &op, &[]);
    }

    fn mutual_until_verdict(target_keys: &[(&str, &str)]) -> Result<Login, Error> {
        let mut login = Login::new(chap_config(true), RANDOM);
        let r = chap_until_response(&mut login, "0xaabbccddeeff00112233445566778899", "0x10")?;
        assert_eq!(r.key("CHAP_I").as_deref(), Some("42"));
        assert_eq!(r.key("CHAP_C"), Some(chap::encode_hex(&RANDOM[1..])));
        answer(
            &mut login,
            &login_response(&r.bhs, target_keys, true, (0, 0), 2),
        )?;
        Ok(login)
    }

    #[test]
    fn mutual_chap_verifies_the_target() {
        let good = chap::encode_hex(&Algorithm::Md5.response(
            42,
            &chap::Secret::new(TSECRET),
            &RANDOM[1..],
        ));
        let mut login = mutual_until_verdict(&[("CHAP_N", TUSER), ("CHAP_R", &good)]).unwrap();
        let op = one(&mut login);
        finish_operational(&mut login, &op, &[]);

        let wrong = chap::encode_hex(&Algorithm::Md5.response(
            42,
            &chap::Secret::new(b"not-the-target-secret".to_vec()),
            &RANDOM[1..],
        ));
        let e = mutual_until_verdict(&[("CHAP_N", TUSER), ("CHAP_R", &wrong)]).unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::TargetResponse))),
            "{e}"
        );
        let e = mutual_until_verdict(&[("CHAP_N", "mallory"), ("CHAP_R", &good)]).unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::TargetName(_)))),
            "{e}"
        );
        let e = mutual_until_verdict(&[]).unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::TargetResponse))),
            "{e}"
        );
        let e = mutual_until_verdict(&[("CHAP_N", TUSER), ("CHAP_R", "zz")]).unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::TargetResponse))),
            "{e}"
        );
        // Truncated response (a prefix of the right one).
        let e = mutual_until_verdict(&[("CHAP_N", TUSER), ("CHAP_R", &good[..20])]).unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::TargetResponse))),
            "{e}"
        );
    }

    #[test]
    fn bad_challenges_are_refused() {
        let long = format!("0x{}", "ab".repeat(1025));
        let reflected = chap::encode_hex(&RANDOM[1..]);
        for (challenge, id) in [
            ("0x", "1"),
            ("", "1"),
            ("zz", "1"),
            ("0xqq", "1"),
            (long.as_str(), "1"),
            ("0x0102", "256"),
            ("0x0102", "-1"),
            ("0x0102", ""),
        ] {
            let mut login = Login::new(chap_config(false), RANDOM);
            let e = chap_until_response(&mut login, challenge, id).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Login(LoginError::Auth(
                        AuthError::Challenge(_) | AuthError::Identifier(_)
                    ))
                ),
                "{challenge:?}/{id:?}: {e}"
            );
            assert!(login.receive(&[]).is_err(), "a failed login stays failed");
        }
        let mut login = Login::new(chap_config(true), RANDOM);
        let e = chap_until_response(&mut login, &reflected, "1").unwrap_err();
        assert!(
            matches!(e, Error::Login(LoginError::Auth(AuthError::Challenge(_)))),
            "{e}"
        );
        // An algorithm we did not offer, and a missing CHAP_C.
        for keys in [
            &[("CHAP_A", "99"), ("CHAP_I", "1"), ("CHAP_C", "0x01")][..],
            &[("CHAP_A", "5"), ("CHAP_I", "1")][..],
        ] {
            let mut login = Login::new(chap_config(false), RANDOM);
            let first = one(&mut login);
            answer(
                &mut login,
                &login_response(&first.bhs, &[("AuthMethod", "CHAP")], false, (0, 0), 0),
            )
            .unwrap();
            let a = one(&mut login);
            let e =
                answer(&mut login, &login_response(&a.bhs, keys, false, (0, 0), 1)).unwrap_err();
            assert!(matches!(e, Error::Login(LoginError::Auth(_))), "{e}");
        }
        // The target refuses CHAP.
        let mut login = Login::new(chap_config(false), RANDOM);
        let first = one(&mut login);
        let e = answer(
            &mut login,
            &login_response(&first.bhs, &[("AuthMethod", "Reject")], false, (0, 0), 0),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Login(LoginError::Auth(AuthError::MethodRefused(_)))
            ),
            "{e}"
        );
    }

    #[test]
    fn status_classes_are_typed_errors() {
        type Case<'a> = ((u8, u8), &'a [(&'a str, &'a str)]);
        let cases: [Case; 5] = [
            ((1, 1), &[("TargetAddress", "10.0.0.2:3260,1")]),
            ((1, 2), &[("TargetAddress", "[::1]:3261,1")]),
            ((2, 1), &[]),
            ((3, 1), &[]),
            ((4, 0), &[]),
        ];
        let mut got = Vec::new();
        for (status, keys) in cases {
            let mut login = Login::new(fake::config(), RANDOM);
            let first = one(&mut login);
            got.push(
                answer(
                    &mut login,
                    &login_response(&first.bhs, keys, false, status, 0),
                )
                .unwrap_err(),
            );
        }
        let login_errors: Vec<LoginError> = got
            .into_iter()
            .map(|e| match e {
                Error::Login(l) => l,
                other => panic!("{other}"),
            })
            .collect();
        assert_eq!(
            login_errors,
            vec![
                LoginError::Redirect {
                    permanent: false,
                    address: "10.0.0.2:3260,1".into()
                },
                LoginError::Redirect {
                    permanent: true,
                    address: "[::1]:3261,1".into()
                },
                LoginError::Initiator { detail: 1 },
                LoginError::Target { detail: 1 },
                LoginError::Status {
                    class: 4,
                    detail: 0
                },
            ]
        );
        assert!(login_errors[2]
            .describe()
            .contains("authentication failure"));
        assert!(login_errors[3].describe().contains("service unavailable"));
    }

    #[test]
    fn continued_login_text_is_requested_and_joined() {
        let mut login = Login::new(fake::config(), RANDOM);
        let first = one(&mut login);
        let whole = fake::text(&[("AuthMethod", "None"), ("TargetAlias", "continued")]);
        let (a, b) = whole.split_at(7);
        let mut bhs = Bhs::from_slice(&login_response(&first.bhs, &[], false, (0, 0), 0)).unwrap();
        bhs.set_flags(0x40); // C, CSG 0
        let part1 = fake::encode(&bhs, a, &Framing::LOGIN);
        answer(&mut login, &part1).unwrap();
        let empty = one(&mut login);
        assert!(empty.data.is_empty());
        assert_eq!(
            empty.bhs.flags(),
            0x80 | 1,
            "the same stage and transit wish"
        );
        bhs.set_flags(0x80 | 1);
        let part2 = fake::encode(&bhs, b, &Framing::LOGIN);
        answer(&mut login, &part2).unwrap();
        assert_eq!(
            login.negotiated().target_alias.as_deref(),
            Some("continued")
        );
        let op = one(&mut login);
        assert_eq!(op.bhs.flags(), 0x80 | (1 << 2) | 3);
    }

    #[test]
    fn garbage_and_wrong_pdus_during_login() {
        let first = |login: &mut Login| one(login);
        // A SCSI Response during login.
        let mut login = Login::new(fake::config(), RANDOM);
        first(&mut login);
        let resp = fake::encode(&Bhs::new(Opcode::ScsiResponse), &[], &Framing::LOGIN);
        assert!(matches!(
            answer(&mut login, &resp),
            Err(Error::Protocol(ProtocolError::UnexpectedOpcode(0x21)))
        ));
        // An opcode no target sends.
        let mut login = Login::new(fake::config(), RANDOM);
        first(&mut login);
        let mut raw = [0u8; 48];
        raw[0] = 0x3e;
        assert!(matches!(
            answer(&mut login, &raw),
            Err(Error::Protocol(ProtocolError::UnknownOpcode(0x3e)))
        ));
        // Truncated: nothing consumed, nothing decided.
        let mut login = Login::new(fake::config(), RANDOM);
        let req = first(&mut login);
        let ok = login_response(&req.bhs, &[("AuthMethod", "None")], true, (0, 0), 0);
        assert_eq!(answer(&mut login, &ok[..30]).unwrap(), 0);
        assert_eq!(answer(&mut login, &ok[..ok.len() - 1]).unwrap(), 0);
        assert_eq!(answer(&mut login, &ok).unwrap(), ok.len());
        // A data segment longer than we accept.
        let mut login = Login::new(fake::config(), RANDOM);
        let req = first(&mut login);
        let mut huge = Bhs::from_slice(&login_response(&req.bhs, &[], false, (0, 0), 0)).unwrap();
        huge.set_data_segment_len(0xff_ffff);
        assert!(matches!(
            answer(&mut login, &huge.0),
            Err(Error::Protocol(ProtocolError::Frame(_)))
        ));
        // Another ISID, a text without NUL, T on a response we did not ask to transit.
        let mut login = Login::new(fake::config(), RANDOM);
        let req = first(&mut login);
        let mut other = Bhs::from_slice(&login_response(&req.bhs, &[], true, (0, 0), 0)).unwrap();
        let mut isid = other.isid();
        isid[1] ^= 1;
        other.set_isid(isid);
        assert!(answer(&mut login, &fake::encode(&other, &[], &Framing::LOGIN)).is_err());
        let mut login = Login::new(fake::config(), RANDOM);
        let req = first(&mut login);
        let mut bhs = Bhs::from_slice(&login_response(&req.bhs, &[], true, (0, 0), 0)).unwrap();
        bhs.set_data_segment_len(0);
        let bad = fake::encode(&bhs, b"AuthMethod=None", &Framing::LOGIN);
        assert!(matches!(
            answer(&mut login, &bad),
            Err(Error::Protocol(ProtocolError::Text(_)))
        ));
        let mut login = Login::new(chap_config(false), RANDOM);
        let req = first(&mut login);
        let transit = login_response(&req.bhs, &[("AuthMethod", "CHAP")], false, (0, 0), 0);
        let mut bhs = Bhs::from_slice(&transit).unwrap();
        bhs.set_flags(0x80 | 1);
        assert!(answer(
            &mut login,
            &fake::encode(
                &bhs,
                &fake::text(&[("AuthMethod", "CHAP")]),
                &Framing::LOGIN
            )
        )
        .is_err());
    }

    #[test]
    fn a_target_that_never_transits_is_cut_off() {
        let mut login = Login::new(fake::config(), RANDOM);
        let mut req = one(&mut login);
        let err = loop {
            match answer(&mut login, &login_response(&req.bhs, &[], false, (0, 0), 0)) {
                Ok(_) => req = one(&mut login),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, Error::Login(LoginError::TooManyRounds)),
            "{err}"
        );
    }

    #[test]
    fn digests_and_erl_must_be_acceptable() {
        let mut c = fake::config();
        c.header_digest = DigestChoice::Crc32c;
        c.data_digest = DigestChoice::Prefer;
        let run = |c: &SessionConfig, keys: &[(&str, &str)]| -> Result<Negotiated, Error> {
            let mut login = Login::new(c.clone(), RANDOM);
            let req = one(&mut login);
            answer(&mut login, &login_response(&req.bhs, &[], true, (0, 0), 0))?;
            let op = one(&mut login);
            assert_eq!(op.key("HeaderDigest").as_deref(), Some("CRC32C"));
            assert_eq!(op.key("DataDigest").as_deref(), Some("CRC32C,None"));
            answer(&mut login, &login_response(&op.bhs, keys, true, (0, 0), 1))?;
            Ok(login.negotiated().clone())
        };
        let n = run(&c, &[("HeaderDigest", "CRC32C"), ("DataDigest", "None")]).unwrap();
        assert!(n.header_digest && !n.data_digest);
        assert!(run(&c, &[("HeaderDigest", "None")]).is_err());
        assert!(run(&c, &[("HeaderDigest", "Reject")]).is_err());
        assert!(run(&c, &[("ErrorRecoveryLevel", "2")]).is_err());
        assert!(run(&c, &[("MaxBurstLength", "12")]).is_err());
        assert!(run(&c, &[("MaxBurstLength", "lots")]).is_err());
        assert!(run(&c, &[("ImmediateData", "Maybe")]).is_err());
        // An AND result of Yes when we said No breaks the rule.
        let mut no_imm = c.clone();
        no_imm.immediate_data = false;
        assert!(run(&no_imm, &[("ImmediateData", "Yes")]).is_err());
        // A min-function answer above our offer is clamped to it.
        let n = run(&c, &[("MaxBurstLength", "16777215")]).unwrap();
        assert_eq!(n.max_burst_length, c.max_burst_length);
    }
}
