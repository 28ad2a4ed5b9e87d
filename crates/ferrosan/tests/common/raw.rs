//! A minimal raw initiator for tests that need exact control of the PDUs on the wire: login
//! straight to full feature phase (no digests), send any PDU, read one PDU back.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use iscsi::pdu::{self, encode_into, off, Bhs, Framing, Opcode, BHS_LEN};

/// How long a raw client waits for an answer before calling it a hang.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Raw {
    pub stream: TcpStream,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
}

/// One PDU as received (no digests are negotiated here).
pub struct Received {
    pub bhs: Bhs,
    pub data: Vec<u8>,
}

impl Received {
    pub fn opcode(&self) -> u8 {
        self.bhs.opcode_raw()
    }
}

pub fn connect(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

pub fn send(stream: &mut TcpStream, bhs: &Bhs, data: &[u8]) {
    let mut out = Vec::new();
    encode_into(&mut out, bhs, data, &Framing::LOGIN);
    stream.write_all(&out).expect("send PDU");
}

/// Reads one PDU; `None` when the peer closed the connection (EOF or reset).
pub fn recv(stream: &mut TcpStream) -> Option<Received> {
    let mut header = [0u8; BHS_LEN];
    match stream.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            panic!("no answer within {ANSWER_TIMEOUT:?}")
        }
        Err(_) => return None,
    }
    let bhs = Bhs(header);
    let ahs = bhs.total_ahs_len();
    let dsl = bhs.data_segment_len();
    let mut rest = vec![0u8; ahs + ((dsl + 3) & !3)];
    stream.read_exact(&mut rest).ok()?;
    let data = rest[ahs..ahs + dsl].to_vec();
    Some(Received { bhs, data })
}

/// Waits for the peer to close; panics if it keeps the connection open past `ANSWER_TIMEOUT`.
/// Returns what it sent before closing.
pub fn until_closed(stream: &mut TcpStream) -> Vec<Received> {
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    let mut got = Vec::new();
    while Instant::now() < deadline {
        match recv(stream) {
            Some(pdu) => got.push(pdu),
            None => return got,
        }
    }
    panic!("connection still open after {ANSWER_TIMEOUT:?}");
}

pub fn login_text(iqn: &str, extra: &str) -> Vec<u8> {
    format!(
        "InitiatorName=iqn.2026-11.org.example:hostile\0TargetName={iqn}\0SessionType=Normal\0\
         HeaderDigest=None\0DataDigest=None\0MaxRecvDataSegmentLength=262144\0{extra}"
    )
    .into_bytes()
}

pub fn login_request(isid_tail: u8, text: &[u8]) -> Bhs {
    // The operational stage straight to full feature phase.
    let mut bhs = pdu::LoginRequest {
        csg: 1,
        transit_to: Some(3),
        continues: false,
        isid: [0x80, 0x12, 0x34, 0x56, 0x78, isid_tail],
        tsih: 0,
        itt: 0x1000,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
    }
    .bhs();
    bhs.set_data_segment_len(text.len());
    bhs
}

/// A READ(10) (0x28) or WRITE(10) (0x2a) CDB for `blocks` blocks at `lba`.
pub fn rw10(opcode: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let l = lba.to_be_bytes();
    let b = blocks.to_be_bytes();
    [opcode, 0, l[0], l[1], l[2], l[3], 0, b[0], b[1], 0]
}

/// The status of a SCSI Response (or of a Data-In with the S bit).
pub fn status_of(pdu: &Received) -> u8 {
    pdu.bhs.byte(off::STATUS)
}

impl Raw {
    /// Connects and logs in (operational stage straight to full feature phase).
    pub fn login(port: u16, iqn: &str, isid_tail: u8) -> Raw {
        let mut stream = connect(port);
        let text = login_text(iqn, "");
        send(&mut stream, &login_request(isid_tail, &text), &text);
        let resp = recv(&mut stream).expect("login response");
        assert_eq!(resp.opcode(), Opcode::LoginResponse as u8);
        assert_eq!(
            (
                resp.bhs.byte(off::STATUS_CLASS),
                resp.bhs.byte(off::STATUS_DETAIL)
            ),
            (0, 0),
            "login failed: {}",
            String::from_utf8_lossy(&resp.data)
        );
        assert_eq!(resp.bhs.flags() & 0x83, 0x83, "not in full feature phase");
        Raw {
            stream,
            cmd_sn: resp.bhs.u32_at(off::EXP_CMD_SN),
            exp_stat_sn: resp.bhs.u32_at(off::STAT_SN).wrapping_add(1),
        }
    }

