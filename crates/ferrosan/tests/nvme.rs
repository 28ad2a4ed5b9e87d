//! NVMe/TCP, the second door: the same devices as the iSCSI targets, one admission, one set of
//! gates and reservations. Driven by the initiator crate's NVMe/TCP host (the Linux kernel's
//! host is exercised in the QEMU guest step, `scripts/kernel-nvme.sh`).

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::array::{read_len, Path};
use common::{free_port, metric, wait_for_metric, Daemon};
use initiator::nvme::{self as host, NvmeHost, QueueConn};
use initiator::session::Transfer;
use nvme::sqe::Status;

const IQN: &str = "iqn.2024-01.dev.ferrosan:nvme";
const NQN: &str = "nqn.2024-01.dev.ferrosan:nvme";
const INITIATOR: &str = "iqn.2024-01.dev.ferrosan:nvme-peer";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:8c1d2f0a-5b7e-4c3d-9a1f-0e2d3c4b5a69";

fn addr(port: u16) -> SocketAddr {
    format!("127.0.0.1:{port}").parse().unwrap()
}

/// A quick export of one RAM LUN through both doors; the NVMe port.
fn both_doors(luns: &[&str]) -> (Daemon, u16) {
    let nvme_port = free_port();
    let listen = format!("127.0.0.1:{nvme_port}");
    let daemon = Daemon::start_with_args(IQN, luns, &["--nvme-listen", &listen]);
    (daemon, nvme_port)
}

/// A config: portal group 1 (iSCSI on `port`, NVMe/TCP on `nvme_port`) and `more` groups,
/// a 16 MiB RAM device, the target with its NQN, and one group `group` (its TOML lines).
fn config_text(port: u16, nvme_port: u16, more: &str, group: &str) -> String {
    format!(
        r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]
nvme_listen = ["127.0.0.1:{nvme_port}"]
{more}
[[device]]
name = "mem"
store = "ram"
size = "16M"

[[target]]
iqn = "{IQN}"
nqn = "{NQN}"

  [[target.group]]
{group}
"#
    )
}

