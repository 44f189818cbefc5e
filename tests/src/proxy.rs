//! [`Proxy`]: a TCP proxy in front of a [`TestServer`] whose path can be
//! made to go silent, for the tests of what lockkit does when a network
//! path stops answering.
//!
//! A path that goes silent is not a path that closes: a closed socket is
//! noticed at once (end of file, a reset), a silent one only by a timer.
//! [`Cut::ServerGone`] closes the server's side and leaves the client's side
//! open and silent, a half-open connection: the server ends the session (and
//! releases its locks) at once, while the client hears nothing, ever.
//! [`Cut::Blackhole`] keeps both sides open and forwards nothing: neither
//! side notices, and the server keeps the session and its locks until the
//! proxy is dropped. [`Cut::Swallow`] is a blackhole that keeps what the
//! clients send into it ([`Proxy::swallowed`]), and [`Cut::Rewrite`]
//! changes what they send on the way.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::Config;

use crate::server::TestServer;

/// What happens to the proxy's connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Bytes flow both ways.
    Open,
    /// Every connection's server side is closed, its client side kept open
    /// and silent (nothing read, nothing written): a half-open connection.
    /// New connections are accepted and kept silent too.
    ServerGone,
    /// Both sides of every connection are kept open, and nothing flows.
    /// New connections are accepted and kept silent too.
    Blackhole,
    /// Bytes flow both ways, and on every connection open now, the next
    /// request's reply comes after a message that is not its own (a
    /// `NoData`, which no reply starts with): what a client sees when a
    /// pooler routes another client's reply to it. Once per connection;
    /// connections opened later are not touched.
    StrayReply,
    /// As [`Blackhole`](Self::Blackhole), but what the clients send after
    /// the cut is read and kept, for [`Proxy::swallowed`].
    Swallow,
    /// Bytes flow both ways, and on every connection open now, what the
    /// client sends reaches the server this much later (each read held
    /// that long, in order); connections opened later are not touched: a
    /// cancel request, which goes on a connection of its own, overtakes
    /// the statement it was sent for.
    Delay(std::time::Duration),
    /// Bytes flow both ways, and on every connection, now and to come,
    /// each occurrence of `from` in what a client sends is replaced by `to`
    /// (as long, so that the message lengths stay right), until
    /// [`Cut::Open`]: how a test makes the server see a statement that is
    /// not quite the one lockkit sent. An occurrence split between two
    /// reads is missed; a statement is sent in one write.
    Rewrite {
        /// What is replaced.
        from: &'static str,
        /// What replaces it, of the same length.
        to: &'static str,
    },
}

/// The message [`Cut::StrayReply`] puts before a reply: `NoData`.
const STRAY: [u8; 5] = [b'n', 0, 0, 0, 4];

/// A TCP proxy on a loopback port in front of a server, on a thread and
/// runtime of its own (so a test's runtime, blocked or busy, cannot stall
/// it). Dropping it closes every connection it holds.
///
/// ```no_run
/// use lockkit_tests::{Cut, Proxy, TestServer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let db = TestServer::shared();
/// let proxy = Proxy::in_front_of(db);
/// let (client, connection) = proxy.config().connect(tokio_postgres::NoTls).await.unwrap();
/// tokio::spawn(connection);
/// client.simple_query("SELECT 1").await.unwrap();
/// proxy.cut(Cut::ServerGone).await; // the next statement never gets an answer
/// # }
/// ```
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    config: Config,
    state: Arc<Mutex<State>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

/// The cut in force, the control channel of every connection still
/// forwarding, the rewrite in force, and what [`Cut::Swallow`] kept.
#[derive(Debug)]
struct State {
    cut: Cut,
    forwarding: Vec<mpsc::UnboundedSender<Order>>,
    rewrite: Option<(&'static str, &'static str)>,
    swallowed: Vec<u8>,
    /// Connections swallowed whose client has not closed its side yet.
    swallowing: usize,
}

/// A cut for one connection, acknowledged once nothing flows any more.
type Order = (Cut, oneshot::Sender<()>);

impl Proxy {
    /// A proxy in front of `server`'s TCP address, forwarding until
    /// [`cut`](Self::cut).
    ///
    /// # Panics
    ///
    /// If `server` has no TCP address or the proxy cannot listen.
    pub fn in_front_of(server: &TestServer) -> Self {
        let config = server.config();
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            other => panic!("the proxy needs a TCP server address, not {other:?}"),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let target: SocketAddr = format!("{host}:{port}")
            .parse()
            .expect("the test server's address is an IP address");
        Self::start(target, config).expect("start the proxy")
    }

