//! lockkit-diesel-async behind a transaction-mode pgbouncer: only the reply
//! check stands between a forged statement and a lock reported held, and
//! other processes' statements of the names diesel-async gives lockkit's
//! fail no lock call.

use std::num::NonZeroU8;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use lockkit_diesel_async::{
    AdvisoryKey, Batch, Config, Error, ErrorKind, Locker, OrderCheck, StatementMode,
};
use lockkit_tests::observe::simple_value;
use lockkit_tests::support::next_statement_name;
use lockkit_tests::{PgBouncer, TestServer};
use tokio_postgres::types::Type;

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
    let bouncer = PgBouncer::one_server_connection(db);
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

/// The pooler these tests share the server through, and another
/// process's statements on it: pgbouncer in transaction mode with one
/// server connection, a client of the server itself (`direct`: this
/// process's next statement name, and what is held), and `foreign`, a
/// client of the pooler that leaves its statements on the server
/// connection outside a transaction.
struct Littered {
    bouncer: PgBouncer,
    direct: tokio_postgres::Client,
    foreign: tokio_postgres::Client,
}

impl Littered {
    async fn new(db: &TestServer) -> Self {
        let bouncer = PgBouncer::one_server_connection(db);
        let foreign = bouncer.connect().await;
        Littered {
            bouncer,
            direct: db.connect().await,
            foreign,
        }
    }

    /// Another process's statements, left on the one server connection
    /// after it deallocated its earlier ones: every tokio-postgres name
    /// from this process's next one on (`s<next>`, 2,000 of them), which
    /// lockkit's statements are about to be prepared under, and the names
    /// of [`kept`]. Answers `next`.
    async fn litter(&self) -> usize {
        self.litter_past(0).await
    }

    /// [`Littered::litter`], with this process's next `skip` names left
    /// free.
    async fn litter_past(&self, skip: usize) -> usize {
        let next = next_statement_name(&self.direct).await;
        let mut script = String::from("DEALLOCATE ALL;");
        for n in next + skip..next + 2_000 {
            script.push_str(&format!("PREPARE s{n} AS SELECT 7::int8;"));
        }
        for name in kept(next) {
            script.push_str(&format!("PREPARE {name} AS SELECT 7::int8;"));
        }
        self.foreign
            .batch_execute(&script)
            .await
            .expect("the foreign statements");
        next
    }

    /// How many of the statements of [`kept`] for `next` are still on the
    /// server connection.
    async fn kept_left(&self, next: usize) -> i64 {
        let names: Vec<String> = kept(next).into();
        self.foreign
            .query_typed_one(
                "SELECT count(*) FROM pg_prepared_statements WHERE name = ANY($1)",
                &[(&names, Type::TEXT_ARRAY)],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    }
}

/// Foreign statements that lockkit's statements can never meet, so that
/// they stay on the server connection: sqlx's and Diesel's names, another
/// application's, and a tokio-postgres name this process has used already
/// (its counter only grows).
fn kept(next: usize) -> [String; 4] {
    [
        "sqlx_s_1".to_owned(),
        "__diesel_stmt_0".to_owned(),
        "billing_report".to_owned(),
        format!("s{}", next - 1),
    ]
}

/// lockkit's statements over diesel-async carry tokio-postgres's names
/// (`s0`, `s1`, … of this process). Behind a transaction-mode pgbouncer
/// that keeps no named statement per client, whose one server connection
/// holds another process's statements under exactly the names this process
/// uses next, a connection is made (`lockkit_diesel_async::establish`,
/// whose set-up's names are diesel-async's), the locker is made, and every
/// lock call succeeds in the default mode, each holding its key on the
/// server.
///
/// What lockkit removes from the server connection is only what could
/// meet its names: the foreign statements of other names stay, and so does
/// the application's own statement prepared in the transaction under a
/// name of the same form (the control that the repair spares what the
/// transaction itself prepared).
#[tokio::test(flavor = "multi_thread")]
async fn every_lock_call_succeeds_behind_a_pooler_holding_this_processs_next_names() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pooler = Littered::new(db).await;
    pooler.litter().await;
    let mut conn = lockkit_diesel_async::establish(&pooler.bouncer.url())
        .await
        .expect("diesel-async's set-up, behind the littered pooler");
    pooler.litter().await;
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = Locker::new(&mut conn, config)
        .await
        .expect("the server's facts, learned through the pooler");
    for form in 0..9_i64 {
        let next = pooler.litter().await;
        let job = Job {
            id: 960_000 + 10 * form,
        };
        let own = format!("s{}", next + 5_000);
        let (locker, observer, own) = (&locker, &pooler.direct, &own);
        let key = conn
            .transaction::<_, Error, _>(async |conn| {
                conn.batch_execute(&format!("PREPARE {own} AS SELECT 1"))
                    .await?;
                let mut tx = locker.lock_tx(conn)?;
                let one = NonZeroU8::MIN;
                let pair = Batch::new().with(&job).with(&Job { id: job.id + 1 });
                let key = match form {
                    0 => tx.lock(job).await?.key(),
                    1 => tx.lock_shared(job).await?.key(),
                    2 => tx.try_lock(job).await?.expect("free").key(),
                    3 => tx.try_lock_shared(job).await?.expect("free").key(),
                    4 => tx.lock_timeout(job, Duration::from_secs(60)).await?.key(),
                    5 => tx.lock_batch(&pair).await?.keys()[0].0,
                    6 => tx.try_lock_batch(&pair).await?.expect("free").keys()[0].0,
                    7 => tx.acquire_permit(job, one).await?.key(),
                    _ => tx.try_acquire_permit(job, one).await?.expect("free").key(),
                };
                // Never a success without the lock.
                assert!(granted_elsewhere(observer, key).await, "form {form}");
                tx.conn().batch_execute(&format!("EXECUTE {own}")).await?;
                Ok(key)
            })
            .await
            .unwrap_or_else(|e| panic!("form {form}: {e}"));
        assert!(!granted_elsewhere(observer, key).await, "form {form}");
        assert_eq!(
            pooler.kept_left(next).await,
            4,
            "form {form}: the foreign statements that cannot clash"
        );
    }
}

