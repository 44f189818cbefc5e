//! What another session sees in `pg_locks`: the observer's questions that
//! every test binary asks, from a tokio-postgres connection of its own (a
//! session, and a driver, apart from the one under test).

use std::time::{Duration, Instant};

use lockkit::LockKey;
use tokio_postgres::{Client, SimpleQueryMessage};

/// The first column of the first row `sql` answers, sent in one
/// simple-protocol query: one round trip, which a transaction-mode pooler
/// runs on one backend (a prepared statement is two, which it may send to
/// two backends).
///
/// # Errors
///
/// The query's error.
pub async fn simple_value(
    client: &Client,
    sql: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .simple_query(sql)
        .await?
        .iter()
        .find_map(|message| match message {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        }))
}

/// How many sessions other than `observer`'s hold `key` granted.
pub async fn holders_elsewhere(observer: &Client, key: LockKey) -> i64 {
    let id = key.to_pg_locks();
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid <> pg_backend_pid()",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Whether a session other than `observer`'s holds `key` granted.
pub async fn granted_elsewhere(observer: &Client, key: LockKey) -> bool {
    holders_elsewhere(observer, key).await > 0
}

/// Waits until no other session holds `key`: for releases the server does
/// asynchronously to the test (a session that ends, a queued rollback).
/// The 30 s deadline guards a hang and is no timing claim.
pub async fn released(observer: &Client, key: LockKey) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if !granted_elsewhere(observer, key).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Whether backend `pid` holds `key` (granted, in any mode).
pub async fn held_by(observer: &Client, pid: i32, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    let n: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid = $4",
            &[&id.classid, &id.objid, &id.objsubid, &pid],
        )
        .await
        .expect("pg_locks")
        .get(0);
    n > 0
}

/// The advisory-lock rows (granted or waiting) of backend `pid`.
pub async fn advisory_rows(observer: &Client, pid: i32) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
            &[&pid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// The kind of lock a backend is seen waiting for in `pg_locks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// An advisory lock.
    Advisory,
    /// A table lock (DDL behind a reader, a reader behind DDL).
    Relation,
    /// A lock of any kind.
    Any,
}

impl Awaited {
    fn locktype(self) -> Option<&'static str> {
        match self {
            Awaited::Advisory => Some("advisory"),
            Awaited::Relation => Some("relation"),
            Awaited::Any => None,
        }
    }
}

/// Whether backend `pid` waits for an advisory lock.
pub async fn waiting(observer: &Client, pid: i32) -> bool {
    waiting_for(observer, pid, Awaited::Advisory).await
}

/// Whether backend `pid` waits for a lock of the kind `what`.
pub async fn waiting_for(observer: &Client, pid: i32, what: Awaited) -> bool {
    observer
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted AND pid = $1 \
             AND ($2::text IS NULL OR locktype = $2))",
            &[&pid, &what.locktype()],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Waits (up to 30 s, else panics) until backend `pid` waits for an
/// advisory lock: the event a test synchronizes on instead of a sleep.
pub async fn wait_until_waiting(observer: &Client, pid: i32) {
    wait_until_waiting_for(observer, pid, Awaited::Advisory).await
}

