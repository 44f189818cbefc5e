//! The default (transaction-held) session-duration locks behind real
//! poolers and pools: 200 locks in a row through transaction-mode and
//! session-mode pgbouncer under background load, and direct, none leaked
//! and never two holders; the control (plain session-level locks, probe
//! off) leaks. Leases from a deadpool pool of one. What an operator sees
//! (`idle in transaction`, `application_name`, no `backend_xmin`). The
//! bounded pooler probe.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::pg::{ProbeTimeout, SessionForm};
use lockkit::{AdvisoryKey, ErrorKind, LockKey, SessionLock};
use lockkit_tests::observe::{held_by, simple_value};
use lockkit_tests::{PgBouncer, TestServer};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};

/// The keepalive of the sessions of the load tests, which bounds how long a
/// call waits for the server's answer. These tests are about where locks
/// are left, not about that bound (`session_silent` is): a loaded machine
/// may take seconds to answer through the pooler, and a call given up
/// there would be a correct `ConnectionLost`, not what these tests check.
const PATIENT: Duration = Duration::from_secs(60);

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-pooler")]
struct Leader {
    id: i64,
}

/// Granted rows of `key` in `pg_locks`, in any session.
async fn granted(observer: &Client, key: LockKey) -> i64 {
    let id = key.to_pg_locks();
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Polls until no session holds `key`; panics after 30 s. The server ends a
/// closed session asynchronously.
async fn until_free(observer: &Client, key: LockKey) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while granted(observer, key).await > 0 {
        assert!(Instant::now() < deadline, "{key} still held after 30 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub(crate) use lockkit_tests::support::pool_of;

/// Clients doing short transactions through `config` until finished, so a
/// transaction-mode pooler hands its backends around; a transaction that
/// fails panics its client, which [`finish`](Self::finish) reports.
pub(crate) struct Background {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl Background {
    pub(crate) async fn start(config: &tokio_postgres::Config, clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let (client, connection) = config.connect(NoTls).await.expect("background client");
            tokio::spawn(connection);
            let (stop, done) = (stop.clone(), done.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    client
                        .batch_execute("BEGIN; SELECT pg_backend_pid(); COMMIT")
                        .await
                        .expect("background transaction");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        Background { stop, done, tasks }
    }

    /// How many transactions the clients have run so far.
    pub(crate) fn transactions(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Stops the clients; answers how many transactions they ran.
    pub(crate) async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("background client panicked");
        }
        self.done.load(Ordering::Relaxed)
    }
}

/// 200 default session locks in a row through `sessions`, with a second
/// holder trying the key through `rival` each time. Each is granted to
/// exactly one backend (checked from the direct `observer`), refused to the
/// rival, and gone from `pg_locks` after its release (checked at once) or
/// drop (polled). Answers how many the rival was refused.
async fn two_hundred_locks(
    sessions: &SessionLock,
    rival: &SessionLock,
    observer: &Client,
    key: Leader,
) -> usize {
    let lock_key = key.lock_key();
    let mut refused = 0;
    for i in 0..200 {
        let guard = sessions
            .lock_timeout(key, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("lock {i}: {e}"));
        if !held_by(observer, guard.backend_pid(), lock_key).await {
            panic!(
                "lock {i}: not granted to its backend {} (guard held: {}); {}",
                guard.backend_pid(),
                guard.is_held(),
                seen(observer, guard.backend_pid(), lock_key).await
            );
        }
        assert_eq!(granted(observer, lock_key).await, 1, "lock {i}: holders");
        match rival.try_lock(key).await.expect("rival try") {
            Err(_) => refused += 1,
            Ok(second) => panic!(
                "lock {i}: a second holder through the same pooler (backend {} and {})",
                guard.backend_pid(),
                second.backend_pid()
            ),
        }
        if i % 2 == 0 {
            assert!(guard.release().await.expect("release"), "lock {i}: held");
            assert_eq!(
                granted(observer, lock_key).await,
                0,
                "lock {i}: still held after release returned"
            );
        } else {
            drop(guard);
            until_free(observer, lock_key).await;
        }
    }
    refused
}

/// What the server shows of `key` and of backend `pid`, for a failure's
/// message: every `pg_locks` row of the key (pid, mode, granted) and the
/// backend's `pg_stat_activity` row.
async fn seen(observer: &Client, pid: i32, key: LockKey) -> String {
    let id = key.to_pg_locks();
    let locks = observer
        .query(
            "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = $1 AND objid = $2 AND objsubid = $3",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| {
                    format!(
                        "{:?}",
                        (
                            r.get::<_, Option<i32>>(0),
                            r.get::<_, String>(1),
                            r.get::<_, bool>(2)
                        )
                    )
                })
                .collect::<Vec<_>>()
        });
    let activity = observer
        .query(
            "SELECT state, application_name, xact_start IS NOT NULL FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| format!("{:?}", (r.get::<_, Option<String>>(0), r.get::<_, Option<String>>(1), r.get::<_, Option<bool>>(2))))
                .collect::<Vec<_>>()
        });
    format!("pg_locks rows of the key (pid, mode, granted): {locks:?}; pg_stat_activity of {pid}: {activity:?}")
}

async fn none_idle_in_transaction(observer: &Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lockkit session lock%'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_locks_behind_transaction_pgbouncer_under_load() {
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let bouncer = PgBouncer::builder(&db)
        .pool_mode("transaction")
        .default_pool_size(3)
        .start();
    let load = Background::start(&bouncer.config(), 3).await;
    let key = Leader { id: 1 };

    // Connections lockkit opens through the pooler.
    let sessions = SessionLock::new(bouncer.config()).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&sessions, &sessions, &observer, key).await,
        200
    );
    // Connections leased from a deadpool pool of pooler connections.
    let pool = pool_of(bouncer.config(), 2);
    let pooled = SessionLock::from_pool(pool.clone()).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&pooled, &sessions, &observer, key).await,
        200
    );

    let ran = load.finish().await;
    assert!(ran > 0, "the background clients ran no transaction");
    assert_eq!(granted(&observer, key.lock_key()).await, 0, "leaked");
    until_zero(&observer).await;
    // The pool's connections came back without a transaction or a lock (in
    // one simple-protocol query, which the pooler runs on one backend).
    let conn = pool.get().await.unwrap();
    let count = simple_value(
        &conn,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .await
    .unwrap();
    assert_eq!(count.as_deref(), Some("0"));
}

