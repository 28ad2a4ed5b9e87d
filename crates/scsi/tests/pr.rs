//! Persistent reservations and SPC-2 RESERVE/RELEASE across several I_T nexuses.
mod common;
use common::*;
use scsi::Status;

fn prout(sa: u8, pr_type: u8) -> [u8; 10] {
    [0x5F, sa, pr_type, 0, 0, 0, 0, 0, 24, 0]
}
fn params(key: u64, sa_key: u64) -> Vec<u8> {
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p
}
fn prin(sa: u8) -> [u8; 10] {
    [0x5E, sa, 0, 0, 0, 0, 0, 0x40, 0, 0]
}

/// One LU, nexuses 1..=3 (distinct initiators), UAs from login cleared.
fn setup() -> T {
    let mut t = T::new();
    t.lu.set_spc2_reservations(true);
    for id in 1..=3 {
        t.lu.nexus_added(id);
        t.nexus = nexus(id);
        t.run(&[0; 6], &[]);
    }
    t.nexus = nexus(1);
    t
}
fn as_nexus(t: &mut T, id: u64) {
    t.nexus = nexus(id);
}
fn conflict(t: &mut T, cdb: &[u8], data: &[u8]) {
    let c = t.run(cdb, data);
    assert_eq!(c.status, Status::ReservationConflict, "cdb {cdb:02x?}");
    assert!(c.sense.is_none());
}
fn keys(t: &mut T) -> (u32, Vec<u64>) {
    let d = t.ok(&prin(0), &[]);
    let gen = u32::from_be_bytes(d[..4].try_into().unwrap());
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    let keys = d[8..8 + len]
        .chunks(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect();
    (gen, keys)
}
fn reservation(t: &mut T) -> Option<(u64, u8)> {
    let d = t.ok(&prin(1), &[]);
    if d[7] == 0 {
        return None;
    }
    Some((u64::from_be_bytes(d[8..16].try_into().unwrap()), d[21]))
}
fn register(t: &mut T, id: u64, key: u64) {
    as_nexus(t, id);
    t.ok(&prout(6, 0), &params(0, key));
}

#[test]
fn registration_lifecycle_and_generation() {
    let mut t = setup();
    assert_eq!(keys(&mut t), (0, vec![]));
    // REGISTER with a reservation key while unregistered conflicts.
    conflict(&mut t, &prout(0, 0), &params(5, 0xAA));
    // Unregistered, SARK 0: nothing happens, no new generation.
    t.ok(&prout(0, 0), &params(0, 0));
    assert_eq!(keys(&mut t), (0, vec![]));
    t.ok(&prout(0, 0), &params(0, 0xAA));
    assert_eq!(keys(&mut t), (1, vec![0xAA]));
    // Re-register with a wrong key conflicts; with the right one changes the key.
    conflict(&mut t, &prout(0, 0), &params(0, 0xAB));
    t.ok(&prout(0, 0), &params(0xAA, 0xAB));
    assert_eq!(keys(&mut t), (2, vec![0xAB]));
    // REGISTER AND IGNORE EXISTING KEY ignores the reservation key.
    t.ok(&prout(6, 0), &params(0x1234, 0xAC));
    register(&mut t, 2, 0xBB);
    assert_eq!(keys(&mut t), (4, vec![0xAC, 0xBB]));
    // Unregister.
    as_nexus(&mut t, 1);
    t.ok(&prout(0, 0), &params(0xAC, 0));
    assert_eq!(keys(&mut t), (5, vec![0xBB]));
    assert_eq!(t.lu.pr_generation(), 5);
    // Registrations belong to the I_T nexus, not the session: a new session id with the same
    // initiator port name is the same registrant.
    as_nexus(&mut t, 2);
    t.nexus.id = 77;
    t.ok(&prout(0, 0), &params(0xBB, 0xBC));
    assert_eq!(keys(&mut t), (6, vec![0xBC]));
}

#[test]
fn parameter_validation() {
    let mut t = setup();
    // Wrong parameter list length.
    let mut cdb = prout(0, 0);
    cdb[8] = 23;
    assert_sense(&t.err(&cdb, &params(0, 1)[..23]), 5, 0x1A, 0);
    assert_sense(&t.err(&prout(0, 0), &params(0, 1)[..20]), 5, 0x1A, 0);
    // APTPL is not supported (PTPL_C=0).
    let mut p = params(0, 1);
    p[20] = 1;
    assert_sense(&t.err(&prout(0, 0), &p), 5, 0x26, 0);
    // Reservation type and scope.
    t.ok(&prout(0, 0), &params(0, 1));
    invalid_cdb(&t.err(&prout(1, 2), &params(1, 0)));
    invalid_cdb(&t.err(&prout(1, 0x11), &params(1, 0)));
    // Unknown service actions.
    invalid_cdb(&t.err(&prout(7, 0), &params(1, 0)));
    invalid_cdb(&t.err(&prin(4), &[]));
    // REPORT CAPABILITIES.
    let d = t.ok(&prin(2), &[]);
    assert_eq!(d, [0, 8, 0, 0x80, 0xEA, 0x01, 0, 0]);
    // Allocation length truncates, the additional length stays whole.
    let mut cdb = prin(0);
    cdb[8] = 4;
    cdb[7] = 0;
    assert_eq!(t.ok(&cdb, &[]).len(), 4);
}

#[test]
fn access_by_type_and_registration() {
    // (type, registered nexus 2 read/write, unregistered nexus 3 read/write)
    let cases = [
        (1u8, (true, false), (true, false)),
        (3, (false, false), (false, false)),
        (5, (true, true), (true, false)),
        (6, (true, true), (false, false)),
        (7, (true, true), (true, false)),
        (8, (true, true), (false, false)),
    ];
    for (ty, reg, unreg) in cases {
        let mut t = setup();
        register(&mut t, 1, 0x11);
        register(&mut t, 2, 0x22);
        as_nexus(&mut t, 1);
        t.ok(&prout(1, ty), &params(0x11, 0));
        let expect_key = if ty >= 7 { 0 } else { 0x11 };
        assert_eq!(reservation(&mut t), Some((expect_key, ty)));
        assert!(t.lu.reservation_held());
        let data = vec![0u8; 512];
        t.ok(&read10(1, 1), &[]);
        t.ok(&write10(1, 1), &data);
        for (id, (r, w)) in [(2, reg), (3, unreg)] {
            as_nexus(&mut t, id);
            if r {
                t.ok(&read10(1, 1), &[]);
            } else {
                conflict(&mut t, &read10(1, 1), &[]);
            }
            if w {
                t.ok(&write10(1, 1), &data);
            } else {
                conflict(&mut t, &write10(1, 1), &data);
            }
            // Always allowed.
            t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
            t.ok(&[0; 6], &[]);
            t.ok(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
            t.ok(&prin(0), &[]);
            // RESERVE of another type or by a non-holder conflicts.
            if id == 3 || ty < 7 {
                conflict(
                    &mut t,
                    &prout(1, ty),
                    &params(if id == 2 { 0x22 } else { 0 }, 0),
                );
            }
        }
        // Release by the holder with the wrong type is refused.
        as_nexus(&mut t, 1);
        let other = if ty == 1 { 3 } else { 1 };
        assert_sense(&t.err(&prout(2, other), &params(0x11, 0)), 5, 0x26, 0x04);
        t.ok(&prout(2, ty), &params(0x11, 0));
        assert_eq!(reservation(&mut t), None);
        assert!(!t.lu.reservation_held());
        // Registrants-only and all-registrants releases tell the other registrants.
        as_nexus(&mut t, 2);
        let c = t.run(&[0; 6], &[]);
        if ty >= 5 {
            assert_eq!(c.status, Status::CheckCondition);
            assert_sense(&c.sense.unwrap(), 6, 0x2A, 0x04);
        } else {
            assert_eq!(c.status, Status::Good);
        }
    }
}

#[test]
fn holder_unregistering_releases_unless_all_registrants() {
    for (ty, shared) in [
        (1u8, false),
        (3, false),
        (5, false),
        (6, false),
        (7, true),
        (8, true),
    ] {
        let mut t = setup();
        register(&mut t, 1, 0x11);
        register(&mut t, 2, 0x22);
        as_nexus(&mut t, 1);
        t.ok(&prout(1, ty), &params(0x11, 0));
        t.ok(&prout(0, 0), &params(0x11, 0));
        if shared {
            assert_eq!(reservation(&mut t), Some((0, ty)));
            as_nexus(&mut t, 2);
            t.ok(&prout(2, ty), &params(0x22, 0));
        }
        assert_eq!(reservation(&mut t), None, "type {ty}");
    }
    // An all-registrants reservation goes with its last registrant.
    let mut t = setup();
    register(&mut t, 1, 0x11);
    as_nexus(&mut t, 1);
    t.ok(&prout(1, 7), &params(0x11, 0));
    t.ok(&prout(0, 0), &params(0x11, 0));
    assert_eq!(reservation(&mut t), None);
}

#[test]
fn clear_and_preempt() {
    let mut t = setup();
    register(&mut t, 1, 0x11);
    register(&mut t, 2, 0x22);
    register(&mut t, 3, 0x33);
    as_nexus(&mut t, 2);
    t.ok(&prout(1, 1), &params(0x22, 0));
    // Only a registrant with its own key may preempt.
    as_nexus(&mut t, 1);
    conflict(&mut t, &prout(4, 3), &params(0x12, 0x22));
    // Preempting a key nobody holds conflicts; key 0 without an AR reservation is invalid.
    conflict(&mut t, &prout(4, 3), &params(0x11, 0x99));
    assert_sense(&t.err(&prout(4, 3), &params(0x11, 0)), 5, 0x26, 0);
    // Preempt the holder: its registration goes, nexus 1 holds an EA reservation.
    let gen = t.lu.pr_generation();
    t.ok(&prout(5, 3), &params(0x11, 0x22));
    assert_eq!(t.lu.pr_generation(), gen + 1);
    assert_eq!(reservation(&mut t), Some((0x11, 3)));
    assert_eq!(keys(&mut t).1, vec![0x11, 0x33]);
    as_nexus(&mut t, 2);
    let c = t.run(&read10(0, 1), &[]);
    assert_sense(&c.sense.unwrap(), 6, 0x2A, 0x05); // REGISTRATIONS PREEMPTED
    conflict(&mut t, &read10(0, 1), &[]);
    // Type changed: the remaining registrant hears RESERVATIONS RELEASED.
    as_nexus(&mut t, 3);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x04);
    // Preempt a registration without touching the reservation.
    as_nexus(&mut t, 1);
    t.ok(&prout(4, 3), &params(0x11, 0x33));
    assert_eq!(keys(&mut t).1, vec![0x11]);
    assert_eq!(reservation(&mut t), Some((0x11, 3)));
    as_nexus(&mut t, 3);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x05);
    // CLEAR: everything goes, other registrants hear RESERVATIONS PREEMPTED.
    register(&mut t, 3, 0x33);
    as_nexus(&mut t, 3);
    conflict(&mut t, &prout(3, 0), &params(0x34, 0));
    as_nexus(&mut t, 1);
    t.ok(&prout(3, 0), &params(0x11, 0));
    assert_eq!(keys(&mut t).1, Vec::<u64>::new());
    assert_eq!(reservation(&mut t), None);
    as_nexus(&mut t, 3);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x03);
    // All-registrants reservation preempted with key 0: everyone else is removed.
    register(&mut t, 1, 0x11);
    register(&mut t, 2, 0x22);
    as_nexus(&mut t, 1);
    t.ok(&prout(1, 8), &params(0x11, 0));
    as_nexus(&mut t, 2);
    t.ok(&prout(4, 1), &params(0x22, 0));
    assert_eq!(keys(&mut t).1, vec![0x22]);
    assert_eq!(reservation(&mut t), Some((0x22, 1)));
}

