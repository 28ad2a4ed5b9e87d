//! Log pages (NVMe base 2.0, 5.16; NVMe over Fabrics 1.1, 5.4 for discovery): Get Log Page's
//! fields, and the pages a fabrics I/O or discovery controller returns — error information,
//! SMART / health, changed namespace list, asymmetric namespace access, discovery.

use crate::sqe::{Sqe, Status};

/// Log page identifiers.
pub mod lid {
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const CHANGED_NAMESPACES: u8 = 0x04;
    pub const COMMAND_EFFECTS: u8 = 0x05;
    pub const ANA: u8 = 0x0C;
    pub const DISCOVERY: u8 = 0x70;
}

/// A Get Log Page command: which page, from which byte offset, how many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetLogPage {
    pub lid: u8,
    /// Log specific field (ANA: bit 0 "groups only").
    pub lsp: u8,
    /// Retain asynchronous event: the host reads without clearing the event.
    pub rae: bool,
    pub offset: u64,
    pub len: u64,
}

impl GetLogPage {
    pub fn decode(sqe: &Sqe) -> Result<GetLogPage, Status> {
        let cdw10 = sqe.cdw(10);
        let numd = u64::from(cdw10 >> 16) | u64::from(sqe.cdw(11) & 0xFFFF) << 16;
        let offset = u64::from(sqe.cdw(12)) | u64::from(sqe.cdw(13)) << 32;
        if offset % 4 != 0 {
            return Err(Status::INVALID_FIELD);
        }
        Ok(GetLogPage {
            lid: (cdw10 & 0xFF) as u8,
            lsp: ((cdw10 >> 8) & 0x7F) as u8,
            rae: cdw10 & 1 << 15 != 0,
            offset,
            len: (numd + 1) * 4,
        })
    }

    /// The part of `page` this command asked for (an offset past the end is Invalid Field).
    pub fn window<'a>(&self, page: &'a [u8]) -> Result<&'a [u8], Status> {
        let start = usize::try_from(self.offset).map_err(|_| Status::INVALID_FIELD)?;
        if start > page.len() {
            return Err(Status::INVALID_FIELD);
        }
        let len = usize::try_from(self.len).unwrap_or(usize::MAX);
        Ok(&page[start..page.len().min(start.saturating_add(len))])
    }
}

/// Error information: `entries` entries of 64 bytes, none of them an error (ferrosan reports
/// errors in each command's status, not in this log).
pub fn error_log(entries: usize) -> Vec<u8> {
    vec![0u8; entries * 64]
}

/// What the SMART / health page counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// Bytes read and written by the host.
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub read_commands: u64,
    pub write_commands: u64,
    /// Media and data integrity errors (the device's read or write errors).
    pub media_errors: u64,
    pub power_on_hours: u64,
}

fn put128(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The 512-byte SMART / health page: no critical warning, 300 K (a virtual device has no
/// temperature of its own; 27 °C), spare 100 % above a 10 % threshold, 0 % used; data units in
/// thousands of 512-byte units, rounded up as the specification says.
pub fn smart(h: &Health) -> Vec<u8> {
    let mut d = vec![0u8; 512];
    d[1..3].copy_from_slice(&300u16.to_le_bytes());
    d[3] = 100;
    d[4] = 10;
    put128(&mut d, 32, h.read_bytes.div_ceil(512_000));
    put128(&mut d, 48, h.written_bytes.div_ceil(512_000));
    put128(&mut d, 64, h.read_commands);
    put128(&mut d, 80, h.write_commands);
    put128(&mut d, 128, h.power_on_hours);
    put128(&mut d, 160, h.media_errors);
    d
}

/// The changed namespace list: up to 1024 namespace IDs, or FFFFFFFFh alone when more changed.
pub fn changed_namespaces(nsids: &[u32]) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    if nsids.len() > 1024 {
        d[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        return d;
    }
    for (i, n) in nsids.iter().enumerate() {
        d[i * 4..i * 4 + 4].copy_from_slice(&n.to_le_bytes());
    }
    d
}

/// The Commands Supported and Effects page: for each admin and I/O opcode offered, CSUPP, and
/// LBCC (it may change logical block content) for those in `changes`.
pub fn command_effects(admin: &[u8], io: &[u8], changes: &[u8]) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    let mut put = |base: usize, op: u8, lbcc: bool| {
        let v: u32 = 1 | if lbcc { 1 << 1 } else { 0 };
        let at = base + usize::from(op) * 4;
        d[at..at + 4].copy_from_slice(&v.to_le_bytes());
    };
    for &op in admin {
        put(0, op, false);
    }
    for &op in io {
        put(1024, op, changes.contains(&op));
    }
    d
}

/// An ANA group's state (ANA log page, figure 206).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AnaState {
    Optimized = 0x01,
    NonOptimized = 0x02,
    Inaccessible = 0x03,
    PersistentLoss = 0x04,
    Change = 0x0F,
}

