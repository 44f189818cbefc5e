//! One client of the fleet test (`tests/fleet`): a process that plays one
//! role against a shared transaction-mode pgbouncer until a deadline.
//!
//! `fleet-worker <role> <url> <seconds> <seed>`, with `role` one of:
//!
//! | role | what it does |
//! | --- | --- |
//! | `tp` | tokio-postgres `LockClient`, `Config::default()`: locks, batches, tries, `_timeout` calls, permits |
//! | `sqlx` | lockkit-sqlx `Locker::transaction` on a default `PgPool` |
//! | `diesel` | lockkit-diesel `Locker::transaction` on a default r2d2 pool |
//! | `diesel-async` | lockkit-diesel-async `Locker::transaction` on a deadpool pool of `lockkit_diesel_async::establish` connections |
//! | `session` | default-form `SessionLock`: lock, try, timeout, permits |
//! | `session-pool` | the same on connections leased from a deadpool-postgres pool (`SessionLock::from_pool`) |
//! | `mux` | `SessionForm::Multiplexed`: lock, try, timeout, two keys at once |
//! | `foreign-tp` | tokio-postgres without lockkit: its own named statements, some never closed |
//! | `foreign-sqlx` | a sqlx pool without lockkit: its own persistent statements |
//! | `sql` | plain SQL through `lockkit.key(...)` (the functions `lockkit::sql::install` put there) |
//! | `naive` | the control: the read-modify-write without any lock |
//! | `tp-prepared` | the control: `tp` with `StatementMode::Prepared` |
//! | `leaky` | the control: `pg_advisory_lock` through the pooler, some never unlocked |
//!
//! Every role that takes locks takes `Account` keys `0..KEYS` and, for
//! each key it holds exclusively, reads the key's counter row, then writes
//! it plus one and logs the write (`rmw_sql`): inside the locking
//! transaction for transaction locks, on a second connection for session
//! locks. A lost update (two holders at once) leaves the counter below the
//! number of log rows. The pooled roles check every connection their pool
//! hands out with the two statements of `tests/conformance/handoff.rs`'s
//! `PROBE`, in simple-protocol form (`PROBE_SET`, `PROBE_CHECK`).
//!
//! Output, on stdout, one JSON object a line: `{"unexpected": …}` at once
//! for each unexpected error, `{"harmed": …}` at once for each error of a
//! foreign role that lockkit may have caused (`lockkit_tests::harm`: the
//! pooler refused it or was gone, or a transaction took longer than
//! `harm::HOSTAGE_BOUND`), and every second and at the end (with
//! `"final": true`) the cumulative counts (`Tally`). A worker killed
//! with SIGKILL has printed every unexpected error it met and its counts of
//! the last second.

use std::num::NonZeroU8;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, Error, LockClient, Locker, StatementMode};
use lockkit_tests::harm;
use serde_json::json;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};

/// The fleet's keys: every role takes `Account { id }` for `id` in
/// `0..KEYS`, through its own stack or through SQL.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/fleet")]
struct Account {
    id: i64,
}

/// The semaphore every role's permits are taken on.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/fleet-quota")]
struct Quota {
    id: i64,
}

/// How many [`Account`] keys the fleet shares (the test creates their
/// counter rows).
const KEYS: i64 = 16;

/// The namespace of [`Account`], as `lockkit.key` takes it.
const NAMESPACE: &str = "lockkit-tests/fleet";

/// The one semaphore's key and size.
const QUOTA: Quota = Quota { id: 0 };

/// Permits of [`QUOTA`].
const PERMITS: NonZeroU8 = match NonZeroU8::new(3) {
    Some(n) => n,
    None => unreachable!(),
};

/// The bound of the `_timeout` calls: short, so some expire.
const TIMED: Duration = Duration::from_millis(30);
/// How long a session lock's holder waits for the server connection of its
/// critical section's writes before it lets its locks go.
const SERVER_WAIT: Duration = Duration::from_secs(3);

/// The first statement of the hand-off check: a setting for the rest of
/// the transaction (`tests/conformance/handoff.rs`, `PROBE`), sent in the
/// simple protocol so that it is one round trip on one backend behind the
/// pooler.
const PROBE_SET: &str = "SELECT set_config('lockkit_tests.handoff', 'inside', true)";

/// The second: fails when the setting is still there, that is when the
/// connection was handed out inside a transaction.
const PROBE_CHECK: &str = "DO $$ BEGIN \
     IF coalesce(current_setting('lockkit_tests.handoff', true), '') <> '' THEN \
     RAISE EXCEPTION 'fleet: the connection was handed out inside a transaction'; \
     END IF; END $$";

/// The text [`PROBE_CHECK`] fails with.
const HANDED_IN_TRANSACTION: &str = "handed out inside a transaction";

/// The counts a worker prints. Each field is cumulative.
#[derive(Default)]
struct Tally {
    /// Transactions (or session-lock critical sections) that locked keys
    /// and committed their writes.
    txs: AtomicU64,
    /// Keys locked exclusively (a batch counts each key).
    locks: AtomicU64,
    /// Permits taken.
    permits: AtomicU64,
    /// Tries that found the key (or every slot) busy.
    busy: AtomicU64,
    /// Timeouts of `_timeout` calls and of tries behind the busy pooler.
    timeouts: AtomicU64,
    /// Connections lost (a terminated backend), after which the worker
    /// carries on.
    lost: AtomicU64,
    /// Errors of no expected cause.
    unexpected: AtomicU64,
    /// diesel-async only, and only the application's own statement (its
    /// read of the counter, an [`OwnRead`]), never lockkit's, nor
    /// diesel-async's connection set-up, which `lockkit_diesel_async::
    /// establish` runs: a statement name (diesel-async names every statement,
    /// `s0`, `s1`, … per process) that another process left on the server
    /// connection, `42P05`, or a name missing there, `26000`. What the
    /// README's pooler section and lockkit-diesel-async's docs say of an
    /// application's own diesel-async statements (pgbouncer 1.21+ with
    /// `max_prepared_statements` is the fix). Counted apart; a clash of
    /// lockkit's own statements is unexpected.
    clashes: AtomicU64,
    /// Pooled connections checked for a transaction at hand-out.
    probes: AtomicU64,
    /// Errors of the foreign roles, whose own named statements meet the
    /// pooler, or whose backend the runner terminated: counted, not a
    /// lockkit failure.
    foreign: AtomicU64,
    /// Errors of the foreign roles that lockkit may have caused
    /// (`lockkit_tests::harm`): the pooler refused them or was gone, or one
    /// of their transactions took longer than `harm::HOSTAGE_BOUND`.
    harmed: AtomicU64,
    /// The foreign roles' longest transaction, first statement (connection
    /// from the pool included) to the commit's reply, in milliseconds.
    longest_ms: AtomicU64,
}

