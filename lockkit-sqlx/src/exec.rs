//! Runs the engine's statements on a sqlx `PgConnection`: the only thing
//! this adapter does for a lock call.
//!
//! sqlx has no pipelining for statements with parameters: each statement
//! is one round trip, sent in the engine's order, and a round stops at its
//! first error (what a pipeline would answer too). Statements with
//! parameters go through `sqlx::query`, which prepares each once per
//! connection in sqlx's statement cache; the engine checks every reply
//! either way.

use lockkit::engine::{Acquisition, DriverError, Grant, Param, Reply, ReplyShape, Statement};
use lockkit::{Busy, Error};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Executor, PgConnection, Postgres, Row};

use crate::error::driver_error;
use crate::locker::BoxFuture;

/// What the server answered one statement.
enum Answer {
    Done,
    Rows(Vec<PgRow>),
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

/// Runs one statement (boxed `Send` with one lifetime: see [`drive`]).
fn run<'a>(
    conn: &'a mut PgConnection,
    stmt: Statement<'a>,
) -> BoxFuture<'a, Result<Answer, DriverError>> {
    Box::pin(async move {
        if stmt.reply() == ReplyShape::Done {
            // No parameters: sqlx sends it with the simple query protocol,
            // which the two-statement rollback needs.
            conn.execute(stmt.text()).await.map_err(driver_error)?;
            return Ok(Answer::Done);
        }
        let mut query = sqlx::query(stmt.text());
        for param in stmt.params() {
            query = bind(query, param)?;
        }
        let rows = conn.fetch_all(query).await.map_err(driver_error)?;
        Ok(Answer::Rows(rows))
    })
}

/// Reads one answer in the shape the statement promises.
fn reply<'r>(stmt: &Statement<'_>, answer: &'r Answer) -> Reply<'r> {
    let rows = match (stmt.reply(), answer) {
        (ReplyShape::Done, Answer::Done) => return Reply::Done,
        (_, Answer::Rows(rows)) => rows,
        (_, Answer::Done) => return Reply::Malformed("no rows".into()),
    };
    let [row] = &rows[..] else {
        return Reply::Malformed(format!("{} rows", rows.len()));
    };
    let read = || -> Result<Reply<'r>, sqlx::Error> {
        Ok(match stmt.reply() {
            ReplyShape::Tagged => Reply::Tagged {
                tag: row.try_get(0)?,
                n: row.try_get(1)?,
            },
            ReplyShape::TriedBigint => Reply::TriedBigint {
                tag: row.try_get(0)?,
                n: row.try_get(1)?,
                busy: row.try_get(2)?,
            },
            ReplyShape::TriedPair => Reply::TriedPair {
                tag: row.try_get(0)?,
                n: row.try_get(1)?,
                classes: row.try_get(2)?,
                objects: row.try_get(3)?,
            },
            _ => Reply::Malformed("a row".into()),
        })
    };
    read().unwrap_or_else(|e| Reply::Malformed(e.to_string()))
}

/// Drives an acquisition to its outcome on `conn`, one statement at a time.
///
/// Dropped while a statement is in flight, the acquisition poisons the
/// transaction (the server may grant what was sent).
///
/// Boxed as a `Send` future here, where its lifetimes are concrete: left to
/// inference inside the callers' `async fn`s, rustc cannot prove the
/// borrows it holds across `.await` `Send` for every lifetime, and the lock
/// futures could not be spawned.
pub(crate) fn drive<'a>(
    conn: &'a mut PgConnection,
    call: Acquisition<'a>,
) -> BoxFuture<'a, Result<Result<Grant, Busy>, Error>> {
    Box::pin(drive_inner(conn, call))
}

async fn drive_inner(
    conn: &mut PgConnection,
    mut call: Acquisition<'_>,
) -> Result<Result<Grant, Busy>, Error> {
    while let Some(round) = call.round() {
        let mut answers = Vec::with_capacity(round.len());
        let mut failure = None;
        for stmt in round.iter().copied() {
            match run(&mut *conn, stmt).await {
                Ok(answer) => answers.push(answer),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        match failure {
            None => {
                let replies: Vec<Reply<'_>> = round
                    .iter()
                    .zip(&answers)
                    .map(|(s, a)| reply(s, a))
                    .collect();
                drop(round);
                call.receive(Ok(replies));
            }
            Some(e) => {
                drop(round);
                call.receive(Err(e));
            }
        }
    }
    call.finish()
}
