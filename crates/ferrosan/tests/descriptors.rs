//! The daemon raises its soft limit on open descriptors to the hard one at start (a shell's
//! soft limit, often 1,024, would run out at about half of the default `max_connections`), and
//! warns when even the hard limit is below what `max_connections` may need.

mod common;

use std::fs;

use common::{require_tool, Daemon};

/// The `Max open files` soft and hard limits of process `pid` ("unlimited" or a number).
fn open_files_limits(pid: &str) -> (String, String) {
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("no open files line");
    match line.split_whitespace().collect::<Vec<_>>().as_slice() {
        [_, _, _, soft, hard, ..] => (soft.to_string(), hard.to_string()),
        _ => panic!("unexpected limits line: {line}"),
    }
}

/// This process's hard limit (the test may lower it for a child, not raise it unprivileged).
fn own_hard_limit() -> u64 {
    open_files_limits("self").1.parse().unwrap_or(u64::MAX)
}

/// The daemon started by `prlimit --nofile=SOFT:HARD` (which execs it, keeping the PID): its
/// soft and hard limits once it serves, and its output.
fn limits_under(soft: u64, hard: u64) -> (String, String, String) {
    let prlimit = require_tool("prlimit");
    let prlimit = prlimit.to_str().expect("prlimit path");
    let nofile = format!("--nofile={soft}:{hard}");
    let daemon = Daemon::start_launched(&[prlimit, &nofile], common::IQN, &["ram:16M"], &[]);
    let (soft_now, hard_now) = open_files_limits(&daemon.pid().to_string());
    (soft_now, hard_now, daemon.output())
}

#[test]
fn the_soft_descriptor_limit_is_raised_to_the_hard_one() {
    let hard = own_hard_limit().min(8192);
    assert!(
        hard > 256,
        "the test needs a hard limit above 256, have {hard}"
    );
    let (soft_now, hard_now, output) = limits_under(256, hard);
    let hard_text = hard.to_string();
    assert_eq!(
        (soft_now.as_str(), hard_now.as_str()),
        (hard_text.as_str(), hard_text.as_str()),
        "{output}"
    );
    // The default max_connections (1,024) needs 4,352; below that the warning is right.
    if hard >= 4352 {
        assert!(
            !output.contains("descriptor limit"),
            "needless warning:\n{output}"
        );
    }
}

#[test]
fn a_hard_limit_too_low_for_max_connections_is_reported() {
    // Default max_connections (1,024) at up to four descriptors each needs more than 600.
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
