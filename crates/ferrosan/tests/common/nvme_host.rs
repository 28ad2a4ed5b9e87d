//! What an NVMe host sends beside reads and writes, as the client-behaviour suites need it:
//! reservations (NVMe base 2.0, 7.2 and 8.19), Identify Namespace fields, Get Log Page, and the
//! fused Compare and Write that VMFS's ATS becomes.

use initiator::nvme::{self as host, NvmeHost, QueueConn};
use nvme::sqe::Status;

/// Reservation types as NVMe numbers them (not SCSI's).
pub mod rtype {
    pub const WRITE_EXCLUSIVE: u8 = 1;
    pub const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 3;
    pub const WRITE_EXCLUSIVE_ALL_REGISTRANTS: u8 = 5;
}

fn keys(a: u64, b: u64) -> Vec<u8> {
    let mut d = a.to_le_bytes().to_vec();
    d.extend_from_slice(&b.to_le_bytes());
    d
}

fn status(q: &mut QueueConn, sqe: nvme::sqe::Sqe, data: Vec<u8>) -> Status {
    q.run(sqe, data, 0)
        .expect("the command is answered")
        .cqe
        .status
}

/// Reservation Register, Register (action 0) ignoring any existing key (IEKEY): as a cluster
/// node joins.
pub fn register(h: &mut NvmeHost, key: u64) -> Status {
    status(
        &mut h.io,
        host::sqe(0x0D, 1, [1 << 3, 0, 0, 0, 0, 0]),
        keys(0, key),
    )
}

/// Reservation Register, Unregister (action 1) of `key`.
pub fn unregister(h: &mut NvmeHost, key: u64) -> Status {
    status(
        &mut h.io,
        host::sqe(0x0D, 1, [1, 0, 0, 0, 0, 0]),
        keys(key, 0),
    )
}

/// Reservation Acquire: action 0 acquire, 1 preempt (`other` the key preempted).
pub fn acquire(h: &mut NvmeHost, action: u32, kind: u8, key: u64, other: u64) -> Status {
    let cdw10 = action | u32::from(kind) << 8;
    status(
        &mut h.io,
        host::sqe(0x11, 1, [cdw10, 0, 0, 0, 0, 0]),
        keys(key, other),
    )
}

/// Reservation Release: action 0 release, 1 clear.
pub fn release(h: &mut NvmeHost, action: u32, kind: u8, key: u64) -> Status {
    let cdw10 = action | u32::from(kind) << 8;
    status(
        &mut h.io,
        host::sqe(0x15, 1, [cdw10, 0, 0, 0, 0, 0]),
        key.to_le_bytes().to_vec(),
    )
}

/// A Reservation Report: the type held (0: none) and each registrant's (holds it, host
/// identifier's first 8 bytes, key).
#[derive(Debug, PartialEq, Eq)]
pub struct Report {
    pub kind: u8,
    pub registrants: Vec<(bool, [u8; 8], u64)>,
}

pub fn report(h: &mut NvmeHost) -> Report {
    let d =
        h.io.run_ok(host::sqe(0x0E, 1, [1023, 0, 0, 0, 0, 0]), Vec::new(), 4096)
            .expect("Reservation Report")
            .data;
    let n = usize::from(u16::from_le_bytes([d[5], d[6]]));
    let registrants = (0..n)
        .map(|i| &d[24 + i * 24..48 + i * 24])
        .map(|e| {
            (
                e[2] & 1 != 0,
                e[8..16].try_into().expect("host id"),
                u64::from_le_bytes(e[16..24].try_into().expect("key")),
            )
        })
        .collect();
    Report {
        kind: d[4],
        registrants,
    }
}

/// Identify Namespace `nsid`.
pub fn identify_namespace(h: &mut NvmeHost, nsid: u32) -> Vec<u8> {
    h.admin
        .run_ok(host::sqe(0x06, nsid, [0; 6]), Vec::new(), 4096)
        .expect("Identify Namespace")
        .data
}

/// The data size of namespace data `ns`'s formatted LBA format, in bytes.
pub fn block_bytes(ns: &[u8]) -> u32 {
    let format = usize::from(ns[26] & 0x0F);
    1 << ns[128 + format * 4 + 2]
}

/// A write of one block of `data` at `lba` of NSID 1: its status.
pub fn write(h: &mut NvmeHost, lba: u64, data: Vec<u8>) -> Status {
    let blocks = (data.len() / 512) as u32;
    status(&mut h.io, host::rw(0x01, 1, lba, blocks), data)
}

/// Get Log Page `lid` (`len` bytes) on the admin queue.
pub fn log_page(h: &mut NvmeHost, lid: u8, len: u32) -> Vec<u8> {
    let numd = len / 4 - 1;
    h.admin
        .run_ok(
            host::sqe(
                0x02,
                u32::MAX,
                [
                    u32::from(lid) | (numd & 0xFFFF) << 16,
                    numd >> 16,
                    0,
                    0,
                    0,
                    0,
                ],
            ),
            Vec::new(),
            len,
        )
        .expect("Get Log Page")
        .data
}

/// The ANA log page's groups: (group, state, its NSIDs).
pub fn ana_groups(h: &mut NvmeHost) -> Vec<(u32, u8, Vec<u32>)> {
    let d = log_page(h, 0x0C, 4096);
    let groups = usize::from(u16::from_le_bytes([d[8], d[9]]));
    let mut at = 16;
    let mut out = Vec::new();
    for _ in 0..groups {
        let id = u32::from_le_bytes(d[at..at + 4].try_into().expect("id"));
        let n = u32::from_le_bytes(d[at + 4..at + 8].try_into().expect("count")) as usize;
        let state = d[at + 16];
        let nsids = (0..n)
            .map(|i| {
                u32::from_le_bytes(
                    d[at + 32 + i * 4..at + 36 + i * 4]
                        .try_into()
                        .expect("nsid"),
                )
            })
            .collect();
        out.push((id, state, nsids));
        at += 32 + n * 4;
    }
    out
}

/// The fused Compare and Write VMFS's ATS becomes: `old` compared with `blocks` at `lba` of
/// NSID 1 and, if it matches, `new` written, atomically. Both completions' statuses.
pub fn compare_and_write(
    h: &mut NvmeHost,
    lba: u64,
    old: Vec<u8>,
    new: Vec<u8>,
) -> (Status, Status) {
    let blocks = (old.len() / 512) as u32;
    let mut compare = host::rw(0x05, 1, lba, blocks);
    compare.0[1] |= 1; // FUSE: first command
    let mut write = host::rw(0x01, 1, lba, blocks);
    write.0[1] |= 2; // FUSE: second command
    let c1 = h.io.submit(compare, old, 0).expect("compare sent");
    let c2 = h.io.submit(write, new, 0).expect("write sent");
    let mut statuses = [None, None];
    for _ in 0..2 {
        let done = h.io.next_done().expect("answered");
        let slot = if done.cqe.cid == c1 {
            0
        } else {
            assert_eq!(done.cqe.cid, c2);
            1
        };
        statuses[slot] = Some(done.cqe.status);
    }
    (statuses[0].expect("compare"), statuses[1].expect("write"))
}
