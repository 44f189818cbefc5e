//! The ingestion study of the design notes: the same event stream, with
//! duplicates that reach two workers at the same moment, ingested exactly
//! once by N concurrent workers under each strategy, measured in one run.

mod breakdown;
mod budget;
mod chaos;
mod chart;
mod options;
mod progress;
mod reading;
mod report;
mod retry;
mod strategy;
mod workload;

use std::collections::HashMap;
use std::error::Error as StdError;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use lockkit::{Config, Locker};
use progress::Lines;
use tokio::sync::{watch, Barrier};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::db::Database;
use retry::{retrying, Failure};

pub use breakdown::{BackendTimes, Breakdown, StatementTimes, SAMPLE_EVERY};
pub use budget::{expected_stripes, BudgetMode, Budgeting, LockCapacity};
pub use chaos::{Action, Step, Survived};
pub use chart::latency_svg;
pub use options::{database, server_settings, Options, DEFAULT_SVG, SERVER_SETTINGS};
pub use report::{Outcome, Report};
pub use strategy::{Event, Strategy, StripedEvent};
pub use workload::Workload;

/// Any error of the study.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Which probes run around each strategy's ingest.
#[derive(Clone, Copy, Debug)]
struct Probing {
    /// The breakdown's probes run.
    on: bool,
    /// `pg_stat_statements` is usable.
    statements: bool,
}

/// Runs the study against `db`.
///
/// # Errors
///
/// When the options are invalid, or a connection or a setup or measurement
/// query fails, or a `--chaos` restart fails. Errors of the ingest
/// transactions themselves are retried and counted, not returned.
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
    if options.chaos && !db.is_throwaway() {
        return Err(
            "--chaos restarts the server: unset DATABASE_URL to use a throwaway one".into(),
        );
    }
    if options.strategies.contains(&Strategy::AckEarly) && !options.chaos {
        return Err("ack-early is the control of --chaos: with no fault it loses nothing".into());
    }
    if options.strategies.contains(&Strategy::NoLock) && options.duplicate_rate == 0.0 {
        return Err("no-lock is a control of duplicates: use a --duplicate-rate above 0".into());
    }
    let admin = db.connect().await?;
    let capacity = LockCapacity::of(&admin).await?;
    let (config, budget_source) = match options.budget_mode {
        BudgetMode::Fit => (
            Config::default().concurrent_lockers(options.workers),
            format!(
                "fitted by lockkit (Config::concurrent_lockers): half of a lock table of {} = {} × ({} + {}), shared by {} workers",
                capacity.total(),
                capacity.max_locks_per_transaction,
                capacity.max_connections,
                capacity.max_prepared_transactions,
                options.workers
            ),
        ),
        BudgetMode::Split | BudgetMode::Stripe => (
            Config::default(),
            "the server's max_locks_per_transaction".to_owned(),
        ),
    };
    let locker = Locker::new(&admin, config).await?;
    let budget = locker.policy().budget();
    let (probing, breakdown_note) = if options.breakdown() {
        match breakdown::enable_statements(&admin).await {
            Ok(()) => (
                Probing {
                    on: true,
                    statements: true,
                },
                None,
            ),
            Err(e) => (
                Probing {
                    on: true,
                    statements: false,
                },
                Some(format!(
                    "pg_stat_statements is not usable ({e}): no server statement times"
                )),
            ),
        }
    } else {
        (
            Probing {
                on: false,
                statements: false,
            },
            None,
        )
    };
    let budgeting = Budgeting::decide(options.batch, budget, options.budget_mode);
    let row = admin
        .query_one(
            "SELECT current_setting('server_version'), current_setting('fsync'),
                    current_setting('synchronous_commit'), current_setting('full_page_writes')",
            &[],
        )
        .await?;
    let version: String = row.get(0);
    let durability = format!(
        "fsync={}, synchronous_commit={}, full_page_writes={}",
        row.get::<_, String>(1),
        row.get::<_, String>(2),
        row.get::<_, String>(3)
    );
    drop(admin);
    let workload = Arc::new(Workload::generate(
        options.workers,
        options.events,
        options.batch,
        options.duplicate_rate,
        options.seed,
    ));
    let lines = Lines::new(options.quiet);
    if let Some(note) = &breakdown_note {
        lines.say(format_args!("{note}"));
    }
    lines.say(format_args!(
        "PostgreSQL {version} ({durability}); {} strategies, {} events each, {} workers",
        options.strategies.len(),
        workload.events,
        options.workers
    ));
    let mut outcomes = Vec::new();
    for (i, &strategy) in options.strategies.iter().enumerate() {
        lines.say(format_args!(
            "{} ({} of {}): creating its tables, opening {} connections",
            strategy.name(),
            i + 1,
            options.strategies.len(),
            options.workers
        ));
        let steps = if options.chaos {
            chaos::schedule(
                options.seed.wrapping_add(i as u64),
                workload.events,
                options.workers,
            )
        } else {
            Vec::new()
        };
        let outcome = run_strategy(
            strategy, options, db, &locker, budgeting, &workload, &steps, &lines, probing,
        )
        .await?;
        lines.say(format_args!(
            "{}: {:.1} s, {:.0} events/s, {} rows: duplicates {}, missing {}",
            strategy.name(),
            outcome.seconds,
            outcome.events_per_second,
            outcome.rows,
            outcome.duplicates,
            outcome.missing
        ));
        outcomes.push(outcome);
    }
    db.connect()
        .await?
        .batch_execute("DROP TABLE IF EXISTS ingest_events, ingest_reservations")
        .await?;
    Ok(Report {
        server_version: version,
        throwaway_server: db.is_throwaway(),
        durability,
        chaos: options.chaos,
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
        budget_note: budgeting.describe(options.batch, budget, &budget_source),
        breakdown_note,
        outcomes,
    })
}

