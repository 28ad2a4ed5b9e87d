//! Hostile clients never disturb a good one.
//!
//! One daemon; a well-behaved initiator (qemu-img: convert a random image onto the LUN, then
//! compare it back, in a loop) runs while raw-socket clients misbehave in parallel: garbage
//! bytes, a 16 MiB data segment, half a PDU and a stall, unknown opcodes, Data-Out for an unknown
//! task, CmdSN outside the window, a duplicate ITT, a Login PDU in full feature phase, and a flood
//! of 200 connections from another loopback address. Each hostile connection must get the RFC
//! 7143 answer (Reject, an error Login Response, or a closed connection); the daemon must stay up;
//! every byte the good client wrote must verify.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::raw::{connect, login_request, login_text, until_closed, Raw};
use common::{pseudo_random_bytes, run, Daemon, Scratch};
use iscsi::pdu::{off, Bhs, Opcode};

const IMAGE_BYTES: usize = 4 << 20;

// ---- the hostile clients -----------------------------------------------------------------------

/// Pseudo-random bytes with the first header's length fields cleared, so the daemon sees one
/// complete PDU (of a random opcode) at once instead of waiting for a random data length.
fn garbage(port: u16) {
    let mut stream = connect(port);
    let mut bytes = pseudo_random_bytes(4096, 0xbad_5eed);
    bytes[0] = 0x3c; // not an initiator opcode
    bytes[4..8].fill(0);
    stream.write_all(&bytes).expect("send garbage");
    for pdu in until_closed(&mut stream) {
        assert_eq!(pdu.opcode(), Opcode::LoginResponse as u8, "{:?}", pdu.bhs);
        assert_ne!(pdu.bhs.byte(off::STATUS_CLASS), 0, "garbage logged in");
    }
}

/// A Login Request whose BHS announces 16 MiB - 1 of data (the login limit is 8 KiB).
fn huge_segment(port: u16) {
    let mut stream = connect(port);
    let mut bhs = login_request(0x01, b"");
    bhs.set_data_segment_len(iscsi::pdu::DATA_SEGMENT_LEN_MAX);
    stream.write_all(&bhs.0).unwrap();
    stream.write_all(&[b'A'; 4096]).unwrap();
    for pdu in until_closed(&mut stream) {
        let op = pdu.opcode();
        assert!(
            op == Opcode::LoginResponse as u8 && pdu.bhs.byte(off::STATUS_CLASS) != 0
                || op == Opcode::Reject as u8,
            "16 MiB segment answered by {:?}",
            pdu.bhs
        );
    }
}

/// Half a BHS, then silence: the daemon must simply wait (until its login timeout).
fn half_pdu(port: u16) -> TcpStream {
    let mut stream = connect(port);
    let text = login_text(common::IQN, "");
    let bhs = login_request(0x02, &text);
    stream.write_all(&bhs.0[..20]).unwrap();
    stream
}

