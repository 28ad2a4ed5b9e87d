use super::*;

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn present(h: &str) -> OwnerSeen {
    OwnerSeen::Present {
        holder: Some(h.to_string()),
    }
}

fn gone(h: &str) -> OwnerSeen {
    OwnerSeen::Gone {
        holder: h.to_string(),
    }
}

const S: Duration = Duration::from_secs(1);

#[test]
fn a_gateway_keeps_its_view_of_the_owner_through_brief_blindness() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut sight = Sight::default();
    // Quick failures, one look a second: the view is kept until the first failed look
    // began BLIND_GRACE ago.
    assert!(!sight.failed(at(0), at(10), false));
    assert!(!sight.failed(at(1000), at(1010), false));
    assert!(!sight.failed(at(2000), at(2010), false));
    assert!(sight.failed(at(3000), at(3010), false));
    // A success starts the count over.
    sight.seen();
    assert!(!sight.failed(at(4000), at(4010), false));
    assert!(!sight.failed(at(5000), at(6999), false));
    assert!(sight.failed(at(6000), at(7000), false));
    // One look that hung for the whole grace (a cluster gone: calls time out) is enough.
    sight.seen();
    assert!(sight.failed(
        at(10_000),
        at(10_000 + BLIND_GRACE.as_millis() as u64),
        false
    ));
    // Fenced: at once.
    sight.seen();
    assert!(sight.failed(at(20_000), at(20_001), true));
    // A clock that seems to run back counts as no time.
    let mut sight = Sight::default();
    assert!(!sight.failed(at(5000), at(4000), false));
}

#[test]
fn an_owner_is_gone_when_its_lock_holder_no_longer_watches_the_image() {
    let holder = "127.0.0.1:0/1001";
    let watchers = names(&["v2:127.0.0.1:0/1001", "127.0.0.1:0/2002"]);
    assert_eq!(judge(&names(&[holder]), &watchers), present(holder));
    assert_eq!(
        judge(&names(&[holder]), &names(&["127.0.0.1:0/2002"])),
        gone(holder)
    );
    assert_eq!(judge(&names(&[holder]), &[]), gone(holder));
    // A nonce is part of the name: a restarted client on the same address is another.
    assert_eq!(
        judge(&names(&[holder]), &names(&["127.0.0.1:0/10011"])),
        gone(holder)
    );
    assert_eq!(judge(&[], &watchers), OwnerSeen::Unlocked);
    // Shared locks are not a gateway's: never acted on.
    assert_eq!(
        judge(&names(&[holder, "127.0.0.1:0/3"]), &[]),
        OwnerSeen::Present { holder: None }
    );
}

#[test]
fn a_silent_owner_is_taken_over_after_the_grace_a_beating_one_never() {
    let t0 = Instant::now();
    let h = "10.0.0.5:0/77";
    let mut vigil = OwnerVigil::new(5 * S);
    // Beating every second for a minute: alive, never taken.
    for i in 0..60u64 {
        let beat = beat_value(h, i);
        assert_eq!(
            vigil.look(
                present(h),
                Some(&beat),
                t0 + i as u32 * S,
                t0 + i as u32 * S
            ),
            Vigil::Wait
        );
        assert!(vigil.owner_alive(t0 + i as u32 * S));
    }
    // The beat stops at 59 (SIGSTOP): late after BEAT_LATE, taken after the grace, the
    // watch still present (the OSDs hear from a stopped client's connection for 30 s).
    let last = beat_value(h, 59);
    let at = |s: u32| t0 + (59 + s) * S;
    assert_eq!(
        vigil.look(present(h), Some(&last), at(1), at(1)),
        Vigil::Wait
    );
    assert!(vigil.owner_alive(at(2)));
    assert_eq!(vigil.silence(at(2)), 2 * S);
    assert_eq!(
        vigil.look(present(h), Some(&last), at(3), at(3)),
        Vigil::Noticed(Doubt::Silent)
    );
    assert!(!vigil.owner_alive(at(3)));
    assert_eq!(
        vigil.look(present(h), Some(&last), at(4), at(4)),
        Vigil::Wait
    );
    assert_eq!(
        vigil.look(present(h), Some(&last), at(5), at(5)),
        Vigil::Take(Some(h.to_string()))
    );
    // A beat that moves again before the grace: alive again, the count starts over.
    let mut vigil = OwnerVigil::new(5 * S);
    vigil.look(present(h), Some(&beat_value(h, 1)), t0, t0);
    assert_eq!(
        vigil.look(present(h), Some(&beat_value(h, 1)), t0 + 4 * S, t0 + 4 * S),
        Vigil::Noticed(Doubt::Silent)
    );
    assert_eq!(
        vigil.look(
            present(h),
            Some(&beat_value(h, 2)),
            t0 + 4 * S + S / 2,
            t0 + 4 * S + S / 2
        ),
        Vigil::Wait
    );
    assert!(vigil.owner_alive(t0 + 5 * S));
    assert_eq!(
        vigil.look(present(h), Some(&beat_value(h, 2)), t0 + 9 * S, t0 + 9 * S),
        Vigil::Noticed(Doubt::Silent)
    );
    assert_eq!(
        vigil.look(
            present(h),
            Some(&beat_value(h, 2)),
            t0 + 9 * S + S / 4,
            t0 + 9 * S + S / 4
        ),
        Vigil::Wait
    );
}

