use super::*;
use clap::Parser;

#[test]
fn nearest_rank() {
    let v: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
    assert_eq!(percentile_ms(&v, 50.0), 50.0);
    assert_eq!(percentile_ms(&v, 99.0), 99.0);
    assert_eq!(percentile_ms(&v, 100.0), 100.0);
    assert_eq!(percentile_ms(&[7000], 99.0), 7.0);
    assert_eq!(percentile_ms(&[], 99.0), 0.0);
}

#[test]
fn weighted_nearest_rank() {
    // 90 events at 1 ms, 10 at 5 ms.
    let v = [(1000, 90), (5000, 10)];
    assert_eq!(weighted_percentile_ms(&v, 50.0), 1.0);
    assert_eq!(weighted_percentile_ms(&v, 90.0), 1.0);
    assert_eq!(weighted_percentile_ms(&v, 91.0), 5.0);
    assert_eq!(weighted_percentile_ms(&v, 99.0), 5.0);
    assert_eq!(weighted_percentile_ms(&[], 99.0), 0.0);
}

/// Every fault of a chaos run fires, even when the chaos agent falls
/// behind a fast strategy. Found in CI: `ingest --chaos` failed because
/// `ack-early` finished with 7 of its 10 faults fired. Here the worst
/// case on purpose: all ten faults are due when the last round starts,
/// so the agent (two restarts of about 0.2 s each, kills aimed at a
/// transaction) is far behind workers with one round left, and
/// `ack-early` does not slow down to retry. Without the workers' wait
/// for the agent, it failed in three runs of three (2 of 10 fired).
#[tokio::test(flavor = "multi_thread")]
async fn every_fault_fires_when_the_agent_falls_behind() {
    let options = Options::parse_from([
        "ingest",
        "--quiet",
        "--chaos",
        "--workers",
        "4",
        "--events",
        "4000",
        "--batch",
        "50",
    ]);
    let db = Database::throwaway(&server_settings(&options));
    let admin = db.connect().await.unwrap();
    let locker = Locker::new(&admin, Config::default()).await.unwrap();
    let budgeting = Budgeting::decide(options.batch, locker.policy().budget(), options.budget_mode);
    let workload = Arc::new(Workload::generate(
        options.workers,
        options.events,
        options.batch,
        options.duplicate_rate,
        options.seed,
    ));
    // Every fault due when the last round starts.
    let last_round = (options.workers * options.batch) as u64;
    let mut steps = chaos::schedule(options.seed, workload.events, options.workers);
    for step in &mut steps {
        step.at_event = workload.events as u64 - last_round;
    }
    let outcome = run_strategy(
        Strategy::AckEarly,
        &options,
        &db,
        &locker,
        budgeting,
        &workload,
        &steps,
        &Lines::new(true),
        Probing {
            on: false,
            statements: false,
        },
    )
    .await
    .unwrap();
    let survived = outcome.survived.expect("a chaos run");
    assert!(
        survived.all_fired(),
        "{} of {} faults fired: {survived:?}",
        survived.fired(),
        survived.scheduled
    );
}
