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
        if self.pooler_full() {
            return ErrorKind::ConnectFailed;
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
            // Sent, as `FATAL`, only to refuse a connection at its startup:
            // no session existed, so none was lost. (As an `ERROR` in a
            // session, `28000` and `3D000` are other statements' errors.)
            Some(c) if closed && REFUSALS.contains(&c) => ErrorKind::ConnectFailed,
            Some(ADMIN_SHUTDOWN | CRASH_SHUTDOWN | IDLE_IN_TRANSACTION_TIMEOUT) => {
                ErrorKind::ConnectionLost
            }
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

    /// The lockkit error for this driver error in opening a connection
    /// (up to the end of its startup): [`ErrorKind::ConnectFailed`] whatever
    /// it is, since no session existed yet, with the SQLSTATE and a message
    /// that says what refused it and what to do.
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    pub(crate) fn into_connect_error(self) -> Error {
        let code = self
            .code
            .clone()
            .or_else(|| self.code_by_message().map(str::to_owned));
        let text = self.connect_failed_text(code.as_deref());
        Error::make(
            ErrorKind::ConnectFailed,
            code,
            Detail::Text(text),
            Some(self.source),
        )
    }

    /// What a [`ErrorKind::ConnectFailed`] of this error says: what refused
    /// the connection (the server's or the pooler's own words, and `code`),
    /// that nothing was held, and what to do.
    fn connect_failed_text(&self, code: Option<&str>) -> String {
        let (what, todo) = if self.pooler_full() {
            (
                "the pooler is full: it refused a new client",
                "retry later, or keep fewer clients connected to the pooler at once (or raise \
                 its max_client_conn)",
            )
        } else {
            match code {
                Some(TOO_MANY_CONNECTIONS) => (
                    "the server is full: it refused a new connection (too many clients)",
                    "retry later, or open fewer connections at once (fewer processes or \
                     SessionLock connections, or a pooler in front), or raise max_connections",
                ),
                Some(INVALID_PASSWORD | INVALID_AUTHORIZATION_SPECIFICATION) => (
                    "authentication failed: the server refused the connection",
                    "check the user, the password and the server's pg_hba.conf (and sslmode)",
                ),
                Some(INVALID_CATALOG_NAME) => (
                    "the database does not exist: the server refused the connection",
                    "check the database name",
                ),
                Some(sqlstate::CANNOT_CONNECT_NOW) => (
                    "the server is not accepting connections now (starting up, shutting down \
                     or in recovery)",
                    "retry later",
                ),
                Some(_) => (
                    "the server (or a pooler in front of it) refused the connection",
                    "see the server's message",
                ),
                None => (
                    "could not connect to the server",
                    "check the host and port, and that the server is running and reachable",
                ),
            }
        };
        let said = match (self.message.as_deref(), code) {
            (Some(message), Some(code)) => format!("{message} (SQLSTATE {code})"),
            (Some(message), None) => message.to_owned(),
            (None, Some(code)) => format!("SQLSTATE {code}"),
            (None, None) => {
                // The driver's error and its causes ("error connecting to
                // server: Connection refused (os error 111)").
                let mut text = self.source.to_string();
                let mut cause = self.source.source();
                while let Some(e) = cause {
                    let next = e.to_string();
                    if !text.contains(&next) {
                        text = format!("{text}: {next}");
                    }
                    cause = e.source();
                }
                text
            }
        };
        format!("{what}: {said}; no connection was made and nothing was held: {todo}")
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
        let detail = match kind {
            ErrorKind::ConnectFailed => Detail::Text(self.connect_failed_text(code.as_deref())),
            _ => detail,
        };
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

    /// Whether the error is pgbouncer's refusal of a new client when its
    /// `max_client_conn` are all connected, by its whole text (pgbouncer
    /// 1.18 sends it as `FATAL`, SQLSTATE `08P01`, with no `V` field, at
    /// the client's startup; a code that says nothing of a full pooler).
    fn pooler_full(&self) -> bool {
        self.message.as_deref() == Some(POOLER_FULL)
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

/// pgbouncer's refusal of a new client when `max_client_conn` clients are
/// connected, as pgbouncer 1.18 sends it (observed: `FATAL`, SQLSTATE
/// `08P01`, this message, at the client's startup).
const POOLER_FULL: &str = "no more connections allowed (max_client_conn)";

/// `53300 too_many_connections`: "sorry, too many clients already",
/// "remaining connection slots are reserved for …", "too many connections
/// for role …".
const TOO_MANY_CONNECTIONS: &str = "53300";
/// `28P01 invalid_password`: "password authentication failed for user …".
const INVALID_PASSWORD: &str = "28P01";
/// `28000 invalid_authorization_specification`: among others, "no
/// pg_hba.conf entry for host …", "role … does not exist".
const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
/// `3D000 invalid_catalog_name`: "database … does not exist".
const INVALID_CATALOG_NAME: &str = "3D000";

/// The SQLSTATEs with which a server refuses a new connection at its
/// startup (as `FATAL`): too many clients, authentication, no such
/// database, not accepting connections now (`57P03`).
const REFUSALS: [&str; 5] = [
    TOO_MANY_CONNECTIONS,
    INVALID_PASSWORD,
    INVALID_AUTHORIZATION_SPECIFICATION,
    INVALID_CATALOG_NAME,
    sqlstate::CANNOT_CONNECT_NOW,
];

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
