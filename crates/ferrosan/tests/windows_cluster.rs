//! What Windows failover clustering's storage validation asks of a LUN, call by call, with two
//! (or more) cluster nodes as initiator names and each node's paths through both portal groups
//! — on a RAM LU, a file on disk, and an RBD image behind two gateways: first every path through
//! one portal group (one gateway), then the nodes and their paths spread over both.
//!
//! The calls are those of [MS-CSVP] (ClusPrep): CprepDiskPRRegister is REGISTER AND IGNORE
//! EXISTING KEY, CprepDiskPRUnRegister the same with key 0, CprepDiskPRReserve/Release/Clear,
//! CprepDiskPRPreempt (PREEMPT, never PREEMPT AND ABORT), CprepDiskIsPRPresent (READ
//! RESERVATION), CprepDiskIsPRPresent3 (READ KEYS). A cluster reserves Write Exclusive –
//! Registrants Only: every node registers, the owner reserves, only registrants write.
//! Arbitration (Validate Disk Arbitration, Validate Multiple Arbitration) is a challenge and a
//! defence: the owner scrubs foreign keys every 3 s; a challenger registers, waits 6 s and, if
//! its key survived (the owner is gone), preempts the owner. Here the intervals are scaled down
//! (0.3 s and 1.2 s); the rule is the same. VPD validation requires one unique NAA identifier
//! for the LU, the same through every path and node.
//!
//! The same cluster over NVMe/TCP (vSphere 8.0 U3's clustered VMDKs, a Windows node's NVMe/TCP
//! initiator): NVMe reservations of the Write Exclusive – All Registrants kind on a 512-byte
//! namespace, through both portal groups (both gateways for RBD), and mixed with an iSCSI node
//! on the same device — one reservation table whichever door.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::array::{pr, read_len, Array, Backing, Path, GOOD, RESERVATION_CONFLICT};
use common::nvme_host;
use common::pseudo_random_bytes;
use initiator::session::Transfer;
use nvme::sqe::Status;

const NODE1: &str = "iqn.1991-05.com.microsoft:node1.cluster.example";
const NODE2: &str = "iqn.1991-05.com.microsoft:node2.cluster.example";
const WERO: u8 = pr::WRITE_EXCLUSIVE_REGISTRANTS_ONLY;
/// Keys as a cluster makes them: a node-specific high half, "MSFT" below.
const KEY1: u64 = 0x0000_0001_4D53_4654;
const KEY2: u64 = 0x0000_0002_4D53_4654;
const CONFLICT: (u8, Option<(u8, u8, u8)>) = (RESERVATION_CONFLICT, None);

/// The path node `n` (0-based) uses first: nodes alternate portal groups (gateways for RBD).
fn node(array: &Array, name: &str, n: usize) -> Path {
    let mut p = array.path(n % 2, name);
    assert_eq!(p.settle(), GOOD, "{name}: {}", array.output());
    p
}

fn block(seed: u64) -> Vec<u8> {
    pseudo_random_bytes(4096, seed)
}

/// Validate SCSI device Vital Product Data: VPD 80h and the LU's NAA designator of 83h are the
/// same through every path of every node; each path names its own relative port and group.
fn vpd_is_one_disk_on_every_path(array: &Array) {
    let mut seen = Vec::new();
    for (name, path) in [(NODE1, 0), (NODE1, 1), (NODE2, 0), (NODE2, 1)] {
        let mut p = array.path(path, name);
        let (status, _, serial) = p.run(&[0x12, 1, 0x80, 0, 255, 0], read_len(255));
        assert_eq!(status, 0);
        let (status, _, ids) = p.run(&[0x12, 1, 0x83, 1, 0, 0], read_len(256));
        assert_eq!(status, 0);
        let d = designators(&ids);
        let naa: Vec<_> = d
            .iter()
            .filter(|(assoc, kind, _)| *assoc == 0 && *kind == 3)
            .collect();
        assert_eq!(naa.len(), 1, "one NAA designator for the LU: {d:02x?}");
        let port = d.iter().find(|(a, k, _)| *a == 1 && *k == 4).expect("RTPI");
        let group = d.iter().find(|(a, k, _)| *a == 1 && *k == 5).expect("TPG");
        assert_eq!(port.2[2..], group.2[2..], "port {path}: one port per group");
        assert_eq!(
            u16::from_be_bytes([group.2[2], group.2[3]]),
            array.portal_of(path) as u16 + 1
        );
        seen.push((serial[4..].to_vec(), naa[0].2.clone()));
    }
    assert!(!seen[0].0.is_empty(), "a unit serial number");
    assert!(seen.iter().all(|s| *s == seen[0]), "{seen:02x?}");
}

