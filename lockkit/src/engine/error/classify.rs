//! How a driver's error becomes one of lockkit's kinds: by SQLSTATE, or
//! by the server's primary message when the driver hides the code; and
//! the drivers' errors as the engine takes them.

use std::time::Duration;

use super::{sqlstate, Detail, DriverError, Error, ErrorKind};

impl DriverError {
    /// Classifies: `timed` is the lockkit timeout and how long the call had
    /// been running when the error came, for a `*_timeout` call.
    pub(super) fn classify(&self, timed: Option<(Duration, Duration)>) -> ErrorKind {
        use sqlstate::*;
        let code = self.code.as_deref().or_else(|| self.code_by_message());
        let closed = self.closed || self.pooler_fatal();
        if self.pool_timeout {
            return ErrorKind::Timeout;
        }
        match code {
            Some(LOCK_NOT_AVAILABLE) => ErrorKind::Timeout,
            Some(QUERY_CANCELED) => {
                let message = self.message.as_deref().unwrap_or("");
                match timed {
                    // Past the call's timeout, lockkit's own
                    // statement_timeout, whatever the message says: one
                    // that fires as a statement ends cancels the next one
                    // sent already, "due to user request" (PostgreSQL
                    // resets the timeout's indicator when it arms the
                    // next statement's, and the cancel stays pending).
                    // Nor can it fire before its time.
                    Some((timeout, elapsed)) if elapsed >= timeout => ErrorKind::Timeout,
                    _ if message.contains("statement timeout") => ErrorKind::Timeout,
                    _ => ErrorKind::Cancelled,
                }
            }
            Some(DEADLOCK_DETECTED) => ErrorKind::Deadlock,
            Some(SERIALIZATION_FAILURE) => ErrorKind::SerializationFailure,
            Some(OUT_OF_MEMORY) => ErrorKind::LockTableFull,
            Some(IN_FAILED_SQL_TRANSACTION) => ErrorKind::TransactionAborted,
            // A statement name that meets another client's statement, or
            // none, on a server connection a pooler shared.
            Some(DUPLICATE_PREPARED_STATEMENT | INVALID_SQL_STATEMENT_NAME) => {
                ErrorKind::UnexpectedReply
            }
            Some(
                ADMIN_SHUTDOWN | CRASH_SHUTDOWN | CANNOT_CONNECT_NOW | IDLE_IN_TRANSACTION_TIMEOUT,
            ) => ErrorKind::ConnectionLost,
            // A refused message (a `Bind` that does not fit the statement of
            // that name) is an `ERROR` the session survives; a `FATAL` one
            // closes the connection.
            Some(PROTOCOL_VIOLATION) if !closed => ErrorKind::Database,
            Some(c) if c.starts_with("08") => ErrorKind::ConnectionLost,
            _ if closed => ErrorKind::ConnectionLost,
            // A reply the driver could not read in the shape it expected:
            // not this statement's.
            _ if self.foreign_reply => ErrorKind::UnexpectedReply,
            _ => ErrorKind::Database,
        }
    }

    /// The lockkit error for this driver error outside a lock call.
    pub fn into_error(self) -> Error {
        self.into_error_in(None, 0)
    }

    /// When the driver could not read the reply in the statement's shape
    /// ([`DriverError::foreign_reply`]), or the server refused one of
    /// lockkit's own statements as not the
    /// statement lockkit prepared under that name: `08P01` at its `Bind`
    /// (the statement of that name has other columns or parameters),
    /// `22P03` (it takes a parameter of another type: lockkit's own
    /// statements take the types lockkit binds),
    /// `26000` (no statement of that name) or `42P05` (preparing it found
    /// one of that name already). Behind a transaction-mode pooler these
    /// mean the backend's statement of that name is another client's, or
    /// none: the reply is not lockkit's ([`ErrorKind::UnexpectedReply`],
    /// keeping the code), whatever its shape.
    pub(crate) fn into_unexpected(self) -> Result<Error, Self> {
        if self.foreign_reply {
            return Ok(Error::make(
                ErrorKind::UnexpectedReply,
                self.code,
                Detail::None,
                Some(self.source),
            ));
        }
        let code = self.code.clone().or_else(|| {
            // Diesel hides the code; its English message names it.
            let message = self.message.as_deref()?;
            let code = if message.starts_with("bind message has ")
                || message.starts_with("bind message supplies ")
            {
                sqlstate::PROTOCOL_VIOLATION
            } else if message.starts_with("incorrect binary data format in bind parameter") {
                sqlstate::INVALID_BINARY_REPRESENTATION
            } else {
                statement_name_code(message)?
            };
            Some(code.to_owned())
        });
        match code.as_deref() {
            Some(
                sqlstate::PROTOCOL_VIOLATION
                | sqlstate::INVALID_BINARY_REPRESENTATION
                | sqlstate::INVALID_SQL_STATEMENT_NAME
                | sqlstate::DUPLICATE_PREPARED_STATEMENT,
            ) => Ok(Error::make(
                ErrorKind::UnexpectedReply,
                code,
                Detail::None,
                Some(self.source),
            )),
            _ => Err(self),
        }
    }

