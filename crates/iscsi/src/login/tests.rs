use super::*;
use crate::chap::{self, Algorithm, Credential};
use crate::pdu::{frame_len, parse_frame};
use seam::name::NodeName;

#[derive(Default)]
struct Policy {
    opened: Vec<SessionKey>,
    deny: Option<LoginStatus>,
    /// The requirement for normal and discovery sessions; `None` = AuthRequirement::None.
    chap: Option<ChapRequirement>,
    /// Random bytes handed out so far (the pattern is i as u8 + seed).
    seed: u8,
}

impl Policy {
    fn chap(req: ChapRequirement) -> Policy {
        Policy {
            chap: Some(req),
            seed: 0x30,
            ..Policy::default()
        }
    }
    fn auth(&self) -> AuthRequirement {
        match &self.chap {
            Some(r) => AuthRequirement::Chap(r.clone()),
            None => AuthRequirement::None,
        }
    }
}

impl LoginPolicy for Policy {
    fn admit(
        &mut self,
        _initiator: &NodeName,
        target: &NodeName,
    ) -> Result<Admission, LoginStatus> {
        if let Some(deny) = self.deny {
            return Err(deny);
        }
        if target.as_str() != "iqn.2026-11.org.ferrosan:t" {
            return Err(LoginStatus::NOT_FOUND);
        }
        Ok(Admission {
            target_alias: Some("alias".into()),
            portal_group_tag: 7,
            auth: self.auth(),
        })
    }
    fn admit_discovery(&mut self, _initiator: &NodeName) -> Result<Admission, LoginStatus> {
        Ok(Admission {
            target_alias: None,
            portal_group_tag: 1,
            auth: self.auth(),
        })
    }
    fn open_session(&mut self, key: &SessionKey, _t: SessionType) -> Result<u16, LoginStatus> {
        self.opened.push(key.clone());
        Ok(0x42)
    }
    fn fill_random(&mut self, buf: &mut [u8]) -> Result<(), LoginStatus> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.seed.wrapping_add(i as u8);
        }
        Ok(())
    }
}

struct Req {
    flags: u8,
    version_min: u8,
    isid: [u8; 6],
    tsih: u16,
    cmd_sn: u32,
    data: Vec<u8>,
    opcode: Opcode,
}

fn req(csg: u8, nsg: Option<u8>, text: &str) -> Req {
    let mut flags = csg << 2;
    if let Some(n) = nsg {
        flags |= 0x80 | n;
    }
    Req {
        flags,
        version_min: 0,
        isid: [0x80, 0, 0, 0, 0, 1],
        tsih: 0,
        cmd_sn: 10,
        data: text.replace(';', "\0").into_bytes(),
        opcode: Opcode::LoginRequest,
    }
}

struct Resp {
    bhs: Bhs,
    keys: Vec<(String, String)>,
}

impl Resp {
    fn status(&self) -> LoginStatus {
        LoginStatus {
            class: self.bhs.byte(off::STATUS_CLASS),
            detail: self.bhs.byte(off::STATUS_DETAIL),
        }
    }
    fn key(&self, k: &str) -> Option<&str> {
        self.keys
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }
}

fn send(login: &mut Login, policy: &mut Policy, r: &Req) -> (LoginStep, Resp) {
    let mut bhs = Bhs::new(r.opcode);
    bhs.set_immediate(true);
    bhs.set_flags(r.flags);
    bhs.set_byte(off::VERSION_MIN, r.version_min);
    bhs.set_isid(r.isid);
    bhs.set_u16(off::TSIH, r.tsih);
    bhs.set_itt(5);
    bhs.set_u32(off::CMD_SN, r.cmd_sn);
    let mut wire = Vec::new();
    pdu::encode_into(&mut wire, &bhs, &r.data, &Framing::LOGIN);
    let pdu = parse_frame(&wire, &Framing::LOGIN).unwrap();
    let mut out = Vec::new();
    let step = login.handle(&pdu, policy, &mut out);
    assert_eq!(frame_len(&out, &Framing::LOGIN).unwrap(), Some(out.len()));
    let resp = parse_frame(&out, &Framing::LOGIN).unwrap();
    assert_eq!(resp.bhs.opcode_raw(), Opcode::LoginResponse as u8);
    assert_eq!(resp.bhs.itt(), 5);
    let keys = text::parse(resp.data, 64).unwrap();
    (
        step,
        Resp {
            bhs: resp.bhs,
            keys,
        },
    )
}

fn login() -> Login {
    Login::new(LoginLimits::default(), TargetLimits::default(), 100)
}

const NORMAL: &str = "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.org.ferrosan:t;SessionType=Normal;AuthMethod=None;";

