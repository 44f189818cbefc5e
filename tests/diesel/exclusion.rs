//! Mutual exclusion under contention: threads sharing an r2d2 pool, many
//! transactions on a small key space, and an in-process detector of
//! overlapping critical sections; with the core's controls, which show the
//! detector catches overlaps.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel::{sql_query, RunQueryDsl};
use lockkit::{AdvisoryKey, LockKey};
use lockkit_diesel::{Batch, Config, Error, Locker, Mode};
use lockkit_tests::TestServer;

use crate::common::{locker, pool, seed};

/// The entity the workers fight over; a namespace of its own so no other
/// test of the binary contends for these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/diesel-exclusion")]
struct Slot {
    id: i64,
}

const THREADS: usize = 16;
const TXS_PER_THREAD: usize = 150;
const KEYS: usize = 8;

/// How a worker "guards" its critical section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Guard {
    /// The real thing: `lock` / `lock_batch` on the slots, in a `LockTx`.
    Locked,
    /// Control: the same calls, but on keys private to the worker.
    PrivateKeys,
    /// Control: raw `pg_advisory_xact_lock` on the slots in autocommit,
    /// released at the end of that statement (the bug lockkit prevents).
    Autocommit,
}

/// Per-key count of workers inside their critical section.
#[derive(Debug, Default)]
struct Room {
    inside: [AtomicU32; KEYS],
}

#[derive(Debug, Default)]
struct Tally {
    entries: AtomicU64,
    overlaps: AtomicU64,
    busy_at_request: AtomicU64,
    batches: AtomicU64,
}

fn worker(
    pool: &crate::common::PgPool,
    locker: &Locker,
    id: usize,
    seed: u64,
    guard: Guard,
    room: &Room,
    tally: &Tally,
) -> Result<(), Error> {
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(id as u64));
    let mut conn = pool.get().expect("pooled connection");
    for i in 0..TXS_PER_THREAD {
        let n = if rng.bool() { 1 } else { rng.usize(2..=3) };
        let ids = rng.choose_multiple(0..KEYS, n);
        if ids.iter().any(|&k| room.inside[k].load(SeqCst) > 0) {
            tally.busy_at_request.fetch_add(1, SeqCst);
        }
        if n > 1 {
            tally.batches.fetch_add(1, SeqCst);
        }
        if guard == Guard::Autocommit {
            for &k in &ids {
                let LockKey::BigInt(key) = Slot { id: k as i64 }.lock_key() else {
                    unreachable!("Slot is a BigInt key")
                };
                sql_query("SELECT pg_advisory_xact_lock($1)")
                    .bind::<BigInt, _>(key)
                    .execute(&mut conn)?;
            }
        }
        locker.transaction(&mut conn, |tx| {
            match guard {
                Guard::Locked if n == 1 => {
                    let _ = tx.lock(Slot { id: ids[0] as i64 })?;
                }
                Guard::Locked => {
                    let mut batch = Batch::new();
                    for &k in &ids {
                        batch.add(&Slot { id: k as i64 }, Mode::Exclusive);
                    }
                    let _ = tx.lock_batch(&batch)?;
                }
                Guard::PrivateKeys => {
                    let private = 1_000_000 * (id as i64 + 1) + i as i64;
                    let _ = tx.lock(Slot { id: private })?;
                }
                Guard::Autocommit => {}
            }
            for &k in &ids {
                tally.entries.fetch_add(1, SeqCst);
                if room.inside[k].fetch_add(1, SeqCst) != 0 {
                    tally.overlaps.fetch_add(1, SeqCst);
                }
            }
            // Widen the window: let the other threads run, and now and then
            // stay inside for a while.
            std::thread::yield_now();
            if i % 4 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            for &k in &ids {
                room.inside[k].fetch_sub(1, SeqCst);
            }
            Ok::<_, Error>(())
        })?;
    }
    Ok(())
}

fn workload(guard: Guard) -> Tally {
    let db = TestServer::shared();
    let _log = db.guard();
    let seed = seed();
    let pool = pool(db, THREADS as u32);
    let locker = locker(&mut pool.get().unwrap(), Config::default());
    let room = Room::default();
    let tally = Tally::default();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|id| {
                let (pool, locker, room, tally) = (&pool, &locker, &room, &tally);
                s.spawn(move || worker(pool, locker, id, seed, guard, room, tally))
            })
            .collect();
        for w in workers {
            w.join().expect("worker panicked").expect("worker failed");
        }
    });
    println!("{guard:?}: {tally:?}");
    tally
}

#[test]
fn exclusive_locks_never_overlap() {
    let tally = workload(Guard::Locked);
    assert_eq!(tally.overlaps.load(SeqCst), 0, "two holders of one key");
    assert!(tally.entries.load(SeqCst) >= (THREADS * TXS_PER_THREAD) as u64);
    assert!(tally.batches.load(SeqCst) > 0);
    let busy = tally.busy_at_request.load(SeqCst);
    assert!(busy >= 50, "too little contention to mean anything: {busy}");
}

/// Control: each worker locking keys of its own overlaps, so the detector
/// above can fail.
#[test]
fn control_without_shared_keys_overlaps() {
    let tally = workload(Guard::PrivateKeys);
    assert!(
        tally.overlaps.load(SeqCst) > 0,
        "the detector saw no overlap without exclusion: {tally:?}"
    );
}

/// Control: xact locks taken outside a transaction exclude nothing.
#[test]
fn control_autocommit_xact_locks_overlap() {
    let tally = workload(Guard::Autocommit);
    assert!(
        tally.overlaps.load(SeqCst) > 0,
        "autocommit xact locks seemed to exclude: {tally:?}"
    );
}
