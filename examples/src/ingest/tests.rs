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
/// study's default runs: `no-lock`, then `lock-only`, fell to about 2,300
/// events/s in some runs (about 105,000 in the others), one worker's check
/// taking 438 µs of server time per event while the others waited on its
/// locks. The study's tables have no statistics (autovacuum is off, to
/// count dead tuples), so the planner sizes them by their pages alone: a
/// plan made while a table is small (a generic plan, or the custom plans a
/// session keeps when they looked cheaper) scans it whole, and the session
/// keeps scanning as the table grows. Here each statement is planned on a
/// small table, then run on a large one.
#[tokio::test(flavor = "multi_thread")]
async fn no_statement_scans_a_whole_table() {
    const SPREAD: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;
    // Rows of the small table each statement is planned on, and rows added
    // for the large one it then runs on.
    const SMALL: i64 = 2_000;
    const LARGE: i64 = 100_000;
    // Transactions of 64 new keys on each: past the five custom plans
    // after which a session may switch to the generic plan, then a few.
    const PLANNED: i64 = 8;
    const RUN: i64 = 3;
    let options = Options::parse_from(["ingest", "--quiet"]);
    let db = Database::throwaway(&server_settings(&options));
    let admin = db.connect().await.unwrap();
    let locker = Locker::new(&admin, Config::default()).await.unwrap();
    let budgeting = Budgeting::decide(64, locker.policy().budget(), options.budget_mode);
    let fill = |rows: i64| {
        format!(
            "INSERT INTO ingest_events (business_key, payload) \
             SELECT gen_random_uuid(), 'x' FROM generate_series(1, {rows}); \
             INSERT INTO ingest_reservations \
             SELECT gen_random_uuid() FROM generate_series(1, {rows})"
        )
    };
    let mut scanned = Vec::new();
    for strategy in Strategy::value_variants().iter().copied() {
        admin.batch_execute(&strategy.schema()).await.unwrap();
        if strategy != Strategy::ForUpdate {
            admin
                .batch_execute("CREATE TABLE ingest_reservations (business_key uuid)")
                .await
                .unwrap();
        }
        admin.batch_execute(&fill(SMALL)).await.unwrap();
        let client = db.connect().await.unwrap();
        let stmts = strategy::Statements::prepare(&client, strategy)
            .await
            .unwrap();
        let mut client = lockkit::LockClient::new(&locker, client);
        let mut next = 0_u128;
        let mut keys = || {
            // Keys spread over the whole uuid space, none in the fills.
            next += 64;
            (next..next + 64)
                .map(|i| Uuid::from_u128(i.wrapping_mul(SPREAD)))
                .collect::<Vec<Uuid>>()
        };
        for _ in 0..PLANNED {
            strategy::ingest(&mut client, strategy, budgeting, &stmts, &keys())
                .await
                .unwrap();
        }
        admin.batch_execute(&fill(LARGE)).await.unwrap();
        let before = seq_scans(&admin, &client, SMALL + LARGE + PLANNED * 64).await;
        for _ in 0..RUN {
            strategy::ingest(&mut client, strategy, budgeting, &stmts, &keys())
                .await
                .unwrap();
        }
        let after = seq_scans(&admin, &client, SMALL + LARGE + (PLANNED + RUN) * 64).await;
        scanned.push((strategy.name(), after - before));
    }
    assert!(
        scanned.iter().all(|&(_, n)| n == 0),
        "whole-table scans per strategy: {scanned:?}"
    );
}

/// Whole-table scans of the study's tables so far, once the statistics
/// show `inserted` rows in `ingest_events`: a backend reports a table's
/// counters together, so the scans of a transaction are counted once its
/// inserts are. Until then both sessions (`admin` filled the table) are
/// made to go idle again, which is when a backend reports: at most every
/// half second before PostgreSQL 15, at once after
/// `pg_stat_force_next_flush` from 15.
async fn seq_scans(admin: &Client, worker: &Client, inserted: i64) -> i64 {
    const COUNTS: &str = "SELECT coalesce(sum(seq_scan), 0)::int8, \
        coalesce(sum(n_tup_ins) FILTER (WHERE relname = 'ingest_events'), 0)::int8 \
        FROM pg_stat_user_tables WHERE relname IN ('ingest_events', 'ingest_reservations')";
    let flush = "DO $$ BEGIN \
        IF to_regproc('pg_stat_force_next_flush') IS NOT NULL \
        THEN PERFORM pg_stat_force_next_flush(); END IF; END $$";
    // Bounded so that a lost report fails the test instead of hanging it.
    for _ in 0..600 {
        worker.batch_execute(flush).await.unwrap();
        admin.batch_execute(flush).await.unwrap();
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        let row = admin.query_one(COUNTS, &[]).await.unwrap();
        let (scans, rows): (i64, i64) = (row.get(0), row.get(1));
        if rows >= inserted {
            return scans;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the statistics never showed {inserted} rows inserted into ingest_events");
}
