//! The API end to end: batches over both key spaces, try and try-batch (all
//! or nothing), timeouts that leave the transaction usable, savepoints that
//! forget what they released, the budget, the order check, standby refusal,
//! `HashText` keys, and errors that convert with `?`.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{sql_query, Connection, PgConnection, QueryableByName, RunQueryDsl};
use lockkit::key::HashText;
use lockkit::ErrorKind;
use lockkit::{AdvisoryKey, ServerFacts};
use lockkit_diesel::{Batch, Config, Error, Locker, Mode, OrderCheck};
use lockkit_tests::aborted::Aborting;
use lockkit_tests::TestServer;

use crate::common::{connect, granted_elsewhere, locker};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-api")]
struct Item {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/diesel-api-pair", pair)]
struct Cell {
    id: i64,
}

#[derive(QueryableByName)]
struct Timeouts {
    #[diesel(sql_type = Text)]
    lock_timeout: String,
    #[diesel(sql_type = Text)]
    statement_timeout: String,
}

#[test]
fn batch_try_and_timeout() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b, mut observer) = (connect(db), connect(db), connect(db));
    // This test takes single keys below held ones on purpose.
    let locker = locker(
        &mut a,
        Config::default().order_check(lockkit::OrderCheck::Off),
    );
    assert!(locker.policy().facts().max_locks_per_transaction() >= 64);
    assert!(!locker.policy().facts().in_recovery());
    assert!(locker.policy().recognizes_errors());

    a.transaction::<(), Error, _>(|a| {
        let mut tx_a = locker.lock_tx(a)?;
        let batch = Batch::new()
            .with(&Item { id: 12 })
            .with(&Cell { id: 11 })
            .with(&Item { id: 11 })
            .with_shared(&Item { id: 13 });
        let held = tx_a.lock_batch(&batch)?;
        assert_eq!(held.keys().len(), 4);
        assert!(held.contains(&Cell { id: 11 }));
        assert_eq!(held.proof(Item { id: 11 }).unwrap().id, 11);
        assert_eq!(tx_a.held_count(), 4);
        for key in [Item { id: 12 }.lock_key(), Cell { id: 11 }.lock_key()] {
            assert!(granted_elsewhere(&mut observer, key));
        }
        // Locking a held key again sends nothing and counts once.
        let again = tx_a.lock(Item { id: 12 })?;
        assert_eq!(again.mode(), Mode::Exclusive);
        assert_eq!(tx_a.held_count(), 4);

        locker.transaction(&mut b, |tx_b| {
            let busy = tx_b.try_lock(Item { id: 11 })?.unwrap_err();
            assert_eq!(busy, Item { id: 11 });
            assert!(
                tx_b.try_lock_shared(Item { id: 13 })?.is_ok(),
                "shared locks admit each other"
            );

            // All or nothing, across both key spaces: 14 and Cell 20 are
            // free, Cell 11 is busy, so none of them is taken.
            let all = Batch::new()
                .with(&Item { id: 14 })
                .with(&Cell { id: 11 })
                .with(&Cell { id: 20 });
            let busy = tx_b.try_lock_batch(&all)?.unwrap_err();
            assert_eq!(busy.keys(), [Cell { id: 11 }.lock_key()]);
            assert!(!tx_b.holds(&Item { id: 14 }, Mode::Exclusive));
            for key in [Item { id: 14 }.lock_key(), Cell { id: 20 }.lock_key()] {
                assert!(!granted_elsewhere(&mut observer, key), "{key}");
            }

            let err = tx_b
                .lock_timeout(Item { id: 12 }, Duration::from_millis(100))
                .unwrap_err();
            assert!(err.is_timeout(), "{err}");
            assert!(err.is_transient());
            let err = tx_b
                .lock_batch_timeout(&all, Duration::from_millis(100))
                .unwrap_err();
            assert!(err.is_timeout(), "{err}");
            assert!(!granted_elsewhere(
                &mut observer,
                Item { id: 14 }.lock_key()
            ));
            // Still usable, and the caller's timeouts are back.
            let t: Timeouts = sql_query(
                "SELECT current_setting('lock_timeout') AS lock_timeout, \
                 current_setting('statement_timeout') AS statement_timeout",
            )
            .get_result(tx_b.conn())?;
            assert_eq!(
                (t.lock_timeout.as_str(), t.statement_timeout.as_str()),
                ("0", "0")
            );
            // Free: the bound (also the statement's) only guards a hang.
            let got = tx_b.lock_timeout(Item { id: 14 }, Duration::from_secs(30))?;
            assert_eq!(got.mode(), Mode::Exclusive);
            let batch = Batch::new().with(&Cell { id: 20 }).with(&Item { id: 15 });
            assert!(tx_b.try_lock_batch(&batch)?.is_ok());
            assert_eq!(tx_b.held_count(), 4);
            Ok::<_, Error>(())
        })?;
        Ok(())
    })
    .unwrap();
    for id in [11, 12, 13, 14, 15] {
        assert!(!granted_elsewhere(&mut observer, Item { id }.lock_key()));
    }
}

