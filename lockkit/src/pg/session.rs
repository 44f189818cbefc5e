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
//! `session lock Payroll`; set on every connection lockkit opens,
//! and transaction-locally on a leased pool connection, which gets its own
//! name back at the rollback), `backend_xid` and `backend_xmin` null: the
//! transaction is `READ COMMITTED` and writes nothing, so between
//! statements it holds no snapshot and does not hold back VACUUM. Its
//! `pg_locks` row is the `advisory` lock of the key, `ExclusiveLock` or
//! `ShareLock`.
//!
//! # Keepalive and `idle_in_transaction_session_timeout`
//!
//! One task per [`SessionLock`] (shared by its clones), running while it
//! has locks held, runs [`KEEPALIVE`](crate::engine::sql::KEEPALIVE)
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
//! # The plain session-level form
//!
//! [`SessionForm::SessionLevel`] takes `pg_advisory_lock` instead: no
//! transaction stays open, but the lock is bound to the server session, so
//! it is safe only on a direct connection (or a session-mode pool). It is
//! refused when [`probe_pooler`] sees a transaction-mode pooler.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use futures_util::future::{join, BoxFuture};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls, Row, SimpleQueryMessage, Socket};

use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::facts::ServerFacts;
use crate::engine::plan::Mode;
use crate::engine::sql::{self, timeout_setting, CHECK_CLIENT, HOLDS};
use crate::engine::{self, read_reply, Policy, ReplyRow, ReplyShape, Request, TxState};
use crate::key::{AdvisoryKey, KeyForm, LockKey};
use crate::pg::exec::{CancelOnDrop, Canceller};
use crate::pg::locker::{server_facts, Locker};

/// The keepalive cadence unless [`SessionLock::keepalive`] says otherwise.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);

/// How long [`probe_pooler`] (and a session-level lock's probe) may take
/// unless [`SessionLock::probe_timeout`] says otherwise.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `application_name` of the pooler probe's connections.
const PROBE_NAME: &str = "lockkit pooler probe";

