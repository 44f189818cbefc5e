//! A plain SQL migration, run through psql, waits for a Rust worker that
//! holds the same entity: both compute the key of `Order { id: 42 }`, the
//! worker with `#[derive(AdvisoryKey)]`, the migration with lockkit's SQL
//! functions (`lockkit::sql`, docs/KEYS.md).
//!
//! ```sh
//! cargo run -p lockkit-examples --bin sql_migration
//! ```
//!
//! The worker locks order 42 and works on it. A migration for order 7 (the
//! control: another key) runs at once. The migration for order 42 is seen
//! waiting in `pg_locks` on the worker's very key, and goes on only when the
//! worker commits: its update lands after the worker's, never in the middle
//! of it. psql is found on `PATH` (or set `PSQL`).

use std::io::Write as _;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Config, LockKey, Locker};
use lockkit_examples::Database;
use tokio_postgres::Client;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The worker's key type: the SQL side computes its key as
/// `lockkit.key('Order', lockkit.int(id))`.
#[derive(AdvisoryKey, Debug, Clone, Copy)]
struct Order {
    id: i64,
}

/// The migration script, as a DBA would write it: take the order's lock
/// (waiting for whoever holds it), then change the order.
fn migration(order_id: i64) -> String {
    format!(
        "\\set ON_ERROR_STOP on
BEGIN;
-- The same key as the Rust service's Order {{ id: {order_id} }}.
SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int({order_id}::int8)));
UPDATE orders SET history = array_append(history, 'migration') WHERE id = {order_id};
COMMIT;
"
    )
}

/// How long the example waits for any one event before it gives up.
const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> ExitCode {
    let db = Database::from_env(&[]);
    match run(&db).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("sql_migration: the scenario did not go as described");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("sql_migration: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(db: &Database) -> Result<bool, BoxError> {
    let start = Instant::now();
    let say = |what: &str| println!("[{:>7.3}s] {what}", start.elapsed().as_secs_f64());
    let admin = db.connect().await?;
    lockkit::sql::install(&admin).await?;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS orders;
             CREATE TABLE orders (id int8 PRIMARY KEY, history text[] NOT NULL DEFAULT '{}');
             INSERT INTO orders (id) VALUES (42), (7);",
        )
        .await?;
    let sql_key: i64 = admin
        .query_one("SELECT lockkit.key('Order', lockkit.int(42::int8))", &[])
        .await?
        .get(0);
    let key = Order { id: 42 }.lock_key();
    say(&format!(
        "installed lockkit's SQL functions; Order {{ id: 42 }} is {key} in Rust and {sql_key} in SQL"
    ));
    let same_key = key == LockKey::BigInt(sql_key);

    // The worker holds order 42 until told to finish.
    let locker = Locker::new(&admin, Config::default()).await?;
    let mut worker = db.connect().await?;
    let worker_pid: i32 = worker
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let tx = locker.begin(&mut worker).await?;
    let held = tx.lock(Order { id: 42 }).await?;
    say("worker: holds Order { id: 42 }, working on it");

    // The control: a migration of order 7 takes another key and does not
    // wait for the worker.
    let mut control = Psql::start(db, "lockkit-example-control", &migration(7))?;
    let status = control.finish().await?;
    let still_held = holds(&admin, worker_pid, key).await?;
    say(&format!(
        "control: the migration of order 7 finished ({status}) while the worker still holds order 42"
    ));
    let control_ok = status.success() && still_held;

    // The migration of order 42 waits for the worker, on the worker's key.
    let mut migration42 = Psql::start(db, "lockkit-example-migration", &migration(42))?;
    let waiting =
        wait_until_waiting(&admin, &mut migration42, "lockkit-example-migration", key).await?;
    if waiting {
        say("psql: the migration of order 42 waits in pg_locks on the worker's key");
    }
    tx.execute(
        "UPDATE orders SET history = array_append(history, 'worker') WHERE id = $1",
        &[&held.id],
    )
    .await?;
    let still_waiting = migration42.0.try_wait()?.is_none();
    drop(held);
    tx.commit().await?;
    say("worker: committed, which released the lock");
    let status = migration42.finish().await?;
    say(&format!(
        "psql: the migration of order 42 finished ({status})"
    ));

    let history: Vec<String> = admin
        .query_one("SELECT history FROM orders WHERE id = 42", &[])
        .await?
        .get(0);
    let history7: Vec<String> = admin
        .query_one("SELECT history FROM orders WHERE id = 7", &[])
        .await?
        .get(0);
    println!("\norder 42 history, in order: {history:?}; order 7: {history7:?}");
    Ok(same_key
        && control_ok
        && waiting
        && still_waiting
        && status.success()
        && history == ["worker", "migration"]
        && history7 == ["migration"])
}

/// A psql process running a script; killed if dropped while it runs (an
/// early return of the example).
struct Psql(Child);

impl Psql {
    /// Starts psql on `script` (from its stdin), as `application_name`.
    fn start(db: &Database, application_name: &str, script: &str) -> Result<Psql, BoxError> {
        let program = std::env::var("PSQL").unwrap_or_else(|_| "psql".into());
        let mut child = Command::new(&program)
            .args(["-X", "-q", "-d", db.url()])
            .env("PGAPPNAME", application_name)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {program} (set PSQL to its path): {e}"))?;
        let mut stdin = child.stdin.take().ok_or("psql has no stdin")?;
        let psql = Psql(child);
        // A few hundred bytes: the pipe takes them whole. Closing stdin
        // ends the script.
        stdin.write_all(script.as_bytes())?;
        drop(stdin);
        Ok(psql)
    }

    /// Waits (at most `PATIENCE`) for psql to end.
    async fn finish(&mut self) -> Result<ExitStatus, BoxError> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.0.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(format!("psql did not end within {PATIENCE:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Psql {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Whether backend `pid` holds `key`.
async fn holds(client: &Client, pid: i32, key: LockKey) -> Result<bool, BoxError> {
    let id = key.to_pg_locks();
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = $1 AND classid = $2 AND objid = $3 AND objsubid = $4",
            &[&pid, &id.classid, &id.objid, &id.objsubid],
        )
        .await?;
    Ok(row.get::<_, i64>(0) == 1)
}

/// Waits until the session of `application_name` waits in `pg_locks` for
/// `key`; false if psql ends first or `PATIENCE` runs out.
async fn wait_until_waiting(
    client: &Client,
    psql: &mut Psql,
    application_name: &str,
    key: LockKey,
) -> Result<bool, BoxError> {
    let id = key.to_pg_locks();
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $1 \
                 AND l.classid = $2 AND l.objid = $3 AND l.objsubid = $4",
                &[&application_name, &id.classid, &id.objid, &id.objsubid],
            )
            .await?;
        if row.get::<_, i64>(0) == 1 {
            return Ok(true);
        }
        if let Some(status) = psql.0.try_wait()? {
            eprintln!("psql ended ({status}) without waiting for the worker");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("psql was not seen waiting within {PATIENCE:?}");
    Ok(false)
}
