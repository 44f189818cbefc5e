//! The multiplexed session-lock form: 10,000 locks held at once over at
//! most 8 connections, direct and through transaction-mode pgbouncer under
//! load, each released on its own, never two holders and none left; a
//! `kill -9`d holder process releases everything, through the pooler too;
//! cut-off calls leave nothing behind; a lost connection is reported to
//! every guard on it, and forgotten before any of them sees it lost. The controls: plain session-level locks through the
//! pooler leak, and two holders of one connection both get the same key.

use std::collections::{BTreeSet, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use lockkit::pg::{SessionForm, SessionGuard, MULTIPLEXED_NAME};
use lockkit::{AdvisoryKey, SessionLock};
use lockkit_tests::fixtures::Feed;
use lockkit_tests::observe::wait_until_gone;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::{Client, NoTls};

/// These tests are about where locks are left, not about the cadence's
/// bound on a silent server (`session_silent` is): a loaded machine may
/// take seconds to answer 10,000 statements through the pooler.
const PATIENT: Duration = Duration::from_secs(60);

/// How many locks the big tests hold at once.
const LOCKS: i64 = 10_000;

/// The bound on the multiplexed connections of the big tests.
const CONNECTIONS: usize = 8;

/// A server of its own for the big tests: 10,000 locks at once need a lock
/// table larger than the default (64 × 200 connections is 12,800 entries,
/// shared with every other test of the binary).
fn big_server() -> TestServer {
    TestServer::builder()
        .setting("max_locks_per_transaction", "256")
        .start()
}

fn multiplexed(config: tokio_postgres::Config, connections: usize) -> SessionLock {
    SessionLock::new(config)
        .form(SessionForm::Multiplexed)
        .connections(connections)
        .keepalive(PATIENT)
}

/// Granted advisory locks on the server, in any session.
async fn advisory_locks(observer: &Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// The backends holding advisory locks, with how many each holds.
async fn holders(observer: &Client) -> Vec<(i32, i64)> {
    observer
        .query(
            "SELECT pid, count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             GROUP BY pid ORDER BY pid",
            &[],
        )
        .await
        .expect("pg_locks")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Backends named as multiplexed connections.
async fn multiplexed_backends(observer: &Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&MULTIPLEXED_NAME],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

/// Polls until the server holds no advisory lock; panics after 60 s (the
/// server ends a closed session asynchronously). Answers how long it took.
async fn until_no_lock(observer: &Client, what: &str) -> Duration {
    let started = Instant::now();
    loop {
        let left = advisory_locks(observer).await;
        if left == 0 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{what}: {left} advisory locks still held after 60 s: {:?}",
            holders(observer).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Short transactions through `config` until the returned flag is set, so
/// that a transaction-mode pooler hands its backends around meanwhile.
async fn background(
    config: &tokio_postgres::Config,
    clients: usize,
) -> Arc<std::sync::atomic::AtomicBool> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for _ in 0..clients {
        let (client, connection) = config.connect(NoTls).await.expect("background client");
        tokio::spawn(connection);
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if client
                    .batch_execute("BEGIN; SELECT pg_backend_pid(); COMMIT")
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
    stop
}

/// 10,000 locks through `config`, at once, over at most 8 connections:
/// every one granted to exactly one of those backends (the server's
/// `pg_locks`, read by the direct `observer`), a rival `SessionLock` (as
/// another process would) refused every key it tries, the same
/// `SessionLock` refused a key it holds, then each released on its own and
/// none left.
async fn ten_thousand(label: &str, config: tokio_postgres::Config, observer: &Client) {
    let sessions = multiplexed(config.clone(), CONNECTIONS);
    let rival = multiplexed(config, 2);
    let guards: Vec<SessionGuard<Feed>> = futures_util::stream::iter(0..LOCKS)
        .map(|id| sessions.try_lock(Feed { id }))
        .buffer_unordered(512)
        .map(|taken| taken.expect("try_lock").expect("a free key"))
        .collect()
        .await;
    let pids: HashSet<i32> = guards.iter().map(|g| g.backend_pid()).collect();
    assert!(
        pids.len() <= CONNECTIONS,
        "{label}: {} backends hold the locks",
        pids.len()
    );
    assert!(
        guards.iter().all(|g| g.form() == SessionForm::Multiplexed),
        "{label}"
    );
    let seen = holders(observer).await;
    assert_eq!(
        seen.iter().map(|(_, n)| n).sum::<i64>(),
        LOCKS,
        "{label}: advisory locks on the server: {seen:?}"
    );
    assert!(
        seen.iter().all(|(pid, _)| pids.contains(pid)),
        "{label}: a lock on a backend no guard names: {seen:?} against {pids:?}"
    );
    assert!(
        multiplexed_backends(observer).await <= CONNECTIONS as i64,
        "{label}"
    );

    // Never two holders: the rival is refused, and so is the holder itself
    // (a session-level lock is re-entrant on its own session).
    for id in (0..LOCKS).step_by(97) {
        assert!(
            rival.try_lock(Feed { id }).await.expect("rival").is_err(),
            "{label}: the rival got {id}"
        );
        assert!(
            rival
                .try_lock_shared(Feed { id })
                .await
                .expect("rival")
                .is_err(),
            "{label}: the rival got {id} shared"
        );
        assert!(
            sessions
                .try_lock(Feed { id })
                .await
                .expect("again")
                .is_err(),
            "{label}: {id} granted twice to its holder"
        );
    }
    assert_eq!(advisory_locks(observer).await, LOCKS, "{label}");

    // Each on its own, in an order unlike the taking's, all at once.
    let mut guards = guards;
    guards.sort_by_key(|g| (g.id * 7919) % LOCKS);
    let released: Vec<bool> = futures_util::stream::iter(guards)
        .map(|g| g.release())
        .buffer_unordered(512)
        .map(|released| released.expect("release"))
        .collect()
        .await;
    assert!(released.iter().all(|&held| held), "{label}");
    assert_eq!(
        advisory_locks(observer).await,
        0,
        "{label}: left after release"
    );

    // Nothing held: the connections close with the `SessionLock`.
    drop((sessions, rival));
    let started = Instant::now();
    while multiplexed_backends(observer).await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{label}: connections left open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_locks_over_eight_connections_direct() {
    let db = big_server();
    let _log = db.guard();
    let observer = db.connect().await;
    ten_thousand("direct", db.config(), &observer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_locks_over_eight_connections_through_transaction_mode_pgbouncer() {
    let db = big_server();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(&db).default_pool_size(16).start();
    let observer = db.connect().await;
    let stop = background(&bouncer.config(), 4).await;
    ten_thousand("pgbouncer", bouncer.config(), &observer).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(advisory_locks(&observer).await, 0, "{}", bouncer.log());
}

/// The control of the pooler test: plain `pg_advisory_lock` through the
/// same transaction-mode pooler (what the multiplexed form would be without
/// its held transaction) leaves locks on pooled backends after its client
/// is gone: a session of the server's own is refused them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plain_session_locks_through_a_transaction_mode_pooler_leak() {
    let db = big_server();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(&db).default_pool_size(4).start();
    let observer = db.connect().await;
    let (naive, connection) = bouncer.config().connect(NoTls).await.expect("naive");
    let task = tokio::spawn(connection);
    for id in 0..100 {
        let key = Feed { id }.lock_key();
        let lockkit::LockKey::BigInt(k) = key else {
            unreachable!("Feed is a BigInt key")
        };
        naive
            .execute("SELECT pg_advisory_lock($1)", &[&k])
            .await
            .expect("naive lock");
    }
    drop(naive);
    task.await.expect("connection task").ok();
    // The client is gone; its locks are not: a session of the server's
    // own is refused keys that no client holds any more.
    assert!(
        advisory_locks(&observer).await > 0,
        "the naive form left nothing"
    );
    let mut refused = 0;
    for id in 0..100 {
        let lockkit::LockKey::BigInt(k) = Feed { id }.lock_key() else {
            unreachable!()
        };
        let row = observer
            .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&k])
            .await
            .expect("try");
        if !row.get::<_, bool>(0) {
            refused += 1;
        }
    }
    assert!(refused > 0, "no key was left on a pooled backend");
}

/// The control of the claim table: two holders sharing one connection, as
/// a multiplexer without it would have them, are both granted one key
/// (session-level locks are re-entrant); the multiplexed form refuses the
/// second.
#[tokio::test(flavor = "multi_thread")]
async fn control_two_holders_on_one_connection_both_get_a_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let naive = db.connect().await;
    let lockkit::LockKey::BigInt(k) = Feed { id: 910_001 }.lock_key() else {
        unreachable!()
    };
    let try_it = || async {
        naive
            .query_one("SELECT pg_try_advisory_lock($1)", &[&k])
            .await
            .expect("try")
            .get::<_, bool>(0)
    };
    let (first, second) = futures_util::future::join(try_it(), try_it()).await;
    assert!(
        first && second,
        "the server refused a re-entrant session lock"
    );
    naive
        .execute("SELECT pg_advisory_unlock_all()", &[])
        .await
        .unwrap();

    let sessions = multiplexed(db.config(), 1);
    let key = Feed { id: 910_001 };
    let (first, second) =
        futures_util::future::join(sessions.try_lock(key), sessions.try_lock(key)).await;
    let granted = [first.unwrap(), second.unwrap()]
        .into_iter()
        .filter_map(Result::ok)
        .count();
    assert_eq!(granted, 1, "two holders of one key through one SessionLock");
}

/// Runs `hold-session-locks` through `url` for `count` keys from `first`,
/// waits until it holds them, kills it with SIGKILL and answers how long
/// the server took to have none of them.
async fn kill_holder(
    label: &str,
    url: &str,
    observer: &Client,
    first: i64,
    count: i64,
) -> Duration {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hold-session-locks"))
        .args([url, &count.to_string(), &first.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("hold-session-locks");
    let stdout = child.stdout.take().expect("piped");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .expect("reader")
    .expect("the child's line");
    let mut words = line.split_whitespace();
    assert_eq!(words.next(), Some("held"), "{label}: {line:?}");
    assert_eq!(
        words.next(),
        Some(count.to_string().as_str()),
        "{label}: {line:?}"
    );
    let pids: BTreeSet<i32> = words
        .next()
        .unwrap_or_default()
        .split(',')
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert!(pids.len() <= CONNECTIONS, "{label}: {pids:?}");
    assert_eq!(advisory_locks(observer).await, count, "{label}");
    child.kill().expect("kill -9");
    child.wait().expect("reaped");
    until_no_lock(observer, label).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_holder_process_releases_every_lock_direct_and_through_pgbouncer() {
    let db = big_server();
    let _log = db.guard();
    let observer = db.connect().await;
    let direct = kill_holder("direct", db.url(), &observer, 0, 2_000).await;
    let bouncer = PgBouncer::builder(&db).default_pool_size(12).start();
    let stop = background(&bouncer.config(), 2).await;
    let pooled = kill_holder("pgbouncer", &bouncer.url(), &observer, 0, 2_000).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    eprintln!("released after kill -9: direct {direct:?}, through pgbouncer {pooled:?}");
    // Through the pooler, every backend that held a lock was closed, not
    // handed to another client: the keys are free to anyone.
    let sessions = multiplexed(bouncer.config(), 4);
    for id in (0..2_000).step_by(50) {
        assert!(
            sessions.try_lock(Feed { id }).await.expect("try").is_ok(),
            "{id} still held after the holder was killed: {}",
            bouncer.log()
        );
    }
}

/// Lock calls cut off every way Rust cuts a future (`now_or_never`, a
/// zero `timeout`, `select!` against a ready branch, dropped after a
/// first poll), many times, on keys also taken by whole calls: nothing is
/// left held once they settle, no key is held twice (one release frees
/// it), and every key can be taken afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_off_calls_leave_nothing_held() {
    let db = big_server();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 2);
    let rival = multiplexed(db.config(), 1);
    let mut kept = Vec::new();
    for i in 0..400_i64 {
        let key = Feed { id: i % 40 };
        match i % 5 {
            0 => drop(sessions.try_lock(key).now_or_never()),
            1 => drop(tokio::time::timeout(Duration::ZERO, sessions.try_lock(key)).await),
            2 => {
                tokio::select! {
                    biased;
                    () = std::future::ready(()) => {}
                    _ = sessions.try_lock(key) => {}
                }
            }
            3 => {
                // Polled once (the statement sent), then dropped.
                let mut call = Box::pin(sessions.try_lock(key));
                let _ = call.as_mut().now_or_never();
                drop(call);
            }
            _ => {
                if let Ok(guard) = sessions.try_lock(key).await.expect("try") {
                    if i % 2 == 0 {
                        // A release cut off after its statement was sent.
                        let mut release = Box::pin(guard.release());
                        let _ = release.as_mut().now_or_never();
                    } else {
                        kept.push(guard);
                    }
                }
            }
        }
        // Never held by the rival too.
        if let Ok(got) = rival.try_lock(key).await.expect("rival") {
            assert!(
                !kept.iter().any(|g| g.id == key.id),
                "the rival got {key:?}, which a kept guard holds"
            );
            drop(got);
        }
    }
    let kept_ids: HashSet<i64> = kept.iter().map(|g| g.id).collect();
    for guard in kept {
        assert!(guard.release().await.expect("release"));
    }
    until_no_lock(&observer, "after the cut-off calls").await;
    for id in 0..40 {
        let guard = sessions
            .try_lock(Feed { id })
            .await
            .expect("try")
            .unwrap_or_else(|_| panic!("{id} left claimed or held (kept: {kept_ids:?})"));
        assert!(guard.release().await.expect("release"));
    }
    // Each key held once: a session lock a cut-off call left taken twice
    // (re-entrant) would outlive the one release above.
    assert_eq!(
        advisory_locks(&observer).await,
        0,
        "held twice: {:?}",
        holders(&observer).await
    );
}

/// Waits, timeouts and shared holders: a wait for a held key is granted
/// when the holder releases it (seen waiting in `pg_locks` first), on a
/// connection of its own; a timeout expires; shared holders admit each
/// other.
#[tokio::test(flavor = "multi_thread")]
async fn waits_take_a_connection_of_their_own() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 2);
    let key = Feed { id: 920_001 };
    let held = sessions.lock(key).await.expect("free: multiplexed");
    assert_eq!(held.form(), SessionForm::Multiplexed);
    let err = sessions
        .lock_timeout(key, Duration::from_millis(50))
        .await
        .expect_err("held");
    assert!(err.is_timeout(), "{err}");
    let waiter = {
        let sessions = sessions.clone();
        tokio::spawn(async move { sessions.lock(key).await })
    };
    lockkit_tests::observe::wait_until_key_waited(&observer, key.lock_key()).await;
    assert!(held.release().await.expect("release"));
    let second = waiter
        .await
        .expect("task")
        .expect("granted after the release");
    assert_eq!(second.form(), SessionForm::Transaction);
    assert!(second.release().await.expect("release"));

    let a = sessions.lock_shared(key).await.expect("shared");
    let b = sessions
        .try_lock_shared(key)
        .await
        .expect("shared")
        .expect("admitted");
    assert_ne!(a.backend_pid(), b.backend_pid());
    assert!(sessions.try_lock(key).await.expect("try").is_err());
    assert!(a.release().await.unwrap() && b.release().await.unwrap());
}

/// A multiplexed connection is closed once it has held nothing for a
/// keepalive cadence, and kept while it holds a lock: keys on two
/// connections, the first's released, the second's held; the first's
/// backend ends, the second's holds its keys still, until their release.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_held_nothing_for_a_cadence_is_closed() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    // A try, and a held lock's keepalive, wait one cadence for their
    // answer: long enough for a loaded machine, since the connection's
    // close is waited for as an event, however long the cadence.
    let cadence = Duration::from_secs(2);
    let sessions = multiplexed(db.config(), 2).keepalive(cadence);
    let guards: Vec<_> = futures_util::stream::iter(931_000..931_200)
        .map(|id| sessions.try_lock(Feed { id }))
        .buffer_unordered(64)
        .map(|taken| taken.expect("try").expect("free"))
        .collect()
        .await;
    let idle_pid = guards[0].backend_pid();
    let (released, held): (Vec<_>, Vec<_>) = guards
        .into_iter()
        .partition(|g| g.backend_pid() == idle_pid);
    assert!(!held.is_empty(), "the keys went to one connection");
    for guard in released {
        assert!(guard.release().await.unwrap());
    }
    wait_until_gone(&observer, &[idle_pid], "the idle connection").await;
    // The other one, holding its keys, outlived the idle one's cadences.
    let held_pid = held[0].backend_pid();
    for guard in held {
        assert!(guard.check().await.unwrap());
        assert!(guard.release().await.unwrap());
    }
    wait_until_gone(&observer, &[held_pid], "the last connection").await;
}

/// A multiplexed connection that ends (`pg_terminate_backend`) is reported
/// to every guard on it, at once; guards on the other connections still
/// hold, and a lost guard's release says the lock was gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_connection_is_reported_to_every_guard_on_it() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 2);
    let guards: Vec<_> = futures_util::stream::iter(930_000..930_200)
        .map(|id| sessions.try_lock(Feed { id }))
        .buffer_unordered(64)
        .map(|taken| taken.expect("try").expect("free"))
        .collect()
        .await;
    let victim = guards[0].backend_pid();
    // What an operator's `lockkit inspect` sees of them: session locks.
    let registry = lockkit::inspect::KeyRegistry::new().register::<Feed>();
    let rows = lockkit::inspect::advisory_locks(&observer, &registry)
        .await
        .expect("inspect");
    let ours: Vec<_> = rows.iter().filter(|r| r.pid == Some(victim)).collect();
    assert!(!ours.is_empty());
    for row in ours {
        assert_eq!(row.lockkit_call(), Some("session lock"), "{row:?}");
        assert_eq!(row.application_name.as_deref(), Some(MULTIPLEXED_NAME));
    }
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&victim])
        .await
        .expect("terminate");
    let (on_victim, others): (Vec<_>, Vec<_>) =
        guards.into_iter().partition(|g| g.backend_pid() == victim);
    for guard in &on_victim {
        tokio::time::timeout(PATIENT, guard.lost())
            .await
            .expect("lost() resolves");
        assert!(!guard.is_held());
    }
    for guard in &others {
        assert!(guard.is_held());
        assert!(guard.check().await.expect("check"));
    }
    for guard in on_victim {
        let err = guard.release().await.expect_err("gone");
        assert!(err.is_connection_lost(), "{err}");
    }
    for guard in others {
        assert!(guard.release().await.expect("release"));
    }
}

