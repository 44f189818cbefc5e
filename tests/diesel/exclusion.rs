//! Mutual exclusion under contention: threads sharing an r2d2 pool, many
//! transactions on a small key space, and an in-process detector of
//! overlapping critical sections; with the core's controls, which show the
//! detector catches overlaps. The generator, detector and assertions are
//! the core suite's ([`lockkit_tests::workload::exclusion`]).

use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel::{sql_query, RunQueryDsl};
use lockkit::{AdvisoryKey, LockKey};
use lockkit_diesel::{Batch, Config, Error, Locker, Mode};
use lockkit_tests::waits::{WaitCounter, Waits};
use lockkit_tests::workload::exclusion::{private_id, slots, Guard, Room, Tally, KEYS};
use lockkit_tests::workload::{seed, worker_rng};
use lockkit_tests::TestServer;

use crate::common::{locker, pool};

/// The entity the workers fight over; a namespace of its own so no other
/// test of the binary contends for these keys.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/diesel-exclusion")]
struct Slot {
    id: i64,
}

const THREADS: usize = 16;
const TXS_PER_THREAD: usize = 150;

fn worker(
    pool: &crate::common::PgPool,
    locker: &Locker,
    id: usize,
    seed: u64,
    guard: Guard,
    room: &Room,
    tally: &Tally,
) -> Result<(), Error> {
    let mut rng = worker_rng(seed, id);
    let mut conn = pool.get().expect("pooled connection");
    for i in 0..TXS_PER_THREAD {
        let ids = slots(&mut rng, tally);
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
                Guard::Locked if ids.len() == 1 => {
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
                    let private = private_id(id, i);
                    let _ = tx.lock(Slot { id: private })?;
                }
                Guard::Autocommit => {}
            }
            room.enter(&ids, tally);
            // Widen the window: let the other threads run, and now and then
            // stay inside for a while.
            std::thread::yield_now();
            if i % 4 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            room.leave(&ids);
            Ok::<_, Error>(())
        })?;
    }
    Ok(())
}

/// Runs the workload; returns its tally and the waits the server was seen
/// making on the slots.
fn workload(guard: Guard) -> (Tally, Waits) {
    let db = TestServer::shared();
    let _log = db.guard();
    let seed = seed();
    let pool = pool(db, THREADS as u32);
    let locker = locker(&mut pool.get().unwrap(), Config::default());
    let room = Room::default();
    let tally = Tally::default();
    let counter = WaitCounter::start(
        db.config(),
        (0..KEYS).map(|k| Slot { id: k as i64 }.lock_key()),
    );
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
    let waits = counter.stop();
    println!("{guard:?}: {tally:?}, {waits:?}");
    (tally, waits)
}

#[test]
fn exclusive_locks_never_overlap() {
    let (tally, waits) = workload(Guard::Locked);
    tally.assert_excluded(&waits);
}

/// Control: each worker locking keys of its own overlaps, so the detector
/// above can fail.
#[test]
fn control_without_shared_keys_overlaps() {
    let (tally, _) = workload(Guard::PrivateKeys);
    tally.assert_overlapped("the detector saw no overlap without exclusion");
}

/// Control: xact locks taken outside a transaction exclude nothing.
#[test]
fn control_autocommit_xact_locks_overlap() {
    let (tally, _) = workload(Guard::Autocommit);
    tally.assert_overlapped("autocommit xact locks seemed to exclude");
}
