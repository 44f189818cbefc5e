//! Locks over TLS, against a throwaway server started with `ssl = on`, a
//! certificate this test generates, and a `pg_hba.conf` that admits TCP
//! clients over TLS only (`hostssl`). The client trusts only the generated
//! certificate, so `sslmode=require` here also verifies the server. A
//! plain-text connection is refused with a clear error.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, Config, LockClient, Locker, SessionLock};
use lockkit_tests::observe::{held_by, wait_until_not_waiting, wait_until_waiting, waiting};
use lockkit_tests::support::backend_pid;
use lockkit_tests::TestServer;
use openssl::ssl::{SslConnector, SslMethod};
use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, NoTls};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-tls")]
struct Secret {
    id: i64,
}

/// A server that takes TCP clients over TLS only (Unix-socket clients,
/// such as `pg_ctl` and the observer, in plain text), and a connector that
/// trusts its certificate.
pub(crate) fn tls_server() -> (TestServer, MakeTlsConnector) {
    let (cert, key) = lockkit_tests::tls::certificate();
    let db = TestServer::builder()
        .setting("ssl", "on")
        .data_file("server.crt", cert.to_pem().unwrap())
        .data_file("server.key", key.private_key_to_pem_pkcs8().unwrap())
        .data_file(
            "pg_hba.conf",
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .start();
    let mut connector = SslConnector::builder(SslMethod::tls()).unwrap();
    connector.cert_store_mut().add_cert(cert).unwrap();
    (db, MakeTlsConnector::new(connector.build()))
}

/// A plain-text connection over the server's Unix socket.
pub(crate) async fn observer(db: &TestServer) -> Client {
    let mut config = tokio_postgres::Config::new();
    config
        .host_path(db.socket_dir().expect("a throwaway server"))
        .port(db.config().get_ports()[0])
        .user("postgres")
        .dbname("postgres");
    let (client, connection) = config.connect(NoTls).await.expect("observer");
    tokio::spawn(connection);
    client
}

async fn uses_tls(observer: &Client, pid: i32) -> bool {
    observer
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn session_locks_over_tls() {
    let (db, tls) = tls_server();
    let observer = observer(&db).await;
    let mut config = db.config();
    config.ssl_mode(SslMode::Require);

    let pool = Pool::builder(Manager::from_config(
        config.clone(),
        tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    ))
    .max_size(2)
    .build()
    .unwrap();
    for (i, sessions) in [
        SessionLock::with_tls(config.clone(), tls.clone()),
        SessionLock::with_tls(config.clone(), tls.clone()).form(SessionForm::SessionLevel),
        SessionLock::from_pool(pool),
    ]
    .into_iter()
    .enumerate()
    {
        let key = Secret { id: i as i64 };
        let guard = sessions.lock(key).await.unwrap();
        assert!(uses_tls(&observer, guard.backend_pid()).await);
        assert!(guard.check().await.unwrap());
        assert!(sessions.try_lock(key).await.unwrap().is_err());
        let err = sessions
            .lock_shared_timeout(key, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // A wait given up mid-statement (drained: ended on the server at
        // its slice, rolled back or unlocked behind it) leaves nothing
        // behind.
        assert!(
            tokio::time::timeout(Duration::from_millis(200), sessions.lock(key))
                .await
                .is_err()
        );
        assert!(guard.release().await.unwrap());
        let again = sessions
            .lock_timeout(key, Duration::from_secs(30))
            .await
            .unwrap();
        observer
            .execute("SELECT pg_terminate_backend($1)", &[&again.backend_pid()])
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(30), again.lost())
            .await
            .expect("lost() after pg_terminate_backend");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plain_text_connection_to_a_tls_only_server_fails_clearly() {
    let (db, _tls) = tls_server();
    let err = SessionLock::new(db.config())
        .lock(Secret { id: 10 })
        .await
        .unwrap_err();
    // 28000 invalid_authorization_specification: "no pg_hba.conf entry for
    // host "127.0.0.1", user "postgres", database "postgres", no encryption".
    assert_eq!(err.code(), Some("28000"), "{err:?}");
    let mut text = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    assert!(text.contains("no encryption"), "{text}");
}

/// Transaction locks over TLS with `sslmode=require`: a lock call dropped
/// while the server waits for the key is cancelled through the connector
/// given to [`Locker::cancel_tls`], so the rollback returns while the
/// holder still holds the key (issue 9's first finding, over TLS). Twelve
/// rounds, unnamed and prepared statements, one key and a batch.
///
/// Under `require` a cancel request must go over TLS (tokio-postgres
/// negotiates TLS for it as for the connection), so only a locker given
/// the connector sends one; without it, the wait is bounded on the server
/// instead. Every connection here sets `deadlock_timeout` to a minute, so
/// a wait's slice lasts longer than the test's bounds: a wait that ends
/// within them was ended by the cancel request. The control, without the
/// connector: the connection is still waiting for the key 2 s after the
/// cut-off. The holder keeps the key until the test ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_lock_call_is_cancelled_over_tls() {
    let (db, tls) = tls_server();
    let observer = observer(&db).await;
    let mut config = db.config();
    config.ssl_mode(SslMode::Require);
    // Slices of a minute (the server's deadlock_timeout and one second):
    // a wait that ends within the test's bounds was ended by the cancel
    // request, not by its slice.
    let connect = || {
        let (config, tls) = (config.clone(), tls.clone());
        async move {
            let (client, connection) = config.connect(tls).await.unwrap();
            tokio::spawn(connection);
            client
                .batch_execute("SET deadlock_timeout = '60s'")
                .await
                .unwrap();
            client
        }
    };
    let mut holder = connect().await;
    let plain = Locker::new(&holder, Config::default()).await.unwrap();
    assert!(
        plain.policy().bounds_waits(),
        "no connector: no cancel request"
    );
    let locker = plain.clone().cancel_tls(tls.clone());
    assert!(
        !locker.policy().bounds_waits(),
        "proven direct under sslmode=require, with the connector"
    );
    let key = Secret { id: 20 };
    let holder_pid = backend_pid(&holder).await;
    let held = plain.begin(&mut holder).await.unwrap();
    let _guard = held.lock(key).await.unwrap();
    assert!(uses_tls(&observer, holder_pid).await);

    for round in 0..12 {
        // A connection per round: one cancel request can cancel the
        // connection's next statement too (see the diesel-async test).
        let mut conn = LockClient::new(&locker, connect().await);
        let pid = backend_pid(&conn).await;
        let tx = if round % 2 == 0 {
            locker.begin(&mut conn).await.unwrap() // unnamed statements
        } else {
            conn.begin().await.unwrap() // prepared on the connection
        };
        let call = async {
            if round % 3 == 2 {
                let batch = lockkit::Batch::new().with(&key).with(&Secret { id: 21 });
                tx.lock_batch(&batch).await.map(drop)
            } else {
                tx.lock(key).await.map(drop)
            }
        };
        drop_once_waiting(&observer, pid, call, &format!("round {round}")).await;
        assert!(tx.is_poisoned());
        // The cut-off itself makes the server stop waiting, before anything
        // else is sent on the connection (the holder still holds the key).
        wait_until_not_waiting(&observer, pid).await;
        assert!(held_by(&observer, holder_pid, key.lock_key()).await);
        tokio::time::timeout(Duration::from_secs(20), tx.rollback())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the rollback waited for the holder"))
            .unwrap();
        assert!(held_by(&observer, holder_pid, key.lock_key()).await);
    }

    // The control: without the connector no request goes, and the wait
    // lasts until its slice ends.
    let mut control = connect().await;
    let control_pid = backend_pid(&control).await;
    let tx = plain.begin(&mut control).await.unwrap();
    drop_once_waiting(&observer, control_pid, tx.lock(key), "the control").await;
    assert!(
        tokio::time::timeout(Duration::from_secs(2), tx.rollback())
            .await
            .is_err(),
        "the control: the rollback returned while the key was held"
    );
    assert!(
        waiting(&observer, control_pid).await,
        "the control: still waiting for the key"
    );
    held.rollback().await.unwrap();
}

/// The same over diesel-async, whose TLS connections are made from a
/// tokio-postgres client: a lock call dropped inside
/// `conn.transaction(async |conn| …)` is cancelled through the connector
/// given to `lockkit_diesel_async::Locker::cancel_tls`, so the server stops
/// waiting for the key while the holder still holds it. (The transaction
/// itself fails at once: the cut-off breaks diesel-async's transaction
/// manager, whose rollback then sends nothing.) Four rounds. The control,
/// the plain-text default: 2 s after the transaction failed, the
/// connection still waits for the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_diesel_async_lock_call_is_cancelled_over_tls() {
    use diesel_async::{AsyncConnection, AsyncPgConnection};

    let (db, tls) = tls_server();
    let observer = observer(&db).await;
    let mut config = db.config();
    config.ssl_mode(SslMode::Require);
    let connect = || {
        let (config, tls) = (config.clone(), tls.clone());
        async move {
            let (client, connection) = config.connect(tls).await.unwrap();
            let mut conn = AsyncPgConnection::try_from_client_and_connection(client, connection)
                .await
                .unwrap();
            // Slices of a minute, as above (once the connection runs: it is
            // diesel-async's to drive).
            diesel_async::SimpleAsyncConnection::batch_execute(
                &mut conn,
                "SET deadlock_timeout = '60s'",
            )
            .await
            .unwrap();
            let pid = diesel_async_pid(&mut conn).await;
            (conn, pid)
        }
    };
    let (mut holder, holder_pid) = connect().await;
    let plain = lockkit_diesel_async::Locker::new(&mut holder, Config::default())
        .await
        .unwrap();
    let locker = plain.clone().cancel_tls(tls.clone());
    let key = Secret { id: 30 };
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (taken, is_taken) = tokio::sync::oneshot::channel::<()>();
    let holding = {
        let plain = plain.clone();
        tokio::spawn(async move {
            holder
                .transaction::<_, lockkit::Error, _>(async |conn| {
                    let mut tx = plain.lock_tx(conn)?;
                    let _held = tx.lock(key).await?;
                    taken.send(()).unwrap();
                    released.await.unwrap();
                    Ok(())
                })
                .await
        })
    };
    is_taken.await.unwrap();
    assert!(uses_tls(&observer, holder_pid).await);

    for round in 0..4 {
        // A connection per round: PostgreSQL can deliver one cancel request
        // twice (to the backend and its process group), and a second
        // delivery that comes after the first cancelled the lock statement
        // cancels whatever the connection runs next, here the next round's
        // lock (seen once: 2 cancel requests, 3 statements cancelled).
        let (mut conn, pid) = connect().await;
        let result = tokio::time::timeout(
            Duration::from_secs(20),
            conn.transaction::<(), lockkit::Error, _>(async |conn| {
                let mut tx = locker.lock_tx(conn)?;
                drop_once_waiting(&observer, pid, tx.lock(key), &format!("round {round}")).await;
                assert!(tx.is_poisoned());
                tx.lock(Secret { id: 31 }).await.map(drop)
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("round {round}: the rollback waited for the holder"));
        // The closure's error, or, when the cancel request's second delivery
        // (above) cancelled diesel-async's own ROLLBACK, that one.
        let err = result.unwrap_err();
        assert!(
            matches!(
                err.kind(),
                lockkit::ErrorKind::Poisoned | lockkit::ErrorKind::Cancelled
            ),
            "{err}"
        );
        // The cancel request got through: the server stops waiting.
        wait_until_not_waiting(&observer, pid).await;
        assert!(held_by(&observer, holder_pid, key.lock_key()).await);
    }

    // The control: without the connector no request goes, and the wait
    // lasts until its slice ends.
    let (mut control, control_pid) = connect().await;
    let outcome = control
        .transaction::<(), lockkit::Error, _>(async |conn| {
            let mut tx = plain.lock_tx(conn)?;
            drop_once_waiting(&observer, control_pid, tx.lock(key), "the control").await;
            tx.lock(Secret { id: 31 }).await.map(drop)
        })
        .await;
    assert!(outcome.is_err(), "the control: {outcome:?}");
    // A window in the safe direction: it fails only if the request got
    // through (which takes milliseconds), however slow the machine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        waiting(&observer, control_pid).await,
        "the control: the lock statement stopped waiting for the key"
    );
    release.send(()).unwrap();
    holding.await.unwrap().unwrap();
}

async fn diesel_async_pid(conn: &mut diesel_async::AsyncPgConnection) -> i32 {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let row: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(conn)
        .await
        .unwrap();
    row.pid
}

/// Polls `call` (a lock call on backend `pid`) until the server is seen
/// making it wait for its key, then drops it there; a call that completes
/// first fails the test (`what` says which).
async fn drop_once_waiting<F>(observer: &Client, pid: i32, call: F, what: &str)
where
    F: std::future::Future,
    F::Output: std::fmt::Debug,
{
    tokio::pin!(call);
    tokio::select! {
        r = &mut call => panic!("{what}: granted while held: {r:?}"),
        () = wait_until_waiting(observer, pid) => {}
    }
}
