//! Bounded waits ([`Policy::bounds_waits`]): a call that waits as long as
//! it takes waits in slices, each under a savepoint, and starts the next
//! one only when lockkit's own slice ended with the key still busy.

use super::*;

fn lock_timeout() -> DriverError {
    DriverError::new("x")
        .code(Some("55P03"))
        .message(Some("canceling statement due to lock timeout"))
}

/// `K(1)` waiting as long as it takes, sliced.
fn sliced(state: &TxState) -> Acquisition<'_> {
    lock_k(state, 1).unwrap().sliced(true)
}

/// The recovery round's replies: the rollback, then whether the wait was
/// lockkit's slice (`n`).
fn recovered(n: i64) -> Vec<Reply> {
    vec![
        Reply::Done,
        Reply::Tagged {
            tag: Sql::EndSlice.tag().unwrap(),
            n,
        },
    ]
}

const SLICE: [Sql; 5] = [
    Sql::ArmSlice,
    Sql::Savepoint,
    Sql::LockBigint,
    Sql::Release,
    Sql::EndSlice,
];

#[test]
fn a_sliced_wait_arms_its_slice_outside_its_savepoint() {
    let state = TxState::new();
    let mut call = sliced(&state);
    assert_eq!(sqls(&call), SLICE);
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    assert!(call.round().is_none());
    assert_eq!(
        left(&state, call.finish()),
        "granted Some((BigInt(1), Exclusive)) []; held [(BigInt(1), Exclusive)]; poisoned false; next Ok(Some(1))"
    );
}

#[test]
fn only_a_wait_that_waits_as_long_as_it_takes_is_sliced() {
    assert_eq!(
        sqls(&lock_k(&TxState::new(), 1).unwrap().sliced(false)),
        [Sql::LockBigint]
    );
    let state = TxState::new();
    let one = || Request::one(&K(1), Mode::Exclusive);
    let timed = Wait::Timeout(Duration::from_millis(50));
    let call = state
        .acquire(&policy(), 0, one(), timed)
        .unwrap()
        .sliced(true);
    assert!(!sqls(&call).contains(&Sql::ArmSlice));
    drop(call);
    let state = TxState::new();
    let call = state
        .acquire(&policy(), 0, one(), Wait::Try)
        .unwrap()
        .sliced(true);
    assert_eq!(sqls(&call), [Sql::TryBigint]);
}

#[test]
fn the_end_of_lockkit_s_slice_starts_the_next() {
    let state = TxState::new();
    let mut call = sliced(&state);
    for _ in 0..3 {
        call.receive(Err(lock_timeout()));
        assert_eq!(sqls(&call), [Sql::Rollback, Sql::EndSlice]);
        call.receive(Ok(recovered(1)));
        assert_eq!(sqls(&call), SLICE);
    }
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    assert!(call.finish().unwrap().is_ok());
    assert!(!state.is_poisoned());
}

/// The statement that aborts the transaction, and its failure.
fn aborts(call: &mut Acquisition<'_>) {
    assert_eq!(sqls(call), [Sql::AbortTransaction]);
    call.receive(Err(DriverError::new("x")
        .code(Some("22P02"))
        .message(Some("invalid input syntax for type integer"))));
    assert!(call.round().is_none());
}

/// A caller's own `lock_timeout` ends the call as it ends an unbounded
/// wait: a timeout, the transaction aborted (its locks released at once).
#[test]
fn a_lock_timeout_of_the_caller_s_own_ends_the_call_as_unbounded() {
    let state = TxState::new();
    let mut call = sliced(&state);
    call.receive(Err(lock_timeout()));
    call.receive(Ok(recovered(0)));
    aborts(&mut call);
    let err = call.finish().unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(
        lock_k(&state, 2).unwrap_err().kind(),
        ErrorKind::TransactionAborted
    );
}

/// Any other failure of a slice ends the call as it ends an unbounded
/// wait: its savepoint rolled back, then the transaction aborted on
/// purpose, which releases every lock it holds at once.
#[test]
fn any_other_error_in_a_slice_aborts_the_transaction_as_unbounded() {
    for (code, message) in [
        ("40P01", "deadlock detected"),
        ("57014", "canceling statement due to statement timeout"),
        ("53200", "out of shared memory"),
    ] {
        let state = TxState::new();
        let mut call = sliced(&state);
        call.receive(Err(DriverError::new("x")
            .code(Some(code))
            .message(Some(message))));
        assert_eq!(sqls(&call), [Sql::Rollback, Sql::EndSlice], "{code}");
        call.receive(Ok(recovered(1)));
        aborts(&mut call);
        let err = call.finish().unwrap_err();
        assert_eq!(err.code(), Some(code));
        assert_eq!(
            lock_k(&state, 2).unwrap_err().kind(),
            ErrorKind::TransactionAborted,
            "{code}"
        );
    }
}

/// The statement that aborts the transaction succeeding is no reply of
/// lockkit's: the transaction is poisoned.
#[test]
fn an_abort_that_succeeds_is_an_unexpected_reply() {
    let state = TxState::new();
    let mut call = sliced(&state);
    call.receive(Err(lock_timeout()));
    call.receive(Ok(recovered(0)));
    call.receive(Ok(vec![Reply::Done]));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );
    assert!(state.is_poisoned());
}

