//! Session-level advisory locks that cannot leak: [`SessionLock`] and its
//! [`SessionGuard`].
//!
//! A session lock (`pg_advisory_lock`) outlives transactions, which is what
//! "only one payroll run at a time" or leader election need, and is what
//! makes it dangerous on a pooled connection: one missed unlock leaves the
//! key locked on a connection that goes back to the pool. Here every session
//! lock owns a connection of its own, opened for it and closed with it, so
//! the lock ends when the guard drops, whatever path the code takes (an
//! early return, a `?`, a panic, a cancelled task): the server ends the
//! session and releases its locks with it.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, NoTls, Row, SimpleQueryMessage};

use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql::{self, timeout_setting, CHECK_CLIENT, HOLDS};
use crate::key::{AdvisoryKey, KeyForm, LockKey};
use crate::pg::locker::Locker;

/// Whether a lock waits, and how long.
#[derive(Clone, Copy, Debug)]
enum Wait {
    Forever,
    Try,
    Timeout(Duration),
}

/// Takes session-level advisory locks, each on a dedicated connection.
///
/// Every lock opens its own connection from the `tokio_postgres::Config`
/// (without TLS), checks the server, takes the lock and hands back a
/// [`SessionGuard`] that owns the connection. Dropping the guard closes the
/// connection, and the server releases the lock with the session, so a
/// session lock cannot leak into a pool or outlive the task that holds it.
///
/// Before locking it refuses:
/// - a hot standby ([`Error::HotStandby`]; see
///   [`allow_standby`](Self::allow_standby)): locks there exclude nothing on
///   the primary;
/// - a transaction-mode pooler ([`Error::PooledConnection`]; see
///   [`probe_pooler`]): the lock would stay on a server connection that
///   other clients get, and the unlock could reach another backend.
///
/// # Example
///
/// ```no_run
/// use lockkit::{AdvisoryKey, SessionLock};
///
/// #[derive(AdvisoryKey)]
/// struct PayrollRun {
///     month: &'static str,
/// }
///
/// # async fn run() -> Result<(), lockkit::Error> {
/// let config: tokio_postgres::Config = "postgres://app@db/app".parse().unwrap();
/// let sessions = SessionLock::new(config);
/// match sessions.try_lock(PayrollRun { month: "2024-05" }).await? {
///     Ok(guard) => {
///         tokio::select! {
///             _ = guard.lost() => eprintln!("lost the lock: stop acting on it"),
///             _ = async { /* the payroll run */ } => {}
///         }
///         let was_held = guard.release().await?;
///         assert!(was_held);
///     }
///     Err(_month) => println!("another payroll run is in progress"),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SessionLock {
    config: tokio_postgres::Config,
    allow_standby: bool,
    pooler_check: bool,
}

impl SessionLock {
    /// Session locks on connections made from `config`.
    pub fn new(config: tokio_postgres::Config) -> Self {
        SessionLock {
            config,
            allow_standby: false,
            pooler_check: true,
        }
    }

    /// Take locks on a hot standby too (refused by default: they exclude
    /// nothing on the primary).
    pub fn allow_standby(mut self, allow: bool) -> Self {
        self.allow_standby = allow;
        self
    }

    /// Whether to probe for a transaction-mode pooler before each lock (on
    /// by default). The probe costs a second, short-lived connection and
    /// three round trips; turn it off only when the configuration is known
    /// to reach PostgreSQL directly.
    pub fn pooler_check(mut self, check: bool) -> Self {
        self.pooler_check = check;
        self
    }

    /// The connection settings.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// Takes `key` exclusive on a new session, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// [`Error::HotStandby`], [`Error::PooledConnection`] and
    /// [`Error::HashtextMismatch`] before locking; [`Error::Deadlock`],
    /// [`Error::ConnectionLost`] and other connection or server errors.
    /// Nothing is held after an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection and cancels
    /// the waiting statement, so the lock is not taken (or, if it was just
    /// granted, released with the session).
    pub async fn lock<K: AdvisoryKey>(&self, key: K) -> Result<SessionGuard<K>, Error> {
        self.acquire(key, Mode::Exclusive, Wait::Forever)
            .await
            .map(expect_granted)
    }

