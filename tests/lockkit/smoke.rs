//! The basic paths, end to end: lock, batch, try, timeout, savepoint.

use std::time::Duration;

use lockkit::OrderCheck;
use lockkit::{AdvisoryKey, Batch, Config, Mode};
use lockkit_tests::TestServer;

use crate::common::{advisory_rows, backend_pid, granted_elsewhere, held_by, locker, Item};

#[tokio::test(flavor = "multi_thread")]
async fn lock_is_held_until_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    assert!(locker.policy().facts().max_locks_per_transaction() >= 64);
    assert!(!locker.policy().facts().in_recovery());

    let tx = locker.begin(&mut a).await.unwrap();
    let held = tx.lock(Item { id: 1 }).await.unwrap();
    assert_eq!(held.key(), Item { id: 1 }.lock_key());
    assert_eq!(held.id, 1);
    assert!(granted_elsewhere(&observer, held.key()).await);
    let key = held.key();
    drop(held);
    assert!(
        granted_elsewhere(&observer, key).await,
        "dropping the guard releases nothing"
    );
    tx.commit().await.unwrap();
    assert!(!granted_elsewhere(&observer, key).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_try_and_timeout() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;

    let tx_a = locker.begin(&mut a).await.unwrap();
    let batch = Batch::new()
        .with(&Item { id: 12 })
        .with(&Item { id: 11 })
        .with_shared(&Item { id: 13 });
    let held = tx_a.lock_batch(&batch).await.unwrap();
    assert_eq!(held.keys().len(), 3);
    assert!(held.contains(&Item { id: 11 }));
    assert_eq!(tx_a.held_count(), 3);

    let tx_b = locker.begin(&mut b).await.unwrap();
    let busy = tx_b.try_lock(Item { id: 11 }).await.unwrap().unwrap_err();
    assert_eq!(busy, Item { id: 11 });
    let shared = tx_b.try_lock_shared(Item { id: 13 }).await.unwrap();
    assert!(shared.is_ok(), "shared locks admit each other");

    let all = Batch::new().with(&Item { id: 14 }).with(&Item { id: 12 });
    let busy = tx_b.try_lock_batch(&all).await.unwrap().unwrap_err();
    assert_eq!(busy.keys(), [Item { id: 12 }.lock_key()]);
    assert!(!tx_b.holds(&Item { id: 14 }, Mode::Exclusive));

    let err = tx_b
        .lock_timeout(Item { id: 12 }, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let err = tx_b
        .lock_batch_timeout(&all, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    // Still usable, and the caller's timeouts are back.
    let row = tx_b
        .query_one(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, &str>(0), row.get::<_, &str>(1)), ("0", "0"));
    // Free: the bound (also the statement's) only guards a hang.
    let got = tx_b
        .lock_timeout(Item { id: 14 }, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(got.mode(), Mode::Exclusive);
    drop(held);
    tx_a.rollback().await.unwrap();
    tx_b.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn savepoint_rollback_forgets_locks() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;

    let mut tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(Item { id: 21 }).await.unwrap();
    {
        let sp = tx.savepoint().await.unwrap();
        let _ = sp.lock(Item { id: 22 }).await.unwrap();
        assert_eq!(sp.held_count(), 2);
        sp.rollback().await.unwrap();
    }
    assert_eq!(tx.held_count(), 1);
    assert!(!granted_elsewhere(&observer, Item { id: 22 }.lock_key()).await);
    assert!(granted_elsewhere(&observer, Item { id: 21 }.lock_key()).await);
    {
        let sp = tx.savepoint().await.unwrap();
        let _ = sp.lock(Item { id: 23 }).await.unwrap();
        sp.commit().await.unwrap();
    }
    assert!(tx.holds(&Item { id: 23 }, Mode::Exclusive));
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn prepared_statements_take_the_same_locks() {
    #[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
    #[advisory_key(pair)]
    struct Seat {
        row: i32,
    }

    let db = TestServer::shared();
    let _log = db.guard();
    let a = db.connect().await;
    let observer = db.connect().await;
    let config = Config::default()
        .order_check(OrderCheck::Warn)
        .statements(lockkit::StatementMode::Prepared);
    let locker = locker(&a, config).await;
    let mut conn = lockkit::LockClient::new(&locker, a);

    let mut tx = conn.begin().await.unwrap();
    assert!(tx.is_prepared());
    let one = tx.lock(Item { id: 31 }).await.unwrap().key();
    let shared = tx.lock_shared(Item { id: 32 }).await.unwrap().key();
    let pair = tx.lock(Seat { row: 7 }).await.unwrap().key();
    let mixed = Batch::new()
        .with(&Item { id: 34 })
        .with(&Item { id: 33 })
        .with_shared(&Seat { row: 9 })
        .with(&Seat { row: 8 });
    let batch: Vec<_> = tx
        .lock_batch(&mixed)
        .await
        .unwrap()
        .keys()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    // All exclusive: the statements without a mode array, for both spaces.
    let exclusive = Batch::new()
        .with(&Item { id: 38 })
        .with(&Item { id: 37 })
        .with(&Seat { row: 11 })
        .with(&Seat { row: 10 });
    let exclusive: Vec<_> = tx
        .lock_batch(&exclusive)
        .await
        .unwrap()
        .keys()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    for key in [one, shared, pair]
        .into_iter()
        .chain(batch)
        .chain(exclusive)
    {
        assert!(granted_elsewhere(&observer, key).await, "{key} not held");
    }
    {
        // Savepoints use the same prepared statements.
        let sp = tx.savepoint().await.unwrap();
        let k = sp
            .lock_timeout(Item { id: 35 }, Duration::from_secs(5))
            .await
            .unwrap()
            .key();
        assert!(granted_elsewhere(&observer, k).await);
        sp.rollback().await.unwrap();
        assert!(!granted_elsewhere(&observer, k).await);
    }
    assert_eq!(tx.held_count(), 11);
    tx.commit().await.unwrap();
    assert!(!granted_elsewhere(&observer, one).await);

    // The statements stay prepared on the connection for its next
    // transactions; a connection in unnamed mode prepares nothing.
    let tx = conn.begin().await.unwrap();
    let k = tx.lock(Item { id: 36 }).await.unwrap().key();
    assert!(granted_elsewhere(&observer, k).await);
    tx.commit().await.unwrap();
    let unnamed = lockkit::Locker::with_facts(
        Config::default()
            .order_check(OrderCheck::Warn)
            .statements(lockkit::StatementMode::Unnamed),
        locker.policy().facts().clone(),
    );
    let mut plain = lockkit::LockClient::new(&unnamed, db.connect().await);
    let tx = plain.begin().await.unwrap();
    assert!(!tx.is_prepared());
    let k = tx.lock(Item { id: 39 }).await.unwrap().key();
    assert!(granted_elsewhere(&observer, k).await);
}

/// `Locker::lock_tx`: a transaction the caller opened (here after a statement
/// of its own) takes locks that are held until it ends, as with `begin`;
/// committing and rolling back the wrapped transaction both release them.
#[tokio::test(flavor = "multi_thread")]
async fn wrap_takes_locks_in_the_callers_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default()).await;
    let (one, two) = (Item { id: 40 }, Item { id: 41 });

    let raw = a.transaction().await.unwrap();
    raw.execute("SET LOCAL application_name = 'wrapped'", &[])
        .await
        .unwrap();
    let tx = locker.wrap(raw);
    let batch = Batch::new().with(&one).with(&two);
    let held = tx.lock_batch(&batch).await.unwrap();
    assert!(held.contains(&one) && held.contains(&two));
    drop(held);
    for key in [one.lock_key(), two.lock_key()] {
        assert!(held_by(&observer, pid, key).await, "{key} not held");
    }
    // The same transaction as the caller's statement.
    let name: String = tx
        .query_one("SELECT current_setting('application_name')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, "wrapped");
    tx.commit().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0, "commit releases");

    let tx = locker.wrap(a.transaction().await.unwrap());
    let _ = tx.lock(one).await.unwrap();
    assert!(held_by(&observer, pid, one.lock_key()).await);
    tx.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0, "rollback releases");
}

