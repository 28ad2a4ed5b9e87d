//! The daemon's listeners by address and kind. The start and every reload go through the one
//! path here: [`Listening::prepare`] binds what the config adds (a failure changes nothing),
//! [`Listening::retire`] stops what it drops and moves what changed group, and
//! [`Listening::start`] hands the new sockets to the acceptor. Sessions that came in through
//! a listener that is gone (or now serves another portal group) ask [`Listening::reaches`]
//! and log out (`dataplane`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::watch;

use crate::admission::Door;
use crate::topology::portals::{reaches, ListenerKind, PortalListener};

/// Pending connections the kernel queues per listener before accept (capped by
/// net.core.somaxconn, 4096 by default since Linux 5.4). std's 128 drops a burst of logins
/// (all of a host's sessions after a path failover) into SYN retries that cost a second each.
const LISTEN_BACKLOG: i32 = 4096;

/// A listener the acceptor serves until `stop` says so (or the daemon shuts down).
pub struct Accepting {
    pub listener: std::net::TcpListener,
    /// Its portal group, read for each connection (a reload may move the listener).
    pub tag: Arc<AtomicU16>,
    pub kind: ListenerKind,
    pub stop: watch::Receiver<bool>,
}

/// How the acceptor takes a new listener (set once its runtime runs).
pub type Spawn = Box<dyn Fn(Accepting) + Send + Sync>;

struct Open {
    /// As configured (the port may be 0).
    addr: SocketAddr,
    /// As bound.
    bound: SocketAddr,
    kind: ListenerKind,
    tag: Arc<AtomicU16>,
    stop: watch::Sender<bool>,
}

/// A listener that could not be had.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({}): {source}", kind.name())]
pub struct ListenError {
    pub addr: SocketAddr,
    pub kind: ListenerKind,
    #[source]
    pub source: std::io::Error,
}

/// What a change of listeners does, bound but not yet visible.
#[derive(Default)]
pub struct Plan {
    bind: Vec<(PortalListener, std::net::TcpListener, SocketAddr)>,
    stop: Vec<(SocketAddr, ListenerKind)>,
    retag: Vec<(SocketAddr, ListenerKind, u16)>,
}

impl Plan {
    /// The addresses bound for `kind`, as the kernel gave them (port 0 resolved).
    pub fn bound(&self, kind: ListenerKind) -> Vec<SocketAddr> {
        self.bind
            .iter()
            .filter(|(l, _, _)| l.kind == kind)
            .map(|(_, _, at)| *at)
            .collect()
    }

    /// One line per change, for the log and `ctl`'s answer.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .bind
            .iter()
            .map(|(l, _, at)| {
                format!(
                    "listening on {at} ({}, portal group {})",
                    l.kind.name(),
                    l.tag
                )
            })
            .collect();
        out.extend(
            self.stop
                .iter()
                .map(|(a, k)| format!("no longer listening on {a} ({})", k.name())),
        );
        out.extend(
            self.retag
                .iter()
                .map(|(a, k, t)| format!("{a} ({}) now serves portal group {t}", k.name())),
        );
        out
    }
}

/// The open listeners, and the acceptor's hand.
#[derive(Default)]
pub struct Listening {
    open: Mutex<Vec<Open>>,
    spawn: OnceLock<Spawn>,
}

impl Listening {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Open>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Binds every listener of `wanted` not open yet, and says which open ones go or move.
    /// A required listener that cannot be bound fails the whole change (the sockets bound
    /// so far close again); an optional one is left out with a warning.
    pub fn prepare(&self, wanted: &[PortalListener]) -> Result<Plan, ListenError> {
        let open = self.lock();
        let mut plan = Plan::default();
        for w in wanted {
            match open.iter().find(|o| o.addr == w.addr && o.kind == w.kind) {
                Some(o) if o.tag.load(Ordering::Relaxed) != w.tag => {
                    plan.retag.push((w.addr, w.kind, w.tag))
                }
                Some(_) => {}
                None => match bind(w.addr) {
                    Ok(socket) => {
                        let at = socket.local_addr().unwrap_or(w.addr);
                        plan.bind.push((*w, socket, at));
                    }
                    Err(source) if w.required => {
                        return Err(ListenError {
                            addr: w.addr,
                            kind: w.kind,
                            source,
                        })
                    }
                    Err(e) => {
                        tracing::warn!(addr = %w.addr, "{} not served on the default port: {e} (set nvme_discovery_listen to choose, or [] for none)", w.kind.name())
                    }
                },
            }
        }
        for o in open.iter() {
            if !wanted.iter().any(|w| w.addr == o.addr && w.kind == o.kind) {
                plan.stop.push((o.addr, o.kind));
            }
        }
        Ok(plan)
    }

    /// Stops the listeners `plan` drops (their ports close) and moves those that changed
    /// portal group; before the topology that says so is published, so that a session that
    /// follows it finds its listener's fate here.
    pub fn retire(&self, plan: &mut Plan) {
        let mut open = self.lock();
        for (addr, kind) in plan.stop.drain(..) {
            if let Some(at) = open.iter().position(|o| o.addr == addr && o.kind == kind) {
                let gone = open.swap_remove(at);
                let _ = gone.stop.send(true);
            }
        }
        for (addr, kind, tag) in plan.retag.drain(..) {
            if let Some(o) = open.iter().find(|o| o.addr == addr && o.kind == kind) {
                o.tag.store(tag, Ordering::Relaxed);
            }
        }
    }

    /// Hands the listeners `plan` bound to the acceptor.
    pub fn start(&self, plan: Plan) {
        let mut open = self.lock();
        for (wanted, listener, bound) in plan.bind {
            let tag = Arc::new(AtomicU16::new(wanted.tag));
            let (stop, stopped) = watch::channel(false);
            open.push(Open {
                addr: wanted.addr,
                bound,
                kind: wanted.kind,
                tag: Arc::clone(&tag),
                stop,
            });
            let accepting = Accepting {
                listener,
                tag,
                kind: wanted.kind,
                stop: stopped,
            };
            match self.spawn.get() {
                Some(spawn) => spawn(accepting),
                // Only before the acceptor runs, which a start does not let happen.
                None => tracing::error!(addr = %bound, "no acceptor to take the listener"),
            }
        }
    }

    /// Sets how the acceptor takes listeners (once, when its runtime runs).
    pub fn set_spawner(&self, spawn: Spawn) {
        let _ = self.spawn.set(spawn);
    }

    /// Whether a connection through `door` that came in at `local` for portal group `tag`
    /// still has its listener: open, at that address, in that group.
    pub fn reaches(&self, door: Door, tag: u16, local: SocketAddr) -> bool {
        let kinds: &[ListenerKind] = match door {
            Door::Iscsi => &[ListenerKind::Iscsi],
            Door::Nvme => &[ListenerKind::Nvme, ListenerKind::NvmeDiscovery],
        };
        self.lock().iter().any(|o| {
            kinds.contains(&o.kind)
                && o.tag.load(Ordering::Relaxed) == tag
                && reaches(o.bound, local)
        })
    }

    /// The open listeners: kind, address as bound, portal group (for `ctl status`).
    pub fn list(&self) -> Vec<(ListenerKind, SocketAddr, u16)> {
        self.lock()
            .iter()
            .map(|o| (o.kind, o.bound, o.tag.load(Ordering::Relaxed)))
            .collect()
    }
}

/// A listening, non-blocking socket at `addr`.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    // Listening again on a listening socket sets its backlog (Linux).
    rustix::net::listen(&listener, LISTEN_BACKLOG)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}
