//! DH-HMAC-CHAP secrets in their standard text form, `DHHC-1:HH:BASE64:` (NVMe base 2.0,
//! 8.13.5.8): HH names the hash that transforms the key for use (00 none, 01 SHA-256, 02
//! SHA-384, 03 SHA-512), BASE64 holds the 32, 48 or 64 key bytes followed by their CRC-32
//! (little-endian). `nvme gen-dhchap-key` writes them; nvme-cli and Linux read them.

use std::fmt;

use super::HashId;

/// A DH-HMAC-CHAP secret. Never printed; overwritten when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    /// The hash that transforms the key (HH), if any.
    transform: Option<HashId>,
    bytes: Vec<u8>,
}

/// Why a text is not a DH-HMAC-CHAP secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// It does not start `DHHC-1:HH:`.
    NotDhhc1,
    /// HH is not 00..03.
    Transform,
    Base64,
    /// The key is not 32, 48 or 64 bytes.
    Length,
    /// The CRC-32 does not match: a mistyped or truncated secret.
    Crc,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyError::NotDhhc1 => "not a DH-HMAC-CHAP secret: it must read DHHC-1:HH:BASE64: (see `nvme gen-dhchap-key`)",
            KeyError::Transform => "the DHHC-1 hash field must be 00, 01, 02 or 03",
            KeyError::Base64 => "the DHHC-1 key is not valid base64",
            KeyError::Length => "the DHHC-1 key must hold 32, 48 or 64 bytes",
            KeyError::Crc => "the DHHC-1 key's CRC-32 does not match: mistyped or truncated",
        })
    }
}

impl std::error::Error for KeyError {}

const PREFIX: &str = "DHHC-1:";

impl Key {
    /// Whether `text` is meant as a DH-HMAC-CHAP secret (valid or not).
    pub fn looks_like(text: &str) -> bool {
        text.trim().starts_with(PREFIX)
    }

    pub fn parse(text: &str) -> Result<Key, KeyError> {
        let rest = text.trim().strip_prefix(PREFIX).ok_or(KeyError::NotDhhc1)?;
        let (hh, rest) = rest.split_once(':').ok_or(KeyError::NotDhhc1)?;
        let transform = match hh {
            "00" => None,
            "01" | "02" | "03" => Some(
                hh[1..]
                    .parse::<u8>()
                    .ok()
                    .and_then(HashId::from_id)
                    .ok_or(KeyError::Transform)?,
            ),
            _ => return Err(KeyError::Transform),
        };
        let bytes = crate::keytext::decode(rest, &[32, 48, 64]).map_err(|e| match e {
            crate::keytext::Bad::Base64 => KeyError::Base64,
            crate::keytext::Bad::Length => KeyError::Length,
            crate::keytext::Bad::Crc => KeyError::Crc,
        })?;
        Ok(Key { transform, bytes })
    }

    /// A key from its bytes (32, 48 or 64), as `nvme gen-dhchap-key` makes one.
    pub fn new(transform: Option<HashId>, bytes: &[u8]) -> Result<Key, KeyError> {
        if ![32, 48, 64].contains(&bytes.len()) {
            return Err(KeyError::Length);
        }
        Ok(Key {
            transform,
            bytes: bytes.to_vec(),
        })
    }

    /// The standard text form (a secret: for files, never for logs).
    pub fn encode(&self) -> String {
        format!(
            "{PREFIX}{:02}:{}:",
            self.transform.map_or(0, HashId::id),
            crate::keytext::encode(&self.bytes)
        )
    }

    /// The key as used with `nqn` (the host's NQN for a host key, the subsystem's for a
    /// controller key): HMAC(key, NQN || "NVMe-over-Fabrics") with its transform hash, or the
    /// key itself.
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.bytes.clone(),
            Some(h) => h.hmac(&self.bytes, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Key(DHHC-1:{:02}:<redacted>)",
            self.transform.map_or(0, HashId::id)
        )
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.bytes.fill(0);
    }
}
