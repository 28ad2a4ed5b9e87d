//! A host that writes and verifies a LUN through all of its paths and retries as a host's SCSI
//! layer and multipath do, for soaks where the paths' owner changes under the I/O
//! (`scripts/soak.sh --gateways`). fio's libiscsi engine fails a job at the first NOT READY,
//! ASYMMETRIC ACCESS STATE TRANSITION that a takeover answers; a kernel host retries it.
//!
//!   verify_io SECONDS REGION_MIB THREADS IQN PORTAL [PORTAL...]
//!
//! Each thread owns a slice of LUN 0's first REGION_MIB MiB. It writes 4-64 KiB at random in
//! its slice, every block stamped with its LBA and a generation and filled from both; every
//! fourth command reads a range back and checks each written block. Commands alternate between
//! the portals (round robin). NOT READY, UNIT ATTENTION and ABORTED COMMAND are retried on the
//! same path, a lost or refused connection on the next one, for up to 60 s per command. When
//! the time is up every block written is read back and checked. Prints one JSON line of counts;
//! exits 1 when a block reads back wrong or a command fails for good.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use initiator::driver::{Client, StatusError};
use initiator::{ClientConfig, SessionConfig, SessionKind};

const INITIATOR: &str = "iqn.2026-12.org.ferrosan:verify-io";
/// How long one command may take, retries included, before the run fails.
const GIVE_UP: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Counts {
    writes: u64,
    reads: u64,
    verified_blocks: u64,
    /// NOT READY answers retried (a takeover's ASYMMETRIC ACCESS STATE TRANSITION).
    not_ready: u64,
    unit_attention: u64,
    aborted: u64,
    /// Commands moved to another path after a lost connection or a failed login.
    path_switches: u64,
    /// The longest a command took, retries included.
    worst_ms: u64,
    /// Commands that took longer than a second.
    over_1s: u64,
}

enum Op<'a> {
    Read { lba: u64, blocks: u32 },
    Write { lba: u64, data: &'a [u8] },
}

/// One thread's sessions (one per portal) and what it wrote.
struct Host {
    portals: Vec<String>,
    iqn: String,
    paths: Vec<Option<Client>>,
    next: usize,
    counts: Counts,
}

impl Host {
    fn client(&mut self, path: usize) -> Result<&mut Client, String> {
        if self.paths[path].is_none() {
            let mut session = SessionConfig::new(
                INITIATOR,
                SessionKind::Normal {
                    target_name: self.iqn.clone(),
                },
            );
            session.command_timeout = Duration::from_secs(30);
            let mut config = ClientConfig::new(self.portals[path].clone(), session);
            config.timeouts.login = Duration::from_secs(5);
            config.retries = 3;
            config.retry_unit_attention = true;
            let client = Client::connect(config).map_err(|e| e.to_string())?;
            self.paths[path] = Some(client);
        }
        self.paths[path].as_mut().ok_or_else(|| "no session".into())
    }

