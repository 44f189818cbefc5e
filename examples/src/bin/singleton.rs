//! "Only one payroll run at a time": a singleton job behind a
//! session-duration advisory try-lock, from the design notes. lockkit's
//! default form holds `pg_advisory_xact_lock` in a transaction kept open on
//! a connection of its own, so it is also safe behind a transaction-mode
//! pooler.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin singleton
//! ```
//!
//! 1. Two payroll runners start at the same moment: one gets the lock and
//!    runs, the other skips at once (no queue of runs piling up).
//! 2. A runner panics mid-run: its lock goes with its transaction, and the
//!    next runner gets it.
//! 3. Why lockkit owns the connection: a raw `pg_advisory_lock` on a shared
//!    connection that "forgets" its unlock after an error blocks every later
//!    run on that key, until someone unlocks that connection by hand.
//!
//! The key is `HashText("payroll-1405-01")`, equal to the server's
//! `hashtext('payroll-1405-01')`, so it also excludes legacy SQL that runs
//! `pg_try_advisory_lock(hashtext('payroll-1405-01'))`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::key::HashText;
use lockkit::SessionLock;
use lockkit_examples::Database;
use tokio::sync::Barrier;
use tokio_postgres::Client;

const PERIOD: &str = "payroll-1405-01";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Clock(Instant);

impl Clock {
    fn say(&self, who: &str, what: impl std::fmt::Display) {
        println!("[{:>7.3}s] {who:<9} {what}", self.0.elapsed().as_secs_f64());
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // runner-c's panic is part of the story: one line, no backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map_or("panic", String::as_str);
        println!("           (panic: {msg})");
    }));
    let db = Database::from_env(&[]);
    match run(&db).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("singleton: the scenario did not go as described");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("singleton: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(db: &Database) -> Result<bool, BoxError> {
    let admin = db.connect().await?;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS payroll_runs;
             CREATE TABLE payroll_runs (period text NOT NULL, runner text NOT NULL,
                                        finished_at timestamptz NOT NULL DEFAULT now());",
        )
        .await?;
    let sessions = SessionLock::new(db.config());
    let clock = Arc::new(Clock(Instant::now()));

    println!("1. Two runners start at the same moment.");
    let barrier = Arc::new(Barrier::new(2));
    let runs: Vec<_> = ["runner-a", "runner-b"]
        .into_iter()
        .map(|name| {
            let (sessions, barrier, clock) = (sessions.clone(), barrier.clone(), clock.clone());
            let db_config = db.config();
            tokio::spawn(async move {
                barrier.wait().await;
                payroll(name, &sessions, &clock, &db_config, false).await
            })
        })
        .collect();
    let mut ran = 0;
    for r in runs {
        ran += usize::from(r.await??);
    }
    let recorded = count_runs(&admin).await?;
    println!("   → {ran} of 2 runners ran; payroll_runs has {recorded} row(s) for {PERIOD}.\n");

    println!("2. A runner panics mid-run.");
    let crashing = {
        let (sessions, clock, db_config) = (sessions.clone(), clock.clone(), db.config());
        tokio::spawn(async move { payroll("runner-c", &sessions, &clock, &db_config, true).await })
    };
    let panicked = crashing.await.is_err();
    clock.say(
        "runner-c",
        "panicked: its guard dropped and ended the lock's transaction",
    );
    let start = Instant::now();
    let guard = sessions
        .lock_timeout(HashText(PERIOD), Duration::from_secs(5))
        .await?;
    clock.say(
        "runner-d",
        format_args!(
            "got the lock {:.1} ms later (released with runner-c's transaction)",
            start.elapsed().as_secs_f64() * 1000.0
        ),
    );
    let held_by_d = guard.release().await?;
    println!();

    println!("3. Without lockkit: a raw session lock on a shared connection, and an error path that skips the unlock.");
    let pooled = db.connect().await?;
    let leaked = raw_run_forgetting_unlock(&pooled, &clock).await?;
    let other = db.connect().await?;
    let blocked = !try_raw(&other).await?;
    clock.say(
        "runner-f",
        if blocked {
            "pg_try_advisory_lock(hashtext('payroll-1405-01')) = false: blocked by a run that ended long ago"
        } else {
            "got the lock (unexpected)"
        },
    );
    let excluded_by_lockkit = sessions.try_lock(HashText(PERIOD)).await?.is_err();
    clock.say(
        "runner-g",
        if excluded_by_lockkit {
            "lockkit's SessionLock sees the same key as busy too (it is the server's hashtext)"
        } else {
            "lockkit got the lock (unexpected)"
        },
    );
    pooled
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await?;
    clock.say(
        "ops",
        "ran pg_advisory_unlock_all() on the pooled connection by hand",
    );
    let freed = try_raw(&other).await?;
    other
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await?;
    println!();

    let ok = ran == 1
        && recorded == 1
        && panicked
        && held_by_d
        && leaked
        && blocked
        && excluded_by_lockkit
        && freed;
    println!(
        "{}",
        if ok {
            "As the notes say: one payroll run at a time, a crash cannot leave the lock behind with lockkit's session locks, and a raw session lock can."
        } else {
            "Unexpected outcome: see above."
        }
    );
    Ok(ok)
}

