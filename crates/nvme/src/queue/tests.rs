use super::*;
use crate::pdu::ICReq;

const LIMITS: QueueLimits = QueueLimits {
    maxh2cdata: 8192,
    in_capsule_max: 8192,
    transfer_max: 1 << 20,
    depth_max: 4,
    solicited_max: 64 * 1024,
};

fn icreq(digests: (bool, bool)) -> Vec<u8> {
    let mut out = Vec::new();
    ICReq {
        hpda: 0,
        header_digest: digests.0,
        data_digest: digests.1,
        maxr2t: 0,
    }
    .encode(&mut out);
    out
}

/// An initialized queue with the given digests.
fn queue(digests: (bool, bool)) -> Queue {
    let mut q = Queue::new(LIMITS);
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let req = icreq(digests);
    assert_eq!(q.receive(&req, &mut out, &mut ready, &mut refused), Ok(128));
    let resp = pdu::ICResp::parse(&out).unwrap();
    assert_eq!((resp.header_digest, resp.data_digest), digests);
    assert_eq!(resp.maxh2cdata, LIMITS.maxh2cdata);
    assert!(q.initialized());
    q
}

fn sqe(op: u8, cid: u16, pointer: DataPointer) -> Sqe {
    let mut s = [0u8; SQE_LEN];
    s[0] = op;
    s[1] = 0x40;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4..8].copy_from_slice(&1u32.to_le_bytes());
    match pointer {
        DataPointer::InCapsule { offset, len } => {
            s[24..32].copy_from_slice(&offset.to_le_bytes());
            s[32..36].copy_from_slice(&len.to_le_bytes());
            s[39] = 0x01;
        }
        DataPointer::Transport { len } => {
            s[32..36].copy_from_slice(&len.to_le_bytes());
            s[39] = 0x5A;
        }
    }
    Sqe(s)
}

const WRITE: u8 = 0x01;
const READ: u8 = 0x02;

struct Turn {
    used: Result<usize, Fatal>,
    out: Vec<u8>,
    ready: Vec<Received>,
    refused: Vec<Refused>,
}

fn feed(q: &mut Queue, bytes: &[u8]) -> Turn {
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let used = q.receive(bytes, &mut out, &mut ready, &mut refused);
    Turn {
        used,
        out,
        ready,
        refused,
    }
}

fn r2ts(out: &[u8]) -> Vec<Transfer> {
    let mut v = Vec::new();
    let mut at = 0;
    while at < out.len() {
        assert_eq!(out[at], PduType::R2T as u8);
        let plen = u32::from_le_bytes(out[at + 4..at + 8].try_into().unwrap()) as usize;
        v.push(Transfer::parse(&out[at..at + 24]).unwrap());
        at += plen;
    }
    v
}

fn h2c(t: Transfer, last: bool, data: &[u8], digests: (bool, bool)) -> Vec<u8> {
    let mut out = Vec::new();
    t.encode_h2c_header(last, digests, &mut out);
    out.extend_from_slice(data);
    if digests.1 {
        out.extend_from_slice(&pdu::digest(data).to_le_bytes());
    }
    out
}

#[test]
fn a_command_before_connection_initialization_ends_the_connection() {
    let mut q = Queue::new(LIMITS);
    let mut cap = Vec::new();
    capsule(
        &sqe(READ, 1, DataPointer::Transport { len: 512 }),
        &[],
        (false, false),
        &mut cap,
    );
    let t = feed(&mut q, &cap);
    assert_eq!(t.used, Err(Fatal::SequenceError));
    assert_eq!(t.out[0], PduType::C2HTermReq as u8);
    // Nothing more is taken after a termination.
    assert_eq!(feed(&mut q, &icreq((false, false))).used, Ok(0));
}

#[test]
fn a_partial_pdu_waits_for_the_rest() {
    let mut q = Queue::new(LIMITS);
    let req = icreq((true, true));
    assert_eq!(q.next_len(&req[..4]), CH_LEN);
    assert_eq!(q.next_len(&req[..8]), 128);
    assert_eq!(feed(&mut q, &req[..100]).used, Ok(0));
    assert_eq!(feed(&mut q, &req).used, Ok(128));
}

