//! A session's view of the array: who it is (the login's standing and admission), the topology
//! it runs on, its LUN map and its nexus; and the one rule for following a reload. Both doors'
//! backends hold one, and every turn and tick asks it whether the session may go on
//! (`Backend::still_admitted`). What it decides is computed from the topology of the moment and
//! the listeners; the backend acts on the verdict (log line, metric, close reason, meter).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use scsi::{LunEntry, LunMap, Nexus};

use crate::admission::{Admitted, Door, Refusal, Standing, TlsProof};
use crate::config::NodeName;
use crate::shared::listening::Listening;
use crate::topology::{DiskLun, GroupRuntime, TargetRuntime, Topology};

/// Who a backend serves: the session's (or NVMe queue's) identity and where it came from.
#[derive(Clone)]
pub(super) struct Party {
    pub(super) door: Door,
    /// Boxed: most sessions have none, and a parked connection keeps its party.
    pub(super) tls: Option<Box<TlsProof>>,
    pub(super) admitted: Admitted,
    /// Its target's name for this door (IQN or NQN; None for discovery).
    pub(super) target_name: Option<NodeName>,
    pub(super) initiator: NodeName,
    pub(super) peer: SocketAddr,
    pub(super) local: SocketAddr,
    pub(super) portal_group_tag: u16,
}

pub(super) struct View {
    /// Who the session is and where it came from, as its login admitted it; `admitted` is
    /// confirmed by every topology since ([`View::follow`]), its membership `topology`'s.
    pub(super) party: Party,
    /// The topology the session's LUN map and membership come from; replaced by a newer one at
    /// the start of a turn after a reload ([`View::follow`]).
    pub(super) topology: Arc<Topology>,
    pub(super) luns: Option<Arc<LunMap>>,
    /// LUNs of this session backed by a real disk: durable operations, and buffered writes while
    /// the device stalls, run on the blocking pool.
    pub(super) disk_luns: Arc<Vec<DiskLun>>,
    pub(super) nexus: Option<Nexus>,
    /// Unit attentions: when the nexus joined its group and when its LUN map last changed
    /// (`scsi::unit_attention::stamp`s), and the LUs it has addressed since (by address; each
    /// was given its unit-attention queue then, [`View::first_use`]).
    attention: Attention,
    /// A reload closed the listener the session came in through (or moved it to another
    /// portal group): an iSCSI session is asked to log out, as at shutdown.
    pub(super) portal_gone: bool,
}

#[derive(Default)]
struct Attention {
    joined: u64,
    map_changed: Option<u64>,
    used: HashSet<usize>,
    /// The LU the last command addressed, the common case of the per-command check.
    last: usize,
}

/// What a newer topology means for a session ([`View::follow`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It goes on; `map_changed`: its LUN map is another now (its counts go to new devices).
    Stay { map_changed: bool },
    /// Its portal (listener or portal group) is gone: it leaves as at shutdown, on the map it
    /// had.
    PortalGone,
    /// A login now would not be admitted to the same group with the same proof: it closes.
    Close(Refusal),
}

impl View {
    /// The view of `party` under `topology`; its nexus and LUN map are set next.
    pub(super) fn new(party: Party, topology: &Arc<Topology>) -> View {
        View {
            party,
            topology: Arc::clone(topology),
            luns: None,
            disk_luns: Arc::new(Vec::new()),
            nexus: None,
            attention: Attention::default(),
            portal_gone: false,
        }
    }

    /// The session's nexus, made at its login into `group`'s LUN map. Its LUs learn of it as
    /// it addresses them ([`View::first_use`]): a queue in each LU of a group of thousands cost
    /// every session ~40 bytes per LU, and its first command the time to make them.
    pub(super) fn join(&mut self, nexus: Nexus, group: &GroupRuntime) {
        self.nexus = Some(nexus);
        self.attention = Attention {
            joined: scsi::unit_attention::stamp(),
            ..Attention::default()
        };
        self.use_group(group);
    }

