//! The multiplexed session-lock form ([`SessionForm::Multiplexed`]) in the
//! setups the default form is tested in: over TLS (`with_tls`, every
//! multiplexed backend on SSL in `pg_stat_ssl`), on connections leased from
//! a deadpool pool (none goes back to it, in a transaction or at all), on a
//! hot standby (refused unless allowed), what an operator sees of its
//! backends (`idle in transaction`, `MULTIPLEXED_NAME`, no `backend_xid`,
//! no `backend_xmin` once quiet), `HashText` keys (the server's
//! `hashtext`), and the keepalive against the server's
//! `idle_in_transaction_session_timeout`.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures_util::{FutureExt, StreamExt};
use lockkit::key::HashText;
use lockkit::pg::{SessionForm, SessionGuard, MULTIPLEXED_NAME};
use lockkit::{AdvisoryKey, LockKey, Mode, SessionLock};
use lockkit_tests::observe::{
    held_by, key_waited, wait_until_gone, wait_until_idle_in_transaction,
};
use lockkit_tests::support::assert_standby;
use lockkit_tests::waits::wait_until_awaited;
use lockkit_tests::TestServer;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::pooler::{activity, pool_of};
use crate::tls::{observer, tls_server};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[advisory_key(namespace = "lockkit-tests/multiplexed-setups")]
struct Setup {
    id: i64,
}

/// The keepalive of the tests that are not about it: long enough that no
/// keepalive runs while a test reads what the server shows, and that a
/// loaded machine's slow answer is not given up as a silent path (the
/// `session_silent` tests are about that bound).
const PATIENT: Duration = Duration::from_secs(60);

/// The bound on a poll for something the server does asynchronously (a
/// closed session ending): it guards a hang and is no timing claim.
const HANG: Duration = Duration::from_secs(60);

fn multiplexed(sessions: SessionLock, connections: usize) -> SessionLock {
    sessions
        .form(SessionForm::Multiplexed)
        .connections(connections)
        .keepalive(PATIENT)
}

/// Takes every key of `ids` with `try_lock`, 64 at a time (more than a
/// connection takes before the next one opens), each expected free.
async fn take_all(
    label: &str,
    sessions: &SessionLock,
    ids: impl Iterator<Item = i64>,
) -> Vec<SessionGuard<Setup>> {
    futures_util::stream::iter(ids)
        .map(|id| sessions.try_lock(Setup { id }))
        .buffer_unordered(64)
        .map(|taken| {
            taken
                .unwrap_or_else(|e| panic!("{label}: try_lock: {e}"))
                .unwrap_or_else(|key| panic!("{label}: {key:?} was busy"))
        })
        .collect()
        .await
}

/// The backends the guards name.
fn pids_of<K>(guards: &[SessionGuard<K>]) -> BTreeSet<i32> {
    guards.iter().map(SessionGuard::backend_pid).collect()
}