/// Group `db`: HOSTNQN with the RAM device as LUN 0 (NSID 1).
fn db_group() -> String {
    format!(
        "  name = \"db\"\n  initiators = [\"{HOSTNQN}\"]\n  luns = [ {{ lun = 0, device = \"mem\" }} ]"
    )
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn a_namespace_is_the_lun_an_iscsi_initiator_sees() {
    let (daemon, nvme_port) = both_doors(&["ram:64M"]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 32).expect("connect");
    // Identify Controller: the subsystem asked for, the controller ID Connect gave.
    assert!(h.identify[768..].starts_with(NQN.as_bytes()));
    assert_eq!(
        u16::from_le_bytes([h.identify[78], h.identify[79]]),
        h.cntlid
    );
    // The active namespace list: NSID 1 (LUN 0); its size in 512-byte blocks.
    let list = h
        .admin
        .run_ok(host::sqe(0x06, 0, [2, 0, 0, 0, 0, 0]), Vec::new(), 4096)
        .unwrap()
        .data;
    assert_eq!(&list[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
    let ns = h
        .admin
        .run_ok(host::sqe(0x06, 1, [0, 0, 0, 0, 0, 0]), Vec::new(), 4096)
        .unwrap()
        .data;
    assert_eq!(
        u64::from_le_bytes(ns[..8].try_into().unwrap()),
        (64 << 20) / 512
    );
    // Written through NVMe (in the capsule, and on an R2T), read back through both doors.
    let small = pattern(1, 4096);
    let large = pattern(2, 256 * 1024);
    h.write(1, 8, small.clone(), 512).unwrap();
    h.write(1, 1000, large.clone(), 512).unwrap();
    assert_eq!(h.read(1, 8, 8, 512).unwrap(), small);
    assert_eq!(h.read(1, 1000, 512, 512).unwrap(), large);
    let mut iscsi = Path::connect(daemon.port, IQN, INITIATOR, [0x40, 0, 0, 0, 0, 1]).unwrap();
    iscsi.settle();
    let (status, _, data) = iscsi.read(8, 8);
    assert_eq!((status, data), (0, small.clone()));
    // Write Zeroes with FUA (WRITE SAME, then SYNCHRONIZE CACHE of its blocks): zeros through
    // both doors, the blocks around it untouched.
    let fua = 1 << 30;
    let zeroes = host::sqe(0x08, 1, [10, 0, 3 | fua, 0, 0, 0]);
    h.io.run_ok(zeroes, Vec::new(), 0)
        .expect("Write Zeroes with FUA");
    let mut expect = small.clone();
    expect[2 * 512..6 * 512].fill(0);
    assert_eq!(h.read(1, 8, 8, 512).unwrap(), expect);
    let (status, _, data) = iscsi.read(8, 8);
    assert_eq!((status, data), (0, expect));
    // Written through iSCSI, read through NVMe.
    let other = pattern(3, 512);
    assert_eq!(iscsi.write(20, &other).0, 0);
    assert_eq!(h.read(1, 20, 1, 512).unwrap(), other);
    // A block past the end: LBA Out of Range, as the SCSI core's 21h/00h.
    let end = (64 << 20) / 512;
    let done =
        h.io.run(host::rw(0x02, 1, end, 1), Vec::new(), 512)
            .unwrap();
    assert_eq!(done.cqe.status, Status::LBA_OUT_OF_RANGE);
    // A namespace that is not there.
    let done = h.io.run(host::rw(0x02, 2, 0, 1), Vec::new(), 512).unwrap();
    assert_eq!(done.cqe.status, Status::INVALID_NAMESPACE);
    h.disconnect();
}

/// Reads go out from where the data lies: a direct-I/O file's from the buffer its read landed
/// in, a page-cached file's long reads with `sendfile` and short ones from a read buffer, a
/// RAM device's from its memory; with data digests, the bytes are read to digest them. Every
/// variant reads back what was written, through a queue without digests and one with both.
#[test]
fn reads_sent_from_where_they_lie_read_back_with_and_without_digests() {
    let scratch = common::Scratch::new("nvme-send");
    let direct = format!(
        "file:{},size=8M,cache=direct",
        scratch.file("d.img").display()
    );
    let page = format!(
        "file:{},size=8M,cache=page",
        scratch.file("p.img").display()
    );
    let metrics_port = free_port();
    let (nvme_port, listen) = (free_port(), format!("127.0.0.1:{metrics_port}"));
    let _daemon = Daemon::start_with_args(
        IQN,
        &[&direct, &page, "ram:8M"],
        &[
            "--nvme-listen",
            &format!("127.0.0.1:{nvme_port}"),
            "--metrics-listen",
            &listen,
        ],
    );
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 32).expect("connect");
    let long = pattern(7, 1 << 20);
    let short = pattern(8, 4096);
    for nsid in 1..=3 {
        h.write(nsid, 0, long.clone(), 512).unwrap();
        h.write(nsid, 4096, short.clone(), 512).unwrap();
    }
    let mut digested = QueueConn::open(addr(nvme_port), (true, true)).unwrap();
    let (connect, data) =
        host::connect_command(2, 15, h.cntlid, NQN, HOSTNQN, host::host_id_of(HOSTNQN));
    digested.run_ok(connect, data, 0).unwrap();
    let read = |q: &mut QueueConn, nsid, lba, blocks: u32| {
        q.run_ok(host::rw(0x02, nsid, lba, blocks), Vec::new(), blocks * 512)
            .unwrap()
            .data
    };
    for nsid in 1..=3 {
        for (q, digests) in [(&mut h.io, false), (&mut digested, true)] {
            let what = format!("namespace {nsid}, digests {digests}");
            assert!(read(q, nsid, 0, 2048) == long, "{what}");
            assert_eq!(read(q, nsid, 4096, 8), short, "{what}");
        }
    }
    // The host's queue disabled SQ flow control: each read ended on its data (C2HData with
    // SUCCESS). The digested queue kept it: each read had its response capsule.
    assert_eq!(h.io.successes_in_data(), 6);
    assert_eq!(digested.successes_in_data(), 0);
    // Completions in capsules report SQ head FFFFh where flow control is off, else the head.
    let flush = || host::sqe(nvme::nvm::opcode::FLUSH, 1, [0; 6]);
    let head = |q: &mut QueueConn| q.run_ok(flush(), Vec::new(), 0).unwrap().cqe.sqhd;
    assert_eq!(head(&mut h.io), nvme::sqe::SQHD_DISABLED);
    assert_ne!(head(&mut digested), nvme::sqe::SQHD_DISABLED);
    h.disconnect();
    // The page-cached file's long reads went out with sendfile (where the kernel can say
    // what is cached): one 1 MiB read, from the queue without digests.
    let sent = "ferrosan_device_sendfile_bytes_total{device=\"lun1\"}";
    if common::kernel_has_cachestat() {
        let text = wait_for_metric(metrics_port, sent, |v| v > 0.0);
        assert_eq!(metric(&text, sent), f64::from(1 << 20), "{text}");
    }
}

#[test]
fn many_commands_in_flight_complete_each_once() {
    let (_daemon, nvme_port) = both_doors(&["ram:64M"]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 64).expect("connect");
    for round in 0..4u8 {
        let mut cids = Vec::new();
        for i in 0..48u64 {
            let data = pattern(round ^ i as u8, 4096);
            let s = host::rw(0x01, 1, i * 8, 8);
            cids.push(h.io.submit(s, data, 0).unwrap());
        }
        let mut seen = Vec::new();
        while h.io.in_flight() > 0 {
            let done = h.io.next_done().unwrap();
            assert!(done.cqe.status.is_success(), "{:?}", done.cqe);
            assert!(!seen.contains(&done.cqe.cid), "answered twice");
            seen.push(done.cqe.cid);
        }
        seen.sort_unstable();
        cids.sort_unstable();
        assert_eq!(seen, cids);
        for i in (0..48u64).step_by(7) {
            assert_eq!(
                h.read(1, i * 8, 8, 512).unwrap(),
                pattern(round ^ i as u8, 4096)
            );
        }
    }
}

#[test]
fn an_iscsi_reservation_fences_an_nvme_host_and_the_reverse() {
    // A file LUN and a state directory: its reservations may persist through power loss.
    let scratch = common::Scratch::new("nvme-pr");
    let lun = format!("file:{},size=16M", scratch.file("lun.img").display());
    let state_arg = scratch.file("state").display().to_string();
    let nvme_port = free_port();
    let listen = format!("127.0.0.1:{nvme_port}");
    let daemon = Daemon::start_with_args(
        IQN,
        &[&lun],
        &["--nvme-listen", &listen, "--state-dir", &state_arg],
    );
    let mut iscsi = Path::connect(daemon.port, IQN, INITIATOR, [0x40, 0, 0, 0, 0, 2]).unwrap();
    iscsi.settle();
    // The iSCSI initiator registers and takes Write Exclusive.
    assert_eq!(iscsi.prout(0x00, 0, 0, 0xAAAA).0, 0);
    assert_eq!(
        iscsi
            .prout(0x01, common::array::pr::WRITE_EXCLUSIVE, 0xAAAA, 0)
            .0,
        0
    );
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let write = h.io.run(host::rw(0x01, 1, 0, 1), vec![1; 512], 0).unwrap();
    assert_eq!(write.cqe.status, Status::RESERVATION_CONFLICT);
    // Reads stay open under Write Exclusive.
    assert!(h.read(1, 0, 1, 512).is_ok());
    // The NVMe host registers and preempts: now the iSCSI initiator is fenced.
    let keys = |cr: u64, nr: u64| {
        let mut d = cr.to_le_bytes().to_vec();
        d.extend_from_slice(&nr.to_le_bytes());
        d
    };
    h.io.run_ok(host::sqe(0x0D, 1, [0, 0, 0, 0, 0, 0]), keys(0, 0xBBBB), 0)
        .expect("register");
    // Preempt (action 1) with type Write Exclusive (1): takes the reservation, removes AAAA.
    h.io.run_ok(
        host::sqe(0x11, 1, [1 | 1 << 8, 0, 0, 0, 0, 0]),
        keys(0xBBBB, 0xAAAA),
        0,
    )
    .expect("preempt");
    assert!(h.write(1, 0, vec![2; 512], 512).is_ok());
    // Reservation Report: the NVMe host holds Write Exclusive under its key and host ID.
    let report =
        h.io.run_ok(host::sqe(0x0E, 1, [1023, 0, 0, 0, 0, 0]), Vec::new(), 4096)
            .expect("report")
            .data;
    assert_eq!(report[4], 1, "Write Exclusive");
    assert_eq!(
        u16::from_le_bytes([report[5], report[6]]),
        1,
        "one registrant"
    );
    assert_eq!(report[24 + 2], 1, "holds the reservation");
    assert_eq!(&report[24 + 8..24 + 16], &host::host_id_of(HOSTNQN)[..8]);
    assert_eq!(
        u64::from_le_bytes(report[24 + 16..24 + 24].try_into().unwrap()),
        0xBBBB
    );
    assert_eq!(report[9], 0, "PTPLS: not persistent through power loss yet");
    // Register again (Replace, its own key) with CPTPL = 11b: the reservations persist (the
    // one table's APTPL), and the report says so.
    h.io.run_ok(
        host::sqe(0x0D, 1, [2 | 3 << 30, 0, 0, 0, 0, 0]),
        keys(0xBBBB, 0xBBBB),
        0,
    )
    .expect("register with CPTPL");
    let report =
        h.io.run_ok(host::sqe(0x0E, 1, [1023, 0, 0, 0, 0, 0]), Vec::new(), 4096)
            .expect("report")
            .data;
    assert_eq!(report[9], 1, "PTPLS: persistent through power loss");
    // The preempted initiator hears of it (REGISTRATIONS PREEMPTED), then is fenced.
    assert_eq!(iscsi.settle().0, 0);
    let (status, _) = iscsi.write(0, &[3; 512]);
    assert_eq!(
        status, 0x18,
        "the iSCSI initiator is fenced after the preempt"
    );
    // The state is one table: READ KEYS through iSCSI shows the NVMe host's key.
    assert_eq!(iscsi.read_keys(), vec![0xBBBB]);
    assert_eq!(iscsi.read_reservation().map(|r| r.0), Some(0xBBBB));
}

#[test]
fn only_admitted_hosts_connect_and_each_door_takes_its_own_names() {
    let (nvme_port, port) = (free_port(), free_port());
    let group = format!(
        "  name = \"db\"\n  initiators = [\"{HOSTNQN}\"]\n  luns = [ {{ lun = 3, device = \"mem\" }} ]"
    );
    let text = config_text(port, nvme_port, "", &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    // The listed host: its group's LUN 3 is NSID 4.
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let list = h
        .admin
        .run_ok(host::sqe(0x06, 0, [2, 0, 0, 0, 0, 0]), Vec::new(), 4096)
        .unwrap()
        .data;
    assert_eq!(&list[..8], &[4, 0, 0, 0, 0, 0, 0, 0]);
    // Another host: Connect Invalid Host.
    let refused = connect_status(
        nvme_port,
        NQN,
        "nqn.2014-08.org.nvmexpress:uuid:someone-else",
    );
    assert_eq!(refused, Status::CONNECT_INVALID_HOST);
    // The target's iSCSI name through the NVMe door: no such subsystem.
    let refused = connect_status(nvme_port, IQN, HOSTNQN);
    assert_eq!(refused, Status::CONNECT_INVALID_PARAMETERS);
    // An I/O queue naming a controller that is not the host's.
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(
        1,
        7,
        h.cntlid,
        NQN,
        "nqn.2014-08.org.nvmexpress:uuid:x",
        [9; 16],
    );
    assert_eq!(
        q.run(c, data, 0).unwrap().cqe.status,
        Status::CONNECT_INVALID_HOST
    );
    // The NQN as an iSCSI target name: not found through the iSCSI door.
    assert!(Path::connect(port, NQN, INITIATOR, [0x40, 0, 0, 0, 0, 3]).is_err());
}

fn connect_status(port: u16, subnqn: &str, hostnqn: &str) -> Status {
    let mut q = QueueConn::open(addr(port), (false, false)).unwrap();
    let (c, data) = host::connect_command(0, 31, 0xFFFF, subnqn, hostnqn, [1; 16]);
    q.run(c, data, 0).unwrap().cqe.status
}

#[test]
fn discovery_lists_the_subsystems_a_host_may_reach() {
    let (_daemon, nvme_port) = both_doors(&["ram:16M"]);
    let page = discovery_log(nvme_port);
    let listed = entries(&page);
    assert_eq!(listed.len(), 2, "{listed:?}");
    // First this discovery service where the host reached it, as one it may stay connected to.
    let here = &listed[0];
    assert_eq!((here.subtype, here.eflags), (3, EFLAGS_EPCSD));
    assert_eq!(here.subnqn, nvme::fabrics::DISCOVERY_NQN);
    assert_eq!((here.address.as_str(), here.port), ("127.0.0.1", nvme_port));
    let subsystem = &listed[1];
    assert_eq!(
        (subsystem.trtype, subsystem.subtype, subsystem.eflags),
        (3, 2, 0)
    );
    assert_eq!(subsystem.subnqn, NQN);
    assert_eq!(
        (subsystem.address.as_str(), subsystem.port),
        ("127.0.0.1", nvme_port)
    );
}

/// Explicit persistent connections supported (discovery log entry flags).
const EFLAGS_EPCSD: u16 = 1 << 1;

/// One discovery log entry, as a host reads it.
#[derive(Debug)]
struct Listed {
    trtype: u8,
    subtype: u8,
    port_id: u16,
    eflags: u16,
    port: u16,
    subnqn: String,
    address: String,
}

/// The entries of a discovery log page.
fn entries(page: &[u8]) -> Vec<Listed> {
    let records = u64::from_le_bytes(page[8..16].try_into().unwrap()) as usize;
    assert!(
        (records + 1) * 1024 <= page.len(),
        "{records} entries: read more of the log"
    );
    let text = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8(b[..end].to_vec()).unwrap()
    };
    (1..=records)
        .map(|i| &page[i * 1024..(i + 1) * 1024])
        .map(|e| Listed {
            trtype: e[0],
            subtype: e[2],
            port_id: u16::from_le_bytes([e[4], e[5]]),
            eflags: u16::from_le_bytes([e[10], e[11]]),
            port: text(&e[32..64]).parse().unwrap(),
            subnqn: text(&e[256..512]),
            address: text(&e[512..768]),
        })
        .collect()
}

#[test]
fn discovery_refers_hosts_to_the_other_gateways_discovery_services() {
    let (nvme_port, port) = (free_port(), free_port());
    let (other_nvme, other_discovery) = (free_port(), free_port());
    let (hidden_nvme, quiet_nvme) = (free_port(), free_port());
    let text = format!(
        r#"[server]
gateway = "a"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]
nvme_listen = ["127.0.0.1:{nvme_port}"]
gateway = "a"

[[portal_group]]
tag = 2
listen = ["127.0.0.1:{}"]
nvme_listen = ["127.0.0.1:{other_nvme}"]
nvme_discovery_listen = ["127.0.0.1:{other_discovery}"]
gateway = "b"

[[portal_group]]
tag = 3
listen = ["127.0.0.1:{}"]
nvme_listen = ["127.0.0.1:{hidden_nvme}", "0.0.0.0:{}"]
gateway = "b"

[[portal_group]]
tag = 4
listen = ["127.0.0.1:{}"]
nvme_listen = ["127.0.0.1:{quiet_nvme}"]
nvme_discovery_listen = []
gateway = "b"

[[device]]
name = "mem"
store = "ram"
size = "16M"

[[target]]
iqn = "{IQN}"
nqn = "{NQN}"
portal_groups = [1, 2, 4]

  [[target.group]]
  name = "db"
  initiators = ["{HOSTNQN}"]
  luns = [ {{ lun = 0, device = "mem" }} ]

[[target]]
iqn = "{IQN}-other"
nqn = "{NQN}-other"
portal_groups = [3]

  [[target.group]]
  name = "db"
  initiators = ["nqn.2014-08.org.nvmexpress:uuid:someone-else"]
  luns = [ {{ lun = 0, device = "mem" }} ]
"#,
        free_port(),
        free_port(),
        free_port(),
        free_port()
    );
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let listed = entries(&discovery_log(nvme_port));
    let kinds: Vec<_> = listed.iter().map(|e| e.subtype).collect();
    assert_eq!(kinds, [3, 2, 1, 1], "{listed:?}");
    // The subsystem at this gateway's listener only; the other gateway's group through its
    // discovery service, the host's way to that gateway's paths.
    assert_eq!((listed[1].port_id, listed[1].port), (1, nvme_port));
    let referral = &listed[2];
    assert_eq!(referral.subnqn, nvme::fabrics::DISCOVERY_NQN);
    assert_eq!((referral.port_id, referral.port), (2, other_discovery));
    assert_eq!(referral.eflags, EFLAGS_EPCSD);
    // Group 4 turned its discovery port off: its NVMe listener answers discovery, and is named.
    assert_eq!((listed[3].port_id, listed[3].port), (4, quiet_nvme));
    // Group 3 serves only a subsystem this host may not reach: no referral to it.
    assert!(listed.iter().all(|e| e.port != hidden_nvme));
}

/// A discovery controller at `port` for HOSTNQN, connected and enabled.
fn discovery_controller(port: u16) -> QueueConn {
    let mut q = QueueConn::open(addr(port), (false, false)).unwrap();
    let (c, data) = host::connect_command(
        0,
        31,
        0xFFFF,
        nvme::fabrics::DISCOVERY_NQN,
        HOSTNQN,
        [2; 16],
    );
    q.run_ok(c, data, 0).unwrap();
    q.run_ok(host::property_set_cc(1 | 6 << 16 | 4 << 20), Vec::new(), 0)
        .unwrap();
    q
}

/// The discovery log page (8 KiB: its header and up to seven entries) a discovery controller
/// at `port` gives HOSTNQN.
fn discovery_log(port: u16) -> Vec<u8> {
    let mut q = discovery_controller(port);
    // Get Log Page 70h, 8 KiB.
    q.run_ok(
        host::sqe(0x02, 0, [0x70 | 2047 << 16, 0, 0, 0, 0, 0]),
        Vec::new(),
        8192,
    )
    .unwrap()
    .data
}

#[test]
fn discovery_controllers_have_their_own_budget_and_take_no_session_place() {
    let (nvme_port, port) = (free_port(), free_port());
    let group = db_group();
    let text = format!(
        "{}\n[limits]\nmax_sessions = 1\nmax_discovery_sessions_per_source = 2\n",
        config_text(port, nvme_port, "", &group)
    );
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let discovery = |id: u8| {
        let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
        let (c, data) = host::connect_command(
            0,
            31,
            0xFFFF,
            nvme::fabrics::DISCOVERY_NQN,
            HOSTNQN,
            [id; 16],
        );
        let status = q.run(c, data, 0).unwrap().cqe.status;
        (q, status)
    };
    let held: Vec<_> = (0..2).map(discovery).collect();
    assert!(held.iter().all(|(_, s)| *s == Status::SUCCESS));
    assert_eq!(
        discovery(3).1,
        Status::CONNECT_CONTROLLER_BUSY,
        "per source"
    );
    // The one session place is still free for a host that reads and writes.
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    assert!(h.read(1, 0, 1, 512).is_ok());
}

#[test]
fn a_namespace_mapped_live_answers_an_nvme_host_at_once_as_one_mapped_at_connect() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port) = (free_port(), free_port());
    let group = db_group();
    let text = config_text(port, nvme_port, "", &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &socket]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    assert!(h.read(1, 0, 1, 512).is_ok(), "mapped at connect");
    assert_eq!(ctl.json(&["device", "add", "more", "ram:4M"])["ok"], true);
    assert_eq!(
        ctl.json(&["lun", "map", IQN, "db", "1", "more"])["ok"],
        true
    );
    // NVMe has no unit attentions: the new namespace's first command is served, not
    // interrupted by a POWER ON condition meant for an iSCSI nexus; the old one's too.
    let started = Instant::now();
    let first = loop {
        match h.read(2, 0, 1, 512) {
            Err(host::NvmeError::Status(s)) if s == Status::INVALID_NAMESPACE => {
                assert!(started.elapsed() < Duration::from_secs(5), "never mapped");
                std::thread::sleep(Duration::from_millis(20));
            }
            other => break other,
        }
    };
    assert!(first.is_ok(), "{first:?}");
    assert!(h.read(1, 0, 1, 512).is_ok());
}