#[test]
fn two_stage_login_to_full_feature() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, r) = send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    assert_eq!(step, LoginStep::Continue);
    assert!(r.status().is_success());
    assert_eq!(r.bhs.flags(), 0x80 | 0x01); // T, CSG=0, NSG=1
    assert_eq!(r.key("AuthMethod"), Some("None"));
    assert_eq!(r.key("TargetPortalGroupTag"), Some("7"));
    assert_eq!(r.key("TargetAlias"), Some("alias"));
    // No operational key in a security-stage response, even the one moving on to the
    // operational stage: open-iscsi fails the login on one.
    assert_eq!(r.key("MaxRecvDataSegmentLength"), None);
    assert_eq!(r.bhs.u32_at(off::STAT_SN), 100);
    assert_eq!(r.bhs.u32_at(off::EXP_CMD_SN), 10);

    let (step, r) = send(
        &mut l,
        &mut p,
        &req(1, Some(3), "HeaderDigest=None;DataDigest=None;ImmediateData=Yes;InitialR2T=No;MaxRecvDataSegmentLength=65536;MaxBurstLength=262144;FirstBurstLength=65536;"),
    );
    assert_eq!(r.bhs.flags(), 0x80 | (1 << 2) | 3);
    assert_eq!(r.bhs.u16_at(off::TSIH), 0x42);
    assert_eq!(r.bhs.u32_at(off::STAT_SN), 101);
    assert_eq!(
        r.key("MaxRecvDataSegmentLength"),
        Some("262144"),
        "declared in the first operational-stage response"
    );
    assert_eq!(r.key("InitialR2T"), Some("No"));
    assert_eq!(r.bhs.u32_at(off::MAX_CMD_SN), 10 + 127);
    let LoginStep::Complete(est) = step else {
        panic!("expected completion, got {step:?}");
    };
    assert_eq!(est.tsih, 0x42);
    assert_eq!(est.next_stat_sn, 102);
    assert_eq!(est.exp_cmd_sn, 10);
    assert_eq!(est.params.max_xmit_data_segment_length, 65536);
    assert_eq!(est.params.max_recv_data_segment_length, 262_144);
    assert!(!est.params.initial_r2t);
    assert_eq!(
        est.target_name.as_ref().map(NodeName::as_str),
        Some("iqn.2026-11.org.ferrosan:t")
    );
    assert_eq!(p.opened.len(), 1);
    assert_eq!(p.opened[0].isid, [0x80, 0, 0, 0, 0, 1]);
}

#[test]
fn the_session_expects_the_cmd_sn_the_last_login_response_acknowledged() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, _) = send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    assert_eq!(step, LoginStep::Continue);
    // The initiator changes CmdSN in its last Login Request.
    let mut last = req(1, Some(3), "HeaderDigest=None;DataDigest=None;");
    last.cmd_sn = 4000;
    let (step, r) = send(&mut l, &mut p, &last);
    assert_eq!(r.bhs.u32_at(off::EXP_CMD_SN), 4000);
    let LoginStep::Complete(est) = step else {
        panic!("expected completion, got {step:?}");
    };
    assert_eq!(est.exp_cmd_sn, 4000, "as the response said");
}

#[test]
fn straight_to_full_feature_uses_default_recv_length() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, _) = send(&mut l, &mut p, &req(0, Some(3), NORMAL));
    let LoginStep::Complete(est) = step else {
        panic!("expected completion");
    };
    // We never declared our limit, so the initiator assumes 8192.
    assert_eq!(est.params.max_recv_data_segment_length, 8192);
}

#[test]
fn operational_first_is_allowed_without_auth() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(
            1,
            Some(3),
            "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.org.ferrosan:t;",
        ),
    );
    assert!(matches!(step, LoginStep::Complete(_)));
    assert_eq!(r.key("TargetPortalGroupTag"), Some("7"));
    assert_eq!(r.key("MaxRecvDataSegmentLength"), Some("262144"));
}

#[test]
fn discovery_session() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(
            1,
            Some(3),
            "InitiatorName=iqn.2026-11.org.test:i;SessionType=Discovery;MaxBurstLength=262144;",
        ),
    );
    assert_eq!(r.key("MaxBurstLength"), Some("Irrelevant"));
    let LoginStep::Complete(est) = step else {
        panic!("expected completion");
    };
    assert_eq!(est.session_type, SessionType::Discovery);
    assert_eq!(est.target_name, None);
}

fn expect_failure(r: &Req, policy: &mut Policy, status: LoginStatus) {
    let mut l = login();
    let (step, resp) = send(&mut l, policy, r);
    assert_eq!(step, LoginStep::Failed(status));
    assert_eq!(resp.status(), status);
    assert_eq!(resp.bhs.flags() & 0x80, 0, "no transit on failure");
}

