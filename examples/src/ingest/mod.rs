//! The ingestion study of the design notes: the same event stream, with
//! duplicates that reach two workers at the same moment, ingested exactly
//! once by N concurrent workers under each strategy, measured in one run.

mod chart;
mod report;
mod strategy;
mod workload;

use std::collections::HashMap;
use std::error::Error as StdError;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use lockkit::{Config, Locker};
use tokio::sync::Barrier;
use tokio_postgres::Client;

use crate::db::Database;

pub use chart::latency_svg;
pub use report::{Outcome, Report};
pub use strategy::{BudgetMode, Budgeting, Event, Strategy, StripedEvent, STRIPES};
pub use workload::Workload;

/// Any error of the study.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// How often a transaction that failed with a retryable error (deadlock,
/// unique violation, serialization failure) is tried again before its
/// events are counted as lost.
const MAX_ATTEMPTS: u32 = 100;

/// The study's command line.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "ingest",
    about = "Exactly-once ingestion under concurrent duplicates: advisory locks vs ON CONFLICT vs FOR UPDATE",
    long_about = "Ingests one event stream, in which duplicates of a key reach two workers \
                  in the same round, with N concurrent workers under each strategy, and \
                  reports throughput, batch latency, WAL, bloat, errors and duplicates in one \
                  table. Uses DATABASE_URL when set, else starts a throwaway PostgreSQL server."
)]
pub struct Options {
    /// Concurrent workers, one connection each.
    #[arg(short, long, default_value_t = 8)]
    pub workers: usize,
    /// Events per strategy, duplicates included (rounded up to whole rounds
    /// of workers × batch).
    #[arg(short, long, default_value_t = 1_000_000)]
    pub events: usize,
    /// Events per batch (one batch per worker per round).
    #[arg(short, long, default_value_t = 500)]
    pub batch: usize,
    /// Fraction of events that are a second copy of a key another worker
    /// receives in the same round (0 to 0.5).
    #[arg(short, long, default_value_t = 0.1)]
    pub duplicate_rate: f64,
    /// Strategies to run, in order.
    #[arg(
        short,
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [Strategy::Advisory, Strategy::OnConflict, Strategy::ForUpdate]
    )]
    pub strategies: Vec<Strategy>,
    /// How the advisory strategy handles batches larger than the lock
    /// budget: smaller transactions, or striped keys.
    #[arg(long, value_enum, default_value_t = BudgetMode::Split)]
    pub budget_mode: BudgetMode,
    /// Seed of the event stream.
    #[arg(long, default_value_t = 1405)]
    pub seed: u64,
    /// Print the raw figures as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write a chart of the latency percentiles (SVG) to this file.
    #[arg(long, value_name = "PATH")]
    pub svg: Option<PathBuf>,
    /// No progress bar.
    #[arg(short, long)]
    pub quiet: bool,
}

/// Settings of the throwaway server on top of the harness's (which has
/// `fsync` and `synchronous_commit` off): full-page writes on, so the WAL
/// figures count what a production server writes after the checkpoint that
/// starts each measurement, and no checkpoint inside a measurement.
pub const SERVER_SETTINGS: &[(&str, &str)] = &[
    ("full_page_writes", "on"),
    ("max_wal_size", "8GB"),
    ("checkpoint_timeout", "1h"),
    ("autovacuum", "off"),
];

