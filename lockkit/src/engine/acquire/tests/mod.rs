use std::panic::Location;
use std::time::Duration;

use super::*;
use crate::engine::config::{Config, OrderCheck};
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::expected_rows;
use crate::engine::facts::ServerFacts;
use crate::engine::guard::Busy;
use crate::engine::plan::{Batch, Mode};
use crate::engine::statement::{Param, Reply, ReplyShape, Sql, Statement};
use crate::key::{AdvisoryKey, LockKey};

mod checks;
mod minting;
mod permit;
mod slices;

#[derive(Debug)]
struct K(i64);
impl AdvisoryKey for K {
    const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("K").raw();
    fn lock_key(&self) -> LockKey {
        LockKey::BigInt(self.0)
    }
}
struct P(i32);
impl AdvisoryKey for P {
    const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("P").raw();
    fn lock_key(&self) -> LockKey {
        LockKey::Pair(1, self.0)
    }
}

fn policy() -> Policy {
    Policy::new(
        Config::default().order_check(OrderCheck::Off),
        ServerFacts::assumed(64, 100, 0),
    )
}

/// The facts of a server with a lock table of 64 × 100, `in_recovery` or
/// not, whose `hashtext` answers the probes with `hashes`.
fn facts(in_recovery: bool, hashes: Vec<i32>) -> ServerFacts {
    ServerFacts::from(&crate::engine::facts::FactsRow {
        max_locks: 64,
        max_connections: 100,
        in_recovery,
        hashes,
        ..Default::default()
    })
}

/// What a server answers when every key is free.
fn granted(round: &[Statement<'_>]) -> Vec<Reply> {
    round
        .iter()
        .map(|s| match s.reply() {
            ReplyShape::Done => Reply::Done,
            ReplyShape::Locked => Reply::Locked {
                tag: s.sql().tag().unwrap(),
            },
            ReplyShape::Tagged => Reply::Tagged {
                tag: s.sql().tag().unwrap(),
                n: expected_rows(s),
            },
            ReplyShape::TriedBigint => Reply::TriedBigint {
                tag: s.sql().tag().unwrap(),
                n: expected_rows(s),
                busy: vec![],
            },
            ReplyShape::TriedPair => Reply::TriedPair {
                tag: s.sql().tag().unwrap(),
                n: expected_rows(s),
                classes: vec![],
                objects: vec![],
            },
        })
        .collect()
}

/// A waiting exclusive call of `K(n)` in `state`, at depth 0.
fn lock_k(state: &TxState, n: i64) -> Result<Acquisition<'_>, Error> {
    state.acquire(
        &policy(),
        0,
        Request::one(&K(n), Mode::Exclusive),
        Wait::Forever,
    )
}

fn sqls(call: &Acquisition<'_>) -> Vec<Sql> {
    call.round().unwrap().iter().map(Statement::sql).collect()
}

/// What a call left: its outcome, what its transaction holds, whether
/// it is poisoned, and what the next call meets.
fn left(state: &TxState, outcome: Result<Result<Grant, Busy>, Error>) -> String {
    let outcome = match outcome {
        Ok(Ok(grant)) => format!("granted {:?} {:?}", grant.key, grant.keys),
        Ok(Err(busy)) => format!("busy {:?}", busy.keys()),
        Err(e) => format!("{:?}: {e}", e.kind()),
    };
    let (held, poisoned) = (state.held(), state.is_poisoned());
    // Dropped unanswered, this call poisons the transaction: it comes
    // last.
    let next = lock_k(state, 9)
        .map(|call| call.round().map(|r| r.len()))
        .map_err(|e| e.kind());
    format!("{outcome}; held {held:?}; poisoned {poisoned}; next {next:?}")
}

