//! Identify data (NVMe base 2.0, 5.17; NVM command set 1.0, 4.1.5): the controller, a
//! namespace, the active namespace list and a namespace's identification descriptors, built
//! from what the controller and the device are. Offsets follow the specification's figures
//! (and Linux's `struct nvme_id_ctrl` / `nvme_id_ns`).

/// The length of every Identify data structure.
pub const IDENTIFY_LEN: usize = 4096;

/// Identify CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    pub const NS_DESCRIPTORS: u8 = 0x03;
    /// I/O command set independent Identify Namespace (what Linux asks of NVMe 1.2+).
    pub const NS_INDEPENDENT: u8 = 0x08;
}

/// Controller multi-path I/O and namespace sharing (CMIC): more than one port, more than one
/// controller, ANA reporting.
pub const CMIC_MULTI_PORT: u8 = 1 << 0;
pub const CMIC_MULTI_CONTROLLER: u8 = 1 << 1;
pub const CMIC_ANA: u8 = 1 << 3;

/// Optional NVM commands (ONCS): Compare, Dataset Management, Write Zeroes, Reservations.
pub const ONCS_COMPARE: u16 = 1 << 0;
pub const ONCS_DSM: u16 = 1 << 2;
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
pub const ONCS_RESERVATIONS: u16 = 1 << 5;

/// Asynchronous events this controller may send (OAES): namespace attribute notices, ANA
/// change notices.
pub const OAES_NS_ATTRIBUTE: u32 = 1 << 8;
pub const OAES_ANA_CHANGE: u32 = 1 << 11;

/// Controller type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ControllerType {
    Io = 1,
    Discovery = 2,
}

/// What Identify Controller reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Controller {
    pub serial: String,
    pub model: String,
    pub firmware: String,
    pub cntlid: u16,
    pub kind: ControllerType,
    /// Maximum data transfer size as a power of two of 4 KiB pages (0: no limit).
    pub mdts: u8,
    /// Commands outstanding per queue at most.
    pub maxcmd: u16,
    /// The highest namespace ID.
    pub nn: u32,
    pub oncs: u16,
    /// Compare and Write fused (FUSES bit 0).
    pub fused_compare_write: bool,
    pub volatile_write_cache: bool,
    pub cmic: u8,
    pub oaes: u32,
    /// Asynchronous Event Requests outstanding at most, 0's based.
    pub aerl: u8,
    /// Error log entries, 0's based.
    pub elpe: u8,
    /// Keep-alive granularity, in 100 ms units.
    pub kas: u16,
    /// ANA: transition time in seconds, the number of groups, the highest group ID.
    pub anatt: u8,
    pub anagrpmax: u32,
    pub nanagrpid: u32,
    pub subnqn: String,
    /// In-capsule data a command capsule may carry, in bytes (IOCCSZ counts the 64-byte command
    /// too, in 16-byte units).
    pub in_capsule: u32,
}

fn put_ascii(out: &mut [u8], text: &str) {
    out.fill(b' ');
    for (o, b) in out
        .iter_mut()
        .zip(text.bytes().filter(|b| (0x20..0x7F).contains(b)))
    {
        *o = b;
    }
}

fn put16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

impl Controller {
    /// The 4096-byte Identify Controller data.
    pub fn encode(&self) -> Vec<u8> {
        let mut d = vec![0u8; IDENTIFY_LEN];
        put_ascii(&mut d[4..24], &self.serial);
        put_ascii(&mut d[24..64], &self.model);
        put_ascii(&mut d[64..72], &self.firmware);
        d[76] = self.cmic;
        d[77] = self.mdts;
        // ACL (0's based): the Abort commands a host may have outstanding.
        d[258] = crate::controller::ABORTS_MAX - 1;
        put16(&mut d, 78, self.cntlid);
        put32(&mut d, 80, crate::fabrics::Registers::VS);
        put32(&mut d, 92, self.oaes);
        // CTRATT: 128-bit host identifier (what NVMe over Fabrics uses).
        put32(&mut d, 96, 1);
        d[111] = self.kind as u8;
        d[258] = self.aerl;
        // LPA: SMART per namespace, commands supported and effects, extended Get Log Page.
        d[261] = 0x07;
        d[262] = self.elpe;
        put16(&mut d, 320, self.kas);
        if self.cmic & CMIC_ANA != 0 {
            d[342] = self.anatt;
            // ANACAP: reports optimized, non-optimized, inaccessible, persistent loss and
            // change states.
            d[343] = 0x1F;
            put32(&mut d, 344, self.anagrpmax);
            put32(&mut d, 348, self.nanagrpid);
        }
        // SQES / CQES: 64-byte and 16-byte entries only.
        d[512] = 0x66;
        d[513] = 0x44;
        put16(&mut d, 514, self.maxcmd);
        put32(&mut d, 516, self.nn);
        // MNAN: namespaces the subsystem may hold at most, as many as NSIDs (Linux refuses a
        // multipath controller without it).
        put32(&mut d, 540, self.nn);
        put16(&mut d, 520, self.oncs);
        put16(&mut d, 522, u16::from(self.fused_compare_write));
        d[525] = u8::from(self.volatile_write_cache);
        // SGLS: SGLs supported (no alignment), offsets in the capsule's data block.
        put32(&mut d, 536, 1 | 1 << 20);
        let nqn = self.subnqn.as_bytes();
        let n = nqn.len().min(crate::fabrics::NQN_MAX);
        d[768..768 + n].copy_from_slice(&nqn[..n]);
        // Fabrics: capsule sizes in 16-byte units, in-capsule data at offset 0, dynamic
        // controllers, one SGL descriptor.
        let ioccsz = (crate::sqe::SQE_LEN as u32 + self.in_capsule) / 16;
        put32(&mut d, 1792, ioccsz);
        put32(&mut d, 1796, (crate::sqe::CQE_LEN / 16) as u32);
        d[1803] = 1;
        d
    }
}

