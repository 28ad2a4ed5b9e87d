//! An NVMe/TCP controller queue (`nvme::queue::Queue`) fed arbitrary bytes in arbitrary pieces,
//! after a well-formed connection initialization or not: it never panics, never consumes more
//! than it was given, never hands out a command twice while it is open, and every command it
//! hands out carries exactly the data its SGL promised; answering them (the controller
//! translating each through `nvme::translate` and the admin decoder) never breaks the stream.
//! With SQ flow control disabled, a successful answer with data ends on a C2HData PDU with
//! SUCCESS and has no response capsule; with it on, SUCCESS never appears. The same stream with
//! H2CData received in place into recycled buffers of old bytes, as the engine does, hands out
//! the same commands with the same data.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::queue::{Queue, QueueLimits};
use nvme::sqe::{Cqe, Status};

#[derive(Arbitrary, Debug)]
struct Input {
    initialize: bool,
    no_sq_flow: bool,
    header_digest: bool,
    data_digest: bool,
    /// Where the byte stream is cut into reads.
    cuts: Vec<u16>,
    bytes: Vec<u8>,
    /// After `bytes`: a host's writes (sent on R2Ts when longer than 4 KiB), arbitrary bytes
    /// between them, and reads of what is sent so far.
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// The host writes `blocks` 512-byte blocks (at most 64 KiB) of bytes from `seed`.
    Write {
        blocks: u8,
        seed: u8,
    },
    Bytes(Vec<u8>),
    /// The queue reads what is sent so far; the host takes its answers (and R2Ts).
    Read,
}

fuzz_target!(|input: Input| {
    let usual = run(&input, false);
    let placed = run(&input, true);
    // The same stream taken the usual way and with H2CData received in place into recycled
    // buffers full of old bytes: the commands handed out, in order, carry the same data (as far
    // as both went: a queue may end the stream at a different PDU).
    let n = usual.len().min(placed.len());
    assert_eq!(usual[..n], placed[..n], "data received in place differs");
});

/// Old bytes in a recycled buffer: none of them may reach a command.
const STALE: u8 = 0xA5;

/// Feeds the input's stream to a queue in the input's pieces, answering every command it hands
/// out, and returns each command's identifier and data in the order handed out. With `placed`,
/// an H2CData PDU the queue would take in place (`Queue::placed_h2c`) whose data is all
/// buffered is put into `Queue::placed_data`'s memory, a recycled buffer of stale bytes, as the
/// engine does.
fn run(input: &Input, placed: bool) -> Vec<(u16, Vec<u8>)> {
    let mut q = Queue::new(QueueLimits {
        maxh2cdata: 8192,
        in_capsule_max: 4096,
        transfer_max: 64 * 1024,
        depth_max: 16,
        solicited_max: 32 * 1024,
    });
    if input.no_sq_flow {
        q.disable_sq_flow_control();
    }
    // The host: a real host queue (initialized only when the stream is), whose bytes go to
    // the stream after the arbitrary ones; it stops when an answer makes no sense to it (a
    // command the arbitrary bytes sent).
    let mut host = nvme::host::HostQueue::new();
    host.in_capsule_max = 4096;
    let mut host_alive = input.initialize;
    let mut stream = Vec::new();
    if input.initialize {
        host.icreq((input.header_digest, input.data_digest), &mut stream);
    }
    stream.extend_from_slice(&input.bytes);
    let mut handed = Vec::new();
    let mut fed = Fed::default();
    let mut cuts = input.cuts.iter();
    let mut next_cid = 0u16;
    for step in input.steps.iter().map(Some).chain([None, None, None]) {
        match step {
            Some(Step::Write { blocks, seed }) if host_alive => {
                let blocks = u32::from(*blocks).clamp(1, 128);
                let data: Vec<u8> = (0..blocks * 512).map(|i| (i as u8) ^ seed).collect();
                let mut sqe = nvme::sqe::Sqe([0; 64]);
                sqe.0[0] = nvme::nvm::opcode::WRITE;
                sqe.0[2..4].copy_from_slice(&next_cid.to_le_bytes());
                sqe.0[4..8].copy_from_slice(&1u32.to_le_bytes());
                sqe.0[48..52].copy_from_slice(&(blocks - 1).to_le_bytes());
                next_cid = next_cid.wrapping_add(1);
                host.submit(sqe, data, 0, &mut stream);
            }
            Some(Step::Bytes(bytes)) => stream.extend_from_slice(bytes),
            Some(Step::Write { .. }) => {}
            // A read, and after the last step reads of whatever the host still sends.
            Some(Step::Read) | None => {
                let ended = feed(
                    &mut q,
                    &mut fed,
                    &mut stream,
                    &mut cuts,
                    placed,
                    input,
                    &mut handed,
                );
                if ended {
                    return handed;
                }
                if host_alive {
                    let mut done = Vec::new();
                    let mut answers = std::mem::take(&mut fed.answers);
                    match host.receive(&answers, &mut stream, &mut done) {
                        Ok(used) => {
                            answers.drain(..used);
                        }
                        Err(_) => host_alive = false,
                    }
                    fed.answers = answers;
                }
            }
        }
    }
    handed
}

/// What the queue was fed and has not consumed, and what it sent that the host has not taken.
#[derive(Default)]
struct Fed {
    buffered: Vec<u8>,
    answers: Vec<u8>,
}

