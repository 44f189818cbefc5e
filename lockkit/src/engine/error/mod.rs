//! lockkit's one error type, shared by every driver adapter, and the one
//! place where a driver's error becomes one of lockkit's kinds.

use std::error::Error as StdError;
use std::fmt;
use std::panic::Location;
use std::time::Duration;

use crate::key::namespace::NamespaceError;
use crate::key::LockKey;

mod classify;
pub(crate) use classify::statement_name_message;
#[cfg(test)]
mod tests;

/// A boxed driver error (`tokio_postgres::Error`, `diesel::result::Error`, …).
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// SQLSTATE codes lockkit maps to their own kinds.
pub mod sqlstate {
    /// `40P01 deadlock_detected`.
    pub const DEADLOCK_DETECTED: &str = "40P01";
    /// `40001 serialization_failure`.
    pub const SERIALIZATION_FAILURE: &str = "40001";
    /// `55P03 lock_not_available`: `lock_timeout` expired.
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `57014 query_canceled`: `statement_timeout` expired, or a cancel request.
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
    /// `25P03 idle_in_transaction_session_timeout`.
    pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";
    /// `08P01 protocol_violation`: among others, a `Bind` whose result
    /// formats or parameters do not fit the prepared statement of that name.
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    /// `26000 invalid_sql_statement_name`: no prepared statement of that
    /// name.
    pub const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    /// `42P05 duplicate_prepared_statement`: a prepared statement of that
    /// name exists already.
    pub const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
    /// `22P03 invalid_binary_representation`: among others, a binary
    /// parameter of a `Bind` that the prepared statement of that name takes
    /// as another type.
    pub const INVALID_BINARY_REPRESENTATION: &str = "22P03";
}

/// What went wrong, to match on. New kinds may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A lock was not granted in time: a lockkit timeout, or the session's own
    /// `lock_timeout` (`55P03`) or `statement_timeout` (`57014`). After a
    /// lockkit timeout the transaction is still usable and holds none of the
    /// keys requested; after the session's own timeout it is aborted. Also a
    /// session lock's pooler probe that did not finish in time (its source
    /// is a `lockkit::pg::ProbeTimeout`), or a pool that handed out no
    /// connection within its own bound (lockkit-sqlx's `Locker::transaction`
    /// on a `PgPool`: sqlx's `PoolTimedOut`): nothing was locked.
    Timeout,
    /// The statement was cancelled by a cancel request (`57014`, "user
    /// request"): an administrator's `pg_cancel_backend`, or lockkit's own
    /// cancel of a dropped lock future. Not a timeout, except past a timed
    /// call's timeout: there PostgreSQL reports the call's own
    /// `statement_timeout`, when it fired as a statement ended, as a cancel
    /// of the next statement, and the call is a [`Timeout`](Self::Timeout).
    Cancelled,
    /// The server detected a deadlock (`40P01`) and aborted the transaction.
    Deadlock,
    /// `40001 serialization_failure`: roll back and retry.
    SerializationFailure,
    /// `53200`: the server's shared lock table is full.
    LockTableFull,
    /// The transaction is aborted (`25P02`, or an earlier lock statement
    /// failed); roll it back. Also a commit (or a savepoint's release)
    /// that lockkit refused and rolled back instead, because a lock call's
    /// error had aborted the transaction.
    TransactionAborted,
    /// The connection is gone; the server released its locks with it.
    /// Only for a connection that existed: one that could not be opened is
    /// a [`ConnectFailed`](Self::ConnectFailed).
    ConnectionLost,
    /// No connection was made: a connection lockkit opens (a session
    /// lock's, the pooler probe's, a deadpool pool's new one) was refused,
    /// or its server could not be reached. The server, or a pooler in front
    /// of it, is full (`53300` too_many_connections: "sorry, too many
    /// clients already", or "remaining connection slots are reserved";
    /// pgbouncer's "no more connections allowed (max_client_conn)", which
    /// it sends as `08P01`), authentication failed (`28P01`, `28000`), the
    /// database does not exist (`3D000`), the server is not accepting
    /// connections now (`57P03`: starting up, shutting down, in recovery)
    /// or refused for another reason; or the TCP connect was refused or
    /// timed out, or the opening got no answer within its bound.
    /// [`Error::code`] is the SQLSTATE the server or pooler sent, if any,
    /// and the message says what happened and what to do. Nothing was
    /// held, so nothing was released: unlike a
    /// [`ConnectionLost`](Self::ConnectionLost), no lock was lost.
    ConnectFailed,
    /// Taking the keys would exceed the transaction's lock budget. Nothing
    /// was sent.
    BudgetExceeded,
    /// A lock call that waits asked for a key below one already held (the
    /// pattern that deadlocks; a try is never refused for it). Nothing was
    /// sent. [`Error::key_types`] and [`Error::lock_order_sites`] say which
    /// key types and which call sites.
    LockOrder,
    /// The server is a hot standby; nothing was sent.
    HotStandby,
    /// An earlier lock call on this transaction was cut off (its future
    /// dropped, or its reply unusable), so what is held is unknown.
    Poisoned,
    /// Another lock call on this transaction is still in flight.
    LockInFlight,
    /// No transaction is open: an xact lock would be released at the end
    /// of its statement.
    NotInTransaction,
    /// The client's `hashtext` disagrees with the server's.
    HashtextMismatch,
    /// A plain session-level lock was refused behind a transaction-mode
    /// pooler.
    PooledConnection,
    /// The server answered a lockkit statement with something that is not
    /// its reply (e.g. a foreign prepared statement of the same name behind
    /// a pooler, whose row is not lockkit's, or whose columns or parameters
    /// made the server refuse the `Bind`: `08P01`, or `22P03` for a
    /// parameter of another type; no statement of that
    /// name: `26000`; or, preparing lockkit's statement, another one of that
    /// name already: `42P05`). Nothing is known to be held; the transaction is
    /// poisoned.
    UnexpectedReply,
    /// An invalid namespace.
    Namespace,
    /// A call needs lockkit's SQL functions (fencing tokens, the fence) and
    /// the database has none, or older ones: install them with
    /// `lockkit sql install`, or the script of [`sql`](crate::sql). Nothing
    /// is held.
    NotInstalled,
    /// Any other database or driver error.
    Database,
}