/// Waits (up to 30 s, else panics) until backend `pid` waits for a lock of
/// the kind `what`. The deadline guards a hang and is no timing claim.
pub async fn wait_until_waiting_for(observer: &Client, pid: i32, what: Awaited) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !waiting_for(observer, pid, what).await {
        assert!(
            Instant::now() < deadline,
            "backend {pid} never waited ({what:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 30 s, else panics) until backend `pid` waits for no
/// advisory lock: a cancelled or given-up lock statement, seen on the
/// server. The deadline guards a hang and is no timing claim.
pub async fn wait_until_not_waiting(observer: &Client, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting(observer, pid).await {
        assert!(Instant::now() < deadline, "backend {pid} still waits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 60 s, else panics, naming `label`) until none of backends
/// `pids` is in `pg_stat_activity`: a session that ends (closed,
/// terminated) does so asynchronously to the test. The deadline guards a
/// hang and is no timing claim.
pub async fn wait_until_gone(observer: &Client, pids: &[i32], label: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let alive: Vec<i32> = observer
            .query(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&pids],
            )
            .await
            .expect("pg_stat_activity")
            .iter()
            .map(|row| row.get(0))
            .collect();
        if alive.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{label}: backends {alive:?} still open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 60 s, else panics, naming `what`) until `sql`, a query of
/// one boolean (over `pg_stat_activity`, say), answers true: an event seen
/// on the server. The deadline guards a hang and is no timing claim.
pub async fn wait_until_true(observer: &Client, sql: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: bool = observer
            .query_one(sql, &[])
            .await
            .expect("the observer's query")
            .get(0);
        if seen {
            return;
        }
        assert!(Instant::now() < deadline, "never seen: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 30 s, else panics) until backend `pid` has finished its
/// statement and waits for the next one inside its transaction
/// (`pg_stat_activity.state` is `idle in transaction`, which the backend
/// reports once the statement's reply is sent). Seen granted in
/// `pg_locks`, a lock statement may still be running. The deadline guards
/// a hang and is no timing claim.
pub async fn wait_until_idle_in_transaction(observer: &Client, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state: Option<String> = observer
            .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .expect("pg_stat_activity")
            .get(0);
        if state.as_deref() == Some("idle in transaction") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never went idle in its transaction (state {state:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 60 s, else panics) until backend `pid`'s last statement
/// is a session lock's keepalive (`SELECT 1`, with or without its comment
/// naming fencing tokens): the event after which `pg_stat_activity`
/// shows what the keepalive says. The deadline guards a hang and is no
/// timing claim.
pub async fn wait_until_keepalive_ran(observer: &Client, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let query: Option<String> = observer
            .query_one("SELECT query FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .expect("pg_stat_activity")
            .get(0);
        if query.as_deref().is_some_and(|q| q.starts_with("SELECT 1")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no keepalive ran on backend {pid} (last statement {query:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether some session waits for advisory lock `key`.
pub async fn key_waited(observer: &Client, key: LockKey) -> bool {
    let id = key.to_pg_locks();
    observer
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
             AND NOT granted AND classid = $1 AND objid = $2 AND objsubid = $3)",
            &[&id.classid, &id.objid, &id.objsubid],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Waits (up to 30 s, else panics) until some backend waits for advisory
/// lock `key` (a waiter whose backend the test does not know). The
/// deadline guards a hang and is no timing claim.
pub async fn wait_until_key_waited(observer: &Client, key: LockKey) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !key_waited(observer, key).await {
        assert!(Instant::now() < deadline, "nobody ever waited for {key}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 30 s) until no session waits for advisory lock `key`;
/// after 30 s, an error that says how many still do. The deadline guards a
/// hang and is no timing claim: a wait that nothing ends lasts until the
/// key's holder lets go.
pub async fn until_key_not_waited(observer: &Client, key: LockKey) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while key_waited(observer, key).await {
        if Instant::now() >= deadline {
            let id = key.to_pg_locks();
            let waiters: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                     AND NOT granted AND classid = $1 AND objid = $2 AND objsubid = $3",
                    &[&id.classid, &id.objid, &id.objsubid],
                )
                .await
                .expect("pg_locks")
                .get(0);
            return Err(format!(
                "{waiters} sessions still wait for {key} after 30 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Whether `client`'s session is outside a transaction block, asked in one
/// simple-protocol query (whose statement starts its own transaction, so
/// `now()` equals `statement_timestamp()`); the server's error when it
/// fails. No bound: the caller bounds the wait where it may not come.
pub async fn outside_a_transaction(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let messages = client
        .simple_query("SELECT now() = statement_timestamp()")
        .await?;
    Ok(messages.iter().any(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0) == Some("t"),
        _ => false,
    }))
}
