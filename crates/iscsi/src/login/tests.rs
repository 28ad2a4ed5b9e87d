use super::*;
use crate::pdu::{frame_len, parse_frame};

#[derive(Default)]
struct Policy {
    opened: Vec<SessionKey>,
    deny: Option<LoginStatus>,
}

impl LoginPolicy for Policy {
    fn admit(&mut self, _initiator: &str, target: &str) -> Result<Admission, LoginStatus> {
        if let Some(deny) = self.deny {
            return Err(deny);
        }
        if target != "iqn.2026-11.org.ferrosan:t" {
            return Err(LoginStatus::NOT_FOUND);
        }
        Ok(Admission {
            target_alias: Some("alias".into()),
            portal_group_tag: 7,
            auth: AuthRequirement::None,
        })
    }
    fn admit_discovery(&mut self, _initiator: &str) -> Result<Admission, LoginStatus> {
        Ok(Admission {
            target_alias: None,
            portal_group_tag: 1,
            auth: AuthRequirement::None,
        })
    }
    fn open_session(&mut self, key: &SessionKey, _t: SessionType) -> Result<u16, LoginStatus> {
        self.opened.push(key.clone());
        Ok(0x42)
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
            class: self.bhs.0[36],
            detail: self.bhs.0[37],
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
    bhs.0[3] = r.version_min;
    bhs.0[8..14].copy_from_slice(&r.isid);
    bhs.set_u16(14, r.tsih);
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
    assert_eq!(r.key("MaxRecvDataSegmentLength"), Some("262144"));
    assert_eq!(r.bhs.u32_at(off::STAT_SN), 100);
    assert_eq!(r.bhs.u32_at(off::EXP_CMD_SN), 10);

    let (step, r) = send(
        &mut l,
        &mut p,
        &req(1, Some(3), "HeaderDigest=None;DataDigest=None;ImmediateData=Yes;InitialR2T=No;MaxRecvDataSegmentLength=65536;MaxBurstLength=262144;FirstBurstLength=65536;"),
    );
    assert_eq!(r.bhs.flags(), 0x80 | (1 << 2) | 3);
    assert_eq!(r.bhs.u16_at(14), 0x42);
    assert_eq!(r.bhs.u32_at(off::STAT_SN), 101);
    assert_eq!(
        r.key("MaxRecvDataSegmentLength"),
        None,
        "declared once, in the first response"
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
        est.target_name.as_deref(),
        Some("iqn.2026-11.org.ferrosan:t")
    );
    assert_eq!(p.opened.len(), 1);
    assert_eq!(p.opened[0].isid, [0x80, 0, 0, 0, 0, 1]);
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
