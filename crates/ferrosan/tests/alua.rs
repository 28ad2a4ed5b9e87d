//! ALUA over the wire, one small test per behaviour.
//!
//! Implicit ALUA (RAM LU, states from the configuration): through either portal REPORT TARGET
//! PORT GROUPS lists every group with its state and ports, INQUIRY says implicit ALUA, VPD 83h
//! names the group of the port the initiator logged in through; each state (active/optimized,
//! active/non-optimized, standby, unavailable) answers exactly the commands SPC-4 5.15.2.4 lets
//! it answer and refuses the rest with its own sense; SET TARGET PORT GROUPS is not offered.
//!
//! Explicit ALUA (an RBD image behind two gateways): the owner's group is active/optimized, the
//! other active/non-optimized and serving every command; SET TARGET PORT GROUPS through the
//! other moves the LU, every other nexus on both gateways gets ASYMMETRIC ACCESS STATE CHANGED
//! and the sender does not; a request it cannot carry out is refused. The transitioning state
//! (a takeover in progress) is tested in the scsi crate (`tests/alua.rs`), where the takeover
//! can be held open.

mod common;

use common::array::{read_len, rtpg_cdb, Array, Backing, Path, GOOD};
use common::raw::Raw;
use common::{free_port, Daemon};
use initiator::session::Transfer;

const IQN: &str = "iqn.2024-01.dev.ferrosan:alua";

fn rtpg(extended: bool) -> [u8; 12] {
    [
        0xA3,
        (u8::from(extended) << 5) | 0x0A,
        0,
        0,
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        0,
    ]
}

#[test]
fn report_target_port_groups_and_inquiry_through_each_portal() {
    let second_port = free_port();
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:{second_port}\"]\nalua_state = \"active-non-optimized\"\n{}",
            common::open_ram_target(IQN)
        ),
    );
    // Group 1 (the harness's portal group): active/optimized, port 1; group 2: non-optimized.
    let mut groups = vec![0, 0, 0, 24];
    groups.extend_from_slice(&[0x00, 0x0F, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]);
    groups.extend_from_slice(&[0x01, 0x0F, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]);
    for (port, group, isid) in [(daemon.port, 1u8, 1u8), (second_port, 2, 2)] {
        let mut client = Raw::login(port, IQN, isid);
        // The new nexus's first command collects its power-on unit attention.
        let bhs = client.command(9, &[0; 6], 0x80, 0);
        client.send(&bhs, &[]);
        client.recv();
        let bhs = client.command(1, &rtpg(false), 0xc0, 256);
        client.send(&bhs, &[]);
        assert_eq!(client.read_data(), groups, "through group {group}");
        let bhs = client.command(2, &rtpg(true), 0xc0, 256);
        client.send(&bhs, &[]);
        let extended = client.read_data();
        assert_eq!(extended[..8], [0, 0, 0, 28, 0x10, 0, 0, 0]);
        assert_eq!(
            extended[8..],
            groups[4..],
            "extended, through group {group}"
        );
        // Standard INQUIRY: TPGS = 01b, implicit ALUA.
        let bhs = client.command(3, &[0x12, 0, 0, 0, 96, 0], 0xc0, 96);
        client.send(&bhs, &[]);
        assert_eq!(client.read_data()[5] & 0x30, 0x10);
        // Device identification VPD: the target port group of this portal.
        let bhs = client.command(4, &[0x12, 1, 0x83, 1, 0, 0], 0xc0, 256);
        client.send(&bhs, &[]);
        let vpd = client.read_data();
        assert!(
            vpd.windows(8)
                .any(|w| w == [0x01, 0x15, 0, 4, 0, 0, 0, group]),
            "no target port group {group} designator: {vpd:02x?}"
        );
    }
}

/// The `Portal:` entries `iscsi-ls` prints for the target, discovered through `port`.
fn discovered_portals(port: u16) -> Vec<String> {
    let out = common::run("iscsi-ls", &[&format!("iscsi://127.0.0.1:{port}")]);
    assert!(out.success(), "{}", out.describe());
    let mut portals: Vec<String> = out
        .stdout
        .lines()
        .filter(|l| l.contains(IQN))
        .filter_map(|l| l.split("Portal:").nth(1))
        .map(|p| p.trim().to_string())
        .collect();
    portals.sort();
    portals
}

