mod common;
use common::*;
use scsi::{LuSettings, Status};
use std::sync::atomic::Ordering;

#[test]
fn read_write_round_trip_all_sizes() {
    let mut t = T::new();
    let data = pattern(4 * 512, 1);
    t.ok(&write10(10, 4), &data);
    assert_eq!(t.ok(&read10(10, 4), &[]), data);
    // READ/WRITE 6: 21-bit LBA.
    let d6 = pattern(512, 2);
    t.ok(&[0x0A, 0x00, 0x00, 20, 1, 0], &d6);
    assert_eq!(t.ok(&[0x08, 0x00, 0x00, 20, 1, 0], &[]), d6);
    // 12 and 16.
    let d12 = pattern(1024, 3);
    t.ok(&cdb12(0xAA, 30, 2), &d12);
    assert_eq!(t.ok(&cdb12(0xA8, 30, 2), &[]), d12);
    let d16 = pattern(1536, 4);
    t.ok(&cdb16(0x8A, 40, 3), &d16);
    assert_eq!(t.ok(&cdb16(0x88, 40, 3), &[]), d16);
    // Unwritten blocks read as zero.
    assert!(t.ok(&read10(1000, 1), &[]).iter().all(|&b| b == 0));
}

#[test]
fn read6_zero_length_means_256_blocks() {
    let mut t = T::new();
    let c = t.run(&[0x08, 0, 0, 0, 0, 0], &[]);
    assert_eq!(c.status, Status::Good);
    assert_eq!(c.transfer_len, 256 * 512);
    assert_eq!(t.data_in.len(), 256 * 512);
}

#[test]
fn zero_length_transfers() {
    let mut t = T::new();
    let c = t.run(&read10(0, 0), &[]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 0));
    assert!(t.data_in.is_empty());
    assert_eq!(t.run(&write10(0, 0), &[]).status, Status::Good);
    assert_eq!(t.run(&cdb16(0x88, 5, 0), &[]).status, Status::Good);
}

#[test]
fn lba_boundaries() {
    let mut t = T::new();
    let last = t.blocks() - 1;
    t.ok(&read10(last as u32, 1), &[]);
    t.ok(&write10(last as u32, 1), &[0u8; 512]);
    lba_oob(&t.err(&read10(last as u32, 2), &[]));
    lba_oob(&t.err(&read10(t.blocks() as u32, 1), &[]));
    lba_oob(&t.err(&read10(t.blocks() as u32, 0), &[]));
    lba_oob(&t.err(&read10(t.blocks() as u32 + 1, 0), &[]));
    lba_oob(&t.err(&read10(u32::MAX, 1), &[]));
    lba_oob(&t.err(&write10(0x8000_0000, 1), &[0u8; 512]));
    // lba + len overflows u64.
    lba_oob(&t.err(&cdb16(0x88, u64::MAX, 2), &[]));
    lba_oob(&t.err(&cdb16(0x8A, u64::MAX - 1, 4), &[0u8; 2048]));
    lba_oob(&t.err(&cdb12(0xA8, last as u32, 2), &[]));
    lba_oob(&t.err(&[0x08, 0x1F, 0xFF, 0xFF, 1, 0], &[]));
}

#[test]
fn protection_fields_are_rejected() {
    let mut t = T::new();
    for flags in [0x20u8, 0x40, 0x80, 0xE0] {
        let mut c = read10(0, 1);
        c[1] = flags;
        invalid_cdb(&t.err(&c, &[]));
        let mut c = write10(0, 1);
        c[1] = flags;
        invalid_cdb(&t.err(&c, &[0u8; 512]));
        let mut c = cdb16(0x88, 0, 1);
        c[1] = flags;
        invalid_cdb(&t.err(&c, &[]));
    }
    let mut c = read10(0, 1);
    c[1] = 0x20;
    assert_eq!(t.err(&c, &[]).sense_key_specific, Some([0xCD, 0, 1]));
    // DPO, FUA, FUA_NV are fine.
    for flags in [0x10u8, 0x08, 0x02, 0x1A] {
        let mut c = read10(0, 1);
        c[1] = flags;
        t.ok(&c, &[]);
    }
}

#[test]
fn transfer_length_above_block_limits_is_invalid() {
    let mut t = T::with(LuSettings::default(), 64 * MIB);
    let max = (8 << 20) / 512;
    t.ok(&cdb16(0x88, 0, max), &[]);
    let s = t.err(&cdb16(0x88, 0, max + 1), &[]);
    invalid_cdb(&s);
    assert_eq!(s.sense_key_specific, Some([0xC0, 0, 10]));
}

