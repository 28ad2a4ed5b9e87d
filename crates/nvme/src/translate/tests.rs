use super::*;
use crate::nvm::ReservationType;

fn blocks(slba: u64, count: u32) -> Blocks {
    Blocks { slba, count }
}

#[test]
fn reads_and_writes_become_their_sixteen_byte_scsi_commands() {
    let r = scsi_command(
        &IoCommand::Read {
            blocks: blocks(0x1_0000_0002, 8),
            fua: true,
        },
        &[],
        512,
    )
    .unwrap();
    assert_eq!(
        r.cdb[..],
        [0x88, 0x08, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0]
    );
    assert_eq!((r.data_in_len, r.read, r.write), (4096, true, false));
    let w = scsi_command(
        &IoCommand::Write {
            blocks: blocks(3, 1),
            fua: false,
        },
        &[7; 4096],
        4096,
    )
    .unwrap();
    assert_eq!(w.cdb[0], 0x8A);
    assert_eq!(w.cdb[1], 0);
    assert_eq!(&w.data_out[..], &[7; 4096]);
    assert!(
        matches!(w.data_out, std::borrow::Cow::Borrowed(_)),
        "a write's data is the host's, not a copy"
    );
    // Data that does not match the blocks asked for never reaches the medium.
    assert_eq!(
        scsi_command(
            &IoCommand::Write {
                blocks: blocks(3, 2),
                fua: false
            },
            &[7; 4096],
            4096
        ),
        Err(Status::DATA_SGL_LENGTH_INVALID)
    );
    let c = scsi_command(
        &IoCommand::Compare {
            blocks: blocks(0, 1),
        },
        &[1; 512],
        512,
    )
    .unwrap();
    assert_eq!((c.cdb[0], c.cdb[1]), (0x8F, 0x02));
    let f = scsi_command(&IoCommand::Flush, &[], 512).unwrap();
    assert_eq!(
        f.cdb[..],
        [0x91, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn write_zeroes_and_deallocate_become_write_same_and_unmap() {
    let z = scsi_command(
        &IoCommand::WriteZeroes {
            blocks: blocks(16, 32),
            deallocate: true,
            fua: false,
        },
        &[],
        512,
    )
    .unwrap();
    assert_eq!((z.cdb[0], z.cdb[1]), (0x93, 0x09));
    assert!(z.data_out.is_empty());
    assert_eq!(
        scsi_command(
            &IoCommand::WriteZeroes {
                blocks: blocks(0, 1),
                deallocate: false,
                fua: true
            },
            &[],
            512
        ),
        Err(Status::INVALID_FIELD)
    );
    // With FUA: the same without it, then SYNCHRONIZE CACHE (16) of exactly its blocks.
    let fua = IoCommand::WriteZeroes {
        blocks: blocks(0x1_0000_0002, 8),
        deallocate: true,
        fua: true,
    };
    let (plain, sync) = split_fua_write_zeroes(&fua).unwrap();
    assert_eq!(
        plain,
        IoCommand::WriteZeroes {
            blocks: blocks(0x1_0000_0002, 8),
            deallocate: true,
            fua: false
        }
    );
    assert_eq!(
        sync.cdb[..],
        [0x91, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0]
    );
    assert!(sync.data_out.is_empty() && !sync.read && sync.data_in_len == 0);
    assert!(split_fua_write_zeroes(&plain).is_none());
    assert!(split_fua_write_zeroes(&IoCommand::Flush).is_none());
    let mut ranges = Vec::new();
    for (slba, count) in [(100u64, 8u32), (0, 0), (7, 1)] {
        ranges.extend_from_slice(&[0; 4]);
        ranges.extend_from_slice(&count.to_le_bytes());
        ranges.extend_from_slice(&slba.to_le_bytes());
    }
    let u = scsi_command(
        &IoCommand::DatasetManagement {
            ranges: 3,
            deallocate: true,
        },
        &ranges,
        512,
    )
    .unwrap();
    assert_eq!(u.cdb[0], 0x42);
    assert_eq!(u16::from_be_bytes([u.cdb[7], u.cdb[8]]), 40);
    assert_eq!(&u.data_out[..4], &[0, 38, 0, 32]);
    assert_eq!(&u.data_out[8..20], &[0, 0, 0, 0, 0, 0, 0, 100, 0, 0, 0, 8]);
    assert_eq!(&u.data_out[24..36], &[0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 1]);
    // Data that is not NR ranges (here 4097 ranges' worth for NR 3): refused, not truncated
    // into a 16-bit parameter list length.
    assert_eq!(
        scsi_command(
            &IoCommand::DatasetManagement {
                ranges: 3,
                deallocate: true
            },
            &vec![0; 4097 * 16],
            512
        ),
        Err(Status::DATA_SGL_LENGTH_INVALID)
    );
}

#[test]
fn reservation_commands_become_persistent_reserve_out_with_the_same_type() {
    let mut keys = Vec::new();
    keys.extend_from_slice(&0x1111u64.to_le_bytes());
    keys.extend_from_slice(&0x2222u64.to_le_bytes());
    let reg = scsi_command(
        &IoCommand::ReservationRegister {
            action: RegisterAction::Register,
            ignore_key: false,
            cptpl: Cptpl::NoChange,
        },
        &keys,
        512,
    )
    .unwrap();
    assert_eq!((reg.cdb[0], reg.cdb[1], reg.cdb[8]), (0x5F, 0x00, 24));
    assert_eq!(
        &reg.data_out[..16],
        &[0, 0, 0, 0, 0, 0, 0x11, 0x11, 0, 0, 0, 0, 0, 0, 0x22, 0x22]
    );
    assert_eq!(reg.data_out[20], 0);
    let acq = scsi_command(
        &IoCommand::ReservationAcquire {
            action: AcquireAction::Preempt,
            ignore_key: false,
            rtype: Some(ReservationType::WriteExclusiveRegistrantsOnly),
        },
        &keys,
        512,
    )
    .unwrap();
    assert_eq!((acq.cdb[1], acq.cdb[2]), (0x04, 5));
    let unreg = scsi_command(
        &IoCommand::ReservationRegister {
            action: RegisterAction::Unregister,
            ignore_key: false,
            cptpl: Cptpl::Set,
        },
        &keys,
        512,
    )
    .unwrap();
    assert_eq!(&unreg.data_out[8..16], &[0; 8]);
    assert_eq!(unreg.data_out[20], 1, "APTPL");
    let clear = scsi_command(
        &IoCommand::ReservationRelease {
            clear: true,
            ignore_key: false,
            rtype: None,
        },
        &keys,
        512,
    )
    .unwrap();
    assert_eq!(clear.cdb[1], 0x03);
}

#[test]
fn a_fused_pair_becomes_compare_and_write() {
    let c = IoCommand::Compare {
        blocks: blocks(9, 1),
    };
    let w = IoCommand::Write {
        blocks: blocks(9, 1),
        fua: false,
    };
    let cw = compare_and_write(&c, &[1; 512], &w, &[2; 512], 512).unwrap();
    assert_eq!(cw.cdb[0], 0x89);
    assert_eq!(cw.cdb[13], 1);
    assert_eq!(cw.data_out.len(), 1024);
    let elsewhere = IoCommand::Write {
        blocks: blocks(10, 1),
        fua: false,
    };
    assert_eq!(
        compare_and_write(&c, &[1; 512], &elsewhere, &[2; 512], 512),
        Err(Status::INVALID_FIELD)
    );
    assert_eq!(
        compare_and_write(&w, &[1; 512], &c, &[2; 512], 512),
        Err(Status::ABORTED_FUSE_FAILED)
    );
}

#[test]
fn scsi_answers_map_to_one_nvme_status_each() {
    let fixed = |key: u8, asc: u8, ascq: u8| {
        let mut s = vec![0u8; 18];
        s[0] = 0x70;
        s[2] = key;
        s[12] = asc;
        s[13] = ascq;
        s
    };
    assert_eq!(status_of(0, &[]), Status::SUCCESS);
    assert_eq!(status_of(0x18, &[]), Status::RESERVATION_CONFLICT);
    assert_eq!(status_of(0x28, &[]), QUEUE_FULL);
    assert_eq!(status_of(2, &fixed(5, 0x21, 0)), Status::LBA_OUT_OF_RANGE);
    assert_eq!(status_of(2, &fixed(5, 0x20, 0)), Status::INVALID_OPCODE);
    assert_eq!(status_of(2, &fixed(7, 0x27, 0)), WRITE_PROTECTED);
    assert_eq!(status_of(2, &fixed(7, 0x27, 7)), Status::CAPACITY_EXCEEDED);
    let full = status_of(2, &fixed(5, 0x55, 4));
    assert_eq!(full, Status::INTERNAL_ERROR, "a full registrant table");
    assert!(!full.dnr, "retried once the table has room");
    assert_eq!(status_of(2, &fixed(0xE, 0x1D, 0)), Status::COMPARE_FAILURE);
    assert_eq!(status_of(2, &fixed(2, 4, 0x0A)), Status::ANA_TRANSITION);
    assert_eq!(status_of(2, &fixed(2, 4, 0x0B)), Status::ANA_INACCESSIBLE);
    assert_eq!(
        status_of(2, &fixed(2, 4, 0x12)),
        Status::NAMESPACE_NOT_READY
    );
    assert_eq!(status_of(2, &fixed(3, 0x11, 0)), UNRECOVERED_READ_ERROR);
    assert_eq!(
        status_of(2, &[0x72, 0x05, 0x24, 0x00]),
        Status::INVALID_FIELD
    );
    assert_eq!(status_of(2, &[]), Status::INTERNAL_ERROR);
}

#[test]
fn read_full_status_becomes_the_reservation_status_structure() {
    // Two registrations: an iSCSI initiator's (holding Write Exclusive) and an NVMe host's.
    let mut full = vec![0, 0, 0, 7, 0, 0, 0, 0];
    let descriptor = |key: u64, holder: bool, name: &str| {
        let mut d = key.to_be_bytes().to_vec();
        d.extend_from_slice(&[0; 4]);
        d.push(u8::from(holder));
        d.push(if holder { 1 } else { 0 });
        d.extend_from_slice(&[0, 0, 0, 0, 0, 1]);
        let padded = (name.len() + 1).div_ceil(4) * 4;
        d.extend_from_slice(&((4 + padded) as u32).to_be_bytes());
        d.extend_from_slice(&[0x45, 0]);
        d.extend_from_slice(&(padded as u16).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.resize(d.len() + padded - name.len(), 0);
        d
    };
    full.extend(descriptor(0xAAAA, true, "iqn.2026-11.x:i,i,0x400000000001"));
    full.extend(descriptor(
        0xBBBB,
        false,
        "nqn.2014-08.org.nvmexpress:uuid:x,h,0x000102030405060708090a0b0c0d0e0f",
    ));
    let n = (full.len() - 8) as u32;
    full[4..8].copy_from_slice(&n.to_be_bytes());
    let s = reservation_status(&full, false, false, 4096);
    assert_eq!(s.len(), 4096);
    assert_eq!(
        u32::from_le_bytes(s[0..4].try_into().unwrap()),
        7,
        "generation"
    );
    assert_eq!(s[4], 1, "Write Exclusive");
    assert_eq!(s[9], 0, "PTPLS: not persistent");
    assert_eq!(u16::from_le_bytes([s[5], s[6]]), 2, "registrants");
    assert_eq!(s[24 + 2], 1, "the first holds it");
    assert_eq!(
        u64::from_le_bytes(s[24 + 16..24 + 24].try_into().unwrap()),
        0xAAAA
    );
    assert_eq!(
        &s[48 + 8..48 + 16],
        &[0, 1, 2, 3, 4, 5, 6, 7],
        "the NVMe host's identifier"
    );
    assert_eq!(
        u64::from_le_bytes(s[48 + 16..48 + 24].try_into().unwrap()),
        0xBBBB
    );
    let e = reservation_status(&full, true, true, 256);
    assert_eq!(e[9], 1, "PTPLS: persistent through power loss");
    assert_eq!(
        u64::from_le_bytes(e[128 + 8..128 + 16].try_into().unwrap()),
        0xBBBB
    );
    assert_eq!(e[128 + 16..128 + 32], (0..16u8).collect::<Vec<_>>()[..]);
    // Garbage in: a well-formed empty answer, never a panic.
    assert_eq!(
        reservation_status(&[1, 2, 3], false, false, 24),
        vec![0; 24]
    );
    assert_eq!(reservation_report().cdb[..2], [0x5E, 0x03]);
}
