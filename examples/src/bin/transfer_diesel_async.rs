//! Money transfers with diesel-async and lockkit-diesel-async: both
//! accounts of a transfer are locked in the global lock order, so transfers
//! running concurrently in both directions between the same accounts never
//! deadlock and never lose money.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin transfer_diesel_async
//! cargo run -p lockkit-examples --bin transfer_diesel_async -- --transfers-per-task 20  # CI size
//! cargo run -p lockkit-examples --bin transfer_diesel_async -- --without-locks  # the control
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

use diesel::prelude::*;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use lockkit_diesel_async::{AdvisoryKey, Batch, Config, Error, Locker};
use lockkit_examples::{transfer::Tally, Database};

diesel::table! {
    /// The accounts.
    lockkit_example_accounts (id) {
        /// The account number.
        id -> BigInt,
        /// The balance.
        cents -> BigInt,
    }
}

use lockkit_example_accounts::dsl::{
    cents, id as account_id, lockkit_example_accounts as accounts,
};

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
    conn: &mut AsyncPgConnection,
    locker: &Locker,
    locked: bool,
    (from, to, amount): (i64, i64, i64),
) -> Result<bool, Error> {
    conn.transaction::<_, Error, _>(async |conn| {
        let mut tx = locker.lock_tx(conn)?;
        if locked {
            // Both accounts, in the global lock order whichever way the money goes.
            let both = Batch::new()
                .with(&Account { id: from })
                .with(&Account { id: to });
            let _held = tx.lock_batch(&both).await?;
        }
        let payer: i64 = accounts.find(from).select(cents).first(tx.conn()).await?;
        if payer < amount {
            return Ok(false);
        }
        let payee: i64 = accounts.find(to).select(cents).first(tx.conn()).await?;
        tokio::task::yield_now().await; // widen the race the locks close
        diesel::update(accounts.find(from))
            .set(cents.eq(payer - amount))
            .execute(tx.conn())
            .await?;
        diesel::update(accounts.find(to))
            .set(cents.eq(payee + amount))
            .execute(tx.conn())
            .await?;
        Ok(true)
    })
    .await // COMMIT releases both locks
}

async fn total(conn: &mut AsyncPgConnection) -> i64 {
    let all: Vec<i64> = accounts
        .select(cents)
        .order(account_id)
        .load(conn)
        .await
        .expect("total");
    all.iter().sum()
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
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url());
    let pool = Pool::builder(manager)
        .max_size(TASKS + 1)
        .build()
        .expect("deadpool");
    let mut conn = pool.get().await.expect("connection");
    conn.batch_execute(
        "DROP TABLE IF EXISTS lockkit_example_accounts; \
         CREATE TABLE lockkit_example_accounts (id int8 PRIMARY KEY, cents int8 NOT NULL)",
    )
    .await
    .expect("schema");
    let opening: Vec<_> = (0..ACCOUNTS)
        .map(|i| (account_id.eq(i), cents.eq(OPENING_CENTS)))
        .collect();
    diesel::insert_into(accounts)
        .values(&opening)
        .execute(&mut conn)
        .await
        .expect("accounts");
    let locker = Locker::new(&mut conn, Config::default())
        .await
        .expect("locker");
    let before = total(&mut conn).await;

    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (pool, locker, tally) = (pool.clone(), locker.clone(), Arc::clone(&tally));
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t as u64);
            let mut conn = pool.get().await.expect("pooled connection");
            for _ in 0..per_task {
                // Half the tasks pay "up", half "down": every pair of
                // accounts sees transfers in both directions at once.
                let a = rng.i64(0..ACCOUNTS - 1);
                let b = rng.i64(a + 1..ACCOUNTS);
                let (from, to) = if t % 2 == 0 { (a, b) } else { (b, a) };
                let amount = rng.i64(1..=5_000);
                match transfer(&mut conn, &locker, locked, (from, to, amount)).await {
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

    let after = total(&mut conn).await;
    tally.report(
        &format!("{TASKS} tasks"),
        ACCOUNTS,
        TASKS * per_task,
        (locked, " (diesel-async)"),
        (before, after),
    )
}
