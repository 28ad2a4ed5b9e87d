//! What VMware ESXi's NVMe/TCP initiator relies on, as ESXi issues it, on a RAM namespace, a
//! file on disk and an RBD image behind two gateways, each reached through two portal groups:
//! - connect and identify: an ESXi host NQN, several I/O queues of 128 entries, and the
//!   controller and namespace fields its NVMe-oF stack reads — ANA reporting (VMware: "the
//!   namespaces cannot be registered until the active path is discovered"), the change notices,
//!   fused Compare and Write, Dataset Management, Write Zeroes, reservations, SGLs, a shared
//!   namespace with a stable identifier (the device's `eui.` name) the same through every path;
//! - the ANA log at connect (one optimized path) and after a change made while I/O runs on both
//!   paths: each controller hears of it, the inaccessible path refuses I/O with the ANA status
//!   ESXi fails over on, the other serves throughout, and the way back;
//! - a namespace grown live: every controller, through every portal group and gateway, hears
//!   Namespace Attribute Changed, the Changed Namespace List names it, Identify shows the size;
//! - VMFS's ATS as fused Compare and Write: hosts' heartbeats on their own blocks and a lock
//!   block they contend for, through both paths — never a false miscompare, and the successful
//!   writes of the lock form one chain (each compared against the one before);
//! - UNMAP as Dataset Management (deallocate, several ranges) and zeroing as Write Zeroes: the
//!   blocks read zeros, their neighbours are untouched.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::array::{Array, Backing, LU_BYTES};
use common::nvme_host;
use common::pseudo_random_bytes;
use initiator::nvme::{self as host, NvmeHost, QueueConn};
use nvme::controller::Notice;
use nvme::sqe::Status;

const ESX: &str = "nqn.2014-08.com.vmware:nvme:esx01";
const BLOCK: usize = 512;
/// The I/O queue size the hosts here ask for (SQSIZE is 0's based).
const QUEUE_ENTRIES: u16 = 128;

fn le16(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([d[at], d[at + 1]])
}

fn le32(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
}

fn le64(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().unwrap())
}

/// The Identify Controller fields ESXi's NVMe-oF stack needs from a controller.
fn controller_fields_esxi_needs(id: &[u8], nqn: &str) {
    assert!(id[768..].starts_with(nqn.as_bytes()), "SUBNQN");
    assert_eq!(
        id[76] & 0b1010,
        0b1010,
        "CMIC: several controllers, ANA reporting"
    );
    let oaes = le32(id, 92);
    assert_ne!(oaes & 1 << 8, 0, "OAES: namespace attribute notices");
    assert_ne!(oaes & 1 << 11, 0, "OAES: ANA change notices");
    assert_eq!(
        id[343] & 0b111,
        0b111,
        "ANACAP: optimized, non-optimized, inaccessible"
    );
    assert!(
        le32(id, 344) >= 1 && le32(id, 348) >= 1,
        "ANAGRPMAX, NANAGRPID"
    );
    let oncs = le16(id, 520);
    for (bit, what) in [
        (0, "Compare"),
        (2, "Dataset Management"),
        (3, "Write Zeroes"),
    ] {
        assert_ne!(oncs & 1 << bit, 0, "ONCS: {what}");
    }
    assert_ne!(oncs & 1 << 5, 0, "ONCS: reservations");
    assert_ne!(le16(id, 522) & 1, 0, "FUSES: Compare and Write");
    assert_ne!(le32(id, 536) & 0b11, 0, "SGLS: SGLs supported");
    assert_ne!(le16(id, 320), 0, "KAS");
    assert_ne!(id[77], 0, "MDTS");
    assert!(le32(id, 1792) >= 4, "IOCCSZ: at least the command");
    assert_eq!(le32(id, 1796), 1, "IORCSZ");
}

