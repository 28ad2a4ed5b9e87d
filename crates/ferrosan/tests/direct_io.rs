//! Direct device I/O as users meet it: a disk file exported with default settings takes the
//! io_uring path and keeps every byte; without io_uring the same store runs on the I/O
//! threads; a LU whose blocks are smaller than the device's direct-I/O alignment is refused
//! when direct I/O is demanded and falls back to the page cache by default; tmpfs files stay
//! in memory. The metric `ferrosan_device_io_path` says which path each device takes.

mod common;

use common::{
    assert_identical, free_port, metric, pseudo_random_bytes, run_path, scrape, upload, Ctl,
    Daemon, LoopDevice, Scratch, IQN,
};
use std::path::{Path, PathBuf};

const IMAGE_BYTES: usize = 6 << 20;

fn disk_dir(tag: &str) -> PathBuf {
    common::disk_dir(&format!("direct-io-{tag}"))
}

/// `ferrosan serve` with `luns` and metrics on a free port; returns the daemon and the port.
fn start_with_metrics(lun: &str) -> (Daemon, u16) {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(IQN, &[lun], &["--metrics-listen", &listen]);
    (daemon, metrics_port)
}

fn io_path_series(device: &str, path: &str) -> String {
    format!("ferrosan_device_io_path{{device=\"{device}\",path=\"{path}\"}}")
}

/// Writes a pseudo-random image through the LUN, compares it back, and checks the device's
/// read and write counters moved (the reads came from the device, not a cache).
fn round_trip(daemon: &Daemon, metrics_port: u16, device: &str, seed: u64) {
    let scratch = Scratch::new("direct-io-image");
    let image = scratch.file("image.raw");
    std::fs::write(&image, pseudo_random_bytes(IMAGE_BYTES, seed)).expect("write image");
    let image = image.display().to_string();
    upload(daemon, 0, &image);
    assert_identical(daemon, 0, &image);
    let read = format!("ferrosan_device_read_bytes_total{{device=\"{device}\"}}");
    let text = common::wait_for_metric(metrics_port, &read, |v| v >= IMAGE_BYTES as f64);
    assert!(metric(&text, &read) >= IMAGE_BYTES as f64, "{text}");
    let written = format!("ferrosan_device_write_bytes_total{{device=\"{device}\"}}");
    assert!(metric(&text, &written) >= IMAGE_BYTES as f64, "{text}");
}