/// The answers a one-key statement may meet: granted, a try's busy,
/// a wrong tag, a malformed row, the server's error, a foreign
/// statement's row.
fn answers(statement: &Statement<'_>) -> Vec<Result<Reply, DriverError>> {
    let tag = statement.sql().tag().unwrap();
    let shaped = |n| match statement.reply() {
        ReplyShape::Locked => Reply::Locked { tag },
        _ => Reply::Tagged { tag, n },
    };
    vec![
        Ok(shaped(1)),
        Ok(Reply::Tagged { tag, n: 0 }),
        Ok(Reply::Tagged { tag, n: 2 }),
        Ok(Reply::Locked { tag: tag + 1 }),
        Ok(Reply::Tagged { tag: tag + 1, n: 1 }),
        Ok(Reply::Malformed("2 rows".into())),
        Err(DriverError::new("x")
            .code(Some("40P01"))
            .message(Some("deadlock detected"))),
        Err(DriverError::new("DataRow field count").foreign_reply(true)),
    ]
}

/// Runs `key` in `mode` through both kinds of call, from each starting
/// state (nothing held, the key held shared, held exclusive), for each
/// answer, and compares what they leave; returns how many were compared.
fn compare<K: AdvisoryKey>(key: &K, mode: Mode, try_only: bool) -> usize {
    let policy = policy();
    let wait = if try_only { Wait::Try } else { Wait::Forever };
    let site = Location::caller();
    let mut compared = 0;
    for before in [None, Some(Mode::Shared), Some(Mode::Exclusive)] {
        // A transaction that holds `key` in `before`.
        let state = || {
            let state = TxState::new();
            if let Some(before) = before {
                let mut call = state
                    .acquire(&policy, 0, Request::one(key, before), Wait::Forever)
                    .unwrap();
                let round = call.round().unwrap();
                let replies = granted(&round);
                call.receive(Ok(replies));
                call.finish().unwrap().unwrap();
            }
            state
        };
        let (one_state, general_state) = (state(), state());
        let one = one_state
            .acquire_one(&policy, 0, (key, mode), try_only, Some(site))
            .unwrap();
        let general = general_state
            .acquire(&policy, 0, Request::one(key, mode).at(site), wait)
            .unwrap();
        let statement = one.statement();
        let sent = general.round().map(|r| {
            assert_eq!(r.len(), 1, "{r:?}");
            (r[0].sql(), r[0].params().to_vec())
        });
        assert_eq!(
            statement.map(|s| (s.sql(), s.params().to_vec())),
            sent,
            "{mode:?} {wait:?} held {before:?}"
        );
        let Some(statement) = statement else {
            // Held already: granted, nothing sent, nothing in flight.
            assert_eq!(
                left(&one_state, one.finish()),
                left(&general_state, general.finish())
            );
            compared += 1;
            continue;
        };
        for i in 0..answers(&statement).len() {
            let answer = || answers(&statement).into_iter().nth(i).unwrap();
            let (one_state, general_state) = (state(), state());
            let mut one = one_state
                .acquire_one(&policy, 0, (key, mode), try_only, Some(site))
                .unwrap();
            let mut general = general_state
                .acquire(&policy, 0, Request::one(key, mode).at(site), wait)
                .unwrap();
            one.receive(answer(), |_, reply| reply.clone());
            general.receive(answer().map(|reply| vec![reply]));
            assert!(one.statement().is_none());
            assert!(general.round().is_none());
            let (one, general) = (
                left(&one_state, one.finish()),
                left(&general_state, general.finish()),
            );
            assert_eq!(one, general, "{mode:?} {wait:?} held {before:?}");
            compared += 1;
        }
    }
    // Dropped unanswered, both poison the transaction.
    let (one_state, general_state) = (TxState::new(), TxState::new());
    let one = one_state
        .acquire_one(&policy, 0, (key, mode), try_only, None)
        .unwrap();
    let general = general_state
        .acquire(&policy, 0, Request::one(key, mode), wait)
        .unwrap();
    drop((one, general));
    assert!(one_state.is_poisoned() && general_state.is_poisoned());
    compared
}

