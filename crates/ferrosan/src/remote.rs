//! `ferrosan ctl --url`: the remote management API's client. One verb per request, as the
//! control socket's: `POST URL/v1/VERB` with the arguments, the token in `Authorization`; the
//! reply is the daemon's JSON answer whatever the HTTP status (its `kind` says why it failed).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use ureq::tls::{Certificate, RootCerts, TlsConfig, TlsProvider};

/// How long a reply may take; the copying verbs (snapshot, clone, rollback) wait without one,
/// as over the socket.
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Remote {
    base: String,
    token: String,
    agent: ureq::Agent,
    copying: ureq::Agent,
}

impl Remote {
    pub fn new(url: &str, token_file: &Path, ca_file: Option<&Path>) -> Result<Remote, String> {
        let base = url.trim_end_matches('/');
        if !base.starts_with("https://") {
            return Err(format!(
                "--url {url}: an https:// URL (the API speaks TLS only)"
            ));
        }
        let token = std::fs::read_to_string(token_file)
            .map_err(|e| format!("{}: {e}", token_file.display()))?
            .trim()
            .to_string();
        if token.is_empty() {
            return Err(format!("{}: no token in it", token_file.display()));
        }
        let roots = match ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let cert = Certificate::from_pem(&pem)
                    .map_err(|e| format!("{}: not a PEM certificate: {e}", path.display()))?;
                RootCerts::Specific(Arc::new(vec![cert]))
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
    pub fn exchange(&self, request: &Value) -> Result<Value, String> {
        let mut args = request.as_object().cloned().unwrap_or_default();
        let verb = args
            .remove("verb")
            .and_then(|v| v.as_str().map(str::to_string))
            .ok_or("a request without a verb")?;
        let agent = match super::ctl::COPYING_VERBS.contains(&verb.as_str()) {
            true => &self.copying,
            false => &self.agent,
        };
        let url = format!("{}/v1/{verb}", self.base);
        let reply = agent
            .post(&url)
            .header("authorization", &format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .send(Value::Object(args).to_string())
            .map_err(|e| format!("{url}: {e}"))?;
        let status = reply.status();
        let text = reply
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| format!("{url}: reading the reply: {e}"))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{url}: HTTP {status}, not a ferrosan answer ({e})"))
    }
}