#[test]
fn failures_map_to_status_classes() {
    let mut p = Policy::default();
    expect_failure(
        &req(0, Some(1), "TargetName=iqn.2026-11.org.ferrosan:t;"),
        &mut p,
        LoginStatus::MISSING_PARAMETER,
    );
    expect_failure(
        &req(0, Some(1), "InitiatorName=iqn.2026-11.org.test:i;"),
        &mut p,
        LoginStatus::MISSING_PARAMETER,
    );
    expect_failure(
        &req(
            0,
            Some(1),
            "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.org.ferrosan:nope;",
        ),
        &mut p,
        LoginStatus::NOT_FOUND,
    );
    expect_failure(
        &req(
            0,
            Some(1),
            "InitiatorName=iqn.2026-11.org.test:i;SessionType=Weird;",
        ),
        &mut p,
        LoginStatus::SESSION_TYPE_UNSUPPORTED,
    );
    expect_failure(
        &req(0, Some(1), "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.org.ferrosan:t;AuthMethod=CHAP;"),
        &mut p,
        LoginStatus::AUTH_FAILED,
    );
    let mut denied = Policy {
        deny: Some(LoginStatus::FORBIDDEN),
        ..Policy::default()
    };
    expect_failure(
        &req(0, Some(1), NORMAL),
        &mut denied,
        LoginStatus::FORBIDDEN,
    );
    let mut bad_version = req(0, Some(1), NORMAL);
    bad_version.version_min = 1;
    expect_failure(&bad_version, &mut p, LoginStatus::UNSUPPORTED_VERSION);
    let mut both = req(0, Some(1), NORMAL);
    both.flags |= 0x40;
    expect_failure(&both, &mut p, LoginStatus::INITIATOR_ERROR);
    expect_failure(
        &req(2, Some(3), NORMAL),
        &mut p,
        LoginStatus::INITIATOR_ERROR,
    );
    expect_failure(&req(3, None, NORMAL), &mut p, LoginStatus::INITIATOR_ERROR);
    expect_failure(
        &req(1, Some(0), NORMAL),
        &mut p,
        LoginStatus::INITIATOR_ERROR,
    );
    expect_failure(
        &req(0, Some(1), "garbage-without-nul"),
        &mut p,
        LoginStatus::INITIATOR_ERROR,
    );
    let mut not_login = req(0, Some(1), NORMAL);
    not_login.opcode = Opcode::TextRequest;
    expect_failure(&not_login, &mut p, LoginStatus::INVALID_DURING_LOGIN);
    assert!(p.opened.is_empty());
}

#[test]
fn continued_text_is_assembled() {
    let mut l = login();
    let mut p = Policy::default();
    let full = NORMAL.replace(';', "\0").into_bytes();
    let (first, rest) = full.split_at(20);
    let mut r1 = req(0, None, "");
    r1.flags |= 0x40;
    r1.data = first.to_vec();
    let (step, r) = send(&mut l, &mut p, &r1);
    assert_eq!(step, LoginStep::Continue);
    assert!(r.keys.is_empty());
    let mut r2 = req(0, Some(1), "");
    r2.data = rest.to_vec();
    let (step, r) = send(&mut l, &mut p, &r2);
    assert_eq!(step, LoginStep::Continue);
    assert_eq!(r.key("AuthMethod"), Some("None"));
}

#[test]
fn identity_must_not_change_between_requests() {
    let mut l = login();
    let mut p = Policy::default();
    send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    let mut r = req(1, Some(3), "");
    r.isid = [1, 2, 3, 4, 5, 6];
    let (step, resp) = send(&mut l, &mut p, &r);
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    assert_eq!(resp.status(), LoginStatus::INITIATOR_ERROR);
}

#[test]
fn stage_must_match_agreed_stage() {
    let mut l = login();
    let mut p = Policy::default();
    // Stay in security (no T bit), then claim operational: not agreed.
    send(&mut l, &mut p, &req(0, None, NORMAL));
    let (step, _) = send(&mut l, &mut p, &req(1, Some(3), ""));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
}

