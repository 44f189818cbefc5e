//! Migrations (issue 14): one migrator of 8 at a time, directly and
//! through transaction-mode pgbouncer, on the default session-duration
//! lock (the DDL helper is tested in `ddl.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockkit::pg::{Migration, MigrationError, MigrationGuard, WhenBusy};
use lockkit::{AdvisoryKey, SessionLock};
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