/// A controller whose Keep Alive timeout is 1 s, enabled: its admin queue (which then sends no
/// Keep Alive) and its controller ID.
fn controller_with_kato_1s(nvme_port: u16, tls: Option<&host::TlsPsk>) -> (QueueConn, u16) {
    let mut admin = match tls {
        None => QueueConn::open(addr(nvme_port), (false, false)),
        Some(key) => QueueConn::open_tls(addr(nvme_port), (false, false), key, HOSTNQN, NQN),
    }
    .unwrap();
    let (mut c, data) = host::connect_command(0, 31, 0xFFFF, NQN, HOSTNQN, [3; 16]);
    c.0[48..52].copy_from_slice(&1000u32.to_le_bytes());
    let cntlid = admin.run_ok(c, data, 0).unwrap().cqe.dw0 as u16;
    admin
        .run_ok(host::property_set_cc(1 | 6 << 16 | 4 << 20), Vec::new(), 0)
        .unwrap();
    (admin, cntlid)
}

#[test]
fn a_host_that_stops_sending_keep_alives_loses_its_controller() {
    let (_daemon, nvme_port) = both_doors(&["ram:16M"]);
    let (_admin, cntlid) = controller_with_kato_1s(nvme_port, None);
    let mut io = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(1, 7, cntlid, NQN, HOSTNQN, [3; 16]);
    io.run_ok(c, data, 0).unwrap();
    let started = Instant::now();
    // No Keep Alive: the controller ends within its timeout and the tick's slack; the I/O
    // queue's next command finds the connection closed.
    let err = io.run(host::rw(0x02, 1, 0, 1), Vec::new(), 512);
    let mut closed = err.is_err();
    while !closed && started.elapsed() < Duration::from_secs(6) {
        std::thread::sleep(Duration::from_millis(200));
        closed = io.run(host::rw(0x02, 1, 0, 1), Vec::new(), 512).is_err();
    }
    assert!(
        closed,
        "the I/O queue still serves after the keep-alive timeout"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));
}

/// A queue the controller ends (here: its host stopped sending Keep Alives) is closed the way
/// a host still sending can take: the controller's FIN, then what the host sends meanwhile read
/// and dropped, never a reset. A reset makes Linux's nvme-tcp host raise SIGPIPE in the
/// application whose command met it (docs/NVME.md, *Linux hosts when the daemon dies*).
#[test]
fn a_queue_the_controller_ends_is_closed_without_a_reset() {
    let (_daemon, nvme_port) = both_doors(&["ram:16M"]);
    let (_admin, cntlid) = controller_with_kato_1s(nvme_port, None);
    let tcp = std::net::TcpStream::connect(addr(nvme_port)).unwrap();
    let raw = tcp.try_clone().unwrap();
    let io = QueueConn::over(tcp, (false, false)).unwrap();
    closed_without_a_reset(io, raw, cntlid);
}