/// A one-key call ([`TxState::acquire_one`]) is the general call of the
/// same key ([`TxState::acquire`] of [`Request::one`]) in less work:
/// the same statement, and for every answer the same outcome,
/// bookkeeping and poisoning; held already, the same grant and no
/// statement; dropped unanswered, the same poisoning.
#[test]
fn a_one_key_call_is_the_general_call_of_its_key() {
    let mut compared = 0;
    for try_only in [false, true] {
        for mode in [Mode::Exclusive, Mode::Shared] {
            compared += compare(&K(1), mode, try_only);
            compared += compare(&P(2), mode, try_only);
        }
    }
    // Each: 8 answers when nothing is held, 8 more (a shared hold
    // upgraded) or a relock for the shared hold, a relock for the
    // exclusive hold.
    assert_eq!(compared, 2 * 2 * (8 + 8 + 1) + 2 * 2 * (8 + 1 + 1));
}

#[test]
fn a_timed_mixed_batch_re_arms_the_timeout_between_key_spaces() {
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&P(2));
    let call = state
        .acquire(
            &policy(),
            0,
            Request::batch(&batch),
            Wait::Timeout(Duration::from_secs(1)),
        )
        .unwrap();
    assert_eq!(
        sqls(&call),
        [
            Sql::Savepoint,
            Sql::SetTimeouts,
            Sql::LockBigint,
            Sql::ArmTimeouts,
            Sql::LockPair,
            Sql::RestoreTimeouts,
            Sql::Release
        ]
    );
    let round = call.round().unwrap();
    assert_eq!(round[1].params(), [Param::Int8(1000)]);
    // One key space: nothing to re-arm.
    let bigints = Batch::new().with(&K(1)).with(&K(2));
    let timed = Wait::Timeout(Duration::from_secs(1));
    let other = TxState::new();
    let call = other
        .acquire(&policy(), 0, Request::batch(&bigints), timed)
        .unwrap();
    assert!(
        !sqls(&call).contains(&Sql::ArmTimeouts),
        "{:?}",
        sqls(&call)
    );
}

#[test]
fn a_foreign_reply_is_an_error_and_poisons() {
    let state = TxState::new();
    let mut call = lock_k(&state, 7).unwrap();
    // A foreign `SELECT $1` under lockkit's statement name.
    call.receive(Ok(vec![Reply::Locked { tag: 7 }]));
    let err = call.finish().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{err}");
    assert!(state.is_poisoned());
    assert!(!state.holds(LockKey::BigInt(7), Mode::Exclusive));
    // The control: lockkit's own reply is a grant.
    let state = TxState::new();
    let mut call = lock_k(&state, 7).unwrap();
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    assert!(call.finish().unwrap().is_ok());
    assert!(state.holds(LockKey::BigInt(7), Mode::Exclusive));
}

/// A statement of lockkit's name that the server will not bind as
/// lockkit's (08P01: other columns; 26000: none of that name; Diesel's
/// message without a code) is not lockkit's reply either; a deadlock is
/// still a deadlock (the control).
#[test]
fn a_refused_bind_of_a_foreign_statement_is_an_unexpected_reply() {
    let cases: [(Option<&str>, Option<&str>, ErrorKind); 8] = [
        (Some("08P01"), None, ErrorKind::UnexpectedReply),
        // lockkit's binary `int8` bound to another client's statement
        // of that name, which takes another type.
        (Some("22P03"), None, ErrorKind::UnexpectedReply),
        (
            None,
            Some("incorrect binary data format in bind parameter 1"),
            ErrorKind::UnexpectedReply,
        ),
        (Some("26000"), None, ErrorKind::UnexpectedReply),
        (Some("42P05"), None, ErrorKind::UnexpectedReply),
        (
            None,
            Some("prepared statement \"__diesel_stmt_1\" already exists"),
            ErrorKind::UnexpectedReply,
        ),
        (
            None,
            Some("bind message has 3 result formats but query has 2 columns"),
            ErrorKind::UnexpectedReply,
        ),
        (Some("40P01"), None, ErrorKind::Deadlock),
    ];
    for (code, message, kind) in cases {
        for wait in [Wait::Forever, Wait::Timeout(Duration::from_secs(1))] {
            let state = TxState::new();
            let mut call = state
                .acquire(&policy(), 0, Request::one(&K(7), Mode::Exclusive), wait)
                .unwrap();
            call.receive(Err(DriverError::new("x").code(code).message(message)));
            while let Some(round) = call.round() {
                let replies = round.iter().map(|_| Reply::Done).collect();
                call.receive(Ok(replies));
            }
            let err = call.finish().unwrap_err();
            assert_eq!(err.kind(), kind, "{err} ({wait:?})");
            if kind == ErrorKind::UnexpectedReply {
                assert!(!state.holds(LockKey::BigInt(7), Mode::Exclusive));
                assert!(state.is_poisoned(), "{wait:?}");
                let named = match message {
                    Some(m) if m.ends_with("already exists") => "42P05",
                    Some(m) if m.starts_with("incorrect binary data") => "22P03",
                    _ => "08P01",
                };
                assert_eq!(err.code(), code.or(Some(named)));
            }
        }
    }
}

