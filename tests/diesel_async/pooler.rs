//! lockkit-diesel-async behind a transaction-mode pgbouncer: only the reply
//! check stands between a forged statement and a lock reported held.

use diesel_async::{AsyncConnection, AsyncPgConnection};
use lockkit_diesel_async::{
    AdvisoryKey, Batch, Config, Error, ErrorKind, Locker, OrderCheck, StatementMode,
};
use lockkit_tests::observe::simple_value;
use lockkit_tests::{PgBouncer, TestServer};

use crate::common::granted_elsewhere;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-async-pooler")]
struct Job {
    id: i64,
}

/// Behind a transaction-mode pgbouncer with one server connection, every
/// lockkit statement diesel-async has prepared there is replaced by a
/// forgery (same name, parameters and reply shape, tag 7, no lock;
/// `lockkit_tests::forge`). Every lock call, in every form, is then refused
/// as `UnexpectedReply`, and no key is held on the server.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_statement_behind_a_pooler_is_refused_by_the_reply_check() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(1)
        .start();
    let mut direct = AsyncPgConnection::establish(db.url()).await.unwrap();
    // Named statements (the opt-in), whose reply check this is about.
    let config = Config::default()
        .statements(StatementMode::Prepared)
        .order_check(OrderCheck::Off);
    let locker = Locker::new(&mut direct, config).await.unwrap();
    let observer = db.connect().await;
    let mut conn = AsyncPgConnection::establish(&bouncer.url())
        .await
        .expect("through pgbouncer");
    for forged in [false, true] {
        if forged {
            lockkit_tests::forge::forge_behind(&bouncer).await;
        }
        for form in 0..5_i64 {
            let job = Job {
                id: 900_000 + form + if forged { 100 } else { 0 },
            };
            let (locker, observer) = (&locker, &observer);
            let result = conn
                .transaction::<_, Error, _>(async |conn| {
                    let mut tx = locker.lock_tx(conn)?;
                    let key = match form {
                        0 => tx.lock(job).await?.key(),
                        1 => tx.lock_shared(job).await?.key(),
                        2 => tx.try_lock(job).await?.expect("free").key(),
                        3 => tx.try_lock_shared(job).await?.expect("free").key(),
                        _ => {
                            let batch = Batch::new().with(&job).with(&Job { id: job.id + 1 });
                            let _ = tx.lock_batch(&batch).await?;
                            job.lock_key()
                        }
                    };
                    // Never a success without the lock.
                    assert!(granted_elsewhere(observer, key).await, "form {form}");
                    Ok(key)
                })
                .await;
            match (forged, result) {
                (false, Ok(_)) => {}
                (true, Err(e)) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "form {form}: {e:?}");
                    assert!(!granted_elsewhere(observer, job.lock_key()).await);
                }
                (forged, result) => panic!("form {form}, forged {forged}: {result:?}"),
            }
        }
    }
}

/// diesel-async names every statement it sends (tokio-postgres's `s0`,
/// `s1`, … of this process), in either `StatementMode`: behind a
/// transaction-mode pgbouncer whose server connection holds statements of
/// those names (another process's), a lock call fails, typed as the clash
/// (`UnexpectedReply`, `42P05`) with the fix in its message, and nothing is
/// held. The README's pooler section says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_name_clash_behind_a_shared_pooler_is_typed_and_says_the_fix() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(1)
        .start();
    let observer = db.connect().await;
    // Connected first: diesel-async's own set-up prepares named statements
    // too, and would meet the foreign ones before lockkit's do.
    let mut direct = AsyncPgConnection::establish(db.url()).await.unwrap();
    let locker = Locker::new(&mut direct, Config::default()).await.unwrap();
    let mut conn = AsyncPgConnection::establish(&bouncer.url()).await.unwrap();
    // This process's next tokio-postgres statement name.
    let next: usize = {
        let probe_client = db.connect().await;
        let _probe = probe_client.prepare("SELECT 525252").await.unwrap();
        let row = probe_client
            .query_typed_one(
                "SELECT name FROM pg_prepared_statements WHERE statement = 'SELECT 525252'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, String>(0)
            .trim_start_matches('s')
            .parse::<usize>()
            .unwrap()
            + 1
    };
    // Another process's statements of the names this one will use next,
    // left on the pooler's one server connection.
    let foreign = bouncer.connect().await;
    let script: String = (next..next + 2_000)
        .map(|n| format!("PREPARE s{n} AS SELECT 7::int8;"))
        .collect();
    foreign.batch_execute(&script).await.unwrap();
    let job = Job { id: 950_000 };
    let answer: Result<(), Error> = locker
        .transaction(&mut conn, |tx| {
            Box::pin(async move {
                let _ = tx.lock(job).await?;
                Ok(())
            })
        })
        .await;
    let e = answer.expect_err("the statement's name is taken on the server connection");
    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e}");
    assert_eq!(e.code(), Some("42P05"), "{e}");
    assert!(e.to_string().contains("max_prepared_statements"), "{e}");
    assert!(!granted_elsewhere(&observer, job.lock_key()).await);
}

