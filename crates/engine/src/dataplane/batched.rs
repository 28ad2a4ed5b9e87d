//! The socket under a TLS stream, read and written in large pieces. OpenSSL asks its transport
//! for a record at a time (a read for each record's header and body, a write for each record),
//! which straight on the socket is a system call or two per NVMe command: a queue of 4 KiB reads
//! made 1.5 per I/O where the clear door makes one per 35. Here one read takes everything that
//! has arrived (OpenSSL then finds the next records in memory) and the records a turn produces
//! wait in memory until the flush that ends the turn sends them together.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What one socket read may take: many commands' records at once.
const READ_BYTES: usize = 128 * 1024;
/// Records held before they are sent without waiting for the flush: a turn answering many
/// reads starts sending while it encrypts the rest (the host works on the first meanwhile).
const WRITE_HELD_MAX: usize = 64 * 1024;

pub(crate) struct Batched<S> {
    inner: S,
    read: Box<[u8]>,
    /// `read[start..end]` arrived and is not taken yet.
    start: usize,
    end: usize,
    /// Records written and not yet sent; `sent` of them are.
    held: Vec<u8>,
    sent: usize,
}

impl<S> Batched<S> {
    pub(crate) fn new(inner: S) -> Batched<S> {
        Batched {
            inner,
            read: vec![0; READ_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            held: Vec::new(),
            sent: 0,
        }
    }
}

impl<S> Batched<S> {
    /// The socket.
    pub(crate) fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Bytes read from the socket and not taken yet.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }
}

impl<S: AsyncWrite + Unpin> Batched<S> {
    /// Sends what is held; resumable where it stopped.
    fn poll_send_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.held.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.held[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.held.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Batched<S> {
    /// Cancel-safe: bytes are taken from the socket into `read` only when it is empty, and
    /// handed out only in the call that returns them.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.start == this.end {
            let mut into = ReadBuf::new(&mut this.read);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut into))?;
            this.start = 0;
            this.end = into.filled().len();
        }
        let n = buf.remaining().min(this.end - this.start);
        buf.put_slice(&this.read[this.start..this.start + n]);
        this.start += n;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Batched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.held.len() >= WRITE_HELD_MAX {
            ready!(this.poll_send_held(cx))?;
        }
        this.held.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::dataplane::testing::{loopback, runtime};

    #[test]
    fn reads_take_what_arrived_and_writes_wait_for_the_flush() {
        let rt = runtime();
        let (target, mut client, _) = loopback(&rt);
        let mut b = Batched::new(target);
        client.write_all(b"one two").unwrap();
        // Everything that arrived is read at once, then handed out in the pieces asked for.
        let mut first = [0u8; 3];
        let mut got = 0;
        while got < 3 {
            got += rt.block_on(b.read(&mut first[got..])).unwrap();
        }
        assert_eq!(&first, b"one");
        let mut rest = [0u8; 16];
        let n = rt.block_on(b.read(&mut rest)).unwrap();
        assert_eq!(&rest[..n], &b" two"[..n]);
        // Written records stay until the flush, then go out in order.
        rt.block_on(b.write_all(b"abc")).unwrap();
        rt.block_on(b.write_all(b"def")).unwrap();
        client.set_nonblocking(true).unwrap();
        let mut probe = [0u8; 8];
        assert!(
            client.read(&mut probe).is_err(),
            "nothing sent before the flush"
        );
        rt.block_on(b.flush()).unwrap();
        client.set_nonblocking(false).unwrap();
        let mut back = [0u8; 6];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"abcdef");
    }
}