/// Granted advisory locks of backends `pids`.
async fn granted_on(observer: &Client, pids: &BTreeSet<i32>) -> i64 {
    let pids: Vec<i32> = pids.iter().copied().collect();
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = ANY($1)",
            &[&pids],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Advisory locks on the server (granted or awaited), in any session: for
/// the tests on a server of their own.
async fn advisory_locks(observer: &Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// Polls until the server has no advisory lock (a closed session and a
/// dropped guard's unlock end asynchronously).
async fn until_no_advisory_lock(observer: &Client, label: &str) {
    let started = Instant::now();
    loop {
        let left = advisory_locks(observer).await;
        if left == 0 {
            return;
        }
        assert!(
            started.elapsed() < HANG,
            "{label}: {left} advisory locks left"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Backends named as multiplexed connections (server-wide).
async fn multiplexed_backends(observer: &Client) -> BTreeSet<i32> {
    observer
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[&MULTIPLEXED_NAME],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

// ---------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------

/// Multiplexed locks through `SessionLock::with_tls` on a TLS-only server,
/// three rounds on one `SessionLock`: 300 keys at once over at most 2
/// backends, each of which `pg_stat_ssl` shows on SSL and `pg_locks` shows
/// holding exactly the guards' keys; a rival over TLS refused; a wait for a
/// held key (its own connection, in the default form, over TLS) timing out,
/// and one cut off while the server has it waiting (its wait ended on the
/// server at its slice), leaving no waiter; then every lock released on its own and none left.
/// The control: the same server refuses the multiplexed form's connection
/// in plain text, so the locks above went over TLS.
#[tokio::test(flavor = "multi_thread")]
async fn multiplexed_locks_over_tls() {
    const CONNECTIONS: usize = 2;
    let (db, tls) = tls_server();
    let _log = db.guard();
    let observer = observer(&db).await;
    let mut config = db.config();
    config.ssl_mode(SslMode::Require);
    let sessions = multiplexed(
        SessionLock::with_tls(config.clone(), tls.clone()),
        CONNECTIONS,
    );
    let rival = multiplexed(SessionLock::with_tls(config.clone(), tls.clone()), 1);

    for round in 0..3_i64 {
        let label = format!("round {round}");
        let guards = take_all(&label, &sessions, round * 1000..round * 1000 + 300).await;
        let pids = pids_of(&guards);
        assert!(pids.len() <= CONNECTIONS, "{label}: {pids:?}");
        for &pid in &pids {
            let ssl: bool = observer
                .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
                .await
                .unwrap()
                .get(0);
            assert!(ssl, "{label}: backend {pid} is not on SSL");
        }
        assert!(
            guards.iter().all(|g| g.form() == SessionForm::Multiplexed),
            "{label}"
        );
        assert_eq!(granted_on(&observer, &pids).await, 300, "{label}");
        for guard in guards.iter().step_by(29) {
            assert!(
                held_by(&observer, guard.backend_pid(), guard.key()).await,
                "{label}: {:?}",
                guard.value()
            );
            assert!(
                rival.try_lock(*guard.value()).await.unwrap().is_err(),
                "{label}: the rival got {:?}",
                guard.value()
            );
        }

        // A wait for a held key takes a TLS connection of its own.
        let key = *guards[0].value();
        let err = sessions
            .lock_timeout(key, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{label}: {err}");
        {
            let wait = sessions.lock(key);
            tokio::pin!(wait);
            tokio::select! {
                got = &mut wait => panic!("{label}: granted while held: {:?}", got.map(|g| g.key())),
                pid = wait_until_awaited(&observer, key.lock_key()) => {
                    let ssl: bool = observer
                        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
                        .await
                        .unwrap()
                        .get(0);
                    assert!(ssl, "{label}: the waiting backend {pid} is not on SSL");
                }
            }
        }
        // Cut off: nobody waits for the key any more, and its holder holds it.
        let started = Instant::now();
        while key_waited(&observer, key.lock_key()).await {
            assert!(started.elapsed() < HANG, "{label}: the cut-off wait stayed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(held_by(&observer, guards[0].backend_pid(), key.lock_key()).await);

        let released: Vec<bool> = futures_util::stream::iter(guards)
            .map(SessionGuard::release)
            .buffer_unordered(64)
            .map(|r| r.expect("release"))
            .collect()
            .await;
        assert!(released.iter().all(|&held| held), "{label}");
        assert_eq!(granted_on(&observer, &pids).await, 0, "{label}");
    }
    drop((sessions, rival));
    until_no_advisory_lock(&observer, "after the TLS rounds").await;

    // The control: plain text is refused (28000, "no encryption").
    let err = multiplexed(SessionLock::new(db.config()), 1)
        .try_lock(Setup { id: 1 })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("28000"), "{err:?}");
}

// ---------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------

/// Whether a pooled connection is clean: not inside a transaction (`now()`
/// is the transaction's start, so it differs from the statement's inside
/// one; and `SAVEPOINT` fails outside one), no advisory lock, and not named
/// as a multiplexed connection. Answers its backend pid.
async fn clean_lease(conn: &Client, label: &str) -> i32 {
    // One simple-protocol query, so one statement: in the extended
    // protocol, `Bind` and `Execute` are messages of their own.
    let row = conn
        .simple_query(
            "SELECT now() = statement_timestamp(), \
             (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
             current_setting('application_name'), pg_backend_pid()",
        )
        .await
        .unwrap()
        .into_iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .expect("a row");
    let column = |i: usize| row.get(i).expect("not null").to_owned();
    assert_eq!(
        column(0),
        "t",
        "{label}: a lease came back in a transaction"
    );
    assert_eq!(column(1), "0", "{label}: a lease came back locked");
    assert_ne!(column(2), MULTIPLEXED_NAME, "{label}");
    assert!(
        conn.batch_execute("SAVEPOINT s").await.is_err(),
        "{label}: the lease is in a transaction"
    );
    column(3).parse().expect("a pid")
}

/// Every connection a pool of `size` can hand out, at once (a lease lost
/// by lockkit, neither returned nor detached, would make this hang: the
/// bound guards that), each clean; answers their backend pids.
async fn every_lease_clean(pool: &Pool, size: usize, label: &str) -> BTreeSet<i32> {
    let mut leases = Vec::new();
    let mut pids = BTreeSet::new();
    for _ in 0..size {
        let conn = tokio::time::timeout(HANG, pool.get())
            .await
            .unwrap_or_else(|_| panic!("{label}: the pool has no connection to give"))
            .unwrap();
        pids.insert(clean_lease(&conn, label).await);
        leases.push(conn);
    }
    pids
}

/// Multiplexed locks on connections leased from a deadpool pool of 4,
/// at most 2 of them multiplexed, four rounds: 200 keys taken at once, held
/// on the multiplexed backends only; a rival refused; a wait for a held
/// key granted after the release on a lease of its own (default form),
/// which goes back to the pool clean; then half released, half dropped,
/// and nothing left. In the last round the `SessionLock` is dropped before
/// its guards. Afterwards: no advisory lock on the server, the multiplexed
/// backends closed (a connection returned to the pool would live on in
/// it), and every connection the pool hands out is outside a transaction,
/// holds nothing and is none of them.
#[tokio::test(flavor = "multi_thread")]
async fn multiplexed_locks_on_a_pool_never_go_back_to_it() {
    const POOL: usize = 4;
    const CONNECTIONS: usize = 2;
    let db = TestServer::builder().start();
    let _log = db.guard();
    let observer = db.connect().await;
    let pool = pool_of(db.config(), POOL);
    // Leases made before: the pool's own connections, seen after too.
    let before = every_lease_clean(&pool, POOL, "before").await;
    let mut sessions = Some(multiplexed(
        SessionLock::from_pool(pool.clone()),
        CONNECTIONS,
    ));
    let rival = multiplexed(SessionLock::new(db.config()), 1);
    let mut multiplexed_pids = BTreeSet::new();

    for round in 0..4_i64 {
        let label = format!("round {round}");
        let lock = sessions.as_ref().expect("kept until the last round");
        let guards = take_all(&label, lock, round * 1000..round * 1000 + 200).await;
        let pids = pids_of(&guards);
        assert!(pids.len() <= CONNECTIONS, "{label}: {pids:?}");
        if round == 0 {
            // Leased from the pool, which had these connections idle.
            assert!(
                pids.is_subset(&before),
                "{label}: {pids:?} are not the pool's connections {before:?}"
            );
        }
        multiplexed_pids.extend(pids.iter().copied());
        assert_eq!(granted_on(&observer, &pids).await, 200, "{label}");
        assert_eq!(advisory_locks(&observer).await, 200, "{label}");
        for guard in guards.iter().step_by(17) {
            assert!(
                rival.try_lock(*guard.value()).await.unwrap().is_err(),
                "{label}: the rival got {:?}",
                guard.value()
            );
        }
        // Named transaction-locally on a lease: the pool's connections too.
        assert!(
            pids.is_subset(&multiplexed_backends(&observer).await),
            "{label}"
        );

        // A wait for a held key: a lease of its own, granted after the
        // release, given back clean.
        let mut guards = guards;
        let first = guards.swap_remove(0);
        let key = *first.value();
        let waiter = {
            let lock = lock.clone();
            tokio::spawn(async move { lock.lock(key).await })
        };
        let waiting_pid = wait_until_awaited(&observer, key.lock_key()).await;
        assert!(!pids.contains(&waiting_pid), "{label}");
        assert!(first.release().await.unwrap(), "{label}");
        let second = tokio::time::timeout(HANG, waiter)
            .await
            .expect("granted after the release")
            .unwrap()
            .unwrap();
        assert_eq!(second.form(), SessionForm::Transaction, "{label}");
        assert_eq!(second.backend_pid(), waiting_pid, "{label}");
        assert!(second.release().await.unwrap(), "{label}");

        if round == 3 {
            // The `SessionLock` goes first; its guards still hold.
            drop(sessions.take());
            assert_eq!(granted_on(&observer, &pids).await, 199, "{label}");
        }
        let (released, dropped): (Vec<_>, Vec<_>) = guards.into_iter().partition(|g| g.id % 2 == 0);
        for guard in released {
            let id = guard.id;
            assert!(guard.release().await.unwrap(), "{label}: {id}");
        }
        drop(dropped);
        until_no_advisory_lock(&observer, &label).await;
    }
    drop(rival);

    // Every connection the pool hands out is clean and none of the
    // multiplexed ones; those were closed, not handed back (a pooled
    // connection lives on in its pool).
    let after = every_lease_clean(&pool, POOL, "after").await;
    assert!(
        after.is_disjoint(&multiplexed_pids),
        "a multiplexed lease came back: {after:?} and {multiplexed_pids:?}"
    );
    let leases: Vec<i32> = multiplexed_pids.iter().copied().collect();
    wait_until_gone(&observer, &leases, "the multiplexed leases").await;
    assert_eq!(advisory_locks(&observer).await, 0);
}

// ---------------------------------------------------------------------------
// Hot standby
// ---------------------------------------------------------------------------

/// On a hot standby, every call of the multiplexed form (try, wait,
/// timeout, shared), opened and pooled, three times (the first opens the
/// multiplexed connection, the next ones find it open), is refused with
/// `HotStandby`, and nothing is locked there. Allowed, the locks are taken
/// on the standby and only there: the primary grants the same keys, and a
/// rival on the standby is refused them. The control: the same refusing
/// `SessionLock`s take the keys on the primary.
#[tokio::test(flavor = "multi_thread")]
async fn multiplexed_locks_are_refused_on_a_hot_standby_unless_allowed() {
    let primary = TestServer::builder().start();
    let _log = primary.guard();
    let standby = primary.standby();
    let _standby_log = standby.guard();
    let on_standby = standby.connect().await;
    let on_primary = primary.connect().await;
    let refusing = [
        ("opened", multiplexed(SessionLock::new(standby.config()), 2)),
        (
            "pooled",
            multiplexed(SessionLock::from_pool(pool_of(standby.config(), 3)), 2),
        ),
    ];
    for (name, sessions) in &refusing {
        for round in 0..3 {
            let what = |call: &str| format!("{name}, round {round}: {call}");
            let k = Setup { id: round };
            assert_standby(sessions.try_lock(k).await, &what("try_lock"));
            assert_standby(sessions.try_lock_shared(k).await, &what("try_lock_shared"));
            assert_standby(sessions.lock(k).await, &what("lock"));
            assert_standby(sessions.lock_shared(k).await, &what("lock_shared"));
            assert_standby(
                sessions.lock_timeout(k, Duration::from_secs(1)).await,
                &what("lock_timeout"),
            );
            assert_standby(
                sessions
                    .lock_shared_timeout(k, Duration::from_secs(1))
                    .await,
                &what("lock_shared_timeout"),
            );
        }
    }
    assert_eq!(advisory_locks(&on_standby).await, 0);

    // Allowed: on the standby, and only there.
    for (name, sessions) in [
        ("opened", SessionLock::new(standby.config())),
        (
            "pooled",
            SessionLock::from_pool(pool_of(standby.config(), 3)),
        ),
    ] {
        let sessions = multiplexed(sessions, 2).allow_standby(true);
        let guards = take_all(name, &sessions, 100..140).await;
        assert!(guards.iter().all(|g| g.form() == SessionForm::Multiplexed));
        let pids = pids_of(&guards);
        assert!(pids.len() <= 2, "{name}: {pids:?}");
        assert_eq!(granted_on(&on_standby, &pids).await, 40, "{name}");
        let rival = multiplexed(SessionLock::new(standby.config()), 1).allow_standby(true);
        let primary_side = multiplexed(SessionLock::new(primary.config()), 1);
        for guard in &guards {
            assert!(
                held_by(&on_standby, guard.backend_pid(), guard.key()).await,
                "{name}"
            );
            assert!(
                rival.try_lock(*guard.value()).await.unwrap().is_err(),
                "{name}: the rival on the standby got {:?}",
                guard.value()
            );
            let there = primary_side
                .try_lock(*guard.value())
                .await
                .unwrap()
                .expect("a standby's lock excludes nothing on the primary");
            assert!(there.release().await.unwrap());
        }
        for guard in guards {
            assert!(guard.release().await.unwrap(), "{name}");
        }
        assert_eq!(granted_on(&on_standby, &pids).await, 0, "{name}");
    }

    // The control: refused for the standby, not for the form.
    for (name, sessions) in [
        ("opened", SessionLock::new(primary.config())),
        (
            "pooled",
            SessionLock::from_pool(pool_of(primary.config(), 3)),
        ),
    ] {
        let guard = multiplexed(sessions, 2)
            .try_lock(Setup { id: 0 })
            .await
            .unwrap()
            .expect("free on the primary");
        assert!(guard.release().await.unwrap(), "{name}");
    }
    assert_eq!(advisory_locks(&on_primary).await, 0);
}

// ---------------------------------------------------------------------------
// What an operator sees
// ---------------------------------------------------------------------------

/// The modes of the advisory locks of backend `pid` in `pg_locks`.
async fn modes_on(observer: &Client, pid: i32) -> Vec<String> {
    observer
        .query(
            "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// What [`look_at_backends`] checks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Look {
    /// State, `application_name`, no `backend_xid`, the `pg_locks` modes.
    Operator,
    /// No `backend_xmin`.
    Snapshot,
}

/// Takes 60 exclusive and 10 shared multiplexed locks (keys
/// `base..base + 70`) through `sessions` (given a long keepalive cadence,
/// so that no keepalive runs meanwhile), and looks at each backend holding
/// them once it is idle in its transaction: after the takes, and again
/// after every third lock was released (each release a statement on its
/// connection). Then releases the rest.
async fn look_at_backends(
    name: &str,
    observer: &Client,
    sessions: SessionLock,
    base: i64,
    look: Look,
) {
    let sessions = multiplexed(sessions, 2).keepalive(Duration::from_secs(600));
    let mut guards = take_all(name, &sessions, base..base + 60).await;
    for id in base + 60..base + 70 {
        let shared = sessions
            .try_lock_shared(Setup { id })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(shared.mode(), Mode::Shared);
        guards.push(shared);
    }
    let pids = pids_of(&guards);
    assert!(pids.len() <= 2, "{name}: {pids:?}");
    for stage in ["taken", "after some releases"] {
        for &pid in &pids {
            wait_until_idle_in_transaction(observer, pid).await;
            if look == Look::Snapshot {
                // The last statement's snapshot is dropped once the
                // connection is quiet (100 ms): the event waited for. The
                // deadline guards a hang and is no timing claim.
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                while !activity(observer, pid).await.2 {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{name}, {stage}: multiplexed backend {pid} keeps a backend_xmin \
                         (it holds back VACUUM)"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                continue;
            }
            let (state, app, _, no_xid) = activity(observer, pid).await;
            assert_eq!(state, "idle in transaction", "{name}, {stage}");
            assert_eq!(app, MULTIPLEXED_NAME, "{name}, {stage}");
            assert!(no_xid, "{name}, {stage}: backend {pid} has an xid");
            let mut modes = modes_on(observer, pid).await;
            modes.sort();
            let mut expected: Vec<String> = guards
                .iter()
                .filter(|g| g.backend_pid() == pid)
                .map(|g| match g.mode() {
                    Mode::Exclusive => "ExclusiveLock".to_owned(),
                    Mode::Shared => "ShareLock".to_owned(),
                })
                .collect();
            expected.sort();
            assert_eq!(modes, expected, "{name}, {stage}: backend {pid}");
        }
        let mut kept = Vec::new();
        for (i, guard) in guards.into_iter().enumerate() {
            if i % 3 == 0 {
                assert!(guard.release().await.unwrap(), "{name}");
            } else {
                kept.push(guard);
            }
        }
        guards = kept;
    }
    for guard in guards {
        assert!(guard.release().await.unwrap(), "{name}");
    }
}

/// [`look_at_backends`] on connections opened from `config` (keys from
/// `base`), then leased from a pool of 2 (keys from `base + 1000`).
async fn look_opened_and_pooled(
    observer: &Client,
    config: tokio_postgres::Config,
    base: i64,
    look: Look,
) {
    let pool = pool_of(config.clone(), 2);
    let opened = SessionLock::new(config);
    look_at_backends("opened", observer, opened, base, look).await;
    let pooled = SessionLock::from_pool(pool);
    look_at_backends("pooled", observer, pooled, base + 1000, look).await;
}

/// While multiplexed locks are held, opened and pooled, each backend that
/// holds them is `idle in transaction`, named [`MULTIPLEXED_NAME`], with no
/// `backend_xid`, and `pg_locks` shows the guards' keys on it,
/// `ExclusiveLock` or `ShareLock` by the guards' mode.
#[tokio::test(flavor = "multi_thread")]
async fn what_an_operator_sees_of_multiplexed_backends() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    look_opened_and_pooled(&observer, db.config(), 20_000, Look::Operator).await;
}

/// Multiplexed backends, opened and pooled, hold back no VACUUM: with the
/// role's default isolation serializable (as the default form's
/// `a_held_lock_does_not_hold_back_vacuum` has it), each shows no
/// `backend_xmin` once its connection is quiet, after the takes and after
/// some releases. A prepared statement's portal keeps its snapshot in the
/// held transaction until the next statement (the control below); the
/// form drops it with a simple query once the connection has run none for
/// 100 ms.
#[tokio::test(flavor = "multi_thread")]
async fn multiplexed_backends_hold_no_snapshot() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut config = db.config();
    config.options("-c default_transaction_isolation=serializable");
    look_opened_and_pooled(&observer, config, 23_000, Look::Snapshot).await;
}

/// The controls of the `backend_xmin` check: `pg_stat_activity` shows one
/// for a transaction that keeps a snapshot, here through the extended
/// protocol: after `BEGIN` a `SELECT pg_try_advisory_lock($1)` (a prepared
/// statement, as the multiplexed form sends) leaves its portal, and the
/// portal's snapshot, open until the next statement. A simple-protocol
/// statement after it (as a keepalive) closes it.
#[tokio::test(flavor = "multi_thread")]
async fn control_an_extended_protocol_statement_keeps_its_snapshot_in_a_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let client = db.connect().await;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let LockKey::BigInt(k) = Setup { id: 22_000 }.lock_key() else {
        unreachable!("Setup is a BigInt key")
    };
    client
        .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    let statement = client
        .prepare_typed(
            "SELECT pg_try_advisory_lock($1)",
            &[tokio_postgres::types::Type::INT8],
        )
        .await
        .unwrap();
    let granted: bool = client.query_one(&statement, &[&k]).await.unwrap().get(0);
    assert!(granted);
    wait_until_idle_in_transaction(&observer, pid).await;
    let (_, _, no_xmin, _) = activity(&observer, pid).await;
    assert!(!no_xmin, "the extended-protocol statement kept no snapshot");
    client.batch_execute("SELECT 1").await.unwrap();
    wait_until_idle_in_transaction(&observer, pid).await;
    let (_, _, no_xmin, _) = activity(&observer, pid).await;
    assert!(no_xmin, "a simple query after it did not close its portal");
    client
        .batch_execute("SELECT pg_advisory_unlock_all(); ROLLBACK")
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------
// HashText keys
// ---------------------------------------------------------------------------

/// `HashText` strings: ASCII, 2-, 3- and 4-byte UTF-8, and the empty one.
fn hashtext_strings() -> Vec<String> {
    let mut strings: Vec<String> = (0..240)
        .map(|i| {
            let tail: String = match i % 4 {
                0 => String::new(),
                1 => "é ñ ü".repeat(i % 7),
                2 => "漢字かな".repeat(i % 5),
                _ => "🦀🔒".repeat(i % 3 + 1),
            };
            format!("lockkit-tests/multiplexed-setups/{i}/{tail}")
        })
        .collect();
    strings.push(String::new());
    strings
}

/// `HashText` keys taken multiplexed: each key is the server's
/// `hashtext` of its string, granted to the guard's backend; SQL that locks
/// `hashtext(...)` of a held string is refused, of another string granted
/// (the control); and a string SQL holds is busy for the multiplexed form,
/// then free once SQL lets it go.
#[tokio::test(flavor = "multi_thread")]
async fn hashtext_keys_taken_multiplexed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut raw = db.connect().await;
    let sessions = multiplexed(SessionLock::new(db.config()), 2);
    let strings = hashtext_strings();

    let server: Vec<i32> = observer
        .query(
            "SELECT hashtext(x) FROM unnest($1::text[]) WITH ORDINALITY AS t(x, i) ORDER BY i",
            &[&strings],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        server.iter().collect::<HashSet<_>>().len(),
        strings.len(),
        "two strings with one hash: the test needs others"
    );
    let guards: Vec<SessionGuard<HashText<String>>> = futures_util::stream::iter(&strings)
        .map(|s| sessions.try_lock(HashText(s.clone())))
        .buffered(64)
        .map(|taken| taken.expect("try_lock").expect("free"))
        .collect()
        .await;
    let pids = pids_of(&guards);
    assert!(pids.len() <= 2, "{pids:?}");
    assert_eq!(granted_on(&observer, &pids).await, strings.len() as i64);
    for (guard, hash) in guards.iter().zip(&server) {
        assert_eq!(guard.form(), SessionForm::Multiplexed);
        assert_eq!(
            guard.key(),
            LockKey::BigInt(i64::from(*hash)),
            "{:?}",
            guard.value().0
        );
        assert!(held_by(&observer, guard.backend_pid(), guard.key()).await);
    }

    // SQL on hashtext() is excluded; the control, another string, is not.
    let tx = raw.transaction().await.unwrap();
    let refused: Vec<bool> = tx
        .query(
            "SELECT pg_try_advisory_xact_lock(hashtext(x)) FROM unnest($1::text[]) AS t(x)",
            &[&strings],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        refused.iter().all(|got| !got),
        "SQL got a held hashtext key"
    );
    let other = "lockkit-tests/multiplexed-setups/not held";
    let got: bool = tx
        .query_one("SELECT pg_try_advisory_xact_lock(hashtext($1))", &[&other])
        .await
        .unwrap()
        .get(0);
    assert!(got, "the control: a string nobody holds is free");
    tx.rollback().await.unwrap();
    for guard in guards {
        assert!(guard.release().await.unwrap());
    }

    // SQL holds, the multiplexed form finds it busy, then free.
    let tx = raw.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext(x)) FROM unnest($1::text[]) AS t(x)",
        &[&strings[..20].to_vec()],
    )
    .await
    .unwrap();
    for s in &strings[..20] {
        let back = sessions
            .try_lock(HashText(s.clone()))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(back.0, *s);
    }
    tx.rollback().await.unwrap();
    for s in &strings[..20] {
        let guard = sessions
            .try_lock(HashText(s.clone()))
            .await
            .unwrap()
            .expect("free once SQL rolled back");
        assert!(guard.release().await.unwrap());
    }
}

// ---------------------------------------------------------------------------
// Keepalive and idle_in_transaction_session_timeout
// ---------------------------------------------------------------------------

/// The server's `idle_in_transaction_session_timeout` in the keepalive test.
const IDLE_TIMEOUT: Duration = Duration::from_secs(1);

/// `state_change` of backend `pid` (seconds since the epoch, the server's
/// clock), or `None` once the backend is gone.
async fn state_change(observer: &Client, pid: i32) -> Option<f64> {
    observer
        .query_opt(
            "SELECT EXTRACT(EPOCH FROM state_change)::float8 FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// Holds a multiplexed lock on `sessions` (a keepalive below the idle
/// timeout) while the server's clock sees its backend's `state_change`
/// move at least 20 times and span more than four idle timeouts: the
/// keepalives run on the lock's connection, and the server never ends its
/// session. Then the lock is still held, by the same backend.
async fn kept_through_several_timeouts(
    label: &str,
    observer: &Client,
    sessions: &SessionLock,
    id: i64,
) {
    let guard = sessions
        .try_lock(Setup { id })
        .await
        .unwrap()
        .expect("free");
    assert_eq!(guard.form(), SessionForm::Multiplexed, "{label}");
    let pid = guard.backend_pid();
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut seen = Vec::<f64>::new();
    let started = Instant::now();
    loop {
        let Some(at) = state_change(observer, pid).await else {
            panic!("{label}: the server ended the lock's session after {seen:?}");
        };
        if seen.last() != Some(&at) {
            seen.push(at);
        }
        let span = seen.last().unwrap() - seen[0];
        if seen.len() > 20 && span > 4.0 * IDLE_TIMEOUT.as_secs_f64() {
            break;
        }
        assert!(
            (&mut lost).now_or_never().is_none(),
            "{label}: lost() resolved"
        );
        assert!(
            started.elapsed() < HANG,
            "{label}: {} keepalives seen in {:?}",
            seen.len(),
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        (&mut lost).now_or_never().is_none(),
        "{label}: lost() resolved"
    );
    assert!(guard.is_held(), "{label}");
    assert!(held_by(observer, pid, guard.key()).await, "{label}");
    assert!(guard.check().await.unwrap(), "{label}");
    assert!(guard.release().await.unwrap(), "{label}");
}

/// With a keepalive (200 ms) below the server's
/// `idle_in_transaction_session_timeout` (1 s), a multiplexed lock, opened
/// and pooled, is kept while its backend is seen running keepalives over
/// more than four timeouts. With one above it (3 s), the lock is kept too:
/// its connection's held transaction runs under its own lease (9 s), not
/// the server's timeout. Its backend then terminated, `lost()` resolves
/// (at once on an opened connection, at the next keepalive on a leased
/// one; the bound only guards a hang), the key is free for another
/// session, the release says the connection was lost, and the next lock
/// opens a new connection.
#[tokio::test(flavor = "multi_thread")]
async fn keepalive_against_idle_in_transaction_session_timeout() {
    let db = TestServer::builder()
        .setting("idle_in_transaction_session_timeout", "1s")
        .start();
    let _log = db.guard();
    let observer = db.connect().await;

    // One multiplexed connection, opened and pooled, with `keepalive`; the
    // keys `first` and `first + 1`.
    let both = |first: i64, keepalive: Duration| {
        [
            ("opened", first, SessionLock::new(db.config())),
            (
                "pooled",
                first + 1,
                SessionLock::from_pool(pool_of(db.config(), 2)),
            ),
        ]
        .map(|(name, id, sessions)| {
            let sessions = sessions
                .form(SessionForm::Multiplexed)
                .connections(1)
                .keepalive(keepalive);
            (name, id, sessions)
        })
    };

    for (name, id, sessions) in both(30_000, Duration::from_millis(200)) {
        kept_through_several_timeouts(name, &observer, &sessions, id).await;
    }

    for (name, id, sessions) in both(30_010, Duration::from_secs(3)) {
        let guard = sessions
            .try_lock(Setup { id })
            .await
            .unwrap()
            .expect("free");
        let pid = guard.backend_pid();
        // The safe direction: a wait that must not see the lock go.
        assert!(
            tokio::time::timeout(IDLE_TIMEOUT * 4, guard.lost())
                .await
                .is_err(),
            "{name}: the server's idle timeout ended a lock under its lease"
        );
        assert!(guard.check().await.unwrap(), "{name}");
        let terminated: bool = observer
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(terminated, "{name}");
        tokio::time::timeout(HANG, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: lost() did not resolve"));
        assert!(!guard.is_held(), "{name}");
        wait_until_gone(&observer, &[pid], name).await;
        let other = SessionLock::new(db.config())
            .lock_timeout(Setup { id }, HANG)
            .await
            .unwrap_or_else(|e| panic!("{name}: the key is not free: {e}"));
        assert!(other.release().await.unwrap());
        let err = guard.release().await.unwrap_err();
        assert!(err.is_connection_lost(), "{name}: {err}");
        // A new connection for the next lock.
        let again = sessions
            .try_lock(Setup { id })
            .await
            .unwrap()
            .expect("free");
        assert_ne!(again.backend_pid(), pid, "{name}");
        assert!(again.release().await.unwrap(), "{name}");
    }
}
