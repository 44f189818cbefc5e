//! The three ways of ingesting a batch exactly once (and a control that is
//! not exactly once), each as one transaction.

use std::fmt;

use futures_util::future::try_join;
use lockkit::{AdvisoryKey, Batch, Locker};
use tokio_postgres::{Client, Statement};
use uuid::Uuid;

/// An event's idempotency key, locked one key per event.
#[derive(AdvisoryKey, Debug, Clone, Copy)]
pub struct Event {
    /// The client-generated idempotency key.
    pub business_key: Uuid,
}

/// Stripes of [`StripedEvent`]: every event folds onto one of this many
/// keys, so a batch of any size takes at most this many locks. It is a
/// property of the type (every process must agree), and it equals
/// PostgreSQL's default `max_locks_per_transaction`.
pub const STRIPES: usize = 64;

/// The same idempotency key folded onto [`STRIPES`] keys.
#[derive(AdvisoryKey, Debug, Clone, Copy)]
#[advisory_key(namespace = "EventStripe", stripes = 64)]
pub struct StripedEvent {
    /// The client-generated idempotency key.
    pub business_key: Uuid,
}

/// How a batch is ingested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Strategy {
    /// lockkit: `pg_advisory_xact_lock` on every event's key, as one sorted
    /// batch, then `INSERT … ON CONFLICT DO NOTHING`, as the notes chose.
    Advisory,
    /// A plain `INSERT … ON CONFLICT DO NOTHING` on the unique key: the
    /// contention happens inside the unique index.
    OnConflict,
    /// Check-then-insert on a reservation table: `SELECT … FOR UPDATE` the
    /// reservations that exist, insert the missing ones and their events.
    ForUpdate,
    /// Control, not exactly once: check-then-insert with no lock and no
    /// unique index. Shows that the duplicate check can fail.
    NoLock,
}

