//! The study's one use of lockkit's retry: what a failed ingest attempt is,
//! which failures are worth running the whole transaction again, and the
//! policy.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use lockkit::{RetryPolicy, Transient};

/// How often a transaction that failed with a retryable error is tried
/// again before its events are counted as lost.
pub(crate) const MAX_ATTEMPTS: u32 = 200;

/// The retry policy of every ingest transaction: up to [`MAX_ATTEMPTS`]
/// attempts, backing off from 5 ms to at most 1 s (full jitter: half a
/// second on average), so a worker waits out a server restart of over a
/// minute. A first full-size `--chaos` run, with at most 100 attempts and
/// 250 ms, gave up 308 events of `for-update` while a restart on the loaded
/// machine kept refusing connections (`57P03`) for longer than that.
pub(crate) fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(MAX_ATTEMPTS)
        .delays(Duration::from_millis(5), Duration::from_secs(1))
}

/// Why one attempt failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The ingest transaction (or preparing its statements) failed.
    Ingest {
        /// lockkit's error.
        error: lockkit::Error,
        /// Whether the connection was closed afterwards (the worker then
        /// opens a new one).
        closed: bool,
    },
    /// A new connection could not be opened (the server is restarting).
    Connect(tokio_postgres::Error),
}

impl Failure {
    /// A short label for the report: the SQLSTATE, else what happened.
    pub(crate) fn label(&self) -> String {
        match self {
            Failure::Ingest { error, closed } => match (error.code(), closed) {
                (Some(code), _) => code.to_owned(),
                (None, true) => "connection closed".to_owned(),
                (None, false) => "other".to_owned(),
            },
            Failure::Connect(e) => match e.code() {
                Some(code) => format!("{} on connect", code.code()),
                None => "connect refused".to_owned(),
            },
        }
    }

    /// Whether the server aborted the transaction for a deadlock.
    pub(crate) fn is_deadlock(&self) -> bool {
        matches!(self, Failure::Ingest { error, .. } if error.is_deadlock())
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Ingest { error, .. } => write!(f, "{error}"),
            Failure::Connect(e) => write!(f, "cannot connect: {e}"),
        }
    }
}

impl Transient for Failure {
    /// Every strategy is idempotent per transaction (a retry finds the rows
    /// a committed attempt left, even one whose COMMIT reply was lost), so
    /// running it again is safe after: what lockkit calls transient
    /// (deadlock, serialization failure, lock timeout); a unique violation
    /// (the `for-update` strategy's designed outcome for a concurrent copy);
    /// a full lock table; and anything that ended the connection (a
    /// restart, a terminated backend, a dropped connection), or kept a new
    /// one from opening. Other errors (a bug, a bad setting) are not
    /// retried.
    fn is_transient(&self) -> bool {
        match self {
            Failure::Connect(_) => true,
            Failure::Ingest { error, closed } => {
                *closed
                    || error.is_transient()
                    || error.is_connection_lost()
                    || error.is_lock_table_full()
                    || matches!(error.code(), Some(code) if code == "23505"
                        || code.starts_with("08")
                        || code.starts_with("57P"))
            }
        }
    }
}

/// Runs `run(job.clone())` under [`policy`] through `lockkit::retry` until
/// it succeeds or fails for good. The only call of `lockkit::retry` in the
/// study. Each attempt gets its own clone of `job`, an owned value, and the
/// closure borrows nothing, so the workers' futures are `Send`.
///
/// # Errors
///
/// The last failure: a non-retryable one, or the last of
/// [`MAX_ATTEMPTS`].
///
/// # Cancel safety
///
/// As cancel safe as `run`.
pub(crate) async fn retrying<J, T, Fut>(job: J, run: fn(J) -> Fut) -> Result<T, Failure>
where
    J: Clone,
    Fut: Future<Output = Result<T, Failure>>,
{
    lockkit::retry(&policy(), move |_attempt| run(job.clone())).await
}