/// One ANA group as seen through the controller asked: its state and namespaces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroup {
    pub id: u32,
    pub state: AnaState,
    pub nsids: Vec<u32>,
}

/// The ANA log page: a header (change count, number of groups) and a descriptor per group,
/// each with its namespace IDs unless `groups_only` (LSP bit 0).
pub fn ana(change_count: u64, groups: &[AnaGroup], groups_only: bool) -> Vec<u8> {
    let mut d = Vec::with_capacity(16 + groups.len() * 32);
    d.extend_from_slice(&change_count.to_le_bytes());
    d.extend_from_slice(&(groups.len().min(usize::from(u16::MAX)) as u16).to_le_bytes());
    d.extend_from_slice(&[0; 6]);
    for g in groups.iter().take(usize::from(u16::MAX)) {
        let nsids: &[u32] = if groups_only { &[] } else { &g.nsids };
        d.extend_from_slice(&g.id.to_le_bytes());
        d.extend_from_slice(&(nsids.len() as u32).to_le_bytes());
        d.extend_from_slice(&change_count.to_le_bytes());
        d.push(g.state as u8);
        d.extend_from_slice(&[0; 15]);
        for n in nsids {
            d.extend_from_slice(&n.to_le_bytes());
        }
    }
    d
}

/// What a discovery log entry describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SubsystemType {
    /// Another discovery service (a referral: another gateway's portal group).
    Referral = 1,
    Nvm = 2,
    /// The discovery subsystem answering, at the port the host reached it on.
    CurrentDiscovery = 3,
}

impl SubsystemType {
    /// Whether the entry describes a discovery service (its subsystem NQN is then the
    /// well-known discovery NQN).
    pub fn is_discovery(self) -> bool {
        !matches!(self, SubsystemType::Nvm)
    }
}

/// One discovery log entry: a subsystem reachable at an address over TCP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryEntry {
    pub kind: SubsystemType,
    pub port_id: u16,
    pub ipv6: bool,
    pub address: String,
    pub port: u16,
    pub subnqn: String,
    /// The host must connect over TLS 1.3 (TREQ: secure channel required; TSAS: TLS 1.3), as
    /// `nvme connect-all` then does by itself.
    pub tls_required: bool,
}

/// TREQ's secure channel field: required (bits 1:0 = 01b); 00b is "not specified".
const TREQ_SECURE_CHANNEL_REQUIRED: u8 = 0x01;
/// TREQ: SQ flow control may be disabled.
const TREQ_SQ_FLOW_DISABLE: u8 = 0x04;
/// TSAS for TCP, byte 0 (SECTYPE): TLS 1.3.
const TSAS_SECTYPE_TLS13: u8 = 2;
/// EFLAGS: the discovery controller described supports explicit persistent connections (it
/// keeps a host's keep-alive and raises Discovery Log Page Change to a held Asynchronous
/// Event Request). Without it, libnvme's `connect-all --persistent` drops the connection.
pub const EFLAGS_EPCSD: u16 = 1 << 1;

fn put_str(d: &mut [u8], at: usize, len: usize, s: &str) {
    let b = &s.as_bytes()[..s.len().min(len - 1)];
    d[at..at + b.len()].copy_from_slice(b);
}

impl DiscoveryEntry {
    fn encode(&self, out: &mut Vec<u8>) {
        let mut e = [0u8; 1024];
        e[0] = 3; // TRTYPE: TCP
        e[1] = if self.ipv6 { 2 } else { 1 };
        e[2] = self.kind as u8;
        e[3] = TREQ_SQ_FLOW_DISABLE;
        if self.tls_required {
            e[3] |= TREQ_SECURE_CHANNEL_REQUIRED;
            e[768] = TSAS_SECTYPE_TLS13;
        }
        e[4..6].copy_from_slice(&self.port_id.to_le_bytes());
        e[6..8].copy_from_slice(&crate::fabrics::DYNAMIC_CONTROLLER.to_le_bytes());
        e[8..10].copy_from_slice(&32u16.to_le_bytes()); // ASQSZ
        if self.kind.is_discovery() {
            e[10..12].copy_from_slice(&EFLAGS_EPCSD.to_le_bytes());
        }
        put_str(&mut e, 32, 32, &self.port.to_string());
        put_str(&mut e, 256, 256, &self.subnqn);
        put_str(&mut e, 512, 256, &self.address);
        out.extend_from_slice(&e);
    }
}

/// The discovery log page: a 1024-byte header (generation counter, number of records) and a
/// 1024-byte entry per subsystem port.
pub fn discovery(generation: u64, entries: &[DiscoveryEntry]) -> Vec<u8> {
    let mut d = vec![0u8; 1024];
    d[..8].copy_from_slice(&generation.to_le_bytes());
    d[8..16].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    for e in entries {
        e.encode(&mut d);
    }
    d
}

#[cfg(test)]
mod tests;