/// Whether a lock waits, and how long.
#[derive(Clone, Copy, Debug)]
enum Wait {
    Forever,
    Try,
    Timeout(Duration),
}

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
    /// A pooled connection is not lockkit's to rename: its
    /// `application_name` is set transaction-locally for the lock.
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
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
            check_interval_known: Arc::new(AtomicBool::new(false)),
        }
    }

    /// How the locks are held: [`SessionForm::Transaction`] (the default,
    /// safe behind any pooler) or [`SessionForm::SessionLevel`] (plain
    /// `pg_advisory_lock`, for direct connections).
    pub fn form(mut self, form: SessionForm) -> Self {
        self.form = form;
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
    /// `SessionLock` per runtime.
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

    /// Whether this lock's connections go through a transaction-mode
    /// pooler: [`probe_pooler`] on a connection from this lock's source
    /// (its config and TLS, or its pool), bounded by
    /// [`probe_timeout`](Self::probe_timeout).
    ///
    /// # Errors
    ///
    /// [`ProbeTimeout`] (inside [`ErrorKind::Database`]) when the probe did not
    /// finish in time, e.g. on a pool with no second connection free;
    /// connection, pool and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: its connections are closed, or returned to the pool
    /// only after their transaction ended, when the future drops.
    pub async fn probe_pooler(&self) -> Result<PoolerProbe, Error> {
        self.bounded(async {
            let (mut lease, _) = self.lease(PROBE_NAME).await?;
            let first = backend_pid(lease.client()).await?;
            let probe = self.probe_backends(&lease, first).await?;
            // Only statements in autocommit ran on it: a pooled connection
            // may go back.
            lease.clean = true;
            Ok(probe)
        })
        .await
    }

    async fn acquire<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let key = value.lock_key();
        let hashtext = K::KEY_SPEC.form() == KeyForm::HashText;
        let name = AppName(K::KEY_SPEC.namespace(), key);
        let (lease, canceller) = self.lease(&name).await?;
        let mut cancel = CancelOnDrop::new(lease.client(), &canceller, || ());
        let taken = match self.form {
            SessionForm::Transaction => {
                let request = Request::key_of::<K>(key, mode);
                self.lock_in_transaction(&lease, request, wait, &name, hashtext)
                    .await
            }
            SessionForm::SessionLevel => {
                self.lock_session_level(&lease, key, mode, wait, hashtext)
                    .await
            }
        };
        cancel.disarm();
        drop(cancel);
        match taken {
            Ok((true, backend_pid)) => Ok(Ok(self.hold(value, key, mode, backend_pid, lease))),
            Ok((false, _)) => {
                self.discard(lease, true).await;
                Ok(Err(value))
            }
            Err(e) => {
                self.discard(lease, false).await;
                Err(e)
            }
        }
    }

    /// The default form: opens the transaction, sets it up and takes the
    /// lock in one simple-protocol query (one message, one round trip; see
    /// [`simple_round`]), then checks the server's facts. Answers whether
    /// the lock was granted and the backend pid.
    async fn lock_in_transaction(
        &self,
        lease: &Lease,
        request: Request,
        wait: Wait,
        name: &AppName,
        hashtext: bool,
    ) -> Result<(bool, i32), Error> {
        let client = lease.client();
        // The facts (HashText keys only) go first, outside the transaction:
        // they are the server's, not the backend's. Then one query:
        // `BEGIN; set-up; lock`. Should BEGIN fail, nothing after it runs
        // (a simple query stops at its first error). It is the last thing
        // sent, and the simple protocol leaves no portal open, so the held
        // transaction holds no snapshot (no `backend_xmin`), with no
        // statement after it.
        let take = take_xact_lock(client, request, wait, name, &self.check_interval_known);
        let (facts, taken) = match hashtext {
            true => {
                let (facts, taken) = join(server_facts(client), take).await;
                (Some(facts), taken)
            }
            false => (None, take.await),
        };
        let (setup, granted) = taken?;
        let (in_recovery, backend_pid) = setup;
        if in_recovery && !self.allow_standby {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if let Some(facts) = facts {
            ServerFacts::from(&facts?).check_hashtext()?;
        }
        Ok((granted?, backend_pid))
    }

    /// The plain session-level form: facts, the pooler probe, then
    /// `pg_advisory_lock`.
    async fn lock_session_level(
        &self,
        lease: &Lease,
        key: LockKey,
        mode: Mode,
        wait: Wait,
        hashtext: bool,
    ) -> Result<(bool, i32), Error> {
        let client = lease.client();
        let row = server_facts(client).await?;
        let (facts, backend_pid) = (ServerFacts::from(&row), row.backend_pid);
        self.refuse(&facts, hashtext)?;
        if self.pooler_check {
            let probe = self
                .bounded(self.probe_backends(lease, backend_pid))
                .await?;
            if let Some(evidence) = probe.evidence {
                return Err(Error::pooled(backend_pid, evidence));
            }
        }
        // Session-wide: only on a connection of lockkit's own.
        if lease.is_owned() && facts.server_version_num() >= 140000 {
            client.batch_execute(CHECK_CLIENT).await?;
        }
        let context = match wait {
            Wait::Timeout(timeout) => {
                let setting = timeout_setting(timeout);
                client
                    .batch_execute(&format!("SET lock_timeout = '{setting}'"))
                    .await?;
                Some(timeout)
            }
            Wait::Forever | Wait::Try => None,
        };
        let started = std::time::Instant::now();
        let rows = key_query(
            client,
            sql::session_lock(key, mode, matches!(wait, Wait::Try)),
            key,
        )
        .await
        .map_err(|e| {
            DriverError::from(e).into_error_in(context.map(|t| (t, started.elapsed())), 1)
        })?;
        let granted = match wait {
            Wait::Try => one_bool(&rows)?,
            Wait::Forever | Wait::Timeout(_) => {
                one_row(&rows, "the lock statement")?;
                true
            }
        };
        if let Wait::Timeout(_) = wait {
            client.batch_execute("RESET lock_timeout").await?;
        }
        Ok((granted, backend_pid))
    }

    fn refuse(&self, facts: &crate::ServerFacts, hashtext: bool) -> Result<(), Error> {
        if facts.in_recovery() && !self.allow_standby {
            return Err(Error::new(ErrorKind::HotStandby));
        }
        if hashtext {
            facts.check_hashtext()?;
        }
        Ok(())
    }

    /// A connection for a lock (or the probe), and how to cancel a
    /// statement on it.
    async fn lease(
        &self,
        application_name: impl fmt::Display,
    ) -> Result<(Lease, Canceller), Error> {
        match &self.source {
            Source::Connect(connect) => {
                let (client, ended) = connect.connect(application_name.to_string()).await?;
                Ok((Lease::owned(client, ended), connect.canceller()))
            }
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => {
                let object = pool.get().await.map_err(pool_error)?;
                // The pool's TLS connector is its own; a cancel request goes
                // without TLS and may be refused. Closing the connection
                // (what a drop does) ends the wait regardless.
                Ok((Lease::pooled(object), Canceller::plain()))
            }
        }
    }

    /// Gives a connection back after a failed or busy acquisition: a pooled
    /// one only once nothing can be held on it.
    async fn discard(&self, mut lease: Lease, busy: bool) {
        if lease.is_owned() {
            return; // Dropping it closes the session.
        }
        lease.clean = match self.form {
            SessionForm::Transaction => lease
                .client()
                .batch_execute(sql::SESSION_ROLLBACK)
                .await
                .is_ok(),
            // A busy try took nothing; after an error, who knows.
            SessionForm::SessionLevel => busy,
        };
    }

    fn hold<K>(
        &self,
        value: K,
        key: LockKey,
        mode: Mode,
        backend_pid: i32,
        lease: Lease,
    ) -> SessionGuard<K> {
        let ended = lease.ended.clone();
        let shared = Arc::new(Shared {
            lease: tokio::sync::Mutex::new(Some(lease)),
            lost: watch::Sender::new(false),
            key,
            mode,
            form: self.form,
            cadence: self.keeper.cadence,
            backend_pid,
        });
        // A connection lockkit opened tells when it ends: its lock is gone
        // at once. (It cost a connection and authentication; one more task
        // is nothing next to that.) A leased one is watched by the keeper.
        if let Some(ended) = ended {
            tokio::spawn(watch_connection(Arc::downgrade(&shared), ended));
        }
        self.keeper.register(&shared);
        SessionGuard {
            value,
            key,
            mode,
            form: self.form,
            backend_pid,
            shared: Holding(shared),
        }
    }

    async fn bounded<T>(&self, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match tokio::time::timeout(self.probe_timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(Error::with_source(
                ErrorKind::Timeout,
                format!(
                    "the pooler probe did not finish within {:?}",
                    self.probe_timeout
                ),
                ProbeTimeout {
                    timeout: self.probe_timeout,
                },
            )),
        }
    }

    /// The probe proper, with the first connection already open and its
    /// backend `first`: see [`probe_pooler`].
    async fn probe_backends(&self, lease: &Lease, first: i32) -> Result<PoolerProbe, Error> {
        let client = lease.client();
        let pooled = |evidence: String| PoolerProbe {
            backend_pid: first,
            evidence: Some(evidence),
        };
        // A session-wide mark of this probe on the backend, read back
        // below: a backend that carries the mark of another client was
        // handed over by a pooler (a direct connection, and a session-mode
        // pooler's `DISCARD ALL`, start every client clean). Concurrent
        // probes mark the pooled backends for one another, so they see the
        // pooler where backend pids alone let several of them miss it.
        let mark = format!("{:016x}", fastrand::u64(1..));
        let (again, found) = read_mark(client, Some(&mark)).await?;
        if again != first {
            return Ok(pooled(format!(
                "the next transaction ran on backend {again}"
            )));
        }
        if let Some(found) = found {
            return Ok(pooled(format!(
                "backend {again} carries another client's pooler probe mark {found}"
            )));
        }
        let (mut other, _) = self.lease(PROBE_NAME).await?;
        other.client().batch_execute("BEGIN").await?;
        let (other_pid, other_found) = read_mark(other.client(), None).await?;
        let after = if other_pid == first {
            None
        } else {
            Some(read_mark(client, None).await?)
        };
        other.clean = other
            .client()
            .batch_execute(sql::SESSION_ROLLBACK)
            .await
            .is_ok();
        drop(other);
        let evidence = match (after, other_found) {
            (None, _) => Some(
                "another client's transaction was given it while this connection was idle".into(),
            ),
            (_, Some(found)) => Some(format!(
                "another client's transaction was given backend {other_pid}, which carries the pooler probe mark {found}"
            )),
            (Some((after, _)), None) if after != first => Some(format!(
                "while another client's transaction was open, this connection moved to backend {after}"
            )),
            (Some((_, found)), None) if found.as_deref() != Some(mark.as_str()) => Some(format!(
                "this connection's backend lost its pooler probe mark (found {found:?})"
            )),
            (Some(_), None) => None,
        };
        if let Some(evidence) = evidence {
            return Ok(pooled(evidence));
        }
        // Directly connected (or session-pooled): take the mark off, so
        // that a pooled connection leased again is not mistaken for one a
        // pooler handed over.
        client.batch_execute(PROBE_UNMARK).await?;
        Ok(PoolerProbe {
            backend_pid: first,
            evidence: None,
        })
    }
}

