//! Retrying a whole transaction after a transient failure.

use std::time::Duration;

use crate::engine::error::Error;

/// An error that says whether running the whole transaction again may
/// succeed.
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

impl Transient for tokio_postgres::Error {
    fn is_transient(&self) -> bool {
        use tokio_postgres::error::SqlState;
        matches!(self.code(), Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED
            || *c == SqlState::T_R_SERIALIZATION_FAILURE
            || *c == SqlState::LOCK_NOT_AVAILABLE)
    }
}

/// How often and how patiently [`retry`] runs a transaction again.
///
/// The delay before attempt `n + 1` is drawn uniformly from
/// `[0, min(max_delay, base_delay × 2ⁿ⁻¹)]` ("full jitter"), so workers that
/// deadlocked with each other do not collide again in lockstep.
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
}

/// Runs `op` until it succeeds, fails with a non-transient error, or
/// `policy`'s attempts are spent; sleeps a jittered backoff between attempts.
///
/// `op` receives the attempt number (1-based) and must run the *whole*
/// transaction: a deadlock or serialization failure aborts it, so the retry
/// begins a new one.
///
/// ```no_run
/// # use lockkit::{AdvisoryKey, Locker, RetryPolicy};
/// # #[derive(AdvisoryKey)] struct Account { id: i64 }
/// # async fn run(locker: Locker, mut client: tokio_postgres::Client) -> Result<(), lockkit::Error> {
/// lockkit::retry(&RetryPolicy::default(), async |_attempt| {
///     let tx = locker.begin(&mut client).await?;
///     let _a = tx.lock(Account { id: 1 }).await?;
///     tx.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1", &[]).await?;
///     tx.commit().await
/// })
/// .await
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
/// As cancel safe as `op`: dropping the future drops the attempt in flight
/// (whose transaction then rolls back).
pub async fn retry<T, E, F>(policy: &RetryPolicy, mut op: F) -> Result<T, E>
where
    F: AsyncFnMut(u32) -> Result<T, E>,
    E: Transient,
{
    let mut attempt = 1;
    loop {
        match op(attempt).await {
            Err(e) if e.is_transient() && attempt < policy.max_attempts => {
                let cap = policy.delay_cap(attempt);
                let delay = cap.mul_f64(fastrand::f64());
                tracing::debug!(
                    attempt,
                    ?delay,
                    "lockkit: transient failure, retrying the transaction"
                );
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test(start_paused = true)]
    async fn retries_transient_errors_only() {
        let policy = RetryPolicy::default().max_attempts(4);
        let mut calls = 0;
        let r: Result<u32, Error> = retry(&policy, async |n| {
            calls += 1;
            if n < 3 {
                Err(Error::Deadlock {
                    source: "deadlock".into(),
                })
            } else {
                Ok(n)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
        assert_eq!(calls, 3);

        let mut calls = 0;
        let r: Result<(), Error> = retry(&policy, async |_| {
            calls += 1;
            Err(Error::HotStandby)
        })
        .await;
        assert!(matches!(r, Err(Error::HotStandby)));
        assert_eq!(calls, 1);

        let mut calls = 0;
        let r: Result<(), Error> = retry(&policy, async |_| {
            calls += 1;
            Err(Error::Deadlock {
                source: "deadlock".into(),
            })
        })
        .await;
        assert!(r.unwrap_err().is_deadlock());
        assert_eq!(calls, 4);
    }
}
