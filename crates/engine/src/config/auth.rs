//! Authentication and access-control keys of the config file: CHAP users and secrets
//! (inline or from a protected file), `auth` modes, and `allowed_sources` address ranges.

use std::fmt;
use std::net::IpAddr;
use std::ops::Range;
use std::path::PathBuf;

use iscsi::chap::{Secret, SECRET_BYTES_MAX, SECRET_BYTES_MIN, USER_BYTES_MAX};
use serde::Deserialize;
use toml::Spanned;

use super::cx::{Cx, Pos};
use super::{AuthConfig, AuthMode, ChapUser, Invalid};

type S<T> = Spanned<T>;

/// What [`super::Config::to_toml`] writes instead of an inline secret. Loading it is an error.
pub(crate) const REDACTED: &str = "<redacted>";
/// The largest secret file read, in bytes.
const SECRET_FILE_BYTES_MAX: u64 = 4096;

/// An address range, `ADDRESS/PREFIX` (a bare address is a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceNet {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl SourceNet {
    pub fn parse(text: &str) -> Result<SourceNet, Invalid> {
        let (addr_text, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr_text
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or ADDRESS/PREFIX range"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max && !p.starts_with('+') => n,
                _ => return Err(format!("prefix length of {text:?} must be 0..={max}").into()),
            },
        };
        let net = SourceNet { addr, prefix_len };
        if net.network() != addr {
            return Err(Invalid(format!(
                "{text:?} has host bits set: write {}/{prefix_len}",
                net.network()
            )));
        }
        Ok(net)
    }

    fn network(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        }
    }

    /// Whether `ip` is in the range. An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) matches
    /// IPv4 ranges as the IPv4 address it carries.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if ip.is_ipv4() != self.addr.is_ipv4() {
            return false;
        }
        SourceNet {
            addr: ip,
            prefix_len: self.prefix_len,
        }
        .network()
            == self.addr
    }
}

impl fmt::Display for SourceNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawChapUser {
    user: Option<S<String>>,
    secret: Option<S<String>>,
    secret_file: Option<S<String>>,
}

/// `[discovery]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDiscovery {
    pub(crate) auth: Option<S<String>>,
    pub(crate) users: Option<S<Vec<S<RawChapUser>>>>,
    pub(crate) mutual: Option<S<RawChapUser>>,
}

/// `[[target.credentials]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCredentials {
    pub(crate) initiator: Option<S<String>>,
    pub(crate) users: Option<S<Vec<S<RawChapUser>>>>,
    pub(crate) mutual: Option<S<RawChapUser>>,
}

/// The auth keys shared by `[discovery]`, `[[target]]` and `[[target.group]]` (borrowed from
/// each raw table: serde's `flatten` does not mix with `deny_unknown_fields` and spans).
pub(crate) struct RawAuth<'a> {
    pub(crate) auth: &'a Option<S<String>>,
    pub(crate) users: &'a Option<S<Vec<S<RawChapUser>>>>,
    pub(crate) mutual: &'a Option<S<RawChapUser>>,
}

/// Every secret seen, to refuse a mutual (target) secret equal to an initiator secret.
#[derive(Default)]
pub(crate) struct SecretBook {
    users: Vec<Secret>,
    mutual: Vec<(Secret, std::ops::Range<usize>, String)>,
}

impl SecretBook {
    /// RFC 7143 §12.1.3: a secret used to authenticate initiators must not authenticate a target.
    pub(crate) fn check(self, cx: &mut Cx<'_>) {
        for (secret, span, field) in &self.mutual {
            if self.users.iter().any(|u| u.ct_eq(secret)) {
                cx.err(
                    span.clone(),
                    field.clone(),
                    "the target's (mutual) secret equals an initiator secret: RFC 7143 forbids using one secret in both directions",
                );
            }
        }
    }
}

