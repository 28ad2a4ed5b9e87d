//! The I/O driver: one non-blocking `std::net::TcpStream` per session, multiplexed with
//! `poll(2)` on one thread, around the sans-IO [`Login`] and [`Session`].
//!
//! [`Connection`] is the pipelined interface: [`Connection::submit`] many commands, then take
//! [`Connection::next_completion`]s; one `read` and one `write` system call serve every PDU
//! that is ready, so a deep queue costs few system calls per command. [`Client`] adds blocking
//! helpers (`read`, `write`, `command`, ...) with retries of BUSY / TASK SET FULL, optional
//! retries on unit attention, and reconnects after a lost connection.
//!
//! Nothing waits without a deadline: connect, login, each command (the session's command
//! timeout), and pings of a silent target (the session's NOP interval and response timeout).
//!
//! The driver does I/O only while it is called: a connection left alone for longer than the
//! target's NOP-In timeout answers none of its pings and may be dropped by the target (the
//! blocking helpers then reconnect). The blocking helpers copy write data once more than the
//! pipelined interface (to resubmit it after a reconnect).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::config::{ClientConfig, SessionKind};
use crate::error::{CommandError, Error};
use crate::login::{Login, LOGIN_RANDOM_BYTES};
use crate::scsi::{self, status, Capacity, Cdb, Inquiry, Sense};
use crate::session::{
    Command, Completion, DiscoveredTarget, Event, ScsiResult, Session, Tmf, Transfer,
};

/// Bytes of output above which `submit` writes at once instead of waiting for the next wait.
const EAGER_FLUSH_BYTES: usize = 256 * 1024;

/// Random bytes from the kernel (`/dev/urandom`); if that fails, from std's randomly keyed
/// hasher mixed with the time (good enough for an ISID, still unpredictable for a challenge).
pub fn random_bytes(out: &mut [u8]) {
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(out))
        .is_ok()
    {
        return;
    }
    use std::hash::{BuildHasher, Hasher};
    for chunk in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(v.get(..chunk.len()).unwrap_or(&[]));
    }
}

/// A random ISID of the "random" format (RFC 7143 §11.12.5: T=10b).
pub fn random_isid() -> [u8; 6] {
    let mut isid = [0u8; 6];
    random_bytes(&mut isid);
    isid[0] = 0x80 | (isid[0] & 0x3f);
    isid
}

/// Resolves `host:port`, `[v6]:port`, `host` or `v6` (port 3260).
/// A TCP connection to the first of the configured address's addresses that answers.
fn dial(config: &ClientConfig) -> Result<TcpStream, Error> {
    let mut last_err = None;
    for addr in resolve(&config.address)? {
        match TcpStream::connect_timeout(&addr, config.timeouts.connect) {
            Ok(s) => return Ok(s),
            Err(e) => last_err = Some(e),
        }
    }
    match last_err {
        Some(e) if e.kind() == ErrorKind::TimedOut => Err(Error::Timeout {
            what: "TCP connect",
            after: config.timeouts.connect,
        }),
        Some(e) => Err(Error::Io(e)),
        None => Err(Error::Url("no address".into())),
    }
}

