//! What lockkit decides before sending anything: the lock budget (and the
//! `53200` it exists to prevent), free relocks, savepoint bookkeeping and the
//! lock order check.

use std::time::Duration;

use lockkit::ErrorKind;
use lockkit::{AdvisoryKey, Batch, Config, LockKey, Mode, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{advisory_rows, backend_pid, granted_elsewhere, held_by, locker, sorted};

/// This module's keys, in a namespace of their own.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.budget")]
struct Key {
    id: i64,
}

/// The `pg_locks` modes in which backend `pid` holds `key`, sorted.
async fn modes(observer: &tokio_postgres::Client, pid: i32, key: LockKey) -> Vec<String> {
    let id = key.to_pg_locks();
    observer
        .query(
            "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1 AND objid = $2 AND objsubid = $3 AND pid = $4 ORDER BY mode",
            &[&id.classid, &id.objid, &id.objsubid, &pid],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn batch_of(ids: impl IntoIterator<Item = i64>) -> Batch {
    ids.into_iter().map(|id| Key { id }).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn configured_budget_refuses_before_sending() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(
        &a,
        Config::default().order_check(OrderCheck::Warn).budget(3),
    )
    .await;

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock_batch(&batch_of([101, 102])).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 2);

    // 102 is held: only 103 and 104 are new, and 2 + 2 > 3.
    let err = tx.lock_batch(&batch_of([102, 103, 104])).await.unwrap_err();
    assert_eq!(err.budget_counts(), Some((2, 2, 3)), "{err}");
    assert_eq!(
        advisory_rows(&observer, pid).await,
        2,
        "nothing of the refused batch reached the server"
    );
    for id in [103, 104] {
        assert!(!granted_elsewhere(&observer, Key { id }.lock_key()).await);
    }
    assert_eq!(tx.held_count(), 2);

    // Still usable: a query and a batch within the budget both work.
    let one: i32 = tx.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    let _ = tx.lock_batch(&batch_of([102, 103])).await.unwrap();
    assert_eq!(tx.held_count(), 3);
    assert_eq!(advisory_rows(&observer, pid).await, 3);

    let err = tx.lock(Key { id: 104 }).await.unwrap_err();
    assert_eq!(err.budget_counts(), Some((3, 1, 3)), "{err}");
    let err = tx.try_lock(Key { id: 104 }).await.unwrap_err();
    assert!(err.kind() == ErrorKind::BudgetExceeded, "{err}");
    assert!(!held_by(&observer, pid, Key { id: 104 }.lock_key()).await);

    // At the budget, held keys can still be locked again, in any covered mode.
    let again = tx.lock(Key { id: 101 }).await.unwrap();
    assert_eq!(again.mode(), Mode::Exclusive);
    let _ = tx.lock_shared(Key { id: 102 }).await.unwrap();
    let _ = tx.lock_batch(&batch_of([101, 102, 103])).await.unwrap();
    assert_eq!(tx.held_count(), 3);
    assert_eq!(advisory_rows(&observer, pid).await, 3);
    tx.commit().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
}

/// At the budget, a held key's upgrade (shared to exclusive) is not a new
/// key: it is sent, and the server then holds the key in both modes, while
/// a key not held is still refused.
#[tokio::test(flavor = "multi_thread")]
async fn upgrading_a_held_key_at_the_budget_is_not_a_new_key() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(
        &a,
        Config::default().order_check(OrderCheck::Warn).budget(3),
    )
    .await;
    let tx = locker.begin(&mut a).await.unwrap();
    let ids = [201, 202, 203];
    for id in ids {
        let _ = tx.lock_shared(Key { id }).await.unwrap();
    }
    assert_eq!(tx.held_count(), 3);
    // One upgrade alone, then two in one batch.
    let up = tx.lock(Key { id: 203 }).await.unwrap();
    assert_eq!(up.mode(), Mode::Exclusive);
    let _ = tx.lock_batch(&batch_of([201, 202])).await.unwrap();
    for id in ids {
        assert_eq!(
            modes(&observer, pid, Key { id }.lock_key()).await,
            ["ExclusiveLock", "ShareLock"],
            "key {id}"
        );
    }
    assert_eq!(tx.held_count(), 3);
    let err = tx.lock_shared(Key { id: 204 }).await.unwrap_err();
    assert_eq!(err.budget_counts(), Some((3, 1, 3)), "{err}");
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn default_budget_is_max_locks_per_transaction() {
    let db = TestServer::builder()
        .setting("max_locks_per_transaction", "10")
        .start();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    assert_eq!(locker.policy().facts().max_locks_per_transaction(), 10);
    assert_eq!(locker.policy().budget(), 10);

    let tx = locker.begin(&mut a).await.unwrap();
    let err = tx.lock_batch(&batch_of(0..11)).await.unwrap_err();
    assert_eq!(err.budget_counts(), Some((0, 11, 10)), "{err}");
    assert_eq!(advisory_rows(&observer, pid).await, 0);

    let _ = tx.lock_batch(&batch_of(0..10)).await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 10);
    let err = tx.lock_shared(Key { id: 10 }).await.unwrap_err();
    assert_eq!(err.budget_counts(), Some((10, 1, 10)), "{err}");
    assert_eq!(advisory_rows(&observer, pid).await, 10);
    let _ = tx.lock(Key { id: 9 }).await.unwrap();
    tx.commit().await.unwrap();
}

/// A relock of a held key sends nothing: it still succeeds after the
/// session's backend was terminated, when anything sent would fail.
#[tokio::test(flavor = "multi_thread")]
async fn relock_of_held_key_costs_no_round_trip() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(Key { id: 201 }).await.unwrap();
    let _ = tx.lock_shared(Key { id: 202 }).await.unwrap();

    let killed: bool = observer
        .query_one("SELECT pg_terminate_backend($1, 10000)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed, "the backend did not exit");

    // Held in a covering mode: nothing to send, so the dead session is no
    // obstacle.
    let again = tx.lock(Key { id: 201 }).await.unwrap();
    assert_eq!(again.mode(), Mode::Exclusive);
    let again = tx.lock_shared(Key { id: 201 }).await.unwrap();
    assert_eq!(again.mode(), Mode::Exclusive, "exclusive covers shared");
    assert!(tx.try_lock_shared(Key { id: 202 }).await.unwrap().is_ok());
    let _ = tx
        .lock_batch(
            &Batch::new()
                .with(&Key { id: 201 })
                .with_shared(&Key { id: 202 }),
        )
        .await
        .unwrap();
    let _ = tx
        .lock_timeout(Key { id: 201 }, Duration::from_millis(10))
        .await
        .unwrap();

    // Control: anything that needs the server fails, an upgrade included.
    let err = tx.lock(Key { id: 202 }).await.unwrap_err();
    assert!(err.is_connection_lost(), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn savepoint_rollback_frees_the_budget() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let locker = locker(
        &a,
        Config::default().order_check(OrderCheck::Warn).budget(2),
    )
    .await;

    let mut tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(Key { id: 301 }).await.unwrap();
    {
        let sp = tx.savepoint().await.unwrap();
        let _ = sp.lock(Key { id: 302 }).await.unwrap();
        let err = sp.lock(Key { id: 303 }).await.unwrap_err();
        assert_eq!(err.budget_counts(), Some((2, 1, 2)), "{err}");
        sp.rollback().await.unwrap();
    }
    assert_eq!(tx.held_count(), 1);
    {
        let sp = tx.savepoint().await.unwrap();
        let _ = sp.lock(Key { id: 303 }).await.unwrap();
        // Dropped without commit: rolled back, forgotten.
    }
    assert_eq!(tx.held_count(), 1);
    let _ = tx.lock(Key { id: 304 }).await.unwrap();
    let err = tx.lock(Key { id: 305 }).await.unwrap_err();
    assert!(matches!(err.budget_counts(), Some((2, _, _))), "{err}");
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn nested_savepoints_release_on_rollback_and_keep_on_commit() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Off)).await;
    let key = |id: i64| Key { id }.lock_key();

    let mut tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(Key { id: 401 }).await.unwrap();
    {
        let mut sp1 = tx.savepoint().await.unwrap();
        assert_eq!(sp1.depth(), 1);
        let _ = sp1.lock(Key { id: 402 }).await.unwrap();
        let _ = sp1.lock_shared(Key { id: 404 }).await.unwrap();
        {
            let sp2 = sp1.savepoint().await.unwrap();
            assert_eq!(sp2.depth(), 2);
            let _ = sp2.lock(Key { id: 403 }).await.unwrap();
            // Upgrading a key the enclosing level holds shared.
            let up = sp2.lock(Key { id: 404 }).await.unwrap();
            assert_eq!(up.mode(), Mode::Exclusive);
            assert_eq!(sp2.held_count(), 4);
            assert!(held_by(&observer, pid, key(403)).await);
            assert_eq!(
                modes(&observer, pid, key(404)).await,
                ["ExclusiveLock", "ShareLock"]
            );
            sp2.rollback().await.unwrap();
        }
        assert_eq!(sp1.held_count(), 3);
        assert!(!sp1.holds(&Key { id: 403 }, Mode::Shared));
        assert!(!held_by(&observer, pid, key(403)).await);
        assert!(sp1.holds(&Key { id: 404 }, Mode::Shared));
        assert!(!sp1.holds(&Key { id: 404 }, Mode::Exclusive));
        assert_eq!(modes(&observer, pid, key(404)).await, ["ShareLock"]);
        assert!(held_by(&observer, pid, key(402)).await);
        {
            let sp2 = sp1.savepoint().await.unwrap();
            let _ = sp2.lock(Key { id: 405 }).await.unwrap();
            sp2.commit().await.unwrap();
        }
        assert!(sp1.holds(&Key { id: 405 }, Mode::Exclusive));
        {
            let sp2 = sp1.savepoint().await.unwrap();
            let _ = sp2.lock(Key { id: 406 }).await.unwrap();
            assert!(held_by(&observer, pid, key(406)).await);
            // Dropped, not committed.
        }
        assert!(!sp1.holds(&Key { id: 406 }, Mode::Shared));
        // tokio-postgres sends the savepoint's rollback on drop, ahead of
        // this query.
        sp1.query_one("SELECT 1", &[]).await.unwrap();
        assert!(!held_by(&observer, pid, key(406)).await);
        sp1.commit().await.unwrap();
    }
    assert_eq!(tx.held_count(), 4);
    for id in [401, 402, 405] {
        assert!(tx.holds(&Key { id }, Mode::Exclusive), "{id}");
        assert!(held_by(&observer, pid, key(id)).await, "{id}");
    }
    assert!(tx.holds(&Key { id: 404 }, Mode::Shared));
    assert_eq!(advisory_rows(&observer, pid).await, 4);
    {
        // The whole savepoint, including what it inherited, rolls back.
        let mut sp1 = tx.savepoint().await.unwrap();
        let _ = sp1.lock(Key { id: 407 }).await.unwrap();
        {
            let sp2 = sp1.savepoint().await.unwrap();
            let _ = sp2.lock(Key { id: 408 }).await.unwrap();
            sp2.commit().await.unwrap();
        }
        sp1.rollback().await.unwrap();
    }
    assert_eq!(tx.held_count(), 4);
    assert_eq!(advisory_rows(&observer, pid).await, 4);
    tx.commit().await.unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn order_check_error_refuses_before_sending() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Error)).await;
    let [k1, k2, k3, k4]: [Key; 4] = sorted((501..505).map(|id| Key { id }).collect())
        .try_into()
        .unwrap();

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    let err = tx.lock(k1).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    assert_eq!(err.lock_order_keys(), Some((k2.lock_key(), k1.lock_key())));
    assert!(!held_by(&observer, pid, k1.lock_key()).await);
    let err = tx
        .lock_batch(&Batch::new().with(&k1).with(&k3))
        .await
        .unwrap_err();
    assert!(err.kind() == ErrorKind::LockOrder, "{err}");
    assert!(!held_by(&observer, pid, k3.lock_key()).await);
    assert_eq!(advisory_rows(&observer, pid).await, 1);

    // Still usable; ascending requests and relocks of lower keys are fine.
    tx.query_one("SELECT 1", &[]).await.unwrap();
    let _ = tx.lock(k3).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    let _ = tx
        .lock_batch(&Batch::new().with(&k2).with(&k4))
        .await
        .unwrap();
    assert_eq!(advisory_rows(&observer, pid).await, 3);
    tx.rollback().await.unwrap();

    // A batch is sorted, so its insertion order never matters.
    let tx = locker.begin(&mut a).await.unwrap();
    let batch = Batch::new().with(&k4).with(&k3).with_shared(&k1).with(&k2);
    let held = tx.lock_batch(&batch).await.unwrap();
    assert_eq!(
        held.keys()
            .iter()
            .map(|(k, _)| *k)
            .collect::<Vec<LockKey>>(),
        [k1, k2, k3, k4].map(|k| k.lock_key())
    );
    assert_eq!(advisory_rows(&observer, pid).await, 4);
    drop(held);
    tx.rollback().await.unwrap();
}