/// The session-wide setting the pooler probe marks its backend with.
const PROBE_MARK: &str = "lockkit.pooler_probe";

/// Takes the pooler probe's mark off the session.
const PROBE_UNMARK: &str = "SELECT set_config('lockkit.pooler_probe', '', false)";

/// `pg_backend_pid()` and the pooler probe's mark on the backend, if any,
/// in one transaction; with `set`, marks it with `set` afterwards, in the
/// same transaction (so on the same backend). The mark answered is the one
/// found before; with `set`, it is `None` when it was `set` already.
async fn read_mark(client: &Client, set: Option<&str>) -> Result<(i32, Option<String>), Error> {
    let mut query = format!("SELECT pg_backend_pid(), current_setting('{PROBE_MARK}', true)");
    if let Some(set) = set {
        query.push_str(&format!(
            "; SELECT set_config('{PROBE_MARK}', '{set}', false)"
        ));
    }
    let messages = client.simple_query(&query).await?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| Error::unexpected("the pooler probe's query returned no row".into()))?;
    let pid = row
        .get(0)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::unexpected("pg_backend_pid() returned no pid".into()))?;
    let found = row
        .get(1)
        .filter(|mark| !mark.is_empty() && Some(*mark) != set)
        .map(str::to_owned);
    Ok((pid, found))
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
        SessionLock::new(config).allow_standby(self.config().allow_standby)
    }
}

/// The `application_name` of a lock's connection,
/// `lockkit session lock <namespace> <key>` (the key type's namespace
/// first, so that the server's cut at 63 bytes takes the key, which
/// `pg_locks` shows anyway; `lockkit inspect` reads the namespace back):
/// formatted where it is written, never allocated on a pooled lease's path.
#[derive(Clone, Copy)]
struct AppName(&'static str, LockKey);

impl fmt::Display for AppName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lockkit session lock {} {}", self.0, self.1)
    }
}

fn expect_granted<K>(result: Result<SessionGuard<K>, K>) -> SessionGuard<K> {
    match result {
        Ok(guard) => guard,
        Err(_) => unreachable!("a waiting lock is granted or fails"),
    }
}