#[test]
fn wrong_counts_shapes_and_tags_are_refused() {
    let tag = |sql: Sql| sql.tag().unwrap();
    let bad: [Reply; 6] = [
        Reply::Tagged {
            tag: tag(Sql::BatchBigintExclusive),
            n: 1,
        },
        Reply::Tagged {
            tag: tag(Sql::BatchBigint),
            n: 2,
        },
        Reply::Locked {
            tag: tag(Sql::BatchBigintExclusive),
        },
        Reply::Locked {
            tag: tag(Sql::LockBigint),
        },
        Reply::Done,
        Reply::Malformed("2 rows".into()),
    ];
    for reply in bad {
        let state = TxState::new();
        let batch = Batch::new().with(&K(1)).with(&K(2));
        let mut call = state
            .acquire(&policy(), 0, Request::batch(&batch), Wait::Forever)
            .unwrap();
        call.receive(Ok(vec![reply.clone()]));
        let err = call.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{reply:?}");
        assert!(state.is_poisoned());
    }
    // A try-batch's reply under another statement's tag.
    for batch in [
        Batch::new().with(&K(1)).with(&K(2)),
        Batch::new().with(&P(1)).with(&P(2)),
    ] {
        let state = TxState::new();
        let try_batch = Request::batch(&batch);
        let mut call = state.acquire(&policy(), 0, try_batch, Wait::Try).unwrap();
        let mut replies = granted(&call.round().unwrap());
        for reply in &mut replies {
            if let Reply::TriedBigint { tag, .. } | Reply::TriedPair { tag, .. } = reply {
                *tag += 1;
            }
        }
        call.receive(Ok(replies));
        assert_eq!(
            call.finish().unwrap_err().kind(),
            ErrorKind::UnexpectedReply
        );
    }
}

#[test]
fn a_relock_sends_nothing_and_leaves_nothing_in_flight() {
    let state = TxState::new();
    for _ in 0..2 {
        let mut call = lock_k(&state, 1).unwrap();
        if let Some(round) = call.round() {
            let replies = granted(&round);
            call.receive(Ok(replies));
        }
        assert!(call.finish().unwrap().is_ok());
    }
    let shared = Request::one(&K(1), Mode::Shared);
    let call = state.acquire(&policy(), 0, shared, Wait::Forever).unwrap();
    assert!(call.round().is_none(), "held in a covering mode");
    drop(call);
    assert!(!state.is_poisoned());
    assert!(lock_k(&state, 2).is_ok());
}

#[test]
fn a_dropped_call_poisons_and_an_error_aborts() {
    let state = TxState::new();
    let call = lock_k(&state, 1).unwrap();
    assert!(call.round().is_some());
    drop(call);
    assert!(state.is_poisoned());

    let state = TxState::new();
    let mut call = lock_k(&state, 1).unwrap();
    call.receive(Err(DriverError::new("x")
        .code(Some("40P01"))
        .message(Some("deadlock detected"))));
    assert!(call.finish().unwrap_err().is_deadlock());
    let again = lock_k(&state, 2);
    assert_eq!(again.unwrap_err().kind(), ErrorKind::TransactionAborted);
}

