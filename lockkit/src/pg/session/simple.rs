//! The default form's lock in one simple-protocol query: the lock
//! engine's statements behind `BEGIN` and the session set-up, sent as one
//! `Query` message, and the text rows they answer read back for the
//! engine's reply checks. The runner is a [`Driver`] ([`Simple`]), so the
//! engine's calls run on it as on every adapter's connection
//! ([`drive`], [`run_one`]).

use std::fmt;
use std::future::Future;
use std::num::NonZeroU8;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use super::wire::{one_row, simple_round, AppName, Completed};
use crate::driver::{drive, run_one, Async, Driver};
use crate::engine::error::{DriverError, Error};
use crate::engine::guard::Busy;
use crate::engine::sql;
use crate::engine::{
    read_reply, Grant, Policy, Reply, ReplyRow, ReplyShape, Request, Statement, TxState, Wait,
};
use crate::fencing::FencingToken;
use crate::key::{AdvisoryKey, LockKey};
use crate::pg::text_row::{BadColumn, SimpleRow};
use crate::StatementMode::{self, Unnamed};

/// How a held transaction is set up, beside its name: whether the server
/// is known to have `client_connection_check_interval` (shared by a
/// `SessionLock`'s clones; cleared when that form fails), the lease after
/// which the server ends a session whose holder stopped answering
/// ([`sql::write_session_setup`]), and whether each round of the lock
/// mints a fencing token after its statements ([`sql::FENCING_TOKEN`]).
#[derive(Clone, Copy)]
pub(super) struct HeldTx<'a> {
    pub(super) check_interval_known: &'a AtomicBool,
    pub(super) lease: Duration,
    pub(super) mint: bool,
}

/// What a session lock's query answered: the set-up row (`in_recovery`,
/// `backend_pid`) and the key granted with its fencing token when the call
/// minted one (`None`: a try found it busy), or, as the inner error, what
/// the engine made of a failed lock statement.
pub(super) type Taken = ((bool, i32), Result<Option<Granted>, Error>);

/// A key granted, and the fencing token minted with it (when asked for).
pub(super) type Granted = (LockKey, Option<FencingToken>);

/// Opens the lock's transaction on `client`, sets it up (named `name`) and
/// takes the transaction-scoped lock inside it through the lock engine
/// under `policy` (its checks, statements, reply checks and timeouts), all
/// in one simple-protocol query; later rounds of the engine (a timeout's
/// savepoint rollback) go the same way.
///
/// # Errors
///
/// The outer error when `BEGIN` or the set-up failed, or their reply was
/// not what they answer: then the engine never saw a reply.
pub(super) async fn take_xact_lock(
    (client, policy): (&Client, &Policy),
    request: Request,
    wait: Wait,
    name: &AppName,
    held: HeldTx<'_>,
) -> Result<Taken, Error> {
    let state = TxState::new();
    // A wait as long as it takes waits in slices that the server bounds
    // (`Policy::bounds_waits`): a take cut off, or whose client is gone,
    // frees its server connection within one slice.
    let call = state.acquire(policy, 0, request, wait)?;
    let call = call.sliced(policy.bounds_waits());
    let mut conn = SimpleConn::new(client, Some((name, held)));
    let outcome = drive::<Simple<'_>>(&mut conn, &Simple(policy), Unnamed, call).await;
    let setup = conn.set_up()?;
    Ok((setup, conn.granted(outcome)))
}

/// [`take_xact_lock`] for a permit of the semaphore of `permits` permits
/// named by `value`'s key: its try behind `BEGIN` and the set-up, in one
/// query; when every slot is busy and the call waits, the wait for one
/// slot, in the same transaction.
///
/// # Errors
///
/// As [`take_xact_lock`].
pub(super) async fn take_permit<K: AdvisoryKey>(
    (client, policy): (&Client, &Policy),
    (value, permits): (&K, NonZeroU8),
    wait: Wait,
    name: &AppName,
    held: HeldTx<'_>,
) -> Result<Taken, Error> {
    let state = TxState::new();
    let call = state.acquire_permit(policy, 0, (value, permits), None)?;
    let mut conn = SimpleConn::new(client, Some((name, held)));
    let outcome = run_one::<Simple<'_>>(&mut conn, &Simple(policy), call).await;
    let setup = conn.set_up()?;
    let outcome = match (outcome, wait) {
        (Ok(Err(_busy)), Wait::Forever | Wait::Timeout(_)) => {
            let request = Request::permit_slot(value, permits);
            let call = state
                .acquire(policy, 0, request, wait)?
                .sliced(policy.bounds_waits());
            let outcome = drive::<Simple<'_>>(&mut conn, &Simple(policy), Unnamed, call).await;
            // A query that did not answer its commands: the call's own
            // error, as in the first round.
            if let Some(Err(e)) = conn.setup.take() {
                return Err(e);
            }
            outcome
        }
        (outcome, _) => outcome,
    };
    Ok((setup, conn.granted(outcome)))
}

