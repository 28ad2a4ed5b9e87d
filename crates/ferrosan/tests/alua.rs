//! ALUA over the wire: a target served by two portal groups, one active/optimized and one
//! active/non-optimized. Through either portal, REPORT TARGET PORT GROUPS lists both groups with
//! their states and ports, INQUIRY says implicit ALUA, and VPD 83h names the group of the port the
//! initiator logged in through.

mod common;

use common::raw::Raw;
use common::{free_port, Daemon};

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
    groups.extend_from_slice(&[0x00, 0x03, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]);
    groups.extend_from_slice(&[0x01, 0x03, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]);
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
