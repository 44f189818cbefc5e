//! Bounded waits (`Policy::bounds_waits`): a lock call that waits as long
//! as it takes, on a locker whose cut-off calls cannot be cancelled at once
//! (made with `with_facts`, or through a pooler), waits in server-side
//! slices of the server's `deadlock_timeout` and one second. Each slice
//! ends on the server whatever the client does, so a cut-off call frees
//! its connection within one (`shared_pooler::cut_off_lock_calls_free…`);
//! here, what the slices must not change: the call still waits as long as
//! it takes, a deadlock is still detected, the caller's own `lock_timeout`
//! still bounds the wait, and the caller's settings come back.
//!
//! Each transaction sets a short `deadlock_timeout` (the tests' role may),
//! so that a slice lasts about a second.

use std::time::Duration;

use lockkit::{AdvisoryKey, Config, LockClient, Locker, OrderCheck};
use lockkit_tests::support::hold_in_transaction;
use lockkit_tests::TestServer;
use tokio_postgres::Client;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/bounded-waits")]
struct Slot {
    id: i64,
}

/// A locker on `db` that bounds its waits (made with `with_facts`: it has
/// seen no connection to prove direct), beside one made on a direct
/// connection, which does not.
async fn bounded_locker(db: &TestServer) -> Locker {
    let direct = Locker::new(&db.connect().await, Config::default())
        .await
        .expect("a locker");
    assert!(
        !direct.policy().bounds_waits(),
        "a locker made on a direct connection bounds its waits"
    );
    // No order check: the deadlock test takes its keys out of order on
    // purpose.
    let config = Config::default().order_check(OrderCheck::Off);
    let bounded = Locker::with_facts(config, direct.policy().facts().clone());
    assert!(bounded.policy().bounds_waits());
    bounded
}

/// When the statement of the backend waiting for `key` began, if one
/// waits.
async fn waiting_since(observer: &Client, key: Slot) -> Option<String> {
    let id = key.lock_key().to_pg_locks();
    observer
        .query_opt(
            "SELECT a.query_start::text FROM pg_locks l \
             JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND NOT l.granted \
             AND l.classid = $1 AND l.objid = $2 AND l.objsubid = $3",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .map(|row| row.get(0))
}

async fn short_slices(tx: &lockkit::LockTx<'_>) {
    tx.batch_execute("SET LOCAL deadlock_timeout = '50ms'")
        .await
        .expect("SET LOCAL deadlock_timeout");
}

/// A wait that outlasts three slices (each seen to start, by its lock
/// statement's start in `pg_stat_activity`, while the holder still holds
/// the key) is granted once the holder lets go. With the next slice never
/// started (`.ci/mutations "next slice never started"`), the call ends with
/// the first slice's lock timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_bounded_wait_outlasts_its_slices_and_is_granted() {
    let db = TestServer::shared();
    let _log = db.guard();
    let locker = bounded_locker(db).await;
    let key = Slot { id: 1 };
    let holder = db.connect().await;
    hold_in_transaction(&holder, [key.lock_key()]).await;
    let observer = db.connect().await;

    let waiter = tokio::spawn(async move {
        let mut client = LockClient::new(&locker, db.connect().await);
        let tx = client.begin().await.expect("BEGIN");
        short_slices(&tx).await;
        let held = tx.lock(key).await.map(|held| held.key());
        let settings = tx
            .query_one("SELECT current_setting('lock_timeout')", &[])
            .await
            .map(|row| row.get::<_, String>(0));
        (held, settings)
    });
    // A hang guard of 60 s, no timing claim: three slices take about 3.
    let mut starts = Vec::new();
    for _ in 0..6_000 {
        assert!(
            !waiter.is_finished(),
            "the call ended after {} slices, the key still held",
            starts.len()
        );
        if let Some(start) = waiting_since(&observer, key).await {
            if starts.last() != Some(&start) {
                starts.push(start);
            }
        }
        if starts.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(starts.len(), 3, "three slices not seen in 60 s: {starts:?}");
    holder.batch_execute("ROLLBACK").await.unwrap();
    let (held, settings) = waiter.await.expect("the waiter");
    assert_eq!(
        held.expect("granted once the holder let go"),
        key.lock_key()
    );
    assert_eq!(settings.expect("the next statement"), "0");
}

/// Two bounded waits in a cycle: the server's deadlock check runs in every
/// slice, so one of them fails as a deadlock (`40P01`), and its
/// transaction is aborted with every lock it held released at once, as an
/// unbounded wait's would be: the other is granted before either
/// transaction ends. Without the abort (the victim rolled back to its
/// savepoint only), the victim keeps its first key, and the other waits
/// until the hang guard (60 s) fails the test.
#[tokio::test(flavor = "multi_thread")]
async fn a_deadlock_between_bounded_waits_is_still_detected() {
    let db = TestServer::shared();
    let _log = db.guard();
    let locker = bounded_locker(db).await;
    let taken = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let answered = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let side = |first: Slot, second: Slot| {
        let (locker, taken, answered) = (locker.clone(), taken.clone(), answered.clone());
        tokio::spawn(async move {
            let mut client = LockClient::new(&locker, db.connect().await);
            let tx = client.begin().await.expect("BEGIN");
            short_slices(&tx).await;
            let _first = tx.lock(first).await.expect("the first key");
            taken.wait().await;
            let second = tx.lock(second).await.map(|held| held.key());
            // Both calls answered before either transaction ends.
            answered.wait().await;
            second
        })
    };
    let (x, y) = (Slot { id: 10 }, Slot { id: 11 });
    let both = async {
        let (a, b) = (side(x, y), side(y, x));
        (a.await.expect("a"), b.await.expect("b"))
    };
    let (a, b) = tokio::time::timeout(Duration::from_secs(60), both)
        .await
        .expect("the deadlock's survivor was not granted before the victim's transaction ended");
    let deadlocks = [&a, &b]
        .iter()
        .filter(|r| r.as_ref().is_err_and(|e| e.is_deadlock()))
        .count();
    assert_eq!(deadlocks, 1, "{a:?}, {b:?}");
    assert!(a.is_ok() || b.is_ok(), "{a:?}, {b:?}");
}

/// A caller's own `lock_timeout` bounds the wait: the call ends as a
/// timeout, not retried, with the transaction aborted as an unbounded
/// wait's would be.
#[tokio::test(flavor = "multi_thread")]
async fn a_caller_s_own_lock_timeout_ends_a_bounded_wait() {
    let db = TestServer::shared();
    let _log = db.guard();
    let locker = bounded_locker(db).await;
    let key = Slot { id: 20 };
    let holder = db.connect().await;
    hold_in_transaction(&holder, [key.lock_key()]).await;
    let mut client = LockClient::new(&locker, db.connect().await);
    let tx = client.begin().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '200ms'")
        .await
        .unwrap();
    let error = tx.lock(key).await.expect_err("granted a held key");
    assert!(error.is_timeout(), "{error:?}");
    let next = tx
        .lock(Slot { id: 21 })
        .await
        .expect_err("the transaction is aborted");
    assert_eq!(
        next.kind(),
        lockkit::ErrorKind::TransactionAborted,
        "{next:?}"
    );
    let statement = tx.query_one("SELECT 1", &[]).await.expect_err("aborted");
    assert_eq!(
        statement.code(),
        Some(&tokio_postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION)
    );
    tx.rollback().await.unwrap();
    holder.batch_execute("ROLLBACK").await.unwrap();
}
