//! The fleet test (issue 44): lockkit on every stack and every form, with
//! default settings, in processes of their own, sharing one real
//! transaction-mode pgbouncer (a pool smaller than the clients) with
//! applications that do not use lockkit, while the runner kills workers
//! with SIGKILL and starts them again, terminates backends, and runs
//! `lockkit inspect` and `lockkit check` through the pooler.
//!
//! The clients are `fleet-worker` processes (`tests/src/bin/fleet_worker.rs`
//! says what each role does). After the run, [`checks`] asks:
//! - no unexpected error on any worker ([`checks::errors`]), a pooled
//!   connection handed out inside a transaction included;
//! - exclusion held ([`checks::exclusion`]): per key, the counter equals
//!   its log rows, and the sampler never saw a key granted exclusive to
//!   two sessions;
//! - nothing left ([`checks::nothing_left`]): no advisory lock in
//!   `pg_locks`, no backend inside a transaction.
//!
//! The run lasts `LOCKKIT_FLEET_SECONDS` (75 by default: the CI form);
//! `.ci/fleet-soak` runs it for 600. Each check has its control, a naive
//! client it must catch: [`control_lost_updates_without_the_lock`],
//! [`control_prepared_statements_behind_the_shared_pooler`],
//! [`control_session_level_locks_left_behind_the_pooler`].

mod checks;
mod fleet;

use std::time::Duration;

use fleet::{Fleet, Role};

/// The run's length unless `LOCKKIT_FLEET_SECONDS` says otherwise: the CI
/// form, which with its start-up and checks stays within 3 minutes on the
/// 2-core machine.
const CI_SECONDS: u64 = 75;

fn run_seconds() -> u64 {
    match std::env::var("LOCKKIT_FLEET_SECONDS") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("LOCKKIT_FLEET_SECONDS={s:?} is not a number of seconds")),
        Err(_) => CI_SECONDS,
    }
}

/// Every stack and form, with the foreign applications, through one
/// transaction-mode pgbouncer of 8 server connections: 14 processes, with
/// some 60 client connections.
const FLEET: &[(Role, usize)] = &[
    (Role::Tp, 2),
    (Role::Sqlx, 2),
    (Role::Diesel, 2),
    (Role::DieselAsync, 1),
    (Role::Session, 1),
    (Role::SessionPool, 1),
    (Role::Mux, 1),
    (Role::Sql, 1),
    (Role::ForeignTp, 2),
    (Role::ForeignSqlx, 1),
];

#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_behind_one_shared_pooler() {
    let seconds = run_seconds();
    let fleet = Fleet::start(8).await;
    let report = fleet
        .run(FLEET, Duration::from_secs(seconds), fleet::Chaos::On)
        .await;
    report.print(&format!("the fleet ({seconds} s)"));
    let mut failures = Vec::new();
    failures.extend(checks::errors(&report).err());
    failures.extend(checks::exclusion(&fleet.observer, &report).await.err());
    failures.extend(
        checks::nothing_left(&fleet.observer, checks::SETTLE)
            .await
            .err(),
    );
    failures.extend(report.failures.iter().cloned());
    assert!(
        failures.is_empty(),
        "the fleet failed:\n- {}",
        failures.join("\n- ")
    );
    assert!(
        report.sum("txs") > 0 && report.sum("probes") > 0,
        "the fleet did no work"
    );
}

/// Control of [`checks::exclusion`]: clients that do the critical
/// section's read-modify-write without a lock lose updates, and the check
/// says so.
#[tokio::test(flavor = "multi_thread")]
async fn control_lost_updates_without_the_lock() {
    let fleet = Fleet::start(6).await;
    let report = fleet
        .run(
            &[(Role::Naive, 2)],
            Duration::from_secs(6),
            fleet::Chaos::Off,
        )
        .await;
    report.print("control: no lock");
    let verdict = checks::exclusion(&fleet.observer, &report).await;
    eprintln!("control: exclusion check says {verdict:?}");
    assert!(
        verdict.is_err(),
        "the exclusion check saw no lost update from clients that take no lock"
    );
}

/// Control of [`checks::errors`]: a `LockClient` in
/// `StatementMode::Prepared` behind the pooler that a foreign application
/// litters with its own named statements fails, and the check says so.
#[tokio::test(flavor = "multi_thread")]
async fn control_prepared_statements_behind_the_shared_pooler() {
    let fleet = Fleet::start(3).await;
    let report = fleet
        .run(
            &[(Role::ForeignTp, 1), (Role::TpPrepared, 1)],
            Duration::from_secs(8),
            fleet::Chaos::Off,
        )
        .await;
    report.print("control: prepared statements");
    let verdict = checks::errors(&report);
    eprintln!("control: error check says {verdict:?}");
    assert!(
        verdict.is_err(),
        "the error check saw no failure of named statements behind the shared pooler"
    );
}

/// Control of [`checks::nothing_left`]: plain `pg_advisory_lock` session
/// locks through the transaction-mode pooler, some never unlocked, stay on
/// the pooler's server connections after the client is gone, and the check
/// says so.
#[tokio::test(flavor = "multi_thread")]
async fn control_session_level_locks_left_behind_the_pooler() {
    let fleet = Fleet::start(3).await;
    let report = fleet
        .run(
            &[(Role::Leaky, 1)],
            Duration::from_secs(3),
            fleet::Chaos::Off,
        )
        .await;
    report.print("control: session-level locks");
    let verdict = checks::nothing_left(&fleet.observer, Duration::from_secs(5)).await;
    eprintln!("control: nothing-left check says {verdict:?}");
    assert!(
        verdict.is_err(),
        "the nothing-left check saw nothing of the session-level locks left behind"
    );
}

/// A defect the fleet found, kept as its test: lockkit-sqlx's `Locker::new`
/// sent its one query (`SERVER_FACTS`) as a sqlx persistent statement,
/// named `sqlx_s_N`, whatever the `StatementMode`. Behind a transaction-mode
/// pgbouncer 1.18 shared with a sqlx application that left its own
/// statements on the server connections, it failed with `42P05` (a name
/// clash) or `26000` (parsed on one server connection, bound on another).
/// It now sends it in the simple query protocol.
#[tokio::test(flavor = "multi_thread")]
async fn sqlx_locker_new_behind_the_shared_pooler() {
    let fleet = Fleet::start(3).await;
    // A sqlx application leaves its statements on every server connection.
    fleet.litter_sqlx(3).await;
    let pool = sqlx::PgPool::connect(&fleet.bouncer_url())
        .await
        .expect("a sqlx pool through the pooler");
    let mut failures = Vec::new();
    for _ in 0..20 {
        if let Err(e) = lockkit_sqlx::Locker::new(&pool, lockkit::Config::default()).await {
            failures.push(format!("{:?} {:?}: {e}", e.kind(), e.code()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 20 Locker::new through the shared pooler failed, first: {}",
        failures.len(),
        failures[0]
    );
}
