//! Who a session is and what it may touch: the one admission decision.
//!
//! A login asks [`Topology::admit`]; a discovery session's SendTargets asks
//! [`Topology::member`] for every target it might list; and a running session asks
//! [`Topology::readmit`] each time the topology changes (a reload, any `ctl` verb). All three
//! are the same lookup, so a change can never give a session what a fresh login under the
//! same name and proof would be refused: a session whose answer changed is closed, never moved
//! silently (docs/SECURITY.md, finding 8).

pub mod controllers;
pub mod doors;
pub mod prelogin;
pub mod registry;
pub mod tokens;

use std::net::IpAddr;

use crate::config::{NodeName, ResolvedAuth, Secret};
use crate::topology::{Membership, Topology};

/// The transport a session came through: an iSCSI login names a target by its iSCSI name, an
/// NVMe/TCP Connect by its NQN; each finds the target only under its own kind of name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Door {
    Iscsi,
    Nvme,
}

impl Door {
    /// Whether its nexuses get SCSI unit attentions: NVMe has none (a host learns the same
    /// from Asynchronous Events and command status, docs/NVME.md).
    pub fn gives_unit_attentions(self) -> bool {
        matches!(self, Door::Iscsi)
    }
}

/// Why an initiator may not (or may no longer) be in a session with a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such target (Login Response 0x0203).
    NoSuchTarget,
    /// The target is not served through this portal group (to the initiator: no such target
    /// here, 0x0203). A running session through a portal group a reload removed is asked to
    /// log out rather than cut off: the target is still there, elsewhere.
    NotOnThisPortal,
    /// The initiator is in no group and the target has no `any_initiator` group (0x0202).
    NotInAnyGroup,
    /// The source address is outside `allowed_sources` (0x0202).
    SourceNotAllowed,
    /// A running session's initiator now belongs to another group than the one it logged in
    /// to: its LUN numbering and its group's authentication are another group's.
    GroupChanged,
    /// A running session's login proof no longer meets its group's authentication (CHAP now
    /// required, its CHAP user removed, or that user's secret changed).
    AuthChanged,
    /// The host has a TLS key for the subsystem and came without TLS or with another key, or
    /// came over TLS under another host's or subsystem's identity (Connect: Invalid Host).
    Tls,
}

impl Refusal {
    /// For the log line and the `reason` label of `ferrosan_sessions_closed_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::NoSuchTarget => "target_gone",
            Refusal::NotOnThisPortal => "portal_gone",
            Refusal::NotInAnyGroup => "not_in_any_group",
            Refusal::SourceNotAllowed => "source_not_allowed",
            Refusal::GroupChanged => "group_changed",
            Refusal::AuthChanged => "authentication_changed",
            Refusal::Tls => "tls",
        }
    }
}

/// How a session proved who it is at login; every later requirement is held against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Proof {
    /// No authentication (AuthMethod=None).
    None,
    /// CHAP as `user`, with the secret the target held for that user at the time.
    Chap { user: String, secret: Secret },
}

impl Proof {
    /// The proof of a login that met `required` as `chap_user` (`None`: without CHAP).
    pub fn of_login(required: &ResolvedAuth, chap_user: Option<&str>) -> Proof {
        let (ResolvedAuth::Chap { users, .. }, Some(user)) = (required, chap_user) else {
            return Proof::None;
        };
        match users.iter().find(|u| u.user == user) {
            Some(u) => Proof::Chap {
                user: u.user.clone(),
                secret: u.secret.clone(),
            },
            // The login core accepts only users of `required`: no proof otherwise.
            None => Proof::None,
        }
    }

    /// Whether a login with this proof would meet `required`. The target's own (mutual)
    /// credential is not part of it: it is what the target proves to the initiator, and a
    /// change of it takes nothing from this session.
    pub fn meets(&self, required: &ResolvedAuth) -> bool {
        match (required, self) {
            (ResolvedAuth::None, _) => true,
            (ResolvedAuth::Chap { .. }, Proof::None) => false,
            (ResolvedAuth::Chap { users, .. }, Proof::Chap { user, secret }) => {
                users.iter().any(|u| u.user == *user && u.secret == *secret)
            }
        }
    }
}

