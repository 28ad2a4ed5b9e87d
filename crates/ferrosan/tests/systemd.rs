//! systemd integration without systemd: the daemon's sd_notify messages (READY once every
//! portal listens, RELOADING/READY around a SIGHUP reload, WATCHDOG keep-alives, STOPPING on
//! SIGTERM) arrive on a NOTIFY_SOCKET the test binds, and a CHAP secret is read from the
//! credentials directory LoadCredential= would provide.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, read_lossy, run, Scratch};

const IQN: &str = "iqn.2026-11.org.ferrosan:notify";

/// Kills the daemon if the test fails before it stops it.
struct Running(Child);
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The next notification that contains `want`, skipping others (keep-alives); panics after 10 s.
fn expect(socket: &UnixDatagram, want: &str, log: &std::path::Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        if let Ok(n) = socket.recv(&mut buf) {
            let message = String::from_utf8_lossy(&buf[..n]).to_string();
            if message.contains(want) {
                return message;
            }
        }
    }
    panic!("no {want} from the daemon; its log:\n{}", read_lossy(log));
}

#[test]
fn sd_notify_readiness_reload_watchdog_stop_and_credentials() {
    let scratch = Scratch::new("systemd");
    let notify_path = scratch.file("notify.sock");
    let socket = UnixDatagram::bind(&notify_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let credentials = scratch.file("credentials");
    std::fs::create_dir(&credentials).unwrap();
    let secret = credentials.join("chap-alice");
    std::fs::write(&secret, "alice-from-systemd\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o400)).unwrap();
    let port = free_port();
    let config = scratch.file("ferrosan.toml");
    std::fs::write(
        &config,
        format!(
            r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]
[[device]]
name = "d"
store = "ram"
size = "16M"
[[target]]
iqn = "{IQN}"
users = [ {{ user = "alice", secret_file = "$CREDENTIALS_DIRECTORY/chap-alice" }} ]
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "d" }} ]
"#
        ),
    )
    .unwrap();
    let log = scratch.file("daemon.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("CREDENTIALS_DIRECTORY", &credentials)
        .env("WATCHDOG_USEC", "400000")
        .env_remove("WATCHDOG_PID")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let mut daemon = Running(child);
    let pid = daemon.0.id().to_string();

    // READY=1 comes once the portal listens.
    let ready = expect(&socket, "READY=1", &log);
    assert!(ready.contains("STATUS=serving on 127.0.0.1:"), "{ready}");
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("the portal listens at READY");
    // Keep-alives at half of WATCHDOG_USEC.
    expect(&socket, "WATCHDOG=1", &log);

    // The secret came from the credentials directory.
    let url = |auth: &str| format!("iscsi://{auth}127.0.0.1:{port}/{IQN}/0");
    let with = run("iscsi-inq", &[&url("alice%alice-from-systemd@")]);
    assert!(with.success(), "{}\n{}", with.describe(), read_lossy(&log));
    assert!(!run("iscsi-inq", &[&url("")]).success(), "CHAP is required");

    // SIGHUP: RELOADING=1 with a timestamp, then READY=1 again.
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let reloading = expect(&socket, "RELOADING=1", &log);
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading}");
    expect(&socket, "READY=1", &log);

    // SIGTERM: STOPPING=1, then a clean exit.
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    expect(&socket, "STOPPING=1", &log);
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(daemon.0.try_wait().unwrap().unwrap().success());
}

/// dist/ferrosan.service as shipped.
fn shipped_unit() -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist/ferrosan.service"),
    )
    .unwrap()
}

/// The shipped unit in `scratch`, its binary this build (verify checks that ExecStart=
/// exists).
fn unit_in(scratch: &Scratch) -> std::path::PathBuf {
    let unit = scratch.file("ferrosan.service");
    let text = shipped_unit().replace("/usr/local/bin/ferrosan", env!("CARGO_BIN_EXE_ferrosan"));
    std::fs::write(&unit, text).unwrap();
    unit
}

#[test]
fn the_shipped_unit_verifies_and_is_hardened() {
    let analyze = common::require_tool("systemd-analyze");
    let scratch = Scratch::new("unit");
    let unit = unit_in(&scratch);
    let unit_arg = unit.display().to_string();
    let verify = common::run_path(&analyze, &["verify", &unit_arg]);
    assert!(
        verify.success() && verify.stderr.trim().is_empty(),
        "systemd-analyze verify:\n{}",
        verify.describe()
    );
    let security = common::run_path(&analyze, &["security", "--offline=true", &unit_arg]);
    let level: f64 = security
        .stdout
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for ferrosan.service:")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level:\n{}", security.describe()));
    eprintln!("systemd-analyze security: exposure {level}");
    assert!(level <= 2.0, "exposure {level}:\n{}", security.stdout);
}