/// A lock taken again the moment its connection is lost goes to a new
/// connection: the connection's slot forgets it before anything can see it
/// lost, so no lock call reaches the dead connection (there it fails with
/// `ConnectionLost` at its first poll). The reaction runs inside the
/// keeper's own steps: at its warning that the connection is given up, a
/// hook polls a try of the next key once. That poll must not have failed;
/// the try then completes on a new backend. 30 connections are ended, one
/// after another.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_taken_again_the_moment_one_is_lost_gets_a_new_connection() {
    use std::sync::Mutex;

    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 1);
    let first = Feed { id: 935_000 };
    let mut guard = sessions.try_lock(first).await.expect("try").expect("free");
    for round in 1..=30 {
        let victim = guard.backend_pid();
        let next = Feed {
            id: 935_000 + round,
        };
        let (polled_tx, polled) = tokio::sync::oneshot::channel();
        let _hook = {
            let (sessions, polled_tx) = (sessions.clone(), Mutex::new(Some(polled_tx)));
            let ours = format!("backend_pid={victim} ");
            lockkit_tests::capture::on_warning(move |text| {
                if text.contains(&ours) && text.contains("given up") {
                    let first_poll = sessions.try_lock(next).now_or_never();
                    if let Some(tx) = polled_tx.lock().unwrap().take() {
                        let _ = tx.send(first_poll.map(|taken| taken.map(|_| ())));
                    }
                }
            })
        };
        observer
            .execute("SELECT pg_terminate_backend($1)", &[&victim])
            .await
            .expect("terminate");
        let first_poll = tokio::time::timeout(PATIENT, polled)
            .await
            .unwrap_or_else(|_| panic!("round {round}: no warning that the connection is given up"))
            .expect("the hook answers");
        if let Some(Err(e)) = first_poll {
            panic!("round {round}: tried on the dead connection: {e}");
        }
        assert!(!guard.is_held(), "round {round}");
        let err = guard.release().await.expect_err("gone");
        assert!(err.is_connection_lost(), "{err}");
        guard = sessions.try_lock(next).await.expect("try").expect("free");
        assert_ne!(guard.backend_pid(), victim, "round {round}");
    }
    assert!(guard.release().await.expect("release"));
}

