//! Retrying a whole transaction after a transient failure.

use std::time::Duration;

#[cfg(any(feature = "tokio-postgres", feature = "diesel", test))]
use crate::engine::error::DriverError;
use crate::engine::error::Error;

/// An error that says whether running the whole transaction again may
/// succeed. lockkit's [`Error`] and the drivers' errors agree: they are
/// classified by the same code ([`ErrorKind::is_transient`](crate::ErrorKind::is_transient)).
pub trait Transient {
    /// Whether a retry may succeed: a deadlock, a serialization failure or a
    /// lock timeout.
    fn is_transient(&self) -> bool;
}

impl Transient for Error {
    fn is_transient(&self) -> bool {
        Error::is_transient(self)
    }
}

#[cfg(feature = "tokio-postgres")]
impl Transient for tokio_postgres::Error {
    fn is_transient(&self) -> bool {
        DriverError::from(self).kind().is_transient()
    }
}

#[cfg(feature = "diesel")]
impl Transient for diesel::result::Error {
    fn is_transient(&self) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as D};
        match self {
            D::DatabaseError(kind, info) => {
                let code = matches!(kind, DatabaseErrorKind::SerializationFailure)
                    .then_some(crate::sqlstate::SERIALIZATION_FAILURE);
                DriverError::new("")
                    .code(code)
                    .message(Some(info.message()))
                    .kind()
                    .is_transient()
            }
            _ => false,
        }
    }
}

/// How often and how patiently `retry` (feature `tokio`) and
/// [`retry_blocking`] run a transaction again.
///
/// The delay before attempt `n + 1` is drawn uniformly from
/// `[0, min(max_delay, base_delay × 2ⁿ⁻¹)]` ("full jitter"), so workers that
/// deadlocked with each other do not collide again in lockstep.
///
/// ```
/// use std::time::Duration;
/// use lockkit::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(8)
///     .delays(Duration::from_millis(5), Duration::from_millis(200));
/// assert_eq!(policy.delay_cap(3), Duration::from_millis(20));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, 10 ms base delay, at most 1 s between attempts.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// At most `attempts` runs in all (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff's first step and its cap.
    pub fn delays(mut self, base: Duration, max: Duration) -> Self {
        self.base_delay = base;
        self.max_delay = max.max(base);
        self
    }

    /// The upper bound of the delay after failed attempt `attempt` (1-based).
    pub fn delay_cap(&self, attempt: u32) -> Duration {
        let factor = 1_u32
            .checked_shl(attempt.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.base_delay.saturating_mul(factor).min(self.max_delay)
    }

    /// The delay before the attempt after failed attempt `attempt`, or `None`
    /// when `error` is not transient or the attempts are spent.
    fn next_delay<E: Transient>(&self, attempt: u32, error: &E) -> Option<Duration> {
        if !error.is_transient() || attempt >= self.max_attempts {
            return None;
        }
        let delay = self.delay_cap(attempt).mul_f64(fastrand::f64());
        tracing::debug!(
            attempt,
            ?delay,
            "lockkit: transient failure, retrying the transaction"
        );
        Some(delay)
    }
}

