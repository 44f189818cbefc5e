//! Session-duration advisory locks that cannot leak, behind any pooler:
//! [`SessionLock`] and its [`SessionGuard`].
//!
//! # The default form: a transaction held open
//!
//! A session-duration lock ("only one payroll run at a time", leader
//! election, one migrator per fleet) must outlive the short transactions of
//! the work it protects. By default lockkit holds it as
//! `pg_advisory_xact_lock` inside a transaction of its own, on a connection
//! of its own (opened for the lock, or leased from the application's pool),
//! and keeps that transaction open until [`SessionGuard::release`] rolls it
//! back. An open transaction pins its server connection in every pooler
//! (pgbouncer in transaction mode, pgcat, Supavisor, RDS Proxy), so the
//! lock cannot be stranded on a pooled backend, and whatever ends the
//! connection (a drop, a panic, a cancelled task, a network failure, a
//! server restart) ends the transaction and the lock with it. No pooler
//! detection is needed for safety.
//!
//! # What an operator sees
//!
//! The lock's backend is `idle in transaction` in `pg_stat_activity`, with
//! `application_name = 'lockkit session lock <namespace> <key>'` (e.g.
//! `lockkit session lock Payroll -3553327097295050730`, the key type's
//! namespace and the key as `pg_locks` has it; `lockkit inspect` shows
//! `session lock Payroll`; set transaction-locally, never on the
//! connection itself, so the connection has its own name back at the
//! rollback: a transaction-mode pooler would carry a connection's name to
//! the backends it later hands to other clients), `backend_xid` and
//! `backend_xmin` null: the transaction is `READ COMMITTED` and writes
//! nothing, so between statements it holds no snapshot and does not hold
//! back VACUUM. Its
//! `pg_locks` row is the `advisory` lock of the key, `ExclusiveLock` or
//! `ShareLock`.
//!
//! # Keepalive and `idle_in_transaction_session_timeout`
//!
//! One task per [`SessionLock`] (shared by its clones), running while it
//! has locks held, runs lockkit's keepalive statement
//! (`SELECT 1`) inside each held lock's transaction at the lock's cadence
//! ([`SessionLock::keepalive`], 5 s by default; the first within one
//! cadence of the lock). Each keepalive resets the
//! server's `idle_in_transaction_session_timeout`, so a cadence below it
//! keeps the lock. When the cadence is longer (or the keepalives stop), the
//! server fires the timeout: it terminates the session (`FATAL 25P03`), the
//! transaction rolls back and the lock is released, and
//! [`SessionGuard::lost`] resolves: at once on a connection lockkit opened
//! (the connection ends), at the next keepalive on a leased one. An
//! idle-connection killer or a dead peer is noticed the same way; a
//! path gone silent (a half-open TCP connection, a partition: no reply at
//! all) when a keepalive gets no reply within one cadence.
//!
//! Every statement lockkit runs on a held lock's connection (keepalive,
//! [`SessionGuard::check`], [`SessionGuard::release`], the rollback of a
//! dropped guard) waits at most one cadence for its answer; one that gets
//! none gives the lock up and closes the connection. So whatever is in
//! flight, `lost()` resolves within one cadence of a connection lockkit
//! opened closing, and within two cadences of the lock's path going silent
//! (the next keepalive starts within one, and waits at most one); `check()`
//! and `release()` answer within two (one waiting for a statement in flight,
//! one for their own). Once `lost()`
//! resolves the holder must stop acting as the lock's owner.
//!
//! # Bounded waits
//!
//! A network path gone silent never holds a call forever; where a call
//! gives up, it closes the connection and holds nothing:
//! - **Opening a connection** (the TCP connect, TLS and the startup, for
//!   each host of the configuration in turn) waits at most the
//!   configuration's `connect_timeout` per host, or
//!   [`DEFAULT_CONNECT_TIMEOUT`] per host when it sets none, then fails
//!   with [`ErrorKind::ConnectionLost`]. (tokio-postgres itself bounds only
//!   the TCP connect.) A pool's lease (`from_pool`) waits as the pool's own
//!   timeouts say.
//! - **Taking a lock**, once connected: a try waits at most one keepalive
//!   cadence for the server's answers, a `_timeout` call its timeout plus
//!   one cadence (plus the [`probe_timeout`](SessionLock::probe_timeout)
//!   when the session-level form probes for a pooler); past that bound it
//!   fails with [`ErrorKind::Timeout`], never `ConnectionLost`. A server
//!   that does not answer cannot be told from a pooler that is alive and
//!   waiting for a free server connection (a transaction-mode pgbouncer
//!   whose server connections are all pinned by held locks, each lock's
//!   transaction holding one): either way the lock was not granted in
//!   time, and a loop of tries (a leader election) sees a timeout it can
//!   retry, not a lost connection. A multiplexed try on a connection it
//!   already holds waits for no server connection. A call that waits for
//!   the key as long as it takes is not bounded: a silent path cannot be
//!   told apart from a key held for long; bound it with
//!   `tokio::time::timeout` (it is cancel safe) or a `_timeout` call.
//! - **Holding a lock**: see the keepalive above.
//!
//! # Multiplexed locks
//!
//! A [`SessionLock`] in the [`SessionForm::Multiplexed`] form holds any
//! number of locks over at most [`SessionLock::connections`] connections
//! ([`DEFAULT_CONNECTIONS`] by default), for the worker per tenant, shard or
//! feed that holds thousands of long-lived locks: 10,000 held at once over
//! 8 connections is tested, direct and through transaction-mode pgbouncer.
//! Each lock is taken and released on its own, with `pg_try_advisory_lock`
//! and `pg_advisory_unlock` (one round trip each, sent unnamed, so that no
//! statement name can meet another client's on a pooled server connection),
//! inside a transaction each connection holds open
//! for as long as it lives:
//! - **Behind any pooler.** The open transaction pins the connection's
//!   backend, so no lock can be stranded on a pooled backend; the
//!   transaction is never ended. A connection is closed instead, once it
//!   has held nothing for a keepalive cadence, or when anything fails on
//!   it; a client that goes away (closed, crashed, killed with `kill -9`)
//!   ends the session too, since a pooler closes a backend its client left
//!   inside a transaction, and the server releases every lock on it. Tested
//!   through transaction-mode pgbouncer: the locks are gone as soon as the
//!   pooler sees the client's socket close, with no timeout involved.
//! - **A try never waits, and a wait never delays another lock.** A free
//!   key is granted in one round trip on a multiplexed connection. A
//!   waiting call ([`SessionLock::lock`], [`SessionLock::lock_timeout`], …)
//!   that finds the key held takes a connection of its own in the default
//!   form ([`SessionGuard::form`] says which), since a connection waiting
//!   for one key would hold up every statement of the others on it.
//! - **One holder per key.** Session-level locks are re-entrant on their
//!   session, so the `SessionLock` (and its clones) keeps a table of the
//!   keys it holds or has a statement in flight for: a try for a key it
//!   holds answers busy at once, with no second grant. A key stays in the
//!   table until its guard is released or dropped, even once `lost()` has
//!   resolved: drop a lost guard to take its key again.
//! - **Losses are per connection.** Each connection has a keepalive at the
//!   cadence, as in the default form. When a connection ends (terminated
//!   backend, restart, lost network) or a statement on it fails or gets no
//!   answer within a cadence, it is closed and [`SessionGuard::lost`]
//!   resolves for every lock it held, once its connection slot has
//!   forgotten it: a lock taken again from then on goes to a new
//!   connection. A try that finds its connection ended before the keeper
//!   saw it ([`ErrorKind::ConnectionLost`]) is made once more, on a new
//!   connection. [`SessionGuard::check`] answering anything but `true`
//!   gives the whole connection up.
//! - **Cut-off calls.** A try or release whose future is dropped while its
//!   statement is in flight leaves its key claimed until a task has sent
//!   the key's unlock after it and read the answer; should that fail, or
//!   no runtime be left to run it, the connection is closed. A guard
//!   dropped without release is unlocked the same way.
//!
//! The connections' backends show `application_name` =
//! [`MULTIPLEXED_NAME`] and `idle in transaction`, with no `backend_xid`.
//! A statement's snapshot stays open in the transaction until the
//! connection's next statement; once a connection has run none for 100 ms,
//! a simple query drops it, so that `backend_xmin` is null: a connection
//! holds back VACUUM only while it is busy, and then only by its last
//! statement's snapshot.
//! On a pool (`from_pool`), each connection is leased for its life and
//! never returned (a connection given up closes when its last guard
//! drops); size the pool for them and for the waits that take connections
//! of their own, since a lease waits for the pool.
//!
//! # The plain session-level form
//!
//! [`SessionForm::SessionLevel`] takes `pg_advisory_lock` instead: no
//! transaction stays open, but the lock is bound to the server session, so
//! it is safe only on a direct connection (or a session-mode pool). It is
//! refused when [`probe_pooler`] sees a transaction-mode pooler. Its
//! backend shows the same `application_name` as the default form's, set
//! session-wide once the probe has passed, on connections lockkit opens
//! (a leased pool connection keeps its own).

