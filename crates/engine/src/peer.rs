//! I/O shipping between RBD gateways: a gateway that does not own an image runs the commands
//! that need its medium on the owner, through an iSCSI session of its own to the owner's portal
//! (active/non-optimized paths, as dual-controller arrays ship I/O over their interconnect).
//! Only the owner ever writes the image, so the fence of a takeover still covers every write.
//!
//! The peer session logs in with the initiator name [`PEER_PREFIX`] + the LU's NAA and CHAP
//! with a secret kept in the image's metadata: only a client of the cluster (who could write
//! the image anyway) can ship. The owner admits that name only into a group of its own that
//! maps the device at LUN 0 (`topology.rs`). Each nexus of the shipping gateway has a peer
//! session of its own, whose InitiatorAlias names that nexus ([`peer_alias`]); the owner runs
//! its commands as that initiator port through the shipping gateway's port
//! (`scsi::TargetPort::shipped`), so reservations, registrations and unit attentions are
//! those of the initiator's own I_T nexus.

use std::collections::HashMap;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use initiator::driver::Connection;
use initiator::scsi::Cdb;
use initiator::session::{Command, Completion, Residual, ScsiResult, Tmf, Transfer};
use initiator::{Auth, ChapConfig, ClientConfig, SessionConfig, SessionKind};

/// The image metadata key holding the peer sessions' CHAP secret.
pub const SECRET_KEY: &str = "ferrosan.gateway_peer_secret";

/// A shipped command not answered within this fails (NOT READY, transition: the initiator
/// retries), and the peer session is dropped.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Initiator names of peer sessions: this, then the LU's NAA in hex.
pub const PEER_PREFIX: &str = "iqn.2026-11.org.ferrosan:gateway-peer.";

/// How a peer session's InitiatorAlias names the nexus it ships for.
const ALIAS_PREFIX: &str = "ferrosan-peer-of ";

/// The InitiatorAlias of `nexus`'s peer session: its initiator port and this gateway's
/// relative target port.
pub fn peer_alias(nexus: &scsi::Nexus) -> String {
    format!(
        "{ALIAS_PREFIX}{} {}",
        nexus.target_port.relative_id, nexus.initiator_port
    )
}

/// The initiator port and relative target port a peer session's alias names.
pub fn parse_peer_alias(alias: &str) -> Option<(String, u16)> {
    let rest = alias.strip_prefix(ALIAS_PREFIX)?;
    let (port, initiator) = rest.split_once(' ')?;
    let port = port.parse().ok().filter(|&p| p != 0)?;
    (!initiator.is_empty() && initiator.len() <= 255 && !initiator.contains(char::is_whitespace))
        .then(|| (initiator.to_string(), port))
}

/// The peer sessions' initiator name for an LU with this identity.
pub fn peer_name(identity: &scsi::LuIdentity) -> String {
    let naa: String = identity
        .naa
        .iter()
        .take(identity.naa_len)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{PEER_PREFIX}{naa}")
}

/// Whether `initiator` (a login's initiator name) is a gateway's peer session.
pub fn is_peer_name(initiator: &str) -> bool {
    initiator.starts_with(PEER_PREFIX)
}

/// The image's peer secret: read, or made and stored by the first gateway to need it (a
/// compare-and-set, so two gateways starting together agree on one).
pub fn secret(image: &rbd::Image) -> Result<String, rbd::Error> {
    for _ in 0..4 {
        if let Some(secret) = image.metadata(SECRET_KEY)?.filter(|s| s.len() >= 32) {
            return Ok(secret);
        }
        let mut bytes = [0u8; 16];
        initiator::driver::random_bytes(&mut bytes);
        let made: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        if image.compare_and_set_metadata(SECRET_KEY, "", &made)? {
            return Ok(made);
        }
    }
    image
        .metadata(SECRET_KEY)?
        .ok_or_else(|| rbd::Error::Invalid("the gateway peer secret keeps changing".into()))
}

/// How this gateway reaches an image's owner: fixed while the device is open.
pub struct PeerRoute {
    /// The peer sessions' initiator name ([`peer_name`]).
    pub name: String,
    /// A target that maps the device on every gateway (the first in the config).
    pub target: String,
    pub secret: String,
    /// Each gateway's portal addresses, by its index in the ownership's gateway list.
    pub portals: Vec<Vec<String>>,
}

/// Peer sessions beyond this many (per image) are not opened: the command gets NOT READY,
/// transition (retry), as when the owner cannot be reached.
const SESSIONS_MAX: usize = 256;

/// A shipped command's outcome as the peer session delivers it.
type Outcome = Result<ScsiResult, String>;

/// Tags of shipped commands start here (the driver's own exchanges use small ones and
/// `u64::MAX - 1`).
const TAG_BASE: u64 = 1 << 48;

