//! A controller's DH-HMAC-CHAP transaction (`nvme::auth::controller::Transaction`) fed
//! arbitrary Authentication Send data and Receives in any order, some of them a real host's
//! messages: it never panics, never authenticates a host that did not answer with the key,
//! and a failed transaction stays failed until a new negotiation.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::auth::controller::{Keys, Policy, Transaction};
use nvme::auth::{host, DhGroup, HashId, Key, Parties};

#[derive(Arbitrary, Debug)]
enum Step {
    /// Authentication Send of these bytes.
    Send(Vec<u8>),
    /// Authentication Send of a real host's negotiate (offering the null group or not).
    Negotiate {
        null_group: bool,
    },
    /// Authentication Send of the wrong-key host's reply to the last challenge.
    Reply,
    Receive,
}

fn parties() -> Parties {
    Parties {
        host_nqn: "nqn.2014-08.org.nvmexpress:uuid:fuzz".into(),
        subsystem_nqn: "nqn.2026-11.org.ferrosan:fuzz".into(),
    }
}

fuzz_target!(|steps: Vec<Step>| {
    let key = |b: u8| Key::new(Some(HashId::Sha256), &[b; 32]).unwrap();
    let keys = Keys {
        host: key(1),
        controller: Some(key(2)),
    };
    // The null group keeps each exponentiation out of the fuzzer's time.
    let policy = Policy {
        hashes: HashId::ALL.to_vec(),
        groups: vec![DhGroup::Null],
    };
    let mut c = Transaction::new(keys, parties(), policy);
    // A host that does not hold the controller's key for the host.
    let mut intruder = host::Transaction::new(key(9), None, parties(), 1);
    let mut counter = 0u8;
    let mut random = |b: &mut [u8]| {
        for x in b.iter_mut() {
            counter = counter.wrapping_add(7);
            *x = counter;
        }
    };
    let mut last = Vec::new();
    for step in steps.into_iter().take(64) {
        match step {
            Step::Send(bytes) => c.send(&bytes),
            Step::Negotiate { null_group } => {
                let groups = if null_group {
                    vec![DhGroup::Null]
                } else {
                    vec![]
                };
                c.send(&intruder.negotiate(&HashId::ALL, &groups));
            }
            Step::Reply => {
                if let Ok(reply) = intruder.reply(&last, &mut random) {
                    c.send(&reply);
                }
            }
            Step::Receive => last = c.receive(&mut random),
        }
        // Only the key authenticates: arbitrary bytes and the intruder's replies never do.
        assert!(!c.authenticated(), "authenticated without the host key");
    }
});
