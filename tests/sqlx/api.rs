//! The whole API on a real server: every lock form, timeouts, tries,
//! batches, savepoints, the not-in-a-transaction refusal, typed errors.

use std::time::{Duration, Instant};

use lockkit_sqlx::{
    AdvisoryKey, Batch, Config, Error, ErrorKind, LockTx, Mode, OrderCheck, SqlxResultExt,
};
use lockkit_tests::aborted::Aborting;
use lockkit_tests::TestServer;
use sqlx::Connection;

use crate::common::{
    backend_pid, connect, granted_elsewhere, holders_elsewhere, locker, pool, wait_until_waiting,
};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-api")]
struct Item {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-api-pair", pair)]
struct Slot {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn locks_are_held_until_commit_in_every_form() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 4).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;

    let mut tx = pool.begin().await.unwrap();
    {
        let mut ltx = locker.lock_tx(&mut tx).unwrap();
        let a = ltx.lock(Item { id: 1 }).await.unwrap();
        assert_eq!((a.id, a.mode()), (1, Mode::Exclusive));
        let b = ltx.lock_shared(Slot { id: 1 }).await.unwrap();
        assert_eq!(b.mode(), Mode::Shared);
        let c = ltx
            .lock_timeout(Item { id: 2 }, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(c.id, 2);
        let _ = ltx
            .lock_shared_timeout(Slot { id: 2 }, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(ltx.try_lock(Item { id: 3 }).await.unwrap().is_ok());
        assert!(ltx.try_lock_shared(Slot { id: 3 }).await.unwrap().is_ok());
        let batch = Batch::new()
            .with(&Item { id: 10 })
            .with(&Item { id: 11 })
            .with_shared(&Slot { id: 10 });
        assert_eq!(ltx.lock_batch(&batch).await.unwrap().keys().len(), 3);
        let batch = Batch::new().with(&Item { id: 12 }).with(&Slot { id: 12 });
        let _ = ltx
            .lock_batch_timeout(&batch, Duration::from_secs(5))
            .await
            .unwrap();
        let batch = Batch::new().with(&Item { id: 13 }).with(&Slot { id: 13 });
        assert!(ltx.try_lock_batch(&batch).await.unwrap().is_ok());
        assert_eq!(ltx.held_count(), 13);
        // Queries run while the guards live.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *ltx)
            .await
            .unwrap();
        assert_eq!(one, 1);
        assert!(a.id == 1 && c.id == 2);
    }
    for key in [
        Item { id: 1 }.lock_key(),
        Slot { id: 1 }.lock_key(),
        Item { id: 2 }.lock_key(),
        Item { id: 11 }.lock_key(),
        Slot { id: 13 }.lock_key(),
    ] {
        assert!(granted_elsewhere(&observer, key).await, "{key:?}");
    }
    tx.commit().await.unwrap();
    for key in [Item { id: 1 }.lock_key(), Slot { id: 13 }.lock_key()] {
        assert!(!granted_elsewhere(&observer, key).await, "{key:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_outside_a_transaction_is_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let mut conn = connect(db).await;
    let err = locker.lock_tx(&mut conn).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotInTransaction, "{err}");
    // Control: the same connection inside a transaction locks.
    let mut tx = conn.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    assert!(ltx.try_lock(Item { id: 100 }).await.unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread")]
async fn try_and_timeout_against_another_holder() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 4).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let mut holder = pool.begin().await.unwrap();
    let mut h = locker.lock_tx(&mut holder).unwrap();
    let _ = h
        .lock_batch(&Batch::new().with(&Item { id: 20 }).with(&Slot { id: 20 }))
        .await
        .unwrap();

    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    assert_eq!(
        ltx.try_lock(Item { id: 20 }).await.unwrap().unwrap_err(),
        Item { id: 20 }
    );
    assert!(ltx.try_lock_shared(Slot { id: 20 }).await.unwrap().is_err());
    // A try-batch is all or nothing and names the busy keys.
    let batch = Batch::new()
        .with(&Item { id: 21 })
        .with(&Item { id: 20 })
        .with(&Slot { id: 20 });
    let busy = ltx.try_lock_batch(&batch).await.unwrap().unwrap_err();
    assert_eq!(busy.keys().len(), 2);
    assert_eq!(ltx.held_count(), 0);

    // A timed batch times out and leaves the transaction usable (that its
    // timeout bounds the whole call is `a_timeout_bounds_the_whole_mixed_batch`).
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let batch = Batch::new().with(&Item { id: 22 }).with(&Slot { id: 20 });
    let err = ltx.lock_batch_timeout(&batch, timeout).await.unwrap_err();
    let took = started.elapsed();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(err.timeout(), Some(timeout));
    assert!(took >= timeout, "the server waited {took:?}");
    assert!(took < Duration::from_secs(10), "bounded: {took:?}");
    assert!(!ltx.holds(&Item { id: 22 }, Mode::Exclusive));
    let err = ltx
        .lock_timeout(Item { id: 20 }, timeout)
        .await
        .unwrap_err();
    assert!(err.is_timeout());
    // Still usable: a free key is taken; the timed-out batch's free key was
    // released with its savepoint.
    assert!(ltx.lock(Item { id: 23 }).await.is_ok());
    let observer = db.connect().await;
    assert!(!granted_elsewhere(&observer, Item { id: 22 }.lock_key()).await);
    assert_eq!(
        holders_elsewhere(&observer, Item { id: 20 }.lock_key()).await,
        1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn savepoints_release_on_rollback_and_keep_on_release() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let _ = ltx.lock(Item { id: 30 }).await.unwrap();

    let out: Result<(), Error> = ltx
        .savepoint(|sp| {
            Box::pin(async move {
                assert_eq!(sp.depth(), 1);
                let _ = sp.lock(Item { id: 31 }).await?;
                Err(Error::other("roll back"))
            })
        })
        .await;
    assert!(out.is_err());
    assert!(!ltx.holds(&Item { id: 31 }, Mode::Exclusive));
    assert!(!granted_elsewhere(&observer, Item { id: 31 }.lock_key()).await);
    assert!(granted_elsewhere(&observer, Item { id: 30 }.lock_key()).await);

    ltx.savepoint(|sp| {
        Box::pin(async move {
            let _ = sp.lock_shared(Slot { id: 32 }).await?;
            Ok::<_, Error>(())
        })
    })
    .await
    .unwrap();
    assert!(ltx.holds(&Slot { id: 32 }, Mode::Shared));
    assert!(granted_elsewhere(&observer, Slot { id: 32 }.lock_key()).await);
    assert_eq!(ltx.held_count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_closure_forms_commit_and_roll_back() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    // The closure's future may not borrow its surroundings (as with sqlx's
    // own `Connection::transaction`): the observer is shared.
    let observer = std::sync::Arc::new(db.connect().await);
    let seen = locker
        .transaction(&pool, |tx| {
            let observer = std::sync::Arc::clone(&observer);
            Box::pin(async move {
                let _held = tx.lock_batch(&Batch::new().with(&Item { id: 40 })).await?;
                assert!(tx.holds(&Item { id: 40 }, Mode::Exclusive));
                Ok::<_, Error>(granted_elsewhere(&observer, Item { id: 40 }.lock_key()).await)
            })
        })
        .await
        .unwrap();
    assert!(seen);
    assert!(!granted_elsewhere(&observer, Item { id: 40 }.lock_key()).await);

    let out: Result<(), Error> = locker
        .transaction(&pool, |tx: &mut LockTx<'_>| {
            Box::pin(async move {
                let _ = tx.lock(Item { id: 41 }).await?;
                sqlx::query("SELECT 1/0")
                    .execute(tx.conn())
                    .await
                    .lock_err()?;
                Ok(())
            })
        })
        .await;
    let err = out.unwrap_err();
    assert_eq!(err.code(), Some("22012"), "{err}");
    assert!(!granted_elsewhere(&observer, Item { id: 41 }.lock_key()).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn server_errors_are_typed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 4).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let mut holder = pool.begin().await.unwrap();
    let mut h = locker.lock_tx(&mut holder).unwrap();
    let _ = h.lock(Item { id: 50 }).await.unwrap();

    // The session's own lock_timeout is a timeout (with no lockkit timeout).
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '50ms'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let err = ltx.lock(Item { id: 50 }).await.unwrap_err();
    assert!(err.is_timeout() && err.timeout().is_none(), "{err}");
    assert_eq!(err.code(), Some("55P03"));
    let err = ltx.lock(Item { id: 51 }).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
    drop(ltx);
    tx.rollback().await.unwrap();

    // pg_cancel_backend is a cancel, not a timeout.
    let mut conn = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let mut tx = conn.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let (lock, cancel) = tokio::join!(
        ltx.lock_timeout(Item { id: 50 }, Duration::from_secs(30)),
        async {
            wait_until_waiting(&observer, pid).await;
            observer
                .execute("SELECT pg_cancel_backend($1)", &[&pid])
                .await
                .unwrap();
        }
    );
    let () = cancel;
    let err = lock.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
    assert_eq!(err.code(), Some("57014"));
    // The savepoint rollback left the transaction usable.
    assert!(ltx.lock(Item { id: 52 }).await.is_ok());
}

/// `lock_batch_timeout` of a `BigInt` and a `Pair` key has one deadline for
/// the call, not a timeout per statement. The call is seen waiting for the
/// `BigInt` key at `W` (its deadline is then at most `W + T`); the `BigInt`
/// key is released at `W + 0.6 s`, the `Pair` key at `W + T + 0.3 s`.
/// Per-statement timeouts would get both (the second statement waits from
/// `W + 0.6 s` with its own `T`); one deadline times out. Load only delays
/// the releases, which can only make the call time out.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_bounds_the_whole_mixed_batch() {
    const T: Duration = Duration::from_secs(1);
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 4).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let (item, slot) = (Item { id: 60 }, Slot { id: 60 });
    let mut holder_big = pool.begin().await.unwrap();
    let _ = locker
        .lock_tx(&mut holder_big)
        .unwrap()
        .lock(item)
        .await
        .unwrap();
    let mut holder_pair = pool.begin().await.unwrap();
    let _ = locker
        .lock_tx(&mut holder_pair)
        .unwrap()
        .lock(slot)
        .await
        .unwrap();

    let mut conn = pool.acquire().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let mut tx = conn.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let batch = Batch::new().with(&item).with(&slot);
    let (result, ()) = tokio::join!(ltx.lock_batch_timeout(&batch, T), async {
        wait_until_waiting(&observer, pid).await;
        let seen = Instant::now();
        tokio::time::sleep(Duration::from_millis(600)).await;
        holder_big.rollback().await.unwrap();
        tokio::time::sleep((T + Duration::from_millis(300)).saturating_sub(seen.elapsed())).await;
        holder_pair.rollback().await.unwrap();
    });
    let err = result.expect_err("the whole batch is bounded by one timeout");
    assert!(err.is_timeout(), "{err}");
    assert_eq!(err.timeout(), Some(T));
    assert!(!ltx.holds(&item, Mode::Exclusive));
    assert!(!granted_elsewhere(&observer, item.lock_key()).await);
}

/// The sqlx adapter's lock methods are `#[track_caller]`: an order error
/// names the two call sites in this file (not the adapter's), and a try
/// below a held key is not refused (it does not wait; the engine's).
#[tokio::test(flavor = "multi_thread")]
async fn an_order_error_names_the_applications_call_sites_and_a_try_passes() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Error)).await;
    // `Pair` keys sort above every `BigInt` key.
    let (high, low) = (Slot { id: 40 }, Item { id: 40 });
    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let (_, line_held) = (ltx.lock(high).await.unwrap(), line!());
    assert!(
        ltx.try_lock(low).await.unwrap().is_ok(),
        "a try is not refused"
    );
    let batch = Batch::new().with(&Item { id: 39 });
    assert!(ltx.try_lock_batch(&batch).await.unwrap().is_ok());
    let (err, line_asked) = (ltx.lock(Item { id: 38 }).await.unwrap_err(), line!());
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    let (taken_at, asked_at) = err.lock_order_sites().unwrap();
    let (taken_at, asked_at) = (taken_at.unwrap(), asked_at.unwrap());
    assert_eq!(
        (taken_at.file(), asked_at.file()),
        (file!(), file!()),
        "{err}"
    );
    assert_eq!((taken_at.line(), asked_at.line()), (line_held, line_asked));
    let err = ltx
        .lock_batch(&Batch::new().with(&Item { id: 36 }))
        .await
        .unwrap_err();
    assert_eq!(err.lock_order_sites().unwrap().1.unwrap().file(), file!());
    let err = ltx
        .lock_timeout(Item { id: 37 }, Duration::from_secs(5))
        .await
        .unwrap_err();
    let asked_at = err.lock_order_sites().unwrap().1.unwrap();
    assert_eq!(asked_at.file(), file!(), "{err}");
    drop(ltx);
    tx.rollback().await.unwrap();
}

