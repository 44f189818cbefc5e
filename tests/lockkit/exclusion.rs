//! Mutual exclusion beyond the conformance suite (tests/conformance, which
//! runs the exclusive workload with its control on every stack): the
//! PostgreSQL fact lockkit's API rules out (xact locks in autocommit
//! exclude nothing, shown on the same workload), and shared readers against
//! exclusive writers. The workload's generator, detector and assertions
//! are [`lockkit_tests::workload::exclusion`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, Error, LockKey, Locker, Mode};
use lockkit_tests::waits::{WaitCounter, Waits};
use lockkit_tests::workload::exclusion::{private_id, slots, Guard, Room, Tally, KEYS};
use lockkit_tests::workload::{seed, worker_rng};
use lockkit_tests::TestServer;
use tokio::sync::Barrier;
use tokio_postgres::Client;

use crate::common::locker;

/// The entity the workers fight over; a namespace of its own so no other
/// test of the binary contends for these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/exclusion")]
struct Slot {
    id: i64,
}

const CONNECTIONS: usize = 16;
const TXS_PER_CONNECTION: usize = 200;

async fn connections(db: &TestServer, n: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(db.connect().await);
    }
    clients
}

/// Runs [`TXS_PER_CONNECTION`] transactions on `client`, each entering the
/// critical section of one to three random slots guarded by `guard`.
async fn exclusive_worker(
    mut client: Client,
    locker: Locker,
    worker: usize,
    seed: u64,
    guard: Guard,
    room: Arc<Room>,
    tally: Arc<Tally>,
) -> Result<(), Error> {
    let mut rng = worker_rng(seed, worker);
    for i in 0..TXS_PER_CONNECTION {
        let ids = slots(&mut rng, &tally);
        if guard == Guard::Autocommit {
            for &k in &ids {
                let LockKey::BigInt(key) = Slot { id: k as i64 }.lock_key() else {
                    unreachable!("Slot is a BigInt key")
                };
                client
                    .execute("SELECT pg_advisory_xact_lock($1)", &[&key])
                    .await?;
            }
        }
        let tx = locker.begin(&mut client).await?;
        match guard {
            Guard::Locked if ids.len() == 1 => {
                let _ = tx.lock(Slot { id: ids[0] as i64 }).await?;
            }
            Guard::Locked => {
                let mut batch = Batch::new();
                for &k in &ids {
                    batch.add(&Slot { id: k as i64 }, Mode::Exclusive);
                }
                let _ = tx.lock_batch(&batch).await?;
            }
            Guard::PrivateKeys => {
                let private = private_id(worker, i);
                let _ = tx.lock(Slot { id: private }).await?;
            }
            Guard::Autocommit => {}
        }
        room.enter(&ids, &tally);
        // Widen the window: let the other tasks run, and now and then stay
        // inside for a timer tick.
        tokio::task::yield_now().await;
        if i % 4 == 0 {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        room.leave(&ids);
        tx.commit().await?;
    }
    Ok(())
}

/// Runs the exclusive workload over [`CONNECTIONS`] connections and returns
/// its tally and the waits the server was seen making on the slots.
async fn exclusive_workload(db: &TestServer, guard: Guard) -> (Tally, Waits) {
    let seed = seed();
    let clients = connections(db, CONNECTIONS).await;
    let locker = locker(&clients[0], Config::default()).await;
    let room = Arc::new(Room::default());
    let tally = Arc::new(Tally::default());
    let counter = WaitCounter::start(
        db.config(),
        (0..KEYS).map(|k| Slot { id: k as i64 }.lock_key()),
    );
    let started = Instant::now();
    let workers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(worker, client)| {
            tokio::spawn(exclusive_worker(
                client,
                locker.clone(),
                worker,
                seed,
                guard,
                Arc::clone(&room),
                Arc::clone(&tally),
            ))
        })
        .collect();
    for worker in workers {
        worker
            .await
            .expect("worker panicked")
            .expect("worker failed");
    }
    let waits = counter.stop();
    println!("{guard:?}: {tally:?}, {waits:?} in {:?}", started.elapsed());
    (Arc::into_inner(tally).expect("workers are done"), waits)
}

/// Control: taking the xact lock outside a transaction (autocommit)
/// excludes nothing, since it is released at the end of its statement.
#[tokio::test(flavor = "multi_thread")]
async fn control_autocommit_xact_lock_overlaps() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (tally, _) = exclusive_workload(db, Guard::Autocommit).await;
    tally.assert_overlapped("the detector saw no overlap with autocommit locks");
}

const RW_KEYS: usize = 2;
const RW_TXS_PER_CONNECTION: usize = 150;
/// The fewest writers the server must be seen making wait behind readers (a
/// lower bound, see [`lockkit_tests::waits`]).
const RW_MIN_WRITERS_BEHIND_READERS: u64 = 40;

/// Per-key readers and writers inside.
#[derive(Debug, Default)]
struct RwRoom {
    readers: [AtomicU32; RW_KEYS],
    writers: [AtomicU32; RW_KEYS],
}

#[derive(Debug, Default)]
struct RwTally {
    reads: AtomicU64,
    writes: AtomicU64,
    /// A writer inside with anyone else (reader or writer) inside.
    violations: AtomicU64,
    /// The most readers seen inside one key at once.
    max_readers: AtomicU32,
}

