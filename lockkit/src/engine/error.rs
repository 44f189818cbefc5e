//! lockkit's one error type, shared by every driver adapter.

use std::error::Error as StdError;
use std::time::Duration;

use crate::key::namespace::NamespaceError;
use crate::key::LockKey;

/// A boxed driver error (`tokio_postgres::Error`, `diesel::result::Error`, …).
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// SQLSTATE codes lockkit maps to their own variants.
pub mod sqlstate {
    /// `40P01 deadlock_detected`.
    pub const DEADLOCK_DETECTED: &str = "40P01";
    /// `40001 serialization_failure`.
    pub const SERIALIZATION_FAILURE: &str = "40001";
    /// `55P03 lock_not_available`: `lock_timeout` expired.
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `57014 query_canceled`: `statement_timeout` expired (or a cancel request).
    pub const QUERY_CANCELED: &str = "57014";
    /// `53200 out_of_memory`: "out of shared memory", the lock table is full.
    pub const OUT_OF_MEMORY: &str = "53200";
    /// `25P02 in_failed_sql_transaction`.
    pub const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
    /// `57P01 admin_shutdown` (`pg_terminate_backend`, fast shutdown).
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    /// `57P02 crash_shutdown`.
    pub const CRASH_SHUTDOWN: &str = "57P02";
    /// `57P03 cannot_connect_now`.
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
}

/// Everything that can go wrong taking an advisory lock.
///
/// Callers branch on the accessors ([`Error::is_timeout`],
/// [`Error::is_deadlock`], [`Error::is_transient`], [`Error::code`]) rather
/// than on variants, which may grow. [`std::error::Error::source`] chains to
/// the driver's error where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock (or the whole batch) was not granted within the timeout. The
    /// transaction is still usable and holds none of the keys requested.
    #[error("timed out after {timeout:?} waiting for {keys} advisory lock(s)")]
    Timeout {
        /// The timeout that expired.
        timeout: Duration,
        /// How many keys were requested.
        keys: usize,
        /// The server's error (`55P03` or `57014`).
        #[source]
        source: BoxError,
    },
    /// The server detected a deadlock (`40P01`) and aborted this transaction.
    /// Roll back and retry; taking keys in one batch avoids the cycle.
    #[error("deadlock detected while acquiring advisory locks; the transaction is aborted")]
    Deadlock {
        /// The server's error.
        #[source]
        source: BoxError,
    },
    /// `40001 serialization_failure`: roll back and retry.
    #[error("serialization failure; the transaction is aborted")]
    SerializationFailure {
        /// The server's error.
        #[source]
        source: BoxError,
    },
    /// `53200`: the server's shared lock table is full. It is sized by
    /// `max_locks_per_transaction` × processes and shared by every session,
    /// so another session's greedy transaction can cause this one's failure.
    #[error("the server's shared lock table is full (out of shared memory); take fewer locks per transaction, stripe keys, or raise max_locks_per_transaction")]
    LockTableFull {
        /// The server's error.
        #[source]
        source: BoxError,
    },
    /// `25P02`: an earlier statement failed and the transaction is aborted;
    /// roll back (or roll back to a savepoint).
    #[error("the transaction is aborted; roll it back before taking locks")]
    TransactionAborted {
        /// The server's error, when the server reported it.
        #[source]
        source: Option<BoxError>,
    },
    /// The connection is gone (`57P01`, a restart, a network failure). The
    /// server released every lock of the session with it.
    #[error("the connection to the server was lost; its locks are released")]
    ConnectionLost {
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// Taking these keys would take the transaction above its lock budget.
    /// Nothing was sent; the transaction is still usable.
    #[error("lock budget exceeded: {held} held + {requested} requested > {allowed} allowed per transaction")]
    BudgetExceeded {
        /// Distinct keys the transaction holds.
        held: usize,
        /// New distinct keys requested.
        requested: usize,
        /// The budget.
        allowed: usize,
    },
    /// A key was requested that sorts below a key the transaction already
    /// holds: the pattern that deadlocks. Nothing was sent.
    #[error("lock order violation: {requested} sorts below {held}, already held; take the keys in one batch or in ascending order")]
    LockOrder {
        /// The greatest key already held.
        held: LockKey,
        /// The smallest new key requested.
        requested: LockKey,
    },
    /// The server is a hot standby: advisory locks there exclude nothing on
    /// the primary.
    #[error(
        "refusing to take advisory locks on a hot standby: they exclude nothing on the primary"
    )]
    HotStandby,
    /// An earlier lock call on this transaction was cancelled (its future
    /// dropped) after its statements were sent, so which keys are held is
    /// unknown. Every later lock call fails until the transaction ends.
    #[error(
        "the transaction is poisoned: an earlier lock call was cancelled mid-flight; roll it back"
    )]
    Poisoned,
    /// Another lock call on this transaction is still in flight (two lock
    /// futures polled concurrently on one transaction). Await one before
    /// starting the next, or put the keys in one batch. Nothing was sent.
    #[error(
        "another lock call on this transaction is still in flight; await it first or use one batch"
    )]
    LockInFlight,
    /// An xact lock was requested outside a transaction: PostgreSQL would
    /// release it at the end of the statement, silently.
    #[error("no transaction is open: a transaction-scoped lock would be released at the end of the statement")]
    NotInTransaction,
    /// The client's `hashtext` disagrees with the connected server's (its byte
    /// order, version or collation differ), so `HashText` keys would not
    /// exclude SQL that locks `hashtext(...)`.
    #[error("client-side hashtext({probe:?}) = {client} but the server says {server}; HashText keys are refused on this server")]
    HashtextMismatch {
        /// The probe string.
        probe: String,
        /// The client's value.
        client: i32,
        /// The server's value.
        server: i32,
    },
    /// A session lock was refused because the connection goes through a
    /// transaction-mode pooler (such as pgbouncer with
    /// `pool_mode = transaction`): the server backend behind it changes
    /// between transactions. A session lock stays on the server connection
    /// that took it, which the pooler then hands to other clients, and the
    /// unlock may reach another backend. Nothing was locked. Connect
    /// directly to PostgreSQL (or through a session-mode pool) for session
    /// locks, or use transaction-scoped locks.
    #[error("refusing a session lock: the connection goes through a transaction-mode pooler (server backend {backend_pid}: {evidence}), so the lock would stay on a server connection that other clients get and the unlock could reach another backend; connect directly to PostgreSQL for session locks, or use transaction-scoped locks")]
    PooledConnection {
        /// The server backend the connection was on first.
        backend_pid: i32,
        /// What the probe saw, e.g. "another client's transaction was given
        /// it" or "the next transaction ran on backend 812".
        evidence: String,
    },
    /// An invalid namespace.
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    /// Any other error from the database or the driver.
    #[error("database error{}", code_suffix(.code))]
    Database {
        /// The SQLSTATE, when the server sent one.
        code: Option<String>,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
}

