//! The lock budget and the bookkeeping of what a transaction holds.
//!
//! [`TxLocks`] is driver-independent: the tokio-postgres transaction and the
//! Diesel adapter both keep one per transaction and ask it, before sending
//! anything, which keys still need a round trip and whether taking them would
//! exceed the budget or break the global order.

use std::panic::Location;

use smallvec::SmallVec;

use crate::engine::config::{Config, OrderCheck};
use crate::engine::error::{Acquired, Error, ErrorKind};
use crate::engine::plan::{Mode, Plan, RAW};
use crate::key::LockKey;

/// At which savepoint depth each mode of a key was taken (0 = the top-level
/// transaction). A rollback to depth `d` releases modes taken at `d` or deeper.
/// With the key's type and the call site that first took it, which a
/// lock-order error names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    shared: Option<u32>,
    exclusive: Option<u32>,
    key_type: &'static str,
    site: Option<&'static Location<'static>>,
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            shared: None,
            exclusive: None,
            key_type: RAW,
            site: None,
        }
    }
}

/// What a lock call asks for, as the bookkeeping checks it: its keys in the
/// global order with their modes, their types (parallel to the keys), the
/// application's call site, and whether the call may wait (a try never
/// waits, so it cannot close a wait cycle: the order check skips it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Asked<'r> {
    pub(crate) keys: &'r [(LockKey, Mode)],
    pub(crate) types: &'r [&'static str],
    pub(crate) site: Option<&'static Location<'static>>,
    pub(crate) waits: bool,
}

