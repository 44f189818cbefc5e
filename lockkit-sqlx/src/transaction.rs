//! [`LockTx`]: a sqlx connection inside a transaction, with the advisory
//! locks it took.

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::time::Duration;

use lockkit::engine::{Grant, Request, SavepointEnd, TxSlot, TxState, Wait};
use lockkit::{AdvisoryKey, Batch, Busy, Error, ErrorKind, Held, HeldBatch, Mode};
use sqlx::{Connection, PgConnection};

use crate::error::lock_error;
use crate::exec;
use crate::locker::{BoxFuture, Locker};

/// A sqlx connection inside a transaction, taking transaction-scoped
/// advisory locks.
///
/// Made by [`Locker::lock_tx`] over an open `sqlx::Transaction`, by
/// [`Locker::transaction`] and [`Locker::locked_transaction`], and by
/// [`LockTx::savepoint`]. Run queries on [`LockTx::conn`] (or `&mut *tx`:
/// it dereferences to `PgConnection`).
///
/// Locks are released by the server at `COMMIT` or `ROLLBACK` (or a rollback
/// of the savepoint that took them), or at once when an error aborts the
/// transaction; never earlier. Guards borrow the transaction (not the
/// `LockTx`, so queries can run while they live), so none outlives it.
/// Every lock call first checks sqlx's transaction depth and fails with
/// [`ErrorKind::NotInTransaction`] at depth 0.
///
/// It remembers what it holds: locking a held key again costs no round trip,
/// the budget counts distinct keys, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] rather than raw
/// `SAVEPOINT` SQL or a nested `begin()`, which this bookkeeping cannot see.
///
/// # Round trips
///
/// sqlx cannot pipeline statements with parameters, so each of the
/// engine's statements is one round trip: a lock or a batch of one key
/// space takes one; a batch that mixes `BigInt` and `Pair` keys two; a
/// timed lock five (savepoint, set the timeouts, lock, restore them,
/// release); a try-batch three.
pub struct LockTx<'t> {
    conn: &'t mut PgConnection,
    state: TxSlot<'t>,
    locker: Locker,
    depth: u32,
}

impl fmt::Debug for LockTx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockTx")
            .field("depth", &self.depth)
            .field("state", &*self.state)
            .finish_non_exhaustive()
    }
}

impl Deref for LockTx<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
    }
}

impl DerefMut for LockTx<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
    }
}