#[test]
fn a_timed_out_call_rolls_its_savepoint_back_and_stays_usable() {
    let state = TxState::new();
    let timed = Wait::Timeout(Duration::from_millis(50));
    let one = Request::one(&K(1), Mode::Exclusive);
    let mut call = state.acquire(&policy(), 0, one, timed).unwrap();
    call.receive(Err(DriverError::new("x")
        .code(Some("55P03"))
        .message(Some("canceling statement due to lock timeout"))));
    assert_eq!(sqls(&call), [Sql::Rollback]);
    call.receive(Ok(vec![Reply::Done]));
    let err = call.finish().unwrap_err();
    assert!(err.is_timeout());
    assert_eq!(err.timeout(), Some(Duration::from_millis(50)));
    assert!(!state.is_poisoned());
    assert!(lock_k(&state, 2).is_ok());
}

/// A `25P02` met inside a timed call, after its savepoint was taken (the
/// rollback to it succeeds), past the call's timeout: the call's own
/// statement_timeout aborted the transaction through a reply the driver
/// did not read. A timeout, the transaction usable. Before the timeout, or
/// when the rollback shows the savepoint was never taken (the transaction
/// failed before the call), it stays `TransactionAborted`.
#[test]
fn an_abort_inside_a_timed_call_past_its_timeout_is_its_timeout() {
    let aborted = || {
        DriverError::new("x").code(Some("25P02")).message(Some(
            "current transaction is aborted, commands ignored until end of transaction block",
        ))
    };
    // A timed call of one key whose main round fails with `main`, 1 ms
    // after it began, and whose savepoint rollback then answers `rollback`.
    let outcome = |state: &TxState, timeout, main, rollback| {
        let one = Request::one(&K(1), Mode::Exclusive);
        let mut call = state
            .acquire(&policy(), 0, one, Wait::Timeout(timeout))
            .unwrap();
        std::thread::sleep(Duration::from_millis(1));
        call.receive(Err(main));
        assert_eq!(sqls(&call), [Sql::Rollback]);
        call.receive(rollback);
        call.finish().unwrap_err()
    };
    let short = Duration::from_micros(1);
    let state = TxState::new();
    let err = outcome(&state, short, aborted(), Ok(vec![Reply::Done]));
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert_eq!(err.timeout(), Some(short));
    assert_eq!(err.code(), Some("25P02"));
    assert!(lock_k(&state, 2).is_ok(), "the transaction goes on");

    // Before the timeout: the abort is not the call's timer.
    let long = Duration::from_secs(3_600);
    let err = outcome(&TxState::new(), long, aborted(), Ok(vec![Reply::Done]));
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");

    // The rollback fails: the savepoint was never taken.
    let err = outcome(&TxState::new(), short, aborted(), Err(aborted()));
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");

    // Another error past the timeout stays what it is.
    let deadlock = DriverError::new("x")
        .code(Some("40P01"))
        .message(Some("deadlock detected"));
    let err = outcome(&TxState::new(), short, deadlock, Ok(vec![Reply::Done]));
    assert!(err.is_deadlock(), "{err}");
}

#[test]
fn a_try_batch_settles_its_savepoint() {
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&K(2)).with(&P(3));
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
        .unwrap();
    assert_eq!(
        sqls(&call),
        [Sql::Savepoint, Sql::TryBatchBigint, Sql::TryBatchPair]
    );
    let mut replies = granted(&call.round().unwrap());
    replies[1] = Reply::TriedBigint {
        tag: Sql::TryBatchBigint.tag().unwrap(),
        n: 2,
        busy: vec![2],
    };
    call.receive(Ok(replies));
    assert_eq!(sqls(&call), [Sql::Rollback]);
    call.receive(Ok(vec![Reply::Done]));
    let busy = call.finish().unwrap().unwrap_err();
    assert_eq!(busy.keys(), [LockKey::BigInt(2)]);
    assert_eq!(state.held_count(), 0);

    // A busy key that was never requested is not lockkit's reply.
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
        .unwrap();
    let mut replies = granted(&call.round().unwrap());
    replies[1] = Reply::TriedBigint {
        tag: Sql::TryBatchBigint.tag().unwrap(),
        n: 2,
        busy: vec![99],
    };
    call.receive(Ok(replies));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );
}

