//! fio-format JSON beside results.json, so the tools users already chart fio with (fio-plot,
//! spreadsheets fed by `jq`) read a `ferrosan bench` run. One file per target and workload,
//! laid out as fio-plot's bench-fio writes them: `fio/<target>/<bs>/<rw>-<iodepth>-<numjobs>.json`.
//!
//! What fio measures and ferrosan bench does not is written as fio writes an absent figure
//! (zero): submission latency (`slat_ns`; `clat_ns` and `lat_ns` are both submission to
//! completion), context switches and faults. `usr_cpu` holds the client's user + system CPU
//! and `sys_cpu` 0: the bench reads the two together.

use crate::plan::{size_label, Pattern, Workload};
use crate::report::{Results, Row};
use crate::stats::{Latency, Summary};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// fio's `rw=` name of a workload.
fn rw(w: &Workload) -> &'static str {
    match (w.pattern, w.read_pct) {
        (Pattern::Random, 100) => "randread",
        (Pattern::Random, 0) => "randwrite",
        (Pattern::Random, _) => "randrw",
        (Pattern::Sequential, 100) => "read",
        (Pattern::Sequential, 0) => "write",
        (Pattern::Sequential, _) => "rw",
    }
}

/// A target's name as a directory name: `iscsi___127.0.0.1_3260_iqn...`, at most 100 bytes.
fn dir_name(target: &str) -> String {
    let s: String = target
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let s = s.trim_matches('_');
    let tail = s.len().saturating_sub(100);
    // ASCII only by construction: any byte offset is a char boundary.
    s[tail..].to_string()
}

/// Where a row's file goes under `dir`.
pub fn path_of(dir: &Path, row: &Row) -> PathBuf {
    let w = &row.workload;
    dir.join(dir_name(&row.target))
        .join(size_label(w.block_size))
        .join(format!("{}-{}-{}.json", rw(w), w.queue_depth, w.jobs))
}

/// Writes every row's file under `dir`; returns how many.
pub fn write_all(results: &Results, dir: &Path) -> Result<usize, String> {
    for row in &results.rows {
        let path = path_of(dir, row);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        let text = serde_json::to_string_pretty(&document(results, row))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(results.rows.len())
}

/// One row as fio's `--output-format=json` document of one job.
pub fn document(results: &Results, row: &Row) -> Value {
    let w = &row.workload;
    let s = &row.result;
    let runtime_ms = (results.runtime_s * 1000.0).round() as u64;
    let mut options = json!({
        "name": w.id,
        "filename": row.target,
        "rw": rw(w),
        "bs": size_label(w.block_size),
        "iodepth": w.queue_depth.to_string(),
        "numjobs": w.jobs.to_string(),
        "direct": "1",
        "time_based": "1",
        "runtime": format!("{}", results.runtime_s),
        "ramp_time": format!("{}", results.ramp_s),
        "group_reporting": "1",
        "ioengine": "ferrosan-bench",
    });
    if !matches!(w.read_pct, 0 | 100) {
        options["rwmixread"] = json!(w.read_pct.to_string());
    }
    let cpu_pct = s
        .client_cpu_us_per_io
        .map_or(0.0, |us| us * s.iops / 1e6 * 100.0);
    let (ns, us, ms) = distribution(s);
    let job = json!({
        "jobname": w.id,
        "groupid": 0,
        "error": if s.errors > 0 { 5 } else { 0 },
        "eta": 0,
        "elapsed": (results.ramp_s + results.runtime_s).round() as u64,
        "job options": options,
        "read": direction(s, s.read_iops, s.read_latency_us.as_ref(), w, runtime_ms),
        "write": direction(s, s.write_iops, s.write_latency_us.as_ref(), w, runtime_ms),
        "trim": direction(s, 0.0, None, w, runtime_ms),
        "job_runtime": runtime_ms,
        "usr_cpu": cpu_pct,
        "sys_cpu": 0.0,
        "ctx": 0,
        "majf": 0,
        "minf": 0,
        "iodepth_level": depth_levels(w.queue_depth),
        "latency_ns": ns,
        "latency_us": us,
        "latency_ms": ms,
        "latency_depth": w.queue_depth,
        "latency_target": 0,
        "latency_percentile": 100.0,
        "latency_window": 0,
    });
    json!({
        "fio version": format!("ferrosan-bench-{}", results.version),
        "timestamp": results.started_unix_s,
        "timestamp_ms": results.started_unix_s * 1000,
        "time": "",
        "global options": {},
        "jobs": [job],
    })
}

/// fio's `read` / `write` / `trim` object for one direction doing `iops`.
fn direction(
    s: &Summary,
    iops: f64,
    lat: Option<&Latency>,
    w: &Workload,
    runtime_ms: u64,
) -> Value {
    let ios = (iops * runtime_ms as f64 / 1000.0).round() as u64;
    let bytes = ios * u64::from(w.block_size);
    let bw_bytes = iops * f64::from(w.block_size);
    // The series is of every I/O: a mixed workload's side gets its share of each step.
    let share = if s.iops > 0.0 { iops / s.iops } else { 0.0 };
    let series: Vec<f64> = s.iops_over_time.iops.iter().map(|v| v * share).collect();
    let (lo, hi, mean, sd) = moments(&series);
    let kib = f64::from(w.block_size) / 1024.0;
    json!({
        "io_bytes": bytes,
        "io_kbytes": bytes / 1024,
        "bw_bytes": bw_bytes.round() as u64,
        "bw": (bw_bytes / 1024.0).round() as u64,
        "iops": iops,
        "runtime": if ios > 0 { runtime_ms } else { 0 },
        "total_ios": ios,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": latency_ns(None, 0, false),
        "clat_ns": latency_ns(lat, ios, true),
        "lat_ns": latency_ns(lat, ios, false),
        "bw_min": (lo * kib).round() as u64,
        "bw_max": (hi * kib).round() as u64,
        "bw_agg": if ios > 0 { 100.0 } else { 0.0 },
        "bw_mean": mean * kib,
        "bw_dev": sd * kib,
        "bw_samples": series.len(),
        "iops_min": lo.round() as u64,
        "iops_max": hi.round() as u64,
        "iops_mean": mean,
        "iops_stddev": sd,
        "iops_samples": series.len(),
    })
}

/// Min, max, mean and standard deviation of `v` (zeros when empty).
fn moments(v: &[f64]) -> (f64, f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0, 0.0);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi, mean, var.sqrt())
}