/// A `FATAL` error ends the session: pgbouncer's `query_wait_timeout` (a
/// `FATAL` `08P01` when no server connection was free in time, then the
/// client's connection closed) is `ConnectionLost`, never a bare database
/// error.
#[tokio::test(flavor = "multi_thread")]
async fn a_fatal_error_of_the_pooler_is_a_lost_connection() {
    use diesel_async::RunQueryDsl;
    let db = TestServer::shared();
    let bouncer = PgBouncer::impatient(db);
    let mut direct = AsyncPgConnection::establish(db.url()).await.unwrap();
    let locker = Locker::new(&mut direct, Config::default()).await.unwrap();
    // Connected (diesel-async's set-up statements run) before the pool is
    // pinned.
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(
            AsyncPgConnection::establish(&bouncer.url())
                .await
                .expect("through pgbouncer"),
        );
    }
    // The one server connection, pinned by a transaction left open.
    let mut pin = AsyncPgConnection::establish(&bouncer.url())
        .await
        .expect("through pgbouncer");
    diesel::sql_query("BEGIN").execute(&mut pin).await.unwrap();
    for (id, conn) in (0..).zip(conns.iter_mut()) {
        let e: Error = locker
            .transaction(conn, |tx| {
                Box::pin(async move { tx.lock(Job { id: 940_000 + id }).await.map(drop) })
            })
            .await
            .expect_err("no server connection was free within query_wait_timeout");
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e:?}");
    }
    diesel::sql_query("ROLLBACK")
        .execute(&mut pin)
        .await
        .unwrap();
}

/// How a connection is opened, for [`a_dropped_connection_answers_before_it_closes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Opened {
    /// diesel-async's own `establish` (the control).
    DieselAsync,
    /// `lockkit_diesel_async::establish`.
    Lockkit,
}

/// Behind a transaction-mode pgbouncer 1.18 with one server connection: a
/// diesel-async connection sends two statements at once and is dropped
/// once the first is answered, the second still running (what
/// diesel-async's set-up does when its first statement fails, and any
/// pipelined query cut off), then another client asks.
/// From `lockkit_diesel_async::establish`, the connection reads the answer
/// it is owed before it closes, and the other client always reads its own
/// answer. The control: from diesel-async's `establish`, the connection
/// closes at once, pgbouncer hands the server connection on with the
/// statement still running, and the other client reads that statement's
/// answer as its own (`TESTING.md`, the fleet's misrouted replies).
// One thread: both statements are queued before the connection's task
// writes, so they leave in one write and reach pgbouncer together.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_connection_answers_before_it_closes() {
    use diesel::sql_types::Integer;
    use diesel::IntoSql;
    use diesel_async::RunQueryDsl;
    use std::pin::pin;
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    observer
        .batch_execute(
            "CREATE OR REPLACE FUNCTION lockkit_tests_sleep(seconds float8) \
             RETURNS int LANGUAGE sql AS 'SELECT 1 FROM pg_sleep(seconds)'",
        )
        .await
        .unwrap();
    for opened in [Opened::DieselAsync, Opened::Lockkit] {
        // Whether pgbouncer sees the fast answer leave its server
        // connection idle with the slow statement still on it depends on
        // how the two statements' messages reach it: in some rounds they
        // do not (about half, in 2-core runs). So the control runs until
        // it misroutes (at most 40 rounds), and lockkit's connections run
        // 24 rounds.
        let rounds = match opened {
            Opened::DieselAsync => 40,
            Opened::Lockkit => 24,
        };
        let mut misrouted = 0;
        for round in 0..rounds {
            // A pooler of its own each round: a misrouted answer leaves the
            // next one out of step too.
            let bouncer = PgBouncer::builder(db).default_pool_size(1).start();
            let conn = match opened {
                Opened::DieselAsync => AsyncPgConnection::establish(&bouncer.url()).await,
                Opened::Lockkit => lockkit_diesel_async::establish(&bouncer.url()).await,
            }
            .expect("through pgbouncer");
            // Both statements prepared first (diesel-async caches them), so
            // that below each goes out as one bind and execute, at once.
            let fast = || diesel::select(1.into_sql::<Integer>());
            let slow = |seconds: f64| diesel::select(lockkit_tests_sleep(seconds));
            let _: i32 = fast().get_result(&mut &conn).await.unwrap();
            let _: i32 = slow(0.0).get_result(&mut &conn).await.unwrap();
            {
                // Two statements at once: the fast one's answer (the server
                // connection idle again, for pgbouncer) while the slow one
                // still runs.
                let mut fast = pin!(fast().get_result::<i32>(&mut &conn));
                let mut slow = pin!(slow(0.3).get_result::<i32>(&mut &conn));
                let mut fast_done = false;
                loop {
                    tokio::select! {
                        // The fast one first: it is sent first.
                        biased;
                        r = &mut fast, if !fast_done => {
                            r.expect("the fast statement");
                            fast_done = true;
                        }
                        r = &mut slow => panic!("the slow statement ended first: {r:?}"),
                        () = sleeping(&observer), if fast_done => break,
                    }
                }
            }
            drop(conn);

            let b = bouncer.connect().await;
            let answer = simple_value(&b, "SELECT 'of B'")
                .await
                .map_err(|e| e.to_string());
            eprintln!("{opened:?} round {round}: B read {answer:?}");
            if answer != Ok(Some("of B".to_owned())) {
                misrouted += 1;
                if opened == Opened::DieselAsync {
                    break;
                }
            }
        }
        match opened {
            Opened::DieselAsync => assert_eq!(
                misrouted, 1,
                "the control: pgbouncer never handed the running statement's answer on"
            ),
            Opened::Lockkit => assert_eq!(misrouted, 0, "answers read by the next client"),
        }
    }
}

diesel::define_sql_function! {
    /// Sleeps `seconds`, then answers 1 (created by the test that uses it).
    fn lockkit_tests_sleep(seconds: diesel::sql_types::Double) -> Integer;
}

/// Waits until a call of `lockkit_tests_sleep` sleeps on the server.
async fn sleeping(observer: &tokio_postgres::Client) {
    lockkit_tests::observe::wait_until_true(
        observer,
        "SELECT count(*) > 0 FROM pg_stat_activity WHERE state = 'active' \
         AND wait_event = 'PgSleep' AND query LIKE '%lockkit_tests_sleep%'",
        "lockkit_tests_sleep sleeping",
    )
    .await;
}
