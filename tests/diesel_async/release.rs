//! Every way a diesel-async transaction ends releases lockkit's locks, as
//! seen from another session; and a dropped lock future sends a cancel
//! request, so the connection is usable at once while the other holder
//! keeps its lock.

use std::time::Duration;

use diesel_async::AsyncConnection;
use lockkit_diesel_async::{AdvisoryKey, AsyncPgConnectionExt, Error, ErrorKind};
use lockkit_tests::TestServer;

use crate::common::{backend_pid, granted_elsewhere, locker, pool, released, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-release")]
struct Res {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_commit_rollback_panic_and_terminate() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2);
    let locker = locker(&pool).await;
    let observer = db.connect().await;
    for (id, commit) in [(1, true), (2, false)] {
        let key = Res { id };
        let mut conn = pool.get().await.unwrap();
        let obs = &observer;
        let out = conn
            .transaction::<_, Error, _>(async |conn| {
                let _ = conn.lock_tx(&locker)?.lock(key).await?;
                assert!(granted_elsewhere(obs, key.lock_key()).await);
                if commit {
                    Ok(())
                } else {
                    Err(Error::other("roll back"))
                }
            })
            .await;
        assert_eq!(out.is_ok(), commit);
        assert!(!granted_elsewhere(&observer, key.lock_key()).await, "{id}");
    }

    // A panic: the task's pooled connection goes back to deadpool with its
    // transaction open, still holding the lock (diesel-async cannot roll
    // back in a destructor). deadpool recycles on checkout: the next
    // checkout of that connection sees diesel-async's broken transaction
    // manager and closes it, which releases the locks.
    let key = Res { id: 3 };
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let task = {
        let (pool, locker) = (pool.clone(), locker.clone());
        tokio::spawn(async move {
            let mut conn = pool.get().await.unwrap();
            conn.transaction::<(), Error, _>(async |conn| {
                let _ = conn.lock_tx(&locker)?.lock(key).await?;
                held_tx.send(()).unwrap();
                panic!("the holder panics")
            })
            .await
        })
    };
    held_rx.await.unwrap();
    assert!(task.await.unwrap_err().is_panic());
    assert!(
        granted_elsewhere(&observer, key.lock_key()).await,
        "held in the pool"
    );
    {
        // Every connection of the pool checked out: the broken one is among
        // them, discarded, and replaced by a new one.
        let (a, b) = tokio::join!(pool.get(), pool.get());
        let (_a, _b) = (a.unwrap(), b.unwrap());
        assert!(released(&observer, key.lock_key()).await);
    }

    // pg_terminate_backend: released, and typed as a lost connection.
    let key = Res { id: 4 };
    let mut conn = pool.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let obs = &observer;
    let out = conn
        .transaction::<(), Error, _>(async |conn| {
            let mut tx = conn.lock_tx(&locker)?;
            let _ = tx.lock(key).await?;
            obs.execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .unwrap();
            assert!(released(obs, key.lock_key()).await);
            let err = tx.lock(Res { id: 5 }).await.unwrap_err();
            assert!(err.is_connection_lost(), "{err:?}");
            Err(err)
        })
        .await;
    assert!(out.is_err());
}

/// The cancel request of a dropped lock future frees the connection: the
/// transaction (poisoned) rolls back while the other session still holds
/// the key. Without the cancel request the rollback would wait for the
/// holder, which lets go only after the rollback returned.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_lock_future_is_cancelled_and_poisons() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 3);
    let locker = locker(&pool).await;
    let observer = db.connect().await;
    let key = Res { id: 10 };
    let mut holder = pool.get().await.unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let hold = {
        let locker = locker.clone();
        tokio::spawn(async move {
            holder
                .transaction::<_, Error, _>(async |conn| {
                    let _ = conn.lock_tx(&locker)?.lock(key).await?;
                    held_tx.send(()).unwrap();
                    // Let go after the other side's rollback, or after a
                    // minute (a guard against a hang, no timing claim).
                    let _ = tokio::time::timeout(Duration::from_secs(60), go_rx).await;
                    Ok(())
                })
                .await
        })
    };
    held_rx.await.unwrap();

    let mut conn = pool.get().await.unwrap();
    let pid = backend_pid(&mut conn).await;
    let obs = &observer;
    let out = conn
        .transaction::<(), Error, _>(async |conn| {
            let mut tx = conn.lock_tx(&locker)?;
            tokio::select! {
                _ = tx.lock(key) => panic!("granted while another session holds it"),
                () = wait_until_waiting(obs, pid) => {}
            }
            let err = tx.lock(Res { id: 11 }).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Poisoned, "{err}");
            Err(err)
        })
        .await;
    assert_eq!(out.unwrap_err().kind(), ErrorKind::Poisoned);
    // The rollback returned while the holder still holds the key.
    assert!(
        granted_elsewhere(&observer, key.lock_key()).await,
        "the holder still holds"
    );
    assert!(!hold.is_finished());
    go_tx.send(()).unwrap();
    hold.await.unwrap().unwrap();
    // The connection is usable and holds nothing.
    conn.transaction::<_, Error, _>(async |conn| {
        assert!(conn.lock_tx(&locker)?.try_lock(key).await?.is_ok());
        Ok(())
    })
    .await
    .unwrap();
}