#[test]
fn full_status_lists_registrants() {
    let mut t = setup();
    register(&mut t, 1, 0x11);
    as_nexus(&mut t, 1);
    t.ok(&prout(1, 1), &params(0x11, 0));
    let d = t.ok(&prin(3), &[]);
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    assert_eq!(d.len(), 8 + len);
    assert_eq!(u64::from_be_bytes(d[8..16].try_into().unwrap()), 0x11);
    assert_eq!((d[20], d[21]), (1, 1)); // R_HOLDER, type
    assert_eq!(&d[26..28], &[0, 1]); // relative target port
    assert_eq!(d[32], 0x45); // iSCSI TransportID, format 01b
    let name = b"iqn.1994-05.com.example:host1,i,0x00023d000001";
    assert_eq!(&d[36..36 + name.len()], name);
}

#[test]
fn spc2_reserve_release() {
    let mut t = setup();
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]);
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]); // the holder may reserve again
    as_nexus(&mut t, 2);
    conflict(&mut t, &[0x16, 0, 0, 0, 0, 0], &[]);
    conflict(&mut t, &[0x1A, 0, 0x3F, 0, 255, 0], &[]);
    conflict(&mut t, &read10(0, 1), &[]);
    conflict(&mut t, &prin(0), &[]);
    t.ok(&[0x12, 0, 0, 0, 36, 0], &[]);
    t.ok(&[0x17, 0, 0, 0, 0, 0], &[]); // RELEASE by a non-holder: no-op
    conflict(&mut t, &[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    as_nexus(&mut t, 1);
    t.ok(&[0x1A, 0, 0x3F, 0, 255, 0], &[]);
    t.ok(&[0x17, 0, 0, 0, 0, 0], &[]);
    as_nexus(&mut t, 2);
    t.ok(&[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    // Released when the holder's nexus goes.
    t.lu.nexus_lost(2);
    assert!(!t.lu.reservation_held());
    as_nexus(&mut t, 1);
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]);
    // Released by LU reset (and so by target reset, which resets every LU).
    t.lu.logical_unit_reset(3);
    assert!(!t.lu.reservation_held());
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x29, 0x03);
    // Target reset releases it too, with the generic reset unit attention.
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]);
    t.lu.target_reset(1);
    assert!(!t.lu.reservation_held());
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x29, 0x00);
    // Third-party reservations are not supported.
    invalid_cdb(&t.err(&[0x56, 0x10, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
}

#[test]
fn spc2_reservations_are_off_by_default() {
    let mut t = T::new();
    for op in [0x16u8, 0x17] {
        assert_sense(&t.err(&[op, 0, 0, 0, 0, 0], &[]), 5, 0x20, 0);
    }
    assert_sense(&t.err(&[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]), 5, 0x20, 0);
    t.lu.set_spc2_reservations(true);
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]);
}

