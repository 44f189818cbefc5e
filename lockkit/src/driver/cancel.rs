//! [`Canceller`]: how a dropped call's cancel request reaches a server
//! that tokio-postgres talks to (feature `cancel`): for the tokio-postgres
//! adapter, and for adapters of other stacks built on tokio-postgres
//! (lockkit-diesel-async).

use std::sync::Arc;
#[cfg(feature = "tokio-postgres")]
use std::time::Duration;

use futures_util::future::BoxFuture;
#[cfg(feature = "tokio-postgres")]
use futures_util::{FutureExt, StreamExt};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
#[cfg(feature = "tokio-postgres")]
use tokio_postgres::Client;
use tokio_postgres::{CancelToken, NoTls, Socket};

use crate::driver::Policy;

/// The first delay before a cancel request is sent again, while the
/// statements it cancels still run; it doubles up to [`RESEND_MAX`].
#[cfg(feature = "tokio-postgres")]
const RESEND_FIRST: Duration = Duration::from_millis(100);
/// The longest delay between two cancel requests for the same statements.
#[cfg(feature = "tokio-postgres")]
const RESEND_MAX: Duration = Duration::from_secs(1);

/// A TLS connector that a cancel request can be sent through: what
/// tokio-postgres's `CancelToken::cancel_query` takes (postgres-openssl's
/// `MakeTlsConnector`, postgres-native-tls's, tokio-postgres-rustls's), and
/// that can be kept and sent between tasks. Implemented for every such
/// connector.
pub trait CancelTls:
    MakeTlsConnect<Socket, Stream: Send, TlsConnect: Send + TlsConnect<Socket, Future: Send>>
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<T> CancelTls for T where
    T: MakeTlsConnect<Socket, Stream: Send, TlsConnect: Send + TlsConnect<Socket, Future: Send>>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// What the locker of a stack that reaches the server through tokio-postgres
/// keeps (the tokio-postgres adapter, lockkit-diesel-async): its
/// [`Policy`], shared by its clones, and how it sends cancel requests.
#[derive(Clone, Debug)]
pub struct CancellingPolicy {
    policy: Arc<Policy>,
    canceller: Canceller,
}

impl CancellingPolicy {
    /// `policy`, with cancel requests in plain text.
    pub fn new(policy: Policy) -> Self {
        CancellingPolicy {
            policy: Arc::new(policy),
            canceller: Canceller::plain(),
        }
    }

    /// The same policy, with cancel requests sent through `tls`.
    pub fn tls(self, tls: impl CancelTls) -> Self {
        CancellingPolicy {
            canceller: Canceller::tls(tls),
            ..self
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// How cancel requests are sent.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn canceller(&self) -> &Canceller {
        &self.canceller
    }

    /// Sends the cancel request for `token`'s connection in the background,
    /// with this policy's TLS, on the current tokio runtime (nothing
    /// without one): what a driver does for a lock call cut off in flight
    /// ([`Driver::cut_off`](crate::driver::Driver::cut_off)). Nobody awaits
    /// it, so a failure is logged as a `tracing` warning.
    pub fn cancel(&self, token: CancelToken) {
        self.canceller.cancel(token);
    }
}

/// `policy`, with cancel requests in plain text.
impl From<Policy> for CancellingPolicy {
    fn from(policy: Policy) -> Self {
        CancellingPolicy::new(policy)
    }
}

/// The policy.
impl AsRef<Policy> for CancellingPolicy {
    fn as_ref(&self) -> &Policy {
        &self.policy
    }
}

/// How a cancel request reaches the server: in plain text, or through the
/// TLS connector the connection was made with.
///
/// PostgreSQL reads a cancel request before any TLS negotiation, so plain
/// text works with `sslmode` `disable` and `prefer`. With `require` (and
/// the `verify-*` modes), tokio-postgres negotiates TLS for the request as
/// for the connection, so the request needs the connector.
///
/// The tokio-postgres adapter's lockers take one with
/// [`Locker::cancel_tls`](crate::Locker::cancel_tls) and
/// [`SessionLock::with_tls`](crate::SessionLock::with_tls); adapters on
/// other stacks that run on tokio-postgres (lockkit-diesel-async) send
/// their cancel requests through it too.
#[derive(Clone, Default)]
pub(crate) struct Canceller(Option<Arc<SendCancel>>);

type SendCancel =
    dyn Fn(CancelToken) -> BoxFuture<'static, Result<(), tokio_postgres::Error>> + Send + Sync;

impl Canceller {
    /// In plain text (`NoTls`), the default.
    pub(crate) const fn plain() -> Canceller {
        Canceller(None)
    }