/// The Identify Namespace fields ESXi reads: shared, in an ANA group, deallocated blocks
/// reading zeros, 512-byte blocks of the LU's size, and a global identifier.
fn namespace_fields_esxi_needs(ns: &[u8]) -> Vec<u8> {
    assert_eq!(le64(ns, 0), LU_BYTES / BLOCK as u64, "NSZE");
    assert_eq!(nvme_host::block_bytes(ns), BLOCK as u32);
    assert_ne!(ns[30] & 1, 0, "NMIC: shared");
    assert_ne!(le32(ns, 92), 0, "ANAGRPID");
    assert_eq!(
        ns[33] & 0b111,
        0b001,
        "DLFEAT: deallocated blocks read zeros"
    );
    let nguid = ns[104..120].to_vec();
    let eui64 = ns[120..128].to_vec();
    assert!(
        nguid.iter().chain(&eui64).any(|&b| b != 0),
        "NGUID or EUI64"
    );
    [nguid, eui64].concat()
}

/// An I/O queue `qid` of controller `cntlid`, connected as ESXi adds its queues.
fn io_queue(array: &Array, path: usize, cntlid: u16, qid: u16) -> QueueConn {
    let addr = SocketAddr::from(([127, 0, 0, 1], array.nvme_port(path)));
    let mut q = QueueConn::open(addr, (false, false)).expect("I/O queue");
    let (c, data) = host::connect_command(
        qid,
        QUEUE_ENTRIES - 1,
        cntlid,
        &array.nqn,
        ESX,
        host::host_id_of(ESX),
    );
    let done = q.run_ok(c, data, 0).expect("I/O queue connects");
    assert_eq!(done.cqe.status, Status::SUCCESS);
    q
}

/// Connect and identify through both paths as ESXi does; four I/O queues on each controller,
/// every one serving; one namespace identifier through both; one optimized path at connect.
fn connect_and_identify(array: &Array) {
    let mut identifiers = Vec::new();
    let mut states = Vec::new();
    for path in 0..2 {
        let mut h = array.nvme(path, ESX, QUEUE_ENTRIES);
        controller_fields_esxi_needs(&h.identify, &array.nqn);
        // Number of Queues: ESXi asks for one I/O queue per core it drives them from.
        let granted = h
            .admin
            .run_ok(
                host::sqe(0x09, 0, [0x07, 3 | 3 << 16, 0, 0, 0, 0]),
                Vec::new(),
                0,
            )
            .expect("Number of Queues")
            .cqe
            .dw0;
        assert!(granted & 0xFFFF >= 3 && granted >> 16 >= 3, "{granted:#x}");
        let mut queues: Vec<_> = (2..=4)
            .map(|q| io_queue(array, path, h.cntlid, q))
            .collect();
        for (i, q) in queues.iter_mut().enumerate() {
            let read = host::rw(0x02, 1, i as u64 * 8, 8);
            let data = q
                .run_ok(read, Vec::new(), 8 * BLOCK as u32)
                .expect("read")
                .data;
            assert_eq!(data.len(), 8 * BLOCK);
        }
        let ns = nvme_host::identify_namespace(&mut h, 1);
        identifiers.push(namespace_fields_esxi_needs(&ns));
        let groups = nvme_host::ana_groups(&mut h);
        assert_eq!(groups.len(), 1, "{groups:?}");
        assert_eq!(groups[0].2, [1], "the namespace in its group");
        assert_eq!(groups[0].0, le32(&ns, 92), "ANAGRPID names it");
        states.push(groups[0].1);
    }
    assert_eq!(
        identifiers[0], identifiers[1],
        "one namespace through both paths"
    );
    assert_eq!(
        states,
        [1, 2],
        "optimized through group 1, non-optimized through 2"
    );
}

