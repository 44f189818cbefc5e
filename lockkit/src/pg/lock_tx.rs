//! [`LockTx`]: a tokio-postgres transaction that takes advisory locks.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use tokio_postgres::error::SqlState;
use tokio_postgres::Transaction;

use std::num::NonZeroU8;
use std::panic::Location;
use std::time::Duration;

use crate::calls::{self, Parts};
use crate::engine::error::{Error, Refused};
use crate::engine::sql;
use crate::engine::{Request, SavepointEnd, TxSlot, TxState, Wait};
use crate::pg::exec::{Pg, PgConn, StatementCache};
use crate::pg::locker::Locker;
use crate::{AdvisoryKey, Batch, Busy, Held, HeldBatch, Mode};

/// A tokio-postgres transaction that takes transaction-scoped advisory
/// locks.
///
/// Made by [`LockClient::begin`](crate::LockClient::begin) (lockkit's
/// statements unnamed by default; with `StatementMode::Prepared`, prepared
/// once per connection),
/// [`Locker::begin`] or [`Locker::wrap`]. It dereferences to
/// [`tokio_postgres::Transaction`] for queries.
///
/// Locks are released by the server at `COMMIT` or `ROLLBACK` (or a
/// rollback of the savepoint that took them), or at once when an error
/// aborts the transaction; never earlier. Guards borrow the transaction, so
/// none outlives it. Locks are taken only inside this transaction, so the
/// silent lock-and-release of an xact lock outside a transaction cannot
/// happen through this API (as long as the transaction ends through it too:
/// see below).
///
/// It remembers what it holds: locking a held key again costs no round trip,
/// the budget counts distinct keys, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] rather than raw
/// `SAVEPOINT` SQL, which this bookkeeping cannot see, and end the
/// transaction with [`LockTx::commit`] or [`LockTx::rollback`], never with
/// raw `COMMIT` or `ROLLBACK` SQL through the `Transaction` it dereferences
/// to: lockkit would not see it, and a lock call after it would run outside
/// a transaction block, where the server releases an xact lock at the end
/// of its statement.
///
/// ```no_run
/// use lockkit::{AdvisoryKey, Batch, LockClient, Locker};
///
/// #[derive(AdvisoryKey)]
/// struct Account {
///     id: i64,
/// }
///
/// # async fn run(conn: &mut LockClient) -> Result<(), lockkit::Error> {
/// let tx = conn.begin().await?;
/// // Both accounts, in the global order, in one round trip.
/// let held = tx.lock_batch(&Batch::new().with(&Account { id: 7 }).with(&Account { id: 3 })).await?;
/// assert!(held.contains(&Account { id: 3 }));
/// tx.execute("UPDATE accounts SET balance = balance - 100 WHERE id = 7", &[]).await?;
/// tx.execute("UPDATE accounts SET balance = balance + 100 WHERE id = 3", &[]).await?;
/// tx.commit().await?; // both locks are released here
/// # Ok(())
/// # }
/// ```
pub struct LockTx<'c> {
    tx: Option<Transaction<'c>>,
    locker: Locker,
    cache: Option<&'c StatementCache>,
    shared: TxSlot<'c, Shared>,
    depth: u32,
}

/// What a transaction shares with its savepoints.
#[derive(Debug, Default)]
struct Shared {
    /// What the transaction holds through lockkit.
    state: TxState,
    /// Whether a dropped lock call sent a cancel request (its rollback
    /// keeps cancelling until it is answered).
    cancelled: AtomicBool,
}

impl fmt::Debug for LockTx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockTx")
            .field("depth", &self.depth)
            .field("state", &self.shared.state)
            .field("prepared", &self.cache.is_some())
            .finish_non_exhaustive()
    }
}

impl<'c> Deref for LockTx<'c> {
    type Target = Transaction<'c>;

    fn deref(&self) -> &Transaction<'c> {
        self.tx
            .as_ref()
            .expect("lockkit: transaction used after commit or rollback")
    }
}

