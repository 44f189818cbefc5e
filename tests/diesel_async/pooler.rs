//! lockkit-diesel-async behind a transaction-mode pgbouncer: only the reply
//! check stands between a forged statement and a lock reported held.

use diesel_async::{AsyncConnection, AsyncPgConnection};
use lockkit_diesel_async::{
    AdvisoryKey, Batch, Config, Error, ErrorKind, Locker, OrderCheck, StatementMode,
};
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
    let (foreign, foreign_conn) = bouncer
        .config()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(foreign_conn);
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
