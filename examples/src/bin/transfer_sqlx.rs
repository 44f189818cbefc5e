//! Money transfers with sqlx and lockkit-sqlx: both accounts of a transfer
//! are locked in the global lock order, so transfers running concurrently
//! in both directions between the same accounts never deadlock and never
//! lose money.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin transfer_sqlx
//! cargo run -p lockkit-examples --bin transfer_sqlx -- --transfers-per-task 20  # CI size
//! cargo run -p lockkit-examples --bin transfer_sqlx -- --without-locks  # the control
//! ```
//!
//! Uses `DATABASE_URL` when it is set, else starts a throwaway server. Each
//! transfer reads both balances and writes both computed from what it read
//! (a read-modify-write that loses updates unless the two accounts are
//! locked). `--without-locks` runs the same transfers without the advisory
//! locks: money is created or destroyed, and opposite transfers deadlock on
//! the row locks of their `UPDATE`s.

use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use lockkit_examples::{transfer::Tally, Database};
use lockkit_sqlx::{AdvisoryKey, Batch, Config, Error, Locker, SqlxResultExt};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// The lock key of an account: the same key for every process, driver and
/// version (KEYS.md), so this example excludes transfer_diesel's.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-examples/account")]
struct Account {
    id: i64,
}

const ACCOUNTS: i64 = 4;
const OPENING_CENTS: i64 = 100_000;
const TASKS: usize = 8;

/// Moves `amount` from `from` to `to` in one transaction; `Ok(false)` when
/// the payer cannot afford it.
async fn transfer(
    pool: &PgPool,
    locker: &Locker,
    locked: bool,
    (from, to, amount): (i64, i64, i64),
) -> Result<bool, Error> {
    let mut tx = pool.begin().await.lock_err()?;
    let mut ltx = locker.lock_tx(&mut tx)?;
    // Both accounts, in the global lock order whichever way the money goes.
    let both = Batch::new()
        .with(&Account { id: from })
        .with(&Account { id: to });
    let _held = match locked {
        true => Some(ltx.lock_batch(&both).await?),
        false => None,
    };
    let read = "SELECT cents FROM lockkit_example_accounts WHERE id = $1";
    let payer: i64 = sqlx::query_scalar(read)
        .bind(from)
        .fetch_one(&mut *ltx)
        .await
        .lock_err()?;
    if payer < amount {
        return Ok(false); // dropping the transaction rolls it back
    }
    let payee: i64 = sqlx::query_scalar(read)
        .bind(to)
        .fetch_one(&mut *ltx)
        .await
        .lock_err()?;
    tokio::task::yield_now().await; // widen the race the locks close
    let write = "UPDATE lockkit_example_accounts SET cents = $2 WHERE id = $1";
    for (id, cents) in [(from, payer - amount), (to, payee + amount)] {
        sqlx::query(write)
            .bind(id)
            .bind(cents)
            .execute(&mut *ltx)
            .await
            .lock_err()?;
    }
    // The guards borrow the transaction: the borrow checker sees that none
    // is used after the commit.
    tx.commit().await.lock_err()?; // releases both locks
    Ok(true)
}

async fn total(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT sum(cents)::int8 FROM lockkit_example_accounts")
        .fetch_one(pool)
        .await
        .expect("total")
}

/// The value of `--name N`, else `default`.
fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> ExitCode {
    let locked = !std::env::args().any(|a| a == "--without-locks");
    let per_task = arg("--transfers-per-task", 250);
    let db = Database::from_env(&[("deadlock_timeout", "50ms")]);
    let pool = PgPoolOptions::new()
        .max_connections(TASKS as u32 + 1)
        .connect(db.url())
        .await
        .expect("sqlx pool");
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS lockkit_example_accounts; \
         CREATE TABLE lockkit_example_accounts (id int8 PRIMARY KEY, cents int8 NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("schema");
    sqlx::query(
        "INSERT INTO lockkit_example_accounts SELECT i, $2 FROM generate_series(0, $1 - 1) AS i",
    )
    .bind(ACCOUNTS)
    .bind(OPENING_CENTS)
    .execute(&pool)
    .await
    .expect("accounts");
    let locker = Locker::new(&pool, Config::default()).await.expect("locker");
    let before = total(&pool).await;

    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (pool, locker, tally) = (pool.clone(), locker.clone(), Arc::clone(&tally));
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t as u64);
            for _ in 0..per_task {
                // Half the tasks pay "up", half "down": every pair of
                // accounts sees transfers in both directions at once.
                let a = rng.i64(0..ACCOUNTS - 1);
                let b = rng.i64(a + 1..ACCOUNTS);
                let (from, to) = if t % 2 == 0 { (a, b) } else { (b, a) };
                let amount = rng.i64(1..=5_000);
                match transfer(&pool, &locker, locked, (from, to, amount)).await {
                    Ok(true) => tally.done.fetch_add(1, Relaxed),
                    Ok(false) => tally.insufficient.fetch_add(1, Relaxed),
                    Err(e) if e.is_deadlock() => tally.deadlocks.fetch_add(1, Relaxed),
                    Err(e) => panic!("transfer failed: {e}"),
                };
            }
        }));
    }
    for task in tasks {
        task.await.expect("transfer task");
    }

    let after = total(&pool).await;
    tally.report(
        &format!("{TASKS} tasks"),
        ACCOUNTS,
        TASKS * per_task,
        (locked, " (sqlx)"),
        (before, after),
    )
}
