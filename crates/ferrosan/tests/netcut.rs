//! Two RBD gateways and their Ceph cluster, each in a network namespace of its own, joined by
//! three switched networks (bridges in a fourth namespace): the cluster network, the hosts'
//! network and the gateways' interconnect (the shipping path). The test itself runs as the
//! hosts, in a fifth namespace. A cut is a switch port taken down: both ends keep their
//! addresses and routes and their packets are dropped, as when a cable or a switch fails.
//!
//! Cut in turn: the owner from the cluster, the interconnect, the owner from its initiators,
//! and the whole cluster for a minute. Each says what the hosts see, how long I/O stalls, who
//! owns the image after, and that every acknowledged write reads back (docs/OPERATIONS.md,
//! *Faults*). Needs root (namespaces), as the rest of the RBD tests do (scripts/test.sh).
//! `NETCUT_LOGS=1` prints both gateways' logs at the end (a failure prints them anyway).

mod common;

use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::ceph::TestCluster;
use common::{pseudo_random_bytes, Ctl, Daemon, Scratch};
use initiator::driver::Client;
use initiator::scsi::Cdb;
use initiator::session::Transfer;

const IQN: &str = "iqn.2024-01.dev.ferrosan:netcut";
const PORT: u16 = 3260;
/// The cluster's, the gateways' and the hosts' addresses on the cluster network (10.89.0.0/24),
/// the hosts' network (10.89.1.0/24) and the interconnect (10.89.3.0/24). They exist only in
/// the test's namespaces.
const CEPH: &str = "10.89.0.1";
const FRONT_A: &str = "10.89.1.2";
const FRONT_B: &str = "10.89.1.3";
const PEER_A: &str = "10.89.3.2";
const PEER_B: &str = "10.89.3.3";

/// The namespaces and the switch; removed (with every link in them) on Drop.
struct Lab {
    prefix: String,
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Lab {
    /// Namespaces `s` (the switch: bridges `cluster`, `front`, `inter`), `c` (Ceph), `a`, `b`
    /// (the gateways) and `h` (the hosts), with a port on a bridge per network each joins.
    fn build() -> Lab {
        let lab = Lab {
            prefix: format!("fsnc{}", std::process::id()),
        };
        for ns in ["s", "c", "a", "b", "h"] {
            ip(&["netns", "add", &lab.ns(ns)]);
            ip(&["-n", &lab.ns(ns), "link", "set", "lo", "up"]);
        }
        for bridge in ["cluster", "front", "inter"] {
            ip(&["-n", &lab.ns("s"), "link", "add", bridge, "type", "bridge"]);
            ip(&["-n", &lab.ns("s"), "link", "set", bridge, "up"]);
        }
        let ports = [
            ("c", "cluster", "10.89.0.1"),
            ("a", "cluster", "10.89.0.2"),
            ("b", "cluster", "10.89.0.3"),
            ("h", "cluster", "10.89.0.9"),
            ("a", "front", FRONT_A),
            ("b", "front", FRONT_B),
            ("h", "front", "10.89.1.9"),
            ("a", "inter", PEER_A),
            ("b", "inter", PEER_B),
        ];
        for (ns, bridge, addr) in ports {
            lab.plug(ns, bridge, addr);
        }
        lab
    }

    fn ns(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// A veth pair: `bridge` in namespace `ns` (address `addr`/24) and its port on the switch,
    /// named `<ns>-<bridge>`.
    fn plug(&self, ns: &str, bridge: &str, addr: &str) {
        let port = Lab::port(ns, bridge);
        let (switch, host) = (self.ns("s"), self.ns(ns));
        let s = switch.as_str();
        ip(&[
            "-n", s, "link", "add", &port, "type", "veth", "peer", bridge, "netns", &host,
        ]);
        ip(&["-n", s, "link", "set", &port, "master", bridge, "up"]);
        ip(&[
            "-n",
            &host,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            bridge,
        ]);
        ip(&["-n", &host, "link", "set", bridge, "up"]);
    }

    fn port(ns: &str, bridge: &str) -> String {
        format!("{ns}-{bridge}")
    }

    /// Takes namespace `ns`'s port on `bridge` down at the switch (`up` false) or back up.
    fn set(&self, ns: &str, bridge: &str, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&[
            "-n",
            &self.ns("s"),
            "link",
            "set",
            &Lab::port(ns, bridge),
            state,
        ]);
    }

    /// Moves the calling thread (and what it starts afterwards) into namespace `ns`.
    fn enter(&self, ns: &str) {
        let file = std::fs::File::open(format!("/run/netns/{}", self.ns(ns))).expect("netns");
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .expect("setns");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in ["h", "a", "b", "c", "s"] {
            let _ = Command::new("ip")
                .args(["netns", "delete", &self.ns(ns)])
                .status();
        }
    }
}

/// One config for gateways `a` and `b`: the image at LUN 0 of an `any_initiator` group and a
/// RAM device of each gateway's own at LUN 1; each listens on the hosts' network and on the
/// interconnect, where the other ships to it (`peer_address`).
fn config(cluster: &TestCluster) -> String {
    format!(
        r#"[[portal_group]]
tag = 1
listen = ["{FRONT_A}:{PORT}", "{PEER_A}:{PORT}"]
peer_address = "{PEER_A}:{PORT}"
gateway = "a"

[[portal_group]]
tag = 2
listen = ["{FRONT_B}:{PORT}", "{PEER_B}:{PORT}"]
peer_address = "{PEER_B}:{PORT}"
gateway = "b"

[[device]]
name = "vm"
store = "rbd"
image = "rbd/netcut"
ceph_conf = "{conf}"
ceph_client = "{user}"

[[device]]
name = "ram"
store = "ram"
size = "16MiB"

[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "vm" }}, {{ lun = 1, device = "ram" }} ]
"#,
        conf = cluster.conf_str(),
        user = cluster.gateway_user()
    )
}

