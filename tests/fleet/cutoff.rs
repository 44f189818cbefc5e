//! The cut-off stress step (`.ci/cutoff-stress`, by hand, not in CI): many
//! lock calls cut off in flight, of every form and stack, with default
//! settings, through a real transaction-mode pgbouncer 1.18 (pool 4,
//! `max_client_conn = 200`) in front of a PostgreSQL of `max_connections =
//! 100`, plain and over TLS (`sslmode=prefer` and `sslmode=require`),
//! while one session holds the keys directly for the whole run; beside
//! them a plain tokio-postgres application (the "foreign" one) runs short
//! transactions through the same pooler. As the control, tokio-postgres's
//! own `CancelToken::cancel_query` cuts off plain `pg_advisory_xact_lock`
//! calls at the same rate, on a pooler of its own.
//!
//! Each cell (a form on a transport) gets a pgbouncer of its own and
//! 16 tasks; each call is made on a new client connection, started, and
//! dropped after a random 5–50 ms (every eighth once `pg_locks` shows a
//! session waiting for the key, or after 200 ms), its connection with it,
//! as a service whose request handler is cancelled drops what it holds.
//! Reported per cell: calls made, pgbouncer alive (`PgBouncer::serving`)
//! and its log's `FATAL` lines, the foreign application's transactions,
//! errors (those lockkit may have caused, `lockkit_tests::harm`, apart)
//! and longest transaction, the most PostgreSQL client backends and
//! pgbouncer clients seen (sampled every 50 ms), and how long after the
//! last call no session waited for an advisory lock any more, the keys
//! still held.
//!
//! A hazard fails the run: the pooler dead, an error of the foreign
//! application caused by lockkit, PostgreSQL's client backends reaching
//! `max_connections` less its reserved slots, or a wait not ended within
//! [`FREED_BOUND`] of the last call. The control's hazards are reported,
//! never failed on: they are what it shows.
//!
//! Settings (environment): `LOCKKIT_CUTOFF_CALLS`, the calls across all
//! cells (10,000 by default); `LOCKKIT_CUTOFF_CELL_SECONDS`, the most a
//! cell makes calls for (60 by default); `LOCKKIT_CUTOFF_FORMS`, a
//! comma-separated subset of the cells' names (all by default);
//! `LOCKKIT_CUTOFF_CONTROL_ROUNDS`, the control's rounds (3 by default).

use std::future::Future;
use std::num::NonZeroU8;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, LockClient, Locker, SessionForm, SessionLock};
use lockkit_tests::harm::{caused_by_lockkit, HOSTAGE_BOUND};
use lockkit_tests::{PgBouncer, TestServer};
use openssl::ssl::{SslConnector, SslMethod};
use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, NoTls};

/// The keys the holder holds for the whole run.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/cutoff")]
struct Target {
    id: i64,
}

/// The key every cut-off call waits for.
const K: Target = Target { id: 1 };
/// A free key, beside [`K`] in the batches.
const FREE: Target = Target { id: 2 };
/// The semaphore of the permit calls, of one permit, which the holder has.
const Q: Target = Target { id: 3 };
/// The control's key, for plain `pg_advisory_xact_lock`.
const RAW_KEY: i64 = 0x00c0_70ff;

/// PostgreSQL's `max_connections` for the run.
const MAX_CONNECTIONS: i64 = 100;
/// Its `superuser_reserved_connections` (the default): the tests connect as
/// a superuser, so only at `MAX_CONNECTIONS` are they refused, but any
/// other role is refused once `MAX_CONNECTIONS - RESERVED` are taken.
const RESERVED: i64 = 3;
/// pgbouncer's server connections per pool.
const POOL: u32 = 4;
/// The most a call's set-up (its connection, `BEGIN`) may take before it
/// counts as stalled and the task goes on: a bound against a hang, no
/// timing claim.
const SETUP_BOUND: Duration = Duration::from_secs(10);
/// Tasks making calls at once in a cell.
const TASKS: usize = 16;

