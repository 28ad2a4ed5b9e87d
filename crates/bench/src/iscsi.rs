//! iSCSI LUNs through the project's own initiator: one session per job, its queue depth kept
//! full with READ(16)/WRITE(16).

use crate::runner::{Done, Engine, Op, Target, TargetInfo};
use initiator::driver::{Client, Connection};
use initiator::url::{redact, IscsiUrl};
use initiator::{scsi, ClientConfig, Command};

/// Retries of one I/O answered BUSY, TASK SET FULL or with a unit attention before it counts
/// as failed (a target that keeps answering so is not being measured).
const RETRIES_MAX: u8 = 16;

pub struct IscsiTarget {
    info: TargetInfo,
    config: ClientConfig,
}

impl IscsiTarget {
    /// Logs in once to learn the LUN's size and block size (and that it is reachable).
    /// `chap_secret`: the CHAP secret of a URL that names a user without a password;
    /// `busy_poll`: how long each job spins on its socket for an answer before it sleeps.
    pub fn open(
        url: &str,
        initiator_name: &str,
        chap_secret: Option<&initiator::Secret>,
        busy_poll: std::time::Duration,
    ) -> Result<IscsiTarget, String> {
        let name = redact(url);
        let mut parsed = IscsiUrl::parse(url).map_err(|e| format!("{name}: {e}"))?;
        if let Some(user) = &parsed.user_without_secret {
            let secret = chap_secret.ok_or_else(|| {
                format!("{name}: CHAP user {user} without a secret: give --chap-secret-file FILE or FERROSAN_CHAP_SECRET, or run on a terminal to be asked")
            })?;
            parsed = parsed.with_secret(secret.expose());
        }
        let mut config = parsed.client_config(initiator_name);
        // A LUN reporting a unit attention at login (power on, a resize) is normal.
        config.retry_unit_attention = true;
        let mut client = Client::connect(config.clone()).map_err(|e| format!("{name}: {e}"))?;
        let capacity = client
            .read_capacity()
            .map_err(|e| format!("{name}: {e}"))?
            .map_err(|e| format!("{name}: READ CAPACITY: {e:?}"))?;
        let _ = client.logout();
        if capacity.block_size == 0 || capacity.bytes() == 0 {
            return Err(format!("{name}: the LUN reports no capacity"));
        }
        config.busy_poll = busy_poll;
        Ok(IscsiTarget {
            info: TargetInfo {
                name,
                kind: "iscsi".into(),
                capacity_bytes: capacity.bytes(),
                block_size: capacity.block_size,
                notes: crate::busy_poll_note(busy_poll).into_iter().collect(),
                node: parsed.target.clone(),
                metrics: None,
            },
            config,
        })
    }
}

impl Target for IscsiTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn open(&self, queue_depth: usize, max_len: u32) -> Result<Box<dyn Engine>, String> {
        let mut config = self.config.clone();
        // Each job is its own session (the seeds' "numjobs"): a fresh ISID, not a reinstatement.
        config.session.isid = initiator::driver::random_isid();
        let conn = Connection::connect(&config).map_err(|e| format!("{}: {e}", self.info.name))?;
        let mut pattern = vec![0u8; max_len as usize];
        initiator::driver::random_bytes(&mut pattern);
        Ok(Box::new(IscsiEngine {
            conn,
            lun: config.lun,
            block_size: u64::from(self.info.block_size),
            pattern: pattern.into(),
            buffers: vec![Vec::new(); queue_depth],
            pending: vec![None; queue_depth],
        }))
    }
}

#[derive(Clone, Copy)]
struct Pending {
    op: Op,
    offset: u64,
    len: u32,
    retries: u8,
}

struct IscsiEngine {
    conn: Connection,
    lun: u64,
    block_size: u64,
    /// What writes send (random, as for NVMe/TCP): shared by every write and sent from where
    /// it lies, never copied per write.
    pattern: std::sync::Arc<[u8]>,
    /// A buffer per tag: its last read's landing place (given back by the completion).
    buffers: Vec<Vec<u8>>,
    pending: Vec<Option<Pending>>,
}