/// A try on a multiplexed connection that ended unseen (its backend
/// terminated; a leased connection learns it only at its next keepalive,
/// a minute away here) is made again on a new connection and granted,
/// rather than failing with `ConnectionLost`; the guards on the dead
/// connection learn at once that they are lost. Both sources, opened and
/// leased, 10 times each.
#[tokio::test(flavor = "multi_thread")]
async fn a_try_on_a_connection_that_ended_unseen_goes_to_a_new_one() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sources = [
        ("opened", SessionLock::new(db.config())),
        (
            "leased",
            SessionLock::from_pool(crate::pooler::pool_of(db.config(), 4)),
        ),
    ];
    for (n, (source, sessions)) in sources.into_iter().enumerate() {
        let sessions = sessions
            .form(SessionForm::Multiplexed)
            .connections(1)
            .keepalive(PATIENT);
        let base = 932_000 + 1_000 * n as i64;
        let mut held = sessions
            .try_lock(Feed { id: base })
            .await
            .expect("try")
            .expect("free");
        for round in 1..=10 {
            let victim = held.backend_pid();
            observer
                .execute("SELECT pg_terminate_backend($1)", &[&victim])
                .await
                .expect("terminate");
            // The backend has ended (its locks with it).
            wait_until_gone(&observer, &[victim], source).await;
            let next = sessions
                .try_lock(Feed { id: base + round })
                .await
                .unwrap_or_else(|e| panic!("{source}, round {round}: {e}"))
                .expect("free");
            assert_ne!(next.backend_pid(), victim, "{source}, round {round}");
            tokio::time::timeout(PATIENT, held.lost())
                .await
                .expect("the guard on the dead connection is lost");
            let err = held.release().await.expect_err("gone");
            assert!(err.is_connection_lost(), "{source}: {err}");
            held = next;
        }
        assert!(held.release().await.expect("release"), "{source}");
    }
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(raw)]
struct RawBig(i64);

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(raw)]
struct RawPair((i32, i32));

