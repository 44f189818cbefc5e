//! How many locks the advisory strategies may take per transaction, and how
//! they fit a batch into that budget: split it, stripe its keys, or size the
//! budget from the server's shared lock table so the batch fits.

use tokio_postgres::Client;

/// What to do with batches larger than the lock budget (advisory
/// strategies only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BudgetMode {
    /// The budget is the server's `max_locks_per_transaction` (lockkit's
    /// default); a larger batch is split into transactions of at most the
    /// budget's number of events.
    Split,
    /// The same budget; a larger batch takes striped keys (at most one per
    /// stripe, and as many stripes as the budget allows) in one
    /// transaction.
    Stripe,
    /// The budget is sized by lockkit from the server's shared lock table
    /// and the number of workers (`Config::concurrent_lockers`); a batch
    /// within it is one transaction with one key per event, a larger one is
    /// split.
    Fit,
}

/// The size of the server's shared lock table, in locks:
/// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`,
/// as `lockkit check` prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockCapacity {
    /// `max_locks_per_transaction`.
    pub max_locks_per_transaction: usize,
    /// `max_connections`.
    pub max_connections: usize,
    /// `max_prepared_transactions`.
    pub max_prepared_transactions: usize,
}

impl LockCapacity {
    /// Reads the three settings from the server.
    ///
    /// # Errors
    ///
    /// When the query fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn of(client: &Client) -> Result<LockCapacity, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('max_locks_per_transaction')::int8,
                        current_setting('max_connections')::int8,
                        current_setting('max_prepared_transactions')::int8",
                &[],
            )
            .await?;
        let get = |i: usize| usize::try_from(row.get::<_, i64>(i)).unwrap_or(0);
        Ok(LockCapacity {
            max_locks_per_transaction: get(0),
            max_connections: get(1),
            max_prepared_transactions: get(2),
        })
    }

    /// Locks the shared table holds, all sessions together.
    pub fn total(&self) -> usize {
        self.max_locks_per_transaction
            .saturating_mul(self.max_connections + self.max_prepared_transactions)
    }
}

/// How the advisory strategies fit their batches into the lock budget,
/// decided once per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budgeting {
    /// The batch fits the budget: one transaction, one key per event.
    Fits,
    /// Transactions of at most `chunk` events, one key per event.
    Split {
        /// Events per transaction.
        chunk: usize,
    },
    /// One transaction per batch, on `stripes` striped keys.
    Stripe {
        /// Stripes every event folds onto.
        stripes: u64,
    },
}

impl Budgeting {
    /// Decides for batches of `batch` events under a budget of `budget` keys
    /// per transaction. Striping uses as many stripes as the budget allows,
    /// so a batch can never take more locks than the budget, and two
    /// concurrent batches share as few stripes as the budget permits.
    pub fn decide(batch: usize, budget: usize, mode: BudgetMode) -> Budgeting {
        if batch <= budget {
            Budgeting::Fits
        } else if mode == BudgetMode::Stripe && budget >= 1 {
            Budgeting::Stripe {
                stripes: budget as u64,
            }
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
            Budgeting::Fits | Budgeting::Stripe { .. } => batch.max(1),
        }
    }

    /// A sentence for the report, with the trade-off of striping in figures.
    pub fn describe(self, batch: usize, budget: usize, budget_source: &str) -> String {
        match self {
            Budgeting::Fits => format!(
                "batches of {batch} fit the lock budget of {budget} ({budget_source}): one transaction and one key per event"
            ),
            Budgeting::Split { chunk } => format!(
                "batches of {batch} exceed the lock budget of {budget} ({budget_source}): split into transactions of at most {chunk} events, one key per event (smaller transactions)"
            ),
            Budgeting::Stripe { stripes } => {
                let touched = expected_stripes(batch, stripes);
                let shared = touched * touched / stripes as f64;
                format!(
                    "batches of {batch} exceed the lock budget of {budget} ({budget_source}): one transaction per batch on {stripes} striped keys, the most the budget allows. \
                     Trade-off: a batch locks {touched:.0} stripes on average instead of {batch} keys, but two concurrent batches share about {shared:.0} of them, \
                     so each waits for the other's commit (batches serialize) unless the stripes far exceed batch² ({}); --budget-mode fit keeps one key per event, where batches share only their duplicates",
                    batch * batch
                )
            }
        }
    }
}

/// The expected number of distinct stripes among `batch` random keys folded
/// onto `stripes`.
pub fn expected_stripes(batch: usize, stripes: u64) -> f64 {
    let s = stripes as f64;
    s * (1.0 - (1.0 - 1.0 / s).powf(batch as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

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
            Budgeting::Stripe { stripes: 64 }
        );
        assert_eq!(Budgeting::decide(500, 64, BudgetMode::Split).chunk(500), 64);
        assert_eq!(Budgeting::Stripe { stripes: 64 }.chunk(500), 500);
    }

    #[test]
    fn stripes_touched() {
        // Every stripe of 64 is taken by a batch of 500.
        assert!(expected_stripes(500, 64) > 63.9);
        // Few collisions when the stripes far exceed the batch.
        assert!(expected_stripes(10, 1 << 20) > 9.99);
    }
}
