//! Every way a `LockTx` ends releases its locks, as seen from another
//! session: commit, rollback, drop, a panicking task, a terminated backend,
//! a server restart. And the PostgreSQL fact the API guards against: an
//! xact lock taken outside a transaction is not held afterwards.

use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config, LockKey};
use lockkit_tests::TestServer;
use tokio::sync::oneshot;
use tokio_postgres::Client;

use crate::common::{advisory_rows, backend_pid, granted_elsewhere, held_by, locker};

/// A key type of this module's own, so no other test holds these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/release")]
struct Res {
    id: i64,
}

/// Waits until no other session holds `key`, per `pg_locks`. Used where the
/// release happens in the server asynchronously to the test (a session that
/// ends); the deadline guards a hang and is no timing claim.
async fn released(observer: &Client, key: LockKey) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if !granted_elsewhere(observer, key).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Whether a new transaction on `client` can take `key` without waiting.
async fn free_for(client: &mut Client, key: Res) -> bool {
    let locker = locker(client, Config::default()).await;
    let tx = locker.begin(client).await.unwrap();
    let free = tx.try_lock(key).await.unwrap().is_ok();
    tx.rollback().await.unwrap();
    free
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 1 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(granted_elsewhere(&b, key.lock_key()).await);
    assert!(!free_for(&mut b, key).await, "held before commit");
    tx.commit().await.unwrap();
    assert!(!granted_elsewhere(&b, key.lock_key()).await);
    assert!(free_for(&mut b, key).await, "released by commit");
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_rollback() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 2 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(!free_for(&mut b, key).await, "held before rollback");
    tx.rollback().await.unwrap();
    assert!(!granted_elsewhere(&b, key.lock_key()).await);
    assert!(free_for(&mut b, key).await, "released by rollback");
}

#[tokio::test(flavor = "multi_thread")]
async fn released_when_dropped_and_client_still_usable() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 3 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(!free_for(&mut b, key).await, "held before the drop");
    drop(tx);
    // tokio-postgres queued a ROLLBACK on drop; the client's next statement
    // runs after it, so from here on the release is a fact.
    let pid: i32 = a
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("the client is usable after dropping a LockTx")
        .get(0);
    let state: String = b
        .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "idle", "the dropped transaction was rolled back");
    assert!(!granted_elsewhere(&b, key.lock_key()).await);
    assert!(free_for(&mut b, key).await, "released by the drop");
    // And the same client can lock again.
    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(granted_elsewhere(&b, key.lock_key()).await);
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn released_when_holding_task_panics() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut b = db.connect().await;
    let holder = db.connect().await;
    let locker = locker(&holder, Config::default()).await;
    let key = Res { id: 4 };

    let (held_tx, held_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut holder = holder;
        let tx = locker.begin(&mut holder).await.unwrap();
        let _held = tx.lock(key).await.unwrap();
        held_tx.send(()).unwrap();
        let _ = go_rx.await;
        // Unwinding drops the guard, the LockTx and the client.
        panic!("deliberate panic while holding an advisory lock (expected by this test)");
    });
    held_rx.await.expect("the holder got the lock");
    assert!(granted_elsewhere(&b, key.lock_key()).await);
    assert!(!free_for(&mut b, key).await, "held before the panic");
    go_tx.send(()).unwrap();
    let err = task.await.unwrap_err();
    assert!(err.is_panic(), "{err}");
    assert!(
        released(&b, key.lock_key()).await,
        "still held after the holding task panicked"
    );
    assert!(free_for(&mut b, key).await, "released by the panic");
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_terminate_backend() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 5 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!free_for(&mut b, key).await, "held before the terminate");
    let terminated: bool = b
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    assert!(
        released(&b, key.lock_key()).await,
        "still held after pg_terminate_backend"
    );
    assert!(free_for(&mut b, key).await, "released by the terminate");

    let err = tx.lock(Res { id: 6 }).await.unwrap_err();
    println!("holder's next call: {err} ({:?}): {:?}", err.code(), err);
    assert!(err.is_connection_lost(), "{err} ({:?})", err.code());
    drop(tx);
    assert!(a.is_closed());
}