/// What a session was admitted as, kept for its life.
#[derive(Clone, Debug)]
pub enum Admitted {
    /// A discovery session: only its proof (discovery's own authentication).
    Discovery { proof: Proof },
    /// A normal session: its target and group, and its proof.
    Normal {
        membership: Membership,
        /// The group's name: groups are matched by name across topologies (indices shift).
        group: String,
        proof: Proof,
    },
}

impl Admitted {
    /// A login's admission: `membership` (`None` for discovery) under `topology`, whose
    /// requirement `required` it met as `chap_user`.
    pub fn of_login(
        topology: &Topology,
        membership: Option<Membership>,
        required: &ResolvedAuth,
        chap_user: Option<&str>,
    ) -> Option<Admitted> {
        let proof = Proof::of_login(required, chap_user);
        let Some(membership) = membership else {
            return Some(Admitted::Discovery { proof });
        };
        Some(Admitted::Normal {
            membership,
            group: topology.group_name(membership)?.to_string(),
            proof,
        })
    }

    pub fn membership(&self) -> Option<Membership> {
        match self {
            Admitted::Discovery { .. } => None,
            Admitted::Normal { membership, .. } => Some(*membership),
        }
    }

    /// The CHAP user the login proved to be (`None`: it did not authenticate).
    pub fn chap_user(&self) -> Option<&str> {
        match self {
            Admitted::Discovery { proof } | Admitted::Normal { proof, .. } => match proof {
                Proof::Chap { user, .. } => Some(user),
                Proof::None => None,
            },
        }
    }
}

/// What an NVMe/TCP queue's TLS handshake proved: the host and subsystem its PSK identity
/// named, and the configured key (and derivation) the PSK came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsProof {
    pub host: String,
    pub subsystem: String,
    pub key: std::sync::Arc<nvme::tls::ConfiguredKey>,
    pub derivation: nvme::tls::Derivation,
}

/// Whether a queue that came with `tls` (None: in the clear) may be `host`'s queue to
/// `target`: a host with a TLS key for the subsystem comes over TLS with that key, and a TLS
/// queue is the queue of the host and subsystem its identity named.
fn tls_meets(
    target: &crate::config::TargetConfig,
    host: &NodeName,
    sub: &NodeName,
    tls: Option<&TlsProof>,
) -> bool {
    match (target.tls_key(host), tls) {
        (None, None) => true,
        (Some(k), Some(p)) => {
            *p.key == *k.key
                && p.derivation == k.derivation
                && host.as_str().eq_ignore_ascii_case(&p.host)
                && sub.as_str().eq_ignore_ascii_case(&p.subsystem)
        }
        _ => false,
    }
}

/// Where a running session stands: what [`Topology::readmit`] decides again.
pub struct Standing<'a> {
    pub door: Door,
    /// What the queue's TLS handshake proved (NVMe/TCP over TLS).
    pub tls: Option<&'a TlsProof>,
    pub initiator: &'a NodeName,
    /// `None` for a discovery session.
    pub target_name: Option<&'a NodeName>,
    pub portal_group_tag: u16,
    pub source: IpAddr,
}

impl Topology {
    /// Which group of target `index` `initiator`, coming from `source`, belongs to, and what
    /// authentication that requires. The one lookup behind a login, its session's life and
    /// discovery.
    pub fn member(
        &self,
        index: usize,
        initiator: &NodeName,
        source: IpAddr,
    ) -> Result<(Membership, ResolvedAuth), Refusal> {
        let target = self.targets.get(index).ok_or(Refusal::NoSuchTarget)?;
        let membership = self
            .membership(index, initiator)
            .ok_or(Refusal::NotInAnyGroup)?;
        let (group, _) = target
            .group(membership.group)
            .ok_or(Refusal::NotInAnyGroup)?;
        // A gateway peer's name is admitted only into its image's peer group (CHAP with the
        // image's secret): elsewhere, e.g. through an `any_initiator` group, it could pass
        // for a peer, whose commands skip reservation checks.
        if crate::io::peer::is_peer_name(initiator.as_str())
            && !group.initiators.iter().any(|i| i == initiator)
        {
            return Err(Refusal::NotInAnyGroup);
        }
        if !target.config.source_allowed(Some(group), source) {
            return Err(Refusal::SourceNotAllowed);
        }
        Ok((membership, target.config.auth_in(initiator, Some(group))))
    }