/// (association, designator type, designator) of each VPD 83h descriptor.
fn designators(page: &[u8]) -> Vec<(u8, u8, Vec<u8>)> {
    let end = (4 + usize::from(u16::from_be_bytes([page[2], page[3]]))).min(page.len());
    let mut out = Vec::new();
    let mut at = 4;
    while at + 4 <= end {
        let len = usize::from(page[at + 3]);
        let value = page[at + 4..(at + 4 + len).min(end)].to_vec();
        out.push(((page[at + 1] >> 4) & 3, page[at + 1] & 0x0F, value));
        at += 4 + len;
    }
    out
}

/// Validate SCSI-3 Persistent Reservation and Validate Disk Failover: register, reserve, a
/// second node registers and cannot reserve, preempts, owns the disk with the first node's data;
/// the first node is told (REGISTRATIONS PREEMPTED) and may no longer write; release, clear,
/// unregister.
fn reservation_sequence(array: &Array) {
    let mut n1 = node(array, NODE1, 0);
    let mut n2 = node(array, NODE2, 1);
    assert_eq!(n1.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY1), GOOD);
    assert_eq!(n1.read_keys(), vec![KEY1]);
    assert_eq!(n1.read_reservation(), None, "IsPRPresent: nothing yet");
    assert_eq!(n1.prout(pr::RESERVE, WERO, KEY1, 0), GOOD);
    assert_eq!(n2.read_reservation(), Some((KEY1, WERO)), "node 2 sees it");
    assert_eq!(n1.write(8, &block(1)), GOOD, "the owner writes");
    // Not registered: reads pass, writes conflict.
    assert_eq!(n2.read(8, 8).0, 0);
    assert_eq!(n2.write(8, &block(2)), CONFLICT);
    assert_eq!(n2.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY2), GOOD);
    let mut keys = n2.read_keys();
    keys.sort_unstable();
    assert_eq!(keys, vec![KEY1, KEY2]);
    assert_eq!(
        n2.prout(pr::RESERVE, WERO, KEY2, 0),
        CONFLICT,
        "held by node 1"
    );
    // A registrant writes under Registrants Only.
    assert_eq!(n2.write(16, &block(3)), GOOD);
    // Failover: node 2 preempts node 1 and owns the disk, with node 1's data.
    assert_eq!(n2.prout(pr::PREEMPT, WERO, KEY2, KEY1), GOOD);
    assert_eq!(n2.read_reservation(), Some((KEY2, WERO)));
    assert_eq!(n2.read_keys(), vec![KEY2]);
    let (status, _, data) = n2.read(8, 8);
    assert_eq!((status, data == block(1)), (0, true), "node 1's data");
    assert_eq!(
        n1.answer(&[0; 6], Transfer::None),
        (0x02, Some(pr::PREEMPTED)),
        "node 1 is told its registration went"
    );
    assert_eq!(n1.write(8, &block(4)), CONFLICT, "node 1 is fenced");
    assert_eq!(n1.read_reservation(), Some((KEY2, WERO)));
    // Release, clear, unregister.
    assert_eq!(n2.prout(pr::RELEASE, WERO, KEY2, 0), GOOD);
    assert_eq!(n1.read_reservation(), None);
    assert_eq!(n2.prout(pr::CLEAR, 0, KEY2, 0), GOOD);
    assert_eq!(n1.read_keys(), Vec::<u64>::new());
    assert_eq!(
        n1.prout(pr::REGISTER_AND_IGNORE, 0, 0, 0),
        GOOD,
        "UnRegister"
    );
    assert_eq!(n1.settle(), GOOD);
    assert_eq!(
        n1.write(8, &block(5)),
        GOOD,
        "no reservation: anyone writes"
    );
}

/// The owner's defence (scaled down): every `DEFEND`, read the keys and preempt every key but
/// its own, keeping the reservation. Runs until `stop`.
const DEFEND: Duration = Duration::from_millis(300);
/// How long a challenger waits before it judges the owner gone (twice a defence period in
/// Windows: 6 s against 3 s; here four, as loopback timing on a loaded machine varies).
const CHALLENGE: Duration = Duration::from_millis(1200);

