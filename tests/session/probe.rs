//! The session-level form's pooler probe under a fleet of concurrent
//! lockers: behind a transaction-mode pgbouncer every one is refused, none
//! is handed a lock that a pooled backend keeps after its "release".

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, ErrorKind, SessionLock};
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::NoTls;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/probe-session")]
struct Chore {
    id: i64,
}

/// Eight concurrent session-level lockers behind a transaction-mode
/// pgbouncer (pool of 4, two background clients), 25 tries each: each
/// probe must see the pooler; none may be handed a session-level lock.
/// Before the probe marked its backends, concurrent probes kept one
/// another's backends busy and about one try in twenty was handed a lock,
/// stranded on a pooled backend (its unlock reached another one).
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_session_level_lockers_are_all_refused_behind_transaction_pgbouncer() {
    const TASKS: i64 = 8;
    const ROUNDS: usize = 25;
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let bouncer = PgBouncer::builder(&db)
        .pool_mode("transaction")
        .default_pool_size(4)
        .start();
    // Background clients doing short transactions.
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..2 {
        let (client, connection) = bouncer.config().connect(NoTls).await.unwrap();
        tokio::spawn(connection);
        let stop = stop.clone();
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = client
                    .batch_execute("BEGIN; SELECT pg_backend_pid(); COMMIT")
                    .await;
            }
        }));
    }
    let granted = Arc::new(AtomicU64::new(0));
    let other = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sessions = SessionLock::new(bouncer.config()).form(SessionForm::SessionLevel);
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (sessions, granted, other) = (sessions.clone(), granted.clone(), other.clone());
        tasks.push(tokio::spawn(async move {
            for r in 0..ROUNDS {
                match sessions
                    .try_lock(Chore {
                        id: t * 1000 + r as i64,
                    })
                    .await
                {
                    Ok(Ok(guard)) => {
                        granted.fetch_add(1, Ordering::SeqCst);
                        let _ = guard.release().await;
                    }
                    Ok(Err(_)) => {}
                    Err(e) if e.kind() == ErrorKind::PooledConnection => {}
                    Err(e) => other.lock().unwrap().push(format!("{:?}: {e}", e.kind())),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    let stranded: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        granted.load(Ordering::SeqCst),
        0,
        "session-level locks handed out behind a transaction-mode pooler ({stranded} advisory \
         locks left on the server; other errors: {:?})",
        other.lock().unwrap()
    );
}

/// A waiting `lock()` dropped while its holder releases at about the same
/// moment: whether the late grant or the cancel wins, the key ends up held
/// by nobody and is free for the next lock. (Direct only: pgbouncer 1.18,
/// the harness's, crashes under this race, "disconnect_client(): bad
/// client state: 0", its issue #801, closed upstream as fixed for 1.19.)
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_wait_racing_the_release_strands_nothing() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    for (path, config) in [("direct", db.config())] {
        let sessions = SessionLock::new(config);
        for i in 0..60 {
            let key = Chore { id: 90_000 + i };
            let holder = sessions.lock(key).await.unwrap();
            let waiter = tokio::spawn({
                let sessions = sessions.clone();
                async move { sessions.lock(key).await.map(|g| g.backend_pid()) }
            });
            lockkit_tests::waits::wait_until_awaited(&observer, key.lock_key()).await;
            // Release and abort at the same moment, in varying order.
            let release = tokio::spawn(async move { holder.release().await });
            for _ in 0..(i % 5) {
                tokio::task::yield_now().await;
            }
            waiter.abort();
            assert!(release.await.unwrap().unwrap(), "{path} {i}: release");
            let _ = waiter.await;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while lockkit_tests::observe::granted_elsewhere(&observer, key.lock_key()).await {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{path} {i}: the key stayed held after the waiter was dropped"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            let again = sessions
                .try_lock(key)
                .await
                .unwrap_or_else(|e| panic!("{path} {i}: try_lock: {e:?}"));
            assert!(
                again.is_ok(),
                "{path} {i}: the dropped waiter kept the lock"
            );
        }
    }
}