fn code_suffix(code: &Option<String>) -> String {
    match code {
        Some(c) => format!(" (SQLSTATE {c})"),
        None => String::new(),
    }
}

/// Where a driver error happened, which decides what `57014` and `55P03`
/// mean. For driver adapters.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Context {
    /// A plain statement.
    Plain,
    /// A lock statement run under a lockkit timeout.
    Timeout {
        /// The timeout.
        timeout: Duration,
        /// How many keys were requested.
        keys: usize,
    },
}

impl Error {
    /// Maps a driver error with an optional SQLSTATE onto lockkit's variants.
    ///
    /// For driver adapters; `closed` says whether the driver reports the
    /// connection as closed.
    pub fn from_driver(
        code: Option<&str>,
        closed: bool,
        context: Context,
        source: BoxError,
    ) -> Self {
        use sqlstate::*;
        match (code, context) {
            (Some(LOCK_NOT_AVAILABLE | QUERY_CANCELED), Context::Timeout { timeout, keys }) => {
                Error::Timeout {
                    timeout,
                    keys,
                    source,
                }
            }
            (Some(DEADLOCK_DETECTED), _) => Error::Deadlock { source },
            (Some(SERIALIZATION_FAILURE), _) => Error::SerializationFailure { source },
            (Some(OUT_OF_MEMORY), _) => Error::LockTableFull { source },
            (Some(IN_FAILED_SQL_TRANSACTION), _) => Error::TransactionAborted {
                source: Some(source),
            },
            (Some(ADMIN_SHUTDOWN | CRASH_SHUTDOWN | CANNOT_CONNECT_NOW), _) => {
                Error::ConnectionLost { source }
            }
            (Some(c), _) if c.starts_with("08") => Error::ConnectionLost { source },
            (None, _) if closed => Error::ConnectionLost { source },
            (code, _) => Error::Database {
                code: code.map(str::to_owned),
                source,
            },
        }
    }

