//! [`LockTx`]: a connection inside a transaction, with the advisory locks it
//! took, written once for every adapter over a [`Driver`].

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use std::num::NonZeroU8;
use std::panic::Location;
use std::time::Duration;

use crate::calls::{self, Parts};
use crate::driver::{Async, Blocking, Driver, DriverError, Io, SavepointStep, Transactions};
use crate::engine::error::Refused;
use crate::engine::{Request, SavepointEnd, SavepointEnding, TxSlot, TxState, Wait};
use crate::{AdvisoryKey, Batch, Busy, Error, ErrorKind, Held, HeldBatch, Mode};

/// The future a closure of [`LockTx::savepoint`] (or of an adapter's
/// `transaction`) returns: boxed, as with sqlx's own
/// `Connection::transaction`, so that it may borrow the [`LockTx`] it is
/// given.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a [`LockTx`] call over driver `D` returns, made from its future
/// `F`: the future itself on an async stack (sqlx, diesel-async: `.await`
/// it), its output on a blocking one (Diesel).
pub type Out<D, F> = <<D as Driver>::Io as Io>::Out<F>;

/// A connection inside a transaction, taking transaction-scoped advisory
/// locks: the lock calls of `lockkit-sqlx`, `lockkit-diesel-async` and
/// `lockkit-diesel` (their `LockTx<'t>` is this type over their
/// [`Driver`], the adapter's `Locker`).
///
/// On sqlx and diesel-async its calls return futures ([`Out`] is the
/// future); on Diesel, which blocks, they return their result (the
/// `# Cancel safety` sections are about the async stacks).
///
/// Made by the adapter's `lock_tx` over an open transaction, by its
/// closure forms, and by [`LockTx::savepoint`]. Run queries on
/// [`LockTx::conn`] (or `&mut *tx`: it dereferences to the connection).
///
/// Locks are released by the server at `COMMIT` or `ROLLBACK` (or a rollback
/// of the savepoint that took them), or at once when an error aborts the
/// transaction; never earlier. Guards borrow the connection (not the
/// `LockTx`, so queries can run while they live), so none outlives the
/// transaction's borrow of it. Every lock call first asks the driver
/// whether a transaction is open and fails with
/// [`ErrorKind::NotInTransaction`] when none is.
///
/// It remembers what it holds: locking a held key again costs no round trip,
/// the budget counts distinct keys, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] rather than raw
/// `SAVEPOINT` SQL or the driver's own nested transaction, which this
/// bookkeeping cannot see. End the transaction through the stack's own
/// commit or rollback (or the adapter's closure form), never with raw
/// `COMMIT` or `ROLLBACK` SQL on the connection: neither the stack nor
/// lockkit would see it, and a lock call after it would run outside a
/// transaction block, where the server releases an xact lock at the end
/// of its statement.
///
/// # Round trips
///
/// The engine's statements go one at a time, in the engine's order (neither
/// sqlx nor diesel-async promises the order of pipelined statements with
/// parameters, and Diesel does not pipeline): a lock or a batch of one key space takes one round trip; a
/// batch that mixes `BigInt` and `Pair` keys two; a timed lock five
/// (savepoint, set the timeouts, lock, restore them, release); a try-batch
/// three.
///
/// ```
/// use lockkit::driver::{Async, Transactions};
/// use lockkit::tx::LockTx;
/// use lockkit::{AdvisoryKey, Batch, Mode};
///
/// #[derive(AdvisoryKey)]
/// struct Account {
///     id: i64,
/// }
///
/// // The same code over every async stack's `LockTx`.
/// async fn transfer<D: Transactions<Io = Async>>(tx: &mut LockTx<'_, D>) -> Result<(), lockkit::Error> {
///     let batch = Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 });
///     let _held = tx.lock_batch(&batch).await?; // until COMMIT or ROLLBACK
///     assert!(tx.holds(&Account { id: 3 }, Mode::Exclusive));
///     Ok(())
/// }
/// ```
pub struct LockTx<'t, D: Driver, M: Io = <D as Driver>::Io> {
    conn: &'t mut D::Conn,
    state: TxSlot<'t>,
    locker: D,
    depth: u32,
    /// `D::Io`, a parameter of its own so that the savepoint of an async
    /// and of a blocking stack can each have its own signature.
    io: PhantomData<fn() -> M>,
}

