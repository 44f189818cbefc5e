//! [`LockTx`]: a Diesel connection inside a transaction, with the advisory
//! locks it took; and the guards that prove them.

use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe, Location};
use std::time::Duration;

use diesel::result::Error as DieselError;
use diesel::PgConnection;
use lockkit::engine::{
    Acquisition, DriverError, Grant, Request, SavepointEnd, TxSlot, TxState, Wait,
};
use lockkit::{AdvisoryKey, Batch, Busy, Error, ErrorKind, Held, HeldBatch, Mode};

use crate::locker::Locker;
use crate::pg;

/// A Diesel connection inside a transaction, taking transaction-scoped
/// advisory locks.
///
/// Made by [`Locker::transaction`] (which opens the transaction),
/// [`Locker::locked_transaction`], or
/// [`lock_tx`](crate::PgConnectionExt::lock_tx) inside Diesel's own
/// `conn.transaction(|conn| …)`. Run queries on [`LockTx::conn`].
///
/// Locks are released by the server at `COMMIT` or `ROLLBACK` (or a
/// rollback of the savepoint that took them), never earlier. Every lock call
/// first checks Diesel's transaction depth and fails with
/// [`ErrorKind::NotInTransaction`] at depth 0, so the silent lock-and-release of
/// an xact lock outside a transaction cannot happen through this API.
///
/// It remembers what it holds for as long as it lives (the whole closure):
/// locking a held key again costs no round trip, the budget counts distinct
/// keys, the order check sees every key, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] for nested transactions
/// that take locks: a `LockTx` cannot be used inside a nested
/// `conn.transaction` it did not open (the borrow checker sees to it), so the
/// keys it remembers are never released behind its back.
pub struct LockTx<'c> {
    conn: &'c mut PgConnection,
    state: TxSlot<'c>,
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

/// Runs `f` in a new transaction (or a savepoint, when one is open) on
/// `conn`, with bookkeeping `locks` at lockkit depth `depth`: commits on
/// `Ok`, rolls back on `Err` and on a panic (which then resumes), and tells
/// the bookkeeping what the server released.
pub(crate) fn run<R, E, F>(
    conn: &mut PgConnection,
    locker: &Locker,
    locks: &TxState,
    depth: u32,
    f: F,
) -> Result<R, E>
where
    F: FnOnce(&mut LockTx<'_>) -> Result<R, E>,
    E: From<DieselError>,
{
    pg::begin(conn)?;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut tx = LockTx {
            conn: &mut *conn,
            state: TxSlot::Borrowed(locks),
            locker: locker.clone(),
            depth,
        };
        f(&mut tx)
    }));
    match outcome {
        Ok(Ok(value)) => match pg::commit(conn) {
            Ok(()) => {
                locks.end_savepoint(depth, SavepointEnd::Released);
                Ok(value)
            }
            Err(e) => {
                // Diesel rolled back, or the connection is gone; either way
                // what is held is not known any more.
                locks.end_savepoint(depth, SavepointEnd::Unknown);
                Err(e.into())
            }
        },
        Ok(Err(user)) => match pg::rollback(conn) {
            Ok(()) => {
                locks.end_savepoint(depth, SavepointEnd::RolledBack);
                Err(user)
            }
            Err(DieselError::BrokenTransactionManager) => {
                locks.end_savepoint(depth, SavepointEnd::Unknown);
                Err(user)
            }
            Err(e) => {
                locks.end_savepoint(depth, SavepointEnd::Unknown);
                Err(e.into())
            }
        },
        Err(panic) => {
            locks.end_savepoint(
                depth,
                match pg::rollback(conn) {
                    Ok(()) => SavepointEnd::RolledBack,
                    Err(_) => SavepointEnd::Unknown,
                },
            );
            resume_unwind(panic)
        }
    }
}