/// Opens the lock's transaction on `client`, sets it up (named `name`) and
/// takes the transaction-scoped lock inside it through the lock engine (its
/// statements, reply checks and timeouts), all in one simple-protocol
/// query; later rounds of the engine (a timeout's savepoint rollback) go
/// the same way. Answers the set-up row (`in_recovery`, `backend_pid`) and
/// whether the lock was granted (`false`: a try found it busy), or, as the
/// inner error, what the engine made of a failed lock statement. The
/// standby and `hashtext` checks are the caller's.
///
/// # Errors
///
/// The outer error when `BEGIN` or the set-up failed, or their reply was
/// not what they answer: then the engine never saw a reply.
async fn take_xact_lock(
    client: &Client,
    request: Request,
    wait: Wait,
    name: &AppName,
    check_interval_known: &AtomicBool,
) -> Result<((bool, i32), Result<bool, Error>), Error> {
    static POLICY: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(|| {
        Policy::new(
            crate::Config::default()
                .allow_standby(true)
                .order_check(crate::OrderCheck::Off)
                .statements(crate::StatementMode::Unnamed),
            ServerFacts::assumed(1, 1, 0),
        )
    });
    let wait = match wait {
        Wait::Forever => engine::Wait::Forever,
        Wait::Timeout(timeout) => engine::Wait::Timeout(timeout),
        Wait::Try => engine::Wait::Try,
    };
    let state = TxState::new();
    let mut call = state.acquire(&POLICY, 0, request, wait)?;
    let mut query = String::with_capacity(512);
    let mut setup = None;
    let mut first = true;
    while let Some(round) = call.round() {
        query.clear();
        let known = check_interval_known.load(Ordering::Relaxed);
        let prefix = if std::mem::take(&mut first) {
            query.push_str(sql::SESSION_BEGIN);
            query.push_str("; ");
            1 + sql::write_session_setup(&mut query, name, known)
        } else {
            0
        };
        for (i, statement) in round.iter().enumerate() {
            if i > 0 || prefix > 0 {
                query.push_str("; ");
            }
            statement.write_simple(&mut query);
        }
        let (completed, failed) = simple_round(client, &query).await;
        let expected = prefix
            + round
                .iter()
                .map(|s| s.sql().simple_commands())
                .sum::<usize>();
        match &failed {
            Some(e) if completed.len() < prefix => {
                if e.code() == Some(&SqlState::UNDEFINED_OBJECT) {
                    // No `client_connection_check_interval` (the server
                    // is older than the one seen before): the next set-up
                    // asks again.
                    check_interval_known.store(false, Ordering::Relaxed);
                }
                return Err(Error::from(failed.expect("matched Some")));
            }
            None if completed.len() != expected => {
                return Err(Error::unexpected(format!(
                    "the session lock's query answered {} commands, not {expected}",
                    completed.len()
                )));
            }
            _ => {}
        }
        if prefix > 0 {
            // BEGIN answers no row; the set-up one row in its first command
            // and none in the others.
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
            setup = Some((row.bool(0).map_err(bad)?, row.int4(1).map_err(bad)?));
            // The other form's last column: NULL when the server has no
            // `client_connection_check_interval`.
            if !known && row.text(3).is_ok() {
                check_interval_known.store(true, Ordering::Relaxed);
            }
        }
        if let Some(e) = failed {
            call.receive(Err(DriverError::from(e)));
            continue;
        }
        // Each statement's rows; a statement of several commands (a
        // savepoint rollback) answers rows of none of them.
        let mut answers: Vec<&[SimpleRow]> = Vec::with_capacity(round.len());
        let mut next = prefix;
        for statement in &round {
            let commands = statement.sql().simple_commands();
            answers.push(completed.rows(next, next + commands));
            next += commands;
        }
        call.receive_answers(Ok(answers), |statement, rows| match statement.reply() {
            ReplyShape::Done if rows.is_empty() => read_reply::<SimpleRow>(statement, None),
            _ => read_reply(statement, Some(rows)),
        });
    }
    let setup = setup.ok_or_else(|| Error::unexpected("the lock engine sent nothing".into()))?;
    Ok((setup, call.finish().map(|outcome| outcome.is_ok())))
}

/// Sends `query` (statements joined by `;`) with the simple query
/// protocol: one `Query` message, sent at the first poll. Answers the rows
/// of each command that completed, in order, and the error that stopped
/// the query, if any (the server runs no command after a failed one, so
/// the failed one is the next after those completed).
async fn simple_round(client: &Client, query: &str) -> (Completed, Option<tokio_postgres::Error>) {
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
struct Completed {
    rows: Vec<SimpleRow>,
    ends: Vec<usize>,
}

impl Completed {
    /// How many commands completed.
    fn len(&self) -> usize {
        self.ends.len()
    }

    /// The rows of commands `from..to` (none for commands that did not
    /// complete).
    fn rows(&self, from: usize, to: usize) -> &[SimpleRow] {
        // Where the rows of the first `i` commands end.
        let end = |i: usize| match i.min(self.ends.len()) {
            0 => 0,
            i => self.ends[i - 1],
        };
        self.rows.get(end(from)..end(to)).unwrap_or_default()
    }
}

/// A simple-protocol row: every column as text, decoded here for the
/// engine's reply checks (and the set-up row).
struct SimpleRow(tokio_postgres::SimpleQueryRow);

/// Why a [`SimpleRow`] column could not be read.
struct BadColumn(String);

impl fmt::Display for BadColumn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl SimpleRow {
    /// Column `i`'s text.
    fn text(&self, i: usize) -> Result<&str, BadColumn> {
        match self.0.try_get(i) {
            Ok(Some(text)) => Ok(text),
            Ok(None) => Err(BadColumn(format!("column {i} is NULL"))),
            Err(e) => Err(BadColumn(e.to_string())),
        }
    }

    fn parse<T: std::str::FromStr>(&self, i: usize, ty: &str) -> Result<T, BadColumn> {
        let text = self.text(i)?;
        text.parse()
            .map_err(|_| BadColumn(format!("column {i}: {text:?} is not {ty}")))
    }

    fn array<T: std::str::FromStr>(&self, i: usize, ty: &str) -> Result<Vec<T>, BadColumn> {
        let text = self.text(i)?;
        let bad = || BadColumn(format!("column {i}: {text:?} is not {ty}[]"));
        let inner = text
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .ok_or_else(bad)?;
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        inner
            .split(',')
            .map(|v| v.parse().map_err(|_| bad()))
            .collect()
    }
}

impl ReplyRow for SimpleRow {
    type Error = BadColumn;
    fn int8(&self, i: usize) -> Result<i64, BadColumn> {
        self.parse(i, "int8")
    }
    fn int4(&self, i: usize) -> Result<i32, BadColumn> {
        self.parse(i, "int4")
    }
    fn bool(&self, i: usize) -> Result<bool, BadColumn> {
        match self.text(i)? {
            "t" => Ok(true),
            "f" => Ok(false),
            text => Err(BadColumn(format!("column {i}: {text:?} is not bool"))),
        }
    }
    fn int8_array(&self, i: usize) -> Result<Vec<i64>, BadColumn> {
        self.array(i, "int8")
    }
    fn int4_array(&self, i: usize) -> Result<Vec<i32>, BadColumn> {
        self.array(i, "int4")
    }
}

/// A session-duration advisory lock, held by a connection of its own.
///
/// The lock is held until [`release`](Self::release), until the guard drops
/// (its task rolls the transaction back, or closes the connection), or
/// until the connection is lost (a network failure, a server restart,
/// `pg_terminate_backend`, `idle_in_transaction_session_timeout`): then the
/// server has released the lock and another session may hold it. A leader
/// must therefore stop acting as one as soon as [`lost`](Self::lost)
/// resolves, and can ask [`is_held`](Self::is_held) at any time.
///
/// Its [`SessionLock`]'s keeper task runs the keepalive on the connection
/// (see the [module docs](self)); the guard is `Send + Sync` and
/// dereferences to the key value.
///
/// ```no_run
/// use lockkit::{HashText, SessionLock};
///
/// # async fn payroll() -> Result<(), lockkit::Error> { Ok(()) }
/// # async fn run(config: tokio_postgres::Config) -> Result<(), lockkit::Error> {
/// let sessions = SessionLock::new(config);
/// // One payroll run at a time across the fleet; the others skip.
/// let Ok(guard) = sessions.try_lock(HashText("payroll-1405-01")).await? else {
///     return Ok(()); // another instance runs it
/// };
/// tokio::select! {
///     result = payroll() => result?,
///     // The lock is gone (connection lost): stop acting as the leader.
///     () = guard.lost() => return Ok(()),
/// }
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "the session lock is released when the guard drops; bind it to a variable for as long as the work needs the lock"]
pub struct SessionGuard<K> {
    value: K,
    key: LockKey,
    mode: Mode,
    form: SessionForm,
    backend_pid: i32,
    shared: Holding,
}

