use num_bigint::BigUint;

use super::controller::{Keys, Policy, Transaction as Controller};
use super::host::Transaction as Host;
use super::msg::{id, Message};
use super::*;

const HOST_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:test";
const SUB_NQN: &str = "nqn.2026-11.org.ferrosan:demo";
/// `nvme gen-dhchap-key -s 000102..1f -m 0` and `-m 1 -n HOST_NQN` (nvme-cli 2.3).
const CLI_KEY_00: &str = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
const CLI_KEY_01: &str = "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:";

fn parties() -> Parties {
    Parties {
        host_nqn: HOST_NQN.into(),
        subsystem_nqn: SUB_NQN.into(),
    }
}

/// A deterministic random source (xorshift64), different per call.
fn counter() -> impl FnMut(&mut [u8]) {
    let mut n = 0x9E37_79B9_7F4A_7C15u64;
    move |buf: &mut [u8]| {
        for b in buf.iter_mut() {
            n ^= n << 13;
            n ^= n >> 7;
            n ^= n << 17;
            *b = n as u8;
        }
    }
}

fn key(byte: u8, transform: Option<HashId>) -> Key {
    Key::new(transform, &[byte; 32]).unwrap()
}

#[test]
fn nvme_cli_keys_parse_and_encode_back() {
    let k = Key::parse(CLI_KEY_00).unwrap();
    assert_eq!(k.transformed("ignored"), (0u8..32).collect::<Vec<_>>());
    assert_eq!(k.encode(), CLI_KEY_00);
    let k1 = Key::parse(CLI_KEY_01).unwrap();
    assert_eq!(k1.encode(), CLI_KEY_01);
    // nvme-cli's -m 1 output is HMAC-SHA-256(secret, NQN || "NVMe-over-Fabrics"): the same
    // transformation the protocol applies to a 01 key, so the two must agree.
    let secret = Key::new(Some(HashId::Sha256), &(0u8..32).collect::<Vec<_>>()).unwrap();
    assert_eq!(
        Key::new(None, &secret.transformed(HOST_NQN))
            .unwrap()
            .encode()[10..],
        CLI_KEY_01[10..]
    );
    assert!(format!("{k:?}").contains("redacted"));
}

#[test]
fn malformed_keys_are_refused_with_the_reason() {
    use key::KeyError::*;
    assert_eq!(Key::parse("secret"), Err(NotDhhc1));
    assert_eq!(Key::parse("DHHC-1:04:AAAA:"), Err(Transform));
    assert_eq!(Key::parse("DHHC-1:00:!!!!:"), Err(Base64));
    assert_eq!(Key::parse("DHHC-1:00:AAECAwQF:"), Err(Length));
    let mut typo = CLI_KEY_00.to_string();
    typo.replace_range(12..13, "B");
    assert_eq!(Key::parse(&typo), Err(Crc));
    // The trailing colon may be left out, surrounding whitespace (a file's newline) is ignored.
    assert!(Key::parse(&format!("{}\n", CLI_KEY_00.trim_end_matches(':'))).is_ok());
}

/// The host's response for fixed inputs, computed independently (Python's hmac module) from
/// the specification's formula: HMAC(Kh', C1 || S1 || T_ID || 00h || "HostHost" || NQNh ||
/// 00h || NQNc), Kh' the 01 key transformed with the host NQN.
#[test]
fn host_response_matches_a_reference_computation() {
    let k = Key::parse(CLI_KEY_01).unwrap();
    let r = host_response(HashId::Sha256, &k, &parties(), &[0xA5; 32], 0x0102_0304, 7);
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "24a60a4f57d269aebba43aa4da1da9ba38a3a5edd396b45fc0e65a52fd1018eb"
    );
}