impl<D: Driver, M: Io> fmt::Debug for LockTx<'_, D, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockTx")
            .field("depth", &self.depth)
            .field("state", &*self.state)
            .finish_non_exhaustive()
    }
}

impl<D: Driver, M: Io> Deref for LockTx<'_, D, M> {
    type Target = D::Conn;

    fn deref(&self) -> &D::Conn {
        self.conn
    }
}

impl<D: Driver, M: Io> DerefMut for LockTx<'_, D, M> {
    fn deref_mut(&mut self) -> &mut D::Conn {
        self.conn
    }
}

/// Records how a savepoint ended; dropped before that (its closure
/// panicked, or its future was dropped), it lets the driver settle the
/// connection ([`Transactions::savepoint_dropped`]).
struct SavepointGuard<'s, 'c, D: Transactions> {
    ending: SavepointEnding<'s>,
    conn: &'c mut D::Conn,
}

impl<D: Transactions> SavepointGuard<'_, '_, D> {
    /// Rolls the savepoint (or the transaction) back, and records how it
    /// ended: rolled back, or unknown when the rollback failed.
    async fn roll_back(&mut self) -> Result<(), DriverError> {
        let rollback = D::savepoint(self.conn, SavepointStep::Rollback).await;
        self.ending.record(match rollback {
            Ok(()) => SavepointEnd::RolledBack,
            Err(_) => SavepointEnd::Unknown,
        });
        rollback
    }
}

impl<D: Transactions> Drop for SavepointGuard<'_, '_, D> {
    fn drop(&mut self) {
        if self.ending.is_pending() && D::savepoint_dropped(self.conn) == SavepointEnd::Unknown {
            self.ending.record(SavepointEnd::Unknown);
        }
    }
}

impl<'t, M: Io, D: Transactions<Io = M>> LockTx<'t, D, M> {
    /// A top-level `LockTx` over the transaction open on `conn`
    /// ([`driver::lock_tx`](crate::driver::lock_tx)).
    pub(crate) fn attach(locker: &D, conn: &'t mut D::Conn) -> Result<Self, Error> {
        if !D::in_transaction(conn).map_err(|e| e.into_error())? {
            return Err(Error::from(ErrorKind::NotInTransaction));
        }
        Ok(LockTx {
            conn,
            state: TxSlot::Owned(TxState::new()),
            locker: locker.clone(),
            depth: 0,
            io: PhantomData,
        })
    }

    /// The connection, for queries inside the transaction.
    pub fn conn(&mut self) -> &mut D::Conn {
        self.conn
    }

    /// What a call returns, made from its future: [`Out`].
    #[inline(always)]
    fn out<F: Future>(future: F) -> Out<D, F> {
        <D::Io as Io>::finish(future)
    }

    #[doc = include_str!("calls/locker.md")]
    pub fn locker(&self) -> &D {
        &self.locker
    }

    #[doc = include_str!("calls/depth.md")]
    pub fn depth(&self) -> u32 {
        self.depth
    }

    #[doc = include_str!("calls/held_count.md")]
    pub fn held_count(&self) -> usize {
        self.state.held_count()
    }

    #[doc = include_str!("calls/holds.md")]
    pub fn holds<K: AdvisoryKey + ?Sized>(&self, key: &K, mode: Mode) -> bool {
        self.state.holds(key.lock_key(), mode)
    }

    #[doc = include_str!("calls/is_poisoned.md")]
    pub fn is_poisoned(&self) -> bool {
        self.state.is_poisoned()
    }

