//! Diesel as lockkit's [`Driver`]: runs the engine's statements, ends
//! savepoints, reads the server facts and Diesel's transaction state: the
//! only things this adapter does.

use std::future::{ready, Future};
use std::num::NonZeroU32;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::sql_types::{Array, Text};
use diesel::{sql_query, Connection, PgConnection, QueryResult, RunQueryDsl};
use lockkit::driver::diesel::{Answer, EngineQuery, FactsColumns, MessagesRow, MESSAGES};
use lockkit::driver::{
    sql, Blocking, Driver, DriverError, FactsRow, Reply, ReplyShape, SavepointEnd, SavepointStep,
    Statement, Transactions, HASHTEXT_PROBES,
};
use lockkit::StatementMode;

use crate::locker::Locker;

/// The server facts, learned with [`sql::SERVER_FACTS`], and its
/// `lc_messages` ([`MESSAGES`]), inside a transaction (a savepoint in one
/// already open): Diesel parses each statement in a round trip of its own
/// before it binds and runs it, and behind a transaction-mode pooler only a
/// transaction keeps the two on one server connection.
pub(crate) fn server_facts(conn: &mut PgConnection) -> QueryResult<(FactsRow, MessagesRow)> {
    conn.transaction(|conn| {
        let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
        let row: FactsColumns = sql_query(sql::SERVER_FACTS)
            .bind::<Array<Text>, _>(probes)
            .get_result(conn)?;
        let messages = sql_query(MESSAGES).get_result(conn)?;
        Ok((row.into(), messages))
    })
}

/// Diesel's transaction depth on `conn`: 0 outside a transaction, 1 in
/// `conn.transaction(…)`, 2 in a nested one (a savepoint), ….
///
/// # Errors
///
/// Diesel's `BrokenTransactionManager` when its transaction manager is in
/// error (after a failed `COMMIT` or `ROLLBACK`).
pub(crate) fn transaction_depth(conn: &mut PgConnection) -> QueryResult<u32> {
    // `TransactionManagerStatus::transaction_depth` is public and documented;
    // its accessor is the only way to it (`#[doc(hidden)]` unless Diesel's
    // third-party-backend feature is on). Kept to this one call.
    let status =
        <AnsiTransactionManager as TransactionManager<PgConnection>>::transaction_manager_status_mut(
            conn,
        );
    Ok(status.transaction_depth()?.map_or(0, NonZeroU32::get))
}

/// Diesel's transaction manager.
type Manager = AnsiTransactionManager;

/// The locker is Diesel's [`Driver`]: the one [`LockTx`](crate::LockTx)
/// runs its statements through it, blocking, each future ready when made.
impl Driver for Locker {
    type Io = Blocking;
    type Conn = PgConnection;
    type Answer = Answer;

    /// A blocking call is never cut off in flight.
    fn cut_off(&self, _: &mut PgConnection) {}

    fn run<'a>(
        conn: &'a mut PgConnection,
        stmt: Statement<'a>,
        mode: StatementMode,
    ) -> impl Future<Output = Result<Answer, DriverError>> + Send + 'a {
        ready(run(conn, &stmt, mode).map_err(DriverError::from))
    }

    fn reply(statement: &Statement<'_>, answer: &Answer) -> Reply {
        answer.reply(statement)
    }
}

impl Transactions for Locker {
    fn in_transaction(conn: &mut PgConnection) -> Result<bool, DriverError> {
        Ok(transaction_depth(conn)? > 0)
    }

    fn savepoint(
        conn: &mut PgConnection,
        step: SavepointStep,
    ) -> impl Future<Output = Result<(), DriverError>> + Send + '_ {
        ready(
            match step {
                SavepointStep::Begin => Manager::begin_transaction(conn),
                SavepointStep::Release => Manager::commit_transaction(conn),
                SavepointStep::Rollback => rollback(conn),
            }
            .map_err(DriverError::from),
        )
    }

    /// A closure that panics: the savepoint (or transaction) is rolled back
    /// as the panic unwinds.
    fn savepoint_dropped(conn: &mut PgConnection) -> SavepointEnd {
        match rollback(conn) {
            Ok(()) => SavepointEnd::RolledBack,
            Err(_) => SavepointEnd::Unknown,
        }
    }
}

/// Rolls the innermost savepoint (or the transaction) back.
fn rollback(conn: &mut PgConnection) -> QueryResult<()> {
    <Manager as TransactionManager<PgConnection>>::rollback_transaction(conn)
}

/// Runs one statement.
fn run(conn: &mut PgConnection, stmt: &Statement<'_>, mode: StatementMode) -> QueryResult<Answer> {
    let query = EngineQuery::new(stmt, mode);
    Ok(match stmt.reply() {
        ReplyShape::Done => {
            conn.batch_execute(stmt.text())?;
            Answer::Done
        }
        _ => Answer::Row(query.get_result(conn)?),
    })
}
