//! Connections that have not completed login yet have a budget of their own, so that clients
//! that connect and never log in cannot lock out those that do. When the budget is full, a new
//! connection evicts one that is still waiting: the oldest of the source address holding the
//! most (an initiator logging in from its own address is the last to go while a flood from
//! other addresses goes on). Under pressure (half the budget in use) new connections also get
//! a shorter login deadline.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// The login deadline of a connection that arrives while half the budget is in use: a real
/// initiator's login (CHAP included) takes milliseconds to a round trip or two.
pub const PRESSURE_LOGIN_TIMEOUT: Duration = Duration::from_secs(3);

pub struct PreLogin {
    budget: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// By arrival (ids only grow): the oldest first.
    waiting: BTreeMap<u64, Waiting>,
}

struct Waiting {
    source: IpAddr,
    evict: Arc<Notify>,
}

/// A connection's place in the pre-login budget, given up when it drops (login completed,
/// failed, or the connection closed).
pub struct Ticket {
    registry: Arc<PreLogin>,
    id: u64,
    evict: Arc<Notify>,
    /// The login deadline this connection gets.
    pub login_timeout: Duration,
}

impl Ticket {
    /// Resolves when the connection was evicted to make room for a newer one.
    pub async fn evicted(&self) {
        self.evict.notified().await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.registry.lock().waiting.remove(&self.id);
    }
}

impl PreLogin {
    /// `budget`: at most this many connections wait for their login at once (at least 1).
    pub fn new(budget: usize) -> Arc<PreLogin> {
        Arc::new(PreLogin {
            budget: budget.max(1),
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections waiting for their login now.
    pub fn count(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Registers a new connection from `source`. If the budget is full, one waiting connection
    /// is told to close first (its source is returned). `login_timeout`: the normal deadline,
    /// shortened under pressure.
    pub fn enter(
        self: &Arc<Self>,
        source: IpAddr,
        login_timeout: Duration,
    ) -> (Ticket, Option<IpAddr>) {
        let mut state = self.lock();
        let evicted = if state.waiting.len() >= self.budget {
            evict_one(&mut state)
        } else {
            None
        };
        let pressure = (state.waiting.len() + 1) * 2 > self.budget;
        let id = state.next_id;
        state.next_id += 1;
        let evict = Arc::new(Notify::new());
        state.waiting.insert(
            id,
            Waiting {
                source,
                evict: Arc::clone(&evict),
            },
        );
        let login_timeout = if pressure {
            login_timeout.min(PRESSURE_LOGIN_TIMEOUT)
        } else {
            login_timeout
        };
        drop(state);
        (
            Ticket {
                registry: Arc::clone(self),
                id,
                evict,
                login_timeout,
            },
            evicted,
        )
    }

    /// Evicts one waiting connection (to make room under `max_connections`); its source, or
    /// None when none is waiting.
    pub fn evict_one(&self) -> Option<IpAddr> {
        evict_one(&mut self.lock())
    }
}

/// Tells the oldest waiting connection of the source with the most waiting ones to close, and
/// forgets it (it closes on its own worker within a turn).
fn evict_one(state: &mut State) -> Option<IpAddr> {
    let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
    for w in state.waiting.values() {
        *per_source.entry(w.source).or_default() += 1;
    }
    let busiest = per_source.values().copied().max()?;
    // The oldest first: the first entry of a busiest source is its oldest.
    let id = state
        .waiting
        .iter()
        .find(|(_, w)| per_source.get(&w.source) == Some(&busiest))
        .map(|(&id, _)| id)?;
    let victim = state.waiting.remove(&id)?;
    // A stored permit: the connection sees it even if it is not waiting on it yet.
    victim.evict.notify_one();
    Some(victim.source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    const NORMAL: Duration = Duration::from_secs(15);

    #[test]
    fn within_the_budget_nothing_is_evicted_and_tickets_give_their_place_back() {
        let p = PreLogin::new(4);
        let a = p.enter(ip(1), NORMAL);
        let b = p.enter(ip(2), NORMAL);
        assert!(a.1.is_none() && b.1.is_none());
        assert_eq!(a.0.login_timeout, NORMAL, "no pressure at 1 of 4");
        assert_eq!(p.count(), 2);
        drop(a);
        assert_eq!(p.count(), 1);
        drop(b);
        assert_eq!(p.count(), 0);
    }

    #[test]
    fn a_full_budget_evicts_the_oldest_of_the_busiest_source() {
        let p = PreLogin::new(4);
        let good = p.enter(ip(1), NORMAL);
        let flood: Vec<_> = (0..3).map(|_| p.enter(ip(9), NORMAL)).collect();
        assert_eq!(p.count(), 4);
        // Full: the next one evicts the flood's oldest, never the lone initiator.
        let (next, evicted) = p.enter(ip(9), NORMAL);
        assert_eq!(evicted, Some(ip(9)));
        assert_eq!(p.count(), 4);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        // The evicted one hears it (the permit is stored), the others do not.
        rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(100), flood[0].0.evicted())
                .await
                .expect("the oldest flood connection is told to close");
        });
        let quiet = |t: &Ticket| {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(20), t.evicted())
                    .await
                    .is_err()
            })
        };
        assert!(quiet(&good.0) && quiet(&flood[1].0) && quiet(&next));
        // An evicted ticket dropping later does not remove anyone else.
        drop(flood);
        assert_eq!(p.count(), 2);
    }

    #[test]
    fn ties_evict_the_oldest_overall_and_pressure_shortens_the_deadline() {
        let p = PreLogin::new(2);
        let (first, _) = p.enter(ip(1), NORMAL);
        let (second, _) = p.enter(ip(2), NORMAL);
        assert_eq!(first.login_timeout, NORMAL);
        assert_eq!(second.login_timeout, PRESSURE_LOGIN_TIMEOUT);
        let (_third, evicted) = p.enter(ip(3), NORMAL);
        assert_eq!(evicted, Some(ip(1)));
        // A deadline already shorter than the pressure one stays.
        let (short, _) = p.enter(ip(4), Duration::from_secs(1));
        assert_eq!(short.login_timeout, Duration::from_secs(1));
        assert!(p.evict_one().is_some());
        drop((first, second, short));
    }

    #[test]
    fn evicting_with_nobody_waiting_is_none() {
        let p = PreLogin::new(1);
        assert_eq!(p.evict_one(), None);
    }
}
