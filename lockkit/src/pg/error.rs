//! tokio-postgres's errors as the engine takes them: the SQLSTATE, the
//! primary message and whether the connection is closed, read from the
//! driver's error and classified once, by the engine.
//!
//! A `FATAL` (or `PANIC`) error ends the session by the protocol's
//! definition, whether or not tokio-postgres has read the end of the
//! socket yet: the server (or a pooler, as pgbouncer's `query_wait_timeout`
//! and `invalid server parameter`) closes the connection after it. Such an
//! error is a closed connection ([`ErrorKind::ConnectionLost`]), never a
//! bare database error.
//!
//! tokio-postgres's "unexpected message from server", a protocol message
//! that does not fit the reply being read, is a reply that is not this
//! statement's: behind a transaction-mode pooler, another client's. It is
//! [`ErrorKind::UnexpectedReply`], never a bare database error.
//!
//! [`ErrorKind::ConnectionLost`]: crate::ErrorKind::ConnectionLost
//! [`ErrorKind::UnexpectedReply`]: crate::ErrorKind::UnexpectedReply

use crate::driver::DriverError;
use crate::Error;

impl From<&tokio_postgres::Error> for DriverError {
    fn from(e: &tokio_postgres::Error) -> Self {
        DriverError::new(String::new())
            .code(e.code().map(tokio_postgres::error::SqlState::code))
            .message(e.as_db_error().map(|d| d.message()))
            .closed(ends_session(e))
            .foreign_reply(unexpected_message(e))
    }
}

impl From<tokio_postgres::Error> for DriverError {
    fn from(e: tokio_postgres::Error) -> Self {
        let code = e.code().map(|c| c.code().to_owned());
        let message = e.as_db_error().map(|d| d.message().to_owned());
        let closed = ends_session(&e);
        let foreign = unexpected_message(&e);
        DriverError::new(e)
            .code(code.as_deref())
            .message(message.as_deref())
            .closed(closed)
            .foreign_reply(foreign)
    }
}

/// Whether the connection is closed or `e` closes it: a `FATAL` or `PANIC`
/// error (by its `V` field, or by its `S` field from a sender that sends
/// no `V`, as pgbouncer).
fn ends_session(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::Severity;
    e.is_closed()
        || e.as_db_error()
            .is_some_and(|db| match db.parsed_severity() {
                Some(severity) => matches!(severity, Severity::Fatal | Severity::Panic),
                None => matches!(db.severity(), "FATAL" | "PANIC"),
            })
}

/// Whether `e` is tokio-postgres's "unexpected message from server", which
/// it exposes by its text only (no kind, no source).
pub(crate) fn unexpected_message(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_none()
        && std::error::Error::source(e).is_none()
        && e.to_string() == "unexpected message from server"
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        DriverError::from(e).into_error()
    }
}