impl IscsiEngine {
    fn send(&mut self, tag: usize, p: Pending) -> Result<(), String> {
        let slot = self
            .buffers
            .get_mut(tag)
            .ok_or_else(|| format!("tag {tag} out of range"))?;
        let lba = p.offset / self.block_size;
        let blocks = u32::try_from(u64::from(p.len) / self.block_size)
            .map_err(|_| "I/O too long".to_string())?;
        let command = match p.op {
            Op::Read => Command::read(tag as u64, self.lun, scsi::read16(lba, blocks), p.len)
                .with_buffer(std::mem::take(slot)),
            Op::Write => {
                let len = p.len as usize;
                if len > self.pattern.len() {
                    return Err(format!("a write of {len} bytes is longer than the pattern"));
                }
                let cdb = scsi::write16(lba, blocks, false);
                Command::write_shared(tag as u64, self.lun, cdb, self.pattern.clone(), len)
            }
        };
        if let Some(slot) = self.pending.get_mut(tag) {
            *slot = Some(p);
        }
        self.conn
            .submit(command)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl Engine for IscsiEngine {
    fn submit(&mut self, tag: usize, op: Op, offset: u64, len: u32) -> Result<(), String> {
        self.send(
            tag,
            Pending {
                op,
                offset,
                len,
                retries: 0,
            },
        )
    }

    fn complete(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), String> {
        let before = out.len();
        while out.len() - before < min {
            // Bounded by the session's command timeout: a dead target is an error, not a hang.
            let c = self.conn.next_completion().map_err(|e| e.to_string())?;
            let tag = usize::try_from(c.tag).unwrap_or(usize::MAX);
            let Some(p) = self.pending.get_mut(tag).and_then(Option::take) else {
                return Err(format!("completion for unknown tag {}", c.tag));
            };
            let result = match c.result {
                Ok(r) => {
                    let status = r.status;
                    let sense = r.sense.as_ref().map(|s| (s.key, s.asc, s.ascq));
                    // A read that came back short did not do the work it is counted for.
                    let short = p.op == Op::Read && status == 0 && r.data.len() != p.len as usize;
                    let got = r.data.len();
                    // A write gives back no buffer: the tag's read buffer stays.
                    if p.op == Op::Read {
                        if let Some(slot) = self.buffers.get_mut(tag) {
                            *slot = r.data;
                        }
                    }
                    // BUSY, TASK SET FULL, or a unit attention: the I/O goes again.
                    let retry = matches!(status, 0x08 | 0x28)
                        || (status == 0x02 && sense.is_some_and(|s| s.0 == 6));
                    if retry && p.retries < RETRIES_MAX {
                        self.send(
                            tag,
                            Pending {
                                retries: p.retries + 1,
                                ..p
                            },
                        )?;
                        continue;
                    }
                    match (status, sense) {
                        (0, _) if short => Err(format!(
                            "read at byte {} returned {got} of {} bytes",
                            p.offset, p.len
                        )),
                        (0, _) => Ok(()),
                        (s, Some((k, asc, ascq))) => Err(format!(
                            "status {s:#04x}, sense {k:x}/{asc:02x}/{ascq:02x} at byte {}",
                            p.offset
                        )),
                        (s, None) => Err(format!("status {s:#04x} at byte {}", p.offset)),
                    }
                }
                Err(e) => Err(format!("{e} at byte {}", p.offset)),
            };
            out.push((tag, result));
        }
        Ok(())
    }

    fn data(&self, tag: usize) -> Option<&[u8]> {
        self.buffers.get(tag).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_or_malformed_url_is_a_clear_error() {
        let e = IscsiTarget::open(
            "iscsi://127.0.0.1:1/iqn.2026-11.x:t/0",
            "iqn.2026-11.x:i",
            None,
            std::time::Duration::ZERO,
        )
        .err()
        .unwrap();
        assert!(e.starts_with("iscsi://127.0.0.1:1/"), "{e}");
        let none = std::time::Duration::ZERO;
        let e = IscsiTarget::open("iscsi://bob%pw@/nothing", "iqn.2026-11.x:i", None, none)
            .err()
            .unwrap();
        assert!(!e.contains("pw"), "the password leaked: {e}");
        let e = IscsiTarget::open(
            "iscsi://bob@127.0.0.1:1/iqn.2026-11.x:t/0",
            "iqn.2026-11.x:i",
            None,
            std::time::Duration::ZERO,
        )
        .err()
        .unwrap();
        assert!(e.contains("--chap-secret-file"), "{e}");
    }
}
