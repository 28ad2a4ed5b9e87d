//! PDU framing: `frame_len` + `parse_frame` on arbitrary bytes and framings, and the round trip
//! `encode_into` -> `frame_len` -> `parse_frame` for structured PDUs.
#![no_main]

use arbitrary::Arbitrary;
use iscsi::pdu::{self, encode_into, frame_len, parse_frame, Bhs, FrameError, Framing, BHS_LEN};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct FramingIn {
    header_digest: bool,
    data_digest: bool,
    /// Scaled into 0..=16 MiB-1 (the 24-bit field's range) below.
    max: u32,
}

impl FramingIn {
    fn framing(&self) -> Framing {
        Framing {
            header_digest: self.header_digest,
            data_digest: self.data_digest,
            max_data_segment_len: (self.max as usize) & pdu::DATA_SEGMENT_LEN_MAX,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Input {
    /// Arbitrary bytes as they might arrive on a socket: parse every frame in them.
    Raw { framing: FramingIn, bytes: Vec<u8> },
    /// A PDU we build: it must come back exactly.
    RoundTrip {
        framing: FramingIn,
        bhs: [u8; BHS_LEN],
        data: Vec<u8>,
        /// Flip one bit of the encoding: digests must notice (or the frame must still decode).
        corrupt: Option<u16>,
    },
}

fn check_raw(bytes: &[u8], framing: &Framing) {
    let mut rest = bytes;
    while !rest.is_empty() {
        match frame_len(rest, framing) {
            Ok(None) => {
                // Needs more bytes: only possible when the frame is longer than what we have.
                if rest.len() >= BHS_LEN {
                    let dsl = Bhs::from_slice(rest).unwrap().data_segment_len();
                    assert!(dsl <= framing.max_data_segment_len);
                }
                return;
            }
            Err(FrameError::DataSegmentTooLong { len, max }) => {
                assert!(len > max);
                assert_eq!(max, framing.max_data_segment_len);
                return;
            }
            Err(e) => panic!("frame_len returned {e:?}, only DataSegmentTooLong is possible"),
            Ok(Some(n)) => {
                assert!(
                    n >= BHS_LEN && n <= rest.len(),
                    "frame length {n} of {}",
                    rest.len()
                );
                assert_eq!(n % 4, 0, "frames are 4-byte aligned");
                let frame = &rest[..n];
                match parse_frame(frame, framing) {
                    Ok(p) => {
                        assert_eq!(p.bhs.0[..], frame[..BHS_LEN]);
                        assert_eq!(p.ahs.len(), p.bhs.total_ahs_len());
                        assert_eq!(p.data.len(), p.bhs.data_segment_len());
                        assert!(p.data.len() <= framing.max_data_segment_len);
                    }
                    Err((FrameError::HeaderDigest, _)) => assert!(framing.header_digest),
                    Err((FrameError::DataDigest, bhs)) => {
                        assert!(framing.data_digest);
                        assert!(bhs.is_some(), "a data digest error keeps the header");
                    }
                    Err((e, _)) => panic!("parse_frame of a measured frame: {e:?}"),
                }
                rest = &rest[n..];
            }
        }
    }
    // Whatever was passed, parse_frame alone never panics either.
    let _ = parse_frame(bytes, framing);
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw { framing, bytes } => check_raw(&bytes, &framing.framing()),
        Input::RoundTrip {
            framing,
            bhs,
            data,
            corrupt,
        } => {
            let framing = framing.framing();
            let mut bhs = Bhs(bhs);
            bhs.0[4] = 0; // encode_into writes no AHS
            let mut out = Vec::new();
            encode_into(&mut out, &bhs, &data, &framing);
            let mut expect_len = BHS_LEN + pdu::padded(data.len());
            if framing.header_digest {
                expect_len += 4;
            }
            if framing.data_digest && !data.is_empty() {
                expect_len += 4;
            }
            assert_eq!(out.len(), expect_len);
            let measured = frame_len(&out, &framing);
            if data.len() > framing.max_data_segment_len {
                assert!(matches!(
                    measured,
                    Err(FrameError::DataSegmentTooLong { .. })
                ));
                return;
            }
            assert_eq!(measured, Ok(Some(out.len())));
            // One byte short: not yet complete.
            assert_eq!(frame_len(&out[..out.len() - 1], &framing), Ok(None));
            let p = parse_frame(&out, &framing).expect("our own encoding parses");
            let mut want = bhs;
            want.set_data_segment_len(data.len());
            assert_eq!(p.bhs, want);
            assert!(p.ahs.is_empty());
            assert_eq!(p.data, &data[..]);
            if let Some(bit) = corrupt {
                let bit = bit as usize % (out.len() * 8);
                let byte = bit / 8;
                out[byte] ^= 1 << (bit % 8);
                let in_bhs = byte < BHS_LEN;
                let in_hd = framing.header_digest && (BHS_LEN..BHS_LEN + 4).contains(&byte);
                // Only header-length and data-length bytes change the frame's shape.
                if in_bhs && (4..8).contains(&byte) {
                    let _ = frame_len(&out, &framing);
                    let _ = parse_frame(&out, &framing);
                    return;
                }
                let hd_end = BHS_LEN + if framing.header_digest { 4 } else { 0 };
                // Padding and the digest itself are covered too (the CRC runs over padded data).
                let in_data = byte >= hd_end;
                match parse_frame(&out, &framing) {
                    Ok(_) => {
                        // Undetected only where no digest covers the flipped bit.
                        assert!(
                            !(framing.header_digest && (in_bhs || in_hd)),
                            "header digest missed a flip at byte {byte}"
                        );
                        assert!(
                            !(framing.data_digest && !data.is_empty() && in_data),
                            "data digest missed a flip at byte {byte}"
                        );
                    }
                    Err((FrameError::HeaderDigest, _)) => {
                        assert!(framing.header_digest && (in_bhs || in_hd))
                    }
                    Err((FrameError::DataDigest, _)) => {
                        assert!(framing.data_digest && !data.is_empty())
                    }
                    Err((e, _)) => panic!("unexpected {e:?}"),
                }
            }
        }
    }
});
