//! Persistent reservations with APTPL survive a restart of the daemon, by SIGTERM and by
//! SIGKILL: an initiator registers and reserves with APTPL=1, the daemon goes away and comes
//! back on the same file and state directory, and the registration, the reservation and its
//! enforcement are all there. A damaged state file fences its device alone, naming the file;
//! registrations are bounded, so the saved state always loads.

mod common;

use std::time::Duration;

use common::raw::{status_of, Raw};
use common::{Daemon, Scratch};
use iscsi::pdu::Opcode;

const IQN: &str = "iqn.2026-11.org.ferrosan:aptpl";
const RESERVATION_CONFLICT: u8 = 0x18;

fn prout(sa: u8, pr_type: u8) -> [u8; 10] {
    [0x5F, sa, pr_type, 0, 0, 0, 0, 0, 24, 0]
}

fn prout_params(key: u64, sa_key: u64, aptpl: bool) -> Vec<u8> {
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p[20] = u8::from(aptpl);
    p
}

/// Sends a command with `data` as immediate data; its status.
fn run(raw: &mut Raw, itt: &mut u32, cdb: &[u8], data: &[u8]) -> u8 {
    let flags = if data.is_empty() { 0x80 } else { 0x80 | 0x20 };
    let bhs = raw.command(*itt, cdb, flags, data.len() as u32);
    *itt += 1;
    raw.send(&bhs, data);
    let pdu = raw.recv();
    assert_eq!(pdu.opcode(), Opcode::ScsiResponse as u8, "{:?}", pdu.bhs);
    status_of(&pdu)
}

/// PERSISTENT RESERVE IN with service action `sa`; its data.
fn prin(raw: &mut Raw, itt: &mut u32, sa: u8) -> Vec<u8> {
    let cdb = [0x5E, sa, 0, 0, 0, 0, 0, 0x01, 0, 0];
    let bhs = raw.command(*itt, &cdb, 0x80 | 0x40, 256);
    *itt += 1;
    raw.send(&bhs, &[]);
    raw.read_data()
}

fn login(daemon: &Daemon, isid_tail: u8) -> (Raw, u32) {
    let mut raw = Raw::login(daemon.port, IQN, isid_tail);
    let mut itt = 1;
    raw.until_ready(&mut itt);
    (raw, itt)
}

/// What the state says after a restart: key 0xAA registered, reserved Write Exclusive by it,
/// APTPL active; another initiator port may read but not write.
fn assert_reserved(daemon: &Daemon, when: &str) {
    let (mut a, mut itt) = login(daemon, 1);
    let keys = prin(&mut a, &mut itt, 0);
    assert_eq!(
        &keys[4..8],
        &8u32.to_be_bytes(),
        "{when}: one key: {keys:02x?}"
    );
    assert_eq!(&keys[8..16], &0xAAu64.to_be_bytes(), "{when}");
    let reservation = prin(&mut a, &mut itt, 1);
    assert_eq!(&reservation[4..8], &16u32.to_be_bytes(), "{when}: reserved");
    assert_eq!(&reservation[8..16], &0xAAu64.to_be_bytes(), "{when}");
    assert_eq!(reservation[21] & 0x0F, 1, "{when}: Write Exclusive");
    let caps = prin(&mut a, &mut itt, 2);
    assert_eq!(caps[2] & 0x01, 1, "{when}: PTPL_C");
    assert_eq!(caps[3] & 0x01, 1, "{when}: PTPL_A");
    // The holder writes; another initiator port reads but may not write.
    let write = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    assert_eq!(run(&mut a, &mut itt, &write, &[7; 512]), 0, "{when}");
    let (mut b, mut itt_b) = login(daemon, 2);
    assert_eq!(
        run(&mut b, &mut itt_b, &write, &[8; 512]),
        RESERVATION_CONFLICT,
        "{when}: the reservation is enforced"
    );
}

