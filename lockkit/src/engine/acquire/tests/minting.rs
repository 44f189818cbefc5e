//! Fencing tokens in transaction-scoped calls: the round's last lock
//! statement mints, its token becomes the grant's, and a minting call
//! that gets no token, or a missing counter, fails typed.

use super::*;
use crate::fencing::FencingToken;

fn minting() -> Policy {
    Policy::new(
        Config::default()
            .order_check(OrderCheck::Off)
            .fencing_tokens(true),
        ServerFacts::assumed(64, 100, 0),
    )
}

/// `granted`, with the token `[1, 50, counter]` on each minting statement.
fn minted(round: &[Statement<'_>], counter: i64) -> Vec<Reply> {
    round
        .iter()
        .zip(granted(round))
        .map(|(s, reply)| match s.is_minting() {
            true => Reply::Minted {
                reply: Box::new(reply),
                token: [1, 50, counter],
            },
            false => reply,
        })
        .collect()
}

/// Each kind of call mints in its last lock statement only, and its grant
/// carries the token.
#[test]
fn every_call_mints_in_its_last_lock_statement() {
    let policy = minting();
    let batch = Batch::new().with(&K(1)).with_shared(&K(2)).with(&P(3));
    let two = || Request::batch(&batch);
    for (what, request, wait) in [
        ("lock", Request::one(&K(1), Mode::Exclusive), Wait::Forever),
        (
            "timeout",
            Request::one(&K(1), Mode::Exclusive),
            Wait::Timeout(Duration::from_secs(1)),
        ),
        ("try", Request::one(&K(1), Mode::Exclusive), Wait::Try),
        ("batch", two(), Wait::Forever),
        ("timed batch", two(), Wait::Timeout(Duration::from_secs(1))),
    ] {
        let state = TxState::new();
        let mut call = state.acquire(&policy, 0, request, wait).unwrap();
        let round = call.round().unwrap();
        let minting: Vec<(Sql, bool)> = round.kinds().to_vec();
        let last_take = minting.iter().rposition(|(sql, _)| sql.takes_keys());
        for (i, (sql, mints)) in minting.iter().enumerate() {
            assert_eq!(
                *mints,
                Some(i) == last_take,
                "{what}: {sql:?} in {minting:?}"
            );
        }
        let replies = minted(&round, 7);
        call.receive(Ok(replies));
        let grant = call.finish().unwrap().expect("granted");
        assert_eq!(grant.token, FencingToken::from_parts(1, 50, 7), "{what}");
    }
}

/// A try of a batch mints in its main round, inside its savepoint; its
/// settling round mints nothing, and the grant keeps the main round's
/// token.
#[test]
fn a_tried_batch_mints_in_its_main_round() {
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&K(2));
    let request = Request::batch(&batch);
    let mut call = state.acquire(&minting(), 0, request, Wait::Try).unwrap();
    let round = call.round().unwrap();
    assert_eq!(
        round.kinds().as_slice(),
        [(Sql::Savepoint, false), (Sql::TryBatchBigint, true)]
    );
    let replies = minted(&round, 9);
    call.receive(Ok(replies));
    let settle = call.round().unwrap();
    assert_eq!(settle.kinds().as_slice(), [(Sql::Release, false)]);
    let replies = granted(&settle);
    call.receive(Ok(replies));
    let grant = call.finish().unwrap().expect("granted");
    assert_eq!(grant.token, FencingToken::from_parts(1, 50, 9));
}

/// A one-key call (lock, try, permit) sends its one statement minting.
#[test]
fn one_key_calls_mint() {
    let policy = minting();
    let permits = std::num::NonZeroU8::new(3).unwrap();
    let state = TxState::new();
    for i in 0..3 {
        let mut call = match i {
            0 => state.acquire_one(&policy, 0, (&K(1), Mode::Exclusive), false, None),
            1 => state.acquire_one(&policy, 0, (&K(2), Mode::Shared), true, None),
            _ => state.acquire_permit(&policy, 0, (&K(3), permits), None),
        }
        .unwrap();
        let statement = call.statement().unwrap();
        assert!(statement.is_minting(), "{statement:?}");
        let reply = minted(std::slice::from_ref(&statement), i + 1).remove(0);
        call.receive(Ok(reply), |_, reply: &Reply| reply.clone());
        let grant = call.finish().unwrap().expect("granted");
        assert_eq!(grant.token, FencingToken::from_parts(1, 50, i as u64 + 1));
    }
    // Not minting: no token, and the plain statement.
    let state = TxState::new();
    let mut call = state
        .acquire_one(&super::policy(), 0, (&K(1), Mode::Exclusive), false, None)
        .unwrap();
    let statement = call.statement().unwrap();
    assert!(!statement.is_minting());
    let reply = granted(std::slice::from_ref(&statement)).remove(0);
    call.receive(Ok(reply), |_, reply: &Reply| reply.clone());
    assert_eq!(call.finish().unwrap().expect("granted").token, None);
}