impl<'c> LockTx<'c> {
    /// A `LockTx` over the transaction already open on `conn`.
    pub(crate) fn attach(locker: &Locker, conn: &'c mut PgConnection) -> Result<LockTx<'c>, Error> {
        if pg::transaction_depth(conn)? == 0 {
            return Err(not_in_transaction());
        }
        Ok(LockTx {
            conn,
            state: TxSlot::Owned(TxState::new()),
            locker: locker.clone(),
            depth: 0,
        })
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

    /// Runs `f` in a savepoint (a nested Diesel transaction): committed when
    /// `f` returns `Ok`, rolled back when it returns `Err` or panics. Locks
    /// taken in a rolled-back savepoint are released by the server and
    /// forgotten here (budget and held set); those of a committed one belong
    /// to this transaction.
    ///
    /// # Errors
    ///
    /// `f`'s error, or Diesel's when `SAVEPOINT`, `RELEASE` or `ROLLBACK TO`
    /// fails (after which this transaction's lock calls fail with
    /// [`ErrorKind::Poisoned`]: roll it back).
    pub fn savepoint<R, E, F>(&mut self, f: F) -> Result<R, E>
    where
        F: FnOnce(&mut LockTx<'_>) -> Result<R, E>,
        E: From<DieselError>,
    {
        let depth = self.depth + 1;
        run(&mut *self.conn, &self.locker, &self.state, depth, f)
    }

    /// Takes `key` exclusive, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::NotInTransaction`], [`ErrorKind::BudgetExceeded`],
    /// [`ErrorKind::LockOrder`] (when configured), [`ErrorKind::HotStandby`],
    /// [`ErrorKind::Poisoned`], [`ErrorKind::TransactionAborted`] and
    /// [`ErrorKind::HashtextMismatch`] before anything is sent;
    /// [`ErrorKind::Deadlock`], [`ErrorKind::LockTableFull`],
    /// [`ErrorKind::ConnectionLost`] and other server errors after, which abort
    /// the transaction (roll it back, or the enclosing savepoint).
    #[track_caller]
    pub fn lock<K: AdvisoryKey>(&mut self, key: K) -> Result<Held<'c, K>, Error> {
        self.lock_one(key, Mode::Exclusive, Wait::Forever)
    }

    /// Takes `key` shared: other shared holders are admitted, exclusive ones
    /// excluded.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    #[track_caller]
    pub fn lock_shared<K: AdvisoryKey>(&mut self, key: K) -> Result<Held<'c, K>, Error> {
        self.lock_one(key, Mode::Shared, Wait::Forever)
    }

    /// Takes `key` exclusive, waiting at most `timeout` (measured by the
    /// server). On timeout nothing is held and the transaction is still
    /// usable.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Timeout`], and as [`LockTx::lock`]; after a deadlock the
    /// savepoint rollback leaves the transaction usable too.
    #[track_caller]
    pub fn lock_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> Result<Held<'c, K>, Error> {
        self.lock_one(key, Mode::Exclusive, Wait::Timeout(timeout))
    }

