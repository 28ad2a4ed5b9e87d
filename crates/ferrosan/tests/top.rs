//! `ferrosan top` against a running qemu-img writer: the plain `--batch` frames and the
//! terminal UI (an 80-column tmux pane, read back with capture-pane) both show its session's
//! writes per second and p99 latency (the batch frames its queue depth and portal too); the
//! sort and filter keys act, and `q` quits.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{require_tool, run_path, Daemon, Scratch};

const IQN: &str = "iqn.2026-11.org.ferrosan:top";

/// The `header` column of the row naming qemu's initiator in a `top` screen or frame.
fn session_cell(screen: &str, header: &str) -> Option<String> {
    let head = screen.lines().find(|l| l.contains("INITIATOR"))?;
    let column = head
        .split(['│', ' '])
        .filter(|c| !c.is_empty())
        .position(|c| c == header)?;
    // At 80 columns the initiator's name keeps its end (…org.linux-kvm).
    let row = screen.lines().find(|l| l.contains("linux-kvm"))?;
    row.split(['│', ' '])
        .filter(|c| !c.is_empty())
        .nth(column)
        .map(str::to_string)
}

/// The WRITE/s column of the row naming qemu's initiator.
fn writes_per_second(screen: &str) -> Option<u64> {
    session_cell(screen, "WRITE/s")?.parse().ok()
}

#[test]
fn top_shows_a_running_sessions_iops_in_batch_and_in_a_terminal() {
    let scratch = Scratch::new("top");
    let socket = scratch.file("control.sock");
    let s = socket.display().to_string();
    let mut daemon = Daemon::start_with_args(IQN, &["ram:64M"], &["--control-socket", &s]);
    // Killed and reaped even if an assertion below fails.
    struct Writer(std::process::Child);
    impl Drop for Writer {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _writer = Writer(
        Command::new(require_tool("qemu-img"))
            .args(["bench", "-w", "-c", "100000000", "-d", "4", "-f", "raw"])
            .arg(daemon.url(0))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let top = Path::new(env!("CARGO_BIN_EXE_ferrosan"));

    let batch = run_path(top, &["top", "--socket", &s, "--batch", "3"]);
    assert!(batch.success(), "{}", batch.describe());
    let last_frame = batch
        .stdout
        .rsplit("ferrosan top:")
        .next()
        .unwrap_or_default();
    let writes = writes_per_second(last_frame);
    assert!(
        writes.is_some_and(|w| w > 0),
        "no writes per second in the last frame:\n{}",
        batch.stdout
    );
    // The daemon's network workers, each with its busy share and connections.
    assert!(
        last_frame.contains("workers: #0 ") && last_frame.contains("% busy"),
        "no workers' line:\n{last_frame}"
    );
    // The p99 of the session's commands in the window: a number, not "-".
    let p99 = session_cell(last_frame, "P99_ms").and_then(|v| v.parse::<f64>().ok());
    assert!(
        p99.is_some_and(|v| v > 0.0),
        "no p99 latency:\n{last_frame}"
    );
    // qemu-img keeps 4 writes in flight; those inside the target at a time (a RAM LUN
    // answers in microseconds, the rest of the loop is the network and qemu) are fewer,
    // never more. Its path is the daemon's portal.
    let qd = session_cell(last_frame, "QD").and_then(|v| v.parse::<f64>().ok());
    assert!(
        qd.is_some_and(|v| v > 0.0 && v <= 4.05),
        "queue depth {qd:?}:\n{last_frame}"
    );
    assert_eq!(
        session_cell(last_frame, "PORTAL"),
        Some(format!("127.0.0.1:{}", daemon.port)),
        "{last_frame}"
    );
    // A filter that matches nothing leaves the tables empty.
    let filtered = run_path(
        top,
        &[
            "top",
            "--socket",
            &s,
            "--batch",
            "1",
            "--filter",
            "no-such-host",
            "--sort",
            "latency",
        ],
    );
    assert!(filtered.success(), "{}", filtered.describe());
    assert!(
        !filtered.stdout.contains("linux-kvm"),
        "{}",
        filtered.stdout
    );

    // The terminal UI, in a detached tmux pane of a private tmux server.
    let tmux = require_tool("tmux");
    let server = format!("ferrosan-top-{}", std::process::id());
    let tmux_cmd = |args: &[&str]| {
        Command::new(&tmux)
            .args(["-L", &server])
            .args(args)
            .output()
            .unwrap()
    };
    struct KillServer<'a>(&'a dyn Fn(&[&str]) -> std::process::Output);
    impl Drop for KillServer<'_> {
        fn drop(&mut self) {
            (self.0)(&["kill-server"]);
        }
    }
    let _cleanup = KillServer(&tmux_cmd);
    let command = format!("{} top --socket {s}", top.display());
    let started = tmux_cmd(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "80",
        "-y",
        "30",
        &command,
    ]);
    assert!(started.status.success(), "{started:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut screen = String::new();
    // A capture can land in the middle of a redraw (the sessions pane drawn, the rest not
    // yet): wait for one that shows the whole screen.
    let complete = |screen: &str| {
        writes_per_second(screen).is_some_and(|w| w > 0)
            && screen.contains("P99_ms")
            && screen.contains("q quit")
    };
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        screen = String::from_utf8_lossy(&tmux_cmd(&["capture-pane", "-p", "-t", "top"]).stdout)
            .to_string();
        if complete(&screen) {
            break;
        }
    }
    assert!(
        writes_per_second(&screen).is_some_and(|w| w > 0),
        "the terminal UI shows no writes per second:\n{screen}"
    );
    assert!(
        screen.contains("P99_ms") && screen.contains("q quit"),
        "{screen}"
    );
    assert!(
        screen.lines().all(|l| l.chars().count() <= 80),
        "wider than the pane:\n{screen}"
    );
    // l sorts by p99; / then text and Enter filters (the kvm session stays).
    tmux_cmd(&["send-keys", "-t", "top", "l", "/", "k", "v", "m", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
        screen = String::from_utf8_lossy(&tmux_cmd(&["capture-pane", "-p", "-t", "top"]).stdout)
            .to_string();
        if screen.contains("[p99]") && screen.contains("[kvm]") {
            break;
        }
    }
    assert!(
        screen.contains("[p99]") && screen.contains("[kvm]"),
        "{screen}"
    );
    assert!(
        screen.contains("linux-kvm"),
        "the filter hid the matching session:\n{screen}"
    );
    tmux_cmd(&["send-keys", "-t", "top", "q"]);
    let quit = Instant::now() + Duration::from_secs(5);
    while tmux_cmd(&["has-session", "-t", "top"]).status.success() {
        assert!(Instant::now() < quit, "q did not quit");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "ferrosan top: {} writes/s in batch, {:?} in the terminal",
        writes.unwrap_or(0),
        writes_per_second(&screen)
    );
    drop(_writer);
    daemon.stop();
}
