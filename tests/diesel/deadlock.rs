//! Deadlock freedom of sorted batches through Diesel: thousands of random
//! multi-key transactions on threads sharing an r2d2 pool never deadlock,
//! while the same workload taking its keys one at a time in random order
//! does (and the server's `40P01` reaches the caller as `is_deadlock()`,
//! though Diesel hides the SQLSTATE). The workload, its holder counters and
//! assertions are the core suite's ([`lockkit_tests::workload::deadlock`]).

use diesel::sql_types::Integer;
use diesel::{sql_query, QueryableByName, RunQueryDsl};
use lockkit::AdvisoryKey;
use lockkit_diesel::{Batch, Config, Error, LockTx, Locker, Mode, OrderCheck};
use lockkit_tests::waits::{WaitCounter, Waits};
use lockkit_tests::workload::deadlock::{is_big, key_set, Acquire, Holders, Tally, KEYS};
use lockkit_tests::workload::{seed, worker_rng};
use lockkit_tests::TestServer;

use crate::common::{locker, pool, PgPool};

/// The `BigInt` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/diesel-deadlock")]
struct Big {
    id: i64,
}

/// The `Pair` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/diesel-deadlock-pair", pair)]
struct Pair {
    id: i64,
}

const THREADS: usize = 16;
/// 16 × 300 = 4,800 transactions.
const SORTED_TXS_PER_THREAD: usize = 300;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS_PER_THREAD: usize = 100;

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = Integer)]
    one: i32,
}

fn lock_one(tx: &mut LockTx<'_>, k: usize, mode: Mode) -> Result<(), Error> {
    let id = k as i64;
    match (is_big(k), mode) {
        (true, Mode::Exclusive) => drop(tx.lock(Big { id })?),
        (true, Mode::Shared) => drop(tx.lock_shared(Big { id })?),
        (false, Mode::Exclusive) => drop(tx.lock(Pair { id })?),
        (false, Mode::Shared) => drop(tx.lock_shared(Pair { id })?),
    }
    Ok(())
}

fn transaction(
    tx: &mut LockTx<'_>,
    keys: &[(usize, Mode)],
    acquire: Acquire,
    holders: &Holders,
) -> Result<(), Error> {
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
            let held = tx.lock_batch(&batch)?;
            assert_eq!(held.keys().len(), keys.len());
        }
        Acquire::OneByOneShuffled => {
            for &(k, mode) in keys {
                lock_one(tx, k, mode)?;
            }
        }
    }
    holders.enter(keys);
    // The tiny bit of work, holding the locks.
    std::thread::yield_now();
    let work: Result<One, _> = sql_query("SELECT 1::int4 AS one").get_result(tx.conn());
    holders.leave(keys);
    assert_eq!(work?.one, 1);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn worker(
    pool: &PgPool,
    locker: &Locker,
    id: usize,
    seed: u64,
    txs: usize,
    acquire: Acquire,
    holders: &Holders,
    tally: &Tally,
) {
    let mut rng = worker_rng(seed, id);
    let mut conn = pool.get().expect("pooled connection");
    for _ in 0..txs {
        let keys = key_set(&mut rng, tally);
        tally.record(locker.transaction(&mut conn, |tx| transaction(tx, &keys, acquire, holders)));
    }
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

/// Runs the workload; returns its tally and the waits the server was seen
/// making on its keys.
fn workload(db: &TestServer, acquire: Acquire, txs: usize) -> (Tally, Waits) {
    let seed = seed();
    let pool = pool(db, THREADS as u32);
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = locker(&mut pool.get().unwrap(), config);
    assert!(locker.recognizes_errors(), "the test server speaks English");
    let holders = Holders::default();
    let tally = Tally::default();
    let counter = WaitCounter::start(db.config(), all_keys());
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|id| {
                let (pool, locker, holders, tally) = (&pool, &locker, &holders, &tally);
                s.spawn(move || worker(pool, locker, id, seed, txs, acquire, holders, tally))
            })
            .collect();
        for w in workers {
            w.join().expect("worker panicked");
        }
    });
    let waits = counter.stop();
    println!(
        "{acquire:?}: {} transactions: {tally:?}, {waits:?}",
        THREADS * txs
    );
    (tally, waits)
}

/// A private server that reports deadlocks quickly, the same for the test
/// and its control.
fn server() -> TestServer {
    TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start()
}

#[test]
fn sorted_batches_never_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, waits) = workload(&db, Acquire::SortedBatch, SORTED_TXS_PER_THREAD);
    tally.assert_never_deadlocked(THREADS * SORTED_TXS_PER_THREAD, &waits);
}

/// Control: the same workload, each key locked on its own in random order,
/// does deadlock, and the server's `40P01` is recognised through Diesel.
#[test]
fn control_unsorted_single_locks_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, _) = workload(&db, Acquire::OneByOneShuffled, UNSORTED_TXS_PER_THREAD);
    tally.assert_deadlocked(THREADS * UNSORTED_TXS_PER_THREAD);
}
