//! A session lock whose network path goes silent is given up within the
//! documented bound (two keepalive cadences: the next keepalive starts
//! within one, and gets no reply within the next), whatever is in flight on
//! its connection when the path goes silent: nothing (the keepalive finds
//! it), a `check()`, or a `release()`. `check()` and `release()` themselves
//! answer within the same bound. Both forms, and both ways a path goes
//! silent: the server's side closed under a client that hears nothing (the
//! server releases the lock at once, and another session takes the key:
//! the holder must stop believing it holds it), and a blackhole where both
//! sides stay open.
//!
//! Taking a lock over a silent path is bounded too (a user's report: a
//! `try_lock` hung for good during a partition): opening the connection
//! (tokio-postgres bounds only the TCP connect, and the proxy accepts), and
//! the statements of a try or a timed call on a connection taken from a
//! pool or already open, in every form; it holds nothing. Opening fails
//! with `ConnectFailed` (no connection was made); a take whose statements
//! go unanswered on a connection already open (a pool's) fails with
//! `Timeout`, since a silent server cannot be told from a pooler waiting
//! for a free server connection
//! (`session_pooler::tries_behind_a_saturated_pooler…`).
//!
//! The bound is asserted with a margin on top, for a loaded machine: what
//! the tests catch is an unbounded wait, which never ends.

use std::time::Duration;

use lockkit::pg::{SessionForm, DEFAULT_CONNECT_TIMEOUT};
use lockkit::{AdvisoryKey, ErrorKind, SessionLock};
use lockkit_tests::observe::granted_elsewhere;
use lockkit_tests::{Cut, Proxy, TestServer};
use tokio_postgres::Client;

use crate::pooler::pool_of;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-silent")]
struct Feed {
    id: i64,
}

/// The keepalive cadence of these tests.
const CADENCE: Duration = Duration::from_millis(500);
/// The documented bound, plus slack that only absorbs a loaded machine.
const BOUND: Duration = Duration::from_millis(2 * 500 + 5_000);
/// Rounds of every case.
const ROUNDS: i64 = 3;

/// What is in flight on the lock's connection when its path goes silent.
#[derive(Clone, Copy, Debug)]
enum InFlight {
    /// Nothing: the keeper's keepalive is the first to get no answer.
    Nothing,
    /// A `check()`, called right after the cut, between two keepalives.
    Check,
    /// A `release()`, called right after the cut.
    Release,
}

