//! What VMware ESXi relies on, as ESXi issues it, on a RAM LU, a file on disk and an RBD image
//! behind two gateways:
//! - VMW_SATP_ALUA claims the LU: TPGS in INQUIRY and REPORT TARGET PORT GROUPS on every path;
//! - the VMFS heartbeat: many hosts' ATS (COMPARE AND WRITE of one block) on their own sectors
//!   and on one contested lock sector, interleaved with writes elsewhere, through both paths —
//!   never a false miscompare (a host that gets one loses access to the datastore: Broadcom KB
//!   2113956), and every ATS that succeeded counted exactly once;
//! - VAAI as ESXi sends it: block limits (VPD B0h) and provisioning (B2h) that pass its rules,
//!   WRITE SAME (16) zeroing and unmapping, UNMAP at the advertised granularity, and EXTENDED
//!   COPY with 16 MiB segments (the largest MaxHWTransferSize);
//! - round robin with `iops=1`: every command on the other path, each read seeing the write
//!   just made through the other one.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::array::{read_len, Array, Backing, Path, GOOD, LU_BYTES};
use common::pseudo_random_bytes;
use initiator::session::Transfer;

const HOST: &str = "iqn.1998-01.com.vmware:esx";
const MISCOMPARE: (u8, Option<(u8, u8, u8)>) = (0x02, Some((0x0E, 0x1D, 0x00)));
const BLOCK: usize = 512;
const MIB_BLOCKS: u32 = (1 << 20) / BLOCK as u32;

fn host(array: &Array, n: usize, path: usize) -> Path {
    let mut p = array.path(path, &format!("{HOST}{n}"));
    assert_eq!(p.settle(), GOOD, "{}", array.output());
    p
}

/// COMPARE AND WRITE of one block at `lba`: `old` expected, `new` written.
fn ats(p: &mut Path, lba: u64, old: &[u8], new: &[u8]) -> (u8, Option<(u8, u8, u8)>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x89;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[13] = 1;
    p.answer(&cdb, Transfer::Write([old, new].concat()))
}

/// A heartbeat or lock block: who wrote it and its sequence number, the rest fixed.
fn beat(owner: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![0x5Au8; BLOCK];
    b[..8].copy_from_slice(&owner.to_be_bytes());
    b[8..16].copy_from_slice(&seq.to_be_bytes());
    b
}

/// ESXi claims the LU with VMW_SATP_ALUA through either path: TPGS set, both groups reported,
/// exactly one active/optimized.
fn satp_alua_claims(array: &Array) {
    for path in 0..2 {
        let mut p = host(array, 0, path);
        let (status, _, inq) = p.run(&[0x12, 0, 0, 0, 96, 0], read_len(96));
        assert_eq!(status, 0);
        assert_ne!(inq[5] & 0x30, 0, "TPGS through path {path}");
        let groups = p.rtpg();
        assert_eq!(groups.len(), 2, "{groups:?}");
        let optimized = groups.iter().filter(|(_, state)| *state == 0).count();
        assert_eq!(optimized, 1, "one active/optimized group: {groups:?}");
    }
}

const HOSTS: usize = 6;
const LOCK_LBA: u64 = 900;
const HEARTBEAT_LBA: u64 = 1000;

/// One host's heartbeat loop until `until`: ATS on its own sector (any miscompare is false:
/// nobody else writes it) and, every fourth beat, an ATS on the shared lock sector from what it
/// read there (a miscompare is a lost race; a success is counted).
fn heartbeat(mut p: Path, me: u64, until: Instant, won: Arc<AtomicU64>) -> u64 {
    let lba = HEARTBEAT_LBA + me;
    let mut mine = beat(me, 0);
    assert_eq!(p.write(lba as u32, &mine), GOOD);
    let mut seq = 0;
    while Instant::now() < until {
        seq += 1;
        let next = beat(me, seq);
        assert_eq!(
            ats(&mut p, lba, &mine, &next),
            GOOD,
            "host {me}, beat {seq}"
        );
        mine = next;
        if seq % 4 == 0 {
            let (status, _, seen) = p.read(LOCK_LBA as u32, 1);
            assert_eq!(status, 0);
            let count = u64::from_be_bytes(seen[8..16].try_into().expect("count"));
            match ats(&mut p, LOCK_LBA, &seen, &beat(me, count + 1)) {
                GOOD => {
                    won.fetch_add(1, Ordering::AcqRel);
                }
                MISCOMPARE => {}
                other => panic!("host {me}: lock ATS answered {other:?}"),
            }
        }
    }
    seq
}

