//! [`Locker`]: the policy and the server facts, shared by every transaction
//! of an application; and [`LockClient`], a connection with lockkit's
//! statements prepared on it.

use std::ops::{Deref, DerefMut};

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Transaction};

use crate::driver::CancellingPolicy;
use crate::engine::config::{Config, StatementMode};
use crate::engine::error::Error;
use crate::engine::facts::{FactsRow, ServerFacts, HASHTEXT_PROBES};
use crate::engine::sql;
use crate::pg::exec::StatementCache;
use crate::pg::lock_tx::LockTx;

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
/// use lockkit::{AdvisoryKey, Config, LockClient, Locker};
///
/// #[derive(AdvisoryKey)]
/// struct Order {
///     id: i64,
/// }
///
/// # async fn run(client: tokio_postgres::Client) -> Result<(), lockkit::Error> {
/// let locker = Locker::new(&client, Config::default()).await?; // once, at startup
/// let mut conn = LockClient::new(&locker, client); // once per connection
///
/// let tx = conn.begin().await?;
/// let order = tx.lock(Order { id: 42 }).await?; // held until COMMIT/ROLLBACK
/// tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&order.id]).await?;
/// drop(order);
/// tx.commit().await?; // releases the lock
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Locker {
    pub(crate) inner: CancellingPolicy,
}

crate::locker_basics!(Locker, cancel_tls);

impl Locker {
    /// Learns the server's facts through `client` (one round trip) and
    /// builds a locker with `config`.
    ///
    /// It also learns whether `client` reaches PostgreSQL itself or a
    /// pooler: only on a connection proven direct does a cut-off lock call
    /// send a cancel request (over TLS with `sslmode=require`, given
    /// [`cancel_tls`](Self::cancel_tls)); everywhere else its waits are
    /// bounded on the server
    /// ([`Policy::bounds_waits`](crate::driver::Policy::bounds_waits)).
    /// Make it on a connection of the route its calls take.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) or
    /// [`ErrorKind::ConnectionLost`](crate::ErrorKind::ConnectionLost) when
    /// the query fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn new(client: &Client, config: Config) -> Result<Locker, Error> {
        let row = server_facts(client).await?;
        let locker = Locker::with_facts(config, ServerFacts::from(&row));
        Ok(Locker {
            inner: locker
                .inner
                .learned_on(&client.cancel_token(), row.backend_pid),
        })
    }

    /// Starts a transaction on a plain `client` that can take advisory
    /// locks, sending lockkit's statements unnamed (one round trip each; the
    /// server parses them every time), whatever the [`StatementMode`]. On a
    /// direct connection, [`LockClient::begin`] with
    /// [`StatementMode::Prepared`] prepares them once per connection.
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

    /// Wraps a `tokio_postgres::Transaction` that is already open, taking
    /// it over (the [`LockTx`] commits or rolls it back), with lockkit's
    /// statements sent unnamed. It must not hold advisory locks taken
    /// outside lockkit, or the budget will not count them. (A
    /// deadpool-postgres `Transaction` is a wrapper that cannot be taken
    /// apart: on a pooled connection use [`begin`](Self::begin).)
    ///
    /// The other adapters' `Locker::lock_tx(&mut conn)` borrows a
    /// connection inside a transaction the application ends; this one owns
    /// the transaction, hence its own name.
    ///
    /// ```no_run
    /// use lockkit::{AdvisoryKey, Locker};
    ///
    /// #[derive(AdvisoryKey)]
    /// struct Order {
    ///     id: i64,
    /// }
    ///
    /// # async fn run(client: &mut tokio_postgres::Client, locker: &Locker)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// let tx = client.transaction().await?;
    /// tx.execute("SET LOCAL statement_timeout = '5s'", &[]).await?;
    /// let tx = locker.wrap(tx);
    /// let order = tx.lock(Order { id: 42 }).await?;
    /// drop(order);
    /// tx.commit().await?; // releases the lock
    /// # Ok(())
    /// # }
    /// ```
    pub fn wrap<'c>(&self, tx: Transaction<'c>) -> LockTx<'c> {
        LockTx::new(self.clone(), tx, None)
    }

    /// The former name of [`wrap`](Self::wrap), which says that the
    /// transaction is taken over, where the other adapters' `lock_tx`
    /// borrows a connection.
    #[deprecated(
        since = "0.1.0",
        note = "renamed `wrap`: it takes the transaction over"
    )]
    pub fn lock_tx<'c>(&self, tx: Transaction<'c>) -> LockTx<'c> {
        self.wrap(tx)
    }
}

/// A connection that takes advisory locks: a [`Client`] with lockkit's
/// per-connection state (and, with [`StatementMode::Prepared`], lockkit's
/// statements prepared on it, lazily, all at once, the first time a lock
/// call needs them). This is the way in for tokio-postgres; make one per
/// connection and keep it with the connection.
///
/// It dereferences to the [`Client`] for everything else.
///
/// By default ([`StatementMode::Unnamed`]) every statement is sent unnamed,
/// in one round trip: safe behind every pooler, including a
/// transaction-mode pgbouncer shared with other applications, whose named
/// statements lockkit's can neither collide with nor miss. On a direct
/// connection (or a pooler that keeps named prepared statements per
/// client, pgbouncer 1.21+ with `max_prepared_statements`),
/// [`Config::statements`]`(`[`StatementMode::Prepared`]`)` saves the
/// server the parse: a lock then costs what a hand-prepared
/// `SELECT pg_advisory_xact_lock($1)` costs. Should a named statement reach
/// a server connection where another client left a statement of the same
/// name, or none, the lock call fails with
/// [`ErrorKind::UnexpectedReply`](crate::ErrorKind::UnexpectedReply) and
/// the SQLSTATE: lockkit checks every reply and never reports a lock it did
/// not see granted.
#[derive(Debug)]
pub struct LockClient {
    client: Client,
    locker: Locker,
    cache: StatementCache,
}

impl LockClient {
    /// Wraps `client` for `locker`. Prepares nothing yet.
    pub fn new(locker: &Locker, client: Client) -> Self {
        LockClient {
            client,
            locker: locker.clone(),
            cache: StatementCache::default(),
        }
    }

    /// The locker.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// Starts a transaction that can take advisory locks.
    ///
    /// # Errors
    ///
    /// When `BEGIN` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if dropped after `BEGIN` was sent, tokio-postgres rolls
    /// the transaction back before the client's next statement.
    pub async fn begin(&mut self) -> Result<LockTx<'_>, Error> {
        let tx = self.client.transaction().await?;
        let cache = match self.locker.policy().config().statement_mode() {
            StatementMode::Prepared => Some(&self.cache),
            StatementMode::Unnamed => None,
        };
        Ok(LockTx::new(self.locker.clone(), tx, cache))
    }

    /// The client back.
    pub fn into_inner(self) -> Client {
        self.client
    }
}

impl Deref for LockClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for LockClient {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// Runs [`sql::SERVER_FACTS`] on `client`.
pub(crate) async fn server_facts(client: &Client) -> Result<FactsRow, Error> {
    let probes: Vec<&str> = HASHTEXT_PROBES.to_vec();
    let row = client
        .query_typed_one(sql::SERVER_FACTS, &[(&probes, Type::TEXT_ARRAY)])
        .await?;
    Ok(FactsRow::read(&row)?)
}
