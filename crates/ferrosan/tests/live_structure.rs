//! The structure changes live through `ferrosan ctl`: targets, initiator groups,
//! authentication, device attributes, portal groups and their listeners. Each change keeps an
//! unrelated session (same TSIH, no error); a session the change concerns is told the
//! standard way (a unit attention, or an Async Message asking it to log out).

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{free_port, raw::Raw, run, Ctl, Daemon};
use serde_json::Value;

const IQN: &str = "iqn.2026-11.org.ferrosan:structure";
const SECOND: &str = "iqn.2026-11.org.ferrosan:second";

const BODY: &str = r#"
[[device]]
name = "mem"
store = "ram"
size = "16M"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:structure"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "mem" } ]
"#;

fn start() -> (Daemon, Ctl) {
    let ctl = Ctl::new();
    let s = ctl.socket.display().to_string();
    let daemon = Daemon::start_config_args(IQN, BODY, &["--control-socket", &s]);
    (daemon, ctl)
}

/// Runs a `ctl` verb that must succeed; its JSON answer.
fn ok(ctl: &Ctl, args: &[&str]) -> Value {
    let r = ctl.json(args);
    assert_eq!(r["ok"], true, "ctl {args:?}: {r}");
    r
}

/// The TSIH of the one session of `target` in `ctl sessions`.
fn tsih_of(ctl: &Ctl, target: &str) -> u64 {
    let sessions = ctl.sessions();
    let mine: Vec<&Value> = sessions.iter().filter(|s| s["target"] == target).collect();
    assert_eq!(mine.len(), 1, "{sessions:?}");
    mine[0]["tsih"].as_u64().unwrap()
}

/// TEST UNIT READY on LUN 0 until GOOD: the unit attentions seen on the way.
fn unit_attentions(raw: &mut Raw, itt: &mut u32) -> Vec<(u8, u8)> {
    let mut seen = Vec::new();
    for _ in 0..6 {
        let bhs = raw.command(*itt, &[0; 6], 0x80, 0);
        *itt += 1;
        raw.send(&bhs, &[]);
        let pdu = raw.recv();
        if common::raw::status_of(&pdu) == 0 {
            return seen;
        }
        let sense = &pdu.data[2..];
        assert_eq!(sense[2] & 0x0f, 0x06, "not a unit attention: {sense:02x?}");
        seen.push((sense[12], sense[13]));
    }
    panic!("TEST UNIT READY never succeeded: {seen:02x?}");
}

/// The status of a WRITE (10) of one block at LBA 0 of LUN 0, and its sense key.
fn write_one(raw: &mut Raw, itt: &mut u32) -> (u8, Option<u8>) {
    let cdb = common::raw::rw10(0x2A, 0, 1);
    let bhs = raw.command(*itt, &cdb, 0xA0, 512);
    *itt += 1;
    raw.send(&bhs, &[7u8; 512]);
    let pdu = raw.recv();
    let status = common::raw::status_of(&pdu);
    (status, (status != 0).then(|| pdu.data[2 + 2] & 0x0f))
}

fn lun_of<'v>(luns: &'v Value, target: &str) -> &'v Value {
    luns["luns"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["target"] == target)
        .unwrap_or_else(|| panic!("no LUN of {target}: {luns}"))
}

