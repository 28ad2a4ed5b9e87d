//! Random 4 KiB reads at a fixed queue depth for a while; prints IOPS and this process's CPU
//! time per I/O. `qd_read iscsi://HOST[:PORT]/IQN/LUN [QD] [SECONDS]`.

use std::time::{Duration, Instant};

use initiator::driver::Client;
use initiator::scsi;
use initiator::session::Command;
use initiator::url::IscsiUrl;

/// utime + stime of this process, from /proc/self/stat (clock ticks, 100 Hz on Linux).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Fields 14 and 15 of stat(5); 12 and 13 after the command name.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = args.get(1).ok_or("usage: qd_read URL [QD] [SECONDS]")?;
    let qd: u64 = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let secs: u64 = args.get(3).map_or(Ok(5), |s| s.parse())?;
    let url = IscsiUrl::parse(url)?;
    let lun = url.lun;
    let mut client = Client::connect(url.client_config("iqn.2024-01.dev.ferrosan:qd-read"))?;
    let _ = client.test_unit_ready()?;
    let cap = client.read_capacity()?.map_err(|e| format!("{e:?}"))?;
    let blocks_per_io = (4096 / cap.block_size).max(1);
    let slots = cap.blocks / u64::from(blocks_per_io);
    let conn = client.connection()?;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_lba = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % slots) * u64::from(blocks_per_io)
    };
    let mut buffers: Vec<Vec<u8>> = Vec::new();
    let submit = |conn: &mut initiator::driver::Connection, tag: u64, lba: u64, buf: Vec<u8>| {
        conn.submit(
            Command::read(tag, lun, scsi::read16(lba, blocks_per_io), 4096).with_buffer(buf),
        )
    };
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    for tag in 0..qd {
        submit(conn, tag, next_lba(), Vec::with_capacity(4096))?;
    }
    let mut done = 0u64;
    let mut tag = qd;
    while conn.in_flight() > 0 {
        let c = conn.next_completion()?;
        let r = c.result?;
        if !r.is_good() {
            return Err(format!("status {:#x}", r.status).into());
        }
        done += 1;
        buffers.push(r.data);
        if Instant::now() < end {
            let buf = buffers.pop().unwrap_or_default();
            submit(conn, tag, next_lba(), buf)?;
            tag += 1;
        }
    }
    let elapsed = t0.elapsed();
    let cpu = cpu_time().saturating_sub(cpu0);
    println!(
        "QD{qd} 4 KiB random reads: {done} in {elapsed:.2?} = {:.0} IOPS; initiator CPU {cpu:?} = {:.2} us/IO",
        done as f64 / elapsed.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / done as f64
    );
    client.logout()?;
    Ok(())
}