/// Holds an Asynchronous Event Request on `h`'s admin queue (notices enabled): its identifier.
fn hold_event(h: &mut NvmeHost) -> u16 {
    let enable = host::sqe(0x09, 0, [0x0B, 1 << 8 | 1 << 11, 0, 0, 0, 0]);
    h.admin
        .run_ok(enable, Vec::new(), 0)
        .expect("async event config");
    let aer = host::sqe(nvme::admin::opcode::ASYNC_EVENT_REQUEST, 0, [0; 6]);
    h.admin.submit(aer, Vec::new(), 0).expect("event request")
}

/// The notice completing the event request `cid` of `h`.
fn notice(h: &mut NvmeHost, cid: u16) -> u32 {
    let done = h.admin.next_done().expect("the event request completes");
    assert_eq!((done.cqe.cid, done.cqe.status), (cid, Status::SUCCESS));
    done.cqe.dw0
}

/// ANA Inaccessible (path related status 02h): what ESXi fails a path over on.
const ANA_INACCESSIBLE: Status = Status {
    sct: 3,
    sc: 0x02,
    dnr: false,
};

/// An operator takes portal group 1 out of service while I/O runs through both paths, then
/// back: the controller through it hears of it (ANA change) and reads the new state, its I/O
/// is refused with ANA Inaccessible, and the other path served every command meanwhile (its
/// state did not change: no notice there).
fn ana_change_under_io(array: &Array) {
    let mut opt = array.nvme(0, ESX, QUEUE_ENTRIES);
    let mut other = array.nvme(1, ESX, QUEUE_ENTRIES);
    let (cid_opt, cid_other) = (hold_event(&mut opt), hold_event(&mut other));
    let ctl = array.ctl(0);
    let served = std::thread::scope(|s| {
        let io = s.spawn(|| {
            let until = Instant::now() + Duration::from_secs(2);
            let mut n = 0u32;
            while n < 4 || Instant::now() < until {
                let data = pseudo_random_bytes(4096, u64::from(n));
                assert_eq!(
                    nvme_host::write(&mut other, 2048, data.clone()),
                    Status::SUCCESS
                );
                assert_eq!(other.read(1, 2048, 8, 512).expect("read"), data);
                n += 1;
            }
            n
        });
        std::thread::sleep(Duration::from_millis(300));
        let reply = ctl.json(&["portal-group", "alua", "1", "unavailable"]);
        assert_eq!(reply["ok"], true, "{reply}");
        io.join().expect("I/O on the other path")
    });
    assert!(served > 0);
    assert_eq!(notice(&mut opt, cid_opt), Notice::AnaChange.dw0());
    assert_eq!(nvme_host::ana_groups(&mut opt)[0].1, 3, "inaccessible");
    assert_eq!(nvme_host::ana_groups(&mut other)[0].1, 2, "non-optimized");
    let refused = opt
        .io
        .run(host::rw(0x02, 1, 0, 1), Vec::new(), 512)
        .unwrap();
    assert_eq!(refused.cqe.status, ANA_INACCESSIBLE);
    let cid = hold_event(&mut opt);
    let reply = ctl.json(&["portal-group", "alua", "1", "active-optimized"]);
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(notice(&mut opt, cid), Notice::AnaChange.dw0());
    assert_eq!(nvme_host::ana_groups(&mut opt)[0].1, 1);
    assert!(opt.read(1, 0, 1, 512).is_ok(), "served again");
    // The other path's state never moved: its event request is still held, no notice sent.
    assert_eq!(other.admin.in_flight(), 1, "no ANA change through group 2");
    let _ = cid_other;
}

