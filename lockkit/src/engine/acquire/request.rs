//! What a lock call starts from: the transaction's [`TxState`] (with its
//! savepoints' ends), and the call's [`Request`] and [`Wait`]; the checks
//! every call passes under the locker's [`Policy`] before anything is
//! sent.

use std::collections::HashSet;
use std::panic::Location;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

#[cfg(doc)]
use super::ledger::Ledger;
#[cfg(doc)]
use super::Acquisition;
use super::Policy;
use crate::engine::budget::{Asked, OutOfOrder, TxLocks};
use crate::engine::error::{Error, ErrorKind};
use crate::engine::observe::{key_type, KeyType};
use crate::engine::plan::{Batch, Mode, Plan};
use crate::key::{AdvisoryKey, KeyForm, LockKey};

/// A transaction's [`TxState`] as a lock handle holds it: owned by the
/// transaction's own handle, borrowed by the handle of a savepoint inside
/// it, so that neither allocates. Dereferences to the state. An adapter
/// that keeps more per transaction than the `TxState` holds its own type
/// `T` (which contains one) the same way.
#[derive(Debug)]
pub(crate) enum TxSlot<'t, T = TxState> {
    /// The transaction's handle: the state is its own.
    Owned(T),
    /// A savepoint's handle: the enclosing transaction's state.
    Borrowed(&'t T),
}

impl<T> std::ops::Deref for TxSlot<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            TxSlot::Owned(state) => state,
            TxSlot::Borrowed(state) => state,
        }
    }
}

/// What one transaction holds through lockkit, shared by the transaction
/// and its savepoints. Adapters keep one per transaction.
#[derive(Debug, Default)]
pub(crate) struct TxState {
    locks: Mutex<TxLocks>,
}

impl TxState {
    /// A transaction that holds nothing.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(super) fn locks(&self) -> MutexGuard<'_, TxLocks> {
        self.locks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Distinct keys held.
    pub(crate) fn held_count(&self) -> usize {
        self.locks().len()
    }

    /// Whether `key` is held in at least `mode`.
    pub(crate) fn holds(&self, key: LockKey, mode: Mode) -> bool {
        self.locks().mode(key).is_some_and(|held| held.covers(mode))
    }

    /// The held keys and modes, in the global order.
    #[cfg(test)]
    pub(crate) fn held(&self) -> Vec<(LockKey, Mode)> {
        self.locks().keys().collect()
    }

    /// Whether a lock call was cut off, so what is held is unknown.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.locks().is_poisoned()
    }

    /// Whether a lock call's error aborted the transaction, or the
    /// savepoint it ran in, with no rollback to that savepoint since: the
    /// server refuses every statement until then, and answers `COMMIT` by
    /// rolling back, which a driver that reads only errors reports as a
    /// commit.
    pub(crate) fn is_aborted(&self) -> bool {
        self.locks().is_aborted()
    }

    /// Records how the savepoint at `depth` ended: released, its locks
    /// belong to `depth - 1`; rolled back, the server released them; not
    /// known, the transaction is poisoned. Depth 0 is the transaction
    /// itself, whose end leaves nothing to record.
    pub(crate) fn end_savepoint(&self, depth: u32, end: SavepointEnd) {
        if depth == 0 {
            return;
        }
        let mut locks = self.locks();
        match end {
            SavepointEnd::Released => locks.release_savepoint(depth),
            SavepointEnd::RolledBack => locks.rollback_savepoint(depth),
            SavepointEnd::Unknown => locks.poison(),
        }
    }

    /// The record of the savepoint at `depth` while its end is in flight.
    /// An adapter's savepoint future holds it from the savepoint's start,
    /// says what a drop at each step would leave on the server
    /// ([`SavepointEnding::if_dropped`]) and records what the server
    /// answered ([`SavepointEnding::record`]). Dropped before that, it
    /// records `if_dropped`: a future dropped half-way (a timeout around
    /// it) leaves no lock reported held that the server released.
    pub(crate) fn ending(&self, depth: u32, if_dropped: SavepointEnd) -> SavepointEnding<'_> {
        SavepointEnding {
            state: self,
            depth,
            if_dropped: Some(if_dropped),
        }
    }

    /// The checks every lock call passes before anything is sent (hot
    /// standby, `hashtext`, then [`TxLocks::plan`]: poisoning, a call in
    /// flight, an aborted transaction, the budget, the lock order of a
    /// call that `waits`), and the keys it must send, with the bookkeeping
    /// still locked for [`Ledger::start`].
    #[inline]
    pub(super) fn open(
        &self,
        policy: &Policy,
        request: &Request,
        waits: bool,
    ) -> Result<(MutexGuard<'_, TxLocks>, Plan), Error> {
        if policy.facts.in_recovery() && !policy.config.standby_allowed() {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if request.hashtext {
            policy.facts.check_hashtext()?;
        }
        let locks = self.locks();
        let asked = Asked {
            keys: request.keys(),
            types: request.types(),
            site: request.site,
            waits,
        };
        let (plan, out_of_order) = locks.plan(asked, policy.budget(), &policy.config)?;
        if let Some(violation) = out_of_order {
            warn_out_of_order(violation);
        }
        Ok((locks, plan))
    }
}