/// A CHAP user's secret: given inline or read from its file, with where it was given (for
/// errors) and the file's path as written. None after an error.
#[allow(clippy::type_complexity)]
fn user_secret(
    cx: &mut Cx<'_>,
    raw: &RawChapUser,
    span: &Range<usize>,
    field: &str,
) -> Option<(Vec<u8>, Option<PathBuf>, Range<usize>, String)> {
    match (&raw.secret, &raw.secret_file) {
        (Some(_), Some(f)) => {
            cx.err(
                f.span(),
                format!("{field}.secret_file"),
                "give `secret` or `secret_file`, not both",
            );
            None
        }
        (None, None) => {
            cx.err(
                span.clone(),
                format!("{field}.secret"),
                "missing: give `secret` or `secret_file`",
            );
            None
        }
        (Some(s), None) => {
            if s.get_ref() == REDACTED {
                cx.err(
                    s.span(),
                    format!("{field}.secret"),
                    "this secret was redacted when the config was written out: put the secret back or use `secret_file`",
                );
                return None;
            }
            Some((
                s.get_ref().as_bytes().to_vec(),
                None,
                s.span(),
                format!("{field}.secret"),
            ))
        }
        (None, Some(f)) => {
            // Kept as written (the file may be saved back); read where it points now.
            let path = PathBuf::from(f.get_ref());
            let resolved = match credential_path(f.get_ref()) {
                Ok(p) => p,
                Err(m) => {
                    cx.err(f.span(), format!("{field}.secret_file"), m);
                    return None;
                }
            };
            match read_secret_file(&resolved) {
                Ok(bytes) => Some((bytes, Some(path), f.span(), format!("{field}.secret_file"))),
                Err(m) => {
                    cx.err(f.span(), format!("{field}.secret_file"), m);
                    None
                }
            }
        }
    }
}

fn resolve_user(
    cx: &mut Cx<'_>,
    raw: &S<RawChapUser>,
    field: &str,
    book: &mut SecretBook,
    mutual: bool,
) -> Option<ChapUser> {
    let span = raw.span();
    let raw = raw.get_ref();
    let mut ok = true;
    let user = match &raw.user {
        None => {
            cx.err(span.clone(), format!("{field}.user"), "missing (required)");
            ok = false;
            String::new()
        }
        Some(u) => {
            let s = u.get_ref();
            if s.is_empty() || s.len() > USER_BYTES_MAX || s.chars().any(char::is_control) {
                cx.err(
                    u.span(),
                    format!("{field}.user"),
                    format!("must be 1 to {USER_BYTES_MAX} bytes without control characters"),
                );
                ok = false;
            }
            s.clone()
        }
    };
    let (secret, secret_file, secret_span, secret_field) = user_secret(cx, raw, &span, field)?;
    // The length rule is stated in bytes, never echoing the secret.
    if !(SECRET_BYTES_MIN..=SECRET_BYTES_MAX).contains(&secret.len()) {
        cx.err(
            secret_span.clone(),
            secret_field.clone(),
            format!(
                "must be {SECRET_BYTES_MIN} to {SECRET_BYTES_MAX} bytes, got {} (RFC 7143 §12.1.3: secrets under 96 bits need IPsec, which ferrosan does not provide)",
                secret.len()
            ),
        );
        ok = false;
    }
    if let Err(bad) = dhchap_secret_ok(&user, &secret, mutual) {
        cx.err(secret_span.clone(), secret_field.clone(), bad.to_string());
        ok = false;
    }
    let secret = Secret::new(secret);
    if mutual {
        book.mutual
            .push((secret.clone(), secret_span, secret_field));
    } else {
        book.users.push(secret.clone());
    }
    ok.then_some(ChapUser {
        user,
        secret,
        secret_file,
    })
}

