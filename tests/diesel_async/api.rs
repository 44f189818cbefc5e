//! The whole API on a real server inside diesel-async's
//! `conn.transaction(async |conn| …)`: every lock form, the
//! not-in-a-transaction refusal, tries, timeouts, savepoints, typed errors,
//! exclusion with its control, and exclusion against tokio-postgres.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, RunQueryDsl};
use lockkit_diesel_async::{AdvisoryKey, AsyncPgConnectionExt, Batch, Error, ErrorKind, Mode};
use lockkit_tests::TestServer;

use crate::common::{backend_pid, granted_elsewhere, locker, pool, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-api")]
struct Item {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-api-pair", pair)]
struct Slot {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn every_form_holds_until_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2);
    let locker = locker(&pool).await;
    let observer = Arc::new(db.connect().await);
    let mut conn = pool.get().await.unwrap();
    let seen = Arc::clone(&observer);
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = conn.lock_tx(&locker)?;
        let a = tx.lock(Item { id: 1 }).await?;
        assert_eq!(a.mode(), Mode::Exclusive);
        assert_eq!(tx.lock_shared(Slot { id: 1 }).await?.mode(), Mode::Shared);
        let _ = tx
            .lock_timeout(Item { id: 2 }, Duration::from_secs(5))
            .await?;
        let _ = tx
            .lock_shared_timeout(Slot { id: 2 }, Duration::from_secs(5))
            .await?;
        assert!(tx.try_lock(Item { id: 3 }).await?.is_ok());
        assert!(tx.try_lock_shared(Slot { id: 3 }).await?.is_ok());
        let batch = Batch::new()
            .with(&Item { id: 10 })
            .with_shared(&Slot { id: 10 });
        assert_eq!(tx.lock_batch(&batch).await?.keys().len(), 2);
        let batch = Batch::new().with(&Item { id: 11 }).with(&Slot { id: 11 });
        let _ = tx
            .lock_batch_timeout(&batch, Duration::from_secs(5))
            .await?;
        let batch = Batch::new().with(&Item { id: 12 }).with(&Slot { id: 12 });
        assert!(tx.try_lock_batch(&batch).await?.is_ok());
        assert_eq!(tx.held_count(), 12);
        // Queries run while the guards live.
        diesel::sql_query("SELECT $1")
            .bind::<BigInt, _>(a.id)
            .execute(tx.conn())
            .await?;
        for key in [Item { id: 1 }.lock_key(), Slot { id: 12 }.lock_key()] {
            assert!(granted_elsewhere(&seen, key).await, "{key:?}");
        }
        Ok(())
    })
    .await
    .unwrap();
    for key in [Item { id: 1 }.lock_key(), Slot { id: 12 }.lock_key()] {
        assert!(!granted_elsewhere(&observer, key).await, "{key:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_outside_a_transaction_is_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let mut conn = pool.get().await.unwrap();
    let err = conn.lock_tx(&locker).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotInTransaction, "{err}");
    // Control: inside a transaction it locks.
    conn.transaction::<_, Error, _>(async |conn| {
        assert!(conn
            .lock_tx(&locker)?
            .try_lock(Item { id: 20 })
            .await?
            .is_ok());
        Ok(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn try_timeout_savepoint_and_errors_against_another_holder() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 3);
    let locker = locker(&pool).await;
    let observer = Arc::new(db.connect().await);
    let mut holder = pool.get().await.unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let hold = {
        let locker = locker.clone();
        tokio::spawn(async move {
            holder
                .transaction::<_, Error, _>(async |conn| {
                    let mut tx = conn.lock_tx(&locker)?;
                    let _ = tx
                        .lock_batch(&Batch::new().with(&Item { id: 30 }).with(&Slot { id: 30 }))
                        .await?;
                    held_tx.send(()).unwrap();
                    go_rx.await.unwrap();
                    Ok(())
                })
                .await
        })
    };
    held_rx.await.unwrap();

    let mut conn = pool.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let obs = Arc::clone(&observer);
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = conn.lock_tx(&locker)?;
        assert!(tx.try_lock(Item { id: 30 }).await?.is_err());
        let busy = tx
            .try_lock_batch(&Batch::new().with(&Item { id: 31 }).with(&Slot { id: 30 }))
            .await?
            .unwrap_err();
        assert_eq!(busy.keys(), [Slot { id: 30 }.lock_key()]);
        // A timeout bounds the whole mixed batch; the transaction stays usable.
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        let batch = Batch::new().with(&Item { id: 32 }).with(&Slot { id: 30 });
        let err = tx.lock_batch_timeout(&batch, timeout).await.unwrap_err();
        let took = started.elapsed();
        assert!(err.is_timeout() && err.timeout() == Some(timeout), "{err}");
        assert!(
            took >= timeout && took < Duration::from_secs(10),
            "{took:?}"
        );
        assert!(!granted_elsewhere(&obs, Item { id: 32 }.lock_key()).await);
        // Savepoints: a rolled-back one releases, a released one keeps.
        let out: Result<(), Error> = tx
            .savepoint(|sp| {
                Box::pin(async move {
                    let _ = sp.lock(Item { id: 33 }).await?;
                    Err(Error::other("roll back"))
                })
            })
            .await;
        assert!(out.is_err());
        assert!(!tx.holds(&Item { id: 33 }, Mode::Exclusive));
        assert!(!granted_elsewhere(&obs, Item { id: 33 }.lock_key()).await);
        tx.savepoint(|sp| {
            Box::pin(async move {
                let _ = sp.lock(Item { id: 34 }).await?;
                Ok::<_, Error>(())
            })
        })
        .await?;
        assert!(tx.holds(&Item { id: 34 }, Mode::Exclusive));
        assert!(granted_elsewhere(&obs, Item { id: 34 }.lock_key()).await);
        // pg_cancel_backend is a cancel (by the English message), not a timeout.
        let (lock, ()) = tokio::join!(
            tx.lock_timeout(Item { id: 30 }, Duration::from_secs(30)),
            async {
                wait_until_waiting(&obs, pid).await;
                tokio_postgres::Client::execute(&obs, "SELECT pg_cancel_backend($1)", &[&pid])
                    .await
                    .unwrap();
            }
        );
        let err = lock.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
        assert_eq!(err.code(), Some("57014"));
        // A deadlock-free usable transaction afterwards.
        assert!(tx.lock(Item { id: 35 }).await.is_ok());
        Ok(())
    })
    .await
    .unwrap();
    go_tx.send(()).unwrap();
    hold.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exclusion_with_its_control() {
    let db = TestServer::shared();
    let _log = db.guard();
    const TASKS: usize = 8;
    const ROUNDS: usize = 40;
    let pool = pool(db, TASKS);
    let locker = locker(&pool).await;
    let setup = db.connect().await;
    setup
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS diesel_async_counters (id int8 PRIMARY KEY, n int8 NOT NULL); \
             INSERT INTO diesel_async_counters VALUES (1, 0), (2, 0) \
             ON CONFLICT (id) DO UPDATE SET n = 0",
        )
        .await
        .unwrap();
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    for (id, lock) in [(1_i64, true), (2, false)] {
        let overlaps = Arc::new(AtomicU64::new(0));
        let inside = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..TASKS {
            let (pool, locker) = (pool.clone(), locker.clone());
            let (overlaps, inside) = (Arc::clone(&overlaps), Arc::clone(&inside));
            tasks.push(tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let mut conn = pool.get().await.unwrap();
                    let (overlaps, inside) = (&overlaps, &inside);
                    conn.transaction::<_, Error, _>(async |conn| {
                        let mut tx = conn.lock_tx(&locker)?;
                        if lock {
                            let _ = tx.lock(Item { id: 1000 }).await?;
                        }
                        if AtomicU64::fetch_add(inside, 1, SeqCst) != 0 {
                            AtomicU64::fetch_add(overlaps, 1, SeqCst);
                        }
                        let row: N =
                            diesel::sql_query("SELECT n FROM diesel_async_counters WHERE id = $1")
                                .bind::<BigInt, _>(id)
                                .get_result(tx.conn())
                                .await?;
                        diesel::sql_query("UPDATE diesel_async_counters SET n = $2 WHERE id = $1")
                            .bind::<BigInt, _>(id)
                            .bind::<BigInt, _>(row.n + 1)
                            .execute(tx.conn())
                            .await?;
                        AtomicU64::fetch_sub(inside, 1, SeqCst);
                        Ok(())
                    })
                    .await
                    .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let n: i64 = setup
            .query_one("SELECT n FROM diesel_async_counters WHERE id = $1", &[&id])
            .await
            .unwrap()
            .get(0);
        let total = (TASKS * ROUNDS) as i64;
        if lock {
            assert_eq!(n, total, "every increment under the lock counts");
            assert_eq!(AtomicU64::load(&overlaps, SeqCst), 0);
        } else {
            assert!(
                n < total,
                "the control lost no update ({n}), so the test cannot fail"
            );
            assert!(AtomicU64::load(&overlaps, SeqCst) > 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn diesel_async_and_tokio_postgres_exclude_each_other() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2);
    let locker = locker(&pool).await;
    let mut pg = db.connect().await;
    let pg_locker = lockkit::Locker::new(
        &pg,
        lockkit::Config::default().order_check(lockkit::OrderCheck::Off),
    )
    .await
    .unwrap();
    let mut conn = pool.get().await.unwrap();
    // diesel-async holds exclusive and shared keys in both key spaces.
    let pg = &mut pg;
    let pg_locker = &pg_locker;
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = conn.lock_tx(&locker)?;
        let batch = Batch::new()
            .with(&Item { id: 40 })
            .with(&Slot { id: 40 })
            .with_shared(&Item { id: 41 })
            .with_shared(&Slot { id: 41 });
        let _ = tx.lock_batch(&batch).await?;
        let pg_tx = pg_locker.begin(pg).await?;
        assert!(pg_tx.try_lock(Item { id: 40 }).await?.is_err());
        assert!(pg_tx.try_lock_shared(Slot { id: 40 }).await?.is_err());
        assert!(pg_tx.try_lock(Item { id: 41 }).await?.is_err());
        assert!(pg_tx.try_lock(Slot { id: 41 }).await?.is_err());
        // Controls: shared with shared, and another key.
        assert!(pg_tx.try_lock_shared(Item { id: 41 }).await?.is_ok());
        assert!(pg_tx.try_lock_shared(Slot { id: 41 }).await?.is_ok());
        assert!(pg_tx.try_lock(Item { id: 42 }).await?.is_ok());
        pg_tx.rollback().await?;
        Ok(())
    })
    .await
    .unwrap();
    // tokio-postgres holds; diesel-async is refused in both key spaces.
    let pg_tx = pg_locker.begin(pg).await.unwrap();
    let _ = pg_tx.lock(Item { id: 43 }).await.unwrap();
    let _ = pg_tx.lock_shared(Slot { id: 43 }).await.unwrap();
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = conn.lock_tx(&locker)?;
        assert!(tx.try_lock_shared(Item { id: 43 }).await?.is_err());
        assert!(tx.try_lock(Slot { id: 43 }).await?.is_err());
        assert!(
            tx.try_lock_shared(Slot { id: 43 }).await?.is_ok(),
            "shared with shared"
        );
        Ok(())
    })
    .await
    .unwrap();
    pg_tx.commit().await.unwrap();
}