#[test]
fn a_slice_s_answer_that_is_not_0_or_1_or_contradicts_its_arming_is_refused() {
    let state = TxState::new();
    let mut call = sliced(&state);
    call.receive(Err(lock_timeout()));
    call.receive(Ok(recovered(2)));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );

    let state = TxState::new();
    let mut call = sliced(&state);
    let mut replies = granted(&call.round().unwrap());
    replies[0] = Reply::Tagged {
        tag: Sql::ArmSlice.tag().unwrap(),
        n: 1,
    };
    call.receive(Ok(replies));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );

    // A `NULL` tag (nothing armed in this transaction) is not the reply.
    let state = TxState::new();
    let mut call = sliced(&state);
    call.receive(Err(lock_timeout()));
    call.receive(Ok(vec![Reply::Done, Reply::Malformed("NULL tag".into())]));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );
}

#[test]
fn a_failed_recovery_ends_the_call_aborted() {
    let state = TxState::new();
    let mut call = sliced(&state);
    call.receive(Err(lock_timeout()));
    call.receive(Err(DriverError::new("connection closed")));
    let err = call.finish().unwrap_err();
    assert!(err.is_timeout() || err.code() == Some("55P03"), "{err:?}");
    assert_eq!(
        lock_k(&state, 2).unwrap_err().kind(),
        ErrorKind::TransactionAborted
    );
}

#[test]
fn a_sliced_batch_arms_one_slice_around_both_key_spaces() {
    let state = TxState::new();
    let request = Request::batch(&Batch::new().with(&K(1)).with(&K(2)).with(&P(3)).with(&P(4)));
    let call = state
        .acquire(&policy(), 0, request, Wait::Forever)
        .unwrap()
        .sliced(true);
    assert_eq!(
        sqls(&call),
        [
            Sql::ArmSlice,
            Sql::Savepoint,
            Sql::BatchBigintExclusive,
            Sql::BatchPairExclusive,
            Sql::Release,
            Sql::EndSlice,
        ]
    );
}

/// The try that starts a bounded lock on a connection the call has to
/// itself is checked as the lock is: the order check applies to it, as to
/// any call that may wait.
#[test]
fn the_try_that_starts_a_bounded_lock_is_checked_as_a_lock() {
    let checked = Policy::new(
        Config::default().order_check(OrderCheck::Error),
        ServerFacts::assumed(64, 100, 0),
    );
    let state = TxState::new();
    let mut first = lock_k(&state, 5).unwrap();
    let replies = granted(&first.round().unwrap());
    first.receive(Ok(replies));
    first.finish().unwrap().unwrap();
    let site = Location::caller();
    let err = state
        .acquire_one_first(&checked, 0, (&K(1), Mode::Exclusive), Some(site))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    assert_eq!(err.lock_order_sites().unwrap().1, Some(site));
    let call = state
        .acquire_one_first(&checked, 0, (&K(9), Mode::Exclusive), None)
        .unwrap();
    assert_eq!(call.statement().unwrap().sql(), Sql::TryBigint);
}

/// A busy answer to that try is not the lock's outcome: its span records
/// none; a grant is the lock's, and recorded.
#[test]
fn the_busy_try_that_starts_a_bounded_lock_records_no_outcome() {
    use crate::engine::observe::recording::recorded;
    let busy = |state: &TxState| {
        let mut call = state
            .acquire_one_first(&policy(), 0, (&K(1), Mode::Exclusive), None)
            .unwrap();
        let tag = Sql::TryBigint.tag().unwrap();
        call.receive(Ok(Reply::Tagged { tag, n: 0 }), |_, r: &Reply| r.clone());
        assert!(call.finish().unwrap().is_err(), "busy");
    };
    let ((), seen) = recorded(|| busy(&TxState::new()));
    assert!(!seen.contains("outcome="), "{seen}");
    // The control: the same busy answer to a try of the application's own
    // is its outcome, and recorded.
    let ((), seen) = recorded(|| {
        let state = TxState::new();
        let mut call = state
            .acquire_one(&policy(), 0, (&K(1), Mode::Exclusive), true, None)
            .unwrap();
        let tag = Sql::TryBigint.tag().unwrap();
        call.receive(Ok(Reply::Tagged { tag, n: 0 }), |_, r: &Reply| r.clone());
        assert!(call.finish().unwrap().is_err(), "busy");
    });
    assert!(seen.contains("outcome=\"busy\""), "{seen}");
    let ((), seen) = recorded(|| {
        let state = TxState::new();
        let mut call = state
            .acquire_one_first(&policy(), 0, (&K(1), Mode::Exclusive), None)
            .unwrap();
        let tag = Sql::TryBigint.tag().unwrap();
        call.receive(Ok(Reply::Tagged { tag, n: 1 }), |_, r: &Reply| r.clone());
        assert!(call.finish().unwrap().is_ok(), "granted");
    });
    assert!(seen.contains("outcome=\"granted\""), "{seen}");
}
