//! lockkit's typed, transaction-scoped PostgreSQL advisory locks inside
//! sqlx transactions.
//!
//! The same keys, sorted batches, lock budget, order check, timeouts and
//! errors as lockkit's tokio-postgres core, from the same code: planning,
//! checking every reply, bookkeeping and error typing are lockkit's engine
//! ([`lockkit::driver`]); this crate only runs the engine's statements
//! through sqlx. A sqlx session and a tokio-postgres or Diesel session
//! locking the same typed key exclude each other.
//!
//! Depending on this crate alone is enough: it re-exports [`lockkit`] (so
//! `#[derive(AdvisoryKey)]` finds it), the derive, the key trait, what a key
//! is made of and lockkit's key functions, the types its API uses (the same
//! names as every lockkit adapter: [`lockkit::adapter`]), and the async
//! [`retry`] loop.
//!
//! # Example
//!
//! ```no_run
//! use lockkit_sqlx::{AdvisoryKey, Batch, Config, Locker, SqlxResultExt};
//!
//! #[derive(AdvisoryKey)]
//! struct Account {
//!     id: i64,
//! }
//!
//! # async fn run() -> Result<(), lockkit_sqlx::Error> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/bank").await.lock_err()?;
//! let locker = Locker::new(&pool, Config::default()).await?;
//!
//! // Both accounts, in the global lock order whatever the direction of the
//! // transfer: two concurrent opposite transfers cannot deadlock.
//! let mut tx = pool.begin().await.lock_err()?;
//! {
//!     let mut ltx = locker.lock_tx(&mut tx)?;
//!     let _held = ltx
//!         .lock_batch(&Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 }))
//!         .await?;
//!     sqlx::query("UPDATE accounts SET cents = cents - 500 WHERE id = 7")
//!         .execute(&mut *ltx)
//!         .await
//!         .lock_err()?;
//!     sqlx::query("UPDATE accounts SET cents = cents + 500 WHERE id = 3")
//!         .execute(&mut *ltx)
//!         .await
//!         .lock_err()?;
//! }
//! tx.commit().await.lock_err()?; // COMMIT releases both locks
//! # Ok(())
//! # }
//! ```
//!
//! # Forms
//!
//! [`Locker::lock_tx`] over an open `sqlx::Transaction` (its guards borrow
//! the transaction, so none outlives its `COMMIT`); [`Locker::transaction`],
//! in the style of sqlx's `Connection::transaction`;
//! [`LockTx::savepoint`](lockkit::tx::LockTx::savepoint).
//!
//! # Statements, and transaction-mode poolers
//!
//! lockkit's statements are sent unnamed by default
//! ([`StatementMode::Unnamed`]): safe behind every pooler, a
//! transaction-mode pgbouncer shared with other applications included. On a
//! direct connection, `Config::default().statements(StatementMode::Prepared)`
//! makes them sqlx's persistent statements, prepared once per connection;
//! behind a pooler that does not keep named statements a lock call would
//! then fail with [`ErrorKind::UnexpectedReply`] (never succeed without its
//! lock).
//!
//! # Errors
//!
//! Lock calls fail with [`lockkit::Error`], typed by the SQLSTATE sqlx
//! exposes (`sqlx::error::DatabaseError::code`).
//! `From<sqlx::Error> for lockkit::Error` cannot be written outside lockkit
//! (Rust's orphan rule), so sqlx's own errors convert with [`lock_error`]
//! or `.lock_err()?` ([`SqlxResultExt`]).
//!
//! # Differences from the tokio-postgres core
//!
//! One statement per round trip, and no cancel request for a dropped lock
//! future (sqlx has none): see [`LockTx::lock`].
pub mod driver;
mod error;
mod locker;

pub use error::{driver_error, lock_error, SqlxResultExt};
pub use locker::Locker;
pub use lockkit::tx::BoxFuture;

/// A sqlx connection inside a transaction, taking transaction-scoped
/// advisory locks: lockkit's one [`LockTx`](lockkit::tx::LockTx) over sqlx.
///
/// Made by [`Locker::lock_tx`] over an open `sqlx::Transaction`, by
/// [`Locker::transaction`], and by
/// [`LockTx::savepoint`](lockkit::tx::LockTx::savepoint). Guards borrow
/// the transaction (not the `LockTx`, so queries can run while they live),
/// so none outlives it.
pub type LockTx<'t> = lockkit::tx::LockTx<'t, Locker>;

/// lockkit itself, so that `#[derive(AdvisoryKey)]` and applications that
/// depend only on this crate find it.
pub use lockkit;
// The key trait and its derive, the key functions, and what the lock calls
// take and return: lockkit's `adapter` module, the same names in every
// adapter. A plain comment: a doc comment here would be prepended to the
// docs of every item the glob re-exports.
pub use lockkit::adapter::*;
// Retrying a whole transaction after a transient failure (deadlock,
// serialization failure, timeout).
pub use lockkit::retry;
