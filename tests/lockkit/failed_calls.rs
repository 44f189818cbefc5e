//! Lock calls that fail, each as a reported defect reproduced on a real
//! server first: one deadline bounds a whole mixed batch; the session's own
//! timeouts are timeouts and a cancel is a cancel; `retry` runs in spawned
//! tasks around a real deadlock; no part of `GIVE_UP` that a cancel can
//! stop leaves the session outside a transaction; a savepoint that a lock
//! error aborted rolls back at its commit. (The dropped lock future is in
//! `poison.rs`; statement-name clashes behind a pooler are in
//! `statement_clashes.rs`.)

use std::time::{Duration, Instant};

use lockkit::{AdvisoryKey, Batch, Config, ErrorKind, LockKey, Transient};
use lockkit_tests::TestServer;
use tokio_postgres::{Client, NoTls};

use crate::common::{backend_pid, held_by, locker, wait_until_waiting};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.failed-calls")]
struct Item {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.failed-calls.seat", pair)]
struct Seat {
    row: i32,
}

fn bigint(key: LockKey) -> i64 {
    match key {
        LockKey::BigInt(k) => k,
        LockKey::Pair(..) => unreachable!("a BigInt key"),
    }
}

/// `lock_batch_timeout` on a batch with one `BigInt` and one
/// `Pair` key gave each key space's statement the whole timeout `T`. The
/// call is seen waiting for the `BigInt` key at `W` (after its timeouts were
/// set, so its deadline is at most `W + T`); the `BigInt` key is released at
/// `W + 0.6 s`, the `Pair` key at `W + T + 0.3 s`. Per-statement timeouts
/// would get both: the second statement waits from `W + 0.6 s` with its own
/// `T`. One deadline for the call times out. Load only delays the releases,
/// which can only make the call time out: the claim holds in the direction
/// load cannot break.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_bounds_the_whole_mixed_batch() {
    const T: Duration = Duration::from_secs(2);
    let db = TestServer::shared();
    let _log = db.guard();
    let mut holder_big = db.connect().await;
    let mut holder_pair = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&b, Config::default()).await;
    let (item, seat) = (Item { id: 1 }, Seat { row: 2 });

    let hb = locker.begin(&mut holder_big).await.unwrap();
    let _ = hb.lock(item).await.unwrap();
    let hp = locker.begin(&mut holder_pair).await.unwrap();
    let _ = hp.lock(seat).await.unwrap();

    let tx = locker.begin(&mut b).await.unwrap();
    let batch = Batch::new().with(&item).with(&seat);
    let started = Instant::now();
    let (result, ()) = tokio::join!(tx.lock_batch_timeout(&batch, T), async {
        wait_until_waiting(&observer, pid).await;
        let seen = Instant::now();
        tokio::time::sleep(Duration::from_millis(600)).await;
        hb.rollback().await.unwrap();
        tokio::time::sleep((T + Duration::from_millis(300)).saturating_sub(seen.elapsed())).await;
        hp.rollback().await.unwrap();
    });
    let err = result.expect_err("the whole batch is bounded by one timeout");
    assert!(err.is_timeout(), "{err}");
    println!(
        "mixed batch timed out after {:?} (timeout {T:?})",
        started.elapsed()
    );
    // Nothing of the batch is held, and the transaction goes on.
    assert!(!held_by(&observer, pid, item.lock_key()).await);
    assert!(!tx.holds(&item, lockkit::Mode::Exclusive));
    let _ = tx.lock(item).await.unwrap();
    tx.rollback().await.unwrap();
}

