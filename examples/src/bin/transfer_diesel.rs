//! Money transfers with Diesel and lockkit-diesel: both accounts of a
//! transfer are locked in the global lock order, so transfers running
//! concurrently in both directions between the same accounts never deadlock
//! and never lose money.
//!
//! ```sh
//! cargo run -p lockkit-examples --bin transfer_diesel
//! cargo run -p lockkit-examples --bin transfer_diesel -- --without-locks  # the control
//! cargo run -p lockkit-examples --bin transfer_diesel -- --transfers-per-thread 50  # CI size
//! ```
//!
//! Uses `DATABASE_URL` when it is set, else starts a throwaway server. Each
//! transfer reads the payer's balance, checks it, and writes both balances
//! computed from what it read (a read-modify-write that loses updates unless
//! the two accounts are locked). `--without-locks` runs the same transfers
//! without the advisory locks: money is created or destroyed, and opposite
//! transfers deadlock on the row locks of their `UPDATE`s.

use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use lockkit_diesel::{AdvisoryKey, Batch, Config, Error, Locker};
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
/// version (KEYS.md).
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-examples/account")]
struct Account {
    id: i64,
}

const ACCOUNTS: i64 = 4;
const OPENING_CENTS: i64 = 100_000;
const THREADS: usize = 8;
/// Transfers per thread unless `--transfers-per-thread N` says otherwise.
const TRANSFERS_PER_THREAD: usize = 250;

/// Moves `amount` from `from` to `to` in one transaction; `Ok(false)` when
/// the payer cannot afford it.
fn transfer(
    conn: &mut PgConnection,
    locker: &Locker,
    locked: bool,
    from: i64,
    to: i64,
    amount: i64,
) -> Result<bool, Error> {
    locker.transaction(conn, |tx| {
        if locked {
            // Both accounts, in the global lock order whichever way the
            // money goes.
            let _held = tx.lock_batch(
                &Batch::new()
                    .with(&Account { id: from })
                    .with(&Account { id: to }),
            )?;
        }
        let payer: i64 = accounts.find(from).select(cents).first(tx.conn())?;
        if payer < amount {
            return Ok(false);
        }
        let payee: i64 = accounts.find(to).select(cents).first(tx.conn())?;
        std::thread::yield_now(); // widen the race the locks close
        diesel::update(accounts.find(from))
            .set(cents.eq(payer - amount))
            .execute(tx.conn())?;
        diesel::update(accounts.find(to))
            .set(cents.eq(payee + amount))
            .execute(tx.conn())?;
        Ok(true)
    })
}

fn total(conn: &mut PgConnection) -> QueryResult<i64> {
    let all: Vec<i64> = accounts.select(cents).order(account_id).load(conn)?;
    Ok(all.iter().sum())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let locked = !args.iter().any(|a| a == "--without-locks");
    let per_thread = match args.iter().position(|a| a == "--transfers-per-thread") {
        None => TRANSFERS_PER_THREAD,
        Some(i) => match args.get(i + 1).and_then(|n| n.parse::<usize>().ok()) {
            Some(n) if n > 0 => n,
            _ => {
                eprintln!("transfer_diesel: --transfers-per-thread needs a positive number");
                return ExitCode::FAILURE;
            }
        },
    };
    let db = Database::from_env(&[("deadlock_timeout", "50ms")]);
    let pool = Pool::builder()
        .max_size(THREADS as u32 + 1)
        .build(ConnectionManager::<PgConnection>::new(db.url()))
        .expect("r2d2 pool");
    let mut conn = pool.get().expect("connection");
    conn.batch_execute(
        "DROP TABLE IF EXISTS lockkit_example_accounts; \
         CREATE TABLE lockkit_example_accounts (id int8 PRIMARY KEY, cents int8 NOT NULL)",
    )
    .expect("schema");
    let opening: Vec<_> = (0..ACCOUNTS)
        .map(|i| (account_id.eq(i), cents.eq(OPENING_CENTS)))
        .collect();
    diesel::insert_into(accounts)
        .values(&opening)
        .execute(&mut conn)
        .expect("accounts");
    let locker = Locker::new(&mut conn, Config::default()).expect("locker");
    let before = total(&mut conn).expect("total");

    let tally = Tally::default();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (pool, locker, tally) = (&pool, &locker, &tally);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut conn = pool.get().expect("pooled connection");
                for _ in 0..per_thread {
                    // Half the threads pay "up", half "down": every pair of
                    // accounts sees transfers in both directions at once.
                    let a = rng.i64(0..ACCOUNTS - 1);
                    let b = rng.i64(a + 1..ACCOUNTS);
                    let (from, to) = if t % 2 == 0 { (a, b) } else { (b, a) };
                    let amount = rng.i64(1..=5_000);
                    match transfer(&mut conn, locker, locked, from, to, amount) {
                        Ok(true) => tally.done.fetch_add(1, Relaxed),
                        Ok(false) => tally.insufficient.fetch_add(1, Relaxed),
                        Err(e) if e.is_deadlock() => tally.deadlocks.fetch_add(1, Relaxed),
                        Err(e) => panic!("transfer failed: {e}"),
                    };
                }
            });
        }
    });

    let after = total(&mut conn).expect("total");
    tally.report(
        &format!("{THREADS} threads"),
        ACCOUNTS,
        THREADS * per_thread,
        (locked, ""),
        (before, after),
    )
}