#[test]
fn short_data_out_writes_only_whole_received_blocks() {
    let mut t = T::new();
    t.ok(&write10(0, 2), &[b'a'; 1024]);
    // Two blocks asked, one received.
    let c = t.run(&write10(0, 2), &[b'b'; 512]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 1024));
    let back = t.ok(&read10(0, 2), &[]);
    assert!(back[..512].iter().all(|&b| b == b'b'));
    assert!(back[512..].iter().all(|&b| b == b'a'));
    // A partial block is not written.
    let c = t.run(&write10(0, 1), &[b'c'; 200]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 512));
    assert_eq!(t.ok(&read10(0, 1), &[])[0], b'b');
    // More received than asked: only what the CDB says.
    t.ok(&write10(0, 1), &[b'd'; 1024]);
    let back = t.ok(&read10(0, 2), &[]);
    assert_eq!((back[0], back[600]), (b'd', b'a'));
}

#[test]
fn read_respects_transport_limit() {
    let mut t = T::new();
    t.limit = 512;
    let c = t.run(&read10(0, 4), &[]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 2048));
    assert_eq!(t.data_in.len(), 512);
}

#[test]
fn reused_data_in_never_leaks_previous_bytes() {
    let mut t = T::new();
    t.ok(&write10(0, 8), &[0xAA; 4096]);
    assert_eq!(t.ok(&read10(0, 8), &[]), vec![0xAA; 4096]);
    // A shorter read of unwritten blocks: exactly its own bytes.
    assert_eq!(t.ok(&read10(100, 1), &[]), vec![0; 512]);
    t.ok(&read10(0, 8), &[]);
    // A failing read leaves nothing behind.
    lba_oob(&t.err(&read10(u32::MAX, 1), &[]));
    t.ok(&read10(0, 8), &[]);
    t.lu.nexus_added(1);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x06, 0x29, 0x00);
    // A longer read than before.
    assert_eq!(t.ok(&read10(0, 16), &[])[4096..], vec![0; 4096][..]);
}

#[test]
fn durability_follows_wce_and_fua() {
    let mut t = T::new(); // WCE=1
    t.ok(&write10(0, 1), &[1u8; 512]);
    assert_eq!(t.store.plain_writes.load(Ordering::SeqCst), 1);
    let mut fua = write10(0, 1);
    fua[1] = 0x08;
    t.ok(&fua, &[1u8; 512]);
    let mut fua16 = cdb16(0x8A, 0, 1);
    fua16[1] = 0x08;
    t.ok(&fua16, &[1u8; 512]);
    assert_eq!(t.store.durable_writes.load(Ordering::SeqCst), 2);
    t.ok(&cdb10(0x35, 0, 0), &[]);
    t.ok(&cdb16(0x91, 0, 0), &[]);
    assert_eq!(t.store.flushes.load(Ordering::SeqCst), 2);

    let mut t = T::with(
        LuSettings {
            write_cache: false,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    t.ok(&write10(0, 1), &[1u8; 512]);
    t.ok(&[0x0A, 0, 0, 1, 1, 0], &[1u8; 512]);
    assert_eq!(t.store.durable_writes.load(Ordering::SeqCst), 2);
    assert_eq!(t.store.plain_writes.load(Ordering::SeqCst), 0);
}

#[test]
fn synchronize_cache_and_prefetch_ranges() {
    let mut t = T::new();
    let n = t.blocks();
    t.ok(&cdb10(0x35, (n - 1) as u32, 1), &[]);
    lba_oob(&t.err(&cdb10(0x35, n as u32, 1), &[]));
    lba_oob(&t.err(&cdb16(0x91, u64::MAX, 1), &[]));
    let mut immed = cdb10(0x35, 0, 0);
    immed[1] = 0x02;
    t.ok(&immed, &[]);
    let mut bad = cdb10(0x35, 0, 0);
    bad[1] = 0x01;
    invalid_cdb(&t.err(&bad, &[]));
    let c = t.run(&cdb10(0x34, 0, 16), &[]);
    assert_eq!(c.status, Status::Good);
    t.ok(&cdb16(0x90, n - 1, 1), &[]);
    lba_oob(&t.err(&cdb10(0x34, n as u32, 1), &[]));
    lba_oob(&t.err(&cdb16(0x90, n - 1, 2), &[]));
}

fn verify10(lba: u32, n: u16, bytchk: u8) -> [u8; 10] {
    let mut c = cdb10(0x2F, lba, n);
    c[1] = bytchk << 1;
    c
}

#[test]
fn verify_compares_and_reports_miscompare_offset() {
    let mut t = T::new();
    let data = pattern(2048, 9);
    t.ok(&write10(100, 4), &data);
    // BYTCHK=0: medium verification only, no data.
    let c = t.run(&verify10(100, 4, 0), &[]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 0));
    t.ok(&verify10(100, 4, 0), &[0xFF; 2048]);
    // BYTCHK=1: exact compare.
    let c = t.run(&verify10(100, 4, 1), &data);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 2048));
    let mut bad = data.clone();
    bad[1500] ^= 1;
    let s = t.err(&verify10(100, 4, 1), &bad);
    assert_sense(&s, 0x0E, 0x1D, 0x00);
    assert_eq!(s.info, Some(1500));
    // 12 and 16 byte forms.
    let mut c12 = cdb12(0xAF, 100, 4);
    c12[1] = 0x02;
    t.ok(&c12, &data);
    let mut c16 = cdb16(0x8F, 100, 4);
    c16[1] = 0x02;
    assert_sense(&t.err(&c16, &bad), 0x0E, 0x1D, 0x00);
    // BYTCHK=3: one block compared against each block.
    t.ok(&write10(200, 3), &[7u8; 1536]);
    t.ok(&verify10(200, 3, 3), &[7u8; 512]);
    let s = t.err(&verify10(199, 3, 3), &[7u8; 512]);
    assert_eq!(s.info, Some(0));
    // BYTCHK=2 is reserved; VRPROTECT unsupported.
    invalid_cdb(&t.err(&verify10(100, 1, 2), &[0; 512]));
    let mut vr = verify10(100, 1, 0);
    vr[1] |= 0x20;
    invalid_cdb(&t.err(&vr, &[]));
    lba_oob(&t.err(&verify10(t.blocks() as u32, 1, 0), &[]));
    lba_oob(&t.err(&cdb16(0x8F, u64::MAX, 1), &[]));
    // Too little data to compare.
    assert_sense(
        &t.err(&verify10(100, 4, 1), &data[..1024]),
        0x05,
        0x1A,
        0x00,
    );
}

