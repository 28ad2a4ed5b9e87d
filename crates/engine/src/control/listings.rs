//! The control socket's answers with a row per device or LUN: `stats`, totals since start per
//! device and per session, for `ferrosan top` (which shows rates from two samples, every
//! second) and scripts; `luns`, every LUN with its device's facts.
//!
//! Their rows are typed and written straight to text: built as `serde_json::Value`s, each
//! `stats` row's keys, numbers and histograms were ~40 allocations made, written and freed,
//! and the whole answer cost 290 ms of the daemon's CPU at 16,000 devices (`perf`: 42 % of
//! it in the allocator, 20 % writing the values out).

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;

use super::edit;
use crate::metrics::{LatencyCounts, LATENCY_BOUNDS_NS};
use crate::shared::Shared;

/// The whole answer, `ok` included (a rendered answer is a successful one).
#[derive(Serialize)]
struct Stats<'a> {
    ok: bool,
    sessions: Vec<Value>,
    devices: Vec<DeviceRow<'a>>,
    workers: Vec<WorkerRow>,
    uptime_ms: u64,
    latency_bounds_ns: &'static [u64],
}

/// One device's totals; `in_flight` is its commands running now.
#[derive(Serialize)]
struct DeviceRow<'a> {
    device: &'a str,
    reads: u64,
    writes: u64,
    read_bytes: u64,
    write_bytes: u64,
    errors: u64,
    read_latency: LatencyCounts,
    write_latency: LatencyCounts,
    in_flight: usize,
    offline: bool,
    size_bytes: u64,
    luns: Vec<MappedAs<'a>>,
    /// Only devices that can answer writes early have a write-back queue to show.
    #[serde(skip_serializing_if = "Option::is_none")]
    write_back_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    write_back_writes: Option<u64>,
}

/// Where a device is mapped: a target, a group and the LUN number there.
#[derive(Serialize)]
struct MappedAs<'a> {
    target: &'a str,
    group: &'a str,
    lun: u64,
}

/// A network worker's connections and busy share (its CPU time over the last second, busy
/// polling left out), as placement sees them.
#[derive(Serialize)]
struct WorkerRow {
    worker: usize,
    connections: i64,
    busy: f64,
}

/// `stats`, as the text of its answer.
pub(super) fn stats(shared: &Shared) -> String {
    let topology = shared.topology();
    let mut names: Vec<&std::sync::Arc<str>> = topology.devices.keys().collect();
    names.sort_unstable();
    let maps = edit::maps_by_device(&topology.config);
    let devices = names
        .into_iter()
        .filter_map(|name| {
            let device = topology.devices.get(name)?;
            let t = shared.metrics.device_totals(name);
            let write_back = device.unit.write_back();
            Some(DeviceRow {
                device: name,
                reads: t.reads,
                writes: t.writes,
                read_bytes: t.read_bytes,
                write_bytes: t.write_bytes,
                errors: t.errors,
                read_latency: t.read_latency,
                write_latency: t.write_latency,
                in_flight: device.unit.in_flight().count(),
                offline: device.unit.is_offline(),
                size_bytes: device.unit.capacity_bytes(),
                luns: (maps.get(&**name).into_iter().flatten())
                    .map(|(t, g, m)| MappedAs {
                        target: t.iqn.as_str(),
                        group: &g.name,
                        lun: m.lun,
                    })
                    .collect(),
                write_back_bytes: write_back.as_ref().map(|q| q.bytes),
                write_back_writes: write_back.as_ref().map(|q| q.writes),
            })
        })
        .collect();
    let workers = (0..shared.workers())
        .map(|i| WorkerRow {
            worker: i,
            connections: shared.metrics.worker_connections(i).get(),
            busy: shared.metrics.worker_busy(i).get(),
        })
        .collect();
    let stats = Stats {
        ok: true,
        sessions: super::session_rows(shared),
        devices,
        workers,
        uptime_ms: shared
            .started
            .elapsed()
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        latency_bounds_ns: &LATENCY_BOUNDS_NS,
    };
    rendered(&stats)
}

/// `luns`: every LUN of every group with its device's facts, and the devices no LUN maps.
#[derive(Serialize)]
struct Luns<'a> {
    ok: bool,
    luns: Vec<LunRow<'a>>,
    unmapped_devices: Vec<&'a String>,
}

