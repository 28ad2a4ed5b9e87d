//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS through a LUN map.
mod common;
use common::*;
use scsi::{Command, Completion, LogicalUnit, LuSettings, LunMap, Sense, Status};
use std::sync::Arc;
use store::{BlockStore, RamStore};

const BLOCKS: u64 = 4096; // 2 MiB of 512-byte blocks

fn lu(last: u8, settings: LuSettings) -> (Arc<LogicalUnit>, Arc<RamStore>) {
    let mut id = identity();
    id.naa[7] = last;
    id.serial = format!("xc{last}");
    let store = Arc::new(RamStore::new(BLOCKS * 512));
    (
        Arc::new(LogicalUnit::new(store.clone(), id, settings).unwrap()),
        store,
    )
}

fn naa(l: &LogicalUnit) -> Vec<u8> {
    l.identity().naa[..l.identity().naa_len].to_vec()
}

fn target(naa: &[u8]) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    d[0] = 0xE4;
    d[4] = 0x01;
    d[5] = 0x03;
    d[7] = naa.len() as u8;
    d[8..8 + naa.len()].copy_from_slice(naa);
    d[30] = 0x02;
    d
}

fn segment(src: u16, dst: u16, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
    let mut d = vec![0u8; 28];
    d[0] = 0x02;
    d[3] = 0x18;
    d[4..6].copy_from_slice(&src.to_be_bytes());
    d[6..8].copy_from_slice(&dst.to_be_bytes());
    d[10..12].copy_from_slice(&blocks.to_be_bytes());
    d[12..20].copy_from_slice(&src_lba.to_be_bytes());
    d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
    d
}

fn list(list_id: u8, usage: u8, targets: &[Vec<u8>], segments: &[Vec<u8>]) -> Vec<u8> {
    let t = targets.concat();
    let s = segments.concat();
    let mut p = vec![0u8; 16];
    p[0] = list_id;
    p[1] = usage << 3;
    p[2..4].copy_from_slice(&(t.len() as u16).to_be_bytes());
    p[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
    p.extend_from_slice(&t);
    p.extend_from_slice(&s);
    p
}

fn xcopy_cdb(len: usize) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x83;
    c[10..14].copy_from_slice(&(len as u32).to_be_bytes());
    c
}

fn rcr_cdb(sa: u8, list_id: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x84;
    c[1] = sa;
    c[2] = list_id;
    c[10..14].copy_from_slice(&1024u32.to_be_bytes());
    c
}

fn exec(m: &LunMap, lun: u64, nexus_id: u64, cdb: &[u8], data_out: &[u8]) -> (Completion, Vec<u8>) {
    let mut buf = Vec::new();
    let cmd = Command {
        cdb,
        data_out,
        data_in_limit: 1 << 20,
    };
    let c = m.execute(&nexus(nexus_id), lun, &cmd, &mut buf);
    (c, buf)
}

fn xcopy(m: &LunMap, lun: u64, p: &[u8]) -> Completion {
    exec(m, lun, 1, &xcopy_cdb(p.len()), p).0
}

fn key(c: &Completion) -> (u8, u8, u8) {
    let s: Sense = c.sense.expect("sense");
    (s.key, s.asc, s.ascq)
}

fn fill(s: &RamStore, block: u64, blocks: u64, byte: u8) {
    s.write_at(&vec![byte; (blocks * 512) as usize], block * 512, false)
        .unwrap();
}

fn read(s: &RamStore, block: u64, blocks: u64) -> Vec<u8> {
    let mut b = vec![0u8; (blocks * 512) as usize];
    s.read_at(&mut b, block * 512).unwrap();
    b
}

fn setup() -> (
    LunMap,
    Arc<LogicalUnit>,
    Arc<RamStore>,
    Arc<LogicalUnit>,
    Arc<RamStore>,
) {
    let (a, sa) = lu(1, LuSettings::default());
    let (b, sb) = lu(2, LuSettings::default());
    let m = LunMap::new(vec![(0, a.clone(), false), (1, b.clone(), false)]).unwrap();
    // Clear the power-on unit attentions.
    for lun in [0, 1] {
        exec(&m, lun, 1, &[0, 0, 0, 0, 0, 0], &[]);
        exec(&m, lun, 2, &[0, 0, 0, 0, 0, 0], &[]);
    }
    (m, a, sa, b, sb)
}