#[test]
fn spc2_and_persistent_reservations_exclude_each_other() {
    let mut t = setup();
    t.ok(&[0x16, 0, 0, 0, 0, 0], &[]);
    as_nexus(&mut t, 2);
    conflict(&mut t, &prout(6, 0), &params(0, 0x22));
    as_nexus(&mut t, 1);
    t.ok(&[0x17, 0, 0, 0, 0, 0], &[]);
    register(&mut t, 2, 0x22);
    as_nexus(&mut t, 2);
    t.ok(&prout(1, 1), &params(0x22, 0));
    // With persistent reservations in use (CRH=0), RESERVE and RELEASE conflict.
    as_nexus(&mut t, 1);
    conflict(&mut t, &[0x16, 0, 0, 0, 0, 0], &[]);
    // Persistent reservations survive an LU reset.
    t.lu.logical_unit_reset(1);
    assert!(t.lu.reservation_held());
}

/// A persistence that keeps what it was given, and fails on demand.
#[derive(Default)]
struct Saved {
    states: std::sync::Mutex<Vec<scsi::PersistentReservations>>,
    fail: std::sync::atomic::AtomicBool,
}

impl scsi::PrPersistence for Saved {
    fn save(&self, state: &scsi::PersistentReservations) -> std::io::Result<()> {
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(std::io::Error::other("disk full"));
        }
        self.states.lock().unwrap().push(state.clone());
        Ok(())
    }
}

