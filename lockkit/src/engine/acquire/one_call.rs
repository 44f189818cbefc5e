//! The one-key call ([`OneCall`]): one key that waits as long as it takes
//! or not at all, one statement and one reply, with the general call's
//! checks and bookkeeping; and the one-key statements both calls send.

use std::num::NonZeroU8;
use std::panic::Location;
use std::sync::atomic::{AtomicU32, Ordering};

use super::grant::Grant;
use super::ledger::{Granted, Ledger};
use super::request::Keys;
#[cfg(doc)]
use super::Acquisition;
use super::{Policy, Request, TxState, Wait};
use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::guard::Busy;
use crate::engine::observe::key_type;
use crate::engine::plan::Mode;
use crate::engine::statement::{minted, Param, Reply, ReplyShape, Sql, Statement};
use crate::fencing::FencingToken;
use crate::key::{semaphore_base, AdvisoryKey, KeyForm, LockKey, SEMAPHORE_CLASS};

impl TxState {
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
    pub(crate) fn acquire_one<'a, K: AdvisoryKey + ?Sized>(
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
        self.start_one(policy, depth, request, try_only, None)
    }

    /// Starts the first step of a lock that waits in slices
    /// ([`Policy::bounds_waits`]) on a connection the call has to itself:
    /// a try of `value`'s key in `mode`, in the one statement of the
    /// unbounded lock, checked as the lock is (the order check included).
    /// Granted, it is the lock's grant; busy, the caller waits in slices,
    /// and the try is no busy outcome of its own (not in the metrics).
    ///
    /// # Errors
    ///
    /// As [`TxState::acquire_one`]'s lock; nothing is to be sent.
    pub(crate) fn acquire_one_first<'a, K: AdvisoryKey + ?Sized>(
        &'a self,
        policy: &Policy,
        depth: u32,
        (value, mode): (&K, Mode),
        site: Option<&'static Location<'static>>,
    ) -> Result<OneCall<'a>, Error> {
        let request = Request {
            site,
            ..Request::one(value, mode)
        };
        let mut call = self.start_one_as(policy, depth, request, true, true, None)?;
        call.ledger.quiet_busy();
        Ok(call)
    }

    /// Starts a try for a permit of the semaphore of `permits` permits named
    /// by `value`'s key (KEYS.md, "Semaphore slots"): one statement that
    /// tries its slots, from one chosen at random, and takes the first free
    /// one. Run and granted as [`TxState::acquire_one`]'s call; the guard
    /// names the slot's key. A transaction holds at most one permit of a
    /// semaphore: holding one already, the call sends nothing and is
    /// granted that one.
    ///
    /// # Errors
    ///
    /// As [`TxState::acquire_one`]'s try; nothing is to be sent.
    pub(crate) fn acquire_permit<'a, K: AdvisoryKey + ?Sized>(
        &'a self,
        policy: &Policy,
        depth: u32,
        (value, permits): (&K, NonZeroU8),
        site: Option<&'static Location<'static>>,
    ) -> Result<OneCall<'a>, Error> {
        let base = semaphore_base(value.lock_key());
        let slot = |s: u8| LockKey::Pair(SEMAPHORE_CLASS, base | i32::from(s));
        let offset = next_offset(permits);
        let held = {
            let locks = self.locks();
            (0..permits.get()).find(|&s| {
                locks
                    .mode(slot(s))
                    .is_some_and(|m| m.covers(Mode::Exclusive))
            })
        };
        let request = Request {
            keys: Keys::One(
                [(slot(held.unwrap_or(offset)), Mode::Exclusive)],
                [K::KEY_SPEC.namespace()],
            ),
            hashtext: K::KEY_SPEC.form() == KeyForm::HashText,
            key_type: key_type!(K::KEY_SPEC.namespace()),
            site,
        };
        let permit = PermitTry {
            base,
            permits: permits.get(),
            offset,
        };
        self.start_one(policy, depth, request, true, Some(permit))
    }

    /// The checks of a one-key call of `request` (a permit's try when
    /// `permit` says so), then the call, with its ledger started: granted
    /// at once when the key is held already in a mode that covers the one
    /// asked.
    #[inline]
    fn start_one(
        &self,
        policy: &Policy,
        depth: u32,
        request: Request,
        try_only: bool,
        permit: Option<PermitTry>,
    ) -> Result<OneCall<'_>, Error> {
        self.start_one_as(policy, depth, request, try_only, !try_only, permit)
    }

    /// [`TxState::start_one`], checked as a call that `waits` (the order
    /// check) or not.
    fn start_one_as(
        &self,
        policy: &Policy,
        depth: u32,
        request: Request,
        try_only: bool,
        waits: bool,
        permit: Option<PermitTry>,
    ) -> Result<OneCall<'_>, Error> {
        let (locks, plan) = self.open(policy, &request, waits)?;
        let (key, mode) = request.keys()[0];
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
            (depth, request.site),
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
            permit,
            mint: policy.config().mints_tokens(),
            token: None,
        })
    }
}