pub fn resolve(address: &str) -> Result<Vec<SocketAddr>, Error> {
    let with_port = if let Ok(addr) = address.parse::<SocketAddr>() {
        return Ok(vec![addr]);
    } else if let Ok(ip) = address.parse::<std::net::IpAddr>() {
        SocketAddr::new(ip, 3260).to_string()
    } else if address.starts_with('[') && address.ends_with(']') {
        format!("{address}:3260")
    } else if address.contains(':') {
        address.to_string()
    } else {
        format!("{address}:3260")
    };
    let addrs: Vec<SocketAddr> = with_port
        .to_socket_addrs()
        .map_err(|e| Error::Url(format!("cannot resolve {address}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::Url(format!("{address} resolves to no address")));
    }
    Ok(addrs)
}

/// A TCP connection in full feature phase.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    session: Session,
    inbuf: Vec<u8>,
    start: usize,
    end: usize,
    completions: VecDeque<Completion>,
    events: VecDeque<Event>,
    /// Why the connection is unusable, once it is.
    broken: Option<String>,
    config: ClientConfig,
}

impl Connection {
    /// Connects, logs in (within `timeouts.login`) and returns the session in full feature
    /// phase.
    pub fn connect(config: &ClientConfig) -> Result<Connection, Error> {
        let started = Instant::now();
        let deadline = started + config.timeouts.login;
        let stream = dial(config)?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let s = &config.session;
        let frame_max = 48 + 1020 + 8 + 4 + (s.max_recv_data_segment_length as usize).max(8192);
        let mut conn_io = Io {
            stream,
            inbuf: vec![0u8; (2 * frame_max).max(256 * 1024)],
            start: 0,
            end: 0,
        };
        let mut random = [0u8; LOGIN_RANDOM_BYTES];
        random_bytes(&mut random);
        let mut login = Login::new(config.session.clone(), random);
        while !login.is_complete() {
            if !login.output().is_empty() {
                let n = conn_io.write(login.output())?;
                login.advance_output(n);
            }
            let used = login.receive(conn_io.filled())?;
            conn_io.consume(used);
            if login.is_complete() {
                break;
            }
            let want_write = !login.output().is_empty();
            if !conn_io.read_some()? {
                conn_io.wait(want_write, Some(deadline), "login", config.timeouts.login)?;
            }
        }
        let session = login.into_session(Instant::now())?;
        let Io {
            stream,
            inbuf,
            start,
            end,
        } = conn_io;
        Ok(Connection {
            stream,
            session,
            inbuf,
            start,
            end,
            completions: VecDeque::new(),
            events: VecDeque::new(),
            broken: None,
            config: config.clone(),
        })
    }

    /// The sans-IO session (negotiated parameters, window, state).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Commands submitted whose completion has not been taken yet.
    pub fn in_flight(&self) -> usize {
        self.session.in_flight() + self.completions.len()
    }

    /// Why the connection is unusable, if it is.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Queues a command (sent at the next wait, or at once when much output is pending).
    pub fn submit(&mut self, cmd: Command) -> Result<u32, Error> {
        if self.broken.is_some() {
            return Err(Error::NotConnected);
        }
        let itt = self.session.submit(cmd, Instant::now())?;
        if self.session.output_len() >= EAGER_FLUSH_BYTES {
            self.pump(Some(Instant::now()), "send", |_| true)?;
        }
        Ok(itt)
    }

    /// Sends what is queued, without waiting for answers.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.pump(Some(Instant::now()), "send", |_| true)
    }

    /// The next completion, waiting for it if needed (bounded by the command timeout). When
    /// the connection fails, each outstanding command still completes (with
    /// [`CommandError::ConnectionLost`]); after the last, the error.
    pub fn next_completion(&mut self) -> Result<Completion, Error> {
        if let Some(c) = self.completions.pop_front() {
            return Ok(c);
        }
        if self.session.in_flight() == 0 {
            return Err(Error::InvalidCommand("no command in flight"));
        }
        let result = self.pump(None, "a command's completion", |c| {
            !c.completions.is_empty()
        });
        match (self.completions.pop_front(), result) {
            (Some(c), _) => Ok(c),
            (None, Err(e)) => Err(e),
            (None, Ok(())) => Err(Error::NotConnected),
        }
    }

    /// A completion if one is ready now (reads what has arrived, never waits).
    pub fn try_completion(&mut self) -> Result<Option<Completion>, Error> {
        if self.completions.is_empty() && self.broken.is_none() {
            let _ = self.pump(Some(Instant::now()), "poll", |_| true);
        }
        Ok(self.completions.pop_front())
    }

    /// The next completion if one arrives within `timeout` (`None` when none did, or when no
    /// command is in flight). For callers that interleave submitting and reaping.
    pub fn wait_completion(&mut self, timeout: Duration) -> Result<Option<Completion>, Error> {
        if let Some(c) = self.completions.pop_front() {
            return Ok(Some(c));
        }
        if self.session.in_flight() == 0 {
            return Ok(None);
        }
        let deadline = Instant::now() + timeout;
        match self.pump(Some(deadline), "a command's completion", |c| {
            !c.completions.is_empty()
        }) {
            Ok(()) | Err(Error::Timeout { .. }) => {}
            Err(e) if self.completions.is_empty() => return Err(e),
            Err(_) => {}
        }
        Ok(self.completions.pop_front())
    }

    /// [`Connection::wait_completion`] that also ends, with `Ok(None)`, as soon as `wake`
    /// becomes readable (an eventfd or pipe the caller drains): for a thread that waits for
    /// completions and must also take up new commands other threads hand it.
    pub fn wait_completion_or_wake(
        &mut self,
        timeout: Duration,
        wake: BorrowedFd<'_>,
    ) -> Result<Option<Completion>, Error> {
        if let Some(c) = self.completions.pop_front() {
            return Ok(Some(c));
        }
        if self.session.in_flight() == 0 {
            return Ok(None);
        }
        let deadline = Instant::now() + timeout;
        let what = "a command's completion";
        match self.pump_with(Some(deadline), what, Some(wake), |c| {
            !c.completions.is_empty()
        }) {
            Ok(()) | Err(Error::Timeout { .. }) => {}
            Err(e) if self.completions.is_empty() => return Err(e),
            Err(_) => {}
        }
        Ok(self.completions.pop_front())
    }

    /// Events other than completions (async messages, task management answers, pongs, ...),
    /// oldest first.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Waits up to `timeout` for an event other than a completion.
    pub fn wait_event(&mut self, timeout: Duration) -> Result<Option<Event>, Error> {
        if self.events.is_empty() {
            let deadline = Instant::now() + timeout;
            match self.pump(Some(deadline), "an event", |c| !c.events.is_empty()) {
                Ok(()) | Err(Error::Timeout { .. }) => {}
                Err(e) if self.events.is_empty() => return Err(e),
                Err(_) => {}
            }
        }
        Ok(self.events.pop_front())
    }

    /// Submits `cmd` and waits for its completion (other completions are kept for
    /// [`Connection::next_completion`]).
    pub fn run(&mut self, cmd: Command) -> Result<Completion, Error> {
        let tag = cmd.tag;
        self.submit(cmd)?;
        let mut others = Vec::new();
        let found = loop {
            match self.next_completion() {
                Ok(c) if c.tag == tag => break Ok(c),
                Ok(c) => others.push(c),
                Err(e) => break Err(e),
            }
        };
        for c in others.into_iter().rev() {
            self.completions.push_front(c);
        }
        found
    }

    /// Task management; waits for the answer (its response code).
    pub fn task_management(&mut self, tmf: Tmf) -> Result<u8, Error> {
        let tag = u64::MAX - 1;
        self.session.task_management(tag, tmf, Instant::now())?;
        match self.wait_for(tag)? {
            Event::TaskManagement { result, .. } => result.map_err(Error::Command),
            _ => Err(Error::NotConnected),
        }
    }

    /// Pings the target; returns the round trip time.
    pub fn ping(&mut self) -> Result<Duration, Error> {
        let tag = u64::MAX - 2;
        self.session.ping(tag, Instant::now())?;
        match self.wait_for(tag)? {
            Event::Pong { result, .. } => result.map_err(Error::Command),
            _ => Err(Error::NotConnected),
        }
    }

    /// SendTargets (`All` on a discovery session).
    pub fn send_targets(&mut self) -> Result<Vec<DiscoveredTarget>, Error> {
        let tag = u64::MAX - 3;
        self.session.send_targets(tag, Instant::now())?;
        match self.wait_for(tag)? {
            Event::SendTargets { result, .. } => result.map_err(Error::Command),
            _ => Err(Error::NotConnected),
        }
    }

    /// Logs out and closes the connection (within `timeouts.exchange`).
    pub fn logout(mut self) -> Result<(), Error> {
        let tag = u64::MAX - 4;
        self.session.logout(tag, Instant::now())?;
        let deadline = Instant::now() + self.config.timeouts.exchange;
        let found = |c: &Connection| {
            c.events
                .iter()
                .any(|e| matches!(e, Event::LoggedOut { tag: t, .. } if *t == tag))
        };
        self.pump(Some(deadline), "the logout response", found)?;
        Ok(())
    }

    fn wait_for(&mut self, tag: u64) -> Result<Event, Error> {
        let is_it = move |e: &Event| match e {
            Event::TaskManagement { tag: t, .. }
            | Event::Pong { tag: t, .. }
            | Event::SendTargets { tag: t, .. }
            | Event::LoggedOut { tag: t, .. } => *t == tag,
            _ => false,
        };
        let deadline = Instant::now() + self.config.timeouts.exchange;
        let result = self.pump(Some(deadline), "an answer", |c| c.events.iter().any(is_it));
        if let Some(pos) = self.events.iter().position(is_it) {
            if let Some(e) = self.events.remove(pos) {
                return Ok(e);
            }
        }
        result.and(Err(Error::NotConnected))
    }

    /// Runs I/O until `done` holds, the deadline passes (`Error::Timeout`), or the connection
    /// fails. A deadline already past means: do what is possible without waiting.
    fn pump(
        &mut self,
        deadline: Option<Instant>,
        what: &'static str,
        done: impl Fn(&Connection) -> bool,
    ) -> Result<(), Error> {
        self.pump_with(deadline, what, None, done)
    }

    /// [`Connection::pump`], ending with a timeout when `wake` becomes readable.
    fn pump_with(
        &mut self,
        deadline: Option<Instant>,
        what: &'static str,
        wake: Option<BorrowedFd<'_>>,
        done: impl Fn(&Connection) -> bool,
    ) -> Result<(), Error> {
        if let Some(why) = &self.broken {
            let _ = why;
            return Err(Error::NotConnected);
        }
        let started = Instant::now();
        let result = self.pump_inner(deadline, what, started, wake, &done);
        if let Err(e) = &result {
            if !matches!(e, Error::Timeout { what: w, .. } if *w == what) {
                // The connection is unusable: fail what is outstanding.
                self.broken = Some(e.to_string());
                self.session.connection_lost(&e.to_string());
                self.drain_events();
            }
        }
        result
    }

    fn pump_inner(
        &mut self,
        deadline: Option<Instant>,
        what: &'static str,
        started: Instant,
        wake: Option<BorrowedFd<'_>>,
        done: &impl Fn(&Connection) -> bool,
    ) -> Result<(), Error> {
        // When the current spin on the socket began (none while reads find input).
        let mut spinning: Option<Instant> = None;
        loop {
            // Write what we can, then read what has come.
            self.write_some()?;
            let read = self.read_some()?;
            self.drain_events();
            if done(self) {
                // Send what answering produced (R2T data, NOP replies) before returning.
                self.write_some()?;
                return Ok(());
            }
            if self.session.state() == crate::session::State::LoggedOut {
                return Err(Error::Closed);
            }
            match read {
                // The buffer filled up: more may be waiting.
                Got::Full => continue,
                // The socket is drained (a short read): wait rather than read again, after
                // sending what the input produced (R2T data, NOP replies).
                Got::Drained => {
                    self.write_some()?;
                }
                Got::Nothing => {}
            }
            let now = Instant::now();
            self.session.handle_timeout(now)?;
            self.drain_events();
            if done(self) {
                self.write_some()?;
                return Ok(());
            }
            if self.session.output_len() > 0 && self.write_some()? {
                continue;
            }
            let due = deadline.is_some_and(|d| d <= now);
            if !due && wake.is_none() && self.spins(&read, &mut spinning, now) {
                std::hint::spin_loop();
                continue;
            }
            let mut until = self.session.next_timeout();
            if let Some(d) = deadline {
                if d <= now {
                    return Err(Error::Timeout {
                        what,
                        after: now.saturating_duration_since(started),
                    });
                }
                until = Some(until.map_or(d, |w| w.min(d)));
            }
            let timeout = until.map(|w| w.saturating_duration_since(now));
            if wait_fd(&self.stream, self.session.output_len() > 0, timeout, wake)? {
                return Err(Error::Timeout {
                    what,
                    after: started.elapsed(),
                });
            }
        }
    }

    /// Whether the wait reads the socket again at once rather than sleeping: within
    /// `busy_poll` of the first read that found nothing, with nothing left to send.
    fn spins(&self, read: &Got, spinning: &mut Option<Instant>, now: Instant) -> bool {
        if self.config.busy_poll.is_zero() || self.session.output_len() > 0 {
            return false;
        }
        if !matches!(read, Got::Nothing) {
            *spinning = None;
        }
        let began = *spinning.get_or_insert(now);
        now.saturating_duration_since(began) < self.config.busy_poll
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.session.poll_event() {
            match e {
                Event::Completed(c) => self.completions.push_back(c),
                e @ (Event::Async(_) | Event::Rejected { .. } | Event::LogoutRequested { .. })
                    if self.events.len() >= crate::session::UNSOLICITED_EVENTS_MAX =>
                {
                    // Never taken by the caller: the oldest goes.
                    self.events.pop_front();
                    self.events.push_back(e);
                }
                other => self.events.push_back(other),
            }
        }
    }

    /// Writes until done or the socket is full; whether anything was written.
    fn write_some(&mut self) -> Result<bool, Error> {
        let mut wrote = false;
        while self.session.output_len() > 0 {
            let mut slices = Vec::new();
            self.session.output_slices(&mut slices);
            let written = self.stream.write_vectored(&slices);
            drop(slices);
            match written {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => {
                    self.session.advance_output(n);
                    wrote = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io(e)),
            }
        }
        Ok(wrote)
    }

    /// One `read` of what has arrived, handed to the session.
    fn read_some(&mut self) -> Result<Got, Error> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.inbuf.len() - self.end < self.inbuf.len() / 2 {
            self.inbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = self.inbuf.len() - self.end;
        let n = match self
            .stream
            .read(self.inbuf.get_mut(self.end..).unwrap_or(&mut []))
        {
            Ok(0) => return Err(Error::Closed),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return Ok(Got::Nothing)
            }
            Err(e) => return Err(Error::Io(e)),
        };
        self.end += n;
        let now = Instant::now();
        let used = self
            .session
            .receive(self.inbuf.get(self.start..self.end).unwrap_or(&[]), now)?;
        self.start += used;
        Ok(if n == room { Got::Full } else { Got::Drained })
    }
}

