//! The login state machine driven by a sequence of arbitrary Login Requests (and the odd
//! non-login PDU) against a fake policy. Invariant: every `handle` call appends exactly one
//! well-formed Login Response whose fields agree with the request and the returned step.
#![no_main]

use arbitrary::Arbitrary;
use iscsi::chap::{self, Algorithm, Credential, Secret};
use iscsi::login::{
    Admission, AuthRequirement, ChapRequirement, Login, LoginLimits, LoginPolicy, LoginStatus,
    LoginStep, SessionKey,
};
use iscsi::negotiation::{SessionType, TargetLimits};
use iscsi::pdu::{self, off, Bhs, Framing, Opcode, Pdu, BHS_LEN};
use iscsi::text;
use libfuzzer_sys::fuzz_target;
use seam::name::NodeName;

const TARGET: &str = "iqn.2026-11.org.ferrosan:t";

#[derive(Arbitrary, Debug)]
struct Policy {
    deny_normal: Option<(u8, u8)>,
    deny_discovery: Option<(u8, u8)>,
    refuse_open: Option<(u8, u8)>,
    alias: Option<String>,
    tpgt: u16,
    tsih: u16,
    /// Require CHAP (user "alice", secret below), optionally with mutual CHAP.
    chap: bool,
    mutual: bool,
    random: u8,
    /// The OS random source fails (the engine answers 0x0300 Target error).
    rng_fails: bool,
}

const USER: &str = "alice";
const SECRET: &[u8] = b"twelve-bytes-secret";

fn requirement(p: &Policy) -> AuthRequirement {
    if !p.chap {
        return AuthRequirement::None;
    }
    AuthRequirement::Chap(ChapRequirement {
        users: vec![Credential {
            user: USER.into(),
            secret: Secret::new(SECRET),
        }],
        mutual: p.mutual.then(|| Credential {
            user: "target".into(),
            secret: Secret::new(b"target-secret-x".to_vec()),
        }),
        algorithms: Algorithm::ALL.to_vec(),
    })
}

fn status((class, detail): (u8, u8)) -> LoginStatus {
    // Class 0 would be "success" dressed as an error; policies only ever refuse.
    LoginStatus {
        class: 2 + class % 2,
        detail,
    }
}

impl LoginPolicy for Policy {
    fn admit(
        &mut self,
        _initiator: &NodeName,
        target: &NodeName,
    ) -> Result<Admission, LoginStatus> {
        if let Some(s) = self.deny_normal {
            return Err(status(s));
        }
        if target.as_str() != TARGET {
            return Err(LoginStatus::NOT_FOUND);
        }
        Ok(Admission {
            target_alias: self
                .alias
                .clone()
                .filter(|a| !a.contains('\0') && a.len() < 256),
            portal_group_tag: self.tpgt,
            auth: requirement(self),
        })
    }
    fn admit_discovery(&mut self, _initiator: &NodeName) -> Result<Admission, LoginStatus> {
        if let Some(s) = self.deny_discovery {
            return Err(status(s));
        }
        Ok(Admission {
            target_alias: None,
            portal_group_tag: self.tpgt,
            auth: requirement(self),
        })
    }
    fn open_session(&mut self, _key: &SessionKey, _t: SessionType) -> Result<u16, LoginStatus> {
        match self.refuse_open {
            Some(s) => Err(status(s)),
            None => Ok(self.tsih.max(1)),
        }
    }
    fn fill_random(&mut self, buf: &mut [u8]) -> Result<(), LoginStatus> {
        if self.rng_fails {
            return Err(LoginStatus::TARGET_ERROR);
        }
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.random.wrapping_add(i as u8);
        }
        Ok(())
    }
}

#[derive(Arbitrary, Debug)]
enum Text {
    /// Raw bytes.
    Raw(Vec<u8>),
    /// Key=value pairs drawn from the keys a login uses, so negotiation is actually reached.
    Pairs(Vec<(u8, u8)>),
    /// Answer the target's last CHAP challenge (computed with the real secret unless `wrong`),
    /// plus some other pairs.
    ChapAnswer {
        wrong: bool,
        user_ok: bool,
        challenge_back: Option<Vec<u8>>,
        extra: Vec<(u8, u8)>,
    },
}