fn aptpl_params(key: u64, sa_key: u64) -> Vec<u8> {
    let mut p = params(key, sa_key);
    p[20] = 1;
    p
}

#[test]
fn aptpl_saves_every_change_and_restores_into_a_new_lu() {
    let mut t = setup();
    let saved = std::sync::Arc::new(Saved::default());
    assert!(t.lu.set_pr_persistence(saved.clone()));
    assert!(!t.lu.set_pr_persistence(saved.clone()), "once per LU");
    // PTPL_C=1; PTPL_A=0 until a REGISTER sets APTPL.
    assert_eq!(t.ok(&prin(2), &[]), [0, 8, 0x01, 0x80, 0xEA, 0x01, 0, 0]);
    // Without APTPL nothing is saved.
    t.ok(&prout(0, 0), &params(0, 0xAA));
    assert!(saved.states.lock().unwrap().is_empty());
    // REGISTER AND IGNORE with APTPL=1 from another nexus: saved, PTPL_A=1.
    as_nexus(&mut t, 2);
    t.ok(&prout(6, 0), &aptpl_params(0, 0xBB));
    assert_eq!(t.ok(&prin(2), &[])[3], 0x81);
    // A reservation: saved before the command completes.
    t.ok(&prout(1, 1), &params(0xBB, 0));
    let last = saved.states.lock().unwrap().last().cloned().unwrap();
    assert!(last.aptpl);
    assert_eq!(last.registrations.len(), 2);
    assert_eq!(last.registrations[0].key, 0xAA);
    assert_eq!(last.registrations[1].key, 0xBB);
    let (holder, pr_type) = last.reservation.clone().unwrap();
    assert_eq!(pr_type, 1);
    assert_eq!(holder, last.registrations[1].nexus);
    assert_eq!(last, t.lu.persistent_reservations());
    // A READ changes nothing and saves nothing.
    let count = saved.states.lock().unwrap().len();
    keys(&mut t);
    assert_eq!(saved.states.lock().unwrap().len(), count);

    // "Restart": a new LU restores the saved state; the same I_T nexuses find it.
    let mut t2 = setup();
    t2.lu.restore_reservations(&last);
    assert_eq!(keys(&mut t2), (last.generation, vec![0xAA, 0xBB]));
    assert_eq!(reservation(&mut t2), Some((0xBB, 1)));
    // The reservation is enforced: nexus 3 (not registered) may not write.
    as_nexus(&mut t2, 3);
    conflict(&mut t2, &[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0; 512]);
    as_nexus(&mut t2, 2);
    t2.ok(&[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0; 512]);
}

