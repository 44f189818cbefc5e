//! tokio-postgres's errors as the engine takes them: the SQLSTATE, the
//! primary message and whether the connection is closed, read from the
//! driver's error and classified once, by the engine.

use crate::driver::DriverError;
use crate::Error;

impl From<&tokio_postgres::Error> for DriverError {
    fn from(e: &tokio_postgres::Error) -> Self {
        DriverError::new(String::new())
            .code(e.code().map(tokio_postgres::error::SqlState::code))
            .message(e.as_db_error().map(|d| d.message()))
            .closed(e.is_closed())
    }
}

impl From<tokio_postgres::Error> for DriverError {
    fn from(e: tokio_postgres::Error) -> Self {
        let code = e.code().map(|c| c.code().to_owned());
        let message = e.as_db_error().map(|d| d.message().to_owned());
        let closed = e.is_closed();
        DriverError::new(e)
            .code(code.as_deref())
            .message(message.as_deref())
            .closed(closed)
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        DriverError::from(e).into_error()
    }
}