/// What one `read` found.
enum Got {
    Nothing,
    /// Less than the buffer's room: the socket had no more.
    Drained,
    /// The buffer's room filled: there may be more.
    Full,
}

/// The socket and receive buffer during login.
struct Io {
    stream: TcpStream,
    inbuf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Io {
    fn filled(&self) -> &[u8] {
        self.inbuf.get(self.start..self.end).unwrap_or(&[])
    }
    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
    }
    fn write(&mut self, data: &[u8]) -> Result<usize, Error> {
        match self.stream.write(data) {
            Ok(0) => Err(Error::Closed),
            Ok(n) => Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
            Err(e) => Err(Error::Io(e)),
        }
    }
    fn read_some(&mut self) -> Result<bool, Error> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.inbuf.len() {
            self.inbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        match self
            .stream
            .read(self.inbuf.get_mut(self.end..).unwrap_or(&mut []))
        {
            Ok(0) => Err(Error::Closed),
            Ok(n) => {
                self.end += n;
                Ok(true)
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                Ok(false)
            }
            Err(e) => Err(Error::Io(e)),
        }
    }
    fn wait(
        &self,
        write: bool,
        deadline: Option<Instant>,
        what: &'static str,
        limit: Duration,
    ) -> Result<(), Error> {
        let now = Instant::now();
        let timeout = deadline.map(|d| d.saturating_duration_since(now));
        if timeout == Some(Duration::ZERO) {
            return Err(Error::Timeout { what, after: limit });
        }
        wait_fd(&self.stream, write, timeout, None).map(|_| ())
    }
}