/// The extreme keys of both key spaces (written into the statement's text
/// as literals) are taken and released, each held by its backend. (On a
/// server of its own: other tests lock these raw keys too.)
#[tokio::test(flavor = "multi_thread")]
async fn extreme_keys_of_both_key_spaces() {
    let db = &big_server();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 1);
    for value in [i64::MIN, i64::MAX, -1] {
        let guard = sessions
            .try_lock(RawBig(value))
            .await
            .unwrap()
            .expect("free");
        assert!(lockkit_tests::observe::held_by(&observer, guard.backend_pid(), guard.key()).await);
        assert!(guard.release().await.unwrap(), "{value}");
    }
    for value in [(i32::MIN, i32::MIN), (i32::MAX, -1)] {
        let guard = sessions
            .try_lock_shared(RawPair(value))
            .await
            .unwrap()
            .expect("free");
        assert!(lockkit_tests::observe::held_by(&observer, guard.backend_pid(), guard.key()).await);
        assert!(guard.release().await.unwrap(), "{value:?}");
    }
}

/// A waiting acquire never delays another lock's acquire or release: while
/// a wait for a held key is seen waiting on the server, 200 other keys are
/// taken and released, every one, through the same `SessionLock`, and the
/// multiplexed connections' backends are never the waiting one.
#[tokio::test(flavor = "multi_thread")]
async fn a_wait_never_delays_the_other_locks() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let sessions = multiplexed(db.config(), 2);
    let rival = multiplexed(db.config(), 1);
    let key = Feed { id: 940_000 };
    let held = rival.try_lock(key).await.unwrap().expect("free");
    let waiter = {
        let sessions = sessions.clone();
        tokio::spawn(async move { sessions.lock(key).await })
    };
    lockkit_tests::observe::wait_until_key_waited(&observer, key.lock_key()).await;
    for id in 940_001..940_201 {
        let guard = sessions.try_lock(Feed { id }).await.unwrap().expect("free");
        assert!(
            !lockkit_tests::observe::waiting(&observer, guard.backend_pid()).await,
            "a multiplexed connection waits"
        );
        assert!(guard.release().await.unwrap());
    }
    assert!(
        !waiter.is_finished(),
        "the wait ended before the holder let go"
    );
    assert!(held.release().await.unwrap());
    let granted = waiter.await.unwrap().expect("granted");
    assert!(granted.release().await.unwrap());
}

