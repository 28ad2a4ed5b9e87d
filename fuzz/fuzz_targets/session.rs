//! Full feature phase: a `Session` built directly, driven by arbitrary PDU sequences (structured
//! SCSI commands, Data-Out, TMF, text, NOP, logout, raw headers) and timer ticks, against a fake
//! SCSI backend. Invariants: the outbox always decodes as well-formed target PDUs with digests,
//! consecutive StatSNs and the advertised window; pending writes stay within the limits.
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use iscsi::negotiation::{SessionParams, SessionType, TargetLimits};
use iscsi::pdu::{self, off, Bhs, Framing, Opcode, Pdu, BHS_LEN, RESERVED_TAG};
use iscsi::session::{DiscoveredTarget, Flow, IscsiBackend, Session, SessionLimits};
use libfuzzer_sys::fuzz_target;
use seam::outbox::{Outbox, ReadBuffers};
use seam::{
    DeferredCommand, Execution, Liveness, ScsiBackend, ScsiOutcome, ScsiRequest, TmfAnswer,
    TmfFunction,
};

/// A file holding the same bytes the backend copies (`i as u8` at offset `i`, 1 MiB), created
/// once per fuzzing process and unlinked at once (the open handle keeps it).
fn pattern_file() -> std::sync::Arc<std::fs::File> {
    static FILE: std::sync::OnceLock<std::sync::Arc<std::fs::File>> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        use std::io::Write;
        let path =
            std::env::temp_dir().join(format!("ferrosan-fuzz-session-{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create the pattern file");
        let _ = std::fs::remove_file(&path);
        let bytes: Vec<u8> = (0..1usize << 20).map(|i| i as u8).collect();
        file.write_all(&bytes).expect("write the pattern file");
        std::sync::Arc::new(file)
    })
    .clone()
}

#[derive(Arbitrary, Debug, Clone)]
struct Backend {
    /// How much Data-In to produce relative to the expected length.
    extra: i16,
    status: u8,
    sense_len: u8,
    transfer_len: Option<u32>,
    tmf_response: u8,
    /// LU-level TMFs are answered later, by `Op::TmfDone` (other sessions' commands running).
    tmf_later: bool,
    #[arbitrary(default)]
    tmfs_later: Vec<u32>,
    /// Nonzero: reads lend their data in slices of this many bytes (zero-copy) instead of
    /// copying it.
    lend_slice: u16,
    /// Reads the request allows it for lend their data as a range of a file (sendfile).
    lend_file: bool,
    /// Every n-th command is deferred (0: never), completed later by `Op::Complete`.
    defer_every: u8,
    #[arbitrary(default)]
    commands: u32,
    #[arbitrary(default)]
    deferred: Vec<(u32, bool)>,
    /// Set by `execute` answering Deferred; the hand-over must follow at once.
    #[arbitrary(default)]
    deferring: bool,
}

