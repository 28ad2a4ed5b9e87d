use super::*;

fn controller(hd: bool, dd: bool) -> Accept {
    Accept {
        controller: true,
        initialized: true,
        header_digest: hd,
        data_digest: dd,
        alignment: 0,
        data_max: 8192,
    }
}

fn ch(t: u8, flags: u8, hlen: u8, pdo: u8, plen: u32) -> [u8; CH_LEN] {
    let p = plen.to_le_bytes();
    [t, flags, hlen, pdo, p[0], p[1], p[2], p[3]]
}

fn field(offset: u32) -> Result<Frame, Refusal> {
    Err(Refusal {
        status: Fatal::InvalidHeaderField,
        field: offset,
    })
}

#[test]
fn a_command_capsule_is_framed_with_its_in_capsule_data_and_digests() {
    let a = controller(false, false);
    // No data.
    let f = frame(&ch(0x04, 0, 72, 0, 72), &a).unwrap();
    assert_eq!((f.hlen, f.data_len, f.len), (72, 0, 72));
    // 4 KiB in-capsule: data right after the header (alignment 0: dwords).
    let f = frame(&ch(0x04, 0, 72, 72, 72 + 4096), &a).unwrap();
    assert_eq!(
        (f.data_offset, f.data_len, f.data_digest),
        (72, 4096, false)
    );
    // Both digests on.
    let a = controller(true, true);
    let f = frame(&ch(0x04, 0x03, 72, 76, 76 + 512 + 4), &a).unwrap();
    assert_eq!(
        (f.header_digest, f.data_offset, f.data_len, f.data_digest),
        (true, 76, 512, true)
    );
    // Without data, no data digest.
    let f = frame(&ch(0x04, 0x01, 72, 0, 76), &a).unwrap();
    assert_eq!((f.data_len, f.data_digest), (0, false));
}

#[test]
fn digest_flags_must_match_what_was_negotiated() {
    let on = controller(true, true);
    let off = controller(false, false);
    assert_eq!(frame(&ch(0x04, 0, 72, 0, 72), &on), field(1));
    assert_eq!(frame(&ch(0x04, 0x01, 72, 0, 76), &off), field(1));
    // A data digest flag on a PDU without data.
    assert_eq!(frame(&ch(0x04, 0x03, 72, 0, 76), &on), field(1));
    // Termination requests are never digested.
    assert!(frame(&ch(0x02, 0, 24, 0, 24), &on).is_ok());
    assert_eq!(frame(&ch(0x02, 0x01, 24, 0, 28), &on), field(1));
}

#[test]
fn lengths_offsets_and_types_are_checked_before_anything_is_read() {
    let a = controller(false, false);
    // Unknown type, a type only a controller sends, a wrong header length.
    assert_eq!(frame(&ch(0x08, 0, 24, 0, 24), &a), field(0));
    assert_eq!(frame(&ch(0x05, 0, 24, 0, 24), &a), field(0));
    assert_eq!(frame(&ch(0x04, 0, 73, 0, 73), &a), field(2));
    // PLEN shorter than the header; data on a type that carries none is impossible here.
    assert_eq!(frame(&ch(0x04, 0, 72, 0, 71), &a), field(4));
    // A data offset that is not where the alignment puts the data.
    assert_eq!(frame(&ch(0x04, 0, 72, 80, 80 + 16), &a), field(3));
    assert_eq!(frame(&ch(0x04, 0, 72, 9, 72), &a), field(3));
    // More data than the receiver takes in one PDU.
    assert_eq!(
        frame(&ch(0x04, 0, 72, 72, 72 + 8193), &a),
        Err(Refusal {
            status: Fatal::DataLimitExceeded,
            field: 4
        })
    );
    assert!(frame(&ch(0x04, 0, 72, 72, 72 + 8192), &a).is_ok());
    // A huge PLEN is refused by the limit, never allocated.
    assert!(frame(&ch(0x06, 0, 24, 24, u32::MAX), &a).is_err());
}

#[test]
fn alignment_moves_the_data_offset() {
    let mut a = controller(true, false);
    // HPDA 7: 32-byte alignment; header 72 + digest 4 = 76, data at 96.
    a.alignment = 7;
    let f = frame(&ch(0x04, 0x01, 72, 96, 96 + 100), &a).unwrap();
    assert_eq!((f.data_offset, f.data_len), (96, 100));
    assert_eq!(frame(&ch(0x04, 0x01, 72, 76, 76 + 100), &a), field(3));
}

