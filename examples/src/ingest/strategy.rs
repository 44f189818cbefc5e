//! The ways of ingesting a batch exactly once, and the controls that are not
//! exactly once, each as one transaction.

use std::fmt;

use futures_util::future::try_join;
use lockkit::{AdvisoryKey, Batch, KeySpec, LockClient, LockKey};
use tokio_postgres::{Client, Statement};
use uuid::Uuid;

use super::budget::Budgeting;

/// An event's idempotency key, locked one key per event.
#[derive(AdvisoryKey, Debug, Clone, Copy)]
pub struct Event {
    /// The client-generated idempotency key.
    pub business_key: Uuid,
}

/// The same idempotency key folded onto a number of stripes chosen per run
/// from the lock budget (see [`Budgeting::decide`]), so a batch of any size
/// takes at most that many locks. Every process that locks these keys must
/// use the same stripe count: it is part of the key.
#[derive(Debug, Clone, Copy)]
pub struct StripedEvent {
    /// The client-generated idempotency key.
    pub business_key: Uuid,
    /// Stripes of the run.
    pub stripes: u64,
}

impl AdvisoryKey for StripedEvent {
    const KEY_SPEC: KeySpec<'static> = KeySpec::new("EventStripe");
    fn lock_key(&self) -> LockKey {
        Self::KEY_SPEC
            .stripes(self.stripes.max(1))
            .key_of(&self.business_key)
    }
}

/// How a batch is ingested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Strategy {
    /// lockkit: `pg_advisory_xact_lock` on every event's key, as one sorted
    /// batch, then `INSERT … ON CONFLICT DO NOTHING`, as the notes chose.
    /// The unique index would keep exactly-once without the locks.
    Advisory,
    /// Reference for `advisory`, with no lockkit in it: the same keys (the
    /// same `i64` values, from lockkit's key derivation), sorted and
    /// deduplicated as lockkit sorts them, locked by one hand-written
    /// statement on a plain tokio-postgres transaction, in the same
    /// transactions, pipelined in front of the same insert. What it costs
    /// is what the advisory locks cost as such; `advisory` against it is
    /// what lockkit adds.
    HandAdvisory,
    /// A plain `INSERT … ON CONFLICT DO NOTHING` on the unique key: the
    /// contention happens inside the unique index.
    OnConflict,
    /// Check-then-insert on a reservation table: `SELECT … FOR UPDATE` the
    /// reservations that exist, insert the missing ones and their events.
    ForUpdate,
    /// lockkit's locks alone carry exactly-once: the events table has no
    /// unique index; the batch's keys are locked, then the events that
    /// exist are looked up and the missing ones inserted. The same
    /// statements as `no-lock`, plus the locks.
    LockOnly,
    /// Reference for `lock-only`, with no lockkit in it: its locks taken by
    /// the hand-written statement of `hand-advisory`, on a plain
    /// tokio-postgres transaction.
    HandLockOnly,
    /// Control, not exactly once: `lock-only` without the locks
    /// (check-then-insert, no unique index). Concurrent copies of a key both
    /// see it missing and both insert it: duplicates.
    NoLock,
    /// Control for `--chaos`, not exactly once: `lock-only`, but the worker
    /// acknowledges a transaction's events as soon as it begins, before its
    /// commit, and does not retry them. A transaction killed by the chaos
    /// loses its events: missing rows.
    AckEarly,
}

