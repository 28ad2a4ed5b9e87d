//! Explicit ALUA (an LU with an owner, as RBD gateways use it): states per target port group
//! from the owner, standby refusing what needs the medium, SET TARGET PORT GROUPS taking the
//! LU over through the sender's own group, unit attentions on every other nexus, and bad
//! parameter lists refused.
mod common;
use common::*;
use scsi::{AccessState, Nexus, Ownership, PortGroup, PrPersistence, TargetPort};
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use store::BlockStore;

/// Owned by group `owner` (0: nobody); `take` fails while `refuse` is set; group `moving`
/// (0: none) is transitioning.
#[derive(Default)]
struct FakeOwner {
    owner: AtomicU16,
    moving: AtomicU16,
    takes: AtomicUsize,
    refuse: std::sync::atomic::AtomicBool,
    /// Implicit only: initiators may not move the LU.
    implicit: std::sync::atomic::AtomicBool,
    /// A wait for the transition ends it (group `moving` becomes the owner); otherwise the
    /// transition outlasts every wait.
    settle_ends: std::sync::atomic::AtomicBool,
    /// The waits asked for, in ms.
    settled: std::sync::Mutex<Vec<u128>>,
}

impl Ownership for FakeOwner {
    fn is_active(&self, group: u16) -> bool {
        self.owner.load(Ordering::SeqCst) == group
    }
    fn transitioning(&self, group: u16) -> bool {
        self.moving.load(Ordering::SeqCst) == group
    }
    fn explicit(&self) -> bool {
        !self.implicit.load(Ordering::SeqCst)
    }
    fn settle(&self, group: u16, within: std::time::Duration) {
        self.settled.lock().unwrap().push(within.as_millis());
        if self.settle_ends.load(Ordering::SeqCst) && self.moving.load(Ordering::SeqCst) == group {
            self.owner.store(group, Ordering::SeqCst);
            self.moving.store(0, Ordering::SeqCst);
        }
    }
    fn take(&self, group: u16) -> std::io::Result<()> {
        if self.refuse.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("cluster unreachable"));
        }
        self.takes.fetch_add(1, Ordering::SeqCst);
        self.owner.store(group, Ordering::SeqCst);
        Ok(())
    }
}

/// A nexus `id` through the port of group `group` of a two-gateway target (groups 1 and 2).
fn gateway_nexus(id: u64, group: u16) -> Nexus {
    let groups: Arc<[PortGroup]> = Arc::new([
        PortGroup {
            id: 1,
            state: AccessState::ActiveOptimized,
            ports: vec![1],
        },
        PortGroup {
            id: 2,
            state: AccessState::ActiveOptimized,
            ports: vec![2],
        },
    ]);
    Nexus {
        id,
        initiator_port: format!("iqn.1994-05.com.example:mp,i,0x00023d00000{id}"),
        target_port: Arc::new(TargetPort {
            relative_id: group,
            name: format!("iqn.2026-11.org.ferrosan:gw,t,0x000{group}"),
            target_name: "iqn.2026-11.org.ferrosan:gw".into(),
            group,
            groups,
            shipped: false,
        }),
    }
}

fn owned(owner: u16) -> (T, Arc<FakeOwner>) {
    let t = T::new();
    let fake = Arc::new(FakeOwner::default());
    fake.owner.store(owner, Ordering::SeqCst);
    t.lu.set_ownership(fake.clone());
    (t, fake)
}

const RTPG: [u8; 12] = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0];

fn stpg_cdb(len: u8) -> [u8; 12] {
    [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, len, 0, 0]
}

/// A SET TARGET PORT GROUPS parameter list of (state, group) descriptors.
fn stpg_list(descriptors: &[(u8, u16)]) -> Vec<u8> {
    let mut list = vec![0u8; 4];
    for &(state, group) in descriptors {
        list.extend_from_slice(&[state, 0]);
        list.extend_from_slice(&group.to_be_bytes());
    }
    list
}

/// (group, state, supported states) per RTPG descriptor.
fn states(data: &[u8]) -> Vec<(u16, u8, u8)> {
    data[4..]
        .chunks(12)
        .map(|d| (u16::from_be_bytes([d[2], d[3]]), d[0] & 0x0F, d[1]))
        .collect()
}

/// Clears the power-on unit attention of the test's nexus.
fn clear_ua(t: &mut T) {
    let _ = t.run(&[0x12, 0, 0, 0, 36, 0], &[]);
    let _ = t.run(&[0x03, 0, 0, 0, 18, 0], &[]);
}

#[test]
fn the_owner_is_active_optimized_every_other_group_standby() {
    let (mut t, _) = owned(1);
    t.nexus = gateway_nexus(1, 1);
    clear_ua(&mut t);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x0, 0x87), (2, 0x2, 0x87)]
    );
    // TPGS = 11b: implicit and explicit.
    let inquiry = t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    assert_eq!(inquiry[5] & 0x30, 0x30);
    // Through the owner's group everything works.
    t.ok(&write10(0, 1), &[7u8; 512]);
    assert_eq!(t.ok(&read10(0, 1), &[]), vec![7u8; 512]);
}

