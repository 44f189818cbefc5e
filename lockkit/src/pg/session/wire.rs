//! What every form sends and reads on a lock's connection, below them all:
//! the lock's `application_name`, a one-key statement and the rows it
//! answers, a simple-protocol query and the rows of each of its commands
//! ([`simple_round`], [`Completed`]), the check whether a backend holds a
//! key, and the bounds on every wait for the server ([`within`],
//! [`within_cadence`], [`within_take`]).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures_util::future::join;
use futures_util::StreamExt;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, SimpleQueryMessage};

use crate::engine::error::{Error, ErrorKind};
use crate::engine::sql::HOLDS;
use crate::fencing::FencingToken;
use crate::key::LockKey;
use crate::pg::text_row::SimpleRow;

/// The `application_name` of a lock's connection,
/// `lockkit session lock <namespace> <key>` (the key type's namespace
/// first, so that the server's cut at 63 bytes takes the key, which
/// `pg_locks` shows anyway; `lockkit inspect` reads the namespace back):
/// formatted where it is written, never allocated on a pooled lease's path.
#[derive(Clone, Copy)]
pub(super) struct AppName(pub(super) &'static str, pub(super) LockKey);

impl fmt::Display for AppName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lockkit session lock {} {}", self.0, self.1)
    }
}

/// Runs a one-key statement with unnamed statements only, which
/// transaction-mode poolers without prepared-statement support accept.
pub(super) async fn key_query(
    client: &Client,
    sql: &str,
    key: LockKey,
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match key {
        LockKey::BigInt(v) => client.query_typed(sql, &[(&v, Type::INT8)]).await,
        LockKey::Pair(class, object) => {
            let params: [(&(dyn ToSql + Sync), Type); 2] =
                [(&class, Type::INT4), (&object, Type::INT4)];
            client.query_typed(sql, &params).await
        }
    }
}

/// Exactly one row, or an error naming `what`.
pub(super) fn one_row<T>(rows: &[T], what: &str) -> Result<(), Error> {
    if rows.len() == 1 {
        Ok(())
    } else {
        Err(Error::unexpected(format!(
            "{what} returned {} rows, not one",
            rows.len()
        )))
    }
}

/// Exactly one row whose first column is a non-null `bool`.
pub(super) fn one_bool(rows: &[Row]) -> Result<bool, Error> {
    one_row(rows, "the lock statement")?;
    match rows[0].try_get::<_, Option<bool>>(0)? {
        Some(answer) => Ok(answer),
        None => Err(Error::unexpected(
            "the lock statement returned NULL, not a bool".into(),
        )),
    }
}

/// The one row of a minting lock statement
/// ([`sql::session_lock_minting`](crate::engine::sql::session_lock_minting)):
/// whether the key was granted, and the token minted with it, which comes
/// exactly when it was.
pub(super) fn granted_with_token(rows: &[Row]) -> Result<Option<FencingToken>, Error> {
    one_row(rows, "the lock statement")?;
    let row = &rows[0];
    let granted: Option<bool> = row.try_get(0)?;
    let parts: [Option<&str>; 3] = [row.try_get(1)?, row.try_get(2)?, row.try_get(3)?];
    match (granted, parts) {
        (Some(false), [None, None, None]) => Ok(None),
        (Some(true), [Some(walfile), Some(flush), Some(counter)]) => {
            FencingToken::from_server(walfile, flush, counter)
                .map(Some)
                .map_err(|e| Error::unexpected(format!("the lock statement's token: {e}")))
        }
        (granted, parts) => Err(Error::unexpected(format!(
            "the lock statement answered granted {granted:?} with token parts {parts:?}"
        ))),
    }
}

/// Whether the lock's backend holds `key`, then the connection's
/// `keepalive`, which drops the check's portal (and snapshot), within one
/// cadence; a lost connection, or no answer in time, answers `false`.
pub(super) async fn holds_now(
    client: &Client,
    key: LockKey,
    cadence: Duration,
    keepalive: &str,
) -> Result<bool, Error> {
    let answer = within_cadence(cadence, async {
        let (held, closed) = join(holds(client, key), client.batch_execute(keepalive)).await;
        held.and_then(|held| closed.map(|()| held).map_err(Error::from))
    })
    .await;
    match answer {
        Err(e) if e.is_connection_lost() => Ok(false),
        result => result,
    }
}

/// Whether the backend of `client` holds `key` (granted, in `pg_locks`).
async fn holds(client: &Client, key: LockKey) -> Result<bool, Error> {
    let id = key.to_pg_locks();
    let (classid, objid) = (i64::from(id.classid), i64::from(id.objid));
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&classid, Type::INT8),
        (&objid, Type::INT8),
        (&id.objsubid, Type::INT2),
    ];
    let rows = client.query_typed(HOLDS, &params).await?;
    one_bool(&rows)
}

/// Runs `work`, statements on a held lock's connection, for at most one
/// keepalive cadence: the one bound on every wait for the server while a
/// lock is held (keepalive, check, release, the rollback of a dropped
/// guard). A path gone silent thus never holds the connection (and its
/// mutex) longer than a cadence, and
/// [`SessionGuard::lost`](super::SessionGuard::lost) resolves within two
/// cadences of the silence: the next keepalive starts within one (after
/// whatever holds the connection), and waits at most one.
pub(super) async fn within_cadence<T>(
    cadence: Duration,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    within(cadence, GIVEN_UP, work).await
}