/// One peer session and the commands of the threads shipping through it, pipelined: whichever
/// shipping thread holds the connection sends every queued command and reaps completions for
/// all of them, so several commands of one nexus are in flight at the owner at once.
struct PeerSession {
    /// Its InitiatorAlias ([`peer_alias`]).
    alias: String,
    /// None until logged in (at the first command), and again after it broke.
    connection: Mutex<Option<Connection>>,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    /// Not sent yet.
    queued: Vec<(Command, Sender<Outcome>)>,
    /// Sent, by tag.
    waiting: HashMap<u64, Sender<Outcome>>,
    next_tag: u64,
}

impl PeerSession {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every command queued or in flight fails with `why` (the connection is gone).
    fn fail_all(&self, why: &str) {
        let mut pending = self.pending();
        for (_, tx) in pending.queued.drain(..) {
            let _ = tx.send(Err(why.to_string()));
        }
        for (_, tx) in pending.waiting.drain() {
            let _ = tx.send(Err(why.to_string()));
        }
    }
}

/// The peer sessions to the current owner: one per nexus of this gateway that ships, so the
/// owner sees one nexus per initiator nexus (its unit attentions, copy results and task
/// management then work per nexus as they would directly).
pub struct PeerLink {
    route: PeerRoute,
    device: String,
    sessions: Mutex<Sessions>,
}

#[derive(Default)]
struct Sessions {
    /// The owner every session below is logged in to.
    owner: Option<usize>,
    by_nexus: HashMap<u64, Arc<PeerSession>>,
}