    /// Every command passes here before its LU sees it: the LU behind `lun`, at the nexus's
    /// first command to it, makes the nexus's unit-attention queue (POWER ON, RESET first). Only
    /// through the iSCSI door: NVMe has no unit attentions (docs/NVME.md).
    pub(super) fn first_use(&mut self, lun: u64) {
        let (Some(nexus), Some(luns), true) = (
            &self.nexus,
            &self.luns,
            self.party.door.gives_unit_attentions(),
        ) else {
            return;
        };
        let Some(entry) = luns.get(lun) else {
            return;
        };
        let key = Arc::as_ptr(&entry.lu) as usize;
        let a = &mut self.attention;
        if key != a.last && a.used.insert(key) {
            entry.lu.nexus_first_use(nexus.id, a.joined, a.map_changed);
        }
        a.last = key;
    }

    /// Takes the LUN map (and what goes with it) of `group` for this session.
    pub(super) fn use_group(&mut self, group: &GroupRuntime) {
        self.luns = Some(Arc::clone(&group.luns));
        self.disk_luns = Arc::clone(&group.disk_luns);
        debug_assert!(
            self.disk_luns.windows(2).all(|w| w[0].lun < w[1].lun),
            "a group's disks are sorted by LUN (`disk` searches them)"
        );
    }

    /// The session's target and group in the topology it runs on (normal sessions).
    pub(super) fn group(&self) -> Option<(&TargetRuntime, &GroupRuntime)> {
        let membership = self.party.admitted.membership()?;
        self.topology.group_of(membership)
    }