    fn start(target: SocketAddr, server: Config) -> io::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(Mutex::new(State {
            cut: Cut::Open,
            forwarding: Vec::new(),
            rewrite: None,
            swallowed: Vec::new(),
            swallowing: 0,
        }));
        let (stop, stopped) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let accepting = state.clone();
        let thread = thread::Builder::new()
            .name(format!("lockkit-proxy-{port}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("register the listener");
                    tokio::select! {
                        _ = accept_loop(listener, target, accepting) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime drops its tasks: every socket closes.
            })?;
        // A new config: `host` and `port` add to a config's lists.
        let mut config = Config::new();
        config.host("127.0.0.1").port(port);
        if let Some(user) = server.get_user() {
            config.user(user);
        }
        if let Some(dbname) = server.get_dbname() {
            config.dbname(dbname);
        }
        if let Some(timeout) = server.get_connect_timeout() {
            config.connect_timeout(*timeout);
        }
        Ok(Self {
            port,
            config,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's connection settings, with the proxy's address.
    pub fn config(&self) -> Config {
        self.config.clone()
    }

    /// What the clients sent into a [`Cut::Swallow`] so far, in the order
    /// it was read (connections interleaved at the boundaries of reads).
    pub fn swallowed(&self) -> Vec<u8> {
        lock(&self.state).swallowed.clone()
    }

    /// Waits (up to 30 s, else panics) until every client whose connection
    /// a [`Cut::Swallow`] holds has closed it: nothing more can come, and
    /// [`swallowed`](Self::swallowed) has all they sent. The deadline
    /// guards a hang and is no timing claim.
    pub async fn until_swallowed_closed(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while lock(&self.state).swallowing > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "a client never closed its swallowed connection"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Applies `how` to every connection, now and to come. When this
    /// returns, nothing sent after it flows any more on a cut connection
    /// (what was already forwarded stays forwarded), and a rewrite applies
    /// to what is read after it.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the cut still applies, perhaps a little
    /// later.
    pub async fn cut(&self, how: Cut) {
        let (acks, forwarding) = {
            let mut state = lock(&self.state);
            match how {
                Cut::Rewrite { from, to } => {
                    assert_eq!(from.len(), to.len(), "a rewrite keeps the length");
                    state.rewrite = Some((from, to));
                }
                Cut::Open => state.rewrite = None,
                _ => {}
            }
            let forwarding = match how {
                // Once, on the connections open now: the proxy stays open.
                Cut::Open | Cut::StrayReply | Cut::Rewrite { .. } | Cut::Delay(_) => {
                    state.forwarding.clone()
                }
                _ => std::mem::take(&mut state.forwarding),
            };
            if !matches!(how, Cut::StrayReply | Cut::Rewrite { .. } | Cut::Delay(_)) {
                state.cut = how;
            }
            (Vec::new(), forwarding)
        };
        let mut acks = acks;
        for control in forwarding {
            let (ack, acked) = oneshot::channel();
            if control.send((how, ack)).is_ok() {
                acks.push(acked);
            }
        }
        for acked in acks {
            // An error: the connection had ended already.
            let _ = acked.await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, state: Arc<Mutex<State>>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(target).await else {
                return; // the client's socket closes
            };
            let (control, orders) = mpsc::unbounded_channel();
            let cut = {
                let mut state = lock(&state);
                if state.cut == Cut::Open {
                    state.forwarding.push(control);
                }
                state.cut
            };
            match cut {
                Cut::Open => forward(client, server, orders, state).await,
                cut => park(client, server, cut, state).await,
            }
        });
    }
}

/// Forwards both ways until a cut arrives (then parks what it keeps open)
/// or either side closes (then closes the other). Each chunk read is
/// written before the next order is read, so a cut acknowledged means
/// nothing more flows.
async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    mut orders: mpsc::UnboundedReceiver<Order>,
    state: Arc<Mutex<State>>,
) {
    let mut up = vec![0u8; 16 * 1024];
    let mut down = vec![0u8; 16 * 1024];
    let mut stray = false;
    let mut delay = None;
    loop {
        tokio::select! {
            biased;
            order = orders.recv() => {
                let Some((cut, ack)) = order else { return };
                if matches!(cut, Cut::Open | Cut::StrayReply | Cut::Rewrite { .. } | Cut::Delay(_)) {
                    stray |= cut == Cut::StrayReply;
                    match cut {
                        Cut::Delay(by) => delay = Some(by),
                        Cut::Open => delay = None,
                        _ => {}
                    }
                    let _ = ack.send(());
                    continue;
                }
                let parked = park(client, server, cut, state);
                let _ = ack.send(());
                return parked.await;
            }
            n = client.read(&mut up) => match n {
                Ok(n) if n > 0 => {
                    let rewrite = lock(&state).rewrite;
                    if let Some((from, to)) = rewrite {
                        rewrite_in(&mut up[..n], from.as_bytes(), to.as_bytes());
                    }
                    if let Some(by) = delay {
                        tokio::time::sleep(by).await;
                    }
                    if server.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                    // Written before the server's reply is read (this task
                    // reads it), so the stray message comes first.
                    if std::mem::take(&mut stray) && client.write_all(&STRAY).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
            n = server.read(&mut down) => match n {
                Ok(n) if n > 0 => {
                    if client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
        }
    }
}

/// Replaces each occurrence of `from` in `bytes` by `to`, as long.
fn rewrite_in(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    let mut at = 0;
    while at + from.len() <= bytes.len() {
        if bytes[at..].starts_with(from) {
            bytes[at..at + to.len()].copy_from_slice(to);
            at += from.len();
        } else {
            at += 1;
        }
    }
}

/// Keeps what `cut` keeps open, writing nothing and reading nothing (but
/// what `Cut::Swallow` keeps), until the proxy's runtime ends.
/// `Cut::ServerGone` closes the server's side first.
fn park(
    mut client: TcpStream,
    server: TcpStream,
    cut: Cut,
    state: Arc<Mutex<State>>,
) -> impl std::future::Future<Output = ()> {
    let server = match cut {
        Cut::ServerGone => {
            drop(server);
            None
        }
        _ => Some(server),
    };
    // Counted before the cut is acknowledged.
    if cut == Cut::Swallow {
        lock(&state).swallowing += 1;
    }
    async move {
        if cut == Cut::Swallow {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = client.read(&mut buf).await {
                lock(&state).swallowed.extend_from_slice(&buf[..n]);
            }
            lock(&state).swallowing -= 1;
        }
        let _kept = (client, server);
        std::future::pending::<()>().await;
    }
}
