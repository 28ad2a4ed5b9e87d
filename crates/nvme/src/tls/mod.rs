//! NVMe/TCP's TLS pre-shared keys (NVMe TCP transport 1.0, 3.6.1): the configured PSK in its
//! interchange form, the PSK identity a host offers, and the TLS PSK both ends derive from
//! them. The TLS handshake itself is OpenSSL's (the engine's NVMe door); this is the NVMe part,
//! pure and tested.
//!
//! - Interchange form: `NVMeTLSkey-1:HH:BASE64:` as `nvme gen-tls-key` writes it; HH is the
//!   hash that turns the configured PSK into the retained PSK (00 none, 01 SHA-256, 02
//!   SHA-384), BASE64 holds 32 or 48 key bytes and their CRC-32 (little-endian).
//! - Identity (version 0, what Linux 6.12's host offers): `NVMe0R0H <hostnqn> <subnqn>`,
//!   R for a retained (configured) PSK, H the cipher suite's hash (01: TLS_AES_128_GCM_SHA256,
//!   02: TLS_AES_256_GCM_SHA384).
//! - Derivation: retained = HKDF-Expand-Label(HKDF-Extract(0, configured), "HostNQN", hostnqn,
//!   L), TLS PSK = HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", identity, L),
//!   L the key's length. libnvme 1.15 and older (Debian 13, Ubuntu 24.04) build the HKDF info
//!   without the label's and context's length bytes and with the length little-endian; a host
//!   that inserted its key with such an nvme-cli holds that key, so the derivation is a
//!   setting ([`Derivation`]).

use std::fmt;

use hkdf::Hkdf;
use sha2::{Sha256, Sha384};

const PREFIX: &str = "NVMeTLSkey-1:";

/// The hash of a TLS cipher suite NVMe/TCP uses, as the identity's HH names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CipherHash {
    /// TLS_AES_128_GCM_SHA256 (01).
    Sha256,
    /// TLS_AES_256_GCM_SHA384 (02).
    Sha384,
}

impl CipherHash {
    fn from_id(id: &str) -> Option<CipherHash> {
        match id {
            "01" => Some(CipherHash::Sha256),
            "02" => Some(CipherHash::Sha384),
            _ => None,
        }
    }

    pub fn id(self) -> u8 {
        match self {
            CipherHash::Sha256 => 1,
            CipherHash::Sha384 => 2,
        }
    }

    /// The key length that goes with it.
    pub fn key_len(self) -> usize {
        match self {
            CipherHash::Sha256 => 32,
            CipherHash::Sha384 => 48,
        }
    }

    /// The hash's name, for people.
    pub fn name(self) -> &'static str {
        match self {
            CipherHash::Sha256 => "SHA-256",
            CipherHash::Sha384 => "SHA-384",
        }
    }

    /// The TLS 1.3 cipher suite, by OpenSSL's name.
    pub fn suite(self) -> &'static str {
        match self {
            CipherHash::Sha256 => "TLS_AES_128_GCM_SHA256",
            CipherHash::Sha384 => "TLS_AES_256_GCM_SHA384",
        }
    }
}

/// How the HKDF info of the two derivations is laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Derivation {
    /// RFC 8446's HkdfLabel, as the transport specification says (libnvme 1.16 and later).
    #[default]
    Spec,
    /// libnvme 1.15 and older: `len16le || "tls13 " || label || context`.
    Libnvme115,
}

impl Derivation {
    pub fn from_name(name: &str) -> Option<Derivation> {
        match name {
            "spec" => Some(Derivation::Spec),
            "libnvme-1.15" => Some(Derivation::Libnvme115),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Derivation::Spec => "spec",
            Derivation::Libnvme115 => "libnvme-1.15",
        }
    }
}

/// A configured PSK. Never printed; overwritten when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredKey {
    /// The hash that makes the retained PSK (None: the configured PSK is the retained one).
    transform: Option<CipherHash>,
    bytes: Vec<u8>,
}

