//! TLS 1.3 external pre-shared keys with any of TLS 1.3's hashes, over OpenSSL.
//!
//! The `openssl` crate binds OpenSSL's PSK callbacks of TLS 1.2's kind only; through them
//! OpenSSL makes every TLS 1.3 PSK a SHA-256 one. A SHA-384 key (NVMe/TCP's `NVMe0R02`
//! identities, TLS_AES_256_GCM_SHA384) needs the TLS 1.3 callbacks, which hand OpenSSL a
//! session naming its cipher suite: `SSL_CTX_set_psk_find_session_callback` on a server,
//! `SSL_CTX_set_psk_use_session_callback` on a client. This crate binds those two, and
//! reads the hash a client's ClientHello binds its PSK with (the binder's length), so that a
//! server can choose the suite that matches what the client computed.
//!
//! All the unsafe code of the TLS paths is here, behind three safe functions.

use std::ffi::{c_int, c_uchar};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use foreign_types::ForeignTypeRef;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{SslContext, SslContextBuilder, SslRef};
use openssl_sys::{SSL, SSL_CIPHER, SSL_CTX, SSL_SESSION};

/// The hash a TLS 1.3 PSK is bound with (its binder's, its key schedule's): the suites a
/// handshake with it may negotiate are those of that hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PskHash {
    Sha256,
    Sha384,
}

impl PskHash {
    /// The AES-GCM suite of the hash, which the PSK's session names (0x13 0x01, 0x13 0x02).
    fn code(self) -> [u8; 2] {
        match self {
            PskHash::Sha256 => [0x13, 0x01],
            PskHash::Sha384 => [0x13, 0x02],
        }
    }

    /// The hash's length: a binder's length says which hash its client bound the PSK with.
    pub fn hash_len(self) -> usize {
        match self {
            PskHash::Sha256 => 32,
            PskHash::Sha384 => 48,
        }
    }

    /// The hash's name, for people.
    pub fn name(self) -> &'static str {
        match self {
            PskHash::Sha256 => "SHA-256",
            PskHash::Sha384 => "SHA-384",
        }
    }

    /// The TLS 1.3 suites of this hash, by OpenSSL's names, AES-GCM first.
    pub fn suites(self) -> &'static str {
        match self {
            PskHash::Sha256 => "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256",
            PskHash::Sha384 => "TLS_AES_256_GCM_SHA384",
        }
    }

    fn from_len(len: usize) -> Option<PskHash> {
        [PskHash::Sha256, PskHash::Sha384]
            .into_iter()
            .find(|h| h.hash_len() == len)
    }
}

/// A key and the hash it is bound with.
pub struct Psk {
    pub key: Vec<u8>,
    pub hash: PskHash,
}

impl Drop for Psk {
    fn drop(&mut self) {
        self.key.fill(0);
    }
}

/// The pre_shared_key extension's code point (RFC 8446, 4.2).
const PRE_SHARED_KEY: u32 = 41;

/// The hash a ClientHello's first PSK binder was computed with, for a server's client-hello
/// callback; None without a PSK or with a binder of no TLS 1.3 hash's length.
pub fn offered_hash(ssl: &SslRef) -> Option<PskHash> {
    let mut data: *const c_uchar = std::ptr::null();
    let mut len: usize = 0;
    // SAFETY: `ssl` is a live SSL inside its client-hello callback (the only time the call
    // answers); OpenSSL points `data` into the ClientHello it holds for the callback's span,
    // and the bytes are copied out before returning.
    let found = unsafe {
        openssl_sys::SSL_client_hello_get0_ext(ssl.as_ptr(), PRE_SHARED_KEY, &mut data, &mut len)
    };
    if found != 1 || data.is_null() {
        return None;
    }
    // SAFETY: OpenSSL says `len` bytes at `data` are the extension's body.
    let body = unsafe { std::slice::from_raw_parts(data, len) };
    first_binder_len(body).and_then(PskHash::from_len)
}

/// The first binder's length in an OfferedPsks (RFC 8446, 4.2.11): identities<7..2^16-1>,
/// then binders<33..2^16-1> of one-byte-length entries.
pub fn first_binder_len(body: &[u8]) -> Option<usize> {
    let u16_at = |at: usize| -> Option<usize> {
        Some(usize::from(u16::from_be_bytes(
            body.get(at..at + 2)?.try_into().ok()?,
        )))
    };
    let identities = u16_at(0)?;
    let binders_at = 2 + identities;
    let binders = u16_at(binders_at)?;
    let first = usize::from(*body.get(binders_at + 2)?);
    (binders > first && body.len() > binders_at + 2 + first).then_some(first)
}

/// What a server's find-session callback asks for an offered identity.
type Find = Box<dyn Fn(&[u8]) -> Option<Psk> + Send + Sync>;

fn find_index() -> Result<Index<SslContext, Find>, ErrorStack> {
    static INDEX: OnceLock<Result<Index<SslContext, Find>, ErrorStack>> = OnceLock::new();
    INDEX.get_or_init(SslContext::new_ex_index::<Find>).clone()
}

/// Makes a server answer each offered PSK identity with what `find` gives it (None: not a
/// key this server knows). The hash must be the negotiated suite's (restrict the suites to
/// those of [`offered_hash`] in the client-hello callback): OpenSSL refuses a PSK of another.
pub fn set_server_find<F>(b: &mut SslContextBuilder, find: F) -> Result<(), ErrorStack>
where
    F: Fn(&[u8]) -> Option<Psk> + Send + Sync + 'static,
{
    b.set_ex_data(find_index()?, Box::new(find) as Find);
    // SAFETY: the callback matches OpenSSL's SSL_psk_find_session_cb_func.
    unsafe { SSL_CTX_set_psk_find_session_callback(b.as_ptr(), Some(raw_find)) };
    Ok(())
}

