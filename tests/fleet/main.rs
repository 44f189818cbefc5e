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
//! - no error of the foreign applications caused by lockkit
//!   ([`checks::harm`]): the pooler never refused them nor went away, and
//!   none of their transactions took longer than
//!   `lockkit_tests::harm::HOSTAGE_BOUND`;
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
mod cutoff;
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
    failures.extend(checks::harm(&report).err());
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

/// Control of [`checks::harm`]: what a real pgbouncer 1.18 sends a client it
/// refuses, and what a refused connection gives, are read as caused by
/// lockkit (`lockkit_tests::harm::caused_by_lockkit`); an application's own
/// errors (a statement name clash, its backend terminated) are not. Each
/// text comes from the pooler itself: its client slots full
/// (`max_client_conn`), no server connection within `query_wait_timeout`,
/// nothing listening once it is gone.
#[tokio::test(flavor = "multi_thread")]
async fn the_harm_classifier_reads_what_pgbouncer_sends() {
    use lockkit_tests::harm::caused_by_lockkit;
    use lockkit_tests::{PgBouncer, TestServer};
    use tokio_postgres::NoTls;

    let db = TestServer::shared();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(1)
        .setting("max_client_conn", "3")
        .setting("query_wait_timeout", "1")
        .start();
    let text = |e: &tokio_postgres::Error| {
        let mut text = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            text.push_str(&format!(": {s}"));
            source = s.source();
        }
        text
    };
    let mut caused = Vec::new();
    let mut own = Vec::new();

    // The application's own: a statement name it used twice on its
    // server connection, and its backend terminated under it.
    let app = bouncer.connect().await;
    let e = app
        .batch_execute("BEGIN; PREPARE fleet_own AS SELECT 1; PREPARE fleet_own AS SELECT 2")
        .await
        .expect_err("a name used twice");
    own.push(text(&e));
    app.batch_execute("ROLLBACK; BEGIN").await.unwrap();
    let pid: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let observer = db.connect().await;
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let e = app
        .simple_query("SELECT 1")
        .await
        .expect_err("its backend was terminated");
    own.push(text(&e));

    // The one server connection pinned by an open transaction: another
    // client waits for it until query_wait_timeout.
    let pin = bouncer.connect().await;
    pin.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = bouncer.connect().await;
    let e = waiter
        .simple_query("SELECT 1")
        .await
        .expect_err("no server connection within query_wait_timeout");
    caused.push(text(&e));

    // Its client slots full (those closed may take a moment to free
    // theirs): a new client is refused.
    let mut clients = Vec::new();
    let refused = loop {
        match bouncer.config().connect(NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                clients.push(client);
                assert!(clients.len() <= 3, "max_client_conn = 3 refused no client");
            }
            Err(e) => break e,
        }
    };
    caused.push(text(&refused));
    drop((pin, clients));

    // The pooler gone: nothing listens.
    let config = bouncer.config();
    drop(bouncer);
    let e = config
        .connect(NoTls)
        .await
        .err()
        .expect("nothing listens once pgbouncer is gone");
    caused.push(text(&e));

    for t in &caused {
        eprintln!("caused by lockkit? {:?} <- {t}", caused_by_lockkit(t));
    }
    for t in &own {
        eprintln!("the application's own? {:?} <- {t}", caused_by_lockkit(t));
    }
    let misread: Vec<&String> = caused
        .iter()
        .filter(|t| caused_by_lockkit(t).is_none())
        .chain(own.iter().filter(|t| caused_by_lockkit(t).is_some()))
        .collect();
    assert!(misread.is_empty(), "misread: {misread:#?}");
}
