//! `iscsi://` URLs as libiscsi (and so qemu) accept them:
//! `iscsi://[<user>[%<password>]@]<host>[:<port>]/<target-iqn>/<lun>` (IPv6 hosts in
//! brackets), or the portal form without `/<target-iqn>/<lun>` for discovery.
//!
//! Following libiscsi's `iscsi_parse_url` (lib/init.c): the user ends at the first `%` (or,
//! without one, the first `:`), the password is the rest up to the first `@`, and neither is
//! percent-decoded (libiscsi uses `%` as the separator, so it cannot decode them); the target
//! name is percent-decoded. CHAP applies only with both a user and a password. Query
//! arguments after `?`, `&`-separated: `target_user` and `target_password` (mutual CHAP, used
//! only with one-way credentials, as in libiscsi), `header_digest` and `data_digest`
//! (`crc32c` or `none`), `auth` (`md5`, `sha1`, `sha-256`, `sha3-256`: the one CHAP
//! algorithm offered); other arguments are ignored, as libiscsi ignores them.

use iscsi::chap::Algorithm;

use crate::config::{Auth, ChapConfig, ClientConfig, DigestChoice, SessionConfig, SessionKind};
use crate::error::Error;

/// A parsed `iscsi://` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IscsiUrl {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
    /// `None` for a portal URL.
    pub target: Option<String>,
    pub lun: u64,
    pub auth: Auth,
    /// A CHAP user named without a password (`iscsi://alice@host/...`): the secret is the
    /// caller's to supply ([`IscsiUrl::with_secret`]) from somewhere other than the URL.
    pub user_without_secret: Option<String>,
    pub header_digest: Option<DigestChoice>,
    pub data_digest: Option<DigestChoice>,
}

/// `url` without its secrets, for messages and reports: `user%password@` loses the password
/// and a query (`target_password=` …) is elided.
pub fn redact(url: &str) -> String {
    let Some(rest) = url.strip_prefix("iscsi://") else {
        return url.to_string();
    };
    let (rest, had_query) = match rest.split_once('?') {
        Some((r, _)) => (r, true),
        None => (rest, false),
    };
    let shown = match rest.split_once('@') {
        Some((user, host)) => format!("{}@{host}", user.split('%').next().unwrap_or("")),
        None => rest.to_string(),
    };
    format!("iscsi://{shown}{}", if had_query { "?…" } else { "" })
}

/// `<target-iqn>/<lun>`, the target percent-decoded.
fn target_and_lun(path: &str) -> Result<(Option<String>, u64), &'static str> {
    let (target, lun) = path.split_once('/').ok_or("no /<lun> after the target")?;
    if target.is_empty() {
        return Err("empty target name");
    }
    if lun.is_empty() || !lun.bytes().all(|b| b.is_ascii_digit()) {
        return Err("the LUN is not a number");
    }
    let lun: u64 = lun.parse().map_err(|_| "the LUN is too large")?;
    Ok((Some(percent_decode(target)), lun))
}

/// The URL's query: mutual CHAP, digests, the CHAP algorithm. Unknown keys are ignored.
#[derive(Default)]
struct Query {
    target_user: Option<String>,
    target_password: Option<String>,
    header_digest: Option<DigestChoice>,
    data_digest: Option<DigestChoice>,
    algorithm: Option<Algorithm>,
}

impl Query {
    fn parse(query: &str) -> Result<Query, &'static str> {
        let mut q = Query::default();
        let digest = |v: &str| match v {
            "crc32c" => Ok(DigestChoice::Crc32c),
            "none" => Ok(DigestChoice::None),
            _ => Err("header_digest/data_digest must be crc32c or none"),
        };
        for arg in query.split('&').filter(|a| !a.is_empty()) {
            let (key, value) = arg.split_once('=').unwrap_or((arg, ""));
            match key {
                "target_user" => q.target_user = Some(value.to_string()),
                "target_password" => q.target_password = Some(value.to_string()),
                "header_digest" => q.header_digest = Some(digest(value)?),
                "data_digest" => q.data_digest = Some(digest(value)?),
                "auth" => {
                    q.algorithm = Some(match value {
                        "md5" => Algorithm::Md5,
                        "sha1" => Algorithm::Sha1,
                        "sha-256" => Algorithm::Sha256,
                        "sha3-256" => Algorithm::Sha3_256,
                        _ => return Err("auth must be md5, sha1, sha-256 or sha3-256"),
                    })
                }
                _ => {}
            }
        }
        Ok(q)
    }
}

