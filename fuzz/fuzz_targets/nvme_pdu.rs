//! NVMe/TCP PDU framing: `nvme::pdu::frame` on arbitrary bytes and receiver settings (every
//! accepted frame's lengths must add up and stay within the receiver's limit; the PDU-specific
//! parsers, the I/O command decoder and Connect must take whatever the frame lets through, and a
//! Connect that parses re-encodes to itself), and the round trip of the PDUs the controller
//! builds.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::pdu::{self, frame, Accept, PduType, Transfer, CH_LEN, DIGEST_LEN, TERM_DATA_MAX};
use nvme::sqe::{Cqe, Sqe, Status, CQE_LEN};

#[derive(Arbitrary, Debug)]
struct AcceptIn {
    controller: bool,
    initialized: bool,
    header_digest: bool,
    data_digest: bool,
    alignment: u8,
    data_max: u16,
}

impl AcceptIn {
    fn accept(&self) -> Accept {
        Accept {
            controller: self.controller,
            initialized: self.initialized,
            header_digest: self.header_digest,
            data_digest: self.data_digest,
            alignment: self.alignment % 32,
            data_max: u32::from(self.data_max) * 4,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Input {
    Raw {
        accept: AcceptIn,
        bytes: Vec<u8>,
    },
    R2T {
        hd: bool,
        cccid: u16,
        ttag: u16,
        offset: u32,
        len: u32,
    },
    C2H {
        hd: bool,
        dd: bool,
        last: bool,
        cccid: u16,
        offset: u32,
        len: u16,
    },
    Resp {
        hd: bool,
        dw0: u32,
        cid: u16,
        sct: u8,
        sc: u8,
        dnr: bool,
    },
}

fn raw(accept: &Accept, mut bytes: &[u8]) {
    while bytes.len() >= CH_LEN {
        let ch: [u8; CH_LEN] = bytes[..CH_LEN].try_into().expect("8 bytes");
        let Ok(f) = frame(&ch, accept) else {
            return;
        };
        let hd = if f.header_digest { DIGEST_LEN } else { 0 };
        let dd = if f.data_digest { DIGEST_LEN } else { 0 };
        assert_eq!(f.hlen, f.pdu_type.hlen());
        assert!(f.len >= f.hlen + hd);
        if f.data_len > 0 {
            assert!(f.data_offset >= f.hlen + hd);
            assert_eq!(f.data_offset + f.data_len + dd, f.len);
            let term = matches!(f.pdu_type, PduType::H2CTermReq | PduType::C2HTermReq);
            let limit = if term {
                TERM_DATA_MAX
            } else {
                accept.data_max as usize
            };
            assert!(f.data_len <= limit);
        } else {
            assert_eq!(f.len, f.hlen + hd);
        }
        let Some(pdu) = bytes.get(..f.len) else {
            return;
        };
        let header = &pdu[..f.hlen];
        match f.pdu_type {
            PduType::ICReq => drop(pdu::ICReq::parse(header)),
            PduType::ICResp => drop(pdu::ICResp::parse(header)),
            PduType::CapsuleCmd => {
                let sqe = Sqe::from_slice(&header[CH_LEN..]).expect("64 bytes");
                let _ = (sqe.data_pointer(), sqe.cid(), sqe.fctype(), sqe.cdw(10));
                let data = &pdu[f.data_offset.max(f.hlen)..f.len];
                if let Ok(cmd) = nvme::nvm::IoCommand::decode(&sqe) {
                    let _ = cmd.data_out_len(4096);
                    let _ = (
                        nvme::nvm::dsm_ranges(data),
                        nvme::nvm::reservation_keys(data),
                    );
                }
                if sqe.fctype() == nvme::fabrics::fctype::CONNECT {
                    if let Ok(c) = nvme::fabrics::Connect::parse(&sqe, data) {
                        // What parses re-encodes to what was parsed.
                        assert_eq!(
                            nvme::fabrics::Connect::parse(&c.sqe(sqe.cid()), &c.data()),
                            Ok(c)
                        );
                    }
                }
                let _ = nvme::fabrics::property(&sqe);
                let _ = nvme::admin::AdminCommand::decode(&sqe);
                let _ = nvme::admin::number_of_queues(sqe.cdw(11), sqe.u16_at(44));
            }
            PduType::CapsuleResp => {
                let raw: [u8; CQE_LEN] = header[CH_LEN..].try_into().expect("16 bytes");
                let _ = Cqe::parse(&raw);
            }
            PduType::H2CData | PduType::C2HData | PduType::R2T => {
                assert!(Transfer::parse(header).is_some())
            }
            PduType::H2CTermReq | PduType::C2HTermReq => {}
        }
        bytes = &bytes[f.len..];
    }
}

fn controller_to_host(hd: bool, dd: bool) -> Accept {
    Accept {
        controller: false,
        initialized: true,
        header_digest: hd,
        data_digest: dd,
        alignment: 0,
        data_max: u32::MAX,
    }
}

fuzz_target!(|input: Input| match input {
    Input::Raw { accept, bytes } => raw(&accept.accept(), &bytes),
    Input::R2T {
        hd,
        cccid,
        ttag,
        offset,
        len,
    } => {
        let t = Transfer {
            cccid,
            ttag,
            offset,
            len,
        };
        let mut out = Vec::new();
        t.encode_r2t(hd, &mut out);
        let f = frame(
            out[..CH_LEN].try_into().unwrap(),
            &controller_to_host(hd, false),
        )
        .expect("our R2T frames");
        assert_eq!(f.len, out.len());
        assert_eq!(Transfer::parse(&out[..24]), Some(t));
        if hd {
            assert!(pdu::header_digest_ok(
                &out[..24],
                out[24..28].try_into().unwrap()
            ));
        }
    }
    Input::C2H {
        hd,
        dd,
        last,
        cccid,
        offset,
        len,
    } => {
        let len = u32::from(len).max(1);
        let t = Transfer {
            cccid,
            ttag: 0,
            offset,
            len,
        };
        let mut out = Vec::new();
        let extra = if last { pdu::flags::LAST_PDU } else { 0 };
        t.encode_c2h_header(extra, (hd, dd), &mut out);
        let f = frame(
            out[..CH_LEN].try_into().unwrap(),
            &controller_to_host(hd, dd),
        )
        .expect("our C2HData frames");
        assert_eq!(f.data_offset, out.len());
        assert_eq!(f.data_len, len as usize);
    }
    Input::Resp {
        hd,
        dw0,
        cid,
        sct,
        sc,
        dnr,
    } => {
        let status = Status {
            sct: sct & 7,
            sc,
            dnr,
        };
        let cqe = Cqe {
            dw0,
            dw1: 0,
            sqhd: 0,
            sqid: 0,
            cid,
            status,
        };
        let mut out = Vec::new();
        cqe.encode_capsule(hd, &mut out);
        let f = frame(
            out[..CH_LEN].try_into().unwrap(),
            &controller_to_host(hd, false),
        )
        .expect("our response capsules frame");
        assert_eq!(f.len, out.len());
        let raw: [u8; CQE_LEN] = out[CH_LEN..CH_LEN + CQE_LEN].try_into().unwrap();
        assert_eq!(Cqe::parse(&raw), cqe);
    }
});