/// No lockkit lock session is left in `pg_stat_activity` (closed
/// connections end asynchronously: polled, 30 s at most).
async fn until_zero(observer: &Client) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while none_idle_in_transaction(observer).await > 0 {
        assert!(
            Instant::now() < deadline,
            "lockkit sessions still open after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_locks_through_session_pgbouncer_and_direct() {
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let key = Leader { id: 2 };

    // Session mode pins each client to a backend: room for the holder, the
    // rival, the pool and the background clients.
    let bouncer = PgBouncer::builder(&db)
        .pool_mode("session")
        .default_pool_size(10)
        .start();
    let load = Background::start(&bouncer.config(), 3).await;
    let sessions = SessionLock::new(bouncer.config()).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&sessions, &sessions, &observer, key).await,
        200
    );
    let pooled = SessionLock::from_pool(pool_of(bouncer.config(), 2)).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&pooled, &sessions, &observer, key).await,
        200
    );
    assert!(load.finish().await > 0);

    let load = Background::start(&db.config(), 3).await;
    let sessions = SessionLock::new(db.config()).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&sessions, &sessions, &observer, key).await,
        200
    );
    let pooled = SessionLock::from_pool(pool_of(db.config(), 2)).keepalive(PATIENT);
    assert_eq!(
        two_hundred_locks(&pooled, &sessions, &observer, key).await,
        200
    );
    assert!(load.finish().await > 0);
    assert_eq!(granted(&observer, key.lock_key()).await, 0, "leaked");
    until_zero(&observer).await;
}