#[test]
fn aptpl_reservations_survive_sigterm_and_sigkill() {
    let scratch = Scratch::new("aptpl");
    let lun = format!("file:{},size=4M", scratch.file("lun.img").display());
    let state = scratch.file("state");
    let state_arg = state.display().to_string();
    let mut daemon = Daemon::start_with_args(IQN, &[&lun], &["--state-dir", &state_arg]);

    let (mut a, mut itt) = login(&daemon, 1);
    // REGISTER AND IGNORE EXISTING KEY with APTPL=1, then RESERVE Write Exclusive.
    assert_eq!(
        run(&mut a, &mut itt, &prout(6, 0), &prout_params(0, 0xAA, true)),
        0
    );
    assert_eq!(
        run(
            &mut a,
            &mut itt,
            &prout(1, 1),
            &prout_params(0xAA, 0, false)
        ),
        0
    );
    drop(a);
    let saved = std::fs::read_dir(state.join("reservations"))
        .expect("the state was saved")
        .count();
    assert_eq!(saved, 1);

    daemon.restart(); // SIGTERM
    assert_reserved(&daemon, "after SIGTERM");

    daemon.signal("KILL");
    assert!(daemon.wait_exit(Duration::from_secs(5)).is_some(), "killed");
    daemon.restart();
    assert_reserved(&daemon, "after SIGKILL");

    // Releasing and unregistering is saved too: after a restart nothing is left.
    let (mut a, mut itt) = login(&daemon, 1);
    assert_eq!(
        run(
            &mut a,
            &mut itt,
            &prout(2, 1),
            &prout_params(0xAA, 0, false)
        ),
        0
    );
    assert_eq!(
        run(&mut a, &mut itt, &prout(0, 0), &prout_params(0xAA, 0, true)),
        0
    );
    drop(a);
    daemon.restart();
    let (mut a, mut itt) = login(&daemon, 1);
    let keys = prin(&mut a, &mut itt, 0);
    assert_eq!(&keys[4..8], &0u32.to_be_bytes(), "no keys: {keys:02x?}");
    drop(a);
    daemon.stop();

    // A damaged state file: that device alone is fenced (NOT READY, MANUAL INTERVENTION
    // REQUIRED), named in the log; the daemon and its other devices serve.
    let file = the_state_file(&state);
    std::fs::write(&file, "not = [valid").unwrap();
    let daemon = Daemon::start_with_args(IQN, &[&lun, "ram:4M"], &["--state-dir", &state_arg]);
    let mut fenced = client(daemon.port, 0, 1);
    let tur = fenced.test_unit_ready().expect("answered");
    let sense = tur.expect_err("a fenced device is not ready").sense;
    assert_eq!(
        sense.map(|s| (s.key, s.asc, s.ascq)),
        Some((0x02, 0x04, 0x03)),
        "NOT READY, MANUAL INTERVENTION REQUIRED"
    );
    let mut other = client(daemon.port, 1, 2);
    other
        .test_unit_ready()
        .expect("answered")
        .expect("the other device serves");
    let log = daemon.output();
    assert!(
        log.contains(&*file.to_string_lossy()) && log.contains("MANUAL INTERVENTION"),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "not = [valid",
        "the damaged file is left for the operator"
    );
}

/// The one reservation file of the state directory `state`.
fn the_state_file(state: &std::path::Path) -> std::path::PathBuf {
    let mut files = std::fs::read_dir(state.join("reservations")).expect("the state was saved");
    let file = files
        .next()
        .expect("a state file")
        .expect("readable")
        .path();
    assert!(files.next().is_none(), "one state file");
    file
}

/// A session of the `initiator` crate on LUN `lun` with ISID tail `isid_tail`, past the
/// unit attentions of a new nexus (a not-ready LU's answer is left for the caller).
fn client(port: u16, lun: u64, isid_tail: u8) -> initiator::driver::Client {
    let mut s = initiator::SessionConfig::new(
        "iqn.2026-11.test:pr",
        initiator::SessionKind::Normal {
            target_name: IQN.into(),
        },
    );
    s.isid[5] = isid_tail;
    let mut c = initiator::ClientConfig::new(format!("127.0.0.1:{port}"), s);
    c.lun = lun;
    let mut client = initiator::driver::Client::connect(c).expect("login");
    for _ in 0..4 {
        match client.test_unit_ready().expect("answered") {
            Err(e) if e.is_unit_attention() => continue,
            _ => break,
        }
    }
    client
}

