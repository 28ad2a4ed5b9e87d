use super::*;
use crate::negotiation::TargetLimits;
use crate::pdu::{frame_len, parse_frame};
use seam::outbox::ReadBuffers;
use seam::DataOutMemory;

#[derive(Default)]
struct Backend {
    executed: Vec<(Vec<u8>, Vec<u8>, u32)>,
    read_data: Vec<u8>,
    sense: Vec<u8>,
    status: u8,
    tmf: Vec<TmfFunction>,
    /// Answer LU-level TMFs later (commands of other sessions still running).
    tmf_later: bool,
    /// Answer Deferred and remember the ITT instead of running the command.
    defer: bool,
    deferred: Vec<u32>,
    /// The Data-Out of each deferred command, as handed over.
    deferred_data: Vec<Vec<u8>>,
    /// Supply engine memory (pre-filled with 0xEE) for Data-Out; the lengths asked, in order.
    engine_memory: bool,
    /// Make that memory this many bytes too long (a broken engine).
    engine_memory_extra: usize,
    memory_asked: Vec<usize>,
    /// Whether each deferred command's Data-Out was in engine memory.
    deferred_in_engine_memory: Vec<bool>,
    /// Lend read data in slices of this many bytes (a zero-copy store) instead of copying it.
    lend_slice_bytes: usize,
    /// Lend read data as a range of this file (holding `read_data` at `FILE_AT`) when the
    /// request allows it.
    lend_file: Option<std::sync::Arc<std::fs::File>>,
    /// `may_lend_file` of every request, in order.
    may_lend_file: Vec<bool>,
    /// Lend `lend_file` even when the request does not allow it (a broken backend).
    ignore_may_lend_file: bool,
    /// The buffer each deferred read took for its Data-In.
    read_buffers: Vec<Vec<u8>>,
}

#[derive(Debug)]
struct TestMemory(Vec<u8>);

impl DataOutMemory for TestMemory {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// Where the test backend's file holds `read_data`.
const FILE_AT: u64 = 4096 + 7;

impl ScsiBackend for Backend {
    fn execute(
        &mut self,
        req: &ScsiRequest<'_>,
        data_in: &mut Vec<u8>,
        lent: &mut Loan,
        sense: &mut Vec<u8>,
    ) -> Execution {
        // A read's buffer may arrive holding old bytes; the backend overwrites it.
        assert!(req.read || data_in.is_empty());
        assert!(lent.is_empty());
        data_in.clear();
        self.may_lend_file.push(req.may_lend_file);
        if self.defer {
            return Execution::Deferred;
        }
        self.executed
            .push((req.cdb.to_vec(), req.data_out.to_vec(), req.expected_len));
        let mut transfer_len = req.data_out.len() as u32;
        if req.read {
            // Like the SCSI layer: produce what the CDB asks, send at most the expected length.
            let n = self.read_data.len().min(req.expected_len as usize);
            let allowed = req.may_lend_file || self.ignore_may_lend_file;
            if let Some(file) = self.lend_file.as_ref().filter(|_| allowed) {
                lent.file = Some((std::sync::Arc::clone(file), FILE_AT, n));
            } else if self.lend_slice_bytes > 0 {
                let owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> =
                    std::sync::Arc::new(self.read_data.clone());
                for start in (0..n).step_by(self.lend_slice_bytes) {
                    let end = (start + self.lend_slice_bytes).min(n);
                    lent.slices
                        .push((std::sync::Arc::clone(&owner), start..end));
                }
            } else {
                data_in.extend_from_slice(&self.read_data[..n]);
            }
            transfer_len = self.read_data.len() as u32;
        }
        sense.extend_from_slice(&self.sense);
        Execution::Done(ScsiOutcome {
            status: self.status,
            transfer_len: if self.sense.is_empty() {
                transfer_len
            } else {
                0
            },
        })
    }
    fn defer(&mut self, command: DeferredCommand, mut buffers: ReadBuffers<'_>) {
        assert!(
            self.defer,
            "only commands answered Deferred are handed over"
        );
        if command.read {
            self.read_buffers.push(buffers.take());
        }
        self.deferred.push(command.tag);
        self.deferred_in_engine_memory
            .push(matches!(command.data_out, DataOutBuf::Engine(_)));
        self.deferred_data.push(command.data_out.to_vec());
    }

    fn data_out_memory(&mut self, _lun: [u8; 8], len: usize) -> Option<Box<dyn DataOutMemory>> {
        self.memory_asked.push(len);
        self.engine_memory.then(|| {
            Box::new(TestMemory(vec![0xEE; len + self.engine_memory_extra]))
                as Box<dyn DataOutMemory>
        })
    }

    fn lun_exists(&mut self, lun: [u8; 8]) -> bool {
        lun == [0; 8]
    }
    fn task_management(&mut self, _itt: u32, f: TmfFunction, _lun: [u8; 8]) -> TmfAnswer {
        self.tmf.push(f);
        if self.tmf_later {
            TmfAnswer::Later
        } else {
            TmfAnswer::Now(tmf_response::COMPLETE)
        }
    }
}

impl IscsiBackend for Backend {
    fn send_targets(&mut self, filter: Option<&str>) -> Vec<DiscoveredTarget> {
        let all = vec![
            DiscoveredTarget {
                name: "iqn.2026-11.org.ferrosan:a".into(),
                addresses: vec!["127.0.0.1:3260,1".into(), "[::1]:3260,1".into()],
            },
            DiscoveredTarget {
                name: "iqn.2026-11.org.ferrosan:b".into(),
                addresses: vec!["127.0.0.1:3260,1".into()],
            },
        ];
        all.into_iter()
            .filter(|t| filter.is_none_or(|f| f == t.name))
            .collect()
    }
}

struct Harness {
    s: Session,
    b: Backend,
    now: Instant,
    cmd_sn: u32,
    /// Given to the outbox of the next `send` as a spare buffer (a recycled one, old bytes in).
    recycled: Option<Vec<u8>>,
}

fn params() -> SessionParams {
    let mut p = SessionParams::rfc_defaults(&TargetLimits::default());
    p.max_xmit_data_segment_length = 8192;
    p.max_burst_length = 16384;
    p.first_burst_length = 8192;
    p.max_outstanding_r2t = 2;
    p.initial_r2t = false;
    p
}

fn harness_with(kind: SessionType, p: SessionParams, limits: SessionLimits) -> Harness {
    let now = Instant::now();
    Harness {
        s: Session::new(
            kind,
            NodeName::from_wire("iqn.2026-11.org.test:i").unwrap(),
            p,
            limits,
            1000,
            1,
            now,
        ),
        b: Backend::default(),
        now,
        cmd_sn: 1,
        recycled: None,
    }
}

fn harness() -> Harness {
    harness_with(SessionType::Normal, params(), SessionLimits::default())
}

impl Harness {
    /// Sends one PDU through the wire encoding and returns the flow and the decoded responses.
    fn send(&mut self, bhs: Bhs, data: &[u8]) -> (Flow, Vec<(Bhs, Vec<u8>)>) {
        let framing = self.s.framing();
        let mut wire = Vec::new();
        pdu::encode_into(&mut wire, &bhs, data, &framing);
        let pdu = parse_frame(&wire, &framing).expect("well-formed test PDU");
        let mut out = Outbox::new(8);
        if let Some(buf) = self.recycled.take() {
            out.give_back(buf);
        }
        let flow = self.s.handle(&pdu, self.now, &mut self.b, &mut out);
        (flow, decode_all(&out.to_vec(), &framing))
    }

    /// Like `send` for a Data-Out, the way an engine receiving payloads in place does it: ask
    /// for the destination, fill it, hand over the header. None if the session declines.
    fn send_placed(&mut self, mut bhs: Bhs, data: &[u8]) -> Option<(Flow, Decoded)> {
        bhs.set_data_segment_len(data.len());
        let dst = self.s.data_out_destination(&bhs)?;
        assert_eq!(dst.len(), data.len());
        dst.copy_from_slice(data);
        let mut out = Outbox::new(8);
        let flow = self
            .s
            .handle_placed_data_out(&bhs, self.now, &mut self.b, &mut out);
        Some((flow, decode_all(&out.to_vec(), &self.s.framing())))
    }

    /// Like `send` for a SCSI Command whose immediate data an engine receives in place. None
    /// if the session declines (the PDU then takes the usual way).
    fn send_placed_command(&mut self, mut bhs: Bhs, data: &[u8]) -> Option<(Flow, Decoded)> {
        bhs.set_data_segment_len(data.len());
        let mut out = Outbox::new(8);
        let dst = self
            .s
            .command_data_destination(&bhs, &mut self.b, &mut out)?;
        assert_eq!(dst.len(), data.len());
        dst.copy_from_slice(data);
        let flow = self
            .s
            .handle_placed_command(self.now, &mut self.b, &mut out);
        Some((flow, decode_all(&out.to_vec(), &self.s.framing())))
    }

    fn command(&mut self, cdb: &[u8], flags: u8, edtl: u32, itt: u32) -> Bhs {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(flags);
        b.set_itt(itt);
        b.set_u32(off::EDTL, edtl);
        b.set_u32(off::CMD_SN, self.cmd_sn);
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        b.0[off::CDB..off::CDB + cdb.len()].copy_from_slice(cdb);
        b
    }
}

/// PDUs decoded from the wire: header and data segment each.
type Decoded = Vec<(Bhs, Vec<u8>)>;

fn decode_all(mut wire: &[u8], framing: &Framing) -> Decoded {
    let recv = Framing {
        max_data_segment_len: 1 << 24,
        ..*framing
    };
    let mut v = Vec::new();
    while !wire.is_empty() {
        let len = frame_len(wire, &recv).unwrap().expect("complete frame");
        let pdu = parse_frame(&wire[..len], &recv).expect("valid frame");
        v.push((pdu.bhs, pdu.data.to_vec()));
        wire = &wire[len..];
    }
    v
}

/// An immediate NOP-Out: `itt` RESERVED_TAG with our ping's `ttt` answers a NOP-In; any other
/// `itt` with `ttt` RESERVED_TAG is the initiator's own ping.
fn immediate_nop_out(itt: u32, ttt: u32) -> Bhs {
    let mut b = Bhs::new(Opcode::NopOut);
    b.set_immediate(true);
    b.set_flags(0x80);
    b.set_itt(itt);
    b.set_u32(off::TTT, ttt);
    b
}

fn data_out(itt: u32, ttt: u32, data_sn: u32, offset: u32, final_bit: bool) -> Bhs {
    let mut b = Bhs::new(Opcode::DataOut);
    b.set_flags(if final_bit { 0x80 } else { 0 });
    b.set_itt(itt);
    b.set_u32(off::TTT, ttt);
    b.set_u32(off::DATA_SN, data_sn);
    b.set_u32(off::BUFFER_OFFSET, offset);
    b
}

const READ10: [u8; 10] = [0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0];
const WRITE10: [u8; 10] = [0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0];

#[test]
fn nop_out_is_echoed_and_consumes_stat_sn() {
    let mut h = harness();
    let mut nop = Bhs::new(Opcode::NopOut);
    nop.set_flags(0x80);
    nop.set_itt(7);
    nop.set_u32(off::TTT, RESERVED_TAG);
    nop.set_u32(off::CMD_SN, 1);
    let (flow, r) = h.send(nop, b"ping");
    assert_eq!(flow, Flow::Continue);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::NopIn as u8);
    assert_eq!(r[0].0.itt(), 7);
    assert_eq!(r[0].0.u32_at(off::TTT), RESERVED_TAG);
    assert_eq!(r[0].0.u32_at(off::STAT_SN), 1000);
    assert_eq!(r[0].0.u32_at(off::EXP_CMD_SN), 2);
    assert_eq!(r[0].1, b"ping");
    nop.set_u32(off::CMD_SN, 2);
    let (_, r) = h.send(nop, b"");
    assert_eq!(r[0].0.u32_at(off::STAT_SN), 1001);
}

