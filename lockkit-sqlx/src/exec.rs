//! Runs the engine's statements on a sqlx `PgConnection`: the only thing
//! this adapter does for a lock call.
//!
//! sqlx has no pipelining for statements with parameters: each statement
//! is one round trip, sent in the engine's order, and a round stops at its
//! first error (what a pipeline would answer too). Statements with
//! parameters go through `sqlx::query`, which prepares each once per
//! connection in sqlx's statement cache; the engine checks every reply
//! either way.

use std::future::Future;

use futures_util::TryStreamExt;
use lockkit::engine::{
    read_reply, Acquisition, DriverError, Grant, Param, Reply, ReplyRow, ReplyShape, Statement,
};
use lockkit::{Busy, Error, StatementMode};
use smallvec::SmallVec;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Executor, PgConnection, Postgres, Row};

use crate::error::driver_error;

/// What the server answered one statement: lockkit's statements answer at
/// most one row, kept inline.
enum Answer {
    Done,
    Rows(SmallVec<[SqlxRow; 1]>),
}

/// A sqlx row, read by the engine ([`ReplyRow`]: the engine knows the
/// column layout of lockkit's replies; this adapter only decodes columns).
pub(crate) struct SqlxRow(pub(crate) PgRow);

impl ReplyRow for SqlxRow {
    type Error = sqlx::Error;
    fn text(&self, i: usize) -> Result<&str, Self::Error> {
        self.0.try_get(i)
    }
    fn int8(&self, i: usize) -> Result<i64, Self::Error> {
        self.0.try_get(i)
    }
    fn int4(&self, i: usize) -> Result<i32, Self::Error> {
        self.0.try_get(i)
    }
    fn bool(&self, i: usize) -> Result<bool, Self::Error> {
        self.0.try_get(i)
    }
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, Self::Error> {
        self.0.try_get(i)
    }
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, Self::Error> {
        self.0.try_get(i)
    }
}

fn bind<'q>(
    query: Query<'q, Postgres, PgArguments>,
    param: &Param<'q>,
) -> Result<Query<'q, Postgres, PgArguments>, DriverError> {
    Ok(match *param {
        Param::Int8(v) => query.bind(v),
        Param::Int4(v) => query.bind(v),
        Param::Int8Array(v) => query.bind(v),
        Param::Int4Array(v) => query.bind(v),
        Param::BoolArray(v) => query.bind(v),
        // A parameter type of a newer lockkit: nothing is sent.
        _ => {
            return Err(DriverError::new(format!(
                "lockkit-sqlx cannot bind the parameter {param:?}"
            )))
        }
    })
}

/// Runs one statement.
async fn run(
    conn: &mut PgConnection,
    stmt: Statement<'_>,
    mode: StatementMode,
) -> Result<Answer, DriverError> {
    if stmt.reply() == ReplyShape::Done {
        // No parameters: sqlx sends it with the simple query protocol,
        // which the two-statement rollback needs.
        conn.execute(stmt.text()).await.map_err(driver_error)?;
        return Ok(Answer::Done);
    }
    // Prepared: sqlx's statement cache keeps it on the connection.
    // Unnamed: parsed every time, for poolers that do not keep named
    // statements.
    let mut query = sqlx::query(stmt.text()).persistent(mode == StatementMode::Prepared);
    for param in stmt.params() {
        query = bind(query, param)?;
    }
    let mut rows = SmallVec::new();
    let mut stream = conn.fetch(query);
    while let Some(row) = stream.try_next().await.map_err(driver_error)? {
        rows.push(SqlxRow(row));
    }
    Ok(Answer::Rows(rows))
}

/// Reads one answer in the shape the statement promises.
fn reply<'r>(stmt: &Statement<'_>, answer: &'r Answer) -> Reply<'r> {
    match answer {
        Answer::Done => read_reply::<SqlxRow>(stmt, None),
        Answer::Rows(rows) => read_reply(stmt, Some(rows)),
    }
}

/// Drives an acquisition to its outcome on `conn`, one statement at a time.
///
/// Dropped while a statement is in flight, the acquisition poisons the
/// transaction (the server may grant what was sent).
///
/// An `async` block rather than an `async fn`: the block keeps what it
/// captures once, where an `async fn` would keep a second copy of the
/// acquisition next to its arguments (rust-lang/rust#62958).
// An `async fn` would double the future (above).
#[allow(clippy::manual_async_fn)]
pub(crate) fn drive<'a>(
    conn: &'a mut PgConnection,
    mode: StatementMode,
    mut call: Acquisition<'a>,
) -> impl Future<Output = Result<Result<Grant, Busy>, Error>> + 'a {
    async move {
        // Most calls are one statement: sent and received without the
        // general rounds, whose larger future is boxed below.
        if let Some(statement) = call.single() {
            let answer = run(&mut *conn, statement, mode).await;
            call.receive_single(answer, reply);
            if call.is_finished() {
                return call.finish();
            }
        }
        Box::pin(drive_rounds(conn, mode, call)).await
    }
}

/// [`drive`]'s general case: round after round.
async fn drive_rounds(
    conn: &mut PgConnection,
    mode: StatementMode,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        // One at a time, stopping at the first error.
        let (mut answers, mut failed) = (SmallVec::<[Answer; 1]>::new(), None);
        for stmt in round.iter().copied() {
            match run(&mut *conn, stmt, mode).await {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        call.receive_answers(failed.map_or(Ok(answers), Err), reply);
    }
    call.finish()
}
