//! One NVMe/TCP queue, host side, sans I/O: connection initialization, command capsules (data
//! in the capsule up to the controller's in-capsule size, else sent on its R2T), and the
//! controller's C2HData and response capsules gathered into completions. For the initiator
//! crate's host and the tests; the controller side is [`crate::queue`].

use crate::pdu::{self, Accept, Fatal, PduType, Refusal, Transfer, CH_LEN};
use crate::queue::capsule_head;
use crate::sqe::{Cqe, Sqe, Status, CQE_LEN};

/// A command the controller answered: its completion and the data it returned.
#[derive(Debug, PartialEq, Eq)]
pub struct Done {
    pub cqe: Cqe,
    pub data: Vec<u8>,
}

/// A write's data as a host hands it over: its own bytes, or a shared buffer's first `len`
/// bytes, so a caller writing the same bytes many times (a benchmark's pattern) hands them
/// over without a copy per write.
#[derive(Clone, Debug)]
pub enum WriteData {
    Owned(Vec<u8>),
    Shared(std::sync::Arc<[u8]>, usize),
}

impl WriteData {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            WriteData::Owned(v) => v,
            WriteData::Shared(bytes, len) => &bytes[..(*len).min(bytes.len())],
        }
    }
}

impl From<Vec<u8>> for WriteData {
    fn from(v: Vec<u8>) -> WriteData {
        WriteData::Owned(v)
    }
}

/// Write data sent by reference instead of copied into the output
/// ([`HostQueue::splice_shared_data`]): `data[range]` goes out at byte `at` of the output,
/// before what follows it there.
#[derive(Clone, Debug)]
pub struct Spliced {
    pub at: usize,
    pub data: std::sync::Arc<[u8]>,
    pub range: std::ops::Range<usize>,
}

/// Appends `data[range]` to what a queue sends: by reference when `spliced` is on and the data
/// is shared, else copied into `out`; its data digest after it when `digest`.
fn put_data(
    spliced: &mut Option<Vec<Spliced>>,
    data: &WriteData,
    range: std::ops::Range<usize>,
    digest: bool,
    out: &mut Vec<u8>,
) {
    let bytes = data.as_slice().get(range.clone()).unwrap_or(&[]);
    match (spliced.as_mut(), data) {
        (Some(list), WriteData::Shared(shared, _)) if !bytes.is_empty() => list.push(Spliced {
            at: out.len(),
            data: std::sync::Arc::clone(shared),
            range,
        }),
        _ => out.extend_from_slice(bytes),
    }
    if digest {
        out.extend_from_slice(&pdu::digest(bytes).to_le_bytes());
    }
}

struct Outstanding {
    /// Data still to send on the controller's R2T.
    data_out: WriteData,
    data_in: Vec<u8>,
    data_in_len: usize,
    /// A C2HData PDU's data digest failed: the command completes with Data Transfer Error
    /// (as Linux's host does).
    digest_failed: bool,
}

/// The host side of a queue.
pub struct HostQueue {
    accept: Accept,
    maxh2cdata: u32,
    /// In-capsule data the controller takes (its IOCCSZ); 0 until the host learns it.
    pub in_capsule_max: u32,
    /// By command identifier: a deep queue's answers find theirs without a walk of the
    /// others.
    outstanding: std::collections::HashMap<u16, Outstanding>,
    /// Commands the controller completed with SUCCESS on their last C2HData PDU, without a
    /// response capsule (when this host disabled SQ flow control).
    pub successes_in_data: u64,
    /// While `Some`: shared write data sent by reference ([`HostQueue::splice_shared_data`]).
    spliced: Option<Vec<Spliced>>,
}

impl Default for HostQueue {
    fn default() -> Self {
        HostQueue::new()
    }
}

impl HostQueue {
    pub fn new() -> HostQueue {
        HostQueue {
            accept: Accept {
                controller: false,
                initialized: false,
                header_digest: false,
                data_digest: false,
                alignment: 0,
                data_max: 16 << 20,
            },
            maxh2cdata: 4096,
            in_capsule_max: 8192,
            outstanding: std::collections::HashMap::new(),
            successes_in_data: 0,
            spliced: None,
        }
    }

    /// From now on (`true`), shared write data ([`WriteData::Shared`]) is not copied into the
    /// output: each piece is listed in [`HostQueue::spliced`] with where it belongs, for a
    /// caller that sends the output and the pieces together (`writev`). A benchmark's host
    /// writing 1 MiB per command copied each write's data once more than it sent it.
    pub fn splice_shared_data(&mut self, on: bool) {
        match (on, &self.spliced) {
            (true, None) => self.spliced = Some(Vec::new()),
            (false, Some(list)) => {
                debug_assert!(list.is_empty(), "spliced data not sent before turning off");
                self.spliced = None;
            }
            _ => {}
        }
    }

