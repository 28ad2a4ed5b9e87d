//! SIGKILL during writes loses nothing that was acknowledged.
//!
//! A minimal initiator (PDUs from the `iscsi` crate) writes numbered, checksummed 4 KiB blocks
//! with WRITE(10) + immediate data and counts a block as acknowledged only when its SCSI Response
//! says GOOD. The daemon is killed with SIGKILL mid-stream, restarted on the same file, and every
//! acknowledged block is read back over iSCSI and verified. A second test does the same on a
//! write-back LU (write_cache = true, from a config file) with SYNCHRONIZE CACHE as the
//! durability point.
//!
//! What this proves: nothing acknowledged is held only in the daemon's memory. SIGKILL keeps
//! the kernel's page cache, so it does not prove durability against power loss (the fsync /
//! fdatasync calls behind write-through and SYNCHRONIZE CACHE are unit-tested in `store`).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{free_port, Scratch, STARTUP_TIMEOUT};
use iscsi::pdu::{encode_into, off, Bhs, Framing, Opcode, BHS_LEN};

const IQN: &str = "iqn.2026-11.org.ferrosan:crash";
const BLOCK: usize = 4096;
const SECTORS_PER_BLOCK: u16 = (BLOCK / 512) as u16;
/// Blocks are written round-robin over this many slots, so later writes overwrite earlier ones.
const SLOTS: u64 = 128;
const LUN_BYTES: &str = "16M";

// ---- a daemon we can SIGKILL -------------------------------------------------------------------

/// The shared harness stops with SIGTERM; this test needs SIGKILL at a moment of its choosing.
struct Killable {
    child: Option<Child>,
    args: Vec<String>,
    port: u16,
    log: std::path::PathBuf,
}

impl Killable {
    fn start(args: Vec<String>, port: u16, log: std::path::PathBuf) -> Killable {
        let mut d = Killable {
            child: None,
            args,
            port,
            log,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_ferrosan"))
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn ferrosan");
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("ferrosan exited ({status}):\n{}", self.output());
            }
            assert!(
                Instant::now() < deadline,
                "ferrosan did not start:\n{}",
                self.output()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL (Child::kill) and reap.
    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        let status = child.wait().unwrap();
        assert!(!status.success(), "killed daemon reported success");
    }

    fn output(&self) -> String {
        common::read_lossy(&self.log)
    }
}

impl Drop for Killable {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---- a minimal initiator -----------------------------------------------------------------------

struct Initiator {
    stream: TcpStream,
    cmd_sn: u32,
    exp_stat_sn: u32,
    itt: u32,
}

/// Why a command did not complete.
#[derive(Debug)]
enum Failure {
    /// The connection closed or failed (e.g. the daemon was killed).
    Connection,
    Status(u8),
}

fn read_pdu(stream: &mut TcpStream) -> Result<(Bhs, Vec<u8>), Failure> {
    let mut header = [0u8; BHS_LEN];
    stream
        .read_exact(&mut header)
        .map_err(|_| Failure::Connection)?;
    let bhs = Bhs(header);
    let ahs = bhs.total_ahs_len();
    let dsl = bhs.data_segment_len();
    let mut rest = vec![0u8; ahs + ((dsl + 3) & !3)];
    stream
        .read_exact(&mut rest)
        .map_err(|_| Failure::Connection)?;
    Ok((bhs, rest[ahs..ahs + dsl].to_vec()))
}

impl Initiator {
    fn login(port: u16) -> Initiator {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let text = format!(
            "InitiatorName=iqn.2026-11.org.example:crash\0TargetName={IQN}\0\
             SessionType=Normal\0HeaderDigest=None\0DataDigest=None\0ImmediateData=Yes\0\
             MaxRecvDataSegmentLength=262144\0"
        );
        let bhs = iscsi::pdu::LoginRequest {
            csg: 1,
            transit_to: Some(3),
            continues: false,
            isid: [0x80, 0xc4, 0x54, 0, 0, 1],
            tsih: 0,
            itt: 1,
            cid: 0,
            cmd_sn: 1,
            exp_stat_sn: 0,
        }
        .bhs();
        let mut out = Vec::new();
        encode_into(&mut out, &bhs, text.as_bytes(), &Framing::LOGIN);
        stream.write_all(&out).unwrap();
        let (resp, data) = read_pdu(&mut stream).expect("login response");
        assert_eq!(resp.opcode_raw(), Opcode::LoginResponse as u8);
        assert_eq!(
            (resp.byte(off::STATUS_CLASS), resp.byte(off::STATUS_DETAIL)),
            (0, 0),
            "login: {}",
            String::from_utf8_lossy(&data)
        );
        Initiator {
            stream,
            cmd_sn: resp.u32_at(off::EXP_CMD_SN),
            exp_stat_sn: resp.u32_at(off::STAT_SN).wrapping_add(1),
            itt: 0x100,
        }
    }

