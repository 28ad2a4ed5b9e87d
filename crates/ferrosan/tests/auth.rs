//! Authentication and access control of the ferrosan binary against libiscsi's initiators:
//! CHAP one-way and mutual (normal and discovery sessions), initiator ACLs, source-address
//! restrictions and the failed-login rate limit. Each test runs its own daemon from a config file.

mod common;

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, read_lossy, require_tool, run_path_env, Run, Scratch, STARTUP_TIMEOUT};

const TARGET: &str = "iqn.2024-01.dev.ferrosan:auth";
const OPEN_TARGET: &str = "iqn.2024-01.dev.ferrosan:open";
const INITIATOR: &str = "iqn.2024-01.dev.ferrosan:initiator-a";
const STRANGER: &str = "iqn.2024-01.dev.ferrosan:stranger";

const USER: &str = "alice";
const SECRET: &str = "alice-secret-2026";
const TARGET_USER: &str = "ferrosan-target";
const TARGET_SECRET: &str = "target-secret-2026";
const DISCOVERY_USER: &str = "disco";
const DISCOVERY_SECRET: &str = "discovery-secret-26";

/// `ferrosan serve --config FILE`, killed and reaped on Drop.
struct ConfigDaemon {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    scratch: Scratch,
}

impl ConfigDaemon {
    /// Starts the daemon with `body` (everything but the portal group, which is added here
    /// with a free loopback port as tag 1).
    fn start(body: &str) -> ConfigDaemon {
        let scratch = Scratch::new("auth");
        let port = free_port();
        let config = scratch.file("ferrosan.toml");
        let text = format!("[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{port}\"]\n\n{body}");
        std::fs::write(&config, text).expect("write config");
        let log = scratch.file("daemon.log");
        let out = File::create(&log).expect("daemon log");
        let child = Command::new(env!("CARGO_BIN_EXE_ferrosan"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup log"))
            .stderr(out)
            .spawn()
            .expect("spawn ferrosan");
        let mut d = ConfigDaemon {
            child: Some(child),
            port,
            log,
            scratch,
        };
        d.wait_listening();
        d
    }

    fn wait_listening(&mut self) {
        let addr: SocketAddr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().expect("try_wait") {
                self.child = None;
                panic!("ferrosan exited ({status}); its output:\n{}", self.output());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "ferrosan did not listen within {STARTUP_TIMEOUT:?}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn output(&self) -> String {
        read_lossy(&self.log)
    }

    /// `iscsi://[user%secret@]127.0.0.1:PORT[/target/lun]`.
    fn url(&self, creds: Option<(&str, &str)>, target: Option<&str>) -> String {
        let who = creds.map_or(String::new(), |(u, s)| format!("{u}%{s}@"));
        let path = target.map_or(String::new(), |t| format!("/{t}/0"));
        format!("iscsi://{who}127.0.0.1:{}{path}", self.port)
    }
}

impl Drop for ConfigDaemon {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = &self.scratch;
    }
}

/// Runs a libiscsi tool with extra environment variables (mutual CHAP credentials), a timeout
/// and captured output.
fn run_env(tool: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    run_path_env(&require_tool(tool), args, env)
}

fn run(tool: &str, args: &[&str]) -> Run {
    run_env(tool, args, &[])
}

fn inq(d: &ConfigDaemon, initiator: &str, creds: Option<(&str, &str)>, target: &str) -> Run {
    run("iscsi-inq", &["-i", initiator, &d.url(creds, Some(target))])
}

fn ls(d: &ConfigDaemon, initiator: &str, creds: Option<(&str, &str)>) -> Run {
    run("iscsi-ls", &["-i", initiator, &d.url(creds, None)])
}

/// The targets `iscsi-ls` listed.
fn listed(r: &Run) -> Vec<String> {
    r.stdout
        .lines()
        .filter_map(|l| l.strip_prefix("Target:"))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn assert_ok(r: &Run, d: &ConfigDaemon) {
    assert!(
        r.success(),
        "{}\n--- daemon output\n{}",
        r.describe(),
        d.output()
    );
}

/// The login failed, and the initiator printed `why` (libiscsi's name of the status).
fn assert_login_fails(r: &Run, d: &ConfigDaemon, why: &str) {
    let text = format!("{}{}", r.stdout, r.stderr);
    assert!(
        !r.success() && text.contains(why),
        "expected a login failure mentioning {why:?}: {}\n--- daemon output\n{}",
        r.describe(),
        d.output()
    );
}

const DEVICE: &str = r#"
[[device]]
name = "disk"
store = "ram"
size = "16M"
"#;

fn chap_target(extra_target_keys: &str) -> String {
    format!(
        r#"{DEVICE}
[limits]
login_failures_max = 100

[[target]]
iqn = "{TARGET}"
users = [ {{ user = "{USER}", secret = "{SECRET}" }} ]
{extra_target_keys}

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#
    )
}

#[test]
fn one_way_chap_admits_the_right_secret_only() {
    let d = ConfigDaemon::start(&chap_target(""));
    let ok = inq(&d, INITIATOR, Some((USER, SECRET)), TARGET);
    assert_ok(&ok, &d);
    assert!(ok.stdout.contains("FERROSAN"), "{}", ok.describe());

    let wrong = inq(&d, INITIATOR, Some((USER, "not-the-secret-26")), TARGET);
    assert_login_fails(&wrong, &d, "Authentication failure");
    let unknown = inq(&d, INITIATOR, Some(("mallory", SECRET)), TARGET);
    assert_login_fails(&unknown, &d, "Authentication failure");
    // Without credentials libiscsi offers no CHAP at all: CHAP is required, so it fails.
    let none = inq(&d, INITIATOR, None, TARGET);
    assert_login_fails(&none, &d, "Authentication failure");

    let log = d.output();
    assert!(log.contains("wrong CHAP response"), "reason logged:\n{log}");
    assert!(log.contains("unknown CHAP user"), "reason logged:\n{log}");
    assert!(log.contains(INITIATOR), "initiator logged:\n{log}");
    for secret in [SECRET, "not-the-secret-26"] {
        assert!(!log.contains(secret), "a secret reached the log:\n{log}");
    }
}

#[test]
fn mutual_chap_proves_the_target_to_the_initiator() {
    let d = ConfigDaemon::start(&chap_target(&format!(
        r#"mutual = {{ user = "{TARGET_USER}", secret = "{TARGET_SECRET}" }}"#
    )));
    let url = d.url(Some((USER, SECRET)), Some(TARGET));
    let ok = run_env(
        "iscsi-inq",
        &["-i", INITIATOR, &url],
        &[
            ("LIBISCSI_CHAP_TARGET_USERNAME", TARGET_USER),
            ("LIBISCSI_CHAP_TARGET_PASSWORD", TARGET_SECRET),
        ],
    );
    assert_ok(&ok, &d);
    // The initiator expects another target secret: the target's answer does not match.
    let wrong = run_env(
        "iscsi-inq",
        &["-i", INITIATOR, &url],
        &[
            ("LIBISCSI_CHAP_TARGET_USERNAME", TARGET_USER),
            ("LIBISCSI_CHAP_TARGET_PASSWORD", "some-other-secret"),
        ],
    );
    assert_login_fails(&wrong, &d, "Invalid CHAP_R");
    // Only the initiator knows; the target says where to look.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !d
        .output()
        .contains("right after the target's mutual CHAP answer")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no log line for the refused target:\n{}",
            d.output()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // And another target name.
    let wrong_name = run_env(
        "iscsi-inq",
        &["-i", INITIATOR, &url],
        &[
            ("LIBISCSI_CHAP_TARGET_USERNAME", "someone-else"),
            ("LIBISCSI_CHAP_TARGET_PASSWORD", TARGET_SECRET),
        ],
    );
    assert_login_fails(&wrong_name, &d, "Wrong CHAP targetname");
    assert!(!d.output().contains(TARGET_SECRET));
}

#[test]
fn mutual_chap_without_target_credentials_fails() {
    let d = ConfigDaemon::start(&chap_target(""));
    let r = run_env(
        "iscsi-inq",
        &["-i", INITIATOR, &d.url(Some((USER, SECRET)), Some(TARGET))],
        &[
            ("LIBISCSI_CHAP_TARGET_USERNAME", TARGET_USER),
            ("LIBISCSI_CHAP_TARGET_PASSWORD", TARGET_SECRET),
        ],
    );
    assert_login_fails(&r, &d, "Authentication failure");
}

#[test]
fn discovery_chap_is_separate_from_the_targets() {
    let body = format!(
        r#"{DEVICE}
[discovery]
auth = "chap"
users = [ {{ user = "{DISCOVERY_USER}", secret = "{DISCOVERY_SECRET}" }} ]

[[target]]
iqn = "{OPEN_TARGET}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#
    );
    let d = ConfigDaemon::start(&body);
    let ok = ls(&d, INITIATOR, Some((DISCOVERY_USER, DISCOVERY_SECRET)));
    assert_ok(&ok, &d);
    assert_eq!(listed(&ok), [OPEN_TARGET], "{}", ok.describe());
    let wrong = ls(&d, INITIATOR, Some((DISCOVERY_USER, "wrong-discovery-26")));
    assert_login_fails(&wrong, &d, "Authentication failure");
    let none = ls(&d, INITIATOR, None);
    assert_login_fails(&none, &d, "Authentication failure");
    // The target itself needs no CHAP.
    assert_ok(&inq(&d, INITIATOR, None, OPEN_TARGET), &d);
}

#[test]
fn initiator_outside_the_acl_sees_nothing_and_cannot_log_in() {
    let body = format!(
        r#"{DEVICE}
[[target]]
iqn = "{TARGET}"

  [[target.group]]
  name = "only-a"
  initiators = ["{INITIATOR}"]
  luns = [ {{ lun = 0, device = "disk" }} ]
"#
    );
    let d = ConfigDaemon::start(&body);
    let member = ls(&d, INITIATOR, None);
    assert_ok(&member, &d);
    assert_eq!(listed(&member), [TARGET]);
    let stranger = ls(&d, STRANGER, None);
    assert_ok(&stranger, &d);
    assert!(listed(&stranger).is_empty(), "{}", stranger.describe());
    assert_ok(&inq(&d, INITIATOR, None, TARGET), &d);
    let refused = inq(&d, STRANGER, None, TARGET);
    assert_login_fails(&refused, &d, "Authorization failure");
    assert_refusal_logged(&d, STRANGER, TARGET);
}

/// The daemon's refusal line names the initiator and target the Login Request carried.
fn assert_refusal_logged(d: &ConfigDaemon, initiator: &str, target: &str) {
    let out = d.output();
    let line = out
        .lines()
        .find(|l| l.contains("login failed: 0202"))
        .unwrap_or_else(|| panic!("no refusal line:\n{out}"));
    assert!(
        line.contains(&format!("initiator=\"{initiator}\""))
            && line.contains(&format!("target=\"{target}\""))
            && !line.contains("(unnamed)"),
        "the refusal names who and what: {line}"
    );
}

#[test]
fn source_address_restrictions_hide_and_refuse() {
    let body = format!(
        r#"{DEVICE}
[[target]]
iqn = "{TARGET}"
allowed_sources = ["10.0.0.0/8"]

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]

[[target]]
iqn = "{OPEN_TARGET}"
allowed_sources = ["127.0.0.0/8", "::1/128"]

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#
    );
    let d = ConfigDaemon::start(&body);
    let found = ls(&d, INITIATOR, None);
    assert_ok(&found, &d);
    assert_eq!(listed(&found), [OPEN_TARGET], "{}", found.describe());
    let refused = inq(&d, INITIATOR, None, TARGET);
    assert_login_fails(&refused, &d, "Authorization failure");
    assert!(
        d.output().contains("allowed_sources"),
        "the refusal is logged:\n{}",
        d.output()
    );
    assert_refusal_logged(&d, INITIATOR, TARGET);
    assert_ok(&inq(&d, INITIATOR, None, OPEN_TARGET), &d);
}

#[test]
fn repeated_failures_from_one_address_are_refused_for_a_while() {
    let body = chap_target("").replace(
        "login_failures_max = 100",
        "login_failures_max = 2\nlogin_failure_window_s = 600",
    );
    let d = ConfigDaemon::start(&body);
    for _ in 0..2 {
        let r = inq(&d, INITIATOR, Some((USER, "not-the-secret-26")), TARGET);
        assert_login_fails(&r, &d, "Authentication failure");
    }
    // Now even the right secret is refused, with Service unavailable.
    let r = inq(&d, INITIATOR, Some((USER, SECRET)), TARGET);
    assert_login_fails(&r, &d, "Service unavailable");
    assert!(
        d.output().contains("too many failed logins"),
        "{}",
        d.output()
    );
}

#[test]
fn secret_files_are_read_and_checked() {
    use std::os::unix::fs::PermissionsExt as _;
    let scratch = Scratch::new("auth-secret");
    let file = scratch.file("alice");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let keys = |path: &Path| {
        format!(
            r#"users = [ {{ user = "{USER}", secret_file = "{}" }} ]"#,
            path.display()
        )
    };
    let body = chap_target("").replace(
        &format!(r#"users = [ {{ user = "{USER}", secret = "{SECRET}" }} ]"#),
        &keys(&file),
    );
    let d = ConfigDaemon::start(&body);
    assert_ok(&inq(&d, INITIATOR, Some((USER, SECRET)), TARGET), &d);
    drop(d);

    // A world-readable secret file is a config error, reported by check-config.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let config = scratch.file("bad.toml");
    std::fs::write(
        &config,
        format!("[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n{body}"),
    )
    .unwrap();
    let r = run_path_plain(
        Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["check-config", config.to_str().unwrap()],
    );
    let text = format!("{}{}", r.stdout, r.stderr);
    assert!(!r.success(), "{}", r.describe());
    assert!(
        text.contains("secret_file") && text.contains("chmod 600"),
        "{}",
        r.describe()
    );
    assert!(!text.contains(SECRET), "{}", r.describe());
}

fn run_path_plain(program: &Path, args: &[&str]) -> Run {
    common::run_path(program, args)
}

/// The authorization bypass of docs/SECURITY.md (2026-11-24): initiator names were compared
/// two ways — the group lookup behind authentication folded non-ASCII case, the one behind the
/// LUN map folded ASCII only — so `…:É`, listed as `…:é` in a group without CHAP, logged in
/// without credentials and got the CHAP-protected any-initiator group's 48 MiB LU. Now every
/// spelling of a name is one identity (RFC 3722): `…:É` is `…:é`, gets the 16 MiB LU of its
/// own group, and every other initiator still needs CHAP for the 48 MiB one.
#[test]
fn one_identity_decides_authentication_and_lun_map() {
    let d = ConfigDaemon::start(
        r#"
[limits]
login_failures_max = 100

[[device]]
name = "plain-disk"
store = "ram"
size = "16M"

[[device]]
name = "protected-disk"
store = "ram"
size = "48M"

[[target]]
iqn = "iqn.2026-11.test:target"

  [[target.group]]
  name = "plain"
  auth = "none"
  initiators = ["iqn.2026-11.test:é"]
  luns = [ { lun = 0, device = "plain-disk" } ]

  [[target.group]]
  name = "protected"
  any_initiator = true
  auth = "chap"
  users = [ { user = "prot", secret = "protected-s3cret-2026" } ]
  luns = [ { lun = 0, device = "protected-disk" } ]
"#,
    );
    let capacity = |initiator: &str, creds: Option<(&str, &str)>| {
        run(
            "iscsi-readcapacity16",
            &[
                "-i",
                initiator,
                &d.url(creds, Some("iqn.2026-11.test:target")),
            ],
        )
    };
    let last_lba = |r: &Run| {
        r.stdout
            .lines()
            .find_map(|l| l.strip_prefix("RETURNED LOGICAL BLOCK ADDRESS:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    const PLAIN_LAST_LBA: u64 = (16 << 20) / 512 - 1;
    const PROTECTED_LAST_LBA: u64 = (48 << 20) / 512 - 1;
    // Every spelling of the listed name: its own group, no CHAP, the 16 MiB LU.
    for spelling in [
        "iqn.2026-11.test:é",
        "iqn.2026-11.test:É",
        "IQN.2026-11.TEST:É",
        "iqn.2026-11.test:e\u{301}",
    ] {
        let r = capacity(spelling, None);
        assert_ok(&r, &d);
        assert_eq!(
            last_lba(&r),
            Some(PLAIN_LAST_LBA),
            "{spelling:?} is the `plain` member: {}",
            r.describe()
        );
    }
    // Anyone else is in `protected`: no login without CHAP, the 48 MiB LU with it.
    let stranger = "iqn.2026-11.test:e";
    assert_login_fails(&capacity(stranger, None), &d, "Authentication failure");
    let r = capacity(stranger, Some(("prot", "protected-s3cret-2026")));
    assert_ok(&r, &d);
    assert_eq!(last_lba(&r), Some(PROTECTED_LAST_LBA), "{}", r.describe());
    // Sessions are logged under the name's one normal form.
    let log = d.output();
    assert!(
        !log.contains("initiator=iqn.2026-11.test:É"),
        "names are logged normalised:\n{log}"
    );
}
