//! Opening the CLI's connection, and bounding every wait for the server.
//!
//! tokio-postgres bounds only the TCP connect (and only when the
//! configuration sets `connect_timeout`): a server that accepts and then
//! says nothing (a stuck server, a half-open path, a proxy) holds the TLS
//! handshake, the startup or a query forever. So the CLI makes the TCP
//! connection itself, runs the rest through `connect_raw` on a stream that
//! tracks how far the opening got, and bounds each step it waits for: the
//! opening of each host, and then each query, by the configuration's
//! `connect_timeout`, or [`DEFAULT_CONNECT_TIMEOUT`] (`SessionLock`'s
//! default) when it sets none. Past the bound the command fails, naming the
//! step that got no answer and the bound.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use lockkit::pg::DEFAULT_CONNECT_TIMEOUT;
use postgres_openssl::MakeTlsConnector;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, SslMode, TargetSessionAttrs};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Config, NoTls};

use crate::{Failure, Result};

/// The bound on each wait for the server: `config`'s `connect_timeout`, or
/// [`DEFAULT_CONNECT_TIMEOUT`].
pub(crate) fn bound_of(config: &Config) -> Duration {
    config
        .get_connect_timeout()
        .copied()
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
}

/// A bound as the messages write it: `2s`, `0.5s`.
pub(crate) fn seconds_text(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// Where an opening got to, so that a timeout names the step that got no
/// answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    /// The TCP connect.
    Connect = 0,
    /// The SSLRequest sent, the server's one-byte answer awaited.
    TlsRequest = 1,
    /// The TLS handshake.
    TlsHandshake = 2,
    /// The startup message sent: authentication and the session's
    /// parameters, up to ReadyForQuery.
    Startup = 3,
}

impl Phase {
    fn load(cell: &AtomicU8) -> Phase {
        match cell.load(Ordering::SeqCst) {
            0 => Phase::Connect,
            1 => Phase::TlsRequest,
            2 => Phase::TlsHandshake,
            _ => Phase::Startup,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Phase::Connect => "the TCP connect",
            Phase::TlsRequest => "the TLS request (the server's answer to SSLRequest)",
            Phase::TlsHandshake => "the TLS handshake",
            Phase::Startup => "the startup (authentication and session parameters)",
        }
    }
}

/// A socket of either kind.
#[derive(Debug)]
enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

