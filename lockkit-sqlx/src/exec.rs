//! Runs the engine's statements on a sqlx `PgConnection`: the only thing
//! this adapter does for a lock call.
//!
//! sqlx has no pipelining for statements with parameters: each statement
//! is one round trip, sent in the engine's order, and a round stops at its
//! first error (what a pipeline would answer too). Statements with
//! parameters go through `sqlx::query`, which prepares each once per
//! connection in sqlx's statement cache; the engine checks every reply
//! either way.

use futures_util::TryStreamExt;
use lockkit::engine::{
    read_reply, Acquisition, DriverError, Grant, Param, Reply, ReplyRow, ReplyShape, Statement,
};
use lockkit::{Busy, Error, StatementMode};
use smallvec::SmallVec;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArguments, PgRow, PgTypeInfo};
use sqlx::query::Query;
use sqlx::{Decode, Either, Executor, PgConnection, Postgres, Row, TypeInfo, ValueRef};

use crate::error::driver_error;

/// What the server answered one statement: lockkit's statements answer at
/// most one row, kept inline.
pub(crate) enum Answer {
    Done,
    Rows(SmallVec<[SqlxRow; 1]>),
}

/// A sqlx row, read by the engine ([`ReplyRow`]: the engine knows the
/// column layout of lockkit's replies; this adapter only decodes columns).
pub(crate) struct SqlxRow(pub(crate) PgRow);

impl SqlxRow {
    /// Column `i` decoded as `T`, when the server typed it `ty`: the type
    /// lockkit's statement gives that column, checked by its OID (sqlx's
    /// `try_get` accepts any of a Rust type's compatible types, at many
    /// times the cost, for every reply of every lock call).
    fn column<'r, T: Decode<'r, Postgres>>(&'r self, i: usize, ty: Oid) -> Result<T, sqlx::Error> {
        let value = self.0.try_get_raw(i)?;
        let decode_error = |source| sqlx::Error::ColumnDecode {
            index: i.to_string(),
            source,
        };
        if !value.is_null() && value.type_info().oid() != Some(ty) {
            let expected = PgTypeInfo::with_oid(ty);
            let found = value.type_info();
            return Err(decode_error(
                format!("a column of type {}, not {}", found.name(), expected.name()).into(),
            ));
        }
        T::decode(value).map_err(decode_error)
    }
}

// The OIDs of the types of lockkit's reply columns (`pg_type.dat`).
const BOOL: Oid = Oid(16);
const INT8: Oid = Oid(20);
const INT4: Oid = Oid(23);
const INT4_ARRAY: Oid = Oid(1007);
const INT8_ARRAY: Oid = Oid(1016);

impl ReplyRow for SqlxRow {
    type Error = sqlx::Error;
    fn int8(&self, i: usize) -> Result<i64, Self::Error> {
        self.column(i, INT8)
    }
    fn int4(&self, i: usize) -> Result<i32, Self::Error> {
        self.column(i, INT4)
    }
    fn bool(&self, i: usize) -> Result<bool, Self::Error> {
        self.column(i, BOOL)
    }
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, Self::Error> {
        self.column(i, INT8_ARRAY)
    }
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, Self::Error> {
        self.column(i, INT4_ARRAY)
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
pub(crate) async fn run(
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
    // `fetch_many`: `fetch` would wrap it in one more boxed stream.
    let mut rows = SmallVec::new();
    let mut stream = conn.fetch_many(query);
    while let Some(step) = stream.try_next().await.map_err(driver_error)? {
        if let Either::Right(row) = step {
            rows.push(SqlxRow(row));
        }
    }
    Ok(Answer::Rows(rows))
}

/// Reads one answer in the shape the statement promises.
pub(crate) fn reply(stmt: &Statement<'_>, answer: &Answer) -> Reply {
    match answer {
        Answer::Done => read_reply::<SqlxRow>(stmt, None),
        Answer::Rows(rows) => read_reply(stmt, Some(rows)),
    }
}

/// Drives an acquisition to its outcome on `conn`, round after round, one
/// statement at a time.
///
/// Dropped while a statement is in flight, the acquisition poisons the
/// transaction (the server may grant what was sent).
pub(crate) async fn drive(
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