impl Request {
    /// One slot of the semaphore of `permits` permits named by `value`'s
    /// key, chosen at random, exclusive: what a permit call that found
    /// every slot busy waits for ([`TxState::acquire_permit`]).
    pub(crate) fn permit_slot<K: AdvisoryKey + ?Sized>(value: &K, permits: NonZeroU8) -> Self {
        let base = semaphore_base(value.lock_key());
        let slot = LockKey::Pair(SEMAPHORE_CLASS, base | i32::from(next_offset(permits)));
        Request::key_of::<K>(slot, Mode::Exclusive)
    }
}

/// The slot a permit call tries first, or waits for: spread over the slots
/// by a counter, and by the process, so that takers do not all start at
/// slot 0.
fn next_offset(permits: NonZeroU8) -> u8 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_add(std::process::id())
        .wrapping_mul(0x9E37_79B9);
    // The high bits of a multiplicative hash are its best mixed.
    ((u64::from(n >> 16) * u64::from(permits.get())) >> 16) as u8
}

/// A permit try's semaphore: its slot-0 object, its permits, and the slot
/// tried first.
#[derive(Clone, Copy, Debug)]
struct PermitTry {
    base: i32,
    permits: u8,
    offset: u8,
}

impl PermitTry {
    /// Checks the reply to [`sql::TRY_PERMIT`](crate::engine::sql::TRY_PERMIT):
    /// the slot granted, or `None` when every slot is busy.
    fn check(self, sql: Sql, reply: &Reply) -> Result<Option<u8>, Error> {
        let what = match reply {
            Reply::Tagged { tag, n } if Some(*tag) == sql.tag() => match u8::try_from(*n) {
                Ok(0) => return Ok(None),
                Ok(n) if n <= self.permits => return Ok(Some(n - 1)),
                _ => format!("names slot {n} of {}", self.permits),
            },
            _ => "is not its reply".to_owned(),
        };
        Err(Error::unexpected(format!(
            "the reply to lockkit's {sql:?} statement {what}: {reply:?}"
        )))
    }
}

/// A one-key call of one statement, started by [`TxState::acquire_one`]:
/// a lock that waits as long as it takes, or a try. The adapter runs it
/// with [`OneCall::run`], giving it how to
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
pub(crate) struct OneCall<'a> {
    ledger: Ledger<'a>,
    key: LockKey,
    mode: Mode,
    /// The mode the key is held in once granted.
    held: Mode,
    try_only: bool,
    /// The outcome once known: from the start when the key is held
    /// already.
    outcome: Option<Result<Granted, Error>>,
    /// A permit try: its statement tries the semaphore's slots, and the
    /// key is the slot granted.
    permit: Option<PermitTry>,
    /// Whether the statement mints a fencing token after its lock.
    mint: bool,
    /// The token minted with the grant.
    token: Option<FencingToken>,
}

impl<'a> OneCall<'a> {
    /// The statement to send, or `None` when the outcome is known (the key
    /// was held already, or the answer is received): then call
    /// [`OneCall::finish`].
    #[inline]
    pub(crate) fn statement(&self) -> Option<Statement<'static>> {
        if self.outcome.is_some() {
            return None;
        }
        if let Some(PermitTry {
            base,
            permits,
            offset,
        }) = self.permit
        {
            let params = [base, permits.into(), offset.into()].map(Param::Int4);
            return Some(Statement::new(Sql::TryPermit, &params).minting(self.mint));
        }
        let shared = self.mode == Mode::Shared;
        let statement = match self.key {
            LockKey::BigInt(k) => one_bigint(k, shared, self.try_only),
            LockKey::Pair(c, o) => one_pair(c, o, shared, self.try_only),
        };
        Some(statement.minting(self.mint))
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
    pub(crate) async fn run<A, F, S, R>(
        mut self,
        send: S,
        read: R,
    ) -> Result<Result<Grant, Busy>, Error>
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