impl ScsiBackend for Backend {
    fn execute(
        &mut self,
        req: &ScsiRequest<'_>,
        data_in: &mut Vec<u8>,
        lent: &mut seam::Loan,
        sense: &mut Vec<u8>,
    ) -> Execution {
        assert!(
            (data_in.is_empty() || req.read) && lent.is_empty() && sense.is_empty(),
            "buffers arrive empty (a read's may hold old bytes to overwrite)"
        );
        // The contract: whatever the outcome, `data_in` ends up holding exactly the Data-In.
        data_in.clear();
        self.commands = self.commands.wrapping_add(1);
        if self.defer_every != 0 && self.commands % self.defer_every as u32 == 0 {
            self.deferring = true;
            return Execution::Deferred;
        }
        assert!(!(req.read && req.write));
        assert!(req.cdb.len() >= 16);
        assert!(req.data_out.len() <= req.expected_len as usize || !req.write);
        if req.write {
            assert_eq!(
                req.data_out.len(),
                req.expected_len as usize,
                "writes run complete"
            );
        }
        if req.read {
            let n = (req.expected_len as i64 + self.extra as i64).clamp(0, 1 << 20) as usize;
            if self.lend_file && req.may_lend_file {
                assert!(
                    req.task_attr <= 1,
                    "only SIMPLE or untagged reads may lend files"
                );
                lent.file = Some((pattern_file(), 0, n));
            } else if self.lend_slice == 0 {
                data_in.extend((0..n).map(|i| i as u8));
            } else {
                let owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> =
                    std::sync::Arc::new((0..n).map(|i| i as u8).collect::<Vec<u8>>());
                let step = usize::from(self.lend_slice);
                for start in (0..n).step_by(step) {
                    lent.slices
                        .push((owner.clone(), start..(start + step).min(n)));
                }
            }
        }
        if self.status == 2 {
            sense.extend((0..self.sense_len.max(8)).map(|i| i ^ 0x70));
        }
        Execution::Done(ScsiOutcome {
            status: self.status,
            transfer_len: self.transfer_len.unwrap_or(req.expected_len),
        })
    }
    fn defer(&mut self, command: DeferredCommand, _buffers: ReadBuffers<'_>) {
        assert!(
            std::mem::take(&mut self.deferring),
            "handed over without a Deferred answer"
        );
        if command.write {
            assert_eq!(
                command.data_out.len(),
                command.expected_len as usize,
                "a deferred write owns all its data"
            );
        } else {
            assert!(command.data_out.is_empty());
        }
        self.deferred.push((command.tag, command.read));
    }

    fn lun_exists(&mut self, lun: [u8; 8]) -> bool {
        lun[0] == 0
    }
    fn task_management(&mut self, itt: u32, _f: TmfFunction, _lun: [u8; 8]) -> TmfAnswer {
        if self.tmf_later {
            self.tmfs_later.push(itt);
            TmfAnswer::Later
        } else {
            TmfAnswer::Now(self.tmf_response)
        }
    }
}

impl IscsiBackend for Backend {
    fn send_targets(&mut self, filter: Option<&str>) -> Vec<DiscoveredTarget> {
        let all: Vec<DiscoveredTarget> = (0..40)
            .map(|i| DiscoveredTarget {
                name: format!("iqn.2026-11.org.ferrosan:target-number-{i:04}"),
                addresses: vec![format!("127.0.0.{i}:3260,1"), "[::1]:3260,1".into()],
            })
            .collect();
        all.into_iter()
            .filter(|t| filter.is_none_or(|f| f.is_empty() || f == t.name))
            .collect()
    }
}

