//! Statement-name clashes behind a transaction-mode pooler, each a
//! reported defect reproduced on a real server first: another client's
//! prepared statement with the name of one of lockkit's, on the pooled
//! backend, is refused as `UnexpectedReply`, whichever of lockkit's
//! statements it replaces, and never taken for a lock.

use std::time::Duration;

use lockkit::{AdvisoryKey, Batch, Config, ErrorKind, LockClient, Locker};
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::NoTls;

use crate::common::{granted_elsewhere, locker};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.statement-clashes")]
struct Item {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.statement-clashes.seat", pair)]
struct Seat {
    row: i32,
}

/// Behind pgbouncer in transaction mode, a foreign prepared
/// statement with lockkit's statement name on the pooled server connection
/// made `lock()` report success without a lock. Now every reply is checked:
/// the call fails with `UnexpectedReply`, and no `lock()` ever returns Ok
/// without its row in `pg_locks` (checked from a direct connection after
/// every call, over many calls from several clients).
///
/// The control shows the danger is real: the same foreign statement,
/// executed through the statement handle that lockkit prepared, answers
/// without error and takes no lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_foreign_statement_behind_a_pooler_is_never_a_lock() {
    let db = TestServer::shared();
    let _log = db.guard();
    // One server connection: every client's transactions share it.
    let bouncer = PgBouncer::one_server_connection(db);
    let observer = db.connect().await;
    // Named statements (the opt-in), whose reply check this is about.
    let locker = locker(
        &db.connect().await,
        Config::default().statements(lockkit::StatementMode::Prepared),
    )
    .await;
    let (client, conn) = bouncer.config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    let mut lk = LockClient::new(&locker, client);
    // The first lock prepares lockkit's statements on the pooled backend.
    let tx = lk.begin().await.unwrap();
    let first = tx.lock(Item { id: 10 }).await.unwrap().key();
    assert!(granted_elsewhere(&observer, first).await);
    tx.commit().await.unwrap();

    // Another client of the pooler replaces lockkit's statements on that
    // backend by foreign ones of the same names and parameter types.
    let (other, conn) = bouncer.config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    let names: Vec<(String, String)> = other
        .query(
            "SELECT name, array_to_string(parameter_types::text[], ',') FROM pg_prepared_statements \
             WHERE statement LIKE '%lockkit:%' AND statement NOT LIKE '%pg_prepared_statements%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        names.len() >= 4,
        "lockkit's statements are prepared there: {names:?}"
    );
    // Three foreign statements: two of other shapes (three columns, which
    // the driver cannot read as the one-key lock's two; a `text` first
    // column, which it cannot read as its `int8` tag), and one of the same
    // shape with another tag.
    for foreign in [
        "SELECT 'x'::text AS tag, 1::int8 AS n, pg_sleep(0) AS locked",
        "SELECT 'x'::text AS tag, pg_sleep(0) AS locked",
        "SELECT 7::int8 AS tag, pg_sleep(0) AS locked",
    ] {
        for (name, types) in &names {
            let params = if types.is_empty() {
                String::new()
            } else {
                format!("({types})")
            };
            other
                .batch_execute(&format!(
                    "DEALLOCATE {name}; PREPARE {name}{params} AS {foreign}"
                ))
                .await
                .unwrap();
        }

        // The control: lockkit's own statement handle now runs the foreign
        // text without an error, and no lock is taken.
        let mut oks = 0;
        for id in 0..12 {
            let tx = lk.begin().await.unwrap();
            match tx.lock(Item { id: 100 + id }).await {
                Ok(held) => {
                    // Never a success without the lock.
                    assert!(
                        granted_elsewhere(&observer, held.key()).await,
                        "lock() returned Ok without its row in pg_locks"
                    );
                    oks += 1;
                }
                Err(e) => {
                    assert_eq!(
                        e.kind(),
                        ErrorKind::UnexpectedReply,
                        "{e} {e:?} ({foreign})"
                    );
                    assert!(tx.is_poisoned());
                }
            }
            tx.rollback().await.unwrap();
        }
        assert_eq!(
            oks, 0,
            "every lock ran the foreign statement ({foreign}) and was refused"
        );
    }
    let raw = other
        .query_one(
            &format!("EXECUTE {}{}", names[0].0, placeholder(&names[0].1)),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        raw.get::<_, i64>(0),
        7,
        "the foreign statement answers silently"
    );

