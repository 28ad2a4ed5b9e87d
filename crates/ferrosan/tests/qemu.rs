//! The ferrosan binary against qemu-img's iSCSI driver (libiscsi inside qemu):
//! bulk writes, read-back comparison, a queue-depth benchmark, persistence.

mod common;

use common::{assert_identical, pseudo_random_bytes, run, upload, Daemon, Scratch};

const IMAGE_BYTES: usize = 8 << 20;

fn write_image(scratch: &Scratch, seed: u64) -> String {
    let path = scratch.file(&format!("random-{seed}.raw"));
    std::fs::write(&path, pseudo_random_bytes(IMAGE_BYTES, seed)).expect("write image");
    path.display().to_string()
}

#[test]
fn qemu_img_convert_then_compare_identical() {
    let scratch = Scratch::new("qemu-convert");
    let image = write_image(&scratch, 0x5eed_0001);
    let daemon = Daemon::start(&["ram:16M"]);
    upload(&daemon, 0, &image);
    assert_identical(&daemon, 0, &image);
    // A different image must NOT compare identical (the check has teeth).
    let other = write_image(&scratch, 0x5eed_0002);
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &other, &daemon.url(0)],
    );
    assert!(
        !out.success(),
        "compare of different data passed:\n{}",
        out.describe()
    );
}

#[test]
fn qemu_img_info_reports_lun_size() {
    let daemon = Daemon::start(&["ram:16M"]);
    let out = run("qemu-img", &["info", "--output=json", &daemon.url(0)]).expect_ok(&daemon);
    assert!(
        out.stdout
            .contains(&format!("\"virtual-size\": {}", 16u64 << 20)),
        "{}",
        out.describe()
    );
}

#[test]
fn qemu_img_bench_random_writes() {
    let mut daemon = Daemon::start(&["ram:64M"]);
    let url = daemon.url(0);
    let out = run(
        "qemu-img",
        &[
            "bench", "-f", "raw", "-c", "2000", "-d", "16", "-s", "4k", "-w", &url,
        ],
    )
    .expect_ok(&daemon);
    assert!(
        out.stdout.contains("Run completed in"),
        "unexpected bench output:\n{}",
        out.describe()
    );
    // And reads after the writes.
    run(
        "qemu-img",
        &[
            "bench", "-f", "raw", "-c", "2000", "-d", "16", "-s", "4k", &url,
        ],
    )
    .expect_ok(&daemon);
    assert!(daemon.alive());
}

#[test]
fn file_lun_data_persists_across_restart() {
    let scratch = Scratch::new("qemu-persist");
    let image = write_image(&scratch, 0x5eed_0003);
    let disk = scratch.file("persist.img");
    let mut daemon = Daemon::start(&[&format!("file:{},size=16M", disk.display())]);
    upload(&daemon, 0, &image);
    assert_identical(&daemon, 0, &image);
    daemon.restart();
    assert_identical(&daemon, 0, &image);
    // The bytes are really in the file, at the start.
    let on_disk = std::fs::read(&disk).expect("read backing file");
    assert_eq!(on_disk.len(), 16 << 20);
    assert!(
        on_disk[..IMAGE_BYTES] == std::fs::read(&image).unwrap()[..],
        "backing file does not hold the written data"
    );
}