/// `poll(2)` for readability (and writability when `write`), up to `timeout`; also for
/// `wake`'s readability, returning whether it woke the wait.
fn wait_fd(
    stream: &TcpStream,
    write: bool,
    timeout: Option<Duration>,
    wake: Option<BorrowedFd<'_>>,
) -> Result<bool, Error> {
    let mut flags = PollFlags::IN;
    if write {
        flags |= PollFlags::OUT;
    }
    let fd = stream.as_fd();
    let ts = timeout.map(|t| {
        Timespec::try_from(t).unwrap_or(Timespec {
            tv_sec: i64::MAX / 2,
            tv_nsec: 0,
        })
    });
    let mut fds = [
        PollFd::new(&fd, flags),
        PollFd::new(&fd, PollFlags::empty()),
    ];
    let count = match &wake {
        Some(w) => {
            fds[1] = PollFd::new(w, PollFlags::IN);
            2
        }
        None => 1,
    };
    match poll(&mut fds[..count], ts.as_ref()) {
        Ok(_) => Ok(count == 2 && !fds[1].revents().is_empty()),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(Error::Io(e.into())),
    }
}

/// SendTargets=All on a discovery session to `config.address` (kind is set to Discovery).
pub fn discover(config: &ClientConfig) -> Result<Vec<DiscoveredTarget>, Error> {
    let mut config = config.clone();
    config.session.kind = SessionKind::Discovery;
    let mut conn = Connection::connect(&config)?;
    let targets = conn.send_targets()?;
    let _ = conn.logout();
    Ok(targets)
}