/// The control: plain session-level locks with the probe off, through the
/// same transaction-mode pgbouncer under the same load, leak: an unlock
/// reaches another backend (answering false) and the lock stays on a
/// pooled backend after "release".
#[tokio::test(flavor = "multi_thread")]
async fn control_session_level_locks_leak_behind_transaction_pgbouncer() {
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let bouncer = PgBouncer::builder(&db)
        .pool_mode("transaction")
        .default_pool_size(3)
        .start();
    let load = Background::start(&bouncer.config(), 3).await;
    let key = Leader { id: 3 };
    let plain = SessionLock::new(bouncer.config())
        .form(SessionForm::SessionLevel)
        .pooler_check(false);

    let mut leaks = 0;
    for _ in 0..200 {
        let Ok(guard) = plain.try_lock(key).await.expect("try_lock") else {
            // Busy: a lock leaked earlier is in the way.
            leaks += 1;
            break;
        };
        let unlocked = guard.release().await.expect("release");
        if !unlocked || granted(&observer, key.lock_key()).await > 0 {
            leaks += 1;
            break;
        }
    }
    load.finish().await;
    assert!(
        leaks > 0,
        "the control did not leak in 200 session-level locks"
    );
    // Clean up what leaked: the pooled backends that hold the key.
    let id = key.lock_key().to_pg_locks();
    observer
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = $1 AND objid = $2 AND objsubid = $3",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .unwrap();
}

/// A pool of one connection: after a dropped guard the next lease sees no
/// lock and no transaction, and another session can take the key. The
/// control drops a leased connection inside a locked transaction by hand,
/// and the check sees the lock come back with the next lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_of_one_never_gets_a_locked_connection_back() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let pool = pool_of(db.config(), 1);
    let sessions = SessionLock::from_pool(pool.clone());
    let other = SessionLock::new(db.config());

    async fn locks_on(client: &Client) -> (i64, String) {
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                 AND pid = pg_backend_pid()), current_setting('application_name'), \
                 current_setting('client_connection_check_interval')",
                &[],
            )
            .await
            .unwrap();
        // The lock's settings are transaction-local, in both set-up forms
        // (the first lock's, and the `SET LOCAL` one of the next locks).
        let interval: String = row.get(2);
        assert_eq!(interval, "0", "a lease came back with lockkit's setting");
        (row.get(0), row.get(1))
    }

    for round in 0..20 {
        let key = Leader { id: 100 + round };
        let guard = sessions.lock(key).await.unwrap();
        let pid = guard.backend_pid();
        assert!(held_by(&observer, pid, key.lock_key()).await);
        if round % 2 == 0 {
            drop(guard);
        } else {
            assert!(guard.release().await.unwrap());
        }
        // The next lease (the same connection, or a new one if it was
        // detached) holds nothing and is not in a transaction.
        let conn = pool.get().await.unwrap();
        let (locks, name) = locks_on(&conn).await;
        assert_eq!(locks, 0, "round {round}: a lease came back with a lock");
        assert!(!name.starts_with("lockkit"), "round {round}: {name}");
        // BEGIN would only warn inside a transaction; this fails instead.
        assert!(
            conn.batch_execute("SAVEPOINT s").await.is_err(),
            "round {round}: the lease is in a transaction"
        );
        drop(conn);
        let again = other.try_lock(key).await.unwrap().expect("the key is free");
        assert!(again.release().await.unwrap());
    }
    assert_eq!(pool.status().size, 1);

    // Control: what the check catches.
    let conn = pool.get().await.unwrap();
    conn.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(4242)")
        .await
        .unwrap();
    drop(conn);
    let conn = pool.get().await.unwrap();
    assert_eq!(locks_on(&conn).await.0, 1, "the control must leak");
    conn.batch_execute("ROLLBACK").await.unwrap();
}

