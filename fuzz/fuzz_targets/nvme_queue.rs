//! An NVMe/TCP controller queue (`nvme::queue::Queue`) fed arbitrary bytes in arbitrary pieces,
//! after a well-formed connection initialization or not: it never panics, never consumes more
//! than it was given, never hands out a command twice while it is open, and every command it
//! hands out carries exactly the data its SGL promised; answering them (the controller
//! translating each through `nvme::translate` and the admin decoder) never breaks the stream.
//! With SQ flow control disabled, a successful answer with data ends on a C2HData PDU with
//! SUCCESS and has no response capsule; with it on, SUCCESS never appears.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::pdu::ICReq;
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
}

fuzz_target!(|input: Input| {
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
    let mut stream = Vec::new();
    if input.initialize {
        ICReq {
            hpda: 0,
            header_digest: input.header_digest,
            data_digest: input.data_digest,
            maxr2t: 0,
        }
        .encode(&mut stream);
    }
    stream.extend_from_slice(&input.bytes);
    let (mut out, mut ready, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let mut buffered: Vec<u8> = Vec::new();
    let mut at = 0;
    let mut cuts = input.cuts.iter();
    while at < stream.len() {
        let n = cuts
            .next()
            .map_or(stream.len() - at, |&c| usize::from(c).max(1));
        let end = (at + n).min(stream.len());
        buffered.extend_from_slice(&stream[at..end]);
        at = end;
        let used = match q.receive(&buffered, &mut out, &mut ready, &mut refused) {
            Ok(used) => used,
            Err(_) => return,
        };
        assert!(used <= buffered.len());
        // In-capsule data is a range of what was received, within what was consumed.
        let ready: Vec<_> = ready
            .drain(..)
            .map(|r| {
                if let nvme::queue::Data::InCapsule(range) = &r.data {
                    assert!(range.end <= used, "in-capsule data outside the PDUs taken");
                }
                r.into_owned(&buffered)
            })
            .collect();
        buffered.drain(..used);
        let mut open: Vec<u16> = Vec::new();
        for r in ready {
            assert!(
                !open.contains(&r.sqe.cid()),
                "a command handed out twice at once"
            );
            open.push(r.sqe.cid());
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
            q.answer(&cqe, &data, &mut out);
            check_answer(
                &out[start..],
                r.sqe.cid(),
                !data.is_empty(),
                input.no_sq_flow,
            );
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
        out.clear();
    }
});

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