#[test]
fn a_standby_group_refuses_what_needs_the_medium_and_answers_the_rest() {
    let (mut t, _) = owned(1);
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    for cdb in [
        &read10(0, 1)[..],
        &write10(0, 1)[..],
        &[0u8; 6][..],                                            // TEST UNIT READY
        &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0],                       // SYNCHRONIZE CACHE (10)
        &[0x9E, 0x12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0], // GET LBA STATUS
    ] {
        let data = if cdb[0] == 0x2A {
            vec![0u8; 512]
        } else {
            Vec::new()
        };
        let s = t.err(cdb, &data);
        assert_sense(&s, 0x02, 0x04, 0x0B);
    }
    assert!(
        t.store.durable_writes.load(Ordering::SeqCst) + t.store.plain_writes.load(Ordering::SeqCst)
            == 0
    );
    // Identification, sense, mode pages, reservations, the group commands and (as LIO)
    // READ CAPACITY still answer.
    t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    t.ok(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    t.ok(
        &[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
        &[],
    );
    t.ok(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    t.ok(&[0x1A, 0, 0x3F, 0, 255, 0], &[]);
    t.ok(&[0x5E, 0, 0, 0, 0, 0, 0, 0, 255, 0], &[]);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x0, 0x87), (2, 0x2, 0x87)]
    );
}

#[test]
fn a_group_taking_over_is_transitioning_and_asks_for_retries() {
    let (mut t, fake) = owned(1);
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    fake.moving.store(2, Ordering::SeqCst);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x0, 0x87), (2, 0xF, 0x87)]
    );
    // Identification, sense and REPORT TARGET PORT GROUPS answer; everything else but TEST UNIT
    // READY, SET TARGET PORT GROUPS and the reservations too, is NOT READY, ASYMMETRIC ACCESS
    // STATE TRANSITION.
    t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    t.ok(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    t.ok(&[0x03, 0, 0, 0, 18, 0], &[]);
    // TEST UNIT READY is not refused for the transition (multipathd would fail the path): it
    // gets what the group would answer without it -- standby here, as this owner does not ship.
    assert_sense(&t.err(&[0u8; 6], &[]), 0x02, 0x04, 0x0B);
    for cdb in [
        &read10(0, 1)[..],
        &[0x5E, 0, 0, 0, 0, 0, 0, 0, 255, 0],
        &[0x1A, 0, 0x3F, 0, 255, 0],
        &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &stpg_cdb(8)[..],
    ] {
        let data = if cdb[0] == 0xA4 {
            stpg_list(&[(0x0, 2)])
        } else {
            Vec::new()
        };
        assert_sense(&t.err(cdb, &data), 0x02, 0x04, 0x0A);
    }
    assert_eq!(fake.takes.load(Ordering::SeqCst), 0);
    // The owner's group is not affected.
    t.nexus = gateway_nexus(1, 1);
    clear_ua(&mut t);
    t.ok(&read10(0, 1), &[]);
    fake.moving.store(0, Ordering::SeqCst);
    t.nexus = gateway_nexus(2, 2);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x02, 0x04, 0x0B);
}

/// A host that moves to a path while a takeover through it runs asks REPORT TARGET PORT GROUPS
/// first: the report waits (off the network threads) for the takeover to end and shows where
/// it ended, instead of a transitioning group that Linux's ALUA handler looks at again only
/// 2 s later. A takeover that outlasts the wait is reported transitioning.
#[test]
fn a_report_during_a_takeover_waits_for_its_end() {
    let (mut t, fake) = owned(1);
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    assert!(t.lu.waits_for_device(&RTPG));
    // Nothing moving: no wait.
    t.ok(&RTPG, &[]);
    assert!(fake.settled.lock().unwrap().is_empty());
    fake.moving.store(2, Ordering::SeqCst);
    fake.settle_ends.store(true, Ordering::SeqCst);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x2, 0x87), (2, 0x0, 0x87)]
    );
    // Bounded: at most the 2 s after which Linux would have looked again anyway.
    let asked = fake.settled.lock().unwrap().clone();
    assert_eq!(asked.len(), 1);
    assert!((1..=2000).contains(&asked[0]), "{asked:?}");
    fake.moving.store(1, Ordering::SeqCst);
    fake.settle_ends.store(false, Ordering::SeqCst);
    t.nexus = gateway_nexus(3, 1);
    clear_ua(&mut t);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0xF, 0x87), (2, 0x0, 0x87)]
    );
}

#[test]
fn nobody_owning_makes_every_group_standby() {
    let (mut t, _) = owned(0);
    t.nexus = gateway_nexus(1, 1);
    clear_ua(&mut t);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x2, 0x87), (2, 0x2, 0x87)]
    );
    assert_sense(&t.err(&read10(0, 1), &[]), 0x02, 0x04, 0x0B);
}

#[test]
fn set_target_port_groups_takes_over_through_the_senders_group() {
    let (mut t, fake) = owned(1);
    // Another nexus of the LU, to see the unit attention.
    let other = gateway_nexus(3, 2);
    t.lu.nexus_added(other.id);
    // Its power-on unit attention first.
    let _ = t.lu.execute(
        &other,
        &scsi::Command {
            cdb: &[0u8; 6],
            data_out: &[],
            data_in_limit: 64,
        },
        &mut Vec::new(),
    );
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    let list = stpg_list(&[(0x0, 2), (0x2, 1)]);
    // A takeover is a cluster round trip and may wait behind another (the vigil's): the
    // engine runs it on the I/O threads, never on a network worker.
    assert!(t.lu.waits_for_device(&stpg_cdb(list.len() as u8)));
    t.ok(&stpg_cdb(list.len() as u8), &list);
    assert_eq!(fake.takes.load(Ordering::SeqCst), 1);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x2, 0x87), (2, 0x0, 0x87)]
    );
    t.ok(&write10(0, 1), &[9u8; 512]);
    // The other nexus is told; the sender is not.
    let mut data_in = Vec::new();
    let c = t.lu.execute(
        &other,
        &scsi::Command {
            cdb: &[0u8; 6],
            data_out: &[],
            data_in_limit: 0,
        },
        &mut data_in,
    );
    let s = c.sense.expect("unit attention");
    assert_sense(&s, 0x06, 0x2A, 0x06);
    // Asking again for what already is: nothing to take.
    t.ok(&stpg_cdb(list.len() as u8), &list);
    assert_eq!(fake.takes.load(Ordering::SeqCst), 1);
}