/// Why a text is not a configured PSK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    NotInterchange,
    Hash,
    Base64,
    Length,
    Crc,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyError::NotInterchange => "not an NVMe TLS PSK: it must read NVMeTLSkey-1:HH:BASE64: (see `nvme gen-tls-key`)",
            KeyError::Hash => "the NVMeTLSkey-1 hash field must be 00, 01 or 02",
            KeyError::Base64 => "the NVMeTLSkey-1 key is not valid base64",
            KeyError::Length => "the NVMeTLSkey-1 key must hold 32 bytes (SHA-256) or 48 (SHA-384), matching its hash field",
            KeyError::Crc => "the NVMeTLSkey-1 key's CRC-32 does not match: mistyped or truncated",
        })
    }
}

impl std::error::Error for KeyError {}

impl ConfiguredKey {
    pub fn parse(text: &str) -> Result<ConfiguredKey, KeyError> {
        let rest = text
            .trim()
            .strip_prefix(PREFIX)
            .ok_or(KeyError::NotInterchange)?;
        let (hh, rest) = rest.split_once(':').ok_or(KeyError::NotInterchange)?;
        let transform = match hh {
            "00" => None,
            _ => Some(CipherHash::from_id(hh).ok_or(KeyError::Hash)?),
        };
        let lens: &[usize] = match transform {
            Some(h) => &[h.key_len()],
            None => &[32, 48],
        };
        let bytes = crate::keytext::decode(rest, lens).map_err(|e| match e {
            crate::keytext::Bad::Base64 => KeyError::Base64,
            crate::keytext::Bad::Length => KeyError::Length,
            crate::keytext::Bad::Crc => KeyError::Crc,
        })?;
        Ok(ConfiguredKey { transform, bytes })
    }

    /// A key from its bytes, as `nvme gen-tls-key` makes one: 32 or 48, the transform's
    /// length if it has one.
    pub fn new(transform: Option<CipherHash>, bytes: &[u8]) -> Result<ConfiguredKey, KeyError> {
        let ok = match transform {
            Some(h) => bytes.len() == h.key_len(),
            None => bytes.len() == 32 || bytes.len() == 48,
        };
        if !ok {
            return Err(KeyError::Length);
        }
        Ok(ConfiguredKey {
            transform,
            bytes: bytes.to_vec(),
        })
    }

    /// The interchange form (a secret: for files, never for logs).
    pub fn encode(&self) -> String {
        format!(
            "{PREFIX}{:02}:{}:",
            self.transform.map_or(0, CipherHash::id),
            crate::keytext::encode(&self.bytes)
        )
    }

    /// The cipher suite's hash this key goes with: its transform's, or by its length.
    pub fn cipher(&self) -> CipherHash {
        self.transform.unwrap_or(if self.bytes.len() == 48 {
            CipherHash::Sha384
        } else {
            CipherHash::Sha256
        })
    }

    /// The TLS PSK for a host offering `identity` with this key, or None when the identity
    /// asks for another cipher suite's hash than the key's.
    pub fn tls_psk(&self, identity: &Identity, how: Derivation) -> Option<Vec<u8>> {
        if identity.cipher != self.cipher() {
            return None;
        }
        let len = self.bytes.len();
        let retained = match self.transform {
            None => self.bytes.clone(),
            Some(h) => expand_label(
                h,
                how,
                &self.bytes,
                b"HostNQN",
                identity.host.as_bytes(),
                len,
            )?,
        };
        let psk = expand_label(
            identity.cipher,
            how,
            &retained,
            b"nvme-tls-psk",
            identity.text.as_bytes(),
            len,
        );
        let mut retained = retained;
        retained.fill(0);
        psk
    }
}

impl fmt::Debug for ConfiguredKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ConfiguredKey({:?}, {} bytes)",
            self.cipher(),
            self.bytes.len()
        )
    }
}

impl Drop for ConfiguredKey {
    fn drop(&mut self) {
        self.bytes.fill(0);
    }
}

