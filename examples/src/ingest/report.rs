//! The study's figures: one [`Outcome`] per strategy, the [`Report`] of a
//! run, as a table or as JSON.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::breakdown::Breakdown;
use super::budget::Budgeting;
use super::chaos::Survived;
use super::strategy::Strategy;

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
    /// Median event latency: from an event's arrival (its batch's, all
    /// events of a batch arrive together) to the commit of the transaction
    /// that ingested it, retries included.
    pub event_p50_ms: f64,
    /// 95th percentile event latency.
    pub event_p95_ms: f64,
    /// 99th percentile event latency.
    pub event_p99_ms: f64,
    /// WAL written during the ingest (`pg_current_wal_lsn()` delta, the whole
    /// server's).
    pub wal_bytes: f64,
    /// `wal_bytes` per event of the stream.
    pub wal_bytes_per_event: f64,
    /// Whether a `CHECKPOINT` preceded the measurement.
    pub checkpointed: bool,
    /// `n_live_tup` of the strategy's tables after the run; `None` after
    /// `--chaos` (an immediate shutdown discards the statistics).
    pub live_tuples: Option<i64>,
    /// `n_dead_tup` of the strategy's tables after the run (autovacuum off);
    /// `None` after `--chaos`.
    pub dead_tuples: Option<i64>,
    /// `pg_total_relation_size` of the strategy's tables (indexes included).
    pub table_bytes: i64,
    /// Transactions aborted by a deadlock (`40P01`), then retried.
    pub deadlocks: u64,
    /// Other failed transactions by SQLSTATE (`23505` unique violation, …),
    /// each retried.
    pub retried: Vec<(String, u64)>,
    /// Events given up after too many attempts, or after a failure that is
    /// not retried.
    pub lost_events: u64,
    /// Connections a worker opened again after a fault or a dropped
    /// connection.
    pub reconnects: u64,
    /// `ack-early`: events acknowledged whose transaction then failed (what
    /// the exactly-once check must find missing).
    pub acked_then_failed: u64,
    /// `--chaos`: the faults that happened during this strategy.
    pub survived: Option<Survived>,
    /// Rows in the events table.
    pub rows: i64,
    /// Rows beyond one per business key: must be 0.
    pub duplicates: i64,
    /// Distinct keys of the stream with no row: must be 0.
    pub missing: i64,
    /// Where the time went; `None` with `--no-breakdown` or `--chaos`.
    pub breakdown: Option<Breakdown>,
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

    /// Whether every key has exactly one row and no event was given up.
    pub fn nothing_lost_or_doubled(&self) -> bool {
        self.exactly_once() && self.lost_events == 0
    }

    /// Whether the strategy did what it must: an exactly-once strategy left
    /// one row per key and gave up no event; the `no-lock` control was
    /// caught with duplicates, the `ack-early` control with missing rows.
    /// Under `--chaos`, every scheduled fault also fired during the ingest.
    pub fn as_expected(&self) -> bool {
        (match self.strategy {
            Strategy::NoLock => self.duplicates > 0,
            Strategy::AckEarly => self.missing > 0,
            _ => self.nothing_lost_or_doubled(),
        }) && self.survived.is_none_or(|s| s.all_fired())
    }

    /// Failed attempts that were run again (deadlocks included).
    pub fn retries(&self) -> u64 {
        self.deadlocks + self.errors()
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
            "batch_latency_ms": { "p50": self.p50_ms, "p95": self.p95_ms, "p99": self.p99_ms, "max": self.max_ms },
            "event_latency_ms": { "p50": self.event_p50_ms, "p95": self.event_p95_ms, "p99": self.event_p99_ms },
            "wal_bytes": self.wal_bytes,
            "wal_bytes_per_event": self.wal_bytes_per_event,
            "checkpointed": self.checkpointed,
            "live_tuples": self.live_tuples,
            "dead_tuples": self.dead_tuples,
            "table_bytes": self.table_bytes,
            "deadlocks": self.deadlocks,
            "retried_by_sqlstate": retried,
            "lost_events": self.lost_events,
            "reconnects": self.reconnects,
            "acked_then_failed": self.acked_then_failed,
            "chaos": self.survived.map(|s| json!({
                "scheduled": s.scheduled,
                "fast_restarts": s.fast_restarts,
                "immediate_restarts": s.immediate_restarts,
                "kills_in_transaction": s.kills_in_transaction,
                "kills_idle": s.kills_idle,
                "dropped_connections": s.dropped_connections,
                "longest_restart_ms": s.longest_restart_ms,
            })),
            "as_expected": self.as_expected(),
            "rows": self.rows,
            "duplicates": self.duplicates,
            "missing": self.missing,
            "breakdown": self.breakdown.as_ref().map(Breakdown::json),
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
    /// `fsync`, `synchronous_commit` and `full_page_writes` as the server
    /// reported them.
    pub durability: String,
    /// Whether faults ran during each strategy (`--chaos`).
    pub chaos: bool,
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
    /// Lock budget per transaction of the advisory strategies.
    pub budget: usize,
    /// How the advisory strategy fits its batches into the budget.
    pub budgeting: Budgeting,
    /// The same, in words.
    pub budget_note: String,
    /// Why the breakdown lacks a part (`pg_stat_statements` not usable).
    pub breakdown_note: Option<String>,
    /// One per strategy, in the order run.
    pub outcomes: Vec<Outcome>,
}

