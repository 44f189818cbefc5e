//! Futures dropped inside diesel-async's `conn.transaction(async |conn| …)`:
//! a lock call or a `LockTx::savepoint` future dropped half-way (e.g. by
//! `tokio::time::timeout`) must not let the enclosing transaction report a
//! commit it did not make, nor leave a lock held by a pooled connection.

use std::future::Future;
use std::sync::Arc;

use diesel_async::AsyncConnection;
use lockkit_diesel_async::{AdvisoryKey, Error};
use lockkit_tests::observe::{advisory_rows, held_by, released, wait_until_idle_in_transaction};
use lockkit_tests::TestServer;

use crate::common::{backend_pid, locker, pool, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-dropped")]
struct Item {
    id: i64,
}

/// Whether the session of `conn` is inside a transaction block, as the
/// server sees it (not as diesel-async's bookkeeping does).
async fn in_transaction_block(observer: &tokio_postgres::Client, pid: i32) -> bool {
    let state: Option<String> = observer
        .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("pg_stat_activity")
        .get(0);
    matches!(
        state.as_deref(),
        Some("idle in transaction" | "idle in transaction (aborted)")
    )
}

/// The savepoint future is dropped while its closure holds a lock and
/// awaits something else (the timeout of a slow call). The closure of
/// `conn.transaction` then returns `Ok`: diesel-async would "commit" at
/// depth 2, i.e. `RELEASE SAVEPOINT`, and report success while the
/// transaction (its writes, its locks) stays open on the server. lockkit
/// must not let that pass as a commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_savepoint_does_not_let_the_transaction_report_a_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let observer = Arc::new(db.connect().await);
    let mut conn = pool.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let (before, inside) = (Item { id: 1 }, Item { id: 2 });
    let out = conn
        .transaction::<_, Error, _>(async |conn| {
            let mut tx = locker.lock_tx(conn)?;
            let _ = tx.lock(before).await?;
            let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
            let savepoint = tx.savepoint(|sp| {
                Box::pin(async move {
                    let _ = sp.lock(inside).await?;
                    let _ = entered_tx.send(());
                    std::future::pending::<()>().await;
                    Ok::<_, Error>(())
                })
            });
            tokio::select! {
                _ = savepoint => unreachable!("the savepoint's closure never returns"),
                r = entered_rx => r.unwrap(),
            }
            assert!(tx.is_poisoned());
            Ok(())
        })
        .await;
    let open = in_transaction_block(&observer, pid).await;
    let held = advisory_rows(&observer, pid).await;
    println!("transaction: {out:?}; in a transaction block: {open}; advisory rows: {held}");
    assert!(
        out.is_err(),
        "the transaction reported Ok (in a transaction block: {open}, advisory locks held: {held})"
    );
    // Back in the pool, the connection holds no lock while it waits to be
    // discarded at the next checkout: the transaction was rolled back.
    drop(conn);
    assert!(
        released(&observer, before.lock_key()).await,
        "a pooled connection keeps the transaction's lock"
    );
    assert!(released(&observer, inside.lock_key()).await);
    // The pool does not hand the given-up transaction out again.
    let mut next = pool.get().await.unwrap();
    assert_ne!(backend_pid(&mut next).await, pid);
}