#[test]
fn a_read_is_ready_at_once_and_its_answer_is_data_then_a_response() {
    for digests in [(false, false), (true, true)] {
        let mut q = queue(digests);
        let mut cap = Vec::new();
        capsule(
            &sqe(READ, 7, DataPointer::Transport { len: 4096 }),
            &[],
            digests,
            &mut cap,
        );
        let t = feed(&mut q, &cap);
        assert_eq!(t.used, Ok(cap.len()));
        assert_eq!(t.ready.len(), 1);
        assert_eq!(t.ready[0].data_in_len, 4096);
        assert_eq!(q.open(), 1);
        let mut out = Vec::new();
        let cqe = Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 1,
            cid: 7,
            status: Status::SUCCESS,
        };
        q.answer(&cqe, &[0xAB; 4096], &mut out);
        assert_eq!(q.open(), 0);
        assert_eq!(out[0], PduType::C2HData as u8);
        assert_ne!(out[1] & flags::LAST_PDU, 0);
        let hd = if digests.0 { 4 } else { 0 };
        let dd = if digests.1 { 4 } else { 0 };
        let data_at = 24 + hd;
        assert_eq!(&out[data_at..data_at + 4096], &[0xAB; 4096][..]);
        let resp = &out[data_at + 4096 + dd..];
        assert_eq!(resp[0], PduType::CapsuleResp as u8);
        assert_eq!(resp.len(), 24 + hd);
        if digests.1 {
            let d = u32::from_le_bytes(out[data_at + 4096..data_at + 4100].try_into().unwrap());
            assert_eq!(d, pdu::digest(&[0xAB; 4096]));
        }
    }
}

#[test]
fn in_capsule_data_comes_with_its_command() {
    let mut q = queue((false, true));
    let mut cap = Vec::new();
    let s = sqe(
        WRITE,
        3,
        DataPointer::InCapsule {
            offset: 0,
            len: 512,
        },
    );
    capsule(&s, &[5; 512], (false, true), &mut cap);
    let t = feed(&mut q, &cap);
    assert_eq!(t.used, Ok(cap.len()));
    // The data stays where it arrived: the capsule's data field, in the bytes received.
    let at = cap.len() - 4 - 512;
    assert_eq!(
        t.ready,
        vec![Received {
            sqe: s,
            data: Data::InCapsule(at..at + 512),
            data_in_len: 0
        }]
    );
    assert_eq!(t.ready[0].data(&cap), &[5; 512]);
    // A wrong length or offset in the descriptor is refused, not run.
    for (offset, len) in [(0, 511), (16, 512)] {
        let mut cap = Vec::new();
        capsule(
            &sqe(WRITE, 4, DataPointer::InCapsule { offset, len }),
            &[5; 512],
            (false, true),
            &mut cap,
        );
        let t = feed(&mut q, &cap);
        assert!(t.ready.is_empty());
        assert_eq!(
            t.refused,
            vec![Refused {
                cid: 4,
                status: Status::DATA_SGL_LENGTH_INVALID
            }]
        );
    }
    // A corrupted data digest: Transient Transport Error, the connection lives on.
    let mut cap = Vec::new();
    capsule(&s, &[5; 512], (false, true), &mut cap);
    let n = cap.len();
    cap[n - 1] ^= 1;
    let mut q = queue((false, true));
    let t = feed(&mut q, &cap);
    assert_eq!(t.used, Ok(n));
    assert_eq!(
        t.refused,
        vec![Refused {
            cid: 3,
            status: TRANSIENT_TRANSPORT_ERROR
        }]
    );
}

#[test]
fn a_write_is_solicited_with_one_r2t_and_ready_when_its_data_arrived() {
    let digests = (true, true);
    let mut q = queue(digests);
    let mut cap = Vec::new();
    let s = sqe(WRITE, 9, DataPointer::Transport { len: 20_000 });
    capsule(&s, &[], digests, &mut cap);
    let t = feed(&mut q, &cap);
    assert!(t.ready.is_empty());
    let r2t = r2ts(&t.out);
    assert_eq!(r2t.len(), 1);
    assert_eq!((r2t[0].cccid, r2t[0].offset, r2t[0].len), (9, 0, 20_000));
    let data: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
    let mut at = 0;
    let mut ready = Vec::new();
    while at < data.len() {
        let n = (data.len() - at).min(8192);
        let t = Transfer {
            cccid: 9,
            ttag: r2t[0].ttag,
            offset: at as u32,
            len: n as u32,
        };
        let pdu = h2c(t, at + n == data.len(), &data[at..at + n], digests);
        let turn = feed(&mut q, &pdu);
        assert_eq!(turn.used, Ok(pdu.len()));
        ready.extend(turn.ready);
        at += n;
    }
    assert_eq!(
        ready,
        vec![Received {
            sqe: s,
            data: Data::Gathered(seam::DataOutBuf::Pooled(data)),
            data_in_len: 0
        }]
    );
}

/// Memory a test places, marked so its use can be seen.
#[derive(Debug)]
struct Placed(Vec<u8>);

