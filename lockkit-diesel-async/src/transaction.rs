//! [`LockTx`]: a diesel-async connection inside a transaction, with the
//! advisory locks it took.

use std::fmt;
use std::future::Future;
use std::panic::Location;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use lockkit::engine::{Grant, Request, SavepointEnd, SavepointEnding, TxSlot, TxState, Wait};
use lockkit::{AdvisoryKey, Batch, Busy, Error, ErrorKind, Held, HeldBatch, Mode};

use crate::exec::{self, BoxFuture};
use crate::locker::Locker;

/// A diesel-async connection inside a transaction, taking
/// transaction-scoped advisory locks.
///
/// Made by [`lock_tx`](crate::AsyncPgConnectionExt::lock_tx) inside
/// diesel-async's `conn.transaction(async |conn| …)`, and by
/// [`LockTx::savepoint`]. Run queries on [`LockTx::conn`].
///
/// Locks are released by the server at `COMMIT` or `ROLLBACK` (or a rollback
/// of the savepoint that took them), or at once when an error aborts the
/// transaction; never earlier. Guards borrow the connection (not the
/// `LockTx`, so queries can run while they live), so none outlives the
/// transaction's closure. Every lock call first checks diesel-async's
/// transaction depth and fails with [`ErrorKind::NotInTransaction`] at
/// depth 0.
///
/// It remembers what it holds: locking a held key again costs no round trip,
/// the budget counts distinct keys, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] rather than a nested
/// `conn.transaction` (the borrow checker sees to it) or raw `SAVEPOINT`
/// SQL, which this bookkeeping cannot see.
///
/// # Round trips
///
/// Statements go one at a time (see the crate docs): a lock or a batch of
/// one key space takes one round trip; a batch that mixes `BigInt` and
/// `Pair` keys two; a timed lock five; a try-batch three.
pub struct LockTx<'t> {
    conn: &'t mut AsyncPgConnection,
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

/// Poisons the bookkeeping, and gives the transaction up
/// ([`exec::abandon_transaction`]), when dropped before the savepoint's end
/// is recorded: a savepoint whose closure panicked or whose future was
/// dropped (before its `RELEASE` or `ROLLBACK TO` completed) is left open,
/// since diesel-async cannot roll back in a destructor. Its transaction
/// manager would go on counting it, so the enclosing `conn.transaction`'s
/// commit would only `RELEASE` the savepoint and report success with the
/// transaction (its writes, its locks) still open. Given up, the
/// transaction is rolled back at once, which releases its locks while the
/// connection waits to be discarded, and that commit fails.
struct SavepointGuard<'s, 'c> {
    ending: SavepointEnding<'s>,
    conn: &'c mut AsyncPgConnection,
}

impl Drop for SavepointGuard<'_, '_> {
    fn drop(&mut self) {
        if self.ending.is_pending() {
            exec::abandon_transaction(self.conn);
        }
    }
}