    /// Whether `initiator`, coming from `source` to the portal group `portal_group_tag` (over
    /// TLS with `tls`), may log in to `target_name`; if so, as which member and with what
    /// authentication. The session's LUN map comes from the same membership
    /// ([`Topology::group_of`]).
    pub fn admit(
        &self,
        door: Door,
        initiator: &NodeName,
        target_name: &NodeName,
        portal_group_tag: u16,
        source: IpAddr,
        tls: Option<&TlsProof>,
    ) -> Result<(Membership, ResolvedAuth), Refusal> {
        if target_name.is_nqn() != (door == Door::Nvme) {
            // An iSCSI login naming an NQN, or a Connect naming an IQN: no such target here.
            return Err(Refusal::NoSuchTarget);
        }
        let (index, target) = self.target(target_name).ok_or(Refusal::NoSuchTarget)?;
        if !target.portal_groups.contains(&portal_group_tag) {
            return Err(Refusal::NotOnThisPortal);
        }
        if !tls_meets(&target.config, initiator, target_name, tls) {
            return Err(Refusal::Tls);
        }
        self.member(index, initiator, source)
    }

    /// A running session, admitted as `before`, admitted again under this topology: the same
    /// decision as a login's, and then the same group and a proof that still meets what
    /// that group (or discovery) requires. `Ok`: the session's admission under this
    /// topology (its membership may have a new index). `Err`: the session must be closed.
    pub fn readmit(&self, session: &Standing<'_>, before: &Admitted) -> Result<Admitted, Refusal> {
        let (target_name, group_before, proof) = match (session.target_name, before) {
            (None, Admitted::Discovery { proof }) => {
                if !proof.meets(&self.config.discovery.resolved()) {
                    return Err(Refusal::AuthChanged);
                }
                return Ok(before.clone());
            }
            (Some(name), Admitted::Normal { group, proof, .. }) => (name, group, proof),
            // A session's kind never changes: an engine bug, refused rather than trusted.
            _ => {
                debug_assert!(false, "a session's standing and admission disagree");
                return Err(Refusal::NotInAnyGroup);
            }
        };
        let (membership, required) = self.admit(
            session.door,
            session.initiator,
            target_name,
            session.portal_group_tag,
            session.source,
            session.tls,
        )?;
        let group = self.group_name(membership).ok_or(Refusal::NotInAnyGroup)?;
        if group != group_before {
            return Err(Refusal::GroupChanged);
        }
        if !proof.meets(&required) {
            return Err(Refusal::AuthChanged);
        }
        Ok(Admitted::Normal {
            membership,
            group: group.to_string(),
            proof: proof.clone(),
        })
    }

