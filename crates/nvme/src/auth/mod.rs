//! NVMe in-band authentication: DH-HMAC-CHAP (NVMe base specification 2.0, section 8.13),
//! carried by the Fabrics Authentication Send and Receive commands.
//!
//! Each queue authenticates on its own after its Connect: the host negotiates a hash and a
//! Diffie-Hellman group, the controller challenges, the host answers with an HMAC over the
//! challenge keyed by its secret (and may challenge the controller back), the controller
//! confirms. With a DH group the challenges are first bound to a fresh shared secret, so an
//! eavesdropper learns nothing to guess the secret from offline.
//!
//! Sans I/O like the rest of the crate: the caller supplies the random bytes (challenges,
//! sequence numbers, DH exponents) and moves the messages; [`controller::Transaction`] is the
//! controller's side, [`host::Transaction`] the host's (the initiator crate and the tests).

pub mod controller;
pub mod dh;
mod ffdhe;
pub mod host;
pub mod key;
pub mod msg;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256, Sha384, Sha512};

pub use dh::DhGroup;
pub use key::{Key, KeyError};

/// The security protocol of Authentication Send/Receive that carries DH-HMAC-CHAP (SECP), and
/// its two protocol-specific bytes (SPSP0, SPSP1).
pub const SECP_DHCHAP: u8 = 0xE9;
pub const SPSP: u8 = 0x01;

/// A random source: fills the buffer (the engine's is the OS's).
pub type Random<'a> = &'a mut dyn FnMut(&mut [u8]);

/// A hash function of DH-HMAC-CHAP, numbered as on the wire (HashID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashId {
    Sha256 = 1,
    Sha384 = 2,
    Sha512 = 3,
}

impl HashId {
    pub const ALL: [HashId; 3] = [HashId::Sha256, HashId::Sha384, HashId::Sha512];

    pub fn from_id(id: u8) -> Option<HashId> {
        HashId::ALL.into_iter().find(|h| h.id() == id)
    }

    pub fn id(self) -> u8 {
        self as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "sha256",
            HashId::Sha384 => "sha384",
            HashId::Sha512 => "sha512",
        }
    }

    pub fn from_name(name: &str) -> Option<HashId> {
        HashId::ALL.into_iter().find(|h| h.name() == name)
    }

    /// The digest length: also the length of every challenge and response (HL).
    pub fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }

    /// HMAC with `key` over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<M: Mac + hmac::digest::KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
            // An HMAC takes a key of any length (longer ones are hashed first).
            let mut mac = <M as hmac::digest::KeyInit>::new_from_slice(key)
                .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
            for p in parts {
                mac.update(p);
            }
            mac.finalize().into_bytes().to_vec()
        }
        match self {
            HashId::Sha256 => run::<Hmac<Sha256>>(key, parts),
            HashId::Sha384 => run::<Hmac<Sha384>>(key, parts),
            HashId::Sha512 => run::<Hmac<Sha512>>(key, parts),
        }
    }

    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            HashId::Sha256 => Sha256::digest(data).to_vec(),
            HashId::Sha384 => Sha384::digest(data).to_vec(),
            HashId::Sha512 => Sha512::digest(data).to_vec(),
        }
    }
}

/// Why a transaction failed, as the failure messages explain it (reason code explanation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The response did not verify (a wrong secret), or no key to answer with.
    Failed = 0x01,
    NotUsable = 0x02,
    /// Secure channel concatenation asked for: not offered.
    ConcatMismatch = 0x03,
    HashUnusable = 0x04,
    DhGroupUnusable = 0x05,
    IncorrectPayload = 0x06,
    IncorrectMessage = 0x07,
}

impl Reason {
    pub fn from_code(code: u8) -> Reason {
        match code {
            0x02 => Reason::NotUsable,
            0x03 => Reason::ConcatMismatch,
            0x04 => Reason::HashUnusable,
            0x05 => Reason::DhGroupUnusable,
            0x06 => Reason::IncorrectPayload,
            0x07 => Reason::IncorrectMessage,
            _ => Reason::Failed,
        }
    }

    /// For log lines and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Failed => "failed",
            Reason::NotUsable => "not_usable",
            Reason::ConcatMismatch => "secure_channel_not_offered",
            Reason::HashUnusable => "hash_unusable",
            Reason::DhGroupUnusable => "dh_group_unusable",
            Reason::IncorrectPayload => "incorrect_payload",
            Reason::IncorrectMessage => "incorrect_message",
        }
    }
}

/// What both sides hash: who is who, and the keys.
#[derive(Clone, Debug)]
pub struct Parties {
    pub host_nqn: String,
    pub subsystem_nqn: String,
}

/// The challenge as it is hashed: with a DH group, bound to the session key (HMAC keyed by
/// H(Ks) over the challenge); without, as sent.
fn augmented(hash: HashId, session_key: Option<&[u8]>, challenge: &[u8]) -> Vec<u8> {
    match session_key {
        Some(ks) => hash.hmac(&hash.digest(ks), &[challenge]),
        None => challenge.to_vec(),
    }
}

/// A response: HMAC keyed by the answering side's transformed key over the (augmented)
/// challenge, the sequence number, the transaction, and the two NQNs in the answering side's
/// order ("HostHost" host first for the host's response, "Controller" subsystem first for
/// the controller's).
#[allow(clippy::too_many_arguments)]
fn response(
    hash: HashId,
    key: &[u8],
    challenge: &[u8],
    seqnum: u32,
    t_id: u16,
    who: &[u8],
    first_nqn: &str,
    second_nqn: &str,
) -> Vec<u8> {
    hash.hmac(
        key,
        &[
            challenge,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[0],
            who,
            first_nqn.as_bytes(),
            &[0],
            second_nqn.as_bytes(),
        ],
    )
}

/// The host's response to challenge `c1` (already augmented).
fn host_response(
    hash: HashId,
    host_key: &Key,
    parties: &Parties,
    c1: &[u8],
    s1: u32,
    t_id: u16,
) -> Vec<u8> {
    let key = host_key.transformed(&parties.host_nqn);
    response(
        hash,
        &key,
        c1,
        s1,
        t_id,
        b"HostHost",
        &parties.host_nqn,
        &parties.subsystem_nqn,
    )
}

/// The controller's response to challenge `c2` (already augmented).
fn controller_response(
    hash: HashId,
    ctrl_key: &Key,
    parties: &Parties,
    c2: &[u8],
    s2: u32,
    t_id: u16,
) -> Vec<u8> {
    let key = ctrl_key.transformed(&parties.subsystem_nqn);
    response(
        hash,
        &key,
        c2,
        s2,
        t_id,
        b"Controller",
        &parties.subsystem_nqn,
        &parties.host_nqn,
    )
}

/// A nonzero sequence number (0 means "no bidirectional authentication").
fn seqnum(random: Random<'_>) -> u32 {
    let mut b = [0u8; 4];
    random(&mut b);
    u32::from_le_bytes(b).max(1)
}

#[cfg(test)]
mod tests;
