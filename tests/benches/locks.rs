//! What lockkit's lock path costs next to hand-written SQL, on a real
//! PostgreSQL server (the harness's throwaway server, or `DATABASE_URL`).
//!
//! ```text
//! cargo bench -p lockkit-tests --bench locks
//! ```
//!
//! Three comparisons, one criterion group each:
//!
//! - `single_lock`: a transaction that takes one key (`BEGIN`, lock,
//!   `COMMIT`) through lockkit and through raw tokio-postgres with a
//!   statement prepared once; then the lock call alone inside an open
//!   transaction (`BEGIN`/`COMMIT` untimed).
//! - `batch_64`: 64 keys in one `lock_batch` against 64 sequential raw
//!   prepared `SELECT pg_advisory_xact_lock($1)`, each awaited.
//! - `pipelined`: a 16-key `lock_batch` polled together with the
//!   transaction's `INSERT` (the pattern documented, with an example, on
//!   `lockkit::LockTx::lock_batch`), against the same transaction without
//!   locks.
//!
//! lockkit runs each twice: `_prepared` with its statements prepared once
//! per connection (`LockClient::begin`, the default), `_typed` sending them unnamed
//! (`Locker::begin`), which the server parses every time. `raw_unnest_prepared`
//! and `raw_pipelined_prepared` send lockkit's batch statement by hand, to
//! tell lockkit's own cost from the statement's.
//!
//! Every benchmark runs on one connection, so no key is ever contended, and
//! every iteration ends its transaction.
//!
//! # The paired report
//!
//! criterion measures one benchmark after another, and on a shared 2-core
//! machine the round-trip time drifts by tens of percent between them. After
//! criterion, a paired report alternates the two sides of each comparison
//! transaction by transaction, so drift hits both alike, and prints the
//! ratio of their medians next to the issue's target.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use lockkit::engine::sql;
use lockkit::{AdvisoryKey, Batch, Config, Error, LockClient, LockKey, LockTx, Locker};
use lockkit_tests::TestServer;
use tokio::runtime::Runtime;
use tokio::sync::Mutex;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

/// The key type locked in every benchmark.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
struct Item {
    id: i64,
}

/// Distinct keys cycled through by the single-key benchmarks.
const RING: usize = 4096;
/// Batches cycled through by the batch benchmarks.
const BATCHES: usize = 64;

/// A connection and what the benchmarks prepare once on it.
struct Bench {
    client: Mutex<LockClient>,
    locker: Locker,
    /// `SELECT pg_advisory_xact_lock($1)`, prepared once.
    lock: Statement,
    /// lockkit's batch statement, prepared once (diagnostic).
    lock_unnest: Statement,
    /// `INSERT INTO <table> (id) VALUES ($1)`, prepared once.
    insert: Statement,
    table: String,
    /// The raw `BigInt` key of `Item { id: i }` at index `i`.
    keys: Vec<i64>,
    batch64: Vec<Batch>,
    /// The raw keys of each `batch64` batch, in the global lock order.
    raw64: Vec<Vec<i64>>,
    batch16: Vec<Batch>,
    /// The raw keys of each `batch16` batch, in the global lock order.
    raw16: Vec<Vec<i64>>,
}

fn bigint(key: LockKey) -> i64 {
    match key {
        LockKey::BigInt(k) => k,
        LockKey::Pair(..) => unreachable!("Item has BigInt keys"),
    }
}

/// Batches of `size` distinct keys each, disjoint from one another.
fn batches(size: usize) -> (Vec<Batch>, Vec<Vec<i64>>) {
    (0..BATCHES)
        .map(|b| {
            let mut batch = Batch::new();
            let items: Vec<Item> = (0..size)
                .map(|i| Item {
                    id: (1_000_000 + b * size + i) as i64,
                })
                .collect();
            batch.extend(&items);
            let raw = batch
                .planned()
                .into_iter()
                .map(|(k, _)| bigint(k))
                .collect();
            (batch, raw)
        })
        .unzip()
}

