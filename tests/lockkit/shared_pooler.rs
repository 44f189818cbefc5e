//! lockkit with no configuration behind a transaction-mode pgbouncer that
//! other applications share (issue 44): pgbouncer 1.18 keeps no named
//! prepared statement per client, so a statement one client prepared stays
//! on a server connection that the pooler then hands to another.
//!
//! Before each test, a foreign application (plain tokio-postgres, which
//! names its statements `s0`, `s1`, …) leaves its statements on every server
//! connection of the pool ([`litter`]); then lockkit runs with
//! `Config::default()` and its default session forms, and must see no error
//! at all. The controls show that the litter is there and that named
//! statements do collide with it ([`control_named_statements_collide`]).

use std::num::NonZeroU8;

use lockkit::{
    AdvisoryKey, Config, ErrorKind, LockClient, Locker, SessionForm, SessionLock, StatementMode,
};
use lockkit_tests::observe::{
    granted_elsewhere, key_waited, outside_a_transaction, until_key_not_waited,
};
use lockkit_tests::{PgBouncer, TestServer};
use openssl::ssl::{SslConnector, SslMethod};
use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, NoTls};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.shared-pooler")]
struct Account {
    id: i64,
}

/// Server connections in the pool: fewer than the clients.
const POOL: u32 = 3;

async fn client(bouncer: &PgBouncer) -> Client {
    let (client, conn) = bouncer
        .config()
        .connect(NoTls)
        .await
        .expect("connects through pgbouncer");
    tokio::spawn(conn);
    client
}

fn bouncer(db: &TestServer) -> PgBouncer {
    PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(POOL)
        .start()
}

/// Names a new client of each stack gives its statements: tokio-postgres
/// numbers them from one counter per process (`s0`, `s1`, …), sqlx per
/// connection (`sqlx_s_1`, …), Diesel per connection (`__diesel_stmt_0`,
/// …). Another process starts its counters where this one started.
fn foreign_names(tokio_postgres_next: usize) -> Vec<String> {
    let mut names = Vec::new();
    for i in 0..LITTER {
        names.push(format!("s{}", tokio_postgres_next + i));
        names.push(format!("sqlx_s_{}", i + 1));
        names.push(format!("__diesel_stmt_{i}"));
    }
    names
}

/// The foreign applications: `POOL` clients each open a transaction at
/// once, so each holds a server connection of its own, and prepare there
/// the statements other processes of every stack would name as this
/// process's new clients will ([`foreign_names`]), which they never
/// deallocate; then commit. Every server connection of the pool now has
/// them.
async fn litter(db: &TestServer, bouncer: &PgBouncer) -> (Vec<Client>, usize) {
    let mut clients = Vec::new();
    for _ in 0..POOL {
        clients.push(client(bouncer).await);
    }
    // This process's next tokio-postgres statement name.
    let next = lockkit_tests::support::next_statement_name(&db.connect().await).await;
    let script: String = foreign_names(next)
        .iter()
        .map(|name| format!("PREPARE {name} AS SELECT 7::int8;"))
        .collect();
    let mut pids = Vec::new();
    for c in &clients {
        c.batch_execute("BEGIN").await.expect("begin");
        let row = c
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid");
        pids.push(row.get::<_, i32>(0));
        c.batch_execute(&script)
            .await
            .expect("prepare the foreign statements");
    }
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(
        pids.len(),
        POOL as usize,
        "each foreign transaction pinned a server connection of its own"
    );
    for c in &clients {
        c.batch_execute("COMMIT").await.expect("commit");
    }
    (clients, next)
}

/// How many foreign statement names each stack's counter may use up in
/// this process while the tests run.
const LITTER: usize = 3_000;

