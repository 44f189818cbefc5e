//! Where a lock's connection comes from: opened from a
//! `tokio_postgres::Config` (with or without TLS), or leased from a
//! deadpool-postgres pool, and how it is given back; and the settings
//! every form takes its locks with ([`Settings`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Socket};

use crate::driver::DriverError;
use crate::engine::error::Error;
use crate::engine::facts::ServerFacts;
use crate::engine::sql;
use crate::StatementMode;

/// How long opening a lock's connection may take, per host of the
/// configuration, when its `connect_timeout` is not set: see
/// [Bounded waits](super#bounded-waits).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How many connections one [`SessionLock`](super::SessionLock) (with its
/// clones) has at most between opening and either holding a lock or
/// being closed: opening, waiting for a take's answer (a statement queued
/// in a pooler whose server connections are all busy), or being drained
/// after a take that was cut off or gave up ([Connections that hold
/// nothing](super#connections-that-hold-nothing)). A take that finds them
/// all in use waits for one within its own bound (a try one keepalive
/// cadence, a timed call its timeout and one cadence) and, past it, fails
/// with [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) having opened
/// nothing. So however long a loop of tries runs behind a saturated
/// pooler, the `SessionLock`'s clients there are at most its held locks'
/// connections, its multiplexed connections and this many.
pub const PENDING_CONNECTIONS_PER_SESSION_LOCK: usize = 8;

/// What every lock of a [`SessionLock`](super::SessionLock) is taken with,
/// whatever its form: where its connection comes from, and the checks
/// before it is handed out. Cloned with the `SessionLock`.
#[derive(Clone)]
pub(super) struct Settings {
    pub(super) source: Source,
    pub(super) allow_standby: bool,
    pub(super) pooler_check: bool,
    pub(super) probe_timeout: Duration,
    /// Whether each grant mints a fencing token
    /// ([`SessionLock::fencing_tokens`](super::SessionLock::fencing_tokens)).
    pub(super) fencing: bool,
    /// How the multiplexed form sends its statements
    /// ([`SessionLock::statements`](super::SessionLock::statements)).
    pub(super) statements: StatementMode,
    /// Whether a lock's set-up saw that the server has
    /// `client_connection_check_interval` (PostgreSQL 14+): the next
    /// set-ups set it with the cheaper `SET LOCAL` form
    /// ([`sql::write_session_setup`](crate::engine::sql::write_session_setup)).
    /// Shared by clones; cleared when that form fails because the server
    /// has no such setting.
    pub(super) check_interval_known: Arc<AtomicBool>,
    /// The server's facts as the default form last read them (`None`
    /// until its first lock): its locks run the engine under the policy
    /// of these facts ([`xact::policy`](super::xact)). Shared by clones.
    pub(super) facts: Arc<Mutex<Option<ServerFacts>>>,
    /// The slots of the connections that hold no lock yet
    /// ([`PENDING_CONNECTIONS_PER_SESSION_LOCK`]). Shared by clones.
    pub(super) pending: Arc<Semaphore>,
}

impl Settings {
    /// The settings of a new [`SessionLock`](super::SessionLock): its
    /// connections from `source`, the checks on (no standby, the pooler
    /// probe bounded by `probe_timeout`), nothing known of the server.
    pub(super) fn new(source: Source, probe_timeout: Duration) -> Self {
        Settings {
            source,
            allow_standby: false,
            pooler_check: true,
            probe_timeout,
            fencing: false,
            statements: StatementMode::Unnamed,
            check_interval_known: Arc::new(AtomicBool::new(false)),
            facts: Arc::new(Mutex::new(None)),
            pending: Arc::new(Semaphore::new(PENDING_CONNECTIONS_PER_SESSION_LOCK)),
        }
    }

    /// A connection for a take, in one of the lock's pending slots
    /// ([`PENDING_CONNECTIONS_PER_SESSION_LOCK`]): the slot waited for at
    /// most `bound` (`None`: as long as it takes), then the connection
    /// opened or leased ([`Source::lease`]). The slot is the lease's until
    /// a lock is held on it ([`Lease::hold`]) or it is closed.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when no slot
    /// freed within `bound` (nothing was opened); the lease's own errors.
    pub(super) async fn pending_lease(&self, bound: Option<Duration>) -> Result<Lease, Error> {
        let slot = self.pending.clone().acquire_owned();
        let slot = match bound {
            Some(bound) => match tokio::time::timeout(bound, slot).await {
                Ok(slot) => slot,
                Err(_) => return Err(no_slot(bound)),
            },
            None => slot.await,
        }
        .expect("the semaphore is never closed");
        let mut lease = self.source.lease().await?;
        lease.slot = Some(slot);
        Ok(lease)
    }
}

/// The refusal of a take that found no pending slot free within `bound`.
fn no_slot(bound: Duration) -> Error {
    Error::with_message(
        crate::ErrorKind::Timeout,
        format!(
            "no connection slot freed within {bound:?}: this SessionLock has \
             {PENDING_CONNECTIONS_PER_SESSION_LOCK} connections opening, waiting for the server \
             (or for a pooler's free server connection) or being drained; the lock was not \
             granted and nothing was opened"
        ),
    )
}

