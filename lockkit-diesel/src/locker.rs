//! [`Locker`]: configuration plus the server facts, shared by every
//! transaction of an application, and how every locked transaction begins.

use std::sync::Arc;

use diesel::PgConnection;
use lockkit::driver::diesel::learned_policy;
use lockkit::driver::Policy;
use lockkit::{Config, Error};

use crate::driver as pg;
use crate::LockTx;

/// Takes transaction-scoped advisory locks over Diesel's `PgConnection`.
///
/// A locker holds the [`Config`] and the
/// [`ServerFacts`](lockkit::ServerFacts) it learned in one query when
/// created, so taking a lock costs no extra round trip. It is cheap to
/// clone (an `Arc`) and `Send + Sync`: make one at startup and share it
/// among threads and pooled connections of the same server.
///
/// See the [crate docs](crate) for an example.
#[derive(Clone, Debug)]
pub struct Locker {
    inner: Arc<Policy>,
}

lockkit::locker_basics!(Locker);

impl Locker {
    /// Learns the server's facts through `conn` (two queries) and builds a
    /// locker with `config`.
    ///
    /// Also reads the server's `lc_messages`: Diesel hides the SQLSTATE, so
    /// deadlocks, timeouts and a full lock table are recognised by the
    /// server's English message. When the messages are in another language a
    /// `tracing` warning says so, and such errors become
    /// [`ErrorKind::Database`](lockkit::ErrorKind::Database) (see [`Policy::recognizes_errors`]).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Database`](lockkit::ErrorKind::Database) or [`ErrorKind::ConnectionLost`](lockkit::ErrorKind::ConnectionLost) when a query fails.
    pub fn new(conn: &mut PgConnection, config: Config) -> Result<Locker, Error> {
        let (facts, messages) = pg::server_facts(conn)?;
        Ok(Locker {
            inner: Arc::new(learned_policy(config, &facts, &messages, "lockkit-diesel")),
        })
    }

    /// A [`LockTx`] over the transaction open on `conn`, inside Diesel's own
    /// `conn.transaction(|conn| …)`, with bookkeeping (held set, budget,
    /// order check) that lasts as long as it does: make one per transaction
    /// and take every lock through it. A panic inside Diesel's
    /// `conn.transaction` leaves the transaction open (Diesel's behaviour;
    /// an r2d2 pool then discards the connection, which releases its
    /// locks); [`Locker::transaction`] rolls back instead.
    ///
    /// ```no_run
    /// use diesel::prelude::*;
    /// use lockkit_diesel::{AdvisoryKey, Locker};
    ///
    /// #[derive(AdvisoryKey)]
    /// struct Order {
    ///     id: i64,
    /// }
    ///
    /// # fn run(conn: &mut PgConnection, locker: &Locker) -> Result<(), lockkit_diesel::Error> {
    /// conn.transaction::<_, lockkit_diesel::Error, _>(|conn| {
    ///     let mut tx = locker.lock_tx(conn)?;
    ///     let order = tx.lock(Order { id: 42 })?; // held until COMMIT/ROLLBACK
    ///     diesel::sql_query("UPDATE orders SET state = 'paid' WHERE id = $1")
    ///         .bind::<diesel::sql_types::BigInt, _>(order.id)
    ///         .execute(tx.conn())?;
    ///     Ok(())
    /// })
    /// # }
    /// ```
    ///
    /// The transaction is Diesel's, and so is its commit: after a lock
    /// call's error that aborts it (a deadlock, the session's own
    /// `lock_timeout`), PostgreSQL answers `COMMIT` by rolling back, and
    /// Diesel's `conn.transaction` reports success. Return the error (`?`),
    /// or use [`transaction`](Self::transaction), whose commit refuses.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::NotInTransaction`](lockkit::ErrorKind::NotInTransaction)
    /// when Diesel has no transaction open on `conn` (its transaction depth
    /// is 0): outside a transaction block an xact lock would be released at
    /// the end of its statement.
    pub fn lock_tx<'t>(&self, conn: &'t mut PgConnection) -> Result<LockTx<'t>, Error> {
        lockkit::driver::lock_tx(self, conn)
    }

    /// Runs `f` in a transaction on `conn`, like Diesel's
    /// `conn.transaction(f)`, with a [`LockTx`] that takes advisory locks.
    /// Commits when `f` returns `Ok`; rolls back when it returns `Err` or
    /// panics (Diesel's own `transaction` leaves the transaction open on a
    /// panic; this one rolls it back, releasing the locks, and resumes the
    /// panic). Called inside an open Diesel transaction, it runs in a
    /// savepoint, as Diesel does.
    ///
    /// Works with r2d2-pooled connections: `&mut pooled` dereferences to
    /// `&mut PgConnection`.
    ///
    /// # Errors
    ///
    /// `f`'s error, or Diesel's when `BEGIN`, `COMMIT` or `ROLLBACK` fails.
    ///
    /// [`ErrorKind::TransactionAborted`](lockkit::ErrorKind::TransactionAborted),
    /// rolled back instead of committed, when `f` returns `Ok` after a lock
    /// call's error aborted the transaction (PostgreSQL answers `COMMIT`
    /// there by rolling back, which Diesel reports as success).
    pub fn transaction<R, E, F>(&self, conn: &mut PgConnection, f: F) -> Result<R, E>
    where
        F: FnOnce(&mut LockTx<'_>) -> Result<R, E>,
        E: From<Error>,
    {
        lockkit::driver::transaction_blocking(self, conn, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locker_is_send_sync() {
        fn check<T: Send + Sync + Clone + 'static>() {}
        check::<Locker>();
    }
}
