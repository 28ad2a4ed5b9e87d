//! A connection's byte stream, whichever door: the TCP socket itself, or TLS 1.3 over it (an
//! NVMe/TCP queue whose host opened with a handshake, `nvme/wire.rs`). The driver reads and
//! sends through it; what only a socket in the clear can do (receive coalescing, busy
//! polling, sendfile) asks [`Wire::plain`].

use std::net::SocketAddr;
use std::os::unix::fs::FileExt as _;

use seam::outbox::{Outbox, Part};
use std::pin::Pin;
use std::task::Poll;

use tokio::io::{AsyncRead as _, AsyncReadExt as _, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio_openssl::SslStream;

use super::batched::Batched;
use super::closed::Closed;

/// Plain text gathered into one TLS write: a few records (16 KiB each).
const TLS_WRITE_CHUNK: usize = 64 * 1024;

pub(super) enum Wire {
    Plain(TcpStream),
    Tls(Box<SslStream<Batched<TcpStream>>>),
}

impl Wire {
    /// The socket, when the queue's bytes are its own (receive coalescing, busy polling and
    /// the held-back read act on the socket, and so only in the clear).
    pub(super) fn plain(&self) -> Option<&TcpStream> {
        match self {
            Wire::Plain(s) => Some(s),
            Wire::Tls(_) => None,
        }
    }

    /// The socket under either: what busy polling watches for input.
    pub(super) fn socket(&self) -> &TcpStream {
        match self {
            Wire::Plain(s) => s,
            Wire::Tls(s) => s.get_ref().get_ref(),
        }
    }

    /// Reads what has arrived (decrypted); 0 at the end of the stream. Cancel-safe.
    pub(super) async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Wire::Plain(s) => s.read(buf).await,
            Wire::Tls(s) => read_tls(s, buf).await,
        }
    }

    /// Sends everything queued in `out`, then clears it.
    pub(super) async fn send(&mut self, out: &mut Outbox, peer: SocketAddr) -> Result<(), Closed> {
        match self {
            Wire::Plain(s) => super::send::send(s, out, peer).await,
            Wire::Tls(s) => send_tls(s, out).await,
        }
    }

    /// Ends this end's sending: TLS's close_notify first, then the socket's FIN. Reading goes
    /// on (from [`Wire::socket`]).
    pub(super) async fn shutdown(&mut self) -> std::io::Result<()> {
        match self {
            Wire::Plain(s) => s.shutdown().await,
            Wire::Tls(s) => s.shutdown().await,
        }
    }

    /// Writes without waiting (a termination request on the way out); a TLS queue writes
    /// nothing here, as a record cannot be half sent.
    pub(super) fn try_write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        match self {
            Wire::Plain(s) => s.try_write(bytes),
            Wire::Tls(_) => Ok(0),
        }
    }
}

/// What has arrived through TLS: OpenSSL returns one record per read, and a host sends a
/// record per command or per few, so the records already in memory (OpenSSL's plaintext, the
/// bytes [`Batched`] read) are taken too: one turn for what one socket read brought, as in
/// the clear. Cancel-safe: each record's bytes are in `buf` once taken, and the call that
/// took them returns them.
async fn read_tls(s: &mut SslStream<Batched<TcpStream>>, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = s.read(buf).await?;
    while n > 0 && n < buf.len() && (s.ssl().pending() > 0 || s.get_ref().buffered() > 0) {
        let more = std::future::poll_fn(|cx| {
            let mut into = ReadBuf::new(&mut buf[n..]);
            match Pin::new(&mut *s).poll_read(cx, &mut into) {
                Poll::Ready(Ok(())) => Poll::Ready(into.filled().len()),
                // Not whole yet, or an error the next read meets: what was taken is returned.
                Poll::Ready(Err(_)) | Poll::Pending => Poll::Ready(0),
            }
        })
        .await;
        if more == 0 {
            break;
        }
        n += more;
    }
    Ok(n)
}

/// The outbox through TLS: its memory and file parts gathered into plain-text chunks, each
/// written (encrypted) whole. No sendfile or vectored write: the bytes pass through OpenSSL.
async fn send_tls(
    stream: &mut SslStream<Batched<TcpStream>>,
    out: &mut Outbox,
) -> Result<(), Closed> {
    if out.is_broken() {
        return Err(Closed::Invariant("outbox invariant broken"));
    }
    let mut chunk: Vec<u8> = Vec::with_capacity(TLS_WRITE_CHUNK);
    for part in out.parts() {
        match *part {
            Part::File { offset, len, .. } => {
                let file = out
                    .file(part)
                    .ok_or(Closed::Invariant("outbox: file part without its file"))?;
                let at = chunk.len();
                chunk.resize(at + len, 0);
                file.read_exact_at(&mut chunk[at..], offset)
                    .map_err(|e| Closed::Failed(format!("reading the LU file to send: {e}")))?;
            }
            _ => chunk.extend_from_slice(out.slice(part)),
        }
        if chunk.len() >= TLS_WRITE_CHUNK {
            stream.write_all(&chunk).await?;
            chunk.clear();
        }
    }
    if !chunk.is_empty() {
        stream.write_all(&chunk).await?;
    }
    stream.flush().await?;
    out.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;
    use crate::dataplane::testing::{loopback, runtime};

    #[test]
    fn a_plain_wire_is_the_socket_both_ways() {
        let rt = runtime();
        let (target, mut client, peer) = loopback(&rt);
        let mut wire = Wire::Plain(target);
        assert!(
            wire.plain().is_some(),
            "coalescing and busy polling act on it"
        );
        client.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        let n = rt.block_on(wire.read(&mut got)).unwrap();
        assert_eq!(&got[..n], &b"ping"[..n]);
        let mut out = Outbox::new(2);
        out.push_bytes(b"pong");
        rt.block_on(wire.send(&mut out, peer)).unwrap();
        assert!(out.is_empty());
        assert_eq!(wire.try_write(b"!").unwrap(), 1, "a write without waiting");
        let mut back = [0u8; 5];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"pong!");
    }
}