    // Unnamed statements cannot collide: the same pooler, the same
    // backend, and every lock is real.
    let unnamed = Locker::with_facts(
        Config::default().statements(lockkit::StatementMode::Unnamed),
        locker.policy().facts().clone(),
    );
    let (client, conn) = bouncer.config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    let mut lk = LockClient::new(&unnamed, client);
    for id in 0..12 {
        let tx = lk.begin().await.unwrap();
        let key = tx.lock(Item { id: 200 + id }).await.unwrap().key();
        assert!(granted_elsewhere(&observer, key).await);
        tx.rollback().await.unwrap();
    }
}

/// Arguments for `EXECUTE` of a statement with these parameter types.
fn placeholder(types: &str) -> String {
    if types.is_empty() {
        return String::new();
    }
    let nulls: Vec<String> = types.split(',').map(|t| format!("NULL::{t}")).collect();
    format!("({})", nulls.join(","))
}

/// Behind a transaction-mode pooler, a foreign prepared statement
/// with the name of lockkit's statement that saves and sets the timeouts of
/// a timed call made the statement that restores them fail with `42704`
/// (unrecognized `lockkit.saved_lock_timeout`), typed `Database`: a
/// statement-name clash must be `UnexpectedReply`, whichever of lockkit's
/// statements it hits. Each of the three timeout statements is replaced in
/// turn by a foreign one of the same parameter types and reply shape
/// (the saving one also with lockkit's own tag, so that only its missing
/// work tells it apart), and timed calls
/// (one key, and batches of both key spaces) run through the pooler: each
/// is refused as `UnexpectedReply`, or, where the replaced statement did
/// not run, succeeds with its locks really held.
#[tokio::test(flavor = "multi_thread")]
async fn a_clash_on_the_timeout_statements_is_an_unexpected_reply() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::one_server_connection(db);
    let observer = db.connect().await;
    // Named statements (the opt-in), whose reply check this is about.
    let locker = locker(
        &db.connect().await,
        Config::default().statements(lockkit::StatementMode::Prepared),
    )
    .await;
    for (marker, foreign) in [
        // Another client's statements of lockkit's shapes.
        ("lockkit:set_timeouts", "SELECT 7::int8 AS tag, 0::int8 AS n, ''::text AS a, ''::text AS b, ''::text AS c, ''::text AS d, ''::text AS e"),
        ("lockkit:arm_timeouts", "SELECT 7::int8 AS tag, 0::int8 AS n, ''::text AS a, ''::text AS b"),
        ("lockkit:restore_timeouts", "SELECT 7::int8 AS tag, 0::int8 AS n, ''::text AS a, ''::text AS b"),
        // Even with lockkit's own tag, a foreign saving statement is seen:
        // what the restoring (and arming) statement needs is missing.
        ("lockkit:set_timeouts", "SELECT 7813573191525823503::int8 AS tag, 0::int8 AS n, ''::text AS a, ''::text AS b, ''::text AS c, ''::text AS d, ''::text AS e"),
    ] {
        let (client, conn) = bouncer.config().connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        let mut lk = LockClient::new(&locker, client);
        // The first timed call prepares lockkit's statements on the backend.
        let tx = lk.begin().await.unwrap();
        let _ = tx
            .lock_timeout(Item { id: 1 }, Duration::from_secs(5))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let (other, conn) = bouncer.config().connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        // Every client's statement of that kind on the backend (this one's
        // and the earlier rounds').
        let replaced =
            lockkit_tests::forge::replace_prepared(&other, marker, |_| foreign.to_owned()).await;
        assert!(replaced > 0, "{marker} is prepared on the backend");

        let mut refused = 0;
        for round in 0..6_i64 {
            let tx = lk.begin().await.unwrap();
            let id = 100 * round;
            let result = match round % 3 {
                0 => tx
                    .lock_timeout(Item { id }, Duration::from_secs(5))
                    .await
                    .map(|held| vec![held.key()]),
                1 => tx
                    .lock_batch_timeout(
                        &Batch::new().with(&Item { id }).with(&Item { id: id + 1 }),
                        Duration::from_secs(5),
                    )
                    .await
                    .map(|held| held.keys().iter().map(|(k, _)| *k).collect()),
                _ => tx
                    .lock_batch_timeout(
                        &Batch::new()
                            .with(&Item { id })
                            .with(&Seat { row: id as i32 }),
                        Duration::from_secs(5),
                    )
                    .await
                    .map(|held| held.keys().iter().map(|(k, _)| *k).collect()),
            };
            match result {
                Ok(keys) => {
                    for key in keys {
                        assert!(
                            granted_elsewhere(&observer, key).await,
                            "{marker}: a timed call returned Ok without {key:?} in pg_locks"
                        );
                    }
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{marker}: {e} ({e:?})");
                    refused += 1;
                }
            }
            tx.rollback().await.unwrap();
        }
        assert!(refused > 0, "{marker}: the clash was never seen");
    }
}
