//! For adapter authors: how the one [`LockTx`] reaches a
//! connection.
//!
//! An adapter is a [`Driver`] (it runs the engine's statements on its
//! connection, reads the answers into the engine's replies, and settles a
//! call cut off in flight) with its stack's [`Transactions`] (whether a
//! transaction is open, savepoint steps), its entry points, its error
//! conversion and its re-exports.
//! Everything else of a lock call (the checks, the plan, the rounds, the
//! reply checks, the bookkeeping, the guards, the savepoint's bookkeeping)
//! is [`LockTx`]'s and the engine's, written once.
//!
//! The driver runs each round's statements in the engine's order (one at a
//! time unless it overrides [`Driver::run_round`]), and a round stops at
//! its first error (what a pipeline would answer too). Session locks' own
//! runner is a driver too: each of its rounds is one simple-protocol query.
//! So is tokio-postgres's (in `lockkit` itself), whose rounds are
//! pipelined.
//!
//! # The engine
//!
//! The lock engine is the whole protocol of taking locks inside a
//! transaction, with no I/O and no driver types.
//!
//! Given what a transaction holds ([`TxState`]), a request ([`Request`],
//! [`Wait`]) and what the locker knows of the server ([`Policy`]), the engine
//! runs the checks (hot standby, `hashtext`, poisoning, budget, lock order),
//! plans the batch (deduplicated, sorted in the global order of KEYS.md, one
//! statement per key space), lists the statements to send, round by round
//! ([`Acquisition::round`]), takes the replies back and checks every one
//! ([`Acquisition::receive`]), records the outcome or poisons the
//! transaction, and makes the guards from the outcome ([`Grant::lock`] and
//! its siblings, which every adapter calls). Only the engine makes guards.
//!
//! The most common call, one key that waits as long as it takes or not at
//! all (an adapter's `lock`, `lock_shared`, `try_lock`, `try_lock_shared`),
//! is one statement and one reply: [`TxState::acquire_one`] starts it as a
//! [`OneCall`], with the same checks, reply check, bookkeeping and metrics
//! as [`Acquisition`] (one implementation of each, shared) and without the
//! rounds, which the most common call does not need.
//!
//! An adapter (tokio-postgres in [`crate::pg`], `lockkit-diesel`, …) only
//! sends [`Statement`]s on its connection, pipelined where its driver allows,
//! turns the rows into [`Reply`]s, turns its errors into [`DriverError`]s,
//! and cancels a call whose future is dropped. Its whole lock call is this
//! loop:
//!
//! ```
//! use lockkit::driver::{
//!     DriverError, Grant, Policy, Reply, ReplyShape, Request, Statement, TxState, Wait,
//! };
//! use lockkit::{Config, HeldBatch, Batch, ServerFacts};
//!
//! /// A stand-in for a driver: answers every statement as the server would
//! /// when nothing else holds the keys.
//! fn send(round: &[Statement<'_>]) -> Result<Vec<Reply>, DriverError> {
//!     Ok(round.iter().map(|s| match (s.reply(), s.sql().tag()) {
//!         (_, None) => Reply::Done,
//!         (ReplyShape::Locked, Some(tag)) => Reply::Locked { tag },
//!         (_, Some(tag)) => Reply::Tagged { tag, n: lockkit::driver::expected_rows(s) },
//!     }).collect())
//! }
//!
//! # fn main() -> Result<(), lockkit::Error> {
//! let policy = Policy::new(Config::default(), ServerFacts::assumed(64, 100, 0));
//! let state = TxState::new(); // one per transaction
//! # #[derive(lockkit::AdvisoryKey)] struct Account { id: i64 }
//! let batch = Batch::new().with(&Account { id: 1 }).with(&Account { id: 2 });
//! let mut call = state.acquire(&policy, 0, Request::batch(&batch), Wait::Forever)?;
//! while let Some(round) = call.round() {
//!     let replies = send(&round);
//!     call.receive(replies);
//! }
//! // The guard from the outcome: `Grant::lock` for one key, `try_lock`
//! // and `try_lock_batch` for the tries.
//! let held: HeldBatch<'_> = Grant::lock_batch(call.finish())?;
//! assert_eq!(held.keys().len(), 2);
//! assert_eq!(state.held_count(), 2);
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "cancel")]
mod cancel;
#[cfg(feature = "diesel")]
pub mod diesel;
mod locker;