/// The same over TLS: the controller's close_notify and FIN, then the host's records read
/// and dropped beneath TLS.
#[test]
fn a_queue_over_tls_the_controller_ends_is_closed_without_a_reset() {
    let dir = std::env::temp_dir().join(format!("ferrosan-nvme-tls-linger-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (key, key_file) = tls_key(&dir, 3);
    let (nvme_port, port) = (free_port(), free_port());
    let _daemon =
        Daemon::start_config_text(IQN, port, &tls_config(port, nvme_port, &key_file), &[]);
    let (_admin, cntlid) = controller_with_kato_1s(nvme_port, Some(&key));
    let tcp = std::net::TcpStream::connect(addr(nvme_port)).unwrap();
    let raw = tcp.try_clone().unwrap();
    let io = QueueConn::over_tls(tcp, (false, false), &key, HOSTNQN, NQN).unwrap();
    closed_without_a_reset(io, raw, cntlid);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Connects `io` (whose socket `raw` is) to controller `cntlid`, whose keep-alive lapses;
/// asserts the queue ends with a close that the host's later sends do not meet as a reset.
fn closed_without_a_reset(mut io: QueueConn, mut raw: std::net::TcpStream, cntlid: u16) {
    use std::io::{Read as _, Write as _};
    let (c, data) = host::connect_command(1, 7, cntlid, NQN, HOSTNQN, [3; 16]);
    io.run_ok(c, data, 0).unwrap();
    // No Keep Alive: the controller ends, and its I/O queue's connection with it.
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = Instant::now();
    let mut sink = [0u8; 4096];
    loop {
        match raw.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!(
                "the queue ended with {e} after {:?}, not a close",
                started.elapsed()
            ),
        }
    }
    // The host sends on, as one whose error recovery has not run yet does: a reset would
    // answer the first capsule within microseconds and fail the second. (The linger lasts
    // 1 s; these take ~40 ms.)
    for i in 0..3 {
        let sent = raw.write_all(&[0u8; 72]);
        assert!(sent.is_ok(), "capsule {i} after the close: {sent:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn controllers_are_sessions_to_ctl_and_a_hostile_queue_touches_no_other() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let nvme_port = free_port();
    let listen = format!("127.0.0.1:{nvme_port}");
    let _daemon = Daemon::start_with_args(
        IQN,
        &["ram:16M"],
        &["--nvme-listen", &listen, "--control-socket", &socket],
    );
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let listed = ctl.sessions();
    let mine = listed
        .iter()
        .find(|s| s["initiator"] == HOSTNQN)
        .unwrap_or_else(|| panic!("the controller in ctl sessions: {listed:?}"));
    assert_eq!(mine["target"], NQN);
    assert_eq!(mine["tsih"], u64::from(h.cntlid));
    // The controller in its own door's terms: no iSCSI key or ISID made up for it.
    assert_eq!(mine["door"], "nvme", "{mine}");
    assert_eq!(mine["header_digest"], "None", "{mine}");
    assert_eq!(mine["tls"], false, "{mine}");
    assert!(mine["kato_ms"].as_u64().is_some(), "{mine}");
    assert!(mine["max_transfer"].as_u64().unwrap() >= 4096, "{mine}");
    for iscsi_only in ["isid", "cid", "initial_r2t", "max_burst_length"] {
        assert!(mine.get(iscsi_only).is_none(), "{iscsi_only} in {mine}");
    }
    assert!(
        mine["chap_user"].is_null(),
        "no authentication, no user: {mine:?}"
    );
    // Garbage on a new queue: a termination request and a close, nothing more.
    let mut raw = std::net::TcpStream::connect(addr(nvme_port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    use std::io::{Read, Write};
    raw.write_all(&[0x04, 0, 72, 0, 0xFF, 0xFF, 0xFF, 0x7F])
        .unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert_eq!(answer.first(), Some(&0x03), "a C2HTermReq: {answer:02x?}");
    // The controller serves on.
    h.write(1, 0, vec![5; 512], 512).unwrap();
    assert_eq!(h.read(1, 0, 1, 512).unwrap(), vec![5; 512]);
    // Its I/O queue's commands count as the controller's (reported once a second), with
    // their latency, as an iSCSI session's do.
    let started = Instant::now();
    let counted = loop {
        let listed = ctl.sessions();
        let mine = listed.iter().find(|s| s["initiator"] == HOSTNQN).cloned();
        let mine = mine.unwrap_or_else(|| panic!("the controller in ctl sessions: {listed:?}"));
        if mine["reads"] == 1 || started.elapsed() > Duration::from_secs(5) {
            break mine;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(counted["reads"], 1, "{counted}");
    assert_eq!(counted["writes"], 1, "{counted}");
    assert_eq!(counted["read_bytes"], 512, "{counted}");
    assert_eq!(counted["write_bytes"], 512, "{counted}");
    assert_eq!(counted["read_latency"]["count"], 1, "{counted}");
    assert_eq!(counted["write_latency"]["count"], 1, "{counted}");
    // `ctl sessions close` ends the controller: its I/O queue is closed too.
    let tsih = h.cntlid.to_string();
    let closed = ctl.json(&["session", "close", &tsih]);
    assert_eq!(closed["ok"], true, "{closed}");
    let started = Instant::now();
    while h.read(1, 0, 1, 512).is_ok() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the controller still serves"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn every_queue_passes_the_admission_from_its_own_address() {
    let (nvme_port, port) = (free_port(), free_port());
    let group = format!(
        "  name = \"db\"\n  initiators = [\"{HOSTNQN}\"]\n  allowed_sources = [\"127.0.0.1/32\"]\n  luns = [ {{ lun = 0, device = \"mem\" }} ]"
    );
    let text = config_text(port, nvme_port, "", &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect from 127.0.0.1");
    // A second I/O queue of the same controller, from 127.0.0.2: outside allowed_sources.
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&"127.0.0.2:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    socket.connect(&addr(nvme_port).into()).unwrap();
    let mut q = QueueConn::over(socket.into(), (false, false)).unwrap();
    let (c, data) = host::connect_command(2, 7, h.cntlid, NQN, HOSTNQN, host::host_id_of(HOSTNQN));
    assert_eq!(
        q.run(c, data, 0).unwrap().cqe.status,
        Status::CONNECT_INVALID_HOST
    );
    // From the admitted address the same queue joins.
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(2, 7, h.cntlid, NQN, HOSTNQN, host::host_id_of(HOSTNQN));
    assert_eq!(q.run(c, data, 0).unwrap().cqe.status, Status::SUCCESS);
}

/// Both of a controller's queues once parked (idle a housekeeping period, nothing open but a
/// held event request: `driver.rs`, `Driven::Parked`); a queue woken soon after it parked
/// waits up to 16 s before it parks again (`lifecycle::Pace::after_park`), so this waits up
/// to 20.
fn parked(metrics_port: u16) -> f64 {
    let mut parked = 0.0;
    for _ in 0..4 {
        let text = wait_for_metric(metrics_port, "ferrosan_connections_parked", |v| v == 2.0);
        parked = metric(&text, "ferrosan_connections_parked");
        if parked == 2.0 {
            break;
        }
    }
    parked
}

/// A parked queue gives its driver's memory back and keeps what its protocol needs: its I/O
/// queue answers the next command with the data written before, its admin queue a Keep Alive
/// and the event request it held when a namespace changes, and a reload that drops the host
/// ends both though neither had a turn since (its view, kept, is readmitted at the next).
#[test]
fn a_parked_controller_serves_hears_and_is_readmitted_as_an_idle_one() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port, metrics_port) = (free_port(), free_port(), free_port());
    let metrics = format!("127.0.0.1:{metrics_port}");
    let text = config_text(port, nvme_port, "", &db_group());
    let args = [
        "--control-socket",
        socket.as_str(),
        "--metrics-listen",
        &metrics,
    ];
    let daemon = Daemon::start_config_text(IQN, port, &text, &args);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let aec = nvme::identify::OAES_NS_ATTRIBUTE;
    let features = host::sqe(
        nvme::admin::opcode::SET_FEATURES,
        0,
        [0x0B, aec, 0, 0, 0, 0],
    );
    h.admin.run_ok(features, Vec::new(), 0).unwrap();
    let aer = host::sqe(nvme::admin::opcode::ASYNC_EVENT_REQUEST, 0, [0; 6]);
    let held = h.admin.submit(aer, Vec::new(), 0).unwrap();
    let data = pattern(7, 4096);
    h.write(1, 8, data.clone(), 512).unwrap();
    assert_eq!(parked(metrics_port), 2.0, "both queues park");

    let changed = ctl.json(&["device", "set", "mem", "--read-only", "on"]);
    assert_eq!(changed["ok"], true, "{changed}");
    let done = h
        .admin
        .next_done()
        .expect("the held event request completes");
    assert_eq!(done.cqe.cid, held);
    assert_eq!(
        done.cqe.dw0,
        nvme::controller::Notice::NamespaceAttribute.dw0()
    );
    assert_eq!(parked(metrics_port), 2.0, "both park again");

    assert_eq!(h.read(1, 8, 8, 512).unwrap(), data, "the I/O queue, woken");
    // The Keep Alive last: the reload below comes well within its 15 s timeout.
    let keep_alive = host::sqe(nvme::admin::opcode::KEEP_ALIVE, 0, [0; 6]);
    h.admin.run_ok(keep_alive, Vec::new(), 0).unwrap();
    assert_eq!(parked(metrics_port), 2.0, "and again");

    let other = "  name = \"db\"\n  initiators = [\"iqn.2024-01.dev.ferrosan:other\"]\n  luns = [ { lun = 0, device = \"mem\" } ]";
    // The file without the host; the live read-only setting is dropped with it.
    let dropped = config_text(port, nvme_port, "", other);
    std::fs::write(daemon.file("ferrosan.toml"), dropped).unwrap();
    let reloaded = ctl.json(&["reload", "--discard"]);
    assert_eq!(reloaded["ok"], true, "{reloaded}");
    let started = Instant::now();
    while h.read(1, 8, 1, 512).is_ok() {
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_secs(5),
            "a parked queue outlived its admission"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = wait_for_metric(metrics_port, "ferrosan_nvme_queues", |v| v == 0.0);
    assert_eq!(metric(&text, "ferrosan_nvme_queues"), 0.0);
    assert_eq!(metric(&text, "ferrosan_connections_parked"), 0.0);
    // Ended by their readmission, not by a keep-alive timeout on a slow run.
    let closed = r#"ferrosan_sessions_closed_total{reason="not_in_any_group"}"#;
    assert!(metric(&text, closed) >= 1.0, "{text}");
}

#[test]
fn a_live_change_that_drops_the_host_ends_its_controller() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let nvme_port = free_port();
    let port = free_port();
    let config = |hosts: &str| {
        let group = format!(
            "  name = \"db\"\n  initiators = [{hosts}]\n  luns = [ {{ lun = 0, device = \"mem\" }} ]"
        );
        config_text(port, nvme_port, "", &group)
    };
    let listed = format!("\"{HOSTNQN}\", \"iqn.2024-01.dev.ferrosan:other\"");
    let daemon =
        Daemon::start_config_text(IQN, port, &config(&listed), &["--control-socket", &socket]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    h.write(1, 0, vec![1; 512], 512).unwrap();
    // Reloaded without the host: the next turn's readmission ends both queues.
    let text = config("\"iqn.2024-01.dev.ferrosan:other\"");
    reload_ends(&daemon, &ctl, &text, &mut h, "the dropped host still reads");
    // And it cannot connect again.
    assert_eq!(
        connect_status(nvme_port, NQN, HOSTNQN),
        Status::CONNECT_INVALID_HOST
    );
}

#[test]
fn a_host_registered_through_one_path_is_registered_through_its_others() {
    let (p1, p2, port) = (free_port(), free_port(), free_port());
    // Group 2 is NVMe/TCP only.
    let more = format!("\n[[portal_group]]\ntag = 2\nnvme_listen = [\"127.0.0.1:{p2}\"]\n");
    let group =
        "  name = \"all\"\n  any_initiator = true\n  luns = [ { lun = 0, device = \"mem\" } ]";
    let text = config_text(port, p1, &more, group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    // One host, a controller through each portal group (native multipath's two paths).
    let mut a = NvmeHost::connect(addr(p1), NQN, HOSTNQN, 8).expect("path 1");
    let mut b = NvmeHost::connect(addr(p2), NQN, HOSTNQN, 8).expect("path 2");
    let keys = |cr: u64, nr: u64| {
        let mut d = cr.to_le_bytes().to_vec();
        d.extend_from_slice(&nr.to_le_bytes());
        d
    };
    a.io.run_ok(host::sqe(0x0D, 1, [0; 6]), keys(0, 0x77), 0)
        .expect("register through path 1");
    // Write Exclusive - Registrants Only (3), acquired through path 1.
    a.io.run_ok(
        host::sqe(0x11, 1, [3 << 8, 0, 0, 0, 0, 0]),
        keys(0x77, 0),
        0,
    )
    .expect("acquire");
    // Path 2 is the same registrant: it writes, and reports one registration.
    b.write(1, 0, vec![9; 512], 512)
        .expect("the registrant writes through its other path");
    let report =
        b.io.run_ok(host::sqe(0x0E, 1, [1023, 0, 0, 0, 0, 0]), Vec::new(), 4096)
            .unwrap()
            .data;
    assert_eq!(
        u16::from_le_bytes([report[5], report[6]]),
        1,
        "one registrant"
    );
    // Another host is not.
    let mut other = NvmeHost::connect(addr(p2), NQN, "nqn.2014-08.org.nvmexpress:uuid:other", 8)
        .expect("another host");
    let w = other
        .io
        .run(host::rw(0x01, 1, 0, 1), vec![1; 512], 0)
        .unwrap();
    assert_eq!(w.cqe.status, Status::RESERVATION_CONFLICT);
}

#[test]
fn the_largest_queue_size_a_host_may_ask_for_is_answered_not_overflowed() {
    let (_daemon, nvme_port) = both_doors(&["ram:16M"]);
    let mut admin = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    // SQSIZE FFFFh: the completions' submission queue head wraps within it.
    let (c, data) = host::connect_command(0, u16::MAX, 0xFFFF, NQN, HOSTNQN, [4; 16]);
    admin.run_ok(c, data, 0).expect("connect");
    for _ in 0..3 {
        admin
            .run_ok(host::property_set_cc(1 | 6 << 16 | 4 << 20), Vec::new(), 0)
            .expect("property set");
    }
    // The daemon serves on.
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    assert!(h.read(1, 0, 1, 512).is_ok());
}

/// DH-HMAC-CHAP keys as `nvme gen-dhchap-key` writes them: the host's (SHA-256 transform) and
/// the controller's (none), and one the controller does not hold.
fn dhchap_key(byte: u8, transform: Option<nvme::auth::HashId>) -> nvme::auth::Key {
    nvme::auth::Key::new(transform, &[byte; 32]).unwrap()
}

fn credentials(
    host: u8,
    controller: Option<u8>,
    groups: &[nvme::auth::DhGroup],
) -> host::Credentials {
    host::Credentials {
        host: dhchap_key(host, Some(nvme::auth::HashId::Sha256)),
        controller: controller.map(|c| dhchap_key(c, None)),
        groups: groups.to_vec(),
    }
}

/// A group that lists HOSTNQN and `other`, requires authentication, and holds a DH-HMAC-CHAP
/// secret for HOSTNQN only (made from `host_byte`), with the controller's mutual key.
fn authenticated_group(host_byte: u8) -> String {
    let key = dhchap_key(host_byte, Some(nvme::auth::HashId::Sha256)).encode();
    let ctrl = dhchap_key(7, None).encode();
    format!(
        "  name = \"db\"\n  initiators = [\"{HOSTNQN}\", \"nqn.2014-08.org.nvmexpress:uuid:other\"]\n  auth = \"chap\"\n  users = [ {{ user = \"{HOSTNQN}\", secret = \"{key}\" }} ]\n  mutual = {{ user = \"ferrosan\", secret = \"{ctrl}\" }}\n  luns = [ {{ lun = 0, device = \"mem\" }} ]"
    )
}

#[test]
fn a_host_authenticates_each_queue_before_it_runs_anything_else() {
    use nvme::auth::DhGroup;
    let (nvme_port, port) = (free_port(), free_port());
    let text = config_text(port, nvme_port, "", &authenticated_group(1));
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    // The right key, the controller proven too, through a DH group and without.
    for groups in [&[DhGroup::Ffdhe2048][..], &[DhGroup::Null][..]] {
        let keys = credentials(1, Some(7), groups);
        let mut h = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&keys))
            .expect("an authenticated host connects");
        h.write(1, 0, pattern(3, 4096), 512).unwrap();
        assert_eq!(h.read(1, 0, 8, 512).unwrap(), pattern(3, 4096));
        h.disconnect();
    }
    // Without authenticating: Connect says ATR, and nothing else runs.
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(0, 31, 0xFFFF, NQN, HOSTNQN, [1; 16]);
    let done = q.run_ok(c, data, 0).unwrap();
    assert_ne!(done.cqe.dw0 & 1 << 17, 0, "ATR set");
    for (s, len) in [
        (host::property_set_cc(1 | 6 << 16 | 4 << 20), 0),
        (host::sqe(0x06, 0, [1, 0, 0, 0, 0, 0]), 4096),
    ] {
        assert_eq!(
            q.run(s, Vec::new(), len).unwrap().cqe.status,
            Status::AUTH_REQUIRED
        );
    }
    // A wrong host key: refused, and the queue closed.
    let wrong = credentials(2, None, &[DhGroup::Ffdhe2048]);
    let err = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&wrong)).err();
    assert!(
        matches!(err, Some(host::NvmeError::Auth(nvme::auth::Reason::Failed))),
        "{err:?}"
    );
    // A controller that cannot prove the key the host holds for it: the host refuses it.
    let doubt = credentials(1, Some(8), &[DhGroup::Null]);
    let err = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&doubt)).err();
    assert!(
        matches!(err, Some(host::NvmeError::Auth(nvme::auth::Reason::Failed))),
        "{err:?}"
    );
    // A listed host the group holds no key for can never authenticate: refused at Connect.
    assert_eq!(
        connect_status(nvme_port, NQN, "nqn.2014-08.org.nvmexpress:uuid:other"),
        Status::CONNECT_INVALID_HOST
    );
}

#[test]
fn a_new_secret_ends_the_controllers_that_proved_the_old_one() {
    use nvme::auth::DhGroup;
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port) = (free_port(), free_port());
    let daemon = Daemon::start_config_text(
        IQN,
        port,
        &config_text(port, nvme_port, "", &authenticated_group(1)),
        &["--control-socket", &socket],
    );
    let old = credentials(1, None, &[DhGroup::Null]);
    let mut h = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&old)).unwrap();
    h.write(1, 0, vec![1; 512], 512).unwrap();
    // `ctl sessions` names the user the controller authenticated as (its host NQN).
    let listed = ctl.sessions();
    let mine = listed.iter().find(|s| s["initiator"] == HOSTNQN);
    assert_eq!(
        mine.map(|s| &s["chap_user"]),
        Some(&HOSTNQN.into()),
        "{listed:?}"
    );
    let text = config_text(port, nvme_port, "", &authenticated_group(5));
    reload_ends(
        &daemon,
        &ctl,
        &text,
        &mut h,
        "a controller authenticated with the old secret still reads",
    );
    assert!(NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&old)).is_err());
    let new = credentials(5, None, &[DhGroup::Ffdhe3072]);
    let mut h = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&new)).unwrap();
    assert_eq!(h.read(1, 0, 1, 512).unwrap(), vec![1; 512]);
}