    /// The SQLSTATE behind this error, when the server reported one.
    pub fn code(&self) -> Option<&str> {
        use sqlstate::*;
        match self {
            Error::Deadlock { .. } => Some(DEADLOCK_DETECTED),
            Error::SerializationFailure { .. } => Some(SERIALIZATION_FAILURE),
            Error::LockTableFull { .. } => Some(OUT_OF_MEMORY),
            Error::TransactionAborted { source: Some(_) } => Some(IN_FAILED_SQL_TRANSACTION),
            Error::Timeout { source, .. } | Error::ConnectionLost { source } => {
                driver_code(source.as_ref())
            }
            Error::Database { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Whether a lock timeout expired ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Whether the server detected a deadlock (`40P01`).
    pub fn is_deadlock(&self) -> bool {
        matches!(self, Error::Deadlock { .. })
    }

    /// Whether the server's shared lock table is full (`53200`).
    pub fn is_lock_table_full(&self) -> bool {
        matches!(self, Error::LockTableFull { .. })
    }

    /// Whether the connection is gone.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, Error::ConnectionLost { .. })
    }

    /// Whether running the whole transaction again may succeed: a deadlock, a
    /// serialization failure or a timeout. [`retry`](crate::retry) retries
    /// exactly these.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Deadlock { .. } | Error::SerializationFailure { .. } | Error::Timeout { .. }
        )
    }
}

fn driver_code<'e>(source: &'e (dyn StdError + 'static)) -> Option<&'e str> {
    #[cfg(feature = "tokio-postgres")]
    if let Some(e) = source.downcast_ref::<tokio_postgres::Error>() {
        return e.code().map(tokio_postgres::error::SqlState::code);
    }
    #[cfg(feature = "diesel")]
    if let Some(e) = source.downcast_ref::<diesel::result::Error>() {
        return diesel_sqlstate(e).0;
    }
    let _ = source;
    None
}

#[cfg(feature = "tokio-postgres")]
impl Error {
    pub(crate) fn from_pg(e: tokio_postgres::Error, context: Context) -> Self {
        let code = e.code().map(|c| c.code().to_owned());
        let closed = e.is_closed();
        Error::from_driver(code.as_deref(), closed, context, Box::new(e))
    }
}

#[cfg(feature = "tokio-postgres")]
impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::from_pg(e, Context::Plain)
    }
}