/// The closure form does not report a commit of a transaction that a lock
/// call's error aborted: PostgreSQL answers `COMMIT` there by rolling back,
/// which sqlx reports as success. A closure that swallows the lock's error
/// and returns `Ok` gets `TransactionAborted`, and its write is not there.
/// The control is the same closure with a lock that is granted: it commits
/// its write.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_a_lock_error_aborted_is_not_reported_committed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1).await;
    let locker = locker(&pool, Config::default()).await;
    let busy = Item { id: 43 };
    let fixture = Aborting::new(db, "lockkit_sqlx_aborted", busy.lock_key()).await;
    for (row, key) in [(1_i64, Item { id: 44 }), (2, busy)] {
        let insert = fixture.insert();
        let answer = locker
            .transaction(&pool, |tx| {
                Box::pin(async move {
                    sqlx::query("SET LOCAL lock_timeout = '50ms'")
                        .execute(tx.conn())
                        .await
                        .lock_err()?;
                    sqlx::query(&insert)
                        .bind(row)
                        .execute(tx.conn())
                        .await
                        .lock_err()?;
                    // Swallowed: the closure returns Ok.
                    if let Err(e) = tx.lock(key).await {
                        assert!(e.is_timeout(), "{e}");
                    }
                    Ok(())
                })
            })
            .await;
        fixture.check(row, key == busy, answer).await;
    }
    fixture.finish().await;
}

