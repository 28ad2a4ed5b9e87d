mod common;
use common::*;
use scsi::{lun_to_wire, Command, LuSettings, LunMap, Status};
use std::sync::Arc;

fn map() -> (LunMap, T, T) {
    let a = T::new();
    let b = T::with(LuSettings::default(), 2 * MIB);
    let m = LunMap::new(vec![(0, a.lu.clone(), false), (300, b.lu.clone(), true)]).unwrap();
    (m, a, b)
}

fn run(m: &LunMap, lun: u64, cdb: &[u8], data_out: &[u8], buf: &mut Vec<u8>) -> scsi::Completion {
    let cmd = Command {
        cdb,
        data_out,
        data_in_limit: 1 << 20,
    };
    m.execute(&nexus(1), lun, &cmd, buf)
}

fn report_luns(select: u8, alloc: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = 0xA0;
    c[2] = select;
    c[6..10].copy_from_slice(&alloc.to_be_bytes());
    c
}

#[test]
fn report_luns_from_any_lun() {
    let (m, _a, _b) = map();
    let mut buf = Vec::new();
    for lun in [0, 300, 7] {
        let c = run(&m, lun, &report_luns(0, 4096), &[], &mut buf);
        assert_eq!((c.status, c.transfer_len), (Status::Good, 24));
        assert_eq!(&buf[..8], &[0, 0, 0, 16, 0, 0, 0, 0]);
        assert_eq!(&buf[8..16], &lun_to_wire(0));
        assert_eq!(&buf[16..24], &[0x41, 0x2C, 0, 0, 0, 0, 0, 0]);
    }
    run(&m, 0, &report_luns(2, 4096), &[], &mut buf);
    assert_eq!(buf.len(), 24);
    let c = run(&m, 0, &report_luns(1, 4096), &[], &mut buf);
    assert_eq!((c.status, buf.as_slice()), (Status::Good, &[0u8; 8][..]));
    let c = run(&m, 0, &report_luns(0x03, 4096), &[], &mut buf);
    invalid_cdb(&c.sense.unwrap());
    let c = run(&m, 0, &report_luns(0, 16), &[], &mut buf);
    assert_eq!((c.transfer_len, buf.len()), (16, 16));
    assert_eq!(&buf[..4], &[0, 0, 0, 16]);
    let c = run(&m, 0, &[0xA0, 0, 0, 0, 0, 0], &[], &mut buf);
    invalid_cdb(&c.sense.unwrap());
    assert_eq!(m.lun_ids().collect::<Vec<_>>(), vec![0, 300]);
}

#[test]
fn unmapped_lun() {
    let (m, _a, _b) = map();
    let mut buf = Vec::new();
    let c = run(&m, 5, &[0x12, 0, 0, 0, 96, 0], &[], &mut buf);
    assert_eq!(c.status, Status::Good);
    assert_eq!(buf[0], 0x7F);
    assert_eq!(buf.len(), 36);
    let c = run(&m, 5, &[0x03, 0, 0, 0, 252, 0], &[], &mut buf);
    assert_eq!(c.status, Status::Good);
    assert_eq!((buf[2], buf[12], buf[13]), (0x05, 0x25, 0x00));
    for cdb in [
        &[0u8, 0, 0, 0, 0, 0][..],
        &read10(0, 1)[..],
        &[0x12, 1, 0x80, 0, 96, 0][..],
    ] {
        let c = run(&m, 5, cdb, &[], &mut buf);
        assert_eq!(c.status, Status::CheckCondition);
        assert_sense(&c.sense.unwrap(), 0x05, 0x25, 0x00);
        assert!(buf.is_empty());
    }
}

#[test]
fn read_only_mapping() {
    let (m, a, _b) = map();
    let mut buf = Vec::new();
    let c = run(&m, 300, &write10(0, 1), &[0; 512], &mut buf);
    assert_sense(&c.sense.unwrap(), 0x07, 0x27, 0x00);
    assert_eq!(
        run(&m, 300, &read10(0, 1), &[], &mut buf).status,
        Status::Good
    );
    let c = run(&m, 300, &[0x1A, 0x08, 0x3F, 0, 255, 0], &[], &mut buf);
    assert_eq!(c.status, Status::Good);
    assert_eq!(buf[2] & 0x80, 0x80); // WP
    assert_eq!(
        run(&m, 0, &write10(0, 1), &[0; 512], &mut buf).status,
        Status::Good
    );
    run(&m, 0, &[0x1A, 0x08, 0x3F, 0, 255, 0], &[], &mut buf);
    assert_eq!(buf[2] & 0x80, 0);
    // The same LU mapped writable elsewhere stays writable.
    let m2 = LunMap::new(vec![(1, a.lu.clone(), true)]).unwrap();
    let c = run(&m2, 1, &write10(0, 1), &[0; 512], &mut buf);
    assert_eq!(c.status, Status::CheckCondition);
}

#[test]
fn map_validation() {
    let a = T::new();
    assert!(LunMap::new(vec![(1, a.lu.clone(), false), (1, a.lu.clone(), true)]).is_err());
    assert!(LunMap::new(vec![(16384, a.lu.clone(), false)]).is_err());
    let m = LunMap::new(vec![(16383, a.lu.clone(), false)]).unwrap();
    assert!(m.get(16383).is_some_and(|e| Arc::ptr_eq(&e.lu, &a.lu)));
    assert!(m.get(0).is_none());
}