/// The connection's socket, noting in `phase` the server's first byte (the
/// answer to the SSLRequest), after which the startup or the TLS handshake
/// follows.
#[derive(Debug)]
pub(crate) struct Watched {
    socket: Socket,
    phase: Arc<AtomicU8>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = match &mut this.socket {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        };
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let _ = this.phase.compare_exchange(
                Phase::TlsRequest as u8,
                Phase::Startup as u8,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.socket {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.socket {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.socket {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A TLS connector that notes in `phase` when its handshake starts and
/// ends.
struct Phased<T> {
    inner: T,
    phase: Arc<AtomicU8>,
}

type Handshake<S, E> = Pin<Box<dyn Future<Output = std::result::Result<S, E>> + Send>>;

impl<S, T> TlsConnect<S> for Phased<T>
where
    T: TlsConnect<S>,
    T::Future: Send + 'static,
    T::Stream: 'static,
    T::Error: 'static,
{
    type Stream = T::Stream;
    type Error = T::Error;
    type Future = Handshake<T::Stream, T::Error>;

    fn connect(self, stream: S) -> Self::Future {
        self.phase
            .store(Phase::TlsHandshake as u8, Ordering::SeqCst);
        let handshake = self.inner.connect(stream);
        let phase = self.phase;
        Box::pin(async move {
            let done = handshake.await;
            phase.store(Phase::Startup as u8, Ordering::SeqCst);
            done
        })
    }
}

/// The CLI's connection: its client, and what bounds and names its waits.
pub(crate) struct Conn {
    /// The client.
    pub(crate) client: Client,
    /// `host:port` of the server connected to, for messages.
    pub(crate) target: String,
    /// The bound on each query ([`bound_of`]).
    pub(crate) bound: Duration,
}

impl Conn {
    /// Runs `work`, which waits for the server (`what`: `reading pg_locks`),
    /// for at most the bound.
    ///
    /// # Errors
    ///
    /// `work`'s error, or a message naming `what` and the bound when the
    /// server did not answer in time.
    pub(crate) async fn within<T>(
        &self,
        what: &str,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.bound, work).await {
            Ok(done) => done,
            Err(_) => Err(silent(
                &self.target,
                &format!("the query {what}"),
                self.bound,
            )),
        }
    }
}

impl Conn {
    /// The error of a query (`what`: `reading pg_locks`) that got no reply
    /// within the bound, as [`within`](Self::within) says it.
    pub(crate) fn silent(&self, what: &str) -> Failure {
        silent(&self.target, &format!("the query {what}"), self.bound)
    }
}

/// The error of a wait that ran past its bound.
fn silent(target: &str, what: &str, bound: Duration) -> Failure {
    format!(
        "{target} did not answer within {}: no reply to {what} (the bound is the URL's \
         connect_timeout, {} when unset; the server is stuck, the network path to it \
         is silent, or a pooler in front of it had no server connection free in that \
         time)",
        seconds_text(bound),
        seconds_text(DEFAULT_CONNECT_TIMEOUT),
    )
    .into()
}

/// `host:port`, for messages (never the password).
fn target_text(host: &Host, port: u16) -> String {
    match host {
        Host::Tcp(host) => format!("{host}:{port}"),
        #[cfg(unix)]
        Host::Unix(path) => format!("{}/.s.PGSQL.{port}", path.display()),
    }
}

/// A failure to connect to one host, with the host named.
pub(crate) struct HostError {
    /// `host:port`.
    pub(crate) target: String,
    /// What went wrong.
    pub(crate) error: HostFailure,
}

/// What went wrong with one host.
pub(crate) enum HostFailure {
    /// The driver's error (refused, authentication, TLS, …).
    Driver(tokio_postgres::Error),
    /// The TCP connect failed.
    Io(io::Error),
    /// A wait ran past its bound: already a message.
    Message(Failure),
}

impl fmt::Debug for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostError")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

/// Connects as `config` says, each host in turn, each within the bound
/// ([`bound_of`]), over TLS when `tls` is given (as `config`'s sslmode
/// says). Answers the connection, or the last host's error.
pub(crate) async fn open(
    config: &Config,
    tls: Option<&MakeTlsConnector>,
) -> std::result::Result<Conn, HostError> {
    let bound = bound_of(config);
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let count = hosts.len().max(addrs.len());
    if count == 0 {
        return Err(HostError {
            target: "no host".into(),
            error: HostFailure::Message(
                "the connection string names no host: give host=… or postgres://HOST/…".into(),
            ),
        });
    }
    let mut last = None;
    for i in 0..count {
        let port = config
            .get_ports()
            .get(i)
            .or_else(|| config.get_ports().first())
            .copied()
            .unwrap_or(5432);
        let name = hosts.get(i);
        let addr = match (addrs.get(i), name) {
            (Some(ip), _) => Host::Tcp(ip.to_string()),
            (None, Some(host)) => host.clone(),
            (None, None) => unreachable!("count is the longer of the two lists"),
        };
        let domain = match name {
            Some(Host::Tcp(host)) => host.clone(),
            _ => String::new(),
        };
        let target = target_text(name.unwrap_or(&addr), port);
        let phase = Arc::new(AtomicU8::new(Phase::Connect as u8));
        let attempt = open_one(config, tls, &addr, port, &domain, phase.clone());
        let result = match tokio::time::timeout(bound, attempt).await {
            Ok(result) => result,
            Err(_) => Err(HostFailure::Message(silent(
                &target,
                Phase::load(&phase).what(),
                bound,
            ))),
        };
        match result {
            Ok(client) => {
                let conn = Conn {
                    client,
                    target: target.clone(),
                    bound,
                };
                if config.get_target_session_attrs() == TargetSessionAttrs::ReadWrite
                    && read_only(&conn).await?
                {
                    last = Some(HostError {
                        target,
                        error: HostFailure::Message(
                            "the server is read-only (target_session_attrs=read-write)".into(),
                        ),
                    });
                    continue;
                }
                return Ok(conn);
            }
            Err(error) => last = Some(HostError { target, error }),
        }
    }
    Err(last.unwrap_or_else(|| unreachable!("at least one host was tried")))
}

/// Whether the server answers `transaction_read_only = on`.
async fn read_only(conn: &Conn) -> std::result::Result<bool, HostError> {
    let fail = |error| HostError {
        target: conn.target.clone(),
        error,
    };
    let rows = conn
        .within("SHOW transaction_read_only", async {
            conn.client
                .simple_query("SHOW transaction_read_only")
                .await
                .map_err(|e| Failure::Message(crate::chain(&e)))
        })
        .await
        .map_err(|e| fail(HostFailure::Message(e)))?;
    Ok(rows.iter().any(
        |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(row) if row.get(0) == Some("on")),
    ))
}

/// One host: the TCP connect, then TLS as `config`'s sslmode says, and the
/// startup; `phase` says how far it got.
async fn open_one(
    config: &Config,
    tls: Option<&MakeTlsConnector>,
    addr: &Host,
    port: u16,
    domain: &str,
    phase: Arc<AtomicU8>,
) -> std::result::Result<Client, HostFailure> {
    let socket = match addr {
        Host::Tcp(host) => {
            let stream = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(HostFailure::Io)?;
            let _ = stream.set_nodelay(true);
            Socket::Tcp(stream)
        }
        #[cfg(unix)]
        Host::Unix(dir) => Socket::Unix(
            tokio::net::UnixStream::connect(dir.join(format!(".s.PGSQL.{port}")))
                .await
                .map_err(HostFailure::Io)?,
        ),
    };
    let tls_wanted = config.get_ssl_mode() != SslMode::Disable && tls.is_some();
    phase.store(
        if tls_wanted {
            Phase::TlsRequest
        } else {
            Phase::Startup
        } as u8,
        Ordering::SeqCst,
    );
    let stream = Watched {
        socket,
        phase: phase.clone(),
    };
    match tls {
        Some(tls) if tls_wanted => {
            let connector =
                MakeTlsConnect::<Watched>::make_tls_connect(&mut tls.clone(), domain)
                    .map_err(|e| HostFailure::Message(format!("cannot set up TLS: {e}").into()))?;
            let (client, connection) = config
                .connect_raw(
                    stream,
                    Phased {
                        inner: connector,
                        phase,
                    },
                )
                .await
                .map_err(HostFailure::Driver)?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok(client)
        }
        _ => {
            let mut plain = config.clone();
            plain.ssl_mode(SslMode::Disable);
            let (client, connection) = plain
                .connect_raw(stream, NoTls)
                .await
                .map_err(HostFailure::Driver)?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok(client)
        }
    }
}