/// The two gateways, their control sockets in `scratch`.
struct Gateways {
    a: Daemon,
    b: Daemon,
    scratch: Scratch,
}

impl Gateways {
    fn start(lab: &Lab, cluster: &TestCluster) -> Gateways {
        let scratch = Scratch::new("netcut");
        let text = config(cluster);
        let start = |gateway: &str, front: &str| {
            let socket = scratch
                .file(&format!("{gateway}.sock"))
                .display()
                .to_string();
            let ns = lab.ns(gateway);
            Daemon::start_config_launched(
                &["ip", "netns", "exec", &ns],
                (front, PORT),
                IQN,
                &text,
                &["--gateway", gateway, "--control-socket", &socket],
            )
        };
        let a = start("a", FRONT_A);
        let b = start("b", FRONT_B);
        Gateways { a, b, scratch }
    }

    /// `ferrosan ctl luns --json` on `gateway`: the image's owner as this gateway sees it
    /// (`None`: standby, no owner known).
    fn owner_seen_by(&self, gateway: &str) -> Option<String> {
        let reply = self.ctl(gateway).json(&["luns"]);
        let lun = find_lun(&reply, "vm").unwrap_or_else(|| panic!("no LUN of vm in {reply}"));
        match (lun["owner_here"].as_bool(), lun["gateway_owner"].as_str()) {
            (Some(true), _) => Some(gateway.to_string()),
            (_, owner) => owner.map(str::to_string),
        }
    }

    /// `ferrosan ctl` on `gateway`'s control socket.
    fn ctl(&self, gateway: &str) -> Ctl {
        Ctl::at(self.scratch.file(&format!("{gateway}.sock")))
    }

    fn daemon(&self, gateway: &str) -> &Daemon {
        if gateway == "a" {
            &self.a
        } else {
            &self.b
        }
    }
}

impl Drop for Gateways {
    /// A failed run shows what each gateway logged.
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (name, daemon) in [("a", &self.a), ("b", &self.b)] {
                eprintln!("---- gateway {name}:\n{}", daemon.output());
            }
        }
    }
}