/// Backend `pid`'s `pg_stat_activity` state and `application_name`, and
/// whether it has no `backend_xmin` and no `backend_xid`.
pub(crate) async fn activity(observer: &Client, pid: i32) -> (String, String, bool, bool) {
    let row = observer
        .query_one(
            "SELECT state, application_name, backend_xmin IS NULL, backend_xid IS NULL \
             FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// What `pg_stat_activity` shows for a held lock: idle in transaction,
/// lockkit's `application_name`, and no `backend_xmin` or `backend_xid`,
/// so VACUUM is not held back, even when the role's default isolation is
/// serializable. The control: a plain transaction under that default
/// holding an xact lock has a `backend_xmin`.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_lock_does_not_hold_back_vacuum() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut config = db.config();
    config.options("-c default_transaction_isolation=serializable");
    let key = Leader { id: 5 };

    for sessions in [
        SessionLock::new(config.clone()),
        SessionLock::from_pool(pool_of(config.clone(), 1)),
    ] {
        // A long cadence: no keepalive runs while the row is read.
        let sessions = sessions.keepalive(Duration::from_secs(600));
        // Twice: the first lock's set-up, then the `SET LOCAL` one of a
        // lock whose server is known.
        for _ in 0..2 {
            let guard = sessions.lock(key).await.unwrap();
            let (state, name, no_xmin, no_xid) = activity(&observer, guard.backend_pid()).await;
            assert_eq!(state, "idle in transaction");
            // The type's namespace, then the key, as far as the server's
            // 63 bytes (NAMEDATALEN - 1) go.
            let full = format!(
                "lockkit session lock lockkit-tests/session-pooler {}",
                key.lock_key()
            );
            assert_eq!(name, full[..full.len().min(63)]);
            assert!(no_xmin, "the lock's backend holds back VACUUM");
            assert!(no_xid);
            assert!(guard.release().await.unwrap());
        }
    }

    // Control: the same default isolation, a raw transaction.
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(4243)")
        .await
        .unwrap();
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let (state, _, no_xmin, _) = activity(&observer, pid).await;
    assert_eq!(state, "idle in transaction");
    assert!(!no_xmin, "the control must hold a snapshot");
}

fn probe_timeout_of(err: &lockkit::Error) -> Option<ProbeTimeout> {
    std::error::Error::source(err)?
        .downcast_ref::<ProbeTimeout>()
        .copied()
}

/// The probe never waits on a saturated pool longer than its bound, and
/// keeps no second connection afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn the_probe_is_bounded_on_a_saturated_pool() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bound = Duration::from_millis(300);

    // A session-mode pgbouncer with one free server connection.
    let bouncer = PgBouncer::builder(db)
        .pool_mode("session")
        .default_pool_size(2)
        .start();
    let (hog, connection) = bouncer.config().connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    hog.batch_execute("SELECT 1").await.unwrap();
    let sessions = SessionLock::new(bouncer.config()).probe_timeout(bound);
    let started = Instant::now();
    let err = sessions.probe_pooler().await.unwrap_err();
    assert_eq!(
        probe_timeout_of(&err),
        Some(ProbeTimeout { timeout: bound }),
        "{err:?}"
    );
    assert_eq!(
        err.kind(),
        ErrorKind::Timeout,
        "the documented kind: {err:?}"
    );
    // Generous: the claim is "does not wait for the second connection".
    assert!(started.elapsed() < Duration::from_secs(10));
    // The session-level form reports the same, and nothing is locked.
    let err = sessions
        .clone()
        .form(SessionForm::SessionLevel)
        .try_lock(Leader { id: 6 })
        .await
        .unwrap_err();
    assert!(probe_timeout_of(&err).is_some(), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err:?}");
    // The probe's connections are gone: the free one serves a new client.
    let (client, connection) = bouncer.config().connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    tokio::time::timeout(Duration::from_secs(10), client.batch_execute("SELECT 1"))
        .await
        .expect("the pooler's free connection is still taken")
        .unwrap();
    drop((client, hog));

    // A deadpool pool of one: the probe's second lease times out, and the
    // pool has its connection back.
    let pool = pool_of(db.config(), 1);
    let err = SessionLock::from_pool(pool.clone())
        .probe_timeout(bound)
        .probe_pooler()
        .await
        .unwrap_err();
    assert!(probe_timeout_of(&err).is_some(), "{err:?}");
    let conn = tokio::time::timeout(Duration::from_secs(10), pool.get())
        .await
        .expect("the probe kept the pool's connection")
        .unwrap();
    conn.batch_execute("SELECT 1").await.unwrap();
    drop(conn);
    // With room for two, the same pool is probed as direct.
    let probe = SessionLock::from_pool(pool_of(db.config(), 2))
        .probe_pooler()
        .await
        .unwrap();
    assert!(!probe.is_transaction_pooled(), "{probe:?}");
}

/// The `application_name` a fresh client through `bouncer` finds on the
/// pooler's one server connection, in one simple-protocol query (the
/// client sets none of its own).
async fn name_on_the_pooled_backend(bouncer: &PgBouncer) -> String {
    let (client, connection) = bouncer.config().connect(NoTls).await.expect("connect");
    let task = tokio::spawn(connection);
    let name = simple_value(&client, "SELECT current_setting('application_name')")
        .await
        .expect("application_name")
        .expect("a row");
    drop(client);
    let _ = task.await;
    name
}

