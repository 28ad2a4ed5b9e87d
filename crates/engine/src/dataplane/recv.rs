//! A connection's receive buffer: one policy for both doors. It starts at [`RBUF_IDLE`] (room
//! for a login PDU or a Connect capsule and a few small commands), grows to its full size when
//! a read fills it or a partial PDU does not fit (a deep queue's commands are waiting: they
//! are read in fewer calls), and is given back after a housekeeping period with nothing
//! received: an idle connection in the clear holds no buffer and waits for its socket to
//! become readable, then takes the small one again. Allocating the full size up front made
//! every idle session pin it: once glibc serves blocks that large from its arenas a zeroed one
//! is written whole, so resident — 192–233 KiB of RSS per idle iSCSI session measured, 24 KiB
//! with the small buffer kept. A 4 KiB start saved 7 KiB but made receive coalescing engage
//! less for a pipelining initiator (docs/PERFORMANCE.md, *Cost as the array grows*); giving
//! the buffer back only after a silent period leaves a busy connection's reads as they were.
//! Through TLS the buffer is kept: OpenSSL may hold decrypted bytes the socket does not show.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;
use rustix::net::RecvFlags;

use super::closed::Closed;
use super::wire::Wire;
use super::{RBUF_BUSY, RBUF_IDLE};

/// Receive-buffer memory mapped from the kernel rather than taken from the heap: a page is
/// resident only once something was received into it, and the pages leave the process when
/// the buffer is given back, but for a thread's few spares (what is freed to glibc's heap
/// stays resident: giving back heap buffers left the RSS of 48 idle sessions where it was).
/// Empty: nothing mapped.
#[derive(Default)]
pub(super) struct Pages(Option<MmapMut>);

/// Small buffers a thread keeps once given back, for the next connection that needs one: an
/// idle session answering a ping takes one and gives it back without a system call (mapping
/// and unmapping one per ping cost 1,000 idle sessions 4 ms of CPU a second more).
const SPARE_PER_THREAD: usize = 8;

thread_local! {
    static SPARE: RefCell<Vec<Pages>> = const { RefCell::new(Vec::new()) };
}

impl Pages {
    /// A small buffer ([`RBUF_IDLE`]), a spare one of this thread's if it has one.
    fn small() -> Option<Pages> {
        SPARE
            .with_borrow_mut(Vec::pop)
            .or_else(|| Pages::zeroed(RBUF_IDLE))
    }

    /// Gives the memory back: a small buffer to this thread's spares while they are few, any
    /// other to the kernel.
    fn give_back(self) {
        if self.len() == RBUF_IDLE {
            SPARE.with_borrow_mut(|spare| {
                if spare.len() < SPARE_PER_THREAD {
                    spare.push(self);
                }
            });
        }
    }

    /// `len` zeroed bytes; None when the kernel refuses the mapping (logged).
    fn zeroed(len: usize) -> Option<Pages> {
        match MmapMut::map_anon(len) {
            Ok(map) => Some(Pages(Some(map))),
            Err(e) => {
                tracing::warn!("cannot map a receive buffer of {len} bytes: {e}");
                None
            }
        }
    }
}

impl Deref for Pages {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl DerefMut for Pages {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Some(map) => map,
            None => &mut [],
        }
    }
}

pub(super) struct RecvBuf {
    buf: Pages,
    /// The first byte not handled yet.
    start: usize,
    /// The end of what was received.
    end: usize,
    /// The size it grows to: twice the door's largest PDU, at least [`RBUF_BUSY`], so a whole
    /// PDU always fits behind a partial one moved to the front.
    full: usize,
    /// Bytes arrived since the last tick.
    received: bool,
}

impl RecvBuf {
    /// A buffer for a door whose largest PDU (headers, payload, digests) is `largest_pdu`.
    pub(super) fn new(largest_pdu: usize) -> RecvBuf {
        let full = largest_pdu.saturating_mul(2).max(RBUF_BUSY);
        RecvBuf {
            buf: Pages::small().unwrap_or_default(),
            start: 0,
            end: 0,
            full,
            received: false,
        }
    }

    /// What was received and not handled yet.
    pub(super) fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// What was received from `base` on (a turn's input: the data of commands taken from it
    /// stays there until [`RecvBuf::make_room`]).
    pub(super) fn since(&self, base: usize) -> &[u8] {
        &self.buf[base.min(self.end)..self.end]
    }

    /// Where [`RecvBuf::pending`] begins in [`RecvBuf::lend`]'s buffer.
    pub(super) fn start(&self) -> usize {
        self.start
    }

