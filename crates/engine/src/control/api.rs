//! The remote management API: the control socket's verbs over HTTPS, for orchestrators
//! (docs/OPERATIONS.md, *Remote API*). Off unless `[server] api_listen` is set.
//!
//! One verb per request: `POST /v1/VERB` with the verb's arguments as a JSON object (the
//! socket's request without `"verb"`), or `GET /v1/VERB` for a reading verb without
//! arguments. The answer is the socket's answer, from the same handler ([`super::handle`]),
//! with an HTTP status from its `kind` ([`status_of`]) and the request's ID. A caller proves
//! itself with a token (`Authorization: Bearer fsn_...`, `ctl token create`); its role decides
//! which verbs it may call ([`crate::admission::tokens::Role::may`]). `GET /v1/openapi.json` describes
//! every verb and needs no token.
//!
//! Bounds: [`CONNECTIONS_MAX`] connections, a request body of at most
//! [`super::REQUEST_BYTES_MAX`] (413), [`RATE_PER_S`] requests a second per source address with
//! bursts of [`RATE_BURST`] (429), [`HANDSHAKE_TIME`] for TLS and a request's headers. Every
//! refusal is logged and counted; every change is logged with who made it and its result.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use openssl::ssl::{Ssl, SslAcceptor, SslFiletype, SslMethod};
use serde_json::{json, Map, Value};

use crate::admission::tokens::Caller;
use crate::shared::Shared;

/// Connections served at once; more are closed at accept.
pub const CONNECTIONS_MAX: usize = 64;
/// Requests a second each source address may make, on average...
pub const RATE_PER_S: f64 = 20.0;
/// ...and at once after a quiet spell.
pub const RATE_BURST: f64 = 40.0;
/// For the TLS handshake, and for a request's headers once connected: hyper starts this
/// clock whenever it waits for a request, so a connection idle this long (never used, or
/// kept alive after its last answer) is closed and cannot hold a place of [`CONNECTIONS_MAX`].
pub const HANDSHAKE_TIME: Duration = Duration::from_secs(10);
/// Source addresses the rate limiter remembers; past this, those idle longest are forgotten.
const SOURCES_MAX: usize = 4096;
/// The longest request ID taken from a client (`X-Request-Id`); longer ones are replaced.
const REQUEST_ID_MAX: usize = 64;

/// Why the API cannot serve: its TLS identity.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("no state directory for a self-signed certificate: set [server] state_dir, or api_cert and api_key")]
    NoStateDir,
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a self-signed certificate: {0}")]
    SelfSigned(openssl::error::ErrorStack),
    #[error("{}: no certificate in it (api_client_ca)", .0.display())]
    NoClientCa(PathBuf),
    #[error("{}: {what}: {source}", path.display())]
    Tls {
        path: PathBuf,
        what: &'static str,
        source: openssl::error::ErrorStack,
    },
}

/// The API's certificate and key files: the configured pair, else `api-cert.pem` and
/// `api-key.pem` in the state directory, made self-signed (P-256, ten years, for the host's
/// name, `localhost`, the loopback addresses and `api_listen`'s address) when missing. A
/// client trusts it with `ctl --ca-file STATE_DIR/api-cert.pem`.
pub fn identity(
    server: &crate::config::ServerConfig,
    state_dir: Option<&Path>,
) -> Result<(PathBuf, PathBuf), ApiError> {
    if let (Some(cert), Some(key)) = (&server.api_cert, &server.api_key) {
        return Ok((cert.clone(), key.clone()));
    }
    let dir = state_dir.ok_or(ApiError::NoStateDir)?;
    let (cert, key) = (dir.join("api-cert.pem"), dir.join("api-key.pem"));
    if cert.exists() && key.exists() {
        return Ok((cert, key));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ApiError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_pem, key_pem, fingerprint) =
        self_signed(server.api_listen.map(|a| a.ip())).map_err(ApiError::SelfSigned)?;
    write_private(&key, &key_pem).map_err(io(&key))?;
    std::fs::write(&cert, cert_pem).map_err(io(&cert))?;
    tracing::warn!(cert = %cert.display(), sha256 = %fingerprint, "remote API: made a self-signed certificate (clients: ctl --ca-file with it, or set api_cert and api_key)");
    Ok((cert, key))
}