#[test]
fn copies_within_one_lu() {
    let (m, a, sa, _b, _sb) = setup();
    fill(&sa, 0, 16, b'A');
    let p = list(
        1,
        3,
        &[target(&naa(&a))],
        &[segment(0, 0, 16, 0, BLOCKS - 16)],
    );
    let c = xcopy(&m, 0, &p);
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
    assert_eq!(c.transfer_len, p.len() as u32);
    assert_eq!(read(&sa, BLOCKS - 16, 16), vec![b'A'; 16 * 512]);
}

#[test]
fn copies_between_lus_of_the_map() {
    let (m, a, sa, b, sb) = setup();
    fill(&sa, 10, 8, b'X');
    // Sent to LUN 1 (the destination), naming LUN 0 as the source.
    let p = list(
        1,
        3,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 8, 10, 100), segment(1, 0, 8, 100, 200)],
    );
    let c = xcopy(&m, 1, &p);
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
    assert_eq!(read(&sb, 100, 8), vec![b'X'; 8 * 512]);
    assert_eq!(read(&sa, 200, 8), vec![b'X'; 8 * 512]);
}

#[test]
fn overlapping_copy_upwards_is_exact() {
    let (m, a, sa, _b, _sb) = setup();
    for i in 0..8u64 {
        fill(&sa, i, 1, i as u8 + 1);
    }
    let before = read(&sa, 0, 8);
    let p = list(1, 3, &[target(&naa(&a))], &[segment(0, 0, 8, 0, 3)]);
    assert_eq!(xcopy(&m, 0, &p).status, Status::Good);
    assert_eq!(read(&sa, 3, 8), before);
}

#[test]
fn lu_alone_reaches_only_itself() {
    let (_m, a, _sa, b, _sb) = setup();
    let p = list(
        1,
        3,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 1, 0, 0)],
    );
    let mut buf = Vec::new();
    let cmd = Command {
        cdb: &xcopy_cdb(p.len()),
        data_out: &p,
        data_in_limit: 0,
    };
    a.execute(&nexus(7), &cmd, &mut buf); // unit attention
    let c = a.execute(&nexus(7), &cmd, &mut buf);
    assert_eq!(key(&c), (0x0A, 0x08, 0x04));
}

#[test]
fn copy_aborted_errors() {
    let (m, a, sa, _b, _sb) = setup();
    fill(&sa, 0, 1, b'Q');
    // A segment naming a target descriptor that does not exist.
    let p = list(1, 0, &[target(&naa(&a))], &[segment(0, 1, 1, 0, 0)]);
    assert_eq!(key(&xcopy(&m, 0, &p)), (0x0A, 0x08, 0x04));
    // A designator no LU of the map has.
    let p = list(
        1,
        0,
        &[target(&[0x50, 9, 9, 9, 9, 9, 9, 9])],
        &[segment(0, 0, 1, 0, 0)],
    );
    assert_eq!(key(&xcopy(&m, 0, &p)), (0x0A, 0x08, 0x04));
    // Beyond the end of the destination, and of the source: nothing is written.
    let p = list(
        1,
        0,
        &[target(&naa(&a))],
        &[segment(0, 0, 16, 0, BLOCKS - 1)],
    );
    assert_eq!(key(&xcopy(&m, 0, &p)), (0x0A, 0x00, 0x00));
    let p = list(
        1,
        0,
        &[target(&naa(&a))],
        &[segment(0, 0, 1, 0, 50), segment(0, 0, 16, BLOCKS - 1, 0)],
    );
    assert_eq!(key(&xcopy(&m, 0, &p)), (0x0A, 0x00, 0x00));
    assert_eq!(read(&sa, 50, 1), vec![0; 512]);
    // A failed copy holds no status.
    let (c, _) = exec(&m, 0, 1, &rcr_cdb(0, 1), &[]);
    assert_eq!(key(&c), (0x05, 0x24, 0x00));
}

