//! A transaction whose lock call was cut off in flight, while another
//! session holds the key, leaves its connection free and outside any
//! transaction, whatever the application does next: for each way Rust cuts
//! a future off (`select!` returning early, `now_or_never`, a 1 ms
//! `timeout`), followed by a rollback, a drop of the transaction, or a
//! panic that unwinds through it. The holder keeps the key for the whole
//! test, so a connection left waiting behind the cut-off statement would
//! never answer again; every connection answers its next statement, as a
//! statement outside a transaction.
//!
//! The cancel request sent as the call drops can reach the server before
//! the lock statement does, and be ignored (about one cut-off in a hundred
//! did); lockkit sends it again until the server is done with the
//! statement. The control shows the hazard: the same cut-off without
//! lockkit, whose transaction's drop sends only its `ROLLBACK`, leaves the
//! connection waiting for the holder. A proxy that holds the lock's
//! connection back makes the ignored first request certain.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use lockkit::{AdvisoryKey, Config, LockClient};
use lockkit_tests::observe::outside_a_transaction;
use lockkit_tests::TestServer;
use tokio::sync::Mutex;
use tokio_postgres::error::SqlState;

use crate::common::locker;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/cutoff")]
struct Order {
    id: i64,
}

/// Connections cutting lock calls off at once.
const WORKERS: usize = 8;
/// Cut-offs for each way of cutting, over all the connections.
const PER_WAY: usize = 1_000;
/// How long a connection may take to answer its next statement before the
/// test calls it blocked: it is waiting for a key held until the test
/// ends, so a blocked connection never answers.
const BLOCKED: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug)]
enum Cut {
    /// `select!` on the call and a ready branch, returning early.
    Select,
    /// Polled once by `now_or_never`.
    NowOrNever,
    /// `tokio::time::timeout` of 1 ms.
    Timeout,
}

#[derive(Clone, Copy, Debug)]
enum Then {
    Rollback,
    Drop,
    /// A panic unwinds through the transaction (in a task of its own).
    Panic,
}

const CUTS: [Cut; 3] = [Cut::Select, Cut::NowOrNever, Cut::Timeout];
const THENS: [Then; 3] = [Then::Rollback, Then::Drop, Then::Panic];

/// One cut-off on `conn`, then `then`.
/// Answers `false` when a late cancel request of an earlier cut-off ended
/// the call (or failed its `BEGIN`) before it could be cut off.
async fn cut_off(conn: Arc<Mutex<LockClient>>, key: Order, cut: Cut, then: Then) -> bool {
    let round = tokio::spawn(async move {
        let mut conn = conn.lock_owned().await;
        let tx = match conn.begin().await {
            Ok(tx) => tx,
            // A late cancel request of an earlier cut-off can land on this
            // round's `BEGIN` too (the documented limit of
            // `Canceller::cancel_until_answered`): nothing was begun.
            Err(e) if e.kind() == lockkit::ErrorKind::Cancelled => return false,
            Err(e) => panic!("begin: {e}"),
        };
        match cut {
            Cut::Select => {
                tokio::select! {
                    biased;
                    r = tx.lock(key) => panic!("granted while held: {r:?}"),
                    () = std::future::ready(()) => {}
                }
            }
            Cut::NowOrNever => assert!(tx.lock(key).now_or_never().is_none()),
            Cut::Timeout => {
                if let Ok(r) = tokio::time::timeout(Duration::from_millis(1), tx.lock(key)).await {
                    // Only a late cancel request of an earlier cut-off can
                    // end the call in time (the key stays held).
                    let e = r.expect_err("granted while held");
                    assert_eq!(e.kind(), lockkit::ErrorKind::Cancelled, "{e}");
                    return false;
                }
            }
        }
        assert!(tx.is_poisoned());
        match then {
            // Bounded: behind a wait that no cancel request ended, the
            // rollback would wait for the holder, which keeps the key until
            // the test ends.
            Then::Rollback => tokio::time::timeout(BLOCKED, tx.rollback())
                .await
                .expect("the rollback still waits behind the cut-off lock statement")
                .expect("rollback"),
            Then::Drop => drop(tx),
            // Without the panic hook's message, thousands of times.
            Then::Panic => std::panic::resume_unwind(Box::new("cut off")),
        }
        true
    });
    match (then, round.await) {
        (Then::Panic, Err(e)) if e.is_panic() => true,
        (_, Ok(cut)) => cut,
        (then, other) => panic!("{then:?}: {other:?}"),
    }
}

/// Asserts that `client` answers its next statement, outside a
/// transaction; `what` names the case in the panic. Answers whether a late
/// cancel request failed that statement first: a request can reach the
/// server after the statement it was sent for and cancel this one instead
/// (documented on `LockTx::rollback`), once, and the statement is sent
/// again.
async fn answers_outside_a_transaction(client: &tokio_postgres::Client, what: &str) -> bool {
    let mut answer = outside_transaction(client).await;
    let mut late = false;
    if let Some(Err(e)) = &answer {
        if e.code() == Some(&SqlState::QUERY_CANCELED) {
            late = true;
            answer = outside_transaction(client).await;
        }
    }
    match answer {
        None => panic!("{what}: the connection still waits behind the cut-off lock statement"),
        Some(Ok(true)) => late,
        Some(Ok(false)) => panic!("{what}: the connection was left inside a transaction"),
        Some(Err(e)) => panic!("{what}: {e}"),
    }
}

