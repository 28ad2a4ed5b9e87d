//! The SCSI core over a real sparse file: provisioning status follows hole punching.
mod common;
use common::*;
use scsi::{Command, LogicalUnit, LuSettings, Status};
use std::sync::Arc;
use store::FileStore;

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn desc(buf: &[u8], i: usize) -> (u64, u32, u8) {
    let d = &buf[8 + 16 * i..8 + 16 * (i + 1)];
    (
        u64::from_be_bytes(d[..8].try_into().unwrap()),
        u32::from_be_bytes(d[8..12].try_into().unwrap()),
        d[12],
    )
}

fn run(lu: &LogicalUnit, cdb: &[u8], data_out: &[u8], buf: &mut Vec<u8>) -> Status {
    let cmd = Command {
        cdb,
        data_out,
        data_in_limit: 1 << 24,
    };
    lu.execute(&nexus(1), &cmd, buf).status
}

#[test]
fn thin_file_lu_round_trip_unmap_and_lba_status() {
    let path = std::env::temp_dir().join(format!("ferrosan-scsi-file-{}", std::process::id()));
    let _guard = TempFile(path.clone());
    let store = Arc::new(FileStore::open(&path, Some(8 * MIB), true).unwrap());
    let lu = LogicalUnit::new(
        store,
        identity(),
        LuSettings {
            write_cache: false,
            ..LuSettings::default()
        },
    )
    .unwrap();
    let mut buf = Vec::new();
    let data = pattern(2048 * 512, 3);
    assert_eq!(run(&lu, &write10(0, 2048), &data, &mut buf), Status::Good);
    assert_eq!(run(&lu, &read10(0, 2048), &[], &mut buf), Status::Good);
    assert_eq!(buf, data);
    // Unmap the second 512 KiB.
    let mut p = vec![0u8; 8];
    p.extend_from_slice(&1024u64.to_be_bytes());
    p.extend_from_slice(&1024u32.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    p[1] = 22;
    p[3] = 16;
    let mut unmap = [0u8; 10];
    unmap[0] = 0x42;
    unmap[8] = p.len() as u8;
    assert_eq!(run(&lu, &unmap, &p, &mut buf), Status::Good);
    let mut status = cdb16(0x9E, 0, 8 + 16 * 4);
    status[1] = 0x12;
    assert_eq!(run(&lu, &status, &[], &mut buf), Status::Good);
    assert_eq!(desc(&buf, 0), (0, 1024, 0));
    assert_eq!(desc(&buf, 1), (1024, 16384 - 1024, 1));
    assert_eq!(run(&lu, &read10(1024, 8), &[], &mut buf), Status::Good);
    assert!(buf.iter().all(|&b| b == 0));
    // WRITE SAME with UNMAP over mapped data, then a pattern WRITE SAME maps again.
    let mut ws = cdb16(0x93, 0, 1024);
    ws[1] = 0x08;
    assert_eq!(run(&lu, &ws, &[7u8; 512], &mut buf), Status::Good);
    assert_eq!(run(&lu, &status, &[], &mut buf), Status::Good);
    assert_eq!(desc(&buf, 0), (0, 16384, 1));
    assert_eq!(
        run(&lu, &cdb16(0x93, 8, 8), &[7u8; 512], &mut buf),
        Status::Good
    );
    assert_eq!(run(&lu, &read10(8, 8), &[], &mut buf), Status::Good);
    assert!(buf.iter().all(|&b| b == 7));
    assert_eq!(run(&lu, &cdb10(0x35, 0, 0), &[], &mut buf), Status::Good);
}
