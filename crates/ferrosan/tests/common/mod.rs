//! Harness for the ferrosan binary's integration tests: start the daemon on a
//! free loopback port, wait until it accepts, run real initiators (libiscsi
//! tools, qemu-img) against it with a timeout, and always stop the daemon
//! (kill + wait on Drop), so a failing test never leaks a process.
//!
//! Missing initiator tools are a test failure, never a silent pass: run
//! `scripts/test.sh`, which installs them.
#![allow(dead_code)] // each test file uses a different part of the harness

pub mod array;
pub mod ceph;
pub mod loopfs;
pub mod nvme_host;
pub mod raw;
pub mod tgt;

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long the daemon may take to accept connections after spawning.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Config text for a 16 MiB RAM device, LUN 0 of target `iqn`, open to any initiator, served
/// on every portal group: the tail of a `Daemon::start_config` body.
pub fn open_ram_target(iqn: &str) -> String {
    format!(
        r#"
[[device]]
name = "mem"
store = "ram"
size = "16M"

[[target]]
iqn = "{iqn}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "mem" }} ]
"#
    )
}

/// How long one initiator command may run before it is killed.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

pub const IQN: &str = "iqn.2024-01.dev.ferrosan:itest";

/// A private scratch directory, removed on Drop.
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "ferrosan-itest-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).expect("create scratch dir");
        Scratch { path }
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

/// A fresh directory on the disk filesystem the build lives on (cargo's per-target scratch
/// dir): the temp dir may be tmpfs, which has no direct I/O and never waits for a device.
/// `tag` keeps concurrent tests apart; the caller removes it.
pub fn disk_dir(tag: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create a scratch dir under CARGO_TARGET_TMPDIR");
    dir
}

/// A loop device over a file on the disk (`losetup` with `options`); detached, and its
/// directory removed, on drop. None (with the reason on stderr) without root or loop devices.
pub struct LoopDevice {
    pub device: String,
    /// The file behind it (tests grow or shrink it under the device).
    pub backing: PathBuf,
    dir: PathBuf,
}

impl LoopDevice {
    pub fn attach(tag: &str, bytes: u64, options: &[&str]) -> Option<LoopDevice> {
        LoopDevice::attach_in(disk_dir(tag), bytes, options)
    }

    /// Like [`LoopDevice::attach`], over a file in `dir` (removed with it on drop).
    pub fn attach_in(dir: PathBuf, bytes: u64, options: &[&str]) -> Option<LoopDevice> {
        let backing = dir.join("backing.img");
        File::create(&backing).ok()?.set_len(bytes).ok()?;
        let out = Command::new("losetup")
            .args(options)
            .args(["-f", "--show"])
            .arg(&backing)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!("losetup: {}", String::from_utf8_lossy(&out.stderr));
            let _ = fs::remove_dir_all(&dir);
            return None;
        }
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Some(LoopDevice {
            device,
            backing,
            dir,
        })
    }

    /// Sets the backing file's length (what the device sees after `losetup -c`, or at once
    /// for reads past the new end).
    pub fn set_backing_len(&self, bytes: u64) {
        File::options()
            .write(true)
            .open(&self.backing)
            .and_then(|f| f.set_len(bytes))
            .expect("resize the loop device's backing file");
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.device]).status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// A loopback port nothing listens on right now, below the kernel's ephemeral range (as
/// `scripts/lib/common.sh` picks them): a port from `bind(0)` lies in that range, so between
/// this check and the daemon's bind it can become the local end of one of the tests' own
/// outgoing connections ("Address already in use", seen in CI with the shell twin).
pub fn free_port() -> u16 {
    static TURN: AtomicU32 = AtomicU32::new(0);
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .filter(|&low| low > 11_000 && low <= 65_535)
        .unwrap_or(32_768);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // Spread the guesses of concurrent tests (and processes) apart.
    // Never 0 (xorshift's fixed point).
    let mut x =
        (nanos ^ std::process::id().rotate_left(16) ^ TURN.fetch_add(0x9e37, Ordering::Relaxed))
            | 1;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let port = (10_000 + x % (low - 10_000)) as u16;
        // A port handed to one test of this process is never handed to another: two tests
        // that each picked it before either daemon bound it would collide (a metrics port
        // "already in use", seen in CI).
        let fresh = HANDED_OUT
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(port);
        if fresh && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {low}");
}

/// Fail (never skip) when an initiator tool is missing.
pub fn require_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin")]) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "`{name}` is not installed: these tests need real initiators. \
         Run scripts/test.sh (it installs libiscsi-bin, qemu-utils and qemu-block-extra), \
         or apt-get install libiscsi-bin qemu-utils qemu-block-extra"
    );
}

