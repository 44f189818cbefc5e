//! Typed PostgreSQL advisory locks, safe by construction.
//!
//! lockkit lets many workers coordinate on logical entities (an order, a
//! business key, a pair of accounts) through PostgreSQL's advisory locks.
//!
//! # The model
//!
//! - **Keys.** `#[derive(AdvisoryKey)]` maps a domain type to a stable
//!   [`LockKey`], `BigInt(i64)` or `Pair(i32, i32)`, in the key format of
//!   `docs/KEYS.md`: the same on every machine, build and version, because
//!   every process that will ever run must agree on it.
//! - **A [`Locker`]**, made once at startup, holds its [`Policy`]: the
//!   configuration ([`Config`]: lock budget, order check, statement mode)
//!   and what it learned of the server in one round trip ([`ServerFacts`]).
//! - **A [`LockClient`]** per connection prepares lockkit's statements once;
//!   its [`begin`](LockClient::begin) opens a [`LockTx`], a
//!   `tokio_postgres::Transaction` that takes locks. ([`Locker::begin`] and
//!   [`Locker::wrap`] serve plain clients and pooled transactions.)
//! - **Locks live as long as the transaction** (`pg_advisory_xact_lock`):
//!   released at `COMMIT` or `ROLLBACK`, never leaked into a pool. A lock
//!   call returns a guard, [`Held`] or [`HeldBatch`], which borrows the
//!   transaction: it proves the key is held and cannot outlive it.
//! - **A [`Batch`]** takes many keys in one round trip, deduplicated and
//!   sorted in one global order, so two workers never wait on each other in a
//!   cycle; the **lock budget** refuses a transaction that would fill the
//!   server's shared lock table before anything is sent.
//! - **Session locks** ([`SessionLock`]) hold a key for longer than a
//!   transaction, on a connection of their own; **inspection**
//!   ([`inspect`], and the `lockkit` command) shows who holds and awaits
//!   which keys, with the types behind them.
//! - **One engine** owns the whole protocol of taking locks; the
//!   tokio-postgres adapter here, `lockkit-diesel` and the others only run
//!   its statements ([`driver`], for adapter authors). sqlx, diesel-async
//!   and Diesel share one [`LockTx`](tx::LockTx), written once over each
//!   adapter's driver; the key functions and what a key is made of are in
//!   [`key`].
//! - **Keys from SQL** ([`sql`]): the same keys computed by SQL functions
//!   installed in the database, so that migrations, psql sessions and
//!   services in other languages take the same locks.
//!
//! # Example
//!
//! ```no_run
//! use lockkit::{AdvisoryKey, Batch, Config, LockClient, Locker};
//!
//! #[derive(AdvisoryKey)]
//! struct Account {
//!     id: i64,
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let (client, connection) =
//!     tokio_postgres::connect("host=localhost user=postgres", tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! let locker = Locker::new(&client, Config::default()).await?; // once, at startup
//! let mut conn = LockClient::new(&locker, client); // once per connection
//!
//! let tx = conn.begin().await?;
//! // Both accounts, in the global order, in one round trip: two opposite
//! // transfers cannot deadlock.
//! let held = tx
//!     .lock_batch(&Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 }))
//!     .await?;
//! let from = held.proof(Account { id: 7 }).ok().expect("in the batch");
//! tx.execute("UPDATE accounts SET cents = cents - 500 WHERE id = $1", &[&from.id]).await?;
//! tx.execute("UPDATE accounts SET cents = cents + 500 WHERE id = 3", &[]).await?;
//! drop((from, held));
//! tx.commit().await?; // both locks are released here, never earlier
//! # Ok(())
//! # }
//! ```
//!
//! Keys alone need no server:
//!
//! ```
//! use lockkit::{AdvisoryKey, LockKey};
//!
//! #[derive(AdvisoryKey)]
//! struct Order {
//!     id: i64,
//! }
//!
//! // A golden vector of docs/KEYS.md: every process, build and version agrees.
//! assert_eq!(Order { id: 42 }.lock_key(), LockKey::BigInt(-7205368663365046133));
//! ```
//!
//! # One `LockTx` per stack, and how each begins one
//!
//! lockkit is the tokio-postgres stack and the core every adapter shares;
//! each other stack has an adapter crate, the only lockkit dependency its
//! application needs (it re-exports the key trait, its derive and what the
//! lock calls take and return):
//!
//! - `lockkit` (this crate): tokio-postgres, session locks, inspection;
//! - `lockkit-sqlx`: sqlx;
//! - `lockkit-diesel-async`: diesel-async;
//! - `lockkit-diesel`: Diesel (blocking);
//! - `lockkit-cli`: the `lockkit` command (`inspect`, `key`, `check`, `sql`).
//!
//! Every stack locks through a `LockTx` with the same methods
//! ([`lock`](LockTx::lock), `lock_shared`, the `_timeout` and `try_` forms,
//! `lock_batch`, `savepoint`, …), the same errors and the same guards. For
//! sqlx, diesel-async and Diesel it is one type, [`tx::LockTx`], over each
//! adapter's driver; tokio-postgres keeps a type of its own, [`LockTx`],
//! which owns the transaction (`commit`, `rollback`).
//!
//! | stack | a `LockTx` over a transaction | a closure in a new transaction |
//! | --- | --- | --- |
//! | tokio-postgres (`lockkit`) | `conn.begin().await?` on a [`LockClient`] (statements unnamed by default, or prepared once per connection with `StatementMode::Prepared`); [`locker.begin(&mut client).await?`](Locker::begin); [`locker.wrap(tx)`](Locker::wrap), taking over an open `tokio_postgres::Transaction` | — |
//! | sqlx (`lockkit-sqlx`) | `locker.lock_tx(&mut tx)?` over `pool.begin().await?` | `locker.transaction(&pool, \|tx\| Box::pin(async move { … }))` |
//! | diesel-async (`lockkit-diesel-async`) | `locker.lock_tx(conn)?` inside `conn.transaction(async \|conn\| …)` | `locker.transaction(conn, \|tx\| Box::pin(async move { … }))` |
//! | Diesel (`lockkit-diesel`) | `locker.lock_tx(conn)?` inside `conn.transaction(\|conn\| …)` | `locker.transaction(conn, \|tx\| { … })` |
//!
//! # Observability
//!
//! Every lock call that goes to the server runs in a `tracing` span
//! `lockkit.lock` at debug level, with `key_type`, `keys`, `wait`, and, when
//! it ends, `outcome` (`granted`, `busy`, `timeout`, `deadlock`, …) and
//! `wait_ms`. Its statements run inside it, in every adapter, so what the
//! driver reports of them (sqlx's `sqlx::query` events, what a Diesel or
//! diesel-async instrumentation emits) is nested under the call. Release builds log out-of-order acquisition as a warning, once
//! per call site. With the `metrics` feature, the standard `metrics` facade
//! gets a histogram `lockkit_lock_wait_seconds` (labels `key_type`,
//! `outcome`) and counters `lockkit_lock_busy_total`,
//! `lockkit_lock_timeouts_total` and `lockkit_lock_deadlocks_total` (label
//! `key_type`):
//!
//! ```toml
//! lockkit = { git = "…", features = ["metrics"] }
//! metrics-exporter-prometheus = "0.16" # or any metrics recorder
//! ```
//!
//! ```text
//! // Spans and warnings: any tracing subscriber, e.g.
//! // tracing_subscriber::fmt().with_env_filter("lockkit=debug").init();
//! // Metrics: install a recorder once, e.g.
//! // metrics_exporter_prometheus::PrometheusBuilder::new().install()?;
//! ```
//!
//! # Features
//!
//! - `derive` (default): `#[derive(AdvisoryKey)]`.
//! - `tokio-postgres` (default): the tokio-postgres adapter, session locks,
//!   inspection, async [`retry`].
//! - `uuid`: `uuid::Uuid` as a key part.
//! - `metrics`: the metrics above.
//! - `diesel`: `From<diesel::result::Error> for Error`, for `lockkit-diesel`.
//!
//! # Facts this crate relies on (PostgreSQL 15)
//!
//! - Transaction-scoped locks are released at `COMMIT`/`ROLLBACK` (or a
//!   rollback to an enclosing savepoint), and at once when an error aborts
//!   the transaction; outside an explicit transaction they are released at
//!   the end of the statement, which is why lockkit only takes them inside
//!   one.
//! - PostgreSQL detects deadlocks among advisory locks (`40P01` after
//!   `deadlock_timeout`); sorted acquisition avoids the stall and the abort.
//! - `max_locks_per_transaction` sizes a lock table shared by all sessions:
//!   one greedy transaction makes other sessions fail with `53200`, even in
//!   `pg_try_*`. Hence the lock budget.
//! - A pooler in transaction mode hands a server connection to another
//!   client between transactions: a session-level lock can be stranded there
//!   and named prepared statements can collide, so lockkit checks every
//!   reply and offers unnamed statements ([`StatementMode::Unnamed`]).
// docs.rs (nightly): each item marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod calls;
pub mod driver;
pub(crate) mod engine;
pub mod fencing;
pub mod key;
#[cfg(feature = "tokio-postgres")]
pub mod pg;
mod retry;
pub mod sql;
pub mod tx;