    /// The write data listed, not copied, since the output was last emptied: the caller
    /// sends them in order with the output, then empties both ([`HostQueue::sent_spliced`]).
    pub fn spliced(&self) -> &[Spliced] {
        self.spliced.as_deref().unwrap_or(&[])
    }

    /// The output and what was spliced into it are sent.
    pub fn sent_spliced(&mut self) {
        if let Some(list) = self.spliced.as_mut() {
            list.clear();
        }
    }

    /// The ICReq that opens the connection, asking for these digests.
    pub fn icreq(&self, digests: (bool, bool), out: &mut Vec<u8>) {
        pdu::ICReq {
            hpda: 0,
            header_digest: digests.0,
            data_digest: digests.1,
            maxr2t: 0,
        }
        .encode(out);
    }

    pub fn initialized(&self) -> bool {
        self.accept.initialized
    }

    /// Commands sent and not yet answered.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Sends command `sqe` (its data pointer set here) with `data_out` to write and room for
    /// `data_in_len` bytes back.
    pub fn submit(
        &mut self,
        mut sqe: Sqe,
        data_out: impl Into<WriteData>,
        data_in_len: u32,
        out: &mut Vec<u8>,
    ) {
        let data_out = data_out.into();
        let cid = sqe.cid();
        let bytes = data_out.as_slice();
        let in_capsule = !bytes.is_empty() && bytes.len() <= self.in_capsule_max as usize;
        sqe.0[1] = (sqe.0[1] & 0x3F) | 0x40;
        sqe.0[24..40].fill(0);
        let len = if bytes.is_empty() {
            data_in_len
        } else {
            bytes.len() as u32
        };
        sqe.0[32..36].copy_from_slice(&len.to_le_bytes());
        sqe.0[39] = if in_capsule { 0x01 } else { 0x5A };
        let digests = (self.accept.header_digest, self.accept.data_digest);
        if in_capsule {
            let len = bytes.len();
            capsule_head(&sqe, len, digests, out);
            put_data(&mut self.spliced, &data_out, 0..len, digests.1, out);
        } else {
            capsule_head(&sqe, 0, digests, out);
        }
        let earlier = self.outstanding.insert(
            cid,
            Outstanding {
                data_out: if in_capsule {
                    WriteData::Owned(Vec::new())
                } else {
                    data_out
                },
                data_in: Vec::new(),
                data_in_len: data_in_len as usize,
                digest_failed: false,
            },
        );
        debug_assert!(earlier.is_none(), "command {cid} sent while outstanding");
    }

    /// Takes every whole PDU at the start of `buf`: completions go to `done`, H2CData
    /// answering R2Ts to `out`. Returns the bytes consumed.
    pub fn receive(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        done: &mut Vec<Done>,
    ) -> Result<usize, Fatal> {
        let mut used = 0;
        loop {
            let rest = &buf[used..];
            let Some(ch) = rest.get(..CH_LEN) else { break };
            let ch: [u8; CH_LEN] = ch.try_into().unwrap_or([0; CH_LEN]);
            let frame = pdu::frame(&ch, &self.accept).map_err(|r| r.status)?;
            let Some(whole) = rest.get(..frame.len) else {
                break;
            };
            self.take(&frame, whole, out, done).map_err(|r| r.status)?;
            used += frame.len;
        }
        Ok(used)
    }

