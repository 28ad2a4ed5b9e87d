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

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};
    use std::sync::Arc;

    use super::*;
    use crate::dataplane::testing::{loopback, runtime};

    /// A file of the test's own, gone with it (sendfile reads a memfd as any file).
    fn scratch_file() -> std::fs::File {
        let fd = rustix::fs::memfd_create("send-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        std::fs::File::from(fd)
    }

    #[test]
    fn headers_payloads_and_file_ranges_go_out_in_their_order_and_the_outbox_empties() {
        let rt = runtime();
        let (mut stream, mut client, peer) = loopback(&rt);
        let mut file = scratch_file();
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&content).unwrap();
        let mut out = Outbox::new(4);
        out.push_bytes(b"header-1");
        let owned = out.adopt(vec![7u8; 70_000]);
        out.push_payload(owned, 0..70_000);
        out.push_bytes(b"header-2");
        let lent = out.lend_file((Arc::new(file), 1000, 150_000));
        // Two ranges of the file, as two PDUs' data would be.
        out.push_payload(lent, 0..100_000);
        out.push_bytes(b"header-3");
        out.push_payload(lent, 100_000..150_000);
        let mut expected = b"header-1".to_vec();
        expected.extend(vec![7u8; 70_000]);
        expected.extend(b"header-2");
        expected.extend(&content[1000..101_000]);
        expected.extend(b"header-3");
        expected.extend(&content[101_000..151_000]);
        let receiver = std::thread::spawn(move || {
            let mut got = vec![0u8; expected.len()];
            client.read_exact(&mut got).unwrap();
            assert!(got == expected, "the bytes differ from what was queued");
        });
        rt.block_on(send(&mut stream, &mut out, peer)).unwrap();
        assert!(out.is_empty(), "sent and cleared");
        assert_eq!(out.len(), 0, "nothing counted as queued");
        receiver.join().unwrap();
    }

    #[test]
    fn a_file_shorter_than_its_range_closes_the_connection_instead_of_sending_less() {
        let rt = runtime();
        let (mut stream, _client, peer) = loopback(&rt);
        let mut file = scratch_file();
        file.write_all(&[1u8; 4096]).unwrap();
        let mut out = Outbox::new(4);
        let lent = out.lend_file((Arc::new(file), 4096, 4096));
        out.push_payload(lent, 0..4096);
        let sent = rt.block_on(send(&mut stream, &mut out, peer));
        assert!(
            matches!(&sent, Err(Closed::Failed(why)) if why.contains("shorter")),
            "{sent:?}"
        );
    }

    #[test]
    fn a_peer_that_closed_ends_the_send_with_an_error() {
        let rt = runtime();
        let (mut stream, client, peer) = loopback(&rt);
        drop(client);
        let mut out = Outbox::new(4);
        let big = out.adopt(vec![0u8; 8 << 20]);
        out.push_payload(big, 0..8 << 20);
        assert!(rt.block_on(send(&mut stream, &mut out, peer)).is_err());
    }
}
