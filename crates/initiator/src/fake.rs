//! A scripted fake target for unit tests: decode what the initiator sent, build what a
//! target would answer.

use std::time::Instant;

use iscsi::pdu::{self, off, Bhs, Framing, Opcode};

use crate::config::{SessionConfig, SessionKind};
use crate::login::{Login, Negotiated};
use crate::session::Session;

pub const TARGET: &str = "iqn.2024-01.dev.ferrosan:fake";
pub const INITIATOR: &str = "iqn.2024-01.dev.ferrosan:unit";

pub fn config() -> SessionConfig {
    SessionConfig::new(
        INITIATOR,
        SessionKind::Normal {
            target_name: TARGET.into(),
        },
    )
}

/// One PDU the initiator sent.
#[derive(Clone, Debug)]
pub struct Sent {
    pub bhs: Bhs,
    pub data: Vec<u8>,
}

impl Sent {
    pub fn op(&self) -> u8 {
        self.bhs.opcode_raw()
    }
    pub fn keys(&self) -> Vec<(String, String)> {
        iscsi::text::parse(&self.data, 256).expect("initiator text parses")
    }
    pub fn key(&self, k: &str) -> Option<String> {
        self.keys()
            .into_iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v)
    }
}

/// Splits `bytes` into PDUs (all must be complete).
pub fn decode(bytes: &[u8], framing: &Framing) -> Vec<Sent> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let len = pdu::frame_len(&bytes[pos..], framing)
            .expect("frame")
            .expect("complete frame");
        let p = pdu::parse_frame(&bytes[pos..pos + len], framing).expect("valid frame");
        out.push(Sent {
            bhs: p.bhs,
            data: p.data.to_vec(),
        });
        pos += len;
    }
    out
}

pub fn encode(bhs: &Bhs, data: &[u8], framing: &Framing) -> Vec<u8> {
    let mut v = Vec::new();
    pdu::encode_into(&mut v, bhs, data, framing);
    v
}

pub fn text(keys: &[(&str, &str)]) -> Vec<u8> {
    let mut v = Vec::new();
    for (k, val) in keys {
        iscsi::text::encode_pair(&mut v, k, val);
    }
    v
}

/// Takes everything the login wants to send.
pub fn take_login(login: &mut Login) -> Vec<Sent> {
    let bytes = login.output().to_vec();
    login.advance_output(bytes.len());
    decode(&bytes, &Framing::LOGIN)
}

/// A Login Response to `req`: same stage; `transit` answers the requested NSG.
pub fn login_response(
    req: &Bhs,
    keys: &[(&str, &str)],
    transit: bool,
    status: (u8, u8),
    stat_sn: u32,
) -> Vec<u8> {
    let nsg = req.flags() & 3;
    let bhs = pdu::LoginResponse {
        request: req,
        csg: (req.flags() >> 2) & 3,
        transit_to: transit.then_some(nsg),
        tsih: if transit && nsg == 3 { 7 } else { 0 },
        stat_sn,
        window: 32,
        status,
    }
    .bhs();
    encode(&bhs, &text(keys), &Framing::LOGIN)
}

/// Parameters for a session built directly (no login).
pub fn params() -> Negotiated {
    Negotiated {
        header_digest: false,
        data_digest: false,
        max_recv_data_segment_length: 262_144,
        max_xmit_data_segment_length: 4096,
        max_burst_length: 16_384,
        first_burst_length: 8192,
        immediate_data: true,
        initial_r2t: false,
        max_outstanding_r2t: 1,
        default_time2wait: 0,
        default_time2retain: 0,
        data_pdu_in_order: true,
        data_sequence_in_order: true,
        max_connections: 1,
        tsih: 7,
        target_portal_group_tag: Some(1),
        target_alias: None,
    }
}

/// A session in full feature phase: next CmdSN 10, window up to `max_cmd_sn`, ExpStatSN 100.
pub fn session(
    config: SessionConfig,
    params: Negotiated,
    max_cmd_sn: u32,
    now: Instant,
) -> Session {
    Session::new(config, params, 10, 100, 10, max_cmd_sn, now)
}

pub fn framing(p: &Negotiated) -> Framing {
    Framing {
        header_digest: p.header_digest,
        data_digest: p.data_digest,
        max_data_segment_len: 1 << 24,
    }
}

/// Takes everything the session wants to send.
pub fn take(s: &mut Session) -> Vec<Sent> {
    let mut slices = Vec::new();
    s.output_slices(&mut slices);
    let bytes: Vec<u8> = slices.iter().flat_map(|p| p.iter().copied()).collect();
    assert_eq!(
        bytes.len(),
        s.output_len(),
        "all of it in one writev's slices"
    );
    s.advance_output(bytes.len());
    decode(&bytes, &framing(s.negotiated()))
}

/// A target PDU header with the sequence numbers filled in.
pub fn target_pdu(op: Opcode, itt: u32, stat_sn: u32, exp_cmd_sn: u32, max_cmd_sn: u32) -> Bhs {
    let mut bhs = Bhs::new(op);
    bhs.set_itt(itt);
    bhs.set_u32(off::STAT_SN, stat_sn);
    bhs.set_u32(off::EXP_CMD_SN, exp_cmd_sn);
    bhs.set_u32(off::MAX_CMD_SN, max_cmd_sn);
    bhs
}

/// Feeds one whole PDU to the session.
pub fn feed(s: &mut Session, bhs: &Bhs, data: &[u8], now: Instant) -> Result<(), crate::Error> {
    let framing = framing(s.negotiated());
    let bytes = encode(bhs, data, &framing);
    let used = s.receive(&bytes, now)?;
    assert_eq!(used, bytes.len(), "the whole PDU was consumed");
    Ok(())
}

/// Every event waiting.
pub fn events(s: &mut Session) -> Vec<crate::Event> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

/// A tiny deterministic generator for garbage input.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