    pub fn header(&self, opcode: Opcode, itt: u32) -> Bhs {
        let mut bhs = Bhs::new(opcode);
        bhs.set_flags(0x80);
        bhs.set_itt(itt);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        bhs
    }

    pub fn send(&mut self, bhs: &Bhs, data: &[u8]) {
        send(&mut self.stream, bhs, data);
    }

    pub fn recv(&mut self) -> Received {
        let pdu = recv(&mut self.stream).expect("connection closed unexpectedly");
        // StatSN is valid in every response but R2T and a Data-In without status (S bit).
        let carries_status = match pdu.opcode() {
            op if op == Opcode::R2t as u8 => false,
            op if op == Opcode::DataIn as u8 => pdu.bhs.flags() & 0x01 != 0,
            _ => true,
        };
        if carries_status {
            self.exp_stat_sn = pdu.bhs.u32_at(off::STAT_SN).wrapping_add(1);
        }
        pdu
    }

    /// A SCSI Command PDU for `cdb` with this client's CmdSN (advanced) and ExpStatSN.
    pub fn command(&mut self, itt: u32, cdb: &[u8], flags: u8, edtl: u32) -> Bhs {
        let mut bhs = Bhs::new(Opcode::ScsiCommand);
        bhs.set_flags(flags);
        bhs.set_itt(itt);
        bhs.set_u32(off::EDTL, edtl);
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        bhs.0[off::CDB..off::CDB + cdb.len()].copy_from_slice(cdb);
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        bhs
    }

    /// Sends TEST UNIT READY until it succeeds (at most 3 times), consuming the power-on unit
    /// attention as an initiator does before its I/O; `itt` advances per command.
    pub fn until_ready(&mut self, itt: &mut u32) {
        for _ in 0..3 {
            let bhs = self.command(*itt, &[0; 6], 0x80, 0);
            *itt += 1;
            self.send(&bhs, &[]);
            if status_of(&self.recv()) == 0 {
                return;
            }
        }
        panic!("TEST UNIT READY never succeeded");
    }

    /// Reads a command's Data-In PDUs up to its status; asserts GOOD and returns the data.
    pub fn read_data(&mut self) -> Vec<u8> {
        let mut data = Vec::new();
        loop {
            let pdu = self.recv(); // panics after ANSWER_TIMEOUT: a stall is a failure
            data.extend_from_slice(&pdu.data);
            if pdu.bhs.flags() & 0x01 != 0 || pdu.opcode() == Opcode::ScsiResponse as u8 {
                assert_eq!(status_of(&pdu), 0, "command failed: {:?}", pdu.bhs);
                return data;
            }
        }
    }

    /// A NOP-Out that must be answered: proves the session still works.
    pub fn ping(&mut self, itt: u32) {
        let mut bhs = self.header(Opcode::NopOut, itt);
        bhs.set_u32(off::TTT, 0xffff_ffff);
        self.send(&bhs, b"ping");
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        // The target's own pings (ITT reserved) may come first on an idle session: skipped.
        let mut pdu = self.recv();
        while pdu.opcode() == Opcode::NopIn as u8 && pdu.bhs.itt() == 0xffff_ffff {
            pdu = self.recv();
        }
        assert_eq!(
            pdu.opcode(),
            Opcode::NopIn as u8,
            "ping answered by {:?}",
            pdu.bhs
        );
        assert_eq!(pdu.bhs.itt(), itt);
        assert_eq!(pdu.data, b"ping");
    }

    /// `rejected` as sent, with `data_len` bytes of data (encode_into filled in the length).
    pub fn expect_reject(&mut self, reason: u8, rejected: &Bhs, data_len: usize, what: &str) {
        let mut rejected = *rejected;
        rejected.set_data_segment_len(data_len);
        let pdu = self.recv();
        assert_eq!(
            pdu.opcode(),
            Opcode::Reject as u8,
            "{what}: expected a Reject, got {:?}",
            pdu.bhs
        );
        assert_eq!(pdu.bhs.byte(off::REASON), reason, "{what}: Reject reason");
        assert_eq!(pdu.data.len(), BHS_LEN, "{what}: Reject carries the header");
        assert_eq!(pdu.data[..], rejected.0[..], "{what}: the rejected header");
    }
}