/// The control: the foreign statements are on every server connection
/// (each of `POOL` pinned transactions fails to prepare the next name), and
/// a `LockClient` whose statements are named (`StatementMode::Prepared`)
/// fails behind the littered pool.
#[tokio::test(flavor = "multi_thread")]
async fn control_named_statements_collide() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let (_foreign, next) = litter(db, &bouncer).await;
    let mut pinned = Vec::new();
    for _ in 0..POOL {
        let c = client(&bouncer).await;
        c.batch_execute("BEGIN").await.unwrap();
        let e = c
            .batch_execute(&format!("PREPARE s{next} AS SELECT 1"))
            .await
            .expect_err("the foreign statement is on every server connection");
        assert_eq!(e.code().map(|c| c.code()), Some("42P05"), "{e}");
        pinned.push(c);
    }
    // Ended, so that pgbouncer keeps the server connections (it closes one
    // whose client left inside a transaction).
    for c in pinned {
        c.batch_execute("ROLLBACK").await.unwrap();
    }
    let locker = Locker::new(
        &client(&bouncer).await,
        Config::default().statements(StatementMode::Prepared),
    )
    .await
    .unwrap();
    let errors = transactions(&bouncer, &locker, 100_000).await;
    assert!(
        !errors.is_empty(),
        "named statements collided with none of the foreign ones"
    );
    // What it is, never 25P02 or a bare database error; the clash and the
    // missing statement say what to do.
    for e in &errors {
        assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e:?}");
        if matches!(e.code(), Some("42P05" | "26000")) {
            assert!(e.to_string().contains("StatementMode::Unnamed"), "{e}");
        }
    }
    assert!(
        errors
            .iter()
            .any(|e| matches!(e.code(), Some("42P05" | "26000"))),
        "no clash or missing statement among {errors:?}"
    );
}

/// Eight clients at once, more than the pool's server connections, each
/// running 25 rounds of transactions: a batch and a try, a lock, a permit.
/// The errors.
async fn transactions(bouncer: &PgBouncer, locker: &Locker, base: i64) -> Vec<lockkit::Error> {
    let mut tasks = Vec::new();
    for worker in 0..8_i64 {
        let mut conn = LockClient::new(locker, client(bouncer).await);
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            for round in 0..25_i64 {
                let id = base + worker * 1_000 + round;
                let outcome: Result<(), lockkit::Error> = async {
                    let tx = conn.begin().await?;
                    let batch = lockkit::Batch::new()
                        .with(&Account { id })
                        .with(&Account { id: id + 500 })
                        .with(&Account { id: id + 700 });
                    let _ = tx.lock_batch(&batch).await?;
                    let _ = tx
                        .try_lock(Account { id: id + 900 })
                        .await?
                        .map_err(|_| lockkit::Error::other("busy"))?;
                    tx.commit().await?;
                    let tx = conn.begin().await?;
                    let _ = tx.lock(Account { id: id + 300 }).await?;
                    tx.commit().await?;
                    let tx = conn.begin().await?;
                    let _ = tx
                        .acquire_permit(Account { id: base + worker }, NonZeroU8::new(3).unwrap())
                        .await?;
                    tx.commit().await?;
                    Ok(())
                }
                .await;
                if let Err(e) = outcome {
                    errors.push(e);
                }
            }
            errors
        }));
    }
    let mut errors = Vec::new();
    for task in tasks {
        errors.extend(task.await.unwrap());
    }
    errors
}

/// A `LockClient` made with `Config::default()` takes every lock behind the
/// shared pooler, transactions and batches, tries and permits, on several
/// clients at once, more clients than server connections.
#[tokio::test(flavor = "multi_thread")]
async fn a_default_lock_client_works_behind_a_shared_pooler() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let _foreign = litter(db, &bouncer).await;
    let observer = db.connect().await;
    let locker = Locker::new(&client(&bouncer).await, Config::default())
        .await
        .expect("the locker learns the server's facts through the pooler");
    let errors = transactions(&bouncer, &locker, 1_000).await;
    assert!(
        errors.is_empty(),
        "{} of 200 transactions failed behind the shared pooler, first: {:?}",
        errors.len(),
        errors.first()
    );
    assert!(!granted_elsewhere(&observer, Account { id: 1_000 }.lock_key()).await);
}

/// A multiplexed `SessionLock` and a default-form one, with no
/// configuration, take and release their locks on a littered pool.
#[tokio::test(flavor = "multi_thread")]
async fn default_session_forms_work_behind_a_shared_pooler() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let _foreign = litter(db, &bouncer).await;
    let observer = db.connect().await;
    for form in [SessionForm::Multiplexed, SessionForm::default()] {
        let sessions = SessionLock::new(bouncer.config()).form(form).connections(1);
        for id in 0..5 {
            let key = Account { id: 50_000 + id };
            let guard = sessions
                .try_lock(key)
                .await
                .unwrap_or_else(|e| panic!("{form:?}: {e:?}"))
                .unwrap_or_else(|_| panic!("{form:?}: nobody else holds the key"));
            assert!(
                granted_elsewhere(&observer, key.lock_key()).await,
                "{form:?}"
            );
            guard
                .release()
                .await
                .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
        }
        let permit = sessions
            .acquire_permit(Account { id: 60_000 }, NonZeroU8::new(2).unwrap())
            .await
            .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
        permit
            .release()
            .await
            .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
    }
}