#[derive(Arbitrary, Debug)]
struct Setup {
    discovery: bool,
    header_digest: bool,
    data_digest: bool,
    initial_r2t: bool,
    immediate_data: bool,
    max_burst: u16,
    first_burst: u16,
    max_r2t: u8,
    max_xmit: u16,
    max_recv: u16,
    queue_depth: u8,
    max_write_bytes: u32,
    max_pending_write_bytes: u32,
    stat_sn: u32,
    exp_cmd_sn: u32,
    backend: Backend,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Command {
        sn: SnChoice,
        immediate: bool,
        flags: u8,
        itt: ItChoice,
        edtl: u16,
        lun0: u8,
        cdb: [u8; 16],
        imm_len: u16,
        ahs: Vec<u8>,
        /// Immediate data received in place (Session::command_data_destination), if taken.
        in_place: bool,
    },
    DataOut {
        itt: ItChoice,
        ttt: TttChoice,
        final_bit: bool,
        data_sn: u8,
        offset: u16,
        len: u16,
        /// Received the way the engine takes long payloads: into the slice the session names
        /// (when it names one), then only the header handed over.
        in_place: bool,
    },
    Tmf {
        sn: SnChoice,
        immediate: bool,
        function: u8,
        lun0: u8,
        referenced: ItChoice,
        ref_cmd_sn: u32,
    },
    Text {
        sn: SnChoice,
        continued: bool,
        final_bit: bool,
        ttt: TttChoice,
        data: Vec<u8>,
    },
    Nop {
        sn: SnChoice,
        itt: u32,
        ttt: TttChoice,
        data: Vec<u8>,
    },
    Logout {
        sn: SnChoice,
        reason: u8,
    },
    Raw {
        bhs: [u8; BHS_LEN],
        sn: SnChoice,
        data: Vec<u8>,
    },
    Tick {
        secs: u8,
        /// False: the connection is not reading (its memory budget is full).
        reading: bool,
    },
    /// The backend finishes one of the commands it deferred.
    Complete {
        pick: u8,
        status: u8,
        data_len: u16,
        sense_len: u8,
    },
    /// The engine's part of a TMF answered `Later` is done.
    TmfDone {
        pick: u8,
        response: u8,
    },
    DigestError {
        bhs: [u8; BHS_LEN],
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum SnChoice {
    Expected,
    Ahead(u8),
    Behind(u8),
    Any(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum ItChoice {
    Small(u8),
    Reserved,
    Any(u32),
}

impl ItChoice {
    fn get(self) -> u32 {
        match self {
            ItChoice::Small(v) => v as u32 % 8,
            ItChoice::Reserved => RESERVED_TAG,
            ItChoice::Any(v) => v,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum TttChoice {
    Reserved,
    /// One of the TTTs the session handed out lately.
    Recent(u8),
    Any(u32),
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

/// What the checker remembers between turns.
struct Checker {
    framing: Framing,
    stat_sn: u32,
    queue_depth: u32,
    ttts: Vec<u32>,
    max_seg: usize,
    max_cmd_sn: Option<u32>,
}

impl Checker {
    fn check(&mut self, session: &Session, out: &Outbox) {
        let bytes = out.to_vec();
        assert_eq!(bytes.len(), out.len());
        // Decode as an initiator would: digests on, data segments up to what it declared.
        let framing = Framing {
            max_data_segment_len: pdu::DATA_SEGMENT_LEN_MAX,
            ..self.framing
        };
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = pdu::frame_len(rest, &framing)
                .expect("target PDU length")
                .expect("outbox holds whole PDUs only");
            let p = pdu::parse_frame(&rest[..n], &framing).expect("target PDU digests");
            rest = &rest[n..];
            let bhs = p.bhs;
            let op = Opcode::from_target(bhs.opcode_raw())
                .unwrap_or_else(|| panic!("not a target opcode: {bhs:?}"));
            assert_eq!(bhs.0[0] & 0xc0, 0, "target PDUs have no I bit");
            assert!(p.ahs.is_empty());
            assert!(
                p.data.len() <= self.max_seg,
                "{op:?} data segment {} beyond MaxRecvDataSegmentLength {}",
                p.data.len(),
                self.max_seg
            );
            let exp = bhs.u32_at(off::EXP_CMD_SN);
            let max = bhs.u32_at(off::MAX_CMD_SN);
            // The window shrinks while tasks are outstanding and may close (MaxCmdSN =
            // ExpCmdSN - 1), but never exceeds the queue depth and MaxCmdSN never goes back.
            let window = max.wrapping_sub(exp).wrapping_add(1);
            assert!(window <= self.queue_depth.max(1), "{op:?} window {window}");
            if let Some(last) = self.max_cmd_sn {
                assert!(
                    iscsi::serial::le(last, max),
                    "{op:?} MaxCmdSN went back: {last} -> {max}"
                );
            }
            self.max_cmd_sn = Some(max);
            let status_bit = bhs.flags() & 0x01 != 0;
            let carries_stat_sn = match op {
                Opcode::DataIn => status_bit,
                Opcode::R2t | Opcode::AsyncMessage => false,
                Opcode::NopIn => bhs.itt() != RESERVED_TAG,
                _ => true,
            };
            if carries_stat_sn {
                assert_eq!(bhs.u32_at(off::STAT_SN), self.stat_sn, "{op:?} StatSN");
                self.stat_sn = self.stat_sn.wrapping_add(1);
            }
            match op {
                Opcode::R2t => {
                    let ttt = bhs.u32_at(off::TTT);
                    assert_ne!(ttt, RESERVED_TAG);
                    assert_ne!(bhs.u32_at(44), 0, "R2T for zero bytes");
                    self.ttts.push(ttt);
                }
                Opcode::TextResponse | Opcode::NopIn => {
                    let ttt = bhs.u32_at(off::TTT);
                    if ttt != RESERVED_TAG {
                        self.ttts.push(ttt);
                    }
                }
                Opcode::ScsiResponse => {
                    if bhs.0[3] == 2 && !p.data.is_empty() {
                        let sl = u16::from_be_bytes([p.data[0], p.data[1]]) as usize;
                        assert!(sl + 2 <= p.data.len(), "SenseLength within the segment");
                    }
                    assert!(bhs.flags() & 0x06 != 0x06, "both overflow and underflow");
                }
                Opcode::Reject => {
                    assert_eq!(p.data.len(), BHS_LEN, "Reject carries the rejected header");
                    assert_eq!(bhs.itt(), RESERVED_TAG);
                }
                _ => {}
            }
        }
        if self.ttts.len() > 64 {
            self.ttts.drain(..32);
        }
        let p = session.params();
        self.max_seg = self.max_seg.max(p.max_xmit_data_segment_length as usize);
    }
}

fuzz_target!(|input: Input| {
    let s = &input.setup;
    let target_limits = TargetLimits::default();
    let mut params = SessionParams::rfc_defaults(&target_limits);
    params.header_digest = s.header_digest;
    params.data_digest = s.data_digest;
    params.initial_r2t = s.initial_r2t;
    params.immediate_data = s.immediate_data;
    params.max_burst_length = (s.max_burst as u32).max(512);
    params.first_burst_length = (s.first_burst as u32).max(512).min(params.max_burst_length);
    params.max_outstanding_r2t = (s.max_r2t as u16 % 9).max(1);
    params.max_xmit_data_segment_length = (s.max_xmit as u32).max(512);
    params.max_recv_data_segment_length = (s.max_recv as u32).max(512);
    let limits = SessionLimits {
        queue_depth: (s.queue_depth as u32 % 33).max(1),
        max_write_bytes: s.max_write_bytes % (1 << 20),
        max_pending_write_bytes: s.max_pending_write_bytes as usize % (1 << 20),
        nop_interval: Duration::from_secs(5),
        nop_timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(120),
        max_text_bytes: 8192,
        max_keys: 64,
    };
    let kind = if s.discovery {
        SessionType::Discovery
    } else {
        SessionType::Normal
    };
    let start = Instant::now();
    let mut now = start;
    let mut session = Session::new(
        kind,
        seam::name::NodeName::from_wire("iqn.2026-11.org.example:init").unwrap(),
        params,
        limits,
        s.stat_sn,
        s.exp_cmd_sn,
        now,
    );
    let mut backend = input.setup.backend.clone();
    let mut out = Outbox::new(4);
    let mut checker = Checker {
        framing: session.framing(),
        stat_sn: s.stat_sn,
        queue_depth: limits.queue_depth,
        ttts: Vec::new(),
        max_seg: params.max_xmit_data_segment_length as usize,
        max_cmd_sn: None,
    };
    // Immediate write data / Data-Out payloads come from this pattern.
    let pattern: Vec<u8> = (0..=u16::MAX).map(|i| (i >> 3) as u8).collect();
    let sn_of = |session: &Session, c: SnChoice| match c {
        SnChoice::Expected => session.exp_cmd_sn(),
        SnChoice::Ahead(d) => session.exp_cmd_sn().wrapping_add(d as u32 % 40),
        SnChoice::Behind(d) => session.exp_cmd_sn().wrapping_sub(1 + d as u32),
        SnChoice::Any(v) => v,
    };

    for op in input.ops.iter().take(200) {
        let mut bhs = Bhs::new(Opcode::NopOut);
        let mut data: Vec<u8> = Vec::new();
        let mut ahs: Vec<u8> = Vec::new();
        let mut placed = false;
        match op {
            Op::Command {
                sn,
                immediate,
                flags,
                itt,
                edtl,
                lun0,
                cdb,
                imm_len,
                ahs: a,
                in_place,
            } => {
                placed = *in_place;
                bhs = Bhs::new(Opcode::ScsiCommand);
                bhs.set_immediate(*immediate);
                bhs.set_flags(*flags);
                bhs.set_itt(itt.get());
                bhs.0[8] = lun0 % 2;
                bhs.set_u32(off::EDTL, *edtl as u32);
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
                bhs.0[32..48].copy_from_slice(cdb);
                let n = (*imm_len as usize).min(*edtl as usize + 1);
                data.extend_from_slice(&pattern[..n]);
                ahs = a.clone();
                ahs.truncate(64);
                ahs.resize(pdu::padded(ahs.len()), 0);
            }
            Op::DataOut {
                itt,
                ttt,
                final_bit,
                data_sn,
                offset,
                len,
                in_place,
            } => {
                placed = *in_place;
                bhs = Bhs::new(Opcode::DataOut);
                bhs.set_flags(if *final_bit { 0x80 } else { 0 });
                bhs.set_itt(itt.get());
                let t = match ttt {
                    TttChoice::Reserved => RESERVED_TAG,
                    TttChoice::Recent(i) => checker
                        .ttts
                        .get(checker.ttts.len().saturating_sub(1 + *i as usize % 8))
                        .copied()
                        .unwrap_or(RESERVED_TAG),
                    TttChoice::Any(v) => *v,
                };
                bhs.set_u32(off::TTT, t);
                bhs.set_u32(off::DATA_SN, *data_sn as u32);
                bhs.set_u32(off::BUFFER_OFFSET, *offset as u32);
                data.extend_from_slice(&pattern[..*len as usize]);
            }
            Op::Tmf {
                sn,
                immediate,
                function,
                lun0,
                referenced,
                ref_cmd_sn,
            } => {
                bhs = Bhs::new(Opcode::TaskMgmtRequest);
                bhs.set_immediate(*immediate);
                bhs.set_flags(0x80 | (function % 10));
                bhs.0[8] = lun0 % 2;
                bhs.set_itt(0x1000 + (*function as u32));
                bhs.set_u32(20, referenced.get());
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
                bhs.set_u32(32, *ref_cmd_sn);
            }
            Op::Text {
                sn,
                continued,
                final_bit,
                ttt,
                data: d,
            } => {
                bhs = Bhs::new(Opcode::TextRequest);
                bhs.set_immediate(true);
                bhs.set_flags(
                    (if *final_bit { 0x80 } else { 0 }) | (if *continued { 0x40 } else { 0 }),
                );
                bhs.set_itt(0x2000);
                let t = match ttt {
                    TttChoice::Reserved => RESERVED_TAG,
                    TttChoice::Recent(i) => checker
                        .ttts
                        .get(checker.ttts.len().saturating_sub(1 + *i as usize % 8))
                        .copied()
                        .unwrap_or(RESERVED_TAG),
                    TttChoice::Any(v) => *v,
                };
                bhs.set_u32(off::TTT, t);
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
                data = d.clone();
            }
            Op::Nop {
                sn,
                itt,
                ttt,
                data: d,
            } => {
                bhs.set_immediate(*itt == RESERVED_TAG);
                bhs.set_flags(0x80);
                bhs.set_itt(*itt);
                let t = match ttt {
                    TttChoice::Reserved => RESERVED_TAG,
                    TttChoice::Recent(_) => checker.ttts.last().copied().unwrap_or(RESERVED_TAG),
                    TttChoice::Any(v) => *v,
                };
                bhs.set_u32(off::TTT, t);
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
                data = d.clone();
            }
            Op::Logout { sn, reason } => {
                bhs = Bhs::new(Opcode::LogoutRequest);
                bhs.set_immediate(true);
                bhs.set_flags(0x80 | (reason % 4));
                bhs.set_itt(0x3000);
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
            }
            Op::Raw {
                bhs: raw,
                sn,
                data: d,
            } => {
                bhs = Bhs(*raw);
                bhs.0[4] = 0;
                bhs.set_u32(off::CMD_SN, sn_of(&session, *sn));
                data = d.clone();
            }
            Op::Tick { secs, reading } => {
                now += Duration::from_secs(*secs as u64 % 40);
                let verdict = session.tick(now, *reading, &mut out);
                checker.check(&session, &out);
                out.clear();
                if verdict != Liveness::Continue {
                    return;
                }
                continue;
            }
            Op::Complete {
                pick,
                status,
                data_len,
                sense_len,
            } => {
                if backend.deferred.is_empty() {
                    continue;
                }
                let (itt, read) = backend
                    .deferred
                    .swap_remove(*pick as usize % backend.deferred.len());
                let running_before = session.running_tasks();
                let data = if read {
                    pattern[..*data_len as usize].to_vec()
                } else {
                    Vec::new()
                };
                let sense: Vec<u8> = (0..*sense_len % 64).collect();
                let outcome = ScsiOutcome {
                    status: *status,
                    transfer_len: *data_len as u32,
                };
                let known = session.complete(itt, outcome, data, &sense, &mut out);
                // Completing a task it still tracks frees exactly one slot; an unknown one
                // (dropped by logout or reset) changes nothing.
                let expect = if known {
                    running_before - 1
                } else {
                    running_before
                };
                assert_eq!(session.running_tasks(), expect);
                assert!(session.running_tasks() <= limits.queue_depth as usize);
                checker.check(&session, &out);
                out.clear();
                continue;
            }
            Op::TmfDone { pick, response } => {
                if backend.tmfs_later.is_empty() {
                    continue;
                }
                let itt = backend
                    .tmfs_later
                    .swap_remove(*pick as usize % backend.tmfs_later.len());
                let before = session.pending_tmfs();
                let flow = session.task_management_done(itt, *response, &mut out);
                assert!(session.pending_tmfs() <= before);
                checker.check(&session, &out);
                out.clear();
                if flow == Flow::Close {
                    return;
                }
                continue;
            }
            Op::DigestError { bhs: raw } => {
                let flow = session.data_digest_error(&Bhs(*raw), &mut out);
                assert_eq!(flow, Flow::Close);
                checker.check(&session, &out);
                return;
            }
        }
        // The engine's framing check: a data segment beyond our limit never reaches the session.
        if data.len() > session.framing().max_data_segment_len {
            data.truncate(session.framing().max_data_segment_len);
        }
        bhs.0[4] = (ahs.len() / 4) as u8;
        bhs.set_data_segment_len(data.len());
        let pdu = Pdu {
            bhs,
            ahs: &ahs,
            data: &data,
        };
        // Like the engine: a Data-Out's payload, or a SCSI Command's immediate data, received
        // in place when the session takes it there (the rest take the usual way).
        let command = pdu.bhs.opcode_raw() & 0x3f == Opcode::ScsiCommand as u8;
        let in_place = placed && {
            let dst = if command {
                session.command_data_destination(&pdu.bhs, &mut backend, &mut out)
            } else {
                session.data_out_destination(&pdu.bhs)
            };
            match dst {
                Some(dst) => {
                    assert_eq!(
                        dst.len(),
                        data.len(),
                        "the destination fits the data segment"
                    );
                    dst.copy_from_slice(&data);
                    true
                }
                None => false,
            }
        };
        let flow = match (in_place, command) {
            (true, true) => session.handle_placed_command(now, &mut backend, &mut out),
            (true, false) => session.handle_placed_data_out(&pdu.bhs, now, &mut backend, &mut out),
            (false, _) => session.handle(&pdu, now, &mut backend, &mut out),
        };
        checker.check(&session, &out);
        assert!(
            session.pending_writes() <= limits.queue_depth as usize,
            "{} pending writes, queue depth {}",
            session.pending_writes(),
            limits.queue_depth
        );
        // Partial sends: consume in two steps like a short writev (or sendfile) would; what
        // is left is exactly the rest of the bytes.
        let whole = out.to_vec();
        let half = out.len() / 2;
        out.consume(half);
        assert_eq!(
            out.to_vec(),
            whole[half..],
            "a partial send resumes where it stopped"
        );
        out.consume(out.len());
        assert!(out.is_empty());
        if flow == Flow::Close {
            // After a close everything further is ignored.
            let again = session.handle(&pdu, now, &mut backend, &mut out);
            assert_eq!(again, Flow::Close);
            return;
        }
    }
});
