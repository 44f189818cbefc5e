//! Helpers shared by the Diesel integration tests.

use std::time::{Duration, Instant};

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Oid, SmallInt};
use diesel::{sql_query, Connection, PgConnection, QueryableByName, RunQueryDsl};
use lockkit::LockKey;
use lockkit_diesel::{Config, Locker};
use lockkit_tests::TestServer;

/// A pool of Diesel connections.
pub(crate) type PgPool = Pool<ConnectionManager<PgConnection>>;

/// A new Diesel connection to `db`.
pub(crate) fn connect(db: &TestServer) -> PgConnection {
    PgConnection::establish(db.url()).expect("diesel connects to the test server")
}

/// An r2d2 pool of `size` connections to `db`, all opened up front.
pub(crate) fn pool(db: &TestServer, size: u32) -> PgPool {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(size))
        .connection_timeout(Duration::from_secs(60))
        .build(ConnectionManager::new(db.url()))
        .expect("r2d2 pool")
}

/// A locker learned through `conn`.
pub(crate) fn locker(conn: &mut PgConnection, config: Config) -> Locker {
    Locker::new(conn, config).expect("locker")
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Whether another session than `observer`'s holds `key` granted, per
/// `pg_locks`.
pub(crate) fn granted_elsewhere(observer: &mut PgConnection, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    let row: Count = sql_query(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid <> pg_backend_pid()",
    )
    .bind::<Oid, _>(id.classid)
    .bind::<Oid, _>(id.objid)
    .bind::<SmallInt, _>(id.objsubid)
    .get_result(observer)
    .expect("pg_locks");
    row.n > 0
}

/// Waits until no other session holds `key`. For releases that happen in the
/// server asynchronously to the test (a session that ends); the deadline
/// guards a hang and is no timing claim.
pub(crate) fn released(observer: &mut PgConnection, key: LockKey) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if !granted_elsewhere(observer, key) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}
