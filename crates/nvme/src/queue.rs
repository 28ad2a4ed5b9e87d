//! One NVMe/TCP connection, controller side: a queue's transport (transport specification 1.0,
//! sections 3.3 and 3.6). Connection initialization (ICReq → ICResp with the digests the host
//! asked for), command capsules with their data in the capsule or solicited by R2T and sent in
//! H2CData PDUs, and the answers back (C2HData, then a response capsule). What a command
//! means is the caller's: a command whose data has all arrived comes out as a [`Received`],
//! and its answer goes in through [`Queue::answer`].
//!
//! Bytes in, bytes out: [`Queue::receive`] takes what the socket returned and says how much of
//! it it consumed; whatever it has to send it appends to the caller's buffer. A PDU the
//! transport cannot take ends the connection with a C2HTermReq (the error says why).

use std::ops::Range;

use seam::DataOutBuf;

use crate::pdu::{self, flags, Accept, Fatal, PduType, Refusal, Transfer, CH_LEN, DIGEST_LEN};
use crate::sqe::{Cqe, DataPointer, Sqe, Status, SQE_LEN};

/// What a queue accepts; every bound a host could push against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// The most data one H2CData PDU may carry (MAXH2CDATA, sent in the ICResp): at least
    /// 4096, a multiple of 4.
    pub maxh2cdata: u32,
    /// In-capsule data a command capsule may carry (IOCCSZ − 64 bytes).
    pub in_capsule_max: u32,
    /// The most data one command may move (MDTS).
    pub transfer_max: u32,
    /// Commands in this queue at once (its SQSIZE + 1 once connected; at most this).
    pub depth_max: u16,
    /// Write data solicited and not yet arrived, at most (a write longer than this alone is
    /// still solicited, alone): further writes wait for their R2T.
    pub solicited_max: u32,
}

/// Transient Transport Error (generic 22h): a data digest failed; the host may retry.
pub const TRANSIENT_TRANSPORT_ERROR: Status = Status {
    sct: 0,
    sc: 0x22,
    dnr: false,
};

/// A command ready to run: its entry, and its data from the host (empty for a command that
/// moves none to the controller).
#[derive(Debug, PartialEq, Eq)]
pub struct Received {
    pub sqe: Sqe,
    pub data: Data,
    /// The bytes the command may move to the host (its transport data block's length).
    pub data_in_len: u32,
}

/// What [`Queue::place`] asks for a solicited write: exactly `len` bytes for its data (memory
/// of the engine's, or a recycled buffer of the connection's whose old bytes the data
/// overwrites), or None for a buffer the queue grows as the data comes.
pub type Placement<'a> = dyn FnMut(&Sqe, usize) -> Option<DataOutBuf> + 'a;

/// Where a command's data from the host is.
#[derive(Debug)]
pub enum Data {
    /// In its capsule: this range of the bytes given to the [`Queue::receive`] call that
    /// returned it, so a write's data goes from the receive buffer to the device in one copy.
    InCapsule(Range<usize>),
    /// Solicited with an R2T and gathered from H2CData PDUs (or none): in memory the engine
    /// placed for it ([`Queue::place`]), e.g. the aligned buffer its direct I/O will write
    /// from, or in a buffer of the queue's own.
    Gathered(DataOutBuf),
}

impl PartialEq for Data {
    fn eq(&self, other: &Data) -> bool {
        match (self, other) {
            (Data::InCapsule(a), Data::InCapsule(b)) => a == b,
            (Data::Gathered(a), Data::Gathered(b)) => a[..] == b[..],
            _ => false,
        }
    }
}

impl Eq for Data {}

impl Received {
    /// Its data; `input` is what was given to the [`Queue::receive`] call that returned it.
    /// (A command made [`Received::into_owned`] holds its data: any `input` will do.)
    pub fn data<'a>(&'a self, input: &'a [u8]) -> &'a [u8] {
        match &self.data {
            Data::InCapsule(range) => {
                debug_assert!(
                    range.end <= input.len(),
                    "in-capsule data without its input"
                );
                input.get(range.clone()).unwrap_or_default()
            }
            Data::Gathered(v) => v,
        }
    }

    pub fn data_len(&self) -> usize {
        match &self.data {
            Data::InCapsule(range) => range.len(),
            Data::Gathered(v) => v.len(),
        }
    }

    /// The same command holding its data itself, to be kept once `input` is reused.
    pub fn into_owned(self, input: &[u8]) -> Received {
        match self.data {
            Data::InCapsule(_) => self.to_owned(input),
            Data::Gathered(_) => self,
        }
    }

