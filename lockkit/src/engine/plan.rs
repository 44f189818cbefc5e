//! The batch planner: dedupe, resolve modes, sort in the global lock order of
//! KEYS.md, and split into the two key spaces' statement parameters.
//!
//! The order is established here, by sorting [`LockKey`]s (whose `Ord` *is*
//! the global order), and nowhere else: the SQL in [`sql`](crate::driver::sql) takes the
//! arrays in the order given, with no `ORDER BY` to get wrong.

use std::collections::BTreeMap;

use smallvec::SmallVec;

use crate::key::{AdvisoryKey, KeyForm, LockKey};

/// An advisory lock mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// `pg_advisory_xact_lock_shared`: compatible with other shared holders.
    Shared,
    /// `pg_advisory_xact_lock`: excludes every other holder.
    Exclusive,
}

impl Mode {
    /// Whether holding `self` already gives what `wanted` asks for.
    pub(crate) fn covers(self, wanted: Mode) -> bool {
        self >= wanted
    }
}

/// A set of keys to take together, of any key types, each shared or
/// exclusive.
///
/// Acquisition dedupes the keys (a key asked for both shared and exclusive is
/// taken exclusive), sorts them in the global lock order of KEYS.md, and
/// takes them in one round trip. The order in which keys are added does not
/// matter.
///
/// ```
/// use lockkit::{Batch, KeySpec, LockKey, Mode};
///
/// # #[derive(lockkit::AdvisoryKey)] struct Account { id: i64 }
/// let batch = Batch::new()
///     .with(&Account { id: 7 })
///     .with(&Account { id: 3 })
///     .with_shared(&Account { id: 7 });
/// let keys = batch.planned();
/// assert_eq!(keys.len(), 2);
/// assert!(keys.windows(2).all(|w| w[0].0 < w[1].0));
/// assert!(keys.iter().all(|(_, mode)| *mode == Mode::Exclusive));
/// ```
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// Each key's mode and type (its namespace, which errors name).
    keys: BTreeMap<LockKey, (Mode, &'static str)>,
    hashtext: bool,
}

/// The type errors name for a key given as a plain [`LockKey`].
pub(crate) const RAW: &str = "raw";

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `key` in `mode`; exclusive wins over shared.
    pub fn add<K: AdvisoryKey + ?Sized>(&mut self, key: &K, mode: Mode) -> &mut Self {
        self.hashtext |= K::KEY_SPEC.form() == KeyForm::HashText;
        self.add_typed(key.lock_key(), mode, K::KEY_SPEC.namespace())
    }

    /// Adds a precomputed key in `mode`; exclusive wins over shared.
    /// Errors name its type `raw` (unless it is added as a typed key too).
    pub fn add_key(&mut self, key: LockKey, mode: Mode) -> &mut Self {
        self.add_typed(key, mode, RAW)
    }

    fn add_typed(&mut self, key: LockKey, mode: Mode, key_type: &'static str) -> &mut Self {
        let (m, t) = self.keys.entry(key).or_insert((mode, key_type));
        *m = (*m).max(mode);
        if *t == RAW {
            *t = key_type;
        }
        self
    }

    /// Adds `key` exclusive (builder form).
    pub fn with<K: AdvisoryKey + ?Sized>(mut self, key: &K) -> Self {
        self.add(key, Mode::Exclusive);
        self
    }

    /// Adds `key` shared (builder form).
    pub fn with_shared<K: AdvisoryKey + ?Sized>(mut self, key: &K) -> Self {
        self.add(key, Mode::Shared);
        self
    }

    /// Adds every key of `keys` exclusive.
    pub fn extend<'k, K: AdvisoryKey + 'k>(
        &mut self,
        keys: impl IntoIterator<Item = &'k K>,
    ) -> &mut Self {
        for k in keys {
            self.add(k, Mode::Exclusive);
        }
        self
    }

    /// Distinct keys in the batch.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the batch has no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Removes every key, keeping the allocation.
    pub fn clear(&mut self) {
        self.keys.clear();
        self.hashtext = false;
    }

    /// The keys and modes in acquisition order (the global lock order).
    pub fn planned(&self) -> Vec<(LockKey, Mode)> {
        self.iter().collect()
    }

    /// The keys and modes in acquisition order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (LockKey, Mode)> + '_ {
        self.keys.iter().map(|(k, (m, _))| (*k, *m))
    }

    /// The key types (namespaces), parallel to [`Batch::planned`].
    pub(crate) fn planned_types(&self) -> Vec<&'static str> {
        self.keys.values().map(|(_, t)| *t).collect()
    }

    /// Whether any key is a server-`hashtext` key, which needs the server
    /// check of [`KeyForm::HashText`].
    pub(crate) fn has_hashtext(&self) -> bool {
        self.hashtext
    }
}

