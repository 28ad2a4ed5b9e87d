//! Who may use the remote management API, and as what: API tokens. A token is 32 random bytes,
//! shown once when it is made (`ctl token create`) and kept only as its SHA-256, with a name
//! and a role; `ctl token list` shows names and roles, `ctl token revoke` ends one at once (the
//! next request with it is refused). Tokens live in the state directory (`api-tokens.json`,
//! mode 0600), so they survive a restart; the file is rewritten whole through a rename.
//!
//! A role decides which verbs a token may call ([`Role::may`]): a reader only those that
//! change nothing and show nothing secret ([`changes`]), an admin every verb. This is the one
//! place the remote API asks; the control socket is the owner's and needs no token.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Why a token verb failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    /// The token file cannot be read, or is not one.
    #[error("{}: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
}

/// The verbs that change nothing and show nothing secret: a reader token may call these.
const READ_VERBS: &[&str] = &[
    "status",
    "sessions",
    "luns",
    "stats",
    "config",
    "volume-list",
    "snapshot-list",
    "pool-list",
];

/// Whether `verb` changes the array or shows what only its administrators may see (the
/// tokens): the one classification the remote API's roles ask ([`Role::may`]). An unknown
/// verb counts as changing.
pub fn changes(verb: &str) -> bool {
    !READ_VERBS.contains(&verb)
}

/// Tokens kept at most: a bound on the file and on each request's lookup.
pub const TOKENS_MAX: usize = 256;
/// What every token starts with, so that one pasted into a log or a chat is recognised.
const PREFIX: &str = "fsn_";
const TOKEN_BYTES: usize = 32;

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Every verb.
    Admin,
    /// The verbs that change nothing.
    Reader,
}

