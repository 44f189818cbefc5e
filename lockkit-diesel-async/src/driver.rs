//! diesel-async as lockkit's [`Driver`]: runs the engine's statements, ends
//! savepoints, settles a cut-off call, reads the server facts and Diesel's
//! transaction state: the only things this adapter does.
//!
//! Statements go one at a time, in the engine's order: a diesel-async
//! pipeline (futures polled together on `&AsyncPgConnection`) prepares each
//! statement in its own future, and nothing in diesel-async promises that
//! the statements then reach the server in the order the futures were made;
//! the engine's order (savepoint, timeouts, `BigInt` keys before `Pair`
//! keys) is what makes a batch deadlock-free and a timeout bounding.
//! (Within one statement, the utility statements that guard its name are
//! ordered by polling, and only in the order tokio-postgres sends what a
//! future asks at its first poll: see [`named`].)

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::pin;
use std::task::{Context, Waker};

use diesel::connection::TransactionManagerStatus;
use diesel::sql_types::{Array, Text};
use diesel::{sql_query, QueryResult};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use lockkit::driver::diesel::{Answer, EngineQuery, FactsColumns, MessagesRow, MESSAGES};
use lockkit::driver::{
    sql, Async, Driver, DriverError, FactsRow, Reply, ReplyShape, SavepointEnd, SavepointStep,
    Statement, Transactions, HASHTEXT_PROBES,
};
use lockkit::tx::BoxFuture;
use lockkit::{Error, StatementMode};

use crate::locker::Locker;
use crate::named;

/// The server facts, learned with [`sql::SERVER_FACTS`], and its
/// `lc_messages` ([`MESSAGES`]), inside a transaction (a savepoint in one
/// already open): diesel-async prepares each statement in a round trip of
/// its own before it binds and runs it, and behind a transaction-mode
/// pooler only a transaction keeps the two on one server connection. Each
/// is prepared under a savepoint ([`named`]), as lockkit's lock statements
/// are by default.
pub(crate) async fn server_facts(
    conn: &mut AsyncPgConnection,
) -> QueryResult<(FactsRow, MessagesRow)> {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        let conn: &AsyncPgConnection = conn;
        let row: FactsColumns = named::under_savepoint(conn, || async move {
            let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
            let mut conn = conn;
            sql_query(sql::SERVER_FACTS)
                .bind::<Array<Text>, _>(probes)
                .get_result(&mut conn)
                .await
        })
        .await?;
        let messages = named::under_savepoint(conn, || async move {
            let mut conn = conn;
            sql_query(MESSAGES).get_result(&mut conn).await
        })
        .await?;
        Ok((row.into(), messages))
    })
    .await
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

/// The locker is diesel-async's [`Driver`]: the one
/// [`LockTx`](crate::LockTx) runs its statements through it, each a
/// Diesel query on the `AsyncPgConnection`, prepared under a savepoint
/// that makes another process's statement of the same name harmless
/// (`named.rs`) unless the mode is `StatementMode::Prepared` (a cut-off
/// call's transaction given up and its statement cancelled).
impl Driver for Locker {
    type Io = Async;
    type Conn = AsyncPgConnection;
    type Answer = Answer;

    fn run<'a>(
        conn: &'a mut AsyncPgConnection,
        stmt: Statement<'a>,
        mode: StatementMode,
    ) -> impl Future<Output = Result<Answer, DriverError>> + Send + 'a {
        // Boxed `Send` with one lifetime, where rustc can see it is `Send`.
        let future: BoxFuture<'a, Result<Answer, DriverError>> = Box::pin(async move {
            if stmt.reply() == ReplyShape::Done {
                conn.batch_execute(stmt.text())
                    .await
                    .map_err(driver_error)?;
                return Ok(Answer::Done);
            }
            let conn: &AsyncPgConnection = conn;
            let stmt = &stmt;
            let load = || async move {
                let mut conn = conn;
                EngineQuery::new(stmt, mode).get_result(&mut conn).await
            };
            let row = if mode == StatementMode::Prepared {
                load().await
            } else {
                named::under_savepoint(conn, load).await
            };
            row.map(Answer::Row).map_err(driver_error)
        });
        future
    }

    fn reply(statement: &Statement<'_>, answer: &Answer) -> Reply {
        answer.reply(statement)
    }

    /// The transaction given up (`abandon_transaction`: rolled back, so
    /// its locks are released whether or not the cancel request aborts it,
    /// which the server ignores when it lands after the lock was granted and
    /// the session is idle; and never reported committed), and a cancel
    /// request for the statement, so the server stops waiting for the lock,
    /// where the locker sends one (on a connection proven direct; elsewhere
    /// the wait ends on the server within its slice).
    /// The cancel token (a copy of the connection's settings) is made only
    /// here: a call that completes pays nothing for it.
    fn cut_off(&self, conn: &mut AsyncPgConnection) {
        abandon_transaction(conn);
        self.inner.cancel(conn.cancel_token());
    }
}

impl Transactions for Locker {
    /// Fails when a cut-off call put the transaction manager in error.
    fn in_transaction(conn: &mut AsyncPgConnection) -> Result<bool, DriverError> {
        transaction_depth(conn)
            .map(|depth| depth > 0)
            .map_err(driver_error)
    }

    fn savepoint(
        conn: &mut AsyncPgConnection,
        step: SavepointStep,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_ {
        type Manager = AnsiTransactionManager;
        // Boxed where they are made, so that rustc sees they are `Send`.
        let future: BoxFuture<'_, QueryResult<()>> = match step {
            SavepointStep::Begin => Box::pin(Manager::begin_transaction(conn)),
            SavepointStep::Release => Box::pin(Manager::commit_transaction(conn)),
            SavepointStep::Rollback => Box::pin(Manager::rollback_transaction(conn)),
        };
        async move { future.await.map_err(driver_error) }
    }

    /// diesel-async cannot roll back in a destructor: the savepoint stays
    /// open, and whether its locks are held is unknown. Gives the
    /// transaction up (`abandon_transaction`): its transaction manager
    /// would go on counting the savepoint, so the enclosing
    /// `conn.transaction`'s commit would only `RELEASE` it and report
    /// success with the transaction (its writes, its locks) still open.
    /// Given up, the transaction is rolled back at once, which releases its
    /// locks while the connection waits to be discarded, and that commit
    /// fails.
    fn savepoint_dropped(conn: &mut AsyncPgConnection) -> SavepointEnd {
        abandon_transaction(conn);
        SavepointEnd::Unknown
    }
}