#[test]
fn discovery_through_any_portal_lists_every_path_wildcards_included() {
    // Group 1 (the harness's) on 127.0.0.1; groups 2 and 3 on wildcard listeners.
    let (two, three) = (free_port(), free_port());
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[[portal_group]]\ntag = 2\nlisten = [\"0.0.0.0:{two}\"]\n\
             [[portal_group]]\ntag = 3\nlisten = [\"0.0.0.0:{three}\"]\n{}",
            common::open_ram_target(IQN)
        ),
    );
    let mut want = vec![
        format!("127.0.0.1:{},1", daemon.port),
        format!("127.0.0.1:{two},2"),
        format!("127.0.0.1:{three},3"),
    ];
    want.sort();
    for port in [daemon.port, two, three] {
        assert_eq!(discovered_portals(port), want, "discovered through {port}");
    }
}

#[test]
fn the_banner_names_dialable_addresses() {
    let port = free_port();
    let scratch = common::Scratch::new("banner");
    let config = scratch.file("ferrosan.toml");
    std::fs::write(
        &config,
        format!(
            "[[portal_group]]\ntag = 1\nlisten = [\"0.0.0.0:{port}\"]\n{}",
            common::open_ram_target(IQN)
        ),
    )
    .unwrap();
    // The daemon started with a wildcard listener prints no wildcard in its examples.
    let wild = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = wild.id();
    let mut child = wild;
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    // A banner that never ends the way we expect must not hang the test: the daemon is
    // killed after 20 s whatever happens (its stdout then closes).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watched = std::sync::Arc::clone(&done);
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(20));
        // Only if it is still ours: reaped, its PID may be someone else's.
        if !watched.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = std::process::Command::new("kill")
                .arg(pid.to_string())
                .status();
        }
    });
    // The banner ends with the login example.
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut stdout, &mut line).unwrap_or(0) == 0 {
            break;
        }
        banner.push_str(&line);
        if line.contains("iscsiadm -m node") {
            break;
        }
    }
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
    let _ = child.wait();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(banner.contains("iscsiadm"), "{banner}");
    for line in banner
        .lines()
        .filter(|l| l.contains("iscsiadm") || l.contains("iscsi://"))
    {
        assert!(!line.contains("0.0.0.0"), "not dialable: {line}");
        assert!(line.contains(&format!(":{port}")), "{line}");
    }
}

/// A RAM LU served through four portal groups, one per configured state: 1 active/optimized,
/// 2 active/non-optimized, 3 standby, 4 unavailable. The ports, by group.
fn four_states() -> (Daemon, [u16; 4]) {
    four_states_of(&common::open_ram_target(IQN))
}

/// [`four_states`] with `target` (devices and the target `IQN`) as the rest of the config.
fn four_states_of(target: &str) -> (Daemon, [u16; 4]) {
    let ports = [free_port(), free_port(), free_port()];
    let mut body = String::new();
    for (tag, port, state) in [
        (2, ports[0], "active-non-optimized"),
        (3, ports[1], "standby"),
        (4, ports[2], "unavailable"),
    ] {
        body.push_str(&format!(
            "[[portal_group]]\ntag = {tag}\nlisten = [\"127.0.0.1:{port}\"]\nalua_state = \"{state}\"\n"
        ));
    }
    body.push_str(target);
    let daemon = Daemon::start_config(IQN, &body);
    let all = [daemon.port, ports[0], ports[1], ports[2]];
    (daemon, all)
}

/// A new nexus through `port`, its power-on unit attention collected.
fn nexus(port: u16, initiator: &str) -> Path {
    let mut p = Path::connect(port, IQN, initiator, initiator::driver::random_isid())
        .expect("login through every state's portal");
    p.settle();
    p
}