use std::fmt;
use std::num::NonZeroU8;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use crate::engine::error::Error;
#[cfg(doc)]
use crate::engine::error::ErrorKind;
use crate::engine::plan::Mode;
#[cfg(doc)]
use crate::engine::sql;
use crate::engine::Wait;
use crate::key::AdvisoryKey;
use crate::pg::locker::Locker;

mod conn;
mod guard;
mod keeper;
mod mux;
mod probe;
mod simple;
mod take;
mod wire;

pub use guard::SessionGuard;
pub use probe::{probe_pooler, PoolerProbe, ProbeTimeout};

use conn::{Direct, Source};
use keeper::Keeper;
use mux::Mux;
pub use mux::MULTIPLEXED_NAME;

/// How many connections the [`SessionForm::Multiplexed`] form opens at most
/// unless [`SessionLock::connections`] says otherwise.
pub const DEFAULT_CONNECTIONS: usize = 4;

/// The keepalive cadence unless [`SessionLock::keepalive`] says otherwise.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);

/// How long [`probe_pooler`] (and a session-level lock's probe) may take
/// unless [`SessionLock::probe_timeout`] says otherwise.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long opening a lock's connection may take, per host of the
/// configuration, when its `connect_timeout` is not set: see
/// [Bounded waits](self#bounded-waits).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How a [`SessionLock`] holds its locks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SessionForm {
    /// `pg_advisory_xact_lock` inside a transaction held open on the lock's
    /// connection, rolled back at release: safe behind any pooler (the
    /// default).
    #[default]
    Transaction,
    /// `pg_advisory_lock` on the lock's session, unlocked at release: for
    /// direct connections only; refused behind a transaction-mode pooler
    /// (see [`SessionLock::pooler_check`]).
    SessionLevel,
    /// Any number of locks over a few connections
    /// ([`SessionLock::connections`], [`DEFAULT_CONNECTIONS`] by default):
    /// `pg_advisory_lock` on connections that each hold a transaction open
    /// for as long as they live and are closed, never committed, once they
    /// hold nothing. Safe behind any pooler, as the default form; see
    /// [Multiplexed locks](self#multiplexed-locks).
    Multiplexed,
}

