//! Session locks on dedicated connections: released on drop, on a panic, on
//! a cancelled acquisition; lost-connection notice; try, timeout, shared;
//! refusal on a hot standby, and of the session-level form behind a real
//! transaction-mode pgbouncer. The pooler, pool, TLS and keepalive tests of
//! the default form are in pooler.rs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::key::HashText;
use lockkit::pg::{probe_pooler, SessionForm, SessionGuard};
use lockkit::{AdvisoryKey, Config, ErrorKind, LockKey, Mode, SessionLock};
use lockkit_tests::observe::granted_elsewhere;
use lockkit_tests::support::locker;
use lockkit_tests::waits::{wait_until_awaited, WaitCounter};
use lockkit_tests::{PgBouncer, TestServer};
use tokio::sync::Barrier;
use tokio_postgres::Client;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session")]
struct Job {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-pair", pair)]
struct Slot {
    id: i64,
}

/// Rows of `key` in `pg_locks`, granted or awaited, in any session.
async fn rows_of(observer: &Client, key: LockKey) -> i64 {
    let id = key.to_pg_locks();
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = $1 AND objid = $2 AND objsubid = $3",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Waits until no session holds or awaits `key`; panics after 30 s. The
/// server ends a closed session asynchronously, so "promptly" is polled.
async fn until_gone(observer: &Client, key: LockKey) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while rows_of(observer, key).await > 0 {
        assert!(
            Instant::now() < deadline,
            "{key} is still in pg_locks after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn guards_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SessionGuard<Job>>();
    check::<SessionLock>();
}

#[tokio::test(flavor = "multi_thread")]
async fn drop_closes_the_session_and_releases_the_lock() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());

    let guard = sessions.lock(Job { id: 1 }).await.unwrap();
    assert_eq!(guard.key(), Job { id: 1 }.lock_key());
    assert_eq!(guard.mode(), Mode::Exclusive);
    assert_eq!(guard.id, 1);
    assert!(guard.is_held());
    assert!(guard.check().await.unwrap());
    assert!(granted_elsewhere(&observer, guard.key()).await);
    // The default form holds a transaction open between keepalives.
    let pid = guard.backend_pid();
    let state: String = observer
        .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "idle in transaction");
    let key = guard.key();
    drop(guard);
    until_gone(&observer, key).await;
    // And the key is free for the next session.
    let again = sessions
        .try_lock(Job { id: 1 })
        .await
        .unwrap()
        .expect("free after drop");
    assert!(again.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_task_releases_its_lock() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());
    let key = Job { id: 2 }.lock_key();

    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
    let (checked_tx, checked_rx) = tokio::sync::oneshot::channel::<()>();
    let task_sessions = sessions.clone();
    let task = tokio::spawn(async move {
        let _guard = task_sessions.lock(Job { id: 2 }).await.unwrap();
        locked_tx.send(()).unwrap();
        // Panics only once the test has seen the lock held.
        checked_rx.await.unwrap();
        panic!("the payroll run crashed");
    });
    locked_rx.await.unwrap();
    assert!(
        granted_elsewhere(&observer, key).await,
        "held before the panic"
    );
    checked_tx.send(()).unwrap();
    let err = task.await.unwrap_err();
    assert!(err.is_panic());
    until_gone(&observer, key).await;
    let guard = sessions
        .lock_timeout(Job { id: 2 }, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(guard.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn release_reports_the_server_answer() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());

    let guard = sessions.lock(Job { id: 3 }).await.unwrap();
    let key = guard.key();
    assert!(guard.release().await.unwrap(), "the server held it");
    assert_eq!(
        rows_of(&observer, key).await,
        0,
        "release waits for the unlock"
    );

    // After the session was killed, release says the connection is gone.
    let guard = sessions.lock(Job { id: 3 }).await.unwrap();
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&guard.backend_pid()])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("lost() resolves after pg_terminate_backend");
    let err = guard.release().await.unwrap_err();
    assert!(err.is_connection_lost(), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn lost_resolves_when_the_backend_is_terminated() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());

    let guard = sessions.lock(Job { id: 4 }).await.unwrap();
    let lost = guard.lost();
    // Not lost while the connection lives.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), guard.lost())
            .await
            .is_err(),
        "lost() must not resolve while the lock is held"
    );
    let killed: bool = observer
        .query_one("SELECT pg_terminate_backend($1)", &[&guard.backend_pid()])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    tokio::time::timeout(Duration::from_secs(30), lost)
        .await
        .expect("lost() resolves after pg_terminate_backend");
    assert!(!guard.is_held());
    assert!(!guard.check().await.unwrap());
    // The client can see the socket close before the terminated backend
    // has exited and released its locks: wait for the release (the server
    // does it asynchronously), do not assume it happened first.
    until_gone(&observer, guard.key()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn try_timeout_and_shared() {
    let db = TestServer::shared();
    let _log = db.guard();
    let sessions = SessionLock::new(db.config());

    let held = sessions.lock(Job { id: 5 }).await.unwrap();
    let busy = sessions.try_lock(Job { id: 5 }).await.unwrap();
    assert_eq!(busy.unwrap_err(), Job { id: 5 }, "the key comes back");
    let err = sessions
        .lock_timeout(Job { id: 5 }, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let err = sessions
        .lock_shared_timeout(Job { id: 5 }, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(held.release().await.unwrap());

    // The pair key space.
    let held = sessions.lock(Slot { id: 5 }).await.unwrap();
    assert!(matches!(held.key(), LockKey::Pair(..)));
    let busy = sessions.try_lock_shared(Slot { id: 5 }).await.unwrap();
    assert_eq!(busy.unwrap_err(), Slot { id: 5 });
    assert!(held.release().await.unwrap());

    // Shared holders admit each other and exclude an exclusive one.
    let a = sessions.lock_shared(Job { id: 6 }).await.unwrap();
    let b = sessions
        .try_lock_shared(Job { id: 6 })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(b.mode(), Mode::Shared);
    assert!(sessions.try_lock(Job { id: 6 }).await.unwrap().is_err());
    assert!(a.release().await.unwrap());
    assert!(sessions.try_lock(Job { id: 6 }).await.unwrap().is_err());
    assert!(b.release().await.unwrap());
    let c = sessions.try_lock(Job { id: 6 }).await.unwrap().unwrap();
    assert!(c.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn session_and_transaction_locks_exclude_each_other() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut client = db.connect().await;
    let locker = locker(&client, Config::default()).await;
    let sessions = locker.session(db.config());

    let tx = locker.begin(&mut client).await.unwrap();
    let held = tx.lock(Job { id: 7 }).await.unwrap();
    assert!(sessions.try_lock(Job { id: 7 }).await.unwrap().is_err());
    drop(held);
    tx.commit().await.unwrap();
    let guard = sessions.try_lock(Job { id: 7 }).await.unwrap().unwrap();
    let tx = locker.begin(&mut client).await.unwrap();
    assert!(tx.try_lock(Job { id: 7 }).await.unwrap().is_err());
    tx.rollback().await.unwrap();
    drop(guard);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_lock_leaves_nothing_behind() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());
    let key = Job { id: 8 }.lock_key();

    let holder = sessions.lock(Job { id: 8 }).await.unwrap();
    {
        let waiting = sessions.lock(Job { id: 8 });
        tokio::pin!(waiting);
        // Give up once the server shows the waiter waiting: the future is
        // dropped (at the end of this block) mid-statement, never before
        // its lock was sent.
        tokio::select! {
            got = &mut waiting => panic!("granted while held: {:?}", got.map(|g| g.key())),
            _ = wait_until_awaited(&observer, key) => {}
        }
    }
    // No cancel request: the server ends the cut-off wait at its slice,
    // while the key is still held, and its connection is rolled back.
    lockkit_tests::observe::until_key_not_waited(&observer, key)
        .await
        .unwrap();
    assert!(holder.release().await.unwrap());
    // The cancelled waiter must not end up holding the key.
    until_gone(&observer, key).await;
    let again = sessions.try_lock(Job { id: 8 }).await.unwrap();
    assert!(again.is_ok(), "the cancelled waiter kept the lock");
}

/// Many tasks, one key: never two inside, over hundreds of acquisitions,
/// many of which the server was seen making wait. The control (distinct
/// keys) shows the counter sees overlap when there is no exclusion: all
/// tasks meet at a barrier inside their critical sections.
#[tokio::test(flavor = "multi_thread")]
async fn excludes_across_many_sessions() {
    const TASKS: usize = 8;
    const ROUNDS: usize = 40;
    /// A lower bound on the waits seen (see `lockkit_tests::waits`).
    const MIN_WAITS: u64 = 50;
    let db = TestServer::shared();
    let _log = db.guard();
    let sessions = SessionLock::new(db.config());
    let counter = WaitCounter::start(db.config(), [Job { id: 9 }.lock_key()]);

    let inside = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (sessions, inside, max) = (sessions.clone(), inside.clone(), max.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = sessions.lock(Job { id: 9 }).await.unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                assert!(guard.release().await.unwrap());
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(max.load(Ordering::SeqCst), 1, "two holders of one key");
    counter.stop().assert_waited(
        &format!("{} session acquisitions", TASKS * ROUNDS),
        MIN_WAITS,
    );

    // Control: distinct keys, so every task can be inside at once.
    let inside = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let (sessions, inside, max, barrier) = (
            sessions.clone(),
            inside.clone(),
            max.clone(),
            barrier.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let guard = sessions.lock(Job { id: 100 + i as i64 }).await.unwrap();
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            max.fetch_max(now, Ordering::SeqCst);
            barrier.wait().await;
            inside.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(max.load(Ordering::SeqCst), TASKS);
}

#[tokio::test(flavor = "multi_thread")]
async fn refused_behind_a_transaction_pooler() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(2)
        .start();

    let err = SessionLock::new(bouncer.config())
        .form(SessionForm::SessionLevel)
        .lock(Job { id: 10 })
        .await
        .unwrap_err();
    assert!(err.kind() == ErrorKind::PooledConnection, "{err}");
    assert!(err.to_string().contains("transaction-mode pooler"), "{err}");
    assert!(!granted_elsewhere(&observer, Job { id: 10 }.lock_key()).await);
    let probe = probe_pooler(&bouncer.config()).await.unwrap();
    assert!(probe.is_transaction_pooled(), "{probe:?}");
    // What gave it away, for the operator.
    assert!(probe.evidence().is_some_and(|e| !e.is_empty()), "{probe:?}");

    // With a pool of one server connection the probe still sees it.
    let single = PgBouncer::one_server_connection(db);
    let err = SessionLock::new(single.config())
        .form(SessionForm::SessionLevel)
        .try_lock(Job { id: 10 })
        .await
        .unwrap_err();
    assert!(err.kind() == ErrorKind::PooledConnection, "{err}");

    // Controls: direct, and through a session-mode pool, it is not pooled
    // in the way that breaks session locks.
    let direct = probe_pooler(&db.config()).await.unwrap();
    assert!(!direct.is_transaction_pooled(), "{direct:?}");
    assert_eq!(direct.evidence(), None, "{direct:?}");
    let session_mode = PgBouncer::builder(db).pool_mode("session").start();
    let probe = probe_pooler(&session_mode.config()).await.unwrap();
    assert!(!probe.is_transaction_pooled(), "{probe:?}");
    let guard = SessionLock::new(session_mode.config())
        .form(SessionForm::SessionLevel)
        .lock(Job { id: 10 })
        .await
        .unwrap();
    assert!(granted_elsewhere(&observer, guard.key()).await);
    assert!(guard.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn refused_on_a_hot_standby_unless_allowed() {
    let primary = TestServer::builder().start();
    let standby = primary.standby();
    let err = SessionLock::new(standby.config())
        .lock(Job { id: 11 })
        .await
        .unwrap_err();
    assert!(err.kind() == ErrorKind::HotStandby, "{err}");
    let client = primary.connect().await;
    let locker = locker(&client, Config::default().allow_standby(true)).await;
    let guard = locker
        .session(standby.config())
        .lock(Job { id: 11 })
        .await
        .unwrap();
    assert!(guard.check().await.unwrap());
    assert!(guard.release().await.unwrap());
}

/// A refusal rests on facts read for it: a `SessionLock` whose first
/// locks were refused on a hot standby (its facts on hand say so) takes
/// its lock there once the standby is promoted, as a fresh `SessionLock`
/// would.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_that_refused_a_lock_grants_it_once_promoted() {
    let primary = TestServer::builder().start();
    let standby = primary.standby();
    let sessions = SessionLock::new(standby.config());
    for _ in 0..2 {
        let err = sessions.lock(Job { id: 12 }).await.unwrap_err();
        assert!(err.kind() == ErrorKind::HotStandby, "{err}");
    }
    standby.promote().await;
    let guard = sessions.lock(Job { id: 12 }).await.unwrap();
    assert!(guard.check().await.unwrap());
    assert!(guard.release().await.unwrap());
}

/// The facts cost one round trip per `SessionLock`, not per lock: the
/// server logs every statement, and after locks by the `SessionLock`, by
/// a clone and a try that finds the key busy, the facts query was sent
/// once; a `HashText` key adds the one read beside its own query, no more,
/// and a `SessionLock` whose first lock is a `HashText` key reads them
/// once for it. (Facts that allow the lock are not read again; the test
/// above shows that facts that refuse it are.)
#[tokio::test(flavor = "multi_thread")]
async fn the_default_form_reads_the_servers_facts_once_per_session_lock() {
    let server = TestServer::builder()
        .setting("log_statement", "all")
        .start();
    let from = server.log_offset();
    let sessions = SessionLock::new(server.config());
    let guard = sessions.lock(Job { id: 14 }).await.unwrap();
    assert!(sessions
        .clone()
        .try_lock(Job { id: 14 })
        .await
        .unwrap()
        .is_err());
    assert!(guard.release().await.unwrap());
    for id in [14, 15] {
        let guard = sessions.clone().lock(Job { id }).await.unwrap();
        assert!(guard.release().await.unwrap());
    }
    let facts_reads = |log: &str| {
        log.matches("current_setting('max_locks_per_transaction')")
            .count()
    };
    let log = server.log_since(from);
    let locks = log.matches("pg_advisory_xact_lock(").count()
        + log.matches("pg_try_advisory_xact_lock(").count();
    assert!(locks >= 4, "the log shows {locks} lock statements:\n{log}");
    assert_eq!(facts_reads(&log), 1, "the facts query, in the log:\n{log}");

    let from = server.log_offset();
    for text in ["lockkit-tests/facts/a", "lockkit-tests/facts/b"] {
        let guard = sessions.lock(HashText(text)).await.unwrap();
        assert!(guard.release().await.unwrap());
    }
    let log = server.log_since(from);
    assert_eq!(facts_reads(&log), 2, "the facts query, in the log:\n{log}");

    let from = server.log_offset();
    let first = SessionLock::new(server.config());
    let guard = first.lock(HashText("lockkit-tests/facts/c")).await.unwrap();
    assert!(guard.release().await.unwrap());
    let log = server.log_since(from);
    assert_eq!(facts_reads(&log), 1, "the facts query, in the log:\n{log}");
}

/// A raw key, so the test picks the exact `LockKey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Raw(LockKey);

impl AdvisoryKey for Raw {
    const KEY_SPEC: lockkit::KeySpec<'static> = lockkit::KeySpec::new("lockkit-tests/raw").raw();
    fn lock_key(&self) -> LockKey {
        self.0
    }
}

/// The default form sends its lock statement with the key as a literal
/// (the engine's `Statement::write_simple`): the extreme keys of both key
/// spaces lock exactly that key in `pg_locks`, are busy for a second
/// holder (try, and a timeout, whose savepoint rounds go the same way) and
/// are gone after the release. The control: a neighbouring key is not the
/// one locked.
#[tokio::test(flavor = "multi_thread")]
async fn extreme_keys_lock_exactly_their_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::new(db.config());
    let other = SessionLock::new(db.config());
    for key in [
        LockKey::BigInt(i64::MIN),
        LockKey::BigInt(i64::MAX),
        LockKey::BigInt(-1),
        LockKey::Pair(i32::MIN, i32::MAX),
        LockKey::Pair(i32::MAX, i32::MIN),
        LockKey::Pair(-1, 0),
    ] {
        let neighbour = match key {
            LockKey::BigInt(v) => LockKey::BigInt(v.wrapping_add(1)),
            LockKey::Pair(c, o) => LockKey::Pair(c, o.wrapping_add(1)),
        };
        let guard = sessions.lock(Raw(key)).await.unwrap();
        assert_eq!(rows_of(&observer, key).await, 1, "{key}");
        assert_eq!(rows_of(&observer, neighbour).await, 0, "{neighbour}");
        assert!(other.try_lock(Raw(key)).await.unwrap().is_err(), "{key}");
        let err = other
            .lock_timeout(Raw(key), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{key}: {err}");
        let free = other.try_lock(Raw(neighbour)).await.unwrap().unwrap();
        assert!(free.release().await.unwrap());
        assert!(guard.release().await.unwrap());
        until_gone(&observer, key).await;
    }
}

/// A session-level lock names its backend after the lock, as the default
/// form does: `pg_stat_activity` shows `lockkit session lock <namespace>
/// <key>` while it is held on a connection of lockkit's own. The name is
/// session-wide there (the lock is not in a transaction), on a connection
/// that is direct or behind a session-mode pooler, and closed at release.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_level_lock_names_its_backend() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let key = Job { id: 11 };
    for wait in ["lock", "try_lock"] {
        let sessions = SessionLock::new(db.config()).form(SessionForm::SessionLevel);
        let guard = match wait {
            "lock" => sessions.lock(key).await.unwrap(),
            _ => sessions.try_lock(key).await.unwrap().expect("free"),
        };
        let name: String = observer
            .query_one(
                "SELECT application_name FROM pg_stat_activity WHERE pid = $1",
                &[&guard.backend_pid()],
            )
            .await
            .unwrap()
            .get(0);
        let full = format!(
            "lockkit session lock {} {}",
            Job::KEY_SPEC.namespace(),
            key.lock_key()
        );
        assert_eq!(name, full[..full.len().min(63)], "{wait}");
        assert!(guard.release().await.unwrap(), "{wait}");
    }
}
