//! Planned commands (submit, then complete) must answer exactly as executed ones: the same
//! status, sense, transfer length, Data-In and medium, for every CDB we can think of.

mod common;
use common::*;
use scsi::{BlockOp, Command, Completion, LuSettings, Plan, Status};
use std::sync::Arc;
use store::BlockStore;

/// Runs `cdb` through plan → (the store, as an engine would) → finish. Returns the
/// completion, the Data-In and whether it planned an I/O.
fn planned(
    t: &mut T,
    cdb: &[u8],
    data_out: &[u8],
    read_only_mapping: bool,
) -> (Completion, Vec<u8>, bool) {
    let cmd = Command {
        cdb,
        data_out,
        data_in_limit: t.limit,
    };
    match t.lu.plan(&t.nexus, &cmd, read_only_mapping) {
        Plan::Io(io, share) => {
            let mut data_in = Vec::new();
            let offset = io.offset;
            let result = match io.op {
                BlockOp::Read => {
                    data_in.resize(io.len as usize, 0);
                    t.store.read_at(&mut data_in, offset)
                }
                BlockOp::Write { durable } => {
                    assert!(share.is_some(), "a write carries its share of the order");
                    t.store
                        .write_at(&data_out[..io.len as usize], offset, durable)
                }
                BlockOp::Flush => t.store.flush(),
            };
            drop(share);
            let c = t.lu.finish(&io, result);
            if c.status != Status::Good {
                data_in.clear();
            }
            (c, data_in, true)
        }
        Plan::Done(c) => (c, Vec::new(), false),
        Plan::Execute => {
            let mut data_in = Vec::new();
            let c = t.lu.execute(&t.nexus, &cmd, &mut data_in);
            (c, data_in, false)
        }
    }
}

fn pair(settings: LuSettings) -> (T, T) {
    let mut a = T::with(settings, 4 * MIB);
    let mut b = T::with(settings, 4 * MIB);
    // Both see the same first command (POWER ON unit attention, then a pattern written).
    for t in [&mut a, &mut b] {
        t.lu.nexus_added(1);
        let data = pattern(64 * 512, 3);
        t.run(&write10(0, 64), &data);
        t.run(&write10(0, 64), &data);
    }
    (a, b)
}

