//! `LunMap::try_execute`: what a network worker runs. Reads lend RAM pages instead of copying,
//! reads of uncached file data are declined without effect, everything else runs as usual.
mod common;
use common::*;
use scsi::{
    Command, Completion, FileRange, Lending, LogicalUnit, LuSettings, LunMap, SharedSlice, Status,
};
use std::sync::Arc;
use store::{BlockStore, FileStore, RamStore};

fn gather(lent: &[SharedSlice]) -> Vec<u8> {
    let mut v = Vec::new();
    for (owner, range) in lent {
        v.extend_from_slice(&(**owner).as_ref()[range.clone()]);
    }
    v
}

fn try_run(
    m: &LunMap,
    cdb: &[u8],
    data_out: &[u8],
    limit: u32,
    data_in: &mut Vec<u8>,
    lent: &mut Vec<SharedSlice>,
) -> Option<Completion> {
    let cmd = Command {
        cdb,
        data_out,
        data_in_limit: limit,
    };
    let mut file = None;
    let lending = Lending {
        slices: lent,
        file: &mut file,
        file_min_bytes: 0,
    };
    let c = m.try_execute(&nexus(1), 0, &cmd, data_in, lending);
    assert!(file.is_none(), "file ranges are lent only when asked for");
    c
}

/// Like `try_run`, with file ranges welcome from `file_min_bytes` on.
fn try_run_files(
    m: &LunMap,
    cdb: &[u8],
    limit: u32,
    data_in: &mut Vec<u8>,
    file: &mut Option<FileRange>,
    file_min_bytes: u32,
) -> Option<Completion> {
    let cmd = Command {
        cdb,
        data_out: &[],
        data_in_limit: limit,
    };
    let mut slices = Vec::new();
    let lending = Lending {
        slices: &mut slices,
        file,
        file_min_bytes,
    };
    let c = m.try_execute(&nexus(1), 0, &cmd, data_in, lending);
    assert!(slices.is_empty(), "a file store lends no memory");
    c
}

fn file_bytes((file, offset, len): &FileRange) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut v = vec![0u8; *len];
    file.read_exact_at(&mut v, *offset).unwrap();
    v
}

fn map_of(store: Arc<dyn BlockStore>) -> LunMap {
    let lu = Arc::new(LogicalUnit::new(store, identity(), LuSettings::default()).unwrap());
    // A fresh nexus sees "power on" first; clear it so reads run.
    let mut buf = Vec::new();
    let tur = Command {
        cdb: &[0; 6],
        data_out: &[],
        data_in_limit: 0,
    };
    lu.execute(&nexus(1), &tur, &mut buf);
    LunMap::new(vec![(0, lu, false)]).unwrap()
}