/// Reported: behind a transaction-mode pgbouncer, the backends of other
/// applications came to show lockkit's session-lock names in
/// `pg_stat_activity` (and `lockkit inspect`) long after lockkit's locks
/// were gone. pgbouncer applies a client's startup `application_name` to
/// every server connection it links to that client, with a session-level
/// `SET`, and a server connection that goes back to the pool keeps it for
/// the next client that names itself nothing. A session lock names its
/// backend inside its own transaction only (`SET LOCAL`), so nothing of it
/// outlives the lock there. With a pool of one server connection, each
/// form's lock is taken, released and its `SessionLock` dropped; the next
/// client of the pool must find the server's own name.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_lock_leaves_no_name_on_a_pooled_backend() {
    let db = TestServer::builder().start();
    let observer = db.connect().await;
    let bouncer = PgBouncer::one_server_connection(&db);
    assert_eq!(name_on_the_pooled_backend(&bouncer).await, "", "before");
    for form in [SessionForm::Transaction, SessionForm::Multiplexed] {
        let sessions = SessionLock::new(bouncer.config()).form(form);
        let guard = sessions.lock(Leader { id: 7 }).await.expect("lock");
        assert!(
            held_by(&observer, guard.backend_pid(), Leader { id: 7 }.lock_key()).await,
            "{form:?}: not held"
        );
        assert!(guard.release().await.expect("release"), "{form:?}");
        drop(sessions);
        until_free(&observer, Leader { id: 7 }.lock_key()).await;
        assert_eq!(
            name_on_the_pooled_backend(&bouncer).await,
            "",
            "{form:?}: the pooled backend kept lockkit's name; {}",
            bouncer.log()
        );
    }
}

/// Tries through a transaction-mode pgbouncer whose every server connection
/// is pinned by a held lock (issue 44): the pooler is alive and queueing, so
/// a try answers busy or an `ErrorKind::Timeout` with nothing held, within
/// its bound (one keepalive cadence, plus what the machine's load adds),
/// never `ConnectionLost`. Both session forms, at the default keepalive and
/// a short one. The control, below the loop: once a lock lets go, a try
/// gets a server connection and the key; then every try's connection,
/// drained meanwhile, ends cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn tries_behind_a_saturated_pooler_are_busy_or_time_out() {
    const POOL: u32 = 2;
    let db = TestServer::shared();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(POOL)
        .start();
    let observer = db.connect().await;
    let holders = SessionLock::new(bouncer.config()).keepalive(PATIENT);
    let mut held = Vec::new();
    for id in 0..POOL as i64 {
        held.push(holders.lock(Leader { id: 70_000 + id }).await.unwrap());
    }
    let mut tries = tokio::task::JoinSet::new();
    let mut id = 71_000;
    for form in [SessionForm::Transaction, SessionForm::Multiplexed] {
        for cadence in [lockkit::DEFAULT_KEEPALIVE, Duration::from_millis(500)] {
            for _ in 0..10 {
                id += 1;
                let sessions = SessionLock::new(bouncer.config())
                    .form(form)
                    .keepalive(cadence);
                tries.spawn(async move {
                    let key = Leader { id };
                    let started = Instant::now();
                    let answer = sessions.try_lock(key).await;
                    let took = started.elapsed();
                    (form, cadence, key, took, answer.map(|r| r.is_ok()))
                });
            }
        }
    }
    let mut timeouts = 0;
    while let Some(done) = tries.join_next().await {
        let (form, cadence, key, took, answer) = done.unwrap();
        let what = format!("{form:?} at a {cadence:?} cadence, after {took:?}");
        match answer {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Timeout, "{what}: {e}");
                assert!(e.is_transient(), "{what}: {e}");
                timeouts += 1;
            }
            Ok(granted) => {
                panic!("{what}: a try answered {granted} with every server connection pinned")
            }
        }
        // The bound, in the direction load cannot break: the try gave up
        // no sooner than its cadence.
        assert!(took >= cadence, "{what}: gave up before its bound");
        assert_eq!(
            granted(&observer, key.lock_key()).await,
            0,
            "{what}: the key is held"
        );
    }
    assert_eq!(timeouts, 40);
    // A try that gave up keeps its connection, drained, never closed under
    // its statement queued in the pooler: pgbouncer 1.18, reading nothing
    // from a client waiting for a server connection, would count a closed
    // one until a server connection frees, and then close that server
    // connection under the statement. Each `SessionLock` here tried once:
    // one connection each, beside the holders'.
    let clients = bouncer.clients_of("postgres").await;
    assert!(
        clients <= POOL as usize + 40,
        "{clients} clients in the pooler: {POOL} holders and 40 drained tries at most"
    );
    // The control: a server connection freed, a try gets it and the key,
    // behind the drained tries' statements, which run and roll back.
    held.pop().unwrap().release().await.unwrap();
    let sessions = SessionLock::new(bouncer.config()).keepalive(PATIENT);
    let guard = sessions
        .try_lock(Leader { id: 79_999 })
        .await
        .unwrap()
        .unwrap_or_else(|_| panic!("nobody holds the key"));
    guard.release().await.unwrap();
    for guard in held {
        guard.release().await.unwrap();
    }
    drop((sessions, holders));
    // Every drained connection ends with a Terminate while idle: none left,
    // and the pooler closed no server connection under a statement.
    bouncer
        .until_no_clients_of("postgres", "every lock let go")
        .await;
    assert_eq!(bouncer.abrupt_client_closes(), Vec::<String>::new());
    for id in 71_001..=id {
        assert_eq!(
            granted(&observer, Leader { id }.lock_key()).await,
            0,
            "key {id}"
        );
    }
}