/// One server-side slice of a bounded wait at the server's default
/// `deadlock_timeout` (1 s) and one second (`Policy::bounds_waits`).
const SLICE: Duration = Duration::from_secs(2);
/// How long after a cell's last call every wait must have ended, its key
/// still held: one slice, and a margin for a loaded 2-core machine (a
/// backend whose slice ended still has to be scheduled to exit, and
/// pgbouncer to hand the next queued client its server connection). A
/// wait with no bound on the server never ends while the key is held.
const FREED_BOUND: Duration = Duration::from_secs(SLICE.as_secs() + 10);

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{name}={s:?} is not a number")),
        Err(_) => default,
    }
}

/// How a cell's clients reach pgbouncer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Plain,
    /// TLS, `sslmode=prefer` (the pooler takes TLS clients only, so it is
    /// agreed).
    Prefer,
    /// TLS, `sslmode=require`.
    Require,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Plain => "plain",
            Transport::Prefer => "tls-prefer",
            Transport::Require => "tls-require",
        }
    }

    fn ssl_mode(self) -> Option<SslMode> {
        match self {
            Transport::Plain => None,
            Transport::Prefer => Some(SslMode::Prefer),
            Transport::Require => Some(SslMode::Require),
        }
    }
}

/// What a cell's calls are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// tokio-postgres `LockClient`, `LockTx::lock` on [`K`].
    Lock,
    /// `LockTx::lock_shared` on [`K`].
    LockShared,
    /// `LockTx::lock_batch` of [`K`] and [`FREE`].
    Batch,
    /// `LockTx::acquire_permit` of [`Q`], one permit.
    Permit,
    /// lockkit-sqlx `Locker::transaction` with a lock on [`K`], on a
    /// `PgConnection` (sqlx is built here without TLS: plain only).
    Sqlx,
    /// lockkit-diesel-async `Locker::transaction` on a connection from
    /// `lockkit_diesel_async::establish` (`establish_tls` over TLS).
    DieselAsync,
    /// `SessionLock::lock`, the default form.
    Session,
    /// `SessionLock::lock`, `SessionForm::Multiplexed`.
    Multiplexed,
    /// The control: plain `pg_advisory_xact_lock` cut off by
    /// tokio-postgres's `cancel_query`, the client closed at once.
    CancelQuery,
}

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Lock => "tp-lock",
            Form::LockShared => "tp-lock-shared",
            Form::Batch => "tp-batch",
            Form::Permit => "tp-permit",
            Form::Sqlx => "sqlx",
            Form::DieselAsync => "diesel-async",
            Form::Session => "session",
            Form::Multiplexed => "session-mux",
            Form::CancelQuery => "control-cancel_query",
        }
    }
}

const FORMS: [Form; 8] = [
    Form::Lock,
    Form::LockShared,
    Form::Batch,
    Form::Permit,
    Form::Sqlx,
    Form::DieselAsync,
    Form::Session,
    Form::Multiplexed,
];

/// A throwaway certificate for pgbouncer's client TLS, and a connector
/// that trusts it.
struct Tls {
    connector: MakeTlsConnector,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Tls {
    fn new() -> Tls {
        let (cert, key) = lockkit_tests::tls::certificate();
        let mut connector = SslConnector::builder(SslMethod::tls()).unwrap();
        connector.cert_store_mut().add_cert(cert.clone()).unwrap();
        Tls {
            connector: MakeTlsConnector::new(connector.build()),
            cert: cert.to_pem().unwrap(),
            key: key.private_key_to_pem_pkcs8().unwrap(),
        }
    }
}

/// A cell's pooler and how to reach it.
struct Cell {
    bouncer: PgBouncer,
    transport: Transport,
    tls: Option<MakeTlsConnector>,
}

type BoxedClient = Pin<
    Box<
        dyn Future<Output = Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>>
            + Send,
    >,
>;

impl Cell {
    fn start(db: &TestServer, transport: Transport, tls: &Tls) -> Cell {
        let mut builder = PgBouncer::builder(db)
            .pool_mode("transaction")
            .default_pool_size(POOL)
            .setting("max_client_conn", "200");
        if transport != Transport::Plain {
            builder = builder.client_tls(tls.cert.clone(), tls.key.clone());
        }
        Cell {
            bouncer: builder.start(),
            transport,
            tls: (transport != Transport::Plain).then(|| tls.connector.clone()),
        }
    }