/// Runs the study against `db`.
///
/// # Errors
///
/// When the options are invalid, or a connection or a setup or measurement
/// query fails. Errors of the ingest transactions themselves are retried and
/// counted, not returned.
///
/// # Cancel safety
///
/// Not cancel safe: the study's tables are left behind.
pub async fn run(options: &Options, db: &Database) -> Result<Report, BoxError> {
    if options.workers == 0 || options.batch == 0 {
        return Err("--workers and --batch must be at least 1".into());
    }
    if !(0.0..=0.5).contains(&options.duplicate_rate) {
        return Err("--duplicate-rate must be between 0 and 0.5".into());
    }
    if options.workers < 2 && options.duplicate_rate > 0.0 {
        return Err("duplicates reach two different workers: use --workers 2 or more".into());
    }
    let admin = db.connect().await?;
    let locker = Locker::new(&admin, Config::default()).await?;
    let budget = locker.budget();
    let budgeting = Budgeting::decide(options.batch, budget, options.budget_mode);
    let version: String = admin
        .query_one("SELECT current_setting('server_version')", &[])
        .await?
        .get(0);
    let workload = Arc::new(Workload::generate(
        options.workers,
        options.events,
        options.batch,
        options.duplicate_rate,
        options.seed,
    ));
    let mut outcomes = Vec::new();
    for &strategy in &options.strategies {
        let outcome =
            run_strategy(strategy, options, db, &admin, &locker, budgeting, &workload).await?;
        outcomes.push(outcome);
    }
    admin
        .batch_execute("DROP TABLE IF EXISTS ingest_events, ingest_reservations")
        .await?;
    Ok(Report {
        server_version: version,
        throwaway_server: db.is_throwaway(),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        workers: options.workers,
        batch: options.batch,
        duplicate_rate: options.duplicate_rate,
        seed: options.seed,
        events: workload.events,
        distinct: workload.distinct,
        duplicates: workload.duplicates,
        budget,
        budgeting,
        budget_note: budgeting.describe(options.batch, budget),
        outcomes,
    })
}

/// What one worker saw.
#[derive(Debug, Default)]
struct Tally {
    /// Microseconds from a batch's start to its last commit, retries
    /// included.
    latencies_us: Vec<u64>,
    transactions: u64,
    deadlocks: u64,
    retried: HashMap<String, u64>,
    lost_events: u64,
}

struct Shared {
    strategy: Strategy,
    budgeting: Budgeting,
    locker: Locker,
    workload: Arc<Workload>,
    barrier: Barrier,
    progress: ProgressBar,
}

async fn run_strategy(
    strategy: Strategy,
    options: &Options,
    db: &Database,
    admin: &Client,
    locker: &Locker,
    budgeting: Budgeting,
    workload: &Arc<Workload>,
) -> Result<Outcome, BoxError> {
    admin.batch_execute(&strategy.schema()).await?;
    let mut clients = Vec::with_capacity(options.workers);
    for _ in 0..options.workers {
        let client = db.connect().await?;
        let stmts = strategy::Statements::prepare(&client, strategy, locker).await?;
        clients.push((client, stmts));
    }
    // Each measurement starts right after a checkpoint (when allowed: it
    // needs pg_checkpoint or superuser), so every strategy pays the same
    // full-page images.
    let checkpointed = admin.batch_execute("CHECKPOINT").await.is_ok();
    let progress = if options.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(workload.events as u64)
    };
    progress.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:32}] {human_pos}/{human_len} events {per_sec:>14} {elapsed}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    progress.set_prefix(strategy.name());
    let shared = Arc::new(Shared {
        strategy,
        budgeting,
        locker: locker.clone(),
        workload: Arc::clone(workload),
        barrier: Barrier::new(options.workers),
        progress: progress.clone(),
    });
    let lsn: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let start = Instant::now();
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(id, (client, stmts))| tokio::spawn(worker(client, stmts, Arc::clone(&shared), id)))
        .collect();
    let mut tally = Tally::default();
    for handle in handles {
        let t = handle.await?;
        tally.latencies_us.extend(t.latencies_us);
        tally.transactions += t.transactions;
        tally.deadlocks += t.deadlocks;
        tally.lost_events += t.lost_events;
        for (code, n) in t.retried {
            *tally.retried.entry(code).or_default() += n;
        }
    }
    let elapsed = start.elapsed();
    let wal_bytes: f64 = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&lsn],
        )
        .await?
        .get(0);
    progress.finish();

    let row = admin
        .query_one(
            "SELECT count(*), count(DISTINCT business_key) FROM ingest_events",
            &[],
        )
        .await?;
    let (rows, distinct_rows): (i64, i64) = (row.get(0), row.get(1));
    let (live, dead) = table_stats(admin, rows).await?;
    let table_bytes: i64 = admin
        .query_one(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 FROM pg_class c
             WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace
               AND c.relname IN ('ingest_events', 'ingest_reservations')",
            &[],
        )
        .await?
        .get(0);

    let mut latencies = tally.latencies_us;
    latencies.sort_unstable();
    let events = workload.events as f64;
    let mut retried: Vec<(String, u64)> = tally.retried.into_iter().collect();
    retried.sort();
    Ok(Outcome {
        strategy,
        seconds: elapsed.as_secs_f64(),
        events_per_second: events / elapsed.as_secs_f64(),
        batches: latencies.len(),
        transactions: tally.transactions,
        p50_ms: percentile_ms(&latencies, 50.0),
        p95_ms: percentile_ms(&latencies, 95.0),
        p99_ms: percentile_ms(&latencies, 99.0),
        max_ms: latencies.last().map_or(0.0, |us| *us as f64 / 1000.0),
        wal_bytes,
        wal_bytes_per_event: wal_bytes / events,
        checkpointed,
        live_tuples: live,
        dead_tuples: dead,
        table_bytes,
        deadlocks: tally.deadlocks,
        retried,
        lost_events: tally.lost_events,
        rows,
        duplicates: rows - distinct_rows,
        missing: workload.distinct as i64 - distinct_rows,
    })
}