/// pgbouncer 1.18 in transaction mode hands a server connection on as soon
/// as its client goes away if the last answer left it idle, even with a
/// statement of that client's still running there
/// (`tests/lockkit/pooler_handoff.rs`). A default-form lock of a `HashText`
/// key, cut off while it waits, is drained: no statement of its may run
/// behind an idle answer, or the pooler gives the next client a server
/// connection inside the lock's transaction, the lock's answer as its own.
/// Here, through a pooler of one server connection, on connections the
/// `SessionLock` opens and on a deadpool pool's: the lock waits for a key
/// held elsewhere and is cut off; the next client reads its own answer,
/// and once the key is let go nothing holds it (on a pool's connection,
/// once the server has ended the wait's slice, with no cancel request).
/// (The facts the lock reads beside its query went out at once ahead of
/// it, and the next client read the lock's set-up row.)
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_lock_leaves_no_statement_to_the_pooler_s_next_client() {
    use lockkit::key::HashText;
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    for round in 0..6 {
        let bouncer = PgBouncer::one_server_connection(db);
        // Connections of its own, and leased from a deadpool pool.
        let sessions = if round % 2 == 0 {
            SessionLock::new(bouncer.config())
        } else {
            SessionLock::from_pool(pool_of(bouncer.config(), 2))
        };
        // The server's facts on hand, as after any first lock.
        let warm = sessions.lock(Leader { id: 700 + round }).await.unwrap();
        assert!(warm.release().await.unwrap());

        let text = format!("lockkit-tests/pooler-handoff/{round}");
        let key = HashText(&text).lock_key();
        let mut holder = db.connect().await;
        let held = holder.transaction().await.unwrap();
        let lockkit::LockKey::BigInt(k) = key else {
            unreachable!("a HashText key is a BigInt")
        };
        held.execute("SELECT pg_advisory_xact_lock($1)", &[&k])
            .await
            .unwrap();
        {
            let lock = sessions.lock(HashText(&text));
            tokio::pin!(lock);
            tokio::select! {
                r = &mut lock => panic!("granted while held elsewhere: {:?}", r.map(|_| ())),
                () = lockkit_tests::observe::wait_until_key_waited(&observer, key) => {}
            }
        } // Cut off while it waits.

        let b = bouncer.connect().await;
        let answer = tokio::spawn(async move { simple_value(&b, "SELECT 'of B'").await });
        if round % 2 == 1 {
            // No cancel request: the server ends the wait at its slice.
            lockkit_tests::observe::until_key_not_waited(&observer, key)
                .await
                .unwrap();
        }
        held.rollback().await.unwrap();
        let answer = tokio::time::timeout(PATIENT, answer)
            .await
            .expect("B is answered")
            .expect("B's task")
            .map_err(|e| e.to_string());
        assert_eq!(answer, Ok(Some("of B".to_owned())), "round {round}");
        assert_eq!(
            granted(&observer, key).await,
            0,
            "round {round}: nothing holds the key"
        );
    }
}

