//! SCSI command execution on a small RAM-backed LU behind a `LunMap`: arbitrary CDBs, Data-Out
//! and Data-In limits, from two nexuses (per-nexus state: unit attentions, PREVENT).
//! Invariants: Data-In never exceeds the transport's limit; CHECK CONDITION always carries sense
//! (and nothing else does); sense encodes within SPC's bounds; a GOOD WRITE then GOOD READ of the
//! same blocks returns the written bytes. With an owner (explicit ALUA, as RBD gateways use it)
//! the two nexuses come through two target port groups: nothing writes the medium through the
//! standby group, and SET TARGET PORT GROUPS only ever moves the LU to the sender's own group.
#![no_main]

use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use scsi::{
    sense, AccessState, Command, Completion, LogicalUnit, LuIdentity, LuSettings, LunMap, Nexus,
    Ownership, PortGroup, Status, TargetPort,
};
use store::RamStore;

#[derive(Arbitrary, Debug)]
struct Input {
    block_4k: bool,
    read_only: bool,
    write_cache: bool,
    thin: bool,
    mapping_read_only: bool,
    /// Explicit ALUA with this owning group (0: nobody, 1 or 2: a nexus's group).
    owner: Option<u8>,
    ops: Vec<Op>,
}

/// The LU's owner, as a gateway's image lock would be; `take` fails while `refuse` is set.
struct FuzzOwner {
    owner: AtomicU16,
    refuse: AtomicBool,
}

impl Ownership for FuzzOwner {
    fn is_active(&self, group: u16) -> bool {
        self.owner.load(Ordering::SeqCst) == group
    }
    fn explicit(&self) -> bool {
        true
    }
    fn take(&self, group: u16) -> std::io::Result<()> {
        if self.refuse.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("cluster unreachable"));
        }
        self.owner.store(group, Ordering::SeqCst);
        Ok(())
    }
}

/// Opcodes that change the medium: never GOOD through a standby group.
const MEDIUM_WRITES: &[u8] = &[0x0a, 0x2a, 0xaa, 0x8a, 0x2e, 0x8e, 0x41, 0x93, 0x89, 0x42];

#[derive(Arbitrary, Debug)]
enum Op {
    Raw {
        nexus: bool,
        lun: u8,
        cdb: Vec<u8>,
        data_out: Vec<u8>,
        limit: u16,
    },
    /// A CDB with a known opcode and arbitrary fields (reaches deeper than random first bytes).
    Known {
        nexus: bool,
        opcode: u8,
        fields: [u8; 15],
        len: u8,
        data_out: Vec<u8>,
        limit: u16,
        /// Run it as a network worker does (`LunMap::try_execute`): reads lend RAM pages.
        nonblocking: bool,
    },
    WriteRead {
        lba: u16,
        blocks: u8,
        seed: u8,
    },
    NexusLost(bool),
    Reset(bool),
    CapacityChanged,
    /// A SET TARGET PORT GROUPS with these (state, group) descriptors, its parameter list
    /// length as the CDB says (or this one instead).
    Stpg {
        nexus: bool,
        descriptors: Vec<(u8, u8)>,
        list_len: Option<u8>,
    },
    /// The owner moved elsewhere (another gateway took the image).
    OwnerMoved(u8),
    /// Takeovers fail (cluster unreachable) or work again.
    Refuse(bool),
}

const OPCODES: &[u8] = &[
    0x00, 0x03, 0x12, 0x15, 0x1a, 0x1b, 0x1e, 0x25, 0x28, 0x2a, 0x2e, 0x2f, 0x35, 0x41, 0x42, 0x4d,
    0x55, 0x5a, 0x5e, 0x5f, 0x88, 0x89, 0x8a, 0x8e, 0x8f, 0x91, 0x93, 0x9e, 0xa0, 0xa3, 0x08, 0x0a,
    0x2b, 0x34, 0x3b, 0x3c, 0x1c, 0x1d, 0x7f, 0xa8, 0xaa, 0x9f, 0x48, 0x83, 0x84, 0xa4,
];

fn check(c: &Completion, data_in: &[u8], limit: u32) {
    assert!(
        data_in.len() <= limit as usize,
        "data_in {} > limit {limit}",
        data_in.len()
    );
    match c.status {
        Status::CheckCondition => {
            let s = c.sense.expect("CHECK CONDITION without sense");
            let mut buf = [0u8; sense::SENSE_BYTES_MAX];
            let n = s.encode(&mut buf);
            assert!(
                (8..=sense::SENSE_BYTES_MAX).contains(&n),
                "sense of {n} bytes"
            );
            assert!(
                buf[0] & 0x7f == 0x70 || buf[0] & 0x7f == 0x72,
                "response code {:#x}",
                buf[0]
            );
            assert!(s.key <= 0xf);
            assert!(data_in.is_empty(), "Data-In with CHECK CONDITION");
        }
        _ => assert!(c.sense.is_none(), "sense with status {:?}", c.status),
    }
}