/// One payroll run: skips when another run holds the lock.
async fn payroll(
    name: &str,
    sessions: &SessionLock,
    clock: &Clock,
    db_config: &tokio_postgres::Config,
    crash: bool,
) -> Result<bool, BoxError> {
    let Ok(guard) = sessions.try_lock(HashText(PERIOD)).await? else {
        clock.say(
            name,
            format_args!("another payroll run for {PERIOD} is in progress: skipping"),
        );
        return Ok(false);
    };
    clock.say(
        name,
        format_args!(
            "got the lock (backend {}, {:?} form, 'idle in transaction' in pg_stat_activity), running payroll…",
            guard.backend_pid(),
            guard.form()
        ),
    );
    // The run's own work goes through another connection (a pool, in a
    // service); the lock's connection only holds the lock.
    let (client, connection) = db_config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    tokio::time::sleep(Duration::from_millis(500)).await;
    if crash {
        panic!("{name}: simulated crash in the middle of the payroll run");
    }
    client
        .execute(
            "INSERT INTO payroll_runs (period, runner) VALUES ($1, $2)",
            &[&PERIOD, &name],
        )
        .await?;
    let held = guard.release().await?;
    clock.say(
        name,
        format_args!("done, lock released (held until now: {held})"),
    );
    Ok(true)
}

async fn count_runs(client: &Client) -> Result<i64, BoxError> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM payroll_runs WHERE period = $1",
            &[&PERIOD],
        )
        .await?
        .get(0))
}

/// A run written with raw SQL: session lock, then a failing step whose error
/// path returns before the unlock. The connection goes back to a pool with
/// the lock on it.
async fn raw_run_forgetting_unlock(client: &Client, clock: &Clock) -> Result<bool, BoxError> {
    let got: bool = client
        .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&PERIOD])
        .await?
        .get(0);
    clock.say(
        "runner-e",
        format_args!("pg_try_advisory_lock(hashtext('{PERIOD}')) = {got}"),
    );
    let failed = client
        .batch_execute("BEGIN; SELECT 1 / 0; COMMIT;")
        .await
        .is_err();
    client.batch_execute("ROLLBACK").await?;
    clock.say(
        "runner-e",
        "a step failed (division by zero), the transaction rolled back, the early return skipped pg_advisory_unlock",
    );
    let still_held: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())",
            &[],
        )
        .await?
        .get(0);
    clock.say(
        "runner-e",
        format_args!("connection back to the pool; it still holds the lock: {still_held}"),
    );
    Ok(got && failed && still_held)
}

async fn try_raw(client: &Client) -> Result<bool, BoxError> {
    Ok(client
        .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&PERIOD])
        .await?
        .get(0))
}