impl PeerLink {
    pub fn new(route: PeerRoute, device: &str) -> PeerLink {
        PeerLink {
            route,
            device: device.to_string(),
            sessions: Mutex::new(Sessions::default()),
        }
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The owner moved (or this gateway took it, None): every session to the old one goes.
    pub fn follow(&self, owner: Option<usize>) {
        let mut sessions = self.sessions();
        if sessions.owner != owner {
            sessions.by_nexus.clear();
            sessions.owner = owner;
        }
    }

    /// The nexus is gone here: its peer session goes too.
    pub fn nexus_lost(&self, nexus: u64) {
        self.sessions().by_nexus.remove(&nexus);
    }

    /// `nexus`'s session to `owner` (made, not yet logged in, at its first use); None beyond
    /// [`SESSIONS_MAX`].
    fn session(&self, nexus: &scsi::Nexus, owner: usize) -> Option<Arc<PeerSession>> {
        let mut sessions = self.sessions();
        if sessions.owner != Some(owner) {
            sessions.by_nexus.clear();
            sessions.owner = Some(owner);
        }
        let full = sessions.by_nexus.len() >= SESSIONS_MAX;
        match sessions.by_nexus.get(&nexus.id) {
            Some(session) => Some(Arc::clone(session)),
            None if full => {
                tracing::warn!(device = %self.device, "{SESSIONS_MAX} peer sessions open already: not shipping");
                None
            }
            None => {
                let session = Arc::new(PeerSession {
                    alias: peer_alias(nexus),
                    connection: Mutex::new(None),
                    pending: Mutex::new(Pending::default()),
                });
                sessions.by_nexus.insert(nexus.id, Arc::clone(&session));
                Some(session)
            }
        }
    }

    /// Logs in to `owner`'s first portal that answers, and takes the new nexus's unit
    /// attentions (its POWER ON): they are the peer session's, not the LU's.
    fn connect(&self, owner: usize, alias: &str) -> Result<Connection, String> {
        let portals = self
            .route
            .portals
            .get(owner)
            .filter(|p| !p.is_empty())
            .ok_or("the owner has no portal address to ship to")?;
        let mut last = String::new();
        for address in portals {
            let mut session = SessionConfig::new(
                self.route.name.clone(),
                SessionKind::Normal {
                    target_name: self.route.target.clone(),
                },
            );
            session.auth = Auth::Chap(ChapConfig::new(
                self.route.name.clone(),
                self.route.secret.as_bytes().to_vec(),
            ));
            session.initiator_alias = Some(alias.to_string());
            session.command_timeout = COMMAND_TIMEOUT;
            let mut config = ClientConfig::new(address.clone(), session);
            config.timeouts.connect = Duration::from_secs(2);
            config.timeouts.login = Duration::from_secs(5);
            match Connection::connect(&config) {
                Ok(mut connection) => {
                    take_unit_attentions(&mut connection);
                    tracing::debug!(device = %self.device, "peer session to the owner at {address}");
                    return Ok(connection);
                }
                Err(e) => last = format!("{address}: {e}"),
            }
        }
        Err(last)
    }

    /// `held`'s connection, logged in again if it broke (everything it carried fails) or was
    /// never made. Err: the owner cannot be reached (everything queued fails too).
    fn connected<'a>(
        &self,
        session: &PeerSession,
        held: &'a mut Option<Connection>,
        owner: usize,
    ) -> Result<&'a mut Connection, String> {
        if held.as_ref().is_some_and(|c| c.broken().is_some()) {
            *held = None;
            session.fail_all("the peer session broke");
        }
        if held.is_none() {
            match self.connect(owner, &session.alias) {
                Ok(connection) => *held = Some(connection),
                Err(e) => {
                    session.fail_all(&e);
                    return Err(e);
                }
            }
        }
        held.as_mut().ok_or_else(|| "no peer session".to_string())
    }

    /// While holding `session`'s connection: logs in if needed, sends every queued command
    /// and delivers the completions that arrive within a millisecond. A broken connection
    /// fails everything it carried and is dropped (the next command logs in again).
    fn lead(&self, session: &PeerSession, held: &mut Option<Connection>, owner: usize) {
        let connection = match self.connected(session, held, owner) {
            Ok(connection) => connection,
            Err(e) => {
                tracing::warn!(device = %self.device, "cannot reach the owner: {e}");
                return;
            }
        };
        let queued = std::mem::take(&mut session.pending().queued);
        for (command, tx) in queued {
            let tag = command.tag;
            match connection.submit(command) {
                Ok(_) => {
                    session.pending().waiting.insert(tag, tx);
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                }
            }
        }
        let reaped = connection.flush().and_then(|()| {
            let mut next = connection.wait_completion(Duration::from_millis(1))?;
            while let Some(completion) = next {
                let tx = session.pending().waiting.remove(&completion.tag);
                if let Some(tx) = tx {
                    let _ = tx.send(completion.result.map_err(|e| e.to_string()));
                }
                next = connection.try_completion()?;
            }
            Ok(())
        });
        if let Err(e) = reaped {
            tracing::warn!(device = %self.device, "the peer session to the owner failed: {e}");
            *held = None;
            session.fail_all(&e.to_string());
        }
    }

    /// Runs `cmd` of `nexus` on `owner` and returns its completion as the owner gave it
    /// (status, sense, residual), Data-In appended to `data_in`. A session that cannot be had
    /// or breaks answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION (retry).
    pub fn ship(
        &self,
        nexus: &scsi::Nexus,
        owner: usize,
        cmd: &scsi::Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> scsi::Completion {
        let transition = scsi::Completion::check_condition(scsi::Sense::not_ready_transition());
        let Some(cdb) = Cdb::new(cmd.cdb) else {
            return scsi::Completion::check_condition(scsi::Sense::invalid_opcode());
        };
        let (transfer, expected) = if !cmd.data_out.is_empty() {
            (
                Transfer::Write(cmd.data_out.to_vec()),
                u32::try_from(cmd.data_out.len()).unwrap_or(u32::MAX),
            )
        } else if cmd.data_in_limit > 0 {
            (
                Transfer::Read {
                    len: cmd.data_in_limit,
                    buf: Vec::new(),
                },
                cmd.data_in_limit,
            )
        } else {
            (Transfer::None, 0)
        };
        let Some(session) = self.session(nexus, owner) else {
            return transition;
        };
        let (tx, rx) = mpsc::channel();
        {
            let mut pending = session.pending();
            let tag = TAG_BASE + pending.next_tag;
            pending.next_tag = pending.next_tag.wrapping_add(1);
            pending.queued.push((
                Command {
                    tag,
                    lun: 0,
                    cdb,
                    transfer,
                    attr: Default::default(),
                },
                tx,
            ));
        }
        // Lead while nobody else does; otherwise wait for the leader to deliver. Bounded: the
        // session times a command out (COMMAND_TIMEOUT) and a broken one fails them all.
        let outcome = loop {
            match rx.try_recv() {
                Ok(outcome) => break outcome,
                Err(mpsc::TryRecvError::Disconnected) => break Err("the peer session went".into()),
                Err(mpsc::TryRecvError::Empty) => {}
            }
            match session.connection.try_lock() {
                Ok(mut held) => self.lead(&session, &mut held, owner),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    self.lead(&session, &mut p.into_inner(), owner)
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    match rx.recv_timeout(Duration::from_millis(2)) {
                        Ok(outcome) => break outcome,
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            break Err("the peer session went".into())
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                    }
                }
            }
        };
        let result = match outcome {
            Ok(result) => result,
            Err(e) => {
                tracing::warn!(device = %self.device, "shipping to the owner failed: {e}");
                return transition;
            }
        };
        if cmd.data_out.is_empty() && cmd.data_in_limit > 0 {
            let n = result.data.len().min(cmd.data_in_limit as usize);
            data_in.extend_from_slice(&result.data[..n]);
        }
        let transfer_len = match result.residual {
            Residual::None => expected,
            Residual::Under(n) => expected.saturating_sub(n),
            Residual::Over(n) => expected.saturating_add(n),
        };
        let status = match result.status {
            0x00 => scsi::Status::Good,
            0x02 => scsi::Status::CheckCondition,
            0x04 => scsi::Status::ConditionMet,
            0x08 => scsi::Status::Busy,
            0x18 => scsi::Status::ReservationConflict,
            0x28 => scsi::Status::TaskSetFull,
            0x40 => scsi::Status::TaskAborted,
            other => {
                tracing::warn!(device = %self.device, "the owner answered status {other:#04x}");
                return transition;
            }
        };
        let sense = result
            .sense
            .as_ref()
            .and_then(|s| scsi::Sense::decode(&s.raw));
        if status == scsi::Status::CheckCondition && sense.is_none() {
            return transition;
        }
        scsi::Completion {
            status,
            sense,
            transfer_len,
        }
    }

    /// LOGICAL UNIT RESET at `owner` through `nexus`'s peer session; the unit attention it
    /// leaves the peer nexus itself is taken (this gateway raises its own). True when the
    /// owner answered *function complete*.
    pub fn reset(&self, nexus: &scsi::Nexus, owner: usize) -> bool {
        let Some(session) = self.session(nexus, owner) else {
            return false;
        };
        let mut held = session.connection.lock().unwrap_or_else(|p| p.into_inner());
        let connection = match self.connected(&session, &mut held, owner) {
            Ok(connection) => connection,
            Err(e) => {
                tracing::warn!(device = %self.device, "cannot pass a LUN reset to the owner: {e}");
                return false;
            }
        };
        match connection.task_management(Tmf::LunReset { lun: 0 }) {
            Ok(0) => {
                take_unit_attentions(connection);
                true
            }
            Ok(response) => {
                tracing::warn!(device = %self.device, "the owner answered a LUN reset with {response}");
                false
            }
            Err(e) => {
                tracing::warn!(device = %self.device, "passing a LUN reset to the owner failed: {e}");
                *held = None;
                session.fail_all(&e.to_string());
                false
            }
        }
    }

    /// Makes the owner take up the reservations as stored (a PERSISTENT RESERVE IN, which reads
    /// them first, through `nexus`'s peer session): after a PERSISTENT RESERVE OUT here, before
    /// it is answered.
    pub fn refresh_reservations(&self, nexus: &scsi::Nexus, owner: usize) {
        let read_keys = scsi::Command {
            cdb: &[0x5E, 0x00, 0, 0, 0, 0, 0, 0, 8, 0],
            data_out: &[],
            data_in_limit: 8,
        };
        let done = self.ship(nexus, owner, &read_keys, &mut Vec::new());
        if done.status != scsi::Status::Good {
            tracing::warn!(device = %self.device, "the owner did not re-read the reservations: {:?}", done.sense);
        }
    }
}

