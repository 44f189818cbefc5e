//! lockkit with no configuration behind a transaction-mode pgbouncer that
//! other applications share (issue 44): pgbouncer 1.18 keeps no named
//! prepared statement per client, so a statement one client prepared stays
//! on a server connection that the pooler then hands to another.
//!
//! Before each test, a foreign application (plain tokio-postgres, which
//! names its statements `s0`, `s1`, …) leaves its statements on every server
//! connection of the pool ([`litter`]); then lockkit runs with
//! `Config::default()` and its default session forms, and must see no error
//! at all. The controls show that the litter is there and that named
//! statements do collide with it ([`control_named_statements_collide`]).

use std::num::NonZeroU8;

use lockkit::{
    AdvisoryKey, Config, ErrorKind, LockClient, Locker, SessionForm, SessionLock, StatementMode,
};
use lockkit_tests::observe::granted_elsewhere;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::{Client, NoTls};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.shared-pooler")]
struct Account {
    id: i64,
}

/// Server connections in the pool: fewer than the clients.
const POOL: u32 = 3;

async fn client(bouncer: &PgBouncer) -> Client {
    let (client, conn) = bouncer
        .config()
        .connect(NoTls)
        .await
        .expect("connects through pgbouncer");
    tokio::spawn(conn);
    client
}

fn bouncer(db: &TestServer) -> PgBouncer {
    PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(POOL)
        .start()
}

/// Names a new client of each stack gives its statements: tokio-postgres
/// numbers them from one counter per process (`s0`, `s1`, …), sqlx per
/// connection (`sqlx_s_1`, …), Diesel per connection (`__diesel_stmt_0`,
/// …). Another process starts its counters where this one started.
fn foreign_names(tokio_postgres_next: usize) -> Vec<String> {
    let mut names = Vec::new();
    for i in 0..LITTER {
        names.push(format!("s{}", tokio_postgres_next + i));
        names.push(format!("sqlx_s_{}", i + 1));
        names.push(format!("__diesel_stmt_{i}"));
    }
    names
}

/// The foreign applications: `POOL` clients each open a transaction at
/// once, so each holds a server connection of its own, and prepare there
/// the statements other processes of every stack would name as this
/// process's new clients will ([`foreign_names`]), which they never
/// deallocate; then commit. Every server connection of the pool now has
/// them.
async fn litter(db: &TestServer, bouncer: &PgBouncer) -> (Vec<Client>, usize) {
    let mut clients = Vec::new();
    for _ in 0..POOL {
        clients.push(client(bouncer).await);
    }
    // This process's next tokio-postgres statement name.
    let next = {
        let direct = db.connect().await;
        let _probe = direct.prepare("SELECT 424242").await.expect("prepare");
        let row = direct
            .query_typed_one(
                "SELECT name FROM pg_prepared_statements WHERE statement = 'SELECT 424242'",
                &[],
            )
            .await
            .expect("the statement's name");
        let name: String = row.get(0);
        name.trim_start_matches('s').parse::<usize>().expect("sN") + 1
    };
    let script: String = foreign_names(next)
        .iter()
        .map(|name| format!("PREPARE {name} AS SELECT 7::int8;"))
        .collect();
    let mut pids = Vec::new();
    for c in &clients {
        c.batch_execute("BEGIN").await.expect("begin");
        let row = c
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid");
        pids.push(row.get::<_, i32>(0));
        c.batch_execute(&script)
            .await
            .expect("prepare the foreign statements");
    }
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(
        pids.len(),
        POOL as usize,
        "each foreign transaction pinned a server connection of its own"
    );
    for c in &clients {
        c.batch_execute("COMMIT").await.expect("commit");
    }
    (clients, next)
}

/// How many foreign statement names each stack's counter may use up in
/// this process while the tests run.
const LITTER: usize = 3_000;

/// The control: the foreign statements are on every server connection
/// (each of `POOL` pinned transactions fails to prepare the next name), and
/// a `LockClient` whose statements are named (`StatementMode::Prepared`)
/// fails behind the littered pool.
#[tokio::test(flavor = "multi_thread")]
async fn control_named_statements_collide() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let (_foreign, next) = litter(db, &bouncer).await;
    let mut pinned = Vec::new();
    for _ in 0..POOL {
        let c = client(&bouncer).await;
        c.batch_execute("BEGIN").await.unwrap();
        let e = c
            .batch_execute(&format!("PREPARE s{next} AS SELECT 1"))
            .await
            .expect_err("the foreign statement is on every server connection");
        assert_eq!(e.code().map(|c| c.code()), Some("42P05"), "{e}");
        pinned.push(c);
    }
    // Ended, so that pgbouncer keeps the server connections (it closes one
    // whose client left inside a transaction).
    for c in pinned {
        c.batch_execute("ROLLBACK").await.unwrap();
    }
    let locker = Locker::new(
        &client(&bouncer).await,
        Config::default().statements(StatementMode::Prepared),
    )
    .await
    .unwrap();
    let errors = transactions(&bouncer, &locker, 100_000).await;
    assert!(
        !errors.is_empty(),
        "named statements collided with none of the foreign ones"
    );
    // What it is, never 25P02 or a bare database error; the clash and the
    // missing statement say what to do.
    for e in &errors {
        assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e:?}");
        if matches!(e.code(), Some("42P05" | "26000")) {
            assert!(e.to_string().contains("StatementMode::Unnamed"), "{e}");
        }
    }
    assert!(
        errors
            .iter()
            .any(|e| matches!(e.code(), Some("42P05" | "26000"))),
        "no clash or missing statement among {errors:?}"
    );
}