impl<K: fmt::Debug> fmt::Debug for SessionGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("value", &self.value)
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("form", &self.form)
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

    /// How the lock is held.
    pub fn form(&self) -> SessionForm {
        self.form
    }

    /// The key value.
    pub fn value(&self) -> &K {
        &self.value
    }

    /// The server process holding the lock (`pg_locks.pid`, also behind a
    /// pooler: the backend the lock's transaction is pinned to).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Whether the lock is still held as far as the client knows: `false`
    /// once the connection ended or a keepalive failed (the lock is gone).
    /// Use [`check`](Self::check) to ask the server.
    pub fn is_held(&self) -> bool {
        !*self.shared.lost.borrow()
    }

    /// A future that resolves when the lock is gone: its connection ended
    /// or a keepalive failed or got no reply within one cadence (and after
    /// a release). It owns what it needs (`'static`), so a leader can
    /// `select!` on it while it works.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = self.shared.lost.subscribe();
        async move {
            // An error means the lock's state is gone: lost as well.
            let _ = lost.wait_for(|lost| *lost).await;
        }
    }

    /// Asks the server whether the lock's backend holds the lock
    /// (`pg_locks`), waiting at most one keepalive cadence for the answer.
    /// Any answer but `true` gives the lock up (its connection is closed,
    /// and [`lost`](Self::lost) resolves): the lock is not the caller's any
    /// more.
    ///
    /// # Errors
    ///
    /// A server error other than a lost connection. A lost connection, or
    /// no answer within one cadence (a path gone silent), answers `false`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn check(&self) -> Result<bool, Error> {
        // On a task of its own, so that a check dropped half-way still
        // reads its replies and sends the keepalive that closes its portal.
        tokio::spawn(check_now(self.shared.clone()))
            .await
            .unwrap_or(Ok(false))
    }

    /// Releases the lock: rolls its transaction back (default form) or
    /// unlocks (session-level form), then closes the connection or returns
    /// it to its pool. Answers whether the server really held the lock
    /// until then: in the default form, the rollback's success (every
    /// statement on the lock's connection runs while it is in the guard's
    /// hands, and the first failed one gives the connection up, so the
    /// transaction, and its lock, lived until the rollback);
    /// `pg_advisory_unlock`'s result in the session-level form.
    ///
    /// The release runs on the caller's task, on the connection it takes
    /// out of the guard (waiting for a keepalive in flight): no hop to
    /// another task and back.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::ConnectionLost`] when the connection was already gone: the
    /// server released the lock when the session ended, possibly long ago;
    /// and when the server did not answer within one keepalive cadence (a
    /// path gone silent): the connection is closed, and the server releases
    /// the lock when it sees the session end. Other server errors; the lock
    /// is gone either way (a connection that could not be cleaned is
    /// closed).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped before the answer, the connection is closed (a
    /// pooled one detached from its pool, never returned), which ends the
    /// session's transaction and the lock on the server.
    pub async fn release(self) -> Result<bool, Error> {
        let lease = self.shared.lease.lock().await.take();
        let Some(lease) = lease else {
            // The keeper, a check or the connection's end gave the
            // connection up: the lock is gone.
            return Err(gone());
        };
        let mut ending = Ending {
            lease: Some(lease),
            lost: &self.shared.lost,
        };
        let lease = ending.lease.as_mut().expect("just put");
        within_cadence(
            self.shared.cadence,
            end_lock(lease, self.form, self.key, self.mode),
        )
        .await
        // `ending` drops the lease (closed, or back to its pool if clean),
        // then flips `lost`; the keeper forgets the lock at its next tick.
    }
}

/// A guard's share of its lock. Its drop (the guard's, without a
/// release) ends the lock on a task: a rollback; a pooled connection goes
/// back only if it completes within one cadence, otherwise it is closed.
/// Nothing to do after a release. (On this field, not on the generic
/// guard, so that the guard's key type needs not outlive it.)
struct Holding(Arc<Shared>);

impl Deref for Holding {
    type Target = Arc<Shared>;

    fn deref(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Ok(slot) = self.0.lease.try_lock() {
            if slot.is_none() {
                return; // released, or already gone
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(end_dropped(self.0.clone()));
            }
            // No runtime to roll back on: close the connection now (never
            // back to a pool unclean). Should a statement be in flight, its
            // task drops the last `Shared`, and the lease closes with it.
            Err(_) => {
                if let Ok(slot) = self.0.lease.try_lock() {
                    self.0.give_up(slot);
                }
            }
        }
    }
}

