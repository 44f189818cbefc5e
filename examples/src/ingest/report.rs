//! The study's figures: one [`Outcome`] per strategy, the [`Report`] of a
//! run, as a table or as JSON.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::strategy::{Budgeting, Strategy};

/// The figures of one strategy.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The strategy.
    pub strategy: Strategy,
    /// Wall time of the ingest, from the first round to the last commit.
    pub seconds: f64,
    /// Events of the stream (duplicates included) per second of wall time.
    pub events_per_second: f64,
    /// Batches ingested (each counted once, whatever its retries).
    pub batches: usize,
    /// Transactions run, retries included.
    pub transactions: u64,
    /// Median batch latency: a batch's start to its last commit, retries
    /// included.
    pub p50_ms: f64,
    /// 95th percentile batch latency.
    pub p95_ms: f64,
    /// 99th percentile batch latency.
    pub p99_ms: f64,
    /// Slowest batch.
    pub max_ms: f64,
    /// WAL written during the ingest (`pg_current_wal_lsn()` delta, the whole
    /// server's).
    pub wal_bytes: f64,
    /// `wal_bytes` per event of the stream.
    pub wal_bytes_per_event: f64,
    /// Whether a `CHECKPOINT` preceded the measurement.
    pub checkpointed: bool,
    /// `n_live_tup` of the strategy's tables after the run.
    pub live_tuples: i64,
    /// `n_dead_tup` of the strategy's tables after the run (autovacuum off).
    pub dead_tuples: i64,
    /// `pg_total_relation_size` of the strategy's tables (indexes included).
    pub table_bytes: i64,
    /// Transactions aborted by a deadlock (`40P01`), then retried.
    pub deadlocks: u64,
    /// Other failed transactions by SQLSTATE (`23505` unique violation, …),
    /// each retried.
    pub retried: Vec<(String, u64)>,
    /// Events given up after too many attempts.
    pub lost_events: u64,
    /// Rows in the events table.
    pub rows: i64,
    /// Rows beyond one per business key: must be 0.
    pub duplicates: i64,
    /// Distinct keys of the stream with no row: must be 0.
    pub missing: i64,
}

impl Outcome {
    /// Failed transactions other than deadlocks.
    pub fn errors(&self) -> u64 {
        self.retried.iter().map(|(_, n)| n).sum()
    }

    /// Whether every key has exactly one row.
    pub fn exactly_once(&self) -> bool {
        self.duplicates == 0 && self.missing == 0
    }

    fn json(&self) -> Value {
        let retried: serde_json::Map<String, Value> = self
            .retried
            .iter()
            .map(|(code, n)| (code.clone(), json!(n)))
            .collect();
        json!({
            "strategy": self.strategy.name(),
            "seconds": self.seconds,
            "events_per_second": self.events_per_second,
            "batches": self.batches,
            "transactions": self.transactions,
            "latency_ms": { "p50": self.p50_ms, "p95": self.p95_ms, "p99": self.p99_ms, "max": self.max_ms },
            "wal_bytes": self.wal_bytes,
            "wal_bytes_per_event": self.wal_bytes_per_event,
            "checkpointed": self.checkpointed,
            "live_tuples": self.live_tuples,
            "dead_tuples": self.dead_tuples,
            "table_bytes": self.table_bytes,
            "deadlocks": self.deadlocks,
            "retried_by_sqlstate": retried,
            "lost_events": self.lost_events,
            "rows": self.rows,
            "duplicates": self.duplicates,
            "missing": self.missing,
        })
    }
}

/// The figures of one run of the study.
#[derive(Clone, Debug)]
pub struct Report {
    /// `server_version` of the server.
    pub server_version: String,
    /// Whether the study started its own throwaway server.
    pub throwaway_server: bool,
    /// CPUs available to this process.
    pub cores: usize,
    /// Concurrent workers.
    pub workers: usize,
    /// Events per batch.
    pub batch: usize,
    /// Fraction of the stream that is a second copy.
    pub duplicate_rate: f64,
    /// Seed of the stream.
    pub seed: u64,
    /// Events per strategy, duplicates included.
    pub events: usize,
    /// Distinct business keys.
    pub distinct: usize,
    /// Second copies in the stream.
    pub duplicates: usize,
    /// Lock budget per transaction (the server's `max_locks_per_transaction`).
    pub budget: usize,
    /// How the advisory strategy fits its batches into the budget.
    pub budgeting: Budgeting,
    /// The same, in words.
    pub budget_note: String,
    /// One per strategy, in the order run.
    pub outcomes: Vec<Outcome>,
}

