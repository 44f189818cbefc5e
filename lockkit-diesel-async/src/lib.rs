//! lockkit's typed, transaction-scoped PostgreSQL advisory locks inside
//! diesel-async transactions.
//!
//! The same keys, sorted batches, lock budget, order check, timeouts and
//! errors as lockkit's tokio-postgres core and `lockkit-diesel`, from the
//! same code: planning, checking every reply, bookkeeping and error typing
//! are lockkit's engine ([`lockkit::driver`]); this crate only runs the
//! engine's statements through diesel-async and, for a lock future dropped
//! in flight, sends a cancel request and rolls the transaction back so that
//! diesel-async cannot report its commit ([`LockTx::lock`]). A diesel-async
//! session and a tokio-postgres, Diesel or sqlx session locking the same
//! typed key exclude each other.
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
//! use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
//! use lockkit_diesel_async::{AdvisoryKey, Batch, Config, Locker};
//!
//! #[derive(AdvisoryKey)]
//! struct Account {
//!     id: i64,
//! }
//!
//! # async fn run() -> Result<(), lockkit_diesel_async::Error> {
//! let mut conn = AsyncPgConnection::establish("postgres://localhost/bank").await
//!     .map_err(lockkit_diesel_async::Error::other)?;
//! let locker = Locker::new(&mut conn, Config::default()).await?;
//!
//! conn.transaction::<_, lockkit_diesel_async::Error, _>(async |conn| {
//!     let mut tx = locker.lock_tx(conn)?;
//!     // Both accounts, in the global lock order whatever the direction of
//!     // the transfer: two concurrent opposite transfers cannot deadlock.
//!     let batch = Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 });
//!     let _held = tx.lock_batch(&batch).await?;
//!     diesel::sql_query("UPDATE accounts SET cents = cents - 500 WHERE id = 7")
//!         .execute(tx.conn())
//!         .await?; // a diesel::result::Error converts with `?`
//!     diesel::sql_query("UPDATE accounts SET cents = cents + 500 WHERE id = 3")
//!         .execute(tx.conn())
//!         .await?;
//!     Ok(())
//! })
//! .await // COMMIT releases both locks
//! # }
//! ```
//!
//! With a pool (features `deadpool` or `bb8`, which turn on diesel-async's),
//! take the transaction on the pooled connection: `(&mut *pooled)` is an
//! `&mut AsyncPgConnection`.
//!
//! # Panics inside a transaction
//!
//! diesel-async cannot roll back in a destructor: when the closure of
//! `conn.transaction` panics (or its future is dropped), the transaction
//! stays open on the connection, and so do its locks. A pool discards such
//! a connection (its transaction manager reports it broken), which closes
//! it and releases the locks: bb8 when the connection is returned, deadpool
//! when it is next checked out (deadpool recycles on checkout), so with
//! deadpool the locks of a panicked transaction stay held until then.
//! Prefer returning errors to panicking while holding locks.
//!
//! # Statements, and transaction-mode poolers
//!
//! By default ([`StatementMode::Unnamed`]) lockkit's statements stay out of
//! the connection's statement cache; on a direct connection,
//! `Config::default().statements(StatementMode::Prepared)` puts them in it,
//! which saves the server their parse.
//!
//! diesel-async names every statement it sends, cached or not (through
//! tokio-postgres, whose names `s0`, `s1`, … are counted per process), and
//! offers no way to send one unnamed: unlike the other stacks, lockkit's
//! statements here carry a name in either mode. Behind a transaction-mode
//! pooler that keeps no named statement per client (pgbouncer before 1.21,
//! or without `max_prepared_statements`) and that other processes share, a
//! server connection can hold a statement another process left under the
//! same name. So by default each of lockkit's statements is prepared under
//! a savepoint, sent with it in the same round trip: when the name is
//! taken, only the savepoint fails; lockkit rolls it back, deallocates the
//! statements of that name and of the names this process will use next
//! (`s<n>` from the taken one on, prepared on that server connection before
//! the transaction began: another process's, left between transactions),
//! and sends the statement again. What the transaction prepared itself,
//! and names of any other form, stay. On a direct connection the savepoint
//! costs two utility statements in a round trip the statement takes anyway
//! (the paired report in BENCHMARKS.md); `StatementMode::Prepared` goes
//! without it.
//!
//! In `StatementMode::Prepared`, and for the application's own
//! diesel-async queries, such a name fails the statement: lockkit's calls
//! with [`ErrorKind::UnexpectedReply`] and `42P05`, the fix in its message,
//! never a success without the lock. Behind such a pooler, keep the
//! default, and for the application's own statements use pgbouncer 1.21+
//! with `max_prepared_statements`, which names each client's statements on
//! the server itself.
//!
//! diesel-async's `AsyncPgConnection::establish` sends its two set-up
//! statements at once and, when the first fails, drops the connection
//! with the second unanswered; pgbouncer 1.18 then hands that statement's
//! answer to another client of the pooler. Behind a transaction-mode
//! pooler, make the pool's connections with [`establish`], which reads
//! every answer it is owed before it closes.
//!
//! # Errors
//!
//! diesel-async reports Diesel's errors, which do not carry the SQLSTATE:
//! as in `lockkit-diesel`, deadlocks (`40P01`), lock and statement timeouts
//! (`55P03`, `57014`), cancels, a full lock table (`53200`) and an aborted
//! transaction (`25P02`) are recognised by the server's English message
//! (the default `lc_messages`). See [`Policy::recognizes_errors`]. With
//! lockkit's `diesel` feature (turned on by this crate), [`lockkit::Error`]
//! converts `From<diesel::result::Error>`, so one error type works with `?`
//! for both lock calls and queries.
mod connect;
mod driver;
mod locker;
mod named;

pub use connect::{establish, establish_tls};
pub use locker::Locker;
pub use lockkit::tx::BoxFuture;

/// A diesel-async connection inside a transaction, taking
/// transaction-scoped advisory locks: lockkit's one
/// [`LockTx`](lockkit::tx::LockTx) over diesel-async.
///
/// Made by [`Locker::lock_tx`] inside
/// diesel-async's `conn.transaction(async |conn| …)`, and by
/// [`LockTx::savepoint`](lockkit::tx::LockTx::savepoint). Guards borrow
/// the connection (not the `LockTx`, so queries can run while they live),
/// so none outlives the transaction's closure.
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