#[test]
fn savepoint_rollback_forgets_locks_and_budget() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer) = (connect(db), connect(db));
    let locker = locker(&mut a, Config::default().budget(2));
    locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(Item { id: 21 })?;
            let err = tx
                .savepoint(|sp| {
                    assert_eq!(sp.depth(), 1);
                    let _ = sp.lock(Item { id: 22 })?;
                    assert_eq!(sp.held_count(), 2);
                    let over = sp.lock(Item { id: 23 }).unwrap_err();
                    assert_eq!(over.budget_counts(), Some((2, 1, 2)), "{over}");
                    Err::<(), _>(Error::from(diesel::result::Error::RollbackTransaction))
                })
                .unwrap_err();
            assert!(err.kind() == ErrorKind::Database);
            assert_eq!(
                tx.held_count(),
                1,
                "the rolled-back savepoint's lock is forgotten"
            );
            assert!(!granted_elsewhere(
                &mut observer,
                Item { id: 22 }.lock_key()
            ));
            assert!(granted_elsewhere(&mut observer, Item { id: 21 }.lock_key()));
            // Its budget is back.
            tx.savepoint(|sp| {
                let _ = sp.lock(Item { id: 23 })?;
                Ok::<_, Error>(())
            })?;
            assert!(tx.holds(&Item { id: 23 }, Mode::Exclusive));
            assert!(granted_elsewhere(&mut observer, Item { id: 23 }.lock_key()));
            let over = tx.lock(Item { id: 24 }).unwrap_err();
            assert!(over.kind() == ErrorKind::BudgetExceeded, "{over}");
            // A budget error sent nothing: the transaction is fine.
            tx.conn().batch_execute("SELECT 1")?;
            Ok::<_, Error>(())
        })
        .unwrap();
    assert!(!granted_elsewhere(
        &mut observer,
        Item { id: 23 }.lock_key()
    ));
}

/// Diesel's own nested `transaction` inside a `lock_tx`: the savepoint it
/// rolls back releases its own locks in the server, and the outer `LockTx`
/// could not have taken any inside it.
#[test]
fn savepoint_inside_diesels_transaction() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut observer) = (connect(db), connect(db));
    let locker = locker(&mut a, Config::default());
    a.transaction::<(), Error, _>(|conn| {
        let mut tx = locker.lock_tx(conn)?;
        let _ = tx.lock(Item { id: 31 })?;
        let _ = tx.savepoint(|sp| {
            let _ = sp.lock(Item { id: 32 })?;
            assert!(granted_elsewhere(&mut observer, Item { id: 32 }.lock_key()));
            Err::<(), Error>(Error::from(ErrorKind::NotInTransaction))
        });
        assert!(!tx.holds(&Item { id: 32 }, Mode::Shared));
        assert!(!granted_elsewhere(
            &mut observer,
            Item { id: 32 }.lock_key()
        ));
        // Diesel's nested transaction with a LockTx of its own.
        let _ = tx.conn().transaction::<(), Error, _>(|inner| {
            let mut inner_tx = locker.lock_tx(inner)?;
            let _ = inner_tx.lock(Item { id: 33 })?;
            Err(diesel::result::Error::RollbackTransaction.into())
        });
        assert!(!granted_elsewhere(
            &mut observer,
            Item { id: 33 }.lock_key()
        ));
        assert!(granted_elsewhere(&mut observer, Item { id: 31 }.lock_key()));
        Ok(())
    })
    .unwrap();
}

#[test]
fn order_check_refuses_a_lower_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = connect(db);
    let locker = locker(&mut a, Config::default().order_check(OrderCheck::Error));
    let (x, y) = (Item { id: 1 }, Item { id: 2 });
    let (low, high) = if x.lock_key() < y.lock_key() {
        (x, y)
    } else {
        (y, x)
    };
    locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(high)?;
            let err = tx.lock(low).unwrap_err();
            assert!(
                err.lock_order_keys() == Some((high.lock_key(), low.lock_key())),
                "{err}"
            );
            assert_eq!(tx.held_count(), 1, "nothing was sent");
            Ok::<_, Error>(())
        })
        .unwrap();
}

