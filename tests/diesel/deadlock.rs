//! Deadlock freedom of sorted batches through Diesel: thousands of random
//! multi-key transactions on threads sharing an r2d2 pool never deadlock,
//! while the same workload taking its keys one at a time in random order
//! does (and the server's `40P01` reaches the caller as `is_deadlock()`,
//! though Diesel hides the SQLSTATE).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;

use diesel::sql_types::Integer;
use diesel::{sql_query, QueryableByName, RunQueryDsl};
use lockkit::AdvisoryKey;
use lockkit_diesel::{Batch, Config, Error, LockTx, Locker, Mode, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{locker, pool, seed, PgPool};

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
/// Keys `0..KEYS`: the lower half `Big`, the upper half `Pair`.
const KEYS: usize = 20;
/// 16 × 300 = 4,800 transactions.
const SORTED_TXS_PER_THREAD: usize = 300;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS_PER_THREAD: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Acquire {
    /// One `lock_batch`, in the global lock order.
    SortedBatch,
    /// Control: `lock` / `lock_shared` per key, in random order.
    OneByOneShuffled,
}

#[derive(Debug, Default)]
struct Tally {
    committed: AtomicU64,
    deadlocks: AtomicU64,
    contended: AtomicU64,
    mixed_forms: AtomicU64,
    other_errors: Mutex<Vec<String>>,
}

#[derive(Debug, Default)]
struct Holders {
    exclusive: [AtomicU32; KEYS],
    shared: [AtomicU32; KEYS],
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = Integer)]
    one: i32,
}

fn lock_one(tx: &mut LockTx<'_>, k: usize, mode: Mode) -> Result<(), Error> {
    let id = k as i64;
    match (k < KEYS / 2, mode) {
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
                if k < KEYS / 2 {
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
    for &(k, mode) in keys {
        match mode {
            Mode::Exclusive => {
                let before = holders.exclusive[k].fetch_add(1, SeqCst);
                assert!(before == 0 && holders.shared[k].load(SeqCst) == 0, "{k}");
            }
            Mode::Shared => {
                holders.shared[k].fetch_add(1, SeqCst);
                assert_eq!(holders.exclusive[k].load(SeqCst), 0, "{k}");
            }
        }
    }
    // The tiny bit of work, holding the locks.
    std::thread::yield_now();
    let work: Result<One, _> = sql_query("SELECT 1::int4 AS one").get_result(tx.conn());
    for &(k, mode) in keys {
        match mode {
            Mode::Exclusive => holders.exclusive[k].fetch_sub(1, SeqCst),
            Mode::Shared => holders.shared[k].fetch_sub(1, SeqCst),
        };
    }
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
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(id as u64));
    let mut conn = pool.get().expect("pooled connection");
    for _ in 0..txs {
        let n = rng.usize(2..=5);
        let mut keys: Vec<(usize, Mode)> = rng
            .choose_multiple(0..KEYS, n)
            .into_iter()
            .map(|k| {
                let mode = if rng.u8(..3) == 0 {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                };
                (k, mode)
            })
            .collect();
        rng.shuffle(&mut keys);
        if keys.iter().any(|&(k, _)| k < KEYS / 2) && keys.iter().any(|&(k, _)| k >= KEYS / 2) {
            tally.mixed_forms.fetch_add(1, SeqCst);
        }
        let conflicting = keys.iter().any(|&(k, mode)| {
            holders.exclusive[k].load(SeqCst) > 0
                || (mode == Mode::Exclusive && holders.shared[k].load(SeqCst) > 0)
        });
        if conflicting {
            tally.contended.fetch_add(1, SeqCst);
        }
        match locker.transaction(&mut conn, |tx| transaction(tx, &keys, acquire, holders)) {
            Ok(()) => {
                tally.committed.fetch_add(1, SeqCst);
            }
            Err(e) if e.is_deadlock() => {
                tally.deadlocks.fetch_add(1, SeqCst);
            }
            Err(e) => tally
                .other_errors
                .lock()
                .unwrap()
                .push(format!("{e} ({:?})", e.code())),
        }
    }
}

fn workload(db: &TestServer, acquire: Acquire, txs: usize) -> Tally {
    let seed = seed();
    let pool = pool(db, THREADS as u32);
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = locker(&mut pool.get().unwrap(), config);
    assert!(locker.recognizes_errors(), "the test server speaks English");
    let holders = Holders::default();
    let tally = Tally::default();
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
    println!("{acquire:?}: {} transactions: {tally:?}", THREADS * txs);
    tally
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
    let tally = workload(&db, Acquire::SortedBatch, SORTED_TXS_PER_THREAD);
    let errors = tally.other_errors.lock().unwrap();
    assert!(errors.is_empty(), "errors: {errors:?}");
    assert_eq!(tally.deadlocks.load(SeqCst), 0, "40P01 in sorted batches");
    let total = (THREADS * SORTED_TXS_PER_THREAD) as u64;
    assert_eq!(tally.committed.load(SeqCst), total);
    assert!(tally.mixed_forms.load(SeqCst) > 0, "no BigInt+Pair batch");
    let contended = tally.contended.load(SeqCst);
    assert!(contended >= 100, "too little contention: {contended}");
}

/// Control: the same workload, each key locked on its own in random order,
/// does deadlock, and the server's `40P01` is recognised through Diesel.
#[test]
fn control_unsorted_single_locks_deadlock() {
    let db = server();
    let _log = db.guard();
    let tally = workload(&db, Acquire::OneByOneShuffled, UNSORTED_TXS_PER_THREAD);
    let errors = tally.other_errors.lock().unwrap();
    assert!(errors.is_empty(), "errors: {errors:?}");
    let deadlocks = tally.deadlocks.load(SeqCst);
    assert!(deadlocks > 0, "no deadlock in the control: {tally:?}");
    assert_eq!(
        tally.committed.load(SeqCst) + deadlocks,
        (THREADS * UNSORTED_TXS_PER_THREAD) as u64
    );
}