/// A SCSI status other than GOOD, for the blocking helpers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusError {
    pub status: u8,
    pub sense: Option<Sense>,
}

impl StatusError {
    pub fn is_unit_attention(&self) -> bool {
        self.status == status::CHECK_CONDITION
            && self.sense.as_ref().is_some_and(Sense::is_unit_attention)
    }
}

/// Blocking helpers over one session to one LUN, with retries and reconnects.
#[derive(Debug)]
pub struct Client {
    config: ClientConfig,
    conn: Option<Connection>,
    capacity: Option<Capacity>,
    next_tag: u64,
    /// Unit attentions met (and retried past) by the helpers, oldest first.
    unit_attentions: Vec<Sense>,
}

/// The outcome of a blocking helper: GOOD, or the status that ended it.
pub type ScsiOutcome<T> = Result<Result<T, StatusError>, Error>;

impl Client {
    /// Connects and logs in.
    pub fn connect(config: ClientConfig) -> Result<Client, Error> {
        let conn = Connection::connect(&config)?;
        Ok(Client {
            config,
            conn: Some(conn),
            capacity: None,
            next_tag: 1,
            unit_attentions: Vec::new(),
        })
    }

    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The connection, for pipelined use (reconnects first if it was lost).
    pub fn connection(&mut self) -> Result<&mut Connection, Error> {
        if self.conn.as_ref().is_none_or(|c| c.broken().is_some()) {
            self.reconnect()?;
        }
        self.conn.as_mut().ok_or(Error::NotConnected)
    }

    /// Drops the current connection (if any) and logs in again: a new session (TSIH 0) with
    /// the same ISID, which reinstates — replaces — the old one at the target.
    pub fn reconnect(&mut self) -> Result<(), Error> {
        self.conn = None;
        self.conn = Some(Connection::connect(&self.config)?);
        Ok(())
    }

    /// Unit attentions the helpers retried past (with `retry_unit_attention`), oldest first.
    pub fn take_unit_attentions(&mut self) -> Vec<Sense> {
        std::mem::take(&mut self.unit_attentions)
    }