    /// A copy holding its data itself (a command kept from a borrowed batch: the first of a
    /// fused pair).
    pub fn to_owned(&self, input: &[u8]) -> Received {
        Received {
            sqe: self.sqe,
            data: Data::Gathered(DataOutBuf::Pooled(self.data(input).to_vec())),
            data_in_len: self.data_in_len,
        }
    }
}

/// A command capsule as it arrived: its SQE, its in-capsule data (and where that lies in the
/// receive buffer), and whether the data digest matched.
struct Capsule<'a> {
    sqe: Sqe,
    data: &'a [u8],
    placed: Range<usize>,
    data_ok: bool,
}

/// A command the transport answers by itself (a malformed data pointer, a digest error, a
/// command identifier already in use): its completion is queued with the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    pub cid: u16,
    pub status: Status,
}

/// An H2CData PDU's header length (common header and its specific header: no digests here).
const H2C_HLEN: usize = 24;

/// An H2CData PDU whose data is received in place ([`Queue::placed_h2c`]).
#[derive(Debug)]
pub struct PlacedH2C {
    /// The PDU's header (its data follows at `header_len`, after any padding).
    header: [u8; H2C_HLEN],
    header_len: usize,
    transfer: Transfer,
    frame: pdu::Frame,
}

impl PlacedH2C {
    /// The bytes of the PDU before its data.
    pub fn header_len(&self) -> usize {
        self.header_len
    }

    /// Its data's length.
    pub fn data_len(&self) -> usize {
        self.frame.data_len
    }
}

/// Where an H2CData PDU's data is.
#[derive(Clone, Copy)]
enum Arrived<'a> {
    /// In the PDU received whole, and whether its digest (if any) matched.
    Here { data: &'a [u8], data_ok: bool },
    /// Already where it goes (`Queue::placed_data`).
    InPlace,
}

/// What an Abort found of a command on a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aborting {
    /// Not waiting for its data here: running, answered, or never received. Not aborted.
    NotWaiting,
    /// Its data was not asked for yet (its R2T waited for room): taken out, never to run; the
    /// caller answers it Command Abort Requested.
    Withdrawn,
    /// Its data is on the way (its R2T went out): what arrives is dropped, and the command is
    /// answered Command Abort Requested when the last of it has, without running.
    OnArrival,
}

/// A write command whose data is being solicited (one R2T for all of it).
struct Awaiting {
    sqe: Sqe,
    ttag: u16,
    total: u32,
    /// Bytes arrived (kept in `data` unless a digest failed).
    arrived: u32,
    /// Where they go: `total` bytes placed ([`Queue::place`] or, at the first data received
    /// in place, [`Queue::placed_data`]'s recycled buffer), which each arrival overwrites at
    /// its offset, or a buffer of the queue's own, grown as they come (zero-filled first: a
    /// pass over each byte more).
    data: DataOutBuf,
    /// `data` was placed: `total` bytes long.
    sized: bool,
    /// The engine was asked for memory for it.
    placed: bool,
    /// A data digest failed: the rest is received and dropped, the command answered
    /// Transient Transport Error.
    failed: bool,
    /// The host aborted it: the rest is received and dropped, the command answered Command
    /// Abort Requested without running.
    aborted: bool,
}

impl Awaiting {
    /// The memory `len` bytes arriving at `offset` fill (every byte before it has arrived):
    /// placed memory as it is, the queue's own buffer grown to hold them.
    fn destination(&mut self, offset: usize, len: usize) -> Option<&mut [u8]> {
        if offset != self.arrived as usize {
            return None;
        }
        let end = offset.checked_add(len)?;
        match (&mut self.data, self.sized) {
            (DataOutBuf::Pooled(v), false) => {
                if v.is_empty() {
                    v.reserve_exact(self.total as usize);
                }
                v.resize(end, 0);
                v.get_mut(offset..)
            }
            (data, _) => data.get_mut(offset..end),
        }
    }

    /// Keeps `data`, which arrived at `offset` (every byte before it has).
    fn put(&mut self, offset: usize, data: &[u8]) {
        match (&mut self.data, self.sized) {
            (DataOutBuf::Pooled(v), false) => {
                debug_assert_eq!(v.len(), offset, "H2CData in order");
                if v.is_empty() {
                    v.reserve_exact(self.total as usize);
                }
                v.extend_from_slice(data);
            }
            (placed, _) => {
                // Placed memory is exactly `total` long and the offset was checked against it.
                let end = offset + data.len();
                if let Some(at) = placed.get_mut(offset..end) {
                    at.copy_from_slice(data);
                }
            }
        }
    }
}

/// A set of command identifiers. The first few open commands are held inline; past them, one
/// bit each for all 65,536 (a deep queue's answer finds its command in one step, not by a
/// walk over every open one), allocated then and kept: an admin queue or an idle I/O queue
/// never holds more than a few, and must not cost 8 KiB each.
struct CidSet {
    inline: [u16; CidSet::INLINE],
    inline_len: usize,
    bits: Option<Box<[u64; 1024]>>,
    len: usize,
}