/// Why an error happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    /// A `_timeout` call's bound, or a try behind the busy pooler.
    Timeout,
    /// The connection ended under the call (a terminated backend).
    Lost,
    /// The diesel-async application's own statement names met another
    /// process's ([`Tally::clashes`]).
    Clash,
    /// Anything else: a failure.
    Unexpected,
}

/// Texts of the errors a terminated backend (or the closed client
/// connection pgbouncer answers it with) gives, on drivers that carry no
/// SQLSTATE for it.
const LOST_TEXTS: [&str; 12] = [
    "terminating connection due to administrator command",
    "connection closed",
    "server closed the connection",
    "broken pipe",
    "connection reset",
    "unexpected eof",
    "server conn crashed",
    "no connection to the server",
    "connection to server was lost",
    "error communicating with database",
    // pgbouncer's `FATAL` errors when the server connection ended under it
    // (in a pool's set-up of a new connection, whose error the pool wraps).
    "invalid server parameter",
    "server conn crashed?",
];

/// Texts of the errors of the roles' own pools (r2d2, deadpool) when the
/// pooler gave them no server connection within the pool's bound: a wait
/// that ran out behind the saturated pooler, like lockkit's `Timeout`.
const POOL_TIMEOUT_TEXTS: [&str; 2] = [
    "timed out waiting for connection",
    "timeout occurred while waiting for a slot",
];

/// `e` and its sources, as one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Whether `e` is a named statement's clash or absence (`42P05`,
/// `26000`), by its SQLSTATE or, from Diesel's errors, which carry none,
/// by the server's message.
fn is_name_clash(e: &Error) -> bool {
    // 22P03 and 08P01: a name bound on another server connection, where
    // it is another statement, with other parameter types or counts.
    if matches!(e.code(), Some("42P05" | "26000" | "22P03" | "08P01")) {
        return true;
    }
    let text = chain(e);
    (text.contains("prepared statement \"s")
        && (text.contains("already exists") || text.contains("does not exist")))
        || text.contains("bind message supplies")
        || text.contains("incorrect binary data format")
}

/// The cause of a lockkit error (driver errors converted into one).
fn classify(e: &Error) -> Cause {
    if e.is_timeout() {
        return Cause::Timeout;
    }
    if e.is_connection_lost() {
        return Cause::Lost;
    }
    if let Some(code) = e.code() {
        if code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03") {
            return Cause::Lost;
        }
    }
    let text = format!("{}: {:?}", chain(e), e).to_lowercase();
    if text.contains(HANDED_IN_TRANSACTION) {
        return Cause::Unexpected;
    }
    if LOST_TEXTS.iter().any(|t| text.contains(t)) {
        Cause::Lost
    } else if POOL_TIMEOUT_TEXTS.iter().any(|t| text.contains(t)) {
        Cause::Timeout
    } else {
        Cause::Unexpected
    }
}

impl Tally {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts `e` by its cause, printing an unexpected one at once with
    /// `what` (where it happened).
    fn error(&self, role: &str, what: &str, e: &Error) -> Cause {
        let mut cause = classify(e);
        // Only the diesel-async application's own read ([`OwnRead`]) may
        // meet another process's statement name: a clash anywhere else
        // (lockkit's statements on any stack, diesel-async's set-up in
        // `lockkit_diesel_async::establish`, lockkit-sqlx's `Locker::new`)
        // is lockkit's, and unexpected.
        if cause == Cause::Unexpected && is_own_read(e) && is_name_clash(e) {
            cause = Cause::Clash;
        }
        match cause {
            Cause::Clash => Self::add(&self.clashes, 1),
            Cause::Timeout => Self::add(&self.timeouts, 1),
            Cause::Lost => Self::add(&self.lost, 1),
            Cause::Unexpected => self.unexpected(role, &format!("{what}: {}: {e:?}", chain(e))),
        }
        cause
    }

    /// Counts and prints an unexpected failure.
    fn unexpected(&self, role: &str, message: &str) {
        Self::add(&self.unexpected, 1);
        println!("{}", json!({ "role": role, "unexpected": message }));
    }

    /// Counts an error of a foreign role: lockkit's doing
    /// ([`Tally::harmed`], printed at once with `what`) when
    /// `lockkit_tests::harm` says so, else the application's own.
    fn foreign_error(&self, role: &str, what: &str, text: &str) {
        match harm::caused_by_lockkit(text) {
            Some(cause) => {
                Self::add(&self.harmed, 1);
                println!(
                    "{}",
                    json!({ "role": role, "harmed": format!("{cause}: {what}: {text}") })
                );
            }
            None => Self::add(&self.foreign, 1),
        }
    }

    /// Times a foreign role's transaction that took `took`: past
    /// `harm::HOSTAGE_BOUND`, it was held hostage ([`Tally::harmed`]).
    fn foreign_took(&self, role: &str, took: Duration) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        self.longest_ms.fetch_max(ms, Ordering::Relaxed);
        if took > harm::HOSTAGE_BOUND {
            Self::add(&self.harmed, 1);
            println!(
                "{}",
                json!({
                    "role": role,
                    "harmed": format!(
                        "a transaction took {took:.1?}, over the bound of {:?}",
                        harm::HOSTAGE_BOUND
                    ),
                })
            );
        }
    }

    /// Counts what `done` says was done.
    fn done(&self, done: &Done) {
        match done {
            Done::Held(ids) => {
                Self::add(&self.txs, 1);
                Self::add(&self.locks, ids.len() as u64);
            }
            Done::Busy => Self::add(&self.busy, 1),
            Done::TimedOut => Self::add(&self.timeouts, 1),
            Done::Permit => Self::add(&self.permits, 1),
        }
    }

    /// The counts as one JSON line.
    fn line(&self, role: &str, last: bool) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "role": role,
            "pid": std::process::id(),
            "final": last,
            "txs": get(&self.txs),
            "locks": get(&self.locks),
            "permits": get(&self.permits),
            "busy": get(&self.busy),
            "timeouts": get(&self.timeouts),
            "lost": get(&self.lost),
            "unexpected": get(&self.unexpected),
            "clashes": get(&self.clashes),
            "probes": get(&self.probes),
            "foreign": get(&self.foreign),
            "harmed": get(&self.harmed),
            "longest_ms": get(&self.longest_ms),
        })
        .to_string()
    }
}

