//! What an NVMe controller shows of its subsystem: the namespaces of its host's LUN map (NSID
//! = LUN + 1), with the identity the device has over iSCSI, and their ANA states through the
//! controller's port — the ALUA states of the same target port group, decided by the same
//! function (`LogicalUnit::access_state`).

use nvme::controller::NamespaceView;
use nvme::identify;
use nvme::log::{AnaGroup, AnaState};
use scsi::{AccessState, LunMap, TargetPort};

/// The namespaces a controller shows, their ANA groups (one per namespace, numbered as it is,
/// so each device's state stands alone), and whether any has its write cache on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Namespaces {
    pub(crate) views: Vec<NamespaceView>,
    pub(crate) ana: Vec<AnaGroup>,
    pub(crate) write_cache: bool,
}

/// The highest NSID a subsystem may show: that of the highest LUN a group may map.
pub(crate) const NSID_MAX: u32 = scsi::LUN_MAX as u32 + 1;

/// The NSID of LUN `lun` (None beyond what an NSID can name).
pub(crate) fn nsid_of(lun: u64) -> Option<u32> {
    u32::try_from(lun + 1).ok().filter(|&n| n < u32::MAX - 1)
}

/// The LUN of NSID `nsid` (None for 0 and the broadcast value).
pub(crate) fn lun_of(nsid: u32) -> Option<u64> {
    (nsid != 0 && nsid != u32::MAX).then(|| u64::from(nsid) - 1)
}

pub(crate) fn ana_state(state: AccessState) -> AnaState {
    match state {
        AccessState::ActiveOptimized => AnaState::Optimized,
        AccessState::ActiveNonOptimized => AnaState::NonOptimized,
        AccessState::Standby | AccessState::Unavailable => AnaState::Inaccessible,
        AccessState::Transitioning => AnaState::Change,
    }
}

/// A device's three NVMe identifiers from its SCSI identity: the NAA designator as EUI-64
/// (its first 8 bytes) and as NGUID (zero-padded), and a UUID made from the NGUID (version 8,
/// RFC 9562's custom layout). The same device shows the same through every port and gateway.
pub(crate) fn identifiers(identity: &scsi::LuIdentity) -> ([u8; 8], [u8; 16], [u8; 16]) {
    let naa = &identity.naa[..identity.naa_len.min(16)];
    let mut nguid = [0u8; 16];
    nguid[..naa.len()].copy_from_slice(naa);
    let mut eui64 = [0u8; 8];
    eui64.copy_from_slice(&nguid[..8]);
    let mut uuid = nguid;
    uuid[6] = (uuid[6] & 0x0F) | 0x80;
    uuid[8] = (uuid[8] & 0x3F) | 0x80;
    (eui64, nguid, uuid)
}

/// The namespaces of `luns` as seen through `port`.
pub(crate) fn namespaces(luns: &LunMap, port: &TargetPort) -> Namespaces {
    let mut out = Namespaces::default();
    for entry in luns.entries() {
        let Some(nsid) = nsid_of(entry.lun) else {
            continue;
        };
        let lu = &entry.lu;
        let settings = lu.settings();
        let block_size = settings.block_size.max(512);
        let (eui64, nguid, uuid) = identifiers(&lu.identity());
        out.views.push(NamespaceView {
            nsid,
            identify: identify::Namespace {
                blocks: lu.capacity_bytes() / u64::from(block_size),
                block_shift: block_size.trailing_zeros() as u8,
                thin: settings.thin,
                shared: true,
                reservations: true,
                write_protected: settings.read_only || entry.read_only,
                anagrpid: nsid,
                nguid,
                eui64,
            },
            uuid,
        });
        let state = lu.access_state(port.group, port.configured_state());
        out.ana.push(AnaGroup {
            id: nsid,
            state: ana_state(state),
            nsids: vec![nsid],
        });
        out.write_cache |= lu.write_cache_enabled();
    }
    out
}

/// What changed between two looks at a controller's namespaces: whether any ANA state moved,
/// and which namespaces came, went or changed size or protection.
pub(crate) fn changes(before: &Namespaces, after: &Namespaces) -> (bool, Vec<u32>) {
    let ana_moved = before.ana != after.ana;
    let mut changed = Vec::new();
    for v in &after.views {
        let same = before.views.iter().find(|b| b.nsid == v.nsid) == Some(v);
        if !same {
            changed.push(v.nsid);
        }
    }
    for b in &before.views {
        if !after.views.iter().any(|v| v.nsid == b.nsid) {
            changed.push(b.nsid);
        }
    }
    (ana_moved, changed)
}

/// A subsystem's serial number (Identify Controller, 20 ASCII characters): hex of a hash of its
/// NQN, so each subsystem has its own and keeps it across restarts.
pub(crate) fn serial_of(nqn: &str) -> String {
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in nqn.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nsids_are_luns_plus_one_within_what_an_nsid_names() {
        assert_eq!(nsid_of(0), Some(1));
        assert_eq!(lun_of(1), Some(0));
        assert_eq!(lun_of(0), None);
        assert_eq!(lun_of(u32::MAX), None);
        assert_eq!(nsid_of(u64::from(u32::MAX)), None);
        for lun in [0, 5, 16383] {
            assert_eq!(nsid_of(lun).and_then(lun_of), Some(lun));
        }
    }

    #[test]
    fn identifiers_come_from_the_naa_and_the_uuid_is_well_formed() {
        let mut naa = [0u8; 16];
        naa[..8].copy_from_slice(&[0x60, 1, 2, 3, 4, 5, 6, 7]);
        let identity = scsi::LuIdentity {
            vendor: "FERROSAN".into(),
            product: "x".into(),
            revision: "1".into(),
            serial: "s".into(),
            naa,
            naa_len: 8,
        };
        let (eui, nguid, uuid) = identifiers(&identity);
        assert_eq!(eui, [0x60, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(&nguid[..8], &eui);
        assert_eq!(uuid[6] >> 4, 8, "version 8");
        assert_eq!(uuid[8] >> 6, 0b10, "RFC variant");
        assert_eq!(serial_of("nqn.a").len(), 16);
        assert_ne!(serial_of("nqn.a"), serial_of("nqn.b"));
    }

    #[test]
    fn ana_states_follow_the_alua_states() {
        assert_eq!(ana_state(AccessState::ActiveOptimized), AnaState::Optimized);
        assert_eq!(
            ana_state(AccessState::ActiveNonOptimized),
            AnaState::NonOptimized
        );
        assert_eq!(ana_state(AccessState::Standby), AnaState::Inaccessible);
        assert_eq!(ana_state(AccessState::Unavailable), AnaState::Inaccessible);
        assert_eq!(ana_state(AccessState::Transitioning), AnaState::Change);
    }
}