    fn take(
        &mut self,
        frame: &pdu::Frame,
        whole: &[u8],
        out: &mut Vec<u8>,
        done: &mut Vec<Done>,
    ) -> Result<(), Refusal> {
        let bad = |field| Refusal {
            status: Fatal::InvalidHeaderField,
            field,
        };
        let header = &whole[..frame.hlen];
        if frame.header_digest {
            let at = frame.hlen;
            let d: [u8; pdu::DIGEST_LEN] = whole[at..at + pdu::DIGEST_LEN]
                .try_into()
                .unwrap_or([0; pdu::DIGEST_LEN]);
            if !pdu::header_digest_ok(header, &d) {
                return Err(Refusal {
                    status: Fatal::HeaderDigestError,
                    field: 0,
                });
            }
        }
        let data = &whole[frame.data_offset..frame.data_offset + frame.data_len];
        let data_ok = !frame.data_digest || {
            let at = frame.data_offset + frame.data_len;
            let d: [u8; pdu::DIGEST_LEN] = whole[at..at + pdu::DIGEST_LEN]
                .try_into()
                .unwrap_or([0; pdu::DIGEST_LEN]);
            pdu::digest(data) == u32::from_le_bytes(d)
        };
        match frame.pdu_type {
            PduType::ICResp => {
                let resp = pdu::ICResp::parse(header)?;
                self.accept.initialized = true;
                self.accept.header_digest = resp.header_digest;
                self.accept.data_digest = resp.data_digest;
                self.maxh2cdata = resp.maxh2cdata;
            }
            PduType::C2HData => {
                let t = Transfer::parse(header).ok_or(bad(8))?;
                let o = self.outstanding.get_mut(&t.cccid).ok_or(bad(8))?;
                if t.offset as usize != o.data_in.len()
                    || o.data_in.len() + data.len() > o.data_in_len
                {
                    return Err(Refusal {
                        status: Fatal::DataOutOfRange,
                        field: 12,
                    });
                }
                o.data_in.extend_from_slice(data);
                o.digest_failed |= !data_ok;
                if frame.flags & pdu::flags::SUCCESS != 0 {
                    // The command succeeded and no response capsule follows: only the last
                    // PDU may say so (Linux's host resets the connection otherwise).
                    if frame.flags & pdu::flags::LAST_PDU == 0 {
                        return Err(bad(1));
                    }
                    self.successes_in_data += 1;
                    let found = self.complete(Cqe::success_in_data(t.cccid), done);
                    debug_assert!(found, "the command was found above");
                }
            }
            PduType::R2T => {
                let t = Transfer::parse(header).ok_or(bad(8))?;
                self.send_data(t, out)?;
            }
            PduType::CapsuleResp => {
                let raw: [u8; CQE_LEN] = header[CH_LEN..CH_LEN + CQE_LEN]
                    .try_into()
                    .map_err(|_| bad(2))?;
                let cqe = Cqe::parse(&raw);
                if !self.complete(cqe, done) {
                    return Err(bad(12));
                }
            }
            PduType::C2HTermReq => {
                return Err(Refusal {
                    status: Fatal::SequenceError,
                    field: 0,
                })
            }
            _ => return Err(bad(0)),
        }
        Ok(())
    }

    /// Ends outstanding command `cqe.cid` with `cqe`, or with Data Transfer Error if a data
    /// digest of its answer failed. False if no such command is outstanding.
    fn complete(&mut self, cqe: Cqe, done: &mut Vec<Done>) -> bool {
        let Some(o) = self.outstanding.remove(&cqe.cid) else {
            return false;
        };
        let cqe = if o.digest_failed {
            Cqe {
                status: Status::DATA_TRANSFER_ERROR,
                ..cqe
            }
        } else {
            cqe
        };
        done.push(Done {
            cqe,
            data: o.data_in,
        });
        true
    }

    /// The data an R2T asks for, in H2CData PDUs of at most MAXH2CDATA.
    fn send_data(&mut self, t: Transfer, out: &mut Vec<u8>) -> Result<(), Refusal> {
        let o = self.outstanding.get(&t.cccid).ok_or(Refusal {
            status: Fatal::InvalidHeaderField,
            field: 8,
        })?;
        let start = t.offset as usize;
        let end = start.saturating_add(t.len as usize);
        if end > o.data_out.as_slice().len() {
            return Err(Refusal {
                status: Fatal::DataOutOfRange,
                field: 12,
            });
        }
        let digests = (self.accept.header_digest, self.accept.data_digest);
        let mut at = start;
        while at < end {
            let n = (end - at).min(self.maxh2cdata as usize);
            let part = Transfer {
                cccid: t.cccid,
                ttag: t.ttag,
                offset: at as u32,
                len: n as u32,
            };
            part.encode_h2c_header(at + n == end, digests, out);
            put_data(&mut self.spliced, &o.data_out, at..at + n, digests.1, out);
            at += n;
        }
        Ok(())
    }
}

