//! Reads of file LUs whose pages are all cached go out with sendfile, straight from the page
//! cache: the initiator gets the same bytes, short reads are still copied, and the metrics say
//! which path ran.

mod common;

use common::raw::{rw10, Raw};
use common::{free_port, metric, run, wait_for_metric, Daemon, Scratch, IQN};

const IMAGE: usize = 8 << 20;

fn round_trip_on(dir: &std::path::Path) {
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    // The page cache is what this test is about (a disk file's default is direct I/O).
    let lun = format!("file:{},size=32M,cache=page", dir.join("lun.img").display());
    let daemon = Daemon::start_with_args(IQN, &[&lun], &["--metrics-listen", &listen]);
    let scratch = Scratch::new("file-reads");
    let image = scratch.file("image.raw");
    std::fs::write(&image, common::pseudo_random_bytes(IMAGE, 11)).expect("write image");
    let image = image.display().to_string();
    common::upload(&daemon, 0, &image);
    // qemu-img compare reads the mapped part (GET LBA STATUS) in large chunks; those file
    // pages were just written, so they are cached.
    common::assert_identical(&daemon, 0, &image);
    let read = "ferrosan_device_read_bytes_total{device=\"lun0\"}";
    let sent = "ferrosan_device_sendfile_bytes_total{device=\"lun0\"}";
    let text = wait_for_metric(metrics_port, read, |v| v >= IMAGE as f64);
    let (read_bytes, sent_bytes) = (metric(&text, read), metric(&text, sent));
    assert!(
        read_bytes >= IMAGE as f64,
        "compare reads the image back:\n{text}"
    );
    if common::kernel_has_cachestat() {
        assert!(
            sent_bytes >= IMAGE as f64 && sent_bytes <= read_bytes,
            "the written (cached) part goes out with sendfile: {sent_bytes} of {read_bytes}\n{text}"
        );
    } else {
        assert_eq!(sent_bytes, 0.0, "no cachestat, no sendfile:\n{text}");
    }
    // 4 KiB reads are copied: the sendfile count stays, the read count grows by 1 MiB.
    run(
        "qemu-img",
        &[
            "bench",
            "-f",
            "raw",
            "-t",
            "none",
            "-c",
            "256",
            "-d",
            "4",
            "-s",
            "4096",
            &daemon.url(0),
        ],
    )
    .expect_ok(&daemon);
    let more = read_bytes + 1024.0 * 1024.0;
    let text = wait_for_metric(metrics_port, read, |v| v >= more);
    assert_eq!(metric(&text, read), more, "{text}");
    assert_eq!(
        metric(&text, sent),
        sent_bytes,
        "short reads are copied:\n{text}"
    );
}

#[test]
fn cached_reads_of_a_disk_file_are_sent_from_the_page_cache() {
    let dir = Scratch::new("file-reads-disk");
    round_trip_on(&dir.path);
}

#[test]
fn cached_reads_of_a_tmpfs_file_are_sent_from_the_page_cache() {
    let shm = std::path::Path::new("/dev/shm");
    assert!(shm.is_dir(), "/dev/shm (tmpfs) is needed for this test");
    let dir = shm.join(format!("ferrosan-file-reads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create dir on /dev/shm");
    round_trip_on(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_initiator_that_stops_reading_file_reads_does_not_stall_its_worker() {
    const MIB: usize = 1 << 20;
    let dir = Scratch::new("file-reads-stuck");
    let lun = format!("file:{},size=64M", dir.path.join("lun.img").display());
    // One worker: the stuck session and the good client share it.
    let daemon = Daemon::start_with_args(IQN, &[&lun], &["--workers", "1"]);
    let scratch = Scratch::new("file-reads-stuck-image");
    let image_path = scratch.file("image.raw");
    let image = common::pseudo_random_bytes(16 * MIB, 29);
    std::fs::write(&image_path, &image).expect("write image");
    let image_path = image_path.display().to_string();
    common::upload(&daemon, 0, &image_path);
    // Sixteen 1 MiB reads of cached pages (the sendfile path), none of their answers read: the
    // target's socket fills and its sends wait for room.
    let mut stuck = Raw::login(daemon.port, IQN, 7);
    // A new nexus first collects its unit attention (power on).
    let tur = stuck.command(100, &[0u8; 6], 0x81, 0);
    stuck.send(&tur, &[]);
    let _ = stuck.recv();
    for itt in 0..16u32 {
        let cdb = rw10(0x28, itt * 2048, 2048);
        let bhs = stuck.command(itt, &cdb, 0xc1, MIB as u32);
        stuck.send(&bhs, &[]);
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Meanwhile a good client on the same worker reads the whole image back.
    common::assert_identical(&daemon, 0, &image_path);
    // The stuck initiator, reading at last, gets every byte of every read. Each read's
    // Data-In is placed by its ITT and buffer offset: tasks may complete, and so be sent, in
    // any order (RFC 7143 orders the PDUs of one task, not tasks among themselves).
    let mut reads = vec![Vec::new(); 16];
    let mut done = 0;
    while done < 16 {
        let pdu = stuck.recv();
        let Some(read) = reads.get_mut(pdu.bhs.itt() as usize) else {
            continue; // the target's own NOP-In pings
        };
        let offset = pdu.bhs.u32_at(iscsi::pdu::off::BUFFER_OFFSET) as usize;
        assert_eq!(offset, read.len(), "Data-In of one task out of order");
        read.extend_from_slice(&pdu.data);
        if pdu.bhs.flags() & 0x01 != 0 {
            assert_eq!(
                common::raw::status_of(&pdu),
                0,
                "read failed: {:?}",
                pdu.bhs
            );
            done += 1;
        }
    }
    for (itt, data) in reads.iter().enumerate() {
        assert!(
            *data == image[itt * MIB..(itt + 1) * MIB],
            "read {itt} differs ({} bytes)",
            data.len()
        );
    }
}
