//! The host's side of a queue's DH-HMAC-CHAP transaction (the initiator crate's, and the
//! tests'): negotiate, answer the challenge, and check the controller's answer when the host
//! holds the controller's key.

use subtle::ConstantTimeEq;

use super::dh::{DhGroup, Exchange};
use super::msg::{Message, Negotiate, Reply};
use super::{augmented, controller_response, host_response, seqnum, HashId, Key, Parties};
use super::{Random, Reason};

enum Step {
    Start,
    /// Replied: the controller's Success1 is next.
    Replied {
        hash: HashId,
        session_key: Option<Vec<u8>>,
        challenge: Option<(Vec<u8>, u32)>,
    },
    Done,
}

pub struct Transaction {
    host_key: Key,
    controller_key: Option<Key>,
    parties: Parties,
    t_id: u16,
    step: Step,
}

impl Transaction {
    /// `controller_key`: the controller must prove it holds it (bidirectional).
    pub fn new(
        host_key: Key,
        controller_key: Option<Key>,
        parties: Parties,
        t_id: u16,
    ) -> Transaction {
        Transaction {
            host_key,
            controller_key,
            parties,
            t_id,
            step: Step::Start,
        }
    }

    /// AUTH_Negotiate offering `hashes` and `groups`.
    pub fn negotiate(&self, hashes: &[HashId], groups: &[DhGroup]) -> Vec<u8> {
        Message::Negotiate(Negotiate {
            t_id: self.t_id,
            sc_c: 0,
            hashes: hashes.iter().map(|h| h.id()).collect(),
            groups: groups.iter().map(|g| g.id()).collect(),
        })
        .encode()
    }

    /// The reply to the controller's challenge (or why there is none: a Failure1, or a
    /// challenge this host cannot answer).
    pub fn reply(&mut self, received: &[u8], random: Random<'_>) -> Result<Vec<u8>, Reason> {
        let c = match Message::decode(received)? {
            Message::Challenge(c) if c.t_id == self.t_id => c,
            Message::Failure1 { reason, .. } => return Err(reason),
            _ => return Err(Reason::IncorrectMessage),
        };
        let hash = HashId::from_id(c.hash).ok_or(Reason::HashUnusable)?;
        let group = DhGroup::from_id(c.group).ok_or(Reason::DhGroupUnusable)?;
        if c.cval.len() != hash.digest_len() {
            return Err(Reason::IncorrectPayload);
        }
        let exchange = Exchange::new(group, random);
        let session_key = match &exchange {
            Some(x) => Some(x.shared(&c.dhv)?),
            None => None,
        };
        let rval = host_response(
            hash,
            &self.host_key,
            &self.parties,
            &augmented(hash, session_key.as_deref(), &c.cval),
            c.seqnum,
            self.t_id,
        );
        let challenge = self.controller_key.as_ref().map(|_| {
            let mut c2 = vec![0u8; hash.digest_len()];
            random(&mut c2);
            (c2, seqnum(random))
        });
        let reply = Message::Reply(Reply {
            t_id: self.t_id,
            rval,
            cval: challenge.as_ref().map(|(c, _)| c.clone()),
            seqnum: challenge.as_ref().map_or(0, |(_, s)| *s),
            dhv: exchange.as_ref().map(Exchange::public).unwrap_or_default(),
        });
        self.step = Step::Replied {
            hash,
            session_key,
            challenge,
        };
        Ok(reply.encode())
    }

    /// The controller's Success1: `Some(Success2)` to send when the host authenticated the
    /// controller, `None` when nothing more is owed; an error when the controller failed the
    /// host or its own response does not verify (send [`Transaction::failure2`] then).
    pub fn success1(&mut self, received: &[u8]) -> Result<Option<Vec<u8>>, Reason> {
        let Step::Replied {
            hash,
            session_key,
            challenge,
        } = std::mem::replace(&mut self.step, Step::Done)
        else {
            return Err(Reason::IncorrectMessage);
        };
        let s = match Message::decode(received)? {
            Message::Success1(s) if s.t_id == self.t_id => s,
            Message::Failure1 { reason, .. } => return Err(reason),
            _ => return Err(Reason::IncorrectMessage),
        };
        let (Some((c2, s2)), Some(key)) = (challenge, &self.controller_key) else {
            return Ok(None);
        };
        let expected = controller_response(
            hash,
            key,
            &self.parties,
            &augmented(hash, session_key.as_deref(), &c2),
            s2,
            self.t_id,
        );
        match s.rval {
            Some(r) if bool::from(expected.ct_eq(&r)) => {
                Ok(Some(Message::Success2 { t_id: self.t_id }.encode()))
            }
            _ => Err(Reason::Failed),
        }
    }

    /// AUTH_Failure2: the host rejects the controller.
    pub fn failure2(&self, reason: Reason) -> Vec<u8> {
        Message::Failure2 {
            t_id: self.t_id,
            reason,
        }
        .encode()
    }
}
