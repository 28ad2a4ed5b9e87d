//! The trust findings of 2026-11-26 (docs/SECURITY.md), each reproduced against the daemon:
//! a live change never gives a running session a group it did not authenticate for.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, metric, scrape, Ctl, Daemon};
use initiator::driver::Client;
use initiator::{Auth, ChapConfig, ClientConfig, SessionConfig, SessionKind};

const IQN: &str = "iqn.2026-11.org.ferrosan:trust";
const DB2: &str = "iqn.2026-11.test:db2";
const DB3: &str = "iqn.2026-11.test:db3";
const BYSTANDER: &str = "iqn.2026-11.test:bystander";
const SECURE_USER: &str = "secure";
const SECURE_SECRET: &str = "secure-secret-2026";

/// An open group (16 MiB, no CHAP) and a CHAP group `secure` (48 MiB) for DB3.
fn two_groups() -> String {
    format!(
        r#"
[[device]]
name = "open"
store = "ram"
size = "16M"

[[device]]
name = "secret"
store = "ram"
size = "48M"

[limits]
login_failures_max = 100

[[target]]
iqn = "{IQN}"
  [[target.group]]
  name = "open"
  any_initiator = true
  luns = [ {{ lun = 0, device = "open" }} ]
  [[target.group]]
  name = "secure"
  initiators = ["{DB3}"]
  auth = "chap"
  users = [ {{ user = "{SECURE_USER}", secret = "{SECURE_SECRET}" }} ]
  luns = [ {{ lun = 0, device = "secret" }} ]
"#
    )
}

fn client_config(port: u16, initiator: &str, chap: Option<(&str, &str)>) -> ClientConfig {
    let mut s = SessionConfig::new(
        initiator,
        SessionKind::Normal {
            target_name: IQN.into(),
        },
    );
    s.command_timeout = Duration::from_secs(10);
    if let Some((user, secret)) = chap {
        s.auth = Auth::Chap(ChapConfig::new(user, secret.as_bytes()));
    }
    let mut c = ClientConfig::new(format!("127.0.0.1:{port}"), s);
    c.timeouts.login = Duration::from_secs(5);
    c
}

/// The capacity LUN 0 shows this session, after the unit attentions a new nexus starts with.
fn capacity(client: &mut Client) -> Result<u64, String> {
    for _ in 0..8 {
        match client.test_unit_ready().map_err(|e| format!("{e:?}"))? {
            Ok(()) => break,
            Err(e) if e.is_unit_attention() => continue,
            Err(e) => return Err(format!("{e:?}")),
        }
    }
    let cap = client.read_capacity().map_err(|e| format!("{e:?}"))?;
    cap.map(|c| c.bytes()).map_err(|e| format!("{e:?}"))
}

/// Whether the target closes the session's connection within `within`, with no command in
/// flight (the target's own NOP-Ins are answered meanwhile).
fn closed_within(client: &mut Client, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let Ok(conn) = client.connection() else {
        return true;
    };
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        if conn.wait_event(left).is_err() || conn.broken().is_some() {
            return true;
        }
    }
    false
}