impl<K: AdvisoryKey> FromIterator<K> for Batch {
    fn from_iter<I: IntoIterator<Item = K>>(iter: I) -> Self {
        let mut b = Batch::new();
        for k in iter {
            b.add(&k, Mode::Exclusive);
        }
        b
    }
}

/// The statement parameters of one acquisition, already in global order:
/// `BigInt` keys first (one statement), then `Pair` keys (a second one).
///
/// Built by the engine's bookkeeping and bound to the statements of
/// [`sql`](crate::driver::sql) in this order. A one-key plan, the most
/// common lock call, is kept inline: planning it allocates nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Each key's type (namespace), in acquisition order.
    types: SmallVec<[&'static str; 1]>,
    bigint: SmallVec<[i64; 1]>,
    bigint_shared: SmallVec<[bool; 1]>,
    class: SmallVec<[i32; 1]>,
    object: SmallVec<[i32; 1]>,
    pair_shared: SmallVec<[bool; 1]>,
}

impl Plan {
    /// Builds the parameters from keys in ascending order.
    #[cfg(test)]
    pub(crate) fn from_sorted(keys: impl IntoIterator<Item = (LockKey, Mode)>) -> Self {
        let mut plan = Plan::default();
        for (key, mode) in keys {
            plan.push(key, mode, RAW);
        }
        plan
    }

    /// Appends `key` of the type `key_type` in `mode`, which sorts after
    /// every key of the plan.
    pub(crate) fn push(&mut self, key: LockKey, mode: Mode, key_type: &'static str) {
        debug_assert!(
            self.last() < Some(key),
            "plan keys must be sorted and distinct"
        );
        self.types.push(key_type);
        match key {
            LockKey::BigInt(k) => {
                self.bigint.push(k);
                self.bigint_shared.push(mode == Mode::Shared);
            }
            LockKey::Pair(c, o) => {
                self.class.push(c);
                self.object.push(o);
                self.pair_shared.push(mode == Mode::Shared);
            }
        }
    }

    /// The last key (`Pair` keys sort after `BigInt` keys).
    fn last(&self) -> Option<LockKey> {
        match (self.class.last(), self.object.last()) {
            (Some(c), Some(o)) => Some(LockKey::Pair(*c, *o)),
            _ => self.bigint.last().map(|k| LockKey::BigInt(*k)),
        }
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.bigint.len() + self.class.len()
    }

