//! Buffered writes to a disk-backed device leave the network workers when the device stalls
//! (see crates/target/src/stall.rs). A real stall cannot be produced on demand, so this test
//! takes the mechanism's own switch: `write_stall_us = 0` runs every buffered write of a disk
//! device on the blocking pool, here with one thread per worker (`io_threads = 1`, so deferred
//! writes queue behind each other). qemu-img then writes an image through it; the image must read
//! back identical, the disk device's offload counter must have counted those writes, and a RAM
//! device in the same target must never be offloaded (its writes cannot wait on a kernel).

mod common;

use common::{assert_identical, pseudo_random_bytes, run, scrape, upload, Daemon, Scratch};

const IQN: &str = "iqn.2024-01.dev.ferrosan:stalls";
const IMAGE_BYTES: usize = 4 << 20;

fn counter(metrics: &str, name: &str, device: &str) -> Option<u64> {
    let prefix = format!("{name}{{device=\"{device}\"}}");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

/// A directory on a disk filesystem: offloading applies to disk-backed devices only, and
/// `std::env::temp_dir()` may be tmpfs. Cargo's per-target scratch dir lives beside the build.
/// `tag` keeps the tests of this file, which run in parallel, out of each other's way.
fn disk_scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("write-stalls-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir under CARGO_TARGET_TMPDIR");
    let fs = run("stat", &["-f", "-c", "%T", &dir.display().to_string()]);
    assert!(
        fs.success() && !fs.stdout.contains("tmpfs") && !fs.stdout.contains("ramfs"),
        "{} must be on a disk filesystem for this test: {}",
        dir.display(),
        fs.describe()
    );
    dir
}

#[test]
fn buffered_writes_run_off_the_workers_and_land_intact() {
    let disk_dir = disk_scratch("offload");
    let lun_path = disk_dir.join("lun0.img");
    let metrics_port = common::free_port();
    let body = format!(
        r#"[server]
metrics_listen = "127.0.0.1:{metrics_port}"

[limits]
write_stall_us = 0
io_threads = 1

[[device]]
name = "disk"
store = "file"
path = "{}"
size = "16M"
write_cache = true

[[device]]
name = "mem"
store = "ram"
size = "16M"

[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }}, {{ lun = 1, device = "mem" }} ]
"#,
        lun_path.display()
    );
    let daemon = Daemon::start_config(IQN, &body);
    let scratch = Scratch::new("stalls");
    let image = scratch.file("image.raw");
    std::fs::write(&image, pseudo_random_bytes(IMAGE_BYTES, 7)).expect("write image");
    let image = image.display().to_string();
    for lun in [0, 1] {
        upload(&daemon, lun, &image);
        assert_identical(&daemon, lun, &image);
    }
    let metrics = scrape(metrics_port);
    let offloaded = counter(&metrics, "ferrosan_writes_offloaded_total", "disk")
        .unwrap_or_else(|| panic!("no offload counter for the disk device:\n{metrics}"));
    // qemu-img convert writes at most 2 MiB per command, so 4 MiB take at least two.
    assert!(
        offloaded >= 2,
        "the disk device's buffered writes did not leave the workers ({offloaded}):\n{metrics}"
    );
    assert_eq!(
        counter(&metrics, "ferrosan_writes_offloaded_total", "mem"),
        None,
        "a RAM device has no stall state:\n{metrics}"
    );
    // The data is on the file itself, not only in the daemon.
    let on_disk = std::fs::read(&lun_path).expect("read the LUN file");
    assert_eq!(
        on_disk[..IMAGE_BYTES],
        pseudo_random_bytes(IMAGE_BYTES, 7)[..],
        "the LUN file does not hold the image"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(&disk_dir);
}

/// With a tiny memory budget and one I/O thread, deferred writes fill the budget at once: the
/// connection must then stop reading (TCP holds qemu-img back) rather than run writes on its
/// worker, and every write must still complete and land.
#[test]
fn a_full_budget_holds_the_initiator_back_and_loses_nothing() {
    let disk_dir = disk_scratch("budget");
    let lun_path = disk_dir.join("lun0.img");
    let metrics_port = common::free_port();
    let body = format!(
        r#"[server]
metrics_listen = "127.0.0.1:{metrics_port}"

[limits]
write_stall_us = 0
io_threads = 1
# The smallest budget allowed: one data segment plus one burst.
memory_per_connection_bytes = 1310720

[[device]]
name = "disk"
store = "file"
path = "{}"
size = "64M"
write_cache = true

[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }} ]
"#,
        lun_path.display()
    );
    let daemon = Daemon::start_config(IQN, &body);
    // 16 MiB in 1 MiB writes, 16 in flight: far past a 1.25 MiB budget.
    run(
        "qemu-img",
        &[
            "bench",
            "-w",
            "-f",
            "raw",
            "-t",
            "none",
            "-c",
            "16",
            "-d",
            "16",
            "-s",
            "1M",
            &daemon.url(0),
        ],
    )
    .expect_ok(&daemon);
    let scratch = Scratch::new("budget");
    let image = scratch.file("image.raw");
    std::fs::write(&image, pseudo_random_bytes(IMAGE_BYTES, 11)).expect("write image");
    let image = image.display().to_string();
    upload(&daemon, 0, &image);
    let metrics = scrape(metrics_port);
    let held_back = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(r#"ferrosan_limit_exceeded_total{limit="memory_per_connection_bytes"}"#)?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0);
    assert!(
        held_back > 0,
        "the budget never filled, so the test proved nothing:\n{metrics}"
    );
    let on_disk = std::fs::read(&lun_path).expect("read the LUN file");
    assert_eq!(
        on_disk[..IMAGE_BYTES],
        pseudo_random_bytes(IMAGE_BYTES, 11)[..],
        "the LUN file does not hold the image"
    );
    drop(daemon);
    let _ = std::fs::remove_dir_all(&disk_dir);
}
