//! The addresses a portal is advertised at. A wildcard listener (0.0.0.0, `[::]`) is no address
//! an initiator can dial: SendTargets and the start-up banner report the host's own addresses
//! for it instead, so that discovery through one portal group finds the paths of the others
//! (multipath with one listener per group on different ports or interfaces).

use std::net::{IpAddr, SocketAddr};

use crate::config::Config;

/// Every listen address of this daemon's portal groups with its tag (a portal group another
/// gateway serves is only reported, in REPORT TARGET PORT GROUPS and discovery).
pub fn served(config: &Config) -> Vec<(SocketAddr, u16)> {
    let me = config.server.gateway.as_deref();
    config
        .portal_groups
        .iter()
        .filter(|p| p.served_by(me))
        .flat_map(|p| p.listen.iter().map(move |a| (*a, p.tag)))
        .collect()
}

/// Every NVMe/TCP listen address of this daemon's portal groups with its tag.
pub fn served_nvme(config: &Config) -> Vec<(SocketAddr, u16)> {
    let me = config.server.gateway.as_deref();
    config
        .portal_groups
        .iter()
        .filter(|p| p.served_by(me))
        .flat_map(|p| p.nvme_listen.iter().map(move |a| (*a, p.tag)))
        .collect()
}

/// What a listener serves: iSCSI, NVMe/TCP, or only NVMe/TCP discovery (the well-known
/// discovery port, 8009).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListenerKind {
    Iscsi,
    Nvme,
    NvmeDiscovery,
}

impl ListenerKind {
    pub fn name(self) -> &'static str {
        match self {
            ListenerKind::Iscsi => "iSCSI",
            ListenerKind::Nvme => "NVMe/TCP",
            ListenerKind::NvmeDiscovery => "NVMe/TCP discovery",
        }
    }

    /// Whether another gateway's peer may log in through it: peers ship over iSCSI only
    /// (io/peer.rs), so only there may a connection pass its source's limit as a peer's.
    pub fn carries_gateway_peers(self) -> bool {
        matches!(self, ListenerKind::Iscsi)
    }
}

/// One listener a config asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortalListener {
    pub addr: SocketAddr,
    pub tag: u16,
    pub kind: ListenerKind,
    /// The config names it: not having it stops a start or a reload. (A default discovery
    /// listener that cannot be had is left out with a warning: another daemon on this host
    /// may hold the port.)
    pub required: bool,
}

/// Every listener of `config` served by this daemon: the one list the start binds, a reload
/// compares and `check-config --deep` tries.
pub fn listeners(config: &Config) -> Vec<PortalListener> {
    let listener = |kind| {
        move |(addr, tag)| PortalListener {
            addr,
            tag,
            kind,
            required: true,
        }
    };
    let mut out: Vec<PortalListener> = served(config)
        .into_iter()
        .map(listener(ListenerKind::Iscsi))
        .collect();
    out.extend(
        served_nvme(config)
            .into_iter()
            .map(listener(ListenerKind::Nvme)),
    );
    out.extend(
        served_nvme_discovery(config)
            .into_iter()
            .map(|d| PortalListener {
                addr: d.addr,
                tag: d.tag,
                kind: ListenerKind::NvmeDiscovery,
                required: d.explicit,
            }),
    );
    out
}

/// Whether a listener bound at `bound` takes connections to `local` (a wildcard takes its
/// family's, `[::]` both: dual-stack).
pub fn reaches(bound: SocketAddr, local: SocketAddr) -> bool {
    if bound.port() != local.port() {
        return false;
    }
    let local_ip = canonical(local.ip());
    match bound.ip() {
        ip if ip.is_unspecified() => bound.is_ipv6() || local_ip.is_ipv4(),
        ip => canonical(ip) == local_ip,
    }
}

/// An NVMe/TCP discovery listener: where, for which portal group, and whether the config
/// named it (else it is the default beside an NVMe/TCP listener).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscoveryListener {
    pub addr: SocketAddr,
    pub tag: u16,
    pub explicit: bool,
}

/// The NVMe/TCP discovery listeners of this daemon's portal groups: each group's
/// `nvme_discovery_listen`, or by default the discovery port (8009) at each address of its
/// `nvme_listen`, unless another listener already holds or overlaps that address.
pub fn served_nvme_discovery(config: &Config) -> Vec<DiscoveryListener> {
    let me = config.server.gateway.as_deref();
    let groups: Vec<_> = config
        .portal_groups
        .iter()
        .filter(|p| p.served_by(me))
        .collect();
    let mut taken: Vec<SocketAddr> = groups
        .iter()
        .flat_map(|p| p.listen.iter().chain(&p.nvme_listen).copied())
        .collect();
    let mut out = Vec::new();
    for p in &groups {
        let (addrs, explicit) = match &p.nvme_discovery_listen {
            Some(list) => (list.clone(), true),
            None => (
                p.nvme_listen
                    .iter()
                    .map(|a| SocketAddr::new(a.ip(), crate::config::NVME_DISCOVERY_PORT))
                    .collect(),
                false,
            ),
        };
        for addr in addrs {
            if !explicit
                && taken
                    .iter()
                    .any(|t| crate::config::portals_overlap(*t, addr))
            {
                continue;
            }
            taken.push(addr);
            out.push(DiscoveryListener {
                addr,
                tag: p.tag,
                explicit,
            });
        }
    }
    out
}