    fn config(&self) -> tokio_postgres::Config {
        let mut config = self.bouncer.config();
        if let Some(mode) = self.transport.ssl_mode() {
            config.ssl_mode(mode);
        }
        config
    }

    fn url(&self) -> String {
        match self.transport {
            Transport::Plain => self.bouncer.url(),
            Transport::Prefer => format!("{}?sslmode=prefer", self.bouncer.url()),
            Transport::Require => format!("{}?sslmode=require", self.bouncer.url()),
        }
    }

    /// A tokio-postgres client through the pooler, its connection on a
    /// task of its own (which ends once the client dropped and its
    /// requests were answered).
    async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        Ok(self.connect_raw().await?.0)
    }

    /// [`connect`](Self::connect), with the connection's task, to close
    /// the connection at once by aborting it.
    fn connect_raw(&self) -> BoxedClient {
        let (config, tls) = (self.config(), self.tls.clone());
        Box::pin(async move {
            match tls {
                Some(tls) => {
                    let (client, connection) = config.connect(tls).await?;
                    let task = tokio::spawn(async move {
                        let _ = connection.await;
                    });
                    Ok((client, task))
                }
                None => {
                    let (client, connection) = config.connect(NoTls).await?;
                    let task = tokio::spawn(async move {
                        let _ = connection.await;
                    });
                    Ok((client, task))
                }
            }
        })
    }

    fn sessions(&self, form: SessionForm) -> SessionLock {
        match &self.tls {
            Some(tls) => SessionLock::with_tls(self.config(), tls.clone()),
            None => SessionLock::new(self.config()),
        }
        .form(form)
    }
}

/// What one cell did and saw.
#[derive(Debug, Default)]
struct Figures {
    name: String,
    calls: u64,
    /// Calls that ended before their cut-off (an error, or granted).
    ended: u64,
    /// Connections to the pooler that failed (not calls).
    connect_errors: u64,
    first_connect_error: Option<String>,
    /// The first error of a call that ended before its cut-off.
    first_early_error: Option<String>,
    alive: bool,
    /// Why a new client was not answered at the end.
    not_serving: Option<String>,
    fatal: Vec<String>,
    foreign_ok: u64,
    foreign_own: u64,
    foreign_caused: u64,
    first_foreign_caused: Option<String>,
    foreign_longest: Duration,
    max_backends: i64,
    max_clients: usize,
    /// From the last call to no session waiting for an advisory lock; None
    /// when that did not come within 30 s.
    freed_after: Option<Duration>,
    waiting_left: i64,
    seconds: f64,
}

impl Figures {
    fn hazards(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.alive {
            out.push(format!(
                "pgbouncer not serving ({:?}): {:?}",
                self.not_serving, self.fatal
            ));
        }
        if self.foreign_caused > 0 {
            out.push(format!(
                "{} foreign errors caused by lockkit, first: {:?}",
                self.foreign_caused, self.first_foreign_caused
            ));
        }
        if self.max_backends >= MAX_CONNECTIONS - RESERVED {
            out.push(format!(
                "{} client backends, max_connections {MAX_CONNECTIONS}",
                self.max_backends
            ));
        }
        match self.freed_after {
            Some(after) if after <= FREED_BOUND => {}
            other => out.push(format!(
                "waits not ended within {FREED_BOUND:?} of the last call (after {other:?}; \
                 {} still waiting at the end)",
                self.waiting_left
            )),
        }
        out
    }