    /// Runs any CDB on the client's LUN. BUSY and TASK SET FULL are retried with bounded
    /// backoff; a lost connection is reconnected and the command resubmitted (so a write may
    /// reach the medium twice — the same data); with `retry_unit_attention`, unit attentions
    /// are recorded and the command retried. Returns the final SCSI result (any status).
    pub fn command(&mut self, cdb: Cdb, transfer: Transfer) -> Result<ScsiResult, Error> {
        let retries = self.config.retries;
        let mut attempt = 0u32;
        let mut backoff = Duration::from_millis(1);
        loop {
            let tag = self.next_tag;
            self.next_tag = self.next_tag.wrapping_add(1);
            let cmd = Command {
                tag,
                lun: self.config.lun,
                cdb,
                transfer: transfer.clone(),
                attr: Default::default(),
            };
            let outcome = self.connection().and_then(|c| c.run(cmd));
            let retry = match &outcome {
                Ok(Completion { result: Ok(r), .. }) => {
                    if r.is_unit_attention() && self.config.retry_unit_attention {
                        self.unit_attentions.extend(r.sense.clone());
                        true
                    } else {
                        matches!(r.status, status::BUSY | status::TASK_SET_FULL)
                    }
                }
                Ok(Completion { result: Err(e), .. }) => e.is_connection_loss(),
                Err(e) => e.is_connection_loss(),
            };
            if !retry || attempt >= retries {
                return match outcome {
                    Ok(Completion { result: Ok(r), .. }) => Ok(r),
                    Ok(Completion { result: Err(e), .. }) => Err(Error::Command(e)),
                    Err(e) => Err(e),
                };
            }
            attempt += 1;
            let lost = match &outcome {
                Ok(Completion { result: Err(e), .. }) => e.is_connection_loss(),
                Err(_) => true,
                _ => false,
            };
            if lost {
                self.conn = None;
                backoff = backoff.max(Duration::from_millis(50));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(if lost { 1000 } else { 100 }));
        }
    }

    fn good(&mut self, cdb: Cdb, transfer: Transfer) -> ScsiOutcome<Vec<u8>> {
        let r = self.command(cdb, transfer)?;
        if r.is_good() {
            Ok(Ok(r.data))
        } else {
            Ok(Err(StatusError {
                status: r.status,
                sense: r.sense,
            }))
        }
    }

    /// READ CAPACITY(16) (cached for `read`/`write`).
    pub fn read_capacity(&mut self) -> ScsiOutcome<Capacity> {
        let data = match self.good(
            scsi::read_capacity16(),
            Transfer::Read {
                len: 32,
                buf: Vec::new(),
            },
        )? {
            Ok(d) => d,
            Err(e) => return Ok(Err(e)),
        };
        let cap = Capacity::parse(&data).ok_or(Error::Protocol(
            crate::error::ProtocolError::Malformed("short READ CAPACITY(16) data"),
        ))?;
        self.capacity = Some(cap);
        Ok(Ok(cap))
    }

    fn block_size(&mut self) -> Result<u32, Error> {
        if let Some(c) = self.capacity {
            return Ok(c.block_size);
        }
        match self.read_capacity()? {
            Ok(c) if c.block_size > 0 => Ok(c.block_size),
            Ok(_) => Err(Error::Protocol(crate::error::ProtocolError::Malformed(
                "block size 0",
            ))),
            Err(e) => Err(Error::Command(CommandError::TargetFailure(e.status))),
        }
    }

    /// READ(16) of `blocks` blocks at `lba`.
    pub fn read(&mut self, lba: u64, blocks: u32) -> ScsiOutcome<Vec<u8>> {
        let bs = self.block_size()?;
        let len = u32::try_from(u64::from(bs) * u64::from(blocks))
            .map_err(|_| Error::InvalidCommand("read longer than 4 GiB"))?;
        self.good(
            scsi::read16(lba, blocks),
            Transfer::Read {
                len,
                buf: Vec::new(),
            },
        )
    }

    /// WRITE(16) of `data` (a whole number of blocks) at `lba`.
    pub fn write(&mut self, lba: u64, data: &[u8]) -> ScsiOutcome<()> {
        let bs = self.block_size()? as usize;
        if !data.len().is_multiple_of(bs) {
            return Err(Error::InvalidCommand(
                "write not a multiple of the block size",
            ));
        }
        let blocks =
            u32::try_from(data.len() / bs).map_err(|_| Error::InvalidCommand("write too long"))?;
        Ok(self
            .good(
                scsi::write16(lba, blocks, false),
                Transfer::Write(data.to_vec()),
            )?
            .map(|_| ()))
    }

    pub fn test_unit_ready(&mut self) -> ScsiOutcome<()> {
        Ok(self
            .good(scsi::test_unit_ready(), Transfer::None)?
            .map(|_| ()))
    }

    pub fn inquiry(&mut self) -> ScsiOutcome<Inquiry> {
        let t = Transfer::Read {
            len: 96,
            buf: Vec::new(),
        };
        Ok(self.good(scsi::inquiry(None, 96), t)?.map(|d| {
            Inquiry::parse(&d).unwrap_or(Inquiry {
                peripheral_type: 0x1f,
                vendor: String::new(),
                product: String::new(),
                revision: String::new(),
            })
        }))
    }

    pub fn report_luns(&mut self) -> ScsiOutcome<Vec<u64>> {
        let t = Transfer::Read {
            len: 4096,
            buf: Vec::new(),
        };
        Ok(self
            .good(scsi::report_luns(4096), t)?
            .map(|d| scsi::parse_report_luns(&d).unwrap_or_default()))
    }

