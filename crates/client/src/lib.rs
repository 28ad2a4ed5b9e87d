//! The remote management API's client (`ferrosan ctl --url`, `ferrosan-csi`'s controller).
//! One verb per request, as the control socket's: `POST URL/v1/VERB` with the arguments, the
//! token in `Authorization`; the reply is the daemon's JSON answer whatever the HTTP status
//! (its `kind` says why it failed).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use ureq::tls::{Certificate, RootCerts, TlsConfig, TlsProvider};

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

pub struct Remote {
    base: String,
    token: String,
    agent: ureq::Agent,
    copying: ureq::Agent,
}

fn read(path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|error| ClientError::File {
        path: path.to_path_buf(),
        error,
    })
}

impl Remote {
    /// A client of the API at `url` (`https://HOST:PORT`), with the token in `token_file` and,
    /// if given, the one certificate in `ca_file` as the only trusted root (the daemon's own
    /// self-signed one); the system's roots otherwise.
    pub fn new(
        url: &str,
        token_file: &Path,
        ca_file: Option<&Path>,
    ) -> Result<Remote, ClientError> {
        let base = url.trim_end_matches('/');
        if !base.starts_with("https://") {
            return Err(ClientError::NotHttps(url.to_string()));
        }
        let token = String::from_utf8_lossy(&read(token_file)?)
            .trim()
            .to_string();
        if token.is_empty() {
            return Err(ClientError::NoToken(token_file.to_path_buf()));
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
        let reply = agent
            .post(&url)
            .header("authorization", &format!("Bearer {}", self.token))
            .header("content-type", "application/json")
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
