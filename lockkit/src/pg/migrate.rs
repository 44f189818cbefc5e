//! Migrations: one runner at a time across a fleet ([`MigrationGuard`]);
//! for DDL that never stalls the lock queue, see [`run_ddl`](crate::pg::run_ddl).
//!
//! # One migrator per fleet
//!
//! Every instance of a service runs its migrations at start-up, and exactly
//! one may run them at a time. [`MigrationGuard`] wraps any migration
//! tool's run in a session-duration lock of the default form
//! ([`SessionLock`]), which is safe behind any pooler: the classic failure,
//! a session-level lock stranded on a pooled backend by a transaction-mode
//! pgbouncer, cannot happen. The others wait (with a bound, or for as long
//! as it takes) and then run the migrations themselves, which finds nothing
//! left to do when the migrations are recorded (a `schema_migrations`
//! table); or they skip at once.
//!

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::error::{Error, ErrorKind};
use crate::key::AdvisoryKey;
use crate::pg::session::{SessionGuard, SessionLock};
use crate::retry::RetryPolicy;

/// What a migrator does when another one holds the migration lock.
///
/// A waiting migrator polls: it tries the lock, and while it is busy sleeps
/// a jittered backoff (from 50 ms up to 1 s) and tries again. A blocking
/// wait would hold a transaction open, and behind a transaction-mode pooler
/// every waiting instance of the fleet would pin a server connection,
/// which can starve the pool the running migration needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenBusy {
    /// Wait at most this long, then fail with a timeout
    /// ([`MigrationError::Lock`], `is_timeout()`).
    Wait(Duration),
    /// Wait as long as it takes.
    WaitForever,
    /// Do not wait: [`Migration::Skipped`] at once.
    Skip,
}

/// What [`MigrationGuard::run`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Migration<T> {
    /// This runner held the lock and the migrations ran, returning `T`.
    Ran(T),
    /// Another runner held the lock and [`WhenBusy::Skip`] was asked.
    Skipped,
}

/// Why [`MigrationGuard::run`] failed.
#[derive(Debug)]
pub enum MigrationError<E> {
    /// The lock could not be taken (a timeout with [`WhenBusy::Wait`], a
    /// connection, pool or server error). The migrations did not run.
    Lock(Error),
    /// The lock was lost while the migrations ran (its connection ended):
    /// another runner may have started. The run was cancelled (its future
    /// dropped) as soon as the loss was noticed, or, when it was noticed
    /// only at the release, after it finished; its result is not reported,
    /// because it was not protected to the end.
    Lost,
    /// The migrations failed; the lock was released.
    Run(E),
}

impl<E: fmt::Display> fmt::Display for MigrationError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigrationError::Lock(e) => write!(f, "cannot take the migration lock: {e}"),
            MigrationError::Lost => f.write_str(
                "the migration lock was lost while the migrations ran; another runner may have started",
            ),
            MigrationError::Run(e) => write!(f, "the migrations failed: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for MigrationError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MigrationError::Lock(e) => Some(e),
            MigrationError::Lost => None,
            MigrationError::Run(e) => Some(e),
        }
    }
}

/// One migration runner at a time across a fleet, on a session-duration
/// lock of the default form.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit::{AdvisoryKey, SessionLock};
/// use lockkit::pg::{Migration, MigrationGuard, WhenBusy};
///
/// #[derive(AdvisoryKey, Clone)]
/// #[advisory_key(namespace = "myapp/migrations")]
/// struct Schema;
///
/// # async fn start(config: tokio_postgres::Config, client: &tokio_postgres::Client)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let guard = MigrationGuard::new(SessionLock::new(config), Schema)
///     .when_busy(WhenBusy::Wait(Duration::from_secs(120)));
/// // Every instance runs this; one at a time gets through, and the later
/// // ones find the migrations recorded.
/// let ran = guard
///     .run(async || {
///         client
///             .batch_execute(
///                 "CREATE TABLE IF NOT EXISTS schema_migrations (version int PRIMARY KEY);
///                  /* apply what schema_migrations does not list */",
///             )
///             .await
///     })
///     .await?;
/// assert!(matches!(ran, Migration::Ran(())));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct MigrationGuard<K> {
    sessions: SessionLock,
    key: K,
    when_busy: WhenBusy,
}

