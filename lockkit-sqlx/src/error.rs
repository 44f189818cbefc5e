//! sqlx's errors as the engine sees them.
//!
//! `From<sqlx::Error> for lockkit::Error` cannot live here (both are foreign
//! to this crate); [`driver_error`] is the one conversion, and
//! [`SqlxResultExt::lock_err`] applies it with `?`.

use lockkit::driver::DriverError;
use lockkit::Error;
use sqlx::postgres::{PgDatabaseError, PgSeverity};

/// sqlx's error as the engine sees it: the SQLSTATE
/// (`sqlx::error::DatabaseError::code`) and the
/// server's primary message when the server sent them, and whether the
/// connection is gone (an I/O error, a closed pool, a crashed worker, or a
/// `FATAL` or `PANIC` error: the server, or a pooler such as pgbouncer,
/// closes the connection after it, whether or not sqlx has read that yet);
/// and a pool that handed out no connection within its `acquire_timeout`
/// (`PoolTimedOut`), a [`lockkit::ErrorKind::Timeout`] with nothing held.
pub fn driver_error(e: sqlx::Error) -> DriverError {
    let (code, message) = match e.as_database_error() {
        Some(db) => (
            db.code().map(|c| c.into_owned()),
            Some(db.message().to_owned()),
        ),
        None => (None, None),
    };
    let fatal = e
        .as_database_error()
        .and_then(|db| db.try_downcast_ref::<PgDatabaseError>())
        .is_some_and(|db| matches!(db.severity(), PgSeverity::Fatal | PgSeverity::Panic));
    let closed = fatal
        || matches!(
            e,
            sqlx::Error::Io(_) | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed
        );
    let pool_timeout = matches!(e, sqlx::Error::PoolTimedOut);
    DriverError::new(e)
        .code(code.as_deref())
        .message(message.as_deref())
        .closed(closed)
        .pool_timeout(pool_timeout)
}

/// sqlx's error as [`lockkit::Error`], typed by its SQLSTATE: a deadlock is
/// [`Error::is_deadlock`], the session's own `lock_timeout` is
/// [`Error::is_timeout`], `pg_terminate_backend` is
/// [`Error::is_connection_lost`], and so on. The sqlx error is the
/// [`source`](std::error::Error::source).
pub fn lock_error(e: sqlx::Error) -> Error {
    driver_error(e).into_error()
}

/// `?` on sqlx results in code whose error type is [`lockkit::Error`].
///
/// ```no_run
/// use lockkit_sqlx::SqlxResultExt;
/// # async fn run(conn: &mut sqlx::PgConnection) -> Result<(), lockkit_sqlx::Error> {
/// sqlx::query("UPDATE accounts SET cents = cents - 1 WHERE id = 1")
///     .execute(conn)
///     .await
///     .lock_err()?;
/// # Ok(())
/// # }
/// ```
pub trait SqlxResultExt<T>: sealed::Sealed {
    /// The error converted with [`lock_error`].
    ///
    /// # Errors
    ///
    /// The sqlx error, as [`lockkit::Error`].
    fn lock_err(self) -> Result<T, Error>;
}

impl<T> SqlxResultExt<T> for Result<T, sqlx::Error> {
    fn lock_err(self) -> Result<T, Error> {
        self.map_err(lock_error)
    }
}

mod sealed {
    #[allow(unreachable_pub)]
    pub trait Sealed {}
    impl<T> Sealed for Result<T, sqlx::Error> {}
}
