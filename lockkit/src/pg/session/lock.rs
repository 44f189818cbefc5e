//! The one door of session locks: [`SessionLock`], its settings and its
//! lock calls, over the forms: on a connection of its own ([`Own`]: the
//! default and the session-level form) or a shared one ([`Multiplexed`]).

use std::fmt;
use std::num::NonZeroU8;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use super::claims::{Mux, DEFAULT_CONNECTIONS};
use super::conn::{Direct, Settings, Source};
use super::form::SessionForm;
use super::guard::{expect_granted, SessionGuard};
use super::keeper::{Keeper, DEFAULT_KEEPALIVE};
use super::mux::{Multiplexed, MuxTry};
use super::mux_conn::MuxConn;
use super::probe::{self, PoolerProbe, DEFAULT_PROBE_TIMEOUT};
#[cfg(doc)]
use super::probe::{probe_pooler, ProbeTimeout};
use super::take::Own;
use super::xact::Take;
use crate::engine::error::Error;
#[cfg(doc)]
use crate::engine::error::ErrorKind;
use crate::engine::plan::Mode;
use crate::engine::Wait;
use crate::key::AdvisoryKey;
use crate::StatementMode;

/// Takes session-duration advisory locks, each on a connection of its own
/// (from a `tokio_postgres::Config`: [`new`](Self::new),
/// [`with_tls`](Self::with_tls); or leased from a pool: `from_pool`), in a
/// transaction held open by default (the [module docs](super) say how);
/// the [`SessionGuard`] keeps it until it is released, dropped or lost.
///
/// Before handing out a lock it refuses a hot standby (locks there exclude
/// nothing on the primary; [`allow_standby`](Self::allow_standby)),
/// `HashText` keys when the server's `hashtext` differs from lockkit's, and
/// in the session-level form a transaction-mode pooler ([`probe_pooler`]).
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
    /// Where the connections come from, and the checks before a lock.
    settings: Settings,
    form: SessionForm,
    /// Keeps the held locks alive ([`keepalive`](Self::keepalive)); shared.
    keeper: Arc<Keeper>,
    /// The multiplexed form's connections and claimed keys; shared.
    mux: Arc<Mux<MuxConn>>,
    /// [`multiplexed_budget`](Self::multiplexed_budget); `None`: half the
    /// server's shared lock table.
    mux_budget: Option<usize>,
}