impl seam::DataOutMemory for Placed {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

#[test]
fn a_solicited_writes_data_lands_in_the_memory_placed_for_it() {
    let mut q = queue((false, false));
    let mut cap = Vec::new();
    // Two writes: memory is placed for the first only (the engine has none for the other).
    capsule(
        &sqe(WRITE, 1, DataPointer::Transport { len: 12_288 }),
        &[],
        (false, false),
        &mut cap,
    );
    capsule(
        &sqe(WRITE, 2, DataPointer::Transport { len: 4096 }),
        &[],
        (false, false),
        &mut cap,
    );
    let r2t = r2ts(&feed(&mut q, &cap).out);
    assert_eq!(r2t.len(), 2);
    let mut asked = Vec::new();
    q.place(&mut |sqe, len| {
        asked.push((sqe.cid(), len));
        (sqe.cid() == 1).then(|| seam::DataOutBuf::Engine(Box::new(Placed(vec![0xEE; len]))))
    });
    assert_eq!(asked, [(1, 12_288), (2, 4096)]);
    // Asked once: a second call finds nothing new.
    q.place(&mut |_, _| panic!("asked twice"));
    let data: Vec<u8> = (0..12_288u32).map(|i| (i % 251) as u8).collect();
    let mut ready = Vec::new();
    for (i, t) in r2t.iter().enumerate() {
        let len = t.len as usize;
        let mut at = 0;
        while at < len {
            let n = (len - at).min(8192);
            let part = Transfer {
                offset: at as u32,
                len: n as u32,
                ..*t
            };
            let bytes = if i == 0 {
                &data[at..at + n]
            } else {
                &data[..n]
            };
            ready.extend(feed(&mut q, &h2c(part, at + n == len, bytes, (false, false))).ready);
            at += n;
        }
    }
    assert_eq!(ready.len(), 2);
    match &ready[0].data {
        Data::Gathered(seam::DataOutBuf::Engine(m)) => {
            assert_eq!(m.bytes(), &data[..], "every byte where it was placed");
        }
        other => panic!("the first write's data is not in its placed memory: {other:?}"),
    }
    assert!(
        matches!(&ready[1].data, Data::Gathered(seam::DataOutBuf::Pooled(v)) if v[..] == data[..4096])
    );
}

#[test]
fn data_out_of_order_or_beyond_the_transfer_ends_the_connection() {
    let cases: [(u32, u32, bool, Fatal); 4] = [
        // Offset ahead of what arrived.
        (512, 512, false, Fatal::InvalidHeaderField),
        // Past the end of the transfer.
        (0, 8192, true, Fatal::DataOutOfRange),
        // The last PDU not flagged so.
        (0, 4096, false, Fatal::InvalidHeaderField),
        // Flagged last too early.
        (0, 512, true, Fatal::InvalidHeaderField),
    ];
    for (offset, len, last, fatal) in cases {
        let mut q = queue((false, false));
        let mut cap = Vec::new();
        capsule(
            &sqe(WRITE, 1, DataPointer::Transport { len: 4096 }),
            &[],
            (false, false),
            &mut cap,
        );
        let ttag = r2ts(&feed(&mut q, &cap).out)[0].ttag;
        let t = Transfer {
            cccid: 1,
            ttag,
            offset,
            len,
        };
        let turn = feed(
            &mut q,
            &h2c(t, last, &vec![0; len as usize], (false, false)),
        );
        assert_eq!(turn.used, Err(fatal), "{offset} {len} {last}");
        assert_eq!(turn.out[0], PduType::C2HTermReq as u8);
    }
    // Data for a transfer nobody asked for.
    let mut q = queue((false, false));
    let t = Transfer {
        cccid: 1,
        ttag: 0,
        offset: 0,
        len: 512,
    };
    assert_eq!(
        feed(&mut q, &h2c(t, true, &[0; 512], (false, false))).used,
        Err(Fatal::InvalidHeaderField)
    );
}

#[test]
fn a_bad_data_digest_in_h2c_data_fails_only_its_command() {
    let mut q = queue((false, true));
    let mut cap = Vec::new();
    capsule(
        &sqe(WRITE, 2, DataPointer::Transport { len: 8192 }),
        &[],
        (false, true),
        &mut cap,
    );
    let ttag = r2ts(&feed(&mut q, &cap).out)[0].ttag;
    let first = Transfer {
        cccid: 2,
        ttag,
        offset: 0,
        len: 4096,
    };
    let mut pdu = h2c(first, false, &[1; 4096], (false, true));
    let n = pdu.len();
    pdu[n - 1] ^= 0xFF;
    assert!(feed(&mut q, &pdu).refused.is_empty());
    let second = Transfer {
        cccid: 2,
        ttag,
        offset: 4096,
        len: 4096,
    };
    let t = feed(&mut q, &h2c(second, true, &[1; 4096], (false, true)));
    assert!(t.ready.is_empty());
    assert_eq!(
        t.refused,
        vec![Refused {
            cid: 2,
            status: TRANSIENT_TRANSPORT_ERROR
        }]
    );
}

/// Capsules of writes `cids`, each of `len` bytes the transport solicits.
fn transport_writes(cids: &[u16], len: u32) -> Vec<u8> {
    let mut cap = Vec::new();
    for &cid in cids {
        let s = sqe(WRITE, cid, DataPointer::Transport { len });
        capsule(&s, &[], (false, false), &mut cap);
    }
    cap
}

#[test]
fn writes_beyond_the_solicited_bound_wait_for_their_r2t() {
    let mut q = queue((false, false));
    // Two 48 KiB writes: the bound (64 KiB) lets one be solicited at a time.
    let cap = transport_writes(&[1, 2], 48 * 1024);
    let t = feed(&mut q, &cap);
    let first = r2ts(&t.out);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].cccid, 1);
    let mut got = Vec::new();
    for at in (0..48 * 1024).step_by(8192) {
        let t = Transfer {
            cccid: 1,
            ttag: first[0].ttag,
            offset: at,
            len: 8192,
        };
        let turn = feed(
            &mut q,
            &h2c(t, at + 8192 == 48 * 1024, &[0; 8192], (false, false)),
        );
        got.extend(r2ts(&turn.out));
    }
    // The first one's data arrived: the second is solicited.
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].cccid, 2);
}

