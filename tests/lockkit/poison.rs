//! Cancellation: a dropped lock future poisons its transaction, because the
//! server may still grant what it asked for; concurrent lock calls on one
//! transaction are refused.

use std::time::Duration;

use lockkit::{AdvisoryKey, Batch, Config, Error};
use lockkit_tests::TestServer;

use crate::common::{
    advisory_rows, backend_pid, held_by, locker, wait_until_held, wait_until_waiting,
};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.poison")]
struct Key {
    id: i64,
}

fn assert_poisoned<T>(result: Result<T, Error>, what: &str) {
    match result {
        Err(Error::Poisoned) => {}
        Err(other) => panic!("{what}: expected Poisoned, got {other}"),
        Ok(_) => panic!("{what}: expected Poisoned, got Ok"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dropped_lock_future_poisons_until_the_transaction_ends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default()).await;
    let (busy, held, fresh) = (Key { id: 1 }, Key { id: 2 }, Key { id: 3 });

    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(busy).await.unwrap();

    let mut tx = locker.begin(&mut b).await.unwrap();
    let _ = tx.lock(held).await.unwrap();
    {
        // Drop the lock future once the server shows it waiting: the
        // statement was sent and still waits there.
        let lock = tx.lock(busy);
        tokio::pin!(lock);
        tokio::select! {
            got = &mut lock => panic!("granted while held: {:?}", got.map(|h| h.key())),
            () = wait_until_waiting(&observer, pid) => {}
        }
    }

    assert_poisoned(tx.lock(fresh).await, "lock");
    assert_poisoned(tx.lock(held).await, "relock of a held key");
    assert_poisoned(tx.lock_shared(fresh).await, "lock_shared");
    assert_poisoned(tx.try_lock(fresh).await, "try_lock");
    assert_poisoned(tx.try_lock_shared(fresh).await, "try_lock_shared");
    assert_poisoned(
        tx.lock_timeout(fresh, Duration::from_millis(10)).await,
        "lock_timeout",
    );
    let batch = Batch::new().with(&fresh).with(&Key { id: 4 });
    assert_poisoned(tx.lock_batch(&batch).await, "lock_batch");
    assert_poisoned(tx.try_lock_batch(&batch).await, "try_lock_batch");
    assert!(!held_by(&observer, pid, fresh.lock_key()).await);

    // The reason: once the holder lets go, the server grants the abandoned
    // request to this transaction, which lockkit could not have recorded.
    holder.rollback().await.unwrap();
    wait_until_held(&observer, pid, busy.lock_key()).await;
    assert_poisoned(tx.lock(busy).await, "lock of the granted key");
    {
        let sp = tx.savepoint().await.unwrap();
        assert_poisoned(sp.lock(fresh).await, "lock in a savepoint");
        sp.rollback().await.unwrap();
    }
    assert_poisoned(tx.lock(fresh).await, "lock after a savepoint rollback");
    assert!(held_by(&observer, pid, busy.lock_key()).await);

    // Rollback ends it; the same client starts clean.
    tx.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
    let tx = locker.begin(&mut b).await.unwrap();
    let _ = tx.lock(busy).await.unwrap();
    let _ = tx.lock(fresh).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 2);
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_lock_calls_on_one_transaction_are_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&a, Config::default()).await;
    let (k1, k2) = (Key { id: 11 }, Key { id: 12 });

    // Both futures polled together: the first is sent, the second is
    // refused without sending, and the first completes. The first waits for
    // a holder, so it is certainly still in flight when the second is polled
    // (a lock that is granted at once could complete within its first poll
    // on a loaded machine, and then the second would rightly go ahead).
    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(k1).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let (r1, r2, ()) = tokio::join!(biased; tx.lock(k1), tx.lock(k2), async {
        wait_until_waiting(&observer, pid).await;
        holder.rollback().await.unwrap();
    });
    let ok = r1.expect("the first lock call is sent and granted").key();
    let refused = r2.expect_err("the second lock call is refused");
    assert!(matches!(refused, Error::LockInFlight), "{refused}");
    assert_eq!(advisory_rows(&observer, pid).await, 1);
    assert!(held_by(&observer, pid, ok).await);
    // Nothing was left in flight: the transaction goes on.
    let _ = tx.lock(k1).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 2);
    tx.rollback().await.unwrap();

    // With try_join the refusal drops the other future mid-flight, which
    // poisons the transaction.
    let (k3, k4) = (Key { id: 13 }, Key { id: 14 });
    let holder = locker.begin(&mut a).await.unwrap();
    let _ = holder.lock(k3).await.unwrap();
    let tx = locker.begin(&mut b).await.unwrap();
    let err = tokio::try_join!(tx.lock(k3), tx.lock(k4)).unwrap_err();
    assert!(matches!(err, Error::LockInFlight), "{err}");
    assert_poisoned(tx.lock(Key { id: 15 }).await, "lock after try_join");
    holder.rollback().await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
}