/// The first object in `v` (searched depth first) with `"device": device`.
fn find_lun<'v>(v: &'v serde_json::Value, device: &str) -> Option<&'v serde_json::Value> {
    match v {
        serde_json::Value::Object(map)
            if map.get("device").and_then(|d| d.as_str()) == Some(device) =>
        {
            Some(v)
        }
        serde_json::Value::Object(map) => map.values().find_map(|x| find_lun(x, device)),
        serde_json::Value::Array(items) => items.iter().find_map(|x| find_lun(x, device)),
        _ => None,
    }
}

/// What each LBA written holds: the last write acknowledged there.
type Acked = std::collections::BTreeMap<u32, Vec<u8>>;

type Answer = Result<(u8, Option<(u8, u8, u8)>, Vec<u8>), String>;

/// A session to `front` at `lun`, its commands timing out after 20 s; `None` when the login
/// fails.
fn session(front: &str, lun: u64, initiator: &str) -> Option<Client> {
    session_timing_out(front, lun, initiator, Duration::from_secs(20))
}

/// Like [`session`], its commands timing out after `timeout`.
fn session_timing_out(front: &str, lun: u64, initiator: &str, timeout: Duration) -> Option<Client> {
    common::iscsi_session(&format!("{front}:{PORT}"), IQN, initiator, lun, timeout).ok()
}

fn command(c: &mut Client, cdb: &[u8], transfer: Transfer) -> Answer {
    let r = c
        .command(Cdb::new(cdb).expect("cdb"), transfer)
        .map_err(|e| e.to_string())?;
    let sense = r.sense.as_ref().map(|s| (s.key, s.asc, s.ascq));
    Ok((r.status, sense, r.data))
}

fn write10(c: &mut Client, lba: u32, data: &[u8]) -> Answer {
    let mut cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&((data.len() / 512) as u16).to_be_bytes());
    command(c, &cdb, Transfer::Write(data.to_vec()))
}

fn read10(c: &mut Client, lba: u32, blocks: u16) -> Answer {
    let mut cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    let len = u32::from(blocks) * 512;
    command(
        c,
        &cdb,
        Transfer::Read {
            len,
            buf: Vec::new(),
        },
    )
}

/// Whether an answer is GOOD (unit attentions, which a new nexus and an ownership change
/// raise, are retried by the caller's loop).
fn good(answer: &Answer) -> bool {
    matches!(answer, Ok((0, _, _)))
}