impl Drop for LockTx<'_> {
    fn drop(&mut self) {
        // Dropped without commit or rollback: tokio-postgres rolls the
        // transaction (or savepoint) back, and the server releases its locks.
        let Some(tx) = self.tx.as_ref() else {
            return;
        };
        if self.depth == 0 && self.shared.cancelled.load(Ordering::SeqCst) {
            // After a cut-off call, a cancel request can still land on the
            // `ROLLBACK` tokio-postgres queues as `tx` drops, and leave the
            // transaction open and aborted. A second one, queued first,
            // means a late request cannot leave it open: see
            // `Canceller::cancel_until_answered`.
            let _ = tx
                .client()
                .simple_query_raw(sql::TX_ROLLBACK)
                .now_or_never();
        }
        self.shared
            .state
            .end_savepoint(self.depth, SavepointEnd::RolledBack);
    }
}

impl<'c> LockTx<'c> {
    pub(crate) fn new(
        locker: Locker,
        tx: Transaction<'c>,
        cache: Option<&'c StatementCache>,
    ) -> Self {
        LockTx {
            tx: Some(tx),
            locker,
            cache,
            shared: TxSlot::Owned(Shared::default()),
            depth: 0,
        }
    }

    fn take(&mut self) -> Transaction<'c> {
        self.tx
            .take()
            .expect("lockkit: transaction used after commit or rollback")
    }

    /// Whether lockkit's statements are prepared on this connection (made
    /// by a [`LockClient`](crate::LockClient) whose statements are not
    /// [unnamed](crate::StatementMode::Unnamed)).
    pub fn is_prepared(&self) -> bool {
        self.cache.is_some()
    }

    /// Commits, releasing every lock (and, for a savepoint, handing its
    /// locks to the enclosing transaction).
    ///
    /// # Errors
    ///
    /// When `COMMIT` (or `RELEASE`) fails; the locks are released either way
    /// once the transaction ends.
    ///
    /// [`ErrorKind::Poisoned`](crate::ErrorKind::Poisoned), without
    /// committing, when a lock call of this transaction was cut off while
    /// the server waited (its future dropped): the cancel request it sent
    /// may abort the transaction, whenever it lands, and PostgreSQL answers a
    /// `COMMIT` in an aborted transaction by rolling back, which
    /// tokio-postgres reports as success. The transaction is rolled back
    /// instead (as [`LockTx::rollback`]), so the error says what happened.
    ///
    /// [`ErrorKind::TransactionAborted`](crate::ErrorKind::TransactionAborted),
    /// rolled back in the same way, when a lock call's error (a deadlock,
    /// the session's own `lock_timeout`, …) aborted the transaction (or,
    /// for a savepoint, the savepoint).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if dropped while in flight, whether the transaction
    /// committed is unknown (as with tokio-postgres). A savepoint's commit
    /// dropped in flight poisons the transaction: whether the savepoint's
    /// locks passed to it is unknown.
    pub async fn commit(mut self) -> Result<(), Error> {
        // PostgreSQL answers `COMMIT` in an aborted transaction by rolling
        // back, which tokio-postgres reports as success: a transaction that
        // is, or may become, aborted is rolled back and refused instead.
        let refused = if self.depth == 0 && self.shared.cancelled.load(Ordering::SeqCst) {
            Some(Refused::CutOff)
        } else if self.shared.state.is_aborted() {
            Some(Refused::Aborted)
        } else {
            None
        };
        if let Some(why) = refused {
            let depth = self.depth;
            // Boxed: this rare path's future would otherwise make every
            // commit's future six times the size of tokio-postgres's.
            let rollback = Box::pin(self.rollback()).await.err();
            return Err(Error::not_committed(why, depth, rollback.map(Into::into)));
        }
        let tx = self.take();
        // Dropped once `RELEASE` is sent, whether it ran is not known.
        let mut ending = self.shared.state.ending(self.depth, SavepointEnd::Unknown);
        let result = tx.commit().await;
        ending.record(match result {
            Ok(()) => SavepointEnd::Released,
            Err(_) => SavepointEnd::Unknown,
        });
        Ok(result?)
    }

    /// Rolls back, releasing every lock this transaction (or savepoint) took.
    ///
    /// After a lock call whose future was dropped, neither this rollback nor
    /// a drop of the transaction waits for another session to let go of
    /// the key. On a connection proven direct the call itself keeps sending
    /// cancel requests until the server is done with its statement (the
    /// first can reach the server before the statement does, and be
    /// ignored); under `sslmode=require` that needs the TLS connector
    /// ([`Locker::cancel_tls`](crate::Locker::cancel_tls)). Everywhere else
    /// (a pooler) no request goes, and this rollback waits at most until the
    /// statement's slice ends on the server
    /// ([`Policy::bounds_waits`](crate::driver::Policy::bounds_waits)).
    ///
    /// A request can also arrive after the statement it was sent for
    /// ended, and cancel the `ROLLBACK`; a transaction's `ROLLBACK` is then
    /// sent again (up to five times), and a dropped transaction queues two,
    /// so the connection is not left in a transaction. This rollback does
    /// not wait for the server to process the requests, so on a loaded
    /// server a request processed late can still cancel a statement sent
    /// after this rollback: a later statement on the connection may fail
    /// once with [`ErrorKind::Cancelled`](crate::ErrorKind::Cancelled).
    /// Discard the connection after a cut-off call to rule that out.
    ///
    /// # Errors
    ///
    /// When `ROLLBACK` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: a dropped rollback leaves the transaction (or
    /// savepoint) to roll back anyway, and a savepoint's locks are
    /// forgotten at once.
    pub async fn rollback(mut self) -> Result<(), Error> {
        let tx = self.take();
        // Dropped, the savepoint is rolled back all the same: tokio-postgres
        // sends its `ROLLBACK TO` at the first poll, or when `tx` drops.
        let mut ending = self
            .shared
            .state
            .ending(self.depth, SavepointEnd::RolledBack);
        let cut_off = self.shared.cancelled.load(Ordering::SeqCst);
        let result = if self.depth > 0 || !cut_off {
            tx.rollback().await
        } else {
            // By hand, and again when a cancel request of the cut-off call
            // lands on the ROLLBACK itself (57014, the transaction left
            // open): the request can reach the server after the statement
            // it was sent for ended. The transaction's own ROLLBACK, sent
            // when `tx` drops here, then finds none open.
            let mut again = 0;
            loop {
                match tx.batch_execute(sql::TX_ROLLBACK).await {
                    Err(e) if again < 5 && e.code() == Some(&SqlState::QUERY_CANCELED) => {
                        again += 1;
                    }
                    result => break result,
                }
            }
        };
        ending.record(match result {
            Ok(()) => SavepointEnd::RolledBack,
            Err(_) => SavepointEnd::Unknown,
        });
        Ok(result?)
    }

    /// Opens a savepoint. Locks taken in it are released by the server if it
    /// rolls back (or is dropped), and forgotten by this transaction's
    /// bookkeeping; if it commits they belong to this transaction.
    ///
    /// # Errors
    ///
    /// When `SAVEPOINT` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: tokio-postgres rolls back a savepoint whose creation was
    /// cancelled.
    pub async fn savepoint(&mut self) -> Result<LockTx<'_>, Error> {
        let depth = self.depth + 1;
        let locker = self.locker.clone();
        let shared = TxSlot::Borrowed(&*self.shared);
        let cache = self.cache;
        let tx = self
            .tx
            .as_mut()
            .expect("lockkit: transaction used after commit or rollback");
        let inner = tx.savepoint(format!("lockkit_sp_{depth}")).await?;
        Ok(LockTx {
            tx: Some(inner),
            locker,
            cache,
            shared,
            depth,
        })
    }

    #[doc = include_str!("../calls/locker.md")]
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    #[doc = include_str!("../calls/depth.md")]
    pub fn depth(&self) -> u32 {
        self.depth
    }

    #[doc = include_str!("../calls/held_count.md")]
    pub fn held_count(&self) -> usize {
        self.shared.state.held_count()
    }

    #[doc = include_str!("../calls/holds.md")]
    pub fn holds<K: AdvisoryKey + ?Sized>(&self, key: &K, mode: Mode) -> bool {
        self.shared.state.holds(key.lock_key(), mode)
    }

    #[doc = include_str!("../calls/is_poisoned.md")]
    pub fn is_poisoned(&self) -> bool {
        self.shared.state.is_poisoned()
    }

    #[doc = include_str!("../calls/lock.md")]
    #[track_caller]
    pub fn lock<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::lock_one(move || self.parts(), key, Mode::Exclusive, site)
    }

    #[doc = include_str!("../calls/lock_shared.md")]
    #[track_caller]
    pub fn lock_shared<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::lock_one(move || self.parts(), key, Mode::Shared, site)
    }

    #[doc = include_str!("../calls/lock_timeout.md")]
    #[track_caller]
    pub fn lock_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::lock_waiting(move || self.parts(), key, Mode::Exclusive, timeout, site)
    }

    #[doc = include_str!("../calls/lock_shared_timeout.md")]
    #[track_caller]
    pub fn lock_shared_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::lock_waiting(move || self.parts(), key, Mode::Shared, timeout, site)
    }

    #[doc = include_str!("../calls/try_lock.md")]
    #[track_caller]
    pub fn try_lock<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> impl Future<Output = Result<Result<Held<'_, K>, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::try_lock_one(move || self.parts(), key, Mode::Exclusive, site)
    }

    #[doc = include_str!("../calls/try_lock_shared.md")]
    #[track_caller]
    pub fn try_lock_shared<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> impl Future<Output = Result<Result<Held<'_, K>, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::try_lock_one(move || self.parts(), key, Mode::Shared, site)
    }

    #[doc = include_str!("../calls/lock_batch.md")]
    #[doc = include_str!("lock_batch_pipelined.md")]
    #[track_caller]
    pub fn lock_batch(
        &self,
        batch: &Batch,
    ) -> impl Future<Output = Result<HeldBatch<'_>, Error>> + use<'_> {
        let request = Request::batch(batch).at(Location::caller());
        calls::lock_batch(move || self.parts(), request, Wait::Forever)
    }

    #[doc = include_str!("../calls/lock_batch_timeout.md")]
    #[track_caller]
    pub fn lock_batch_timeout(
        &self,
        batch: &Batch,
        timeout: Duration,
    ) -> impl Future<Output = Result<HeldBatch<'_>, Error>> + use<'_> {
        let request = Request::batch(batch).at(Location::caller());
        calls::lock_batch(move || self.parts(), request, Wait::Timeout(timeout))
    }

    #[doc = include_str!("../calls/try_lock_batch.md")]
    #[track_caller]
    pub fn try_lock_batch(
        &self,
        batch: &Batch,
    ) -> impl Future<Output = Result<Result<HeldBatch<'_>, Busy>, Error>> + use<'_> {
        let request = Request::batch(batch).at(Location::caller());
        calls::try_lock_batch(move || self.parts(), request)
    }

    #[doc = include_str!("../calls/acquire_permit.md")]
    #[track_caller]
    pub fn acquire_permit<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::permit(move || self.parts(), key, permits, Wait::Forever, site)
    }

    #[doc = include_str!("../calls/acquire_permit_timeout.md")]
    #[track_caller]
    pub fn acquire_permit_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
        timeout: Duration,
    ) -> impl Future<Output = Result<Held<'_, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::permit(
            move || self.parts(),
            key,
            permits,
            Wait::Timeout(timeout),
            site,
        )
    }

    #[doc = include_str!("../calls/try_acquire_permit.md")]
    #[track_caller]
    pub fn try_acquire_permit<K: AdvisoryKey>(
        &self,
        key: K,
        permits: NonZeroU8,
    ) -> impl Future<Output = Result<Result<Held<'_, K>, K>, Error>> + use<'_, K> {
        let site = Location::caller();
        calls::try_permit(move || self.parts(), key, permits, site)
    }

    /// What a lock call needs (the calls borrow tokio-postgres's face `&`):
    /// what the transaction holds, its connection and the [`Pg`] driver that
    /// runs the engine's statements on it, the depth. It owns its
    /// transaction, so one is open.
    #[inline(always)]
    fn parts(&self) -> Result<Parts<'_, Pg<'_>, PgConn<'_>, Pg<'_>>, Error> {
        Ok(Parts {
            state: &self.shared.state,
            conn: PgConn {
                client: self.client(),
                cache: self.cache,
                cancelled: &self.shared.cancelled,
            },
            driver: Pg::new(&self.locker.inner),
            depth: self.depth,
            stack: std::marker::PhantomData,
        })
    }
}