pub use crate::engine::Policy;
pub use crate::engine::{
    expected_rows, read_reply, sql, Acquisition, DriverError, FactsRow, Grant, OneCall, Param,
    ParamType, Reply, ReplyRow, ReplyShape, Request, Round, SavepointEnd, SavepointEnding, Sql,
    Statement, TxSlot, TxState, Wait, HASHTEXT_PROBES,
};
#[cfg(feature = "cancel")]
pub use cancel::{CancelTls, Canceller, CancellingPolicy};

use std::fmt;
use std::future::Future;

use crate::tx::{BoxFuture, LockTx, Scope};
use crate::{Busy, Error, StatementMode};

/// Whether a driver's calls are futures ([`Async`]) or run to their end
/// when made ([`Blocking`]): what lets one [`LockTx`] serve both.
///
/// Sealed: lockkit's two are the only ones.
pub trait Io: sealed::Sealed + Sized + Send + Sync + 'static {
    /// What a call returns, made from its future `F`.
    type Out<F: Future>;
    /// The call's return value made from its future.
    fn finish<F: Future>(future: F) -> Self::Out<F>;
}

/// Calls return their future; closures return a boxed future
/// ([`BoxFuture`]).
#[derive(Debug)]
pub enum Async {}

/// Calls return their result; closures return their value. A blocking
/// driver's futures complete when first polled (its `run` and savepoint
/// calls return [`std::future::Ready`]).
#[derive(Debug)]
pub enum Blocking {}

impl Io for Async {
    type Out<F: Future> = F;

    #[inline(always)]
    fn finish<F: Future>(future: F) -> F {
        future
    }
}

impl Io for Blocking {
    type Out<F: Future> = F::Output;

    fn finish<F: Future>(future: F) -> F::Output {
        use std::task::{Context, Poll, Waker};
        let mut future = std::pin::pin!(future);
        match future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(output) => output,
            // A blocking driver's futures are ready when made: the call's
            // future never waits.
            Poll::Pending => unreachable!("lockkit: a blocking driver's call did not complete"),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Async {}
    impl Sealed for super::Blocking {}
}

/// A database stack's connection, as the one
/// [`LockTx`] uses it.
///
/// The trait is implemented by the adapter's locker (its configuration and
/// server facts, as a [`Policy`], and what it needs to settle a cut-off
/// call), which every [`LockTx`] keeps a clone of. The methods take the
/// connection as an argument, so that a savepoint's `LockTx` reborrows the
/// same connection.
///
/// A blocking driver (`Io = `[`Blocking`]) does each call's work before
/// its future is first polled, and returns it ready
/// ([`std::future::ready`]): [`LockTx`] polls that future once, and
/// panics if it is not ready (a bug of the driver).
pub trait Driver: AsRef<Policy> + Clone + fmt::Debug + Sized + Send + Sync {
    /// [`Async`] or [`Blocking`].
    type Io: Io;
    /// The connection a [`LockTx`] borrows for its
    /// transaction, on which the application also runs its queries.
    type Conn: Send;
    /// What the server answered one statement, before the engine reads it.
    type Answer: Send;

    /// Runs one statement on `conn` (prepared as `mode` says, where the
    /// statement has parameters).
    ///
    /// # Errors
    ///
    /// The driver's error for the statement.
    ///
    /// # Cancel safety
    ///
    /// Dropped in flight, the caller settles the connection with
    /// [`Driver::cut_off`].
    fn run<'a>(
        conn: &'a mut Self::Conn,
        statement: Statement<'a>,
        mode: StatementMode,
    ) -> impl Future<Output = Result<Self::Answer, DriverError>> + Send + 'a;

