//! A semaphore permit's try: one statement, its reply checked, the slot
//! granted recorded, and a permit asked again granted with nothing sent.

use std::num::NonZeroU8;

use super::*;
use crate::key::{semaphore_base, semaphore_of, SEMAPHORE_CLASS};

const THREE: NonZeroU8 = match NonZeroU8::new(3) {
    Some(n) => n,
    None => unreachable!(),
};

/// The reply of `TRY_PERMIT` naming slot `n - 1` (0: every slot busy).
fn slot_reply(n: i64) -> Reply {
    Reply::Tagged {
        tag: Sql::TryPermit.tag().unwrap(),
        n,
    }
}

/// One statement, with the semaphore's slot-0 object, its permits and a
/// first slot among them; the slot the reply names is held, and the next
/// ask of the same transaction is granted that slot with nothing sent.
#[test]
fn a_permit_is_one_statement_and_asking_again_sends_nothing() {
    let (state, policy) = (TxState::new(), policy());
    let mut call = state
        .acquire_permit(&policy, 0, (&K(7), THREE), None)
        .unwrap();
    let statement = call.statement().expect("a statement to send");
    assert_eq!(statement.sql(), Sql::TryPermit);
    let base = semaphore_base(LockKey::BigInt(7));
    match statement.params() {
        [Param::Int4(b), Param::Int4(3), Param::Int4(first)] => {
            assert_eq!(*b, base);
            assert!((0..3).contains(first), "first slot {first}");
        }
        other => panic!("params {other:?}"),
    }
    call.receive(Ok(()), |_, ()| slot_reply(3));
    assert!(call.statement().is_none(), "one statement");
    let held = Grant::try_lock(call.finish(), K(7)).unwrap().unwrap();
    assert_eq!(held.key(), LockKey::Pair(SEMAPHORE_CLASS, base | 2));
    assert_eq!(semaphore_of(held.key()), Some((base, 2)));
    assert_eq!(state.held_count(), 1);

    let again = state
        .acquire_permit(&policy, 0, (&K(7), THREE), None)
        .unwrap();
    assert!(again.statement().is_none(), "held: nothing to send");
    let held = Grant::try_lock(again.finish(), K(7)).unwrap().unwrap();
    assert_eq!(held.key(), LockKey::Pair(SEMAPHORE_CLASS, base | 2));
    assert_eq!(state.held_count(), 1);
}

/// Every slot busy: the key back, nothing held; a reply naming a slot
/// beyond the permits, or of another statement, is refused and poisons.
#[test]
fn busy_and_foreign_replies() {
    let policy = policy();
    let state = TxState::new();
    let mut call = state
        .acquire_permit(&policy, 0, (&K(8), THREE), None)
        .unwrap();
    call.receive(Ok(()), |_, ()| slot_reply(0));
    assert!(Grant::try_lock(call.finish(), K(8)).unwrap().is_err());
    assert_eq!(state.held_count(), 0);

    for reply in [
        slot_reply(4),
        slot_reply(-1),
        Reply::Tagged {
            tag: Sql::TryPair.tag().unwrap(),
            n: 1,
        },
    ] {
        let state = TxState::new();
        let mut call = state
            .acquire_permit(&policy, 0, (&K(8), THREE), None)
            .unwrap();
        call.receive(Ok(()), |_, ()| reply.clone());
        let err = call.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{reply:?}: {err}");
        assert!(state.is_poisoned(), "{reply:?}");
    }
}
