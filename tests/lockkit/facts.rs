//! Server behaviours lockkit relies on (README, "Facts lockkit relies on")
//! that no test of a lockkit feature checks on its own. The others are
//! checked where lockkit uses them: release at abort and at a savepoint
//! rollback (`release`, `smoke`, `budget`, the conformance suite), deadlock
//! detection (`timeouts`, the conformance suite), the shared lock table
//! (`budget`), the statements' lock order whatever the plan (`order`),
//! `hashtext` (`hashtext`), the `pg_stat_activity` columns of inspection
//! (`inspect`), poolers (`pooler` of tests/session). CI runs them all on
//! each tested PostgreSQL major (`.ci/run`, `.ci/pg-binaries`).

use std::time::{Duration, Instant};

use lockkit_tests::TestServer;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};

use crate::common::backend_pid;

/// How long a backend may take to be seen in a state: a bound against a
/// hang on a loaded machine, not a timing claim.
const BOUND: Duration = Duration::from_secs(60);

/// A session waiting in `pg_advisory_lock(key)` whose client can be cut off.
struct Waiter {
    pid: i32,
    /// The connection task: aborting it drops the socket without a word to
    /// the server, as a client that went away does.
    connection: JoinHandle<()>,
    /// The lock call, which fails once the connection is gone.
    call: JoinHandle<Result<u64, tokio_postgres::Error>>,
}

/// A new session with `client_connection_check_interval = interval`,
/// waiting for `key`, which another session holds.
async fn waiter(db: &TestServer, observer: &Client, interval: &str, key: i64) -> Waiter {
    let (client, connection) = db.config().connect(NoTls).await.expect("connect");
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    client
        .batch_execute(&format!(
            "SET client_connection_check_interval = '{interval}'"
        ))
        .await
        .expect("set client_connection_check_interval");
    let pid = backend_pid(&client).await;
    let call =
        tokio::spawn(async move { client.execute("SELECT pg_advisory_lock($1)", &[&key]).await });
    until(observer, pid, "waiting for the advisory lock", WAITING).await;
    Waiter {
        pid,
        connection,
        call,
    }
}

/// `$1 int4`: the backend waits for an advisory lock.
const WAITING: &str = "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 \
                       AND locktype = 'advisory' AND NOT granted)";
/// `$1 int4`: the backend has ended.
const GONE: &str = "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)";

/// Polls `query` (about `pid`, answering one bool) until it is true.
async fn until(observer: &Client, pid: i32, what: &str, query: &str) {
    let deadline = Instant::now() + BOUND;
    loop {
        let row = observer.query_one(query, &[&pid]).await.expect(what);
        if row.get::<_, bool>(0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} was not seen {what} within {BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `client_connection_check_interval` (PostgreSQL 14+): a backend waiting
/// for an advisory lock ends soon after its client went away, still
/// waiting, so a cancelled session lock is never granted to nobody. The
/// control waits beside it with the setting off: its client is cut off
/// first, and its backend still waits for the lock when the other one has
/// ended, so the cut-off alone does not end a waiting backend (it notices
/// only when it next writes to the socket, after it got the lock).
#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_backend_notices_its_client_left_only_with_the_check_interval() {
    let db = TestServer::builder().start();
    let _log = db.guard();
    let observer = db.connect().await;
    let holder = db.connect().await;
    let key = 0x6661_6374_7301_i64;
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .expect("the holder's lock");

    let checked = waiter(&db, &observer, "100ms", key).await;
    let control = waiter(&db, &observer, "0", key).await;
    control.connection.abort();
    assert!(control.call.await.expect("join").is_err());
    checked.connection.abort();
    assert!(checked.call.await.expect("join").is_err());

    until(&observer, checked.pid, "gone", GONE).await;
    let row = observer
        .query_one(WAITING, &[&control.pid])
        .await
        .expect("pg_locks");
    assert!(
        row.get::<_, bool>(0),
        "without client_connection_check_interval, backend {} stopped waiting \
         while the lock was still held",
        control.pid
    );
    // Granted the lock, the control's backend writes its answer, finds its
    // client gone and ends, which releases the lock.
    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&key])
        .await
        .expect("unlock");
    until(&observer, control.pid, "gone", GONE).await;
}
