//! Through a deadpool-postgres pool: transaction-scoped locks never leak
//! into a pooled connection, however the transaction ends.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockkit::OrderCheck;
use lockkit::{Config, Error};
use lockkit_tests::TestServer;
use tokio_postgres::NoTls;

use crate::common::{locker, Item};

fn pool(db: &TestServer, size: usize) -> Pool {
    let manager = Manager::from_config(
        db.config(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(size).build().expect("pool")
}

/// Advisory locks held by any session other than `observer`'s on keys of the
/// `Item` namespace used here.
async fn advisory_locks_held(observer: &tokio_postgres::Client, ids: std::ops::Range<i64>) -> i64 {
    let mut held = 0;
    for id in ids {
        if crate::common::granted_elsewhere(observer, lockkit::AdvisoryKey::lock_key(&Item { id }))
            .await
        {
            held += 1;
        }
    }
    held
}

#[tokio::test(flavor = "multi_thread")]
async fn xact_locks_never_leak_into_the_pool() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 4);
    let observer = db.connect().await;
    let locker = locker(&observer, Config::default().order_check(OrderCheck::Warn)).await;
    const KEYS: std::ops::Range<i64> = 9_000..9_008;

    let mut tasks = Vec::new();
    for n in 0..64_i64 {
        let (pool, locker) = (pool.clone(), locker.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = pool.get().await.expect("pooled connection");
            let tx = locker.begin(&mut conn).await?;
            let _held = tx
                .lock(Item {
                    id: KEYS.start + n % 8,
                })
                .await?;
            match n % 4 {
                0 => tx.commit().await?,
                1 => tx.rollback().await?,
                2 => drop(tx), // dropped: tokio-postgres rolls back
                _ => {
                    // A failed statement aborts the transaction; then dropped.
                    assert!(tx.execute("SELECT 1/0", &[]).await.is_err());
                }
            }
            Ok::<_, Error>(())
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("transaction");
    }
    // Every pooled connection (the pool holds at most 4) is idle and holds
    // nothing. A dropped transaction's ROLLBACK is sent without waiting for
    // its reply, so the connection can be back in the pool before the
    // server has processed it; a round trip on each connection first
    // orders the observer's look after it. Without it, the observer saw the
    // key still held once in 300 drops on a quiet machine. (A later user of
    // the connection is ordered after the ROLLBACK anyway: it queues
    // behind it.)
    let mut conns = Vec::new();
    for _ in 0..4 {
        let conn = pool.get().await.expect("pooled connection");
        conn.batch_execute("SELECT 1").await.unwrap();
        conns.push(conn);
    }
    assert_eq!(advisory_locks_held(&observer, KEYS).await, 0);
    for conn in &mut conns {
        let tx = locker.begin(conn).await.unwrap();
        for id in KEYS {
            assert!(
                tx.try_lock(Item { id }).await.unwrap().is_ok(),
                "key {id} leaked"
            );
        }
        tx.rollback().await.unwrap();
    }
}

/// The control: a session lock left on a pooled connection does leak, and
/// the check above sees it.
#[tokio::test(flavor = "multi_thread")]
async fn control_session_lock_leaks_into_the_pool() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let observer = db.connect().await;
    let key = lockkit::AdvisoryKey::lock_key(&Item { id: 9_100 });
    let lockkit::LockKey::BigInt(k) = key else {
        unreachable!()
    };
    {
        let conn = pool.get().await.unwrap();
        conn.execute("SELECT pg_advisory_lock($1)", &[&k])
            .await
            .unwrap();
        // Returned to the pool without unlocking.
    }
    assert_eq!(advisory_locks_held(&observer, 9_100..9_101).await, 1);
    let conn = pool.get().await.unwrap();
    conn.execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
}