impl IscsiUrl {
    /// Parses a full URL (target and LUN) or a portal URL (`iscsi://host[:port][/]`).
    pub fn parse(url: &str) -> Result<IscsiUrl, Error> {
        // Errors end up in logs and reports: never with the password.
        let shown = redact(url);
        let bad = |why: &str| {
            Error::Url(format!("{why} in {shown:?}; the form is iscsi://[<user>[%<password>]@]<host>[:<port>]/<target-iqn>/<lun>"))
        };
        let rest = url
            .strip_prefix("iscsi://")
            .ok_or_else(|| bad("no iscsi:// prefix"))?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (userinfo, rest) = match rest.split_once('@') {
            Some((u, r)) => (Some(u), r),
            None => (None, rest),
        };
        let (portal, path) = match rest.split_once('/') {
            Some((p, path)) => (p, Some(path)),
            None => (rest, None),
        };
        let (host, port) = split_host_port(portal).ok_or_else(|| bad("bad host or port"))?;
        let (target, lun) = match path {
            None | Some("") => (None, 0),
            Some(path) => target_and_lun(path).map_err(&bad)?,
        };
        let (user, password) = match userinfo.map(|u| (u, u.find('%').or_else(|| u.find(':')))) {
            Some((u, Some(i))) => (
                u.get(..i).map(str::to_string),
                u.get(i + 1..).map(str::to_string),
            ),
            Some((u, None)) => (Some(u.to_string()), None),
            None => (None, None),
        };
        let q = Query::parse(query.unwrap_or("")).map_err(&bad)?;
        let nonempty = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        let user_without_secret = user.clone().filter(|_| !nonempty(&password));
        let auth = if nonempty(&user) && nonempty(&password) {
            let mut chap = ChapConfig::new(
                user.unwrap_or_default(),
                password.unwrap_or_default().into_bytes(),
            );
            if nonempty(&q.target_user) && nonempty(&q.target_password) {
                chap = chap.with_mutual(
                    q.target_user.unwrap_or_default(),
                    q.target_password.unwrap_or_default().into_bytes(),
                );
            }
            if let Some(a) = q.algorithm {
                chap.algorithms = vec![a];
            }
            Auth::Chap(chap)
        } else {
            Auth::None
        };
        Ok(IscsiUrl {
            host,
            port,
            target,
            lun,
            auth,
            user_without_secret: user_without_secret.filter(|u| !u.is_empty()),
            header_digest: q.header_digest,
            data_digest: q.data_digest,
        })
    }

    /// One-way CHAP as the URL's user with `secret` (given apart from the URL, so it shows in
    /// no process list); the URL unchanged when it names no user or already has a password.
    pub fn with_secret(mut self, secret: &[u8]) -> IscsiUrl {
        if let Some(user) = self.user_without_secret.take() {
            self.auth = Auth::Chap(ChapConfig::new(user, secret.to_vec()));
        }
        self
    }

    /// `host:port`, IPv6 in brackets.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// A driver configuration for this URL (a discovery session for a portal URL), with a
    /// random ISID.
    pub fn client_config(&self, initiator_name: &str) -> ClientConfig {
        let kind = match &self.target {
            Some(t) => SessionKind::Normal {
                target_name: t.clone(),
            },
            None => SessionKind::Discovery,
        };
        let mut session = SessionConfig::new(initiator_name, kind);
        session.auth = self.auth.clone();
        if let Some(d) = self.header_digest {
            session.header_digest = d;
        }
        if let Some(d) = self.data_digest {
            session.data_digest = d;
        }
        let mut config = ClientConfig::new(self.address(), session);
        config.lun = self.lun;
        config
    }
}

fn split_host_port(portal: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(v6) = portal.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (host, port)
    } else {
        match portal.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (portal, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0)?,
        None => 3260,
    };
    Some((host.to_string(), port))
}

