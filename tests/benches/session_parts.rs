//! Where a default session lock's time goes: the statements it sends, sent
//! by hand without lockkit, next to lockkit's default session lock and the
//! plain prepared `pg_advisory_lock` / `pg_advisory_unlock`, on the same
//! warm deadpool pool of 4, in one run (the sides rotate, iteration by
//! iteration), ratio of each median to the plain one's.
//!
//! ```text
//! cargo bench -p lockkit-tests --bench session_parts
//! ```
//!
//! - `plain`: as in `benches/session.rs`.
//! - `floor`: `BEGIN; <lock>` then `ROLLBACK` (simple protocol): the least
//!   a lock held by an open transaction costs, with no set-up.
//! - `statements`: what lockkit sends for a lock once the server is known,
//!   `BEGIN; SELECT pg_is_in_recovery(), pg_backend_pid(); SET LOCAL
//!   application_name …; SET LOCAL client_connection_check_interval …;
//!   <lock>` then `ROLLBACK`, by hand.
//! - `statements + task`: the same, with a spawned task owning the
//!   connection until the release, as lockkit's keepalive task does.
//! - `default`: `SessionLock::from_pool(pool).lock(key)` then `release()`.
//!
//! `LOCKKIT_BENCH_SIDE=<index>` (0 = plain … 4 = default) and
//! `LOCKKIT_BENCH_PAIRS=n` run one side only, for callgrind.
//!
//! The hand-written texts are copies of lockkit's, for the measurement
//! only: lockkit's own are rendered by the engine (`engine::sql`,
//! `Statement::write_simple`).

use std::time::{Duration, Instant};

use deadpool_postgres::{Object, Pool};
use lockkit::SessionLock;
use lockkit_tests::TestServer;

#[path = "support/session.rs"]
mod support;
use support::{plain_lock_unlock, warm_pool, Job};

const WARMUP: usize = 300;
const ROUNDS: usize = 2000;
const RING: i64 = 1024;
const SIDES: [&str; 5] = [
    "plain pg_advisory_lock/unlock, prepared",
    "floor: BEGIN; lock / ROLLBACK",
    "statements: BEGIN; set-up; lock / ROLLBACK",
    "statements + a task owning the connection",
    "default SessionLock",
];

fn lock_text(id: i64) -> String {
    let key = Job { id }.raw();
    format!(
        "/* lockkit:lock_bigint */ SELECT 7813573191525823489::int8 AS tag, \
         pg_advisory_xact_lock(('{key}'::int8)) AS locked"
    )
}

async fn statements(conn: &Object, id: i64, setup: bool) {
    let setup = if setup {
        "SELECT pg_is_in_recovery(), pg_backend_pid(); \
         SET LOCAL application_name = E'lockkit session lock 1'; \
         SET LOCAL client_connection_check_interval = 1000; "
    } else {
        ""
    };
    let query = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; {setup}{}",
        lock_text(id)
    );
    conn.simple_query(&query).await.expect("lock");
}

async fn side(pool: &Pool, sessions: &SessionLock, which: usize, id: i64) -> Duration {
    let started = Instant::now();
    match which {
        0 => {
            let conn = pool.get().await.expect("lease");
            plain_lock_unlock(&conn, Job { id }).await;
        }
        1 | 2 => {
            let conn = pool.get().await.expect("lease");
            statements(&conn, id, which == 2).await;
            conn.simple_query("ROLLBACK").await.expect("rollback");
        }
        3 => {
            let conn = pool.get().await.expect("lease");
            statements(&conn, id, true).await;
            let (release, mut asked) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(async move {
                let done: tokio::sync::oneshot::Sender<()> = asked.recv().await.expect("asked");
                conn.simple_query("ROLLBACK").await.expect("rollback");
                drop(conn);
                let _ = done.send(());
            });
            let (done, released) = tokio::sync::oneshot::channel();
            release.send(done).expect("task");
            released.await.expect("released");
        }
        _ => {
            let guard = sessions.lock(Job { id }).await.expect("lock");
            assert!(guard.release().await.expect("release"));
        }
    }
    started.elapsed()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let db = TestServer::shared();
        let pool = warm_pool(db).await;
        let sessions = SessionLock::from_pool(pool.clone());
        // For instruction counts (callgrind): `LOCKKIT_BENCH_SIDE=<index
        // in SIDES>` runs only that side, `LOCKKIT_BENCH_PAIRS=n` n times
        // after the warm-up (see `benches/session.rs`).
        if let Ok(only) = std::env::var("LOCKKIT_BENCH_SIDE") {
            let which: usize = only.parse().expect("LOCKKIT_BENCH_SIDE: an index");
            let n: usize = std::env::var("LOCKKIT_BENCH_PAIRS")
                .map(|n| n.parse().expect("LOCKKIT_BENCH_PAIRS: a count"))
                .unwrap_or(ROUNDS);
            for i in 0..WARMUP + n {
                side(&pool, &sessions, which, i as i64 % RING).await;
            }
            println!("{n} iterations of {} after {WARMUP} warm-up ones", SIDES[which]);
            return;
        }
        let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(ROUNDS); SIDES.len()];
        for i in 0..WARMUP + ROUNDS {
            for j in 0..SIDES.len() {
                let which = (i + j) % SIDES.len();
                let took = side(&pool, &sessions, which, i as i64 % RING).await;
                if i >= WARMUP {
                    samples[which].push(took);
                }
            }
        }
        let medians: Vec<Duration> = samples
            .iter_mut()
            .map(|s| {
                s.sort_unstable();
                s[s.len() / 2]
            })
            .collect();
        println!("session lock parts, acquire + release on a warm deadpool pool of 4, {ROUNDS} rounds rotated:");
        for (name, median) in SIDES.iter().zip(&medians) {
            println!(
                "  {name:<45} median {median:>9.1?}  {:.2}x plain",
                median.as_secs_f64() / medians[0].as_secs_f64()
            );
        }
    });
}