    /// Takes `key` shared on a new session, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn lock_shared<K: AdvisoryKey>(&self, key: K) -> Result<SessionGuard<K>, Error> {
        self.acquire(key, Mode::Shared, Wait::Forever)
            .await
            .map(expect_granted)
    }

    /// Tries `key` exclusive without waiting: the guard, or the key back when
    /// another session holds it.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn try_lock<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        self.acquire(key, Mode::Exclusive, Wait::Try).await
    }

    /// Tries `key` shared without waiting: the guard, or the key back when
    /// another session holds it exclusive.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn try_lock_shared<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        self.acquire(key, Mode::Shared, Wait::Try).await
    }

    /// Takes `key` exclusive, waiting at most `timeout` (the session's
    /// `lock_timeout`, enforced by the server).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the timeout expired; otherwise as
    /// [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn lock_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> Result<SessionGuard<K>, Error> {
        self.acquire(key, Mode::Exclusive, Wait::Timeout(timeout))
            .await
            .map(expect_granted)
    }

    /// Takes `key` shared, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`lock_timeout`](Self::lock_timeout).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn lock_shared_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> Result<SessionGuard<K>, Error> {
        self.acquire(key, Mode::Shared, Wait::Timeout(timeout))
            .await
            .map(expect_granted)
    }

    async fn acquire<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let key = value.lock_key();
        let (client, lost) = open(&self.config).await?;
        let row = crate::pg::locker::server_facts(&client).await?;
        let (facts, backend_pid) = (ServerFacts::from(&row), row.backend_pid);
        if facts.in_recovery() && !self.allow_standby {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if K::KEY_SPEC.form() == KeyForm::HashText {
            facts.check_hashtext()?;
        }
        if self.pooler_check {
            let probe = probe_backends(&client, &self.config, backend_pid).await?;
            if let Some(evidence) = probe.evidence {
                return Err(Error::pooled(backend_pid, evidence));
            }
        }
        if facts.server_version_num() >= 140000 {
            client.simple_query(CHECK_CLIENT).await?;
        }
        let context = match wait {
            Wait::Timeout(timeout) => {
                let setting = timeout_setting(timeout);
                client
                    .simple_query(&format!("SET lock_timeout = '{setting}'"))
                    .await?;
                Some(timeout)
            }
            Wait::Forever | Wait::Try => None,
        };
        let started = std::time::Instant::now();
        let cancel = CancelOnDrop(Some(client.cancel_token()));
        let rows = key_query(
            &client,
            sql::session_lock(key, mode, matches!(wait, Wait::Try)),
            key,
        )
        .await
        .map_err(|e| {
            DriverError::from(e).into_error_in(context.map(|t| (t, started.elapsed())), 1)
        })?;
        cancel.disarm();
        if matches!(wait, Wait::Try) && !first_bool(&rows)? {
            // Dropping the client closes the session: nothing is held.
            return Ok(Err(value));
        }
        if let Wait::Timeout(_) = wait {
            client.simple_query("RESET lock_timeout").await?;
        }
        Ok(Ok(SessionGuard {
            value,
            key,
            mode,
            backend_pid,
            client,
            lost,
        }))
    }
}

impl Locker {
    /// Session locks on connections made from `config`, with this locker's
    /// standby policy ([`Config::allow_standby`](crate::Config::allow_standby)).
    ///
    /// The locker's transactions and the session locks take keys from the
    /// same key spaces, so an xact lock and a session lock on one key
    /// exclude each other.
    pub fn session(&self, config: tokio_postgres::Config) -> SessionLock {
        SessionLock::new(config).allow_standby(self.config().allow_standby)
    }
}

