//! The discovery log a host reads from a discovery controller: this discovery service at the
//! port the host reached it on, every subsystem the host would be admitted to at every NVMe
//! listener of its portal groups, and a referral to the discovery service of each of those
//! portal groups another gateway serves (so `nvme connect-all` finds that gateway's paths).
//! Who may see what is the Connect's decision (`Topology::member`), not a second one.

use std::net::{IpAddr, SocketAddr};

use nvme::fabrics::DISCOVERY_NQN;
use nvme::log::{DiscoveryEntry, SubsystemType};

use crate::config::{NodeName, PortalGroup};
use crate::topology::portals::{advertised, canonical, served_nvme};
use crate::topology::Topology;

/// Where the host is and where it reached this daemon.
pub(super) struct Asker<'a> {
    pub host: &'a NodeName,
    pub peer: IpAddr,
    pub local: SocketAddr,
    pub portal_group_tag: u16,
}

/// The entries of the log `asker` may read.
pub(super) fn entries(topology: &Topology, asker: &Asker<'_>) -> Vec<DiscoveryEntry> {
    // As the host dialed it (an IPv4 host on a dual-stack listener is not shown as ::ffff:).
    let here = SocketAddr::new(canonical(asker.local.ip()), asker.local.port());
    let mut out = vec![service(
        SubsystemType::CurrentDiscovery,
        asker.portal_group_tag,
        here,
    )];
    let reachable = reachable_targets(topology, asker);
    out.extend(subsystems(topology, asker, &reachable));
    out.extend(referrals(topology, &reachable));
    out
}

/// The targets the host would be admitted to, with an NQN.
fn reachable_targets(topology: &Topology, asker: &Asker<'_>) -> Vec<usize> {
    (0..topology.targets.len())
        .filter(|&i| topology.targets[i].config.nqn.is_some())
        .filter(|&i| topology.member(i, asker.host, asker.peer).is_ok())
        .collect()
}

/// Each reachable subsystem at each of this daemon's NVMe listeners of its portal groups.
fn subsystems(topology: &Topology, asker: &Asker<'_>, reachable: &[usize]) -> Vec<DiscoveryEntry> {
    let host_ips = crate::topology::portals::host_addresses();
    let listeners = served_nvme(&topology.config);
    let mut out = Vec::new();
    for &index in reachable {
        let t = &topology.targets[index];
        let Some(nqn) = &t.config.nqn else { continue };
        for (addr, tag) in &listeners {
            if !t.portal_groups.contains(tag) {
                continue;
            }
            for shown in advertised(*addr, asker.local.ip(), &host_ips) {
                out.push(DiscoveryEntry {
                    kind: SubsystemType::Nvm,
                    port_id: *tag,
                    ipv6: shown.is_ipv6(),
                    address: shown.ip().to_string(),
                    port: shown.port(),
                    subnqn: nqn.to_string(),
                    tls_required: t.config.tls_key(asker.host).is_some(),
                });
            }
        }
    }
    out
}

/// The discovery services of the reachable subsystems' portal groups that another gateway
/// serves: its discovery listeners, or its NVMe listeners where it has none (a discovery
/// controller answers on those too). A wildcard address names nothing a host can dial.
fn referrals(topology: &Topology, reachable: &[usize]) -> Vec<DiscoveryEntry> {
    let me = topology.config.server.gateway.as_deref();
    let mut out: Vec<DiscoveryEntry> = Vec::new();
    for pg in &topology.config.portal_groups {
        if pg.served_by(me) || !reachable.iter().any(|&i| serves(topology, i, pg)) {
            continue;
        }
        // `nvme_discovery_listen = []` turns the discovery port off, not the discovery
        // service its NVMe listeners answer too.
        let addrs = pg
            .nvme_discovery_listen
            .as_ref()
            .filter(|l| !l.is_empty())
            .unwrap_or(&pg.nvme_listen);
        for addr in addrs.iter().filter(|a| !a.ip().is_unspecified()) {
            let entry = service(SubsystemType::Referral, pg.tag, *addr);
            if !out.contains(&entry) {
                out.push(entry);
            }
        }
    }
    out
}

fn serves(topology: &Topology, target: usize, pg: &PortalGroup) -> bool {
    topology.targets[target].portal_groups.contains(&pg.tag)
}

/// An entry for a discovery service at `addr`.
fn service(kind: SubsystemType, port_id: u16, addr: SocketAddr) -> DiscoveryEntry {
    debug_assert!(kind.is_discovery());
    DiscoveryEntry {
        kind,
        port_id,
        ipv6: addr.is_ipv6(),
        address: addr.ip().to_string(),
        port: addr.port(),
        subnqn: DISCOVERY_NQN.to_string(),
        tls_required: false,
    }
}
