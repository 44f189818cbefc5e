//! The grant: the proof that a lock call was granted, and the guards an
//! adapter makes of it.

#[cfg(doc)]
use super::{Acquisition, Request, Wait};
use crate::engine::error::Error;
use crate::engine::guard::{Busy, Held, HeldBatch};
use crate::engine::plan::Mode;
use crate::fencing::FencingToken;
use crate::key::{AdvisoryKey, LockKey};

/// The proof that a lock call was granted, from which an adapter makes the
/// guard it hands out. Only the engine makes one, from checked replies.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(super) key: Option<(LockKey, Mode)>,
    pub(super) keys: Vec<(LockKey, Mode)>,
    /// The fencing token minted with the grant, when the policy mints them
    /// and a statement was sent.
    pub(super) token: Option<FencingToken>,
}

impl Grant {
    /// The key of a one-key call's grant (a permit's: the slot granted):
    /// what a session permit keeps.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn key(&self) -> Option<LockKey> {
        self.key.map(|(key, _)| key)
    }

    /// The guard of a one-key call for `value`, the value the request was
    /// made of ([`Request::one`]). The guard names the key granted: the one
    /// the request computed from `value` and sent, not computed again (a
    /// hand-written [`AdvisoryKey`] may answer another key at each call).
    /// The lifetime `'t` is the adapter's to tie to its transaction.
    ///
    /// # Errors
    ///
    /// Gives `value` back when the grant is not of a one-key call.
    pub(crate) fn held<'t, K: AdvisoryKey>(self, value: K) -> Result<Held<'t, K>, K> {
        match self.key {
            Some((key, mode)) => Ok(Held::new(value, key, mode).with_token(self.token)),
            None => Err(value),
        }
    }

    /// The guard of a batch call. The lifetime `'t` is the adapter's to tie
    /// to its transaction.
    pub(crate) fn batch<'t>(self) -> HeldBatch<'t> {
        // A grant is of one key or of a batch's keys, never both.
        let keys = match self.key {
            Some(one) => vec![one],
            None => self.keys,
        };
        HeldBatch::new(keys).with_token(self.token)
    }

    /// What a one-key lock call that waits ([`Request::one`] with
    /// [`Wait::Forever`] or [`Wait::Timeout`]) answers its caller, from the
    /// call's outcome ([`Acquisition::finish`]): its guard for `value`. The
    /// adapters' one mapping from that outcome to what they return.
    ///
    /// # Errors
    ///
    /// The call's error.
    pub(crate) fn lock<'t, K: AdvisoryKey>(
        outcome: Result<Result<Grant, Busy>, Error>,
        value: K,
    ) -> Result<Held<'t, K>, Error> {
        Ok(Self::try_lock(outcome, value)?.unwrap_or_else(|_| unreachable!("only a try is busy")))
    }

    /// [`Grant::lock`] for a one-key try ([`Wait::Try`]): the guard, or
    /// `value` back when the key is busy.
    ///
    /// # Errors
    ///
    /// The call's error.
    pub(crate) fn try_lock<'t, K: AdvisoryKey>(
        outcome: Result<Result<Grant, Busy>, Error>,
        value: K,
    ) -> Result<Result<Held<'t, K>, K>, Error> {
        Ok(match outcome? {
            Ok(grant) => Ok(grant
                .held(value)
                .unwrap_or_else(|_| unreachable!("a one-key call's grant names its key"))),
            Err(_) => Err(value),
        })
    }

    /// [`Grant::lock`] for a batch that waits ([`Request::batch`]): the
    /// batch's guard.
    ///
    /// # Errors
    ///
    /// The call's error.
    pub(crate) fn lock_batch<'t>(
        outcome: Result<Result<Grant, Busy>, Error>,
    ) -> Result<HeldBatch<'t>, Error> {
        Ok(Self::try_lock_batch(outcome)?.unwrap_or_else(|_| unreachable!("only a try is busy")))
    }

    /// [`Grant::lock`] for a batch try: the batch's guard, or the busy keys
    /// (nothing of the batch is held then).
    ///
    /// # Errors
    ///
    /// The call's error.
    pub(crate) fn try_lock_batch<'t>(
        outcome: Result<Result<Grant, Busy>, Error>,
    ) -> Result<Result<HeldBatch<'t>, Busy>, Error> {
        Ok(outcome?.map(Grant::batch))
    }
}
