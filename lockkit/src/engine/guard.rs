//! The guards every adapter hands out: typed proofs that a transaction
//! holds a key, and the busy keys of a failed try-batch.
//!
//! A guard's lifetime ties it to its transaction (in the tokio-postgres
//! adapter it borrows the [`LockTx`](crate::LockTx)), so no guard outlives
//! the locks it proves. Only the engine makes guards, from the checked
//! replies of a lock call ([`Grant`](crate::engine::Grant)).

use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use crate::engine::plan::Mode;
use crate::fencing::FencingToken;
use crate::key::{AdvisoryKey, LockKey};

/// Proof that the transaction holds the advisory lock of a `K` value.
///
/// The lock lasts until the transaction commits or rolls back, whatever
/// happens to this guard: dropping it releases nothing. Holding a `Held<'_, K>`
/// lets a function demand that its caller locked the entity first:
///
/// ```
/// # use lockkit::{AdvisoryKey, Held};
/// # #[derive(AdvisoryKey)] struct Account { id: i64 }
/// fn debit(account: &Held<'_, Account>, cents: i64) {
///     let id = account.id; // `Held` dereferences to the key value
///     # let _ = (id, cents);
/// }
/// ```
#[must_use = "the advisory lock stays held until the transaction ends, whatever happens to this guard; keep it as proof the key is locked"]
pub struct Held<'t, K> {
    value: K,
    key: LockKey,
    mode: Mode,
    token: Option<FencingToken>,
    _tx: PhantomData<&'t ()>,
}

impl<K: fmt::Debug> fmt::Debug for Held<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("value", &self.value)
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("fencing_token", &self.token)
            .finish()
    }
}

impl<K> Held<'_, K> {
    /// The fencing token minted with this grant, when the locker mints
    /// them ([`Config::fencing_tokens`](crate::Config::fencing_tokens)):
    /// larger than every token minted before, for the protected resource to
    /// refuse an older holder's write ([`crate::fencing`]). `None`
    /// otherwise, and for a key the transaction held already (nothing was
    /// sent for it).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
    }
}

impl<K> Held<'_, K> {
    /// The lock key the server granted: the one the lock call computed
    /// from the value, once, and sent.
    pub fn key(&self) -> LockKey {
        self.key
    }

    /// The mode the key is held in (at least the one asked for).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The key value.
    pub fn value(&self) -> &K {
        &self.value
    }

    /// Gives the key value back; the lock stays held until the transaction
    /// ends.
    pub fn into_value(self) -> K {
        self.value
    }
}

impl<K> Deref for Held<'_, K> {
    type Target = K;

    fn deref(&self) -> &K {
        &self.value
    }
}

/// Proof that the transaction holds every key of a batch.
///
/// ```no_run
/// # use lockkit::{AdvisoryKey, Batch, Held, LockTx};
/// # #[derive(AdvisoryKey)] struct Account { id: i64 }
/// # fn debit(_: &Held<'_, Account>) {}
/// # async fn run(tx: &LockTx<'_>) -> Result<(), lockkit::Error> {
/// let held = tx
///     .lock_batch(&Batch::new().with(&Account { id: 1 }).with(&Account { id: 2 }))
///     .await?;
/// assert!(held.contains(&Account { id: 2 }));
/// // A typed proof for one member, for functions that demand one.
/// let one = held.proof(Account { id: 1 }).ok().expect("in the batch");
/// debit(&one);
/// # Ok(())
/// # }
/// ```
#[must_use = "the advisory locks stay held until the transaction ends, whatever happens to this guard; keep it as proof the keys are locked"]
#[derive(Debug)]
pub struct HeldBatch<'t> {
    keys: Vec<(LockKey, Mode)>,
    token: Option<FencingToken>,
    _tx: PhantomData<&'t ()>,
}

impl<'t> HeldBatch<'t> {
    /// The fencing token minted with the batch's grant, after all its keys
    /// were taken, when the locker mints them
    /// ([`Config::fencing_tokens`](crate::Config::fencing_tokens)): larger
    /// than every token minted before ([`crate::fencing`]). `None`
    /// otherwise, and for a batch whose keys the transaction held already
    /// (nothing was sent for it).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
    }

    /// The keys and the modes asked for, in the global lock order.
    pub fn keys(&self) -> &[(LockKey, Mode)] {
        &self.keys
    }

    /// Whether `key` is in the batch (in any mode).
    pub fn contains<K: AdvisoryKey + ?Sized>(&self, key: &K) -> bool {
        self.find(key.lock_key()).is_some()
    }

    /// A typed proof for one value of the batch, or the value back when it
    /// is not in the batch.
    ///
    /// # Errors
    ///
    /// Gives `value` back when its key is not in the batch.
    pub fn proof<K: AdvisoryKey>(&self, value: K) -> Result<Held<'t, K>, K> {
        let key = value.lock_key();
        match self.find(key) {
            Some(mode) => Ok(Held {
                value,
                key,
                mode,
                token: self.token,
                _tx: PhantomData,
            }),
            None => Err(value),
        }
    }

    fn find(&self, key: LockKey) -> Option<Mode> {
        self.keys
            .binary_search_by(|(k, _)| k.cmp(&key))
            .ok()
            .map(|i| self.keys[i].1)
    }
}

