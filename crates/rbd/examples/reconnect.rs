//! How a process's memory follows cluster connections made and shut down, one after another:
//! each round connects, opens an image, writes a block, closes and shuts down, as a gateway does
//! each time another gateway's takeover fences its data connection.
//!
//!     reconnect CEPH_CONF POOL/IMAGE ROUNDS
//!
//! Prints the round and the process's anonymous RSS (KiB) every tenth of the rounds.
use rbd::{Cluster, ClusterOptions, Image, Op};

fn rss_anon_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, conf, spec, rounds] = args.as_slice() else {
        eprintln!("usage: reconnect CEPH_CONF POOL/IMAGE ROUNDS");
        std::process::exit(2);
    };
    let (pool, image) = spec.split_once('/').expect("POOL/IMAGE");
    let rounds: u32 = rounds.parse().expect("ROUNDS");
    let options = ClusterOptions {
        conf: Some(conf.into()),
        ..Default::default()
    };
    for round in 0..=rounds {
        if round % (rounds / 10).max(1) == 0 {
            println!("{round} {}", rss_anon_kib());
        }
        let cluster = Cluster::connect(&options).expect("connect");
        let img = Image::open(&cluster, pool, image).expect("open");
        let done = img.run(Op::Write { offset: 0 }, vec![round as u8; 4096]);
        done.result.expect("write");
        drop(img);
        drop(cluster);
    }
}