#[derive(Serialize)]
struct LunRow<'a> {
    target: &'a str,
    group: &'a str,
    lun: u64,
    device: &'a str,
    store: &'a str,
    path: Option<String>,
    size_bytes: u64,
    block_size: u32,
    read_only: bool,
    write_cache: bool,
    /// Under RBD gateways (else null): whether this gateway ships the LU's commands to the
    /// image's owner, who owns it as this gateway knows, and whether that is this gateway.
    ships_to_owner: Option<bool>,
    direct: bool,
    offline: bool,
    serial: String,
    product: String,
    gateway_owner: Option<&'a str>,
    owner_here: Option<bool>,
}

/// `luns`, as the text of its answer.
pub(super) fn luns(shared: &Shared) -> String {
    let topology = shared.topology();
    // By name once: a lookup per LUN stays O(1) at 16,000 LUNs (a search per LUN made the
    // listing quadratic: 2.6 s of CPU there).
    let configs: HashMap<&str, &crate::config::DeviceConfig> = (topology.config.devices.iter())
        .map(|d| (d.name.as_str(), &**d))
        .collect();
    let mut luns = Vec::new();
    for t in &topology.targets {
        for (g, group) in t.config.groups.iter().zip(&t.groups) {
            for m in &g.luns {
                let Some(device) = topology.devices.get(m.device.as_str()) else {
                    continue;
                };
                let lu = &device.unit;
                let dc = configs.get(m.device.as_str());
                let settings = lu.settings();
                let identity = lu.identity();
                let ownership = device.ownership.as_ref();
                luns.push(LunRow {
                    target: t.iqn.as_str(),
                    group: &group.name,
                    lun: m.lun,
                    device: &m.device,
                    store: dc.map_or("?", |d| d.store.name()),
                    path: dc.and_then(|d| d.store.medium()),
                    size_bytes: lu.capacity_bytes(),
                    block_size: settings.block_size,
                    read_only: m.read_only || settings.read_only,
                    write_cache: lu.write_cache_enabled(),
                    ships_to_owner: ownership.map(|o| scsi::Ownership::ships(o.as_ref())),
                    direct: lu.capabilities().direct,
                    offline: lu.is_offline(),
                    serial: identity.serial.clone(),
                    product: identity.product.clone(),
                    gateway_owner: ownership.and_then(|o| o.owner_name()),
                    owner_here: ownership.map(|o| o.owns_here()),
                });
            }
        }
    }
    rendered(&Luns {
        ok: true,
        luns,
        unmapped_devices: super::unmapped(&topology.config),
    })
}

