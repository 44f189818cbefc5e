//! `--chaos`: faults on a seeded, reproducible schedule during each
//! strategy. Server restarts (fast and immediate shutdown), backends of
//! random workers terminated with `pg_terminate_backend` in the middle of a
//! transaction, and pooled connections dropped and reopened. The workers
//! retry what failed; the exactly-once check at the end says whether any
//! event was lost or doubled.
//!
//! Faults follow the ingest's progress, not the clock. Once the ingest has
//! passed the last fault's point, the workers start no new round until the
//! agent has fired every fault, so a fast strategy cannot finish with
//! faults untested however slow the faults are.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use lockkit_tests::StopMode;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::BoxError;
use crate::db::Database;

/// Terminations per strategy.
const KILLS: usize = 4;
/// Dropped connections per strategy.
const DROPS: usize = 4;
/// How often a termination looks for its worker inside a transaction
/// (every millisecond) before it terminates the backend wherever it is.
const KILL_AIM_POLLS: usize = 500;

/// One fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// `pg_ctl stop -m fast`, then start: every session ends (`57P01`).
    Restart(StopMode),
    /// `pg_terminate_backend` on this worker's backend, aimed at a moment
    /// when it is inside a transaction.
    Kill {
        /// The worker.
        worker: usize,
    },
    /// The pool closes this worker's connection; the worker opens a new one
    /// for its next transaction.
    DropConnection {
        /// The worker.
        worker: usize,
    },
}

/// A fault and when it fires: once the workers have ingested `at_event`
/// events of the strategy's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Progress, in events, at which the fault fires.
    pub at_event: u64,
    /// The fault.
    pub action: Action,
}

/// The schedule of one strategy: one fast and one immediate restart,
/// [`KILLS`] terminations and [`DROPS`] dropped connections of seeded random
/// workers, at seeded random points between 10% and 75% of the stream, in
/// order. The same `seed` gives the same schedule.
pub(crate) fn schedule(seed: u64, events: usize, workers: usize) -> Vec<Step> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x00C4_A05C_4A05);
    let mut actions = vec![
        Action::Restart(StopMode::Fast),
        Action::Restart(StopMode::Immediate),
    ];
    for _ in 0..KILLS {
        actions.push(Action::Kill {
            worker: rng.usize(..workers.max(1)),
        });
    }
    for _ in 0..DROPS {
        actions.push(Action::DropConnection {
            worker: rng.usize(..workers.max(1)),
        });
    }
    rng.shuffle(&mut actions);
    let lo = events as u64 / 10;
    let hi = (events as u64 * 75 / 100).max(lo + 1);
    let mut points: Vec<u64> = actions.iter().map(|_| rng.u64(lo..hi)).collect();
    points.sort_unstable();
    points
        .into_iter()
        .zip(actions)
        .map(|(at_event, action)| Step { at_event, action })
        .collect()
}

/// What the workers share with the chaos agent.
#[derive(Debug)]
pub(crate) struct Targets {
    /// Each worker's current backend pid (0 before its first connection).
    pub pids: Vec<AtomicI32>,
    /// Set by the agent; the worker closes its connection and opens a new
    /// one before its next transaction.
    pub drop_connection: Vec<AtomicBool>,
}

impl Targets {
    pub(crate) fn new(workers: usize) -> Targets {
        Targets {
            pids: (0..workers).map(|_| AtomicI32::new(0)).collect(),
            drop_connection: (0..workers).map(|_| AtomicBool::new(false)).collect(),
        }
    }
}

/// The faults that happened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Survived {
    /// Faults in the schedule.
    pub scheduled: u32,
    /// Restarts with a fast shutdown.
    pub fast_restarts: u32,
    /// Restarts with an immediate shutdown (crash recovery).
    pub immediate_restarts: u32,
    /// Backends terminated inside a transaction.
    pub kills_in_transaction: u32,
    /// Backends terminated between transactions (the worker was never seen
    /// inside one within the aiming window).
    pub kills_idle: u32,
    /// Connections dropped by the "pool".
    pub dropped_connections: u32,
    /// The longest restart, from the stop to accepting connections again,
    /// in milliseconds.
    pub longest_restart_ms: u64,
}