impl Source {
    /// A connection for a lock (or the probe). No cancel request is ever
    /// sent for a statement on it: a pooler may be in between, and
    /// pgbouncer before 1.19 can die of one (its issues 801, 822, 847),
    /// every client of the pooler with it. A take's wait is bounded on the
    /// server instead, and a cut-off take's connection is drained
    /// ([`drain`](super::drain)).
    ///
    /// It is opened with the configuration's own `application_name`, never
    /// a lock's: a transaction-mode pooler applies a client's startup name
    /// to every server connection it links to that client, with a
    /// session-level `SET`, and a server connection that goes back to the
    /// pool keeps it for the next client that names itself nothing. A lock
    /// names its backend transaction-locally instead
    /// ([`sql::write_session_setup`](crate::engine::sql::write_session_setup)).
    ///
    /// Opening one waits at most [`connect_bound`] (a pool's lease, as the
    /// pool's timeouts say): tokio-postgres bounds only the TCP connect,
    /// and a path gone silent after it (a half-open connection, a pooler
    /// or proxy that accepts and says nothing) would hold the startup
    /// forever.
    pub(super) async fn lease(&self) -> Result<Lease, Error> {
        match self {
            Source::Connect(connect) => {
                let bound = connect_bound(connect.config());
                let opening = tokio::time::timeout(bound, connect.connect());
                let opened = opening.await.map_err(|_| Error::not_connected(bound))?;
                let (client, ended, close) = opened?;
                Ok(Lease::owned(client, ended, close))
            }
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => {
                let object = pool.get().await.map_err(pool_error)?;
                Ok(Lease::pooled(object))
            }
        }
    }
}

/// How long opening a connection of `config` may take: its
/// `connect_timeout` (or [`DEFAULT_CONNECT_TIMEOUT`]) for each of its hosts,
/// which tokio-postgres tries in turn.
fn connect_bound(config: &tokio_postgres::Config) -> Duration {
    let per_host = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let hosts = u32::try_from(config.get_hosts().len()).unwrap_or(u32::MAX);
    per_host.saturating_mul(hosts.max(1))
}

/// The connection of a lock: opened by lockkit, or leased from a pool.
pub(super) struct Lease {
    conn: Option<Conn>,
    /// Flips when the connection task of an owned connection ends.
    pub(super) ended: Option<watch::Receiver<bool>>,
    /// Whether nothing of the lock can be left on the connection and no
    /// statement is in flight on it: set only once that is known. A pooled
    /// connection goes back to its pool only then. An owned one then ends
    /// as a dropped tokio-postgres client ends; otherwise it is closed at
    /// once, since tokio-postgres keeps a connection whose client is gone
    /// open until its last statement is answered: over a silent path
    /// never, and behind a pooler the statement the caller gave up on
    /// would still wait there and run (taking its key) once a server
    /// connection frees.
    pub(super) clean: bool,
    /// Closes an owned connection now, while its client is still shared.
    close: Option<Arc<Notify>>,
    /// Whether the session-level form set its lease (`idle_session_timeout`)
    /// and client check on this pooled connection, for the lock's time: reset
    /// ([`Lease::reset_session_lease`]) before the connection may go back.
    pub(super) session_lease: AtomicBool,
    /// The pending slot the connection takes until a lock is held on it
    /// ([`Settings::pending_lease`]); `None` once one is, or for the
    /// probe's connections.
    slot: Option<OwnedSemaphorePermit>,
}

enum Conn {
    Owned(Client),
    #[cfg(feature = "deadpool")]
    Pooled(deadpool_postgres::Object),
}

impl Lease {
    fn owned(client: Client, ended: watch::Receiver<bool>, close: Arc<Notify>) -> Self {
        Lease {
            conn: Some(Conn::Owned(client)),
            ended: Some(ended),
            clean: false,
            close: Some(close),
            session_lease: AtomicBool::new(false),
            slot: None,
        }
    }

    #[cfg(feature = "deadpool")]
    fn pooled(object: deadpool_postgres::Object) -> Self {
        Lease {
            conn: Some(Conn::Pooled(object)),
            ended: None,
            clean: false,
            close: None,
            session_lease: AtomicBool::new(false),
            slot: None,
        }
    }

    pub(super) fn client(&self) -> &Client {
        match &self.conn {
            Some(Conn::Owned(client)) => client,
            #[cfg(feature = "deadpool")]
            Some(Conn::Pooled(object)) => object,
            None => unreachable!("only Drop takes the connection"),
        }
    }

    /// The connection, moved out into a lease of its own (for a task to
    /// drain it), leaving this one empty: dropping it does nothing.
    pub(super) fn take_out(&mut self) -> Lease {
        Lease {
            conn: self.conn.take(),
            ended: self.ended.take(),
            clean: false,
            close: self.close.take(),
            session_lease: AtomicBool::new(self.session_lease.load(Ordering::Acquire)),
            slot: self.slot.take(),
        }
    }