#[test]
fn a_live_change_never_gives_a_session_a_group_it_did_not_authenticate_for() {
    let ctl = Ctl::new();
    let socket = ctl.socket.display().to_string();
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_config_args(
        IQN,
        &two_groups(),
        &["--control-socket", &socket, "--metrics-listen", &listen],
    );
    let port = daemon.port;
    // DB2 logs in without CHAP and lands in the open group; DB3 with CHAP in `secure`; a
    // bystander in the open group is there to show that only changed sessions close.
    let mut db2 = Client::connect(client_config(port, DB2, None)).expect("db2 login");
    assert_eq!(capacity(&mut db2), Ok(16 << 20));
    let chap = Some((SECURE_USER, SECURE_SECRET));
    let mut db3 = Client::connect(client_config(port, DB3, chap)).expect("db3 login");
    assert_eq!(capacity(&mut db3), Ok(48 << 20));
    let mut bystander = Client::connect(client_config(port, BYSTANDER, None)).expect("login");
    assert_eq!(capacity(&mut bystander), Ok(16 << 20));

    // The operator puts DB2 into the CHAP group while its unauthenticated session runs.
    let added = ctl.json(&["initiator", "add", IQN, "secure", DB2]);
    assert_eq!(added["ok"], true, "{added}");
    // Its next command never reaches the secure LUN: the session is closed (and a new login
    // without CHAP is refused, so no reconnection gets there either).
    let after = capacity(&mut db2);
    assert!(
        after.is_err(),
        "the unauthenticated session read the CHAP group's LUN: {after:?}"
    );
    assert!(
        Client::connect(client_config(port, DB2, None)).is_err(),
        "a login without CHAP into the CHAP group"
    );
    assert_eq!(
        capacity(&mut bystander),
        Ok(16 << 20),
        "the bystander kept its session"
    );
    assert_eq!(capacity(&mut db3), Ok(48 << 20), "db3 kept its session");

    // The group's CHAP user changes: DB3's session, proven with the old user, is closed even
    // though it sends nothing (the daemon decides within a second, not at the next command).
    let out = ctl.chap_set(&[IQN, "--group", "secure", "other"], b"other-secret-2026\n");
    assert!(out.status.success(), "{out:?}");
    assert!(
        closed_within(&mut db3, Duration::from_secs(5)),
        "a session whose CHAP user left its group stayed open"
    );
    assert!(
        capacity(&mut db3).is_err(),
        "db3 read after its proof was withdrawn"
    );
    assert_eq!(capacity(&mut bystander), Ok(16 << 20));

    let log = daemon.output();
    assert!(
        log.contains("reason=\"group_changed\"") || log.contains("reason=group_changed"),
        "{log}"
    );
    let text = scrape(metrics_port);
    assert_eq!(
        metric(
            &text,
            r#"ferrosan_sessions_closed_total{reason="group_changed"}"#
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"ferrosan_sessions_closed_total{reason="authentication_changed"}"#
        ),
        1.0,
        "{text}"
    );
}

const SRC_NAA: [u8; 8] = [0x50, 0x01, 0x40, 0x50, 0, 0, 0, 0x01];
const DST_NAA: [u8; 8] = [0x50, 0x01, 0x40, 0x50, 0, 0, 0, 0x02];

/// LUN 0 a RAM device `src`, LUN 1 the device `dst` (`dst_store`), both with a known NAA.
fn copy_pair(dst_store: &str, size: &str) -> String {
    format!(
        r#"
[[device]]
name = "src"
store = "ram"
size = "{size}"
naa = "5001405000000001"

[[device]]
name = "dst"
{dst_store}
size = "{size}"
naa = "5001405000000002"

[[target]]
iqn = "{IQN}"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "src" }}, {{ lun = 1, device = "dst" }} ]
"#
    )
}

/// An EXTENDED COPY (LID1) parameter list: `segments` of (blocks, src LBA, dst LBA) from
/// target descriptor 0 (`src`) to 1 (`dst`), 512-byte blocks.
fn copy_list(src: &[u8], dst: &[u8], segments: &[(u16, u64, u64)]) -> Vec<u8> {
    let target = |naa: &[u8]| {
        let mut d = vec![0u8; 32];
        d[0] = 0xE4; // identification descriptor
        d[4] = 0x01; // code set: binary
        d[5] = 0x03; // designator type: NAA
        d[7] = naa.len() as u8;
        d[8..8 + naa.len()].copy_from_slice(naa);
        d[30] = 0x02; // block length 512
        d
    };
    let mut segs = Vec::new();
    for &(blocks, src_lba, dst_lba) in segments {
        let mut d = vec![0u8; 28];
        d[0] = 0x02; // block -> block
        d[3] = 0x18;
        d[6..8].copy_from_slice(&1u16.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&src_lba.to_be_bytes());
        d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
        segs.extend_from_slice(&d);
    }
    let mut p = vec![0u8; 16];
    p[1] = 3 << 3; // LIST ID USAGE 11b: no list identifier held
    p[2..4].copy_from_slice(&64u16.to_be_bytes());
    p[8..12].copy_from_slice(&(segs.len() as u32).to_be_bytes());
    p.extend_from_slice(&target(src));
    p.extend_from_slice(&target(dst));
    p.extend_from_slice(&segs);
    p
}

/// A session of DB3 for many long copies: a copy queued behind others on a loaded machine
/// may take longer than the usual 10 s to be answered.
fn copier_config(port: u16) -> ClientConfig {
    let mut c = client_config(port, DB3, None);
    c.session.command_timeout = Duration::from_secs(120);
    c
}

