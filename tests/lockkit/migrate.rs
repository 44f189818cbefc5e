//! Migrations (issue 14): one migrator of 8 at a time, directly and
//! through transaction-mode pgbouncer, on the default session-duration
//! lock; the DDL helper gives up at its deadline with a typed error,
//! succeeds once the long reader ends, and keeps new readers from queueing
//! behind it for longer than its lock timeout, where a plain `ALTER TABLE`
//! stalls them for the long reader's whole duration (the control).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{
    run_ddl, AdvisoryKey, DdlError, DdlPolicy, Migration, MigrationError, MigrationGuard,
    SessionLock, WhenBusy,
};
use lockkit_tests::{PgBouncer, TestServer};
use tokio::sync::{Barrier, Notify};
use tokio_postgres::{Client, Config, NoTls};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/migrations")]
struct Schema {
    fleet: i64,
}

async fn connect(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// The migrations, in order: each recorded in `schema_migrations`.
const MIGRATIONS: [&str; 3] = [
    "CREATE TABLE accounts (id bigint PRIMARY KEY)",
    "ALTER TABLE accounts ADD COLUMN name text",
    "CREATE INDEX accounts_name ON accounts (name)",
];

/// A plain migration runner: applies what `schema_migrations` does not
/// list, each in a transaction; answers how many it applied.
async fn apply_pending(client: &Client) -> Result<usize, tokio_postgres::Error> {
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS schema_migrations (version int PRIMARY KEY)")
        .await?;
    let mut applied = 0;
    for (version, sql) in MIGRATIONS.iter().enumerate() {
        let version = version as i32;
        // Unnamed statements: transaction-mode pgbouncer 1.18 does not
        // keep prepared statements.
        let done: bool = client
            .query_typed(
                "SELECT EXISTS (SELECT 1 FROM schema_migrations WHERE version = $1)",
                &[(&version, tokio_postgres::types::Type::INT4)],
            )
            .await?[0]
            .get(0);
        if !done {
            client
                .batch_execute(&format!(
                    "BEGIN; {sql}; INSERT INTO schema_migrations VALUES ({version}); COMMIT"
                ))
                .await?;
            applied += 1;
        }
    }
    Ok(applied)
}

/// 8 runners start at once through `config`, each guarded by the lock,
/// waiting up to a minute; answers what each applied.
async fn eight_migrators(db: &TestServer, config: Config, dbname: &str) -> Vec<usize> {
    db.create_database(dbname).await;
    let mut config = config;
    config.dbname(dbname);
    let barrier = Arc::new(Barrier::new(8));
    let inside = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let mut runners = Vec::new();
    for _ in 0..8 {
        let (config, barrier, inside, max) =
            (config.clone(), barrier.clone(), inside.clone(), max.clone());
        runners.push(tokio::spawn(async move {
            let client = connect(&config).await;
            let guard = MigrationGuard::new(SessionLock::new(config), Schema { fleet: 1 })
                .when_busy(WhenBusy::Wait(Duration::from_secs(60)));
            barrier.wait().await;
            let ran = guard
                .run(async || {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    max.fetch_max(now, Ordering::SeqCst);
                    let applied = apply_pending(&client).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    applied
                })
                .await
                .expect("migrations");
            let Migration::Ran(applied) = ran else {
                panic!("a waiting runner skipped")
            };
            // Proceeding, it sees the whole schema.
            let versions: i64 = client
                .query_typed("SELECT count(*) FROM schema_migrations", &[])
                .await
                .unwrap()[0]
                .get(0);
            assert_eq!(versions, MIGRATIONS.len() as i64);
            client
                .query_typed("SELECT id, name FROM accounts", &[])
                .await
                .unwrap();
            applied
        }));
    }
    let mut applied = Vec::new();
    for runner in runners {
        applied.push(runner.await.unwrap());
    }
    assert_eq!(max.load(Ordering::SeqCst), 1, "two runners at once");
    applied
}

#[tokio::test(flavor = "multi_thread")]
async fn exactly_one_of_eight_migrates_directly_and_behind_transaction_pgbouncer() {
    let db = TestServer::shared();
    let _log = db.guard();
    let direct = eight_migrators(db, db.config(), "migrate_direct").await;
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(3)
        .start();
    let pooled = eight_migrators(db, bouncer.config(), "migrate_pgbouncer").await;
    for applied in [direct, pooled] {
        let mut applied = applied;
        applied.sort_unstable();
        assert_eq!(applied, [0, 0, 0, 0, 0, 0, 0, MIGRATIONS.len()]);
    }
}

/// With `Skip`, the runner holds the lock until the 7 others skipped:
/// exactly one ran. The control, each runner with a key of its own, runs
/// all 8.
#[tokio::test(flavor = "multi_thread")]
async fn the_others_skip() {
    let db = TestServer::shared();
    let _log = db.guard();
    for (shared_key, expected_ran) in [(true, 1), (false, 8)] {
        let skipped = Arc::new(AtomicUsize::new(0));
        let all_skipped = Arc::new(Notify::new());
        let barrier = Arc::new(Barrier::new(8));
        let mut runners = Vec::new();
        for i in 0..8 {
            let (skipped, all_skipped, barrier) =
                (skipped.clone(), all_skipped.clone(), barrier.clone());
            let fleet = if shared_key { 2 } else { 100 + i };
            let guard = MigrationGuard::new(SessionLock::new(db.config()), Schema { fleet })
                .when_busy(WhenBusy::Skip);
            runners.push(tokio::spawn(async move {
                barrier.wait().await;
                let outcome = guard
                    .run(async || {
                        if shared_key {
                            // Hold the lock until every other runner skipped.
                            while skipped.load(Ordering::SeqCst) < 7 {
                                let notified = all_skipped.notified();
                                if skipped.load(Ordering::SeqCst) >= 7 {
                                    break;
                                }
                                notified.await;
                            }
                        }
                        Ok::<_, std::convert::Infallible>(())
                    })
                    .await
                    .unwrap();
                if outcome == Migration::Skipped {
                    skipped.fetch_add(1, Ordering::SeqCst);
                    all_skipped.notify_waiters();
                }
                outcome
            }));
        }
        let mut ran = 0;
        for runner in runners {
            ran += usize::from(runner.await.unwrap() == Migration::Ran(()));
        }
        assert_eq!(ran, expected_ran, "shared key: {shared_key}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bounded_wait_times_out_with_a_typed_error() {
    let db = TestServer::shared();
    let _log = db.guard();
    let sessions = SessionLock::new(db.config());
    let holder = sessions.lock(Schema { fleet: 3 }).await.unwrap();
    let result = MigrationGuard::new(sessions, Schema { fleet: 3 })
        .when_busy(WhenBusy::Wait(Duration::from_millis(100)))
        .run(async || Ok::<_, std::convert::Infallible>(()))
        .await;
    match result {
        Err(MigrationError::Lock(e)) => assert!(e.is_timeout(), "{e}"),
        other => panic!("expected a lock timeout, got {other:?}"),
    }
    assert!(holder.release().await.unwrap());
}

/// A table, a long reader holding it (`ACCESS SHARE`, in an open
/// transaction), and the reader's backend pid.
async fn table_with_long_reader(db: &TestServer, name: &str) -> (Config, Client, i32) {
    let url = db.create_database(name).await;
    let config: Config = url.parse().unwrap();
    let setup = connect(&config).await;
    setup
        .batch_execute("CREATE TABLE t (id int); INSERT INTO t SELECT generate_series(1, 100)")
        .await
        .unwrap();
    let long = connect(&config).await;
    long.batch_execute("BEGIN; SELECT count(*) FROM t")
        .await
        .unwrap();
    let pid: i32 = long
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (config, long, pid)
}

#[tokio::test(flavor = "multi_thread")]
async fn ddl_gives_up_at_its_deadline_and_succeeds_once_the_reader_ends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (config, long, _) = table_with_long_reader(db, "ddl_deadline").await;
    let migrator = connect(&config).await;
    let policy = DdlPolicy::default()
        .lock_timeout(Duration::from_millis(50))
        .deadline(Duration::from_millis(600))
        .backoff(Duration::from_millis(20), Duration::from_millis(100));

    let err = run_ddl(&migrator, "ALTER TABLE t ADD COLUMN a int", &policy)
        .await
        .unwrap_err();
    match &err {
        DdlError::Deadline { attempts, last, .. } => {
            assert!(*attempts >= 2, "{err}");
            assert_eq!(last.code(), Some("55P03"), "{last}");
        }
        other => panic!("expected the deadline, got {other:?}"),
    }
    // Nothing changed, and the migrator's connection is usable.
    let columns: i64 = migrator
        .query_one(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 't'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(columns, 1);

    // With a long deadline, it succeeds once the reader ends: end it when
    // the helper is seen waiting for its lock.
    let migrator_pid: i32 = migrator
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let policy = policy.deadline(Duration::from_secs(60));
    let ddl = tokio::spawn(async move {
        let report = run_ddl(&migrator, "ALTER TABLE t ADD COLUMN a int", &policy).await;
        (report, migrator)
    });
    let observer = connect(&config).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: bool = observer
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)",
                &[&migrator_pid],
            )
            .await
            .unwrap()
            .get(0);
        if waiting {
            break;
        }
        assert!(Instant::now() < deadline, "the DDL was never seen waiting");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    long.batch_execute("COMMIT").await.unwrap();
    let (report, migrator) = ddl.await.unwrap();
    let report = report.unwrap();
    assert!(report.attempts >= 1);
    migrator.query("SELECT a FROM t", &[]).await.unwrap();
}

/// Readers of `t` on `readers` connections, each recording its longest
/// query, until `stop` is notified.
async fn readers(
    config: &Config,
    n: usize,
    stop: Arc<Notify>,
) -> Vec<tokio::task::JoinHandle<(Duration, i32)>> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let client = connect(config).await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let pid: i32 = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .unwrap()
                .get(0);
            let mut longest = Duration::ZERO;
            let stopped = stop.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            loop {
                let started = Instant::now();
                let stop = tokio::select! {
                    // A query that completed counts, even if stop came too;
                    // one still in flight counts for its wait so far.
                    biased;
                    r = client.query_one("SELECT count(*) FROM t", &[]) => {
                        r.unwrap();
                        false
                    }
                    _ = &mut stopped => true,
                };
                longest = longest.max(started.elapsed());
                if stop {
                    break;
                }
            }
            (longest, pid)
        }));
    }
    tasks
}