/// The CDBs both paths must agree on: good, out of range, bad flags, zero length, short
/// Data-Out, FUA, every size of READ/WRITE, SYNCHRONIZE CACHE with and without range.
fn cdbs(blocks: u64) -> Vec<(Vec<u8>, usize)> {
    let last = blocks as u32 - 1;
    let mut v: Vec<(Vec<u8>, usize)> = vec![
        (read10(0, 8).to_vec(), 0),
        (read10(5, 1).to_vec(), 0),
        (read10(last, 1).to_vec(), 0),
        (read10(last, 2).to_vec(), 0),
        (read10(blocks as u32, 1).to_vec(), 0),
        (read10(0, 0).to_vec(), 0),
        (vec![0x08, 0, 0, 1, 2, 0], 0),  // READ(6) 2 blocks at 1
        (vec![0x08, 0, 0, 0, 0, 0], 0),  // READ(6) 256 blocks
        (cdb12(0xA8, 3, 4).to_vec(), 0), // READ(12)
        (cdb16(0x88, 7, 9).to_vec(), 0), // READ(16)
        (cdb16(0x88, u64::MAX, 1).to_vec(), 0),
        (cdb16(0x88, 0, u32::MAX).to_vec(), 0),
        (write10(1, 2).to_vec(), 1024),
        (write10(1, 2).to_vec(), 700), // one whole block arrived
        (write10(1, 2).to_vec(), 0),
        (write10(last, 2).to_vec(), 1024),
        (write10(0, 0).to_vec(), 0),
        (vec![0x0A, 0, 0, 9, 1, 0], 512), // WRITE(6)
        (cdb12(0xAA, 11, 1).to_vec(), 512),
        (cdb16(0x8A, 12, 3).to_vec(), 1536),
        (vec![0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0), // SYNCHRONIZE CACHE(10) all
        (vec![0x35, 0x02, 0, 0, 0, 1, 0, 0, 8, 0], 0), // IMMED, a range
        (cdb16(0x91, blocks, 1).to_vec(), 0),       // SYNCHRONIZE CACHE(16) out of range
        (vec![0x35, 0x02, 0, 0, 0, 1, 0, 0, 8, 0x04], 0), // control byte NACA
        (vec![0x28], 0),                            // short CDB
        (vec![0x12, 0, 0, 0, 36, 0], 0),            // INQUIRY: executes
        (vec![0x00; 6], 0),                         // TEST UNIT READY: executes
    ];
    // FUA, DPO, and protection fields (invalid without PI) on READ/WRITE(10).
    for flags in [0x08u8, 0x10, 0x20, 0xE0, 0x02] {
        let mut r = read10(2, 2).to_vec();
        r[1] = flags;
        v.push((r, 0));
        let mut w = write10(2, 2).to_vec();
        w[1] = flags;
        v.push((w, 1024));
    }
    v
}

fn agree(settings: LuSettings, read_only_mapping: bool) -> usize {
    let (a, mut b) = pair(settings);
    let blocks = a.lu.capacity_bytes() / u64::from(a.lu.settings().block_size);
    let mut planned_ios = 0;
    for (i, (cdb, out_len)) in cdbs(blocks).into_iter().enumerate() {
        let data_out = pattern(out_len, i as u8);
        // Reference: the ordinary path (the map's read-only flag as execute_io takes it).
        let cmd = Command {
            cdb: &cdb,
            data_out: &data_out,
            data_in_limit: a.limit,
        };
        let map = scsi::LunMap::new(vec![(0, Arc::clone(&a.lu), read_only_mapping)]).unwrap();
        let mut want_data = Vec::new();
        let want = map.execute(&a.nexus, 0, &cmd, &mut want_data);
        let (got, got_data, was_io) = planned(&mut b, &cdb, &data_out, read_only_mapping);
        planned_ios += usize::from(was_io);
        assert_eq!(got, want, "cdb {cdb:02x?} data_out {out_len}");
        assert_eq!(got_data, want_data, "cdb {cdb:02x?}");
    }
    // Same medium afterwards.
    let mut ma = vec![0u8; 4 * MIB as usize];
    let mut mb = vec![0u8; 4 * MIB as usize];
    a.store.read_at(&mut ma, 0).unwrap();
    b.store.read_at(&mut mb, 0).unwrap();
    assert!(ma == mb, "planned and executed writes left different media");
    planned_ios
}

#[test]
fn planned_commands_answer_as_executed_ones() {
    let ios = agree(LuSettings::default(), false);
    assert!(ios >= 15, "only {ios} commands planned an I/O");
}

#[test]
fn planned_commands_agree_in_write_through_on_4k_blocks() {
    let settings = LuSettings {
        block_size: 4096,
        write_cache: false,
        ..LuSettings::default()
    };
    // Data-Out shorter than a 4 KiB block writes nothing (and agrees on that).
    assert!(agree(settings, false) >= 8);
}

#[test]
fn planned_commands_agree_through_a_read_only_mapping() {
    // Writes are refused (DATA PROTECT) by both; reads still plan.
    assert!(agree(LuSettings::default(), true) > 0);
}

#[test]
fn durability_follows_wce_and_fua() {
    let mut t = T::new(); // write cache on
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    let plan = |t: &T, cdb: &[u8]| {
        let data = vec![0u8; 512];
        let cmd = Command {
            cdb,
            data_out: &data,
            data_in_limit: 0,
        };
        match t.lu.plan(&t.nexus, &cmd, false) {
            Plan::Io(io, _) => io.op,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(plan(&t, &write10(0, 1)), BlockOp::Write { durable: false });
    let mut fua = write10(0, 1);
    fua[1] = 0x08;
    assert_eq!(plan(&t, &fua), BlockOp::Write { durable: true });
    let mut wt = T::with(
        LuSettings {
            write_cache: false,
            ..LuSettings::default()
        },
        MIB,
    );
    wt.lu.nexus_added(1);
    wt.run(&[0; 6], &[]);
    assert_eq!(plan(&wt, &write10(0, 1)), BlockOp::Write { durable: true });
}

#[test]
fn a_pending_unit_attention_is_reported_by_plan_and_kept_by_execute_plans() {
    let t = T::new();
    t.lu.nexus_added(1);
    // INQUIRY does not plan: nothing happens, the unit attention stays.
    let cmd = Command {
        cdb: &[0x12, 0, 0, 0, 36, 0],
        data_out: &[],
        data_in_limit: 36,
    };
    assert!(matches!(t.lu.plan(&t.nexus, &cmd, false), Plan::Execute));
    let read = read10(0, 1);
    let cmd = Command {
        cdb: &read,
        data_out: &[],
        data_in_limit: 512,
    };
    match t.lu.plan(&t.nexus, &cmd, false) {
        Plan::Done(c) => {
            assert_eq!(c.status, Status::CheckCondition);
            assert_sense(&c.sense.unwrap(), 0x06, 0x29, 0x00);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(t.lu.plan(&t.nexus, &cmd, false), Plan::Io(..)));
}

#[test]
fn device_errors_finish_as_medium_errors() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    for (cdb, asc) in [
        (read10(0, 1).to_vec(), 0x11),
        (write10(0, 1).to_vec(), 0x0C),
    ] {
        let data = vec![0u8; 512];
        let cmd = Command {
            cdb: &cdb,
            data_out: &data,
            data_in_limit: 512,
        };
        let Plan::Io(io, _) = t.lu.plan(&t.nexus, &cmd, false) else {
            panic!("plans");
        };
        let c = t.lu.finish(&io, Err(std::io::Error::from_raw_os_error(5)));
        assert_eq!(c.status, Status::CheckCondition);
        assert_sense(&c.sense.unwrap(), 0x03, asc, 0x00);
        assert_eq!(t.lu.finish(&io, Ok(())), Completion::good(512));
    }
}

/// A full filesystem or quota under the LU is out of space, not a failing medium: DATA
/// PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT (27h/07h), for a write and for a flush.
#[test]
fn a_full_backing_store_is_space_allocation_failed_not_a_medium_error() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    let synchronize_cache = [0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    for cdb in [write10(0, 1).to_vec(), synchronize_cache.to_vec()] {
        let data = vec![0u8; if cdb[0] == 0x2A { 512 } else { 0 }];
        let cmd = Command {
            cdb: &cdb,
            data_out: &data,
            data_in_limit: 0,
        };
        let Plan::Io(io, _) = t.lu.plan(&t.nexus, &cmd, false) else {
            panic!("plans");
        };
        for errno in [28 /* ENOSPC */, 122 /* EDQUOT */] {
            let c =
                t.lu.finish(&io, Err(std::io::Error::from_raw_os_error(errno)));
            assert_eq!(c.status, Status::CheckCondition);
            assert_sense(&c.sense.unwrap(), 0x07, 0x27, 0x07);
        }
    }
}

#[test]
fn compare_and_write_waits_for_planned_writes_and_excludes_new_ones() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    let data = vec![7u8; 512];
    let w = write10(0, 1);
    let cmd = Command {
        cdb: &w,
        data_out: &data,
        data_in_limit: 0,
    };
    let Plan::Io(_, Some(share)) = t.lu.plan(&t.nexus, &cmd, false) else {
        panic!("a write plans with a share");
    };
    // COMPARE AND WRITE of block 0 (compare zeros... the block is still zeros) on a thread:
    // it must not finish while the planned write is in flight.
    let lu = Arc::clone(&t.lu);
    let nexus = t.nexus.clone();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done2 = Arc::clone(&done);
    let caw = std::thread::spawn(move || {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x89;
        cdb[13] = 1;
        let mut out = vec![0u8; 512];
        out.extend_from_slice(&[9u8; 512]);
        let cmd = Command {
            cdb: &cdb,
            data_out: &out,
            data_in_limit: 0,
        };
        let c = lu.execute(&nexus, &cmd, &mut Vec::new());
        done2.store(true, std::sync::atomic::Ordering::SeqCst);
        c
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "CAW ran during a write"
    );
    // While the CAW waits for the order, a new write does not plan: it must wait too.
    assert!(matches!(t.lu.plan(&t.nexus, &cmd, false), Plan::Execute));
    drop(share);
    let c = caw.join().unwrap();
    assert_eq!(c.status, Status::Good, "{:?}", c.sense);
}

#[test]
fn an_offline_lu_plans_no_io() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.err(&[0, 0, 0, 0, 0, 0], &[]);
    t.lu.set_offline(true);
    for cdb in [
        read10(0, 1).to_vec(),
        write10(0, 1).to_vec(),
        cdb10(0x35, 0, 0).to_vec(),
    ] {
        let data_out = if cdb[0] == 0x2A {
            pattern(512, 1)
        } else {
            vec![]
        };
        let (c, data_in, io) = planned(&mut t, &cdb, &data_out, false);
        assert!(!io, "cdb {cdb:02x?} reached the store");
        assert!(data_in.is_empty());
        assert_sense(&c.sense.unwrap(), 0x02, 0x04, 0x03);
    }
    t.lu.set_offline(false);
    let (c, _, _) = planned(&mut t, &read10(0, 1), &[], false);
    assert_sense(&c.sense.unwrap(), 0x06, 0x28, 0x00);
    let (c, _, io) = planned(&mut t, &read10(0, 1), &[], false);
    assert_eq!(c.status, Status::Good);
    assert!(io);
}

/// The sense of a command that failed on the medium: key, ASC and the INFORMATION field.
fn medium_failure(c: &Completion) -> (u8, u8, Option<u64>) {
    assert_eq!(c.status, Status::CheckCondition, "{c:?}");
    let sense = c.sense.expect("sense data");
    (sense.key, sense.asc, sense.info)
}

/// A read that meets a bad block says which one, as a disk does: MEDIUM ERROR, UNRECOVERED
/// READ ERROR with the first failing LBA in INFORMATION, whether it ran whole (the blocking
/// path) or was planned and failed on the device (located by `finish_located`), and VERIFY
/// with BYTCHK 0 reads the medium to find it too.
#[test]
fn a_read_that_fails_on_the_medium_names_its_first_bad_block() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    // Blocks 100-101 of 512 bytes are bad; a 64-block read from 70 meets them at 100.
    t.store.fail_reads(100 * 512..102 * 512, usize::MAX);
    let c = t.run(&read10(70, 64), &[]);
    assert_eq!(medium_failure(&c), (0x03, 0x11, Some(100)));
    // Planned: the device failed the whole read; locating reads again.
    let cdb = read10(99, 8);
    let cmd = Command {
        cdb: &cdb,
        data_out: &[],
        data_in_limit: 8 * 512,
    };
    let Plan::Io(io, _) = t.lu.plan(&t.nexus, &cmd, false) else {
        panic!("plans");
    };
    let eio = std::io::Error::from_raw_os_error(5);
    assert!(io.failure_is_located(&eio));
    let c = t.lu.finish_located(&io, eio);
    assert_eq!(medium_failure(&c), (0x03, 0x11, Some(100)));
    // A backend out of reach is no medium error and is not located.
    assert!(!io.failure_is_located(&std::io::Error::from_raw_os_error(110)));
    // One block: it is the bad one.
    let c = t.run(&read10(101, 1), &[]);
    assert_eq!(medium_failure(&c), (0x03, 0x11, Some(101)));
    // VERIFY(10), BYTCHK 0, blocks 0-199: the medium is read, block 100 fails.
    let verify = [0x2F, 0, 0, 0, 0, 0, 0, 0, 200, 0];
    let c = t.run(&verify, &[]);
    assert_eq!(medium_failure(&c), (0x03, 0x11, Some(100)));
    // Blocks the failure does not touch read and verify as before.
    assert_eq!(t.run(&read10(0, 100), &[]).status, Status::Good);
    let verify = [0x2F, 0, 0, 0, 0, 0, 0, 0, 100, 0];
    assert_eq!(t.run(&verify, &[]), Completion::good(0));
}

/// A failure that does not repeat (a flaky device) is still a MEDIUM ERROR, but names no block:
/// the sense claims nothing it could not show.
#[test]
fn a_read_failure_that_does_not_repeat_names_no_block() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.run(&[0; 6], &[]);
    t.store.fail_reads(100 * 512..101 * 512, 1);
    let c = t.run(&read10(64, 64), &[]);
    assert_eq!(medium_failure(&c), (0x03, 0x11, None));
    assert_eq!(t.run(&read10(64, 64), &[]).status, Status::Good);
}
