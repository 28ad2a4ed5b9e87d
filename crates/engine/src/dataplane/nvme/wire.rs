//! An NVMe/TCP queue's byte stream: the TCP socket itself, or TLS 1.3 over it with a
//! pre-shared key (NVMe TCP transport 1.0, 3.6; docs/NVME.md, *TLS*). A host that wants TLS
//! starts with a TLS handshake record, one that does not with its ICReq, so one port serves
//! both; whether a host *must* use TLS is the admission decision's (`Topology::admit`, with
//! what the handshake proved).

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use openssl::ssl::{
    ClientHelloResponse, Ssl, SslContext, SslContextBuilder, SslMethod, SslVersion,
};
use tokio::net::TcpStream;
use tokio_openssl::SslStream;

pub(in crate::dataplane) use super::super::wire::Wire;
use crate::admission::TlsProof;
use crate::config::NodeName;
use crate::dataplane::batched::Batched;
use crate::shared::Shared;

/// The first byte of a TLS handshake record (a ClientHello); an ICReq starts with 0.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Why a queue closed before its first PDU.
pub(super) enum NotOpened {
    Closed,
    Io(std::io::Error),
    /// The TLS handshake failed: the metric's label, and the log's reason.
    Tls(&'static str, String),
}

/// The queue's stream: TLS when the host opens with a handshake (then what it proved), else
/// the socket as it is.
pub(super) async fn open(
    stream: TcpStream,
    shared: &Arc<Shared>,
) -> Result<(Wire, Option<TlsProof>), NotOpened> {
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(0) => return Err(NotOpened::Closed),
        Ok(_) => {}
        Err(e) => return Err(NotOpened::Io(e)),
    }
    if first[0] != TLS_HANDSHAKE_RECORD {
        return Ok((Wire::Plain(stream), None));
    }
    // A source over its failed-login limit gets no handshake (its cost is the daemon's).
    if let Ok(peer) = stream.peer_addr() {
        if shared
            .doors
            .login_blocked(peer.ip(), std::time::Instant::now())
        {
            shared.metrics.limit("login_failures_max");
            return Err(NotOpened::Closed);
        }
    }
    let chosen = Arc::new(Mutex::new(Chosen::default()));
    let ctx = context(shared, &chosen)
        .map_err(|e| NotOpened::Tls("handshake", format!("TLS setup: {e}")))?;
    let mut tls = Ssl::new(&ctx)
        .and_then(|ssl| SslStream::new(ssl, Batched::new(stream)))
        .map_err(|e| NotOpened::Tls("handshake", format!("TLS setup: {e}")))?;
    let accepted = Pin::new(&mut tls).accept().await;
    let chosen = std::mem::take(&mut *chosen.lock().unwrap_or_else(|e| e.into_inner()));
    match (accepted, chosen) {
        (Ok(()), Chosen { proof: Some(p), .. }) => Ok((Wire::Tls(Box::new(tls)), Some(p))),
        (Ok(()), _) => Err(NotOpened::Tls(
            "handshake",
            "TLS without a pre-shared key".into(),
        )),
        (
            Err(_),
            Chosen {
                refused: Some(why), ..
            },
        ) => Err(NotOpened::Tls("unknown_identity", why)),
        (Err(e), c) => Err(NotOpened::Tls("handshake", format!("{e} ({})", c.hello))),
    }
}

/// What the TLS callbacks decided, for the handshake's end.
#[derive(Default)]
struct Chosen {
    /// The hash the host's PSK binder was computed with (its ClientHello's).
    hash: Option<tls13_psk::PskHash>,
    proof: Option<TlsProof>,
    /// Why no key was given for the offered identity.
    refused: Option<String>,
    /// What the host's ClientHello offered, for the log of a failed handshake.
    hello: String,
}

/// The PSK binder's hash and the TLS 1.3 suites a ClientHello offers, for people.
fn hello(ssl: &openssl::ssl::SslRef, hash: Option<tls13_psk::PskHash>) -> String {
    let suites: Vec<String> = ssl
        .client_hello_ciphers()
        .unwrap_or_default()
        .chunks_exact(2)
        .filter(|c| c[0] == 0x13)
        .map(|c| match c[1] {
            1 => "TLS_AES_128_GCM_SHA256".to_string(),
            2 => "TLS_AES_256_GCM_SHA384".to_string(),
            3 => "TLS_CHACHA20_POLY1305_SHA256".to_string(),
            n => format!("0x13{n:02x}"),
        })
        .collect();
    let binder = match hash {
        Some(h) => format!("a PSK binder of {} ({} bytes)", h.name(), h.hash_len()),
        None => "no PSK binder of a TLS 1.3 hash's length".to_string(),
    };
    format!(
        "the host offered {binder} and suites [{}]",
        suites.join(", ")
    )
}

/// The suites NVMe/TCP names (TCP transport 3.6.1.3: TLS_AES_128_GCM_SHA256 for SHA-256
/// PSKs, TLS_AES_256_GCM_SHA384 for SHA-384 ones), and TLS_CHACHA20_POLY1305_SHA256, the only
/// SHA-256 suite Debian 13's host offers with a SHA-384 key (which it binds with SHA-256).
const SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

