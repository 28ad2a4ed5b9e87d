//! The remote management API's client (`ferrosan ctl --url`, `ferrosan-csi`'s controller).
//! One verb per request, as the control socket's: `POST URL/v1/VERB` with the arguments, the
//! token in `Authorization` or a client certificate in the TLS handshake; the reply is the
//! daemon's JSON answer whatever the HTTP status (its `kind` says why it failed).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use ureq::tls::{parse_pem, Certificate, ClientCert, PemItem, RootCerts, TlsConfig, TlsProvider};

/// How long a reply may take; the copying verbs (snapshot, clone, rollback) wait without one,
/// as over the socket.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// The verbs that may copy a volume's data where its pool's filesystem cannot reflink: they
/// take as long as the data does, and the answer is awaited without a limit (the daemon logs
/// the copy's progress).
pub const COPYING_VERBS: &[&str] = &["volume-snapshot", "volume-clone", "volume-rollback"];

/// Why a request got no answer from the daemon (an answer with `"ok": false` is an answer).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--url {0}: an https:// URL (the API speaks TLS only)")]
    NotHttps(String),
    #[error("{path}: {error}")]
    File {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{0}: no token in it")]
    NoToken(PathBuf),
    #[error("a token file or a client certificate and its key is needed")]
    NoCredentials,
    #[error("{path}: {why}")]
    ClientCertificate { path: PathBuf, why: String },
    #[error("{path}: not a PEM certificate: {error}")]
    Certificate { path: PathBuf, error: ureq::Error },
    #[error("a request without a verb")]
    NoVerb,
    #[error("{url}: {error}")]
    Transport { url: String, error: ureq::Error },
    #[error("{url}: HTTP {status}, not a ferrosan answer ({error})")]
    NotAnAnswer {
        url: String,
        status: u16,
        error: serde_json::Error,
    },
}

/// How the client proves itself: a token, a client certificate, or both (the token is then
/// what the daemon checks).
#[derive(Clone, Copy, Debug, Default)]
pub struct Credentials<'a> {
    pub token_file: Option<&'a Path>,
    /// A certificate chain (PEM) and its private key (PEM, PKCS#8: what `openssl genpkey`
    /// writes), signed by a CA of the daemon's `api_client_ca`.
    pub certificate: Option<(&'a Path, &'a Path)>,
}

pub struct Remote {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
    copying: ureq::Agent,
}

fn read(path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|error| ClientError::File {
        path: path.to_path_buf(),
        error,
    })
}

/// The token in `path` (its first line, trimmed).
fn token(path: &Path) -> Result<String, ClientError> {
    let token = String::from_utf8_lossy(&read(path)?).trim().to_string();
    if token.is_empty() {
        return Err(ClientError::NoToken(path.to_path_buf()));
    }
    Ok(token)
}

/// The certificate chain in `cert` and the PKCS#8 key in `key` (PEM files).
fn client_cert((cert, key): (&Path, &Path)) -> Result<ClientCert, ClientError> {
    let bad = |path: &Path, why: String| ClientError::ClientCertificate {
        path: path.to_path_buf(),
        why,
    };
    let mut chain = Vec::new();
    for item in parse_pem(&read(cert)?) {
        match item.map_err(|e| bad(cert, e.to_string()))? {
            PemItem::Certificate(c) => chain.push(c),
            _ => {
                return Err(bad(
                    cert,
                    "a certificate file holds certificates only".into(),
                ))
            }
        }
    }
    if chain.is_empty() {
        return Err(bad(cert, "no PEM certificate in it".into()));
    }
    let key_pem = read(key)?;
    let mut keys = parse_pem(&key_pem).filter_map(|item| match item {
        Ok(PemItem::PrivateKey(k)) => Some(k),
        _ => None,
    });
    let key_item = keys
        .next()
        .ok_or_else(|| bad(key, "no PEM private key in it".into()))?;
    // The label says the kind: native-tls takes PKCS#8 only ("PRIVATE KEY", not "EC PRIVATE
    // KEY" or "RSA PRIVATE KEY").
    if !String::from_utf8_lossy(&key_pem).contains("-----BEGIN PRIVATE KEY-----") {
        let why = "not a PKCS#8 key (convert it: openssl pkcs8 -topk8 -nocrypt)";
        return Err(bad(key, why.into()));
    }
    Ok(ClientCert::new_with_certs(&chain, key_item))
}

impl Remote {
    /// A client of the API at `url` (`https://HOST:PORT`), proving itself with `credentials`
    /// and, if given, trusting the one certificate in `ca_file` as the only root (the daemon's
    /// own self-signed one); the system's roots otherwise.
    pub fn new(
        url: &str,
        credentials: &Credentials<'_>,
        ca_file: Option<&Path>,
    ) -> Result<Remote, ClientError> {
        let base = url.trim_end_matches('/');
        if !base.starts_with("https://") {
            return Err(ClientError::NotHttps(url.to_string()));
        }
        let token = credentials.token_file.map(token).transpose()?;
        let identity = credentials.certificate.map(client_cert).transpose()?;
        if token.is_none() && identity.is_none() {
            return Err(ClientError::NoCredentials);
        }
        let roots = match ca_file {
            Some(path) => {
                let cert = Certificate::from_pem(&read(path)?).map_err(|error| {
                    ClientError::Certificate {
                        path: path.to_path_buf(),
                        error,
                    }
                })?;
                RootCerts::Specific(Arc::new(vec![cert.to_owned()]))
            }
            None => RootCerts::PlatformVerifier,
        };
        let agent = |timeout: Option<Duration>| -> ureq::Agent {
            let tls = TlsConfig::builder()
                .provider(TlsProvider::NativeTls)
                .root_certs(roots.clone())
                .client_cert(identity.clone())
                .build();
            ureq::Agent::config_builder()
                .tls_config(tls)
                .timeout_global(timeout)
                .http_status_as_error(false)
                .build()
                .into()
        };
        Ok(Remote {
            base: base.to_string(),
            token,
            agent: agent(Some(REPLY_TIMEOUT)),
            copying: agent(None),
        })
    }

    /// Sends `request` (a socket request: `verb` and its arguments); the daemon's answer.
    pub fn exchange(&self, request: &Value) -> Result<Value, ClientError> {
        let mut args = request.as_object().cloned().unwrap_or_default();
        let verb = args
            .remove("verb")
            .and_then(|v| v.as_str().map(str::to_string))
            .ok_or(ClientError::NoVerb)?;
        self.call(&verb, args)
    }

    /// Sends `verb` with `args`; the daemon's answer.
    pub fn call(&self, verb: &str, args: Map<String, Value>) -> Result<Value, ClientError> {
        let agent = match COPYING_VERBS.contains(&verb) {
            true => &self.copying,
            false => &self.agent,
        };
        let url = format!("{}/v1/{verb}", self.base);
        let transport = |error| ClientError::Transport {
            url: url.clone(),
            error,
        };
        let mut post = agent.post(&url).header("content-type", "application/json");
        if let Some(token) = &self.token {
            post = post.header("authorization", &format!("Bearer {token}"));
        }
        let reply = post
            .send(Value::Object(args).to_string())
            .map_err(transport)?;
        let status = reply.status().as_u16();
        let text = reply
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(transport)?;
        serde_json::from_str(&text).map_err(|error| ClientError::NotAnAnswer {
            url: url.clone(),
            status,
            error,
        })
    }
}