#[tokio::test(flavor = "multi_thread")]
async fn released_on_server_restart() {
    let db = TestServer::builder().start();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 7 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(!free_for(&mut b, key).await, "held before the restart");
    drop(b);

    // `restart` blocks this thread until the server is back.
    tokio::task::block_in_place(|| db.restart());

    let err = tx.lock(Res { id: 8 }).await.unwrap_err();
    println!("holder's next call: {err} ({:?}): {:?}", err.code(), err);
    assert!(err.is_connection_lost(), "{err} ({:?})", err.code());
    drop(tx);

    let mut c = db.connect().await;
    assert!(!granted_elsewhere(&c, key.lock_key()).await);
    assert!(free_for(&mut c, key).await, "released by the restart");
}

/// Locks outside a transaction cannot be taken through lockkit: every lock
/// method is on `LockTx`, whose only constructors are `Locker::begin` (which
/// sends `BEGIN`) and `Locker::wrap` (which takes an open
/// `tokio_postgres::Transaction`); `LockTx::new` is crate-private and
/// `Locker` has no lock method of its own, so "lock in autocommit" does not
/// compile. This test shows the PostgreSQL behaviour that design rules out:
/// `pg_advisory_xact_lock` in autocommit returns as if it locked, and holds
/// nothing once the statement ends.
#[tokio::test(flavor = "multi_thread")]
async fn autocommit_xact_lock_is_silently_released() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let key = Res { id: 9 };
    let LockKey::BigInt(raw) = key.lock_key() else {
        unreachable!("Res is a BigInt key")
    };

    // Autocommit: the call succeeds...
    a.execute("SELECT pg_advisory_xact_lock($1)", &[&raw])
        .await
        .unwrap();
    // ...and nothing is held afterwards.
    assert!(!granted_elsewhere(&b, key.lock_key()).await);
    assert!(free_for(&mut b, key).await, "autocommit lock is not held");

    // The same SQL inside a transaction is held until it ends, so the
    // checks above can fail.
    let tx = a.transaction().await.unwrap();
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&raw])
        .await
        .unwrap();
    assert!(granted_elsewhere(&b, key.lock_key()).await);
    assert!(!free_for(&mut b, key).await, "held inside a transaction");
    tx.rollback().await.unwrap();
    assert!(free_for(&mut b, key).await);
}

/// The refinement the README states: a statement that fails aborts the
/// transaction, and its advisory locks are released at that moment, before
/// the `ROLLBACK`, as another session sees in `pg_locks` while the first is
/// still in its aborted transaction block.
#[tokio::test(flavor = "multi_thread")]
async fn released_when_an_error_aborts_the_transaction_before_rollback() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, observer) = (db.connect().await, db.connect().await);
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default()).await;
    let key = Res { id: 10 };

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(key).await.unwrap();
    assert!(
        held_by(&observer, pid, key.lock_key()).await,
        "held before the error"
    );
    let err = tx.execute("SELECT 1 / 0", &[]).await.unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("22012"), "{err}");
    // Still inside the (aborted) transaction block: no ROLLBACK was sent…
    // (the error reaches the client before the backend reports its new
    // state, so wait for the state, up to 30 s)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let state: String = observer
            .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .unwrap()
            .get(0);
        if state == "idle in transaction (aborted)" {
            break;
        }
        assert_eq!(
            state, "active",
            "the session can only be finishing the failed statement"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "never reached the aborted state"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // …and the lock is gone already.
    assert!(
        !held_by(&observer, pid, key.lock_key()).await,
        "held after the abort"
    );
    assert_eq!(advisory_rows(&observer, pid).await, 0);
    tx.rollback().await.unwrap();
}