    /// Runs one command to GOOD, retrying as a host does; the data read, if any.
    fn run(&mut self, op: &Op) -> Result<Vec<u8>, String> {
        let start = Instant::now();
        self.next = (self.next + 1) % self.paths.len();
        let mut path = self.next;
        let result = loop {
            let outcome = self.client(path).and_then(|c| {
                match op {
                    Op::Read { lba, blocks } => c.read(*lba, *blocks),
                    Op::Write { lba, data } => c.write(*lba, data).map(|r| r.map(|()| Vec::new())),
                }
                .map_err(|e| e.to_string())
            });
            let why = match outcome {
                Ok(Ok(data)) => break Ok(data),
                Ok(Err(status)) => match self.retryable(&status) {
                    Some(()) => format!("{status:?}"),
                    None => break Err(format!("path {path}: status {status:?}")),
                },
                Err(e) => {
                    self.paths[path] = None;
                    path = (path + 1) % self.paths.len();
                    self.counts.path_switches += 1;
                    e
                }
            };
            if start.elapsed() > GIVE_UP {
                break Err(format!("no GOOD within {GIVE_UP:?}: {why}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let ms = start.elapsed().as_millis() as u64;
        self.counts.worst_ms = self.counts.worst_ms.max(ms);
        self.counts.over_1s += u64::from(ms > 1000);
        result
    }

    /// Whether a host retries this status (counted), as Linux's SCSI layer and multipath do.
    fn retryable(&mut self, status: &StatusError) -> Option<()> {
        match status.sense.as_ref().map(|s| s.key) {
            Some(0x02) => self.counts.not_ready += 1,
            Some(0x06) => self.counts.unit_attention += 1,
            Some(0x0b) => self.counts.aborted += 1,
            _ => return None,
        }
        Some(())
    }
}

/// The content of block `lba` at generation `generation`: both stamped in front, the rest
/// from a generator seeded by them.
fn fill(block: &mut [u8], lba: u64, generation: u32) {
    block[..8].copy_from_slice(&lba.to_le_bytes());
    block[8..12].copy_from_slice(&generation.to_le_bytes());
    let mut x = lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(generation) ^ 1;
    for chunk in block[12..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One thread: random writes and read-backs over the `len` blocks from `first` until `until`,
/// then every written block read back. Returns its counts, or the first error.
fn worker(mut host: Host, first: u64, len: u64, bs: u32, until: Instant) -> Result<Counts, String> {
    let blocks = 64 * 1024 / u64::from(bs);
    let mut gens = vec![0u32; len as usize];
    let mut seed = [0u8; 8];
    initiator::driver::random_bytes(&mut seed);
    let mut rng = Xorshift(u64::from_le_bytes(seed) | 1);
    let mut buf = vec![0u8; 64 * 1024];
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let count = 1 + rng.below(blocks);
        let at = rng.below(len - count + 1);
        if n.is_multiple_of(4) {
            check(&mut host, &gens, first, at, count as u32, bs)?;
            continue;
        }
        for i in 0..count {
            let g = &mut gens[(at + i) as usize];
            *g += 1;
            let b = i as usize * bs as usize;
            fill(&mut buf[b..b + bs as usize], first + at + i, *g);
        }
        let data = &buf[..(count * u64::from(bs)) as usize];
        host.run(&Op::Write {
            lba: first + at,
            data,
        })?;
        host.counts.writes += 1;
    }
    for at in (0..len).step_by(blocks as usize) {
        check(&mut host, &gens, first, at, blocks.min(len - at) as u32, bs)?;
    }
    Ok(host.counts)
}

/// Reads `count` blocks at slice offset `at` and checks every block written so far.
fn check(
    h: &mut Host,
    gens: &[u32],
    first: u64,
    at: u64,
    count: u32,
    bs: u32,
) -> Result<(), String> {
    let data = h.run(&Op::Read {
        lba: first + at,
        blocks: count,
    })?;
    h.counts.reads += 1;
    let mut want = vec![0u8; bs as usize];
    for (i, got) in data.chunks(bs as usize).enumerate() {
        let (lba, g) = (first + at + i as u64, gens[at as usize + i]);
        if g == 0 {
            continue;
        }
        fill(&mut want, lba, g);
        if got != want.as_slice() {
            let stamp = |r: std::ops::Range<usize>| got.get(r).map(|b| b.to_vec());
            return Err(format!(
                "block {lba} reads back wrong: want generation {g}, found a block stamped LBA \
                 {:?} generation {:?} (little-endian bytes)",
                stamp(0..8),
                stamp(8..12)
            ));
        }
        h.counts.verified_blocks += 1;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: verify_io SECONDS REGION_MIB THREADS IQN PORTAL [PORTAL...]";
    let (Some(secs), Some(region), Some(threads)) = (
        args.first().and_then(|s| s.parse::<u64>().ok()),
        args.get(1).and_then(|s| s.parse::<u64>().ok()),
        args.get(2).and_then(|s| s.parse::<u64>().ok()),
    ) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    if args.len() < 5 || threads == 0 || region < threads {
        eprintln!("{usage} (each thread needs a MiB of the region)");
        return ExitCode::from(2);
    }
    match run(secs, region, threads, &args[3], &args[4..]) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("verify_io: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts the threads, waits for them, adds up their counts as a JSON line.
fn run(
    secs: u64,
    region_mib: u64,
    threads: u64,
    iqn: &str,
    portals: &[String],
) -> Result<String, String> {
    let host = || Host {
        portals: portals.to_vec(),
        iqn: iqn.to_string(),
        paths: portals.iter().map(|_| None).collect(),
        next: 0,
        counts: Counts::default(),
    };
    let mut probe = host();
    let capacity = probe
        .client(0)?
        .read_capacity()
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("READ CAPACITY: {e:?}"))?;
    let bs = capacity.block_size;
    if !(512..=65536).contains(&bs) || capacity.bytes() < region_mib << 20 {
        return Err(format!(
            "block size {bs}, {} bytes: too small a LUN",
            capacity.bytes()
        ));
    }
    let slice = (region_mib << 20) / threads / u64::from(bs);
    let until = Instant::now() + Duration::from_secs(secs);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let h = host();
            std::thread::spawn(move || worker(h, t * slice, slice, bs, until))
        })
        .collect();
    let mut total = Counts::default();
    for h in handles {
        let c = h.join().map_err(|_| "a thread panicked".to_string())??;
        total.writes += c.writes;
        total.reads += c.reads;
        total.verified_blocks += c.verified_blocks;
        total.not_ready += c.not_ready;
        total.unit_attention += c.unit_attention;
        total.aborted += c.aborted;
        total.path_switches += c.path_switches;
        total.worst_ms = total.worst_ms.max(c.worst_ms);
        total.over_1s += c.over_1s;
    }
    if total.writes == 0 || total.verified_blocks == 0 {
        return Err("nothing was written or verified".into());
    }
    Ok(format!(
        "{{\"writes\": {}, \"reads\": {}, \"verified_mib\": {:.1}, \"not_ready\": {}, \
         \"unit_attention\": {}, \"aborted\": {}, \"path_switches\": {}, \"worst_ms\": {}, \
         \"over_1s\": {}}}",
        total.writes,
        total.reads,
        (total.verified_blocks * u64::from(bs)) as f64 / 1048576.0,
        total.not_ready,
        total.unit_attention,
        total.aborted,
        total.path_switches,
        total.worst_ms,
        total.over_1s
    ))
}
