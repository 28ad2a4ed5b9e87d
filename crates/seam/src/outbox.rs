//! Everything a connection sends in one turn, gathered for a single vectored write.
//!
//! Headers and small payloads are appended to one byte buffer; large Data-In payloads stay in the
//! buffer the SCSI layer filled, or in the store's own memory it lent (zero-copy reads), and are
//! referenced, not copied. A payload can also be a page-cached range of a file, which the
//! engine sends with `sendfile` between vectored writes. The engine turns `parts()` into `IoSlice`s, writes them, then calls
//! [`Outbox::clear`], which recycles the payload buffers and returns lent memory, so the steady
//! state allocates nothing.

use std::ops::Range;
use std::sync::Arc;

/// Memory lent by the storage layer, kept alive and unchanged while it is queued: (owner, byte
/// range within it). The same std-only type as the store's, so none of the layers depend on
/// each other to pass it.
pub type SharedSlice = (Arc<dyn AsRef<[u8]> + Send + Sync>, Range<usize>);

/// A page-cached byte range of a file, `(file, offset, len)`, sent from the page cache: the same
/// std-only type as the store's.
pub type FileRange = (Arc<std::fs::File>, u64, usize);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// A range of the outbox's own byte buffer.
    Bytes(Range<usize>),
    /// A range of one payload buffer.
    Payload { index: usize, range: Range<usize> },
    /// A range of one lent slice (an index into the outbox's lent slices).
    Lent { slice: usize, range: Range<usize> },
    /// `len` bytes at `offset` of a lent file (payload `payload`); not memory: [`Outbox::slice`]
    /// has nothing for it, the engine sends it with `sendfile` ([`Outbox::file`]).
    File {
        payload: usize,
        offset: u64,
        len: usize,
    },
}

