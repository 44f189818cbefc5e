//! Cancellation: a dropped lock future sends a cancel request and poisons
//! its transaction (the server may have granted what it asked for);
//! concurrent lock calls on one transaction are refused.

use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, Error, ErrorKind, LockKey, OrderCheck};
use lockkit_tests::observe::wait_until_not_waiting;
use lockkit_tests::TestServer;

use crate::common::{advisory_rows, backend_pid, held_by, locker, wait_until_waiting};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.poison")]
struct Key {
    id: i64,
}

fn assert_poisoned<T>(result: Result<T, Error>, what: &str) {
    match result {
        Err(e) if e.kind() == ErrorKind::Poisoned => {}
        Err(other) => panic!("{what}: expected Poisoned, got {other}"),
        Ok(_) => panic!("{what}: expected Poisoned, got Ok"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dropped_lock_future_poisons_until_the_transaction_ends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let (busy, held, fresh) = (Key { id: 1 }, Key { id: 2 }, Key { id: 3 });

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(busy).await.unwrap();

    let tx = locker.begin(&mut b).await.unwrap();
    let _ = tx.lock(held).await.unwrap();
    {
        let call = tx.lock(busy);
        tokio::pin!(call);
        tokio::select! {
            r = &mut call => panic!("the lock cannot be granted while held: {r:?}"),
            // The statement was sent and waits on the server: drop it.
            () = wait_until_waiting(&observer, pid) => {}
        }
    }

    assert_poisoned(tx.lock(fresh).await, "lock");
    assert_poisoned(tx.lock(held).await, "relock of a held key");
    assert_poisoned(tx.lock_shared(fresh).await, "lock_shared");
    assert_poisoned(tx.try_lock(fresh).await, "try_lock");
    assert_poisoned(tx.try_lock_shared(fresh).await, "try_lock_shared");
    assert_poisoned(
        tx.lock_timeout(fresh, Duration::from_millis(10)).await,
        "lock_timeout",
    );
    let batch = Batch::new().with(&fresh).with(&Key { id: 4 });
    assert_poisoned(tx.lock_batch(&batch).await, "lock_batch");
    assert_poisoned(tx.try_lock_batch(&batch).await, "try_lock_batch");
    assert!(!held_by(&observer, pid, fresh.lock_key()).await);

    // The dropped call sent a cancel request: the server stops waiting,
    // the transaction is aborted, and it stays poisoned until it ends.
    wait_until_not_waiting(&observer, pid).await;
    assert!(!held_by(&observer, pid, busy.lock_key()).await);
    assert!(tx.is_poisoned());
    assert_poisoned(tx.lock(busy).await, "lock of the abandoned key");

    // Rollback ends it; the same client starts clean.
    tx.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
    holder.rollback().await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let _ = tx.lock(busy).await.unwrap();
    let _ = tx.lock(fresh).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 2);
    tx.commit().await.unwrap();
}

/// A dropped lock future does not hold the connection hostage until the
/// other holder lets go: the drop sends a cancel request, so `rollback()`
/// returns while the other session still holds the key, for every form of
/// lock call, many times over.
///
/// The claim is stated in the safe direction: the server is seen to stop
/// waiting after the drop and before anything else is sent, while the
/// holder keeps its lock until after the rollback returned (so neither a
/// cut-off that left the server waiting nor a rollback that waited for the
/// lock could pass; the 20 s only turns such a hang into a failure). The
/// control, the same drop of a raw `pg_advisory_xact_lock` statement,
/// shows the rollback cannot return while the key is held.
#[tokio::test(flavor = "multi_thread")]
async fn dropped_lock_future_frees_the_connection_while_the_key_is_held() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default()).await;
    let mut conn = lockkit::LockClient::new(&locker, db.connect().await);
    let conn_pid = backend_pid(&conn).await;
    let busy = Key { id: 21 };
    let holder_pid = backend_pid(&a).await;

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(busy).await.unwrap();

    let mut slowest = Duration::ZERO;
    for round in 0..30 {
        // Unnamed and prepared statements, waiting and timed forms.
        let (tx, pid) = if round % 2 == 0 {
            (locker.begin(&mut b).await.unwrap(), pid)
        } else {
            (conn.begin().await.unwrap(), conn_pid)
        };
        {
            let call = async {
                match round % 3 {
                    0 => tx.lock(busy).await.map(drop),
                    1 => tx
                        .lock_timeout(busy, Duration::from_secs(60))
                        .await
                        .map(drop),
                    _ => tx
                        .lock_batch(&Batch::new().with(&busy).with(&Key { id: 22 }))
                        .await
                        .map(drop),
                }
            };
            tokio::pin!(call);
            tokio::select! {
                r = &mut call => panic!("round {round}: the lock cannot be granted while held: {r:?}"),
                () = wait_until_waiting(&observer, pid) => {}
            }
            // Dropped here, while the server waits for the key.
        }
        assert!(tx.is_poisoned());
        // The cut-off itself makes the server stop waiting, before anything
        // else is sent on the connection, while the holder holds the key.
        wait_until_not_waiting(&observer, pid).await;
        assert!(held_by(&observer, holder_pid, busy.lock_key()).await);
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(20), tx.rollback())
            .await
            .unwrap_or_else(|_| panic!("round {round}: rollback waited for the holder"))
            .unwrap();
        slowest = slowest.max(started.elapsed());
        assert!(held_by(&observer, holder_pid, busy.lock_key()).await);
        assert_eq!(advisory_rows(&observer, pid).await, 0);
    }
    println!("slowest rollback after a dropped lock call: {slowest:?} (holder still holding)");

    // The control: a raw statement dropped the same way keeps the server
    // waiting, so the rollback cannot finish while the key is held. On a
    // connection of its own: a cancel request of the rounds above that the
    // server processes late (the default locker sends them as
    // tokio-postgres does, without waiting for that) would cancel a
    // statement of `b`'s, and end the control's wait.
    let mut c = db.connect().await;
    let pid = backend_pid(&c).await;
    let raw = c.transaction().await.unwrap();
    {
        let key = match busy.lock_key() {
            LockKey::BigInt(k) => k,
            LockKey::Pair(..) => unreachable!(),
        };
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&key];
        let call = raw.execute("SELECT pg_advisory_xact_lock($1)", &params);
        tokio::pin!(call);
        tokio::select! {
            r = &mut call => panic!("granted while held: {r:?}"),
            () = wait_until_waiting(&observer, pid) => {}
        }
    }
    let rollback = raw.rollback();
    tokio::pin!(rollback);
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut rollback)
            .await
            .is_err(),
        "the control's rollback cannot finish while the key is held"
    );
    holder.rollback().await.unwrap();
    rollback.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_lock_calls_on_one_transaction_are_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let (k1, k2) = (Key { id: 11 }, Key { id: 12 });

    // Both futures polled together: the first is sent, the second is
    // refused without sending, and the first completes. The first waits for
    // a holder, so it is certainly still in flight when the second is polled
    // (a lock that is granted at once could complete within its first poll
    // on a loaded machine, and then the second would rightly go ahead).
    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(k1).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let (r1, r2, ()) = tokio::join!(biased; tx.lock(k1), tx.lock(k2), async {
        wait_until_waiting(&observer, pid).await;
        holder.rollback().await.unwrap();
    });
    let ok = r1.expect("the first lock call is sent and granted").key();
    let refused = r2.expect_err("the second lock call is refused");
    assert!(refused.kind() == ErrorKind::LockInFlight, "{refused}");
    assert_eq!(advisory_rows(&observer, pid).await, 1);
    assert!(held_by(&observer, pid, ok).await);
    // Nothing was left in flight: the transaction goes on.
    let _ = tx.lock(k1).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 2);
    tx.rollback().await.unwrap();

    // With try_join the refusal drops the other future mid-flight, which
    // poisons the transaction.
    let (k3, k4) = (Key { id: 13 }, Key { id: 14 });
    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(k3).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let err = tokio::try_join!(tx.lock(k3), tx.lock(k4)).unwrap_err();
    assert!(err.kind() == ErrorKind::LockInFlight, "{err}");
    assert_poisoned(tx.lock(Key { id: 15 }).await, "lock after try_join");
    holder.rollback().await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
}