/// A `FATAL` error ends the session, whatever the driver has yet read of
/// the socket behind it: pgbouncer's `query_wait_timeout` (a `FATAL`
/// `08P01` when no server connection was free in time, then the client's
/// connection closed) is `ConnectionLost` on a `LockClient`, never a bare
/// database error.
#[tokio::test(flavor = "multi_thread")]
async fn a_fatal_error_of_the_pooler_is_a_lost_connection() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::impatient(db);
    // The one server connection, pinned by a transaction left open.
    let pin = client(&bouncer).await;
    pin.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let locker = Locker::new(&db.connect().await, Config::default())
        .await
        .unwrap();
    for id in 0..3 {
        let mut conn = LockClient::new(&locker, client(&bouncer).await);
        let e = async {
            let tx = conn.begin().await?;
            tx.lock(Account { id: 910_000 + id }).await.map(drop)
        }
        .await
        .expect_err("no server connection was free within query_wait_timeout");
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e:?}");
        assert!(e.is_connection_lost(), "{e:?}");
    }
    pin.batch_execute("ROLLBACK").await.unwrap();
}

/// A direct session that holds `key` in an open transaction until it rolls
/// back.
async fn hold_elsewhere(db: &TestServer, key: Account) -> Client {
    let holder = db.connect().await;
    lockkit_tests::support::hold_in_transaction(&holder, [key.lock_key()]).await;
    holder
}

/// How [`calls_on_a_held_key`] ends its lock calls.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Calls {
    /// A `timeout` drops the call's future; the locker, made through the
    /// pooler with no configuration, sends no cancel request, and the wait
    /// ends on the server at the end of its slice.
    CutOff,
    /// The same through a pooler that takes clients over TLS only
    /// (`sslmode=require`), the locker given the connector
    /// (`Locker::cancel_tls`): its connection is not the backend's own, so
    /// no request goes either.
    CutOffTls,
    /// `lock_timeout`: the server ends the wait, nothing is cancelled.
    Bounded,
}

/// How many calls each of [`calls_on_a_held_key`]'s clients makes: a
/// cut-off call keeps its server connection for up to one slice, so fewer
/// of those.
fn calls_per_client(calls: Calls) -> u64 {
    match calls {
        Calls::CutOff | Calls::CutOffTls => 5,
        Calls::Bounded => 25,
    }
}

