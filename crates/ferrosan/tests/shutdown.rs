//! Graceful shutdown: on SIGTERM the daemon stops accepting, asks every session to log out
//! (Async Message, AsyncEvent 1), keeps serving them meanwhile, and exits once they are gone
//! or `shutdown_grace_s` has passed; a second signal exits at once.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::raw::{self, Raw};
use common::Daemon;
use iscsi::pdu::{off, Opcode};

const IQN: &str = "iqn.2024-01.dev.ferrosan:shutdown";

fn daemon(grace_s: u32) -> Daemon {
    Daemon::start_config(
        IQN,
        &format!(
            "[limits]\nshutdown_grace_s = {grace_s}\n{}",
            common::open_ram_target(IQN)
        ),
    )
}

/// The next PDU must be the logout request: AsyncEvent 1 with `grace_s` in Parameter3.
fn expect_logout_request(client: &mut Raw, grace_s: u16) {
    let pdu = client.recv();
    assert_eq!(
        pdu.opcode(),
        Opcode::AsyncMessage as u8,
        "expected an Async Message, got {:?}",
        pdu.bhs
    );
    assert_eq!(
        pdu.bhs.byte(off::ASYNC_EVENT),
        1,
        "AsyncEvent 1: target requests logout"
    );
    assert_eq!(pdu.bhs.u16_at(off::PARAMETER3), grace_s, "Parameter3");
}

fn logout(client: &mut Raw, itt: u32) {
    let mut bhs = client.header(Opcode::LogoutRequest, itt);
    bhs.set_immediate(true);
    client.send(&bhs, &[]);
    let pdu = client.recv();
    assert_eq!(pdu.opcode(), Opcode::LogoutResponse as u8);
    assert_eq!(
        pdu.bhs.byte(off::RESPONSE),
        0,
        "logout response: closed successfully"
    );
}

#[test]
fn sigterm_asks_sessions_to_log_out_serves_them_and_exits_when_they_have() {
    let mut daemon = daemon(10);
    let mut client = Raw::login(daemon.port, IQN, 1);
    client.ping(1);
    daemon.signal("TERM");
    expect_logout_request(&mut client, 10);
    // Still served, and the listener is closed to newcomers.
    client.ping(2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", daemon.port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "still accepting connections after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    logout(&mut client, 3);
    assert!(raw::until_closed(&mut client.stream).is_empty());
    let status = daemon
        .wait_exit(Duration::from_secs(5))
        .expect("daemon still running after its last session logged out");
    assert!(status.success(), "exit status {status:?}");
    let log = daemon.output();
    assert!(log.contains("SIGTERM: shutting down"), "{log}");
    assert!(log.contains("every session closed"), "{log}");
}

#[test]
fn a_session_that_does_not_log_out_is_closed_when_the_grace_ends() {
    let mut daemon = daemon(1);
    let mut client = Raw::login(daemon.port, IQN, 1);
    let started = Instant::now();
    daemon.signal("TERM");
    expect_logout_request(&mut client, 1);
    // Ignore it: the target closes the connection after a second.
    assert!(raw::until_closed(&mut client.stream).is_empty());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "closed after {waited:?}, grace 1 s"
    );
    // An initiator that sends on before it notices meets a target still reading (and dropping)
    // what comes, not a reset (`Conn::linger`).
    for i in 0..3 {
        let sent = std::io::Write::write_all(&mut client.stream, &[0u8; 48]);
        assert!(sent.is_ok(), "PDU {i} after the close: {sent:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = daemon
        .wait_exit(Duration::from_secs(3))
        .expect("daemon still running after the grace");
    assert!(status.success(), "exit status {status:?}");
    assert!(
        daemon.output().contains("no logout within 1 s"),
        "{}",
        daemon.output()
    );
}

#[test]
fn a_second_signal_exits_at_once() {
    let mut daemon = daemon(60);
    let mut client = Raw::login(daemon.port, IQN, 1);
    daemon.signal("INT");
    expect_logout_request(&mut client, 60);
    daemon.signal("INT");
    let status = daemon
        .wait_exit(Duration::from_secs(3))
        .expect("daemon still draining after a second SIGINT");
    assert!(
        !status.success(),
        "a cut-short drain reports failure: {status:?}"
    );
}

#[test]
fn with_no_session_sigterm_exits_promptly() {
    let mut daemon = daemon(10);
    daemon.signal("TERM");
    let status = daemon
        .wait_exit(Duration::from_secs(2))
        .expect("an idle daemon did not exit within 2 s of SIGTERM");
    assert!(status.success(), "exit status {status:?}");
}

/// A restart under load with a real initiator: qemu-img (libiscsi) is writing when SIGTERM
/// arrives; it logs out as asked, reconnects to the restarted daemon, finishes its run, and
/// every write it was acknowledged is in the LUN file.
#[test]
fn qemu_img_logs_out_and_finishes_its_writes_after_a_restart() {
    // On a disk filesystem, with the default write-through cache, a 512-byte write takes tens
    // of microseconds: 60,000 of them last seconds, so the logout request (sent within a second
    // of SIGTERM) lands mid-run.
    const WRITES: usize = 60_000;
    const SIZE: usize = 512;
    const PATTERN: u8 = 0x5a;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("shutdown-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir under CARGO_TARGET_TMPDIR");
    let lun_path = dir.join("lun.img");
    let mut daemon = Daemon::start_with(IQN, &[&format!("file:{},size=128M", lun_path.display())]);
    let url = daemon.url(0);
    let writer = std::thread::spawn(move || {
        common::run(
            "qemu-img",
            &[
                "bench",
                "-w",
                "-t",
                "none",
                "-f",
                "raw",
                "-c",
                &WRITES.to_string(),
                "-d",
                "16",
                "-s",
                &SIZE.to_string(),
                "--pattern",
                &PATTERN.to_string(),
                &url,
            ],
        )
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !daemon.output().contains("session established") {
        assert!(Instant::now() < deadline, "qemu-img never logged in");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    daemon.signal("TERM");
    let status = daemon
        .wait_exit(Duration::from_secs(12))
        .expect("daemon still running after the grace");
    let first_log = daemon.output();
    assert!(status.success(), "exit status {status:?}:\n{first_log}");
    assert!(
        first_log.contains("asked the initiator to log out")
            && first_log.contains("every session closed"),
        "{first_log}"
    );
    assert!(
        !writer.is_finished(),
        "qemu-img finished before SIGTERM: raise WRITES"
    );
    daemon.restart();
    let run = writer.join().expect("writer thread");
    assert!(run.success(), "{}", run.describe());
    assert!(
        daemon.output().contains("session established"),
        "qemu-img did not reconnect:\n{}",
        daemon.output()
    );
    let data = std::fs::read(&lun_path).expect("read the LUN file");
    let written = &data[..WRITES * SIZE];
    let wrong = written.iter().filter(|&&b| b != PATTERN).count();
    assert_eq!(
        wrong,
        0,
        "{wrong} bytes of {} were not written",
        written.len()
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
}