#[test]
fn a_command_identifier_in_use_or_a_full_queue_is_refused_not_run() {
    let mut q = queue((false, false));
    let mut cap = Vec::new();
    for cid in [1, 1, 2, 3, 4, 5] {
        capsule(
            &sqe(READ, cid, DataPointer::Transport { len: 512 }),
            &[],
            (false, false),
            &mut cap,
        );
    }
    let t = feed(&mut q, &cap);
    assert_eq!(
        t.ready.iter().map(|r| r.sqe.cid()).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert_eq!(
        t.refused,
        vec![
            Refused {
                cid: 1,
                status: Status::COMMAND_ID_CONFLICT
            },
            Refused {
                cid: 5,
                status: QUEUE_FULL
            },
        ]
    );
    // A longer transfer than MDTS is refused too.
    let mut q = queue((false, false));
    let mut cap = Vec::new();
    capsule(
        &sqe(
            READ,
            1,
            DataPointer::Transport {
                len: (1 << 20) + 512,
            },
        ),
        &[],
        (false, false),
        &mut cap,
    );
    assert_eq!(
        feed(&mut q, &cap).refused,
        vec![Refused {
            cid: 1,
            status: Status::DATA_SGL_LENGTH_INVALID
        }]
    );
}

#[test]
fn a_corrupt_header_digest_ends_the_connection() {
    let mut q = queue((true, false));
    let mut cap = Vec::new();
    capsule(
        &sqe(READ, 1, DataPointer::Transport { len: 512 }),
        &[],
        (true, false),
        &mut cap,
    );
    cap[20] ^= 1;
    let t = feed(&mut q, &cap);
    assert_eq!(t.used, Err(Fatal::HeaderDigestError));
}

#[test]
fn an_answer_in_parts_reaches_the_host_whole_across_pdus_and_digests() {
    use crate::host::HostQueue;
    for digests in [(false, false), (true, true)] {
        let mut q = Queue::new(QueueLimits {
            transfer_max: 2 << 20,
            ..LIMITS
        });
        let mut host = HostQueue::new();
        let (mut to_ctrl, mut to_host) = (Vec::new(), Vec::new());
        host.icreq(digests, &mut to_ctrl);
        feed_into(&mut q, &to_ctrl, &mut to_host);
        let mut done = Vec::new();
        host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
        assert!(host.initialized());
        // Parts that straddle the 1 MiB C2HData bound, with an empty one among them.
        let parts: Vec<Vec<u8>> = vec![vec![1; 600 << 10], vec![], vec![2; 700 << 10], vec![3; 10]];
        let total: usize = parts.iter().map(Vec::len).sum();
        to_ctrl.clear();
        host.submit(
            sqe(READ, 5, DataPointer::Transport { len: total as u32 }),
            Vec::new(),
            total as u32,
            &mut to_ctrl,
        );
        to_host.clear();
        let ready = feed_into(&mut q, &to_ctrl, &mut to_host);
        assert_eq!(ready.len(), 1);
        let cqe = Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 1,
            cid: 5,
            status: Status::SUCCESS,
        };
        let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        q.answer_parts(&cqe, &slices, &mut to_host);
        let used = host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
        assert_eq!(used, to_host.len());
        assert_eq!(done.len(), 1, "{digests:?}");
        // The host checks every digest: a wrong one would be Data Transfer Error.
        assert_eq!(done[0].cqe.status, Status::SUCCESS, "{digests:?}");
        assert_eq!(done[0].data, parts.concat(), "{digests:?}");
        // Two C2HData PDUs (the 1 MiB bound) and the response.
        let pdus = std::iter::successors(Some(0usize), |&at| {
            let plen = u32::from_le_bytes(to_host[at + 4..at + 8].try_into().unwrap());
            Some(at + plen as usize).filter(|&n| n < to_host.len())
        })
        .count();
        assert_eq!(pdus, 3, "{digests:?}");
        if digests.1 {
            // And the check can fail: one byte of data changed on the way.
            to_ctrl.clear();
            host.submit(
                sqe(READ, 6, DataPointer::Transport { len: total as u32 }),
                Vec::new(),
                total as u32,
                &mut to_ctrl,
            );
            to_host.clear();
            feed_into(&mut q, &to_ctrl, &mut to_host);
            q.answer_parts(&Cqe { cid: 6, ..cqe }, &slices, &mut to_host);
            to_host[100] ^= 1;
            done.clear();
            host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
            assert_eq!(done[0].cqe.status, Status::DATA_TRANSFER_ERROR);
        }
    }
}

