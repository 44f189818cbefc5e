//! Helpers shared by the diesel-async integration tests. The observer of
//! `pg_locks` is a tokio-postgres client (another session).

use std::time::{Duration, Instant};

use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::AsyncPgConnection;
use lockkit::LockKey;
use lockkit_diesel_async::{Config, Locker, OrderCheck};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

/// A deadpool pool of diesel-async connections.
pub(crate) type PgPool = Pool<AsyncPgConnection>;

/// A pool of at most `size` connections to `db`.
pub(crate) fn pool(db: &TestServer, size: usize) -> PgPool {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(db.url());
    Pool::builder(manager)
        .max_size(size)
        .build()
        .expect("deadpool")
}

/// A locker learned through a connection of `pool`, without the order check
/// (the tests take keys one by one in any order on purpose).
pub(crate) async fn locker(pool: &PgPool) -> Locker {
    let mut conn = pool.get().await.expect("pooled connection");
    Locker::new(&mut conn, Config::default().order_check(OrderCheck::Off))
        .await
        .expect("locker")
}

/// Whether another session than `observer`'s holds `key` granted.
pub(crate) async fn granted_elsewhere(observer: &Client, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    let n: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid <> pg_backend_pid()",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0);
    n > 0
}

/// The backend pid of a diesel-async connection.
pub(crate) async fn backend_pid(conn: &mut AsyncPgConnection) -> i32 {
    use diesel::sql_types::Integer;
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    let row: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(conn)
        .await
        .expect("pg_backend_pid");
    row.pid
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