/// Full-feature misbehaviour on one logged-in session; the session survives all of it.
fn misbehave_after_login(port: u16, iqn: &str) {
    let mut c = Raw::login(port, iqn, 0x03);
    c.ping(0x10);

    // Unknown opcode: Reject, Command not supported (RFC 7143 §11.17.1).
    let mut bhs = c.header(Opcode::NopOut, 0x11);
    bhs.0[0] = 0x1c;
    c.send(&bhs, &[]);
    c.expect_reject(0x05, &bhs, 0, "unknown opcode");
    c.ping(0x12);

    // Data-Out for a task that does not exist (with a TTT the target never gave).
    let mut bhs = Bhs::new(Opcode::DataOut);
    bhs.set_flags(0x80);
    bhs.set_itt(0xdead);
    bhs.set_u32(off::TTT, 0x7777);
    bhs.set_u32(off::EXP_STAT_SN, c.exp_stat_sn);
    c.send(&bhs, &[0u8; 512]);
    c.expect_reject(0x09, &bhs, 512, "Data-Out for an unknown task");
    c.ping(0x13);

    // CmdSN far outside the window: silently dropped (RFC 7143 §4.2.2.1); the next in-window
    // command is answered and the dropped one never is.
    let mut bhs = c.header(Opcode::NopOut, 0x14);
    bhs.set_u32(off::TTT, 0xffff_ffff);
    bhs.set_u32(off::CMD_SN, c.cmd_sn.wrapping_add(100_000));
    c.send(&bhs, &[]);
    c.ping(0x15);

    // Duplicate ITT: a write waiting for its data (R2T), then another command with its ITT.
    let mut bhs = c.header(Opcode::ScsiCommand, 0x16);
    bhs.set_flags(0x80 | 0x20); // F, W
    bhs.set_u32(off::EDTL, 4096);
    let mut cdb = [0u8; 16];
    cdb[0] = 0x2a; // WRITE(10) of 8 blocks at LBA 100000 (beyond the good client's image)
    cdb[2..6].copy_from_slice(&100_000u32.to_be_bytes());
    cdb[8] = 8;
    bhs.0[off::CDB..off::CDB + 16].copy_from_slice(&cdb);
    c.send(&bhs, &[]);
    c.cmd_sn = c.cmd_sn.wrapping_add(1);
    let r2t = c.recv();
    assert_eq!(
        r2t.opcode(),
        Opcode::R2t as u8,
        "write without data: {:?}",
        r2t.bhs
    );
    assert_eq!(r2t.bhs.itt(), 0x16);
    let mut dup = c.header(Opcode::ScsiCommand, 0x16);
    dup.set_byte(off::CDB, 0x00); // TEST UNIT READY with the busy ITT
    c.send(&dup, &[]);
    c.cmd_sn = c.cmd_sn.wrapping_add(1);
    c.expect_reject(0x07, &dup, 0, "duplicate ITT");
    c.ping(0x17);

    // A Login Request in full feature phase: Reject, Protocol error.
    let text = login_text(iqn, "");
    let mut bhs = login_request(0x03, &text);
    bhs.set_u32(off::CMD_SN, c.cmd_sn);
    c.send(&bhs, &text);
    c.expect_reject(0x04, &bhs, text.len(), "login in full feature phase");
    c.ping(0x18);
}

/// Opens `n` connections from `source` (another loopback address) and holds them. Returns them
/// and how many the daemon closed at once (the per-source limit is 64 by default).
fn flood(port: u16, source: &str, n: usize) -> (Vec<TcpStream>, usize) {
    let mut held: Vec<TcpStream> = (0..n).map(|_| connect_from(source, port)).collect();
    thread::sleep(Duration::from_millis(1500));
    let closed = closed(&mut held);
    (held, closed)
}

/// A connection to the daemon on 127.0.0.1:`port` from `source` (another loopback address).
fn connect_from(source: &str, port: u16) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let local: SocketAddr = format!("{source}:0").parse().unwrap();
    let remote: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket
        .bind(&local.into())
        .unwrap_or_else(|e| panic!("bind to {source}: {e}"));
    socket
        .connect(&remote.into())
        .unwrap_or_else(|e| panic!("connect from {source}: {e}"));
    TcpStream::from(socket)
}

// ---- the good client ---------------------------------------------------------------------------

fn good_client(daemon_url: String, image: String, stop: Arc<AtomicBool>) -> usize {
    let mut rounds = 0;
    while rounds < 2 || !stop.load(Ordering::SeqCst) {
        let out = common::convert_to(&daemon_url, &image);
        assert!(
            out.success(),
            "good client's upload failed:\n{}",
            out.describe()
        );
        let out = run(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", &image, &daemon_url],
        );
        assert!(
            out.success() && out.stdout.contains("Images are identical"),
            "good client's data differs:\n{}",
            out.describe()
        );
        rounds += 1;
        if rounds >= 20 {
            break;
        }
    }
    rounds
}