    /// Runs a round of statements on `conn`, in order, and answers those
    /// that ran, with the error that stopped the round, if any (the next
    /// statement's): what a pipeline answers too. By default one statement
    /// at a time, through [`Driver::run`]; a driver that sends a round at
    /// once (one message, or pipelined) overrides it.
    ///
    /// # Cancel safety
    ///
    /// As [`Driver::run`].
    fn run_round<'a>(
        conn: &'a mut Self::Conn,
        round: &'a [Statement<'a>],
        mode: StatementMode,
    ) -> impl Future<Output = (Vec<Self::Answer>, Option<DriverError>)> + Send + 'a {
        async move {
            let mut answers = Vec::with_capacity(round.len());
            for &statement in round {
                match Self::run(&mut *conn, statement, mode).await {
                    Ok(answer) => answers.push(answer),
                    Err(e) => return (answers, Some(e)),
                }
            }
            (answers, None)
        }
    }

    /// The engine's reply in `answer`, the answer to `statement`
    /// ([`read_reply`] over the driver's rows).
    fn reply(statement: &Statement<'_>, answer: &Self::Answer) -> Reply;

    /// What a lock call dropped while a statement is in flight leaves on
    /// `conn`, from a destructor: a cancel request where the driver has
    /// one, and whatever keeps the transaction from being reported
    /// committed. The engine has already poisoned the transaction's
    /// bookkeeping.
    fn cut_off(&self, conn: &mut Self::Conn);
}

/// A stack's transaction manager, as the generic [`LockTx`] uses it: the
/// `LockTx` borrows a connection whose transaction the stack opens and
/// ends, so it asks the driver whether one is open and takes its
/// savepoints (and its closure forms' transactions) through it. Every
/// adapter's driver implements it; tokio-postgres's `LockTx` owns its
/// `Transaction`, and session locks run their own, so their drivers do
/// not.
pub trait Transactions: Driver {
    /// Whether a transaction is open on `conn`.
    ///
    /// # Errors
    ///
    /// When the driver cannot tell (a transaction manager in error).
    fn in_transaction(conn: &mut Self::Conn) -> Result<bool, DriverError>;

    /// Takes one step of a savepoint through the driver's transaction
    /// manager, on the innermost savepoint (at depth 0, `BEGIN` opens the
    /// transaction, and `COMMIT` or `ROLLBACK` ends it).
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn savepoint(
        conn: &mut Self::Conn,
        step: SavepointStep,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_;

    /// Ends, from a destructor, a savepoint (or a transaction begun by
    /// [`transaction`]) whose future was dropped or whose closure panicked
    /// before it ended, and says how: [`SavepointEnd::RolledBack`] when it
    /// is rolled back (now, or before the connection's next use), else
    /// [`SavepointEnd::Unknown`] (the transaction is poisoned).
    fn savepoint_dropped(conn: &mut Self::Conn) -> SavepointEnd;
}

/// A step of a savepoint, or of a transaction the driver's transaction
/// manager begins ([`Transactions::savepoint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavepointStep {
    /// `SAVEPOINT`, or `BEGIN` outside a transaction.
    Begin,
    /// `RELEASE SAVEPOINT`, or `COMMIT` of the transaction.
    Release,
    /// `ROLLBACK TO SAVEPOINT`, or `ROLLBACK` of the transaction.
    Rollback,
}

/// A [`LockTx`] over the transaction open on `conn`: an adapter's entry
/// points make every `LockTx` through this.
///
/// # Errors
///
/// [`ErrorKind::NotInTransaction`](crate::ErrorKind::NotInTransaction) when
/// no transaction is open on `conn`, or the driver's error when it cannot
/// tell.
pub fn lock_tx<'t, D: Transactions>(
    locker: &D,
    conn: &'t mut D::Conn,
) -> Result<LockTx<'t, D>, Error> {
    LockTx::attach(locker, conn)
}