#[test]
fn parameter_list_errors_reach_the_initiator() {
    let (m, a, _sa, _b, _sb) = setup();
    let p = list(1, 0, &[target(&naa(&a))], &[segment(0, 0, 1, 0, 1)]);
    let c = exec(&m, 0, 1, &xcopy_cdb(47), &p[..47]).0;
    assert_eq!(key(&c), (0x05, 0x1A, 0x00));
    // The CDB length counts, not the Data-Out the transport received.
    let c = exec(&m, 0, 1, &xcopy_cdb(p.len()), &p[..60]).0;
    assert_eq!(key(&c), (0x05, 0x1A, 0x00));
    // Empty parameter list: nothing to do.
    assert_eq!(xcopy(&m, 0, &[]).status, Status::Good);
    // Block length that does not match the LU.
    let mut t = target(&naa(&a));
    t[30] = 0x10;
    let c = xcopy(&m, 0, &list(1, 0, &[t], &[segment(0, 0, 1, 0, 1)]));
    assert_eq!(key(&c), (0x05, 0x26, 0x00));
    // Reserved CDB bytes and the LID4 service action.
    let mut cdb = xcopy_cdb(p.len());
    cdb[2] = 1;
    assert_eq!(key(&exec(&m, 0, 1, &cdb, &p).0), (0x05, 0x24, 0x00));
    let mut cdb = xcopy_cdb(p.len());
    cdb[1] = 1;
    assert_eq!(key(&exec(&m, 0, 1, &cdb, &p).0), (0x05, 0x24, 0x00));
}

#[test]
fn read_only_destination_is_protected() {
    let (a, sa) = lu(1, LuSettings::default());
    let (b, sb) = lu(2, LuSettings::default());
    let m = LunMap::new(vec![(0, a.clone(), false), (1, b.clone(), true)]).unwrap();
    for lun in [0, 1] {
        exec(&m, lun, 1, &[0, 0, 0, 0, 0, 0], &[]);
    }
    fill(&sa, 0, 1, b'R');
    let p = list(
        1,
        0,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 1, 0, 0)],
    );
    assert_eq!(key(&xcopy(&m, 0, &p)), (0x07, 0x27, 0x00));
    assert_eq!(read(&sb, 0, 1), vec![0; 512]);
    // The read-only LU may be the source, and may receive the command.
    let p = list(
        1,
        0,
        &[target(&naa(&b)), target(&naa(&a))],
        &[segment(0, 1, 1, 5, 6)],
    );
    assert_eq!(xcopy(&m, 1, &p).status, Status::Good);
    // ... but not be the destination when it receives it either.
    let p = list(1, 0, &[target(&naa(&b))], &[segment(0, 0, 1, 5, 6)]);
    assert_eq!(key(&xcopy(&m, 1, &p)), (0x07, 0x27, 0x00));
}

#[test]
fn reservation_on_the_other_lu_conflicts() {
    let (m, a, _sa, b, sb) = setup();
    // Nexus 2 registers key 1 on LU b and takes a Write Exclusive reservation.
    let mut reg = vec![0u8; 24];
    reg[8..16].copy_from_slice(&1u64.to_be_bytes());
    let c = exec(&m, 1, 2, &[0x5F, 0x00, 0, 0, 0, 0, 0, 0, 24, 0], &reg).0;
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
    let mut res = vec![0u8; 24];
    res[0..8].copy_from_slice(&1u64.to_be_bytes());
    let c = exec(&m, 1, 2, &[0x5F, 0x01, 0x01, 0, 0, 0, 0, 0, 24, 0], &res).0;
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
    let p = list(
        1,
        0,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 1, 0, 0)],
    );
    assert_eq!(xcopy(&m, 0, &p).status, Status::ReservationConflict);
    // Reading from it is allowed under Write Exclusive.
    fill(&sb, 0, 1, b'W');
    let p = list(
        1,
        0,
        &[target(&naa(&b)), target(&naa(&a))],
        &[segment(0, 1, 1, 0, 9)],
    );
    assert_eq!(xcopy(&m, 0, &p).status, Status::Good);
}