#[test]
fn only_the_holders_own_heartbeat_counts() {
    let t0 = Instant::now();
    let (old, new) = ("10.0.0.5:0/1", "10.0.0.6:0/2");
    let mut vigil = OwnerVigil::new(5 * S);
    // The stored beat is the previous owner's (the new one has not written yet, or is of a
    // release that writes none): the new owner is judged by the cluster's watch alone.
    let stale = beat_value(old, 40);
    for i in 0..30 {
        assert_eq!(
            vigil.look(present(new), Some(&stale), t0 + i * S, t0 + i * S),
            Vigil::Wait
        );
        assert!(vigil.owner_alive(t0 + i * S));
    }
    assert_eq!(
        vigil.look(present(new), None, t0 + 31 * S, t0 + 31 * S),
        Vigil::Wait
    );
    // Once it beats, its beat is what counts.
    vigil.look(
        present(new),
        Some(&beat_value(new, 0)),
        t0 + 32 * S,
        t0 + 32 * S,
    );
    assert_eq!(
        vigil.look(
            present(new),
            Some(&beat_value(new, 0)),
            t0 + 37 * S,
            t0 + 37 * S
        ),
        Vigil::Take(Some(new.to_string()))
    );
    // A garbled value is no beat.
    let mut vigil = OwnerVigil::new(5 * S);
    for i in 0..10 {
        assert_eq!(
            vigil.look(present(new), Some("garbage"), t0 + i * S, t0 + i * S),
            Vigil::Wait
        );
    }
}

#[test]
fn a_gone_owner_is_taken_over_after_two_looks_an_unlocked_image_after_the_grace() {
    let t0 = Instant::now();
    let mut vigil = OwnerVigil::new(5 * S);
    assert_eq!(vigil.look(present("a"), None, t0, t0), Vigil::Wait);
    assert_eq!(
        vigil.look(gone("a"), None, t0 + S, t0 + S),
        Vigil::Noticed(Doubt::Gone)
    );
    assert!(!vigil.owner_alive(t0 + S));
    assert_eq!(
        vigil.look(gone("a"), None, t0 + 2 * S, t0 + 2 * S),
        Vigil::Wait
    );
    assert_eq!(
        vigil.look(gone("a"), None, t0 + 3 * S, t0 + 3 * S),
        Vigil::Take(Some("a".to_string()))
    );
    // A watch missing for one look (librbd re-watching): nothing happens.
    assert_eq!(
        vigil.look(gone("b"), None, t0 + 10 * S, t0 + 10 * S),
        Vigil::Noticed(Doubt::Gone)
    );
    assert_eq!(
        vigil.look(present("b"), None, t0 + 11 * S, t0 + 11 * S),
        Vigil::Wait
    );
    assert!(vigil.owner_alive(t0 + 11 * S));
    assert_eq!(
        vigil.look(gone("b"), None, t0 + 12 * S, t0 + 12 * S),
        Vigil::Noticed(Doubt::Gone)
    );
    // Another holder gone is another owner: its own count.
    assert_eq!(
        vigil.look(gone("c"), None, t0 + 13 * S, t0 + 13 * S),
        Vigil::Noticed(Doubt::Gone)
    );
    // Nobody holds it (a clean stop, maybe a restart): the whole grace.
    assert_eq!(
        vigil.look(OwnerSeen::Unlocked, None, t0 + 20 * S, t0 + 20 * S),
        Vigil::Noticed(Doubt::Unlocked)
    );
    assert_eq!(
        vigil.look(OwnerSeen::Unlocked, None, t0 + 24 * S, t0 + 24 * S),
        Vigil::Wait
    );
    assert_eq!(
        vigil.look(OwnerSeen::Unlocked, None, t0 + 25 * S, t0 + 25 * S),
        Vigil::Take(None)
    );
    // A failed takeover or a cluster that did not answer: the count starts over.
    vigil.look(gone("d"), None, t0 + 30 * S, t0 + 30 * S);
    vigil.reset();
    assert_eq!(
        vigil.look(gone("d"), None, t0 + 40 * S, t0 + 40 * S),
        Vigil::Noticed(Doubt::Gone)
    );
    // Shared locks: never acted on, and they forget what was seen.
    assert_eq!(
        vigil.look(
            OwnerSeen::Present { holder: None },
            None,
            t0 + 41 * S,
            t0 + 41 * S
        ),
        Vigil::Wait
    );
    assert_eq!(
        vigil.look(gone("d"), None, t0 + 42 * S, t0 + 42 * S),
        Vigil::Noticed(Doubt::Gone)
    );
}

