//! The call's ledger: what a lock call, of either kind, records in its
//! transaction (in flight, outcome, span, metrics), and the transaction's
//! poisoning when a call is cut off.

use std::panic::Location;
use std::sync::MutexGuard;
use std::time::Instant;

#[cfg(doc)]
use super::{Acquisition, OneCall};
use super::{TxState, Wait};
use crate::engine::budget::TxLocks;
use crate::engine::error::Error;
use crate::engine::observe::{observe, KeyType, Outcome};
use crate::engine::plan::Mode;
use crate::key::LockKey;

/// What a lock call records in its transaction, for both kinds of call
/// ([`Acquisition`], [`OneCall`]): that it is in flight, its outcome, its
/// span and its metrics. Dropped before the outcome is recorded, it
/// poisons the transaction: the server may have granted what was sent.
#[derive(Debug)]
pub(super) struct Ledger<'a> {
    pub(super) span: tracing::Span,
    pub(super) state: &'a TxState,
    depth: u32,
    /// The application's call site, which the bookkeeping records with
    /// the keys the call takes.
    site: Option<&'static Location<'static>>,
    pub(super) key_type: &'static KeyType,
    pub(super) started: Instant,
    /// The outcome is recorded, or nothing was to be sent.
    recorded: bool,
    /// A busy outcome is not the call's own (the try that starts a lock
    /// waiting in slices): not observed.
    quiet_busy: bool,
}

impl<'a> Ledger<'a> {
    /// A call at savepoint `depth` from `site` that sends `keys` keys
    /// (none: its outcome is known), marked in flight in `locks` until its
    /// outcome is recorded.
    #[inline]
    pub(super) fn start(
        state: &'a TxState,
        mut locks: MutexGuard<'_, TxLocks>,
        (depth, site): (u32, Option<&'static Location<'static>>),
        key_type: &'static KeyType,
        keys: usize,
        wait: Wait,
    ) -> Self {
        let empty = keys == 0;
        if !empty {
            locks.start();
        }
        drop(locks);
        // No subscriber takes debug spans (or none is set): `none` costs
        // nothing to make, enter, record and drop, where a disabled span
        // still goes through `tracing`'s `log` bridge at each of those.
        let span = if empty || !tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::Span::none()
        } else {
            lock_span(key_type, keys, wait)
        };
        Ledger {
            span,
            state,
            depth,
            site,
            key_type,
            started: Instant::now(),
            recorded: empty,
            quiet_busy: false,
        }
    }

    /// Marks a busy outcome as not the call's own: not observed.
    pub(super) fn quiet_busy(&mut self) {
        self.quiet_busy = true;
    }

    /// Records the outcome: the keys `taken` are held when granted, and
    /// may be when the failure `aborted` the transaction (every later call
    /// then fails until a rollback).
    #[inline]
    pub(super) fn settle(
        &mut self,
        taken: impl Iterator<Item = (LockKey, Mode, &'static str)>,
        outcome: &Result<Granted, Error>,
        aborted: bool,
    ) {
        let acquired = matches!(outcome, Ok(Granted::Now));
        self.state
            .locks()
            .finish(taken, (self.depth, self.site), acquired, aborted);
        self.recorded = true;
        self.observe(outcome);
    }

    /// A reply that is not lockkit's: nothing is known any more, and the
    /// transaction is poisoned.
    pub(super) fn cut_off(&mut self, error: Error) -> Result<Granted, Error> {
        let mut locks = self.state.locks();
        locks.finish(std::iter::empty(), (self.depth, None), false, false);
        locks.poison();
        drop(locks);
        self.recorded = true;
        let outcome = Err(error);
        self.observe(&outcome);
        outcome
    }

    /// Reports a call that went to the server (see [`observe`]).
    fn observe(&self, outcome: &Result<Granted, Error>) {
        let outcome = match outcome {
            Ok(Granted::Now) => Outcome::Granted,
            Ok(Granted::Busy(_)) if self.quiet_busy => return,
            Ok(Granted::Busy(_)) => Outcome::Busy,
            Err(e) => Outcome::of(e.kind()),
        };
        observe(&self.span, self.key_type, outcome, self.started.elapsed());
    }
}

impl Drop for Ledger<'_> {
    fn drop(&mut self) {
        if !self.recorded {
            // Cut off while the server may be granting what was sent.
            let mut locks = self.state.locks();
            locks.finish(std::iter::empty(), (self.depth, None), false, false);
            locks.poison();
        }
    }
}

#[derive(Debug)]
pub(super) enum Granted {
    Now,
    Busy(Vec<LockKey>),
}

/// The `lockkit.lock` span of a call (see [`Acquisition::span`]), or `none`
/// when no subscriber wants it. Out of line: the span's construction is
/// large, and only calls with a debug subscriber run it.
#[cold]
#[inline(never)]
fn lock_span(key_type: &KeyType, keys: usize, wait: Wait) -> tracing::Span {
    let span = tracing::debug_span!(
        "lockkit.lock",
        key_type = key_type.name(),
        keys = keys,
        wait = ?wait,
        outcome = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
    );
    // No subscriber wants this one: `none` as well.
    if span.is_disabled() {
        tracing::Span::none()
    } else {
        span
    }
}