    /// The end of what was received, in [`RecvBuf::lend`]'s buffer.
    pub(super) fn end(&self) -> usize {
        self.end
    }

    pub(super) fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Where a read stops for a door that wants it to end at `stop` (the next header, say):
    /// there, within the buffer, unless that leaves nothing to read into — a read into an
    /// empty range returns 0, which means the peer closed — then at the buffer's end.
    pub(super) fn stop_at(&self, stop: usize) -> usize {
        let stop = stop.min(self.buf.len());
        if stop > self.end {
            stop
        } else {
            self.buf.len()
        }
    }

    /// `n` bytes of the pending input were handled.
    pub(super) fn consume(&mut self, n: usize) {
        debug_assert!(
            self.start + n <= self.end,
            "consumed more than was received"
        );
        self.start = (self.start + n).min(self.end);
    }

    /// Forgets everything pending (its bytes were moved elsewhere).
    pub(super) fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// The buffer itself, lent to commands that read their data where it lies; given back
    /// with [`RecvBuf::restore`] before anything is read into it.
    pub(super) fn lend(&mut self) -> Pages {
        std::mem::take(&mut self.buf)
    }

    pub(super) fn restore(&mut self, buf: Pages) {
        debug_assert!(self.buf.is_empty() && buf.len() >= self.end);
        self.buf = buf;
    }

    /// The free tail up to `stop` (a door may stop a read early, at the next header), for a
    /// read; never empty, since a read into nothing looks like the end of the stream.
    pub(super) fn tail(&mut self, stop: usize) -> Result<&mut [u8], Closed> {
        let stop = stop.min(self.buf.len());
        if stop <= self.end {
            return Err(Closed::Limit("receive buffer full"));
        }
        Ok(&mut self.buf[self.end..stop])
    }

    /// Counts `n` bytes read into the tail. A read that filled the buffer means more is
    /// waiting: from then on the connection reads in full-size batches.
    pub(super) fn received(&mut self, n: usize) {
        debug_assert!(self.end + n <= self.buf.len());
        self.end = (self.end + n).min(self.buf.len());
        self.received = n > 0 || self.received;
        self.grow_if_full();
    }

    /// Moves a partial PDU to the front when the tail of the buffer is short, and grows a
    /// small buffer that one partial PDU fills.
    pub(super) fn make_room(&mut self) {
        if self.start == self.end {
            self.clear();
        } else if self.buf.len() - self.end < self.buf.len() / 4 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        self.grow_if_full();
    }

    fn grow_if_full(&mut self) {
        if self.end == self.buf.len() && !self.buf.is_empty() && self.buf.len() < self.full {
            // Left as it is when the kernel refuses: reads go on in smaller pieces.
            if let Some(mut bigger) = Pages::zeroed(self.full) {
                bigger[..self.end].copy_from_slice(&self.buf[..self.end]);
                std::mem::replace(&mut self.buf, bigger).give_back();
            }
        }
    }

    /// Whether it holds a buffer.
    pub(super) fn holds(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Whether housekeeping should look again: until a buffer that `may_release` is given
    /// back, or a large one is small again.
    pub(super) fn shrinks_later(&self, may_release: bool) -> bool {
        self.buf.len() > RBUF_IDLE || (may_release && self.holds())
    }

    /// At housekeeping: a connection that received nothing since the last and holds no
    /// partial PDU gives its buffer back when it `may_release` it (a socket in the clear),
    /// else goes back to the small one.
    pub(super) fn shrink_if_idle(&mut self, may_release: bool) {
        if !self.received && self.start == self.end {
            if may_release {
                self.give_back_if_empty(true);
            } else if self.buf.len() > RBUF_IDLE {
                self.buf = Pages::small().unwrap_or_default();
                self.clear();
            }
        }
        self.received = false;
    }

    /// Gives the buffer back at once when nothing is pending and it `may_release` it.
    pub(super) fn give_back_if_empty(&mut self, may_release: bool) {
        if may_release && self.start == self.end {
            std::mem::take(&mut self.buf).give_back();
            self.clear();
        }
    }

    /// Takes the small buffer again if it was given back.
    pub(super) fn hold(&mut self) -> Result<(), Closed> {
        if self.buf.is_empty() {
            debug_assert_eq!(self.end, 0, "bytes pending in a buffer given back");
            self.buf = Pages::small().ok_or(Closed::Limit("no memory to receive into"))?;
            self.clear();
        }
        Ok(())
    }

    /// The free tail up to `stop` for a wait on the socket; None when the buffer was given
    /// back (the wait is for readability, then [`RecvBuf::read_ready`]).
    pub(super) fn wait_tail(&mut self, stop: usize) -> Result<Option<&mut [u8]>, Closed> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        self.tail(stop).map(Some)
    }