/// One lock through a proxy, its path cut, and what the holder sees.
async fn case(db: &TestServer, form: SessionForm, in_flight: InFlight, cut: Cut, id: i64) {
    let what = format!("{form:?}, {in_flight:?} in flight, {cut:?}, key {id}");
    let proxy = Proxy::in_front_of(db);
    let sessions = SessionLock::new(proxy.config())
        .form(form)
        .keepalive(CADENCE);
    let key = Feed { id };
    let guard = sessions
        .lock(key)
        .await
        .unwrap_or_else(|e| panic!("{what}: lock: {e}"));
    let lost = guard.lost();

    proxy.cut(cut).await;
    let outcome = match in_flight {
        InFlight::Nothing => None,
        InFlight::Check => Some(tokio::spawn(async move {
            let answer = guard.check().await;
            (answer.map_err(|e| e.kind()), guard.is_held())
        })),
        InFlight::Release => Some(tokio::spawn(async move {
            (guard.release().await.map_err(|e| e.kind()), false)
        })),
    };

    if cut == Cut::ServerGone {
        // The premise: the server released the lock, and another session
        // now holds the key.
        let other = SessionLock::new(db.config())
            .lock_timeout(key, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{what}: the server did not release the key: {e}"));
        assert!(other.release().await.unwrap(), "{what}");
    }

    if let Some(outcome) = outcome {
        let (answer, held) = tokio::time::timeout(BOUND, outcome)
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer within {BOUND:?}"))
            .expect("the task");
        match in_flight {
            // The lock is given up: not held, whatever the server did.
            InFlight::Check => {
                assert_eq!(answer, Ok(false), "{what}");
                assert!(
                    !held,
                    "{what}: is_held() after a check that found no answer"
                );
            }
            // No answer means no proof the lock lived until the release.
            InFlight::Release => assert_eq!(answer, Err(ErrorKind::ConnectionLost), "{what}"),
            InFlight::Nothing => unreachable!(),
        }
    }
    tokio::time::timeout(BOUND, lost)
        .await
        .unwrap_or_else(|_| panic!("{what}: lost() did not resolve within {BOUND:?}"));
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_silent_path_is_given_up_within_the_bound_whatever_is_in_flight() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut cases = tokio::task::JoinSet::new();
    let mut id = 0;
    for round in 0..ROUNDS {
        for form in [SessionForm::Transaction, SessionForm::SessionLevel] {
            for in_flight in [InFlight::Nothing, InFlight::Check, InFlight::Release] {
                for cut in [Cut::ServerGone, Cut::Blackhole] {
                    id += 1;
                    cases.spawn(case(db, form, in_flight, cut, round * 1_000 + id));
                }
            }
        }
    }
    while let Some(done) = cases.join_next().await {
        done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }
}

/// The control: through the same proxy and cut, a statement sent with no
/// bound of its own gets no answer at all (the path is silent, not closed),
/// so the tests above see lockkit's bound, not a socket error.
#[tokio::test(flavor = "multi_thread")]
async fn control_a_statement_over_the_silent_path_gets_no_answer() {
    let db = TestServer::shared();
    for cut in [Cut::ServerGone, Cut::Blackhole] {
        let proxy = Proxy::in_front_of(db);
        let (client, connection) = proxy
            .config()
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connect through the proxy");
        tokio::spawn(connection);
        client.simple_query("SELECT 1").await.expect("open path");
        proxy.cut(cut).await;
        let answer = tokio::time::timeout(2 * CADENCE, client.simple_query("SELECT 1")).await;
        assert!(
            answer.is_err(),
            "{cut:?}: the silent path answered: {answer:?}"
        );
    }
}

/// The `connect_timeout` of the take tests' connections.
const CONNECT: Duration = Duration::from_secs(1);

/// How a take waits for the key.
#[derive(Clone, Copy, Debug)]
enum Call {
    Try,
    Timeout,
    Forever,
}

/// Where the take's connection comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Conn {
    /// Opened by lockkit from a config with [`CONNECT`] as its
    /// `connect_timeout`, after the cut.
    Opened,
    /// The same, with another key held before the cut (in the multiplexed
    /// form, on the connection the take tries first).
    OpenedWithOneHeld,
    /// A pool whose one connection was opened before the cut.
    Pool,
}