    fn print(&self) {
        eprintln!(
            "cutoff: {:<34} calls {:>5} (ended early {}) in {:>5.1} s | pgbouncer {} ({} FATAL) | \
             foreign ok {} own errors {} caused by lockkit {} longest {:.2?} | \
             max backends {} | max pgbouncer clients {} | waits ended {} | connect errors {}{}",
            self.name,
            self.calls,
            self.ended,
            self.seconds,
            if self.alive { "serving" } else { "NOT SERVING" },
            self.fatal.len(),
            self.foreign_ok,
            self.foreign_own,
            self.foreign_caused,
            self.foreign_longest,
            self.max_backends,
            self.max_clients,
            match self.freed_after {
                Some(d) => format!("{:.1?} after the last call", d),
                None => format!("NOT within 30 s ({} waiting)", self.waiting_left),
            },
            self.connect_errors,
            match &self.first_connect_error {
                Some(e) => format!(" (first: {e})"),
                None => String::new(),
            },
        );
        if let Some(e) = &self.first_early_error {
            eprintln!("cutoff:   a call that failed before its cut-off: {e}");
        }
        if let Some(e) = &self.not_serving {
            eprintln!("cutoff:   a new client was not served: {e}");
        }
        for f in self.fatal.iter().take(3) {
            eprintln!("cutoff:   {f}");
        }
    }
}