fn expect_granted<K>(result: Result<SessionGuard<K>, K>) -> SessionGuard<K> {
    match result {
        Ok(guard) => guard,
        Err(_) => unreachable!("a waiting lock is granted or fails"),
    }
}

/// A session-level advisory lock, held by a connection of its own.
///
/// The lock is held until [`release`](Self::release), until the guard drops
/// (which closes the connection: the server ends the session and releases
/// its locks), or until the connection is lost (a network failure, a server
/// restart, `pg_terminate_backend`): then the server has released the lock
/// and another session may hold it. A leader must therefore stop acting as
/// one as soon as [`lost`](Self::lost) resolves, and can ask
/// [`is_held`](Self::is_held) at any time.
///
/// Dropping the guard inside a tokio runtime closes the connection at once
/// (its task sends the termination message). The guard is `Send + Sync`
/// and dereferences to the key value.
#[must_use = "the session lock is released when the guard drops; bind it to a variable for as long as the work needs the lock"]
pub struct SessionGuard<K> {
    value: K,
    key: LockKey,
    mode: Mode,
    backend_pid: i32,
    client: Client,
    lost: watch::Receiver<bool>,
}

impl<K: fmt::Debug> fmt::Debug for SessionGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("value", &self.value)
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("backend_pid", &self.backend_pid)
            .field("held", &self.is_held())
            .finish()
    }
}

impl<K> Deref for SessionGuard<K> {
    type Target = K;

    fn deref(&self) -> &K {
        &self.value
    }
}

impl<K> SessionGuard<K> {
    /// The lock key.
    pub fn key(&self) -> LockKey {
        self.key
    }

    /// The mode the key is held in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The key value.
    pub fn value(&self) -> &K {
        &self.value
    }

    /// The server process of the lock's session (`pg_locks.pid`).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Whether the lock's connection is still open. `false` means the lock
    /// is gone; `true` means the client has not seen the connection end (a
    /// silent network partition is noticed only when TCP gives up; use
    /// [`check`](Self::check) to ask the server).
    pub fn is_held(&self) -> bool {
        !self.client.is_closed() && !*self.lost.borrow()
    }

    /// A future that resolves when the lock's connection ends, and with it
    /// the lock. It owns what it needs (`'static`), so a leader can
    /// `select!` on it while it works.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            // An error means the connection task is gone: lost as well.
            let _ = lost.wait_for(|lost| *lost).await;
        }
    }

    /// Asks the server whether this session holds the lock (`pg_locks`).
    ///
    /// # Errors
    ///
    /// A server error other than a lost connection (which answers `false`).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn check(&self) -> Result<bool, Error> {
        let id = self.key.to_pg_locks();
        let (classid, objid) = (i64::from(id.classid), i64::from(id.objid));
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&classid, Type::INT8),
            (&objid, Type::INT8),
            (&id.objsubid, Type::INT2),
        ];
        let result = self.client.query_typed_one(HOLDS, &params).await;
        match result {
            Ok(row) => Ok(row.try_get(0)?),
            Err(e) => match Error::from(e) {
                e if e.is_connection_lost() => Ok(false),
                e => Err(e),
            },
        }
    }

    /// Unlocks explicitly and closes the connection. Answers whether the
    /// server really held the lock (`pg_advisory_unlock`'s result).
    ///
    /// # Errors
    ///
    /// [`Error::ConnectionLost`] when the connection was already gone: the
    /// server released the lock when the session ended, possibly long ago.
    /// Other server errors; the connection is closed either way.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if dropped, the connection is closed and the lock
    /// released with the session.
    pub async fn release(self) -> Result<bool, Error> {
        let SessionGuard {
            key,
            mode,
            client,
            mut lost,
            ..
        } = self;
        let result = key_query(&client, sql::session_unlock(key, mode), key).await;
        drop(client);
        // The connection task sends the termination message and ends.
        let _ = lost.wait_for(|lost| *lost).await;
        first_bool(&result?)
    }
}

