//! NVMe/TCP namespaces through the initiator crate's NVMe/TCP host: one controller (an admin
//! and an I/O queue) per job, its queue depth kept full with Read / Write.

use crate::runner::{Done, Engine, Op, Target, TargetInfo};
use ::nvme::host::WriteData;
use ::nvme::sqe::Status;
use initiator::nvme::{self as host, NvmeHost, QueueConn};

/// Retries of one I/O answered with a retryable status (Command Interrupted, Namespace Not
/// Ready, an ANA transition) before it counts as failed.
const RETRIES_MAX: u8 = 16;

/// `nvme+tcp://HOST[:PORT]/SUBSYSTEM-NQN/NSID[?tls]`, the port 4420 unless given; `?tls`:
/// every queue over TLS with the bench's pre-shared key (`--tls-key-file`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeUrl {
    pub addr: std::net::SocketAddr,
    pub nqn: String,
    pub nsid: u32,
    pub tls: bool,
}

impl NvmeUrl {
    pub fn parse(url: &str) -> Result<NvmeUrl, String> {
        let rest = url
            .strip_prefix("nvme+tcp://")
            .ok_or("an NVMe/TCP URL starts with nvme+tcp://")?;
        let (rest, tls) = match rest.split_once('?') {
            None => (rest, false),
            Some((rest, "tls")) => (rest, true),
            Some((_, query)) => return Err(format!("?{query}: the one option is ?tls")),
        };
        let (hostport, path) = rest
            .split_once('/')
            .ok_or("nvme+tcp://HOST[:PORT]/NQN/NSID: no subsystem")?;
        let (nqn, nsid) = path
            .rsplit_once('/')
            .ok_or("nvme+tcp://HOST[:PORT]/NQN/NSID: no namespace ID")?;
        let nsid: u32 = nsid
            .parse()
            .ok()
            .filter(|&n| n > 0 && n != u32::MAX)
            .ok_or_else(|| format!("namespace ID {nsid:?}: 1 or more"))?;
        if !nqn.starts_with("nqn.") {
            return Err(format!("{nqn:?} is not an NQN (nqn....)"));
        }
        let with_port = if hostport.ends_with(']') || !hostport.contains(':') {
            format!("{hostport}:4420")
        } else {
            hostport.to_string()
        };
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&with_port)
            .map_err(|e| format!("{hostport}: {e}"))?
            .next()
            .ok_or_else(|| format!("{hostport}: no address"))?;
        Ok(NvmeUrl {
            addr,
            nqn: nqn.to_string(),
            nsid,
            tls,
        })
    }
}

pub struct NvmeTarget {
    info: TargetInfo,
    url: NvmeUrl,
    hostnqn: String,
    /// The pre-shared key its queues use (a `?tls` URL).
    tls: Option<host::TlsPsk>,
    busy_poll: std::time::Duration,
}

impl NvmeTarget {
    /// Connects once to learn the namespace's size and block size (and that it is reachable).
    pub fn open(
        url: &str,
        hostnqn: &str,
        tls_key: Option<&host::TlsPsk>,
        busy_poll: std::time::Duration,
    ) -> Result<NvmeTarget, String> {
        let parsed = NvmeUrl::parse(url).map_err(|e| format!("{url}: {e}"))?;
        let tls = match (parsed.tls, tls_key) {
            (false, _) => None,
            (true, Some(k)) => Some(k.clone()),
            (true, None) => return Err(format!("{url}: ?tls needs --tls-key-file")),
        };
        let mut h =
            NvmeHost::connect_secure(parsed.addr, &parsed.nqn, hostnqn, 2, None, tls.as_ref())
                .map_err(|e| format!("{url}: {e}"))?;
        let ns = h
            .admin
            .run_ok(host::sqe(0x06, parsed.nsid, [0; 6]), Vec::new(), 4096)
            .map_err(|e| format!("{url}: Identify Namespace: {e}"))?
            .data;
        h.disconnect();
        let blocks = u64::from_le_bytes(ns[..8].try_into().unwrap_or([0; 8]));
        let shift = ns.get(130).copied().unwrap_or(0);
        if blocks == 0 || !(9..=16).contains(&shift) {
            return Err(format!(
                "{url}: the namespace is not there or reports no capacity"
            ));
        }
        let block_size = 1u32 << shift;
        Ok(NvmeTarget {
            info: TargetInfo {
                name: url.to_string(),
                kind: "nvme".into(),
                capacity_bytes: blocks * u64::from(block_size),
                block_size,
                notes: crate::busy_poll_note(busy_poll).into_iter().collect(),
                node: Some(parsed.nqn.clone()),
                metrics: None,
            },
            url: parsed,
            hostnqn: hostnqn.to_string(),
            tls,
            busy_poll,
        })
    }
}

