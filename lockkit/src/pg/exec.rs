//! tokio-postgres's [`Driver`]: runs the engine's statements on a
//! tokio-postgres connection, each round pipelined, with lockkit's
//! statements unnamed (the default) or prepared once per connection. The only thing
//! this adapter does for a lock call: the engine and the driver module's
//! `run_one` and `drive` do the rest, as on every stack.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::{join, join_all, try_join_all};
use futures_util::TryStreamExt;
use smallvec::SmallVec;
use tokio::sync::OnceCell;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, RowStream, SimpleQueryMessage};

use crate::driver::{Async, CancellingPolicy, Driver};
use crate::engine::config::StatementMode;
use crate::engine::{
    read_reply, DriverError, Param, ParamType, Policy, Reply, ReplyRow, ReplyShape, Sql, Statement,
};
use crate::pg::text_row::SimpleRow;

/// lockkit's statements prepared on one connection, prepared all at once
/// the first time a lock call needs them.
#[derive(Debug, Default)]
pub(crate) struct StatementCache {
    statements: OnceCell<Vec<tokio_postgres::Statement>>,
}

impl StatementCache {
    /// The statements, when they are prepared.
    fn ready(&self) -> Option<&[tokio_postgres::Statement]> {
        self.statements.get().map(Vec::as_slice)
    }

    /// Prepares every statement on `client`: the `Parse` messages go out on
    /// the first poll, so whatever is polled after this future follows them.
    async fn prepare(&self, client: &Client) -> Result<(), tokio_postgres::Error> {
        let types: Vec<Vec<Type>> = Sql::PREPARABLE
            .iter()
            .map(|sql| sql.param_types().iter().map(|t| pg_type(*t)).collect())
            .collect();
        let statements = try_join_all(
            Sql::PREPARABLE
                .iter()
                .zip(&types)
                .map(|(sql, types)| client.prepare_typed(sql.text(), types)),
        )
        .await?;
        // Two calls racing to prepare: the first one's statements stay.
        let _ = self.statements.set(statements);
        Ok(())
    }
}

fn cached(
    statements: &[tokio_postgres::Statement],
    sql: Sql,
) -> Option<&tokio_postgres::Statement> {
    Sql::PREPARABLE
        .iter()
        .position(|s| *s == sql)
        .map(|i| &statements[i])
}

fn pg_type(t: ParamType) -> Type {
    match t {
        ParamType::Int8 => Type::INT8,
        ParamType::Int4 => Type::INT4,
        ParamType::Int8Array => Type::INT8_ARRAY,
        ParamType::Int4Array => Type::INT4_ARRAY,
        ParamType::BoolArray => Type::BOOL_ARRAY,
    }
}

fn pg_value<'p>(p: &'p Param<'_>) -> &'p (dyn ToSql + Sync) {
    match p {
        Param::Int8(v) => v,
        Param::Int4(v) => v,
        Param::Int8Array(v) => v,
        Param::Int4Array(v) => v,
        Param::BoolArray(v) => v,
    }
}

/// What the server answered one statement: lockkit's statements answer at
/// most one row, kept inline.
pub(crate) enum Answer {
    Done,
    /// The rows of a prepared statement.
    Rows(SmallVec<[Row; 1]>),
    /// The rows of a statement sent in the simple query protocol.
    Text(SmallVec<[SimpleRow; 1]>),
}

/// The answers of a round, inline for the common one-statement round.
type Answers = SmallVec<[Answer; 1]>;

