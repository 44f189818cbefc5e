//! The lock budget and the bookkeeping of what a transaction holds.
//!
//! [`TxLocks`] is driver-independent: the tokio-postgres transaction and the
//! Diesel adapter both keep one per transaction and ask it, before sending
//! anything, which keys still need a round trip and whether taking them would
//! exceed the budget or break the global order.

use smallvec::SmallVec;

use crate::engine::config::{Config, OrderCheck};
use crate::engine::error::{Error, ErrorKind};
use crate::engine::plan::{Mode, Plan};
use crate::key::LockKey;

/// At which savepoint depth each mode of a key was taken (0 = the top-level
/// transaction). A rollback to depth `d` releases modes taken at `d` or deeper.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    shared: Option<u32>,
    exclusive: Option<u32>,
}

impl Entry {
    fn mode(&self) -> Option<Mode> {
        if self.exclusive.is_some() {
            Some(Mode::Exclusive)
        } else if self.shared.is_some() {
            Some(Mode::Shared)
        } else {
            None
        }
    }

    fn slot(&mut self, mode: Mode) -> &mut Option<u32> {
        match mode {
            Mode::Shared => &mut self.shared,
            Mode::Exclusive => &mut self.exclusive,
        }
    }
}

/// The held keys in the global order, each with its [`Entry`]: a sorted
/// vector, inline for the first two keys (most transactions take one or
/// two), which a lock call's sorted plan is merged into in one pass.
#[derive(Debug, Default)]
struct HeldKeys(SmallVec<[(LockKey, Entry); 2]>);

impl HeldKeys {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, key: LockKey) -> Option<&Entry> {
        self.0
            .binary_search_by_key(&key, |(k, _)| *k)
            .ok()
            .map(|i| &self.0[i].1)
    }

    /// Records each `(key, mode)` of `taken` (sorted, distinct) as taken at
    /// `depth`, unless that mode of the key is held already.
    fn take(&mut self, taken: impl Iterator<Item = (LockKey, Mode)>, depth: u32) {
        let mut taken = taken.peekable();
        // The common case, keys taken in the global order: each sorts after
        // everything held, and is appended.
        while let Some((key, mode)) =
            taken.next_if(|(k, _)| self.0.last().is_none_or(|(last, _)| last < k))
        {
            let mut entry = Entry::default();
            *entry.slot(mode) = Some(depth);
            self.0.push((key, entry));
        }
        if taken.peek().is_none() {
            return;
        }
        let mut held = std::mem::take(&mut self.0).into_iter().peekable();
        let mut merged = SmallVec::with_capacity(held.len() + taken.size_hint().0);
        for (key, mode) in taken {
            while let Some(before) = held.next_if(|(k, _)| *k < key) {
                merged.push(before);
            }
            let mut entry = held
                .next_if(|(k, _)| *k == key)
                .map_or_else(Entry::default, |(_, e)| e);
            let slot = entry.slot(mode);
            if slot.is_none() {
                *slot = Some(depth);
            }
            merged.push((key, entry));
        }
        merged.extend(held);
        self.0 = merged;
    }
}

/// What one transaction holds, as far as lockkit took it: keys, modes, and the
/// savepoint depth that took them; plus whether the transaction is poisoned
/// or aborted.
///
/// For driver adapters; applications use it through a transaction type.
#[derive(Debug, Default)]
pub(crate) struct TxLocks {
    held: HeldKeys,
    in_flight: bool,
    poisoned: bool,
    aborted_at: Option<u32>,
}

impl TxLocks {
    /// Distinct keys held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The mode `key` is held in, if it is.
    pub(crate) fn mode(&self, key: LockKey) -> Option<Mode> {
        self.held.get(key).and_then(Entry::mode)
    }

