//! Operational parameter negotiation (RFC 7143 §6.2, §13): each key's type and result function.
//!
//! The target is always the responder here: the initiator offers, we answer with the result value
//! computed from our own limit and the offer under the key's rule.

use crate::text;

/// The limits and preferences the target brings to a negotiation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetLimits {
    /// What we declare as our MaxRecvDataSegmentLength (bytes we accept per PDU).
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub max_outstanding_r2t: u16,
    pub header_digest_allowed: bool,
    pub data_digest_allowed: bool,
}

impl Default for TargetLimits {
    fn default() -> Self {
        TargetLimits {
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            first_burst_length: 65_536,
            max_outstanding_r2t: 8,
            header_digest_allowed: true,
            data_digest_allowed: true,
        }
    }
}

/// The negotiated session and connection parameters (ERL 0, one connection per session).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionParams {
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_connections: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub max_outstanding_r2t: u16,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u8,
    /// Initiator's MaxRecvDataSegmentLength: the largest data segment we may send.
    pub max_xmit_data_segment_length: u32,
    /// Ours: the largest data segment we accept.
    pub max_recv_data_segment_length: u32,
}

impl SessionParams {
    /// RFC 7143 §13 defaults, with our declared receive limit.
    pub fn rfc_defaults(limits: &TargetLimits) -> SessionParams {
        SessionParams {
            header_digest: false,
            data_digest: false,
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 262_144.min(limits.max_burst_length),
            first_burst_length: 65_536.min(limits.first_burst_length),
            default_time2wait: 2,
            default_time2retain: 0,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: 0,
            max_xmit_data_segment_length: 8192,
            max_recv_data_segment_length: limits.max_recv_data_segment_length,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionType {
    Normal,
    Discovery,
}

/// Why a negotiation cannot continue; maps to a Login Response status (see `login`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NegotiationError {
    /// A key the RFC forbids in this stage or session, or sent twice: initiator error 0x0200.
    Protocol(String),
}

/// Keys answered "Irrelevant" in a discovery session (RFC 7143 §13: they only make sense for data).
const DISCOVERY_IRRELEVANT: &[&str] = &[
    "MaxBurstLength",
    "FirstBurstLength",
    "InitialR2T",
    "ImmediateData",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
    "DefaultTime2Wait",
    "DefaultTime2Retain",
    "MaxConnections",
];

/// Keys that may appear only in the security stage or are handled by the login state machine.
pub const LOGIN_DECLARATIVE: &[&str] = &[
    "InitiatorName",
    "InitiatorAlias",
    "TargetName",
    "SessionType",
    "AuthMethod",
];

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

/// Numbers may be decimal or 0x-prefixed hex (RFC 7143 §6.1 "numerical-value").
pub fn parse_number(v: &str) -> Option<u64> {
    if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if hex.is_empty() || hex.len() > 16 {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    } else {
        if v.is_empty() || v.len() > 20 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        v.parse().ok()
    }
}

fn number_in(v: &str, lo: u64, hi: u64) -> Option<u64> {
    parse_number(v).filter(|n| (lo..=hi).contains(n))
}

/// The state of one login's operational negotiation.
#[derive(Clone, Debug)]
pub struct Negotiator {
    pub limits: TargetLimits,
    pub params: SessionParams,
    pub session_type: SessionType,
    answered: Vec<String>,
    declared_recv_length: bool,
}

impl Negotiator {
    pub fn new(limits: TargetLimits, session_type: SessionType) -> Negotiator {
        let params = SessionParams::rfc_defaults(&limits);
        Negotiator {
            limits,
            params,
            session_type,
            answered: Vec::new(),
            declared_recv_length: false,
        }
    }

    /// Answers the operational keys of one complete request. Keys handled by the login state
    /// machine (names, session type, AuthMethod, CHAP_*) are skipped here.
    pub fn respond(
        &mut self,
        offers: &[(String, String)],
        out: &mut Vec<(String, String)>,
    ) -> Result<(), NegotiationError> {
        for (key, value) in offers {
            if LOGIN_DECLARATIVE.contains(&key.as_str()) || key.starts_with("CHAP_") {
                continue;
            }
            if self.answered.iter().any(|k| k == key) {
                return Err(NegotiationError::Protocol(format!(
                    "key {key} negotiated twice"
                )));
            }
            self.answered.push(key.clone());
            if let Some(answer) = self.answer(key, value) {
                out.push((key.clone(), answer));
            }
        }
        Ok(())
    }

    pub fn has_declared(&self) -> bool {
        self.declared_recv_length
    }

    /// Declarations the target makes once in the operational stage even when not asked.
    pub fn declarations(&mut self, out: &mut Vec<(String, String)>) {
        // A key appears at most once per text (RFC 7143 §6.1): if this response already answers
        // the initiator's MaxRecvDataSegmentLength (with Reject), declare ours in a later one.
        let answered = out.iter().any(|(k, _)| k == "MaxRecvDataSegmentLength");
        if !self.declared_recv_length && !answered {
            self.declared_recv_length = true;
            out.push((
                "MaxRecvDataSegmentLength".into(),
                self.limits.max_recv_data_segment_length.to_string(),
            ));
        }
    }

    fn answer(&mut self, key: &str, value: &str) -> Option<String> {
        let discovery = self.session_type == SessionType::Discovery;
        if discovery && DISCOVERY_IRRELEVANT.contains(&key) {
            return Some("Irrelevant".into());
        }
        match key {
            "HeaderDigest" | "DataDigest" => self.answer_digest(key, value),
            "MaxConnections"
            | "MaxRecvDataSegmentLength"
            | "MaxBurstLength"
            | "FirstBurstLength"
            | "DefaultTime2Wait"
            | "DefaultTime2Retain"
            | "MaxOutstandingR2T"
            | "ErrorRecoveryLevel"
            | "iSCSIProtocolLevel" => self.answer_number(key, value),
            "InitialR2T"
            | "ImmediateData"
            | "DataPDUInOrder"
            | "DataSequenceInOrder"
            | "IFMarker"
            | "OFMarker" => self.answer_bool(key, value),
            "IFMarkInt" | "OFMarkInt" => Some("Irrelevant".into()),
            "TaskReporting" => Some("RFC3720".into()),
            // Target-declared keys the initiator must not send.
            "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => reject(),
            _ => Some("NotUnderstood".into()),
        }
    }

    /// HeaderDigest, DataDigest: list negotiation, the first offered value we support wins.
    fn answer_digest(&mut self, key: &str, value: &str) -> Option<String> {
        let header = key == "HeaderDigest";
        let allowed = if header {
            self.limits.header_digest_allowed
        } else {
            self.limits.data_digest_allowed
        };
        let choice = value
            .split(',')
            .find(|v| *v == "None" || (*v == "CRC32C" && allowed));
        let Some(choice) = choice else {
            return reject();
        };
        let on = choice == "CRC32C";
        if header {
            self.params.header_digest = on;
        } else {
            self.params.data_digest = on;
        }
        Some(choice.to_string())
    }

    /// The boolean keys.
    fn answer_bool(&mut self, key: &str, value: &str) -> Option<String> {
        let Some(v) = parse_bool(value) else {
            return reject();
        };
        let p = &mut self.params;
        match key {
            // OR: we do not require R2T for the first burst, so the offer decides.
            "InitialR2T" => p.initial_r2t = v,
            // AND: we accept immediate data, so the offer decides.
            "ImmediateData" => p.immediate_data = v,
            // OR with our Yes: always Yes.
            "DataPDUInOrder" | "DataSequenceInOrder" => return Some("Yes".into()),
            // AND with our No: markers are never used (RFC 7143 removed them).
            _ => return Some("No".into()),
        }
        Some(yes_no(v).into())
    }

    /// The numeric keys, each within its range (else Reject).
    fn answer_number(&mut self, key: &str, value: &str) -> Option<String> {
        let (min, max) = match key {
            "MaxConnections" | "MaxOutstandingR2T" => (1, 65535),
            "MaxRecvDataSegmentLength" | "MaxBurstLength" | "FirstBurstLength" => (512, 16_777_215),
            "DefaultTime2Wait" | "DefaultTime2Retain" => (0, 3600),
            "ErrorRecoveryLevel" => (0, 2),
            _ => (0, 31), // iSCSIProtocolLevel
        };
        let Some(v) = number_in(value, min, max) else {
            return reject();
        };
        let p = &mut self.params;
        match key {
            "MaxConnections" => {
                p.max_connections = 1;
                Some("1".into())
            }
            // Declarative: the initiator tells us how much it accepts per PDU.
            "MaxRecvDataSegmentLength" => {
                p.max_xmit_data_segment_length = v as u32;
                None
            }
            "MaxBurstLength" => {
                p.max_burst_length = (v as u32).min(self.limits.max_burst_length);
                p.first_burst_length = p.first_burst_length.min(p.max_burst_length);
                Some(p.max_burst_length.to_string())
            }
            "FirstBurstLength" => {
                p.first_burst_length = (v as u32)
                    .min(self.limits.first_burst_length)
                    .min(p.max_burst_length);
                Some(p.first_burst_length.to_string())
            }
            // Max function; our own value is 0 so the offer stands.
            "DefaultTime2Wait" => {
                p.default_time2wait = v as u16;
                Some(v.to_string())
            }
            // Min function; at ERL 0 we retain nothing, so 0.
            "DefaultTime2Retain" => {
                p.default_time2retain = 0;
                Some("0".into())
            }
            "MaxOutstandingR2T" => {
                p.max_outstanding_r2t = (v as u16).min(self.limits.max_outstanding_r2t);
                Some(p.max_outstanding_r2t.to_string())
            }
            "ErrorRecoveryLevel" => {
                p.error_recovery_level = 0;
                Some("0".into())
            }
            // iSCSIProtocolLevel (RFC 7144): numerical min; we implement RFC 7143 (level 1).
            _ => Some(v.min(1).to_string()),
        }
    }
}

fn reject() -> Option<String> {
    Some("Reject".to_string())
}

/// Parses and answers one text in a single call (used by tests and the Text phase).
pub fn respond_text(
    negotiator: &mut Negotiator,
    data: &[u8],
    max_keys: usize,
) -> Result<Vec<(String, String)>, NegotiationError> {
    let offers =
        text::parse(data, max_keys).map_err(|e| NegotiationError::Protocol(e.to_string()))?;
    let mut out = Vec::new();
    negotiator.respond(&offers, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn neg() -> Negotiator {
        Negotiator::new(TargetLimits::default(), SessionType::Normal)
    }

    fn answer(n: &mut Negotiator, k: &str, v: &str) -> Option<String> {
        let mut out = Vec::new();
        n.respond(&[(k.to_string(), v.to_string())], &mut out)
            .unwrap();
        out.into_iter().find(|(key, _)| key == k).map(|(_, v)| v)
    }

    #[test]
    fn digests_list_choice() {
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("CRC32C")
        );
        assert!(n.params.header_digest);
        assert_eq!(
            answer(&mut n, "DataDigest", "None,CRC32C").as_deref(),
            Some("None")
        );
        assert!(!n.params.data_digest);
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "HeaderDigest", "MD5").as_deref(),
            Some("Reject")
        );
        let mut n = Negotiator::new(
            TargetLimits {
                header_digest_allowed: false,
                ..TargetLimits::default()
            },
            SessionType::Normal,
        );
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("None")
        );
        assert!(!n.params.header_digest);
    }

    #[test]
    fn boolean_and_or() {
        let mut n = neg();
        assert_eq!(answer(&mut n, "InitialR2T", "No").as_deref(), Some("No"));
        assert!(!n.params.initial_r2t);
        let mut n = neg();
        assert_eq!(answer(&mut n, "InitialR2T", "Yes").as_deref(), Some("Yes"));
        assert!(n.params.initial_r2t);
        let mut n = neg();
        assert_eq!(answer(&mut n, "ImmediateData", "No").as_deref(), Some("No"));
        assert!(!n.params.immediate_data);
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "ImmediateData", "Maybe").as_deref(),
            Some("Reject")
        );
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "DataPDUInOrder", "No").as_deref(),
            Some("Yes")
        );
        assert_eq!(answer(&mut n, "IFMarker", "Yes").as_deref(), Some("No"));
    }

    #[test]
    fn numerical_min_max() {
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "16776192").as_deref(),
            Some("1048576")
        );
        assert_eq!(
            answer(&mut n, "FirstBurstLength", "262144").as_deref(),
            Some("65536")
        );
        assert_eq!(
            answer(&mut n, "MaxOutstandingR2T", "1").as_deref(),
            Some("1")
        );
        assert_eq!(
            answer(&mut n, "DefaultTime2Wait", "5").as_deref(),
            Some("5")
        );
        assert_eq!(
            answer(&mut n, "DefaultTime2Retain", "20").as_deref(),
            Some("0")
        );
        assert_eq!(
            answer(&mut n, "ErrorRecoveryLevel", "2").as_deref(),
            Some("0")
        );
        assert_eq!(answer(&mut n, "MaxConnections", "8").as_deref(), Some("1"));
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "4096").as_deref(),
            Some("4096")
        );
        // FirstBurstLength never exceeds MaxBurstLength.
        assert_eq!(
            answer(&mut n, "FirstBurstLength", "65536").as_deref(),
            Some("4096")
        );
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "100").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            answer(&mut n, "FirstBurstLength", "abc").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            answer(&mut n, "MaxOutstandingR2T", "0").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            answer(&mut n, "DefaultTime2Wait", "3601").as_deref(),
            Some("Reject")
        );
    }

    #[test]
    fn declarative_recv_length() {
        let mut n = neg();
        assert_eq!(answer(&mut n, "MaxRecvDataSegmentLength", "65536"), None);
        assert_eq!(n.params.max_xmit_data_segment_length, 65536);
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "MaxRecvDataSegmentLength", "100").as_deref(),
            Some("Reject")
        );
        let mut out = Vec::new();
        n.declarations(&mut out);
        n.declarations(&mut out);
        assert_eq!(
            out,
            vec![("MaxRecvDataSegmentLength".into(), "262144".into())]
        );
    }

    #[test]
    fn unknown_and_target_only_keys() {
        let mut n = neg();
        assert_eq!(
            answer(&mut n, "X-com.example.Foo", "1").as_deref(),
            Some("NotUnderstood")
        );
        assert_eq!(
            answer(&mut n, "TargetAlias", "x").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            answer(&mut n, "IFMarkInt", "2048").as_deref(),
            Some("Irrelevant")
        );
        assert_eq!(
            answer(&mut n, "iSCSIProtocolLevel", "2").as_deref(),
            Some("1")
        );
    }

    #[test]
    fn discovery_irrelevant_keys() {
        let mut n = Negotiator::new(TargetLimits::default(), SessionType::Discovery);
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "262144").as_deref(),
            Some("Irrelevant")
        );
        assert_eq!(
            answer(&mut n, "HeaderDigest", "None").as_deref(),
            Some("None")
        );
    }

    #[test]
    fn repeated_key_is_an_error() {
        let mut n = neg();
        let mut out = Vec::new();
        n.respond(&[("InitialR2T".into(), "No".into())], &mut out)
            .unwrap();
        assert!(n
            .respond(&[("InitialR2T".into(), "No".into())], &mut out)
            .is_err());
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_number("0x10"), Some(16));
        assert_eq!(parse_number("10"), Some(10));
        assert_eq!(parse_number(""), None);
        assert_eq!(parse_number("0x"), None);
        assert_eq!(parse_number("-1"), None);
        assert_eq!(parse_number("99999999999999999999999"), None);
    }

    #[test]
    fn respond_text_parses() {
        let mut n = neg();
        let out = respond_text(&mut n, b"ImmediateData=Yes\0InitiatorName=iqn.x\0", 8).unwrap();
        assert_eq!(out, vec![("ImmediateData".into(), "Yes".into())]);
        assert!(respond_text(&mut n, b"bad", 8).is_err());
    }
}

#[cfg(test)]
mod declaration_tests {
    use super::*;

    #[test]
    fn rejected_recv_length_is_not_answered_twice_in_one_text() {
        // Found by the `text_keys` fuzz target: Reject plus our declaration in one response.
        let mut n = Negotiator::new(TargetLimits::default(), SessionType::Normal);
        let mut out = Vec::new();
        n.respond(
            &[("MaxRecvDataSegmentLength".into(), "16777216".into())],
            &mut out,
        )
        .unwrap();
        n.declarations(&mut out);
        let count = out
            .iter()
            .filter(|(k, _)| k == "MaxRecvDataSegmentLength")
            .count();
        assert_eq!(count, 1, "{out:?}");
        assert!(!n.has_declared());
        let mut next = Vec::new();
        n.declarations(&mut next);
        assert_eq!(
            next,
            vec![("MaxRecvDataSegmentLength".into(), "262144".into())]
        );
    }
}
