//! Volumes of a pool on XFS (a loop device the test formats) and of an RBD pool (the test
//! cluster): create, map, write from an initiator, snapshot, write more, clone the snapshot,
//! map the clone: it reads exactly the data of the snapshot moment; rollback restores it;
//! delete is refused while mapped or while snapshots remain (and, on RBD, a snapshot while
//! clones depend on it); every verb repeated answers success with `existed`. Needs root
//! (losetup, mount) and the Ceph packages, as the test command installs.

mod common;

use common::ceph::TestCluster;
use common::loopfs::LoopFs;
use common::raw::{self, Raw};
use common::{Ctl, Daemon};
use serde_json::Value;

const IQN: &str = "iqn.2026-11.org.ferrosan:volumes";

fn ok(ctl: &Ctl, args: &[&str]) -> Value {
    let r = ctl.json(args);
    assert_eq!(r["ok"], true, "ctl {args:?}: {r}");
    r
}

fn refused(ctl: &Ctl, args: &[&str], why: &str) {
    let r = ctl.json(args);
    assert_eq!(r["ok"], false, "ctl {args:?} should be refused: {r}");
    assert!(
        r["error"].as_str().unwrap_or("").contains(why),
        "ctl {args:?}: {r}"
    );
}

/// Runs a command on `lun` until it is not a unit attention; its status and data.
fn command(
    raw: &mut Raw,
    itt: &mut u32,
    lun: u8,
    cdb: &[u8],
    data_out: &[u8],
    read: u32,
) -> (u8, Vec<u8>) {
    for _ in 0..6 {
        let flags = if data_out.is_empty() { 0xC0 } else { 0xA0 };
        let edtl = if data_out.is_empty() {
            read
        } else {
            data_out.len() as u32
        };
        let mut bhs = raw.command(*itt, cdb, flags, edtl);
        bhs.set_lun([0, lun, 0, 0, 0, 0, 0, 0]); // peripheral addressing
        *itt += 1;
        raw.send(&bhs, data_out);
        let mut data = Vec::new();
        loop {
            let pdu = raw.recv();
            if pdu.opcode() == iscsi::pdu::Opcode::DataIn as u8 {
                data.extend_from_slice(&pdu.data);
                if pdu.bhs.flags() & 0x01 == 0 {
                    continue;
                }
                return (0, data);
            }
            let status = raw::status_of(&pdu);
            let unit_attention = status == 2 && pdu.data.get(4).is_some_and(|k| k & 0x0f == 0x06);
            if unit_attention {
                break;
            }
            return (status, data);
        }
    }
    panic!("LUN {lun}: unit attentions without end");
}

fn write(raw: &mut Raw, itt: &mut u32, lun: u8, byte: u8) {
    let (status, _) = command(raw, itt, lun, &raw::rw10(0x2A, 0, 8), &[byte; 4096], 0);
    assert_eq!(status, 0, "WRITE to LUN {lun}");
}

fn read(raw: &mut Raw, itt: &mut u32, lun: u8) -> Vec<u8> {
    let (status, data) = command(raw, itt, lun, &raw::rw10(0x28, 0, 8), &[], 4096);
    assert_eq!(status, 0, "READ of LUN {lun}");
    data
}

/// What differs between pool kinds in the scenario.
struct Kind {
    /// The `[[pool]]` table's lines after `name`.
    pool: String,
    /// The `method` a snapshot and a clone answer.
    methods: (&'static str, &'static str),
    /// Whether a snapshot with a clone is kept (RBD clones depend on their parent snapshot;
    /// reflink clones share extents but depend on nothing).
    clones_depend: bool,
}

#[test]
fn an_xfs_pool_snapshots_and_clones_by_reflink() {
    let fs = LoopFs::new("xfs", 512 << 20);
    let pool = fs.path("pool");
    scenario(&Kind {
        pool: format!("path = \"{}\"", pool.display()),
        methods: ("reflink", "reflink"),
        clones_depend: false,
    });
    assert!(!pool.join("vm1.img").exists() && !pool.join("vm2.img").exists());
}

#[test]
fn an_rbd_pool_snapshots_and_clones_by_librbd() {
    let cluster = TestCluster::start("volumes", 3, "");
    scenario(&Kind {
        pool: format!(
            "kind = \"rbd\"\npool = \"rbd\"\nceph_conf = \"{}\"",
            cluster.conf_str()
        ),
        methods: ("rbd", "rbd clone"),
        clones_depend: true,
    });
    let left = String::from_utf8_lossy(&cluster.rbd(&["ls", "rbd"])).to_string();
    assert!(left.trim().is_empty(), "images left behind: {left}");
}