/// Lock calls on a key held elsewhere, 8 clients at once through the shared
/// pooler ([`calls_per_client`] each), ended as `calls` says. Then whether
/// pgbouncer still serves a new client (its log's `FATAL` lines when it does
/// not), whether every call could be made, whether every wait ended while
/// the key is still held (none left waiting for the holder), and whether
/// any cancel request reached the pooler.
///
/// Each transaction sets a short `deadlock_timeout` (the test's role may),
/// so that a bounded wait's slice lasts about a second.
async fn calls_on_a_held_key(db: &TestServer, calls: Calls) -> Result<(), String> {
    let tls = (calls == Calls::CutOffTls).then(|| {
        let (cert, key) = lockkit_tests::tls::certificate();
        let mut connector = SslConnector::builder(SslMethod::tls()).unwrap();
        connector.cert_store_mut().add_cert(cert.clone()).unwrap();
        let pem = (
            cert.to_pem().unwrap(),
            key.private_key_to_pem_pkcs8().unwrap(),
        );
        (MakeTlsConnector::new(connector.build()), pem)
    });
    let bouncer = match &tls {
        Some((_, (cert, key))) => PgBouncer::builder(db)
            .pool_mode("transaction")
            .default_pool_size(POOL)
            .client_tls(cert.clone(), key.clone())
            .start(),
        None => bouncer(db),
    };
    let tls = tls.map(|(connector, _)| connector);
    let mut config = bouncer.config();
    if tls.is_some() {
        config.ssl_mode(SslMode::Require);
    }
    let connect = {
        let tls = tls.clone();
        move || {
            let (config, tls) = (config.clone(), tls.clone());
            async move {
                let (client, conn) = match tls {
                    Some(tls) => {
                        let (client, conn) = config.connect(tls).await.ok()?;
                        (client, tokio::spawn(conn))
                    }
                    None => {
                        let (client, conn) = config.connect(NoTls).await.ok()?;
                        (client, tokio::spawn(conn))
                    }
                };
                Some((client, conn))
            }
        }
    };
    let key = Account {
        id: 3_000 + calls as i64,
    };
    let holder = hold_elsewhere(db, key).await;
    let (first, _conn) = connect().await.expect("a client through the pooler");
    let mut locker = Locker::new(&first, Config::default())
        .await
        .expect("locker");
    drop(first);
    if let Some(tls) = &tls {
        locker = locker.cancel_tls(tls.clone());
    }
    assert!(
        locker.policy().bounds_waits(),
        "a locker made through the pooler leaves its waits unbounded"
    );
    let per_client = calls_per_client(calls);
    let calls_made = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..8_u64 {
        let (locker, connect, calls_made) = (locker.clone(), connect.clone(), calls_made.clone());
        tasks.push(tokio::spawn(async move {
            for j in 0..per_client {
                let Some((client, _conn)) = connect().await else {
                    return; // the pooler is gone: what the check below sees
                };
                let mut client = LockClient::new(&locker, client);
                let Ok(tx) = client.begin().await else {
                    return;
                };
                if tx
                    .batch_execute("SET LOCAL deadlock_timeout = '50ms'")
                    .await
                    .is_err()
                {
                    return;
                }
                calls_made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let wait = std::time::Duration::from_millis((i * 25 + j) % 6);
                match calls {
                    Calls::CutOff | Calls::CutOffTls => {
                        let cut = tokio::time::timeout(wait, tx.lock(key)).await;
                        assert!(cut.is_err() || cut.unwrap().is_err(), "granted a held key");
                    }
                    Calls::Bounded => {
                        let e = tx.lock_timeout(key, wait).await.err();
                        assert!(e.is_some(), "granted a held key");
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("a client panicked");
    }
    // Every wait ended, at the end of its slice or at its lock_timeout,
    // while the holder still holds the key: nothing else could end it.
    let observer = db.connect().await;
    let ended = until_key_not_waited(&observer, key.lock_key()).await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    // A pooler that died says so first, with its log's FATAL lines.
    bouncer
        .answers(connect().await.map(|(client, _)| client))
        .await?;
    let cancels = bouncer.cancel_lines();
    if !cancels.is_empty() {
        return Err(format!("cancel requests reached the pooler: {cancels:?}"));
    }
    match calls_made.load(std::sync::atomic::Ordering::Relaxed) {
        made if made == 8 * per_client => ended,
        made => Err(format!(
            "only {made} of the {} calls could be made",
            8 * per_client
        )),
    }
}

/// Cut-off lock calls behind pgbouncer 1.18, the distribution's, by a
/// `Locker` made through it with no configuration, on a key its holder
/// never lets go: no cancel request reaches the pooler, and every wait
/// still ends, at the end of its slice on the server, freeing its server
/// connection, while the key is held. With waits left unbounded
/// (`.ci/mutations "left unbounded"`), the cut-off waits hold the pool's
/// server connections until the holder lets go: sessions still wait after
/// 30 s.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_lock_calls_free_their_server_connections_within_a_slice() {
    let db = TestServer::shared();
    let _log = db.guard();
    calls_on_a_held_key(db, Calls::CutOff).await.unwrap();
}

/// Cut-off lock calls through pgbouncer 1.18, the distribution's, by a
/// `Locker` given no configuration. Made through the pooler, it learned
/// that its connection's cancel key is the pooler's, not its backend's, and
/// sends no cancel request: pgbouncer before 1.19 can die of one (its issues
/// 801 and 822), and every client of the pooler with it. The holder here
/// lets go each time some session waits for the key, and takes it again, so
/// that calls are granted as well as cut off. 8 tasks, 25 calls each,
/// cut off after 0 to 5 ms, through 3 server connections shared with other
/// applications (their named statements on every server connection, and
/// one application's transactions all along): all 200 calls are made, no
/// cancel request reaches the pooler (its log), the pooler serves on, each
/// client's next statement runs outside a transaction, and the other
/// application's transactions all succeed. With
/// the route taken as direct (`.ci/mutations "taken as direct"`), the
/// requests go as tokio-postgres sends them, and pgbouncer dies.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_lock_calls_do_not_crash_the_shared_pooler() {
    cut_offs_with_no_address(false).await;
}

/// The same with the locker given a TLS connector (`Locker::cancel_tls`)
/// and its connections the default `sslmode=prefer`, through a pooler in
/// plain text: the connector does not make the connection direct, so no
/// request goes.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_lock_calls_with_a_tls_connector_and_sslmode_prefer_do_not_crash_the_pooler() {
    cut_offs_with_no_address(true).await;
}

/// [`cut_off_lock_calls_do_not_crash_the_shared_pooler`], its locker given
/// a TLS connector when `tls`.
async fn cut_offs_with_no_address(tls: bool) {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::Arc;
    use std::time::Duration;

    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = Arc::new(bouncer(db));
    // Other applications share the pooler: their statements on every
    // server connection, and one of them at work all along.
    let (_foreign, _) = litter(db, &bouncer).await;
    let key = Account {
        id: 3_050 + i64::from(tls),
    };
    let first = client(&bouncer).await;
    let mut locker = Locker::new(&first, Config::default())
        .await
        .expect("locker");
    drop(first);
    if tls {
        let connector = SslConnector::builder(SslMethod::tls()).unwrap().build();
        locker = locker.cancel_tls(MakeTlsConnector::new(connector));
    }
    let done = Arc::new(AtomicBool::new(false));
    let application = {
        let (done, bouncer) = (done.clone(), bouncer.clone());
        tokio::spawn(async move {
            let app = client(&bouncer).await;
            let mut ran = 0_u64;
            while !done.load(Relaxed) {
                app.batch_execute(
                    "BEGIN; PREPARE app_statement AS SELECT 1; EXECUTE app_statement; \
                     DEALLOCATE app_statement; COMMIT",
                )
                .await?;
                ran += 1;
            }
            Ok::<_, tokio_postgres::Error>(ran)
        })
    };
    let cycler = {
        let done = done.clone();
        tokio::spawn(async move {
            let observer = db.connect().await;
            let mut releases = 0_u64;
            while !done.load(Relaxed) {
                let holder = hold_elsewhere(db, key).await;
                while !done.load(Relaxed) && !key_waited(&observer, key.lock_key()).await {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                holder.batch_execute("ROLLBACK").await.unwrap();
                releases += 1;
            }
            releases
        })
    };
    let mut tasks = Vec::new();
    for i in 0..8_u64 {
        let (locker, bouncer) = (locker.clone(), bouncer.clone());
        tasks.push(tokio::spawn(async move {
            let mut made = 0_u64;
            for j in 0..25_u64 {
                let mut client = LockClient::new(&locker, client(&bouncer).await);
                let tx = client.begin().await.expect("BEGIN through the pooler");
                let wait = Duration::from_millis((i * 25 + j) % 6);
                // Granted or cut off: the holder lets go now and then.
                let _ = tokio::time::timeout(wait, tx.lock(key)).await;
                drop(tx);
                made += 1;
                // Behind the cut-off statement, once the key was granted
                // to it and rolled back: outside a transaction, where a
                // simple query's `now()` is its own start.
                let outside = outside_a_transaction(&client)
                    .await
                    .expect("the client's next statement");
                assert!(outside, "the next statement ran inside a transaction");
            }
            made
        }));
    }
    let mut made = 0;
    for task in tasks {
        made += task.await.expect("a client panicked");
    }
    done.store(true, Relaxed);
    let releases = cycler.await.expect("the holder");
    let ran = application
        .await
        .expect("the other application")
        .expect("the other application's transactions");
    assert_eq!(made, 200, "calls made");
    assert!(ran > 0, "the other application ran no transaction");
    bouncer.serving().await.unwrap();
    let cancels = bouncer.cancel_lines();
    assert!(
        cancels.is_empty(),
        "cancel requests reached the pooler ({releases} releases): {cancels:?}"
    );
}

/// The same through a pgbouncer 1.18 that takes clients over TLS only
/// (`sslmode=require`), the locker given the connector
/// (`Locker::cancel_tls`): no request goes, every wait ends within its
/// slice, and the pooler keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_lock_calls_over_tls_free_their_server_connections_within_a_slice() {
    let db = TestServer::shared();
    let _log = db.guard();
    calls_on_a_held_key(db, Calls::CutOffTls).await.unwrap();
}

/// Session lock calls cut off in flight behind pgbouncer 1.18, with no
/// configuration: 8 tasks, 20 cut-off calls each, in both session forms,
/// on a key held elsewhere. A session lock sends no cancel request (the
/// pooler may die of one): its wait is bounded on the server, in slices,
/// and its connection is drained, never closed under its statement. Then
/// the pooler still serves, no cancel request reached it, it closed no
/// server connection under a statement whose client left, and every
/// cut-off wait ended while the holder still holds the key.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_session_lock_calls_leave_the_shared_pooler_serving() {
    cut_off_session_lock_calls(false).await;
}

/// The same with a TLS connector (`SessionLock::with_tls`) and the default
/// `sslmode=prefer`, through the pooler in plain text: there tokio-postgres
/// would send a cancel request in plain text, closed at once, which
/// pgbouncer 1.18 can die of; a session lock sends none.
#[tokio::test(flavor = "multi_thread")]
async fn cut_off_session_lock_calls_with_a_tls_connector_and_sslmode_prefer_leave_the_pooler_serving(
) {
    cut_off_session_lock_calls(true).await;
}

/// [`cut_off_session_lock_calls_leave_the_shared_pooler_serving`], its
/// session locks given a TLS connector when `tls`.
async fn cut_off_session_lock_calls(tls: bool) {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = bouncer(db);
    let key = Account {
        id: 3_100 + i64::from(tls),
    };
    let holder = hold_elsewhere(db, key).await;
    let connector = MakeTlsConnector::new(SslConnector::builder(SslMethod::tls()).unwrap().build());
    let mut tasks = Vec::new();
    for i in 0..8_u64 {
        let form = match i % 2 {
            0 => SessionForm::default(),
            _ => SessionForm::Multiplexed,
        };
        let sessions = match tls {
            true => SessionLock::with_tls(bouncer.config(), connector.clone()),
            false => SessionLock::new(bouncer.config()),
        };
        let sessions = sessions.form(form).connections(1);
        tasks.push(tokio::spawn(async move {
            for j in 0..20_u64 {
                let wait = std::time::Duration::from_millis((i * 20 + j) % 6);
                let cut = tokio::time::timeout(wait, sessions.lock(key)).await;
                assert!(
                    cut.is_err() || cut.unwrap().is_err(),
                    "{form:?}: granted a held key"
                );
            }
        }));
    }
    for task in tasks {
        task.await.expect("a client panicked");
    }
    // Every cut-off wait ended (at its slice) while the holder still holds
    // the key.
    let observer = db.connect().await;
    let ended = until_key_not_waited(&observer, key.lock_key()).await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    bouncer.serving().await.unwrap();
    ended.unwrap();
    let cancels = bouncer.cancel_lines();
    assert!(
        cancels.is_empty(),
        "cancel requests reached the pooler: {cancels:?}"
    );
    bouncer.assert_no_abrupt_closes();
}

/// The control: the same calls, bounded by the server instead of cut off
/// (no cancel request), leave the pooler serving.
#[tokio::test(flavor = "multi_thread")]
async fn calls_bounded_by_the_server_leave_the_shared_pooler_serving() {
    let db = TestServer::shared();
    let _log = db.guard();
    calls_on_a_held_key(db, Calls::Bounded).await.unwrap();
}

/// One protocol message from `stream`: its type and body.
async fn read_message(stream: &mut tokio::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut header = [0_u8; 5];
    stream.read_exact(&mut header).await?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let mut body = vec![0_u8; len.saturating_sub(4)];
    stream.read_exact(&mut body).await?;
    Ok((header[0], body))
}

/// A session through the pooler at `port`, spoken by hand: its stream, and
/// the backend key the pooler gave it (its process id and secret).
async fn raw_session(
    port: u16,
    user: &str,
    database: &str,
) -> std::io::Result<(tokio::net::TcpStream, [u8; 8])> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let params = format!("user\0{user}\0database\0{database}\0\0");
    let params = params.as_bytes();
    let mut startup = Vec::new();
    startup.extend_from_slice(&(params.len() as u32 + 8).to_be_bytes());
    startup.extend_from_slice(&196_608_u32.to_be_bytes());
    startup.extend_from_slice(params);
    stream.write_all(&startup).await?;
    let mut key = None;
    loop {
        match read_message(&mut stream).await? {
            (b'K', body) => key = body.get(..8).map(|k| <[u8; 8]>::try_from(k).unwrap()),
            (b'Z', _) => break,
            (b'E', body) => {
                return Err(std::io::Error::other(
                    String::from_utf8_lossy(&body).into_owned(),
                ))
            }
            _ => {}
        }
    }
    Ok((stream, key.expect("BackendKeyData")))
}

/// A cancel request for the session of `key` through the pooler at
/// `port`: closed at once after it is written (as tokio-postgres does), or
/// kept open until the pooler closes it (as libpq does).
async fn cancel_request(port: u16, key: [u8; 8], wait_for_close: bool) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let mut request = Vec::with_capacity(16);
    request.extend_from_slice(&16_u32.to_be_bytes());
    request.extend_from_slice(&80_877_102_u32.to_be_bytes());
    request.extend_from_slice(&key);
    stream.write_all(&request).await?;
    if wait_for_close {
        let mut sink = [0_u8; 64];
        let until_closed = async {
            while stream.read(&mut sink).await? > 0 {}
            std::io::Result::Ok(())
        };
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), until_closed).await;
    } else {
        stream.shutdown().await?;
    }
    Ok(())
}

