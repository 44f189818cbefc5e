//! Deadlock freedom of sorted batches through sqlx: 5,120 random multi-key
//! transactions in mixed modes and both key spaces, on tasks sharing a
//! `PgPool`, never deadlock, while the same workload taking its keys one at
//! a time in random order does (the control; the server's `40P01` reaches
//! the caller as `is_deadlock()`). The workload, its holder counters and
//! assertions are the shared ones ([`lockkit_tests::workload::deadlock`]).

use std::sync::Arc;

use lockkit_sqlx::{AdvisoryKey, Batch, Config, Error, LockTx, Locker, Mode, OrderCheck};
use lockkit_tests::waits::{WaitCounter, Waits};
use lockkit_tests::workload::deadlock::KEYS;
use lockkit_tests::workload::deadlock::{is_big, key_set, Acquire, Holders, Tally};
use lockkit_tests::workload::{seed, worker_rng};
use lockkit_tests::TestServer;
use sqlx::PgPool;

use crate::common::{locker, pool};

/// The `BigInt` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/sqlx-deadlock")]
struct Big {
    id: i64,
}

/// The `Pair` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/sqlx-deadlock-pair", pair)]
struct Pair {
    id: i64,
}

const TASKS: usize = 16;
/// 16 × 320 = 5,120 transactions.
const SORTED_TXS_PER_TASK: usize = 320;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS_PER_TASK: usize = 100;

async fn lock_one(tx: &mut LockTx<'_>, k: usize, mode: Mode) -> Result<(), Error> {
    let id = k as i64;
    match (is_big(k), mode) {
        (true, Mode::Exclusive) => drop(tx.lock(Big { id }).await?),
        (true, Mode::Shared) => drop(tx.lock_shared(Big { id }).await?),
        (false, Mode::Exclusive) => drop(tx.lock(Pair { id }).await?),
        (false, Mode::Shared) => drop(tx.lock_shared(Pair { id }).await?),
    }
    Ok(())
}

async fn transaction(
    pool: &PgPool,
    locker: &Locker,
    keys: &[(usize, Mode)],
    acquire: Acquire,
    holders: &Holders,
) -> Result<(), Error> {
    let mut tx = pool.begin().await.map_err(lockkit_sqlx::lock_error)?;
    {
        let mut ltx = locker.lock_tx(&mut tx)?;
        match acquire {
            Acquire::SortedBatch => {
                let mut batch = Batch::new();
                for &(k, mode) in keys {
                    let id = k as i64;
                    if is_big(k) {
                        batch.add(&Big { id }, mode);
                    } else {
                        batch.add(&Pair { id }, mode);
                    }
                }
                let held = ltx.lock_batch(&batch).await?;
                assert_eq!(held.keys().len(), keys.len());
            }
            Acquire::OneByOneShuffled => {
                for &(k, mode) in keys {
                    lock_one(&mut ltx, k, mode).await?;
                }
            }
        }
        holders.enter(keys);
        // The tiny bit of work, holding the locks.
        tokio::task::yield_now().await;
        let one: Result<i32, _> = sqlx::query_scalar("SELECT 1::int4")
            .fetch_one(&mut *ltx)
            .await;
        holders.leave(keys);
        assert_eq!(one.map_err(lockkit_sqlx::lock_error)?, 1);
    }
    tx.commit().await.map_err(lockkit_sqlx::lock_error)
}

async fn workload(db: &TestServer, acquire: Acquire, txs: usize) -> (Arc<Tally>, Waits) {
    let seed = seed();
    let counter = WaitCounter::start(db.config(), all_keys());
    let pool = pool(db, TASKS as u32).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let holders = Arc::new(Holders::default());
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = (0..TASKS)
        .map(|id| {
            let (pool, locker) = (pool.clone(), locker.clone());
            let (holders, tally) = (Arc::clone(&holders), Arc::clone(&tally));
            tokio::spawn(async move {
                let mut rng = worker_rng(seed, id);
                for _ in 0..txs {
                    let keys = key_set(&mut rng, &tally);
                    tally.record(transaction(&pool, &locker, &keys, acquire, &holders).await);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker panicked");
    }
    let waits = counter.stop();
    println!(
        "{acquire:?}: {} transactions: {tally:?}, {waits:?}",
        TASKS * txs
    );
    (tally, waits)
}

/// The lock keys of the workload's key space.
fn all_keys() -> impl Iterator<Item = lockkit::LockKey> {
    (0..KEYS).map(|k| {
        let id = k as i64;
        if is_big(k) {
            Big { id }.lock_key()
        } else {
            Pair { id }.lock_key()
        }
    })
}

/// A private server that reports deadlocks quickly, the same for the test
/// and its control.
fn server() -> TestServer {
    TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sorted_batches_never_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, waits) = workload(&db, Acquire::SortedBatch, SORTED_TXS_PER_TASK).await;
    tally.assert_never_deadlocked(TASKS * SORTED_TXS_PER_TASK, &waits);
}

/// Control: the same workload, each key locked on its own in random order,
/// does deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_unsorted_single_locks_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, _) = workload(&db, Acquire::OneByOneShuffled, UNSORTED_TXS_PER_TASK).await;
    tally.assert_deadlocked(TASKS * UNSORTED_TXS_PER_TASK);
}