/// What [`within_cadence`]'s error says became of the lock.
const GIVEN_UP: &str =
    "one keepalive cadence: the session lock is given up and its connection closed";

/// What the error of a take's [`within`] says: its caller closes the
/// connection (a pooled one is detached), so nothing taken on it stays held.
pub(super) const NOTHING_HELD: &str = "its bound: the connection is closed and nothing is held";

/// Runs `work`, a take's statements once its connection is open, for at
/// most `bound`: past it the take fails with [`ErrorKind::Timeout`] and its
/// caller closes the connection (a pooled one is detached), so nothing is
/// held. A server that does not answer cannot be told from a pooler that
/// is alive and waiting for a free server connection (a transaction-mode
/// pgbouncer whose pool is pinned by held locks): either way the lock was
/// not granted in time, which is what a timeout says, and a caller that
/// tries again is right to.
pub(super) async fn within_take<T>(
    bound: Duration,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    bounded(bound, work, || {
        Error::with_message(
            ErrorKind::Timeout,
            format!(
                "no answer within {bound:?} (the server, or a pooler in front of it waiting for a \
                 free server connection): the lock was not granted, its connection is closed \
                 and nothing is held"
            ),
        )
    })
    .await
}

/// Runs `work`, statements on a session lock's connection, for at most
/// `bound`: past it the path is taken for silent, and the call fails with
/// [`ErrorKind::ConnectionLost`], its message saying `then`, what becomes
/// of the lock and the connection (which the caller does).
pub(super) async fn within<T>(
    bound: Duration,
    then: &str,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    bounded(bound, work, || {
        Error::with_message(
            ErrorKind::ConnectionLost,
            format!("the server did not answer within {bound:?}, {then}"),
        )
    })
    .await
}

/// `work`'s answer, or `elapsed()` once `bound` has passed without one: the
/// one timer under every bound on a session lock's statements.
async fn bounded<T>(
    bound: Duration,
    work: impl Future<Output = Result<T, Error>>,
    elapsed: impl FnOnce() -> Error,
) -> Result<T, Error> {
    match tokio::time::timeout(bound, work).await {
        Ok(result) => result,
        Err(_) => Err(elapsed()),
    }
}

/// Sends `query` (statements joined by `;`) with the simple query
/// protocol: one `Query` message, sent at the first poll. Answers the rows
/// of each command that completed, in order, and the error that stopped
/// the query, if any (the server runs no command after a failed one, so
/// the failed one is the next after those completed).
pub(super) async fn simple_round(
    client: &Client,
    query: &str,
) -> (Completed, Option<tokio_postgres::Error>) {
    // Two vectors for the whole query, not one per command.
    let mut done = Completed {
        rows: Vec::with_capacity(4),
        ends: Vec::with_capacity(8),
    };
    let stream = match client.simple_query_raw(query).await {
        Ok(stream) => stream,
        Err(e) => return (done, Some(e)),
    };
    let mut stream = std::pin::pin!(stream);
    while let Some(message) = stream.next().await {
        match message {
            Ok(SimpleQueryMessage::Row(row)) => done.rows.push(SimpleRow(row)),
            Ok(SimpleQueryMessage::CommandComplete(_)) => done.ends.push(done.rows.len()),
            Ok(_) => {}
            Err(e) => return (done, Some(e)),
        }
    }
    (done, None)
}

/// The commands of a simple query that completed, in order, with their
/// rows in one vector: command `i` answered `rows[ends[i - 1]..ends[i]]`
/// (rows after the last completed command, of a failed one, are ignored).
pub(super) struct Completed {
    rows: Vec<SimpleRow>,
    ends: Vec<usize>,
}

impl Completed {
    /// Forgets the first command (its rows, which the caller has read).
    pub(super) fn skip_first(&mut self) {
        if self.ends.is_empty() {
            return;
        }
        let first = self.ends.remove(0);
        self.rows.drain(..first);
        for end in &mut self.ends {
            *end -= first;
        }
    }

    /// How many commands completed.
    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Where the rows of the first `i` commands end.
    fn end(&self, i: usize) -> usize {
        match i.min(self.ends.len()) {
            0 => 0,
            i => self.ends[i - 1],
        }
    }

    /// The rows of commands `from..to` (none for commands that did not
    /// complete).
    pub(super) fn rows(&self, from: usize, to: usize) -> &[SimpleRow] {
        self.rows
            .get(self.end(from)..self.end(to))
            .unwrap_or_default()
    }

    /// The rows of each statement after the first `prefix` commands, given
    /// how many commands each statement is: a statement of several
    /// commands (a savepoint rollback) answers the rows of all of them.
    pub(super) fn into_answers(
        self,
        prefix: usize,
        commands: impl Iterator<Item = usize>,
    ) -> Vec<Vec<SimpleRow>> {
        let (mut next, mut taken) = (prefix, self.end(prefix));
        let ends: Vec<usize> = commands
            .map(|n| {
                next += n;
                self.end(next)
            })
            .collect();
        let mut rows = self.rows.into_iter().skip(taken);
        ends.into_iter()
            .map(|end| {
                let statement = rows.by_ref().take(end - taken).collect();
                taken = end;
                statement
            })
            .collect()
    }
}