/// The same with the lock statement in flight when the savepoint future is
/// dropped (the key held elsewhere): the cancel request ends the wait, and
/// the enclosing transaction must not report a commit either.
#[tokio::test(flavor = "multi_thread")]
async fn a_savepoint_dropped_mid_wait_does_not_let_the_transaction_report_a_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2);
    let locker = locker(&pool).await;
    let observer = Arc::new(db.connect().await);
    let (before, busy) = (Item { id: 10 }, Item { id: 11 });
    let mut holder = pool.get().await.unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let hold = {
        let locker = locker.clone();
        tokio::spawn(async move {
            holder
                .transaction::<_, Error, _>(async |conn| {
                    let _ = locker.lock_tx(conn)?.lock(busy).await?;
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
    let out = conn
        .transaction::<_, Error, _>(async |conn| {
            let mut tx = locker.lock_tx(conn)?;
            let _ = tx.lock(before).await?;
            let savepoint = tx.savepoint(|sp| {
                Box::pin(async move {
                    let _ = sp.lock(busy).await?;
                    Ok::<_, Error>(())
                })
            });
            tokio::select! {
                _ = savepoint => unreachable!("the key is held elsewhere"),
                () = wait_until_waiting(&obs, pid) => {}
            }
            assert!(tx.is_poisoned());
            Ok(())
        })
        .await;
    let open = in_transaction_block(&observer, pid).await;
    let held = held_by(&observer, pid, before.lock_key()).await;
    println!("transaction: {out:?}; in a transaction block: {open}; holds `before`: {held}");
    assert!(
        out.is_err(),
        "the transaction reported Ok (in a transaction block: {open}, holds `before`: {held})"
    );
    // Back in the pool, the connection holds no lock while it waits to be
    // discarded at the next checkout: the transaction was rolled back.
    drop(conn);
    assert!(
        released(&observer, before.lock_key()).await,
        "a pooled connection keeps the transaction's lock"
    );
    go_tx.send(()).unwrap();
    hold.await.unwrap().unwrap();
    let both = (pool.get().await.unwrap(), pool.get().await.unwrap());
    drop(both);
    assert!(released(&observer, before.lock_key()).await);
    assert!(released(&observer, busy.lock_key()).await);
}

/// A savepoint future dropped after its closure returned `Err`, while its
/// `ROLLBACK TO` is in flight: the server releases the savepoint's locks,
/// so the bookkeeping must not go on reporting them held (and must not
/// grant them again without a round trip), unless it says it does not know
/// (poisoned). A current-thread runtime: the connection's task cannot read
/// the reply while the test polls the savepoint future; a poll that sees the
/// savepoint end anyway is retried.
#[tokio::test(flavor = "current_thread")]
async fn a_savepoint_dropped_during_its_rollback_does_not_report_its_locks_held() {
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::task::Poll;

    use lockkit_diesel_async::Mode;

    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let observer = db.connect().await;
    // Under CPU contention the server's answer often lands before the
    // poll that sent the ROLLBACK TO ends (the write wakes the server,
    // which preempts the client): retried for a minute.
    for attempt in lockkit_tests::attempts_for(std::time::Duration::from_secs(60)) {
        let inside = Item {
            id: 100_000 + attempt,
        };
        let mut conn = pool.get().await.unwrap();
        let pid = backend_pid(&mut conn).await;
        let mut cut = false;
        let _ = conn
            .transaction::<_, Error, _>(async |conn| {
                let mut tx = locker.lock_tx(conn)?;
                let ended = Arc::new(AtomicBool::new(false));
                {
                    let ended2 = Arc::clone(&ended);
                    let savepoint = tx.savepoint(move |sp| {
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
                    if finished.is_some() {
                        return Ok(()); // the savepoint ended in one poll: again
                    }
                }
                cut = true;
                // Let the ROLLBACK TO run: the connection's next statement
                // follows it.
                diesel_async::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), tx.conn())
                    .await?;
                let on_server = held_by(&observer, pid, inside.lock_key()).await;
                assert!(!on_server, "ROLLBACK TO released it");
                if !tx.is_poisoned() {
                    assert!(
                        !tx.holds(&inside, Mode::Exclusive),
                        "holds() reports a lock the server released"
                    );
                    if tx.lock(inside).await.is_ok() {
                        assert!(
                            held_by(&observer, pid, inside.lock_key()).await,
                            "lock() returned Ok without the lock"
                        );
                    }
                }
                Err(Error::other("done"))
            })
            .await;
        if cut {
            return;
        }
    }
    panic!("the savepoint's ROLLBACK TO was answered within the poll that sent it, for a minute");
}

/// A lock call cut off inside `conn.transaction` (its future dropped while
/// the server waits for the key, so a cancel request goes out, which aborts
/// the transaction): if the closure still returns `Ok`, PostgreSQL answers
/// diesel-async's `COMMIT` by rolling back, and diesel-async reported that
/// as success. The transaction must fail instead, its row not there; the
/// control rounds, without a cut-off, commit their rows.
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_lock_call_does_not_let_the_transaction_report_a_commit() {
    use diesel_async::RunQueryDsl;

    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let observer = db.connect().await;
    let mut holder = db.connect().await;
    // A key left held by an earlier round's pooled connection fails the
    // next round's holder instead of hanging the test (a bound, not a
    // timing claim).
    holder
        .batch_execute("SET lock_timeout = '30s'")
        .await
        .unwrap();
    let table = lockkit_tests::scratch_table(&observer, "lockkit_da_cut_off").await;
    let busy = Item { id: 30 };
    let lockkit::LockKey::BigInt(k) = busy.lock_key() else {
        unreachable!("Item is a BigInt key")
    };

    for (round, cut_off) in [(1_i64, true), (2, false), (3, true), (4, false)] {
        let held_elsewhere = holder.transaction().await.unwrap();
        tokio_postgres::Transaction::execute(
            &held_elsewhere,
            "SELECT pg_advisory_xact_lock($1)",
            &[&k],
        )
        .await
        .unwrap_or_else(|e| {
            panic!("round {round}: the key stays held by an earlier round's pooled connection: {e}")
        });
        let mut conn = pool.get().await.unwrap();
        let pid = backend_pid(&mut conn).await;
        let insert = format!("INSERT INTO {table} VALUES ({round})");
        let out = conn
            .transaction::<_, Error, _>(async |conn| {
                diesel::sql_query(insert).execute(conn).await?;
                let mut tx = locker.lock_tx(conn)?;
                if cut_off {
                    let call = tx.lock(busy);
                    tokio::pin!(call);
                    tokio::select! {
                        r = &mut call => panic!("granted while held: {r:?}"),
                        () = wait_until_waiting(&observer, pid) => {}
                    }
                }
                Ok(())
            })
            .await;
        drop(conn);
        held_elsewhere.rollback().await.unwrap();
        let rows: i64 = observer
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE id = $1"),
                &[&round],
            )
            .await
            .unwrap()
            .get(0);
        match out {
            Ok(()) => assert_eq!(
                rows, 1,
                "round {round}: transaction said Ok, its row is missing"
            ),
            Err(e) => {
                assert!(cut_off, "round {round}: {e}");
                assert_eq!(rows, 0, "round {round}: failed, yet committed");
            }
        }
    }
    observer
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}

/// Drives `call` (a lock on `key` from backend `pid`) until the server makes
/// it wait for `holder`, which holds `key` in a transaction; then, without
/// polling `call` again, ends `holder`'s transaction and waits until the
/// server grants `key` to `pid`. The call's reply is then on its way,
/// unread. The 30 s deadline guards a hang and is no timing claim.
async fn granted_unread<F: Future + Unpin>(
    call: &mut F,
    observer: &tokio_postgres::Client,
    holder: &tokio_postgres::Client,
    pid: i32,
    key: lockkit::LockKey,
) where
    F::Output: std::fmt::Debug,
{
    tokio::select! {
        out = &mut *call => panic!("granted while held elsewhere: {out:?}"),
        () = wait_until_waiting(observer, pid) => {}
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !held_by(observer, pid, key).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the server never granted the key"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// `holder` takes `key` in a transaction of its own.
async fn hold(holder: &tokio_postgres::Client, key: lockkit::LockKey) {
    let lockkit::LockKey::BigInt(k) = key else {
        unreachable!("Item is a BigInt key")
    };
    holder
        .batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({k})"))
        .await
        .unwrap();
}

/// A lock call dropped after the server granted its lock, its reply unread
/// (e.g. by a `tokio::time::timeout` that fires just then): the cancel
/// request that goes out finds the session idle, and the server ignores it,
/// so nothing aborts the transaction. A closure that returns `Ok` anyway
/// must not be told its transaction committed, what it writes after the
/// cut-off must not land (outside any transaction), and the lock must not
/// stay held by the connection back in the pool: lockkit rolls the
/// transaction back at the cut-off. The control rounds (no cut-off) commit
/// their rows.
///
/// The other control is the test's premise: the same cut-off by hand, with
/// a cancel and without lockkit, leaves the key held after the backend was
/// signalled (the lock stranded that a pool would keep).
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_call_dropped_after_its_grant_neither_commits_nor_strands_its_lock() {
    use diesel_async::RunQueryDsl;

    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let observer = db.connect().await;
    let holder = db.connect().await;
    let table = lockkit_tests::scratch_table(&observer, "lockkit_da_granted_cut_off").await;

    let mut cut_offs = 0;
    for round in 1..=20_i64 {
        let cut_off = round % 2 == 1;
        let key = Item { id: 1000 + round };
        let mut conn = pool.get().await.unwrap();
        let pid = backend_pid(&mut conn).await;
        let insert = format!("INSERT INTO {table} VALUES ({round})");
        let (observer, holder) = (&observer, &holder);
        if cut_off {
            hold(holder, key.lock_key()).await;
        }
        let out = conn
            .transaction::<_, Error, _>(async |conn| {
                diesel::sql_query(insert).execute(conn).await?;
                let mut tx = locker.lock_tx(conn)?;
                if cut_off {
                    {
                        let mut call = std::pin::pin!(tx.lock(key));
                        granted_unread(&mut call, observer, holder, pid, key.lock_key()).await;
                    }
                    // What the closure still writes must not land either
                    // (e.g. outside any transaction, committed at once).
                    let after = format!("INSERT INTO {table} VALUES ({})", -round);
                    let refused = diesel::sql_query(after).execute(tx.conn()).await;
                    assert!(
                        refused.is_err(),
                        "round {round}: a write after the cut-off ran"
                    );
                } else {
                    let _ = tx.lock(key).await?;
                }
                Ok(())
            })
            .await;
        // Back to the pool, where a stranded lock would stay.
        drop(conn);
        assert!(
            released(observer, key.lock_key()).await,
            "round {round}: the key stays held by a pooled connection"
        );
        let rows: i64 = observer
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE abs(id) = $1"),
                &[&round],
            )
            .await
            .unwrap()
            .get(0);
        match out {
            Ok(()) => {
                assert!(!cut_off, "round {round}: cut off, yet reported a commit");
                assert_eq!(rows, 1, "round {round}: committed, its row is missing");
            }
            Err(e) => {
                assert!(cut_off, "round {round}: {e}");
                assert_eq!(rows, 0, "round {round}: failed, yet committed");
                cut_offs += 1;
            }
        }
    }
    assert_eq!(cut_offs, 10);

    // The control: by hand, the cancel request alone leaves the lock held.
    let mut conn =
        <diesel_async::AsyncPgConnection as diesel_async::AsyncConnection>::establish(db.url())
            .await
            .unwrap();
    let pid = backend_pid(&mut conn).await;
    let key = Item { id: 999 };
    let lockkit::LockKey::BigInt(k) = key.lock_key() else {
        unreachable!("Item is a BigInt key")
    };
    diesel_async::SimpleAsyncConnection::batch_execute(&mut conn, "BEGIN")
        .await
        .unwrap();
    hold(&holder, key.lock_key()).await;
    {
        let mut call = std::pin::pin!(diesel::sql_query(format!(
            "SELECT pg_advisory_xact_lock({k})"
        ))
        .execute(&mut conn));
        granted_unread(&mut call, &observer, &holder, pid, key.lock_key()).await;
    }
    // The cancel, as `pg_cancel_backend`: it returns once the backend is
    // signalled. (A cancel request returns once it is sent, and the server
    // may signal the backend later, during the statement below, which the
    // cancel would then abort.) The backend, idle, ignores it when it reads
    // the next statement; so the control waits for it to be idle: seen
    // granted, the lock statement may still be running, and a signal then
    // cancels it (CI saw that once: the `SELECT 1` below found the
    // transaction aborted).
    wait_until_idle_in_transaction(&observer, pid).await;
    let signalled: bool = observer
        .query_one("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(signalled);
    diesel_async::SimpleAsyncConnection::batch_execute(&mut conn, "SELECT 1")
        .await
        .unwrap();
    assert!(
        held_by(&observer, pid, key.lock_key()).await,
        "control: the cancel alone released the lock; the test above proves nothing"
    );
    drop(conn);
    assert!(released(&observer, key.lock_key()).await);
    observer
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
