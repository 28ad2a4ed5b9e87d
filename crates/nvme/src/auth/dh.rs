//! The Diffie-Hellman groups of DH-HMAC-CHAP: none, or RFC 7919's FFDHE groups.
//!
//! Each transaction draws a fresh 512-bit exponent (at least twice every group's security
//! strength, NIST SP 800-56A): it is used for one exchange, so a timing difference of the
//! modular exponentiation tells an observer nothing it could accumulate.

use std::sync::OnceLock;

use num_bigint::BigUint;

use super::{ffdhe, Random, Reason};

/// The exponent's length in bytes.
const EXPONENT_BYTES: usize = 64;

/// A DH group, numbered as on the wire (DHgID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DhGroup {
    Null = 0,
    Ffdhe2048 = 1,
    Ffdhe3072 = 2,
    Ffdhe4096 = 3,
    Ffdhe6144 = 4,
    Ffdhe8192 = 5,
}

impl DhGroup {
    pub const ALL: [DhGroup; 6] = [
        DhGroup::Null,
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ];

    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.id() == id)
    }

    pub fn id(self) -> u8 {
        self as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    pub fn from_name(name: &str) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.name() == name)
    }

    /// The length of a public value and of the shared secret, in bytes (0: no DH).
    pub fn bytes(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    /// The group's prime; `None` for the null group.
    pub fn prime(self) -> Option<&'static BigUint> {
        static PRIMES: [OnceLock<BigUint>; 5] = [
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
        ];
        let (i, hex) = match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => (0, ffdhe::FFDHE2048),
            DhGroup::Ffdhe3072 => (1, ffdhe::FFDHE3072),
            DhGroup::Ffdhe4096 => (2, ffdhe::FFDHE4096),
            DhGroup::Ffdhe6144 => (3, ffdhe::FFDHE6144),
            DhGroup::Ffdhe8192 => (4, ffdhe::FFDHE8192),
        };
        Some(PRIMES[i].get_or_init(|| {
            BigUint::parse_bytes(hex.as_bytes(), 16)
                .unwrap_or_else(|| unreachable!("the RFC 7919 primes are hexadecimal"))
        }))
    }
}

/// One side's ephemeral exponent in a group.
pub struct Exchange {
    group: DhGroup,
    exponent: BigUint,
}

impl Exchange {
    /// A fresh exponent; `None` for the null group.
    pub fn new(group: DhGroup, random: Random<'_>) -> Option<Exchange> {
        group.prime()?;
        let mut bytes = [0u8; EXPONENT_BYTES];
        random(&mut bytes);
        // Never 0 or 1 whatever the source gave.
        bytes[0] |= 0x80;
        let exponent = BigUint::from_bytes_be(&bytes);
        bytes.fill(0);
        Some(Exchange { group, exponent })
    }

    fn prime(&self) -> &'static BigUint {
        self.group
            .prime()
            .unwrap_or_else(|| unreachable!("an exchange is never in the null group"))
    }

    /// The public value g^x mod p, big-endian, as long as the prime.
    pub fn public(&self) -> Vec<u8> {
        let p = self.prime();
        padded(
            &BigUint::from(2u8).modpow(&self.exponent, p),
            self.group.bytes(),
        )
    }

    /// The shared secret from the peer's public value, as long as the prime. A value outside
    /// 2..=p-2 (RFC 7919 §5.1: it would force a known secret) is refused.
    pub fn shared(&self, peer: &[u8]) -> Result<Vec<u8>, Reason> {
        let p = self.prime();
        if peer.len() != self.group.bytes() {
            return Err(Reason::IncorrectPayload);
        }
        let y = BigUint::from_bytes_be(peer);
        let one = BigUint::from(1u8);
        if y <= one || y >= p - &one {
            return Err(Reason::DhGroupUnusable);
        }
        Ok(padded(&y.modpow(&self.exponent, p), self.group.bytes()))
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.exponent = BigUint::default();
    }
}

/// `n` big-endian in exactly `len` bytes (left-padded with zeros).
fn padded(n: &BigUint, len: usize) -> Vec<u8> {
    let b = n.to_bytes_be();
    let mut out = vec![0u8; len.saturating_sub(b.len())];
    out.extend_from_slice(&b[b.len().saturating_sub(len)..]);
    out
}