#[test]
fn a_disk_file_takes_the_io_uring_path_by_default_and_keeps_every_byte() {
    let dir = disk_dir("default");
    let lun = format!("file:{},size=32M", dir.join("lun.img").display());
    let (daemon, metrics_port) = start_with_metrics(&lun);
    let text = scrape(metrics_port);
    assert_eq!(
        metric(&text, &io_path_series("lun0", "io_uring")),
        1.0,
        "a disk file's default is direct I/O on io_uring:\n{text}"
    );
    round_trip(&daemon, metrics_port, "lun0", 21);
    // Bytes written through the ring are in the file itself (O_DIRECT: no cache to flush).
    drop(daemon);
    let on_disk = std::fs::read(dir.join("lun.img")).expect("read the LUN file");
    assert_eq!(
        on_disk[..IMAGE_BYTES],
        pseudo_random_bytes(IMAGE_BYTES, 21)[..]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Write-through writes that are in flight together are made durable by one fdatasync per
/// group (engine::io::group_commit) and every byte is kept: qemu-img writes out of order (-W),
/// 16 requests at a time, and the file read back after the daemon stopped is the image.
#[test]
fn concurrent_write_through_writes_are_group_committed_and_kept() {
    let dir = disk_dir("group-commit");
    let lun = format!("file:{},size=32M", dir.join("lun.img").display());
    let (daemon, metrics_port) = start_with_metrics(&lun);
    let scratch = Scratch::new("direct-io-group-commit");
    let image = scratch.file("image.raw");
    // Small requests (-S: a sparse-detection granularity that splits the copy), many at once.
    std::fs::write(&image, pseudo_random_bytes(IMAGE_BYTES, 33)).expect("write image");
    let image = image.display().to_string();
    let url = daemon.url(0);
    common::run(
        "qemu-img",
        &[
            "convert", "-n", "-W", "-m", "16", "-S", "4k", "-f", "raw", "-O", "raw", &image, &url,
        ],
    )
    .expect_ok(&daemon);
    assert_identical(&daemon, 0, &image);
    let text = scrape(metrics_port);
    let flushes = metric(&text, "ferrosan_group_commit_flushes_total");
    let grouped = metric(&text, "ferrosan_group_commit_writes_total");
    assert!(
        flushes >= 1.0 && grouped >= flushes,
        "group commit: {flushes} flushes for {grouped} writes\n{text}"
    );
    drop(daemon);
    let on_disk = std::fs::read(dir.join("lun.img")).expect("read the LUN file");
    assert_eq!(
        on_disk[..IMAGE_BYTES],
        pseudo_random_bytes(IMAGE_BYTES, 33)[..]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_io_uring_direct_devices_run_on_the_io_threads() {
    let dir = disk_dir("threads");
    let metrics_port = free_port();
    let body = format!(
        r#"[server]
metrics_listen = "127.0.0.1:{metrics_port}"
io_uring = false

[[device]]
name = "disk"
store = "file"
path = "{}"
size = "32M"
cache = "direct"

[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#,
        dir.join("lun.img").display()
    );
    let daemon = Daemon::start_config(IQN, &body);
    let text = scrape(metrics_port);
    assert_eq!(
        metric(&text, &io_path_series("disk", "threads")),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, &io_path_series("disk", "io_uring")),
        0.0,
        "{text}"
    );
    round_trip(&daemon, metrics_port, "disk", 22);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_on_tmpfs_stays_in_memory() {
    if !Path::new("/dev/shm").is_dir() {
        eprintln!("SKIPPED: no /dev/shm");
        return;
    }
    let dir = PathBuf::from(format!(
        "/dev/shm/ferrosan-direct-io-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let lun = format!("file:{},size=32M", dir.join("lun.img").display());
    let (daemon, metrics_port) = start_with_metrics(&lun);
    let text = scrape(metrics_port);
    assert_eq!(
        metric(&text, &io_path_series("lun0", "memory")),
        1.0,
        "{text}"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A loop device with 4096-byte logical sectors over a file on the disk.
fn loop_4k() -> Option<LoopDevice> {
    LoopDevice::attach("loop4k", 32 << 20, &["-b", "4096", "--direct-io=on"])
}

#[test]
fn a_512_byte_lu_on_a_4k_sector_device_is_refused_direct_and_paged_by_default() {
    let Some(dev) = loop_4k() else {
        eprintln!("SKIPPED: needs root and loop devices (losetup -b 4096)");
        return;
    };
    // cache=direct with 512-byte blocks cannot work: refused at start, naming what to change.
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let lun = format!("block:{},cache=direct", dev.device);
    let refused = run_path(
        Path::new(env!("CARGO_BIN_EXE_ferrosan")),
        &["serve", "--listen", &listen, "--target", IQN, "--lun", &lun],
    );
    let said = format!("{}{}", refused.stdout, refused.stderr);
    assert!(
        !refused.success(),
        "started anyway:\n{}",
        refused.describe()
    );
    assert!(
        said.contains(&dev.device) && said.contains("4096") && said.contains("block_size"),
        "the error names the device, its alignment and the fix:\n{}",
        refused.describe()
    );
    // The default (auto) exports it through the page cache instead, and says so.
    let (daemon, metrics_port) = start_with_metrics(&format!("block:{}", dev.device));
    let text = scrape(metrics_port);
    assert_eq!(
        metric(&text, &io_path_series("lun0", "page_cache")),
        1.0,
        "{text}"
    );
    round_trip(&daemon, metrics_port, "lun0", 23);
    drop(daemon);
    // With 4096-byte blocks it goes direct.
    let lun = format!("block:{},block_size=4096,cache=direct", dev.device);
    let (daemon, metrics_port) = start_with_metrics(&lun);
    let text = scrape(metrics_port);
    assert_eq!(
        metric(&text, &io_path_series("lun0", "io_uring")),
        1.0,
        "{text}"
    );
    round_trip(&daemon, metrics_port, "lun0", 24);
}

/// A device that fails reads: a loop device whose backing file shrank under it answers reads
/// beyond the new end with nothing (device-mapper's `error` target is not available here).
/// The command gets MEDIUM ERROR (03h/11h/00h), the failure is counted and logged, and the
/// same session and LU keep working for the blocks that are there.
#[test]
fn a_failing_device_read_is_a_medium_error_and_the_lu_keeps_working() {
    use common::raw::{rw10, status_of, Raw};
    let Some(dev) = LoopDevice::attach("eio", 8 << 20, &[]) else {
        eprintln!("SKIPPED: needs root and loop devices");
        return;
    };
    dev.set_backing_len(4 << 20);
    let (daemon, metrics_port) = start_with_metrics(&format!("block:{},cache=direct", dev.device));
    let mut client = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    client.until_ready(&mut itt);
    // Block 12288 (6 MiB) lies beyond the backing file's new end.
    let bhs = client.command(itt, &rw10(0x28, 12288, 8), 0xC0, 4096);
    itt += 1;
    client.send(&bhs, &[]);
    let answer = client.recv();
    assert_eq!(
        status_of(&answer),
        0x02,
        "CHECK CONDITION expected: {:?}",
        answer.bhs
    );
    // Sense data: 2-byte length, then fixed (70h) or descriptor (72h) format.
    let sense = answer.data.get(2..).unwrap_or_default();
    let (key, asc) = match sense.first() {
        Some(0x72) => (sense[1] & 0x0F, sense[2]),
        _ => (sense[2] & 0x0F, sense[12]),
    };
    assert_eq!(
        (key, asc),
        (0x03, 0x11),
        "MEDIUM ERROR / UNRECOVERED READ ERROR: {sense:02x?}"
    );
    assert_eq!(
        information(sense),
        Some(12288),
        "the bad block: {sense:02x?}"
    );
    // A read from the last blocks that exist into the missing ones names the first missing
    // one (located on the blocking pool: the ring failed the read as a whole).
    let bhs = client.command(itt, &rw10(0x28, 8184, 16), 0xC0, 16 * 512);
    itt += 1;
    client.send(&bhs, &[]);
    let answer = client.recv();
    assert_eq!(status_of(&answer), 0x02, "{:?}", answer.bhs);
    let sense = answer.data.get(2..).unwrap_or_default();
    assert_eq!(
        information(sense),
        Some(8192),
        "the first bad block: {sense:02x?}"
    );
    // The blocks that exist still read, on the same session.
    let bhs = client.command(itt, &rw10(0x28, 0, 8), 0xC0, 4096);
    client.send(&bhs, &[]);
    assert_eq!(client.read_data().len(), 4096);
    let series = "ferrosan_device_errors_total{device=\"lun0\",cause=\"medium_error\"}";
    let text = common::wait_for_metric(metrics_port, series, |v| v >= 1.0);
    assert!(
        metric(&text, series) >= 1.0,
        "the failure is counted as a medium error:\n{text}"
    );
    // The power-on unit attention of the login is no error.
    assert_eq!(
        metric(
            &text,
            "ferrosan_device_errors_total{device=\"lun0\",cause=\"other\"}"
        ),
        0.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "ferrosan_device_unit_attentions_total{device=\"lun0\"}"
        ) >= 1.0,
        "{text}"
    );
    drop(client);
    drop(daemon);
}

/// The INFORMATION field of sense data when its VALID bit is set (fixed format) or its
/// information descriptor is there (descriptor format).
fn information(sense: &[u8]) -> Option<u64> {
    match sense.first()? {
        0x72 => {
            let mut at = 8;
            while at + 12 <= sense.len() {
                if sense[at] == 0x00 {
                    return Some(u64::from_be_bytes(sense[at + 4..at + 12].try_into().ok()?));
                }
                at += 2 + usize::from(sense[at + 1]);
            }
            None
        }
        code if code & 0x80 != 0 => {
            Some(u32::from_be_bytes(sense.get(3..7)?.try_into().ok()?).into())
        }
        _ => None,
    }
}

/// A loop device over a sparse file on a tmpfs far smaller than the file: writes to blocks
/// the tmpfs has no room for fail in the kernel with ENOSPC. Detached, unmounted and removed
/// on drop. None (with the reason on stderr) without root, tmpfs mounts or loop devices.
struct FullDevice {
    /// Detached before the tmpfs under it is unmounted.
    device: Option<LoopDevice>,
    dir: PathBuf,
}

impl FullDevice {
    fn new(tag: &str, fs_bytes: u64, device_bytes: u64) -> Option<FullDevice> {
        let dir = disk_dir(tag);
        let size = format!("size={fs_bytes}");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &size, "tmpfs"])
            .arg(&dir)
            .status();
        let mut full = FullDevice { device: None, dir };
        if !mounted.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("mount -t tmpfs: {mounted:?}");
            return None;
        }
        full.device = Some(LoopDevice::attach_in(full.dir.clone(), device_bytes, &[])?);
        Some(full)
    }
}

impl Drop for FullDevice {
    fn drop(&mut self) {
        drop(self.device.take());
        // Fails harmlessly when the mount above did not happen.
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A device that runs out of room under concurrent write-through writes (the write-through
/// LU's group commit): every write is answered, each either GOOD or DATA PROTECT / SPACE
/// ALLOCATION FAILED WRITE PROTECT (27h/07h) — never a medium error, never a hang — the
/// failures are counted, every write answered GOOD reads back, and the session and another
/// LUN keep working.
#[test]
fn a_full_device_fails_writes_as_out_of_space_and_keeps_what_it_acknowledged() {
    use common::raw::{rw10, status_of, Raw};
    const WRITES: u32 = 48;
    // 64 KiB of tmpfs under a 32 MiB device: 16 pages for 48 writes to distinct pages.
    let Some(full) = FullDevice::new("full", 64 << 10, 32 << 20) else {
        eprintln!("SKIPPED: needs root, tmpfs mounts and loop devices");
        return;
    };
    let device = full
        .device
        .as_ref()
        .map(|d| d.device.clone())
        .unwrap_or_default();
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(
        IQN,
        &[&format!("block:{device},cache=direct"), "ram:8M"],
        &["--metrics-listen", &listen],
    );
    let mut client = Raw::login(daemon.port, IQN, 1);
    let mut itt = 1;
    client.until_ready(&mut itt);
    // Every write in flight at once: 4 KiB of immediate data each, 512 KiB apart.
    let block = |n: u32| pseudo_random_bytes(4096, u64::from(n) + 100);
    let lba = |n: u32| n * 1024;
    for n in 0..WRITES {
        let data = block(n);
        let mut bhs = client.command(100 + n, &rw10(0x2a, lba(n), 8), 0xa0, 4096);
        bhs.set_data_segment_len(data.len());
        client.send(&bhs, &data);
    }
    let mut good = Vec::new();
    let mut out_of_space = 0;
    for _ in 0..WRITES {
        let answer = client.recv();
        let n = answer.bhs.itt() - 100;
        match status_of(&answer) {
            0x00 => good.push(n),
            0x02 => {
                let sense = answer.data.get(2..).unwrap_or_default();
                let (key, asc, ascq) = match sense.first() {
                    Some(0x72) => (sense[1] & 0x0F, sense[2], sense[3]),
                    _ => (sense[2] & 0x0F, sense[12], sense[13]),
                };
                assert_eq!(
                    (key, asc, ascq),
                    (0x07, 0x27, 0x07),
                    "write {n}: SPACE ALLOCATION FAILED WRITE PROTECT expected: {sense:02x?}"
                );
                out_of_space += 1;
            }
            other => panic!("write {n}: status {other:#x}"),
        }
    }
    assert!(
        !good.is_empty() && out_of_space > 0,
        "{} good, {out_of_space} out of space: the device should take some and refuse some\n{}",
        good.len(),
        daemon.output()
    );
    // What was acknowledged is there.
    for &n in &good {
        let bhs = client.command(itt, &rw10(0x28, lba(n), 8), 0xc0, 4096);
        itt += 1;
        client.send(&bhs, &[]);
        assert_eq!(client.read_data(), block(n), "acknowledged write {n}");
    }
    // The other LUN and the session work on (its first answer is its power-on unit
    // attention).
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let mut bhs = client.command(itt, &rw10(0x2a, 0, 8), 0xa0, 4096);
        itt += 1;
        bhs.set_lun([0, 1, 0, 0, 0, 0, 0, 0]);
        bhs.set_data_segment_len(4096);
        client.send(&bhs, &block(999));
        statuses.push(status_of(&client.recv()));
    }
    assert_eq!(
        statuses.last(),
        Some(&0),
        "writes to the RAM LUN: {statuses:?}"
    );
    client.ping(itt);
    let series = "ferrosan_device_errors_total{device=\"lun0\",cause=\"data_protect\"}";
    let text = common::wait_for_metric(metrics_port, series, |v| v >= f64::from(out_of_space));
    assert_eq!(metric(&text, series), f64::from(out_of_space), "{text}");
    drop(client);
    drop(daemon);
    drop(full);
}

/// A tmpfs of `bytes` mounted at a fresh directory, unmounted and removed on drop; None
/// (with the reason on stderr) without root or tmpfs mounts.
struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    fn new(tag: &str, bytes: u64) -> Option<SmallFs> {
        let dir = disk_dir(tag);
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .status();
        let fs = SmallFs { dir };
        if !mounted.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("mount -t tmpfs: {mounted:?}");
            return None;
        }
        Some(fs)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A volume created after the space watch told its pool's volumes their share gets it at the
/// next check though the share did not move (a check that finds a pool's space unchanged
/// skips the volumes it told), two created between two checks both do, a deleted one is not
/// told when the share moves, and one created again under its name (its series went with
/// the deleted one) gets it back.
#[test]
fn volumes_created_after_a_check_get_their_pools_share_though_it_did_not_move() {
    let Some(fs) = SmallFs::new("pool-space-new", 8 << 20) else {
        eprintln!("SKIPPED: needs root and tmpfs mounts");
        return;
    };
    let metrics_port = free_port();
    let ctl = Ctl::new();
    let body = format!(
        "[[pool]]\nname = \"small\"\npath = \"{}\"\n\n[[device]]\nname = \"v0\"\nstore = \"file\"\n\
         path = \"{}\"\nsize = \"1M\"\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  \
         name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"v0\" }} ]\n",
        fs.dir.display(),
        fs.dir.join("v0.img").display(),
    );
    let listen = format!("127.0.0.1:{metrics_port}");
    let socket = ctl.socket.display().to_string();
    let daemon = Daemon::start_config_args(
        IQN,
        &body,
        &["--metrics-listen", &listen, "--control-socket", &socket],
    );
    let used = |name: &str| space_used(metrics_port, name);
    let until = |what: &str, done: &dyn Fn() -> bool| within_six_checks(&daemon, what, done);
    let ok = |args: &[&str]| {
        let r = ctl.json(args);
        assert_eq!(r["ok"], true, "ctl {args:?}: {r}");
    };
    until("v0's share", &|| used("v0").is_some());
    // Two changes back to back, most often between the same two checks.
    ok(&["volume", "create", "small", "v1", "1M"]);
    ok(&["volume", "create", "small", "v2", "1M"]);
    until("the new volumes' share", &|| {
        used("v1").is_some() && used("v2").is_some()
    });
    // Sparse files on tmpfs: the pool's share stayed within the thousandth the watch tells,
    // so v0 was not told again and the new volumes were told as new.
    let (v0, v1) = (used("v0").unwrap(), used("v1").unwrap());
    assert!((v0 - v1).abs() < 0.001, "v0 {v0}, v1 {v1}");
    ok(&["volume", "delete", "v1"]);
    until("v1's series gone", &|| used("v1").is_none());
    // The share moves: the pool's volumes are told again, the deleted one not.
    let filler = fs.dir.join("filler");
    std::fs::write(&filler, vec![1u8; 2 << 20]).unwrap();
    until("the pool's new share", &|| {
        used("v0").is_some_and(|u| u > v0 + 0.1)
    });
    assert_eq!(used("v1"), None, "a deleted volume told its pool's share");
    assert!(used("v2").is_some_and(|u| u > v0 + 0.1));
    ok(&["volume", "create", "small", "v1", "1M"]);
    until("v1's share again", &|| used("v1").is_some());
    drop(daemon);
    drop(fs);
}

/// The sense (key, ASC, ASCQ) of a failed command, from the initiator crate's client.
fn sense_of(r: &initiator::session::ScsiResult) -> Option<(u8, u8, u8)> {
    r.sense.as_ref().map(|s| (s.key, s.asc, s.ascq))
}

/// A thin file LUN whose filesystem fills as a host writes it: past `space_warning_percent`
/// the host is told THIN PROVISIONING SOFT THRESHOLD REACHED (06h/38h/07h) once, with a log
/// line and a metric; at full, writes answer SPACE ALLOCATION FAILED WRITE PROTECT
/// (07h/27h/07h) while reads go on and what was acknowledged stays; once space is freed the
/// same write succeeds, without a restart.
#[test]
fn a_filling_filesystem_warns_first_then_fails_writes_and_recovers_when_freed() {
    use initiator::scsi::Cdb;
    use initiator::session::Transfer;
    let Some(fs) = SmallFs::new("space", 8 << 20) else {
        eprintln!("SKIPPED: needs root and tmpfs mounts");
        return;
    };
    // Someone else's 3 MiB on the same filesystem.
    let filler = fs.dir.join("filler");
    std::fs::write(&filler, vec![7u8; 3 << 20]).unwrap();
    let metrics_port = free_port();
    let body = format!(
        "[[device]]\nname = \"lun0\"\nstore = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\n\
         [limits]\nspace_warning_percent = 60\n\n[[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  \
         name = \"all\"\n  any_initiator = true\n  luns = [ {{ lun = 0, device = \"lun0\" }} ]\n",
        fs.dir.join("lun.img").display()
    );
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_config_args(IQN, &body, &["--metrics-listen", &listen]);
    let mut s = initiator::SessionConfig::new(
        "iqn.2026-12.test:space",
        initiator::SessionKind::Normal {
            target_name: IQN.into(),
        },
    );
    s.isid[5] = 1;
    let c = initiator::ClientConfig::new(format!("127.0.0.1:{}", daemon.port), s);
    let mut client = initiator::driver::Client::connect(c).expect("login");
    let mut run = |cdb: Cdb, transfer: Transfer| client.command(cdb, transfer).expect("answered");
    let tur = initiator::scsi::test_unit_ready;
    while run(tur(), Transfer::None).is_unit_attention() {}
    // 2 MiB written: 5 of 8 MiB in use, past 60 %.
    let chunk = |n: u8| pseudo_random_bytes(1 << 20, u64::from(n));
    let write = |lba: u64| initiator::scsi::write16(lba, 2048, false);
    for n in 0..2u8 {
        let r = run(write(u64::from(n) * 2048), Transfer::Write(chunk(n)));
        assert!(r.is_good(), "write {n}: {:?}", sense_of(&r));
    }
    let started = std::time::Instant::now();
    loop {
        let r = run(tur(), Transfer::None);
        if r.is_good() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(12),
                "no warning within two checks\n{}",
                daemon.output()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
            continue;
        }
        assert_eq!(sense_of(&r), Some((0x06, 0x38, 0x07)), "the warning");
        break;
    }
    assert!(run(tur(), Transfer::None).is_good(), "told once");
    let text = scrape(metrics_port);
    assert_eq!(
        metric(
            &text,
            "ferrosan_device_space_warnings_total{device=\"lun0\"}"
        ),
        1.0
    );
    assert!(metric(&text, "ferrosan_device_space_used_ratio{device=\"lun0\"}") >= 0.6);
    assert!(daemon
        .output()
        .contains("device space past its warning threshold"));
    // Fill it: the writes that find no room answer SPACE ALLOCATION FAILED WRITE PROTECT.
    let mut refused = None;
    for n in 2..8u8 {
        let r = run(write(u64::from(n) * 2048), Transfer::Write(chunk(n)));
        if !r.is_good() {
            assert_eq!(sense_of(&r), Some((0x07, 0x27, 0x07)), "write {n}");
            refused = Some(n);
            break;
        }
    }
    let refused = refused.expect("the filesystem never filled");
    // Reads go on, and what was acknowledged is there.
    for n in 0..refused {
        let r = run(
            initiator::scsi::read16(u64::from(n) * 2048, 2048),
            Transfer::Read {
                len: 1 << 20,
                buf: Vec::new(),
            },
        );
        assert!(r.is_good() && r.data == chunk(n), "read {n}");
    }
    // Space freed: the same write goes through, no restart.
    std::fs::remove_file(&filler).unwrap();
    let r = run(
        write(u64::from(refused) * 2048),
        Transfer::Write(chunk(refused)),
    );
    assert!(r.is_good(), "after freeing: {:?}", sense_of(&r));
    drop(daemon);
    drop(fs);
}

/// `series`' value on the daemon's metrics at `port`, if it has that series.
fn series_value(port: u16, series: &str) -> Option<f64> {
    let text = scrape(port);
    text.contains(series).then(|| metric(&text, series))
}

/// Device `name`'s share of its space in use, if the space watch has told it.
fn space_used(port: u16, name: &str) -> Option<f64> {
    series_value(
        port,
        &format!("ferrosan_device_space_used_ratio{{device=\"{name}\"}}"),
    )
}

/// Waits for `done`, up to six of the space watch's checks (30 s; a busy 2-core CI machine
/// keeps that bound), else fails with `what` and the daemon's output.
fn within_six_checks(daemon: &Daemon, what: &str, done: &dyn Fn() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{what} not within six checks (30 s)\n{}",
            daemon.output()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// The volumes of a directory pool share its filesystem's space, looked at once a check for
/// all of them: when others fill that filesystem past `space_warning_percent` every volume is
/// warned once (its metric and its count), freed below the re-arm margin they are re-armed,
/// and filled again they are warned again (a check that finds the space where it was skips
/// the volumes, not a change).
#[test]
fn a_pools_volumes_share_its_filesystems_space_and_are_warned_at_each_crossing() {
    devices_on_one_filesystem_are_warned_at_each_crossing(true);
}

/// The same for file devices outside any pool whose files share a filesystem: grouped by it,
/// one device's look a check answers for both.
#[test]
fn file_devices_on_one_filesystem_share_its_space_and_are_warned_at_each_crossing() {
    devices_on_one_filesystem_are_warned_at_each_crossing(false);
}

fn devices_on_one_filesystem_are_warned_at_each_crossing(pooled: bool) {
    let tag = if pooled { "pool-space" } else { "fs-space" };
    let Some(fs) = SmallFs::new(tag, 8 << 20) else {
        eprintln!("SKIPPED: needs root and tmpfs mounts");
        return;
    };
    let metrics_port = free_port();
    let volume = |name: &str| {
        format!(
            "[[device]]\nname = \"{name}\"\nstore = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\n",
            fs.dir.join(format!("{name}.img")).display()
        )
    };
    let pool = match pooled {
        true => format!(
            "[[pool]]\nname = \"small\"\npath = \"{}\"\n\n",
            fs.dir.display()
        ),
        false => String::new(),
    };
    let body = format!(
        "{pool}{}{}[limits]\nspace_warning_percent = 60\n\n\
         [[target]]\niqn = \"{IQN}\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n  \
         luns = [ {{ lun = 0, device = \"v0\" }}, {{ lun = 1, device = \"v1\" }} ]\n",
        volume("v0"),
        volume("v1"),
    );
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_config_args(IQN, &body, &["--metrics-listen", &listen]);
    let warnings = |name: &str| {
        let series = format!("ferrosan_device_space_warnings_total{{device=\"{name}\"}}");
        series_value(metrics_port, &series)
    };
    let until = |what: &str, done: &dyn Fn() -> bool| within_six_checks(&daemon, what, done);
    let used = |name: &str| space_used(metrics_port, name);
    until("both volumes' share", &|| {
        used("v0").is_some() && used("v1").is_some()
    });
    assert!(used("v0").unwrap() < 0.6, "{:?}", used("v0"));
    let filler = fs.dir.join("filler");
    for round in 1..=2u8 {
        // Someone else's 5 MiB of the 8.
        std::fs::write(&filler, vec![round; 5 << 20]).unwrap();
        let warned = |n| warnings("v0") == Some(n) && warnings("v1") == Some(n);
        until("the warning", &|| warned(f64::from(round)));
        assert!(used("v0").unwrap() >= 0.6 && used("v1").unwrap() >= 0.6);
        std::thread::sleep(std::time::Duration::from_secs(6));
        assert!(warned(f64::from(round)), "warned once per crossing");
        std::fs::remove_file(&filler).unwrap();
        until("the re-arm", &|| {
            used("v0").is_some_and(|u| u < 0.5) && used("v1").is_some_and(|u| u < 0.5)
        });
    }
    let output = daemon.output();
    assert_eq!(
        output
            .matches("device space back below its warning threshold")
            .count(),
        4,
        "{output}"
    );
    drop(daemon);
    drop(fs);
}
