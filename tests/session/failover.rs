//! Fencing tokens and session locks across a crash of the server and
//! across a failover to a streaming standby: every token minted afterwards
//! is larger than every token minted before, the ones the standby never
//! received included; the guards held on the old primary resolve `lost()`;
//! a transaction-scoped lock call on the dead primary fails as a lost
//! connection, and its transaction's commit is refused; and a
//! `SessionLock` of a multi-host configuration takes its next lock on the
//! new primary. The controls: after the promotion, the counter and
//! the flushed WAL position alone are both behind what the old primary
//! handed out, so only the timeline keeps the order.

use std::time::Duration;

use lockkit::fencing::FencingToken;
use lockkit::pg::SessionGuard;
use lockkit::SessionLock;
use lockkit_tests::fixtures::Feed;
use lockkit_tests::{StopMode, TestServer};
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::Client;

/// The bound on a wait of these tests: it guards a hang, not a timing.
const PATIENT: Duration = Duration::from_secs(60);

async fn install(db: &TestServer) -> Client {
    let client = db.connect().await;
    lockkit::sql::install(&client).await.expect("install");
    client
}

/// Takes `id`'s key through `sessions`, waiting at most [`PATIENT`].
async fn take(sessions: &SessionLock, id: i64) -> SessionGuard<Feed> {
    tokio::time::timeout(PATIENT, sessions.lock(Feed { id }))
        .await
        .unwrap_or_else(|_| panic!("{id} was not granted"))
        .unwrap_or_else(|e| panic!("{id}: {e}"))
}

/// Takes and releases the keys `ids`, answering their tokens.
async fn grants(sessions: &SessionLock, ids: std::ops::Range<i64>) -> Vec<FencingToken> {
    let mut tokens = Vec::new();
    for id in ids {
        let guard = take(sessions, id).await;
        tokens.push(guard.fencing_token().expect("minted"));
        assert!(guard.release().await.unwrap());
    }
    tokens
}

/// A crash (immediate stop, then crash recovery) loses the WAL the server
/// had not written yet, and with it possibly the counter's last values;
/// every token minted after it is still larger than every token before,
/// and the locks held through it are lost.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_grow_across_a_crash_of_the_server() {
    // Committed work survives the crash (the install script's, above all):
    // the harness's default `synchronous_commit=off` could lose it.
    let db = TestServer::builder()
        .setting("synchronous_commit", "on")
        .start();
    let _log = db.guard();
    install(&db).await;
    let sessions = SessionLock::new(db.config()).fencing_tokens(true);
    let mut before = grants(&sessions, 0..100).await;
    let mut held = Vec::new();
    for id in 100..104 {
        let guard = take(&sessions, id).await;
        before.push(guard.fencing_token().expect("minted"));
        held.push(guard);
    }
    db.restart_with(StopMode::Immediate);
    for guard in &held {
        tokio::time::timeout(PATIENT, guard.lost())
            .await
            .expect("a lock held through the crash is lost");
    }
    let newest = *before.iter().max().unwrap();
    let after = grants(&sessions, 0..104).await;
    for token in &after {
        assert!(
            *token > newest,
            "{token} after the crash, {newest} before it"
        );
    }
    eprintln!(
        "crash: newest before {newest} (counter {}), first after {} (counter {})",
        newest.counter(),
        after[0],
        after[0].counter()
    );
}

