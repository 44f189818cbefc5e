//! The acquisition protocol, written once: checks, plan, statements,
//! replies, outcome, guards. No I/O: an adapter sends what
//! [`Acquisition::round`] lists and hands the replies to
//! [`Acquisition::receive`].

use std::collections::HashSet;
use std::panic::Location;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::engine::budget::{Asked, OutOfOrder, TxLocks};
use crate::engine::config::Config;
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::guard::{Busy, Held, HeldBatch};
use crate::engine::observe::{key_type, observe, KeyType, Outcome};
use crate::engine::plan::{Batch, Mode, Plan, RAW};
use crate::engine::sql::timeout_millis;
use crate::engine::statement::{Param, Reply, ReplyShape, Round, Sql, Statement};
use crate::key::{AdvisoryKey, KeyForm, LockKey};

/// What a locker enforces: its [`Config`] and the [`ServerFacts`] it learned.
/// Every adapter's locker holds one.
#[derive(Clone, Debug)]
pub struct Policy {
    config: Config,
    facts: ServerFacts,
}

impl Policy {
    /// A policy of `config` on the server described by `facts`.
    pub fn new(config: Config, facts: ServerFacts) -> Self {
        Policy { config, facts }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The server's facts.
    pub fn facts(&self) -> &ServerFacts {
        &self.facts
    }

    /// The lock budget per transaction (see [`Config::budget`] and
    /// [`Config::concurrent_lockers`]).
    pub fn budget(&self) -> usize {
        self.config.budget_for(&self.facts)
    }
}

/// A transaction's [`TxState`] as a lock handle holds it: owned by the
/// transaction's own handle, borrowed by the handle of a savepoint inside
/// it, so that neither allocates. Dereferences to the state. An adapter
/// that keeps more per transaction than the `TxState` holds its own type
/// `T` (which contains one) the same way.
#[derive(Debug)]
pub enum TxSlot<'t, T = TxState> {
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
pub struct TxState {
    locks: Mutex<TxLocks>,
}

impl TxState {
    /// A transaction that holds nothing.
    pub fn new() -> Self {
        Self::default()
    }

    fn locks(&self) -> MutexGuard<'_, TxLocks> {
        self.locks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Distinct keys held.
    pub fn held_count(&self) -> usize {
        self.locks().len()
    }

    /// Whether `key` is held in at least `mode`.
    pub fn holds(&self, key: LockKey, mode: Mode) -> bool {
        self.locks().mode(key).is_some_and(|held| held.covers(mode))
    }

    /// The held keys and modes, in the global order.
    pub fn held(&self) -> Vec<(LockKey, Mode)> {
        self.locks().keys().collect()
    }

    /// Whether a lock call was cut off, so what is held is unknown.
    pub fn is_poisoned(&self) -> bool {
        self.locks().is_poisoned()
    }

    /// Marks the transaction poisoned: every later lock call fails.
    pub fn poison(&self) {
        self.locks().poison();
    }

    /// Records how the savepoint at `depth` ended: released, its locks
    /// belong to `depth - 1`; rolled back, the server released them; not
    /// known, the transaction is poisoned. Depth 0 is the transaction
    /// itself, whose end leaves nothing to record.
    pub fn end_savepoint(&self, depth: u32, end: SavepointEnd) {
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
    pub fn ending(&self, depth: u32, if_dropped: SavepointEnd) -> SavepointEnding<'_> {
        SavepointEnding {
            state: self,
            depth,
            if_dropped: Some(if_dropped),
        }
    }

    /// Starts acquiring `request` at savepoint `depth` under `policy`:
    /// checks everything that needs no round trip and plans the statements.
    /// On success the transaction counts as having a lock call in flight
    /// until the [`Acquisition`] is finished; dropped unfinished, it poisons
    /// the transaction.
    ///
    /// A one-key call that waits as long as it takes, or not at all, is one
    /// statement: [`TxState::acquire_one`] runs it with less work.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::HotStandby`], [`ErrorKind::HashtextMismatch`],
    /// [`ErrorKind::Poisoned`], [`ErrorKind::LockInFlight`],
    /// [`ErrorKind::TransactionAborted`], [`ErrorKind::BudgetExceeded`] and
    /// [`ErrorKind::LockOrder`] (when configured); nothing is to be sent.
    pub fn acquire<'a>(
        &'a self,
        policy: &Policy,
        depth: u32,
        request: Request,
        wait: Wait,
    ) -> Result<Acquisition<'a>, Error> {
        let (locks, plan) = self.open(policy, &request, wait != Wait::Try)?;
        let empty = plan.is_empty();
        let ledger = Ledger::start(
            self,
            locks,
            (depth, request.site),
            request.key_type,
            plan.len(),
            wait,
        );
        Ok(Acquisition {
            ledger,
            plan,
            request,
            wait,
            stage: if empty {
                Stage::Finished(Ok(Granted::Now))
            } else {
                Stage::Main
            },
        })
    }

    /// Starts a one-key call of one statement: `value`'s key in `mode`,
    /// waiting as long as it takes, or not at all when `try_only` (the
    /// calls behind an adapter's `lock`, `lock_shared`, `try_lock` and
    /// `try_lock_shared`). The same checks and bookkeeping as
    /// [`TxState::acquire`], without its rounds: the adapter runs it with
    /// [`OneCall::run`] and makes the guard from its outcome. `site` is the
    /// application's call site, when the adapter knows it (see
    /// [`Request::at`]).
    ///
    /// # Errors
    ///
    /// As [`TxState::acquire`]; nothing is to be sent.
    pub fn acquire_one<'a, K: AdvisoryKey + ?Sized>(
        &'a self,
        policy: &Policy,
        depth: u32,
        (value, mode): (&K, Mode),
        try_only: bool,
        site: Option<&'static Location<'static>>,
    ) -> Result<OneCall<'a>, Error> {
        let request = Request {
            site,
            ..Request::one(value, mode)
        };
        let (locks, plan) = self.open(policy, &request, !try_only)?;
        let key = request.keys()[0].0;
        // Held already in a mode that covers `mode`: granted, nothing to
        // send, and the guard names the mode held. Sent and granted, the
        // key is held in `mode` (an upgrade is to `mode`).
        let (outcome, held) = match plan.is_empty() {
            true => (Some(Ok(Granted::Now)), locks.mode(key).unwrap_or(mode)),
            false => (None, mode),
        };
        let wait = if try_only { Wait::Try } else { Wait::Forever };
        let ledger = Ledger::start(
            self,
            locks,
            (depth, site),
            request.key_type,
            plan.len(),
            wait,
        );
        Ok(OneCall {
            ledger,
            key,
            mode,
            held,
            try_only,
            outcome,
        })
    }

    /// The checks every lock call passes before anything is sent (hot
    /// standby, `hashtext`, then [`TxLocks::plan`]: poisoning, a call in
    /// flight, an aborted transaction, the budget, the lock order of a
    /// call that `waits`), and the keys it must send, with the bookkeeping
    /// still locked for [`Ledger::start`].
    #[inline]
    fn open(
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

/// What a lock call records in its transaction, for both kinds of call
/// ([`Acquisition`], [`OneCall`]): that it is in flight, its outcome, its
/// span and its metrics. Dropped before the outcome is recorded, it
/// poisons the transaction: the server may have granted what was sent.
#[derive(Debug)]
struct Ledger<'a> {
    span: tracing::Span,
    state: &'a TxState,
    depth: u32,
    /// The application's call site, which the bookkeeping records with
    /// the keys the call takes.
    site: Option<&'static Location<'static>>,
    key_type: &'static KeyType,
    started: Instant,
    /// The outcome is recorded, or nothing was to be sent.
    recorded: bool,
}

