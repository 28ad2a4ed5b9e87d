//! Text keys: `text::parse` on arbitrary bytes, and `Negotiator::respond` on whatever parses.
//! Invariants: parsed pairs obey the RFC 7143 §6.1 bounds and re-encode to an equivalent text;
//! negotiated parameters never exceed the target's limits or the RFC ranges.
#![no_main]

use arbitrary::Arbitrary;
use iscsi::chap;
use iscsi::negotiation::{respond_text, Negotiator, SessionType, TargetLimits};
use iscsi::text;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    max_keys: u8,
    discovery: bool,
    header_digest_allowed: bool,
    data_digest_allowed: bool,
    /// Two negotiation rounds (login requests) on one negotiator.
    first: Vec<u8>,
    second: Vec<u8>,
    /// Structured offers: known keys with arbitrary values, so the rules are reached often.
    offers: Vec<(u8, String)>,
}

const KEYS: &[&str] = &[
    "HeaderDigest",
    "DataDigest",
    "MaxConnections",
    "InitialR2T",
    "ImmediateData",
    "MaxRecvDataSegmentLength",
    "MaxBurstLength",
    "FirstBurstLength",
    "DefaultTime2Wait",
    "DefaultTime2Retain",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
    "ErrorRecoveryLevel",
    "IFMarker",
    "OFMarker",
    "IFMarkInt",
    "OFMarkInt",
    "iSCSIProtocolLevel",
    "TaskReporting",
    "TargetAlias",
    "InitiatorName",
    "AuthMethod",
    "CHAP_A",
    "X-vendor",
];

fn check_params(n: &Negotiator) {
    let p = &n.params;
    let l = &n.limits;
    assert!(p.max_burst_length <= l.max_burst_length);
    assert!(p.max_burst_length >= 512);
    assert!(p.first_burst_length <= p.max_burst_length, "{p:?}");
    assert!(p.first_burst_length <= l.first_burst_length);
    assert!(p.max_outstanding_r2t >= 1 && p.max_outstanding_r2t <= l.max_outstanding_r2t);
    assert!((512..=16_777_215).contains(&p.max_xmit_data_segment_length));
    assert_eq!(
        p.max_recv_data_segment_length,
        l.max_recv_data_segment_length
    );
    assert_eq!(p.max_connections, 1);
    assert_eq!(p.error_recovery_level, 0);
    assert!(p.default_time2wait <= 3600);
    assert_eq!(p.default_time2retain, 0);
    assert!(!p.header_digest || l.header_digest_allowed);
    assert!(!p.data_digest || l.data_digest_allowed);
    assert!(p.data_pdu_in_order && p.data_sequence_in_order);
}

fn check_answers(answers: &[(String, String)]) {
    for (k, v) in answers {
        assert!(
            !k.is_empty() && k.len() <= text::KEY_LEN_MAX,
            "answer key {k:?}"
        );
        assert!(!k.contains('\0') && !v.contains('\0'));
        assert!(v.len() <= text::VALUE_LEN_MAX);
    }
    // Our answers are themselves valid text.
    let encoded = text::encode(answers);
    let back = text::parse(&encoded, usize::MAX).expect("our answers parse");
    assert_eq!(&back, answers);
}

fuzz_target!(|input: Input| {
    let max_keys = input.max_keys as usize;
    // Binary values (CHAP_C, CHAP_R): what decodes re-encodes to the same bytes.
    for data in [&input.first, &input.second] {
        if let Ok(s) = std::str::from_utf8(data) {
            // Was a panic when byte 2 fell inside a multi-byte character (fixed; see
            // docs/SECURITY.md): hostile values must decode or fail, never panic.
            if let Ok(bytes) = chap::decode_binary(s) {
                assert!(!bytes.is_empty());
                assert_eq!(chap::decode_binary(&chap::encode_hex(&bytes)), Ok(bytes));
            }
            let _ = chap::parse_identifier(s);
        }
    }
    for data in [&input.first, &input.second] {
        if let Ok(pairs) = text::parse(data, max_keys) {
            assert!(pairs.len() <= max_keys);
            for (i, (k, v)) in pairs.iter().enumerate() {
                assert!(!k.is_empty() && k.len() <= text::KEY_LEN_MAX);
                assert!(!k.contains('=') && !k.contains('\0'));
                assert!(v.len() <= text::VALUE_LEN_MAX && !v.contains('\0'));
                assert!(pairs[..i].iter().all(|(k2, _)| k2 != k), "duplicate {k}");
            }
            // Re-encoding gives a text that parses to the same pairs.
            let encoded = text::encode(&pairs);
            assert_eq!(text::parse(&encoded, max_keys).as_ref(), Ok(&pairs));
        }
    }

    let limits = TargetLimits {
        header_digest_allowed: input.header_digest_allowed,
        data_digest_allowed: input.data_digest_allowed,
        ..TargetLimits::default()
    };
    let kind = if input.discovery {
        SessionType::Discovery
    } else {
        SessionType::Normal
    };
    let mut n = Negotiator::new(limits.clone(), kind);
    for data in [&input.first, &input.second] {
        if let Ok(answers) = respond_text(&mut n, data, max_keys.max(1)) {
            check_answers(&answers);
        }
        check_params(&n);
    }

    let mut n = Negotiator::new(limits, kind);
    let offers: Vec<(String, String)> = input
        .offers
        .iter()
        .map(|(k, v)| (KEYS[*k as usize % KEYS.len()].to_string(), v.clone()))
        .collect();
    let mut answers = Vec::new();
    let before = answers.len();
    let result = n.respond(&offers, &mut answers);
    let unique = offers
        .iter()
        .enumerate()
        .all(|(i, (k, _))| offers[..i].iter().all(|(k2, _)| k2 != k));
    if unique {
        assert!(result.is_ok(), "{result:?}");
    }
    assert!(answers.len() >= before);
    for (k, v) in &answers {
        assert!(
            offers.iter().any(|(ok, _)| ok == k),
            "answered unasked key {k}"
        );
        if input.discovery
            && [
                "MaxBurstLength",
                "FirstBurstLength",
                "InitialR2T",
                "ImmediateData",
            ]
            .contains(&k.as_str())
        {
            assert_eq!(v, "Irrelevant");
        }
    }
    check_params(&n);
    n.declarations(&mut answers);
    // A key appears at most once per text (RFC 7143 §6.1): our declaration waits for a later
    // response when this one already answers the initiator's MaxRecvDataSegmentLength.
    let recv_keys = answers
        .iter()
        .filter(|(k, _)| k == "MaxRecvDataSegmentLength")
        .count();
    assert!(recv_keys <= 1, "{answers:?}");
    assert!(
        n.has_declared()
            || answers
                .iter()
                .any(|(k, v)| k == "MaxRecvDataSegmentLength" && v == "Reject"),
        "{answers:?}"
    );
});