/// 8 sessions spoken by hand through a fresh pooler, 40 queries each, every
/// query cancelled in flight; then whether the pooler still serves a new
/// client. Every session must have started, and sent its first cancel
/// request.
async fn cancelled_queries(db: &TestServer, wait_for_close: bool) -> Result<(), String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncWriteExt;
    // A server connection per session: every query runs when cancelled.
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(8)
        .start();
    let port = bouncer.port();
    let config = bouncer.config();
    let user = config.get_user().expect("a user").to_owned();
    let database = config.get_dbname().expect("a database").to_owned();
    let sent = std::sync::Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..8_u64 {
        let (user, database, sent) = (user.clone(), database.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let (mut stream, key) = raw_session(port, &user, &database)
                .await
                .expect("a session through the pooler");
            for j in 0..40_u64 {
                let query = b"Q\0\0\0\x1aSELECT pg_sleep(0.01)\0";
                if stream.write_all(query).await.is_err() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis((i * 40 + j) % 8)).await;
                if cancel_request(port, key, wait_for_close).await.is_err() {
                    return;
                }
                sent.fetch_add(1, Ordering::Relaxed);
                loop {
                    match read_message(&mut stream).await {
                        Ok((b'Z', _)) => break,
                        Ok(_) => {}
                        Err(_) => return,
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("a session panicked");
    }
    let sent = sent.load(Ordering::Relaxed);
    assert!(sent > 0, "no cancel request was sent");
    let verdict = bouncer.serving().await;
    eprintln!("{sent} cancel requests sent (waiting for the close: {wait_for_close}): {verdict:?}");
    verdict
}

/// What a fix must do, shown without lockkit: 320 cancel requests that stay
/// open until the pooler closes them (as libpq's) leave pgbouncer 1.18
/// serving.
#[tokio::test(flavor = "multi_thread")]
async fn cancel_requests_that_wait_for_the_pooler_leave_it_serving() {
    let db = TestServer::shared();
    let _log = db.guard();
    cancelled_queries(db, true).await.unwrap();
}

/// The control of the check: the same cancel requests closed at once (as
/// tokio-postgres's) crash pgbouncer 1.18, and the check sees it.
#[tokio::test(flavor = "multi_thread")]
async fn control_cancel_requests_closed_at_once_crash_pgbouncer_1_18() {
    let db = TestServer::shared();
    let _log = db.guard();
    let verdict = cancelled_queries(db, false).await;
    assert!(
        verdict.is_err(),
        "pgbouncer survived cancel requests closed at once"
    );
}
