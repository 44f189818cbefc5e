//! [`Prepared`]: lockkit's lock statements prepared once on one connection,
//! so a lock costs the server no parse and plan.

use std::sync::Arc;

use futures_util::future::try_join_all;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Statement, Transaction};

use crate::engine::error::Error;
use crate::engine::plan::Plan;
use crate::engine::sql;

/// The lock statements of [`sql`](crate::driver::sql), prepared on one
/// connection.
///
/// Without it, lockkit sends each lock statement unnamed with its types
/// (`Parse`, `Bind`, `Execute` in one round trip), and the server parses and
/// plans it every time. With it, a lock is only `Bind` and `Execute`, exactly
/// what a hand-prepared `SELECT pg_advisory_xact_lock($1)` costs. Keep one
/// per connection, next to it, and pass it to
/// [`Locker::begin_prepared`](crate::Locker::begin_prepared).
///
/// A `Prepared` belongs to the connection that prepared it: used with
/// another, the server answers "prepared statement does not exist" and the
/// transaction aborts. Named prepared statements also do not survive a
/// transaction-mode pooler (pgbouncer before 1.21); use
/// [`Locker::begin`](crate::Locker::begin) there.
#[derive(Clone, Debug)]
pub struct Prepared {
    inner: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    lock_bigint: Statement,
    lock_bigint_shared: Statement,
    lock_pair: Statement,
    lock_pair_shared: Statement,
    batch_bigint: Statement,
    batch_pair: Statement,
    batch_bigint_exclusive: Statement,
    batch_pair_exclusive: Statement,
}

impl Prepared {
    /// Prepares the lock statements on `client`, in one round trip.
    ///
    /// # Errors
    ///
    /// When the server refuses to prepare them.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: prepared statements that were never handed out are
    /// closed when dropped.
    pub async fn new(client: &Client) -> Result<Prepared, Error> {
        let int8 = [Type::INT8];
        let int4 = [Type::INT4, Type::INT4];
        let bigint_batch = [Type::INT8_ARRAY, Type::BOOL_ARRAY];
        let pair_batch = [Type::INT4_ARRAY, Type::INT4_ARRAY, Type::BOOL_ARRAY];
        let texts: [(&str, &[Type]); 8] = [
            (sql::LOCK_BIGINT, &int8),
            (sql::LOCK_BIGINT_SHARED, &int8),
            (sql::LOCK_PAIR, &int4),
            (sql::LOCK_PAIR_SHARED, &int4),
            (sql::BATCH_BIGINT, &bigint_batch),
            (sql::BATCH_PAIR, &pair_batch),
            (sql::BATCH_BIGINT_EXCLUSIVE, &bigint_batch[..1]),
            (sql::BATCH_PAIR_EXCLUSIVE, &pair_batch[..2]),
        ];
        let statements = try_join_all(
            texts
                .iter()
                .map(|(text, types)| client.prepare_typed(text, types)),
        )
        .await?;
        let [lock_bigint, lock_bigint_shared, lock_pair, lock_pair_shared, batch_bigint, batch_pair, batch_bigint_exclusive, batch_pair_exclusive] =
            <[Statement; 8]>::try_from(statements).expect("one statement per text");
        Ok(Prepared {
            inner: Arc::new(Statements {
                lock_bigint,
                lock_bigint_shared,
                lock_pair,
                lock_pair_shared,
                batch_bigint,
                batch_pair,
                batch_bigint_exclusive,
                batch_pair_exclusive,
            }),
        })
    }
}

/// How a transaction sends its lock statements.
#[derive(Clone, Debug, Default)]
pub(crate) enum LockSql {
    /// Unnamed, typed: parsed by the server each time.
    #[default]
    Typed,
    /// Prepared once on this connection.
    Prepared(Prepared),
}

type PgResult<T> = Result<T, tokio_postgres::Error>;

