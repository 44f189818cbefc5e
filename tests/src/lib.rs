//! lockkit's test support: a throwaway PostgreSQL server for the
//! integration tests, benchmarks and doctests.
//!
//! # Example
//!
//! ```
//! use lockkit_tests::TestServer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let server = TestServer::builder()
//!     .setting("deadlock_timeout", "100ms")
//!     .start();
//! let client = server.connect().await;
//! let row = client.query_one("SHOW deadlock_timeout", &[]).await.unwrap();
//! assert_eq!(row.get::<_, &str>(0), "100ms");
//! # }
//! ```
//!
//! A test on the server its binary shares:
//!
//! ```no_run
//! use lockkit_tests::TestServer;
//!
//! #[tokio::test(flavor = "multi_thread")]
//! async fn it_works() {
//!     let db = TestServer::shared();
//!     let _log = db.guard(); // prints the server log if the test fails
//!     let client = db.connect().await;
//!     // …
//! }
//! ```
//!
//! # Where the server comes from
//!
//! [`TestServer::shared`] uses `DATABASE_URL` when it is set; otherwise it,
//! like every [`TestServer::builder`] server, is a new cluster: `initdb`
//! into a directory under the temp dir, started with `pg_ctl` on a free
//! loopback port (retried on a clash) and a Unix socket, trust auth,
//! superuser and database `postgres`, and settings for speed
//! (`fsync=off`, …) and for standbys (`wal_level=replica`). The programs are
//! taken from the directory `LOCKKIT_PG_BINDIR` names when it is set (and
//! from nowhere else: a directory without `initdb`, `pg_ctl` and `postgres`
//! is an error), else found with `pg_config --bindir`, else in the newest
//! `/usr/lib/postgresql/*/bin`, else on `PATH`. `.ci/pg-binaries MAJOR DIR`
//! lays out the programs of another PostgreSQL major for
//! `LOCKKIT_PG_BINDIR=DIR/bin`; they lack `pg_basebackup`, so a standby
//! cannot be made from them. Starting a server takes about a second and
//! blocks the calling thread, which is fine in an async test.
//!
//! PostgreSQL refuses to run as root. When the tests run as root, the
//! server programs run as `postgres`, else `nobody`, and own the directory.
//!
//! # Logs
//!
//! The server's stderr goes to a log file. It is printed to stderr, which
//! the test runner shows with a failed test, when a private server drops
//! during a panic, when a [`LogGuard`] does, and in the panic message when
//! a server fails to start.
//!
//! # Clean-up
//!
//! A server is stopped and its directory removed when its handle drops. A
//! watchdog process per server does the same when the test process exits,
//! even if it is killed: that is what stops the shared server, which lives
//! in a `static` and never drops. Only killing the watchdog itself leaves a
//! server behind, in a `lockkit-pg-<pid>-<n>` directory in the temp dir.
pub mod aborted;
mod account;
mod binaries;
pub mod capture;
pub mod fixtures;
pub mod forge;
pub mod harm;
mod instance;
pub mod keys_doc;
pub mod observe;
mod pgbouncer;
mod proxy;
mod server;
pub mod spans;
pub mod support;
pub mod tls;
pub mod waits;
pub mod workload;

#[cfg(test)]
mod tests;

pub use pgbouncer::{PgBouncer, PgBouncerBuilder};
pub use proxy::{Cut, Proxy};
pub use server::{Builder, LogGuard, StopMode, TestServer};

/// Attempt numbers, from 0, for as long as `limit` has not passed: for a
/// test that retries until its premise holds (a statement still in flight,
/// say), which a busy spell on a shared machine can defeat many times in a
/// row. A count of attempts would be used up by such a spell; a minute of
/// them is not.
pub fn attempts_for(limit: std::time::Duration) -> impl Iterator<Item = i64> {
    let deadline = std::time::Instant::now() + limit;
    (0..).take_while(move |_| std::time::Instant::now() < deadline)
}

/// Creates the table `{prefix}_{pid}` (`id int8`), dropping one of that
/// name first, through `client`, and returns its name: the table a test
/// writes into to see whether a write landed.
pub async fn scratch_table(client: &tokio_postgres::Client, prefix: &str) -> String {
    let table = format!("{prefix}_{}", std::process::id());
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int8)"
        ))
        .await
        .expect("create the scratch table");
    table
}