/// Takes a new (or just reset) peer nexus's unit attentions: TEST UNIT READY until none (its
/// other commands' completions stay queued for their reaper).
fn take_unit_attentions(connection: &mut Connection) {
    for tag in 0..8u64 {
        match connection.run(Command::none(tag + 1, 0, tur())) {
            Ok(Completion { result: Ok(r), .. }) if r.is_unit_attention() => continue,
            _ => break,
        }
    }
}

fn tur() -> Cdb {
    initiator::scsi::test_unit_ready()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_alias_names_the_nexus_and_nothing_else_parses() {
        let nexus = scsi::Nexus {
            id: 4,
            initiator_port: "iqn.1994-05.com.redhat:host,i,0x023d00000001".into(),
            target_port: std::sync::Arc::new(scsi::TargetPort::alone(
                7,
                "iqn.2026-11.org.ferrosan:x,t,0x0007".into(),
                "iqn.2026-11.org.ferrosan:x".into(),
            )),
        };
        let alias = peer_alias(&nexus);
        assert_eq!(
            parse_peer_alias(&alias),
            Some(("iqn.1994-05.com.redhat:host,i,0x023d00000001".into(), 7))
        );
        for bad in [
            "",
            "host1",
            "ferrosan-peer-of ",
            "ferrosan-peer-of 7",
            "ferrosan-peer-of 0 iqn.x,i,0x01",
            "ferrosan-peer-of 70000 iqn.x,i,0x01",
            "ferrosan-peer-of x iqn.x,i,0x01",
            "ferrosan-peer-of 7 iqn.x,i,0x01 extra",
            "ferrosan-peer-of 7 ",
        ] {
            assert_eq!(parse_peer_alias(bad), None, "{bad:?}");
        }
        let long = format!("ferrosan-peer-of 7 {}", "a".repeat(300));
        assert_eq!(parse_peer_alias(&long), None);
    }
}
