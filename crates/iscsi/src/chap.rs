//! CHAP (RFC 1994) as iSCSI uses it (RFC 7143 §12.1.3): algorithms, the response function,
//! binary value encodings, and secrets that never print.
//!
//! Pure functions only: the challenge bytes come from the caller (the engine's random source
//! through [`crate::login::LoginPolicy::fill_random`]), so every exchange is reproducible in a test.

use std::fmt;

use base64::Engine as _;
use subtle::ConstantTimeEq as _;

/// The length of the challenges the target sends, in bytes. RFC 7143 §12.1.3 asks for challenges
/// at least as long as the digest would be useful against; 32 bytes covers every algorithm we
/// offer (their outputs are 16 to 32 bytes) and stays far below the 1024-byte limit.
pub const CHALLENGE_BYTES: usize = 32;
/// The shortest challenge accepted from an initiator (mutual CHAP), in bytes.
pub const PEER_CHALLENGE_BYTES_MIN: usize = 16;
/// The longest challenge accepted from an initiator, in bytes (RFC 7143 §12.1.3: 1024).
pub const PEER_CHALLENGE_BYTES_MAX: usize = 1024;
/// The shortest secret we accept, in bytes. RFC 7143 §12.1.3: a secret with less than 96 random
/// bits requires IPsec, which ferrosan does not provide, so 12 bytes is the floor.
pub const SECRET_BYTES_MIN: usize = 12;
/// The longest secret we accept, in bytes (initiators keep them in 256-byte buffers).
pub const SECRET_BYTES_MAX: usize = 255;
/// The longest CHAP user name (CHAP_N), in bytes: an RFC 7143 text value limit.
pub const USER_BYTES_MAX: usize = 255;

/// A CHAP hash algorithm, numbered as in the IANA "PPP Authentication Algorithms" registry
/// that RFC 7143 §12.1.3 (and its successor drafts) refer to; Linux (LIO and open-iscsi) uses
/// the same numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    Md5 = 5,
    Sha1 = 6,
    Sha256 = 7,
    Sha3_256 = 8,
}

impl Algorithm {
    /// Every algorithm, strongest first: the target's default preference.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::Sha3_256,
        Algorithm::Sha256,
        Algorithm::Sha1,
        Algorithm::Md5,
    ];

    pub fn from_code(code: u32) -> Option<Algorithm> {
        match code {
            5 => Some(Algorithm::Md5),
            6 => Some(Algorithm::Sha1),
            7 => Some(Algorithm::Sha256),
            8 => Some(Algorithm::Sha3_256),
            _ => None,
        }
    }

    /// The name used in config files: `md5`, `sha1`, `sha256`, `sha3-256`.
    pub fn from_name(name: &str) -> Option<Algorithm> {
        match name.to_ascii_lowercase().as_str() {
            "md5" => Some(Algorithm::Md5),
            "sha1" => Some(Algorithm::Sha1),
            "sha256" | "sha-256" => Some(Algorithm::Sha256),
            "sha3-256" | "sha3_256" => Some(Algorithm::Sha3_256),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Md5 => "md5",
            Algorithm::Sha1 => "sha1",
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha3_256 => "sha3-256",
        }
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// The response length, in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Algorithm::Md5 => 16,
            Algorithm::Sha1 => 20,
            Algorithm::Sha256 | Algorithm::Sha3_256 => 32,
        }
    }

    /// RFC 1994 §4.1: H(identifier || secret || challenge).
    pub fn response(self, id: u8, secret: &Secret, challenge: &[u8]) -> Vec<u8> {
        fn h<D: md5::Digest>(id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
            let mut d = D::new();
            d.update([id]);
            d.update(secret);
            d.update(challenge);
            d.finalize().to_vec()
        }
        let s = secret.expose();
        let out = match self {
            Algorithm::Md5 => h::<md5::Md5>(id, s, challenge),
            Algorithm::Sha1 => h::<sha1::Sha1>(id, s, challenge),
            Algorithm::Sha256 => h::<sha2::Sha256>(id, s, challenge),
            Algorithm::Sha3_256 => h::<sha3::Sha3_256>(id, s, challenge),
        };
        debug_assert_eq!(out.len(), self.digest_len());
        out
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.code())
    }
}