/// Runs `op` until it succeeds, fails with a non-transient error, or
/// `policy`'s attempts are spent; sleeps a jittered backoff between attempts.
///
/// `op` receives the attempt number (1-based) and returns a future that must
/// run the *whole* transaction: a deadlock or serialization failure aborts
/// it, so the retry begins a new one. The future `retry` returns is `Send`
/// when `op`'s futures are, so it runs in `tokio::spawn`: give `op` what it
/// needs by value (a pool, an `Arc`), as below.
///
/// ```no_run
/// # use lockkit::{AdvisoryKey, Locker, RetryPolicy};
/// # #[derive(AdvisoryKey)] struct Account { id: i64 }
/// # async fn run(locker: Locker, config: tokio_postgres::Config) {
/// let task = tokio::spawn(async move {
///     lockkit::retry(&RetryPolicy::default(), |_attempt| {
///         let (locker, config) = (locker.clone(), config.clone());
///         async move {
///             let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
///             tokio::spawn(connection);
///             let tx = locker.begin(&mut client).await?;
///             let _a = tx.lock(Account { id: 1 }).await?;
///             tx.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1", &[]).await?;
///             tx.commit().await
///         }
///     })
///     .await
/// });
/// # let _ = task;
/// # }
/// ```
///
/// # Errors
///
/// The last error of `op`: the first non-transient one, or the transient one
/// of the last attempt.
///
/// # Cancel safety
///
/// As cancel safe as `op`'s futures: dropping the future drops the attempt
/// in flight (whose transaction then rolls back).
#[cfg(feature = "tokio")]
pub async fn retry<T, E, F, Fut>(policy: &RetryPolicy, mut op: F) -> Result<T, E>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: Transient,
{
    let mut attempt = 1;
    loop {
        match op(attempt).await {
            Err(e) => match policy.next_delay(attempt, &e) {
                Some(delay) => {
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                None => return Err(e),
            },
            ok => return ok,
        }
    }
}

/// The async `retry` for blocking code (Diesel): runs `op` until it
/// succeeds, fails with a non-transient error, or the attempts are spent,
/// sleeping the thread between attempts.
///
/// ```no_run
/// # fn transfer(attempt: u32) -> Result<(), lockkit::Error> { Ok(()) }
/// let policy = lockkit::RetryPolicy::default();
/// lockkit::retry_blocking(&policy, |attempt| transfer(attempt))?;
/// # Ok::<(), lockkit::Error>(())
/// ```
///
/// # Errors
///
/// The last error of `op`: the first non-transient one, or the transient one
/// of the last attempt.
pub fn retry_blocking<T, E, F>(policy: &RetryPolicy, mut op: F) -> Result<T, E>
where
    F: FnMut(u32) -> Result<T, E>,
    E: Transient,
{
    let mut attempt = 1;
    loop {
        match op(attempt) {
            Err(e) => match policy.next_delay(attempt, &e) {
                Some(delay) => {
                    std::thread::sleep(delay);
                    attempt += 1;
                }
                None => return Err(e),
            },
            ok => return ok,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::error::ErrorKind;

    fn deadlock() -> Error {
        DriverError::new("deadlock")
            .code(Some("40P01"))
            .into_error()
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = RetryPolicy::default().delays(Duration::from_millis(10), Duration::from_millis(50));
        assert_eq!(p.delay_cap(1), Duration::from_millis(10));
        assert_eq!(p.delay_cap(2), Duration::from_millis(20));
        assert_eq!(p.delay_cap(3), Duration::from_millis(40));
        assert_eq!(p.delay_cap(4), Duration::from_millis(50));
        assert_eq!(p.delay_cap(100), Duration::from_millis(50));
        assert_eq!(RetryPolicy::default().max_attempts(0).max_attempts, 1);
    }

    #[test]
    fn blocking_retries_transient_errors_only() {
        let policy = RetryPolicy::default()
            .max_attempts(4)
            .delays(Duration::ZERO, Duration::ZERO);
        let mut calls = 0;
        let r: Result<u32, Error> = retry_blocking(&policy, |n| {
            calls += 1;
            if n < 3 {
                Err(deadlock())
            } else {
                Ok(n)
            }
        });
        assert_eq!(r.unwrap(), 3);
        assert_eq!(calls, 3);
        let mut calls = 0;
        let r: Result<(), Error> = retry_blocking(&policy, |_| {
            calls += 1;
            Err(Error::new(ErrorKind::HotStandby))
        });
        assert_eq!(r.unwrap_err().kind(), ErrorKind::HotStandby);
        assert_eq!(calls, 1);
    }

    #[cfg(feature = "tokio")]
    #[tokio::test(start_paused = true)]
    async fn retries_transient_errors_only() {
        let policy = RetryPolicy::default().max_attempts(4);
        let calls = std::sync::atomic::AtomicU32::new(0);
        let r: Result<u32, Error> = retry(&policy, |n| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if n < 3 {
                    Err(deadlock())
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
        assert_eq!(calls.into_inner(), 3);

        let mut calls = 0;
        let r: Result<(), Error> = retry(&policy, |_| {
            calls += 1;
            async { Err(deadlock()) }
        })
        .await;
        assert!(r.unwrap_err().is_deadlock());
        assert_eq!(calls, 4);
    }

    /// `retry`'s future is `Send`, so that it can run in a spawned task.
    #[cfg(feature = "tokio")]
    #[test]
    fn retry_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let policy = RetryPolicy::default();
        let shared = std::sync::Arc::new(5_u32);
        let fut = retry(&policy, move |attempt| {
            let shared = shared.clone();
            async move {
                tokio::task::yield_now().await;
                Ok::<_, Error>(*shared + attempt)
            }
        });
        assert_send(&fut);
    }
}