#[test]
fn ram_reads_lend_pages_and_match_the_copy() {
    let m = map_of(Arc::new(RamStore::new(4 * MIB)));
    let data = pattern(64 * 1024, 9);
    let (mut data_in, mut lent) = (Vec::new(), Vec::new());
    let c = try_run(&m, &write10(7, 128), &data, 0, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    assert!(lent.is_empty());
    // Unaligned to pages, and crossing unwritten space.
    let c = try_run(&m, &read10(7, 200), &[], 1 << 20, &mut data_in, &mut lent).unwrap();
    assert_eq!((c.status, c.transfer_len), (Status::Good, 200 * 512));
    assert!(data_in.is_empty(), "nothing copied");
    let got = gather(&lent);
    assert_eq!(&got[..data.len()], &data[..]);
    assert!(got[data.len()..].iter().all(|&b| b == 0));
    assert_eq!(got.len(), 200 * 512);
    // The transport's expected length bounds what is lent; the CDB's length is reported.
    lent.clear();
    let c = try_run(&m, &read10(7, 200), &[], 1000, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.transfer_len, 200 * 512);
    assert_eq!(gather(&lent), &data[..1000]);
    // A failing read lends nothing.
    lent.clear();
    let c = try_run(&m, &read10(8191, 2), &[], 1 << 20, &mut data_in, &mut lent).unwrap();
    lba_oob(&c.sense.unwrap());
    assert!(lent.is_empty() && data_in.is_empty());
    // Non-read commands build their data as before.
    let c = try_run(
        &m,
        &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &[],
        8,
        &mut data_in,
        &mut lent,
    );
    assert_eq!(c.unwrap().status, Status::Good);
    assert_eq!(data_in.len(), 8);
    assert!(lent.is_empty());
}

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes the store back and drops `[at, at + len)` from the page cache. DONTNEED is advice: a
/// page still in another CPU's LRU batch survives a round (CI saw it, about 1 run in 100), so
/// it is repeated until the store no longer finds the whole range cached. Kernels without
/// cachestat (before 6.5) cannot tell; they get a single round.
fn write_back_and_evict(store: &FileStore, path: &std::path::Path, at: u64, len: u64) {
    store.flush().unwrap();
    let file = std::fs::File::open(path).unwrap();
    for _ in 0..50 {
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        if store.cached_file_range(at, len).unwrap().is_none() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("the kernel kept every page of [{at}, +{len}) through 50 evictions");
}

#[test]
fn uncached_file_reads_are_declined_without_effect() {
    // The build directory is on a disk filesystem (not tmpfs), where pages can be uncached.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nonblocking-{}", std::process::id()));
    let _guard = TempFile(path.clone());
    let store = Arc::new(FileStore::open(&path, Some(4 * MIB), true).unwrap());
    let m = map_of(store.clone());
    let data = pattern(256 * 1024, 4);
    let (mut data_in, mut lent) = (Vec::new(), Vec::new());
    let c = try_run(&m, &write10(0, 512), &data, 0, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    // Cached: copied inline (a file store does not lend).
    let c = try_run(&m, &read10(0, 512), &[], 1 << 20, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    assert!(lent.is_empty());
    assert_eq!(data_in, data);
    // Written back and dropped from the page cache: declined, nothing produced.
    write_back_and_evict(&store, &path, 0, data.len() as u64);
    let declined = try_run(&m, &read10(0, 512), &[], 1 << 20, &mut data_in, &mut lent);
    assert!(
        declined.is_none(),
        "uncached read must not be served inline"
    );
    assert!(data_in.is_empty() && lent.is_empty());
    // The blocking path serves it.
    let cmd = Command {
        cdb: &read10(0, 512),
        data_out: &[],
        data_in_limit: 1 << 20,
    };
    let c = m.execute(&nexus(1), 0, &cmd, &mut data_in);
    assert_eq!(c.status, Status::Good);
    assert_eq!(data_in, data);
    // A reused buffer with an earlier read's bytes: overwritten and cut to the new length.
    data_in[..4096].fill(0xEE);
    let c = try_run(&m, &read10(8, 8), &[], 1 << 20, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    assert_eq!(data_in, &data[4096..8192]);
    // ...and emptied by a command without Data-In.
    let c = try_run(&m, &[0; 6], &[], 0, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    assert!(data_in.is_empty());
}

#[test]
fn cached_file_reads_lend_the_file_range() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nonblocking-files-{}", std::process::id()));
    let _guard = TempFile(path.clone());
    let store = Arc::new(FileStore::open(&path, Some(4 * MIB), true).unwrap());
    let m = map_of(store.clone());
    let data = pattern(256 * 1024, 5);
    let (mut data_in, mut lent) = (Vec::new(), Vec::new());
    let c = try_run(&m, &write10(16, 512), &data, 0, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    let mut file = None;
    let c = try_run_files(
        &m,
        &read10(16, 512),
        1 << 20,
        &mut data_in,
        &mut file,
        64 * 1024,
    );
    assert_eq!(c.unwrap().status, Status::Good);
    let Some(range) = file.take() else {
        // Kernels before 6.5 have no cachestat: the read is copied, which the other tests cover.
        assert_eq!(data_in, data);
        return;
    };
    assert!(data_in.is_empty(), "nothing copied");
    assert_eq!((range.1, range.2), (16 * 512, data.len()));
    assert_eq!(file_bytes(&range), data);
    // The transport's expected length bounds the range; the CDB's length is reported.
    let c = try_run_files(
        &m,
        &read10(17, 511),
        100_000,
        &mut data_in,
        &mut file,
        64 * 1024,
    );
    assert_eq!(c.unwrap().transfer_len, 511 * 512);
    let range = file.take().unwrap();
    assert_eq!((range.1, range.2), (17 * 512, 100_000));
    assert_eq!(file_bytes(&range), &data[512..100_512]);
    // Below the minimum the read is copied.
    let c = try_run_files(
        &m,
        &read10(16, 64),
        1 << 20,
        &mut data_in,
        &mut file,
        64 * 1024,
    );
    assert_eq!(c.unwrap().status, Status::Good);
    assert!(file.is_none());
    assert_eq!(data_in, &data[..32 * 1024]);
    // A failing read lends nothing.
    let c = try_run_files(&m, &read10(8191, 2), 1 << 20, &mut data_in, &mut file, 512);
    lba_oob(&c.unwrap().sense.unwrap());
    assert!(file.is_none() && data_in.is_empty());
    // Not cached (written back and dropped): declined without effect, as a copied read is.
    write_back_and_evict(&store, &path, 16 * 512, data.len() as u64);
    let declined = try_run_files(&m, &read10(16, 512), 1 << 20, &mut data_in, &mut file, 512);
    assert!(declined.is_none());
    assert!(file.is_none() && data_in.is_empty());
}

#[test]
fn write_back_writes_the_kernel_would_block_are_declined_and_run_again_whole() {
    let store = Arc::new(Recording::new(4 * MIB));
    let m = map_of(store.clone());
    let (mut data_in, mut lent) = (Vec::new(), Vec::new());
    let first = pattern(64 * 1024, 1);
    let c = try_run(&m, &write10(0, 128), &first, 0, &mut data_in, &mut lent).unwrap();
    assert_eq!(c.status, Status::Good);
    // The kernel would make the next write wait: declined, half of it written meanwhile.
    store.busy.store(true, std::sync::atomic::Ordering::SeqCst);
    let second = pattern(64 * 1024, 2);
    let declined = try_run(&m, &write10(0, 128), &second, 0, &mut data_in, &mut lent);
    assert!(declined.is_none(), "must be declined, not answered");
    // FUA (or write-through) writes never take the non-blocking path: they wait anyway, on the
    // blocking pool, where the engine sends them without asking (waits_for_device).
    let mut fua = write10(0, 128);
    fua[1] |= 0x08;
    assert!(m.get(0).unwrap().lu.waits_for_device(&fua));
    // Run again where waiting is fine: the whole write lands.
    let cmd = Command {
        cdb: &write10(0, 128),
        data_out: &second,
        data_in_limit: 0,
    };
    assert_eq!(
        m.execute(&nexus(1), 0, &cmd, &mut data_in).status,
        Status::Good
    );
    let cmd = Command {
        cdb: &read10(0, 128),
        data_out: &[],
        data_in_limit: 1 << 20,
    };
    assert_eq!(
        m.execute(&nexus(1), 0, &cmd, &mut data_in).status,
        Status::Good
    );
    assert_eq!(data_in, second);
}

/// A read the medium fails on a network worker is declined, not answered: finding which block
/// failed takes more reads, which only the blocking pool may wait for (it then answers with
/// the block named).
#[test]
fn a_medium_error_on_the_worker_is_declined_for_the_blocking_pool() {
    let store = Arc::new(Recording::new(4 * MIB));
    store.fail_reads(8 * 512..9 * 512, usize::MAX);
    let m = map_of(store);
    let (mut data_in, mut lent) = (Vec::new(), Vec::new());
    let c = try_run(&m, &read10(0, 16), &[], 16 * 512, &mut data_in, &mut lent);
    assert!(c.is_none(), "declined: {c:?}");
    let cmd = Command {
        cdb: &read10(0, 16),
        data_out: &[],
        data_in_limit: 16 * 512,
    };
    let c = m.execute(&nexus(1), 0, &cmd, &mut data_in);
    assert_eq!(c.status, Status::CheckCondition);
    assert_eq!(
        c.sense.map(|s| (s.key, s.asc, s.info)),
        Some((3, 0x11, Some(8)))
    );
}