    /// Sends one SCSI command and waits for its status; Data-In is collected into the result.
    fn command(&mut self, cdb: &[u8], data_out: &[u8], read_len: u32) -> Result<Vec<u8>, Failure> {
        self.itt = self.itt.wrapping_add(1);
        let mut bhs = Bhs::new(Opcode::ScsiCommand);
        let mut flags = 0x80u8 | 0x01; // F, SIMPLE
        if !data_out.is_empty() {
            flags |= 0x20;
        }
        if read_len > 0 {
            flags |= 0x40;
        }
        bhs.set_flags(flags);
        bhs.set_itt(self.itt);
        bhs.set_u32(
            off::EDTL,
            if data_out.is_empty() {
                read_len
            } else {
                data_out.len() as u32
            },
        );
        bhs.set_u32(off::CMD_SN, self.cmd_sn);
        bhs.set_u32(off::EXP_STAT_SN, self.exp_stat_sn);
        bhs.0[off::CDB..off::CDB + cdb.len()].copy_from_slice(cdb);
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        let mut out = Vec::new();
        let framing = Framing {
            max_data_segment_len: 262_144,
            ..Framing::LOGIN
        };
        encode_into(&mut out, &bhs, data_out, &framing);
        self.stream
            .write_all(&out)
            .map_err(|_| Failure::Connection)?;
        let mut data = vec![0u8; read_len as usize];
        loop {
            let (resp, payload) = read_pdu(&mut self.stream)?;
            match Opcode::from_target(resp.opcode_raw()) {
                Some(Opcode::DataIn) => {
                    assert_eq!(resp.itt(), self.itt);
                    let offset = resp.u32_at(off::BUFFER_OFFSET) as usize;
                    data[offset..offset + payload.len()].copy_from_slice(&payload);
                    if resp.flags() & 0x01 != 0 {
                        self.exp_stat_sn = resp.u32_at(off::STAT_SN).wrapping_add(1);
                        return match resp.byte(off::STATUS) {
                            0 => Ok(data),
                            s => Err(Failure::Status(s)),
                        };
                    }
                }
                Some(Opcode::ScsiResponse) => {
                    assert_eq!(resp.itt(), self.itt);
                    self.exp_stat_sn = resp.u32_at(off::STAT_SN).wrapping_add(1);
                    return match (resp.byte(off::RESPONSE), resp.byte(off::STATUS)) {
                        (0, 0) => Ok(data),
                        (_, s) => Err(Failure::Status(s)),
                    };
                }
                // NOP-In pings (none expected this fast) and anything else: keep reading.
                Some(Opcode::NopIn) if resp.itt() == 0xffff_ffff => {
                    let mut nop = Bhs::new(Opcode::NopOut);
                    nop.set_immediate(true);
                    nop.set_flags(0x80);
                    nop.set_itt(0xffff_ffff);
                    nop.set_u32(off::TTT, resp.u32_at(off::TTT));
                    nop.set_u32(off::CMD_SN, self.cmd_sn);
                    let mut out = Vec::new();
                    encode_into(&mut out, &nop, &[], &Framing::LOGIN);
                    self.stream
                        .write_all(&out)
                        .map_err(|_| Failure::Connection)?;
                }
                other => panic!("unexpected PDU {other:?}: {resp:?}"),
            }
        }
    }

    fn write_block(&mut self, slot: u64, block: &[u8]) -> Result<(), Failure> {
        let lba = (slot * u64::from(SECTORS_PER_BLOCK)) as u32;
        let mut cdb = [0u8; 10];
        cdb[0] = 0x2a;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&SECTORS_PER_BLOCK.to_be_bytes());
        // CHECK CONDITION (the first command of a nexus gets a unit attention) is not an
        // acknowledgement: retry.
        for _ in 0..3 {
            match self.command(&cdb, block, 0) {
                Err(Failure::Status(2)) => continue,
                other => return other.map(|_| ()),
            }
        }
        Err(Failure::Status(2))
    }

