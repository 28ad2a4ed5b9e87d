//! The iSCSI door's side of the session backend: SendTargets, and handing finished commands back
//! to the iSCSI session. Everything else a session's commands need is the seam's
//! ([`seam::ScsiBackend`], in `backend.rs`), shared with the NVMe/TCP door.

use std::sync::Arc;

use iscsi::login::Established;
use iscsi::session::{DiscoveredTarget, IscsiBackend, Session};
use seam::outbox::Outbox;

use super::backend::{Backend, Completed};
use crate::admission::registry::{DoorFacts, IscsiFacts};
use crate::config::NodeName;

/// Hands a finished command to the session: its answer is queued in `out`, its memory and
/// counts settled. True when the session is closing (a cold reset's last task finished).
pub(super) fn deliver(
    session: &mut Session,
    backend: &mut Backend<'_>,
    out: &mut Outbox,
    done: Completed,
) -> bool {
    backend.settle(&done);
    match done.lent {
        Some(slice) => {
            // One Vec for every lent read of the connection (the outbox empties it).
            backend.loan.slices.push(slice);
            session.complete_lent(done.tag, done.outcome, &mut backend.loan, &done.sense, out);
        }
        None => {
            session.complete(done.tag, done.outcome, done.data_in, &done.sense, out);
        }
    }
    done.data_out.recycle(out);
    session.closing()
}

/// Delivers the commands answered this turn (planned ones that failed a check, ring
/// completions); their Vec keeps its capacity for the next turn. True when the session closes.
pub(super) fn deliver_answered(
    session: &mut Session,
    backend: &mut Backend<'_>,
    out: &mut Outbox,
) -> bool {
    let mut answered = std::mem::take(&mut backend.answered);
    let mut closing = false;
    for done in answered.drain(..) {
        closing |= deliver(session, backend, out, done);
    }
    backend.answered = answered;
    closing
}

impl IscsiBackend for Backend<'_> {
    fn send_targets(&mut self, filter: Option<&str>) -> Vec<DiscoveredTarget> {
        let mut found = Vec::new();
        // A name that is not one names no target.
        let named = filter
            .filter(|f| !f.is_empty())
            .map(|f| NodeName::from_wire(f).ok());
        let topology = Arc::clone(&self.view.topology);
        // The host's addresses, asked once per request and only if needed.
        let mut host: Option<Vec<std::net::IpAddr>> = None;
        for (index, t) in topology.targets.iter().enumerate() {
            let wanted = match (&named, filter) {
                (None, None) => true,
                // Empty value: the session's own target.
                (None, Some(_)) => self
                    .view
                    .party
                    .admitted
                    .membership()
                    .is_some_and(|m| m.target == index),
                (Some(name), _) => name.as_ref() == Some(&t.iqn),
            };
            if !wanted {
                continue;
            }
            // The same decision as a login's: visible exactly to those who could log in.
            if topology
                .member(index, &self.view.party.initiator, self.view.party.peer.ip())
                .is_err()
            {
                continue;
            }
            // Every portal of every portal group of the target: each one a path.
            let mut addresses = Vec::new();
            for (addr, tag) in crate::topology::portals::served(&topology.config) {
                if !t.portal_groups.contains(&tag) {
                    continue;
                }
                let host = host.get_or_insert_with(crate::topology::portals::host_addresses);
                for shown in
                    crate::topology::portals::advertised(addr, self.view.party.local.ip(), host)
                {
                    let entry = format!("{shown},{tag}");
                    if !addresses.contains(&entry) {
                        addresses.push(entry);
                    }
                }
            }
            found.push(DiscoveredTarget {
                name: t.iqn.to_string(),
                addresses,
            });
        }
        found
    }
}

/// What `ctl sessions` shows of an iSCSI session beside what every session has: its ISID,
/// connection ID and negotiated keys.
pub(super) fn facts(established: &Established) -> DoorFacts {
    let p = &established.params;
    DoorFacts::Iscsi(IscsiFacts {
        isid: established.isid,
        cid: established.cid,
        header_digest: p.header_digest,
        data_digest: p.data_digest,
        max_recv_data_segment_length: p.max_recv_data_segment_length,
        max_xmit_data_segment_length: p.max_xmit_data_segment_length,
        max_burst_length: p.max_burst_length,
        first_burst_length: p.first_burst_length,
        immediate_data: p.immediate_data,
        initial_r2t: p.initial_r2t,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_iscsi_session_shows_its_own_doors_facts() {
        let limits = crate::config::Limits::default();
        let mut established = super::super::login::established_for_test(&limits);
        established.isid = [0x40, 0, 0, 0, 0, 7];
        established.cid = 3;
        established.params.header_digest = true;
        established.params.first_burst_length = 65_536;
        let params = established.params;
        let DoorFacts::Iscsi(f) = facts(&established) else {
            panic!("an iSCSI session shows iSCSI facts");
        };
        assert_eq!((f.isid, f.cid), ([0x40, 0, 0, 0, 0, 7], 3));
        assert!(f.header_digest && !f.data_digest);
        assert_eq!(f.first_burst_length, 65_536);
        assert_eq!(f.initial_r2t, params.initial_r2t);
        assert_eq!(f.max_burst_length, params.max_burst_length);
    }
}