    #[doc = include_str!("calls/lock.md")]
    #[track_caller]
    pub fn lock<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::lock_one(
            move || self.parts(),
            key,
            Mode::Exclusive,
            site,
        ))
    }

    #[doc = include_str!("calls/lock_shared.md")]
    #[track_caller]
    pub fn lock_shared<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::lock_one(
            move || self.parts(),
            key,
            Mode::Shared,
            site,
        ))
    }

    #[doc = include_str!("calls/lock_timeout.md")]
    #[track_caller]
    pub fn lock_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::lock_waiting(
            move || self.parts(),
            key,
            Mode::Exclusive,
            timeout,
            site,
        ))
    }

    #[doc = include_str!("calls/lock_shared_timeout.md")]
    #[track_caller]
    pub fn lock_shared_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        timeout: Duration,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::lock_waiting(
            move || self.parts(),
            key,
            Mode::Shared,
            timeout,
            site,
        ))
    }

    #[doc = include_str!("calls/try_lock.md")]
    #[track_caller]
    pub fn try_lock<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> Out<D, impl Future<Output = Result<Result<Held<'t, K>, K>, Error>> + use<'_, 't, K, D, M>>
    {
        let site = Location::caller();
        Self::out(calls::try_lock_one(
            move || self.parts(),
            key,
            Mode::Exclusive,
            site,
        ))
    }

    #[doc = include_str!("calls/try_lock_shared.md")]
    #[track_caller]
    pub fn try_lock_shared<K: AdvisoryKey>(
        &mut self,
        key: K,
    ) -> Out<D, impl Future<Output = Result<Result<Held<'t, K>, K>, Error>> + use<'_, 't, K, D, M>>
    {
        let site = Location::caller();
        Self::out(calls::try_lock_one(
            move || self.parts(),
            key,
            Mode::Shared,
            site,
        ))
    }

    #[doc = include_str!("calls/lock_batch.md")]
    #[track_caller]
    pub fn lock_batch(
        &mut self,
        batch: &Batch,
    ) -> Out<D, impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't, D, M>> {
        let request = Request::batch(batch).at(Location::caller());
        Self::out(calls::lock_batch(
            move || self.parts(),
            request,
            Wait::Forever,
        ))
    }

    #[doc = include_str!("calls/lock_batch_timeout.md")]
    #[track_caller]
    pub fn lock_batch_timeout(
        &mut self,
        batch: &Batch,
        timeout: Duration,
    ) -> Out<D, impl Future<Output = Result<HeldBatch<'t>, Error>> + use<'_, 't, D, M>> {
        let request = Request::batch(batch).at(Location::caller());
        Self::out(calls::lock_batch(
            move || self.parts(),
            request,
            Wait::Timeout(timeout),
        ))
    }

    #[doc = include_str!("calls/try_lock_batch.md")]
    #[track_caller]
    pub fn try_lock_batch(
        &mut self,
        batch: &Batch,
    ) -> Out<D, impl Future<Output = Result<Result<HeldBatch<'t>, Busy>, Error>> + use<'_, 't, D, M>>
    {
        let request = Request::batch(batch).at(Location::caller());
        Self::out(calls::try_lock_batch(move || self.parts(), request))
    }

    #[doc = include_str!("calls/acquire_permit.md")]
    #[track_caller]
    pub fn acquire_permit<K: AdvisoryKey>(
        &mut self,
        key: K,
        permits: NonZeroU8,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::permit(
            move || self.parts(),
            key,
            permits,
            Wait::Forever,
            site,
        ))
    }

    #[doc = include_str!("calls/acquire_permit_timeout.md")]
    #[track_caller]
    pub fn acquire_permit_timeout<K: AdvisoryKey>(
        &mut self,
        key: K,
        permits: NonZeroU8,
        timeout: Duration,
    ) -> Out<D, impl Future<Output = Result<Held<'t, K>, Error>> + use<'_, 't, K, D, M>> {
        let site = Location::caller();
        Self::out(calls::permit(
            move || self.parts(),
            key,
            permits,
            Wait::Timeout(timeout),
            site,
        ))
    }

    #[doc = include_str!("calls/try_acquire_permit.md")]
    #[track_caller]
    pub fn try_acquire_permit<K: AdvisoryKey>(
        &mut self,
        key: K,
        permits: NonZeroU8,
    ) -> Out<D, impl Future<Output = Result<Result<Held<'t, K>, K>, Error>> + use<'_, 't, K, D, M>>
    {
        let site = Location::caller();
        Self::out(calls::try_permit(move || self.parts(), key, permits, site))
    }

    /// What a lock call needs (the calls borrow the generic face `&mut`),
    /// once a transaction is known to be open: what it holds, the
    /// connection, the driver, the depth.
    fn parts(&mut self) -> Result<Parts<'_, D, &mut D::Conn, &D>, Error> {
        self.check_in_transaction()?;
        Ok(Parts {
            state: &self.state,
            conn: &mut *self.conn,
            driver: &self.locker,
            depth: self.depth,
            stack: PhantomData,
        })
    }

    /// A lock call outside a transaction (the driver's transaction already
    /// ended) is refused before anything is sent; so is one after a cut-off
    /// call put the driver's transaction manager in error.
    fn check_in_transaction(&mut self) -> Result<(), Error> {
        match D::in_transaction(self.conn) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::from(ErrorKind::NotInTransaction)),
            Err(_) if self.state.is_poisoned() => Err(Error::from(ErrorKind::Poisoned)),
            Err(e) => Err(e.into_error()),
        }
    }
}