/// An iSCSI session of `initiator` to `target` at `addr` (`HOST:PORT`), on LUN `lun`: its
/// login bounded to 10 s, its commands to `command_timeout`.
pub fn iscsi_session(
    addr: &str,
    target: &str,
    initiator: &str,
    lun: u64,
    command_timeout: Duration,
) -> Result<initiator::driver::Client, initiator::Error> {
    use initiator::{ClientConfig, SessionConfig, SessionKind};
    let mut session = SessionConfig::new(
        initiator,
        SessionKind::Normal {
            target_name: target.into(),
        },
    );
    session.command_timeout = command_timeout;
    let mut config = ClientConfig::new(addr.to_string(), session);
    config.timeouts.login = Duration::from_secs(10);
    config.lun = lun;
    initiator::driver::Client::connect(config)
}

/// A running ferrosan daemon. Stopped (and reaped) on Drop.
pub struct Daemon {
    child: Option<Child>,
    /// The address its portal is reached on (loopback unless started in a namespace).
    pub host: String,
    pub port: u16,
    pub iqn: String,
    args: Vec<String>,
    /// A program that execs the daemon with its arguments (e.g. `prlimit --nofile=...`), kept
    /// for restarts; empty to run the daemon directly.
    launcher: Vec<String>,
    log: PathBuf,
    _scratch: Scratch,
}

impl Daemon {
    /// `ferrosan serve --listen 127.0.0.1:PORT --target IQN --lun L...`
    pub fn start(luns: &[&str]) -> Daemon {
        Daemon::start_with(IQN, luns)
    }

    pub fn start_with(iqn: &str, luns: &[&str]) -> Daemon {
        Daemon::start_with_args(iqn, luns, &[])
    }

    /// Like `start_with`, with extra `serve` options (e.g. `--metrics-listen ADDR`).
    pub fn start_with_args(iqn: &str, luns: &[&str], extra: &[&str]) -> Daemon {
        Daemon::start_launched(&[], iqn, luns, extra)
    }

