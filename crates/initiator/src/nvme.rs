//! An NVMe/TCP host: an admin queue and one I/O queue to a subsystem, each its own TCP
//! connection, on the `nvme` crate's sans-IO host queue. Blocking and pipelined: submit many
//! commands, then take their completions. For the tests and `ferrosan bench`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// How long a queue waits for its socket (to take input, or room for output) before it
/// gives up: the read timeout its socket is given.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

use nvme::fabrics::{Connect, DYNAMIC_CONTROLLER};
use nvme::host::{next_len, Done, HostQueue};
use nvme::sqe::{Cqe, Sqe, Status};

/// Why a host command failed.
#[derive(Debug)]
pub enum NvmeError {
    Io(std::io::Error),
    /// The transport broke (a termination request, or a PDU that made no sense).
    Transport(nvme::pdu::Fatal),
    /// The controller answered with this status.
    Status(Status),
    /// DH-HMAC-CHAP failed: the controller refused the host, or the host the controller
    /// (or the controller required authentication and the host has no key).
    Auth(nvme::auth::Reason),
    /// The TLS handshake failed (a key the controller does not hold, say).
    Tls(String),
}

impl std::fmt::Display for NvmeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvmeError::Io(e) => write!(f, "I/O: {e}"),
            NvmeError::Transport(t) => write!(f, "transport: {t:?}"),
            NvmeError::Status(s) => write!(f, "status: SCT {} SC {:#04x}", s.sct, s.sc),
            NvmeError::Auth(r) => write!(f, "authentication: {}", r.name()),
            NvmeError::Tls(why) => write!(f, "TLS: {why}"),
        }
    }
}

impl std::error::Error for NvmeError {}

impl From<std::io::Error> for NvmeError {
    fn from(e: std::io::Error) -> Self {
        NvmeError::Io(e)
    }
}

/// A host's TLS pre-shared key (NVMe/TCP TLS 1.3): its configured PSK and how the TLS PSK is
/// derived from it (as the controller's configuration says).
#[derive(Clone, Debug)]
pub struct TlsPsk {
    pub key: std::sync::Arc<nvme::tls::ConfiguredKey>,
    pub derivation: nvme::tls::Derivation,
    /// The hash the PSK is bound with in the handshake when not the key's own: Debian 13's
    /// host (ktls-utils 1.0) binds SHA-384 keys with SHA-256 (offering the key's AES-GCM
    /// suite and ChaCha20-Poly1305), and a target has to serve it.
    pub bound_with: Option<nvme::tls::CipherHash>,
}

impl TlsPsk {
    /// A key in its interchange form (`NVMeTLSkey-1:01:...:`) with its derivation by name
    /// (`spec` or `libnvme-1.15`).
    pub fn parse(key: &str, derivation: &str) -> Result<TlsPsk, String> {
        let derivation = nvme::tls::Derivation::from_name(derivation)
            .ok_or_else(|| format!("derivation {derivation:?}: spec or libnvme-1.15"))?;
        let key = nvme::tls::ConfiguredKey::parse(key).map_err(|e| e.to_string())?;
        Ok(TlsPsk {
            key: std::sync::Arc::new(key),
            derivation,
            bound_with: None,
        })
    }
}

/// A queue's byte stream: the socket, or TLS over it.
enum Stream {
    Tcp(TcpStream),
    Tls(Box<openssl::ssl::SslStream<Batched>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Tcp(s) => s,
            Stream::Tls(s) => &s.get_ref().tcp,
        }
    }
}

/// The socket under a TLS stream, read and written in large pieces: OpenSSL reads a record's
/// header and body and writes each record on its own, a system call each; here one read takes
/// what has arrived and the records of one send go out together at the flush (as the target's
/// NVMe door does, `dataplane/batched.rs`).
struct Batched {
    tcp: TcpStream,
    read: Vec<u8>,
    start: usize,
    end: usize,
    held: Vec<u8>,
}