/// The namespace grows live: every controller, through both portal groups (both gateways for
/// RBD, each told by its own `ctl resize`), hears Namespace Attribute Changed, the
/// Changed Namespace List names NSID 1, and Identify shows the new size.
fn resize_seen_everywhere(array: &Array) {
    let mut hosts = [array.nvme(0, ESX, 8), array.nvme(1, ESX, 8)];
    let cids = hosts.each_mut().map(hold_event);
    let grown = 2 * LU_BYTES;
    let size = format!("{}M", grown >> 20);
    if let Some(cluster) = array.cluster() {
        cluster.rbd(&[
            "resize",
            "--size",
            &size,
            &format!("rbd/{}", array_tag(array)),
        ]);
    }
    let daemons = if array.backing == Backing::Rbd { 2 } else { 1 };
    for i in 0..daemons {
        // An RBD device takes its image's size; a file grows to the size given.
        let args: &[&str] = match array.backing {
            Backing::Rbd => &["resize", "lu"],
            _ => &["resize", "lu", &size],
        };
        let reply = array.ctl(i).json(args);
        assert_eq!(reply["ok"], true, "{reply}");
    }
    for (h, cid) in hosts.iter_mut().zip(cids) {
        assert_eq!(notice(h, cid), Notice::NamespaceAttribute.dw0());
        let changed = nvme_host::log_page(h, 0x04, 4096);
        assert_eq!(le32(&changed, 0), 1, "NSID 1 changed");
        assert_eq!(le32(&changed, 4), 0, "only it");
        let ns = nvme_host::identify_namespace(h, 1);
        assert_eq!(le64(&ns, 0), grown / BLOCK as u64);
        // The new blocks serve.
        let last = grown / BLOCK as u64 - 8;
        assert_eq!(h.read(1, last, 8, 512).expect("a new block").len(), 4096);
    }
}

/// The tag the array was started with (its image's name for RBD).
fn array_tag(array: &Array) -> &str {
    array.nqn.rsplit(':').next().unwrap_or_default()
}

/// A heartbeat or lock block: who wrote it and its sequence number, the rest fixed.
fn beat(owner: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![0x5Au8; BLOCK];
    b[..8].copy_from_slice(&owner.to_be_bytes());
    b[8..16].copy_from_slice(&seq.to_be_bytes());
    b
}

const LOCK_LBA: u64 = 64;

/// One host's heartbeat for `secs`: its own block (never a miscompare: no one else writes it)
/// and the lock block (taken when it reads as someone left it). Returns the lock's transitions
/// it made: (the block it replaced, the block it wrote).
fn heartbeat(mut h: NvmeHost, me: u64, until: Instant) -> Vec<(Vec<u8>, Vec<u8>)> {
    let own = 256 + me * 8;
    let mut mine = beat(me, 0);
    assert_eq!(nvme_host::write(&mut h, own, mine.clone()), Status::SUCCESS);
    let mut taken = Vec::new();
    let mut seq = 1;
    // A few rounds each at least, however late the thread starts on a busy machine.
    while seq <= 3 || Instant::now() < until {
        let next = beat(me, seq);
        let (c, w) = nvme_host::compare_and_write(&mut h, own, mine.clone(), next.clone());
        assert_eq!(
            (c, w),
            (Status::SUCCESS, Status::SUCCESS),
            "a false miscompare on host {me}'s own block"
        );
        mine = next;
        let seen = h.read(1, LOCK_LBA, 1, 512).expect("read the lock");
        let claim = beat(100 + me, seq);
        match nvme_host::compare_and_write(&mut h, LOCK_LBA, seen.clone(), claim.clone()) {
            (Status::SUCCESS, Status::SUCCESS) => taken.push((seen, claim)),
            (Status::COMPARE_FAILURE, Status::ABORTED_FUSE_FAILED) => {}
            other => panic!("host {me}: the lock's ATS answered {other:?}"),
        }
        seq += 1;
    }
    taken
}