#[test]
fn read_is_split_into_data_in_with_status_in_the_last() {
    let mut h = harness();
    h.b.read_data = (0..20000u32).map(|i| i as u8).collect();
    let cmd = h.command(&READ10, 0xc0, 20000, 0x11);
    let (_, r) = h.send(cmd, &[]);
    // 8192 + 8192 (burst 16384 ends) + 3616.
    assert_eq!(r.len(), 3);
    let mut data = Vec::new();
    for (i, (bhs, d)) in r.iter().enumerate() {
        assert_eq!(bhs.opcode_raw(), Opcode::DataIn as u8);
        assert_eq!(bhs.u32_at(off::DATA_SN), i as u32);
        assert_eq!(bhs.u32_at(off::BUFFER_OFFSET) as usize, data.len());
        assert_eq!(bhs.itt(), 0x11);
        data.extend_from_slice(d);
    }
    assert_eq!(data, h.b.read_data);
    assert_eq!(r[0].0.flags(), 0x00);
    assert_eq!(r[1].0.flags(), 0x80, "end of a MaxBurstLength sequence");
    assert_eq!(r[2].0.flags(), 0x81, "final with status");
    assert_eq!(r[2].0.byte(off::STATUS), status::GOOD);
    assert_eq!(r[2].0.u32_at(off::STAT_SN), 1000);
    assert_eq!(h.b.executed[0].2, 20000);
}

#[test]
fn read_residuals() {
    let mut h = harness();
    h.b.read_data = vec![1; 512];
    let cmd = h.command(&READ10, 0xc0, 1024, 1);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.flags(), 0x80 | 0x01 | 0x02);
    assert_eq!(r[0].0.u32_at(off::RESIDUAL), 512);
    let cmd = h.command(&READ10, 0xc0, 256, 2);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].1.len(), 256);
    assert_eq!(r[0].0.flags(), 0x80 | 0x01 | 0x04);
    assert_eq!(r[0].0.u32_at(off::RESIDUAL), 256);
}

#[test]
fn sense_goes_in_a_scsi_response() {
    let mut h = harness();
    h.b.status = status::CHECK_CONDITION;
    h.b.sense = vec![0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x21, 0, 0, 0, 0, 0];
    let cmd = h.command(&READ10, 0xc0, 4096, 3);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r.len(), 1);
    let (bhs, data) = &r[0];
    assert_eq!(bhs.opcode_raw(), Opcode::ScsiResponse as u8);
    assert_eq!(bhs.byte(off::STATUS), status::CHECK_CONDITION);
    assert_eq!(&data[..2], &[0, 18]);
    assert_eq!(data[2 + 12], 0x21);
    assert_eq!(bhs.flags() & 0x02, 0x02);
    assert_eq!(bhs.u32_at(off::RESIDUAL), 4096);
}

#[test]
fn write_with_all_immediate_data_runs_at_once() {
    let mut h = harness();
    let cmd = h.command(&WRITE10, 0xa0, 4096, 4);
    let (_, r) = h.send(cmd, &[9u8; 4096]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::ScsiResponse as u8);
    assert_eq!(r[0].0.byte(off::STATUS), status::GOOD);
    assert_eq!(h.b.executed[0].1, vec![9u8; 4096]);
    assert_eq!(h.s.pending_writes(), 0);
}

#[test]
fn write_with_unsolicited_and_solicited_data() {
    let mut h = harness();
    // 40 KiB: 4 KiB immediate, unsolicited up to FirstBurst 8 KiB, then R2Ts of 16 KiB.
    let total = 40 * 1024u32;
    let payload: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let cmd = h.command(&WRITE10, 0x20, total, 5);
    let (_, r) = h.send(cmd, &payload[..4096]);
    assert_eq!(r.len(), 2, "two R2Ts (MaxOutstandingR2T=2)");
    let r2ts: Vec<(u32, u32, u32, u32)> = r
        .iter()
        .map(|(b, _)| {
            assert_eq!(b.opcode_raw(), Opcode::R2t as u8);
            (
                b.u32_at(off::TTT),
                b.u32_at(off::DATA_SN),
                b.u32_at(off::BUFFER_OFFSET),
                b.u32_at(off::DESIRED_LENGTH),
            )
        })
        .collect();
    assert_eq!((r2ts[0].1, r2ts[0].2, r2ts[0].3), (0, 8192, 16384));
    assert_eq!((r2ts[1].1, r2ts[1].2, r2ts[1].3), (1, 24576, 16384));
    // Unsolicited Data-Out 4096..8192.
    let (_, r) = h.send(
        data_out(5, RESERVED_TAG, 0, 4096, true),
        &payload[4096..8192],
    );
    assert!(r.is_empty());
    // First R2T in two PDUs.
    let (_, r) = h.send(
        data_out(5, r2ts[0].0, 0, 8192, false),
        &payload[8192..16384],
    );
    assert!(r.is_empty());
    let (_, r) = h.send(
        data_out(5, r2ts[0].0, 1, 16384, true),
        &payload[16384..24576],
    );
    assert!(r.is_empty(), "nothing left to solicit");
    let (_, r) = h.send(data_out(5, r2ts[1].0, 0, 24576, true), &payload[24576..]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::ScsiResponse as u8);
    assert_eq!(h.b.executed.len(), 1);
    assert_eq!(h.b.executed[0].1, payload);
    assert_eq!(h.s.pending_writes(), 0);
}

#[test]
fn data_out_received_in_place_acts_as_handled_data_out() {
    let total = 40 * 1024u32;
    let payload: Vec<u8> = (0..total).map(|i| (i * 13 % 251) as u8).collect();
    let mut runs = Vec::new();
    for placed in [false, true] {
        let mut h = harness();
        let send_data = |h: &mut Harness, bhs: Bhs, data: &[u8]| {
            if placed {
                h.send_placed(bhs, data).expect("accepted in place")
            } else {
                h.send(bhs, data)
            }
        };
        // 4 KiB immediate, unsolicited to 8 KiB, then two R2Ts of 16 KiB.
        let cmd = h.command(&WRITE10, 0x20, total, 5);
        let (_, r) = h.send(cmd, &payload[..4096]);
        let ttts: Vec<u32> = r.iter().map(|(b, _)| b.u32_at(off::TTT)).collect();
        let mut wire = Vec::new();
        for (bhs, range) in [
            (data_out(5, RESERVED_TAG, 0, 4096, true), 4096..8192),
            (data_out(5, ttts[0], 0, 8192, false), 8192..16384),
            (data_out(5, ttts[0], 1, 16384, true), 16384..24576),
            (data_out(5, ttts[1], 0, 24576, true), 24576..40960),
        ] {
            let (flow, r) = send_data(&mut h, bhs, &payload[range]);
            assert_eq!(flow, Flow::Continue);
            wire.push(r);
        }
        assert_eq!(h.b.executed.len(), 1);
        assert_eq!(h.b.executed[0].1, payload);
        assert_eq!(h.s.pending_writes(), 0);
        runs.push(wire);
    }
    assert_eq!(runs[0], runs[1], "the same answers either way");
}

#[test]
fn a_write_into_a_recycled_buffer_carries_only_the_data_sent() {
    let total = 40 * 1024u32;
    let payload: Vec<u8> = (0..total).map(|i| (i * 7 % 253) as u8).collect();
    // Recycled buffers longer, as long and shorter than the write, full of old bytes.
    for old_len in [64 * 1024, total as usize, 1000] {
        let mut h = harness();
        h.recycled = Some(vec![0xEE; old_len]);
        let cmd = h.command(&WRITE10, 0x20, total, 5);
        let (_, r) = h.send(cmd, &payload[..4096]);
        let ttts: Vec<u32> = r.iter().map(|(b, _)| b.u32_at(off::TTT)).collect();
        for (bhs, range) in [
            (data_out(5, RESERVED_TAG, 0, 4096, true), 4096..8192),
            (data_out(5, ttts[0], 0, 8192, false), 8192..16384),
            (data_out(5, ttts[0], 1, 16384, true), 16384..24576),
            (data_out(5, ttts[1], 0, 24576, true), 24576..40960),
        ] {
            let _ = h.send(bhs, &payload[range]);
        }
        assert_eq!(h.b.executed.len(), 1, "old_len {old_len}");
        assert_eq!(h.b.executed[0].1, payload, "old_len {old_len}");
    }
    // A write still missing data never runs, whatever the buffer held.
    let mut h = harness();
    h.recycled = Some(vec![0xEE; 64 * 1024]);
    let cmd = h.command(&WRITE10, 0x20, total, 5);
    let _ = h.send(cmd, &payload[..4096]);
    let _ = h.send(
        data_out(5, RESERVED_TAG, 0, 4096, true),
        &payload[4096..8192],
    );
    assert!(h.b.executed.is_empty());
    assert_eq!(h.s.pending_writes(), 1);
}

