use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use openssl::ssl::{
    ClientHelloResponse, Ssl, SslContextBuilder, SslMethod, SslVerifyMode, SslVersion,
};

use super::*;

const IDENTITY: &[u8] = b"NVMe0R02 nqn.2014-08.org.nvmexpress:uuid:h nqn.2026-01.test:s";

fn offered(identity: &[u8], binders: &[usize]) -> Vec<u8> {
    let mut ids = Vec::new();
    ids.extend_from_slice(&(identity.len() as u16).to_be_bytes());
    ids.extend_from_slice(identity);
    ids.extend_from_slice(&0u32.to_be_bytes());
    let mut bs = Vec::new();
    for &b in binders {
        bs.push(b as u8);
        bs.extend(std::iter::repeat_n(0xab, b));
    }
    let mut body = (ids.len() as u16).to_be_bytes().to_vec();
    body.extend(ids);
    body.extend_from_slice(&(bs.len() as u16).to_be_bytes());
    body.extend(bs);
    body
}

#[test]
fn the_first_binder_says_the_hash() {
    assert_eq!(first_binder_len(&offered(IDENTITY, &[48])), Some(48));
    assert_eq!(first_binder_len(&offered(IDENTITY, &[32, 48])), Some(32));
    let hash = |len| first_binder_len(&offered(IDENTITY, &[len])).and_then(PskHash::from_len);
    assert_eq!(hash(32), Some(PskHash::Sha256));
    assert_eq!(hash(48), Some(PskHash::Sha384));
    assert_eq!(hash(64), None);
}

#[test]
fn a_cut_or_empty_extension_names_no_binder() {
    let whole = offered(IDENTITY, &[48]);
    for cut in 0..whole.len() {
        assert_eq!(first_binder_len(&whole[..cut]), None, "cut at {cut}");
    }
    // Binders' length shorter than the entry it holds.
    let mut lying = whole.clone();
    let at = 2 + usize::from(u16::from_be_bytes([whole[0], whole[1]]));
    lying[at..at + 2].copy_from_slice(&10u16.to_be_bytes());
    assert_eq!(first_binder_len(&lying), None);
    assert_eq!(first_binder_len(&[0xff, 0xff]), None);
}

/// What the server's callbacks saw.
#[derive(Default)]
struct Seen {
    offered: Option<PskHash>,
    identity: Option<Vec<u8>>,
}

fn key(len: usize) -> Vec<u8> {
    (0..len as u8).collect()
}

const ALL: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

/// A server that binds the key with the hash the client's binder names (as NVMe/TCP's door
/// does), or with `fixed` when given.
fn server(fixed: Option<PskHash>, seen: &Arc<Mutex<Seen>>) -> openssl::ssl::SslContext {
    let mut b = SslContextBuilder::new(SslMethod::tls_server()).unwrap();
    b.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
    b.set_ciphersuites(ALL).unwrap();
    let s = Arc::clone(seen);
    b.set_client_hello_callback(move |ssl, _alert| {
        let hash = offered_hash(ssl);
        s.lock().unwrap().offered = hash;
        if let Some(hash) = fixed.or(hash) {
            ssl.set_ciphersuites(hash.suites())?;
        }
        Ok(ClientHelloResponse::SUCCESS)
    });
    let s = Arc::clone(seen);
    set_server_find(&mut b, move |identity| {
        let mut s = s.lock().unwrap();
        s.identity = Some(identity.to_vec());
        let hash = fixed.or(s.offered)?;
        (identity == IDENTITY).then(|| Psk { key: key(48), hash })
    })
    .unwrap();
    b.build()
}

/// A client offering `suites` with its key bound with `hash`.
fn client(identity: &[u8], key: Vec<u8>, hash: PskHash, suites: &str) -> openssl::ssl::SslContext {
    let mut b = SslContextBuilder::new(SslMethod::tls_client()).unwrap();
    b.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
    b.set_ciphersuites(suites).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    set_client_psk(&mut b, identity.to_vec(), Psk { key, hash }).unwrap();
    b.build()
}

/// A handshake and one message each way; the suite the server agreed on.
fn talk(
    server: openssl::ssl::SslContext,
    client: openssl::ssl::SslContext,
) -> Result<&'static str, String> {
    let (a, b) = UnixStream::pair().unwrap();
    let serving = std::thread::spawn(move || -> Result<&'static str, String> {
        let mut tls = Ssl::new(&server)
            .unwrap()
            .accept(a)
            .map_err(|e| e.to_string())?;
        let mut got = [0u8; 5];
        tls.read_exact(&mut got).map_err(|e| e.to_string())?;
        tls.write_all(&got).map_err(|e| e.to_string())?;
        Ok(tls.ssl().current_cipher().map(|c| c.name()).unwrap_or(""))
    });
    let talked = Ssl::new(&client)
        .unwrap()
        .connect(b)
        .map_err(|e| e.to_string())
        .and_then(|mut tls| {
            tls.write_all(b"hello").map_err(|e| e.to_string())?;
            let mut back = [0u8; 5];
            tls.read_exact(&mut back).map_err(|e| e.to_string())?;
            assert_eq!(&back, b"hello");
            Ok(())
        });
    let served = serving.join().unwrap();
    talked.and(served)
}

#[test]
fn a_sha384_psk_is_served_with_its_suite() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let suite = talk(
        server(None, &seen),
        client(IDENTITY, key(48), PskHash::Sha384, ALL),
    );
    assert_eq!(suite, Ok("TLS_AES_256_GCM_SHA384"));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.offered, Some(PskHash::Sha384));
    assert_eq!(seen.identity.as_deref(), Some(IDENTITY));
}

#[test]
fn a_key_bound_with_sha256_is_served_with_a_suite_of_that_hash() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let suite = talk(
        server(None, &seen),
        client(IDENTITY, key(48), PskHash::Sha256, ALL),
    );
    assert_eq!(suite, Ok("TLS_AES_128_GCM_SHA256"));
    assert_eq!(seen.lock().unwrap().offered, Some(PskHash::Sha256));
    // As Debian 13's tlshd offers a SHA-384 key: a SHA-256 binder, and of SHA-256's suites
    // only ChaCha20-Poly1305.
    let suite = talk(
        server(None, &seen),
        client(
            IDENTITY,
            key(48),
            PskHash::Sha256,
            "TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        ),
    );
    assert_eq!(suite, Ok("TLS_CHACHA20_POLY1305_SHA256"));
}

#[test]
fn a_suite_chosen_without_the_binder_fails_the_handshake() {
    // Why the server reads the binder: a SHA-384 session for a SHA-256 binder is refused.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let talked = talk(
        server(Some(PskHash::Sha384), &seen),
        client(IDENTITY, key(48), PskHash::Sha256, ALL),
    );
    assert!(talked.is_err(), "{talked:?}");
}

#[test]
fn a_wrong_key_or_an_unknown_identity_fails_the_handshake() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut wrong = key(48);
    wrong[0] ^= 1;
    let talked = talk(
        server(None, &seen),
        client(IDENTITY, wrong, PskHash::Sha384, ALL),
    );
    assert!(talked.is_err(), "{talked:?}");
    let talked = talk(
        server(None, &seen),
        client(b"NVMe0R02 someone else", key(48), PskHash::Sha384, ALL),
    );
    assert!(talked.is_err(), "{talked:?}");
    assert_eq!(
        seen.lock().unwrap().identity.as_deref(),
        Some(&b"NVMe0R02 someone else"[..])
    );
}