extern "C" fn raw_find(
    ssl: *mut SSL,
    identity: *const c_uchar,
    identity_len: usize,
    sess: *mut *mut SSL_SESSION,
) -> c_int {
    // SAFETY: OpenSSL calls this with its live SSL and a place for the session, during the
    // handshake.
    let ctx = unsafe { SslRef::from_ptr(ssl).ssl_context() };
    // An empty identity may come as a null pointer, which a slice must never be made from.
    let identity: &[u8] = if identity.is_null() || identity_len == 0 {
        &[]
    } else {
        // SAFETY: OpenSSL gives the identity's `identity_len` bytes, live for the call.
        unsafe { std::slice::from_raw_parts(identity, identity_len) }
    };
    let found = catch_unwind(AssertUnwindSafe(|| {
        let find = ctx.ex_data(find_index().ok()?)?;
        find(identity)
    }));
    match found {
        Ok(Some(psk)) => match session(ssl, &psk) {
            Some(s) => {
                // SAFETY: OpenSSL takes the session's reference.
                unsafe { *sess = s };
                1
            }
            None => 0,
        },
        Ok(None) => {
            // SAFETY: as above. No session: this identity has no key here.
            unsafe { *sess = std::ptr::null_mut() };
            1
        }
        Err(_) => 0,
    }
}

/// Makes a client offer `identity` with `psk`.
pub fn set_client_psk(
    b: &mut SslContextBuilder,
    identity: Vec<u8>,
    psk: Psk,
) -> Result<(), ErrorStack> {
    b.set_ex_data(offer_index()?, Offer { identity, psk });
    // SAFETY: the callback matches OpenSSL's SSL_psk_use_session_cb_func.
    unsafe { SSL_CTX_set_psk_use_session_callback(b.as_ptr(), Some(raw_use)) };
    Ok(())
}

/// What a client offers: kept in its context, where OpenSSL reads the identity from.
struct Offer {
    identity: Vec<u8>,
    psk: Psk,
}

fn offer_index() -> Result<Index<SslContext, Offer>, ErrorStack> {
    static INDEX: OnceLock<Result<Index<SslContext, Offer>, ErrorStack>> = OnceLock::new();
    INDEX.get_or_init(SslContext::new_ex_index::<Offer>).clone()
}

extern "C" fn raw_use(
    ssl: *mut SSL,
    _md: *const openssl_sys::EVP_MD,
    id: *mut *const c_uchar,
    idlen: *mut usize,
    sess: *mut *mut SSL_SESSION,
) -> c_int {
    // SAFETY: OpenSSL calls this with its live SSL and places for the identity and session.
    let ctx = unsafe { SslRef::from_ptr(ssl) }.ssl_context();
    let Some(offer) = offer_index().ok().and_then(|i| ctx.ex_data(i)) else {
        return 0;
    };
    let Some(s) = session(ssl, &offer.psk) else {
        return 0;
    };
    // SAFETY: the identity lives in the context, which outlives the handshake; OpenSSL takes
    // the session's reference.
    unsafe {
        *id = offer.identity.as_ptr();
        *idlen = offer.identity.len();
        *sess = s;
    }
    1
}

/// A TLS 1.3 session holding `psk` with its hash's AES-GCM suite (OpenSSL takes it for any
/// negotiated suite of the same hash), or None when OpenSSL cannot make one.
fn session(ssl: *mut SSL, psk: &Psk) -> Option<*mut SSL_SESSION> {
    const TLS1_3_VERSION: c_int = 0x0304;
    // SAFETY: plain OpenSSL calls on a live SSL and a session this function owns until it
    // returns it; the session is freed on every failure.
    unsafe {
        let cipher = SSL_CIPHER_find(ssl, psk.hash.code().as_ptr());
        if cipher.is_null() {
            return None;
        }
        let s = SSL_SESSION_new();
        if s.is_null() {
            return None;
        }
        let made = SSL_SESSION_set1_master_key(s, psk.key.as_ptr(), psk.key.len()) == 1
            && SSL_SESSION_set_cipher(s, cipher) == 1
            && SSL_SESSION_set_protocol_version(s, TLS1_3_VERSION) == 1;
        if !made {
            openssl_sys::SSL_SESSION_free(s);
            return None;
        }
        Some(s)
    }
}

type FindSession = extern "C" fn(*mut SSL, *const c_uchar, usize, *mut *mut SSL_SESSION) -> c_int;
type UseSession = extern "C" fn(
    *mut SSL,
    *const openssl_sys::EVP_MD,
    *mut *const c_uchar,
    *mut usize,
    *mut *mut SSL_SESSION,
) -> c_int;

// OpenSSL 1.1.1 and later (libssl); not in openssl-sys.
extern "C" {
    fn SSL_CTX_set_psk_find_session_callback(ctx: *mut SSL_CTX, cb: Option<FindSession>);
    fn SSL_CTX_set_psk_use_session_callback(ctx: *mut SSL_CTX, cb: Option<UseSession>);
    fn SSL_CIPHER_find(ssl: *mut SSL, code: *const c_uchar) -> *const SSL_CIPHER;
    fn SSL_SESSION_new() -> *mut SSL_SESSION;
    fn SSL_SESSION_set1_master_key(s: *mut SSL_SESSION, key: *const c_uchar, len: usize) -> c_int;
    fn SSL_SESSION_set_cipher(s: *mut SSL_SESSION, cipher: *const SSL_CIPHER) -> c_int;
    fn SSL_SESSION_set_protocol_version(s: *mut SSL_SESSION, version: c_int) -> c_int;
}

#[cfg(test)]
mod tests;