#[test]
fn initialization_comes_first_and_once() {
    let mut a = controller(false, false);
    a.initialized = false;
    assert!(frame(&ch(0x00, 0, 128, 0, 128), &a).is_ok());
    let seq = Err(Refusal {
        status: Fatal::SequenceError,
        field: 0,
    });
    assert_eq!(frame(&ch(0x04, 0, 72, 0, 72), &a), seq);
    a.initialized = true;
    assert_eq!(frame(&ch(0x00, 0, 128, 0, 128), &a), seq);
    // A termination request is allowed at any time, with the header in error as data.
    a.initialized = false;
    let f = frame(&ch(0x02, 0, 24, 24, 24 + 72), &a).unwrap();
    assert_eq!(f.data_len, 72);
    assert!(frame(&ch(0x02, 0, 24, 24, 24 + 153), &a).is_err());
}

#[test]
fn a_host_receives_only_controller_pdus() {
    let host = Accept {
        controller: false,
        ..controller(false, false)
    };
    assert!(frame(&ch(0x05, 0, 24, 0, 24), &host).is_ok());
    assert!(frame(&ch(0x09, 0, 24, 0, 24), &host).is_ok());
    let f = frame(&ch(0x07, flags::LAST_PDU, 24, 24, 24 + 4096), &host).unwrap();
    assert_eq!(f.flags & flags::LAST_PDU, flags::LAST_PDU);
    assert_eq!(frame(&ch(0x04, 0, 72, 0, 72), &host), field(0));
    // R2T carries no data.
    assert_eq!(frame(&ch(0x09, 0, 24, 24, 28), &host), field(4));
}

#[test]
fn connection_initialization_round_trips_and_refuses_the_unknown() {
    let req = ICReq {
        hpda: 0,
        header_digest: true,
        data_digest: false,
        maxr2t: 0,
    };
    let mut out = Vec::new();
    req.encode(&mut out);
    assert_eq!(out.len(), 128);
    let mut a = controller(false, false);
    a.initialized = false;
    let f = frame(out[..8].try_into().unwrap(), &a).unwrap();
    assert_eq!(f.len, 128);
    assert_eq!(ICReq::parse(&out), Ok(req));
    let mut bad = out.clone();
    bad[8] = 1;
    assert_eq!(
        ICReq::parse(&bad).map_err(|r| r.status),
        Err(Fatal::UnsupportedParameter)
    );
    let mut bad = out.clone();
    bad[10] = 32;
    assert_eq!(ICReq::parse(&bad), Err(Refusal::field(10)));
    let mut bad = out.clone();
    bad[11] = 0x04;
    assert_eq!(ICReq::parse(&bad), Err(Refusal::field(11)));
    let resp = ICResp {
        cpda: 0,
        header_digest: true,
        data_digest: true,
        maxh2cdata: 128 << 10,
    };
    let mut out = Vec::new();
    resp.encode(&mut out);
    assert_eq!(&out[..4], &[0x01, 0, 128, 0]);
    assert_eq!(ICResp::parse(&out), Ok(resp));
}

#[test]
fn data_and_r2t_headers_carry_their_transfer() {
    let t = Transfer {
        cccid: 0x1234,
        ttag: 7,
        offset: 8192,
        len: 4096,
    };
    let mut out = Vec::new();
    t.encode_r2t(true, &mut out);
    assert_eq!(out.len(), 28);
    assert_eq!(Transfer::parse(&out), Some(t));
    assert_eq!(Transfer::parse(&out[..19]), None);
    assert!(header_digest_ok(
        &out[..24],
        out[24..28].try_into().unwrap()
    ));
    let host = Accept {
        controller: false,
        ..controller(true, false)
    };
    assert_eq!(frame(out[..8].try_into().unwrap(), &host).unwrap().len, 28);
    let mut out = Vec::new();
    t.encode_c2h_header(flags::LAST_PDU | flags::SUCCESS, (false, true), &mut out);
    assert_eq!(out.len(), 24);
    let host = Accept {
        controller: false,
        ..controller(false, true)
    };
    let f = frame(out[..8].try_into().unwrap(), &host).unwrap();
    assert_eq!((f.data_offset, f.data_len, f.data_digest), (24, 4096, true));
    assert_eq!(f.flags & 0x0C, 0x0C);
}

#[test]
fn a_termination_request_names_the_error_and_quotes_the_header() {
    let header = [0xAAu8; 200];
    let mut out = Vec::new();
    let r = Refusal {
        status: Fatal::HeaderDigestError,
        field: 0,
    };
    encode_term(&r, true, &header, &mut out);
    assert_eq!(out.len(), 24 + TERM_DATA_MAX);
    assert_eq!(out[0], 0x03);
    assert_eq!(u16::from_le_bytes([out[8], out[9]]), 0x03);
    let host = Accept {
        controller: false,
        ..controller(false, false)
    };
    let f = frame(out[..8].try_into().unwrap(), &host).unwrap();
    assert_eq!(f.data_len, TERM_DATA_MAX);
}