    /// The socket of a connection whose buffer was given back became readable and the buffer
    /// was taken again ([`RecvBuf::hold`]): reads what is there, up to the door's `stop`;
    /// false at the end of the stream. A stale readiness reads nothing (tokio clears it, so
    /// the next wait sleeps).
    pub(super) fn read_ready(&mut self, stream: &Wire, stop: usize) -> Result<bool, Closed> {
        let Some(socket) = stream.plain() else {
            // Never given back through TLS; were it, the next wait reads through OpenSSL.
            debug_assert!(false, "a receive buffer given back under TLS");
            return Ok(true);
        };
        match read_draining(socket, self.tail(stop)?) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.received(n);
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(true),
            Err(e) => Err(Closed::Io(e)),
        }
    }

    /// Reads at least one byte (room made first); the end of the stream is a close.
    pub(super) async fn fill(&mut self, stream: &mut Wire) -> Result<(), Closed> {
        self.hold()?;
        self.make_room();
        let full = self.buf.len();
        match stream.read(self.tail(full)?).await {
            Ok(0) => Err(Closed::Limit("peer closed")),
            Ok(n) => {
                self.received(n);
                Ok(())
            }
            Err(e) => Err(Closed::Io(e)),
        }
    }

    /// Reads what the socket's receive low-water mark held back (once a batch's wait is over);
    /// false at the end of the stream. Only a socket in the clear holds bytes back.
    pub(super) fn read_held_back(&mut self, stream: &Wire) -> Result<bool, Closed> {
        let Some(socket) = stream.plain() else {
            return Ok(true);
        };
        self.hold()?;
        let full = self.buf.len();
        let Ok(tail) = self.tail(full) else {
            return Ok(true);
        };
        match rustix::net::recv(socket, tail, RecvFlags::DONTWAIT) {
            Ok((0, _)) => Ok(false),
            Ok((n, _)) => {
                self.received(n);
                Ok(true)
            }
            Err(rustix::io::Errno::AGAIN) => Ok(true),
            Err(e) => Err(Closed::Io(e.into())),
        }
    }
}