#[test]
fn a_discovery_listener_serves_discovery_only() {
    let (nvme_port, port, discovery_port) = (free_port(), free_port(), free_port());
    let more = format!("nvme_discovery_listen = [\"127.0.0.1:{discovery_port}\"]\n");
    let group = db_group();
    let text = config_text(port, nvme_port, &more, &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    // The discovery controller answers there, and points at the I/O listener, not at itself.
    let listed = entries(&discovery_log(discovery_port));
    let ports: Vec<_> = listed.iter().map(|e| (e.subtype, e.port)).collect();
    assert_eq!(ports, [(3, discovery_port), (2, nvme_port)]);
    // A subsystem's Connect there is refused; at the I/O listener it is served.
    assert_eq!(
        connect_status(discovery_port, NQN, HOSTNQN),
        Status::CONNECT_INVALID_PARAMETERS
    );
    NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
}

#[test]
fn exchanges_a_host_never_finishes_count_as_failed_logins() {
    let (nvme_port, port) = (free_port(), free_port());
    let text = format!(
        "{}\n[limits]\nlogin_failures_max = 2\n",
        config_text(port, nvme_port, "", &authenticated_group(1))
    );
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    for _ in 0..2 {
        // Connected (ATR set), then gone without authenticating.
        let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
        let (c, data) = host::connect_command(0, 31, 0xFFFF, NQN, HOSTNQN, [1; 16]);
        assert_ne!(q.run_ok(c, data, 0).unwrap().cqe.dw0 & 1 << 17, 0);
    }
    // The closes are seen as the daemon notices them: the source is refused soon after.
    let started = Instant::now();
    while connect_status(nvme_port, NQN, HOSTNQN) != Status::CONNECT_CONTROLLER_BUSY {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "abandoned exchanges are not counted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_host_that_restarts_its_exchange_is_counted_each_time_and_stopped() {
    use nvme::auth::{host::Transaction, DhGroup, HashId};
    use nvme::fabrics::auth_sqe;
    let (nvme_port, port) = (free_port(), free_port());
    let text = format!(
        "{}\n[limits]\nlogin_failures_max = 2\n",
        config_text(port, nvme_port, "", &authenticated_group(1))
    );
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(0, 31, 0xFFFF, NQN, HOSTNQN, [1; 16]);
    assert_ne!(q.run_ok(c, data, 0).unwrap().cqe.dw0 & 1 << 17, 0);
    // A host without the secret asks for challenge after challenge and never answers one.
    let parties = nvme::auth::Parties {
        host_nqn: HOSTNQN.into(),
        subsystem_nqn: NQN.into(),
    };
    let t = Transaction::new(dhchap_key(9, None), None, parties, 1);
    let mut challenges = 0;
    for _ in 0..3 {
        let negotiate = t.negotiate(&HashId::ALL, &[DhGroup::Ffdhe2048]);
        let sent = q.run(auth_sqe(0, true, negotiate.len() as u32), negotiate, 0);
        let Ok(received) = sent.and_then(|_| q.run_ok(auth_sqe(0, false, 4096), Vec::new(), 4096))
        else {
            break;
        };
        match nvme::auth::msg::Message::decode(&received.data) {
            Ok(nvme::auth::msg::Message::Challenge(_)) => challenges += 1,
            _ => break,
        }
    }
    assert_eq!(challenges, 2, "one restart, then the queue fails");
    // The restart and the failure were counted: the source is refused, though this queue's
    // own close may not have been seen yet.
    assert_eq!(
        connect_status(nvme_port, NQN, HOSTNQN),
        Status::CONNECT_CONTROLLER_BUSY
    );
}

#[test]
fn a_queue_takes_its_id_only_once_it_has_authenticated() {
    use nvme::auth::DhGroup;
    let (nvme_port, port) = (free_port(), free_port());
    let text = config_text(port, nvme_port, "", &authenticated_group(1));
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let keys = credentials(1, None, &[DhGroup::Null]);
    let mut h = NvmeHost::connect_with(addr(nvme_port), NQN, HOSTNQN, 8, Some(&keys)).unwrap();
    let host_id = host::host_id_of(HOSTNQN);
    let queue = |qid: u16| {
        let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
        let (c, data) = host::connect_command(qid, 31, h.cntlid, NQN, HOSTNQN, host_id);
        let done = q.run(c, data, 0).unwrap();
        (q, done.cqe)
    };
    // Someone without the secret connects queue 2 of the host's controller and stays.
    let (_squatter, cqe) = queue(2);
    assert_eq!(cqe.status, Status::SUCCESS);
    assert_ne!(cqe.dw0 & 1 << 17, 0, "must authenticate");
    // The host's own queue 2 still connects and authenticates, and then holds the ID.
    let (mut own, cqe) = queue(2);
    assert_eq!(
        cqe.status,
        Status::SUCCESS,
        "the ID was taken before any proof"
    );
    own.authenticate_if_asked(cqe.dw0, Some(&keys), NQN, HOSTNQN)
        .unwrap();
    assert_eq!(queue(2).1.status, Status::CONNECT_INVALID_PARAMETERS);
    h.write(1, 0, pattern(5, 512), 512).unwrap();
    assert_eq!(h.read(1, 0, 1, 512).unwrap(), pattern(5, 512));
}

/// Reloads `daemon` with config `text` and waits (5 s at most) until host `h` can no longer
/// read: the reload ended its controller.
fn reload_ends(daemon: &Daemon, ctl: &common::Ctl, text: &str, h: &mut NvmeHost, what: &str) {
    std::fs::write(daemon.file("ferrosan.toml"), text).unwrap();
    let reloaded = ctl.json(&["reload"]);
    assert_eq!(reloaded["ok"], true, "{reloaded}");
    let started = Instant::now();
    while h.read(1, 0, 1, 512).is_ok() {
        assert!(started.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_nvme_listener_added_live_serves_and_closing_it_ends_only_its_controllers() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (port, nvme_port, second) = (free_port(), free_port(), free_port());
    let group =
        "  name = \"all\"\n  any_initiator = true\n  luns = [ { lun = 0, device = \"mem\" } ]";
    let text = config_text(port, nvme_port, "", group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &socket]);
    let mut stays = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let at = addr(second).to_string();
    let r = ctl.json(&["portal-group", "listen", "1", &at, "--nvme"]);
    assert_eq!(r["ok"], true, "{r}");
    let mut goes = NvmeHost::connect(addr(second), NQN, "nqn.2014-08.org.example:second", 8)
        .expect("connect through the listener added live");
    goes.write(1, 0, vec![5; 512], 512).unwrap();
    let r = ctl.json(&["portal-group", "unlisten", "1", &at, "--nvme"]);
    assert_eq!(r["ok"], true, "{r}");
    let started = Instant::now();
    while goes.read(1, 0, 1, 512).is_ok() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the closed listener's controller still reads"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        std::net::TcpStream::connect(addr(second)).is_err(),
        "the listener is closed"
    );
    assert_eq!(
        stays.read(1, 0, 1, 512).unwrap(),
        vec![5; 512],
        "the other path keeps its controller"
    );
}

/// A TLS pre-shared key (SHA-256) of `byte`s in its interchange form, written 0600 under a
/// directory of this test's own; the key and its file's path.
fn tls_key(dir: &std::path::Path, byte: u8) -> (host::TlsPsk, std::path::PathBuf) {
    tls_key_of(dir, byte, nvme::tls::CipherHash::Sha256)
}

/// A TLS pre-shared key of `byte`s for `hash` (32 or 48 bytes), as [`tls_key`].
fn tls_key_of(
    dir: &std::path::Path,
    byte: u8,
    hash: nvme::tls::CipherHash,
) -> (host::TlsPsk, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt as _;
    let bytes = vec![byte; hash.key_len()];
    let key = nvme::tls::ConfiguredKey::new(Some(hash), &bytes);
    let text = key.unwrap().encode();
    let path = dir.join(format!("tls-{byte}.key"));
    std::fs::write(&path, format!("{text}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    (host::TlsPsk::parse(&text, "spec").unwrap(), path)
}

/// The config of `config_text` whose target requires TLS of HOSTNQN with the key at `key`.
fn tls_config(port: u16, nvme_port: u16, key: &std::path::Path) -> String {
    let group = format!(
        "  name = \"db\"\n  initiators = [\"{HOSTNQN}\", \"nqn.2014-08.org.nvmexpress:uuid:other\"]\n  luns = [ {{ lun = 0, device = \"mem\" }} ]"
    );
    config_text(port, nvme_port, "", &group).replace(
        &format!("nqn = \"{NQN}\"\n"),
        &format!(
            "nqn = \"{NQN}\"\ntls_keys = [ {{ host = \"{HOSTNQN}\", key_file = \"{}\" }} ]\n",
            key.display()
        ),
    )
}

#[test]
fn a_host_with_a_tls_key_connects_over_tls_only_and_with_that_key() {
    let dir = std::env::temp_dir().join(format!("ferrosan-nvme-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (good, good_file) = tls_key(&dir, 1);
    let (wrong, wrong_file) = tls_key(&dir, 2);
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port, metrics_port) = (free_port(), free_port(), free_port());
    let metrics = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_config_text(
        IQN,
        port,
        &tls_config(port, nvme_port, &good_file),
        &["--control-socket", &socket, "--metrics-listen", &metrics],
    );
    let handshakes = |result: &str, n: f64| {
        let series = format!("ferrosan_nvme_tls_handshakes_total{{result=\"{result}\"}}");
        let text = wait_for_metric(metrics_port, &series, |v| v >= n);
        metric(&text, &series)
    };
    let a = addr(nvme_port);
    // Over TLS with its key: both queues, data both ways (a 64 KiB write takes R2T and
    // H2CData, a 64 KiB read C2HData, all inside TLS records).
    let mut h = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&good))
        .expect("the host connects over TLS");
    h.write(1, 0, pattern(9, 65536), 512).unwrap();
    assert_eq!(h.read(1, 0, 128, 512).unwrap(), pattern(9, 65536));
    assert_eq!(handshakes("success", 2.0), 2.0, "one handshake per queue");
    // In the clear: Connect refused (Invalid Host).
    let err = NvmeHost::connect(a, NQN, HOSTNQN, 8).err();
    assert!(
        matches!(err, Some(host::NvmeError::Status(s)) if s == Status::CONNECT_INVALID_HOST),
        "{err:?}"
    );
    // A key the controller does not hold: the handshake fails.
    let err = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&wrong)).err();
    assert!(
        matches!(err, Some(host::NvmeError::Tls(_) | host::NvmeError::Io(_))),
        "{err:?}"
    );
    assert_eq!(
        handshakes("handshake", 1.0),
        1.0,
        "the failed handshake is counted"
    );
    // Another host's TLS identity does not make it that host, nor a host without a key
    // a TLS one: refused at Connect.
    let other = "nqn.2014-08.org.nvmexpress:uuid:other";
    let err = NvmeHost::connect_secure(a, NQN, other, 8, None, Some(&good)).err();
    assert!(
        err.is_some(),
        "a host with no key of its own connected over TLS"
    );
    assert!(
        NvmeHost::connect(a, NQN, other, 8).is_ok(),
        "a host without a key, in the clear"
    );
    // The host's key changed live: its controller ends, the new key connects.
    let text = tls_config(port, nvme_port, &wrong_file);
    reload_ends(
        &daemon,
        &ctl,
        &text,
        &mut h,
        "a controller over the old key still reads",
    );
    let mut h = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&wrong)).unwrap();
    assert_eq!(h.read(1, 0, 128, 512).unwrap(), pattern(9, 65536));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sha384_key_connects_with_its_suite_and_as_debian_13_binds_it() {
    use nvme::tls::CipherHash;
    let dir = std::env::temp_dir().join(format!("ferrosan-nvme-tls384-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (key, file) = tls_key_of(&dir, 3, CipherHash::Sha384);
    let (nvme_port, port) = (free_port(), free_port());
    let _daemon = Daemon::start_config_text(IQN, port, &tls_config(port, nvme_port, &file), &[]);
    let a = addr(nvme_port);
    // Identity NVMe0R02, TLS_AES_256_GCM_SHA384 (as ktls-utils 1.1 and later connect).
    let mut h = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&key))
        .expect("a SHA-384 key connects with its suite");
    h.write(1, 0, pattern(4, 65536), 512).unwrap();
    assert_eq!(h.read(1, 0, 128, 512).unwrap(), pattern(4, 65536));
    // The same identity with the PSK bound with SHA-256 (ktls-utils 1.0, Debian 13's host).
    let bound256 = host::TlsPsk {
        bound_with: Some(CipherHash::Sha256),
        ..key.clone()
    };
    let mut h2 = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&bound256))
        .expect("a SHA-384 key bound with SHA-256 connects");
    assert_eq!(h2.read(1, 0, 128, 512).unwrap(), pattern(4, 65536));
    // A SHA-256 key of the same host is not this one: the handshake fails.
    let (other, _) = tls_key(&dir, 3);
    let err = NvmeHost::connect_secure(a, NQN, HOSTNQN, 8, None, Some(&other)).err();
    assert!(
        matches!(err, Some(host::NvmeError::Tls(_) | host::NvmeError::Io(_))),
        "{err:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_idle_controller_hears_of_a_change_to_its_namespace_at_once() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port) = (free_port(), free_port());
    let group = db_group();
    let text = config_text(port, nvme_port, "", &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &socket]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let aec = nvme::identify::OAES_NS_ATTRIBUTE | nvme::identify::OAES_ANA_CHANGE;
    let features = host::sqe(
        nvme::admin::opcode::SET_FEATURES,
        0,
        [0x0B, aec, 0, 0, 0, 0],
    );
    h.admin.run_ok(features, Vec::new(), 0).unwrap();
    let aer = host::sqe(nvme::admin::opcode::ASYNC_EVENT_REQUEST, 0, [0; 6]);
    let cid = h.admin.submit(aer, Vec::new(), 0).unwrap();
    // The controller now sits idle (no keep-alive asked, nothing due): only the change,
    // nudged to its queues (crates/engine/src/shared/nudge.rs), can wake it.
    std::thread::sleep(Duration::from_millis(1_500));
    let changed = Instant::now();
    assert_eq!(
        ctl.json(&["device", "set", "mem", "--read-only", "on"])["ok"],
        true
    );
    let done = h.admin.next_done().expect("the event request completes");
    let waited = changed.elapsed();
    assert_eq!(done.cqe.cid, cid);
    assert!(done.cqe.status.is_success());
    assert_eq!(
        done.cqe.dw0,
        nvme::controller::Notice::NamespaceAttribute.dw0(),
        "Namespace Attribute Changed"
    );
    assert!(waited < Duration::from_secs(5), "heard after {waited:?}");
    eprintln!("the notice came {waited:?} after the change was asked for");
}