#[test]
fn copy_status_is_held_per_nexus_and_list_id() {
    let (m, a, _sa, _b, _sb) = setup();
    let (c, _) = exec(&m, 0, 1, &rcr_cdb(0, 1), &[]);
    assert_eq!(key(&c), (0x05, 0x24, 0x00));
    let p = list(
        1,
        0,
        &[target(&naa(&a))],
        &[segment(0, 0, 4, 0, 8), segment(0, 0, 4, 0, 16)],
    );
    assert_eq!(xcopy(&m, 0, &p).status, Status::Good);
    // Another nexus does not see it.
    assert_eq!(
        key(&exec(&m, 0, 2, &rcr_cdb(0, 1), &[]).0),
        (0x05, 0x24, 0x00)
    );
    let (c, d) = exec(&m, 0, 1, &rcr_cdb(0, 1), &[]);
    assert_eq!(c.status, Status::Good);
    assert_eq!(d, vec![0, 0, 0, 8, 0x00, 0, 2, 0x00, 0, 0, 0x10, 0]);
    // Reported once.
    assert_eq!(
        key(&exec(&m, 0, 1, &rcr_cdb(0, 1), &[]).0),
        (0x05, 0x24, 0x00)
    );
    // LIST ID USAGE 10b and 11b hold nothing; a lost nexus drops what it held.
    let p3 = list(3, 3, &[target(&naa(&a))], &[segment(0, 0, 1, 0, 8)]);
    assert_eq!(xcopy(&m, 0, &p3).status, Status::Good);
    assert_eq!(
        key(&exec(&m, 0, 1, &rcr_cdb(0, 3), &[]).0),
        (0x05, 0x24, 0x00)
    );
    assert_eq!(xcopy(&m, 0, &p).status, Status::Good);
    a.nexus_lost(1);
    a.nexus_added(1);
    exec(&m, 0, 1, &[0, 0, 0, 0, 0, 0], &[]);
    assert_eq!(
        key(&exec(&m, 0, 1, &rcr_cdb(0, 1), &[]).0),
        (0x05, 0x24, 0x00)
    );
}

#[test]
fn operating_parameters_and_unsupported_service_actions() {
    let (m, _a, _sa, _b, _sb) = setup();
    let (c, d) = exec(&m, 0, 1, &rcr_cdb(3, 0), &[]);
    assert_eq!(c.status, Status::Good);
    assert_eq!(d.len(), 46);
    assert_eq!(&d[8..12], &[0, 8, 0, 32]);
    assert_eq!(&d[16..20], &(32u32 << 20).to_be_bytes());
    // RECEIVE DATA and FAILED SEGMENT DETAILS are not offered.
    for sa in [1, 4] {
        assert_eq!(
            key(&exec(&m, 0, 1, &rcr_cdb(sa, 0), &[]).0),
            (0x05, 0x24, 0x00)
        );
    }
    let mut cdb = rcr_cdb(3, 0);
    cdb[5] = 1;
    assert_eq!(key(&exec(&m, 0, 1, &cdb, &[]).0), (0x05, 0x24, 0x00));
}