/// What one worker saw.
#[derive(Debug, Default)]
struct Tally {
    /// Microseconds from a batch's arrival to its last commit, retries
    /// included.
    batch_latencies_us: Vec<u64>,
    /// Microseconds from an event's arrival (its batch's) to the commit of
    /// its transaction, and how many events that commit carried.
    event_latencies_us: Vec<(u64, u32)>,
    transactions: u64,
    deadlocks: u64,
    retried: HashMap<String, u64>,
    lost_events: u64,
    /// Connections opened after the first (after a fault).
    reconnects: u64,
    /// `ack-early`: events acknowledged whose transaction then failed.
    acked_then_failed: u64,
    /// Time spent waiting for the other workers at the start of each round.
    round_wait: Duration,
}

impl Tally {
    fn record(&mut self, failure: &Failure) {
        if failure.is_deadlock() {
            self.deadlocks += 1;
        } else {
            *self.retried.entry(failure.label()).or_default() += 1;
        }
    }

    fn add(&mut self, t: Tally) {
        self.batch_latencies_us.extend(t.batch_latencies_us);
        self.event_latencies_us.extend(t.event_latencies_us);
        self.transactions += t.transactions;
        self.deadlocks += t.deadlocks;
        self.lost_events += t.lost_events;
        self.reconnects += t.reconnects;
        self.acked_then_failed += t.acked_then_failed;
        self.round_wait += t.round_wait;
        for (code, n) in t.retried {
            *self.retried.entry(code).or_default() += n;
        }
    }
}

struct Shared {
    strategy: Strategy,
    budgeting: Budgeting,
    locker: Locker,
    db: Database,
    workload: Arc<Workload>,
    barrier: Barrier,
    progress: ProgressBar,
    /// The progress lines, when stderr is not a terminal.
    lines: Lines,
    /// Events ingested so far, for the progress lines.
    done: std::sync::atomic::AtomicU64,
    /// Events ingested so far: what the chaos schedule follows.
    ingested: watch::Sender<u64>,
    targets: chaos::Targets,
    /// Progress at which every fault of the schedule is due (`u64::MAX`
    /// without chaos): a round that starts there waits for [`Self::faults_done`].
    faults_due_by: u64,
    /// Set when the chaos agent is done, with every fault fired (or failed).
    faults_done: watch::Sender<bool>,
}

/// A worker's connection (lockkit's statements prepared on it lazily) with
/// its prepared statements.
struct Conn {
    client: lockkit::LockClient,
    stmts: strategy::Statements,
}