/// Writes elsewhere (64 KiB at a time above the heartbeat region) until `until`.
fn bystander(mut p: Path, seed: u64, until: Instant) -> u64 {
    let data = pseudo_random_bytes(64 << 10, seed);
    let mut n = 0u32;
    while Instant::now() < until {
        let lba = 4096 + (seed as u32 % 2) * 8192 + (n % 64) * 128;
        assert_eq!(p.write(lba, &data), GOOD);
        n += 1;
    }
    u64::from(n)
}

fn ats_heartbeat_load(array: &Array) {
    let mut setup = host(array, 99, 0);
    assert_eq!(setup.write(LOCK_LBA as u32, &beat(0, 0)), GOOD);
    let until = Instant::now() + Duration::from_secs(3);
    let won = Arc::new(AtomicU64::new(0));
    let beats: Vec<_> = (0..HOSTS)
        .map(|n| {
            let p = host(array, n, n % 2);
            let won = won.clone();
            std::thread::spawn(move || heartbeat(p, n as u64, until, won))
        })
        .collect();
    let writers: Vec<_> = (0..2)
        .map(|n| {
            let p = host(array, 50 + n, n);
            std::thread::spawn(move || bystander(p, n as u64, until))
        })
        .collect();
    let beats: Vec<u64> = beats.into_iter().map(|t| t.join().expect("host")).collect();
    let written: u64 = writers.into_iter().map(|t| t.join().expect("writer")).sum();
    assert!(beats.iter().all(|&b| b >= 8), "every host beat: {beats:?}");
    assert!(written > 0);
    let (status, _, lock) = setup.read(LOCK_LBA as u32, 1);
    assert_eq!(status, 0);
    let count = u64::from_be_bytes(lock[8..16].try_into().expect("count"));
    let won = won.load(Ordering::Acquire);
    assert!(won > 0, "some lock ATS succeeded");
    assert_eq!(count, won, "each successful ATS counted once on the lock");
    eprintln!(
        "{:?}: {} heartbeat ATS, {won} lock ATS won, {written} 64 KiB writes beside them",
        array.backing,
        beats.iter().sum::<u64>()
    );
}

/// Block limits (B0h) and logical block provisioning (B2h) as ESXi reads them.
fn vaai_limits(array: &Array) {
    let mut p = host(array, 0, 1);
    let (status, _, b0) = p.run(&[0x12, 1, 0xB0, 0, 64, 0], read_len(64));
    assert_eq!(status, 0);
    let be32 = |at: usize| u32::from_be_bytes(b0[at..at + 4].try_into().expect("u32"));
    assert!(
        b0[5] >= 1,
        "ATS of one block (MAXIMUM COMPARE AND WRITE LENGTH)"
    );
    assert!(
        be32(20) >= MIB_BLOCKS,
        "MAXIMUM UNMAP LBA COUNT covers 1 MiB"
    );
    assert!(be32(24) >= 1, "MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT");
    let granularity = be32(28);
    assert!(
        granularity >= 1 && MIB_BLOCKS.is_multiple_of(granularity),
        "OPTIMAL UNMAP GRANULARITY {granularity} divides 1 MiB"
    );
    let alignment = be32(32) & 0x7FFF_FFFF;
    assert!(
        alignment % granularity.max(1) == 0,
        "UGAVALID alignment {alignment}"
    );
    let write_same = u64::from_be_bytes(b0[36..44].try_into().expect("u64"));
    assert!(
        write_same >= u64::from(MIB_BLOCKS),
        "MAXIMUM WRITE SAME LENGTH {write_same}: ESXi zeroes 1 MiB at a time"
    );
    let (status, _, b2) = p.run(&[0x12, 1, 0xB2, 0, 8, 0], read_len(8));
    assert_eq!(status, 0);
    assert_eq!(
        b2[5] & 0xC0,
        0xC0,
        "LBPU and LBPWS: UNMAP and WRITE SAME (16) unmap"
    );
    assert_eq!(b2[6] & 0x07, 0x02, "thin provisioned");
    let (status, _, rc16) = p.run(
        &[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
        read_len(32),
    );
    assert_eq!(status, 0);
    assert_ne!(rc16[14] & 0x80, 0, "LBPME in READ CAPACITY (16)");
}

fn write_same16(
    p: &mut Path,
    lba: u64,
    blocks: u32,
    unmap: bool,
    block: &[u8],
) -> (u8, Option<(u8, u8, u8)>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x93;
    cdb[1] = if unmap { 0x08 } else { 0 };
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
    p.answer(&cdb, Transfer::Write(block.to_vec()))
}

fn unmap(p: &mut Path, ranges: &[(u64, u32)]) -> (u8, Option<(u8, u8, u8)>) {
    let mut params = vec![0u8; 8];
    params[0..2].copy_from_slice(&(6 + 16 * ranges.len() as u16).to_be_bytes());
    params[2..4].copy_from_slice(&(16 * ranges.len() as u16).to_be_bytes());
    for &(lba, blocks) in ranges {
        params.extend_from_slice(&lba.to_be_bytes());
        params.extend_from_slice(&blocks.to_be_bytes());
        params.extend_from_slice(&[0; 4]);
    }
    let mut cdb = [0u8; 10];
    cdb[0] = 0x42;
    cdb[7..9].copy_from_slice(&(params.len() as u16).to_be_bytes());
    p.answer(&cdb, Transfer::Write(params))
}

/// Writes `data` in 1 MiB WRITE (10)s from `lba`.
fn fill(p: &mut Path, lba: u32, data: &[u8]) {
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        assert_eq!(p.write(lba + i as u32 * MIB_BLOCKS, chunk), GOOD);
    }
}

