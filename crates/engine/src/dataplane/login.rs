//! A connection's login: the policy the iSCSI core asks (who may log in, with what proof,
//! to which group: `admission`), and what a completed login hands to the full feature phase
//! (the session, its nexus, its limits).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iscsi::login::{
    Admission, AuthRequirement, ChapRequirement, Established, LoginLimits, LoginPolicy,
    LoginStatus, SessionKey,
};
use iscsi::negotiation::{SessionType, TargetLimits};
use iscsi::session::{Session, SessionLimits};
use scsi::Nexus;

use super::closed::Closed;
use crate::admission::registry::{Full, SessionTicket};
use crate::admission::Admitted;
use crate::admission::Refusal;
use crate::config::NodeName;
use crate::config::ResolvedAuth;
use crate::shared::Shared;
use crate::topology::{GroupRuntime, Membership, Topology};

/// Largest single write (EDTL) accepted.
const WRITE_BYTES_MAX: u32 = 64 << 20;

/// The login policy of one connection: knows which portal it arrived on and from where.
pub(super) struct Policy<'a> {
    pub(super) shared: &'a Shared,
    pub(super) portal_group_tag: u16,
    pub(super) peer: SocketAddr,
    pub(super) ticket: Option<SessionTicket>,
    /// Admitted past its source's `max_connections_per_source`: a gateway peer's login only.
    pub(super) peer_only: bool,
    /// The group the initiator was admitted as (normal sessions) and the authentication that
    /// required, in the topology it was admitted under: its session's LUN map comes from
    /// this, not from a second lookup.
    /// `None` as the membership: a discovery session, with discovery's authentication.
    pub(super) admitted: Option<(Arc<Topology>, Option<Membership>, ResolvedAuth)>,
}

impl Policy<'_> {
    /// Refuses a login on a connection admitted for gateway peers only, unless it is a peer's,
    /// and every login from a source that failed too often lately (docs/CONFIG.md,
    /// `login_failures_max`).
    pub(super) fn check_source(&self, initiator_name: &NodeName) -> Result<(), LoginStatus> {
        // A connection past its source's limit is for a gateway peer only (admission/doors.rs).
        if self.peer_only && !crate::io::peer::is_peer_name(initiator_name.as_str()) {
            tracing::warn!(
                peer = %self.peer,
                initiator = %initiator_name,
                "login refused: max_connections_per_source"
            );
            self.shared.metrics.limit("max_connections_per_source");
            return Err(LoginStatus::OUT_OF_RESOURCES);
        }
        if self
            .shared
            .doors
            .login_blocked(self.peer.ip(), Instant::now())
        {
            tracing::warn!(
                peer = %self.peer,
                initiator = %initiator_name,
                "login refused: too many failed logins from this address"
            );
            self.shared.metrics.limit("login_failures_max");
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        Ok(())
    }

    pub(super) fn requirement(&self, auth: ResolvedAuth) -> AuthRequirement {
        match auth {
            ResolvedAuth::None => AuthRequirement::None,
            ResolvedAuth::Chap { users, mutual } => AuthRequirement::Chap(ChapRequirement {
                users: users.iter().map(|u| u.credential()).collect(),
                mutual: mutual.map(|m| m.credential()),
                algorithms: self.shared.chap_algorithms.clone(),
            }),
        }
    }
}