impl<'t> LockTx<'t> {
    /// A top-level `LockTx` over the transaction open on `conn`.
    pub(crate) fn attach(
        locker: &Locker,
        conn: &'t mut AsyncPgConnection,
    ) -> Result<LockTx<'t>, Error> {
        if exec::transaction_depth(conn).map_err(exec::lock_error)? == 0 {
            return Err(Error::from(ErrorKind::NotInTransaction));
        }
        Ok(LockTx {
            conn,
            state: TxSlot::Owned(TxState::new()),
            locker: locker.clone(),
            depth: 0,
        })
    }

    /// The connection, for queries inside the transaction.
    pub fn conn(&mut self) -> &mut AsyncPgConnection {
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

    /// Runs `f` in a savepoint (diesel-async's nested transaction):
    /// released when `f` returns `Ok`, rolled back when it returns `Err`.
    /// Locks taken in a rolled-back savepoint are released by the server and
    /// forgotten here (budget and held set); those of a released one belong
    /// to this transaction. If `f` panics or this future is dropped, the
    /// savepoint stays open (diesel-async cannot roll back in a destructor):
    /// this transaction is poisoned and diesel-async's transaction manager
    /// is put in error, so the enclosing `conn.transaction` fails (with
    /// Diesel's `BrokenTransactionManager`) rather than commit, the
    /// transaction and its locks stay open until the connection closes, and
    /// a pool discards the connection (as after a panic: see the crate
    /// docs). A connection outside a pool must be established again.
    ///
    /// ```no_run
    /// # use lockkit_diesel_async::{AdvisoryKey, LockTx};
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
    /// assert!(!tx.holds(&Job { id: 1 }, lockkit_diesel_async::Mode::Exclusive)); // released
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `f`'s error, or Diesel's (as [`lockkit::Error`], converted into `E`)
    /// when `SAVEPOINT`, `RELEASE` or `ROLLBACK TO` fails (after which this
    /// transaction's lock calls fail with [`ErrorKind::Poisoned`]: roll it
    /// back).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future poisons this transaction and gives it up: it is
    /// rolled back at once (which releases its locks) and the enclosing
    /// `conn.transaction` fails, even when its closure returns `Ok`; pools
    /// discard the connection.
    pub async fn savepoint<R, E, F>(&mut self, f: F) -> Result<R, E>
    where
        F: for<'a, 's> FnOnce(&'a mut LockTx<'s>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        let depth = self.depth + 1;
        let state = &*self.state;
        exec::begin(self.conn)
            .await
            .map_err(|e| E::from(exec::lock_error(e)))?;
        let mut guard = SavepointGuard {
            ending: state.ending(depth, SavepointEnd::Unknown),
            conn: &mut *self.conn,
        };
        let result = {
            let mut inner = LockTx {
                conn: &mut *guard.conn,
                state: TxSlot::Borrowed(state),
                locker: self.locker.clone(),
                depth,
            };
            f(&mut inner).await
        };
        // Pending until the bookkeeping records how the savepoint ended: a
        // future dropped during `RELEASE` or `ROLLBACK TO` leaves it unknown.
        match result {
            Ok(value) => match exec::commit(guard.conn).await {
                Ok(()) => {
                    guard.ending.record(SavepointEnd::Released);
                    Ok(value)
                }
                Err(e) => {
                    guard.ending.record(SavepointEnd::Unknown);
                    Err(E::from(exec::lock_error(e)))
                }
            },
            Err(user) => {
                guard.ending.record(match exec::rollback(guard.conn).await {
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
    /// Dropping the future after its statement was sent (a
    /// `tokio::time::timeout` around it, a `select!`) cuts the call off:
    ///
    /// - the transaction is poisoned (the server may have granted the
    ///   lock): every later lock call fails with [`ErrorKind::Poisoned`];
    /// - lockkit queues behind the cut-off statement a rollback of the
    ///   transaction, which releases its locks at once, and sends a cancel
    ///   request (diesel-async's `cancel_token`), so the server stops
    ///   waiting and the connection is free again within about a round
    ///   trip; the closure's later statements fail (`25P02`: the session is
    ///   left in a failed transaction, not outside one);
    /// - diesel-async's transaction manager is put in error, so that
    ///   `conn.transaction` fails rather than send a `COMMIT` and report
    ///   the rollback as a commit. It fails even when the closure returns
    ///   `Ok`, and pools (deadpool, bb8) discard the connection; a
    ///   connection of your own must be replaced.
    ///
    /// Under `sslmode=require` the cancel request needs the TLS connector:
    /// see [`Locker::cancel_tls`](crate::Locker::cancel_tls).
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
    /// As [`LockTx::lock`].
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

    /// Checks diesel-async's transaction depth, then runs a one-key call of
    /// one statement (a lock that waits, or a try) asked for at `site`.
    async fn send_one<K: AdvisoryKey>(
        &mut self,
        value: &K,
        mode: Mode,
        try_only: bool,
        site: &'static Location<'static>,
    ) -> Result<Result<Grant, Busy>, Error> {
        self.check_depth()?;
        let policy = self.locker.policy();
        let call =
            self.state
                .acquire_one(policy, self.depth, (value, mode), try_only, Some(site))?;
        let (canceller, mode) = (self.locker.canceller(), policy.config().statement_mode());
        let conn = &mut *self.conn;
        call.run(
            move |statement| exec::send_one(conn, mode, canceller, statement),
            |_, a| a.reply(),
        )
        .await
    }

    /// Checks diesel-async's transaction depth, then lets the engine run the
    /// call.
    async fn drive(&mut self, request: Request, wait: Wait) -> Result<Result<Grant, Busy>, Error> {
        self.check_depth()?;
        let policy = self.locker.policy();
        let call = self.state.acquire(policy, self.depth, request, wait)?;
        let canceller = self.locker.canceller();
        let mode = policy.config().statement_mode();
        call.run(|call| exec::drive(self.conn, mode, canceller, call))
            .await
    }
}

impl LockTx<'_> {
    /// A lock call outside a transaction (diesel-async's transaction
    /// already ended) is refused before anything is sent.
    fn check_depth(&mut self) -> Result<(), Error> {
        let depth = exec::transaction_depth(self.conn);
        // A call cut off in flight breaks diesel-async's transaction manager
        // on purpose (see `lock`): a call after it is refused as what it is.
        if depth.is_err() && self.state.is_poisoned() {
            return Err(Error::from(ErrorKind::Poisoned));
        }
        if depth.map_err(exec::lock_error)? == 0 {
            return Err(Error::from(ErrorKind::NotInTransaction));
        }
        Ok(())
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
