use super::*;

fn sqe(op: u8, cdw10: u32, cdw11: u32, cdw12: u32) -> Sqe {
    let mut s = Sqe([0; 64]);
    s.0[0] = op;
    s.0[1] = 0x40;
    s.0[40..44].copy_from_slice(&cdw10.to_le_bytes());
    s.0[44..48].copy_from_slice(&cdw11.to_le_bytes());
    s.0[48..52].copy_from_slice(&cdw12.to_le_bytes());
    s
}

#[test]
fn reads_and_writes_take_a_64_bit_start_a_0s_based_count_and_fua() {
    let r = IoCommand::decode(&sqe(opcode::READ, 0x10, 0x2, 7)).unwrap();
    assert_eq!(
        r,
        IoCommand::Read {
            blocks: Blocks {
                slba: 0x2_0000_0010,
                count: 8
            },
            fua: false
        }
    );
    let w = IoCommand::decode(&sqe(opcode::WRITE, 0, 0, 0xFFFF | 1 << 30)).unwrap();
    assert_eq!(
        w,
        IoCommand::Write {
            blocks: Blocks {
                slba: 0,
                count: 65536
            },
            fua: true
        }
    );
    assert_eq!(w.data_out_len(4096), Some(65536 * 4096));
    assert_eq!(r.data_out_len(512), None);
    // Protection information on a namespace without it.
    for bits in [1 << 26, 1 << 29, 1 << 24] {
        assert_eq!(
            IoCommand::decode(&sqe(opcode::WRITE, 0, 0, bits)),
            Err(Status::INVALID_FIELD)
        );
    }
    // Limited retry (bit 31) and the hints are accepted.
    assert!(IoCommand::decode(&sqe(opcode::READ, 0, 0, 1 << 31)).is_ok());
}

#[test]
fn write_zeroes_dataset_management_and_flush() {
    assert_eq!(
        IoCommand::decode(&sqe(opcode::WRITE_ZEROES, 8, 0, 15 | 1 << 25)).unwrap(),
        IoCommand::WriteZeroes {
            blocks: Blocks { slba: 8, count: 16 },
            deallocate: true,
            fua: false
        }
    );
    let dsm = IoCommand::decode(&sqe(opcode::DATASET_MANAGEMENT, 255, 1 << 2, 0)).unwrap();
    assert_eq!(
        dsm,
        IoCommand::DatasetManagement {
            ranges: 256,
            deallocate: true
        }
    );
    assert_eq!(dsm.data_out_len(512), Some(4096));
    let mut data = vec![0u8; 32];
    data[4..8].copy_from_slice(&64u32.to_le_bytes());
    data[8..16].copy_from_slice(&1024u64.to_le_bytes());
    data[20..24].copy_from_slice(&8u32.to_le_bytes());
    data[24..32].copy_from_slice(&9u64.to_le_bytes());
    assert_eq!(
        dsm_ranges(&data),
        vec![
            Blocks {
                slba: 1024,
                count: 64
            },
            Blocks { slba: 9, count: 8 }
        ]
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::FLUSH, 0, 0, 0)),
        Ok(IoCommand::Flush)
    );
    assert_eq!(
        IoCommand::decode(&sqe(0x7C, 0, 0, 0)),
        Err(Status::INVALID_OPCODE)
    );
}

#[test]
fn reservation_commands_decode_their_actions_and_types() {
    assert_eq!(
        IoCommand::decode(&sqe(
            opcode::RESERVATION_REGISTER,
            2 | 1 << 3 | 3 << 30,
            0,
            0
        )),
        Ok(IoCommand::ReservationRegister {
            action: RegisterAction::Replace,
            ignore_key: true,
            cptpl: Cptpl::Set
        })
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_REGISTER, 1 << 30, 0, 0)),
        Err(Status::INVALID_FIELD),
        "CPTPL 01b is reserved"
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_ACQUIRE, 1 | 3 << 8, 0, 0)),
        Ok(IoCommand::ReservationAcquire {
            action: AcquireAction::Preempt,
            ignore_key: false,
            rtype: Some(ReservationType::WriteExclusiveRegistrantsOnly)
        })
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_ACQUIRE, 3, 0, 0)),
        Err(Status::INVALID_FIELD)
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_RELEASE, 7 << 8, 0, 0)),
        Err(Status::INVALID_FIELD)
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_RELEASE, 1, 0, 0)),
        Ok(IoCommand::ReservationRelease {
            clear: true,
            ignore_key: false,
            rtype: None
        })
    );
    assert_eq!(
        IoCommand::decode(&sqe(opcode::RESERVATION_REPORT, 1023, 1, 0)),
        Ok(IoCommand::ReservationReport {
            dwords: 1024,
            extended: true
        })
    );
    let mut data = [0u8; 16];
    data[..8].copy_from_slice(&0xAAu64.to_le_bytes());
    data[8..].copy_from_slice(&0xBBu64.to_le_bytes());
    assert_eq!(reservation_keys(&data), Some((0xAA, 0xBB)));
    assert_eq!(reservation_keys(&data[..8]), Some((0xAA, 0)));
    assert_eq!(reservation_keys(&data[..7]), None);
}

#[test]
fn the_six_reservation_types_are_spc_4s_six() {
    let spc: Vec<u8> = (1..=6)
        .map(|t| ReservationType::from_u8(t).unwrap().spc_type())
        .collect();
    assert_eq!(spc, vec![1, 3, 5, 6, 7, 8]);
    for t in 1..=6 {
        let r = ReservationType::from_u8(t).unwrap();
        assert_eq!(ReservationType::from_spc(r.spc_type()), Some(r));
    }
    assert_eq!(ReservationType::from_u8(0), None);
    assert_eq!(ReservationType::from_u8(7), None);
    assert_eq!(ReservationType::from_spc(2), None);
}