/// How a savepoint ended, for its transaction's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SavepointEnd {
    /// Released: its locks belong to the enclosing level.
    Released,
    /// Rolled back, or sure to be before the connection's next statement
    /// (the driver has sent, or queued, its `ROLLBACK TO`): the server
    /// releases its locks, and the bookkeeping forgets them.
    RolledBack,
    /// Not known (its `RELEASE` or `ROLLBACK TO` failed, or was cut off
    /// where the outcome depends on whether the server ran it): the
    /// transaction is poisoned.
    Unknown,
}

/// A savepoint's end in flight: see [`TxState::ending`].
#[derive(Debug)]
#[must_use = "dropped, it records what a drop means, not what the server answered"]
pub(crate) struct SavepointEnding<'s> {
    state: &'s TxState,
    depth: u32,
    if_dropped: Option<SavepointEnd>,
}

impl SavepointEnding<'_> {
    /// What a drop from now on records: the adapter is about to send the
    /// savepoint's `RELEASE` (usually [`SavepointEnd::Unknown`]) or its
    /// `ROLLBACK TO` ([`SavepointEnd::RolledBack`]).
    pub(crate) fn if_dropped(&mut self, end: SavepointEnd) {
        self.if_dropped = Some(end);
    }

    /// Whether nothing is recorded yet.
    pub(crate) fn is_pending(&self) -> bool {
        self.if_dropped.is_some()
    }

    /// Records how the savepoint ended, once the server answered; a drop
    /// records nothing more.
    pub(crate) fn record(&mut self, end: SavepointEnd) {
        self.if_dropped = None;
        self.state.end_savepoint(self.depth, end);
    }
}

impl Drop for SavepointEnding<'_> {
    fn drop(&mut self) {
        if let Some(end) = self.if_dropped.take() {
            self.state.end_savepoint(self.depth, end);
        }
    }
}

/// The keys of one lock call.
#[derive(Debug)]
pub(crate) struct Request {
    pub(super) keys: Keys,
    pub(super) hashtext: bool,
    pub(super) key_type: &'static KeyType,
    pub(super) site: Option<&'static Location<'static>>,
}