impl fmt::Debug for SessionLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLock")
            .field("source", &self.settings.source)
            .field("form", &self.form)
            .field("allow_standby", &self.settings.allow_standby)
            .field("pooler_check", &self.settings.pooler_check)
            .field("keepalive", &self.keeper.cadence)
            .field("connections", &self.mux.max())
            .field("multiplexed_budget", &self.mux_budget)
            .field("probe_timeout", &self.settings.probe_timeout)
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
    /// `deadpool`): never returned with a lock on them; see the [module
    /// docs](super#connections-leased-from-a-pool).
    #[cfg(feature = "deadpool")]
    pub fn from_pool(pool: deadpool_postgres::Pool) -> Self {
        Self::from_source(Source::Pool(pool))
    }

    fn from_source(source: Source) -> Self {
        SessionLock {
            settings: Settings::new(source, DEFAULT_PROBE_TIMEOUT),
            form: SessionForm::Transaction,
            keeper: Keeper::new(DEFAULT_KEEPALIVE),
            mux: Mux::new(DEFAULT_CONNECTIONS),
            mux_budget: None,
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
        self.settings.allow_standby = allow;
        self
    }

    /// For the [`SessionForm::Multiplexed`] form: how its lock and unlock
    /// statements are sent. [`StatementMode::Unnamed`] (the default) parses
    /// each on the server every time, in one round trip, and is safe behind
    /// any pooler. [`StatementMode::Prepared`] prepares each once per
    /// connection and saves the server that work (about 13 µs a statement
    /// on the benchmark machine, BENCHMARKS.md): for connections that reach
    /// PostgreSQL directly, not through a transaction-mode pooler: there a
    /// statement's name can meet another client's on the server
    /// connection, the take fails with [`ErrorKind::UnexpectedReply`]
    /// (`42P05`), holding nothing, and the connection can be given up with
    /// the other locks on it (their `lost()` resolves). The other forms
    /// send each lock as one simple-protocol query, whatever this says.
    ///
    /// ```no_run
    /// # async fn f(config: tokio_postgres::Config) {
    /// use lockkit::pg::SessionForm;
    /// use lockkit::{SessionLock, StatementMode};
    ///
    /// // A direct connection: the fastest multiplexed locks.
    /// let sessions = SessionLock::new(config)
    ///     .form(SessionForm::Multiplexed)
    ///     .statements(StatementMode::Prepared);
    /// # }
    /// ```
    pub fn statements(mut self, mode: StatementMode) -> Self {
        self.settings.statements = mode;
        self
    }

    /// For the [`SessionForm::SessionLevel`] form: whether to probe for a
    /// transaction-mode pooler before each lock (on by default). The probe
    /// costs a second, short-lived connection and three round trips,
    /// bounded by [`probe_timeout`](Self::probe_timeout); turn it off only
    /// when the connections are known to reach PostgreSQL directly. The
    /// default form needs no probe and ignores this.
    pub fn pooler_check(mut self, check: bool) -> Self {
        self.settings.pooler_check = check;
        self
    }

    /// The keepalive cadence of each lock's connection (5 s by default; at
    /// least 1 ms), and with it each lock's [lease](Self::lease) (the
    /// [module docs](super#the-lease)); [`SessionGuard::lost`] resolves
    /// within one cadence of the lock being gone, and a try waits that long
    /// for the server's answers once connected ([Bounded
    /// waits](super#bounded-waits)). One task keeps the held locks of this
    /// `SessionLock` and of its clones made after this call, on the runtime
    /// of the lock that started it: should that runtime shut down while
    /// locks taken on another runtime are held, they are given up, so use
    /// one `SessionLock` per runtime.
    pub fn keepalive(mut self, cadence: Duration) -> Self {
        // A keeper of its own: the clones made before keep their cadence.
        self.keeper = Keeper::new(cadence.max(Duration::from_millis(1)));
        self
    }

    /// Whether every grant mints a fencing token (off by default): a
    /// number larger than every token minted before, on any connection, for
    /// the protected resource to refuse an older holder's write. The guard
    /// hands it out ([`SessionGuard::fencing_token`]). Minted by the server
    /// with the grant, in the same round trip, in every form and for
    /// permits. Needs lockkit's SQL functions on the database
    /// ([`sql::install`](crate::sql::install) or `lockkit sql install`);
    /// without them a lock call fails with
    /// [`ErrorKind::NotInstalled`](crate::ErrorKind::NotInstalled) and
    /// nothing is held. See [`crate::fencing`], with an example.
    pub fn fencing_tokens(mut self, mint: bool) -> Self {
        self.settings.fencing = mint;
        self
    }

    /// The lease of this lock's locks: how long a held lock's session may
    /// run no statement before the server ends it, and the lock passes to
    /// the next taker. [`LEASE_CADENCES`](super::LEASE_CADENCES) keepalive cadences, at least
    /// [`MIN_LEASE`](super::MIN_LEASE): 15 s at the default cadence. See the
    /// [module docs](super#the-lease).
    ///
    /// ```
    /// use std::time::Duration;
    /// use lockkit::SessionLock;
    ///
    /// let config: tokio_postgres::Config = "host=localhost user=app".parse().unwrap();
    /// let sessions = SessionLock::new(config).keepalive(Duration::from_secs(2));
    /// assert_eq!(sessions.lease(), Duration::from_secs(6));
    /// ```
    pub fn lease(&self) -> Duration {
        self.keeper.lease()
    }

    /// The bound on the pooler probe ([`probe_pooler`](Self::probe_pooler)
    /// and the session-level form's check), 2 s by default: on a saturated
    /// pool it gives up with [`ProbeTimeout`] instead of waiting for a
    /// second connection.
    pub fn probe_timeout(mut self, timeout: Duration) -> Self {
        self.settings.probe_timeout = timeout;
        self
    }

    /// The connection settings, when the locks open their own connections
    /// (`None` for a pool).
    pub fn config(&self) -> Option<&tokio_postgres::Config> {
        match &self.settings.source {
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
    /// lock is handed out; [`ErrorKind::ConnectFailed`] when no connection
    /// could be made; [`ErrorKind::Deadlock`], [`ErrorKind::ConnectionLost`]
    /// and other connection, pool or server errors. Nothing is held after
    /// an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future hands the connection to a task
    /// that waits for the statement in flight to end (the server ends a
    /// wait within one slice), then rolls back (or unlocks) behind it and
    /// gives the connection back: the lock is not taken, or, if it was just
    /// granted, released there. No cancel request is sent (the module
    /// docs' [Connections that hold nothing](super#connections-that-hold-nothing)).
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
    /// within one keepalive cadence ([Bounded waits](super#bounded-waits)):
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
    /// As [`try_lock`](Self::try_lock): [`ErrorKind::Timeout`] when no
    /// answer came within one keepalive cadence, from the server or from a
    /// pooler waiting for a free server connection ([Bounded
    /// waits](super#bounded-waits)); nothing is held.
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
    /// [`ProbeTimeout`] (inside [`ErrorKind::Timeout`]) when the probe did not
    /// finish in time, e.g. on a pool with no second connection free;
    /// connection, pool and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: its connections are closed, or returned to the pool
    /// only after their transaction ended, when the future drops.
    pub async fn probe_pooler(&self) -> Result<PoolerProbe, Error> {
        probe::probe(&self.settings.source, self.settings.probe_timeout).await
    }

    /// Takes `value`'s key in `mode` in this lock's form.
    async fn acquire<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Result<SessionGuard<K>, K>, Error> {
        let own = Own::new(&self.settings, &self.keeper);
        if self.form != SessionForm::Multiplexed {
            return own.acquire(value, Take::Key(mode), wait, self.form).await;
        }
        // A free key is taken on a multiplexed connection, in one round
        // trip. A wait never runs there (a connection waiting for one key
        // would delay every other lock's statements on it): it takes a
        // connection of its own, in the default form.
        let mux = Multiplexed::new(&self.settings, &self.keeper, &self.mux, self.mux_budget);
        match mux.try_lock(value, mode).await? {
            MuxTry::Held(value, held) => Ok(Ok(SessionGuard::multiplexed(value, held))),
            MuxTry::Busy(value) if matches!(wait, Wait::Try) => Ok(Err(value)),
            MuxTry::Busy(value) | MuxTry::Elsewhere(value) => {
                let take = Take::Key(mode);
                own.acquire(value, take, wait, SessionForm::Transaction)
                    .await
            }
        }
    }

    /// Takes a permit of the semaphore of `permits` permits named by `key`,
    /// waiting as long as it takes. A free slot is taken in the one query
    /// that opens the permit's transaction.
    ///
    /// The semaphore is [`LockTx::acquire_permit`](crate::LockTx::acquire_permit)'s
    /// (slots, waiting, fairness). Each permit holds a connection of its
    /// own, in the default form whatever [`form`](Self::form) says, and its
    /// guard names the slot's key.
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
    /// As [`try_lock`](Self::try_lock): [`ErrorKind::Timeout`] when no
    /// answer came within one keepalive cadence, from the server or from a
    /// pooler waiting for a free server connection ([Bounded
    /// waits](super#bounded-waits)); nothing is held.
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
        let take = Take::Permit(permits);
        Own::new(&self.settings, &self.keeper)
            .acquire(key, take, wait, SessionForm::Transaction)
            .await
    }
}