/// A waiting request below a key held: what [`OrderCheck::Warn`] warns of
/// and [`OrderCheck::Error`] refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OutOfOrder {
    pub(crate) held: Acquired,
    pub(crate) requested: Acquired,
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

    /// Records each `(key, mode, type)` of `taken` (sorted, distinct) as
    /// taken at `depth` by the call at `site`, unless that mode of the key
    /// is held already.
    fn take(
        &mut self,
        taken: impl Iterator<Item = (LockKey, Mode, &'static str)>,
        depth: u32,
        site: Option<&'static Location<'static>>,
    ) {
        let mut taken = taken.peekable();
        let new = |mode: Mode, key_type: &'static str| {
            let mut entry = Entry {
                key_type,
                site,
                ..Entry::default()
            };
            *entry.slot(mode) = Some(depth);
            entry
        };
        // The common case, keys taken in the global order: each sorts after
        // everything held, and is appended.
        while let Some((key, mode, key_type)) =
            taken.next_if(|(k, _, _)| self.0.last().is_none_or(|(last, _)| last < k))
        {
            self.0.push((key, new(mode, key_type)));
        }
        if taken.peek().is_none() {
            return;
        }
        let mut held = std::mem::take(&mut self.0).into_iter().peekable();
        let mut merged = SmallVec::with_capacity(held.len() + taken.size_hint().0);
        for (key, mode, key_type) in taken {
            while let Some(before) = held.next_if(|(k, _)| *k < key) {
                merged.push(before);
            }
            let entry = match held.next_if(|(k, _)| *k == key) {
                Some((_, mut entry)) => {
                    let slot = entry.slot(mode);
                    if slot.is_none() {
                        *slot = Some(depth);
                    }
                    entry
                }
                None => new(mode, key_type),
            };
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
    #[cfg(test)]
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

    /// Whether a lock call's error aborted the transaction, or the
    /// savepoint it ran in, with no rollback to that savepoint since.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted_at.is_some()
    }

    /// Decides what a request must send: the keys (already in global order)
    /// not yet held in a covering mode, and, under [`OrderCheck::Warn`], the
    /// order violation to warn about. Checks poisoning, the abort state, the
    /// budget and the lock order first; on any error nothing is to be sent and
    /// nothing changes. The order is checked only for a request that waits:
    /// a try never waits, so it cannot close a wait cycle.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Poisoned`], [`ErrorKind::LockInFlight`], [`ErrorKind::TransactionAborted`],
    /// [`ErrorKind::BudgetExceeded`], and [`ErrorKind::LockOrder`] when `config` says
    /// order violations are errors.
    pub(crate) fn plan(
        &self,
        asked: Asked<'_>,
        allowed: usize,
        config: &Config,
    ) -> Result<(Plan, Option<OutOfOrder>), Error> {
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
        for (i, &(key, mode)) in asked.keys.iter().enumerate() {
            let held = self.held.get(key);
            if !held.and_then(Entry::mode).is_some_and(|h| h.covers(mode)) {
                new += usize::from(held.is_none());
                plan.push(key, mode, asked.types.get(i).copied().unwrap_or(RAW));
            }
        }
        if self.held.len() + new > allowed {
            return Err(self.over_budget(&plan, new, allowed));
        }
        let mut out_of_order = None;
        if let (true, Some(first), Some(&(held, entry))) =
            (asked.waits, plan.keys().next(), self.held.0.last())
        {
            if first < held && config.order_check != OrderCheck::Off {
                let violation = OutOfOrder {
                    held: Acquired {
                        key: held,
                        key_type: entry.key_type,
                        site: entry.site,
                    },
                    requested: Acquired {
                        key: first,
                        key_type: plan.types()[0],
                        site: asked.site,
                    },
                };
                match config.order_check {
                    OrderCheck::Error => {
                        return Err(Error::lock_order(violation.held, violation.requested))
                    }
                    _ => out_of_order = Some(violation),
                }
            }
        }
        Ok((plan, out_of_order))
    }

    /// The budget error of `plan`, whose `new` keys are not held yet: the
    /// types held (most keys first) and the types requested.
    #[cold]
    fn over_budget(&self, plan: &Plan, new: usize, allowed: usize) -> Error {
        let mut held_types: Vec<(&'static str, usize)> = Vec::new();
        for (_, entry) in &self.held.0 {
            match held_types.iter_mut().find(|(t, _)| *t == entry.key_type) {
                Some((_, n)) => *n += 1,
                None => held_types.push((entry.key_type, 1)),
            }
        }
        held_types.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let requested: Vec<LockKey> = plan
            .keys()
            .filter(|k| self.held.get(*k).is_none())
            .collect();
        Error::budget(
            (self.held.len(), held_types),
            new,
            allowed,
            plan.distinct_types(Some(&requested)),
        )
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
    /// [`Plan::taken`]), are now held at `depth`, taken by the call at
    /// `site`. When the request failed
    /// and the transaction is aborted (`aborted`), the keys may be partly
    /// held: they are recorded as held (so the budget stays conservative)
    /// and every later request fails until a rollback to `depth` or above
    /// forgets them.
    pub(crate) fn finish(
        &mut self,
        taken: impl Iterator<Item = (LockKey, Mode, &'static str)>,
        (depth, site): (u32, Option<&'static Location<'static>>),
        acquired: bool,
        aborted: bool,
    ) {
        self.in_flight = false;
        if acquired || aborted {
            self.held.take(taken, depth, site);
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

    /// A request of `keys` that waits, of type `raw`, from no known site.
    fn ask(keys: &[(LockKey, Mode)]) -> Asked<'_> {
        Asked {
            keys,
            types: &[],
            site: None,
            waits: true,
        }
    }

    fn req(keys: &[(i64, Mode)]) -> Vec<(LockKey, Mode)> {
        keys.iter()
            .map(|(k, m)| (LockKey::BigInt(*k), *m))
            .collect()
    }

    /// Takes `keys` (waiting) in `t` at `depth`, checked by `c`.
    fn take(t: &mut TxLocks, keys: &[(i64, Mode)], depth: u32, c: &Config) {
        let p = t.plan(ask(&req(keys)), 10, c).unwrap().0;
        t.start();
        t.finish(p.taken(), (depth, None), true, false);
    }

    /// Under the order check, asking above the highest key held is in
    /// order, and so is upgrading the highest key itself.
    #[test]
    fn ascending_requests_and_an_upgrade_of_the_top_key_are_in_order() {
        let c = cfg(OrderCheck::Error);
        let mut t = TxLocks::default();
        take(&mut t, &[(1, Mode::Exclusive)], 0, &c);
        take(&mut t, &[(5, Mode::Shared)], 0, &c);
        let (plan, warned) = t.plan(ask(&req(&[(5, Mode::Exclusive)])), 10, &c).unwrap();
        assert_eq!(
            (plan.len(), warned),
            (1, None),
            "the upgrade of the top key"
        );
        let (plan, warned) = t.plan(ask(&req(&[(9, Mode::Exclusive)])), 10, &c).unwrap();
        assert_eq!(
            (plan.len(), warned),
            (1, None),
            "a key above every one held"
        );
    }

    /// Releasing a savepoint of a transaction that no error aborted leaves
    /// it usable; one that an error aborted stays aborted one level up.
    #[test]
    fn a_released_savepoint_aborts_nothing() {
        let c = cfg(OrderCheck::Off);
        let mut t = TxLocks::default();
        take(&mut t, &[(1, Mode::Exclusive)], 1, &c);
        t.release_savepoint(1);
        assert!(t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c).is_ok());
        let p = t
            .plan(ask(&req(&[(3, Mode::Exclusive)])), 10, &c)
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), (2, None), false, true);
        t.release_savepoint(2);
        let err = t
            .plan(ask(&req(&[(4, Mode::Exclusive)])), 10, &c)
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
        t.rollback_savepoint(1);
        assert!(t.plan(ask(&req(&[(4, Mode::Exclusive)])), 10, &c).is_ok());
    }

    #[test]
    fn relock_sends_nothing_and_upgrade_sends() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Error);
        let p = t
            .plan(
                ask(&req(&[(1, Mode::Shared), (2, Mode::Exclusive)])),
                10,
                &c,
            )
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), (0, None), true, false);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.plan(ask(&req(&[(1, Mode::Shared), (2, Mode::Shared)])), 10, &c)
                .unwrap()
                .0
                .len(),
            0
        );
        let up = t
            .plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c)
            .unwrap()
            .0;
        assert_eq!(up.len(), 0);
        // Upgrading 1 sorts below 2, already held: an order violation.
        assert!(matches!(
            t.plan(ask(&req(&[(1, Mode::Exclusive)])), 10, &c),
            Err(e) if e.kind() == ErrorKind::LockOrder
        ));
        let up = t
            .plan(
                ask(&req(&[(1, Mode::Exclusive)])),
                10,
                &cfg(OrderCheck::Off),
            )
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
            .plan(ask(&req(&[(1, Mode::Shared), (2, Mode::Shared)])), 2, &c)
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), (0, None), true, false);
        let up = t.plan(ask(&req(&[(2, Mode::Exclusive)])), 2, &c).unwrap().0;
        assert_eq!(up.len(), 1);
        let both = t
            .plan(
                ask(&req(&[(1, Mode::Exclusive), (2, Mode::Exclusive)])),
                2,
                &c,
            )
            .unwrap()
            .0;
        assert_eq!(both.len(), 2);
        let err = t
            .plan(ask(&req(&[(2, Mode::Exclusive), (3, Mode::Shared)])), 2, &c)
            .unwrap_err();
        assert_eq!(err.budget_counts(), Some((2, 1, 2)), "{err}");
    }

    #[test]
    fn budget_counts_distinct_new_keys() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        let p = t
            .plan(
                ask(&req(&[(1, Mode::Exclusive), (2, Mode::Exclusive)])),
                3,
                &c,
            )
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), (0, None), true, false);
        let err = t
            .plan(
                ask(&req(&[
                    (2, Mode::Exclusive),
                    (3, Mode::Exclusive),
                    (4, Mode::Exclusive),
                ])),
                3,
                &c,
            )
            .unwrap_err();
        assert_eq!(err.budget_counts(), Some((2, 2, 3)), "{err}");
        assert_eq!(
            t.plan(
                ask(&req(&[(2, Mode::Exclusive), (3, Mode::Exclusive)])),
                3,
                &c
            )
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
            take(&mut t, &[(key, Mode::Shared)], depth, &c);
        }
        take(&mut t, &[(1, Mode::Exclusive)], 2, &c);
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
        let p = t
            .plan(ask(&req(&[(1, Mode::Exclusive)])), 10, &c)
            .unwrap()
            .0;
        t.start();
        assert!(matches!(
            t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c),
            Err(e) if e.kind() == ErrorKind::LockInFlight
        ));
        t.finish(p.taken(), (1, None), false, true);
        assert!(matches!(
            t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c),
            Err(e) if e.kind() == ErrorKind::TransactionAborted
        ));
        t.rollback_savepoint(1);
        assert_eq!(t.len(), 0);
        assert!(t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c).is_ok());
        t.start();
        t.poison();
        assert!(matches!(
            t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c),
            Err(e) if e.kind() == ErrorKind::Poisoned
        ));
        t.rollback_savepoint(0);
        assert!(
            matches!(
                t.plan(ask(&req(&[(2, Mode::Exclusive)])), 10, &c),
                Err(e) if e.kind() == ErrorKind::Poisoned
            ),
            "poison lasts until the transaction ends"
        );
    }

    /// The held set (a sorted vector) against a `BTreeMap` model, over
    /// random plans that interleave with what
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
                t.finish(plan.taken(), (depth, None), true, false);
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

    /// A try never waits, so it cannot close a wait cycle: below a key
    /// held, it is neither refused nor warned of; the same key asked for by
    /// a call that waits is (the control).
    #[test]
    fn a_try_below_a_held_key_is_not_an_order_violation() {
        let mut t = TxLocks::default();
        let p = t
            .plan(
                ask(&req(&[(5, Mode::Exclusive)])),
                10,
                &cfg(OrderCheck::Error),
            )
            .unwrap()
            .0;
        t.start();
        t.finish(p.taken(), (0, None), true, false);
        let low = req(&[(1, Mode::Exclusive)]);
        for check in [OrderCheck::Error, OrderCheck::Warn] {
            let tried = Asked {
                waits: false,
                ..ask(&low)
            };
            let (plan, warned) = t.plan(tried, 10, &cfg(check)).unwrap();
            assert_eq!((plan.len(), warned), (1, None), "{check:?}");
        }
        let err = t.plan(ask(&low), 10, &cfg(OrderCheck::Error)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
        let warned = t.plan(ask(&low), 10, &cfg(OrderCheck::Warn)).unwrap().1;
        assert!(warned.is_some());
    }

    /// A lock-order error names the types of both keys and the call sites
    /// that took the one held and asked for the one below it.
    #[test]
    fn an_order_error_names_types_and_sites() {
        let (taken_at, asked_at) = (Location::caller(), Location::caller());
        let mut t = TxLocks::default();
        let high = req(&[(5, Mode::Exclusive)]);
        let asked = Asked {
            types: &["app.account"],
            site: Some(taken_at),
            ..ask(&high)
        };
        let p = t.plan(asked, 10, &cfg(OrderCheck::Error)).unwrap().0;
        t.start();
        t.finish(p.taken(), (0, Some(taken_at)), true, false);
        let low = req(&[(1, Mode::Exclusive)]);
        let asked = Asked {
            types: &["app.report"],
            site: Some(asked_at),
            ..ask(&low)
        };
        let err = t.plan(asked, 10, &cfg(OrderCheck::Error)).unwrap_err();
        assert_eq!(err.key_types(), ["app.account", "app.report"]);
        assert_eq!(
            err.lock_order_sites(),
            Some((Some(taken_at), Some(asked_at)))
        );
        assert_eq!(
            err.lock_order_keys(),
            Some((LockKey::BigInt(5), LockKey::BigInt(1)))
        );
        let message = err.to_string();
        for part in [
            format!("the app.report key 1 (requested at {asked_at})"),
            format!("the app.account key 5 (taken at {taken_at})"),
        ] {
            assert!(message.contains(&part), "{part:?} in {message}");
        }
    }

    /// A budget error names the types held (most first) and requested.
    #[test]
    fn a_budget_error_names_types() {
        let mut t = TxLocks::default();
        let c = cfg(OrderCheck::Off);
        let held = req(&[
            (1, Mode::Exclusive),
            (2, Mode::Exclusive),
            (3, Mode::Shared),
        ]);
        let asked = Asked {
            types: &["app.order", "app.account", "app.account"],
            ..ask(&held)
        };
        let p = t.plan(asked, 4, &c).unwrap().0;
        t.start();
        t.finish(p.taken(), (0, None), true, false);
        let more = req(&[
            (3, Mode::Exclusive),
            (4, Mode::Exclusive),
            (5, Mode::Exclusive),
        ]);
        let asked = Asked {
            types: &["app.account", "app.event", "app.event"],
            ..ask(&more)
        };
        let err = t.plan(asked, 4, &c).unwrap_err();
        assert_eq!(err.budget_counts(), Some((3, 2, 4)), "{err}");
        assert_eq!(err.key_types(), ["app.event"], "{err}");
        assert_eq!(
            err.budget_held_types(),
            Some(&[("app.account", 2), ("app.order", 1)][..])
        );
        assert_eq!(
            err.to_string(),
            "lock budget exceeded: 3 held (2 app.account, 1 app.order) + 2 requested of type app.event > 4 allowed per transaction"
        );
    }
}