/// Live and dead tuples of the study's tables from `pg_stat_user_tables`,
/// once the workers' statistics have reached it: they asked for a flush
/// (`pg_stat_force_next_flush`, PostgreSQL 15) and disconnected, and this
/// waits (up to 10 s) until the live count of the events table matches its
/// `count(*)` twice in a row.
async fn table_stats(admin: &Client, rows: i64) -> Result<(i64, i64), BoxError> {
    let mut last = None;
    for _ in 0..100 {
        let row = admin
            .query_one(
                "SELECT coalesce(sum(n_live_tup), 0)::int8, coalesce(sum(n_dead_tup), 0)::int8,
                        coalesce(sum(n_live_tup) FILTER (WHERE relname = 'ingest_events'), 0)::int8
                 FROM pg_stat_user_tables
                 WHERE schemaname = current_schema()
                   AND relname IN ('ingest_events', 'ingest_reservations')",
                &[],
            )
            .await?;
        let now: (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if now.2 == rows && last == Some(now) {
            return Ok((now.0, now.1));
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (live, dead, _) = last.unwrap_or_default();
    Ok((live, dead))
}

/// Nearest-rank percentile of sorted microseconds, in milliseconds.
fn percentile_ms(sorted_us: &[u64], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted_us.len() as f64).ceil() as usize;
    sorted_us[rank.clamp(1, sorted_us.len()) - 1] as f64 / 1000.0
}

async fn worker(
    mut client: Client,
    stmts: strategy::Statements,
    shared: Arc<Shared>,
    id: usize,
) -> Tally {
    let mut tally = Tally::default();
    for round in &shared.workload.rounds {
        let batch = &round[id];
        // Every worker starts the round together: the two copies of a
        // duplicate arrive at the same moment.
        shared.barrier.wait().await;
        let start = Instant::now();
        for chunk in batch.chunks(shared.budgeting.chunk(batch.len())) {
            let mut attempts = 0;
            loop {
                attempts += 1;
                tally.transactions += 1;
                let result = strategy::ingest(
                    &mut client,
                    shared.strategy,
                    shared.budgeting,
                    &shared.locker,
                    &stmts,
                    chunk,
                )
                .await;
                match result {
                    Ok(()) => break,
                    Err(e) => {
                        if e.is_deadlock() {
                            tally.deadlocks += 1;
                        } else {
                            let code = e.code().unwrap_or("none").to_owned();
                            *tally.retried.entry(code).or_default() += 1;
                        }
                        if attempts >= MAX_ATTEMPTS || e.is_connection_lost() {
                            tally.lost_events += chunk.len() as u64;
                            break;
                        }
                    }
                }
            }
        }
        tally.latencies_us.push(start.elapsed().as_micros() as u64);
        shared.progress.inc(batch.len() as u64);
    }
    // Statistics reach pg_stat_user_tables when a backend flushes them (at
    // most once a second, or when it exits); ask for it now.
    let _ = client
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await;
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        assert_eq!(percentile_ms(&v, 50.0), 50.0);
        assert_eq!(percentile_ms(&v, 99.0), 99.0);
        assert_eq!(percentile_ms(&v, 100.0), 100.0);
        assert_eq!(percentile_ms(&[7000], 99.0), 7.0);
        assert_eq!(percentile_ms(&[], 99.0), 0.0);
    }
}