    /// The name of a membership's group.
    pub fn group_name(&self, membership: Membership) -> Option<&str> {
        let target = self.targets.get(membership.target)?;
        Some(target.group(membership.group)?.0.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ChapUser;

    fn user(name: &str, secret: &str) -> ChapUser {
        ChapUser {
            user: name.into(),
            secret: Secret::new(secret.as_bytes()),
            secret_file: None,
        }
    }

    fn chap(users: &[ChapUser]) -> ResolvedAuth {
        ResolvedAuth::Chap {
            users: users.to_vec(),
            mutual: None,
        }
    }

    #[test]
    fn a_proof_meets_what_a_login_with_it_would_meet() {
        let alice = user("alice", "alice-secret-2026");
        let none = Proof::of_login(&ResolvedAuth::None, None);
        assert_eq!(none, Proof::None);
        assert!(none.meets(&ResolvedAuth::None));
        assert!(
            !none.meets(&chap(std::slice::from_ref(&alice))),
            "CHAP now required"
        );

        let proof = Proof::of_login(&chap(std::slice::from_ref(&alice)), Some("alice"));
        assert!(proof.meets(&chap(std::slice::from_ref(&alice))));
        assert!(proof.meets(&ResolvedAuth::None), "less required: still met");
        assert!(
            proof.meets(&chap(&[user("bob", "bob-secret-2026x"), alice.clone()])),
            "another user added beside it"
        );
        assert!(
            !proof.meets(&chap(&[user("bob", "bob-secret-2026x")])),
            "its user removed"
        );
        assert!(
            !proof.meets(&chap(&[user("alice", "rotated-secret-26")])),
            "its user's secret changed"
        );
        // The target's own credential is not the initiator's proof.
        let with_mutual = ResolvedAuth::Chap {
            users: vec![alice],
            mutual: Some(user("target", "target-secret-26")),
        };
        assert!(proof.meets(&with_mutual));
    }

    /// A target with an NQN whose host `HOST` must come over TLS with the key in `key_file`.
    fn tls_topology(key_file: &std::path::Path, derivation: &str) -> Topology {
        topology(&format!(
            r#"{PORTAL}nvme_listen = ["127.0.0.1:4420"]
[[target]]
iqn = "iqn.2026-11.test:t"
nqn = "nqn.2026-11.test:t"
tls_keys = [ {{ host = "nqn.2026-11.test:host", key_file = "{}", derivation = "{derivation}" }} ]
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = []
"#,
            key_file.display()
        ))
    }

    fn key_file(dir: &std::path::Path, name: &str, byte: u8) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let key = nvme::tls::ConfiguredKey::new(Some(nvme::tls::CipherHash::Sha256), &[byte; 32]);
        let path = dir.join(name);
        std::fs::write(&path, format!("{}\n", key.unwrap().encode())).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }

    #[test]
    fn a_host_with_a_tls_key_is_admitted_over_tls_with_that_key_only() {
        let dir = std::env::temp_dir().join(format!("ferrosan-tls-admit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (good, other) = (key_file(&dir, "good", 1), key_file(&dir, "other", 2));
        let t = tls_topology(&good, "spec");
        let name = |s: &str| NodeName::from_wire(s).unwrap();
        let (host, sub) = (name("nqn.2026-11.test:host"), name("nqn.2026-11.test:t"));
        let source = "127.0.0.1".parse().unwrap();
        let key = |t: &Topology| t.target(&sub).unwrap().1.config.tls_keys[0].key.clone();
        let proof = |host: &str, sub: &str, t: &Topology| TlsProof {
            host: host.into(),
            subsystem: sub.into(),
            key: key(t),
            derivation: nvme::tls::Derivation::Spec,
        };
        let admit = |t: &Topology, who: &NodeName, tls: Option<&TlsProof>| {
            t.admit(Door::Nvme, who, &sub, 1, source, tls).map(drop)
        };
        let good_proof = proof("nqn.2026-11.test:host", "nqn.2026-11.test:t", &t);
        assert_eq!(admit(&t, &host, Some(&good_proof)), Ok(()));
        assert_eq!(admit(&t, &host, None), Err(Refusal::Tls), "in the clear");
        // A TLS identity of another host or subsystem does not carry over.
        let elsewhere = proof("nqn.2026-11.test:host", "nqn.2026-11.test:other", &t);
        assert_eq!(admit(&t, &host, Some(&elsewhere)), Err(Refusal::Tls));
        let someone = name("nqn.2026-11.test:someone");
        assert_eq!(
            admit(&t, &someone, None),
            Ok(()),
            "a host without a key: in the clear"
        );
        assert_eq!(admit(&t, &someone, Some(&good_proof)), Err(Refusal::Tls));
        // The key changed, or its derivation: the old proof no longer meets it.
        let rotated = tls_topology(&other, "spec");
        assert_eq!(admit(&rotated, &host, Some(&good_proof)), Err(Refusal::Tls));
        let rederived = tls_topology(&good, "libnvme-1.15");
        assert_eq!(
            admit(&rederived, &host, Some(&good_proof)),
            Err(Refusal::Tls)
        );
        // A running controller that came over TLS is readmitted the same way.
        let standing = Standing {
            door: Door::Nvme,
            tls: Some(&good_proof),
            initiator: &host,
            target_name: Some(&sub),
            portal_group_tag: 1,
            source,
        };
        let (m, required) = t
            .admit(Door::Nvme, &host, &sub, 1, source, Some(&good_proof))
            .unwrap();
        let admitted = Admitted::of_login(&t, Some(m), &required, None).unwrap();
        assert!(t.readmit(&standing, &admitted).is_ok());
        assert_eq!(
            rotated.readmit(&standing, &admitted).err(),
            Some(Refusal::Tls)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A topology of `text` (groups without LUNs: no device needs opening).
    fn topology(text: &str) -> Topology {
        let config = crate::config::Config::from_toml_str(text, "test").unwrap();
        Topology::assemble(config, Default::default(), 1).unwrap()
    }

    const PORTAL: &str = "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n";

    fn groups(db2_in: &str, secure_auth: &str) -> String {
        format!(
            r#"{PORTAL}
[[target]]
iqn = "iqn.2026-11.test:t"
  [[target.group]]
  name = "open"
  any_initiator = true
  luns = []
  [[target.group]]
  name = "secure"
  initiators = [{db2_in}"iqn.2026-11.test:db3"]
  {secure_auth}
  luns = []
"#
        )
    }

    #[test]
    fn readmission_is_the_login_decision_then_the_same_group_and_proof() {
        let name = |s: &str| NodeName::from_wire(s).unwrap();
        let (db2, db3, target) = (
            name("iqn.2026-11.test:db2"),
            name("iqn.2026-11.test:db3"),
            name("iqn.2026-11.test:t"),
        );
        let chap = r#"auth = "chap"
  users = [ { user = "sec", secret = "secure-secret-2026" } ]"#;
        let before = topology(&groups("", chap));
        let source = "127.0.0.1".parse().unwrap();
        let standing = |initiator| Standing {
            door: Door::Iscsi,
            tls: None,
            initiator,
            target_name: Some(&target),
            portal_group_tag: 1,
            source,
        };
        let admitted = |t: &Topology, who: &NodeName, chap_user: Option<&str>| {
            let (membership, required) =
                t.admit(Door::Iscsi, who, &target, 1, source, None).unwrap();
            Admitted::of_login(t, Some(membership), &required, chap_user).unwrap()
        };
        let db2_open = admitted(&before, &db2, None);
        let db3_secure = admitted(&before, &db3, Some("sec"));
        // Nothing changed for them: both stay.
        let same = topology(&groups("", chap));
        assert!(same.readmit(&standing(&db2), &db2_open).is_ok());
        assert!(same.readmit(&standing(&db3), &db3_secure).is_ok());
        // db2 put into the CHAP group: another group now.
        let moved = topology(&groups("\"iqn.2026-11.test:db2\", ", chap));
        assert_eq!(
            moved.readmit(&standing(&db2), &db2_open).err(),
            Some(Refusal::GroupChanged)
        );
        // The CHAP group's user changed: db3's proof no longer meets it.
        let rotated = topology(&groups(
            "",
            r#"auth = "chap"
  users = [ { user = "sec", secret = "rotated-secret-26" } ]"#,
        ));
        assert_eq!(
            rotated.readmit(&standing(&db3), &db3_secure).err(),
            Some(Refusal::AuthChanged)
        );
        // A portal group the target no longer serves: as a login, no such target there.
        let elsewhere = Standing {
            portal_group_tag: 2,
            ..standing(&db3)
        };
        assert_eq!(
            same.readmit(&elsewhere, &db3_secure).err(),
            Some(Refusal::NotOnThisPortal)
        );
        // Discovery: CHAP now required for SendTargets closes an unauthenticated session.
        let discovery = Admitted::Discovery { proof: Proof::None };
        let open_discovery = Standing {
            target_name: None,
            ..standing(&db2)
        };
        assert!(same.readmit(&open_discovery, &discovery).is_ok());
        let guarded = topology(&format!(
            "{}\n[discovery]\nauth = \"chap\"\nusers = [ {{ user = \"d\", secret = \"discovery-secret-26\" }} ]\n",
            groups("", chap)
        ));
        assert_eq!(
            guarded.readmit(&open_discovery, &discovery).err(),
            Some(Refusal::AuthChanged)
        );
    }

    #[test]
    fn a_chap_user_the_requirement_does_not_hold_proves_nothing() {
        let proof = Proof::of_login(&chap(&[user("alice", "alice-secret-2026")]), Some("eve"));
        assert_eq!(proof, Proof::None);
        let proof = Proof::of_login(&ResolvedAuth::None, Some("alice"));
        assert_eq!(proof, Proof::None);
    }
}