    /// Through `tls`, the connector the connections are made with.
    pub(crate) fn tls(tls: impl CancelTls) -> Canceller {
        Canceller(Some(Arc::new(move |token: CancelToken| {
            let tls = tls.clone();
            Box::pin(async move { token.cancel_query(tls).await }) as BoxFuture<'static, _>
        })))
    }

    /// Sends the cancel request for `token`'s connection in the background,
    /// on the current tokio runtime (nothing without one). Nobody awaits
    /// it, so a failure is logged as a `tracing` warning.
    pub(crate) fn cancel(&self, token: CancelToken) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let send = self.send(token);
        handle.spawn(async move {
            if let Err(e) = send.await {
                warn_not_sent(&e);
            }
        });
    }

    fn send(&self, token: CancelToken) -> BoxFuture<'static, Result<(), tokio_postgres::Error>> {
        match &self.0 {
            None => Box::pin(async move { token.cancel_query(NoTls).await }),
            Some(send) => send(token),
        }
    }

    /// Cancels the statements in flight on `client` until the server is
    /// done with them, in the background on the current tokio runtime
    /// (nothing without one).
    ///
    /// A cancel request is not tied to a statement: the server cancels
    /// whatever runs when the request arrives, and ignores one that arrives
    /// while the session is idle. One sent as a lock call's future drops can
    /// arrive before the lock statement does, and be ignored, and the
    /// statement then waits for the key's holder, holding up everything
    /// queued behind it. So a no-op query (an empty one) is queued on
    /// `client` at once, behind the statements in flight: its answer comes
    /// after theirs. A cancel request goes now, and again (after 100 ms,
    /// doubling up to 1 s, each after the previous one was sent) until that
    /// answer comes, or the connection ends. Whatever the application does
    /// next (a rollback, a drop, a panic), the server stops waiting: within
    /// a round trip when the first request lands, within about 100 ms more
    /// when it was ignored; nothing sent after waits behind the cut-off
    /// statement for the key's holder.
    ///
    /// A request processed late (one sent just before the answer, or the
    /// server's second delivery of one) can still cancel the statement
    /// running when it arrives, which then fails with `57014`:
    /// tokio-postgres does not wait for the server to process a request,
    /// and does not expose the server's address to wait on it.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn cancel_until_answered(&self, client: &Client) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let token = client.cancel_token();
        // Its first poll queues the query and answers its stream, which
        // owns what it needs.
        let answered = client.simple_query_raw("").now_or_never();
        let canceller = self.clone();
        handle.spawn(async move {
            let mut probe = match answered {
                Some(Ok(stream)) => Box::pin(stream),
                // The connection is gone (or the query could not be
                // queued): the server ends the session's statements itself;
                // one request, for a statement it is still running.
                _ => {
                    if let Err(e) = canceller.send(token).await {
                        warn_not_sent(&e);
                    }
                    return;
                }
            };
            let mut delay = RESEND_FIRST;
            loop {
                if let Err(e) = canceller.send(token.clone()).await {
                    warn_not_sent(&e);
                }
                // Until the no-op's answer (or an error: the connection is
                // gone), or the delay.
                let done = tokio::time::timeout(delay, async {
                    while let Some(Ok(_)) = probe.next().await {}
                })
                .await;
                if done.is_ok() {
                    return;
                }
                delay = (delay * 2).min(RESEND_MAX);
            }
        });
    }
}

fn warn_not_sent(e: &tokio_postgres::Error) {
    tracing::warn!(
        error = %e,
        "lockkit: could not send the cancel request of a dropped lock call \
         (behind TLS with sslmode=require, give lockkit the TLS connector: \
         cancel_tls)"
    );
}

impl std::fmt::Debug for Canceller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            None => "Canceller(plain text)",
            Some(_) => "Canceller(TLS)",
        })
    }
}