fn gone() -> Error {
    Error::with_message(
        ErrorKind::ConnectionLost,
        "the session lock's connection had already ended; its lock is released",
    )
}

/// What a held lock's guard, its keeper and (on a connection lockkit
/// opened) its connection watcher share.
struct Shared {
    /// The lock's connection, while the lock is held: every statement on
    /// it runs under this mutex. Whoever ends the lock (the release, the
    /// task a drop starts, or the keeper, a check or the connection
    /// watcher after a failed statement or a lost connection) takes it
    /// out, in an [`Ending`]; an empty slot means the lock is gone.
    lease: tokio::sync::Mutex<Option<Lease>>,
    /// Flipped to `true` once the lock is gone.
    lost: watch::Sender<bool>,
    key: LockKey,
    mode: Mode,
    form: SessionForm,
    cadence: Duration,
    backend_pid: i32,
}

impl Shared {
    /// Gives the lock up: takes the connection out of `slot` (so that no
    /// release can use it after whatever failed on it), closes it, and
    /// flips `lost`.
    fn give_up(&self, mut slot: tokio::sync::MutexGuard<'_, Option<Lease>>) {
        let lease = slot.take();
        drop(slot);
        drop(Ending {
            lease,
            lost: &self.lost,
        });
    }
}

/// A lease taken out of [`Shared::lease`] to end the lock: dropping it
/// (after the rollback, or when a release is cancelled or fails) closes the
/// connection or returns it to its pool if clean, then flips `lost`.
struct Ending<'a> {
    lease: Option<Lease>,
    lost: &'a watch::Sender<bool>,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        drop(self.lease.take());
        // Wakes watchers only when there are some (`lost()` futures): a
        // watch's wake costs more than the rest of a release's bookkeeping.
        // The value is set either way, under the watch's lock, so a
        // receiver made after this (or `is_held`) reads `true`.
        self.lost.send_if_modified(|lost| {
            *lost = true;
            self.lost.receiver_count() > 0
        });
    }
}

/// Keeps the held locks of a [`SessionLock`] (and of its clones with the
/// same cadence) alive: one task, started by the first lock and ending
/// when a tick finds no lock held, starts the keepalive on every held
/// lock's connection once per cadence, each bounded by the cadence and
/// none waiting for another.
/// A lock registers by pushing onto a list under a short mutex: no task
/// spawned and no worker woken per lock.
struct Keeper {
    cadence: Duration,
    state: std::sync::Mutex<KeeperState>,
}

struct KeeperState {
    /// The locks registered since the last tick (and still alive then).
    held: Vec<Weak<Shared>>,
    /// Length at which a registration drops the entries of locks already
    /// gone, so that a busy cadence does not pile them up.
    prune_at: usize,
    /// Whether a keeper task is running (or about to).
    running: bool,
}

impl Keeper {
    fn new(cadence: Duration) -> Arc<Self> {
        Arc::new(Keeper {
            cadence,
            state: std::sync::Mutex::new(KeeperState {
                held: Vec::new(),
                prune_at: 64,
                running: false,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KeeperState> {
        // Nothing under this mutex can panic half-way; a poisoned one is
        // still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `shared` alive from the next tick on (within one cadence);
    /// starts the keeper task if none runs.
    fn register(self: &Arc<Self>, shared: &Arc<Shared>) {
        let start = {
            let mut state = self.state();
            if state.held.len() >= state.prune_at {
                state.held.retain(|held| held.strong_count() > 0);
                state.prune_at = (state.held.len() * 2).max(64);
            }
            state.held.push(Arc::downgrade(shared));
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            tokio::spawn(self.clone().run());
        }
    }

    async fn run(self: Arc<Self>) {
        // Should the task be dropped (its runtime shutting down), the locks
        // it kept are given up, and the next registration starts another.
        let mut running = Running(Some(&self));
        let mut ticks = tokio::time::interval_at(Instant::now() + self.cadence, self.cadence);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Each lock's keepalive runs on its own: one that gets no reply
        // (bounded by a cadence) never delays the next tick of the others.
        let mut keeping = FuturesUnordered::new();
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                Some(()) = keeping.next(), if !keeping.is_empty() => continue,
            }
            let held: Vec<Arc<Shared>> = {
                let mut state = self.state();
                state.held.retain(|held| held.strong_count() > 0);
                if state.held.is_empty() {
                    // Under the mutex: a registration after this starts a
                    // new task. (A keepalive in flight holds its lock, so
                    // nothing is in flight here.)
                    state.running = false;
                    running.0 = None;
                    return;
                }
                state.held.iter().filter_map(Weak::upgrade).collect()
            };
            for shared in held {
                keeping.push(async move { keep_alive(&shared).await });
            }
        }
    }
}

/// Marks the keeper stopped if its task is dropped before it ends (its
/// runtime shutting down), and gives up the locks it was keeping: no task
/// would notice them go any more, and `lost()` must not wait for nothing.
/// Their connections close, which ends each lock on the server; a lock
/// whose connection is in use right now is ended by whoever uses it.
struct Running<'a>(Option<&'a Keeper>);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let Some(keeper) = self.0.take() else {
            return;
        };
        let mut state = keeper.state();
        state.running = false;
        // A lock in use stays listed, for the next keeper.
        state.held.retain(|held| {
            let Some(shared) = held.upgrade() else {
                return false;
            };
            let Ok(slot) = shared.lease.try_lock() else {
                return true;
            };
            if slot.is_some() {
                tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid,
                    "lockkit: the runtime of the session locks' keeper shut down; giving the lock up");
                shared.give_up(slot);
            }
            false
        });
    }
}