#[test]
fn set_target_port_groups_refuses_what_it_cannot_do() {
    let (mut t, fake) = owned(1);
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    // Another gateway's group cannot be made active from here.
    let remote = stpg_list(&[(0x0, 3)]);
    assert_sense(&t.err(&stpg_cdb(8), &remote), 0x05, 0x26, 0x00);
    let elsewhere = {
        let (mut t2, _) = owned(0);
        t2.nexus = gateway_nexus(2, 2);
        clear_ua(&mut t2);
        let list = stpg_list(&[(0x0, 1)]);
        t2.err(&stpg_cdb(8), &list)
    };
    assert_sense(&elsewhere, 0x05, 0x26, 0x00);
    // Our own group standby, transitioning, or a reserved state: refused.
    for state in [0x2, 0xF, 0x7] {
        let list = stpg_list(&[(state, 2)]);
        assert_sense(&t.err(&stpg_cdb(8), &list), 0x05, 0x26, 0x00);
    }
    // A list shorter than its header, not whole descriptors, or longer than the data.
    assert_sense(&t.err(&stpg_cdb(3), &[0, 0, 0]), 0x05, 0x1A, 0x00);
    assert_sense(&t.err(&stpg_cdb(6), &[0; 6]), 0x05, 0x1A, 0x00);
    assert_sense(&t.err(&stpg_cdb(12), &[0; 8]), 0x05, 0x1A, 0x00);
    // A failed takeover: SET TARGET PORT GROUPS COMMAND FAILED, nothing changed.
    fake.refuse.store(true, std::sync::atomic::Ordering::SeqCst);
    let list = stpg_list(&[(0x0, 2)]);
    assert_sense(&t.err(&stpg_cdb(8), &list), 0x0B, 0x67, 0x0A);
    assert!(!fake.is_active(2));
    assert_eq!(fake.takes.load(Ordering::SeqCst), 0);
    // An empty list does nothing.
    t.ok(&stpg_cdb(0), &[]);
}

#[test]
fn under_implicit_ownership_set_target_port_groups_is_not_offered() {
    let (mut t, fake) = owned(1);
    fake.implicit.store(true, Ordering::SeqCst);
    t.nexus = gateway_nexus(2, 2);
    clear_ua(&mut t);
    // TPGS = 01b: implicit only; the states and their supported bits as under explicit.
    let inquiry = t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    assert_eq!(inquiry[5] & 0x30, 0x10);
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x0, 0x87), (2, 0x2, 0x87)]
    );
    let list = stpg_list(&[(0x0, 2)]);
    assert_sense(&t.err(&stpg_cdb(8), &list), 0x05, 0x20, 0x00);
    assert_eq!(fake.takes.load(Ordering::SeqCst), 0);
    assert!(fake.is_active(1));
}

#[test]
fn without_an_owner_set_target_port_groups_is_not_offered() {
    let mut t = T::new();
    t.nexus = gateway_nexus(1, 1);
    clear_ua(&mut t);
    let list = stpg_list(&[(0x0, 1)]);
    assert!(!t.lu.waits_for_device(&stpg_cdb(8)));
    assert!(!t.lu.waits_for_device(&RTPG));
    assert_sense(&t.err(&stpg_cdb(8), &list), 0x05, 0x20, 0x00);
    let inquiry = t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    assert_eq!(inquiry[5] & 0x30, 0x10);
}

/// A non-owner gateway that ships to an owner in the same process: the owner's LU (with its
/// own store) run through a peer nexus per nexus here, as the engine's peer sessions do over
/// the network (a new one's POWER ON unit attention taken at once, as at its login).
struct Shipper {
    owner_lu: Arc<scsi::LogicalUnit>,
    /// Peer nexuses by the id of the nexus here.
    peers: std::sync::Mutex<std::collections::HashMap<u64, Nexus>>,
    shipped: AtomicUsize,
    resets: AtomicUsize,
    reservation_pokes: AtomicUsize,
    /// The owner cannot be reached: every ship fails as the engine's does (NOT READY,
    /// ASYMMETRIC ACCESS STATE TRANSITION).
    owner_gone: std::sync::atomic::AtomicBool,
}

impl Shipper {
    fn peer(&self, nexus: &Nexus) -> Nexus {
        let mut peers = self.peers.lock().unwrap();
        if let Some(p) = peers.get(&nexus.id) {
            return p.clone();
        }
        // The initiator's own port, through this gateway's port, as the owner's group.
        let mut peer = gateway_nexus(1000 + nexus.id, 1);
        peer.initiator_port = nexus.initiator_port.clone();
        let mut port = (*nexus.target_port).clone();
        port.group = 1;
        port.shipped = true;
        peer.target_port = Arc::new(port);
        self.owner_lu.nexus_added(peer.id);
        let _ = self.owner_lu.execute(
            &peer,
            &scsi::Command {
                cdb: &[0u8; 6],
                data_out: &[],
                data_in_limit: 0,
            },
            &mut Vec::new(),
        );
        peers.insert(nexus.id, peer.clone());
        peer
    }
}

