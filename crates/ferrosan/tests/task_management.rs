//! Task management that means what it says (SAM-5 §7, RFC 7143 §11.5.1): a LOGICAL UNIT RESET
//! or ABORT TASK is answered only once the commands it concerns can no longer reach the medium.
//! A write is held in the device path for real: the LUN's file lives on an ext4 filesystem on a
//! loop device, frozen with `fsfreeze` while the write is in flight (the kernel blocks it until
//! the thaw). Needs root (losetup, mount, fsfreeze), as the test command runs.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::loopfs::{sh, LoopFs};
use common::raw::{self, status_of, Raw};
use common::{Daemon, IQN};
use iscsi::pdu::{off, Opcode};

/// The filesystem frozen: writes to it block until the thaw (drop, or `thaw`).
struct Frozen<'a> {
    mountpoint: &'a Path,
    thawed: bool,
}

impl<'a> Frozen<'a> {
    fn freeze(fs: &'a LoopFs) -> Frozen<'a> {
        sh("fsfreeze", &["-f", fs.mountpoint.to_str().unwrap()]);
        Frozen {
            mountpoint: &fs.mountpoint,
            thawed: false,
        }
    }
    fn thaw(&mut self) {
        if !self.thawed {
            sh("fsfreeze", &["-u", self.mountpoint.to_str().unwrap()]);
            self.thawed = true;
        }
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if !self.thawed {
            let _ = Command::new("fsfreeze")
                .args(["-u", self.mountpoint.to_str().unwrap()])
                .status();
        }
    }
}

/// A 4 KiB WRITE (10) at `lba` with its data immediate.
fn write(client: &mut Raw, itt: u32, lba: u32, fill: u8) {
    let cdb = raw::rw10(0x2a, lba, 8);
    let bhs = client.command(itt, &cdb, 0x80 | 0x20, 4096);
    client.send(&bhs, &[fill; 4096]);
}

/// An immediate TMF request.
fn tmf(client: &mut Raw, itt: u32, function: u8, referenced: u32) {
    let mut bhs = client.header(Opcode::TaskMgmtRequest, itt);
    bhs.set_immediate(true);
    bhs.set_flags(0x80 | function);
    bhs.set_u32(off::REFERENCED_TASK_TAG, referenced);
    bhs.set_u32(off::REF_CMD_SN, client.cmd_sn.wrapping_sub(1));
    client.send(&bhs, &[]);
}

/// Asserts nothing arrives on `client` for `quiet`.
fn silent_for(client: &mut Raw, quiet: Duration, what: &str) {
    client.stream.set_read_timeout(Some(quiet)).unwrap();
    let mut byte = [0u8; 1];
    let started = Instant::now();
    match client.stream.peek(&mut byte) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!(
            "{what}: something arrived after {:?}: {other:?}",
            started.elapsed()
        ),
    }
    client
        .stream
        .set_read_timeout(Some(raw::ANSWER_TIMEOUT))
        .unwrap();
}

/// How long the daemon's log says its last LOGICAL UNIT RESET waited before its answer.
fn reset_waited_ms(daemon: &Daemon) -> u64 {
    let log = daemon.output();
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("task management: LogicalUnitReset answered after"))
        .unwrap_or_else(|| panic!("no log line of the reset's answer:\n{log}"));
    let after = line.split("answered after ").nth(1).unwrap_or_default();
    after
        .split(" ms")
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no wait in {line}"))
}

fn setup(fs: &LoopFs) -> Daemon {
    let lun = fs.path("lun0.img");
    Daemon::start_with(IQN, &[&format!("file:{},size=16M", lun.display())])
}

#[test]
fn logical_unit_reset_waits_for_a_write_still_reaching_the_medium() {
    if !common::is_root() {
        eprintln!("SKIPPED: needs root for losetup, mount and fsfreeze");
        return;
    }
    let fs = LoopFs::new("ext4", 96 << 20);
    let daemon = setup(&fs);
    let mut writer = Raw::login(daemon.port, IQN, 1);
    let mut resetter = Raw::login(daemon.port, IQN, 2);
    let (mut itt_w, mut itt_r) = (1, 1000);
    writer.until_ready(&mut itt_w);
    resetter.until_ready(&mut itt_r);

    let mut frozen = Frozen::freeze(&fs);
    // Write-through: the write goes to the device path, where the frozen filesystem holds it.
    write(&mut writer, 100, 0, 0xa5);
    std::thread::sleep(Duration::from_millis(300));
    // Another session resets the LU: it may not be answered while the write can still land.
    tmf(&mut resetter, 200, 5, 0);
    silent_for(
        &mut resetter,
        Duration::from_millis(800),
        "LOGICAL UNIT RESET answered while a write was in flight",
    );
    silent_for(&mut writer, Duration::from_millis(50), "the held write");
    frozen.thaw();
    let answer = resetter.recv();
    assert_eq!(answer.opcode(), Opcode::TaskMgmtResponse as u8);
    assert_eq!(answer.bhs.itt(), 200);
    assert_eq!(answer.bhs.byte(off::RESPONSE), 0, "function complete");
    // The write finished before the reset was answered: its status is there now.
    let done = writer.recv();
    assert_eq!(done.bhs.itt(), 100);
    assert_eq!(status_of(&done), 0, "the write completed");
    // The daemon's log says the reset was answered, and how long it waited for the write.
    let waited_ms = reset_waited_ms(&daemon);
    assert!(
        waited_ms >= 800,
        "the reset waited {waited_ms} ms by the log"
    );
    // Both sessions go on; the writer learns of the reset by a unit attention.
    writer.until_ready(&mut itt_w);
    resetter.ping(9);
    // And the LU takes new commands once the reset is done.
    write(&mut writer, itt_w, 8, 0x5a);
    let done = writer.recv();
    assert_eq!(
        status_of(&done),
        0,
        "a write after the reset: {:?}",
        done.bhs
    );
    drop(frozen);
}

#[test]
fn abort_task_and_lu_reset_of_the_same_session_wait_for_the_aborted_write() {
    if !common::is_root() {
        eprintln!("SKIPPED: needs root for losetup, mount and fsfreeze");
        return;
    }
    let fs = LoopFs::new("ext4", 96 << 20);
    let daemon = setup(&fs);
    let mut client = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    client.until_ready(&mut itt);
    for function in [1u8, 5] {
        let mut frozen = Frozen::freeze(&fs);
        write(&mut client, 300 + u32::from(function), 16, function);
        std::thread::sleep(Duration::from_millis(200));
        tmf(
            &mut client,
            400 + u32::from(function),
            function,
            300 + u32::from(function),
        );
        silent_for(
            &mut client,
            Duration::from_millis(600),
            "TMF answered while the task it aborted was still running",
        );
        frozen.thaw();
        // The aborted write sends nothing; the TMF's response is the next PDU.
        let answer = client.recv();
        assert_eq!(
            answer.opcode(),
            Opcode::TaskMgmtResponse as u8,
            "{:?}",
            answer.bhs
        );
        assert_eq!(answer.bhs.itt(), 400 + u32::from(function));
        assert_eq!(answer.bhs.byte(off::RESPONSE), 0);
        let exp = answer.bhs.u32_at(off::EXP_CMD_SN);
        assert_eq!(exp, client.cmd_sn, "the aborted command consumed its CmdSN");
        client.until_ready(&mut itt);
    }
    client.ping(77);
    drop(daemon);
}