impl Target for NvmeTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn open(&self, queue_depth: usize, max_len: u32) -> Result<Box<dyn Engine>, String> {
        let depth = u16::try_from(queue_depth.max(1)).map_err(|_| "queue depth too large")?;
        let mut h = NvmeHost::connect_secure(
            self.url.addr,
            &self.url.nqn,
            &self.hostnqn,
            depth,
            None,
            self.tls.as_ref(),
        )
        .map_err(|e| format!("{}: {e}", self.info.name))?;
        h.io.set_busy_poll(self.busy_poll);
        let mut pattern = vec![0u8; max_len as usize];
        initiator::driver::random_bytes(&mut pattern);
        Ok(Box::new(NvmeEngine {
            admin: h.admin,
            kept_alive: std::time::Instant::now(),
            io: h.io,
            nsid: self.url.nsid,
            block_size: u64::from(self.info.block_size),
            pattern: pattern.into(),
            pending: vec![None; queue_depth],
            read: vec![Vec::new(); queue_depth],
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

/// How often a job's controller is sent a Keep Alive: a third of the KATO its Connect asked
/// for (15 s), so a workload of any length keeps its controller (I/O alone does not count as
/// keep-alive traffic unless the controller offers TBKAS, which ferrosan's does not).
const KEEP_ALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

struct NvmeEngine {
    /// Kept open (closing the admin queue ends the controller), and sent Keep Alives.
    admin: QueueConn,
    kept_alive: std::time::Instant,
    io: QueueConn,
    nsid: u32,
    block_size: u64,
    /// What writes send (random, as for iSCSI): shared by every write, never copied per write.
    pattern: std::sync::Arc<[u8]>,
    pending: Vec<Option<Pending>>,
    /// Per tag, what its last read brought.
    read: Vec<Vec<u8>>,
}

impl NvmeEngine {
    fn send(&mut self, tag: usize, p: Pending) -> Result<(), String> {
        let cid = u16::try_from(tag).map_err(|_| format!("tag {tag} out of range"))?;
        let lba = p.offset / self.block_size;
        let blocks = u32::try_from(u64::from(p.len) / self.block_size)
            .map_err(|_| "I/O too long".to_string())?;
        let (opcode, data_out, data_in) = match p.op {
            Op::Read => (
                ::nvme::nvm::opcode::READ,
                WriteData::Owned(Vec::new()),
                p.len,
            ),
            Op::Write => {
                let len = p.len as usize;
                if len > self.pattern.len() {
                    return Err(format!("a write of {len} bytes is longer than the pattern"));
                }
                let shared = WriteData::Shared(std::sync::Arc::clone(&self.pattern), len);
                (::nvme::nvm::opcode::WRITE, shared, 0)
            }
        };
        *self
            .pending
            .get_mut(tag)
            .ok_or_else(|| format!("tag {tag} out of range"))? = Some(p);
        self.io.enqueue(
            cid,
            host::rw(opcode, self.nsid, lba, blocks),
            data_out,
            data_in,
        );
        Ok(())
    }
}

/// Statuses the host retries: Command Interrupted, Namespace Not Ready, ANA transition.
fn retryable(s: Status) -> bool {
    !s.dnr && matches!((s.sct, s.sc), (0, 0x21) | (0, 0x82) | (3, 0x03))
}

impl Engine for NvmeEngine {
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
        if self.kept_alive.elapsed() >= KEEP_ALIVE_EVERY {
            let keep_alive = host::sqe(::nvme::admin::opcode::KEEP_ALIVE, 0, [0; 6]);
            self.admin
                .run_ok(keep_alive, Vec::new(), 0)
                .map_err(|e| format!("Keep Alive: {e}"))?;
            self.kept_alive = std::time::Instant::now();
        }
        let before = out.len();
        while out.len() - before < min {
            let done = self.io.next_done().map_err(|e| e.to_string())?;
            let tag = usize::from(done.cqe.cid);
            let Some(p) = self.pending.get_mut(tag).and_then(Option::take) else {
                return Err(format!("completion for unknown command {}", done.cqe.cid));
            };
            let status = done.cqe.status;
            if retryable(status) && p.retries < RETRIES_MAX {
                self.send(
                    tag,
                    Pending {
                        retries: p.retries + 1,
                        ..p
                    },
                )?;
                continue;
            }
            let result = if !status.is_success() {
                Err(format!(
                    "status SCT {} SC {:#04x} at byte {}",
                    status.sct, status.sc, p.offset
                ))
            } else if p.op == Op::Read && done.data.len() != p.len as usize {
                Err(format!(
                    "read at byte {} returned {} of {} bytes",
                    p.offset,
                    done.data.len(),
                    p.len
                ))
            } else {
                if p.op == Op::Read {
                    if let Some(slot) = self.read.get_mut(tag) {
                        *slot = done.data;
                    }
                }
                Ok(())
            };
            out.push((tag, result));
        }
        Ok(())
    }

    fn data(&self, tag: usize) -> Option<&[u8]> {
        self.read.get(tag).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_host_a_subsystem_and_a_namespace() {
        let u = NvmeUrl::parse("nvme+tcp://127.0.0.1/nqn.2026-11.org.ferrosan:demo/1").unwrap();
        assert_eq!(u.addr, "127.0.0.1:4420".parse().unwrap());
        assert_eq!(
            (u.nqn.as_str(), u.nsid),
            ("nqn.2026-11.org.ferrosan:demo", 1)
        );
        let u = NvmeUrl::parse("nvme+tcp://[::1]:4421/nqn.2026-11.x:y:z/7").unwrap();
        assert_eq!(u.addr, "[::1]:4421".parse().unwrap());
        assert_eq!(u.nqn, "nqn.2026-11.x:y:z");
        assert!(!u.tls);
        let u = NvmeUrl::parse("nvme+tcp://127.0.0.1/nqn.2026-11.x:y/1?tls").unwrap();
        assert!(u.tls && u.nsid == 1);
        for bad in [
            "nvme+tcp://127.0.0.1/nqn.x/1?tls=1",
            "iscsi://127.0.0.1/nqn.x/1",
            "nvme+tcp://127.0.0.1/nqn.x/0",
            "nvme+tcp://127.0.0.1/iqn.2026-11.x:t/1",
            "nvme+tcp://127.0.0.1/nqn.x",
        ] {
            assert!(NvmeUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