/// Whether the session is outside a transaction block
/// ([`outside_a_transaction`]): `None` when the connection did not answer
/// within [`BLOCKED`], `Err` with the server's error.
async fn outside_transaction(
    client: &tokio_postgres::Client,
) -> Option<Result<bool, tokio_postgres::Error>> {
    tokio::time::timeout(BLOCKED, outside_a_transaction(client))
        .await
        .ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_lock_call_leaves_its_connection_free_and_outside_a_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let locker = locker(&db.connect().await, Config::default()).await;
    let key = Order { id: 1 };
    let mut holder = LockClient::new(&locker, db.connect().await);
    let held = holder.begin().await.unwrap();
    let _guard = held.lock(key).await.unwrap();

    let late_cancels = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..WORKERS {
        let conn = Arc::new(Mutex::new(LockClient::new(&locker, db.connect().await)));
        let late_cancels = late_cancels.clone();
        workers.spawn(async move {
            let rounds = CUTS.len() * PER_WAY / WORKERS;
            for round in 0..rounds {
                let (cut, then) = (CUTS[round % 3], THENS[(round / 3 + worker) % 3]);
                if !cut_off(conn.clone(), key, cut, then).await {
                    late_cancels.fetch_add(1, Ordering::Relaxed);
                }
                let conn = conn.lock().await;
                let what = format!("worker {worker}, round {round} ({cut:?}, then {then:?})");
                if answers_outside_a_transaction(&conn, &what).await {
                    late_cancels.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while let Some(done) = workers.join_next().await {
        done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }
    println!(
        "{} cut-offs; a late cancel request failed the next statement {} time(s)",
        CUTS.len() * PER_WAY,
        late_cancels.load(Ordering::Relaxed)
    );
    held.rollback().await.unwrap();
}

/// The control: the same cut-off of a hand-written lock statement in a
/// tokio-postgres transaction, which sends no cancel request, leaves the
/// connection waiting for the holder: its next statement gets no answer
/// while the holder holds the key.
#[tokio::test(flavor = "multi_thread")]
async fn control_a_cut_off_without_a_cancel_leaves_the_connection_waiting() {
    let db = TestServer::shared();
    let key = Order { id: 2 };
    let lock = lockkit_tests::support::xact_lock_sql(key.lock_key());
    let mut holder = db.connect().await;
    let held = holder.transaction().await.unwrap();
    held.simple_query(&lock).await.unwrap();
    let mut client = db.connect().await;
    {
        let tx = client.transaction().await.unwrap();
        tokio::select! {
            biased;
            r = tx.simple_query(&lock) => panic!("granted while held: {r:?}"),
            () = std::future::ready(()) => {}
        }
    }
    let answer =
        tokio::time::timeout(Duration::from_secs(1), client.simple_query("SELECT 1")).await;
    assert!(answer.is_err(), "the connection answered: {answer:?}");
    held.rollback().await.unwrap();
}

/// A cancel request that reaches the server before the statement it was
/// sent for is ignored (the server cancels what runs when it arrives, and
/// the session is still idle); lockkit sends it again until the statement
/// is done. Made certain here, not left to one cut-off in a hundred:
/// through a proxy that holds what the lock's connection sends for
/// 300 ms, while each cancel request, on a connection of its own opened
/// later, goes straight through. Every cut-off's first request lands
/// before its lock statement, which then waits for the holder; the
/// connection still answers its next statement, outside a transaction,
/// whatever follows the cut-off. Sent once, never again
/// (`.ci/mutations "sent once"`), the connection waits for the holder.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_request_that_overtakes_its_statement_is_sent_again() {
    use lockkit_tests::{Cut as ProxyCut, Proxy};
    let db = TestServer::shared();
    let _log = db.guard();
    let locker = locker(&db.connect().await, Config::default()).await;
    let key = Order { id: 3 };
    let mut holder = LockClient::new(&locker, db.connect().await);
    let held = holder.begin().await.unwrap();
    let _guard = held.lock(key).await.unwrap();
    let proxy = Proxy::in_front_of(db);
    let (client, connection) = proxy.config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let conn = Arc::new(Mutex::new(LockClient::new(&locker, client)));
    proxy.cut(ProxyCut::Delay(Duration::from_millis(300))).await;
    for (round, then) in THENS.into_iter().cycle().take(6).enumerate() {
        // A rollback waits behind the statement it follows: bounded too.
        let cut = tokio::time::timeout(BLOCKED, cut_off(conn.clone(), key, Cut::NowOrNever, then))
            .await
            .unwrap_or_else(|_| {
                panic!("round {round} (then {then:?}): the rollback waits behind the cut-off lock statement")
            });
        assert!(
            cut,
            "round {round}: a late cancel request ended the call before its cut-off"
        );
        let conn = conn.lock().await;
        answers_outside_a_transaction(&conn, &format!("round {round} (then {then:?})")).await;
    }
    held.rollback().await.unwrap();
}