/// One keepalive on a held lock's connection, bounded by one cadence; when
/// it fails or gets no reply in time, the lock is given up.
async fn keep_alive(shared: &Shared) {
    let slot = shared.lease.lock().await;
    let Some(lease) = slot.as_ref() else {
        return; // released meanwhile
    };
    let reply = within_cadence(shared.cadence, async {
        Ok(lease.client().batch_execute(sql::KEEPALIVE).await?)
    })
    .await;
    if let Err(e) = reply {
        tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid, error = %e,
            "lockkit: a session lock's keepalive failed; the lock is gone");
    } else {
        return;
    }
    // Under the same lock as the statement that failed on it, so that no
    // release can run a ROLLBACK (and report the lock held) after a
    // failure. The connection is closed, never back to a pool unclean.
    shared.give_up(slot);
}

/// Runs `work`, statements on a held lock's connection, for at most one
/// keepalive cadence: the one bound on every wait for the server while a
/// lock is held (keepalive, check, release, the rollback of a dropped
/// guard). A path gone silent thus never holds the connection (and its
/// mutex) longer than a cadence, and [`SessionGuard::lost`] resolves
/// within two cadences of the silence: the next keepalive starts within
/// one (after whatever holds the connection), and waits at most one.
async fn within_cadence<T>(
    cadence: Duration,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(cadence, work).await {
        Ok(result) => result,
        Err(_) => Err(Error::with_message(
            ErrorKind::ConnectionLost,
            format!(
                "the server did not answer within one keepalive cadence ({cadence:?}); \
                 the session lock is given up and its connection closed"
            ),
        )),
    }
}

/// Ends the lock of a connection lockkit opened as soon as the connection
/// ends (`ended` flips, or its task is gone).
async fn watch_connection(shared: Weak<Shared>, mut ended: watch::Receiver<bool>) {
    let _ = ended.wait_for(|ended| *ended).await;
    let Some(shared) = shared.upgrade() else {
        return; // released and dropped
    };
    let slot = shared.lease.lock().await;
    if slot.is_some() {
        tracing::warn!(key = %shared.key, backend_pid = shared.backend_pid,
            "lockkit: a session lock's connection ended; the lock is gone");
        shared.give_up(slot);
    }
}

/// [`SessionGuard::check`] on the lock's connection: a failed check (or a
/// lock found gone) gives the connection up, since a failed statement
/// aborts the lock's transaction, and with it the lock.
async fn check_now(shared: Arc<Shared>) -> Result<bool, Error> {
    let slot = shared.lease.lock().await;
    let answer = match slot.as_ref() {
        Some(lease) => holds_now(lease, shared.key, shared.cadence).await,
        None => return Ok(false),
    };
    if !matches!(answer, Ok(true)) {
        shared.give_up(slot);
    }
    answer
}

/// A guard dropped without release: the rollback (or unlock), bounded by
/// one cadence; a pooled connection goes back only if it completed.
async fn end_dropped(shared: Arc<Shared>) {
    let lease = shared.lease.lock().await.take();
    if lease.is_none() {
        return;
    }
    let mut ending = Ending {
        lease,
        lost: &shared.lost,
    };
    let lease = ending.lease.as_mut().expect("just put");
    let _ = within_cadence(
        shared.cadence,
        end_lock(lease, shared.form, shared.key, shared.mode),
    )
    .await;
}

/// Whether the lock's backend holds `key`, then the keepalive, which drops
/// the check's portal (and snapshot), within one cadence; a lost
/// connection, or no answer in time, answers `false`.
async fn holds_now(lease: &Lease, key: LockKey, cadence: Duration) -> Result<bool, Error> {
    let client = lease.client();
    let answer = within_cadence(cadence, async {
        let (held, closed) = join(holds(client, key), client.batch_execute(sql::KEEPALIVE)).await;
        held.and_then(|held| closed.map(|()| held).map_err(Error::from))
    })
    .await;
    match answer {
        Err(e) if e.is_connection_lost() => Ok(false),
        result => result,
    }
}

/// Ends a held lock on its connection: the rollback (default form) or the
/// unlock (session-level form). Marks the lease clean, so that a pooled
/// connection may go back, only when nothing of the lock is left on it.
async fn end_lock(
    lease: &mut Lease,
    form: SessionForm,
    key: LockKey,
    mode: Mode,
) -> Result<bool, Error> {
    let client = lease.client();
    match form {
        SessionForm::Transaction => {
            // An xact lock ends only with its transaction, or when an error
            // aborts the transaction. Every statement on the connection
            // runs under the guard's mutex, and the first failure takes
            // the connection out of it, so a successful ROLLBACK proves the
            // transaction, and its lock, lived until now. (Reading
            // pg_locks, as `check()` does, costs ten round trips here.)
            client.batch_execute(sql::SESSION_ROLLBACK).await?;
            lease.clean = true;
            Ok(true)
        }
        SessionForm::SessionLevel => {
            let rows = key_query(client, sql::session_unlock(key, mode), key).await?;
            let was_held = one_bool(&rows)?;
            // Unlocked what it took: nothing of this lock is left.
            lease.clean = was_held;
            Ok(was_held)
        }
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

/// The connection of a lock: opened by lockkit, or leased from a pool.
struct Lease {
    conn: Option<Conn>,
    /// Flips when the connection task of an owned connection ends.
    ended: Option<watch::Receiver<bool>>,
    /// Whether a pooled connection may go back to its pool: set only once
    /// nothing of the lock can be left on it.
    clean: bool,
}

enum Conn {
    Owned(Client),
    #[cfg(feature = "deadpool")]
    Pooled(deadpool_postgres::Object),
}

impl Lease {
    fn owned(client: Client, ended: watch::Receiver<bool>) -> Self {
        Lease {
            conn: Some(Conn::Owned(client)),
            ended: Some(ended),
            clean: false,
        }
    }

    #[cfg(feature = "deadpool")]
    fn pooled(object: deadpool_postgres::Object) -> Self {
        Lease {
            conn: Some(Conn::Pooled(object)),
            ended: None,
            clean: false,
        }
    }

    fn client(&self) -> &Client {
        match &self.conn {
            Some(Conn::Owned(client)) => client,
            #[cfg(feature = "deadpool")]
            Some(Conn::Pooled(object)) => object,
            None => unreachable!("only Drop takes the connection"),
        }
    }

    fn is_owned(&self) -> bool {
        matches!(self.conn, Some(Conn::Owned(_)))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match self.conn.take() {
            #[cfg(feature = "deadpool")]
            Some(Conn::Pooled(object)) if !self.clean => {
                // Never back to the pool: detached and dropped, which aborts
                // its connection task and closes the socket, so the server
                // ends the session and its transaction.
                drop(deadpool_postgres::Object::take(object));
            }
            // An owned client closes its connection when it drops; a clean
            // pooled one goes back to the pool.
            other => drop(other),
        }
    }
}

#[cfg(feature = "deadpool")]
fn pool_error(e: deadpool_postgres::PoolError) -> Error {
    match e {
        deadpool_postgres::PoolError::Backend(e) => Error::from(e),
        e => Error::other(e),
    }
}

/// Where a [`SessionLock`] gets its connections.
#[derive(Clone)]
enum Source {
    Connect(Arc<dyn Connect>),
    #[cfg(feature = "deadpool")]
    Pool(deadpool_postgres::Pool),
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Connect(connect) => f.debug_tuple("Connect").field(connect.config()).finish(),
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => f.debug_tuple("Pool").field(&pool.status()).finish(),
        }
    }
}

