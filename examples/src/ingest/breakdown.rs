//! Where the time goes, per strategy: figures read around each strategy's
//! ingest, so that the report can say why one strategy is slower than
//! another rather than only that it is.
//!
//! - The workers' backends, sampled from `pg_stat_activity` twenty times a
//!   second: running, waiting on a lock (`wait_event_type = 'Lock'`: an
//!   advisory lock, or a concurrent insert of the same unique key), waiting
//!   on something else (WAL, buffers, the client socket), idle inside a
//!   transaction (the client's turn: a round trip), idle between
//!   transactions (the client's turn: its own work, and the study's round
//!   barrier). The shares of the samples, times the workers' wall time,
//!   give microseconds per event that add up to the worker time per event.
//! - The server's execution time and calls per statement kind, from
//!   `pg_stat_statements` when the server has it loaded.
//! - Commits and rollbacks per event, from `pg_stat_database`.
//! - This process's CPU time (user and system) per event, from
//!   `/proc/self/stat`.
//!
//! None of it runs under `--chaos` (a restart discards the server's
//! statistics) or with `--no-breakdown`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use super::BoxError;
use crate::db::Database;

/// How often the workers' backends are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// Where one strategy's time went, per event of the stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Breakdown {
    /// Wall time of all workers together per event, µs: workers × seconds
    /// / events. The backend states below add up to it.
    pub worker_us: f64,
    /// Time the workers waited at the round barrier per event (all workers
    /// together), µs, measured by the workers: part of the backends' idle
    /// time, the study's own shape rather than the strategy's.
    pub round_wait_us: f64,
    /// This process's CPU time (user and system) per event, µs; `None`
    /// where `/proc/self/stat` cannot be read.
    pub client_cpu_us: Option<f64>,
    /// The workers' backends, sampled; `None` when no sample saw one.
    pub backends: Option<BackendTimes>,
    /// The server's statement figures; `None` without `pg_stat_statements`.
    pub statements: Option<StatementTimes>,
    /// Transactions committed per event (`pg_stat_database.xact_commit`,
    /// the sampler's own transactions and the workers' final statistics
    /// flush taken out; the study's other queries, a few per strategy, are
    /// in it).
    pub commits: f64,
    /// Transactions rolled back per event (`xact_rollback`).
    pub rollbacks: f64,
}

/// The workers' backends' time per event, µs, by state (the shares of the
/// samples times [`Breakdown::worker_us`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackendTimes {
    /// Samples taken of a worker's backend.
    pub samples: u64,
    /// Executing a statement, not waiting on anything the server reports
    /// (on a busy machine, that includes waiting for a CPU).
    pub running_us: f64,
    /// Executing a statement, waiting on a heavyweight lock.
    pub lock_wait_us: f64,
    /// Executing a statement, waiting on anything else.
    pub other_wait_us: f64,
    /// Idle inside a transaction: waiting for the client's next statement.
    pub idle_in_transaction_us: f64,
    /// Idle between transactions.
    pub idle_us: f64,
}

/// The server's execution time per event, µs, by statement kind, and the
/// statements run per event, from `pg_stat_statements` (execution only, not
/// planning; lock waits inside a statement count as its execution).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StatementTimes {
    /// Statements run per event, every kind.
    pub calls: f64,
    /// Execution time of every kind.
    pub total_us: f64,
    /// The lock statements (lockkit's or hand-written).
    pub lock_us: f64,
    /// The statements on the study's tables.
    pub data_us: f64,
    /// `BEGIN`, `COMMIT`, `ROLLBACK`, savepoints.
    pub transaction_us: f64,
}

/// What a statement of `pg_stat_statements` is, for the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Lock,
    Data,
    Transaction,
}

