//! [`Locker`]: configuration plus the server facts, shared by every
//! transaction of an application, and how every locked transaction begins.

use diesel_async::AsyncPgConnection;
use lockkit::driver::diesel::learned_policy;
use lockkit::driver::CancellingPolicy;
use lockkit::tx::BoxFuture;
use lockkit::{Config, Error};

use crate::driver;
use crate::LockTx;

/// Takes transaction-scoped advisory locks over diesel-async's
/// `AsyncPgConnection`.
///
/// A locker holds the [`Config`] and the
/// [`ServerFacts`](lockkit::ServerFacts) it learned when created, so taking
/// a lock costs no extra round trip. It is cheap to clone (an `Arc`) and
/// `Send + Sync`: make one at startup and share it among tasks and pooled
/// connections (deadpool, bb8) of the same server.
///
/// See the [crate docs](crate) for an example.
#[derive(Clone, Debug)]
pub struct Locker {
    pub(crate) inner: CancellingPolicy,
}

lockkit::locker_basics!(Locker, cancel_tls);

impl Locker {
    /// Learns the server's facts through `conn` (two queries) and builds a
    /// locker with `config`.
    ///
    /// Also reads the server's `lc_messages`: diesel-async reports Diesel's
    /// errors, which do not carry the SQLSTATE, so deadlocks, timeouts and a
    /// full lock table are recognised by the server's English message. When
    /// the messages are in another language a `tracing` warning says so, and
    /// such errors become [`ErrorKind::Database`](lockkit::ErrorKind::Database)
    /// (see
    /// [`Policy::recognizes_errors`](lockkit::driver::Policy::recognizes_errors)).
    ///
    /// It also learns whether `conn` reaches PostgreSQL itself or a pooler:
    /// only on a connection proven direct does a cut-off lock call send a
    /// cancel request (over TLS with `sslmode=require`, given
    /// [`cancel_tls`](Self::cancel_tls)); everywhere else its waits are
    /// bounded on the server
    /// ([`Policy::bounds_waits`](lockkit::driver::Policy::bounds_waits)).
    /// Make it on a connection of the route its calls take.
    ///
    /// # Errors
    ///
    /// The query's error, as [`Error`].
    ///
    /// Each query is prepared under a savepoint, as lock calls are by
    /// default: behind a pooler shared with other processes, a statement
    /// another process left under the name diesel-async gives it is
    /// deallocated and the query sent again (the crate docs, "Statements,
    /// and transaction-mode poolers").
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the queries change nothing on the server but that,
    /// other processes' statements left under the names this process uses
    /// next.
    pub async fn new(conn: &mut AsyncPgConnection, config: Config) -> Result<Locker, Error> {
        let (facts, messages) = driver::server_facts(conn)
            .await
            .map_err(driver::lock_error)?;
        Ok(Locker {
            inner: CancellingPolicy::new(learned_policy(
                config,
                &facts,
                &messages,
                "lockkit-diesel-async",
            ))
            .learned_on(&conn.cancel_token(), facts.backend_pid),
        })
    }

    /// A [`LockTx`] over the transaction open on `conn`, inside
    /// diesel-async's own `conn.transaction(async |conn| …)`, with
    /// bookkeeping (held set, budget, order check) that lasts as long as it
    /// does: make one per transaction and take every lock through it. On a
    /// deadpool or bb8 connection, pass `&mut *pooled`.
    ///
    /// See the [crate docs](crate) for an example.
    ///
    /// The transaction is diesel-async's, and so is its commit: after a lock
    /// call's error that aborts it (a deadlock, the session's own
    /// `lock_timeout`), PostgreSQL answers `COMMIT` by rolling back, and
    /// diesel-async's `conn.transaction` reports success. Return the error
    /// (`?`), or use [`transaction`](Self::transaction), whose commit
    /// refuses.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::NotInTransaction`](lockkit::ErrorKind::NotInTransaction)
    /// when diesel-async has no transaction open on `conn` (its transaction
    /// depth is 0): outside a transaction block an xact lock would be
    /// released at the end of its statement.
    pub fn lock_tx<'t>(&self, conn: &'t mut AsyncPgConnection) -> Result<LockTx<'t>, Error> {
        lockkit::driver::lock_tx(self, conn)
    }

    /// Runs `f` in a new transaction on `conn` (a savepoint, when one is
    /// open there), with a [`LockTx`] that takes advisory locks: commits
    /// when `f` returns `Ok`, rolls back when it returns `Err`.
    ///
    /// ```no_run
    /// use diesel_async::{AsyncPgConnection, RunQueryDsl};
    /// use lockkit_diesel_async::{AdvisoryKey, Locker};
    ///
    /// #[derive(AdvisoryKey)]
    /// struct Order {
    ///     id: i64,
    /// }
    ///
    /// # async fn run(conn: &mut AsyncPgConnection, locker: &Locker) -> Result<(), lockkit_diesel_async::Error> {
    /// locker
    ///     .transaction(conn, |tx| {
    ///         Box::pin(async move {
    ///             let order = tx.lock(Order { id: 42 }).await?;
    ///             diesel::sql_query("UPDATE orders SET state = 'paid' WHERE id = $1")
    ///                 .bind::<diesel::sql_types::BigInt, _>(order.id)
    ///                 .execute(tx.conn())
    ///                 .await?;
    ///             Ok::<_, lockkit_diesel_async::Error>(())
    ///         })
    ///     })
    ///     .await
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `f`'s error, or diesel-async's (as [`lockkit::Error`], converted
    /// into `E`) when `BEGIN`, `COMMIT` or `ROLLBACK` fails.
    ///
    /// [`ErrorKind::TransactionAborted`](lockkit::ErrorKind::TransactionAborted),
    /// rolled back instead of committed, when `f` returns `Ok` after a lock
    /// call's error aborted the transaction (PostgreSQL answers `COMMIT`
    /// there by rolling back, which diesel-async reports as success).
    ///
    /// # Cancel safety
    ///
    /// Dropped before it ends (or if `f` panics), the transaction is given
    /// up as a cut-off lock call's is: rolled back at once, and
    /// diesel-async's transaction manager put in error, so that a pool
    /// discards the connection (diesel-async cannot roll back in a
    /// destructor).
    pub async fn transaction<R, E, F>(&self, conn: &mut AsyncPgConnection, f: F) -> Result<R, E>
    where
        F: for<'a, 't> FnOnce(&'a mut LockTx<'t>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        lockkit::driver::transaction(self, conn, f).await
    }
}
