//! [`Locker`]: configuration plus the server facts, shared by every
//! transaction of an application.

use std::sync::Arc;

use lockkit::driver::Policy;
use lockkit::driver::{sql, FactsRow, HASHTEXT_PROBES};
use lockkit::{Config, Error, ServerFacts};
use sqlx::{Acquire, Executor, PgConnection, Postgres};

use crate::error::lock_error;
use crate::LockTx;
use lockkit::tx::BoxFuture;

/// Takes transaction-scoped advisory locks inside sqlx transactions.
///
/// A locker holds the [`Config`] and the [`ServerFacts`] it learned in one
/// query when created, so taking a lock costs no extra round trip. It is
/// cheap to clone (an `Arc`) and `Send + Sync`: make one at startup and share
/// it among tasks and pooled connections of the same server.
///
/// See the [crate docs](crate) for an example.
#[derive(Clone, Debug)]
pub struct Locker {
    inner: Arc<Policy>,
}

lockkit::locker_basics!(Locker);

impl Locker {
    /// Learns the server's facts in one query
    /// ([`SERVER_FACTS`](lockkit::driver::sql::SERVER_FACTS)) through
    /// `executor` (`&PgPool`, `&mut PgConnection`, `&mut *tx`) and builds a
    /// locker with `config`.
    ///
    /// # Errors
    ///
    /// The query's error ([`ErrorKind::Database`](lockkit::ErrorKind::Database),
    /// [`ErrorKind::ConnectionLost`](lockkit::ErrorKind::ConnectionLost), …).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the query changes nothing on the server.
    pub async fn new<'c, E>(executor: E, config: Config) -> Result<Locker, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let query = server_facts_query();
        let row = executor
            .fetch_one(query.as_str())
            .await
            .map_err(lock_error)?;
        let row = FactsRow::read(&crate::driver::SqlxRow(row)).map_err(lock_error)?;
        let facts = ServerFacts::from(&row);
        Ok(Locker::with_facts(config, facts))
    }

    /// A [`LockTx`] over the transaction open on `conn`: pass `&mut tx` for
    /// a `sqlx::Transaction<'_, Postgres>` (from `PgPool::begin`,
    /// `PgConnection::begin`, or inside sqlx's `Connection::transaction`).
    /// Its bookkeeping (held set, budget, order check) lasts as long as it
    /// does: make one per transaction and take every lock through it. Its
    /// guards borrow the transaction, so none outlives the `COMMIT` or
    /// `ROLLBACK` that releases them.
    ///
    /// See the [crate docs](crate) for an example.
    ///
    /// The transaction is sqlx's, and so is its commit: after a lock
    /// call's error that aborts it (a deadlock, the session's own
    /// `lock_timeout`), PostgreSQL answers `COMMIT` by rolling back, and
    /// sqlx's `commit` reports success. Return the error (`?`), or use
    /// [`transaction`](Self::transaction), whose commit refuses.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::NotInTransaction`](lockkit::ErrorKind::NotInTransaction) when sqlx has no transaction open on
    /// `conn` (its transaction depth is 0): outside a transaction block an
    /// xact lock would be released at the end of its statement.
    pub fn lock_tx<'t>(&self, conn: &'t mut PgConnection) -> Result<LockTx<'t>, Error> {
        lockkit::driver::lock_tx(self, conn)
    }

    /// Runs `f` in a new transaction begun on `conn` (`&PgPool`,
    /// `&mut PgConnection`; a savepoint when a transaction is open there), with
    /// a [`LockTx`] that takes advisory locks: commits when `f` returns
    /// `Ok`, rolls back when it returns `Err`. If `f` panics, or this future
    /// is dropped, sqlx rolls the transaction back before the connection's
    /// next use (which releases the locks), as with sqlx's own
    /// `Connection::transaction`.
    ///
    /// ```no_run
    /// use lockkit_sqlx::{AdvisoryKey, Batch, Locker, SqlxResultExt};
    ///
    /// #[derive(AdvisoryKey)]
    /// struct Account {
    ///     id: i64,
    /// }
    ///
    /// # async fn run(pool: &sqlx::PgPool, locker: &Locker) -> Result<(), lockkit_sqlx::Error> {
    /// locker
    ///     .transaction(pool, |tx| {
    ///         Box::pin(async move {
    ///             let batch = Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 });
    ///             let _held = tx.lock_batch(&batch).await?;
    ///             sqlx::query("UPDATE accounts SET cents = cents - 500 WHERE id = 7")
    ///                 .execute(tx.conn())
    ///                 .await
    ///                 .lock_err()?;
    ///             Ok::<_, lockkit_sqlx::Error>(())
    ///         })
    ///     })
    ///     .await
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `f`'s error, or sqlx's (as [`lockkit::Error`], converted into `E`)
    /// when `BEGIN`, `COMMIT` or `ROLLBACK` fails.
    ///
    /// [`ErrorKind::TransactionAborted`](lockkit::ErrorKind::TransactionAborted),
    /// rolled back instead of committed, when `f` returns `Ok` after a lock
    /// call's error aborted the transaction (PostgreSQL answers `COMMIT`
    /// there by rolling back, which sqlx reports as success).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls the transaction back (see above); a lock
    /// call in flight then is handled as [`LockTx::lock`] says.
    pub async fn transaction<'c, A, R, E, F>(&self, conn: A, f: F) -> Result<R, E>
    where
        A: Acquire<'c, Database = Postgres>,
        F: for<'a, 't> FnOnce(&'a mut LockTx<'t>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        let mut conn = conn.acquire().await.map_err(|e| E::from(lock_error(e)))?;
        lockkit::driver::transaction(self, &mut *conn, f).await
    }
}

/// [`sql::SERVER_FACTS`] with its one parameter, lockkit's own `hashtext`
/// probes, written in as a text array literal, for the simple query
/// protocol: one message, no statement name. sqlx parses a statement with
/// parameters in a round trip of its own before it binds and runs it, and
/// outside a transaction a transaction-mode pooler may serve the two on
/// different server connections; a persistent statement's name may also
/// meet another client's there.
fn server_facts_query() -> String {
    let probes: Vec<String> = HASHTEXT_PROBES
        .iter()
        .map(|p| format!("'{}'", p.replace('\'', "''")))
        .collect();
    let array = format!("ARRAY[{}]::text[]", probes.join(", "));
    sql::SERVER_FACTS.replacen("$1", &array, 1)
}
