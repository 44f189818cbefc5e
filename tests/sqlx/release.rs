//! `Locker::transaction` releases its locks when its closure panics, as
//! seen from another session. (The conformance suite, tests/conformance,
//! drives sqlx through `lock_tx` on its own `Transaction`; this is the
//! closure form.)

use lockkit_sqlx::{AdvisoryKey, Config, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{locker, pool, released};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-release")]
struct Res {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn released_when_the_holding_task_panics() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let key = Res { id: 10 };
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let task = {
        let (pool, locker) = (pool.clone(), locker.clone());
        tokio::spawn(async move {
            locker
                .transaction(&pool, |tx| {
                    Box::pin(async move {
                        let _ = tx.lock(key).await?;
                        held_tx.send(()).unwrap();
                        tokio::task::yield_now().await;
                        panic!("the holder panics");
                        #[allow(unreachable_code)]
                        Ok::<_, lockkit_sqlx::Error>(())
                    })
                })
                .await
        })
    };
    held_rx.await.unwrap();
    assert!(task.await.unwrap_err().is_panic());
    assert!(released(&observer, key.lock_key()).await);
}

/// A transaction whose `COMMIT` fails (a deferred unique constraint, which
/// the server checks at the commit and answers by rolling back): sqlx
/// counts it still open (its `commit` fails before it counts the
/// transaction ended), and its pool would hand the connection on that way:
/// the next `Locker::transaction` would send a `SAVEPOINT` outside any
/// transaction (`25P01`). `Locker::transaction` rolls it back after the
/// failed commit, so the next one runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_commit_hands_the_connection_on_outside_a_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = crate::common::pool(db, 1).await;
    let locker = crate::common::locker(&pool, lockkit_sqlx::Config::default()).await;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS lockkit_sqlx_deferred; \
         CREATE TABLE lockkit_sqlx_deferred (id int8 UNIQUE DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let failed: Result<(), lockkit_sqlx::Error> = locker
        .transaction(&pool, |tx| {
            Box::pin(async move {
                let _ = tx.lock(Deferred { id: 1 }).await?;
                sqlx::query("INSERT INTO lockkit_sqlx_deferred VALUES (1), (1)")
                    .execute(tx.conn())
                    .await
                    .map_err(lockkit_sqlx::lock_error)?;
                Ok(())
            })
        })
        .await;
    let e = failed.expect_err("the commit fails on the deferred constraint");
    assert_eq!(e.code(), Some("23505"), "{e}");
    let next: Result<(), lockkit_sqlx::Error> = locker
        .transaction(&pool, |tx| {
            Box::pin(async move {
                let _ = tx.lock(Deferred { id: 2 }).await?;
                Ok(())
            })
        })
        .await;
    next.expect("the connection was handed on outside any transaction");
}

#[derive(lockkit_sqlx::AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/sqlx-deferred")]
struct Deferred {
    id: i64,
}
