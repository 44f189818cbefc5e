//! Runs the engine's statements through diesel-async, reads the server
//! facts, and Diesel's transaction state: the only things this adapter does.
//!
//! Statements go one at a time, in the engine's order: a diesel-async
//! pipeline (futures polled together on `&AsyncPgConnection`) prepares each
//! statement in its own future, and nothing in diesel-async promises that
//! the statements then reach the server in the order the futures were made;
//! the engine's order (savepoint, timeouts, `BigInt` keys before `Pair`
//! keys) is what makes a batch deadlock-free and a timeout bounding.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::{pin, Pin};
use std::task::{Context, Waker};

use diesel::connection::TransactionManagerStatus;
use diesel::sql_types::{Array, Text};
use diesel::{sql_query, QueryResult};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use lockkit::engine::{
    sql, Acquisition, DriverError, FactsRow, Grant, ReplyShape, Statement, HASHTEXT_PROBES,
};
use lockkit::for_diesel::{Answer, EngineQuery, FactsColumns, MessagesRow, MESSAGES};
use lockkit::pg::Canceller;
use lockkit::{Busy, Error, StatementMode};

/// The future a closure of [`LockTx::savepoint`](crate::LockTx::savepoint)
/// returns: boxed, so that it may borrow the `LockTx` it is given.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The server facts, learned with [`sql::SERVER_FACTS`].
pub(crate) async fn server_facts(conn: &mut AsyncPgConnection) -> QueryResult<FactsRow> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row: FactsColumns = sql_query(sql::SERVER_FACTS)
        .bind::<Array<Text>, _>(probes)
        .get_result(conn)
        .await?;
    Ok(row.into())
}

/// The server's `lc_messages` ([`MESSAGES`]).
pub(crate) async fn messages(conn: &mut AsyncPgConnection) -> QueryResult<MessagesRow> {
    sql_query(MESSAGES).get_result(conn).await
}

/// diesel-async's transaction depth on `conn`: 0 outside a transaction, 1
/// in `conn.transaction(…)`, 2 in a nested one (a savepoint), ….
///
/// # Errors
///
/// Diesel's `BrokenTransactionManager` when the transaction manager is in
/// error.
pub(crate) fn transaction_depth(conn: &mut AsyncPgConnection) -> QueryResult<u32> {
    let status: &mut TransactionManagerStatus = <AnsiTransactionManager as TransactionManager<
        AsyncPgConnection,
    >>::transaction_manager_status_mut(conn);
    Ok(status.transaction_depth()?.map_or(0, NonZeroU32::get))
}

/// Puts diesel-async's transaction manager on `conn` in error: its commit
/// and rollback then fail with `BrokenTransactionManager` instead of sending
/// anything, and pools discard the connection.
fn break_transaction_manager(conn: &mut AsyncPgConnection) {
    <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(
        conn,
    )
    .set_in_error();
}

/// Gives up the transaction open on `conn`, from a destructor (a lock call
/// or a savepoint cut off in flight), where nothing can be awaited:
///
/// - queues [`sql::GIVE_UP`] behind what is in flight (tokio-postgres puts
///   a query on the connection at its first poll; what it answers nobody
///   reads): the transaction is rolled back, its locks released, whatever
///   happens to the statements before it, and what the application still
///   sends fails instead of running outside a transaction;
/// - puts diesel-async's transaction manager in error, so that the
///   enclosing `conn.transaction` never sends its `COMMIT`: PostgreSQL
///   would answer it, in the aborted transaction, by rolling back, and
///   diesel-async would report that as a commit (and at a savepoint's
///   depth it would only `RELEASE`). The transaction fails instead, even
///   when its closure returns `Ok`, and pools discard the connection (a
///   session left in a failed transaction, which holds nothing).
pub(crate) fn abandon_transaction(conn: &mut AsyncPgConnection) {
    {
        let give_up = pin!(conn.batch_execute(sql::GIVE_UP));
        let _ = give_up.poll(&mut Context::from_waker(Waker::noop()));
    }
    break_transaction_manager(conn);
}

pub(crate) fn begin(conn: &mut AsyncPgConnection) -> BoxFuture<'_, QueryResult<()>> {
    Box::pin(<AnsiTransactionManager as TransactionManager<
        AsyncPgConnection,
    >>::begin_transaction(conn))
}

/// Commits the innermost savepoint.
pub(crate) fn commit(conn: &mut AsyncPgConnection) -> BoxFuture<'_, QueryResult<()>> {
    Box::pin(<AnsiTransactionManager as TransactionManager<
        AsyncPgConnection,
    >>::commit_transaction(conn))
}

/// Rolls the innermost savepoint back.
pub(crate) fn rollback(conn: &mut AsyncPgConnection) -> BoxFuture<'_, QueryResult<()>> {
    Box::pin(<AnsiTransactionManager as TransactionManager<
        AsyncPgConnection,
    >>::rollback_transaction(conn))
}

