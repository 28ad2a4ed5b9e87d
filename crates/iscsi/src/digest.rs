//! CRC32C digests (RFC 7143 §13.1), hardware-accelerated by the `crc32c` crate.

pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Digest over a data segment plus its zero padding to a 4-byte boundary, without copying.
pub fn crc32c_padded(data: &[u8]) -> u32 {
    let pad = crate::pdu::padded(data.len()) - data.len();
    let crc = crc32c::crc32c(data);
    crc32c::crc32c_append(crc, &[0u8; 3][..pad])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        // 32 bytes of 0xff.
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc), 0x46dd_794e);
    }

    #[test]
    fn padding_equals_explicit_zeros() {
        assert_eq!(crc32c_padded(b"abc"), crc32c(b"abc\0"));
        assert_eq!(crc32c_padded(b"abcd"), crc32c(b"abcd"));
        assert_eq!(crc32c_padded(b"a"), crc32c(b"a\0\0\0"));
    }
}