/// A user named by an NQN is an NVMe host: its secret must be a DH-HMAC-CHAP one (`DHHC-1:`,
/// as `nvme gen-dhchap-key` writes it). A mutual secret written in that form is the NVMe
/// controller's key, so it must be a valid one too. The reason never echoes the secret.
fn dhchap_secret_ok(user: &str, secret: &[u8], mutual: bool) -> Result<(), BadDhchapSecret> {
    let text = std::str::from_utf8(secret).unwrap_or("");
    let nvme_host = !mutual
        && user
            .get(..4)
            .is_some_and(|p| p.eq_ignore_ascii_case("nqn."));
    if !nvme_host && !nvme::auth::Key::looks_like(text) {
        return Ok(());
    }
    nvme::auth::Key::parse(text)
        .map(drop)
        .map_err(|why| BadDhchapSecret { nvme_host, why })
}

/// A secret that should be, and is not, a valid DH-HMAC-CHAP secret.
#[derive(Debug)]
struct BadDhchapSecret {
    /// Its user is an NVMe host's NQN (rather than the secret looking like one).
    nvme_host: bool,
    why: nvme::auth::KeyError,
}

impl std::fmt::Display for BadDhchapSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nvme_host {
            f.write_str(
                "the user is an NVMe host NQN, so its secret must be a DH-HMAC-CHAP secret: ",
            )?;
        }
        write!(f, "{}", self.why)
    }
}

/// Reads a secret file: a regular file not readable or writable by group or others, at most
/// 4 KiB; one trailing newline (`\n` or `\r\n`) is not part of the secret.
/// Where a `secret_file` is: as written, or under systemd's credentials directory when it
/// starts with `$CREDENTIALS_DIRECTORY/` (the unit's `LoadCredential=NAME:/path` puts the secret
/// there, readable by the service alone, for `secret_file = "$CREDENTIALS_DIRECTORY/NAME"`).
pub fn credential_path(written: &str) -> Result<PathBuf, Invalid> {
    super::names::check_path_text(written)?;
    credential_path_in(
        written,
        std::env::var_os("CREDENTIALS_DIRECTORY").as_deref(),
    )
}

/// [`credential_path`] with the credentials directory given.
fn credential_path_in(
    written: &str,
    credentials: Option<&std::ffi::OsStr>,
) -> Result<PathBuf, Invalid> {
    let Some(name) = ["$CREDENTIALS_DIRECTORY/", "${CREDENTIALS_DIRECTORY}/"]
        .iter()
        .find_map(|p| written.strip_prefix(p))
    else {
        return Ok(PathBuf::from(written));
    };
    let dir = credentials.ok_or(
        "$CREDENTIALS_DIRECTORY is not set: systemd sets it for a unit with LoadCredential= \
         (outside systemd, give the file's path)",
    )?;
    if name.is_empty() || name.contains('/') {
        return Err(Invalid(format!(
            "{written}: name one credential (LoadCredential=NAME:...), no sub-directories"
        )));
    }
    Ok(PathBuf::from(dir).join(name))
}