impl Batched {
    fn new(tcp: TcpStream) -> Batched {
        Batched {
            tcp,
            read: vec![0; 128 * 1024],
            start: 0,
            end: 0,
            held: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Batched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched").field("tcp", &self.tcp).finish()
    }
}

impl Read for Batched {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.start == self.end {
            self.end = self.tcp.read(&mut self.read)?;
            self.start = 0;
        }
        let n = buf.len().min(self.end - self.start);
        buf[..n].copy_from_slice(&self.read[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// Records held before they are sent without waiting for the flush: a deep queue's writes
/// reach the target while the rest are still being encrypted.
const TLS_HELD_MAX: usize = 32 * 1024;

impl Write for Batched {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.held.len() >= TLS_HELD_MAX {
            self.flush()?;
        }
        self.held.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.write_all(&self.held)?;
        self.held.clear();
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// TLS 1.3 over `tcp` with the PSK `tls` derives for `hostnqn` and `subnqn` (identity
/// `NVMe0R0H <hostnqn> <subnqn>`), no certificate.
fn tls_over(
    tcp: TcpStream,
    tls: &TlsPsk,
    hostnqn: &str,
    subnqn: &str,
) -> Result<Stream, NvmeError> {
    use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode, SslVersion};
    let failed = |e: &dyn std::fmt::Display| NvmeError::Tls(e.to_string());
    let cipher = tls.key.cipher();
    let identity = format!("NVMe0R{:02} {hostnqn} {subnqn}", cipher.id());
    let parsed = nvme::tls::Identity::parse(identity.as_bytes())
        .map_err(|e| NvmeError::Tls(format!("identity: {e:?}")))?;
    let psk = tls
        .key
        .tls_psk(&parsed, tls.derivation)
        .ok_or_else(|| NvmeError::Tls("no TLS PSK for this identity".into()))?;
    let hash = match tls.bound_with.unwrap_or(cipher) {
        nvme::tls::CipherHash::Sha256 => tls13_psk::PskHash::Sha256,
        nvme::tls::CipherHash::Sha384 => tls13_psk::PskHash::Sha384,
    };
    // Bound with another hash than the key's, the suites are what Debian 13's host offers
    // then: the key's AES-GCM suite and ChaCha20-Poly1305.
    let suites = match tls.bound_with {
        Some(h) if h != cipher => format!("{}:TLS_CHACHA20_POLY1305_SHA256", cipher.suite()),
        _ => hash.suites().to_string(),
    };
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| failed(&e))?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))
        .and_then(|()| b.set_max_proto_version(Some(SslVersion::TLS1_3)))
        .and_then(|()| b.set_ciphersuites(&suites))
        .map_err(|e| failed(&e))?;
    b.set_verify(SslVerifyMode::NONE);
    let psk = tls13_psk::Psk { key: psk, hash };
    tls13_psk::set_client_psk(&mut b, identity.into_bytes(), psk).map_err(|e| failed(&e))?;
    let mut config = b.build().configure().map_err(|e| failed(&e))?;
    config.set_verify_hostname(false);
    config.set_use_server_name_indication(false);
    let stream = config
        .connect("", Batched::new(tcp))
        .map_err(|e| failed(&e))?;
    Ok(Stream::Tls(Box::new(stream)))
}

/// One queue's connection.
pub struct QueueConn {
    stream: Stream,
    queue: HostQueue,
    rbuf: Vec<u8>,
    end: usize,
    out: Vec<u8>,
    next_cid: u16,
    /// Completions received and not yet taken, oldest first.
    done: std::collections::VecDeque<Done>,
    /// What one receive completed (moved to `done`).
    fresh: Vec<Done>,
    /// While `Some`: the data R2Ts ask for, kept back (a host whose data is late, for tests
    /// of what a target does meanwhile).
    withheld: Option<Vec<u8>>,
    /// How long a wait for input spins on a clear socket before it sleeps in `recv`.
    busy_poll: Duration,
}

/// A queue's socket as every queue uses it: no Nagle delay, reads bounded by [`IO_TIMEOUT`].
fn tuned(tcp: TcpStream) -> std::io::Result<TcpStream> {
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(IO_TIMEOUT))?;
    Ok(tcp)
}