#[test]
fn aptpl_off_is_saved_once_and_not_restored() {
    let mut t = setup();
    let saved = std::sync::Arc::new(Saved::default());
    t.lu.set_pr_persistence(saved.clone());
    t.ok(&prout(0, 0), &aptpl_params(0, 0xAA));
    // REGISTER (re-register, same key) with APTPL=0 turns it off: saved once, saying so.
    t.ok(&prout(0, 0), &params(0xAA, 0xAA));
    let states = saved.states.lock().unwrap().clone();
    assert_eq!(states.len(), 2);
    assert!(!states[1].aptpl);
    // Later changes are not saved.
    t.ok(&prout(1, 1), &params(0xAA, 0));
    assert_eq!(saved.states.lock().unwrap().len(), 2);
    // A state saved with APTPL off is not restored.
    let mut t2 = setup();
    t2.lu.restore_reservations(&states[1]);
    assert_eq!(keys(&mut t2), (0, vec![]));
}

#[test]
fn a_failed_save_fails_the_command_and_changes_nothing() {
    let mut t = setup();
    let saved = std::sync::Arc::new(Saved::default());
    t.lu.set_pr_persistence(saved.clone());
    t.ok(&prout(0, 0), &aptpl_params(0, 0xAA));
    saved.fail.store(true, std::sync::atomic::Ordering::Relaxed);
    // HARDWARE ERROR, INTERNAL TARGET FAILURE; no reservation, same generation.
    let (gen, _) = keys(&mut t);
    assert_sense(&t.err(&prout(1, 1), &params(0xAA, 0)), 4, 0x44, 0);
    assert_eq!(reservation(&mut t), None);
    assert_sense(&t.err(&prout(0, 0), &aptpl_params(0xAA, 0xAB)), 4, 0x44, 0);
    assert_eq!(keys(&mut t), (gen, vec![0xAA]));
    // And once the store works again, so does the command.
    saved
        .fail
        .store(false, std::sync::atomic::Ordering::Relaxed);
    t.ok(&prout(1, 1), &params(0xAA, 0));
    assert_eq!(reservation(&mut t), Some((0xAA, 1)));
}