#[test]
fn write_and_verify_writes_durably() {
    let mut t = T::new();
    let data = pattern(1024, 5);
    let mut c = cdb10(0x2E, 8, 2);
    c[1] = 0x02; // BYTCHK
    t.ok(&c, &data);
    assert_eq!(t.ok(&read10(8, 2), &[]), data);
    assert_eq!(t.store.durable_writes.load(Ordering::SeqCst), 1);
    t.ok(&cdb12(0xAE, 10, 1), &data[..512]);
    t.ok(&cdb16(0x8E, 11, 1), &data[..512]);
    lba_oob(&t.err(&cdb16(0x8E, t.blocks(), 1), &data[..512]));
    let mut wp = cdb10(0x2E, 8, 1);
    wp[1] = 0x20;
    invalid_cdb(&t.err(&wp, &data[..512]));
}

fn unmap_params(descs: &[(u64, u32)]) -> Vec<u8> {
    let mut p = vec![0u8; 8];
    for &(lba, n) in descs {
        p.extend_from_slice(&lba.to_be_bytes());
        p.extend_from_slice(&n.to_be_bytes());
        p.extend_from_slice(&[0; 4]);
    }
    let bd = (p.len() - 8) as u16;
    p[0..2].copy_from_slice(&(bd + 6).to_be_bytes());
    p[2..4].copy_from_slice(&bd.to_be_bytes());
    p
}
fn unmap_cdb(len: usize) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x42;
    c[7..9].copy_from_slice(&(len as u16).to_be_bytes());
    c
}
fn lba_status(t: &mut T, lba: u64) -> (u64, u32, u8) {
    let mut c = cdb16(0x9E, lba, 24);
    c[1] = 0x12;
    let d = t.ok(&c, &[]);
    assert_eq!(d.len(), 24);
    assert_eq!(u32::from_be_bytes(d[0..4].try_into().unwrap()), 20);
    (
        u64::from_be_bytes(d[8..16].try_into().unwrap()),
        u32::from_be_bytes(d[16..20].try_into().unwrap()),
        d[20],
    )
}