impl<'t> LockTx<'t> {
    /// A top-level `LockTx` on `conn`, whose transaction is open.
    pub(crate) fn attach(locker: Locker, conn: &'t mut PgConnection) -> LockTx<'t> {
        LockTx {
            conn,
            state: TxSlot::Owned(TxState::new()),
            locker,
            depth: 0,
        }
    }

    /// The connection, for queries inside the transaction.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// The locker this transaction belongs to.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// Savepoint depth below this `LockTx`'s transaction: 0 for the
    /// transaction itself, 1 inside one [`LockTx::savepoint`], ….
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Distinct keys this transaction holds through lockkit.
    pub fn held_count(&self) -> usize {
        self.state.held_count()
    }

    /// Whether this transaction holds `key` in at least `mode`, as far as
    /// lockkit took it.
    pub fn holds<K: AdvisoryKey + ?Sized>(&self, key: &K, mode: Mode) -> bool {
        self.state.holds(key.lock_key(), mode)
    }

    /// Whether an earlier lock call was cut off (its future dropped, or its
    /// reply not lockkit's), so that what this transaction holds is unknown
    /// and every lock call fails: roll it back.
    pub fn is_poisoned(&self) -> bool {
        self.state.is_poisoned()
    }

    /// Runs `f` in a savepoint (sqlx's nested transaction): released when
    /// `f` returns `Ok`, rolled back when it returns `Err`. Locks taken in a
    /// rolled-back savepoint are released by the server and forgotten here
    /// (budget and held set); those of a released one belong to this
    /// transaction. If `f` panics or this future is dropped, sqlx rolls the
    /// savepoint back before the connection's next use, and it is forgotten
    /// here too; dropped while its `RELEASE` is in flight, this transaction
    /// is poisoned (whether the savepoint's locks are still held is
    /// unknown).
    ///
    /// ```no_run
    /// # use lockkit_sqlx::{AdvisoryKey, LockTx};
    /// # #[derive(AdvisoryKey)] struct Job { id: i64 }
    /// # async fn run(tx: &mut LockTx<'_>) -> Result<(), lockkit::Error> {
    /// let outcome = tx
    ///     .savepoint(|sp| {
    ///         Box::pin(async move {
    ///             let _job = sp.lock(Job { id: 1 }).await?;
    ///             Err::<(), _>(lockkit::Error::other("changed my mind"))
    ///         })
    ///     })
    ///     .await;
    /// assert!(outcome.is_err());
    /// assert!(!tx.holds(&Job { id: 1 }, lockkit_sqlx::Mode::Exclusive)); // released
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `f`'s error, or sqlx's (as [`lockkit::Error`], converted into `E`)
    /// when `SAVEPOINT`, `RELEASE` or `ROLLBACK TO` fails (after which this
    /// transaction's lock calls fail with [`ErrorKind::Poisoned`]: roll it
    /// back).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls the savepoint back (see above).
    pub async fn savepoint<R, E, F>(&mut self, f: F) -> Result<R, E>
    where
        F: for<'a, 's> FnOnce(&'a mut LockTx<'s>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        let depth = self.depth + 1;
        let state = &*self.state;
        let mut sp = self
            .conn
            .begin()
            .await
            .map_err(|e| E::from(lock_error(e)))?;
        // Dropped while `f` runs or `ROLLBACK TO` is in flight, sqlx rolls
        // the savepoint back before the connection's next use; dropped
        // while `RELEASE` is, whether it ran is unknown.
        let mut ending = state.ending(depth, SavepointEnd::RolledBack);
        let result = {
            let mut inner = LockTx {
                conn: &mut sp,
                state: TxSlot::Borrowed(state),
                locker: self.locker.clone(),
                depth,
            };
            f(&mut inner).await
        };
        match result {
            Ok(value) => {
                ending.if_dropped(SavepointEnd::Unknown);
                match sp.commit().await {
                    Ok(()) => {
                        ending.record(SavepointEnd::Released);
                        Ok(value)
                    }
                    Err(e) => {
                        ending.record(SavepointEnd::Unknown);
                        Err(E::from(lock_error(e)))
                    }
                }
            }
            Err(user) => {
                ending.record(match sp.rollback().await {
                    Ok(()) => SavepointEnd::RolledBack,
                    Err(_) => SavepointEnd::Unknown,
                });
                Err(user)
            }
        }
    }

    /// Takes `key` exclusive, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// Before anything is sent: [`ErrorKind::NotInTransaction`],
    /// [`ErrorKind::BudgetExceeded`], [`ErrorKind::LockOrder`] (when
    /// configured), [`ErrorKind::HotStandby`], [`ErrorKind::Poisoned`],
    /// [`ErrorKind::TransactionAborted`], [`ErrorKind::HashtextMismatch`].
    /// After, with the transaction aborted: [`ErrorKind::Deadlock`],
    /// [`ErrorKind::LockTableFull`], [`ErrorKind::Timeout`] (the session's
    /// own `lock_timeout`/`statement_timeout`), [`ErrorKind::Cancelled`]
    /// (`pg_cancel_backend`), [`ErrorKind::ConnectionLost`] and other server
    /// errors; [`ErrorKind::UnexpectedReply`] (the transaction is poisoned)
    /// when the server's answer is not the reply of lockkit's statement.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after its statement was sent poisons the
    /// transaction (the server may grant the lock): every later lock call
    /// fails with [`ErrorKind::Poisoned`]; roll it back. sqlx has no cancel
    /// request, so the server keeps waiting for the lock: the connection
    /// answers nothing else (sqlx's next use of it, the `ROLLBACK` of a
    /// dropped `Transaction` included, first waits for the lock statement's
    /// reply) until the lock is granted, the session's own
    /// `lock_timeout`/`statement_timeout` fires, or the statement is
    /// cancelled from another session (`pg_cancel_backend`). To bound the
    /// wait, use [`LockTx::lock_timeout`], which the server enforces, rather
    /// than dropping the future.
    #[track_caller]
    pub fn lock<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K> {
        self.lock_one(key, Mode::Exclusive, Wait::Forever, Location::caller())
    }

    /// Takes `key` shared: other shared holders are admitted, exclusive ones
    /// excluded.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    #[track_caller]
    pub fn lock_shared<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K> {
        self.lock_one(key, Mode::Shared, Wait::Forever, Location::caller())
    }

    /// Takes `key` exclusive, waiting at most `timeout` (measured by the
    /// server). On timeout nothing is held and the transaction is still
    /// usable.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Timeout`] (with [`Error::timeout`] set), and as
    /// [`LockTx::lock`]; after a deadlock or a cancel the savepoint rollback
    /// leaves the transaction usable too.
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`]; the server still ends the wait within `timeout`.
    #[track_caller]
    pub fn lock_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K> {
        let site = Location::caller();
        self.lock_one(key, Mode::Exclusive, Wait::Timeout(timeout), site)
    }

    /// Takes `key` shared, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock_timeout`].
    #[track_caller]
    pub fn lock_shared_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K> {
        let site = Location::caller();
        self.lock_one(key, Mode::Shared, Wait::Timeout(timeout), site)
    }