#[test]
fn awaits_data_out_tells_how_much_a_pending_write_still_expects() {
    let total = 40 * 1024u32;
    let payload = vec![7u8; total as usize];
    let mut h = harness();
    assert!(!h.s.awaits_data_out(1), "no write pending");
    let cmd = h.command(&WRITE10, 0x20, total, 5);
    let (_, r) = h.send(cmd, &payload[..4096]);
    // 36 KiB still to come.
    assert!(h.s.awaits_data_out(36 * 1024));
    assert!(!h.s.awaits_data_out(36 * 1024 + 1));
    let ttts: Vec<u32> = r.iter().map(|(b, _)| b.u32_at(off::TTT)).collect();
    for (bhs, range) in [
        (data_out(5, RESERVED_TAG, 0, 4096, true), 4096..8192),
        (data_out(5, ttts[0], 0, 8192, false), 8192..16384),
        (data_out(5, ttts[0], 1, 16384, true), 16384..24576),
    ] {
        let _ = h.send(bhs, &payload[range]);
    }
    assert!(h.s.awaits_data_out(16 * 1024));
    assert!(!h.s.awaits_data_out(16 * 1024 + 1));
    let _ = h.send(data_out(5, ttts[1], 0, 24576, true), &payload[24576..]);
    assert_eq!(h.b.executed.len(), 1);
    assert!(!h.s.awaits_data_out(1), "the write ran");
}

#[test]
fn data_out_has_no_destination_on_a_connection_with_digests() {
    for (header, data) in [(true, false), (false, true)] {
        let mut p = params();
        p.header_digest = header;
        p.data_digest = data;
        let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
        let cmd = h.command(&WRITE10, 0x20, 40 * 1024, 5);
        let (_, r) = h.send(cmd, &[1u8; 4096]);
        let mut bhs = data_out(5, r[0].0.u32_at(off::TTT), 0, 8192, false);
        bhs.set_data_segment_len(8192);
        assert!(
            h.s.data_out_destination(&bhs).is_none(),
            "header digest {header}, data digest {data}"
        );
        assert!(
            !h.s.awaits_data_out(1),
            "no header-first reads either: header digest {header}, data digest {data}"
        );
    }
}

#[test]
fn data_out_the_session_would_refuse_has_no_destination() {
    let mut h = harness();
    let total = 40 * 1024u32;
    let cmd = h.command(&WRITE10, 0x20, total, 5);
    let (_, r) = h.send(cmd, &[1u8; 4096]);
    let ttt = r[0].0.u32_at(off::TTT);
    let sized = |mut b: Bhs, len: usize| {
        b.set_data_segment_len(len);
        b
    };
    for (bhs, why) in [
        (
            sized(data_out(5, ttt, 0, 8192 + 512, false), 4096),
            "offset not where the R2T is",
        ),
        (
            sized(data_out(5, ttt, 1, 8192, false), 4096),
            "DataSN skips one",
        ),
        (
            sized(data_out(5, ttt, 0, 8192, false), 16385),
            "longer than the R2T",
        ),
        (
            sized(data_out(5, ttt ^ 1, 0, 8192, false), 4096),
            "unknown TTT",
        ),
        (sized(data_out(6, ttt, 0, 8192, false), 4096), "unknown ITT"),
        (
            sized(data_out(5, RESERVED_TAG, 0, 4096, true), 4097),
            "past FirstBurstLength",
        ),
        (sized(Bhs::new(Opcode::NopOut), 4096), "not a Data-Out"),
    ] {
        assert!(h.s.data_out_destination(&bhs).is_none(), "{why}");
    }
    // Nothing changed: the right PDU is still accepted, in place.
    let ok = data_out(5, ttt, 0, 8192, false);
    assert!(h.send_placed(ok, &[2u8; 8192]).is_some());
}

#[test]
fn r2ts_are_issued_as_earlier_ones_complete() {
    let mut p = params();
    p.max_outstanding_r2t = 1;
    p.initial_r2t = true;
    let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
    let cmd = h.command(&WRITE10, 0x80 | 0x20, 32768, 6);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r.len(), 1);
    let ttt = r[0].0.u32_at(off::TTT);
    assert_eq!(
        (
            r[0].0.u32_at(off::BUFFER_OFFSET),
            r[0].0.u32_at(off::DESIRED_LENGTH)
        ),
        (0, 16384)
    );
    h.send(data_out(6, ttt, 0, 0, false), &[1; 8192]);
    let (_, r) = h.send(data_out(6, ttt, 1, 8192, true), &[1; 8192]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::R2t as u8);
    assert_eq!(r[0].0.u32_at(off::DATA_SN), 1, "R2TSN");
    assert_eq!(r[0].0.u32_at(off::BUFFER_OFFSET), 16384);
}

#[test]
fn bad_data_sn_or_offset_fails_the_task_not_the_session() {
    for (data_sn, offset) in [(1u32, 4096u32), (0, 0), (27, 4096), (u32::MAX, 4096)] {
        let mut h = harness();
        let cmd = h.command(&WRITE10, 0x20, 8192, 7);
        h.send(cmd, &[0; 4096]);
        let (flow, r) = h.send(data_out(7, RESERVED_TAG, data_sn, offset, true), &[0; 4096]);
        assert_eq!(flow, Flow::Continue, "data_sn {data_sn} offset {offset}");
        assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
        assert_eq!(r[0].1.len(), 48, "Reject carries the rejected header");
        assert_eq!(r[1].0.opcode_raw(), Opcode::ScsiResponse as u8);
        assert_eq!(r[1].0.byte(off::STATUS), status::CHECK_CONDITION);
        assert_eq!(r[1].1[2 + 2], 0x0b, "ABORTED COMMAND");
        assert!(h.b.executed.is_empty());
        assert_eq!(h.s.pending_writes(), 0);
        // Late unsolicited data for the failed task is dropped quietly.
        let (_, r) = h.send(data_out(7, RESERVED_TAG, 1, 4096, true), &[0; 4096]);
        assert!(r.is_empty());
    }
}

#[test]
fn data_out_beyond_the_unsolicited_burst_is_refused() {
    let mut h = harness();
    let cmd = h.command(&WRITE10, 0x20, 65536, 8);
    h.send(cmd, &[]);
    let (_, r) = h.send(data_out(8, RESERVED_TAG, 0, 0, true), &[0; 8192 + 512]);
    assert_eq!(r[1].0.byte(off::STATUS), status::CHECK_CONDITION);
    assert_eq!(h.s.pending_writes(), 0);
}

#[test]
fn data_out_for_unknown_task() {
    let mut h = harness();
    let (flow, r) = h.send(data_out(99, RESERVED_TAG, 0, 0, true), &[0; 512]);
    assert_eq!(flow, Flow::Continue);
    assert!(r.is_empty(), "late unsolicited data is dropped");
    let (flow, r) = h.send(data_out(99, 1234, 0, 0, true), &[0; 512]);
    assert_eq!(flow, Flow::Continue);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
    assert_eq!(
        r[0].0.byte(off::REASON),
        RejectReason::InvalidPduField as u8
    );
}

#[test]
fn cmd_sn_window() {
    let mut h = harness();
    let max = h.s.max_cmd_sn();
    assert_eq!(max, 1 + 127);
    // Too high: silently ignored.
    let mut tur = h.command(&[0u8; 6], 0x80, 0, 1);
    tur.set_u32(off::CMD_SN, max + 1);
    let (_, r) = h.send(tur, &[]);
    assert!(r.is_empty());
    // Too low: ignored.
    tur.set_u32(off::CMD_SN, 0);
    let (_, r) = h.send(tur, &[]);
    assert!(r.is_empty());
    // Out of order inside the window: held until the gap closes.
    tur.set_u32(off::CMD_SN, 2);
    tur.set_itt(2);
    let (_, r) = h.send(tur, &[]);
    assert!(r.is_empty());
    tur.set_u32(off::CMD_SN, 1);
    tur.set_itt(1);
    let (_, r) = h.send(tur, &[]);
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].0.itt(), 1);
    assert_eq!(r[1].0.itt(), 2);
    assert_eq!(h.s.exp_cmd_sn(), 3);
    assert_eq!(r[1].0.u32_at(off::EXP_CMD_SN), 3);
    // Immediate commands do not advance ExpCmdSN.
    tur.set_immediate(true);
    tur.set_u32(off::CMD_SN, 3);
    let (_, r) = h.send(tur, &[]);
    assert_eq!(r.len(), 1);
    assert_eq!(h.s.exp_cmd_sn(), 3);
}

#[test]
fn abort_task_drops_a_pending_write() {
    let mut h = harness();
    let cmd = h.command(&WRITE10, 0x20, 65536, 9);
    h.send(cmd, &[]);
    assert_eq!(h.s.pending_writes(), 1);
    let mut tmf = Bhs::new(Opcode::TaskMgmtRequest);
    tmf.set_immediate(true);
    tmf.set_flags(0x80 | 1);
    tmf.set_itt(10);
    tmf.set_u32(off::REFERENCED_TASK_TAG, 9);
    tmf.set_u32(off::CMD_SN, h.cmd_sn);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::TaskMgmtResponse as u8);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
    assert_eq!(h.s.pending_writes(), 0);
    // A task that never existed, referenced beyond the window.
    tmf.set_u32(off::REFERENCED_TASK_TAG, 12345);
    tmf.set_u32(off::REF_CMD_SN, h.cmd_sn + 500);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(
        r[0].0.byte(off::RESPONSE),
        tmf_response::TASK_DOES_NOT_EXIST
    );
    // Received and already completed: nothing to abort.
    let cmd = h.command(&[0u8; 6], 0x80, 0, 11);
    let done_sn = cmd.u32_at(off::CMD_SN);
    h.send(cmd, &[]);
    tmf.set_u32(off::REFERENCED_TASK_TAG, 11);
    tmf.set_u32(off::REF_CMD_SN, done_sn);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(
        r[0].0.byte(off::RESPONSE),
        tmf_response::TASK_DOES_NOT_EXIST
    );
    // Not received yet but inside the window: considered received, function complete.
    tmf.set_u32(off::REFERENCED_TASK_TAG, 12);
    tmf.set_u32(off::REF_CMD_SN, h.cmd_sn + 3);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
}

#[test]
fn lun_reset_and_unknown_functions() {
    let mut h = harness();
    let mut tmf = Bhs::new(Opcode::TaskMgmtRequest);
    tmf.set_immediate(true);
    tmf.set_flags(0x80 | 5);
    tmf.set_itt(1);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
    assert_eq!(h.b.tmf, vec![TmfFunction::LogicalUnitReset]);
    tmf.set_lun([0, 9, 0, 0, 0, 0, 0, 0]);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::LUN_DOES_NOT_EXIST);
    tmf.set_flags(0x80 | 0x33);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::NOT_SUPPORTED);
    tmf.set_flags(0x80 | 7);
    let (flow, r) = h.send(tmf, &[]);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
    assert_eq!(flow, Flow::Close, "cold reset drops the connection");
}

