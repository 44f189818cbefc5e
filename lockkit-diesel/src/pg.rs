//! Runs the engine's statements through Diesel, and Diesel's transaction
//! state: the only things this adapter does.

use std::num::NonZeroU32;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::sql_types::{Array, Text};
use diesel::{sql_query, PgConnection, QueryResult, RunQueryDsl};
use lockkit::engine::{
    sql, Acquisition, DriverError, FactsRow, Grant, ReplyShape, Statement, HASHTEXT_PROBES,
};
use lockkit::for_diesel::{Answer, EngineQuery, FactsColumns, MessagesRow, MESSAGES};
use lockkit::{Busy, Error, StatementMode};

/// The server facts, learned with [`sql::SERVER_FACTS`].
pub(crate) fn server_facts(conn: &mut PgConnection) -> QueryResult<FactsRow> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row: FactsColumns = sql_query(sql::SERVER_FACTS)
        .bind::<Array<Text>, _>(probes)
        .get_result(conn)?;
    Ok(row.into())
}

/// The server's `lc_messages` ([`MESSAGES`]).
pub(crate) fn messages(conn: &mut PgConnection) -> QueryResult<MessagesRow> {
    sql_query(MESSAGES).get_result(conn)
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

/// Opens a transaction (depth 0) or a savepoint, as `conn.transaction` does.
pub(crate) fn begin(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::begin_transaction(conn)
}

/// Commits the innermost transaction or savepoint, as `conn.transaction` does.
pub(crate) fn commit(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::commit_transaction(conn)
}

/// Rolls back the innermost transaction or savepoint, as `conn.transaction`
/// does.
pub(crate) fn rollback(conn: &mut PgConnection) -> QueryResult<()> {
    <AnsiTransactionManager as TransactionManager<PgConnection>>::rollback_transaction(conn)
}

/// Runs one statement (Diesel cannot pipeline: one round trip each), as
/// `mode` says: through Diesel's statement cache, or unnamed.
pub(crate) fn run(
    conn: &mut PgConnection,
    stmt: &Statement<'_>,
    mode: StatementMode,
) -> QueryResult<Answer> {
    let query = EngineQuery::new(stmt, mode);
    Ok(match stmt.reply() {
        ReplyShape::Done => {
            conn.batch_execute(stmt.text())?;
            Answer::Done
        }
        ReplyShape::Locked => Answer::Locked(query.get_result(conn)?),
        ReplyShape::TriedBigint => Answer::TriedBigint(query.get_result(conn)?),
        ReplyShape::TriedPair => Answer::TriedPair(query.get_result(conn)?),
        _ => Answer::Tagged(query.get_result(conn)?),
    })
}

/// Drives an acquisition to its outcome on `conn`, one statement at a time,
/// stopping a round at its first error.
pub(crate) fn drive(
    conn: &mut PgConnection,
    mode: StatementMode,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        // One at a time; `collect` stops at the first error.
        let answers: QueryResult<Vec<Answer>> =
            round.iter().map(|stmt| run(conn, stmt, mode)).collect();
        call.receive_answers(answers.map_err(DriverError::from), |_, a| a.reply());
    }
    call.finish()
}
