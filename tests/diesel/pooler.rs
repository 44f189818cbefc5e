//! lockkit-diesel behind a transaction-mode pgbouncer, where one Diesel
//! connection's transactions land on whichever server backend is free.
//!
//! Diesel names its cached prepared statements `__diesel_stmt_0`, `_1`, …
//! on every connection, so behind such a pooler a backend may hold another
//! client's statement under the name lockkit's lock statement gets, or none.
//! With [`StatementMode::Prepared`] (an opt-in; the default is `Unnamed`) a lock must then fail with
//! `UnexpectedReply`, never succeed without its lock; with
//! [`StatementMode::Unnamed`] every lock is real.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use diesel::{Connection, PgConnection, RunQueryDsl};
use lockkit::ErrorKind;
use lockkit_diesel::{AdvisoryKey, Config, Error, StatementMode};
use lockkit_tests::{PgBouncer, TestServer};

use crate::common::{connect, granted_elsewhere, locker};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-pooler")]
struct Job {
    id: i64,
}

const CLIENTS: usize = 4;
const ROUNDS: usize = 40;

/// Outcomes of `CLIENTS` Diesel connections through `bouncer`, each taking
/// `ROUNDS` locks (each client in its own form: lock, try, shared, try
/// shared) with statements in `mode`, each Ok checked in `pg_locks` from a direct
/// connection while it is held: (granted, refused as UnexpectedReply).
fn run(db: &TestServer, bouncer: &PgBouncer, mode: StatementMode, base: i64) -> (usize, usize) {
    let locker = locker(&mut connect(db), Config::default().statements(mode));
    let granted = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for client in 0..CLIENTS {
            let (locker, url) = (locker.clone(), bouncer.url());
            let (granted, refused) = (Arc::clone(&granted), Arc::clone(&refused));
            s.spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("through pgbouncer");
                let mut observer = connect(db);
                for round in 0..ROUNDS {
                    let job = Job {
                        id: base + (client * ROUNDS + round) as i64,
                    };
                    let outcome = locker.transaction(&mut conn, |tx| {
                        // Each client takes its locks in another form, so
                        // Diesel's first statement name means another
                        // lockkit statement on each client.
                        let held = match client % 4 {
                            0 => tx.lock(job)?,
                            1 => tx.try_lock(job)?.expect("distinct keys are free"),
                            2 => tx.lock_shared(job)?,
                            _ => tx.try_lock_shared(job)?.expect("distinct keys are free"),
                        };
                        // Never a success without the lock.
                        assert!(
                            granted_elsewhere(&mut observer, held.key()),
                            "lock() returned Ok without its row in pg_locks ({mode:?})"
                        );
                        Ok::<_, Error>(())
                    });
                    match outcome {
                        Ok(()) => granted.fetch_add(1, SeqCst),
                        Err(e) => {
                            assert_eq!(
                                e.kind(),
                                ErrorKind::UnexpectedReply,
                                "{e} {e:?} ({mode:?})"
                            );
                            refused.fetch_add(1, SeqCst)
                        }
                    };
                }
            });
        }
    });
    (granted.load(SeqCst), refused.load(SeqCst))
}

#[test]
fn behind_a_transaction_pooler_a_lock_is_real_or_refused() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::builder(db)
        .pool_mode("transaction")
        .default_pool_size(2)
        .start();

    let (granted, refused) = run(db, &bouncer, StatementMode::Unnamed, 0);
    assert_eq!(
        (granted, refused),
        (CLIENTS * ROUNDS, 0),
        "unnamed statements cannot collide"
    );

    // Diesel's cached statements: whatever the pooler does, every Ok was
    // checked in pg_locks and every refusal is typed.
    let (granted, refused) = run(db, &bouncer, StatementMode::Prepared, 100_000);
    assert_eq!(granted + refused, CLIENTS * ROUNDS);
    assert!(granted > 0, "some locks were real");
    eprintln!("prepared behind pgbouncer: {granted} granted, {refused} refused");
}

/// Only the reply check stands between a forged statement and a lock
/// reported held: behind a transaction-mode pgbouncer with one server
/// connection, every lockkit statement Diesel has prepared there is
/// replaced by a forgery (same name, parameters and reply shape, tag 7, no
/// lock; `lockkit_tests::forge`). Every lock call, in every form, is then
/// refused as `UnexpectedReply`, and no key is held on the server.
#[test]
fn a_forged_statement_behind_a_pooler_is_refused_by_the_reply_check() {
    let db = TestServer::shared();
    let _log = db.guard();
    let bouncer = PgBouncer::one_server_connection(db);
    // Named statements (the opt-in), whose reply check this is about.
    let locker = locker(
        &mut connect(db),
        Config::default()
            .statements(StatementMode::Prepared)
            .order_check(lockkit::OrderCheck::Off),
    );
    let mut observer = connect(db);
    let mut conn = PgConnection::establish(&bouncer.url()).expect("through pgbouncer");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for forged in [false, true] {
        if forged {
            runtime.block_on(lockkit_tests::forge::forge_behind(&bouncer));
        }
        for form in 0..5_i64 {
            let job = Job {
                id: 900_000 + form + if forged { 100 } else { 0 },
            };
            let result = locker.transaction(&mut conn, |tx| {
                let key = match form {
                    0 => tx.lock(job)?.key(),
                    1 => tx.lock_shared(job)?.key(),
                    2 => tx.try_lock(job)?.expect("free").key(),
                    3 => tx.try_lock_shared(job)?.expect("free").key(),
                    _ => {
                        let batch = lockkit_diesel::Batch::new()
                            .with(&job)
                            .with(&Job { id: job.id + 1 });
                        let _ = tx.lock_batch(&batch)?;
                        job.lock_key()
                    }
                };
                // Never a success without the lock.
                assert!(granted_elsewhere(&mut observer, key), "form {form}");
                Ok::<_, Error>(key)
            });
            match (forged, result) {
                (false, Ok(_)) => {}
                (true, Err(e)) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "form {form}: {e:?}");
                    assert!(!granted_elsewhere(&mut observer, job.lock_key()));
                }
                (forged, result) => panic!("form {form}, forged {forged}: {result:?}"),
            }
        }
    }
}

/// A `FATAL` error ends the session: pgbouncer's `query_wait_timeout` (a
/// `FATAL` `08P01` when no server connection was free in time, then the
/// client's connection closed) is `ConnectionLost`, never a bare database
/// error.
#[test]
fn a_fatal_error_of_the_pooler_is_a_lost_connection() {
    let db = TestServer::shared();
    let bouncer = PgBouncer::impatient(db);
    let locker = locker(&mut connect(db), Config::default());
    // Connected (Diesel's set-up statements run) before the pool is pinned.
    let mut conns: Vec<PgConnection> = (0..3)
        .map(|_| PgConnection::establish(&bouncer.url()).expect("through pgbouncer"))
        .collect();
    // The one server connection, pinned by a transaction left open.
    let mut pin = PgConnection::establish(&bouncer.url()).expect("through pgbouncer");
    diesel::sql_query("BEGIN").execute(&mut pin).unwrap();
    for (id, conn) in (0..).zip(conns.iter_mut()) {
        let e: Error = locker
            .transaction(conn, |tx| tx.lock(Job { id: 930_000 + id }).map(drop))
            .expect_err("no server connection was free within query_wait_timeout");
        assert_eq!(e.kind(), ErrorKind::ConnectionLost, "{e:?}");
    }
    diesel::sql_query("ROLLBACK").execute(&mut pin).unwrap();
}