/// `%XX` escapes decoded (invalid escapes are kept as they are).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let hex = |x: u8| (x as char).to_digit(16);
        match (
            c,
            b.get(i + 1).and_then(|&x| hex(x)),
            b.get(i + 2).and_then(|&x| hex(x)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chap(u: &IscsiUrl) -> &ChapConfig {
        match &u.auth {
            Auth::Chap(c) => c,
            Auth::None => panic!("no CHAP in {u:?}"),
        }
    }

    #[test]
    fn full_urls() {
        let u = IscsiUrl::parse("iscsi://10.0.0.1/iqn.2024-01.x:t/3").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.lun), ("10.0.0.1", 3260, 3));
        assert_eq!(u.target.as_deref(), Some("iqn.2024-01.x:t"));
        assert_eq!(u.auth, Auth::None);
        assert_eq!(u.address(), "10.0.0.1:3260");
        let u = IscsiUrl::parse("iscsi://[2001:db8::1]:3261/iqn.x:y/0").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("2001:db8::1", 3261));
        assert_eq!(u.address(), "[2001:db8::1]:3261");
        let u = IscsiUrl::parse("iscsi://host.example:860/iqn.a%3Ab/1").unwrap();
        assert_eq!(u.target.as_deref(), Some("iqn.a:b"));
        assert_eq!(u.port, 860);
    }

    #[test]
    fn credentials_like_libiscsi() {
        let u = IscsiUrl::parse("iscsi://alice%s3cr%41t@h/iqn.x:t/0").unwrap();
        let c = chap(&u);
        assert_eq!(c.user, "alice");
        // Not percent-decoded: libiscsi passes the password on as written.
        assert_eq!(c.secret.expose(), b"s3cr%41t");
        assert!(c.mutual.is_none());
        assert_eq!(c.algorithms[0], Algorithm::Md5);
        let u = IscsiUrl::parse("iscsi://bob:pw@h:3260/iqn.x:t/0").unwrap();
        assert_eq!(chap(&u).secret.expose(), b"pw");
        // A user without a password: no CHAP (libiscsi needs both).
        assert_eq!(
            IscsiUrl::parse("iscsi://bob@h/iqn.x:t/0").unwrap().auth,
            Auth::None
        );
        let u = IscsiUrl::parse(
            "iscsi://a%b@h/iqn.x:t/0?target_user=tgt&target_password=tsecret&header_digest=crc32c&auth=sha-256&other=1",
        )
        .unwrap();
        let c = chap(&u);
        let m = c.mutual.as_ref().expect("mutual");
        assert_eq!(
            (m.user.as_str(), m.secret.expose()),
            ("tgt", &b"tsecret"[..])
        );
        assert_eq!(c.algorithms, vec![Algorithm::Sha256]);
        assert_eq!(u.header_digest, Some(DigestChoice::Crc32c));
        // Mutual credentials without one-way ones are ignored, as in libiscsi.
        let u = IscsiUrl::parse("iscsi://h/iqn.x:t/0?target_user=t&target_password=p").unwrap();
        assert_eq!(u.auth, Auth::None);
    }

    #[test]
    fn portal_urls_and_errors() {
        let u = IscsiUrl::parse("iscsi://h:3300").unwrap();
        assert_eq!((u.target.clone(), u.port), (None, 3300));
        assert_eq!(IscsiUrl::parse("iscsi://h/").unwrap().target, None);
        let cfg = u.client_config("iqn.x:i");
        assert_eq!(cfg.session.kind, SessionKind::Discovery);
        assert_eq!(cfg.session.isid[0] & 0xc0, 0x80);
        for bad in [
            "http://h/iqn.x/0",
            "iscsi://",
            "iscsi://h:0/iqn.x/0",
            "iscsi://h:99999/iqn.x/0",
            "iscsi://h:x/iqn.x/0",
            "iscsi://[::1/iqn.x/0",
            "iscsi://[::1]x/iqn.x/0",
            "iscsi://h/iqn.x",
            "iscsi://h/iqn.x/",
            "iscsi://h/iqn.x/-1",
            "iscsi://h//0",
            "iscsi://h/iqn.x/99999999999999999999999",
            "iscsi://h/iqn.x/0?header_digest=md5",
            "iscsi://h/iqn.x/0?auth=chap",
        ] {
            assert!(IscsiUrl::parse(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(percent_decode("a%zzb%4"), "a%zzb%4");
    }

    #[test]
    fn redaction_keeps_passwords_out_of_messages() {
        assert_eq!(
            redact("iscsi://bob%s3cret@10.0.0.1:3260/iqn.x:t/0"),
            "iscsi://bob@10.0.0.1:3260/iqn.x:t/0"
        );
        assert_eq!(
            redact("iscsi://bob%s3cret@[::1]/iqn.x:t/1?target_user=t&target_password=p"),
            "iscsi://bob@[::1]/iqn.x:t/1?…"
        );
        assert_eq!(
            redact("iscsi://127.0.0.1/iqn.x:t/0"),
            "iscsi://127.0.0.1/iqn.x:t/0"
        );
        assert_eq!(redact("/dev/sdb"), "/dev/sdb");
    }
}
