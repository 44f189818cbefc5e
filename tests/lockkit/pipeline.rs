//! `LockTx::lock_batch` pipelined with the transaction's next statement
//! keeps its order: the statement runs after the locks are granted, never
//! while they wait. The statement draws from a sequence, which other
//! sessions see advance at once (sequences are not transactional), so
//! "has it run yet" is observable while the batch waits; the control
//! pipelines the other way round and is seen running early.

use lockkit::{AdvisoryKey, Batch, Config, Error};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use crate::common::{backend_pid, locker, wait_until_waiting};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/pipeline")]
struct Event {
    id: i64,
}

/// Whether the sequence `seq` has handed out a value.
async fn drawn(observer: &Client, seq: &str) -> bool {
    observer
        .query_one(&format!("SELECT is_called FROM {seq}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// What the pipelined transaction is doing as another session sees it: its
/// current statement and whether it waits for an advisory lock.
async fn activity(observer: &Client, pid: i32) -> (String, Option<String>) {
    let row = observer
        .query_one(
            "SELECT query, wait_event FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Runs the batch and the insert pipelined, the lock future polled first
/// (as `lock_batch` documents) or, in the control, the insert first; while
/// they run, `holder` keeps one key of the batch, and the test waits until
/// the batch's session is seen waiting. Returns whether the insert had
/// drawn its sequence value while the lock waited, and the statement the
/// session was running then.
///
/// With `fresh_client`, the transaction comes from a new `LockClient`,
/// whose first lock call also prepares lockkit's statements.
async fn pipelined(
    lock_first: bool,
    fresh_client: bool,
    ids: [i64; 2],
    name: &str,
) -> (bool, String) {
    let db = TestServer::shared();
    let a = db.connect().await;
    let mut holder_client = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    // `fresh_client`: a `LockClient` whose statements are prepared (the
    // opt-in), its first lock call preparing them; otherwise the default,
    // unnamed statements.
    let locker = locker(
        &a,
        Config::default().statements(lockkit::StatementMode::Prepared),
    )
    .await;
    let (table, seq) = (format!("{name}_rows"), format!("{name}_seq"));
    observer
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; DROP SEQUENCE IF EXISTS {seq}; \
             CREATE SEQUENCE {seq}; CREATE TABLE {table} (n int8 NOT NULL)"
        ))
        .await
        .unwrap();
    let insert = format!("INSERT INTO {table} SELECT nextval('{seq}')");
    let batch = Batch::new()
        .with(&Event { id: ids[0] })
        .with(&Event { id: ids[1] });

    let holder = locker.begin(&mut holder_client).await.unwrap();
    let _ = holder.lock(Event { id: ids[1] }).await.unwrap();

    let mut conn = lockkit::LockClient::new(&locker, a);
    let tx = if fresh_client {
        conn.begin().await.unwrap()
    } else {
        locker.begin(&mut conn).await.unwrap()
    };
    assert_eq!(tx.is_prepared(), fresh_client);
    let lock = async { tx.lock_batch(&batch).await.map(drop) };
    // `execute_typed` sends its statement on its first poll.
    let insert = async { Ok::<_, Error>(tx.execute_typed(&insert, &[]).await?) };
    let observe = async {
        wait_until_waiting(&observer, pid).await;
        let seen = (drawn(&observer, &seq).await, activity(&observer, pid).await);
        // Only now may the batch get its key.
        holder.commit().await.unwrap();
        seen
    };
    let (result, (drawn_while_waiting, (query, wait_event))) = if lock_first {
        let (result, seen) = tokio::join!(async { tokio::try_join!(lock, insert) }, observe);
        (result.map(|(_, n)| n), seen)
    } else {
        let (result, seen) = tokio::join!(async { tokio::try_join!(insert, lock) }, observe);
        (result.map(|(n, _)| n), seen)
    };
    assert_eq!(result.unwrap(), 1, "one row inserted");
    assert_eq!(wait_event.as_deref(), Some("advisory"), "{query}");
    tx.commit().await.unwrap();
    let rows: i64 = observer
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    assert!(drawn(&observer, &seq).await, "the insert ran in the end");
    observer
        .batch_execute(&format!("DROP TABLE {table}; DROP SEQUENCE {seq}"))
        .await
        .unwrap();
    (drawn_while_waiting, query)
}

#[tokio::test(flavor = "multi_thread")]
async fn pipelined_statement_runs_after_the_locks() {
    let _log = TestServer::shared().guard();
    let (drawn, query) = pipelined(true, false, [1, 2], "lockkit_pipeline_ordered").await;
    assert!(
        !drawn,
        "the insert ran while the batch waited for its locks"
    );
    assert!(
        query.contains("pg_advisory_xact_lock"),
        "the session waits in the lock statement, not the insert: {query}"
    );
}

/// Control: the insert polled (so sent) first runs before the locks, and
/// the observation above sees it.
#[tokio::test(flavor = "multi_thread")]
async fn control_statement_sent_first_runs_before_the_locks() {
    let _log = TestServer::shared().guard();
    let (drawn, _) = pipelined(false, false, [3, 4], "lockkit_pipeline_control").await;
    assert!(drawn, "the observation cannot tell the order apart");
}

/// The same on a new `LockClient`: its first lock call prepares lockkit's
/// statements, and the statement pipelined behind it still runs after the
/// locks. (It once ran first: the lock future awaited the prepare before
/// sending anything, and the ingestion study's lock-only strategy let
/// duplicates through on each new connection.)
#[tokio::test(flavor = "multi_thread")]
async fn pipelined_statement_runs_after_the_locks_on_a_new_lock_client() {
    let _log = TestServer::shared().guard();
    let (drawn, query) = pipelined(true, true, [5, 6], "lockkit_pipeline_fresh").await;
    assert!(
        !drawn,
        "the insert ran while the batch waited for its locks"
    );
    assert!(query.contains("pg_advisory_xact_lock"), "{query}");
}
