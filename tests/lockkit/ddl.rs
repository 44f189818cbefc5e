//! DDL that never stalls the lock queue (`lockkit::pg::run_ddl`), on a real
//! server with a long reader and readers arriving behind the DDL.

use std::time::{Duration, Instant};

use lockkit::pg::{run_ddl, DdlRetry};
use lockkit::{ErrorKind, RetryPolicy};
use lockkit_tests::observe::{wait_until_waiting_for, Awaited};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use crate::common::backend_pid;

/// Waits (up to 30 s, else panics) until backend `pid` waits for a
/// relation lock in its `nth` distinct transaction (told apart by
/// `xact_start`), counting from the first one seen.
async fn wait_until_attempt_waits(observer: &Client, pid: i32, nth: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen: Vec<String> = Vec::new();
    loop {
        let row = observer
            .query_opt(
                "SELECT a.xact_start::text FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid \
                 WHERE a.pid = $1 AND l.locktype = 'relation' AND NOT l.granted",
                &[&pid],
            )
            .await
            .unwrap();
        if let Some(row) = row {
            let start: String = row.get(0);
            if !seen.contains(&start) {
                seen.push(start);
            }
            if seen.len() >= nth {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never waited in {nth} transactions"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `run_ddl` tries until its deadline, never gives up before it: several
/// runs at once, each behind a reader that never lets go, with a backoff
/// whose delays are a large share of the deadline (so a jittered delay
/// often reaches past it). Each returns `Timeout`, no earlier than its
/// deadline (a lower bound: load only makes the return later), with an
/// error that says what happened.
#[tokio::test(flavor = "multi_thread")]
async fn ddl_keeps_trying_until_its_deadline() {
    const RUNS: usize = 6;
    let deadline = Duration::from_millis(1500);
    let retry = DdlRetry::default()
        .lock_timeout(Duration::from_millis(50))
        .deadline(deadline)
        .backoff(RetryPolicy::default().delays(Duration::from_millis(300), Duration::from_secs(1)));
    let db = TestServer::shared();
    let _log = db.guard();
    let mut runs = tokio::task::JoinSet::new();
    for i in 0..RUNS {
        runs.spawn(async move {
            let table = format!("ddl_deadline_{i}");
            let mut long = db.connect().await;
            long.batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int)"
            ))
            .await
            .unwrap();
            let long_tx = long.transaction().await.unwrap();
            long_tx
                .query(&format!("SELECT * FROM {table}"), &[])
                .await
                .unwrap();
            let mut migrator = db.connect().await;
            let called = Instant::now();
            let result = tokio::time::timeout(
                deadline + Duration::from_secs(30),
                run_ddl(
                    &mut migrator,
                    &format!("ALTER TABLE {table} ADD COLUMN note text"),
                    &retry,
                ),
            )
            .await
            .expect("run_ddl never returned");
            let returned = called.elapsed();
            drop(long_tx);
            (i, returned, result)
        });
    }
    while let Some(run) = runs.join_next().await {
        let (i, returned, result) = run.unwrap();
        let err = result.expect_err("the long reader never let go");
        assert_eq!(err.kind(), ErrorKind::Timeout, "run {i}: {err}");
        assert!(
            returned >= deadline,
            "run {i} gave up after {returned:?}, before its deadline of {deadline:?}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.contains("attempt(s)") && message.contains("nothing was changed"),
            "run {i}: {message}"
        );
        let source = std::error::Error::source(&err).expect("the last attempt's error");
        assert!(source.to_string().contains("lock"), "run {i}: {source}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ddl_gives_way_to_readers_and_succeeds_when_the_long_reader_ends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let setup = db.connect().await;
    setup
        .batch_execute("DROP TABLE IF EXISTS ddl_queue; CREATE TABLE ddl_queue (id int); INSERT INTO ddl_queue VALUES (1)")
        .await
        .unwrap();
    let mut long = db.connect().await;
    let reader = db.connect().await;
    let mut migrator = db.connect().await;

    // A long reader holds ACCESS SHARE for the whole test below.
    let long_tx = long.transaction().await.unwrap();
    long_tx.query("SELECT * FROM ddl_queue", &[]).await.unwrap();

    // 1. Under a deadline the helper gives up with a typed error, and
    //    meanwhile readers keep going: every one completes while the long
    //    reader still holds its lock (each within the helper's lock timeout
    //    plus a generous margin).
    let retry = DdlRetry::default()
        .lock_timeout(Duration::from_millis(50))
        .deadline(Duration::from_secs(5));
    let (result, slowest) = tokio::join!(
        run_ddl(
            &mut migrator,
            "ALTER TABLE ddl_queue ADD COLUMN note text",
            &retry
        ),
        async {
            let mut slowest = Duration::ZERO;
            let started = Instant::now();
            while started.elapsed() < Duration::from_millis(1500) {
                let t = Instant::now();
                // A reader queued behind an attempt waits for that attempt's
                // 50 ms lock_timeout, not for the 5 s deadline (nor for the
                // long reader): 1 s is 20 lock timeouts of slack for a
                // loaded machine, and a fifth of the deadline.
                tokio::time::timeout(
                    Duration::from_secs(1),
                    reader.query("SELECT * FROM ddl_queue", &[]),
                )
                .await
                .expect("a reader was held up by more than the DDL's lock_timeout")
                .unwrap();
                slowest = slowest.max(t.elapsed());
            }
            slowest
        }
    );
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    println!("readers during the retries: slowest {slowest:?} (lock_timeout 50 ms)");

    // 2. It succeeds once the long reader ends, during its retries.
    let retry = DdlRetry::default()
        .lock_timeout(Duration::from_millis(50))
        .deadline(Duration::from_secs(60));
    let migrator_pid = backend_pid(&migrator).await;
    let (done, ()) = tokio::join!(
        run_ddl(
            &mut migrator,
            "ALTER TABLE ddl_queue ADD COLUMN note text",
            &retry
        ),
        async {
            // The long reader ends only once a second attempt waits (a
            // transaction of its own, so another `xact_start`): the first
            // attempt timed out behind it.
            wait_until_attempt_waits(&reader, migrator_pid, 2).await;
            long_tx.commit().await.unwrap();
        }
    );
    let done = done.unwrap();
    assert!(done.attempts >= 2, "{done:?}");
    reader
        .query("SELECT note FROM ddl_queue", &[])
        .await
        .unwrap();
}

/// The control: a plain `ALTER TABLE` behind the long reader blocks a new
/// reader for as long as the long reader holds its lock.
#[tokio::test(flavor = "multi_thread")]
async fn control_plain_ddl_stalls_every_later_reader() {
    let db = TestServer::shared();
    let _log = db.guard();
    let setup = db.connect().await;
    setup
        .batch_execute("DROP TABLE IF EXISTS ddl_stall; CREATE TABLE ddl_stall (id int)")
        .await
        .unwrap();
    let mut long = db.connect().await;
    let alter = db.connect().await;
    let reader = db.connect().await;
    let observer = db.connect().await;
    let (alter_pid, reader_pid) = (backend_pid(&alter).await, backend_pid(&reader).await);

    let long_tx = long.transaction().await.unwrap();
    long_tx.query("SELECT * FROM ddl_stall", &[]).await.unwrap();
    let alter_call = alter.batch_execute("ALTER TABLE ddl_stall ADD COLUMN note text");
    let read_call = reader.query("SELECT * FROM ddl_stall", &[]);
    tokio::pin!(alter_call, read_call);
    tokio::select! {
        _ = &mut alter_call => panic!("the ALTER cannot finish while the reader holds"),
        () = wait_until_waiting_for(&observer, alter_pid, Awaited::Relation) => {}
    }
    tokio::select! {
        _ = &mut read_call => panic!("the new reader got past the queued ALTER"),
        () = wait_until_waiting_for(&observer, reader_pid, Awaited::Relation) => {}
    }
    // Still stalled a second later: it waits for the long reader, not for time.
    assert!(tokio::time::timeout(Duration::from_secs(1), &mut read_call)
        .await
        .is_err());
    long_tx.commit().await.unwrap();
    alter_call.await.unwrap();
    read_call.await.unwrap();
}

/// `run_ddl`'s cancel safety: a call dropped while its `COMMIT` is in
/// flight has applied the DDL (the commit is in the WAL). Made
/// deterministic with synchronous replication to a standby that never
/// comes: the `COMMIT` waits (`SyncRep`) after committing locally; the
/// call is dropped there, and the wait is cancelled, which makes the
/// commit visible. The docs claimed "nothing of it is applied" for any
/// dropped call.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_dropped_during_its_commit_may_have_applied_the_ddl() {
    let db = TestServer::builder()
        .setting("synchronous_standby_names", "nobody")
        .setting("synchronous_commit", "local")
        .start();
    let observer = db.connect().await;
    observer
        .batch_execute("CREATE TABLE dropped_commit (id int)")
        .await
        .unwrap();
    let mut client = db.connect().await;
    client
        .batch_execute("SET synchronous_commit = on")
        .await
        .unwrap();
    let pid = backend_pid(&client).await;
    let retry = DdlRetry::default();
    {
        let ddl = run_ddl(
            &mut client,
            "ALTER TABLE dropped_commit ADD COLUMN note text",
            &retry,
        );
        tokio::pin!(ddl);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            tokio::select! {
                done = &mut ddl => panic!("the COMMIT did not wait: {done:?}"),
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            let waiting: bool = observer
                .query_one(
                    "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            if waiting {
                break;
            }
            assert!(Instant::now() < deadline, "the COMMIT never waited");
        }
        // Dropped here, mid-COMMIT.
    }
    observer
        .execute("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap();
    // The cancelled backend leaves its SyncRep wait and ends the
    // transaction, already in the WAL, as committed; until it has, the
    // column is not visible yet. Polled until it is (or 30 s: a hang, not
    // a timing claim).
    let deadline = Instant::now() + Duration::from_secs(30);
    let applied = loop {
        let applied: bool = observer
            .query_one(
                "SELECT count(*) > 0 FROM information_schema.columns \
                 WHERE table_name = 'dropped_commit' AND column_name = 'note'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if applied || Instant::now() >= deadline {
            break applied;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Before the docs were fixed this asserted `!applied` and failed: the
    // DDL was applied although the call never returned. Nothing can undo a
    // COMMIT already sent; the docs now say so.
    assert!(
        applied,
        "the COMMIT was in the WAL before the call was dropped"
    );
}