/// A savepoint's rollback future dropped after it sent `ROLLBACK TO` (first
/// poll) but before the reply: the server releases the savepoint's locks,
/// so lockkit must not go on reporting them held, and a new lock call for
/// the key must take it again rather than answer from the bookkeeping.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_rollback_dropped_in_flight_forgets_its_locks() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let key = Item { id: 24 };

    let mut tx = locker.begin(&mut a).await.unwrap();
    {
        let sp = tx.savepoint().await.unwrap();
        drop(sp.lock(key).await.unwrap());
        let mut rollback = Box::pin(sp.rollback());
        // On this one-thread runtime the connection task cannot run during
        // the poll: `ROLLBACK TO` is sent and its reply cannot have come.
        assert!(poll_once(rollback.as_mut()).await.is_pending());
        drop(rollback);
    }
    assert!(
        !tx.holds(&key, Mode::Exclusive),
        "reported held after the rollback"
    );
    assert_eq!(tx.held_count(), 0);
    drop(tx.lock(key).await.unwrap());
    assert!(
        held_by(&observer, pid, key.lock_key()).await,
        "locked again"
    );
    tx.rollback().await.unwrap();
}

/// A savepoint's commit future dropped after it sent `RELEASE`: whether
/// the savepoint's locks now belong to the transaction is unknown to lockkit,
/// so the transaction is poisoned rather than guessed about.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_commit_dropped_in_flight_poisons_the_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let locker = locker(&a, Config::default()).await;

    let mut tx = locker.begin(&mut a).await.unwrap();
    {
        let sp = tx.savepoint().await.unwrap();
        drop(sp.lock(Item { id: 25 }).await.unwrap());
        let mut commit = Box::pin(sp.commit());
        assert!(poll_once(commit.as_mut()).await.is_pending());
        drop(commit);
    }
    assert!(tx.is_poisoned());
    let refused = tx.lock(Item { id: 26 }).await.unwrap_err();
    assert_eq!(refused.kind(), lockkit::ErrorKind::Poisoned);
    tx.rollback().await.unwrap();
}

/// Polls `fut` once and says what that poll returned.
async fn poll_once<F: std::future::Future>(
    mut fut: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await
}

/// Advisory locks belong to the database session, not to a thread: guards
/// and transactions must cross `.await` points on multi-threaded runtimes.
#[test]
fn guards_and_transactions_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<lockkit::Locker>();
    send_sync::<lockkit::LockTx<'static>>();
    send_sync::<lockkit::Held<'static, i64>>();
    send_sync::<lockkit::HeldBatch<'static>>();
    send::<lockkit::Held<'static, String>>();
    send_sync::<lockkit::Busy>();
    send_sync::<lockkit::Error>();
}
