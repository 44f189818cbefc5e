//! Deadlock freedom of sorted batches: thousands of random multi-key
//! transactions over many connections never deadlock, while the same
//! workload taking its keys one at a time in random order does. The
//! workload, its holder counters and assertions are shared with the Diesel
//! suite ([`lockkit_tests::workload::deadlock`]).

use std::sync::Arc;
use std::time::Instant;

use lockkit::{AdvisoryKey, Batch, Config, Error, LockTx, Locker, Mode, OrderCheck};
use lockkit_tests::waits::{WaitCounter, Waits};
use lockkit_tests::workload::deadlock::{is_big, key_set, Acquire, Holders, Tally, KEYS};
use lockkit_tests::workload::{seed, worker_rng};
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
/// 16 × 640 = 10,240 transactions.
const SORTED_TXS_PER_CONNECTION: usize = 640;
/// 16 × 100 = 1,600 transactions.
const UNSORTED_TXS_PER_CONNECTION: usize = 100;

/// A private server that reports deadlocks quickly, the same for the test
/// and its control.
fn server() -> TestServer {
    TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start()
}

async fn lock_one(tx: &LockTx<'_>, k: usize, mode: Mode) -> Result<(), Error> {
    let id = k as i64;
    match (is_big(k), mode) {
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
                if is_big(k) {
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
    holders.enter(keys);
    // The tiny bit of work, holding the locks.
    tokio::task::yield_now().await;
    let work = tx.query_one("SELECT 1::int4", &[]).await;
    holders.leave(keys);
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
    let mut rng = worker_rng(seed, worker);
    for _ in 0..txs {
        let keys = key_set(&mut rng, &tally);
        tally.record(transaction(&mut client, &locker, &keys, acquire, &holders).await);
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
async fn workload(db: &TestServer, acquire: Acquire, txs: usize) -> (Tally, Waits) {
    let seed = seed();
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        clients.push(db.connect().await);
    }
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = locker(&clients[0], config).await;
    let holders = Arc::new(Holders::default());
    let tally = Arc::new(Tally::default());
    let counter = WaitCounter::start(db.config(), all_keys());
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
    let waits = counter.stop();
    println!(
        "{acquire:?}: {} transactions: {tally:?}, {waits:?} in {:?}",
        CONNECTIONS * txs,
        started.elapsed()
    );
    (Arc::into_inner(tally).expect("workers are done"), waits)
}

#[tokio::test(flavor = "multi_thread")]
async fn sorted_batches_never_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, waits) = workload(&db, Acquire::SortedBatch, SORTED_TXS_PER_CONNECTION).await;
    tally.assert_never_deadlocked(CONNECTIONS * SORTED_TXS_PER_CONNECTION, &waits);
}

/// Control: the same workload, each key locked on its own in random order,
/// does deadlock (and the server reports it as `40P01`, which lockkit maps
/// to `Error::Deadlock`), so the zero above means something.
#[tokio::test(flavor = "multi_thread")]
async fn control_unsorted_single_locks_deadlock() {
    let db = server();
    let _log = db.guard();
    let (tally, _) = workload(&db, Acquire::OneByOneShuffled, UNSORTED_TXS_PER_CONNECTION).await;
    tally.assert_deadlocked(CONNECTIONS * UNSORTED_TXS_PER_CONNECTION);
}
