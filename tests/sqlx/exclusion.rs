//! Mutual exclusion under concurrency, with its control: tasks on a sqlx
//! pool do a read-modify-write of one counter row under one key. With the
//! lock no update is lost and no two holders overlap; without it (the
//! control) updates are lost, which shows the test can fail.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use lockkit_sqlx::{AdvisoryKey, Config, Locker};
use lockkit_tests::TestServer;
use sqlx::PgPool;

use crate::common::{locker, pool};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-exclusion")]
struct Counter {
    id: i64,
}

const TASKS: usize = 8;
const ROUNDS: usize = 40;

/// Runs the workload; returns (final counter, overlaps seen in process).
async fn run(pool: &PgPool, locker: &Locker, id: i64, lock: bool) -> (i64, u64) {
    sqlx::query("CREATE TABLE IF NOT EXISTS sqlx_counters (id int8 PRIMARY KEY, n int8 NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO sqlx_counters VALUES ($1, 0) ON CONFLICT (id) DO UPDATE SET n = 0")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    let inside = Arc::new(AtomicI64::new(0));
    let overlaps = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (pool, locker) = (pool.clone(), locker.clone());
        let (inside, overlaps) = (Arc::clone(&inside), Arc::clone(&overlaps));
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let mut tx = pool.begin().await.unwrap();
                let mut ltx = locker.lock_tx(&mut tx).unwrap();
                let _guard = if lock {
                    Some(ltx.lock(Counter { id }).await.unwrap())
                } else {
                    None
                };
                if inside.fetch_add(1, SeqCst) != 0 {
                    overlaps.fetch_add(1, SeqCst);
                }
                let n: i64 = sqlx::query_scalar("SELECT n FROM sqlx_counters WHERE id = $1")
                    .bind(id)
                    .fetch_one(&mut *ltx)
                    .await
                    .unwrap();
                sqlx::query("UPDATE sqlx_counters SET n = $2 WHERE id = $1")
                    .bind(id)
                    .bind(n + 1)
                    .execute(&mut *ltx)
                    .await
                    .unwrap();
                inside.fetch_sub(1, SeqCst);
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n: i64 = sqlx::query_scalar("SELECT n FROM sqlx_counters WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    (n, overlaps.load(SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_update_is_lost_under_the_lock_and_some_are_without() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, TASKS as u32).await;
    let locker = locker(&pool, Config::default()).await;
    let total = (TASKS * ROUNDS) as i64;

    let (n, overlaps) = run(&pool, &locker, 1, true).await;
    assert_eq!(n, total, "every increment under the lock counts");
    assert_eq!(overlaps, 0);

    // Control: the same workload without the lock loses updates.
    let (n, overlaps) = run(&pool, &locker, 2, false).await;
    assert!(
        n < total,
        "the control lost no update ({n}), so the test cannot fail"
    );
    assert!(overlaps > 0);
}
