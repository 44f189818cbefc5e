//! What lockkit's lock path costs next to hand-written SQL, on a real
//! PostgreSQL server (the harness's throwaway server, or `DATABASE_URL`).
//!
//! ```text
//! cargo bench -p lockkit-tests --bench locks                                # criterion, then the paired report
//! LOCKKIT_BENCH_PAIRED_ONLY=1 cargo bench -p lockkit-tests --bench locks    # the paired report alone (a few minutes)
//! ```
//!
//! `LOCKKIT_BENCH_ROUNDS` sets the transactions per side of each paired
//! comparison (default 2,000), and `LOCKKIT_BENCH_ONLY=text` runs only the
//! comparisons whose name contains `text`.
//!
//! Three comparisons for tokio-postgres, one criterion group each, lockkit
//! through a [`LockClient`] in the fastest mode, `StatementMode::Prepared`
//! (lockkit's statements prepared lazily, once per connection):
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
//! The `_unnamed` variants send lockkit's statements unnamed, the default
//! (`StatementMode::Unnamed`, safe behind every pooler), which the server
//! parses every time. `raw_unnest_prepared` and `raw_pipelined_prepared`
//! send lockkit's batch statement by hand, to tell lockkit's own cost from
//! the statement's. The paired report's one-lock rows run every stack in
//! both modes: the default, and `Prepared`.
//!
//! And the same three for Diesel (group `diesel`), `lockkit_diesel::Locker::
//! transaction` with a `LockTx` against raw Diesel SQL
//! (`diesel::sql_query("SELECT pg_advisory_xact_lock($1)")` in
//! `conn.transaction`). Diesel runs `sql_query` unprepared, on both sides,
//! and cannot pipeline: its "pipelined" comparison is the locked 16-key batch
//! then the INSERT (one round trip more) against the INSERT alone.
//!
//! And the one lock of a whole transaction for the two other adapters
//! (group `adapters`), each against what its users write by hand:
//! lockkit-sqlx in `conn.begin()` against `sqlx::query("SELECT
//! pg_advisory_xact_lock($1)")` (which sqlx prepares once and caches), and
//! lockkit-diesel-async in `conn.transaction(async |conn| …)` against
//! diesel-async's `sql_query`.
//!
//! Every benchmark runs on one connection, so no key is ever contended, and
//! every iteration ends its transaction.
//!
//! And, in the paired report only, a multiplexed session lock
//! (`SessionLock` in `SessionForm::Multiplexed`, `connections(8)`): one
//! `try_lock` of a free `Feed` key then its `release` (two round trips on
//! one of its connections, each inside the transaction it holds open)
//! against the same two statements by hand, `pg_try_advisory_lock($1)` and
//! `pg_advisory_unlock($1)` prepared once on an open tokio-postgres
//! connection inside a transaction held open too (so the held transaction
//! is not what differs); and the same try and release on a
//! `SessionLock` that already holds 1,000 other keys on its connections
//! against one that holds nothing else. One task takes every lock, so the
//! multiplexed side runs on one connection, as the raw side does (a free
//! key goes to the open connection with the fewest keys); every side locks
//! keys of its own, each free when taken.
//!
//! # The paired report
//!
//! criterion measures one benchmark after another, and on a shared 2-core
//! machine the round-trip time drifts by tens of percent between them. After
//! criterion, a paired report alternates the two sides of each comparison
//! transaction by transaction, and which side goes first, so drift hits both
//! alike (a control row runs the raw side against itself), and prints the
//! ratio of their medians next to the issue's target. It is what the targets
//! are checked against; criterion's runs are kept short. The last column is
//! the client's CPU time per transaction (this process's thread, lockkit /
//! baseline), which tells lockkit's own work from the server's and the
//! network's.
//!
//! Every row runs on the harness's server, which turns `fsync` and
//! `synchronous_commit` off to make tests fast, so a COMMIT costs no more
//! than a round trip and the INSERT comparisons are as strict as they can
//! be. Two `durable:` rows, for context, run the INSERT comparisons on a
//! server of their own with PostgreSQL's default durability: there each
//! COMMIT waits for its WAL flush, as in production, and what that costs is
//! this machine's disk's.

use std::cell::{Cell, RefCell};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use diesel::sql_types::{Array, BigInt};
use diesel::{sql_query, Connection, PgConnection, RunQueryDsl};
use lockkit::driver::sql;
use lockkit::pg::{SessionForm, SessionGuard};
use lockkit::{
    AdvisoryKey, Batch, Config, Error, LockClient, LockKey, Locker, SessionLock, StatementMode,
};
use lockkit_tests::fixtures::Feed;
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
/// The baseline's lock statement, as a user would write it.
const RAW_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// The connections of each multiplexed `SessionLock` (at most; one task
/// taking one lock at a time uses one of them, unless keys are held).
const MUX_CONNECTIONS: usize = 8;
/// The other keys the loaded multiplexed `SessionLock` holds.
const MUX_HELD: i64 = 1_000;
/// The first `Feed` id of each side's keys (`RING` each, `MUX_HELD` for
/// the held ones): disjoint ranges, checked disjoint as keys.
const FEED_MUX: i64 = 70_000_000;
const FEED_LOADED: i64 = 71_000_000;
const FEED_HELD: i64 = 72_000_000;
const FEED_RAW: i64 = 73_000_000;
const FEED_MUX_PREPARED: i64 = 74_000_000;

/// lockkit's exclusive batch statement as it was before 2026-12-01, with
/// `unnest` in `FROM` (a function scan, which materializes every row before
/// the first lock): the diagnostic row that backs `engine::sql`'s figures.
const FUNCTION_SCAN_BATCH: &str = "SELECT 7813573191525823499::int8 AS tag, \
     count(pg_advisory_xact_lock(k)) AS n FROM unnest($1::int8[]) AS t(k)";

/// lockkit's one-key statement as it was before 2026-12-01, its tag the
/// statement's name as `text` and followed by a count: the diagnostic row
/// that backs `engine::sql::LOCK_BIGINT`'s figures.
const TEXT_TAGGED_LOCK: &str = "SELECT 'lockkit:lock_bigint'::text AS tag, 1::int8 AS n, \
     pg_advisory_xact_lock($1) AS locked";