    /// Whether there is nothing to send.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys in acquisition order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = LockKey> + '_ {
        let big = self.bigint.iter().map(|k| LockKey::BigInt(*k));
        let pair = self
            .class
            .iter()
            .zip(&self.object)
            .map(|(c, o)| LockKey::Pair(*c, *o));
        big.chain(pair)
    }

    /// The keys, their modes and their types, in acquisition order.
    pub(crate) fn taken(&self) -> impl Iterator<Item = (LockKey, Mode, &'static str)> + '_ {
        self.keys()
            .zip(self.modes())
            .zip(self.types.iter().copied())
            .map(|((k, m), t)| (k, m, t))
    }

    /// The key types (namespaces), parallel to [`Plan::keys`].
    pub(crate) fn types(&self) -> &[&'static str] {
        &self.types
    }

    /// The distinct key types of the keys `of` (a subset of the plan's,
    /// all of them when `None`), in the order of their first key.
    pub(crate) fn distinct_types(&self, of: Option<&[LockKey]>) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = Vec::new();
        for (key, key_type) in self.keys().zip(self.types.iter().copied()) {
            if of.is_none_or(|of| of.contains(&key)) && !out.contains(&key_type) {
                out.push(key_type);
            }
        }
        out
    }

    /// The modes, parallel to [`Plan::keys`].
    pub(crate) fn modes(&self) -> impl Iterator<Item = Mode> + '_ {
        let shared = self.bigint_shared.iter().chain(&self.pair_shared);
        shared.map(|s| if *s { Mode::Shared } else { Mode::Exclusive })
    }

    /// `BigInt` keys, ascending: `$1` of the bigint statements.
    pub(crate) fn bigint(&self) -> &[i64] {
        &self.bigint
    }

    /// Whether each `BigInt` key is shared: `$2` of the bigint statements.
    pub(crate) fn bigint_shared(&self) -> &[bool] {
        &self.bigint_shared
    }

    /// `Pair` classes, parallel to [`Plan::pair_objects`]: `$1` of the pair
    /// statements.
    pub(crate) fn pair_classes(&self) -> &[i32] {
        &self.class
    }

    /// `Pair` objects: `$2` of the pair statements.
    pub(crate) fn pair_objects(&self) -> &[i32] {
        &self.object
    }

    /// Whether each `Pair` key is shared: `$3` of the pair statements.
    pub(crate) fn pair_shared(&self) -> &[bool] {
        &self.pair_shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::KeySpec;

    struct K(i64);
    impl AdvisoryKey for K {
        const KEY_SPEC: KeySpec<'static> = KeySpec::new("K").raw();
        fn lock_key(&self) -> LockKey {
            LockKey::BigInt(self.0)
        }
    }

    struct H(i64);
    impl AdvisoryKey for H {
        const KEY_SPEC: KeySpec<'static> = KeySpec::new("H").hashtext();
        fn lock_key(&self) -> LockKey {
            LockKey::BigInt(self.0)
        }
    }

    /// A key's type is its namespace, which a typed add gives a key first
    /// added raw; a server-`hashtext` key marks the batch until it is
    /// cleared.
    #[test]
    fn a_batch_keeps_its_keys_types_and_hashtext() {
        let mut b = Batch::new();
        assert!(b.is_empty() && !b.has_hashtext());
        b.add_key(LockKey::BigInt(1), Mode::Shared)
            .add(&K(1), Mode::Shared)
            .add(&K(2), Mode::Shared)
            .add_key(LockKey::BigInt(2), Mode::Shared)
            .add_key(LockKey::BigInt(3), Mode::Shared);
        assert_eq!(b.planned_types(), ["K", "K", RAW]);
        assert!(!b.has_hashtext());
        b.add(&H(4), Mode::Exclusive);
        b.add(&K(5), Mode::Exclusive);
        assert!(b.has_hashtext());
        assert_eq!(b.extend(&[K(6), K(7)]).len(), 7);
        b.clear();
        assert!(b.is_empty() && !b.has_hashtext());
    }

    /// A plan's keys are pushed in the global order; one out of order is a
    /// bug of the engine, caught in debug builds.
    #[test]
    #[should_panic(expected = "sorted and distinct")]
    fn a_plan_refuses_a_pair_key_below_its_last() {
        let mut plan = Plan::default();
        plan.push(LockKey::Pair(1, 2), Mode::Exclusive, RAW);
        plan.push(LockKey::Pair(1, 1), Mode::Exclusive, RAW);
    }

    /// As above, for a `BigInt` key after a `Pair` key.
    #[test]
    #[should_panic(expected = "sorted and distinct")]
    fn a_plan_refuses_a_bigint_key_after_a_pair_key() {
        let mut plan = Plan::default();
        plan.push(LockKey::BigInt(1), Mode::Exclusive, RAW);
        plan.push(LockKey::Pair(1, 2), Mode::Exclusive, RAW);
        plan.push(LockKey::BigInt(5), Mode::Exclusive, RAW);
    }

    #[test]
    fn a_batch_collected_counts_its_distinct_keys() {
        let b: Batch = [K(3), K(1), K(3)].into_iter().collect();
        assert_eq!(b.len(), 2);
        assert!(!b.is_empty());
        assert_eq!(
            b.planned(),
            [
                (LockKey::BigInt(1), Mode::Exclusive),
                (LockKey::BigInt(3), Mode::Exclusive)
            ]
        );
    }

    #[test]
    fn dedupes_and_exclusive_wins() {
        let mut b = Batch::new();
        b.add(&K(5), Mode::Shared)
            .add(&K(5), Mode::Exclusive)
            .add(&K(5), Mode::Shared);
        b.add(&K(1), Mode::Shared);
        assert_eq!(
            b.planned(),
            [
                (LockKey::BigInt(1), Mode::Shared),
                (LockKey::BigInt(5), Mode::Exclusive)
            ]
        );
    }

    #[test]
    fn plan_puts_bigint_before_pair_in_order() {
        let mut b = Batch::new();
        b.add_key(LockKey::Pair(1, -1), Mode::Exclusive)
            .add_key(LockKey::BigInt(9), Mode::Shared)
            .add_key(LockKey::Pair(-3, 4), Mode::Exclusive)
            .add_key(LockKey::BigInt(-9), Mode::Exclusive);
        let plan = Plan::from_sorted(b.iter());
        assert_eq!(plan.bigint(), [-9, 9]);
        assert_eq!(plan.bigint_shared(), [false, true]);
        assert_eq!(plan.pair_classes(), [-3, 1]);
        assert_eq!(plan.pair_objects(), [4, -1]);
        assert_eq!(plan.len(), 4);
        let keys: Vec<_> = plan.keys().collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }
}