impl Report {
    /// The table the study prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "PostgreSQL {} ({}), {} cores; {} workers, batches of {}, {} events per strategy ({} distinct keys, {} duplicates = {:.0}%, seed {})",
            self.server_version,
            if self.throwaway_server { "throwaway server on this host" } else { "DATABASE_URL" },
            self.cores,
            self.workers,
            self.batch,
            self.events,
            self.distinct,
            self.duplicates,
            self.duplicate_rate * 100.0,
            self.seed,
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| strategy    | events/s | p50 ms | p95 ms | p99 ms | WAL B/event | dead tuples | size MiB | deadlocks | errors | duplicates | missing |"
        );
        let _ = writeln!(
            out,
            "| ----------- | -------: | -----: | -----: | -----: | ----------: | ----------: | -------: | --------: | -----: | ---------: | ------: |"
        );
        for o in &self.outcomes {
            let _ = writeln!(
                out,
                "| {:<11} | {:>8.0} | {:>6.1} | {:>6.1} | {:>6.1} | {:>11.0} | {:>11} | {:>8.1} | {:>9} | {:>6} | {:>10} | {:>7} |",
                o.strategy.name(),
                o.events_per_second,
                o.p50_ms,
                o.p95_ms,
                o.p99_ms,
                o.wal_bytes_per_event,
                o.dead_tuples,
                o.table_bytes as f64 / (1024.0 * 1024.0),
                o.deadlocks,
                o.errors(),
                o.duplicates,
                o.missing,
            );
        }
        let _ = writeln!(out);
        if self
            .outcomes
            .iter()
            .any(|o| o.strategy == Strategy::Advisory)
        {
            let _ = writeln!(out, "advisory: {}.", self.budget_note);
        }
        for o in &self.outcomes {
            if !o.retried.is_empty() {
                let codes: Vec<String> = o
                    .retried
                    .iter()
                    .map(|(code, n)| format!("{n} × {}", describe_sqlstate(code)))
                    .collect();
                let _ = writeln!(
                    out,
                    "{}: errors are failed transactions, each rolled back and retried: {}.",
                    o.strategy.name(),
                    codes.join(", ")
                );
            }
            if o.lost_events > 0 {
                let _ = writeln!(
                    out,
                    "{}: {} events given up after too many attempts.",
                    o.strategy.name(),
                    o.lost_events
                );
            }
        }
        let failed: Vec<&str> = self
            .outcomes
            .iter()
            .filter(|o| !o.exactly_once())
            .map(|o| o.strategy.name())
            .collect();
        if failed.is_empty() {
            let _ = writeln!(out, "exactly once: every strategy left one row per key.");
        } else {
            let _ = writeln!(
                out,
                "NOT exactly once: {} (duplicate or missing rows).",
                failed.join(", ")
            );
        }
        out
    }

    /// The raw figures.
    pub fn json(&self) -> Value {
        json!({
            "server_version": self.server_version,
            "throwaway_server": self.throwaway_server,
            "cores": self.cores,
            "workers": self.workers,
            "batch": self.batch,
            "duplicate_rate": self.duplicate_rate,
            "seed": self.seed,
            "events": self.events,
            "distinct_keys": self.distinct,
            "duplicates_in_stream": self.duplicates,
            "lock_budget": self.budget,
            "budget_handling": match self.budgeting {
                Budgeting::Fits => json!({ "mode": "fits" }),
                Budgeting::Split { chunk } => json!({ "mode": "split", "events_per_transaction": chunk }),
                Budgeting::Stripe => json!({ "mode": "stripe", "stripes": super::STRIPES }),
            },
            "budget_note": self.budget_note,
            "outcomes": self.outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
        })
    }
}

fn describe_sqlstate(code: &str) -> String {
    let name = match code {
        "23505" => "unique_violation",
        "40001" => "serialization_failure",
        "53200" => "out_of_shared_memory",
        "25P02" => "in_failed_sql_transaction",
        _ => return code.to_owned(),
    };
    format!("{code} {name}")
}
