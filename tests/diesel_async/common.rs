//! Helpers shared by the diesel-async integration tests. The observer of
//! `pg_locks` is a tokio-postgres client (another session).

use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::AsyncPgConnection;
use lockkit_diesel_async::{Config, Locker, OrderCheck};
pub(crate) use lockkit_tests::observe::{granted_elsewhere, wait_until_waiting};
use lockkit_tests::TestServer;

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
