//! Fabrics Connect: an admin queue's Connect makes a controller — admitted by the one
//! admission decision (`Topology::admit`, through the NVMe door), registered as a session —
//! and an I/O queue's Connect joins the controller it names.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use nvme::auth::controller::Keys;
use nvme::controller::{Controller, ControllerLimits};
use nvme::fabrics::{Connect, InvalidParameter, DISCOVERY_NQN};
use nvme::identify::ControllerType;
use nvme::sqe::Status;

use crate::admission::controllers::{ControllerEntry, CNTLID_MAX};
use crate::admission::registry::Instance;
use crate::admission::{Admitted, Door, Refusal};
use crate::config::{NodeName, ResolvedAuth};
use crate::shared::Shared;
use crate::topology::Topology;

/// Why a Connect was refused: its status, its dword 0 (the parameter in error), and the
/// metric's label.
pub(super) struct Refused {
    pub(super) status: Status,
    pub(super) dw0: u32,
    pub(super) why: &'static str,
}

fn invalid(in_data: bool, offset: u16) -> Refused {
    Refused {
        status: Status::CONNECT_INVALID_PARAMETERS,
        dw0: InvalidParameter { in_data, offset }.dw0(),
        why: "invalid_parameters",
    }
}

fn invalid_host() -> Refused {
    Refused {
        status: Status::CONNECT_INVALID_HOST,
        dw0: 0,
        why: "invalid_host",
    }
}

/// Where a Connect came from.
pub(super) struct Arrival {
    pub(super) peer: SocketAddr,
    pub(super) local: SocketAddr,
    pub(super) portal_group_tag: u16,
    /// Came in on a discovery listener: only the discovery subsystem is served there.
    pub(super) discovery_only: bool,
    /// What the connection's TLS handshake proved (None: in the clear).
    pub(super) tls: Option<crate::admission::TlsProof>,
}

/// A controller's limits, from the daemon's.
pub(super) fn controller_limits(limits: &crate::config::Limits) -> ControllerLimits {
    ControllerLimits {
        io_queues_max: super::IO_QUEUES_MAX,
        mqes: limits.max_queue_depth.saturating_sub(1) as u16,
        mdts: super::mdts(limits),
        in_capsule: super::IN_CAPSULE_BYTES,
        kato_ms_max: super::KATO_MS_MAX,
    }
}

/// The admin queue's Connect: a new controller, or the refusal.
pub(super) fn admin(
    shared: &Shared,
    connect: &Connect,
    at: &Arrival,
) -> Result<(Arc<ControllerEntry>, Option<Keys>), Refused> {
    let host = NodeName::from_wire(&connect.hostnqn).map_err(|_| invalid(true, 512))?;
    let discovery = connect.subnqn == DISCOVERY_NQN;
    if at.discovery_only && !discovery {
        tracing::warn!(peer = %at.peer, host = %host, subsystem = %connect.subnqn, "NVMe Connect refused: a discovery listener serves only the discovery subsystem");
        return Err(invalid(true, 256));
    }
    let topology = shared.topology();
    let (subsystem, admitted, keys) = admit_controller(&topology, &host, connect, at)?;
    let ticket = shared
        .registry
        .open(&host, instance(), subsystem.as_ref(), 0, at.peer.ip())
        .map_err(|refused| {
            if let Some(limit) = refused.limit {
                shared.metrics.limit(limit);
            }
            busy(refused.limit.unwrap_or("controller IDs"))
        })?;
    let cntlid = ticket.tsih();
    if cntlid > CNTLID_MAX {
        return Err(busy("controller IDs"));
    }
    let nexus = admitted
        .membership()
        .and_then(|m| topology.targets.get(m.target))
        .and_then(|t| t.ports.get(&at.portal_group_tag))
        .map(|port| scsi::Nexus {
            id: crate::topology::nexus::new_id(),
            initiator_port: initiator_port(&host, &connect.host_id),
            target_port: Arc::new(port.any_port()),
        });
    let kind = if discovery {
        ControllerType::Discovery
    } else {
        ControllerType::Io
    };
    let state = Controller::new(
        cntlid,
        kind,
        controller_limits(&shared.limits),
        connect.kato_ms,
    );
    let (kill, _) = tokio::sync::watch::channel(None);
    let entry = Arc::new(ControllerEntry {
        cntlid,
        host,
        host_id: connect.host_id,
        subsystem,
        portal_group_tag: at.portal_group_tag,
        source: at.peer,
        admitted,
        nexus,
        state: Mutex::new(state),
        io_queues: Mutex::new(Vec::new()),
        kill,
        ticket: Mutex::new(Some(ticket)),
        info: Mutex::new(None),
        aborts: Mutex::default(),
    });
    shared.nvme.insert(Arc::clone(&entry));
    Ok((entry, keys))
}