/// A typed answer's text. Its rows hold strings, integers, booleans and floats (serde_json
/// writes a NaN or an infinite float as null rather than failing), so this does not fail.
pub(super) fn rendered<T: Serialize>(answer: &T) -> String {
    serde_json::to_string(answer)
        .unwrap_or_else(|e| super::error(format!("internal error: {e}")).to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use crate::metrics::{IoCounts, LatencyCounts};

    const CONFIG: &str = r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[device]]
name = "d1"
store = "ram"
size = "1M"
[[device]]
name = "d0"
store = "ram"
size = "2M"
[[target]]
iqn = "iqn.2026-12.test:t"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "d0" }, { lun = 7, device = "d1", read_only = true } ]
[[device]]
name = "spare"
store = "ram"
size = "1M"
"#;

    /// The answer as the socket sends it and as the remote API gets it, its clock left out.
    fn answers(shared: &crate::shared::Shared) -> (Value, Value) {
        let request = br#"{"verb":"stats"}"#;
        let line = super::super::handle_line(shared, request);
        let mut sent: Value = serde_json::from_str(&line).expect("the line is JSON");
        let mut value = super::super::handle(shared, request);
        for answer in [&mut sent, &mut value] {
            answer
                .as_object_mut()
                .expect("an object")
                .remove("uptime_ms");
        }
        (sent, value)
    }

    #[test]
    fn every_device_has_its_totals_latencies_and_maps_in_name_order() {
        let shared = crate::shared::testing::shared(CONFIG);
        let io = IoCounts {
            reads: 3,
            read_bytes: 12288,
            writes: 1,
            write_bytes: 4096,
            ..IoCounts::default()
        };
        shared.metrics.add_io("d0", &io);
        let mut latency = LatencyCounts::default();
        latency.observe(std::time::Duration::from_micros(30));
        shared.metrics.add_latency("d0", "read", &latency);
        let (sent, value) = answers(&shared);
        assert_eq!(sent, value, "the line and the value are one answer");
        assert_eq!(sent["ok"], true);
        let devices = sent["devices"].as_array().expect("devices");
        let names: Vec<&str> = devices
            .iter()
            .filter_map(|d| d["device"].as_str())
            .collect();
        assert_eq!(names, ["d0", "d1", "spare"]);
        let d0 = &devices[0];
        assert_eq!(
            (d0["reads"].as_u64(), d0["read_bytes"].as_u64()),
            (Some(3), Some(12288))
        );
        assert_eq!(
            (d0["writes"].as_u64(), d0["write_bytes"].as_u64()),
            (Some(1), Some(4096))
        );
        assert_eq!(d0["size_bytes"], 2 << 20);
        assert_eq!(d0["offline"], false);
        let read = &d0["read_latency"];
        assert_eq!(
            (read["count"].as_u64(), read["sum_ns"].as_u64()),
            (Some(1), Some(30_000))
        );
        let buckets = read["buckets"].as_array().expect("buckets");
        assert_eq!(buckets.len(), crate::metrics::LATENCY_BOUNDS_NS.len() + 1);
        // 30 µs falls in the bucket up to 50 µs.
        let at: Vec<usize> = (buckets.iter().enumerate())
            .filter(|(_, n)| n.as_u64() != Some(0))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(at, [4]);
        assert_eq!(crate::metrics::LATENCY_BOUNDS_NS[4], 50_000);
        assert_eq!(d0["write_latency"]["count"], 0);
        assert_eq!(
            devices[1]["luns"],
            serde_json::json!([{"target": "iqn.2026-12.test:t", "group": "all", "lun": 7}])
        );
        assert!(
            d0.get("write_back_bytes").is_none(),
            "RAM answers no write early"
        );
        assert_eq!(sent["latency_bounds_ns"].as_array().map(Vec::len), Some(18));
        assert_eq!(sent["workers"][0]["worker"], 0);
        assert_eq!(sent["sessions"], serde_json::json!([]));
    }

    #[test]
    fn every_lun_has_its_devices_facts_and_unmapped_devices_are_named() {
        let shared = crate::shared::testing::shared(CONFIG);
        let line = super::super::handle_line(&shared, br#"{"verb":"luns"}"#);
        let answer: Value = serde_json::from_str(&line).expect("the line is JSON");
        assert_eq!(answer, super::super::handle(&shared, br#"{"verb":"luns"}"#));
        assert_eq!(answer["ok"], true);
        assert_eq!(answer["unmapped_devices"], serde_json::json!(["spare"]));
        let luns = answer["luns"].as_array().expect("luns");
        let at: Vec<(u64, &str)> = (luns.iter())
            .filter_map(|l| Some((l["lun"].as_u64()?, l["device"].as_str()?)))
            .collect();
        assert_eq!(at, [(0, "d0"), (7, "d1")]);
        let d1 = &luns[1];
        assert_eq!(
            (&d1["target"], &d1["group"], &d1["store"]),
            (&"iqn.2026-12.test:t".into(), &"all".into(), &"ram".into())
        );
        assert_eq!(
            (d1["read_only"].as_bool(), d1["size_bytes"].as_u64()),
            (Some(true), Some(1 << 20))
        );
        assert_eq!(luns[0]["read_only"], false);
        assert_eq!(d1["block_size"], 512);
        assert_eq!(
            (d1["path"].is_null(), d1["offline"].as_bool()),
            (true, Some(false))
        );
        assert_eq!(d1["product"], "RAM DISK");
        assert!(d1["serial"].as_str().is_some_and(|s| !s.is_empty()));
        for key in ["ships_to_owner", "gateway_owner", "owner_here"] {
            assert!(d1[key].is_null(), "{key}: no gateways here");
        }
    }
}
