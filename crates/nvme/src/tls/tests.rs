//! The vectors were computed with OpenSSL's own HKDF (`openssl kdf ... HKDF`), the info laid
//! out by hand per derivation: an implementation other than the one under test.

use super::*;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";
const SUB: &str = "nqn.2026-11.org.example:store1";
/// 32 bytes 00..1f, SHA-256 transform (as `nvme gen-tls-key` writes one).
const KEY_01: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
/// 48 bytes 00..2f, SHA-384 transform.
const KEY_02: &str =
    "NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:";
/// 32 bytes 00..1f, no transform.
const KEY_00: &str = "NVMeTLSkey-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn identity(hh: u8) -> Identity {
    Identity::parse(format!("NVMe0R{hh:02} {HOST} {SUB}").as_bytes()).unwrap()
}

#[test]
fn the_spec_derivation_matches_an_independent_hkdf() {
    let k = ConfiguredKey::parse(KEY_01).unwrap();
    assert_eq!(k.cipher(), CipherHash::Sha256);
    assert_eq!(
        k.tls_psk(&identity(1), Derivation::Spec).unwrap(),
        hex("4ae2e499f85ba7a46cf3b2efe903db722f61eaebb20e6b86a48e44834639dfb4")
    );
    let k = ConfiguredKey::parse(KEY_02).unwrap();
    assert_eq!(k.cipher(), CipherHash::Sha384);
    assert_eq!(
        k.tls_psk(&identity(2), Derivation::Spec).unwrap(),
        hex("f5e5b35ffb5a7aab1dabaaef6e346d1bdb5d8ecd648827b7ea98a3f39e1c07e13e20bc88f3b5ef8567bac3b105007d07")
    );
    // No transform: the configured PSK is the retained one.
    let k = ConfiguredKey::parse(KEY_00).unwrap();
    assert_eq!(
        k.tls_psk(&identity(1), Derivation::Spec).unwrap(),
        hex("1bb515aeb34aa31c3d43e3d18397eabe799a50d24b58e0cfff22a0b1e6cf954f")
    );
}

#[test]
fn the_libnvme_1_15_derivation_matches_an_independent_hkdf() {
    let k = ConfiguredKey::parse(KEY_01).unwrap();
    assert_eq!(
        k.tls_psk(&identity(1), Derivation::Libnvme115).unwrap(),
        hex("e915d323b264795ffe41e58d353b4cda52811592c93996898147b4759d2e828f")
    );
    let k = ConfiguredKey::parse(KEY_02).unwrap();
    assert_eq!(
        k.tls_psk(&identity(2), Derivation::Libnvme115).unwrap(),
        hex("86098c1a981313ff8d0bfeb1bfe994c0dcaa9d9fa5b0871490b143b803b97ccbdb8c2f442911860a09c36e589b6ef9e2")
    );
}

#[test]
fn keys_made_from_bytes_read_as_nvme_cli_writes_them() {
    let bytes: Vec<u8> = (0..32).collect();
    let k = ConfiguredKey::new(Some(CipherHash::Sha256), &bytes).unwrap();
    assert_eq!(k.encode(), KEY_01);
    assert_eq!(ConfiguredKey::parse(KEY_01).unwrap(), k);
    let k = ConfiguredKey::new(None, &bytes).unwrap();
    assert_eq!(k.encode(), KEY_00);
    assert_eq!(
        ConfiguredKey::new(Some(CipherHash::Sha384), &bytes),
        Err(KeyError::Length)
    );
}

#[test]
fn an_identity_asking_for_the_other_hash_gets_no_key() {
    let k = ConfiguredKey::parse(KEY_01).unwrap();
    assert_eq!(k.tls_psk(&identity(2), Derivation::Spec), None);
}

#[test]
fn keys_in_the_wrong_form_are_refused() {
    assert_eq!(
        ConfiguredKey::parse("DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"),
        Err(KeyError::NotInterchange)
    );
    assert_eq!(
        ConfiguredKey::parse("NVMeTLSkey-1:03:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"),
        Err(KeyError::Hash)
    );
    // A 32-byte key with the SHA-384 transform.
    assert_eq!(
        ConfiguredKey::parse("NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"),
        Err(KeyError::Length)
    );
    // One character changed: the CRC catches it.
    assert_eq!(
        ConfiguredKey::parse("NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:"),
        Err(KeyError::Crc)
    );
    assert_eq!(
        ConfiguredKey::parse("NVMeTLSkey-1:01:!!:"),
        Err(KeyError::Base64)
    );
    // Never printed.
    let k = ConfiguredKey::parse(KEY_01).unwrap();
    assert!(!format!("{k:?}").contains("AAEC"));
}

#[test]
fn identities_parse_and_odd_ones_are_refused() {
    let id = identity(1);
    assert_eq!((id.host.as_str(), id.subsystem.as_str()), (HOST, SUB));
    assert_eq!(id.cipher, CipherHash::Sha256);
    let bad = |s: String| Identity::parse(s.as_bytes());
    assert_eq!(
        bad(format!("NVMe0G01 {HOST} {SUB}")),
        Err(IdentityError::Unsupported)
    );
    assert_eq!(
        bad(format!("NVMe1R01 {HOST} {SUB} ZGlnZXN0")),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        bad(format!("NVMe0R03 {HOST} {SUB}")),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        bad(format!("NVMe0R01 {HOST}")),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        bad(format!("NVMe0R01 {HOST} iqn.2026-11.x:y")),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        Identity::parse(&[b'N'; IDENTITY_MAX + 1]),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        Identity::parse(b"NVMe0R01 \xff \xfe"),
        Err(IdentityError::Malformed)
    );
    // A multi-byte character across the prefix's fields (a fuzzer's find: it panicked).
    assert_eq!(
        Identity::parse(b"NVMeT\xd3\xa9k  \xfe:"),
        Err(IdentityError::Malformed)
    );
    assert_eq!(
        Identity::parse("NVMe0Ré nqn.a nqn.b".as_bytes()),
        Err(IdentityError::Malformed)
    );
}