impl Survived {
    /// Faults that fired while the workers were ingesting.
    pub fn fired(&self) -> u32 {
        self.fast_restarts
            + self.immediate_restarts
            + self.kills_in_transaction
            + self.kills_idle
            + self.dropped_connections
    }

    /// Whether every scheduled fault fired during the ingest.
    pub fn all_fired(&self) -> bool {
        self.fired() == self.scheduled
    }
}

/// The value of the progress channel once every worker is done: faults not
/// fired by then are skipped (and the report says so).
pub(crate) const WORKERS_DONE: u64 = u64::MAX;

/// Runs `steps` against the workers as `progress` (events ingested) passes
/// each step's point. Stops when `progress` says [`WORKERS_DONE`]: a fault
/// after the ingest would test nothing.
///
/// # Errors
///
/// When a restart fails, or the agent's own connection cannot be reopened.
///
/// # Cancel safety
///
/// Not cancel safe: a restart in flight completes on its own thread.
pub(crate) async fn run(
    db: &Database,
    steps: &[Step],
    mut progress: watch::Receiver<u64>,
    targets: &Targets,
) -> Result<Survived, BoxError> {
    let mut survived = Survived {
        scheduled: steps.len() as u32,
        ..Survived::default()
    };
    let mut admin = Some(db.connect().await?);
    for step in steps {
        match progress.wait_for(|n| *n >= step.at_event).await {
            Ok(n) if *n != WORKERS_DONE => {}
            _ => break,
        }
        match step.action {
            Action::Restart(mode) => {
                let started = std::time::Instant::now();
                db.restart(mode).await?;
                let ms = started.elapsed().as_millis() as u64;
                survived.longest_restart_ms = survived.longest_restart_ms.max(ms);
                admin = None;
                match mode {
                    StopMode::Fast => survived.fast_restarts += 1,
                    StopMode::Immediate => survived.immediate_restarts += 1,
                }
            }
            Action::DropConnection { worker } => {
                targets.drop_connection[worker].store(true, Ordering::SeqCst);
                survived.dropped_connections += 1;
            }
            Action::Kill { worker } => {
                let client = match admin.take() {
                    Some(c) if !c.is_closed() => c,
                    _ => db.connect().await?,
                };
                if kill(&client, &targets.pids[worker]).await? {
                    survived.kills_in_transaction += 1;
                } else {
                    survived.kills_idle += 1;
                }
                admin = Some(client);
            }
        }
    }
    Ok(survived)
}

/// Terminates the worker's backend, waiting (up to [`KILL_AIM_POLLS`] ms)
/// for a moment when it is inside a transaction; returns whether it was.
/// An `idle` backend is not, even with an `xact_start`: that is a short
/// transaction of its own, to catch up with catalog invalidations.
async fn kill(admin: &Client, pid: &AtomicI32) -> Result<bool, BoxError> {
    for _ in 0..KILL_AIM_POLLS {
        let row = admin
            .query_opt(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE pid = $1 AND xact_start IS NOT NULL AND state <> 'idle'",
                &[&pid.load(Ordering::SeqCst)],
            )
            .await?;
        if let Some(row) = row {
            if row.get::<_, bool>(0) {
                return Ok(true);
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    admin
        .execute(
            "SELECT pg_terminate_backend($1) WHERE $1 <> 0",
            &[&pid.load(Ordering::SeqCst)],
        )
        .await?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_schedule() {
        let a = schedule(7, 10_000, 4);
        assert_eq!(a, schedule(7, 10_000, 4));
        assert_ne!(a, schedule(8, 10_000, 4));
        assert_eq!(a.len(), 2 + KILLS + DROPS);
        assert!(a.windows(2).all(|w| w[0].at_event <= w[1].at_event));
        assert!(a.iter().all(|s| (1_000..7_500).contains(&s.at_event)));
        for mode in [StopMode::Fast, StopMode::Immediate] {
            assert!(a.iter().any(|s| s.action == Action::Restart(mode)));
        }
        assert!(a.iter().all(|s| match s.action {
            Action::Kill { worker } | Action::DropConnection { worker } => worker < 4,
            Action::Restart(_) => true,
        }));
    }
}