/// Who an admin queue's Connect makes a controller for: the discovery subsystem under the
/// discovery section's requirement, or a subsystem through the one admission; the keys its
/// in-band authentication will use.
fn admit_controller(
    topology: &Topology,
    host: &NodeName,
    connect: &Connect,
    at: &Arrival,
) -> Result<(Option<NodeName>, Admitted, Option<Keys>), Refused> {
    if connect.subnqn == DISCOVERY_NQN {
        let required = topology.config.discovery.resolved();
        let keys = keys_for(&required, host, DISCOVERY_NQN, at)?;
        let chap_user = keys.as_ref().map(|(_, user)| user.as_str());
        let admitted =
            Admitted::of_login(topology, None, &required, chap_user).ok_or_else(invalid_host)?;
        return Ok((None, admitted, keys.map(|(k, _)| k)));
    }
    let sub = NodeName::from_wire(&connect.subnqn).map_err(|_| invalid(true, 256))?;
    let (admitted, keys) = admit(topology, host, &sub, at)?;
    Ok((Some(sub), admitted, keys))
}

fn busy(what: &'static str) -> Refused {
    tracing::warn!("NVMe Connect refused: {what} exhausted");
    Refused {
        status: Status::CONNECT_CONTROLLER_BUSY,
        dw0: 0,
        why: "controller_busy",
    }
}

/// The one admission decision, through the NVMe door: the subsystem is the target whose
/// `nqn` it names, and the host must belong to one of its groups from this address. What that
/// group requires decides whether the queue must authenticate (DH-HMAC-CHAP) before anything
/// else, and with which keys.
fn admit(
    topology: &Topology,
    host: &NodeName,
    sub: &NodeName,
    at: &Arrival,
) -> Result<(Admitted, Option<Keys>), Refused> {
    let refused = |refusal: Refusal| {
        tracing::warn!(peer = %at.peer, host = %host, subsystem = %sub, reason = refusal.reason(), "NVMe Connect refused");
        match refusal {
            // Not served on this port, or no such subsystem: the subsystem NQN is wrong.
            Refusal::NoSuchTarget | Refusal::NotOnThisPortal => invalid(true, 256),
            _ => invalid_host(),
        }
    };
    let (membership, required) = topology
        .admit(
            Door::Nvme,
            host,
            sub,
            at.portal_group_tag,
            at.peer.ip(),
            at.tls.as_ref(),
        )
        .map_err(refused)?;
    let keys = keys_for(&required, host, sub.as_str(), at)?;
    let chap_user = keys.as_ref().map(|(_, user)| user.as_str());
    let admitted = Admitted::of_login(topology, Some(membership), &required, chap_user)
        .ok_or_else(invalid_host)?;
    Ok((admitted, keys.map(|(k, _)| k)))
}

/// The DH-HMAC-CHAP keys a host authenticates with when `required` asks for authentication:
/// the secret of the CHAP user named by the host's NQN (a `DHHC-1:` secret), and the mutual
/// secret as the controller's key if it is one. A host the group requires to authenticate but
/// holds no key for can never succeed: refused at Connect.
fn keys_for(
    required: &ResolvedAuth,
    host: &NodeName,
    sub: &str,
    at: &Arrival,
) -> Result<Option<(Keys, String)>, Refused> {
    let ResolvedAuth::Chap { users, mutual } = required else {
        return Ok(None);
    };
    // NQNs compare as the names they are (the config's user may differ in case).
    let key = users
        .iter()
        .find(|u| u.user.eq_ignore_ascii_case(host.as_str()))
        .and_then(|u| Some((key_of(&u.secret)?, u.user.clone())));
    let Some((key, user)) = key else {
        tracing::warn!(peer = %at.peer, host = %host, subsystem = sub, "NVMe Connect refused: the host's group requires authentication and holds no DH-HMAC-CHAP secret for this host (a `users` entry named by the host NQN, with a DHHC-1 secret)");
        return Err(invalid_host());
    };
    let controller = mutual.as_ref().and_then(|m| key_of(&m.secret));
    let keys = Keys {
        host: key,
        controller,
    };
    Ok(Some((keys, user)))
}

/// A configured secret as a DH-HMAC-CHAP key (`None` unless it is a `DHHC-1:` secret; the
/// config loader refuses a malformed one).
fn key_of(secret: &crate::config::Secret) -> Option<nvme::auth::Key> {
    nvme::auth::Key::parse(std::str::from_utf8(secret.expose()).ok()?).ok()
}