    /// The session's standing, as a login now would present it.
    fn standing(&self) -> Standing<'_> {
        Standing {
            door: self.party.door,
            tls: self.party.tls.as_deref(),
            initiator: &self.party.initiator,
            target_name: self.party.target_name.as_ref(),
            portal_group_tag: self.party.portal_group_tag,
            source: self.party.peer.ip(),
        }
    }

    /// Whether `next` lets the session go on, and it moved there when it does: admitted again
    /// by the login's own decision ([`Topology::readmit`]), then its group's LUN map as the
    /// reload left it (REPORTED LUNS DATA HAS CHANGED on its nexus when that map changed) and
    /// its port's ALUA states. A session already asked to leave stays on what it had. Called
    /// at the start of a turn, when no command of the turn is half-handled, and by the tick,
    /// so an idle session is judged too.
    pub(super) fn follow(&mut self, next: Arc<Topology>, listening: &Listening) -> Verdict {
        if self.portal_gone || next.generation == self.topology.generation {
            return Verdict::Stay { map_changed: false };
        }
        let admitted = match next.readmit(&self.standing(), &self.party.admitted) {
            Ok(admitted) => admitted,
            // Its portal group went (the target stays, elsewhere): told like its listener.
            Err(Refusal::NotOnThisPortal) => return self.portal_is_gone(),
            Err(refusal) => return Verdict::Close(refusal),
        };
        let mut map_changed = false;
        if let Some((target, group)) = admitted.membership().and_then(|m| next.group_of(m)) {
            map_changed = self.follow_lun_map(group);
            self.follow_port(target);
        }
        self.party.admitted = admitted;
        self.topology = next;
        if !listening.reaches(
            self.party.door,
            self.party.portal_group_tag,
            self.party.local,
        ) {
            return self.portal_is_gone();
        }
        Verdict::Stay { map_changed }
    }

    fn portal_is_gone(&mut self) -> Verdict {
        self.portal_gone = true;
        Verdict::PortalGone
    }

    /// Takes the session's target port of a newer topology when its ALUA states changed (a
    /// live `alua_state` change). A shipped nexus keeps its own: its states are the owner's.
    fn follow_port(&mut self, target: &TargetRuntime) {
        let Some(nexus) = &mut self.nexus else {
            return;
        };
        match target.ports.get(&self.party.portal_group_tag) {
            Some(port) if !nexus.target_port.shipped && port.groups != nexus.target_port.groups => {
                nexus.target_port = if nexus.target_port.relative_id == scsi::ANY_PORT {
                    // An NVMe host's nexus keeps its port ID (its registrations are the host's).
                    Arc::new(port.any_port())
                } else {
                    debug_assert_eq!(port.relative_id, nexus.target_port.relative_id);
                    Arc::clone(port)
                };
            }
            _ => {}
        }
    }

    /// Takes `group`'s LUN map of a newer topology (the session's own group): LUs it drops
    /// forget the nexus, and every LU of the map tells the nexus its LUNs changed (those it
    /// has not addressed yet, at its first command to them). Returns whether the map is
    /// another (not only new handles).
    pub(super) fn follow_lun_map(&mut self, group: &GroupRuntime) -> bool {
        let unchanged = self
            .luns
            .as_deref()
            .is_some_and(|old| same_lun_map(old, &group.luns));
        if let (Some(nexus), false) = (&self.nexus, unchanged) {
            let old: &[LunEntry] = self.luns.as_deref().map_or(&[], LunMap::entries);
            // The LUs of each map by address, once: a search per LU made a map change at
            // 16,000 LUNs quadratic, in every session of the group.
            let lus = |entries: &[LunEntry]| -> HashSet<*const scsi::LogicalUnit> {
                entries.iter().map(|e| Arc::as_ptr(&e.lu)).collect()
            };
            let after = lus(group.luns.entries());
            let a = &mut self.attention;
            for entry in old {
                let lu = Arc::as_ptr(&entry.lu);
                if !after.contains(&lu) {
                    entry.lu.nexus_lost(nexus.id);
                    a.used.remove(&(lu as usize));
                }
            }
            a.last = 0;
            a.map_changed = Some(scsi::unit_attention::stamp());
            for entry in group.luns.entries() {
                if a.used.contains(&(Arc::as_ptr(&entry.lu) as usize)) {
                    entry.lu.reported_luns_changed_for(nexus.id);
                }
            }
        }
        self.use_group(group);
        !unchanged
    }

    /// Whether this gateway lost the ownership of an RBD image the session maps since the
    /// session's nexus was made.
    pub(super) fn lost_an_image(&self) -> bool {
        match (&self.luns, &self.nexus) {
            (Some(luns), Some(nexus)) => luns
                .entries()
                .iter()
                .any(|e| e.lu.nexus_outlived_ownership(nexus)),
            _ => false,
        }
    }

    /// The LU behind `lun` and its device's stall state, when it is backed by a real disk.
    pub(super) fn disk_lu(&self, lun: u64) -> Option<(&DiskLun, &LunEntry)> {
        Some((self.disk(lun)?, self.luns.as_deref()?.get(lun)?))
    }

    /// The disk behind `lun`, when it is backed by a real disk: a binary search of the
    /// group's disks, which the topology sorts by LUN (a command's cost must not grow with
    /// the LUNs of its group).
    pub(super) fn disk(&self, lun: u64) -> Option<&DiskLun> {
        let at = self.disk_luns.binary_search_by_key(&lun, |d| d.lun).ok()?;
        self.disk_luns.get(at)
    }
}