#[test]
fn unmap_deallocates_and_reads_zero() {
    let mut t = T::new();
    let n = t.blocks();
    t.ok(&write10(0, 4096), &vec![0xAB; 4096 * 512]);
    assert_eq!(lba_status(&mut t, 0), (0, 4096, 0));
    assert_eq!(lba_status(&mut t, 4096), (4096, (n - 4096) as u32, 1));
    let p = unmap_params(&[(0, 2048), (3000, 8)]);
    t.ok(&unmap_cdb(p.len()), &p);
    assert!(t.ok(&read10(0, 8), &[]).iter().all(|&b| b == 0));
    assert!(t.ok(&read10(3000, 8), &[]).iter().all(|&b| b == 0));
    assert!(t.ok(&read10(3008, 1), &[]).iter().all(|&b| b == 0xAB));
    assert_eq!(lba_status(&mut t, 0), (0, 2048, 1));
    assert_eq!(lba_status(&mut t, 2048).2, 0);
    // Zero descriptors and zero parameter length are no-ops.
    let p = unmap_params(&[]);
    t.ok(&unmap_cdb(p.len()), &p);
    t.ok(&unmap_cdb(0), &[]);
    let p = unmap_params(&[(5, 0)]);
    t.ok(&unmap_cdb(p.len()), &p);
}

#[test]
fn unmap_parameter_validation() {
    let mut t = T::new();
    let n = t.blocks();
    assert_sense(&t.err(&unmap_cdb(4), &[0; 4]), 0x05, 0x1A, 0x00);
    let p = unmap_params(&[(n - 1, 2)]);
    lba_oob(&t.err(&unmap_cdb(p.len()), &p));
    let p = unmap_params(&[(u64::MAX, 2)]);
    lba_oob(&t.err(&unmap_cdb(p.len()), &p));
    let many: Vec<(u64, u32)> = (0..257).map(|i| (i, 1)).collect();
    let p = unmap_params(&many);
    assert_sense(&t.err(&unmap_cdb(p.len()), &p), 0x05, 0x26, 0x00);
    let mut anchor = unmap_cdb(0);
    anchor[1] = 0x01;
    invalid_cdb(&t.err(&anchor, &[]));
    // Nothing was unmapped by a rejected list: validation precedes action.
    t.ok(&write10(0, 1), &[1; 512]);
    let p = unmap_params(&[(0, 1), (n, 1)]);
    lba_oob(&t.err(&unmap_cdb(p.len()), &p));
    assert_eq!(t.ok(&read10(0, 1), &[])[0], 1);
}

#[test]
fn thick_lu_has_no_unmap() {
    let mut t = T::with(
        LuSettings {
            thin: false,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    let p = unmap_params(&[(0, 1)]);
    assert_sense(&t.err(&unmap_cdb(p.len()), &p), 0x05, 0x20, 0x00);
    // WRITE SAME with UNMAP is refused; without it, zeros are written.
    let mut ws = cdb10(0x41, 0, 8);
    ws[1] = 0x08;
    let s = t.err(&ws, &[0; 512]);
    assert_eq!(s.sense_key_specific, Some([0xCB, 0, 1]));
    t.ok(&cdb10(0x41, 0, 8), &[0; 512]);
    let d = t.ok(&cdb16(0x9E, 0, 32).map_service_action(0x10), &[]);
    assert_eq!(d[14] & 0xC0, 0);
}

trait WithSa {
    fn map_service_action(self, sa: u8) -> Self;
}
impl WithSa for [u8; 16] {
    fn map_service_action(mut self, sa: u8) -> Self {
        self[1] = sa;
        self
    }
}

#[test]
fn write_same_pattern_zero_unmap_and_ndob() {
    let mut t = T::new();
    let block = pattern(512, 77);
    let mut ws = cdb10(0x41, 10, 20);
    t.ok(&ws, &block);
    let back = t.ok(&read10(10, 20), &[]);
    for chunk in back.chunks(512) {
        assert_eq!(chunk, &block[..]);
    }
    // Zeros with UNMAP deallocate.
    t.ok(&write10(0, 4096), &vec![1; 4096 * 512]);
    ws = cdb10(0x41, 0, 2048);
    ws[1] = 0x08;
    t.ok(&ws, &[0u8; 512]);
    assert_eq!(t.store.log.lock().unwrap().last(), Some(&"zeroes+dealloc"));
    assert_eq!(lba_status(&mut t, 0), (0, 2048, 1));
    assert!(t.ok(&read10(0, 4), &[]).iter().all(|&b| b == 0));
    // UNMAP deallocates even when the data block is not zeros.
    t.ok(&write10(0, 4), &[5u8; 2048]);
    t.ok(&ws, &[9u8; 512]);
    assert!(t.ok(&read10(0, 4), &[]).iter().all(|&b| b == 0));
    assert_eq!(lba_status(&mut t, 0), (0, 2048, 1));
    // Without UNMAP, zeros are written through write_zeroes without deallocation.
    let zero_no_unmap = cdb10(0x41, 4000, 8);
    t.ok(&zero_no_unmap, &[0u8; 512]);
    assert_eq!(t.store.log.lock().unwrap().last(), Some(&"zeroes"));
    // NDOB (16 only): zeros without a Data-Out buffer.
    let mut ndob = cdb16(0x93, 0, 8);
    ndob[1] = 0x09;
    let c = t.run(&ndob, &[]);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 0));
    assert!(t.ok(&read10(0, 8), &[]).iter().all(|&b| b == 0));
    let c = t.run(&cdb16(0x93, 100, 4), &block);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 512));
}