impl Strategy {
    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Advisory => "advisory",
            Strategy::OnConflict => "on-conflict",
            Strategy::ForUpdate => "for-update",
            Strategy::NoLock => "no-lock",
        }
    }

    /// The tables this strategy ingests into, created fresh (autovacuum off,
    /// so the dead tuples a run leaves can be counted).
    pub(crate) fn schema(self) -> String {
        let mut sql = String::from(
            "DROP TABLE IF EXISTS ingest_events, ingest_reservations;
             CREATE TABLE ingest_events (
                 business_key uuid NOT NULL,
                 payload text NOT NULL,
                 received_at timestamptz NOT NULL DEFAULT now()
             ) WITH (autovacuum_enabled = off);",
        );
        sql.push_str(match self {
            // ON CONFLICT needs the unique index as its arbiter.
            Strategy::Advisory | Strategy::OnConflict => {
                "CREATE UNIQUE INDEX ingest_events_key ON ingest_events (business_key);"
            }
            // The reservation (or nothing, for the control) is the gate; the
            // events are still looked up by key.
            Strategy::ForUpdate | Strategy::NoLock => {
                "CREATE INDEX ingest_events_key ON ingest_events (business_key);"
            }
        });
        if self == Strategy::ForUpdate {
            sql.push_str(
                "CREATE TABLE ingest_reservations (business_key uuid PRIMARY KEY)
                 WITH (autovacuum_enabled = off);",
            );
        }
        sql
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What to do with batches larger than the lock budget (advisory only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BudgetMode {
    /// Smaller transactions: split the batch into transactions of at most
    /// the budget's number of events.
    Split,
    /// Striping: lock [`StripedEvent`] keys, so a whole batch takes at most
    /// [`STRIPES`] locks in one transaction.
    Stripe,
}

/// How the advisory strategy fits its batches into the lock budget, decided
/// once per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budgeting {
    /// The batch fits the budget: one transaction, one key per event.
    Fits,
    /// Transactions of at most `chunk` events, one key per event.
    Split {
        /// Events per transaction.
        chunk: usize,
    },
    /// One transaction per batch, on [`STRIPES`] striped keys.
    Stripe,
}

impl Budgeting {
    /// Decides for batches of `batch` events under a budget of `budget` keys
    /// per transaction. Striping falls back to splitting when even the
    /// stripes exceed the budget.
    pub fn decide(batch: usize, budget: usize, mode: BudgetMode) -> Budgeting {
        if batch <= budget {
            Budgeting::Fits
        } else if mode == BudgetMode::Stripe && STRIPES <= budget {
            Budgeting::Stripe
        } else {
            Budgeting::Split {
                chunk: budget.max(1),
            }
        }
    }

    /// Events per transaction for batches of `batch` events.
    pub(crate) fn chunk(self, batch: usize) -> usize {
        match self {
            Budgeting::Split { chunk } => chunk,
            Budgeting::Fits | Budgeting::Stripe => batch.max(1),
        }
    }

    /// A sentence for the report.
    pub fn describe(self, batch: usize, budget: usize) -> String {
        match self {
            Budgeting::Fits => format!(
                "batches of {batch} fit the lock budget of {budget}: one transaction and one key per event"
            ),
            Budgeting::Split { chunk } => format!(
                "batches of {batch} exceed the lock budget of {budget}: split into transactions of at most {chunk} events, one key per event (smaller transactions)"
            ),
            Budgeting::Stripe => format!(
                "batches of {batch} exceed the lock budget of {budget}: one transaction per batch on {STRIPES} striped keys (#[advisory_key(stripes = {STRIPES})])"
            ),
        }
    }
}

/// The statements of one strategy, prepared on one worker's connection.
pub(crate) struct Statements {
    insert: Statement,
    check: Option<Statement>,
    reserve: Option<Statement>,
}

const INSERT_ON_CONFLICT: &str = "INSERT INTO ingest_events (business_key, payload)
     SELECT k, md5(k::text) FROM unnest($1::uuid[]) AS t(k) ORDER BY k
     ON CONFLICT DO NOTHING";
const INSERT_PLAIN: &str = "INSERT INTO ingest_events (business_key, payload)
     SELECT k, md5(k::text) FROM unnest($1::uuid[]) AS t(k) ORDER BY k";
const CHECK_RESERVATIONS: &str = "SELECT business_key FROM ingest_reservations
     WHERE business_key = ANY($1::uuid[]) ORDER BY business_key FOR UPDATE";
const RESERVE: &str = "INSERT INTO ingest_reservations (business_key)
     SELECT k FROM unnest($1::uuid[]) AS t(k) ORDER BY k";
const CHECK_EVENTS: &str =
    "SELECT business_key FROM ingest_events WHERE business_key = ANY($1::uuid[])";

impl Statements {
    /// Prepares what `strategy` sends (outside the measured window).
    pub(crate) async fn prepare(
        client: &Client,
        strategy: Strategy,
        _locker: &Locker,
    ) -> Result<Statements, lockkit::Error> {
        Ok(match strategy {
            Strategy::Advisory => Statements {
                insert: client.prepare(INSERT_ON_CONFLICT).await?,
                check: None,
                reserve: None,
            },
            Strategy::OnConflict => Statements {
                insert: client.prepare(INSERT_ON_CONFLICT).await?,
                check: None,
                reserve: None,
            },
            Strategy::ForUpdate => Statements {
                insert: client.prepare(INSERT_PLAIN).await?,
                check: Some(client.prepare(CHECK_RESERVATIONS).await?),
                reserve: Some(client.prepare(RESERVE).await?),
            },
            Strategy::NoLock => Statements {
                insert: client.prepare(INSERT_PLAIN).await?,
                check: Some(client.prepare(CHECK_EVENTS).await?),
                reserve: None,
            },
        })
    }
}

/// Ingests `keys` in one transaction, the way `strategy` does.
pub(crate) async fn ingest(
    client: &mut Client,
    strategy: Strategy,
    budgeting: Budgeting,
    locker: &Locker,
    stmts: &Statements,
    keys: &[Uuid],
) -> Result<(), lockkit::Error> {
    match strategy {
        Strategy::Advisory => {
            let batch: Batch = if budgeting == Budgeting::Stripe {
                keys.iter()
                    .map(|&business_key| StripedEvent { business_key })
                    .collect()
            } else {
                keys.iter()
                    .map(|&business_key| Event { business_key })
                    .collect()
            };
            let tx = locker.begin(client).await?;
            {
                // The lock statement goes out first and the insert right
                // behind it: the server runs them in order, so the insert
                // starts once every key is locked, at no extra round trip.
                let insert = async {
                    tx.execute(&stmts.insert, &[&keys])
                        .await
                        .map_err(lockkit::Error::from)
                };
                let (_held, _) = try_join(tx.lock_batch(&batch), insert).await?;
            }
            tx.commit().await
        }
        Strategy::OnConflict => {
            let tx = client.transaction().await?;
            tx.execute(&stmts.insert, &[&keys]).await?;
            Ok(tx.commit().await?)
        }
        Strategy::ForUpdate | Strategy::NoLock => {
            let tx = client.transaction().await?;
            let check = stmts.check.as_ref().expect("prepared for this strategy");
            let found: std::collections::HashSet<Uuid> = tx
                .query(check, &[&keys])
                .await?
                .iter()
                .map(|row| row.get(0))
                .collect();
            let missing: Vec<Uuid> = keys
                .iter()
                .filter(|k| !found.contains(k))
                .copied()
                .collect();
            if !missing.is_empty() {
                if let Some(reserve) = &stmts.reserve {
                    // A concurrent copy that reserved the key first makes
                    // this wait for its commit, then fail with 23505.
                    tx.execute(reserve, &[&missing]).await?;
                }
                tx.execute(&stmts.insert, &[&missing]).await?;
            }
            Ok(tx.commit().await?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striped_keys_fold_onto_the_stripes() {
        let keys: std::collections::HashSet<_> = (0..10_000u128)
            .map(|i| {
                StripedEvent {
                    business_key: Uuid::from_u128(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                }
                .lock_key()
            })
            .collect();
        assert!(keys.len() <= STRIPES, "{} keys", keys.len());
        assert!(keys.len() > STRIPES / 2);
    }

    #[test]
    fn budgeting() {
        assert_eq!(
            Budgeting::decide(50, 64, BudgetMode::Stripe),
            Budgeting::Fits
        );
        assert_eq!(
            Budgeting::decide(500, 64, BudgetMode::Split),
            Budgeting::Split { chunk: 64 }
        );
        assert_eq!(
            Budgeting::decide(500, 64, BudgetMode::Stripe),
            Budgeting::Stripe
        );
        assert_eq!(
            Budgeting::decide(500, 32, BudgetMode::Stripe),
            Budgeting::Split { chunk: 32 }
        );
        assert_eq!(Budgeting::decide(500, 64, BudgetMode::Split).chunk(500), 64);
        assert_eq!(Budgeting::Stripe.chunk(500), 500);
    }
}