impl Strategy {
    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Advisory => "advisory",
            Strategy::HandAdvisory => "hand-advisory",
            Strategy::OnConflict => "on-conflict",
            Strategy::ForUpdate => "for-update",
            Strategy::LockOnly => "lock-only",
            Strategy::HandLockOnly => "hand-lock-only",
            Strategy::NoLock => "no-lock",
            Strategy::AckEarly => "ack-early",
        }
    }

    /// Whether the strategy takes advisory locks, through lockkit or by
    /// hand (and so is subject to the lock budget: the hand-written
    /// references take exactly the locks of the strategy they mirror).
    pub fn locks(self) -> bool {
        matches!(
            self,
            Strategy::Advisory
                | Strategy::HandAdvisory
                | Strategy::LockOnly
                | Strategy::HandLockOnly
                | Strategy::AckEarly
        )
    }

    /// The lockkit strategy a hand-written reference mirrors.
    pub fn mirrors(self) -> Option<Strategy> {
        match self {
            Strategy::HandAdvisory => Some(Strategy::Advisory),
            Strategy::HandLockOnly => Some(Strategy::LockOnly),
            _ => None,
        }
    }

    /// Whether this is a control, built to fail the exactly-once check.
    pub fn is_control(self) -> bool {
        matches!(self, Strategy::NoLock | Strategy::AckEarly)
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
            Strategy::Advisory | Strategy::HandAdvisory | Strategy::OnConflict => {
                "CREATE UNIQUE INDEX ingest_events_key ON ingest_events (business_key);"
            }
            // The reservation (or nothing, for the control) is the gate; the
            // events are still looked up by key.
            Strategy::ForUpdate
            | Strategy::LockOnly
            | Strategy::HandLockOnly
            | Strategy::NoLock
            | Strategy::AckEarly => {
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

/// The statements of one strategy, prepared on one worker's connection.
pub(crate) struct Statements {
    insert: Statement,
    check: Option<Statement>,
    reserve: Option<Statement>,
    /// The hand-written references' lock statement.
    lock: Option<Statement>,
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
/// The hand-written references' lock statement: every key of `$1` (sorted
/// and distinct, see [`hand_keys`]) locked in array order. `unnest` in
/// `FROM` yields the array's order, and nothing sorts after the lock
/// function ran; one row comes back (the count), as from lockkit's batch
/// statement.
pub(crate) const HAND_LOCK: &str =
    "SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::int8[]) AS t(k)";
const CHECK_EVENTS: &str =
    "SELECT business_key FROM ingest_events WHERE business_key = ANY($1::uuid[])";

/// Every worker session finds rows by index, never by scanning a table.
/// The study's tables have no statistics (autovacuum is off, so that the
/// dead tuples a run leaves can be counted), so the planner sizes them by
/// their pages alone: a plan made while a table is small (the generic
/// plan, or the custom plans a session keeps when they looked cheaper)
/// scans it whole, and the session keeps scanning as the table grows
/// (tests.rs, `no_statement_scans_a_whole_table`). Every statement the
/// study sends looks rows up by an indexed key, which is the plan the
/// planner picks on a table with statistics.
const SESSION: &str = "SET enable_seqscan = off";

impl Statements {
    /// Sets the session up ([`SESSION`]) and prepares what `strategy`
    /// sends (outside the measured window).
    pub(crate) async fn prepare(
        client: &Client,
        strategy: Strategy,
    ) -> Result<Statements, lockkit::Error> {
        client.batch_execute(SESSION).await?;
        let lock = match strategy {
            Strategy::HandAdvisory | Strategy::HandLockOnly => {
                Some(client.prepare(HAND_LOCK).await?)
            }
            _ => None,
        };
        Ok(match strategy {
            Strategy::Advisory | Strategy::HandAdvisory | Strategy::OnConflict => Statements {
                insert: client.prepare(INSERT_ON_CONFLICT).await?,
                check: None,
                reserve: None,
                lock,
            },
            Strategy::ForUpdate => Statements {
                insert: client.prepare(INSERT_PLAIN).await?,
                check: Some(client.prepare(CHECK_RESERVATIONS).await?),
                reserve: Some(client.prepare(RESERVE).await?),
                lock,
            },
            Strategy::LockOnly | Strategy::HandLockOnly | Strategy::AckEarly | Strategy::NoLock => {
                Statements {
                    insert: client.prepare(INSERT_PLAIN).await?,
                    check: Some(client.prepare(CHECK_EVENTS).await?),
                    reserve: None,
                    lock,
                }
            }
        })
    }
}

/// The keys an advisory strategy locks for `keys`: one per event, or one
/// per stripe.
fn lock_batch_of(budgeting: Budgeting, keys: &[Uuid]) -> Batch {
    match budgeting {
        Budgeting::Stripe { stripes } => keys
            .iter()
            .map(|&business_key| StripedEvent {
                business_key,
                stripes,
            })
            .collect(),
        Budgeting::Fits | Budgeting::Split { .. } => keys
            .iter()
            .map(|&business_key| Event { business_key })
            .collect(),
    }
}

/// The `i64` values the hand-written references lock for `keys`: the keys
/// of [`lock_batch_of`], from lockkit's key derivation, sorted ascending and
/// deduplicated, which is the order lockkit takes them in (`LockKey`'s
/// `Ord`, the global lock order). The study's keys are all in the bigint
/// key space; a pair key has no place in [`HAND_LOCK`] and is an error.
pub(crate) fn hand_keys(budgeting: Budgeting, keys: &[Uuid]) -> Result<Vec<i64>, lockkit::Error> {
    let lock_key = |business_key: Uuid| match budgeting {
        Budgeting::Stripe { stripes } => StripedEvent {
            business_key,
            stripes,
        }
        .lock_key(),
        Budgeting::Fits | Budgeting::Split { .. } => Event { business_key }.lock_key(),
    };
    let mut out = Vec::with_capacity(keys.len());
    for &key in keys {
        match lock_key(key) {
            LockKey::BigInt(k) => out.push(k),
            LockKey::Pair(..) => {
                return Err(lockkit::Error::other(
                    "the hand-written lock statement takes bigint keys only",
                ))
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The keys of `keys` that the check did not find, in their order.
fn missing(keys: &[Uuid], found: &std::collections::HashSet<Uuid>) -> Vec<Uuid> {
    keys.iter()
        .filter(|k| !found.contains(k))
        .copied()
        .collect()
}

/// Ingests `keys` in one transaction, the way `strategy` does.
pub(crate) async fn ingest(
    client: &mut LockClient,
    strategy: Strategy,
    budgeting: Budgeting,
    stmts: &Statements,
    keys: &[Uuid],
) -> Result<(), lockkit::Error> {
    match strategy {
        Strategy::Advisory => {
            let batch = lock_batch_of(budgeting, keys);
            let tx = client.begin().await?;
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
        Strategy::LockOnly | Strategy::AckEarly => {
            let batch = lock_batch_of(budgeting, keys);
            let check = stmts.check.as_ref().expect("prepared for this strategy");
            let tx = client.begin().await?;
            let found = {
                // The check goes out right behind the lock statement. Under
                // READ COMMITTED it takes its snapshot when it starts, after
                // every key is locked: a copy committed by the worker that
                // held a key before us is visible to it.
                let lookup = async {
                    tx.query(check, &[&keys])
                        .await
                        .map_err(lockkit::Error::from)
                };
                let (_held, rows) = try_join(tx.lock_batch(&batch), lookup).await?;
                rows.iter()
                    .map(|row| row.get(0))
                    .collect::<std::collections::HashSet<Uuid>>()
            };
            let missing = missing(keys, &found);
            if !missing.is_empty() {
                tx.execute(&stmts.insert, &[&missing]).await?;
            }
            tx.commit().await
        }
        Strategy::HandAdvisory => {
            let lock = stmts.lock.as_ref().expect("prepared for this strategy");
            let locked = hand_keys(budgeting, keys)?;
            let tx = client.transaction().await?;
            // Pipelined as `advisory` does: the lock statement, then the
            // insert right behind it, both sent before either answer.
            try_join(
                tx.query_one(lock, &[&locked]),
                tx.execute(&stmts.insert, &[&keys]),
            )
            .await?;
            Ok(tx.commit().await?)
        }
        Strategy::HandLockOnly => {
            let lock = stmts.lock.as_ref().expect("prepared for this strategy");
            let check = stmts.check.as_ref().expect("prepared for this strategy");
            let locked = hand_keys(budgeting, keys)?;
            let tx = client.transaction().await?;
            // As `lock-only`: the check goes out right behind the locks and
            // takes its snapshot once every key is locked.
            let (_, rows) =
                try_join(tx.query_one(lock, &[&locked]), tx.query(check, &[&keys])).await?;
            let found: std::collections::HashSet<Uuid> =
                rows.iter().map(|row| row.get(0)).collect();
            let missing = missing(keys, &found);
            if !missing.is_empty() {
                tx.execute(&stmts.insert, &[&missing]).await?;
            }
            Ok(tx.commit().await?)
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
            let missing = missing(keys, &found);
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

    /// The hand-written references lock what lockkit locks, in its order:
    /// the same values as the planned batch, for keys per event and for
    /// striped keys, with the duplicates of a batch taken once.
    #[test]
    fn hand_keys_are_lockkits_planned_keys() {
        let mut keys: Vec<Uuid> = (0..300u128)
            .map(|i| Uuid::from_u128(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        keys.extend_from_within(..40);
        for budgeting in [
            Budgeting::Fits,
            Budgeting::Split { chunk: 64 },
            Budgeting::Stripe { stripes: 64 },
        ] {
            let planned: Vec<i64> = lock_batch_of(budgeting, &keys)
                .planned()
                .into_iter()
                .map(|(key, mode)| {
                    assert_eq!(mode, lockkit::Mode::Exclusive);
                    match key {
                        LockKey::BigInt(k) => k,
                        LockKey::Pair(..) => panic!("a pair key: {key:?}"),
                    }
                })
                .collect();
            assert_eq!(
                hand_keys(budgeting, &keys).unwrap(),
                planned,
                "{budgeting:?}"
            );
            assert!(planned.windows(2).all(|w| w[0] < w[1]));
        }
    }

    /// Every hand-written reference mirrors a strategy that takes the same
    /// locks, under the same budget.
    #[test]
    fn references_mirror_a_locking_strategy() {
        use clap::ValueEnum;
        for &s in Strategy::value_variants() {
            if let Some(m) = s.mirrors() {
                assert!(s.locks() && m.locks() && m.mirrors().is_none(), "{s}");
                assert_eq!(s.schema(), m.schema(), "{s}");
            }
        }
    }

    #[test]
    fn striped_keys_fold_onto_the_stripes() {
        for stripes in [64_u64, 700] {
            let keys: std::collections::HashSet<_> = (0..10_000u128)
                .map(|i| {
                    StripedEvent {
                        business_key: Uuid::from_u128(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                        stripes,
                    }
                    .lock_key()
                })
                .collect();
            assert!(keys.len() as u64 <= stripes, "{} keys", keys.len());
            assert!(keys.len() as u64 > stripes / 2);
        }
    }
}