/// A connection and what the benchmarks prepare once on it.
struct Bench {
    client: Mutex<LockClient>,
    locker: Locker,
    /// The default locker minting fencing tokens
    /// (`Config::fencing_tokens`).
    locker_minting: Locker,
    /// `SELECT pg_advisory_xact_lock($1)`, prepared once.
    lock: Statement,
    /// lockkit's exclusive batch statement, prepared once (diagnostic).
    lock_unnest: Statement,
    /// [`FUNCTION_SCAN_BATCH`], prepared once (diagnostic).
    lock_function_scan: Statement,
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
    /// A Diesel connection to the same server (blocking; used between the
    /// async benchmarks, never at the same time).
    diesel: RefCell<PgConnection>,
    /// Diesel's lockers: the default configuration (statements unnamed),
    /// and `StatementMode::Prepared` (Diesel's statement cache).
    diesel_locker: lockkit_diesel::Locker,
    diesel_locker_prepared: lockkit_diesel::Locker,
    /// The INSERT's text, for Diesel's `sql_query`.
    insert_sql: String,
    /// The next id for the insert table.
    next_row: Cell<i64>,
    /// lockkit's one-key statement, prepared by hand (diagnostic).
    lock_tagged: Statement,
    /// [`TEXT_TAGGED_LOCK`], prepared once (diagnostic).
    lock_text_tagged: Statement,
    /// `SELECT 1`, prepared once (diagnostic: what any statement pipelined
    /// with the INSERT costs).
    noop: Statement,
    /// A sqlx connection to the same server.
    sqlx: Mutex<sqlx::PgConnection>,
    sqlx_locker: lockkit_sqlx::Locker,
    sqlx_locker_prepared: lockkit_sqlx::Locker,
    /// A diesel-async connection to the same server.
    diesel_async: Mutex<diesel_async::AsyncPgConnection>,
    diesel_async_locker: lockkit_diesel_async::Locker,
    diesel_async_locker_prepared: lockkit_diesel_async::Locker,
    /// A multiplexed `SessionLock` that holds nothing but the key of the
    /// iteration.
    sessions: SessionLock,
    /// A multiplexed `SessionLock` that holds [`MUX_HELD`] other keys
    /// (`_held`, kept for the whole run), spread over all its connections.
    sessions_loaded: SessionLock,
    /// As `sessions`, with `StatementMode::Prepared`.
    sessions_prepared: SessionLock,
    _held: Vec<SessionGuard<Feed>>,
    /// The raw session-level side's connection, inside a transaction held
    /// open (as each multiplexed connection is).
    session_client: Client,
    /// `SELECT pg_try_advisory_lock($1)`, prepared once on `session_client`.
    try_lock: Statement,
    /// `SELECT pg_advisory_unlock($1)`, prepared once on `session_client`.
    unlock: Statement,
    /// The raw `BigInt` key of `Feed { id: FEED_RAW + i }` at index `i`.
    feed_raw: Vec<i64>,
    /// The next index into each side's `Feed` ids (mod `RING`).
    next_feed: Cell<i64>,
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
    async fn new(server: &TestServer) -> Bench {
        let client = server.connect().await;
        let locker = Locker::new(&client, Config::default())
            .await
            .expect("locker");
        // The fastest mode, for direct connections: lockkit's statements
        // prepared once per connection.
        let prepared = || Config::default().statements(StatementMode::Prepared);
        let locker_prepared = Locker::new(&client, prepared()).await.expect("locker");
        lockkit::sql::install(&client)
            .await
            .expect("install lockkit's SQL");
        let locker_minting = Locker::new(&client, Config::default().fencing_tokens(true))
            .await
            .expect("locker");
        let table = format!("lockkit_bench_{}", std::process::id());
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int8 PRIMARY KEY)"
            ))
            .await
            .expect("create the bench table");
        let lock = client.prepare(RAW_LOCK).await.expect("prepare");
        let lock_tagged = client.prepare(sql::LOCK_BIGINT).await.expect("prepare");
        let lock_text_tagged = client.prepare(TEXT_TAGGED_LOCK).await.expect("prepare");
        let lock_unnest = client
            .prepare(sql::BATCH_BIGINT_EXCLUSIVE)
            .await
            .expect("prepare");
        let lock_function_scan = client.prepare(FUNCTION_SCAN_BATCH).await.expect("prepare");
        let insert = client
            .prepare(&format!("INSERT INTO {table} (id) VALUES ($1)"))
            .await
            .expect("prepare");
        let keys = (0..RING as i64)
            .map(|id| bigint(Item { id }.lock_key()))
            .collect();
        let (batch64, raw64) = batches(64);
        let (batch16, raw16) = batches(16);
        let mut diesel = PgConnection::establish(server.url()).expect("diesel connects");
        let diesel_locker =
            lockkit_diesel::Locker::new(&mut diesel, Config::default()).expect("diesel locker");
        let diesel_locker_prepared =
            lockkit_diesel::Locker::new(&mut diesel, prepared()).expect("diesel locker");
        let insert_sql = format!("INSERT INTO {table} (id) VALUES ($1)");
        let noop = client.prepare("SELECT 1").await.expect("prepare");
        let mut sqlx = <sqlx::PgConnection as sqlx::Connection>::connect(server.url())
            .await
            .expect("sqlx connects");
        let sqlx_locker = lockkit_sqlx::Locker::new(&mut sqlx, Config::default())
            .await
            .expect("sqlx locker");
        let sqlx_locker_prepared = lockkit_sqlx::Locker::new(&mut sqlx, prepared())
            .await
            .expect("sqlx locker");
        let mut diesel_async =
            <diesel_async::AsyncPgConnection as diesel_async::AsyncConnection>::establish(
                server.url(),
            )
            .await
            .expect("diesel-async connects");
        let diesel_async_locker =
            lockkit_diesel_async::Locker::new(&mut diesel_async, Config::default())
                .await
                .expect("diesel-async locker");
        let diesel_async_locker_prepared =
            lockkit_diesel_async::Locker::new(&mut diesel_async, prepared())
                .await
                .expect("diesel-async locker");
        let multiplexed = || {
            SessionLock::new(server.config())
                .form(SessionForm::Multiplexed)
                .connections(MUX_CONNECTIONS)
        };
        let (sessions, sessions_loaded) = (multiplexed(), multiplexed());
        let sessions_prepared = multiplexed().statements(StatementMode::Prepared);
        // Taken one at a time: each goes to the open connection with the
        // fewest keys (or opens one), so they end up spread over all
        // `MUX_CONNECTIONS`, where the measured keys go too.
        let mut held = Vec::with_capacity(MUX_HELD as usize);
        for id in FEED_HELD..FEED_HELD + MUX_HELD {
            let guard = sessions_loaded
                .try_lock(Feed { id })
                .await
                .expect("try_lock")
                .expect("a free key");
            held.push(guard);
        }
        let session_client = server.connect().await;
        // The raw side runs inside a transaction held open, as the
        // multiplexed connections do (`pg_try_advisory_lock` takes a
        // session-level lock all the same), so that the held transaction
        // is not what differs.
        session_client
            .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .expect("begin");
        let try_lock = session_client
            .prepare("SELECT pg_try_advisory_lock($1)")
            .await
            .expect("prepare");
        let unlock = session_client
            .prepare("SELECT pg_advisory_unlock($1)")
            .await
            .expect("prepare");
        let feed = |id| bigint(Feed { id }.lock_key());
        let feed_raw: Vec<i64> = (FEED_RAW..FEED_RAW + RING as i64).map(feed).collect();
        let mut every: Vec<i64> = [FEED_MUX, FEED_LOADED, FEED_MUX_PREPARED]
            .into_iter()
            .flat_map(|first| (first..first + RING as i64).map(feed))
            .chain((FEED_HELD..FEED_HELD + MUX_HELD).map(feed))
            .chain(feed_raw.iter().copied())
            .collect();
        let all = every.len();
        every.sort_unstable();
        every.dedup();
        assert_eq!(every.len(), all, "the sides' Feed keys overlap");
        Bench {
            client: Mutex::new(LockClient::new(&locker_prepared, client)),
            locker,
            locker_minting,
            lock,
            lock_unnest,
            lock_function_scan,
            insert,
            table,
            keys,
            batch64,
            raw64,
            batch16,
            raw16,
            diesel: RefCell::new(diesel),
            diesel_locker,
            diesel_locker_prepared,
            insert_sql,
            next_row: Cell::new(0),
            lock_tagged,
            lock_text_tagged,
            noop,
            sqlx: Mutex::new(sqlx),
            sqlx_locker,
            sqlx_locker_prepared,
            diesel_async: Mutex::new(diesel_async),
            diesel_async_locker,
            diesel_async_locker_prepared,
            sessions,
            sessions_loaded,
            sessions_prepared,
            _held: held,
            session_client,
            try_lock,
            unlock,
            feed_raw,
            next_feed: Cell::new(0),
        }
    }

    /// A new id for the insert table, never used before in this run (the
    /// table is never truncated: a TRUNCATE before a sample made its first
    /// INSERT pay for the new relation and a re-plan, which swamped what
    /// the pipelined comparison is about).
    fn row_id(&self) -> i64 {
        let id = self.next_row.get();
        self.next_row.set(id + 1);
        id
    }

    /// The index of the next iteration's `Feed` key in each side's range.
    fn feed_index(&self) -> i64 {
        let i = self.next_feed.get();
        self.next_feed.set((i + 1) % RING as i64);
        i
    }

    async fn drop_table(&self) {
        let client = self.client.lock().await;
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", self.table))
            .await
            .expect("drop the bench table");
    }
}