/// Session locks' runner, as a [`Driver`]: each round of the engine is one
/// simple-protocol query (one `Query` message, one round trip), the first
/// behind `BEGIN` and the session set-up, under the lock's policy. Its
/// connection is a [`SimpleConn`].
#[derive(Clone, Copy, Debug)]
struct Simple<'c>(&'c Policy);

impl AsRef<Policy> for Simple<'_> {
    fn as_ref(&self) -> &Policy {
        self.0
    }
}

/// A session lock's connection as [`Simple`] runs it: the client, the
/// set-up its first round sends before the engine's statements, and what
/// that set-up answered.
struct SimpleConn<'c> {
    client: &'c Client,
    /// The lock's name and its held transaction's set-up: taken by the
    /// first round.
    begin: Option<(&'c AppName, HeldTx<'c>)>,
    /// The set-up's row; or the call's own error, when `BEGIN` or the
    /// set-up failed or a query did not answer its commands: then the
    /// engine saw an error in place of its replies, and the lock call
    /// answers this one.
    setup: Option<Result<(bool, i32), Error>>,
    /// Whether each round mints a fencing token after its statements.
    mint: bool,
    /// The token the last round minted: the one of the grant, since a
    /// round that grants is the last.
    token: Option<FencingToken>,
}

impl<'c> SimpleConn<'c> {
    fn new(client: &'c Client, begin: Option<(&'c AppName, HeldTx<'c>)>) -> Self {
        SimpleConn {
            client,
            mint: begin.is_some_and(|(_, held)| held.mint),
            begin,
            setup: None,
            token: None,
        }
    }

    /// The key a call's outcome grants (`None` when busy), with the token
    /// minted with it when the call mints them.
    ///
    /// # Errors
    ///
    /// The call's own error; [`ErrorKind::UnexpectedReply`] when a minting
    /// call granted a key and no token came with it.
    fn granted(
        &self,
        outcome: Result<Result<Grant, Busy>, Error>,
    ) -> Result<Option<Granted>, Error> {
        let Some(key) = outcome?.ok().and_then(|grant| grant.key()) else {
            return Ok(None);
        };
        match (self.mint, self.token) {
            (false, _) => Ok(Some((key, None))),
            (true, Some(token)) => Ok(Some((key, Some(token)))),
            (true, None) => Err(Error::unexpected(
                "a lock that mints fencing tokens was granted without one".into(),
            )),
        }
    }

    /// The set-up's row, once the first round ran.
    ///
    /// # Errors
    ///
    /// As [`take_xact_lock`]'s outer error.
    fn set_up(&mut self) -> Result<(bool, i32), Error> {
        match self.setup.take() {
            Some(setup) => setup,
            None => Err(Error::unexpected("the lock engine sent nothing".into())),
        }
    }

    /// Records `e` as the lock call's answer, and gives the engine an error
    /// in place of its replies.
    fn failed(&mut self, e: Error) -> (Vec<Vec<SimpleRow>>, Option<DriverError>) {
        let engine = DriverError::new(e.to_string());
        self.setup = Some(Err(e));
        (Vec::new(), Some(engine))
    }
}

impl<'c> Driver for Simple<'c> {
    type Io = Async;
    type Conn = SimpleConn<'c>;
    /// The rows of one statement (of none, for a statement of several
    /// commands: a savepoint rollback).
    type Answer = Vec<SimpleRow>;

