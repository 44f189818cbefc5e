//! sqlx as lockkit's [`Driver`]: runs the engine's statements on a sqlx
//! `PgConnection` and ends its savepoints, the only things this adapter
//! does for a lock call.
//!
//! sqlx has no pipelining for statements with parameters: each statement
//! is one round trip, sent in the engine's order, and a round stops at its
//! first error (what a pipeline would answer too). By default
//! (`StatementMode::Unnamed`) each goes in the simple query protocol, its
//! parameters written in as literals; with `StatementMode::Prepared`,
//! through `sqlx::query`, which prepares each once per connection in sqlx's
//! statement cache. The engine checks every reply either way.

use futures_util::TryStreamExt;
use lockkit::driver::{
    read_reply, Async, Driver, DriverError, Param, Reply, ReplyRow, ReplyShape, SavepointEnd,
    SavepointStep, Statement, Transactions,
};
use lockkit::StatementMode;
use smallvec::SmallVec;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArguments, PgRow, PgTransactionManager, PgTypeInfo};
use sqlx::query::Query;
use sqlx::{
    Connection, Decode, Either, Executor, PgConnection, Postgres, Row, TransactionManager,
    TypeInfo, ValueRef,
};

use crate::error::driver_error;
use crate::locker::Locker;

/// What the server answered one statement, the [`Driver::Answer`] of
/// [`Locker`]: its rows (lockkit's statements answer at most one, kept
/// inline), or `None` for a statement sent without rows (the simple query
/// protocol).
pub type Answer = Option<SmallVec<[SqlxRow; 1]>>;

/// A sqlx row, read by the engine ([`ReplyRow`]: the engine knows the
/// column layout of lockkit's replies; this adapter only decodes columns).
#[derive(Debug)]
pub struct SqlxRow(pub(crate) PgRow);

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

/// The locker is sqlx's [`Driver`]: the one [`LockTx`](crate::LockTx)
/// runs its statements through it, kept in sqlx's statement cache (or sent
/// unnamed, as the [`StatementMode`] says).
impl Driver for Locker {
    type Io = Async;
    type Conn = PgConnection;
    type Answer = Answer;

    async fn run<'a>(
        conn: &'a mut PgConnection,
        stmt: Statement<'a>,
        mode: StatementMode,
    ) -> Result<Answer, DriverError> {
        if stmt.reply() == ReplyShape::Done {
            // No parameters: sqlx sends it with the simple query protocol,
            // which the two-statement rollback needs.
            conn.execute(stmt.text()).await.map_err(driver_error)?;
            return Ok(None);
        }
        let mut rows = SmallVec::new();
        if mode == StatementMode::Prepared {
            // sqlx's statement cache keeps it on the connection.
            let mut query = sqlx::query(stmt.text()).persistent(true);
            for param in stmt.params() {
                query = bind(query, param)?;
            }
            // `fetch_many`: `fetch` would wrap it in one more boxed stream.
            let mut stream = conn.fetch_many(query);
            while let Some(step) = stream.try_next().await.map_err(driver_error)? {
                if let Either::Right(row) = step {
                    rows.push(SqlxRow(row));
                }
            }
        } else {
            // The simple query protocol, the parameters written in as
            // literals (integers, integer arrays and booleans only): no
            // statement name, and one round trip, where an unnamed
            // statement costs sqlx two (it parses it in a round trip of its
            // own before binding it).
            let mut text = String::with_capacity(stmt.text().len() + 32);
            stmt.write_simple(&mut text);
            let mut stream = conn.fetch_many(text.as_str());
            while let Some(step) = stream.try_next().await.map_err(driver_error)? {
                if let Either::Right(row) = step {
                    rows.push(SqlxRow(row));
                }
            }
        }
        Ok(Some(rows))
    }

    fn reply(stmt: &Statement<'_>, answer: &Answer) -> Reply {
        read_reply(stmt, answer.as_deref())
    }

    /// sqlx has no cancel request: the server keeps waiting for the lock,
    /// and sqlx's next use of the connection first waits for its reply.
    fn cut_off(&self, _: &mut PgConnection) {}
}

/// How many answers a rollback reads past before its own: sqlx sends one
/// statement at a time, so a cut-off call leaves at most one unread.
const STALE_ANSWERS: usize = 2;

/// Rolls the savepoint (or the transaction) back, past the answer of a
/// statement that was cut off.
///
/// sqlx reads what a cut-off statement left on the connection before it
/// sends anything, and when that answer is an error (a statement timeout,
/// say) it returns it and sends nothing: the `ROLLBACK` never goes out, and
/// the connection would go back to its pool inside an aborted transaction.
/// Each try reads past one stale answer; the transaction depth says whether
/// the rollback itself was sent and answered. When it still was not, it is
/// queued, and sqlx sends it before the connection's next statement.
async fn rollback(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let depth = PgTransactionManager::get_transaction_depth(conn);
    let mut tries = 0;
    loop {
        match PgTransactionManager::rollback(conn).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                let sent = PgTransactionManager::get_transaction_depth(conn) < depth;
                let stale = matches!(e, sqlx::Error::Database(_));
                if sent || !stale || tries == STALE_ANSWERS {
                    if !sent {
                        PgTransactionManager::start_rollback(conn);
                    }
                    return Err(e);
                }
                tries += 1;
            }
        }
    }
}

impl Transactions for Locker {
    fn in_transaction(conn: &mut PgConnection) -> Result<bool, DriverError> {
        Ok(conn.is_in_transaction())
    }

    async fn savepoint(conn: &mut PgConnection, step: SavepointStep) -> Result<(), DriverError> {
        match step {
            SavepointStep::Begin => PgTransactionManager::begin(conn, None).await,
            SavepointStep::Release => PgTransactionManager::commit(conn).await,
            SavepointStep::Rollback => rollback(conn).await,
        }
        .map_err(driver_error)
    }

    /// sqlx rolls the savepoint back before the connection's next use.
    fn savepoint_dropped(conn: &mut PgConnection) -> SavepointEnd {
        PgTransactionManager::start_rollback(conn);
        SavepointEnd::RolledBack
    }
}
