//! [`LockTx`]: a tokio-postgres transaction that takes advisory locks, and
//! the guards that prove them.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::future::{try_join, try_join3, try_join5};
use tokio_postgres::types::Type;
use tokio_postgres::Transaction;

use crate::engine::budget::TxLocks;
use crate::engine::error::{Context, Error};
use crate::engine::guard::{Busy, Held, HeldBatch};
use crate::engine::plan::{Batch, Mode, Plan};
use crate::engine::sql;
use crate::key::{AdvisoryKey, KeyForm, LockKey};
use crate::pg::locker::Locker;
use crate::pg::prepared::LockSql;

type PgResult<T> = Result<T, tokio_postgres::Error>;

/// A tokio-postgres transaction that takes transaction-scoped advisory
/// locks.
///
/// It dereferences to [`tokio_postgres::Transaction`] for queries. Locks are
/// released by the server at `COMMIT` or `ROLLBACK` (or a rollback of the
/// savepoint that took them), never earlier; guards borrow the transaction,
/// so none outlives it. Locks are taken only inside this transaction, so the
/// silent lock-and-release of an xact lock outside a transaction cannot
/// happen through this API.
///
/// It remembers what it holds: locking a held key again costs no round trip,
/// the budget counts distinct keys, and locks released by a savepoint
/// rollback are forgotten. Use [`LockTx::savepoint`] rather than raw
/// `SAVEPOINT` SQL, which this bookkeeping cannot see.
pub struct LockTx<'c> {
    tx: Option<Transaction<'c>>,
    locker: Locker,
    sql: LockSql,
    locks: Arc<Mutex<TxLocks>>,
    depth: u32,
}

impl fmt::Debug for LockTx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockTx")
            .field("depth", &self.depth)
            .field("locks", &*self.locks())
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
        if self.tx.is_some() && self.depth > 0 {
            self.locks().rollback_savepoint(self.depth);
        }
    }
}

/// How one acquisition waits.
#[derive(Clone, Copy)]
enum Wait {
    Forever,
    Timeout(Duration),
}

impl<'c> LockTx<'c> {
    pub(crate) fn new(locker: Locker, tx: Transaction<'c>, sql: LockSql) -> Self {
        LockTx {
            tx: Some(tx),
            locker,
            sql,
            locks: Arc::new(Mutex::new(TxLocks::new())),
            depth: 0,
        }
    }

