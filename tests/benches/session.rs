//! What a default session-duration lock costs on a connection leased from a
//! warm pool, next to a plain session-level lock by hand on a pooled
//! connection, on a real PostgreSQL server (the harness's throwaway server,
//! or `DATABASE_URL`).
//!
//! ```text
//! cargo bench -p lockkit-tests --bench session
//! ```
//!
//! One paired report (no criterion): the sides alternate, iteration by
//! iteration and in rotating order, so a drift of the machine's round trip
//! hits all alike; it prints the median and p90 of each and the ratios of
//! the medians next to their targets.
//!
//! - `default`: `SessionLock::from_pool(pool).lock(key)` then
//!   `guard.release()`: a lease, then one simple-protocol query, `BEGIN;`
//!   the set-up (`SELECT` standby check and backend pid; `SET LOCAL`
//!   `application_name` and `client_connection_check_interval`, once the
//!   first lock saw the server has it, and the lease,
//!   `idle_in_transaction_session_timeout`) `;` the engine's xact lock
//!   statement with its key as a literal, a task for the keepalive, and
//!   `ROLLBACK` in a second round trip: seven commands parsed by the server
//!   each time,
//!   where `plain` sends two prepared statements.
//! - `plain`: a lease, then `SELECT pg_advisory_lock($1)` and
//!   `SELECT pg_advisory_unlock($1)`, statements prepared once per
//!   connection (deadpool's statement cache): two round trips, the least a
//!   hand-written session lock costs.
//!
//! - `minting`: `default` with `SessionLock::fencing_tokens(true)`: the same
//!   query with `SELECT lockkit.fencing_token()::text` after the lock
//!   (one more command), next to `default` (target ≤ 1.05×).
//!
//! The sides use the same pool of 4 connections (warmed first), one key
//! per iteration from a ring, never contended.
//!
//! For instruction counts (callgrind), `LOCKKIT_BENCH_SIDE=default` or
//! `plain` runs only that side, `LOCKKIT_BENCH_PAIRS=n` n iterations of it
//! (after the warm-up); the difference of two such runs over the difference
//! of their `n` is one side's client cost per lock + release:
//!
//! ```text
//! LOCKKIT_BENCH_SIDE=default LOCKKIT_BENCH_PAIRS=1000 valgrind --tool=callgrind target/release/deps/session-* --bench
//! ```

use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use lockkit::SessionLock;
use lockkit_tests::TestServer;

#[path = "support/session.rs"]
mod support;
use support::{plain_lock_unlock, warm_pool, Job};

const WARMUP: usize = 300;
const PAIRS: usize = 3000;
const RING: i64 = 1024;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn default_side(sessions: &SessionLock, id: i64) -> Duration {
    let started = Instant::now();
    let guard = sessions.lock(Job { id }).await.expect("lock");
    let held = guard.release().await.expect("release");
    let elapsed = started.elapsed();
    assert!(held);
    elapsed
}

async fn plain_side(pool: &Pool, id: i64) -> Duration {
    let started = Instant::now();
    let conn = pool.get().await.expect("lease");
    plain_lock_unlock(&conn, Job { id }).await;
    drop(conn);
    started.elapsed()
}

fn median_and_p90(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort_unstable();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

/// `LOCKKIT_BENCH_SIDE=default|plain`: only that side (instruction counts).
fn only_side() -> Option<bool> {
    match std::env::var("LOCKKIT_BENCH_SIDE").ok()?.as_str() {
        "default" => Some(true),
        "plain" => Some(false),
        other => panic!("LOCKKIT_BENCH_SIDE={other:?}: default or plain"),
    }
}

async fn run_one_side(db: &TestServer, default: bool) {
    let pairs: usize = std::env::var("LOCKKIT_BENCH_PAIRS")
        .map(|n| n.parse().expect("LOCKKIT_BENCH_PAIRS: a count"))
        .unwrap_or(PAIRS);
    let pool = warm_pool(db).await;
    let sessions = SessionLock::from_pool(pool.clone());
    for i in 0..(WARMUP + pairs) as i64 {
        match default {
            true => default_side(&sessions, i % RING).await,
            false => plain_side(&pool, i % RING).await,
        };
    }
    println!("{pairs} iterations of one side after {WARMUP} warm-up ones");
}

async fn run() {
    let db = TestServer::shared();
    if let Some(default) = only_side() {
        return run_one_side(db, default).await;
    }
    let pool = warm_pool(db).await;
    let sessions = SessionLock::from_pool(pool.clone());
    // The fencing tokens' functions, for the minting side.
    let client = pool.get().await.expect("lease");
    lockkit::sql::install(&**client).await.expect("install");
    drop(client);
    let minting = SessionLock::from_pool(pool.clone()).fencing_tokens(true);

    for i in 0..WARMUP as i64 {
        default_side(&sessions, i % RING).await;
        default_side(&minting, i % RING).await;
        plain_side(&pool, i % RING).await;
    }
    let mut default = Vec::with_capacity(PAIRS);
    let mut minted = Vec::with_capacity(PAIRS);
    let mut plain = Vec::with_capacity(PAIRS);
    for i in 0..PAIRS {
        let id = i as i64 % RING;
        // The three sides in turn, each first in one iteration of three.
        for side in 0..3 {
            match (i + side) % 3 {
                0 => default.push(default_side(&sessions, id).await),
                1 => minted.push(default_side(&minting, id).await),
                _ => plain.push(plain_side(&pool, id).await),
            }
        }
    }
    let (d50, d90) = median_and_p90(&mut default);
    let (m50, m90) = median_and_p90(&mut minted);
    let (p50, p90) = median_and_p90(&mut plain);
    println!(
        "session locks, acquire + release on a warm deadpool pool of 4, {PAIRS} triples alternated:"
    );
    println!("  default (xact lock in a held transaction): median {d50:>9.1?}  p90 {d90:>9.1?}");
    println!("  default, minting a fencing token:          median {m50:>9.1?}  p90 {m90:>9.1?}");
    println!("  plain pg_advisory_lock/unlock, prepared:    median {p50:>9.1?}  p90 {p90:>9.1?}");
    println!(
        "  ratio of medians default/plain: {:.2}x (target <= 1.5x)",
        d50.as_secs_f64() / p50.as_secs_f64()
    );
    println!(
        "  ratio of medians minting/default: {:.2}x (target <= 1.05x)",
        m50.as_secs_f64() / d50.as_secs_f64()
    );
}
