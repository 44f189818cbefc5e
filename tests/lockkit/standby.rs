//! Hot standbys: locks there exclude nothing on the primary, so lockkit
//! refuses them unless told otherwise.

use std::time::Duration;

use lockkit::ErrorKind;
use lockkit::{AdvisoryKey, Batch, Config};
use lockkit_tests::support::assert_standby;
use lockkit_tests::TestServer;

use crate::common::{advisory_rows, backend_pid, granted_elsewhere, held_by, locker};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.standby")]
struct Key {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn standby_is_refused_unless_allowed() {
    let primary = TestServer::builder().start();
    let _log = primary.guard();
    let standby = primary.standby();
    let _standby_log = standby.guard();
    let mut s = standby.connect().await;
    let standby_observer = standby.connect().await;
    let mut p = primary.connect().await;
    let primary_observer = primary.connect().await;
    let pid = backend_pid(&s).await;
    let k = Key { id: 1 };

    let refusing = locker(&s, Config::default()).await;
    assert!(refusing.policy().facts().in_recovery());
    let tx = refusing.begin(&mut s).await.unwrap();
    assert_standby(tx.lock(k).await, "lock");
    assert_standby(tx.lock_shared(k).await, "lock_shared");
    assert_standby(tx.try_lock(k).await, "try_lock");
    assert_standby(tx.try_lock_shared(k).await, "try_lock_shared");
    assert_standby(
        tx.lock_timeout(k, Duration::from_millis(100)).await,
        "lock_timeout",
    );
    let batch = Batch::new().with(&k).with(&Key { id: 2 });
    assert_standby(tx.lock_batch(&batch).await, "lock_batch");
    assert_standby(tx.try_lock_batch(&batch).await, "try_lock_batch");
    assert!(!ErrorKind::HotStandby.is_transient());
    assert_eq!(advisory_rows(&standby_observer, pid).await, 0);
    // Nothing was sent, so the transaction is fine.
    let in_recovery: bool = tx
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(in_recovery);
    tx.rollback().await.unwrap();

    // Allowed: the lock is taken on the standby, and only there.
    let allowing = locker(&s, Config::default().allow_standby(true)).await;
    let tx = allowing.begin(&mut s).await.unwrap();
    let held = tx.lock(k).await.unwrap();
    let _ = tx.lock_batch(&batch).await.unwrap();
    assert!(held_by(&standby_observer, pid, held.key()).await);
    assert_eq!(advisory_rows(&standby_observer, pid).await, 2);
    assert!(!granted_elsewhere(&primary_observer, held.key()).await);
    let on_primary = locker(&p, Config::default()).await;
    assert!(!on_primary.policy().facts().in_recovery());
    let ptx = on_primary.begin(&mut p).await.unwrap();
    assert!(
        ptx.try_lock(k).await.unwrap().is_ok(),
        "a standby's lock excludes nothing on the primary"
    );
    ptx.rollback().await.unwrap();
    // Control: on the standby itself it does exclude.
    let mut s2 = standby.connect().await;
    let stx = allowing.begin(&mut s2).await.unwrap();
    assert!(stx.try_lock(k).await.unwrap().is_err());
    stx.rollback().await.unwrap();
    drop(held);
    tx.commit().await.unwrap();
}
