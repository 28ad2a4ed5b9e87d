//! Everything a connection sends in one turn, gathered for a single vectored write.
//!
//! Headers and small payloads are appended to one byte buffer; large Data-In payloads stay in the
//! buffer the SCSI layer filled and are referenced, not copied. The engine turns `parts()` into
//! `IoSlice`s, writes them, then calls [`Outbox::clear`], which recycles the payload buffers so the
//! steady state allocates nothing.

use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// A range of [`Outbox::bytes`].
    Bytes(Range<usize>),
    /// A range of one payload buffer.
    Payload { index: usize, range: Range<usize> },
}

#[derive(Default)]
pub struct Outbox {
    bytes: Vec<u8>,
    parts: Vec<Part>,
    payloads: Vec<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    /// Buffers kept for reuse; beyond this they are freed (bounded memory per connection).
    spare_max: usize,
    queued: usize,
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

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    pub fn slice(&self, part: &Part) -> &[u8] {
        match part {
            Part::Bytes(r) => self.bytes.get(r.clone()).unwrap_or(&[]),
            Part::Payload { index, range } => self
                .payloads
                .get(*index)
                .and_then(|p| p.get(range.clone()))
                .unwrap_or(&[]),
        }
    }

    /// Total bytes queued.
    pub fn len(&self) -> usize {
        self.queued
    }

    fn keep_spare(&mut self, buf: Vec<u8>) {
        if self.spare.len() < self.spare_max && buf.capacity() <= SPARE_CAPACITY_MAX {
            self.spare.push(buf);
        }
    }

    /// A cleared buffer for the SCSI layer to fill, recycled from earlier turns when possible.
    pub fn take_buffer(&mut self) -> Vec<u8> {
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf
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
        self.payloads.push(buf);
        self.payloads.len() - 1
    }

    pub fn payload(&self, index: usize) -> &[u8] {
        self.payloads.get(index).map_or(&[], |p| p.as_slice())
    }

    /// Queues a range of an adopted payload.
    pub fn push_payload(&mut self, index: usize, range: Range<usize>) {
        debug_assert!(index < self.payloads.len());
        if !range.is_empty() {
            self.queued += range.len();
            self.parts.push(Part::Payload { index, range });
        }
    }

    /// Everything was sent: forget it and recycle payload buffers.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.parts.clear();
        self.queued = 0;
        while let Some(buf) = self.payloads.pop() {
            self.keep_spare(buf);
        }
    }

    /// Drops `n` sent bytes from the front after a partial write.
    pub fn consume(&mut self, mut n: usize) {
        self.queued = self.queued.saturating_sub(n);
        let mut drop_parts = 0;
        for part in self.parts.iter_mut() {
            let len = match part {
                Part::Bytes(r) => r.len(),
                Part::Payload { range, .. } => range.len(),
            };
            if n >= len {
                n -= len;
                drop_parts += 1;
                continue;
            }
            match part {
                Part::Bytes(r) => r.start += n,
                Part::Payload { range, .. } => range.start += n,
            }
            break;
        }
        self.parts.drain(..drop_parts);
        if self.parts.is_empty() {
            self.clear();
        }
    }

    /// All queued bytes in order (tests and small tools).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for p in &self.parts {
            v.extend_from_slice(self.slice(p));
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
}