/// Lock calls of a `SessionLock` on a deadpool pool, cut off at once or
/// within a few milliseconds while another session holds the key, through
/// pgbouncer 1.18 in transaction mode: 8 tasks of 50 calls each. A cancel
/// request whose client closes before pgbouncer 1.18 forwarded it kills
/// that pgbouncer (`FATAL … disconnect_client(): bad client state: 0`,
/// pgbouncer's issue 801), and every client of the pooler with it. So a
/// cut-off call sends none: its wait is bounded on the server (slices),
/// and its connection is drained, rolled back behind the statement and
/// returned to the pool, never closed under it. Checks: the pooler still
/// serves, no cancel request reached it (its log), it closed no server
/// connection under a statement whose client left, and every wait ends
/// while the holder still holds the key. Closing a cut-off take's connection at once (`.ci/mutations "cut-off
/// take closed at once"`) fails it.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_pooled_lock_calls_leave_the_shared_pooler_serving() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let bouncer = PgBouncer::builder(db).default_pool_size(4).start();
    let sessions = SessionLock::from_pool(pool_of(bouncer.config(), 16)).keepalive(PATIENT);
    let key = Leader { id: 79_500 };
    let mut holder = db.connect().await;
    let held = holder.transaction().await.unwrap();
    let lockkit::LockKey::BigInt(k) = key.lock_key() else {
        unreachable!("a Leader key is a BigInt")
    };
    held.execute("SELECT pg_advisory_xact_lock($1)", &[&k])
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..8_u64 {
        let sessions = sessions.clone();
        tasks.push(tokio::spawn(async move {
            for j in 0..50_u64 {
                let wait = Duration::from_millis((i * 50 + j * 7) % 60);
                let cut = tokio::time::timeout(wait, sessions.lock(key)).await;
                assert!(!matches!(cut, Ok(Ok(_))), "granted a held key");
            }
        }));
    }
    for task in tasks {
        task.await.expect("a task panicked");
    }
    let ended = lockkit_tests::observe::until_key_not_waited(&observer, key.lock_key()).await;
    held.rollback().await.unwrap();
    bouncer.serving().await.unwrap();
    let cancels = bouncer.cancel_lines();
    assert!(
        cancels.is_empty(),
        "cancel requests reached the pooler: {cancels:?}"
    );
    ended.unwrap();
    until_free(&observer, key.lock_key()).await;
    bouncer.assert_no_abrupt_closes();
}

/// A session-level lock on a connection leased from a deadpool pool, cut
/// off while it waits for a key held elsewhere: it sends no cancel request
/// (`cut_off_pooled_lock_calls_leave_the_shared_pooler_serving`), and the
/// server ends the wait while the key is still held, at the end of the
/// slice the form set as the session's `lock_timeout` for the wait; the
/// drained connection is unlocked and reset behind it, and goes back to
/// the pool. Without the slices (`.ci/mutations "session-level slices"`),
/// the session waited for the key until its holder let go (30 s here).
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_session_level_lock_on_a_pool_s_connection_stops_waiting() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = SessionLock::from_pool(pool_of(db.config(), 2))
        .form(SessionForm::SessionLevel)
        // A direct server; the probe would need a second connection.
        .pooler_check(false);
    let key = Leader { id: 79_600 };
    let holder = SessionLock::new(db.config());
    let held = holder.lock(key).await.unwrap();
    for round in 0..3 {
        {
            let lock = sessions.lock(key);
            tokio::pin!(lock);
            tokio::select! {
                r = &mut lock => panic!("granted while held elsewhere: {:?}", r.map(|_| ())),
                () = lockkit_tests::observe::wait_until_key_waited(&observer, key.lock_key()) => {}
            }
        } // Cut off while it waits.
        lockkit_tests::observe::until_key_not_waited(&observer, key.lock_key())
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    assert!(held.release().await.unwrap());
    until_free(&observer, key.lock_key()).await;
}