impl Role {
    pub fn parse(text: &str) -> Result<Role, TokenError> {
        match text {
            "admin" => Ok(Role::Admin),
            "reader" => Ok(Role::Reader),
            other => Err(TokenError::BadRequest(format!(
                "role {other:?}: admin or reader"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Reader => "reader",
        }
    }

    /// Whether a token of this role may call `verb`: the one decision of the remote API.
    pub fn may(self, verb: &str) -> bool {
        match self {
            Role::Admin => true,
            Role::Reader => !changes(verb),
        }
    }
}

/// One token as the file keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    name: String,
    role: Role,
    /// SHA-256 of the token, in hex.
    sha256: String,
    /// Seconds since the epoch.
    created: u64,
}

/// Who presented a token: its name (for the audit log) and its role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The daemon's tokens, as its state directory holds them.
#[derive(Debug)]
pub struct Tokens {
    /// None: no state directory; tokens can be neither made nor used.
    path: Option<PathBuf>,
    records: Mutex<Vec<Record>>,
    /// The file did not load: no token is accepted and none is made or revoked (that would
    /// write over the others) until it is mended and the daemon restarted.
    broken: Option<String>,
}

impl Tokens {
    /// The tokens of `state_dir`, as [`Tokens::load`]; a file that does not load is logged
    /// and leaves the API without tokens rather than stopping the daemon.
    pub fn of_state_dir(state_dir: Option<&Path>) -> Tokens {
        Tokens::load(state_dir).unwrap_or_else(|e| {
            tracing::error!("API tokens: {e}; no token is accepted until it is mended");
            Tokens {
                path: None,
                records: Mutex::new(Vec::new()),
                broken: Some(e.to_string()),
            }
        })
    }

    /// The tokens kept in `state_dir` (none yet when it holds no file).
    pub fn load(state_dir: Option<&Path>) -> Result<Tokens, TokenError> {
        let path = state_dir.map(|d| d.join("api-tokens.json"));
        let unreadable = |path: &Path, reason: String| TokenError::Unreadable {
            path: path.to_path_buf(),
            reason,
        };
        let records = match &path {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => serde_json::from_str(&text)
                    .map_err(|e| unreadable(path, format!("not a token file: {e}")))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(unreadable(path, e.to_string())),
            },
            None => Vec::new(),
        };
        Ok(Tokens {
            path,
            records: Mutex::new(records),
            broken: None,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Record>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes a token named `name` with `role`: the token itself, shown once.
    pub fn create(&self, name: &str, role: Role) -> Result<String, TokenError> {
        check_name(name)?;
        let mut records = self.lock();
        if records.iter().any(|r| r.name == name) {
            return Err(TokenError::Conflict(format!(
                "a token named {name:?} exists (revoke it first)"
            )));
        }
        if records.len() >= TOKENS_MAX {
            return Err(TokenError::Conflict(format!(
                "{TOKENS_MAX} tokens exist: revoke one first"
            )));
        }
        let mut secret = [0u8; TOKEN_BYTES];
        openssl::rand::rand_bytes(&mut secret)
            .map_err(|e| TokenError::BadRequest(format!("no randomness to make a token: {e}")))?;
        let token = format!("{PREFIX}{}", hex(&secret));
        let mut next = records.clone();
        next.push(Record {
            name: name.to_string(),
            role,
            sha256: hex(&openssl::sha::sha256(token.as_bytes())),
            created: now_s(),
        });
        self.store(&next)?;
        *records = next;
        Ok(token)
    }

    /// Revokes the token named `name`: refused from the next request on.
    pub fn revoke(&self, name: &str) -> Result<(), TokenError> {
        let mut records = self.lock();
        let Some(at) = records.iter().position(|r| r.name == name) else {
            return Err(TokenError::NotFound(format!("no token named {name:?}")));
        };
        let mut next = records.clone();
        next.remove(at);
        self.store(&next)?;
        *records = next;
        Ok(())
    }

    /// Every token's name, role and creation time (never the token).
    pub fn list(&self) -> Value {
        let rows: Vec<Value> = self
            .lock()
            .iter()
            .map(|r| json!({ "name": r.name, "role": r.role.name(), "created": r.created }))
            .collect();
        json!({ "tokens": rows })
    }

    /// Who `presented` is, if it is a token of this daemon. Its hash is compared with every
    /// token's in constant time, so the time taken tells nothing of how close a guess was.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        if !presented.starts_with(PREFIX) || presented.len() > PREFIX.len() + 2 * TOKEN_BYTES {
            return None;
        }
        let hash = hex(&openssl::sha::sha256(presented.as_bytes()));
        let records = self.lock();
        let mut found = None;
        for r in records.iter() {
            let same = r.sha256.len() == hash.len()
                && openssl::memcmp::eq(r.sha256.as_bytes(), hash.as_bytes());
            if same {
                found = Some(Caller {
                    name: r.name.clone(),
                    role: r.role,
                });
            }
        }
        found
    }

    /// The caller named `name`, if a token of that name exists: who a verified client
    /// certificate with that common name is (revoking the token stops it too).
    pub fn named(&self, name: &str) -> Option<Caller> {
        let records = self.lock();
        let record = records.iter().find(|r| r.name == name)?;
        Some(Caller {
            name: record.name.clone(),
            role: record.role,
        })
    }

    /// Writes `records` whole (temporary file, rename), readable by the daemon's user only.
    fn store(&self, records: &[Record]) -> Result<(), TokenError> {
        if let Some(broken) = &self.broken {
            return Err(TokenError::Conflict(format!(
                "the token file is broken: {broken}"
            )));
        }
        let Some(path) = &self.path else {
            return Err(TokenError::Conflict(
                "no state directory to keep tokens in ([server] state_dir)".into(),
            ));
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| TokenError::Conflict(format!("{}: {e}", dir.display())))?;
        }
        let text = serde_json::to_string_pretty(records).unwrap_or_default();
        crate::config::edit::write_atomically(path, &text, true)
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt as _;
                let owner_only = std::fs::Permissions::from_mode(0o600);
                std::fs::set_permissions(path, owner_only).map_err(|e| (path.clone(), e))
            })
            .map_err(|(at, e)| {
                TokenError::Conflict(format!("tokens not saved: {}: {e}", at.display()))
            })
    }
}