    /// The held keys in the global order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = (LockKey, Mode)> + '_ {
        self.held
            .0
            .iter()
            .filter_map(|(k, e)| e.mode().map(|m| (*k, m)))
    }

    /// Whether a cancelled lock call left the held set unknown.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Decides what a request must send: the keys (already in global order)
    /// not yet held in a covering mode, and, under [`OrderCheck::Warn`], the
    /// (held, requested) keys of an order violation to warn about. Checks poisoning, the abort state, the
    /// budget and the lock order first; on any error nothing is to be sent and
    /// nothing changes.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Poisoned`], [`ErrorKind::LockInFlight`], [`ErrorKind::TransactionAborted`],
    /// [`ErrorKind::BudgetExceeded`], and [`ErrorKind::LockOrder`] when `config` says
    /// order violations are errors.
    pub(crate) fn plan(
        &self,
        request: &[(LockKey, Mode)],
        allowed: usize,
        config: &Config,
    ) -> Result<(Plan, Option<(LockKey, LockKey)>), Error> {
        if self.poisoned {
            return Err(Error::new(ErrorKind::Poisoned));
        }
        if self.in_flight {
            return Err(Error::new(ErrorKind::LockInFlight));
        }
        if self.aborted_at.is_some() {
            return Err(Error::new(ErrorKind::TransactionAborted));
        }
        // One pass, one lookup per key: most calls are of one key.
        let (mut plan, mut new) = (Plan::default(), 0);
        for &(key, mode) in request {
            let held = self.held.get(key);
            if !held.and_then(Entry::mode).is_some_and(|h| h.covers(mode)) {
                new += usize::from(held.is_none());
                plan.push(key, mode);
            }
        }
        if self.held.len() + new > allowed {
            return Err(Error::budget(self.held.len(), new, allowed));
        }
        let mut out_of_order = None;
        if let (Some(first), Some(&(held, _))) = (plan.keys().next(), self.held.0.last()) {
            if first < held {
                match config.order_check {
                    OrderCheck::Off => {}
                    OrderCheck::Warn => out_of_order = Some((held, first)),
                    OrderCheck::Error => return Err(Error::lock_order(held, first)),
                }
            }
        }
        Ok((plan, out_of_order))
    }

    /// Marks the start of sending `plan`. Until [`TxLocks::finish`] the
    /// transaction counts as poisoned: a caller that never finishes (a
    /// dropped future) leaves it poisoned for good.
    pub(crate) fn start(&mut self) {
        self.in_flight = true;
    }

    /// Records the outcome of a request started with [`TxLocks::start`].
    ///
    /// `acquired` says whether the request's keys, `taken` (its plan's:
    /// [`Plan::taken`]), are now held at `depth`. When the request failed
    /// and the transaction is aborted (`aborted`), the keys may be partly
    /// held: they are recorded as held (so the budget stays conservative)
    /// and every later request fails until a rollback to `depth` or above
    /// forgets them.
    pub(crate) fn finish(
        &mut self,
        taken: impl Iterator<Item = (LockKey, Mode)>,
        depth: u32,
        acquired: bool,
        aborted: bool,
    ) {
        self.in_flight = false;
        if acquired || aborted {
            self.held.take(taken, depth);
        }
        if aborted {
            self.aborted_at = Some(self.aborted_at.map_or(depth, |d| d.min(depth)));
        }
    }

    /// Marks the transaction poisoned (a request's outcome is unknown).
    pub(crate) fn poison(&mut self) {
        self.poisoned = true;
    }

    /// The savepoint at `depth` was released: what it took now belongs to
    /// `depth - 1`.
    pub(crate) fn release_savepoint(&mut self, depth: u32) {
        for (_, e) in &mut self.held.0 {
            for slot in [&mut e.shared, &mut e.exclusive] {
                if *slot >= Some(depth) {
                    *slot = Some(depth.saturating_sub(1));
                }
            }
        }
        if self.aborted_at >= Some(depth) {
            self.aborted_at = Some(depth.saturating_sub(1));
        }
    }

    /// The savepoint at `depth` was rolled back: the server released what it
    /// (and deeper savepoints) took.
    pub(crate) fn rollback_savepoint(&mut self, depth: u32) {
        self.held.0.retain(|(_, e)| {
            for slot in [&mut e.shared, &mut e.exclusive] {
                if *slot >= Some(depth) {
                    *slot = None;
                }
            }
            e.mode().is_some()
        });
        if self.aborted_at >= Some(depth) {
            self.aborted_at = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(order: OrderCheck) -> Config {
        Config::default().order_check(order)
    }

    fn req(keys: &[(i64, Mode)]) -> Vec<(LockKey, Mode)> {
        keys.iter()
            .map(|(k, m)| (LockKey::BigInt(*k), *m))
            .collect()
    }

    #[test]
    fn relock_sends_nothing_and_upgrade_sends() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Error);
        let p = t
            .plan(&req(&[(1, Mode::Shared), (2, Mode::Exclusive)]), 10, &c)
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), 0, true, false);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.plan(&req(&[(1, Mode::Shared), (2, Mode::Shared)]), 10, &c)
                .unwrap()
                .0
                .len(),
            0
        );
        let up = t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c).unwrap().0;
        assert_eq!(up.len(), 0);
        // Upgrading 1 sorts below 2, already held: an order violation.
        assert!(matches!(
            t.plan(&req(&[(1, Mode::Exclusive)]), 10, &c),
            Err(e) if e.kind() == ErrorKind::LockOrder
        ));
        let up = t
            .plan(&req(&[(1, Mode::Exclusive)]), 10, &cfg(OrderCheck::Off))
            .unwrap()
            .0;
        assert_eq!(up.len(), 1);
    }

    /// An upgrade (shared held, exclusive asked) is sent but is not a new
    /// key: at the budget it is allowed, alone or with others, and a key
    /// not held still counts.
    #[test]
    fn an_upgrade_at_the_budget_is_not_a_new_key() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        let p = t
            .plan(&req(&[(1, Mode::Shared), (2, Mode::Shared)]), 2, &c)
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), 0, true, false);
        let up = t.plan(&req(&[(2, Mode::Exclusive)]), 2, &c).unwrap().0;
        assert_eq!(up.len(), 1);
        let both = t
            .plan(&req(&[(1, Mode::Exclusive), (2, Mode::Exclusive)]), 2, &c)
            .unwrap()
            .0;
        assert_eq!(both.len(), 2);
        let err = t
            .plan(&req(&[(2, Mode::Exclusive), (3, Mode::Shared)]), 2, &c)
            .unwrap_err();
        assert_eq!(err.budget_counts(), Some((2, 1, 2)), "{err}");
    }

    #[test]
    fn budget_counts_distinct_new_keys() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        let p = t
            .plan(&req(&[(1, Mode::Exclusive), (2, Mode::Exclusive)]), 3, &c)
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), 0, true, false);
        let err = t
            .plan(
                &req(&[
                    (2, Mode::Exclusive),
                    (3, Mode::Exclusive),
                    (4, Mode::Exclusive),
                ]),
                3,
                &c,
            )
            .unwrap_err();
        assert_eq!(err.budget_counts(), Some((2, 2, 3)), "{err}");
        assert_eq!(
            t.plan(&req(&[(2, Mode::Exclusive), (3, Mode::Exclusive)]), 3, &c)
                .unwrap()
                .0
                .len(),
            1
        );
    }

    #[test]
    fn savepoints_forget_and_keep() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        for (key, depth) in [(1, 0), (2, 1), (3, 2)] {
            let p = t.plan(&req(&[(key, Mode::Shared)]), 10, &c).unwrap().0;
            t.start();
            t.finish(p.taken(), depth, true, false);
        }
        let p = t.plan(&req(&[(1, Mode::Exclusive)]), 10, &c).unwrap().0;
        t.start();
        t.finish(p.taken(), 2, true, false);
        t.release_savepoint(2);
        t.rollback_savepoint(1);
        assert_eq!(
            t.keys().collect::<Vec<_>>(),
            [(LockKey::BigInt(1), Mode::Shared)]
        );
    }

    #[test]
    fn unfinished_request_poisons_and_abort_needs_rollback() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        let p = t.plan(&req(&[(1, Mode::Exclusive)]), 10, &c).unwrap().0;
        t.start();
        assert!(matches!(
            t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c),
            Err(e) if e.kind() == ErrorKind::LockInFlight
        ));
        t.finish(p.taken(), 1, false, true);
        assert!(matches!(
            t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c),
            Err(e) if e.kind() == ErrorKind::TransactionAborted
        ));
        t.rollback_savepoint(1);
        assert_eq!(t.len(), 0);
        assert!(t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c).is_ok());
        t.start();
        t.poison();
        assert!(matches!(
            t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c),
            Err(e) if e.kind() == ErrorKind::Poisoned
        ));
        t.rollback_savepoint(0);
        assert!(
            matches!(
                t.plan(&req(&[(2, Mode::Exclusive)]), 10, &c),
                Err(e) if e.kind() == ErrorKind::Poisoned
            ),
            "poison lasts until the transaction ends"
        );
    }

    /// The held set against a `BTreeMap` model (what it was before it
    /// became a sorted vector), over random plans that interleave with what
    /// is held, in both key spaces and modes, with savepoint releases and
    /// rollbacks in between.
    #[test]
    fn held_keys_match_a_map_model() {
        use std::collections::BTreeMap;
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut t = TxLocks::default();
            let mut model: BTreeMap<LockKey, Entry> = BTreeMap::new();
            for _ in 0..20 {
                let depth = next(3) as u32;
                let mut keys: Vec<(LockKey, Mode)> = (0..next(6))
                    .map(|_| {
                        let key = match next(2) {
                            0 => LockKey::BigInt(next(12) as i64),
                            _ => LockKey::Pair(next(3) as i32, next(3) as i32),
                        };
                        let mode = [Mode::Shared, Mode::Exclusive][next(2) as usize];
                        (key, mode)
                    })
                    .collect();
                keys.sort_by_key(|(k, _)| *k);
                keys.dedup_by_key(|(k, _)| *k);
                let plan = Plan::from_sorted(keys.iter().copied());
                t.start();
                t.finish(plan.taken(), depth, true, false);
                for (key, mode) in &keys {
                    let slot = model.entry(*key).or_default().slot(*mode);
                    if slot.is_none() {
                        *slot = Some(depth);
                    }
                }
                match next(4) {
                    0 => {
                        t.release_savepoint(depth.max(1));
                        for e in model.values_mut() {
                            for slot in [&mut e.shared, &mut e.exclusive] {
                                if *slot >= Some(depth.max(1)) {
                                    *slot = Some(depth.max(1) - 1);
                                }
                            }
                        }
                    }
                    1 => {
                        t.rollback_savepoint(depth.max(1));
                        model.retain(|_, e| {
                            for slot in [&mut e.shared, &mut e.exclusive] {
                                if *slot >= Some(depth.max(1)) {
                                    *slot = None;
                                }
                            }
                            e.mode().is_some()
                        });
                    }
                    _ => {}
                }
                let expected: Vec<(LockKey, Entry)> = model.iter().map(|(k, e)| (*k, *e)).collect();
                assert_eq!(t.held.0.as_slice(), expected.as_slice());
            }
        }
    }
}