impl CidSet {
    const INLINE: usize = 4;

    fn new() -> CidSet {
        CidSet {
            inline: [0; CidSet::INLINE],
            inline_len: 0,
            bits: None,
            len: 0,
        }
    }

    fn at(cid: u16) -> (usize, u64) {
        (usize::from(cid / 64), 1 << (cid % 64))
    }

    fn contains(&self, cid: u16) -> bool {
        match &self.bits {
            Some(bits) => {
                let (word, bit) = CidSet::at(cid);
                bits[word] & bit != 0
            }
            None => self.inline[..self.inline_len].contains(&cid),
        }
    }

    fn insert(&mut self, cid: u16) {
        debug_assert!(!self.contains(cid), "command {cid} is open already");
        if self.contains(cid) {
            return;
        }
        if self.bits.is_none() && self.inline_len < CidSet::INLINE {
            self.inline[self.inline_len] = cid;
            self.inline_len += 1;
            self.len += 1;
            return;
        }
        let inline = &self.inline[..self.inline_len];
        let bits = self.bits.get_or_insert_with(|| {
            let mut bits = Box::new([0; 1024]);
            for &c in inline {
                let (word, bit) = CidSet::at(c);
                bits[word] |= bit;
            }
            bits
        });
        self.inline_len = 0;
        let (word, bit) = CidSet::at(cid);
        bits[word] |= bit;
        self.len += 1;
    }

