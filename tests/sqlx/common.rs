//! Helpers shared by the sqlx integration tests. The observer of `pg_locks`
//! is a tokio-postgres client (another session, another driver).

use std::time::{Duration, Instant};

use lockkit::LockKey;
use lockkit_sqlx::{Config, Locker};
use lockkit_tests::TestServer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio_postgres::Client;

/// A sqlx pool of at most `size` connections to `db`.
pub(crate) async fn pool(db: &TestServer, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(60))
        .connect(db.url())
        .await
        .expect("sqlx pool")
}

/// A single sqlx connection to `db`.
pub(crate) async fn connect(db: &TestServer) -> PgConnection {
    PgConnection::connect(db.url())
        .await
        .expect("sqlx connects")
}

/// A locker learned through `pool` with `config`.
pub(crate) async fn locker(pool: &PgPool, config: Config) -> Locker {
    Locker::new(pool, config).await.expect("locker")
}

/// How many sessions other than `observer`'s hold `key` granted, per
/// `pg_locks`.
pub(crate) async fn holders_elsewhere(observer: &Client, key: LockKey) -> i64 {
    let id = key.to_pg_locks();
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid <> pg_backend_pid()",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Whether another session than `observer`'s holds `key` granted.
pub(crate) async fn granted_elsewhere(observer: &Client, key: LockKey) -> bool {
    holders_elsewhere(observer, key).await > 0
}

/// Waits until no other session holds `key`: for releases that happen in
/// the server asynchronously to the test (a session that ends, a queued
/// rollback). The deadline guards a hang and is no timing claim.
pub(crate) async fn released(observer: &Client, key: LockKey) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if !granted_elsewhere(observer, key).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The backend pid of a sqlx connection.
pub(crate) async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .expect("pg_backend_pid")
}

/// Waits (up to 30 s, else panics) until backend `pid` waits for an
/// advisory lock, per `pg_locks`.
pub(crate) async fn wait_until_waiting(observer: &Client, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                 AND NOT granted AND pid = $1",
                &[&pid],
            )
            .await
            .expect("pg_locks")
            .get(0);
        if n > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "backend {pid} never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