/// A sink that sends data from where it lies: the bytes before each range are taken from
/// `out` as they come, and the range is recorded, not copied.
#[derive(Default)]
struct Referencing {
    len: usize,
    sent: Vec<Result<Vec<u8>, Range<usize>>>,
}

impl DataSink for Referencing {
    fn data_len(&self) -> usize {
        self.len
    }

    fn data(&mut self, out: &mut Vec<u8>, range: Range<usize>, digest: bool) -> u32 {
        self.sent.push(Ok(std::mem::take(out)));
        self.sent.push(Err(range.clone()));
        if digest {
            crc32c::crc32c(&vec![9; range.len()])
        } else {
            0
        }
    }
}

#[test]
fn data_sent_from_where_it_lies_is_the_copied_answer_byte_for_byte() {
    for digests in [(false, false), (true, false), (false, true), (true, true)] {
        let total = (1 << 20) + 4096;
        let data = vec![9u8; total];
        let cqe = Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 1,
            cid: 3,
            status: Status::SUCCESS,
        };
        let mut copied = Vec::new();
        queue(digests).answer(&cqe, &data, &mut copied);
        let mut sink = Referencing {
            len: total,
            ..Referencing::default()
        };
        let mut out = Vec::new();
        queue(digests).answer_with(&cqe, &mut sink, &mut out);
        // Two C2HData PDUs, each header taken before its data, in order.
        let ranges: Vec<_> = sink.sent.iter().filter_map(|p| p.clone().err()).collect();
        assert_eq!(ranges, [0..1 << 20, 1 << 20..total], "{digests:?}");
        let mut rebuilt = Vec::new();
        for part in sink.sent {
            match part {
                Ok(bytes) => rebuilt.extend_from_slice(&bytes),
                Err(range) => rebuilt.extend_from_slice(&data[range]),
            }
        }
        rebuilt.extend_from_slice(&out);
        assert_eq!(rebuilt, copied, "{digests:?}");
    }
}

#[test]
fn pieces_of_parts_cover_exactly_the_range() {
    let parts: [&[u8]; 4] = [b"abc", b"", b"defg", b"hi"];
    let mut seen = Vec::new();
    for_each_piece(&parts, 2..8, |p| seen.push(p.to_vec()));
    assert_eq!(seen, [b"c".to_vec(), b"defg".to_vec(), b"h".to_vec()]);
    seen.clear();
    for_each_piece(&parts, 3..3, |p| seen.push(p.to_vec()));
    assert!(seen.is_empty());
}

/// Feeds the controller queue `bytes` (whole PDUs), appending what it sends to `out`.
fn feed_into(q: &mut Queue, bytes: &[u8], out: &mut Vec<u8>) -> Vec<Received> {
    let (mut ready, mut refused) = (Vec::new(), Vec::new());
    let used = q.receive(bytes, out, &mut ready, &mut refused).unwrap();
    assert_eq!(used, bytes.len());
    assert!(refused.is_empty());
    ready
}

/// The PDU types in `bytes`, in order.
fn pdu_types(bytes: &[u8]) -> Vec<(u8, u8)> {
    let mut at = 0;
    let mut types = Vec::new();
    while at + 8 <= bytes.len() {
        types.push((bytes[at], bytes[at + 1]));
        at += u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    }
    types
}