    /// Takes `key` exclusive if no other transaction holds it, without
    /// waiting. Gives the key back when it is busy.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`] (a full lock table raises `53200` even here),
    /// but never `LockOrder`: a try does not wait, so it cannot deadlock.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future poisons the transaction, as [`LockTx::lock`];
    /// the statement does not wait, so the connection is free within a
    /// round trip.
    #[track_caller]
    pub fn try_lock<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> impl Future<Output = Result<Result<Held<'t, K>, K>, Error>> + use<'_, 't, K> {
        self.try_lock_one(key, Mode::Exclusive, Location::caller())
    }

    /// Takes `key` shared if no transaction holds it exclusive, without
    /// waiting. Gives the key back when it is busy.
    ///
    /// # Errors
    ///
    /// As [`LockTx::try_lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::try_lock`].
    #[track_caller]
    pub fn try_lock_shared<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> impl Future<Output = Result<Result<Held<'t, K>, K>, Error>> + use<'_, 't, K> {
        self.try_lock_one(key, Mode::Shared, Location::caller())
    }

    /// Takes every key of `batch` in the global lock order: one statement,
    /// or two (`BigInt` keys, then `Pair` keys) when the batch mixes both.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    #[track_caller]
    pub fn lock_batch(
        &mut self,
        batch: &Batch,
    ) -> impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't> {
        self.acquire(batch, Wait::Forever, Location::caller())
    }

    /// Takes every key of `batch`, waiting at most `timeout` for the whole
    /// batch (both key spaces together). On timeout nothing of the batch is
    /// held and the transaction is still usable.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock_timeout`].
    #[track_caller]
    pub fn lock_batch_timeout(
        &mut self,
        batch: &Batch,
        timeout: Duration,
    ) -> impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't> {
        self.acquire(batch, Wait::Timeout(timeout), Location::caller())
    }

    /// Takes every key of `batch` or none: when any key is busy, nothing of
    /// the batch is held and the busy keys are returned.
    ///
    /// # Errors
    ///
    /// As [`LockTx::try_lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::try_lock`].
    #[track_caller]
    pub fn try_lock_batch(
        &mut self,
        batch: &Batch,
    ) -> impl Future<Output = Result<Result<HeldBatch<'t>, Busy>, Error>> + use<'_, 't> {
        let request = Request::batch(batch).at(Location::caller());
        async move { Grant::try_lock_batch(self.drive(request, Wait::Try).await) }
    }

    async fn lock_one<K: AdvisoryKey>(
        &mut self,
        value: K,
        mode: Mode,
        wait: Wait,
        site: &'static Location<'static>,
    ) -> Result<Held<'t, K>, Error> {
        let outcome = match wait {
            Wait::Forever => self.send_one(&value, mode, false, site).await,
            wait => self.drive(Request::one(&value, mode).at(site), wait).await,
        };
        Grant::lock(outcome, value)
    }

    async fn try_lock_one<K: AdvisoryKey>(
        &mut self,
        value: K,
        mode: Mode,
        site: &'static Location<'static>,
    ) -> Result<Result<Held<'t, K>, K>, Error> {
        Grant::try_lock(self.send_one(&value, mode, true, site).await, value)
    }

    /// [`LockTx::lock_batch`] asked for at `site` (for lockkit's own calls
    /// on the application's behalf, such as
    /// [`Locker::locked_transaction`]).
    pub(crate) fn lock_batch_at(
        &mut self,
        batch: &Batch,
        site: &'static Location<'static>,
    ) -> impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't> {
        self.acquire(batch, Wait::Forever, site)
    }

    /// The batch's request is made before the future, which then does not
    /// borrow `batch`.
    fn acquire(
        &mut self,
        batch: &Batch,
        wait: Wait,
        site: &'static Location<'static>,
    ) -> impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't> {
        let request = Request::batch(batch).at(site);
        async move { Grant::lock_batch(self.drive(request, wait).await) }
    }

    /// Checks sqlx's transaction depth, then runs a one-key call of one
    /// statement (a lock that waits, or a try) asked for at `site`.
    async fn send_one<K: AdvisoryKey>(
        &mut self,
        value: &K,
        mode: Mode,
        try_only: bool,
        site: &'static Location<'static>,
    ) -> Result<Result<Grant, Busy>, Error> {
        self.check_in_transaction()?;
        let policy = self.locker.policy();
        let call =
            self.state
                .acquire_one(policy, self.depth, (value, mode), try_only, Some(site))?;
        let mode = policy.config().statement_mode();
        call.run(
            |statement| exec::run(self.conn, statement, mode),
            exec::reply,
        )
        .await
    }

    /// Checks sqlx's transaction depth, then lets the engine run the call.
    async fn drive(&mut self, request: Request, wait: Wait) -> Result<Result<Grant, Busy>, Error> {
        self.check_in_transaction()?;
        let policy = self.locker.policy();
        let call = self.state.acquire(policy, self.depth, request, wait)?;
        let mode = policy.config().statement_mode();
        call.run(|call| exec::drive(self.conn, mode, call)).await
    }
}

impl LockTx<'_> {
    /// A lock call outside a transaction (sqlx's transaction already
    /// ended) is refused before anything is sent.
    fn check_in_transaction(&mut self) -> Result<(), Error> {
        match self.conn.is_in_transaction() {
            true => Ok(()),
            false => Err(Error::from(ErrorKind::NotInTransaction)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_and_tx_are_send() {
        fn send<T: Send>() {}
        send::<LockTx<'static>>();
        send::<Held<'static, i64>>();
        send::<HeldBatch<'static>>();
        send::<Busy>();
    }
}