/// Runs `f` in a new transaction begun on `conn` (a savepoint, when one is
/// open there) with a [`LockTx`]: commits when `f` returns `Ok`, rolls back
/// when it returns `Err`; dropped, the transaction ends as
/// [`Transactions::savepoint_dropped`] says. An async adapter's `transaction`.
///
/// # Errors
///
/// `f`'s error, or the driver's (as [`Error`]) when `BEGIN`, `COMMIT` or
/// `ROLLBACK` fails.
///
/// [`ErrorKind::TransactionAborted`](crate::ErrorKind::TransactionAborted),
/// rolled back instead of committed, when `f` returns `Ok` after a lock
/// call's error aborted the transaction.
///
/// # Cancel safety
///
/// Dropped, the transaction ends as [`Transactions::savepoint_dropped`] says.
pub async fn transaction<D, R, E, F>(locker: &D, conn: &mut D::Conn, f: F) -> Result<R, E>
where
    D: Transactions<Io = Async>,
    F: for<'a, 's> FnOnce(&'a mut LockTx<'s, D>) -> BoxFuture<'a, Result<R, E>>,
    E: From<Error>,
{
    let state = TxState::new();
    let mut scope = Scope::<D>::begin(conn, &state, 0).await?;
    let result = f(&mut scope.tx(locker.clone())).await;
    scope.end(result).await
}

/// [`transaction`] for a blocking adapter (Diesel): its `transaction`. A
/// panic in `f` rolls the transaction back as it unwinds.
///
/// # Errors
///
/// As [`transaction`].
pub fn transaction_blocking<D, R, E, F>(locker: &D, conn: &mut D::Conn, f: F) -> Result<R, E>
where
    D: Transactions<Io = Blocking>,
    F: FnOnce(&mut LockTx<'_, D>) -> Result<R, E>,
    E: From<Error>,
{
    let state = TxState::new();
    let mut scope = Blocking::finish(Scope::<D>::begin(conn, &state, 0))?;
    let result = f(&mut scope.tx(locker.clone()));
    Blocking::finish(scope.end(result))
}

/// Settles the connection with [`Driver::cut_off`] when dropped armed: a
/// statement was sent and its answer never read.
struct CutOff<'c, 'l, D: Driver> {
    conn: &'c mut D::Conn,
    armed: Option<&'l D>,
}

impl<D: Driver> Drop for CutOff<'_, '_, D> {
    fn drop(&mut self) {
        if let Some(locker) = self.armed.take() {
            locker.cut_off(self.conn);
        }
    }
}

/// Runs a one-key call's statement, settling the connection if dropped in
/// flight.
pub(crate) async fn send_one<'a, D: Driver>(
    conn: &'a mut D::Conn,
    locker: &'a D,
    mode: StatementMode,
    statement: Statement<'a>,
) -> Result<D::Answer, DriverError> {
    let mut guard = CutOff::<D> {
        conn,
        armed: Some(locker),
    };
    let answer = D::run(&mut *guard.conn, statement, mode).await;
    guard.armed = None;
    answer
}

/// Runs a one-key call (a lock, a try, a permit's try) on `conn`, settling
/// the connection if dropped in flight. Always inlined, as the engine's
/// hot path is: the statement's future is built in the lock call's own
/// state.
#[inline(always)]
pub(crate) fn run_one<'a, D: Driver>(
    conn: &'a mut D::Conn,
    locker: &'a D,
    call: OneCall<'a>,
) -> impl Future<Output = Result<Result<Grant, Busy>, Error>> + 'a {
    let mode = locker.as_ref().config().statement_mode();
    call.run(
        move |statement| send_one::<D>(conn, locker, mode, statement),
        D::reply,
    )
}

/// Drives an acquisition to its outcome on `conn`, round after round
/// ([`Driver::run_round`]). Dropped while a statement is in flight, the
/// acquisition poisons the transaction and the connection is settled
/// ([`Driver::cut_off`]).
pub(crate) async fn drive<D: Driver>(
    conn: &mut D::Conn,
    locker: &D,
    mode: StatementMode,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        let mut guard = CutOff::<D> {
            conn: &mut *conn,
            armed: Some(locker),
        };
        let (answers, failed) = D::run_round(&mut *guard.conn, &round, mode).await;
        guard.armed = None;
        call.receive_answers(failed.map_or(Ok(answers), Err), D::reply);
    }
    call.finish()
}