/// Diesel's error as the engine sees it (lockkit's `diesel` conversion),
/// plus what diesel-async reports differently from Diesel: a tokio-postgres
/// error without a SQLSTATE arrives as `UnableToSendCommand` with
/// tokio-postgres's message, and "connection closed" or "error
/// communicating with the server" mean the connection is gone.
pub(crate) fn driver_error(e: diesel::result::Error) -> DriverError {
    use diesel::result::{DatabaseErrorKind as Kind, Error as D};
    let lost = match &e {
        D::DatabaseError(Kind::UnableToSendCommand, info) => {
            let message = info.message();
            message == "connection closed"
                || message.starts_with("error communicating with the server")
        }
        _ => false,
    };
    let driver = DriverError::from(e);
    if lost {
        driver.closed(true)
    } else {
        driver
    }
}

/// [`driver_error`] as lockkit's error.
pub(crate) fn lock_error(e: diesel::result::Error) -> Error {
    driver_error(e).into_error()
}

/// Runs one statement (boxed `Send` with one lifetime, where rustc can see
/// it is `Send`), as `mode` says: through diesel-async's statement cache,
/// or unnamed.
fn run<'a>(
    conn: &'a mut AsyncPgConnection,
    stmt: Statement<'a>,
    mode: StatementMode,
) -> BoxFuture<'a, Result<Answer, DriverError>> {
    Box::pin(async move {
        if stmt.reply() == ReplyShape::Done {
            conn.batch_execute(stmt.text())
                .await
                .map_err(driver_error)?;
            return Ok(Answer::Done);
        }
        let query = EngineQuery::new(&stmt, mode);
        let answer = match stmt.reply() {
            ReplyShape::Locked => query.get_result(conn).await.map(Answer::Locked),
            ReplyShape::TriedBigint => query.get_result(conn).await.map(Answer::TriedBigint),
            ReplyShape::TriedPair => query.get_result(conn).await.map(Answer::TriedPair),
            _ => query.get_result(conn).await.map(Answer::Tagged),
        };
        answer.map_err(driver_error)
    })
}

/// What a lock call cut off in flight (its future dropped while a statement
/// was sent) leaves on `conn`, when dropped armed: the transaction given up
/// ([`abandon_transaction`]: rolled back, so its locks are released whether
/// or not the cancel request aborts it, which the server ignores when it
/// lands after the lock was granted and the session is idle; and never
/// reported committed), and a cancel request for the statement, so the
/// server stops waiting for the lock.
///
/// The statements go through the guard's `conn`, so that the cancel token (a
/// copy of the connection's settings) is made only at the drop: a call that
/// completes pays nothing for it.
struct CancelOnDrop<'a, 'c> {
    conn: &'c mut AsyncPgConnection,
    armed: Option<&'a Canceller>,
}

impl Drop for CancelOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(canceller) = self.armed.take() {
            abandon_transaction(self.conn);
            canceller.cancel(self.conn.cancel_token());
        }
    }
}

/// Sends a one-key call's statement on `conn` (see
/// [`OneCall`](lockkit::engine::OneCall)) and
/// returns its answer. Dropped while the statement is in flight, it gives
/// up the transaction and sends a cancel request through `canceller` (see
/// [`CancelOnDrop`]); the dropped call poisons the transaction.
pub(crate) fn send_one<'a>(
    conn: &'a mut AsyncPgConnection,
    mode: StatementMode,
    canceller: &'a Canceller,
    statement: Statement<'a>,
) -> BoxFuture<'a, Result<Answer, DriverError>> {
    Box::pin(async move {
        let mut guard = CancelOnDrop {
            conn,
            armed: Some(canceller),
        };
        let answer = run(&mut *guard.conn, statement, mode).await;
        guard.armed = None;
        answer
    })
}

/// Drives an acquisition to its outcome on `conn`, one statement at a time.
///
/// Dropped while a statement is in flight, the acquisition poisons the
/// transaction and a cancel request goes to the server through `canceller`.
pub(crate) fn drive<'a>(
    conn: &'a mut AsyncPgConnection,
    mode: StatementMode,
    canceller: &'a Canceller,
    call: Acquisition<'a>,
) -> BoxFuture<'a, Result<Result<Grant, Busy>, Error>> {
    Box::pin(drive_inner(conn, mode, canceller, call))
}

async fn drive_inner(
    conn: &mut AsyncPgConnection,
    mode: StatementMode,
    canceller: &Canceller,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        let mut guard = CancelOnDrop {
            conn: &mut *conn,
            armed: Some(canceller),
        };
        // One at a time, stopping at the first error.
        let (mut answers, mut failed) = (Vec::with_capacity(round.len()), None);
        for stmt in round.iter().copied() {
            match run(&mut *guard.conn, stmt, mode).await {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        guard.armed = None;
        call.receive_answers(failed.map_or(Ok(answers), Err), |_, a| a.reply());
    }
    call.finish()
}
