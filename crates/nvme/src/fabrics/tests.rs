use super::*;

fn connect(qid: u16, sqsize: u16, cntlid: u16) -> Connect {
    Connect {
        qid,
        sqsize,
        cattr: 0,
        kato_ms: 5000,
        host_id: [7; 16],
        cntlid,
        subnqn: "nqn.2026-11.org.ferrosan:demo".into(),
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427".into(),
    }
}

#[test]
fn a_connect_round_trips_through_its_command_and_data() {
    for c in [connect(0, 31, DYNAMIC_CONTROLLER), connect(3, 127, 1)] {
        let sqe = c.sqe(5);
        assert_eq!((sqe.opcode(), sqe.fctype(), sqe.cid()), (0x7F, 0x01, 5));
        assert_eq!(Connect::parse(&sqe, &c.data()), Ok(c));
    }
}

#[test]
fn a_connect_names_the_parameter_it_refuses() {
    let c = connect(0, 31, DYNAMIC_CONTROLLER);
    let at = |in_data, offset| Err(ConnectError::Invalid(InvalidParameter { in_data, offset }));
    // The admin queue holds 32 entries at least; no queue holds 1.
    let small = connect(0, 30, DYNAMIC_CONTROLLER);
    assert_eq!(Connect::parse(&small.sqe(1), &small.data()), at(false, 44));
    let one = connect(2, 0, 1);
    assert_eq!(Connect::parse(&one.sqe(1), &one.data()), at(false, 44));
    // A static controller on the admin queue.
    let fixed = connect(0, 31, 3);
    assert_eq!(Connect::parse(&fixed.sqe(1), &fixed.data()), at(true, 16));
    // NQNs: empty, unterminated, too long, not an NQN, not UTF-8.
    let mut data = c.data();
    data[256..512].fill(0);
    assert_eq!(Connect::parse(&c.sqe(1), &data), at(true, 256));
    let mut data = c.data();
    data[512..768].fill(b'a');
    assert_eq!(Connect::parse(&c.sqe(1), &data), at(true, 512));
    let mut data = c.data();
    data[512..512 + 224].fill(b'n');
    data[512..516].copy_from_slice(b"nqn.");
    assert_eq!(Connect::parse(&c.sqe(1), &data), at(true, 512));
    let mut data = c.data();
    data[256..260].copy_from_slice(b"iqn.");
    assert_eq!(Connect::parse(&c.sqe(1), &data), at(true, 256));
    let mut data = c.data();
    data[520] = 0xFF;
    assert_eq!(Connect::parse(&c.sqe(1), &data), at(true, 512));
    // Short data; an unknown record format.
    assert_eq!(Connect::parse(&c.sqe(1), &c.data()[..512]), at(false, 32));
    let mut sqe = c.sqe(1);
    sqe.0[40] = 1;
    let e = Connect::parse(&sqe, &c.data()).unwrap_err();
    assert_eq!(e, ConnectError::Format);
    assert_eq!(e.status(), Status::CONNECT_INCOMPATIBLE_FORMAT);
    // The completion's dword 0 says where.
    assert_eq!(
        InvalidParameter {
            in_data: true,
            offset: 512
        }
        .dw0(),
        0x0200_0001
    );
}

#[test]
fn a_controller_is_enabled_reset_and_shut_down_through_its_properties() {
    let mut r = Registers::new(127);
    assert_eq!(
        r.get(reg::CAP, true),
        Ok(127 | 1 << 16 | 15 << 24 | 1 << 37)
    );
    assert_eq!(r.get(reg::VS, false), Ok(0x0002_0000));
    assert_eq!(r.get(reg::CSTS, false), Ok(0));
    assert!(!r.ready());
    // Enable with 64-byte SQEs and 16-byte CQEs (IOSQES 6, IOCQES 4), as Linux does.
    let cc = 1 | 6 << 16 | 4 << 20;
    r.set(reg::CC, false, cc).unwrap();
    assert_eq!(r.get(reg::CC, false), Ok(cc));
    assert_eq!(r.get(reg::CSTS, false), Ok(1));
    assert!(r.ready());
    // Normal shutdown: complete at once, still ready until disabled.
    r.set(reg::CC, false, cc | 1 << 14).unwrap();
    assert_eq!(r.get(reg::CSTS, false), Ok(1 | 2 << 2));
    // Reset.
    r.set(reg::CC, false, 0).unwrap();
    assert_eq!(r.get(reg::CSTS, false), Ok(0));
    assert!(!r.ready());
    // Wrong size, read-only or unknown properties; a value beyond 32 bits.
    assert_eq!(r.get(reg::CAP, false), Err(Status::INVALID_FIELD));
    assert_eq!(r.get(0x24, false), Err(Status::INVALID_FIELD));
    assert_eq!(r.set(reg::CSTS, false, 1), Err(Status::INVALID_FIELD));
    assert_eq!(r.set(reg::CC, true, 1), Err(Status::INVALID_FIELD));
    assert_eq!(r.set(reg::CC, false, 1 << 32), Err(Status::INVALID_FIELD));
    // Reserved bits of CC are not kept.
    r.set(reg::CC, false, 0xFFFF_FFFF).unwrap();
    assert_eq!(r.get(reg::CC, false), Ok(0x00FF_FFF1));
}

#[test]
fn property_commands_say_offset_and_size() {
    let mut sqe = Sqe([0; 64]);
    sqe.0[44..48].copy_from_slice(&reg::CAP.to_le_bytes());
    sqe.0[40] = 1;
    assert_eq!(property(&sqe), Ok((0, true)));
    sqe.0[40] = 0;
    sqe.0[44] = 0x1C;
    assert_eq!(property(&sqe), Ok((0x1C, false)));
    sqe.0[40] = 2;
    assert_eq!(property(&sqe), Err(Status::INVALID_FIELD));
}