/// Feeds all of `stream` to the queue in the input's pieces, answering every command it hands
/// out (into `handed`: identifier and data). True when the queue ended the stream.
fn feed<'a>(
    q: &mut Queue,
    fed: &mut Fed,
    stream: &mut Vec<u8>,
    cuts: &mut impl Iterator<Item = &'a u16>,
    placed: bool,
    input: &Input,
    handed: &mut Vec<(u16, Vec<u8>)>,
) -> bool {
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let buffered = &mut fed.buffered;
    let mut at = 0;
    while at < stream.len() {
        let n = cuts
            .next()
            .map_or(stream.len() - at, |&c| usize::from(c).max(1));
        let end = (at + n).min(stream.len());
        buffered.extend_from_slice(&stream[at..end]);
        at = end;
        let mut placed_ready = Vec::new();
        if placed && !take_in_place(q, buffered, &mut out, &mut placed_ready, &mut refused) {
            return true;
        }
        let used = match q.receive(buffered, &mut out, &mut ready, &mut refused) {
            Ok(used) => used,
            Err(_) => return true,
        };
        assert!(used <= buffered.len());
        // In-capsule data is a range of what was received, within what was consumed.
        let taken: Vec<_> = placed_ready
            .into_iter()
            .chain(ready.drain(..).map(|r| {
                if let nvme::queue::Data::InCapsule(range) = &r.data {
                    assert!(range.end <= used, "in-capsule data outside the PDUs taken");
                }
                r.into_owned(buffered)
            }))
            .collect();
        buffered.drain(..used);
        let mut open: Vec<u16> = Vec::new();
        for r in taken {
            assert!(
                !open.contains(&r.sqe.cid()),
                "a command handed out twice at once"
            );
            open.push(r.sqe.cid());
            handed.push((r.sqe.cid(), r.data(&[]).to_vec()));
            answer(q, &r, input.no_sq_flow, &mut out);
        }
        for r in refused.drain(..) {
            let cqe = Cqe {
                dw0: 0,
                dw1: 0,
                sqhd: 0,
                sqid: 1,
                cid: r.cid,
                status: r.status,
            };
            q.answer(&cqe, &[], &mut out);
        }
        fed.answers.append(&mut out);
    }
    stream.clear();
    false
}

/// Takes the H2CData PDUs at the start of `buffered` that the queue would receive in place and
/// that are all there, through `placed_data`'s recycled memory. False when the queue ended
/// the stream.
fn take_in_place(
    q: &mut Queue,
    buffered: &mut Vec<u8>,
    out: &mut Vec<u8>,
    ready: &mut Vec<nvme::queue::Received>,
    refused: &mut Vec<nvme::queue::Refused>,
) -> bool {
    while let Some(h) = q.placed_h2c(buffered, 1) {
        let total = h.header_len() + h.data_len();
        if buffered.len() < total {
            return true;
        }
        let dst = q
            .placed_data(&h, |len| vec![STALE; len])
            .expect("a PDU placed_h2c takes has a destination");
        assert_eq!(dst.len(), h.data_len());
        dst.copy_from_slice(&buffered[h.header_len()..total]);
        if q.receive_placed(&h, out, ready, refused).is_err() {
            return false;
        }
        buffered.drain(..total);
    }
    true
}

/// Answers command `r` with success (and as much data as it may take), checking the PDUs.
fn answer(q: &mut Queue, r: &nvme::queue::Received, no_sq_flow: bool, out: &mut Vec<u8>) {
    if let Ok(pointer) = r.sqe.data_pointer() {
        match pointer {
            nvme::sqe::DataPointer::InCapsule { len, .. } => {
                assert_eq!(r.data_len(), len as usize)
            }
            nvme::sqe::DataPointer::Transport { len } => {
                assert!(r.data_len() == 0 || r.data_len() == len as usize)
            }
        }
    }
    // Whatever the command says, translating or decoding it must not panic.
    if let Ok(c) = nvme::nvm::IoCommand::decode(&r.sqe) {
        let _ = nvme::translate::scsi_command(&c, r.data(&[]), 512);
    }
    let _ = nvme::admin::AdminCommand::decode(&r.sqe);
    let cqe = Cqe {
        dw0: 0,
        dw1: 0,
        sqhd: 0,
        sqid: 1,
        cid: r.sqe.cid(),
        status: Status::SUCCESS,
    };
    let data = vec![0u8; (r.data_in_len as usize).min(64 * 1024)];
    let start = out.len();
    q.answer(&cqe, &data, out);
    check_answer(&out[start..], r.sqe.cid(), !data.is_empty(), no_sq_flow);
}

/// The PDUs of one successful answer to command `cid`: SUCCESS only on the last C2HData PDU
/// and only without SQ flow control, and then no response capsule; else one capsule, for `cid`.
fn check_answer(pdus: &[u8], cid: u16, with_data: bool, no_sq_flow: bool) {
    use nvme::pdu::flags;
    const C2H: u8 = 0x07;
    const RESP: u8 = 0x05;
    let (mut at, mut capsules, mut successes) = (0, 0, 0);
    while at < pdus.len() {
        let plen = u32::from_le_bytes(pdus[at + 4..at + 8].try_into().unwrap()) as usize;
        assert!(
            plen >= 8 && at + plen <= pdus.len(),
            "a PDU past the answer"
        );
        let (kind, f) = (pdus[at], pdus[at + 1]);
        if f & flags::SUCCESS != 0 {
            assert_eq!(kind, C2H, "SUCCESS on another PDU than C2HData");
            assert!(
                f & flags::LAST_PDU != 0,
                "SUCCESS on a PDU that is not the last"
            );
            successes += 1;
        }
        if kind == RESP {
            let got = u16::from_le_bytes([pdus[at + 20], pdus[at + 21]]);
            assert_eq!(got, cid, "a response capsule for another command");
            capsules += 1;
        }
        at += plen;
    }
    let in_data = no_sq_flow && with_data;
    assert_eq!(
        successes,
        usize::from(in_data),
        "SUCCESS where it does not belong"
    );
    assert_eq!(
        capsules,
        usize::from(!in_data),
        "a response capsule missing or doubled"
    );
}