    pub fn synchronize_cache(&mut self) -> ScsiOutcome<()> {
        Ok(self
            .good(scsi::synchronize_cache10(), Transfer::None)?
            .map(|_| ()))
    }

    /// Logs out (best effort) and closes.
    pub fn logout(mut self) -> Result<(), Error> {
        match self.conn.take() {
            Some(c) if c.broken().is_none() => c.logout(),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake;
    use iscsi::pdu::{off, Bhs, Framing, Opcode, BHS_LEN};
    use std::net::TcpListener;

    fn read_pdu(s: &mut TcpStream) -> Option<(Bhs, Vec<u8>)> {
        let mut h = [0u8; BHS_LEN];
        s.read_exact(&mut h).ok()?;
        let bhs = Bhs(h);
        let mut rest = vec![0u8; iscsi::pdu::padded(bhs.data_segment_len())];
        s.read_exact(&mut rest).ok()?;
        rest.truncate(bhs.data_segment_len());
        Some((bhs, rest))
    }

    /// A TCP fake target: logs in without auth, then answers each SCSI command with the
    /// next status of `statuses`, and closes the connection when they run out.
    fn fake_target(statuses: Vec<u8>) -> (u16, std::thread::JoinHandle<usize>) {
        fake_target_slow(statuses, Duration::ZERO)
    }

    /// [`fake_target`] that waits `delay` before each answer.
    fn fake_target_slow(
        statuses: Vec<u8>,
        delay: Duration,
    ) -> (u16, std::thread::JoinHandle<usize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let handle = std::thread::spawn(move || {
            let mut answered = 0;
            let Ok((mut s, _)) = listener.accept() else {
                return answered;
            };
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let (req, _) = read_pdu(&mut s).expect("login 1");
            s.write_all(&fake::login_response(
                &req,
                &[("AuthMethod", "None")],
                true,
                (0, 0),
                0,
            ))
            .unwrap();
            let (req, _) = read_pdu(&mut s).expect("login 2");
            s.write_all(&fake::login_response(&req, &[], true, (0, 0), 1))
                .unwrap();
            for (stat_sn, status) in (2u32..).zip(statuses) {
                let Some((cmd, _)) = read_pdu(&mut s) else {
                    break;
                };
                assert_eq!(cmd.opcode_raw(), Opcode::ScsiCommand as u8);
                std::thread::sleep(delay);
                let cmd_sn = cmd.u32_at(off::CMD_SN);
                let mut r = fake::target_pdu(
                    Opcode::ScsiResponse,
                    cmd.itt(),
                    stat_sn,
                    cmd_sn.wrapping_add(1),
                    cmd_sn.wrapping_add(32),
                );
                r.set_flags(0x80);
                r.set_byte(iscsi::pdu::off::STATUS, status);
                s.write_all(&fake::encode(&r, &[], &Framing::LOGIN))
                    .unwrap();
                answered += 1;
            }
            // Hang up cleanly (FIN, not a reset that could discard our last answers): read
            // what the initiator still sends.
            let _ = s.shutdown(std::net::Shutdown::Write);
            s.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            while read_pdu(&mut s).is_some() {}
            answered
        });
        (port, handle)
    }

    fn client_config(port: u16, retries: u32) -> ClientConfig {
        let mut c = ClientConfig::new(format!("127.0.0.1:{port}"), fake::config());
        c.retries = retries;
        c.timeouts.login = Duration::from_secs(2);
        c
    }

    #[test]
    fn busy_and_task_set_full_are_retried_with_backoff() {
        let (port, target) = fake_target(vec![status::BUSY, status::TASK_SET_FULL, status::GOOD]);
        let mut client = Client::connect(client_config(port, 5)).unwrap();
        assert_eq!(client.test_unit_ready().unwrap(), Ok(()));
        drop(client);
        assert_eq!(target.join().unwrap(), 3);
        // Out of retries: the last status is the answer.
        let (port, target) = fake_target(vec![status::BUSY, status::BUSY]);
        let mut client = Client::connect(client_config(port, 1)).unwrap();
        let err = client.test_unit_ready().unwrap().unwrap_err();
        assert_eq!(err.status, status::BUSY);
        drop(client);
        assert_eq!(target.join().unwrap(), 2);
    }

    #[test]
    fn a_polling_connection_gets_its_answers_and_keeps_its_deadlines() {
        // Each answer comes 1.5 s late; the connection spins up to 5 s for it. A look or a wait
        // that spun past its own end would meet the answer and return it: None says it did not.
        let (port, target) = fake_target_slow(
            vec![status::GOOD, status::BUSY],
            Duration::from_millis(1500),
        );
        let mut config = client_config(port, 0);
        config.busy_poll = Duration::from_secs(5);
        let mut conn = Connection::connect(&config).unwrap();
        for tag in [1, 2] {
            conn.submit(Command::none(tag, 0, crate::scsi::test_unit_ready()))
                .unwrap();
        }
        conn.flush().unwrap();
        // A look that never waits does not spin either.
        assert!(
            conn.try_completion().unwrap().is_none(),
            "try_completion spun"
        );
        // A wait shorter than the spin ends at its deadline, not the spin's.
        assert!(
            conn.wait_completion(Duration::from_millis(20))
                .unwrap()
                .is_none(),
            "the spin outlasted the wait's deadline"
        );
        // Both answers come, in order, to a wait that spins for them.
        let first = conn.next_completion().unwrap();
        let second = conn.next_completion().unwrap();
        assert_eq!(
            [
                (first.tag, first.result.map(|r| r.status)),
                (second.tag, second.result.map(|r| r.status))
            ],
            [(1, Ok(status::GOOD)), (2, Ok(status::BUSY))]
        );
        drop(conn);
        assert_eq!(target.join().unwrap(), 2);
    }

    #[test]
    fn a_closed_connection_fails_pipelined_commands_and_the_next_call_reconnects() {
        // One answer, then the target hangs up with three commands outstanding.
        let (port, target) = fake_target(vec![status::GOOD]);
        let mut conn = Connection::connect(&client_config(port, 0)).unwrap();
        for tag in 0..4 {
            conn.submit(Command::none(tag, 0, crate::scsi::test_unit_ready()))
                .unwrap();
        }
        let mut results = Vec::new();
        while conn.in_flight() > 0 {
            results.push(conn.next_completion().unwrap().result);
        }
        assert_eq!(target.join().unwrap(), 1);
        assert!(results[0].as_ref().is_ok_and(|r| r.is_good()));
        assert_eq!(results.len(), 4);
        assert!(results[1..]
            .iter()
            .all(|r| matches!(r, Err(CommandError::ConnectionLost(_)))));
        assert!(conn.broken().is_some());
        assert!(matches!(
            conn.submit(Command::none(9, 0, crate::scsi::test_unit_ready())),
            Err(Error::NotConnected)
        ));
    }

    #[test]
    fn wait_completion_returns_what_arrives_and_none_when_nothing_is_in_flight() {
        let (port, target) = fake_target(vec![status::GOOD, status::BUSY]);
        let mut conn = Connection::connect(&client_config(port, 0)).unwrap();
        let started = Instant::now();
        assert!(conn
            .wait_completion(Duration::from_secs(5))
            .unwrap()
            .is_none());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "waited with nothing in flight"
        );
        for tag in [7, 8] {
            conn.submit(Command::none(tag, 0, crate::scsi::test_unit_ready()))
                .unwrap();
        }
        conn.flush().unwrap();
        let mut got = Vec::new();
        while let Some(c) = conn.wait_completion(Duration::from_secs(5)).unwrap() {
            got.push((c.tag, c.result.map(|r| r.status)));
        }
        assert_eq!(got, vec![(7, Ok(status::GOOD)), (8, Ok(status::BUSY))]);
        drop(conn);
        assert_eq!(target.join().unwrap(), 2);
    }

    #[test]
    fn a_wake_ends_the_wait_for_a_completion_early_and_the_answer_still_comes() {
        let (port, target) = fake_target_slow(vec![status::GOOD], Duration::from_millis(1500));
        let mut conn = Connection::connect(&client_config(port, 0)).unwrap();
        conn.submit(Command::none(3, 0, crate::scsi::test_unit_ready()))
            .unwrap();
        conn.flush().unwrap();
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        let wake = rustix::event::eventfd(0, flags).unwrap();
        let raiser = wake.try_clone().unwrap();
        let raising = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            rustix::io::write(&raiser, &1u64.to_ne_bytes()).unwrap();
        });
        let started = Instant::now();
        let woken = conn
            .wait_completion_or_wake(Duration::from_secs(10), wake.as_fd())
            .unwrap();
        assert!(woken.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the wake did not end the wait ({:?})",
            started.elapsed()
        );
        assert!(conn.broken().is_none(), "a wake is not a failure");
        raising.join().unwrap();
        rustix::io::read(&wake, &mut [0u8; 8]).unwrap();
        let answer = conn
            .wait_completion_or_wake(Duration::from_secs(10), wake.as_fd())
            .unwrap()
            .expect("the answer comes after the wake");
        assert_eq!(answer.tag, 3);
        drop(conn);
        assert_eq!(target.join().unwrap(), 1);
    }

    #[test]
    fn addresses_resolve() {
        assert_eq!(resolve("127.0.0.1:3261").unwrap()[0].port(), 3261);
        assert_eq!(resolve("127.0.0.1").unwrap()[0].port(), 3260);
        assert_eq!(resolve("[::1]").unwrap()[0].port(), 3260);
        assert_eq!(resolve("::1").unwrap()[0].port(), 3260);
        assert!(resolve("no-such-host.invalid:3260").is_err());
    }
}