/// A self-signed certificate and its key (PEM), and the certificate's SHA-256 fingerprint.
fn self_signed(
    listen: Option<IpAddr>,
) -> Result<(Vec<u8>, Vec<u8>, String), openssl::error::ErrorStack> {
    use openssl::x509::{extension::SubjectAlternativeName, X509NameBuilder, X509};
    use openssl::{asn1::Asn1Time, bn::BigNum, ec, hash::MessageDigest, nid::Nid, pkey::PKey};
    let group = ec::EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
    let key = PKey::from_ec_key(ec::EcKey::generate(&group)?)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    let mut name = X509NameBuilder::new()?;
    name.append_entry_by_nid(Nid::COMMONNAME, &host)?;
    let name = name.build();
    let mut x509 = X509::builder()?;
    x509.set_version(2)?;
    let mut serial = [0u8; 16];
    openssl::rand::rand_bytes(&mut serial)?;
    serial[0] &= 0x7f;
    let serial = BigNum::from_slice(&serial)?.to_asn1_integer()?;
    x509.set_serial_number(&serial)?;
    x509.set_subject_name(&name)?;
    x509.set_issuer_name(&name)?;
    x509.set_pubkey(&key)?;
    let (from, until) = (Asn1Time::days_from_now(0)?, Asn1Time::days_from_now(3650)?);
    x509.set_not_before(&from)?;
    x509.set_not_after(&until)?;
    let mut san = SubjectAlternativeName::new();
    san.dns(&host).dns("localhost").ip("127.0.0.1").ip("::1");
    if let Some(ip) = listen.filter(|ip| !ip.is_unspecified()) {
        san.ip(&ip.to_string());
    }
    let san = san.build(&x509.x509v3_context(None, None))?;
    x509.append_extension(san)?;
    x509.sign(&key, MessageDigest::sha256())?;
    let cert = x509.build();
    let fingerprint = cert.digest(MessageDigest::sha256())?;
    let fingerprint: Vec<String> = fingerprint.iter().map(|b| format!("{b:02X}")).collect();
    Ok((
        cert.to_pem()?,
        key.private_key_to_pem_pkcs8()?,
        fingerprint.join(":"),
    ))
}

/// Writes a private key readable by the daemon's user only.
fn write_private(path: &Path, pem: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(pem)
}

/// The API's TLS identity: the configured certificate chain and key (PEM files); with
/// `client_ca`, client certificates are asked for and must chain to one of its certificates
/// (a client without one may still present a token).
pub fn acceptor(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<SslAcceptor, ApiError> {
    let tls = |path: &Path, what| {
        let path = path.to_path_buf();
        move |source| ApiError::Tls { path, what, source }
    };
    let mut builder =
        SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).map_err(tls(cert, "TLS"))?;
    builder
        .set_certificate_chain_file(cert)
        .map_err(tls(cert, "not a PEM certificate chain"))?;
    builder
        .set_private_key_file(key, SslFiletype::PEM)
        .map_err(tls(key, "not a PEM private key"))?;
    builder
        .check_private_key()
        .map_err(tls(key, "not the certificate's key"))?;
    if let Some(ca) = client_ca {
        ask_client_certificates(&mut builder, ca)?;
    }
    Ok(builder.build())
}

