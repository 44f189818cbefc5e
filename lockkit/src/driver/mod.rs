//! For adapter authors: how the one [`LockTx`] reaches a
//! connection.
//!
//! An adapter is a [`Driver`] (it runs the engine's statements on its
//! connection, reads the answers into the engine's replies, and settles a
//! call cut off in flight) with its stack's [`Transactions`] (whether a
//! transaction is open, savepoint steps), its entry points ([`lock_tx`],
//! [`transaction`] or [`transaction_blocking`]), its error conversion
//! ([`DriverError`]) and its re-exports. Everything else of a lock call (the
//! checks, the plan, the rounds, the reply checks, the bookkeeping, the
//! guards, the savepoint's bookkeeping) is [`LockTx`]'s and the lock
//! engine's, written once inside lockkit: an adapter never sees a plan,
//! never makes a guard, and cannot report a lock that the server did not
//! grant, since every reply it reads is checked against what was sent.
//!
//! The driver runs each round's statements in the engine's order (one at a
//! time unless it overrides [`Driver::run_round`]), and a round stops at
//! its first error (what a pipeline would answer too). Session locks' own
//! runner is a driver too: each of its rounds is one simple-protocol query.
//! So is tokio-postgres's (in `lockkit` itself), whose rounds are
//! pipelined.
//!
//! This is an adapter, whole, for a blocking stack (Diesel's adapter is
//! this, over `PgConnection`); an async stack's `run` returns its query's
//! future, with `type Io = Async`, and its `cut_off` cancels what is in
//! flight ([`CancellingPolicy::cancel`]):
//!
//! ```
//! use std::future::{ready, Future};
//!
//! use lockkit::driver::{
//!     read_reply, Blocking, Driver, DriverError, Param, Policy, Reply, ReplyRow, SavepointEnd,
//!     SavepointStep, Statement, Transactions,
//! };
//! use lockkit::tx::LockTx;
//! use lockkit::{Config, Error, ServerFacts, StatementMode};
//!
//! /// The stack's connection and rows (a real adapter has its driver's).
//! pub struct Conn {
//!     depth: u32,
//! }
//! pub struct Row(Vec<i64>);
//!
//! impl Conn {
//!     fn query(&mut self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, String> {
//!         # let _ = (sql, params);
//!         unimplemented!("the stack's query: {sql}")
//!     }
//!     fn execute(&mut self, sql: &str) -> Result<(), String> {
//!         unimplemented!("the stack's statement: {sql}")
//!     }
//! }
//!
//! /// How the engine reads a row: the columns of its reply, by index.
//! impl ReplyRow for Row {
//!     type Error = String;
//!     fn int8(&self, i: usize) -> Result<i64, String> {
//!         self.0.get(i).copied().ok_or_else(|| format!("no column {i}"))
//!     }
//!     fn int4(&self, i: usize) -> Result<i32, String> {
//!         i32::try_from(self.int8(i)?).map_err(|e| e.to_string())
//!     }
//!     fn bool(&self, i: usize) -> Result<bool, String> {
//!         Ok(self.int8(i)? != 0)
//!     }
//!     fn int8_array(&self, _: usize) -> Result<Vec<i64>, String> {
//!         Err("this stack reads no arrays".into())
//!     }
//!     fn int4_array(&self, _: usize) -> Result<Vec<i32>, String> {
//!         Err("this stack reads no arrays".into())
//!     }
//! }
//!
//! /// The adapter's locker: what it learned of the server, and the driver.
//! #[derive(Clone, Debug)]
//! pub struct Locker {
//!     policy: Policy,
//! }
//!
//! impl AsRef<Policy> for Locker {
//!     fn as_ref(&self) -> &Policy {
//!         &self.policy
//!     }
//! }
//!
//! impl Driver for Locker {
//!     type Io = Blocking;
//!     type Conn = Conn;
//!     type Answer = Vec<Row>;
//!
//!     fn run<'a>(
//!         conn: &'a mut Conn,
//!         statement: Statement<'a>,
//!         _mode: StatementMode,
//!     ) -> impl Future<Output = Result<Vec<Row>, DriverError>> + Send + 'a {
//!         // A real adapter also reads the SQLSTATE, the message and whether
//!         // the connection closed into the `DriverError`.
//!         ready(conn.query(statement.text(), statement.params()).map_err(DriverError::new))
//!     }
//!
//!     fn reply(statement: &Statement<'_>, rows: &Vec<Row>) -> Reply {
//!         read_reply(statement, Some(rows))
//!     }
//!
//!     /// A blocking call is never cut off in flight.
//!     fn cut_off(&self, _: &mut Conn) {}
//! }
//!
//! impl Transactions for Locker {
//!     fn in_transaction(conn: &mut Conn) -> Result<bool, DriverError> {
//!         Ok(conn.depth > 0)
//!     }
//!
//!     fn savepoint(
//!         conn: &mut Conn,
//!         step: SavepointStep,
//!     ) -> impl Future<Output = Result<(), DriverError>> + Send + '_ {
//!         let sql = match (step, conn.depth) {
//!             (SavepointStep::Begin, 0) => "BEGIN",
//!             (SavepointStep::Begin, _) => "SAVEPOINT lockkit",
//!             (SavepointStep::Release, 1) => "COMMIT",
//!             (SavepointStep::Release, _) => "RELEASE SAVEPOINT lockkit",
//!             (SavepointStep::Rollback, 1) => "ROLLBACK",
//!             (SavepointStep::Rollback, _) => "ROLLBACK TO SAVEPOINT lockkit; RELEASE SAVEPOINT lockkit",
//!         };
//!         let done = conn.execute(sql).map_err(DriverError::new);
//!         if done.is_ok() {
//!             match step {
//!                 SavepointStep::Begin => conn.depth += 1,
//!                 _ => conn.depth -= 1,
//!             }
//!         }
//!         ready(done)
//!     }
//!
//!     fn savepoint_dropped(conn: &mut Conn) -> SavepointEnd {
//!         match Self::in_transaction(conn) {
//!             Ok(true) => SavepointEnd::Unknown, // a real adapter rolls back here
//!             _ => SavepointEnd::Unknown,
//!         }
//!     }
//! }
//!
//! /// The adapter's entry points: over an open transaction, and the
//! /// closure form that begins, commits or rolls back.
//! impl Locker {
//!     pub fn new(config: Config, facts: ServerFacts) -> Locker {
//!         Locker { policy: Policy::new(config, facts) }
//!     }
//!
//!     pub fn lock_tx<'t>(&self, conn: &'t mut Conn) -> Result<LockTx<'t, Locker>, Error> {
//!         lockkit::driver::lock_tx(self, conn)
//!     }
//!
//!     pub fn transaction<R, E: From<Error>>(
//!         &self,
//!         conn: &mut Conn,
//!         f: impl FnOnce(&mut LockTx<'_, Locker>) -> Result<R, E>,
//!     ) -> Result<R, E> {
//!         lockkit::driver::transaction_blocking(self, conn, f)
//!     }
//! }
//!
//! // No transaction open: refused before anything is sent.
//! let locker = Locker::new(Config::default(), ServerFacts::assumed(64, 100, 0));
//! let mut conn = Conn { depth: 0 };
//! assert!(locker.lock_tx(&mut conn).is_err());
//! ```
//!
//! The lock engine behind [`LockTx`] is the whole protocol of taking locks
//! inside a transaction, with no I/O and no driver types; it stays inside
//! lockkit, and so does everything that makes a guard.