fn text_req(itt: u32, ttt: u32, cmd_sn: u32) -> Bhs {
    let mut b = Bhs::new(Opcode::TextRequest);
    b.set_flags(0x80);
    b.set_itt(itt);
    b.set_u32(off::TTT, ttt);
    b.set_u32(off::CMD_SN, cmd_sn);
    b
}

#[test]
fn send_targets_in_discovery() {
    let mut h = harness_with(SessionType::Discovery, params(), SessionLimits::default());
    let (_, r) = h.send(text_req(1, RESERVED_TAG, 1), b"SendTargets=All\0");
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.flags(), 0x80);
    let pairs = text::parse(&r[0].1, 64).err();
    assert!(
        pairs.is_some(),
        "TargetAddress repeats, so a strict parse refuses it"
    );
    let text = String::from_utf8(r[0].1.clone()).unwrap();
    assert_eq!(
        text,
        "TargetName=iqn.2026-11.org.ferrosan:a\0TargetAddress=127.0.0.1:3260,1\0TargetAddress=[::1]:3260,1\0\
         TargetName=iqn.2026-11.org.ferrosan:b\0TargetAddress=127.0.0.1:3260,1\0"
    );
    let (_, r) = h.send(
        text_req(2, RESERVED_TAG, 2),
        b"SendTargets=iqn.2026-11.org.ferrosan:b\0",
    );
    assert!(String::from_utf8_lossy(&r[0].1).contains("ferrosan:b"));
    assert!(!String::from_utf8_lossy(&r[0].1).contains("ferrosan:a"));
    // SCSI commands are not allowed in discovery.
    let cmd = h.command(&READ10, 0xc0, 512, 3);
    let mut cmd = cmd;
    cmd.set_u32(off::CMD_SN, 3);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
}

#[test]
fn long_text_answers_continue() {
    let mut p = params();
    p.max_xmit_data_segment_length = 512;
    let mut h = harness_with(SessionType::Discovery, p, SessionLimits::default());
    h.b = Backend::default();
    let (_, r) = h.send(
        text_req(1, RESERVED_TAG, 1),
        b"SendTargets=All\0X-foo=1\0".as_slice(),
    );
    let total_first = r[0].1.len();
    assert!(total_first <= 512);
    let mut collected = r[0].1.clone();
    let mut last = r[0].0;
    let mut sn = 2;
    while last.flags() & 0x40 != 0 {
        let (_, r) = h.send(text_req(1, last.u32_at(off::TTT), sn), &[]);
        sn += 1;
        collected.extend_from_slice(&r[0].1);
        last = r[0].0;
    }
    assert_eq!(last.flags(), 0x80);
    assert!(String::from_utf8_lossy(&collected).ends_with("X-foo=NotUnderstood\0"));
    // A continuation with a stale TTT is rejected.
    let (_, r) = h.send(text_req(1, 4242, sn), &[]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
}

#[test]
fn send_targets_all_in_normal_session_is_rejected() {
    let mut h = harness();
    let (_, r) = h.send(text_req(1, RESERVED_TAG, 1), b"SendTargets=All\0");
    assert_eq!(String::from_utf8_lossy(&r[0].1), "SendTargets=Reject\0");
}

#[test]
fn logout_closes() {
    let mut h = harness();
    let mut lo = Bhs::new(Opcode::LogoutRequest);
    lo.set_immediate(true);
    lo.set_flags(0x80);
    lo.set_itt(77);
    let (flow, r) = h.send(lo, &[]);
    assert_eq!(flow, Flow::Close);
    assert_eq!(r[0].0.opcode_raw(), Opcode::LogoutResponse as u8);
    assert_eq!(r[0].0.byte(off::RESPONSE), 0);
    assert_eq!(r[0].0.itt(), 77);
    let mut h = harness();
    lo.set_flags(0x80 | 2);
    let (flow, r) = h.send(lo, &[]);
    assert_eq!(flow, Flow::Continue);
    assert_eq!(
        r[0].0.byte(off::RESPONSE),
        2,
        "recovery not supported at ERL 0"
    );
}

#[test]
fn a_requested_logout_is_an_async_message_then_the_logout_closes() {
    let mut h = harness();
    let nop = |itt| immediate_nop_out(itt, RESERVED_TAG);
    let (_, r) = h.send(nop(1), &[]);
    let stat_sn = r[0].0.u32_at(off::STAT_SN);
    let mut out = Outbox::new(4);
    h.s.request_logout(10, &mut out);
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    let (msg, data) = &r[0];
    assert_eq!(msg.opcode_raw(), Opcode::AsyncMessage as u8);
    assert_eq!(msg.flags(), 0x80);
    assert_eq!(msg.itt(), RESERVED_TAG);
    assert_eq!(
        msg.byte(off::ASYNC_EVENT),
        1,
        "AsyncEvent: target requests logout"
    );
    assert_eq!(
        msg.u16_at(off::PARAMETER3),
        10,
        "Parameter3: seconds to log out"
    );
    assert_eq!(msg.u32_at(off::STAT_SN), stat_sn + 1);
    assert!(data.is_empty());
    // Commands are still served, with the StatSN after the message's.
    let (_, r) = h.send(nop(2), &[]);
    assert_eq!(r[0].0.u32_at(off::STAT_SN), stat_sn + 2);
    // The initiator's logout ends the session as usual.
    let mut lo = Bhs::new(Opcode::LogoutRequest);
    lo.set_immediate(true);
    lo.set_flags(0x80);
    lo.set_itt(3);
    let (flow, r) = h.send(lo, &[]);
    assert_eq!(flow, Flow::Close);
    assert_eq!(r[0].0.opcode_raw(), Opcode::LogoutResponse as u8);
}

#[test]
fn unknown_opcodes_and_login_are_rejected() {
    let mut h = harness();
    let mut b = Bhs::new(Opcode::NopOut);
    b.0[0] = 0x1c; // vendor-specific
    let (flow, r) = h.send(b, &[]);
    assert_eq!(flow, Flow::Continue);
    assert_eq!(
        r[0].0.byte(off::REASON),
        RejectReason::CommandNotSupported as u8
    );
    let b = Bhs::new(Opcode::LoginRequest);
    let (_, r) = h.send(b, &[]);
    assert_eq!(r[0].0.byte(off::REASON), RejectReason::ProtocolError as u8);
    let b = Bhs::new(Opcode::SnackRequest);
    let (_, r) = h.send(b, &[]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
}

#[test]
fn malformed_commands_are_rejected() {
    let mut h = harness();
    // Immediate data on a read.
    let cmd = h.command(&READ10, 0xc0, 512, 1);
    let (_, r) = h.send(cmd, &[0; 16]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
    // Immediate data longer than EDTL.
    let cmd = h.command(&WRITE10, 0xa0, 512, 2);
    let (_, r) = h.send(cmd, &[0; 1024]);
    assert_eq!(r[0].0.opcode_raw(), Opcode::Reject as u8);
    // Duplicate ITT of a pending task.
    let cmd = h.command(&WRITE10, 0x20, 65536, 3);
    h.send(cmd, &[]);
    let cmd = h.command(&WRITE10, 0x20, 65536, 3);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].0.byte(off::REASON), RejectReason::TaskInProgress as u8);
    // Bidirectional.
    let cmd = h.command(&WRITE10, 0xe0, 512, 4);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].0.byte(off::STATUS), status::CHECK_CONDITION);
}

#[test]
fn write_limits() {
    let limits = SessionLimits {
        max_write_bytes: 65536,
        max_pending_write_bytes: 100_000,
        ..SessionLimits::default()
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    let cmd = h.command(&WRITE10, 0x20, 65537, 1);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].0.byte(off::STATUS), status::CHECK_CONDITION);
    let cmd = h.command(&WRITE10, 0x20, 65536, 2);
    h.send(cmd, &[]);
    let cmd = h.command(&WRITE10, 0x20, 65536, 3);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].0.byte(off::STATUS), status::TASK_SET_FULL);
}

#[test]
fn idle_pings_and_dead_peer_detection() {
    let mut h = harness();
    let mut out = Outbox::new(4);
    assert_eq!(
        h.s.tick(h.now + Duration::from_secs(1), true, &mut out),
        Liveness::Continue
    );
    assert!(out.is_empty());
    assert_eq!(
        h.s.tick(h.now + Duration::from_secs(6), true, &mut out),
        Liveness::Continue
    );
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r[0].0.opcode_raw(), Opcode::NopIn as u8);
    assert_eq!(r[0].0.itt(), RESERVED_TAG);
    let ttt = r[0].0.u32_at(off::TTT);
    // The answer clears the ping.
    h.now += Duration::from_secs(7);
    let (_, r) = h.send(immediate_nop_out(RESERVED_TAG, ttt), &[]);
    assert!(r.is_empty());
    let mut out = Outbox::new(4);
    assert_eq!(
        h.s.tick(h.now + Duration::from_secs(60), true, &mut out),
        Liveness::Continue
    );
    // No answer this time: dead after the timeout.
    let later = h.now + Duration::from_secs(60 + 31);
    assert_eq!(
        h.s.tick(later, true, &mut Outbox::new(4)),
        Liveness::DeadPeer
    );
}

/// Ticks once a second from `from` to `to` (inclusive), answering every ping at once; returns the
/// first verdict other than Continue, with its second.
fn tick_answering_pings(h: &mut Harness, from: u64, to: u64) -> Option<(u64, Liveness)> {
    let start = h.now;
    for s in from..=to {
        let mut out = Outbox::new(4);
        let verdict = h.s.tick(start + Duration::from_secs(s), true, &mut out);
        if verdict != Liveness::Continue {
            h.now = start;
            return Some((s, verdict));
        }
        for (bhs, _) in decode_all(&out.to_vec(), &h.s.framing()) {
            h.now = start + Duration::from_secs(s);
            h.send(immediate_nop_out(RESERVED_TAG, bhs.u32_at(off::TTT)), &[]);
        }
    }
    h.now = start;
    None
}

#[test]
fn an_idle_session_ends_after_the_idle_timeout_unless_work_is_outstanding() {
    let limits = SessionLimits {
        idle_timeout: Duration::from_secs(60),
        ..SessionLimits::default()
    };
    // Answered pings keep the connection alive but are not activity: idle at 60 s.
    let mut h = harness_with(SessionType::Normal, params(), limits);
    assert_eq!(
        tick_answering_pings(&mut h, 1, 120),
        Some((60, Liveness::Idle))
    );

    // A command still running is work outstanding: never idle meanwhile.
    let mut h = harness_with(SessionType::Normal, params(), limits);
    h.b.defer = true;
    let cmd = h.command(&READ10, 0xc1, 512, 3);
    h.send(cmd, &[]);
    assert_eq!(tick_answering_pings(&mut h, 1, 300), None);

    // Zero (the default) never ends a session for idleness.
    let mut h = harness();
    assert_eq!(tick_answering_pings(&mut h, 1, 3600), None);
}

