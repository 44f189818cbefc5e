//! The key protocol is shared across drivers: a sqlx session and a
//! tokio-postgres session locking the same typed key exclude each other, in
//! both key spaces and both modes.

use lockkit_sqlx::{AdvisoryKey, Batch, Config, Mode, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{backend_pid, granted_elsewhere, locker, pool, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-cross")]
struct Order {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-cross-pair", pair)]
struct Shelf {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlx_and_tokio_postgres_exclude_each_other() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let mut pg = db.connect().await;
    let pg_locker = lockkit::Locker::new(
        &pg,
        lockkit::Config::default().order_check(lockkit::OrderCheck::Off),
    )
    .await
    .unwrap();
    let observer = db.connect().await;

    // sqlx holds exclusive (both key spaces) and shared (both key spaces).
    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let batch = Batch::new()
        .with(&Order { id: 1 })
        .with(&Shelf { id: 1 })
        .with_shared(&Order { id: 2 })
        .with_shared(&Shelf { id: 2 });
    let _ = ltx.lock_batch(&batch).await.unwrap();
    {
        let pg_tx = pg_locker.begin(&mut pg).await.unwrap();
        assert!(pg_tx.try_lock(Order { id: 1 }).await.unwrap().is_err());
        assert!(pg_tx.try_lock(Shelf { id: 1 }).await.unwrap().is_err());
        assert!(pg_tx
            .try_lock_shared(Order { id: 1 })
            .await
            .unwrap()
            .is_err());
        assert!(pg_tx
            .try_lock_shared(Shelf { id: 1 })
            .await
            .unwrap()
            .is_err());
        assert!(pg_tx.try_lock(Order { id: 2 }).await.unwrap().is_err());
        assert!(pg_tx.try_lock(Shelf { id: 2 }).await.unwrap().is_err());
        // shared vs shared is admitted; a different key is free (controls).
        assert!(pg_tx
            .try_lock_shared(Order { id: 2 })
            .await
            .unwrap()
            .is_ok());
        assert!(pg_tx
            .try_lock_shared(Shelf { id: 2 })
            .await
            .unwrap()
            .is_ok());
        assert!(pg_tx.try_lock(Order { id: 3 }).await.unwrap().is_ok());
        assert!(pg_tx.try_lock(Shelf { id: 3 }).await.unwrap().is_ok());
        pg_tx.rollback().await.unwrap();
    }
    drop(ltx);
    tx.rollback().await.unwrap();

    // tokio-postgres holds; sqlx is refused, then waits and gets it once
    // tokio-postgres commits.
    let pg_tx = pg_locker.begin(&mut pg).await.unwrap();
    let _ = pg_tx.lock(Order { id: 4 }).await.unwrap();
    let _ = pg_tx.lock(Shelf { id: 4 }).await.unwrap();
    let _ = pg_tx.lock_shared(Order { id: 5 }).await.unwrap();
    let _ = pg_tx.lock_shared(Shelf { id: 5 }).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    assert!(ltx.try_lock(Order { id: 4 }).await.unwrap().is_err());
    assert!(ltx.try_lock_shared(Shelf { id: 4 }).await.unwrap().is_err());
    assert!(ltx.try_lock(Order { id: 5 }).await.unwrap().is_err());
    assert!(ltx.try_lock(Shelf { id: 5 }).await.unwrap().is_err());
    assert!(ltx.try_lock_shared(Order { id: 5 }).await.unwrap().is_ok());
    assert!(ltx.try_lock_shared(Shelf { id: 5 }).await.unwrap().is_ok());
    let (held, ()) = tokio::join!(ltx.lock(Shelf { id: 4 }), async {
        wait_until_waiting(&observer, pid).await;
        pg_tx.commit().await.unwrap();
    });
    assert_eq!(held.unwrap().mode(), Mode::Exclusive);
    assert!(granted_elsewhere(&observer, Shelf { id: 4 }.lock_key()).await);
}