const KEYS: &[&str] = &[
    "InitiatorName",
    "TargetName",
    "SessionType",
    "AuthMethod",
    "HeaderDigest",
    "DataDigest",
    "MaxRecvDataSegmentLength",
    "MaxBurstLength",
    "FirstBurstLength",
    "ImmediateData",
    "InitialR2T",
    "MaxOutstandingR2T",
    "ErrorRecoveryLevel",
    "InitiatorAlias",
    "CHAP_A",
    "CHAP_I",
    "CHAP_C",
    "CHAP_N",
    "CHAP_R",
    "X-foo",
];
const VALUES: &[&str] = &[
    "iqn.2026-11.org.example:init",
    TARGET,
    "Normal",
    "Discovery",
    "None",
    "CHAP,None",
    "CHAP",
    "CRC32C,None",
    "CRC32C",
    "8192",
    "512",
    "16777215",
    "16777216",
    "0x10000",
    "Yes",
    "No",
    "",
    "Reject",
    "iqn.2026-11.org.ferrosan:other",
    "5",
    "7,5",
    "8,7,6,5",
    "1",
    "0x00112233445566778899aabbccddeeff",
    "0bAAECAwQFBgcICQoLDA0ODw==",
    "alice",
    "0x",
    "0x0",
];

fn pairs(out: &mut Vec<u8>, p: &[(u8, u8)]) {
    for (k, v) in p {
        text::encode_pair(
            out,
            KEYS[*k as usize % KEYS.len()],
            VALUES[*v as usize % VALUES.len()],
        );
    }
}

/// The CHAP exchange as the fuzzer sees it in the target's answers.
#[derive(Default)]
struct ChapSeen {
    algorithm: Option<Algorithm>,
    id: Option<u8>,
    challenge: Option<Vec<u8>>,
    /// We sent the right response to the target's challenge.
    answered_right: bool,
}

impl Text {
    fn bytes(&self, seen: &mut ChapSeen) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Text::Raw(b) => out = b.clone(),
            Text::Pairs(p) => pairs(&mut out, p),
            Text::ChapAnswer {
                wrong,
                user_ok,
                challenge_back,
                extra,
            } => {
                if let (Some(a), Some(id), Some(c)) = (seen.algorithm, seen.id, &seen.challenge) {
                    let secret = if *wrong {
                        Secret::new(b"not-the-secret!".to_vec())
                    } else {
                        Secret::new(SECRET)
                    };
                    let r = a.response(id, &secret, c);
                    text::encode_pair(&mut out, "CHAP_N", if *user_ok { USER } else { "mallory" });
                    text::encode_pair(&mut out, "CHAP_R", &chap::encode_hex(&r));
                    if !*wrong && *user_ok {
                        seen.answered_right = true;
                    }
                    if let Some(cb) = challenge_back {
                        text::encode_pair(&mut out, "CHAP_I", "9");
                        text::encode_pair(&mut out, "CHAP_C", &chap::encode_hex(cb));
                    }
                }
                pairs(&mut out, extra);
            }
        }
        out
    }
}

#[derive(Arbitrary, Debug)]
struct Request {
    /// Mostly 0x43 (immediate Login Request); anything else is an invalid PDU during login.
    opcode: Option<u8>,
    flags: u8,
    version_max: u8,
    version_min: u8,
    isid: Option<[u8; 6]>,
    tsih: u16,
    itt: u32,
    cid: u16,
    cmd_sn: u32,
    exp_stat_sn: u32,
    text: Text,
}

#[derive(Arbitrary, Debug)]
struct Input {
    policy: Policy,
    initial_stat_sn: u32,
    max_requests: u8,
    queue_depth: u8,
    requests: Vec<Request>,
}