/// One take through a proxy whose path is cut first: it answers
/// `ConnectFailed` (opening a connection) or `Timeout` (the statements on
/// a pool's connection opened before the cut) within its bound, and
/// nothing holds the key.
async fn take_case(
    db: &TestServer,
    observer: &Client,
    form: SessionForm,
    call: Call,
    conn: Conn,
    cut: Cut,
    id: i64,
) {
    let what = format!("{form:?}, {call:?}, {conn:?}, {cut:?}, key {id}");
    let proxy = Proxy::in_front_of(db);
    let mut config = proxy.config();
    config.connect_timeout(CONNECT);
    let sessions = match conn {
        Conn::Opened | Conn::OpenedWithOneHeld => SessionLock::new(config),
        Conn::Pool => {
            let pool = pool_of(config, 1);
            // The pool's one connection, opened and back in the pool.
            pool.get()
                .await
                .unwrap()
                .simple_query("SELECT 1")
                .await
                .unwrap();
            SessionLock::from_pool(pool)
        }
    }
    .form(form)
    .keepalive(CADENCE);
    // Only the session-level form runs the pooler probe, and only its
    // bound counts the probe's: another form's take does not wait for it.
    let sessions = match form {
        SessionForm::SessionLevel => sessions,
        _ => sessions.probe_timeout(Duration::from_secs(3600)),
    };
    let held = match conn {
        Conn::OpenedWithOneHeld => Some(sessions.lock(Feed { id: -id }).await.unwrap()),
        Conn::Opened | Conn::Pool => None,
    };
    proxy.cut(cut).await;

    let key = Feed { id };
    let timed = Duration::from_secs(1);
    let started = tokio::time::Instant::now();
    let take = async {
        match call {
            Call::Try => sessions.try_lock(key).await.map(|r| r.is_ok()),
            Call::Timeout => sessions.lock_timeout(key, timed).await.map(|_| true),
            Call::Forever => sessions.lock(key).await.map(|_| true),
        }
    };
    // Opening (one host) and the statements (two cadences for a
    // multiplexed try, which gives its connection up and tries again),
    // plus slack that only absorbs a loaded machine.
    let bound = CONNECT + timed + 2 * CADENCE + Duration::from_secs(5);
    let answer = tokio::time::timeout(bound, take)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {bound:?}"));
    let expected = match conn {
        // A new connection is opened through the cut path: the opening
        // gives up (a multiplexed try on the one it holds gives that up,
        // and opens another).
        Conn::Opened | Conn::OpenedWithOneHeld => ErrorKind::ConnectFailed,
        // The pool's connection is open: the take's statements go
        // unanswered.
        Conn::Pool => ErrorKind::Timeout,
    };
    assert_eq!(
        answer.map_err(|e| e.kind()),
        Err(expected),
        "{what}, after {:?}",
        started.elapsed()
    );
    // The premise more than the mechanism: after the cut nothing the take
    // sends reaches the server, so no session can hold the key.
    assert!(
        !granted_elsewhere(observer, key.lock_key()).await,
        "{what}: a session holds the key"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_take_over_a_silent_path_fails_within_its_bound() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer: &'static Client = Box::leak(Box::new(db.connect().await));
    let mut cases = tokio::task::JoinSet::new();
    let mut id = 50_000;
    for form in [
        SessionForm::Transaction,
        SessionForm::SessionLevel,
        SessionForm::Multiplexed,
    ] {
        for call in [Call::Try, Call::Timeout, Call::Forever] {
            for conn in [Conn::Opened, Conn::OpenedWithOneHeld, Conn::Pool] {
                // A pool's connection is taken at once, and a wait as long
                // as it takes is not bounded past the opening; the
                // session-level form is for direct connections.
                let forever = matches!(call, Call::Forever);
                if conn == Conn::Pool && (forever || form == SessionForm::SessionLevel) {
                    continue;
                }
                for cut in [Cut::ServerGone, Cut::Blackhole] {
                    id += 1;
                    cases.spawn(take_case(db, observer, form, call, conn, cut, id));
                }
            }
        }
    }
    while let Some(done) = cases.join_next().await {
        done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }
}

/// Without a `connect_timeout` in the configuration, opening a connection
/// over a silent path gives up after [`DEFAULT_CONNECT_TIMEOUT`].
#[tokio::test(flavor = "multi_thread")]
async fn opening_over_a_silent_path_gives_up_after_the_default_bound() {
    let db = TestServer::shared();
    let proxy = Proxy::in_front_of(db);
    proxy.cut(Cut::Blackhole).await;
    let sessions = SessionLock::new(proxy.config());
    let started = tokio::time::Instant::now();
    let bound = DEFAULT_CONNECT_TIMEOUT + Duration::from_secs(10);
    let answer = tokio::time::timeout(bound, sessions.try_lock(Feed { id: 59_999 }))
        .await
        .unwrap_or_else(|_| panic!("no answer within {bound:?}"));
    assert_eq!(
        answer.map(|r| r.is_ok()).map_err(|e| e.kind()),
        Err(ErrorKind::ConnectFailed)
    );
    // Not before the bound: the default is what gave up.
    assert!(
        started.elapsed() >= DEFAULT_CONNECT_TIMEOUT,
        "{:?}",
        started.elapsed()
    );
}

/// The control: tokio-postgres's own `connect_timeout` bounds only the TCP
/// connect, which the proxy accepts: the startup over the silent path gets
/// no answer, so the tests above see lockkit's bound.
#[tokio::test(flavor = "multi_thread")]
async fn control_connect_timeout_alone_does_not_bound_the_startup() {
    let db = TestServer::shared();
    let proxy = Proxy::in_front_of(db);
    proxy.cut(Cut::Blackhole).await;
    let mut config = proxy.config();
    config.connect_timeout(CONNECT);
    let connect = tokio::time::timeout(3 * CONNECT, config.connect(tokio_postgres::NoTls)).await;
    assert!(
        connect.is_err(),
        "the silent path answered the startup: {:?}",
        connect.map(|r| r.map(|_| ()))
    );
}

/// The simple-protocol queries in `bytes`, a client's messages from the
/// start of one (`Q` messages; others are skipped, a cut-short last one
/// too).
fn simple_queries(bytes: &[u8]) -> Vec<String> {
    let mut queries = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let Some(body) = rest.get(5..1 + len) else {
            break;
        };
        if rest[0] == b'Q' {
            let text = body.strip_suffix(&[0]).unwrap_or(body);
            queries.push(String::from_utf8_lossy(text).into_owned());
        }
        rest = &rest[1 + len..];
    }
    queries
}