/// A CHAP secret. Its `Debug` and `Display` print `<redacted>`; the bytes are reachable only
/// through [`Secret::expose`], and are overwritten with zeros when dropped (best effort).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Constant-time equality (for checks between configured secrets).
    pub fn ct_eq(&self, other: &Secret) -> bool {
        self.0.len() == other.0.len() && bool::from(self.0.ct_eq(&other.0))
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            *b = 0;
        }
        std::hint::black_box(&self.0);
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A CHAP name and its secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    pub user: String,
    pub secret: Secret,
}

/// Why a binary value could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Neither `0x`/`0X` (hex) nor `0b`/`0B` (base64) prefix.
    NoPrefix,
    BadHex,
    BadBase64,
    Empty,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DecodeError::NoPrefix => "binary value without 0x or 0b prefix",
            DecodeError::BadHex => "malformed hexadecimal value",
            DecodeError::BadBase64 => "malformed base64 value",
            DecodeError::Empty => "empty binary value",
        })
    }
}

/// Decodes an RFC 7143 §6.1 binary value: `0x` + hex digits (an odd count has an implied
/// leading zero) or `0b` + base64 (RFC 4648, padded).
pub fn decode_binary(value: &str) -> Result<Vec<u8>, DecodeError> {
    // `get`, not `split_at`: byte 2 may fall inside a multi-byte character of hostile input.
    let bytes = if let Some(rest) = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
    {
        decode_hex(rest)?
    } else if let Some(rest) = value
        .strip_prefix("0b")
        .or_else(|| value.strip_prefix("0B"))
    {
        base64::engine::general_purpose::STANDARD
            .decode(rest)
            .map_err(|_| DecodeError::BadBase64)?
    } else {
        return Err(DecodeError::NoPrefix);
    };
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    Ok(bytes)
}

fn decode_hex(digits: &str) -> Result<Vec<u8>, DecodeError> {
    fn nibble(c: u8) -> Result<u8, DecodeError> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(DecodeError::BadHex),
        }
    }
    let raw = digits.as_bytes();
    let mut out = Vec::with_capacity(raw.len().div_ceil(2));
    let (head, tail) = raw.split_at(raw.len() % 2);
    if let [c] = head {
        out.push(nibble(*c)?);
    }
    for pair in tail.chunks_exact(2) {
        out.push(nibble(pair[0])? << 4 | nibble(pair[1])?);
    }
    Ok(out)
}

/// `0x` + lowercase hex: how the target writes binary values.
pub fn encode_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// A numerical value (RFC 7143 §6.1: decimal, or `0x` hex) of at most 255: CHAP_I.
pub fn parse_identifier(value: &str) -> Option<u8> {
    let n = if let Some(hex) = value.strip_prefix("0x").or(value.strip_prefix("0X")) {
        if hex.is_empty() || hex.len() > 8 {
            return None;
        }
        u32::from_str_radix(hex, 16).ok()?
    } else {
        if value.is_empty() || value.len() > 10 || !value.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        value.parse::<u32>().ok()?
    };
    u8::try_from(n).ok()
}