/// fio's `clat_ns` / `lat_ns`: figures in ns, with percentiles for `clat_ns`.
fn latency_ns(lat: Option<&Latency>, n: u64, percentiles: bool) -> Value {
    let l = lat.cloned().unwrap_or_default();
    let ns = |us: f64| (us * 1000.0).round() as u64;
    let mut v = json!({
        "min": ns(l.min),
        "max": ns(l.max),
        "mean": l.mean * 1000.0,
        "stddev": l.stddev * 1000.0,
        "N": n,
    });
    if percentiles && n > 0 {
        v["percentile"] = json!({
            "50.000000": ns(l.p50),
            "90.000000": ns(l.p90),
            "99.000000": ns(l.p99),
            "99.900000": ns(l.p99_9),
        });
    }
    v
}

/// The distribution as fio's three maps of percentages (`latency_ns`, `_us`, `_ms`).
fn distribution(s: &Summary) -> (Value, Value, Value) {
    let total: u64 = s.latency_histogram.iter().map(|b| b.count).sum();
    let pct = |count: u64| {
        if total == 0 {
            0.0
        } else {
            100.0 * count as f64 / total as f64
        }
    };
    let mut maps = [Map::new(), Map::new(), Map::new()];
    for (i, b) in s.latency_histogram.iter().enumerate() {
        let (map, key) = match b.upto_ns {
            Some(edge) => {
                let unit = (i / 10).min(2);
                let scale = [1, 1_000, 1_000_000][unit];
                (unit, (edge / scale).to_string())
            }
            None => (2, ">=2000".to_string()),
        };
        maps[map].insert(key, json!(pct(b.count)));
    }
    let [ns, us, ms] = maps;
    (Value::Object(ns), Value::Object(us), Value::Object(ms))
}

