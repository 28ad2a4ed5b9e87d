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