fn defend(mut owner: Path, stop: Arc<AtomicBool>) -> Path {
    while !stop.load(Ordering::Acquire) {
        for key in owner.read_keys() {
            if key != KEY1 {
                assert_eq!(owner.prout(pr::PREEMPT, WERO, KEY1, key), GOOD);
            }
        }
        std::thread::sleep(DEFEND);
    }
    owner
}

/// A challenger's arbitration: register, wait, and preempt the owner if our key survived.
/// Whether it won.
fn challenge(challenger: &mut Path) -> bool {
    assert_eq!(challenger.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY2), GOOD);
    std::thread::sleep(CHALLENGE);
    challenger.settle();
    if !challenger.read_keys().contains(&KEY2) {
        return false;
    }
    let holder = challenger.read_reservation().map(|(key, _)| key);
    assert_eq!(
        challenger.prout(pr::PREEMPT, WERO, KEY2, holder.unwrap_or(KEY1)),
        GOOD
    );
    true
}

/// Validate Disk Arbitration: a live owner keeps the disk against a challenger; a silent one
/// loses it, and its writes are refused from then on.
fn disk_arbitration(array: &Array) {
    let mut owner = node(array, NODE1, 0);
    let mut challenger = node(array, NODE2, 1);
    assert_eq!(owner.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY1), GOOD);
    assert_eq!(owner.prout(pr::RESERVE, WERO, KEY1, 0), GOOD);
    let stop = Arc::new(AtomicBool::new(false));
    let defender = {
        let stop = stop.clone();
        std::thread::spawn(move || defend(owner, stop))
    };
    let won = challenge(&mut challenger);
    stop.store(true, Ordering::Release);
    let mut owner = defender.join().expect("defender");
    assert!(!won, "a defended disk was lost");
    assert_eq!(challenger.settle(), GOOD);
    assert_eq!(challenger.write(0, &block(6)), CONFLICT);
    assert_eq!(owner.read_reservation(), Some((KEY1, WERO)));
    // The owner falls silent: the challenger wins and the old owner is fenced.
    assert!(challenge(&mut challenger), "a silent owner kept the disk");
    assert_eq!(challenger.read_reservation(), Some((KEY2, WERO)));
    assert_eq!(challenger.write(0, &block(7)), GOOD);
    assert_eq!(owner.settle(), GOOD);
    assert_eq!(owner.write(0, &block(8)), CONFLICT);
    assert_eq!(challenger.prout(pr::CLEAR, 0, KEY2, 0), GOOD);
}

/// Validate Multiple Arbitration: four nodes, each registered, reserve at once through both
/// paths; exactly one wins and all see the same owner.
fn multiple_arbitration(array: &Array) {
    const NODES: u64 = 4;
    let barrier = Arc::new(Barrier::new(NODES as usize));
    let racers: Vec<_> = (0..NODES)
        .map(|n| {
            let mut p = node(array, &format!("{NODE1}-{n}"), n as usize);
            let key = KEY1 + (n << 32);
            assert_eq!(p.prout(pr::REGISTER_AND_IGNORE, 0, 0, key), GOOD);
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let answer = p.prout(pr::RESERVE, WERO, key, 0);
                (key, answer, p)
            })
        })
        .collect();
    let mut results: Vec<_> = racers
        .into_iter()
        .map(|r| r.join().expect("racer"))
        .collect();
    let winners: Vec<u64> = results
        .iter()
        .filter(|(_, answer, _)| *answer == GOOD)
        .map(|(key, _, _)| *key)
        .collect();
    assert_eq!(
        winners.len(),
        1,
        "{:?}",
        results.iter().map(|r| r.1).collect::<Vec<_>>()
    );
    for (key, answer, p) in &mut results {
        if *key != winners[0] {
            assert_eq!(*answer, CONFLICT);
        }
        assert_eq!(p.read_reservation(), Some((winners[0], WERO)));
    }
    let (key, _, first) = &mut results[0];
    assert_eq!(first.prout(pr::CLEAR, 0, *key, 0), GOOD);
}