/// A savepoint (lockkit's, inside sqlx's own transaction) whose lock call's
/// error aborted it is rolled back when its closure returns `Ok`, which
/// gets `TransactionAborted`; the transaction goes on, and its commit keeps
/// the writes made outside the savepoint, not the one inside.
#[tokio::test(flavor = "multi_thread")]
async fn a_savepoint_a_lock_error_aborted_is_rolled_back_and_the_transaction_goes_on() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1).await;
    let locker = locker(&pool, Config::default()).await;
    let busy = Item { id: 45 };
    let fixture = Aborting::new(db, "lockkit_sqlx_sp_aborted", busy.lock_key()).await;
    let insert = fixture.insert();
    let mut tx = pool.begin().await.unwrap();
    let mut ltx = locker.lock_tx(&mut tx).unwrap();
    let write = |row: i64| sqlx::query(&insert).bind(row);
    write(1).execute(ltx.conn()).await.unwrap();
    let inside = fixture.insert();
    let answer: Result<(), Error> = ltx
        .savepoint(|sp| {
            Box::pin(async move {
                sqlx::query("SET LOCAL lock_timeout = '50ms'")
                    .execute(sp.conn())
                    .await
                    .lock_err()?;
                sqlx::query(&inside)
                    .bind(2_i64)
                    .execute(sp.conn())
                    .await
                    .lock_err()?;
                // Swallowed: the closure returns Ok.
                if let Err(e) = sp.lock(busy).await {
                    assert!(e.is_timeout(), "{e}");
                }
                Ok(())
            })
        })
        .await;
    let err = answer.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
    write(3).execute(ltx.conn()).await.unwrap();
    drop(ltx);
    tx.commit().await.unwrap();
    assert_eq!(fixture.ids().await, [1, 3]);
    fixture.finish().await;
}

