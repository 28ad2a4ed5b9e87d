//! An ESXi-style full clone through EXTENDED COPY (LID1), timed: the whole of LUN SRC copied
//! onto LUN DST in segments of SEGMENT bytes (ESXi's DataMover.MaxHWTransferSize, 4 MiB by
//! default), QD commands in flight, one block-to-block segment per command as ESXi sends
//! them; then both LUNs read back and compared. Prints one JSON line. Used by
//! bench/xcopy.sh.
//!
//!     xcopy HOST:PORT IQN SRC_LUN DST_LUN SEGMENT_BYTES QD [fill]
//!
//! `fill` first writes pseudo-random data over the whole source (a RAM LUN starts empty).

use std::time::Instant;

use initiator::driver::Connection;
use initiator::scsi::{inquiry, read16, read_capacity16, write16, Cdb};
use initiator::{ClientConfig, Command, SessionConfig, SessionKind};

fn die(what: &str) -> ! {
    eprintln!("xcopy: {what}");
    std::process::exit(1)
}

fn run(c: &mut Connection, cmd: Command) -> Vec<u8> {
    for _ in 0..4 {
        let done = c.run(cmd.clone()).unwrap_or_else(|e| die(&format!("{e}")));
        let r = done.result.unwrap_or_else(|e| die(&format!("{e:?}")));
        if r.is_good() {
            return r.data;
        }
        if !r.is_unit_attention() {
            die(&format!("status {:#x}, sense {:?}", r.status, r.sense));
        }
    }
    die("unit attentions without end")
}

/// The LU's NAA designator (VPD 83h, designator type 3).
fn naa(c: &mut Connection, lun: u64) -> Vec<u8> {
    let page = run(c, Command::read(1, lun, inquiry(Some(0x83), 255), 255));
    let mut at = 4;
    while at + 4 <= page.len() {
        let (kind, len) = (page[at + 1] & 0x0F, usize::from(page[at + 3]));
        if kind == 3 {
            return page[at + 4..at + 4 + len].to_vec();
        }
        at += 4 + len;
    }
    die("no NAA designator")
}

fn blocks(c: &mut Connection, lun: u64) -> (u64, u32) {
    let d = run(c, Command::read(2, lun, read_capacity16(), 32));
    let last = u64::from_be_bytes(d[0..8].try_into().unwrap_or_default());
    let size = u32::from_be_bytes(d[8..12].try_into().unwrap_or_default());
    (last + 1, size)
}

fn target_descriptor(naa: &[u8], block: u32) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    d[0] = 0xE4;
    d[4] = 0x01;
    d[5] = 0x03;
    d[7] = naa.len() as u8;
    d[8..8 + naa.len()].copy_from_slice(naa);
    d[29..32].copy_from_slice(&block.to_be_bytes()[1..]);
    d
}

fn parameters(src: &[u8], dst: &[u8], block: u32, lba: u64, count: u16) -> Vec<u8> {
    let mut p = vec![0u8; 16];
    p[1] = 3 << 3; // LIST ID USAGE 11b: no list identifier, no status held
    p[2..4].copy_from_slice(&64u16.to_be_bytes());
    p[8..12].copy_from_slice(&28u32.to_be_bytes());
    p.extend(target_descriptor(src, block));
    p.extend(target_descriptor(dst, block));
    let mut s = vec![0u8; 28];
    s[0] = 0x02; // block to block
    s[3] = 0x18;
    s[6..8].copy_from_slice(&1u16.to_be_bytes());
    s[10..12].copy_from_slice(&count.to_be_bytes());
    s[12..20].copy_from_slice(&lba.to_be_bytes());
    s[20..28].copy_from_slice(&lba.to_be_bytes());
    p.extend(s);
    p
}

fn xcopy_cdb(len: usize) -> Cdb {
    let mut c = [0u8; 16];
    c[0] = 0x83;
    c[10..14].copy_from_slice(&(len as u32).to_be_bytes());
    Cdb::new(&c).unwrap_or_else(|| die("cdb"))
}

/// Writes pseudo-random data (xorshift) over all `count` blocks of `lun`, 1 MiB at a time.
fn fill(c: &mut Connection, lun: u64, count: u64, block: u32) {
    let chunk = (1u64 << 20) / u64::from(block);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut at = 0;
    while at < count {
        let n = chunk.min(count - at);
        let mut data = Vec::with_capacity((n * u64::from(block)) as usize);
        while data.len() < data.capacity() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            data.extend_from_slice(&x.to_le_bytes());
        }
        run(
            c,
            Command::write(6, lun, write16(at, n as u32, false), data),
        );
        at += n;
    }
}

fn arg(n: usize) -> String {
    std::env::args()
        .nth(n)
        .unwrap_or_else(|| die("usage: xcopy HOST:PORT IQN SRC_LUN DST_LUN SEGMENT_BYTES QD"))
}

fn number(n: usize) -> u64 {
    arg(n).parse().unwrap_or_else(|_| die("not a number"))
}

fn main() {
    let kind = SessionKind::Normal {
        target_name: arg(2),
    };
    let config = ClientConfig::new(
        arg(1),
        SessionConfig::new("iqn.2026-11.org.ferrosan:xcopy-bench", kind),
    );
    let mut c = Connection::connect(&config).unwrap_or_else(|e| die(&format!("login: {e}")));
    let (src_lun, dst_lun, segment, depth) = (number(3), number(4), number(5), number(6) as usize);
    for lun in [src_lun, dst_lun] {
        // Takes the power-on unit attention, so the copy is not the command that reports it.
        run(
            &mut c,
            Command::none(5, lun, initiator::scsi::test_unit_ready()),
        );
    }
    let (src, dst) = (naa(&mut c, src_lun), naa(&mut c, dst_lun));
    let (count, block) = blocks(&mut c, src_lun);
    if std::env::args().nth(7).as_deref() == Some("fill") {
        fill(&mut c, src_lun, count, block);
    }
    let per = (segment / u64::from(block)).min(u64::from(u16::MAX));
    let started = Instant::now();
    let (mut next, mut tag) = (0u64, 10u64);
    while next < count || c.in_flight() > 0 {
        while next < count && c.in_flight() < depth {
            let n = per.min(count - next);
            let p = parameters(&src, &dst, block, next, n as u16);
            c.submit(Command::write(tag, dst_lun, xcopy_cdb(p.len()), p))
                .unwrap_or_else(|e| die(&format!("{e}")));
            (next, tag) = (next + n, tag + 1);
        }
        let done = c.next_completion().unwrap_or_else(|e| die(&format!("{e}")));
        let r = done.result.unwrap_or_else(|e| die(&format!("{e:?}")));
        if !r.is_good() {
            die(&format!(
                "EXTENDED COPY: status {:#x}, sense {:?}",
                r.status, r.sense
            ));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    // Read both back, 1 MiB at a time, and compare.
    let chunk = (1u64 << 20) / u64::from(block);
    let mut at = 0;
    while at < count {
        let n = chunk.min(count - at);
        let len = (n * u64::from(block)) as u32;
        let a = run(&mut c, Command::read(3, src_lun, read16(at, n as u32), len));
        let b = run(&mut c, Command::read(4, dst_lun, read16(at, n as u32), len));
        if a != b {
            die(&format!("the copy differs from its source at LBA {at}"));
        }
        at += n;
    }
    let bytes = count * u64::from(block);
    println!(
        "{{\"bytes\": {bytes}, \"segment_bytes\": {}, \"queue_depth\": {depth}, \"seconds\": {seconds:.3}, \"identical\": true}}",
        per * u64::from(block)
    );
}