/// A pair key of this module's own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/multiplexed-prepared", pair)]
struct Cell {
    id: i64,
}

/// `statements(StatementMode::Prepared)` on a direct connection: the
/// multiplexed form prepares its lock and unlock statements once per
/// connection and runs them by name (the server's statement log says
/// `execute s…`, never `<unnamed>`), for both key shapes and both modes,
/// and each lock is real (seen granted on the connection's backend). The
/// control: the default sends them unnamed (`execute <unnamed>`) and no
/// name appears.
#[tokio::test(flavor = "multi_thread")]
async fn prepared_statements_on_a_direct_connection() {
    use lockkit::StatementMode;
    let db = TestServer::builder()
        .setting("log_statement", "all")
        .start();
    let _log = db.guard();
    let observer = db.connect().await;
    for mode in [StatementMode::Unnamed, StatementMode::Prepared] {
        let from = db.log_offset();
        let sessions = SessionLock::new(db.config())
            .form(SessionForm::Multiplexed)
            .keepalive(PATIENT)
            .statements(mode);
        for round in 0..3 {
            let feed = sessions.lock(Feed { id: 95_000 + round }).await.unwrap();
            let cell = sessions
                .try_lock_shared(Cell { id: round })
                .await
                .unwrap()
                .unwrap_or_else(|_| panic!("{mode:?}: a free cell"));
            for key in [feed.key(), cell.key()] {
                let granted = lockkit_tests::observe::holders_elsewhere(&observer, key).await;
                assert_eq!(granted, 1, "{mode:?}, round {round}: {key} held");
            }
            assert!(feed.release().await.unwrap());
            assert!(cell.release().await.unwrap());
        }
        let log = db.log_since(from);
        let lockkit = |line: &&str| {
            line.contains("pg_try_advisory_lock") || line.contains("pg_advisory_unlock")
        };
        let named = log
            .lines()
            .filter(lockkit)
            .filter(|l| l.contains("execute s"))
            .count();
        let unnamed = log
            .lines()
            .filter(lockkit)
            .filter(|l| l.contains("execute <unnamed>"))
            .count();
        match mode {
            StatementMode::Prepared => {
                assert_eq!(unnamed, 0, "{mode:?}: sent unnamed");
                assert!(named >= 12, "{mode:?}: {named} run by name");
            }
            _ => {
                assert_eq!(named, 0, "{mode:?}: run by name");
                assert!(unnamed >= 12, "{mode:?}: {unnamed} sent unnamed");
            }
        }
    }
}