/// The closure form does not report a commit after a lock call that was
/// cut off while the server waited (its future dropped, here by
/// `select!`): sqlx sends no cancel request, so the statement goes on
/// waiting after the drop, and here another session cancels it, which
/// aborts the transaction where lockkit never reads the reply. The commit
/// must not say Ok for a write that is not there: the closure form refuses
/// to commit a transaction whose lock call was cut off in flight
/// ([`ErrorKind::Poisoned`], as tokio-postgres's `LockTx::commit` refuses)
/// and rolls it back, past the dropped statement's stale answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_whose_lock_call_was_cut_off_is_not_reported_committed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1).await;
    let locker = locker(&pool, Config::default()).await;
    let busy = Item { id: 46 };
    let fixture = Aborting::new(db, "lockkit_sqlx_cut_off", busy.lock_key()).await;
    let observer = std::sync::Arc::new(db.connect().await);
    let insert = fixture.insert();
    let answer: Result<(), Error> = locker
        .transaction(&pool, |tx| {
            Box::pin(async move {
                let pid = backend_pid(tx.conn()).await;
                sqlx::query(&insert)
                    .bind(1_i64)
                    .execute(tx.conn())
                    .await
                    .lock_err()?;
                let call = tx.lock(busy);
                tokio::pin!(call);
                tokio::select! {
                    r = &mut call => panic!("granted while held: {r:?}"),
                    () = wait_until_waiting(&observer, pid) => {}
                }
                // Cut off; the statement still waits for the key, until
                // the cancel (the holder keeps it throughout).
                observer
                    .execute("SELECT pg_cancel_backend($1)", &[&pid])
                    .await
                    .unwrap();
                Ok(())
            })
        })
        .await;
    let ids = fixture.ids().await;
    let err = answer.expect_err("the transaction was aborted after the drop");
    assert_eq!(err.kind(), ErrorKind::Poisoned, "{err}");
    assert!(err.to_string().contains("not committed"), "{err}");
    assert!(ids.is_empty(), "refused, yet committed: {ids:?}");
    fixture.finish().await;
}

/// A pool that hands out no connection within its `acquire_timeout` is a
/// bounded wait that ran out, with nothing sent and nothing held:
/// `ErrorKind::Timeout` (retryable), not a bare database error.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_that_hands_out_no_connection_in_time_is_a_timeout() {
    let db = TestServer::shared();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(200))
        .connect(db.url())
        .await
        .unwrap();
    let locker = locker(&pool, Config::default()).await;
    let _busy = pool.acquire().await.unwrap();
    let e: Error = locker
        .transaction(&pool, |tx| {
            Box::pin(async move { tx.lock(Item { id: 77_001 }).await.map(drop) })
        })
        .await
        .expect_err("the pool's one connection is taken");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e:?}");
    assert!(e.is_timeout() && e.is_transient(), "{e:?}");
    // Said as what it is: no lock was waited for, nothing was aborted.
    let text = e.to_string();
    assert!(text.contains("the pool handed out no connection"), "{text}");
    assert!(!text.contains("lock_timeout"), "{text}");
}