#[test]
fn targets_groups_auth_and_device_attributes_change_live_around_a_session() {
    let (mut daemon, ctl) = start();
    let mut raw = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![(0x29, 0x00)]);
    let tsih = tsih_of(&ctl, IQN);

    // A second target, its own device and LUN, found by discovery and readable.
    ok(&ctl, &["device", "add", "other", "ram:8M"]);
    let r = ok(
        &ctl,
        &[
            "target",
            "add",
            SECOND,
            "--group",
            "hosts",
            "--any-initiator",
        ],
    );
    assert_eq!(r["changes"][0], format!("target {SECOND} added"), "{r}");
    ok(&ctl, &["lun", "map", SECOND, "hosts", "0", "other"]);
    let listed = run("iscsi-ls", &["-s", &daemon.portal()]).expect_ok(&daemon);
    assert!(listed.stdout.contains(SECOND), "{}", listed.describe());
    run(
        "iscsi-inq",
        &[&format!("iscsi://127.0.0.1:{}/{SECOND}/0", daemon.port)],
    )
    .expect_ok(&daemon);
    // A group for one host, then gone; a group that is a target's last is refused.
    ok(
        &ctl,
        &[
            "group",
            "add",
            SECOND,
            "db",
            "--initiator",
            "iqn.2026-11.test:db1",
        ],
    );
    ok(&ctl, &["group", "remove", SECOND, "db"]);
    let last = ctl.run(&["group", "remove", SECOND, "hosts"]);
    assert!(last.stderr.contains("only group"), "{}", last.describe());
    // Authentication off and on (chap needs users: refused without them, nothing changed).
    ok(&ctl, &["auth", "set", SECOND, "none"]);
    let chap = ctl.run(&["auth", "set", SECOND, "chap"]);
    assert_eq!(chap.status.code(), Some(1), "{}", chap.describe());
    assert!(chap.stderr.contains("users"), "{}", chap.describe());
    ok(&ctl, &["target", "remove", SECOND]);
    assert!(ctl.json(&["luns"])["luns"]
        .to_string()
        .find(SECOND)
        .is_none());

    // Device attributes, live, on the session's own LUN: each told by its unit attention.
    // (A config's device has its write cache off unless it says otherwise.)
    let r = ok(&ctl, &["device", "set", "mem", "--write-cache", "on"]);
    assert_eq!(r["changes"][0], "device mem: write_cache on", "{r}");
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![(0x2a, 0x01)]);
    ok(&ctl, &["device", "set", "mem", "--write-cache", "off"]);
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![(0x2a, 0x01)]);
    ok(
        &ctl,
        &[
            "device",
            "set",
            "mem",
            "--product",
            "VM STORE",
            "--serial",
            "array7-1",
        ],
    );
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![(0x3f, 0x03)]);
    let lun = lun_of(&ctl.json(&["luns"]), IQN).clone();
    assert_eq!(
        (&lun["write_cache"], &lun["product"], &lun["serial"]),
        (
            &Value::Bool(false),
            &Value::from("VM STORE"),
            &Value::from("array7-1")
        ),
        "{lun}"
    );
    assert_eq!(write_one(&mut raw, &mut itt), (0, None));
    ok(&ctl, &["device", "set", "mem", "--read-only", "on"]);
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![(0x2a, 0x01)]);
    assert_eq!(
        write_one(&mut raw, &mut itt),
        (2, Some(0x07)),
        "DATA PROTECT"
    );
    ok(&ctl, &["device", "set", "mem", "--read-only", "off"]);
    unit_attentions(&mut raw, &mut itt);
    assert_eq!(write_one(&mut raw, &mut itt), (0, None));
    // What cannot change while it runs is refused, naming what can.
    let again = ctl.run(&["device", "set", "mem", "--write-cache", "off"]);
    assert!(again.stderr.contains("already"), "{}", again.describe());
    // Saved, the file holds the attributes and a restart would serve them.
    ok(&ctl, &["save"]);
    let text = std::fs::read_to_string(daemon.file("ferrosan.toml")).unwrap();
    assert!(text.contains("product = \"VM STORE\""), "{text}");
    assert!(text.contains("serial = \"array7-1\""), "{text}");
    assert_eq!(
        ok(&ctl, &["reload"])["changes"].as_array().map(Vec::len),
        Some(0)
    );

    // The session lived through all of it.
    raw.ping(999);
    assert_eq!(tsih_of(&ctl, IQN), tsih);
    daemon.stop();
}

fn connects(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).is_ok()
}

#[test]
fn portal_groups_and_listeners_change_live_and_their_sessions_are_asked_to_log_out() {
    let (mut daemon, ctl) = start();
    let mut raw = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    unit_attentions(&mut raw, &mut itt);
    let tsih = tsih_of(&ctl, IQN);

    let (second, third) = (free_port(), free_port());
    let at = |port: u16| format!("127.0.0.1:{port}");
    assert!(!connects(second));
    let r = ok(
        &ctl,
        &[
            "portal-group",
            "add",
            "2",
            &at(second),
            "--state",
            "active-non-optimized",
        ],
    );
    assert!(
        r["changes"].to_string().contains("portal group 2 added"),
        "{r}"
    );
    assert!(connects(second), "the new portal group listens at once");
    // Discovery through the first portal now reports the second as a path too.
    let listed = run("iscsi-ls", &["-s", &daemon.portal()]).expect_ok(&daemon);
    assert!(listed.stdout.contains(&at(second)), "{}", listed.describe());
    let status = ok(&ctl, &["status"]);
    assert!(
        status["listeners"].to_string().contains(&at(second)),
        "{status}"
    );

    // Another listener for group 2, and away again.
    ok(&ctl, &["portal-group", "listen", "2", &at(third)]);
    assert!(connects(third));
    ok(&ctl, &["portal-group", "unlisten", "2", &at(third)]);
    assert!(!connects(third), "an unlistened address is closed");
    // A port someone else holds: refused, nothing changed.
    let held = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let taken = held.local_addr().unwrap().to_string();
    let r = ctl.run(&["portal-group", "listen", "2", &taken]);
    assert_eq!(r.status.code(), Some(1), "{}", r.describe());
    assert!(r.stderr.contains("cannot listen"), "{}", r.describe());
    assert!(!ok(&ctl, &["config", "show"])["toml"]
        .to_string()
        .contains(&taken));

    // A session through group 2; removing the group asks it to log out.
    let mut through = Raw::login(second, IQN, 2);
    ok(&ctl, &["portal-group", "remove", "2"]);
    assert!(!connects(second), "the removed group's listener is closed");
    let deadline = Instant::now() + Duration::from_secs(5);
    let asked = loop {
        let pdu = through.recv();
        if pdu.opcode() == iscsi::pdu::Opcode::AsyncMessage as u8 {
            break pdu.bhs.byte(iscsi::pdu::off::ASYNC_EVENT);
        }
        assert!(Instant::now() < deadline, "no Async Message");
    };
    assert_eq!(asked, 1, "AsyncEvent 1: the target requests a logout");
    // The session of group 1 was not concerned.
    raw.ping(999);
    assert_eq!(unit_attentions(&mut raw, &mut itt), vec![]);
    let sessions = ctl.sessions();
    let kept: Vec<_> = sessions
        .iter()
        .filter(|s| s["portal_group_tag"] == 1)
        .collect();
    assert_eq!(kept.len(), 1, "{sessions:?}");
    assert_eq!(kept[0]["tsih"].as_u64(), Some(tsih));
    drop(held);
    daemon.stop();
}