/// Sends one round on `client`, all statements on the first poll (so they
/// are pipelined, in order), and returns an answer per statement or the
/// first error in statement order.
async fn send_round(
    client: &Client,
    cache: Option<&StatementCache>,
    round: &[Statement<'_>],
) -> Result<Answers, tokio_postgres::Error> {
    // Every statement of the round is sent on the first poll, in order, so
    // that a statement the caller pipelines behind the lock call runs after
    // the locks. The first time, the statements are not prepared yet: the
    // `Parse` messages go first, the round itself goes unnamed right behind
    // them, and the prepared statements serve the next rounds.
    let prepared = cache.and_then(StatementCache::ready);
    match (cache.filter(|c| c.ready().is_none()), round) {
        // The common case, one statement already prepared: no join.
        (None, [stmt]) => Ok(smallvec::smallvec![send(client, prepared, stmt).await?]),
        (None, _) => join_all(round.iter().map(|stmt| send(client, prepared, stmt)))
            .await
            .into_iter()
            .collect(),
        (Some(cache), _) => {
            let answers = join_all(round.iter().map(|stmt| send(client, None, stmt)));
            let (prepared, answers) = preparing(client, cache, answers).await;
            the_cause(prepared, answers.into_iter().collect())
        }
    }
}

/// Runs `unnamed` (statements sent unnamed) right behind the `Parse`
/// messages of lockkit's statements, which the first lock call on a
/// connection sends; the prepared statements serve the next calls. Answers
/// how the preparation went, and `unnamed`'s output.
async fn preparing<T>(
    client: &Client,
    cache: &StatementCache,
    unnamed: impl Future<Output = T>,
) -> (Result<(), tokio_postgres::Error>, T) {
    let (prepared, out) = join(cache.prepare(client), unnamed).await;
    if let Err(e) = &prepared {
        // Unnamed statements served this call; the next one tries again.
        tracing::debug!(error = %e, "lockkit: could not prepare lockkit's statements");
    }
    (prepared, out)
}

/// The answer of statements sent behind the preparation, with the cause of
/// their failure: a `Parse` the server refused (a statement name another
/// client left on the server connection, `42P05`) aborts the transaction,
/// and the statements behind it fail with `25P02`, which says nothing of
/// why.
fn the_cause<T>(
    prepared: Result<(), tokio_postgres::Error>,
    answer: Result<T, tokio_postgres::Error>,
) -> Result<T, tokio_postgres::Error> {
    match (prepared, answer) {
        (Err(cause), Err(_)) if cause.as_db_error().is_some() => Err(cause),
        (_, answer) => answer,
    }
}

/// Sends one statement: prepared when `prepared` has it; else in the simple
/// query protocol, its parameters written in as literals
/// ([`Statement::write_simple`]): no statement name, one message, one round
/// trip, and no portal left open behind it. lockkit's parameters are
/// integers, integer arrays and booleans only, so nothing of the caller's
/// reaches the text.
async fn send(
    client: &Client,
    prepared: Option<&[tokio_postgres::Statement]>,
    stmt: &Statement<'_>,
) -> Result<Answer, tokio_postgres::Error> {
    if stmt.reply() == ReplyShape::Done {
        return client
            .batch_execute(stmt.text())
            .await
            .map(|()| Answer::Done);
    }
    // At most three parameters: no allocation for them.
    const UNUSED: &(dyn ToSql + Sync) = &0i64;
    let params = stmt.params();
    let mut values = [UNUSED; 3];
    for (value, param) in values.iter_mut().zip(params) {
        *value = pg_value(param);
    }
    let values = &values[..params.len()];
    // A minting form is another text: no prepared statement serves it.
    let prepared = prepared.filter(|_| !stmt.is_minting());
    match prepared.and_then(|p| cached(p, stmt.sql())) {
        Some(statement) => {
            let stream = client.query_raw(statement, values.iter().copied()).await?;
            Ok(Answer::Rows(collect(stream).await?))
        }
        None => {
            let mut text = String::with_capacity(stmt.text().len() + 32);
            stmt.write_simple(&mut text);
            Ok(Answer::Text(simple_rows(client, &text).await?))
        }
    }
}

/// The rows of one simple-protocol query.
async fn simple_rows(
    client: &Client,
    query: &str,
) -> Result<SmallVec<[SimpleRow; 1]>, tokio_postgres::Error> {
    let mut stream = std::pin::pin!(client.simple_query_raw(query).await?);
    let mut rows = SmallVec::new();
    while let Some(message) = stream.try_next().await? {
        if let SimpleQueryMessage::Row(row) = message {
            rows.push(SimpleRow(row));
        }
    }
    Ok(rows)
}

/// Every row of `stream`, inline when there is one.
async fn collect(stream: RowStream) -> Result<SmallVec<[Row; 1]>, tokio_postgres::Error> {
    let mut stream = std::pin::pin!(stream);
    let mut rows = SmallVec::new();
    while let Some(row) = stream.try_next().await? {
        rows.push(row);
    }
    Ok(rows)
}

impl ReplyRow for Row {
    type Error = tokio_postgres::Error;
    fn int8(&self, i: usize) -> Result<i64, Self::Error> {
        self.try_get(i)
    }
    fn int4(&self, i: usize) -> Result<i32, Self::Error> {
        self.try_get(i)
    }
    fn bool(&self, i: usize) -> Result<bool, Self::Error> {
        self.try_get(i)
    }
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, Self::Error> {
        self.try_get(i)
    }
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, Self::Error> {
        self.try_get(i)
    }
}

/// Reads one answer in the shape the statement promises.
pub(crate) fn reply(stmt: &Statement<'_>, answer: &Answer) -> Reply {
    match answer {
        Answer::Done => read_reply::<Row>(stmt, None),
        Answer::Rows(rows) => read_reply(stmt, Some(rows)),
        Answer::Text(rows) => read_reply(stmt, Some(rows)),
    }
}

/// Whether tokio-postgres could not read the reply as this statement's: a
/// row not in the prepared statement's shape (the statement of that name on
/// the server is not the one prepared: a foreign statement behind a
/// pooler), or a message that does not fit the reply at all (another
/// client's reply, routed here by a pooler). Either way the reply is not
/// lockkit's. tokio-postgres does not expose its error kinds; its `Parse`
/// error keeps the `io::Error` that names the mismatch.
fn foreign_row(e: &tokio_postgres::Error) -> bool {
    let wrong_shape = e.as_db_error().is_none()
        && !e.is_closed()
        && std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| {
                io.kind() == std::io::ErrorKind::InvalidData
                    && io.to_string().starts_with("DataRow field count")
            });
    wrong_shape || crate::pg::error::unexpected_message(e)
}