impl ErrorKind {
    /// Whether running the whole transaction again may succeed: a deadlock,
    /// a serialization failure or a timeout.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorKind::Deadlock | ErrorKind::SerializationFailure | ErrorKind::Timeout
        )
    }
}

/// Everything that can go wrong taking an advisory lock.
///
/// Opaque, like `tokio_postgres::Error`: branch on [`Error::kind`] or the
/// `is_*` accessors. [`std::error::Error::source`] chains to the driver's
/// error where there is one, and [`Error::code`] is the SQLSTATE the server
/// sent.
///
/// ```no_run
/// # use lockkit::{AdvisoryKey, ErrorKind, LockTx};
/// # #[derive(AdvisoryKey)] struct Order { id: i64 }
/// # async fn run(tx: &LockTx<'_>) -> Result<(), lockkit::Error> {
/// match tx.lock_timeout(Order { id: 42 }, std::time::Duration::from_millis(50)).await {
///     Ok(_held) => { /* … */ }
///     Err(e) if e.is_timeout() => println!("order 42 is busy: {e}"),
///     Err(e) if e.kind() == ErrorKind::Deadlock => return Err(e), // retry the transaction
///     Err(e) => return Err(e),
/// }
/// # Ok(())
/// # }
/// ```
pub struct Error(Box<Inner>);

struct Inner {
    kind: ErrorKind,
    code: Option<String>,
    detail: Detail,
    /// The key types (namespaces) of the lock call the error is about.
    key_types: Vec<&'static str>,
    source: Option<BoxError>,
}

/// One acquisition as a lock-order error names it: the key, its type
/// (namespace) and where the application asked for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Acquired {
    pub(crate) key: LockKey,
    pub(crate) key_type: &'static str,
    pub(crate) site: Option<&'static Location<'static>>,
}

impl Acquired {
    /// `the Account key 42 (taken at src/main.rs:3:5)`, the site named
    /// after `verb` when it is known.
    fn describe(&self, f: &mut fmt::Formatter<'_>, verb: &str) -> fmt::Result {
        write!(f, "the {} key {}", self.key_type, self.key)?;
        match self.site {
            Some(site) => write!(f, " ({verb} at {site})"),
            None => Ok(()),
        }
    }
}

