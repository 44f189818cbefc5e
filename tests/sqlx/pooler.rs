//! lockkit-sqlx behind a transaction-mode pgbouncer (1.18: no prepared
//! statement tracking), where one sqlx connection's transactions land on
//! whichever server backend is free.
//!
//! sqlx names its cached statements `sqlx_s_1`, `sqlx_s_2`, … on every
//! connection, so behind such a pooler a backend may hold another client's
//! statement under the name lockkit's lock statement gets, or none. With
//! [`StatementMode::Prepared`] (an opt-in; the default is `Unnamed`) a lock may then fail (typed, as
//! `UnexpectedReply` or the server's error), never succeed without its
//! lock; with [`StatementMode::Unnamed`] every lock is real.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use lockkit_sqlx::{AdvisoryKey, Config, Error, ErrorKind, Locker, OrderCheck, StatementMode};
use lockkit_tests::{PgBouncer, TestServer};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

use crate::common::{connect, granted_elsewhere};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-pooler")]
struct Job {
    id: i64,
}

const CLIENTS: usize = 4;
const ROUNDS: usize = 40;

/// Outcomes of `CLIENTS` sqlx connections through `bouncer`, each taking
/// `ROUNDS` locks (each client in its own form, after a query of its own
/// so that statement names mean different statements on each client), each
/// Ok checked in `pg_locks` from a direct connection while it is held:
/// (granted, refused, each refusal's step and error).
async fn run(
    db: &TestServer,
    bouncer: &PgBouncer,
    mode: StatementMode,
    base: i64,
) -> (usize, usize, Vec<(&'static str, Error)>) {
    let locker = Locker::new(
        &mut connect(db).await,
        Config::default()
            .statements(mode)
            .order_check(OrderCheck::Off),
    )
    .await
    .unwrap();
    let granted = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let kinds = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let (locker, url) = (locker.clone(), bouncer.url());
        let (granted, refused, kinds) = (
            Arc::clone(&granted),
            Arc::clone(&refused),
            Arc::clone(&kinds),
        );
        let observer = db.connect().await;
        tasks.push(tokio::spawn(async move {
            let options = PgConnectOptions::from_str(&url)
                .unwrap()
                .extra_float_digits(None);
            let mut conn = options.connect().await.expect("through pgbouncer");
            for round in 0..ROUNDS {
                let job = Job {
                    id: base + (client * ROUNDS + round) as i64,
                };
                let outcome: Result<(), (&str, Error)> = async {
                    let mut tx = conn
                        .begin()
                        .await
                        .map_err(|e| ("begin", lockkit_sqlx::lock_error(e)))?;
                    {
                        let mut ltx = locker.lock_tx(&mut tx).map_err(|e| ("lock", e))?;
                        // A statement of the client's own first, on some
                        // clients, so the names shift between clients.
                        for _ in 0..client % 2 {
                            // Named (as sqlx does by default) only in the
                            // prepared run: unnamed, it cannot collide.
                            sqlx::query("SELECT $1::int4 + 1")
                                .persistent(mode == StatementMode::Prepared)
                                .bind(client as i32)
                                .execute(&mut *ltx)
                                .await
                                .map_err(|e| ("own query", lockkit_sqlx::lock_error(e)))?;
                        }
                        let key = match client % 4 {
                            0 => ltx.lock(job).await.map(|h| h.key()),
                            1 => ltx
                                .try_lock(job)
                                .await
                                .map(|h| h.expect("distinct keys are free").key()),
                            2 => ltx.lock_shared(job).await.map(|h| h.key()),
                            _ => ltx
                                .try_lock_shared(job)
                                .await
                                .map(|h| h.expect("distinct keys are free").key()),
                        }
                        .map_err(|e| ("lock", e))?;
                        // Never a success without the lock.
                        assert!(
                            granted_elsewhere(&observer, key).await,
                            "client {client}: a lock returned Ok without its row in \
                             pg_locks ({mode:?})"
                        );
                    }
                    tx.commit()
                        .await
                        .map_err(|e| ("commit", lockkit_sqlx::lock_error(e)))
                }
                .await;
                match outcome {
                    Ok(()) => {
                        granted.fetch_add(1, SeqCst);
                    }
                    Err(refusal) => {
                        kinds.lock().unwrap().push(refusal);
                        refused.fetch_add(1, SeqCst);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client panicked");
    }
    let kinds = std::mem::take(&mut *kinds.lock().unwrap());
    (granted.load(SeqCst), refused.load(SeqCst), kinds)
}

#[tokio::test(flavor = "multi_thread")]
async fn behind_a_transaction_pooler_a_lock_is_real_or_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(2)
        .start();

    let (granted, refused, kinds) = run(db, &bouncer, StatementMode::Unnamed, 300_000).await;
    assert_eq!(
        (granted, refused),
        (CLIENTS * ROUNDS, 0),
        "unnamed statements cannot collide: {kinds:?}"
    );

    // sqlx's cached statements: whatever the pooler does, every Ok was
    // checked in pg_locks, and a refusal is an error, never a lock call
    // that said Ok.
    let (granted, refused, kinds) = run(db, &bouncer, StatementMode::Prepared, 400_000).await;
    assert_eq!(granted + refused, CLIENTS * ROUNDS);
    eprintln!("prepared behind pgbouncer: {granted} granted, {refused} refused");
    let mut distinct: Vec<String> = kinds
        .iter()
        .map(|(step, e)| format!("{step}: {:?} {:?}", e.kind(), e.code()))
        .collect();
    distinct.sort();
    distinct.dedup();
    for k in &distinct {
        eprintln!("  {k}");
    }
    for (step, e) in &kinds {
        match *step {
            // A lock call refused because the statement of that name on the
            // backend is another client's: typed so (22P03, 08P01, 26000,
            // 42P05 or a row of another shape), not a server error.
            "lock" => assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e:?}"),
            // The client's own statement refused at its Bind (08P01): the
            // connection and the transaction's locks live on; not "lost".
            _ => assert!(!e.is_connection_lost(), "{step}: {e:?}"),
        }
    }
}

/// Only the reply check stands between a forged statement and a lock
/// reported held: behind a transaction-mode pgbouncer with one server
/// connection, every lockkit statement sqlx has prepared there is replaced
/// by a forgery (same name, parameters and reply shape, tag 7, no lock;
/// `lockkit_tests::forge`). Every lock call, in every form, is then
/// refused as `UnexpectedReply`, and no key is held on the server.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_statement_behind_a_pooler_is_refused_by_the_reply_check() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::one_server_connection(db);
    // Named statements (the opt-in), whose reply check this is about.
    let locker = Locker::new(
        &mut connect(db).await,
        Config::default()
            .statements(StatementMode::Prepared)
            .order_check(OrderCheck::Off),
    )
    .await
    .unwrap();
    let observer = db.connect().await;
    let options = PgConnectOptions::from_str(&bouncer.url())
        .unwrap()
        .extra_float_digits(None);
    let mut conn = options.connect().await.expect("through pgbouncer");
    // Each form once, for real: sqlx prepares its statement on the backend.
    for forged in [false, true] {
        if forged {
            lockkit_tests::forge::forge_behind(&bouncer).await;
        }
        for form in 0..5_i64 {
            let job = Job {
                id: 900_000 + form + if forged { 100 } else { 0 },
            };
            let mut tx = conn.begin().await.unwrap();
            let result = {
                let mut ltx = locker.lock_tx(&mut tx).unwrap();
                match form {
                    0 => ltx.lock(job).await.map(|h| h.key()),
                    1 => ltx.lock_shared(job).await.map(|h| h.key()),
                    2 => ltx.try_lock(job).await.map(|h| h.expect("free").key()),
                    3 => ltx
                        .try_lock_shared(job)
                        .await
                        .map(|h| h.expect("free").key()),
                    _ => ltx
                        .lock_batch(
                            &lockkit_sqlx::Batch::new()
                                .with(&job)
                                .with(&Job { id: job.id + 1 }),
                        )
                        .await
                        .map(|_| job.lock_key()),
                }
            };
            match (forged, result) {
                (false, Ok(key)) => assert!(granted_elsewhere(&observer, key).await),
                (true, Err(e)) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "form {form}: {e:?}");
                    assert!(!granted_elsewhere(&observer, job.lock_key()).await);
                }
                (forged, result) => panic!("form {form}, forged {forged}: {result:?}"),
            }
            tx.rollback().await.unwrap();
        }
    }
}

/// A `FATAL` error ends the session, whatever sqlx has yet read of the
/// socket behind it: pgbouncer's `query_wait_timeout` (a `FATAL` `08P01`
/// when no server connection was free in time) is `ConnectionLost`, never a
/// bare database error.
#[tokio::test(flavor = "multi_thread")]
async fn a_fatal_error_of_the_pooler_is_a_lost_connection() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::impatient(db);
    let locker = Locker::new(&mut connect(db).await, Config::default())
        .await
        .unwrap();
    // The one server connection, pinned by a transaction left open.
    let options = PgConnectOptions::from_str(&bouncer.url()).unwrap();
    let mut pin = options.connect().await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT 1")
        .execute(&mut pin)
        .await
        .unwrap();
    for id in 0..3 {
        let mut conn = options.connect().await.unwrap();
        let e = locker
            .transaction(&mut conn, |tx| {
                Box::pin(async move { tx.lock(Job { id: 920_000 + id }).await.map(drop) })
            })
            .await
            .expect_err("no server connection was free within query_wait_timeout");
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e:?}");
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut pin).await.unwrap();
}
