//! Per-nexus unit attention queues (SAM-5 5.14, SPC-4 5.14). The fast path pays one atomic load
//! while nothing is pending anywhere on the LU; the lock is taken only when some nexus has one.
//!
//! A nexus gets its queue on an LU when it first addresses it ([`UnitAttentions::join_since`]):
//! a session of a group of thousands of LUs that uses a few holds a queue in those few. What
//! it would have been told meanwhile comes from the conditions raised for every nexus since
//! it joined, which each LU keeps the last [`UA_QUEUE_MAX`] of.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Queued conditions per nexus; a further one is dropped (the oldest ones matter most, and
/// duplicates are never queued).
pub const UA_QUEUE_MAX: usize = 8;

pub const NOT_READY_TO_READY: (u8, u8) = (0x28, 0x00);
pub const POWER_ON_RESET: (u8, u8) = (0x29, 0x00);
pub const LU_RESET: (u8, u8) = (0x29, 0x03);
pub const RESERVATIONS_PREEMPTED: (u8, u8) = (0x2A, 0x03);
pub const RESERVATIONS_RELEASED: (u8, u8) = (0x2A, 0x04);
pub const REGISTRATIONS_PREEMPTED: (u8, u8) = (0x2A, 0x05);
pub const MODE_PARAMETERS_CHANGED: (u8, u8) = (0x2A, 0x01);
pub const CAPACITY_CHANGED: (u8, u8) = (0x2A, 0x09);
pub const THIN_PROVISIONING_SOFT_THRESHOLD_REACHED: (u8, u8) = (0x38, 0x07);
pub const INQUIRY_DATA_CHANGED: (u8, u8) = (0x3F, 0x03);
pub const REPORTED_LUNS_CHANGED: (u8, u8) = (0x3F, 0x0E);

/// Orders joins, LUN map changes and conditions raised for every nexus, over all LUs.
static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A new point in the order of joins, map changes and raised conditions: a nexus that joined
/// at `stamp()` is told of what is raised after it.
pub fn stamp() -> u64 {
    SEQUENCE.fetch_add(1, Ordering::SeqCst) + 1
}

/// A condition raised for every nexus of an LU (except one), at its point in the order.
#[derive(Clone, Copy)]
struct Raised {
    at: u64,
    ua: (u8, u8),
    except: Option<u64>,
}

/// Called when a condition is raised for every nexus of an LU: the LU changed in a way its
/// hosts must learn (its capacity, mode, identity, access state, reservations). A transport
/// whose hosts learn it otherwise than by a unit attention (NVMe's asynchronous events) wakes
/// its idle connections from here instead of polling the LU.
pub type Changed = Arc<dyn Fn() + Send + Sync>;

/// One nexus's conditions, oldest first, held inline: every session joins every LU of its
/// group, so a heap queue per (nexus, LU) cost an allocation each (4,096 LUNs: one per LU per
/// login).
#[derive(Default, Clone, Copy)]
struct Queue {
    len: u8,
    items: [(u8, u8); UA_QUEUE_MAX],
}

impl Queue {
    fn iter(&self) -> impl Iterator<Item = &(u8, u8)> {
        self.items[..usize::from(self.len)].iter()
    }

    /// Queues `ua` unless full or queued already; whether it was.
    fn push(&mut self, ua: (u8, u8)) -> bool {
        let len = usize::from(self.len);
        if len == UA_QUEUE_MAX || self.iter().any(|q| *q == ua) {
            return false;
        }
        self.items[len] = ua;
        self.len += 1;
        true
    }

    fn pop_front(&mut self) -> Option<(u8, u8)> {
        let len = usize::from(self.len);
        let first = *self.items[..len].first()?;
        self.items.copy_within(1..len, 0);
        self.len -= 1;
        Some(first)
    }
}

#[derive(Default)]
struct Table {
    /// Every nexus that joined and its queue.
    queues: HashMap<u64, Queue>,
    /// The last conditions raised for every nexus, oldest first, for the nexuses that join
    /// later with an earlier stamp.
    raised: VecDeque<Raised>,
}

#[derive(Default)]
pub struct UnitAttentions {
    /// Total conditions queued over all nexuses.
    pending: AtomicUsize,
    table: Mutex<Table>,
    /// Told of every [`UnitAttentions::raise_all`], after the queues.
    changed: OnceLock<Changed>,
}

impl UnitAttentions {
    fn push(pending: &AtomicUsize, q: &mut Queue, ua: (u8, u8)) {
        if q.push(ua) {
            pending.fetch_add(1, Ordering::Release);
        }
    }

