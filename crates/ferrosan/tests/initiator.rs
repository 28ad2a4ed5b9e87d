//! The `initiator` crate against real targets: the ferrosan daemon (login with and without
//! CHAP, discovery, data written and read back, QD32 pipelining, unit attentions, reconnect
//! after a restart, timeouts on a silent target) and tgt (`tgtd`, login without auth and with
//! CHAP one-way and mutual, write and read).

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::tgt::{Tgt, TGT_IQN};
use common::{pseudo_random_bytes, Daemon, IQN};
use initiator::driver::{self, Client, Connection};
use initiator::error::{AuthError, CommandError, Error, LoginError};
use initiator::scsi;
use initiator::session::{Command, Tmf};
use initiator::{Auth, ChapConfig, ClientConfig, SessionConfig, SessionKind};

const INITIATOR: &str = "iqn.2024-01.dev.ferrosan:initiator-crate";

fn config(port: u16, target: &str, lun: u64) -> ClientConfig {
    let mut s = SessionConfig::new(
        INITIATOR,
        SessionKind::Normal {
            target_name: target.into(),
        },
    );
    s.command_timeout = Duration::from_secs(10);
    let mut c = ClientConfig::new(format!("127.0.0.1:{port}"), s);
    c.lun = lun;
    c.timeouts.login = Duration::from_secs(5);
    c
}

fn chap(config: &mut ClientConfig, chap: ChapConfig) {
    config.session.auth = Auth::Chap(chap);
}

/// Clears the unit attentions a fresh nexus starts with (power on / reset).
fn settle(client: &mut Client) {
    for _ in 0..8 {
        match client.test_unit_ready().expect("TEST UNIT READY") {
            Ok(()) => return,
            Err(e) => assert!(e.is_unit_attention(), "{e:?}"),
        }
    }
    panic!("unit attentions never cleared");
}

/// Writes a pattern, reads it back, and checks the other helpers on LUN `config.lun`.
fn write_read_verify(config: ClientConfig, expect_bytes: Option<u64>) {
    let mut client = Client::connect(config).expect("login");
    settle(&mut client);
    let cap = client.read_capacity().unwrap().expect("READ CAPACITY(16)");
    if let Some(bytes) = expect_bytes {
        assert_eq!(cap.bytes(), bytes, "{cap:?}");
    }
    let bs = cap.block_size as usize;
    // 1 MiB: many PDUs, immediate data, R2Ts and several bursts whatever the target's limits.
    let data = pseudo_random_bytes(1 << 20, 7);
    let lba = 8;
    client.write(lba, &data).unwrap().expect("WRITE");
    client
        .synchronize_cache()
        .unwrap()
        .expect("SYNCHRONIZE CACHE");
    let back = client
        .read(lba, (data.len() / bs) as u32)
        .unwrap()
        .expect("READ");
    assert!(back == data, "read back differs");
    let small = client.read(0, 1).unwrap().expect("READ one block");
    assert_eq!(small.len(), bs);
    client.logout().expect("logout");
}

#[test]
fn login_without_auth_writes_and_reads_back() {
    let daemon = Daemon::start(&["ram:16M"]);
    let mut client = Client::connect(config(daemon.port, IQN, 0)).expect("login");
    let n = client.connection().unwrap().session().negotiated().clone();
    assert!(
        n.tsih != 0 && n.max_xmit_data_segment_length >= 512,
        "{n:?}"
    );
    settle(&mut client);
    let inq = client.inquiry().unwrap().expect("INQUIRY");
    assert_eq!(inq.vendor, "FERROSAN", "{inq:?}");
    assert_eq!(client.report_luns().unwrap().expect("REPORT LUNS"), vec![0]);
    client.logout().unwrap();
    write_read_verify(config(daemon.port, IQN, 0), Some(16 << 20));
    // Digests on both ways.
    let mut c = config(daemon.port, IQN, 0);
    c.session.header_digest = initiator::DigestChoice::Crc32c;
    c.session.data_digest = initiator::DigestChoice::Crc32c;
    write_read_verify(c, None);
}