impl Bench {
    async fn new() -> Bench {
        let client = TestServer::shared().connect().await;
        let locker = Locker::new(&client, Config::default())
            .await
            .expect("locker");
        let table = format!("lockkit_bench_{}", std::process::id());
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int8 PRIMARY KEY)"
            ))
            .await
            .expect("create the bench table");
        let lock = client.prepare(sql::LOCK_BIGINT).await.expect("prepare");
        let lock_unnest = client.prepare(sql::BATCH_BIGINT).await.expect("prepare");
        let insert = client
            .prepare(&format!("INSERT INTO {table} (id) VALUES ($1)"))
            .await
            .expect("prepare");
        let keys = (0..RING as i64)
            .map(|id| bigint(Item { id }.lock_key()))
            .collect();
        let (batch64, raw64) = batches(64);
        let (batch16, raw16) = batches(16);
        Bench {
            client: Mutex::new(LockClient::new(&locker, client)),
            locker,
            lock,
            lock_unnest,
            insert,
            table,
            keys,
            batch64,
            raw64,
            batch16,
            raw16,
        }
    }

    /// A lockkit transaction, its statements `prepared` or sent typed.
    async fn begin<'c>(&self, client: &'c mut LockClient, prepared: bool) -> LockTx<'c> {
        let tx = if prepared {
            client.begin().await
        } else {
            self.locker.begin(client).await
        };
        tx.expect("begin")
    }

    /// Empties the insert table (untimed, before a sample).
    async fn truncate(&self, client: &Client) {
        client
            .batch_execute(&format!("TRUNCATE {}", self.table))
            .await
            .expect("truncate");
    }

    async fn drop_table(&self) {
        let client = self.client.lock().await;
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", self.table))
            .await
            .expect("drop the bench table");
    }
}

// ---- single_lock ---------------------------------------------------------

async fn single_lockkit_tx(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let tx = b.begin(&mut client, prepared).await;
        let held = tx.lock(Item { id }).await.expect("lock");
        black_box(&held);
        drop(held);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn single_raw_tx(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        tx.execute(&b.lock, &[&key]).await.expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn single_lockkit_call(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let mut total = Duration::ZERO;
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let tx = b.begin(&mut client, prepared).await;
        let start = Instant::now();
        let held = tx.lock(Item { id }).await.expect("lock");
        total += start.elapsed();
        black_box(&held);
        drop(held);
        tx.commit().await.expect("commit");
    }
    total
}

async fn single_raw_call(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let mut total = Duration::ZERO;
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        let start = Instant::now();
        tx.execute(&b.lock, &[&key]).await.expect("lock");
        total += start.elapsed();
        tx.commit().await.expect("commit");
    }
    total
}

// ---- batch_64 ------------------------------------------------------------

