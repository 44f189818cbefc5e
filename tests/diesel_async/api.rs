//! The whole API on a real server inside diesel-async's
//! `conn.transaction(async |conn| …)`: every lock form, the
//! not-in-a-transaction refusal, tries, timeouts, savepoints, typed errors.
//! Exclusion, deadlock freedom, release, cancel and exclusion against the
//! other stacks are the conformance suite's (tests/conformance).

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, RunQueryDsl};
use lockkit_diesel_async::{AdvisoryKey, Batch, Error, ErrorKind, Mode};
use lockkit_tests::aborted::Aborting;
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
        let mut tx = locker.lock_tx(conn)?;
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
    let err = locker.lock_tx(&mut conn).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotInTransaction, "{err}");
    // Control: inside a transaction it locks.
    conn.transaction::<_, Error, _>(async |conn| {
        assert!(locker
            .lock_tx(conn)?
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
                    let mut tx = locker.lock_tx(conn)?;
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
        let mut tx = locker.lock_tx(conn)?;
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

/// The diesel-async adapter's lock methods are `#[track_caller]`: an order
/// error names the two call sites in this file (not the adapter's), and a
/// try below a held key is not refused (it does not wait; the engine's).
#[tokio::test(flavor = "multi_thread")]
async fn an_order_error_names_the_applications_call_sites_and_a_try_passes() {
    use lockkit_diesel_async::{Config, Locker, OrderCheck};
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let mut conn = pool.get().await.unwrap();
    let config = Config::default().order_check(OrderCheck::Error);
    let locker = Locker::new(&mut conn, config).await.unwrap();
    // `Pair` keys sort above every `BigInt` key.
    let (high, low) = (Slot { id: 40 }, Item { id: 40 });
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = locker.lock_tx(conn)?;
        let (_, line_held) = (tx.lock(high).await?, line!());
        assert!(tx.try_lock(low).await?.is_ok(), "a try is not refused");
        let batch = Batch::new().with(&Item { id: 39 });
        assert!(tx.try_lock_batch(&batch).await?.is_ok());
        let (err, line_asked) = (tx.lock(Item { id: 38 }).await.unwrap_err(), line!());
        assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
        let (taken_at, asked_at) = err.lock_order_sites().unwrap();
        let (taken_at, asked_at) = (taken_at.unwrap(), asked_at.unwrap());
        assert_eq!(
            (taken_at.file(), asked_at.file()),
            (file!(), file!()),
            "{err}"
        );
        assert_eq!((taken_at.line(), asked_at.line()), (line_held, line_asked));
        let err = tx
            .lock_batch_timeout(&Batch::new().with(&Item { id: 36 }), Duration::from_secs(5))
            .await
            .unwrap_err();
        let asked_at = err.lock_order_sites().unwrap().1.unwrap();
        assert_eq!(asked_at.file(), file!(), "{err}");
        Ok(())
    })
    .await
    .unwrap();
}

/// The closure form does not report a commit of a transaction that a lock
/// call's error aborted: PostgreSQL answers `COMMIT` there by rolling back,
/// which diesel-async reports as success. A closure that swallows the
/// lock's error and returns `Ok` gets `TransactionAborted`, and its write is
/// not there. The control is the same closure with a lock that is granted:
/// it commits its write.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_a_lock_error_aborted_is_not_reported_committed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let locker = locker(&pool).await;
    let busy = Item { id: 43 };
    let fixture = Aborting::new(db, "lockkit_diesel_async_aborted", busy.lock_key()).await;
    let mut conn = pool.get().await.unwrap();
    for (row, key) in [(1_i64, Item { id: 44 }), (2, busy)] {
        let insert = fixture.insert();
        let answer = locker
            .transaction(&mut conn, |tx| {
                Box::pin(async move {
                    diesel::sql_query("SET LOCAL lock_timeout = '50ms'")
                        .execute(tx.conn())
                        .await?;
                    diesel::sql_query(insert)
                        .bind::<BigInt, _>(row)
                        .execute(tx.conn())
                        .await?;
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

/// Under a timeout, every statement of the call runs bounded by it
/// (`statement_timeout`), the utility statements that guard a statement's
/// name included ([`lockkit_diesel_async`]'s savepoint before each
/// statement's `Parse`). When the timeout cuts one of those, the call is a
/// `Timeout` with nothing held, as when it cuts the lock itself: never a
/// `TransactionAborted`, the `25P02` the statements behind it then meet,
/// which would hide the cause and tell the caller its transaction was
/// already lost. 1 ms timeouts on a free key, from 8 connections at once,
/// make the timeout land on every statement of the call in turn. A
/// timeout that fires as a statement ends stays pending and cancels the
/// next message: "due to user request", and when that message is the
/// `Close` of a statement tokio-postgres dropped (diesel-async names every
/// statement), in a reply nobody reads, so that the call's next statement
/// meets `25P02`. Both are the call's timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_that_cuts_a_guarding_statement_is_a_timeout() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 16);
    let locker = locker(&pool).await;
    let tasks: Vec<_> = (0..16_i64)
        .map(|t| {
            let (pool, locker) = (pool.clone(), locker.clone());
            tokio::spawn(async move {
                let mut conn = pool.get().await.unwrap();
                let (mut held, mut timeouts) = (0, 0);
                for _ in 0..300 {
                    let item = Item { id: 7_000 + t };
                    let outcome = conn
                        .transaction::<_, Error, _>(async |conn| {
                            let mut tx = locker.lock_tx(conn)?;
                            tx.lock_timeout(item, Duration::from_millis(1))
                                .await
                                .map(drop)
                        })
                        .await;
                    match outcome {
                        Ok(()) => held += 1,
                        Err(e) if e.kind() == ErrorKind::Timeout => timeouts += 1,
                        Err(e) => return Err(format!("{:?} {:?}: {e}: {e:?}", e.kind(), e.code())),
                    }
                }
                Ok((held, timeouts))
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok((held, timeouts)) => {
                eprintln!("1 ms lock_timeout: {held} held, {timeouts} timed out")
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 16 connections saw a 1 ms lock_timeout fail otherwise than as a Timeout, first: {}",
        failures.len(),
        failures[0]
    );
}