#[cfg(feature = "tokio-postgres")]
pub use pg::inspect;

// Keys: a domain type's stable key (the rest of docs/KEYS.md is in `key`).
pub use key::{AdvisoryKey, KeySpec, LockKey};

// Locking, whatever the driver: configuration, batches, guards, errors,
// retry.
pub use engine::config::{Config, OrderCheck, StatementMode};
pub use engine::error::{sqlstate, BoxError, Error, ErrorKind};
pub use engine::facts::ServerFacts;
pub use engine::guard::{Busy, Held, HeldBatch};
pub use engine::plan::{Batch, Mode};
pub use engine::Policy;
pub use retry::{retry_blocking, RetryPolicy, Transient};

// tokio-postgres: everything of module `pg` (the adapter, session locks and
// their options, migrations, DDL, the pooler probe), as its docs promise.
#[cfg(feature = "tokio-postgres")]
pub use pg::{
    probe_pooler, published_key_types, run_ddl, session, DdlOutcome, DdlRetry, LockClient, LockTx,
    Locker, Migration, MigrationError, MigrationGuard, PoolerProbe, ProbeTimeout, PublishedKeyType,
    SessionForm, SessionGuard, SessionLock, WhenBusy, DEFAULT_CONNECTIONS, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_KEEPALIVE, DEFAULT_PROBE_TIMEOUT, MULTIPLEXED_NAME,
    PENDING_CONNECTIONS_PER_SESSION_LOCK,
};
#[cfg(feature = "tokio")]
pub use retry::retry;

