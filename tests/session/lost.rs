//! `SessionGuard::lost()` resolves within one keepalive cadence (plus a
//! generous margin for a loaded machine) after the lock's backend is
//! terminated and after a server restart: directly, from a deadpool pool,
//! and through transaction- and session-mode pgbouncer. A held lock runs
//! under its own lease, whatever the server's
//! `idle_in_transaction_session_timeout`. On a connection lockkit opened,
//! `lost()` does not wait for the keepalive; a dropped guard gives a
//! pooled connection back.

use std::time::Duration;

use lockkit::pg::{SessionForm, SessionGuard};
use lockkit::{AdvisoryKey, SessionLock};
use lockkit_tests::{PgBouncer, TestServer};

use crate::pooler::pool_of;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-lost")]
struct Duty {
    id: i64,
}

/// The keepalive cadence of these tests.
const CADENCE: Duration = Duration::from_secs(2);
/// Slack on top of one cadence: the claim is "within one cadence"; the
/// margin only absorbs a loaded CI machine.
const MARGIN: Duration = Duration::from_secs(5);

/// Every way to reach the server, each with its own session locks.
struct Paths {
    _bouncers: (PgBouncer, PgBouncer),
    locks: Vec<(&'static str, SessionLock)>,
}

fn paths(db: &TestServer, cadence: Duration) -> Paths {
    let transaction = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(3)
        .start();
    let session = PgBouncer::builder(db)
        .pool_mode("session")
        .default_pool_size(10)
        .start();
    let locks = vec![
        ("direct", SessionLock::new(db.config())),
        (
            "direct, pool",
            SessionLock::from_pool(pool_of(db.config(), 2)),
        ),
        (
            "transaction pgbouncer",
            SessionLock::new(transaction.config()),
        ),
        (
            "transaction pgbouncer, pool",
            SessionLock::from_pool(pool_of(transaction.config(), 2)),
        ),
        ("session pgbouncer", SessionLock::new(session.config())),
    ];
    Paths {
        _bouncers: (transaction, session),
        locks: locks
            .into_iter()
            .map(|(name, lock)| (name, lock.keepalive(cadence)))
            .collect(),
    }
}

/// One lock per path, on keys `base + i`.
async fn hold_all(paths: &Paths, base: i64) -> Vec<(&'static str, SessionGuard<Duty>)> {
    let mut guards = Vec::new();
    for (i, (name, sessions)) in paths.locks.iter().enumerate() {
        let guard = sessions
            .lock(Duty {
                id: base + i as i64,
            })
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(guard.is_held(), "{name}");
        guards.push((*name, guard));
    }
    guards
}

async fn expect_lost(guards: &[(&'static str, SessionGuard<Duty>)], bound: Duration) {
    for (name, guard) in guards {
        tokio::time::timeout(bound, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: lost() did not resolve within {bound:?}"));
        assert!(!guard.is_held(), "{name}");
    }
}

/// The keys are free again: another session takes each.
async fn expect_free(db: &TestServer, guards: &[(&'static str, SessionGuard<Duty>)]) {
    let direct = SessionLock::new(db.config());
    for (name, guard) in guards {
        let again = direct
            .lock_timeout(*guard.value(), Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{name}: the key is not free: {e}"));
        assert!(again.release().await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn lost_after_pg_terminate_backend() {
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let paths = paths(&db, CADENCE);
    let guards = hold_all(&paths, 0).await;
    // Not lost while held.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), guards[0].1.lost())
            .await
            .is_err()
    );
    for (name, guard) in &guards {
        let killed: bool = observer
            .query_one("SELECT pg_terminate_backend($1)", &[&guard.backend_pid()])
            .await
            .unwrap()
            .get(0);
        assert!(killed, "{name}");
    }
    expect_lost(&guards, CADENCE + MARGIN).await;
    expect_free(&db, &guards).await;
    for (name, guard) in guards {
        assert!(
            guard.release().await.unwrap_err().is_connection_lost(),
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn lost_after_a_server_restart() {
    let db = TestServer::builder().start();
    let paths = paths(&db, CADENCE);
    let guards = hold_all(&paths, 100).await;
    db.restart();
    expect_lost(&guards, CADENCE + MARGIN).await;
    expect_free(&db, &guards).await;
}

/// On a connection lockkit opened, `lost()` resolves when the connection
/// ends, not at the next keepalive: with a cadence of an hour, a lock
/// whose backend is terminated (default and session-level forms) is lost
/// within the margin.
#[tokio::test(flavor = "multi_thread")]
async fn lost_at_once_when_the_connection_lockkit_opened_ends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let hour = Duration::from_secs(3600);
    for (i, form) in [SessionForm::Transaction, SessionForm::SessionLevel]
        .into_iter()
        .enumerate()
    {
        let sessions = SessionLock::new(db.config()).keepalive(hour).form(form);
        let guard = sessions.lock(Duty { id: 400 + i as i64 }).await.unwrap();
        let killed: bool = observer
            .query_one("SELECT pg_terminate_backend($1)", &[&guard.backend_pid()])
            .await
            .unwrap()
            .get(0);
        assert!(killed, "{form:?}");
        tokio::time::timeout(MARGIN, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{form:?}: lost() waits for the keepalive"));
        assert!(!guard.is_held(), "{form:?}");
    }
}

/// A guard dropped without release gives a pooled connection back to its
/// pool, clean, in both forms that lease one: the next lock from a pool
/// of one runs on the same backend. (Had the drop closed the connection,
/// the pool would open another.)
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_guard_gives_its_pooled_connection_back() {
    let db = TestServer::shared();
    let _log = db.guard();
    for (i, form) in [SessionForm::Transaction, SessionForm::SessionLevel]
        .into_iter()
        .enumerate()
    {
        // A direct server: no pooler to probe for (the probe would lease
        // a second connection from the pool of one).
        let sessions = SessionLock::from_pool(pool_of(db.config(), 1))
            .form(form)
            .pooler_check(false);
        let base = 410 + 10 * i as i64;
        let guard = sessions.lock(Duty { id: base }).await.unwrap();
        let pid = guard.backend_pid();
        drop(guard);
        let next = sessions.lock(Duty { id: base + 1 }).await.unwrap();
        assert_eq!(next.backend_pid(), pid, "{form:?}: another connection");
        // The dropped guard's key is free again.
        let other = SessionLock::new(db.config());
        let again = other.lock_timeout(Duty { id: base }, MARGIN).await;
        assert!(again.unwrap().release().await.unwrap(), "{form:?}");
        assert!(next.release().await.unwrap(), "{form:?}");
    }
}

/// A held lock's transaction runs under its own lease, whatever the
/// server's `idle_in_transaction_session_timeout`: a cadence below the
/// server's timeout keeps every lock for four times it, and so does a
/// cadence above it, whose lease (three cadences) is the bound now. A
/// holder that stops answering loses its lock at the lease
/// (`tests/session/lease.rs`).
#[tokio::test(flavor = "multi_thread")]
async fn the_lease_and_not_the_servers_idle_timeout_bounds_a_held_lock() {
    const IDLE_TIMEOUT: Duration = Duration::from_secs(1);
    let db = TestServer::builder()
        .setting("idle_in_transaction_session_timeout", "1s")
        .start();

    // The safe direction: a generous wait that must not see a lock go.
    // Each keepalive waits one cadence for its answer before it gives the
    // lock up: the cadence below the server's timeout is as long as it can
    // be, for a loaded machine.
    for (base, cadence) in [
        (200, Duration::from_millis(900)),
        (300, Duration::from_secs(3)),
    ] {
        let kept = paths(&db, cadence);
        let guards = hold_all(&kept, base).await;
        let four = IDLE_TIMEOUT * 4;
        assert!(
            tokio::time::timeout(four, guards[0].1.lost())
                .await
                .is_err(),
            "cadence {cadence:?}: the lock was not kept"
        );
        for (name, guard) in guards {
            assert!(guard.is_held(), "{name}, cadence {cadence:?}");
            assert!(guard.check().await.unwrap(), "{name}, cadence {cadence:?}");
            assert!(
                guard.release().await.unwrap(),
                "{name}, cadence {cadence:?}"
            );
        }
    }
}

/// One keeper task keeps every held lock of a `SessionLock` (and of its
/// clones): several locks held at once on one pooled `SessionLock`, taken
/// after an idle gap in which the keeper had no lock to keep (its task ends
/// then, and the next lock starts another), all outlive four times the
/// server's `idle_in_transaction_session_timeout` (and their lease, 3 s
/// here); terminating one lock's backend makes that one lost, and only that
/// one. The control that a lock whose keepalives stop is lost at its lease
/// is `tests/session/lease.rs`.
#[tokio::test(flavor = "multi_thread")]
async fn one_keeper_keeps_every_lock_of_a_session_lock() {
    const IDLE_TIMEOUT: Duration = Duration::from_secs(1);
    // A keepalive waits one cadence for its answer, then gives the lock
    // up: a second, which a loaded machine does not overrun, and a lease
    // (3 s) still shorter than the waits below.
    const KEEP: Duration = Duration::from_secs(1);
    let db = TestServer::builder()
        .setting("idle_in_transaction_session_timeout", "1s")
        .start();
    let observer = db.connect().await;
    let sessions = SessionLock::from_pool(pool_of(db.config(), 6)).keepalive(KEEP);
    let clone = sessions.clone();

    // A lock and its release, then an idle gap of several cadences: the
    // keeper's tick finds nothing to keep and its task ends.
    let first = sessions.lock(Duty { id: 400 }).await.unwrap();
    assert!(first.release().await.unwrap());
    tokio::time::sleep(KEEP * 5).await;

    let mut guards = Vec::new();
    for id in 401..405 {
        let from = if id % 2 == 0 { &sessions } else { &clone };
        guards.push(from.lock(Duty { id }).await.unwrap());
    }
    assert!(
        tokio::time::timeout(IDLE_TIMEOUT * 4, guards[0].lost())
            .await
            .is_err(),
        "the keeper did not keep the lock"
    );
    for guard in &guards {
        assert!(guard.is_held(), "{:?}", guard.value());
        assert!(guard.check().await.unwrap(), "{:?}", guard.value());
    }

    let killed = guards.remove(1);
    let terminated: bool = observer
        .query_one("SELECT pg_terminate_backend($1)", &[&killed.backend_pid()])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    tokio::time::timeout(KEEP + MARGIN, killed.lost())
        .await
        .expect("lost() did not resolve after pg_terminate_backend");
    assert!(killed.release().await.unwrap_err().is_connection_lost());
    // The others are kept on: still held after four more idle timeouts.
    tokio::time::sleep(IDLE_TIMEOUT * 4).await;
    for guard in guards {
        assert!(guard.is_held(), "{:?}", guard.value());
        assert!(guard.check().await.unwrap(), "{:?}", guard.value());
        let value = *guard.value();
        assert!(guard.release().await.unwrap(), "{value:?}");
    }
}

/// A multi-threaded runtime of `workers` threads, of a test's own.
fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// The keeper task runs on the runtime of the lock that started it; when
/// that runtime shuts down, the next lock (on another runtime) starts a new
/// keeper, so its lock outlives the server's
/// `idle_in_transaction_session_timeout`. Without the restart it would be
/// lost at its lease (3 s).
#[test]
fn a_lock_is_kept_after_the_keepers_runtime_shut_down() {
    const IDLE_TIMEOUT: Duration = Duration::from_secs(1);
    // A keepalive waits one cadence for its answer, then gives the lock
    // up: a second, which a loaded machine does not overrun, and a lease
    // (3 s) still shorter than the waits below.
    const KEEP: Duration = Duration::from_secs(1);
    let db = TestServer::builder()
        .setting("idle_in_transaction_session_timeout", "1s")
        .start();
    let sessions = SessionLock::new(db.config()).keepalive(KEEP);

    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    first.block_on(async {
        // Held while the keeper's task starts on this runtime.
        let guard = sessions.lock(Duty { id: 500 }).await.unwrap();
        assert!(guard.release().await.unwrap());
    });
    // Shut down with the keeper's task waiting for its first tick.
    drop(first);

    let second = runtime(2);
    second.block_on(async {
        let guard = sessions.lock(Duty { id: 501 }).await.unwrap();
        assert!(
            tokio::time::timeout(IDLE_TIMEOUT * 4, guard.lost())
                .await
                .is_err(),
            "no keeper kept the lock"
        );
        assert!(guard.check().await.unwrap());
        assert!(guard.release().await.unwrap());
    });
}

/// A lock taken on one runtime while its `SessionLock`'s keeper runs on
/// another: when the keeper's runtime shuts down, no task would keep the
/// lock or notice it go, so it is given up at once: `lost()` resolves and
/// the key is free. (Without that, `lost()` would never resolve here.)
#[test]
fn locks_are_given_up_when_the_keepers_runtime_shuts_down() {
    let db = TestServer::builder().start();
    let sessions = SessionLock::new(db.config());
    let keeper_runtime = runtime(1);
    // The keeper starts there, and runs on until a tick finds no lock.
    keeper_runtime.block_on(async {
        let guard = sessions.lock(Duty { id: 600 }).await.unwrap();
        assert!(guard.release().await.unwrap());
    });
    let runtime = runtime(2);
    let guard = runtime.block_on(sessions.lock(Duty { id: 601 })).unwrap();
    // Control: held while the keeper's runtime lives.
    runtime.block_on(async {
        assert!(
            tokio::time::timeout(Duration::from_millis(100), guard.lost())
                .await
                .is_err()
        );
        assert!(guard.check().await.unwrap());
    });
    drop(keeper_runtime);
    runtime.block_on(async {
        tokio::time::timeout(MARGIN, guard.lost())
            .await
            .expect("lost() did not resolve after the keeper's runtime shut down");
        assert!(!guard.is_held());
        expect_free(&db, &[("direct", guard)]).await;
    });
}