/// The CDB of an EXTENDED COPY (LID1) of a `list_len`-byte parameter list.
fn extended_copy_cdb(list_len: usize) -> initiator::scsi::Cdb {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x83;
    cdb[10..14].copy_from_slice(&(list_len as u32).to_be_bytes());
    initiator::scsi::Cdb::new(&cdb).unwrap()
}

/// An EXTENDED COPY of `segments` from `src` to `dst` (512-byte blocks), for pipelining.
fn copy_command(tag: u64, segments: &[(u16, u64, u64)]) -> initiator::session::Command {
    let list = copy_list(&SRC_NAA, &DST_NAA, segments);
    initiator::session::Command::write(tag, 0, extended_copy_cdb(list.len()), list)
}

fn extended_copy(client: &mut Client, list: Vec<u8>) -> initiator::session::ScsiResult {
    let cdb = extended_copy_cdb(list.len());
    client
        .command(cdb, initiator::session::Transfer::Write(list))
        .expect("EXTENDED COPY answered")
}

fn sense_of(r: &initiator::session::ScsiResult) -> Option<(u8, u8, u8)> {
    r.sense.as_ref().map(|s| (s.key, s.asc, s.ascq))
}

#[test]
fn extended_copy_never_writes_a_device_taken_offline() {
    let scratch = common::Scratch::new("trust-xcopy");
    let file = scratch.file("dst.img");
    let ctl = Ctl::new();
    let socket = ctl.socket.display().to_string();
    let dst = format!("store = \"file\"\npath = \"{}\"", file.display());
    let daemon =
        Daemon::start_config_args(IQN, &copy_pair(&dst, "16M"), &["--control-socket", &socket]);
    let mut lun0 = Client::connect(client_config(daemon.port, DB2, None)).expect("login");
    assert_eq!(capacity(&mut lun0), Ok(16 << 20));
    lun0.write(0, &[b'S'; 8 * 512])
        .unwrap()
        .expect("WRITE to src");
    let mut c1 = client_config(daemon.port, DB3, None);
    c1.lun = 1;
    let mut lun1 = Client::connect(c1).expect("login");
    assert_eq!(capacity(&mut lun1), Ok(16 << 20));
    let before = std::fs::read(&file).unwrap();

    let off = ctl.json(&["device", "offline", "dst"]);
    assert_eq!(off["ok"], true, "{off}");
    // A plain WRITE to it is refused ...
    let w = lun1.write(0, &[b'W'; 512]).expect("answered");
    assert!(w.is_err(), "a WRITE reached an offline device");
    // ... and so is a copy addressed to the online LUN 0 that writes it.
    let r = extended_copy(&mut lun0, copy_list(&SRC_NAA, &DST_NAA, &[(8, 0, 0)]));
    assert_eq!(
        (r.status, sense_of(&r)),
        (0x02, Some((0x02, 0x04, 0x03))),
        "EXTENDED COPY to an offline device: NOT READY, MANUAL INTERVENTION REQUIRED"
    );
    assert!(
        std::fs::read(&file).unwrap() == before,
        "the offline device's file changed"
    );
    // Online again, the same copy runs.
    let on = ctl.json(&["device", "online", "dst"]);
    assert_eq!(on["ok"], true, "{on}");
    let r = extended_copy(&mut lun0, copy_list(&SRC_NAA, &DST_NAA, &[(8, 0, 0)]));
    assert_eq!(r.status, 0, "{:?}", sense_of(&r));
    let after = std::fs::read(&file).unwrap();
    assert!(after[..8 * 512].iter().all(|&b| b == b'S'));
}

