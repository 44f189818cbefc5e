//! lockkit's typed, transaction-scoped PostgreSQL advisory locks inside
//! Diesel transactions.
//!
//! The same keys, sorted batches, lock budget, order check and timeouts as
//! lockkit's tokio-postgres core, from the same code: key encoding, batch
//! planning, budget bookkeeping, SQL text and error mapping are lockkit's
//! ([`lockkit::driver`]); this crate only runs the engine's statements
//! through Diesel. A Diesel session and a tokio-postgres session locking the same
//! typed key exclude each other.
//!
//! # Example
//!
//! ```no_run
//! use diesel::prelude::*;
//! use lockkit_diesel::{AdvisoryKey, Batch, Config, Locker};
//!
//! #[derive(AdvisoryKey)]
//! struct Account {
//!     id: i64,
//! }
//!
//! fn main() -> Result<(), lockkit_diesel::Error> {
//!     let mut conn = PgConnection::establish("postgres://localhost/bank")
//!         .expect("connect");
//!     let locker = Locker::new(&mut conn, Config::default())?;
//!
//!     // Both accounts, in the global lock order whatever the direction of
//!     // the transfer: two concurrent opposite transfers cannot deadlock.
//!     let batch = Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 });
//!     locker.transaction(&mut conn, |tx| {
//!         let _held = tx.lock_batch(&batch)?; // until COMMIT or ROLLBACK
//!         diesel::sql_query("UPDATE accounts SET cents = cents - 500 WHERE id = 7")
//!             .execute(tx.conn())?; // a diesel::result::Error converts with `?`
//!         diesel::sql_query("UPDATE accounts SET cents = cents + 500 WHERE id = 3")
//!             .execute(tx.conn())?;
//!         Ok::<_, lockkit_diesel::Error>(())
//!     })?; // COMMIT releases both locks
//!     Ok(())
//! }
//! ```
//!
//! # Two forms
//!
//! - [`Locker::transaction`]: `conn.transaction` with a [`LockTx`], whose
//!   methods take keys one by one, shared or exclusive, waiting, with a
//!   timeout, or trying; batches and try-batches (all or nothing); and
//!   [`LockTx::savepoint`] for nested transactions.
//! - [`Locker::lock_tx`] inside Diesel's own
//!   `conn.transaction(|conn| …)`: the same [`LockTx`] over the open
//!   transaction.
//!
//! With lockkit's `diesel` feature (turned on by this crate), [`Error`]
//! (lockkit's) converts `From<diesel::result::Error>`, so one error type
//! works with `?` for both lock calls and queries:
//! `conn.transaction::<_, lockkit_diesel::Error, _>(|conn| …)`.
//!
//! # Depending on this crate alone
//!
//! `lockkit-diesel` is the only lockkit dependency a Diesel application
//! needs. It re-exports what its API takes and returns, and what keys are
//! made of: [`AdvisoryKey`] and its derive (feature `derive`, on by
//! default), [`KeyPart`], [`Parts`], [`KeySpec`], [`LockKey`], [`HashText`]
//! and the `hashtext` functions; [`Batch`], [`Mode`], [`Config`],
//! [`OrderCheck`], [`StatementMode`]; [`Held`], [`HeldBatch`], [`Busy`];
//! [`Error`], [`ErrorKind`], [`sqlstate`]; [`RetryPolicy`],
//! [`retry_blocking`], [`Transient`]; [`ServerFacts`]. The rest
//! of lockkit (its `driver` module, say) is at [`lockkit`](mod@lockkit).
//!
//! `#[derive(AdvisoryKey)]` finds lockkit by itself: through a direct
//! dependency on `lockkit` if the crate has one (renamed or not), else
//! through this crate's `lockkit_diesel::lockkit` (renamed or not), read from
//! the crate's Cargo.toml. `#[advisory_key(crate = "...")]` names the path
//! explicitly where that guess is wrong: in the library of a crate that
//! depends on this crate and has lockkit among its dev-dependencies only,
//! write `#[advisory_key(crate = "::lockkit_diesel::lockkit")]`.
//!
//! # Statements, and transaction-mode poolers
//!
//! lockkit's statements are sent unnamed by default
//! ([`StatementMode::Unnamed`]): safe behind every pooler, a
//! transaction-mode pgbouncer shared with other applications included. On a
//! direct connection, `Config::default().statements(StatementMode::Prepared)`
//! puts them in the connection's own statement cache (prepared once per
//! connection, then only bound and run). Behind a transaction-mode pooler
//! (pgbouncer before 1.21, or without `max_prepared_statements`) Diesel's
//! statement names (`__diesel_stmt_0`, …) may mean another client's
//! statement on the backend a transaction lands on, or none: a lock call in
//! that mode then fails with [`ErrorKind::UnexpectedReply`], never succeeds
//! without its lock (and the application's own cached queries break the
//! same way: disable Diesel's statement cache there).
//!
//! # Transactions only
//!
//! Every lock call checks Diesel's transaction depth and fails with
//! [`ErrorKind::NotInTransaction`] at depth 0: PostgreSQL would release a
//! transaction-scoped lock at the end of its statement, silently.
//!
//! # Errors
//!
//! Diesel does not expose the SQLSTATE. Its `DatabaseErrorKind` names
//! `40001` and a closed connection; deadlocks (`40P01`), lock and statement
//! timeouts (`55P03`, `57014`), a full lock table (`53200`) and an aborted
//! transaction (`25P02`) are recognised by the server's English message
//! (the default `lc_messages`). See [`Policy::recognizes_errors`].
//!
//! # Differences from the tokio-postgres core
//!
//! - Diesel's API is blocking and has no pipelining: a batch that mixes
//!   `BigInt` and `Pair` keys takes two round trips (one statement each, in
//!   the global order), and a lock with a timeout takes four.
//! - Guards do not borrow the [`LockTx`] (Diesel queries need
//!   `&mut PgConnection`); their lifetime ties them to the transaction's
//!   closure instead.
mod driver;
mod locker;

pub use locker::Locker;

/// A Diesel connection inside a transaction, taking transaction-scoped
/// advisory locks: lockkit's one [`LockTx`](lockkit::tx::LockTx) over
/// Diesel, whose calls return their result (Diesel blocks).
///
/// Made by [`Locker::transaction`], by
/// [`Locker::lock_tx`] inside Diesel's own
/// `conn.transaction(|conn| …)`, and by
/// [`LockTx::savepoint`](lockkit::tx::LockTx::savepoint). Guards borrow the
/// connection (not the `LockTx`, so queries can run while they live), so
/// none outlives the transaction's closure.
pub type LockTx<'t> = lockkit::tx::LockTx<'t, Locker>;

/// The lockkit crate, for what is not re-exported here. Also the path
/// `#[derive(AdvisoryKey)]` names in a crate that depends on `lockkit-diesel`
/// and not on `lockkit`: keep it.
pub use lockkit;

// The key trait and its derive, the key functions, and what the lock calls
// take and return: lockkit's `adapter` module, the same names in every
// adapter. A plain comment: a doc comment here would be prepended to the
// docs of every item the glob re-exports.
pub use lockkit::adapter::*;
// Retrying a whole transaction after a transient failure (deadlock,
// serialization failure, timeout), for blocking code.
pub use lockkit::retry_blocking;