/// A store two LUs share (two gateways exporting one image): whatever was saved last is
/// what `load` gives; loading fails on demand.
#[derive(Default)]
struct Shared {
    state: std::sync::Mutex<Option<scsi::PersistentReservations>>,
    saves: std::sync::atomic::AtomicUsize,
    unreadable: std::sync::atomic::AtomicBool,
    /// Another gateway's saves that land between the next loads and saves (each overtakes
    /// one save, which then fails with `SaveRefused::Conflict`).
    overtaking: std::sync::Mutex<Vec<scsi::PersistentReservations>>,
}

impl scsi::PrPersistence for Shared {
    fn save(&self, state: &scsi::PersistentReservations) -> std::io::Result<()> {
        self.saves.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(other) = self.overtaking.lock().unwrap().pop() {
            *self.state.lock().unwrap() = Some(other);
            return Err(scsi::SaveRefused::Conflict.error());
        }
        *self.state.lock().unwrap() = Some(state.clone());
        Ok(())
    }
    fn shared(&self) -> bool {
        true
    }
    fn load(&self) -> std::io::Result<Option<scsi::PersistentReservations>> {
        if self.unreadable.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("cluster unreachable"));
        }
        Ok(self.state.lock().unwrap().clone())
    }
}

#[test]
fn shared_reservations_are_saved_without_aptpl_and_seen_by_every_lu() {
    let store = std::sync::Arc::new(Shared::default());
    let mut a = setup();
    let mut b = setup();
    a.lu.set_pr_persistence(store.clone());
    b.lu.set_pr_persistence(store.clone());
    // PERSISTENT RESERVE IN waits for the store too (it reads it first).
    assert!(a.lu.waits_for_device(&prin(0)));
    // Registered and reserved through A, APTPL off: saved anyway.
    register(&mut a, 1, 0xA1);
    a.ok(&prout(1, 1), &params(0xA1, 0));
    assert_eq!(store.saves.load(std::sync::atomic::Ordering::SeqCst), 2);
    // B reads the same registrations and reservation.
    as_nexus(&mut b, 2);
    assert_eq!(keys(&mut b).1, vec![0xA1]);
    assert_eq!(reservation(&mut b), Some((0xA1, 1)));
    // A registration through B reaches A; B's read-modify-write keeps A's.
    register(&mut b, 2, 0xB2);
    as_nexus(&mut a, 3);
    assert_eq!(keys(&mut a).1, vec![0xA1, 0xB2]);
    // Enforced on B for its writes (once it has read the state: the engine's follower does
    // it once a second through `replace_reservations`).
    b.lu.replace_reservations(&store.state.lock().unwrap().clone().unwrap());
    as_nexus(&mut b, 3);
    conflict(&mut b, &[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0; 512]);
    // A store that cannot be read: the command fails (retry), nothing acts on a stale copy.
    store
        .unreadable
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_sense(&a.err(&prin(0), &[]), 2, 0x04, 0x0A);
    assert_sense(&a.err(&prout(6, 0), &params(0, 0xCC)), 2, 0x04, 0x0A);
}