/// fio's `iodepth_level`: the share of time at each depth (the bench keeps its depth full).
fn depth_levels(qd: u32) -> Value {
    let levels = ["1", "2", "4", "8", "16", "32", ">=64"];
    let at = match qd {
        0 | 1 => 0,
        2 => 1,
        3..=4 => 2,
        5..=8 => 3,
        9..=16 => 4,
        17..=32 => 5,
        _ => 6,
    };
    let mut m = Map::new();
    for (i, l) in levels.iter().enumerate() {
        m.insert((*l).to_string(), json!(if i == at { 100.0 } else { 0.0 }));
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::sample_results;

    fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
        path.iter().fold(v, |v, k| match k.parse::<usize>() {
            Ok(i) => &v[i],
            Err(_) => &v[*k],
        })
    }

    #[test]
    fn each_file_has_what_fio_plot_reads_where_it_reads_it() {
        let r = sample_results();
        let row = r
            .rows
            .iter()
            .find(|x| x.workload.id == "randread-4k-qd64")
            .unwrap();
        let doc = document(&r, row);
        // fio-plot's flat mapping (fio_plot/fiolib/jsonimport.py): these paths, these types.
        assert!(doc["fio version"].is_string());
        for (option, want) in [
            ("iodepth", "64"),
            ("numjobs", "1"),
            ("bs", "4k"),
            ("rw", "randread"),
        ] {
            assert_eq!(at(&doc, &["jobs", "0", "job options", option]), want);
        }
        for mode in ["read", "write"] {
            for path in [
                &["bw"][..],
                &["iops"],
                &["iops_stddev"],
                &["lat_ns", "mean"],
                &["lat_ns", "stddev"],
            ] {
                let mut p = vec!["jobs", "0", mode];
                p.extend_from_slice(path);
                assert!(at(&doc, &p).is_number(), "{p:?}");
            }
        }
        for key in ["latency_ms", "latency_us", "latency_ns"] {
            assert!(at(&doc, &["jobs", "0", key]).is_object(), "{key}");
        }
        for key in ["usr_cpu", "sys_cpu"] {
            assert!(at(&doc, &["jobs", "0", key]).is_number(), "{key}");
        }
        let job = &doc["jobs"][0];
        assert_eq!(job["read"]["iops"], row.result.read_iops);
        // The first target: 64 I/Os per 100 ms step for 10 s.
        assert_eq!(job["read"]["total_ios"], 640 * 10);
        assert_eq!(job["read"]["bw"], 640 * 4);
        assert_eq!(job["write"]["total_ios"], 0);
        let p99 = job["read"]["clat_ns"]["percentile"]["99.000000"]
            .as_u64()
            .unwrap();
        assert_eq!(p99, (row.result.latency_us.p99 * 1000.0).round() as u64);
        assert!(job["write"]["clat_ns"]["percentile"].is_null());
        // Client CPU: 3 µs per I/O at 640 IOPS is 0.192 % of a CPU.
        assert!((job["usr_cpu"].as_f64().unwrap() - 0.192).abs() < 1e-9);
        assert_eq!(job["iodepth_level"][">=64"], 100.0);
        // fio-plot picks files by name: rw first, then "-iodepth-numjobs".
        let path = path_of(Path::new("/o"), row);
        let name = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(name, "randread-64-1.json");
        assert_eq!(path.parent().unwrap().file_name().unwrap(), "4k");
        assert_eq!(
            path.parent()
                .unwrap()
                .parent()
                .unwrap()
                .file_name()
                .unwrap(),
            "iscsi___127.0.0.1_3260_iqn.x__t__0"
        );
    }

    #[test]
    fn the_distribution_sums_to_all_ios_and_a_mix_splits_by_direction() {
        let r = sample_results();
        let row = r
            .rows
            .iter()
            .find(|x| x.workload.id == "randrw70-4k-qd64")
            .unwrap();
        let job = document(&r, row)["jobs"][0].clone();
        let sum: f64 = ["latency_ns", "latency_us", "latency_ms"]
            .iter()
            .flat_map(|k| job[*k].as_object().unwrap().values())
            .map(|v| v.as_f64().unwrap())
            .sum();
        assert!((sum - 100.0).abs() < 1e-6, "{sum}");
        assert_eq!(job["latency_ms"].as_object().unwrap().len(), 12);
        assert!(job["latency_ms"][">=2000"].is_number());
        assert_eq!(job["job options"]["rw"], "randrw");
        assert_eq!(job["job options"]["rwmixread"], "70");
        let (rd, wr) = (
            job["read"]["iops"].as_f64().unwrap(),
            job["write"]["iops"].as_f64().unwrap(),
        );
        assert!((rd + wr - row.result.iops).abs() < 1e-6);
        assert!((rd / (rd + wr) - 0.7).abs() < 0.01, "{rd} {wr}");
        assert!(job["write"]["lat_ns"]["mean"].as_f64().unwrap() > 0.0);
        // The series is flat (the same I/Os each step): no spread.
        assert_eq!(job["read"]["iops_stddev"], 0.0);
        assert!((job["read"]["iops_mean"].as_f64().unwrap() - rd).abs() < 1e-6);
    }

    #[test]
    fn every_row_gets_its_own_file() {
        let r = sample_results();
        let dir = std::env::temp_dir().join(format!("ferrosan-fio-{}", std::process::id()));
        let n = write_all(&r, &dir).unwrap();
        assert_eq!(n, r.rows.len());
        let mut paths: Vec<_> = r.rows.iter().map(|row| path_of(&dir, row)).collect();
        paths.sort();
        paths.dedup();
        assert_eq!(paths.len(), r.rows.len(), "no two rows share a file");
        assert!(paths.iter().all(|p| p.is_file()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