/// One lock call of a transaction.
#[derive(Clone, Debug)]
enum Op {
    Lock(i64),
    Try(i64),
    Timed(i64),
    Batch(Vec<i64>),
    TryBatch(Vec<i64>),
    TimedBatch(Vec<i64>),
    Permit,
    TryPermit,
    TimedPermit,
}

/// What a lock call got.
#[derive(Debug)]
enum Done {
    /// These keys, exclusively: their counters are to be incremented.
    Held(Vec<i64>),
    /// A try found them busy.
    Busy,
    /// A `_timeout` call's bound expired.
    TimedOut,
    /// A permit of [`QUOTA`].
    Permit,
}

/// The worker's random choices.
struct Dice(fastrand::Rng);

impl Dice {
    fn id(&mut self) -> i64 {
        self.0.i64(0..KEYS)
    }

    fn ids(&mut self) -> Vec<i64> {
        let n = self.0.usize(2..=3);
        let mut ids: Vec<i64> = (0..n).map(|_| self.id()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// A transaction's lock call: mostly keys, now and then a permit.
    fn op(&mut self) -> Op {
        match self.0.u8(0..20) {
            0..=4 => Op::Lock(self.id()),
            5..=7 => Op::Try(self.id()),
            8..=9 => Op::Timed(self.id()),
            10..=12 => Op::Batch(self.ids()),
            13..=14 => Op::TryBatch(self.ids()),
            15..=16 => Op::TimedBatch(self.ids()),
            17 => Op::Permit,
            18 => Op::TryPermit,
            _ => Op::TimedPermit,
        }
    }

    /// A session lock's call: no batches.
    fn session_op(&mut self) -> Op {
        match self.0.u8(0..10) {
            0..=3 => Op::Lock(self.id()),
            4..=5 => Op::Try(self.id()),
            6..=7 => Op::Timed(self.id()),
            8 => Op::Permit,
            _ => Op::TryPermit,
        }
    }

    /// Whether to stay a millisecond inside the critical section, between
    /// the read and the write, so that two holders would overlap.
    fn linger(&mut self) -> bool {
        self.0.u8(0..4) == 0
    }
}

fn batch(ids: &[i64]) -> Batch {
    ids.iter()
        .fold(Batch::new(), |b, &id| b.with(&Account { id }))
}

/// Runs `op` on a `LockTx` (`$tx`), awaiting each call with the tokens
/// `$aw` (`.await`, or nothing on Diesel), and evaluates to its [`Done`];
/// an error returns from the enclosing function. Guards are dropped at
/// once: the locks stay until the transaction ends.
macro_rules! run_op {
    ($tx:expr, $op:expr, $($aw:tt)*) => {
        match $op {
            Op::Lock(id) => {
                drop($tx.lock(Account { id }) $($aw)* ?);
                Done::Held(vec![id])
            }
            Op::Try(id) => match $tx.try_lock(Account { id }) $($aw)* ? {
                Ok(held) => {
                    drop(held);
                    Done::Held(vec![id])
                }
                Err(_) => Done::Busy,
            },
            Op::Timed(id) => match $tx.lock_timeout(Account { id }, TIMED) $($aw)* {
                Ok(held) => {
                    drop(held);
                    Done::Held(vec![id])
                }
                Err(e) if e.is_timeout() => Done::TimedOut,
                Err(e) => return Err(e),
            },
            Op::Batch(ids) => {
                drop($tx.lock_batch(&batch(&ids)) $($aw)* ?);
                Done::Held(ids)
            }
            Op::TryBatch(ids) => match $tx.try_lock_batch(&batch(&ids)) $($aw)* ? {
                Ok(held) => {
                    drop(held);
                    Done::Held(ids)
                }
                Err(_) => Done::Busy,
            },
            Op::TimedBatch(ids) => match $tx.lock_batch_timeout(&batch(&ids), TIMED) $($aw)* {
                Ok(held) => {
                    drop(held);
                    Done::Held(ids)
                }
                Err(e) if e.is_timeout() => Done::TimedOut,
                Err(e) => return Err(e),
            },
            Op::Permit => {
                drop($tx.acquire_permit(QUOTA, PERMITS) $($aw)* ?);
                Done::Permit
            }
            Op::TryPermit => match $tx.try_acquire_permit(QUOTA, PERMITS) $($aw)* ? {
                Ok(held) => {
                    drop(held);
                    Done::Permit
                }
                Err(_) => Done::Busy,
            },
            Op::TimedPermit => {
                match $tx.acquire_permit_timeout(QUOTA, PERMITS, TIMED) $($aw)* {
                    Ok(held) => {
                        drop(held);
                        Done::Permit
                    }
                    Err(e) if e.is_timeout() => Done::TimedOut,
                    Err(e) => return Err(e),
                }
            }
        }
    };
}

/// The read of the critical section: the key's counter.
const READ_SQL: &str = "SELECT n FROM fleet_counters WHERE id = $1";

/// The error of the diesel-async application's own read ([`READ_SQL`]),
/// a statement diesel-async names like every other: its name clashes are
/// the application's, told from lockkit's by this type.
#[derive(Debug)]
struct OwnRead(diesel::result::Error);

impl std::fmt::Display for OwnRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the diesel-async application's own read")
    }
}

