//! Migrations from the design notes: one migrator per fleet, and DDL that
//! never stalls the lock queue.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin migrate
//! ```
//!
//! 1. Six application instances start at once, each connecting through
//!    pgbouncer in transaction mode, and each runs its migrations inside a
//!    `lockkit::pg::MigrationGuard`. Exactly one applies them (recorded in
//!    `schema_migrations`); the others find nothing left to do and see the
//!    schema when they proceed.
//! 2. A long reader holds `accounts` (an open transaction after a SELECT)
//!    for about 1.5 s while new readers keep arriving. An `ALTER TABLE`
//!    through `lockkit::pg::run_ddl` (50 ms `lock_timeout`, retried) keeps their
//!    p99 latency low; the control, a plain `ALTER TABLE`, queues for its
//!    ACCESS EXCLUSIVE lock and blocks every new reader behind it for the
//!    long reader's whole duration.
//!
//! It starts a throwaway server and a pgbouncer (`apt-get install
//! pgbouncer`), and exits non-zero when an outcome is not as described.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::key::HashText;
use lockkit::pg::{DdlRetry, Migration, MigrationGuard, WhenBusy};
use lockkit::SessionLock;
use lockkit_tests::{PgBouncer, TestServer};
use tokio::sync::Barrier;
use tokio_postgres::{Client, Config, NoTls};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const INSTANCES: usize = 6;
const LONG_READ: Duration = Duration::from_millis(1500);
const READERS: usize = 4;

/// The application's migrations, in order: (version, SQL).
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    ),
    (
        2,
        "INSERT INTO accounts SELECT g, 100 FROM generate_series(1, 1000) g",
    ),
    (3, "CREATE INDEX accounts_balance ON accounts (balance)"),
];

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("migrate: the scenario did not go as described");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("migrate: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<bool, BoxError> {
    let server = TestServer::builder().start();
    let bouncer = PgBouncer::builder(&server)
        .pool_mode("transaction")
        .default_pool_size(10)
        .start();

    println!("1. {INSTANCES} instances start at once, through transaction-mode pgbouncer.");
    let barrier = Arc::new(Barrier::new(INSTANCES));
    let instances: Vec<_> = (0..INSTANCES)
        .map(|i| {
            let (config, barrier) = (bouncer.config(), barrier.clone());
            tokio::spawn(async move { instance(i, config, &barrier).await })
        })
        .collect();
    let mut migrators = 0;
    let mut all_see_schema = true;
    for task in instances {
        let (applied, sees_schema) = task.await??;
        migrators += usize::from(applied > 0);
        all_see_schema &= sees_schema;
    }
    println!("   → {migrators} of {INSTANCES} applied migrations; all saw the schema: {all_see_schema}\n");

    println!("2. A long reader holds accounts for {LONG_READ:?} while new readers arrive.");
    let config = server.config();
    let helper = stall(&config, "ALTER TABLE accounts ADD COLUMN note text", true).await?;
    let control = stall(&config, "ALTER TABLE accounts ADD COLUMN memo text", false).await?;
    let ok = migrators == 1 && all_see_schema && helper < control / 2;
    println!(
        "{}",
        if ok {
            "As the notes say: one migrator per fleet, and a DDL with a short lock_timeout does not stall its table's readers."
        } else {
            "Unexpected outcome: see above."
        }
    );
    Ok(ok)
}

/// One application instance: migrates under the guard, then checks that it
/// sees the schema. Returns (migrations it applied, whether it sees them).
async fn instance(i: usize, config: Config, barrier: &Barrier) -> Result<(usize, bool), BoxError> {
    let client = connect(&config).await?;
    let guard = MigrationGuard::new(SessionLock::new(config), HashText("myapp/migrations"))
        .when_busy(WhenBusy::Wait(Duration::from_secs(30)));
    barrier.wait().await;
    let applied = match guard.run(async || apply(&client).await).await? {
        Migration::Ran(applied) => applied,
        Migration::Skipped => 0,
    };
    let index = rows(
        &client,
        "SELECT 1 WHERE to_regclass('accounts_balance') IS NOT NULL",
    )
    .await?;
    let recorded = rows(&client, "SELECT version FROM schema_migrations").await?;
    let sees = index == 1 && recorded == MIGRATIONS.len();
    println!("   instance {i}: applied {applied} migration(s); sees the schema: {sees}");
    Ok((applied, sees))
}

/// Applies the migrations `schema_migrations` does not list, each in a
/// transaction of its own with its record.
async fn apply(client: &Client) -> Result<usize, tokio_postgres::Error> {
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS schema_migrations (version int PRIMARY KEY)")
        .await?;
    let mut applied = 0;
    for (version, sql) in MIGRATIONS {
        // Simple queries: no prepared statements through the pooler.
        let done = rows(
            client,
            &format!("SELECT 1 FROM schema_migrations WHERE version = {version}"),
        )
        .await?
            > 0;
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

/// Runs `ddl` (through `run_ddl` or plainly) while a long reader holds the
/// table and new readers keep arriving; returns the p99 latency of the
/// readers that started while the DDL ran.
async fn stall(config: &Config, ddl: &'static str, helper: bool) -> Result<Duration, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..READERS {
        let (client, stop) = (connect(config).await?, stop.clone());
        readers.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                client
                    .query_one("SELECT count(*) FROM accounts", &[])
                    .await?;
                samples.push((start, start.elapsed()));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok::<_, tokio_postgres::Error>(samples)
        }));
    }
    let long = connect(config).await?;
    long.batch_execute("BEGIN; SELECT count(*) FROM accounts")
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let began = Instant::now();
    let mut ddl_client = connect(config).await?;
    let ddl_task = tokio::spawn(async move {
        if helper {
            let retry = DdlRetry::default()
                .lock_timeout(Duration::from_millis(50))
                .deadline(Duration::from_secs(30));
            lockkit::pg::run_ddl(&mut ddl_client, ddl, &retry).await?;
        } else {
            ddl_client.batch_execute(ddl).await?;
        }
        Ok::<_, BoxError>(())
    });
    tokio::time::sleep(LONG_READ).await;
    long.batch_execute("COMMIT").await?;
    ddl_task.await??;
    let ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, Ordering::Relaxed);

    let mut during = Vec::new();
    for reader in readers {
        let samples = reader.await??;
        during.extend(
            samples
                .into_iter()
                .filter(|(s, _)| *s >= began && *s < ended)
                .map(|(_, d)| d),
        );
    }
    during.sort();
    let p99 = during
        .get((during.len() * 99).div_ceil(100).saturating_sub(1))
        .copied()
        .ok_or("no reader started while the DDL ran")?;
    println!(
        "   {}: {} readers' queries during the DDL, p99 {:.1} ms",
        if helper {
            "run_ddl"
        } else {
            "plain ALTER TABLE (control)"
        },
        during.len(),
        ms(p99)
    );
    Ok(p99)
}

/// The number of rows of a simple query (no prepared statement, so it also
/// works through a transaction-mode pooler).
async fn rows(client: &Client, sql: &str) -> Result<usize, tokio_postgres::Error> {
    let messages = client.simple_query(sql).await?;
    Ok(messages
        .iter()
        .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
        .count())
}

async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