#[allow(clippy::too_many_arguments)]
async fn run_strategy(
    strategy: Strategy,
    options: &Options,
    db: &Database,
    locker: &Locker,
    budgeting: Budgeting,
    workload: &Arc<Workload>,
    steps: &[Step],
    lines: &Lines,
    probing: Probing,
) -> Result<Outcome, BoxError> {
    // A new admin connection per strategy: the chaos of the last one
    // restarted the server.
    let admin = db.connect().await?;
    admin.batch_execute(&strategy.schema()).await?;
    let (ingested, ingested_rx) = watch::channel(0_u64);
    let (faults_done, _) = watch::channel(steps.is_empty());
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
        db: db.clone(),
        workload: Arc::clone(workload),
        barrier: Barrier::new(options.workers),
        progress: progress.clone(),
        lines: lines.clone(),
        done: Default::default(),
        ingested,
        targets: chaos::Targets::new(options.workers),
        faults_due_by: steps.iter().map(|s| s.at_event).max().unwrap_or(u64::MAX),
        faults_done,
    });
    // Connections are opened and statements prepared outside the measured
    // window.
    let mut slots = Vec::with_capacity(options.workers);
    for id in 0..options.workers {
        slots.push(open(&shared, id).await.map_err(|f| f.to_string())?);
    }
    // Each measurement starts right after a checkpoint (when allowed: it
    // needs pg_checkpoint or superuser), so every strategy pays the same
    // full-page images.
    let checkpointed = admin.batch_execute("CHECKPOINT").await.is_ok();
    let lsn: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    lines.say(format_args!(
        "{}: ingesting {} events with {} workers{}",
        strategy.name(),
        workload.events,
        options.workers,
        if steps.is_empty() {
            String::new()
        } else {
            format!(", {} faults scheduled", steps.len())
        }
    ));
    // The probes only without faults: a restart discards the server's
    // statistics, and reconnected workers have new backends.
    let probe = if probing.on && steps.is_empty() {
        let pids: Arc<[i32]> = shared
            .targets
            .pids
            .iter()
            .map(|pid| pid.load(Ordering::SeqCst))
            .collect();
        Some(breakdown::Probe::start(db, &admin, probing.statements, pids).await?)
    } else {
        None
    };
    let start = Instant::now();
    let handles: Vec<_> = slots
        .into_iter()
        .enumerate()
        .map(|(id, conn)| tokio::spawn(worker(conn, Arc::clone(&shared), id)))
        .collect();
    let workers = async {
        let mut tally = Tally::default();
        for handle in handles {
            tally.add(handle.await?);
        }
        // Faults not fired by now are skipped.
        shared.ingested.send_replace(chaos::WORKERS_DONE);
        Ok::<_, BoxError>((tally, start.elapsed()))
    };
    let agent = async {
        if steps.is_empty() {
            Ok(None)
        } else {
            let survived = chaos::run(db, steps, ingested_rx, &shared.targets).await;
            shared.faults_done.send_replace(true);
            survived.map(Some)
        }
    };
    let (workers, survived) = tokio::join!(workers, agent);
    let (tally, elapsed) = workers?;
    let survived = survived?;
    progress.finish();
    lines.say(format_args!(
        "{}: ingested in {:.1} s; measuring WAL, tuples and sizes",
        strategy.name(),
        elapsed.as_secs_f64()
    ));

    let admin = if admin.is_closed() {
        db.connect().await?
    } else {
        admin
    };
    let events = workload.events as f64;
    // Read before the study's own queries on its tables below, which
    // pg_stat_statements would count as the strategy's.
    let stopped = match probe {
        Some(probe) => Some(probe.stop(&admin, events).await?),
        None => None,
    };
    let wal_bytes: f64 = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&lsn],
        )
        .await?
        .get(0);
    let row = admin
        .query_one(
            "SELECT count(*), count(DISTINCT business_key) FROM ingest_events",
            &[],
        )
        .await?;
    let (rows, distinct_rows): (i64, i64) = (row.get(0), row.get(1));
    // An immediate shutdown discards the statistics: no tuple counts then.
    let tuples = if survived.is_some() {
        None
    } else {
        Some(table_stats(&admin, rows).await?)
    };
    let table_bytes: i64 = admin
        .query_one(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 FROM pg_class c
             WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace
               AND c.relname IN ('ingest_events', 'ingest_reservations')",
            &[],
        )
        .await?
        .get(0);

    let breakdown = match stopped {
        Some(stopped) => Some(
            stopped
                .finish(
                    &admin,
                    events,
                    options.workers as f64 * elapsed.as_secs_f64(),
                    tally.round_wait,
                )
                .await?,
        ),
        None => None,
    };
    let mut batch_latencies = tally.batch_latencies_us;
    batch_latencies.sort_unstable();
    let mut event_latencies = tally.event_latencies_us;
    event_latencies.sort_unstable();
    let mut retried: Vec<(String, u64)> = tally.retried.into_iter().collect();
    retried.sort();
    Ok(Outcome {
        strategy,
        seconds: elapsed.as_secs_f64(),
        events_per_second: events / elapsed.as_secs_f64(),
        batches: batch_latencies.len(),
        transactions: tally.transactions,
        p50_ms: percentile_ms(&batch_latencies, 50.0),
        p95_ms: percentile_ms(&batch_latencies, 95.0),
        p99_ms: percentile_ms(&batch_latencies, 99.0),
        max_ms: batch_latencies.last().map_or(0.0, |us| *us as f64 / 1000.0),
        event_p50_ms: weighted_percentile_ms(&event_latencies, 50.0),
        event_p95_ms: weighted_percentile_ms(&event_latencies, 95.0),
        event_p99_ms: weighted_percentile_ms(&event_latencies, 99.0),
        wal_bytes,
        wal_bytes_per_event: wal_bytes / events,
        checkpointed,
        live_tuples: tuples.map(|t| t.0),
        dead_tuples: tuples.map(|t| t.1),
        table_bytes,
        deadlocks: tally.deadlocks,
        retried,
        lost_events: tally.lost_events,
        reconnects: tally.reconnects,
        acked_then_failed: tally.acked_then_failed,
        survived,
        rows,
        duplicates: rows - distinct_rows,
        missing: workload.distinct as i64 - distinct_rows,
        breakdown,
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

/// Nearest-rank percentile of sorted `(microseconds, count)` pairs, each
/// standing for `count` equal values, in milliseconds.
fn weighted_percentile_ms(sorted_us: &[(u64, u32)], p: f64) -> f64 {
    let total: u64 = sorted_us.iter().map(|&(_, n)| u64::from(n)).sum();
    if total == 0 {
        return 0.0;
    }
    let rank = (((p / 100.0) * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for &(us, n) in sorted_us {
        seen += u64::from(n);
        if seen >= rank {
            return us as f64 / 1000.0;
        }
    }
    unreachable!("rank is at most the total")
}

/// Opens worker `id`'s connection, prepares its statements and publishes its
/// backend pid for the chaos agent.
async fn open(shared: &Shared, id: usize) -> Result<Conn, Failure> {
    let client = shared.db.connect().await.map_err(Failure::Connect)?;
    let failed = |client: &Client, error: lockkit::Error| Failure::Ingest {
        closed: client.is_closed(),
        error,
    };
    let stmts = match strategy::Statements::prepare(&client, shared.strategy).await {
        Ok(stmts) => stmts,
        Err(e) => return Err(failed(&client, e)),
    };
    let pid: i32 = match client.query_one("SELECT pg_backend_pid()", &[]).await {
        Ok(row) => row.get(0),
        Err(e) => return Err(failed(&client, e.into())),
    };
    shared.targets.pids[id].store(pid, Ordering::SeqCst);
    Ok(Conn {
        client: lockkit::LockClient::new(&shared.locker, client),
        stmts,
    })
}

/// Worker `id`'s connection, ready for a transaction: a new one when it was
/// closed by a fault or dropped by the "pool".
async fn ready<'s>(
    shared: &Shared,
    id: usize,
    slot: &'s mut Option<Conn>,
    tally: &Mutex<Tally>,
) -> Result<&'s mut Conn, Failure> {
    if shared.targets.drop_connection[id].swap(false, Ordering::SeqCst) {
        *slot = None;
    }
    if slot.as_ref().is_some_and(|c| c.client.is_closed()) {
        *slot = None;
    }
    match slot {
        Some(conn) => Ok(conn),
        None => {
            let result = open(shared, id).await;
            let mut t = tally.lock().expect("tally lock");
            match result {
                Ok(conn) => {
                    t.reconnects += 1;
                    Ok(slot.insert(conn))
                }
                Err(f) => {
                    t.record(&f);
                    Err(f)
                }
            }
        }
    }
}

/// One worker's part of one transaction, owned, so each attempt of
/// [`retrying`] gets its own copy.
#[derive(Clone)]
struct Job {
    shared: Arc<Shared>,
    id: usize,
    slot: Arc<tokio::sync::Mutex<Option<Conn>>>,
    tally: Arc<Mutex<Tally>>,
    /// The events: `workload.rounds[round][id][events]`.
    round: usize,
    events: Range<usize>,
}

impl Job {
    fn keys(&self) -> &[Uuid] {
        &self.shared.workload.rounds[self.round][self.id][self.events.clone()]
    }

    /// One attempt at ingesting the job's events in one transaction.
    /// Failures are recorded in the tally before they are returned.
    async fn ingest(self) -> Result<(), Failure> {
        let shared = &*self.shared;
        let mut slot = self.slot.lock().await;
        let conn = ready(shared, self.id, &mut slot, &self.tally).await?;
        self.tally.lock().expect("tally lock").transactions += 1;
        let result = strategy::ingest(
            &mut conn.client,
            shared.strategy,
            shared.budgeting,
            &conn.stmts,
            self.keys(),
        )
        .await;
        result.map_err(|error| {
            let failure = Failure::Ingest {
                closed: conn.client.is_closed(),
                error,
            };
            self.tally.lock().expect("tally lock").record(&failure);
            failure
        })
    }

    /// Makes sure the worker has a connection.
    async fn connect(self) -> Result<(), Failure> {
        let mut slot = self.slot.lock().await;
        ready(&self.shared, self.id, &mut slot, &self.tally)
            .await
            .map(|_| ())
    }
}

async fn worker(conn: Conn, shared: Arc<Shared>, id: usize) -> Tally {
    let slot = Arc::new(tokio::sync::Mutex::new(Some(conn)));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut round_starts_at = 0_u64;
    for (round, batches) in shared.workload.rounds.iter().enumerate() {
        let batch = batches[id].len();
        // Once the ingest has passed every fault's point, the rest waits for
        // the chaos agent to have fired them all: a fault that takes long
        // (a restart, a kill aimed at a transaction) must not let a fast
        // strategy finish untested.
        if round_starts_at >= shared.faults_due_by {
            let mut done = shared.faults_done.subscribe();
            let _ = done.wait_for(|done| *done).await;
        }
        round_starts_at += batches.iter().map(|b| b.len() as u64).sum::<u64>();
        // Every worker starts the round together: the two copies of a
        // duplicate arrive at the same moment.
        let waiting = Instant::now();
        shared.barrier.wait().await;
        let arrived = Instant::now();
        tally.lock().expect("tally lock").round_wait += arrived - waiting;
        let chunk = shared.budgeting.chunk(batch);
        for start in (0..batch).step_by(chunk) {
            let job = Job {
                shared: Arc::clone(&shared),
                id,
                slot: Arc::clone(&slot),
                tally: Arc::clone(&tally),
                round,
                events: start..(start + chunk).min(batch),
            };
            let len = job.events.len();
            let committed = if shared.strategy == Strategy::AckEarly {
                ack_early(job).await
            } else {
                retrying(job, Job::ingest).await.is_ok()
            };
            let mut t = tally.lock().expect("tally lock");
            if committed {
                let us = arrived.elapsed().as_micros() as u64;
                t.event_latencies_us.push((us, len as u32));
            } else {
                t.lost_events += len as u64;
            }
        }
        tally
            .lock()
            .expect("tally lock")
            .batch_latencies_us
            .push(arrived.elapsed().as_micros() as u64);
        shared.progress.inc(batch as u64);
        let before = shared.done.fetch_add(batch as u64, Ordering::Relaxed);
        shared.lines.quarter(
            shared.strategy.name(),
            (before, before + batch as u64),
            shared.workload.events as u64,
        );
        shared
            .ingested
            .send_modify(|n| *n = n.saturating_add(batch as u64));
    }
    // Statistics reach pg_stat_user_tables when a backend flushes them (at
    // most once a second, or when it exits); ask for it now.
    if let Some(conn) = slot.lock().await.as_ref() {
        let _ = conn
            .client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
    }
    drop(slot);
    match Arc::try_unwrap(tally) {
        Ok(tally) => tally.into_inner().expect("tally lock"),
        Err(_) => unreachable!("every job of the worker is done"),
    }
}

/// The `ack-early` control: a connection is found (retried, nothing is
/// acknowledged yet), then the events are acknowledged and the transaction
/// runs once. When it fails, the worker has already let the events go:
/// it says it committed them. Only the exactly-once check can tell.
async fn ack_early(job: Job) -> bool {
    if retrying(job.clone(), Job::connect).await.is_err() {
        return false;
    }
    let (tally, len) = (Arc::clone(&job.tally), job.events.len());
    if job.ingest().await.is_err() {
        tally.lock().expect("tally lock").acked_then_failed += len as u64;
    }
    true
}

#[cfg(test)]
mod tests;