#[test]
fn write_same_invalid_fields() {
    let mut t = T::new();
    let n = t.blocks();
    let block = [0u8; 512];
    // WSNZ: zero blocks is invalid.
    invalid_cdb(&t.err(&cdb10(0x41, 0, 0), &block));
    invalid_cdb(&t.err(&cdb16(0x93, 0, 0), &block));
    // Above MAXIMUM WRITE SAME LENGTH.
    invalid_cdb(&t.err(&cdb16(0x93, 0, 0x1_0000), &block));
    lba_oob(&t.err(&cdb16(0x93, 0, 0xFFFF), &block)); // within the limit, beyond this LU
    let mut anchor = cdb10(0x41, 0, 1);
    anchor[1] = 0x18;
    let s = t.err(&anchor, &block);
    assert_eq!(s.sense_key_specific, Some([0xCC, 0, 1]));
    let mut ndob10 = cdb10(0x41, 0, 1);
    ndob10[1] = 0x01;
    invalid_cdb(&t.err(&ndob10, &block));
    let mut wp = cdb16(0x93, 0, 1);
    wp[1] = 0x20;
    invalid_cdb(&t.err(&wp, &block));
    lba_oob(&t.err(&cdb10(0x41, n as u32, 1), &block));
    lba_oob(&t.err(&cdb10(0x41, (n - 1) as u32, 2), &block));
    lba_oob(&t.err(&cdb16(0x93, u64::MAX, 1), &block));
    lba_oob(&t.err(&cdb10(0x41, 0x8000_0000, 1), &block));
    // Data-Out must be exactly one block.
    invalid_cdb(&t.err(&cdb10(0x41, 0, 1), &block[..100]));
    invalid_cdb(&t.err(&cdb10(0x41, 0, 1), &[0u8; 1024]));
    invalid_cdb(&t.err(&cdb16(0x93, 0, 1), &[]));
}

#[test]
fn get_lba_status_limits() {
    let mut t = T::new();
    let n = t.blocks();
    assert_eq!(lba_status(&mut t, n - 1), (n - 1, 1, 1));
    let mut c = cdb16(0x9E, n, 24);
    c[1] = 0x12;
    lba_oob(&t.err(&c, &[]));
    // Several descriptors when the allocation length allows.
    t.ok(&write10(2048, 1), &[1; 512]);
    let mut c = cdb16(0x9E, 0, 8 + 16 * 8);
    c[1] = 0x12;
    let d = t.ok(&c, &[]);
    assert_eq!(d.len(), 8 + 16 * 3);
    assert_eq!(d[20], 1);
    assert_eq!(u64::from_be_bytes(d[24..32].try_into().unwrap()), 2048);
    assert_eq!(d[36], 0);
    // Allocation length smaller than the header truncates.
    let mut c = cdb16(0x9E, 0, 4);
    c[1] = 0x12;
    assert_eq!(t.ok(&c, &[]).len(), 4);
}

fn caw(lba: u64, n: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x89;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = n;
    c
}