/// The group an admission names (None for discovery).
fn group_of(admitted: &Admitted) -> Option<&str> {
    match admitted {
        Admitted::Normal { group, .. } => Some(group),
        Admitted::Discovery { .. } => None,
    }
}

/// The SCSI initiator port name of an NVMe host: its NQN and host identifier. Reservations
/// and per-nexus state key on it, as on an iSCSI initiator's name and ISID.
fn initiator_port(host: &NodeName, host_id: &[u8; 16]) -> String {
    let id: String = host_id.iter().map(|b| format!("{b:02x}")).collect();
    format!("{host},h,0x{id}")
}

/// The registry's instance for a new controller: never the same for two controllers (a host
/// may run several through one port; NVMe has no reinstatement to ask for).
fn instance() -> Instance {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    Instance::Controller(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// An I/O queue's Connect: the controller it names, if this host on this port owns it.
pub(super) fn io(
    shared: &Shared,
    connect: &Connect,
    at: &Arrival,
) -> Result<(Arc<ControllerEntry>, Option<Keys>), Refused> {
    if at.discovery_only {
        // A discovery controller has no I/O queues, and no other subsystem is served here.
        return Err(invalid(true, 256));
    }
    let entry = shared
        .nvme
        .get(connect.cntlid)
        .ok_or_else(|| invalid(true, 16))?;
    let host = NodeName::from_wire(&connect.hostnqn).map_err(|_| invalid(true, 512))?;
    let sub = NodeName::from_wire(&connect.subnqn).map_err(|_| invalid(true, 256))?;
    if entry.host != host || entry.host_id != connect.host_id {
        return Err(invalid_host());
    }
    if entry.subsystem.as_ref() != Some(&sub) || entry.portal_group_tag != at.portal_group_tag {
        return Err(invalid(true, 256));
    }
    // Each queue is its own connection, possibly from another address: the same admission
    // decision for it (its source against `allowed_sources`), into the controller's group.
    let (admitted, keys) = admit(&shared.topology(), &host, &sub, at)?;
    if group_of(&admitted) != group_of(&entry.admitted) {
        return Err(invalid_host());
    }
    if !entry.state().regs.ready() {
        return Err(Refused {
            status: nvme::controller::COMMAND_SEQUENCE_ERROR,
            dw0: 0,
            why: "sequence",
        });
    }
    if connect.sqsize > entry.state().regs.mqes {
        return Err(invalid(false, 44));
    }
    // A queue that must authenticate takes its ID once it has (`Driver::after_auth_step`).
    let placed = match keys {
        None => entry.add_io_queue(connect.qid),
        Some(_) => entry.io_queue_free(connect.qid),
    };
    if !placed {
        return Err(invalid(false, 42));
    }
    Ok((entry, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_controller_is_its_own_registry_instance() {
        let (a, b) = (instance(), instance());
        assert_ne!(a, b, "never reinstated: no two Connects share one");
        assert!(matches!(a, Instance::Controller(_)));
    }

    #[test]
    fn a_hosts_initiator_port_names_its_nqn_and_host_id() {
        let host = NodeName::from_wire("nqn.2014-08.org.nvmexpress:uuid:h").unwrap();
        let mut id = [0u8; 16];
        id[0] = 0xAB;
        id[15] = 0x01;
        assert_eq!(
            initiator_port(&host, &id),
            "nqn.2014-08.org.nvmexpress:uuid:h,h,0xab000000000000000000000000000001"
        );
    }

    #[test]
    fn refusals_answer_the_connect_statuses_the_spec_names() {
        let bad = invalid(true, 256);
        assert_eq!(bad.status, Status::CONNECT_INVALID_PARAMETERS);
        assert_eq!(
            bad.dw0,
            InvalidParameter {
                in_data: true,
                offset: 256
            }
            .dw0()
        );
        assert_eq!(invalid_host().status, Status::CONNECT_INVALID_HOST);
        assert_eq!(
            busy("controller IDs").status,
            Status::CONNECT_CONTROLLER_BUSY
        );
    }

    #[test]
    fn a_controllers_limits_follow_the_daemons() {
        let limits = crate::config::Limits::default();
        let c = controller_limits(&limits);
        assert_eq!(u32::from(c.mqes), limits.max_queue_depth - 1, "0's based");
        assert_eq!(4096u32 << c.mdts, super::super::TRANSFER_BYTES_MAX);
        assert_eq!(c.in_capsule, super::super::IN_CAPSULE_BYTES);
    }
}
