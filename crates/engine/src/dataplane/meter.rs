//! What a session's commands counted, per mapped LUN, between two reports to the shared
//! metrics (once a second): reads, writes, bytes, errors and latencies, kept in plain
//! integers so the command path touches no shared memory; and the turn's clock (a command run
//! inline is complete when the turn that ran it has queued its answers).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use seam::{Loan, ScsiRequest};

use crate::admission::registry::SessionInfo;
use crate::config::NodeName;
use crate::metrics::{IoCounts, LatencyCounts, Metrics};

/// One LUN's I/O on this connection, counted without atomics.
pub(super) struct DeviceIo {
    pub(super) device: Arc<str>,
    pub(super) counts: IoCounts,
    /// Latencies of reads ([`OP_READ`]) and writes ([`OP_WRITE`]).
    pub(super) latency: [LatencyCounts; 2],
}

pub(super) const OP_READ: usize = 0;
pub(super) const OP_WRITE: usize = 1;
pub(super) const OP_NAMES: [&str; 2] = ["read", "write"];

pub(super) fn op_index(kind: scsi::IoKind) -> Option<usize> {
    match kind {
        scsi::IoKind::Read => Some(OP_READ),
        scsi::IoKind::Write => Some(OP_WRITE),
        scsi::IoKind::Other => None,
    }
}

pub(super) struct Meter {
    metrics: Arc<Metrics>,
    /// For the log line of a command refused for lack of resources.
    peer: SocketAddr,
    initiator: NodeName,
    /// What `ctl sessions` shows of this session (its counters get `io`'s once a second).
    pub(super) info: Option<Arc<SessionInfo>>,
    /// The session's LUN map: (LUN, device), the group's, shared.
    devices: Arc<Vec<(u64, Arc<str>)>>,
    /// I/O since the last report of each LUN this session has used, in the order of first
    /// use: made at a LUN's first command, so a session's counters cost what it uses, not
    /// what its group maps (~0.5 KiB a LUN: 2 MiB a session at 4,096 LUNs).
    pub(super) io: Vec<DeviceIo>,
    /// Each used LUN's slot in `io`.
    slots: std::collections::HashMap<u64, usize>,
    /// When the current turn started handling PDUs: a command is complete in the target then.
    pub(super) turn_started: Instant,
    /// Reads and writes (slot in `io`, op index) run inline this turn; their latency is taken
    /// once, when the turn has queued all its responses.
    turn_inline: Vec<(usize, usize)>,
    /// When the last turn that ran reads or writes inline had queued its responses: the
    /// coalescer plans from it instead of reading the clock again (one read per turn saved).
    pub(super) turn_ended: Option<Instant>,
}

impl Meter {
    pub(super) fn new(metrics: Arc<Metrics>, peer: SocketAddr, initiator: NodeName) -> Meter {
        Meter {
            metrics,
            peer,
            initiator,
            info: None,
            devices: Arc::default(),
            io: Vec::new(),
            slots: std::collections::HashMap::new(),
            turn_started: Instant::now(),
            turn_inline: Vec::new(),
            turn_ended: None,
        }
    }

    /// Counts from now on for `devices` (LUN, device name), the session's LUN map; what was
    /// counted under the map before is reported first.
    pub(super) fn count_for(&mut self, devices: &Arc<Vec<(u64, Arc<str>)>>) {
        self.report_io();
        self.devices = Arc::clone(devices);
        self.io.clear();
        self.slots.clear();
        // Their slots name the old map: this turn's inline commands lose their latency sample
        // (a map change is rare), never count it on another LUN.
        self.turn_inline.clear();
    }

    /// The slot in `io` of `lun`, made at its first use; None for a LUN not in the map.
    fn slot_of(&mut self, lun: u64) -> Option<usize> {
        if let Some(&slot) = self.slots.get(&lun) {
            return Some(slot);
        }
        let (_, device) = self.devices.iter().find(|(l, _)| *l == lun)?;
        self.io.push(DeviceIo {
            device: Arc::clone(device),
            counts: IoCounts::default(),
            latency: [LatencyCounts::default(); 2],
        });
        let slot = self.io.len() - 1;
        self.slots.insert(lun, slot);
        debug_assert_eq!(self.io.len(), self.slots.len(), "one slot per used LUN");
        Some(slot)
    }

