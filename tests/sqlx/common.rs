//! Helpers shared by the sqlx integration tests. The observer of `pg_locks`
//! is a tokio-postgres client (another session, another driver).

use std::time::Duration;

use lockkit_sqlx::{Config, Locker};
pub(crate) use lockkit_tests::observe::{
    granted_elsewhere, holders_elsewhere, released, wait_until_waiting,
};
use lockkit_tests::TestServer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

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

/// The backend pid of a sqlx connection.
pub(crate) async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .expect("pg_backend_pid")
}
