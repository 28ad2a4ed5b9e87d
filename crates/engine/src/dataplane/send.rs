//! Sending a turn's answers: one way for both doors. An [`Outbox`] holds headers and small
//! answers as bytes, and read data where it lies (store memory lent by the store, a page-cached
//! file range); it goes out in one vectored write per run of memory parts and one `sendfile`
//! per file range.

use std::io::IoSlice;
use std::net::SocketAddr;

use rustix::net::{SendAncillaryBuffer, SendFlags};
use seam::outbox::{Outbox, Part};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use super::closed::Closed;

/// Slices per writev call (Linux IOV_MAX is 1024).
const IOV_BATCH: usize = 512;

/// Sends everything queued in `out` with as few system calls as possible, then clears it
/// (returning lent memory to its owner and keeping payload buffers for reuse).
pub(super) async fn send(
    stream: &mut TcpStream,
    out: &mut Outbox,
    peer: SocketAddr,
) -> Result<(), Closed> {
    if out.is_broken() {
        // A bug, not the peer's doing: what is queued no longer matches its headers.
        tracing::error!(%peer, "outbox invariant broken (a payload range out of bounds); closing the connection");
        return Err(Closed::Invariant("outbox invariant broken"));
    }
    while let Some(first) = out.parts().first() {
        let written = if let &Part::File { offset, len, .. } = first {
            let Some(file) = out.file(first) else {
                return Err(Closed::Invariant("outbox: file part without its file"));
            };
            send_file(stream, file, offset, len).await?
        } else {
            send_memory(stream, out).await?
        };
        if written == 0 {
            return Err(Closed::Limit("peer stopped reading"));
        }
        out.consume(written);
    }
    out.clear();
    Ok(())
}

/// `len` bytes of `file` at `offset`, from the page cache; returns how many went.
async fn send_file(
    stream: &TcpStream,
    file: &std::fs::File,
    offset: u64,
    len: usize,
) -> Result<usize, Closed> {
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            let mut at = offset;
            rustix::fs::sendfile(stream, file, Some(&mut at), len).map_err(std::io::Error::from)
        })
        .await
        .map_err(|e| Closed::Failed(format!("sendfile: {e}")))?;
    if sent == 0 {
        // Only past the end of the file: it shrank under the LU.
        return Err(Closed::Failed(
            "sendfile: LU file shorter than its size".into(),
        ));
    }
    Ok(sent)
}

/// The memory parts up to the next file part (at most [`IOV_BATCH`]) in one vectored write;
/// returns how many bytes went.
async fn send_memory(stream: &mut TcpStream, out: &Outbox) -> Result<usize, Closed> {
    let mut file_follows = false;
    let slices: Vec<IoSlice<'_>> = out
        .parts()
        .iter()
        .take(IOV_BATCH)
        .take_while(|p| {
            file_follows = matches!(p, Part::File { .. });
            !file_follows
        })
        .map(|p: &Part| IoSlice::new(out.slice(p)))
        .collect();
    if !file_follows {
        return Ok(stream.write_vectored(&slices).await?);
    }
    // MSG_MORE: the headers wait for the file data instead of leaving alone in a small
    // segment (the socket has TCP_NODELAY).
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            rustix::net::sendmsg(
                &*stream,
                &slices,
                &mut SendAncillaryBuffer::default(),
                SendFlags::MORE | SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        })
        .await?;
    Ok(sent)
}