#[test]
fn compare_and_write() {
    let mut t = T::new();
    let old = pattern(1024, 1);
    let new = pattern(1024, 2);
    t.ok(&write10(50, 2), &old);
    let mut both = old.clone();
    both.extend_from_slice(&new);
    let c = t.run(&caw(50, 2), &both);
    assert_eq!((c.status, c.transfer_len), (Status::Good, 2048));
    assert_eq!(t.ok(&read10(50, 2), &[]), new);
    // Now the compare data is stale: MISCOMPARE at the first differing byte, nothing written.
    let s = t.err(&caw(50, 2), &both);
    assert_sense(&s, 0x0E, 0x1D, 0x00);
    let first_diff = old.iter().zip(&new).position(|(a, b)| a != b).unwrap();
    assert_eq!(s.info, Some(first_diff as u64));
    assert_eq!(t.ok(&read10(50, 2), &[]), new);
    t.ok(&caw(50, 0), &[]);
    // 256 blocks do not fit the one-byte field: 0 blocks with data is a mismatch.
    invalid_cdb(&t.err(&caw(0, 0), &vec![0; 256 * 1024]));
    invalid_cdb(&t.err(&caw(0, 129), &vec![0; 129 * 1024]));
    lba_oob(&t.err(&caw(t.blocks(), 1), &[0; 1024]));
    lba_oob(&t.err(&caw(t.blocks() - 1, 2), &[0; 2048]));
    lba_oob(&t.err(&caw(u64::MAX, 1), &[0; 1024]));
    // Data-Out must be exactly verify + write data.
    invalid_cdb(&t.err(&caw(50, 2), &both[..1500]));
    invalid_cdb(&t.err(&caw(50, 1), &both));
    invalid_cdb(&t.err(&caw(50, 3), &both));
}