impl std::error::Error for OwnRead {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// Whether `e` or one of its sources is an [`OwnRead`].
fn is_own_read(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<OwnRead>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// The write of the critical section, with parameters: the key's id and
/// its new count.
const UPDATE_SQL: &str = "UPDATE fleet_counters SET n = $2 WHERE id = $1";

/// The log row of a write, with parameters: the key's id and the role.
const LOG_SQL: &str = "INSERT INTO fleet_log (id, role) VALUES ($1, $2)";

/// The write of the critical section, after a read of `n`: `n + 1`, and a
/// log row naming the role. Integers and a role name of this file's own:
/// nothing to escape.
fn rmw_sql(id: i64, n: i64, role: &str) -> String {
    format!(
        "UPDATE fleet_counters SET n = {} WHERE id = {id}; \
         INSERT INTO fleet_log (id, role) VALUES ({id}, '{role}')",
        n + 1
    )
}

/// The read-modify-write on a tokio-postgres client or transaction,
/// unnamed statements only (a named one could meet a foreign application's
/// behind the pooler: that would be this file's fault, not lockkit's).
async fn rmw_tp<C: tokio_postgres::GenericClient + Sync>(
    client: &C,
    id: i64,
    role: &str,
    linger: bool,
) -> Result<(), tokio_postgres::Error> {
    let n: i64 = client
        .query_typed_one(READ_SQL, &[(&id, Type::INT8)])
        .await?
        .get(0);
    if linger {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    client.batch_execute(&rmw_sql(id, n, role)).await
}

/// What every role is given.
struct Ctx {
    role: String,
    url: String,
    deadline: Instant,
    seed: u64,
    tally: Arc<Tally>,
}

impl Ctx {
    fn running(&self) -> bool {
        Instant::now() < self.deadline
    }

    fn config(&self) -> tokio_postgres::Config {
        self.url.parse().expect("a connection URL")
    }

    fn dice(&self, task: u64) -> Dice {
        Dice(fastrand::Rng::with_seed(
            self.seed ^ (task.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        ))
    }

    /// A tokio-postgres client through the pooler, trying again (within
    /// the deadline) while connecting fails.
    async fn connect(&self) -> Option<Client> {
        let config = self.config();
        while self.running() {
            match config.connect(NoTls).await {
                Ok((client, connection)) => {
                    tokio::spawn(connection);
                    return Some(client);
                }
                Err(e) if self.role.starts_with("foreign") => {
                    self.tally.foreign_error(&self.role, "connect", &chain(&e));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    self.tally.error(&self.role, "connect", &Error::from(e));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        None
    }
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: fleet-worker <role> <url> <seconds> <seed>";
    let role = args.next().expect(usage);
    let url = args.next().expect(usage);
    let seconds: f64 = args.next().expect(usage).parse().expect(usage);
    let seed: u64 = args.next().expect(usage).parse().expect(usage);
    let ctx = Arc::new(Ctx {
        role: role.clone(),
        url,
        deadline: Instant::now() + Duration::from_secs_f64(seconds),
        seed,
        tally: Arc::new(Tally::default()),
    });
    let status = {
        let (tally, role) = (Arc::clone(&ctx.tally), role.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                println!("{}", tally.line(&role, false));
            }
        })
    };
    match role.as_str() {
        "tp" => tasks(&ctx, 2, |ctx, t| tp(ctx, t, StatementMode::default())).await,
        "tp-prepared" => tasks(&ctx, 2, |ctx, t| tp(ctx, t, StatementMode::Prepared)).await,
        "sqlx" => with_sqlx::run(&ctx).await,
        "diesel" => with_diesel::run(&ctx).await,
        "diesel-async" => with_diesel_async::run(&ctx).await,
        "session" => tasks(&ctx, 1, |ctx, t| session(ctx, t, Sessions::Own)).await,
        "session-pool" => tasks(&ctx, 1, |ctx, t| session(ctx, t, Sessions::Pooled)).await,
        "mux" => tasks(&ctx, 1, |ctx, t| session(ctx, t, Sessions::Multiplexed)).await,
        "sql" => tasks(&ctx, 2, sql).await,
        "naive" => tasks(&ctx, 3, naive).await,
        "leaky" => leaky(&ctx).await,
        "foreign-tp" => tasks(&ctx, 2, foreign_tp).await,
        "foreign-sqlx" => with_sqlx::foreign(&ctx).await,
        other => panic!("unknown role `{other}`; {usage}"),
    }
    status.abort();
    println!("{}", ctx.tally.line(&role, true));
}

/// Runs `n` tasks of `f` at once, each with its index, until they end.
async fn tasks<F, Fut>(ctx: &Arc<Ctx>, n: u64, f: F)
where
    F: Fn(Arc<Ctx>, u64) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let handles: Vec<_> = (0..n)
        .map(|t| tokio::spawn(f(Arc::clone(ctx), t)))
        .collect();
    for h in handles {
        h.await.expect("a task of the worker panicked");
    }
}

/// `tp` and `tp-prepared`: a `LockClient` through the pooler, connecting
/// again after a lost connection.
async fn tp(ctx: Arc<Ctx>, task: u64, mode: StatementMode) {
    let Some(first) = ctx.connect().await else {
        return;
    };
    let locker = loop {
        match Locker::new(&first, Config::default().statements(mode)).await {
            Ok(locker) => break locker,
            Err(e) => {
                ctx.tally.error(&ctx.role, "Locker::new", &e);
                if !ctx.running() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let mut conn = LockClient::new(&locker, first);
    let mut dice = ctx.dice(task);
    while ctx.running() {
        let op = dice.op();
        let linger = dice.linger();
        let outcome: Result<Done, Error> = async {
            let tx = conn.begin().await?;
            let done = run_op!(tx, op.clone(), .await);
            if let Done::Held(ids) = &done {
                for &id in ids {
                    rmw_tp(&*tx, id, &ctx.role, linger).await?;
                }
            }
            tx.commit().await?;
            Ok(done)
        }
        .await;
        match outcome {
            Ok(done) => ctx.tally.done(&done),
            Err(e) => {
                let cause = ctx.tally.error(&ctx.role, &format!("{op:?}"), &e);
                if cause == Cause::Lost || conn.is_closed() {
                    match ctx.connect().await {
                        Some(client) => conn = LockClient::new(&locker, client),
                        None => return,
                    }
                }
            }
        }
    }
}

/// Which session locks a session role takes.
#[derive(Clone, Copy, PartialEq)]
enum Sessions {
    /// `session`: the default form, on connections of its own.
    Own,
    /// `session-pool`: the default form, on connections leased from a
    /// deadpool-postgres pool.
    Pooled,
    /// `mux`: the multiplexed form.
    Multiplexed,
}

/// `session`, `session-pool` and `mux`: session locks through the pooler,
/// with the critical section's read-modify-write on a second connection,
/// committed before the lock is released.
async fn session(ctx: Arc<Ctx>, task: u64, kind: Sessions) {
    let sessions = match kind {
        Sessions::Own => lockkit::SessionLock::new(ctx.config()),
        Sessions::Pooled => {
            lockkit::SessionLock::from_pool(lockkit_tests::support::pool_of(ctx.config(), 4))
        }
        Sessions::Multiplexed => {
            lockkit::SessionLock::new(ctx.config()).form(lockkit::SessionForm::Multiplexed)
        }
    };
    let multiplexed = kind == Sessions::Multiplexed;
    let Some(mut work) = ctx.connect().await else {
        return;
    };
    let mut dice = ctx.dice(task);
    while ctx.running() {
        let op = if multiplexed {
            match dice.0.u8(0..3) {
                0 => Op::Lock(dice.id()),
                1 => Op::Try(dice.id()),
                _ => Op::Timed(dice.id()),
            }
        } else {
            dice.session_op()
        };
        let taken = match op {
            Op::Lock(id) => sessions.lock(Account { id }).await.map(Ok),
            Op::Try(id) => sessions.try_lock(Account { id }).await,
            Op::Timed(id) => sessions.lock_timeout(Account { id }, TIMED).await.map(Ok),
            Op::Permit => {
                permit(&ctx, sessions.acquire_permit(QUOTA, PERMITS).await.map(Ok)).await;
                continue;
            }
            _ => {
                permit(&ctx, sessions.try_acquire_permit(QUOTA, PERMITS).await).await;
                continue;
            }
        };
        let mut guards = match taken {
            Ok(Ok(guard)) => vec![guard],
            Ok(Err(_)) => {
                Tally::add(&ctx.tally.busy, 1);
                continue;
            }
            Err(e) => {
                ctx.tally.error(&ctx.role, &format!("{op:?}"), &e);
                continue;
            }
        };
        // The multiplexed form holds many keys at once: a try on a second
        // key while the first is held (a try never waits, so no cycle).
        if multiplexed && dice.0.bool() {
            let id = dice.id();
            match sessions.try_lock(Account { id }).await {
                Ok(Ok(guard)) => guards.push(guard),
                Ok(Err(_)) => Tally::add(&ctx.tally.busy, 1),
                Err(e) => {
                    ctx.tally.error(&ctx.role, "second try", &e);
                }
            }
        }
        let linger = dice.linger();
        // The critical section needs a second server connection while its
        // lock pins one; with every other one taken by waits for the keys
        // held here, it would wait for pgbouncer's query_wait_timeout (the
        // README's pooler section). So its wait for a server connection is
        // bounded: past it, nothing was written, and the locks go.
        let written: Option<Result<(), tokio_postgres::Error>> =
            match tokio::time::timeout(SERVER_WAIT, work.transaction()).await {
                Err(_) => None,
                Ok(begun) => Some(
                    async {
                        let tx = begun?;
                        for guard in &guards {
                            rmw_tp(&tx, guard.value().id, &ctx.role, linger).await?;
                        }
                        tx.commit().await
                    }
                    .await,
                ),
            };
        let Some(written) = written else {
            // The cut-off BEGIN may still wait in pgbouncer's queue: the
            // connection goes, and nothing was written.
            Tally::add(&ctx.tally.timeouts, 1);
            release_all(&ctx, guards).await;
            match ctx.connect().await {
                Some(client) => work = client,
                None => return,
            }
            continue;
        };
        let n = guards.len() as u64;
        let all_held = release_all(&ctx, guards).await;
        match written {
            Ok(()) if all_held => {
                Tally::add(&ctx.tally.txs, 1);
                Tally::add(&ctx.tally.locks, n);
            }
            Ok(()) => {}
            Err(e) => {
                ctx.tally
                    .error(&ctx.role, "the critical section's writes", &Error::from(e));
                if work.is_closed() {
                    match ctx.connect().await {
                        Some(client) => work = client,
                        None => return,
                    }
                }
            }
        }
    }
}

/// Releases `guards`; whether each was still held. A lost one is
/// unexpected: the runner never terminates the backend of a session lock on
/// an Account key, and nothing else ends it.
async fn release_all(ctx: &Ctx, guards: Vec<lockkit::SessionGuard<Account>>) -> bool {
    let mut all_held = true;
    for guard in guards {
        let id = guard.value().id;
        match guard.release().await {
            Ok(true) => {}
            Ok(false) => {
                all_held = false;
                ctx.tally.unexpected(
                    &ctx.role,
                    &format!("the session lock of Account {id} was lost while held"),
                );
            }
            Err(e) => {
                all_held = false;
                ctx.tally.error(&ctx.role, "release", &e);
            }
        }
    }
    all_held
}

/// Counts a session permit's outcome and releases it after a moment.
async fn permit<K: AdvisoryKey>(
    ctx: &Ctx,
    taken: Result<Result<lockkit::SessionGuard<K>, K>, Error>,
) {
    match taken {
        Ok(Ok(guard)) => {
            tokio::time::sleep(Duration::from_millis(2)).await;
            match guard.release().await {
                // A permit's backend may be terminated: the permit is gone
                // with it, as documented.
                Ok(true) => Tally::add(&ctx.tally.permits, 1),
                Ok(false) => Tally::add(&ctx.tally.lost, 1),
                Err(e) => {
                    ctx.tally.error(&ctx.role, "permit release", &e);
                }
            }
        }
        Ok(Err(_)) => Tally::add(&ctx.tally.busy, 1),
        Err(e) => {
            ctx.tally.error(&ctx.role, "permit", &e);
        }
    }
}

/// `sql`: plain SQL through the pooler, the keys computed by
/// `lockkit.key(...)`; first checks that SQL computes the Rust keys.
async fn sql(ctx: Arc<Ctx>, task: u64) {
    let Some(mut client) = ctx.connect().await else {
        return;
    };
    if task == 0 {
        for id in 0..KEYS {
            let sql = format!("SELECT lockkit.key('{NAMESPACE}', lockkit.int({id}::int8))");
            match client.query_typed_one(&sql, &[]).await {
                Ok(row) => {
                    let key = lockkit::LockKey::BigInt(row.get(0));
                    if key != (Account { id }).lock_key() {
                        ctx.tally.unexpected(
                            &ctx.role,
                            &format!(
                                "SQL computes {key} for Account {{ id: {id} }}, Rust {}",
                                Account { id }.lock_key()
                            ),
                        );
                    }
                }
                Err(e) => {
                    ctx.tally.error(&ctx.role, "lockkit.key", &Error::from(e));
                }
            }
        }
    }
    let mut dice = ctx.dice(task);
    while ctx.running() {
        let try_it = dice.0.bool();
        let ids = if dice.0.bool() {
            vec![dice.id()]
        } else {
            dice.ids()
        };
        let linger = dice.linger();
        let outcome: Result<bool, tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            // One statement for the keys, in ascending key order (the
            // order lockkit's batches use), as the SQL client's own code.
            let list = ids
                .iter()
                .map(|id| format!("lockkit.key('{NAMESPACE}', lockkit.int({id}::int8))"))
                .collect::<Vec<_>>()
                .join(", ");
            // A try answers whether it got every key (on a miss, the
            // rollback lets go of the others); a lock waits for each.
            let taken = if try_it {
                "coalesce(bool_and(pg_try_advisory_xact_lock(k)), true)"
            } else {
                "count(pg_advisory_xact_lock(k)) >= 0"
            };
            let sql =
                format!("SELECT {taken} FROM (SELECT unnest(ARRAY[{list}]) AS k ORDER BY 1) keys");
            let all: bool = tx.query_typed_one(&sql, &[]).await?.get(0);
            if !all {
                tx.rollback().await?;
                return Ok(false);
            }
            for &id in &ids {
                rmw_tp(&tx, id, &ctx.role, linger).await?;
            }
            tx.commit().await?;
            Ok(true)
        }
        .await;
        match outcome {
            Ok(true) => ctx.tally.done(&Done::Held(ids)),
            Ok(false) => Tally::add(&ctx.tally.busy, 1),
            Err(e) => {
                ctx.tally
                    .error(&ctx.role, "SQL transaction", &Error::from(e));
                if client.is_closed() {
                    match ctx.connect().await {
                        Some(c) => client = c,
                        None => return,
                    }
                }
            }
        }
    }
}

/// `naive` (a control): the critical section without any lock.
async fn naive(ctx: Arc<Ctx>, task: u64) {
    let Some(mut client) = ctx.connect().await else {
        return;
    };
    let mut dice = ctx.dice(task);
    while ctx.running() {
        let id = dice.0.i64(0..2);
        let outcome: Result<(), tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            rmw_tp(&tx, id, &ctx.role, true).await?;
            tx.commit().await
        }
        .await;
        match outcome {
            Ok(()) => ctx.tally.done(&Done::Held(vec![id])),
            Err(e) => {
                ctx.tally.error(&ctx.role, "naive", &Error::from(e));
            }
        }
    }
}

/// `leaky` (a control): `pg_advisory_lock` through the transaction-mode
/// pooler, unlocked only every other time; then waits for the deadline with
/// its connection open.
async fn leaky(ctx: &Arc<Ctx>) {
    let Some(client) = ctx.connect().await else {
        return;
    };
    for id in 0..4_i64 {
        let key = match (Account { id: 100 + id }).lock_key() {
            lockkit::LockKey::BigInt(k) => k,
            other => unreachable!("Account is a BigInt key, not {other}"),
        };
        let taken = client
            .simple_query(&format!("SELECT pg_advisory_lock({key})"))
            .await;
        if let Err(e) = taken {
            ctx.tally
                .error(&ctx.role, "pg_advisory_lock", &Error::from(e));
            continue;
        }
        Tally::add(&ctx.tally.locks, 1);
        if id % 2 == 0 {
            // Behind the pooler this may run on another backend, where it
            // unlocks nothing.
            let _ = client
                .simple_query(&format!("SELECT pg_advisory_unlock({key})"))
                .await;
        }
    }
    tokio::time::sleep_until(ctx.deadline.into()).await;
}

/// `foreign-tp`: an application without lockkit that prepares its own
/// named statements (`s0`, `s1`, … as tokio-postgres names them) inside
/// its transactions and leaves every third one on the backend (never
/// closed).
async fn foreign_tp(ctx: Arc<Ctx>, task: u64) {
    let Some(mut client) = ctx.connect().await else {
        return;
    };
    let mut dice = ctx.dice(task);
    let mut round = 0_u64;
    while ctx.running() {
        round += 1;
        let started = Instant::now();
        let outcome: Result<(), tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            let add = tx.prepare("SELECT $1::int8 + 1").await?;
            let count = tx.prepare("SELECT count(*) FROM fleet_counters").await?;
            let _: i64 = tx.query_one(&add, &[&dice.0.i64(0..1000)]).await?.get(0);
            let _: i64 = tx.query_one(&count, &[]).await?.get(0);
            if round % 3 == 0 {
                // Never closed: left on whichever backend this was.
                std::mem::forget(add);
            }
            tx.commit().await
        }
        .await;
        ctx.tally.foreign_took(&ctx.role, started.elapsed());
        match outcome {
            Ok(()) => Tally::add(&ctx.tally.txs, 1),
            Err(e) => {
                ctx.tally
                    .foreign_error(&ctx.role, "transaction", &chain(&e));
                if client.is_closed() {
                    match ctx.connect().await {
                        Some(c) => client = c,
                        None => return,
                    }
                }
            }
        }
    }
}

/// sqlx: lockkit-sqlx's `Locker::transaction` on a default `PgPool`, and
/// the foreign sqlx application.
mod with_sqlx {
    use super::*;
    use lockkit_sqlx::lock_error;
    use sqlx::pool::PoolConnection;
    use sqlx::postgres::PgPool;
    use sqlx::Postgres;

    async fn pool(ctx: &Ctx) -> Option<PgPool> {
        while ctx.running() {
            match PgPool::connect(&ctx.url).await {
                Ok(pool) => return Some(pool),
                Err(e) if ctx.role.starts_with("foreign") => {
                    ctx.tally
                        .foreign_error(&ctx.role, "PgPool::connect", &chain(&e));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    ctx.tally
                        .error(&ctx.role, "PgPool::connect", &lock_error(e));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        None
    }

    /// Checks the connection the pool handed out (see [`PROBE_CHECK`]);
    /// `false` when it was inside a transaction (counted, and rolled back).
    pub(super) async fn probe(ctx: &Ctx, conn: &mut PoolConnection<Postgres>) -> bool {
        Tally::add(&ctx.tally.probes, 1);
        let first = sqlx::raw_sql(PROBE_SET).execute(&mut **conn).await;
        let checked = match first {
            Ok(_) => sqlx::raw_sql(PROBE_CHECK).execute(&mut **conn).await,
            Err(e) => Err(e),
        };
        match checked {
            Ok(_) => true,
            Err(e) => {
                let code = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .map(|c| c.into_owned());
                let text = e.to_string();
                if code.as_deref() == Some("25P02") || text.contains(HANDED_IN_TRANSACTION) {
                    ctx.tally.unexpected(
                        &ctx.role,
                        &format!("the pool handed out a connection inside a transaction: {text}"),
                    );
                    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await;
                } else {
                    ctx.tally.error(&ctx.role, "hand-off check", &lock_error(e));
                }
                false
            }
        }
    }

    /// The read-modify-write inside the transaction, unnamed.
    /// (Boxed, `Send` checked here: left opaque, sqlx's `Executor` for
    /// `&mut PgConnection` is not general enough for the closure's
    /// higher-ranked lifetimes.)
    fn rmw<'a>(
        tx: &'a mut lockkit_sqlx::LockTx<'_>,
        id: i64,
        role: &'a str,
        linger: bool,
    ) -> lockkit::tx::BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let n: i64 = sqlx::query_scalar(READ_SQL)
                .bind(id)
                .persistent(false)
                .fetch_one(tx.conn())
                .await
                .map_err(lock_error)?;
            if linger {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // Two unnamed statements: `raw_sql`'s future is not `Send` for
            // every lifetime either.
            sqlx::query(UPDATE_SQL)
                .bind(id)
                .bind(n + 1)
                .persistent(false)
                .execute(tx.conn())
                .await
                .map_err(lock_error)?;
            sqlx::query(LOG_SQL)
                .bind(id)
                .bind(role)
                .persistent(false)
                .execute(tx.conn())
                .await
                .map_err(lock_error)?;
            Ok(())
        })
    }

    pub(super) async fn run(ctx: &Arc<Ctx>) {
        let Some(pool) = pool(ctx).await else {
            return;
        };
        let locker = loop {
            match lockkit_sqlx::Locker::new(&pool, Config::default()).await {
                Ok(locker) => break locker,
                Err(e) => {
                    ctx.tally.error(&ctx.role, "Locker::new", &e);
                    if !ctx.running() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        // Joined on this task, not spawned: sqlx's `Executor` for
        // `&mut PgConnection` is not general enough for `tokio::spawn`'s
        // `Send` check.
        let tasks = (0..3).map(|t| {
            let (ctx, pool, locker) = (Arc::clone(ctx), pool.clone(), locker.clone());
            async move {
                let mut dice = ctx.dice(t);
                while ctx.running() {
                    let mut conn = match pool.acquire().await {
                        Ok(conn) => conn,
                        Err(e) => {
                            ctx.tally.error(&ctx.role, "acquire", &lock_error(e));
                            continue;
                        }
                    };
                    if !probe(&ctx, &mut conn).await {
                        continue;
                    }
                    let (op, linger, role) = (dice.op(), dice.linger(), ctx.role.clone());
                    let what = format!("{op:?}");
                    let outcome: Result<Done, Error> = locker
                        .transaction(&mut *conn, move |tx| {
                            Box::pin(async move {
                                let done = run_op!(tx, op, .await);
                                if let Done::Held(ids) = &done {
                                    for &id in ids {
                                        rmw(tx, id, &role, linger).await?;
                                    }
                                }
                                Ok(done)
                            })
                        })
                        .await;
                    match outcome {
                        Ok(done) => ctx.tally.done(&done),
                        Err(e) => {
                            ctx.tally.error(&ctx.role, &what, &e);
                        }
                    }
                }
            }
        });
        futures_util::future::join_all(tasks).await;
        pool.close().await;
    }

    /// `foreign-sqlx`: a sqlx pool application without lockkit, whose
    /// queries are sqlx's persistent (named, cached) statements.
    pub(super) async fn foreign(ctx: &Arc<Ctx>) {
        let Some(pool) = pool(ctx).await else {
            return;
        };
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let (ctx, pool) = (Arc::clone(ctx), pool.clone());
                tokio::spawn(async move {
                    let mut dice = ctx.dice(t);
                    while ctx.running() {
                        let started = Instant::now();
                        let outcome: Result<(), sqlx::Error> = async {
                            let mut tx = pool.begin().await?;
                            let _: i64 = sqlx::query_scalar("SELECT $1::int8 * 2")
                                .bind(dice.0.i64(0..1000))
                                .fetch_one(&mut *tx)
                                .await?;
                            let _: i64 = sqlx::query_scalar("SELECT count(*) FROM fleet_log")
                                .fetch_one(&mut *tx)
                                .await?;
                            tx.commit().await
                        }
                        .await;
                        ctx.tally.foreign_took(&ctx.role, started.elapsed());
                        match outcome {
                            Ok(()) => Tally::add(&ctx.tally.txs, 1),
                            Err(e) => ctx
                                .tally
                                .foreign_error(&ctx.role, "transaction", &chain(&e)),
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.expect("a foreign sqlx task panicked");
        }
        pool.close().await;
    }
}

/// Blocking Diesel: lockkit-diesel's `Locker::transaction` on a default
/// r2d2 pool, on threads of their own.
mod with_diesel {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::r2d2::{ConnectionManager, Pool};
    use diesel::sql_types::BigInt;
    use diesel::{PgConnection, QueryableByName, RunQueryDsl};

    /// A counter row.
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    /// See [`with_sqlx::probe`].
    fn probe(ctx: &Ctx, conn: &mut PgConnection) -> bool {
        Tally::add(&ctx.tally.probes, 1);
        let checked = conn
            .batch_execute(PROBE_SET)
            .and_then(|()| conn.batch_execute(PROBE_CHECK));
        match checked {
            Ok(()) => true,
            Err(e) => {
                let text = e.to_string();
                if text.contains("current transaction is aborted")
                    || text.contains(HANDED_IN_TRANSACTION)
                {
                    ctx.tally.unexpected(
                        &ctx.role,
                        &format!("the pool handed out a connection inside a transaction: {text}"),
                    );
                    let _ = conn.batch_execute("ROLLBACK");
                } else {
                    ctx.tally
                        .error(&ctx.role, "hand-off check", &Error::from(e));
                }
                false
            }
        }
    }

    fn worker(
        ctx: &Ctx,
        pool: &Pool<ConnectionManager<PgConnection>>,
        locker: &lockkit_diesel::Locker,
        task: u64,
    ) {
        let mut dice = ctx.dice(task);
        while ctx.running() {
            let mut conn = match pool.get() {
                Ok(conn) => conn,
                Err(e) => {
                    ctx.tally.error(&ctx.role, "r2d2 get", &Error::other(e));
                    continue;
                }
            };
            if !probe(ctx, &mut conn) {
                continue;
            }
            let (op, linger) = (dice.op(), dice.linger());
            let what = format!("{op:?}");
            let outcome: Result<Done, Error> = locker.transaction(&mut conn, |tx| {
                let done = run_op!(tx, op,);
                if let Done::Held(ids) = &done {
                    for &id in ids {
                        let got: N = diesel::sql_query(READ_SQL)
                            .bind::<BigInt, _>(id)
                            .get_result(tx.conn())?;
                        if linger {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        tx.conn().batch_execute(&rmw_sql(id, got.n, &ctx.role))?;
                    }
                }
                Ok(done)
            });
            match outcome {
                Ok(done) => ctx.tally.done(&done),
                Err(e) => {
                    ctx.tally.error(&ctx.role, &what, &e);
                }
            }
        }
    }

    /// `url` for libpq without its GSSAPI probe (`gssencmode=disable`;
    /// the test servers have no Kerberos). The probe uses krb5's
    /// thread-specific data, whose teardown at process exit races with
    /// r2d2's threads still connecting: the worker then dies of SIGABRT
    /// (`krb5int_getspecific: Assertion destructors_set[keynum] == 1`)
    /// after its run, a libpq and krb5 matter, not lockkit's.
    fn libpq_url(url: &str) -> String {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}gssencmode=disable")
    }

    pub(super) async fn run(ctx: &Arc<Ctx>) {
        let ctx = Arc::clone(ctx);
        tokio::task::spawn_blocking(move || {
            let pool = loop {
                match Pool::builder()
                    .build(ConnectionManager::<PgConnection>::new(libpq_url(&ctx.url)))
                {
                    Ok(pool) => break pool,
                    Err(e) => {
                        ctx.tally.error(&ctx.role, "r2d2 build", &Error::other(e));
                        if !ctx.running() {
                            return;
                        }
                    }
                }
            };
            let locker = loop {
                let made = pool
                    .get()
                    .map_err(Error::other)
                    .and_then(|mut conn| lockkit_diesel::Locker::new(&mut conn, Config::default()));
                match made {
                    Ok(locker) => break locker,
                    Err(e) => {
                        ctx.tally.error(&ctx.role, "Locker::new", &e);
                        if !ctx.running() {
                            return;
                        }
                    }
                }
            };
            std::thread::scope(|scope| {
                for t in 0..3 {
                    let (ctx, pool, locker) = (&ctx, &pool, &locker);
                    scope.spawn(move || worker(ctx, pool, locker, t));
                }
            });
        })
        .await
        .expect("the Diesel threads panicked");
    }
}

/// diesel-async: lockkit-diesel-async's `Locker::transaction` on a deadpool
/// pool whose connections come from `lockkit_diesel_async::establish`, as
/// its docs say to behind a transaction-mode pooler (diesel-async's own
/// `establish` drops a connection with its second set-up statement
/// unanswered, whose answer pgbouncer 1.18 then hands to another client).
mod with_diesel_async {
    use super::*;
    use diesel::sql_types::BigInt;
    use diesel::QueryableByName;
    use diesel_async::pooled_connection::deadpool::Pool;
    use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
    use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

    /// A counter row.
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    /// See [`with_sqlx::probe`].
    async fn probe(ctx: &Ctx, conn: &mut AsyncPgConnection) -> bool {
        Tally::add(&ctx.tally.probes, 1);
        let checked = match conn.batch_execute(PROBE_SET).await {
            Ok(()) => conn.batch_execute(PROBE_CHECK).await,
            Err(e) => Err(e),
        };
        match checked {
            Ok(()) => true,
            Err(e) => {
                let text = e.to_string();
                if text.contains("current transaction is aborted")
                    || text.contains(HANDED_IN_TRANSACTION)
                {
                    ctx.tally.unexpected(
                        &ctx.role,
                        &format!("the pool handed out a connection inside a transaction: {text}"),
                    );
                    let _ = conn.batch_execute("ROLLBACK").await;
                } else {
                    ctx.tally
                        .error(&ctx.role, "hand-off check", &Error::from(e));
                }
                false
            }
        }
    }

    pub(super) async fn run(ctx: &Arc<Ctx>) {
        let mut config = ManagerConfig::default();
        config.custom_setup = Box::new(lockkit_diesel_async::establish);
        let manager =
            AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(&ctx.url, config);
        let pool = Pool::builder(manager).build().expect("deadpool");
        let locker = loop {
            let made = match pool.get().await {
                Ok(mut conn) => {
                    lockkit_diesel_async::Locker::new(&mut conn, Config::default()).await
                }
                Err(e) => Err(Error::other(e)),
            };
            match made {
                Ok(locker) => break locker,
                Err(e) => {
                    ctx.tally.error(&ctx.role, "Locker::new", &e);
                    if !ctx.running() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let handles: Vec<_> = (0..3)
            .map(|t| {
                let (ctx, pool, locker) = (Arc::clone(ctx), pool.clone(), locker.clone());
                tokio::spawn(async move {
                    let mut dice = ctx.dice(t);
                    while ctx.running() {
                        let mut conn = match pool.get().await {
                            Ok(conn) => conn,
                            Err(e) => {
                                ctx.tally.error(&ctx.role, "deadpool get", &Error::other(e));
                                continue;
                            }
                        };
                        if !probe(&ctx, &mut conn).await {
                            continue;
                        }
                        let (op, linger, role) = (dice.op(), dice.linger(), ctx.role.clone());
                        let what = format!("{op:?}");
                        let outcome: Result<Done, Error> = locker
                            .transaction(&mut conn, move |tx| {
                                Box::pin(async move {
                                    let done = run_op!(tx, op, .await);
                                    if let Done::Held(ids) = &done {
                                        for &id in ids {
                                            let got: N = diesel::sql_query(READ_SQL)
                                                .bind::<BigInt, _>(id)
                                                .get_result(tx.conn())
                                                .await
                                                .map_err(|e| Error::other(OwnRead(e)))?;
                                            if linger {
                                                tokio::time::sleep(Duration::from_millis(1)).await;
                                            }
                                            tx.conn()
                                                .batch_execute(&rmw_sql(id, got.n, &role))
                                                .await?;
                                        }
                                    }
                                    Ok(done)
                                })
                            })
                            .await;
                        match outcome {
                            Ok(done) => ctx.tally.done(&done),
                            Err(e) => {
                                ctx.tally.error(&ctx.role, &what, &e);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.expect("a diesel-async task panicked");
        }
    }
}
