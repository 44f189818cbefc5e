//! What session locks do to a transaction-mode pgbouncer 1.18 they share
//! with other applications, with no configuration: cut off under churn,
//! they close no connection under a statement in flight (no server
//! connection churned, PostgreSQL far from `max_connections`, the other
//! application served without an error), and their waits end on the
//! server within a slice; a loop of tries behind a saturated pooler keeps
//! its clients there within
//! [`PENDING_CONNECTIONS_PER_SESSION_LOCK`] beside the held locks, and a
//! foreign client still connects.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, ErrorKind, LockKey, SessionLock, PENDING_CONNECTIONS_PER_SESSION_LOCK};
use lockkit_tests::observe::{key_waited, wait_until_key_waited};
use lockkit_tests::support::hold_in_transaction;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::{Client, NoTls};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/pooler-hazard")]
struct Job {
    id: i64,
}

/// The pooler's server connections.
const POOL: u32 = 4;

/// The server's `max_connections`, as in the report these tests answer.
const MAX_CONNECTIONS: i64 = 100;

/// A duration in seconds from the environment variable `name`, else
/// `default`: CI runs the short default, a soak sets more.
fn seconds(name: &str, default: u64) -> Duration {
    let secs = std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Duration::from_secs(secs)
}

/// One slice of a bounded wait on this server: its `deadlock_timeout` and
/// one second.
async fn slice(observer: &Client) -> Duration {
    let ms: i64 = observer
        .query_one(
            "SELECT (1000 + 1000 * extract(epoch FROM \
             current_setting('deadlock_timeout')::interval))::int8",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    Duration::from_millis(ms as u64)
}

/// A foreign application through the pooler: plain tokio-postgres, short
/// transactions one after another, a new connection after any error. It
/// counts what ran and what failed.
struct Foreign {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Foreign {
    fn start(config: tokio_postgres::Config) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let task = {
            let (stop, ok) = (stop.clone(), ok.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let client = match config.connect(NoTls).await {
                        Ok((client, connection)) => {
                            tokio::spawn(connection);
                            client
                        }
                        Err(e) => {
                            errors.push(format!("connect: {e}"));
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    while !stop.load(Ordering::Relaxed) {
                        match client
                            .batch_execute("BEGIN; SELECT pg_backend_pid(); COMMIT")
                            .await
                        {
                            Ok(()) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                errors.push(format!("transaction: {e}"));
                                break;
                            }
                        }
                    }
                }
                errors
            })
        };
        Foreign { stop, ok, task }
    }

    /// Stops it: how many transactions ran, and the errors.
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let errors = self.task.await.expect("the foreign application");
        (self.ok.load(Ordering::Relaxed), errors)
    }
}

/// The most client backends PostgreSQL had at once, sampled every 20 ms
/// until stopped.
struct Backends {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<i64>,
}

impl Backends {
    async fn start(db: &TestServer) -> Self {
        let observer = db.connect().await;
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut most = 0;
                while !stop.load(Ordering::Relaxed) {
                    let n = observer
                        .query_one(
                            "SELECT count(*) FROM pg_stat_activity \
                             WHERE backend_type = 'client backend'",
                            &[],
                        )
                        .await;
                    // A failure here is no claim of the test's.
                    if let Ok(row) = n {
                        most = most.max(row.get(0));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                most
            })
        };
        Backends { stop, task }
    }

    async fn most(self) -> i64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the sampler")
    }
}

