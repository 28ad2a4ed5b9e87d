//! The DH-HMAC-CHAP messages as they travel in Authentication Send and Receive data
//! (NVMe base 2.0, 8.13.5.x): decoded with every length checked against the data, encoded
//! byte for byte.

use super::Reason;

/// AUTH_Type: the common messages (negotiate, failures) and the DH-HMAC-CHAP ones.
const COMMON: u8 = 0x00;
const DHCHAP: u8 = 0x01;

/// AUTH_Id of each message.
pub mod id {
    pub const NEGOTIATE: u8 = 0x00;
    pub const CHALLENGE: u8 = 0x01;
    pub const REPLY: u8 = 0x02;
    pub const SUCCESS1: u8 = 0x03;
    pub const SUCCESS2: u8 = 0x04;
    pub const FAILURE2: u8 = 0xF0;
    pub const FAILURE1: u8 = 0xF1;
}

/// The protocol descriptor's AUTHID for DH-HMAC-CHAP, and its size.
const AUTHID_DHCHAP: u8 = 0x01;
const DESCRIPTOR_LEN: usize = 64;
/// Hash and group lists hold at most 30 identifiers each.
const IDS_MAX: usize = 30;
/// The fixed part of the challenge, reply and success messages.
const HEADER: usize = 16;

/// AUTH_Negotiate (host to controller): what the host can use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiate {
    pub t_id: u16,
    /// Secure channel concatenation asked for (SC_C; 0: none).
    pub sc_c: u8,
    pub hashes: Vec<u8>,
    pub groups: Vec<u8>,
}

/// DH-HMAC-CHAP_Challenge (controller to host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub t_id: u16,
    pub hash: u8,
    pub group: u8,
    pub seqnum: u32,
    pub cval: Vec<u8>,
    pub dhv: Vec<u8>,
}

/// DH-HMAC-CHAP_Reply (host to controller): its response, and its own challenge if it
/// authenticates the controller too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub t_id: u16,
    pub rval: Vec<u8>,
    /// The host's challenge (CVALID set).
    pub cval: Option<Vec<u8>>,
    /// S2: 0 when the controller is not to answer.
    pub seqnum: u32,
    pub dhv: Vec<u8>,
}

/// DH-HMAC-CHAP_Success1 (controller to host), with the controller's response if asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Success1 {
    pub t_id: u16,
    pub hl: u8,
    pub rval: Option<Vec<u8>>,
}

/// A decoded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Negotiate(Negotiate),
    Challenge(Challenge),
    Reply(Reply),
    Success1(Success1),
    Success2 { t_id: u16 },
    Failure1 { t_id: u16, reason: Reason },
    Failure2 { t_id: u16, reason: Reason },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl Message {
    /// The transaction it belongs to.
    pub fn t_id(&self) -> u16 {
        match self {
            Message::Negotiate(m) => m.t_id,
            Message::Challenge(m) => m.t_id,
            Message::Reply(m) => m.t_id,
            Message::Success1(m) => m.t_id,
            Message::Success2 { t_id }
            | Message::Failure1 { t_id, .. }
            | Message::Failure2 { t_id, .. } => *t_id,
        }
    }

    pub fn decode(b: &[u8]) -> Result<Message, Reason> {
        if b.len() < 8 {
            return Err(Reason::IncorrectPayload);
        }
        let t_id = u16_at(b, 4);
        match (b[0], b[1]) {
            (COMMON, id::NEGOTIATE) => negotiate(b).map(Message::Negotiate),
            (COMMON, id::FAILURE1 | id::FAILURE2) => {
                let reason = Reason::from_code(b.get(7).copied().unwrap_or(1));
                Ok(if b[1] == id::FAILURE1 {
                    Message::Failure1 { t_id, reason }
                } else {
                    Message::Failure2 { t_id, reason }
                })
            }
            (DHCHAP, _) if b.len() < HEADER => Err(Reason::IncorrectPayload),
            (DHCHAP, id::CHALLENGE) => challenge(b).map(Message::Challenge),
            (DHCHAP, id::REPLY) => reply(b).map(Message::Reply),
            (DHCHAP, id::SUCCESS1) => success1(b).map(Message::Success1),
            (DHCHAP, id::SUCCESS2) => Ok(Message::Success2 { t_id }),
            _ => Err(Reason::IncorrectMessage),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Negotiate(m) => {
                let mut b = start(COMMON, id::NEGOTIATE, m.t_id, 8 + DESCRIPTOR_LEN);
                b[6] = m.sc_c;
                b[7] = 1; // NAPD: one protocol descriptor
                b[8] = AUTHID_DHCHAP;
                let hashes = &m.hashes[..m.hashes.len().min(IDS_MAX)];
                let groups = &m.groups[..m.groups.len().min(IDS_MAX)];
                b[10] = hashes.len() as u8;
                b[11] = groups.len() as u8;
                b[12..12 + hashes.len()].copy_from_slice(hashes);
                b[42..42 + groups.len()].copy_from_slice(groups);
                b
            }
            Message::Challenge(m) => {
                let mut b = start(DHCHAP, id::CHALLENGE, m.t_id, HEADER);
                b[6] = m.cval.len() as u8;
                b[8] = m.hash;
                b[9] = m.group;
                b[10..12].copy_from_slice(&(m.dhv.len() as u16).to_le_bytes());
                b[12..16].copy_from_slice(&m.seqnum.to_le_bytes());
                b.extend_from_slice(&m.cval);
                b.extend_from_slice(&m.dhv);
                b
            }
            Message::Reply(m) => {
                let hl = m.rval.len();
                let mut b = start(DHCHAP, id::REPLY, m.t_id, HEADER);
                b[6] = hl as u8;
                b[8] = u8::from(m.cval.is_some());
                b[10..12].copy_from_slice(&(m.dhv.len() as u16).to_le_bytes());
                b[12..16].copy_from_slice(&m.seqnum.to_le_bytes());
                b.extend_from_slice(&m.rval);
                match &m.cval {
                    Some(c) => b.extend_from_slice(c),
                    None => b.resize(b.len() + hl, 0),
                }
                b.extend_from_slice(&m.dhv);
                b
            }
            Message::Success1(m) => {
                let mut b = start(DHCHAP, id::SUCCESS1, m.t_id, HEADER);
                b[6] = m.hl;
                if let Some(r) = &m.rval {
                    b[8] = 1;
                    b.extend_from_slice(r);
                }
                b
            }
            Message::Success2 { t_id } => start(DHCHAP, id::SUCCESS2, *t_id, HEADER),
            Message::Failure1 { t_id, reason } | Message::Failure2 { t_id, reason } => {
                let which = match self {
                    Message::Failure1 { .. } => id::FAILURE1,
                    _ => id::FAILURE2,
                };
                let mut b = start(COMMON, which, *t_id, 8);
                b[6] = 0x01; // reason code: authentication failure
                b[7] = *reason as u8;
                b
            }
        }
    }
}