/// The unit's ExecReload (what `systemctl reload ferrosan` runs) applies the file and fails,
/// saying why, when the daemon refuses it; SIGHUP could not answer.
#[test]
fn the_units_reload_fails_when_the_daemon_refuses_the_file() {
    let shipped = shipped_unit();
    let reload = shipped
        .lines()
        .find_map(|l| l.strip_prefix("ExecReload="))
        .expect("the unit has an ExecReload");
    let ctl = common::Ctl::new();
    let socket = ctl.socket.display().to_string();
    let iqn = "iqn.2026-11.org.ferrosan:reload";
    let body = "[[device]]\nname = \"m\"\nstore = \"ram\"\nsize = \"4M\"\n\n[[target]]\n\
                iqn = \"iqn.2026-11.org.ferrosan:reload\"\n  [[target.group]]\n  name = \"all\"\n  \
                any_initiator = true\n  luns = [ { lun = 0, device = \"m\" } ]\n";
    let daemon = common::Daemon::start_config_args(iqn, body, &["--control-socket", &socket]);
    let command = reload
        .replace("/usr/local/bin/ferrosan", env!("CARGO_BIN_EXE_ferrosan"))
        .replace("/run/ferrosan/control.sock", &socket);
    let run = || {
        std::process::Command::new("sh")
            .args(["-c", &command])
            .output()
            .unwrap()
    };
    let good = run();
    assert!(good.status.success(), "{good:?}");
    let path = daemon.file("ferrosan.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("size = \"4M\"", "size = \"lots\"")).unwrap();
    let refused = run();
    let said = String::from_utf8_lossy(&refused.stdout).to_string()
        + &String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "a refused reload succeeded: {said}"
    );
    assert!(
        said.contains("lots"),
        "the failure does not say why: {said}"
    );
    // Nothing changed: the daemon still serves its LUN.
    assert!(ctl.json(&["luns"])["ok"] == true);
}

/// `ferrosan systemd-dropin` opens the packaged unit to exactly what a config names beyond
/// RAM and /var/lib/ferrosan, and the unit with it still verifies.
#[test]
fn the_dropin_opens_the_unit_to_the_configs_devices_and_verifies() {
    let analyze = common::require_tool("systemd-analyze");
    let scratch = Scratch::new("dropin");
    let luns = scratch.file("luns dir");
    std::fs::create_dir_all(&luns).unwrap();
    let config = scratch.file("ferrosan.toml");
    let text = format!(
        "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n\n\
         [[device]]\nname = \"md\"\nstore = \"block\"\npath = \"/dev/md0\"\n\n\
         [[device]]\nname = \"old\"\nstore = \"block\"\npath = \"/dev/sdb\"\nread_only = true\n\n\
         [[device]]\nname = \"f\"\nstore = \"file\"\npath = \"{}/a.img\"\nsize = \"1G\"\n\n\
         [[device]]\nname = \"kept\"\nstore = \"file\"\npath = \"/var/lib/ferrosan/b.img\"\nsize = \"1G\"\n\n\
         [[target]]\niqn = \"iqn.2026-11.org.ferrosan:dropin\"\n  [[target.group]]\n  name = \"all\"\n  \
         any_initiator = true\n  luns = [ {{ lun = 0, device = \"md\" }}, {{ lun = 1, device = \"f\" }} ]\n",
        luns.display()
    );
    std::fs::write(&config, text).unwrap();
    let out = common::run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["systemd-dropin", "--config", &config.display().to_string()],
    );
    assert!(out.success(), "{}", out.describe());
    let dropin = out.stdout;
    for line in [
        "PrivateDevices=no",
        "DeviceAllow=/dev/md0 rw",
        "DeviceAllow=/dev/sdb r",
        "#SupplementaryGroups=disk",
        &format!("ReadWritePaths=\"{}\"", luns.display()),
    ] {
        assert!(
            dropin.lines().any(|l| l == line),
            "no {line:?} in:\n{dropin}"
        );
    }
    assert!(
        !dropin.contains("/var/lib/ferrosan\n") && !dropin.contains("ProtectHome"),
        "{dropin}"
    );
    // The nodes go to the group ferrosan by a udev rule, not the unit to the group disk.
    assert!(
        !dropin.lines().any(|l| l == "SupplementaryGroups=disk"),
        "{dropin}"
    );
    let udev = common::run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &[
            "systemd-dropin",
            "--udev",
            "--config",
            &config.display().to_string(),
        ],
    );
    assert!(udev.success(), "{}", udev.describe());
    let rules: Vec<&str> = udev
        .stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect();
    assert_eq!(
        rules,
        [
            "SUBSYSTEM==\"block\", KERNEL==\"md0\", GROUP=\"ferrosan\", MODE=\"0660\"",
            "SUBSYSTEM==\"block\", KERNEL==\"sdb\", GROUP=\"ferrosan\", MODE=\"0640\"",
        ],
        "{}",
        udev.stdout
    );
    // The shipped unit with the drop-in beside it, as systemd would read them.
    let unit = unit_in(&scratch);
    let dir = scratch.file("ferrosan.service.d");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("devices.conf"), &dropin).unwrap();
    let verify = common::run_path(&analyze, &["verify", &unit.display().to_string()]);
    assert!(
        verify.success() && verify.stderr.trim().is_empty(),
        "systemd-analyze verify:\n{}",
        verify.describe()
    );
    // A config of RAM devices needs nothing.
    let ram = scratch.file("ram.toml");
    std::fs::write(
        &ram,
        "[[device]]\nname = \"m\"\nstore = \"ram\"\nsize = \"4M\"\n\n[[target]]\n\
         iqn = \"iqn.2026-11.org.ferrosan:dropin\"\n  [[target.group]]\n  name = \"all\"\n  \
         any_initiator = true\n  luns = [ { lun = 0, device = \"m\" } ]\n\
         [[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n",
    )
    .unwrap();
    let none = common::run_path(
        std::path::Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["systemd-dropin", "--config", &ram.display().to_string()],
    );
    assert!(
        none.stdout.contains("Nothing to add"),
        "{}",
        none.describe()
    );
}