#[test]
fn a_zero_ping_interval_never_pings() {
    let limits = SessionLimits {
        nop_interval: Duration::ZERO,
        ..SessionLimits::default()
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    for s in [1, 10, 100, 10_000] {
        let mut out = Outbox::new(4);
        assert_eq!(
            h.s.tick(h.now + Duration::from_secs(s), true, &mut out),
            Liveness::Continue
        );
        assert!(out.is_empty(), "pinged after {s} s");
    }
}

#[test]
fn idleness_counts_what_the_initiator_sends_of_its_own_accord() {
    let mut h = harness();
    let start = h.now;
    let mut out = Outbox::new(4);
    h.s.tick(start + Duration::from_secs(6), true, &mut out);
    let ping = decode_all(&out.to_vec(), &h.s.framing());
    let ttt = ping[0].0.u32_at(off::TTT);
    // Answering our ping is not activity...
    h.now = start + Duration::from_secs(7);
    h.send(immediate_nop_out(RESERVED_TAG, ttt), &[]);
    assert_eq!(
        h.s.idle_for(start + Duration::from_secs(10)),
        Duration::from_secs(10)
    );
    // ...its own NOP-Out (a ping of its own) is.
    h.now = start + Duration::from_secs(12);
    h.send(immediate_nop_out(5, RESERVED_TAG), &[]);
    assert_eq!(
        h.s.idle_for(start + Duration::from_secs(15)),
        Duration::from_secs(3)
    );
    // A connection that is not reading has work held back: not idle.
    h.s.tick(start + Duration::from_secs(20), false, &mut Outbox::new(4));
    assert_eq!(
        h.s.idle_for(start + Duration::from_secs(21)),
        Duration::from_secs(1)
    );
}

#[test]
fn no_ping_verdict_while_the_connection_is_not_reading() {
    let mut h = harness();
    let mut out = Outbox::new(4);
    // A ping goes out after the idle interval.
    h.s.tick(h.now + Duration::from_secs(6), true, &mut out);
    assert_eq!(decode_all(&out.to_vec(), &h.s.framing()).len(), 1);
    // The connection then stops reading for far longer than the NOP-In timeout (30 s): the
    // unanswered ping is not a dead peer, and no further ping is sent.
    for s in [10, 40, 70, 100] {
        let mut out = Outbox::new(4);
        assert_eq!(
            h.s.tick(h.now + Duration::from_secs(s), false, &mut out),
            Liveness::Continue
        );
        assert!(out.is_empty());
    }
    // Reading again, the answer has 30 s from there before the verdict.
    let resumed = h.now + Duration::from_secs(100);
    let mut out = Outbox::new(4);
    assert_eq!(
        h.s.tick(resumed + Duration::from_secs(29), true, &mut out),
        Liveness::Continue
    );
    assert_eq!(
        h.s.tick(resumed + Duration::from_secs(31), true, &mut out),
        Liveness::DeadPeer
    );
}

#[test]
fn digests_apply_to_everything_sent() {
    let mut p = params();
    p.header_digest = true;
    p.data_digest = true;
    let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
    h.b.read_data = vec![5; 1000];
    let cmd = h.command(&READ10, 0xc0, 1000, 1);
    let (_, r) = h.send(cmd, &[]);
    assert_eq!(r[0].1, vec![5; 1000]);
}

/// Encodes `cmd` (no data), hands it to the session and returns what the session queued.
fn handle_to_outbox(h: &mut Harness, cmd: &Bhs) -> Outbox {
    let framing = h.s.framing();
    let mut wire = Vec::new();
    pdu::encode_into(&mut wire, cmd, &[], &framing);
    let pdu = parse_frame(&wire, &framing).unwrap();
    let mut out = Outbox::new(8);
    h.s.handle(&pdu, h.now, &mut h.b, &mut out);
    out
}

/// The raw bytes a read sends (not decoded, so any difference shows).
fn read_wire(lend_slice_bytes: usize, digests: bool, edtl: u32) -> Vec<u8> {
    read_wire_from(lend_slice_bytes, None, digests, edtl, 0x01)
}

/// A file holding `data` at `FILE_AT`, unlinked at once (the open handle keeps the bytes).
fn file_holding(data: &[u8]) -> std::sync::Arc<std::fs::File> {
    use std::os::unix::fs::FileExt;
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("ferrosan-session-file-{}-{n}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file.write_all_at(data, FILE_AT).unwrap();
    std::sync::Arc::new(file)
}

fn read_wire_from(
    lend_slice_bytes: usize,
    lend_file: Option<std::sync::Arc<std::fs::File>>,
    digests: bool,
    edtl: u32,
    task_attr: u8,
) -> Vec<u8> {
    let mut p = params();
    p.header_digest = digests;
    p.data_digest = digests;
    let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
    h.b.read_data = (0..20001u32).map(|i| (i * 31 % 251) as u8).collect();
    h.b.lend_slice_bytes = lend_slice_bytes;
    h.b.lend_file = lend_file;
    let cmd = h.command(&READ10, 0xc0 | task_attr, edtl, 9);
    let framing = h.s.framing();
    let bytes = handle_to_outbox(&mut h, &cmd).to_vec();
    // Every PDU (and digest) decodes.
    assert!(!decode_all(&bytes, &framing).is_empty());
    bytes
}

#[test]
fn lent_reads_send_the_same_bytes_as_copied_reads() {
    for digests in [false, true] {
        for edtl in [20001, 20000, 8192, 100, 30000] {
            let copied = read_wire(0, digests, edtl);
            // Slices smaller than, straddling and larger than the 8 KiB PDUs.
            for slice in [1000, 4096, 5000, 65536] {
                assert_eq!(
                    read_wire(slice, digests, edtl),
                    copied,
                    "slice {slice}, digests {digests}, edtl {edtl}"
                );
            }
        }
    }
}

#[test]
fn file_reads_send_the_same_bytes_as_copied_reads() {
    let data: Vec<u8> = (0..20001u32).map(|i| (i * 31 % 251) as u8).collect();
    let file = file_holding(&data);
    for digests in [false, true] {
        for edtl in [20001, 20000, 8192, 100, 30000] {
            for attr in [0, 1, 2, 3] {
                let copied = read_wire(0, digests, edtl);
                let from_file = read_wire_from(0, Some(file.clone()), digests, edtl, attr);
                assert_eq!(
                    from_file, copied,
                    "digests {digests}, edtl {edtl}, attr {attr}"
                );
            }
        }
    }
}

#[test]
fn only_simple_reads_without_data_digests_may_lend_files() {
    for (digests, attr, read, want) in [
        (false, 0, true, true),
        (false, 1, true, true),
        (false, 2, true, false), // ORDERED
        (false, 3, true, false), // HEAD OF QUEUE
        (true, 1, true, false),
        (false, 1, false, false),
    ] {
        let mut p = params();
        p.data_digest = digests;
        let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
        h.b.read_data = vec![1; 512];
        let flags = if read { 0xc0 } else { 0x80 } | attr;
        let cmd = h.command(&READ10, flags, if read { 512 } else { 0 }, 3);
        let _ = h.send(cmd, &[]);
        assert_eq!(
            h.b.may_lend_file,
            vec![want],
            "digests {digests}, attr {attr}"
        );
    }
}

#[test]
fn a_file_lent_against_the_request_fails_the_command_instead_of_sending_it() {
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let file = file_holding(&data);
    // Data digests on (no bytes to digest) and an ORDERED read without digests (pages may change).
    for (digests, attr) in [(true, 1), (false, 2)] {
        let mut p = params();
        p.header_digest = digests;
        p.data_digest = digests;
        let mut h = harness_with(SessionType::Normal, p, SessionLimits::default());
        h.b.read_data = data.clone();
        h.b.lend_file = Some(file.clone());
        h.b.ignore_may_lend_file = true;
        let cmd = h.command(&READ10, 0xc0 | attr, 8192, 5);
        let framing = h.s.framing();
        let out = handle_to_outbox(&mut h, &cmd);
        assert!(
            out.parts()
                .iter()
                .all(|p| !matches!(p, seam::outbox::Part::File { .. })),
            "digests {digests}, attr {attr}: no file part queued"
        );
        let pdus = decode_all(&out.to_vec(), &framing);
        assert_eq!(pdus.len(), 1, "only a SCSI Response, no Data-In");
        let (bhs, data) = &pdus[0];
        assert_eq!(bhs.opcode_raw(), Opcode::ScsiResponse as u8);
        assert_eq!(bhs.byte(off::STATUS), status::CHECK_CONDITION);
        // Sense length, then fixed-format sense: HARDWARE ERROR, INTERNAL TARGET FAILURE.
        assert_eq!(&data[..2], &[0, 18]);
        assert_eq!(
            (data[2 + 2] & 0x0f, data[2 + 12], data[2 + 13]),
            (0x04, 0x44, 0x00)
        );
        // The whole expected length is residual.
        assert_eq!(bhs.u32_at(off::RESIDUAL), 8192);
    }
}

#[test]
fn file_payloads_are_queued_as_file_parts_and_consumed_in_place() {
    let data: Vec<u8> = (0..20001u32).map(|i| (i * 7 % 253) as u8).collect();
    let file = file_holding(&data);
    let mut h = harness_with(SessionType::Normal, params(), SessionLimits::default());
    h.b.read_data = data.clone();
    h.b.lend_file = Some(file);
    let cmd = h.command(&READ10, 0xc1, 20001, 4);
    let mut out = handle_to_outbox(&mut h, &cmd);
    // 8 KiB PDUs: 8192 + 8192 + 3617 bytes from the file, each after its header.
    let files: Vec<(u64, usize)> = out
        .parts()
        .iter()
        .filter_map(|p| match p {
            seam::outbox::Part::File { offset, len, .. } => Some((*offset, *len)),
            _ => None,
        })
        .collect();
    assert_eq!(
        files,
        vec![
            (FILE_AT, 8192),
            (FILE_AT + 8192, 8192),
            (FILE_AT + 16384, 3617)
        ]
    );
    assert!(out
        .parts()
        .iter()
        .all(|p| out.file(p).is_some() == matches!(p, seam::outbox::Part::File { .. })));
    let whole = out.to_vec();
    // A partial send that stops inside the first file part resumes at the right file offset.
    out.consume(48 + 1000);
    assert_eq!(out.to_vec(), &whole[48 + 1000..]);
    assert!(matches!(
        out.parts().first(),
        Some(seam::outbox::Part::File { offset, len: 7192, .. }) if *offset == FILE_AT + 1000
    ));
    out.consume(7192 + 48 + 8191);
    assert_eq!(out.to_vec(), &whole[48 + 8192 + 48 + 8191..]);
}

#[test]
fn extended_cdb_from_ahs() {
    let mut h = harness();
    let mut cmd = h.command(&READ10, 0xc0, 0, 1);
    cmd.0[4] = 2; // 8 bytes of AHS
    let framing = h.s.framing();
    let mut wire = Vec::new();
    pdu::encode_into(&mut wire, &cmd, &[], &framing);
    // Insert the AHS: length 5 (4 CDB bytes + reserved), type 1.
    let ahs = [0u8, 5, 1, 0, 0xaa, 0xbb, 0xcc, 0xdd];
    wire.splice(48..48, ahs);
    let pdu = parse_frame(&wire, &framing).unwrap();
    let mut out = Outbox::new(4);
    h.s.handle(&pdu, h.now, &mut h.b, &mut out);
    assert_eq!(h.b.executed[0].0.len(), 20);
    assert_eq!(&h.b.executed[0].0[16..], &[0xaa, 0xbb, 0xcc, 0xdd]);
}

#[test]
fn deferred_commands_complete_later_and_shrink_the_window() {
    let limits = SessionLimits {
        queue_depth: 4,
        ..SessionLimits::default()
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    h.b.defer = true;
    assert_eq!(h.s.max_cmd_sn(), 1 + 3);
    let mut last = Bhs::new(Opcode::NopIn);
    for itt in 1..=3u32 {
        let cmd = h.command(&WRITE10, 0xa0, 512, itt);
        let (_, r) = h.send(cmd, &[7; 512]);
        assert!(r.is_empty(), "nothing is sent until the backend completes");
        last = cmd;
    }
    let _ = last;
    assert_eq!(h.s.running_tasks(), 3);
    // Completing one sends its status; the window reflects the two still running.
    let mut out = Outbox::new(4);
    let good = ScsiOutcome {
        status: status::GOOD,
        transfer_len: 512,
    };
    assert!(h.s.complete(2, good, Vec::new(), &[], &mut out));
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.itt(), 2);
    assert_eq!(r[0].0.byte(off::STATUS), status::GOOD);
    assert_eq!(r[0].0.u32_at(off::EXP_CMD_SN), 4);
    // ExpCmdSN 4, 2 running: 2 slots, MaxCmdSN 5 (it never goes below the first grant of 4).
    assert_eq!(r[0].0.u32_at(off::MAX_CMD_SN), 5);
    // An unknown ITT is not completed twice.
    assert!(!h.s.complete(2, good, Vec::new(), &[], &mut out));
}

#[test]
fn deferred_writes_hand_over_their_data() {
    let mut h = harness();
    h.b.defer = true;
    // Immediate data only: copied into a pooled buffer (it lives in the receive buffer).
    let cmd = h.command(&WRITE10, 0xa0, 4096, 31);
    let (_, r) = h.send(cmd, &[5; 4096]);
    assert!(r.is_empty());
    // Data-Out PDUs: the task's own assembly buffer is handed over.
    let payload: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
    let cmd = h.command(&WRITE10, 0x20, 8192, 32);
    h.send(cmd, &payload[..4096]);
    let (_, r) = h.send(data_out(32, RESERVED_TAG, 0, 4096, true), &payload[4096..]);
    assert!(r.is_empty(), "no status before the backend completes");
    // A read hands over no data.
    let cmd = h.command(&READ10, 0xc0, 4096, 33);
    h.send(cmd, &[]);
    assert_eq!(h.b.deferred, vec![31, 32, 33]);
    assert_eq!(h.b.deferred_data[0], vec![5; 4096]);
    assert_eq!(h.b.deferred_data[1], payload);
    assert!(h.b.deferred_data[2].is_empty());
    assert_eq!(h.s.running_tasks(), 3);
    assert_eq!(
        h.s.pending_writes(),
        0,
        "a handed-over write no longer waits for data"
    );
}

#[test]
fn deferred_writes_arrive_in_engine_memory_when_the_engine_supplies_it() {
    let mut h = harness();
    h.b.defer = true;
    h.b.engine_memory = true;
    // Immediate data only, then immediate + unsolicited Data-Out, then placed Data-Out.
    let cmd = h.command(&WRITE10, 0xa0, 4096, 41);
    h.send(cmd, &[5; 4096]);
    let payload: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let cmd = h.command(&WRITE10, 0x20, 8192, 42);
    h.send(cmd, &payload[..4096]);
    h.send(data_out(42, RESERVED_TAG, 0, 4096, true), &payload[4096..]);
    let cmd = h.command(&WRITE10, 0x20, 8192, 43);
    h.send(cmd, &payload[..4096]);
    let mut bhs = data_out(43, RESERVED_TAG, 0, 4096, true);
    bhs.set_data_segment_len(4096);
    let dst = h.s.data_out_destination(&bhs).expect("accepted in place");
    dst.copy_from_slice(&payload[4096..]);
    let mut out = Outbox::new(4);
    h.s.handle_placed_data_out(&bhs, Instant::now(), &mut h.b, &mut out);
    assert_eq!(
        h.b.memory_asked,
        vec![4096, 8192, 8192],
        "exactly EDTL each"
    );
    assert_eq!(h.b.deferred, vec![41, 42, 43]);
    assert_eq!(h.b.deferred_in_engine_memory, vec![true, true, true]);
    assert_eq!(h.b.deferred_data[0], vec![5; 4096]);
    assert_eq!(h.b.deferred_data[1], payload, "every byte overwritten");
    assert_eq!(h.b.deferred_data[2], payload);
}

#[test]
fn engine_memory_of_the_wrong_length_is_not_used() {
    let mut h = harness();
    h.b.defer = true;
    h.b.engine_memory = true;
    h.b.engine_memory_extra = 512;
    let cmd = h.command(&WRITE10, 0xa0, 4096, 51);
    h.send(cmd, &[9; 4096]);
    let payload: Vec<u8> = (0..8192u32).map(|i| (i % 249) as u8).collect();
    let cmd = h.command(&WRITE10, 0x20, 8192, 52);
    h.send(cmd, &payload[..4096]);
    h.send(data_out(52, RESERVED_TAG, 0, 4096, true), &payload[4096..]);
    assert_eq!(h.b.memory_asked, vec![4096, 8192]);
    assert_eq!(h.b.deferred_in_engine_memory, vec![false, false]);
    assert_eq!(h.b.deferred_data[0], vec![9; 4096]);
    assert_eq!(h.b.deferred_data[1], payload);
}

#[test]
fn deferred_read_returns_data_and_sense_on_completion() {
    let mut h = harness();
    h.b.defer = true;
    let cmd = h.command(&READ10, 0xc0, 4096, 9);
    let (_, r) = h.send(cmd, &[]);
    assert!(r.is_empty());
    let mut out = Outbox::new(4);
    let ok = ScsiOutcome {
        status: status::GOOD,
        transfer_len: 4096,
    };
    assert!(h.s.complete(9, ok, vec![3; 4096], &[], &mut out));
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::DataIn as u8);
    assert_eq!(r[0].0.flags() & 0x01, 0x01, "status in the Data-In");
    assert_eq!(r[0].1, vec![3; 4096]);
    // With sense: a SCSI Response carries it.
    let cmd = h.command(&READ10, 0xc0, 4096, 10);
    h.send(cmd, &[]);
    let mut out = Outbox::new(4);
    let bad = ScsiOutcome {
        status: status::CHECK_CONDITION,
        transfer_len: 0,
    };
    let sense = [0x70, 0, 3, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x11, 0, 0, 0, 0, 0];
    assert!(h.s.complete(10, bad, Vec::new(), &sense, &mut out));
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r[0].0.opcode_raw(), Opcode::ScsiResponse as u8);
    assert_eq!(r[0].0.byte(off::STATUS), status::CHECK_CONDITION);
    assert_eq!(&r[0].1[2..], &sense);
}