fuzz_target!(|input: Input| {
    let block_size = if input.block_4k { 4096 } else { 512 };
    let store = Arc::new(RamStore::new(256 * 1024));
    let mut naa = [0u8; 16];
    naa[..8].copy_from_slice(&[0x30, 1, 2, 3, 4, 5, 6, 7]);
    let identity = LuIdentity {
        vendor: "FERROSAN".into(),
        product: "FUZZ".into(),
        revision: "0001".into(),
        serial: "fuzz0001".into(),
        naa,
        naa_len: 8,
    };
    let settings = LuSettings {
        block_size,
        read_only: input.read_only,
        write_cache: input.write_cache,
        thin: input.thin,
    };
    let lu = Arc::new(LogicalUnit::new(store, identity, settings).expect("valid LU"));
    let owner = input.owner.map(|o| {
        let owner = Arc::new(FuzzOwner {
            owner: AtomicU16::new(u16::from(o % 3)),
            refuse: AtomicBool::new(false),
        });
        lu.set_ownership(owner.clone());
        owner
    });
    let map = LunMap::new(vec![
        (0, lu.clone(), false),
        (5, lu.clone(), input.mapping_read_only),
    ])
    .expect("valid map");
    let groups: Arc<[PortGroup]> = Arc::new([1u16, 2].map(|id| PortGroup {
        id,
        state: AccessState::ActiveOptimized,
        ports: vec![id],
    }));
    // Without an owner both nexuses come through one port; with one, nexus N through group N.
    let port_of = |id: u16| {
        let name = format!("iqn.2026-11.org.ferrosan:fuzz,t,0x000{id}");
        let target = "iqn.2026-11.org.ferrosan:fuzz".to_string();
        Arc::new(if owner.is_some() {
            TargetPort {
                relative_id: id,
                name,
                target_name: target,
                group: id,
                groups: groups.clone(),
                shipped: false,
            }
        } else {
            TargetPort::alone(1, name, target)
        })
    };
    let nexuses = [1u64, 2].map(|id| Nexus {
        id,
        initiator_port: format!("iqn.2026-11.org.example:i{id},i,0x800000000001"),
        target_port: port_of(id as u16),
    });
    // What a command through `nexus` may have done, given the owner before it.
    let check_alua = |nexus: &Nexus, cdb: &[u8], before: Option<u16>, c: &Completion| {
        let (Some(owner), Some(before), Some(&opcode)) = (&owner, before, cdb.first()) else {
            return;
        };
        let group = nexus.target_port.group;
        let after = owner.owner.load(Ordering::SeqCst);
        if c.status == Status::Good && MEDIUM_WRITES.contains(&opcode) {
            assert_eq!(
                before, group,
                "opcode {opcode:#x} GOOD through standby group {group}"
            );
        }
        if after != before {
            assert_eq!(
                after, group,
                "the owner moved to a group other than the sender's"
            );
            assert_eq!(opcode, 0xa4, "only SET TARGET PORT GROUPS moves the owner");
        }
    };
    let owner_now = || owner.as_ref().map(|o| o.owner.load(Ordering::SeqCst));
    for n in &nexuses {
        lu.nexus_added(n.id);
    }
    let mut data_in = Vec::new();
    for op in input.ops.iter().take(64) {
        match op {
            Op::Raw {
                nexus,
                lun,
                cdb,
                data_out,
                limit,
            } => {
                let cmd = Command {
                    cdb: &cdb[..cdb.len().min(260)],
                    data_out,
                    data_in_limit: *limit as u32,
                };
                let before = owner_now();
                let n = &nexuses[*nexus as usize];
                let lun = *lun as u64 % 8;
                let c = map.execute(n, lun, &cmd, &mut data_in);
                check(&c, &data_in, cmd.data_in_limit);
                if lun == 0 || lun == 5 {
                    check_alua(n, cmd.cdb, before, &c);
                }
                // Sense data as a peer gateway sends it back (engine::io::peer): decoding any
                // bytes never panics, and what decodes survives an encode and a decode.
                if let Some(sense) = scsi::Sense::decode(data_out) {
                    let mut buf = [0u8; scsi::sense::SENSE_BYTES_MAX];
                    let n = sense.encode(&mut buf);
                    assert_eq!(scsi::Sense::decode(&buf[..n]), Some(sense));
                }
            }
            Op::Known {
                nexus,
                opcode,
                fields,
                len,
                data_out,
                limit,
                nonblocking,
            } => {
                let mut cdb = [0u8; 16];
                cdb[0] = OPCODES[*opcode as usize % OPCODES.len()];
                cdb[1..].copy_from_slice(fields);
                let len = [6, 10, 12, 16][*len as usize % 4];
                let cmd = Command {
                    cdb: &cdb[..len],
                    data_out,
                    data_in_limit: *limit as u32,
                };
                let before = owner_now();
                let n = &nexuses[*nexus as usize];
                if *nonblocking {
                    let (mut slices, mut file) = (Vec::new(), None);
                    let lending = scsi::Lending {
                        slices: &mut slices,
                        file: &mut file,
                        file_min_bytes: 1,
                    };
                    let c = map
                        .try_execute(n, 0, &cmd, &mut data_in, lending)
                        .expect("a RAM LU never waits, so never declines");
                    assert!(file.is_none(), "a RAM store lends no file");
                    assert!(
                        slices.is_empty() || data_in.is_empty(),
                        "lent or copied, not both"
                    );
                    for (owner, range) in &slices {
                        data_in.extend_from_slice(&(**owner).as_ref()[range.clone()]);
                    }
                    check(&c, &data_in, cmd.data_in_limit);
                    check_alua(n, cmd.cdb, before, &c);
                } else {
                    let c = lu.execute(n, &cmd, &mut data_in);
                    check(&c, &data_in, cmd.data_in_limit);
                    check_alua(n, cmd.cdb, before, &c);
                }
            }
            Op::WriteRead { lba, blocks, seed } => {
                let capacity_blocks = 256 * 1024 / block_size;
                let lba = *lba as u32 % capacity_blocks;
                let blocks = (*blocks as u32 % 8).min(capacity_blocks - lba);
                let bytes = (blocks * block_size) as usize;
                let payload: Vec<u8> = (0..bytes)
                    .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                    .collect();
                let mut w = [0u8; 10];
                w[0] = 0x2a;
                w[2..6].copy_from_slice(&lba.to_be_bytes());
                w[7..9].copy_from_slice(&(blocks as u16).to_be_bytes());
                let mut r = w;
                r[0] = 0x28;
                let n = &nexuses[0];
                let before = owner_now();
                let cw = lu.execute(
                    n,
                    &Command {
                        cdb: &w,
                        data_out: &payload,
                        data_in_limit: 0,
                    },
                    &mut data_in,
                );
                check(&cw, &data_in, 0);
                check_alua(n, &w, before, &cw);
                let cr = lu.execute(
                    n,
                    &Command {
                        cdb: &r,
                        data_out: &[],
                        data_in_limit: bytes as u32,
                    },
                    &mut data_in,
                );
                check(&cr, &data_in, bytes as u32);
                if cr.status == Status::Good {
                    assert_eq!(data_in.len(), bytes);
                    assert_eq!(cr.transfer_len as usize, bytes);
                }
                if cw.status == Status::Good && cr.status == Status::Good {
                    assert!(!input.read_only, "a write succeeded on a read-only LU");
                    assert_eq!(data_in, payload, "read after write differs");
                }
            }
            Op::NexusLost(which) => {
                let n = &nexuses[*which as usize];
                lu.nexus_lost(n.id);
                lu.nexus_added(n.id);
            }
            Op::Reset(which) => lu.logical_unit_reset(nexuses[*which as usize].id),
            Op::CapacityChanged => lu.capacity_changed(),
            Op::Stpg {
                nexus,
                descriptors,
                list_len,
            } => {
                let mut list = vec![0u8; 4];
                for &(state, group) in descriptors.iter().take(4) {
                    // Mostly the two real groups and real states, now and then anything.
                    list.extend_from_slice(&[state % 16, 0, 0, group % 4]);
                }
                let len = list_len.map_or(list.len(), usize::from);
                let mut cdb = [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                cdb[6..10].copy_from_slice(&(len as u32).to_be_bytes());
                let before = owner_now();
                let n = &nexuses[*nexus as usize];
                let cmd = Command {
                    cdb: &cdb,
                    data_out: &list[..len.min(list.len())],
                    data_in_limit: 0,
                };
                let c = lu.execute(n, &cmd, &mut data_in);
                check(&c, &data_in, 0);
                check_alua(n, &cdb, before, &c);
            }
            Op::OwnerMoved(to) => {
                if let Some(o) = &owner {
                    o.owner.store(u16::from(to % 3), Ordering::SeqCst);
                    lu.access_state_changed(None);
                }
            }
            Op::Refuse(on) => {
                if let Some(o) = &owner {
                    o.refuse.store(*on, Ordering::SeqCst);
                }
            }
        }
    }
});