#[test]
fn the_rfc_7919_primes_have_their_published_shape() {
    for g in &DhGroup::ALL[1..] {
        let p = g.prime().unwrap();
        let bits = g.bytes() as u64 * 8;
        assert_eq!(p.bits(), bits, "{g:?}");
        let ones = (BigUint::from(1u8) << 64u32) - 1u8;
        assert_eq!(p & &ones, ones, "{g:?} low bits");
        assert_eq!(p >> (bits - 64), ones, "{g:?} high bits");
    }
    // p is a safe prime with 2 generating the subgroup of order q = (p-1)/2.
    let p = DhGroup::Ffdhe2048.prime().unwrap();
    let q = (p - 1u8) >> 1u32;
    assert_eq!(BigUint::from(2u8).modpow(&q, p), BigUint::from(1u8));
}

#[test]
fn both_sides_of_an_exchange_reach_one_secret() {
    let mut random = counter();
    let a = dh::Exchange::new(DhGroup::Ffdhe2048, &mut random).unwrap();
    let b = dh::Exchange::new(DhGroup::Ffdhe2048, &mut random).unwrap();
    let (pa, pb) = (a.public(), b.public());
    assert_eq!(pa.len(), 256);
    assert_ne!(pa, pb);
    assert_eq!(a.shared(&pb).unwrap(), b.shared(&pa).unwrap());
    // Values that force a known secret are refused.
    let p = DhGroup::Ffdhe2048.prime().unwrap();
    let pad = |n: BigUint| {
        let b = n.to_bytes_be();
        let mut v = vec![0u8; 256 - b.len()];
        v.extend(b);
        v
    };
    for bad in [BigUint::from(1u8), p - 1u8, p.clone(), BigUint::default()] {
        assert_eq!(a.shared(&pad(bad)), Err(Reason::DhGroupUnusable));
    }
    assert_eq!(a.shared(&pb[1..]), Err(Reason::IncorrectPayload));
    assert!(dh::Exchange::new(DhGroup::Null, &mut random).is_none());
}

struct Run {
    controller: Controller,
    outcome: Result<(), Reason>,
}