    /// Counts one finished command: `data_bytes` is its Data-In (reads) or Data-Out (writes).
    /// Returns the LUN's slot in `io` (None for a LUN not mapped to this session) for the
    /// command's other statistics, so the slot is looked up once per command.
    pub(super) fn record_io(
        &mut self,
        lun: u64,
        kind: scsi::IoKind,
        status: u8,
        sense: &[u8],
        data_bytes: usize,
    ) -> Option<usize> {
        let index = self.slot_of(lun)?;
        let slot = self.io.get_mut(index)?;
        let good = status == 0;
        let counts = &mut slot.counts;
        if !good {
            match crate::metrics::error_cause(status, sense) {
                Some(cause) => {
                    if let Some(n) = counts.errors.get_mut(cause) {
                        // A limit of the target's refused the command: said once per
                        // connection, LUN and second (counts are reset once a second).
                        if *n == 0
                            && crate::metrics::ERROR_CAUSES.get(cause)
                                == Some(&"insufficient_resources")
                        {
                            tracing::warn!(peer = %self.peer, initiator = %self.initiator, lun, device = %slot.device, "a command was refused for lack of resources (INSUFFICIENT RESOURCES, 55h): e.g. the device's persistent reservation registrations are at their limit ({})", scsi::REGISTRATIONS_MAX);
                        }
                        *n += 1;
                    }
                }
                None => counts.unit_attentions += 1,
            }
        }
        let bytes = if good { data_bytes as u64 } else { 0 };
        match kind {
            scsi::IoKind::Read => {
                counts.reads += 1;
                counts.read_bytes += bytes;
            }
            scsi::IoKind::Write => {
                counts.writes += 1;
                counts.write_bytes += bytes;
            }
            scsi::IoKind::Other => {}
        }
        Some(index)
    }

    /// Counts the latency of one read or write of the LUN in slot `slot` of `io`.
    pub(super) fn record_latency(&mut self, slot: usize, op: usize, latency: Duration) {
        if let Some(counts) = self
            .io
            .get_mut(slot)
            .and_then(|device| device.latency.get_mut(op))
        {
            counts.observe(latency);
        }
    }

    /// The turn has queued its responses: the reads and writes it ran inline took until now.
    pub(super) fn finish_turn(&mut self) {
        if self.turn_inline.is_empty() {
            self.turn_ended = None;
            return;
        }
        let ended = Instant::now();
        self.turn_ended = Some(ended);
        let latency = ended.saturating_duration_since(self.turn_started);
        let mut inline = std::mem::take(&mut self.turn_inline);
        for &(slot, op) in &inline {
            self.record_latency(slot, op, latency);
        }
        inline.clear();
        self.turn_inline = inline;
    }

    /// Adds what this connection counted to the shared per-device metrics (once a second,
    /// and at the end).
    pub(super) fn report_io(&mut self) {
        for slot in &mut self.io {
            if slot.counts != IoCounts::default() {
                self.metrics.add_io(&slot.device, &slot.counts);
                if let Some(info) = &self.info {
                    let c = &slot.counts;
                    info.add_io(c.reads, c.writes, c.read_bytes, c.write_bytes);
                    if let Some(target) = &info.target {
                        self.metrics.add_initiator_io(target, &info.initiator, c);
                    }
                }
                slot.counts = IoCounts::default();
            }
            for (op, counts) in slot.latency.iter_mut().enumerate() {
                if counts.count > 0 {
                    let name = OP_NAMES.get(op).copied().unwrap_or("other");
                    self.metrics.add_latency(&slot.device, name, counts);
                    if let Some(info) = &self.info {
                        info.add_latency(op, counts);
                    }
                    *counts = LatencyCounts::default();
                }
            }
        }
    }