/// Runs `request` against a server on which the keys of `busy` are
/// taken by another session, and returns the outcome.
fn outcome(
    state: &TxState,
    request: Request,
    wait: Wait,
    busy: &[i64],
) -> Result<Result<Grant, Busy>, Error> {
    let mut call = state.acquire(&policy(), 0, request, wait).unwrap();
    while let Some(round) = call.round() {
        let replies = granted(&round)
            .into_iter()
            .zip(round.iter())
            .map(|(reply, s)| match (reply, s.params()) {
                (Reply::Tagged { tag, .. }, [Param::Int8(k)]) if busy.contains(k) => {
                    Reply::Tagged { tag, n: 0 }
                }
                (Reply::TriedBigint { tag, n, .. }, [Param::Int8Array(keys), ..]) => {
                    Reply::TriedBigint {
                        tag,
                        n,
                        busy: keys.iter().copied().filter(|k| busy.contains(k)).collect(),
                    }
                }
                (reply, _) => reply,
            })
            .collect();
        call.receive(Ok(replies));
    }
    call.finish()
}

/// The one mapping from an outcome to what every adapter's lock call
/// returns: the guard names the key and mode the server granted (an
/// upgrade names exclusive; a relock, the mode held), a busy try gives
/// the value or the busy keys back, and an error is the call's.
#[test]
fn the_guards_come_from_the_outcome() {
    let state = TxState::new();
    let lock = |id: i64, mode: Mode| {
        let outcome = outcome(&state, Request::one(&K(id), mode), Wait::Forever, &[]);
        Grant::lock(outcome, K(id)).unwrap()
    };
    let try_lock = |id: i64, busy: &[i64]| {
        let request = Request::one(&K(id), Mode::Exclusive);
        Grant::try_lock(outcome(&state, request, Wait::Try, busy), K(id)).unwrap()
    };
    let held = lock(5, Mode::Shared);
    assert_eq!(
        (held.key(), held.mode()),
        (LockKey::BigInt(5), Mode::Shared)
    );
    assert_eq!(lock(5, Mode::Exclusive).mode(), Mode::Exclusive);
    // Held already in a covering mode: nothing sent, the held mode named.
    assert_eq!(lock(5, Mode::Shared).mode(), Mode::Exclusive);

    assert_eq!(try_lock(6, &[6]).map(|h| h.key()).unwrap_err().0, 6);
    assert_eq!(
        try_lock(7, &[]).map(|h| h.key()).ok(),
        Some(LockKey::BigInt(7))
    );

    let batch = Batch::new().with(&K(10)).with(&K(11));
    let busy = Grant::try_lock_batch(outcome(&state, Request::batch(&batch), Wait::Try, &[11]))
        .unwrap()
        .unwrap_err();
    assert_eq!(busy.keys(), [LockKey::BigInt(11)]);
    let held =
        Grant::lock_batch(outcome(&state, Request::batch(&batch), Wait::Forever, &[])).unwrap();
    let keys: Vec<_> = held.keys().iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, [LockKey::BigInt(10), LockKey::BigInt(11)]);

    let state = TxState::new();
    drop(lock_k(&state, 2).unwrap()); // cut off in flight
    let poisoned = lock_k(&state, 1).map(Acquisition::finish);
    assert_eq!(
        Grant::lock(poisoned.and_then(|o| o), K(1))
            .unwrap_err()
            .kind(),
        ErrorKind::Poisoned
    );
}