#[test]
fn a_persistent_discovery_controller_hears_of_a_subsystem_added_live() {
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let (nvme_port, port) = (free_port(), free_port());
    let group = db_group();
    let text = config_text(port, nvme_port, "", &group);
    let _daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &socket]);
    // A discovery controller kept open, as `nvme discover --persistent` keeps it, with its
    // Asynchronous Event Request held.
    let mut q = discovery_controller(nvme_port);
    let log = |q: &mut QueueConn| {
        let page = q
            .run_ok(
                host::sqe(0x02, 0, [0x70 | 1023 << 16, 0, 0, 0, 0, 0]),
                Vec::new(),
                4096,
            )
            .unwrap()
            .data;
        // Subsystems only (the first entry is the discovery service itself).
        u64::from_le_bytes(page[8..16].try_into().unwrap()) - 1
    };
    assert_eq!(log(&mut q), 1);
    let aer = host::sqe(nvme::admin::opcode::ASYNC_EVENT_REQUEST, 0, [0; 6]);
    let cid = q.submit(aer, Vec::new(), 0).unwrap();
    // A mapping that reaches no new subsystem changes nothing the host may discover.
    assert_eq!(ctl.json(&["device", "add", "more", "ram:4M"])["ok"], true);
    assert_eq!(
        ctl.json(&["lun", "map", IQN, "db", "1", "more"])["ok"],
        true
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(q.in_flight(), 1, "no notice for a log that did not change");
    // A second subsystem for this host, live: the notice, and the log lists it.
    let added = Instant::now();
    let second = "iqn.2024-01.dev.ferrosan:nvme-second";
    let reply = ctl.json(&[
        "target",
        "add",
        second,
        "--initiator",
        HOSTNQN,
        "--nqn",
        "nqn.2024-01.dev.ferrosan:nvme-second",
    ]);
    assert_eq!(reply["ok"], true, "{reply}");
    let done = q.next_done().expect("the event request completes");
    assert_eq!(done.cqe.cid, cid);
    assert_eq!(
        done.cqe.dw0,
        nvme::controller::Notice::DiscoveryChange.dw0(),
        "Discovery Log Page Change"
    );
    assert!(added.elapsed() < Duration::from_secs(5));
    assert_eq!(log(&mut q), 2);
}

