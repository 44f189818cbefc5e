//! What Diesel's transactions do with lockkit's locks beyond the
//! conformance suite (tests/conformance, which covers commit, rollback,
//! panic and terminate in `Locker::transaction`): the closure's own error
//! passed through, Diesel's own `conn.transaction` (on errors and panics),
//! r2d2-pooled connections, reuse after a panic, and no lock outside a
//! transaction.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;

use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::{sql_query, Connection, PgConnection, RunQueryDsl};
use lockkit::ErrorKind;
use lockkit::{AdvisoryKey, LockKey};
use lockkit_diesel::{Config, Error, Locker};
use lockkit_tests::TestServer;

use crate::common::{connect, granted_elsewhere, locker, pool, released};

/// A key type of this module's own, so no other test holds these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-release")]
struct Res {
    id: i64,
}

fn setup(db: &TestServer) -> (PgConnection, PgConnection, Locker) {
    let mut a = connect(db);
    let observer = connect(db);
    let locker = locker(&mut a, Config::default());
    (a, observer, locker)
}

#[test]
fn released_on_err_from_the_closure() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, locker) = setup(db);
    let key = Res { id: 2 };
    let err = locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(key)?;
            assert!(granted_elsewhere(&mut observer, key.lock_key()));
            Err::<(), _>(Error::from(diesel::result::Error::RollbackTransaction))
        })
        .unwrap_err();
    assert!(
        (err.kind() == ErrorKind::Database && err.code().is_none()),
        "{err}"
    );
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
}

#[test]
fn released_on_rollback_in_diesels_own_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, locker) = setup(db);
    let key = Res { id: 3 };
    let result = a.transaction::<(), Error, _>(|conn| {
        let mut tx = locker.lock_tx(conn)?;
        let _ = tx.lock(key)?;
        assert!(granted_elsewhere(&mut observer, key.lock_key()));
        Err(diesel::result::Error::RollbackTransaction.into())
    });
    assert!(result.is_err());
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
    // And on commit.
    a.transaction::<(), Error, _>(|conn| {
        let mut tx = locker.lock_tx(conn)?;
        let _ = tx.lock(key)?;
        assert!(granted_elsewhere(&mut observer, key.lock_key()));
        Ok(())
    })
    .unwrap();
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
}

#[test]
fn released_on_panic_and_connection_reusable() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, locker) = setup(db);
    let key = Res { id: 4 };
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        locker.transaction(&mut a, |tx| {
            let _ = tx.lock(key)?;
            assert!(granted_elsewhere(&mut observer, key.lock_key()));
            if key.id == 4 {
                panic!("boom");
            }
            Ok::<_, Error>(())
        })
    }));
    assert!(panicked.is_err(), "the panic resumes");
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
    // The transaction was rolled back: the connection is outside any
    // transaction again, so lock_tx refuses it…
    assert!(locker
        .lock_tx(&mut a)
        .is_err_and(|e| e.kind() == ErrorKind::NotInTransaction));
    // …and a new transaction is a real one, not a savepoint of a leftover.
    locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(key)?;
            Ok::<_, Error>(())
        })
        .unwrap();
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
}

/// A panic inside Diesel's own `conn.transaction` on a pooled connection:
/// Diesel leaves the transaction open, r2d2 discards the connection as
/// broken, and the server releases the locks with the session.
#[test]
fn released_on_panic_in_diesels_transaction_on_a_pooled_connection() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 1);
    let mut observer = connect(db);
    let locker = locker(&mut pool.get().unwrap(), Config::default());
    let key = Res { id: 5 };
    let (locked_tx, locked_rx) = mpsc::channel();
    let worker = std::thread::spawn({
        let pool = pool.clone();
        let locker = locker.clone();
        move || {
            let mut conn = pool.get().unwrap();
            let _ = conn.transaction::<(), Error, _>(|conn| {
                let mut tx = locker.lock_tx(conn)?;
                let _ = tx.lock(key)?;
                locked_tx.send(()).unwrap();
                panic!("boom");
            });
        }
    });
    locked_rx.recv().expect("the worker locked the key");
    assert!(worker.join().is_err(), "the worker panicked");
    assert!(
        released(&mut observer, key.lock_key()),
        "the discarded connection's lock is released"
    );
    // The pool replaced the connection with a usable one.
    locker
        .transaction(&mut pool.get().unwrap(), |tx| {
            let _ = tx.lock(key)?;
            Ok::<_, Error>(())
        })
        .unwrap();
}

/// The difference documented on `lock_tx`: on a connection that survives a
/// panic in Diesel's own `transaction`, Diesel did not roll back, so the
/// lock is still held until that transaction ends.
#[test]
fn diesels_transaction_keeps_the_transaction_open_on_panic() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, locker) = setup(db);
    let key = Res { id: 6 };
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        a.transaction::<(), Error, _>(|conn| {
            let mut tx = locker.lock_tx(conn)?;
            let _ = tx.lock(key)?;
            panic!("boom");
        })
    }));
    assert!(panicked.is_err());
    assert!(granted_elsewhere(&mut observer, key.lock_key()));
    a.batch_execute("ROLLBACK").unwrap();
    assert!(!granted_elsewhere(&mut observer, key.lock_key()));
}

#[test]
fn no_lock_outside_a_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, locker) = setup(db);
    let err = locker.lock_tx(&mut a).unwrap_err();
    assert!(err.kind() == ErrorKind::NotInTransaction, "{err}");
    let pooled = pool(db, 1);
    let err = locker.lock_tx(&mut pooled.get().unwrap()).unwrap_err();
    assert!(err.kind() == ErrorKind::NotInTransaction, "{err}");
    // Inside Diesel's transaction on a pooled connection, it works.
    pooled
        .get()
        .unwrap()
        .transaction::<(), Error, _>(|conn| {
            let mut tx = locker.lock_tx(conn)?;
            let _ = tx.lock(Res { id: 7 })?;
            assert!(granted_elsewhere(&mut observer, Res { id: 7 }.lock_key()));
            Ok(())
        })
        .unwrap();
    assert!(!granted_elsewhere(&mut observer, Res { id: 7 }.lock_key()));
}

/// Control: the PostgreSQL fact the refusal guards against. An xact lock
/// taken outside a transaction is released when its statement ends.
#[test]
fn control_autocommit_xact_lock_is_not_held() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer, _) = setup(db);
    let LockKey::BigInt(k) = Res { id: 8 }.lock_key() else {
        unreachable!("Res is a BigInt key")
    };
    sql_query("SELECT pg_advisory_xact_lock($1)")
        .bind::<BigInt, _>(k)
        .execute(&mut a)
        .unwrap();
    assert!(!granted_elsewhere(&mut observer, LockKey::BigInt(k)));
    // While the same statement inside a transaction does hold it.
    a.transaction::<(), diesel::result::Error, _>(|conn| {
        sql_query("SELECT pg_advisory_xact_lock($1)")
            .bind::<BigInt, _>(k)
            .execute(conn)?;
        assert!(granted_elsewhere(&mut observer, LockKey::BigInt(k)));
        Ok(())
    })
    .unwrap();
}