/// A savepoint (or, at depth 0, the transaction it begins) opened on a
/// connection through the driver: the steps every closure form shares
/// (savepoints, and an adapter's `transaction`), around the application's
/// closure, which each form calls as its stack does.
pub(crate) struct Scope<'s, 'c, D: Transactions> {
    guard: SavepointGuard<'s, 'c, D>,
    state: &'s TxState,
    depth: u32,
}

impl<'s, 'c, D: Transactions> Scope<'s, 'c, D> {
    /// Opens the savepoint at `depth` (`SAVEPOINT`, or `BEGIN` when no
    /// transaction is open) for `state`'s bookkeeping.
    pub(crate) async fn begin(
        conn: &'c mut D::Conn,
        state: &'s TxState,
        depth: u32,
    ) -> Result<Self, Error> {
        D::savepoint(conn, SavepointStep::Begin)
            .await
            .map_err(|e| e.into_error())?;
        Ok(Scope {
            guard: SavepointGuard {
                ending: state.ending(depth, SavepointEnd::RolledBack),
                conn,
            },
            state,
            depth,
        })
    }

    /// The `LockTx` the closure is given.
    pub(crate) fn tx(&mut self, locker: D) -> LockTx<'_, D> {
        LockTx {
            conn: &mut *self.guard.conn,
            state: TxSlot::Borrowed(self.state),
            locker,
            depth: self.depth,
            io: PhantomData,
        }
    }

    /// Releases the savepoint (commits the transaction) after the closure's
    /// `Ok`, rolls it back after its `Err`, and records how it ended.
    pub(crate) async fn end<R, E: From<Error>>(mut self, result: Result<R, E>) -> Result<R, E> {
        let guard = &mut self.guard;
        match result {
            // A lock call's error aborted the transaction (or this
            // savepoint): the server would answer `COMMIT` by rolling back,
            // which the stack reports as a commit, and `RELEASE` with an
            // error. Rolled back, and said so.
            //
            // A lock call cut off in flight at depth 0 left an answer the
            // server may still make an error (a statement timeout, the
            // cancel request of a driver that sends one), which aborts the
            // transaction: whether a `COMMIT` would commit is unknown, so
            // it is rolled back and refused, as tokio-postgres's
            // `LockTx::commit` refuses.
            Ok(_) if self.state.is_aborted() || (self.depth == 0 && self.state.is_poisoned()) => {
                let why = if self.state.is_aborted() {
                    Refused::Aborted
                } else {
                    Refused::CutOff
                };
                let rollback = guard.roll_back().await.err();
                let rollback = rollback.map(|e| e.into_error().into());
                Err(E::from(Error::not_committed(why, self.depth, rollback)))
            }
            Ok(value) => {
                // Dropped while `RELEASE` (or `COMMIT`) is in flight, whether
                // it ran is unknown.
                guard.ending.if_dropped(SavepointEnd::Unknown);
                match D::savepoint(guard.conn, SavepointStep::Release).await {
                    Ok(()) => {
                        guard.ending.record(SavepointEnd::Released);
                        Ok(value)
                    }
                    Err(e) => {
                        guard.ending.record(SavepointEnd::Unknown);
                        // A failed `COMMIT` (or `RELEASE`) can leave the
                        // transaction open as the stack sees it: one never
                        // sent (sqlx sends nothing after reading an earlier
                        // statement's error), or one the server refused. It
                        // is rolled back, so that the connection never goes
                        // on inside it; the commit's error is the answer.
                        if D::in_transaction(guard.conn).unwrap_or(false) {
                            let _ = guard.roll_back().await;
                        }
                        Err(E::from(e.into_error()))
                    }
                }
            }
            Err(user) => {
                // The closure's error is the answer; the rollback's, if
                // any, is in how the savepoint's end was recorded.
                let _ = guard.roll_back().await;
                Err(user)
            }
        }
    }
}