#[test]
fn with_sq_flow_control_disabled_a_successful_read_ends_on_its_data() {
    use crate::host::HostQueue;
    const C2H: u8 = 0x07;
    const RESP: u8 = 0x05;
    let last_success = flags::LAST_PDU | flags::SUCCESS;
    for (disabled, digests) in [(false, false), (true, false), (true, true)] {
        let mut q = Queue::new(LIMITS);
        assert!(q.sq_flow_control());
        if disabled {
            q.disable_sq_flow_control();
        }
        assert_eq!(q.sq_flow_control(), !disabled);
        let mut host = HostQueue::new();
        let (mut to_ctrl, mut to_host) = (Vec::new(), Vec::new());
        host.icreq((digests, digests), &mut to_ctrl);
        feed_into(&mut q, &to_ctrl, &mut to_host);
        let mut done = Vec::new();
        host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
        let (hd, dd) = if digests {
            (flags::HDGSTF, flags::DDGSTF)
        } else {
            (0, 0)
        };
        let ok = |cid, dw0| Cqe {
            dw0,
            dw1: 0,
            sqhd: 0,
            sqid: 1,
            cid,
            status: Status::SUCCESS,
        };
        // Three reads: one succeeds, one fails, one succeeds with something in dword 0.
        to_ctrl.clear();
        for cid in 1..=3 {
            let len = DataPointer::Transport { len: 4096 };
            host.submit(sqe(READ, cid, len), Vec::new(), 4096, &mut to_ctrl);
        }
        to_host.clear();
        assert_eq!(feed_into(&mut q, &to_ctrl, &mut to_host).len(), 3);
        let failed = Cqe {
            status: Status::LBA_OUT_OF_RANGE,
            ..ok(2, 0)
        };
        for (cqe, data) in [
            (ok(1, 0), &[5u8; 4096][..]),
            (failed, &[]),
            (ok(3, 7), &[6; 4096]),
        ] {
            to_host.clear();
            q.answer(&cqe, data, &mut to_host);
            let types = pdu_types(&to_host);
            let ends_on_data = disabled && cqe.cid == 1;
            let expected = match (cqe.cid, ends_on_data) {
                (2, _) => vec![(RESP, hd)],
                (_, true) => vec![(C2H, last_success | hd | dd)],
                _ => vec![(C2H, flags::LAST_PDU | hd | dd), (RESP, hd)],
            };
            let what = format!("disabled {disabled}, digests {digests}, cid {}", cqe.cid);
            assert_eq!(types, expected, "{what}");
            done.clear();
            let used = host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
            assert_eq!(used, to_host.len());
            assert_eq!(done.len(), 1);
            assert_eq!(done[0].cqe.cid, cqe.cid);
            assert_eq!(done[0].cqe.status, cqe.status);
            assert_eq!(done[0].cqe.dw0, cqe.dw0);
            assert_eq!(done[0].data, data);
        }
        assert_eq!(host.successes_in_data, u64::from(disabled));
        assert_eq!(host.outstanding(), 0);
        assert_eq!(q.open(), 0);
    }
}

#[test]
fn a_host_refuses_success_on_a_data_pdu_that_is_not_the_last() {
    use crate::host::HostQueue;
    let mut q = Queue::new(LIMITS);
    let mut host = HostQueue::new();
    let (mut to_ctrl, mut to_host) = (Vec::new(), Vec::new());
    host.icreq((false, false), &mut to_ctrl);
    feed_into(&mut q, &to_ctrl, &mut to_host);
    let mut done = Vec::new();
    host.receive(&to_host, &mut to_ctrl, &mut done).unwrap();
    to_ctrl.clear();
    let len = DataPointer::Transport { len: 8192 };
    host.submit(sqe(READ, 1, len), Vec::new(), 8192, &mut to_ctrl);
    to_host.clear();
    Transfer {
        cccid: 1,
        ttag: 0,
        offset: 0,
        len: 4096,
    }
    .encode_c2h_header(flags::SUCCESS, (false, false), &mut to_host);
    to_host.extend_from_slice(&[1; 4096]);
    assert_eq!(
        host.receive(&to_host, &mut to_ctrl, &mut done),
        Err(Fatal::InvalidHeaderField)
    );
    assert!(done.is_empty());
}

#[test]
fn the_sq_head_walks_the_hosts_ring_and_is_ffffh_without_flow_control() {
    let mut q = Queue::new(LIMITS);
    // Before a Connect: a ring of one entry.
    assert_eq!(q.next_sqhd(), 0);
    q.connected(3, false);
    let heads: Vec<u16> = (0..9).map(|_| q.next_sqhd()).collect();
    assert_eq!(heads, [1, 2, 3, 0, 1, 2, 3, 0, 1]);
    let mut q = Queue::new(LIMITS);
    q.connected(31, true);
    assert!(!q.sq_flow_control());
    assert_eq!(q.next_sqhd(), crate::sqe::SQHD_DISABLED);
    assert_eq!(q.next_sqhd(), crate::sqe::SQHD_DISABLED);
}

/// Solicits a write of `len` bytes as command `cid` on a queue without digests; returns its
/// R2T.
fn solicited(q: &mut Queue, cid: u16, len: u32) -> Transfer {
    solicited_with(q, cid, len, (false, false))
}

fn solicited_with(q: &mut Queue, cid: u16, len: u32, digests: (bool, bool)) -> Transfer {
    let mut cap = Vec::new();
    capsule(
        &sqe(WRITE, cid, DataPointer::Transport { len }),
        &[],
        digests,
        &mut cap,
    );
    let r2t = r2ts(&feed(q, &cap).out);
    assert_eq!(r2t.len(), 1);
    r2t[0]
}