/// Takes session-duration advisory locks, each on a connection of its own.
///
/// Every lock opens its own connection from a `tokio_postgres::Config`
/// ([`new`](Self::new), or [`with_tls`](Self::with_tls)), or leases one
/// from the application's deadpool-postgres pool (`from_pool`, feature
/// `deadpool`), for the life of the lock. In the default
/// [`SessionForm::Transaction`] it opens a transaction there and takes
/// `pg_advisory_xact_lock` inside (see the [module docs](self)); the
/// [`SessionGuard`] it hands back keeps the transaction open, with a
/// keepalive, until it is released, dropped or lost.
///
/// Before handing out a lock it refuses:
/// - a hot standby ([`ErrorKind::HotStandby`]; see
///   [`allow_standby`](Self::allow_standby)): locks there exclude nothing on
///   the primary;
/// - `HashText` keys when the server's `hashtext` differs from lockkit's
///   ([`ErrorKind::HashtextMismatch`]);
/// - in the [`SessionForm::SessionLevel`] form only, a transaction-mode
///   pooler ([`ErrorKind::PooledConnection`]; see [`probe_pooler`]).
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
#[derive(Clone)]
pub struct SessionLock {
    source: Source,
    form: SessionForm,
    allow_standby: bool,
    pooler_check: bool,
    /// Keeps the held locks alive at the cadence
    /// ([`keepalive`](Self::keepalive)); shared by clones.
    keeper: Arc<Keeper>,
    probe_timeout: Duration,
    /// The multiplexed form's connections and claimed keys; shared by
    /// clones.
    mux: Arc<Mux>,
    /// The most keys the multiplexed form holds at once
    /// ([`multiplexed_budget`](Self::multiplexed_budget)); `None`: half the
    /// server's shared lock table.
    mux_budget: Option<usize>,
    /// Whether a lock's set-up saw that the server has
    /// `client_connection_check_interval` (PostgreSQL 14+): the next
    /// set-ups set it with the cheaper `SET LOCAL` form
    /// ([`sql::write_session_setup`]). Shared by clones; cleared when that
    /// form fails because the server has no such setting.
    check_interval_known: Arc<AtomicBool>,
}

