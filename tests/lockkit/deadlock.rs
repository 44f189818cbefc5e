//! Deadlock freedom of sorted batches: thousands of random multi-key
//! transactions over many connections never deadlock, while the same
//! workload taking its keys one at a time in random order does.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Instant;

use lockkit::{AdvisoryKey, Batch, Config, Error, LockTx, Locker, Mode, OrderCheck};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use crate::common::locker;

/// The `BigInt` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/deadlock")]
struct Big {
    id: i64,
}

/// The `Pair` half of the key space.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/deadlock-pair", pair)]
struct Pair {
    id: i64,
}

const CONNECTIONS: usize = 16;
/// Keys `0..KEYS`: the lower half `Big`, the upper half `Pair`.
const KEYS: usize = 20;
/// 16 × 640 = 10,240 transactions.
const SORTED_TXS_PER_CONNECTION: usize = 640;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS_PER_CONNECTION: usize = 100;

/// How a transaction takes its keys.
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
    /// Transactions that asked for a key another worker held in a
    /// conflicting mode at that moment, so they had to wait.
    contended: AtomicU64,
    mixed_forms: AtomicU64,
    other_errors: std::sync::Mutex<Vec<String>>,
}

/// Per-key holders, for the contention count (and an exclusion check for
/// free).
#[derive(Debug, Default)]
struct Holders {
    exclusive: [AtomicU32; KEYS],
    shared: [AtomicU32; KEYS],
}

fn seed() -> u64 {
    let seed = std::env::var("LOCKKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("seed = {seed} (rerun with LOCKKIT_SEED={seed})");
    seed
}

/// A private server that reports deadlocks quickly, the same for the test
/// and its control.
fn server() -> TestServer {
    TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start()
}

async fn lock_one(tx: &LockTx<'_>, k: usize, mode: Mode) -> Result<(), Error> {
    let id = k as i64;
    match (k < KEYS / 2, mode) {
        (true, Mode::Exclusive) => drop(tx.lock(Big { id }).await?),
        (true, Mode::Shared) => drop(tx.lock_shared(Big { id }).await?),
        (false, Mode::Exclusive) => drop(tx.lock(Pair { id }).await?),
        (false, Mode::Shared) => drop(tx.lock_shared(Pair { id }).await?),
    }
    Ok(())
}

/// One transaction: lock `keys`, hold them over a tiny bit of work, commit.
async fn transaction(
    client: &mut Client,
    locker: &Locker,
    keys: &[(usize, Mode)],
    acquire: Acquire,
    holders: &Holders,
) -> Result<(), Error> {
    let tx = locker.begin(client).await?;
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
            let held = tx.lock_batch(&batch).await?;
            assert_eq!(held.keys().len(), keys.len());
        }
        Acquire::OneByOneShuffled => {
            for &(k, mode) in keys {
                lock_one(&tx, k, mode).await?;
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
    tokio::task::yield_now().await;
    let work = tx.query_one("SELECT 1::int4", &[]).await;
    for &(k, mode) in keys {
        match mode {
            Mode::Exclusive => holders.exclusive[k].fetch_sub(1, SeqCst),
            Mode::Shared => holders.shared[k].fetch_sub(1, SeqCst),
        };
    }
    assert_eq!(work?.get::<_, i32>(0), 1);
    tx.commit().await
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    mut client: Client,
    locker: Locker,
    worker: usize,
    seed: u64,
    txs: usize,
    acquire: Acquire,
    holders: Arc<Holders>,
    tally: Arc<Tally>,
) {
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(worker as u64));
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
        match transaction(&mut client, &locker, &keys, acquire, &holders).await {
            Ok(()) => {
                tally.committed.fetch_add(1, SeqCst);
            }
            Err(e) if e.is_deadlock() => {
                // The server aborted the victim before it got in; dropping
                // the transaction rolled it back.
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

async fn workload(db: &TestServer, acquire: Acquire, txs: usize) -> Tally {
    let seed = seed();
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        clients.push(db.connect().await);
    }
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = locker(&clients[0], config).await;
    let holders = Arc::new(Holders::default());
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let workers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, client)| {
            tokio::spawn(worker(
                client,
                locker.clone(),
                i,
                seed,
                txs,
                acquire,
                Arc::clone(&holders),
                Arc::clone(&tally),
            ))
        })
        .collect();
    for w in workers {
        w.await.expect("worker panicked");
    }
    println!(
        "{acquire:?}: {} transactions: {tally:?} in {:?}",
        CONNECTIONS * txs,
        started.elapsed()
    );
    Arc::into_inner(tally).expect("workers are done")
}

#[tokio::test(flavor = "multi_thread")]
async fn sorted_batches_never_deadlock() {
    let db = server();
    let _log = db.guard();
    let tally = workload(&db, Acquire::SortedBatch, SORTED_TXS_PER_CONNECTION).await;
    let errors = tally.other_errors.lock().unwrap();
    assert!(errors.is_empty(), "errors: {errors:?}");
    assert_eq!(tally.deadlocks.load(SeqCst), 0, "40P01 in sorted batches");
    let total = (CONNECTIONS * SORTED_TXS_PER_CONNECTION) as u64;
    assert!(total >= 10_000);
    assert_eq!(tally.committed.load(SeqCst), total);
    assert!(tally.mixed_forms.load(SeqCst) > 0, "no BigInt+Pair batch");
    let contended = tally.contended.load(SeqCst);
    assert!(contended >= 100, "too little contention: {contended}");
}

/// Control: the same workload, each key locked on its own in random order,
/// does deadlock (and the server reports it as `40P01`, which lockkit maps
/// to `Error::Deadlock`), so the zero above means something.
#[tokio::test(flavor = "multi_thread")]
async fn control_unsorted_single_locks_deadlock() {
    let db = server();
    let _log = db.guard();
    let tally = workload(&db, Acquire::OneByOneShuffled, UNSORTED_TXS_PER_CONNECTION).await;
    let errors = tally.other_errors.lock().unwrap();
    assert!(errors.is_empty(), "errors: {errors:?}");
    let deadlocks = tally.deadlocks.load(SeqCst);
    assert!(deadlocks > 0, "no deadlock in the control: {tally:?}");
    assert_eq!(
        tally.committed.load(SeqCst) + deadlocks,
        (CONNECTIONS * UNSORTED_TXS_PER_CONNECTION) as u64
    );
}