/// Reads `blocks` in 1 MiB READ (10)s from `lba`.
fn read_all(p: &mut Path, lba: u32, blocks: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < blocks {
        let n = (blocks - at).min(MIB_BLOCKS);
        let (status, sense, data) = p.read(lba + at, n as u16);
        assert_eq!(status, 0, "{sense:?}");
        out.extend_from_slice(&data);
        at += n;
    }
    out
}

/// Block zeroing and space reclamation as ESXi sends them: WRITE SAME (16) of a zero block
/// over 1 MiB, WRITE SAME (16) with UNMAP, UNMAP of whole granules; each range reads zeros.
fn vaai_zero_and_unmap(array: &Array) {
    let mut p = host(array, 1, 1);
    let base = 8 * MIB_BLOCKS;
    let data = pseudo_random_bytes(4 << 20, 7);
    fill(&mut p, base, &data);
    let zero = vec![0u8; BLOCK];
    assert_eq!(
        write_same16(&mut p, u64::from(base), MIB_BLOCKS, false, &zero),
        GOOD
    );
    let second = u64::from(base + MIB_BLOCKS);
    assert_eq!(write_same16(&mut p, second, MIB_BLOCKS, true, &zero), GOOD);
    assert_eq!(
        unmap(&mut p, &[(second + u64::from(MIB_BLOCKS), MIB_BLOCKS)]),
        GOOD
    );
    let read = read_all(&mut p, base, 4 * MIB_BLOCKS);
    assert!(
        read[..3 << 20].iter().all(|&b| b == 0),
        "zeroed and unmapped ranges read zeros"
    );
    assert!(
        read[3 << 20..] == data[3 << 20..],
        "the MiB after them kept its data"
    );
}

/// The LU's NAA designator from VPD 83h.
fn naa(p: &mut Path) -> Vec<u8> {
    let (status, _, page) = p.run(&[0x12, 1, 0x83, 1, 0, 0], read_len(256));
    assert_eq!(status, 0);
    let mut at = 4;
    while at + 4 <= page.len() {
        let len = usize::from(page[at + 3]);
        if page[at + 1] & 0x3F == 0x03 {
            return page[at + 4..at + 4 + len].to_vec();
        }
        at += 4 + len;
    }
    panic!("no NAA designator: {page:02x?}");
}