/// What Identify Namespace reports of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Size in logical blocks.
    pub blocks: u64,
    /// log2 of the logical block size (9: 512 bytes, 12: 4096).
    pub block_shift: u8,
    /// Thin: deallocation offered, deallocated blocks read as zeros.
    pub thin: bool,
    /// Shared by several controllers (paths), as every ferrosan namespace may be.
    pub shared: bool,
    /// Reservation types offered: all six, persistence through power loss and Ignore
    /// Existing Key (RESCAP 0xFF).
    pub reservations: bool,
    pub write_protected: bool,
    pub anagrpid: u32,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
}

impl Namespace {
    /// The 4096-byte Identify Namespace data.
    pub fn encode(&self) -> Vec<u8> {
        let mut d = vec![0u8; IDENTIFY_LEN];
        d[0..8].copy_from_slice(&self.blocks.to_le_bytes());
        d[8..16].copy_from_slice(&self.blocks.to_le_bytes());
        d[16..24].copy_from_slice(&self.blocks.to_le_bytes());
        // NSFEAT bit 0: thin provisioning.
        d[24] = u8::from(self.thin);
        // One LBA format (NLBAF 0's based), format 0 in use.
        d[25] = 0;
        d[26] = 0;
        d[30] = u8::from(self.shared);
        d[31] = if self.reservations { 0xFF } else { 0 };
        // DLFEAT: deallocated blocks read as zeros, Write Zeroes may deallocate.
        if self.thin {
            d[33] = 0x01 | 0x08;
        }
        put32(&mut d, 92, self.anagrpid);
        d[99] = u8::from(self.write_protected);
        d[104..120].copy_from_slice(&self.nguid);
        d[120..128].copy_from_slice(&self.eui64);
        // LBA format 0: no metadata, this block size, best performance.
        d[130] = self.block_shift;
        d
    }
}

impl Namespace {
    /// The 4096-byte I/O command set independent Identify Namespace data (CNS 08h): features,
    /// sharing, reservations, ANA group, write protection; the namespace is ready.
    pub fn encode_independent(&self) -> Vec<u8> {
        let mut d = vec![0u8; IDENTIFY_LEN];
        d[0] = u8::from(self.thin);
        d[1] = u8::from(self.shared);
        d[2] = if self.reservations { 0xFF } else { 0 };
        put32(&mut d, 4, self.anagrpid);
        d[8] = u8::from(self.write_protected);
        // NSTAT: ready.
        d[14] = 1;
        d
    }
}

/// The active namespace list (CNS 02h): the namespace IDs above `after`, ascending, at most
/// 1024, zero-filled.
pub fn active_namespaces(nsids: &[u32], after: u32) -> Vec<u8> {
    let mut sorted: Vec<u32> = nsids.iter().copied().filter(|&n| n > after).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut d = vec![0u8; IDENTIFY_LEN];
    for (i, nsid) in sorted.iter().take(IDENTIFY_LEN / 4).enumerate() {
        put32(&mut d, i * 4, *nsid);
    }
    d
}

/// A namespace's identification descriptors (CNS 03h): EUI-64, NGUID and UUID, each
/// `NIDT NIDL 0 0 NID`.
pub fn ns_descriptors(eui64: &[u8; 8], nguid: &[u8; 16], uuid: &[u8; 16]) -> Vec<u8> {
    let mut d = Vec::with_capacity(IDENTIFY_LEN);
    for (nidt, nid) in [(1u8, &eui64[..]), (2, &nguid[..]), (3, &uuid[..])] {
        d.extend_from_slice(&[nidt, nid.len() as u8, 0, 0]);
        d.extend_from_slice(nid);
    }
    d.resize(IDENTIFY_LEN, 0);
    d
}

#[cfg(test)]
mod tests;