impl Ownership for Shipper {
    fn is_active(&self, group: u16) -> bool {
        group == 1
    }
    fn take(&self, _: u16) -> std::io::Result<()> {
        Err(std::io::Error::other("not in this test"))
    }
    fn ships(&self) -> bool {
        true
    }
    fn non_owners_ship(&self) -> bool {
        true
    }
    fn ship(
        &self,
        nexus: &Nexus,
        cmd: &scsi::Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> scsi::Completion {
        self.shipped.fetch_add(1, Ordering::SeqCst);
        if self.owner_gone.load(Ordering::SeqCst) {
            return scsi::Completion::check_condition(scsi::Sense::not_ready_transition());
        }
        let peer = self.peer(nexus);
        self.owner_lu.execute(&peer, cmd, data_in)
    }
    fn reset_owner(&self, nexus: &Nexus) -> bool {
        self.resets.fetch_add(1, Ordering::SeqCst);
        let peer = self.peer(nexus);
        self.owner_lu.logical_unit_reset(peer.id);
        true
    }
    fn reservations_changed(&self, _: &Nexus) {
        self.reservation_pokes.fetch_add(1, Ordering::SeqCst);
    }
}

/// `t` is the gateway of group 2 (not the owner), shipping to `owner` (group 1's LU), whose
/// peer nexus has had its power-on unit attention.
fn shipping() -> (T, T, Arc<Shipper>) {
    let mut owner = T::new();
    owner.nexus = gateway_nexus(1, 1);
    let owns = Arc::new(FakeOwner::default());
    owns.owner.store(1, Ordering::SeqCst);
    owner.lu.set_ownership(owns);
    owner.store.inner.write_at(&[0x5A; 512], 0, false).unwrap();
    let shipper = Arc::new(Shipper {
        owner_lu: Arc::clone(&owner.lu),
        peers: Default::default(),
        shipped: AtomicUsize::new(0),
        resets: AtomicUsize::new(0),
        reservation_pokes: AtomicUsize::new(0),
        owner_gone: Default::default(),
    });
    let mut t = T::new();
    t.lu.set_ownership(shipper.clone());
    t.nexus = gateway_nexus(2, 2);
    t.lu.nexus_added(t.nexus.id);
    clear_ua(&mut t);
    (t, owner, shipper)
}

#[test]
fn a_non_owner_that_ships_is_active_non_optimized_and_runs_everything_at_the_owner() {
    let (mut t, owner, shipper) = shipping();
    assert_eq!(
        states(&t.ok(&RTPG, &[])),
        vec![(1, 0x0, 0x87), (2, 0x1, 0x87)]
    );
    // The transport is told to run these off its network threads; the rest stay local.
    for cdb in [&read10(0, 1)[..], &write10(0, 1)[..], &[0u8; 6][..]] {
        assert!(t.lu.ships_to_owner(&t.nexus, cdb), "{cdb:02x?}");
    }
    assert!(!t.lu.ships_to_owner(&t.nexus, &RTPG));
    assert!(!t.lu.ships_to_owner(&t.nexus, &[0x12, 0, 0, 0, 36, 0]));
    // Planned I/O is not planned here: the transport runs it through `execute`.
    let cmd = scsi::Command {
        cdb: &read10(0, 1),
        data_out: &[],
        data_in_limit: 512,
    };
    assert!(matches!(
        t.lu.plan(&t.nexus, &cmd, false),
        scsi::Plan::Execute
    ));
    // Reads return the owner's data; writes land in the owner's store, never in this one.
    assert_eq!(t.ok(&read10(0, 1), &[]), vec![0x5A; 512]);
    t.ok(&write10(8, 2), &[0xC3; 1024]);
    let mut back = vec![0u8; 1024];
    owner.store.inner.read_at(&mut back, 8 * 512).unwrap();
    assert_eq!(back, vec![0xC3; 1024]);
    assert_eq!(
        t.store.plain_writes.load(Ordering::SeqCst) + t.store.durable_writes.load(Ordering::SeqCst),
        0
    );
    // Errors come back as the owner sent them (LBA out of range: 05h/21h/00h).
    let s = t.err(&read10(u32::MAX - 1, 1), &[]);
    assert_sense(&s, 0x05, 0x21, 0x00);
    // A shorter Data-In allowance than the owner's answer is respected.
    t.limit = 100;
    let data = t.ok(&read10(0, 1), &[]);
    assert_eq!(data.len(), 100);
    // The local answers did not go to the owner.
    let before = shipper.shipped.load(Ordering::SeqCst);
    t.ok(&RTPG, &[]);
    t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    assert_eq!(shipper.shipped.load(Ordering::SeqCst), before);
}

#[test]
fn shipped_commands_meet_the_reservations_at_the_owner_as_their_own_initiator() {
    let (mut t, mut owner, shipper) = shipping();
    // Gateways share reservations through the image; here, the owner's copy is the one kept
    // current (a PERSISTENT RESERVE OUT through the non-owner tells the owner).
    let shared = Arc::new(SharedStore::default());
    t.lu.set_pr_persistence(shared.clone());
    owner.lu.set_pr_persistence(shared.clone());
    // Nexus 2 (here, group 2) registers and reserves WRITE EXCLUSIVE.
    let mut register = vec![0u8; 24];
    register[8..16].copy_from_slice(&0xABu64.to_be_bytes());
    t.ok(&[0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0], &register);
    let mut reserve = vec![0u8; 24];
    reserve[0..8].copy_from_slice(&0xABu64.to_be_bytes());
    t.ok(&[0x5F, 0x01, 0x01, 0, 0, 0, 0, 0, 24, 0], &reserve);
    assert_eq!(shipper.reservation_pokes.load(Ordering::SeqCst), 2);
    // (What the poke makes the engine's owner do: re-read the stored state.)
    owner.ok(&[0x5E, 0x00, 0, 0, 0, 0, 0, 0, 8, 0], &[]);
    // Another nexus here may not write: the owner refuses it.
    let holder = t.nexus.clone();
    t.nexus = gateway_nexus(3, 2);
    t.lu.nexus_added(t.nexus.id);
    clear_ua(&mut t);
    let c = t.run(&write10(0, 1), &[1u8; 512]);
    assert_eq!(c.status, scsi::Status::ReservationConflict);
    // The holder may: at the owner it is the same I_T nexus (its port, this gateway's port).
    t.nexus = holder.clone();
    t.ok(&write10(0, 1), &[2u8; 512]);
    // A direct nexus of the owner that is not the holder conflicts.
    owner.nexus = gateway_nexus(4, 1);
    owner.lu.nexus_added(owner.nexus.id);
    clear_ua(&mut owner);
    let c = owner.run(&write10(0, 1), &[3u8; 512]);
    assert_eq!(c.status, scsi::Status::ReservationConflict);
    // Released through the owner: a non-holder's shipped write passes at once, even though
    // this gateway's own copy still says reserved.
    owner.nexus = gateway_nexus(1002, 1);
    owner.nexus.initiator_port = holder.initiator_port.clone();
    let mut port = (*holder.target_port).clone();
    port.group = 1;
    port.shipped = true;
    owner.nexus.target_port = Arc::new(port);
    owner.ok(&[0x5F, 0x02, 0x01, 0, 0, 0, 0, 0, 24, 0], &reserve);
    t.nexus = gateway_nexus(3, 2);
    t.ok(&write10(0, 1), &[5u8; 512]);
}

#[test]
fn unit_attentions_from_the_owner_reach_every_nexus_and_resets_reach_the_owner() {
    let (t, owner, shipper) = shipping();
    let other = gateway_nexus(3, 2);
    t.lu.nexus_added(other.id);
    let tur = |lu: &scsi::LogicalUnit, n: &Nexus| {
        lu.execute(
            n,
            &scsi::Command {
                cdb: &[0u8; 6],
                data_out: &[],
                data_in_limit: 0,
            },
            &mut Vec::new(),
        )
        .sense
        .map(|s| (s.key, s.asc, s.ascq))
    };
    assert_eq!(tur(&t.lu, &other), Some((0x06, 0x29, 0x00)));
    assert_eq!(tur(&t.lu, &other), None);
    // A LOGICAL UNIT RESET at the owner: each nexus here learns it on its next shipped
    // command, once, through its own peer nexus.
    assert_eq!(tur(&t.lu, &t.nexus), None);
    owner.lu.logical_unit_reset(0);
    assert_eq!(tur(&t.lu, &t.nexus), Some((0x06, 0x29, 0x03)));
    assert_eq!(tur(&t.lu, &t.nexus), None);
    assert_eq!(tur(&t.lu, &other), Some((0x06, 0x29, 0x03)));
    assert_eq!(tur(&t.lu, &other), None);
    // A nexus gone here lets its peer nexus go (the engine closes the peer session).
    t.lu.nexus_lost(other.id);
    // A reset through this (non-owner) port is passed on to the owner; through the owner's
    // own port there is nothing to pass on.
    assert!(t.lu.reset_at_owner(&t.nexus));
    assert_eq!(shipper.resets.load(Ordering::SeqCst), 1);
    assert!(!owner.lu.reset_at_owner(&owner.nexus));
}

/// Reservations kept where both gateways see them (as an RBD image's metadata).
#[derive(Default)]
struct SharedStore(std::sync::Mutex<Option<scsi::PersistentReservations>>);

impl scsi::PrPersistence for SharedStore {
    fn save(&self, state: &scsi::PersistentReservations) -> std::io::Result<()> {
        *self.0.lock().unwrap() = Some(state.clone());
        Ok(())
    }
    fn shared(&self) -> bool {
        true
    }
    fn load(&self) -> std::io::Result<Option<scsi::PersistentReservations>> {
        Ok(self.0.lock().unwrap().clone())
    }
}

#[test]
fn a_shipped_command_meets_a_reservation_made_through_the_owner_a_moment_before() {
    let (mut t, mut owner, shipper) = shipping();
    let shared = Arc::new(SharedStore::default());
    t.lu.set_pr_persistence(shared.clone());
    owner.lu.set_pr_persistence(shared.clone());
    // Through the owner: register and reserve EXCLUSIVE ACCESS (saved to the shared store).
    owner.nexus = gateway_nexus(5, 1);
    owner.lu.nexus_added(5);
    clear_ua(&mut owner);
    let mut register = vec![0u8; 24];
    register[8..16].copy_from_slice(&0x77u64.to_be_bytes());
    owner.ok(&[0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0], &register);
    let mut reserve = vec![0u8; 24];
    reserve[0..8].copy_from_slice(&0x77u64.to_be_bytes());
    owner.ok(&[0x5F, 0x01, 0x03, 0, 0, 0, 0, 0, 24, 0], &reserve);
    // The non-owner never ran a PERSISTENT RESERVE command (its copy is empty), yet its
    // nexus's read meets the reservation: the owner checks it.
    let c = t.run(&read10(0, 1), &[]);
    assert_eq!(c.status, scsi::Status::ReservationConflict);
    assert!(shipper.shipped.load(Ordering::SeqCst) > 0);
    assert!(!t.lu.reservation_held());
}

/// What a transport that ships without waiting does: this LU's checks, then the owner's
/// answer through `done`.
fn ship_without_waiting(
    t: &T,
    nexus: &Nexus,
    cdb: &[u8],
    data_out: &[u8],
    limit: u32,
    read_only_mapping: bool,
) -> Result<(scsi::Completion, Vec<u8>), scsi::Completion> {
    let cmd = scsi::Command {
        cdb,
        data_out,
        data_in_limit: limit,
    };
    t.lu.admit_for_owner(nexus, &cmd, read_only_mapping)?;
    let (tx, rx) = std::sync::mpsc::channel();
    t.lu.ship_then(
        nexus,
        scsi::ShippedCommand::new(&cmd),
        Box::new(move |completion, data_in| {
            let _ = tx.send((completion, data_in));
        }),
    );
    Ok(rx.recv().expect("done is called"))
}

#[test]
fn shipping_without_waiting_checks_here_first_and_answers_as_the_owner() {
    let (t, owner, shipper) = shipping();
    // Reads come back from the owner within the allowance; writes land there.
    let (done, data) = ship_without_waiting(&t, &t.nexus, &read10(0, 1), &[], 100, false).unwrap();
    assert_eq!(done.status, scsi::Status::Good, "{:?}", done.sense);
    assert_eq!(data, vec![0x5A; 100]);
    let (done, _) =
        ship_without_waiting(&t, &t.nexus, &write10(8, 1), &[0xC3; 512], 0, false).unwrap();
    assert_eq!(done.status, scsi::Status::Good, "{:?}", done.sense);
    let mut back = vec![0u8; 512];
    owner.store.inner.read_at(&mut back, 8 * 512).unwrap();
    assert_eq!(back, vec![0xC3; 512]);
    // The owner's errors come back as it sent them (LBA out of range).
    let (done, _) =
        ship_without_waiting(&t, &t.nexus, &read10(u32::MAX - 1, 1), &[], 512, false).unwrap();
    assert_sense(done.sense.as_ref().unwrap(), 0x05, 0x21, 0x00);
    let shipped = shipper.shipped.load(Ordering::SeqCst);
    // A write through a read-only mapping is refused here and never shipped.
    let refused =
        ship_without_waiting(&t, &t.nexus, &write10(8, 1), &[0; 512], 0, true).unwrap_err();
    assert_sense(refused.sense.as_ref().unwrap(), 0x07, 0x27, 0x00);
    // A new nexus's unit attention is reported here, once, before anything ships.
    let fresh = gateway_nexus(3, 2);
    t.lu.nexus_added(fresh.id);
    let attention = ship_without_waiting(&t, &fresh, &read10(0, 1), &[], 512, false).unwrap_err();
    assert_eq!(attention.sense.as_ref().unwrap().key, 0x06);
    assert_eq!(shipper.shipped.load(Ordering::SeqCst), shipped);
    let (done, _) = ship_without_waiting(&t, &fresh, &read10(0, 1), &[], 512, false).unwrap();
    assert_eq!(done.status, scsi::Status::Good, "{:?}", done.sense);
    assert_eq!(shipper.shipped.load(Ordering::SeqCst), shipped + 1);
}

#[test]
fn a_gateway_that_became_the_owner_meanwhile_asks_for_a_retry_instead_of_shipping() {
    // The transport saw a non-owner; by the checks, this gateway's group owns the LU.
    let (mut t, _) = owned(2);
    t.nexus = gateway_nexus(2, 2);
    t.lu.nexus_added(t.nexus.id);
    clear_ua(&mut t);
    let answer = ship_without_waiting(&t, &t.nexus, &read10(0, 1), &[], 512, false).unwrap_err();
    assert_sense(answer.sense.as_ref().unwrap(), 0x02, 0x04, 0x0A);
}

/// A PERSISTENT RESERVE OUT parameter list: reservation key, service action key.
fn prout_list(key: u64, sa_key: u64) -> Vec<u8> {
    let mut list = vec![0u8; 24];
    list[0..8].copy_from_slice(&key.to_be_bytes());
    list[8..16].copy_from_slice(&sa_key.to_be_bytes());
    list
}

/// The unit attention (or other sense) a TEST UNIT READY of `nexus` gets from `lu`.
fn tur_sense(lu: &scsi::LogicalUnit, nexus: &Nexus) -> Option<(u8, u8, u8)> {
    let cmd = scsi::Command {
        cdb: &[0u8; 6],
        data_out: &[],
        data_in_limit: 0,
    };
    lu.execute(nexus, &cmd, &mut Vec::new())
        .sense
        .map(|s| (s.key, s.asc, s.ascq))
}

/// A PREEMPT through one gateway tells the preempted initiators connected to either gateway,
/// each once: the gateway that ran it tells its own nexuses at once, the other when it reads
/// the shared state (following it, or before its next PERSISTENT RESERVE command); a nexus
/// the owner knows only as shipped is told by the gateway that shipped it, not twice.
#[test]
fn reservation_unit_attentions_reach_initiators_of_every_gateway_once() {
    const PREEMPTED: Option<(u8, u8, u8)> = Some((0x06, 0x2A, 0x05));
    let (mut t, mut owner, _shipper) = shipping();
    let shared = Arc::new(SharedStore::default());
    t.lu.set_pr_persistence(shared.clone());
    owner.lu.set_pr_persistence(shared.clone());
    let register = [0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0];
    let reserve_we = [0x5F, 0x01, 0x01, 0, 0, 0, 0, 0, 24, 0];
    let preempt_we = [0x5F, 0x04, 0x01, 0, 0, 0, 0, 0, 24, 0];
    let read_keys = [0x5E, 0x00, 0, 0, 0, 0, 0, 0, 64, 0];
    // Through the non-owner: nexus 2 registers 0xB, nexus 3 registers 0xA.
    let b2 = t.nexus.clone();
    t.ok(&register, &prout_list(0, 0xB));
    let b3 = gateway_nexus(3, 2);
    t.lu.nexus_added(b3.id);
    t.nexus = b3.clone();
    clear_ua(&mut t);
    t.ok(&register, &prout_list(0, 0xA));
    // Through the owner: nexus 5 registers 0xA as well and reserves WRITE EXCLUSIVE.
    let a5 = gateway_nexus(5, 1);
    owner.lu.nexus_added(a5.id);
    owner.nexus = a5.clone();
    clear_ua(&mut owner);
    owner.ok(&register, &prout_list(0, 0xA));
    owner.ok(&reserve_we, &prout_list(0xA, 0));
    // Nexus 2 reads through shipping: the owner now knows its peer nexus.
    t.nexus = b2.clone();
    t.ok(&read10(0, 1), &[]);

    // Nexus 5 (owner) preempts 0xB: nexus 2's registration goes. The owner does not tell the
    // peer nexus; the non-owner tells nexus 2 when it follows the shared state.
    owner.ok(&preempt_we, &prout_list(0xA, 0xB));
    assert_eq!(tur_sense(&t.lu, &b2), None, "not followed yet");
    t.lu.replace_reservations(&shared.load().unwrap().unwrap());
    assert_eq!(tur_sense(&t.lu, &b2), PREEMPTED);
    assert_eq!(tur_sense(&t.lu, &b2), None, "once");
    // Not again from the owner: a read ships, and comes back GOOD (WRITE EXCLUSIVE).
    t.nexus = b2.clone();
    t.ok(&read10(0, 1), &[]);
    assert_eq!(tur_sense(&t.lu, &b3), None, "nexus 3 was not preempted");
    // Following the same state again raises nothing.
    t.lu.replace_reservations(&shared.load().unwrap().unwrap());
    assert_eq!(tur_sense(&t.lu, &b2), None);

    // Nexus 2 registers again (0xC) through the non-owner and preempts key 0xA, held by nexus
    // 3 (here: told at once) and nexus 5 (the owner's: told when the owner reads the state,
    // here before its next PERSISTENT RESERVE command).
    t.ok(&register, &prout_list(0, 0xC));
    t.ok(&preempt_we, &prout_list(0xC, 0xA));
    assert_eq!(tur_sense(&t.lu, &b3), PREEMPTED);
    assert_eq!(tur_sense(&t.lu, &b3), None);
    t.lu.replace_reservations(&shared.load().unwrap().unwrap());
    assert_eq!(
        tur_sense(&t.lu, &b3),
        None,
        "its own notice, not raised twice"
    );
    assert_eq!(
        tur_sense(&owner.lu, &a5),
        None,
        "the owner has not read it yet"
    );
    let keys = owner.ok(&read_keys, &[]);
    assert_eq!(
        &keys[4..8],
        &8u32.to_be_bytes(),
        "only 0xC is left: {keys:02x?}"
    );
    assert_eq!(tur_sense(&owner.lu, &a5), PREEMPTED);
    assert_eq!(tur_sense(&owner.lu, &a5), None);
    // The shared state keeps the notices, numbered.
    let stored = shared.load().unwrap().unwrap();
    let seqs: Vec<u64> = stored.notices.iter().map(|n| n.seq).collect();
    assert_eq!(seqs, vec![1, 2]);
}

/// A shared state keeps only the last [`scsi::NOTICES_KEPT`] notices.
#[test]
fn a_shared_reservation_state_keeps_a_bounded_number_of_notices() {
    let (mut t, owner, _shipper) = shipping();
    let shared = Arc::new(SharedStore::default());
    t.lu.set_pr_persistence(shared.clone());
    owner.lu.set_pr_persistence(shared.clone());
    let register = [0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0];
    let preempt_we = [0x5F, 0x04, 0x01, 0, 0, 0, 0, 0, 24, 0];
    let victim = gateway_nexus(7, 2);
    t.lu.nexus_added(victim.id);
    let me = t.nexus.clone();
    t.ok(&register, &prout_list(0, 1));
    for round in 0..(scsi::NOTICES_KEPT as u64 + 4) {
        t.nexus = victim.clone();
        let _ = t.run(&[0u8; 6], &[]);
        t.ok(&register, &prout_list(0, 100 + round));
        t.nexus = me.clone();
        t.ok(&preempt_we, &prout_list(1, 100 + round));
    }
    let stored = shared.load().unwrap().unwrap();
    assert_eq!(stored.notices.len(), scsi::NOTICES_KEPT);
    let last = scsi::NOTICES_KEPT as u64 + 4;
    assert_eq!(stored.notices.last().map(|n| n.seq), Some(last));
    assert_eq!(
        stored.notices.first().map(|n| n.seq),
        Some(last - scsi::NOTICES_KEPT as u64 + 1)
    );
}

/// What a read-only mapping may not do: take the LU over (SET TARGET PORT GROUPS would fence
/// the owner gateway's sessions), change its mode pages or its reservations. Through a
/// read-write mapping of the same LU the same commands run.
#[test]
fn a_read_only_mapping_changes_nothing_others_see_of_the_lu() {
    let (t, fake) = owned(1);
    t.lu.set_spc2_reservations(true);
    let read_only = scsi::LunMap::new(vec![(0, t.lu.clone(), true)]).unwrap();
    let read_write = scsi::LunMap::new(vec![(0, t.lu.clone(), false)]).unwrap();
    // Through the standby gateway (group 2) for SET TARGET PORT GROUPS, which takes the LU
    // over; through the owner's (group 1) for the rest, which standby refuses anyway.
    let standby = gateway_nexus(2, 2);
    let active = gateway_nexus(3, 1);
    let run = |map: &scsi::LunMap, nexus: &Nexus, cdb: &[u8], data_out: &[u8]| {
        let cmd = scsi::Command {
            cdb,
            data_out,
            data_in_limit: 4096,
        };
        map.execute(nexus, 0, &cmd, &mut Vec::new())
    };
    for nexus in [&standby, &active] {
        t.lu.nexus_added(nexus.id);
        let _ = run(&read_only, nexus, &[0u8; 6], &[]); // the power-on unit attention
    }
    let list = stpg_list(&[(0x0, 2), (0x2, 1)]);
    let stpg = stpg_cdb(list.len() as u8);
    // MODE SELECT(10) of the caching page flipping WCE; PERSISTENT RESERVE OUT REGISTER.
    let wce = t.lu.write_cache_enabled();
    let mut caching = vec![0u8; 8];
    caching.extend_from_slice(&[0x08, 0x12, if wce { 0 } else { 0x04 }]);
    caching.extend_from_slice(&[0u8; 17]);
    let mode_select = [0x55, 0x10, 0, 0, 0, 0, 0, 0, caching.len() as u8, 0];
    let mut register = vec![0u8; 24];
    register[8..16].copy_from_slice(&7u64.to_be_bytes());
    let prout = [0x5F, 0x06, 0, 0, 0, 0, 0, 0, 24, 0];
    let reserve = [0x16, 0, 0, 0, 0, 0];
    for (what, nexus, cdb, data) in [
        ("SET TARGET PORT GROUPS", &standby, &stpg[..], &list[..]),
        ("MODE SELECT", &active, &mode_select[..], &caching[..]),
        ("PERSISTENT RESERVE OUT", &active, &prout[..], &register[..]),
        ("RESERVE(6)", &active, &reserve[..], &[][..]),
    ] {
        let c = run(&read_only, nexus, cdb, data);
        let s = c.sense.unwrap_or_else(|| panic!("{what}: {:?}", c.status));
        assert_sense(&s, 0x07, 0x27, 0x00);
    }
    assert_eq!(
        fake.takes.load(Ordering::SeqCst),
        0,
        "the owner did not move"
    );
    assert_eq!(t.lu.write_cache_enabled(), wce);
    assert_eq!(t.lu.pr_generation(), 0);
    // Through a read-write mapping the same commands run.
    let c = run(&read_write, &active, &mode_select, &caching);
    assert_eq!(c.status, scsi::Status::Good, "{:?}", c.sense);
    assert_eq!(t.lu.write_cache_enabled(), !wce);
    let c = run(&read_write, &active, &prout, &register);
    assert_eq!(c.status, scsi::Status::Good, "{:?}", c.sense);
    let _ = run(&read_write, &standby, &[0u8; 6], &[]); // MODE PARAMETERS CHANGED
    let c = run(&read_write, &standby, &stpg, &list);
    assert_eq!(c.status, scsi::Status::Good, "{:?}", c.sense);
    assert_eq!(fake.takes.load(Ordering::SeqCst), 1);
}

#[test]
fn a_path_check_through_a_non_owner_is_good_while_the_owner_cannot_be_asked() {
    let (mut t, owner, shipper) = shipping();
    // Shipped while the owner answers: its answer (here GOOD), its unit attentions included.
    t.ok(&[0u8; 6], &[]);
    owner.lu.logical_unit_reset(0);
    assert_sense(&t.err(&[0u8; 6], &[]), 0x06, 0x29, 0x03);
    // The owner gone (a takeover about to happen): TEST UNIT READY says this path is ready,
    // what needs the medium is retried (NOT READY, ASYMMETRIC ACCESS STATE TRANSITION).
    shipper.owner_gone.store(true, Ordering::SeqCst);
    let shipped = shipper.shipped.load(Ordering::SeqCst);
    t.ok(&[0u8; 6], &[]);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x02, 0x04, 0x0A);
    assert_eq!(shipper.shipped.load(Ordering::SeqCst), shipped + 2);
    // This path's own checks still answer first: a unit attention here is reported.
    t.lu.logical_unit_reset(0);
    assert_sense(&t.err(&[0u8; 6], &[]), 0x06, 0x29, 0x03);
    t.ok(&[0u8; 6], &[]);
}