/// `Request::one` keeps its mode: the statement of a shared timed lock is
/// a shared one, that of an exclusive one is not.
#[test]
fn a_one_key_request_keeps_its_mode() {
    let policy = policy();
    for mode in [Mode::Shared, Mode::Exclusive] {
        let state = TxState::new();
        let wait = Wait::Timeout(Duration::from_secs(1));
        let mut call = state
            .acquire(&policy, 0, Request::one(&K(1), mode), wait)
            .unwrap();
        let round = call.round().unwrap();
        let sent: Vec<Sql> = round.iter().map(|s| s.sql()).collect();
        let shared = sent.contains(&Sql::LockBigintShared);
        assert_eq!(shared, mode == Mode::Shared, "{mode:?}: {sent:?}");
        assert!(
            sent.contains(&Sql::LockBigint) || shared,
            "{mode:?}: {sent:?}"
        );
        let replies = granted(&round);
        call.receive(Ok(replies));
        assert!(call.finish().unwrap().is_ok());
        assert!(state.holds(LockKey::BigInt(1), mode));
    }
}

/// A batch whose keys are all exclusive takes the exclusive statement (no
/// modes array); one shared key makes it the statement with modes.
#[test]
fn an_all_exclusive_batch_takes_the_exclusive_statement() {
    let policy = policy();
    let cases = [
        (
            Batch::new().with(&K(1)).with(&K(2)),
            Sql::BatchBigintExclusive,
        ),
        (
            Batch::new().with(&K(1)).with_shared(&K(2)),
            Sql::BatchBigint,
        ),
        (
            Batch::new().with(&P(1)).with(&P(2)),
            Sql::BatchPairExclusive,
        ),
        (Batch::new().with(&P(1)).with_shared(&P(2)), Sql::BatchPair),
    ];
    for (batch, expected) in cases {
        let state = TxState::new();
        let call = state
            .acquire(&policy, 0, Request::batch(&batch), Wait::Forever)
            .unwrap();
        let sent: Vec<Sql> = call.round().unwrap().iter().map(|s| s.sql()).collect();
        assert_eq!(sent, [expected]);
    }
}

/// An adapter that hands the driver's answers to `receive_answers` drives
/// the call to its outcome, round after round.
#[test]
fn answers_read_by_the_adapter_drive_the_call() {
    let policy = policy();
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&P(2));
    let wait = Wait::Timeout(Duration::from_secs(1));
    let mut call = state
        .acquire(&policy, 0, Request::batch(&batch), wait)
        .unwrap();
    let mut rounds = 0;
    while let Some(round) = call.round() {
        let answers = granted(&round);
        call.receive_answers(Ok::<_, DriverError>(answers), |_, reply| reply.clone());
        rounds += 1;
        assert!(rounds < 5, "the call does not advance");
    }
    assert!(call.finish().unwrap().is_ok());
    assert!(state.holds(LockKey::BigInt(1), Mode::Exclusive));
    assert_eq!(state.held_count(), 2);
}

/// A try-batch whose keys are all granted releases its savepoint (the
/// locks stay); only a busy key rolls it back.
#[test]
fn a_granted_try_batch_releases_its_savepoint() {
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&K(2));
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
        .unwrap();
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    assert_eq!(sqls(&call), [Sql::Release]);
    call.receive(Ok(vec![Reply::Done]));
    assert!(call.finish().unwrap().is_ok());
    assert_eq!(state.held_count(), 2);
}

/// Takes `key` at savepoint `depth` of `state`, every key free.
fn take_at(state: &TxState, depth: u32, key: &K) {
    let one = Request::one(key, Mode::Exclusive);
    let mut call = state.acquire(&policy(), depth, one, Wait::Forever).unwrap();
    let replies = granted(&call.round().unwrap());
    call.receive(Ok(replies));
    call.finish().unwrap().unwrap();
}