impl Part {
    pub fn len(&self) -> usize {
        match self {
            Part::Bytes(r) => r.len(),
            Part::Payload { range, .. } | Part::Lent { range, .. } => range.len(),
            Part::File { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

enum Payload {
    Owned(Vec<u8>),
    /// Indexes of `Outbox::lent` that make up the payload, in order.
    Lent(Range<usize>),
    File(FileRange),
}

/// Where the last lent-payload lookup ended: (payload, slice index, payload offset of that slice),
/// so Data-In PDUs cut in order from one payload find their slices without rescanning.
type LentCursor = (usize, usize, usize);

#[derive(Default)]
pub struct Outbox {
    bytes: Vec<u8>,
    parts: Vec<Part>,
    payloads: Vec<Payload>,
    lent: Vec<SharedSlice>,
    lent_cursor: Option<LentCursor>,
    spare: Vec<Vec<u8>>,
    /// Buffers kept for reuse; beyond this they are freed (bounded memory per connection).
    spare_max: usize,
    queued: usize,
    /// A part was asked for outside its payload: what is queued no longer matches the lengths
    /// its headers declare, and the connection must close (see [`Outbox::is_broken`]).
    broken: bool,
}

/// The outbox's recycled buffers as a backend that runs a read elsewhere sees them: only
/// taking one. The read's Data-In comes back through the same outbox and the buffer returns
/// to the pool once sent, so a connection's deferred reads reuse memory instead of allocating
/// and zero-filling up to megabytes each.
pub struct ReadBuffers<'a>(&'a mut Outbox);

impl ReadBuffers<'_> {
    /// A buffer that may hold bytes this connection sent earlier: the read must overwrite
    /// every byte it sends (resize, then fill), and send nothing when it fails.
    pub fn take(&mut self) -> Vec<u8> {
        self.0.take_scratch()
    }
}

/// Larger buffers (rare, huge transfers) are freed rather than kept, so an idle connection never
/// pins more than `spare_max * SPARE_CAPACITY_MAX` bytes.
const SPARE_CAPACITY_MAX: usize = 4 << 20;

impl Outbox {
    pub fn new(spare_max: usize) -> Outbox {
        Outbox {
            spare_max,
            ..Outbox::default()
        }
    }

    /// Whether a payload range out of bounds was pushed (a bug upstream): sending the queue
    /// would put the stream out of step with its PDU headers, so the engine closes the
    /// connection instead. Debug builds assert at the push.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn out_of_range(&mut self, what: &str) {
        debug_assert!(false, "outbox: {what} out of range");
        self.broken = true;
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    pub fn slice(&self, part: &Part) -> &[u8] {
        match part {
            Part::Bytes(r) => self.bytes.get(r.clone()).unwrap_or(&[]),
            Part::Payload { index, range } => match self.payloads.get(*index) {
                Some(Payload::Owned(p)) => p.get(range.clone()).unwrap_or(&[]),
                _ => &[],
            },
            Part::Lent { slice, range } => self
                .lent
                .get(*slice)
                .and_then(|(owner, _)| (**owner).as_ref().get(range.clone()))
                .unwrap_or(&[]),
            Part::File { .. } => &[],
        }
    }

    /// The file a [`Part::File`] is sent from.
    pub fn file(&self, part: &Part) -> Option<&std::fs::File> {
        match part {
            Part::File { payload, .. } => match self.payloads.get(*payload) {
                Some(Payload::File((file, _, _))) => Some(file),
                _ => None,
            },
            _ => None,
        }
    }

    /// Total bytes queued.
    pub fn len(&self) -> usize {
        self.queued
    }

    fn keep_spare(&mut self, buf: Vec<u8>) {
        // A buffer that never held anything would only displace a useful one.
        if buf.capacity() > 0
            && self.spare.len() < self.spare_max
            && buf.capacity() <= SPARE_CAPACITY_MAX
        {
            self.spare.push(buf);
        }
    }

    /// A cleared buffer for the SCSI layer to fill, recycled from earlier turns when possible.
    pub fn take_buffer(&mut self) -> Vec<u8> {
        let mut buf = self.take_scratch();
        buf.clear();
        buf
    }

    /// A recycled buffer that still holds bytes this connection sent earlier: a read overwrites
    /// it instead of zero-filling first (safe Rust cannot read into uninitialized memory), which
    /// saves a pass over up to megabytes per read.
    pub fn take_scratch(&mut self) -> Vec<u8> {
        self.spare.pop().unwrap_or_default()
    }

    /// The recycled buffers, for a backend running a read elsewhere (see [`ReadBuffers`]).
    pub fn read_buffers(&mut self) -> ReadBuffers<'_> {
        ReadBuffers(self)
    }

    /// Returns a buffer that ended up not being sent.
    pub fn give_back(&mut self, buf: Vec<u8>) {
        self.keep_spare(buf);
    }

    /// Appends bytes (headers, digests, small data) to the send queue.
    pub fn push_bytes(&mut self, data: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(data);
        let end = self.bytes.len();
        self.queued += data.len();
        if let Some(Part::Bytes(last)) = self.parts.last_mut() {
            if last.end == start {
                last.end = end;
                return;
            }
        }
        self.parts.push(Part::Bytes(start..end));
    }

    /// Gives a payload buffer to the outbox; returns its index for [`Outbox::push_payload`].
    pub fn adopt(&mut self, buf: Vec<u8>) -> usize {
        self.payloads.push(Payload::Owned(buf));
        self.payloads.len() - 1
    }

    /// Takes lent slices (emptying `slices`) as one payload; returns its index for
    /// [`Outbox::push_payload`]. They are released by [`Outbox::clear`].
    pub fn lend(&mut self, slices: &mut Vec<SharedSlice>) -> usize {
        let start = self.lent.len();
        self.lent.append(slices);
        self.payloads.push(Payload::Lent(start..self.lent.len()));
        self.payloads.len() - 1
    }

    /// Takes a lent file range as one payload; returns its index for [`Outbox::push_payload`].
    pub fn lend_file(&mut self, range: FileRange) -> usize {
        self.payloads.push(Payload::File(range));
        self.payloads.len() - 1
    }

    /// Total bytes of a payload.
    pub fn payload_len(&self, index: usize) -> usize {
        match self.payloads.get(index) {
            Some(Payload::Owned(p)) => p.len(),
            Some(Payload::Lent(slices)) => {
                self.lent[slices.clone()].iter().map(|s| s.1.len()).sum()
            }
            Some(Payload::File((_, _, len))) => *len,
            None => 0,
        }
    }

    /// Whether a payload is a file range (its bytes are not in memory).
    pub fn is_file_payload(&self, index: usize) -> bool {
        matches!(self.payloads.get(index), Some(Payload::File(_)))
    }

    /// Calls `f` with the pieces of `range` of a memory payload, in order; nothing for a file
    /// payload (its bytes are not in memory: a session that needs them, for a data digest, does
    /// not take file ranges).
    pub fn for_each_payload_piece(
        &self,
        index: usize,
        range: Range<usize>,
        mut f: impl FnMut(&[u8]),
    ) {
        match self.payloads.get(index) {
            Some(Payload::Owned(p)) => f(p.get(range).unwrap_or(&[])),
            Some(Payload::Lent(slices)) => {
                let mut at = 0;
                for (owner, r) in &self.lent[slices.clone()] {
                    let (start, end) = (at.max(range.start), (at + r.len()).min(range.end));
                    if start < end {
                        let within = r.start + start - at..r.start + end - at;
                        f((**owner).as_ref().get(within).unwrap_or(&[]));
                    }
                    at += r.len();
                    if at >= range.end {
                        break;
                    }
                }
            }
            Some(Payload::File(_)) | None => {}
        }
    }

    /// Queues a range of an adopted or lent payload.
    pub fn push_payload(&mut self, index: usize, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        let slices = match self.payloads.get(index) {
            Some(Payload::Owned(p)) => {
                if range.end > p.len() {
                    return self.out_of_range("payload range");
                }
                self.queued += range.len();
                self.parts.push(Part::Payload { index, range });
                return;
            }
            Some(Payload::File((_, offset, len))) => {
                if range.end > *len {
                    return self.out_of_range("file range");
                }
                let end = range.end;
                if range.start < end {
                    self.queued += end - range.start;
                    self.parts.push(Part::File {
                        payload: index,
                        offset: offset + range.start as u64,
                        len: end - range.start,
                    });
                }
                return;
            }
            Some(Payload::Lent(slices)) => slices.clone(),
            None => return self.out_of_range("payload index"),
        };

        // Resume from the previous lookup when it is in this payload and not past `range`.
        let (mut slice, mut at) = match self.lent_cursor {
            Some((i, slice, at)) if i == index && at <= range.start => (slice, at),
            _ => (slices.start, 0),
        };
        let mut pushed = 0;
        while slice < slices.end && at < range.end {
            let r = self.lent[slice].1.clone();
            let (start, end) = (at.max(range.start), (at + r.len()).min(range.end));
            if start < end {
                let piece = r.start + start - at..r.start + end - at;
                pushed += piece.len();
                self.queued += piece.len();
                self.parts.push(Part::Lent {
                    slice,
                    range: piece,
                });
            }
            if at + r.len() > range.end {
                break; // the next PDU continues in this slice
            }
            at += r.len();
            slice += 1;
        }
        self.lent_cursor = Some((index, slice, at));
        if pushed != range.len() {
            self.out_of_range("lent range");
        }
    }

    /// Everything was sent: forget it and recycle payload buffers.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.parts.clear();
        self.queued = 0;
        while let Some(payload) = self.payloads.pop() {
            if let Payload::Owned(buf) = payload {
                self.keep_spare(buf);
            }
        }
        // Lent memory goes back to its owner (a RAM LUN page may be written in place again).
        self.lent.clear();
        self.lent_cursor = None;
    }

