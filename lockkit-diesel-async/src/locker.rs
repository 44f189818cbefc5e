//! [`Locker`]: configuration plus the server facts, shared by every
//! transaction of an application, and how every locked transaction begins.

use std::future::Future;
use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use lockkit::driver::diesel::DieselPolicy;
use lockkit::driver::Canceller;
use lockkit::driver::Policy;
use lockkit::tx::BoxFuture;
use lockkit::{Batch, Config, Error, ServerFacts};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use crate::driver as exec;
use crate::LockTx;

/// Takes transaction-scoped advisory locks over diesel-async's
/// `AsyncPgConnection`.
///
/// A locker holds the [`Config`] and the [`ServerFacts`] it learned when
/// created, so taking a lock costs no extra round trip. It is cheap to clone
/// (an `Arc`) and `Send + Sync`: make one at startup and share it among
/// tasks and pooled connections (deadpool, bb8) of the same server.
///
/// See the [crate docs](crate) for an example.
#[derive(Clone, Debug)]
pub struct Locker {
    inner: Arc<DieselPolicy>,
    canceller: Canceller,
}

/// The configuration and facts, as the engine sees them.
impl AsRef<Policy> for Locker {
    fn as_ref(&self) -> &Policy {
        self.inner.policy()
    }
}

impl Locker {
    /// Learns the server's facts through `conn` (two queries) and builds a
    /// locker with `config`.
    ///
    /// Also reads the server's `lc_messages`: diesel-async reports Diesel's
    /// errors, which do not carry the SQLSTATE, so deadlocks, timeouts and a
    /// full lock table are recognised by the server's English message. When
    /// the messages are in another language a `tracing` warning says so, and
    /// such errors become [`ErrorKind::Database`](lockkit::ErrorKind::Database)
    /// (see [`Locker::recognizes_errors`]).
    ///
    /// # Errors
    ///
    /// The query's error, as [`Error`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the queries change nothing on the server.
    pub async fn new(conn: &mut AsyncPgConnection, config: Config) -> Result<Locker, Error> {
        let facts = exec::server_facts(conn).await.map_err(exec::lock_error)?;
        let messages = exec::messages(conn).await.map_err(exec::lock_error)?;
        Ok(Locker {
            inner: Arc::new(DieselPolicy::learned(
                config,
                &facts,
                &messages,
                "lockkit-diesel-async",
            )),
            canceller: Canceller::plain(),
        })
    }

    /// A locker with facts known in advance (no query). It assumes the
    /// server's messages are English.
    pub fn with_facts(config: Config, facts: ServerFacts) -> Locker {
        Locker {
            inner: Arc::new(DieselPolicy::assumed(config, facts)),
            canceller: Canceller::plain(),
        }
    }

    /// Sends the cancel request of a dropped lock call through `tls`, the
    /// TLS connector the connections were made with (diesel-async connects
    /// over TLS through a tokio-postgres client, e.g. in
    /// `ManagerConfig::custom_setup`). Needed under `sslmode=require` and
    /// the `verify-*` modes, where a request in plain text fails and the
    /// server goes on waiting for the key: see [`lockkit::driver::Canceller`].
    pub fn cancel_tls<T>(mut self, tls: T) -> Locker
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.canceller = Canceller::tls(tls);
        self
    }

    /// How this locker sends cancel requests.
    pub(crate) fn canceller(&self) -> &Canceller {
        &self.canceller
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        self.inner.policy().config()
    }

    /// What the locker learned about the server.
    pub fn facts(&self) -> &ServerFacts {
        self.inner.policy().facts()
    }

    /// The configuration and facts, as the engine sees them.
    pub fn policy(&self) -> &Policy {
        self.inner.policy()
    }

    /// Whether the server's error messages are English, so that
    /// [`Error::is_deadlock`], [`Error::is_timeout`] and
    /// [`Error::is_lock_table_full`] work.
    pub fn recognizes_errors(&self) -> bool {
        self.inner.recognizes_errors()
    }

    /// The lock budget per transaction: the configured one, else the
    /// server's `max_locks_per_transaction`.
    pub fn budget(&self) -> usize {
        self.inner.policy().budget()
    }

    /// A [`LockTx`] over the transaction open on `conn`, inside
    /// diesel-async's own `conn.transaction(async |conn| …)`, with
    /// bookkeeping (held set, budget, order check) that lasts as long as it
    /// does: make one per transaction and take every lock through it. On a
    /// deadpool or bb8 connection, pass `&mut *pooled`.
    ///
    /// See the [crate docs](crate) for an example.
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
    /// # async fn run(conn: &mut AsyncPgConnection, locker: &Locker) -> Result<(), lockkit::Error> {
    /// locker
    ///     .transaction(conn, |tx| {
    ///         Box::pin(async move {
    ///             let order = tx.lock(Order { id: 42 }).await?;
    ///             diesel::sql_query("UPDATE orders SET state = 'paid' WHERE id = $1")
    ///                 .bind::<diesel::sql_types::BigInt, _>(order.id)
    ///                 .execute(tx.conn())
    ///                 .await?;
    ///             Ok::<_, lockkit::Error>(())
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
        lockkit::driver::transaction(self, conn, None, f).await
    }

    /// The common case in one call: a transaction that first takes every key
    /// of `batch` in the global lock order, then runs `f`, then commits (or
    /// rolls back, as [`Locker::transaction`]).
    ///
    /// # Errors
    ///
    /// The lock errors of
    /// [`LockTx::lock_batch`](lockkit::tx::LockTx::lock_batch) (converted
    /// into `E`), `f`'s error, or diesel-async's.
    ///
    /// # Cancel safety
    ///
    /// As [`Locker::transaction`].
    #[track_caller]
    pub fn locked_transaction<'c, 'b, R, E, F>(
        &self,
        conn: &'c mut AsyncPgConnection,
        batch: &'b Batch,
        f: F,
    ) -> impl Future<Output = Result<R, E>> + use<'_, 'b, 'c, R, E, F>
    where
        F: for<'a, 't> FnOnce(&'a mut LockTx<'t>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        // The batch is the application's call, at its call site.
        let site = std::panic::Location::caller();
        lockkit::driver::transaction(self, conn, Some((batch, site)), f)
    }
}
