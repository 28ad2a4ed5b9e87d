//! The controller's side of one queue's DH-HMAC-CHAP transaction: Authentication Send hands it
//! the host's messages, Authentication Receive takes its answers. The queue is authenticated
//! once the host's response verified (and, if the host asked, it accepted the controller's);
//! any failure is final for the queue. A new AUTH_Negotiate restarts the transaction (a host
//! re-authenticates that way), but each one abandoned midway is counted for the caller to
//! report as a failed login, and past [`ABANDONED_MAX`] the queue fails: a host that never
//! answers a challenge gets no more than that many DH exponentiations from one queue.

use subtle::ConstantTimeEq;

use super::dh::{DhGroup, Exchange};
use super::msg::{Challenge, Message, Negotiate, Reply, Success1};
use super::{augmented, controller_response, host_response, seqnum, HashId, Key, Parties};
use super::{Random, Reason};

/// Transactions a queue may abandon midway (a Negotiate before the last one ended) before it
/// fails: one, for a host that restarts after its own error.
pub const ABANDONED_MAX: u32 = 1;

/// What the controller offers, in its order of preference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub hashes: Vec<HashId>,
    pub groups: Vec<DhGroup>,
}

impl Default for Policy {
    /// SHA-256 first (every host has it); a DH group before none (it keeps an eavesdropper
    /// from guessing the secret offline), the smallest first (the cheapest). Not the 6144- and
    /// 8192-bit groups: each of their exponentiations takes 10-18 ms of a network worker
    /// (measured, docs/NVME.md), which a host could ask for before it proved anything.
    fn default() -> Policy {
        Policy {
            hashes: HashId::ALL.to_vec(),
            groups: vec![
                DhGroup::Ffdhe2048,
                DhGroup::Ffdhe3072,
                DhGroup::Ffdhe4096,
                DhGroup::Null,
            ],
        }
    }
}

/// The secrets a queue's host authenticates with: its own, and the controller's for a host
/// that authenticates the controller too.
#[derive(Clone, Debug)]
pub struct Keys {
    pub host: Key,
    pub controller: Option<Key>,
}

#[derive(Clone, Copy)]
struct Chosen {
    t_id: u16,
    hash: HashId,
    group: DhGroup,
}

enum Step {
    /// Waiting for AUTH_Negotiate.
    Negotiate,
    /// Negotiated: the challenge is the next Receive.
    Challenge(Chosen),
    /// Challenged: the reply is the next Send.
    Reply {
        chosen: Chosen,
        c1: Vec<u8>,
        s1: u32,
        exchange: Option<Exchange>,
    },
    /// Replied: Success1 is the next Receive (with the answer to the host's challenge).
    Success1 {
        chosen: Chosen,
        host_challenge: Option<(Vec<u8>, u32)>,
        session_key: Option<Vec<u8>>,
    },
    /// The controller answered the host's challenge: Success2 (or Failure2) is next.
    Success2 {
        t_id: u16,
    },
    /// The next Receive reports this failure.
    Failure1 {
        t_id: u16,
        reason: Reason,
    },
    Done,
}

/// One queue's authentication.
pub struct Transaction {
    keys: Keys,
    parties: Parties,
    policy: Policy,
    step: Step,
    authenticated: bool,
    failed: Option<Reason>,
    /// Transactions abandoned midway over the queue's life.
    abandoned: u32,
    /// Of those, the ones the caller has not yet taken ([`Transaction::take_abandoned`]).
    abandoned_untaken: u32,
}

impl Transaction {
    pub fn new(keys: Keys, parties: Parties, policy: Policy) -> Transaction {
        Transaction {
            keys,
            parties,
            policy,
            step: Step::Negotiate,
            authenticated: false,
            failed: None,
            abandoned: 0,
            abandoned_untaken: 0,
        }
    }

    /// Whether the queue may run commands other than authentication.
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// Why the transaction failed, once it did (final: the queue is to be closed).
    pub fn failed(&self) -> Option<Reason> {
        self.failed
    }

    /// Transactions abandoned midway since the last call: each is a failed login of its own,
    /// counted when it happens rather than when the queue closes.
    pub fn take_abandoned(&mut self) -> u32 {
        std::mem::take(&mut self.abandoned_untaken)
    }

    /// The hash and group a transaction settled on (for the log line).
    pub fn chosen(&self) -> Option<(HashId, DhGroup)> {
        match &self.step {
            Step::Challenge(c)
            | Step::Reply { chosen: c, .. }
            | Step::Success1 { chosen: c, .. } => Some((c.hash, c.group)),
            _ => None,
        }
    }

    /// Authentication Send: the host's message.
    pub fn send(&mut self, data: &[u8]) {
        let current = self.t_id();
        let message = match Message::decode(data) {
            Ok(m) => m,
            Err(reason) => return self.fail_next(current, reason),
        };
        match (message, std::mem::replace(&mut self.step, Step::Done)) {
            (Message::Negotiate(n), Step::Negotiate | Step::Done) => self.negotiate(&n),
            // A negotiate midway restarts the transaction, within the queue's allowance.
            (Message::Negotiate(n), _) => {
                self.abandoned += 1;
                self.abandoned_untaken += 1;
                if self.abandoned > ABANDONED_MAX {
                    self.fail_next(n.t_id, Reason::IncorrectMessage);
                } else {
                    self.negotiate(&n);
                }
            }
            (
                Message::Reply(r),
                Step::Reply {
                    chosen,
                    c1,
                    s1,
                    exchange,
                },
            ) => {
                if r.t_id != chosen.t_id {
                    return self.fail_next(chosen.t_id, Reason::IncorrectPayload);
                }
                match self.verify(&r, chosen, &c1, s1, exchange.as_ref()) {
                    Ok(step) => self.step = step,
                    Err(reason) => self.fail_next(chosen.t_id, reason),
                }
            }
            (Message::Success2 { t_id }, Step::Success2 { t_id: expected }) if t_id == expected => {
                self.authenticated = true;
            }
            (Message::Failure2 { reason, .. }, _) => self.fail_now(reason),
            (_, _) => self.fail_next(current, Reason::IncorrectMessage),
        }
    }