/// Asks clients for a certificate chaining to one in `ca` (PEM), naming those CAs in the
/// request; one that fails verification fails the handshake, none at all is let through.
fn ask_client_certificates(
    builder: &mut openssl::ssl::SslAcceptorBuilder,
    ca: &Path,
) -> Result<(), ApiError> {
    use openssl::ssl::SslVerifyMode;
    use openssl::x509::X509;
    let pem = std::fs::read(ca).map_err(|source| ApiError::Io {
        path: ca.to_path_buf(),
        source,
    })?;
    let tls = |what| {
        let path = ca.to_path_buf();
        move |source| ApiError::Tls { path, what, source }
    };
    let certs = X509::stack_from_pem(&pem).map_err(tls("not PEM certificates"))?;
    let mut names = openssl::stack::Stack::new().map_err(tls("TLS"))?;
    for cert in &certs {
        let name = cert.subject_name().to_owned().map_err(tls("TLS"))?;
        names.push(name).map_err(tls("TLS"))?;
    }
    if certs.is_empty() {
        return Err(ApiError::NoClientCa(ca.to_path_buf()));
    }
    builder
        .set_ca_file(ca)
        .map_err(tls("not PEM certificates"))?;
    builder.set_client_ca_list(names);
    builder.set_verify(SslVerifyMode::PEER);
    // OpenSSL refuses to resume a session with client verification without one.
    builder
        .set_session_id_context(b"ferrosan-api")
        .map_err(tls("TLS"))?;
    Ok(())
}

/// The common name of a verified client certificate's subject: who it says it is. Only a
/// certificate the handshake verified counts (OpenSSL keeps one it could not verify too).
fn certified_name(ssl: &openssl::ssl::SslRef) -> Option<String> {
    if ssl.verify_result() != openssl::x509::X509VerifyResult::OK {
        return None;
    }
    let cert = ssl.peer_certificate()?;
    let entry = cert
        .subject_name()
        .entries_by_nid(openssl::nid::Nid::COMMONNAME)
        .next()?;
    // The bytes as they are: a name with a NUL or in another encoding matches no token.
    String::from_utf8(entry.data().as_slice().to_vec()).ok()
}

/// What every connection of the API shares.
struct Api {
    shared: Arc<Shared>,
    rate: Mutex<HashMap<IpAddr, Bucket>>,
}