fn start(auth_type: u8, auth_id: u8, t_id: u16, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    b[0] = auth_type;
    b[1] = auth_id;
    b[4..6].copy_from_slice(&t_id.to_le_bytes());
    b
}

/// The first DH-HMAC-CHAP protocol descriptor of a negotiate message.
fn negotiate(b: &[u8]) -> Result<Negotiate, Reason> {
    let napd = usize::from(b[7]);
    if napd == 0 || b.len() < 8 + napd * DESCRIPTOR_LEN {
        return Err(Reason::IncorrectPayload);
    }
    let d = (0..napd)
        .map(|i| &b[8 + i * DESCRIPTOR_LEN..8 + (i + 1) * DESCRIPTOR_LEN])
        .find(|d| d[0] == AUTHID_DHCHAP)
        .ok_or(Reason::IncorrectPayload)?;
    let (halen, dhlen) = (usize::from(d[2]), usize::from(d[3]));
    if halen > IDS_MAX || dhlen > IDS_MAX {
        return Err(Reason::IncorrectPayload);
    }
    Ok(Negotiate {
        t_id: u16_at(b, 4),
        sc_c: b[6],
        hashes: d[4..4 + halen].to_vec(),
        groups: d[34..34 + dhlen].to_vec(),
    })
}

fn challenge(b: &[u8]) -> Result<Challenge, Reason> {
    let hl = usize::from(b[6]);
    let dhvlen = usize::from(u16_at(b, 10));
    let body = b
        .get(HEADER..HEADER + hl + dhvlen)
        .ok_or(Reason::IncorrectPayload)?;
    Ok(Challenge {
        t_id: u16_at(b, 4),
        hash: b[8],
        group: b[9],
        seqnum: u32_at(b, 12),
        cval: body[..hl].to_vec(),
        dhv: body[hl..].to_vec(),
    })
}

fn reply(b: &[u8]) -> Result<Reply, Reason> {
    let hl = usize::from(b[6]);
    let dhvlen = usize::from(u16_at(b, 10));
    let body = b
        .get(HEADER..HEADER + 2 * hl + dhvlen)
        .ok_or(Reason::IncorrectPayload)?;
    Ok(Reply {
        t_id: u16_at(b, 4),
        rval: body[..hl].to_vec(),
        cval: (b[8] & 1 != 0).then(|| body[hl..2 * hl].to_vec()),
        seqnum: u32_at(b, 12),
        dhv: body[2 * hl..].to_vec(),
    })
}

fn success1(b: &[u8]) -> Result<Success1, Reason> {
    let hl = b[6];
    let rval = if b[8] & 1 != 0 {
        Some(
            b.get(HEADER..HEADER + usize::from(hl))
                .ok_or(Reason::IncorrectPayload)?
                .to_vec(),
        )
    } else {
        None
    };
    Ok(Success1 {
        t_id: u16_at(b, 4),
        hl,
        rval,
    })
}