/// The kind of a statement text, or `None` for a statement that is not a
/// worker's (the sampler's and the study's own queries).
pub(crate) fn statement_kind(query: &str) -> Option<Kind> {
    let lower = query.to_ascii_lowercase();
    if lower.contains("pg_advisory") {
        return Some(Kind::Lock);
    }
    let first = lower
        .split(|c: char| !c.is_ascii_alphabetic())
        .find(|w| !w.is_empty())
        .unwrap_or("");
    if matches!(
        first,
        "begin" | "start" | "commit" | "end" | "rollback" | "savepoint" | "release"
    ) {
        return Some(Kind::Transaction);
    }
    (lower.contains("ingest_events") || lower.contains("ingest_reservations")).then_some(Kind::Data)
}

/// The state of a backend in one sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Running,
    LockWait,
    OtherWait,
    IdleInTransaction,
    Idle,
}

/// A backend's state from `pg_stat_activity.state` and `wait_event_type`.
/// An active backend waiting for the client socket (`Client`) is counted
/// as an other wait: it is inside a statement.
pub(crate) fn backend_state(state: Option<&str>, wait_event_type: Option<&str>) -> State {
    match (state, wait_event_type) {
        (Some("active"), None) => State::Running,
        (Some("active"), Some("Lock")) => State::LockWait,
        (Some("active"), Some(_)) => State::OtherWait,
        (Some(s), _) if s.starts_with("idle in transaction") => State::IdleInTransaction,
        _ => State::Idle,
    }
}

/// Samples of each [`State`], in its order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts([u64; 5]);

impl Counts {
    pub(crate) fn add(&mut self, state: State) {
        self.0[state as usize] += 1;
    }

    /// The shares of the samples times `worker_us`; `None` without samples.
    pub(crate) fn times(&self, worker_us: f64) -> Option<BackendTimes> {
        let samples: u64 = self.0.iter().sum();
        if samples == 0 {
            return None;
        }
        let us = |state: State| self.0[state as usize] as f64 / samples as f64 * worker_us;
        Some(BackendTimes {
            samples,
            running_us: us(State::Running),
            lock_wait_us: us(State::LockWait),
            other_wait_us: us(State::OtherWait),
            idle_in_transaction_us: us(State::IdleInTransaction),
            idle_us: us(State::Idle),
        })
    }
}

/// The user and system CPU time of this process, from `/proc/self/stat`
/// (Linux); `None` elsewhere.
pub(crate) fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    cpu_of_stat(&stat)
}

/// `utime + stime` of a `/proc/<pid>/stat` line. They are fields 14 and 15,
/// counted in USER_HZ, which Linux fixes at 100 on x86 and ARM. The command
/// name (field 2) is in parentheses and may hold spaces and `)`, so fields
/// are counted after its last `)`.
pub(crate) fn cpu_of_stat(stat: &str) -> Option<Duration> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Loads `pg_stat_statements` into the current database, so the probes can
/// read it. `Err` says why it cannot be used (not installed, or not in
/// `shared_preload_libraries`, or no right to reset it); the study runs on
/// without it.
pub(crate) async fn enable_statements(admin: &Client) -> Result<(), String> {
    admin
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
             SELECT pg_stat_statements_reset();",
        )
        .await
        .map_err(|e| match e.as_db_error() {
            Some(db) => db.message().to_owned(),
            None => e.to_string(),
        })
}

/// The probes of one strategy's ingest, started right before its workers.
pub(crate) struct Probe {
    statements: bool,
    /// Workers whose backends are sampled.
    workers: i64,
    xacts: (i64, i64),
    cpu: Option<Duration>,
    stop: watch::Sender<bool>,
    sampler: JoinHandle<Result<(Counts, i64), BoxError>>,
}

