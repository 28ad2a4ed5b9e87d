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

use std::sync::Mutex;
use std::time::Duration;

use initiator::driver::Client;
use initiator::scsi::Cdb;
use initiator::session::{Residual, Transfer};
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

/// The peer session to the current owner (one; commands shipped through it run one at a
/// time — see docs/RBD.md, *Limits*).
pub struct PeerLink {
    route: PeerRoute,
    device: String,
    /// The owner's index and the session to it.
    session: Mutex<Option<(usize, Client)>>,
}

impl PeerLink {
    pub fn new(route: PeerRoute, device: &str) -> PeerLink {
        PeerLink {
            route,
            device: device.to_string(),
            session: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(usize, Client)>> {
        self.session.lock().unwrap_or_else(|p| p.into_inner())
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
                    for _ in 0..8 {
                        match client.command(tur(), Transfer::None) {
                            Ok(r) if r.is_unit_attention() => continue,
                            _ => break,
                        }
                    }
                    tracing::info!(device = %self.device, "peer session to the owner at {address}");
                    return Ok(client);
                }
                Err(e) => last = format!("{address}: {e}"),
            }
        }
        Err(last)
    }

    /// Keeps the session pointed at `owner` (None: this gateway owns the image or nobody
    /// does: no session). The follow loop calls it so the session exists before the first
    /// shipped command, and the owner's unit attentions (a reset there) reach it.
    pub fn follow(&self, owner: Option<usize>) {
        let mut session = self.lock();
        match (owner, session.as_ref()) {
            (None, Some(_)) => *session = None,
            (Some(o), Some((at, _))) if *at != o => *session = None,
            _ => {}
        }
        if let (Some(owner), None) = (owner, session.as_ref()) {
            match self.connect(owner) {
                Ok(client) => *session = Some((owner, client)),
                Err(e) => {
                    tracing::debug!(device = %self.device, "no peer session to the owner yet: {e}")
                }
            }
        }
    }

    /// Runs `cmd` on `owner` and returns its completion as the owner gave it (status, sense,
    /// residual), Data-In appended to `data_in`. A session that cannot be had or breaks
    /// answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION (retry).
    pub fn ship(
        &self,
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
        let mut session = self.lock();
        if session.as_ref().is_some_and(|(at, _)| *at != owner) {
            *session = None;
        }
        if session.is_none() {
            match self.connect(owner) {
                Ok(client) => *session = Some((owner, client)),
                Err(e) => {
                    tracing::warn!(device = %self.device, "cannot ship to the owner: {e}");
                    return transition;
                }
            }
        }
        let Some((_, client)) = session.as_mut() else {
            return transition;
        };
        let result = match client.command(cdb, transfer) {
            Ok(result) => result,
            Err(e) => {
                tracing::warn!(device = %self.device, "shipping to the owner failed: {e}");
                *session = None;
                return transition;
            }
        };
        drop(session);
        let read = matches!(cmd.data_out, []) && cmd.data_in_limit > 0;
        if read {
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

    /// LOGICAL UNIT RESET at `owner` through the peer session; the unit attention it raises
    /// for the peer nexus itself is taken (this gateway raises its own). True when the owner
    /// answered *function complete*.
    pub fn reset(&self, owner: usize) -> bool {
        let mut session = self.lock();
        if session.as_ref().is_some_and(|(at, _)| *at != owner) {
            *session = None;
        }
        if session.is_none() {
            match self.connect(owner) {
                Ok(client) => *session = Some((owner, client)),
                Err(e) => {
                    tracing::warn!(device = %self.device, "cannot pass a LUN reset to the owner: {e}");
                    return false;
                }
            }
        }
        let Some((_, client)) = session.as_mut() else {
            return false;
        };
        let lun = client.config().lun;
        let done = client
            .connection()
            .and_then(|c| c.task_management(initiator::session::Tmf::LunReset { lun }));
        match done {
            Ok(0) => {
                for _ in 0..8 {
                    match client.command(tur(), Transfer::None) {
                        Ok(r) if r.is_unit_attention() => continue,
                        _ => break,
                    }
                }
                true
            }
            Ok(response) => {
                tracing::warn!(device = %self.device, "the owner answered a LUN reset with {response}");
                false
            }
            Err(e) => {
                tracing::warn!(device = %self.device, "passing a LUN reset to the owner failed: {e}");
                *session = None;
                false
            }
        }
    }
}

fn tur() -> Cdb {
    initiator::scsi::test_unit_ready()
}