#[test]
fn hostile_clients_do_not_disturb_a_good_one() {
    let started = Instant::now();
    let scratch = Scratch::new("hostile");
    let image = scratch.file("image.raw");
    std::fs::write(&image, pseudo_random_bytes(IMAGE_BYTES, 0x0051_1e47)).unwrap();
    let mut daemon = Daemon::start(&["ram:64M"]);
    let port = daemon.port;
    let iqn = daemon.iqn.clone();

    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let (url, image, stop) = (daemon.url(0), image.display().to_string(), stop.clone());
        thread::spawn(move || good_client(url, image, stop))
    };

    let stalled = half_pdu(port);
    let (flooded, refused) = flood(port, "127.0.0.2", 200);
    let hostile: Vec<thread::JoinHandle<()>> = vec![
        thread::spawn(move || garbage(port)),
        thread::spawn(move || huge_segment(port)),
        thread::spawn(move || misbehave_after_login(port, &iqn)),
    ];
    let mut failures = Vec::new();
    for h in hostile {
        if let Err(e) = h.join() {
            failures.push(
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default(),
            );
        }
    }
    // Everything hostile happened while the good client kept working.
    stop.store(true, Ordering::SeqCst);
    let rounds = good.join();
    assert!(
        daemon.alive(),
        "the daemon died; its output:\n{}",
        daemon.output()
    );
    assert!(
        failures.is_empty(),
        "hostile clients got wrong answers: {failures:#?}\n--- daemon output\n{}",
        daemon.output()
    );
    let rounds =
        rounds.unwrap_or_else(|_| panic!("good client failed; daemon:\n{}", daemon.output()));
    assert!(rounds >= 2);
    // The per-source limit (64 by default) refused the rest of the flood at once.
    assert!(
        refused >= 200 - 64,
        "only {refused} of 200 flood connections from one source were refused"
    );
    assert!(refused < 200, "every flood connection was refused");
    drop(flooded);
    drop(stalled);
    assert!(daemon.alive());
    eprintln!(
        "good client: {rounds} verified rounds of {} MiB; {refused}/200 flood connections refused; {:?}",
        IMAGE_BYTES >> 20,
        started.elapsed()
    );
    daemon.stop();
}

/// A Data-Out whose long payload stops arriving: the target, reading it straight into the
/// command's buffer, drops the connection within its dead-peer bound (nop_in_interval_s +
/// nop_in_timeout_s, at least 5 s for the latter), and another session on the same (only) worker
/// is served meanwhile.
#[test]
fn a_sender_stalled_inside_a_long_data_out_is_dropped_and_others_carry_on() {
    const IQN_S: &str = "iqn.2024-01.dev.ferrosan:stalled";
    let daemon = Daemon::start_config(
        IQN_S,
        &format!(
            "[server]\nworkers = 1\n[limits]\nnop_in_interval_s = 1\nnop_in_timeout_s = 1\n{}",
            common::open_ram_target(IQN_S)
        ),
    );
    let mut stalled = Raw::login(daemon.port, IQN_S, 1);
    let mut other = Raw::login(daemon.port, IQN_S, 2);
    // WRITE(10) of 1 MiB without immediate data: the target asks for it with an R2T (a unit
    // attention first answers the write itself; the second write gets the R2T).
    let write = [0x2a, 0, 0, 0, 0, 0, 0, 0x08, 0, 0];
    for itt in 1..=2u32 {
        let cmd = stalled.command(itt, &write, 0xa1, 1 << 20);
        stalled.send(&cmd, &[]);
        let answer = stalled.recv();
        if answer.opcode() == Opcode::R2t as u8 {
            let mut data_out = Bhs::new(Opcode::DataOut);
            data_out.set_itt(itt);
            data_out.set_u32(off::TTT, answer.bhs.u32_at(off::TTT));
            data_out.set_u32(off::EXP_STAT_SN, stalled.exp_stat_sn);
            data_out.set_data_segment_len(256 * 1024);
            // The header and 1,000 of the 262,144 bytes it announces; then nothing.
            let mut bytes = data_out.0.to_vec();
            bytes.extend_from_slice(&[7u8; 1000]);
            stalled
                .stream
                .write_all(&bytes)
                .expect("send partial Data-Out");
            break;
        }
        assert_eq!(
            answer.opcode(),
            Opcode::ScsiResponse as u8,
            "unit attention first"
        );
    }
    let started = Instant::now();
    // The other session is answered while the stalled one waits.
    other.ping(100);
    // Dropped within the bound (1 + 5 s), answered by nothing but the close.
    stalled
        .stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut buf = [0u8; 64];
    let closed = loop {
        match stalled.stream.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue, // a NOP-In or a rejection before the close is fine
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                break false
            }
            Err(_) => break true, // reset
        }
    };
    let waited = started.elapsed();
    assert!(closed, "still open after {waited:?}");
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_secs(12),
        "dropped after {waited:?}, expected about 6 s"
    );
    // (`other` does not answer the target's pings, so with these limits it is closed as a dead
    // peer soon after: not checked further.)
}

