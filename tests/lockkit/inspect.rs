//! `lockkit::inspect` on the real server: holders, waiters, blockers, modes,
//! decoded types, hidden queries, and tag collisions of derived types.

use std::time::{Duration, Instant};

use lockkit::inspect::{advisory_locks, AdvisoryLockRow, KeyRegistry, Marker};
use lockkit::{AdvisoryKey, Config, LockKey, Mode};
use lockkit_tests::TestServer;
use tokio_postgres::{Client, NoTls};

use crate::common::locker;

#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/inspect")]
struct Invoice {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/inspect-pair", pair)]
struct Seat {
    id: i64,
}

/// Another type that (wrongly) reuses `Invoice`'s namespace.
#[derive(AdvisoryKey, Clone, Copy, Debug)]
#[advisory_key(namespace = "lockkit-tests/inspect")]
struct InvoiceCopy {
    id: i64,
}

async fn connect(db: &TestServer, user: Option<&str>, app: &str) -> Client {
    let mut config = db.config();
    config.application_name(app);
    if let Some(user) = user {
        config.user(user);
    }
    let (client, connection) = config.connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

async fn pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

fn rows_of(rows: &[AdvisoryLockRow], pid: i32, key: LockKey) -> Vec<&AdvisoryLockRow> {
    rows.iter()
        .filter(|r| r.pid == Some(pid) && r.key == key)
        .collect()
}

/// Takes a session lock with an unnamed statement, so that the holder's
/// backend has nothing left to process once the reply is in.
/// `execute(&str)` would not do: tokio-postgres prepares a named statement
/// for it and, when that is dropped after the reply, sends its Close with a
/// Sync. A Sync processed after an inspection began is a state change of the
/// holder, so that inspection rightly says `Unknown`
/// (`a_message_after_the_read_leaves_the_scope_unknown`).
async fn lock_idle(client: &Client, key: i64) {
    client
        .query_typed(
            "SELECT pg_advisory_lock($1)",
            &[(&key, tokio_postgres::types::Type::INT8)],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn lists_holders_waiters_and_blockers() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut holder = connect(db, None, "inspect-holder").await;
    let waiter = connect(db, None, "inspect-waiter").await;
    let sharer = connect(db, None, "inspect-sharer").await;
    let observer = db.connect().await;
    let registry = KeyRegistry::new().register::<Invoice>().register::<Seat>();
    assert!(registry.collisions().is_empty());
    let locker = locker(&holder, Config::default()).await;
    let (holder_pid, waiter_pid, sharer_pid) =
        (pid(&holder).await, pid(&waiter).await, pid(&sharer).await);

    let invoice = Invoice { id: 1 }.lock_key();
    let seat = Seat { id: 1 }.lock_key();
    let tx = locker.begin(&mut holder).await.unwrap();
    let held = tx.lock(Invoice { id: 1 }).await.unwrap();
    let LockKey::Pair(class, object) = seat else {
        unreachable!()
    };
    sharer
        .execute("SELECT pg_advisory_lock_shared($1, $2)", &[&class, &object])
        .await
        .unwrap();
    // An unregistered key, held too.
    sharer
        .execute("SELECT pg_advisory_lock(4242)", &[])
        .await
        .unwrap();
    let LockKey::BigInt(raw) = invoice else {
        unreachable!()
    };
    let waiting = tokio::spawn(async move {
        waiter
            .execute("SELECT pg_advisory_lock($1)", &[&raw])
            .await
            .unwrap();
        waiter
    });

    let deadline = Instant::now() + Duration::from_secs(30);
    let rows = loop {
        let rows = advisory_locks(&observer, &registry).await.unwrap();
        if !rows_of(&rows, waiter_pid, invoice).is_empty() {
            break rows;
        }
        assert!(Instant::now() < deadline, "the waiter never showed up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    let h = rows_of(&rows, holder_pid, invoice);
    assert_eq!(h.len(), 1);
    assert!(h[0].granted);
    assert_eq!(h[0].mode, Mode::Exclusive);
    assert_eq!(h[0].application_name.as_deref(), Some("inspect-holder"));
    assert_eq!(h[0].types.len(), 1);
    assert_eq!(h[0].types[0].namespace(), "lockkit-tests/inspect");
    assert!(h[0].blocked_by.is_empty());
    assert_eq!(h[0].state.as_deref(), Some("idle in transaction"));

    let w = rows_of(&rows, waiter_pid, invoice);
    assert_eq!(w.len(), 1);
    assert!(!w[0].granted);
    assert_eq!(w[0].blocked_by, [holder_pid]);
    assert!(w[0].waited.is_some(), "PostgreSQL 14+ reports waitstart");
    assert!(w[0].query.as_deref().unwrap().contains("pg_advisory_lock"));
    assert!(!w[0].query_hidden);
    assert_eq!(w[0].types[0].namespace(), "lockkit-tests/inspect");

    let s = rows_of(&rows, sharer_pid, seat);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].mode, Mode::Shared);
    assert_eq!(s[0].types[0].namespace(), "lockkit-tests/inspect-pair");
    let unknown = rows_of(&rows, sharer_pid, LockKey::BigInt(4242));
    assert_eq!(unknown.len(), 1);
    assert!(unknown[0].types.is_empty());

    drop(held);
    tx.rollback().await.unwrap();
    let waiter = waiting.await.unwrap();
    waiter
        .execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
    sharer
        .execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();
    let rows = advisory_locks(&observer, &registry).await.unwrap();
    assert!(rows_of(&rows, holder_pid, invoice).is_empty());
    assert!(rows_of(&rows, waiter_pid, invoice).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn hides_queries_the_role_may_not_see() {
    let db = TestServer::shared();
    let _log = db.guard();
    let admin = connect(db, None, "inspect-admin").await;
    admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE lockkit_inspect_viewer LOGIN; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        )
        .await
        .unwrap();
    let viewer = connect(db, Some("lockkit_inspect_viewer"), "inspect-viewer").await;
    let admin_pid = pid(&admin).await;
    let key = Invoice { id: 2 }.lock_key();
    let LockKey::BigInt(raw) = key else {
        unreachable!()
    };
    admin
        .execute("SELECT pg_advisory_lock($1)", &[&raw])
        .await
        .unwrap();
    let registry = KeyRegistry::new().register::<Invoice>();

    let seen = advisory_locks(&viewer, &registry).await.unwrap();
    let row = rows_of(&seen, admin_pid, key);
    assert_eq!(row.len(), 1, "pg_locks is visible to every role");
    assert!(row[0].query_hidden);
    assert_eq!(row[0].query, None);
    // Control: the superuser sees the same row's query.
    let seen = advisory_locks(&admin, &registry).await.unwrap();
    let row = rows_of(&seen, admin_pid, key);
    assert!(!row[0].query_hidden);
    assert!(row[0].query.is_some());
    admin
        .execute("SELECT pg_advisory_unlock($1)", &[&raw])
        .await
        .unwrap();
}

#[test]
fn reports_colliding_derived_types() {
    let registry = KeyRegistry::new()
        .register::<Invoice>()
        .register::<InvoiceCopy>()
        .register::<Seat>();
    let collisions = registry.collisions();
    assert_eq!(collisions.len(), 1);
    assert_eq!(collisions[0].marker, Marker::Tag(Invoice::KEY_SPEC.tag()));
    let names: Vec<&str> = collisions[0].types.iter().map(|t| t.name()).collect();
    assert!(
        names[0].ends_with("Invoice") && names[1].ends_with("InvoiceCopy"),
        "{names:?}"
    );
    assert_eq!(registry.decode(Invoice { id: 3 }.lock_key()).len(), 2);
    // Control: without the copy there is none.
    assert!(KeyRegistry::new()
        .register::<Invoice>()
        .register::<Seat>()
        .collisions()
        .is_empty());
}

/// The statement behind `Scope::Session`, step by step: a holder idle since
/// before `pg_locks` was read is a session-lock holder; one that ran a
/// transaction since, or sits in one, is not. Inside an explicit
/// transaction the inspector's `pg_stat_activity` snapshot is stale; the
/// control shows that without `CLEAR_ACTIVITY_SNAPSHOT` the stale view
/// would wrongly name the busy holder.
#[tokio::test(flavor = "multi_thread")]
async fn session_holders_are_idle_since_the_read() {
    use lockkit::inspect::{CLEAR_ACTIVITY_SNAPSHOT, SESSION_HOLDERS};
    use tokio_postgres::types::Type;

    let db = TestServer::shared();
    let _log = db.guard();
    let idle = connect(db, None, "scope-idle").await;
    let busy = connect(db, None, "scope-busy").await;
    let in_tx = connect(db, None, "scope-in-tx").await;
    let inspector = connect(db, None, "scope-inspector").await;
    let (idle_pid, busy_pid, in_tx_pid) = (pid(&idle).await, pid(&busy).await, pid(&in_tx).await);
    let key = Invoice { id: 9001 }.lock_key();
    let LockKey::BigInt(k) = key else {
        unreachable!()
    };
    lock_idle(&idle, k).await;
    in_tx.batch_execute("BEGIN; SELECT 1").await.unwrap();

    // The inspector's transaction takes its activity snapshot now, with
    // `busy` idle, then notes the moment "pg_locks was read".
    inspector
        .batch_execute("BEGIN; SELECT count(*) FROM pg_stat_activity")
        .await
        .unwrap();
    let read_at: String = inspector
        .query_one("SELECT statement_timestamp()::text", &[])
        .await
        .unwrap()
        .get(0);
    // After the read, `busy` runs a transaction (with a transaction lock)
    // and goes idle again.
    busy.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(9002); COMMIT")
        .await
        .unwrap();
    let holders =
        |rows: Vec<tokio_postgres::Row>| -> Vec<i32> { rows.iter().map(|r| r.get(0)).collect() };

    // The control: the stale snapshot still shows `busy` idle since before.
    let stale = holders(
        inspector
            .query_typed(SESSION_HOLDERS, &[(&read_at, Type::TEXT)])
            .await
            .unwrap(),
    );
    assert!(
        stale.contains(&busy_pid),
        "the stale view names {busy_pid}: {stale:?}"
    );

    inspector
        .query_typed(CLEAR_ACTIVITY_SNAPSHOT, &[])
        .await
        .unwrap();
    let fresh = holders(
        inspector
            .query_typed(SESSION_HOLDERS, &[(&read_at, Type::TEXT)])
            .await
            .unwrap(),
    );
    assert!(fresh.contains(&idle_pid), "{fresh:?}");
    assert!(!fresh.contains(&busy_pid), "{fresh:?}");
    assert!(!fresh.contains(&in_tx_pid), "{fresh:?}");
    inspector.batch_execute("COMMIT").await.unwrap();
    in_tx.batch_execute("COMMIT").await.unwrap();
    idle.execute("SELECT pg_advisory_unlock($1)", &[&k])
        .await
        .unwrap();
}

/// A protocol message the holder's backend processes after the read, even
/// one that runs no transaction (a driver closing a prepared statement, with
/// its Sync), moves its `state_change` past the read: the holder is then not
/// named, and the inspection says `Unknown` rather than guess. The next
/// inspection, read after the message, says `Session` again.
///
/// Found as a flake of `transaction_locks_are_never_reported_as_session_locks`
/// (its first inspection said `Unknown`): the lock was taken with
/// `execute(&str)`, whose named statement tokio-postgres closes after the
/// reply. Step by step here, so the order is certain; the control is the
/// same read before the message, which names the holder.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_after_the_read_leaves_the_scope_unknown() {
    use lockkit::inspect::{Scope, CLEAR_ACTIVITY_SNAPSHOT, SESSION_HOLDERS};
    use tokio_postgres::types::Type;

    let db = TestServer::shared();
    let _log = db.guard();
    let idle = connect(db, None, "scope-message").await;
    let inspector = connect(db, None, "scope-message-inspector").await;
    let idle_pid = pid(&idle).await;
    let key = Invoice { id: 9401 }.lock_key();
    let LockKey::BigInt(k) = key else {
        unreachable!()
    };
    lock_idle(&idle, k).await;
    let statement = idle.prepare("SELECT 1").await.unwrap();
    let read_at: String = inspector
        .query_one("SELECT statement_timestamp()::text", &[])
        .await
        .unwrap()
        .get(0);
    let holders = || async {
        inspector
            .query_typed(CLEAR_ACTIVITY_SNAPSHOT, &[])
            .await
            .unwrap();
        inspector
            .query_typed(SESSION_HOLDERS, &[(&read_at, Type::TEXT)])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect::<Vec<i32>>()
    };
    // The control: before the message, the holder is named.
    let before = holders().await;
    assert!(before.contains(&idle_pid), "{idle_pid} in {before:?}");

    // Dropping the statement sends Close and Sync; wait until the backend
    // has processed them (its `state_change` moves past the read).
    drop(statement);
    let mut polls = 0;
    loop {
        inspector
            .query_typed(CLEAR_ACTIVITY_SNAPSHOT, &[])
            .await
            .unwrap();
        let row = inspector
            .query_typed(
                "SELECT state, state_change > $1::timestamptz \
                 FROM pg_stat_activity WHERE pid = $2",
                &[(&read_at, Type::TEXT), (&idle_pid, Type::INT4)],
            )
            .await
            .unwrap();
        let (state, moved): (String, bool) = (row[0].get(0), row[0].get(1));
        // Idle throughout, as far as anyone can see. (Not `xact_start IS
        // NULL`: on the shared server, other tests' DDL makes the idle
        // backend catch up in short transactions of its own.)
        assert_eq!(state, "idle");
        if moved {
            break;
        }
        polls += 1;
        assert!(polls < 10_000, "the Close was never processed");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let after = holders().await;
    assert!(!after.contains(&idle_pid), "{idle_pid} not in {after:?}");

    // A fresh inspection reads after the message.
    let registry = KeyRegistry::new().register::<Invoice>();
    let rows = advisory_locks(&inspector, &registry).await.unwrap();
    let ours = rows_of(&rows, idle_pid, key);
    assert_eq!(ours.len(), 1, "{rows:?}");
    assert_eq!(ours[0].scope, Scope::Session);
    idle.query_typed("SELECT pg_advisory_unlock($1)", &[(&k, Type::INT8)])
        .await
        .unwrap();
}

/// Under churn, a transaction lock is never reported as session-level: a
/// holder runs many short transactions, each taking a transaction lock,
/// while `advisory_locks` runs again and again; a session lock held by an
/// idle session alongside is reported as session-level whenever seen.
#[tokio::test(flavor = "multi_thread")]
async fn transaction_locks_are_never_reported_as_session_locks() {
    use lockkit::inspect::Scope;

    let db = TestServer::shared();
    let _log = db.guard();
    let churn = connect(db, None, "scope-churn").await;
    let idle = connect(db, None, "scope-idle-2").await;
    let inspector = connect(db, None, "scope-inspector-2").await;
    let churn_pid = pid(&churn).await;
    let idle_pid = pid(&idle).await;
    let tx_key = Invoice { id: 9101 }.lock_key();
    let session_key = Invoice { id: 9102 }.lock_key();
    let (LockKey::BigInt(tk), LockKey::BigInt(sk)) = (tx_key, session_key) else {
        unreachable!()
    };
    lock_idle(&idle, sk).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let churning = tokio::spawn(async move {
        let mut n = 0_u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            churn
                .batch_execute(&format!(
                    "BEGIN; SELECT pg_advisory_xact_lock({tk}); COMMIT"
                ))
                .await
                .unwrap();
            n += 1;
        }
        n
    });
    let registry = KeyRegistry::new().register::<Invoice>();
    let (mut seen_tx, mut seen_session, mut inspections) = (0, 0, 0);
    // At least 300 inspections, and on until the churning holder has been
    // seen holding its lock (it holds it for microseconds at a time; on a
    // busy machine that can take more), within a bound.
    while inspections < 300 || (seen_tx == 0 && inspections < 20_000) {
        inspections += 1;
        let rows = advisory_locks(&inspector, &registry).await.unwrap();
        for r in rows_of(&rows, churn_pid, tx_key) {
            seen_tx += 1;
            assert_ne!(
                r.scope,
                Scope::Session,
                "a transaction lock reported as a session lock: {r:?}"
            );
        }
        for r in rows_of(&rows, idle_pid, session_key) {
            seen_session += 1;
            if r.scope != Scope::Session {
                // What the server shows of the idle session now, for the
                // failure message: a state change after the inspection
                // began would explain the `Unknown`.
                let now = inspector
                    .query_one(
                        "SELECT state, state_change::text, xact_start::text, \
                         backend_start::text, clock_timestamp()::text \
                         FROM pg_stat_activity WHERE pid = $1",
                        &[&idle_pid],
                    )
                    .await
                    .unwrap();
                let now: Vec<Option<String>> = (0..5).map(|i| now.get(i)).collect();
                panic!(
                    "inspection {inspections}: the idle session's lock is not reported as \
                     session-level: {r:?}; its (state, state_change, xact_start, \
                     backend_start, now) just after: {now:?}"
                );
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let transactions = churning.await.unwrap();
    assert_eq!(seen_session, inspections);
    assert!(
        seen_tx > 0,
        "the churning holder was never seen holding its lock ({transactions} transactions, \
         {inspections} inspections)"
    );
    idle.execute("SELECT pg_advisory_unlock($1)", &[&sk])
        .await
        .unwrap();
}

/// An idle session runs short transactions of its own, with no query of its
/// client, to catch up with the catalog invalidations other sessions' DDL
/// queues (PostgreSQL's `ProcessCatchupInterrupt`); meanwhile
/// `pg_stat_activity` shows it `idle` with an `xact_start`. It takes no
/// advisory lock there, so the session lock it holds is still reported as
/// session-level, and the session as outside any transaction (no
/// `transaction_age`). Found as a flake of the test above, with the rest of
/// the suite running DDL alongside: the lock was reported `Unknown`.
///
/// A server of its own, flooded with invalidations (temporary tables made
/// and dropped) while the lock is inspected at least 5,000 times. Before the
/// fixes it failed in four runs of four (1 to 4 inspections reported
/// `Unknown`), then in three of three (2 to 8 reported a `transaction_age`).
/// The control: an observer samples the idle backend inside the server and
/// must see it catching up (`idle` with an `xact_start`) at least 20 times
/// during the run (it saw 124 to 258 on a quiet machine, 27 to 38 with CI
/// running alongside); the inspections go on until it has, within a bound.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_session_catching_up_with_invalidations_still_holds_a_session_lock() {
    use lockkit::inspect::Scope;
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::sync::Arc;
    const INSPECTIONS: usize = 5_000;
    /// Catch-ups the observer must see (the control).
    const CATCH_UPS: i64 = 20;

    let db = TestServer::builder().start();
    let _log = db.guard();
    let idle = connect(&db, None, "catchup-idle").await;
    let inspector = connect(&db, None, "catchup-inspector").await;
    let observer = connect(&db, None, "catchup-observer").await;
    let idle_pid = pid(&idle).await;
    let key = Invoice { id: 9201 }.lock_key();
    let LockKey::BigInt(k) = key else {
        unreachable!()
    };
    // Samples `pid` `n` times, each from a fresh activity snapshot, and
    // counts the samples that show it idle inside a transaction of its own.
    observer
        .batch_execute(
            "CREATE FUNCTION catching_up(p int4, n int4) RETURNS int8 LANGUAGE plpgsql AS $$ \
             DECLARE seen int8 := 0; \
             BEGIN \
               FOR i IN 1..n LOOP \
                 PERFORM pg_stat_clear_snapshot(); \
                 IF EXISTS (SELECT 1 FROM pg_stat_get_activity(p) a \
                            WHERE a.state = 'idle' AND a.xact_start IS NOT NULL) THEN \
                   seen := seen + 1; \
                 END IF; \
               END LOOP; \
               RETURN seen; \
             END $$",
        )
        .await
        .unwrap();
    lock_idle(&idle, k).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut churners = Vec::new();
    for n in 0..2 {
        let ddl = connect(&db, None, "catchup-ddl").await;
        let stop = stop.clone();
        churners.push(tokio::spawn(async move {
            let batch: String = (0..20)
                .map(|i| {
                    format!(
                        "CREATE TEMP TABLE churn_{n}_{i} (a int, b text); DROP TABLE churn_{n}_{i};"
                    )
                })
                .collect();
            while !stop.load(Ordering::Relaxed) {
                ddl.batch_execute(&batch).await.unwrap();
            }
        }));
    }
    let caught_up = Arc::new(AtomicI64::new(0));
    let watching = {
        let (stop, caught_up) = (stop.clone(), caught_up.clone());
        tokio::spawn(async move {
            // In bursts: sampling without a pause would keep a core busy
            // and slow the tests running alongside.
            while !stop.load(Ordering::Relaxed) {
                let row = observer
                    .query_one("SELECT catching_up($1, 500)", &[&idle_pid])
                    .await
                    .unwrap();
                caught_up.fetch_add(row.get(0), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let registry = KeyRegistry::new().register::<Invoice>();
    let mut not_session = Vec::new();
    // At least INSPECTIONS, and on until the observer has seen the control's
    // catch-ups (fewer come when the machine is busy), within a bound.
    let mut inspections = 0;
    while inspections < INSPECTIONS
        || (caught_up.load(Ordering::Relaxed) < CATCH_UPS && inspections < 4 * INSPECTIONS)
    {
        inspections += 1;
        let rows = advisory_locks(&inspector, &registry).await.unwrap();
        let ours = rows_of(&rows, idle_pid, key);
        assert_eq!(ours.len(), 1, "{rows:?}");
        if ours[0].scope != Scope::Session || ours[0].transaction_age.is_some() {
            not_session.push(ours[0].clone());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for churner in churners {
        churner.await.unwrap();
    }
    watching.await.unwrap();
    let caught_up = caught_up.load(Ordering::Relaxed);
    assert!(
        not_session.is_empty(),
        "the idle session's lock was not reported as session-level, or the session as outside \
         any transaction, {} times in {inspections} inspections ({caught_up} catch-ups seen): {:?}",
        not_session.len(),
        not_session.first()
    );
    assert!(
        caught_up >= CATCH_UPS,
        "the control: the idle backend was seen catching up only {caught_up} times"
    );
    idle.execute("SELECT pg_advisory_unlock($1)", &[&k])
        .await
        .unwrap();
}

/// A prepared transaction's advisory lock has no pid and is reported as
/// transaction-level.
#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_transactions_lock_is_transaction_level() {
    use lockkit::inspect::Scope;

    let db = TestServer::builder()
        .setting("max_prepared_transactions", "2")
        .start();
    let _log = db.guard();
    let client = db.connect().await;
    let key = Invoice { id: 9201 }.lock_key();
    let LockKey::BigInt(k) = key else {
        unreachable!()
    };
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({k}); PREPARE TRANSACTION 'lockkit-inspect-scope'"
        ))
        .await
        .unwrap();
    let rows = advisory_locks(&client, &KeyRegistry::new().register::<Invoice>())
        .await
        .unwrap();
    let row = rows
        .iter()
        .find(|r| r.key == key)
        .unwrap_or_else(|| panic!("no row of the prepared lock: {rows:?}"));
    assert_eq!(row.pid, None);
    assert!(row.granted);
    assert_eq!(row.scope, Scope::Transaction);
    client
        .batch_execute("ROLLBACK PREPARED 'lockkit-inspect-scope'")
        .await
        .unwrap();
}

/// The inspecting session's `TimeZone` and `DateStyle` (a server, database or
/// role default, or a pooled connection's `SET`) must not matter. With a
/// non-ISO `DateStyle` PostgreSQL prints a time zone abbreviation, and
/// reading `statement_timestamp()::text` back as a `timestamptz` fails for an
/// abbreviation it does not know (`WIB`, Asia/Jakarta): every inspection
/// with an idle holder failed.
#[tokio::test(flavor = "multi_thread")]
async fn inspection_works_under_any_time_zone_and_date_style() {
    use lockkit::inspect::Scope;

    let db = TestServer::shared();
    let _log = db.guard();
    let idle = connect(db, None, "tz-idle").await;
    let inspector = connect(db, None, "tz-inspector").await;
    let idle_pid = pid(&idle).await;
    let key = Invoice { id: 9301 }.lock_key();
    let LockKey::BigInt(k) = key else {
        unreachable!()
    };
    lock_idle(&idle, k).await;
    let registry = KeyRegistry::new().register::<Invoice>();
    for (zone, style) in [
        ("Asia/Jakarta", "Postgres, MDY"),
        ("Asia/Jakarta", "SQL, DMY"),
        ("Asia/Kolkata", "German"),
        ("UTC+3", "Postgres, DMY"),
        ("Europe/Berlin", "ISO, YMD"),
    ] {
        inspector
            .batch_execute(&format!(
                "SET TimeZone = '{zone}'; SET DateStyle = '{style}'"
            ))
            .await
            .unwrap();
        let rows = advisory_locks(&inspector, &registry)
            .await
            .unwrap_or_else(|e| panic!("{zone}, {style}: {e}"));
        let held = rows_of(&rows, idle_pid, key);
        assert_eq!(held.len(), 1, "{zone}, {style}: {rows:?}");
        assert_eq!(held[0].scope, Scope::Session, "{zone}, {style}");
    }
    idle.execute("SELECT pg_advisory_unlock($1)", &[&k])
        .await
        .unwrap();
}

/// `ADVISORY_LOCKS`' `read_at` means the same instant to `SESSION_HOLDERS`
/// whatever the session's `TimeZone` and `DateStyle`. Printed as
/// `... 2024 IST` (Asia/Kolkata, +05:30) and read back as Israel Standard
/// Time (+02:00), it was 3.5 hours late: a session that held a transaction
/// lock when `pg_locks` was read, then committed and went idle before
/// `SESSION_HOLDERS` ran, was named a session holder, and its transaction
/// lock reported as `Scope::Session`. The statements are run one by one
/// here, with the commit in between, as `advisory_locks` runs them.
#[tokio::test(flavor = "multi_thread")]
async fn read_at_is_the_same_instant_under_any_time_zone() {
    use lockkit::inspect::{ADVISORY_LOCKS, CLEAR_ACTIVITY_SNAPSHOT, SESSION_HOLDERS};
    use tokio_postgres::types::Type;

    let db = TestServer::shared();
    let _log = db.guard();
    let in_tx = connect(db, None, "tz-in-tx").await;
    let inspector = connect(db, None, "tz-inspector").await;
    let in_tx_pid = pid(&in_tx).await;
    for (i, (zone, style)) in [
        ("Asia/Kolkata", "Postgres, MDY"),
        ("Asia/Shanghai", "SQL, MDY"),
        ("Asia/Manila", "German"),
    ]
    .into_iter()
    .enumerate()
    {
        let k = 9310 + i as i64;
        lockkit_tests::support::hold_in_transaction(&in_tx, [lockkit::LockKey::BigInt(k)]).await;
        inspector
            .batch_execute(&format!(
                "SET TimeZone = '{zone}'; SET DateStyle = '{style}'"
            ))
            .await
            .unwrap();
        let rows = inspector.query_typed(ADVISORY_LOCKS, &[]).await.unwrap();
        let held = rows
            .iter()
            .any(|r| r.get::<_, Option<i32>>(5) == Some(in_tx_pid) && r.get::<_, i64>(1) == k);
        assert!(held, "{zone}: the transaction lock is in pg_locks");
        let read_at: String = rows[0].get(13);
        // After the read: the transaction ends, the session goes idle.
        in_tx.batch_execute("COMMIT").await.unwrap();
        inspector
            .query_typed(CLEAR_ACTIVITY_SNAPSHOT, &[])
            .await
            .unwrap();
        let holders: Vec<i32> = inspector
            .query_typed(SESSION_HOLDERS, &[(&read_at, Type::TEXT)])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            !holders.contains(&in_tx_pid),
            "{zone}, {style}: read_at {read_at:?} names {in_tx_pid}, idle only since after the read, \
             a session holder: its transaction lock would read as Scope::Session"
        );
    }
}