/// Whether two LUN maps show an initiator the same LUNs: same numbers, same LUs, same
/// read-only flags.
pub(super) fn same_lun_map(a: &LunMap, b: &LunMap) -> bool {
    a.entries().len() == b.entries().len()
        && a.entries()
            .iter()
            .zip(b.entries())
            .all(|(x, y)| x.lun == y.lun && Arc::ptr_eq(&x.lu, &y.lu) && x.read_only == y.read_only)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::listening::Listening;
    use crate::topology::portals::{ListenerKind, PortalListener};
    use crate::topology::{DeviceContext, OpenDevices};

    const TARGET: &str = "iqn.2026-12.test:t";
    const SUBSYSTEM: &str = "nqn.2026-12.test:t";
    const HOST: &str = "iqn.2026-12.test:host";
    const HOST_NQN: &str = "nqn.2026-12.test:host";

    /// A config of one target (also an NVMe subsystem) whose group `a` maps `luns` (TOML) to
    /// `a_members`, group `b` has `b_members`; devices d0 and d1 (RAM).
    fn config(luns: &str, a_members: &str, b_members: &str) -> crate::config::Config {
        let text = format!(
            r#"[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
nvme_listen = ["127.0.0.1:4420"]
nvme_discovery_listen = []
[[device]]
name = "d0"
store = "ram"
size = "1M"
[[device]]
name = "d1"
store = "ram"
size = "1M"
[[target]]
iqn = "{TARGET}"
nqn = "{SUBSYSTEM}"
  [[target.group]]
  name = "a"
  initiators = [{a_members}]
  luns = [{luns}]
  [[target.group]]
  name = "b"
  initiators = [{b_members}]
  luns = []
"#
        );
        crate::config::Config::from_toml_str(&text, "test").expect("a valid config")
    }

    const BOTH: &str = r#""iqn.2026-12.test:host", "nqn.2026-12.test:host""#;
    const NOBODY: &str = r#""iqn.2026-12.test:nobody""#;
    const D0: &str = r#"{ lun = 0, device = "d0" }"#;
    const D0_D1: &str = r#"{ lun = 0, device = "d0" }, { lun = 1, device = "d1" }"#;

    /// The topology of `config` at `generation`, its devices opened once across generations
    /// (in `open`), so that a reload keeps an LU as a real one does.
    fn topology(
        config: crate::config::Config,
        generation: u64,
        open: &mut OpenDevices,
    ) -> Arc<Topology> {
        let context = DeviceContext::new(&config, Default::default());
        for device in &config.devices {
            if !open.contains_key(device.name.as_str()) {
                let opened = context.open(device, &config).expect("a RAM device opens");
                open.insert(device.name.as_str().into(), opened);
            }
        }
        Arc::new(Topology::assemble(config, open.clone(), generation).expect("assembled"))
    }

    /// An open listener of `kind` for portal group 1 on a loopback port: its address.
    fn listening(kind: ListenerKind) -> (Listening, SocketAddr) {
        let listening = Listening::default();
        let wanted = PortalListener {
            addr: "127.0.0.1:0".parse().expect("an address"),
            tag: 1,
            kind,
            required: true,
        };
        let plan = listening.prepare(&[wanted]).expect("a loopback port");
        let at = plan.bound(kind)[0];
        listening.start(plan);
        (listening, at)
    }

    /// A session of `door` logged in under `topology` through `local`.
    fn logged_in(door: Door, topology: &Arc<Topology>, local: SocketAddr) -> View {
        let (initiator, target) = match door {
            Door::Iscsi => (HOST, TARGET),
            Door::Nvme => (HOST_NQN, SUBSYSTEM),
        };
        let party = super::super::testing::party(door, topology, initiator, target, local);
        let mut view = View::new(party, topology);
        super::super::testing::join(&mut view);
        view
    }

    /// The unit attentions `view`'s nexus is given by `lu`, in order (TEST UNIT READY until
    /// it answers GOOD), through the first-use check every command passes when `lu` is mapped.
    fn attentions(view: &mut View, lu: &scsi::LogicalUnit) -> Vec<(u8, u8)> {
        let mapped = view.luns.as_ref().and_then(|l| {
            l.entries()
                .iter()
                .find(|e| std::ptr::eq(Arc::as_ptr(&e.lu), lu))
                .map(|e| e.lun)
        });
        if let Some(lun) = mapped {
            view.first_use(lun);
        }
        let nexus = view.nexus.as_ref().expect("a nexus");
        let tur = scsi::Command {
            cdb: &[0u8; 6],
            data_out: &[],
            data_in_limit: 0,
        };
        let mut seen = Vec::new();
        for _ in 0..8 {
            let done = lu.execute(nexus, &tur, &mut Vec::new());
            match done.sense {
                Some(sense) if sense.key == scsi::sense::UNIT_ATTENTION => {
                    seen.push((sense.asc, sense.ascq))
                }
                _ => return seen,
            }
        }
        panic!("unit attentions without end: {seen:?}");
    }

    fn lu(topology: &Topology, device: &str) -> Arc<scsi::LogicalUnit> {
        Arc::clone(&topology.devices[device].unit)
    }

    /// A group whose config lists its LUNs out of order finds each LUN's disk (a binary
    /// search: the topology sorts them).
    #[test]
    fn each_lun_finds_its_disk_whatever_the_order_of_the_config() {
        let dir =
            std::path::PathBuf::from(format!("/var/tmp/ferrosan-view-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory on a disk");
        let mut text = String::from("[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n");
        let order = [5u64, 1, 9, 3, 7];
        for n in order {
            text += &format!(
                "[[device]]\nname = \"f{n}\"\nstore = \"file\"\npath = \"{}/f{n}.img\"\nsize = \"1M\"\n",
                dir.display()
            );
        }
        text += &format!("[[target]]\niqn = \"{TARGET}\"\n  [[target.group]]\n  name = \"a\"\n  initiators = [{BOTH}]\n  luns = [");
        for n in order {
            text += &format!("{{ lun = {n}, device = \"f{n}\" }}, ");
        }
        text += "]\n";
        let config = crate::config::Config::from_toml_str(&text, "test").expect("a valid config");
        let topology = topology(config, 1, &mut OpenDevices::default());
        let (_listening, at) = listening(ListenerKind::Iscsi);
        let view = logged_in(Door::Iscsi, &topology, at);
        let disks = view.disk_luns.len();
        assert_eq!(disks, order.len(), "every file on a disk is a disk LUN");
        for n in order {
            assert_eq!(view.disk(n).map(|d| d.lun), Some(n), "{disks} disks");
            assert!(view.disk_lu(n).is_some());
        }
        assert!(view.disk(2).is_none() && view.disk(10).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    const POWER_ON: (u8, u8) = (0x29, 0x00);
    const LUNS_CHANGED: (u8, u8) = (0x3F, 0x0E);

    #[test]
    fn a_mapped_lu_tells_an_iscsi_nexus_and_never_an_nvme_one() {
        for (door, kind) in [
            (Door::Iscsi, ListenerKind::Iscsi),
            (Door::Nvme, ListenerKind::Nvme),
        ] {
            let mut open = OpenDevices::default();
            let first = topology(config(D0, BOTH, NOBODY), 1, &mut open);
            let (listening, local) = listening(kind);
            let mut view = logged_in(door, &first, local);
            let next = topology(config(D0_D1, BOTH, NOBODY), 2, &mut open);
            let verdict = view.follow(Arc::clone(&next), &listening);
            assert_eq!(verdict, Verdict::Stay { map_changed: true }, "{door:?}");
            assert_eq!(view.topology.generation, 2);
            assert_eq!(view.luns.as_ref().map(|l| l.entries().len()), Some(2));
            let (d0, d1) = (
                attentions(&mut view, &lu(&next, "d0")),
                attentions(&mut view, &lu(&next, "d1")),
            );
            match door {
                Door::Iscsi => {
                    assert_eq!(d0, [POWER_ON, LUNS_CHANGED]);
                    assert_eq!(d1, [POWER_ON, LUNS_CHANGED]);
                }
                Door::Nvme => assert!(d0.is_empty() && d1.is_empty(), "{d0:?} {d1:?}"),
            }
        }
    }

    #[test]
    fn an_unmapped_lu_forgets_the_nexus_and_an_unchanged_map_tells_nothing() {
        let mut open = OpenDevices::default();
        let first = topology(config(D0_D1, BOTH, NOBODY), 1, &mut open);
        let (listening, local) = listening(ListenerKind::Iscsi);
        let mut view = logged_in(Door::Iscsi, &first, local);
        assert_eq!(attentions(&mut view, &lu(&first, "d1")), [POWER_ON]);
        // The same map again: new handles, nothing for the initiator to see.
        let same = topology(config(D0_D1, BOTH, NOBODY), 2, &mut open);
        let verdict = view.follow(Arc::clone(&same), &listening);
        assert_eq!(verdict, Verdict::Stay { map_changed: false });
        assert!(Arc::ptr_eq(
            view.luns.as_ref().unwrap(),
            &same.targets[0].groups[0].luns
        ));
        assert_eq!(attentions(&mut view, &lu(&same, "d0")), [POWER_ON]);
        // d1 unmapped: it forgets the nexus (no attention queued for it any more).
        lu(&same, "d1").reported_luns_changed_for(view.nexus.as_ref().unwrap().id);
        let fewer = topology(config(D0, BOTH, NOBODY), 3, &mut open);
        assert_eq!(
            view.follow(fewer, &listening),
            Verdict::Stay { map_changed: true }
        );
        assert_eq!(attentions(&mut view, &lu(&same, "d0")), [LUNS_CHANGED]);
        assert!(attentions(&mut view, &lu(&same, "d1")).is_empty());
    }

    /// An LU learns of a nexus at its first command, and tells it then what it would have
    /// told it since the login: not what came before, and in order with a map change.
    #[test]
    fn an_lu_first_addressed_late_tells_what_was_raised_since_the_login() {
        let mut open = OpenDevices::default();
        let first = topology(config(D0, BOTH, NOBODY), 1, &mut open);
        let (listening, local) = listening(ListenerKind::Iscsi);
        lu(&first, "d0").capacity_changed();
        let mut view = logged_in(Door::Iscsi, &first, local);
        lu(&first, "d0").capacity_changed();
        let next = topology(config(D0_D1, BOTH, NOBODY), 2, &mut open);
        assert_eq!(
            view.follow(Arc::clone(&next), &listening),
            Verdict::Stay { map_changed: true }
        );
        lu(&next, "d1").capacity_changed();
        const CAPACITY: (u8, u8) = (0x2A, 0x09);
        assert_eq!(
            attentions(&mut view, &lu(&next, "d0")),
            [POWER_ON, CAPACITY, LUNS_CHANGED]
        );
        assert_eq!(
            attentions(&mut view, &lu(&next, "d1")),
            [POWER_ON, LUNS_CHANGED, CAPACITY]
        );
        // Addressed: later conditions queue as they come.
        lu(&next, "d1").capacity_changed();
        assert_eq!(attentions(&mut view, &lu(&next, "d1")), [CAPACITY]);
    }

    #[test]
    fn a_session_moved_to_another_group_closes_and_keeps_what_it_had() {
        let mut open = OpenDevices::default();
        let first = topology(config(D0, BOTH, NOBODY), 1, &mut open);
        let (listening, local) = listening(ListenerKind::Iscsi);
        let mut view = logged_in(Door::Iscsi, &first, local);
        let moved = topology(config(D0, NOBODY, BOTH), 2, &mut open);
        assert_eq!(
            view.follow(moved, &listening),
            Verdict::Close(Refusal::GroupChanged)
        );
        assert_eq!(view.topology.generation, 1);
        assert!(!view.portal_gone);
    }

    #[test]
    fn a_removed_listener_sends_the_session_away_once() {
        let mut open = OpenDevices::default();
        let first = topology(config(D0, BOTH, NOBODY), 1, &mut open);
        let (listening, local) = listening(ListenerKind::Iscsi);
        let mut view = logged_in(Door::Iscsi, &first, local);
        // Another door's listener does not stand in for the session's own.
        let (nvme_only, _) = self::listening(ListenerKind::Nvme);
        let again = topology(config(D0, BOTH, NOBODY), 2, &mut open);
        assert_eq!(view.follow(again, &nvme_only), Verdict::PortalGone);
        assert!(view.portal_gone);
        // Asked to leave: it ends on what it had, whatever comes next.
        let moved = topology(config(D0, NOBODY, BOTH), 3, &mut open);
        assert_eq!(
            view.follow(moved, &listening),
            Verdict::Stay { map_changed: false }
        );
        assert_eq!(view.topology.generation, 2);
    }
}