fn scenario(kind: &Kind) {
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let body = format!(
        "[[pool]]\nname = \"fast\"\n{}\n\n[[device]]\nname = \"boot\"\nstore = \"ram\"\nsize = \"8M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"boot\" }} ]\n",
        kind.pool
    );
    let mut daemon = Daemon::start_config_args(IQN, &body, &["--control-socket", &s]);

    let made = ok(&ctl, &["volume", "create", "fast", "vm1", "64M"]);
    assert_eq!(made["existed"], false, "{made}");
    assert_eq!(
        ok(&ctl, &["volume", "create", "fast", "vm1", "64M"])["existed"],
        true
    );
    refused(&ctl, &["volume", "create", "fast", "vm1", "32M"], "exists");
    // The pool's medium answers its size and free space (statvfs, or the monitors' df).
    let pools = ok(&ctl, &["pool", "list", "fast"]);
    let pool = &pools["pools"][0];
    let (total, free) = (
        pool["total_bytes"].as_u64(),
        pool["available_bytes"].as_u64(),
    );
    assert!(
        matches!((total, free), (Some(t), Some(f)) if f > 0 && f <= t),
        "{pools}"
    );
    assert_eq!(
        (&pool["volumes"], &pool["provisioned_bytes"]),
        (&Value::from(1), &Value::from(64u64 << 20)),
        "{pools}"
    );
    refused(&ctl, &["pool", "list", "slow"], "no pool");
    ok(&ctl, &["lun", "map", IQN, "all", "1", "vm1"]);

    let mut raw = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    write(&mut raw, &mut itt, 1, b'A');
    let snap = ok(&ctl, &["volume", "snapshot", "vm1", "s1"]);
    assert_eq!(snap["method"], kind.methods.0, "{snap}");
    assert_eq!(
        ok(&ctl, &["volume", "snapshot", "vm1", "s1"])["existed"],
        true
    );
    write(&mut raw, &mut itt, 1, b'B');

    let clone = ok(&ctl, &["volume", "clone", "vm1", "vm2", "--snapshot", "s1"]);
    assert_eq!(clone["method"], kind.methods.1, "{clone}");
    assert_eq!(
        ok(&ctl, &["volume", "clone", "vm1", "vm2", "--snapshot", "s1"])["existed"],
        true
    );
    ok(&ctl, &["lun", "map", IQN, "all", "2", "vm2"]);
    assert_eq!(
        read(&mut raw, &mut itt, 2),
        vec![b'A'; 4096],
        "the clone holds the snapshot moment"
    );
    assert_eq!(
        read(&mut raw, &mut itt, 1),
        vec![b'B'; 4096],
        "the volume kept its later write"
    );
    // The clone is a volume of its own: written, the source does not change.
    write(&mut raw, &mut itt, 2, b'C');
    assert_eq!(read(&mut raw, &mut itt, 1), vec![b'B'; 4096]);

    // Delete refused while mapped; rollback refused while mapped and online.
    refused(&ctl, &["volume", "delete", "vm2"], "mapped");
    refused(&ctl, &["volume", "rollback", "vm1", "s1"], "offline");
    ok(&ctl, &["device", "offline", "vm1"]);
    ok(&ctl, &["volume", "rollback", "vm1", "s1"]);
    ok(&ctl, &["device", "online", "vm1"]);
    assert_eq!(
        read(&mut raw, &mut itt, 1),
        vec![b'A'; 4096],
        "rolled back to the snapshot"
    );

    let listed = ok(&ctl, &["volume", "list"]);
    let names: Vec<&str> = listed["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["volume"].as_str())
        .collect();
    assert_eq!(names, ["vm1", "vm2"], "{listed}");
    assert_eq!(listed["volumes"][0]["size_bytes"], 64 << 20, "{listed}");
    let snaps = ok(&ctl, &["snapshot", "list", "vm1"]);
    assert_eq!(snaps["snapshots"][0]["snapshot"], "s1", "{snaps}");
    // One volume asked for alone is that volume's entry of the whole listing.
    let one = ok(&ctl, &["volume", "list", "vm1"]);
    assert_eq!(one["volumes"].as_array().map(Vec::len), Some(1), "{one}");
    assert_eq!(one["volumes"][0], listed["volumes"][0], "{one}");
    assert_eq!(
        one["volumes"][0]["snapshots"],
        serde_json::json!(["s1"]),
        "{one}"
    );
    let none = ok(&ctl, &["volume", "list", "vm9"]);
    assert_eq!(none["volumes"], serde_json::json!([]), "{none}");

    // A clone of the volume as it is now. An RBD pool clones a snapshot taken for it, named
    // after the clone and kept while the clone depends on it.
    let live = ok(&ctl, &["volume", "clone", "vm1", "vm3"]);
    let taken = kind.clones_depend.then_some("vm3");
    assert_eq!(live["snapshot"].as_str(), taken, "{live}");
    assert_eq!(
        ok(&ctl, &["volume", "clone", "vm1", "vm3"])["existed"],
        true
    );
    ok(&ctl, &["lun", "map", IQN, "all", "3", "vm3"]);
    assert_eq!(
        read(&mut raw, &mut itt, 3),
        vec![b'A'; 4096],
        "the live clone holds the volume as it was"
    );
    ok(&ctl, &["lun", "unmap", IQN, "all", "3"]);
    assert_eq!(ok(&ctl, &["volume", "delete", "vm3"])["deleted"], true);
    assert_eq!(
        ok(&ctl, &["snapshot", "delete", "vm1", "vm3"])["deleted"],
        kind.clones_depend
    );

    // Unmapped, a volume with snapshots is kept until they go; then it goes, once.
    ok(&ctl, &["lun", "unmap", IQN, "all", "2"]);
    ok(&ctl, &["lun", "unmap", IQN, "all", "1"]);
    if kind.clones_depend {
        refused(
            &ctl,
            &["snapshot", "delete", "vm1", "s1"],
            "dependent clones",
        );
    }
    // Flattened, the clone depends on nothing and keeps its data.
    let flat = ok(&ctl, &["volume", "flatten", "vm2"]);
    assert_eq!(flat["flattened"], kind.clones_depend, "{flat}");
    assert_eq!(ok(&ctl, &["volume", "flatten", "vm2"])["flattened"], false);
    ok(&ctl, &["lun", "map", IQN, "all", "2", "vm2"]);
    assert_eq!(
        read(&mut raw, &mut itt, 2),
        vec![b'C'; 4096],
        "the flattened clone's data"
    );
    ok(&ctl, &["lun", "unmap", IQN, "all", "2"]);
    assert_eq!(ok(&ctl, &["volume", "delete", "vm2"])["deleted"], true);
    assert_eq!(ok(&ctl, &["volume", "delete", "vm2"])["deleted"], false);
    refused(&ctl, &["volume", "delete", "vm1"], "snapshots");
    assert_eq!(
        ok(&ctl, &["snapshot", "delete", "vm1", "s1"])["deleted"],
        true
    );
    assert_eq!(
        ok(&ctl, &["snapshot", "delete", "vm1", "s1"])["deleted"],
        false
    );
    ok(&ctl, &["volume", "delete", "vm1", "--save"]);
    let text = std::fs::read_to_string(daemon.file("ferrosan.toml")).unwrap();
    assert!(!text.contains("vm1") && text.contains("[[pool]]"), "{text}");
    raw.ping(999);
    daemon.stop();
}

#[test]
fn a_pool_that_cannot_reflink_copies_only_volumes_not_in_use() {
    let fs = LoopFs::new("ext4", 256 << 20);
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let body = format!(
        "[[pool]]\nname = \"slow\"\npath = \"{}\"\n\n[[device]]\nname = \"boot\"\nstore = \"ram\"\nsize = \"8M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"boot\" }} ]\n",
        fs.path("pool").display()
    );
    let mut daemon = Daemon::start_config_args(IQN, &body, &["--control-socket", &s]);
    ok(&ctl, &["volume", "create", "slow", "vm1", "16M"]);
    ok(&ctl, &["lun", "map", IQN, "all", "1", "vm1"]);
    let mut raw = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    write(&mut raw, &mut itt, 1, b'A');
    // ext4 shares no extents: holding the writes of a volume in use for a whole copy is refused.
    refused(&ctl, &["volume", "snapshot", "vm1", "s1"], "cannot reflink");
    ok(&ctl, &["device", "offline", "vm1"]);
    let snap = ok(&ctl, &["volume", "snapshot", "vm1", "s1"]);
    assert_eq!(snap["method"], "copy", "{snap}");
    ok(&ctl, &["device", "online", "vm1"]);
    let clone = ok(&ctl, &["volume", "clone", "vm1", "vm2", "--snapshot", "s1"]);
    assert_eq!(clone["method"], "copy", "{clone}");
    ok(&ctl, &["lun", "map", IQN, "all", "2", "vm2"]);
    assert_eq!(
        read(&mut raw, &mut itt, 2),
        vec![b'A'; 4096],
        "the copied clone's data"
    );
    raw.ping(999);
    daemon.stop();
}

/// The orchestrator's step (CSI ControllerPublish, a Proxmox plugin): `volume export` shows a
/// volume to one host at a free LUN in a group of the host's own, idempotently; the host reads
/// and writes it there; `volume unexport` takes it away, and the host's group goes with its
/// last LUN.
#[test]
fn a_volume_is_exported_to_one_host_and_unexported_in_one_step() {
    const HOST: &str = "iqn.2026-11.org.example:hostile";
    let dir = common::disk_dir("volumes-export");
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let body = format!(
        "[[pool]]\nname = \"fast\"\npath = \"{}\"\n\n[[device]]\nname = \"boot\"\nstore = \"ram\"\nsize = \"8M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"boot\" }} ]\n",
        dir.join("pool").display()
    );
    let mut daemon = Daemon::start_config_args(IQN, &body, &["--control-socket", &s]);
    ok(&ctl, &["volume", "create", "fast", "vm1", "16M"]);
    ok(&ctl, &["volume", "create", "fast", "vm3", "16M"]);
    let export = ["volume", "export", "vm1", "--initiator", HOST];
    let first = ok(&ctl, &export);
    assert_eq!(
        (&first["lun"], &first["existed"], &first["target"]),
        (&Value::from(0), &Value::from(false), &Value::from(IQN)),
        "{first}"
    );
    assert_eq!(first["group"], "host-iqn.2026-11.org.example.hostile");
    assert!(
        !first["serial"].as_str().unwrap_or("").is_empty(),
        "{first}"
    );
    assert_eq!(first["naa"].as_str().map(str::len), Some(16), "{first}");
    // Asked again: the same answer, nothing changed.
    let again = ok(&ctl, &export);
    assert_eq!(again["existed"], true);
    assert_eq!(
        (&again["lun"], &again["naa"]),
        (&first["lun"], &first["naa"])
    );
    refused(
        &ctl,
        &["volume", "export", "vm1", "--initiator", HOST, "--lun", "5"],
        "exported to",
    );
    // A malformed host name is named as written, and no group is made for it.
    let said = ctl.run(&["volume", "export", "vm3", "--initiator", "not a name"]);
    assert!(
        !said.success()
            && said.stderr.contains("initiator \"not a name\"")
            && !said.stderr.contains("host-"),
        "{}",
        said.describe()
    );
    let second = ok(&ctl, &["volume", "export", "vm3", "--initiator", HOST]);
    assert_eq!(second["lun"], 1, "{second}");
    // In words, for a person: where it is, asked again too.
    let said = ctl.run(&["volume", "export", "vm3", "--initiator", HOST]);
    assert!(
        said.success()
            && said.stdout.contains(&format!(
                "volume vm3 already exported: LUN 1 of {IQN}, group host-iqn.2026-11.org.example.hostile, NAA "
            )),
        "{}",
        said.describe()
    );

    // The host sees the volume at its LUN 0 (not the RAM device the others see there).
    let mut raw = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    write(&mut raw, &mut itt, 0, b'E');
    assert_eq!(read(&mut raw, &mut itt, 0), vec![b'E'; 4096]);
    raw.ping(999);
    drop(raw);
    let vm1 = std::fs::read(dir.join("pool/vm1.img")).unwrap();
    assert_eq!(
        &vm1[..4096],
        &[b'E'; 4096][..],
        "the write landed in the volume"
    );

    refused(&ctl, &["volume", "delete", "vm1"], "mapped");
    let gone = ok(&ctl, &["volume", "unexport", "vm3", "--initiator", HOST]);
    assert_eq!(
        (&gone["unexported"], &gone["group_removed"]),
        (&Value::from(true), &Value::from(false)),
        "{gone}"
    );
    let last = ok(
        &ctl,
        &["volume", "unexport", "vm1", "--initiator", HOST, "--save"],
    );
    assert_eq!(
        (&last["lun"], &last["group_removed"]),
        (&Value::from(0), &Value::from(true)),
        "{last}"
    );
    let twice = ok(&ctl, &["volume", "unexport", "vm1", "--initiator", HOST]);
    assert_eq!(twice["unexported"], false, "{twice}");
    let said = ctl.run(&["volume", "unexport", "vm1", "--initiator", HOST]);
    assert!(
        said.success() && said.stdout.contains("volume vm1 was not exported through"),
        "{}",
        said.describe()
    );
    let text = std::fs::read_to_string(daemon.file("ferrosan.toml")).unwrap();
    assert!(!text.contains("host-iqn"), "{text}");
    ok(&ctl, &["volume", "delete", "vm1"]);
    ok(&ctl, &["volume", "delete", "vm3"]);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory pool whose filesystem fills under a thin volume an NVMe/TCP host writes: the
/// write that finds no room answers Capacity Exceeded (the NVMe form of SPACE ALLOCATION
/// FAILED), reads go on, and once room is made (a file deleted) writes resume on the same
/// controller, with every acknowledged write intact. Needs root (a loop device's filesystem).
#[test]
fn a_directory_pool_that_fills_refuses_writes_over_nvme_and_resumes() {
    use initiator::nvme::{NvmeError, NvmeHost};
    const NQN: &str = "nqn.2026-11.org.ferrosan:volumes";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:5d0c1b2a-3e4f-4a5b-8c6d-7e8f90a1b2c3";
    let fs = LoopFs::new("ext4", 48 << 20);
    let pool = fs.path("pool");
    std::fs::create_dir_all(&pool).unwrap();
    // Room to give back later: 8 MiB of the filesystem's ~40.
    let ballast = fs.path("ballast");
    std::fs::write(&ballast, vec![0x42u8; 8 << 20]).unwrap();
    let (port, nvme_port) = (common::free_port(), common::free_port());
    let text = format!(
        "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{port}\"]\n\
         nvme_listen = [\"127.0.0.1:{nvme_port}\"]\n\n[[pool]]\nname = \"p\"\npath = \"{}\"\n\n\
         [[target]]\niqn = \"{IQN}\"\nnqn = \"{NQN}\"\n  [[target.group]]\n  name = \"h\"\n  \
         initiators = [\"{HOST}\"]\n  luns = []\n",
        pool.display()
    );
    let ctl = Ctl::new();
    let socket = ctl.socket.display().to_string();
    let _daemon = Daemon::start_config_text(IQN, port, &text, &["--control-socket", &socket]);
    ok(&ctl, &["volume", "create", "p", "v1", "64M"]);
    ok(&ctl, &["volume", "export", "v1", "--initiator", HOST]);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{nvme_port}").parse().unwrap();
    let mut h = NvmeHost::connect(addr, NQN, HOST, 8).expect("connect");
    const CHUNK: usize = 1 << 20;
    let mut written = Vec::new();
    let refused = loop {
        assert!(
            written.len() < 64,
            "64 MiB written into a 40 MiB filesystem"
        );
        let data = common::pseudo_random_bytes(CHUNK, written.len() as u64);
        let lba = (written.len() * CHUNK / 512) as u64;
        match h.write(1, lba, data.clone(), 512) {
            Ok(()) => written.push(data),
            Err(NvmeError::Status(status)) => break status,
            Err(e) => panic!("write {}: {e}", written.len()),
        }
    };
    assert_eq!(refused, nvme::sqe::Status::CAPACITY_EXCEEDED, "{refused:?}");
    assert!(
        written.len() >= 20,
        "only {} MiB before the pool was full",
        written.len()
    );
    let first = h
        .read(1, 0, (CHUNK / 512) as u32, 512)
        .expect("a read of a full pool");
    assert!(first == written[0], "the first write reads back");
    std::fs::remove_file(&ballast).unwrap();
    let lba = (written.len() * CHUNK / 512) as u64;
    let data = common::pseudo_random_bytes(CHUNK, 999);
    h.write(1, lba, data.clone(), 512)
        .expect("a write once room was made");
    assert!(h.read(1, lba, (CHUNK / 512) as u32, 512).unwrap() == data);
    for (i, want) in written.iter().enumerate() {
        let got = h
            .read(1, (i * CHUNK / 512) as u64, (CHUNK / 512) as u32, 512)
            .unwrap();
        assert!(got == *want, "MiB {i} acknowledged before the pool filled");
    }
    eprintln!(
        "pool full after {} MiB: {refused:?}; writes resumed once room was made",
        written.len()
    );
}
