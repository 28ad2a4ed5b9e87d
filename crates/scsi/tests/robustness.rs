//! Arbitrary CDBs and parameter lists never panic and always produce a well-formed completion.
mod common;
use common::*;
use scsi::sense::SENSE_BYTES_MAX;
use scsi::{Command, LunMap, Status};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

const OPCODES: &[u8] = &[
    0x00, 0x03, 0x08, 0x0A, 0x12, 0x15, 0x1A, 0x1B, 0x1E, 0x25, 0x28, 0x2A, 0x2E, 0x2F, 0x34, 0x35,
    0x37, 0x41, 0x42, 0x55, 0x5A, 0x88, 0x89, 0x8A, 0x8E, 0x8F, 0x90, 0x91, 0x93, 0x9E, 0xA0, 0xA3,
    0xA8, 0xAA, 0xAE, 0xAF, 0xB7,
];

#[test]
fn random_commands_never_panic() {
    let t = T::new();
    let map = LunMap::new(vec![(0, t.lu.clone(), false), (1, t.lu.clone(), true)]).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut data_in = Vec::new();
    let mut sense = [0u8; SENSE_BYTES_MAX];
    for i in 0..20_000u32 {
        let len = (rng.next() % 17) as usize;
        let mut cdb: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
        if let Some(first) = cdb.first_mut() {
            *first = OPCODES[(rng.next() % OPCODES.len() as u64) as usize];
        }
        // Keep most transfers small so the run stays fast, but let some be wild.
        if i % 4 != 0 {
            for b in cdb.iter_mut().skip(5).take(5) {
                *b &= 0x03;
            }
        }
        let out_len = (rng.next() % 2048) as usize;
        let mut data_out: Vec<u8> = (0..out_len).map(|_| rng.byte()).collect();
        if i % 3 == 0 {
            data_out.iter_mut().skip(8).for_each(|b| *b &= 0x01);
        }
        let limit = (rng.next() % 70_000) as u32;
        let cmd = Command {
            cdb: &cdb,
            data_out: &data_out,
            data_in_limit: limit,
        };
        let lun = rng.next() % 3;
        let c = map.execute(&nexus(i as u64 % 3), lun, &cmd, &mut data_in);
        assert!(data_in.len() <= limit as usize);
        match c.status {
            Status::Good => assert!(c.sense.is_none()),
            Status::CheckCondition => {
                let n = c.sense.expect("sense").encode(&mut sense);
                assert!((8..=SENSE_BYTES_MAX).contains(&n));
                assert!(data_in.is_empty());
            }
            other => panic!("unexpected status {other:?}"),
        }
    }
}