const CHAP_TARGET: &str = "iqn.2024-01.dev.ferrosan:chap";
const USER: &str = "alice";
const SECRET: &str = "alice-secret-2026";
const TARGET_USER: &str = "ferrosan-target";
const TARGET_SECRET: &str = "target-secret-2026";

fn chap_daemon(mutual: bool) -> Daemon {
    let mutual = if mutual {
        format!(r#"mutual = {{ user = "{TARGET_USER}", secret = "{TARGET_SECRET}" }}"#)
    } else {
        String::new()
    };
    Daemon::start_config(
        CHAP_TARGET,
        &format!(
            r#"
[[device]]
name = "disk"
store = "ram"
size = "16M"

[limits]
login_failures_max = 100

[[target]]
iqn = "{CHAP_TARGET}"
users = [ {{ user = "{USER}", secret = "{SECRET}" }} ]
{mutual}

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#
        ),
    )
}

#[test]
fn chap_one_way_admits_the_right_secret_only() {
    let daemon = chap_daemon(false);
    let mut c = config(daemon.port, CHAP_TARGET, 0);
    chap(&mut c, ChapConfig::new(USER, SECRET));
    write_read_verify(c.clone(), Some(16 << 20));
    // Each algorithm the target and we share.
    for alg in iscsi::chap::Algorithm::ALL {
        let mut one = c.clone();
        let mut cfg = ChapConfig::new(USER, SECRET);
        cfg.algorithms = vec![alg];
        chap(&mut one, cfg);
        Client::connect(one)
            .unwrap_or_else(|e| panic!("{alg}: {e}"))
            .logout()
            .unwrap();
    }
    chap(&mut c, ChapConfig::new(USER, "not-the-secret-26"));
    match Client::connect(c.clone()) {
        Err(Error::Login(LoginError::Initiator { detail: 1 })) => {}
        other => panic!("wrong secret: {other:?}"),
    }
    c.session.auth = Auth::None;
    assert!(matches!(
        Client::connect(c),
        Err(Error::Login(LoginError::Initiator { detail: 1 }))
    ));
}

#[test]
fn chap_mutual_proves_the_target() {
    let daemon = chap_daemon(true);
    let mut c = config(daemon.port, CHAP_TARGET, 0);
    chap(
        &mut c,
        ChapConfig::new(USER, SECRET).with_mutual(TARGET_USER, TARGET_SECRET),
    );
    write_read_verify(c.clone(), Some(16 << 20));
    // We expect another target secret: the target's answer does not prove it.
    chap(
        &mut c,
        ChapConfig::new(USER, SECRET).with_mutual(TARGET_USER, "some-other-secret"),
    );
    match Client::connect(c.clone()) {
        Err(Error::Login(LoginError::Auth(AuthError::TargetResponse))) => {}
        other => panic!("wrong target secret: {other:?}"),
    }
    chap(
        &mut c,
        ChapConfig::new(USER, SECRET).with_mutual("someone-else", TARGET_SECRET),
    );
    match Client::connect(c) {
        Err(Error::Login(LoginError::Auth(AuthError::TargetName(n)))) => {
            assert_eq!(n, TARGET_USER)
        }
        other => panic!("wrong target name: {other:?}"),
    }
}

#[test]
fn chap_from_an_iscsi_url_with_mutual_query_arguments() {
    let daemon = chap_daemon(true);
    let url = format!(
        "iscsi://{USER}%{SECRET}@127.0.0.1:{}/{CHAP_TARGET}/0?target_user={TARGET_USER}&target_password={TARGET_SECRET}",
        daemon.port
    );
    let parsed = initiator::url::IscsiUrl::parse(&url).unwrap();
    let mut client = Client::connect(parsed.client_config(INITIATOR)).expect("login");
    settle(&mut client);
    client.logout().unwrap();
}

#[test]
fn discovery_lists_the_target() {
    let daemon = Daemon::start(&["ram:16M"]);
    let targets = driver::discover(&config(daemon.port, IQN, 0)).expect("SendTargets");
    let ours = targets
        .iter()
        .find(|t| t.name == IQN)
        .unwrap_or_else(|| panic!("{IQN} not in {targets:?}"));
    let addr = format!("127.0.0.1:{}", daemon.port);
    assert!(
        ours.addresses.iter().any(|(a, _)| *a == addr),
        "{addr} not in {ours:?}"
    );
    // The same through a portal URL.
    let url = initiator::url::IscsiUrl::parse(&daemon.portal()).unwrap();
    let again = driver::discover(&url.client_config(INITIATOR)).unwrap();
    assert_eq!(again, targets);
}

/// QD32 random reads and writes of 4 KiB to 256 KiB on one session, each checked against a
/// model of the medium. Commands in flight never overlap, so each read must see exactly the
/// last write to its range.
#[test]
fn qd32_pipelined_random_io_is_verified() {
    const REGION: usize = 256 * 1024;
    const REGIONS: usize = 64; // 16 MiB
    const BLOCK: usize = 512;
    let daemon = Daemon::start(&["ram:16M"]);
    let mut client = Client::connect(config(daemon.port, IQN, 0)).expect("login");
    settle(&mut client);
    let conn: &mut Connection = client.connection().unwrap();
    let mut model = vec![0u8; REGION * REGIONS];
    let mut busy = [false; REGIONS];
    // tag -> (region, offset, len, is_write)
    let mut inflight: std::collections::HashMap<u64, (usize, usize, usize, bool)> =
        Default::default();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let total = 6000u64;
    let (mut submitted, mut done, mut max_depth) = (0u64, 0u64, 0usize);
    let (mut reads, mut writes, mut bytes_checked) = (0u64, 0u64, 0usize);
    let started = Instant::now();
    while done < total {
        while submitted < total && inflight.len() < 32 {
            let region = (next() as usize) % REGIONS;
            if busy[region] {
                continue;
            }
            let len = [4096, 4096, 8192, 65536, REGION][(next() % 5) as usize];
            let offset = ((next() as usize) % ((REGION - len) / BLOCK + 1)) * BLOCK;
            let start = region * REGION + offset;
            let lba = (start / BLOCK) as u64;
            let blocks = (len / BLOCK) as u32;
            let is_write = next() % 2 == 0;
            let tag = submitted;
            let cmd = if is_write {
                let data = pseudo_random_bytes(len, tag + 1);
                Command::write(tag, 0, scsi::write16(lba, blocks, false), data)
            } else {
                Command::read(tag, 0, scsi::read16(lba, blocks), len as u32)
            };
            conn.submit(cmd).expect("submit");
            busy[region] = true;
            inflight.insert(tag, (region, offset, len, is_write));
            submitted += 1;
        }
        max_depth = max_depth.max(conn.in_flight());
        let c = conn.next_completion().expect("completion");
        let (region, offset, len, is_write) = inflight.remove(&c.tag).expect("known tag");
        let r = c.result.unwrap_or_else(|e| panic!("tag {}: {e}", c.tag));
        assert!(r.is_good(), "tag {}: {r:?}", c.tag);
        let range = region * REGION + offset..region * REGION + offset + len;
        if is_write {
            assert_eq!(r.data.len(), len, "the write buffer comes back");
            model[range].copy_from_slice(&r.data);
            writes += 1;
        } else {
            assert!(
                r.data == model[range],
                "tag {}: read differs from the model",
                c.tag
            );
            bytes_checked += len;
            reads += 1;
        }
        busy[region] = false;
        done += 1;
    }
    assert_eq!(max_depth, 32, "the queue was kept full");
    assert!(
        reads > 1000 && writes > 1000,
        "{reads} reads, {writes} writes"
    );
    eprintln!(
        "{done} commands ({reads} reads, {bytes_checked} bytes checked) at QD32 in {:?}",
        started.elapsed()
    );
    // Finally the whole medium, read back sequentially.
    for region in 0..REGIONS {
        let lba = (region * REGION / BLOCK) as u64;
        let data = client
            .read(lba, (REGION / BLOCK) as u32)
            .unwrap()
            .expect("READ");
        assert!(
            data == model[region * REGION..(region + 1) * REGION],
            "region {region}"
        );
    }
}

#[test]
fn a_lun_reset_from_another_session_is_a_unit_attention() {
    let daemon = Daemon::start(&["ram:16M"]);
    let mut a = Client::connect(config(daemon.port, IQN, 0)).expect("login a");
    settle(&mut a);
    let mut b = Client::connect(config(daemon.port, IQN, 0)).expect("login b");
    let response = b
        .connection()
        .unwrap()
        .task_management(Tmf::LunReset { lun: 0 })
        .expect("LUN RESET");
    assert_eq!(response, 0, "function complete");
    let ua = a.test_unit_ready().unwrap().expect_err("a unit attention");
    assert!(ua.is_unit_attention(), "{ua:?}");
    let sense = ua.sense.expect("sense");
    assert_eq!((sense.asc, sense.ascq), (0x29, 0x03), "LOGICAL UNIT RESET");
    a.test_unit_ready().unwrap().expect("reported once");

    // With retry_unit_attention the helper retries and keeps what it met.
    let mut cfg = config(daemon.port, IQN, 0);
    cfg.retry_unit_attention = true;
    let mut c = Client::connect(cfg).expect("login c");
    c.test_unit_ready().unwrap().expect("retried past the UA");
    b.connection()
        .unwrap()
        .task_management(Tmf::LunReset { lun: 0 })
        .unwrap();
    let data = c.read(0, 1).unwrap().expect("READ retried past the UA");
    assert_eq!(data.len(), 512);
    assert!(c
        .take_unit_attentions()
        .iter()
        .any(|s| (s.asc, s.ascq) == (0x29, 0x03)));
    // ABORT TASK of a command no longer running: the target knows no such task.
    let conn = b.connection().unwrap();
    conn.submit(Command::none(77, 0, scsi::test_unit_ready()))
        .unwrap();
    let first = conn.next_completion().unwrap();
    assert_eq!(first.tag, 77);
    assert!(conn
        .task_management(Tmf::AbortTask { lun: 0, task: 77 })
        .is_err());
    assert!(conn.ping().unwrap() < Duration::from_secs(5));
}

#[test]
fn reconnects_after_the_daemon_restarts() {
    let mut daemon = Daemon::start(&["ram:16M"]);
    let mut cfg = config(daemon.port, IQN, 0);
    cfg.retry_unit_attention = true;
    let mut client = Client::connect(cfg).expect("login");
    let data = pseudo_random_bytes(64 * 1024, 3);
    client.write(0, &data).unwrap().expect("WRITE");
    daemon.restart();
    // The helper meets the closed connection, logs in again and resubmits.
    client
        .write(0, &data)
        .unwrap()
        .expect("WRITE after the restart");
    assert_eq!(client.read(0, 128).unwrap().expect("READ"), data);
    // An explicit reconnect works too (and reinstates the session: same ISID).
    client.reconnect().unwrap();
    assert_eq!(client.read(0, 128).unwrap().expect("READ"), data);
    // The pipelined interface sees the loss as completions, then an error.
    daemon.restart();
    let conn = client.connection().unwrap();
    for tag in 0..4 {
        // The first submits may still be written into the dead socket.
        if conn
            .submit(Command::read(tag, 0, scsi::read16(0, 8), 4096))
            .is_err()
        {
            break;
        }
    }
    let mut lost = 0;
    while conn.in_flight() > 0 {
        match conn.next_completion() {
            Ok(c) => {
                if matches!(c.result, Err(CommandError::ConnectionLost(_))) {
                    lost += 1;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(lost > 0, "the commands met the lost connection");
    assert!(conn.broken().is_some());
    assert!(client.read(0, 8).unwrap().is_ok(), "reconnected");
}

#[test]
fn a_silent_target_times_out() {
    // Accepts TCP, then says nothing.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let holder = std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().take(1).collect();
        std::thread::sleep(Duration::from_secs(4));
        drop(held);
    });
    let mut cfg = config(port, IQN, 0);
    cfg.timeouts.login = Duration::from_secs(1);
    let started = Instant::now();
    match Client::connect(cfg) {
        Err(Error::Timeout { what, .. }) => assert_eq!(what, "login"),
        other => panic!("expected a login timeout: {other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    holder.join().unwrap();

    // A target that stops answering in full feature phase (SIGSTOP): the command times out,
    // the ABORT TASK is not answered either, and the connection is declared dead.
    let mut daemon = Daemon::start(&["ram:16M"]);
    let mut cfg = config(daemon.port, IQN, 0);
    cfg.session.command_timeout = Duration::from_secs(1);
    cfg.session.response_timeout = Duration::from_secs(1);
    cfg.retries = 0;
    let mut client = Client::connect(cfg).expect("login");
    settle(&mut client);
    daemon.signal("STOP");
    let started = Instant::now();
    let r = client.read(0, 8);
    let took = started.elapsed();
    daemon.signal("CONT");
    assert!(
        matches!(r, Err(Error::Command(CommandError::Timeout))),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(client.read(0, 8).unwrap().is_ok(), "works again after CONT");
    assert!(daemon.alive());
}

/// `tgtd` on a free port with a private control socket; SIGKILLed (it ignores SIGTERM) and
/// reaped on Drop.
#[test]
fn tgt_login_without_auth_writes_and_reads_back() {
    let tgt = Tgt::start();
    let mut client = Client::connect(config(tgt.port, TGT_IQN, 1)).expect("login to tgt");
    let n = client.connection().unwrap().session().negotiated().clone();
    eprintln!("tgt negotiated: {n:?}");
    settle(&mut client);
    let luns = client.report_luns().unwrap().expect("REPORT LUNS");
    assert!(luns.contains(&0) && luns.contains(&1), "{luns:?}");
    client.logout().unwrap();
    write_read_verify(config(tgt.port, TGT_IQN, 1), Some(16 << 20));
    let targets = driver::discover(&config(tgt.port, TGT_IQN, 1)).expect("SendTargets");
    assert!(targets.iter().any(|t| t.name == TGT_IQN), "{targets:?}");
}

#[test]
fn tgt_chap_one_way_and_mutual() {
    let tgt = Tgt::start();
    tgt.account(USER, SECRET, false);
    let mut c = config(tgt.port, TGT_IQN, 1);
    assert!(
        matches!(
            Client::connect(c.clone()),
            Err(Error::Login(LoginError::Initiator { .. }))
        ),
        "no CHAP: refused"
    );
    chap(&mut c, ChapConfig::new(USER, "not-the-secret-26"));
    assert!(matches!(
        Client::connect(c.clone()),
        Err(Error::Login(LoginError::Initiator { .. }))
    ));
    chap(&mut c, ChapConfig::new(USER, SECRET));
    write_read_verify(c.clone(), None);

    tgt.account(TARGET_USER, TARGET_SECRET, true);
    chap(
        &mut c,
        ChapConfig::new(USER, SECRET).with_mutual(TARGET_USER, TARGET_SECRET),
    );
    write_read_verify(c.clone(), None);
    chap(
        &mut c,
        ChapConfig::new(USER, SECRET).with_mutual(TARGET_USER, "some-other-secret"),
    );
    match Client::connect(c) {
        Err(Error::Login(LoginError::Auth(AuthError::TargetResponse))) => {}
        other => panic!("tgt with another target secret: {other:?}"),
    }
}

#[test]
fn qd32_against_tgt_is_verified() {
    let tgt = Tgt::start();
    let mut client = Client::connect(config(tgt.port, TGT_IQN, 1)).expect("login");
    settle(&mut client);
    let conn = client.connection().unwrap();
    // 32 distinct 16 KiB ranges written at once, then read back at once.
    for tag in 0..32u64 {
        let data = pseudo_random_bytes(16384, tag + 100);
        conn.submit(Command::write(
            tag,
            1,
            scsi::write16(tag * 32, 32, false),
            data,
        ))
        .unwrap();
    }
    for _ in 0..32 {
        let c = conn.next_completion().unwrap();
        assert!(c.result.as_ref().is_ok_and(|r| r.is_good()), "{c:?}");
    }
    for tag in 0..32u64 {
        conn.submit(Command::read(tag, 1, scsi::read16(tag * 32, 32), 16384))
            .unwrap();
    }
    for _ in 0..32 {
        let c = conn.next_completion().unwrap();
        let r = c.result.unwrap();
        assert!(
            r.data == pseudo_random_bytes(16384, c.tag + 100),
            "tag {}",
            c.tag
        );
    }
}