    async fn run<'a>(
        conn: &'a mut SimpleConn<'c>,
        statement: Statement<'a>,
        _: StatementMode,
    ) -> Result<Vec<SimpleRow>, DriverError> {
        match query_round(conn, std::slice::from_ref(&statement)).await {
            (_, Some(e)) => Err(e),
            (mut answers, None) => Ok(answers.pop().unwrap_or_default()),
        }
    }

    fn run_round<'a>(
        conn: &'a mut SimpleConn<'c>,
        round: &'a [Statement<'a>],
        _: StatementMode,
    ) -> impl Future<Output = (Vec<Vec<SimpleRow>>, Option<DriverError>)> + Send + 'a {
        query_round(conn, round)
    }

    fn reply(statement: &Statement<'_>, rows: &Vec<SimpleRow>) -> Reply {
        match statement.reply() {
            ReplyShape::Done if rows.is_empty() => read_reply::<SimpleRow>(statement, None),
            _ => read_reply(statement, Some(rows)),
        }
    }

    /// Nothing: the take's connection is drained behind the query
    /// ([`Taking`](super::drain::Taking)).
    fn cut_off(&self, _: &mut SimpleConn<'c>) {}
}

/// Sends `round` on `conn` as one simple-protocol query, behind `BEGIN`
/// and the session set-up when it is the first round, and answers each
/// statement's rows, with the error that stopped the query, if any.
async fn query_round(
    conn: &mut SimpleConn<'_>,
    round: &[Statement<'_>],
) -> (Vec<Vec<SimpleRow>>, Option<DriverError>) {
    let mut query = String::with_capacity(512);
    let first = conn.begin.take();
    let known = first.is_some_and(|(_, held)| held.check_interval_known.load(Ordering::Relaxed));
    let prefix = match first {
        Some((name, held)) => {
            query.push_str(sql::SESSION_BEGIN);
            query.push_str("; ");
            1 + sql::write_session_setup(&mut query, name, known, held.lease)
        }
        None => 0,
    };
    for statement in round {
        if !query.is_empty() {
            query.push_str("; ");
        }
        statement.write_simple(&mut query);
    }
    // The token after the round's statements: a grant comes before it, and
    // a failed statement stops the query before it.
    if conn.mint {
        query.push_str("; ");
        query.push_str(sql::FENCING_TOKEN);
    }
    let (completed, failed) = simple_round(conn.client, &query).await;
    let statements = prefix
        + round
            .iter()
            .map(|s| s.sql().simple_commands())
            .sum::<usize>();
    let expected = statements + usize::from(conn.mint);
    match failed {
        Some(e) if completed.len() < prefix => {
            if let (Some((_, held)), Some(&SqlState::UNDEFINED_OBJECT)) = (first, e.code()) {
                // No `client_connection_check_interval` (the server is
                // older than the one seen before): the next set-up asks
                // again.
                held.check_interval_known.store(false, Ordering::Relaxed);
            }
            return conn.failed(Error::from(e));
        }
        None if completed.len() != expected => {
            return conn.failed(Error::unexpected(format!(
                "the session lock's query answered {} commands, not {expected}",
                completed.len()
            )));
        }
        failed => {
            if let Some((_, held)) = first {
                match read_setup(&completed, prefix, known, held.check_interval_known) {
                    Ok(setup) => conn.setup = Some(Ok(setup)),
                    Err(e) => return conn.failed(e),
                }
            }
            match failed {
                // The statements ran and the token's failed: no lockkit SQL
                // functions (the error aborted the transaction, and with it
                // whatever the statements took).
                Some(e) if conn.mint && completed.len() == statements => {
                    let e = Error::not_installed_or(Error::from(e), "a fencing token");
                    return conn.failed(e);
                }
                Some(e) => return (Vec::new(), Some(DriverError::from(e))),
                None => {}
            }
            if conn.mint {
                match read_token(completed.rows(statements, expected)) {
                    Ok(token) => conn.token = Some(token),
                    Err(e) => return conn.failed(e),
                }
            }
        }
    }
    let commands = round.iter().map(|s| s.sql().simple_commands());
    (completed.into_answers(prefix, commands), None)
}

/// The fencing token of [`sql::FENCING_TOKEN`]'s rows: one row, its three
/// parts.
fn read_token(rows: &[SimpleRow]) -> Result<FencingToken, Error> {
    one_row(rows, "the fencing token")?;
    let bad = |e: BadColumn| Error::unexpected(format!("the fencing token: {e}"));
    let row = &rows[0];
    let (walfile, flush, counter) = (
        row.text(0).map_err(bad)?,
        row.text(1).map_err(bad)?,
        row.text(2).map_err(bad)?,
    );
    FencingToken::from_server(walfile, flush, counter)
        .map_err(|e| Error::unexpected(format!("the fencing token: {e}")))
}

/// Opens a held transaction on `client` and sets it up (named `name`), in
/// one simple-protocol query, as [`take_xact_lock`] does before its lock:
/// the multiplexed form's connection. Answers `in_recovery` and the
/// backend pid.
///
/// # Errors
///
/// When `BEGIN` or the set-up failed, or their reply was not theirs.
pub(super) async fn begin_held(
    client: &Client,
    name: impl fmt::Display,
    held: HeldTx<'_>,
) -> Result<(bool, i32), Error> {
    held_round(client, name, held, false).await
}

/// [`begin_held`] behind a `ROLLBACK`, in the same query: a held
/// transaction that a statement's error aborted, made anew. One query is one
/// message with one `ReadyForQuery` at its end, inside the new transaction,
/// so a transaction-mode pooler never sees the connection idle, and keeps it
/// pinned; the session-level locks taken on it outlive the rollback.
///
/// # Errors
///
/// As [`begin_held`].
pub(super) async fn renew_held(
    client: &Client,
    name: impl fmt::Display,
    held: HeldTx<'_>,
) -> Result<(bool, i32), Error> {
    held_round(client, name, held, true).await
}

async fn held_round(
    client: &Client,
    name: impl fmt::Display,
    held: HeldTx<'_>,
    renew: bool,
) -> Result<(bool, i32), Error> {
    let check_interval_known = held.check_interval_known;
    let known = check_interval_known.load(Ordering::Relaxed);
    let mut query = String::with_capacity(256);
    if renew {
        query.push_str(sql::SESSION_ROLLBACK);
        query.push_str("; ");
    }
    query.push_str(sql::SESSION_BEGIN);
    query.push_str("; ");
    let prefix = 1 + sql::write_session_setup(&mut query, name, known, held.lease);
    let (mut completed, failed) = simple_round(client, &query).await;
    if let Some(e) = failed {
        if e.code() == Some(&SqlState::UNDEFINED_OBJECT) {
            check_interval_known.store(false, Ordering::Relaxed);
        }
        return Err(Error::from(e));
    }
    if renew {
        // The ROLLBACK answers no row.
        if !completed.rows(0, 1).is_empty() {
            return Err(Error::unexpected("ROLLBACK returned a row".into()));
        }
        completed.skip_first();
    }
    if completed.len() != prefix {
        return Err(Error::unexpected(format!(
            "the session set-up answered {} commands, not {prefix}",
            completed.len()
        )));
    }
    read_setup(&completed, prefix, known, check_interval_known)
}

/// The set-up row of a held transaction's first `prefix` commands
/// (`BEGIN`, then [`sql::write_session_setup`]'s): `in_recovery` and the
/// backend pid. Notes whether the server has
/// `client_connection_check_interval`.
fn read_setup(
    completed: &Completed,
    prefix: usize,
    known: bool,
    check_interval_known: &AtomicBool,
) -> Result<(bool, i32), Error> {
    // BEGIN answers no row; the set-up one row in its first command and
    // none in the others.
    let begun = completed.rows(0, 1);
    let set_up = completed.rows(1, 2);
    let settings = completed.rows(2, prefix);
    if !begun.is_empty() || !settings.is_empty() {
        return Err(Error::unexpected(
            "BEGIN or a SET of the session set-up returned a row".into(),
        ));
    }
    one_row(set_up, "the session set-up")?;
    let row = &set_up[0];
    let bad = |e: BadColumn| Error::unexpected(format!("the session set-up: {e}"));
    let setup = (row.bool(0).map_err(bad)?, row.int4(1).map_err(bad)?);
    // The other form's last column: NULL when the server has no
    // `client_connection_check_interval`.
    if !known && row.text(3).is_ok() {
        check_interval_known.store(true, Ordering::Relaxed);
    }
    Ok(setup)
}
