//! A `LockTx::savepoint` future dropped half-way (e.g. by
//! `tokio::time::timeout`): the bookkeeping must not report locks the
//! server released, nor grant them again without a round trip.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::task::Poll;

use lockkit_sqlx::{AdvisoryKey, Config, Error, Locker, Mode, OrderCheck};
use lockkit_tests::observe::held_by;
use lockkit_tests::{LogGuard, TestServer};
use sqlx::{Connection, PgConnection, PgPool};

use crate::common::{backend_pid, connect, locker, pool};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-dropped")]
struct Item {
    id: i64,
}

/// What each test here starts from: the shared server, its log printed
/// should the test fail, an observer connection (tokio-postgres, another
/// session), a pool of one connection and its locker, with
/// the order check off (the tests choose their keys' order).
struct Setup {
    db: &'static TestServer,
    _log: LogGuard<'static>,
    pool: PgPool,
    locker: Locker,
    observer: tokio_postgres::Client,
}

impl Setup {
    async fn new() -> Setup {
        let db = TestServer::shared();
        let _log = db.guard();
        let pool = pool(db, 1).await;
        let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
        let observer = db.connect().await;
        Setup {
            db,
            _log,
            pool,
            locker,
            observer,
        }
    }

    /// A sqlx connection of its own, and its backend pid.
    async fn connection(&self) -> (PgConnection, i32) {
        let mut conn = connect(self.db).await;
        let pid = backend_pid(&mut conn).await;
        (conn, pid)
    }
}

/// The savepoint future is dropped after its closure returned `Err`, while
/// its `ROLLBACK TO` is in flight: the server releases the savepoint's
/// locks (and sqlx queues another `ROLLBACK TO`), so the bookkeeping must
/// forget them, or say it does not know (poisoned). A poll that sees the
/// savepoint end anyway is retried.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_dropped_during_its_rollback_does_not_report_its_locks_held() {
    let s = Setup::new().await;
    let (mut conn, pid) = s.connection().await;
    let (locker, observer) = (&s.locker, &s.observer);
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
            !held_by(observer, pid, inside.lock_key()).await,
            "ROLLBACK TO released it"
        );
        if !ltx.is_poisoned() {
            assert!(
                !ltx.holds(&inside, Mode::Exclusive),
                "holds() reports a lock the server released"
            );
            if ltx.lock(inside).await.is_ok() {
                assert!(
                    held_by(observer, pid, inside.lock_key()).await,
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

/// The savepoint future is dropped while its closure waits, a lock taken
/// inside it: sqlx queues the savepoint's `ROLLBACK TO`, which its next
/// statement runs first, so the savepoint's end is known (rolled back).
/// The transaction goes on, not poisoned: the savepoint's key is not
/// reported held, the server releases it, and the next lock is taken.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_dropped_while_its_closure_waits_is_rolled_back_and_the_transaction_goes_on() {
    let s = Setup::new().await;
    let (mut conn, pid) = s.connection().await;
    let (locker, observer) = (&s.locker, &s.observer);
    let (before, inside, after) = (
        Item { id: 300_000 },
        Item { id: 300_001 },
        Item { id: 300_002 },
    );
    let mut tx = conn.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let _ = ltx.lock(before).await.unwrap();
    let locked = Arc::new(AtomicBool::new(false));
    {
        let locked2 = Arc::clone(&locked);
        let savepoint = ltx.savepoint(move |sp| {
            Box::pin(async move {
                let _ = sp.lock(inside).await?;
                locked2.store(true, SeqCst);
                std::future::pending::<Result<(), Error>>().await
            })
        });
        let mut savepoint = std::pin::pin!(savepoint);
        std::future::poll_fn(|cx| match savepoint.as_mut().poll(cx) {
            Poll::Ready(r) => panic!("the savepoint ended: {r:?}"),
            Poll::Pending if locked.load(SeqCst) => Poll::Ready(()),
            Poll::Pending => Poll::Pending,
        })
        .await;
        assert!(held_by(observer, pid, inside.lock_key()).await);
    } // The savepoint future is dropped here.
    assert!(!ltx.is_poisoned(), "a savepoint rolled back is a known end");
    assert!(!ltx.holds(&inside, Mode::Exclusive));
    assert!(ltx.holds(&before, Mode::Exclusive));
    assert_eq!(ltx.held_count(), 1);
    let _ = ltx.lock(after).await.unwrap();
    assert!(
        !held_by(observer, pid, inside.lock_key()).await,
        "ROLLBACK TO released it"
    );
    assert!(held_by(observer, pid, before.lock_key()).await);
    assert!(held_by(observer, pid, after.lock_key()).await);
    drop(ltx);
    tx.commit().await.unwrap();
    assert!(!held_by(observer, pid, after.lock_key()).await);
}

/// A closure form whose lock call was cut off in flight (here once the
/// server shows it waiting for the key another session holds) and whose
/// closure then returns `Ok` must not report the transaction committed:
/// the call's outcome is unknown, the transaction is poisoned, and
/// `transaction` rolls back and fails typed. The application's write in it
/// is not committed.
#[tokio::test(flavor = "multi_thread")]
async fn a_closure_whose_lock_call_was_cut_off_is_not_committed() {
    let s = Setup::new().await;
    let holder = s.db.connect().await;
    let (pool, locker, observer) = (&s.pool, &s.locker, &s.observer);
    observer
        .batch_execute("CREATE TABLE IF NOT EXISTS sqlx_cut_off_writes (id int8 PRIMARY KEY)")
        .await
        .unwrap();
    for round in 0..5_i64 {
        let key = Item {
            id: 200_000 + round,
        };
        holder.batch_execute("BEGIN").await.unwrap();
        let lock_key = key.lock_key();
        let lockkit::LockKey::BigInt(k) = lock_key else {
            unreachable!()
        };
        holder
            .execute("SELECT pg_advisory_xact_lock($1)", &[&k])
            .await
            .unwrap();
        // sqlx has no cancel request: the cut-off statement keeps waiting
        // behind the holder (for at most its slice), and so does the
        // transaction's end. It runs in a task, cut off once the server
        // shows it waiting for the key (a lock's first statement, a try,
        // does not wait); then the holder lets go.
        let (pool2, locker2) = (pool.clone(), locker.clone());
        let cut = std::sync::Arc::new(tokio::sync::Notify::new());
        let cut_here = cut.clone();
        let task = tokio::spawn(async move {
            locker2
                .transaction(&pool2, |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO sqlx_cut_off_writes VALUES ($1)")
                            .bind(200_000 + round)
                            .execute(tx.conn())
                            .await
                            .map_err(lockkit_sqlx::lock_error)?;
                        // Waiting behind the holder, then dropped.
                        tokio::select! {
                            r = tx.lock(key) => panic!("granted while held: {:?}", r.map(|_| ())),
                            () = cut_here.notified() => {}
                        }
                        Ok::<_, Error>(())
                    })
                })
                .await
        });
        lockkit_tests::observe::wait_until_key_waited(observer, lock_key).await;
        cut.notify_one();
        holder.batch_execute("ROLLBACK").await.unwrap();
        let result = task.await.unwrap();
        let e = result.expect_err("a transaction with a cut-off lock call was reported committed");
        assert_eq!(e.kind(), lockkit_sqlx::ErrorKind::Poisoned, "{e:?}");
        let committed: i64 = observer
            .query_one(
                "SELECT count(*) FROM sqlx_cut_off_writes WHERE id = $1",
                &[&(200_000 + round)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            committed, 0,
            "the cut-off transaction's write was committed"
        );
    }
}
