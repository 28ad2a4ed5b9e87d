//! One LU reached over two paths, as a multipath host sees an array, on each kind of device the
//! client-behaviour suites (`windows_cluster`, `vmware`, `alua`) must pass on:
//! - `Ram` and `Disk` (a thin file on the build's disk): one daemon, two portal groups — group 1
//!   active/optimized, group 2 active/non-optimized (implicit ALUA);
//! - `Rbd`: two gateways `a` and `b` on a throwaway single-node Ceph cluster, each serving one
//!   portal group of the same target; `a` owns the image (explicit ALUA), `b` ships to it.
//!
//! Each portal group serves the target over NVMe/TCP too (its `nqn`, NSID 1 the same LU), so a
//! suite may reach the LU through either door, or both at once.
#![allow(dead_code)]

use std::time::Duration;

use initiator::driver::Client;
use initiator::scsi::{Cdb, Sense};
use initiator::session::Transfer;
use initiator::{ClientConfig, SessionConfig, SessionKind};

use super::ceph::TestCluster;
use super::{disk_dir, free_port, Daemon, Scratch};

/// The kind of device behind the LU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    Ram,
    Disk,
    Rbd,
}

/// Size of the LU (RAM and file; the RBD image is created with it too).
pub const LU_BYTES: u64 = 64 << 20;

/// A status and the sense key, ASC and ASCQ of a CHECK CONDITION.
pub type Answer = (u8, Option<(u8, u8, u8)>);

pub const GOOD: Answer = (0, None);
pub const RESERVATION_CONFLICT: u8 = 0x18;

pub struct Array {
    pub backing: Backing,
    pub iqn: String,
    /// The portal of path 0 (target port group 1) and of path 1 (group 2).
    pub ports: [u16; 2],
    /// The subsystem NQN and each group's NVMe/TCP listener.
    pub nqn: String,
    pub nvme_ports: [u16; 2],
    /// One daemon (RAM, disk) or the gateways `a` and `b` (RBD).
    pub daemons: Vec<Daemon>,
    /// False: every path goes through portal group 1 (one gateway, for RBD).
    spread: std::cell::Cell<bool>,
    // Dropped after the daemons: the file and the cluster outlive them.
    scratch: Scratch,
    dir: Option<std::path::PathBuf>,
    cluster: Option<TestCluster>,
}