/// A command each state is checked with: name, CDB, Data-Out (None: a Data-In allowance).
type Probe = (&'static str, Vec<u8>, Option<Vec<u8>>);

fn commands() -> Vec<Probe> {
    vec![
        ("TEST UNIT READY", vec![0; 6], None),
        ("INQUIRY", vec![0x12, 0, 0, 0, 96, 0], None),
        (
            "REPORT LUNS",
            vec![0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            None,
        ),
        ("REQUEST SENSE", vec![0x03, 0, 0, 0, 18, 0], None),
        ("REPORT TARGET PORT GROUPS", rtpg_cdb().to_vec(), None),
        (
            "READ CAPACITY (10)",
            vec![0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
        (
            "READ CAPACITY (16)",
            vec![0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
            None,
        ),
        ("MODE SENSE (6)", vec![0x1A, 0, 0x3F, 0, 255, 0], None),
        (
            "PERSISTENT RESERVE IN",
            vec![0x5E, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            None,
        ),
        ("READ (10)", vec![0x28, 0, 0, 0, 0, 8, 0, 0, 1, 0], None),
        (
            "WRITE (10)",
            vec![0x2A, 0, 0, 0, 0, 8, 0, 0, 1, 0],
            Some(vec![0xA5; 512]),
        ),
        (
            "SYNCHRONIZE CACHE (10)",
            vec![0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
    ]
}

/// Sends every command of [`commands`] through `p`; `refused(name)` gives the ASCQ of the
/// NOT READY, LOGICAL UNIT NOT ACCESSIBLE sense the state must answer it with, or None for GOOD.
fn check_state(p: &mut Path, state: &str, refused: impl Fn(&str) -> Option<u8>) {
    for (name, cdb, data) in commands() {
        let transfer = match data {
            Some(d) => Transfer::Write(d),
            None => read_len(1024),
        };
        let want = match refused(name) {
            Some(ascq) => (0x02, Some((0x02, 0x04, ascq))),
            None => GOOD,
        };
        assert_eq!(p.answer(&cdb, transfer), want, "{name} through {state}");
    }
}

/// What standby refuses (TARGET PORT IN STANDBY STATE, 04h/0Bh): what needs the medium.
fn standby_refuses(name: &str) -> Option<u8> {
    let medium = [
        "TEST UNIT READY",
        "READ (10)",
        "WRITE (10)",
        "SYNCHRONIZE CACHE (10)",
    ];
    medium.contains(&name).then_some(0x0B)
}

/// What unavailable refuses (TARGET PORT IN UNAVAILABLE STATE, 04h/0Ch): all but
/// identification, sense and the group reports.
fn unavailable_refuses(name: &str) -> Option<u8> {
    let answers = [
        "INQUIRY",
        "REPORT LUNS",
        "REQUEST SENSE",
        "REPORT TARGET PORT GROUPS",
    ];
    (!answers.contains(&name)).then_some(0x0C)
}

#[test]
fn active_optimized_serves_every_command() {
    let (_daemon, ports) = four_states();
    check_state(
        &mut nexus(ports[0], "iqn.2026-11.org.ferrosan:ao"),
        "AO",
        |_| None,
    );
}

#[test]
fn active_non_optimized_serves_every_command() {
    let (_daemon, ports) = four_states();
    check_state(
        &mut nexus(ports[1], "iqn.2026-11.org.ferrosan:ano"),
        "ANO",
        |_| None,
    );
}

#[test]
fn standby_answers_identification_sense_mode_reservations_and_capacity_only() {
    let (_daemon, ports) = four_states();
    check_state(
        &mut nexus(ports[2], "iqn.2026-11.org.ferrosan:sb"),
        "standby",
        standby_refuses,
    );
}

#[test]
fn unavailable_answers_identification_sense_and_group_reports_only() {
    let (_daemon, ports) = four_states();
    check_state(
        &mut nexus(ports[3], "iqn.2026-11.org.ferrosan:un"),
        "unavailable",
        unavailable_refuses,
    );
}

/// The states decide before the device is touched: the same answers from a file on disk.
#[test]
fn every_state_answers_the_same_on_a_file_on_disk() {
    let dir = common::disk_dir("alua-disk");
    let target = common::open_ram_target(IQN).replace(
        "store = \"ram\"\nsize = \"16M\"",
        &format!(
            "store = \"file\"\npath = \"{}\"\nsize = \"16M\"",
            dir.join("lu.img").display()
        ),
    );
    assert!(target.contains("store = \"file\""), "{target}");
    let (daemon, ports) = four_states_of(&target);
    check_state(
        &mut nexus(ports[0], "iqn.2026-11.org.ferrosan:d0"),
        "AO",
        |_| None,
    );
    check_state(
        &mut nexus(ports[1], "iqn.2026-11.org.ferrosan:d1"),
        "ANO",
        |_| None,
    );
    check_state(
        &mut nexus(ports[2], "iqn.2026-11.org.ferrosan:d2"),
        "standby",
        standby_refuses,
    );
    check_state(
        &mut nexus(ports[3], "iqn.2026-11.org.ferrosan:d3"),
        "unavailable",
        unavailable_refuses,
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_port_reports_every_state_and_the_implicit_states_supported() {
    let (_daemon, ports) = four_states();
    for port in ports {
        let mut p = nexus(port, "iqn.2026-11.org.ferrosan:rtpg");
        let (status, _, data) = p.run(&rtpg_cdb(), read_len(1024));
        assert_eq!(status, 0);
        assert_eq!(
            common::array::parse_rtpg(&data),
            vec![(1, 0x0), (2, 0x1), (3, 0x2), (4, 0x3)],
            "through {port}"
        );
        // AO_SUP, AN_SUP, S_SUP and U_SUP; no transitioning under implicit ALUA.
        assert!(data[4..].chunks(12).all(|d| d[1] == 0x0F), "{data:02x?}");
    }
}

#[test]
fn set_target_port_groups_is_not_offered_under_implicit_alua() {
    let (_daemon, ports) = four_states();
    // Through every state, unavailable included (it answers the group commands).
    for port in ports {
        let mut p = nexus(port, "iqn.2026-11.org.ferrosan:stpg");
        let list = vec![0, 0, 0, 0, 0x00, 0, 0, 2];
        let cdb = [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0];
        assert_eq!(
            p.answer(&cdb, Transfer::Write(list)),
            (0x02, Some((0x05, 0x20, 0x00))),
            "through {port}"
        );
    }
}

#[test]
fn a_standby_or_unavailable_group_in_the_config_is_checked() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["check-config", "/dev/stdin"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(
                format!(
                    "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\nalua_state = \"offline\"\n{}",
                    common::open_ram_target(IQN)
                )
                .as_bytes(),
            )?;
            child.wait_with_output()
        })
        .expect("check-config");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("\"standby\" or \"unavailable\""), "{text}");
}

/// SET TARGET PORT GROUPS through `p` asking `(state, group)`.
fn stpg(p: &mut Path, state: u8, group: u16) -> (u8, Option<(u8, u8, u8)>) {
    let mut list = vec![0u8; 4];
    list.extend_from_slice(&[state, 0]);
    list.extend_from_slice(&group.to_be_bytes());
    p.answer(
        &[0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0],
        Transfer::Write(list),
    )
}

const STATE_CHANGED: (u8, Option<(u8, u8, u8)>) = (0x02, Some((0x06, 0x2A, 0x06)));

/// RBD gateways report implicit ALUA by default: the gateways move the image, initiators
/// follow (Linux's ALUA handler then sends no SET TARGET PORT GROUPS when it activates a path,
/// which under explicit ALUA took the image back from a live owner when a gateway returned).
/// The explicit policy is `rbd_gateways_under_explicit_alua_never_take_from_a_live_owner`.
#[test]
fn rbd_gateways_report_implicit_alua_and_refuse_set_target_port_groups() {
    let array = Array::start(Backing::Rbd, "alua-rbd");
    let initiator = "iqn.2026-11.org.ferrosan:implicit";
    let mut on_a = array.path(0, initiator);
    let mut on_b = array.path(1, initiator);
    for p in [&mut on_a, &mut on_b] {
        p.settle();
        let (status, _, data) = p.run(&rtpg_cdb(), read_len(1024));
        assert_eq!(status, 0);
        assert_eq!(common::array::parse_rtpg(&data), vec![(1, 0x0), (2, 0x1)]);
        // AO_SUP, AN_SUP, S_SUP, T_SUP; TPGS = 01b.
        assert!(data[4..].chunks(12).all(|d| d[1] == 0x87), "{data:02x?}");
        let (_, _, inquiry) = p.run(&[0x12, 0, 0, 0, 96, 0], read_len(96));
        assert_eq!(inquiry[5] & 0x30, 0x10);
        // Not offered: INVALID COMMAND OPERATION CODE, nothing moves.
        assert_eq!(stpg(p, 0x0, 2), (0x02, Some((0x05, 0x20, 0x00))));
    }
    // Active/non-optimized serves every command (at the owner).
    check_state(&mut on_b, "ANO (gateway b)", |_| None);
    assert_eq!(on_b.write(64, &[0x3C; 512]), GOOD);
    let (status, _, data) = on_a.read(64, 1);
    assert_eq!((status, data), (0, vec![0x3C; 512]));
    assert_eq!(on_a.rtpg(), vec![(1, 0x0), (2, 0x1)]);
    assert_eq!(on_b.rtpg(), vec![(1, 0x0), (2, 0x1)]);
}

#[test]
fn a_live_state_change_tells_every_nexus_and_applies_at_once() {
    let second = free_port();
    let ctl = common::Ctl::new();
    let daemon = Daemon::start_config_args(
        IQN,
        &format!(
            "[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:{second}\"]\nalua_state = \"active-non-optimized\"\n{}",
            common::open_ram_target(IQN)
        ),
        &["--control-socket", &ctl.socket.display().to_string()],
    );
    let mut one = nexus(daemon.port, "iqn.2026-11.org.ferrosan:live1");
    let mut two = nexus(second, "iqn.2026-11.org.ferrosan:live2");
    // Maintenance of path 2's network: unavailable.
    let out = ctl.run(&["portal-group", "alua", "2", "unavailable"]);
    assert!(out.success(), "{}", out.describe());
    for p in [&mut one, &mut two] {
        assert_eq!(p.answer(&[0; 6], Transfer::None), STATE_CHANGED);
        assert_eq!(p.rtpg(), vec![(1, 0x0), (2, 0x3)]);
    }
    assert_eq!(one.read(0, 1).0, 0);
    assert_eq!(
        two.answer(&[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], read_len(512)),
        (0x02, Some((0x02, 0x04, 0x0C)))
    );
    // Asking for what is so already, an unknown group or state, a bad state: refused, nothing told.
    assert!(!ctl
        .run(&["portal-group", "alua", "2", "unavailable"])
        .success());
    assert!(!ctl.run(&["portal-group", "alua", "9", "standby"]).success());
    assert!(!ctl
        .run(&["portal-group", "alua", "2", "transitioning"])
        .success());
    assert_eq!(one.answer(&[0; 6], Transfer::None), GOOD);
    // Back, optimized this time.
    let out = ctl.run(&["portal-group", "alua", "2", "active-optimized"]);
    assert!(out.success(), "{}", out.describe());
    assert_eq!(two.answer(&[0; 6], Transfer::None), STATE_CHANGED);
    assert_eq!(two.rtpg(), vec![(1, 0x0), (2, 0x0)]);
    assert_eq!(two.read(0, 1).0, 0);
    // The same through the config file and a reload: group 1 standby.
    let file = daemon.file("ferrosan.toml");
    let text = std::fs::read_to_string(&file).expect("config");
    let text = text.replacen("tag = 1\n", "tag = 1\nalua_state = \"standby\"\n", 1);
    std::fs::write(
        &file,
        text.replace("\"active-non-optimized\"", "\"active-optimized\""),
    )
    .expect("config");
    // The ctl changes above are unsaved: a plain reload would undo them and is refused; the
    // edited file says what to run, so its changes are discarded.
    let out = ctl.run(&["reload"]);
    assert!(!out.success(), "{}", out.describe());
    let out = ctl.run(&["reload", "--discard"]);
    assert!(out.success(), "{}", out.describe());
    assert_eq!(one.answer(&[0; 6], Transfer::None), STATE_CHANGED);
    assert_eq!(
        one.answer(&[0; 6], Transfer::None),
        (0x02, Some((0x02, 0x04, 0x0B)))
    );
    assert_eq!(two.answer(&[0; 6], Transfer::None), STATE_CHANGED);
    assert_eq!(two.rtpg(), vec![(1, 0x2), (2, 0x0)]);
}
