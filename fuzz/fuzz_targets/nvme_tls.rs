//! NVMe/TCP TLS's inputs: a PSK identity as a host offers it in its ClientHello (bytes of the
//! network), and a configured key's text (a key file). Neither parse panics; an identity
//! that parses names two NQNs and a cipher, and re-reads to itself; a TLS PSK is derived only
//! for an identity of the key's own cipher, and is the key's length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvme::tls::{ConfiguredKey, Derivation, Identity};

fuzz_target!(|input: (&[u8], &str)| {
    let (identity, key_text) = input;
    let key =
        ConfiguredKey::parse("NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:")
            .expect("a valid key");
    if let Ok(id) = Identity::parse(identity) {
        assert!(id.host.starts_with("nqn.") && id.subsystem.starts_with("nqn."));
        let text = std::str::from_utf8(identity).expect("an identity is text");
        assert_eq!(Identity::parse(text.as_bytes()), Ok(id.clone()));
        for how in [Derivation::Spec, Derivation::Libnvme115] {
            match key.tls_psk(&id, how) {
                Some(psk) => {
                    assert_eq!(id.cipher, key.cipher());
                    assert_eq!(psk.len(), 32);
                }
                None => assert!(id.cipher != key.cipher() || identity.len() > 255),
            }
        }
    }
    if let Ok(k) = ConfiguredKey::parse(key_text) {
        assert!(key_text.trim().starts_with("NVMeTLSkey-1:"));
        let _ = k.cipher();
    }
});
