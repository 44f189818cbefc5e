//! The driver-independent half of the concurrency tests: the seed, the
//! seeded workload generators, the in-process detectors of overlapping
//! holders, and the tallies with their assertions. The conformance suite
//! (`tests/conformance`) runs them on every stack (tokio-postgres, Diesel,
//! diesel-async, sqlx), so all are held to the same workloads, counts and
//! controls; `tests/lockkit/exclusion.rs` runs the autocommit control and
//! the read/write workload on tokio-postgres.

use lockkit::Error;

/// The seed of a randomized test: `LOCKKIT_SEED` if set, else random.
/// Printed, so a failure can be replayed with `LOCKKIT_SEED`.
pub fn seed() -> u64 {
    let seed = std::env::var("LOCKKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("seed = {seed} (rerun with LOCKKIT_SEED={seed})");
    seed
}

/// The random number generator of worker number `worker` in a test seeded
/// with `seed`: each worker draws its own sequence, replayable from `seed`.
pub fn worker_rng(seed: u64, worker: usize) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed.wrapping_add(worker as u64))
}

/// Deadlock freedom: random multi-key transactions in mixed modes over a
/// small key space of `BigInt` and `Pair` keys, taken either as one sorted
/// batch (never deadlocks) or one key at a time in random order (the
/// control, which does).
pub mod deadlock {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
    use std::sync::Mutex;

    use lockkit::Mode;

    use super::Error;
    use crate::waits::Waits;

    /// The fewest lock requests of the sorted workload the server must be
    /// seen making wait (a lower bound, see [`crate::waits`]).
    pub const MIN_WAITS: u64 = 500;

    /// Keys `0..KEYS`: the lower half `BigInt` keys, the upper half `Pair`
    /// keys (see [`is_big`]).
    pub const KEYS: usize = 20;

    /// Whether key `k` is in the lower half of the key space, which the
    /// tests map to a `BigInt` key type (the upper half to a `Pair` one).
    pub fn is_big(k: usize) -> bool {
        k < KEYS / 2
    }

    /// How a transaction takes its keys.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Acquire {
        /// One `lock_batch`, in the global lock order.
        SortedBatch,
        /// Control: `lock` / `lock_shared` per key, in random order.
        OneByOneShuffled,
    }

    /// What a deadlock workload did, counted by its workers.
    #[derive(Debug, Default)]
    pub struct Tally {
        committed: AtomicU64,
        deadlocks: AtomicU64,
        mixed_forms: AtomicU64,
        other_errors: Mutex<Vec<String>>,
    }

    impl Tally {
        /// Counts how a transaction ended: committed, chosen as a deadlock
        /// victim (`40P01`; the server aborted it before it got in, and
        /// dropping it rolled it back), or failed otherwise.
        pub fn record(&self, result: Result<(), Error>) {
            match result {
                Ok(()) => {
                    self.committed.fetch_add(1, SeqCst);
                }
                Err(e) if e.is_deadlock() => {
                    self.deadlocks.fetch_add(1, SeqCst);
                }
                Err(e) => self
                    .other_errors
                    .lock()
                    .unwrap()
                    .push(format!("{e} ({:?})", e.code())),
            }
        }

        /// Asserts that all of `transactions` committed without an error or
        /// a deadlock, that some of them mixed `BigInt` and `Pair` keys, and
        /// that the server was seen making at least [`MIN_WAITS`] lock
        /// requests wait (`waits`, counted on the workload's keys by a
        /// [`WaitCounter`](crate::waits::WaitCounter)), so the absence of
        /// deadlocks means something.
        ///
        /// # Panics
        ///
        /// If any of that does not hold.
        pub fn assert_never_deadlocked(&self, transactions: usize, waits: &Waits) {
            let errors = self.other_errors.lock().unwrap();
            assert!(errors.is_empty(), "errors: {errors:?}");
            assert_eq!(self.deadlocks.load(SeqCst), 0, "40P01 in sorted batches");
            assert_eq!(self.committed.load(SeqCst), transactions as u64);
            assert!(self.mixed_forms.load(SeqCst) > 0, "no BigInt+Pair batch");
            waits.assert_waited("sorted batches", MIN_WAITS);
        }

        /// The control's assertions: no error other than deadlocks, at least
        /// one deadlock, and every other one of `transactions` committed.
        ///
        /// # Panics
        ///
        /// If any of that does not hold.
        pub fn assert_deadlocked(&self, transactions: usize) {
            let errors = self.other_errors.lock().unwrap();
            assert!(errors.is_empty(), "errors: {errors:?}");
            let deadlocks = self.deadlocks.load(SeqCst);
            assert!(deadlocks > 0, "no deadlock in the control: {self:?}");
            assert_eq!(self.committed.load(SeqCst) + deadlocks, transactions as u64);
        }
    }

    /// Per-key holders: an exclusion check for free.
    #[derive(Debug, Default)]
    pub struct Holders {
        exclusive: [AtomicU32; KEYS],
        shared: [AtomicU32; KEYS],
    }

    impl Holders {
        /// Marks `keys` held, once their locks are granted.
        ///
        /// # Panics
        ///
        /// If another worker holds one of them in a conflicting mode: the
        /// locks did not exclude.
        pub fn enter(&self, keys: &[(usize, Mode)]) {
            for &(k, mode) in keys {
                match mode {
                    Mode::Exclusive => {
                        let before = self.exclusive[k].fetch_add(1, SeqCst);
                        assert!(before == 0 && self.shared[k].load(SeqCst) == 0, "{k}");
                    }
                    Mode::Shared => {
                        self.shared[k].fetch_add(1, SeqCst);
                        assert_eq!(self.exclusive[k].load(SeqCst), 0, "{k}");
                    }
                }
            }
        }

        /// Marks `keys` released, before their locks are.
        pub fn leave(&self, keys: &[(usize, Mode)]) {
            for &(k, mode) in keys {
                match mode {
                    Mode::Exclusive => self.exclusive[k].fetch_sub(1, SeqCst),
                    Mode::Shared => self.shared[k].fetch_sub(1, SeqCst),
                };
            }
        }
    }

    /// The keys of a worker's next transaction: two to five distinct keys
    /// in random order, each shared one time in three, else exclusive.
    /// Counts it in `tally` if it mixes `BigInt` and `Pair` keys.
    pub fn key_set(rng: &mut fastrand::Rng, tally: &Tally) -> Vec<(usize, Mode)> {
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
        if keys.iter().any(|&(k, _)| is_big(k)) && keys.iter().any(|&(k, _)| !is_big(k)) {
            tally.mixed_forms.fetch_add(1, SeqCst);
        }
        keys
    }
}