    /// Takes `key` shared, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    #[track_caller]
    pub fn lock_shared_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> Result<Held<'c, K>, Error> {
        self.lock_one(key, Mode::Shared, Wait::Timeout(timeout))
    }

    /// Takes `key` exclusive if no other transaction holds it, without
    /// waiting. Gives the key back when it is busy.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`] (a full lock table raises `53200` even here),
    /// but never `LockOrder`: a try does not wait, so it cannot deadlock.
    #[track_caller]
    pub fn try_lock<K: AdvisoryKey>(&mut self, key: K) -> Result<Result<Held<'c, K>, K>, Error> {
        self.try_lock_one(key, Mode::Exclusive)
    }

    /// Takes `key` shared if no transaction holds it exclusive, without
    /// waiting. Gives the key back when it is busy.
    ///
    /// # Errors
    ///
    /// As [`LockTx::try_lock`].
    #[track_caller]
    pub fn try_lock_shared<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> Result<Result<Held<'c, K>, K>, Error> {
        self.try_lock_one(key, Mode::Shared)
    }

    /// Takes every key of `batch` in the global lock order: one statement,
    /// or two (`BigInt` keys, then `Pair` keys) when the batch mixes both.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    #[track_caller]
    pub fn lock_batch(&mut self, batch: &Batch) -> Result<HeldBatch<'c>, Error> {
        self.acquire(batch, Wait::Forever)
    }

    /// Takes every key of `batch`, each statement of the batch waiting at
    /// most `timeout` (not each key). On timeout nothing of the batch is held
    /// and the transaction is still usable.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    #[track_caller]
    pub fn lock_batch_timeout(
        &mut self,
        batch: &Batch,
        timeout: Duration,
    ) -> Result<HeldBatch<'c>, Error> {
        self.acquire(batch, Wait::Timeout(timeout))
    }

    /// Takes every key of `batch` or none: when any key is busy, nothing of
    /// the batch is held and the busy keys are returned.
    ///
    /// # Errors
    ///
    /// As [`LockTx::try_lock`].
    #[track_caller]
    pub fn try_lock_batch(&mut self, batch: &Batch) -> Result<Result<HeldBatch<'c>, Busy>, Error> {
        let request = Request::batch(batch).at(Location::caller());
        Grant::try_lock_batch(self.drive(request, Wait::Try))
    }

    #[track_caller]
    fn lock_one<K: AdvisoryKey>(
        &mut self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Held<'c, K>, Error> {
        let outcome = match wait {
            Wait::Forever => self.send_one(&value, mode, false),
            wait => self.drive(Request::one(&value, mode).at(Location::caller()), wait),
        };
        Grant::lock(outcome, value)
    }

    #[track_caller]
    fn try_lock_one<K: AdvisoryKey>(
        &mut self,
        value: K,
        mode: Mode,
    ) -> Result<Result<Held<'c, K>, K>, Error> {
        Grant::try_lock(self.send_one(&value, mode, true), value)
    }

    #[track_caller]
    fn acquire(&mut self, batch: &Batch, wait: Wait) -> Result<HeldBatch<'c>, Error> {
        self.lock_batch_at(batch, wait, Location::caller())
    }

    /// [`LockTx::lock_batch`] asked for at `site` (for lockkit's own calls
    /// on the application's behalf, such as
    /// [`Locker::locked_transaction`](crate::Locker::locked_transaction)).
    pub(crate) fn lock_batch_at(
        &mut self,
        batch: &Batch,
        wait: Wait,
        site: &'static Location<'static>,
    ) -> Result<HeldBatch<'c>, Error> {
        Grant::lock_batch(self.drive(Request::batch(batch).at(site), wait))
    }

    /// Checks Diesel's transaction depth, then runs a one-key call of one
    /// statement (a lock that waits, or a try).
    #[track_caller]
    fn send_one<K: AdvisoryKey>(
        &mut self,
        value: &K,
        mode: Mode,
        try_only: bool,
    ) -> Result<Result<Grant, Busy>, Error> {
        self.check_in_transaction()?;
        let site = Some(Location::caller());
        let policy = self.locker.policy();
        let call = self
            .state
            .acquire_one(policy, self.depth, (value, mode), try_only, site)?;
        let mode = policy.config().statement_mode();
        let send = |statement| pg::run(self.conn, &statement, mode).map_err(DriverError::from);
        call.run_blocking(send, |_, a| a.reply())
    }

    /// Checks Diesel's transaction depth, then lets the engine run the call
    /// (whose request carries the application's call site).
    fn drive(&mut self, request: Request, wait: Wait) -> Result<Result<Grant, Busy>, Error> {
        self.check_in_transaction()?;
        let policy = self.locker.policy();
        let call: Acquisition<'_> = self.state.acquire(policy, self.depth, request, wait)?;
        let mode = policy.config().statement_mode();
        call.run_blocking(|call| pg::drive(self.conn, mode, call))
    }
}

impl LockTx<'_> {
    /// A lock call outside a transaction (Diesel's transaction already
    /// ended) is refused before anything is sent.
    fn check_in_transaction(&mut self) -> Result<(), Error> {
        match pg::transaction_depth(self.conn)? {
            0 => Err(not_in_transaction()),
            _ => Ok(()),
        }
    }
}

fn not_in_transaction() -> Error {
    Error::from(ErrorKind::NotInTransaction)
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