#[test]
fn repeated_operational_key_fails() {
    let mut l = login();
    let mut p = Policy::default();
    send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    send(&mut l, &mut p, &req(1, None, "InitialR2T=No;"));
    let (step, _) = send(&mut l, &mut p, &req(1, Some(3), "InitialR2T=No;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
}

#[test]
fn names_may_repeat_but_not_change() {
    let mut l = login();
    let mut p = Policy::default();
    send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    let (step, _) = send(
        &mut l,
        &mut p,
        &req(1, Some(3), "InitiatorName=iqn.2026-11.org.test:other;"),
    );
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
}

#[test]
fn too_many_requests_fail() {
    let mut l = Login::new(
        LoginLimits {
            max_requests: 3,
            ..LoginLimits::default()
        },
        TargetLimits::default(),
        1,
    );
    let mut p = Policy::default();
    send(&mut l, &mut p, &req(0, None, NORMAL));
    send(&mut l, &mut p, &req(0, None, ""));
    send(&mut l, &mut p, &req(0, None, ""));
    let (step, _) = send(&mut l, &mut p, &req(0, None, ""));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
}

#[test]
fn oversized_continued_text_fails() {
    let mut l = Login::new(
        LoginLimits {
            max_text_bytes: 64,
            ..LoginLimits::default()
        },
        TargetLimits::default(),
        1,
    );
    let mut p = Policy::default();
    let mut r = req(0, None, "");
    r.flags |= 0x40;
    r.data = vec![b'a'; 60];
    send(&mut l, &mut p, &r);
    let (step, _) = send(&mut l, &mut p, &r);
    assert_eq!(step, LoginStep::Failed(LoginStatus::OUT_OF_RESOURCES));
}

// ---- CHAP (RFC 7143 §12.1.3) ----

const INI: &str = "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.org.ferrosan:t;";
const USER: &str = "alice";
const SECRET: &[u8] = b"alice-secret-123";
const TARGET_USER: &str = "target-t";
const TARGET_SECRET: &[u8] = b"target-secret-456";

fn cred(user: &str, secret: &[u8]) -> Credential {
    Credential {
        user: user.into(),
        secret: chap::Secret::new(secret.to_vec()),
    }
}

fn chap_req(mutual: bool) -> ChapRequirement {
    ChapRequirement {
        users: vec![cred("bob", b"bob-secret-0000"), cred(USER, SECRET)],
        mutual: mutual.then(|| cred(TARGET_USER, TARGET_SECRET)),
        algorithms: Algorithm::ALL.to_vec(),
    }
}

fn hexs(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The response computed independently of `chap.rs`, with the digest crates directly.
fn expected_response(alg: u8, id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    let mut input = vec![id];
    input.extend_from_slice(secret);
    input.extend_from_slice(challenge);
    match alg {
        5 => md5::Md5::digest(&input).to_vec(),
        6 => sha1::Sha1::digest(&input).to_vec(),
        7 => sha2::Sha256::digest(&input).to_vec(),
        8 => sha3::Sha3_256::digest(&input).to_vec(),
        _ => unreachable!(),
    }
}

/// What the target answered to CHAP_A: (algorithm, identifier, challenge bytes).
fn challenge_of(r: &Resp) -> (u8, u8, Vec<u8>) {
    let alg: u8 = r.key("CHAP_A").expect("CHAP_A").parse().unwrap();
    let id: u8 = r.key("CHAP_I").expect("CHAP_I").parse().unwrap();
    let c = r.key("CHAP_C").expect("CHAP_C");
    let c = c.strip_prefix("0x").expect("hex challenge");
    let bytes = (0..c.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&c[i..i + 2], 16).unwrap())
        .collect();
    (alg, id, bytes)
}

/// Runs AuthMethod and CHAP_A; returns the challenge the target sent.
fn chap_until_challenge(l: &mut Login, p: &mut Policy, algs: &str) -> (u8, u8, Vec<u8>) {
    let (step, r) = send(
        l,
        p,
        &req(0, Some(1), &format!("{INI}AuthMethod=CHAP,None;")),
    );
    assert_eq!(step, LoginStep::Continue);
    assert_eq!(r.key("AuthMethod"), Some("CHAP"));
    assert_eq!(r.bhs.flags() & 0x80, 0, "no transit before authentication");
    let (step, r) = send(l, p, &req(0, None, &format!("CHAP_A={algs};")));
    assert_eq!(step, LoginStep::Continue, "{:?}", l.auth_failure());
    assert_eq!(r.bhs.flags() & 0x80, 0);
    let (alg, id, c) = challenge_of(&r);
    assert!(c.len() >= 16 && c.len() <= 1024);
    (alg, id, c)
}

#[test]
fn chap_one_way_succeeds_with_every_algorithm() {
    for code in [5u8, 6, 7, 8] {
        let mut l = login();
        let mut p = Policy::chap(chap_req(false));
        let (alg, id, c) = chap_until_challenge(&mut l, &mut p, &code.to_string());
        assert_eq!(alg, code);
        assert_eq!(id, 0x30, "identifier from the policy's random bytes");
        assert_eq!(c[0], 0x31, "challenge from the policy's random bytes");
        assert_eq!(c.len(), chap::CHALLENGE_BYTES);
        let resp = expected_response(code, id, SECRET, &c);
        let (step, r) = send(
            &mut l,
            &mut p,
            &req(
                0,
                Some(1),
                &format!("CHAP_N={USER};CHAP_R=0x{};", hexs(&resp)),
            ),
        );
        assert_eq!(
            step,
            LoginStep::Continue,
            "alg {code}: {:?}",
            l.auth_failure()
        );
        assert!(r.status().is_success());
        assert_eq!(r.bhs.flags(), 0x80 | 0x01, "transit to operational");
        assert_eq!(r.key("CHAP_N"), None, "no mutual answer unless asked");
        let (step, _) = send(&mut l, &mut p, &req(1, Some(3), ""));
        let LoginStep::Complete(est) = step else {
            panic!("alg {code}: expected completion, got {step:?}");
        };
        assert_eq!(est.chap_user.as_deref(), Some(USER));
    }
}

#[test]
fn chap_picks_the_strongest_common_algorithm() {
    for (offer, want) in [("5,6,7,8", 8), ("5,7", 7), ("6,5", 6), ("99,5,x", 5)] {
        let mut l = login();
        let mut p = Policy::chap(chap_req(false));
        let (alg, _, _) = chap_until_challenge(&mut l, &mut p, offer);
        assert_eq!(alg, want, "offer {offer}");
    }
    // The configured preference restricts and orders.
    let mut req = chap_req(false);
    req.algorithms = vec![Algorithm::Sha1, Algorithm::Md5];
    let mut l = login();
    let mut p = Policy::chap(req);
    let (alg, _, _) = chap_until_challenge(&mut l, &mut p, "5,6,7,8");
    assert_eq!(alg, 6);
}

#[test]
fn chap_mutual_succeeds_with_every_algorithm() {
    for code in [5u8, 6, 7, 8] {
        let mut l = login();
        let mut p = Policy::chap(chap_req(true));
        let (_, id, c) = chap_until_challenge(&mut l, &mut p, &code.to_string());
        let resp = expected_response(code, id, SECRET, &c);
        let my_challenge: Vec<u8> = (0..24).map(|i| 0xa0 ^ i).collect();
        let (step, r) = send(
            &mut l,
            &mut p,
            &req(
                0,
                Some(1),
                &format!(
                    "CHAP_N={USER};CHAP_R=0x{};CHAP_I=77;CHAP_C=0x{};",
                    hexs(&resp),
                    hexs(&my_challenge)
                ),
            ),
        );
        assert_eq!(
            step,
            LoginStep::Continue,
            "alg {code}: {:?}",
            l.auth_failure()
        );
        assert_eq!(r.bhs.flags(), 0x80 | 0x01);
        assert_eq!(r.key("CHAP_N"), Some(TARGET_USER));
        let want = expected_response(code, 77, TARGET_SECRET, &my_challenge);
        assert_eq!(r.key("CHAP_R"), Some(format!("0x{}", hexs(&want)).as_str()));
    }
}

#[test]
fn chap_accepts_base64_and_uppercase_hex() {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut l = login();
    let mut p = Policy::chap(chap_req(true));
    let (alg, id, c) = chap_until_challenge(&mut l, &mut p, "7");
    let resp = expected_response(alg, id, SECRET, &c);
    let mine = [0x55u8; 16];
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(
            0,
            Some(1),
            &format!(
                "CHAP_N={USER};CHAP_R=0b{};CHAP_I=0x10;CHAP_C=0X{};",
                b64.encode(&resp),
                hexs(&mine).to_uppercase()
            ),
        ),
    );
    assert_eq!(step, LoginStep::Continue, "{:?}", l.auth_failure());
    let want = expected_response(alg, 0x10, TARGET_SECRET, &mine);
    assert_eq!(r.key("CHAP_R"), Some(format!("0x{}", hexs(&want)).as_str()));
}

/// Runs a CHAP login up to the response and sends `last`; expects failure with `status`.
fn chap_fails_with(
    req_cfg: ChapRequirement,
    last: impl Fn(u8, u8, &[u8]) -> String,
    status: LoginStatus,
    why: AuthFailure,
) {
    let mut l = login();
    let mut p = Policy::chap(req_cfg);
    let (alg, id, c) = chap_until_challenge(&mut l, &mut p, "5");
    let (step, r) = send(&mut l, &mut p, &req(0, Some(1), &last(alg, id, &c)));
    assert_eq!(step, LoginStep::Failed(status), "{}", last(alg, id, &c));
    assert_eq!(r.status(), status);
    assert_eq!(l.auth_failure(), Some(why));
    assert!(r.keys.is_empty(), "a failure carries no keys");
    assert!(p.opened.is_empty());
}

#[test]
fn chap_wrong_secret_fails() {
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, b"wrong-secret-000", c);
            format!("CHAP_N={USER};CHAP_R=0x{};", hexs(&resp))
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::WrongResponse,
    );
    // Another user's secret does not work for this user either.
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, b"bob-secret-0000", c);
            format!("CHAP_N={USER};CHAP_R=0x{};", hexs(&resp))
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::WrongResponse,
    );
}