fuzz_target!(|input: Input| {
    let mut policy = input.policy;
    let limits = LoginLimits {
        max_requests: (input.max_requests as usize % 20).max(1),
        queue_depth: input.queue_depth as u32,
        ..LoginLimits::default()
    };
    let mut login = Login::new(limits, TargetLimits::default(), input.initial_stat_sn);
    let mut expect_stat_sn = input.initial_stat_sn;
    let mut out = Vec::new();
    let mut seen = ChapSeen::default();
    let chap_required = policy.chap;
    for r in input.requests.iter().take(40) {
        let mut bhs = Bhs::new(Opcode::LoginRequest);
        bhs.0[0] = r.opcode.unwrap_or(0x43);
        bhs.set_flags(r.flags);
        bhs.0[2] = r.version_max;
        bhs.0[3] = r.version_min;
        bhs.0[8..14].copy_from_slice(&r.isid.unwrap_or([0x80, 0, 0, 0, 0, 1]));
        bhs.set_u16(14, r.tsih);
        bhs.set_itt(r.itt);
        bhs.set_u16(20, r.cid);
        bhs.set_u32(off::CMD_SN, r.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, r.exp_stat_sn);
        let data = r.text.bytes(&mut seen);
        let data = &data[..data.len().min(Framing::LOGIN.max_data_segment_len)];
        bhs.set_data_segment_len(data.len());
        let pdu = Pdu {
            bhs,
            ahs: &[],
            data,
        };

        out.clear();
        let step = login.handle(&pdu, &mut policy, &mut out);

        // Exactly one well-formed Login Response.
        let n = pdu::frame_len(&out, &Framing::LOGIN)
            .expect("response fits the login framing")
            .expect("a complete response");
        assert_eq!(n, out.len(), "exactly one PDU appended");
        let resp = pdu::parse_frame(&out, &Framing::LOGIN).expect("response parses");
        let rb = resp.bhs;
        assert_eq!(rb.0[0], Opcode::LoginResponse as u8);
        assert_eq!(rb.0[4], 0, "no AHS");
        assert_eq!(rb.itt(), r.itt, "ITT echoed");
        assert_eq!(rb.0[8..14], bhs.0[8..14], "ISID echoed");
        assert_eq!(rb.0[2], 0);
        assert_eq!(rb.0[3], 0);
        assert_eq!(rb.u32_at(off::STAT_SN), expect_stat_sn, "StatSN sequence");
        expect_stat_sn = expect_stat_sn.wrapping_add(1);
        assert_eq!(rb.u32_at(off::EXP_CMD_SN), r.cmd_sn);
        let answers = match text::parse(resp.data, usize::MAX) {
            Ok(a) => a,
            Err(e) => panic!("response text does not parse: {e:?}"),
        };
        for (k, v) in &answers {
            match k.as_str() {
                "CHAP_A" => seen.algorithm = v.parse().ok().and_then(Algorithm::from_code),
                "CHAP_I" => seen.id = chap::parse_identifier(v),
                "CHAP_C" => seen.challenge = chap::decode_binary(v).ok(),
                _ => {}
            }
            assert!(
                k != "CHAP_R" || chap_required,
                "target answered CHAP_R without CHAP"
            );
        }
        let class = rb.0[36];
        let flags = rb.flags();
        match &step {
            LoginStep::Continue => {
                assert_eq!(class, 0);
                assert_eq!(flags & 0x40, 0, "target never continues its text");
                if flags & 0x80 != 0 {
                    assert!(
                        matches!(flags & 3, 1),
                        "transit only to the operational stage here"
                    );
                    assert!((flags >> 2) & 3 < (flags & 3));
                }
                assert_eq!(
                    rb.u32_at(off::MAX_CMD_SN),
                    r.cmd_sn,
                    "window of one during login"
                );
            }
            LoginStep::Complete(est) => {
                assert_eq!(class, 0);
                assert_eq!(flags & 0x83, 0x83, "T=1 NSG=FullFeature");
                assert_eq!(rb.u16_at(14), est.tsih);
                assert_ne!(est.tsih, 0);
                assert_eq!(est.next_stat_sn, expect_stat_sn);
                assert_eq!(est.exp_cmd_sn, r.cmd_sn);
                assert_eq!(
                    rb.u32_at(off::MAX_CMD_SN),
                    r.cmd_sn.wrapping_add(limits.queue_depth.max(1) - 1)
                );
                let p = &est.params;
                assert!(p.first_burst_length <= p.max_burst_length);
                assert!(p.max_recv_data_segment_length >= 512);
                assert!(p.max_xmit_data_segment_length >= 512);
                assert!(!est.initiator_name.as_str().is_empty());
                // A normal form is its own normal form.
                assert_eq!(
                    NodeName::from_wire(est.initiator_name.as_str()).as_ref(),
                    Ok(&est.initiator_name)
                );
                // The security invariant: with CHAP required, no login completes unless the
                // right response to the target's challenge was sent.
                if chap_required {
                    assert!(
                        seen.answered_right,
                        "login completed without authenticating"
                    );
                }
                if est.session_type == SessionType::Normal {
                    assert_eq!(est.target_name.as_ref().map(NodeName::as_str), Some(TARGET));
                }
                return;
            }
            LoginStep::Failed(status) => {
                assert_ne!(class, 0);
                assert_eq!(class, status.class);
                assert_eq!(rb.0[37], status.detail);
                assert!(answers.is_empty(), "a failure carries no keys");
                assert_eq!(flags & 0xc0, 0, "no T/C bits on failure");
                return;
            }
        }
        assert!(out.len() >= BHS_LEN);
    }
});