/// `establish` learns this process's next name with a statement of its
/// own before diesel-async's set-up: when that name is free but the ones
/// after it are another process's, it still clears them, and the set-up
/// succeeds; the foreign statements that cannot meet this process's names
/// stay.
#[tokio::test(flavor = "multi_thread")]
async fn establish_clears_the_names_after_a_free_one() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pooler = Littered::new(db).await;
    let next = pooler.litter_past(1).await;
    let mut conn = lockkit_diesel_async::establish(&pooler.bouncer.url())
        .await
        .expect("diesel-async's set-up, behind the littered pooler");
    conn.batch_execute("SELECT 1").await.unwrap();
    assert_eq!(
        pooler.kept_left(next).await,
        4,
        "the foreign statements that cannot clash"
    );
}

/// The clear spares what the transaction itself prepared: when the
/// application prepared, in the same transaction, statements under the
/// names lockkit's next statements get (500 of them: the other tests of
/// this binary, running meanwhile, use up names of the same process
/// counter), the one clear cannot make way, and
/// the call fails after it, typed as the clash, holding nothing, instead of
/// clearing and sending again for as long as names are taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_clash_the_clear_cannot_repair_fails_the_call_after_one_clear() {
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = db.connect().await;
    let mut conn = AsyncPgConnection::establish(db.url()).await.unwrap();
    let config = Config::default().order_check(OrderCheck::Off);
    let locker = Locker::new(&mut conn, config).await.unwrap();
    let job = Job { id: 970_000 };
    let (locker, observer) = (&locker, &observer);
    let answer = conn
        .transaction::<(), Error, _>(async |conn| {
            let next = next_statement_name(observer).await;
            let own: String = (next..next + 500)
                .map(|n| format!("PREPARE s{n} AS SELECT 1;"))
                .collect();
            conn.batch_execute(&own).await?;
            let mut tx = locker.lock_tx(conn)?;
            let e = tx.lock(job).await.expect_err("every next name is taken");
            assert!(!granted_elsewhere(observer, job.lock_key()).await);
            Err(e)
        })
        .await;
    let e = answer.expect_err("the call failed");
    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e}");
    assert_eq!(e.code(), Some("42P05"), "{e}");
}

/// In the opt-in `StatementMode::Prepared`, lockkit's statements go into
/// diesel-async's statement cache under tokio-postgres's names, not safe
/// behind such a pooler: a name another process left on the server
/// connection fails the lock call, typed as the clash (`UnexpectedReply`,
/// `42P05`) with the fix in its message, and nothing is held. The README's
/// pooler section says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_name_clash_in_prepared_mode_is_typed_and_says_the_fix() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pooler = Littered::new(db).await;
    let mut conn = AsyncPgConnection::establish(&pooler.bouncer.url())
        .await
        .unwrap();
    let mut on_server = AsyncPgConnection::establish(db.url()).await.unwrap();
    let config = Config::default().statements(StatementMode::Prepared);
    let locker = Locker::new(&mut on_server, config).await.unwrap();
    pooler.litter().await;
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
    assert!(!granted_elsewhere(&pooler.direct, job.lock_key()).await);
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
            let bouncer = PgBouncer::one_server_connection(db);
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
