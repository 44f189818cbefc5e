use super::*;
use clap::{Parser, ValueEnum};

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

/// No strategy's statements scan a whole table of the study. Found in the
/// study's default runs: `no-lock` fell to about 2,300 events/s in two runs
/// of four (about 105,000 in the others), its check taking 438 µs per event
/// on the server. The study's tables have no statistics (autovacuum is off,
/// to count dead tuples), and a custom plan for `= ANY` of 64 constant keys
/// then estimates a fifth of the table and scans all of it; a worker whose
/// first plans were cheaper custom than generic kept planning them as the
/// table grew. Here the tables are filled before the workers' first
/// transaction, so each statement's first plans see them large.
#[tokio::test(flavor = "multi_thread")]
async fn no_statement_scans_a_whole_table() {
    const SPREAD: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;
    let options = Options::parse_from(["ingest", "--quiet"]);
    let db = Database::throwaway(&server_settings(&options));
    let admin = db.connect().await.unwrap();
    let locker = Locker::new(&admin, Config::default()).await.unwrap();
    let budgeting = Budgeting::decide(64, locker.policy().budget(), options.budget_mode);
    let scans = "SELECT coalesce(sum(seq_scan), 0)::int8 FROM pg_stat_user_tables \
                 WHERE relname IN ('ingest_events', 'ingest_reservations')";
    let mut scanned = Vec::new();
    for strategy in Strategy::value_variants().iter().copied() {
        admin.batch_execute(&strategy.schema()).await.unwrap();
        let fill = "INSERT INTO ingest_events (business_key, payload) \
                    SELECT gen_random_uuid(), 'x' FROM generate_series(1, 100000)";
        admin.batch_execute(fill).await.unwrap();
        if strategy == Strategy::ForUpdate {
            let fill = "INSERT INTO ingest_reservations \
                        SELECT gen_random_uuid() FROM generate_series(1, 100000)";
            admin.batch_execute(fill).await.unwrap();
        }
        let client = db.connect().await.unwrap();
        let stmts = strategy::Statements::prepare(&client, strategy)
            .await
            .unwrap();
        let mut client = lockkit::LockClient::new(&locker, client);
        // The counters of every earlier scan (the index builds') first.
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .unwrap();
        client.batch_execute("SELECT 1").await.unwrap();
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        let before: i64 = admin.query_one(scans, &[]).await.unwrap().get(0);
        for round in 0..3_u128 {
            // Keys spread over the whole uuid space, none in the fill.
            let keys: Vec<Uuid> = (0..64)
                .map(|i| Uuid::from_u128((round * 64 + i + 1).wrapping_mul(SPREAD)))
                .collect();
            strategy::ingest(&mut client, strategy, budgeting, &stmts, &keys)
                .await
                .unwrap();
        }
        // The backend flushes its counters before it answers its next
        // statement once asked to.
        client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .unwrap();
        client.batch_execute("SELECT 1").await.unwrap();
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        let after: i64 = admin.query_one(scans, &[]).await.unwrap().get(0);
        scanned.push((strategy.name(), after - before));
    }
    assert!(
        scanned.iter().all(|&(_, n)| n == 0),
        "whole-table scans per strategy: {scanned:?}"
    );
}