/// What the message says beyond the kind.
enum Detail {
    None,
    Timeout {
        timeout: Option<Duration>,
        keys: usize,
    },
    Budget {
        held: usize,
        /// Each key type held, with its count of held keys.
        held_types: Vec<(&'static str, usize)>,
        requested: usize,
        allowed: usize,
    },
    Order {
        held: Acquired,
        requested: Acquired,
    },
    Hashtext {
        probe: String,
        client: i32,
        server: i32,
    },
    Pooled {
        backend_pid: i32,
        evidence: String,
    },
    Text(String),
}

/// Why lockkit refused a commit (or a savepoint's release) and rolled back
/// instead ([`Error::not_committed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// A lock call was cut off while the server waited: its statement's
    /// own error (a statement timeout) or the cancel request the driver
    /// sent may abort the transaction, whenever it lands.
    CutOff,
    /// A lock call's error aborted the transaction (or the savepoint).
    Aborted,
}

impl Error {
    fn make(
        kind: ErrorKind,
        code: Option<String>,
        detail: Detail,
        source: Option<BoxError>,
    ) -> Self {
        Error(Box::new(Inner {
            kind,
            code,
            detail,
            key_types: Vec::new(),
            source,
        }))
    }

    /// This error as a lockkit timeout of `keys` keys under `timeout`
    /// when it is a [`TransactionAborted`](ErrorKind::TransactionAborted)
    /// that a timed call met inside itself, past its timeout (see
    /// `Acquisition::own_timeout`); any other error as it is. The server's
    /// code (`25P02`) and error stay, as the source.
    pub(crate) fn aborted_as_timeout(mut self, timeout: Duration, keys: usize) -> Self {
        if self.0.kind == ErrorKind::TransactionAborted {
            self.0.kind = ErrorKind::Timeout;
            self.0.detail = Detail::Timeout {
                timeout: Some(timeout),
                keys,
            };
        }
        self
    }

    pub(crate) fn new(kind: ErrorKind) -> Self {
        Error::make(kind, None, Detail::None, None)
    }

