//! `ferrosan bench` end to end: the real binary on a file on the build's disk filesystem,
//! results.json and report.html checked, and the destructive-write rules.

mod common;

use common::tgt::{Tgt, TGT_IQN};
use common::{disk_dir, free_port, run_path, Daemon, LoopDevice, IQN};
use std::path::Path;

fn ferrosan() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_ferrosan"))
}

fn image(dir: &Path, name: &str, bytes: usize) -> String {
    let path = dir.join(name);
    // Real data, not a sparse file: reads must reach the device.
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut data = Vec::with_capacity(bytes);
    while data.len() < bytes {
        data.extend_from_slice(&block);
    }
    data.truncate(bytes);
    std::fs::write(&path, data).unwrap();
    path.display().to_string()
}

#[test]
fn a_quick_run_on_a_file_writes_results_and_a_self_contained_report() {
    let dir = disk_dir("bench-quick");
    let file = image(&dir, "disk.img", 64 << 20);
    let out = dir.join("out");
    let out_s = out.display().to_string();
    let run = run_path(
        ferrosan(),
        &["bench", "--quick", "--runtime", "1", "--out", &out_s, &file],
    );
    assert!(run.success(), "{}", run.describe());
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = results["rows"].as_array().unwrap();
    let ids: Vec<&str> = rows
        .iter()
        .map(|r| r["workload"]["id"].as_str().unwrap())
        .collect();
    // Reads only without --destructive: the headline and the queue-depth sweep.
    assert_eq!(
        ids,
        [
            "randread-4k-qd1",
            "randread-4k-qd64",
            "seqread-1m-qd16",
            "randread-4k-qd2",
            "randread-4k-qd4",
            "randread-4k-qd8",
            "randread-4k-qd16",
            "randread-4k-qd32"
        ]
    );
    for r in rows {
        assert_eq!(r["target"], file.as_str());
        let iops = r["iops"].as_f64().unwrap();
        assert!(iops > 0.0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert!(
            r["latency_us"]["p99"].as_f64().unwrap() >= r["latency_us"]["p50"].as_f64().unwrap()
        );
        // The distribution counts every I/O of the window; the series averages to the IOPS.
        let counted: u64 = r["latency_histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["count"].as_u64().unwrap())
            .sum();
        assert!((counted as f64 - iops).abs() <= 1.0, "{counted} vs {iops}");
        let series: Vec<f64> = r["iops_over_time"]["iops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(series.len(), 10, "1 s in 100 ms steps");
        let mean = series.iter().sum::<f64>() / series.len() as f64;
        assert!((mean - iops).abs() < iops * 0.01 + 1.0, "{mean} vs {iops}");
        assert!(r["read_latency_us"]["p50"].as_f64().unwrap() > 0.0);
        assert!(r["write_latency_us"].is_null());
        // The image holds data: its reads are not flagged as zeros.
        assert_eq!(r["reads_only_zeros"], false, "{r}");
        let p50 = r["percentiles_us"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["p"] == 50.0)
            .map(|p| p["us"].as_f64().unwrap());
        assert!(p50.is_some_and(|v| v > 0.0), "{r}");
    }
    assert_eq!(walk(&out.join("fio")).len(), rows.len());
    assert!(rows[2]["mb_per_s"].as_f64().unwrap() > 1.0);
    assert_eq!(results["targets"][0]["kind"], "file");
    assert_eq!(results["targets"][0]["capacity_bytes"], 64 << 20);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<svg "), "no chart");
    assert!(html.contains("randread-4k-qd64: latency by percentile"));
    assert!(html.contains("randread-4k-qd64: IOPS over time"));
    assert!(
        html.contains("µs (log scale)"),
        "p99 across queue depths on a log axis"
    );
    for outside in ["http:", "https:", "src=", "<link", "<script"] {
        assert!(!html.contains(outside), "report refers outside: {outside}");
    }
    // The file is unchanged: nothing was written.
    let after = std::fs::read(&file).unwrap();
    assert_eq!(after.len(), 64 << 20);
    assert_eq!(&after[..16], &image_prefix()[..]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn image_prefix() -> Vec<u8> {
    (0..16u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

#[test]
fn writes_need_destructive_and_never_touch_a_file_in_use() {
    let dir = disk_dir("bench-destructive");
    let file = image(&dir, "disk.img", 16 << 20);
    let out = dir.join("out").display().to_string();
    // Another process holds it open: refused, with the reason, before any I/O.
    let mut holder = std::process::Command::new("sleep")
        .arg("60")
        .stdin(std::fs::File::open(&file).unwrap())
        .spawn()
        .unwrap();
    let refused = run_path(
        ferrosan(),
        &[
            "bench",
            "--quick",
            "--destructive",
            "--runtime",
            "1",
            "--out",
            &out,
            &file,
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{}", refused.describe());
    assert!(
        refused.stderr.contains("is open in process") && refused.stderr.contains("sleep"),
        "{}",
        refused.describe()
    );
    assert!(!Path::new(&out).join("results.json").exists());
    assert_eq!(&std::fs::read(&file).unwrap()[..16], &image_prefix()[..]);
    // Unless asked to write even so (a benchmark keeping a target on the same file), with its
    // own ramp.
    let forced = run_path(
        ferrosan(),
        &[
            "bench",
            "--destructive",
            "--even-if-open",
            "--only",
            "seqwrite-1m-qd16",
            "--ramp",
            "0",
            "--runtime",
            "1",
            "--out",
            &out,
            &file,
        ],
    );
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(forced.success(), "{}", forced.describe());
    assert_ne!(&std::fs::read(&file).unwrap()[..16], &image_prefix()[..]);
    let text = std::fs::read_to_string(Path::new(&out).join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["ramp_s"].as_f64(), Some(0.0), "{text}");
    std::fs::remove_file(Path::new(&out).join("results.json")).unwrap();

    // Free now: --destructive runs the writes too, and they land.
    let ran = run_path(
        ferrosan(),
        &[
            "bench",
            "--quick",
            "--destructive",
            "--dsync",
            "--runtime",
            "1",
            "--out",
            &out,
            &file,
        ],
    );
    assert!(ran.success(), "{}", ran.describe());
    let text = std::fs::read_to_string(Path::new(&out).join("results.json")).unwrap();
    for id in ["randwrite-4k-qd64", "randrw70-4k-qd64", "seqwrite-1m-qd16"] {
        assert!(text.contains(id), "{id} missing");
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mix = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["workload"]["id"] == "randrw70-4k-qd64")
        .unwrap();
    let share = mix["read_iops"].as_f64().unwrap() / mix["iops"].as_f64().unwrap();
    assert!((0.6..0.8).contains(&share), "70/30 mix read share {share}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A block device a running daemon serves is claimed (O_EXCL), so a
/// destructive run is refused before any I/O, and the disk keeps its data; reading it is fine.
#[test]
fn a_device_a_running_daemon_serves_is_never_written_by_a_destructive_run() {
    let Some(dev) = LoopDevice::attach("bench-served", 16 << 20, &[]) else {
        println!("skipped: needs root and loop devices (losetup)");
        return;
    };
    {
        use std::os::unix::fs::FileExt as _;
        let backing = std::fs::File::options().write(true).open(&dev.backing);
        backing.unwrap().write_all_at(&image_prefix(), 0).unwrap();
    }
    let daemon = Daemon::start(&[&format!("block:{}", dev.device)]);
    let out_dir = disk_dir("bench-served-out");
    let out = out_dir.join("out").display().to_string();
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--quick", "--runtime", "1", "--out", &out];
        args.extend(extra);
        args.push(&dev.device);
        run_path(ferrosan(), &args)
    };
    let refused = bench(&["--destructive", "--ramp", "0"]);
    assert_eq!(refused.status.code(), Some(2), "{}", refused.describe());
    assert!(
        refused
            .stderr
            .contains("is served or mounted by another program"),
        "{}",
        refused.describe()
    );
    assert_eq!(
        &std::fs::read(&dev.backing).unwrap()[..16],
        &image_prefix()[..]
    );
    let read = bench(&["--only", "seqread-1m-qd16", "--ramp", "0"]);
    assert!(read.success(), "{}", read.describe());
    drop(daemon);
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn a_polling_client_runs_through_both_doors_and_on_a_local_file() {
    let dir = disk_dir("bench-poll");
    let file = image(&dir, "disk.img", 16 << 20);
    // The LUN holds data too, so every target's reads can be told from zeros.
    let lun = format!("file:{}", image(&dir, "lun.img", 16 << 20));
    let out = dir.join("out");
    let out_s = out.display().to_string();
    let nvme_port = free_port();
    let listen = format!("127.0.0.1:{nvme_port}");
    let daemon = Daemon::start_with_args(IQN, &[lun.as_str()], &["--nvme-listen", &listen]);
    let nqn = IQN.replacen("iqn.", "nqn.", 1);
    let nvme_url = format!("nvme+tcp://{listen}/{nqn}/1");
    let iscsi_url = daemon.url(0);
    let run = run_path(
        ferrosan(),
        &[
            "bench",
            "--busy-poll-us",
            "200",
            "--destructive",
            "--only",
            "randwrite-4k-qd1,randread-4k-qd1",
            "--ramp",
            "0",
            "--runtime",
            "1",
            "--out",
            &out_s,
            &iscsi_url,
            &nvme_url,
            &file,
        ],
    );
    assert!(
        run.success(),
        "{}\n--- daemon\n{}",
        run.describe(),
        daemon.output()
    );
    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 3, "2 workloads x 3 targets: {text}");
    for row in rows {
        assert_eq!(row["errors"], 0, "{row}");
        assert!(row["iops"].as_f64().unwrap() > 100.0, "{row}");
        // Reads brought the data (the image's, or what the writes left), not zeros.
        assert_eq!(row["reads_only_zeros"], false, "{row}");
    }
    // Every target's rows say their client polled: the latency is a polling host's.
    for target in results["targets"].as_array().unwrap() {
        let notes = target["notes"].to_string();
        assert!(notes.contains("spins up to 200 µs"), "{target}");
    }
    // A spin beyond a second is refused before any I/O.
    let long = run_path(
        ferrosan(),
        &["bench", "--busy-poll-us", "1000001", "--out", &out_s, &file],
    );
    assert_eq!(long.status.code(), Some(2), "{}", long.describe());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_targets_and_options_fail_clearly() {
    let dir = disk_dir("bench-bad");
    let out = dir.join("out").display().to_string();
    let missing = run_path(
        ferrosan(),
        &["bench", "--quick", "--out", &out, "/nonexistent/x.img"],
    );
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        missing.stderr.contains("/nonexistent/x.img"),
        "{}",
        missing.describe()
    );
    let empty = dir.join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let e = run_path(
        ferrosan(),
        &[
            "bench",
            "--quick",
            "--out",
            &out,
            &empty.display().to_string(),
        ],
    );
    assert_eq!(e.status.code(), Some(2));
    assert!(e.stderr.contains("empty"), "{}", e.describe());
    let size = run_path(
        ferrosan(),
        &["bench", "--size", "lots", "--out", &out, "/dev/null"],
    );
    assert_eq!(size.status.code(), Some(2), "{}", size.describe());
    let none = run_path(ferrosan(), &["bench"]);
    assert!(!none.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tgt_ferrosan_and_a_file_side_by_side_in_one_run() {
    let dir = disk_dir("bench-iscsi");
    let file = image(&dir, "disk.img", 32 << 20);
    let out = dir.join("out");
    let out_s = out.display().to_string();
    let tgt = Tgt::start();
    let metrics_port = free_port();
    let metrics = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start_with_args(IQN, &["ram:64M"], &["--metrics-listen", &metrics]);
    let tgt_url = format!("iscsi://127.0.0.1:{}/{TGT_IQN}/1", tgt.port);
    let ours = daemon.url(0);
    let run = run_path(
        ferrosan(),
        &[
            "bench",
            "--only",
            "randread-4k-qd1,randread-4k-qd64,seqread-1m-qd16",
            "--runtime",
            "1",
            "--target-metrics",
            &metrics,
            "--out",
            &out_s,
            &tgt_url,
            &ours,
            &file,
        ],
    );
    assert!(
        run.success(),
        "{}\n--- daemon\n{}",
        run.describe(),
        daemon.output()
    );
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3 * 3, "3 workloads x 3 targets");
    for target in [&tgt_url, &ours, &file] {
        let row = |id: &str| {
            rows.iter()
                .find(|r| r["target"] == target.as_str() && r["workload"]["id"] == id)
                .unwrap_or_else(|| panic!("no {id} row for {target}"))
        };
        assert!(
            row("randread-4k-qd64")["iops"].as_f64().unwrap() > 100.0,
            "{target}"
        );
        assert!(
            row("seqread-1m-qd16")["mb_per_s"].as_f64().unwrap() > 1.0,
            "{target}"
        );
        assert_eq!(row("randread-4k-qd1")["errors"], 0, "{target}");
        // Target CPU only where the metrics endpoint serves the target: ferrosan's LUN.
        let target_cpu = row("randread-4k-qd64")["target_cpu_us_per_io"].as_f64();
        if *target == ours {
            assert!(
                target_cpu.is_some_and(|c| c > 0.0),
                "{target}: {target_cpu:?}"
            );
        } else {
            assert_eq!(target_cpu, None, "{target}");
        }
    }
    assert_eq!(
        results["targets"][1]["metrics"],
        format!("http://{metrics}/metrics").as_str()
    );
    assert!(results["targets"][0]["notes"][0]
        .as_str()
        .unwrap()
        .contains("no --target-metrics endpoint serves it"));
    // fio-format files, one per target and workload, in bench-fio's layout.
    let fio_files = walk(&out.join("fio"));
    assert_eq!(fio_files.len(), 9, "{fio_files:?}");
    let qd64: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            fio_files
                .iter()
                .find(|p| {
                    p.ends_with("4k/randread-64-1.json") && p.to_string_lossy().contains("itest")
                })
                .expect("ferrosan's randread QD64 file"),
        )
        .unwrap(),
    )
    .unwrap();
    let job = &qd64["jobs"][0];
    assert_eq!(job["job options"]["iodepth"], "64");
    assert!(job["read"]["iops"].as_f64().unwrap() > 100.0, "{job}");
    assert!(
        job["read"]["clat_ns"]["percentile"]["99.000000"]
            .as_u64()
            .unwrap()
            > 0
    );
    let kinds: Vec<_> = results["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["iscsi", "iscsi", "file"]);
    assert_eq!(results["targets"][1]["capacity_bytes"], 64 << 20);
    assert_eq!(results["targets"][0]["capacity_bytes"], 16 << 20);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<svg ") && html.contains(TGT_IQN));
    for outside in ["http:", "https:", "src=", "<link", "<script"] {
        assert!(!html.contains(outside), "report refers outside: {outside}");
    }
    // Writes to a ferrosan LUN with --destructive land on the LUN (the RAM LUN was zeros).
    let w = run_path(
        ferrosan(),
        &[
            "bench",
            "--only",
            "randwrite-4k-qd64",
            "--destructive",
            "--runtime",
            "1",
            "--out",
            &out_s,
            &ours,
        ],
    );
    assert!(w.success(), "{}", w.describe());
    let text = std::fs::read_to_string(out.join("results.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["rows"][0]["write_iops"].as_f64().unwrap() > 100.0,
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_dead_target_or_bad_credentials_end_the_run_with_an_error_not_a_hang() {
    let dir = disk_dir("bench-dead");
    let out = dir.join("out").display().to_string();
    // Accepts TCP, never answers: the login times out.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "iscsi://127.0.0.1:{}/iqn.2026-11.x:none/0",
        silent.local_addr().unwrap().port()
    );
    let started = std::time::Instant::now();
    let r = run_path(ferrosan(), &["bench", "--quick", "--out", &out, &url]);
    assert_eq!(r.status.code(), Some(2), "{}", r.describe());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    assert!(r.stderr.contains("127.0.0.1"), "{}", r.describe());
    // A CHAP password in the URL never shows in the error.
    let daemon = Daemon::start(&["ram:16M"]);
    let with_pw = daemon
        .url(0)
        .replacen("iscsi://", "iscsi://alice%hunter2secret@", 1);
    let r = run_path(ferrosan(), &["bench", "--quick", "--out", &out, &with_pw]);
    assert!(!r.stderr.contains("hunter2secret"), "{}", r.describe());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files.extend(walk(&p));
        } else {
            files.push(p);
        }
    }
    files
}
