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
