//! Receive coalescing against the real daemon: a raw initiator pipelines bursts of 4 KiB writes
//! (so its ExpStatSN lags by many answers, as a QD64 initiator's does), then sends one lone
//! command. The lone command must be answered (the backstop timer reads it, the connection never
//! waits for bytes that are not coming), every write must read back intact, and the metrics must
//! show that coalescing really engaged and that the backstop really fired.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::raw::{self, rw10, Raw};
use common::{free_port, pseudo_random_bytes, scrape, Daemon};
use iscsi::pdu::{encode_into, Framing, Opcode};

const BLOCK: usize = 512;
const WRITE_BYTES: usize = 4096;
const BURST: u32 = 64;
const BURSTS: u32 = 8;
/// Repetitions of the bursts and the lone command, at most: each round ends at the first that
/// saw the backstop fire, which on a loaded machine (a full test run) took more than five.
const ROUNDS: u32 = 20;

fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from metrics:\n{text}"))
}

#[test]
fn pipelined_bursts_are_coalesced_and_a_lone_command_still_gets_its_answer() {
    let metrics_port = free_port();
    let daemon = Daemon::start_with_args(
        common::IQN,
        &["ram:64M"],
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    let mut raw = Raw::login(daemon.port, &daemon.iqn, 1);
    let blocks_per_write = (WRITE_BYTES / BLOCK) as u16;
    let mut itt = 1u32;
    raw.until_ready(&mut itt);
    // Whether the connection is still collecting a batch when the pipeline stops depends on
    // timing, so the scenario repeats (rewriting the same data) until the backstop has fired;
    // a connection whose timer never fires would never answer the lone command at all.
    let mut lone_times = Vec::new();
    for _round in 0..ROUNDS {
        for burst in 0..BURSTS {
            // Send the whole burst before reading any answer: each PDU is its own write (the
            // socket has TCP_NODELAY), as an initiator with 64 commands queued sends them.
            let framing = Framing::LOGIN;
            for i in 0..BURST {
                let n = burst * BURST + i;
                let data = pseudo_random_bytes(WRITE_BYTES, u64::from(n));
                let cdb = rw10(0x2a, n * u32::from(blocks_per_write), blocks_per_write);
                let mut bhs = raw.command(itt, &cdb, 0xa0, WRITE_BYTES as u32);
                bhs.set_data_segment_len(WRITE_BYTES);
                let mut wire = Vec::new();
                encode_into(&mut wire, &bhs, &data, &framing);
                raw.stream.write_all(&wire).expect("send write");
                itt += 1;
            }
            for _ in 0..BURST {
                let pdu = raw.recv();
                assert_eq!(pdu.bhs.opcode_raw(), Opcode::ScsiResponse as u8);
                assert_eq!(raw::status_of(&pdu), 0, "write failed: {:?}", pdu.bhs);
            }
        }
        // The pipeline stops: one lone small command, sent after every answer was read. The
        // connection may still be waiting for a batch; only its timer can read this command.
        let started = Instant::now();
        let cdb = rw10(0x28, 0, blocks_per_write);
        let bhs = raw.command(itt, &cdb, 0xc0, WRITE_BYTES as u32);
        raw.send(&bhs, &[]);
        let data = raw.read_data();
        lone_times.push(started.elapsed());
        assert_eq!(data, pseudo_random_bytes(WRITE_BYTES, 0));
        itt += 1;
        // Counts reach the metrics once a second per connection.
        std::thread::sleep(Duration::from_millis(1_100));
        if counter(&scrape(metrics_port), "ferrosan_receive_batch_misses_total") > 0 {
            break;
        }
    }
    let lone = lone_times.iter().max().copied().unwrap_or_default();
    // Everything written reads back, in one 256 KiB read per burst.
    for burst in 0..BURSTS {
        let blocks = (BURST as usize * WRITE_BYTES / BLOCK) as u16;
        let lba = burst * u32::from(blocks);
        let cdb = rw10(0x28, lba, blocks);
        let len = BURST * WRITE_BYTES as u32;
        let bhs = raw.command(itt, &cdb, 0xc0, len);
        itt += 1;
        raw.send(&bhs, &[]);
        let got = raw.read_data();
        for i in 0..BURST {
            let n = burst * BURST + i;
            let at = i as usize * WRITE_BYTES;
            assert!(
                got[at..at + WRITE_BYTES] == pseudo_random_bytes(WRITE_BYTES, u64::from(n)),
                "write {n} did not read back"
            );
        }
    }
    drop(raw);
    // Counts reach the metrics once a second and when the connection ends.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (batches, misses) = loop {
        let text = scrape(metrics_port);
        let now = (
            counter(&text, "ferrosan_receive_batches_total"),
            counter(&text, "ferrosan_receive_batch_misses_total"),
        );
        if (now.0 > 0 && now.1 > 0) || Instant::now() > deadline {
            break now;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        batches > 0,
        "coalescing never engaged (lone commands took up to {lone:?})"
    );
    assert!(
        misses > 0,
        "the backstop timer never fired in {ROUNDS} rounds (lone commands took up to {lone:?})"
    );
    eprintln!(
        "coalesced reads: {batches}, misses: {misses}, lone commands answered in {lone_times:?}"
    );
}