#[test]
fn chap_wrong_response_length_fails() {
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!("CHAP_N={USER};CHAP_R=0x{}00;", hexs(&resp))
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::WrongResponse,
    );
}

#[test]
fn chap_unknown_user_fails() {
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!("CHAP_N=mallory;CHAP_R=0x{};", hexs(&resp))
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::UnknownUser,
    );
}

#[test]
fn chap_missing_keys_fail() {
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!("CHAP_R=0x{};", hexs(&resp))
        },
        LoginStatus::MISSING_PARAMETER,
        AuthFailure::Protocol("CHAP_N or CHAP_R missing"),
    );
    chap_fails_with(
        chap_req(false),
        |_, _, _| format!("CHAP_N={USER};"),
        LoginStatus::MISSING_PARAMETER,
        AuthFailure::Protocol("CHAP_N or CHAP_R missing"),
    );
    chap_fails_with(
        chap_req(true),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!("CHAP_N={USER};CHAP_R=0x{};CHAP_I=3;", hexs(&resp))
        },
        LoginStatus::MISSING_PARAMETER,
        AuthFailure::Protocol("CHAP_I without CHAP_C or the reverse"),
    );
    // CHAP_A missing after AuthMethod=CHAP.
    let mut l = login();
    let mut p = Policy::chap(chap_req(false));
    send(
        &mut l,
        &mut p,
        &req(0, None, &format!("{INI}AuthMethod=CHAP;")),
    );
    let (step, _) = send(&mut l, &mut p, &req(0, None, ""));
    assert_eq!(step, LoginStep::Failed(LoginStatus::MISSING_PARAMETER));
}

