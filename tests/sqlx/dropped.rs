//! A `LockTx::savepoint` future dropped half-way (e.g. by
//! `tokio::time::timeout`): the bookkeeping must not report locks the
//! server released, nor grant them again without a round trip.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::task::Poll;

use lockkit_sqlx::{AdvisoryKey, Config, Error, Mode, OrderCheck};
use lockkit_tests::observe::held_by;
use lockkit_tests::TestServer;
use sqlx::Connection;

use crate::common::{backend_pid, connect, locker, pool};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-dropped")]
struct Item {
    id: i64,
}

/// The savepoint future is dropped after its closure returned `Err`, while
/// its `ROLLBACK TO` is in flight: the server releases the savepoint's
/// locks (and sqlx queues another `ROLLBACK TO`), so the bookkeeping must
/// forget them, or say it does not know (poisoned). A poll that sees the
/// savepoint end anyway is retried.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_dropped_during_its_rollback_does_not_report_its_locks_held() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let mut conn = connect(db).await;
    let pid = backend_pid(&mut conn).await;
    // Under CPU contention the server's answer often lands before the
    // poll that sent the ROLLBACK TO ends (the write wakes the server,
    // which preempts the client): retried for a minute.
    for attempt in lockkit_tests::attempts_for(std::time::Duration::from_secs(60)) {
        let inside = Item {
            id: 100_000 + attempt,
        };
        let mut tx = conn.begin().await.unwrap();
        let mut ltx = locker.lock_tx(&mut tx).unwrap();
        let ended = Arc::new(AtomicBool::new(false));
        {
            let ended2 = Arc::clone(&ended);
            let savepoint = ltx.savepoint(move |sp| {
                Box::pin(async move {
                    let _ = sp.lock(inside).await?;
                    ended2.store(true, SeqCst);
                    Err::<(), _>(Error::other("roll back"))
                })
            });
            let mut savepoint = std::pin::pin!(savepoint);
            let finished = std::future::poll_fn(|cx| match savepoint.as_mut().poll(cx) {
                Poll::Ready(r) => Poll::Ready(Some(r)),
                Poll::Pending if ended.load(SeqCst) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            })
            .await;
            if let Some(r) = finished {
                eprintln!("attempt {attempt}: the savepoint ended in one poll: {r:?}");
                ended.store(false, SeqCst);
            }
        }
        if !ended.load(SeqCst) {
            drop(ltx);
            tx.rollback().await.unwrap();
            continue; // the savepoint ended in one poll: again
        }
        // Let the ROLLBACK TO run: the connection's next statement follows.
        sqlx::query("SELECT 1").execute(&mut *ltx).await.unwrap();
        assert!(
            !held_by(&observer, pid, inside.lock_key()).await,
            "ROLLBACK TO released it"
        );
        if !ltx.is_poisoned() {
            assert!(
                !ltx.holds(&inside, Mode::Exclusive),
                "holds() reports a lock the server released"
            );
            if ltx.lock(inside).await.is_ok() {
                assert!(
                    held_by(&observer, pid, inside.lock_key()).await,
                    "lock() returned Ok without the lock"
                );
            }
        }
        drop(ltx);
        tx.rollback().await.unwrap();
        return;
    }
    panic!("the savepoint's ROLLBACK TO was answered within the poll that sent it, for a minute");
}
