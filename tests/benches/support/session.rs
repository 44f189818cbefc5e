//! What the two session-lock benches share: the key type, the warm pool
//! and the plain side (a hand-written session-level lock).

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use lockkit::{AdvisoryKey, LockKey};
use lockkit_tests::TestServer;
use tokio_postgres::NoTls;

/// The key type both benches lock.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-bench/session")]
pub(crate) struct Job {
    pub(crate) id: i64,
}

impl Job {
    /// The raw `BigInt` key.
    pub(crate) fn raw(self) -> i64 {
        match self.lock_key() {
            LockKey::BigInt(key) => key,
            LockKey::Pair(..) => unreachable!("Job is a BigInt key"),
        }
    }
}

/// A deadpool pool of 4 connections to `db` (fast recycling), every
/// connection opened once.
pub(crate) async fn warm_pool(db: &TestServer) -> Pool {
    let manager = Manager::from_config(
        db.config(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(4).build().expect("pool");
    let mut warm = Vec::new();
    for _ in 0..pool.status().max_size {
        warm.push(pool.get().await.expect("lease"));
    }
    drop(warm);
    pool
}

/// The plain side: `pg_advisory_lock` then `pg_advisory_unlock` on `conn`,
/// statements prepared once per connection (deadpool's cache), two round
/// trips, the least a hand-written session lock costs.
pub(crate) async fn plain_lock_unlock(conn: &Object, job: Job) {
    let key = job.raw();
    let lock = conn
        .prepare_cached("SELECT pg_advisory_lock($1)")
        .await
        .expect("prepare");
    let unlock = conn
        .prepare_cached("SELECT pg_advisory_unlock($1)")
        .await
        .expect("prepare");
    conn.query_one(&lock, &[&key]).await.expect("lock");
    let unlocked: bool = conn
        .query_one(&unlock, &[&key])
        .await
        .expect("unlock")
        .get(0);
    assert!(unlocked);
}