/// The SQLSTATE of a Diesel error and whether the connection is closed.
///
/// Diesel does not expose the SQLSTATE: its `DatabaseErrorKind` names a few
/// codes (`40001`, the integrity violations, `25006`, a closed connection),
/// and the rest are recognised by the server's primary message, which is
/// reliable when the server's `lc_messages` is English (`C`, `POSIX`, `en_*`:
/// the default). Messages in another language fall through to
/// [`Error::Database`] without a code.
#[cfg(feature = "diesel")]
fn diesel_sqlstate(e: &diesel::result::Error) -> (Option<&'static str>, bool) {
    use diesel::result::{DatabaseErrorKind as Kind, Error as D};
    let D::DatabaseError(kind, info) = e else {
        return (None, false);
    };
    let by_kind = match kind {
        Kind::UniqueViolation => Some("23505"),
        Kind::ForeignKeyViolation => Some("23503"),
        Kind::NotNullViolation => Some("23502"),
        Kind::CheckViolation => Some("23514"),
        Kind::RestrictViolation => Some("23001"),
        Kind::ExclusionViolation => Some("23P01"),
        Kind::SerializationFailure => Some(sqlstate::SERIALIZATION_FAILURE),
        Kind::ReadOnlyTransaction => Some("25006"),
        _ => None,
    };
    // Primary messages (`errmsg`) of the codes lockkit maps, PostgreSQL 12+.
    const MESSAGES: [(&str, &str); 9] = [
        ("deadlock detected", sqlstate::DEADLOCK_DETECTED),
        (
            "canceling statement due to lock timeout",
            sqlstate::LOCK_NOT_AVAILABLE,
        ),
        ("could not obtain lock", sqlstate::LOCK_NOT_AVAILABLE),
        (
            "canceling statement due to statement timeout",
            sqlstate::QUERY_CANCELED,
        ),
        (
            "canceling statement due to user request",
            sqlstate::QUERY_CANCELED,
        ),
        ("out of shared memory", sqlstate::OUT_OF_MEMORY),
        (
            "current transaction is aborted",
            sqlstate::IN_FAILED_SQL_TRANSACTION,
        ),
        (
            "terminating connection due to administrator command",
            sqlstate::ADMIN_SHUTDOWN,
        ),
        (
            "could not serialize access",
            sqlstate::SERIALIZATION_FAILURE,
        ),
    ];
    let message = info.message();
    let code = by_kind.or_else(|| {
        MESSAGES
            .iter()
            .find(|(prefix, _)| message.starts_with(prefix))
            .map(|(_, code)| *code)
    });
    (code, matches!(kind, Kind::ClosedConnection))
}

#[cfg(feature = "diesel")]
impl Error {
    /// Maps a Diesel error onto lockkit's variants, as the
    /// `From<diesel::result::Error>` impl does but in `context`. For driver
    /// adapters.
    pub fn from_diesel(e: diesel::result::Error, context: Context) -> Self {
        let (code, closed) = diesel_sqlstate(&e);
        Error::from_driver(code, closed, context, Box::new(e))
    }
}

/// With the `diesel` feature, so that `?` works inside
/// `conn.transaction::<_, lockkit::Error, _>(|conn| …)`.
///
/// Diesel does not expose the SQLSTATE; lockkit takes it from Diesel's
/// `DatabaseErrorKind` where that names one, else from the server's English
/// primary message (`deadlock detected`, `canceling statement due to lock
/// timeout`, `out of shared memory`, …). On a server whose `lc_messages` is
/// not English those errors become [`Error::Database`] without a code.
#[cfg(feature = "diesel")]
impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Error::from_diesel(e, Context::Plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxed() -> BoxError {
        "driver".into()
    }

    #[test]
    fn maps_sqlstates() {
        let t = Context::Timeout {
            timeout: Duration::from_millis(5),
            keys: 2,
        };
        assert!(Error::from_driver(Some("55P03"), false, t, boxed()).is_timeout());
        assert!(Error::from_driver(Some("57014"), false, t, boxed()).is_timeout());
        assert!(!Error::from_driver(Some("57014"), false, Context::Plain, boxed()).is_timeout());
        assert!(Error::from_driver(Some("40P01"), false, t, boxed()).is_deadlock());
        assert!(
            Error::from_driver(Some("53200"), false, Context::Plain, boxed()).is_lock_table_full()
        );
        assert!(
            Error::from_driver(Some("57P01"), false, Context::Plain, boxed()).is_connection_lost()
        );
        assert!(
            Error::from_driver(Some("08006"), false, Context::Plain, boxed()).is_connection_lost()
        );
        assert!(Error::from_driver(None, true, Context::Plain, boxed()).is_connection_lost());
        let e = Error::from_driver(Some("25P02"), false, Context::Plain, boxed());
        assert!(matches!(e, Error::TransactionAborted { .. }));
        assert_eq!(e.code(), Some("25P02"));
        let e = Error::from_driver(Some("42P01"), false, Context::Plain, boxed());
        assert_eq!(e.code(), Some("42P01"));
        assert_eq!(e.to_string(), "database error (SQLSTATE 42P01)");
        assert!(!e.is_transient());
        assert!(Error::from_driver(Some("40001"), false, Context::Plain, boxed()).is_transient());
    }

    #[test]
    fn is_send_sync_static() {
        fn check<T: Send + Sync + 'static + StdError>() {}
        check::<Error>();
    }
}