/// MPIO: a node registers its key on both of its paths (as the Microsoft DSM does) and reserves
/// through one; that path's session dies and comes back (the same I_T nexus): the reservation
/// held throughout, the node wrote through its other path meanwhile, and the other node was
/// refused all along.
fn reservation_survives_a_path_change(array: &Array) {
    let mut first = node(array, NODE1, 0);
    let mut second = node(array, NODE1, 1);
    let mut other = node(array, NODE2, 1);
    assert_eq!(first.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY1), GOOD);
    assert_eq!(second.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY1), GOOD);
    assert_eq!(first.prout(pr::RESERVE, WERO, KEY1, 0), GOOD);
    let isid = first.isid;
    drop(first); // the path fails: no logout
    assert_eq!(second.write(24, &block(9)), GOOD, "the other path writes");
    assert_eq!(other.write(24, &block(10)), CONFLICT);
    let mut first = array.path_with_isid(0, NODE1, isid);
    first.settle();
    assert_eq!(first.read_reservation(), Some((KEY1, WERO)));
    let (status, _, data) = first.read(24, 8);
    assert_eq!((status, data == block(9)), (0, true));
    assert_eq!(
        first.prout(pr::RELEASE, WERO, KEY1, 0),
        GOOD,
        "still the holder"
    );
    assert_eq!(other.settle(), GOOD);
    assert_eq!(other.write(24, &block(11)), GOOD);
    assert_eq!(first.prout(pr::CLEAR, 0, KEY1, 0), GOOD);
}

/// The whole validation through one portal group (one gateway), then with the nodes and their
/// paths spread over both.
/// NVMe host NQNs of the cluster's nodes (Windows names its host after the machine).
const NVME_NODE1: &str = "nqn.1991-05.com.microsoft:node1.cluster.example";
const NVME_NODE2: &str = "nqn.1991-05.com.microsoft:node2.cluster.example";
const NVME_OUTSIDER: &str = "nqn.1991-05.com.microsoft:outsider.example";
const WEAR: u8 = nvme_host::rtype::WRITE_EXCLUSIVE_ALL_REGISTRANTS;

/// The cluster over NVMe/TCP, as a clustered VMDK or a Windows node with an NVMe/TCP initiator
/// uses it: a 512-byte namespace offering Write Exclusive – All Registrants; each node
/// registers (through both of its paths, one host), the owner acquires, every registrant
/// writes and an outsider is fenced; a node preempts another's key (that node is fenced on
/// every path, the reservation stays with the registrants), a preempt with key 0 leaves the
/// preempting node alone; release and clear end it.
fn nvme_reservation_sequence(array: &Array) {
    let mut n1 = array.nvme(0, NVME_NODE1, 8);
    let mut n1b = array.nvme(1, NVME_NODE1, 8);
    let mut n2 = array.nvme(1, NVME_NODE2, 8);
    let mut outsider = array.nvme(0, NVME_OUTSIDER, 8);
    let ns = nvme_host::identify_namespace(&mut n1, 1);
    assert_eq!(nvme_host::block_bytes(&ns), 512, "a 512-byte namespace");
    assert_ne!(
        ns[31] & 1 << 5,
        0,
        "RESCAP: Write Exclusive - All Registrants"
    );
    assert_ne!(ns[30] & 1, 0, "NMIC: shared by several controllers");
    assert_eq!(nvme_host::register(&mut n1, KEY1), Status::SUCCESS);
    assert_eq!(nvme_host::register(&mut n2, KEY2), Status::SUCCESS);
    assert_eq!(
        nvme_host::acquire(&mut n1, 0, WEAR, KEY1, 0),
        Status::SUCCESS
    );
    let seen = nvme_host::report(&mut n2);
    assert_eq!(seen.kind, WEAR);
    let mut held: Vec<_> = seen.registrants.iter().map(|r| (r.0, r.2)).collect();
    held.sort();
    assert_eq!(
        held,
        [(true, KEY1), (true, KEY2)],
        "every registrant holds it"
    );
    // Every registrant writes, through any of its paths; an outsider reads and is fenced.
    for (h, seed) in [(&mut n1, 1), (&mut n1b, 2), (&mut n2, 3)] {
        assert_eq!(nvme_host::write(h, 8, block(seed)), Status::SUCCESS);
    }
    assert_eq!(
        nvme_host::write(&mut outsider, 8, block(4)),
        Status::RESERVATION_CONFLICT
    );
    assert_eq!(
        outsider.read(1, 8, 8, 512).expect("an outsider reads"),
        block(3)
    );
    // Node 2 preempts node 1's key: node 1 is fenced on both paths; the registrants keep it.
    assert_eq!(
        nvme_host::acquire(&mut n2, 1, WEAR, KEY2, KEY1),
        Status::SUCCESS
    );
    for h in [&mut n1, &mut n1b] {
        assert_eq!(
            nvme_host::write(h, 8, block(5)),
            Status::RESERVATION_CONFLICT
        );
    }
    let seen = nvme_host::report(&mut n1);
    assert_eq!((seen.kind, seen.registrants.len()), (WEAR, 1));
    assert_eq!(seen.registrants[0].2, KEY2);
    // Node 1 joins again and writes; a preempt with key 0 removes every other registrant.
    assert_eq!(nvme_host::register(&mut n1b, KEY1), Status::SUCCESS);
    assert_eq!(nvme_host::write(&mut n1, 8, block(6)), Status::SUCCESS);
    assert_eq!(
        nvme_host::acquire(&mut n2, 1, WEAR, KEY2, 0),
        Status::SUCCESS
    );
    assert_eq!(
        nvme_host::write(&mut n1, 8, block(7)),
        Status::RESERVATION_CONFLICT
    );
    // Release: anyone writes again; clear: no registration left.
    assert_eq!(nvme_host::release(&mut n2, 0, WEAR, KEY2), Status::SUCCESS);
    assert_eq!(
        nvme_host::write(&mut outsider, 8, block(8)),
        Status::SUCCESS
    );
    assert_eq!(nvme_host::release(&mut n2, 1, 0, KEY2), Status::SUCCESS);
    assert_eq!(
        nvme_host::report(&mut n1),
        nvme_host::Report {
            kind: 0,
            registrants: Vec::new()
        }
    );
}