/// The host's addresses an initiator may reach: interfaces that are up, neither loopback nor
/// link-local (those need a scope an initiator elsewhere does not have). Empty if the host
/// cannot say (then only the address the initiator came in on is reported).
pub fn host_addresses() -> Vec<IpAddr> {
    let Ok(interfaces) = if_addrs::get_if_addrs() else {
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = interfaces
        .iter()
        .filter(|i| i.is_oper_up() && !i.is_loopback() && !i.is_link_local())
        .map(|i| i.ip())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Where the listener `listen` is advertised to an initiator that reached this host at
/// `local`: a specific address as it is; a wildcard at `local`'s address first, then at every
/// other address of the host it listens on (0.0.0.0: IPv4; `[::]`: both), unless the initiator came over loopback (it
/// is on this host: loopback is the path it has).
pub fn advertised(listen: SocketAddr, local: IpAddr, host: &[IpAddr]) -> Vec<SocketAddr> {
    if !listen.ip().is_unspecified() {
        return vec![listen];
    }
    let local = canonical(local);
    // [::] is dual-stack on Linux (unless net.ipv6.bindv6only): it is reached over both.
    let same_family = |ip: &IpAddr| listen.is_ipv6() || ip.is_ipv4();
    let mut ips = Vec::new();
    if same_family(&local) {
        ips.push(local);
    }
    if !local.is_loopback() {
        ips.extend(
            host.iter()
                .copied()
                .filter(|ip| same_family(ip) && *ip != local),
        );
    }
    ips.into_iter()
        .map(|ip| SocketAddr::new(ip, listen.port()))
        .collect()
}

/// An IPv4 peer of a dual-stack socket shows as ::ffff:a.b.c.d: the IPv4 address it is.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// An address for the start-up banner's examples: a specific one as it is, a wildcard as the
/// host's first address (loopback if it has none).
pub fn dialable(bound: SocketAddr, host: &[IpAddr]) -> SocketAddr {
    if !bound.ip().is_unspecified() {
        return bound;
    }
    let loopback = if bound.is_ipv4() {
        IpAddr::from([127, 0, 0, 1])
    } else {
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
    };
    let ip = host
        .iter()
        .copied()
        .find(|ip| ip.is_ipv4() == bound.is_ipv4())
        .unwrap_or(loopback);
    SocketAddr::new(ip, bound.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn specific_listeners_are_advertised_as_they_are() {
        let host = [ip("10.0.0.5")];
        assert_eq!(
            advertised(sa("192.168.1.2:3260"), ip("10.0.0.5"), &host),
            vec![sa("192.168.1.2:3260")]
        );
    }

    #[test]
    fn a_wildcard_is_the_address_reached_then_the_hosts_others() {
        let host = [ip("10.0.0.5"), ip("10.1.0.5"), ip("fd00::5")];
        assert_eq!(
            advertised(sa("0.0.0.0:3302"), ip("10.1.0.5"), &host),
            vec![sa("10.1.0.5:3302"), sa("10.0.0.5:3302")]
        );
        // Over loopback the initiator is on this host: loopback only.
        assert_eq!(
            advertised(sa("0.0.0.0:3302"), ip("127.0.0.1"), &host),
            vec![sa("127.0.0.1:3302")]
        );
        // 0.0.0.0 is IPv4 only; [::] takes both; an IPv4 peer of a dual-stack socket counts
        // as IPv4.
        assert_eq!(
            advertised(sa("0.0.0.0:3260"), ip("fd00::5"), &host),
            vec![sa("10.0.0.5:3260"), sa("10.1.0.5:3260")]
        );
        assert_eq!(
            advertised(sa("[::]:3260"), ip("fd00::5"), &host),
            vec![
                sa("[fd00::5]:3260"),
                sa("10.0.0.5:3260"),
                sa("10.1.0.5:3260")
            ]
        );
        assert_eq!(
            advertised(sa("[::]:3260"), ip("::ffff:10.0.0.5"), &host),
            vec![
                sa("10.0.0.5:3260"),
                sa("10.1.0.5:3260"),
                sa("[fd00::5]:3260")
            ]
        );
        assert_eq!(
            advertised(sa("[::]:3260"), ip("127.0.0.1"), &host),
            vec![sa("127.0.0.1:3260")]
        );
    }

    #[test]
    fn the_banner_never_prints_a_wildcard() {
        assert_eq!(
            dialable(sa("0.0.0.0:3301"), &[ip("fd00::1"), ip("10.0.0.5")]),
            sa("10.0.0.5:3301")
        );
        assert_eq!(dialable(sa("0.0.0.0:3301"), &[]), sa("127.0.0.1:3301"));
        assert_eq!(dialable(sa("[::]:3301"), &[]), sa("[::1]:3301"));
        assert_eq!(
            dialable(sa("127.0.0.1:3260"), &[ip("10.0.0.5")]),
            sa("127.0.0.1:3260")
        );
    }

    #[test]
    fn nvme_discovery_listeners_default_to_port_8009_beside_each_nvme_listener() {
        let c = crate::config::Config::from_toml_str(
            r#"
[[portal_group]]
tag = 1
nvme_listen = ["127.0.0.1:4420", "127.0.0.2:4420"]
[[portal_group]]
tag = 2
nvme_listen = ["127.0.0.1:4421"]
[[portal_group]]
tag = 3
nvme_listen = ["127.0.0.3:4420"]
nvme_discovery_listen = ["127.0.0.3:9009"]
[[portal_group]]
tag = 4
nvme_listen = ["127.0.0.4:4420"]
nvme_discovery_listen = []
"#,
            "test.toml",
        )
        .expect("valid config");
        let d: Vec<_> = served_nvme_discovery(&c)
            .into_iter()
            .map(|d| (d.addr, d.tag, d.explicit))
            .collect();
        // Group 2's default is group 1's (one address, one listener); group 3 named its own;
        // group 4 asked for none.
        assert_eq!(
            d,
            vec![
                (sa("127.0.0.1:8009"), 1, false),
                (sa("127.0.0.2:8009"), 1, false),
                (sa("127.0.0.3:9009"), 3, true),
            ]
        );
    }
}
