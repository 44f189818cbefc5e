//! [`establish`]: an `AsyncPgConnection` that answers everything it sent
//! before it closes, for pools behind a transaction-mode pooler.

use diesel::{ConnectionError, ConnectionResult};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use crate::{named, BoxFuture};

/// Connects to `url` as `AsyncPgConnection::establish` does (diesel-async's
/// set-up included), in plain text, but with a connection that, once the
/// `AsyncPgConnection` is dropped, still reads the answer of every
/// statement it sent before it closes the socket.
///
/// Use it as the set-up of a pool's connections behind a transaction-mode
/// pooler (`ManagerConfig::custom_setup`; [`establish_tls`] for TLS).
///
/// # Why
///
/// diesel-async's `establish` sends its two set-up statements at once, and
/// when the first fails (behind a pooler shared with other applications, a
/// statement name another client left on the server connection) it drops
/// the connection at once, the second statement unanswered. pgbouncer 1.18
/// in transaction mode then hands that server connection, its answer still
/// to come, to the next client waiting: whichever client of the pooler
/// that is, lockkit or not, reads diesel-async's answer as its own (a wrong
/// result, or tokio-postgres's "unexpected message from server"). The same
/// happens whenever a connection of `establish`'s is dropped with a
/// statement in flight. A connection made here ends as tokio-postgres ends
/// one whose client is dropped: it waits for the answers, then says goodbye
/// (`Terminate`), so the pooler has the server connection back idle.
///
/// diesel-async's set-up statements carry names (it names every statement
/// it sends), and outside a transaction a transaction-mode pooler may run
/// the two halves of each (prepare, then bind and run) on two server
/// connections, or meet another process's statement of the same name. A
/// connection made here runs the set-up inside a transaction, whose server
/// connection the pooler keeps for it, after deallocating there the other
/// processes' statements under the names this process will use next, as
/// lockkit's lock calls do when they meet one (see the crate docs).
///
/// # Example
///
/// ```no_run
/// # #[cfg(feature = "deadpool")]
/// # fn pool() -> diesel_async::pooled_connection::deadpool::Pool<diesel_async::AsyncPgConnection> {
/// use diesel_async::pooled_connection::deadpool::Pool;
/// use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
/// use diesel_async::AsyncPgConnection;
///
/// let mut config = ManagerConfig::default();
/// config.custom_setup = Box::new(lockkit_diesel_async::establish);
/// let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
///     "postgres://app@pgbouncer:6432/bank",
///     config,
/// );
/// Pool::builder(manager).build().expect("a pool")
/// # }
/// ```
///
/// # Errors
///
/// [`ConnectionError::InvalidConnectionUrl`] when `url` does not parse,
/// [`ConnectionError::BadConnection`] when the connection fails, and
/// [`ConnectionError::CouldntSetupConfiguration`] when the set-up's
/// statements (diesel-async's, and the transaction and clear around them)
/// fail.
///
/// # Cancel safety
///
/// Cancel safe: dropped before it returns, the connection is dropped as
/// above, after the answers it is owed.
///
/// # Panics
///
/// Outside a tokio runtime (the connection runs on a spawned task).
pub fn establish(url: &str) -> BoxFuture<'_, ConnectionResult<AsyncPgConnection>> {
    Box::pin(establish_tls(url, NoTls))
}

/// [`establish`] with `tls`, a tokio-postgres TLS connector (for example
/// `postgres_openssl::MakeTlsConnector`), for a pool whose set-up closure
/// captures it.
///
/// # Errors
///
/// As [`establish`].
///
/// # Cancel safety
///
/// As [`establish`].
///
/// # Panics
///
/// As [`establish`].
pub async fn establish_tls<T>(url: &str, tls: T) -> ConnectionResult<AsyncPgConnection>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| ConnectionError::InvalidConnectionUrl(e.to_string()))?;
    let (client, connection) = config
        .connect(tls)
        .await
        .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    // tokio-postgres's connection, once every client handle is gone, reads
    // the answers still owed and only then closes. (diesel-async's own
    // driver stops it at once when the connection is dropped.)
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("lockkit-diesel-async: connection ended: {e}");
        }
    });
    // diesel-async's set-up, in a transaction whose server connection the
    // pooler keeps for it, after the names it will use are cleared there.
    let setup =
        |e: tokio_postgres::Error| ConnectionError::CouldntSetupConfiguration(diesel_error(&e));
    named::begin_clear_ahead(&client).await.map_err(setup)?;
    let mut conn = AsyncPgConnection::try_from(client).await?;
    conn.batch_execute("COMMIT")
        .await
        .map_err(ConnectionError::CouldntSetupConfiguration)?;
    Ok(conn)
}

/// tokio-postgres's error as Diesel's, as diesel-async reports one: the
/// server's message when the server sent one (so that lockkit's error
/// conversion recognizes it), tokio-postgres's own words otherwise.
fn diesel_error(e: &tokio_postgres::Error) -> diesel::result::Error {
    let message = e
        .as_db_error()
        .map_or_else(|| e.to_string(), |db| db.message().to_owned());
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::Unknown,
        Box::new(message),
    )
}