/// A multiplexed connection whose keepalive goes unanswered is given up at
/// once: nothing more is sent on it. Renewing its held transaction is what
/// follows a keepalive the server refused (`25P02`, the transaction
/// aborted by another statement's error), never one that got no answer:
/// over a silent path the renewal would wait a cadence more, the lock
/// still believed held. The proxy keeps what the client sends after the
/// cut: keepalives only, and no `ROLLBACK`. A renewal after any failure
/// (`.ci/mutations "any keepalive failure"`) fails it.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_multiplexed_connection_is_given_up_without_a_renewal() {
    let db = TestServer::shared();
    let _log = db.guard();
    for round in 0..3 {
        let swallowed =
            given_up_over_a_swallowing_path(db, SessionForm::Multiplexed, 60_000 + round);
        let sent = simple_queries(&swallowed.await);
        assert!(
            !sent.is_empty(),
            "round {round}: no keepalive after the cut"
        );
        for query in &sent {
            assert!(
                query.starts_with("SELECT 1"),
                "round {round}: sent over the silent path after its keepalive: {query:?}"
            );
        }
    }
}

/// A lock of `form` on key `id` through a proxy whose path then goes
/// silent, keeping what the client sends ([`Cut::Swallow`]): once `lost()`
/// resolves, waits for the client to close its connection (30 s, else
/// panics), and answers all it sent after the cut.
async fn given_up_over_a_swallowing_path(db: &TestServer, form: SessionForm, id: i64) -> Vec<u8> {
    let proxy = Proxy::in_front_of(db);
    let sessions = SessionLock::new(proxy.config())
        .form(form)
        .keepalive(CADENCE);
    let guard = sessions.lock(Feed { id }).await.unwrap();
    let lost = guard.lost();
    proxy.cut(Cut::Swallow).await;
    tokio::time::timeout(BOUND, lost)
        .await
        .unwrap_or_else(|_| panic!("{form:?}: lost() did not resolve within {BOUND:?}"));
    // Given up, the connection is closed: all it sent is in.
    proxy.until_swallowed_closed().await;
    drop(guard);
    proxy.swallowed()
}

/// A lock given up over a silent path closes its connection at once, in
/// every form: its client socket does not stay open waiting for the answer
/// to the keepalive that went unanswered (tokio-postgres keeps a connection
/// whose client is gone open until its last statement is answered, which
/// over a silent path is never). The proxy reads what the clients send
/// after the cut and sees each close its connection. Keeping an
/// unclean connection open on drop (`.ci/mutations "owned connection"`)
/// fails it for the forms on a connection of their own.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_given_up_over_a_silent_path_closes_its_connection() {
    let db = TestServer::shared();
    let _log = db.guard();
    for (id, form) in [
        SessionForm::Transaction,
        SessionForm::SessionLevel,
        SessionForm::Multiplexed,
    ]
    .into_iter()
    .enumerate()
    {
        // Panics if the client keeps its connection open.
        given_up_over_a_swallowing_path(db, form, 61_000 + id as i64).await;
    }
}