    fn remove(&mut self, cid: u16) {
        if !self.contains(cid) {
            return;
        }
        self.len -= 1;
        match &mut self.bits {
            Some(bits) => {
                let (word, bit) = CidSet::at(cid);
                bits[word] &= !bit;
            }
            None => {
                let at = self.inline[..self.inline_len]
                    .iter()
                    .position(|&c| c == cid);
                if let Some(at) = at {
                    self.inline_len -= 1;
                    self.inline.swap(at, self.inline_len);
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The transport state of one queue.
pub struct Queue {
    limits: QueueLimits,
    accept: Accept,
    /// Commands received and not yet answered (their identifiers), awaiting data or running.
    open: CidSet,
    awaiting: Vec<Awaiting>,
    /// Writes whose R2T waits for solicited data to arrive (the `solicited_max` bound).
    unsolicited: std::collections::VecDeque<(Sqe, u32)>,
    /// Bytes of `awaiting` still to arrive.
    solicited: u64,
    next_ttag: u16,
    /// A termination request was sent: nothing more is read.
    terminated: bool,
    /// The host's Connect disabled SQ flow control: a successful data transfer's last
    /// C2HData PDU carries SUCCESS and no response capsule follows.
    sq_flow_disabled: bool,
    /// The host's SQSIZE (0's based) once it connected: the ring the SQ head walks.
    sqsize: u16,
    /// The SQ head the last completion reported.
    sqhd: u16,
    /// What was taken since [`Queue::take_counts`] last asked.
    taken: Taken,
}

/// What a queue took from its host since it was last asked: the host's pipeline as the
/// connection driver judges it (command capsules and what came with them; data PDUs apart, as
/// iSCSI's Data-Out is).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub capsules: u32,
    /// The capsules' bytes: headers and in-capsule data.
    pub capsule_bytes: u64,
    /// H2CData PDUs.
    pub data_pdus: u32,
}

/// Data transfer direction of an opcode (bits 1:0): 01b host to controller.
fn host_to_controller(sqe: &Sqe) -> bool {
    let op = if sqe.opcode() == crate::sqe::FABRICS {
        sqe.fctype()
    } else {
        sqe.opcode()
    };
    op & 0x3 == 0x1
}

impl Queue {
    pub fn new(limits: QueueLimits) -> Queue {
        assert!(limits.maxh2cdata >= 4096 && limits.maxh2cdata.is_multiple_of(4));
        assert!(limits.depth_max > 0);
        Queue {
            limits,
            accept: Accept {
                controller: true,
                initialized: false,
                header_digest: false,
                data_digest: false,
                alignment: 0,
                data_max: limits.in_capsule_max.max(limits.maxh2cdata),
            },
            open: CidSet::new(),
            awaiting: Vec::new(),
            unsolicited: std::collections::VecDeque::new(),
            solicited: 0,
            next_ttag: 0,
            terminated: false,
            sq_flow_disabled: false,
            sqsize: 0,
            sqhd: 0,
            taken: Taken::default(),
        }
    }

    /// The connection's negotiated header and data digests.
    pub fn digests(&self) -> (bool, bool) {
        (self.accept.header_digest, self.accept.data_digest)
    }

    pub fn initialized(&self) -> bool {
        self.accept.initialized
    }

    /// Commands received and not yet answered.
    pub fn open(&self) -> usize {
        self.open.len()
    }

    /// The most commands this queue holds at once (the host's SQSIZE once it connected).
    pub fn set_depth(&mut self, depth: u16) {
        self.limits.depth_max = depth.clamp(1, self.limits.depth_max);
    }

    /// The host's Connect asked that SQ flow control be disabled (see
    /// [`crate::fabrics::CATTR_DISABLE_SQ_FLOW`]): answers may end in a C2HData PDU with
    /// SUCCESS.
    pub fn disable_sq_flow_control(&mut self) {
        self.sq_flow_disabled = true;
    }

    pub fn sq_flow_control(&self) -> bool {
        !self.sq_flow_disabled
    }

    /// The host's Connect was accepted: its SQSIZE (0's based) bounds the queue and the ring
    /// the SQ head walks; `disable_sq_flow` is its CATTR bit.
    pub fn connected(&mut self, sqsize: u16, disable_sq_flow: bool) {
        self.set_depth(sqsize.saturating_add(1));
        self.sqsize = sqsize;
        if disable_sq_flow {
            self.disable_sq_flow_control();
        }
    }

    /// The SQ head the next completion reports: each command consumed one entry, so one
    /// further per answer, wrapping past SQSIZE; FFFFh once the host disabled SQ flow control.
    pub fn next_sqhd(&mut self) -> u16 {
        if self.sq_flow_disabled {
            return crate::sqe::SQHD_DISABLED;
        }
        self.sqhd = if self.sqhd >= self.sqsize {
            0
        } else {
            self.sqhd + 1
        };
        self.sqhd
    }

    /// Bytes of the next PDU that must be buffered before [`Queue::receive`] can take it (its
    /// whole length once the common header is in), so the caller can size its reads.
    pub fn next_len(&self, buf: &[u8]) -> usize {
        match buf.get(..CH_LEN) {
            Some(ch) => u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]) as usize,
            None => CH_LEN,
        }
    }

    /// Takes every complete PDU at the start of `buf`: commands ready to run go to `ready`,
    /// commands the transport refuses to `refused`, bytes to send (ICResp, R2T) to `out`.
    /// Returns the bytes consumed; `Err` once a termination request was appended to `out`
    /// (send it, then close).
    pub fn receive(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) -> Result<usize, Fatal> {
        let mut used = 0;
        while !self.terminated {
            let rest = &buf[used..];
            let Some(ch) = rest.get(..CH_LEN) else { break };
            let ch: &[u8; CH_LEN] = ch.try_into().unwrap_or(&[0; CH_LEN]);
            let frame = match pdu::frame(ch, &self.accept) {
                Ok(f) => f,
                Err(r) => return Err(self.terminate(r, &rest[..CH_LEN], out)),
            };
            let Some(whole) = rest.get(..frame.len) else {
                break;
            };
            if let Err(r) = self.take(&frame, whole, used, out, ready, refused) {
                let header = &whole[..frame.hlen.min(whole.len())];
                return Err(self.terminate(r, header, out));
            }
            used += frame.len;
        }
        Ok(used)
    }

    /// Offers memory for the writes solicited since the last call, before any of their data
    /// arrives (an R2T goes out with the bytes [`Queue::receive`] returned, so no H2CData can
    /// come before the next call): `memory(sqe, len)` gives exactly `len` bytes, e.g. aligned
    /// for the direct I/O that will write them, or None for a buffer of the queue's own. Each
    /// write is asked once. Old bytes in what it gives never reach a command: a write runs only
    /// once every byte of its range has arrived, each part at the offset the last one ended.
    pub fn place(&mut self, memory: &mut Placement<'_>) {
        for a in self.awaiting.iter_mut().filter(|a| !a.placed) {
            a.placed = true;
            if a.arrived != 0 {
                continue;
            }
            let m = memory(&a.sqe, a.total as usize);
            if let Some(m) = m.filter(|m| m.len() == a.total as usize) {
                a.data = m;
                a.sized = true;
            }
        }
    }

    /// When `buf` begins with the header of an H2CData PDU carrying at least `min` bytes, no
    /// digests, and a part of its write's data that is next: the PDU, so the caller can
    /// receive its data straight into [`Queue::placed_data`] rather than buffer it (one copy
    /// fewer per byte written), then hand it over with [`Queue::receive_placed`]. None: the
    /// PDU takes the usual way, [`Queue::receive`] (which also refuses a malformed one).
    pub fn placed_h2c(&self, buf: &[u8], min: usize) -> Option<PlacedH2C> {
        let ch: &[u8; CH_LEN] = buf.get(..CH_LEN)?.try_into().ok()?;
        let frame = pdu::frame(ch, &self.accept).ok()?;
        let plain = !frame.header_digest && !frame.data_digest;
        let long = frame.data_len >= min.max(1);
        if frame.pdu_type != PduType::H2CData || !plain || !long {
            return None;
        }
        let header = buf.get(..frame.data_offset)?;
        let t = Transfer::parse(header.get(..frame.hlen)?)?;
        let a = self
            .awaiting
            .iter()
            .find(|a| a.sqe.cid() == t.cccid && a.ttag == t.ttag)?;
        let fits = u64::from(t.offset) + u64::from(t.len) <= u64::from(a.total);
        if a.failed || t.offset != a.arrived || t.len as usize != frame.data_len || !fits {
            return None;
        }
        debug_assert_eq!(frame.hlen, H2C_HLEN, "the frame checks an H2CData's length");
        Some(PlacedH2C {
            header: header.get(..H2C_HLEN)?.try_into().ok()?,
            header_len: header.len(),
            transfer: t,
            frame,
        })
    }

    /// What was taken since the last call, resetting it.
    pub fn take_counts(&mut self) -> Taken {
        std::mem::take(&mut self.taken)
    }

    /// Whether a write still waits for at least `min` bytes of data, in PDUs without
    /// digests: a reader then stops at each PDU's header, so that the data behind it can be
    /// received in place ([`Queue::placed_h2c`]).
    pub fn awaits_data(&self, min: usize) -> bool {
        !self.accept.header_digest
            && !self.accept.data_digest
            && self
                .awaiting
                .iter()
                .any(|a| !a.failed && (a.total - a.arrived) as usize >= min)
    }

    /// The memory the data of `h2c` fills (exactly its length).
    ///
    /// A write with nothing placed and nothing arrived yet takes `recycled(total)` now: a
    /// buffer of exactly `total` bytes whose old bytes its data overwrites (as placed memory).
    /// Taken when its first data comes rather than when its R2T goes, the buffer is one a write
    /// just gave back and still in the cache: taking it at the R2T, 16 writes of 1 MiB earlier,
    /// made 1 MiB writes from a RAM LUN 6 % slower than growing a zero-filled buffer.
    pub fn placed_data(
        &mut self,
        h2c: &PlacedH2C,
        recycled: impl FnOnce(usize) -> Vec<u8>,
    ) -> Option<&mut [u8]> {
        let t = &h2c.transfer;
        let a = self
            .awaiting
            .iter_mut()
            .find(|a| a.sqe.cid() == t.cccid && a.ttag == t.ttag)?;
        if !a.sized && a.arrived == 0 && !(a.failed || a.aborted) {
            let buf = recycled(a.total as usize);
            if buf.len() == a.total as usize {
                a.data = DataOutBuf::Pooled(buf);
                a.sized = true;
            }
        }
        a.destination(t.offset as usize, t.len as usize)
    }

    /// Takes `h2c` whose data [`Queue::placed_data`] now holds, as [`Queue::receive`] takes
    /// a PDU: its write ready once all of its data is in; `Err` as there.
    pub fn receive_placed(
        &mut self,
        h2c: &PlacedH2C,
        out: &mut Vec<u8>,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) -> Result<(), Fatal> {
        let header = &h2c.header[..];
        match self.h2c_data(&h2c.frame, header, Arrived::InPlace, ready, refused) {
            Ok(()) => {
                self.solicit_waiting(out);
                Ok(())
            }
            Err(r) => Err(self.terminate(r, header, out)),
        }
    }

    fn terminate(&mut self, r: Refusal, header: &[u8], out: &mut Vec<u8>) -> Fatal {
        self.terminated = true;
        pdu::encode_term(&r, true, header, out);
        r.status
    }

    /// One whole PDU whose common header `frame` accepted, at `at` of the input.
    fn take(
        &mut self,
        frame: &pdu::Frame,
        whole: &[u8],
        at: usize,
        out: &mut Vec<u8>,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) -> Result<(), Refusal> {
        let header = &whole[..frame.hlen];
        if frame.header_digest {
            let d: [u8; DIGEST_LEN] = whole[frame.hlen..frame.hlen + DIGEST_LEN]
                .try_into()
                .unwrap_or([0; DIGEST_LEN]);
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
            let d: [u8; DIGEST_LEN] = whole[at..at + DIGEST_LEN]
                .try_into()
                .unwrap_or([0; DIGEST_LEN]);
            pdu::digest(data) == u32::from_le_bytes(d)
        };
        match frame.pdu_type {
            PduType::ICReq => {
                self.initialize(header, out)?;
                Ok(())
            }
            PduType::H2CTermReq => Err(Refusal {
                // The host ends the connection: nothing is sent back but the close.
                status: Fatal::SequenceError,
                field: 0,
            }),
            PduType::CapsuleCmd => {
                self.taken.capsules += 1;
                self.taken.capsule_bytes += frame.len as u64;
                let sqe = Sqe::from_slice(&header[CH_LEN..]).ok_or(Refusal {
                    status: Fatal::InvalidHeaderField,
                    field: 2,
                })?;
                let placed = at + frame.data_offset..at + frame.data_offset + frame.data_len;
                let capsule = Capsule {
                    sqe,
                    data,
                    placed,
                    data_ok,
                };
                self.command(capsule, out, ready, refused);
                Ok(())
            }
            PduType::H2CData => {
                let arrived = Arrived::Here { data, data_ok };
                self.h2c_data(frame, header, arrived, ready, refused)?;
                self.solicit_waiting(out);
                Ok(())
            }
            // `frame` lets through only what a host sends.
            _ => Err(Refusal {
                status: Fatal::InvalidHeaderField,
                field: 0,
            }),
        }
    }

    fn initialize(&mut self, header: &[u8], out: &mut Vec<u8>) -> Result<(), Refusal> {
        let req = pdu::ICReq::parse(header)?;
        self.accept.initialized = true;
        self.accept.header_digest = req.header_digest;
        self.accept.data_digest = req.data_digest;
        self.accept.alignment = req.hpda;
        pdu::ICResp {
            cpda: 0,
            header_digest: req.header_digest,
            data_digest: req.data_digest,
            maxh2cdata: self.limits.maxh2cdata,
        }
        .encode(out);
        Ok(())
    }

    /// A command capsule: ready now (data in the capsule, or none to receive), solicited with
    /// an R2T, or refused.
    /// Whether a command capsule may open: its identifier free, room in the queue, its data
    /// intact and its data pointer one this transport takes. Else the status it is answered
    /// with (a command identifier in use: the one in use keeps running, this one is answered
    /// with the same identifier; the host broke the rule, it sorts out which answer is which).
    fn admissible(&self, sqe: &Sqe, data_ok: bool) -> Result<DataPointer, Status> {
        if self.open.contains(sqe.cid()) {
            return Err(Status::COMMAND_ID_CONFLICT);
        }
        if self.open.len() >= usize::from(self.limits.depth_max) {
            return Err(QUEUE_FULL);
        }
        if !data_ok {
            return Err(TRANSIENT_TRANSPORT_ERROR);
        }
        sqe.data_pointer()
    }

    fn command(
        &mut self,
        capsule: Capsule<'_>,
        out: &mut Vec<u8>,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) {
        let Capsule {
            sqe,
            data,
            placed,
            data_ok,
        } = capsule;
        let cid = sqe.cid();
        let refuse = |status| Refused { cid, status };
        let pointer = match self.admissible(&sqe, data_ok) {
            Ok(p) => p,
            Err(status) => {
                refused.push(refuse(status));
                return;
            }
        };
        match pointer {
            DataPointer::InCapsule { offset, len } => {
                // In-capsule data begins at offset 0 (the identify data says so) and is all of
                // the capsule's data.
                if offset != 0 || len as usize != data.len() || len > self.limits.in_capsule_max {
                    refused.push(refuse(Status::DATA_SGL_LENGTH_INVALID));
                    return;
                }
                self.open.insert(cid);
                debug_assert_eq!(placed.len(), data.len());
                ready.push(Received {
                    sqe,
                    data: Data::InCapsule(placed),
                    data_in_len: 0,
                });
            }
            DataPointer::Transport { len } => {
                if !data.is_empty() || len > self.limits.transfer_max {
                    refused.push(refuse(Status::DATA_SGL_LENGTH_INVALID));
                    return;
                }
                self.open.insert(cid);
                if host_to_controller(&sqe) && len > 0 {
                    self.unsolicited.push_back((sqe, len));
                    self.solicit_waiting(out);
                } else {
                    ready.push(Received {
                        sqe,
                        data: Data::Gathered(DataOutBuf::default()),
                        data_in_len: if host_to_controller(&sqe) { 0 } else { len },
                    });
                }
            }
        }
    }

    /// An Abort of command `cid` (NVMe base 2.0, 5.1): what the transport can stop is a write
    /// still waiting for its data; a command the engine runs is past it.
    pub fn abort(&mut self, cid: u16) -> Aborting {
        if let Some(i) = self.unsolicited.iter().position(|(s, _)| s.cid() == cid) {
            self.unsolicited.remove(i);
            return Aborting::Withdrawn;
        }
        match self.awaiting.iter_mut().find(|a| a.sqe.cid() == cid) {
            Some(a) => {
                a.aborted = true;
                Aborting::OnArrival
            }
            None => Aborting::NotWaiting,
        }
    }

    /// Sends the R2Ts of waiting writes while the data solicited stays within its bound (one
    /// at a time past it).
    fn solicit_waiting(&mut self, out: &mut Vec<u8>) {
        while let Some(&(sqe, len)) = self.unsolicited.front() {
            let room = self.solicited + u64::from(len) <= u64::from(self.limits.solicited_max);
            if !room && !self.awaiting.is_empty() {
                break;
            }
            self.unsolicited.pop_front();
            self.solicit(sqe, len, out);
        }
    }

    /// Asks for all of a write's data with one R2T (the host sends it in H2CData PDUs of at
    /// most MAXH2CDATA each).
    fn solicit(&mut self, sqe: Sqe, len: u32, out: &mut Vec<u8>) {
        self.solicited += u64::from(len);
        let ttag = self.next_ttag;
        self.next_ttag = self.next_ttag.wrapping_add(1);
        Transfer {
            cccid: sqe.cid(),
            ttag,
            offset: 0,
            len,
        }
        .encode_r2t(self.accept.header_digest, out);
        self.awaiting.push(Awaiting {
            sqe,
            ttag,
            total: len,
            arrived: 0,
            data: DataOutBuf::default(),
            sized: false,
            placed: false,
            failed: false,
            aborted: false,
        });
    }

    fn h2c_data(
        &mut self,
        frame: &pdu::Frame,
        header: &[u8],
        input: Arrived<'_>,
        ready: &mut Vec<Received>,
        refused: &mut Vec<Refused>,
    ) -> Result<(), Refusal> {
        self.taken.data_pdus += 1;
        let (data_len, data_ok) = match input {
            Arrived::Here { data, data_ok } => (data.len(), data_ok),
            Arrived::InPlace => (frame.data_len, true),
        };
        let field = |offset| Refusal {
            status: Fatal::InvalidHeaderField,
            field: offset,
        };
        let t = Transfer::parse(header).ok_or(field(2))?;
        let index = self
            .awaiting
            .iter()
            .position(|a| a.sqe.cid() == t.cccid && a.ttag == t.ttag)
            .ok_or(field(8))?;
        let a = &mut self.awaiting[index];
        if t.offset != a.arrived || t.len as usize != data_len {
            return Err(field(12));
        }
        let arrived = a.arrived + t.len;
        if arrived > a.total {
            return Err(Refusal {
                status: Fatal::DataOutOfRange,
                field: 16,
            });
        }
        let done = arrived == a.total;
        if done != (frame.flags & flags::LAST_PDU != 0) {
            return Err(field(1));
        }
        let offset = a.arrived as usize;
        a.arrived = arrived;
        a.failed |= !data_ok;
        if let (false, Arrived::Here { data, .. }) = (a.failed || a.aborted, input) {
            a.put(offset, data);
        }
        if done {
            let a = self.awaiting.swap_remove(index);
            self.solicited -= u64::from(a.total);
            if a.failed || a.aborted {
                let status = if a.failed {
                    TRANSIENT_TRANSPORT_ERROR
                } else {
                    Status::ABORTED_BY_REQUEST
                };
                refused.push(Refused {
                    cid: a.sqe.cid(),
                    status,
                });
            } else {
                ready.push(Received {
                    sqe: a.sqe,
                    data: Data::Gathered(a.data),
                    data_in_len: 0,
                });
            }
        }
        Ok(())
    }

    /// Answers command `cqe.cid`: `data` (at most what it may move to the host) in C2HData,
    /// then the response capsule. A command that is not open is answered too (a refused one).
    pub fn answer(&mut self, cqe: &Cqe, data: &[u8], out: &mut Vec<u8>) {
        self.answer_parts(cqe, &[data], out);
    }

    /// As [`Queue::answer`], the data given in parts (a read's pieces of store memory, copied
    /// once, into `out`).
    pub fn answer_parts(&mut self, cqe: &Cqe, parts: &[&[u8]], out: &mut Vec<u8>) {
        self.answer_with(cqe, &mut Copied(parts), out);
    }

    /// As [`Queue::answer`], the data from a [`DataSink`]: the engine's sends it from where it
    /// lies (store memory, a page-cached file) instead of copying it into `out`.
    ///
    /// With SQ flow control disabled, a successful answer with data and nothing in its
    /// completion's dwords 0 and 1 ends with SUCCESS on its last C2HData PDU instead of a
    /// response capsule: one PDU less per read, as the host has nothing to learn from it.
    pub fn answer_with(&mut self, cqe: &Cqe, data: &mut impl DataSink, out: &mut Vec<u8>) {
        self.open.remove(cqe.cid);
        let (hdgst, ddgst) = self.digests();
        let total = data.data_len();
        let in_data = self.sq_flow_disabled
            && total > 0
            && cqe.status.is_success()
            && cqe.dw0 == 0
            && cqe.dw1 == 0;
        let last_flags = if in_data {
            flags::LAST_PDU | flags::SUCCESS
        } else {
            flags::LAST_PDU
        };
        let mut offset = 0usize;
        while offset < total {
            let len = (total - offset).min(C2H_DATA_MAX);
            let last = offset + len == total;
            Transfer {
                cccid: cqe.cid,
                ttag: 0,
                offset: offset as u32,
                len: len as u32,
            }
            .encode_c2h_header(if last { last_flags } else { 0 }, (hdgst, ddgst), out);
            let crc = data.data(out, offset..offset + len, ddgst);
            if ddgst {
                out.extend_from_slice(&crc.to_le_bytes());
            }
            offset += len;
        }
        if !in_data {
            cqe.encode_capsule(hdgst, out);
        }
    }
}

/// Where an answer's data goes. The queue encodes its headers, digests and completion into the
/// caller's byte buffer; the data in between is the sink's, so it can be sent from where it
/// lies rather than copied after the headers.
pub trait DataSink {
    /// The data's length in bytes.
    fn data_len(&self) -> usize;
    /// Queues bytes `range` of the data after everything now in `out` (the sink may take
    /// `out`'s bytes first to keep the order). Returns their CRC32C when `digest`, else 0.
    fn data(&mut self, out: &mut Vec<u8>, range: Range<usize>, digest: bool) -> u32;
}

/// Data in memory, in parts that follow one another: copied into the output.
pub struct Copied<'a>(pub &'a [&'a [u8]]);

impl DataSink for Copied<'_> {
    fn data_len(&self) -> usize {
        self.0.iter().map(|p| p.len()).sum()
    }

    fn data(&mut self, out: &mut Vec<u8>, range: Range<usize>, digest: bool) -> u32 {
        let mut crc = 0;
        for_each_piece(self.0, range, |piece| {
            out.extend_from_slice(piece);
            if digest {
                crc = crc32c::crc32c_append(crc, piece);
            }
        });
        crc
    }
}

/// Calls `f` with the pieces of `range` of the concatenation of `parts`, in order.
pub fn for_each_piece(parts: &[&[u8]], range: Range<usize>, mut f: impl FnMut(&[u8])) {
    let mut at = 0;
    for part in parts {
        let (start, end) = (at.max(range.start), (at + part.len()).min(range.end));
        if start < end {
            f(&part[start - at..end - at]);
        }
        at += part.len();
        if at >= range.end {
            break;
        }
    }
}

/// The most data one C2HData PDU carries: a long read goes in several, so no PDU length nears
/// the 32-bit field.
const C2H_DATA_MAX: usize = 1 << 20;

/// Commands beyond the queue's size: the host broke SQ flow control. Answered with Command
/// Interrupted (generic 21h, retryable) rather than ending the connection.
pub const QUEUE_FULL: Status = Status {
    sct: 0,
    sc: 0x21,
    dnr: false,
};

/// Writes a command capsule of `sqe` with `data` in it (a host's PDU: for hosts and tests).
pub fn capsule(sqe: &Sqe, data: &[u8], digests: (bool, bool), out: &mut Vec<u8>) {
    capsule_head(sqe, data.len(), digests, out);
    out.extend_from_slice(data);
    if digests.1 && !data.is_empty() {
        out.extend_from_slice(&pdu::digest(data).to_le_bytes());
    }
}

/// A command capsule's header (and its digest) for `data_len` bytes of in-capsule data that
/// the caller sends after it, followed by their data digest when `digests.1`.
pub fn capsule_head(sqe: &Sqe, data_len: usize, digests: (bool, bool), out: &mut Vec<u8>) {
    let (hdgst, ddgst) = digests;
    let start = out.len();
    let hlen = PduType::CapsuleCmd.hlen();
    let header_end = hlen + if hdgst { DIGEST_LEN } else { 0 };
    let pdo = if data_len == 0 { 0 } else { header_end };
    let ddgst = ddgst && data_len != 0;
    let plen = header_end + data_len + if ddgst { DIGEST_LEN } else { 0 };
    let mut f = 0;
    if hdgst {
        f |= flags::HDGSTF;
    }
    if ddgst {
        f |= flags::DDGSTF;
    }
    pdu::put_ch(out, PduType::CapsuleCmd, f, pdo as u8, plen as u32);
    out.extend_from_slice(&sqe.0[..SQE_LEN]);
    if hdgst {
        let d = pdu::digest(&out[start..]);
        out.extend_from_slice(&d.to_le_bytes());
    }
}

#[cfg(test)]
mod tests;