#[test]
fn an_offline_lu_is_neither_source_nor_destination() {
    let (m, a, sa, b, sb) = setup();
    fill(&sa, 0, 8, b'S');
    fill(&sb, 0, 8, b'D');
    assert!(b.set_offline(true));
    // Addressed to LUN 0 (online), writing the offline LUN 1.
    let to_b = list(
        1,
        0,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 8, 0, 0)],
    );
    let c = xcopy(&m, 0, &to_b);
    assert_eq!(c.status, Status::CheckCondition);
    assert_eq!(
        key(&c),
        (0x02, 0x04, 0x03),
        "NOT READY, MANUAL INTERVENTION REQUIRED"
    );
    assert_eq!(
        read(&sb, 0, 8),
        vec![b'D'; 8 * 512],
        "the offline LU was written"
    );
    // Reading it is refused too.
    let from_b = list(
        1,
        0,
        &[target(&naa(&b)), target(&naa(&a))],
        &[segment(0, 1, 8, 0, 100)],
    );
    assert_eq!(key(&xcopy(&m, 0, &from_b)), (0x02, 0x04, 0x03));
    assert_eq!(read(&sa, 100, 8), vec![0; 8 * 512]);
    // Back online, the same copy runs (after the unit attention of coming back).
    assert!(b.set_offline(false));
    exec(&m, 1, 1, &[0, 0, 0, 0, 0, 0], &[]);
    assert_eq!(xcopy(&m, 0, &to_b).status, Status::Good);
    assert_eq!(read(&sb, 0, 8), vec![b'S'; 8 * 512]);
}

#[test]
fn a_copy_counts_in_flight_on_every_lu_it_touches() {
    let (m, a, sa, b, sb) = setup();
    fill(&sa, 0, 8, b'S');
    // A reset of the destination is under way: the copy addressed to LUN 0 does not write it
    // behind the reset's back (it is refused, to be retried), and leaves no hold behind.
    b.in_flight().start_reset();
    let p = list(
        1,
        0,
        &[target(&naa(&a)), target(&naa(&b))],
        &[segment(0, 1, 8, 0, 0)],
    );
    let c = xcopy(&m, 0, &p);
    assert_eq!(key(&c), (0x02, 0x04, 0x07), "{c:?}");
    assert_eq!(read(&sb, 0, 8), vec![0; 8 * 512]);
    assert_eq!(b.in_flight().count(), 0);
    b.in_flight().end_reset();
    assert_eq!(xcopy(&m, 0, &p).status, Status::Good);
    assert_eq!(read(&sb, 0, 8), vec![b'S'; 8 * 512]);
    assert_eq!((a.in_flight().count(), b.in_flight().count()), (0, 0));
}

/// Two LUs on files: EXTENDED COPY between them goes through the kernel
/// (`store::clone::copy_range`), and reads back exactly what a copy through memory would.
#[test]
fn copies_between_file_stores_inside_the_kernel() {
    let dir = std::env::temp_dir().join(format!("ferrosan-xcopy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let open = |name: &str, last: u8| {
        let store =
            Arc::new(store::FileStore::open(dir.join(name), Some(BLOCKS * 512), true).unwrap());
        let mut id = identity();
        id.naa[7] = last;
        let lu = Arc::new(LogicalUnit::new(store.clone(), id, LuSettings::default()).unwrap());
        (lu, store)
    };
    let (a, sa) = open("a.img", 1);
    let (b, sb) = open("b.img", 2);
    let m = LunMap::new(vec![(0, a.clone(), false), (1, b.clone(), false)]).unwrap();
    for lun in [0, 1] {
        exec(&m, lun, 1, &[0, 0, 0, 0, 0, 0], &[]);
    }
    let data: Vec<u8> = (0..64 * 512).map(|i| (i % 251) as u8).collect();
    sa.write_at(&data, 8 * 512, false).unwrap();
    // 4 KiB-aligned (a reflink where the filesystem shares extents) and unaligned segments,
    // and one within the destination itself.
    let p = list(
        1,
        3,
        &[target(&naa(&a)), target(&naa(&b))],
        &[
            segment(0, 1, 64, 8, 16),
            segment(0, 1, 3, 9, 1001),
            segment(1, 1, 8, 16, 2000),
        ],
    );
    let c = xcopy(&m, 1, &p);
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
    let read_b = |block: u64, blocks: u64| {
        let mut got = vec![0u8; (blocks * 512) as usize];
        sb.read_at(&mut got, block * 512).unwrap();
        got
    };
    assert!(read_b(16, 64) == data, "the aligned segment");
    assert!(
        read_b(1001, 3) == data[512..4 * 512],
        "the unaligned segment"
    );
    assert!(
        read_b(2000, 8) == data[..8 * 512],
        "the copy within the destination"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