    /// Like `start_with_args`, run through `launcher`, a program that execs the daemon (so
    /// `pid()` is still the daemon's), e.g. `["prlimit", "--nofile=256:4096"]`.
    pub fn start_launched(launcher: &[&str], iqn: &str, luns: &[&str], extra: &[&str]) -> Daemon {
        let scratch = Scratch::new("daemon");
        let port = free_port();
        let mut args = vec![
            "serve".to_string(),
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--target".to_string(),
            iqn.to_string(),
        ];
        for lun in luns {
            args.push("--lun".to_string());
            args.push(lun.to_string());
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut daemon = Daemon::new(iqn, port, args, scratch);
        daemon.launcher = launcher.iter().map(|a| a.to_string()).collect();
        daemon.spawn();
        daemon
    }

    /// `ferrosan serve --config FILE`, FILE holding a portal group (tag 1) on a free loopback
    /// port followed by `body`, which defines the target `iqn`.
    pub fn start_config(iqn: &str, body: &str) -> Daemon {
        Daemon::start_config_args(iqn, body, &[])
    }

    /// Like `start_config`, with extra `serve` options.
    pub fn start_config_args(iqn: &str, body: &str, extra: &[&str]) -> Daemon {
        let port = free_port();
        let text = format!("[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:{port}\"]\n\n{body}");
        Daemon::start_config_text(iqn, port, &text, extra)
    }

    /// `ferrosan serve --config FILE` with `text` as the whole file, reached on `port` (one of
    /// its portals), with extra `serve` options.
    pub fn start_config_text(iqn: &str, port: u16, text: &str, extra: &[&str]) -> Daemon {
        let scratch = Scratch::new("daemon");
        let config = scratch.file("ferrosan.toml");
        fs::write(&config, text).expect("write config");
        let mut args = vec![
            "serve".to_string(),
            "--config".to_string(),
            config.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut daemon = Daemon::new(iqn, port, args, scratch);
        daemon.spawn();
        daemon
    }

    /// Like `start_config_text`, run through `launcher` (e.g. `ip netns exec NS`) and reached
    /// on `host:port`.
    pub fn start_config_launched(
        launcher: &[&str],
        (host, port): (&str, u16),
        iqn: &str,
        text: &str,
        extra: &[&str],
    ) -> Daemon {
        let scratch = Scratch::new("daemon");
        let config = scratch.file("ferrosan.toml");
        fs::write(&config, text).expect("write config");
        let mut args = vec!["serve".to_string(), "--config".to_string()];
        args.push(config.display().to_string());
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut daemon = Daemon::new(iqn, port, args, scratch);
        daemon.launcher = launcher.iter().map(|a| a.to_string()).collect();
        daemon.host = host.to_string();
        daemon.spawn();
        daemon
    }

    /// Not started yet.
    fn new(iqn: &str, port: u16, args: Vec<String>, scratch: Scratch) -> Daemon {
        let log = scratch.file("daemon.log");
        Daemon {
            child: None,
            host: "127.0.0.1".to_string(),
            port,
            iqn: iqn.to_string(),
            args,
            launcher: Vec::new(),
            log,
            _scratch: scratch,
        }
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        let log = File::create(&self.log).expect("create daemon log");
        let daemon = env!("CARGO_BIN_EXE_ferrosan");
        let mut command = match self.launcher.split_first() {
            Some((program, options)) => {
                let mut c = Command::new(program);
                c.args(options).arg(daemon);
                c
            }
            None => Command::new(daemon),
        };
        let child = command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .expect("spawn ferrosan");
        self.child = Some(child);
        let addr: SocketAddr = format!("{}:{}", self.host, self.port).parse().unwrap();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().expect("try_wait") {
                self.child = None;
                panic!(
                    "ferrosan {:?} exited ({status}) before listening on {addr}; its output:\n{}",
                    self.args,
                    self.output()
                );
            }
            // Its banner first: a connect alone can succeed before the daemon listens (a TCP
            // self-connect from an ephemeral port equal to the chosen one, or another test's
            // daemon that raced for the same free port); seen once in CI.
            if self.output().contains(" serving on ")
                && TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            {
                return;
            }
            if Instant::now() > deadline {
                self.stop();
                panic!(
                    "ferrosan {:?} did not accept connections on {addr} within {:?}; its output:\n{}",
                    self.args,
                    STARTUP_TIMEOUT,
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop gracefully (SIGTERM, 5 s), then SIGKILL; always reaped.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Sends a signal ("TERM", "INT", ...) to the daemon, by PID.
    pub fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("daemon running");
        let status = Command::new("kill")
            .args([&format!("-{name}"), &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
        if name == "STOP" {
            wait_stopped(child.id());
        }
    }

    /// Waits up to `within` for the daemon to exit on its own; its exit status if it did.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stop, then start again with the same arguments and port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The daemon's process ID (for /proc measurements), while it runs.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    /// Everything the daemon printed so far (stdout and stderr).
    pub fn output(&self) -> String {
        read_lossy(&self.log)
    }

    /// A path in the daemon's private scratch directory (its config is `ferrosan.toml`).
    pub fn file(&self, name: &str) -> PathBuf {
        self._scratch.file(name)
    }

    pub fn portal(&self) -> String {
        format!("iscsi://{}:{}", self.host, self.port)
    }

    pub fn url(&self, lun: u32) -> String {
        format!("iscsi://{}:{}/{}/{lun}", self.host, self.port, self.iqn)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What one tool run produced.
#[derive(Debug)]
pub struct Run {
    pub cmdline: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Panic (with the whole output and the daemon's log) unless it succeeded.
    pub fn expect_ok(self, daemon: &Daemon) -> Run {
        assert!(
            self.success(),
            "`{}` failed ({})\n--- stdout\n{}\n--- stderr\n{}\n--- daemon output\n{}",
            self.cmdline,
            self.status,
            self.stdout,
            self.stderr,
            daemon.output()
        );
        self
    }

    pub fn describe(&self) -> String {
        format!(
            "`{}` ({})\n--- stdout\n{}\n--- stderr\n{}",
            self.cmdline, self.status, self.stdout, self.stderr
        )
    }
}

/// A file's contents as text; tools print raw binary fields (iscsi-inq shows
/// an NAA designator's bytes as-is), so invalid UTF-8 is replaced, not fatal.
pub fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Run a tool (which must be installed) with a timeout; output captured.
pub fn run(tool: &str, args: &[&str]) -> Run {
    run_path(&require_tool(tool), args)
}

/// Run a program by path with [`TOOL_TIMEOUT`]; output captured via files so
/// that a chatty tool can never block on a full pipe.
pub fn run_path(program: &Path, args: &[&str]) -> Run {
    run_path_env(program, args, &[])
}

/// Like [`run_path`], with extra environment variables. libiscsi reads CHAP credentials from
/// `LIBISCSI_CHAP_*`: those are cleared first so the caller's environment never leaks in.
pub fn run_path_env(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let scratch = Scratch::new("run");
    let out_path = scratch.file("stdout");
    let err_path = scratch.file("stderr");
    let assignments: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    let cmdline = format!(
        "{}{} {}",
        assignments.concat(),
        program.display(),
        args.join(" ")
    );
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("stdout file"))
        .stderr(File::create(&err_path).expect("stderr file"));
    for var in [
        "LIBISCSI_CHAP_USERNAME",
        "LIBISCSI_CHAP_PASSWORD",
        "LIBISCSI_CHAP_TARGET_USERNAME",
        "LIBISCSI_CHAP_TARGET_PASSWORD",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{cmdline}`: {e}"));
    let deadline = Instant::now() + TOOL_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`{cmdline}` did not finish within {TOOL_TIMEOUT:?}; output so far:\n{}\n{}",
                read_lossy(&out_path),
                read_lossy(&err_path)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        cmdline,
        status,
        stdout: read_lossy(&out_path),
        stderr: read_lossy(&err_path),
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
pub fn pseudo_random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The sizes `iscsi-ls -s` may print for a LUN of `bytes` bytes: libiscsi
/// 1.19 prints the size rounded down in its unit, computed from the last
/// LBA (so 64 MiB prints as "63M" against tgt); accept that and the exact one.
pub fn iscsi_ls_sizes(bytes: u64) -> Vec<String> {
    let mib = bytes >> 20;
    let mut sizes = vec![format!("{mib}M")];
    if mib > 0 {
        sizes.push(format!("{}M", mib - 1));
    }
    if bytes >= 1 << 30 {
        sizes.push(format!("{}G", bytes >> 30));
    }
    sizes
}

/// Whether this kernel has cachestat(2) (Linux 6.5+), without which nothing is sent from the
/// page cache.
pub fn kernel_has_cachestat() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let (major, minor) = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    (major, minor) >= (6, 5)
}

/// `GET /metrics` from the daemon's metrics endpoint on `port`; asserts a 200 answer.
pub fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .expect("read the metrics answer");
    assert!(answer.starts_with("HTTP/1.0 200 OK"), "{answer}");
    answer
}

/// The value of one series (`name{labels}`) in a Prometheus text scrape; 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse::<f64>().unwrap_or(-1.0))
        })
        .unwrap_or(0.0)
}

/// Polls the endpoint until `series` satisfies `want` (connections report once a second and
/// when they close), for at most 5 s; returns the last scrape.
pub fn wait_for_metric(metrics_port: u16, series: &str, want: impl Fn(f64) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = scrape(metrics_port);
        if want(metric(&text, series)) || std::time::Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `qemu-img convert` of a raw image onto the LUN at `url` (no target creation: -n).
pub fn convert_to(url: &str, image: &str) -> Run {
    run(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", image, url],
    )
}

/// [`convert_to`] LUN `lun` of `daemon`, which must succeed.
pub fn upload(daemon: &Daemon, lun: u32, image: &str) {
    convert_to(&daemon.url(lun), image).expect_ok(daemon);
}

/// `qemu-img compare` says LUN `lun` is identical to the raw image (a LUN larger than the image
/// must be zero beyond it, which compare checks too).
pub fn assert_identical(daemon: &Daemon, lun: u32, image: &str) {
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", image, &daemon.url(lun)],
    );
    assert!(
        out.success() && out.stdout.contains("Images are identical"),
        "LUN {lun} differs from {image}:\n{}\n--- daemon output\n{}",
        out.describe(),
        daemon.output()
    );
}

/// Waits until every thread of process `pid` is stopped (SIGSTOP). `kill` returns before that:
/// one thread takes the stop and then stops the others, and under load that thread may not run
/// for tens of milliseconds, while the rest of the process goes on serving (a daemon "hung" by
/// SIGSTOP answered a command sent after `kill` returned, in a loaded run).
pub fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let all_stopped = || -> Option<bool> {
        let mut any = false;
        for task in fs::read_dir(format!("/proc/{pid}/task")).ok()? {
            let stat = fs::read_to_string(task.ok()?.path().join("stat")).ok()?;
            // The state follows the command name's closing parenthesis.
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            if !matches!(state, 'T' | 't') {
                return Some(false);
            }
            any = true;
        }
        Some(any)
    };
    while all_stopped() != Some(true) {
        assert!(
            Instant::now() < deadline,
            "process {pid} did not stop within 10 s of SIGSTOP"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether the tests run as root (the effective user id, from /proc): some need to act as
/// another user or on devices.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|u| u.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// `ferrosan ctl` against one daemon's control socket, or its remote API.
#[derive(Clone)]
pub struct Ctl {
    pub socket: PathBuf,
    /// The remote API instead: its URL, an admin token's file and the CA file.
    pub remote: Option<(String, PathBuf, PathBuf)>,
    /// The socket's private directory when [`Ctl::new`] made it: removed when the last
    /// clone is dropped (after the daemons declared after it).
    dir: Option<std::sync::Arc<Scratch>>,
}

impl Ctl {
    /// A socket path in a fresh private directory, for `serve --control-socket`.
    pub fn new() -> Ctl {
        let dir = Scratch::new("ctl");
        Ctl {
            socket: dir.file("control.sock"),
            remote: None,
            dir: Some(std::sync::Arc::new(dir)),
        }
    }

    /// `ferrosan ctl` on the socket at `socket`.
    pub fn at(socket: PathBuf) -> Ctl {
        Ctl {
            socket,
            remote: None,
            dir: None,
        }
    }

    /// The same daemon through its remote API at `url` (its certificate in `state`), as an
    /// admin token made over the socket.
    pub fn over_api(&self, url: &str, state: &Path) -> Ctl {
        let made = self.json(&["token", "create", "tests", "--role", "admin"]);
        assert_eq!(made["ok"], true, "{made}");
        let token = self.socket.with_file_name("admin.token");
        fs::write(&token, format!("{}\n", made["token"].as_str().unwrap())).unwrap();
        Ctl {
            socket: self.socket.clone(),
            remote: Some((url.to_string(), token, state.join("api-cert.pem"))),
            dir: self.dir.clone(),
        }
    }

    /// `ctl` and where it reaches the daemon.
    fn prefix(&self) -> Vec<String> {
        let mut all = vec!["ctl".to_string()];
        match &self.remote {
            None => all.extend(["--socket".into(), self.socket.display().to_string()]),
            Some((url, token, ca)) => all.extend([
                "--url".into(),
                url.clone(),
                "--token-file".into(),
                token.display().to_string(),
                "--ca-file".into(),
                ca.display().to_string(),
            ]),
        }
        all
    }

    pub fn run(&self, args: &[&str]) -> Run {
        let prefix = self.prefix();
        let mut all: Vec<&str> = prefix.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        run_path(Path::new(env!("CARGO_BIN_EXE_ferrosan")), &all)
    }

    pub fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let r = self.run(&all);
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.describe()))
    }

    /// `ctl chap set ARGS...` with the secret on stdin, as an operator types it.
    pub fn chap_set(&self, args: &[&str], secret: &[u8]) -> std::process::Output {
        let child = Command::new(env!("CARGO_BIN_EXE_ferrosan"))
            .args(self.prefix())
            .args(["chap", "set"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.as_ref().unwrap().write_all(secret).unwrap();
        child.wait_with_output().unwrap()
    }

    /// `ctl chap set ARGS...` on a terminal (util-linux `script` gives it one), `lines` typed
    /// a second apart once it has had time to prompt; what the terminal showed.
    pub fn chap_set_on_terminal(&self, args: &[&str], lines: &[&str]) -> std::process::Output {
        let command = format!(
            "{} {} chap set {}",
            env!("CARGO_BIN_EXE_ferrosan"),
            self.prefix().join(" "),
            args.join(" ")
        );
        let typed: String = lines
            .iter()
            .map(|l| format!("sleep 1; printf '%s\\r' '{l}'; "))
            .collect();
        Command::new("bash")
            .arg("-c")
            .arg(format!(
                "({typed}sleep 1) | script -qec '{command}' /dev/null"
            ))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    pub fn sessions(&self) -> Vec<Value> {
        let v = self.json(&["sessions"]);
        assert_eq!(v["ok"], true, "{v}");
        v["sessions"].as_array().cloned().unwrap_or_default()
    }
}

/// The head of a config for an array with a remote API: a directory pool `pool` at
/// `pool_path`, the API on `api_port`, its state (and self-signed certificate) in `state`, the
/// control socket `ctl`'s, one portal on `port`. The caller adds devices and targets.
pub fn api_array_config(
    pool: &str,
    pool_path: &Path,
    api_port: u16,
    state: &Path,
    ctl: &Ctl,
    port: u16,
) -> String {
    format!(
        r#"[[pool]]
name = "{pool}"
path = "{}"

[server]
api_listen = "127.0.0.1:{api_port}"
state_dir = "{}"
control_socket = "{}"

[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]
"#,
        pool_path.display(),
        state.display(),
        ctl.socket.display()
    )
}