/// Holds until `standby` has replayed everything `primary` wrote so far.
async fn caught_up(primary: &Client, standby: &Client) {
    let target: String = primary
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let started = std::time::Instant::now();
    loop {
        let done: bool = standby
            .query_one(
                "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                &[&target],
            )
            .await
            .unwrap()
            .get(0);
        if done {
            return;
        }
        assert!(started.elapsed() < PATIENT, "the standby did not catch up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The failover, reproduced: a streaming standby (`pg_basebackup`); its
/// replication cut; grants on the primary it never receives (more than the
/// 32 values a sequence logs ahead, and a few megabytes of other WAL); the
/// primary killed with locks held; the standby promoted.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_and_session_locks_across_a_promotion() {
    let primary = TestServer::builder().start();
    let _log = primary.guard();
    let on_primary = install(&primary).await;
    let standby = primary.standby();
    let _standby_log = standby.guard();
    let on_standby = standby.connect().await;

    // Both servers, the writable one wanted.
    let mut config = primary.config();
    let standby_config = standby.config();
    config
        .host("127.0.0.1")
        .port(standby_config.get_ports()[0])
        .target_session_attrs(TargetSessionAttrs::ReadWrite);
    let sessions = SessionLock::new(config).fencing_tokens(true);

    let mut old = grants(&sessions, 0..20).await;
    caught_up(&on_primary, &on_standby).await;

    // Replication cut: the standby's WAL receiver stops for good.
    for sql in [
        "ALTER SYSTEM SET primary_conninfo = ''",
        "SELECT pg_reload_conf()",
    ] {
        on_standby.batch_execute(sql).await.unwrap();
    }
    let started = std::time::Instant::now();
    loop {
        let receivers: i64 = on_standby
            .query_one("SELECT count(*) FROM pg_stat_wal_receiver", &[])
            .await
            .unwrap()
            .get(0);
        if receivers == 0 {
            break;
        }
        assert!(started.elapsed() < PATIENT, "the WAL receiver did not stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replayed: String = on_standby
        .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);

    // Grants the standby never receives, then more WAL, and locks held.
    old.extend(grants(&sessions, 20..120).await);
    on_primary
        .batch_execute("CREATE TABLE filler AS SELECT g FROM generate_series(1, 100000) AS g")
        .await
        .unwrap();
    let mut held = Vec::new();
    for id in 120..124 {
        let guard = take(&sessions, id).await;
        old.push(guard.fencing_token().expect("minted"));
        held.push(guard);
    }
    // And a transaction-scoped lock, in a transaction left open.
    let config = lockkit::Config::default()
        .fencing_tokens(true)
        .order_check(lockkit::OrderCheck::Off);
    let locker = lockkit::Locker::new(&primary.connect().await, config)
        .await
        .expect("locker");
    let mut tx_client = lockkit::LockClient::new(&locker, primary.connect().await);
    let tx = tx_client.begin().await.expect("begin");
    let xact = tx.lock(Feed { id: 130 }).await.expect("lock");
    old.push(xact.fencing_token().expect("minted"));
    drop(xact);
    let unreplicated: bool = on_primary
        .query_one(
            "SELECT pg_current_wal_flush_lsn() > $1::text::pg_lsn",
            &[&replayed],
        )
        .await
        .unwrap()
        .get(0);
    assert!(unreplicated, "the last grants reached the standby");

    // The primary dies; its locks are gone, and their guards say so.
    primary.stop_with(StopMode::Immediate);
    for guard in &held {
        tokio::time::timeout(PATIENT, guard.lost())
            .await
            .expect("a lock held on the dead primary is lost");
    }
    // The open transaction's next lock call fails as a lost connection, and
    // its commit is refused: never a success on a server that is gone.
    let next = tokio::time::timeout(PATIENT, tx.lock(Feed { id: 131 }))
        .await
        .expect("the lock call returns");
    let e = next.expect_err("a lock granted by a dead primary");
    assert!(e.is_connection_lost(), "{e}");
    // The commit is refused: a lock call's error aborted the transaction
    // (its rollback fails too, on no connection).
    let e = tokio::time::timeout(PATIENT, tx.commit())
        .await
        .expect("the commit returns")
        .expect_err("a commit on a dead primary");
    assert_eq!(e.kind(), lockkit::ErrorKind::TransactionAborted, "{e}");
    standby.promote().await;

    // The same SessionLock takes its next locks on the new primary, with
    // tokens above every token of the old one.
    let newest = *old.iter().max().unwrap();
    let new = grants(&sessions, 0..124).await;
    let guard = take(&sessions, 124).await;
    let pid: i32 = on_standby
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let holder: i32 = on_standby
        .query_one(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid <> $1",
            &[&pid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        holder,
        guard.backend_pid(),
        "the lock is not on the new primary"
    );
    assert!(guard.release().await.unwrap());
    for token in &new {
        assert!(
            *token > newest,
            "{token} on the new primary, {newest} on the old one"
        );
        assert!(token.timeline() > newest.timeline());
    }
    // The controls: without the timeline, the new primary's tokens would
    // not all be larger.
    let (old_counter, old_flush) = (
        old.iter().map(|t| t.counter()).max().unwrap(),
        old.iter().map(|t| t.flush()).max().unwrap(),
    );
    assert!(
        new[0].counter() < old_counter,
        "the counter did not go back: {} after {old_counter}",
        new[0].counter()
    );
    assert!(
        new[0].flush() < old_flush,
        "the flushed WAL did not go back: {:X} after {old_flush:X}",
        new[0].flush()
    );
    eprintln!(
        "promotion: newest on the old primary {newest}, first on the new one {}",
        new[0]
    );
}