/// Tasks that each start a lock of `key` in `sessions` and drop it after a
/// random 5–50 ms, again and again until `until`; every fourth call of a
/// task is dropped only once the server shows some take waiting for the
/// key (so that some drops surely cut a wait off on the server). Answers
/// how many calls were cut off, and the errors the calls answered (a
/// call never gets the key: it is held elsewhere).
async fn churn(
    sessions: &SessionLock,
    observer: &Arc<Client>,
    key: Job,
    tasks: u64,
    until: Instant,
) -> (u64, Vec<String>) {
    let mut running = Vec::new();
    for i in 0..tasks {
        let (sessions, observer) = (sessions.clone(), observer.clone());
        running.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(i);
            let (mut cut, mut errors) = (0_u64, Vec::new());
            let mut n = 0_u64;
            while Instant::now() < until {
                n += 1;
                let lock = sessions.lock(key);
                let answer = if n % 4 == 0 {
                    tokio::pin!(lock);
                    tokio::select! {
                        answer = &mut lock => Some(answer),
                        () = wait_until_key_waited(&observer, key.lock_key()) => None,
                    }
                } else {
                    let wait = Duration::from_millis(rng.u64(5..=50));
                    tokio::time::timeout(wait, lock).await.ok()
                };
                match answer {
                    None => cut += 1,
                    Some(Ok(_)) => panic!("granted a key held elsewhere"),
                    Some(Err(e)) => errors.push(format!("{:?}: {e}", e.kind())),
                }
            }
            (cut, errors)
        }));
    }
    let (mut cut, mut errors) = (0, Vec::new());
    for task in running {
        let (c, e) = task.await.expect("a churning task panicked");
        cut += c;
        errors.extend(e);
    }
    (cut, errors)
}

