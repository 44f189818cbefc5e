//! Runs the engine's statements through Diesel, and Diesel's transaction
//! state: the only things this adapter does.

use std::num::NonZeroU32;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::pg::Pg;
use diesel::query_builder::BoxedSqlQuery;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text};
use diesel::{sql_query, PgConnection, QueryResult, QueryableByName, RunQueryDsl};
use lockkit::engine::{
    sql, Acquisition, DriverError, FactsRow, Grant, Param, Reply, ReplyShape, Statement,
    HASHTEXT_PROBES,
};
use lockkit::{Busy, Error};

#[derive(QueryableByName)]
struct FactsColumns {
    #[diesel(sql_type = Integer)]
    max_locks: i32,
    #[diesel(sql_type = Integer)]
    max_connections: i32,
    #[diesel(sql_type = Bool)]
    in_recovery: bool,
    #[diesel(sql_type = Integer)]
    version_num: i32,
    #[diesel(sql_type = Array<Integer>)]
    hashes: Vec<i32>,
    #[diesel(sql_type = Integer)]
    backend_pid: i32,
}

#[derive(QueryableByName)]
struct MessagesRow {
    #[diesel(sql_type = Text)]
    lc_messages: String,
}

#[derive(QueryableByName)]
struct Tagged {
    #[diesel(sql_type = Text)]
    tag: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct TriedBigint {
    #[diesel(sql_type = Text)]
    tag: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Array<BigInt>)]
    busy: Vec<i64>,
}

#[derive(QueryableByName)]
struct TriedPair {
    #[diesel(sql_type = Text)]
    tag: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Array<Integer>)]
    busy_class: Vec<i32>,
    #[diesel(sql_type = Array<Integer>)]
    busy_object: Vec<i32>,
}

/// The server facts, learned with [`sql::SERVER_FACTS`].
pub(crate) fn server_facts(conn: &mut PgConnection) -> QueryResult<FactsRow> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row: FactsColumns = sql_query(sql::SERVER_FACTS)
        .bind::<Array<Text>, _>(probes)
        .get_result(conn)?;
    Ok(FactsRow {
        max_locks: row.max_locks,
        max_connections: row.max_connections,
        in_recovery: row.in_recovery,
        version_num: row.version_num,
        hashes: row.hashes,
        backend_pid: row.backend_pid,
    })
}

/// Whether the server reports errors in English, which the error mapping
/// needs (Diesel hides the SQLSTATE).
pub(crate) fn english_messages(conn: &mut PgConnection) -> QueryResult<bool> {
    let row: MessagesRow =
        sql_query("SELECT current_setting('lc_messages') AS lc_messages").get_result(conn)?;
    let lc = row.lc_messages.to_ascii_lowercase();
    Ok(lc.is_empty() || lc == "c" || lc == "posix" || lc.starts_with("c.") || lc.starts_with("en"))
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

fn bind<'a>(
    query: BoxedSqlQuery<'a, Pg, diesel::query_builder::SqlQuery>,
    param: &Param<'a>,
) -> BoxedSqlQuery<'a, Pg, diesel::query_builder::SqlQuery> {
    match *param {
        Param::Int8(v) => query.bind::<BigInt, _>(v),
        Param::Int4(v) => query.bind::<Integer, _>(v),
        Param::Int8Array(v) => query.bind::<Array<BigInt>, _>(v),
        Param::Int4Array(v) => query.bind::<Array<Integer>, _>(v),
        Param::BoolArray(v) => query.bind::<Array<Bool>, _>(v),
        _ => unreachable!("lockkit's statements bind no other type"),
    }
}

/// What the server answered one statement, owned.
enum Answer {
    Done,
    Tagged(Tagged),
    TriedBigint(TriedBigint),
    TriedPair(TriedPair),
}

/// Runs one statement (Diesel cannot pipeline: one round trip each).
fn run(conn: &mut PgConnection, stmt: &Statement<'_>) -> QueryResult<Answer> {
    if stmt.reply() == ReplyShape::Done {
        conn.batch_execute(stmt.text())?;
        return Ok(Answer::Done);
    }
    let query = stmt
        .params()
        .iter()
        .fold(sql_query(stmt.text()).into_boxed(), |q, p| bind(q, p));
    Ok(match stmt.reply() {
        ReplyShape::TriedBigint => Answer::TriedBigint(query.get_result(conn)?),
        ReplyShape::TriedPair => Answer::TriedPair(query.get_result(conn)?),
        _ => Answer::Tagged(query.get_result(conn)?),
    })
}

fn reply(answer: &Answer) -> Reply<'_> {
    match answer {
        Answer::Done => Reply::Done,
        Answer::Tagged(r) => Reply::Tagged {
            tag: &r.tag,
            n: r.n,
        },
        Answer::TriedBigint(r) => Reply::TriedBigint {
            tag: &r.tag,
            n: r.n,
            busy: r.busy.clone(),
        },
        Answer::TriedPair(r) => Reply::TriedPair {
            tag: &r.tag,
            n: r.n,
            classes: r.busy_class.clone(),
            objects: r.busy_object.clone(),
        },
    }
}

/// Drives an acquisition to its outcome on `conn`, one statement at a time,
/// stopping a round at its first error.
pub(crate) fn drive(
    conn: &mut PgConnection,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        let mut answers = Vec::with_capacity(round.len());
        let mut failure = None;
        for stmt in &round {
            match run(conn, stmt) {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        drop(round);
        match failure {
            None => call.receive(Ok(answers.iter().map(reply).collect())),
            Some(e) => call.receive(Err(DriverError::from(e))),
        }
    }
    call.finish()
}