impl QueueConn {
    /// Opens a connection and initializes it (ICReq / ICResp) with these digests.
    pub fn open(addr: SocketAddr, digests: (bool, bool)) -> Result<QueueConn, NvmeError> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        QueueConn::over(stream, digests)
    }

    /// Initializes a queue on a connection the caller made (from a chosen source address,
    /// say).
    pub fn over(stream: TcpStream, digests: (bool, bool)) -> Result<QueueConn, NvmeError> {
        QueueConn::start(Stream::Tcp(tuned(stream)?), digests)
    }

    /// Opens a connection over TLS with `tls` for `hostnqn`'s queue to `subnqn`, and
    /// initializes it.
    pub fn open_tls(
        addr: SocketAddr,
        digests: (bool, bool),
        tls: &TlsPsk,
        hostnqn: &str,
        subnqn: &str,
    ) -> Result<QueueConn, NvmeError> {
        let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        QueueConn::over_tls(tcp, digests, tls, hostnqn, subnqn)
    }

    /// As [`QueueConn::open_tls`], on a connection the caller made (and may keep a clone of,
    /// to see what happens beneath TLS).
    pub fn over_tls(
        tcp: TcpStream,
        digests: (bool, bool),
        tls: &TlsPsk,
        hostnqn: &str,
        subnqn: &str,
    ) -> Result<QueueConn, NvmeError> {
        QueueConn::start(tls_over(tuned(tcp)?, tls, hostnqn, subnqn)?, digests)
    }

    fn start(stream: Stream, digests: (bool, bool)) -> Result<QueueConn, NvmeError> {
        let mut q = QueueConn {
            stream,
            queue: HostQueue::new(),
            rbuf: vec![0; 1 << 20],
            end: 0,
            out: Vec::new(),
            next_cid: 0,
            done: std::collections::VecDeque::new(),
            fresh: Vec::new(),
            withheld: None,
            busy_poll: Duration::ZERO,
        };
        // Shared write data goes from where it is, without a copy, in the clear.
        let clear = matches!(q.stream, Stream::Tcp(_));
        q.queue.splice_shared_data(clear);
        q.queue.icreq(digests, &mut q.out);
        q.flush()?;
        while !q.queue.initialized() {
            q.pump()?;
        }
        Ok(q)
    }

    fn flush(&mut self) -> Result<(), NvmeError> {
        if matches!(self.stream, Stream::Tcp(_)) {
            return self.send_taking_input();
        }
        self.stream.write_all(&self.out)?;
        self.stream.flush()?;
        self.out.clear();
        Ok(())
    }

    /// Sends `out` in the clear, with the write data the queue spliced into it, taking what
    /// arrives while the socket is full (completions, the next R2Ts), as a kernel host does: a
    /// deep queue of long writes then has commands answered and new ones sent while its data
    /// still goes out.
    fn send_taking_input(&mut self) -> Result<(), NvmeError> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        use rustix::io::Errno;
        // IO_TIMEOUT without progress, however long the whole output takes.
        let mut deadline = std::time::Instant::now() + IO_TIMEOUT;
        let mut sent = 0;
        loop {
            let Stream::Tcp(tcp) = &self.stream else {
                unreachable!("only a clear stream is sent here")
            };
            let spliced = self.queue.spliced();
            let mut slices = Vec::with_capacity(2 * spliced.len() + 1);
            let pieces = spliced
                .iter()
                .map(|s| (s.at, s.data.get(s.range.clone()).unwrap_or(&[])));
            let left = crate::splice::gather(&self.out, pieces, sent, &mut slices);
            if left == 0 {
                break;
            }
            let flags = rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL;
            let mut control = rustix::net::SendAncillaryBuffer::default();
            match rustix::net::sendmsg(tcp, &slices, &mut control, flags) {
                Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into()),
                Ok(n) => {
                    sent += n;
                    deadline = std::time::Instant::now() + IO_TIMEOUT;
                    continue;
                }
                Err(Errno::AGAIN | Errno::INTR) => {}
                Err(e) => return Err(NvmeError::Io(e.into())),
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(NvmeError::Io(std::io::ErrorKind::TimedOut.into()));
            }
            let timeout = Timespec::try_from(left).ok();
            let mut fds = [PollFd::new(tcp, PollFlags::IN | PollFlags::OUT)];
            match poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(NvmeError::Io(e.into())),
            }
            if fds[0].revents().contains(PollFlags::IN) {
                self.read_once(rustix::net::RecvFlags::DONTWAIT)?;
            }
        }
        self.out.clear();
        self.queue.sent_spliced();
        Ok(())
    }

    /// Reads once (waiting only without `DONTWAIT`, up to the socket's read timeout) and takes
    /// every whole PDU: completions to `done`, the data R2Ts ask for appended to `out` (or
    /// kept back while withholding). False if nothing was there to read.
    fn read_once(&mut self, flags: rustix::net::RecvFlags) -> Result<bool, NvmeError> {
        let need = next_len(&self.rbuf[..self.end]).max(self.end + 1);
        if self.rbuf.len() < need {
            self.rbuf.resize(need, 0);
        }
        let n = match &mut self.stream {
            Stream::Tcp(tcp) if !flags.is_empty() => {
                match rustix::net::recv(&*tcp, &mut self.rbuf[self.end..], flags) {
                    Ok((n, _)) => n,
                    Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return Ok(false),
                    Err(e) => return Err(NvmeError::Io(e.into())),
                }
            }
            stream => stream.read(&mut self.rbuf[self.end..])?,
        };
        if n == 0 {
            return Err(NvmeError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.end += n;
        let before = self.out.len();
        let used = self
            .queue
            .receive(&self.rbuf[..self.end], &mut self.out, &mut self.fresh)
            .map_err(NvmeError::Transport)?;
        self.rbuf.copy_within(used..self.end, 0);
        self.end -= used;
        self.done.extend(self.fresh.drain(..));
        if let Some(held) = self.withheld.as_mut() {
            held.extend_from_slice(&self.out[before..]);
            self.out.truncate(before);
        }
        Ok(true)
    }

    /// Reads once, waiting for input, takes every whole PDU and sends the data R2Ts asked for.
    fn pump(&mut self) -> Result<(), NvmeError> {
        if !self.spin_for_input()? {
            self.read_once(rustix::net::RecvFlags::empty())?;
        }
        self.flush()
    }

    /// Reads a clear socket without waiting, again and again for up to `busy_poll`, until
    /// something came (true) or the time is up (false: the caller sleeps in `recv`).
    fn spin_for_input(&mut self) -> Result<bool, NvmeError> {
        if self.busy_poll.is_zero() || !matches!(self.stream, Stream::Tcp(_)) {
            return Ok(false);
        }
        let began = std::time::Instant::now();
        while began.elapsed() < self.busy_poll {
            if self.read_once(rustix::net::RecvFlags::DONTWAIT)? {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        Ok(false)
    }

    /// Waits for input by spinning on the socket for up to `spin` before sleeping in `recv`
    /// (zero, the default: it sleeps at once, as the kernel's host does). A polling host
    /// answers a queue depth of 1 without a wake-up per answer, at the price of a CPU.
    /// Connections over TLS always sleep.
    pub fn set_busy_poll(&mut self, spin: Duration) {
        self.busy_poll = spin;
    }

    /// From now on, keep back the data the target's R2Ts ask for (`true`), or send what was
    /// kept back and stop keeping it (`false`).
    pub fn withhold_data(&mut self, on: bool) -> Result<(), NvmeError> {
        // Data kept back is copied: it is sent later, as bytes.
        let clear = matches!(self.stream, Stream::Tcp(_));
        self.queue.splice_shared_data(clear && !on);
        match (on, self.withheld.take()) {
            (true, held) => self.withheld = Some(held.unwrap_or_default()),
            (false, Some(mut held)) => {
                self.out.append(&mut held);
                self.flush()?;
            }
            (false, None) => {}
        }
        Ok(())
    }

    /// Reads once and takes what arrived (an R2T, say), without waiting for a completion.
    pub fn receive(&mut self) -> Result<(), NvmeError> {
        self.pump()
    }

    /// Commands answered with SUCCESS on their data, without a response capsule.
    pub fn successes_in_data(&self) -> u64 {
        self.queue.successes_in_data
    }

    /// Sends a command (its identifier set here) and returns the identifier.
    pub fn submit(
        &mut self,
        mut sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<u16, NvmeError> {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        sqe.0[2..4].copy_from_slice(&cid.to_le_bytes());
        self.queue.submit(sqe, data_out, data_in_len, &mut self.out);
        self.flush()?;
        Ok(cid)
    }

    /// Queues a command with identifier `cid` without sending it (the next
    /// [`QueueConn::next_done`] sends what is queued): many commands, one write.
    pub fn enqueue(
        &mut self,
        cid: u16,
        mut sqe: Sqe,
        data_out: impl Into<::nvme::host::WriteData>,
        data_in_len: u32,
    ) {
        sqe.0[2..4].copy_from_slice(&cid.to_le_bytes());
        self.queue.submit(sqe, data_out, data_in_len, &mut self.out);
    }

    /// The next completion (of any command). What is queued is sent before waiting for one
    /// (not before taking one already received: a pipelined caller's commands then leave in
    /// batches, one write for many, as a kernel host's do).
    pub fn next_done(&mut self) -> Result<Done, NvmeError> {
        while self.done.is_empty() {
            self.flush()?;
            self.pump()?;
        }
        self.done
            .pop_front()
            .ok_or(NvmeError::Io(std::io::ErrorKind::UnexpectedEof.into()))
    }

    /// Commands sent and not yet taken.
    pub fn in_flight(&self) -> usize {
        self.queue.outstanding() + self.done.len()
    }

    /// Runs one command to its completion (other completions arriving meanwhile are kept).
    pub fn run(
        &mut self,
        sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<Done, NvmeError> {
        let cid = self.submit(sqe, data_out, data_in_len)?;
        loop {
            if let Some(i) = self.done.iter().position(|d| d.cqe.cid == cid) {
                if let Some(done) = self.done.remove(i) {
                    return Ok(done);
                }
            }
            self.pump()?;
        }
    }

    /// As [`QueueConn::run`], a failing status as an error.
    pub fn run_ok(
        &mut self,
        sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<Done, NvmeError> {
        let done = self.run(sqe, data_out, data_in_len)?;
        if !done.cqe.status.is_success() {
            return Err(NvmeError::Status(done.cqe.status));
        }
        Ok(done)
    }

    /// Runs this queue's DH-HMAC-CHAP transaction (after a Connect that set ATR). A refusal by
    /// either side is [`NvmeError::Auth`]; a controller that failed the host closes the queue.
    pub fn authenticate(
        &mut self,
        keys: &Credentials,
        parties: nvme::auth::Parties,
    ) -> Result<(), NvmeError> {
        use nvme::auth::{host::Transaction, HashId};
        use nvme::fabrics::auth_sqe;
        let mut t = Transaction::new(keys.host.clone(), keys.controller.clone(), parties, 1);
        let mut random = |b: &mut [u8]| crate::driver::random_bytes(b);
        let negotiate = t.negotiate(&HashId::ALL, &keys.groups);
        self.run_ok(auth_sqe(0, true, negotiate.len() as u32), negotiate, 0)?;
        let challenge = self.run_ok(auth_sqe(0, false, AUTH_BUF), Vec::new(), AUTH_BUF)?;
        let reply = t
            .reply(&challenge.data, &mut random)
            .map_err(NvmeError::Auth)?;
        self.run_ok(auth_sqe(0, true, reply.len() as u32), reply, 0)?;
        let success1 = self.run_ok(auth_sqe(0, false, AUTH_BUF), Vec::new(), AUTH_BUF)?;
        match t.success1(&success1.data) {
            Ok(Some(success2)) => {
                self.run_ok(auth_sqe(0, true, success2.len() as u32), success2, 0)?;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(reason) => {
                let failure2 = t.failure2(reason);
                let _ = self.run(auth_sqe(0, true, failure2.len() as u32), failure2, 0);
                Err(NvmeError::Auth(reason))
            }
        }
    }

    /// Authenticates when a Connect's dword 0 asks (ATR, bit 17).
    pub fn authenticate_if_asked(
        &mut self,
        connect_dw0: u32,
        keys: Option<&Credentials>,
        subnqn: &str,
        hostnqn: &str,
    ) -> Result<(), NvmeError> {
        if connect_dw0 & 1 << 17 == 0 {
            return Ok(());
        }
        let keys = keys.ok_or(NvmeError::Auth(nvme::auth::Reason::NotUsable))?;
        let parties = nvme::auth::Parties {
            host_nqn: hostnqn.to_string(),
            subsystem_nqn: subnqn.to_string(),
        };
        self.authenticate(keys, parties)
    }

    /// The in-capsule data the controller takes (from its Identify data).
    pub fn set_in_capsule(&mut self, bytes: u32) {
        self.queue.in_capsule_max = bytes;
    }
}

/// The bytes an Authentication Receive asks for (Linux's buffer too).
const AUTH_BUF: u32 = 4096;

/// A host's DH-HMAC-CHAP keys, and the groups it offers.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub host: nvme::auth::Key,
    /// Set: the controller must prove it holds this key too.
    pub controller: Option<nvme::auth::Key>,
    pub groups: Vec<nvme::auth::DhGroup>,
}

/// A connected host: a controller's admin queue and one I/O queue.
pub struct NvmeHost {
    pub admin: QueueConn,
    pub io: QueueConn,
    pub cntlid: u16,
    /// Identify Controller's data.
    pub identify: Vec<u8>,
}

/// A Fabrics Connect's SQE and data for queue `qid`.
pub fn connect_command(
    qid: u16,
    sqsize: u16,
    cntlid: u16,
    subnqn: &str,
    hostnqn: &str,
    host_id: [u8; 16],
) -> (Sqe, Vec<u8>) {
    let c = Connect {
        qid,
        sqsize,
        cattr: 0,
        kato_ms: if qid == 0 { 15_000 } else { 0 },
        host_id,
        cntlid,
        subnqn: subnqn.to_string(),
        hostnqn: hostnqn.to_string(),
    };
    (c.sqe(0), c.data())
}

/// A Connect asking that SQ flow control be disabled, as Linux's hosts do when a discovery
/// entry allows it: reads then end on their data (C2HData with SUCCESS), with no response
/// capsule.
pub fn without_sq_flow_control(mut connect: Sqe) -> Sqe {
    connect.0[46] |= nvme::fabrics::CATTR_DISABLE_SQ_FLOW;
    connect
}

/// A Property Set of CC (the controller's configuration: EN, and the queue entry sizes).
pub fn property_set_cc(value: u32) -> Sqe {
    let mut s = [0u8; 64];
    s[0] = nvme::sqe::FABRICS;
    s[4] = nvme::fabrics::fctype::PROPERTY_SET;
    s[44..48].copy_from_slice(&nvme::fabrics::reg::CC.to_le_bytes());
    s[48..56].copy_from_slice(&u64::from(value).to_le_bytes());
    Sqe(s)
}

/// An SQE with `opcode`, `nsid` and command dwords 10..=15.
pub fn sqe(opcode: u8, nsid: u32, cdw: [u32; 6]) -> Sqe {
    let mut s = [0u8; 64];
    s[0] = opcode;
    s[4..8].copy_from_slice(&nsid.to_le_bytes());
    for (i, v) in cdw.iter().enumerate() {
        s[40 + i * 4..44 + i * 4].copy_from_slice(&v.to_le_bytes());
    }
    Sqe(s)
}

impl NvmeHost {
    /// Connects to subsystem `subnqn` at `addr` as `hostnqn`: the admin queue, the
    /// controller enabled, one I/O queue of `depth` entries.
    pub fn connect(
        addr: SocketAddr,
        subnqn: &str,
        hostnqn: &str,
        depth: u16,
    ) -> Result<NvmeHost, NvmeError> {
        NvmeHost::connect_with(addr, subnqn, hostnqn, depth, None)
    }

    /// As [`NvmeHost::connect`], authenticating each queue with `keys` when the controller
    /// requires it.
    pub fn connect_with(
        addr: SocketAddr,
        subnqn: &str,
        hostnqn: &str,
        depth: u16,
        keys: Option<&Credentials>,
    ) -> Result<NvmeHost, NvmeError> {
        NvmeHost::connect_secure(addr, subnqn, hostnqn, depth, keys, None)
    }

    /// As [`NvmeHost::connect_with`], each queue over TLS with `tls` when given.
    pub fn connect_secure(
        addr: SocketAddr,
        subnqn: &str,
        hostnqn: &str,
        depth: u16,
        keys: Option<&Credentials>,
        tls: Option<&TlsPsk>,
    ) -> Result<NvmeHost, NvmeError> {
        let host_id = host_id_of(hostnqn);
        let open = || match tls {
            None => QueueConn::open(addr, (false, false)),
            Some(t) => QueueConn::open_tls(addr, (false, false), t, hostnqn, subnqn),
        };
        let mut admin = open()?;
        let (connect, data) = connect_command(0, 31, DYNAMIC_CONTROLLER, subnqn, hostnqn, host_id);
        let connect = without_sq_flow_control(connect);
        let done = admin.run_ok(connect, data, 0)?;
        let cntlid = done.cqe.dw0 as u16;
        admin.authenticate_if_asked(done.cqe.dw0, keys, subnqn, hostnqn)?;
        // EN, 64-byte submission and 16-byte completion entries.
        admin.run_ok(property_set_cc(1 | 6 << 16 | 4 << 20), Vec::new(), 0)?;
        let identify = admin
            .run_ok(
                sqe(nvme::admin::opcode::IDENTIFY, 0, [1, 0, 0, 0, 0, 0]),
                Vec::new(),
                4096,
            )?
            .data;
        let ioccsz = u32::from_le_bytes(identify[1792..1796].try_into().unwrap_or([0; 4]));
        let mut io = open()?;
        io.set_in_capsule((ioccsz * 16).saturating_sub(64));
        let (connect, data) = connect_command(
            1,
            depth.saturating_sub(1).max(1),
            cntlid,
            subnqn,
            hostnqn,
            host_id,
        );
        let done = io.run_ok(without_sq_flow_control(connect), data, 0)?;
        io.authenticate_if_asked(done.cqe.dw0, keys, subnqn, hostnqn)?;
        Ok(NvmeHost {
            admin,
            io,
            cntlid,
            identify,
        })
    }

    /// Reads `blocks` blocks of `block_size` at `lba` of namespace `nsid`.
    pub fn read(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        block_size: u32,
    ) -> Result<Vec<u8>, NvmeError> {
        let s = rw(nvme::nvm::opcode::READ, nsid, lba, blocks);
        Ok(self.io.run_ok(s, Vec::new(), blocks * block_size)?.data)
    }

    /// Writes `data` (whole blocks) at `lba` of namespace `nsid`.
    pub fn write(
        &mut self,
        nsid: u32,
        lba: u64,
        data: Vec<u8>,
        block_size: u32,
    ) -> Result<(), NvmeError> {
        let blocks = (data.len() / block_size as usize) as u32;
        let s = rw(nvme::nvm::opcode::WRITE, nsid, lba, blocks);
        self.io.run_ok(s, data, 0).map(|_| ())
    }

    /// Ends the controller (closing the admin queue ends its I/O queues too).
    pub fn disconnect(self) {
        let _ = self.admin.stream.tcp().shutdown(std::net::Shutdown::Both);
        let _ = self.io.stream.tcp().shutdown(std::net::Shutdown::Both);
    }
}

/// A read or write SQE: starting LBA in CDW10-11, the 0's based block count in CDW12.
pub fn rw(opcode: u8, nsid: u32, lba: u64, blocks: u32) -> Sqe {
    sqe(
        opcode,
        nsid,
        [
            lba as u32,
            (lba >> 32) as u32,
            blocks.saturating_sub(1),
            0,
            0,
            0,
        ],
    )
}

/// A host identifier derived from the host NQN (stable for one name).
pub fn host_id_of(hostnqn: &str) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut id = [0u8; 16];
    for (i, b) in hostnqn.bytes().enumerate() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
        id[i % 16] ^= h as u8;
    }
    id
}

/// A completion's status as a result.
pub fn status(cqe: &Cqe) -> Result<(), NvmeError> {
    if cqe.status.is_success() {
        Ok(())
    } else {
        Err(NvmeError::Status(cqe.status))
    }
}
