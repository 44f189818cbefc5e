//! What lockkit's lock path costs next to hand-written SQL, on a real
//! PostgreSQL server (the harness's throwaway server, or `DATABASE_URL`).
//!
//! ```text
//! cargo bench -p lockkit-tests --bench locks
//! ```
//!
//! Three comparisons, one criterion group each, so the report shows them
//! side by side:
//!
//! - `single_lock`: a transaction that takes one key (`BEGIN`, lock,
//!   `COMMIT`) through lockkit and through raw tokio-postgres with a
//!   statement prepared once; then the lock call alone inside an open
//!   transaction (`BEGIN`/`COMMIT` untimed).
//! - `batch_64`: 64 keys in one `lock_batch` against 64 sequential raw
//!   prepared `SELECT pg_advisory_xact_lock($1)`, each awaited.
//! - `pipelined`: a 16-key `lock_batch` polled together with the
//!   transaction's `INSERT`, against the same transaction without locks.
//!
//! Every benchmark runs on one connection, so no key is ever contended, and
//! every iteration ends its transaction. The `raw_typed` variants send the
//! raw SQL the way lockkit sends it (`query_typed`: an unnamed statement
//! parsed on every call) to tell lockkit's own cost from the protocol's.
//! `raw_unnest_*` and `raw_pipelined_*` send lockkit's own batch statement
//! by hand, prepared once or as lockkit sends it, to show what a prepared
//! statement would save. These and `pipelined/lockkit_sequential` are
//! diagnostics, not targets.
//!
//! # Pipelining a lock batch with the next statement
//!
//! [`LockTx::lock_batch`] sends its statement when the future is first
//! polled. Polled together with the transaction's next statement, both go
//! out before either answer comes back: the server runs the locks first and
//! the statement after them, in order, and the locks cost no round trip of
//! their own. Poll the lock future *first* (`try_join!` polls left to
//! right), and put only statements that may run under the locks next to it:
//! the statement runs whether or not it is needed, before the locks are
//! known to be granted. If the lock statement fails (deadlock, lock table
//! full), the server aborts the transaction, the statement after it fails
//! too, and `try_join!` returns the lock's error.
//!
//! ```no_run
//! use lockkit::{AdvisoryKey, Batch, Error, Locker};
//! use tokio_postgres::types::ToSql;
//!
//! #[derive(AdvisoryKey)]
//! struct Event {
//!     id: i64,
//! }
//!
//! async fn ingest(
//!     locker: &Locker,
//!     client: &mut tokio_postgres::Client,
//!     ids: &[i64],
//! ) -> Result<u64, Error> {
//!     let mut batch = Batch::new();
//!     batch.extend(&ids.iter().map(|&id| Event { id }).collect::<Vec<_>>());
//!
//!     let tx = locker.begin(client).await?;
//!     // One round trip for both: the locks, then the insert under them.
//!     let (held, inserted) = tokio::try_join!(tx.lock_batch(&batch), async {
//!         let insert = "INSERT INTO events (id) SELECT unnest($1) ON CONFLICT DO NOTHING";
//!         Ok::<_, Error>(tx.execute_typed(insert, &[(&ids, Type::INT8_ARRAY)]).await?)
//!     })?;
//!     drop(held); // proof only: the locks stay held until the transaction ends
//!     tx.commit().await?; // releases every lock of the batch
//!     Ok(inserted)
//! }
//! ```
//!
//! The second future must send its statement on its first poll, as
//! `execute_typed`, `query_typed` and `execute`/`query` with a prepared
//! [`Statement`](tokio_postgres::Statement) do. `execute` with a `&str`
//! first prepares the statement and waits for that answer, so only the
//! `Parse` overlaps the locks; prepare it once per connection instead.
//!
//! The benchmark `pipelined/lockkit_pipelined` runs this pattern (with a
//! statement prepared once per connection), `pipelined/lockkit_sequential`
//! the same transaction awaiting the batch before the insert.
//!
//! [`LockTx::lock_batch`]: lockkit::LockTx::lock_batch

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use lockkit::driver::sql;
use lockkit::{AdvisoryKey, Batch, Config, Error, LockKey, LockTx, Locker, Prepared};
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
    client: Mutex<Client>,
    locker: Locker,
    /// lockkit's statements prepared on `client` ([`Locker::prepare`]).
    prepared: Prepared,
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
        let prepared = locker.prepare(&client).await.expect("prepare lockkit");
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
            client: Mutex::new(client),
            locker,
            prepared,
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
    async fn begin<'c>(&self, client: &'c mut Client, prepared: bool) -> LockTx<'c> {
        let tx = if prepared {
            self.locker.begin_prepared(client, &self.prepared).await
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

fn locks(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let bench = rt.block_on(Bench::new());

    group(
        c,
        &rt,
        &bench,
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
        &rt,
        &bench,
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
        &rt,
        &bench,
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

    rt.block_on(bench.drop_table());
}

// `criterion_group!`/`criterion_main!` by hand: the macro's `pub fn` has no
// doc comment, which the workspace lints reject.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    locks(&mut c);
    c.final_summary();
}