    fn drain(pending: &AtomicUsize, q: &mut Queue) {
        pending.fetch_sub(usize::from(q.len), Ordering::Release);
        q.len = 0;
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new nexus: it starts with POWER ON, RESET (29h/00h).
    pub fn add_nexus(&self, nexus: u64) {
        let mut table = self.table();
        let q = table.queues.entry(nexus).or_default();
        Self::drain(&self.pending, q);
        Self::push(&self.pending, q, POWER_ON_RESET);
    }

    /// A nexus that joined at `joined` (a [`stamp`]) addresses the LU for the first time: its
    /// queue starts with POWER ON, RESET, then what was raised for every nexus since it joined,
    /// and REPORTED LUNS DATA HAS CHANGED in its place when its LUN map changed at
    /// `map_changed`. Nothing when it has a queue already. Past [`UA_QUEUE_MAX`] conditions
    /// since the join it is given the latest rather than the earliest: POWER ON, RESET, first,
    /// tells it to look again at everything.
    pub fn join_since(&self, nexus: u64, joined: u64, map_changed: Option<u64>) {
        let mut table = self.table();
        let Table { queues, raised } = &mut *table;
        let std::collections::hash_map::Entry::Vacant(slot) = queues.entry(nexus) else {
            return;
        };
        let q = slot.insert(Queue::default());
        Self::push(&self.pending, q, POWER_ON_RESET);
        let mut map_change = map_changed.filter(|&at| at > joined);
        for r in raised
            .iter()
            .filter(|r| r.at > joined && r.except != Some(nexus))
        {
            if map_change.is_some_and(|at| at < r.at) {
                Self::push(&self.pending, q, REPORTED_LUNS_CHANGED);
                map_change = None;
            }
            Self::push(&self.pending, q, r.ua);
        }
        if map_change.is_some() {
            Self::push(&self.pending, q, REPORTED_LUNS_CHANGED);
        }
    }

    /// Forgets `nexus`. The table gives its room back once mostly empty: a thousand sessions
    /// that came and went must not leave every LU holding a thousand sessions' room.
    pub fn remove_nexus(&self, nexus: u64) {
        let queues = &mut self.table().queues;
        if let Some(mut q) = queues.remove(&nexus) {
            Self::drain(&self.pending, &mut q);
        }
        if queues.capacity() > 16 && queues.len() < queues.capacity() / 4 {
            queues.shrink_to_fit();
        }
    }

    /// Sets what is told of every change raised for all nexuses (once; later calls are
    /// ignored).
    pub fn on_change(&self, changed: Changed) {
        let _ = self.changed.set(changed);
    }

    /// Queues `ua` for every nexus that joined except `except`, and keeps it for those that
    /// join later with an earlier stamp; then tells the observer.
    pub fn raise_all(&self, ua: (u8, u8), except: Option<u64>) {
        {
            let mut table = self.table();
            let Table { queues, raised } = &mut *table;
            for (id, q) in queues.iter_mut() {
                if Some(*id) != except {
                    Self::push(&self.pending, q, ua);
                }
            }
            if raised.len() == UA_QUEUE_MAX {
                raised.pop_front();
            }
            // Stamped under the lock: a join that finds no queue here sees it in `raised`.
            raised.push_back(Raised {
                at: stamp(),
                ua,
                except,
            });
        }
        if let Some(changed) = self.changed.get() {
            changed();
        }
    }

    /// Queues `ua` for one nexus, if it joined.
    pub fn raise_one(&self, nexus: u64, ua: (u8, u8)) {
        if let Some(q) = self.table().queues.get_mut(&nexus) {
            Self::push(&self.pending, q, ua);
        }
    }

    /// Takes the oldest condition queued for `nexus`.
    pub fn take(&self, nexus: u64) -> Option<(u8, u8)> {
        if self.pending.load(Ordering::Acquire) == 0 {
            return None;
        }
        let ua = self.table().queues.get_mut(&nexus)?.pop_front()?;
        self.pending.fetch_sub(1, Ordering::Release);
        Some(ua)
    }

    #[cfg(test)]
    pub fn pending_total(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_order_dedup_and_counts() {
        let u = UnitAttentions::default();
        assert_eq!(u.take(1), None);
        u.add_nexus(1);
        u.add_nexus(2);
        assert_eq!(u.pending_total(), 2);
        u.raise_all(MODE_PARAMETERS_CHANGED, Some(2));
        u.raise_all(MODE_PARAMETERS_CHANGED, Some(2));
        assert_eq!(u.pending_total(), 3);
        assert_eq!(u.take(1), Some(POWER_ON_RESET));
        assert_eq!(u.take(1), Some(MODE_PARAMETERS_CHANGED));
        assert_eq!(u.take(1), None);
        u.remove_nexus(2);
        assert_eq!(u.pending_total(), 0);
        assert_eq!(u.take(2), None);
    }

    #[test]
    fn a_queue_keeps_its_order_as_it_is_taken_and_refilled() {
        let mut q = Queue::default();
        for ascq in 0..3 {
            assert!(q.push((0x3F, ascq)));
        }
        assert!(!q.push((0x3F, 1)), "a duplicate");
        assert_eq!(q.pop_front(), Some((0x3F, 0)));
        assert!(q.push((0x2A, 1)));
        let rest: Vec<_> = std::iter::from_fn(|| q.pop_front()).collect();
        assert_eq!(rest, [(0x3F, 1), (0x3F, 2), (0x2A, 1)]);
        assert_eq!(q.pop_front(), None);
    }

    #[test]
    fn the_table_shrinks_once_its_nexuses_are_gone() {
        let u = UnitAttentions::default();
        for n in 0..1000 {
            u.add_nexus(n);
        }
        let full = u.table().queues.capacity();
        for n in 0..1000 {
            u.remove_nexus(n);
        }
        assert_eq!(u.pending_total(), 0);
        let left = u.table().queues.capacity();
        assert!(left < full / 8, "{left} of {full} entries' room kept");
    }

    #[test]
    fn a_late_join_is_told_what_was_raised_since_its_stamp_in_order() {
        let u = UnitAttentions::default();
        u.raise_all(CAPACITY_CHANGED, None);
        let joined = stamp();
        u.raise_all(MODE_PARAMETERS_CHANGED, None);
        u.raise_all(LU_RESET, Some(9));
        let map_changed = stamp();
        u.raise_all(INQUIRY_DATA_CHANGED, None);
        u.join_since(8, joined, Some(map_changed));
        u.join_since(9, joined, None);
        let all = |n| std::iter::from_fn(|| u.take(n)).collect::<Vec<_>>();
        assert_eq!(
            all(8),
            [
                POWER_ON_RESET,
                MODE_PARAMETERS_CHANGED,
                LU_RESET,
                REPORTED_LUNS_CHANGED,
                INQUIRY_DATA_CHANGED
            ]
        );
        // Not the reset it made, and no map change of its own.
        assert_eq!(
            all(9),
            [
                POWER_ON_RESET,
                MODE_PARAMETERS_CHANGED,
                INQUIRY_DATA_CHANGED
            ]
        );
        assert_eq!(u.pending_total(), 0);
        // A second first use is no first use: nothing queued again.
        u.join_since(8, joined, Some(map_changed));
        assert_eq!(u.take(8), None);
    }

    #[test]
    fn a_late_join_after_many_conditions_starts_with_power_on_and_is_bounded() {
        let u = UnitAttentions::default();
        let joined = stamp();
        for ascq in 0..20 {
            u.raise_all((0x3F, ascq), None);
        }
        u.join_since(1, joined, None);
        assert_eq!(u.pending_total(), UA_QUEUE_MAX);
        assert_eq!(u.take(1), Some(POWER_ON_RESET));
        assert_eq!(u.take(1), Some((0x3F, 12)), "the latest seven after it");
    }

    #[test]
    fn queue_is_bounded() {
        let u = UnitAttentions::default();
        u.add_nexus(7);
        for ascq in 0..20 {
            u.raise_all((0x3F, ascq), None);
        }
        assert_eq!(u.pending_total(), UA_QUEUE_MAX);
    }

    #[test]
    fn every_change_for_all_nexuses_is_told_and_one_for_a_single_nexus_is_not() {
        let u = UnitAttentions::default();
        let told = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&told);
        u.on_change(Arc::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        u.add_nexus(1);
        u.raise_one(1, THIN_PROVISIONING_SOFT_THRESHOLD_REACHED);
        assert_eq!(told.load(Ordering::SeqCst), 0);
        // Told even with no nexus to queue for: an NVMe host has none.
        u.remove_nexus(1);
        u.raise_all(CAPACITY_CHANGED, None);
        assert_eq!(told.load(Ordering::SeqCst), 1);
    }
}