/// Eight clients at once, more than the pool's server connections, each
/// running 25 rounds of transactions: a batch and a try, a lock, a permit.
/// The errors.
async fn transactions(bouncer: &PgBouncer, locker: &Locker, base: i64) -> Vec<lockkit::Error> {
    let mut tasks = Vec::new();
    for worker in 0..8_i64 {
        let mut conn = LockClient::new(locker, client(bouncer).await);
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            for round in 0..25_i64 {
                let id = base + worker * 1_000 + round;
                let outcome: Result<(), lockkit::Error> = async {
                    let tx = conn.begin().await?;
                    let batch = lockkit::Batch::new()
                        .with(&Account { id })
                        .with(&Account { id: id + 500 })
                        .with(&Account { id: id + 700 });
                    let _ = tx.lock_batch(&batch).await?;
                    let _ = tx
                        .try_lock(Account { id: id + 900 })
                        .await?
                        .map_err(|_| lockkit::Error::other("busy"))?;
                    tx.commit().await?;
                    let tx = conn.begin().await?;
                    let _ = tx.lock(Account { id: id + 300 }).await?;
                    tx.commit().await?;
                    let tx = conn.begin().await?;
                    let _ = tx
                        .acquire_permit(Account { id: base + worker }, NonZeroU8::new(3).unwrap())
                        .await?;
                    tx.commit().await?;
                    Ok(())
                }
                .await;
                if let Err(e) = outcome {
                    errors.push(e);
                }
            }
            errors
        }));
    }
    let mut errors = Vec::new();
    for task in tasks {
        errors.extend(task.await.unwrap());
    }
    errors
}

/// A `LockClient` made with `Config::default()` takes every lock behind the
/// shared pooler, transactions and batches, tries and permits, on several
/// clients at once, more clients than server connections.
#[tokio::test(flavor = "multi_thread")]
async fn a_default_lock_client_works_behind_a_shared_pooler() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let _foreign = litter(db, &bouncer).await;
    let observer = db.connect().await;
    let locker = Locker::new(&client(&bouncer).await, Config::default())
        .await
        .expect("the locker learns the server's facts through the pooler");
    let errors = transactions(&bouncer, &locker, 1_000).await;
    assert!(
        errors.is_empty(),
        "{} of 200 transactions failed behind the shared pooler, first: {:?}",
        errors.len(),
        errors.first()
    );
    assert!(!granted_elsewhere(&observer, Account { id: 1_000 }.lock_key()).await);
}

/// A multiplexed `SessionLock` and a default-form one, with no
/// configuration, take and release their locks on a littered pool.
#[tokio::test(flavor = "multi_thread")]
async fn default_session_forms_work_behind_a_shared_pooler() {
    let db = TestServer::shared();
    let bouncer = bouncer(db);
    let _foreign = litter(db, &bouncer).await;
    let observer = db.connect().await;
    for form in [SessionForm::Multiplexed, SessionForm::default()] {
        let sessions = SessionLock::new(bouncer.config()).form(form).connections(1);
        for id in 0..5 {
            let key = Account { id: 50_000 + id };
            let guard = sessions
                .try_lock(key)
                .await
                .unwrap_or_else(|e| panic!("{form:?}: {e:?}"))
                .unwrap_or_else(|_| panic!("{form:?}: nobody else holds the key"));
            assert!(
                granted_elsewhere(&observer, key.lock_key()).await,
                "{form:?}"
            );
            guard
                .release()
                .await
                .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
        }
        let permit = sessions
            .acquire_permit(Account { id: 60_000 }, NonZeroU8::new(2).unwrap())
            .await
            .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
        permit
            .release()
            .await
            .unwrap_or_else(|e| panic!("{form:?}: {e:?}"));
    }
}

/// A `FATAL` error ends the session, whatever the driver has yet read of
/// the socket behind it: pgbouncer's `query_wait_timeout` (a `FATAL`
/// `08P01` when no server connection was free in time, then the client's
/// connection closed) is `ConnectionLost` on a `LockClient`, never a bare
/// database error.
#[tokio::test(flavor = "multi_thread")]
async fn a_fatal_error_of_the_pooler_is_a_lost_connection() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::impatient(db);
    // The one server connection, pinned by a transaction left open.
    let pin = client(&bouncer).await;
    pin.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let locker = Locker::new(&db.connect().await, Config::default())
        .await
        .unwrap();
    for id in 0..3 {
        let mut conn = LockClient::new(&locker, client(&bouncer).await);
        let e = async {
            let tx = conn.begin().await?;
            tx.lock(Account { id: 910_000 + id }).await.map(drop)
        }
        .await
        .expect_err("no server connection was free within query_wait_timeout");
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e:?}");
        assert!(e.is_connection_lost(), "{e:?}");
    }
    pin.batch_execute("ROLLBACK").await.unwrap();
}