/// tokio-postgres as a [`Driver`]: the engine's statements on the
/// connection of a tokio-postgres [`LockTx`](crate::LockTx), through the
/// same [`run_one`](crate::driver::run_one) and
/// [`drive`](crate::driver::drive) as every adapter's.
///
/// Made per call from the transaction's parts, by value: the tokio-postgres
/// face takes `&self` (its calls pipeline with the transaction's next
/// statement), and a [`Client`] runs statements through `&self`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pg<'c>(&'c CancellingPolicy);

impl<'c> Pg<'c> {
    pub(crate) fn new(locker: &'c CancellingPolicy) -> Self {
        Pg(locker)
    }
}

impl AsRef<Policy> for Pg<'_> {
    fn as_ref(&self) -> &Policy {
        self.0.policy()
    }
}

/// A tokio-postgres transaction's connection, as its lock calls use it.
#[derive(Debug)]
pub(crate) struct PgConn<'c> {
    pub(crate) client: &'c Client,
    /// lockkit's statements prepared on the connection, unless its
    /// statements are unnamed.
    pub(crate) cache: Option<&'c StatementCache>,
    /// Set when a call cut off in flight sent a cancel request: the
    /// transaction's rollback keeps cancelling until it is answered.
    pub(crate) cancelled: &'c AtomicBool,
}

impl<'c> Driver for Pg<'c> {
    type Io = Async;
    type Conn = PgConn<'c>;
    type Answer = Answer;

    /// The statement, prepared when lockkit's statements are (the
    /// connection's first lock call prepares them, boxed, so that every
    /// later call's future stays small), else unnamed.
    async fn run<'a>(
        conn: &'a mut PgConn<'c>,
        statement: Statement<'a>,
        _: StatementMode,
    ) -> Result<Answer, DriverError> {
        let (client, cache) = (conn.client, conn.cache);
        let answer = match cache.filter(|c| c.ready().is_none()) {
            None => send(client, cache.and_then(StatementCache::ready), &statement).await,
            Some(cache) => {
                let (prepared, answer) =
                    Box::pin(preparing(client, cache, send(client, None, &statement))).await;
                the_cause(prepared, answer)
            }
        };
        answer.map_err(driver_error)
    }

    /// Every statement of the round pipelined, sent on the first poll. A
    /// round that fails answers its error alone, without the answers of
    /// the statements before it: `drive` reads a failed round by its error.
    async fn run_round<'a>(
        conn: &'a mut PgConn<'c>,
        round: &'a [Statement<'a>],
        _: StatementMode,
    ) -> (Vec<Answer>, Option<DriverError>) {
        match send_round(conn.client, conn.cache, round).await {
            Ok(answers) => (answers.into_vec(), None),
            Err(e) => (Vec::new(), Some(driver_error(e))),
        }
    }

    fn reply(statement: &Statement<'_>, answer: &Answer) -> Reply {
        reply(statement, answer)
    }

    /// Records the cut-off for the transaction's rollback and cancels what
    /// is in flight until the server answers
    /// ([`Canceller`](crate::driver::Canceller)'s `cancel_until_answered`):
    /// a dropped lock call must not leave the server waiting for its lock.
    fn cut_off(&self, conn: &mut PgConn<'c>) {
        conn.cancelled.store(true, Ordering::SeqCst);
        self.0.canceller().cancel_until_answered(conn.client);
    }
}

/// The engine's error for one of tokio-postgres's.
fn driver_error(e: tokio_postgres::Error) -> DriverError {
    let foreign = foreign_row(&e);
    DriverError::from(e).foreign_reply(foreign)
}
