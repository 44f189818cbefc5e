//! The study's command line ([`Options`]) and the server it runs on
//! ([`database`]).

use std::path::PathBuf;

use crate::db::Database;

use super::{BudgetMode, Strategy};

/// The study's command line.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "ingest",
    about = "Exactly-once ingestion under concurrent duplicates: advisory locks vs ON CONFLICT vs FOR UPDATE",
    long_about = "Ingests one event stream, in which duplicates of a key reach two workers \
                  in the same round, with N concurrent workers under each strategy, and \
                  reports throughput, event and batch latency, WAL, bloat, errors and duplicates \
                  in one table. Uses DATABASE_URL when set, else starts a throwaway PostgreSQL \
                  server. Exits non-zero unless every exactly-once strategy left exactly one row \
                  per key and every control was caught by that check."
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
    /// Strategies to run, in order (`lock-only,no-lock` is the locks-only
    /// study and its control; `ack-early` is the control of `--chaos`).
    #[arg(
        short,
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [Strategy::Advisory, Strategy::HandAdvisory, Strategy::OnConflict, Strategy::ForUpdate, Strategy::LockOnly, Strategy::HandLockOnly, Strategy::NoLock]
    )]
    pub strategies: Vec<Strategy>,
    /// How the advisory strategies handle batches larger than the lock
    /// budget: smaller transactions, striped keys, or a budget sized from the
    /// server's lock table so the batch fits.
    #[arg(long, value_enum, default_value_t = BudgetMode::Split)]
    pub budget_mode: BudgetMode,
    /// Faults during each strategy, on a schedule seeded by --seed: server
    /// restarts (fast and immediate shutdown), terminated worker backends,
    /// dropped connections. Needs the throwaway server; turns
    /// `synchronous_commit` on (an immediate shutdown loses asynchronous
    /// commits).
    #[arg(long)]
    pub chaos: bool,
    /// Durable commits: the throwaway server runs with `fsync=on` and
    /// `synchronous_commit=on` instead of the harness's fast settings.
    #[arg(long)]
    pub durable: bool,
    /// No "where the time goes" breakdown: no `pg_stat_statements`, no
    /// sampling of the workers' backends, so that what the probes cost can
    /// be measured against a run without them. (`--chaos` has no breakdown
    /// either: a restart discards the server's statistics.)
    #[arg(long)]
    pub no_breakdown: bool,
    /// Seed of the event stream.
    #[arg(long, default_value_t = 1405)]
    pub seed: u64,
    /// Print the raw figures as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Where to write the chart of the latency percentiles (SVG).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SVG)]
    pub svg: PathBuf,
    /// Write no chart.
    #[arg(long, conflicts_with = "svg")]
    pub no_svg: bool,
    /// No progress: neither the bar (stderr a terminal) nor the progress
    /// lines (stderr a file or a pipe: CI logs, `| tee`).
    #[arg(short, long)]
    pub quiet: bool,
}

/// Where the chart goes unless `--svg` says otherwise: under the
/// workspace's `target/` when run with `cargo run` from the workspace.
pub const DEFAULT_SVG: &str = "target/ingest/latency.svg";

impl Options {
    /// The chart's path, unless `--no-svg`.
    pub fn chart(&self) -> Option<&std::path::Path> {
        (!self.no_svg).then_some(self.svg.as_path())
    }
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

/// The throwaway server's settings for `options`: [`SERVER_SETTINGS`], plus
/// `fsync` and `synchronous_commit` on with `--durable`, and
/// `synchronous_commit` on with `--chaos` (with it off, an immediate
/// shutdown loses commits the workers were told had succeeded, which is
/// the server's configuration losing data, not the strategy).
pub fn server_settings(options: &Options) -> Vec<(&'static str, &'static str)> {
    let mut settings = SERVER_SETTINGS.to_vec();
    if options.durable {
        settings.push(("fsync", "on"));
    }
    if options.durable || options.chaos {
        settings.push(("synchronous_commit", "on"));
    }
    settings
}

impl Options {
    /// Whether the strategies' time is broken down (see
    /// [`Breakdown`](super::Breakdown)): unless `--no-breakdown` or `--chaos`.
    pub fn breakdown(&self) -> bool {
        !self.no_breakdown && !self.chaos
    }
}

/// The server of the study: `DATABASE_URL` when set, else a throwaway server
/// with [`server_settings`], and with `pg_stat_statements` preloaded when
/// the run has a breakdown. A server that cannot load it (the contrib
/// module not installed) is started again without it, with a note on stderr:
/// the breakdown then goes without the server's statement times.
pub fn database(options: &Options) -> Database {
    let settings = server_settings(options);
    if std::env::var("DATABASE_URL").is_ok_and(|url| !url.is_empty()) || !options.breakdown() {
        return Database::from_env(&settings);
    }
    let mut preloaded = settings.clone();
    preloaded.push(("shared_preload_libraries", "pg_stat_statements"));
    match Database::try_throwaway(&preloaded) {
        Ok(db) => db,
        Err(e) => {
            let first = e.to_string();
            let first = first.lines().next().unwrap_or("");
            eprintln!(
                "ingest: the server cannot preload pg_stat_statements ({first}); starting it without: no server statement times"
            );
            Database::throwaway(&settings)
        }
    }
}