    /// A lock is held on the connection: it leaves its pending slot
    /// ([`PENDING_CONNECTIONS_PER_SESSION_LOCK`]) to the next take.
    pub(super) fn hold(&mut self) {
        self.slot = None;
    }

    pub(super) fn is_owned(&self) -> bool {
        matches!(self.conn, Some(Conn::Owned(_)))
    }

    /// Gives the pool's connection the server's `idle_session_timeout` and
    /// `client_connection_check_interval` back, if the session-level form
    /// set its lease and client check on it: before the connection may go
    /// back to its pool, where the lease would end its idle session.
    ///
    /// # Errors
    ///
    /// When the `RESET` fails: the connection must not go back.
    pub(super) async fn reset_session_lease(&self) -> Result<(), Error> {
        if self.session_lease.load(Ordering::Acquire) {
            self.client()
                .batch_execute(sql::RESET_SESSION_LEASE)
                .await?;
            self.session_lease.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Closes an owned connection now, even while its client is shared
    /// (statements in flight fail): the server ends the session, and every
    /// lock on it. A pooled connection closes when the lease drops
    /// (detached from its pool, unless clean).
    pub(super) fn close(&self) {
        if let Some(close) = &self.close {
            close.notify_one();
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match self.conn.take() {
            #[cfg(feature = "deadpool")]
            Some(Conn::Pooled(object)) if !self.clean => {
                // Never back to the pool: detached and dropped, which aborts
                // its connection task and closes the socket, so the server
                // ends the session and its transaction.
                drop(deadpool_postgres::Object::take(object));
            }
            // An owned connection that is not clean closes now, with
            // whatever is in flight on it (see `clean`); a clean one when its
            // client drops. A clean pooled one goes back to the pool.
            other => {
                if !self.clean {
                    self.close();
                }
                drop(other);
            }
        }
    }
}

#[cfg(feature = "deadpool")]
fn pool_error(e: deadpool_postgres::PoolError) -> Error {
    match e {
        // The pool's error in opening a new connection.
        deadpool_postgres::PoolError::Backend(e) => DriverError::from(e).into_connect_error(),
        e => Error::other(e),
    }
}

/// Where a [`SessionLock`](super::SessionLock) gets its connections.
#[derive(Clone)]
pub(super) enum Source {
    Connect(Arc<dyn Connect>),
    #[cfg(feature = "deadpool")]
    Pool(deadpool_postgres::Pool),
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Connect(connect) => f.debug_tuple("Connect").field(connect.config()).finish(),
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => f.debug_tuple("Pool").field(&pool.status()).finish(),
        }
    }
}

/// An opened connection: its client, the watch that flips when it ends,
/// and what closes it ([`Lease::close`]).
pub(super) type Opened = (Client, watch::Receiver<bool>, Arc<Notify>);

/// Opens connections, whatever the TLS connector's type.
pub(super) trait Connect: Send + Sync {
    fn connect(&self) -> BoxFuture<'_, Result<Opened, Error>>;
    fn config(&self) -> &tokio_postgres::Config;
}

pub(super) struct Direct<T> {
    pub(super) config: tokio_postgres::Config,
    pub(super) tls: T,
}

impl<T> Connect for Direct<T>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    /// Connects, and runs the connection on a task that flips the returned
    /// watch to `true` when it ends, and that the returned `Notify` ends
    /// (closing the socket).
    fn connect(&self) -> BoxFuture<'_, Result<Opened, Error>> {
        Box::pin(async move {
            let connecting = self.config.connect(self.tls.clone());
            let (client, connection) = connecting
                .await
                .map_err(|e| DriverError::from(e).into_connect_error())?;
            let (ended, lost) = watch::channel(false);
            let close = Arc::new(Notify::new());
            let closing = close.clone();
            tokio::spawn(async move {
                tokio::select! {
                    result = connection => if let Err(e) = result {
                        tracing::debug!(error = %e, "lockkit: a session lock connection ended");
                    },
                    // Dropping the connection closes its socket.
                    () = closing.notified() => {}
                }
                let _ = ended.send(true);
            });
            Ok((client, lost, close))
        })
    }

    fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{connect_bound, DEFAULT_CONNECT_TIMEOUT};

    /// The bound is per host, as tokio-postgres tries the hosts in turn,
    /// and the default stands in for a `connect_timeout` left unset.
    #[test]
    fn the_connect_bound_is_per_host() {
        let mut config = tokio_postgres::Config::new();
        assert_eq!(connect_bound(&config), DEFAULT_CONNECT_TIMEOUT);
        config.host("db1").host("db2");
        assert_eq!(connect_bound(&config), 2 * DEFAULT_CONNECT_TIMEOUT);
        config.connect_timeout(Duration::from_millis(1500));
        assert_eq!(connect_bound(&config), Duration::from_secs(3));
    }
}