impl fmt::Debug for SessionLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLock")
            .field("source", &self.source)
            .field("form", &self.form)
            .field("allow_standby", &self.allow_standby)
            .field("pooler_check", &self.pooler_check)
            .field("keepalive", &self.keeper.cadence)
            .field("connections", &self.mux.max())
            .field("multiplexed_budget", &self.mux_budget)
            .field("probe_timeout", &self.probe_timeout)
            .finish()
    }
}

impl SessionLock {
    /// Session locks on connections made from `config`, without TLS.
    pub fn new(config: tokio_postgres::Config) -> Self {
        Self::with_tls(config, NoTls)
    }

    /// Session locks on connections made from `config` through `tls`, a
    /// tokio-postgres TLS connector (e.g. `postgres_openssl::MakeTlsConnector`
    /// or `tokio_postgres_rustls::MakeRustlsConnect`), as
    /// `config.connect(tls)` would make them; `sslmode` is the config's.
    /// Cancel requests for an abandoned wait go through `tls` too.
    pub fn with_tls<T>(config: tokio_postgres::Config, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Self::from_source(Source::Connect(Arc::new(Direct { config, tls })))
    }

    /// Session locks on connections leased from the application's
    /// deadpool-postgres `pool` for the life of each lock (feature
    /// `deadpool`).
    ///
    /// A release rolls the lock's transaction back and returns the
    /// connection to the pool. A guard dropped without release rolls back
    /// on its task and returns the connection only when the rollback
    /// completed; otherwise (a failed or cut-short rollback, a lost
    /// connection, the runtime shutting down) the connection is detached
    /// from the pool and closed, which ends the transaction on the server.
    /// A connection is never returned with a lock on it.
    ///
    /// A pooled connection keeps its own name: a lock's
    /// `application_name` is set transaction-locally, as on every
    /// connection.
    #[cfg(feature = "deadpool")]
    pub fn from_pool(pool: deadpool_postgres::Pool) -> Self {
        Self::from_source(Source::Pool(pool))
    }

    fn from_source(source: Source) -> Self {
        SessionLock {
            source,
            form: SessionForm::Transaction,
            allow_standby: false,
            pooler_check: true,
            keeper: Keeper::new(DEFAULT_KEEPALIVE),
            mux: Mux::new(DEFAULT_CONNECTIONS),
            mux_budget: None,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
            check_interval_known: Arc::new(AtomicBool::new(false)),
        }
    }

