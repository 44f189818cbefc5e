//! What a call checks before anything is sent (the order), and what it
//! reports: its span, and the guard its grant makes.

use super::*;
use crate::engine::observe::recording::recorded;

/// A policy that refuses a waiting call below a key held.
fn order_checked() -> Policy {
    Policy::new(
        Config::default().order_check(OrderCheck::Error),
        ServerFacts::assumed(64, 100, 0),
    )
}

/// The order check applies to the calls that wait; a try cannot deadlock.
#[test]
fn only_a_waiting_call_is_checked_for_its_order() {
    let state = TxState::new();
    let checked = order_checked();
    take_at(&state, 0, &K(5));
    let below = || Request::one(&K(1), Mode::Exclusive);
    let err = state
        .acquire(&checked, 0, below(), Wait::Forever)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    // Both keys named by their type, the one held and the one asked for.
    assert_eq!(err.to_string().matches("the K key").count(), 2, "{err}");
    assert!(state.acquire(&checked, 0, below(), Wait::Try).is_ok());
}

/// The same for the one-key call, whose order error names the site it was
/// asked at.
#[test]
fn a_one_key_call_is_checked_when_it_waits_and_names_its_site() {
    let state = TxState::new();
    take_at(&state, 0, &K(5));
    let site = Location::caller();
    let one = |try_only| {
        state.acquire_one(
            &order_checked(),
            0,
            (&K(1), Mode::Exclusive),
            try_only,
            Some(site),
        )
    };
    let err = one(false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    assert_eq!(err.lock_order_sites().unwrap().1, Some(site));
    assert!(one(true).is_ok());
}

/// A call that goes to the server makes its span, and records its outcome
/// in it.
#[test]
fn a_call_makes_its_span_and_records_its_outcome() {
    let state = TxState::new();
    let ((), seen) = recorded(|| {
        take_at(&state, 0, &K(1));
        // Held already: nothing is sent, and no span is made.
        let relock = lock_k(&state, 1).unwrap();
        assert!(relock.round().is_none());
    });
    assert_eq!(seen.matches("span=lockkit.lock").count(), 1, "{seen}");
    assert!(seen.contains("outcome=\"granted\""), "{seen}");
}

/// A one-key call's grant makes the batch guard of its key.
#[test]
fn a_one_key_grant_makes_the_batch_guard_of_its_key() {
    let state = TxState::new();
    let mut call = lock_k(&state, 1).unwrap();
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    let held = call.finish().unwrap().unwrap().batch();
    assert_eq!(held.keys(), [(LockKey::BigInt(1), Mode::Exclusive)]);
}

/// A one-key try's count under another statement's tag is refused.
#[test]
fn a_one_key_reply_under_another_tag_is_refused() {
    let state = TxState::new();
    let one = Request::one(&K(1), Mode::Exclusive);
    let mut call = state.acquire(&policy(), 0, one, Wait::Try).unwrap();
    let mut replies = granted(&call.round().unwrap());
    for reply in &mut replies {
        if let Reply::Tagged { tag, .. } = reply {
            *tag += 1;
        }
    }
    call.receive(Ok(replies));
    let err = call.finish().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{err}");
}

/// An ending is pending until it records what the server answered; then
/// its drop records nothing more.
#[test]
fn a_recorded_ending_is_no_longer_pending() {
    let state = TxState::new();
    take_at(&state, 1, &K(1));
    let mut ending = state.ending(1, SavepointEnd::RolledBack);
    assert!(ending.is_pending());
    ending.record(SavepointEnd::Released);
    assert!(!ending.is_pending());
    drop(ending);
    assert_eq!(state.held_count(), 1, "released: the key stays");
}

/// A key of a server-`hashtext` type is refused on a server whose
/// `hashtext` differs from lockkit's; other keys are not.
#[test]
fn a_hashtext_key_needs_the_servers_hashtext() {
    struct H(i64);
    impl AdvisoryKey for H {
        const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("H").hashtext();
        fn lock_key(&self) -> LockKey {
            LockKey::BigInt(self.0)
        }
    }
    let wrong = vec![0; crate::engine::facts::HASHTEXT_PROBES.len()];
    let policy = Policy::new(Config::default(), facts(false, wrong));
    let state = TxState::new();
    let hashed = Request::one(&H(1), Mode::Exclusive);
    let err = state
        .acquire(&policy, 0, hashed, Wait::Forever)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::HashtextMismatch, "{err}");
    let plain = Request::one(&K(1), Mode::Exclusive);
    assert!(state.acquire(&policy, 0, plain, Wait::Forever).is_ok());
}

/// On a hot standby a lock is refused, unless the configuration allows
/// it (it would exclude nothing on the primary).
#[test]
fn a_standby_refuses_locks_unless_allowed() {
    let right = crate::engine::facts::HASHTEXT_PROBES
        .iter()
        .map(|p| crate::key::hashtext(p))
        .collect();
    let standby = facts(true, right);
    let on = |config: Config| Policy::new(config, standby.clone());
    let state = TxState::new();
    let one = || Request::one(&K(1), Mode::Exclusive);
    let err = state
        .acquire(&on(Config::default()), 0, one(), Wait::Forever)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::HotStandby, "{err}");
    let allowed = on(Config::default().allow_standby(true));
    assert!(state.acquire(&allowed, 0, one(), Wait::Forever).is_ok());
}