fn read_secret_file(path: &std::path::Path) -> Result<Vec<u8>, Invalid> {
    use std::io::Read as _;
    use std::os::unix::fs::PermissionsExt as _;
    let meta =
        std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(Invalid(format!("{} is not a regular file", path.display())));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Invalid(format!(
            "{} is accessible by group or others (mode {mode:04o}): chmod 600 it",
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(SECRET_FILE_BYTES_MAX + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > SECRET_FILE_BYTES_MAX {
        return Err(Invalid(format!(
            "{} is larger than {SECRET_FILE_BYTES_MAX} bytes",
            path.display()
        )));
    }
    if bytes.ends_with(b"\r\n") {
        bytes.truncate(bytes.len() - 2);
    } else if bytes.ends_with(b"\n") {
        bytes.truncate(bytes.len() - 1);
    }
    Ok(bytes)
}

/// A `users = [...]` list.
pub(crate) fn resolve_users(
    cx: &mut Cx<'_>,
    raw: &Option<S<Vec<S<RawChapUser>>>>,
    ctx: &str,
    book: &mut SecretBook,
) -> Vec<ChapUser> {
    let mut users: Vec<ChapUser> = Vec::new();
    let Some(list) = raw else {
        return users;
    };
    for (i, u) in list.get_ref().iter().enumerate() {
        let field = format!("{ctx}: users[{i}]");
        if let Some(user) = resolve_user(cx, u, &field, book, false) {
            if users.iter().any(|x| x.user == user.user) {
                cx.err(
                    u.span(),
                    format!("{field}.user"),
                    format!("user {:?} is listed twice", user.user),
                );
                continue;
            }
            users.push(user);
        }
    }
    users
}

pub(crate) fn resolve_mutual(
    cx: &mut Cx<'_>,
    raw: &Option<S<RawChapUser>>,
    ctx: &str,
    book: &mut SecretBook,
) -> Option<ChapUser> {
    raw.as_ref()
        .and_then(|m| resolve_user(cx, m, &format!("{ctx}: mutual"), book, true))
}

/// One scope's `auth`, `users` and `mutual`. `inherited_users`: whether an enclosing scope has
/// users that `auth = "chap"` here may use.
pub(crate) fn resolve_auth(
    cx: &mut Cx<'_>,
    raw: &RawAuth<'_>,
    ctx: &str,
    table: &std::ops::Range<usize>,
    inherited_users: bool,
    book: &mut SecretBook,
) -> AuthConfig {
    let users = resolve_users(cx, raw.users, ctx, book);
    let mutual = resolve_mutual(cx, raw.mutual, ctx, book);
    let mode = raw.auth.as_ref().and_then(|a| match a.get_ref().as_str() {
        "none" => Some(AuthMode::None),
        "chap" => Some(AuthMode::Chap),
        other => {
            cx.err(
                a.span(),
                format!("{ctx}: auth"),
                format!("must be \"none\" or \"chap\", got {other:?}"),
            );
            None
        }
    });
    let has_users = raw.users.as_ref().is_some_and(|u| !u.get_ref().is_empty());
    let here = raw.auth.as_ref().map_or(table.clone(), |a| a.span());
    match mode {
        Some(AuthMode::Chap) if !has_users && !inherited_users => cx.err(
            here,
            format!("{ctx}: users"),
            "auth = \"chap\" needs `users` here or in an enclosing section",
        ),
        Some(AuthMode::None) if has_users || raw.mutual.is_some() => cx.err(
            here,
            format!("{ctx}: auth"),
            "auth = \"none\" together with CHAP `users` or `mutual`: remove one",
        ),
        _ => {}
    }
    if mode.is_none() && !has_users && raw.mutual.is_some() && !inherited_users {
        cx.err(
            raw.mutual.as_ref().map_or(table.clone(), |m| m.span()),
            format!("{ctx}: mutual"),
            "mutual CHAP without CHAP `users`: the target authenticates itself only after the initiator did",
        );
    }
    AuthConfig {
        mode,
        users,
        mutual,
    }
}

/// TOML of one CHAP user: the secret is never written; an inline one becomes [`REDACTED`].
pub(crate) fn user_toml(u: &ChapUser, reveal: bool) -> String {
    let q = |s: &str| toml::Value::String(s.to_string()).to_string();
    match &u.secret_file {
        Some(p) => format!(
            "{{ user = {}, secret_file = {} }}",
            q(&u.user),
            q(&p.to_string_lossy())
        ),
        None if reveal => format!(
            "{{ user = {}, secret = {} }}",
            q(&u.user),
            q(&String::from_utf8_lossy(u.secret.expose()))
        ),
        None => format!("{{ user = {}, secret = {} }}", q(&u.user), q(REDACTED)),
    }
}

/// The raw tables of a config made in memory from a [`super::Config`], as reading back
/// `to_toml_with_secrets` would give them (`super::file::RawFile::of`).
impl RawChapUser {
    /// `{ user, secret_file }`, or `{ user, secret }` (the secret as the text would hold it).
    fn of(u: &ChapUser, pos: &mut Pos) -> RawChapUser {
        let user = Some(pos.s(u.user.clone()));
        match &u.secret_file {
            Some(p) => RawChapUser {
                user,
                secret: None,
                secret_file: Some(pos.s(p.to_string_lossy().into_owned())),
            },
            None => RawChapUser {
                user,
                secret: Some(pos.s(String::from_utf8_lossy(u.secret.expose()).into_owned())),
                secret_file: None,
            },
        }
    }
}

/// The `auth`, `users` and `mutual` of one scope, as [`auth_toml`] writes them.
#[allow(clippy::type_complexity)]
pub(crate) fn raw_auth_of(
    a: &AuthConfig,
    pos: &mut Pos,
) -> (
    Option<S<String>>,
    Option<S<Vec<S<RawChapUser>>>>,
    Option<S<RawChapUser>>,
) {
    let auth = a.mode.map(|mode| {
        let m = match mode {
            AuthMode::None => "none",
            AuthMode::Chap => "chap",
        };
        pos.s(m.to_string())
    });
    let users = (!a.users.is_empty())
        .then(|| pos.list(&a.users, |pos, u| Some(RawChapUser::of(u, pos))))
        .flatten();
    let mutual = a.mutual.as_ref().map(|m| {
        let at = pos.next();
        Spanned::new(at, RawChapUser::of(m, pos))
    });
    (auth, users, mutual)
}

impl RawDiscovery {
    pub(crate) fn of(a: &AuthConfig, pos: &mut Pos) -> RawDiscovery {
        let (auth, users, mutual) = raw_auth_of(a, pos);
        RawDiscovery {
            auth,
            users,
            mutual,
        }
    }
}

impl RawCredentials {
    pub(crate) fn of(c: &super::InitiatorCredentials, pos: &mut Pos) -> RawCredentials {
        let initiator = Some(pos.s(c.initiator.as_str().to_string()));
        let users = pos.list(&c.users, |pos, u| Some(RawChapUser::of(u, pos)));
        let mutual = c.mutual.as_ref().map(|m| {
            let at = pos.next();
            Spanned::new(at, RawChapUser::of(m, pos))
        });
        RawCredentials {
            initiator,
            users,
            mutual,
        }
    }
}

impl RawTlsKey {
    pub(crate) fn of(k: &super::TlsKey, pos: &mut Pos) -> RawTlsKey {
        RawTlsKey {
            host: Some(pos.s(k.host.as_str().to_string())),
            key_file: Some(pos.s(k.key_file.clone())),
            derivation: Some(pos.s(k.derivation.name().to_string())),
        }
    }
}

/// The `auth`, `users`, `mutual` lines of one scope, each prefixed with `indent`.
pub(crate) fn auth_toml(a: &AuthConfig, indent: &str, reveal: bool) -> String {
    let mut out = String::new();
    if let Some(mode) = a.mode {
        let m = match mode {
            AuthMode::None => "none",
            AuthMode::Chap => "chap",
        };
        out.push_str(&format!("{indent}auth = \"{m}\"\n"));
    }
    if !a.users.is_empty() {
        let users: Vec<String> = a.users.iter().map(|u| user_toml(u, reveal)).collect();
        out.push_str(&format!("{indent}users = [{}]\n", users.join(", ")));
    }
    if let Some(m) = &a.mutual {
        out.push_str(&format!("{indent}mutual = {}\n", user_toml(m, reveal)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_nets_parse_and_match() {
        let n = SourceNet::parse("10.0.0.0/8").unwrap();
        assert!(n.contains("10.1.2.3".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        assert!(n.contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(!n.contains("::1".parse().unwrap()));
        let h = SourceNet::parse("127.0.0.1").unwrap();
        assert_eq!(h.prefix_len, 32);
        assert!(h.contains("127.0.0.1".parse().unwrap()));
        assert!(!h.contains("127.0.0.2".parse().unwrap()));
        let all = SourceNet::parse("0.0.0.0/0").unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        let v6 = SourceNet::parse("2001:db8::/32").unwrap();
        assert!(v6.contains("2001:db8:1::5".parse().unwrap()));
        assert!(!v6.contains("2001:db9::5".parse().unwrap()));
        assert!(SourceNet::parse("::1/128")
            .unwrap()
            .contains("::1".parse().unwrap()));
        assert_eq!(v6.to_string(), "2001:db8::/32");
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "10.0.0.0/",
            "host",
            "::/129",
            "1.2.3.4/+8",
        ] {
            assert!(SourceNet::parse(bad).is_err(), "{bad}");
        }
    }
}

/// One entry of a target's `tls_keys`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTlsKey {
    host: Option<S<String>>,
    key_file: Option<S<String>>,
    derivation: Option<S<String>>,
}

/// A target's `tls_keys`: each an NVMe host NQN (once), its configured PSK read from a
/// protected file (`NVMeTLSkey-1:` form), and how its host derives the TLS PSK.
pub(super) fn resolve_tls_keys(
    cx: &mut Cx<'_>,
    raw: &Option<S<Vec<S<RawTlsKey>>>>,
    ctx: &str,
) -> Vec<super::TlsKey> {
    let mut out: Vec<super::TlsKey> = Vec::new();
    let Some(list) = raw else {
        return out;
    };
    for (i, entry) in list.get_ref().iter().enumerate() {
        let table = entry.span();
        let entry = entry.get_ref();
        let field = format!("{ctx}: tls_keys #{}", i + 1);
        let host = super::cx::required(cx, &entry.host, &table, format!("{field}: host"))
            .and_then(|h| tls_host(cx, h, &field, &out));
        let key = super::cx::required(cx, &entry.key_file, &table, format!("{field}: key_file"))
            .and_then(|f| tls_key_file(cx, f, &field));
        let derivation = match &entry.derivation {
            None => Some(nvme::tls::Derivation::default()),
            Some(d) => nvme::tls::Derivation::from_name(d.get_ref()).or_else(|| {
                cx.err(
                    d.span(),
                    format!("{field}: derivation"),
                    "must be \"spec\" or \"libnvme-1.15\" (the form nvme-cli with libnvme 1.15 or older inserts)",
                );
                None
            }),
        };
        if let (Some(host), Some((key, key_file)), Some(derivation)) = (host, key, derivation) {
            out.push(super::TlsKey {
                host,
                key: std::sync::Arc::new(key),
                derivation,
                key_file,
            });
        }
    }
    out
}

fn tls_host(
    cx: &mut Cx<'_>,
    h: &S<String>,
    field: &str,
    seen: &[super::TlsKey],
) -> Option<super::NodeName> {
    let err = |cx: &mut Cx<'_>, m: &str| cx.err(h.span(), format!("{field}: host"), m.to_string());
    match super::names::check_iscsi_name(h.get_ref()) {
        Ok(name) if !name.is_nqn() => err(cx, "must be an NVMe host NQN (nqn.…)"),
        Ok(name) if seen.iter().any(|k| k.host == name) => {
            err(cx, "this host already has a TLS key in this target")
        }
        Ok(name) => return Some(name),
        Err(m) => err(cx, &m.to_string()),
    }
    None
}

fn tls_key_file(
    cx: &mut Cx<'_>,
    f: &S<String>,
    field: &str,
) -> Option<(nvme::tls::ConfiguredKey, String)> {
    let read = credential_path(f.get_ref()).and_then(|p| read_secret_file(&p));
    let parsed = read.and_then(|mut bytes| {
        let text = String::from_utf8(std::mem::take(&mut bytes)).unwrap_or_default();
        let key = nvme::tls::ConfiguredKey::parse(&text).map_err(|e| Invalid(e.to_string()));
        let mut text = text.into_bytes();
        text.fill(0);
        key
    });
    match parsed {
        Ok(key) => Some((key, f.get_ref().clone())),
        Err(m) => {
            cx.err(f.span(), format!("{field}: key_file"), m.to_string());
            None
        }
    }
}
