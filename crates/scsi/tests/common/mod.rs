//! Shared harness: a RAM-backed LU, a nexus, CDB builders and sense assertions.
#![allow(dead_code)]

use scsi::{
    Command, Completion, LogicalUnit, LuIdentity, LuSettings, Nexus, Sense, Status, TargetPort,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use store::{BlockStore, Extent, RamStore};

/// Wraps a store and records durability requests.
pub struct Recording {
    pub inner: RamStore,
    pub durable_writes: AtomicUsize,
    pub plain_writes: AtomicUsize,
    pub flushes: AtomicUsize,
    pub log: Mutex<Vec<&'static str>>,
    /// While set, non-blocking writes are declined after writing their first half, as the
    /// kernel can leave an RWF_NOWAIT write.
    pub busy: AtomicBool,
    /// Bytes whose reads fail with EIO (a bad range of a disk), and how many such reads may
    /// still fail (a flaky device; `usize::MAX`: every one).
    pub unreadable: Mutex<std::ops::Range<u64>>,
    pub failures_left: AtomicUsize,
}

impl Recording {
    pub fn new(bytes: u64) -> Recording {
        Recording {
            inner: RamStore::new(bytes),
            durable_writes: AtomicUsize::new(0),
            plain_writes: AtomicUsize::new(0),
            flushes: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
            busy: AtomicBool::new(false),
            unreadable: Mutex::new(0..0),
            failures_left: AtomicUsize::new(usize::MAX),
        }
    }

    /// Reads touching `range` fail with EIO, `times` times in all.
    pub fn fail_reads(&self, range: std::ops::Range<u64>, times: usize) {
        *self.unreadable.lock().unwrap() = range;
        self.failures_left.store(times, Ordering::SeqCst);
    }

    fn read_fails(&self, len: usize, offset: u64) -> bool {
        let bad = self.unreadable.lock().unwrap().clone();
        let touches = offset < bad.end && bad.start < offset + len as u64;
        touches
            && self
                .failures_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    }
}

impl BlockStore for Recording {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn capabilities(&self) -> store::Capabilities {
        self.inner.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if self.read_fails(buf.len(), offset) {
            return Err(std::io::Error::from_raw_os_error(5));
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, durable: bool) -> std::io::Result<()> {
        if durable {
            self.durable_writes.fetch_add(1, Ordering::SeqCst);
        } else {
            self.plain_writes.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.write_at(buf, offset, durable)
    }
    fn try_write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<bool> {
        if self.busy.load(Ordering::SeqCst) {
            self.inner.write_at(&buf[..buf.len() / 2], offset, false)?;
            return Ok(false);
        }
        self.write_at(buf, offset, false).map(|()| true)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.log.lock().unwrap().push("discard");
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.log.lock().unwrap().push(if deallocate {
            "zeroes+dealloc"
        } else {
            "zeroes"
        });
        self.inner.write_zeroes(offset, len, deallocate)
    }
    fn mapping(&self, offset: u64) -> std::io::Result<Extent> {
        self.inner.mapping(offset)
    }
    fn is_thin(&self) -> bool {
        true
    }
}

pub fn identity() -> LuIdentity {
    let mut naa = [0u8; 16];
    naa[..8].copy_from_slice(&[0x50, 0x01, 0x40, 0x50, 0x12, 0x34, 0x56, 0x78]);
    LuIdentity {
        vendor: "FERROSAN".into(),
        product: "RAM DISK".into(),
        revision: "0001".into(),
        serial: "fs0001".into(),
        naa,
        naa_len: 8,
    }
}

pub fn nexus(id: u64) -> Nexus {
    Nexus {
        id,
        initiator_port: format!("iqn.1994-05.com.example:host{id},i,0x00023d000001"),
        target_port: Arc::new(TargetPort::alone(
            1,
            "iqn.2026-11.org.ferrosan:demo,t,0x0001".into(),
            "iqn.2026-11.org.ferrosan:demo".into(),
        )),
    }
}

pub const MIB: u64 = 1 << 20;

pub struct T {
    pub lu: Arc<LogicalUnit>,
    pub store: Arc<Recording>,
    pub nexus: Nexus,
    pub data_in: Vec<u8>,
    pub limit: u32,
}

impl T {
    pub fn with(settings: LuSettings, bytes: u64) -> T {
        let store = Arc::new(Recording::new(bytes));
        let lu = Arc::new(LogicalUnit::new(store.clone(), identity(), settings).unwrap());
        T {
            lu,
            store,
            nexus: nexus(1),
            data_in: Vec::new(),
            limit: 1 << 24,
        }
    }
    /// 512-byte blocks, 4 MiB (8192 blocks), thin, write cache on.
    pub fn new() -> T {
        T::with(LuSettings::default(), 4 * MIB)
    }
    pub fn blocks(&self) -> u64 {
        4 * MIB / 512
    }
    pub fn run(&mut self, cdb: &[u8], data_out: &[u8]) -> Completion {
        let cmd = Command {
            cdb,
            data_out,
            data_in_limit: self.limit,
        };
        let c = self.lu.execute(&self.nexus, &cmd, &mut self.data_in);
        assert!(self.data_in.len() <= self.limit as usize);
        c
    }
    pub fn ok(&mut self, cdb: &[u8], data_out: &[u8]) -> Vec<u8> {
        let c = self.run(cdb, data_out);
        assert_eq!(c.status, Status::Good, "cdb {cdb:02x?}: {:?}", c.sense);
        assert!(c.sense.is_none());
        self.data_in.clone()
    }
    pub fn err(&mut self, cdb: &[u8], data_out: &[u8]) -> Sense {
        let c = self.run(cdb, data_out);
        assert_eq!(
            c.status,
            Status::CheckCondition,
            "cdb {cdb:02x?} unexpectedly good"
        );
        assert!(self.data_in.is_empty());
        c.sense.expect("check condition carries sense")
    }
}

pub fn assert_sense(s: &Sense, key: u8, asc: u8, ascq: u8) {
    assert_eq!((s.key, s.asc, s.ascq), (key, asc, ascq), "sense {s:?}");
}
pub fn invalid_cdb(s: &Sense) {
    assert_sense(s, 0x05, 0x24, 0x00);
    assert!(
        s.sense_key_specific.is_some_and(|f| f[0] & 0xC0 == 0xC0),
        "{s:?}"
    );
}
pub fn lba_oob(s: &Sense) {
    assert_sense(s, 0x05, 0x21, 0x00);
}

pub fn read10(lba: u32, n: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x28;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&n.to_be_bytes());
    c
}
pub fn write10(lba: u32, n: u16) -> [u8; 10] {
    let mut c = read10(lba, n);
    c[0] = 0x2A;
    c
}
pub fn cdb12(op: u8, lba: u32, n: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[6..10].copy_from_slice(&n.to_be_bytes());
    c
}
pub fn cdb16(op: u8, lba: u64, n: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&n.to_be_bytes());
    c
}
pub fn cdb10(op: u8, lba: u32, n: u16) -> [u8; 10] {
    let mut c = read10(lba, n);
    c[0] = op;
    c
}
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