/// Reads what `socket` holds into `buf`, without waiting. A read shorter than `buf` took all
/// the socket held, so its readiness is cleared as an empty read would: an idle connection's
/// next wait then sleeps instead of reading once more to find nothing (a system call and a
/// turn for each ping an idle session answers). tokio clears only the readiness this read
/// saw: bytes that arrive after it wake the wait again.
fn read_draining(socket: &tokio::net::TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut took = 0;
    let read = socket.try_io(tokio::io::Interest::READABLE, || {
        let (n, _) = rustix::net::recv(socket, &mut *buf, rustix::net::RecvFlags::empty())
            .map_err(std::io::Error::from)?;
        took = n;
        match n > 0 && n < buf.len() {
            true => Err(std::io::ErrorKind::WouldBlock.into()),
            false => Ok(n),
        }
    });
    match read {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && took > 0 => Ok(took),
        read => read,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::task::Poll;

    /// Whether `socket` shows readable without waiting (one poll).
    fn shows_readable(socket: &tokio::net::TcpStream) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        matches!(socket.poll_read_ready(&mut cx), Poll::Ready(Ok(())))
    }

    #[test]
    fn a_short_read_clears_readiness_and_new_bytes_set_it_again() {
        let rt = super::super::testing::runtime();
        let (target, mut host, _) = super::super::testing::loopback(&rt);
        rt.block_on(async {
            let mut buf = [0u8; 64];
            host.write_all(b"ping").unwrap();
            target.readable().await.unwrap();
            assert_eq!(read_draining(&target, &mut buf).unwrap(), 4);
            assert!(
                !shows_readable(&target),
                "a drained socket still shows readable"
            );
            // Readiness comes back with the next bytes, not lost with the cleared one.
            host.write_all(&[7u8; 100]).unwrap();
            target.readable().await.unwrap();
            // A full read leaves readiness as it was: more may be waiting.
            assert_eq!(read_draining(&target, &mut buf).unwrap(), 64);
            assert!(shows_readable(&target));
            assert_eq!(read_draining(&target, &mut buf).unwrap(), 36);
            assert_eq!(&buf[..36], &[7u8; 36]);
            drop(host);
            target.readable().await.unwrap();
            assert_eq!(
                read_draining(&target, &mut buf).unwrap(),
                0,
                "the end of the stream"
            );
        });
    }

    fn receive(b: &mut RecvBuf, bytes: &[u8]) {
        let full = b.capacity();
        let tail = b.tail(full).unwrap();
        tail[..bytes.len()].copy_from_slice(bytes);
        b.received(bytes.len());
    }

    #[test]
    fn an_idle_buffer_is_small_and_a_read_that_fills_it_grows_it_to_twice_the_largest_pdu() {
        let mut b = RecvBuf::new(300 * 1024);
        assert_eq!(b.capacity(), RBUF_IDLE);
        receive(&mut b, &[7; RBUF_IDLE]);
        assert_eq!(b.capacity(), 600 * 1024, "full: two of the largest PDU");
        assert_eq!(b.pending(), &[7; RBUF_IDLE][..], "contents kept");
        // A door of small PDUs still batches a deep queue's reads.
        assert_eq!(RecvBuf::new(100).full, RBUF_BUSY);
    }

    #[test]
    fn a_partial_pdu_moves_to_the_front_only_when_the_tail_is_short() {
        let mut b = RecvBuf::new(RBUF_IDLE / 4);
        receive(&mut b, &[1; 1000]);
        b.consume(900);
        b.make_room();
        assert_eq!(b.start(), 900, "a long tail: nothing moved");
        receive(&mut b, &[2; RBUF_IDLE - 1000 - 100]);
        b.consume(b.pending().len() - 10);
        b.make_room();
        assert_eq!(
            (b.start(), b.pending().len()),
            (0, 10),
            "a short tail: moved"
        );
        b.consume(10);
        b.make_room();
        assert_eq!((b.start(), b.end()), (0, 0), "all handled: from the front");
    }

    #[test]
    fn a_second_without_input_shrinks_an_empty_buffer_but_never_one_holding_a_partial_pdu() {
        for may_release in [false, true] {
            let mut b = RecvBuf::new(1 << 20);
            receive(&mut b, &[0; RBUF_IDLE]);
            b.consume(RBUF_IDLE - 1);
            b.shrink_if_idle(may_release);
            b.shrink_if_idle(may_release);
            assert!(b.capacity() > RBUF_IDLE, "a partial PDU keeps the buffer");
            receive(&mut b, &[0; 9]);
            b.consume(10);
            b.shrink_if_idle(may_release);
            assert!(
                b.capacity() > RBUF_IDLE,
                "input in the last second keeps it"
            );
            b.shrink_if_idle(may_release);
            let idle = if may_release { 0 } else { RBUF_IDLE };
            assert_eq!((b.capacity(), b.holds()), (idle, !may_release));
            assert!(b.pending().is_empty());
        }
    }

    #[test]
    fn a_buffer_given_back_stays_empty_until_input_comes() {
        let mut b = RecvBuf::new(1 << 20);
        b.shrink_if_idle(true);
        assert!(!b.holds());
        // The turn's bookkeeping does not grow it back.
        b.make_room();
        assert_eq!(b.capacity(), 0);
        assert!(
            b.wait_tail(0).expect("no error").is_none(),
            "wait on readiness"
        );
        // Input takes the small buffer again, and a full read grows it as before.
        b.hold().expect("mapped");
        assert_eq!(b.capacity(), RBUF_IDLE);
        assert_eq!(
            b.wait_tail(RBUF_IDLE).expect("room").map(|t| t.len()),
            Some(RBUF_IDLE)
        );
        receive(&mut b, &[3; RBUF_IDLE]);
        assert_eq!(b.capacity(), 2 << 20);
        // Never with input pending, nor through TLS.
        b.give_back_if_empty(true);
        assert!(b.holds(), "pending input keeps it");
        b.consume(RBUF_IDLE);
        b.give_back_if_empty(false);
        assert!(b.holds(), "TLS keeps it");
        b.give_back_if_empty(true);
        assert!(!b.holds());
    }

    #[test]
    fn a_full_buffer_gives_no_empty_tail_to_read_into() {
        let mut b = RecvBuf::new(RBUF_BUSY / 2);
        receive(&mut b, &[0; RBUF_IDLE]);
        let full = b.capacity();
        receive(&mut b, &vec![0; full - RBUF_IDLE]);
        assert!(matches!(b.tail(full), Err(Closed::Limit(_))));
        // A door's early stop at or before the end is no room either.
        assert!(b.tail(b.end()).is_err());
        let lent = b.lend();
        assert_eq!(lent.len(), full);
        b.restore(lent);
        assert_eq!(b.pending().len(), full);
    }
}
