//! I/O shipping between RBD gateways: a gateway that does not own an image runs the commands
//! that need its medium on the owner, through an iSCSI session of its own to the owner's portal
//! (active/non-optimized paths, as dual-controller arrays ship I/O over their interconnect).
//! Only the owner ever writes the image, so the fence of a takeover still covers every write.
//!
//! The peer session logs in with the initiator name `scsi::GATEWAY_PEER_PREFIX` + the LU's NAA
//! and CHAP with a secret kept in the image's metadata: only a client of the cluster (who could
//! write the image anyway) can ship. The owner admits that name only into a group of its own
//! that maps the device at LUN 0 (`topology.rs`), and does not check reservations again for
//! it: the gateway that shipped the command checked them for the initiator that sent it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use initiator::driver::Client;
use initiator::scsi::Cdb;
use initiator::session::{Residual, Tmf, Transfer};
use initiator::{Auth, ChapConfig, ClientConfig, SessionConfig, SessionKind};

/// The image metadata key holding the peer sessions' CHAP secret.
pub const SECRET_KEY: &str = "ferrosan.gateway_peer_secret";

/// A shipped command not answered within this fails (NOT READY, transition: the initiator
/// retries), and the peer session is dropped.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The peer sessions' initiator name for an LU with this identity.
pub fn peer_name(identity: &scsi::LuIdentity) -> String {
    let naa: String = identity
        .naa
        .iter()
        .take(identity.naa_len)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{}{naa}", scsi::GATEWAY_PEER_PREFIX)
}

/// Whether `initiator_port` (an I_T nexus's initiator port name) is a gateway's peer session.
pub fn is_peer_port(initiator_port: &str) -> bool {
    initiator_port.starts_with(scsi::GATEWAY_PEER_PREFIX)
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

/// One peer session, or none yet (opened at its first command).
type Slot = Arc<Mutex<Option<Client>>>;

/// The peer sessions to the current owner: one per nexus of this gateway that ships, so the
/// owner sees one nexus per initiator nexus (its unit attentions, copy results and task
/// management then work per nexus as they would directly). A session runs one command at a
/// time (see docs/RBD.md, *Limits*).
pub struct PeerLink {
    route: PeerRoute,
    device: String,
    sessions: Mutex<Sessions>,
}

#[derive(Default)]
struct Sessions {
    /// The owner every session below is logged in to.
    owner: Option<usize>,
    by_nexus: HashMap<u64, Slot>,
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

    /// Runs `f` on `nexus`'s session to `owner`, logging in first if it has none. Err: no
    /// session could be had (logged).
    fn with_session<T>(
        &self,
        nexus: u64,
        owner: usize,
        f: impl FnOnce(&mut Client) -> T,
    ) -> Result<T, ()> {
        let slot = {
            let mut sessions = self.sessions();
            if sessions.owner != Some(owner) {
                sessions.by_nexus.clear();
                sessions.owner = Some(owner);
            }
            let full = sessions.by_nexus.len() >= SESSIONS_MAX;
            match sessions.by_nexus.get(&nexus) {
                Some(slot) => Arc::clone(slot),
                None if full => {
                    tracing::warn!(device = %self.device, "{SESSIONS_MAX} peer sessions open already: not shipping");
                    return Err(());
                }
                None => Arc::clone(sessions.by_nexus.entry(nexus).or_default()),
            }
        };
        let mut session = slot.lock().unwrap_or_else(|p| p.into_inner());
        if session.is_none() {
            match self.connect(owner) {
                Ok(client) => *session = Some(client),
                Err(e) => {
                    tracing::warn!(device = %self.device, "cannot reach the owner: {e}");
                    return Err(());
                }
            }
        }
        match session.as_mut() {
            Some(client) => Ok(f(client)),
            None => Err(()),
        }
    }

    /// Drops `nexus`'s session (it broke): the next command logs in again.
    fn drop_session(&self, nexus: u64) {
        self.sessions().by_nexus.remove(&nexus);
    }

    /// Logs in to `owner`'s first portal that answers, and takes the new nexus's unit
    /// attentions (its POWER ON): they are the peer session's, not the LU's.
    fn connect(&self, owner: usize) -> Result<Client, String> {
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
            session.command_timeout = COMMAND_TIMEOUT;
            let mut config = ClientConfig::new(address.clone(), session);
            config.timeouts.connect = Duration::from_secs(2);
            config.timeouts.login = Duration::from_secs(5);
            // Nothing is resent on its own: a command that met a lost connection fails, and
            // the initiator that sent it decides.
            config.retries = 0;
            config.retry_unit_attention = false;
            match Client::connect(config) {
                Ok(mut client) => {
                    take_unit_attentions(&mut client);
                    tracing::debug!(device = %self.device, "peer session to the owner at {address}");
                    return Ok(client);
                }
                Err(e) => last = format!("{address}: {e}"),
            }
        }
        Err(last)
    }

    /// Runs `cmd` of `nexus` on `owner` and returns its completion as the owner gave it
    /// (status, sense, residual), Data-In appended to `data_in`. A session that cannot be had
    /// or breaks answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION (retry).
    pub fn ship(
        &self,
        nexus: u64,
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
        let result = match self.with_session(nexus, owner, |c| c.command(cdb, transfer)) {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => {
                tracing::warn!(device = %self.device, "shipping to the owner failed: {e}");
                self.drop_session(nexus);
                return transition;
            }
            Err(()) => return transition,
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
    pub fn reset(&self, nexus: u64, owner: usize) -> bool {
        let done = self.with_session(nexus, owner, |client| {
            let lun = client.config().lun;
            let answer = client
                .connection()
                .and_then(|c| c.task_management(Tmf::LunReset { lun }));
            if matches!(answer, Ok(0)) {
                take_unit_attentions(client);
            }
            answer
        });
        match done {
            Ok(Ok(0)) => true,
            Ok(Ok(response)) => {
                tracing::warn!(device = %self.device, "the owner answered a LUN reset with {response}");
                false
            }
            Ok(Err(e)) => {
                tracing::warn!(device = %self.device, "passing a LUN reset to the owner failed: {e}");
                self.drop_session(nexus);
                false
            }
            Err(()) => false,
        }
    }

    /// Makes the owner take up the reservations as stored (a PERSISTENT RESERVE IN, which reads
    /// them first, through `nexus`'s peer session): after a PERSISTENT RESERVE OUT here, before
    /// it is answered.
    pub fn refresh_reservations(&self, nexus: u64, owner: usize) {
        let Some(read_keys) = Cdb::new(&[0x5E, 0x00, 0, 0, 0, 0, 0, 0, 8, 0]) else {
            return;
        };
        let read = Transfer::Read {
            len: 8,
            buf: Vec::new(),
        };
        match self.with_session(nexus, owner, |c| c.command(read_keys, read)) {
            Ok(Ok(r)) if r.is_good() => {}
            Ok(Ok(r)) => {
                tracing::warn!(device = %self.device, "the owner did not re-read the reservations (status {:#04x})", r.status)
            }
            Ok(Err(e)) => {
                tracing::warn!(device = %self.device, "the owner did not re-read the reservations: {e}");
                self.drop_session(nexus);
            }
            Err(()) => {}
        }
    }
}

/// Takes a new (or just reset) peer nexus's unit attentions: TEST UNIT READY until none.
fn take_unit_attentions(client: &mut Client) {
    for _ in 0..8 {
        match client.command(tur(), Transfer::None) {
            Ok(r) if r.is_unit_attention() => continue,
            _ => break,
        }
    }
}

fn tur() -> Cdb {
    initiator::scsi::test_unit_ready()
}