#[test]
fn h2c_data_received_in_place_lands_in_placed_memory_and_readies_its_write() {
    let mut q = queue((false, false));
    let r2t = solicited(&mut q, 3, 16_384);
    q.place(&mut |_, len| Some(seam::DataOutBuf::Engine(Box::new(Placed(vec![0; len])))));
    assert!(q.awaits_data(16_384) && !q.awaits_data(16_385));
    let data: Vec<u8> = (0..16_384u32).map(|i| (i % 253) as u8).collect();
    let mut ready = Vec::new();
    for (at, last) in [(0usize, false), (8192, true)] {
        let part = Transfer {
            offset: at as u32,
            len: 8192,
            ..r2t
        };
        let pdu = h2c(part, last, &data[at..at + 8192], (false, false));
        // Only the header and the first bytes have arrived.
        let h2c = q.placed_h2c(&pdu[..100], 8192).expect("taken in place");
        assert_eq!((h2c.header_len(), h2c.data_len()), (24, 8192));
        assert!(
            q.placed_h2c(&pdu[..100], 8193).is_none(),
            "shorter than asked"
        );
        let dst = q
            .placed_data(&h2c, |_| panic!("memory was placed"))
            .unwrap();
        assert_eq!(dst.len(), 8192);
        dst.copy_from_slice(&pdu[24..]);
        let mut out = Vec::new();
        let mut refused = Vec::new();
        q.receive_placed(&h2c, &mut out, &mut ready, &mut refused)
            .unwrap();
        assert!(refused.is_empty() && out.is_empty());
        assert_eq!(ready.is_empty(), !last, "ready with its last byte only");
    }
    assert!(!q.awaits_data(1));
    let [r] = &ready[..] else { panic!("{ready:?}") };
    let Data::Gathered(seam::DataOutBuf::Engine(m)) = &r.data else {
        panic!("not in placed memory: {r:?}")
    };
    assert_eq!(m.bytes(), &data[..]);
}

/// A write whose data lands in a recycled buffer of the connection's (old bytes in it) runs
/// with exactly the host's bytes, whether its parts come in place or the usual way; one
/// aborted before all came never runs; placed memory is not replaced by a recycled buffer.
#[test]
fn a_recycled_buffer_taken_for_a_write_holds_only_the_hosts_bytes_when_it_runs() {
    let mut q = queue((false, false));
    let first = solicited(&mut q, 3, 16_384);
    let second = solicited(&mut q, 4, 8192);
    // Nothing placed at the R2Ts: the first data takes a recycled buffer.
    q.place(&mut |_, _| None);
    let data: Vec<u8> = (0..16_384u32).map(|i| (i % 241) as u8).collect();
    let part = |offset| Transfer {
        offset,
        len: 8192,
        ..first
    };
    // The first part in place, the second the usual way.
    let pdu = h2c(part(0), false, &data[..8192], (false, false));
    let h = q.placed_h2c(&pdu, 1).expect("taken in place");
    q.placed_data(&h, |len| vec![0xEE; len])
        .unwrap()
        .copy_from_slice(&pdu[24..]);
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    q.receive_placed(&h, &mut out, &mut ready, &mut refused)
        .unwrap();
    assert!(ready.is_empty(), "not ready before its last byte");
    ready.extend(
        feed(
            &mut q,
            &h2c(part(8192), true, &data[8192..], (false, false)),
        )
        .ready,
    );
    let [r] = &ready[..] else { panic!("{ready:?}") };
    let Data::Gathered(seam::DataOutBuf::Pooled(v)) = &r.data else {
        panic!("not in its recycled buffer: {r:?}")
    };
    assert_eq!(v[..], data[..], "every old byte overwritten");
    // The second write aborted after half of its data: refused, never ready.
    let half = Transfer {
        len: 4096,
        ..second
    };
    assert!(feed(&mut q, &h2c(half, false, &[1; 4096], (false, false)))
        .ready
        .is_empty());
    assert_eq!(q.abort(4), Aborting::OnArrival);
    let rest = Transfer {
        offset: 4096,
        len: 4096,
        ..second
    };
    let t = feed(&mut q, &h2c(rest, true, &[1; 4096], (false, false)));
    assert!(t.ready.is_empty(), "an aborted write does not run");
    assert_eq!(t.refused.len(), 1);
}

#[test]
fn h2c_data_out_of_order_with_digests_or_for_no_write_takes_the_usual_way() {
    let mut q = queue((false, false));
    let r2t = solicited(&mut q, 4, 16_384);
    let part = |offset| Transfer {
        offset,
        len: 8192,
        ..r2t
    };
    let data = vec![1u8; 8192];
    // Not the next part: the usual way, which refuses it.
    assert!(q
        .placed_h2c(&h2c(part(8192), true, &data, (false, false)), 1)
        .is_none());
    // Another command's tag.
    let stray = Transfer {
        cccid: 99,
        ..part(0)
    };
    assert!(q
        .placed_h2c(&h2c(stray, false, &data, (false, false)), 1)
        .is_none());
    // A command capsule, or not yet a whole header.
    let pdu = h2c(part(0), false, &data, (false, false));
    assert!(q.placed_h2c(&pdu[..23], 1).is_none());
    // The queue's own buffer when nothing was placed and no recycled one came: grown to
    // hold the part.
    let h = q.placed_h2c(&pdu, 1).unwrap();
    assert_eq!(q.placed_data(&h, |_| Vec::new()).unwrap().len(), 8192);
    // With digests nothing is taken in place.
    let mut dq = queue((true, true));
    let r2t = solicited_with(&mut dq, 5, 8192, (true, true));
    assert!(!dq.awaits_data(1));
    assert!(dq
        .placed_h2c(&h2c(r2t, true, &data, (true, true)), 1)
        .is_none());
}

