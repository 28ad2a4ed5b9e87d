//! RBD LUNs against a real single-node Ceph cluster the test starts (scripts/ceph-single-node.sh):
//! data written through the gateway is what librbd reads (`rbd export`) and the other way
//! round, a missing image is a located error, a lost cluster fails commands with a standard
//! sense in bounded time and I/O resumes when it returns; two gateways export one image with
//! explicit ALUA, and a takeover fences the old owner (blocklist) so none of its writes lands
//! afterwards, also when the old owner was SIGKILLed.

mod common;

use std::time::{Duration, Instant};

use common::ceph::TestCluster;
use common::{free_port, metric, pseudo_random_bytes, scrape, Daemon, Scratch};
use initiator::driver::Client;
use initiator::scsi::{Cdb, Sense};
use initiator::session::Transfer;
use initiator::{ClientConfig, SessionConfig, SessionKind};

const INITIATOR: &str = "iqn.2024-01.dev.ferrosan:rbd-test";
const NOT_READY: u8 = 0x02;

fn client(port: u16, target: &str) -> Client {
    client_named(port, target, INITIATOR)
}

fn client_named(port: u16, target: &str, initiator: &str) -> Client {
    connect(port, target, initiator, Duration::from_secs(90)).expect("login")
}

/// A session of `initiator` to `target` on the loopback `port`, whose commands time out after
/// `command_timeout`.
fn connect(
    port: u16,
    target: &str,
    initiator: &str,
    command_timeout: Duration,
) -> Result<Client, initiator::Error> {
    let addr = format!("127.0.0.1:{port}");
    common::iscsi_session(&addr, target, initiator, 0, command_timeout)
}

/// Sends `cdb` with `transfer`; the status and sense (key, asc, ascq) and the data.
fn command(c: &mut Client, cdb: &[u8], transfer: Transfer) -> (u8, Option<(u8, u8, u8)>, Vec<u8>) {
    let r = c
        .command(Cdb::new(cdb).expect("cdb"), transfer)
        .expect("command reaches the target");
    let sense = r.sense.as_ref().map(|s: &Sense| (s.key, s.asc, s.ascq));
    (r.status, sense, r.data)
}

fn write10(c: &mut Client, lba: u32, data: &[u8]) -> (u8, Option<(u8, u8, u8)>) {
    let blocks = (data.len() / 512) as u16;
    let mut cdb = [0u8; 10];
    cdb[0] = 0x2A;
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    let (status, sense, _) = command(c, &cdb, Transfer::Write(data.to_vec()));
    (status, sense)
}

fn read10(c: &mut Client, lba: u32, blocks: u16) -> (u8, Option<(u8, u8, u8)>, Vec<u8>) {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x28;
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    command(
        c,
        &cdb,
        Transfer::Read {
            len: u32::from(blocks) * 512,
            buf: Vec::new(),
        },
    )
}

/// TEST UNIT READY until no unit attention is pending; its final status and sense.
fn settle(c: &mut Client) -> (u8, Option<(u8, u8, u8)>) {
    for _ in 0..16 {
        let (status, sense, _) = command(c, &[0; 6], Transfer::None);
        if sense.is_some_and(|(key, _, _)| key == 0x06) {
            continue;
        }
        return (status, sense);
    }
    panic!("unit attentions never cleared");
}

/// REPORT TARGET PORT GROUPS: (group, asymmetric access state) per descriptor.
fn rtpg(c: &mut Client) -> Vec<(u16, u8)> {
    let cdb = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0];
    let mut answer = || {
        command(
            c,
            &cdb,
            Transfer::Read {
                len: 1024,
                buf: Vec::new(),
            },
        )
    };
    let mut reply = answer();
    // Unit attentions first (a new nexus, ASYMMETRIC ACCESS STATE CHANGED).
    for _ in 0..8 {
        if reply.1.is_none_or(|(key, _, _)| key != 0x06) {
            break;
        }
        reply = answer();
    }
    let (status, sense, data) = reply;
    assert_eq!(status, 0, "RTPG: {sense:?}");
    let mut groups = Vec::new();
    let mut at = 4;
    while at + 8 <= data.len() {
        let ports = usize::from(data[at + 7]);
        groups.push((
            u16::from_be_bytes([data[at + 2], data[at + 3]]),
            data[at] & 0x0F,
        ));
        at += 8 + 4 * ports;
    }
    groups
}

/// SET TARGET PORT GROUPS: `group` active/optimized.
fn stpg(c: &mut Client, group: u16) -> (u8, Option<(u8, u8, u8)>) {
    let mut params = vec![0u8; 4];
    params.extend_from_slice(&[0x00, 0, 0, 0]);
    params[6..8].copy_from_slice(&group.to_be_bytes());
    let cdb = [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, params.len() as u8, 0, 0];
    let (status, sense, _) = command(c, &cdb, Transfer::Write(params));
    (status, sense)
}