impl Report {
    /// The table the study prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "PostgreSQL {} ({}; {}), {} cores; {} workers, batches of {}, {} events per strategy ({} distinct keys, {} duplicates = {:.0}%, seed {}){}",
            self.server_version,
            if self.throwaway_server { "throwaway server on this host" } else { "DATABASE_URL" },
            self.durability,
            self.cores,
            self.workers,
            self.batch,
            self.events,
            self.distinct,
            self.duplicates,
            self.duplicate_rate * 100.0,
            self.seed,
            if self.chaos { "; --chaos: faults during each strategy" } else { "" },
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| strategy       | events/s | event p50 ms | event p95 ms | event p99 ms | batch p99 ms | WAL B/event | dead tuples | size MiB | deadlocks | retries | duplicates | missing |"
        );
        let _ = writeln!(
            out,
            "| -------------- | -------: | -----------: | -----------: | -----------: | -----------: | ----------: | ----------: | -------: | --------: | ------: | ---------: | ------: |"
        );
        for o in &self.outcomes {
            let _ = writeln!(
                out,
                "| {:<14} | {:>8.0} | {:>12.1} | {:>12.1} | {:>12.1} | {:>12.1} | {:>11.0} | {:>11} | {:>8.1} | {:>9} | {:>7} | {:>10} | {:>7} |",
                o.strategy.name(),
                o.events_per_second,
                o.event_p50_ms,
                o.event_p95_ms,
                o.event_p99_ms,
                o.p99_ms,
                o.wal_bytes_per_event,
                o.dead_tuples.map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
                o.table_bytes as f64 / (1024.0 * 1024.0),
                o.deadlocks,
                o.retries(),
                o.duplicates,
                o.missing,
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "Event latency: from an event's arrival (its batch's, at the start of the round) to the commit that ingested it; batch latency: to the batch's last commit."
        );
        if self.outcomes.iter().any(|o| o.strategy.locks()) {
            let _ = writeln!(out, "advisory locks: {}.", self.budget_note);
        }
        for o in &self.outcomes {
            if let Some(s) = o.survived {
                let _ = writeln!(
                    out,
                    "{}: {} of {} scheduled faults fired during the ingest: survived {} fast and {} immediate restarts (the longest took {:.1} s), {} backends terminated inside a transaction and {} between transactions, {} dropped connections; {} reconnects.",
                    o.strategy.name(),
                    s.fired(),
                    s.scheduled,
                    s.fast_restarts,
                    s.immediate_restarts,
                    s.longest_restart_ms as f64 / 1000.0,
                    s.kills_in_transaction,
                    s.kills_idle,
                    s.dropped_connections,
                    o.reconnects,
                );
            }
            if o.survived.is_some_and(|s| !s.all_fired()) {
                let _ = writeln!(
                    out,
                    "{}: NOT every scheduled fault fired before the workers were done: the run is too short to test them all.",
                    o.strategy.name()
                );
            }
            if !o.retried.is_empty() {
                let codes: Vec<String> = o
                    .retried
                    .iter()
                    .map(|(code, n)| format!("{n} × {}", describe_sqlstate(code)))
                    .collect();
                let what = if o.strategy == Strategy::AckEarly {
                    "each rolled back; connecting retried through lockkit::retry, acknowledged transactions not"
                } else {
                    "each rolled back and retried through lockkit::retry"
                };
                let _ = writeln!(
                    out,
                    "{}: failed attempts other than deadlocks, {what}: {}.",
                    o.strategy.name(),
                    codes.join(", ")
                );
            }
            if o.lost_events > 0 {
                let _ = writeln!(
                    out,
                    "{}: {} events given up (too many attempts, or an error that is not retried).",
                    o.strategy.name(),
                    o.lost_events
                );
            }
            match o.strategy {
                Strategy::NoLock => {
                    let _ = writeln!(
                        out,
                        "no-lock (control, the same check-then-insert as lock-only without the locks): {}",
                        if o.duplicates > 0 {
                            format!("the check caught {} duplicate rows, as it must.", o.duplicates)
                        } else {
                            "NO duplicate found: the control did not show that the check can fail.".to_owned()
                        }
                    );
                }
                Strategy::AckEarly => {
                    let _ = writeln!(
                        out,
                        "ack-early (control, lock-only acknowledging before its commit): {} acknowledged events were in transactions that then failed; {}",
                        o.acked_then_failed,
                        if o.missing > 0 {
                            format!("the check caught {} missing keys, as it must.", o.missing)
                        } else {
                            "NO missing key found: the control did not show that the check can fail.".to_owned()
                        }
                    );
                }
                _ => {}
            }
        }
        let failed: Vec<&str> = self
            .outcomes
            .iter()
            .filter(|o| !o.strategy.is_control() && !o.nothing_lost_or_doubled())
            .map(|o| o.strategy.name())
            .collect();
        if failed.is_empty() {
            let _ = writeln!(
                out,
                "exactly once: every strategy other than the controls left one row per key (duplicates 0, missing 0)."
            );
        } else {
            let _ = writeln!(
                out,
                "NOT exactly once: {} (duplicate or missing rows, or events given up).",
                failed.join(", ")
            );
        }
        out.push_str(&self.breakdown_table());
        out
    }

    /// "Where the time goes": one row per strategy with a breakdown, in µs
    /// per event (empty when none has one).
    pub fn breakdown_table(&self) -> String {
        let rows: Vec<(&Outcome, &Breakdown)> = self
            .outcomes
            .iter()
            .filter_map(|o| o.breakdown.as_ref().map(|b| (o, b)))
            .collect();
        let mut out = String::new();
        if rows.is_empty() {
            return out;
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "Where the time goes, µs per event. worker = {} workers × wall time / events, split by what each worker's backend was doing (pg_stat_activity, sampled every {} ms): running, waiting on a lock, waiting on anything else, idle inside a transaction (the client's turn), idle between transactions (the client's turn; round barrier: of that, waiting for the other workers, measured by the workers). server: execution time by statement kind (pg_stat_statements; lock waits inside a statement included). stmts and commits: per event. client CPU: this process, user + system.",
            self.workers,
            super::breakdown::SAMPLE_EVERY.as_millis()
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| strategy       | worker | running | lock wait | other wait | idle in tx | idle | round barrier | server | locks | data | BEGIN/COMMIT | stmts | commits | client CPU |"
        );
        let _ = writeln!(
            out,
            "| -------------- | -----: | ------: | --------: | ---------: | ---------: | ---: | ------------: | -----: | ----: | ---: | -----------: | ----: | ------: | ---------: |"
        );
        let num = |v: Option<f64>, width: usize| match v {
            Some(v) => format!("{v:>width$.1}"),
            None => format!("{:>width$}", "n/a"),
        };
        for (o, b) in rows {
            let states = b.backends;
            let server = b.statements;
            let _ = writeln!(
                out,
                "| {:<14} | {:>6.1} | {} | {} | {} | {} | {} | {:>13.1} | {} | {} | {} | {} | {} | {:>7.3} | {} |",
                o.strategy.name(),
                b.worker_us,
                num(states.map(|s| s.running_us), 7),
                num(states.map(|s| s.lock_wait_us), 9),
                num(states.map(|s| s.other_wait_us), 10),
                num(states.map(|s| s.idle_in_transaction_us), 10),
                num(states.map(|s| s.idle_us), 4),
                b.round_wait_us,
                num(server.map(|s| s.total_us), 6),
                num(server.map(|s| s.lock_us), 5),
                num(server.map(|s| s.data_us), 4),
                num(server.map(|s| s.transaction_us), 12),
                match server {
                    Some(s) => format!("{:>5.3}", s.calls),
                    None => format!("{:>5}", "n/a"),
                },
                b.commits,
                num(b.client_cpu_us, 10),
            );
        }
        if let Some(note) = &self.breakdown_note {
            let _ = writeln!(out, "{note}.");
        }
        let _ = writeln!(out);
        out
    }

    /// The raw figures.
    pub fn json(&self) -> Value {
        json!({
            "server_version": self.server_version,
            "throwaway_server": self.throwaway_server,
            "durability": self.durability,
            "chaos": self.chaos,
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
                Budgeting::Stripe { stripes } => json!({ "mode": "stripe", "stripes": stripes }),
            },
            "budget_note": self.budget_note,
            "breakdown_note": self.breakdown_note,
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
        "57P01" => "admin_shutdown",
        "57P02" => "crash_shutdown",
        "57P03" => "cannot_connect_now",
        _ => return code.to_owned(),
    };
    format!("{code} {name}")
}