#[test]
fn standby_and_hashtext_mismatch_are_refused_before_sending() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = connect(db);
    let real = locker(&mut a, Config::default());
    let probes: Vec<i32> = lockkit::driver::HASHTEXT_PROBES
        .iter()
        .map(|p| lockkit::key::hashtext(p))
        .collect();
    let standby = Locker::with_facts(
        Config::default(),
        ServerFacts::from(&lockkit::driver::FactsRow {
            max_locks: 64,
            max_connections: 100,
            in_recovery: true,
            version_num: real.policy().facts().server_version_num(),
            hashes: probes.clone(),
            backend_pid: 0,
        }),
    );
    let mut bad = probes.clone();
    bad[1] ^= 1;
    let mismatch = Locker::with_facts(
        Config::default(),
        ServerFacts::from(&lockkit::driver::FactsRow {
            max_locks: 64,
            max_connections: 100,
            in_recovery: false,
            version_num: real.policy().facts().server_version_num(),
            hashes: bad,
            backend_pid: 0,
        }),
    );
    standby
        .transaction(&mut a, |tx| {
            assert!(tx
                .lock(Item { id: 41 })
                .is_err_and(|e| e.kind() == ErrorKind::HotStandby));
            Ok::<_, Error>(())
        })
        .unwrap();
    let allowed = Locker::with_facts(
        Config::default().allow_standby(true),
        ServerFacts::from(&lockkit::driver::FactsRow {
            max_locks: 64,
            max_connections: 100,
            in_recovery: true,
            version_num: real.policy().facts().server_version_num(),
            hashes: probes.clone(),
            backend_pid: 0,
        }),
    );
    allowed
        .transaction(&mut a, |tx| tx.lock(Item { id: 41 }).map(drop))
        .unwrap();
    mismatch
        .transaction(&mut a, |tx| {
            let err = tx.lock(HashText("x")).unwrap_err();
            assert!(err.kind() == ErrorKind::HashtextMismatch, "{err}");
            let batch = Batch::new().with(&HashText("x"));
            let err = tx.try_lock_batch(&batch).unwrap_err();
            assert!(err.kind() == ErrorKind::HashtextMismatch, "{err}");
            // Other key forms are still fine.
            let _ = tx.lock(Item { id: 42 })?;
            Ok::<_, Error>(())
        })
        .unwrap();
}

/// `HashText` keys exclude SQL that locks `hashtext(...)` directly.
#[test]
fn hashtext_keys_exclude_raw_sql() {
    let db = TestServer::shared();
    let _log = db.guard();
    let (mut a, mut b) = (connect(db), connect(db));
    let locker = locker(&mut a, Config::default());
    #[derive(QueryableByName)]
    struct Got {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        got: bool,
    }
    locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(HashText("lockkit-diesel-payroll-7"))?;
            b.transaction::<(), Error, _>(|b| {
                let row: Got = sql_query(
                    "SELECT pg_try_advisory_xact_lock(hashtext('lockkit-diesel-payroll-7')) AS got",
                )
                .get_result(b)?;
                assert!(!row.got, "raw SQL got the key lockkit holds");
                Ok(())
            })?;
            Ok::<_, Error>(())
        })
        .unwrap();
}

/// Errors of queries convert with `?` into `lockkit::Error`, with the codes
/// Diesel knows; the transaction then rolls back as usual.
#[test]
fn diesel_errors_convert_with_question_mark() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = connect(db);
    let locker = locker(&mut a, Config::default());
    let err = locker
        .transaction(&mut a, |tx| {
            let _ = tx.lock(Item { id: 51 })?;
            tx.conn().batch_execute(
                "CREATE TEMP TABLE u (id int PRIMARY KEY); INSERT INTO u VALUES (1)",
            )?;
            tx.conn().batch_execute("INSERT INTO u VALUES (1)")?;
            Ok::<_, Error>(())
        })
        .unwrap_err();
    assert_eq!(err.code(), Some("23505"), "{err}");
    let err = a
        .transaction::<(), Error, _>(|conn| {
            conn.batch_execute("SELECT * FROM lockkit_no_such_table")?;
            Ok(())
        })
        .unwrap_err();
    assert!(
        (err.kind() == ErrorKind::Database && err.code().is_none()),
        "{err}"
    );
    assert!(std::error::Error::source(&err).is_some());
    // After an error in the transaction, a lock call is refused by the
    // server (25P02) and the closure's `?` rolls back.
    let err = locker
        .transaction(&mut a, |tx| {
            let _ = tx
                .conn()
                .batch_execute("SELECT * FROM lockkit_no_such_table");
            let _ = tx.lock(Item { id: 52 })?;
            Ok::<_, Error>(())
        })
        .unwrap_err();
    assert!(err.kind() == ErrorKind::TransactionAborted, "{err}");
    assert_eq!(err.code(), Some("25P02"));
}