#[test]
fn a_deferred_read_takes_the_connections_recycled_buffer() {
    let mut h = harness();
    h.b.defer = true;
    h.recycled = Some(vec![0xaa; 4096]);
    let cmd = h.command(&READ10, 0xc0, 4096, 9);
    let (_, r) = h.send(cmd, &[]);
    assert!(
        r.is_empty(),
        "nothing is answered before the read completes"
    );
    // The spare the session lent to `execute` went back to the pool on deferral and on to
    // the read: its memory, not a fresh allocation.
    assert_eq!(h.b.read_buffers.len(), 1);
    assert_eq!(h.b.read_buffers[0].capacity(), 4096);
    // A deferred write takes none.
    h.recycled = Some(vec![0xbb; 512]);
    let cmd = h.command(&WRITE10, 0xa0, 4096, 10);
    h.send(cmd, &[5; 4096]);
    assert_eq!(h.b.deferred, vec![9, 10]);
    assert_eq!(h.b.read_buffers.len(), 1);
}

#[test]
fn deferred_read_completed_with_a_loan_sends_the_lent_bytes() {
    let mut h = harness();
    h.b.defer = true;
    let cmd = h.command(&READ10, 0xc0, 4096, 11);
    h.send(cmd, &[]);
    let mut out = Outbox::new(4);
    let ok = ScsiOutcome {
        status: status::GOOD,
        transfer_len: 4096,
    };
    let bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> = std::sync::Arc::new(vec![7u8; 4096]);
    let mut loan = Loan {
        slices: vec![(bytes, 0..4096)],
        file: None,
    };
    assert!(h.s.complete_lent(11, ok, &mut loan, &[], &mut out));
    assert!(loan.is_empty(), "the loan is handed to the outbox");
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.opcode_raw(), Opcode::DataIn as u8);
    assert_eq!(r[0].0.flags() & 0x01, 0x01, "status in the Data-In");
    assert_eq!(r[0].1, vec![7u8; 4096]);
    // Unknown task: nothing sent, the loan released.
    let bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> = std::sync::Arc::new(vec![1u8; 8]);
    let mut loan = Loan {
        slices: vec![(bytes, 0..8)],
        file: None,
    };
    let mut out = Outbox::new(4);
    assert!(!h.s.complete_lent(99, ok, &mut loan, &[], &mut out));
    assert!(loan.is_empty() && out.to_vec().is_empty());
}