    /// Counts a command run inline in the device's I/O metrics (its latency at the turn's end).
    pub(super) fn record_inline(
        &mut self,
        lun: u64,
        req: &ScsiRequest<'_>,
        data_in: &[u8],
        lent: &Loan,
        sense: &[u8],
        status: u8,
    ) {
        let kind = scsi::io_kind(req.cdb);
        let data_bytes = match kind {
            scsi::IoKind::Read => {
                // Per the ScsiBackend contract `lent` arrived empty and `data_in` now holds exactly
                // the Data-In (a reused read buffer's old length says nothing).
                let lent_bytes: usize = lent
                    .slices
                    .iter()
                    .map(|(_, range)| range.len())
                    .sum::<usize>()
                    + lent.file.as_ref().map_or(0, |(_, _, len)| *len);
                (data_in.len() + lent_bytes).min(req.expected_len as usize)
            }
            _ => req.data_out.len(),
        };
        if let Some(slot) = self.record_io(lun, kind, status, sense, data_bytes) {
            if let Some(op) = op_index(kind) {
                self.turn_inline.push((slot, op));
            }
            if let (Some((_, _, len)), Some(device)) = (&lent.file, self.io.get_mut(slot)) {
                device.counts.sendfile_bytes += (*len).min(req.expected_len as usize) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meter() -> (Meter, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let initiator = NodeName::from_wire("iqn.2026-12.test:i").unwrap();
        let mut m = Meter::new(
            Arc::clone(&metrics),
            "127.0.0.1:1".parse().unwrap(),
            initiator,
        );
        m.count_for(&Arc::new(vec![
            (0, Arc::from("ram0")),
            (3, Arc::from("disk3")),
        ]));
        (m, metrics)
    }

    #[test]
    fn a_session_counts_only_the_luns_it_uses_and_keeps_counts_across_a_map_change() {
        let (mut m, metrics) = meter();
        let big: Vec<(u64, Arc<str>)> = (0..4096)
            .map(|lun| (lun, Arc::from(format!("d{lun}").as_str())))
            .collect();
        m.record_io(0, scsi::IoKind::Read, 0, &[], 512);
        m.count_for(&Arc::new(big));
        assert_eq!(
            metrics.device_totals("ram0").reads,
            1,
            "reported at the change"
        );
        assert!(m.io.is_empty(), "nothing made before a LUN is used");
        assert_eq!(m.record_io(4000, scsi::IoKind::Write, 0, &[], 512), Some(0));
        assert_eq!(m.record_io(7, scsi::IoKind::Read, 0, &[], 512), Some(1));
        assert_eq!(m.record_io(4000, scsi::IoKind::Write, 0, &[], 512), Some(0));
        assert_eq!(m.record_io(5000, scsi::IoKind::Read, 0, &[], 512), None);
        assert_eq!(m.io.len(), 2);
        m.report_io();
        assert_eq!(metrics.device_totals("d4000").writes, 2);
    }

    #[test]
    fn commands_count_on_their_lun_and_reach_the_metrics_once_reported() {
        let (mut m, metrics) = meter();
        assert_eq!(m.record_io(0, scsi::IoKind::Read, 0, &[], 4096), Some(0));
        assert_eq!(m.record_io(3, scsi::IoKind::Write, 0, &[], 512), Some(1));
        // A failed command counts, its bytes do not.
        m.record_io(
            3,
            scsi::IoKind::Write,
            2,
            &[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24],
            512,
        );
        assert_eq!(
            m.record_io(7, scsi::IoKind::Read, 0, &[], 1),
            None,
            "not mapped"
        );
        assert_eq!(
            metrics.device_totals("ram0").reads,
            0,
            "not before the report"
        );
        m.report_io();
        let (ram, disk) = (
            metrics.device_totals("ram0"),
            metrics.device_totals("disk3"),
        );
        assert_eq!((ram.reads, ram.read_bytes), (1, 4096));
        assert_eq!((disk.writes, disk.write_bytes, disk.errors), (2, 512, 1));
        m.report_io();
        assert_eq!(metrics.device_totals("ram0").reads, 1, "reported once");
    }

    #[test]
    fn a_turns_inline_commands_take_its_length_once_and_an_empty_turn_reads_no_clock() {
        let (mut m, metrics) = meter();
        m.finish_turn();
        assert_eq!(m.turn_ended, None, "nothing ran inline");
        m.turn_started = Instant::now() - Duration::from_millis(2);
        let slot = m.record_io(0, scsi::IoKind::Read, 0, &[], 4096).unwrap();
        m.turn_inline.push((slot, OP_READ));
        m.finish_turn();
        let ended = m.turn_ended.expect("the turn's end, for the coalescer");
        assert!(ended >= m.turn_started + Duration::from_millis(2));
        assert!(m.turn_inline.is_empty());
        m.report_io();
        let timed = metrics.device_totals("ram0").read_latency;
        assert_eq!(timed.count, 1);
        assert!(timed.sum_ns >= 2_000_000);
    }
}