    fn locks(&self) -> MutexGuard<'_, TxLocks> {
        self.locks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&mut self) -> Transaction<'c> {
        self.tx
            .take()
            .expect("lockkit: transaction used after commit or rollback")
    }

    /// The locker this transaction belongs to.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// Savepoint depth: 0 for the transaction itself.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Distinct keys this transaction holds through lockkit.
    pub fn held_count(&self) -> usize {
        self.locks().len()
    }

    /// Whether this transaction holds `key` in at least `mode`, as far as
    /// lockkit took it.
    pub fn holds<K: AdvisoryKey + ?Sized>(&self, key: &K, mode: Mode) -> bool {
        self.locks()
            .mode(key.lock_key())
            .is_some_and(|held| held.covers(mode))
    }

    /// Commits, releasing every lock (and, for a savepoint, handing its
    /// locks to the enclosing transaction).
    ///
    /// # Errors
    ///
    /// When `COMMIT` (or `RELEASE`) fails; the locks are released either way
    /// once the transaction ends.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: if dropped while in flight, whether the transaction
    /// committed is unknown (as with tokio-postgres).
    pub async fn commit(mut self) -> Result<(), Error> {
        let tx = self.take();
        let result = tx.commit().await;
        if self.depth > 0 {
            if result.is_ok() {
                self.locks().release_savepoint(self.depth);
            } else {
                self.locks().poison();
            }
        }
        Ok(result?)
    }

    /// Rolls back, releasing every lock this transaction (or savepoint) took.
    ///
    /// # Errors
    ///
    /// When `ROLLBACK` fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: a dropped rollback leaves the transaction to
    /// roll back anyway.
    pub async fn rollback(mut self) -> Result<(), Error> {
        let tx = self.take();
        let result = tx.rollback().await;
        if self.depth > 0 {
            if result.is_ok() {
                self.locks().rollback_savepoint(self.depth);
            } else {
                self.locks().poison();
            }
        }
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
        let sql = self.sql.clone();
        let locks = Arc::clone(&self.locks);
        let tx = self
            .tx
            .as_mut()
            .expect("lockkit: transaction used after commit or rollback");
        let inner = tx.savepoint(format!("lockkit_sp_{depth}")).await?;
        Ok(LockTx {
            tx: Some(inner),
            locker,
            sql,
            locks,
            depth,
        })
    }

    /// Takes `key` exclusive, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// [`Error::BudgetExceeded`], [`Error::LockOrder`] (when configured),
    /// [`Error::HotStandby`], [`Error::Poisoned`] and
    /// [`Error::HashtextMismatch`] before anything is sent;
    /// [`Error::Deadlock`], [`Error::LockTableFull`],
    /// [`Error::ConnectionLost`] and other server errors after, which abort
    /// the transaction.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped after its statement was sent, the server may
    /// still grant the lock, so the transaction is marked poisoned: every
    /// later lock call fails with [`Error::Poisoned`] until it ends.
    pub async fn lock<K: AdvisoryKey>(&self, key: K) -> Result<Held<'_, K>, Error> {
        self.lock_one(key, Mode::Exclusive, Wait::Forever).await
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
    pub async fn lock_shared<K: AdvisoryKey>(&self, key: K) -> Result<Held<'_, K>, Error> {
        self.lock_one(key, Mode::Shared, Wait::Forever).await
    }

    /// Takes `key` exclusive, waiting at most `timeout` (measured by the
    /// server). On timeout nothing is held and the transaction is still
    /// usable.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], and as [`LockTx::lock`]; after a deadlock the
    /// savepoint rollback leaves the transaction usable too.
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn lock_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> Result<Held<'_, K>, Error> {
        self.lock_one(key, Mode::Exclusive, Wait::Timeout(timeout))
            .await
    }

    /// Takes `key` shared, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn lock_shared_timeout<K: AdvisoryKey>(
        &self,
        key: K,
        timeout: Duration,
    ) -> Result<Held<'_, K>, Error> {
        self.lock_one(key, Mode::Shared, Wait::Timeout(timeout))
            .await
    }

    /// Takes `key` exclusive if no other transaction holds it, without
    /// waiting. Gives the key back when it is busy.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`] (a full lock table raises `53200` even here).
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn try_lock<K: AdvisoryKey>(&self, key: K) -> Result<Result<Held<'_, K>, K>, Error> {
        self.try_lock_one(key, Mode::Exclusive).await
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
    /// As [`LockTx::lock`].
    pub async fn try_lock_shared<K: AdvisoryKey>(
        &self,
        key: K,
    ) -> Result<Result<Held<'_, K>, K>, Error> {
        self.try_lock_one(key, Mode::Shared).await
    }

    /// Takes every key of `batch` in the global lock order, in one round
    /// trip (two statements pipelined when the batch mixes `BigInt` and
    /// `Pair` keys).
    ///
    /// # Pipelining the batch with the next statement
    ///
    /// The future sends its statements when first polled. Polled together
    /// with the transaction's next statement, both go out before either
    /// answer comes back: the server runs the locks first and the statement
    /// after them, in order, and the locks cost no round trip of their own
    /// (the `pipelined` comparison of `cargo bench -p lockkit-tests --bench
    /// locks`). Poll the lock future *first* (`try_join!` polls left to
    /// right) and pipeline only a statement that may run under the locks: it
    /// runs before the locks are known to be granted. If the locks fail
    /// (deadlock, lock table full), the server aborts the transaction, the
    /// statement fails too, and `try_join!` returns the lock's error.
    ///
    /// ```no_run
    /// use lockkit::{AdvisoryKey, Batch, Error, Locker, Prepared};
    /// use tokio_postgres::types::Type;
    ///
    /// #[derive(AdvisoryKey)]
    /// struct Event {
    ///     id: i64,
    /// }
    ///
    /// async fn ingest(
    ///     locker: &Locker,
    ///     prepared: &Prepared, // locker.prepare(&client), once per connection
    ///     client: &mut tokio_postgres::Client,
    ///     ids: &[i64],
    /// ) -> Result<u64, Error> {
    ///     let batch: Batch = ids.iter().map(|&id| Event { id }).collect();
    ///     let tx = locker.begin_prepared(client, prepared).await?;
    ///     // One round trip for both: the locks, then the insert under them.
    ///     let insert = "INSERT INTO events (id) SELECT unnest($1::int8[]) ON CONFLICT DO NOTHING";
    ///     let (held, inserted) = tokio::try_join!(tx.lock_batch(&batch), async {
    ///         Ok::<_, Error>(tx.execute_typed(insert, &[(&ids, Type::INT8_ARRAY)]).await?)
    ///     })?;
    ///     drop(held); // proof only: the locks stay held until the transaction ends
    ///     tx.commit().await?; // releases every lock of the batch
    ///     Ok(inserted)
    /// }
    /// ```
    ///
    /// The second future must send its statement on its first poll, as
    /// `execute_typed`, `query_typed`, and `execute`/`query` with a prepared
    /// `Statement` do; `execute` with a `&str` first waits for a prepare.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn lock_batch(&self, batch: &Batch) -> Result<HeldBatch<'_>, Error> {
        self.acquire(batch, Wait::Forever).await
    }

    /// Takes every key of `batch`, the whole batch waiting at most `timeout`
    /// (not each key). On timeout nothing of the batch is held and the
    /// transaction is still usable.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock_timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn lock_batch_timeout(
        &self,
        batch: &Batch,
        timeout: Duration,
    ) -> Result<HeldBatch<'_>, Error> {
        self.acquire(batch, Wait::Timeout(timeout)).await
    }

    /// Takes every key of `batch` or none: when any key is busy, nothing of
    /// the batch is held and the busy keys are returned.
    ///
    /// # Errors
    ///
    /// As [`LockTx::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockTx::lock`].
    pub async fn try_lock_batch(
        &self,
        batch: &Batch,
    ) -> Result<Result<HeldBatch<'_>, Busy>, Error> {
        let (plan, mut flight) = self.prepare(batch.iter(), batch.has_hashtext())?;
        if plan.is_empty() {
            flight.finish(&plan, true, false);
            return Ok(Ok(self.batch_guard(batch)));
        }
        let tx = &**self;
        let result = if plan.len() == 1 {
            try_one(tx, &plan).await.map(|ok| {
                if ok {
                    Vec::new()
                } else {
                    plan.keys().collect()
                }
            })
        } else {
            try_many(tx, &plan).await
        };
        match result {
            Ok(busy) => {
                flight.finish(&plan, busy.is_empty(), false);
                Ok(if busy.is_empty() {
                    Ok(self.batch_guard(batch))
                } else {
                    Err(Busy::__new(busy))
                })
            }
            Err(e) => {
                let aborted = plan.len() == 1 || tx.batch_execute(sql::ROLLBACK).await.is_err();
                flight.finish(&plan, false, aborted);
                Err(Error::from_pg(e, Context::Plain))
            }
        }
    }

    async fn lock_one<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
        wait: Wait,
    ) -> Result<Held<'_, K>, Error> {
        let key = value.lock_key();
        let (plan, flight) =
            self.prepare([(key, mode)], K::KEY_SPEC.form() == KeyForm::HashText)?;
        self.send(&plan, flight, wait).await?;
        let mode = self.locks().mode(key).unwrap_or(mode);
        Ok(Held::__granted(value, key, mode))
    }

    async fn try_lock_one<K: AdvisoryKey>(
        &self,
        value: K,
        mode: Mode,
    ) -> Result<Result<Held<'_, K>, K>, Error> {
        let key = value.lock_key();
        let (plan, mut flight) =
            self.prepare([(key, mode)], K::KEY_SPEC.form() == KeyForm::HashText)?;
        if !plan.is_empty() {
            match try_one(self, &plan).await {
                Ok(true) => flight.finish(&plan, true, false),
                Ok(false) => {
                    flight.finish(&plan, false, false);
                    return Ok(Err(value));
                }
                Err(e) => {
                    flight.finish(&plan, false, true);
                    return Err(Error::from_pg(e, Context::Plain));
                }
            }
        } else {
            flight.finish(&plan, true, false);
        }
        let mode = self.locks().mode(key).unwrap_or(mode);
        Ok(Ok(Held::__granted(value, key, mode)))
    }

    async fn acquire(&self, batch: &Batch, wait: Wait) -> Result<HeldBatch<'_>, Error> {
        let (plan, flight) = self.prepare(batch.iter(), batch.has_hashtext())?;
        self.send(&plan, flight, wait).await?;
        Ok(self.batch_guard(batch))
    }

    fn batch_guard(&self, batch: &Batch) -> HeldBatch<'_> {
        HeldBatch::__granted(batch.planned())
    }

    /// Checks everything that needs no round trip, plans what to send, and
    /// marks the request in flight (one critical section, so concurrent calls
    /// on one transaction cannot both plan against the same held set).
    fn prepare(
        &self,
        request: impl IntoIterator<Item = (LockKey, Mode)>,
        hashtext: bool,
    ) -> Result<(Plan, Flight<'_>), Error> {
        let facts = self.locker.facts();
        if facts.in_recovery() && !self.locker.config().allow_standby {
            return Err(Error::HotStandby);
        }
        if hashtext {
            facts.check_hashtext()?;
        }
        let mut locks = self.locks();
        let plan = locks.plan(request, self.locker.budget(), self.locker.config())?;
        locks.start();
        Ok((
            plan,
            Flight {
                locks: &self.locks,
                depth: self.depth,
                done: false,
            },
        ))
    }

    /// Sends a plan's lock statements and records the outcome.
    async fn send(&self, plan: &Plan, mut flight: Flight<'_>, wait: Wait) -> Result<(), Error> {
        if plan.is_empty() {
            flight.finish(plan, true, false);
            return Ok(());
        }
        let tx = &**self;
        match wait {
            Wait::Forever => match self.sql.lock(tx, plan).await {
                Ok(()) => flight.finish(plan, true, false),
                Err(e) => {
                    flight.finish(plan, false, true);
                    return Err(Error::from_pg(e, Context::Plain));
                }
            },
            Wait::Timeout(timeout) => {
                let setting = sql::timeout_setting(timeout);
                let result = try_join5(
                    tx.batch_execute(sql::SAVEPOINT),
                    tx.execute_typed(sql::SAVE_TIMEOUTS, &[]),
                    tx.execute_typed(sql::SET_TIMEOUTS, &[(&setting, Type::TEXT)]),
                    self.sql.lock(tx, plan),
                    try_join(
                        tx.execute_typed(sql::RESTORE_TIMEOUTS, &[]),
                        tx.batch_execute(sql::RELEASE),
                    ),
                )
                .await;
                match result {
                    Ok(_) => flight.finish(plan, true, false),
                    Err(e) => {
                        // The savepoint rollback releases whatever part of
                        // the batch was granted and restores the timeouts.
                        let aborted = tx.batch_execute(sql::ROLLBACK).await.is_err();
                        flight.finish(plan, false, aborted);
                        return Err(Error::from_pg(
                            e,
                            Context::Timeout {
                                timeout,
                                keys: plan.len(),
                            },
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Poisons the transaction unless the request it guards finishes: a dropped
/// future leaves the held set unknown.
struct Flight<'a> {
    locks: &'a Mutex<TxLocks>,
    depth: u32,
    done: bool,
}

impl Flight<'_> {
    fn finish(&mut self, plan: &Plan, acquired: bool, aborted: bool) {
        self.done = true;
        self.locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .finish(plan, self.depth, acquired, aborted);
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .poison();
        }
    }
}

/// Tries the single key of `plan`; nothing to undo when it is busy.
async fn try_one(tx: &Transaction<'_>, plan: &Plan) -> PgResult<bool> {
    let row = match (plan.bigint(), plan.pair_classes()) {
        ([key], _) => {
            let stmt = if plan.bigint_shared()[0] {
                sql::TRY_BIGINT_SHARED
            } else {
                sql::TRY_BIGINT
            };
            tx.query_typed_one(stmt, &[(key, Type::INT8)]).await?
        }
        (_, [class]) => {
            let stmt = if plan.pair_shared()[0] {
                sql::TRY_PAIR_SHARED
            } else {
                sql::TRY_PAIR
            };
            tx.query_typed_one(
                stmt,
                &[(class, Type::INT4), (&plan.pair_objects()[0], Type::INT4)],
            )
            .await?
        }
        _ => unreachable!("try_one is called with exactly one key"),
    };
    row.try_get(0)
}

/// Tries every key of `plan` inside a savepoint; releases it when all were
/// granted, rolls it back (releasing every granted key) otherwise. Returns
/// the busy keys.
async fn try_many(tx: &Transaction<'_>, plan: &Plan) -> PgResult<Vec<LockKey>> {
    let bigint = async {
        if plan.bigint().is_empty() {
            return Ok(Vec::new());
        }
        let (k, s) = (plan.bigint(), plan.bigint_shared());
        let row = tx
            .query_typed_one(
                sql::TRY_BATCH_BIGINT,
                &[(&k, Type::INT8_ARRAY), (&s, Type::BOOL_ARRAY)],
            )
            .await?;
        let busy: Vec<i64> = row.try_get(0)?;
        Ok(busy.into_iter().map(LockKey::BigInt).collect::<Vec<_>>())
    };
    let pair = async {
        if plan.pair_classes().is_empty() {
            return Ok(Vec::new());
        }
        let (c, o, s) = (plan.pair_classes(), plan.pair_objects(), plan.pair_shared());
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 3] = [
            (&c, Type::INT4_ARRAY),
            (&o, Type::INT4_ARRAY),
            (&s, Type::BOOL_ARRAY),
        ];
        let row = tx.query_typed_one(sql::TRY_BATCH_PAIR, &params).await?;
        let (c, o): (Vec<i32>, Vec<i32>) = (row.try_get(0)?, row.try_get(1)?);
        Ok(c.into_iter()
            .zip(o)
            .map(|(c, o)| LockKey::Pair(c, o))
            .collect())
    };
    let ((), mut busy, busy_pair) =
        try_join3(tx.batch_execute(sql::SAVEPOINT), bigint, pair).await?;
    busy.extend(busy_pair);
    if busy.is_empty() {
        tx.batch_execute(sql::RELEASE).await?;
    } else {
        tx.batch_execute(sql::ROLLBACK).await?;
    }
    Ok(busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    /// Advisory locks belong to the database session, not to a thread:
    /// guards and transactions must cross `.await` points on multi-threaded
    /// runtimes.
    #[test]
    fn guards_and_transactions_are_send_and_sync() {
        send_sync::<Locker>();
        send_sync::<LockTx<'static>>();
        send_sync::<Held<'static, i64>>();
        send_sync::<HeldBatch<'static>>();
        send::<Held<'static, String>>();
        send_sync::<Busy>();
        send_sync::<Error>();
    }

    #[test]
    fn held_batch_proofs_follow_membership() {
        let batch = Batch::new()
            .with(&crate::HashText("a"))
            .with_shared(&crate::HashText("b"));
        let held = HeldBatch::__granted(batch.planned());
        assert!(held.contains(&crate::HashText("a")));
        assert!(!held.contains(&crate::HashText("c")));
        let proof = held.proof(crate::HashText("b")).unwrap();
        assert_eq!(proof.mode(), Mode::Shared);
        assert_eq!(proof.key(), crate::hashtext_key("b"));
        assert_eq!(
            held.proof(crate::HashText("c")).unwrap_err(),
            crate::HashText("c")
        );
    }
}