/// Mutual exclusion: transactions that each enter the critical sections of
/// one to three random slots of a small key space, with a detector of
/// overlapping sections, guarded by exclusive locks or (the controls) by
/// nothing that excludes.
pub mod exclusion {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

    use crate::waits::Waits;

    /// Slots `0..KEYS`.
    pub const KEYS: usize = 8;

    /// The fewest lock requests of the exclusive workload the server must be
    /// seen making wait (a lower bound, see [`crate::waits`]).
    pub const MIN_WAITS: u64 = 200;

    /// How a worker "guards" its critical section.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Guard {
        /// The real thing: `lock` / `lock_batch` on the slots, in a
        /// `LockTx`.
        Locked,
        /// Control: the same calls, but on keys private to the worker
        /// ([`private_id`]).
        PrivateKeys,
        /// Control: raw `pg_advisory_xact_lock` on the slots in autocommit,
        /// released at the end of that statement (the bug lockkit
        /// prevents).
        Autocommit,
    }

    /// The id of a key private to transaction `i` of worker `worker`, for
    /// [`Guard::PrivateKeys`]: outside the slots and every other worker's.
    pub fn private_id(worker: usize, i: usize) -> i64 {
        1_000_000 * (worker as i64 + 1) + i as i64
    }

    /// Per-key count of workers inside their critical section.
    #[derive(Debug, Default)]
    pub struct Room {
        inside: [AtomicU32; KEYS],
    }

    impl Room {
        /// Enters the critical sections of `slots`, counting as overlaps the
        /// entries that find another worker inside.
        pub fn enter(&self, slots: &[usize], tally: &Tally) {
            for &k in slots {
                if self.inside[k].fetch_add(1, SeqCst) != 0 {
                    tally.overlaps.fetch_add(1, SeqCst);
                }
            }
        }

        /// Leaves the critical sections of `slots`.
        pub fn leave(&self, slots: &[usize]) {
            for &k in slots {
                self.inside[k].fetch_sub(1, SeqCst);
            }
        }
    }

    /// What an exclusion workload did, counted by its workers.
    #[derive(Debug, Default)]
    pub struct Tally {
        /// Entries that found another worker inside the same key's section.
        overlaps: AtomicU64,
        /// Multi-key (batch) transactions.
        batches: AtomicU64,
    }

    impl Tally {
        /// Asserts that no two workers were ever inside one key's section,
        /// that some transactions took several keys, and that the server
        /// was seen making at least [`MIN_WAITS`] of the workload's lock
        /// requests wait (`waits`, counted on the slots' keys by a
        /// [`WaitCounter`](crate::waits::WaitCounter)), so the absence of
        /// overlaps means something.
        ///
        /// # Panics
        ///
        /// If any of that does not hold.
        pub fn assert_excluded(&self, waits: &Waits) {
            assert_eq!(self.overlaps.load(SeqCst), 0, "two holders of one key");
            assert!(self.batches.load(SeqCst) > 0, "no batch: {self:?}");
            waits.assert_waited("exclusive slots", MIN_WAITS);
        }

        /// A control's assertion: the detector saw an overlap. `failure`
        /// heads the panic message.
        ///
        /// # Panics
        ///
        /// If it saw none.
        pub fn assert_overlapped(&self, failure: &str) {
            assert!(self.overlaps.load(SeqCst) > 0, "{failure}: {self:?}");
        }
    }

    /// The slots of a worker's next transaction: one half the time, else
    /// two or three distinct ones (a batch). Counts it in `tally` as a
    /// batch.
    pub fn slots(rng: &mut fastrand::Rng, tally: &Tally) -> Vec<usize> {
        let n = if rng.bool() { 1 } else { rng.usize(2..=3) };
        let ids = rng.choose_multiple(0..KEYS, n);
        if n > 1 {
            tally.batches.fetch_add(1, SeqCst);
        }
        ids
    }
}