impl LockSql {
    /// Sends the lock statements of a plan: both are sent on the first poll,
    /// `BigInt` keys first, and the server runs them in that order.
    pub(crate) async fn lock(&self, tx: &Transaction<'_>, plan: &Plan) -> PgResult<()> {
        match (plan.bigint(), plan.pair_classes()) {
            ([key], []) => self.lock_bigint(tx, *key, plan.bigint_shared()[0]).await?,
            ([], [class]) => {
                self.lock_pair(tx, *class, plan.pair_objects()[0], plan.pair_shared()[0])
                    .await?
            }
            (_, []) => self.batch_bigint(tx, plan).await?,
            ([], _) => self.batch_pair(tx, plan).await?,
            _ => {
                futures_util::future::try_join(
                    self.batch_bigint(tx, plan),
                    self.batch_pair(tx, plan),
                )
                .await?;
                0
            }
        };
        Ok(())
    }

    async fn lock_bigint(&self, tx: &Transaction<'_>, key: i64, shared: bool) -> PgResult<u64> {
        match self {
            LockSql::Prepared(p) => {
                let stmt = if shared {
                    &p.inner.lock_bigint_shared
                } else {
                    &p.inner.lock_bigint
                };
                tx.execute(stmt, &[&key]).await
            }
            LockSql::Typed => {
                let text = if shared {
                    sql::LOCK_BIGINT_SHARED
                } else {
                    sql::LOCK_BIGINT
                };
                tx.execute_typed(text, &[(&key, Type::INT8)]).await
            }
        }
    }

    async fn lock_pair(
        &self,
        tx: &Transaction<'_>,
        class: i32,
        object: i32,
        shared: bool,
    ) -> PgResult<u64> {
        match self {
            LockSql::Prepared(p) => {
                let stmt = if shared {
                    &p.inner.lock_pair_shared
                } else {
                    &p.inner.lock_pair
                };
                tx.execute(stmt, &[&class, &object]).await
            }
            LockSql::Typed => {
                let text = if shared {
                    sql::LOCK_PAIR_SHARED
                } else {
                    sql::LOCK_PAIR
                };
                tx.execute_typed(text, &[(&class, Type::INT4), (&object, Type::INT4)])
                    .await
            }
        }
    }

    async fn batch_bigint(&self, tx: &Transaction<'_>, plan: &Plan) -> PgResult<u64> {
        let (keys, shared) = (plan.bigint(), plan.bigint_shared());
        let exclusive = !shared.contains(&true);
        match self {
            LockSql::Prepared(p) if exclusive => {
                tx.execute(&p.inner.batch_bigint_exclusive, &[&keys]).await
            }
            LockSql::Prepared(p) => tx.execute(&p.inner.batch_bigint, &[&keys, &shared]).await,
            LockSql::Typed if exclusive => {
                tx.execute_typed(sql::BATCH_BIGINT_EXCLUSIVE, &[(&keys, Type::INT8_ARRAY)])
                    .await
            }
            LockSql::Typed => {
                tx.execute_typed(
                    sql::BATCH_BIGINT,
                    &[(&keys, Type::INT8_ARRAY), (&shared, Type::BOOL_ARRAY)],
                )
                .await
            }
        }
    }

    async fn batch_pair(&self, tx: &Transaction<'_>, plan: &Plan) -> PgResult<u64> {
        let (c, o, s) = (plan.pair_classes(), plan.pair_objects(), plan.pair_shared());
        let exclusive = !s.contains(&true);
        match self {
            LockSql::Prepared(p) if exclusive => {
                tx.execute(&p.inner.batch_pair_exclusive, &[&c, &o]).await
            }
            LockSql::Prepared(p) => tx.execute(&p.inner.batch_pair, &[&c, &o, &s]).await,
            LockSql::Typed if exclusive => {
                tx.execute_typed(
                    sql::BATCH_PAIR_EXCLUSIVE,
                    &[(&c, Type::INT4_ARRAY), (&o, Type::INT4_ARRAY)],
                )
                .await
            }
            LockSql::Typed => {
                tx.execute_typed(
                    sql::BATCH_PAIR,
                    &[
                        (&c, Type::INT4_ARRAY),
                        (&o, Type::INT4_ARRAY),
                        (&s, Type::BOOL_ARRAY),
                    ],
                )
                .await
            }
        }
    }
}