/// QD1 4 KiB reads of LUN 0 on one worker while another session keeps copies in flight on
/// the same worker: the copies run off it, so the reads are answered as usual.
#[test]
fn extended_copy_leaves_the_network_worker_to_other_sessions() {
    let daemon = Daemon::start_config_args(
        IQN,
        &format!(
            "[server]\nworkers = 1\n{}",
            copy_pair("store = \"ram\"", "1G")
        ),
        &[],
    );
    let port = daemon.port;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let copier = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut client = Client::connect(copier_config(port)).expect("login");
            capacity(&mut client).expect("ready");
            // 32 segments of 32 MiB less a block: 1 GiB per command (the most one may move),
            // 8 in flight.
            let segments: Vec<_> = (0..32u64).map(|i| (u16::MAX, i << 16, i << 16)).collect();
            let conn = client.connection().expect("connected");
            let mut copies = 0u32;
            let mut in_flight = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                while in_flight < 8 {
                    let cmd = copy_command(u64::from(copies), &segments);
                    conn.submit(cmd).expect("submit");
                    in_flight += 1;
                }
                let done = conn.next_completion().expect("a copy's completion");
                let result = done.result.expect("a copy's answer");
                assert_eq!(result.status, 0, "{:?}", result.sense);
                in_flight -= 1;
                copies += 1;
            }
            copies
        })
    };
    // Let the copies get going, then time QD1 reads from another session.
    std::thread::sleep(Duration::from_millis(500));
    let mut victim = Client::connect(client_config(port, DB2, None)).expect("login");
    capacity(&mut victim).expect("ready");
    let mut latencies = Vec::new();
    for i in 0..40u64 {
        let t = Instant::now();
        victim.read(i * 8, 8).unwrap().expect("READ");
        latencies.push(t.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let copies = copier.join().expect("copier");
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    // Measured before the copies left the worker: p50 1.96 s; after: a few ms. The bound is
    // far from both, and only says the worker was not held.
    eprintln!(
        "QD1 reads beside copies: p50 {p50:?}, max {:?}, {copies} copies",
        latencies.last()
    );
    assert!(copies >= 1, "no copy completed");
    assert!(
        p50 < Duration::from_millis(250),
        "QD1 reads waited behind copies on their worker: p50 {p50:?} ({copies} copies)"
    );
}

fn mode_of(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// A config written as an operator would: comments, sizes with units, an inline secret.
fn commented_config(port: u16, lun_file: &std::path::Path) -> String {
    format!(
        r#"# The lab array. Keep this comment.
[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]

[[device]]
name = "disk"
store = "file"
path = "{}"
size = "16M"   # sixteen mebibytes

[[target]]
iqn = "{IQN}"
users = [ {{ user = "{SECURE_USER}", secret = "{SECURE_SECRET}" }} ]
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#,
        lun_file.display()
    )
}

#[test]
fn secrets_and_lun_files_are_kept_from_other_users_and_the_file_is_edited_not_rewritten() {
    let scratch = common::Scratch::new("trust-secrets");
    let lun_file = scratch.file("lun.img");
    let ctl = Ctl::new();
    let port = free_port();
    let text = commented_config(port, &lun_file);
    let daemon = Daemon::start_config_text(
        IQN,
        port,
        &text,
        &["--control-socket", &ctl.socket.display().to_string()],
    );
    let config = daemon.file("ferrosan.toml");
    // The harness wrote the file with the umask's 0644: every user may read the secret.
    std::fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let check = common::run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["check-config", &config.display().to_string()],
    );
    assert!(check.success(), "{}", check.describe());
    assert!(
        check.stderr.contains("readable by every user"),
        "{}",
        check.describe()
    );
    // The LUN file the daemon created is the initiators' data: no one else's to read.
    assert_eq!(mode_of(&lun_file), 0o600);

    // A secret from a file: the saved config names the file, not the secret.
    let secret_file = scratch.file("bob.secret");
    std::fs::write(&secret_file, "bob-secret-from-a-file\n").unwrap();
    std::fs::set_permissions(
        &secret_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let set = ctl.run(&[
        "chap",
        "set",
        IQN,
        "--group",
        "all",
        "bob",
        "--secret-file",
        &secret_file.display().to_string(),
        "--save",
    ]);
    assert!(set.success(), "{}", set.describe());
    let saved = std::fs::read_to_string(&config).unwrap();
    assert!(
        saved.contains(&format!("secret_file = \"{}\"", secret_file.display())),
        "{saved}"
    );
    assert!(!saved.contains("bob-secret-from-a-file"), "{saved}");
    // Edited, not rewritten: the comments, the unit and what was not changed stay.
    for kept in [
        "# The lab array. Keep this comment.",
        "size = \"16M\"   # sixteen mebibytes",
    ] {
        assert!(saved.contains(kept), "{kept:?} lost:\n{saved}");
    }
    assert!(!saved.contains("serial"), "defaults spelled out:\n{saved}");
    let backup = std::fs::read_to_string(scratch_backup(&config)).expect("a backup");
    assert!(
        backup.ends_with(&text),
        "the backup is not the previous file:\n{backup}"
    );
    // It still holds the target's inline secret: saved no more open than 0640.
    assert_eq!(mode_of(&config) & 0o007, 0, "mode {:o}", mode_of(&config));
    // bob logs in with the secret from the file.
    let mut bob = Client::connect(client_config(
        port,
        DB2,
        Some(("bob", "bob-secret-from-a-file")),
    ))
    .expect("login with the file's secret");
    assert_eq!(capacity(&mut bob), Ok(16 << 20));
    let log = daemon.output();
    assert!(
        !log.contains("bob-secret-from-a-file") && !log.contains(SECURE_SECRET),
        "{log}"
    );
}

fn scratch_backup(config: &std::path::Path) -> std::path::PathBuf {
    let mut name = config.file_name().unwrap().to_os_string();
    name.push(".bak");
    config.with_file_name(name)
}

/// `ferrosan bench` takes a CHAP secret from the environment (or a file, or a prompt), never
/// needing it in a URL that every user sees in the process list.
#[test]
fn bench_takes_the_chap_secret_from_outside_its_command_line() {
    let scratch = common::Scratch::new("trust-bench");
    let port = free_port();
    let daemon = Daemon::start_config_text(
        IQN,
        port,
        &commented_config(port, &scratch.file("l.img")),
        &[],
    );
    let url = format!("iscsi://{SECURE_USER}@127.0.0.1:{}/{IQN}/0", daemon.port);
    let out = scratch.file("out").display().to_string();
    let args = [
        "bench",
        "--only",
        "randread-4k-qd1",
        "--ramp",
        "0",
        "--runtime",
        "1",
        "--out",
        &out,
        &url,
    ];
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan"));
    let without = common::run_path(bin, &args);
    assert!(!without.success());
    assert!(
        without.stderr.contains("--chap-secret-file"),
        "{}",
        without.describe()
    );
    let with = common::run_path_env(bin, &args, &[("FERROSAN_CHAP_SECRET", SECURE_SECRET)]);
    assert!(with.success(), "{}", with.describe());
    let secret_file = scratch.file("secret");
    std::fs::write(&secret_file, format!("{SECURE_SECRET}\n")).unwrap();
    let mut from_file = args.to_vec();
    let s = secret_file.display().to_string();
    from_file.splice(1..1, ["--chap-secret-file", s.as_str()]);
    let with_file = common::run_path(bin, &from_file);
    assert!(with_file.success(), "{}", with_file.describe());
}

/// `serve ARGS` run to its exit (it must not start): its stderr.
fn refused_start(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ferrosan");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut child = out;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the daemon ran");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the daemon started: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    err
}

/// Another user's daemon listening where `ferrosan ctl` looks (a directory in a shared,
/// world-writable place, like `/tmp`): `ctl` sends it nothing; and the daemon itself refuses
/// a socket directory others may write to.
#[test]
fn the_control_socket_cannot_be_squatted() {
    if !common::is_root() {
        eprintln!("needs root (to run a daemon as another user): not run");
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    let scratch = common::Scratch::new("trust-socket");
    // A world-writable, sticky directory, as /tmp is.
    let shared = scratch.file("tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    // The daemon refuses a socket directory every user may write to.
    let socket = shared.join("control.sock").display().to_string();
    let err = refused_start(&[
        "serve",
        "--listen",
        &listen,
        "--lun",
        "ram:4M",
        "--control-socket",
        &socket,
    ]);
    assert!(err.contains("writable by others"), "{err}");

    // User 65534 makes a directory of its own there and listens in it.
    let squat = shared.join("ferrosan-0");
    let status = std::process::Command::new("/usr/bin/setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "mkdir",
            "-m",
            "0755",
        ])
        .arg(&squat)
        .status()
        .unwrap();
    assert!(status.success());
    let socket = squat.join("control.sock");
    let socket_s = socket.display().to_string();
    let mut squatter = std::process::Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_ferrosan"))
        .args([
            "serve",
            "--listen",
            &listen,
            "--lun",
            "ram:4M",
            "--control-socket",
            &socket_s,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Root's ctl, sent there, refuses to talk to it: the new secret never leaves.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args([
            "ctl",
            "--socket",
            &socket_s,
            "chap",
            "set",
            "iqn.2026-11.x:t",
            "admin",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin
                .take()
                .unwrap()
                .write_all(b"a-secret-for-nobody\n")?;
            c.wait_with_output()
        })
        .unwrap();
    let _ = squatter.kill();
    let _ = squatter.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not sending it anything"), "{stderr}");
}

/// Idle connections to the metrics endpoint, many of them from one address, delay no one's
/// scrape from another address (the old listener served 8 at a time for up to 5 s each).
#[test]
fn idle_metrics_connections_delay_no_scrape() {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let _daemon = Daemon::start_with_args(IQN, &["ram:4M"], &["--metrics-listen", &listen]);
    let idle: Vec<std::net::TcpStream> = (0..40)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // A scrape from another address.
    let started = Instant::now();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(
            &"127.0.0.2:0"
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .into(),
        )
        .unwrap();
    socket
        .connect(&std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port)).into())
        .unwrap();
    let mut stream: std::net::TcpStream = socket.into();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    std::io::Write::write_all(&mut stream, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut stream, &mut page).unwrap();
    let took = started.elapsed();
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");
    // Well under the 5 s the old listener made it wait, far over a scrape's real time.
    assert!(
        took < Duration::from_millis(2500),
        "the scrape waited {took:?}"
    );
    assert!(
        metric(
            &page,
            r#"ferrosan_limit_exceeded_total{limit="metrics_connections_per_source"}"#
        ) >= 36.0,
        "{page}"
    );
    drop(idle);
}