#[test]
fn chap_malformed_values_fail() {
    for bad in ["0xzz", "zz", "0b***", "0x", ""] {
        chap_fails_with(
            chap_req(false),
            move |_, _, _| format!("CHAP_N={USER};CHAP_R={bad};"),
            LoginStatus::INITIATOR_ERROR,
            AuthFailure::Protocol("CHAP_R is not a binary value"),
        );
    }
    let ok_resp = |alg, id, c: &[u8]| hexs(&expected_response(alg, id, SECRET, c));
    chap_fails_with(
        chap_req(true),
        move |alg, id, c| {
            format!(
                "CHAP_N={USER};CHAP_R=0x{};CHAP_I=300;CHAP_C=0x{};",
                ok_resp(alg, id, c),
                hexs(&[1; 16])
            )
        },
        LoginStatus::INITIATOR_ERROR,
        AuthFailure::Protocol("CHAP_I is not a number in 0..=255"),
    );
    chap_fails_with(
        chap_req(true),
        move |alg, id, c| {
            format!(
                "CHAP_N={USER};CHAP_R=0x{};CHAP_I=1;CHAP_C=0xgg;",
                ok_resp(alg, id, c)
            )
        },
        LoginStatus::INITIATOR_ERROR,
        AuthFailure::Protocol("CHAP_C is not a binary value"),
    );
    // Too short and too long peer challenges.
    for len in [8usize, 1025] {
        chap_fails_with(
            chap_req(true),
            move |alg, id, c| {
                format!(
                    "CHAP_N={USER};CHAP_R=0x{};CHAP_I=1;CHAP_C=0x{};",
                    ok_resp(alg, id, c),
                    hexs(&vec![7; len])
                )
            },
            LoginStatus::INITIATOR_ERROR,
            AuthFailure::Protocol("CHAP_C length out of range"),
        );
    }
}

#[test]
fn chap_reflected_challenge_fails() {
    chap_fails_with(
        chap_req(true),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!(
                "CHAP_N={USER};CHAP_R=0x{};CHAP_I={id};CHAP_C=0x{};",
                hexs(&resp),
                hexs(c)
            )
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::ReflectedChallenge,
    );
}

#[test]
fn chap_mutual_without_target_credentials_fails() {
    chap_fails_with(
        chap_req(false),
        |alg, id, c| {
            let resp = expected_response(alg, id, SECRET, c);
            format!(
                "CHAP_N={USER};CHAP_R=0x{};CHAP_I=9;CHAP_C=0x{};",
                hexs(&resp),
                hexs(&[9; 16])
            )
        },
        LoginStatus::AUTH_FAILED,
        AuthFailure::MutualNotConfigured,
    );
}

#[test]
fn none_only_initiator_against_chap_target_fails() {
    let mut p = Policy::chap(chap_req(false));
    expect_failure(&req(0, Some(1), NORMAL), &mut p, LoginStatus::AUTH_FAILED);
    // Skipping the security stage is not a way around it.
    expect_failure(&req(1, Some(3), INI), &mut p, LoginStatus::AUTH_FAILED);
    // Nor is asking for transit without AuthMethod.
    expect_failure(&req(0, Some(1), INI), &mut p, LoginStatus::AUTH_FAILED);
    // Discovery sessions follow their own requirement (here CHAP too).
    expect_failure(
        &req(
            0,
            Some(1),
            "InitiatorName=iqn.2026-11.org.test:i;SessionType=Discovery;AuthMethod=None;",
        ),
        &mut p,
        LoginStatus::AUTH_FAILED,
    );
    assert!(p.opened.is_empty());
}