/// Initiators logging in with ever new ISIDs and registering each with APTPL=1 cannot grow
/// the saved state past what loads: one node gets 32 places, registration 257 of all gets
/// INSUFFICIENT REGISTRATION RESOURCES, the file stays small, and a restart loads it with the
/// 256 registrations; `ctl device clear-reservations` then frees every place.
#[test]
fn registrations_are_bounded_and_their_state_always_loads() {
    let scratch = Scratch::new("pr-bound");
    let lun = format!("file:{},size=4M", scratch.file("lun.img").display());
    let state = scratch.file("state");
    let state_arg = state.display().to_string();
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let mut daemon = Daemon::start_with_args(
        IQN,
        &[&lun],
        &["--state-dir", &state_arg, "--control-socket", &socket],
    );
    // The documented bounds (CONFIG.md, *State directory*; scsi::REGISTRATIONS_MAX and
    // REGISTRATIONS_PER_NODE_MAX).
    let (max, per_node) = (256u16, 32u16);
    let register = |daemon: &Daemon, node: u16, n: u16| {
        // Long initiator names, as in the report (223 bytes is the most a name may have).
        let name = format!("iqn.2026-11.test:{}{node:03}", "x".repeat(197));
        let mut s = initiator::SessionConfig::new(
            name,
            initiator::SessionKind::Normal {
                target_name: IQN.into(),
            },
        );
        s.isid[4..6].copy_from_slice(&n.to_be_bytes());
        let c = initiator::ClientConfig::new(format!("127.0.0.1:{}", daemon.port), s);
        let mut client = initiator::driver::Client::connect(c).expect("login");
        let cdb = initiator::scsi::Cdb::new(&prout(6, 0)).unwrap();
        let params = prout_params(0, 0x1000 + u64::from(n), true);
        let mut result = None;
        for _ in 0..4 {
            let r = client
                .command(cdb, initiator::session::Transfer::Write(params.clone()))
                .expect("PERSISTENT RESERVE OUT answered");
            let ua = r.sense.as_ref().is_some_and(|s| s.key == 0x06);
            result = Some(r);
            if !ua {
                break;
            }
        }
        let r = result.unwrap();
        (r.status, r.sense.map(|s| (s.key, s.asc, s.ascq)))
    };
    let refused = (0x02, Some((0x05, 0x55, 0x04)));
    for n in 0..max {
        assert_eq!(
            register(&daemon, n / per_node, n),
            (0, None),
            "registration {n}"
        );
    }
    assert_eq!(register(&daemon, 0, max), refused, "a node's 33rd");
    assert_eq!(register(&daemon, 99, max), refused, "the LU's 257th");
    let file = the_state_file(&state);
    let bytes = std::fs::metadata(&file).unwrap().len();
    assert!(bytes < 1 << 20, "{bytes} bytes");
    let log = daemon.output();
    assert!(log.contains("INSUFFICIENT RESOURCES"), "{log}");
    daemon.restart();
    let log = daemon.output();
    assert!(
        log.contains(&format!(
            "restored persistent reservations ({max} registrations"
        )),
        "{log}"
    );
    let cleared = ctl.json(&["device", "clear-reservations", "lun0"]);
    assert_eq!(
        cleared["registrations_cleared"],
        u64::from(max),
        "{cleared}"
    );
    assert_eq!(
        register(&daemon, 99, max),
        (0, None),
        "a place is free again"
    );
    let r = ctl.run(&["device", "clear-reservations", "nope"]);
    assert!(
        !r.success() && r.stderr.contains("no device nope"),
        "{}",
        r.describe()
    );
}

#[test]
fn ram_luns_refuse_aptpl() {
    let mut daemon = Daemon::start_with(IQN, &["ram:4M"]);
    let (mut a, mut itt) = login(&daemon, 1);
    // CHECK CONDITION (INVALID FIELD IN PARAMETER LIST), and PTPL_C=0.
    assert_eq!(
        run(&mut a, &mut itt, &prout(6, 0), &prout_params(0, 0xAA, true)),
        0x02
    );
    let caps = prin(&mut a, &mut itt, 2);
    assert_eq!(caps[2] & 0x01, 0);
    daemon.stop();
}