/// VMFS's heartbeats as fused Compare and Write, three hosts through both paths at once: no
/// false miscompare, and the lock's successful writes form one chain from its first content
/// to its last (each compared against the write before it: none lost, none applied twice).
fn ats_heartbeats(array: &Array) {
    let hosts: Vec<_> = (0..3u64)
        .map(|n| array.nvme(n as usize % 2, &format!("{ESX}-{n}"), 32))
        .collect();
    let mut first = array.nvme(0, ESX, 8);
    let start = beat(0, 0);
    assert_eq!(
        nvme_host::write(&mut first, LOCK_LBA, start.clone()),
        Status::SUCCESS
    );
    let until = Instant::now() + Duration::from_secs(2);
    let mut transitions: Vec<_> = std::thread::scope(|s| {
        let runs: Vec<_> = hosts
            .into_iter()
            .enumerate()
            .map(|(n, h)| s.spawn(move || heartbeat(h, n as u64, until)))
            .collect();
        runs.into_iter()
            .flat_map(|r| r.join().expect("host"))
            .collect()
    });
    assert!(!transitions.is_empty(), "no host ever took the lock");
    let total = transitions.len();
    let mut at = start;
    while let Some(i) = transitions.iter().position(|(old, _)| *old == at) {
        at = transitions.swap_remove(i).1;
    }
    assert!(
        transitions.is_empty(),
        "{} of {total} lock writes are off the chain",
        transitions.len()
    );
    assert_eq!(
        first.read(1, LOCK_LBA, 1, 512).expect("read"),
        at,
        "the last write stands"
    );
}

/// Dataset Management with the deallocate attribute over several ranges, as ESXi's UNMAP sends
/// it, and Write Zeroes as its zeroing: the blocks read zeros, their neighbours keep their data.
fn unmap_and_zero(array: &Array) {
    let mut h = array.nvme(0, ESX, 8);
    let base = 4096u64;
    let data = pseudo_random_bytes(64 * BLOCK, 7);
    assert_eq!(
        nvme_host::write(&mut h, base, data.clone()),
        Status::SUCCESS
    );
    // Ranges: blocks 8..16 and 32..40; context attributes 0, length, starting LBA.
    let mut ranges = Vec::new();
    for (start, len) in [(base + 8, 8u32), (base + 32, 8)] {
        ranges.extend_from_slice(&0u32.to_le_bytes());
        ranges.extend_from_slice(&len.to_le_bytes());
        ranges.extend_from_slice(&start.to_le_bytes());
    }
    let dsm = host::sqe(0x09, 1, [1, 1 << 2, 0, 0, 0, 0]); // two ranges (0's based), AD
    h.io.run_ok(dsm, ranges, 0).expect("Dataset Management");
    // Write Zeroes of blocks 48..56 (NLB 0's based).
    let zeroes = host::sqe(0x08, 1, [(base + 48) as u32, 0, 7, 0, 0, 0]);
    h.io.run_ok(zeroes, Vec::new(), 0).expect("Write Zeroes");
    let mut expect = data;
    for start in [8, 32, 48] {
        expect[start * BLOCK..(start + 8) * BLOCK].fill(0);
    }
    for path in 0..2 {
        let mut reader = array.nvme(path, ESX, 8);
        assert!(
            reader.read(1, base, 64, 512).expect("read") == expect,
            "through path {path}"
        );
    }
}

fn esxi(backing: Backing, tag: &str) {
    let array = Array::start(backing, tag);
    connect_and_identify(&array);
    if backing != Backing::Rbd {
        // Through an RBD gateway pair the states follow the image's owner, not the operator.
        ana_change_under_io(&array);
    }
    ats_heartbeats(&array);
    unmap_and_zero(&array);
    if backing != Backing::Ram {
        // A RAM device's size is fixed while it runs (`ctl resize` refuses it).
        resize_seen_everywhere(&array);
    }
}

#[test]
fn vmware_esxi_nvme_rules_on_ram() {
    esxi(Backing::Ram, "esx-nvme-ram");
}

#[test]
fn vmware_esxi_nvme_rules_on_disk() {
    esxi(Backing::Disk, "esx-nvme-disk");
}

#[test]
fn vmware_esxi_nvme_rules_across_two_rbd_gateways() {
    esxi(Backing::Rbd, "esx-nvme-rbd");
}