/// Constant-time comparison of a received response with the expected one.
pub fn responses_match(expected: &[u8], received: &[u8]) -> bool {
    expected.len() == received.len() && bool::from(expected.ct_eq(received))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_matches_rfc1994_construction() {
        // Independent computation: MD5 over the concatenation.
        use md5::Digest as _;
        let secret = Secret::new(b"twelve-bytes".to_vec());
        let challenge = [7u8; 16];
        let mut m = md5::Md5::new();
        m.update([9u8]);
        m.update(b"twelve-bytes");
        m.update(challenge);
        assert_eq!(
            Algorithm::Md5.response(9, &secret, &challenge),
            m.finalize().to_vec()
        );
    }

    #[test]
    fn known_vectors() {
        // H(0x01 || "secret-secret" || 0x00..0x0f), computed independently with Python's hashlib.
        let secret = Secret::new(b"secret-secret".to_vec());
        let challenge: Vec<u8> = (0u8..16).collect();
        let want = [
            (Algorithm::Md5, "0x41cdd4a71fbf6e597cb74760765d3f8a"),
            (
                Algorithm::Sha1,
                "0x7fe93362cb97cd38a3d784d278ffe28022363d08",
            ),
            (
                Algorithm::Sha256,
                "0x8702a8c0aaf9cca9efa685f9c14d9d1c3a408bb412cdfbea3aa28127cf0e60fc",
            ),
            (
                Algorithm::Sha3_256,
                "0x510e04a14bcea37da7d70eb6d15aed3a6da6bf3dd1600e4c361db71a50477f6b",
            ),
        ];
        for (alg, hex) in want {
            assert_eq!(
                encode_hex(&alg.response(1, &secret, &challenge)),
                hex,
                "{alg}"
            );
        }
    }

    #[test]
    fn codes_and_names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::from_code(a.code().into()), Some(a));
            assert_eq!(Algorithm::from_name(a.name()), Some(a));
        }
        assert_eq!(Algorithm::Sha256.code(), 7);
        assert_eq!(Algorithm::Sha3_256.code(), 8);
        assert_eq!(Algorithm::from_code(4), None);
        assert_eq!(Algorithm::from_code(9), None);
    }

    #[test]
    fn binary_values_decode() {
        assert_eq!(decode_binary("0x0aFf"), Ok(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0xabc"), Ok(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAAEC"), Ok(vec![0, 1, 2]));
        assert_eq!(decode_binary("0bAAE="), Ok(vec![0, 1]));
        assert_eq!(decode_binary("0x"), Err(DecodeError::Empty));
        assert_eq!(decode_binary("0xzz"), Err(DecodeError::BadHex));
        assert_eq!(decode_binary("0b!!!!"), Err(DecodeError::BadBase64));
        assert_eq!(decode_binary("0bAAE"), Err(DecodeError::BadBase64));
        assert_eq!(decode_binary("abcd"), Err(DecodeError::NoPrefix));
        assert_eq!(decode_binary(""), Err(DecodeError::NoPrefix));
        assert_eq!(decode_binary("é"), Err(DecodeError::NoPrefix));
        assert_eq!(encode_hex(&[0, 0xab]), "0x00ab");
    }

    #[test]
    fn identifiers_parse() {
        assert_eq!(parse_identifier("0"), Some(0));
        assert_eq!(parse_identifier("255"), Some(255));
        assert_eq!(parse_identifier("0xff"), Some(255));
        assert_eq!(parse_identifier("256"), None);
        assert_eq!(parse_identifier("-1"), None);
        assert_eq!(parse_identifier(""), None);
        assert_eq!(parse_identifier("0x"), None);
        assert_eq!(parse_identifier("+1"), None);
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new(b"very-secret-value".to_vec());
        assert!(!format!("{s:?}").contains("very"));
        assert!(!format!("{s}").contains("very"));
        let c = Credential {
            user: "u".into(),
            secret: s,
        };
        assert!(!format!("{c:?}").contains("very"));
    }

    #[test]
    fn response_comparison() {
        assert!(responses_match(&[1, 2, 3], &[1, 2, 3]));
        assert!(!responses_match(&[1, 2, 3], &[1, 2, 4]));
        assert!(!responses_match(&[1, 2, 3], &[1, 2]));
    }
}

#[cfg(test)]
mod hostile_input_tests {
    use super::*;

    #[test]
    fn prefix_split_inside_a_multibyte_character_is_an_error_not_a_panic() {
        // Found by the `login` fuzz target: "0" followed by U+07FB (bytes df bb).
        assert_eq!(decode_binary("0\u{7fb}"), Err(DecodeError::NoPrefix));
        assert_eq!(decode_binary("\u{7fb}"), Err(DecodeError::NoPrefix));
        assert!(decode_binary("0x\u{7fb}").is_err());
        assert_eq!(decode_binary(""), Err(DecodeError::NoPrefix));
    }
}