#[test]
fn a_save_another_gateway_overtook_is_run_again_on_the_state_it_saved() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = std::sync::Arc::new(Shared::default());
    let mut a = setup();
    let mut b = setup();
    a.lu.set_pr_persistence(store.clone());
    b.lu.set_pr_persistence(store.clone());
    register(&mut a, 1, 0xA1);
    let only_a1 = store.state.lock().unwrap().clone().unwrap();
    // B's registration, saved while A works on the state without it.
    register(&mut b, 2, 0xB2);
    let with_b2 = store.state.lock().unwrap().clone().unwrap();
    *store.state.lock().unwrap() = Some(only_a1.clone());
    store.overtaking.lock().unwrap().push(with_b2);
    let saves = store.saves.load(SeqCst);
    register(&mut a, 3, 0xA3);
    assert_eq!(
        store.saves.load(SeqCst),
        saves + 2,
        "overtaken once, saved again"
    );
    // Neither registration is lost, on either LU.
    as_nexus(&mut a, 4);
    assert_eq!(keys(&mut a).1, vec![0xA1, 0xB2, 0xA3]);
    as_nexus(&mut b, 4);
    assert_eq!(keys(&mut b).1, vec![0xA1, 0xB2, 0xA3]);

    // Overtaken on every attempt: NOT READY (retry), and nothing of it stands.
    let now = store.state.lock().unwrap().clone().unwrap();
    *store.overtaking.lock().unwrap() = vec![now.clone(); 64];
    as_nexus(&mut a, 5);
    assert_sense(&a.err(&prout(6, 0), &params(0, 0xA5)), 2, 0x04, 0x0A);
    store.overtaking.lock().unwrap().clear();
    assert_eq!(store.state.lock().unwrap().clone().unwrap(), now);
    assert_eq!(keys(&mut a).1, vec![0xA1, 0xB2, 0xA3]);
    // Nothing was raised for it either; a CLEAR overtaken once raises its unit attention once.
    as_nexus(&mut a, 1);
    a.ok(&[0; 6], &[]);
    store.overtaking.lock().unwrap().push(now);
    as_nexus(&mut a, 3);
    a.ok(&prout(3, 0), &params(0xA3, 0));
    assert_eq!(keys(&mut a).1, Vec::<u64>::new());
    as_nexus(&mut a, 1);
    assert_sense(&a.err(&[0; 6], &[]), 6, 0x2A, 0x03); // RESERVATIONS PREEMPTED
    a.ok(&[0; 6], &[]);
}

#[test]
fn registrations_beyond_the_bound_get_insufficient_registration_resources() {
    let mut t = T::new();
    let max = scsi::REGISTRATIONS_MAX as u64;
    for id in 1..=max + 1 {
        t.lu.nexus_added(id);
        as_nexus(&mut t, id);
        t.run(&[0; 6], &[]); // the nexus's power-on unit attention
    }
    for id in 1..=max {
        register(&mut t, id, 0x100 + id);
    }
    as_nexus(&mut t, max + 1);
    let s = t.err(&prout(6, 0), &params(0, 0xFFFF));
    assert_eq!((s.key, s.asc, s.ascq), (0x05, 0x55, 0x04));
    let (_, held) = keys(&mut t);
    assert_eq!(held.len(), max as usize, "nothing changed");
    // Registrants still change their key and unregister; then a place is free again.
    as_nexus(&mut t, 1);
    t.ok(&prout(0, 0), &params(0x101, 0x1001));
    t.ok(&prout(0, 0), &params(0x1001, 0));
    register(&mut t, max + 1, 0xFFFF);
    assert_eq!(keys(&mut t).1.len(), max as usize);
}