/// Opens connections, whatever the TLS connector's type.
trait Connect: Send + Sync {
    fn connect(
        &self,
        application_name: String,
    ) -> BoxFuture<'_, Result<(Client, watch::Receiver<bool>), Error>>;
    fn canceller(&self) -> Canceller;
    fn config(&self) -> &tokio_postgres::Config;
}

struct Direct<T> {
    config: tokio_postgres::Config,
    tls: T,
}

impl<T> Connect for Direct<T>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    /// Connects, named `application_name`, and runs the connection on a
    /// task that flips the returned watch to `true` when it ends.
    fn connect(
        &self,
        application_name: String,
    ) -> BoxFuture<'_, Result<(Client, watch::Receiver<bool>), Error>> {
        Box::pin(async move {
            let mut config = self.config.clone();
            config.application_name(&application_name);
            let (client, connection) = config.connect(self.tls.clone()).await?;
            let (ended, lost) = watch::channel(false);
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "lockkit: a session lock connection ended");
                }
                let _ = ended.send(true);
            });
            Ok((client, lost))
        })
    }

    fn canceller(&self) -> Canceller {
        Canceller::tls(self.tls.clone())
    }

    fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }
}

/// The pooler probe did not finish within its timeout
/// ([`SessionLock::probe_timeout`]): typically a pool or pooler with no
/// second connection free. Nothing was locked, and the probe's connections
/// were closed (or returned to the pool), so it holds none of them longer
/// than the timeout. The source of an [`ErrorKind::Database`] without a
/// SQLSTATE; find it with `std::error::Error::source` and `downcast_ref`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the pooler probe did not finish within {timeout:?} (no second connection free in the pool?); nothing was locked")]
pub struct ProbeTimeout {
    /// The timeout that expired.
    pub timeout: Duration,
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

/// Whether connections made from `config` (without TLS) go through a
/// transaction-mode pooler: the check the [`SessionForm::SessionLevel`]
/// form makes before every lock (the default form needs none). Bounded by
/// [`DEFAULT_PROBE_TIMEOUT`]; use [`SessionLock::probe_pooler`] for TLS,
/// a pool or another bound.
///
/// On its own connection it reads `pg_backend_pid()` in two transactions;
/// then a second client opens a transaction, and the first reads its pid
/// again. Directly connected, the pid never changes and the second client
/// has another. Behind a transaction-mode pooler the backend is returned to
/// the pool after each transaction: pgbouncer hands the one released last
/// to the next client, so the second client gets the first one's backend,
/// or, when it does not, the first client moves to another. The first
/// connection also marks its backend with a session-wide setting
/// (`lockkit.pooler_probe`, taken off again when no pooler was seen): a
/// client that finds another client's mark on its fresh connection, or
/// loses its own, was handed a backend by a pooler. Concurrent probes
/// (a fleet of session-level lockers) thus mark the pooled backends for
/// one another, where the pids alone let some of them miss the pooler. A
/// session-mode pooler keeps each client on one backend (and its
/// `DISCARD ALL` clears the mark) and is not reported. The probe is still
/// a heuristic (the very first probes on a fresh pool rely on the pooler's
/// reuse order); that is why the default session form does not rely on
/// it.
///
/// # Errors
///
/// [`ProbeTimeout`] (inside [`ErrorKind::Database`]) when the probe did not
/// finish within the bound, e.g. because the pool had no second connection
/// free; when a connection or a query fails.
///
/// # Cancel safety
///
/// Cancel safe: both connections are closed when the future drops.
pub async fn probe_pooler(config: &tokio_postgres::Config) -> Result<PoolerProbe, Error> {
    SessionLock::new(config.clone()).probe_pooler().await
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
        .ok_or_else(|| Error::unexpected("pg_backend_pid() returned no row".into()))
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

/// Exactly one row, or an error naming `what`.
fn one_row<T>(rows: &[T], what: &str) -> Result<(), Error> {
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
fn one_bool(rows: &[Row]) -> Result<bool, Error> {
    one_row(rows, "the lock statement")?;
    match rows[0].try_get::<_, Option<bool>>(0)? {
        Some(answer) => Ok(answer),
        None => Err(Error::unexpected(
            "the lock statement returned NULL, not a bool".into(),
        )),
    }
}
