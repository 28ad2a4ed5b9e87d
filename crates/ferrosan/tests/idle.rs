//! The connection timers (crates/engine/src/alarm.rs): `idle_timeout_s` closes a session whose
//! initiator sends nothing of its own accord for that long, while one that keeps sending (here:
//! its own NOP-Out pings) stays; `login_timeout_s` closes a connection that never completes its
//! login, while others log in meanwhile; a session with nothing due wakes nothing.

mod common;

use std::time::{Duration, Instant};

use common::raw::{self, Raw};
use common::Daemon;

const IQN: &str = "iqn.2024-01.dev.ferrosan:idle";

#[test]
fn an_idle_session_is_closed_and_a_busy_one_is_not() {
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[limits]\nidle_timeout_s = 2\n{}",
            common::open_ram_target(IQN)
        ),
    );
    let mut idle = Raw::login(daemon.port, IQN, 1);
    let mut busy = Raw::login(daemon.port, IQN, 2);
    let started = Instant::now();
    let mut itt = 1;
    // The busy session pings every 300 ms for 4 s, twice the limit.
    while started.elapsed() < Duration::from_secs(4) {
        busy.ping(itt);
        itt += 1;
        std::thread::sleep(Duration::from_millis(300));
    }
    busy.ping(itt);
    // The idle one was closed after 2-3 s (the check runs once a second), without a word.
    assert!(raw::until_closed(&mut idle.stream).is_empty());
    assert!(
        daemon.output().contains("closing idle session"),
        "{}",
        daemon.output()
    );
}

#[test]
fn a_login_that_never_completes_is_dropped_after_login_timeout_s() {
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[limits]\nlogin_timeout_s = 2\n{}",
            common::open_ram_target(IQN)
        ),
    );
    let started = Instant::now();
    // Half a login PDU, then nothing.
    let mut silent = raw::connect(daemon.port);
    std::io::Write::write_all(&mut silent, &[0x43; 20]).unwrap();
    // Meanwhile another connection logs in and is answered.
    let mut other = Raw::login(daemon.port, IQN, 3);
    other.ping(1);
    assert!(raw::until_closed(&mut silent).is_empty());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1_900) && waited < Duration::from_secs(4),
        "closed after {waited:?}, not about 2 s"
    );
    // The session that did log in outlives the limit.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(started.elapsed()));
    other.ping(2);
}

/// Voluntary context switches of the daemon's network worker threads so far: each time an
/// idle worker wakes and sleeps again is one (preemption by other processes on a busy machine
/// is not counted).
fn worker_switches(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("ferrosan-work") {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        total += status
            .lines()
            .filter(|l| l.starts_with("voluntary_ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    total
}

#[test]
fn idle_sessions_wake_no_worker() {
    // Without pings nothing is due: a session sleeps until its initiator sends or something
    // it follows changes (crates/engine/src/shared/nudge.rs).
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[server]\nworkers = 2\n[limits]\nnop_in_interval_s = 0\n{}",
            common::open_ram_target(IQN)
        ),
    );
    const SESSIONS: u8 = 40;
    let mut sessions: Vec<Raw> = (1..=SESSIONS)
        .map(|isid| Raw::login(daemon.port, IQN, isid))
        .collect();
    // Past the housekeeping that follows each login's work.
    std::thread::sleep(Duration::from_millis(1_500));
    let before = worker_switches(daemon.pid());
    let quiet = Duration::from_secs(4);
    std::thread::sleep(quiet);
    let woken = worker_switches(daemon.pid()) - before;
    eprintln!("{SESSIONS} idle sessions: the workers woke {woken} times in {quiet:?}");
    // Each worker's own once-a-second sample wakes it (8 in all); a second's tick per session
    // would be 160 more.
    assert!(
        woken <= 24,
        "{SESSIONS} idle sessions woke the workers {woken} times in {quiet:?}"
    );
    assert!(
        woken > 0,
        "the count is read (the workers sample once a second)"
    );
    // Each is still served.
    for (itt, s) in sessions.iter_mut().enumerate() {
        s.ping(itt as u32 + 1);
    }
}