/// Committed and rolled-back transactions of the current database so far.
async fn xacts(admin: &Client) -> Result<(i64, i64), BoxError> {
    let row = admin
        .query_one(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database
             WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

impl Probe {
    /// Resets `pg_stat_statements` (when `statements`), reads the
    /// transaction counters and this process's CPU, and starts sampling the
    /// backends of `pids` on a connection of its own.
    pub(crate) async fn start(
        db: &Database,
        admin: &Client,
        statements: bool,
        pids: Arc<[i32]>,
    ) -> Result<Probe, BoxError> {
        let workers = pids.len() as i64;
        let client = db.connect().await?;
        let sample = client
            .prepare(
                "SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = ANY($1::int4[])",
            )
            .await?;
        if statements {
            admin
                .batch_execute("SELECT pg_stat_statements_reset()")
                .await?;
        }
        let xacts = xacts(admin).await?;
        let (stop, mut stopped) = watch::channel(false);
        let sampler = tokio::spawn(async move {
            let mut counts = Counts::default();
            let mut queries = 0_i64;
            let mut every = tokio::time::interval(SAMPLE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = stopped.wait_for(|s| *s) => break,
                }
                let pids: &[i32] = &pids;
                for row in client.query(&sample, &[&pids]).await? {
                    counts.add(backend_state(row.get(0), row.get(1)));
                }
                queries += 1;
            }
            // Its transactions reach pg_stat_database before the count is
            // read, so that they can be taken out of it.
            client
                .batch_execute("SELECT pg_stat_force_next_flush()")
                .await?;
            Ok((counts, queries + 1))
        });
        Ok(Probe {
            statements,
            workers,
            xacts,
            cpu: process_cpu(),
            stop,
            sampler,
        })
    }

    /// Stops the probes when the workers are done: the sampler, the CPU
    /// clock and the statement figures (before the study's own queries on
    /// its tables), per `events`.
    pub(crate) async fn stop(self, admin: &Client, events: f64) -> Result<Stopped, BoxError> {
        let cpu = self
            .cpu
            .zip(process_cpu())
            .map(|(a, b)| b.saturating_sub(a));
        self.stop.send_replace(true);
        let (counts, sampler_xacts) = self.sampler.await??;
        let statements = if self.statements {
            let mut t = StatementTimes::default();
            let rows = admin
                .query(
                    "SELECT query, calls::int8, total_exec_time::float8 FROM pg_stat_statements
                     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
                    &[],
                )
                .await?;
            for row in rows {
                let Some(kind) = statement_kind(row.get(0)) else {
                    continue;
                };
                let (calls, ms): (i64, f64) = (row.get(1), row.get(2));
                let us = ms * 1000.0 / events;
                t.calls += calls as f64 / events;
                t.total_us += us;
                match kind {
                    Kind::Lock => t.lock_us += us,
                    Kind::Data => t.data_us += us,
                    Kind::Transaction => t.transaction_us += us,
                }
            }
            Some(t)
        } else {
            None
        };
        Ok(Stopped {
            workers: self.workers,
            counts,
            sampler_xacts,
            xacts: self.xacts,
            client_cpu_us: cpu.map(|c| c.as_secs_f64() * 1e6 / events),
            statements,
        })
    }
}

/// What the probes saw; [`Stopped::finish`] adds the transaction counts.
pub(crate) struct Stopped {
    workers: i64,
    counts: Counts,
    sampler_xacts: i64,
    xacts: (i64, i64),
    client_cpu_us: Option<f64>,
    statements: Option<StatementTimes>,
}

impl Stopped {
    /// The breakdown, once the workers' statistics have reached
    /// `pg_stat_database` (they asked for a flush before disconnecting).
    pub(crate) async fn finish(
        self,
        admin: &Client,
        events: f64,
        worker_seconds: f64,
        round_wait: Duration,
    ) -> Result<Breakdown, BoxError> {
        let (commits, rollbacks) = xacts(admin).await?;
        let worker_us = worker_seconds * 1e6 / events;
        Ok(Breakdown {
            worker_us,
            round_wait_us: round_wait.as_secs_f64() * 1e6 / events,
            client_cpu_us: self.client_cpu_us,
            backends: self.counts.times(worker_us),
            statements: self.statements,
            commits: (commits - self.xacts.0 - self.sampler_xacts - self.workers).max(0) as f64
                / events,
            rollbacks: (rollbacks - self.xacts.1).max(0) as f64 / events,
        })
    }
}

impl Breakdown {
    /// The raw figures.
    pub(crate) fn json(&self) -> Value {
        json!({
            "worker_us_per_event": self.worker_us,
            "round_wait_us_per_event": self.round_wait_us,
            "client_cpu_us_per_event": self.client_cpu_us,
            "backends_us_per_event": self.backends.map(|b| json!({
                "samples": b.samples,
                "running": b.running_us,
                "lock_wait": b.lock_wait_us,
                "other_wait": b.other_wait_us,
                "idle_in_transaction": b.idle_in_transaction_us,
                "idle": b.idle_us,
            })),
            "server_us_per_event": self.statements.map(|s| json!({
                "statements_per_event": s.calls,
                "total": s.total_us,
                "lock": s.lock_us,
                "data": s.data_us,
                "transaction": s.transaction_us,
            })),
            "commits_per_event": self.commits,
            "rollbacks_per_event": self.rollbacks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_by_kind() {
        let lockkit = "/* lockkit:batch_bigint_exclusive */ SELECT $1::int8 AS tag, \
             count(pg_advisory_xact_lock(k)) AS n FROM (SELECT unnest($1::int8[]) AS k) AS t";
        assert_eq!(statement_kind(lockkit), Some(Kind::Lock));
        assert_eq!(
            statement_kind(super::super::strategy::HAND_LOCK),
            Some(Kind::Lock)
        );
        for txn in ["BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT lockkit_acquire"] {
            assert_eq!(statement_kind(txn), Some(Kind::Transaction), "{txn}");
        }
        assert_eq!(
            statement_kind("INSERT INTO ingest_events (business_key, payload) SELECT k"),
            Some(Kind::Data)
        );
        assert_eq!(
            statement_kind("SELECT business_key FROM ingest_reservations FOR UPDATE"),
            Some(Kind::Data)
        );
        // The probes' own.
        assert_eq!(
            statement_kind("SELECT state, wait_event_type FROM pg_stat_activity"),
            None
        );
        assert_eq!(statement_kind("SELECT pg_stat_force_next_flush()"), None);
    }

    #[test]
    fn backend_states() {
        assert_eq!(backend_state(Some("active"), None), State::Running);
        assert_eq!(backend_state(Some("active"), Some("Lock")), State::LockWait);
        assert_eq!(
            backend_state(Some("active"), Some("LWLock")),
            State::OtherWait
        );
        assert_eq!(
            backend_state(Some("active"), Some("Client")),
            State::OtherWait
        );
        assert_eq!(
            backend_state(Some("idle in transaction"), Some("Client")),
            State::IdleInTransaction
        );
        assert_eq!(
            backend_state(Some("idle in transaction (aborted)"), Some("Client")),
            State::IdleInTransaction
        );
        assert_eq!(backend_state(Some("idle"), Some("Client")), State::Idle);
    }

    /// The states' times are the shares of the samples of the worker time,
    /// and add up to it.
    #[test]
    fn states_share_the_worker_time() {
        let mut c = Counts::default();
        assert_eq!(c.times(100.0), None);
        for (state, n) in [
            (State::Running, 5),
            (State::LockWait, 2),
            (State::OtherWait, 1),
            (State::IdleInTransaction, 1),
            (State::Idle, 1),
        ] {
            for _ in 0..n {
                c.add(state);
            }
        }
        let t = c.times(200.0).unwrap();
        assert_eq!(t.samples, 10);
        assert_eq!(
            (t.running_us, t.lock_wait_us, t.other_wait_us),
            (100.0, 40.0, 20.0)
        );
        assert_eq!((t.idle_in_transaction_us, t.idle_us), (20.0, 20.0));
    }

    #[test]
    fn cpu_from_proc_stat() {
        // A command name with a space and a parenthesis.
        let stat = "4242 (ingest (x) y) R 1 4242 4242 0 -1 4194304 2311 0 0 0 153 27 0 0 20 0 9 0";
        assert_eq!(cpu_of_stat(stat), Some(Duration::from_millis(1800)));
        assert_eq!(cpu_of_stat("4242 (ingest) R 1"), None);
        assert_eq!(cpu_of_stat("garbage"), None);
        if cfg!(target_os = "linux") {
            assert!(process_cpu().is_some());
        }
    }
}