/// What the hosts' I/O does through `front`: a 4 KiB write of `data` at `lba` on a fresh
/// session, tried again (new session on a transport error) until GOOD or `within` passed.
/// Every answer seen on the way and the time to the GOOD one.
fn write_until_good(
    front: &str,
    lba: u32,
    data: &[u8],
    within: Duration,
) -> (Vec<String>, Option<Duration>) {
    let start = Instant::now();
    let mut seen = Vec::new();
    let mut client: Option<Client> = None;
    while start.elapsed() < within {
        let Some(c) = client.as_mut() else {
            client = session(front, 0, "iqn.2024-01.dev.ferrosan:netcut-host");
            if client.is_none() {
                note(&mut seen, "login failed".into());
                std::thread::sleep(Duration::from_millis(500));
            }
            continue;
        };
        let answer = write10(c, lba, data);
        if good(&answer) {
            return (seen, Some(start.elapsed()));
        }
        note(&mut seen, describe(&answer));
        if answer.is_err() {
            client = None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    (seen, None)
}

/// Records `what` unless it repeats the last record.
fn note(seen: &mut Vec<String>, what: String) {
    if seen.last() != Some(&what) {
        seen.push(what);
    }
}

/// Reads `want.len()` bytes at `lba` through `front` (GOOD within 60 s: unit attentions and
/// transitions retried) and compares with `want`.
fn reads_back(front: &str, lba: u32, want: &[u8], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut client = None;
    loop {
        if client.is_none() {
            client = session(front, 0, "iqn.2024-01.dev.ferrosan:netcut-check");
        }
        let answer = client
            .as_mut()
            .map(|c| read10(c, lba, (want.len() / 512) as u16));
        if let Some(Ok((0, _, data))) = &answer {
            let head = &data[..16.min(data.len())];
            assert!(
                data == want,
                "{what}: read back different data through {front}: {head:x?}"
            );
            return;
        }
        if matches!(answer, Some(Err(_))) {
            client = None;
        }
        let said = answer.as_ref().map(describe);
        assert!(
            Instant::now() < deadline,
            "{what}: no read through {front}: {said:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An answer as a person reads it: GOOD, CHECK CONDITION with its sense in hex, or the
/// transport's error.
fn describe(answer: &Answer) -> String {
    match answer {
        Ok((0, _, _)) => "GOOD".into(),
        Ok((status, Some((key, asc, ascq)), _)) => {
            format!("status {status:#04x} sense {key:x}/{asc:02x}/{ascq:02x}")
        }
        Ok((status, None, _)) => format!("status {status:#04x}"),
        Err(e) => format!("transport: {e}"),
    }
}

/// Until `until`: the RAM LUN (LUN 1) of the gateway at `front`, a block written and read back
/// every 100 ms on one session; the slowest round.
fn ram_lun_meanwhile(front: &str, until: Instant) -> Duration {
    let mut c = session(front, 1, "iqn.2024-01.dev.ferrosan:netcut-ram").expect("RAM LUN login");
    let (mut worst, mut rounds) = (Duration::ZERO, 0u32);
    while Instant::now() < until {
        let block = [rounds as u8; 4096];
        let t = Instant::now();
        // Unit attentions of a new nexus first.
        while !good(&write10(&mut c, rounds % 32, &block)) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the RAM LUN's write failed"
            );
        }
        let read = read10(&mut c, rounds % 32, 8);
        assert!(
            matches!(&read, Ok((0, _, d)) if d[..] == block[..]),
            "RAM LUN read {read:?}"
        );
        worst = worst.max(t.elapsed());
        rounds += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    worst
}

fn wait_for_owner(g: &Gateways, want: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let (a, b) = (g.owner_seen_by("a"), g.owner_seen_by("b"));
        if a.as_deref() == Some(want) && b.as_deref() == Some(want) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "owner {want} not agreed within {within:?}: a sees {a:?}, b sees {b:?}\n\
             a:\n{}\nb:\n{}",
            g.a.output(),
            g.b.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn rbd_gateways_ride_through_cut_networks() {
    let lab = Lab::build();
    lab.enter("h");
    let cluster = TestCluster::start_in_netns("netcut", 3, &lab.ns("c"), (CEPH, "10.89.0.0/24"));
    cluster.rbd(&["create", "--size", "64M", "rbd/netcut"]);
    let g = Gateways::start(&lab, &cluster);
    let take = g.ctl("a").json(&["device", "take", "vm"]);
    assert_eq!(take["ok"], true, "{take}");
    wait_for_owner(&g, "a", Duration::from_secs(30));
    let mut acked = Acked::new();
    let first = pseudo_random_bytes(4096, 1);
    let (_, took) = write_until_good(FRONT_A, 0, &first, Duration::from_secs(30));
    assert!(took.is_some(), "the first write");
    acked.insert(0, first);

    owner_cut_from_the_cluster(&lab, &g, &mut acked);
    interconnect_cut(&lab, &g, &mut acked);
    owner_cut_from_its_initiators(&lab, &g, &mut acked);
    cluster_away_for_a_minute(&lab, &g, &mut acked);
    if std::env::var_os("NETCUT_LOGS").is_some() {
        eprintln!("---- a:\n{}\n---- b:\n{}", g.a.output(), g.b.output());
    }
    for (lba, data) in &acked {
        reads_back(FRONT_A, *lba, data, &format!("acknowledged write at {lba}"));
        reads_back(FRONT_B, *lba, data, &format!("acknowledged write at {lba}"));
    }
    for gateway in ["a", "b"] {
        assert!(
            !g.daemon(gateway).output().contains("panicked"),
            "gateway {gateway} panicked:\n{}",
            g.daemon(gateway).output()
        );
    }
}

/// Owner A loses the cluster network. B takes the image over once A's heartbeat has been
/// silent for the grace (4 s); the hosts' writes through B succeed from then on, and A, cut
/// off and fenced, answers none of its writes GOOD. Mended, A follows: it ships to B.
fn owner_cut_from_the_cluster(lab: &Lab, g: &Gateways, acked: &mut Acked) {
    lab.set("a", "cluster", false);
    let cut = Instant::now();
    let stale = pseudo_random_bytes(4096, 99);
    let through_a = {
        let stale = stale.clone();
        std::thread::spawn(move || write_until_good(FRONT_A, 64, &stale, Duration::from_secs(20)))
    };
    let data = pseudo_random_bytes(4096, 2);
    let (seen_b, took_b) = write_until_good(FRONT_B, 8, &data, Duration::from_secs(60));
    let took_b = took_b.unwrap_or_else(|| panic!("no write through B after A was cut: {seen_b:?}"));
    wait_for_owner_b(g);
    acked.insert(8, data);
    let (seen_a, good_a) = through_a.join().expect("writer through A");
    assert!(
        good_a.is_none(),
        "a write through A, cut from the cluster, was answered GOOD after {good_a:?}: {seen_a:?}"
    );
    lab.set("a", "cluster", true);
    let mended = Instant::now();
    // A was fenced: the write it was sent, held in its sockets while it was cut off and sent
    // when the link came back, is refused by the OSD. The block stays as it was (zeros).
    acked.insert(64, vec![0; 4096]);
    let data = pseudo_random_bytes(4096, 3);
    let (seen, took) = write_until_good(FRONT_A, 16, &data, Duration::from_secs(60));
    let took = took.unwrap_or_else(|| panic!("A does not ship after the mend: {seen:?}"));
    acked.insert(16, data);
    eprintln!(
        "owner cut from the cluster: B took the image over, a write through B GOOD \
         {took_b:?} after the cut (seen before: {seen_b:?}); through A no write GOOD in 20 s ({seen_a:?}); \
         mended, A ships to B after {took:?} ({seen:?}); {:?} in all",
        mended.duration_since(cut)
    );
}

/// B owns the image as B sees it (A, cut off, cannot look).
fn wait_for_owner_b(g: &Gateways) {
    let start = Instant::now();
    while g.owner_seen_by("b").as_deref() != Some("b") {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "B never took the image"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The interconnect cut: A (a non-owner now) cannot ship to B by its `peer_address`. What
/// the hosts see through A, and that B, their direct path, is not held up meanwhile.
fn interconnect_cut(lab: &Lab, g: &Gateways, acked: &mut Acked) {
    wait_for_owner(g, "b", Duration::from_secs(60));
    lab.set("a", "inter", false);
    let data = pseudo_random_bytes(4096, 4);
    let through_a = {
        let data = data.clone();
        std::thread::spawn(move || write_until_good(FRONT_A, 24, &data, Duration::from_secs(90)))
    };
    // Held up means the cut's timeouts (20-30 s); 5 s leaves a busy machine its slow writes.
    let worst_b = ram_or_image_meanwhile(FRONT_B, 32, Instant::now() + Duration::from_secs(10));
    let (seen_a, took_a) = through_a.join().expect("writer through A");
    lab.set("a", "inter", true);
    let owner = wait_for_owner(g, "b", Duration::from_secs(30));
    if took_a.is_some() {
        acked.insert(24, data);
    }
    assert!(
        worst_b < Duration::from_secs(5),
        "B's own path held up {worst_b:?}"
    );
    eprintln!(
        "interconnect cut: through A {} ({seen_a:?}); B's writes at worst {worst_b:?}; B still \
         owns ({owner:?} to agree after the mend)",
        took_a.map_or("no write GOOD in 90 s".to_string(), |t| format!(
            "GOOD after {t:?}"
        ))
    );
}

/// Until `until`, 4 KiB writes to the image at `lba` through `front` on one session, each
/// GOOD; the slowest.
fn ram_or_image_meanwhile(front: &str, lba: u32, until: Instant) -> Duration {
    let mut c = session(front, 0, "iqn.2024-01.dev.ferrosan:netcut-direct").expect("login");
    let mut worst = Duration::ZERO;
    let mut round = 0u8;
    while Instant::now() < until {
        let t = Instant::now();
        while !good(&write10(&mut c, lba, &[round; 4096])) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "a write through {front} failed"
            );
        }
        worst = worst.max(t.elapsed());
        round = round.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(100));
    }
    worst
}

/// Owner B cut from the hosts' network: B keeps the image (its heartbeat goes on through the
/// cluster network, docs/RBD.md says why), and the hosts' writes through A, shipped to B over
/// the interconnect, are not held up.
fn owner_cut_from_its_initiators(lab: &Lab, g: &Gateways, acked: &mut Acked) {
    lab.set("b", "front", false);
    let cut = Instant::now();
    let worst = ram_or_image_meanwhile(FRONT_A, 40, cut + Duration::from_secs(10));
    let owner = g.owner_seen_by("a");
    lab.set("b", "front", true);
    let data = pseudo_random_bytes(4096, 5);
    let (seen, took) = write_until_good(FRONT_B, 48, &data, Duration::from_secs(30));
    assert!(took.is_some(), "B's path after the mend: {seen:?}");
    acked.insert(48, data);
    assert_eq!(
        owner.as_deref(),
        Some("b"),
        "the owner while cut from its hosts"
    );
    assert!(
        worst < Duration::from_secs(5),
        "writes through A held up {worst:?}"
    );
    eprintln!(
        "owner cut from its initiators: writes through A at worst {worst:?}, B kept the image"
    );
}

/// The cluster network's Ceph end down for a minute: the image's commands fail in bounded
/// time on both gateways, the RAM LUNs beside it answer throughout, and once the cluster is
/// back I/O resumes without a restart.
fn cluster_away_for_a_minute(lab: &Lab, g: &Gateways, acked: &mut Acked) {
    const AWAY: Duration = Duration::from_secs(60);
    // Longer than the cluster client's 30 s operation timeout: the answer is the gateway's.
    let timeout = Duration::from_secs(45);
    let initiator = "iqn.2024-01.dev.ferrosan:netcut-away";
    let mut c = session_timing_out(FRONT_B, 0, initiator, timeout).expect("login");
    while !good(&write10(&mut c, 56, &[0x56; 4096])) {}
    acked.insert(56, vec![0x56; 4096]);
    lab.set("c", "cluster", false);
    let cut = Instant::now();
    let ram = [FRONT_A, FRONT_B]
        .map(|front| std::thread::spawn(move || ram_lun_meanwhile(front, cut + AWAY)));
    let answer = write10(&mut c, 0, &[0x77; 4096]);
    let failed_after = cut.elapsed();
    assert!(
        !good(&answer),
        "a write answered GOOD with the cluster away"
    );
    assert!(
        failed_after < Duration::from_secs(40),
        "the write was answered after {failed_after:?}"
    );
    let worst = ram.map(|t| t.join().expect("RAM LUN session"));
    std::thread::sleep(AWAY.saturating_sub(cut.elapsed()));
    lab.set("c", "cluster", true);
    let data = pseudo_random_bytes(4096, 6);
    // The write that failed may still land (it was on its way to the OSD, in the gateway's
    // socket, when the link went down: SCSI leaves a failed write's blocks undefined), but
    // never after a later acknowledged write to the same blocks.
    let (seen, took) = write_until_good(FRONT_A, 0, &data, Duration::from_secs(120));
    let took = took.unwrap_or_else(|| {
        panic!(
            "no write after the cluster returned: {seen:?}\na:\n{}\nb:\n{}",
            g.a.output(),
            g.b.output()
        )
    });
    acked.insert(0, data);
    let owner = [g.owner_seen_by("a"), g.owner_seen_by("b")];
    for w in worst {
        assert!(
            w < Duration::from_secs(4),
            "a RAM LUN answered in {w:?} at worst"
        );
    }
    eprintln!(
        "cluster away {AWAY:?}: the image's write answered {} after {failed_after:?}; \
         RAM LUNs at worst {worst:?}; writes GOOD {took:?} after the cluster returned ({seen:?}); \
         owner as seen by a, b: {owner:?}",
        describe(&answer)
    );
}
