//! For adapter authors: how the one [`LockTx`](crate::tx::LockTx) reaches a
//! connection.
//!
//! An adapter is a [`Driver`] (it runs the engine's statements on its
//! connection, reads the answers into the engine's replies, reports the
//! transaction depth, ends savepoints, and settles a call cut off in
//! flight), its entry points, its error conversion and its re-exports.
//! Everything else of a lock call (the checks, the plan, the rounds, the
//! reply checks, the bookkeeping, the guards, the savepoint's bookkeeping)
//! is [`LockTx`](crate::tx::LockTx)'s and the engine's, written once.
//!
//! The driver runs one statement at a time, in the engine's order, and a
//! round stops at its first error (what a pipeline would answer too).

use std::fmt;
use std::future::Future;

use smallvec::SmallVec;

use crate::engine::{Acquisition, DriverError, Grant, Policy, Reply, SavepointEnd, Statement};
use crate::tx::LockTx;
use crate::{Busy, Error, StatementMode};

/// A database stack's connection, as the one
/// [`LockTx`](crate::tx::LockTx) uses it.
///
/// The trait is implemented by a marker type of the adapter (no value is
/// made); every method is an associated function over the connection, so
/// that a savepoint's `LockTx` reborrows the same connection.
pub trait Driver: Sized + Send + Sync + 'static {
    /// The connection a [`LockTx`](crate::tx::LockTx) borrows for its
    /// transaction, on which the application also runs its queries.
    type Conn: Send;
    /// The adapter's locker: configuration, server facts, and what the
    /// driver needs to settle a cut-off call (a cancel request's TLS).
    type Locker: Clone + fmt::Debug + Send + Sync + 'static;
    /// What the server answered one statement, before the engine reads it.
    type Answer: Send;

    /// What `locker` knows: configuration and server facts.
    fn policy(locker: &Self::Locker) -> &Policy;

    /// Whether a transaction is open on `conn`.
    ///
    /// # Errors
    ///
    /// When the driver cannot tell (a transaction manager in error).
    fn in_transaction(conn: &mut Self::Conn) -> Result<bool, DriverError>;

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

    /// The engine's reply in `answer`, the answer to `statement`
    /// ([`read_reply`](crate::engine::read_reply) over the driver's rows).
    fn reply(statement: &Statement<'_>, answer: &Self::Answer) -> Reply;

    /// What a lock call dropped while a statement is in flight leaves on
    /// `conn`, from a destructor: a cancel request where the driver has
    /// one, and whatever keeps the transaction from being reported
    /// committed. The engine has already poisoned the transaction's
    /// bookkeeping.
    fn cut_off(conn: &mut Self::Conn, locker: &Self::Locker);

    /// Opens a savepoint through the driver's transaction manager.
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn begin_savepoint(
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_;

    /// Releases the innermost savepoint.
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn release_savepoint(
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_;

    /// Rolls the innermost savepoint back.
    ///
    /// # Errors
    ///
    /// The driver's error.
    fn rollback_savepoint(
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_;

    /// How a savepoint ends when its future is dropped (or its closure
    /// panics) before `RELEASE` is sent: [`SavepointEnd::RolledBack`] when
    /// [`Driver::savepoint_dropped`] rolls it back, else
    /// [`SavepointEnd::Unknown`] (the transaction is poisoned).
    const SAVEPOINT_DROPPED: SavepointEnd;

    /// What a savepoint whose end was never recorded leaves on `conn`, from
    /// a destructor.
    fn savepoint_dropped(conn: &mut Self::Conn);
}

/// A [`LockTx`] over the transaction open on `conn`: an adapter's entry
/// points make every `LockTx` through this.
///
/// # Errors
///
/// [`ErrorKind::NotInTransaction`](crate::ErrorKind::NotInTransaction) when
/// no transaction is open on `conn`, or the driver's error when it cannot
/// tell.
pub fn lock_tx<'t, D: Driver>(
    locker: &D::Locker,
    conn: &'t mut D::Conn,
) -> Result<LockTx<'t, D>, Error> {
    LockTx::attach(locker, conn)
}

/// Settles the connection with [`Driver::cut_off`] when dropped armed: a
/// statement was sent and its answer never read.
struct CutOff<'c, 'l, D: Driver> {
    conn: &'c mut D::Conn,
    armed: Option<&'l D::Locker>,
}

impl<D: Driver> Drop for CutOff<'_, '_, D> {
    fn drop(&mut self) {
        if let Some(locker) = self.armed.take() {
            D::cut_off(self.conn, locker);
        }
    }
}

/// Runs a one-key call's statement, settling the connection if dropped in
/// flight.
pub(crate) async fn send_one<'a, D: Driver>(
    conn: &'a mut D::Conn,
    locker: &'a D::Locker,
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

/// Drives an acquisition to its outcome on `conn`, round after round, one
/// statement at a time, stopping a round at its first error. Dropped while a
/// statement is in flight, the acquisition poisons the transaction and the
/// connection is settled ([`Driver::cut_off`]).
pub(crate) async fn drive<D: Driver>(
    conn: &mut D::Conn,
    locker: &D::Locker,
    mode: StatementMode,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        let mut guard = CutOff::<D> {
            conn: &mut *conn,
            armed: Some(locker),
        };
        let (mut answers, mut failed) = (SmallVec::<[D::Answer; 1]>::new(), None);
        for statement in round.iter().copied() {
            match D::run(&mut *guard.conn, statement, mode).await {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        guard.armed = None;
        call.receive_answers(failed.map_or(Ok(answers), Err), D::reply);
    }
    call.finish()
}