/// Opens `per_source` idle connections (they never send a Login Request) from each of
/// 127.0.0.2..=127.0.0.21 and holds them.
fn prelogin_flood(port: u16, per_source: usize) -> Vec<TcpStream> {
    (0..per_source)
        .flat_map(|_| 2..=21u8)
        .map(|source| connect_from(&format!("127.0.0.{source}"), port))
        .collect()
}

/// How many of `held` the daemon has closed.
fn closed(held: &mut [TcpStream]) -> usize {
    held.iter_mut()
        .filter(|s| {
            let mut s: &TcpStream = s;
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => true,
                Err(e) => e.kind() != ErrorKind::WouldBlock,
                Ok(_) => panic!("the daemon sent bytes to a connection that sent none"),
            }
        })
        .count()
}

/// A good initiator's login and INQUIRY (iscsi-inq from 127.0.0.1); how long it took.
fn good_login(daemon: &Daemon) -> Duration {
    let started = Instant::now();
    let out = run("iscsi-inq", &[&daemon.url(0)]);
    let took = started.elapsed();
    assert!(
        out.success(),
        "the good initiator could not log in during the flood:\n{}\n--- daemon\n{}",
        out.describe(),
        daemon.output()
    );
    took
}

#[test]
fn connections_that_never_log_in_cannot_lock_out_those_that_do() {
    // Defaults: max_connections 1024, 256 of them for connections still logging in. 20
    // sources x 20 idle connections = 400: more than the pre-login budget.
    let mut daemon = Daemon::start(&["ram:16M"]);
    let mut session = Raw::login(daemon.port, &daemon.iqn, 7);
    let mut held = prelogin_flood(daemon.port, 20);
    let took = good_login(&daemon);
    thread::sleep(Duration::from_millis(300));
    let evicted = closed(&mut held);
    assert!(
        evicted >= 400 - 256,
        "only {evicted} of 400 idle connections were evicted"
    );
    // The session logged in before the flood was never a candidate.
    session.ping(1);
    assert!(took < Duration::from_secs(1), "good login took {took:?}");
    eprintln!("pre-login budget: good login in {took:?} with 400 idle connections open, {evicted} evicted");
    drop(held);

    // max_connections binds before the pre-login budget does: at the limit, a connection still
    // logging in makes room.
    let body = r#"
[limits]
max_connections = 100

[[device]]
name = "d"
store = "ram"
size = "16M"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:flood"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "d" } ]
"#;
    let mut small = Daemon::start_config_args("iqn.2026-11.org.ferrosan:flood", body, &[]);
    let mut held = prelogin_flood(small.port, 10);
    let took = good_login(&small);
    assert!(took < Duration::from_secs(1), "good login took {took:?}");
    thread::sleep(Duration::from_millis(300));
    assert!(
        closed(&mut held) >= 100,
        "the flood kept its place at max_connections"
    );
    eprintln!("max_connections 100: good login in {took:?} with 200 idle connections attempted");
    drop(held);
    assert!(daemon.alive() && small.alive());
    daemon.stop();
    small.stop();
}