async fn batch_lockkit(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch64[(i % BATCHES as u64) as usize];
        let tx = b.begin(&mut client, prepared).await;
        let held = tx.lock_batch(batch).await.expect("lock_batch");
        black_box(&held);
        drop(held);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn batch_raw_sequential(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw64[(i % BATCHES as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        for key in keys {
            tx.execute(&b.lock, &[key]).await.expect("lock");
        }
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn batch_raw_unnest_prepared(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let shared = vec![false; 64];
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw64[(i % BATCHES as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        tx.execute(&b.lock_unnest, &[keys, &shared])
            .await
            .expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

// ---- pipelined -----------------------------------------------------------

/// Ids for the insert table: distinct within a sample (the table is
/// truncated before each).
fn row_id(i: u64) -> i64 {
    i as i64
}

async fn insert_no_locks(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    b.truncate(&client).await;
    let start = Instant::now();
    for i in 0..iters {
        let tx = client.transaction().await.expect("begin");
        tx.execute(&b.insert, &[&row_id(i)]).await.expect("insert");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn insert_lockkit_pipelined(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    b.truncate(&client).await;
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch16[(i % BATCHES as u64) as usize];
        let tx = b.begin(&mut client, prepared).await;
        let (held, n) = tokio::try_join!(tx.lock_batch(batch), async {
            Ok::<_, Error>(tx.execute(&b.insert, &[&row_id(i)]).await?)
        })
        .expect("lock and insert");
        black_box((&held, n));
        drop(held);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// The pipelined transaction in raw tokio-postgres, with lockkit's batch
/// statement prepared once.
async fn insert_raw_pipelined_prepared(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    b.truncate(&client).await;
    let shared = vec![false; 16];
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw16[(i % BATCHES as u64) as usize];
        let id = row_id(i);
        let params: [&(dyn ToSql + Sync); 1] = [&id];
        let lock_params: [&(dyn ToSql + Sync); 2] = [keys, &shared];
        let tx = client.transaction().await.expect("begin");
        let n = tokio::try_join!(
            tx.execute(&b.lock_unnest, &lock_params),
            tx.execute(&b.insert, &params)
        )
        .expect("lock and insert");
        black_box(n);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// lockkit's routines with their statements sent typed (`_typed`) or
/// prepared on the connection (`_prepared`).
macro_rules! variants {
    ($($f:ident => $typed:ident, $prepared:ident;)*) => {$(
        async fn $typed(b: &Bench, iters: u64) -> Duration {
            $f(b, iters, false).await
        }
        async fn $prepared(b: &Bench, iters: u64) -> Duration {
            $f(b, iters, true).await
        }
    )*};
}
variants! {
    single_lockkit_tx => single_lockkit_tx_typed, single_lockkit_tx_prepared;
    single_lockkit_call => single_lockkit_call_typed, single_lockkit_call_prepared;
    batch_lockkit => batch_lockkit_typed, batch_lockkit_prepared;
    insert_lockkit_pipelined => insert_lockkit_pipelined_typed, insert_lockkit_pipelined_prepared;
}

// ---- groups --------------------------------------------------------------

type Routine = for<'b> fn(
    &'b Bench,
    u64,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Duration> + 'b>>;

macro_rules! routine {
    ($f:path) => {{
        let r: Routine = |b, iters| Box::pin($f(b, iters));
        r
    }};
}

fn group(c: &mut Criterion, rt: &Runtime, bench: &Bench, name: &str, cases: &[(&str, Routine)]) {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(50)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5));
    for &(id, routine) in cases {
        group.bench_function(id, |b| {
            b.to_async(rt).iter_custom(|iters| routine(bench, iters));
        });
    }
    group.finish();
}

fn locks(c: &mut Criterion, rt: &Runtime, bench: &Bench) {
    group(
        c,
        rt,
        bench,
        "single_lock",
        &[
            ("lockkit_tx_prepared", routine!(single_lockkit_tx_prepared)),
            ("lockkit_tx_typed", routine!(single_lockkit_tx_typed)),
            ("raw_tx", routine!(single_raw_tx)),
            (
                "lockkit_call_prepared",
                routine!(single_lockkit_call_prepared),
            ),
            ("lockkit_call_typed", routine!(single_lockkit_call_typed)),
            ("raw_call", routine!(single_raw_call)),
        ],
    );
    group(
        c,
        rt,
        bench,
        "batch_64",
        &[
            ("lockkit_batch_prepared", routine!(batch_lockkit_prepared)),
            ("lockkit_batch_typed", routine!(batch_lockkit_typed)),
            ("raw_sequential", routine!(batch_raw_sequential)),
            ("raw_unnest_prepared", routine!(batch_raw_unnest_prepared)),
        ],
    );
    group(
        c,
        rt,
        bench,
        "pipelined",
        &[
            ("no_locks", routine!(insert_no_locks)),
            (
                "lockkit_pipelined_prepared",
                routine!(insert_lockkit_pipelined_prepared),
            ),
            (
                "lockkit_pipelined_typed",
                routine!(insert_lockkit_pipelined_typed),
            ),
            (
                "raw_pipelined_prepared",
                routine!(insert_raw_pipelined_prepared),
            ),
        ],
    );
}

/// One comparison of the paired report: `lockkit` against `baseline`, and
/// the target for `lockkit / baseline` (or `baseline / lockkit` when
/// `speedup`).
struct Pair {
    name: &'static str,
    lockkit: Routine,
    baseline: Routine,
    speedup: bool,
    target: f64,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Alternates the two sides transaction by transaction and prints the ratio
/// of their medians.
fn paired_report(rt: &Runtime, bench: &Bench, rounds: usize) {
    let pairs = [
        Pair {
            name: "single lock, whole transaction",
            lockkit: routine!(single_lockkit_tx_prepared),
            baseline: routine!(single_raw_tx),
            speedup: false,
            target: 1.05,
        },
        Pair {
            name: "single lock, the call alone",
            lockkit: routine!(single_lockkit_call_prepared),
            baseline: routine!(single_raw_call),
            speedup: false,
            target: 1.05,
        },
        Pair {
            name: "single lock, typed (no prepare)",
            lockkit: routine!(single_lockkit_tx_typed),
            baseline: routine!(single_raw_tx),
            speedup: false,
            target: 1.05,
        },
        Pair {
            name: "64-key batch vs 64 statements",
            lockkit: routine!(batch_lockkit_prepared),
            baseline: routine!(batch_raw_sequential),
            speedup: true,
            target: 5.0,
        },
        Pair {
            name: "16-key batch pipelined with INSERT",
            lockkit: routine!(insert_lockkit_pipelined_prepared),
            baseline: routine!(insert_no_locks),
            speedup: false,
            target: 1.2,
        },
        Pair {
            name: "the same, typed (no prepare)",
            lockkit: routine!(insert_lockkit_pipelined_typed),
            baseline: routine!(insert_no_locks),
            speedup: false,
            target: 1.2,
        },
    ];
    println!("\npaired report ({rounds} alternating transactions per side)");
    println!(
        "{:<38} {:>12} {:>12} {:>8} {:>8}  met",
        "comparison", "lockkit µs", "baseline µs", "ratio", "target"
    );
    for pair in &pairs {
        let (mut a, mut b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
        rt.block_on(async {
            for _ in 0..rounds {
                a.push((pair.lockkit)(bench, 1).await);
                b.push((pair.baseline)(bench, 1).await);
            }
        });
        let (a, b) = (median(a), median(b));
        let ratio = if pair.speedup {
            b.as_secs_f64() / a.as_secs_f64()
        } else {
            a.as_secs_f64() / b.as_secs_f64()
        };
        let met = if pair.speedup {
            ratio >= pair.target
        } else {
            ratio <= pair.target
        };
        let (op, target) = if pair.speedup {
            ("≥", pair.target)
        } else {
            ("≤", pair.target)
        };
        println!(
            "{:<38} {:>12.1} {:>12.1} {:>7.2}× {:>2}{:>5.2}×  {}",
            pair.name,
            a.as_secs_f64() * 1e6,
            b.as_secs_f64() * 1e6,
            ratio,
            op,
            target,
            if met { "yes" } else { "no" }
        );
    }
}

// `criterion_group!`/`criterion_main!` by hand: the macro's `pub fn` has no
// doc comment, which the workspace lints reject.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let bench = rt.block_on(Bench::new());
    locks(&mut c, &rt, &bench);
    c.final_summary();
    // Only for a real benchmark run, not `cargo test --benches`.
    if std::env::args().any(|a| a == "--bench") {
        paired_report(&rt, &bench, 2000);
    }
    rt.block_on(bench.drop_table());
}