/// One whole transaction between a host and a controller; the host offers `groups`.
fn run(host: Host, keys: Keys, policy: Policy, groups: &[DhGroup]) -> Run {
    let mut host = host;
    let mut random = counter();
    let mut c = Controller::new(keys, parties(), policy);
    c.send(&host.negotiate(&HashId::ALL, groups));
    let challenge = c.receive(&mut random);
    let reply = match host.reply(&challenge, &mut random) {
        Ok(r) => r,
        Err(e) => {
            return Run {
                controller: c,
                outcome: Err(e),
            }
        }
    };
    c.send(&reply);
    let s1 = c.receive(&mut random);
    let outcome = match host.success1(&s1) {
        Ok(Some(s2)) => {
            c.send(&s2);
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => {
            c.send(&host.failure2(e));
            Err(e)
        }
    };
    Run {
        controller: c,
        outcome,
    }
}

fn host(host_key: Key, ctrl_key: Option<Key>) -> Host {
    Host::new(host_key, ctrl_key, parties(), 9)
}

#[test]
fn a_host_with_the_right_key_authenticates_with_every_hash_and_group() {
    for hash in HashId::ALL {
        for group in [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
            let policy = Policy {
                hashes: vec![hash],
                groups: vec![group],
            };
            let k = key(1, Some(hash));
            let keys = Keys {
                host: k.clone(),
                controller: None,
            };
            let r = run(host(k, None), keys, policy, &DhGroup::ALL);
            assert_eq!(r.outcome, Ok(()), "{hash:?} {group:?}");
            assert!(r.controller.authenticated(), "{hash:?} {group:?}");
            assert_eq!(r.controller.failed(), None);
        }
    }
}

#[test]
fn a_wrong_host_key_fails_the_queue() {
    let keys = Keys {
        host: key(1, None),
        controller: None,
    };
    let r = run(
        host(key(2, None), None),
        keys,
        Policy::default(),
        &DhGroup::ALL,
    );
    assert_eq!(r.outcome, Err(Reason::Failed));
    assert!(!r.controller.authenticated());
    assert_eq!(r.controller.failed(), Some(Reason::Failed));
}

#[test]
fn bidirectional_authentication_proves_the_controller_too() {
    let keys = |ctrl: Option<Key>| Keys {
        host: key(1, None),
        controller: ctrl,
    };
    let ok = run(
        host(key(1, None), Some(key(3, Some(HashId::Sha384)))),
        keys(Some(key(3, Some(HashId::Sha384)))),
        Policy::default(),
        &[DhGroup::Ffdhe2048],
    );
    assert_eq!(ok.outcome, Ok(()));
    assert!(ok.controller.authenticated());
    // A controller holding another controller key is refused by the host ...
    let wrong = run(
        host(key(1, None), Some(key(3, None))),
        keys(Some(key(4, None))),
        Policy::default(),
        &[DhGroup::Null],
    );
    assert_eq!(wrong.outcome, Err(Reason::Failed));
    assert!(!wrong.controller.authenticated());
    // ... and one without any fails the host's request instead of skipping it.
    let none = run(
        host(key(1, None), Some(key(3, None))),
        keys(None),
        Policy::default(),
        &[DhGroup::Null],
    );
    assert_eq!(none.outcome, Err(Reason::Failed));
    assert_eq!(none.controller.failed(), Some(Reason::Failed));
}

fn controller() -> Controller {
    Controller::new(
        Keys {
            host: key(1, None),
            controller: None,
        },
        parties(),
        Policy::default(),
    )
}

fn failure_of(bytes: &[u8]) -> Reason {
    match Message::decode(bytes).unwrap() {
        Message::Failure1 { reason, .. } => reason,
        other => panic!("expected a Failure1, got {other:?}"),
    }
}

#[test]
fn negotiation_refuses_what_it_cannot_use() {
    let mut random = counter();
    let h = host(key(1, None), None);
    // No common hash, no common group, a secure channel asked for.
    let mut c = controller();
    c.send(&h.negotiate(&[], &DhGroup::ALL));
    assert_eq!(failure_of(&c.receive(&mut random)), Reason::HashUnusable);
    assert_eq!(c.failed(), Some(Reason::HashUnusable));
    let mut c = controller();
    c.send(&h.negotiate(&HashId::ALL, &[]));
    assert_eq!(failure_of(&c.receive(&mut random)), Reason::DhGroupUnusable);
    let mut c = controller();
    let mut n = h.negotiate(&HashId::ALL, &DhGroup::ALL);
    n[6] = 1;
    c.send(&n);
    assert_eq!(failure_of(&c.receive(&mut random)), Reason::ConcatMismatch);
}

#[test]
fn messages_out_of_order_fail_the_transaction() {
    let mut random = counter();
    // A Receive before anything was negotiated.
    let mut c = controller();
    assert_eq!(
        failure_of(&c.receive(&mut random)),
        Reason::IncorrectMessage
    );
    assert!(c.failed().is_some());
    // A Success2 where a reply is due.
    let mut c = controller();
    let mut h = host(key(1, None), None);
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
    let challenge = c.receive(&mut random);
    c.send(&Message::Success2 { t_id: 9 }.encode());
    assert_eq!(
        failure_of(&c.receive(&mut random)),
        Reason::IncorrectMessage
    );
    // A reply of another transaction.
    let mut c = controller();
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
    let _ = c.receive(&mut random);
    let mut reply = h.reply(&challenge, &mut random).unwrap();
    reply[4] ^= 1;
    c.send(&reply);
    assert_eq!(
        failure_of(&c.receive(&mut random)),
        Reason::IncorrectPayload
    );
    assert!(!c.authenticated());
}

#[test]
fn truncated_and_oversized_messages_are_refused_not_trusted() {
    let mut random = counter();
    let mut h = host(key(1, None), None);
    let mut c = controller();
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Ffdhe2048]));
    let challenge = c.receive(&mut random);
    let reply = h.reply(&challenge, &mut random).unwrap();
    for cut in [0, 7, 15, 16, reply.len() - 1] {
        let mut c = controller();
        c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Ffdhe2048]));
        let _ = c.receive(&mut random);
        c.send(&reply[..cut]);
        assert!(matches!(
            failure_of(&c.receive(&mut random)),
            Reason::IncorrectPayload | Reason::IncorrectMessage
        ));
    }
    // Lengths that claim more than the message holds.
    let mut long = reply.clone();
    long[6] = 0xFF;
    assert_eq!(Message::decode(&long), Err(Reason::IncorrectPayload));
    let mut negotiate = h.negotiate(&HashId::ALL, &DhGroup::ALL);
    negotiate[10] = 31;
    assert_eq!(Message::decode(&negotiate), Err(Reason::IncorrectPayload));
    negotiate[7] = 200;
    assert_eq!(Message::decode(&negotiate), Err(Reason::IncorrectPayload));
}