    /// Takes the answer to [`OneCall::statement`], read into its reply by
    /// `read` (as for [`Acquisition::receive_answers`]), or the driver's
    /// error, checks it and records the outcome. Without a statement to
    /// answer, it does nothing. For the engine's tests; a driver's call
    /// runs through [`OneCall::run`].
    #[cfg(test)]
    pub(crate) fn receive<A>(
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
        let outcome = match answer {
            Ok(answer) => match self.check(statement, &read(&statement, &answer)) {
                Ok(granted) => {
                    let taken = std::iter::once((self.key, self.mode, key_type));
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
                    let taken = std::iter::once((self.key, self.mode, key_type));
                    let error = e.into_error_in(None, 1).with_key_types(vec![key_type]);
                    let error = match self.mint {
                        true => Error::not_installed_or(error, "a fencing token"),
                        false => error,
                    };
                    let outcome = Err(error);
                    self.ledger.settle(taken, &outcome, true);
                    outcome
                }
            },
        };
        self.outcome = Some(outcome);
    }

    /// Checks the reply to the call's statement: whether it was granted
    /// (a permit try's key becomes the slot granted, and a minting
    /// statement's token the grant's).
    fn check(&mut self, statement: Statement<'_>, reply: &Reply) -> Result<bool, Error> {
        let sql = statement.sql();
        let (reply, token) = minted(statement.is_minting(), reply).map_err(|what| {
            Error::unexpected(format!(
                "the reply to lockkit's {sql:?} statement {what}: {reply:?}"
            ))
        })?;
        self.token = token;
        let Some(permit) = self.permit else {
            return check_one(sql, reply);
        };
        Ok(match permit.check(sql, reply)? {
            Some(slot) => {
                self.key = LockKey::Pair(SEMAPHORE_CLASS, permit.base | i32::from(slot));
                true
            }
            None => false,
        })
    }

    /// The outcome, once [`OneCall::statement`] is `None`: the grant, or
    /// the busy key of a try. The adapter hands it to [`Grant::lock`] or
    /// [`Grant::try_lock`].
    ///
    /// # Errors
    ///
    /// As [`Acquisition::finish`].
    pub(crate) fn finish(mut self) -> Result<Result<Grant, Busy>, Error> {
        match self.outcome.take() {
            // Unanswered: the ledger's drop poisons the transaction.
            None => Err(Error::new(ErrorKind::Poisoned)),
            Some(Err(e)) => Err(e),
            Some(Ok(Granted::Busy(busy))) => {
                Ok(Err(Busy::new(busy, vec![self.ledger.key_type.name()])))
            }
            Some(Ok(Granted::Now)) => Ok(Ok(Grant {
                token: self.token,
                key: Some((self.key, self.held)),
                keys: Vec::new(),
            })),
        }
    }
}

/// Checks the reply to a one-key statement (a lock, or its try): `true`
/// when the key is granted, `false` when the try found it busy.
#[inline]
pub(super) fn check_one(sql: Sql, reply: &Reply) -> Result<bool, Error> {
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

/// The statement that takes one `BigInt` key: the lock, or its try.
pub(super) fn one_bigint(key: i64, shared: bool, try_only: bool) -> Statement<'static> {
    let sql = match (try_only, shared) {
        (false, false) => Sql::LockBigint,
        (false, true) => Sql::LockBigintShared,
        (true, false) => Sql::TryBigint,
        (true, true) => Sql::TryBigintShared,
    };
    Statement::new(sql, &[Param::Int8(key)])
}

/// The statement that takes one `Pair` key: the lock, or its try.
pub(super) fn one_pair(
    class: i32,
    object: i32,
    shared: bool,
    try_only: bool,
) -> Statement<'static> {
    let sql = match (try_only, shared) {
        (false, false) => Sql::LockPair,
        (false, true) => Sql::LockPairShared,
        (true, false) => Sql::TryPair,
        (true, true) => Sql::TryPairShared,
    };
    Statement::new(sql, &[Param::Int4(class), Param::Int4(object)])
}