/// `OrderCheck::Warn` (the default) takes a lock below a held key, and
/// emits a warning saying so; taken in order, no warning (the control).
#[tokio::test(flavor = "multi_thread")]
async fn order_check_warn_takes_the_lock() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    // Debug builds fail on out-of-order acquisition by default (lockdep);
    // release builds warn.
    assert_eq!(
        OrderCheck::default(),
        if cfg!(debug_assertions) {
            OrderCheck::Error
        } else {
            OrderCheck::Warn
        }
    );
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let [k1, k2]: [Key; 2] = sorted((601..603).map(|id| Key { id }).collect())
        .try_into()
        .unwrap();

    // The test body runs on this thread (block_on), and so do the lock
    // calls it awaits: the capture sees their events.
    let (captured, _capture) = crate::common::capture::capture();

    // Control: in order, nothing to warn about.
    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(k1).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(captured.warnings(), Vec::<String>::new());

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(k2).await.unwrap();
    let _ = tx.lock(k1).await.unwrap();
    let warnings = captured.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("requested below a key already held")
            && warnings[0].contains(&k2.lock_key().to_string())
            && warnings[0].contains(&k1.lock_key().to_string()),
        "{warnings:?}"
    );
    assert!(held_by(&observer, pid, k1.lock_key()).await);
    assert!(held_by(&observer, pid, k2.lock_key()).await);
    tx.rollback().await.unwrap();
}

