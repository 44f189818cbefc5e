//! [`Locker`]: configuration plus the server facts, shared by every
//! transaction of an application.

use std::sync::Arc;

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Transaction};

use crate::engine::config::Config;
use crate::engine::error::Error;
use crate::engine::facts::{ServerFacts, HASHTEXT_PROBES};
use crate::engine::sql;
use crate::pg::prepared::{LockSql, Prepared};
use crate::pg::transaction::LockTx;

/// Takes transaction-scoped advisory locks over tokio-postgres.
///
/// A locker holds the [`Config`] and the [`ServerFacts`] it learned in one
/// round trip when created, so taking a lock costs no extra round trip. It is
/// cheap to clone (an `Arc`) and `Send + Sync`: make one at startup and share
/// it among workers and pooled connections of the same server.
///
/// # Example
///
/// ```no_run
/// use lockkit::{AdvisoryKey, Config, Locker};
///
/// #[derive(AdvisoryKey)]
/// struct Order {
///     id: i64,
/// }
///
/// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
/// let locker = Locker::new(client, Config::default()).await?;
///
/// let tx = locker.begin(client).await?;
/// let order = tx.lock(Order { id: 42 }).await?; // held until COMMIT/ROLLBACK
/// tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&order.id]).await?;
/// drop(order);
/// tx.commit().await?; // releases the lock
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Locker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    facts: ServerFacts,
}

impl Locker {
    /// Learns the server's facts through `client` (one round trip) and
    /// builds a locker with `config`.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] or [`Error::ConnectionLost`] when the query fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn new(client: &Client, config: Config) -> Result<Locker, Error> {
        let (facts, _pid) = server_facts(client).await?;
        Ok(Locker::with_facts(config, facts))
    }

    /// A locker with facts known in advance (no query).
    pub fn with_facts(config: Config, facts: ServerFacts) -> Locker {
        Locker {
            inner: Arc::new(Inner { config, facts }),
        }
    }

    /// The policy.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// What the locker learned about the server.
    pub fn facts(&self) -> &ServerFacts {
        &self.inner.facts
    }

    /// The lock budget per transaction: the configured one, else the
    /// server's `max_locks_per_transaction`.
    pub fn budget(&self) -> usize {
        self.inner
            .config
            .budget
            .unwrap_or(self.inner.facts.max_locks_per_transaction())
    }

    /// Starts a transaction on `client` that can take advisory locks.
    ///
    /// Works with pooled connections too: a deadpool-postgres `Object`
    /// dereferences to `Client` (`locker.begin(&mut obj)`).
    ///
    /// # Errors
    ///
    /// When `BEGIN` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if dropped after `BEGIN` was sent, tokio-postgres rolls
    /// the transaction back before the client's next statement.
    pub async fn begin<'c>(&self, client: &'c mut Client) -> Result<LockTx<'c>, Error> {
        let tx = client.transaction().await?;
        Ok(self.wrap(tx))
    }

    /// Wraps a transaction that is already open. It must not hold advisory
    /// locks taken outside lockkit, or the budget will not count them.
    pub fn wrap<'c>(&self, tx: Transaction<'c>) -> LockTx<'c> {
        LockTx::new(self.clone(), tx, LockSql::Typed)
    }

    /// Prepares lockkit's lock statements on `client` (one round trip), for
    /// [`Locker::begin_prepared`]: keep the result with the connection.
    ///
    /// # Errors
    ///
    /// When the server refuses to prepare them.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn prepare(&self, client: &Client) -> Result<Prepared, Error> {
        Prepared::new(client).await
    }

    /// Like [`Locker::begin`], with the lock statements `prepared` on this
    /// very `client`, so each lock costs the server no parse: as cheap as a
    /// hand-prepared `SELECT pg_advisory_xact_lock($1)`.
    ///
    /// ```no_run
    /// # use lockkit::{AdvisoryKey, Config, Locker};
    /// # #[derive(AdvisoryKey)] struct Order { id: i64 }
    /// # async fn run(mut client: tokio_postgres::Client) -> Result<(), lockkit::Error> {
    /// let locker = Locker::new(&client, Config::default()).await?;
    /// let prepared = locker.prepare(&client).await?; // once per connection
    /// for id in 0..100 {
    ///     let tx = locker.begin_prepared(&mut client, &prepared).await?;
    ///     let _order = tx.lock(Order { id }).await?;
    ///     tx.commit().await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// When `BEGIN` fails. A `prepared` from another connection makes the
    /// first lock fail ("prepared statement does not exist") and abort the
    /// transaction.
    ///
    /// # Cancel safety
    ///
    /// As [`Locker::begin`].
    pub async fn begin_prepared<'c>(
        &self,
        client: &'c mut Client,
        prepared: &Prepared,
    ) -> Result<LockTx<'c>, Error> {
        let tx = client.transaction().await?;
        Ok(self.wrap_prepared(tx, prepared))
    }

    /// Like [`Locker::wrap`], with statements `prepared` on the transaction's
    /// connection.
    pub fn wrap_prepared<'c>(&self, tx: Transaction<'c>, prepared: &Prepared) -> LockTx<'c> {
        LockTx::new(self.clone(), tx, LockSql::Prepared(prepared.clone()))
    }
}

/// Runs [`sql::SERVER_FACTS`] on `client`: the server's facts, and the
/// backend pid of this connection.
pub(crate) async fn server_facts(client: &Client) -> Result<(ServerFacts, i32), Error> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row = client
        .query_typed_one(sql::SERVER_FACTS, &[(&probes, Type::TEXT_ARRAY)])
        .await?;
    let hashes: Vec<i32> = row.try_get(3)?;
    let facts = ServerFacts::new(row.try_get(0)?, row.try_get(1)?, row.try_get(2)?, &hashes);
    Ok((facts, row.try_get(4)?))
}