#[cfg(feature = "cancel")]
mod cancel;
#[cfg(feature = "diesel")]
pub mod diesel;
mod locker_basics;

pub use crate::engine::Policy;
pub use crate::engine::{
    read_reply, DriverError, FactsRow, Param, Reply, ReplyRow, ReplyShape, SavepointEnd, Statement,
    HASHTEXT_PROBES,
};
// Named by the docs of the tokio-postgres adapter's cut-off path.
#[cfg(feature = "tokio-postgres")]
#[allow(unused_imports)]
pub(crate) use cancel::Canceller;
#[cfg(feature = "cancel")]
pub use cancel::{CancelTls, CancellingPolicy};

/// The name the server's English message says is taken when preparing a
/// statement found one of that name already on the connection (`42P05`,
/// `prepared statement "s12" already exists` gives `s12`); `None` for any
/// other message.
///
/// For adapters that repair such a clash, which needs the name: the same
/// reading by which lockkit types the error of a driver that hides the
/// SQLSTATE (Diesel, diesel-async) as
/// [`UnexpectedReply`](crate::ErrorKind::UnexpectedReply) with `42P05`. A
/// server whose `lc_messages` is not English names no statement here.
///
/// ```
/// use lockkit::driver::taken_statement_name;
///
/// assert_eq!(taken_statement_name("prepared statement \"s12\" already exists"), Some("s12"));
/// assert_eq!(taken_statement_name("prepared statement \"s12\" does not exist"), None);
/// ```
pub fn taken_statement_name(message: &str) -> Option<&str> {
    match crate::engine::error::statement_name_message(message)? {
        (name, crate::sqlstate::DUPLICATE_PREPARED_STATEMENT) => Some(name),
        _ => None,
    }
}

/// The SQL texts sent outside the engine's lock calls: [`SERVER_FACTS`]
/// and [`GIVE_UP`], which adapters send themselves (a locker's set-up, a
/// cut-off call's transaction given up); and lockkit's one-key lock, its
/// exclusive batch and its key-type publication, for tests and benchmarks
/// that replay or compare them by hand. Every other statement is the
/// engine's, handed to the driver as a [`Statement`].
///
/// [`SERVER_FACTS`]: sql::SERVER_FACTS
/// [`GIVE_UP`]: sql::GIVE_UP
pub mod sql {
    pub use crate::engine::sql::{
        BATCH_BIGINT_EXCLUSIVE, CREATE_KEY_TYPES, GIVE_UP, LOCK_BIGINT, PUBLISH_LOCK, SERVER_FACTS,
    };
}

use std::fmt;
use std::future::Future;

use crate::engine::{Acquisition, Grant, OneCall, TxState};
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
    pub trait Sealed {
        /// Whether a call can be cut off in flight (its future dropped
        /// while a statement runs): an async one can; a blocking one runs
        /// to its end, so its waits need no bound on the server.
        const CUT_OFF: bool;
    }
    impl Sealed for super::Async {
        const CUT_OFF: bool = true;
    }
    impl Sealed for super::Blocking {
        const CUT_OFF: bool = false;
    }
}

/// Whether `D`'s calls that wait as long as it takes bound their waits on
/// the server: its policy says so ([`Policy::bounds_waits`]), and its calls
/// can be cut off in flight.
pub(crate) fn bounds_waits<D: Driver>(driver: &D) -> bool {
    <D::Io as sealed::Sealed>::CUT_OFF && driver.as_ref().bounds_waits()
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