    fn read_block(&mut self, slot: u64) -> Vec<u8> {
        let lba = (slot * u64::from(SECTORS_PER_BLOCK)) as u32;
        let mut cdb = [0u8; 10];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&SECTORS_PER_BLOCK.to_be_bytes());
        // A restarted LU reports a unit attention (power on / reset) once: retry past it.
        for _ in 0..3 {
            match self.command(&cdb, &[], BLOCK as u32) {
                Ok(data) => return data,
                Err(Failure::Status(2)) => continue,
                Err(e) => panic!("READ of slot {slot}: {e:?}"),
            }
        }
        panic!("READ of slot {slot} kept failing");
    }

    fn synchronize_cache(&mut self) -> Result<(), Failure> {
        for _ in 0..3 {
            match self.command(&[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[], 0) {
                Err(Failure::Status(2)) => continue,
                other => return other.map(|_| ()),
            }
        }
        Err(Failure::Status(2))
    }
}

// ---- numbered, checksummed blocks --------------------------------------------------------------

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Block `seq`: "FSCRASH1", seq, slot, payload, and an FNV-1a checksum over everything before.
fn block(seq: u64) -> Vec<u8> {
    let mut b = common::pseudo_random_bytes(BLOCK, seq.wrapping_mul(0x9e37_79b9) ^ 0xc4a5);
    b[..8].copy_from_slice(b"FSCRASH1");
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b[16..24].copy_from_slice(&(seq % SLOTS).to_le_bytes());
    let sum = fnv1a(&b[..BLOCK - 8]);
    b[BLOCK - 8..].copy_from_slice(&sum.to_le_bytes());
    b
}

/// The sequence number of a valid block, or None for zeros/garbage.
fn decode(b: &[u8]) -> Option<u64> {
    if &b[..8] != b"FSCRASH1" {
        return None;
    }
    let sum = u64::from_le_bytes(b[BLOCK - 8..].try_into().unwrap());
    if fnv1a(&b[..BLOCK - 8]) != sum {
        return None;
    }
    let seq = u64::from_le_bytes(b[8..16].try_into().unwrap());
    (block(seq) == b).then_some(seq)
}

#[derive(Default)]
struct Progress {
    /// Highest acknowledged sequence number per slot.
    acked: Vec<Option<u64>>,
    /// The write that was in flight when the connection failed (it may or may not have landed).
    in_flight: Option<u64>,
    total_acked: u64,
}

/// Writes blocks 0, 1, 2, ... until the connection fails; records what was acknowledged.
fn writer(port: u16, progress: Arc<Mutex<Progress>>, sync_every: Option<u64>) {
    let mut c = Initiator::login(port);
    let mut pending_sync: Vec<u64> = Vec::new();
    for seq in 0.. {
        let slot = seq % SLOTS;
        progress.lock().unwrap().in_flight = Some(seq);
        if c.write_block(slot, &block(seq)).is_err() {
            return;
        }
        match sync_every {
            None => record(&progress, seq),
            Some(n) => {
                // Write-back: only what a later SYNCHRONIZE CACHE covered is acknowledged.
                pending_sync.push(seq);
                if seq % n == n - 1 {
                    progress.lock().unwrap().in_flight = None;
                    if c.synchronize_cache().is_err() {
                        // Still unsure: all of these may or may not have landed.
                        return;
                    }
                    for s in pending_sync.drain(..) {
                        record(&progress, s);
                    }
                }
            }
        }
    }
}

fn record(progress: &Mutex<Progress>, seq: u64) {
    let mut p = progress.lock().unwrap();
    let slot = (seq % SLOTS) as usize;
    p.acked[slot] = Some(p.acked[slot].map_or(seq, |s| s.max(seq)));
    p.in_flight = None;
    p.total_acked += 1;
}

fn run_crash(args: Vec<String>, port: u16, scratch: &Scratch, sync_every: Option<u64>) -> u64 {
    let mut daemon = Killable::start(args, port, scratch.file("daemon.log"));
    let progress = Arc::new(Mutex::new(Progress {
        acked: vec![None; SLOTS as usize],
        ..Progress::default()
    }));
    let done = Arc::new(AtomicBool::new(false));
    let w = {
        let (progress, done) = (progress.clone(), done.clone());
        thread::spawn(move || {
            writer(port, progress, sync_every);
            done.store(true, Ordering::SeqCst);
        })
    };
    // Let it write (and overwrite every slot at least once), then kill it mid-stream.
    let deadline = Instant::now() + Duration::from_secs(20);
    while progress.lock().unwrap().total_acked < 3 * SLOTS {
        assert!(
            !done.load(Ordering::SeqCst),
            "writer stopped early:\n{}",
            daemon.output()
        );
        assert!(
            Instant::now() < deadline,
            "too slow: {} blocks acknowledged in 20 s",
            progress.lock().unwrap().total_acked
        );
        thread::sleep(Duration::from_millis(10));
    }
    daemon.kill9();
    w.join().expect("writer thread");
    let p = progress.lock().unwrap();

    daemon.spawn();
    let mut c = Initiator::login(port);
    let mut verified = 0;
    for slot in 0..SLOTS {
        let Some(acked) = p.acked[slot as usize] else {
            continue;
        };
        let data = c.read_block(slot);
        let found = decode(&data).unwrap_or_else(|| {
            panic!("slot {slot}: acknowledged block {acked} lost; found garbage or zeros")
        });
        assert_eq!(found % SLOTS, slot, "block {found} in slot {slot}");
        // The newest acknowledged write, or a newer one that was in flight (or, for write-back,
        // written but not yet covered by a SYNCHRONIZE CACHE).
        let newer_ok = match sync_every {
            None => p.in_flight == Some(found),
            Some(_) => found > acked,
        };
        assert!(
            found == acked || (found > acked && newer_ok),
            "slot {slot}: acknowledged block {acked}, found block {found} (in flight: {:?})",
            p.in_flight
        );
        verified += 1;
    }
    assert_eq!(verified, SLOTS, "every slot was acknowledged at least once");
    p.total_acked
}

fn serve_file_args(port: u16, path: &Path, cache: &str) -> Vec<String> {
    vec![
        "serve".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--target".into(),
        IQN.into(),
        "--lun".into(),
        format!("file:{},size={LUN_BYTES},cache={cache}", path.display()),
    ]
}

/// Where the LUN file lives: direct I/O needs a disk filesystem (cargo's scratch dir beside
/// the build; the temp dir may be tmpfs), the page cache works anywhere.
fn lun_file(scratch: &Scratch, cache: &str, tag: &str) -> std::path::PathBuf {
    if cache != "direct" {
        return scratch.file("lun.img");
    }
    common::disk_dir(&format!("crash-{tag}")).join("lun.img")
}

fn write_through(cache: &str) {
    let scratch = Scratch::new(&format!("crash-wt-{cache}"));
    let port = free_port();
    let image = lun_file(&scratch, cache, "wt");
    let args = serve_file_args(port, &image, cache);
    let acked = run_crash(args, port, &scratch, None);
    eprintln!("write-through ({cache}): {acked} acknowledged 4 KiB writes survived SIGKILL");
    if cache == "direct" {
        let _ = std::fs::remove_dir_all(image.parent().unwrap());
    }
}

fn write_back(cache: &str) {
    let scratch = Scratch::new(&format!("crash-wb-{cache}"));
    let port = free_port();
    let config = scratch.file("ferrosan.toml");
    let image = lun_file(&scratch, cache, "wb");
    std::fs::write(
        &config,
        format!(
            r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:{port}"]

[[device]]
name = "wb"
store = "file"
path = "{}"
size = "{LUN_BYTES}"
write_cache = true
cache = "{cache}"

[[target]]
iqn = "{IQN}"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "wb" }} ]
"#,
            image.display()
        ),
    )
    .unwrap();
    let args = vec![
        "serve".into(),
        "--config".into(),
        config.display().to_string(),
    ];
    let acked = run_crash(args, port, &scratch, Some(16));
    eprintln!("write-back ({cache}): {acked} writes covered by SYNCHRONIZE CACHE survived SIGKILL");
    if cache == "direct" {
        let _ = std::fs::remove_dir_all(image.parent().unwrap());
    }
}

#[test]
fn sigkill_during_write_through_writes_loses_nothing_acknowledged() {
    write_through("page");
}

#[test]
fn sigkill_during_direct_write_through_writes_loses_nothing_acknowledged() {
    write_through("direct");
}

#[test]
fn sigkill_after_synchronize_cache_on_write_back_loses_nothing() {
    write_back("page");
}

#[test]
fn sigkill_after_synchronize_cache_on_direct_write_back_loses_nothing() {
    write_back("direct");
}