impl<'t, D: Transactions<Io = Async>> LockTx<'t, D, Async> {
    /// Runs `f` in a savepoint (the driver's nested transaction): released
    /// when `f` returns `Ok`, rolled back when it returns `Err`. Locks taken
    /// in a rolled-back savepoint are released by the server and forgotten
    /// here (budget and held set); those of a released one belong to this
    /// transaction.
    ///
    /// If `f` panics or this future is dropped before the savepoint ends:
    ///
    /// - on sqlx, sqlx rolls the savepoint back before the connection's next
    ///   use, and it is forgotten here too; dropped while its `RELEASE` is
    ///   in flight, this transaction is poisoned (whether the savepoint's
    ///   locks are still held is unknown);
    /// - on diesel-async, which cannot roll back in a destructor, the
    ///   savepoint stays open: this transaction is poisoned and given up
    ///   (rolled back at once, which releases its locks), and diesel-async's
    ///   transaction manager is put in error, so the enclosing
    ///   `conn.transaction` fails (with Diesel's `BrokenTransactionManager`)
    ///   rather than report a commit, and a pool discards the connection.
    ///
    /// ```
    /// # use lockkit::driver::{Async, Transactions};
    /// # use lockkit::tx::LockTx;
    /// # use lockkit::{AdvisoryKey, Mode};
    /// # #[derive(AdvisoryKey)] struct Job { id: i64 }
    /// # async fn run<D: Transactions<Io = Async>>(tx: &mut LockTx<'_, D>) -> Result<(), lockkit::Error> {
    /// let outcome = tx
    ///     .savepoint(|sp| {
    ///         Box::pin(async move {
    ///             let _job = sp.lock(Job { id: 1 }).await?;
    ///             Err::<(), _>(lockkit::Error::other("changed my mind"))
    ///         })
    ///     })
    ///     .await;
    /// assert!(outcome.is_err());
    /// assert!(!tx.holds(&Job { id: 1 }, Mode::Exclusive)); // released
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `f`'s error, or the driver's (as [`Error`], converted into `E`) when
    /// `SAVEPOINT`, `RELEASE` or `ROLLBACK TO` fails (after which this
    /// transaction's lock calls fail with [`ErrorKind::Poisoned`]: roll it
    /// back).
    ///
    /// [`ErrorKind::TransactionAborted`], the savepoint rolled back instead
    /// of released, when `f` returns `Ok` after a lock call's error aborted
    /// it; this transaction is usable again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future ends the savepoint as described above.
    pub async fn savepoint<R, E, F>(&mut self, f: F) -> Result<R, E>
    where
        F: for<'a, 's> FnOnce(&'a mut LockTx<'s, D>) -> BoxFuture<'a, Result<R, E>>,
        E: From<Error>,
    {
        let (depth, locker) = (self.depth + 1, self.locker.clone());
        let mut scope = Scope::<D>::begin(&mut *self.conn, &self.state, depth).await?;
        let result = f(&mut scope.tx(locker)).await;
        scope.end(result).await
    }
}

impl<'t, D: Transactions<Io = Blocking>> LockTx<'t, D, Blocking> {
    /// Runs `f` in a savepoint (the driver's nested transaction): released
    /// when `f` returns `Ok`, rolled back when it returns `Err` or panics.
    /// Locks taken in a rolled-back savepoint are released by the server
    /// and forgotten here (budget and held set); those of a released one
    /// belong to this transaction.
    ///
    /// # Errors
    ///
    /// `f`'s error, or the driver's (as [`Error`], converted into `E`) when
    /// `SAVEPOINT`, `RELEASE` or `ROLLBACK TO` fails (after which this
    /// transaction's lock calls fail with [`ErrorKind::Poisoned`]: roll it
    /// back).
    ///
    /// [`ErrorKind::TransactionAborted`], the savepoint rolled back instead
    /// of released, when `f` returns `Ok` after a lock call's error aborted
    /// it; this transaction is usable again.
    ///
    /// # Panics
    ///
    /// When `f` panics, after rolling the savepoint back.
    pub fn savepoint<R, E, F>(&mut self, f: F) -> Result<R, E>
    where
        F: FnOnce(&mut LockTx<'_, D>) -> Result<R, E>,
        E: From<Error>,
    {
        let (depth, locker) = (self.depth + 1, self.locker.clone());
        let mut scope = Blocking::finish(Scope::<D>::begin(&mut *self.conn, &self.state, depth))?;
        let result = f(&mut scope.tx(locker));
        Blocking::finish(scope.end(result))
    }
}