    /// `requested` new keys of the types `key_types` would exceed the
    /// budget `allowed` with `held` held, of `held_types` (each type with its
    /// count of held keys).
    pub(crate) fn budget(
        (held, held_types): (usize, Vec<(&'static str, usize)>),
        requested: usize,
        allowed: usize,
        key_types: Vec<&'static str>,
    ) -> Self {
        Error::make(
            ErrorKind::BudgetExceeded,
            None,
            Detail::Budget {
                held,
                held_types,
                requested,
                allowed,
            },
            None,
        )
        .with_key_types(key_types)
    }

    /// `requested` sorts below `held`, held already.
    pub(crate) fn lock_order(held: Acquired, requested: Acquired) -> Self {
        let mut key_types = vec![held.key_type, requested.key_type];
        key_types.dedup();
        Error::make(
            ErrorKind::LockOrder,
            None,
            Detail::Order { held, requested },
            None,
        )
        .with_key_types(key_types)
    }

    /// The error of a lock call of keys of the types `key_types`
    /// (distinct, in the order of their first key in the global order).
    pub(crate) fn with_key_types(mut self, key_types: Vec<&'static str>) -> Self {
        self.0.key_types = key_types;
        self
    }

    pub(crate) fn hashtext(probe: String, client: i32, server: i32) -> Self {
        Error::make(
            ErrorKind::HashtextMismatch,
            None,
            Detail::Hashtext {
                probe,
                client,
                server,
            },
            None,
        )
    }

    /// A plain session-level lock refused behind a transaction-mode pooler.
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn pooled(backend_pid: i32, evidence: String) -> Self {
        Error::make(
            ErrorKind::PooledConnection,
            None,
            Detail::Pooled {
                backend_pid,
                evidence,
            },
            None,
        )
    }

    pub(crate) fn unexpected(what: String) -> Self {
        Error::make(ErrorKind::UnexpectedReply, None, Detail::Text(what), None)
    }

    /// A connection whose opening (the TCP connect, TLS, the startup) got
    /// no answer within `bound`: [`ErrorKind::ConnectFailed`].
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn not_connected(bound: Duration) -> Self {
        Error::with_message(
            ErrorKind::ConnectFailed,
            format!(
                "could not connect to the server: no answer within {bound:?} (TCP connect, TLS, \
                 startup: the server, or the path to it, is silent); no connection was made and \
                 nothing was held: check that the server is running and reachable"
            ),
        )
    }

    /// An error of `kind` with a message of its own (for kinds whose
    /// standard message does not fit, e.g. a database error lockkit found).
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn with_message(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error::make(kind, None, Detail::Text(message.into()), None)
    }

    /// The refusal of a commit (at `depth` 0) or of a savepoint's release,
    /// for the reason `why`: it was rolled back instead, and `rollback` is
    /// that rollback's own error when it failed too.
    pub(crate) fn not_committed(why: Refused, depth: u32, rollback: Option<BoxError>) -> Self {
        let (kind, what) = match why {
            Refused::CutOff => (
                ErrorKind::Poisoned,
                "a lock call of this transaction was cut off in flight, and its \
                 statement's error or its cancel request may abort the transaction: \
                 it was not committed",
            ),
            Refused::Aborted if depth == 0 => (
                ErrorKind::TransactionAborted,
                "a lock call's error aborted the transaction (PostgreSQL answers COMMIT \
                 there by rolling back): it was not committed",
            ),
            Refused::Aborted => (
                ErrorKind::TransactionAborted,
                "a lock call's error aborted the savepoint: it was not released",
            ),
        };
        match rollback {
            None => Error::with_message(kind, format!("{what}, and is rolled back")),
            Some(e) => Error::with_source(kind, format!("{what}; its rollback failed"), e),
        }
    }

    /// The server's `source` error of a call that needs lockkit's SQL
    /// functions for `what`, when they are missing (no schema `lockkit`,
    /// no such function or table: `3F000`, `42883`, `42P01`; from a driver
    /// that hides the SQLSTATE, Diesel's, an error that names
    /// `lockkit.fencing_counter` or the schema) as
    /// [`ErrorKind::NotInstalled`], with the server's SQLSTATE; any other
    /// error as it is.
    pub(crate) fn not_installed_or(source: Error, what: &str) -> Self {
        let missing = match source.code() {
            Some(code) => matches!(code, "3F000" | "42883" | "42P01"),
            None => {
                let mut text = source.to_string();
                let mut cause = std::error::Error::source(&source);
                while let Some(e) = cause {
                    text.push_str(&e.to_string());
                    cause = e.source();
                }
                text.contains("\"lockkit.fencing_counter\" does not exist")
                    || text.contains("schema \"lockkit\" does not exist")
            }
        };
        match missing {
            // The server's SQLSTATE kept: it answered, so the connection
            // is alive and its transaction aborted.
            true => Error::make(
                ErrorKind::NotInstalled,
                source.code().map(str::to_owned),
                Detail::Text(format!(
                    "{what} needs lockkit's SQL functions, which this database does not have \
                     (or has in an older version): install them with `lockkit sql install` \
                     or lockkit::sql::install; nothing is held"
                )),
                Some(source.into()),
            ),
            false => source,
        }
    }

    /// Any other error (a pool's, an application's), as
    /// [`ErrorKind::Database`], so that a closure returning lockkit's
    /// `Error` can use `?` on it.
    pub fn other(source: impl Into<BoxError>) -> Self {
        Error::make(ErrorKind::Database, None, Detail::None, Some(source.into()))
    }

    /// An error of `kind` with a message of its own and a source.
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn with_source(
        kind: ErrorKind,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::make(
            kind,
            None,
            Detail::Text(message.into()),
            Some(source.into()),
        )
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    /// The SQLSTATE the server sent, when it sent one (recorded when the
    /// error was made).
    pub fn code(&self) -> Option<&str> {
        self.0.code.as_deref()
    }

    /// Whether a lock was not granted in time ([`ErrorKind::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        self.0.kind == ErrorKind::Timeout
    }

    /// Whether the server detected a deadlock (`40P01`).
    pub fn is_deadlock(&self) -> bool {
        self.0.kind == ErrorKind::Deadlock
    }

    /// Whether the server's shared lock table is full (`53200`).
    pub fn is_lock_table_full(&self) -> bool {
        self.0.kind == ErrorKind::LockTableFull
    }

    /// Whether the connection is gone.
    pub fn is_connection_lost(&self) -> bool {
        self.0.kind == ErrorKind::ConnectionLost
    }

    /// Whether running the whole transaction again may succeed: a deadlock, a
    /// serialization failure or a timeout. `retry` retries
    /// exactly these, and so does it for a driver's error of the same
    /// SQLSTATE ([`Transient`](crate::Transient)).
    pub fn is_transient(&self) -> bool {
        self.0.kind.is_transient()
    }

    /// The lockkit timeout that expired, for a [`ErrorKind::Timeout`] of a
    /// `*_timeout` call (`None` when the session's own setting fired).
    pub fn timeout(&self) -> Option<Duration> {
        match self.0.detail {
            Detail::Timeout { timeout, .. } => timeout,
            _ => None,
        }
    }

    /// For [`ErrorKind::BudgetExceeded`]: the distinct keys held, the new
    /// distinct keys requested, and the budget.
    pub fn budget_counts(&self) -> Option<(usize, usize, usize)> {
        match self.0.detail {
            Detail::Budget {
                held,
                requested,
                allowed,
                ..
            } => Some((held, requested, allowed)),
            _ => None,
        }
    }

    /// For [`ErrorKind::BudgetExceeded`]: each key type (namespace) the
    /// transaction holds keys of, with how many, most first: what used the
    /// budget.
    pub fn budget_held_types(&self) -> Option<&[(&'static str, usize)]> {
        match &self.0.detail {
            Detail::Budget { held_types, .. } => Some(held_types),
            _ => None,
        }
    }

    /// For [`ErrorKind::LockOrder`]: the greatest key held and the smallest
    /// key requested below it.
    pub fn lock_order_keys(&self) -> Option<(LockKey, LockKey)> {
        match self.0.detail {
            Detail::Order { held, requested } => Some((held.key, requested.key)),
            _ => None,
        }
    }

    /// For [`ErrorKind::LockOrder`]: where the application took the
    /// greatest key held and where it asked for the key below it (each
    /// `None` when the adapter did not know the call site).
    #[allow(clippy::type_complexity)]
    pub fn lock_order_sites(
        &self,
    ) -> Option<(
        Option<&'static Location<'static>>,
        Option<&'static Location<'static>>,
    )> {
        match self.0.detail {
            Detail::Order { held, requested } => Some((held.site, requested.site)),
            _ => None,
        }
    }

    /// The key types (the [`AdvisoryKey`](crate::AdvisoryKey) namespaces)
    /// the error is about: for [`ErrorKind::LockOrder`], the type of the
    /// key held and then the type of the key requested below it (one entry
    /// when both are of one type); for [`ErrorKind::BudgetExceeded`], the
    /// types of the keys requested; for an error of a lock call that went
    /// to the server ([`ErrorKind::Timeout`], [`ErrorKind::Deadlock`], …),
    /// the types of the keys the call asked for. Distinct, in the global
    /// lock order of their first key. A key given as a plain
    /// [`LockKey`] is of the type `raw`. Empty for an error of no lock call.
    pub fn key_types(&self) -> &[&'static str] {
        &self.0.key_types
    }

    /// For [`ErrorKind::PooledConnection`]: the server backend the
    /// connection was on first.
    pub fn backend_pid(&self) -> Option<i32> {
        match self.0.detail {
            Detail::Pooled { backend_pid, .. } => Some(backend_pid),
            _ => None,
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.0.kind);
        if let Some(code) = &self.0.code {
            d.field("code", code);
        }
        d.field("message", &self.to_string());
        if let Some(source) = &self.0.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ErrorKind as K;
        let inner = &*self.0;
        match (&inner.kind, &inner.detail) {
            (_, Detail::Text(text)) => f.write_str(text),
            (K::Timeout, Detail::Timeout { timeout: Some(t), keys }) => {
                write!(f, "timed out after {t:?} waiting for {keys} advisory lock(s)")?;
                of_types(f, &inner.key_types)
            }
            (K::Timeout, _) => {
                f.write_str(
                    "the session's lock_timeout or statement_timeout expired while waiting for an advisory lock",
                )?;
                of_types(f, &inner.key_types)?;
                f.write_str("; the transaction is aborted")
            }
            (K::Cancelled, _) => {
                f.write_str("the lock statement")?;
                of_types(f, &inner.key_types)?;
                f.write_str(
                    " was cancelled by a cancel request (pg_cancel_backend or a dropped lock future); the transaction is aborted: roll it back",
                )
            }
            (K::Deadlock, _) => {
                f.write_str("deadlock detected while acquiring advisory locks")?;
                of_types(f, &inner.key_types)?;
                f.write_str(
                    "; the transaction is aborted: retry the whole transaction (the error is transient; lockkit::retry does it), and take the keys each transaction needs in one batch, or in ascending order, so that no two wait for each other",
                )
            }
            (K::SerializationFailure, _) => f.write_str(
                "serialization failure; the transaction is aborted: retry the whole transaction (the error is transient; lockkit::retry does it)",
            ),
            (K::LockTableFull, _) => f.write_str(
                "the server's shared lock table is full (out of shared memory); take fewer locks per transaction, stripe keys, or raise max_locks_per_transaction",
            ),
            (K::TransactionAborted, _) => {
                f.write_str("the transaction is aborted; roll it back before taking locks")
            }
            (K::ConnectionLost, _) => f.write_str(
                "the connection to the server was lost; its locks are released: take them again, in a new transaction on a new connection",
            ),
            (K::ConnectFailed, _) => f.write_str(
                "no connection was made to the server; nothing was held",
            ),
            (
                K::BudgetExceeded,
                Detail::Budget {
                    held,
                    held_types,
                    requested,
                    allowed,
                },
            ) => {
                write!(f, "lock budget exceeded: {held} held")?;
                if !held_types.is_empty() {
                    f.write_str(" (")?;
                    for (i, (key_type, n)) in held_types.iter().enumerate() {
                        let sep = if i == 0 { "" } else { ", " };
                        write!(f, "{sep}{n} {key_type}")?;
                    }
                    f.write_str(")")?;
                }
                write!(f, " + {requested} requested")?;
                of_types(f, &inner.key_types)?;
                write!(f, " > {allowed} allowed per transaction")
            }
            (K::LockOrder, Detail::Order { held, requested }) => {
                f.write_str("lock order violation: ")?;
                requested.describe(f, "requested")?;
                f.write_str(" sorts below ")?;
                held.describe(f, "taken")?;
                f.write_str(
                    ", already held; waiting for it can deadlock: take the keys in one batch or in ascending order",
                )
            }
            (K::HotStandby, _) => f.write_str(
                "refusing to take advisory locks on a hot standby: they exclude nothing on the primary",
            ),
            (K::Poisoned, _) => f.write_str(
                "the transaction is poisoned: an earlier lock call was cut off mid-flight, so what it holds is unknown; roll it back",
            ),
            (K::LockInFlight, _) => f.write_str(
                "another lock call on this transaction is still in flight; await it first or use one batch",
            ),
            (K::NotInTransaction, _) => f.write_str(
                "no transaction is open: a transaction-scoped lock would be released at the end of the statement",
            ),
            (
                K::HashtextMismatch,
                Detail::Hashtext {
                    probe,
                    client,
                    server,
                },
            ) => write!(
                f,
                "client-side hashtext({probe:?}) = {client} but the server says {server}; HashText keys are refused on this server"
            ),
            (
                K::PooledConnection,
                Detail::Pooled {
                    backend_pid,
                    evidence,
                },
            ) => write!(
                f,
                "refusing a plain session-level lock: the connection goes through a transaction-mode pooler (server backend {backend_pid}: {evidence}), so the lock would stay on a server connection that other clients get; use the default session lock (held in a transaction of its own), or transaction-scoped locks"
            ),
            (K::UnexpectedReply, _) => match inner.code.as_deref() {
                Some(sqlstate::DUPLICATE_PREPARED_STATEMENT) => f.write_str(
                    "prepared statement name clash (SQLSTATE 42P05): another client's prepared \
                     statement of that name is on this server connection, as behind a \
                     transaction-mode pooler shared with other applications; nothing is known \
                     to be held. Keep StatementMode::Unnamed (the default), in which lockkit's \
                     statements cannot meet another client's (on diesel-async, which names every \
                     statement, lockkit clears a name another client left and sends its \
                     statement again); for named statements of your own, use a pooler that keeps \
                     prepared statements per client (pgbouncer 1.21+ with max_prepared_statements)",
                ),
                Some(sqlstate::INVALID_SQL_STATEMENT_NAME) => f.write_str(
                    "prepared statement missing (SQLSTATE 26000): it was prepared on another \
                     server connection, as behind a transaction-mode pooler; nothing is known \
                     to be held. Keep StatementMode::Unnamed (the default), in which lockkit keeps \
                     no statement on the connection; for named statements of your own, use a \
                     pooler that keeps prepared statements per client (pgbouncer 1.21+ with \
                     max_prepared_statements)",
                ),
                _ => f.write_str(
                    "the server's reply is not the reply of lockkit's statement; nothing is known to be held",
                ),
            },
            (K::Namespace, _) => f.write_str("invalid namespace"),
            (_, _) => match &inner.code {
                Some(code) => write!(f, "database error (SQLSTATE {code})"),
                None => f.write_str("database error"),
            },
        }
    }
}

/// ` of type T` or ` of types T, U`: nothing for no type, or for keys
/// given as plain [`LockKey`]s only (type `raw`, which names nothing).
fn of_types(f: &mut fmt::Formatter<'_>, key_types: &[&str]) -> fmt::Result {
    match key_types {
        [] | [crate::engine::plan::RAW] => Ok(()),
        [one] => write!(f, " of type {one}"),
        [first, rest @ ..] => {
            write!(f, " of types {first}")?;
            for key_type in rest {
                write!(f, ", {key_type}")?;
            }
            Ok(())
        }
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0
            .source
            .as_ref()
            .map(|s| &**s as &(dyn StdError + 'static))
    }
}

/// An error of `kind` with its standard message, for adapters that refuse
/// a call themselves (e.g. [`ErrorKind::NotInTransaction`]).
impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error::new(kind)
    }
}

impl From<NamespaceError> for Error {
    fn from(e: NamespaceError) -> Self {
        Error::make(
            ErrorKind::Namespace,
            None,
            Detail::Text(e.to_string()),
            Some(Box::new(e)),
        )
    }
}

/// A driver's error as an adapter hands it to the engine: the SQLSTATE and
/// primary message when the server sent them, whether the driver reports the
/// connection closed, and the error itself (kept as the
/// [`source`](std::error::Error::source)).
#[derive(Debug)]
pub struct DriverError {
    code: Option<String>,
    message: Option<String>,
    closed: bool,
    foreign_reply: bool,
    pool_timeout: bool,
    source: BoxError,
}

impl DriverError {
    /// A driver error with no SQLSTATE, message or closed flag yet.
    pub fn new(source: impl Into<BoxError>) -> Self {
        DriverError {
            code: None,
            message: None,
            closed: false,
            foreign_reply: false,
            pool_timeout: false,
            source: source.into(),
        }
    }

    /// The SQLSTATE the server sent.
    pub fn code(mut self, code: Option<&str>) -> Self {
        self.code = code.map(str::to_owned);
        self
    }

    /// The server's primary message (`errmsg`).
    pub fn message(mut self, message: Option<&str>) -> Self {
        self.message = message.map(str::to_owned);
        self
    }

    /// Whether the driver reports the connection as closed.
    pub fn closed(mut self, closed: bool) -> Self {
        self.closed = closed;
        self
    }

    /// Whether the driver could not read the reply to one of lockkit's
    /// statements in the statement's own shape (another number of columns,
    /// a column missing): the statement that answered is not lockkit's, and
    /// the lock call fails with [`ErrorKind::UnexpectedReply`].
    pub fn foreign_reply(mut self, foreign: bool) -> Self {
        self.foreign_reply = foreign;
        self
    }

    /// Whether a pool handed out no connection within its own bound (sqlx's
    /// `PoolTimedOut`): nothing was sent, nothing is held, and the error is
    /// an [`ErrorKind::Timeout`].
    pub fn pool_timeout(mut self, timed_out: bool) -> Self {
        self.pool_timeout = timed_out;
        self
    }

    /// The kind this error is, outside any lock call.
    pub fn kind(&self) -> ErrorKind {
        self.classify(None)
    }
}