impl LoginPolicy for Policy<'_> {
    fn admit(
        &mut self,
        initiator_name: &NodeName,
        target_name: &NodeName,
    ) -> Result<Admission, LoginStatus> {
        self.check_source(initiator_name)?;
        let topology = self.shared.topology();
        let admitted = topology.admit(
            crate::admission::Door::Iscsi,
            initiator_name,
            target_name,
            self.portal_group_tag,
            self.peer.ip(),
            None,
        );
        let (membership, auth) = match admitted {
            Ok(admitted) => admitted,
            Err(Refusal::NoSuchTarget | Refusal::NotOnThisPortal) => {
                return Err(LoginStatus::NOT_FOUND)
            }
            Err(refusal) => {
                let why = match refusal {
                    Refusal::SourceNotAllowed => "source address not in allowed_sources",
                    _ => "initiator not in any group",
                };
                tracing::warn!(
                    peer = %self.peer,
                    initiator = %initiator_name,
                    target = %target_name,
                    "login refused: {why}"
                );
                return Err(LoginStatus::FORBIDDEN);
            }
        };
        let alias = topology
            .targets
            .get(membership.target)
            .and_then(|t| t.alias.clone());
        let requirement = self.requirement(auth.clone());
        // The session's LUN map comes from this same membership, not from a second lookup.
        self.admitted = Some((topology, Some(membership), auth));
        Ok(Admission {
            target_alias: alias,
            portal_group_tag: self.portal_group_tag,
            auth: requirement,
        })
    }

    fn admit_discovery(&mut self, initiator_name: &NodeName) -> Result<Admission, LoginStatus> {
        self.check_source(initiator_name)?;
        let topology = self.shared.topology();
        let auth = topology.config.discovery.resolved();
        let requirement = self.requirement(auth.clone());
        self.admitted = Some((topology, None, auth));
        Ok(Admission {
            target_alias: None,
            portal_group_tag: self.portal_group_tag,
            auth: requirement,
        })
    }

    fn fill_random(&mut self, buf: &mut [u8]) -> Result<(), LoginStatus> {
        os_random(buf).map_err(|e| {
            tracing::error!("cannot read the OS random source: {e}");
            LoginStatus::TARGET_ERROR
        })
    }

    fn open_session(
        &mut self,
        key: &SessionKey,
        _session_type: SessionType,
    ) -> Result<u16, LoginStatus> {
        let ticket = self
            .shared
            .registry
            .open(
                &key.initiator_name,
                key.isid,
                key.target_name.as_ref(),
                key.tsih,
                self.peer.ip(),
            )
            .map_err(|refused| {
                if let Some(limit) = refused.limit {
                    tracing::warn!(peer = %self.peer, initiator = %key.initiator_name, limit, "login refused: limit reached");
                    self.shared.metrics.limit(limit);
                }
                match refused.why {
                    Full::OutOfResources => LoginStatus::OUT_OF_RESOURCES,
                    Full::TooManyConnections => LoginStatus::TOO_MANY_CONNECTIONS,
                    Full::SessionDoesNotExist => LoginStatus::SESSION_DOES_NOT_EXIST,
                }
            })?;
        let tsih = ticket.tsih();
        self.ticket = Some(ticket);
        Ok(tsih)
    }
}

/// What a completed login hands to the full feature phase.
pub(super) struct LoggedIn {
    pub(super) established: Box<Established>,
    pub(super) ticket: SessionTicket,
    /// The topology the session was admitted under, its group in it (`None`: discovery) and
    /// what it proved.
    pub(super) topology: Arc<Topology>,
    pub(super) membership: Option<Membership>,
    pub(super) admitted: Admitted,
}

/// What the login policy decided, taken once the login completed.
pub(super) fn logged_in(
    mut policy: Policy<'_>,
    established: Box<Established>,
) -> Result<LoggedIn, Closed> {
    let ticket = policy
        .ticket
        .take()
        .ok_or(Closed::Invariant("login completed without a session"))?;
    // A normal session was admitted as a member of one group of its target; discovery
    // sessions have no target.
    let (topology, membership, required) = policy
        .admitted
        .take()
        .ok_or(Closed::Invariant("login completed without an admission"))?;
    let admitted = Admitted::of_login(
        &topology,
        membership,
        &required,
        established.chap_user.as_deref(),
    )
    .ok_or(Closed::Invariant(
        "the admitted group is not in its topology",
    ))?;
    assert_eq!(
        membership.is_some(),
        established.target_name.is_some(),
        "a normal session's membership is decided at its admission"
    );
    debug_assert!(membership.is_none_or(|m| topology
        .targets
        .get(m.target)
        .is_some_and(|t| Some(&t.iqn) == established.target_name.as_ref())));
    Ok(LoggedIn {
        established,
        ticket,
        topology,
        membership,
        admitted,
    })
}

/// The limits a login negotiates within.
pub(super) fn login_limits(limits: &crate::config::Limits) -> (LoginLimits, TargetLimits) {
    let target_limits = TargetLimits {
        max_recv_data_segment_length: limits.max_recv_data_segment_length,
        max_burst_length: limits.max_burst_length,
        first_burst_length: limits.first_burst_length,
        max_outstanding_r2t: limits.max_outstanding_r2t.min(u16::MAX as u32) as u16,
        header_digest_allowed: true,
        data_digest_allowed: true,
    };
    let login_limits = LoginLimits {
        max_keys: limits.max_text_key_count as usize,
        max_text_bytes: limits.max_text_length as usize,
        max_requests: 16,
        queue_depth: limits.max_queue_depth,
    };
    (login_limits, target_limits)
}

