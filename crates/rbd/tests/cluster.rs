//! The binding against a real single-node Ceph cluster (scripts/ceph-single-node.sh), started
//! for this test and stopped on Drop. Missing Ceph packages are a failure, as every other
//! missing tool is (scripts/test.sh installs them).

use rbd::{Cluster, ClusterOptions, Image, Op};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

// The single-node cluster helper the daemon's tests use too.
#[path = "../../ferrosan/tests/common/ceph.rs"]
mod ceph;
use ceph::TestCluster;

fn options(cluster: &TestCluster) -> ClusterOptions {
    ClusterOptions {
        conf: Some(cluster.conf.clone()),
        ..Default::default()
    }
}

/// Reads `len` bytes at `offset`, which must succeed.
fn read(image: &Image, offset: u64, len: usize) -> Vec<u8> {
    let f = image.run(Op::Read { offset, len }, Vec::new());
    assert_eq!(f.result, Ok(len), "read at {offset}");
    f.buf
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn an_image_reads_writes_flushes_discards_compares_and_grows_through_librbd() {
    rbd::available().expect("librbd loads");
    let c = TestCluster::start("binding", 2, "");
    c.rbd(&["create", "rbd/img", "--size", "64M"]);
    let cluster = Cluster::connect(&options(&c)).expect("connect");
    let image = Image::open(&cluster, "rbd", "img").expect("open");
    assert_eq!(image.size().unwrap(), 64 << 20);

    // Bounded waits and a caller's defaults apply where the config is silent, and yield to a
    // config that chooses.
    let seconds = |c: &Cluster, key: &str| c.option(key).unwrap().trim().parse::<f64>().unwrap();
    assert_eq!(seconds(&cluster, "rados_osd_op_timeout"), 30.0);
    let thread_default = vec![("librados_thread_count".to_string(), "1".to_string())];
    let defaulted = Cluster::connect(&ClusterOptions {
        defaults: thread_default.clone(),
        ..options(&c)
    })
    .expect("connect");
    assert_eq!(defaulted.option("librados_thread_count").unwrap(), "1");
    let chosen_conf = c.conf.with_file_name("chosen.conf");
    let text = std::fs::read_to_string(&c.conf).unwrap();
    std::fs::write(
        &chosen_conf,
        format!("{text}\n[client.admin]\nlibrados_thread_count = 3\nrados_osd_op_timeout = 7\n"),
    )
    .unwrap();
    let chosen = Cluster::connect(&ClusterOptions {
        conf: Some(chosen_conf),
        defaults: thread_default,
        ..Default::default()
    })
    .expect("connect");
    assert_eq!(chosen.option("librados_thread_count").unwrap(), "3");
    assert_eq!(seconds(&chosen, "rados_osd_op_timeout"), 7.0);
    drop((defaulted, chosen));

    // 64 asynchronous 4 KiB writes in flight at once, completions through a channel.
    let (tx, rx) = std::sync::mpsc::channel();
    let sink: rbd::Sink<u64> = Arc::new(move |f| {
        let _ = tx.send(f);
    });
    for i in 0..64u64 {
        let r = image.submit(
            Op::Write { offset: i * 8192 },
            pattern(i as u8, 4096),
            i,
            Arc::clone(&sink),
        );
        assert!(r.is_ok());
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..64 {
        let f = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("completion");
        assert_eq!(f.result.as_ref().copied(), Ok(4096), "write {}", f.tag);
        assert_eq!(f.buf, pattern(f.tag as u8, 4096), "the buffer comes back");
        seen.insert(f.tag);
    }
    assert_eq!(seen.len(), 64);
    assert!(image.run(Op::Flush, Vec::new()).result.is_ok());
    for i in [0u64, 17, 63] {
        let f = image.run(
            Op::Read {
                offset: i * 8192,
                len: 4096,
            },
            Vec::new(),
        );
        assert_eq!(f.result, Ok(4096));
        assert_eq!(f.buf, pattern(i as u8, 4096), "read back {i}");
    }
    // A discard of whole objects (4 MiB) and write-zeroes read back as zeros. (librbd skips
    // discards smaller than its 64 KiB granularity: UNMAP promises no zeros there, LBPRZ = 0.)
    assert!(image
        .run(
            Op::Discard {
                offset: 0,
                len: 4 << 20
            },
            Vec::new()
        )
        .result
        .is_ok());
    assert!(image
        .run(
            Op::WriteZeroes {
                offset: 17 * 8192,
                len: 4096
            },
            Vec::new()
        )
        .result
        .is_ok());
    for off in [0u64, 17 * 8192] {
        let f = image.run(
            Op::Read {
                offset: off,
                len: 4096,
            },
            Vec::new(),
        );
        assert!(f.buf.iter().all(|&b| b == 0), "zeros at {off}");
    }
    // COMPARE AND WRITE of one 512-byte block (ESXi's ATS; librbd refuses extents that cross a
    // 512-byte sector with EINVAL): a match writes, a miscompare names the first differing byte.
    const CAW_AT: u64 = 8 << 20;
    assert!(image
        .run(Op::Write { offset: CAW_AT }, pattern(63, 512))
        .result
        .is_ok());
    let mut cw = pattern(63, 512);
    cw.extend(pattern(99, 512));
    let f = image.run(Op::CompareAndWrite { offset: CAW_AT }, cw);
    assert!(
        f.result.is_ok(),
        "{:?} mismatch at {:?}",
        f.result,
        f.mismatch_at
    );
    assert_eq!(read(&image, CAW_AT, 512), pattern(99, 512));
    let mut stale = pattern(99, 512);
    stale[100] ^= 0xff;
    stale.extend(pattern(5, 512));
    let f = image.run(Op::CompareAndWrite { offset: CAW_AT }, stale);
    assert_eq!(
        f.result.as_ref().err().and_then(|e| e.errno()),
        Some(84),
        "EILSEQ"
    );
    assert_eq!(f.mismatch_at, Some(CAW_AT + 100));
    assert_eq!(read(&image, CAW_AT, 512), pattern(99, 512), "not written");
    // Odd-length compare-and-write is refused before librbd sees it.
    assert!(image
        .run(Op::CompareAndWrite { offset: 0 }, vec![0; 3])
        .result
        .is_err());
    // Past the end: an error, not a crash.
    let f = image.run(
        Op::Read {
            offset: 128 << 20,
            len: 4096,
        },
        Vec::new(),
    );
    assert!(f.result.is_err(), "read past the end");
    // Resize grows the image for every client.
    image.resize(128 << 20).unwrap();
    assert_eq!(
        Image::open(&cluster, "rbd", "img").unwrap().size().unwrap(),
        128 << 20
    );
    image.lock_exclusive().expect("exclusive lock");
    // The one holder, named by its client's address (what a gateway records with its name,
    // so that a restarted gateway knows its dead predecessor's lock).
    let holders = image.lock_owners().unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(
        holders[0].contains('/'),
        "an address and nonce: {holders:?}"
    );
    // The holder is among the image's watchers, named alike (how a standby gateway tells a
    // live owner from a dead one); a second client of the image watches too, and stops
    // watching when it closes the image.
    let watchers = image.watchers().unwrap();
    assert!(
        watchers
            .iter()
            .any(|w| w == rbd::plain_address(&holders[0])),
        "holder {holders:?} not among watchers {watchers:?}"
    );
    // Compare-and-set of a metadata key: an absent key holds ""; a stale expectation
    // writes nothing; what it sets is what librbd reads.
    assert!(image.compare_and_set_metadata("t.cas", "", "one").unwrap());
    assert_eq!(image.metadata("t.cas").unwrap().as_deref(), Some("one"));
    assert!(!image.compare_and_set_metadata("t.cas", "", "two").unwrap());
    assert!(!image
        .compare_and_set_metadata("t.cas", "zero", "two")
        .unwrap());
    assert_eq!(image.metadata("t.cas").unwrap().as_deref(), Some("one"));
    assert!(image
        .compare_and_set_metadata("t.cas", "one", "two")
        .unwrap());
    assert_eq!(image.metadata("t.cas").unwrap().as_deref(), Some("two"));
    let other = Arc::new(Image::open(&cluster, "rbd", "img").unwrap());
    let with_other = image.watchers().unwrap();
    assert_eq!(with_other.len(), watchers.len() + 1, "{with_other:?}");
    // While the lock is held in exclusive mode, another client's write is refused with EROFS
    // (librbd does not move the lock): what a gateway's reconnected image meets once another
    // gateway took the image over, which the store answers as a fenced write.
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = Arc::clone(&other);
    let handle = std::thread::spawn(move || {
        let f = writer.run(Op::Write { offset: 0 }, vec![7; 512]);
        let _ = tx.send(f.result.err().and_then(|e| e.errno()));
    });
    let refused = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a write without the lock is answered, not held");
    assert_eq!(refused, Some(30), "EROFS");
    // The thread's clone must be gone before the image closes with the last one.
    handle.join().unwrap();
    drop(other);
    assert_eq!(image.watchers().unwrap(), watchers);
    drop(image);

    // Missing image and pool: ENOENT, named.
    let e = Image::open(&cluster, "rbd", "nope").err().unwrap();
    assert_eq!(e.errno(), Some(2));
    assert!(e.to_string().contains("rbd/nope"), "{e}");
    let e = Image::open(&cluster, "nopool", "img").err().unwrap();
    assert_eq!(e.errno(), Some(2));
    assert!(e.to_string().contains("nopool"), "{e}");
}

#[test]
fn a_cluster_that_is_not_there_fails_in_bounded_time() {
    rbd::available().expect("librbd loads");
    // A monitor address nobody listens on.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ceph-dead-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("ceph.conf");
    std::fs::write(
        &conf,
        "[global]\nmon host = [v2:127.0.0.1:9]\nauth client required = none\n",
    )
    .unwrap();
    let started = Instant::now();
    let e = Cluster::connect(&ClusterOptions {
        conf: Some(conf),
        settings: vec![("client_mount_timeout".into(), "3".into())],
        ..Default::default()
    })
    .err()
    .expect("no cluster, no connection");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    assert!(e.to_string().contains("connecting"), "{e}");
    let missing = Cluster::connect(&ClusterOptions {
        conf: Some(dir.join("absent.conf")),
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(missing.to_string().contains("absent.conf"), "{missing}");
    let _ = std::fs::remove_dir_all(&dir);
}
