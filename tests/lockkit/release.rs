//! Releases beyond the conformance suite (tests/conformance: commit,
//! rollback, drop, panic and `pg_terminate_backend` on every stack): a
//! server restart, and a statement error that aborts the transaction. And
//! the PostgreSQL fact the API guards against: an xact lock taken outside a
//! transaction is not held afterwards.

use lockkit::{AdvisoryKey, Config, LockKey};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use crate::common::{advisory_rows, backend_pid, granted_elsewhere, held_by, locker};

/// A key type of this module's own, so no other test holds these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/release")]
struct Res {
    id: i64,
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
/// sends `BEGIN`) and `Locker::lock_tx` (which takes an open
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