/// A cluster with a node on each door: the NVMe node's All Registrants reservation admits the
/// iSCSI node's writes once it registers (SCSI sees type 7h, key 0) and fences an unregistered
/// initiator; the iSCSI node preempts the NVMe node's key and fences it.
fn nvme_beside_iscsi(array: &Array) {
    let mut nvme_node = array.nvme(0, NVME_NODE1, 8);
    let mut iscsi_node = node(array, NODE2, 1);
    let mut stranger = node(array, "iqn.1991-05.com.microsoft:stranger", 0);
    assert_eq!(nvme_host::register(&mut nvme_node, KEY1), Status::SUCCESS);
    assert_eq!(
        nvme_host::acquire(&mut nvme_node, 0, WEAR, KEY1, 0),
        Status::SUCCESS
    );
    assert_eq!(
        iscsi_node.write(16, &block(9)),
        CONFLICT,
        "not yet registered"
    );
    assert_eq!(iscsi_node.prout(pr::REGISTER_AND_IGNORE, 0, 0, KEY2), GOOD);
    assert_eq!(iscsi_node.write(16, &block(10)), GOOD);
    assert_eq!(
        iscsi_node.read_reservation(),
        Some((0, 7)),
        "All Registrants, key 0"
    );
    assert_eq!(stranger.write(16, &block(11)), CONFLICT);
    assert_eq!(iscsi_node.prout(pr::PREEMPT, 7, KEY2, KEY1), GOOD);
    assert_eq!(
        nvme_host::write(&mut nvme_node, 16, block(12)),
        Status::RESERVATION_CONFLICT
    );
    assert_eq!(nvme_node.read(1, 16, 8, 512).expect("read"), block(10));
    assert_eq!(iscsi_node.prout(pr::CLEAR, 0, KEY2, 0), GOOD);
    assert_eq!(stranger.settle(), GOOD);
    assert_eq!(stranger.write(16, &block(13)), GOOD);
}

fn validate(backing: Backing, tag: &str) {
    let array = Array::start(backing, tag);
    for spread in [false, true] {
        array.spread_paths(spread);
        vpd_is_one_disk_on_every_path(&array);
        reservation_sequence(&array);
        disk_arbitration(&array);
        multiple_arbitration(&array);
        reservation_survives_a_path_change(&array);
        nvme_reservation_sequence(&array);
        nvme_beside_iscsi(&array);
    }
}

#[test]
fn windows_cluster_validation_on_ram() {
    validate(Backing::Ram, "wsfc-ram");
}

#[test]
fn windows_cluster_validation_on_disk() {
    validate(Backing::Disk, "wsfc-disk");
}

#[test]
fn windows_cluster_validation_across_two_rbd_gateways() {
    validate(Backing::Rbd, "wsfc-rbd");
}
