//! Every way a sqlx transaction ends releases lockkit's locks, as seen from
//! another session: commit, rollback, drop, a panicking task, a terminated
//! backend. And what a dropped lock future does (sqlx has no cancel
//! request): it poisons the transaction, and the connection waits for the
//! server's reply.

use std::time::Duration;

use lockkit_sqlx::{AdvisoryKey, Config, ErrorKind, Mode, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{backend_pid, granted_elsewhere, locker, pool, released, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-release")]
struct Res {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_commit_rollback_and_drop() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    for (id, end) in [(1, "commit"), (2, "rollback"), (3, "drop")] {
        let key = Res { id };
        let mut tx = pool.begin().await.unwrap();
        let mut ltx = locker.lock_tx(&mut tx).unwrap();
        let _ = ltx.lock(key).await.unwrap();
        drop(ltx);
        assert!(
            granted_elsewhere(&observer, key.lock_key()).await,
            "{end}: held"
        );
        match end {
            "commit" => tx.commit().await.unwrap(),
            "rollback" => tx.rollback().await.unwrap(),
            _ => drop(tx), // sqlx queues the ROLLBACK; the pool sends it
        }
        assert!(released(&observer, key.lock_key()).await, "{end}: released");
    }
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

#[tokio::test(flavor = "multi_thread")]
async fn released_on_terminate_backend_and_typed_as_connection_lost() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let key = Res { id: 20 };
    let mut conn = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let _ = ltx.lock(key).await.unwrap();
    assert!(granted_elsewhere(&observer, key.lock_key()).await);
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    assert!(released(&observer, key.lock_key()).await);
    let err = ltx.lock(Res { id: 21 }).await.unwrap_err();
    assert!(err.is_connection_lost(), "{err:?}");
}

/// sqlx has no cancel request: a dropped lock future poisons the
/// transaction, and the connection answers nothing until the server
/// answers the lock statement (here: when the holder lets go). The rollback
/// then releases what the lock statement got.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_lock_future_poisons_and_the_rollback_waits_for_the_reply() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 3).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let key = Res { id: 30 };
    let mut holder = pool.begin().await.unwrap();
    let mut h = locker.lock_tx(&mut holder).unwrap();
    let _ = h.lock(key).await.unwrap();
    drop(h);

    let mut conn = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    // Dropped once the server is seen waiting for the lock.
    tokio::select! {
        _ = ltx.lock(key) => panic!("granted while another session holds it"),
        () = wait_until_waiting(&observer, pid) => {}
    }
    assert!(ltx.is_poisoned());
    let err = ltx.lock(Res { id: 31 }).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Poisoned, "{err}");
    drop(ltx);
    // The rollback cannot finish while the server still waits for the lock
    // (a window in the safe direction: it fails if the rollback returns).
    let rollback = tx.rollback();
    tokio::pin!(rollback);
    tokio::select! {
        _ = &mut rollback => panic!("the rollback returned while the lock statement waited"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    let (rolled_back, committed) = tokio::join!(rollback, holder.commit());
    rolled_back.unwrap();
    committed.unwrap();
    // Whatever the lock statement got, the rollback released it.
    assert!(released(&observer, key.lock_key()).await);
    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    assert!(ltx.try_lock(key).await.unwrap().is_ok());
    assert!(ltx.holds(&key, Mode::Exclusive));
}