#[test]
fn tmf_responses_wait_for_the_tasks_they_abort() {
    let mut h = harness();
    h.b.defer = true;
    for itt in [21, 22] {
        let cmd = h.command(&WRITE10, 0xa0, 512, itt);
        h.send(cmd, &[1; 512]);
    }
    let mut tmf = Bhs::new(Opcode::TaskMgmtRequest);
    tmf.set_immediate(true);
    tmf.set_flags(0x80 | 1);
    tmf.set_itt(100);
    tmf.set_u32(off::REFERENCED_TASK_TAG, 21);
    tmf.set_u32(off::CMD_SN, h.cmd_sn);
    let (_, r) = h.send(tmf, &[]);
    assert!(
        r.is_empty(),
        "ABORT TASK of a running write waits until it can no longer reach the medium"
    );
    assert_eq!(h.s.pending_tmfs(), 1);
    let good = ScsiOutcome {
        status: status::GOOD,
        transfer_len: 512,
    };
    let mut out = Outbox::new(4);
    assert!(h.s.complete(21, good, Vec::new(), &[], &mut out));
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(
        r.len(),
        1,
        "the aborted task sends nothing, the TMF its response"
    );
    assert_eq!(r[0].0.opcode_raw(), Opcode::TaskMgmtResponse as u8);
    assert_eq!(r[0].0.itt(), 100);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
    // LU reset: waits for this session's task and for the engine (other sessions' commands).
    h.b.tmf_later = true;
    tmf.set_flags(0x80 | 5);
    tmf.set_itt(101);
    let (_, r) = h.send(tmf, &[]);
    assert!(r.is_empty());
    let mut out = Outbox::new(4);
    assert!(h.s.complete(22, good, Vec::new(), &[], &mut out));
    assert!(out.is_empty(), "the engine has not answered yet");
    assert_eq!(h.s.running_tasks(), 0);
    let mut out = Outbox::new(4);
    assert_eq!(
        h.s.task_management_done(101, tmf_response::COMPLETE, &mut out),
        Flow::Continue
    );
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.itt(), 101);
    assert_eq!(h.s.pending_tmfs(), 0);
    // The engine answered first, the session's own task completes later.
    let cmd = h.command(&WRITE10, 0xa0, 512, 23);
    h.send(cmd, &[1; 512]);
    tmf.set_itt(102);
    let (_, r) = h.send(tmf, &[]);
    assert!(r.is_empty());
    let mut out = Outbox::new(4);
    h.s.task_management_done(102, tmf_response::COMPLETE, &mut out);
    assert!(out.is_empty(), "task 23 still runs");
    assert!(h.s.complete(23, good, Vec::new(), &[], &mut out));
    let r = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.itt(), 102);
    // A cold reset closes the connection once its response is out.
    let cmd = h.command(&WRITE10, 0xa0, 512, 24);
    h.send(cmd, &[1; 512]);
    tmf.set_flags(0x80 | 7);
    tmf.set_itt(103);
    let (flow, r) = h.send(tmf, &[]);
    assert!(r.is_empty());
    assert_eq!(flow, Flow::Continue);
    let mut out = Outbox::new(4);
    assert!(h.s.complete(24, good, Vec::new(), &[], &mut out));
    assert!(out.is_empty());
    assert_eq!(
        h.s.task_management_done(103, tmf_response::COMPLETE, &mut out),
        Flow::Close
    );
    assert_eq!(decode_all(&out.to_vec(), &h.s.framing())[0].0.itt(), 103);
}

#[test]
fn tmfs_without_running_tasks_answer_at_once() {
    let mut h = harness();
    let mut tmf = Bhs::new(Opcode::TaskMgmtRequest);
    tmf.set_immediate(true);
    tmf.set_flags(0x80 | 2); // ABORT TASK SET
    tmf.set_itt(7);
    let (_, r) = h.send(tmf, &[]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.byte(off::RESPONSE), tmf_response::COMPLETE);
    assert_eq!(h.b.tmf, vec![TmfFunction::AbortTaskSet]);
}