/// The session's own `lock_timeout`/`statement_timeout` firing
/// during `lock()` are timeouts (and transient, for lockkit's error and the
/// driver's alike), and an administrator's cancel during a timed lock is a
/// cancel, not a timeout.
#[tokio::test(flavor = "multi_thread")]
async fn the_sessions_own_timeouts_are_timeouts_and_a_cancel_is_a_cancel() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut holder = db.connect().await;
    let mut b = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&b).await;
    let locker = locker(&b, Config::default()).await;
    let key = Item { id: 30 };
    let h = locker.begin(&mut holder).await.unwrap();
    let _ = h.lock(key).await.unwrap();

    for setting in ["lock_timeout", "statement_timeout"] {
        let tx = locker.begin(&mut b).await.unwrap();
        tx.batch_execute(&format!("SET LOCAL {setting} = '100ms'"))
            .await
            .unwrap();
        let err = tx.lock(key).await.unwrap_err();
        assert!(err.is_timeout(), "{setting}: {err}");
        assert!(err.is_transient(), "{setting}");
        assert_eq!(err.timeout(), None, "not a lockkit timeout");
        tx.rollback().await.unwrap();

        // The driver's error of the same statement agrees.
        let raw = b.transaction().await.unwrap();
        raw.batch_execute(&format!("SET LOCAL {setting} = '100ms'"))
            .await
            .unwrap();
        let e = raw
            .execute(
                "SELECT pg_advisory_xact_lock($1)",
                &[&bigint(key.lock_key())],
            )
            .await
            .unwrap_err();
        assert!(Transient::is_transient(&e), "{setting}: {e}");
        raw.rollback().await.unwrap();
    }

    // pg_cancel_backend during a 10 s timed lock: a cancel.
    let tx = locker.begin(&mut b).await.unwrap();
    let started = Instant::now();
    let (result, ()) = tokio::join!(tx.lock_timeout(key, Duration::from_secs(10)), async {
        wait_until_waiting(&observer, pid).await;
        observer
            .execute("SELECT pg_cancel_backend($1)", &[&pid])
            .await
            .unwrap();
    });
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
    assert!(!err.is_timeout() && !err.is_transient());
    assert!(started.elapsed() < Duration::from_secs(10));
    // The savepoint rollback left the transaction usable.
    tx.query_one("SELECT 1", &[]).await.unwrap();
    tx.rollback().await.unwrap();
    h.rollback().await.unwrap();
}

/// `retry` runs in a spawned task (its future is `Send`), here
/// around a real deadlock between two tasks.
#[tokio::test(flavor = "multi_thread")]
async fn retry_runs_in_spawned_tasks() {
    let db = TestServer::builder()
        .setting("deadlock_timeout", "10ms")
        .start();
    let _log = db.guard();
    let locker = locker(
        &db.connect().await,
        Config::default().order_check(lockkit::OrderCheck::Off),
    )
    .await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let mut tasks = Vec::new();
    for (first, second) in [(1, 2), (2, 1)] {
        let (locker, config, barrier) = (locker.clone(), db.config(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let policy = lockkit::RetryPolicy::default()
                .max_attempts(20)
                .delays(Duration::from_millis(5), Duration::from_millis(50));
            lockkit::retry(&policy, |attempt| {
                let (locker, config, barrier) = (locker.clone(), config.clone(), barrier.clone());
                async move {
                    let mut client = connect(&config).await;
                    let tx = locker.begin(&mut client).await?;
                    let _ = tx.lock(Item { id: 40 + first }).await?;
                    if attempt == 1 {
                        barrier.wait().await;
                    }
                    let _ = tx.lock(Item { id: 40 + second }).await?;
                    tx.commit().await?;
                    Ok::<_, lockkit::Error>(attempt)
                }
            })
            .await
        }));
    }
    let mut attempts = Vec::new();
    for t in tasks {
        attempts.push(t.await.unwrap().unwrap());
    }
    attempts.sort();
    assert_eq!(attempts[0], 1, "the winner needs one attempt");
    assert!(
        attempts[1] > 1,
        "the deadlock victim was retried: {attempts:?}"
    );
}