/// A try-batch of several keys runs in a savepoint: when its statement
/// fails (a full lock table raises 53200 even in a try), the savepoint's
/// rollback leaves the transaction usable.
#[test]
fn a_failed_try_batch_rolls_back_to_its_savepoint() {
    let state = TxState::new();
    let batch = Batch::new().with(&K(1)).with(&K(2));
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
        .unwrap();
    assert_eq!(sqls(&call), [Sql::Savepoint, Sql::TryBatchBigint]);
    call.receive(Err(DriverError::new("full")
        .code(Some("53200"))
        .message(Some("out of shared memory"))));
    assert_eq!(sqls(&call), [Sql::Rollback]);
    call.receive(Ok(vec![Reply::Done]));
    let err = call.finish().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockTableFull, "{err}");
    assert!(!state.is_poisoned());
    assert_eq!(state.held_count(), 0);
}

/// A pair try-batch's busy keys must be keys it asked for, as many classes
/// as objects; a pair batch must report its own count.
#[test]
fn pair_replies_are_checked_key_by_key() {
    let batch = Batch::new().with(&P(1)).with(&P(2));
    let tag = Sql::TryBatchPair.tag().unwrap();
    let tried = |classes, objects| Reply::TriedPair {
        tag,
        n: 2,
        classes,
        objects,
    };
    for (reply, busy) in [
        (tried(vec![1], vec![2]), Some(LockKey::Pair(1, 2))),
        (tried(vec![1, 1], vec![2]), None),
        (tried(vec![1], vec![9]), None),
    ] {
        let state = TxState::new();
        let mut call = state
            .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
            .unwrap();
        call.receive(Ok(vec![Reply::Done, reply]));
        while call.round().is_some() {
            call.receive(Ok(vec![Reply::Done]));
        }
        match (call.finish(), busy) {
            (Ok(Err(seen)), Some(key)) => assert_eq!(seen.keys(), [key]),
            (Err(e), None) => assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e}"),
            (other, _) => panic!("{other:?} for {busy:?}"),
        }
    }
    let state = TxState::new();
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Forever)
        .unwrap();
    let tag = Sql::BatchPairExclusive.tag().unwrap();
    call.receive(Ok(vec![Reply::Tagged { tag, n: 1 }]));
    assert_eq!(
        call.finish().unwrap_err().kind(),
        ErrorKind::UnexpectedReply
    );
    let state = TxState::new();
    let mut call = state
        .acquire(&policy(), 0, Request::batch(&batch), Wait::Forever)
        .unwrap();
    call.receive(Ok(vec![Reply::Tagged { tag, n: 2 }]));
    assert!(call.finish().unwrap().is_ok(), "both keys reported");
}

/// A savepoint's end is recorded at its own depth: rolled back, its locks
/// are forgotten and the enclosing ones stay; released, they stay.
#[test]
fn a_savepoints_end_is_recorded_at_its_depth() {
    let state = TxState::new();
    take_at(&state, 0, &K(1));
    take_at(&state, 1, &K(2));
    state.end_savepoint(1, SavepointEnd::RolledBack);
    assert!(state.holds(LockKey::BigInt(1), Mode::Exclusive));
    assert!(!state.holds(LockKey::BigInt(2), Mode::Exclusive));
    take_at(&state, 1, &K(3));
    state.end_savepoint(1, SavepointEnd::Released);
    assert!(state.holds(LockKey::BigInt(3), Mode::Exclusive));
    assert_eq!(state.held_count(), 2);
}

/// A savepoint ending dropped after `if_dropped(Unknown)` (its `RELEASE`
/// in flight) poisons the transaction; dropped before, it records the
/// rollback it was made with.
#[test]
fn a_dropped_ending_records_what_it_was_told() {
    let state = TxState::new();
    take_at(&state, 1, &K(1));
    drop(state.ending(1, SavepointEnd::RolledBack));
    assert!(!state.is_poisoned());
    assert_eq!(state.held_count(), 0);
    take_at(&state, 1, &K(2));
    let mut ending = state.ending(1, SavepointEnd::RolledBack);
    ending.if_dropped(SavepointEnd::Unknown);
    drop(ending);
    assert!(state.is_poisoned());
}