#[test]
fn a_full_window_closes_and_reopens() {
    let limits = SessionLimits {
        queue_depth: 2,
        ..SessionLimits::default()
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    h.b.defer = true;
    let c1 = h.command(&WRITE10, 0xa0, 512, 1);
    h.send(c1, &[0; 512]);
    let c2 = h.command(&WRITE10, 0xa0, 512, 2);
    h.send(c2, &[0; 512]);
    // Window granted at login was [1, 2]; both used. A third beyond it is dropped.
    let c3 = h.command(&WRITE10, 0xa0, 512, 3);
    let (_, r) = h.send(c3, &[0; 512]);
    assert!(r.is_empty());
    assert_eq!(h.b.deferred, vec![1, 2]);
    let mut out = Outbox::new(4);
    let good = ScsiOutcome {
        status: status::GOOD,
        transfer_len: 512,
    };
    h.s.complete(1, good, Vec::new(), &[], &mut out);
    let r = decode_all(&out.to_vec(), &h.s.framing());
    // ExpCmdSN 3 with one task running: one slot, MaxCmdSN 3.
    assert_eq!(r[0].0.u32_at(off::MAX_CMD_SN), 3);
}

/// A TEST UNIT READY carrying `exp_stat_sn`.
fn tur_acknowledging(h: &mut Harness, itt: u32, exp_stat_sn: u32) -> Bhs {
    let mut b = h.command(&[0; 6], 0x80, 0, itt);
    b.set_u32(off::EXP_STAT_SN, exp_stat_sn);
    b
}

#[test]
fn activity_shows_the_initiators_unseen_responses() {
    let mut h = harness();
    assert_eq!(h.s.take_activity(), Activity::default());
    // Three commands sent without reading any answer: each sees one more unseen response.
    for itt in 0..3 {
        let b = tur_acknowledging(&mut h, itt, 1000);
        h.send(b, b"");
    }
    let a = h.s.take_activity();
    assert_eq!(a.commands, 3);
    assert_eq!(a.command_bytes, 3 * pdu::BHS_LEN as u64);
    assert_eq!(a.other_pdus, 0);
    assert_eq!(
        a.initiator_backlog, 2,
        "the third command had not seen StatSN 1000 and 1001"
    );
    assert_eq!(h.s.take_activity(), Activity::default(), "taking resets it");
    // An initiator that read every answer first shows no backlog.
    let b = tur_acknowledging(&mut h, 9, 1003);
    h.send(b, b"");
    assert_eq!(h.s.take_activity().initiator_backlog, 0);
}

#[test]
fn activity_counts_immediate_data_and_other_pdus() {
    let mut h = harness();
    let mut w = h.command(&WRITE10, 0xa0, 4096, 1);
    w.set_u32(off::EXP_STAT_SN, 1000);
    h.send(w, &[7u8; 4096]);
    let mut nop = Bhs::new(Opcode::NopOut);
    nop.set_flags(0x80);
    nop.set_itt(2);
    nop.set_u32(off::TTT, RESERVED_TAG);
    nop.set_u32(off::CMD_SN, h.cmd_sn);
    h.send(nop, b"");
    let a = h.s.take_activity();
    assert_eq!(a.commands, 1);
    assert_eq!(a.command_bytes, (pdu::BHS_LEN + 4096) as u64);
    assert_eq!(a.other_pdus, 1);
}

#[test]
fn activity_bounds_a_nonsense_exp_stat_sn() {
    let mut h = harness();
    // Far behind (or garbage): at most the command window.
    let b = tur_acknowledging(&mut h, 1, 1000u32.wrapping_sub(1_000_000));
    h.send(b, b"");
    assert_eq!(
        h.s.take_activity().initiator_backlog,
        SessionLimits::default().queue_depth
    );
    // Ahead of anything we sent: no backlog.
    let b = tur_acknowledging(&mut h, 2, 5000);
    h.send(b, b"");
    assert_eq!(h.s.take_activity().initiator_backlog, 0);
    // Across the wrap of the sequence space.
    let mut h = harness_with(SessionType::Normal, params(), SessionLimits::default());
    h.s.stat_sn = 2;
    let b = tur_acknowledging(&mut h, 3, u32::MAX);
    h.send(b, b"");
    assert_eq!(h.s.take_activity().initiator_backlog, 3);
}

#[test]
fn immediate_commands_beyond_the_queue_depth_get_task_set_full() {
    let limits = SessionLimits {
        queue_depth: 2,
        ..SessionLimits::default()
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    h.b.defer = true;
    for itt in 1..=2u32 {
        let cmd = h.command(&WRITE10, 0xa0, 512, itt);
        let (_, r) = h.send(cmd, &[0; 512]);
        assert!(r.is_empty());
    }
    // Immediate delivery bypasses the CmdSN window; the task set is still bounded.
    let mut cmd = h.command(&WRITE10, 0xa0, 512, 3);
    cmd.set_immediate(true);
    let (_, r) = h.send(cmd, &[0; 512]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0.itt(), 3);
    assert_eq!(r[0].0.byte(off::STATUS), status::TASK_SET_FULL);
    assert_eq!(h.s.running_tasks(), 2);
}

/// Runs `steps` (a command with immediate data, then its Data-Out) on two sessions: one handed
/// every PDU from its receive buffer, one whose command's immediate data arrives in place. What
/// the initiator sees and what the backend runs must not differ.
fn placed_and_usual(
    setup: impl Fn(&mut Harness),
    command: impl Fn(&mut Harness) -> Bhs,
    immediate: &[u8],
    data_outs: &[(Bhs, std::ops::Range<usize>)],
    payload: &[u8],
) -> [(Harness, Vec<Decoded>); 2] {
    let run = |placed: bool| {
        let mut h = harness();
        setup(&mut h);
        let cmd = command(&mut h);
        let first = if placed {
            h.send_placed_command(cmd, immediate)
                .expect("taken in place")
                .1
        } else {
            h.send(cmd, immediate).1
        };
        let mut answers = vec![first];
        for (bhs, range) in data_outs {
            answers.push(h.send(*bhs, &payload[range.clone()]).1);
        }
        (h, answers)
    };
    [run(false), run(true)]
}

#[test]
fn immediate_data_received_in_place_runs_like_the_usual_path() {
    let payload: Vec<u8> = (0..24576u32).map(|i| (i % 253) as u8).collect();
    // All of the write as immediate data, run by the backend at once.
    let [(usual, a), (placed, b)] = placed_and_usual(
        |_| {},
        |h| h.command(&WRITE10, 0xa0, 8192, 7),
        &payload[..8192],
        &[],
        &payload,
    );
    assert_eq!(a, b);
    assert_eq!(usual.b.executed, placed.b.executed);
    assert_eq!(placed.b.executed[0].1, payload[..8192]);
    // Immediate data, unsolicited Data-Out, then an R2T's Data-Out; deferred, in engine memory.
    let setup = |h: &mut Harness| {
        h.b.defer = true;
        h.b.engine_memory = true;
    };
    let [(usual, a), (placed, b)] = placed_and_usual(
        setup,
        |h| h.command(&WRITE10, 0x20, 24576, 8),
        &payload[..4096],
        &[
            (data_out(8, RESERVED_TAG, 0, 4096, true), 4096..8192),
            // The harness's session hands out TTTs from 1.
            (data_out(8, 1, 0, 8192, true), 8192..24576),
        ],
        &payload,
    );
    assert_eq!(a, b, "the same R2T, the same answers");
    assert_eq!(usual.b.deferred, vec![8]);
    assert_eq!(placed.b.deferred, vec![8]);
    assert_eq!(
        placed.b.deferred_data[0], payload,
        "every byte where it belongs"
    );
    assert_eq!(placed.b.deferred_in_engine_memory, vec![true]);
    assert_eq!(
        placed.b.memory_asked,
        vec![24576],
        "one buffer of EDTL bytes"
    );
    assert_eq!(placed.s.pending_writes(), 0);
    assert_eq!(placed.s.running_tasks(), 1);
}

#[test]
fn a_placed_command_counts_as_a_command_with_its_data() {
    let mut h = harness();
    let _ = h.s.take_activity();
    let cmd = h.command(&WRITE10, 0xa0, 8192, 9);
    assert!(h.send_placed_command(cmd, &[3u8; 8192]).is_some());
    let activity = h.s.take_activity();
    assert_eq!(activity.commands, 1);
    assert_eq!(activity.command_bytes, (pdu::BHS_LEN + 8192) as u64);
    assert_eq!(h.s.exp_cmd_sn(), 2, "CmdSN advanced once");
}

#[test]
fn commands_the_session_would_not_take_at_once_have_no_destination() {
    let data = [4u8; 4096];
    type MakeCommand = Box<dyn Fn(&mut Harness) -> Bhs>;
    let cases: Vec<(&str, MakeCommand)> = vec![
        (
            "CmdSN ahead of ExpCmdSN (kept out of order)",
            Box::new(|h| {
                h.cmd_sn += 1;
                h.command(&WRITE10, 0x20, 8192, 20)
            }),
        ),
        (
            "immediate delivery",
            Box::new(|h| {
                let mut b = h.command(&WRITE10, 0x20, 8192, 20);
                b.set_immediate(true);
                b
            }),
        ),
        ("a read", Box::new(|h| h.command(&READ10, 0xc0, 4096, 20))),
        (
            "more data than EDTL",
            Box::new(|h| h.command(&WRITE10, 0xa0, 2048, 20)),
        ),
        (
            "more than FirstBurstLength",
            Box::new(|h| {
                let mut b = h.command(&WRITE10, 0x20, 65536, 20);
                b.set_data_segment_len(8193);
                b
            }),
        ),
        (
            "an AHS",
            Box::new(|h| {
                let mut b = h.command(&WRITE10, 0x20, 8192, 20);
                b.0[4] = 1;
                b
            }),
        ),
        (
            "the ITT of a write still pending",
            Box::new(|h| {
                let pending = h.command(&WRITE10, 0x20, 16384, 20);
                let _ = h.send(pending, &[1u8; 4096]);
                h.command(&WRITE10, 0x20, 8192, 20)
            }),
        ),
        (
            "a write larger than max_write_bytes",
            Box::new(|h| {
                h.command(
                    &WRITE10,
                    0x20,
                    SessionLimits::default().max_write_bytes + 512,
                    20,
                )
            }),
        ),
        (
            "not a SCSI Command",
            Box::new(|h| {
                let mut b = h.command(&WRITE10, 0x20, 8192, 20);
                b.0[0] = Opcode::NopOut as u8;
                b
            }),
        ),
    ];
    for (why, make) in cases {
        let mut h = harness();
        let mut bhs = make(&mut h);
        if bhs.data_segment_len() == 0 {
            bhs.set_data_segment_len(data.len());
        }
        let pending = h.s.pending_writes();
        let mut out = Outbox::new(4);
        assert!(
            h.s.command_data_destination(&bhs, &mut h.b, &mut out)
                .is_none(),
            "{why}"
        );
        assert!(out.is_empty(), "{why}: nothing answered");
        assert_eq!(h.s.pending_writes(), pending, "{why}: nothing changed");
        // The session still takes the next good command in place.
        h.cmd_sn = h.s.exp_cmd_sn();
        let good = h.command(&WRITE10, 0xa0, 4096, 99);
        assert!(h.send_placed_command(good, &data).is_some(), "{why}");
    }
    // Session-wide refusals: digests, ImmediateData=No, a discovery session.
    for (why, p, kind) in [
        (
            "header digest",
            {
                let mut p = params();
                p.header_digest = true;
                p
            },
            SessionType::Normal,
        ),
        (
            "data digest",
            {
                let mut p = params();
                p.data_digest = true;
                p
            },
            SessionType::Normal,
        ),
        (
            "ImmediateData=No",
            {
                let mut p = params();
                p.immediate_data = false;
                p
            },
            SessionType::Normal,
        ),
        ("discovery session", params(), SessionType::Discovery),
    ] {
        let mut h = harness_with(kind, p, SessionLimits::default());
        let cmd = h.command(&WRITE10, 0xa0, 4096, 1);
        assert!(h.send_placed_command(cmd, &data).is_none(), "{why}");
    }
}

#[test]
fn activity_counts_the_commands_in_flight_when_one_arrives() {
    let mut h = harness();
    h.b.defer = true;
    let _ = h.s.take_activity();
    for itt in 1..=3 {
        let cmd = h.command(&READ10, 0xc0, 4096, itt);
        h.send(cmd, &[]);
    }
    // A write still waiting for its Data-Out counts too.
    let cmd = h.command(&WRITE10, 0x20, 16384, 4);
    h.send(cmd, &[1u8; 4096]);
    let activity = h.s.take_activity();
    assert_eq!(activity.commands, 4);
    assert_eq!(
        activity.in_flight, 3,
        "the last arrived with three before it"
    );
    let cmd = h.command(&READ10, 0xc0, 4096, 5);
    h.send(cmd, &[]);
    assert_eq!(h.s.take_activity().in_flight, 4);
    assert_eq!(h.s.take_activity(), Activity::default(), "taken: reset");
}

#[test]
fn the_next_deadline_is_the_first_instant_a_tick_acts_on() {
    let mut h = harness();
    let start = h.now;
    let due =
        h.s.next_deadline()
            .expect("a ping is due on a silent connection");
    assert_eq!(due, start + Duration::from_secs(5));
    let mut out = Outbox::new(4);
    let just_before = due - Duration::from_millis(1);
    assert_eq!(h.s.tick(just_before, true, &mut out), Liveness::Continue);
    assert!(out.is_empty(), "nothing before the deadline");
    h.s.tick(due, true, &mut out);
    let ping = decode_all(&out.to_vec(), &h.s.framing());
    assert_eq!(ping[0].0.opcode_raw(), Opcode::NopIn as u8);
    // Unanswered, it is looked at where the next ping would fall had it been answered (an
    // interval after it), then its timeout is next, and the peer is dead exactly then.
    assert_eq!(h.s.next_deadline(), Some(due + Duration::from_secs(5)));
    let mut out = Outbox::new(4);
    let interval_on = due + Duration::from_secs(5);
    assert_eq!(h.s.tick(interval_on, true, &mut out), Liveness::Continue);
    assert!(out.is_empty(), "no second ping while one is unanswered");
    let timeout = h.s.next_deadline().unwrap();
    assert_eq!(timeout, due + Duration::from_secs(30));
    let before = timeout - Duration::from_millis(1);
    assert_eq!(h.s.tick(before, true, &mut out), Liveness::Continue);
    assert_eq!(h.s.tick(timeout, true, &mut out), Liveness::DeadPeer);
}

/// An answered ping leaves the deadline armed when it went out: the next ping is an interval
/// after this one, not after its answer (an idle connection's alarm is set once a ping). An
/// answer later than the interval has the next ping go out at once.
#[test]
fn the_next_ping_is_an_interval_after_the_last_one() {
    let ping_at = |h: &mut Harness, at: Instant| {
        let mut out = Outbox::new(4);
        h.s.tick(at, true, &mut out);
        let sent = decode_all(&out.to_vec(), &h.s.framing());
        assert_eq!(sent.len(), 1, "one ping at {at:?}");
        sent[0].0.u32_at(off::TTT)
    };
    let mut h = harness();
    let due = h.s.next_deadline().unwrap();
    let ttt = ping_at(&mut h, due);
    let armed = h.s.next_deadline();
    assert_eq!(armed, Some(due + Duration::from_secs(5)));
    h.now = due + Duration::from_millis(1);
    h.send(immediate_nop_out(RESERVED_TAG, ttt), &[]);
    assert_eq!(h.s.next_deadline(), armed, "the answer leaves it");
    ping_at(&mut h, armed.unwrap());

    // Answered 7 s after it went out: overdue, the next ping is due at once.
    let mut h = harness();
    let due = h.s.next_deadline().unwrap();
    let ttt = ping_at(&mut h, due);
    h.s.tick(due + Duration::from_secs(5), true, &mut Outbox::new(4));
    h.now = due + Duration::from_secs(7);
    h.send(immediate_nop_out(RESERVED_TAG, ttt), &[]);
    assert_eq!(h.s.next_deadline(), Some(due + Duration::from_secs(5)));
    let now = h.now;
    ping_at(&mut h, now);
}

#[test]
fn without_pings_the_idle_timeout_is_the_only_deadline_and_none_without_it() {
    let quiet = SessionLimits {
        nop_interval: Duration::ZERO,
        ..SessionLimits::default()
    };
    let h = harness_with(SessionType::Normal, params(), quiet);
    assert_eq!(h.s.next_deadline(), None, "nothing wakes such a session");
    let limits = SessionLimits {
        idle_timeout: Duration::from_secs(60),
        ..quiet
    };
    let mut h = harness_with(SessionType::Normal, params(), limits);
    let due = h.s.next_deadline().unwrap();
    assert_eq!(due, h.now + Duration::from_secs(60));
    let mut out = Outbox::new(4);
    let before = due - Duration::from_millis(1);
    assert_eq!(h.s.tick(before, true, &mut out), Liveness::Continue);
    assert_eq!(h.s.tick(due, true, &mut out), Liveness::Idle);
}