    /// Authentication Receive: the controller's next message.
    pub fn receive(&mut self, random: Random<'_>) -> Vec<u8> {
        match std::mem::replace(&mut self.step, Step::Done) {
            Step::Challenge(chosen) => self.challenge(chosen, random),
            Step::Success1 {
                chosen,
                host_challenge,
                session_key,
            } => self.success1(chosen, host_challenge, session_key.as_deref()),
            Step::Failure1 { t_id, reason } => {
                self.fail_now(reason);
                Message::Failure1 { t_id, reason }.encode()
            }
            _ => {
                let t_id = self.t_id();
                self.fail_now(Reason::IncorrectMessage);
                Message::Failure1 {
                    t_id,
                    reason: Reason::IncorrectMessage,
                }
                .encode()
            }
        }
    }

    fn t_id(&self) -> u16 {
        match &self.step {
            Step::Challenge(c)
            | Step::Reply { chosen: c, .. }
            | Step::Success1 { chosen: c, .. } => c.t_id,
            Step::Success2 { t_id } | Step::Failure1 { t_id, .. } => *t_id,
            Step::Negotiate | Step::Done => 0,
        }
    }

    /// The failure is reported by the next Receive.
    fn fail_next(&mut self, t_id: u16, reason: Reason) {
        self.step = Step::Failure1 { t_id, reason };
    }

    fn fail_now(&mut self, reason: Reason) {
        self.authenticated = false;
        self.failed = Some(reason);
        self.step = Step::Done;
    }

    fn negotiate(&mut self, n: &Negotiate) {
        if n.sc_c != 0 {
            return self.fail_next(n.t_id, Reason::ConcatMismatch);
        }
        let Some(hash) = self
            .policy
            .hashes
            .iter()
            .copied()
            .find(|h| n.hashes.contains(&h.id()))
        else {
            return self.fail_next(n.t_id, Reason::HashUnusable);
        };
        let Some(group) = self
            .policy
            .groups
            .iter()
            .copied()
            .find(|g| n.groups.contains(&g.id()))
        else {
            return self.fail_next(n.t_id, Reason::DhGroupUnusable);
        };
        self.step = Step::Challenge(Chosen {
            t_id: n.t_id,
            hash,
            group,
        });
    }

    fn challenge(&mut self, chosen: Chosen, random: Random<'_>) -> Vec<u8> {
        let mut c1 = vec![0u8; chosen.hash.digest_len()];
        random(&mut c1);
        let s1 = seqnum(random);
        let exchange = Exchange::new(chosen.group, random);
        let message = Message::Challenge(Challenge {
            t_id: chosen.t_id,
            hash: chosen.hash.id(),
            group: chosen.group.id(),
            seqnum: s1,
            cval: c1.clone(),
            dhv: exchange.as_ref().map(Exchange::public).unwrap_or_default(),
        });
        self.step = Step::Reply {
            chosen,
            c1,
            s1,
            exchange,
        };
        message.encode()
    }

    /// Checks the host's response; what comes next if it holds.
    fn verify(
        &mut self,
        r: &Reply,
        chosen: Chosen,
        c1: &[u8],
        s1: u32,
        exchange: Option<&Exchange>,
    ) -> Result<Step, Reason> {
        if r.rval.len() != chosen.hash.digest_len() {
            return Err(Reason::IncorrectPayload);
        }
        let session_key = match exchange {
            Some(x) => Some(x.shared(&r.dhv)?),
            None if r.dhv.is_empty() => None,
            None => return Err(Reason::IncorrectPayload),
        };
        let expected = host_response(
            chosen.hash,
            &self.keys.host,
            &self.parties,
            &augmented(chosen.hash, session_key.as_deref(), c1),
            s1,
            chosen.t_id,
        );
        if !bool::from(expected.ct_eq(&r.rval)) {
            return Err(Reason::Failed);
        }
        // S2 = 0 with a challenge only seeds a secure channel: no answer is owed.
        let host_challenge = r
            .cval
            .clone()
            .filter(|_| r.seqnum != 0)
            .map(|c| (c, r.seqnum));
        if host_challenge.is_some() && self.keys.controller.is_none() {
            return Err(Reason::Failed);
        }
        if host_challenge.is_none() {
            self.authenticated = true;
        }
        Ok(Step::Success1 {
            chosen,
            host_challenge,
            session_key,
        })
    }

    fn success1(
        &mut self,
        chosen: Chosen,
        host_challenge: Option<(Vec<u8>, u32)>,
        session_key: Option<&[u8]>,
    ) -> Vec<u8> {
        let rval = match (&host_challenge, &self.keys.controller) {
            (Some((c2, s2)), Some(key)) => Some(controller_response(
                chosen.hash,
                key,
                &self.parties,
                &augmented(chosen.hash, session_key, c2),
                *s2,
                chosen.t_id,
            )),
            _ => None,
        };
        self.step = if rval.is_some() {
            Step::Success2 { t_id: chosen.t_id }
        } else {
            Step::Done
        };
        Message::Success1(Success1 {
            t_id: chosen.t_id,
            hl: chosen.hash.digest_len() as u8,
            rval,
        })
        .encode()
    }
}