/// A lockkit transaction: `LockClient::begin` over a locker in
/// `StatementMode::Prepared` (statements prepared once per connection) when
/// `prepared`, else `Locker::begin` on the plain client (statements sent
/// unnamed, as the default mode does). A macro,
/// not a method: the routine awaits lockkit's own future, as an application
/// does, rather than a wrapper of the bench's holding both.
macro_rules! begin {
    ($b:expr, $client:expr, $prepared:expr) => {
        if $prepared {
            $client.begin().await
        } else {
            $b.locker.begin(&mut $client).await
        }
        .expect("begin")
    };
}

// ---- single_lock ---------------------------------------------------------

async fn single_lockkit_tx(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let tx = begin!(b, client, prepared);
        let held = tx.lock(Item { id }).await.expect("lock");
        black_box(&held);
        drop(held);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// [`single_lockkit_tx`], unnamed, each lock minting a fencing token.
async fn single_lockkit_tx_minting(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let tx = b.locker_minting.begin(&mut client).await.expect("begin");
        let held = tx.lock(Item { id }).await.expect("lock");
        assert!(held.fencing_token().is_some());
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

/// The plain lock statement sent unnamed (`query_typed`: parse, bind and
/// execute in one round trip): the floor of any unnamed statement
/// (diagnostic).
async fn single_raw_unnamed_tx(b: &Bench, iters: u64) -> Duration {
    use tokio_postgres::types::Type;
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        tx.query_typed(RAW_LOCK, &[(&key, Type::INT8)])
            .await
            .expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// The plain lock statement in the simple query protocol, its key a
/// literal (diagnostic).
async fn single_raw_simple_tx(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        tx.simple_query(&format!("SELECT pg_advisory_xact_lock({key})"))
            .await
            .expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// What a sqlx user writes for a statement sqlx does not keep
/// (`persistent(false)`): sqlx parses it in a round trip of its own, then
/// binds and runs it (diagnostic).
async fn sqlx_single_raw_unnamed(b: &Bench, iters: u64) -> Duration {
    use sqlx::Connection as _;
    let mut conn = b.sqlx.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let mut tx = conn.begin().await.expect("begin");
        // A text of its own: sqlx would serve `RAW_LOCK` from its cache.
        sqlx::query("SELECT pg_advisory_xact_lock($1) -- unnamed")
            .bind(key)
            .persistent(false)
            .execute(&mut *tx)
            .await
            .expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// lockkit's one-key statement (`engine::sql::LOCK_BIGINT`: an `int8` tag
/// and the lock function's `void`), prepared and sent by hand, its row
/// read: the statement's cost without lockkit's code (diagnostic).
async fn single_tagged_tx(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        let row = tx.query_one(&b.lock_tagged, &[&key]).await.expect("lock");
        let tag: i64 = row.get(0);
        black_box(tag);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// [`TEXT_TAGGED_LOCK`], prepared and sent by hand, its row read as lockkit
/// read it then (diagnostic).
async fn single_text_tagged_tx(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        let row = tx
            .query_one(&b.lock_text_tagged, &[&key])
            .await
            .expect("lock");
        let (tag, n): (&str, i64) = (row.get(0), row.get(1));
        black_box((tag, n));
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn single_lockkit_call(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let mut total = Duration::ZERO;
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let tx = begin!(b, client, prepared);
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

// ---- the other adapters: one lock, whole transaction ---------------------

async fn sqlx_single_lockkit(b: &Bench, iters: u64) -> Duration {
    sqlx_single(b, &b.sqlx_locker, iters).await
}

async fn sqlx_single_lockkit_prepared(b: &Bench, iters: u64) -> Duration {
    sqlx_single(b, &b.sqlx_locker_prepared, iters).await
}

async fn sqlx_single(b: &Bench, locker: &lockkit_sqlx::Locker, iters: u64) -> Duration {
    use sqlx::Connection as _;
    let mut conn = b.sqlx.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        let mut tx = conn.begin().await.expect("begin");
        {
            let mut ltx = locker.lock_tx(&mut tx).expect("lock_tx");
            let held = ltx.lock(Item { id }).await.expect("lock");
            black_box(&held);
        }
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

/// What a sqlx user writes: `sqlx::query`, which sqlx prepares once per
/// connection and caches.
async fn sqlx_single_raw(b: &Bench, iters: u64) -> Duration {
    use sqlx::Connection as _;
    let mut conn = b.sqlx.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let mut tx = conn.begin().await.expect("begin");
        sqlx::query(RAW_LOCK)
            .bind(key)
            .execute(&mut *tx)
            .await
            .expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn diesel_async_single_lockkit(b: &Bench, iters: u64) -> Duration {
    diesel_async_single(b, &b.diesel_async_locker, iters).await
}

async fn diesel_async_single_lockkit_prepared(b: &Bench, iters: u64) -> Duration {
    diesel_async_single(b, &b.diesel_async_locker_prepared, iters).await
}

async fn diesel_async_single(
    b: &Bench,
    // The closure's future must be `Send`: it borrows the locker, not `b`.
    locker: &lockkit_diesel_async::Locker,
    iters: u64,
) -> Duration {
    use diesel_async::AsyncConnection as _;
    let mut conn = b.diesel_async.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        conn.transaction::<_, Error, _>(async |conn| {
            let mut tx = locker.lock_tx(conn)?;
            let held = tx.lock(Item { id }).await?;
            black_box(&held);
            Ok(())
        })
        .await
        .expect("lockkit-diesel-async transaction");
    }
    start.elapsed()
}

/// What a diesel-async user writes: `sql_query` in `conn.transaction`.
async fn diesel_async_single_raw(b: &Bench, iters: u64) -> Duration {
    use diesel_async::AsyncConnection as _;
    let mut conn = b.diesel_async.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        conn.transaction::<_, diesel::result::Error, _>(async |conn| {
            diesel_async::RunQueryDsl::execute(sql_query(RAW_LOCK).bind::<BigInt, _>(key), conn)
                .await
        })
        .await
        .expect("raw diesel-async transaction");
    }
    start.elapsed()
}

// ---- multiplexed session locks -------------------------------------------

/// One `try_lock` of a free key then its `release`, through `sessions`.
async fn mux_try_release(b: &Bench, sessions: &SessionLock, first: i64, iters: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        let id = first + b.feed_index();
        let guard = sessions
            .try_lock(Feed { id })
            .await
            .expect("try_lock")
            .expect("a free key");
        let was_held = guard.release().await.expect("release");
        assert!(was_held);
    }
    start.elapsed()
}

/// Through the `SessionLock` that holds nothing else.
async fn mux_try_release_alone(b: &Bench, iters: u64) -> Duration {
    mux_try_release(b, &b.sessions, FEED_MUX, iters).await
}

/// Through the `SessionLock` that prepares its statements.
async fn mux_try_release_prepared(b: &Bench, iters: u64) -> Duration {
    mux_try_release(b, &b.sessions_prepared, FEED_MUX_PREPARED, iters).await
}

/// Through the `SessionLock` that holds [`MUX_HELD`] other keys.
async fn mux_try_release_loaded(b: &Bench, iters: u64) -> Duration {
    mux_try_release(b, &b.sessions_loaded, FEED_LOADED, iters).await
}

/// The same by hand: `pg_try_advisory_lock($1)` then
/// `pg_advisory_unlock($1)`, prepared once, on an open connection (inside
/// its held transaction).
async fn raw_session_try_release(b: &Bench, iters: u64) -> Duration {
    let client = &b.session_client;
    let start = Instant::now();
    for _ in 0..iters {
        let key = b.feed_raw[b.feed_index() as usize];
        let row = client.query_one(&b.try_lock, &[&key]).await.expect("try");
        assert!(row.get::<_, bool>(0), "a free key");
        let row = client.query_one(&b.unlock, &[&key]).await.expect("unlock");
        assert!(row.get::<_, bool>(0));
    }
    start.elapsed()
}

// ---- batch_64 ------------------------------------------------------------

async fn batch_lockkit(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch64[(i % BATCHES as u64) as usize];
        let tx = begin!(b, client, prepared);
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
    batch_by_hand(b, iters, &b.lock_unnest).await
}

/// lockkit's earlier batch statement, `unnest` in `FROM` (diagnostic).
async fn batch_raw_function_scan(b: &Bench, iters: u64) -> Duration {
    batch_by_hand(b, iters, &b.lock_function_scan).await
}

/// 64 keys in one batch statement `lock`, prepared by hand, per transaction.
async fn batch_by_hand(b: &Bench, iters: u64, lock: &Statement) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw64[(i % BATCHES as u64) as usize];
        let tx = client.transaction().await.expect("begin");
        tx.execute(lock, &[keys]).await.expect("lock");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

// ---- pipelined -----------------------------------------------------------

async fn insert_no_locks(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for _ in 0..iters {
        let tx = client.transaction().await.expect("begin");
        tx.execute(&b.insert, &[&b.row_id()]).await.expect("insert");
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

async fn insert_lockkit_pipelined(b: &Bench, iters: u64, prepared: bool) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch16[(i % BATCHES as u64) as usize];
        let tx = begin!(b, client, prepared);
        let (held, n) = tokio::try_join!(tx.lock_batch(batch), async {
            Ok::<_, Error>(tx.execute(&b.insert, &[&b.row_id()]).await?)
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
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw16[(i % BATCHES as u64) as usize];
        let id = b.row_id();
        let params: [&(dyn ToSql + Sync); 1] = [&id];
        let lock_params: [&(dyn ToSql + Sync); 1] = [keys];
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

/// `SELECT 1` pipelined with the INSERT (diagnostic): what any second
/// statement in the pipeline costs, the floor of the pipelined comparison.
async fn insert_noop_pipelined(b: &Bench, iters: u64) -> Duration {
    let mut client = b.client.lock().await;
    let start = Instant::now();
    for _ in 0..iters {
        let id = b.row_id();
        let params: [&(dyn ToSql + Sync); 1] = [&id];
        let tx = client.transaction().await.expect("begin");
        let n = tokio::try_join!(tx.execute(&b.noop, &[]), tx.execute(&b.insert, &params))
            .expect("select and insert");
        black_box(n);
        tx.commit().await.expect("commit");
    }
    start.elapsed()
}

// ---- diesel --------------------------------------------------------------

/// Raw Diesel: `SELECT pg_advisory_xact_lock($1)`, sent unprepared (Diesel
/// never caches `sql_query` statements; lockkit-diesel's own statements go
/// through Diesel's statement cache).
fn diesel_raw_lock(conn: &mut PgConnection, key: i64) -> diesel::QueryResult<usize> {
    sql_query(RAW_LOCK).bind::<BigInt, _>(key).execute(conn)
}

fn diesel_insert(b: &Bench, conn: &mut PgConnection, id: i64) -> diesel::QueryResult<usize> {
    sql_query(&b.insert_sql).bind::<BigInt, _>(id).execute(conn)
}

fn diesel_single_lockkit(b: &Bench, iters: u64) -> Duration {
    diesel_single(b, &b.diesel_locker, iters)
}

fn diesel_single_lockkit_prepared(b: &Bench, iters: u64) -> Duration {
    diesel_single(b, &b.diesel_locker_prepared, iters)
}

fn diesel_single(b: &Bench, locker: &lockkit_diesel::Locker, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let id = (i % RING as u64) as i64;
        locker
            .transaction(conn, |tx| {
                let held = tx.lock(Item { id })?;
                black_box(&held);
                Ok::<_, Error>(())
            })
            .expect("lockkit-diesel transaction");
    }
    start.elapsed()
}

fn diesel_single_raw(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        conn.transaction(|c| diesel_raw_lock(c, key))
            .expect("raw diesel transaction");
    }
    start.elapsed()
}

/// lockkit's one-key statement sent by hand in raw Diesel, its row read
/// (diagnostic).
fn diesel_single_tagged(b: &Bench, iters: u64) -> Duration {
    #[derive(diesel::QueryableByName)]
    struct Tagged {
        #[diesel(sql_type = BigInt)]
        tag: i64,
    }
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let key = b.keys[(i % RING as u64) as usize];
        let row: Tagged = conn
            .transaction(|c| {
                sql_query(sql::LOCK_BIGINT)
                    .bind::<BigInt, _>(key)
                    .get_result(c)
            })
            .expect("raw diesel transaction");
        black_box(row.tag);
    }
    start.elapsed()
}

fn diesel_batch_lockkit(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch64[(i % BATCHES as u64) as usize];
        b.diesel_locker
            .transaction(conn, |tx| {
                let held = tx.lock_batch(batch)?;
                black_box(&held);
                Ok::<_, Error>(())
            })
            .expect("lockkit-diesel transaction");
    }
    start.elapsed()
}

fn diesel_batch_raw_sequential(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw64[(i % BATCHES as u64) as usize];
        conn.transaction(|c| {
            for &key in keys {
                diesel_raw_lock(c, key)?;
            }
            Ok::<_, diesel::result::Error>(())
        })
        .expect("raw diesel transaction");
    }
    start.elapsed()
}

fn diesel_insert_no_locks(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for _ in 0..iters {
        conn.transaction(|c| diesel_insert(b, c, b.row_id()))
            .expect("raw diesel transaction");
    }
    start.elapsed()
}

/// The 16-key batch, then the INSERT: Diesel cannot pipeline them.
fn diesel_insert_lockkit(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let batch = &b.batch16[(i % BATCHES as u64) as usize];
        b.diesel_locker
            .transaction(conn, |tx| {
                let held = tx.lock_batch(batch)?;
                let n = diesel_insert(b, tx.conn(), b.row_id())?;
                black_box((&held, n));
                Ok::<_, Error>(())
            })
            .expect("lockkit-diesel transaction");
    }
    start.elapsed()
}

/// The same in raw Diesel, lockkit's batch statement sent by hand
/// (diagnostic: lockkit-diesel's own cost next to the statement's).
fn diesel_insert_raw_batch(b: &Bench, iters: u64) -> Duration {
    let conn = &mut *b.diesel.borrow_mut();
    let start = Instant::now();
    for i in 0..iters {
        let keys = &b.raw16[(i % BATCHES as u64) as usize];
        conn.transaction(|c| {
            sql_query(sql::BATCH_BIGINT_EXCLUSIVE)
                .bind::<Array<BigInt>, _>(keys)
                .execute(c)?;
            diesel_insert(b, c, b.row_id())
        })
        .expect("raw diesel transaction");
    }
    start.elapsed()
}

/// lockkit's routines with their statements sent unnamed (`_unnamed`, the
/// default mode) or prepared on the connection (`_prepared`).
macro_rules! variants {
    ($($f:ident => $unnamed:ident, $prepared:ident;)*) => {$(
        async fn $unnamed(b: &Bench, iters: u64) -> Duration {
            $f(b, iters, false).await
        }
        async fn $prepared(b: &Bench, iters: u64) -> Duration {
            $f(b, iters, true).await
        }
    )*};
}
variants! {
    single_lockkit_tx => single_lockkit_tx_unnamed, single_lockkit_tx_prepared;
    single_lockkit_call => single_lockkit_call_unnamed, single_lockkit_call_prepared;
    batch_lockkit => batch_lockkit_unnamed, batch_lockkit_prepared;
    insert_lockkit_pipelined => insert_lockkit_pipelined_unnamed, insert_lockkit_pipelined_prepared;
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

/// A blocking (Diesel) routine.
type Blocking = fn(&Bench, u64) -> Duration;

/// One side of a comparison.
#[derive(Clone, Copy)]
enum Side {
    Async(Routine),
    Blocking(Blocking),
}

impl Side {
    fn run(self, rt: &Runtime, bench: &Bench, iters: u64) -> Duration {
        match self {
            Side::Async(r) => rt.block_on(r(bench, iters)),
            Side::Blocking(f) => f(bench, iters),
        }
    }
}

/// Whether only the paired report runs (`LOCKKIT_BENCH_PAIRED_ONLY=1`).
fn paired_only() -> bool {
    std::env::var_os("LOCKKIT_BENCH_PAIRED_ONLY").is_some_and(|v| v != "0")
}

fn group(c: &mut Criterion, rt: &Runtime, bench: &Bench, name: &str, cases: &[(&str, Side)]) {
    let mut group = c.benchmark_group(name);
    // Short: the paired report is what the targets are checked against.
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for &(id, side) in cases {
        group.bench_function(id, |b| match side {
            Side::Async(routine) => b.to_async(rt).iter_custom(|iters| routine(bench, iters)),
            Side::Blocking(f) => b.iter_custom(|iters| f(bench, iters)),
        });
    }
    group.finish();
}

fn locks(c: &mut Criterion, rt: &Runtime, bench: &Bench) {
    use Side::{Async, Blocking};
    group(
        c,
        rt,
        bench,
        "single_lock",
        &[
            (
                "lockkit_tx_prepared",
                Async(routine!(single_lockkit_tx_prepared)),
            ),
            (
                "lockkit_tx_unnamed",
                Async(routine!(single_lockkit_tx_unnamed)),
            ),
            ("raw_tx", Async(routine!(single_raw_tx))),
            (
                "lockkit_call_prepared",
                Async(routine!(single_lockkit_call_prepared)),
            ),
            (
                "lockkit_call_unnamed",
                Async(routine!(single_lockkit_call_unnamed)),
            ),
            ("raw_call", Async(routine!(single_raw_call))),
        ],
    );
    group(
        c,
        rt,
        bench,
        "batch_64",
        &[
            (
                "lockkit_batch_prepared",
                Async(routine!(batch_lockkit_prepared)),
            ),
            (
                "lockkit_batch_unnamed",
                Async(routine!(batch_lockkit_unnamed)),
            ),
            ("raw_sequential", Async(routine!(batch_raw_sequential))),
            (
                "raw_unnest_prepared",
                Async(routine!(batch_raw_unnest_prepared)),
            ),
        ],
    );
    group(
        c,
        rt,
        bench,
        "pipelined",
        &[
            ("no_locks", Async(routine!(insert_no_locks))),
            (
                "lockkit_pipelined_prepared",
                Async(routine!(insert_lockkit_pipelined_prepared)),
            ),
            (
                "lockkit_pipelined_unnamed",
                Async(routine!(insert_lockkit_pipelined_unnamed)),
            ),
            (
                "raw_pipelined_prepared",
                Async(routine!(insert_raw_pipelined_prepared)),
            ),
        ],
    );
    group(
        c,
        rt,
        bench,
        "diesel",
        &[
            ("single_lockkit", Blocking(diesel_single_lockkit)),
            ("single_raw", Blocking(diesel_single_raw)),
            ("batch_64_lockkit", Blocking(diesel_batch_lockkit)),
            (
                "batch_64_raw_sequential",
                Blocking(diesel_batch_raw_sequential),
            ),
            ("insert_lockkit_batch_16", Blocking(diesel_insert_lockkit)),
            ("insert_raw_batch_16", Blocking(diesel_insert_raw_batch)),
            ("insert_no_locks", Blocking(diesel_insert_no_locks)),
        ],
    );
    group(
        c,
        rt,
        bench,
        "adapters",
        &[
            ("sqlx_single_lockkit", Async(routine!(sqlx_single_lockkit))),
            ("sqlx_single_raw", Async(routine!(sqlx_single_raw))),
            (
                "diesel_async_single_lockkit",
                Async(routine!(diesel_async_single_lockkit)),
            ),
            (
                "diesel_async_single_raw",
                Async(routine!(diesel_async_single_raw)),
            ),
        ],
    );
}

/// One comparison of the paired report: `lockkit` against `baseline`, and
/// the target for `lockkit / baseline` (or `baseline / lockkit` when
/// `speedup`); `None` for the diagnostic rows.
struct Pair {
    name: &'static str,
    lockkit: Side,
    baseline: Side,
    speedup: bool,
    target: Option<f64>,
    /// Run on the durable server (see [`durable_server`]), not the harness's.
    durable: bool,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Alternates the two sides transaction by transaction and prints the ratio
/// of their medians.
fn paired_report(rt: &Runtime, bench: &Bench, rounds: usize) {
    use Side::{Async, Blocking};
    let pair = |name, lockkit, baseline, speedup, target| Pair {
        name,
        lockkit,
        baseline,
        speedup,
        target,
        durable: false,
    };
    let durable = |name, lockkit, baseline| Pair {
        name,
        lockkit,
        baseline,
        speedup: false,
        target: None,
        durable: true,
    };
    let pairs = [
        // The one-lock transaction on every stack in the default mode
        // (StatementMode::Unnamed: safe behind every pooler; the server
        // parses each statement) and in the fastest (Prepared), each against
        // what the stack's users write by hand.
        pair(
            "tp: one lock, default (unnamed)",
            Async(routine!(single_lockkit_tx_unnamed)),
            Async(routine!(single_raw_tx)),
            false,
            Some(1.05),
        ),
        pair(
            "tp: one lock, Prepared",
            Async(routine!(single_lockkit_tx_prepared)),
            Async(routine!(single_raw_tx)),
            false,
            Some(1.05),
        ),
        pair(
            "tp: 16-key batch pipelined with INSERT",
            Async(routine!(insert_lockkit_pipelined_prepared)),
            Async(routine!(insert_no_locks)),
            false,
            Some(1.20),
        ),
        pair(
            "tp: 64-key batch vs 64 statements",
            Async(routine!(batch_lockkit_prepared)),
            Async(routine!(batch_raw_sequential)),
            true,
            Some(10.0),
        ),
        pair(
            "diesel: one lock, default (unnamed)",
            Blocking(diesel_single_lockkit),
            Blocking(diesel_single_raw),
            false,
            Some(1.05),
        ),
        pair(
            "diesel: one lock, Prepared",
            Blocking(diesel_single_lockkit_prepared),
            Blocking(diesel_single_raw),
            false,
            Some(1.05),
        ),
        pair(
            "diesel: 16-key batch, then INSERT",
            Blocking(diesel_insert_lockkit),
            Blocking(diesel_insert_no_locks),
            false,
            Some(1.20),
        ),
        pair(
            "diesel: 64-key batch vs 64 statements",
            Blocking(diesel_batch_lockkit),
            Blocking(diesel_batch_raw_sequential),
            true,
            Some(10.0),
        ),
        pair(
            "sqlx: one lock, default (unnamed)",
            Async(routine!(sqlx_single_lockkit)),
            Async(routine!(sqlx_single_raw)),
            false,
            Some(1.05),
        ),
        pair(
            "sqlx: one lock, Prepared",
            Async(routine!(sqlx_single_lockkit_prepared)),
            Async(routine!(sqlx_single_raw)),
            false,
            Some(1.05),
        ),
        pair(
            "diesel-async: one lock, default (savepoint-guarded name)",
            Async(routine!(diesel_async_single_lockkit)),
            Async(routine!(diesel_async_single_raw)),
            false,
            Some(1.05),
        ),
        pair(
            "diesel-async: one lock, Prepared",
            Async(routine!(diesel_async_single_lockkit_prepared)),
            Async(routine!(diesel_async_single_raw)),
            false,
            Some(1.05),
        ),
        // A multiplexed session lock's try and release, against the two
        // statements by hand (prepared, on an open connection inside a
        // held transaction); then with 1,000 other keys held on the same
        // connections, against none held.
        pair(
            "multiplexed try+release",
            Async(routine!(mux_try_release_alone)),
            Async(routine!(raw_session_try_release)),
            false,
            Some(1.10),
        ),
        pair(
            "multiplexed try+release, Prepared",
            Async(routine!(mux_try_release_prepared)),
            Async(routine!(raw_session_try_release)),
            false,
            Some(1.10),
        ),
        pair(
            "multiplexed try+release with 1,000 held",
            Async(routine!(mux_try_release_loaded)),
            Async(routine!(mux_try_release_alone)),
            false,
            Some(1.20),
        ),
        // The same two INSERT comparisons on a server with PostgreSQL's
        // default durability, where each COMMIT waits for its WAL flush
        // (context, not the target: the flush's cost is this machine's
        // disk's, and drowns the locks' cost).
        durable(
            "durable: tp 16-key pipelined with INSERT",
            Async(routine!(insert_lockkit_pipelined_prepared)),
            Async(routine!(insert_no_locks)),
        ),
        durable(
            "durable: diesel 16-key, then INSERT",
            Blocking(diesel_insert_lockkit),
            Blocking(diesel_insert_no_locks),
        ),
        // Diagnostics: where the time goes.
        pair(
            "tp: control, the raw side against itself",
            Async(routine!(single_raw_tx)),
            Async(routine!(single_raw_tx)),
            false,
            None,
        ),
        pair(
            "tp: one lock vs its statement by hand",
            Async(routine!(single_lockkit_tx_prepared)),
            Async(routine!(single_tagged_tx)),
            false,
            None,
        ),
        pair(
            "tp: lockkit's statement vs the plain one",
            Async(routine!(single_tagged_tx)),
            Async(routine!(single_raw_tx)),
            false,
            None,
        ),
        pair(
            "tp: lockkit's statement vs its text-tagged form",
            Async(routine!(single_tagged_tx)),
            Async(routine!(single_text_tagged_tx)),
            false,
            None,
        ),
        pair(
            "diesel: one lock vs its statement by hand",
            Blocking(diesel_single_lockkit),
            Blocking(diesel_single_tagged),
            false,
            None,
        ),
        pair(
            "diesel: lockkit's statement vs the plain",
            Blocking(diesel_single_tagged),
            Blocking(diesel_single_raw),
            false,
            None,
        ),
        pair(
            "tp: one lock, the call alone",
            Async(routine!(single_lockkit_call_prepared)),
            Async(routine!(single_raw_call)),
            false,
            None,
        ),
        // The floor of the default mode: the same plain statement unnamed,
        // against it prepared.
        pair(
            "floor: tp plain statement, unnamed vs prepared",
            Async(routine!(single_raw_unnamed_tx)),
            Async(routine!(single_raw_tx)),
            false,
            None,
        ),
        pair(
            "floor: tp plain statement, simple query vs prepared",
            Async(routine!(single_raw_simple_tx)),
            Async(routine!(single_raw_tx)),
            false,
            None,
        ),
        pair(
            "floor: sqlx plain statement, unnamed vs prepared",
            Async(routine!(sqlx_single_raw_unnamed)),
            Async(routine!(sqlx_single_raw)),
            false,
            None,
        ),
        pair(
            "tp: one lock minting a fencing token vs without",
            Async(routine!(single_lockkit_tx_minting)),
            Async(routine!(single_lockkit_tx_unnamed)),
            false,
            Some(1.05),
        ),
        pair(
            "tp: one lock, default (unnamed) vs Prepared",
            Async(routine!(single_lockkit_tx_unnamed)),
            Async(routine!(single_lockkit_tx_prepared)),
            false,
            None,
        ),
        pair(
            "tp: 16-key pipelined vs by hand",
            Async(routine!(insert_lockkit_pipelined_prepared)),
            Async(routine!(insert_raw_pipelined_prepared)),
            false,
            None,
        ),
        pair(
            "tp: 64 keys by hand, unnest in the target list vs in FROM",
            Async(routine!(batch_raw_unnest_prepared)),
            Async(routine!(batch_raw_function_scan)),
            false,
            None,
        ),
        pair(
            "tp: 64-key batch vs its statement by hand",
            Async(routine!(batch_lockkit_prepared)),
            Async(routine!(batch_raw_unnest_prepared)),
            false,
            None,
        ),
        pair(
            "tp: 16-key by hand vs no locks",
            Async(routine!(insert_raw_pipelined_prepared)),
            Async(routine!(insert_no_locks)),
            false,
            None,
        ),
        pair(
            "tp: SELECT 1 pipelined vs no locks",
            Async(routine!(insert_noop_pipelined)),
            Async(routine!(insert_no_locks)),
            false,
            None,
        ),
        pair(
            "tp: 16-key pipelined, unnamed",
            Async(routine!(insert_lockkit_pipelined_unnamed)),
            Async(routine!(insert_no_locks)),
            false,
            None,
        ),
        pair(
            "diesel: 16-key batch vs by hand",
            Blocking(diesel_insert_lockkit),
            Blocking(diesel_insert_raw_batch),
            false,
            None,
        ),
        pair(
            "diesel: 16-key by hand vs INSERT alone",
            Blocking(diesel_insert_raw_batch),
            Blocking(diesel_insert_no_locks),
            false,
            None,
        ),
    ];
    println!(
        "\npaired report ({rounds} alternating transactions per side; tp = tokio-postgres, \
         LockClient::begin)"
    );
    println!(
        "{:<40} {:>11} {:>12} {:>8} {:>8}  {:<3} {:>10}",
        "comparison", "lockkit µs", "baseline µs", "ratio", "target", "met", "client CPU µs"
    );
    // `LOCKKIT_BENCH_ONLY=diesel` runs the comparisons whose name has it.
    let only = std::env::var("LOCKKIT_BENCH_ONLY").unwrap_or_default();
    let mut durable_bench = None;
    for pair in pairs.iter().filter(|p| p.name.contains(only.as_str())) {
        let bench = match pair.durable {
            false => bench,
            // Started when a durable row first runs; the bench's
            // connections drop before the server (tuple order).
            true => {
                &durable_bench
                    .get_or_insert_with(|| {
                        let server = durable_server();
                        (rt.block_on(Bench::new(&server)), server)
                    })
                    .0
            }
        };
        let (mut a, mut b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
        // This thread's CPU time on each side (the runtime is
        // current-thread, so the connection task's work is in it too).
        let (mut cpu_a, mut cpu_b) = (Some(0u64), Some(0u64));
        let add = |sum: &mut Option<u64>, from: Option<u64>, to: Option<u64>| {
            *sum = sum.zip(from.zip(to)).map(|(s, (f, t))| s + (t - f));
        };
        // The order alternates too: the side that runs first after the
        // other one pays more (the control row, one routine against itself,
        // showed 1.01× and 10 % more client CPU for the first side).
        for round in 0..rounds {
            let c0 = thread_cpu_ns();
            if round % 2 == 0 {
                a.push(pair.lockkit.run(rt, bench, 1));
                let c1 = thread_cpu_ns();
                b.push(pair.baseline.run(rt, bench, 1));
                let c2 = thread_cpu_ns();
                add(&mut cpu_a, c0, c1);
                add(&mut cpu_b, c1, c2);
            } else {
                b.push(pair.baseline.run(rt, bench, 1));
                let c1 = thread_cpu_ns();
                a.push(pair.lockkit.run(rt, bench, 1));
                let c2 = thread_cpu_ns();
                add(&mut cpu_b, c0, c1);
                add(&mut cpu_a, c1, c2);
            }
        }
        let cpu = match (cpu_a, cpu_b) {
            (Some(x), Some(y)) => format!(
                "{:.1} / {:.1}",
                x as f64 / 1e3 / rounds as f64,
                y as f64 / 1e3 / rounds as f64
            ),
            _ => String::new(),
        };
        let (a, b) = (median(a), median(b));
        let ratio = if pair.speedup {
            b.as_secs_f64() / a.as_secs_f64()
        } else {
            a.as_secs_f64() / b.as_secs_f64()
        };
        let op = if pair.speedup { "≥" } else { "≤" };
        let (target, met) = match pair.target {
            Some(t) if pair.speedup => (format!("{op}{t:>5.2}×"), yes(ratio >= t)),
            Some(t) => (format!("{op}{t:>5.2}×"), yes(ratio <= t)),
            None => (String::new(), ""),
        };
        println!(
            "{:<40} {:>11.1} {:>12.1} {:>7.2}× {:>8}  {:<3} {:>13}",
            pair.name,
            a.as_secs_f64() * 1e6,
            b.as_secs_f64() * 1e6,
            ratio,
            target,
            met,
            cpu
        );
    }
}

/// A server of its own with PostgreSQL's default durability (`fsync`,
/// `synchronous_commit` and `full_page_writes` on, where the harness turns
/// them off to make tests fast): a commit that wrote waits for its WAL to
/// reach the disk, as in production.
fn durable_server() -> TestServer {
    TestServer::builder()
        .setting("fsync", "on")
        .setting("synchronous_commit", "on")
        .setting("full_page_writes", "on")
        .start()
}

/// The CPU time this thread has run, in nanoseconds (Linux's
/// `/proc/thread-self/schedstat`; `None` elsewhere).
fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn yes(met: bool) -> &'static str {
    if met {
        "yes"
    } else {
        "NO"
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
    let bench = rt.block_on(Bench::new(TestServer::shared()));
    // A real benchmark run (`cargo bench`), not `cargo test --benches`.
    let bench_run = std::env::args().any(|a| a == "--bench");
    if !(bench_run && paired_only()) {
        locks(&mut c, &rt, &bench);
        c.final_summary();
    }
    if bench_run {
        let rounds = std::env::var("LOCKKIT_BENCH_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(2000);
        paired_report(&rt, &bench, rounds);
    }
    rt.block_on(bench.drop_table());
}