/// A source's token bucket.
#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Serves the API on `listener` with `tls` until the daemon shuts down.
pub async fn serve(shared: Arc<Shared>, listener: tokio::net::TcpListener, tls: SslAcceptor) {
    let api = Arc::new(Api {
        shared: Arc::clone(&shared),
        rate: Mutex::new(HashMap::new()),
    });
    let tls = Arc::new(tls);
    let open = Arc::new(AtomicUsize::new(0));
    let mut shutdown = shared.shutdown_signal();
    loop {
        let (stream, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("API: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = Shared::wait_for_shutdown(&mut shutdown) => break,
        };
        if open.fetch_add(1, Ordering::AcqRel) >= CONNECTIONS_MAX {
            open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(%peer, "API: {CONNECTIONS_MAX} connections open, closing a new one");
            shared.metrics.limit("api_connections");
            continue;
        }
        let (api, tls, open) = (Arc::clone(&api), Arc::clone(&tls), Arc::clone(&open));
        tokio::spawn(async move {
            connection(api, &tls, stream, peer).await;
            open.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// One connection: the TLS handshake, then HTTP/1.1 requests until the client closes.
async fn connection(
    api: Arc<Api>,
    tls: &SslAcceptor,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
) {
    let Ok(ssl) = Ssl::new(tls.context()) else {
        return;
    };
    let Ok(mut stream) = tokio_openssl::SslStream::new(ssl, stream) else {
        return;
    };
    match tokio::time::timeout(HANDSHAKE_TIME, Pin::new(&mut stream).accept()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(%peer, "API: TLS handshake failed: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "API: TLS handshake timed out");
            return;
        }
    }
    let certified: Option<Arc<str>> = certified_name(stream.ssl()).map(Arc::from);
    let service = hyper::service::service_fn(move |request| {
        let (api, certified) = (Arc::clone(&api), certified.clone());
        async move {
            let from = Origin {
                peer,
                certified: certified.as_deref(),
            };
            Ok::<_, Infallible>(answer(&api, from, request).await)
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HANDSHAKE_TIME)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
        .await;
    if let Err(e) = served {
        tracing::debug!(%peer, "API: connection ended: {e}");
    }
}

/// A refusal before the verb runs: its status, the socket's `kind` and a message.
struct Refused(StatusCode, &'static str, String);

/// Where a request comes from: its address, and the common name of the client certificate
/// its connection verified, if any.
#[derive(Clone, Copy)]
struct Origin<'a> {
    peer: SocketAddr,
    certified: Option<&'a str>,
}

/// Answers one request.
async fn answer(api: &Api, from: Origin<'_>, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let (id, peer) = (request_id(&request), from.peer);
    let result = match admitted(api, from, &request) {
        Ok(Routed::OpenApi) => Ok((StatusCode::OK, openapi())),
        Ok(Routed::Verb(verb, caller, proof)) => {
            let who = Who {
                caller,
                proof,
                peer,
            };
            run(api, request, verb, who, &id).await
        }
        Err(refused) => {
            // Refused before its body was read: read it away, as `arguments` does.
            linger(&mut request.into_body()).await;
            Err(refused)
        }
    };
    let (status, mut body) = match result {
        Ok(answered) => answered,
        Err(Refused(status, kind, message)) => {
            tracing::warn!(%peer, request_id = %id, kind, "API: {message}");
            api.shared.metrics.limit(refusal_limit(kind));
            (
                status,
                json!({ "ok": false, "error": message, "kind": kind }),
            )
        }
    };
    if let Value::Object(fields) = &mut body {
        fields.insert("request_id".into(), Value::String(id.clone()));
    }
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(id) = HeaderValue::from_str(&id) {
        headers.insert("x-request-id", id);
    }
    if status == StatusCode::UNAUTHORIZED {
        headers.insert("www-authenticate", HeaderValue::from_static("Bearer"));
    }
    response
}

/// What a request asks for, once it may: the verb, its caller and how the caller proved
/// itself (`token` or `certificate`).
enum Routed {
    OpenApi,
    Verb(&'static str, Caller, &'static str),
}

/// Who runs a verb, for the audit log.
struct Who {
    caller: Caller,
    proof: &'static str,
    peer: SocketAddr,
}

/// The decisions before a verb runs, in order: the source's rate, the path (a known verb),
/// the method, the caller (a token, else a verified client certificate), its role.
fn admitted(api: &Api, from: Origin<'_>, request: &Request<Incoming>) -> Result<Routed, Refused> {
    let peer = from.peer;
    if !api.take_rate(peer.ip(), Instant::now()) {
        let message = format!(
            "more than {RATE_PER_S} requests a second from {}",
            peer.ip()
        );
        return Err(Refused(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            message,
        ));
    }
    let path = request.uri().path();
    if path == "/v1/openapi.json" && request.method() == Method::GET {
        return Ok(Routed::OpenApi);
    }
    let verb = path
        .strip_prefix("/v1/")
        .and_then(super::known_verb)
        .ok_or_else(|| {
            Refused(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no verb at {path}"),
            )
        })?;
    let method_ok = match *request.method() {
        Method::POST => true,
        Method::GET => !super::changes(verb),
        _ => false,
    };
    if !method_ok {
        let message = format!("{verb}: POST (GET only for a verb that changes nothing)");
        return Err(Refused(
            StatusCode::METHOD_NOT_ALLOWED,
            "bad_request",
            message,
        ));
    }
    let (caller, proof) = caller(api, from, request)?;
    if !caller.role.may(verb) {
        let message = format!(
            "{proof} {:?} ({}) may not call {verb}",
            caller.name,
            caller.role.name()
        );
        return Err(Refused(StatusCode::FORBIDDEN, "forbidden", message));
    }
    Ok(Routed::Verb(verb, caller, proof))
}

/// Who sends `request`, and by which proof: the token it presents, right or wrong; without
/// one, the verified client certificate of its connection.
fn caller(
    api: &Api,
    from: Origin<'_>,
    request: &Request<Incoming>,
) -> Result<(Caller, &'static str), Refused> {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let (caller, proof) = match (presented, from.certified) {
        (Some(t), _) => (api.shared.tokens.authenticate(t.trim()), "token"),
        (None, Some(name)) => (api.shared.tokens.named(name), "certificate"),
        (None, None) => (None, "token"),
    };
    let Some(caller) = caller else {
        let message = match proof {
            "certificate" => "the client certificate names no token (ctl token create NAME)",
            _ => "a valid token is needed (Authorization: Bearer; ctl token create)",
        };
        return Err(Refused(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            message.into(),
        ));
    };
    Ok((caller, proof))
}

/// Runs `verb` for `caller` with the request's body as its arguments, through the socket's
/// handler on the blocking pool (verbs open devices and write files); logs a change.
async fn run(
    api: &Api,
    request: Request<Incoming>,
    verb: &'static str,
    who: Who,
    id: &str,
) -> Result<(StatusCode, Value), Refused> {
    let mut args = arguments(request).await?;
    args.insert("verb".into(), Value::String(verb.into()));
    let line = Value::Object(args).to_string();
    let shared = Arc::clone(&api.shared);
    let answer = tokio::task::spawn_blocking(move || super::handle(&shared, line.as_bytes()))
        .await
        .unwrap_or_else(|e| super::error(format!("internal error: {e}")));
    let kind = match answer.get("ok").and_then(Value::as_bool) {
        Some(true) => "ok",
        _ => answer
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("bad_request"),
    };
    if super::changes(verb) {
        tracing::info!(
            target: "ferrosan::audit",
            request_id = %id,
            token = %who.caller.name,
            proof = who.proof,
            peer = %who.peer,
            verb,
            result = kind,
            "API change"
        );
    }
    Ok((status_of(kind), answer))
}

/// What a refused body may still send, and for how long, before its connection is closed.
const LINGER_BYTES: usize = 1024 * 1024;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// Reads and drops the rest of a refused request's body, up to [`LINGER_BYTES`] and
/// [`LINGER_TIME`]: a connection closed with unread data resets, and the reset can reach the
/// client before the refusal does (it sees no answer at all, only a broken connection). Every
/// refusal takes this way, the body's size or the caller's rights alike.
async fn linger(body: &mut Incoming) {
    let drained = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > LINGER_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drained).await;
}

/// The request's body as the verb's arguments: empty, or one JSON object of at most
/// `REQUEST_BYTES_MAX` bytes.
async fn arguments(request: Request<Incoming>) -> Result<Map<String, Value>, Refused> {
    let max = super::REQUEST_BYTES_MAX;
    let too_long = || {
        let message = format!("a request body is at most {max} bytes");
        Refused(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    };
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let mut body = request.into_body();
    if declared.is_some_and(|n| n > max) {
        linger(&mut body).await;
        return Err(too_long());
    }
    // Through a borrow, so that a body found too long can still be read away.
    let body = match Limited::new(&mut body, max).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            linger(&mut body).await;
            return Err(too_long());
        }
        Err(e) => {
            let message = format!("reading the request: {e}");
            return Err(Refused(StatusCode::BAD_REQUEST, "bad_request", message));
        }
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(args)) if !args.contains_key("verb") => Ok(args),
        Ok(Value::Object(_)) => {
            let message = "the verb is the path: no \"verb\" in the body".into();
            Err(Refused(StatusCode::BAD_REQUEST, "bad_request", message))
        }
        Ok(_) | Err(_) => {
            let message = "the body is the verb's arguments, one JSON object".into();
            Err(Refused(StatusCode::BAD_REQUEST, "bad_request", message))
        }
    }
}

/// The HTTP status of an answer of `kind` (the socket's kinds, docs/OPERATIONS.md).
pub fn status_of(kind: &str) -> StatusCode {
    match kind {
        "ok" => StatusCode::OK,
        "bad_request" => StatusCode::BAD_REQUEST,
        "not_found" => StatusCode::NOT_FOUND,
        "conflict" | "needs_restart" | "busy" | "in_use" => StatusCode::CONFLICT,
        "invalid_config" | "no_config_file" => StatusCode::UNPROCESSABLE_ENTITY,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The limit a refusal of `kind` counts against (`ferrosan_limit_exceeded_total`).
fn refusal_limit(kind: &str) -> &'static str {
    match kind {
        "rate_limited" => "api_rate",
        "too_large" => "api_body",
        "unauthorized" => "api_unauthorized",
        "forbidden" => "api_forbidden",
        _ => "api_request",
    }
}

/// The client's `X-Request-Id` when it is short and printable, else a new one.
fn request_id(request: &Request<Incoming>) -> String {
    let given = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= REQUEST_ID_MAX)
        .filter(|v| v.bytes().all(|b| b.is_ascii_graphic()));
    match given {
        Some(id) => id.to_string(),
        None => {
            let mut bytes = [0u8; 8];
            let _ = openssl::rand::rand_bytes(&mut bytes);
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        }
    }
}

impl Api {
    fn take_rate(&self, source: IpAddr, now: Instant) -> bool {
        let mut buckets = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        take(&mut buckets, source, now)
    }
}

/// Takes one request from `source`'s bucket at `now`: false when it is empty (or when
/// [`SOURCES_MAX`] other sources are all busy).
fn take(buckets: &mut HashMap<IpAddr, Bucket>, source: IpAddr, now: Instant) -> bool {
    if buckets.len() >= SOURCES_MAX && !buckets.contains_key(&source) {
        // Forget the sources quiet long enough to be full again: they lose nothing.
        let full = Duration::from_secs_f64(RATE_BURST / RATE_PER_S);
        buckets.retain(|_, b| now.saturating_duration_since(b.at) < full);
        if buckets.len() >= SOURCES_MAX {
            return false;
        }
    }
    let bucket = buckets.entry(source).or_insert(Bucket {
        tokens: RATE_BURST,
        at: now,
    });
    let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * RATE_PER_S;
    bucket.tokens = (bucket.tokens + refill).min(RATE_BURST);
    bucket.at = now;
    if bucket.tokens < 1.0 {
        return false;
    }
    bucket.tokens -= 1.0;
    true
}

/// The OpenAPI 3.1 document of the API, made from the verb tables: every verb, its method,
/// the role it needs, its answers.
pub fn openapi() -> Value {
    let answer = json!({
        "type": "object",
        "required": ["ok", "request_id"],
        "properties": {
            "ok": { "type": "boolean" },
            "error": { "type": "string" },
            "kind": { "type": "string", "description": "why it failed, for a program to act on (docs/OPERATIONS.md)" },
            "request_id": { "type": "string" }
        },
        "additionalProperties": true
    });
    let responses = json!({
        "200": { "description": "done", "content": { "application/json": { "schema": answer } } },
        "400": { "description": "bad_request: the arguments" },
        "401": { "description": "unauthorized: no valid token" },
        "403": { "description": "forbidden: the token's role may not call this verb" },
        "404": { "description": "not_found" },
        "409": { "description": "conflict, needs_restart, busy" },
        "413": { "description": "too_large: the body" },
        "422": { "description": "invalid_config" },
        "429": { "description": "rate_limited" },
        "500": { "description": "device, save_failed, not_saved and other failures" }
    });
    let mut paths = Map::new();
    for verb in super::all_verbs() {
        let role = if super::changes(verb) {
            "admin"
        } else {
            "reader"
        };
        let post = json!({
            "operationId": verb,
            "summary": format!("ferrosan ctl's {verb} (the {role} role or above)"),
            "x-ferrosan-role": role,
            "requestBody": {
                "required": false,
                "content": { "application/json": { "schema": {
                    "type": "object",
                    "description": "the verb's arguments, as the control socket takes them (docs/OPERATIONS.md)",
                    "additionalProperties": true
                } } }
            },
            "responses": responses.clone()
        });
        let mut item = json!({ "post": post });
        if role == "reader" {
            item["get"] = json!({ "operationId": format!("{verb}-get"), "summary": format!("{verb} without arguments"), "responses": responses.clone() });
        }
        paths.insert(format!("/v1/{verb}"), item);
    }
    json!({
        "openapi": "3.1.0",
        "info": { "title": "ferrosan management API", "version": env!("CARGO_PKG_VERSION") },
        "components": { "securitySchemes": { "token": { "type": "http", "scheme": "bearer" } } },
        "security": [ { "token": [] } ],
        "paths": paths
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_gets_its_burst_then_its_rate_and_others_are_not_held_back() {
        let mut buckets = HashMap::new();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        let burst = (0..100).take_while(|_| take(&mut buckets, a, t0)).count();
        assert_eq!(burst, RATE_BURST as usize);
        assert!(
            take(&mut buckets, b, t0),
            "another source has its own bucket"
        );
        // A second later: the rate's worth again, no more.
        let t1 = t0 + Duration::from_secs(1);
        let again = (0..100).take_while(|_| take(&mut buckets, a, t1)).count();
        assert_eq!(again, RATE_PER_S as usize);
    }

    #[test]
    fn the_limiter_remembers_a_bounded_number_of_sources() {
        let mut buckets = HashMap::new();
        let t0 = Instant::now();
        for i in 0..SOURCES_MAX as u32 {
            assert!(take(&mut buckets, IpAddr::from(i.to_be_bytes()), t0));
        }
        let newcomer = IpAddr::from([255, 0, 0, 1]);
        assert!(
            !take(&mut buckets, newcomer, t0),
            "all busy: refused, not remembered"
        );
        assert_eq!(buckets.len(), SOURCES_MAX);
        let later = t0 + Duration::from_secs(3);
        assert!(
            take(&mut buckets, newcomer, later),
            "the quiet ones are forgotten"
        );
        assert_eq!(buckets.len(), 1);
    }

    #[test]
    fn kinds_map_to_their_statuses() {
        assert_eq!(status_of("ok"), StatusCode::OK);
        assert_eq!(status_of("bad_request"), StatusCode::BAD_REQUEST);
        assert_eq!(status_of("not_found"), StatusCode::NOT_FOUND);
        assert_eq!(status_of("conflict"), StatusCode::CONFLICT);
        assert_eq!(status_of("in_use"), StatusCode::CONFLICT);
        assert_eq!(
            status_of("invalid_config"),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(status_of("device"), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn the_document_names_every_verb_with_its_role() {
        let doc = openapi();
        let paths = doc["paths"].as_object().unwrap();
        assert_eq!(paths.len(), super::super::all_verbs().count());
        assert_eq!(
            doc["paths"]["/v1/status"]["post"]["x-ferrosan-role"],
            "reader"
        );
        assert!(doc["paths"]["/v1/status"].get("get").is_some());
        assert_eq!(
            doc["paths"]["/v1/volume-create"]["post"]["x-ferrosan-role"],
            "admin"
        );
        assert!(doc["paths"]["/v1/volume-create"].get("get").is_none());
        assert_eq!(
            doc["paths"]["/v1/token-list"]["post"]["x-ferrosan-role"],
            "admin"
        );
    }
}