#[test]
fn the_write_cache_is_one_setting_whichever_door_changes_it() {
    let (daemon, nvme_port) = both_doors(&["ram:16M", "ram:16M"]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let mut iscsi = Path::connect(daemon.port, IQN, INITIATOR, [0x40, 0, 0, 0, 0, 9]).unwrap();
    iscsi.settle();
    let features = |h: &mut NvmeHost, cdw10: u32| {
        h.admin
            .run_ok(host::sqe(0x0A, 0, [cdw10, 0, 0, 0, 0, 0]), Vec::new(), 0)
            .unwrap()
            .cqe
            .dw0
    };
    // LUN 0's WCE, as MODE SENSE (10) of the caching page shows it.
    let wce = |iscsi: &mut Path| {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x5A;
        cdb[1] = 0x08; // DBD
        cdb[2] = 0x08;
        cdb[8] = 64;
        let (status, _, data) = iscsi.run(&cdb, read_len(64));
        assert_eq!(status, 0);
        data[8 + 2] & 0x04 != 0
    };
    assert_eq!(features(&mut h, 0x06 | 3 << 8), 1 << 2, "changeable");
    let set = |h: &mut NvmeHost, on: u32| {
        h.admin
            .run_ok(host::sqe(0x09, 0, [0x06, on, 0, 0, 0, 0]), Vec::new(), 0)
            .expect("Set Features (Volatile Write Cache)")
    };
    // On from NVMe: LUN 0's device, seen through iSCSI, which hears of the change (MODE
    // PARAMETERS CHANGED).
    set(&mut h, 1);
    assert_eq!(features(&mut h, 0x06), 1);
    let (status, sense, _) = iscsi.run(&[0; 6], Transfer::None);
    assert_eq!((status, sense.map(|s| (s.1, s.2))), (2, Some((0x2A, 0x01))));
    iscsi.settle();
    assert!(wce(&mut iscsi));
    // Off from NVMe: every namespace's device (the feature reads on while any is on).
    set(&mut h, 0);
    assert_eq!(features(&mut h, 0x06), 0);
    iscsi.settle();
    assert!(!wce(&mut iscsi));
    // On again from iSCSI (LUN 0): NVMe reports the cache on.
    let mut cdb = [0u8; 10];
    cdb[0] = 0x55;
    cdb[1] = 0x10;
    cdb[8] = 28;
    let mut page = vec![0u8; 28];
    page[8..11].copy_from_slice(&[0x08, 0x12, 0x04]);
    assert_eq!(iscsi.run(&cdb, Transfer::Write(page)).0, 0);
    assert_eq!(features(&mut h, 0x06), 1);
}

#[test]
fn an_abort_stops_a_write_still_waiting_for_its_data_and_only_that() {
    let (nvme_port, port) = (free_port(), free_port());
    let group = db_group();
    // 1 MiB of solicited data per queue: a second large write waits for its R2T.
    let text = format!(
        "{}\n[limits]\nmemory_per_connection_bytes = 4194304\n",
        config_text(port, nvme_port, "", &group)
    );
    let _daemon = Daemon::start_config_text(IQN, port, &text, &[]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let before = h.read(1, 0, 8, 512).unwrap();
    // A second I/O queue whose host is slow to send its data.
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(2, 31, h.cntlid, NQN, HOSTNQN, host::host_id_of(HOSTNQN));
    q.run_ok(c, data, 0).expect("I/O queue 2");
    q.withhold_data(true).unwrap();
    let mib = 1 << 20;
    let first = q
        .submit(host::rw(0x01, 1, 0, 2048), pattern(1, mib), 0)
        .unwrap();
    q.receive().unwrap(); // its R2T: the data is asked for, and kept back
    let second = q
        .submit(host::rw(0x01, 1, 4096, 128), pattern(2, 64 << 10), 0)
        .unwrap();
    let abort = |h: &mut NvmeHost, sqid: u32, cid: u16| {
        h.admin
            .run_ok(
                host::sqe(0x08, 0, [sqid | u32::from(cid) << 16, 0, 0, 0, 0, 0]),
                Vec::new(),
                0,
            )
            .expect("Abort")
            .cqe
            .dw0
    };
    // The second was never asked for its data: aborted, answered at once, never run.
    assert_eq!(abort(&mut h, 2, second) & 1, 0, "aborted");
    let done = q.next_done().unwrap();
    assert_eq!(
        (done.cqe.cid, done.cqe.status),
        (second, Status::ABORTED_BY_REQUEST)
    );
    // The first's data is on the way: aborted, answered when the data has arrived, not run.
    assert_eq!(abort(&mut h, 2, first) & 1, 0, "aborted");
    q.withhold_data(false).unwrap();
    let done = q.next_done().unwrap();
    assert_eq!(
        (done.cqe.cid, done.cqe.status),
        (first, Status::ABORTED_BY_REQUEST)
    );
    assert_eq!(h.read(1, 0, 8, 512).unwrap(), before, "nothing was written");
    assert_eq!(h.read(1, 4096, 8, 512).unwrap(), vec![0; 4096]);
    // A command that ran, an unknown one, a queue that does not exist: not aborted.
    let read = q.submit(host::rw(0x02, 1, 0, 8), Vec::new(), 4096).unwrap();
    assert_eq!(q.next_done().unwrap().cqe.cid, read);
    assert_eq!(abort(&mut h, 2, read) & 1, 1);
    assert_eq!(abort(&mut h, 5, 1) & 1, 1);
    // The queue serves on: a write with its data now.
    q.run_ok(host::rw(0x01, 1, 0, 8), pattern(3, 4096), 0)
        .expect("a write after the aborts");
    assert_eq!(h.read(1, 0, 8, 512).unwrap(), pattern(3, 4096));
    // A held Asynchronous Event Request, aborted on the admin queue.
    let aer = host::sqe(nvme::admin::opcode::ASYNC_EVENT_REQUEST, 0, [0; 6]);
    let held = h.admin.submit(aer, Vec::new(), 0).unwrap();
    let cid = h
        .admin
        .submit(
            host::sqe(0x08, 0, [u32::from(held) << 16, 0, 0, 0, 0, 0]),
            Vec::new(),
            0,
        )
        .unwrap();
    let mut answers: Vec<_> = (0..2).map(|_| h.admin.next_done().unwrap().cqe).collect();
    answers.sort_by_key(|c| c.cid != held);
    assert_eq!(
        (answers[0].cid, answers[0].status),
        (held, Status::ABORTED_BY_REQUEST)
    );
    assert_eq!((answers[1].cid, answers[1].dw0 & 1), (cid, 0));
}

/// A disk that holds a write (its filesystem frozen, as a slow or stuck disk holds it): an
/// Abort of that write is answered at once, "not aborted" — the write is in the kernel and
/// cannot be called back, as nvmet answers — and the RAM namespace beside it serves on the
/// same controller meanwhile; once the disk lets go, the write completes and reads back.
#[test]
fn an_abort_of_a_write_the_disk_holds_is_answered_at_once_and_nothing_else_waits() {
    use common::loopfs::{sh, LoopFs};
    let fs = LoopFs::new("ext4", 96 << 20);
    let file = format!("file:{},size=16M", fs.path("ns1.img").display());
    let (_daemon, nvme_port) = both_doors(&[&file, "ram:16M"]);
    let mut h = NvmeHost::connect(addr(nvme_port), NQN, HOSTNQN, 8).expect("connect");
    let mut q = QueueConn::open(addr(nvme_port), (false, false)).unwrap();
    let (c, data) = host::connect_command(2, 31, h.cntlid, NQN, HOSTNQN, host::host_id_of(HOSTNQN));
    q.run_ok(c, data, 0).expect("I/O queue 2");
    let mountpoint = fs.mountpoint.display().to_string();
    /// Thaws on drop too, so a failed assertion leaves no frozen filesystem to unmount.
    struct Frozen(String);
    impl Drop for Frozen {
        fn drop(&mut self) {
            let _ = std::process::Command::new("fsfreeze")
                .args(["-u", &self.0])
                .status();
        }
    }
    sh("fsfreeze", &["-f", &mountpoint]);
    let frozen = Frozen(mountpoint);
    let thaw = || drop(frozen);
    let held = q
        .submit(host::rw(0x01, 1, 0, 8), pattern(7, 4096), 0)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The disk holds the write until the thaw below: an answer within 5 s did not wait for it.
    let asked = Instant::now();
    let abort = host::sqe(0x08, 0, [2 | u32::from(held) << 16, 0, 0, 0, 0, 0]);
    let answer = h.admin.run_ok(abort, Vec::new(), 0);
    let abort_took = asked.elapsed();
    // The namespace beside it, on the same controller's first queue.
    let read_started = Instant::now();
    let beside = h.read(2, 0, 8, 512);
    let read_took = read_started.elapsed();
    thaw();
    let answer = answer.expect("Abort").cqe;
    assert_eq!(answer.dw0 & 1, 1, "a write in the kernel is not aborted");
    assert!(
        abort_took < Duration::from_secs(5),
        "Abort answered after {abort_took:?}"
    );
    assert_eq!(beside.expect("RAM namespace"), vec![0; 4096]);
    assert!(
        read_took < Duration::from_secs(5),
        "the RAM namespace answered in {read_took:?}"
    );
    let done = q.next_done().unwrap();
    assert_eq!((done.cqe.cid, done.cqe.status), (held, Status::SUCCESS));
    assert_eq!(h.read(1, 0, 8, 512).unwrap(), pattern(7, 4096));
    eprintln!(
        "Abort of a held write answered in {abort_took:?}; RAM namespace read in {read_took:?}"
    );
}