/// `#[derive(AdvisoryKey)]`: see the [`AdvisoryKey`] trait and
/// `docs/KEYS.md`.
///
/// # Examples
///
/// These are the derive's examples, here so that they run as doctests (the
/// derive crate cannot depend on lockkit).
///
/// ```
/// use lockkit::{AdvisoryKey, LockKey};
///
/// #[derive(AdvisoryKey)]
/// struct Order {
///     id: i64,
/// }
///
/// // KEYS.md golden vector.
/// assert_eq!(Order { id: 42 }.lock_key(), LockKey::BigInt(-7205368663365046133));
/// ```
///
/// Type attributes:
///
/// ```
/// use lockkit::{AdvisoryKey, KeySpec, LockKey};
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(namespace = "billing.invoice", pair, class = 7)]
/// struct Invoice { id: u64 }
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(pair = "exact", class = 7)]
/// struct Account(i32);
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(raw)]
/// struct LegacyJobId(i64);
///
/// #[derive(AdvisoryKey)]
/// #[advisory_key(stripes = 1024)]
/// struct Event { business_key: String } // at most 1024 distinct keys
///
/// let invoice = Invoice { id: 9 }.lock_key();
/// assert!(matches!(invoice, LockKey::Pair(7, _)));
/// assert_eq!(invoice, KeySpec::new("billing.invoice").class(7).key_of(&9_u64));
/// assert_eq!(Account(5).lock_key(), LockKey::Pair(7, 5));
/// assert_eq!(LegacyJobId(9).lock_key(), LockKey::BigInt(9));
/// // KEYS.md golden vector.
/// let event = Event { business_key: "a1b2c3d4".into() };
/// assert_eq!(event.lock_key(), LockKey::BigInt(5974306380683673735));
/// ```
///
/// Field attributes:
///
/// ```
/// use lockkit::AdvisoryKey;
///
/// fn cents(amount: &f64, parts: &mut lockkit::key::Parts<'_>) {
///     parts.put(&((amount * 100.0).round() as i64));
/// }
///
/// #[derive(AdvisoryKey)]
/// struct Payment {
///     order: u64,
///     #[advisory_key(with = "cents")]
///     amount: f64,
///     #[advisory_key(skip)]
///     note: String,
/// }
///
/// let a = Payment { order: 1, amount: 12.5, note: "first".into() };
/// let b = Payment { order: 1, amount: 12.5, note: "second".into() };
/// let c = Payment { order: 1, amount: 12.75, note: "first".into() };
/// assert_eq!(a.lock_key(), b.lock_key()); // `note` is skipped
/// assert_ne!(a.lock_key(), c.lock_key());
/// ```
#[cfg(feature = "derive")]
pub use lockkit_derive::AdvisoryKey;

/// What every adapter crate re-exports (`pub use lockkit::adapter::*;`), so
/// that an application depending on one adapter alone finds everything it
/// uses: the key trait (and its derive, with the `derive` feature), what a
/// key is made of, lockkit's key functions, and what the lock calls take
/// and return. Each adapter adds its retry loop (`retry` or
/// `retry_blocking`) and its own types.
pub mod adapter {
    // Keys: what a key type is made of, and lockkit's key functions.
    pub use crate::key::{
        hash_bytes, hashtext, hashtext_key, hashtext_key_with, hashtext_with, parts_bytes,
        ByteOrder, HashText, KeyForm, KeyPart, NamespaceError, Parts, PgLocksId, MAX_NAMESPACE_LEN,
    };
    // The trait and, with the `derive` feature, its derive.
    pub use crate::{AdvisoryKey, KeySpec, LockKey};
    // What the lock calls take and return.
    pub use crate::{
        sqlstate, Batch, BoxError, Busy, Config, Error, ErrorKind, Held, HeldBatch, Mode,
        OrderCheck, Policy, ServerFacts, StatementMode,
    };
    // Retrying transient failures: the policy (the loop is the adapter's).
    pub use crate::{RetryPolicy, Transient};
}

/// Not public API: what `#[derive(AdvisoryKey)]` expands to.
#[doc(hidden)]
pub mod __private {
    pub use crate::key::encoding::{KeyPart, Parts};
    pub use crate::key::linked::LinkedKeyType;
    pub use crate::key::{AdvisoryKey, KeySpec, LockKey};
    pub use core;
    pub use inventory;
}

/// The README's examples compile (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