/// What [`probe_pooler`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolerProbe {
    backend_pid: i32,
    evidence: Option<String>,
}

impl PoolerProbe {
    /// The server backend the probed connection was on first.
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Whether the connection goes through a transaction-mode pooler.
    pub fn is_transaction_pooled(&self) -> bool {
        self.evidence.is_some()
    }

    /// What gave the pooler away, when it did.
    pub fn evidence(&self) -> Option<&str> {
        self.evidence.as_deref()
    }
}

/// Whether connections made from `config` go through a transaction-mode
/// pooler: the check [`SessionLock`] makes before every lock.
///
/// On its own connection it reads `pg_backend_pid()` in two transactions;
/// then a second client opens a transaction, and the first reads its pid
/// again. Directly connected, the pid never changes and the second client
/// has another. Behind a transaction-mode pooler the backend is returned to
/// the pool after each transaction: pgbouncer hands the one released last
/// to the next client, so the second client gets the first one's backend,
/// or, when it does not, the first client moves to another. A session-mode
/// pooler keeps each client on one backend and is not reported.
///
/// # Errors
///
/// When a connection or a query fails.
///
/// # Cancel safety
///
/// Cancel safe: both connections are closed when the future drops.
pub async fn probe_pooler(config: &tokio_postgres::Config) -> Result<PoolerProbe, Error> {
    let (client, _lost) = open(config).await?;
    let first = backend_pid(&client).await?;
    probe_backends(&client, config, first).await
}

async fn probe_backends(
    client: &Client,
    config: &tokio_postgres::Config,
    first: i32,
) -> Result<PoolerProbe, Error> {
    let pooled = |evidence: String| PoolerProbe {
        backend_pid: first,
        evidence: Some(evidence),
    };
    let again = backend_pid(client).await?;
    if again != first {
        return Ok(pooled(format!(
            "the next transaction ran on backend {again}"
        )));
    }
    let (other, _other_lost) = open(config).await?;
    other.simple_query("BEGIN").await?;
    let other_pid = backend_pid(&other).await?;
    if other_pid == first {
        return Ok(pooled(
            "another client's transaction was given it while this connection was idle".into(),
        ));
    }
    let after = backend_pid(client).await?;
    drop(other);
    if after != first {
        return Ok(pooled(format!(
            "while another client's transaction was open, this connection moved to backend {after}"
        )));
    }
    Ok(PoolerProbe {
        backend_pid: first,
        evidence: None,
    })
}

/// Connects and runs the connection on a task that flips the returned
/// watch to `true` when the connection ends.
async fn open(config: &tokio_postgres::Config) -> Result<(Client, watch::Receiver<bool>), Error> {
    let (client, connection) = config.connect(NoTls).await?;
    let (ended, lost) = watch::channel(false);
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "lockkit: session lock connection ended");
        }
        let _ = ended.send(true);
    });
    Ok((client, lost))
}

/// `pg_backend_pid()` in a statement of its own (its own transaction).
async fn backend_pid(client: &Client) -> Result<i32, Error> {
    let messages = client.simple_query("SELECT pg_backend_pid()").await?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .ok_or_else(|| Error::with_message(ErrorKind::Database, "pg_backend_pid() returned no row"))
}

/// Runs a one-key statement with unnamed statements only, which
/// transaction-mode poolers without prepared-statement support accept.
async fn key_query(
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

fn first_bool(rows: &[Row]) -> Result<bool, Error> {
    match rows.first() {
        Some(row) => Ok(row.try_get(0)?),
        None => Err(Error::with_message(
            ErrorKind::Database,
            "the lock statement returned no row",
        )),
    }
}

/// Cancels the statement in flight on the server if the acquisition is
/// dropped before it completes.
struct CancelOnDrop(Option<CancelToken>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let (Some(token), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move {
                let _ = token.cancel_query(NoTls).await;
            });
        }
    }
}
