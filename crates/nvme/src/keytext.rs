//! The text form NVMe's secrets share (`DHHC-1:HH:BASE64:`, `NVMeTLSkey-1:HH:BASE64:`):
//! BASE64 holds the key bytes followed by their CRC-32 (IEEE, little-endian), which catches a
//! mistyped or truncated key.

use base64::Engine as _;

/// Why a BASE64 field is not a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bad {
    Base64,
    Length,
    Crc,
}

/// The key bytes of `b64` (the trailing ':' of the form allowed: nvme-cli reads it either
/// way), if they are one of `lens` long and their CRC-32 matches. Rejected bytes are zeroed.
pub(crate) fn decode(b64: &str, lens: &[usize]) -> Result<Vec<u8>, Bad> {
    let b64 = b64.strip_suffix(':').unwrap_or(b64);
    let mut raw = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|_| Bad::Base64)?;
    if !lens.iter().any(|&l| raw.len() == l + 4) {
        raw.fill(0);
        return Err(Bad::Length);
    }
    let split = raw.len() - 4;
    let crc = u32::from_le_bytes([raw[split], raw[split + 1], raw[split + 2], raw[split + 3]]);
    if crc32fast::hash(&raw[..split]) != crc {
        raw.fill(0);
        return Err(Bad::Crc);
    }
    raw.truncate(split);
    Ok(raw)
}

/// BASE64 of `key` and its CRC-32 (a secret: for files, never for logs).
pub(crate) fn encode(key: &[u8]) -> String {
    let mut raw = key.to_vec();
    raw.extend_from_slice(&crc32fast::hash(key).to_le_bytes());
    let text = base64::engine::general_purpose::STANDARD.encode(&raw);
    raw.fill(0);
    text
}