#[tokio::test(flavor = "multi_thread")]
async fn readers_are_not_stalled_by_the_ddl_helper_but_are_by_a_plain_alter() {
    const LOCK_TIMEOUT: Duration = Duration::from_millis(100);
    const MARGIN: Duration = Duration::from_millis(900);
    const LONG_READER_AFTER_STALL: Duration = Duration::from_secs(3);
    let db = TestServer::shared();
    let _log = db.guard();
    let (config, long, _) = table_with_long_reader(db, "ddl_readers").await;

    // The helper retries for 2 s against the long reader.
    let stop = Arc::new(Notify::new());
    let tasks = readers(&config, 4, stop.clone()).await;
    let migrator = connect(&config).await;
    let policy = DdlPolicy::default()
        .lock_timeout(LOCK_TIMEOUT)
        .deadline(Duration::from_secs(2))
        .backoff(Duration::from_millis(20), Duration::from_millis(200));
    let err = run_ddl(&migrator, "ALTER TABLE t ADD COLUMN b int", &policy)
        .await
        .unwrap_err();
    assert!(matches!(err, DdlError::Deadline { .. }), "{err}");
    stop.notify_waiters();
    for task in tasks {
        let (longest, _) = task.await.unwrap();
        assert!(
            longest < LOCK_TIMEOUT + MARGIN,
            "a reader waited {longest:?} behind the helper"
        );
    }

    // Control: a plain ALTER TABLE queues behind the long reader, and the
    // new readers queue behind it until the long reader ends.
    let stop = Arc::new(Notify::new());
    let tasks = readers(&config, 4, stop.clone()).await;
    let plain = connect(&config).await;
    let alter = tokio::spawn(async move {
        plain
            .batch_execute("ALTER TABLE t ADD COLUMN c int")
            .await
            .unwrap();
    });
    let observer = connect(&config).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Wait until a reader (not the ALTER) is seen blocked behind the queue.
    loop {
        let blocked: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query = 'SELECT count(*) FROM t'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if blocked > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no reader was seen blocked");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let stalled_since = Instant::now();
    tokio::time::sleep(LONG_READER_AFTER_STALL).await;
    long.batch_execute("COMMIT").await.unwrap();
    alter.await.unwrap();
    let stalled = stalled_since.elapsed();
    stop.notify_waiters();
    let mut longest = Duration::ZERO;
    for task in tasks {
        longest = longest.max(task.await.unwrap().0);
    }
    assert!(
        longest >= LONG_READER_AFTER_STALL,
        "the control did not stall the readers: longest {longest:?} of {stalled:?}"
    );
}