    /// How the locks are held: [`SessionForm::Transaction`] (the default,
    /// safe behind any pooler), [`SessionForm::Multiplexed`] (many locks
    /// over a few connections, safe behind any pooler) or
    /// [`SessionForm::SessionLevel`] (plain `pg_advisory_lock`, for direct
    /// connections).
    pub fn form(mut self, form: SessionForm) -> Self {
        self.form = form;
        self
    }

    /// For the [`SessionForm::Multiplexed`] form: at most `connections`
    /// connections hold the locks taken without waiting
    /// ([`DEFAULT_CONNECTIONS`] by default; at least 1, at most 64). Shared
    /// by the clones made after this call; clones made before keep their
    /// own connections (and their own table of claimed keys).
    pub fn connections(mut self, connections: usize) -> Self {
        self.mux = Mux::new(connections.clamp(1, 64));
        self
    }

    /// For the [`SessionForm::Multiplexed`] form: at most `max` keys held
    /// (or being taken) at once over all its connections. Each is an entry
    /// of the server's shared lock table, which every session's relation
    /// and advisory locks share, and which, full, fails other sessions'
    /// statements with `53200`. By default the budget is half the table
    /// (`max_locks_per_transaction × (max_connections +
    /// max_prepared_transactions) / 2`, learned when the first connection
    /// opens), as [`Config::concurrent_lockers`](crate::Config::concurrent_lockers)
    /// sizes a transaction's. A take past it is refused with
    /// [`ErrorKind::BudgetExceeded`] before anything is sent for it.
    ///
    /// A take the server refuses all the same (the table filled by other
    /// sessions) fails alone, with [`ErrorKind::LockTableFull`]: the other
    /// locks on its connection are kept.
    pub fn multiplexed_budget(mut self, max: usize) -> Self {
        self.mux_budget = Some(max);
        self
    }

    /// Take locks on a hot standby too (refused by default: they exclude
    /// nothing on the primary).
    pub fn allow_standby(mut self, allow: bool) -> Self {
        self.allow_standby = allow;
        self
    }

    /// For the [`SessionForm::SessionLevel`] form: whether to probe for a
    /// transaction-mode pooler before each lock (on by default). The probe
    /// costs a second, short-lived connection and three round trips,
    /// bounded by [`probe_timeout`](Self::probe_timeout); turn it off only
    /// when the connections are known to reach PostgreSQL directly. The
    /// default form needs no probe and ignores this.
    pub fn pooler_check(mut self, check: bool) -> Self {
        self.pooler_check = check;
        self
    }

    /// The keepalive cadence of each lock's connection (5 s by default; at
    /// least 1 ms). Keep it below the server's
    /// `idle_in_transaction_session_timeout`, or the server ends the lock's
    /// session (see the [module docs](self)). [`SessionGuard::lost`]
    /// resolves within one cadence of the lock being gone. One task keeps
    /// all the held locks of this `SessionLock` and of its clones made
    /// after this call; clones made before keep their own cadence. It runs
    /// on the runtime of the lock that started it: should that runtime
    /// shut down while locks taken on another runtime are held, they are
    /// given up (`lost()` resolves, their connections close), so use one
    /// `SessionLock` per runtime. The cadence is also how long a try waits
    /// for the server's answers once connected (see
    /// [Bounded waits](self#bounded-waits)).
    pub fn keepalive(mut self, cadence: Duration) -> Self {
        // A keeper of its own: the clones made before keep their cadence.
        self.keeper = Keeper::new(cadence.max(Duration::from_millis(1)));
        self
    }

    /// The bound on the pooler probe ([`probe_pooler`](Self::probe_pooler)
    /// and the session-level form's check), 2 s by default: on a saturated
    /// pool it gives up with [`ProbeTimeout`] instead of waiting for a
    /// second connection.
    pub fn probe_timeout(mut self, timeout: Duration) -> Self {
        self.probe_timeout = timeout;
        self
    }