#[derive(Debug)]
pub(super) enum Keys {
    /// One key: a slice of one, as the planner reads every request, and
    /// its type.
    One([(LockKey, Mode); 1], [&'static str; 1]),
    /// The keys in the global order, and their types.
    Many(Vec<(LockKey, Mode)>, Vec<&'static str>),
}

impl Request {
    /// One key in `mode`.
    pub(crate) fn one<K: AdvisoryKey + ?Sized>(key: &K, mode: Mode) -> Self {
        Request {
            keys: Keys::One([(key.lock_key(), mode)], [K::KEY_SPEC.namespace()]),
            hashtext: K::KEY_SPEC.form() == KeyForm::HashText,
            key_type: key_type!(K::KEY_SPEC.namespace()),
            site: None,
        }
    }

    /// One key of type `K` given as its [`LockKey`], in `mode`: typed as
    /// [`one`](Self::one) is (errors name `K`), with no `hashtext` check
    /// (for a caller that checks `hashtext` itself).
    pub(crate) fn key_of<K: AdvisoryKey + ?Sized>(key: LockKey, mode: Mode) -> Self {
        Request {
            keys: Keys::One([(key, mode)], [K::KEY_SPEC.namespace()]),
            hashtext: false,
            key_type: key_type!(K::KEY_SPEC.namespace()),
            site: None,
        }
    }

    /// Every key of `batch`.
    pub(crate) fn batch(batch: &Batch) -> Self {
        Request {
            keys: Keys::Many(batch.planned(), batch.planned_types()),
            hashtext: batch.has_hashtext(),
            key_type: KeyType::BATCH,
            site: None,
        }
    }

    /// The application's call site (`Location::caller()` of the adapter's
    /// `#[track_caller]` lock method): a lock-order error names it (and
    /// the site that took the key held above it), and a lock-order warning
    /// is logged once per call site.
    pub(crate) fn at(mut self, site: &'static Location<'static>) -> Self {
        self.site = Some(site);
        self
    }

    pub(super) fn keys(&self) -> &[(LockKey, Mode)] {
        match &self.keys {
            Keys::One(one, _) => one,
            Keys::Many(many, _) => many,
        }
    }

    /// The key types, parallel to [`Request::keys`].
    fn types(&self) -> &[&'static str] {
        match &self.keys {
            Keys::One(_, one) => one,
            Keys::Many(_, many) => many,
        }
    }
}

/// How a lock call waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Wait {
    /// As long as it takes (or the session's own timeouts allow).
    Forever,
    /// At most this long for the whole call, measured by the server; on
    /// timeout nothing of the request is held and the transaction is usable.
    Timeout(Duration),
    /// Not at all: every key or none; the busy keys come back.
    Try,
}

/// Under [`OrderCheck::Warn`](crate::OrderCheck::Warn): a `tracing`
/// warning, once per call site (every time when the adapter gave none).
fn warn_out_of_order(violation: OutOfOrder) {
    /// A call site: file, line, column.
    type Site = (&'static str, u32, u32);
    static WARNED: OnceLock<Mutex<HashSet<Site>>> = OnceLock::new();
    let OutOfOrder { held, requested } = violation;
    if let Some(site) = requested.site {
        let warned = WARNED.get_or_init(Default::default);
        let first = warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((site.file(), site.line(), site.column()));
        if !first {
            return;
        }
    }
    tracing::warn!(
        held = %held.key,
        held_type = held.key_type,
        held_site = held.site.map(|s| s.to_string()),
        requested = %requested.key,
        requested_type = requested.key_type,
        site = requested.site.map(|s| s.to_string()),
        "lockkit: advisory lock requested below a key already held; this order can deadlock (take keys in one batch); warned once per call site"
    );
}

#[cfg(test)]
mod tests {
    use std::panic::Location;

    use super::warn_out_of_order;
    use crate::engine::budget::OutOfOrder;
    use crate::engine::error::Acquired;
    use crate::engine::observe::recording::recorded;
    use crate::key::LockKey;

    fn violation(site: Option<&'static Location<'static>>) -> OutOfOrder {
        let at = |key| Acquired {
            key: LockKey::BigInt(key),
            key_type: "Order",
            site,
        };
        OutOfOrder {
            held: at(5),
            requested: at(1),
        }
    }

    /// A call site is warned of once, however often it asks out of order;
    /// a call without a site (the adapter gave none) every time.
    #[test]
    fn an_out_of_order_request_warns_once_per_call_site() {
        let (a, b) = (Location::caller(), Location::caller());
        let warned = |site| {
            let ((), seen) = recorded(|| warn_out_of_order(violation(site)));
            seen.matches("event=WARN").count()
        };
        assert_eq!(warned(Some(a)), 1, "a site's first violation");
        assert_eq!(warned(Some(a)), 0, "the same site again");
        assert_eq!(warned(Some(b)), 1, "another site");
        assert_eq!(warned(None), 1, "no site");
        assert_eq!(warned(None), 1, "no site, again");
    }
}
