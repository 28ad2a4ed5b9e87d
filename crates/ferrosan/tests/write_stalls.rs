//! Buffered writes to a disk-backed device leave the network workers when the device stalls
//! (see crates/engine/src/stall.rs). A real stall cannot be produced on demand, so this test
//! takes the mechanism's own switch: `write_stall_us = 0` runs every buffered write of a disk
//! device on the blocking pool, here with one thread per worker (`io_threads = 1`, so deferred
//! writes queue behind each other). qemu-img then writes an image through it; the image must read
//! back identical, the disk device's offload counter must have counted those writes, and a RAM
//! device in the same target must never be offloaded (its writes cannot wait on a kernel).

mod common;

use common::{assert_identical, pseudo_random_bytes, run, scrape, upload, Daemon, Scratch};

const IQN: &str = "iqn.2024-01.dev.ferrosan:stalls";
const IMAGE_BYTES: usize = 4 << 20;

/// The value of `series` (name and labels, exactly as exposed) in a metrics scrape.
fn metric(metrics: &str, series: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

fn offloaded(metrics: &str, device: &str) -> Option<u64> {
    metric(
        metrics,
        &format!("ferrosan_writes_offloaded_total{{device=\"{device}\"}}"),
    )
}

/// A config body: metrics on `metrics_port`, `limits` lines, a write-back page-cache file
/// device "disk" (buffered writes are what this file tests; direct I/O has none) at
/// `lun_path` as LUN 0, and with `ram_lun` a 16 MiB RAM device "mem" as LUN 1.
fn config(metrics_port: u16, limits: &str, lun_path: &std::path::Path, ram_lun: bool) -> String {
    let (ram_device, ram_mapping) = if ram_lun {
        (
            "[[device]]\nname = \"mem\"\nstore = \"ram\"\nsize = \"16M\"\n",
            ", { lun = 1, device = \"mem\" }",
        )
    } else {
        ("", "")
    };
    format!(
        r#"[server]
metrics_listen = "127.0.0.1:{metrics_port}"

[limits]
{limits}

[[device]]
name = "disk"
store = "file"
path = "{}"
size = "64M"
write_cache = true
cache = "page"

{ram_device}
[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "disk" }}{ram_mapping} ]
"#,
        lun_path.display()
    )
}

/// The LUN file itself (not only the daemon) holds the image written with `seed`.
fn assert_file_holds_image(lun_path: &std::path::Path, seed: u64) {
    let on_disk = std::fs::read(lun_path).expect("read the LUN file");
    assert_eq!(
        on_disk[..IMAGE_BYTES],
        pseudo_random_bytes(IMAGE_BYTES, seed)[..],
        "the LUN file does not hold the image"
    );
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
    let body = config(
        metrics_port,
        "write_stall_us = 0\nio_threads = 1",
        &lun_path,
        true,
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
    let disk_offloaded = offloaded(&metrics, "disk")
        .unwrap_or_else(|| panic!("no offload counter for the disk device:\n{metrics}"));
    // qemu-img convert writes at most 2 MiB per command, so 4 MiB take at least two.
    assert!(
        disk_offloaded >= 2,
        "the disk device's buffered writes did not leave the workers ({disk_offloaded}):\n{metrics}"
    );
    assert_eq!(
        offloaded(&metrics, "mem"),
        None,
        "a RAM device has no stall state:\n{metrics}"
    );
    // Writes that ran on the blocking pool are counted like inline ones, per device.
    for device in ["disk", "mem"] {
        let series = format!("ferrosan_device_write_bytes_total{{device=\"{device}\"}}");
        assert_eq!(
            metric(&metrics, &series),
            Some(IMAGE_BYTES as u64),
            "{series}:\n{metrics}"
        );
    }
    assert_file_holds_image(&lun_path, 7);
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
    // The smallest budget allowed: one data segment plus one burst.
    let limits = "write_stall_us = 0\nio_threads = 1\nmemory_per_connection_bytes = 1310720";
    let body = config(metrics_port, limits, &lun_path, false);
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
    let held_back = metric(
        &metrics,
        r#"ferrosan_limit_exceeded_total{limit="memory_per_connection_bytes"}"#,
    )
    .unwrap_or(0);
    assert!(
        held_back > 0,
        "the budget never filled, so the test proved nothing:\n{metrics}"
    );
    assert_file_holds_image(&lun_path, 11);
    drop(daemon);
    let _ = std::fs::remove_dir_all(&disk_dir);
}