    /// Drops `n` sent bytes from the front after a partial write.
    pub fn consume(&mut self, mut n: usize) {
        self.queued = self.queued.saturating_sub(n);
        let mut drop_parts = 0;
        for part in self.parts.iter_mut() {
            let len = part.len();
            if n >= len {
                n -= len;
                drop_parts += 1;
                continue;
            }
            match part {
                Part::Bytes(r) => r.start += n,
                Part::Payload { range, .. } | Part::Lent { range, .. } => range.start += n,
                Part::File { offset, len, .. } => {
                    *offset += n as u64;
                    *len -= n;
                }
            }
            break;
        }
        self.parts.drain(..drop_parts);
        if self.parts.is_empty() {
            self.clear();
        }
    }

    /// All queued bytes in order, file parts read from their files (tests and small tools;
    /// a file that cannot be read gives zeros).
    pub fn to_vec(&self) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut v = Vec::with_capacity(self.len());
        for p in &self.parts {
            match (p, self.file(p)) {
                (Part::File { offset, len, .. }, Some(file)) => {
                    let start = v.len();
                    v.resize(start + len, 0);
                    let _ = file.read_exact_at(&mut v[start..], *offset);
                }
                _ => v.extend_from_slice(self.slice(p)),
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_merge_and_payloads_keep_order() {
        let mut o = Outbox::new(4);
        o.push_bytes(b"ab");
        o.push_bytes(b"cd");
        let idx = o.adopt(b"PAYLOAD".to_vec());
        o.push_payload(idx, 1..4);
        o.push_bytes(b"ef");
        assert_eq!(o.parts().len(), 3);
        assert_eq!(o.to_vec(), b"abcdAYLef");
        assert_eq!(o.len(), 9);
    }

    #[test]
    fn partial_writes_consume_across_parts() {
        let mut o = Outbox::new(4);
        o.push_bytes(b"abc");
        let idx = o.adopt(b"0123456789".to_vec());
        o.push_payload(idx, 0..10);
        o.push_bytes(b"xyz");
        o.consume(2);
        assert_eq!(o.to_vec(), b"c0123456789xyz");
        o.consume(5);
        assert_eq!(o.to_vec(), b"456789xyz");
        o.consume(9);
        assert!(o.is_empty());
        assert_eq!(o.len(), 0);
    }

    fn lent(parts: &[&[u8]]) -> Vec<SharedSlice> {
        parts
            .iter()
            .map(|p| {
                // Lend the middle of a larger buffer, as a store page would.
                let mut owner = vec![0xEEu8; 2];
                owner.extend_from_slice(p);
                owner.push(0xEE);
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(owner);
                (owner, 2..2 + p.len())
            })
            .collect()
    }

    #[test]
    fn lent_payloads_are_cut_across_slices_in_order() {
        let mut o = Outbox::new(4);
        let mut slices = lent(&[b"abcd", b"efgh", b"ij"]);
        o.push_bytes(b"<");
        let idx = o.lend(&mut slices);
        assert!(slices.is_empty(), "the outbox took the slices");
        assert_eq!(o.payload_len(idx), 10);
        // PDU-sized cuts that straddle slice boundaries, each followed by a header.
        for range in [0..3, 3..9, 9..10] {
            o.push_payload(idx, range);
            o.push_bytes(b"|");
        }
        assert_eq!(o.to_vec(), b"<abc|defghi|j|");
        assert_eq!(o.len(), 14);
        let mut pieces = Vec::new();
        o.for_each_payload_piece(idx, 3..9, |p| pieces.push(p.to_vec()));
        assert_eq!(pieces, [b"d".to_vec(), b"efgh".to_vec(), b"i".to_vec()]);
        // A second payload and an out-of-order cut (no cursor reuse) still resolve.
        let second = o.lend(&mut lent(&[b"XY", b"Z"]));
        o.push_payload(second, 1..3);
        o.push_payload(idx, 0..1);
        assert!(o.to_vec().ends_with(b"|YZa"));
        o.consume(5);
        assert!(o.to_vec().starts_with(b"defghi|"));
    }

    #[test]
    fn clearing_releases_lent_memory() {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(vec![1u8; 8]);
        let mut o = Outbox::new(4);
        let idx = o.lend(&mut vec![(Arc::clone(&owner), 0..8)]);
        o.push_payload(idx, 0..8);
        assert_eq!(Arc::strong_count(&owner), 2);
        o.consume(8); // fully sent: consume clears
        assert_eq!(Arc::strong_count(&owner), 1);
    }

    #[test]
    fn buffers_are_recycled_and_bounded() {
        let mut o = Outbox::new(1);
        let mut b = o.take_buffer();
        b.extend_from_slice(&[1; 100]);
        let cap = b.capacity();
        let i = o.adopt(b);
        o.push_payload(i, 0..100);
        let j = o.adopt(vec![2; 10]);
        o.push_payload(j, 0..10);
        o.clear();
        let again = o.take_buffer();
        assert!(again.is_empty());
        assert!(again.capacity() == cap || again.capacity() == 10);
        assert!(o.take_buffer().capacity() == 0, "only one spare kept");
    }

    #[test]
    fn empty_buffers_are_not_kept() {
        let mut o = Outbox::new(2);
        o.give_back(Vec::with_capacity(64));
        // Kept, it would be taken first (the spares are a stack) and the pool would hand out
        // a buffer that must grow from nothing.
        o.give_back(Vec::new());
        assert_eq!(o.take_buffer().capacity(), 64, "the useful one comes first");
        assert_eq!(o.take_buffer().capacity(), 0, "and the pool is then empty");
    }
}

#[cfg(test)]
mod range_tests {
    use super::*;

    /// A payload range past its buffer is a bug upstream: debug builds stop at the push.
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "out of range"))]
    fn a_range_past_its_payload_breaks_the_outbox() {
        let mut out = Outbox::new(2);
        let index = out.adopt(vec![1; 100]);
        out.push_payload(index, 50..150);
        // Release builds: nothing was queued for it, and the engine is told to close.
        assert!(out.is_broken());
        assert_eq!(out.len(), 0);
    }

    #[test]
    fn ranges_within_their_payloads_are_fine() {
        let mut out = Outbox::new(2);
        let index = out.adopt(vec![1; 100]);
        out.push_payload(index, 0..100);
        let owner: SharedSlice = (std::sync::Arc::new(vec![2u8; 64]), 0..64);
        let lent = out.lend(&mut vec![owner.clone(), owner]);
        out.push_payload(lent, 10..128);
        assert!(!out.is_broken());
        assert_eq!(out.len(), 100 + 118);
    }
}