/// `ferrosan ctl device take vm` on `gateway`: the operator moves the image there (an
/// initiator's SET TARGET PORT GROUPS never takes it from a live owner).
fn take(scratch: &Scratch, gateway: &str) {
    let out = gateway_ctl(scratch, gateway, &["device", "take", "vm"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains(&format!("owned by gateway {gateway}")),
        "ctl device take on {gateway}: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Short client timeouts, so that a lost cluster fails commands within seconds.
const CLIENT_TIMEOUTS: &str = "rados osd op timeout = 8\nrados mon op timeout = 8";

#[test]
fn rbd_lun_data_missing_image_and_lost_cluster() {
    let cluster = TestCluster::start("lun", 3, CLIENT_TIMEOUTS);
    let conf = cluster.conf_str();
    cluster.rbd(&["create", "--size", "64M", "rbd/lun"]);

    // A missing image or pool stops the start with an error naming it.
    for (spec, says) in [
        (format!("rbd:rbd/missing,conf={conf}"), "rbd/missing"),
        (format!("rbd:nopool/x,conf={conf}"), "nopool"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .args(["--lun", &spec])
            .output()
            .expect("run ferrosan");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{spec}: started");
        assert!(
            stderr.contains(says) && stderr.contains("No such file"),
            "{spec}: {stderr}"
        );
    }

    // Through a config file the error is located at the device's table.
    let located = Scratch::new("rbd-missing");
    let config = located.file("missing.toml");
    std::fs::write(
        &config,
        format!(
            "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{}\"]\n[[device]]\nname = \"vm\"\n\
             store = \"rbd\"\nimage = \"rbd/missing\"\nceph_conf = \"{conf}\"\n[[target]]\n\
             iqn = \"iqn.2024-01.dev.ferrosan:missing\"\n  [[target.group]]\n  name = \"g\"\n  \
             any_initiator = true\n  luns = [ {{ lun = 0, device = \"vm\" }} ]\n",
            free_port()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["serve", "--config", &config.display().to_string()])
        .output()
        .expect("run ferrosan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with a missing image");
    assert!(
        stderr.contains("missing.toml:4: device vm: rbd image rbd/missing"),
        "{stderr}"
    );

    // The cluster unreachable at start (its monitor elsewhere): the other LUNs serve, the
    // RBD device is left out with an error that says why.
    let scratch = Scratch::new("rbd");
    let dead_monitor = scratch.file("dead.conf");
    let text = std::fs::read_to_string(&cluster.conf).unwrap();
    let text: String = text
        .lines()
        .map(|l| {
            if l.starts_with("mon host") {
                format!("mon host = [v2:127.0.0.1:{}]\n", free_port())
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(
        &dead_monitor,
        format!("{text}\n[client]\nclient mount timeout = 3\n"),
    )
    .unwrap();
    let left_out_iqn = "iqn.2024-01.dev.ferrosan:left-out";
    let port = free_port();
    let socket = scratch.file("left-out.sock").display().to_string();
    let text = format!(
        r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]

[[device]]
name = "scratch"
store = "ram"
size = "16M"

[[device]]
name = "vm"
store = "rbd"
image = "rbd/lun"
ceph_conf = "{dead}"

[[target]]
iqn = "{left_out_iqn}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "scratch" }}, {{ lun = 1, device = "vm" }} ]
"#,
        dead = dead_monitor.display()
    );
    let daemon =
        Daemon::start_config_text(left_out_iqn, port, &text, &["--control-socket", &socket]);
    assert!(
        daemon.output().contains("cluster unavailable") && daemon.output().contains("rbd/lun"),
        "{}",
        daemon.output()
    );
    let mut c = client(port, left_out_iqn);
    assert_eq!(settle(&mut c), (0, None));
    assert_eq!(read10(&mut c, 0, 1).0, 0);
    assert_eq!(c.report_luns().expect("sent").expect("good"), vec![0]);
    drop(c);
    let ctl = |verb: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
            .args(["ctl", "--socket", &socket, verb])
            .output()
            .expect("ferrosan ctl");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let status = ctl("status");
    assert!(status.contains("LEFT OUT      vm"), "{status}");
    // Saving the running config keeps the device that is left out (and its LUN) in the file.
    ctl("save");
    let file = std::fs::read_to_string(daemon.file("ferrosan.toml")).expect("the config file");
    assert!(
        file.contains("name = \"vm\"") && file.contains("device = \"vm\""),
        "the saved config lost the device left out:\n{file}"
    );
    // The cluster reachable again (its monitor where the config file now says): the device is
    // opened and served without a reload.
    std::fs::copy(&cluster.conf, &dead_monitor).expect("restore the monitor address");
    wait_until("the RBD LUN served again", Duration::from_secs(60), || {
        let mut c = client(port, left_out_iqn);
        settle(&mut c);
        c.report_luns()
            .ok()
            .and_then(Result::ok)
            .is_some_and(|luns| luns == vec![0, 1])
    });
    assert!(
        daemon.output().contains("the cluster can be reached again"),
        "{}",
        daemon.output()
    );
    let status = ctl("status");
    assert!(!status.contains("LEFT OUT"), "{status}");
    drop(daemon);

    let daemon = Daemon::start(&[&format!("rbd:rbd/lun,conf={conf}")]);
    assert!(
        daemon.output().contains("I/O path asynchronous"),
        "{}",
        daemon.output()
    );
    // Through the gateway, then as librbd sees it; and librbd's writes through the gateway.
    let image = scratch.file("pattern.img");
    std::fs::write(&image, pseudo_random_bytes(8 << 20, 20)).unwrap();
    common::upload(&daemon, 0, &image.display().to_string());
    let exported = scratch.file("export.img");
    cluster.rbd(&["export", "rbd/lun", &exported.display().to_string()]);
    let exported = std::fs::read(&exported).unwrap();
    assert_eq!(&exported[..8 << 20], &std::fs::read(&image).unwrap()[..]);
    assert!(exported[8 << 20..].iter().all(|&b| b == 0));
    let other = scratch.file("other.img");
    std::fs::write(&other, pseudo_random_bytes(64 << 20, 21)).unwrap();
    cluster.rbd(&[
        "import",
        "--no-progress",
        &other.display().to_string(),
        "rbd/lun2",
    ]);
    // librbd waits up to 5 s for the image's other watchers (the export above) to acknowledge
    // the lock's release: more than Daemon::stop's patience.
    let mut daemon = daemon;
    daemon.signal("TERM");
    assert!(daemon.wait_exit(Duration::from_secs(30)).is_some());
    drop(daemon);
    // A daemon that stopped gracefully closed the image: its exclusive lock is released, so
    // the next writer (a restarted daemon, another gateway) does not wait for it to expire.
    let locks =
        String::from_utf8(cluster.rbd(&["lock", "ls", "--format", "json", "rbd/lun"])).unwrap();
    assert!(!locks.contains("locker"), "lock left behind: {locks}");
    let daemon = Daemon::start(&[&format!("rbd:rbd/lun2,conf={conf}"), "ram:16M"]);
    common::assert_identical(&daemon, 0, &other.display().to_string());
    cluster_away(&cluster, &daemon);
    drop(daemon);
    // The rest on a cluster of its own. After the freeze this one's placement groups can stay
    // laggy for minutes on a busy machine (an `rbd create` here timed out for a whole minute
    // in one test command run, while the LUN's I/O had resumed): what these check is ferrosan,
    // not how fast a single-node cluster recovers.
    drop(cluster);
    let cluster = TestCluster::start("lun-cache", 3, CLIENT_TIMEOUTS);
    rbd_write_cache(&cluster, &scratch);
    pool_quota(&cluster);
}

/// An image whose pool reaches its quota: once Ceph flags the pool full, a write answers
/// SPACE ALLOCATION FAILED WRITE PROTECT (07h/27h/07h) at once — not after the client's 8 s op
/// timeout, as a write paused in librados would — reads go on, and once the quota is lifted
/// writes resume without a restart, with everything acknowledged before still there.
fn pool_quota(cluster: &TestCluster) {
    cluster.ceph(&["osd", "pool", "create", "quota", "8", "8"]);
    cluster.rbd(&["pool", "init", "quota"]);
    cluster.rbd(&["create", "--size", "64M", "quota/img"]);
    let conf = cluster.conf_str();
    let daemon = Daemon::start(&[&format!("rbd:quota/img,conf={conf}")]);
    let mut c = client(daemon.port, &daemon.iqn);
    assert_eq!(settle(&mut c), (0, None));
    cluster.ceph(&["osd", "pool", "set-quota", "quota", "max_bytes", "4194304"]);
    // 256 KiB at a time, each block new, until Ceph's accounting catches up and flags the
    // pool full (its statistics move every few seconds).
    const CHUNK: u32 = 512;
    let mut written = Vec::new();
    // THIN PROVISIONING SOFT THRESHOLD REACHED: the pool past `space_warning_percent` (90) of
    // what it may hold; the write it came on is sent again, as an initiator does.
    let mut warned = None;
    let (failed, took) = loop {
        let lba = written.len() as u32 * CHUNK;
        assert!(
            lba < 120_000,
            "64 MiB written and the 4 MiB quota never stopped a write"
        );
        let data = pseudo_random_bytes(CHUNK as usize * 512, u64::from(lba));
        let started = Instant::now();
        let (status, sense) = write10(&mut c, lba, &data);
        if sense == Some(SOFT_THRESHOLD) {
            warned.get_or_insert(written.len() * 256);
            continue;
        }
        if status != 0 {
            break (sense, started.elapsed());
        }
        written.push(data);
        std::thread::sleep(Duration::from_millis(100));
    };
    // The watch looks every 5 s at the monitors' statistics, which move every few seconds
    // too: the quota may stop writes before it warns. It warns once either way.
    if warned.is_none() {
        wait_until(
            "the soft threshold's unit attention",
            Duration::from_secs(30),
            || {
                let (_, sense) = settle_once(&mut c);
                sense == Some(SOFT_THRESHOLD)
            },
        );
    }
    eprintln!("soft threshold reported after {warned:?} KiB (None: after the quota)");
    eprintln!(
        "pool at its quota after {} KiB: {failed:?} in {took:?}",
        written.len() * 256
    );
    assert_eq!(failed, Some((0x07, 0x27, 0x07)), "SPACE ALLOCATION FAILED");
    assert!(
        took < Duration::from_secs(4),
        "answered in {took:?}: paused, not refused"
    );
    // Reads go on, and what was acknowledged is there.
    let (status, _, data) = read10(&mut c, 0, CHUNK as u16);
    assert_eq!(status, 0);
    assert!(data == written[0], "the first write reads back");
    // The quota lifted: writes resume (Ceph clears the flag at its next statistics update).
    cluster.ceph(&["osd", "pool", "set-quota", "quota", "max_bytes", "0"]);
    let lba = written.len() as u32 * CHUNK;
    let data = pseudo_random_bytes(CHUNK as usize * 512, 7);
    wait_until("writes resume", Duration::from_secs(60), || {
        write10(&mut c, lba, &data).0 == 0
    });
    let (status, _, back) = read10(&mut c, lba, CHUNK as u16);
    assert!(
        status == 0 && back == data,
        "the write after the quota reads back"
    );
    let last = written.len() as u32 - 1;
    let (_, _, back) = read10(&mut c, last * CHUNK, CHUNK as u16);
    assert!(
        back == written[last as usize],
        "the last write before the quota reads back"
    );
    cluster_full(cluster, &mut c, &written[0]);
}

/// THIN PROVISIONING SOFT THRESHOLD REACHED (06h/38h/07h).
const SOFT_THRESHOLD: (u8, u8, u8) = (0x06, 0x38, 0x07);

/// One TEST UNIT READY: its status and sense.
fn settle_once(c: &mut Client) -> (u8, Option<(u8, u8, u8)>) {
    let (status, sense, _) = command(c, &[0; 6], Transfer::None);
    (status, sense)
}

/// The cluster at its full ratio (set below what its OSD holds): a write to blocks never
/// written answers SPACE ALLOCATION FAILED WRITE PROTECT at once, as for a pool's quota (a
/// write over written blocks takes no new space and succeeds: the OSD refuses only what
/// grows), reads go on, and once the ratio is back writes resume. `first` is LBA 0's data.
fn cluster_full(cluster: &TestCluster, c: &mut Client, first: &[u8]) {
    let ratios = |near: &str, backfill: &str, full: &str| {
        cluster.ceph(&["osd", "set-nearfull-ratio", near]);
        cluster.ceph(&["osd", "set-backfillfull-ratio", backfill]);
        cluster.ceph(&["osd", "set-full-ratio", full]);
    };
    ratios("0.005", "0.008", "0.01");
    let mut flagged = 0;
    wait_until(
        "the monitors flag the pool full",
        Duration::from_secs(60),
        || {
            let dump = cluster.ceph(&["osd", "dump", "--format", "json"]);
            let dump: serde_json::Value = serde_json::from_str(&dump).expect("osd dump");
            flagged = dump["epoch"].as_u64().expect("epoch");
            // The flag itself: "nearfull" and "backfillfull", which the monitors may raise
            // an epoch or more before it, contain the word.
            dump["pools"].as_array().expect("pools").iter().any(|p| {
                p["pool_name"] == "quota"
                    && p["flags_names"]
                        .as_str()
                        .is_some_and(|f| f.split(',').any(|flag| flag == "full"))
            })
        },
    );
    // The OSD refuses only once it has the map that flags the pool: on a loaded machine that
    // map reaches it seconds after the monitors made it.
    wait_until(
        "the OSD has the map that flags the pool full",
        Duration::from_secs(60),
        || {
            let status = cluster.ceph(&["tell", "osd.0", "status"]);
            let status: serde_json::Value = serde_json::from_str(&status).expect("osd status");
            status["newest_map"].as_u64().is_some_and(|e| e >= flagged)
        },
    );
    // Each try on an object never written (4 MiB each, from the image's end down), as the
    // OSD may see the flag a moment after the monitors: a write over blocks written by an
    // earlier try would take no new space and succeed.
    let data = pseudo_random_bytes(4096, 11);
    let mut answer = (0, None, Duration::ZERO);
    let mut object = 16u32;
    wait_until(
        "the full cluster refuses a write",
        Duration::from_secs(30),
        || {
            object -= 1;
            assert!(object >= 8, "every untouched object written, none refused");
            std::thread::sleep(Duration::from_millis(500));
            let started = Instant::now();
            let (status, sense) = write10(c, object << 13, &data);
            answer = (status, sense, started.elapsed());
            status != 0 && sense != Some(SOFT_THRESHOLD)
        },
    );
    let (_, sense, took) = answer;
    // The space watch may have told the host THIN PROVISIONING SOFT THRESHOLD REACHED after
    // that write (it looks every few seconds): the unit attention is taken first.
    settle(c);
    let (status, read_sense, back) = read10(c, 0, (first.len() / 512) as u16);
    ratios("0.85", "0.90", "0.95");
    assert_eq!(sense, Some((0x07, 0x27, 0x07)), "SPACE ALLOCATION FAILED");
    assert!(
        took < Duration::from_secs(4),
        "answered in {took:?}: paused, not refused"
    );
    assert!(
        status == 0 && back == first,
        "a read while the cluster is full: status {status}, sense {read_sense:?}"
    );
    wait_until(
        "writes resume below the full ratio",
        Duration::from_secs(60),
        || {
            let (status, sense) = write10(c, object << 13, &data);
            status == 0 || sense == Some(SOFT_THRESHOLD) && write10(c, object << 13, &data).0 == 0
        },
    );
    let (status, _, back) = read10(c, object << 13, 8);
    assert!(
        status == 0 && back == data,
        "the write after the full ratio reads back"
    );
    eprintln!("cluster at its full ratio: SPACE ALLOCATION FAILED in {took:?}; writes resumed");
}

/// How long the cluster's OSD stays away: past the client's 8 s op timeouts, so every command
/// that needs it fails. Not longer, and not the monitor with it: this single-node cluster,
/// frozen whole, resumes with placement groups laggy past their 16 s read lease, or a monitor
/// that times out the next clients, for minutes (seen with 25 s in 4 of 16 runs, and with the
/// monitor frozen 9 s in 1 of 3); a longer outage needs the cluster cut off, not frozen.
const AWAY: Duration = Duration::from_secs(9);

/// Waits for the cluster's placement groups to leave the laggy state a paused OSD resumes
/// in. One can latch it and park every op until the PG's next interval, which a single OSD
/// that keeps heartbeating never gets: Ceph's own (ceph/ceph#71663, "a PG that latches
/// PG_STATE_LAGGY has nothing scheduled that will ever re-evaluate it";
/// ceph/ceph-container#1682 with pause/unpause). After 15 s the OSD is marked down, which
/// starts one (it marks itself up again), as an operator would; the gateway's own resumption
/// is timed from there.
fn unless_laggy(cluster: &TestCluster) {
    let laggy = || {
        cluster
            .ceph(&["pg", "stat", "--connect-timeout", "10"])
            .contains("laggy")
    };
    let since = Instant::now();
    while laggy() {
        if since.elapsed() > Duration::from_secs(15) {
            eprintln!(
                "a placement group stayed laggy {:?} after the OSD resumed: osd.0 marked down \
                 to start its next interval (Ceph's wedge, not the gateway's)",
                since.elapsed()
            );
            cluster.ceph(&["osd", "down", "0"]);
            return;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The cluster gone (its only OSD stopped) for [`AWAY`]: the RBD LUN's write
/// and a read on another session fail with NOT READY within the client's timeout instead of
/// hanging; the RAM LUN beside it (LUN 1, a third session, logged in meanwhile) answers every
/// command at once; once the cluster is back, I/O resumes and the write acknowledged before it
/// left reads back.
fn cluster_away(cluster: &TestCluster, daemon: &Daemon) {
    let mut c = client(daemon.port, &daemon.iqn);
    assert_eq!(settle(&mut c), (0, None));
    let acked = write10(&mut c, 8, &[5u8; 4096]);
    assert_eq!(acked, (0, None), "acknowledged before");
    let mut reader = client_named(daemon.port, &daemon.iqn, "iqn.2024-01.dev.ferrosan:reader");
    assert_eq!(settle(&mut reader), (0, None));
    let daemons = [cluster.pid("osd.0")];
    let signal = |sig: &str| {
        for pid in daemons {
            let ok = std::process::Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} {pid}");
        }
    };
    signal("-STOP");
    daemons.into_iter().for_each(common::wait_stopped);
    let gone = Instant::now();
    let beside = std::thread::spawn({
        let (port, iqn) = (daemon.port, daemon.iqn.clone());
        move || ram_lun_meanwhile(port, &iqn, gone + Duration::from_secs(8))
    });
    let read = std::thread::spawn(move || {
        let (status, sense, _) = read10(&mut reader, 8, 8);
        (status, sense, gone.elapsed())
    });
    let (status, sense) = write10(&mut c, 0, &[7u8; 4096]);
    let took = gone.elapsed();
    let (read_status, read_sense, read_took) = read.join().expect("the reading session");
    let worst = beside.join().expect("the RAM LUN's session");
    std::thread::sleep(AWAY.saturating_sub(gone.elapsed()));
    signal("-CONT");
    let back = Instant::now();
    assert_eq!(
        (status, sense),
        (0x02, Some((NOT_READY, 0x04, 0x0A))),
        "write"
    );
    let bound = Duration::from_secs(20);
    assert!(took < bound, "the write failed only after {took:?}");
    let read = (read_status, read_sense);
    assert_eq!(read, (0x02, Some((NOT_READY, 0x04, 0x0A))), "read");
    assert!(
        read_took < bound,
        "the read failed only after {read_took:?}"
    );
    // Not held behind the RBD LUN's commands, which wait for the 8 s op timeout.
    let held = Duration::from_secs(4);
    assert!(worst < held, "the RAM LUN answered in {worst:?} at worst");
    // A failure says whether the cluster itself served again (its placement groups can stay
    // laggy for minutes after a freeze on a busy machine: see AWAY) and what the daemon saw.
    unless_laggy(cluster);
    let deadline = Instant::now() + Duration::from_secs(60);
    while write10(&mut c, 0, &[8u8; 4096]).0 != 0 {
        // A placement group can turn laggy only once its read lease runs out after the
        // resume, past the first look: looked at again after each failed write.
        unless_laggy(cluster);
        if Instant::now() > deadline {
            let said = daemon.output();
            let tail: Vec<&str> = said.lines().rev().take(20).collect();
            panic!(
                "I/O did not resume within 60 s of the cluster serving again\ncluster: {}\ndaemon, last lines:\n{}",
                cluster.ceph(&["-s", "--connect-timeout", "10"]),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "cluster away {AWAY:?}: write NOT READY after {took:?}, read after {read_took:?}, \
         RAM LUN at worst {worst:?}, I/O resumed {:?} after the cluster returned",
        back.elapsed()
    );
    let (status, _, data) = read10(&mut c, 0, 8);
    assert_eq!((status, data), (0, vec![8u8; 4096]));
    let (status, _, data) = read10(&mut c, 8, 8);
    assert_eq!(
        (status, data),
        (0, vec![5u8; 4096]),
        "the acknowledged write"
    );
}

/// Until `until`: a new session to the RAM LUN (LUN 1) writes and reads a block over and over;
/// the slowest answer (each must be GOOD and read what was written).
fn ram_lun_meanwhile(port: u16, iqn: &str, until: Instant) -> Duration {
    let addr = format!("127.0.0.1:{port}");
    let initiator = "iqn.2024-01.dev.ferrosan:rbd-test-beside";
    let mut c = common::iscsi_session(&addr, iqn, initiator, 1, Duration::from_secs(90))
        .expect("a login while the cluster is away");
    assert_eq!(settle(&mut c), (0, None));
    let (mut worst, mut rounds) = (Duration::ZERO, 0u32);
    while Instant::now() < until {
        let block = [rounds as u8; 4096];
        let t = Instant::now();
        assert_eq!(write10(&mut c, rounds % 64, &block), (0, None));
        let (status, _, data) = read10(&mut c, rounds % 64, 8);
        assert_eq!((status, data), (0, block.to_vec()));
        worst = worst.max(t.elapsed());
        rounds += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(rounds >= 3, "only {rounds} rounds on the RAM LUN");
    worst
}

const SYNCHRONIZE_CACHE_10: [u8; 10] = [0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0];

/// An RBD LUN with its write cache on (`,write_cache`, WCE=1): what qemu-img wrote through it
/// is the image's once flushed, reads overlapping writes answered early see them, and a write
/// answered before it reached the cluster that then failed (the OSD stopped past the client's
/// timeout) fails the next SYNCHRONIZE CACHE as a write error, once, not as "retry".
fn rbd_write_cache(cluster: &TestCluster, scratch: &Scratch) {
    let conf = cluster.conf_str();
    cluster.rbd(&["create", "--size", "64M", "rbd/cached"]);
    let metrics_port = free_port();
    let socket = scratch.file("cached.sock").display().to_string();
    let daemon = Daemon::start_with_args(
        common::IQN,
        &[&format!("rbd:rbd/cached,conf={conf},write_cache")],
        &[
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
            "--control-socket",
            &socket,
        ],
    );
    // The control socket's `stats` (what `ferrosan top` polls), spoken directly.
    let stats = || {
        use std::io::{BufRead, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&socket).expect("control socket");
        s.write_all(b"{\"verb\":\"stats\"}\n").unwrap();
        let mut line = String::new();
        std::io::BufReader::new(s).read_line(&mut line).unwrap();
        line.replace([' ', '\n'], "")
    };
    let queued_writes = "ferrosan_device_write_back_writes{device=\"lun0\"}";
    let queued_bytes = "ferrosan_device_write_back_bytes{device=\"lun0\"}";
    let text = scrape(metrics_port);
    assert!(text.contains(queued_writes), "{text}");
    assert_eq!(metric(&text, queued_bytes), 0.0);
    let image = scratch.file("cached.img");
    std::fs::write(&image, pseudo_random_bytes(16 << 20, 22)).unwrap();
    common::upload(&daemon, 0, &image.display().to_string());
    common::assert_identical(&daemon, 0, &image.display().to_string());
    let mut c = client(daemon.port, &daemon.iqn);
    assert_eq!(settle(&mut c), (0, None));
    // Back to back, each read right after the write under it was answered.
    for round in 0..64u32 {
        let data = pseudo_random_bytes(4096, 100 + u64::from(round));
        let lba = (round % 8) * 8;
        assert_eq!(write10(&mut c, lba, &data), (0, None));
        let (status, sense, read) = read10(&mut c, lba, 8);
        assert_eq!((status, sense), (0, None));
        assert!(read == data, "round {round}: read back other data");
    }
    let (status, sense, _) = command(&mut c, &SYNCHRONIZE_CACHE_10, Transfer::None);
    assert_eq!((status, sense), (0, None));
    let exported = scratch.file("cached-export.img");
    cluster.rbd(&["export", "rbd/cached", &exported.display().to_string()]);
    let exported = std::fs::read(&exported).unwrap();
    let last = pseudo_random_bytes(4096, 100 + 63);
    assert!(
        exported[7 * 8 * 512..8 * 8 * 512] == last[..],
        "not in the image"
    );
    assert!(exported[64 * 512..16 << 20] == std::fs::read(&image).unwrap()[64 * 512..]);

    // The OSD stopped: a write is still answered at once (write-back), and the flush after it
    // waits for it to fail and says so.
    let osd = cluster.pid("osd.0").to_string();
    let signal = |which: &str| {
        assert!(std::process::Command::new("kill")
            .args([which, &osd])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    common::wait_stopped(cluster.pid("osd.0"));
    let started = Instant::now();
    let answered = write10(&mut c, 4096, &[9u8; 4096]);
    let answer_took = started.elapsed();
    // Answered, not yet on the OSD: the write-back queue shows it.
    let queued = scrape(metrics_port);
    let queued_stats = stats();
    let (status, sense, _) = command(&mut c, &SYNCHRONIZE_CACHE_10, Transfer::None);
    signal("-CONT");
    assert_eq!(
        (
            metric(&queued, queued_writes),
            metric(&queued, queued_bytes)
        ),
        (1.0, 4096.0),
        "{queued}"
    );
    assert!(
        queued_stats.contains("\"write_back_bytes\":4096,\"write_back_writes\":1"),
        "{queued_stats}"
    );
    assert_eq!(answered, (0, None), "a write-back write");
    assert!(
        answer_took < Duration::from_secs(4),
        "answered only after {answer_took:?}: not early"
    );
    assert_eq!(
        (status, sense),
        (0x02, Some((0x03, 0x0C, 0x00))),
        "SYNCHRONIZE CACHE after a lost write: MEDIUM ERROR, WRITE ERROR\n{}",
        daemon.output()
    );
    assert!(
        daemon
            .output()
            .contains("a write answered from the write cache failed"),
        "{}",
        daemon.output()
    );
    // Reported once: with the OSD back, the next flush succeeds and writes are answered again.
    unless_laggy(cluster);
    wait_until("I/O resumes", Duration::from_secs(60), || {
        write10(&mut c, 4096, &[10u8; 4096]).0 == 0
            && command(&mut c, &SYNCHRONIZE_CACHE_10, Transfer::None).0 == 0
    });
    let (status, _, data) = read10(&mut c, 4096, 8);
    assert_eq!((status, data), (0, vec![10u8; 4096]));
    let text = scrape(metrics_port);
    assert_eq!(metric(&text, queued_writes), 0.0, "{text}");
}

/// One config for two gateways `a` and `b` (portal groups 1 and 2) exporting `image` as LUN 0
/// of `iqn`; `top` goes first (e.g. a `[limits]` table). The gateways run as the cephx user
/// with the caps docs/RBD.md gives (takeover, fencing, shipping and reservations included).
fn gateways_config(
    top: &str,
    iqn: &str,
    image: &str,
    cluster: &TestCluster,
    (port_a, port_b): (u16, u16),
) -> String {
    format!(
        r#"{top}
[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port_a}"]
gateway = "a"

[[portal_group]]
tag = 2
listen = ["127.0.0.1:{port_b}"]
gateway = "b"

[[device]]
name = "vm"
store = "rbd"
image = "{image}"
ceph_conf = "{conf}"
ceph_client = "{user}"

[[target]]
iqn = "{iqn}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "vm" }} ]
"#,
        conf = cluster.conf_str(),
        user = cluster.gateway_user()
    )
}

/// Gateway `gateway`'s control socket, in `scratch`.
fn gateway_socket(scratch: &Scratch, gateway: &str) -> String {
    scratch
        .file(&format!("{gateway}.sock"))
        .display()
        .to_string()
}

/// Starts gateway `gateway` of `config` on `port`, its control socket in `scratch`, with
/// `extra` arguments.
fn start_gateway(
    iqn: &str,
    port: u16,
    config: &str,
    scratch: &Scratch,
    gateway: &str,
    extra: &[&str],
) -> Daemon {
    let socket = gateway_socket(scratch, gateway);
    let mut args = vec!["--gateway", gateway, "--control-socket", &socket];
    args.extend_from_slice(extra);
    Daemon::start_config_text(iqn, port, config, &args)
}

/// `ferrosan ctl ARGS` on gateway `gateway`'s control socket.
fn gateway_ctl(scratch: &Scratch, gateway: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["ctl", "--socket", &gateway_socket(scratch, gateway)])
        .args(args)
        .output()
        .expect("ferrosan ctl")
}

#[test]
fn rbd_gateways_fence_on_takeover() {
    let cluster = TestCluster::start("gw", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/gw"]);
    let iqn = "iqn.2024-01.dev.ferrosan:gateways";
    let (port_a, port_b) = (free_port(), free_port());
    // Standby non-owners: what this test shows is librbd's fence (the default, shipping to
    // the owner, is rbd_gateways_ship_commands_to_the_owner).
    let config = gateways_config(
        "[server]\ngateway_standby = true\n",
        iqn,
        "rbd/gw",
        &cluster,
        (port_a, port_b),
    );
    let scratch = Scratch::new("gateways");
    let start =
        |gateway: &str, port: u16| start_gateway(iqn, port, &config, &scratch, gateway, &[]);
    let mut a = start("a", port_a);
    let mut b = start("b", port_b);

    // A owns the image (first to start); B is standby, and both say so.
    let mut ca = client(port_a, iqn);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut ca), (0, None));
    assert_eq!(settle(&mut cb), (NOT_READY, Some((NOT_READY, 0x04, 0x0B))));
    assert_eq!(rtpg(&mut ca), vec![(1, 0x0), (2, 0x2)]);
    assert_eq!(rtpg(&mut cb), vec![(1, 0x0), (2, 0x2)]);
    let first = pseudo_random_bytes(64 << 10, 1);
    assert_eq!(write10(&mut ca, 0, &first), (0, None));
    let (status, sense, _) = read10(&mut cb, 0, 8);
    assert_eq!((status, sense), (NOT_READY, Some((NOT_READY, 0x04, 0x0B))));

    // A registration made through A is kept in the image: B sees it (before and after the
    // takeover).
    let mut register = vec![0u8; 24];
    register[8..16].copy_from_slice(&0xFE55_0001u64.to_be_bytes());
    let cdb = [0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0];
    let (status, sense, _) = command(&mut ca, &cdb, Transfer::Write(register));
    assert_eq!(status, 0, "REGISTER through A: {sense:?}");
    let read_keys = |c: &mut Client| {
        let (status, sense, data) = command(
            c,
            &[0x5E, 0x00, 0, 0, 0, 0, 0, 0x01, 0, 0],
            Transfer::Read {
                len: 256,
                buf: Vec::new(),
            },
        );
        assert_eq!(status, 0, "READ KEYS: {sense:?}");
        data[8..]
            .chunks(8)
            .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
            .collect::<Vec<_>>()
    };
    assert_eq!(read_keys(&mut cb), vec![0xFE55_0001]);

    // Registrations through both gateways at the same moment: each gateway's save replaces
    // only the state it loaded (compare-and-set in the cluster), so none is lost.
    let registrars: Vec<_> = [(port_a, 0xA000u64), (port_b, 0xB000)]
        .into_iter()
        .map(|(port, base)| {
            std::thread::spawn(move || {
                for i in 0..6u64 {
                    let name = format!("iqn.2024-01.dev.ferrosan:pr-{base:x}-{i}");
                    let mut c = client_named(port, iqn, &name);
                    // The new nexus's unit attention first (B's answer is standby's).
                    settle(&mut c);
                    let mut params = vec![0u8; 24];
                    params[8..16].copy_from_slice(&(base + i).to_be_bytes());
                    let (status, sense, _) = command(
                        &mut c,
                        &[0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0],
                        Transfer::Write(params),
                    );
                    assert_eq!(status, 0, "REGISTER {:x}: {sense:?}", base + i);
                }
            })
        })
        .collect();
    for r in registrars {
        r.join().expect("registrar");
    }
    let sorted_keys = |c: &mut Client| {
        let mut keys = read_keys(c);
        keys.sort_unstable();
        keys
    };
    let mut expected: Vec<u64> = (0..6).flat_map(|i| [0xA000 + i, 0xB000 + i]).collect();
    expected.push(0xFE55_0001);
    expected.sort_unstable();
    assert_eq!(sorted_keys(&mut ca), expected, "a registration was lost");

    // A keeps writing while B takes the image over: after the takeover, nothing A sends
    // lands (its client is blocklisted), whatever A answers its initiator.
    let writer = std::thread::spawn(move || {
        let mut late = Vec::new();
        for i in 0u32..200 {
            let block = pseudo_random_bytes(4096, 1000 + u64::from(i));
            let (status, _) = write10(&mut ca, 1024, &block);
            late.push((Instant::now(), status, block));
            std::thread::sleep(Duration::from_millis(20));
        }
        late
    });
    std::thread::sleep(Duration::from_millis(500));
    take(&scratch, "b");
    let taken = Instant::now();
    let writes = writer.join().expect("writer");
    assert_eq!(rtpg(&mut cb), vec![(1, 0x2), (2, 0x0)]);
    assert_eq!(
        sorted_keys(&mut cb),
        expected,
        "registrations survive the takeover"
    );
    let (status, sense, data) = read10(&mut cb, 0, 128);
    assert_eq!(status, 0, "read through B after the takeover: {sense:?}");
    assert!(data == first, "B does not read the data written through A");
    let (status, _, now) = read10(&mut cb, 1024, 8);
    assert_eq!(status, 0);
    // What B reads is one A wrote before the takeover (or the initial zeros), never a later one.
    let landed = writes.iter().position(|(_, _, block)| *block == now);
    match landed {
        Some(i) => assert!(
            writes[i].0 < taken,
            "a write A sent {:?} after the takeover landed",
            writes[i].0 - taken
        ),
        None => assert!(now.iter().all(|&b| b == 0), "block 1024 holds unknown data"),
    }
    let after: Vec<u8> = writes
        .iter()
        .filter(|(at, _, _)| *at > taken + Duration::from_secs(1))
        .map(|(_, status, _)| *status)
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|&s| s != 0),
        "A still acknowledged writes after the takeover: {after:?}"
    );
    // A notices and reports the same picture.
    let mut ca = client(port_a, iqn);
    wait_until("A reports B as the owner", Duration::from_secs(10), || {
        rtpg(&mut ca) == vec![(1, 0x2), (2, 0x0)]
    });

    // The fenced A reconnects (a new cluster client) and can take the image back: B is
    // fenced in turn, and A reads what B acknowledged.
    wait_until(
        "A reconnects after its fence",
        Duration::from_secs(15),
        || a.output().contains("reconnected, standby"),
    );
    let second = pseudo_random_bytes(64 << 10, 2);
    assert_eq!(write10(&mut cb, 0, &second), (0, None));
    take(&scratch, "a");
    // (Every nexus of A is told: ASYMMETRIC ACCESS STATE CHANGED.)
    assert_eq!(settle(&mut ca), (0, None));
    let (status, sense, data) = read10(&mut ca, 0, 128);
    assert_eq!(status, 0, "read through A after taking it back: {sense:?}");
    assert!(data == second, "A does not read the data written through B");
    let (status, _) = write10(&mut cb, 0, &first);
    assert_ne!(status, 0, "the fenced B still acknowledged a write");

    // B recovers too. The owner A is SIGKILLed; the operator moves the image to B with
    // `ferrosan ctl device take`, and B reads everything A acknowledged.
    wait_until(
        "B reconnects after its fence",
        Duration::from_secs(15),
        || b.output().contains("reconnected, standby"),
    );
    let third = pseudo_random_bytes(64 << 10, 3);
    assert_eq!(write10(&mut ca, 0, &third), (0, None));
    a.signal("KILL");
    let _ = a.wait_exit(Duration::from_secs(5));
    drop(a);
    let out = gateway_ctl(&scratch, "b", &["device", "take", "vm"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("owned by gateway b"),
        "ctl device take: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cb = client(port_b, iqn);
    assert_eq!(rtpg(&mut cb), vec![(1, 0x2), (2, 0x0)]);
    let (status, sense, data) = read10(&mut cb, 0, 128);
    assert_eq!(
        status,
        0,
        "read through B after ctl take: {sense:?}\n{}",
        b.output()
    );
    assert!(data == third, "B does not read the data written through A");
    assert_eq!(sorted_keys(&mut cb), expected);

    // The owner B crashes and is restarted at once, with its lock still held by the dead
    // client: it knows that client as its own (recorded with its name), fences it and owns
    // the image again without an operator.
    let fourth = pseudo_random_bytes(64 << 10, 4);
    assert_eq!(write10(&mut cb, 0, &fourth), (0, None));
    b.signal("KILL");
    let _ = b.wait_exit(Duration::from_secs(5));
    drop(b);
    let b = start("b", port_b);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut cb), (0, None), "{}", b.output());
    assert!(
        b.output().contains("this gateway's previous instance"),
        "{}",
        b.output()
    );
    assert_eq!(rtpg(&mut cb), vec![(1, 0x2), (2, 0x0)]);
    let (status, sense, data) = read10(&mut cb, 0, 128);
    assert_eq!(status, 0, "read through the restarted B: {sense:?}");
    assert!(data == fourth, "the restarted B lost what it acknowledged");
    assert_eq!(write10(&mut cb, 0, &first), (0, None));
    drop(b);
}

/// With `gateway_alua = "explicit"` an initiator's SET TARGET PORT GROUPS through a non-owner
/// takes the image only from an owner that is not known to be alive (its heartbeat stopped):
/// a gateway that returns, or a path the initiator activates, never takes the image back from
/// the one serving it. `gateway_takeover_s = 0`: only the initiator (or the operator) moves it.
#[test]
fn rbd_gateways_under_explicit_alua_never_take_from_a_live_owner() {
    let cluster = TestCluster::start("explicit", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/explicit"]);
    let iqn = "iqn.2024-01.dev.ferrosan:explicit";
    let (port_a, port_b) = (free_port(), free_port());
    let config = gateways_config(
        "[server]\ngateway_alua = \"explicit\"\n[limits]\ngateway_takeover_s = 0\n",
        iqn,
        "rbd/explicit",
        &cluster,
        (port_a, port_b),
    );
    let scratch = Scratch::new("explicit");
    let metrics_b = free_port();
    let a = start_gateway(iqn, port_a, &config, &scratch, "a", &[]);
    let metrics = format!("127.0.0.1:{metrics_b}");
    let b = start_gateway(
        iqn,
        port_b,
        &config,
        &scratch,
        "b",
        &["--metrics-listen", &metrics],
    );
    let (a_owns, b_owns) = (vec![(1, 0x0), (2, 0x1)], vec![(1, 0x1), (2, 0x0)]);
    let mut ca = client(port_a, iqn);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut ca), (0, None));
    settle(&mut cb);
    wait_until("B sees A own the image", Duration::from_secs(10), || {
        rtpg(&mut cb) == a_owns
    });
    let (_, _, inquiry) = command(
        &mut cb,
        &[0x12, 0, 0, 0, 36, 0],
        Transfer::Read {
            len: 36,
            buf: Vec::new(),
        },
    );
    assert_eq!(inquiry[5] & 0x30, 0x30, "TPGS = 11b");
    let first = pseudo_random_bytes(64 << 10, 1);
    assert_eq!(write10(&mut ca, 0, &first), (0, None));
    // A lives: refused (SET TARGET PORT GROUPS COMMAND FAILED), nothing moves, counted.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(stpg(&mut cb, 2), (0x02, Some((0x0B, 0x67, 0x0A))));
    assert_eq!(rtpg(&mut cb), a_owns);
    assert_eq!(rtpg(&mut ca), a_owns);
    assert_eq!(
        metric(
            &scrape(metrics_b),
            "ferrosan_gateway_takeovers_refused_total{device=\"vm\"}"
        ),
        1.0
    );
    // A hangs: its heartbeat stops. No takeover by itself (gateway_takeover_s = 0), but the
    // initiator's request now goes ahead, fencing A.
    a.signal("STOP");
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(rtpg(&mut cb), a_owns, "B took the image by itself");
    assert_eq!(stpg(&mut cb, 2), (0, None), "{}", b.output());
    assert_eq!(rtpg(&mut cb), b_owns);
    assert!(b.output().contains("fenced"), "{}", b.output());
    let (status, sense, data) = read10(&mut cb, 0, 128);
    assert_eq!(status, 0, "read through B: {sense:?}");
    assert!(data == first, "B does not read what A acknowledged");
    // A returns, fenced: it follows B, and an initiator activating its path takes nothing.
    a.signal("CONT");
    wait_until(
        "A reconnects after its fence",
        Duration::from_secs(20),
        || a.output().contains("reconnected"),
    );
    let mut ca = client(port_a, iqn);
    settle(&mut ca);
    wait_until("A follows B", Duration::from_secs(10), || {
        rtpg(&mut ca) == b_owns
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(stpg(&mut ca, 1), (0x02, Some((0x0B, 0x67, 0x0A))));
    assert_eq!(rtpg(&mut ca), b_owns);
    assert_eq!(rtpg(&mut cb), b_owns);
    // The operator may: failback is theirs.
    take(&scratch, "a");
    assert_eq!(rtpg(&mut client(port_a, iqn)), a_owns);
}

/// A standby gateway takes an image over by itself once its owner is gone -- hung (SIGSTOP),
/// crashed (SIGKILL) or cleanly stopped -- for `gateway_takeover_s`: its heartbeat in the
/// image stopped (or nobody holds the lock), with the cluster's watch timeout at its default
/// (30 s), which the heartbeat does not wait for. The hung owner is fenced, so the write it
/// was sent while hung and runs when it wakes never lands.
#[test]
fn rbd_gateway_takes_over_from_a_gone_owner_by_itself() {
    let cluster = TestCluster::start("auto", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/auto"]);
    let iqn = "iqn.2024-01.dev.ferrosan:auto";
    let (port_a, port_b) = (free_port(), free_port());
    let config = gateways_config(
        "[server]\ngateway_standby = true\n[limits]\ngateway_takeover_s = 2\n",
        iqn,
        "rbd/auto",
        &cluster,
        (port_a, port_b),
    );
    let scratch = Scratch::new("auto-takeover");
    let (metrics_a, metrics_b) = (free_port(), free_port());
    let start = |gateway: &str, port: u16| {
        let metrics = format!(
            "127.0.0.1:{}",
            if gateway == "a" { metrics_a } else { metrics_b }
        );
        start_gateway(
            iqn,
            port,
            &config,
            &scratch,
            gateway,
            &["--metrics-listen", &metrics],
        )
    };
    // `ferrosan ctl luns` on a gateway: the MODE column says who owns the image.
    let lun_mode = |gateway: &str| {
        let out = gateway_ctl(&scratch, gateway, &["luns"]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let has = |port: u16, sample: &str| {
        let text = scrape(port);
        assert!(text.contains(sample), "{sample} not in\n{text}");
    };
    let a_owns = vec![(1, 0x0), (2, 0x2)];
    let b_owns = vec![(1, 0x2), (2, 0x0)];
    let mut a = start("a", port_a);
    let b = start("b", port_b);
    let mut ca = client(port_a, iqn);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut ca), (0, None));
    let first = pseudo_random_bytes(64 << 10, 1);
    assert_eq!(write10(&mut ca, 0, &first), (0, None));
    // A live owner is left alone, however long the grace has run.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        rtpg(&mut cb),
        a_owns,
        "B took a live owner's image\n{}",
        b.output()
    );
    // One heartbeat object per gateway and pool: A's names the image with its lock holder and
    // moves; B, which owns nothing, vouches for nothing.
    let beat = |gateway: &str| {
        let object = format!("ferrosan.gateway_beat.{gateway}");
        let text = cluster.rados(&["-p", "rbd", "get", &object, "/dev/stdout"]);
        String::from_utf8_lossy(&text).into_owned()
    };
    let first_beat = beat("a");
    assert!(
        first_beat.starts_with("ferrosan gateway heartbeat 1\ncount ")
            && first_beat.contains("\nauto\t"),
        "{first_beat:?}"
    );
    // It moves every second; a loaded machine may hold a beat up, never for 20 s.
    wait_until("A's heartbeat moves", Duration::from_secs(20), || {
        beat("a") != first_beat
    });
    assert!(!beat("b").contains("auto\t"), "{:?}", beat("b"));

    // A hangs. The initiator's next write reaches A's socket, unread; B takes the image over
    // once the cluster stopped hearing from A, and writes the same block.
    a.signal("STOP");
    let stale = pseudo_random_bytes(4096, 7);
    let hung_write = {
        let stale = stale.clone();
        std::thread::spawn(move || write10(&mut ca, 2048, &stale))
    };
    let stopped = Instant::now();
    wait_until(
        "B takes over from the hung A",
        Duration::from_secs(30),
        || rtpg(&mut cb) == b_owns,
    );
    let waited = stopped.elapsed();
    eprintln!("B took over {waited:?} after A hung");
    // The grace (2 s) runs from A's last heartbeat, which came up to a beat interval (1 s,
    // `policy::BEAT_INTERVAL`) before the signal: the earliest takeover the rule allows is
    // 1 s after it.
    assert!(
        waited >= Duration::from_secs(1),
        "B took over {waited:?} after A hung: before the grace ran out"
    );
    assert!(
        waited < Duration::from_secs(10),
        "B took over {waited:?} after A hung: the heartbeat was not what judged it"
    );
    assert!(b.output().contains("fenced"), "{}", b.output());
    has(metrics_b, "ferrosan_gateway_owner{device=\"vm\"} 1");
    has(
        metrics_b,
        "ferrosan_gateway_takeovers_total{device=\"vm\",reason=\"owner_gone\"} 1",
    );
    // The takeover publishes the new owner, then tells every nexus (2Ah/06h): the RTPG that
    // saw B own the image may have come between the two, and the notice then comes with the
    // next command, as an initiator expects it.
    assert_eq!(settle(&mut cb), (0, None));
    let (status, sense, data) = read10(&mut cb, 0, 128);
    assert_eq!(status, 0, "read through B: {sense:?}");
    assert!(data == first, "B does not read what A acknowledged");
    let fresh = pseudo_random_bytes(4096, 8);
    assert_eq!(write10(&mut cb, 2048, &fresh), (0, None));
    // A wakes and runs the write it was sent while hung: fenced, it cannot land.
    a.signal("CONT");
    let (status, sense) = hung_write.join().expect("hung writer");
    assert_ne!(status, 0, "the fenced A acknowledged a write: {sense:?}");
    let (status, _, data) = read10(&mut cb, 2048, 8);
    assert_eq!(status, 0);
    assert!(
        data == fresh,
        "a write the fenced A ran after the takeover landed"
    );

    // B crashes: A (reconnected after its fence, standby) takes the image back.
    wait_until(
        "A reconnects after its fence",
        Duration::from_secs(15),
        || a.output().contains("reconnected, standby"),
    );
    has(metrics_a, "ferrosan_gateway_fenced_total{device=\"vm\"} 1");
    has(metrics_a, "ferrosan_gateway_owner{device=\"vm\"} 0");
    let said = lun_mode("a");
    assert!(said.contains("rw standby (owner b)"), "{said}");
    let said = lun_mode("b");
    assert!(said.contains("rw owner"), "{said}");
    let second = pseudo_random_bytes(64 << 10, 2);
    assert_eq!(write10(&mut cb, 0, &second), (0, None));
    b.signal("KILL");
    drop(b);
    let crashed = Instant::now();
    let mut ca = client(port_a, iqn);
    // Within the cluster's watch timeout (30 s) and the grace at the latest: A was fenced and
    // reconnected before, and such a gateway has been seen (under two tests at once) to judge
    // the next owner by its watch rather than its heartbeat (docs/RBD.md, *Limits and gaps*).
    while rtpg(&mut ca) != a_owns {
        assert!(
            crashed.elapsed() < Duration::from_secs(45),
            "A did not take over from the crashed B within 45 s\n{}",
            a.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("A took over {:?} after B crashed", crashed.elapsed());
    assert_eq!(settle(&mut ca), (0, None), "{}", a.output());
    let (status, sense, data) = read10(&mut ca, 0, 128);
    assert_eq!(status, 0, "read through A: {sense:?}\n{}", a.output());
    assert!(data == second, "A does not read what B acknowledged");
    // No unit attention left: A raises the takeover's before its new state shows in REPORT
    // TARGET PORT GROUPS, so the loop above has taken it; one raised later would reach here.
    assert_eq!(write10(&mut ca, 0, &first), (0, None), "{}", a.output());

    // A stops cleanly (the lock goes with it): the restarted B takes over without waiting for
    // any watch to expire.
    let b = start("b", port_b);
    let mut cb = client(port_b, iqn);
    assert_eq!(rtpg(&mut cb), a_owns, "{}", b.output());
    a.signal("TERM");
    assert!(
        a.wait_exit(Duration::from_secs(20)).is_some(),
        "A did not stop"
    );
    let stopped = Instant::now();
    wait_until(
        "B takes over from the stopped A",
        Duration::from_secs(15),
        || rtpg(&mut cb) == b_owns,
    );
    eprintln!("B took over {:?} after A stopped", stopped.elapsed());
    assert_eq!(settle(&mut cb), (0, None));
    let (status, _, data) = read10(&mut cb, 0, 128);
    assert_eq!(status, 0);
    assert!(
        data == first,
        "B does not read what A acknowledged before it stopped"
    );
}

/// COMPARE AND WRITE of one 512-byte block at `lba`: `compare` then `write`.
fn compare_and_write(
    c: &mut Client,
    lba: u64,
    compare: &[u8],
    write: &[u8],
) -> (u8, Option<(u8, u8, u8)>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x89;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[13] = 1;
    let mut data = compare.to_vec();
    data.extend_from_slice(write);
    let (status, sense, _) = command(c, &cdb, Transfer::Write(data));
    (status, sense)
}

/// PERSISTENT RESERVE OUT with service action `action`, type `kind`, key and service action
/// key; the status.
fn pr_out(c: &mut Client, action: u8, kind: u8, key: u64, sa_key: u64) -> u8 {
    let mut params = vec![0u8; 24];
    params[0..8].copy_from_slice(&key.to_be_bytes());
    params[8..16].copy_from_slice(&sa_key.to_be_bytes());
    let cdb = [0x5F, action, kind, 0, 0, 0, 0, 0, 24, 0];
    let (status, sense, _) = command(c, &cdb, Transfer::Write(params));
    assert!(status != 0x02, "PERSISTENT RESERVE OUT {action}: {sense:?}");
    status
}

fn lun_reset(c: &mut Client) -> u8 {
    c.connection()
        .expect("connected")
        .task_management(initiator::session::Tmf::LunReset { lun: 0 })
        .expect("LUN reset answered")
}

/// The default: a gateway that does not own the image is active/non-optimized and runs the
/// commands that need the medium on the owner (I/O shipping over a CHAP-authenticated peer
/// session), so either portal serves every command — what libiscsi's MultipathIO tests and
/// initiators without ALUA need. Reservations are checked where a command arrives, resets
/// and the owner's unit attentions cross to the other gateway, and after a takeover the old
/// owner's sessions ship nothing (a command they held from before could land after writes made
/// through the new owner); new sessions do.
#[test]
fn rbd_gateways_ship_commands_to_the_owner() {
    let cluster = TestCluster::start("ship", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/ship"]);
    let iqn = "iqn.2024-01.dev.ferrosan:ship";
    let (port_a, port_b) = (free_port(), free_port());
    let config = gateways_config("", iqn, "rbd/ship", &cluster, (port_a, port_b));
    let scratch = Scratch::new("ship");
    let start =
        |gateway: &str, port: u16| start_gateway(iqn, port, &config, &scratch, gateway, &[]);
    let a = start("a", port_a);
    let b = start("b", port_b);
    let mut ca = client(port_a, iqn);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut ca), (0, None));
    assert_eq!(settle(&mut cb), (0, None), "{}", b.output());
    let a_owns = vec![(1, 0x0), (2, 0x1)];
    assert_eq!(rtpg(&mut ca), a_owns);
    assert_eq!(rtpg(&mut cb), a_owns);

    // Data written through either gateway reads back through the other.
    let first = pseudo_random_bytes(64 << 10, 1);
    assert_eq!(write10(&mut cb, 0, &first), (0, None));
    let (status, sense, data) = read10(&mut ca, 0, 128);
    assert_eq!(status, 0, "{sense:?}");
    assert!(data == first, "A does not read what B shipped");
    let second = pseudo_random_bytes(64 << 10, 2);
    assert_eq!(write10(&mut ca, 256, &second), (0, None));
    let (status, sense, data) = read10(&mut cb, 256, 128);
    assert_eq!(status, 0, "{sense:?}");
    assert!(data == second, "B does not read what A wrote");
    // 32 writes in flight at once through B share its nexus's peer session (pipelined);
    // each lands where it was sent.
    {
        let conn = cb.connection().expect("connected");
        for i in 0..32u64 {
            let mut cdb = [0u8; 10];
            cdb[0] = 0x2A;
            cdb[2..6].copy_from_slice(&(1024 + 8 * i as u32).to_be_bytes());
            cdb[8] = 8;
            let data = pseudo_random_bytes(4096, 100 + i);
            conn.submit(initiator::Command {
                tag: 500 + i,
                lun: 0,
                cdb: Cdb::new(&cdb).expect("cdb"),
                transfer: Transfer::Write(data),
                attr: Default::default(),
            })
            .expect("submit");
        }
        conn.flush().expect("flush");
        for _ in 0..32 {
            let done = conn.next_completion().expect("completion");
            let result = done.result.expect("answered");
            assert_eq!(
                result.status, 0,
                "pipelined write {}: {:?}",
                done.tag, result.sense
            );
        }
    }
    let (status, _, data) = read10(&mut ca, 1024, 256);
    assert_eq!(status, 0);
    for i in 0..32u64 {
        let at = (8 * i as usize) * 512;
        assert!(
            data[at..at + 4096] == pseudo_random_bytes(4096, 100 + i)[..],
            "pipelined write {i} did not land"
        );
    }
    // COMPARE AND WRITE through B runs at the owner: atomic against A's writers.
    let block = &first[..512];
    let new = vec![0xC4u8; 512];
    assert_eq!(compare_and_write(&mut cb, 0, block, &new), (0, None));
    assert_eq!(
        compare_and_write(&mut cb, 0, block, &new),
        (0x02, Some((0x0E, 0x1D, 0x00)))
    );
    let (_, _, data) = read10(&mut ca, 0, 1);
    assert_eq!(data, new);

    // A reservation is checked where the command arrives (B), not again at the owner.
    let holder = INITIATOR;
    let other = "iqn.2024-01.dev.ferrosan:rbd-other";
    let mut cb_other = client_named(port_b, iqn, other);
    settle(&mut cb_other);
    assert_eq!(pr_out(&mut cb, 0x00, 0, 0, 0x5151), 0);
    assert_eq!(pr_out(&mut cb, 0x01, 0x01, 0x5151, 0), 0);
    let (status, _) = write10(&mut cb_other, 512, &[1u8; 512]);
    assert_eq!(status, 0x18, "B let a non-holder write");
    assert_eq!(write10(&mut cb, 512, &[2u8; 512]), (0, None), "{holder}");
    let mut ca_other = client_named(port_a, iqn, other);
    settle(&mut ca_other);
    wait_until(
        "A enforces the reservation made through B",
        Duration::from_secs(5),
        || write10(&mut ca_other, 512, &[3u8; 512]).0 == 0x18,
    );
    assert_eq!(pr_out(&mut cb, 0x03, 0, 0x5151, 0), 0, "CLEAR");
    settle(&mut cb);
    settle(&mut cb_other);
    // A PREEMPT through B tells the preempted initiator connected to A (REGISTRATIONS
    // PREEMPTED): A raises it from the notice B saved with the reservations.
    settle(&mut ca_other);
    assert_eq!(pr_out(&mut ca_other, 0x00, 0, 0, 0x77), 0);
    assert_eq!(pr_out(&mut cb, 0x00, 0, 0, 0x88), 0);
    assert_eq!(pr_out(&mut cb, 0x04, 0x01, 0x88, 0x77), 0, "PREEMPT");
    wait_until(
        "A tells its nexus that B preempted it",
        Duration::from_secs(5),
        || command(&mut ca_other, &[0; 6], Transfer::None).1 == Some((0x06, 0x2A, 0x05)),
    );
    let (status, sense, _) = command(&mut ca_other, &[0; 6], Transfer::None);
    assert_eq!((status, sense), (0, None), "told once");
    assert_eq!(pr_out(&mut cb, 0x03, 0, 0x88, 0), 0, "CLEAR");
    settle(&mut cb);

    // A LUN reset through A reaches B's nexuses (through the peer session's unit attention),
    // and one through B is passed on to A before it is answered.
    assert_eq!(lun_reset(&mut ca), 0);
    let (_, sense, _) = command(&mut cb_other, &[0; 6], Transfer::None);
    assert_eq!(
        sense,
        Some((0x06, 0x29, 0x03)),
        "B's nexus missed A's reset"
    );
    settle(&mut ca);
    settle(&mut cb);
    settle(&mut cb_other);
    assert_eq!(lun_reset(&mut cb), 0);
    let (_, sense, _) = command(&mut ca, &[0; 6], Transfer::None);
    assert_eq!(
        sense,
        Some((0x06, 0x29, 0x03)),
        "A's nexus missed B's reset"
    );
    settle(&mut ca);
    settle(&mut cb);

    // A peer's name is admitted only with the image's secret, even by an open target.
    let peer = format!("iqn.2026-11.org.ferrosan:gateway-peer.{}", "00".repeat(8));
    let mut s = SessionConfig::new(
        peer.as_str(),
        SessionKind::Normal {
            target_name: iqn.into(),
        },
    );
    s.command_timeout = Duration::from_secs(10);
    assert!(
        Client::connect(ClientConfig::new(format!("127.0.0.1:{port_a}"), s)).is_err(),
        "a made-up peer name logged in"
    );

    // B takes the image over. A's session from before ships nothing (transition, retry) and
    // A ends it within a second or so; a new session to A ships to B, and what it writes B
    // reads.
    let mut old = {
        let mut s = SessionConfig::new(
            INITIATOR,
            SessionKind::Normal {
                target_name: iqn.into(),
            },
        );
        s.command_timeout = Duration::from_secs(30);
        initiator::driver::Connection::connect(&ClientConfig::new(format!("127.0.0.1:{port_a}"), s))
            .expect("login to A")
    };
    let tur = |conn: &mut initiator::driver::Connection, tag: u64| {
        conn.run(initiator::Command::none(
            tag,
            0,
            Cdb::new(&[0; 6]).expect("cdb"),
        ))
    };
    while tur(&mut old, 900)
        .ok()
        .and_then(|c| c.result.ok())
        .is_some_and(|r| r.is_unit_attention())
    {}
    take(&scratch, "b");
    let b_owns = vec![(1, 0x1), (2, 0x0)];
    wait_until("A follows the takeover", Duration::from_secs(10), || {
        rtpg(&mut client(port_a, iqn)) == b_owns
    });
    let third = pseudo_random_bytes(4096, 3);
    let mut cdb = [0u8; 10];
    cdb[0] = 0x2A;
    cdb[8] = 8;
    // (Past the unit attention the state change leaves first: ASYMMETRIC ACCESS STATE CHANGED.)
    let mut stale = None;
    for tag in 901..905 {
        let got = old.run(initiator::Command {
            tag,
            lun: 0,
            cdb: Cdb::new(&cdb).expect("cdb"),
            transfer: Transfer::Write(third.clone()),
            attr: Default::default(),
        });
        let attention =
            matches!(&got, Ok(c) if c.result.as_ref().is_ok_and(|r| r.is_unit_attention()));
        stale = Some(got);
        if !attention {
            break;
        }
    }
    match stale.expect("sent").map(|c| c.result) {
        Ok(Ok(r)) => assert_eq!(
            (r.status, r.sense.map(|s| (s.key, s.asc, s.ascq))),
            (NOT_READY, Some((NOT_READY, 0x04, 0x0A))),
            "a session from before the takeover shipped a write"
        ),
        // Or A had ended the session already.
        Ok(Err(e)) => assert!(e.to_string().contains("connection"), "{e}"),
        Err(_) => {}
    }
    wait_until(
        "A ends its session from before",
        Duration::from_secs(5),
        || !tur(&mut old, 910).is_ok_and(|c| c.result.is_ok()),
    );
    assert!(
        a.output().contains("this gateway lost an RBD image"),
        "{}",
        a.output()
    );
    let (_, _, data) = read10(&mut cb, 0, 8);
    assert!(data != third, "the stale session's write landed");
    let mut ca2 = client(port_a, iqn);
    assert_eq!(settle(&mut ca2), (0, None), "{}", a.output());
    assert_eq!(write10(&mut ca2, 0, &third), (0, None));
    let (_, _, data) = read10(&mut cb, 0, 8);
    assert!(
        data == third,
        "B does not read what A shipped after the takeover"
    );
    let said = gateway_ctl(&scratch, "a", &["luns"]);
    let said = String::from_utf8_lossy(&said.stdout);
    assert!(said.contains("rw non-optimized (owner b)"), "{said}");
    drop((a, b));
}

/// A shipped command waits for the owner on the peer session's own thread, not on the
/// shipping gateway's I/O threads: while the owner hangs (SIGSTOP), gateway B — one worker,
/// one I/O thread — still runs a write-through write to a file device of its own, on the same
/// session, at once; the shipped read completes when the owner wakes. The owner listens on a
/// wildcard only: B ships to its `peer_address`.
#[test]
fn a_hung_owner_holds_no_io_thread_other_devices_need() {
    let cluster = TestCluster::start("hung", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/hung"]);
    let iqn = "iqn.2024-01.dev.ferrosan:hung";
    let (port_a, port_b) = (free_port(), free_port());
    let scratch = Scratch::new("hung-owner");
    // The owner listens on a wildcard; the others reach it at its `peer_address`.
    let wildcard_owner = |config: String| {
        config.replace(
            &format!("listen = [\"127.0.0.1:{port_a}\"]\ngateway = \"a\""),
            &format!(
                "listen = [\"0.0.0.0:{port_a}\"]\ngateway = \"a\"\npeer_address = \"127.0.0.1:{port_a}\""
            ),
        )
    };
    let config_a = wildcard_owner(gateways_config(
        "",
        iqn,
        "rbd/hung",
        &cluster,
        (port_a, port_b),
    ));
    assert!(config_a.contains("peer_address"), "{config_a}");
    let local = scratch.file("local.img").display().to_string();
    let config_b = wildcard_owner(gateways_config(
        "[server]\nworkers = 1\n[limits]\nio_threads = 1\n",
        iqn,
        "rbd/hung",
        &cluster,
        (port_a, port_b),
    )
    .replace(
        "luns = [ { lun = 0, device = \"vm\" } ]",
        "luns = [ { lun = 0, device = \"vm\" }, { lun = 1, device = \"local\" } ]",
    )
    .replace(
        "[[target]]",
        &format!(
            "[[device]]\nname = \"local\"\nstore = \"file\"\npath = \"{local}\"\nsize = \"16M\"\ncache = \"page\"\nwrite_cache = false\n\n[[target]]"
        ),
    ));
    assert!(
        config_b.contains("lun = 1") && config_b.contains("peer_address"),
        "{config_b}"
    );
    let metrics_b = free_port();
    let metrics = format!("127.0.0.1:{metrics_b}");
    let start = |gateway: &str, port: u16, config: &str| {
        let extra: &[&str] = if gateway == "b" {
            &["--metrics-listen", &metrics]
        } else {
            &[]
        };
        start_gateway(iqn, port, config, &scratch, gateway, extra)
    };
    let a = start("a", port_a, &config_a);
    let b = start("b", port_b, &config_b);
    let mut cb = client(port_b, iqn);
    assert_eq!(settle(&mut cb), (0, None), "{}", b.output());
    let data = pseudo_random_bytes(4096, 7);
    assert_eq!(write10(&mut cb, 0, &data), (0, None), "{}", b.output());
    let conn = cb.connection().expect("connected");
    // LUN 1's own power-on unit attention, out of the way.
    for tag in 10..14 {
        let tur = initiator::scsi::test_unit_ready();
        let done = conn
            .run(initiator::Command::none(tag, 1, tur))
            .expect("TUR");
        if done.result.expect("answered").status == 0 {
            break;
        }
    }

    let (read_tag, write_tag) = (101, 102);
    // (Waits until every thread of A has stopped: `kill` returns before that.)
    a.signal("STOP");
    let read = Cdb::new(&[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0]).expect("cdb");
    conn.submit(initiator::Command {
        tag: read_tag,
        lun: 0,
        cdb: read,
        transfer: Transfer::Read {
            len: 4096,
            buf: Vec::new(),
        },
        attr: Default::default(),
    })
    .expect("submit the shipped read");
    // Let the read reach B and be shipped before the local write follows it.
    conn.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(300));
    let write = Cdb::new(&[0x2A, 0, 0, 0, 0, 0, 0, 0, 8, 0]).expect("cdb");
    let started = Instant::now();
    conn.submit(initiator::Command {
        tag: write_tag,
        lun: 1,
        cdb: write,
        transfer: Transfer::Write(data.clone()),
        attr: Default::default(),
    })
    .expect("submit the local write");
    conn.flush().expect("flush");
    // Every answer until the write's, for at most 10 s: the read's must not be among them.
    let (mut written, mut read_early) = (None, None);
    while written.is_none() {
        let Some(left) = Duration::from_secs(10).checked_sub(started.elapsed()) else {
            break;
        };
        match conn.wait_completion(left).expect("the connection holds") {
            Some(done) if done.tag == write_tag => written = Some(done),
            Some(done) => read_early = Some(done),
            None => break,
        }
    }
    let waited = started.elapsed();
    a.signal("CONT");
    let seen = format!(
        "after {waited:?}: write {written:?}, read {read_early:?}\n{}",
        b.output()
    );
    let written = written.unwrap_or_else(|| panic!("no answer to the local write {seen}"));
    assert!(
        waited < Duration::from_secs(5),
        "the local write waited behind a hung owner {seen}"
    );
    assert_eq!(written.result.expect("answered").status, 0, "{seen}");
    assert!(
        read_early.is_none(),
        "the shipped read was answered while its owner hung {seen}"
    );
    // The owner wakes and answers the shipped read.
    let second = conn.next_completion().expect("the shipped read's answer");
    assert_eq!(second.tag, read_tag);
    let result = second.result.expect("answered");
    assert_eq!(result.status, 0, "{:?}", result.sense);
    assert_eq!(result.data, data);
    // B counted what it shipped (settle's TEST UNIT READY, the write, the read) and its one
    // peer session; nothing failed.
    let text = scrape(metrics_b);
    let shipped = metric(&text, "ferrosan_gateway_shipped_total{device=\"vm\"}");
    assert!(shipped >= 3.0, "{shipped}");
    let sessions = metric(&text, "ferrosan_gateway_peer_sessions{device=\"vm\"}");
    assert_eq!(sessions, 1.0);
    let failed = metric(&text, "ferrosan_gateway_ship_failures_total{device=\"vm\"}");
    assert_eq!(failed, 0.0);
}

/// One path's writes and read-backs in [`rbd_gateways_keep_every_acknowledged_write_while_ownership_moves`]:
/// a 512-byte block names its LBA and the write's number.
fn numbered_block(lba: u32, seq: u64) -> Vec<u8> {
    let mut block = pseudo_random_bytes(512, seq);
    block[..8].copy_from_slice(&u64::from(lba).to_be_bytes());
    block[8..16].copy_from_slice(&seq.to_be_bytes());
    block
}

/// The (LBA, write number) a block read back names.
fn block_number(block: &[u8]) -> Option<(u32, u64)> {
    let lba = u64::from_be_bytes(block.get(..8)?.try_into().ok()?);
    let seq = u64::from_be_bytes(block.get(8..16)?.try_into().ok()?);
    Some((u32::try_from(lba).ok()?, seq))
}

/// The image moves between the gateways six times (`ferrosan ctl device take`, each fencing
/// the other) while an initiator writes through both portals in turn, reconnecting when a
/// gateway ends its sessions and retrying what failed, and reads each block back through the
/// other portal after every write: no read ever returns a write older than one acknowledged
/// for that block (a stale write landing after a newer one), and the final contents hold
/// every acknowledged write.
#[test]
fn rbd_gateways_keep_every_acknowledged_write_while_ownership_moves() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const BLOCKS: u32 = 32;
    let cluster = TestCluster::start("moves", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/moves"]);
    let iqn = "iqn.2024-01.dev.ferrosan:moves";
    let (port_a, port_b) = (free_port(), free_port());
    let config = gateways_config("", iqn, "rbd/moves", &cluster, (port_a, port_b));
    let scratch = Scratch::new("moves");
    let start =
        |gateway: &str, port: u16| start_gateway(iqn, port, &config, &scratch, gateway, &[]);
    let a = start("a", port_a);
    let b = start("b", port_b);
    assert_eq!(
        settle(&mut client(port_a, iqn)),
        (0, None),
        "{}",
        a.output()
    );
    assert_eq!(
        settle(&mut client(port_b, iqn)),
        (0, None),
        "{}",
        b.output()
    );

    // What the writer learned: per block, the newest acknowledged write; what went wrong. (The
    // blocking client logs in again by itself when a gateway ends its session, and resubmits
    // the command it had in flight: the same write, so the same number.)
    #[derive(Default)]
    struct Seen {
        acked: Vec<u64>,
        acked_total: u64,
        failed: u64,
        stale: Vec<String>,
    }
    let seen = Arc::new(Mutex::new(Seen {
        acked: vec![0; BLOCKS as usize],
        ..Seen::default()
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (seen, stop, iqn) = (Arc::clone(&seen), Arc::clone(&stop), iqn.to_string());
        std::thread::spawn(move || {
            let ports = [port_a, port_b];
            let connect = |port: u16| connect(port, &iqn, INITIATOR, Duration::from_secs(30)).ok();
            let mut clients: Vec<Option<Client>> = ports.iter().map(|&p| connect(p)).collect();
            let mut seq = 0u64;
            while !stop.load(Ordering::Acquire) {
                seq += 1;
                let lba = (seq % u64::from(BLOCKS)) as u32;
                let path = (seq % 2) as usize;
                let Some(c) = clients[path].as_mut() else {
                    std::thread::sleep(Duration::from_millis(50));
                    clients[path] = connect(ports[path]);
                    continue;
                };
                let mut cdb = [0u8; 10];
                cdb[0] = 0x2A;
                cdb[2..6].copy_from_slice(&lba.to_be_bytes());
                cdb[8] = 1;
                let written = c.command(
                    Cdb::new(&cdb).expect("cdb"),
                    Transfer::Write(numbered_block(lba, seq)),
                );
                match written {
                    Ok(r) if r.status == 0 => {
                        let mut s = seen.lock().unwrap();
                        s.acked[lba as usize] = seq;
                        s.acked_total += 1;
                    }
                    Ok(_) => {
                        seen.lock().unwrap().failed += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(_) => {
                        seen.lock().unwrap().failed += 1;
                        clients[path] = None;
                        continue;
                    }
                }
                // Read the block back through the other path: never older than acknowledged.
                let other = 1 - path;
                let Some(c) = clients[other].as_mut() else {
                    continue;
                };
                let mut cdb = [0u8; 10];
                cdb[0] = 0x28;
                cdb[2..6].copy_from_slice(&lba.to_be_bytes());
                cdb[8] = 1;
                let floor = seen.lock().unwrap().acked[lba as usize];
                let read = c.command(
                    Cdb::new(&cdb).expect("cdb"),
                    Transfer::Read {
                        len: 512,
                        buf: Vec::new(),
                    },
                );
                match read {
                    Ok(r) if r.status == 0 => match block_number(&r.data) {
                        Some((at, got)) if at == lba && got >= floor => {}
                        other_block => seen.lock().unwrap().stale.push(format!(
                            "LBA {lba} read through port {}: {other_block:?}, acknowledged {floor}",
                            ports[other]
                        )),
                    },
                    Ok(_) => {}
                    Err(_) => clients[other] = None,
                }
            }
        })
    };

    // Six moves, each once the gateway taking the image has replaced the connection the
    // previous move fenced.
    let reconnected = |d: &Daemon| d.output().matches("reconnected, standby").count();
    let mut fenced = [0usize; 2];
    let mut acked_before_last_move = 0;
    for (i, gateway) in ["b", "a", "b", "a", "b", "a"].into_iter().enumerate() {
        std::thread::sleep(Duration::from_millis(1500));
        let (me, other) = if gateway == "a" { (0, 1) } else { (1, 0) };
        let daemon = [&a, &b][me];
        wait_until(
            &format!("gateway {gateway} replaces its fenced connection"),
            Duration::from_secs(20),
            || reconnected(daemon) >= fenced[me],
        );
        let out = gateway_ctl(&scratch, gateway, &["device", "take", "vm"]);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.contains(&format!("owned by gateway {gateway}")),
            "move {i}: ctl device take: {said}{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            daemon.output()
        );
        // Each move breaks the other gateway's lock, blocklisting its data connection.
        fenced[other] += 1;
        acked_before_last_move = seen.lock().unwrap().acked_total;
    }
    // The writer keeps going through the final owner's portal and the shipping one.
    wait_until(
        "writes are acknowledged after the last move",
        Duration::from_secs(30),
        || seen.lock().unwrap().acked_total > acked_before_last_move + 20,
    );
    stop.store(true, Ordering::Release);
    writer.join().expect("the writer ran to the end");
    let seen = seen.lock().unwrap();
    assert!(seen.stale.is_empty(), "stale reads: {:?}", seen.stale);
    // Each gateway that lost the image ended the sessions it had then; they logged in again.
    let ended = |d: &Daemon| {
        d.output()
            .matches("closing the session: this gateway lost an RBD image")
            .count()
    };
    let (ended_a, ended_b) = (ended(&a), ended(&b));
    eprintln!(
        "{} writes acknowledged, {} failed (retried as new writes); sessions ended: a {ended_a}, b {ended_b}",
        seen.acked_total, seen.failed
    );
    assert!(
        ended_a >= 1 && ended_b >= 1,
        "{}\n{}",
        a.output(),
        b.output()
    );
    // The final contents, through the owner a: every block holds its newest acknowledged
    // write or a later one that failed to answer, never an older one.
    let mut ca = client(port_a, iqn);
    settle(&mut ca);
    let (status, sense, data) = read10(&mut ca, 0, BLOCKS as u16);
    assert_eq!(status, 0, "{sense:?}");
    for (lba, block) in data.chunks(512).enumerate() {
        if seen.acked[lba] == 0 && block.iter().all(|&b| b == 0) {
            continue;
        }
        let (at, got) = block_number(block).expect("a numbered block");
        assert_eq!(at as usize, lba, "block {lba} holds another LBA's write");
        assert!(
            got >= seen.acked[lba],
            "block {lba}: write {got}, older than the acknowledged {}",
            seen.acked[lba]
        );
    }
    drop((a, b));
}

/// The ANA state of namespace 1's group through an NVMe controller (ANA log page 0Ch: a
/// 16-byte header, then the group descriptor, its state at byte 16). A Keep Alive first: the
/// test polls for longer than the controller's keep-alive timeout.
fn ana_state(h: &mut initiator::nvme::NvmeHost) -> u8 {
    h.admin
        .run_ok(initiator::nvme::sqe(0x18, 0, [0; 6]), Vec::new(), 0)
        .expect("Keep Alive");
    let page = h
        .admin
        .run_ok(
            initiator::nvme::sqe(0x02, 0, [0x0C | 1023 << 16, 0, 0, 0, 0, 0]),
            Vec::new(),
            4096,
        )
        .expect("ANA log page")
        .data;
    page[32] & 0x0F
}

#[test]
fn rbd_gateways_serve_nvme_tcp_with_ana_from_ownership() {
    use initiator::nvme::NvmeHost;
    const OPTIMIZED: u8 = 0x01;
    const NON_OPTIMIZED: u8 = 0x02;
    let cluster = TestCluster::start("nvmegw", 3, "");
    cluster.rbd(&["create", "--size", "64M", "rbd/nvmegw"]);
    let iqn = "iqn.2024-01.dev.ferrosan:nvmegw";
    let nqn = "nqn.2024-01.dev.ferrosan:nvmegw";
    let host = "nqn.2014-08.org.nvmexpress:uuid:3a1b2c4d-0e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let (port_a, port_b) = (free_port(), free_port());
    let (nvme_a, nvme_b) = (free_port(), free_port());
    // The iSCSI gateways' config, each portal group with an NVMe/TCP listener, the target with
    // its NQN.
    let config = gateways_config(
        "[limits]\ngateway_takeover_s = 2\n",
        iqn,
        "rbd/nvmegw",
        &cluster,
        (port_a, port_b),
    )
    .replace(
        &format!("listen = [\"127.0.0.1:{port_a}\"]"),
        &format!("listen = [\"127.0.0.1:{port_a}\"]\nnvme_listen = [\"127.0.0.1:{nvme_a}\"]\nnvme_discovery_listen = []"),
    )
    .replace(
        &format!("listen = [\"127.0.0.1:{port_b}\"]"),
        &format!("listen = [\"127.0.0.1:{port_b}\"]\nnvme_listen = [\"127.0.0.1:{nvme_b}\"]\nnvme_discovery_listen = []"),
    )
    .replace(
        &format!("iqn = \"{iqn}\""),
        &format!("iqn = \"{iqn}\"\nnqn = \"{nqn}\""),
    );
    let scratch = Scratch::new("nvme-gateways");
    let start =
        |gateway: &str, port: u16| start_gateway(iqn, port, &config, &scratch, gateway, &[]);
    let a = start("a", port_a);
    let b = start("b", port_b);
    let at = |port: u16| -> std::net::SocketAddr { format!("127.0.0.1:{port}").parse().unwrap() };
    let mut ha = NvmeHost::connect(at(nvme_a), nqn, host, 8).expect("connect to A");
    let mut hb = NvmeHost::connect(at(nvme_b), nqn, host, 8).expect("connect to B");
    // One subsystem: a host must see a different controller ID through each gateway (Linux
    // refuses the second controller of a duplicate ID), and CNTLID says the same.
    assert_ne!(
        ha.cntlid, hb.cntlid,
        "both gateways gave the same controller ID"
    );
    let identified = |h: &NvmeHost| u16::from_le_bytes([h.identify[78], h.identify[79]]);
    assert_eq!((identified(&ha), identified(&hb)), (ha.cntlid, hb.cntlid));
    // The owner's path is optimized, the other's non-optimized: ALUA's states as ANA states.
    wait_until(
        "the paths settle: A optimized, B non-optimized",
        Duration::from_secs(30),
        || ana_state(&mut ha) == OPTIMIZED && ana_state(&mut hb) == NON_OPTIMIZED,
    );
    // What one gateway's namespace takes, the other's reads (B ships to the owner).
    let first = pseudo_random_bytes(64 << 10, 1);
    hb.write(1, 0, first.clone(), 512).expect("write through B");
    assert!(ha.read(1, 0, 128, 512).expect("read through A") == first);
    let second = pseudo_random_bytes(64 << 10, 2);
    ha.write(1, 256, second.clone(), 512)
        .expect("write through A");
    assert!(hb.read(1, 256, 128, 512).expect("read through B") == second);
    // The owner is killed: B takes the image over by itself and its path becomes optimized.
    a.signal("KILL");
    let killed = Instant::now();
    wait_until(
        "B's path becomes optimized after A is killed",
        Duration::from_secs(45),
        || ana_state(&mut hb) == OPTIMIZED,
    );
    let took = killed.elapsed();
    eprintln!("B's path optimized {took:?} after A was killed");
    // By A's heartbeat (grace 2 s), not the cluster's watch timeout (28-30 s): A's first beat
    // is written when it takes the image, so even an owner killed at once has one.
    assert!(
        took < Duration::from_secs(25),
        "B took over {took:?} after A was killed: by the watch timeout, not the heartbeat"
    );
    let third = pseudo_random_bytes(4096, 3);
    let written = (0..40).any(|_| {
        let ok = hb.write(1, 1024, third.clone(), 512).is_ok();
        if !ok {
            std::thread::sleep(Duration::from_millis(250));
        }
        ok
    });
    assert!(
        written,
        "B's namespace takes no write after the takeover\n{}",
        b.output()
    );
    assert!(
        hb.read(1, 0, 128, 512).unwrap() == first,
        "B lost what A acknowledged"
    );
    assert!(hb.read(1, 1024, 8, 512).unwrap() == third);
    assert!(b.output().contains("fenced"), "{}", b.output());
}