/// The Diesel adapter's lock methods are `#[track_caller]`: an order error
/// names the two call sites in this file (not the adapter's), and a try
/// below a held key is not refused (it does not wait; the engine's).
#[test]
fn an_order_error_names_the_applications_call_sites_and_a_try_passes() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = connect(db);
    let locker = locker(&mut a, Config::default().order_check(OrderCheck::Error));
    // `Pair` keys sort above every `BigInt` key.
    let (high, low) = (Cell { id: 40 }, Item { id: 40 });
    locker
        .transaction(&mut a, |tx| {
            let (_, line_held) = (tx.lock(high)?, line!());
            assert!(tx.try_lock(low)?.is_ok(), "a try is not refused");
            let batch = Batch::new().with(&Item { id: 39 });
            assert!(tx.try_lock_batch(&batch)?.is_ok());
            let (err, line_asked) = (tx.lock(Item { id: 38 }).unwrap_err(), line!());
            assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
            let (taken_at, asked_at) = err.lock_order_sites().unwrap();
            let (taken_at, asked_at) = (taken_at.unwrap(), asked_at.unwrap());
            assert_eq!(
                (taken_at.file(), asked_at.file()),
                (file!(), file!()),
                "{err}"
            );
            assert_eq!((taken_at.line(), asked_at.line()), (line_held, line_asked));
            let err = tx
                .lock_batch(&Batch::new().with(&Item { id: 36 }))
                .unwrap_err();
            assert_eq!(err.lock_order_sites().unwrap().1.unwrap().file(), file!());
            Ok::<_, Error>(())
        })
        .unwrap();
}

/// A lock call's error that aborted a savepoint or the transaction is
/// refused at their end, not reported as a release or a commit (PostgreSQL
/// answers `COMMIT` in an aborted transaction by rolling back, which Diesel
/// reports as success): the savepoint whose closure swallowed the error is
/// rolled back with `TransactionAborted` and the transaction goes on,
/// keeping the writes made outside it; the transaction whose closure did
/// the same is rolled back, and its write is not there.
#[test]
fn a_lock_error_that_aborted_is_refused_at_the_end() {
    let db = TestServer::shared();
    let _log = db.guard();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime for the fixture");
    let busy = Item { id: 70 };
    let fixture = runtime.block_on(Aborting::new(db, "lockkit_diesel_aborted", busy.lock_key()));
    let insert = fixture.insert();
    let write = |conn: &mut PgConnection, row: i64| {
        sql_query(&insert)
            .bind::<BigInt, _>(row)
            .execute(conn)
            .map(drop)
    };
    let mut conn = connect(db);
    let locker = locker(&mut conn, Config::default());
    locker
        .transaction(&mut conn, |tx| {
            write(tx.conn(), 1)?;
            let err = tx
                .savepoint(|sp| {
                    sp.conn().batch_execute("SET LOCAL lock_timeout = '50ms'")?;
                    write(sp.conn(), 2)?;
                    // Swallowed: the closure returns Ok.
                    let e = sp.lock(busy).unwrap_err();
                    assert!(e.is_timeout(), "{e}");
                    Ok::<_, Error>(())
                })
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
            write(tx.conn(), 3)?;
            Ok::<_, Error>(())
        })
        .unwrap();
    assert_eq!(runtime.block_on(fixture.ids()), [1, 3]);

    let answer = locker.transaction(&mut conn, |tx| {
        tx.conn().batch_execute("SET LOCAL lock_timeout = '50ms'")?;
        write(tx.conn(), 4)?;
        let e = tx.lock(busy).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        Ok::<_, Error>(())
    });
    runtime.block_on(fixture.check(4, true, answer));
    runtime.block_on(fixture.finish());
}