/// A TLS 1.3 server context that knows no certificate, only the configured PSKs: one per
/// connection, its callbacks reading the topology of the moment.
fn context(
    shared: &Arc<Shared>,
    chosen: &Arc<Mutex<Chosen>>,
) -> Result<SslContext, openssl::error::ErrorStack> {
    let mut b = SslContextBuilder::new(SslMethod::tls_server())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_ciphersuites(SUITES)?;
    // No session tickets: NVMe/TCP has no resumption, every queue hands its key again.
    b.set_num_tickets(0)?;
    // The suite is one of the hash the host bound its PSK with (its binder's), which is not
    // always its identity's: Debian 13's host (ktls-utils 1.0) binds an NVMe0R02 key with
    // SHA-256. OpenSSL takes only a PSK whose hash is the negotiated suite's.
    let c = Arc::clone(chosen);
    b.set_client_hello_callback(move |ssl, _alert| {
        let hash = tls13_psk::offered_hash(ssl);
        let said = hello(ssl, hash);
        if let Some(hash) = hash {
            ssl.set_ciphersuites(hash.suites())?;
        }
        let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
        c.hash = hash;
        c.hello = said;
        Ok(ClientHelloResponse::SUCCESS)
    });
    let shared = Arc::clone(shared);
    let chosen = Arc::clone(chosen);
    tls13_psk::set_server_find(&mut b, move |identity| {
        let mut c = chosen.lock().unwrap_or_else(|e| e.into_inner());
        let hash = c.hash?;
        match psk_for(&shared, identity) {
            Ok((key, proof)) => {
                c.proof = Some(proof);
                Some(tls13_psk::Psk { key, hash })
            }
            Err(why) => {
                c.refused = Some(why.to_string());
                None
            }
        }
    })?;
    Ok(b.build())
}

/// Why an offered PSK identity gets no key: the handshake fails and the log says this.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PskRefused {
    Malformed,
    /// A generated PSK or a version 1 identity, which are not offered.
    Unsupported,
    NoValidNqns,
    NoKey {
        host: NodeName,
        subsystem: NodeName,
    },
    /// The host's key is for the other hash than its identity names.
    OtherHash {
        host: NodeName,
        key: nvme::tls::CipherHash,
    },
}

impl std::fmt::Display for PskRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PskRefused::Malformed => f.write_str("a malformed PSK identity"),
            PskRefused::Unsupported => {
                f.write_str("a generated PSK or a version 1 identity (not offered)")
            }
            PskRefused::NoValidNqns => f.write_str("a PSK identity naming no valid NQNs"),
            PskRefused::NoKey { host, subsystem } => {
                write!(f, "no TLS key for host {host} in subsystem {subsystem}")
            }
            PskRefused::OtherHash { host, key } => write!(
                f,
                "the TLS key for host {host} is a {} key, and its identity names the other hash",
                key.name()
            ),
        }
    }
}

/// The TLS PSK for an offered identity: the subsystem it names, that subsystem's key for the
/// host it names, derived as the configuration says.
fn psk_for(shared: &Shared, identity: &[u8]) -> Result<(Vec<u8>, TlsProof), PskRefused> {
    let id = nvme::tls::Identity::parse(identity).map_err(|e| match e {
        nvme::tls::IdentityError::Malformed => PskRefused::Malformed,
        nvme::tls::IdentityError::Unsupported => PskRefused::Unsupported,
    })?;
    let (host, sub) = match (
        NodeName::from_wire(&id.host),
        NodeName::from_wire(&id.subsystem),
    ) {
        (Ok(h), Ok(s)) if s.is_nqn() => (h, s),
        _ => return Err(PskRefused::NoValidNqns),
    };
    let topology = shared.topology();
    let key = topology
        .target(&sub)
        .and_then(|(_, t)| t.config.tls_key(&host).cloned())
        .ok_or_else(|| PskRefused::NoKey {
            host: host.clone(),
            subsystem: sub.clone(),
        })?;
    let psk = key
        .key
        .tls_psk(&id, key.derivation)
        .ok_or(PskRefused::OtherHash {
            host,
            key: key.key.cipher(),
        })?;
    let proof = TlsProof {
        host: id.host,
        subsystem: id.subsystem,
        key: key.key,
        derivation: key.derivation,
    };
    Ok((psk, proof))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_psk_identity_says_why_without_the_key() {
        let host = NodeName::from_wire("nqn.2014-08.org.nvmexpress:uuid:h").unwrap();
        let subsystem = NodeName::from_wire("nqn.2026-11.org.ferrosan:s").unwrap();
        let no_key = PskRefused::NoKey {
            host: host.clone(),
            subsystem,
        };
        assert_eq!(
            no_key.to_string(),
            "no TLS key for host nqn.2014-08.org.nvmexpress:uuid:h in subsystem nqn.2026-11.org.ferrosan:s"
        );
        let other = PskRefused::OtherHash {
            host,
            key: nvme::tls::CipherHash::Sha384,
        };
        assert!(other.to_string().contains("is a SHA-384 key"), "{other}");
    }
}