impl Array {
    /// Starts the array for test `tag` (a short, unique word).
    pub fn start(backing: Backing, tag: &str) -> Array {
        let iqn = format!("iqn.2026-11.org.ferrosan:{tag}");
        let nqn = format!("nqn.2026-11.org.ferrosan:{tag}");
        let ports = [free_port(), free_port()];
        let nvme_ports = [free_port(), free_port()];
        let scratch = Scratch::new(tag);
        let mut array = Array {
            backing,
            iqn,
            ports,
            nqn,
            nvme_ports,
            daemons: Vec::new(),
            spread: std::cell::Cell::new(true),
            scratch,
            dir: None,
            cluster: None,
        };
        match backing {
            Backing::Ram => array.start_local(r#"store = "ram""#.into()),
            Backing::Disk => {
                let dir = disk_dir(tag);
                let device = format!(
                    "store = \"file\"\npath = \"{}\"\nthin = true",
                    dir.join("lu.img").display()
                );
                array.dir = Some(dir);
                array.start_local(device);
            }
            Backing::Rbd => array.start_gateways(tag),
        }
        array
    }

    fn start_local(&mut self, device: String) {
        let [a, b] = self.ports;
        let [na, nb] = self.nvme_ports;
        let size = format!("size = \"{}M\"", LU_BYTES >> 20);
        let text = format!(
            r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:{a}"]
nvme_listen = ["127.0.0.1:{na}"]
nvme_discovery_listen = []

[[portal_group]]
tag = 2
listen = ["127.0.0.1:{b}"]
nvme_listen = ["127.0.0.1:{nb}"]
nvme_discovery_listen = []
alua_state = "active-non-optimized"

[[device]]
name = "lu"
{device}
{size}
{target}"#,
            target = target_text(&self.iqn, &self.nqn)
        );
        let socket = self.scratch.file("ctl.sock").display().to_string();
        self.daemons.push(Daemon::start_config_text(
            &self.iqn,
            a,
            &text,
            &["--control-socket", &socket],
        ));
    }

    fn start_gateways(&mut self, tag: &str) {
        let cluster = TestCluster::start(tag, 3, "");
        let image = format!("rbd/{tag}");
        cluster.rbd(&["create", "--size", &format!("{}M", LU_BYTES >> 20), &image]);
        let [a, b] = self.ports;
        let [na, nb] = self.nvme_ports;
        let text = format!(
            r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:{a}"]
nvme_listen = ["127.0.0.1:{na}"]
nvme_discovery_listen = []
gateway = "a"

[[portal_group]]
tag = 2
listen = ["127.0.0.1:{b}"]
nvme_listen = ["127.0.0.1:{nb}"]
nvme_discovery_listen = []
gateway = "b"

[[device]]
name = "lu"
store = "rbd"
image = "{image}"
ceph_conf = "{conf}"
{target}"#,
            conf = cluster.conf_str(),
            target = target_text(&self.iqn, &self.nqn)
        );
        for (gateway, port) in [("a", a), ("b", b)] {
            let socket = self.scratch.file(&format!("{gateway}.sock"));
            let socket = socket.display().to_string();
            let args = ["--gateway", gateway, "--control-socket", &socket];
            self.daemons
                .push(Daemon::start_config_text(&self.iqn, port, &text, &args));
        }
        self.cluster = Some(cluster);
        // Gateway a takes the image at start; b learns it within its vigil's second.
        let mut probe = self.path(1, "iqn.2026-11.org.ferrosan:probe");
        wait_until(
            "gateway b sees a as the owner",
            Duration::from_secs(30),
            || {
                let (status, _, data) = probe.run(&rtpg_cdb(), read_len(1024));
                status == 0 && parse_rtpg(&data) == [(1, 0), (2, 1)]
            },
        );
    }

    /// A session of `initiator` through path `path` (0: group 1, 1: group 2), to LUN 0,
    /// with a random ISID: a new I_T nexus. Nothing is retried.
    pub fn path(&self, path: usize, initiator: &str) -> Path {
        self.path_with_isid(path, initiator, initiator::driver::random_isid())
    }

    /// Like [`Array::path`] with a given ISID (the same ISID and initiator name through the
    /// same portal is the same I_T nexus: a reconnect).
    pub fn path_with_isid(&self, path: usize, initiator: &str, isid: [u8; 6]) -> Path {
        Path::connect(self.ports[self.portal_of(path)], &self.iqn, initiator, isid).unwrap_or_else(
            |e| {
                panic!(
                    "{initiator} logs in through path {path}: {e}\n{}",
                    self.output()
                )
            },
        )
    }

    /// A controller of NVMe host `hostnqn` through path `path`'s portal group, with one I/O
    /// queue of `depth` entries (its host identifier follows from the NQN: a host's paths are
    /// one host).
    pub fn nvme(&self, path: usize, hostnqn: &str, depth: u16) -> initiator::nvme::NvmeHost {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.nvme_port(path)));
        initiator::nvme::NvmeHost::connect(addr, &self.nqn, hostnqn, depth).unwrap_or_else(|e| {
            panic!(
                "{hostnqn} connects through path {path}: {e:?}\n{}",
                self.output()
            )
        })
    }

    /// `ferrosan ctl` on daemon `i` (the only one, or gateway `a` and `b`).
    pub fn ctl(&self, i: usize) -> super::Ctl {
        let name = match self.backing {
            Backing::Rbd => ["a.sock", "b.sock"][i],
            _ => "ctl.sock",
        };
        super::Ctl::at(self.scratch.file(name))
    }

    /// The RBD image's cluster (RBD only).
    pub fn cluster(&self) -> Option<&TestCluster> {
        self.cluster.as_ref()
    }

    /// The NVMe/TCP listener path `path` goes through.
    pub fn nvme_port(&self, path: usize) -> u16 {
        self.nvme_ports[self.portal_of(path)]
    }

    /// Whether paths 0 and 1 go through portal groups 1 and 2 (true, the default), or both
    /// through group 1: one gateway for RBD, two sessions through one portal otherwise.
    pub fn spread_paths(&self, spread: bool) {
        self.spread.set(spread);
    }

    /// The portal (0: group 1, 1: group 2) path `path` goes through.
    pub fn portal_of(&self, path: usize) -> usize {
        if self.spread.get() {
            path
        } else {
            0
        }
    }

    /// Every daemon's log, for a failure message.
    pub fn output(&self) -> String {
        self.daemons
            .iter()
            .map(Daemon::output)
            .collect::<Vec<_>>()
            .join("\n----\n")
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        self.daemons.clear();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn target_text(iqn: &str, nqn: &str) -> String {
    format!(
        r#"
[[target]]
iqn = "{iqn}"
nqn = "{nqn}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "lu" }} ]
"#
    )
}

/// One I_T nexus: a logged-in session to LUN 0.
pub struct Path {
    pub client: Client,
    pub isid: [u8; 6],
}

impl Path {
    /// A session of `initiator` with `isid` to LUN 0 of `target` on the loopback `port`.
    /// Nothing is retried.
    pub fn connect(
        port: u16,
        target: &str,
        initiator: &str,
        isid: [u8; 6],
    ) -> Result<Path, initiator::Error> {
        let mut s = SessionConfig::new(
            initiator,
            SessionKind::Normal {
                target_name: target.into(),
            },
        );
        s.command_timeout = Duration::from_secs(60);
        let mut c = ClientConfig::new(format!("127.0.0.1:{port}"), s);
        c.session.isid = isid;
        c.retries = 0;
        c.retry_unit_attention = false;
        c.timeouts.login = Duration::from_secs(10);
        Ok(Path {
            client: Client::connect(c)?,
            isid,
        })
    }

    /// Sends `cdb` with `transfer`: the status, sense and Data-In.
    pub fn run(&mut self, cdb: &[u8], transfer: Transfer) -> (u8, Option<(u8, u8, u8)>, Vec<u8>) {
        let r = self
            .client
            .command(Cdb::new(cdb).expect("cdb"), transfer)
            .unwrap_or_else(|e| panic!("command {:02x?} reaches the target: {e}", cdb));
        let sense = r.sense.as_ref().map(|s: &Sense| (s.key, s.asc, s.ascq));
        (r.status, sense, r.data)
    }

    /// Status and sense of a command without Data-In.
    pub fn answer(&mut self, cdb: &[u8], transfer: Transfer) -> Answer {
        let (status, sense, _) = self.run(cdb, transfer);
        (status, sense)
    }

    /// Clears pending unit attentions (TEST UNIT READY until one answers without one).
    pub fn settle(&mut self) -> Answer {
        for _ in 0..16 {
            let answer = self.answer(&[0; 6], Transfer::None);
            if answer.0 != 0x02 || answer.1.is_none_or(|s| s.0 != 0x06) {
                return answer;
            }
        }
        panic!("unit attentions without end");
    }

    pub fn write(&mut self, lba: u32, data: &[u8]) -> Answer {
        let blocks = u16::try_from(data.len() / 512).expect("blocks");
        let mut cdb = [0u8; 10];
        cdb[0] = 0x2A;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        self.answer(&cdb, Transfer::Write(data.to_vec()))
    }

    pub fn read(&mut self, lba: u32, blocks: u16) -> (u8, Option<(u8, u8, u8)>, Vec<u8>) {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        self.run(&cdb, read_len(u32::from(blocks) * 512))
    }

    /// REPORT TARGET PORT GROUPS: (group, access state) of each descriptor.
    pub fn rtpg(&mut self) -> Vec<(u16, u8)> {
        let (status, sense, data) = self.run(&rtpg_cdb(), read_len(1024));
        assert_eq!(status, 0, "REPORT TARGET PORT GROUPS: {sense:?}");
        parse_rtpg(&data)
    }
}

/// A Data-In transfer of up to `len` bytes.
pub fn read_len(len: u32) -> Transfer {
    Transfer::Read {
        len,
        buf: Vec::new(),
    }
}

/// REPORT TARGET PORT GROUPS (length-only header), 1 KiB allocation.
pub fn rtpg_cdb() -> [u8; 12] {
    [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 0x04, 0, 0, 0]
}

/// (group, access state) of each descriptor of REPORT TARGET PORT GROUPS' length-only data.
pub fn parse_rtpg(data: &[u8]) -> Vec<(u16, u8)> {
    let len = u32::from_be_bytes(data[..4].try_into().expect("length")) as usize;
    let mut out = Vec::new();
    let mut at = 4;
    while at + 8 <= (4 + len).min(data.len()) {
        let ports = usize::from(data[at + 7]);
        out.push((
            u16::from_be_bytes([data[at + 2], data[at + 3]]),
            data[at] & 0x0F,
        ));
        at += 8 + 4 * ports;
    }
    out
}

pub fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// PERSISTENT RESERVE OUT service actions and reservation types (SPC-4 6.16).
pub mod pr {
    pub const REGISTER: u8 = 0x00;
    pub const RESERVE: u8 = 0x01;
    pub const RELEASE: u8 = 0x02;
    pub const CLEAR: u8 = 0x03;
    pub const PREEMPT: u8 = 0x04;
    pub const REGISTER_AND_IGNORE: u8 = 0x06;
    pub const WRITE_EXCLUSIVE: u8 = 0x1;
    pub const EXCLUSIVE_ACCESS: u8 = 0x3;
    pub const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 0x5;
    /// REGISTRATIONS PREEMPTED (UNIT ATTENTION 2Ah/05h).
    pub const PREEMPTED: (u8, u8, u8) = (0x06, 0x2A, 0x05);
}

impl Path {
    /// PERSISTENT RESERVE OUT `action` of `kind` with RESERVATION KEY `key` and SERVICE ACTION
    /// RESERVATION KEY `sa_key` (APTPL 0, scope LU).
    pub fn prout(&mut self, action: u8, kind: u8, key: u64, sa_key: u64) -> Answer {
        let cdb = [0x5F, action, kind, 0, 0, 0, 0, 0, 24, 0];
        let mut params = vec![0u8; 24];
        params[..8].copy_from_slice(&key.to_be_bytes());
        params[8..16].copy_from_slice(&sa_key.to_be_bytes());
        self.answer(&cdb, Transfer::Write(params))
    }

    fn prin(&mut self, action: u8) -> Vec<u8> {
        let cdb = [0x5E, action, 0, 0, 0, 0, 0, 0x10, 0, 0];
        let (status, sense, data) = self.run(&cdb, read_len(4096));
        assert_eq!(status, 0, "PERSISTENT RESERVE IN {action}: {sense:?}");
        data
    }

    /// PERSISTENT RESERVE IN, READ KEYS: the registered keys.
    pub fn read_keys(&mut self) -> Vec<u64> {
        let data = self.prin(0x00);
        let len = u32::from_be_bytes(data[4..8].try_into().expect("length")) as usize;
        data[8..(8 + len).min(data.len())]
            .chunks_exact(8)
            .map(|k| u64::from_be_bytes(k.try_into().expect("key")))
            .collect()
    }

    /// PERSISTENT RESERVE IN, READ RESERVATION: the holder's key and the type, if reserved.
    pub fn read_reservation(&mut self) -> Option<(u64, u8)> {
        let data = self.prin(0x01);
        let len = u32::from_be_bytes(data[4..8].try_into().expect("length")) as usize;
        (len >= 16).then(|| {
            (
                u64::from_be_bytes(data[8..16].try_into().expect("key")),
                data[21] & 0x0F,
            )
        })
    }
}