/// HKDF-Expand-Label(HKDF-Extract(0, key), label, context, len) with `hash`, the info laid
/// out as `how` says. None for a context longer than RFC 8446's opaque<0..255> (an identity of
/// two long NQNs), which libnvme refuses too.
fn expand_label(
    hash: CipherHash,
    how: Derivation,
    key: &[u8],
    label: &[u8],
    context: &[u8],
    len: usize,
) -> Option<Vec<u8>> {
    if context.len() > 255 {
        return None;
    }
    let mut info = Vec::with_capacity(4 + 6 + label.len() + context.len());
    let full_label = [b"tls13 ".as_slice(), label].concat();
    match how {
        Derivation::Spec => {
            info.extend_from_slice(&(len as u16).to_be_bytes());
            info.push(full_label.len() as u8);
            info.extend_from_slice(&full_label);
            info.push(context.len() as u8);
            info.extend_from_slice(context);
        }
        Derivation::Libnvme115 => {
            info.extend_from_slice(&(len as u16).to_le_bytes());
            info.extend_from_slice(&full_label);
            info.extend_from_slice(context);
        }
    }
    let mut out = vec![0; len];
    // The lengths are 32 or 48: far below HKDF's limit of 255 hash lengths.
    let ok = match hash {
        CipherHash::Sha256 => Hkdf::<Sha256>::new(None, key).expand(&info, &mut out),
        CipherHash::Sha384 => Hkdf::<Sha384>::new(None, key).expand(&info, &mut out),
    };
    debug_assert!(ok.is_ok(), "HKDF output length out of range");
    Some(out)
}

/// A PSK identity a host offered: `NVMe0R0H <hostnqn> <subnqn>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub cipher: CipherHash,
    pub host: String,
    pub subsystem: String,
    /// The whole identity (the TLS PSK's derivation context).
    text: String,
}

/// Why an offered identity is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityError {
    /// Not `NVMe0R0H <hostnqn> <subnqn>`.
    Malformed,
    /// A generated PSK (`G`, from secure channel concatenation) or a version 1 identity:
    /// not offered.
    Unsupported,
}

/// The longest identity taken: two NQNs of 223 bytes and the prefix.
pub const IDENTITY_MAX: usize = 2 * 223 + 10;

impl Identity {
    pub fn parse(bytes: &[u8]) -> Result<Identity, IdentityError> {
        if bytes.len() > IDENTITY_MAX {
            return Err(IdentityError::Malformed);
        }
        let text = std::str::from_utf8(bytes).map_err(|_| IdentityError::Malformed)?;
        let mut words = text.split(' ');
        let head = words.next().ok_or(IdentityError::Malformed)?;
        let (host, subsystem) = (words.next(), words.next());
        let (Some(host), Some(subsystem), None) = (host, subsystem, words.next()) else {
            return Err(IdentityError::Malformed);
        };
        // Compared as bytes: a multi-byte character must not be cut (found by fuzzing).
        let head = head.as_bytes();
        if head.len() != 8 || !head.starts_with(b"NVMe") || !head.is_ascii() {
            return Err(IdentityError::Malformed);
        }
        if &head[4..6] != b"0R" {
            return Err(IdentityError::Unsupported);
        }
        let hh = std::str::from_utf8(&head[6..8]).map_err(|_| IdentityError::Malformed)?;
        let cipher = CipherHash::from_id(hh).ok_or(IdentityError::Malformed)?;
        let nqn_ok =
            |n: &str| n.starts_with("nqn.") && n.len() <= 223 && !n.contains(char::is_control);
        if !nqn_ok(host) || !nqn_ok(subsystem) {
            return Err(IdentityError::Malformed);
        }
        Ok(Identity {
            cipher,
            host: host.to_string(),
            subsystem: subsystem.to_string(),
            text: text.to_string(),
        })
    }
}

#[cfg(test)]
mod tests;