/// A token's name: what the audit log and `token list` show.
fn check_name(name: &str) -> Result<(), TokenError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    match ok {
        true => Ok(()),
        false => Err(TokenError::BadRequest(format!(
            "token name {name:?}: 1 to 64 letters, digits, '-', '_' or '.'"
        ))),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ferrosan-tokens-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_token_is_shown_once_kept_hashed_and_revoked_at_once() {
        let dir = dir("life");
        let tokens = Tokens::load(Some(&dir)).unwrap();
        let admin = tokens.create("ci", Role::Admin).unwrap();
        let reader = tokens.create("grafana", Role::Reader).unwrap();
        assert!(admin.starts_with(PREFIX) && admin.len() == PREFIX.len() + 64);
        let file = std::fs::read_to_string(dir.join("api-tokens.json")).unwrap();
        assert!(
            !file.contains(&admin[PREFIX.len()..]),
            "the token itself is never stored"
        );
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir.join("api-tokens.json"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let who = |t: &str| tokens.authenticate(t).map(|c| (c.name, c.role));
        assert_eq!(who(&admin), Some(("ci".into(), Role::Admin)));
        assert_eq!(who(&reader), Some(("grafana".into(), Role::Reader)));
        let mut wrong = admin.clone();
        wrong.pop();
        wrong.push('x');
        assert_eq!(who(&wrong), None);
        assert_eq!(who(""), None);
        // Kept across a restart; revoked, refused at once.
        let again = Tokens::load(Some(&dir)).unwrap();
        assert_eq!(
            again.authenticate(&reader).map(|c| c.role),
            Some(Role::Reader)
        );
        tokens.revoke("grafana").unwrap();
        assert_eq!(who(&reader), None);
        assert!(matches!(
            tokens.revoke("grafana"),
            Err(TokenError::NotFound(_))
        ));
        let listed = tokens.list().to_string();
        assert!(
            listed.contains("\"ci\"") && !listed.contains("grafana"),
            "{listed}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn names_are_unique_and_plain_and_tokens_are_bounded() {
        let dir = dir("names");
        let tokens = Tokens::load(Some(&dir)).unwrap();
        tokens.create("a", Role::Reader).unwrap();
        assert!(matches!(
            tokens.create("a", Role::Admin),
            Err(TokenError::Conflict(_))
        ));
        for bad in ["", "a b", "x/y", &"n".repeat(65)] {
            assert!(matches!(
                tokens.create(bad, Role::Admin),
                Err(TokenError::BadRequest(_))
            ));
        }
        for i in 1..TOKENS_MAX {
            tokens.create(&format!("t{i}"), Role::Reader).unwrap();
        }
        assert!(matches!(
            tokens.create("one-more", Role::Reader),
            Err(TokenError::Conflict(_))
        ));
        let none = Tokens::load(None).unwrap();
        assert!(matches!(
            none.create("a", Role::Admin),
            Err(TokenError::Conflict(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_reader_may_call_only_what_changes_nothing() {
        for verb in [
            "status",
            "sessions",
            "luns",
            "stats",
            "config",
            "volume-list",
            "snapshot-list",
            "pool-list",
        ] {
            assert!(Role::Reader.may(verb), "{verb}");
        }
        for verb in [
            "reload",
            "save",
            "lun-map",
            "volume-create",
            "device-take",
            "token-create",
            "token-list",
            "session-close",
        ] {
            assert!(!Role::Reader.may(verb), "{verb}");
            assert!(Role::Admin.may(verb), "{verb}");
        }
        assert!(
            !Role::Reader.may("no-such-verb"),
            "an unknown verb is not a reading one"
        );
    }
}