    /// The lockkit error for this driver error in a lock call of `keys` keys
    /// under `timed` = (lockkit timeout, elapsed) when it was a timed call.
    pub(crate) fn into_error_in(self, timed: Option<(Duration, Duration)>, keys: usize) -> Error {
        let kind = self.classify(timed);
        let detail = match kind {
            ErrorKind::Timeout if self.pool_timeout => Detail::Text(
                "the pool handed out no connection within its acquire timeout; nothing was sent \
                 and nothing is held"
                    .to_owned(),
            ),
            ErrorKind::Timeout => Detail::Timeout {
                timeout: timed
                    .filter(|_| self.code.as_deref() != Some(sqlstate::IN_FAILED_SQL_TRANSACTION))
                    .map(|(t, _)| t),
                keys,
            },
            _ => Detail::None,
        };
        // Keep the code the message named, so `code()` agrees with `kind()`.
        let code = self
            .code
            .clone()
            .or_else(|| self.code_by_message().map(str::to_owned));
        Error::make(kind, code, detail, Some(self.source))
    }

    /// The SQLSTATE the message names, from a driver that hides the code
    /// (Diesel, diesel-async): the server's English primary message, or
    /// pgbouncer's own error text.
    fn code_by_message(&self) -> Option<&'static str> {
        if self.pooler_fatal() {
            return Some(sqlstate::PROTOCOL_VIOLATION);
        }
        let message = self.message.as_deref()?;
        MESSAGES
            .iter()
            .find(|(prefix, _)| message.starts_with(prefix))
            .map(|(_, code)| *code)
            .or_else(|| statement_name_code(message))
    }

    /// Whether the error is one pgbouncer ends the client's connection with,
    /// told by its text from a driver that hides both the SQLSTATE and the
    /// severity (diesel-async): tokio-postgres and sqlx report it `FATAL`,
    /// and libpq (Diesel) as a closed connection.
    fn pooler_fatal(&self) -> bool {
        self.code.is_none()
            && self
                .message
                .as_deref()
                .is_some_and(|m| POOLER_FATAL.contains(&m))
    }
}

/// The SQLSTATE of the server's English message about a prepared
/// statement's name: `42P05` when preparing found one of that name already
/// (`prepared statement "s1" already exists`), `26000` when none was found
/// (`… does not exist`).
fn statement_name_code(message: &str) -> Option<&'static str> {
    statement_name_message(message).map(|(_, code)| code)
}

/// The statement name in the server's English message about a prepared
/// statement's name, with the message's SQLSTATE (see
/// [`statement_name_code`]); `None` for any other message.
pub(crate) fn statement_name_message(message: &str) -> Option<(&str, &'static str)> {
    let rest = message.strip_prefix("prepared statement \"")?;
    if let Some(name) = rest.strip_suffix("\" already exists") {
        Some((name, sqlstate::DUPLICATE_PREPARED_STATEMENT))
    } else {
        let name = rest.strip_suffix("\" does not exist")?;
        Some((name, sqlstate::INVALID_SQL_STATEMENT_NAME))
    }
}

/// pgbouncer's errors that end the client's connection (it sends them with
/// severity `FATAL` and SQLSTATE `08P01`, then closes the connection), by
/// their whole text: no server waits in a pool queue past
/// `query_wait_timeout`; the server connection ended under a client
/// (`server conn crashed?`, or `invalid server parameter` when it ended
/// while pgbouncer set the client's parameters on it); pgbouncer's own
/// timeouts; no server connection could be opened.
pub(super) const POOLER_FATAL: [&str; 7] = [
    "query_wait_timeout",
    "query_timeout",
    "idle transaction timeout",
    "client_idle_timeout",
    "server conn crashed?",
    "invalid server parameter",
    "pgbouncer cannot connect to server",
];

/// Primary messages (`errmsg`, PostgreSQL 12+, English) of the codes lockkit
/// maps, for drivers that do not expose the SQLSTATE (Diesel). On a server
/// whose `lc_messages` is not English those errors are
/// [`ErrorKind::Database`] without a code.
const MESSAGES: [(&str, &str); 10] = [
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
        "terminating connection due to idle-in-transaction timeout",
        sqlstate::IDLE_IN_TRANSACTION_TIMEOUT,
    ),
    (
        "could not serialize access",
        sqlstate::SERIALIZATION_FAILURE,
    ),
];