#[test]
fn a_placed_h2c_whose_last_flag_lies_ends_the_connection_as_the_usual_way_does() {
    let mut q = queue((false, false));
    let r2t = solicited(&mut q, 6, 8192);
    // All of the write's data, not marked last.
    let pdu = h2c(r2t, false, &[2u8; 8192], (false, false));
    let h = q.placed_h2c(&pdu, 1).unwrap();
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let fatal = q.receive_placed(&h, &mut out, &mut ready, &mut refused);
    assert_eq!(fatal, Err(Fatal::InvalidHeaderField));
    assert_eq!(
        out[0],
        PduType::C2HTermReq as u8,
        "a termination request to send"
    );
    assert!(ready.is_empty());
}

#[test]
fn the_queue_counts_capsules_and_data_pdus_apart() {
    let mut q = queue((false, false));
    assert_eq!(q.take_counts(), Taken::default());
    let r2t = solicited(&mut q, 7, 8192);
    let mut cap = Vec::new();
    capsule(
        &sqe(
            WRITE,
            8,
            DataPointer::InCapsule {
                offset: 0,
                len: 4096,
            },
        ),
        &[7; 4096],
        (false, false),
        &mut cap,
    );
    feed(&mut q, &cap);
    feed(&mut q, &h2c(r2t, true, &[1; 8192], (false, false)));
    let taken = q.take_counts();
    assert_eq!((taken.capsules, taken.data_pdus), (2, 1));
    assert_eq!(
        taken.capsule_bytes,
        (72 + 72 + 4096) as u64,
        "headers and in-capsule data"
    );
    assert_eq!(q.take_counts(), Taken::default(), "taken once");
}

#[test]
fn an_abort_stops_a_write_still_waiting_for_its_data_and_nothing_else() {
    let mut q = queue((false, false));
    // Two 48 KiB writes: the first solicited, the second waiting for room (its R2T unsent).
    let mut cap = transport_writes(&[1, 2], 48 * 1024);
    capsule(
        &sqe(READ, 3, DataPointer::Transport { len: 512 }),
        &[],
        (false, false),
        &mut cap,
    );
    let t = feed(&mut q, &cap);
    let r2t = r2ts(&t.out)[0];
    assert_eq!(t.ready.len(), 1, "the read runs");
    // The read is past the transport; the waiting write is taken out; the solicited one
    // waits for the rest of its data.
    assert_eq!(q.abort(3), Aborting::NotWaiting);
    assert_eq!(q.abort(2), Aborting::Withdrawn);
    assert_eq!(q.abort(1), Aborting::OnArrival);
    assert_eq!(q.abort(9), Aborting::NotWaiting);
    let mut solicited = Vec::new();
    let mut answered = Vec::new();
    for at in (0..48 * 1024).step_by(8192) {
        let t = Transfer {
            offset: at,
            len: 8192,
            ..r2t
        };
        let turn = feed(
            &mut q,
            &h2c(t, at + 8192 == 48 * 1024, &[7; 8192], (false, false)),
        );
        assert!(turn.ready.is_empty(), "an aborted write never runs");
        solicited.extend(r2ts(&turn.out));
        answered.extend(turn.refused);
    }
    assert!(
        solicited.is_empty(),
        "the withdrawn write is never asked for its data"
    );
    assert_eq!(answered.len(), 1);
    assert_eq!(
        (answered[0].cid, answered[0].status),
        (1, Status::ABORTED_BY_REQUEST)
    );
}

/// The open commands' set holds a few inline, then moves them into its bitmap, and answers the
/// same either way.
#[test]
fn the_open_set_holds_a_few_inline_and_the_rest_in_its_bitmap() {
    let mut set = CidSet::new();
    let cids = [7u16, 65535, 0, 300, 9, 4096, 12];
    for (n, &cid) in cids.iter().enumerate() {
        set.insert(cid);
        assert_eq!(set.len(), n + 1);
        assert_eq!(
            set.bits.is_some(),
            n >= CidSet::INLINE,
            "after {} inserts",
            n + 1
        );
    }
    assert!(cids.iter().all(|&c| set.contains(c)));
    assert!(!set.contains(8) && !set.contains(65534));
    for &cid in &cids {
        set.remove(cid);
        assert!(!set.contains(cid));
    }
    set.remove(7);
    assert_eq!(set.len(), 0);
    // Inline only: a removal in the middle keeps the others.
    let mut small = CidSet::new();
    for cid in [1, 2, 3] {
        small.insert(cid);
    }
    small.remove(1);
    assert!(!small.contains(1) && small.contains(2) && small.contains(3));
    assert_eq!((small.len(), small.bits.is_none()), (2, true));
}
