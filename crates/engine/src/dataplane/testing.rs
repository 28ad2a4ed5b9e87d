//! What the data plane's unit tests share: a runtime like a worker's (I/O, no timers: the
//! connection's alarm is a timerfd) and a loopback connection.

use std::net::SocketAddr;

/// A current-thread runtime with I/O and without tokio's timers, as a network worker's.
pub(super) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a test runtime")
}

/// A loopback connection: the target's end registered with `rt`, the host's end blocking,
/// and the host's address as the target sees it.
pub(super) fn loopback(
    rt: &tokio::runtime::Runtime,
) -> (tokio::net::TcpStream, std::net::TcpStream, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let host = std::net::TcpStream::connect(listener.local_addr().expect("its address"))
        .expect("a loopback connection");
    let (target, peer) = listener.accept().expect("the connection accepted");
    target.set_nonblocking(true).expect("non-blocking");
    let _entered = rt.enter();
    let target = tokio::net::TcpStream::from_std(target).expect("registered with the runtime");
    (target, host, peer)
}

pub(super) use crate::shared::testing::shared;

/// The party of a session of `initiator` through `door`, admitted to `target` through portal
/// group 1 at `local` as a login admits it.
pub(super) fn party(
    door: crate::admission::Door,
    topology: &crate::topology::Topology,
    initiator: &str,
    target: &str,
    local: SocketAddr,
) -> super::view::Party {
    use crate::config::NodeName;
    let name = |s: &str| NodeName::from_wire(s).expect("a valid name");
    let (initiator, target) = (name(initiator), name(target));
    let peer: SocketAddr = "127.0.0.1:50000".parse().expect("an address");
    let (membership, required) = topology
        .admit(door, &initiator, &target, 1, peer.ip(), None)
        .expect("admitted");
    let admitted =
        crate::admission::Admitted::of_login(topology, Some(membership), &required, None)
            .expect("its proof meets the group");
    super::view::Party {
        door,
        tls: None,
        admitted,
        target_name: Some(target),
        initiator,
        peer,
        local,
        portal_group_tag: 1,
    }
}

/// `view`'s nexus made and its group's LUN map taken: what a login does once admitted.
pub(super) fn join(view: &mut super::view::View) {
    let topology = std::sync::Arc::clone(&view.topology);
    let membership = view.party.admitted.membership().expect("a member");
    let (t, group) = topology.group_of(membership).expect("a member");
    let nexus = scsi::Nexus {
        id: crate::topology::nexus::new_id(),
        initiator_port: format!("{},i,0x000000000001", view.party.initiator),
        target_port: std::sync::Arc::clone(t.ports.get(&1).expect("its port")),
    };
    view.join(nexus, group);
}

/// A backend of an iSCSI session of `initiator` logged in to `target` ([`party`], [`join`]),
/// with the receiving end of its completions.
pub(super) fn logged_in<'s>(
    shared: &'s crate::shared::Shared,
    initiator: &str,
    target: &str,
) -> (
    super::backend::Backend<'s>,
    tokio::sync::mpsc::UnboundedReceiver<Box<super::backend::Completed>>,
) {
    let topology = shared.topology();
    let local = "127.0.0.1:3260".parse().expect("an address");
    let party = party(
        crate::admission::Door::Iscsi,
        &topology,
        initiator,
        target,
        local,
    );
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    let mut backend = super::backend::Backend::new(shared, &topology, party, sender);
    join(&mut backend.view);
    (backend, receiver)
}