/// The lock table is shared: a transaction without a budget fills it and
/// makes an innocent session fail with `53200`, even in `try_lock`; with the
/// default budget the greedy one is stopped first and others are fine.
#[tokio::test(flavor = "multi_thread")]
async fn budget_prevents_lock_table_full() {
    let db = TestServer::builder()
        .setting("max_locks_per_transaction", "10")
        .setting("max_connections", "20")
        .start();
    let _log = db.guard();
    let mut greedy = db.connect().await;
    let mut innocent = db.connect().await;
    let observer = db.connect().await;
    let greedy_pid = backend_pid(&greedy).await;
    let unbounded = locker(
        &greedy,
        Config::default()
            .order_check(OrderCheck::Warn)
            .budget(100_000),
    )
    .await;
    let bounded = locker(&greedy, Config::default().order_check(OrderCheck::Warn)).await;
    let polite = locker(&innocent, Config::default().order_check(OrderCheck::Warn)).await;
    assert_eq!(bounded.policy().budget(), 10);

    // Without a budget: take keys in batches until the server gives out.
    const STEP: i64 = 50;
    let tx = unbounded.begin(&mut greedy).await.unwrap();
    let mut taken = 0;
    let err = loop {
        assert!(taken < 90_000, "no 53200 after {taken} keys");
        match tx.lock_batch(&batch_of(taken..taken + STEP)).await {
            Ok(_) => taken += STEP,
            Err(e) => break e,
        }
    };
    assert!(err.is_lock_table_full(), "{err}");
    assert_eq!(err.code(), Some("53200"));
    assert!(taken as usize > bounded.policy().budget());
    eprintln!("53200 after {taken} advisory locks (+ part of a batch of {STEP})");
    // The failed statement aborted the transaction, and the server released
    // its locks with the abort, before any ROLLBACK.
    let err = tx.lock(Key { id: -2 }).await.unwrap_err();
    assert!(err.kind() == ErrorKind::TransactionAborted, "{err}");
    tx.rollback().await.unwrap();

    // So to hurt others, the greedy transaction must keep what it took:
    // fill the table again, each request in a savepoint (lock_*_timeout),
    // batches first, then single keys, until not even one key fits.
    let tx = unbounded.begin(&mut greedy).await.unwrap();
    let forever = Duration::from_secs(60);
    let mut taken = 0;
    let mut step = STEP;
    loop {
        assert!(taken < 90_000, "no 53200 after {taken} keys");
        let result = if step == 1 {
            tx.lock_timeout(Key { id: taken }, forever).await.map(drop)
        } else {
            tx.lock_batch_timeout(&batch_of(taken..taken + step), forever)
                .await
                .map(drop)
        };
        match result {
            Ok(()) => taken += step,
            Err(e) if e.is_lock_table_full() && step > 1 => step = 1,
            Err(e) if e.is_lock_table_full() => break,
            Err(e) => panic!("after {taken} keys: {e}"),
        }
    }
    eprintln!("the greedy transaction holds {taken} advisory locks, the table is full");
    assert_eq!(advisory_rows(&observer, greedy_pid).await, taken);
    assert_eq!(tx.held_count() as i64, taken);

    // Now the greedy transaction's greed is every session's failure, even
    // for a try, which raises rather than reporting the key busy.
    let itx = polite.begin(&mut innocent).await.unwrap();
    let err = itx.try_lock(Key { id: -1 }).await.unwrap_err();
    assert!(err.is_lock_table_full(), "try_lock: {err}");
    itx.rollback().await.unwrap();
    let itx = polite.begin(&mut innocent).await.unwrap();
    let err = itx.lock_timeout(Key { id: -1 }, forever).await.unwrap_err();
    assert!(err.is_lock_table_full(), "lock_timeout: {err}");
    itx.query_one("SELECT 1", &[]).await.unwrap();
    itx.rollback().await.unwrap();

    // Control: the same innocent request succeeds once the greedy one ends.
    tx.rollback().await.unwrap();
    let itx = polite.begin(&mut innocent).await.unwrap();
    assert!(itx.try_lock(Key { id: -1 }).await.unwrap().is_ok());
    itx.rollback().await.unwrap();

    // With the default budget, the same greed is stopped by lockkit, in as
    // many sessions as the server allows us, and innocents are fine.
    let mut others = Vec::new();
    for _ in 0..10 {
        others.push(db.connect().await);
    }
    let mut txs = Vec::new();
    for (n, client) in std::iter::once(&mut greedy)
        .chain(others.iter_mut())
        .enumerate()
    {
        let tx = bounded.begin(client).await.unwrap();
        let base = 1_000_000 * (n as i64 + 1);
        let mut taken = 0;
        let err = loop {
            match tx
                .lock_batch(&batch_of(base + taken..base + taken + 5))
                .await
            {
                Ok(_) => taken += 5,
                Err(e) => break e,
            }
        };
        assert_eq!(err.budget_counts(), Some((10, 5, 10)), "{err}");
        tx.query_one("SELECT 1", &[]).await.unwrap();
        txs.push(tx);
    }
    let itx = polite.begin(&mut innocent).await.unwrap();
    assert!(itx.try_lock(Key { id: -1 }).await.unwrap().is_ok());
    let _ = itx.lock_batch(&batch_of(-10..-1)).await.unwrap();
    itx.commit().await.unwrap();
    for tx in txs {
        tx.rollback().await.unwrap();
    }
}