/// A minting statement's reply without its token is not lockkit's reply:
/// nothing is known, and the transaction is poisoned. The same for a call
/// of many statements.
#[test]
fn a_minting_call_without_its_token_is_cut_off() {
    let policy = minting();
    let state = TxState::new();
    let mut call = state
        .acquire_one(&policy, 0, (&K(1), Mode::Exclusive), false, None)
        .unwrap();
    let statement = call.statement().unwrap();
    let reply = granted(std::slice::from_ref(&statement)).remove(0);
    call.receive(Ok(reply), |_, reply: &Reply| reply.clone());
    let e = call.finish().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e}");
    assert!(e.to_string().contains("no fencing token"), "{e}");
    assert!(state.is_poisoned());

    let state = TxState::new();
    let mut call = state
        .acquire(
            &policy,
            0,
            Request::one(&K(1), Mode::Exclusive),
            Wait::Timeout(Duration::from_secs(1)),
        )
        .unwrap();
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );
    assert!(state.is_poisoned());
}

/// No counter on the server (`42P01`, and the message Diesel keeps in
/// place of the SQLSTATE): `NotInstalled`, and the transaction aborted as
/// for any error of a lock statement; other errors keep their kind.
#[test]
fn a_missing_counter_is_not_installed() {
    let policy = minting();
    let missing = || {
        DriverError::new("relation \"lockkit.fencing_counter\" does not exist")
            .code(Some("42P01"))
            .message(Some("relation \"lockkit.fencing_counter\" does not exist"))
    };
    let state = TxState::new();
    let mut call = state
        .acquire_one(&policy, 0, (&K(1), Mode::Exclusive), false, None)
        .unwrap();
    call.receive(Err(missing()), |_, reply: &Reply| reply.clone());
    let e = call.finish().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotInstalled, "{e}");
    assert_eq!(e.code(), Some("42P01"), "{e}");
    assert!(e.to_string().contains("lockkit sql install"), "{e}");

    let state = TxState::new();
    let mut call = state
        .acquire(
            &policy,
            0,
            Request::one(&K(1), Mode::Exclusive),
            Wait::Timeout(Duration::from_secs(1)),
        )
        .unwrap();
    call.receive(Err(missing()));
    // The savepoint's rollback, then the error.
    let recover = call.round().unwrap();
    assert_eq!(recover.kinds().as_slice(), [(Sql::Rollback, false)]);
    let replies = granted(&recover);
    call.receive(Ok(replies));
    assert_eq!(call.finish().unwrap_err().kind(), ErrorKind::NotInstalled);

    // Diesel's error: no SQLSTATE, the message.
    let state = TxState::new();
    let mut call = state
        .acquire_one(&policy, 0, (&K(1), Mode::Exclusive), false, None)
        .unwrap();
    let diesel = DriverError::new("relation \"lockkit.fencing_counter\" does not exist")
        .message(Some("relation \"lockkit.fencing_counter\" does not exist"));
    call.receive(Err(diesel), |_, reply: &Reply| reply.clone());
    assert_eq!(call.finish().unwrap_err().kind(), ErrorKind::NotInstalled);

    // Another error of a minting call keeps its kind.
    let state = TxState::new();
    let mut call = state
        .acquire_one(&policy, 0, (&K(1), Mode::Exclusive), false, None)
        .unwrap();
    let deadlock = DriverError::new("x")
        .code(Some("40P01"))
        .message(Some("deadlock detected"));
    call.receive(Err(deadlock), |_, reply: &Reply| reply.clone());
    assert_eq!(call.finish().unwrap_err().kind(), ErrorKind::Deadlock);
}
