//! [`Canceller`]: how a dropped call's cancel request reaches a server
//! that tokio-postgres talks to (feature `cancel`): for the tokio-postgres
//! adapter, and for adapters of other stacks built on tokio-postgres
//! (lockkit-diesel-async).

use std::any::TypeId;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
#[cfg(feature = "tokio-postgres")]
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
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
/// How long a cancel request's connection stays open for the server (or
/// the pooler) to close it, which says that it processed the request.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

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
    /// `policy`, with cancel requests in plain text, on connections not yet
    /// proven to reach PostgreSQL itself: no request goes, and lock waits
    /// are bounded on the server ([`Policy::bounds_waits`]).
    pub fn new(policy: Policy) -> Self {
        CancellingPolicy {
            policy: Arc::new(policy),
            canceller: Canceller::plain(),
        }
        .settled()
    }

    /// The same policy, with cancel requests sent through `tls`, the
    /// connector the connections are made with: what a request to a
    /// connection proven direct needs under `sslmode=require` (and
    /// stricter), where tokio-postgres sends it over TLS.
    pub fn tls(self, tls: impl CancelTls) -> Self {
        CancellingPolicy {
            canceller: Canceller {
                tls: Canceller::tls(tls).tls,
                ..self.canceller
            },
            ..self
        }
        .settled()
    }

    /// The same policy, told whether the connection it was learned on
    /// reaches PostgreSQL itself: whether `token`, that connection's cancel
    /// token, names `backend_pid`, the backend the server says the
    /// connection has (`pg_backend_pid()`, in
    /// [`FactsRow::backend_pid`](crate::driver::FactsRow::backend_pid)).
    ///
    /// A pooler gives its clients cancel keys of its own (pgbouncer draws
    /// them at random), never its server connections' keys, which it keeps
    /// to itself. Only when the key is the backend's own does a cut-off
    /// call send a cancel request (to PostgreSQL, which handles it), and
    /// only then are its waits left unbounded on the server: a pooler's
    /// cancel handling is not safe to rely on (pgbouncer before 1.19 dies of
    /// requests in several ways), and lockkit cannot tell its version.
    pub fn learned_on(self, token: &CancelToken, backend_pid: i32) -> Self {
        CancellingPolicy {
            canceller: self.canceller.learned_on(token, backend_pid),
            ..self
        }
        .settled()
    }

    /// The policy bounding waits exactly where no cancel request can end
    /// them.
    fn settled(self) -> Self {
        let bounded = !self.canceller.sends();
        let policy = match self.policy.bounds_waits() == bounded {
            true => self.policy,
            false => Arc::new(Policy::clone(&self.policy).with_bounded_waits(bounded)),
        };
        CancellingPolicy { policy, ..self }
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

/// Whether, and how, a cut-off call's cancel request reaches the server.
///
/// A request goes only to a connection proven to reach PostgreSQL itself
/// ([`CancellingPolicy::learned_on`]: its cancel key is its backend's own,
/// which a pooler's never is). A pooler's cancel handling is not safe to
/// rely on: pgbouncer before 1.19 dies of requests in several ways (its
/// issues 801, 822 and 847, whatever the client does), and every client
/// of the pooler loses its connection with it; lockkit cannot tell a
/// pooler's version. Where no request goes, the wait is bounded on the
/// server instead ([`Policy::bounds_waits`]), and ends there within one
/// slice.
///
/// PostgreSQL reads a cancel request before any TLS negotiation, so plain
/// text works with `sslmode` `disable` and `prefer`, as tokio-postgres
/// sends it. With `require` (and the `verify-*` modes), tokio-postgres
/// negotiates TLS for the request as for the connection, so the request
/// needs the connector ([`Locker::cancel_tls`](crate::Locker::cancel_tls),
/// [`SessionLock::with_tls`](crate::SessionLock::with_tls)); without it
/// none can go, and the waits are bounded. Adapters on other stacks that
/// run on tokio-postgres (lockkit-diesel-async) send theirs the same way.
///
/// A request's connection stays open until the server closes it, as
/// libpq's does, wherever lockkit opens it itself (through the TLS
/// connector, the stream tokio-postgres opened; to a
/// [`SessionLock`](crate::SessionLock)'s own address): the close says the
/// request was processed.
#[derive(Clone, Default)]
pub(crate) struct Canceller {
    tls: Option<Arc<SendCancel>>,
    /// Whether the connections are proven to reach PostgreSQL itself
    /// ([`CancellingPolicy::learned_on`]): only then does a request go.
    direct: bool,
    /// Whether their requests must go over TLS (`sslmode=require` and
    /// stricter), which needs the connector.
    over_tls: bool,
}

type SendCancel = dyn Fn(CancelToken) -> BoxFuture<'static, Result<(), SendError>> + Send + Sync;

/// Why a cancel request could not be sent.
type SendError = Box<dyn std::error::Error + Send + Sync>;

impl Canceller {
    /// In plain text (`NoTls`), the default.
    pub(crate) const fn plain() -> Canceller {
        Canceller {
            tls: None,
            direct: false,
            over_tls: false,
        }
    }

    /// Through `tls`, the connector the connections are made with (`NoTls`
    /// is plain text).
    pub(crate) fn tls<T: CancelTls>(tls: T) -> Canceller {
        if TypeId::of::<T>() == TypeId::of::<NoTls>() {
            return Canceller::plain();
        }
        let send = move |token: CancelToken| {
            let tls = tls.clone();
            Box::pin(async move {
                let (back, stream) = oneshot::channel();
                token.cancel_query(KeepOpen { tls, back }).await?;
                // Only a stream that negotiated TLS comes back: one the
                // server answered `N` went in plain text and is closed.
                if let Ok(stream) = stream.await {
                    until_closed(stream).await;
                }
                Ok(())
            }) as BoxFuture<'static, _>
        };
        Canceller {
            tls: Some(Arc::new(send)),
            direct: false,
            over_tls: false,
        }
    }

    /// The same, told whether the connections reach PostgreSQL itself and
    /// whether their requests must go over TLS, as [`key_of`] reads
    /// `token` ([`CancellingPolicy::learned_on`]): `backend_pid` is the
    /// backend the server says the connection has.
    pub(crate) fn learned_on(self, token: &CancelToken, backend_pid: i32) -> Canceller {
        let key = key_of(token).filter(|k| k.pid == backend_pid);
        Canceller {
            direct: key.is_some(),
            over_tls: key.is_some_and(|k| k.tls),
            ..self
        }
    }

    /// Sends the cancel request for `token`'s connection in the background,
    /// on the current tokio runtime (nothing without one). Nobody awaits
    /// it, so a failure is logged as a `tracing` warning.
    pub(crate) fn cancel(&self, token: CancelToken) {
        if !self.sends() {
            return;
        }
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

    /// Whether a request goes at all: only on connections proven to reach
    /// PostgreSQL itself ([`CancellingPolicy::learned_on`]). A pooler's
    /// cancel handling is not safe to rely on (pgbouncer before 1.19 dies
    /// of requests in several ways, its issues 801, 822 and 847, and every
    /// client of the pooler loses its connection with it), and lockkit
    /// cannot tell a pooler's version. Elsewhere the call's wait is bounded
    /// on the server instead ([`Policy::bounds_waits`]), and ends there.
    pub(crate) fn sends(&self) -> bool {
        self.direct && (!self.over_tls || self.tls.is_some())
    }

    /// Sends the cancel request for `token`'s connection: through the TLS
    /// connector when there is one (kept open until the server closes it,
    /// within [`CLOSE_BOUND`], when it negotiated TLS), else as
    /// tokio-postgres sends it. Only to a connection proven direct
    /// ([`sends`](Self::sends)): PostgreSQL handles either.
    fn send(&self, token: CancelToken) -> BoxFuture<'static, Result<(), SendError>> {
        match &self.tls {
            Some(send) => send(token),
            None => Box::pin(async move { Ok(token.cancel_query(NoTls).await?) }),
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
    /// running when it arrives, which then fails with `57014`: each request
    /// is waited for (where the request's connection stays open, see
    /// [`Canceller`]) before the next one goes, but what the application
    /// sends next does not wait for any.
    #[cfg(feature = "tokio-postgres")]
    pub(crate) fn cancel_until_answered(&self, client: &Client) {
        let token = client.cancel_token();
        if !self.sends() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
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

/// The cancel key `token` holds: what tokio-postgres writes for its
/// request, read back from memory, nothing sent. A request that can go in
/// plain text (`sslmode` `disable` or `prefer`) is read as written to a
/// server that answers "no TLS"; one that must go over TLS
/// (`sslmode=require` and stricter) as written over a TLS session agreed
/// in memory, whose bytes pass as they are. `None` when tokio-postgres
/// sends no request (a token whose connection used a socket it cannot
/// open again).
fn key_of(token: &CancelToken) -> Option<Key> {
    let read = |tls: bool| {
        let mut recorder = Recorder {
            written: Vec::new(),
            answered: false,
            tls,
        };
        // In memory, every write and read completes at once.
        token
            .cancel_query_raw(&mut recorder, Negotiates)
            .now_or_never()?
            .ok()?;
        plain_request_key(&recorder.written)
    };
    let key = |(pid, _), tls| Key { pid, tls };
    match read(false) {
        Some(plain) => Some(key(plain, false)),
        None => read(true).map(|k| key(k, true)),
    }
}

/// What [`key_of`] read of a cancel request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    /// The process id the request names.
    pid: i32,
    /// Whether the request must go over TLS.
    tls: bool,
}

/// The key of the plain-text cancel request in `written`, what a client
/// wrote: the request alone, or behind a request for TLS (answered "no
/// TLS"). `None` for anything else.
fn plain_request_key(written: &[u8]) -> Option<(i32, i32)> {
    let word = |i: usize| {
        written
            .get(i..i + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(i32::from_be_bytes)
    };
    // The TLS request: its length, 8, and its code. The cancel request:
    // its length (16), its code, the process id, the key.
    let at = match (word(0), word(4)) {
        (Some(8), Some(TLS_REQUEST_CODE)) => 8,
        _ => 0,
    };
    let whole = written.len() == at + 16;
    (whole && word(at) == Some(16) && word(at + 4) == Some(CANCEL_REQUEST_CODE))
        .then(|| Some((word(at + 8)?, word(at + 12)?)))
        .flatten()
}

/// The code of a cancel request (the protocol's `CancelRequest`).
const CANCEL_REQUEST_CODE: i32 = 80_877_102;
/// The code of a request for TLS (the protocol's `SSLRequest`).
const TLS_REQUEST_CODE: i32 = 80_877_103;

/// [`key_of`]'s stream: it keeps what is written, and answers a TLS
/// request once, with `N` (no TLS) or, when `tls`, `S`; then the end of the
/// stream.
struct Recorder {
    written: Vec<u8>,
    answered: bool,
    tls: bool,
}

impl AsyncRead for Recorder {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !std::mem::replace(&mut this.answered, true) {
            buf.put_slice(if this.tls { b"S" } else { b"N" });
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Recorder {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// [`key_of`]'s connector: one that can negotiate TLS (so that
/// tokio-postgres asks for it where the mode says to, unlike with `NoTls`),
/// and whose "TLS" session passes the bytes as they are, in memory.
struct Negotiates;

impl<S: AsyncRead + AsyncWrite + Unpin> TlsConnect<S> for Negotiates {
    type Stream = InMemory<S>;
    type Error = io::Error;
    type Future = std::future::Ready<Result<Self::Stream, io::Error>>;

    fn connect(self, stream: S) -> Self::Future {
        std::future::ready(Ok(InMemory(stream)))
    }
}

/// [`Negotiates`]'s session: the stream as it is.
struct InMemory<S>(S);

impl<S: AsyncRead + Unpin> AsyncRead for InMemory<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for InMemory<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for InMemory<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

/// Reads `stream` until the server closes it, within [`CLOSE_BOUND`].
async fn until_closed<S: AsyncRead + Unpin>(mut stream: S) {
    let mut sink = [0_u8; 64];
    let closed = async { while let Ok(1..) = stream.read(&mut sink).await {} };
    let _ = tokio::time::timeout(CLOSE_BOUND, closed).await;
}

/// A stream that tokio-postgres writes a cancel request on, and that comes
/// back through `back` when tokio-postgres drops it, still open: its
/// shutdown does nothing, so the server closes it first.
struct Held<S> {
    inner: Option<S>,
    back: Option<oneshot::Sender<S>>,
}

impl<S> Held<S> {
    fn inner(&mut self) -> io::Result<&mut S> {
        self.inner
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }
}

impl<S> Drop for Held<S> {
    fn drop(&mut self) {
        if let (Some(stream), Some(back)) = (self.inner.take(), self.back.take()) {
            let _ = back.send(stream);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Held<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut().inner() {
            Ok(s) => Pin::new(s).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Held<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().inner() {
            Ok(s) => Pin::new(s).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().inner() {
            Ok(s) => Pin::new(s).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    /// Nothing: the server closes the connection once it has processed the
    /// request.
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl<S: TlsStream + Unpin> TlsStream for Held<S> {
    fn channel_binding(&self) -> ChannelBinding {
        match &self.inner {
            Some(s) => s.channel_binding(),
            None => ChannelBinding::none(),
        }
    }
}

/// A TLS connector whose streams come back through `back` (see [`Held`]).
struct KeepOpen<T, S> {
    tls: T,
    back: oneshot::Sender<S>,
}

impl<T> MakeTlsConnect<Socket> for KeepOpen<T, T::Stream>
where
    T: MakeTlsConnect<Socket>,
{
    type Stream = Held<T::Stream>;
    type TlsConnect = KeepOpen<T::TlsConnect, T::Stream>;
    type Error = T::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, T::Error> {
        // tokio-postgres makes one connector per request.
        let (back, _) = oneshot::channel();
        let back = std::mem::replace(&mut self.back, back);
        Ok(KeepOpen {
            tls: self.tls.make_tls_connect(domain)?,
            back,
        })
    }
}

impl<T> TlsConnect<Socket> for KeepOpen<T, T::Stream>
where
    T: TlsConnect<Socket>,
{
    type Stream = Held<T::Stream>;
    type Error = T::Error;
    type Future = Connecting<T::Future, T::Stream>;

    fn connect(self, socket: Socket) -> Self::Future {
        Connecting {
            connect: Box::pin(self.tls.connect(socket)),
            back: Some(self.back),
        }
    }
}

/// [`KeepOpen`]'s handshake: the connector's, its stream then [`Held`].
struct Connecting<F, S> {
    connect: Pin<Box<F>>,
    back: Option<oneshot::Sender<S>>,
}

impl<F, S, E> std::future::Future for Connecting<F, S>
where
    F: std::future::Future<Output = Result<S, E>>,
{
    type Output = Result<Held<S>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let stream = std::task::ready!(self.connect.as_mut().poll(cx))?;
        Poll::Ready(Ok(Held {
            inner: Some(stream),
            back: self.back.take(),
        }))
    }
}

fn warn_not_sent(e: &SendError) {
    tracing::warn!(
        error = %e,
        "lockkit: could not send the cancel request of a dropped lock call \
         (behind TLS with sslmode=require, give lockkit the TLS connector: \
         cancel_tls)"
    );
}

impl std::fmt::Debug for Canceller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Canceller")
            .field("tls", &self.tls.is_some())
            .field("direct", &self.direct)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connector of another type than `NoTls` (it makes `NoTls`'s).
    #[derive(Clone)]
    struct OtherTls;

    impl MakeTlsConnect<Socket> for OtherTls {
        type Stream = tokio_postgres::tls::NoTlsStream;
        type TlsConnect = NoTls;
        type Error = tokio_postgres::tls::NoTlsError;

        fn make_tls_connect(&mut self, _: &str) -> Result<NoTls, Self::Error> {
            Ok(NoTls)
        }
    }

    /// A protocol message of 32-bit words, as a client writes it.
    fn words(words: &[i32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_be_bytes()).collect()
    }

    #[test]
    fn a_plain_request_s_key_is_read_alone_or_behind_a_tls_request() {
        let cancel = words(&[16, CANCEL_REQUEST_CODE, 4242, -7]);
        let tls = words(&[8, TLS_REQUEST_CODE]);
        assert_eq!(plain_request_key(&cancel), Some((4242, -7)));
        assert_eq!(
            plain_request_key(&[tls.clone(), cancel.clone()].concat()),
            Some((4242, -7))
        );
        // Only the TLS request (the mode needs TLS): no plain request.
        assert_eq!(plain_request_key(&tls), None);
        assert_eq!(plain_request_key(&[]), None);
        // Anything else is not a cancel request.
        assert_eq!(plain_request_key(&cancel[..15]), None);
        assert_eq!(plain_request_key(&[cancel.clone(), vec![0]].concat()), None);
        assert_eq!(
            plain_request_key(&[tls.clone(), tls.clone()].concat()),
            None
        );
        assert_eq!(
            plain_request_key(&words(&[16, TLS_REQUEST_CODE, 4242, -7])),
            None
        );
        assert_eq!(
            plain_request_key(&words(&[20, CANCEL_REQUEST_CODE, 4242, -7])),
            None
        );
        assert_eq!(
            plain_request_key(&[words(&[8, CANCEL_REQUEST_CODE]), cancel.clone()].concat()),
            None
        );
        assert_eq!(
            plain_request_key(&[words(&[12, TLS_REQUEST_CODE]), cancel].concat()),
            None
        );
    }

    #[test]
    fn no_tls_is_plain_text() {
        assert!(Canceller::tls(NoTls).tls.is_none());
        assert!(Canceller::plain().tls.is_none());
        assert!(Canceller::tls(OtherTls).tls.is_some());
    }

    /// A policy sends no request and bounds its waits until a connection
    /// proves direct: made, and given a connector, it still does.
    #[test]
    #[cfg(feature = "tokio-postgres")]
    fn a_policy_bounds_its_waits_until_it_can_send_a_request() {
        let policy = CancellingPolicy::new(Policy::new(
            crate::Config::default(),
            crate::ServerFacts::assumed(64, 100, 0),
        ));
        assert!(!policy.canceller().sends());
        assert!(policy.policy().bounds_waits());
        let policy = policy.tls(OtherTls);
        assert!(policy.canceller().tls.is_some());
        assert!(!policy.canceller().sends());
        assert!(policy.policy().bounds_waits());
    }

    /// A request goes only to a connection proven direct, and over TLS only
    /// with the connector; waits are bounded exactly where none goes.
    #[test]
    fn a_request_goes_only_where_proven_and_possible() {
        let with = |direct, over_tls, tls: bool| Canceller {
            direct,
            over_tls,
            ..match tls {
                true => Canceller::tls(OtherTls),
                false => Canceller::plain(),
            }
        };
        assert!(with(true, false, false).sends());
        assert!(with(true, false, true).sends());
        assert!(with(true, true, true).sends());
        assert!(!with(true, true, false).sends());
        assert!(!with(false, false, false).sends());
        assert!(!with(false, false, true).sends());
        for tls in [false, true] {
            let policy = CancellingPolicy {
                policy: Arc::new(Policy::new(
                    crate::Config::default(),
                    crate::ServerFacts::assumed(64, 100, 0),
                )),
                canceller: with(true, false, tls),
            }
            .settled();
            assert!(!policy.policy().bounds_waits());
            let policy = CancellingPolicy {
                canceller: with(false, false, tls),
                ..policy
            }
            .settled();
            assert!(policy.policy().bounds_waits());
        }
    }
}