/// Readers take the slot shared, writers in `writer_mode` (exclusive,
/// except in the control).
async fn rw_worker(
    mut client: Client,
    locker: Locker,
    worker: usize,
    seed: u64,
    writer_mode: Mode,
    room: Arc<RwRoom>,
    tally: Arc<RwTally>,
) -> Result<(), Error> {
    let mut rng = worker_rng(seed, worker);
    for i in 0..RW_TXS_PER_CONNECTION {
        let k = rng.usize(..RW_KEYS);
        let slot = Slot { id: 100 + k as i64 };
        let writer = rng.u8(..5) == 0;
        let tx = locker.begin(&mut client).await?;
        if writer {
            let _ = match writer_mode {
                Mode::Exclusive => tx.lock(slot).await?,
                Mode::Shared => tx.lock_shared(slot).await?,
            };
            tally.writes.fetch_add(1, SeqCst);
            // SeqCst on both sides: if a reader and a writer overlap, at
            // least one of them sees the other's increment.
            if room.writers[k].fetch_add(1, SeqCst) != 0 || room.readers[k].load(SeqCst) != 0 {
                tally.violations.fetch_add(1, SeqCst);
            }
        } else {
            let _ = tx.lock_shared(slot).await?;
            tally.reads.fetch_add(1, SeqCst);
            let readers = room.readers[k].fetch_add(1, SeqCst) + 1;
            tally.max_readers.fetch_max(readers, SeqCst);
            if room.writers[k].load(SeqCst) != 0 {
                tally.violations.fetch_add(1, SeqCst);
            }
        }
        tokio::task::yield_now().await;
        if i % 4 == 0 {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        if writer {
            room.writers[k].fetch_sub(1, SeqCst);
        } else {
            room.readers[k].fetch_sub(1, SeqCst);
        }
        tx.commit().await?;
    }
    Ok(())
}

/// Runs the read/write workload; returns its tally and the waits the server
/// was seen making on its keys.
async fn rw_workload(db: &TestServer, writer_mode: Mode) -> (RwTally, Waits) {
    let seed = seed();
    let clients = connections(db, CONNECTIONS).await;
    let locker = locker(&clients[0], Config::default()).await;
    let room = Arc::new(RwRoom::default());
    let tally = Arc::new(RwTally::default());
    let counter = WaitCounter::start(
        db.config(),
        (0..RW_KEYS).map(|k| Slot { id: 100 + k as i64 }.lock_key()),
    );
    let started = Instant::now();
    let workers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(worker, client)| {
            tokio::spawn(rw_worker(
                client,
                locker.clone(),
                worker,
                seed,
                writer_mode,
                Arc::clone(&room),
                Arc::clone(&tally),
            ))
        })
        .collect();
    for worker in workers {
        worker
            .await
            .expect("worker panicked")
            .expect("worker failed");
    }
    let waits = counter.stop();
    println!(
        "writers {writer_mode:?}: {tally:?}, {waits:?} in {:?}",
        started.elapsed()
    );
    (Arc::into_inner(tally).expect("workers are done"), waits)
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_readers_share_and_exclude_writers() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (tally, waits) = rw_workload(db, Mode::Exclusive).await;
    assert_eq!(tally.violations.load(SeqCst), 0, "a writer was not alone");
    assert!(tally.writes.load(SeqCst) > 0);
    assert!(tally.reads.load(SeqCst) > 0);
    let max = tally.max_readers.load(SeqCst);
    assert!(max >= 2, "readers were never inside together (max {max})");
    // Writers arrived while readers were inside, and the server made them
    // wait: the exclusion above was exercised, not just never needed.
    waits.assert_writers_waited_behind_readers("read/write", RW_MIN_WRITERS_BEHIND_READERS);
}

/// Control: "writers" that take the shared lock are seen overlapping
/// readers, so the violation check above can fail.
#[tokio::test(flavor = "multi_thread")]
async fn control_shared_writers_overlap() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (tally, _) = rw_workload(db, Mode::Shared).await;
    assert!(
        tally.violations.load(SeqCst) > 0,
        "the detector saw no writer overlap: {tally:?}"
    );
}

/// Deterministic: every reader is inside at once (a barrier that only opens
/// when all of them hold the shared lock), and meanwhile a writer cannot get
/// in; once they commit it can.
#[tokio::test(flavor = "multi_thread")]
async fn all_readers_inside_together_writer_excluded() {
    let db = TestServer::shared();
    let _log = db.guard();
    let slot = Slot { id: 200 };
    let clients = connections(db, CONNECTIONS).await;
    let mut writer = db.connect().await;
    let locker = locker(&writer, Config::default()).await;
    // Readers + the test itself.
    let inside = Arc::new(Barrier::new(CONNECTIONS + 1));
    let leave = Arc::new(Barrier::new(CONNECTIONS + 1));
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let (locker, inside, leave) = (locker.clone(), Arc::clone(&inside), Arc::clone(&leave));
            tokio::spawn(async move {
                let tx = locker.begin(&mut client).await?;
                let held = tx.lock_shared(slot).await?;
                assert_eq!(held.mode(), Mode::Shared);
                inside.wait().await;
                leave.wait().await;
                drop(held);
                tx.commit().await
            })
        })
        .collect();
    // Guards a hang (shared locks excluding each other), not a timing claim.
    tokio::time::timeout(Duration::from_secs(60), inside.wait())
        .await
        .expect("the readers never were all inside at once");

    let tx = locker.begin(&mut writer).await.unwrap();
    assert!(
        tx.try_lock(slot).await.unwrap().is_err(),
        "a writer got in among {CONNECTIONS} readers"
    );
    assert!(
        tx.try_lock_shared(slot).await.unwrap().is_ok(),
        "one more reader is admitted"
    );
    tx.rollback().await.unwrap();

    leave.wait().await;
    for reader in readers {
        reader
            .await
            .expect("reader panicked")
            .expect("reader failed");
    }
    let tx = locker.begin(&mut writer).await.unwrap();
    let held = tx.try_lock(slot).await.unwrap().expect("readers are gone");
    assert_eq!(held.mode(), Mode::Exclusive);
    drop(held);
    tx.commit().await.unwrap();
}