#[test]
fn chap_offered_but_not_required_picks_none() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(0, Some(1), &format!("{INI}AuthMethod=CHAP,None;")),
    );
    assert_eq!(step, LoginStep::Continue);
    assert_eq!(r.key("AuthMethod"), Some("None"));
    assert_eq!(r.bhs.flags(), 0x80 | 0x01);
    // CHAP keys after AuthMethod=None are out of order.
    let mut l = login();
    send(
        &mut l,
        &mut p,
        &req(0, None, &format!("{INI}AuthMethod=None;")),
    );
    let (step, _) = send(&mut l, &mut p, &req(0, None, "CHAP_A=5;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
}

#[test]
fn chap_keys_out_of_order_fail() {
    // CHAP_A together with the AuthMethod offer.
    let mut p = Policy::chap(chap_req(false));
    expect_failure(
        &req(0, None, &format!("{INI}AuthMethod=CHAP;CHAP_A=5;")),
        &mut p,
        LoginStatus::INITIATOR_ERROR,
    );
    // CHAP_N before the challenge.
    let mut l = login();
    send(
        &mut l,
        &mut p,
        &req(0, None, &format!("{INI}AuthMethod=CHAP;")),
    );
    let (step, _) = send(&mut l, &mut p, &req(0, None, "CHAP_A=5;CHAP_N=alice;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    // CHAP_A twice.
    let mut l = login();
    chap_until_challenge(&mut l, &mut p, "5");
    let (step, _) = send(&mut l, &mut p, &req(0, None, "CHAP_A=5;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    // AuthMethod renegotiated.
    let mut l = login();
    send(
        &mut l,
        &mut p,
        &req(0, None, &format!("{INI}AuthMethod=CHAP;")),
    );
    let (step, _) = send(&mut l, &mut p, &req(0, None, "AuthMethod=CHAP;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    // CHAP keys again after success, and CHAP keys in the operational stage.
    for (stage, nsg) in [(0u8, None), (1, Some(3))] {
        let mut l = login();
        let (alg, id, c) = chap_until_challenge(&mut l, &mut p, "5");
        let resp = expected_response(alg, id, SECRET, &c);
        let (step, _) = send(
            &mut l,
            &mut p,
            &req(
                0,
                (stage == 1).then_some(1),
                &format!("CHAP_N={USER};CHAP_R=0x{};", hexs(&resp)),
            ),
        );
        assert_eq!(step, LoginStep::Continue);
        let (step, _) = send(&mut l, &mut p, &req(stage, nsg, "CHAP_N=alice;"));
        assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    }
    // No common algorithm.
    let mut l = login();
    send(
        &mut l,
        &mut p,
        &req(0, None, &format!("{INI}AuthMethod=CHAP;")),
    );
    let (step, _) = send(&mut l, &mut p, &req(0, None, "CHAP_A=4,99;"));
    assert_eq!(step, LoginStep::Failed(LoginStatus::AUTH_FAILED));
    assert_eq!(l.auth_failure(), Some(AuthFailure::NoCommonAlgorithm));
}

#[test]
fn chap_challenges_come_from_the_policy() {
    // Two logins with different random bytes get different challenges and identifiers.
    let mut l1 = login();
    let mut p1 = Policy::chap(chap_req(false));
    let (_, id1, c1) = chap_until_challenge(&mut l1, &mut p1, "5");
    let mut l2 = login();
    let mut p2 = Policy::chap(chap_req(false));
    p2.seed = 0x99;
    let (_, id2, c2) = chap_until_challenge(&mut l2, &mut p2, "5");
    assert_ne!(id1, id2);
    assert_ne!(c1, c2);
}

#[test]
fn chap_success_in_discovery() {
    let mut l = login();
    let mut p = Policy::chap(chap_req(false));
    send(
        &mut l,
        &mut p,
        &req(
            0,
            None,
            "InitiatorName=iqn.2026-11.org.test:i;SessionType=Discovery;AuthMethod=CHAP,None;",
        ),
    );
    let (step, r) = send(&mut l, &mut p, &req(0, None, "CHAP_A=5;"));
    assert_eq!(step, LoginStep::Continue);
    let (alg, id, c) = challenge_of(&r);
    let resp = expected_response(alg, id, SECRET, &c);
    let (step, _) = send(
        &mut l,
        &mut p,
        &req(
            0,
            Some(3),
            &format!("CHAP_N={USER};CHAP_R=0x{};", hexs(&resp)),
        ),
    );
    let LoginStep::Complete(est) = step else {
        panic!("expected completion, got {step:?}");
    };
    assert_eq!(est.session_type, SessionType::Discovery);
    assert_eq!(est.chap_user.as_deref(), Some(USER));
}

#[test]
fn names_are_normalised_where_they_enter() {
    let mut l = login();
    let mut p = Policy::default();
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(
            0,
            Some(3),
            "InitiatorName=IQN.2026-11.Org.Test:É;TargetName=iqn.2026-11.ORG.ferrosan:T;AuthMethod=None;",
        ),
    );
    assert!(r.status().is_success());
    let LoginStep::Complete(est) = step else {
        panic!("expected completion, got {step:?}");
    };
    assert_eq!(est.initiator_name.as_str(), "iqn.2026-11.org.test:é");
    assert_eq!(
        est.target_name.as_ref().map(NodeName::as_str),
        Some("iqn.2026-11.org.ferrosan:t")
    );
    assert_eq!(p.opened[0].initiator_name, est.initiator_name);
}

#[test]
fn a_repeated_name_in_another_spelling_is_the_same_name() {
    let mut l = login();
    let mut p = Policy::default();
    send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    let (step, r) = send(
        &mut l,
        &mut p,
        &req(1, Some(3), "InitiatorName=IQN.2026-11.org.TEST:i;"),
    );
    assert!(r.status().is_success(), "{:?}", r.status());
    assert!(matches!(step, LoginStep::Complete(_)));
}

#[test]
fn malformed_names_are_refused_and_remembered_for_the_log() {
    let mut p = Policy::default();
    // A space is prohibited by RFC 3722: initiator error, with the reason kept for the log.
    let mut l = login();
    let (step, _) = send(
        &mut l,
        &mut p,
        &req(
            0,
            Some(1),
            "InitiatorName=iqn.2026-11.org.test:a b;TargetName=iqn.2026-11.org.ferrosan:t;",
        ),
    );
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    assert_eq!(l.auth_failure(), Some(AuthFailure::MalformedName));
    // A malformed TargetName names no target.
    expect_failure(
        &req(
            0,
            Some(1),
            "InitiatorName=iqn.2026-11.org.test:i;TargetName=iqn.2026-11.x:\u{e000};",
        ),
        &mut p,
        LoginStatus::NOT_FOUND,
    );
    // A refused admission still knows both names (the engine logs them).
    let mut l = login();
    p.deny = Some(LoginStatus::FORBIDDEN);
    send(&mut l, &mut p, &req(0, Some(1), NORMAL));
    assert_eq!(
        l.initiator_name().map(NodeName::as_str),
        Some("iqn.2026-11.org.test:i")
    );
    assert_eq!(
        l.target_name().map(NodeName::as_str),
        Some("iqn.2026-11.org.ferrosan:t")
    );
}

#[test]
fn a_refused_login_keeps_its_names_and_takes_no_second_request() {
    let mut l = login();
    let mut denied = Policy {
        deny: Some(LoginStatus::FORBIDDEN),
        ..Policy::default()
    };
    let (step, r) = send(&mut l, &mut denied, &req(0, Some(1), NORMAL));
    assert_eq!(step, LoginStep::Failed(LoginStatus::FORBIDDEN));
    assert_eq!(r.status(), LoginStatus::FORBIDDEN);
    let names = (l.initiator_name().cloned(), l.target_name().cloned());
    let name = |s: &str| Some(NodeName::from_wire(s).unwrap());
    assert_eq!(
        names,
        (
            name("iqn.2026-11.org.test:i"),
            name("iqn.2026-11.org.ferrosan:t")
        )
    );
    // The policy would admit it now: the login stays refused, never admitted a second time.
    let mut open = Policy::default();
    let (step, _) = send(&mut l, &mut open, &req(0, Some(1), NORMAL));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    assert!(open.opened.is_empty());
}

#[test]
fn a_discovery_login_may_repeat_its_names_and_a_complete_login_takes_no_more() {
    let mut l = login();
    let mut p = Policy::default();
    let discovery = "InitiatorName=iqn.2026-11.org.test:i;SessionType=Discovery;AuthMethod=None;";
    let (step, _) = send(&mut l, &mut p, &req(0, Some(1), discovery));
    assert_eq!(step, LoginStep::Continue);
    // The operational stage without a new name, then full feature.
    let (step, _) = send(
        &mut l,
        &mut p,
        &req(1, Some(3), "InitiatorName=iqn.2026-11.org.test:i;"),
    );
    assert!(matches!(step, LoginStep::Complete(_)), "{step:?}");
    let (step, r) = send(&mut l, &mut p, &req(1, Some(3), ""));
    assert_eq!(step, LoginStep::Failed(LoginStatus::INITIATOR_ERROR));
    assert_eq!(r.status(), LoginStatus::INITIATOR_ERROR);
    assert_eq!(l.initiator_name(), None, "the session holds the names now");
}