/// The keys of a try-batch that another transaction held.
///
/// Its `Display` names how many keys were busy and their types:
/// `2 advisory lock(s) busy, of type Account`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Busy {
    keys: Vec<LockKey>,
    key_types: Vec<&'static str>,
}

impl Busy {
    /// The busy keys, in the global lock order.
    pub fn keys(&self) -> &[LockKey] {
        &self.keys
    }

    /// The key types (the [`AdvisoryKey`] namespaces) of the busy keys:
    /// distinct, in the global lock order of their first busy key (`raw`
    /// for a key given as a plain [`LockKey`]).
    pub fn key_types(&self) -> &[&'static str] {
        &self.key_types
    }
}

impl fmt::Display for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} advisory lock(s) busy", self.keys.len())?;
        match self.key_types.as_slice() {
            [] => Ok(()),
            [one] => write!(f, ", of type {one}"),
            [first, rest @ ..] => {
                write!(f, ", of types {first}")?;
                rest.iter().try_for_each(|t| write!(f, ", {t}"))
            }
        }
    }
}

// Only the engine makes guards, from a checked grant.
impl<K> Held<'_, K> {
    pub(crate) fn new(value: K, key: LockKey, mode: Mode) -> Self {
        Held {
            value,
            key,
            mode,
            token: None,
            _tx: PhantomData,
        }
    }

    /// The guard with the fencing token minted with its grant.
    pub(crate) fn with_token(self, token: Option<FencingToken>) -> Self {
        Held { token, ..self }
    }
}

impl HeldBatch<'_> {
    pub(crate) fn new(keys: Vec<(LockKey, Mode)>) -> Self {
        HeldBatch {
            keys,
            token: None,
            _tx: PhantomData,
        }
    }

    /// The guard with the fencing token minted with its grant.
    pub(crate) fn with_token(self, token: Option<FencingToken>) -> Self {
        HeldBatch { token, ..self }
    }
}

impl Busy {
    pub(crate) fn new(keys: Vec<LockKey>, key_types: Vec<&'static str>) -> Self {
        Busy { keys, key_types }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard hands out the token its grant carried; a batch's proofs
    /// carry the batch's.
    #[test]
    fn guards_carry_their_grants_token() {
        let token = FencingToken::from_parts(1, 2, 3);
        let held = Held::new(7_i64, LockKey::BigInt(7), Mode::Exclusive);
        assert_eq!(held.fencing_token(), None);
        assert_eq!(held.with_token(token).fencing_token(), token);
        let batch = HeldBatch::new(vec![(LockKey::BigInt(7), Mode::Exclusive)]);
        assert_eq!(batch.fencing_token(), None);
        let batch = batch.with_token(token);
        assert_eq!(batch.fencing_token(), token);
        struct K;
        impl AdvisoryKey for K {
            const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("K").raw();
            fn lock_key(&self) -> LockKey {
                LockKey::BigInt(7)
            }
        }
        assert_eq!(batch.proof(K).ok().and_then(|p| p.fencing_token()), token);
    }

    /// A batch's guard knows its keys, and gives a proof for each of them
    /// and for nothing else.
    #[test]
    fn a_batch_contains_its_keys_only() {
        #[derive(Debug, PartialEq)]
        struct K(LockKey);
        impl AdvisoryKey for K {
            const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("K").raw();
            fn lock_key(&self) -> LockKey {
                self.0
            }
        }
        let batch = HeldBatch::new(vec![
            (LockKey::BigInt(3), Mode::Exclusive),
            (LockKey::Pair(1, 2), Mode::Shared),
        ]);
        assert!(batch.contains(&K(LockKey::BigInt(3))));
        assert!(batch.contains(&K(LockKey::Pair(1, 2))));
        assert!(!batch.contains(&K(LockKey::BigInt(4))));
        let proof = batch.proof(K(LockKey::Pair(1, 2))).unwrap();
        assert_eq!(
            (proof.key(), proof.mode()),
            (LockKey::Pair(1, 2), Mode::Shared)
        );
        assert_eq!(
            batch.proof(K(LockKey::BigInt(4))).unwrap_err(),
            K(LockKey::BigInt(4))
        );
    }

    /// A guard's `Debug` shows the value, its key and its mode.
    #[test]
    fn a_guard_shows_its_value_key_and_mode() {
        let held: Held<'_, &str> = Held::new("order 7", LockKey::BigInt(7), Mode::Shared);
        let shown = format!("{held:?}");
        for part in ["Held", "\"order 7\"", "BigInt(7)", "Shared"] {
            assert!(shown.contains(part), "{shown} lacks {part}");
        }
    }

    /// A busy error names how many keys were busy and of which types.
    #[test]
    fn busy_says_how_many_and_of_which_types() {
        let one = Busy::new(vec![LockKey::BigInt(1)], vec!["billing.invoice"]);
        assert_eq!(one.keys(), [LockKey::BigInt(1)]);
        assert_eq!(one.key_types(), ["billing.invoice"]);
        assert_eq!(
            one.to_string(),
            "1 advisory lock(s) busy, of type billing.invoice"
        );
        let two = Busy::new(
            vec![LockKey::BigInt(1), LockKey::Pair(2, 3)],
            vec!["order", "account"],
        );
        assert_eq!(
            two.to_string(),
            "2 advisory lock(s) busy, of types order, account"
        );
        assert_eq!(
            Busy::new(vec![LockKey::BigInt(1)], vec![]).to_string(),
            "1 advisory lock(s) busy"
        );
    }
}
