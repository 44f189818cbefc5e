//! DDL that never stalls the lock queue: a short `lock_timeout` per
//! attempt, retried with jittered backoff until a deadline.
//!
//! An `ALTER TABLE` waiting for its `ACCESS EXCLUSIVE` lock behind one long
//! reader blocks every later reader of the table for as long as it waits:
//! the application stalls. With a short `lock_timeout`, the statement gives
//! up its place in the queue after a moment, the readers behind it go on,
//! and it tries again later.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::engine::error::{DriverError, Error, ErrorKind};
use crate::engine::sql::{self, SettingScope};
use crate::retry::RetryPolicy;

/// How [`run_ddl`] retries.
///
/// ```
/// use std::time::Duration;
/// use lockkit::pg::DdlRetry;
///
/// let retry = DdlRetry::default()
///     .lock_timeout(Duration::from_millis(50))
///     .deadline(Duration::from_secs(30));
/// # let _ = retry;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DdlRetry {
    lock_timeout: Duration,
    deadline: Duration,
    backoff: RetryPolicy,
}

impl Default for DdlRetry {
    /// 100 ms `lock_timeout` per attempt, 60 s in all, backoff from 50 ms up
    /// to 2 s between attempts (full jitter).
    fn default() -> Self {
        DdlRetry {
            lock_timeout: Duration::from_millis(100),
            deadline: Duration::from_secs(60),
            backoff: RetryPolicy::default()
                .max_attempts(u32::MAX)
                .delays(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }
}

impl DdlRetry {
    /// How long each attempt may wait for its lock (and so how long readers
    /// queued behind it may be held up).
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long to keep trying, from the first attempt.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The backoff between attempts (its attempt limit is ignored: the
    /// deadline bounds the retries).
    pub fn backoff(mut self, policy: RetryPolicy) -> Self {
        self.backoff = policy.max_attempts(u32::MAX);
        self
    }
}

/// What a successful [`run_ddl`] took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DdlOutcome {
    /// Attempts made, the successful one included.
    pub attempts: u32,
    /// Time from the first attempt to the commit.
    pub elapsed: Duration,
}

/// Runs `statement` (one or more DDL statements) in a transaction of its own
/// on `client`, under `SET LOCAL lock_timeout`, retrying with jittered
/// backoff while it times out on a lock, until the deadline. Each attempt is
/// reported as a `tracing` event (`lockkit::ddl`, debug level, with the
/// attempt number and how long it waited); giving up is a warning.
///
/// ```no_run
/// # async fn run(client: &mut tokio_postgres::Client) -> Result<(), lockkit::Error> {
/// let done = lockkit::pg::run_ddl(
///     client,
///     "ALTER TABLE orders ADD COLUMN note text",
///     &lockkit::pg::DdlRetry::default(),
/// )
/// .await?;
/// println!("migrated after {} attempt(s)", done.attempts);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when the deadline
/// passed with every attempt timed out on its lock (nothing was changed):
/// attempts go on until the deadline, the last one waiting only for what is
/// left of it, so the call returns about a round trip after the deadline,
/// never before it. Its message says how many attempts were made, over how
/// long, and its source is the last attempt's `55P03`. Any other error of
/// the statement at once (not retried).
///
/// # Cancel safety
///
/// Cancel safe up to the commit: an attempt dropped before its `COMMIT`
/// was sent is rolled back by tokio-postgres before the client's next
/// statement, so nothing of it is applied. Dropped while the `COMMIT` is in
/// flight (e.g. waiting for a synchronous standby), the outcome is the
/// server's: the DDL may well be applied (committed locally, durable) even
/// though the call never returned. After a dropped call, check the schema
/// (or rerun idempotent DDL) rather than assume nothing changed.
pub async fn run_ddl(
    client: &mut Client,
    statement: &str,
    retry: &DdlRetry,
) -> Result<DdlOutcome, Error> {
    let started = Instant::now();
    let deadline = started + retry.deadline;
    let mut attempt = 1;
    loop {
        // Every attempt, the last one too, ends by the deadline: it waits
        // for its lock no longer than what is left.
        let wait = retry
            .lock_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let mut set = String::with_capacity(40);
        sql::write_lock_timeout(&mut set, SettingScope::Transaction, wait);
        let begun = Instant::now();
        let result = async {
            let tx = client.transaction().await?;
            tx.batch_execute(&set).await?;
            tx.batch_execute(statement).await?;
            tx.commit().await
        }
        .await;
        let e = match result {
            Ok(()) => {
                tracing::debug!(
                    target: "lockkit::ddl",
                    attempt,
                    waited_ms = begun.elapsed().as_secs_f64() * 1000.0,
                    "lockkit: DDL committed"
                );
                return Ok(DdlOutcome {
                    attempts: attempt,
                    elapsed: started.elapsed(),
                });
            }
            Err(e) => DriverError::from(e).into_error(),
        };
        if e.code() != Some(crate::sqlstate::LOCK_NOT_AVAILABLE) {
            return Err(e);
        }
        tracing::debug!(
            target: "lockkit::ddl",
            attempt,
            waited_ms = begun.elapsed().as_secs_f64() * 1000.0,
            "lockkit: DDL timed out on its lock; the queue behind it moves on"
        );
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!(
                target: "lockkit::ddl",
                attempts = attempt,
                "lockkit: DDL gave up at its deadline"
            );
            return Err(Error::with_source(
                ErrorKind::Timeout,
                format!(
                    "DDL did not get its lock by its deadline of {:?}: {attempt} attempt(s) in {:?}, \
                     each gave up waiting for its lock after at most {:?} (lock_timeout, 55P03) \
                     so that the queries queued behind it could go on; nothing was changed",
                    retry.deadline,
                    started.elapsed(),
                    retry.lock_timeout,
                ),
                e,
            ));
        }
        // The backoff, cut short by the deadline: one more attempt then.
        let delay = retry.backoff.delay_cap(attempt).mul_f64(fastrand::f64());
        tokio::time::sleep(delay.min(left)).await;
        attempt += 1;
    }
}