#[test]
fn one_node_with_fresh_isids_takes_only_its_share_of_the_registrations() {
    let mut t = T::new();
    let per_node = scsi::REGISTRATIONS_PER_NODE_MAX as u64;
    // One node, a fresh ISID per nexus (its name spelled in another case once: one node).
    let greedy = |id: u64| {
        let mut n = nexus(id);
        let name = if id == 1 {
            "IQN.2026-12.test:greedy"
        } else {
            "iqn.2026-12.test:greedy"
        };
        n.initiator_port = format!("{name},i,0x40{id:010x}");
        n
    };
    for id in 1..=per_node + 1 {
        t.lu.nexus_added(id);
        t.nexus = greedy(id);
        t.run(&[0; 6], &[]); // the nexus's power-on unit attention
    }
    for id in 1..=per_node {
        t.nexus = greedy(id);
        t.ok(&prout(6, 0), &params(0, 0x100 + id));
    }
    t.nexus = greedy(per_node + 1);
    let s = t.err(&prout(6, 0), &params(0, 0xFFFF));
    assert_eq!((s.key, s.asc, s.ascq), (0x05, 0x55, 0x04));
    // Another node still registers.
    let other = 1000;
    t.lu.nexus_added(other);
    as_nexus(&mut t, other);
    t.run(&[0; 6], &[]);
    register(&mut t, other, 0xABC);
    assert_eq!(keys(&mut t).1.len(), per_node as usize + 1);
}

/// A shared store whose next load can be held midway (as a slow cluster holds it), to order a
/// follower's load against a command.
#[derive(Default)]
struct Holding {
    shared: Shared,
    hold: std::sync::Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl scsi::PrPersistence for Holding {
    fn save(&self, state: &scsi::PersistentReservations) -> std::io::Result<()> {
        self.shared.save(state)
    }
    fn shared(&self) -> bool {
        true
    }
    fn load(&self) -> std::io::Result<Option<scsi::PersistentReservations>> {
        let state = self.shared.load();
        if let Some((entered, release)) = self.hold.lock().unwrap().take() {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
        state
    }
}

#[test]
fn following_the_shared_state_never_undoes_a_change_made_meanwhile() {
    use std::sync::mpsc::channel;
    let store = std::sync::Arc::new(Holding::default());
    let mut a = setup();
    a.lu.set_pr_persistence(store.clone());
    register(&mut a, 1, 0xA1);
    let before = scsi::PrPersistence::load(&store.shared).unwrap().unwrap();
    // The follower reads the state and is held there (its cluster slow) ...
    let (entered_tx, entered) = channel();
    let (release, release_rx) = channel();
    *store.hold.lock().unwrap() = Some((entered_tx, release_rx));
    let lu = std::sync::Arc::clone(&a.lu);
    let follower = std::thread::spawn(move || lu.follow_shared_reservations());
    entered.recv().unwrap();
    // ... while a node reserves Write Exclusive – Registrants Only through this gateway.
    let mut b = T {
        lu: std::sync::Arc::clone(&a.lu),
        store: std::sync::Arc::clone(&a.store),
        nexus: nexus(1),
        data_in: Vec::new(),
        limit: a.limit,
    };
    let reserving = std::thread::spawn(move || {
        b.ok(&prout(1, 5), &params(0xA1, 0));
    });
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(
        !reserving.is_finished(),
        "the RESERVE waits for the follower's load"
    );
    release.send(()).unwrap();
    follower.join().unwrap();
    reserving.join().unwrap();
    // The reservation stands, and an unregistered host is refused its write.
    assert_eq!(reservation(&mut a), Some((0xA1, 5)));
    as_nexus(&mut a, 2);
    conflict(&mut a, &[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0; 512]);
    // What the follower did before, applying a copy read outside the lock: the RESERVE undone
    // and the write let through until the next follow.
    a.lu.replace_reservations(&before);
    as_nexus(&mut a, 1);
    assert_eq!(
        reservation(&mut a),
        Some((0xA1, 5)),
        "read back from the store"
    );
    as_nexus(&mut a, 2);
    a.lu.replace_reservations(&before);
    let c = a.run(&[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0; 512]);
    assert_eq!(c.status, Status::Good, "a stale copy applied lets it write");
}
