//! A connection lockkit opens for a session lock and that the server or a
//! pooler refuses, on real servers: a pgbouncer 1.18 whose
//! `max_client_conn` is full, a server whose `max_connections` are all
//! taken (`53300`), a wrong password (`28P01`), a database that does not
//! exist (`3D000`), a port nobody listens on. Each fails with
//! [`ErrorKind::ConnectFailed`], its message naming the refusal, never
//! [`ErrorKind::ConnectionLost`], which says that a connection existed and
//! its locks went with it. A lock on an established connection that the
//! server then ends is still `ConnectionLost` (`lost.rs`).

use std::net::TcpListener;

use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, Error, ErrorKind, SessionLock};
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::NoTls;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-refused")]
struct Gate {
    id: i64,
}

/// The forms that open connections of their own: the default and the
/// multiplexed one.
const FORMS: [SessionForm; 2] = [SessionForm::Transaction, SessionForm::Multiplexed];

/// A try of `Gate { id }` in `form` on `config`'s server, which must fail.
async fn refused(config: tokio_postgres::Config, form: SessionForm, id: i64) -> Error {
    match SessionLock::new(config)
        .form(form)
        .try_lock(Gate { id })
        .await
    {
        Ok(granted) => panic!("{form:?}: the connection was not refused: {granted:?}"),
        Err(e) => e,
    }
}

/// Asserts that `err` is a refused connection, not a lost one, that its
/// message says `says`, and that its SQLSTATE is `code`.
fn assert_refused(err: &Error, code: Option<&str>, says: &str) {
    assert_ne!(err.kind(), ErrorKind::ConnectionLost, "{err:?}");
    assert_eq!(err.kind(), ErrorKind::ConnectFailed, "{err:?}");
    assert_eq!(err.code(), code, "{err:?}");
    let text = err.to_string();
    assert!(text.contains(says), "the message names the refusal: {text}");
    assert!(text.contains("nothing was held"), "{text}");
}

/// Behind a pgbouncer 1.18 whose client slots are all taken, pgbouncer
/// refuses the lock's connection at its startup: `FATAL: no more
/// connections allowed (max_client_conn)`. Both forms say so; before,
/// both said the connection was lost and its locks released.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_pgbouncer_refuses_the_connection_it_is_not_lost() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::builder(db)
        .setting("max_client_conn", "2")
        .start();
    // The two slots taken: each client is counted once its startup is
    // answered, which `connect` waits for.
    let _first = bouncer.connect().await;
    let _second = bouncer.connect().await;
    for (id, form) in (1..).zip(FORMS) {
        let err = refused(bouncer.config(), form, id).await;
        eprintln!("{form:?}: {err:?}");
        assert_refused(
            &err,
            Some("08P01"),
            "no more connections allowed (max_client_conn)",
        );
        assert!(err.to_string().contains("full"), "{err}");
    }
    // The pooler still serves its clients.
    _first
        .simple_query("SELECT 1")
        .await
        .expect("pgbouncer serves");
}

/// A server whose `max_connections` are all taken refuses the next one:
/// `53300` "sorry, too many clients already".
#[tokio::test(flavor = "multi_thread")]
async fn a_server_with_no_free_connection_refuses_it_is_not_lost() {
    let db = TestServer::builder()
        .setting("max_connections", "4")
        .setting("superuser_reserved_connections", "0")
        .start();
    let _log = db.guard();
    let (_taken, _refusal) = db.fill(4).await;
    for (id, form) in (1..).zip(FORMS) {
        let err = refused(db.config(), form, id).await;
        eprintln!("{form:?}: {err:?}");
        assert_refused(&err, Some("53300"), "too many clients");
        assert!(err.to_string().contains("full"), "{err}");
    }
}

/// A wrong password: `28P01`, on a server that asks TCP clients for one.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_password_is_refused_it_is_not_lost() {
    let db = TestServer::builder()
        .data_file(
            "pg_hba.conf",
            "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
        )
        .start();
    let _log = db.guard();
    let mut socket = tokio_postgres::Config::new();
    socket
        .host_path(db.socket_dir().expect("a throwaway server"))
        .port(db.config().get_ports()[0])
        .user("postgres")
        .dbname("postgres");
    let (admin, connection) = socket.connect(NoTls).await.expect("over the socket");
    tokio::spawn(connection);
    admin
        .batch_execute("ALTER ROLE postgres PASSWORD 'the right one'")
        .await
        .unwrap();
    let mut config = db.config();
    config.password("a wrong one");
    for (id, form) in (1..).zip(FORMS) {
        let err = refused(config.clone(), form, id).await;
        eprintln!("{form:?}: {err:?}");
        assert_refused(&err, Some("28P01"), "authentication failed");
    }
    // The control: the right password connects.
    config.password("the right one");
    let held = SessionLock::new(config)
        .try_lock(Gate { id: 9 })
        .await
        .unwrap();
    assert!(held.is_ok(), "{held:?}");
}

/// A database that does not exist: `3D000`.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_that_does_not_exist_is_refused_it_is_not_lost() {
    let db = TestServer::shared();
    let mut config = db.config();
    config.dbname("lockkit_tests_no_such_database");
    for (id, form) in (1..).zip(FORMS) {
        let err = refused(config.clone(), form, id).await;
        eprintln!("{form:?}: {err:?}");
        assert_refused(&err, Some("3D000"), "does not exist");
    }
}

/// A port nobody listens on: the TCP connect is refused, no server was
/// reached.
#[tokio::test(flavor = "multi_thread")]
async fn a_port_nobody_listens_on_is_a_connect_failure() {
    // A port that was free a moment ago, and is closed now.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(port)
        .user("postgres")
        .dbname("postgres");
    for (id, form) in (1..).zip(FORMS) {
        let err = refused(config.clone(), form, id).await;
        eprintln!("{form:?}: {err:?}");
        assert_refused(&err, None, "could not connect");
        assert!(err.to_string().contains("Connection refused"), "{err}");
    }
}