impl<K: AdvisoryKey + Clone> MigrationGuard<K> {
    /// Migrations guarded by `key`, locked through `sessions` (its default
    /// form: safe behind any pooler). Waits as long as it takes unless
    /// [`when_busy`](Self::when_busy) says otherwise.
    pub fn new(sessions: SessionLock, key: K) -> Self {
        MigrationGuard {
            sessions,
            key,
            when_busy: WhenBusy::WaitForever,
        }
    }

    /// What to do when another runner holds the lock.
    pub fn when_busy(mut self, when_busy: WhenBusy) -> Self {
        self.when_busy = when_busy;
        self
    }

    /// Takes the lock, runs `migrate` while holding it, and releases it.
    /// `migrate` runs on the caller's connections, not the lock's.
    ///
    /// # Errors
    ///
    /// [`MigrationError::Lock`] when the lock could not be taken,
    /// [`MigrationError::Run`] with `migrate`'s error,
    /// [`MigrationError::Lost`] when the lock was lost before `migrate`
    /// finished or before the release.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes (it is released when the future
    /// drops); `migrate` is dropped mid-run, so run migrations in
    /// transactions.
    pub async fn run<T, E, F>(&self, migrate: F) -> Result<Migration<T>, MigrationError<E>>
    where
        F: AsyncFnOnce() -> Result<T, E>,
    {
        let key = self.key.clone();
        let guard = match self.when_busy {
            WhenBusy::Skip => match self.sessions.try_lock(key).await {
                Ok(Ok(guard)) => guard,
                Ok(Err(_)) => return Ok(Migration::Skipped),
                Err(e) => return Err(MigrationError::Lock(e)),
            },
            WhenBusy::Wait(timeout) => self
                .poll(key, Some(timeout))
                .await
                .map_err(MigrationError::Lock)?,
            WhenBusy::WaitForever => self.poll(key, None).await.map_err(MigrationError::Lock)?,
        };
        tracing::info!(key = %guard.key(), backend_pid = guard.backend_pid(),
            "lockkit: holding the migration lock; running the migrations");
        let lost = guard.lost();
        let result = tokio::select! {
            biased;
            () = lost => {
                tracing::error!(key = %guard.key(),
                    "lockkit: the migration lock was lost; cancelling the migrations");
                return Err(MigrationError::Lost);
            }
            result = migrate() => result,
        };
        let held = guard.release().await;
        match (result, held) {
            (Ok(value), Ok(true)) => Ok(Migration::Ran(value)),
            (Err(e), _) => Err(MigrationError::Run(e)),
            (Ok(_), Ok(false)) => Err(MigrationError::Lost),
            (Ok(_), Err(e)) if e.is_connection_lost() => Err(MigrationError::Lost),
            // The rollback failed for another reason: the lock is gone with
            // the connection, but it was held to the end.
            (Ok(value), Err(e)) => {
                tracing::warn!(error = %e, "lockkit: releasing the migration lock failed");
                Ok(Migration::Ran(value))
            }
        }
    }
}

impl<K: AdvisoryKey + Clone> MigrationGuard<K> {
    /// Tries the lock until it is free or `timeout` passed.
    async fn poll(&self, key: K, timeout: Option<Duration>) -> Result<SessionGuard<K>, Error> {
        let started = Instant::now();
        let backoff = RetryPolicy::default().delays(POLL_BASE, POLL_MAX);
        let mut attempt = 1;
        let mut key = key;
        loop {
            key = match self.sessions.try_lock(key).await? {
                Ok(guard) => return Ok(guard),
                Err(key) => key,
            };
            let mut delay = backoff.delay_cap(attempt).mul_f64(fastrand::f64());
            if let Some(timeout) = timeout {
                let left = timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(Error::with_message(
                        ErrorKind::Timeout,
                        format!("timed out after {timeout:?} waiting for the migration lock: another runner held it throughout"),
                    ));
                }
                delay = delay.min(left);
            }
            tracing::debug!(
                attempt,
                ?delay,
                "lockkit: the migration lock is busy; polling"
            );
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }
}

/// The first step and the cap of a waiting migrator's polling backoff.
const POLL_BASE: Duration = Duration::from_millis(50);
const POLL_MAX: Duration = Duration::from_secs(1);