impl<'a> Ledger<'a> {
    /// A call at savepoint `depth` from `site` that sends `keys` keys
    /// (none: its outcome is known), marked in flight in `locks` until its
    /// outcome is recorded.
    #[inline]
    fn start(
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
        }
    }

    /// Records the outcome: the keys `taken` are held when granted, and
    /// may be when the failure `aborted` the transaction (every later call
    /// then fails until a rollback).
    #[inline]
    fn settle(
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
    fn cut_off(&mut self, error: Error) -> Result<Granted, Error> {
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
pub struct SavepointEnding<'s> {
    state: &'s TxState,
    depth: u32,
    if_dropped: Option<SavepointEnd>,
}

impl SavepointEnding<'_> {
    /// What a drop from now on records: the adapter is about to send the
    /// savepoint's `RELEASE` (usually [`SavepointEnd::Unknown`]) or its
    /// `ROLLBACK TO` ([`SavepointEnd::RolledBack`]).
    pub fn if_dropped(&mut self, end: SavepointEnd) {
        self.if_dropped = Some(end);
    }

    /// Whether nothing is recorded yet.
    pub fn is_pending(&self) -> bool {
        self.if_dropped.is_some()
    }

    /// Records how the savepoint ended, once the server answered; a drop
    /// records nothing more.
    pub fn record(&mut self, end: SavepointEnd) {
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
pub struct Request {
    keys: Keys,
    hashtext: bool,
    key_type: &'static KeyType,
    site: Option<&'static Location<'static>>,
}

#[derive(Debug)]
enum Keys {
    /// One key: a slice of one, as the planner reads every request, and
    /// its type.
    One([(LockKey, Mode); 1], [&'static str; 1]),
    /// The keys in the global order, and their types.
    Many(Vec<(LockKey, Mode)>, Vec<&'static str>),
}

impl Request {
    /// One key in `mode`.
    pub fn one<K: AdvisoryKey + ?Sized>(key: &K, mode: Mode) -> Self {
        Request {
            keys: Keys::One([(key.lock_key(), mode)], [K::KEY_SPEC.namespace()]),
            hashtext: K::KEY_SPEC.form() == KeyForm::HashText,
            key_type: key_type!(K::KEY_SPEC.namespace()),
            site: None,
        }
    }

    /// One key in `mode`, given as its [`LockKey`] (a plain key: no
    /// `hashtext` check; the key type is reported as `raw`).
    pub fn key(key: LockKey, mode: Mode) -> Self {
        Request {
            keys: Keys::One([(key, mode)], [RAW]),
            hashtext: false,
            key_type: KeyType::RAW,
            site: None,
        }
    }

    /// One key of type `K` given as its [`LockKey`], in `mode`: typed as
    /// [`one`](Self::one) is (errors name `K`), with no `hashtext` check
    /// (for a caller that checks `hashtext` itself).
    pub fn key_of<K: AdvisoryKey + ?Sized>(key: LockKey, mode: Mode) -> Self {
        Request {
            keys: Keys::One([(key, mode)], [K::KEY_SPEC.namespace()]),
            hashtext: false,
            key_type: key_type!(K::KEY_SPEC.namespace()),
            site: None,
        }
    }

    /// Every key of `batch`.
    pub fn batch(batch: &Batch) -> Self {
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
    pub fn at(mut self, site: &'static Location<'static>) -> Self {
        self.site = Some(site);
        self
    }

    fn keys(&self) -> &[(LockKey, Mode)] {
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
pub enum Wait {
    /// As long as it takes (or the session's own timeouts allow).
    Forever,
    /// At most this long for the whole call, measured by the server; on
    /// timeout nothing of the request is held and the transaction is usable.
    Timeout(Duration),
    /// Not at all: every key or none; the busy keys come back.
    Try,
}

#[derive(Debug)]
enum Stage {
    /// The lock statements are to be sent.
    Main,
    /// A try-batch savepoint is to be released (all granted) or rolled back
    /// (busy keys).
    Settle(Vec<LockKey>),
    /// A failure is to be undone by rolling back lockkit's savepoint.
    Recover(Error),
    Finished(Result<Granted, Error>),
}

#[derive(Debug)]
enum Granted {
    Now,
    Busy(Vec<LockKey>),
}

/// One lock call in flight: the statements to send, round by round, and the
/// checked outcome. Dropping it unfinished poisons the transaction, since the
/// server may have granted what was sent.
#[derive(Debug)]
#[must_use = "an acquisition must be driven to its outcome, or it poisons the transaction"]
pub struct Acquisition<'a> {
    ledger: Ledger<'a>,
    plan: Plan,
    request: Request,
    wait: Wait,
    stage: Stage,
}

impl Acquisition<'_> {
    /// The statements to send now, in this order (pipelined where the driver
    /// can), or `None` when the outcome is known: call
    /// [`Acquisition::finish`].
    pub fn round(&self) -> Option<Round<'_>> {
        if let Stage::Finished(_) = self.stage {
            return None;
        }
        let plan = &self.plan;
        let mut out = Round::new();
        match &self.stage {
            Stage::Finished(_) => return None,
            Stage::Recover(_) => out.push(Statement::new(Sql::Rollback, &[])),
            Stage::Settle(busy) if busy.is_empty() => out.push(Statement::new(Sql::Release, &[])),
            Stage::Settle(_) => out.push(Statement::new(Sql::Rollback, &[])),
            Stage::Main => match self.wait {
                Wait::Forever => self.lock_statements(&mut out),
                Wait::Timeout(timeout) => {
                    out.push(Statement::new(Sql::Savepoint, &[]));
                    out.push(Statement::new(
                        Sql::SetTimeouts,
                        &[Param::Int8(timeout_millis(timeout))],
                    ));
                    self.lock_statements(&mut out);
                    out.push(Statement::new(Sql::RestoreTimeouts, &[]));
                    out.push(Statement::new(Sql::Release, &[]));
                }
                Wait::Try if plan.len() == 1 => out.push(self.one_key(true)),
                Wait::Try => {
                    out.push(Statement::new(Sql::Savepoint, &[]));
                    if !plan.bigint().is_empty() {
                        out.push(Statement::new(
                            Sql::TryBatchBigint,
                            &[
                                Param::Int8Array(plan.bigint()),
                                Param::BoolArray(plan.bigint_shared()),
                            ],
                        ));
                    }
                    if !plan.pair_classes().is_empty() {
                        out.push(Statement::new(
                            Sql::TryBatchPair,
                            &[
                                Param::Int4Array(plan.pair_classes()),
                                Param::Int4Array(plan.pair_objects()),
                                Param::BoolArray(plan.pair_shared()),
                            ],
                        ));
                    }
                }
            },
        }
        Some(out)
    }

    /// The statement that takes the plan's one key: the lock, or its try.
    fn one_key(&self, try_only: bool) -> Statement<'_> {
        let plan = &self.plan;
        let shared = plan.modes().next() == Some(Mode::Shared);
        match (plan.bigint(), plan.pair_classes()) {
            ([k], []) => one_bigint(*k, shared, try_only),
            ([], [c]) => one_pair(*c, plan.pair_objects()[0], shared, try_only),
            _ => unreachable!("a plan of one key has one key"),
        }
    }

    /// The lock statements of the plan: `BigInt` keys first, then `Pair`
    /// keys; under a timeout, the second re-armed with what is left of it.
    fn lock_statements<'s>(&'s self, out: &mut Round<'s>) {
        let plan = &self.plan;
        let (big, pair) = (plan.bigint(), plan.pair_classes());
        match big {
            [] => {}
            [k] => out.push(one_bigint(*k, plan.bigint_shared()[0], false)),
            _ if plan.bigint_shared().contains(&true) => out.push(Statement::new(
                Sql::BatchBigint,
                &[
                    Param::Int8Array(big),
                    Param::BoolArray(plan.bigint_shared()),
                ],
            )),
            _ => out.push(Statement::new(
                Sql::BatchBigintExclusive,
                &[Param::Int8Array(big)],
            )),
        }
        if !big.is_empty() && !pair.is_empty() && matches!(self.wait, Wait::Timeout(_)) {
            out.push(Statement::new(Sql::ArmTimeouts, &[]));
        }
        let (objects, shared) = (plan.pair_objects(), plan.pair_shared());
        match pair {
            [] => {}
            [c] => out.push(one_pair(*c, objects[0], shared[0], false)),
            _ if shared.contains(&true) => out.push(Statement::new(
                Sql::BatchPair,
                &[
                    Param::Int4Array(pair),
                    Param::Int4Array(objects),
                    Param::BoolArray(shared),
                ],
            )),
            _ => out.push(Statement::new(
                Sql::BatchPairExclusive,
                &[Param::Int4Array(pair), Param::Int4Array(objects)],
            )),
        }
    }

    /// [`Acquisition::receive`] from what the driver returned: an answer
    /// per statement of the round, in order (a `Vec`, an array, or any
    /// slice of them), each read into its reply by `read` (the adapter's
    /// reading of its driver's rows; see
    /// [`read_reply`](crate::engine::read_reply)), or the first error. An
    /// adapter then keeps only its driver's answers; pairing them with the
    /// round's statements is the engine's. A round of up to two statements
    /// allocates nothing here.
    pub fn receive_answers<A, S: AsRef<[A]>>(
        &mut self,
        answers: Result<S, DriverError>,
        read: impl Fn(&Statement<'_>, &A) -> Reply,
    ) {
        let answers = match answers {
            Ok(answers) => answers,
            Err(e) => return self.receive(Err(e)),
        };
        let answers = answers.as_ref();
        let Some(round) = self.round() else {
            return;
        };
        let sent = round.kinds();
        let replies: SmallVec<[Reply; 2]> = round
            .iter()
            .zip(answers)
            .map(|(statement, answer)| read(statement, answer))
            .collect();
        self.received(sent.as_slice(), Ok(&replies));
    }

    /// Takes the outcome of the round [`Acquisition::round`] listed: a reply
    /// per statement, in order, or the first error. Decides what comes next.
    pub fn receive(&mut self, result: Result<Vec<Reply>, DriverError>) {
        let Some(round) = self.round() else {
            return;
        };
        let sent = round.kinds();
        match result {
            Ok(replies) => self.received(sent.as_slice(), Ok(&replies)),
            Err(e) => self.received(sent.as_slice(), Err(e)),
        }
    }

    /// [`Acquisition::receive`], with the kinds of the round's statements.
    fn received(&mut self, sent: &[Sql], result: Result<&[Reply], DriverError>) {
        let stage = std::mem::replace(&mut self.stage, Stage::Main);
        self.stage = match (stage, result) {
            (Stage::Main, Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                Ok(busy) => match self.wait {
                    Wait::Try if self.plan.len() > 1 => Stage::Settle(busy),
                    _ if busy.is_empty() => self.settled(Ok(Granted::Now), false),
                    _ => self.settled(Ok(Granted::Busy(busy)), false),
                },
            },
            (Stage::Main, Err(e)) => match e.into_unexpected() {
                // Not lockkit's statement: nothing is known any more.
                Ok(error) => self.cut_off(error),
                Err(e) => self.main_failed(e),
            },
            (Stage::Settle(busy), Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                Ok(_) if busy.is_empty() => self.settled(Ok(Granted::Now), false),
                Ok(_) => self.settled(Ok(Granted::Busy(busy)), false),
            },
            (Stage::Settle(_), Err(e)) => self.settled(Err(e.into_error()), true),
            (Stage::Recover(error), Ok(replies)) => match self.check(sent, replies) {
                Err(e) => self.cut_off(e),
                // The savepoint rollback released what the call took and
                // left the transaction usable.
                Ok(_) => self.settled(Err(error), false),
            },
            (Stage::Recover(error), Err(_)) => self.settled(Err(error), true),
            (finished @ Stage::Finished(_), _) => finished,
        };
    }

    /// The main round failed with the server's or the driver's error.
    fn main_failed(&mut self, e: DriverError) -> Stage {
        let timed = match self.wait {
            Wait::Timeout(t) => Some((t, self.ledger.started.elapsed())),
            _ => None,
        };
        let error = e
            .into_error_in(timed, self.plan.len())
            .with_key_types(self.plan.distinct_types(None));
        if self.uses_savepoint() {
            Stage::Recover(error)
        } else {
            // The failed statement aborted the transaction; what the batch
            // took is released with it (or at the rollback).
            self.settled(Err(error), true)
        }
    }

    fn uses_savepoint(&self) -> bool {
        match self.wait {
            Wait::Forever => false,
            Wait::Timeout(_) => true,
            Wait::Try => self.plan.len() > 1,
        }
    }

    /// Records the outcome in the transaction's bookkeeping.
    fn settled(&mut self, outcome: Result<Granted, Error>, aborted: bool) -> Stage {
        self.ledger.settle(self.plan.taken(), &outcome, aborted);
        Stage::Finished(outcome)
    }

    /// A reply that is not lockkit's: nothing is known any more.
    fn cut_off(&mut self, error: Error) -> Stage {
        Stage::Finished(self.ledger.cut_off(error))
    }

    /// The span of this call (`lockkit.lock`, at debug level, with the key
    /// type, the key count and the wait; the outcome and `wait_ms` are
    /// recorded when it finishes). An adapter runs its rounds in it, through
    /// [`Acquisition::run`] or [`Acquisition::run_blocking`].
    pub fn span(&self) -> &tracing::Span {
        &self.ledger.span
    }

    /// Runs the call: `drive` is the adapter's future that sends its rounds
    /// and finishes it, and runs inside the call's span (entered at each
    /// poll), so that what the driver reports of the statements is nested
    /// under the call.
    // Always inlined: the adapter's future is then built where the lock
    // call keeps it, not returned from here and copied there.
    #[inline(always)]
    pub fn run<F: std::future::Future>(
        self,
        drive: impl FnOnce(Self) -> F,
    ) -> tracing::instrument::Instrumented<F> {
        use tracing::Instrument as _;
        let span = self.ledger.span.clone();
        drive(self).instrument(span)
    }

    /// [`Acquisition::run`] for a blocking adapter: `drive` runs inside the
    /// call's span.
    pub fn run_blocking<T>(self, drive: impl FnOnce(Self) -> T) -> T {
        let _entered = self.ledger.span.clone().entered();
        drive(self)
    }

    /// Checks every reply of a round against what was sent; returns the busy
    /// keys of a try.
    fn check(&self, sent: &[Sql], replies: &[Reply]) -> Result<Vec<LockKey>, Error> {
        if sent.len() != replies.len() {
            return Err(Error::unexpected(format!(
                "{} replies to {} statements",
                replies.len(),
                sent.len()
            )));
        }
        let mut busy = Vec::new();
        for (sql, reply) in sent.iter().zip(replies) {
            let bad = |what: &str| {
                Err(Error::unexpected(format!(
                    "the reply to lockkit's {sql:?} statement {what}: {reply:?}"
                )))
            };
            let tag_ok = |tag: &i64| Some(*tag) == sql.tag();
            match (sql.reply(), reply) {
                (ReplyShape::Done, Reply::Done) => {}
                _ if sql.is_one_key() => {
                    if !check_one(*sql, reply)? {
                        busy.extend(self.plan.keys());
                    }
                }
                (ReplyShape::Tagged, Reply::Tagged { tag, n }) if tag_ok(tag) => {
                    let expected = self.expected_count(*sql);
                    if *n != expected {
                        return bad(&format!("counts {n}, not {expected}"));
                    }
                }
                (ReplyShape::TriedBigint, Reply::TriedBigint { tag, n, busy: b })
                    if tag_ok(tag) =>
                {
                    if *n != self.plan.bigint().len() as i64 {
                        return bad("tried another number of keys");
                    }
                    for k in b {
                        if self.plan.bigint().binary_search(k).is_err() {
                            return bad("names a key that was not requested");
                        }
                        busy.push(LockKey::BigInt(*k));
                    }
                }
                (
                    ReplyShape::TriedPair,
                    Reply::TriedPair {
                        tag,
                        n,
                        classes,
                        objects,
                    },
                ) if tag_ok(tag) => {
                    if *n != self.plan.pair_classes().len() as i64 || classes.len() != objects.len()
                    {
                        return bad("tried another number of keys");
                    }
                    for (c, o) in classes.iter().zip(objects) {
                        let key = LockKey::Pair(*c, *o);
                        if !self.plan.keys().any(|k| k == key) {
                            return bad("names a key that was not requested");
                        }
                        busy.push(key);
                    }
                }
                _ => return bad("is not its reply"),
            }
        }
        Ok(busy)
    }

    /// How many keys a lock statement must report.
    fn expected_count(&self, sql: Sql) -> i64 {
        let n = match sql {
            Sql::BatchBigint | Sql::BatchBigintExclusive => self.plan.bigint().len(),
            Sql::BatchPair | Sql::BatchPairExclusive => self.plan.pair_classes().len(),
            _ => 0,
        };
        n as i64
    }

    /// Whether the outcome is known ([`Acquisition::round`] is `None`).
    pub fn is_finished(&self) -> bool {
        matches!(self.stage, Stage::Finished(_))
    }

    /// How long the call has been running.
    pub fn elapsed(&self) -> Duration {
        self.ledger.started.elapsed()
    }

    /// The outcome, once [`Acquisition::round`] is `None`: the grant, or the
    /// busy keys of a try. The adapter hands it to [`Grant::lock`] (or
    /// [`Grant::try_lock`], [`Grant::lock_batch`], [`Grant::try_lock_batch`])
    /// for what its lock call returns.
    ///
    /// # Errors
    ///
    /// The error of the call (typed from the driver's error and the call's
    /// timeout); [`ErrorKind::UnexpectedReply`] for a reply that is not
    /// lockkit's; [`ErrorKind::Poisoned`] when called before the outcome is
    /// known (the transaction is then poisoned).
    pub fn finish(mut self) -> Result<Result<Grant, Busy>, Error> {
        let stage = std::mem::replace(&mut self.stage, Stage::Main);
        let outcome = match stage {
            Stage::Finished(outcome) => outcome,
            _ => {
                // Unfinished: `Drop` poisons the transaction.
                return Err(Error::new(ErrorKind::Poisoned));
            }
        };
        let key = match &self.request.keys {
            Keys::One([(k, m)], _) => Some((*k, self.ledger.state.locks().mode(*k).unwrap_or(*m))),
            Keys::Many(..) => None,
        };
        match outcome {
            Err(e) => Err(e),
            Ok(Granted::Busy(busy)) => {
                let key_types = self.plan.distinct_types(Some(&busy));
                Ok(Err(Busy::new(busy, key_types)))
            }
            Ok(Granted::Now) => Ok(Ok(Grant {
                key,
                keys: match std::mem::replace(
                    &mut self.request.keys,
                    Keys::Many(Vec::new(), Vec::new()),
                ) {
                    Keys::Many(v, _) => v,
                    Keys::One(..) => Vec::new(),
                },
            })),
        }
    }
}

/// A one-key call of one statement, started by [`TxState::acquire_one`]:
/// a lock that waits as long as it takes, or a try. The adapter runs it
/// with [`OneCall::run`] (or [`OneCall::run_blocking`]), giving it how to
/// send a statement on its connection and read the answer, and hands the
/// outcome to [`Grant::lock`] or [`Grant::try_lock`]. Or step by step:
/// send [`OneCall::statement`] (when there is one), hand the answer to
/// [`OneCall::receive`], then call [`OneCall::finish`].
///
/// Dropped before its answer is received (once started, its statement
/// counts as sent), it poisons the transaction: the server may have
/// granted the key. Held already, it sends nothing and poisons nothing.
#[derive(Debug)]
#[must_use = "a lock call must be driven to its outcome, or it poisons the transaction"]
pub struct OneCall<'a> {
    ledger: Ledger<'a>,
    key: LockKey,
    mode: Mode,
    /// The mode the key is held in once granted.
    held: Mode,
    try_only: bool,
    /// The outcome once known: from the start when the key is held
    /// already.
    outcome: Option<Result<Granted, Error>>,
}

impl<'a> OneCall<'a> {
    /// The statement to send, or `None` when the outcome is known (the key
    /// was held already, or the answer is received): then call
    /// [`OneCall::finish`].
    #[inline]
    pub fn statement(&self) -> Option<Statement<'static>> {
        if self.outcome.is_some() {
            return None;
        }
        let shared = self.mode == Mode::Shared;
        Some(match self.key {
            LockKey::BigInt(k) => one_bigint(k, shared, self.try_only),
            LockKey::Pair(c, o) => one_pair(c, o, shared, self.try_only),
        })
    }

    /// Runs the call on an async driver: `send` sends
    /// [`OneCall::statement`] (when there is one: the key may be held
    /// already) and returns the driver's answer, inside the call's span
    /// (entered at each poll, so that what the driver reports of the
    /// statement is nested under the call); `read` reads the answer into
    /// its reply. The outcome goes to [`Grant::lock`] or
    /// [`Grant::try_lock`].
    ///
    /// Dropped while `send` is in flight, the call poisons the transaction;
    /// the adapter's `send` cancels its statement when dropped.
    ///
    /// # Errors
    ///
    /// As [`Acquisition::finish`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe by itself: dropped after `send` started, the
    /// transaction is poisoned (the server may grant the key), and what
    /// reaches the server is `send`'s to settle (a cancel request).
    // Always inlined: `send`'s future (about 1.4 KB on tokio-postgres) is
    // then built where the adapter's lock call keeps it, not moved there.
    #[inline(always)]
    pub async fn run<A, F, S, R>(mut self, send: S, read: R) -> Result<Result<Grant, Busy>, Error>
    where
        S: FnOnce(Statement<'static>) -> F,
        F: std::future::Future<Output = Result<A, DriverError>>,
        R: FnOnce(&Statement<'_>, &A) -> Reply,
    {
        if let Some(statement) = self.statement() {
            use tracing::Instrument as _;
            // No span wanted (no debug subscriber): awaited where it is
            // built; the span's wrapper would move it there first.
            let answer = match self.ledger.span.is_none() {
                true => send(statement).await,
                false => send(statement).instrument(self.ledger.span.clone()).await,
            };
            self.answered(statement, answer, read);
        }
        self.finish()
    }

    /// [`OneCall::run`] on a blocking driver: `send` runs inside the call's
    /// span.
    ///
    /// # Errors
    ///
    /// As [`Acquisition::finish`].
    pub fn run_blocking<A>(
        mut self,
        send: impl FnOnce(Statement<'static>) -> Result<A, DriverError>,
        read: impl FnOnce(&Statement<'_>, &A) -> Reply,
    ) -> Result<Result<Grant, Busy>, Error> {
        if let Some(statement) = self.statement() {
            let answer = self.ledger.span.in_scope(|| send(statement));
            self.answered(statement, answer, read);
        }
        self.finish()
    }

    /// Takes the answer to [`OneCall::statement`], read into its reply by
    /// `read` (as for [`Acquisition::receive_answers`]), or the driver's
    /// error, checks it and records the outcome. Without a statement to
    /// answer, it does nothing.
    pub fn receive<A>(
        &mut self,
        answer: Result<A, DriverError>,
        read: impl FnOnce(&Statement<'_>, &A) -> Reply,
    ) {
        if let Some(statement) = self.statement() {
            self.answered(statement, answer, read);
        }
    }

    /// [`OneCall::receive`] of the answer to `statement`, the call's
    /// statement.
    fn answered<A>(
        &mut self,
        statement: Statement<'static>,
        answer: Result<A, DriverError>,
        read: impl FnOnce(&Statement<'_>, &A) -> Reply,
    ) {
        let key_type = self.ledger.key_type.name();
        let taken = std::iter::once((self.key, self.mode, key_type));
        let outcome = match answer {
            Ok(answer) => match check_one(statement.sql(), &read(&statement, &answer)) {
                Ok(granted) => {
                    let outcome = Ok(match granted {
                        true => Granted::Now,
                        false => Granted::Busy(vec![self.key]),
                    });
                    self.ledger.settle(taken, &outcome, false);
                    outcome
                }
                Err(e) => self.ledger.cut_off(e),
            },
            Err(e) => match e.into_unexpected() {
                // Not lockkit's statement: nothing is known any more.
                Ok(error) => self.ledger.cut_off(error),
                // The failed statement aborted the transaction.
                Err(e) => {
                    let outcome = Err(e.into_error_in(None, 1).with_key_types(vec![key_type]));
                    self.ledger.settle(taken, &outcome, true);
                    outcome
                }
            },
        };
        self.outcome = Some(outcome);
    }

    /// The outcome, once [`OneCall::statement`] is `None`: the grant, or
    /// the busy key of a try. The adapter hands it to [`Grant::lock`] or
    /// [`Grant::try_lock`].
    ///
    /// # Errors
    ///
    /// As [`Acquisition::finish`].
    pub fn finish(mut self) -> Result<Result<Grant, Busy>, Error> {
        match self.outcome.take() {
            // Unanswered: the ledger's drop poisons the transaction.
            None => Err(Error::new(ErrorKind::Poisoned)),
            Some(Err(e)) => Err(e),
            Some(Ok(Granted::Busy(busy))) => {
                Ok(Err(Busy::new(busy, vec![self.ledger.key_type.name()])))
            }
            Some(Ok(Granted::Now)) => Ok(Ok(Grant {
                key: Some((self.key, self.held)),
                keys: Vec::new(),
            })),
        }
    }
}

/// Checks the reply to a one-key statement (a lock, or its try): `true`
/// when the key is granted, `false` when the try found it busy.
#[inline]
fn check_one(sql: Sql, reply: &Reply) -> Result<bool, Error> {
    let tag_ok = |tag: &i64| Some(*tag) == sql.tag();
    let what = match (sql.reply(), reply) {
        // A one-key lock's row exists only once its key is locked.
        (ReplyShape::Locked, Reply::Locked { tag }) if tag_ok(tag) => return Ok(true),
        // A try counts the keys it took: its one key, or none.
        (ReplyShape::Tagged, Reply::Tagged { tag, n }) if tag_ok(tag) => match n {
            1 => return Ok(true),
            0 => return Ok(false),
            n => format!("counts {n}, not 0 or 1"),
        },
        _ => "is not its reply".to_owned(),
    };
    Err(Error::unexpected(format!(
        "the reply to lockkit's {sql:?} statement {what}: {reply:?}"
    )))
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

/// The statement that takes one `BigInt` key: the lock, or its try.
fn one_bigint(key: i64, shared: bool, try_only: bool) -> Statement<'static> {
    let sql = match (try_only, shared) {
        (false, false) => Sql::LockBigint,
        (false, true) => Sql::LockBigintShared,
        (true, false) => Sql::TryBigint,
        (true, true) => Sql::TryBigintShared,
    };
    Statement::new(sql, &[Param::Int8(key)])
}

/// The statement that takes one `Pair` key: the lock, or its try.
fn one_pair(class: i32, object: i32, shared: bool, try_only: bool) -> Statement<'static> {
    let sql = match (try_only, shared) {
        (false, false) => Sql::LockPair,
        (false, true) => Sql::LockPairShared,
        (true, false) => Sql::TryPair,
        (true, true) => Sql::TryPairShared,
    };
    Statement::new(sql, &[Param::Int4(class), Param::Int4(object)])
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

/// The proof that a lock call was granted, from which an adapter makes the
/// guard it hands out. Only the engine makes one, from checked replies.
#[derive(Debug)]
pub struct Grant {
    key: Option<(LockKey, Mode)>,
    keys: Vec<(LockKey, Mode)>,
}

impl Grant {
    /// The guard of a one-key call for `value`, the value the request was
    /// made of ([`Request::one`]). The guard names the key granted: the one
    /// the request computed from `value` and sent, not computed again (a
    /// hand-written [`AdvisoryKey`] may answer another key at each call).
    /// The lifetime `'t` is the adapter's to tie to its transaction.
    ///
    /// # Errors
    ///
    /// Gives `value` back when the grant is not of a one-key call.
    pub fn held<'t, K: AdvisoryKey>(self, value: K) -> Result<Held<'t, K>, K> {
        match self.key {
            Some((key, mode)) => Ok(Held::new(value, key, mode)),
            None => Err(value),
        }
    }

    /// The guard of a batch call. The lifetime `'t` is the adapter's to tie
    /// to its transaction.
    pub fn batch<'t>(self) -> HeldBatch<'t> {
        let keys = match self.key {
            Some(one) if self.keys.is_empty() => vec![one],
            _ => self.keys,
        };
        HeldBatch::new(keys)
    }

    /// What a one-key lock call that waits ([`Request::one`] with
    /// [`Wait::Forever`] or [`Wait::Timeout`]) answers its caller, from the
    /// call's outcome ([`Acquisition::finish`]): its guard for `value`. The
    /// adapters' one mapping from that outcome to what they return.
    ///
    /// # Errors
    ///
    /// The call's error.
    pub fn lock<'t, K: AdvisoryKey>(
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
    pub fn try_lock<'t, K: AdvisoryKey>(
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
    pub fn lock_batch<'t>(
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
    pub fn try_lock_batch<'t>(
        outcome: Result<Result<Grant, Busy>, Error>,
    ) -> Result<Result<HeldBatch<'t>, Busy>, Error> {
        Ok(outcome?.map(Grant::batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::config::OrderCheck;
    use crate::engine::error::ErrorKind;
    use crate::engine::expected_rows;

    #[derive(Debug)]
    struct K(i64);
    impl AdvisoryKey for K {
        const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("K").raw();
        fn lock_key(&self) -> LockKey {
            LockKey::BigInt(self.0)
        }
    }
    struct P(i32);
    impl AdvisoryKey for P {
        const KEY_SPEC: crate::KeySpec<'static> = crate::KeySpec::new("P").raw();
        fn lock_key(&self) -> LockKey {
            LockKey::Pair(1, self.0)
        }
    }

    fn policy() -> Policy {
        Policy::new(
            Config::default().order_check(OrderCheck::Off),
            ServerFacts::assumed(64, 100, 0),
        )
    }

    /// What a server answers when every key is free.
    fn granted(round: &[Statement<'_>]) -> Vec<Reply> {
        round
            .iter()
            .map(|s| match s.reply() {
                ReplyShape::Done => Reply::Done,
                ReplyShape::Locked => Reply::Locked {
                    tag: s.sql().tag().unwrap(),
                },
                ReplyShape::Tagged => Reply::Tagged {
                    tag: s.sql().tag().unwrap(),
                    n: expected_rows(s),
                },
                ReplyShape::TriedBigint => Reply::TriedBigint {
                    tag: s.sql().tag().unwrap(),
                    n: expected_rows(s),
                    busy: vec![],
                },
                ReplyShape::TriedPair => Reply::TriedPair {
                    tag: s.sql().tag().unwrap(),
                    n: expected_rows(s),
                    classes: vec![],
                    objects: vec![],
                },
            })
            .collect()
    }

    fn sqls(call: &Acquisition<'_>) -> Vec<Sql> {
        call.round().unwrap().iter().map(Statement::sql).collect()
    }

    /// What a call left: its outcome, what its transaction holds, whether
    /// it is poisoned, and what the next call meets.
    fn left(state: &TxState, outcome: Result<Result<Grant, Busy>, Error>) -> String {
        let outcome = match outcome {
            Ok(Ok(grant)) => format!("granted {:?} {:?}", grant.key, grant.keys),
            Ok(Err(busy)) => format!("busy {:?}", busy.keys()),
            Err(e) => format!("{:?}: {e}", e.kind()),
        };
        let (held, poisoned) = (state.held(), state.is_poisoned());
        // Dropped unanswered, this call poisons the transaction: it comes
        // last.
        let next = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(9), Mode::Exclusive),
                Wait::Forever,
            )
            .map(|call| call.round().map(|r| r.len()))
            .map_err(|e| e.kind());
        format!("{outcome}; held {held:?}; poisoned {poisoned}; next {next:?}")
    }

    /// The answers a one-key statement may meet: granted, a try's busy,
    /// a wrong tag, a malformed row, the server's error, a foreign
    /// statement's row.
    fn answers(statement: &Statement<'_>) -> Vec<Result<Reply, DriverError>> {
        let tag = statement.sql().tag().unwrap();
        let shaped = |n| match statement.reply() {
            ReplyShape::Locked => Reply::Locked { tag },
            _ => Reply::Tagged { tag, n },
        };
        vec![
            Ok(shaped(1)),
            Ok(Reply::Tagged { tag, n: 0 }),
            Ok(Reply::Tagged { tag, n: 2 }),
            Ok(Reply::Locked { tag: tag + 1 }),
            Ok(Reply::Malformed("2 rows".into())),
            Err(DriverError::new("x")
                .code(Some("40P01"))
                .message(Some("deadlock detected"))),
            Err(DriverError::new("DataRow field count").foreign_reply(true)),
        ]
    }

    /// Runs `key` in `mode` through both kinds of call, from each starting
    /// state (nothing held, the key held shared, held exclusive), for each
    /// answer, and compares what they leave; returns how many were compared.
    fn compare<K: AdvisoryKey>(key: &K, mode: Mode, try_only: bool) -> usize {
        let policy = policy();
        let wait = if try_only { Wait::Try } else { Wait::Forever };
        let site = Location::caller();
        let mut compared = 0;
        for before in [None, Some(Mode::Shared), Some(Mode::Exclusive)] {
            // A transaction that holds `key` in `before`.
            let state = || {
                let state = TxState::new();
                if let Some(before) = before {
                    let mut call = state
                        .acquire(&policy, 0, Request::one(key, before), Wait::Forever)
                        .unwrap();
                    let round = call.round().unwrap();
                    let replies = granted(&round);
                    call.receive(Ok(replies));
                    call.finish().unwrap().unwrap();
                }
                state
            };
            let (one_state, general_state) = (state(), state());
            let one = one_state
                .acquire_one(&policy, 0, (key, mode), try_only, Some(site))
                .unwrap();
            let general = general_state
                .acquire(&policy, 0, Request::one(key, mode).at(site), wait)
                .unwrap();
            let statement = one.statement();
            let sent = general.round().map(|r| {
                assert_eq!(r.len(), 1, "{r:?}");
                (r[0].sql(), r[0].params().to_vec())
            });
            assert_eq!(
                statement.map(|s| (s.sql(), s.params().to_vec())),
                sent,
                "{mode:?} {wait:?} held {before:?}"
            );
            let Some(statement) = statement else {
                // Held already: granted, nothing sent, nothing in flight.
                assert_eq!(
                    left(&one_state, one.finish()),
                    left(&general_state, general.finish())
                );
                compared += 1;
                continue;
            };
            for i in 0..answers(&statement).len() {
                let answer = || answers(&statement).into_iter().nth(i).unwrap();
                let (one_state, general_state) = (state(), state());
                let mut one = one_state
                    .acquire_one(&policy, 0, (key, mode), try_only, Some(site))
                    .unwrap();
                let mut general = general_state
                    .acquire(&policy, 0, Request::one(key, mode).at(site), wait)
                    .unwrap();
                one.receive(answer(), |_, reply| reply.clone());
                general.receive(answer().map(|reply| vec![reply]));
                assert!(one.statement().is_none());
                assert!(general.round().is_none());
                let (one, general) = (
                    left(&one_state, one.finish()),
                    left(&general_state, general.finish()),
                );
                assert_eq!(one, general, "{mode:?} {wait:?} held {before:?}");
                compared += 1;
            }
        }
        // Dropped unanswered, both poison the transaction.
        let (one_state, general_state) = (TxState::new(), TxState::new());
        let one = one_state
            .acquire_one(&policy, 0, (key, mode), try_only, None)
            .unwrap();
        let general = general_state
            .acquire(&policy, 0, Request::one(key, mode), wait)
            .unwrap();
        drop((one, general));
        assert!(one_state.is_poisoned() && general_state.is_poisoned());
        compared
    }

    /// A one-key call ([`TxState::acquire_one`]) is the general call of the
    /// same key ([`TxState::acquire`] of [`Request::one`]) in less work:
    /// the same statement, and for every answer the same outcome,
    /// bookkeeping and poisoning; held already, the same grant and no
    /// statement; dropped unanswered, the same poisoning.
    #[test]
    fn a_one_key_call_is_the_general_call_of_its_key() {
        let mut compared = 0;
        for try_only in [false, true] {
            for mode in [Mode::Exclusive, Mode::Shared] {
                compared += compare(&K(1), mode, try_only);
                compared += compare(&P(2), mode, try_only);
            }
        }
        // Each: 7 answers when nothing is held, 7 more (a shared hold
        // upgraded) or a relock for the shared hold, a relock for the
        // exclusive hold.
        assert_eq!(compared, 2 * 2 * (7 + 7 + 1) + 2 * 2 * (7 + 1 + 1));
    }

    #[test]
    fn a_timed_mixed_batch_re_arms_the_timeout_between_key_spaces() {
        let state = TxState::new();
        let batch = Batch::new().with(&K(1)).with(&P(2));
        let call = state
            .acquire(
                &policy(),
                0,
                Request::batch(&batch),
                Wait::Timeout(Duration::from_secs(1)),
            )
            .unwrap();
        assert_eq!(
            sqls(&call),
            [
                Sql::Savepoint,
                Sql::SetTimeouts,
                Sql::LockBigint,
                Sql::ArmTimeouts,
                Sql::LockPair,
                Sql::RestoreTimeouts,
                Sql::Release
            ]
        );
        let round = call.round().unwrap();
        assert_eq!(round[1].params(), [Param::Int8(1000)]);
    }

    #[test]
    fn a_foreign_reply_is_an_error_and_poisons() {
        let state = TxState::new();
        let mut call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(7), Mode::Exclusive),
                Wait::Forever,
            )
            .unwrap();
        // A foreign `SELECT $1` under lockkit's statement name.
        call.receive(Ok(vec![Reply::Locked { tag: 7 }]));
        let err = call.finish().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{err}");
        assert!(state.is_poisoned());
        assert!(!state.holds(LockKey::BigInt(7), Mode::Exclusive));
        // The control: lockkit's own reply is a grant.
        let state = TxState::new();
        let mut call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(7), Mode::Exclusive),
                Wait::Forever,
            )
            .unwrap();
        let replies = granted(&call.round().unwrap());
        call.receive(Ok(replies));
        assert!(call.finish().unwrap().is_ok());
        assert!(state.holds(LockKey::BigInt(7), Mode::Exclusive));
    }

    /// A statement of lockkit's name that the server will not bind as
    /// lockkit's (08P01: other columns; 26000: none of that name; Diesel's
    /// message without a code) is not lockkit's reply either; a deadlock is
    /// still a deadlock (the control).
    #[test]
    fn a_refused_bind_of_a_foreign_statement_is_an_unexpected_reply() {
        let cases: [(Option<&str>, Option<&str>, ErrorKind); 8] = [
            (Some("08P01"), None, ErrorKind::UnexpectedReply),
            // lockkit's binary `int8` bound to another client's statement
            // of that name, which takes another type.
            (Some("22P03"), None, ErrorKind::UnexpectedReply),
            (
                None,
                Some("incorrect binary data format in bind parameter 1"),
                ErrorKind::UnexpectedReply,
            ),
            (Some("26000"), None, ErrorKind::UnexpectedReply),
            (Some("42P05"), None, ErrorKind::UnexpectedReply),
            (
                None,
                Some("prepared statement \"__diesel_stmt_1\" already exists"),
                ErrorKind::UnexpectedReply,
            ),
            (
                None,
                Some("bind message has 3 result formats but query has 2 columns"),
                ErrorKind::UnexpectedReply,
            ),
            (Some("40P01"), None, ErrorKind::Deadlock),
        ];
        for (code, message, kind) in cases {
            for wait in [Wait::Forever, Wait::Timeout(Duration::from_secs(1))] {
                let state = TxState::new();
                let mut call = state
                    .acquire(&policy(), 0, Request::one(&K(7), Mode::Exclusive), wait)
                    .unwrap();
                call.receive(Err(DriverError::new("x").code(code).message(message)));
                while let Some(round) = call.round() {
                    let replies = round.iter().map(|_| Reply::Done).collect();
                    call.receive(Ok(replies));
                }
                let err = call.finish().unwrap_err();
                assert_eq!(err.kind(), kind, "{err} ({wait:?})");
                if kind == ErrorKind::UnexpectedReply {
                    assert!(!state.holds(LockKey::BigInt(7), Mode::Exclusive));
                    assert!(state.is_poisoned(), "{wait:?}");
                    let named = match message {
                        Some(m) if m.ends_with("already exists") => "42P05",
                        Some(m) if m.starts_with("incorrect binary data") => "22P03",
                        _ => "08P01",
                    };
                    assert_eq!(err.code(), code.or(Some(named)));
                }
            }
        }
    }

    #[test]
    fn wrong_counts_shapes_and_tags_are_refused() {
        let tag = |sql: Sql| sql.tag().unwrap();
        let bad: [Reply; 6] = [
            Reply::Tagged {
                tag: tag(Sql::BatchBigintExclusive),
                n: 1,
            },
            Reply::Tagged {
                tag: tag(Sql::BatchBigint),
                n: 2,
            },
            Reply::Locked {
                tag: tag(Sql::BatchBigintExclusive),
            },
            Reply::Locked {
                tag: tag(Sql::LockBigint),
            },
            Reply::Done,
            Reply::Malformed("2 rows".into()),
        ];
        for reply in bad {
            let state = TxState::new();
            let batch = Batch::new().with(&K(1)).with(&K(2));
            let mut call = state
                .acquire(&policy(), 0, Request::batch(&batch), Wait::Forever)
                .unwrap();
            call.receive(Ok(vec![reply.clone()]));
            let err = call.finish().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::UnexpectedReply, "{reply:?}");
            assert!(state.is_poisoned());
        }
    }

    #[test]
    fn a_relock_sends_nothing_and_leaves_nothing_in_flight() {
        let state = TxState::new();
        for _ in 0..2 {
            let mut call = state
                .acquire(
                    &policy(),
                    0,
                    Request::one(&K(1), Mode::Exclusive),
                    Wait::Forever,
                )
                .unwrap();
            if let Some(round) = call.round() {
                let replies = granted(&round);
                call.receive(Ok(replies));
            }
            assert!(call.finish().unwrap().is_ok());
        }
        let call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(1), Mode::Shared),
                Wait::Forever,
            )
            .unwrap();
        assert!(call.round().is_none(), "held in a covering mode");
        drop(call);
        assert!(!state.is_poisoned());
        assert!(state
            .acquire(
                &policy(),
                0,
                Request::one(&K(2), Mode::Exclusive),
                Wait::Forever
            )
            .is_ok());
    }

    #[test]
    fn a_dropped_call_poisons_and_an_error_aborts() {
        let state = TxState::new();
        let call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(1), Mode::Exclusive),
                Wait::Forever,
            )
            .unwrap();
        assert!(call.round().is_some());
        drop(call);
        assert!(state.is_poisoned());

        let state = TxState::new();
        let mut call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(1), Mode::Exclusive),
                Wait::Forever,
            )
            .unwrap();
        call.receive(Err(DriverError::new("x")
            .code(Some("40P01"))
            .message(Some("deadlock detected"))));
        assert!(call.finish().unwrap_err().is_deadlock());
        let again = state.acquire(
            &policy(),
            0,
            Request::one(&K(2), Mode::Exclusive),
            Wait::Forever,
        );
        assert_eq!(again.unwrap_err().kind(), ErrorKind::TransactionAborted);
    }

    #[test]
    fn a_timed_out_call_rolls_its_savepoint_back_and_stays_usable() {
        let state = TxState::new();
        let mut call = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(1), Mode::Exclusive),
                Wait::Timeout(Duration::from_millis(50)),
            )
            .unwrap();
        call.receive(Err(DriverError::new("x")
            .code(Some("55P03"))
            .message(Some("canceling statement due to lock timeout"))));
        assert_eq!(sqls(&call), [Sql::Rollback]);
        call.receive(Ok(vec![Reply::Done]));
        let err = call.finish().unwrap_err();
        assert!(err.is_timeout());
        assert_eq!(err.timeout(), Some(Duration::from_millis(50)));
        assert!(!state.is_poisoned());
        assert!(state
            .acquire(
                &policy(),
                0,
                Request::one(&K(2), Mode::Exclusive),
                Wait::Forever
            )
            .is_ok());
    }

    #[test]
    fn a_try_batch_settles_its_savepoint() {
        let state = TxState::new();
        let batch = Batch::new().with(&K(1)).with(&K(2)).with(&P(3));
        let mut call = state
            .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
            .unwrap();
        assert_eq!(
            sqls(&call),
            [Sql::Savepoint, Sql::TryBatchBigint, Sql::TryBatchPair]
        );
        let mut replies = granted(&call.round().unwrap());
        replies[1] = Reply::TriedBigint {
            tag: Sql::TryBatchBigint.tag().unwrap(),
            n: 2,
            busy: vec![2],
        };
        call.receive(Ok(replies));
        assert_eq!(sqls(&call), [Sql::Rollback]);
        call.receive(Ok(vec![Reply::Done]));
        let busy = call.finish().unwrap().unwrap_err();
        assert_eq!(busy.keys(), [LockKey::BigInt(2)]);
        assert_eq!(state.held_count(), 0);

        // A busy key that was never requested is not lockkit's reply.
        let mut call = state
            .acquire(&policy(), 0, Request::batch(&batch), Wait::Try)
            .unwrap();
        let mut replies = granted(&call.round().unwrap());
        replies[1] = Reply::TriedBigint {
            tag: Sql::TryBatchBigint.tag().unwrap(),
            n: 2,
            busy: vec![99],
        };
        call.receive(Ok(replies));
        assert_eq!(
            call.finish().unwrap_err().kind(),
            ErrorKind::UnexpectedReply
        );
    }

    /// Runs `request` against a server on which the keys of `busy` are
    /// taken by another session, and returns the outcome.
    fn outcome(
        state: &TxState,
        request: Request,
        wait: Wait,
        busy: &[i64],
    ) -> Result<Result<Grant, Busy>, Error> {
        let mut call = state.acquire(&policy(), 0, request, wait).unwrap();
        while let Some(round) = call.round() {
            let replies = granted(&round)
                .into_iter()
                .zip(round.iter())
                .map(|(reply, s)| match (reply, s.params()) {
                    (Reply::Tagged { tag, .. }, [Param::Int8(k)]) if busy.contains(k) => {
                        Reply::Tagged { tag, n: 0 }
                    }
                    (Reply::TriedBigint { tag, n, .. }, [Param::Int8Array(keys), ..]) => {
                        Reply::TriedBigint {
                            tag,
                            n,
                            busy: keys.iter().copied().filter(|k| busy.contains(k)).collect(),
                        }
                    }
                    (reply, _) => reply,
                })
                .collect();
            call.receive(Ok(replies));
        }
        call.finish()
    }

    /// The one mapping from an outcome to what every adapter's lock call
    /// returns: the guard names the key and mode the server granted (an
    /// upgrade names exclusive; a relock, the mode held), a busy try gives
    /// the value or the busy keys back, and an error is the call's.
    #[test]
    fn the_guards_come_from_the_outcome() {
        let state = TxState::new();
        let lock = |id: i64, mode: Mode| {
            let outcome = outcome(&state, Request::one(&K(id), mode), Wait::Forever, &[]);
            Grant::lock(outcome, K(id)).unwrap()
        };
        let try_lock = |id: i64, busy: &[i64]| {
            let request = Request::one(&K(id), Mode::Exclusive);
            Grant::try_lock(outcome(&state, request, Wait::Try, busy), K(id)).unwrap()
        };
        let held = lock(5, Mode::Shared);
        assert_eq!(
            (held.key(), held.mode()),
            (LockKey::BigInt(5), Mode::Shared)
        );
        assert_eq!(lock(5, Mode::Exclusive).mode(), Mode::Exclusive);
        // Held already in a covering mode: nothing sent, the held mode named.
        assert_eq!(lock(5, Mode::Shared).mode(), Mode::Exclusive);

        assert_eq!(try_lock(6, &[6]).map(|h| h.key()).unwrap_err().0, 6);
        assert_eq!(
            try_lock(7, &[]).map(|h| h.key()).ok(),
            Some(LockKey::BigInt(7))
        );

        let batch = Batch::new().with(&K(10)).with(&K(11));
        let busy = Grant::try_lock_batch(outcome(&state, Request::batch(&batch), Wait::Try, &[11]))
            .unwrap()
            .unwrap_err();
        assert_eq!(busy.keys(), [LockKey::BigInt(11)]);
        let held =
            Grant::lock_batch(outcome(&state, Request::batch(&batch), Wait::Forever, &[])).unwrap();
        let keys: Vec<_> = held.keys().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, [LockKey::BigInt(10), LockKey::BigInt(11)]);

        let state = TxState::new();
        state.poison();
        let poisoned = state
            .acquire(
                &policy(),
                0,
                Request::one(&K(1), Mode::Exclusive),
                Wait::Forever,
            )
            .map(Acquisition::finish);
        assert_eq!(
            Grant::lock(poisoned.and_then(|o| o), K(1))
                .unwrap_err()
                .kind(),
            ErrorKind::Poisoned
        );
    }
}