/// Waits until no session waits for `key`; panics past `bound`, saying
/// how many still do.
async fn no_waiter_within(observer: &Client, key: LockKey, bound: Duration, what: &str) {
    let started = Instant::now();
    while key_waited(observer, key).await {
        assert!(
            started.elapsed() < bound,
            "{what}: a session still waits for the key {bound:?} after the last take was \
             dropped, while the key is held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Session locks on a key held elsewhere, started and dropped over and over
/// by 16 tasks through a transaction-mode pgbouncer 1.18 of 4 server
/// connections (`max_client_conn` 200) in front of a server of
/// `max_connections` 100, in the default form and then the multiplexed,
/// with no configuration; a foreign application runs short transactions
/// through the same pooler throughout. Reported: lockkit closed each
/// cut-off take's connection at once; a statement still queued in the
/// pooler then reached the server, pgbouncer closed that server connection
/// ("client disconnect while server was not ready") and opened others,
/// until PostgreSQL refused logins, and the foreign application got
/// thousands of errors. Checks: pgbouncer never closed a server connection
/// under a statement, PostgreSQL's backends stayed below
/// `max_connections`, the foreign application had no error, no lock call
/// failed, and once the tasks stop, no take waits for the key after its
/// queue through the pooler (at most [`PENDING_CONNECTIONS_PER_SESSION_LOCK`]
/// drained connections, [`POOL`] at a time) had one slice each, while the
/// key is still held. `LOCKKIT_CHURN_SECS` (5 by default) is each form's
/// churn.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_session_locks_under_churn_leave_the_shared_pooler_and_its_clients_alone() {
    let db = TestServer::builder()
        .setting("max_connections", MAX_CONNECTIONS.to_string())
        .start();
    let observer = Arc::new(db.connect().await);
    let bouncer = PgBouncer::builder(&db).default_pool_size(POOL).start();
    let key = Job { id: 1 };
    let holder = db.connect().await;
    hold_in_transaction(&holder, [key.lock_key()]).await;
    let slice = slice(&observer).await;
    let backends = Backends::start(&db).await;
    let foreign = Foreign::start(bouncer.config());
    let churn_for = seconds("LOCKKIT_CHURN_SECS", 5);
    let mut cut_offs = 0;
    for form in [SessionForm::Transaction, SessionForm::Multiplexed] {
        let sessions = SessionLock::new(bouncer.config()).form(form);
        let until = Instant::now() + churn_for;
        let (cut, errors) = churn(&sessions, &observer, key, 16, until).await;
        assert!(
            errors.is_empty(),
            "{form:?}: {} lock calls failed, the first: {:?}",
            errors.len(),
            &errors[..errors.len().min(3)]
        );
        assert!(cut > 0, "{form:?}: no call was cut off");
        cut_offs += cut;
        // Each drained connection's statement reaches the server in turn
        // (the pooler's queue), and waits there at most one slice.
        let queued = PENDING_CONNECTIONS_PER_SESSION_LOCK.div_ceil(POOL as usize) as u32 + 1;
        let bound = slice * queued + Duration::from_secs(5);
        no_waiter_within(&observer, key.lock_key(), bound, &format!("{form:?}")).await;
        assert!(
            lockkit_tests::observe::granted_elsewhere(&observer, key.lock_key()).await,
            "the holder lost the key"
        );
    }
    let (ran, errors) = foreign.finish().await;
    let most = backends.most().await;
    eprintln!(
        "{cut_offs} calls cut off; the foreign application ran {ran} transactions, {} failed; \
         at most {most} client backends",
        errors.len()
    );
    bouncer.serving().await.unwrap();
    // Every lockkit connection ends (the `SessionLock`s are gone): their
    // ends are in pgbouncer's log before it is read.
    bouncer.until_no_clients_of("postgres", "the churn").await;
    let abrupt = bouncer.abrupt_client_closes();
    assert!(
        abrupt.is_empty(),
        "pgbouncer closed {} server connections under a statement whose client left, first: {:?}",
        abrupt.len(),
        abrupt.first()
    );
    assert!(
        errors.is_empty(),
        "the foreign application failed {} times ({ran} ran), first: {:?}",
        errors.len(),
        errors.first()
    );
    assert!(ran > 0, "the foreign application ran nothing");
    assert!(
        most < MAX_CONNECTIONS,
        "{most} client backends at once: max_connections reached"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// Default-form tries in a loop, 16 tasks of one `SessionLock` at a 200 ms
/// keepalive, behind a transaction-mode pgbouncer 1.18 whose 4 server
/// connections are all pinned by held locks, for `LOCKKIT_TRY_LOOP_SECS`
/// (20 by default). Reported: each try that gave up closed its connection,
/// which pgbouncer 1.18, reading nothing from a client waiting for a
/// server connection, kept counting; the loop filled `max_client_conn`,
/// and pgbouncer refused every new client, lockkit's and other services'.
/// Here `max_client_conn` leaves room for the holders, the bound, the
/// admin console that counts and a foreign client, and little more.
/// Checks: every try answers `Timeout` (never another error), pgbouncer's
/// own count of the clients (`SHOW CLIENTS`, which counts a closed client
/// it has not read from) never passes the held locks' connections plus
/// [`PENDING_CONNECTIONS_PER_SESSION_LOCK`] (plus the foreign client once
/// it connected), a foreign client connects in the middle of the loop and
/// is answered once a lock lets go, and every drained connection ends
/// cleanly (no server connection closed under a statement).
#[tokio::test(flavor = "multi_thread")]
async fn a_try_loop_behind_a_saturated_pooler_keeps_its_clients_within_the_bound() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bound = POOL as usize + PENDING_CONNECTIONS_PER_SESSION_LOCK;
    // The holders and the bound, the admin console, the foreign client,
    // and two more.
    let max_client_conn = bound + 4;
    let bouncer = Arc::new(
        PgBouncer::builder(db)
            .default_pool_size(POOL)
            .setting("max_client_conn", &max_client_conn.to_string())
            .start(),
    );
    let holders = SessionLock::new(bouncer.config()).keepalive(Duration::from_secs(60));
    let mut held = Vec::new();
    for id in 0..i64::from(POOL) {
        held.push(holders.lock(Job { id: 100 + id }).await.unwrap());
    }
    let looping = seconds("LOCKKIT_TRY_LOOP_SECS", 20);
    let until = Instant::now() + looping;
    let sessions = SessionLock::new(bouncer.config()).keepalive(Duration::from_millis(200));
    let mut tasks = Vec::new();
    for i in 0..16_i64 {
        let sessions = sessions.clone();
        tasks.push(tokio::spawn(async move {
            let key = Job { id: 200 + i };
            let (mut timeouts, mut errors) = (0_u64, Vec::new());
            while Instant::now() < until {
                match sessions.try_lock(key).await {
                    Err(e) if e.kind() == ErrorKind::Timeout => timeouts += 1,
                    Err(e) => errors.push(format!("{:?}: {e}", e.kind())),
                    Ok(answer) => errors.push(format!(
                        "answered (granted: {}) with every server connection pinned",
                        answer.is_ok()
                    )),
                }
            }
            (timeouts, errors)
        }));
    }
    // pgbouncer's own count, all along; the foreign client half-way.
    let mut most = 0;
    let mut foreign = None;
    while Instant::now() < until {
        let foreign_in = usize::from(foreign.is_some());
        let clients = bouncer.clients_of("postgres").await;
        most = most.max(clients.saturating_sub(foreign_in));
        if foreign.is_none() && Instant::now() + looping / 2 > until {
            let (client, connection) = bouncer
                .config()
                .connect(NoTls)
                .await
                .unwrap_or_else(|e| panic!("pgbouncer refused a foreign client: {e}"));
            tokio::spawn(connection);
            foreign = Some(tokio::spawn(async move {
                client.simple_query("SELECT 1").await.map(drop)
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (mut timeouts, mut errors) = (0, Vec::new());
    for task in tasks {
        let (t, e) = task.await.expect("a trying task panicked");
        timeouts += t;
        errors.extend(e);
    }
    eprintln!(
        "{timeouts} tries timed out in {looping:?}; at most {most} lockkit clients in pgbouncer \
         (bound {bound})"
    );
    assert!(
        errors.is_empty(),
        "{} tries did not time out, the first: {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    assert!(
        most <= bound,
        "{most} lockkit clients in pgbouncer at once, past {POOL} held and \
         {PENDING_CONNECTIONS_PER_SESSION_LOCK} pending"
    );
    // A lock lets go: the foreign client is answered, behind the drained
    // tries the pooler queued before it.
    let foreign = foreign.expect("the foreign client connected");
    held.pop().unwrap().release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), foreign)
        .await
        .expect("the foreign client is answered once a server connection frees")
        .unwrap()
        .expect("the foreign client's query");
    for guard in held {
        guard.release().await.unwrap();
    }
    drop((sessions, holders));
    // The drained connections end, each with a Terminate while idle.
    bouncer
        .until_no_clients_of("postgres", "the locks let go")
        .await;
    let abrupt = bouncer.abrupt_client_closes();
    assert!(
        abrupt.is_empty(),
        "pgbouncer closed server connections under a statement whose client left: {abrupt:?}"
    );
    bouncer.serving().await.unwrap();
}

/// Tries of a busy key through a transaction-mode pgbouncer 1.18, in the
/// default form and for a permit, as a leader loop makes them: a busy
/// try's connection is inside the try's transaction, and a client that
/// leaves there makes pgbouncer close the server connection ("client
/// disconnect while server was not ready") and open another for its next
/// client: a backend churned per try. Checks that no try did, and that
/// every try answered busy.
#[tokio::test(flavor = "multi_thread")]
async fn busy_tries_churn_no_server_connection() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db).default_pool_size(2).start();
    let key = Job { id: 300 };
    let holder = db.connect().await;
    hold_in_transaction(&holder, [key.lock_key()]).await;
    let sessions = SessionLock::new(bouncer.config());
    let permits = std::num::NonZeroU8::new(1).unwrap();
    let slot = db.connect().await;
    // The permit's one slot, held elsewhere.
    let taken = SessionLock::new(db.config())
        .acquire_permit(Job { id: 301 }, permits)
        .await
        .unwrap();
    for i in 0..20 {
        assert!(sessions.try_lock(key).await.unwrap().is_err(), "try {i}");
        assert!(
            sessions
                .try_acquire_permit(Job { id: 301 }, permits)
                .await
                .unwrap()
                .is_err(),
            "permit {i}"
        );
    }
    drop(sessions);
    let deadline = Instant::now() + Duration::from_secs(30);
    while bouncer.clients_of("postgres").await > 0 {
        assert!(Instant::now() < deadline, "the tries' clients stay");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let abrupt = bouncer.abrupt_client_closes();
    assert!(
        abrupt.is_empty(),
        "{} busy tries left the pooler with a server connection to close, first: {:?}",
        abrupt.len(),
        abrupt.first()
    );
    drop((taken, slot));
    holder.batch_execute("ROLLBACK").await.unwrap();
}