/// The I_T nexus of a session in `group` through `port`. A gateway peer's session ships for
/// the nexus its alias names: the initiator's own port through that gateway's port, in this
/// gateway's group.
pub(super) fn nexus_of(
    established: &Established,
    t: &crate::topology::TargetRuntime,
    group: &GroupRuntime,
    port: Arc<scsi::TargetPort>,
) -> Nexus {
    let id = crate::topology::nexus::new_id();
    let shipped_for = group
        .peer
        .then_some(established.initiator_alias.as_deref())
        .flatten()
        .and_then(crate::io::peer::parse_peer_alias)
        .and_then(|(initiator, relative)| {
            // An NVMe host's nexus names no one port (scsi::ANY_PORT): the owner's stands in.
            let theirs = match relative {
                scsi::ANY_PORT => Some(&port),
                _ => t.ports.values().find(|p| p.relative_id == relative),
            }?;
            Some((initiator, relative, theirs))
        });
    match shipped_for {
        Some((initiator_port, relative_id, theirs)) => Nexus {
            id,
            initiator_port,
            target_port: Arc::new(scsi::TargetPort {
                relative_id,
                name: theirs.name.clone(),
                target_name: theirs.target_name.clone(),
                group: port.group,
                groups: Arc::clone(&port.groups),
                shipped: true,
            }),
        },
        None => {
            let isid: String = established
                .isid
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            Nexus {
                id,
                initiator_port: format!("{},i,0x{isid}", established.initiator_name),
                target_port: port,
            }
        }
    }
}

/// The full feature session a login established.
pub(super) fn new_session(established: &Established, limits: &crate::config::Limits) -> Session {
    let session_limits = SessionLimits {
        queue_depth: limits.max_queue_depth,
        max_write_bytes: WRITE_BYTES_MAX,
        // The largest single write must always fit, or it could never run.
        max_pending_write_bytes: (limits.memory_per_connection_bytes as usize)
            .max(WRITE_BYTES_MAX as usize),
        nop_interval: Duration::from_secs(limits.nop_in_interval_s.into()),
        nop_timeout: Duration::from_secs(limits.nop_in_timeout_s.into()),
        idle_timeout: Duration::from_secs(limits.idle_timeout_s.into()),
        max_text_bytes: limits.max_text_length as usize,
        max_keys: limits.max_text_key_count as usize,
    };
    Session::new(
        established.session_type,
        established.initiator_name.clone(),
        established.params,
        session_limits,
        established.next_stat_sn,
        established.exp_cmd_sn,
        Instant::now(),
    )
}

pub(super) fn target_shown(established: &Established) -> &str {
    established
        .target_name
        .as_ref()
        .map_or("(discovery)", NodeName::as_str)
}

/// Unpredictable bytes from the kernel's CSPRNG (CHAP identifiers and challenges).
/// /dev/urandom never blocks once the system's pool is initialized, which is long done by the
/// time a daemon accepts connections.
pub(super) fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// The first StatSN of a connection. Any value is valid; varying it per connection makes stale
/// acknowledgements from an older connection stand out.
pub(super) fn initial_stat_sn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.subsec_nanos());
    nanos.max(1)
}

/// A normal session's login as a test makes one: the RFC defaults under `limits`, the
/// initiator `iqn.2026-12.test:i`, TSIH 1, CID 0, ISID 0.
#[cfg(test)]
pub(super) fn established_for_test(limits: &crate::config::Limits) -> Established {
    Established {
        session_type: SessionType::Normal,
        initiator_name: crate::config::NodeName::from_wire("iqn.2026-12.test:i")
            .expect("a valid IQN"),
        initiator_alias: None,
        target_name: None,
        portal_group_tag: 1,
        isid: [0; 6],
        tsih: 1,
        cid: 0,
        params: iscsi::negotiation::SessionParams::rfc_defaults(&login_limits(limits).1),
        chap_user: None,
        next_stat_sn: 1,
        exp_cmd_sn: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_login_negotiates_within_the_daemons_limits() {
        let limits = crate::config::Limits {
            max_outstanding_r2t: u32::MAX,
            ..Default::default()
        };
        let (login, target) = login_limits(&limits);
        assert_eq!(
            target.max_recv_data_segment_length,
            limits.max_recv_data_segment_length
        );
        assert_eq!(target.max_burst_length, limits.max_burst_length);
        assert_eq!(
            target.max_outstanding_r2t,
            u16::MAX,
            "clamped to the key's range"
        );
        assert_eq!(login.queue_depth, limits.max_queue_depth);
        assert_eq!(login.max_keys, limits.max_text_key_count as usize);
    }

    #[test]
    fn the_first_stat_sn_is_never_zero() {
        assert_ne!(initial_stat_sn(), 0);
    }
}