#[test]
fn every_message_decodes_to_what_was_encoded() {
    let messages = [
        Message::Success2 { t_id: 3 },
        Message::Failure1 {
            t_id: 3,
            reason: Reason::Failed,
        },
        Message::Failure2 {
            t_id: 4,
            reason: Reason::HashUnusable,
        },
        Message::Success1(msg::Success1 {
            t_id: 5,
            hl: 32,
            rval: Some(vec![7; 32]),
        }),
        Message::Reply(msg::Reply {
            t_id: 6,
            rval: vec![1; 48],
            cval: Some(vec![2; 48]),
            seqnum: 77,
            dhv: vec![3; 256],
        }),
    ];
    for m in messages {
        assert_eq!(Message::decode(&m.encode()), Ok(m));
    }
    assert_eq!(id::FAILURE1, 0xF1);
}

#[test]
fn a_new_negotiate_restarts_and_a_failed_reauthentication_revokes() {
    let keys = Keys {
        host: key(1, None),
        controller: None,
    };
    let r = run(
        host(key(1, None), None),
        keys,
        Policy::default(),
        &[DhGroup::Null],
    );
    assert!(r.controller.authenticated());
    let mut c = r.controller;
    let mut random = counter();
    let mut wrong = host(key(2, None), None);
    c.send(&wrong.negotiate(&HashId::ALL, &[DhGroup::Null]));
    let challenge = c.receive(&mut random);
    c.send(&wrong.reply(&challenge, &mut random).unwrap());
    assert_eq!(failure_of(&c.receive(&mut random)), Reason::Failed);
    assert!(!c.authenticated());
}

#[test]
fn a_host_that_never_answers_gets_one_restart_and_each_is_counted() {
    let mut random = counter();
    let h = host(key(2, None), None);
    let mut c = controller();
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
    assert!(matches!(
        Message::decode(&c.receive(&mut random)),
        Ok(Message::Challenge(_))
    ));
    assert_eq!(c.take_abandoned(), 0);
    // The first restart is allowed, and counted when it happens.
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
    assert_eq!(c.take_abandoned(), 1);
    assert_eq!(c.take_abandoned(), 0, "taken once");
    assert!(matches!(
        Message::decode(&c.receive(&mut random)),
        Ok(Message::Challenge(_))
    ));
    // The second is refused: no third challenge, and the queue fails.
    c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
    assert_eq!(c.take_abandoned(), 1);
    assert_eq!(
        failure_of(&c.receive(&mut random)),
        Reason::IncorrectMessage
    );
    assert!(c.failed().is_some() && !c.authenticated());
}

#[test]
fn re_authentication_after_a_finished_transaction_is_not_a_restart() {
    let keys = Keys {
        host: key(1, None),
        controller: None,
    };
    let r = run(
        host(key(1, None), None),
        keys,
        Policy::default(),
        &[DhGroup::Null],
    );
    let mut c = r.controller;
    let mut random = counter();
    for _ in 0..3 {
        let mut h = host(key(1, None), None);
        c.send(&h.negotiate(&HashId::ALL, &[DhGroup::Null]));
        let challenge = c.receive(&mut random);
        c.send(&h.reply(&challenge, &mut random).unwrap());
        let _ = c.receive(&mut random);
        assert!(c.authenticated() && c.failed().is_none());
    }
    assert_eq!(c.take_abandoned(), 0);
}
