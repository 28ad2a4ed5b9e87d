//! The daemon raises its soft limit on open descriptors to the hard one at start (a shell's
//! soft limit, often 1,024, would run out at about half of the default `max_connections`), and
//! warns when even the hard limit is below what `max_connections` may need.

mod common;

use std::fs::{self, File};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, require_tool, Scratch};

/// Stops the daemon however the test ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `ferrosan serve` under `prlimit --nofile=SOFT:HARD` (which execs it, keeping the
/// PID), waits for its banner, and returns its soft and hard limits and its output.
fn limits_under(soft: u32, hard: u32) -> (String, String, String) {
    let prlimit = require_tool("prlimit");
    let scratch = Scratch::new("descriptors");
    let log = scratch.file("daemon.log");
    let out = File::create(&log).expect("create log");
    let port = free_port();
    let child = Command::new(prlimit)
        .arg(format!("--nofile={soft}:{hard}"))
        .arg(env!("CARGO_BIN_EXE_ferrosan"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--target",
            "iqn.2024-01.dev.ferrosan:fd",
            "--lun",
            "ram:16M",
        ])
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup log"))
        .stderr(out)
        .spawn()
        .expect("spawn prlimit");
    let mut daemon = Running(child);
    let deadline = Instant::now() + Duration::from_secs(15);
    let output = loop {
        let output = fs::read_to_string(&log).unwrap_or_default();
        if output.contains(" serving on ") {
            break output;
        }
        if let Some(status) = daemon.0.try_wait().expect("try_wait") {
            panic!("ferrosan exited ({status}) before serving:\n{output}");
        }
        assert!(Instant::now() < deadline, "no banner:\n{output}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let limits = fs::read_to_string(format!("/proc/{}/limits", daemon.0.id())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("no open files line")
        .to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (soft_now, hard_now) = match fields.as_slice() {
        [_, _, _, soft, hard, ..] => (soft.to_string(), hard.to_string()),
        _ => panic!("unexpected limits line: {line}"),
    };
    (soft_now, hard_now, output)
}

/// This process's hard limit (the test may lower it for a child, not raise it unprivileged).
fn own_hard_limit() -> u64 {
    let limits = fs::read_to_string("/proc/self/limits").expect("own limits");
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .map_or(u64::MAX, |hard| hard.parse().unwrap_or(u64::MAX))
}

#[test]
fn the_soft_descriptor_limit_is_raised_to_the_hard_one() {
    let hard = own_hard_limit().min(8192);
    assert!(
        hard > 256,
        "the test needs a hard limit above 256, have {hard}"
    );
    let (soft_now, hard_now, output) = limits_under(256, hard as u32);
    let hard = hard.to_string();
    assert_eq!(
        (soft_now.as_str(), hard_now.as_str()),
        (hard.as_str(), hard.as_str()),
        "{output}"
    );
    // The default max_connections (1,024) needs 2,304; below that the warning is right.
    if own_hard_limit().min(8192) >= 2304 {
        assert!(
            !output.contains("descriptor limit"),
            "needless warning:\n{output}"
        );
    }
}

#[test]
fn a_hard_limit_too_low_for_max_connections_is_reported() {
    // Default max_connections (1,024) at up to two descriptors each needs more than 600.
    assert!(
        own_hard_limit() >= 600,
        "the test needs a hard limit of 600 or more"
    );
    let (soft, _, output) = limits_under(256, 600);
    assert_eq!(soft, "600", "{output}");
    assert!(
        output.contains("open descriptor limit 600 is below"),
        "no warning:\n{output}"
    );
}