/// A transaction whose lock call was cut off (its future dropped while the
/// server waited, so a cancel request went out) does not report a commit:
/// the cancel aborts the transaction, and PostgreSQL answers `COMMIT` in an
/// aborted transaction by rolling back, which tokio-postgres reports as
/// success. A commit that said Ok would have lost the transaction's writes.
/// The control commits the same writes without a cut-off call and sees them.
///
/// Each round has a connection of its own. tokio-postgres sends a cancel
/// request without waiting for the server to process it (libpq waits), so
/// a request the server processes late can cancel a later statement on the
/// same connection: seen once in CI, where a cancel request of a cut-off
/// round cancelled a later round's lock call before it waited
/// (`LockTx::rollback` documents it).
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_whose_lock_call_was_cut_off_does_not_report_a_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut holder = db.connect().await;
    let observer = db.connect().await;
    let locker = locker(&observer, Config::default()).await;
    let table = lockkit_tests::scratch_table(&observer, "lockkit_cut_off").await;
    let busy = Key { id: 30 };

    for (round, cut_off) in [(1_i64, true), (2, false), (3, true), (4, false)] {
        let mut client = db.connect().await;
        let pid = backend_pid(&client).await;
        let held_elsewhere = holder.transaction().await.unwrap();
        let LockKey::BigInt(k) = busy.lock_key() else {
            unreachable!("Key is a BigInt key")
        };
        held_elsewhere
            .execute("SELECT pg_advisory_xact_lock($1)", &[&k])
            .await
            .unwrap();

        let tx = locker.begin(&mut client).await.unwrap();
        tx.execute(&format!("INSERT INTO {table} VALUES ($1)"), &[&round])
            .await
            .unwrap();
        if cut_off {
            let call = tx.lock(busy);
            tokio::pin!(call);
            tokio::select! {
                r = &mut call => panic!("granted while held: {r:?}"),
                () = wait_until_waiting(&observer, pid) => {}
            }
        }
        let committed = tx.commit().await;
        held_elsewhere.rollback().await.unwrap();
        let rows: i64 = observer
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE id = $1"),
                &[&round],
            )
            .await
            .unwrap()
            .get(0);
        match committed {
            Ok(()) => assert_eq!(rows, 1, "round {round}: commit said Ok, the row is missing"),
            Err(e) => {
                assert!(cut_off, "round {round}: {e}");
                assert_eq!(e.kind(), ErrorKind::Poisoned, "round {round}: {e}");
                assert_eq!(rows, 0, "round {round}: refused, yet committed");
            }
        }
        // Nothing is left on the connection.
        assert_eq!(advisory_rows(&observer, pid).await, 0);
    }
    observer
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