/// An EXTENDED COPY (LID1) parameter list as ESXi's clone sends it: one identification target
/// descriptor naming the LU `id` (it copies to itself), block-to-block segments of
/// `(blocks, source LBA, destination LBA)`.
fn xcopy_list(id: &[u8], segments: &[(u16, u64, u64)]) -> Vec<u8> {
    let mut target = vec![0u8; 32];
    target[0] = 0xE4;
    target[4] = 0x01; // binary
    target[5] = 0x03; // LU, NAA
    target[7] = id.len() as u8;
    target[8..8 + id.len()].copy_from_slice(id);
    target[29..32].copy_from_slice(&(BLOCK as u32).to_be_bytes()[1..]);
    let mut list = vec![0u8; 16];
    list[1] = 0x18; // no list identifier
    list[2..4].copy_from_slice(&32u16.to_be_bytes());
    list[8..12].copy_from_slice(&(28 * segments.len() as u32).to_be_bytes());
    list.extend_from_slice(&target);
    for &(blocks, src, dst) in segments {
        let mut segment = vec![0u8; 28];
        segment[0] = 0x02; // block to block
        segment[3] = 0x18;
        segment[10..12].copy_from_slice(&blocks.to_be_bytes());
        segment[12..20].copy_from_slice(&src.to_be_bytes());
        segment[20..28].copy_from_slice(&dst.to_be_bytes());
        list.extend_from_slice(&segment);
    }
    list
}

fn xcopy(p: &mut Path, list: Vec<u8>) -> (u8, Option<(u8, u8, u8)>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x83;
    cdb[10..14].copy_from_slice(&(list.len() as u32).to_be_bytes());
    p.answer(&cdb, Transfer::Write(list))
}

/// VAAI full copy: one 16 MiB segment (the largest `MaxHWTransferSize`), then the default's
/// four 4 MiB segments in one command; each copy equals its source.
fn vaai_full_copy(array: &Array) {
    let mut p = host(array, 2, 1);
    let source = pseudo_random_bytes(16 << 20, 11);
    fill(&mut p, 0, &source);
    let id = naa(&mut p);
    let blocks = 16 * MIB_BLOCKS;
    let dst = LU_BYTES / BLOCK as u64 / 2;
    let one = xcopy_list(&id, &[(blocks as u16, 0, dst)]);
    assert_eq!(xcopy(&mut p, one), GOOD, "{}", array.output());
    let copy = read_all(&mut p, dst as u32, blocks);
    assert!(copy == source, "the 16 MiB clone differs from its source");
    let (four_mib, dst) = (4 * u64::from(MIB_BLOCKS), dst + u64::from(blocks));
    let segments: Vec<_> = (0..4)
        .map(|i| (four_mib as u16, i * four_mib, dst + i * four_mib))
        .collect();
    assert_eq!(xcopy(&mut p, xcopy_list(&id, &segments)), GOOD);
    let copy = read_all(&mut p, dst as u32, blocks);
    assert!(
        copy == source,
        "the clone in 4 MiB segments differs from its source"
    );
}

/// Round robin, one command per path: write through one path, read it back through the other,
/// alternating, over a small working set.
fn round_robin_iops_1(array: &Array) {
    let mut paths = [host(array, 3, 0), host(array, 3, 1)];
    let mut last = vec![None; 32];
    for i in 0..400u64 {
        let slot = (i * 7 % 32) as usize;
        let lba = 20_000 + slot as u32 * 8;
        let data = pseudo_random_bytes(4096, 1000 + i);
        assert_eq!(paths[(i % 2) as usize].write(lba, &data), GOOD, "write {i}");
        last[slot] = Some(data);
        let (status, _, read) = paths[((i + 1) % 2) as usize].read(lba, 8);
        assert_eq!(status, 0);
        assert!(
            Some(read) == last[slot],
            "command {i}: the other path read stale data"
        );
    }
}

fn vmware(backing: Backing, tag: &str) {
    let array = Array::start(backing, tag);
    satp_alua_claims(&array);
    vaai_limits(&array);
    ats_heartbeat_load(&array);
    vaai_zero_and_unmap(&array);
    vaai_full_copy(&array);
    round_robin_iops_1(&array);
}

#[test]
fn vmware_esxi_rules_on_ram() {
    vmware(Backing::Ram, "esx-ram");
}

#[test]
fn vmware_esxi_rules_on_disk() {
    vmware(Backing::Disk, "esx-disk");
}

#[test]
fn vmware_esxi_rules_across_two_rbd_gateways() {
    vmware(Backing::Rbd, "esx-rbd");
}