#[test]
fn a_zero_grace_judges_but_never_takes() {
    let t0 = Instant::now();
    let mut never = OwnerVigil::new(Duration::ZERO);
    never.look(present("a"), Some(&beat_value("a", 1)), t0, t0);
    for i in 1..100 {
        let seen = if i % 2 == 0 { gone("a") } else { present("a") };
        assert!(!matches!(
            never.look(seen, Some(&beat_value("a", 1)), t0 + i * S, t0 + i * S),
            Vigil::Take(_)
        ));
    }
    assert!(!never.owner_alive(t0 + 100 * S));
    for i in 0..100 {
        assert!(!matches!(
            never.look(
                OwnerSeen::Unlocked,
                None,
                t0 + (200 + i) * S,
                t0 + (200 + i) * S
            ),
            Vigil::Take(_)
        ));
    }
}

#[test]
fn an_initiator_never_takes_the_image_from_a_live_owner_the_operator_may() {
    assert!(!may_take(Asker::Initiator, true));
    assert!(may_take(Asker::Initiator, false));
    assert!(may_take(Asker::Operator, true));
    assert!(may_take(Asker::Operator, false));
}

#[test]
fn the_owner_record_names_the_gateway_and_its_lock_holder() {
    assert_eq!(
        parse_owner("gw-a 10.0.0.5:0/3052916102"),
        Some(OwnerRecord {
            gateway: "gw-a",
            holder: Some("10.0.0.5:0/3052916102")
        })
    );
    // Written before holders were kept: the gateway alone.
    assert_eq!(
        parse_owner(" gw-b\n"),
        Some(OwnerRecord {
            gateway: "gw-b",
            holder: None
        })
    );
    assert_eq!(parse_owner(""), None);
    assert_eq!(parse_owner("   "), None);
    assert_eq!(
        beat_holder(&beat_value("10.0.0.5:0/3", 7)),
        Some("10.0.0.5:0/3")
    );
    assert_eq!(beat_holder("7"), None);
}

#[test]
fn a_slow_cluster_stretches_the_grace_by_the_time_its_looks_took() {
    let t0 = Instant::now();
    let h = "10.0.0.5:0/77";
    let beat = beat_value(h, 1);
    let mut vigil = OwnerVigil::new(5 * S);
    assert_eq!(vigil.look(present(h), Some(&beat), t0, t0), Vigil::Wait);
    // Looks 3 s apart that each take 2 s: only the second between them counts, so the owner is
    // taken over after 15 s instead of 5.
    let said: Vec<Vigil> = (1..=5u32)
        .map(|i| {
            let now = t0 + 3 * i * S;
            vigil.look(present(h), Some(&beat), now - 2 * S, now)
        })
        .collect();
    assert_eq!(
        said,
        vec![
            Vigil::Wait,
            Vigil::Wait,
            Vigil::Noticed(Doubt::Silent),
            Vigil::Wait,
            Vigil::Take(Some(h.to_string()))
        ]
    );
    // A look that takes longer than the whole silence so far does not count at all.
    let mut vigil = OwnerVigil::new(5 * S);
    vigil.look(present(h), Some(&beat), t0, t0);
    assert_eq!(
        vigil.look(present(h), Some(&beat), t0 + 2 * S, t0 + 30 * S),
        Vigil::Wait
    );
    assert!(vigil.owner_alive(t0 + 30 * S));
}