    /// The connection settings, when the locks open their own connections
    /// (`None` for a pool).
    pub fn config(&self) -> Option<&tokio_postgres::Config> {
        match &self.source {
            Source::Connect(connect) => Some(connect.config()),
            #[cfg(feature = "deadpool")]
            Source::Pool(_) => None,
        }
    }

    /// Takes `key` exclusive, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::HotStandby`], [`ErrorKind::HashtextMismatch`] and (session-level
    /// form) [`ErrorKind::PooledConnection`] or a [`ProbeTimeout`] before the
    /// lock is handed out; [`ErrorKind::Deadlock`], [`ErrorKind::ConnectionLost`]
    /// and other connection, pool or server errors. Nothing is held after
    /// an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future cancels the waiting statement and
    /// closes (or, for a pool, detaches and closes) the connection, so the
    /// lock is not taken, or, if it was just granted, released with the
    /// connection.
    pub async fn lock<K: AdvisoryKey>(&self, key: K) -> Result<SessionGuard<K>, Error> {
        self.acquire(key, Mode::Exclusive, Wait::Forever)
            .await
            .map(expect_granted)
    }

    /// Takes `key` shared, waiting as long as it takes.
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
    /// As [`lock`](Self::lock), and [`ErrorKind::Timeout`] when the server
    /// (or a pooler waiting for a free server connection) did not answer
    /// within one keepalive cadence ([Bounded waits](self#bounded-waits)):
    /// nothing is held.
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

    /// Takes `key` exclusive, waiting at most `timeout` (`lock_timeout`,
    /// enforced by the server; the connection's own set-up is not counted).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Timeout`] when the timeout expired; otherwise as
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
}

/// A semaphore's permits, held for a session: see
/// [`LockTx::acquire_permit`](crate::LockTx::acquire_permit) for the
/// semaphore itself (slots, waiting, fairness). Each permit holds a
/// connection of its own, in the default form (whatever
/// [`form`](SessionLock::form) says), and its guard names the slot's key.
impl SessionLock {
    /// Takes a permit of the semaphore of `permits` permits named by `key`,
    /// waiting as long as it takes. A free slot is taken in the one query
    /// that opens the permit's transaction.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn acquire_permit<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
    ) -> Result<SessionGuard<K>, Error> {
        self.permit(key, permits, Wait::Forever)
            .await
            .map(expect_granted)
    }

    /// Takes a permit, waiting at most `timeout` once every slot is found
    /// busy.
    ///
    /// # Errors
    ///
    /// As [`lock_timeout`](Self::lock_timeout).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn acquire_permit_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
        timeout: Duration,
    ) -> Result<SessionGuard<K>, Error> {
        self.permit(key, permits, Wait::Timeout(timeout))
            .await
            .map(expect_granted)
    }

    /// Takes a permit if a slot is free, without waiting: the guard, or the
    /// key back when every slot is busy.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    pub async fn try_acquire_permit<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        self.permit(key, permits, Wait::Try).await
    }

    async fn permit<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
        wait: Wait,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let take = take::Take::Permit(permits);
        self.acquire_own(key, take, wait, SessionForm::Transaction)
            .await
    }
}

impl Locker {
    /// Session locks on connections made from `config` (without TLS), with
    /// this locker's standby policy
    /// ([`Config::allow_standby`](crate::Config::allow_standby)).
    ///
    /// The locker's transactions and the session locks take keys from the
    /// same key spaces, so an xact lock and a session lock on one key
    /// exclude each other.
    pub fn session(&self, config: tokio_postgres::Config) -> SessionLock {
        SessionLock::new(config).allow_standby(self.policy().config().allow_standby)
    }
}

fn expect_granted<K>(result: Result<SessionGuard<K>, K>) -> SessionGuard<K> {
    match result {
        Ok(guard) => guard,
        Err(_) => unreachable!("a waiting lock is granted or fails"),
    }
}