#[test]
fn compare_and_write_is_atomic_against_writers() {
    let t = T::new();
    let lu = t.lu.clone();
    let nexus = t.nexus.clone();
    // Two threads each increment a counter stored in block 0 via CAW 500 times.
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let lu = lu.clone();
            let nexus = nexus.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut done = 0;
                while done < 500 {
                    let cmd = scsi::Command {
                        cdb: &read10(0, 1),
                        data_out: &[],
                        data_in_limit: 512,
                    };
                    lu.execute(&nexus, &cmd, &mut buf);
                    let mut cur = buf.clone();
                    let v = u64::from_le_bytes(cur[..8].try_into().unwrap());
                    let mut next = cur.clone();
                    next[..8].copy_from_slice(&(v + 1).to_le_bytes());
                    cur.extend_from_slice(&next);
                    let cmd = scsi::Command {
                        cdb: &caw(0, 1),
                        data_out: &cur,
                        data_in_limit: 0,
                    };
                    if lu.execute(&nexus, &cmd, &mut buf).status == Status::Good {
                        done += 1;
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let mut t = t;
    let d = t.ok(&read10(0, 1), &[]);
    assert_eq!(u64::from_le_bytes(d[..8].try_into().unwrap()), 1000);
}

#[test]
fn read_capacity() {
    let mut t = T::new();
    let n = t.blocks();
    let d = t.ok(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    assert_eq!(
        d,
        [&((n - 1) as u32).to_be_bytes()[..], &512u32.to_be_bytes()].concat()
    );
    // PMI=0 requires LBA 0.
    invalid_cdb(&t.err(&[0x25, 0, 0, 0, 0, 1, 0, 0, 0, 0], &[]));
    t.ok(&[0x25, 0, 0, 0, 0, 1, 0, 0, 1, 0], &[]);
    let d = t.ok(&cdb16(0x9E, 0, 32).map_service_action(0x10), &[]);
    assert_eq!(d.len(), 32);
    assert_eq!(u64::from_be_bytes(d[..8].try_into().unwrap()), n - 1);
    assert_eq!(u32::from_be_bytes(d[8..12].try_into().unwrap()), 512);
    // One logical block per physical block reported (4 KiB physical blocks are implemented but
    // switched off: libiscsi GetLBAStatus.UnmapSingle is wrong for LBPPB > 1).
    assert_eq!(d[13], 0);
    assert_eq!(d[14], 0xC0); // LBPME | LBPRZ, lowest aligned LBA 0
    assert_eq!(d[15], 0);
    let c = t.run(&cdb16(0x9E, 0, 12).map_service_action(0x10), &[]);
    assert_eq!((c.transfer_len, t.data_in.len()), (12, 12));
    // Unknown SERVICE ACTION IN service action.
    invalid_cdb(&t.err(&cdb16(0x9E, 0, 32).map_service_action(0x11), &[]));
}

#[test]
fn block_size_4096() {
    let mut t = T::with(
        LuSettings {
            block_size: 4096,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    let d = t.ok(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    assert_eq!(d, [0, 0, 3, 0xFF, 0, 0, 0x10, 0]);
    let d = t.ok(&cdb16(0x9E, 0, 32).map_service_action(0x10), &[]);
    assert_eq!(d[13], 0); // one logical block per physical block
    let data = pattern(8192, 3);
    t.ok(&write10(1023, 1), &data[..4096]);
    lba_oob(&t.err(&write10(1023, 2), &data));
    assert_eq!(t.ok(&read10(1023, 1), &[]), &data[..4096]);
}

#[test]
fn read_defect_data() {
    let mut t = T::new();
    let d = t.ok(&[0x37, 0, 0x1D, 0, 0, 0, 0, 0, 4, 0], &[]);
    assert_eq!(d, [0, 0x1D, 0, 0]);
    let d = t.ok(&[0xB7, 0x0D, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0], &[]);
    assert_eq!(d, [0, 0x0D, 0, 0, 0, 0, 0, 0]);
    assert_eq!(t.ok(&[0x37, 0, 0x1D, 0, 0, 0, 0, 0, 2, 0], &[]).len(), 2);
    invalid_cdb(&t.err(&[0x37, 0, 0x20, 0, 0, 0, 0, 0, 4, 0], &[]));
}

#[test]
fn read_only_lu_refuses_medium_writes() {
    let mut t = T::with(
        LuSettings {
            read_only: true,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    let p = unmap_params(&[(0, 1)]);
    let cdbs: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (write10(0, 1).to_vec(), vec![0; 512]),
        (vec![0x0A, 0, 0, 0, 1, 0], vec![0; 512]),
        (cdb12(0xAA, 0, 1).to_vec(), vec![0; 512]),
        (cdb16(0x8A, 0, 1).to_vec(), vec![0; 512]),
        (cdb10(0x2E, 0, 1).to_vec(), vec![0; 512]),
        (cdb10(0x41, 0, 1).to_vec(), vec![0; 512]),
        (cdb16(0x93, 0, 1).to_vec(), vec![0; 512]),
        (unmap_cdb(p.len()).to_vec(), p),
        (caw(0, 1).to_vec(), vec![0; 1024]),
    ];
    for (cdb, data) in cdbs {
        assert_sense(&t.err(&cdb, &data), 0x07, 0x27, 0x00);
    }
    t.ok(&read10(0, 1), &[]);
    t.ok(&cdb10(0x35, 0, 0), &[]);
}

#[test]
fn orwrite_ors_into_the_medium() {
    let mut t = T::new();
    let n = t.blocks();
    t.ok(&write10(0, 2), &vec![0x0F; 1024]);
    t.ok(&cdb16(0x8B, 0, 2), &vec![0xA0; 1024]);
    assert_eq!(t.ok(&read10(0, 2), &[]), vec![0xAF; 1024]);
    // Only the blocks that arrived are ORed in.
    t.ok(&cdb16(0x8B, 0, 2), &vec![0x50; 512]);
    let d = t.ok(&read10(0, 2), &[]);
    assert_eq!(&d[..512], &[0xFF; 512][..]);
    assert_eq!(&d[512..], &[0xAF; 512][..]);
    // Zero blocks, end of medium, ORPROTECT, FUA.
    t.ok(&cdb16(0x8B, 0, 0), &[]);
    t.ok(&cdb16(0x8B, n - 1, 1), &[1; 512]);
    lba_oob(&t.err(&cdb16(0x8B, n - 1, 2), &[1; 1024]));
    let mut c = cdb16(0x8B, 0, 1);
    c[1] = 0x20;
    invalid_cdb(&t.err(&c, &[0; 512]));
    c[1] = 0x18;
    t.ok(&c, &[0; 512]);
}

#[test]
fn write_atomic_16() {
    let mut t = T::new();
    let n = t.blocks();
    let atomic = |lba: u64, blocks: u16| {
        let mut c = [0u8; 16];
        c[0] = 0x9C;
        c[2..10].copy_from_slice(&lba.to_be_bytes());
        c[12..14].copy_from_slice(&blocks.to_be_bytes());
        c
    };
    let data = pattern(4096, 9);
    t.ok(&atomic(3, 8), &data);
    assert_eq!(t.ok(&read10(3, 8), &[]), data);
    t.ok(&atomic(0, 0), &[]);
    t.ok(&atomic(n - 1, 1), &data[..512]);
    lba_oob(&t.err(&atomic(n - 1, 2), &data[..1024]));
    // Above the maximum atomic transfer length (the maximum transfer length).
    invalid_cdb(&t.err(&atomic(0, 16385), &[]));
    // A short Data-Out is not written at all.
    invalid_cdb(&t.err(&atomic(100, 2), &data[..512]));
    assert_eq!(t.ok(&read10(100, 1), &[]), vec![0; 512]);
    // WRPROTECT and ATOMIC BOUNDARY are refused; DPO and FUA accepted.
    let mut c = atomic(0, 1);
    c[1] = 0x20;
    invalid_cdb(&t.err(&c, &data[..512]));
    c[1] = 0x18;
    t.ok(&c, &data[..512]);
    c[11] = 1;
    invalid_cdb(&t.err(&c, &data[..512]));
    // Block Limits VPD: maximum atomic transfer length, no alignment or granularity rule.
    let d = t.ok(&[0x12, 1, 0xB0, 0, 255, 0], &[]);
    let be32 = |at: usize| u32::from_be_bytes(d[at..at + 4].try_into().unwrap());
    assert_eq!(be32(44), (8 << 20) / 512);
    assert!(be32(44) <= be32(8));
    assert_eq!((be32(48), be32(52), be32(56), be32(60)), (0, 0, 0, 0));
}

#[test]
fn read_only_lu_refuses_orwrite_and_write_atomic() {
    let mut t = T::with(
        LuSettings {
            read_only: true,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    assert_sense(&t.err(&cdb16(0x8B, 0, 1), &[0; 512]), 7, 0x27, 0);
    let mut c = [0u8; 16];
    c[0] = 0x9C;
    c[13] = 1;
    assert_sense(&t.err(&c, &[0; 512]), 7, 0x27, 0);
}

/// One LU with the write cache on (the default) and one with it off.
fn write_back_and_write_through() -> (T, T) {
    let write_through = T::with(
        LuSettings {
            write_cache: false,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    (T::new(), write_through)
}

#[test]
fn which_commands_wait_for_the_device() {
    let (write_back, write_through) = write_back_and_write_through();
    let write10 = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let write10_fua = [0x2A, 0x08, 0, 0, 0, 0, 0, 0, 1, 0];
    let write6 = [0x0A, 0, 0, 0, 1, 0];
    let atomic_fua = [0x9C, 0x08, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0];
    let read10 = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    // Write-back: only FUA writes and the always-durable commands wait.
    assert!(!write_back.lu.waits_for_device(&write10));
    assert!(!write_back.lu.waits_for_device(&write6));
    assert!(write_back.lu.waits_for_device(&write10_fua));
    assert!(write_back.lu.waits_for_device(&atomic_fua));
    for opcode in [0x35u8, 0x91, 0x2E, 0x41, 0x93, 0x42, 0x89, 0x8B, 0x83] {
        assert!(
            write_back
                .lu
                .waits_for_device(&[opcode, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            "{opcode:#x}"
        );
    }
    // Write-through: every write waits; reads and empty CDBs never do.
    assert!(write_through.lu.waits_for_device(&write10));
    assert!(write_through.lu.waits_for_device(&write6));
    assert!(!write_through.lu.waits_for_device(&read10));
    assert!(!write_through.lu.waits_for_device(&[]));
}

#[test]
fn buffered_writes_are_the_write_back_writes_without_fua() {
    let (write_back, write_through) = write_back_and_write_through();
    let write6 = [0x0A, 0, 0, 0, 1, 0];
    let write10 = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let write12 = [0xAA, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0];
    let mut write16 = [0u8; 16];
    write16[0] = 0x8A;
    for cdb in [&write6[..], &write10, &write12, &write16] {
        assert!(write_back.lu.is_buffered_write(cdb), "{:#x}", cdb[0]);
        assert!(!write_through.lu.is_buffered_write(cdb), "{:#x}", cdb[0]);
    }
    let write10_fua = [0x2A, 0x08, 0, 0, 0, 0, 0, 0, 1, 0];
    assert!(!write_back.lu.is_buffered_write(&write10_fua));
    // Reads, writes with side effects (WRITE SAME, COMPARE AND WRITE, WRITE AND VERIFY, ORWRITE,
    // WRITE ATOMIC) and empty CDBs are not plain buffered writes.
    for opcode in [0x28u8, 0x41, 0x93, 0x89, 0x2E, 0x8B, 0x9C] {
        let mut cdb = [0u8; 16];
        cdb[0] = opcode;
        assert!(!write_back.lu.is_buffered_write(&cdb), "{opcode:#x}");
    }
    assert!(!write_back.lu.is_buffered_write(&[]));
}