async fn connect(config: &tokio_postgres::Config) -> Client {
    let (client, conn) = config.connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// `engine::sql::GIVE_UP`'s statements, split where the simple query
/// protocol runs one after another (at the semicolons outside its
/// dollar-quoted `DO` body).
fn statements_of(query: &str) -> Vec<&str> {
    let (mut out, mut start, mut quoted) = (Vec::new(), 0, false);
    for (at, c) in query.char_indices() {
        if query[at..].starts_with("$lockkit$") {
            quoted = !quoted;
        }
        if c == ';' && !quoted {
            out.push(query[start..at].trim());
            start = at + 1;
        }
    }
    out.push(query[start..].trim());
    out
}

/// A write after a cut-off lock call ran outside any transaction (seen in
/// diesel-async's `a_lock_call_dropped_after_its_grant_…`). The adapter queues `GIVE_UP` (roll back, begin, fail)
/// behind the cut-off call, and the call's cancel request may land at any
/// point of it: between the `ROLLBACK` and the `BEGIN`, the server stops
/// the query there (a cancel is checked before each statement of a simple
/// query), and the session is left outside any transaction, where the
/// application's next statement commits at once.
///
/// A cancel landing before statement `i` ends the query after the `i`
/// statements before it, so each such prefix must leave the session in a
/// transaction block that no later statement escapes: a write after it
/// never lands, and the lock the transaction held is released (from the
/// first statement on). Inside a savepoint too. The control runs the
/// former text, `ROLLBACK; BEGIN; DO …`, whose first statement alone lets
/// the write land.
#[tokio::test(flavor = "multi_thread")]
async fn no_prefix_of_give_up_leaves_the_session_outside_a_transaction() {
    const FORMER: &str =
        "ROLLBACK; BEGIN; DO $lockkit$ BEGIN RAISE EXCEPTION 'gave up'; END $lockkit$";
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let table = lockkit_tests::scratch_table(&observer, "lockkit_give_up").await;
    let client = db.connect().await;
    let pid = backend_pid(&client).await;
    // Whether the write after the first `n` statements of `query` landed,
    // and whether the lock was released by them.
    let run = async |query: &str, n: usize, savepoint: bool, id: i64| -> (bool, bool) {
        let key = Item { id }.lock_key();
        let k = bigint(key);
        let savepoint = if savepoint { "SAVEPOINT sp;" } else { "" };
        client
            .batch_execute(&format!(
                "BEGIN; {savepoint} SELECT pg_advisory_xact_lock({k})"
            ))
            .await
            .unwrap();
        assert!(held_by(&observer, pid, key).await);
        let prefix = statements_of(query)[..n].join("; ");
        let _ = client.batch_execute(&prefix).await;
        let released = !held_by(&observer, pid, key).await;
        let _ = client
            .batch_execute(&format!("INSERT INTO {table} VALUES ({id})"))
            .await;
        let _ = client.batch_execute("ROLLBACK").await;
        let landed: i64 = observer
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE id = {id}"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (landed > 0, released)
    };

    let statements = statements_of(lockkit::driver::sql::GIVE_UP);
    assert!(statements.len() >= 2, "{statements:?}");
    let mut id = 5000;
    for savepoint in [false, true] {
        for n in 1..=statements.len() {
            id += 1;
            let (landed, released) = run(lockkit::driver::sql::GIVE_UP, n, savepoint, id).await;
            assert!(
                !landed,
                "after {:?} (savepoint: {savepoint}), a write ran outside any transaction",
                &statements[..n]
            );
            assert!(
                released,
                "after {:?} (savepoint: {savepoint}), the lock is still held",
                &statements[..n]
            );
        }
    }
    // The control: the former text's ROLLBACK alone lets the write land.
    assert_eq!(statements_of(FORMER).len(), 3);
    let (landed, released) = run(FORMER, 1, false, 5100).await;
    assert!(
        landed && released,
        "control: the write after a lone ROLLBACK did not land; the test above proves nothing"
    );
}

/// A commit after a lock call's error aborted the transaction was
/// reported as a success: PostgreSQL answers `COMMIT` there by rolling
/// back, and tokio-postgres reads no error. Now the commit rolls back and
/// fails with `TransactionAborted` (the top level is in the conformance
/// suite, `commit_after_an_aborting_error`). Here the abort is inside a
/// savepoint: its commit rolls it back and says so, and the transaction
/// goes on: its commit keeps the writes made outside the savepoint, and the
/// write inside it is gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_savepoint_a_lock_error_aborted_rolls_back_at_its_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let table = lockkit_tests::scratch_table(&observer, "lockkit_sp_aborted").await;
    let mut holder = db.connect().await;
    let busy = Item { id: 60 };
    let held = holder.transaction().await.unwrap();
    held.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&bigint(busy.lock_key())],
    )
    .await
    .unwrap();
    let mut client = db.connect().await;
    // The session's own bound: the lock statement fails, and the error
    // aborts the savepoint it runs in.
    client
        .batch_execute("SET lock_timeout = '50ms'")
        .await
        .unwrap();
    let locker = locker(&client, Config::default()).await;
    let insert = format!("INSERT INTO {table} VALUES ($1)");
    let mut tx = locker.begin(&mut client).await.unwrap();
    tx.execute(&insert, &[&1_i64]).await.unwrap();
    let sp = tx.savepoint().await.unwrap();
    sp.execute(&insert, &[&2_i64]).await.unwrap();
    let err = sp.lock(busy).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let err = sp.commit().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
    tx.execute(&insert, &[&3_i64]).await.unwrap();
    tx.commit().await.unwrap();
    held.rollback().await.unwrap();
    let ids: Vec<i64> = observer
        .query(&format!("SELECT id FROM {table} ORDER BY id"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(ids, [1, 3]);
    observer
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