/// Bytes of the next PDU a host must buffer before [`HostQueue::receive`] takes it.
pub fn next_len(buf: &[u8]) -> usize {
    match buf.get(..CH_LEN) {
        Some(ch) => (u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]) as usize).max(CH_LEN),
        None => CH_LEN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{Queue, QueueLimits};
    use crate::sqe::Status;

    /// A host and a controller queue joined back to back: what one sends the other takes.
    #[test]
    fn a_host_and_a_controller_queue_understand_each_other() {
        for digests in [(false, false), (true, true)] {
            let mut host = HostQueue::new();
            host.in_capsule_max = 4096;
            let mut ctrl = Queue::new(QueueLimits {
                maxh2cdata: 8192,
                in_capsule_max: 4096,
                transfer_max: 1 << 20,
                depth_max: 8,
                solicited_max: 1 << 20,
            });
            let (mut to_ctrl, mut to_host) = (Vec::new(), Vec::new());
            host.icreq(digests, &mut to_ctrl);
            let (mut ready, mut refused, mut done) = (Vec::new(), Vec::new(), Vec::new());
            ctrl.receive(&to_ctrl, &mut to_host, &mut ready, &mut refused)
                .unwrap();
            to_ctrl.clear();
            host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
            to_host.clear();
            assert!(host.initialized());
            // A 20 000-byte write goes on an R2T in H2CData; a small one in the capsule.
            let mut write = Sqe([0; 64]);
            write.0[0] = 0x01;
            write.0[2] = 1;
            let big: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
            host.submit(write, big.clone(), 0, &mut to_ctrl);
            write.0[2] = 2;
            host.submit(write, vec![9; 512], 0, &mut to_ctrl);
            ctrl.receive(&to_ctrl, &mut to_host, &mut ready, &mut refused)
                .unwrap();
            to_ctrl.clear();
            assert_eq!(ready.len(), 1, "the small write came whole");
            host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
            to_host.clear();
            ctrl.receive(&to_ctrl, &mut to_host, &mut ready, &mut refused)
                .unwrap();
            to_ctrl.clear();
            assert_eq!(ready.len(), 2);
            assert_eq!(
                ready[1].data,
                crate::queue::Data::Gathered(seam::DataOutBuf::Pooled(big))
            );
            assert!(refused.is_empty());
            // Answers: one with data (a read's), one without.
            let cqe = |cid| Cqe {
                dw0: 0,
                dw1: 0,
                sqhd: 0,
                sqid: 1,
                cid,
                status: Status::SUCCESS,
            };
            let mut read = Sqe([0; 64]);
            read.0[0] = 0x02;
            read.0[2] = 3;
            host.submit(read, Vec::new(), 4096, &mut to_ctrl);
            ctrl.receive(&to_ctrl, &mut to_host, &mut ready, &mut refused)
                .unwrap();
            ctrl.answer(&cqe(3), &[7; 4096], &mut to_host);
            ctrl.answer(&cqe(1), &[], &mut to_host);
            ctrl.answer(&cqe(2), &[], &mut to_host);
            let used = host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
            assert_eq!(used, to_host.len());
            assert_eq!(done.len(), 3);
            assert_eq!(done[0].data, vec![7; 4096]);
            assert_eq!(host.outstanding(), 0);
        }
    }

    /// The output with the spliced pieces put where they belong.
    fn joined(out: &[u8], spliced: &[Spliced]) -> Vec<u8> {
        let mut v = Vec::new();
        let mut at = 0;
        for s in spliced {
            v.extend_from_slice(&out[at..s.at]);
            v.extend_from_slice(&s.data[s.range.clone()]);
            at = s.at;
        }
        v.extend_from_slice(&out[at..]);
        v
    }

    /// Shared write data spliced rather than copied: the output with the pieces in their
    /// places is byte for byte what the copying host sends, in the capsule and on an R2T,
    /// with and without digests; owned data is still copied.
    #[test]
    fn spliced_write_data_makes_the_same_bytes_as_copied() {
        let shared: std::sync::Arc<[u8]> = (0..40_000u32).map(|i| (i % 239) as u8).collect();
        for digests in [(false, false), (true, true)] {
            let mut sent = Vec::new();
            for splice in [false, true] {
                let mut host = HostQueue::new();
                host.in_capsule_max = 4096;
                host.maxh2cdata = 8192;
                host.accept.header_digest = digests.0;
                host.accept.data_digest = digests.1;
                host.splice_shared_data(splice);
                let mut out = Vec::new();
                let mut write = Sqe([0; 64]);
                write.0[0] = 0x01;
                for (cid, data) in [
                    (1u8, WriteData::Shared(shared.clone(), 20_000)),
                    (2, WriteData::Shared(shared.clone(), 4096)),
                    (3, WriteData::Owned(vec![5; 512])),
                ] {
                    write.0[2] = cid;
                    host.submit(write, data, 0, &mut out);
                }
                let r2t = Transfer {
                    cccid: 1,
                    ttag: 7,
                    offset: 4096,
                    len: 15_904,
                };
                host.send_data(r2t, &mut out).unwrap();
                assert_eq!(host.spliced().is_empty(), !splice);
                if splice {
                    // The second write's in-capsule data and the two H2CData PDUs (8 KiB at
                    // most) of the first's R2T.
                    assert_eq!(host.spliced().len(), 3);
                }
                sent.push(joined(&out, host.spliced()));
                host.sent_spliced();
                assert!(host.spliced().is_empty());
            }
            assert_eq!(sent[0], sent[1], "digests {digests:?}");
        }
    }
}