/// The foreign application: two tasks of short transactions through the
/// cell's pooler until `stop`.
async fn foreign(
    cell: Arc<Cell>,
    stop: Arc<AtomicBool>,
) -> (u64, u64, u64, Option<String>, Duration) {
    let ok = Arc::new(AtomicU64::new(0));
    let own = Arc::new(AtomicU64::new(0));
    let caused = Arc::new(AtomicU64::new(0));
    let first = Arc::new(std::sync::Mutex::new(None::<String>));
    let longest = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (cell, stop, ok, own, caused, first, longest) = (
            Arc::clone(&cell),
            Arc::clone(&stop),
            Arc::clone(&ok),
            Arc::clone(&own),
            Arc::clone(&caused),
            Arc::clone(&first),
            Arc::clone(&longest),
        );
        tasks.push(tokio::spawn(async move {
            let mut client: Option<Client> = None;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                // Bounded, so that a pooler whose server connections are
                // held for good does not stop the run: past the bound the
                // transaction counts as held hostage, below.
                let outcome = tokio::time::timeout(HOSTAGE_BOUND + Duration::from_secs(1), async {
                    if client.as_ref().is_none_or(Client::is_closed) {
                        client = Some(cell.connect().await?);
                    }
                    let c = client.as_ref().expect("connected");
                    c.batch_execute("BEGIN; SELECT count(*) FROM pg_class; COMMIT")
                        .await
                })
                .await;
                let took = started.elapsed();
                longest.fetch_max(took.as_millis() as u64, Ordering::Relaxed);
                let note = |text: String| {
                    caused.fetch_add(1, Ordering::Relaxed);
                    let mut first = first.lock().unwrap();
                    if first.is_none() {
                        *first = Some(text);
                    }
                };
                if took > HOSTAGE_BOUND {
                    note(format!("a transaction took {took:.1?}"));
                }
                match outcome {
                    Ok(Ok(())) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => client = None,
                    Ok(Err(e)) => {
                        let text = with_sources(&e);
                        match caused_by_lockkit(&text) {
                            Some(cause) => note(format!("{cause}: {text}")),
                            None => {
                                own.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        client = None;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("a foreign task panicked");
    }
    let first = first.lock().unwrap().clone();
    (
        ok.load(Ordering::Relaxed),
        own.load(Ordering::Relaxed),
        caused.load(Ordering::Relaxed),
        first,
        Duration::from_millis(longest.load(Ordering::Relaxed)),
    )
}

fn with_sources(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Sessions waiting for an advisory lock.
async fn advisory_waiters(observer: &Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// The cut-off delay of call `n`: until `pg_locks` shows a session waiting
/// for [`K`] (or the control's key) for every eighth call, bounded by
/// 200 ms, else a random 5–50 ms.
async fn cut_off_point(n: u64, rng: &mut fastrand::Rng, observer: &Client) {
    if n % 8 == 7 {
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until && advisory_waiters(observer).await == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    } else {
        tokio::time::sleep(Duration::from_millis(rng.u64(5..=50))).await;
    }
}

/// One call of `form`, cut off at [`cut_off_point`]: `None` when it was
/// cut off, `Some` when it ended before (with its error, if it failed).
async fn one_call(
    form: Form,
    cell: &Cell,
    lockers: &Lockers,
    sessions: Option<&SessionLock>,
    n: u64,
    rng: &mut fastrand::Rng,
    observer: &Client,
) -> Result<Option<Option<String>>, String> {
    let cut = cut_off_point(n, rng, observer);
    // The call's set-up (a connection, `BEGIN`) behind a pooler whose
    // server connections are all taken waits for one: bounded, and
    // reported as a stall.
    let setup = |what: &'static str| {
        move |e: tokio::time::error::Elapsed| {
            format!("stalled: {what} took over {SETUP_BOUND:?} ({e})")
        }
    };
    macro_rules! race {
        ($call:expr) => {{
            tokio::select! {
                r = $call => Ok(Some(r.err().map(|e| e.to_string()))),
                () = cut => Ok(None),
            }
        }};
    }
    match form {
        Form::Lock | Form::LockShared | Form::Batch | Form::Permit => {
            let client = tokio::time::timeout(SETUP_BOUND, cell.connect())
                .await
                .map_err(setup("connect"))?
                .map_err(|e| with_sources(&e))?;
            let mut conn = LockClient::new(lockers.tp.as_ref().expect("a locker"), client);
            let tx = tokio::time::timeout(SETUP_BOUND, conn.begin())
                .await
                .map_err(setup("begin"))?
                .map_err(|e| e.to_string())?;
            race!(async {
                match form {
                    Form::Lock => tx.lock(K).await.map(drop),
                    Form::LockShared => tx.lock_shared(K).await.map(drop),
                    Form::Batch => tx
                        .lock_batch(&Batch::new().with(&K).with(&FREE))
                        .await
                        .map(drop),
                    _ => tx.acquire_permit(Q, NonZeroU8::MIN).await.map(drop),
                }
            })
        }
        Form::Sqlx => {
            use sqlx::Connection;
            let mut conn =
                tokio::time::timeout(SETUP_BOUND, sqlx::PgConnection::connect(&cell.url()))
                    .await
                    .map_err(setup("connect"))?
                    .map_err(|e| with_sources(&e))?;
            let locker = lockers.sqlx.as_ref().expect("a sqlx locker");
            race!(locker.transaction(&mut conn, |tx| Box::pin(async move {
                tx.lock(K).await.map(drop)
            })))
        }
        Form::DieselAsync => {
            let url = cell.url();
            let mut conn = tokio::time::timeout(SETUP_BOUND, async {
                match &cell.tls {
                    Some(tls) => lockkit_diesel_async::establish_tls(&url, tls.clone()).await,
                    None => lockkit_diesel_async::establish(&url).await,
                }
            })
            .await
            .map_err(setup("establish"))?
            .map_err(|e| with_sources(&e))?;
            let locker = lockers
                .diesel_async
                .as_ref()
                .expect("a diesel-async locker");
            race!(locker.transaction(&mut conn, |tx| Box::pin(async move {
                tx.lock(K).await.map(drop)
            })))
        }
        Form::Session | Form::Multiplexed => {
            let sessions = sessions.expect("a SessionLock");
            race!(sessions.lock(K))
        }
        Form::CancelQuery => {
            let (client, connection) = tokio::time::timeout(SETUP_BOUND, cell.connect_raw())
                .await
                .map_err(setup("connect"))?
                .map_err(|e| with_sources(&e))?;
            tokio::time::timeout(SETUP_BOUND, client.batch_execute("BEGIN"))
                .await
                .map_err(setup("BEGIN"))?
                .map_err(|e| with_sources(&e))?;
            let token = client.cancel_token();
            let sql = format!("SELECT pg_advisory_xact_lock({RAW_KEY})");
            let ended = race!(client.simple_query(&sql));
            // The request on a task of its own, the client closed at once.
            let tls = cell.tls.clone();
            tokio::spawn(async move {
                let _ = match tls {
                    Some(tls) => token.cancel_query(tls).await,
                    None => token.cancel_query(NoTls).await,
                };
            });
            drop(client);
            connection.abort();
            ended
        }
    }
}

/// The lockers of a cell, made once through its pooler.
#[derive(Default)]
struct Lockers {
    tp: Option<Locker>,
    sqlx: Option<lockkit_sqlx::Locker>,
    diesel_async: Option<lockkit_diesel_async::Locker>,
}

async fn lockers(form: Form, cell: &Cell) -> Lockers {
    let mut out = Lockers::default();
    match form {
        Form::Lock | Form::LockShared | Form::Batch | Form::Permit => {
            let client = cell.connect().await.expect("a client through the pooler");
            out.tp = Some(
                Locker::new(&client, Config::default())
                    .await
                    .expect("Locker::new through the pooler"),
            );
        }
        Form::Sqlx => {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&cell.url())
                .await
                .expect("sqlx connects through the pooler");
            out.sqlx = Some(
                lockkit_sqlx::Locker::new(&mut conn, Config::default())
                    .await
                    .expect("lockkit-sqlx Locker::new through the pooler"),
            );
        }
        Form::DieselAsync => {
            let url = cell.url();
            let mut conn = match &cell.tls {
                Some(tls) => lockkit_diesel_async::establish_tls(&url, tls.clone()).await,
                None => lockkit_diesel_async::establish(&url).await,
            }
            .expect("establish through the pooler");
            out.diesel_async = Some(
                lockkit_diesel_async::Locker::new(&mut conn, Config::default())
                    .await
                    .expect("lockkit-diesel-async Locker::new through the pooler"),
            );
        }
        _ => {}
    }
    out
}

/// What every cell of a run shares.
struct Run<'a> {
    db: &'a TestServer,
    observer: &'a Client,
    tls: &'a Tls,
    /// Calls per cell.
    calls: u64,
    /// The most a cell makes calls for.
    seconds: u64,
}

/// Runs `run.calls` cut-off calls of `form` on `transport` (at most for
/// `run.seconds`), with the foreign application beside; its figures.
async fn cell(run: &Run<'_>, form: Form, transport: Transport, seed: u64) -> Figures {
    let Run {
        db,
        observer,
        tls,
        calls,
        seconds,
    } = *run;
    let cell = Arc::new(Cell::start(db, transport, tls));
    let mut figures = Figures {
        name: format!("{} {}", form.name(), transport.name()),
        ..Figures::default()
    };
    let lockers = lockers(form, &cell).await;
    let sessions = match form {
        Form::Session => Some(cell.sessions(SessionForm::default())),
        Form::Multiplexed => Some(cell.sessions(SessionForm::Multiplexed)),
        _ => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let foreign = tokio::spawn(foreign(Arc::clone(&cell), Arc::clone(&stop)));
    let sampler = {
        let (cell, stop) = (Arc::clone(&cell), Arc::clone(&stop));
        let db_config = db.config();
        tokio::spawn(async move {
            let (client, connection) = db_config.connect(NoTls).await.expect("the sampler");
            tokio::spawn(connection);
            let (mut backends, mut clients) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                if let Ok(row) = client
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                        &[],
                    )
                    .await
                {
                    backends = backends.max(row.get::<_, i64>(0));
                }
                clients = clients.max(cell.bouncer.clients_connected());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (backends, clients)
        })
    };

    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let next = AtomicU64::new(0);
    let ended = AtomicU64::new(0);
    let made = AtomicU64::new(0);
    let connect_errors = AtomicU64::new(0);
    let first_error = std::sync::Mutex::new(None::<String>);
    let first_early = std::sync::Mutex::new(None::<String>);
    let tasks = (0..TASKS).map(|t| {
        let (cell, lockers, sessions) = (&cell, &lockers, sessions.as_ref());
        let (next, ended, made, connect_errors, first_error, first_early) = (
            &next,
            &ended,
            &made,
            &connect_errors,
            &first_error,
            &first_early,
        );
        async move {
            let mut rng = fastrand::Rng::with_seed(seed ^ (t as u64).wrapping_mul(0x9e37_79b9));
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= calls || Instant::now() > deadline {
                    break;
                }
                match one_call(form, cell, lockers, sessions, n, &mut rng, observer).await {
                    Ok(early) => {
                        made.fetch_add(1, Ordering::Relaxed);
                        if let Some(error) = early {
                            ended.fetch_add(1, Ordering::Relaxed);
                            if let Some(e) = error {
                                first_early.lock().unwrap().get_or_insert(e);
                            }
                        }
                    }
                    Err(e) => {
                        connect_errors.fetch_add(1, Ordering::Relaxed);
                        first_error.lock().unwrap().get_or_insert(e);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        }
    });
    futures_util::future::join_all(tasks).await;
    let last_call = Instant::now();
    figures.seconds = started.elapsed().as_secs_f64();
    figures.calls = made.load(Ordering::Relaxed);
    figures.ended = ended.load(Ordering::Relaxed);
    figures.connect_errors = connect_errors.load(Ordering::Relaxed);
    figures.first_connect_error = first_error.lock().unwrap().take();
    figures.first_early_error = first_early.lock().unwrap().take();
    drop(sessions);

    // Every wait ends within the bound, the keys still held.
    let mut waiting = advisory_waiters(observer).await;
    while waiting > 0 && last_call.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waiting = advisory_waiters(observer).await;
    }
    figures.freed_after = (waiting == 0).then(|| last_call.elapsed());
    figures.waiting_left = waiting;

    // The foreign application through the whole cell, the check included.
    stop.store(true, Ordering::Relaxed);
    let (ok, own, caused, first, longest) = foreign.await.expect("the foreign application");
    (
        figures.foreign_ok,
        figures.foreign_own,
        figures.foreign_caused,
    ) = (ok, own, caused);
    figures.first_foreign_caused = first;
    figures.foreign_longest = longest;
    (figures.max_backends, figures.max_clients) = sampler.await.expect("the sampler");
    // Whether a new client (over TLS where the cell is) is answered.
    let answer = tokio::time::timeout(SETUP_BOUND, async {
        cell.connect().await?.simple_query("SELECT 1").await
    })
    .await;
    figures.not_serving = match answer {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(with_sources(&e)),
        Err(_) => Some(format!("no answer within {SETUP_BOUND:?}")),
    };
    figures.alive = figures.not_serving.is_none();
    figures.fatal = cell
        .bouncer
        .log()
        .lines()
        .filter(|l| l.contains("FATAL"))
        .map(str::to_owned)
        .collect();
    figures.print();
    // pgbouncer stopped; its server connections' backends end, but a
    // wait that nothing bounds does not (the control's): ended by hand,
    // so that the next cell starts clean.
    drop(lockers);
    drop(cell);
    let ended: i64 = observer
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_locks \
             WHERE locktype = 'advisory' AND NOT granted) t",
            &[],
        )
        .await
        .expect("terminate the waits left")
        .get(0);
    if ended > 0 {
        eprintln!("cutoff:   {ended} waits left were ended by hand (pg_terminate_backend)");
    }
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let left: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
                 AND pid <> pg_backend_pid() AND application_name <> 'cutoff-holder'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    figures
}

/// The cut-off stress step: every form on every transport, then the
/// control; fails on a hazard of lockkit's forms.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "by hand: .ci/cutoff-stress"]
async fn cut_off_calls_of_every_form_through_pgbouncer() {
    let total = env_u64("LOCKKIT_CUTOFF_CALLS", 10_000);
    let seconds = env_u64("LOCKKIT_CUTOFF_CELL_SECONDS", 60);
    let rounds = env_u64("LOCKKIT_CUTOFF_CONTROL_ROUNDS", 3);
    let only: Option<Vec<String>> = std::env::var("LOCKKIT_CUTOFF_FORMS")
        .ok()
        .map(|s| s.split(',').map(|f| f.trim().to_owned()).collect());
    let db = TestServer::builder()
        .setting("max_connections", MAX_CONNECTIONS.to_string())
        .start();
    let tls = Tls::new();
    let mut cells = Vec::new();
    for transport in [Transport::Plain, Transport::Prefer, Transport::Require] {
        for form in FORMS {
            // sqlx is built here without a TLS feature.
            if form == Form::Sqlx && transport != Transport::Plain {
                continue;
            }
            let name = format!("{} {}", form.name(), transport.name());
            if only
                .as_ref()
                .is_some_and(|o| !o.iter().any(|f| f == form.name() || *f == name))
            {
                continue;
            }
            cells.push((form, transport));
        }
    }
    let per_cell = total.div_ceil(cells.len().max(1) as u64);

    // The holder: K exclusive, Q's one permit, and the control's key,
    // directly, for the whole run.
    let mut config = db.config();
    config.application_name("cutoff-holder");
    let (holder, connection) = config.connect(NoTls).await.expect("the holder");
    tokio::spawn(connection);
    let locker = Locker::new(&holder, Config::default())
        .await
        .expect("locker");
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&RAW_KEY])
        .await
        .expect("the control's key");
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
    let holding = tokio::spawn(async move {
        let mut conn = LockClient::new(&locker, holder);
        let tx = conn.begin().await.expect("the holder's transaction");
        let k = tx.lock(K).await.expect("K");
        let q = tx
            .acquire_permit(Q, NonZeroU8::MIN)
            .await
            .expect("Q's permit");
        let _ = held_tx.send(());
        let _ = released.await;
        drop((k, q));
        tx.rollback().await.expect("the holder lets go");
    });
    held_rx.await.expect("the holder holds");
    let observer = db.connect().await;

    eprintln!(
        "cutoff: {} cells, {per_cell} calls each (at most {seconds} s), {TASKS} tasks, \
         pgbouncer pool {POOL}, max_client_conn 200, max_connections {MAX_CONNECTIONS}; \
         the waits must end within {FREED_BOUND:?} of the last call",
        cells.len()
    );
    let run = Run {
        db: &db,
        observer: &observer,
        tls: &tls,
        calls: per_cell,
        seconds,
    };
    let mut all = Vec::new();
    for (i, &(form, transport)) in cells.iter().enumerate() {
        all.push(cell(&run, form, transport, i as u64).await);
    }
    let mut control = Vec::new();
    for round in 0..rounds {
        control.push(cell(&run, Form::CancelQuery, Transport::Plain, 1_000 + round).await);
    }
    let _ = release.send(());
    holding.await.expect("the holder");

    eprintln!(
        "==== cut-off stress: {} calls ====",
        all.iter().map(|f| f.calls).sum::<u64>()
    );
    for f in &all {
        f.print();
    }
    // pgbouncer's own FATALs (`FATAL @src/...`) say it died; a pooler
    // that does not serve without one was refused logins by PostgreSQL.
    let crashed = control
        .iter()
        .filter(|f| f.fatal.iter().any(|l| l.contains("FATAL @")))
        .count();
    let not_serving = control.iter().filter(|f| !f.alive).count();
    eprintln!(
        "==== control, tokio-postgres cancel_query: pgbouncer died in {crashed} of {} rounds, \
         did not serve at the end in {not_serving} ====",
        control.len()
    );
    for f in &control {
        f.print();
        // The same checks as lockkit's cells: what they catch.
        for h in f.hazards() {
            eprintln!("cutoff:   control hazard: {h}");
        }
    }
    let hazards: Vec<String> = all
        .iter()
        .flat_map(|f| {
            f.hazards()
                .into_iter()
                .map(move |h| format!("{}: {h}", f.name))
        })
        .collect();
    assert!(
        hazards.is_empty(),
        "cut-off calls were a hazard:\n- {}",
        hazards.join("\n- ")
    );
}