/// One connection with 24 copies of 1 GiB queued runs a bounded number at once (8 with the
/// default memory budget): the rest wait in TCP, and the I/O threads stay free for others.
#[test]
fn one_connection_runs_a_bounded_number_of_copies_at_once() {
    let ctl = Ctl::new();
    let socket = ctl.socket.display().to_string();
    let daemon = Daemon::start_config_args(
        IQN,
        &format!(
            "[server]\nworkers = 1\n{}",
            copy_pair("store = \"ram\"", "1G")
        ),
        &["--control-socket", &socket],
    );
    let port = daemon.port;
    let mut client = Client::connect(copier_config(port)).expect("login");
    capacity(&mut client).expect("ready");
    // 512 MiB each: the bound counts commands, not bytes.
    let segments: Vec<_> = (0..32u64).map(|i| (1u16 << 15, i << 15, i << 15)).collect();
    let conn = client.connection().expect("connected");
    // The most copies in flight on the source LU, sampled every 5 ms from another thread for
    // as long as the copies run (until their last answer), not for a fixed window. Copies of
    // a RAM LU never written take milliseconds, and a batch may end before its first sample
    // (seen in about half the batches here, and in every sample of two test-command runs
    // that looked for a fixed 3 or 10 s): a batch in which none was seen is sent again, 20
    // at most, so the bound is never judged on no data.
    let mut most = 0;
    for batch in 0..20u64 {
        for tag in 0..24u64 {
            conn.submit(copy_command(batch * 24 + tag, &segments))
                .expect("submit");
        }
        conn.flush().expect("sent");
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampler = {
            let running = std::sync::Arc::clone(&running);
            let socket = ctl.socket.clone();
            std::thread::spawn(move || {
                let mut most = 0;
                while running.load(std::sync::atomic::Ordering::Acquire) {
                    let stats = socket_verb(&socket, "stats");
                    let in_flight = stats["devices"]
                        .as_array()
                        .and_then(|d| d.iter().find(|d| d["device"] == "src"))
                        .and_then(|d| d["in_flight"].as_u64())
                        .unwrap_or(0);
                    most = most.max(in_flight);
                    std::thread::sleep(Duration::from_millis(5));
                }
                most
            })
        };
        // Every copy completes.
        for _ in 0..24 {
            let done = conn.next_completion().expect("a copy's completion");
            let result = done.result.expect("a copy's answer");
            assert_eq!(result.status, 0, "{:?}", result.sense);
        }
        running.store(false, std::sync::atomic::Ordering::Release);
        most = most.max(sampler.join().expect("the sampler"));
        if most >= 1 {
            break;
        }
    }
    assert!(most >= 1, "no copy seen running in 20 batches");
    // 8 at most (all 24 at once without the bound): a copy lets go of the LU before its answer
    // gives its share of the budget back.
    assert!(most <= 8, "{most} copies of one connection ran at once");
}

/// A verb of the control socket's own protocol (one JSON object per line), such as `stats`,
/// which `ferrosan top` reads.
fn socket_verb(socket: &std::path::Path, verb: &str) -> serde_json::Value {
    use std::io::{BufRead as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("control socket");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    writeln!(stream, "{{\"verb\":\"{verb}\"}}").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stream)
        .read_line(&mut line)
        .unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}
