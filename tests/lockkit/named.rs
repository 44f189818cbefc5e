//! Errors say what they are about: a try below a held key is not an order
//! violation (it never waits, so it cannot close a wait cycle); a
//! lock-order error names both key types and both call sites; timeouts,
//! budget errors and busy try-batches name the key types involved.

use std::time::Duration;

use lockkit::{AdvisoryKey, Batch, Config, ErrorKind, LockKey, OrderCheck};
use lockkit_tests::TestServer;
use tokio_postgres::Client;

use crate::common::capture::capture;
use crate::common::{advisory_rows, backend_pid, held_by, locker};

/// A `Pair` key: every one sorts above every `BigInt` key (docs/KEYS.md).
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.named.account", pair)]
struct Account {
    id: i64,
}

/// A `BigInt` key: sorts below every [`Account`].
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.named.report")]
struct Report {
    id: i64,
}

const ACCOUNT: &str = "lockkit-tests.named.account";
const REPORT: &str = "lockkit-tests.named.report";

/// A bound against a hang, not a margin: every call it wraps answers
/// within a round trip when the code is right.
const HANG: Duration = Duration::from_secs(60);

/// Takes `key` in a transaction of `client`'s, kept open until it is
/// dropped or committed.
async fn hold(client: &mut Client, key: LockKey) -> tokio_postgres::Transaction<'_> {
    let tx = client.transaction().await.expect("begin");
    let LockKey::BigInt(k) = key else {
        panic!("a BigInt key")
    };
    tx.execute("SELECT pg_advisory_xact_lock($1::int8)", &[&k])
        .await
        .expect("the blocker locks");
    tx
}

#[test]
fn the_two_types_sort_as_the_tests_assume() {
    assert!(Report { id: i64::MAX }.lock_key() < Account { id: i64::MIN }.lock_key());
}

/// The case: `try_lock(report)` after `lock(account)`, `report`
/// sorting below, under `OrderCheck::Error`. A try below the held key is
/// granted when free, answers busy at once when another session holds it
/// (the call returns while the blocker still holds the key: it did not
/// wait), and a try-batch below it likewise; a lock that waits for the same
/// key is refused, naming both types and both call sites (the control).
#[tokio::test(flavor = "multi_thread")]
async fn a_try_below_a_held_key_is_not_refused_and_does_not_wait() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut blocker = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Error)).await;
    let (account, report) = (Account { id: 3 }, Report { id: 1 });

    // Free: the try takes it.
    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(account).await.unwrap();
    let held = tx.try_lock(report).await.unwrap();
    assert!(held.is_ok(), "a free key below a held one is granted");
    assert!(held_by(&observer, pid, report.lock_key()).await);
    drop(held);
    tx.rollback().await.unwrap();

    // Busy: the try answers busy while the blocker holds the key.
    let blocked = hold(&mut blocker, report.lock_key()).await;
    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(account).await.unwrap();
    let tried = tokio::time::timeout(HANG, tx.try_lock(report)).await;
    let tried = tried.expect("a try does not wait").unwrap();
    assert_eq!(tried.err(), Some(report), "busy: the key comes back");
    let shared = tx.try_lock_shared(report).await.unwrap();
    assert!(shared.is_err(), "busy for a shared try too");
    let batch = Batch::new().with(&report).with(&Report { id: 2 });
    let tried = tokio::time::timeout(HANG, tx.try_lock_batch(&batch)).await;
    let busy = tried
        .expect("a try-batch does not wait")
        .unwrap()
        .unwrap_err();
    assert_eq!(busy.keys(), [report.lock_key()]);
    assert_eq!(busy.key_types(), [REPORT]);
    assert_eq!(
        busy.to_string(),
        format!("1 advisory lock(s) busy, of type {REPORT}")
    );
    assert!(!tx.is_poisoned());
    assert_eq!(advisory_rows(&observer, pid).await, 1, "only the account");

    // The control: a lock that would wait for it is refused, and says
    // which keys and where.
    tx.rollback().await.unwrap();
    let tx2 = locker.begin(&mut a).await.unwrap();
    let (_, line_held) = (tx2.lock(account).await.unwrap(), line!());
    let (err, line_asked) = (tx2.lock(report).await.unwrap_err(), line!());
    assert_eq!(err.kind(), ErrorKind::LockOrder, "{err}");
    assert_eq!(err.key_types(), [ACCOUNT, REPORT]);
    let (taken_at, asked_at) = err.lock_order_sites().expect("an order error");
    let (taken_at, asked_at) = (taken_at.expect("site known"), asked_at.expect("site known"));
    assert!(taken_at.file().ends_with("named.rs"), "{taken_at}");
    assert_eq!((taken_at.line(), asked_at.line()), (line_held, line_asked));
    assert_eq!(asked_at.file(), taken_at.file());
    let message = err.to_string();
    for part in [
        format!(
            "the {REPORT} key {} (requested at {asked_at})",
            report.lock_key()
        ),
        format!(
            "the {ACCOUNT} key {} (taken at {taken_at})",
            account.lock_key()
        ),
    ] {
        assert!(message.contains(&part), "{part:?} in {message}");
    }
    let err = tx2
        .lock_batch(&Batch::new().with(&report))
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::LockOrder,
        "a batch that waits: {err}"
    );
    assert!(!held_by(&observer, pid, report.lock_key()).await);
    tx2.rollback().await.unwrap();
    blocked.commit().await.unwrap();
}

/// Under `OrderCheck::Warn` a try below a held key warns of nothing; a
/// lock below it warns once, naming both types (the control).
#[tokio::test(flavor = "current_thread")]
async fn a_try_below_a_held_key_is_not_warned_of() {
    let (warnings, _capture) = capture();
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Warn)).await;
    let (account, report) = (Account { id: 4 }, Report { id: 4 });

    let tx = locker.begin(&mut a).await.unwrap();
    let _ = tx.lock(account).await.unwrap();
    assert!(tx.try_lock(report).await.unwrap().is_ok());
    let batch = Batch::new().with(&Report { id: 5 });
    assert!(tx.try_lock_batch(&batch).await.unwrap().is_ok());
    assert_eq!(
        warnings.warnings(),
        Vec::<String>::new(),
        "tries warn of nothing"
    );
    let _ = tx.lock(Report { id: 6 }).await.unwrap();
    let warned = warnings.warnings();
    assert_eq!(warned.len(), 1, "{warned:?}");
    for part in [ACCOUNT, REPORT, "named.rs"] {
        assert!(warned[0].contains(part), "{part} in {warned:?}");
    }
    tx.rollback().await.unwrap();
}

/// A timeout names the types of the keys the call waited for: lockkit's
/// own timeout, on one key and on a batch of two types, and the session's
/// own `lock_timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_names_the_key_types() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let mut blocker = db.connect().await;
    let locker = locker(&a, Config::default().order_check(OrderCheck::Error)).await;
    let report = Report { id: 7 };
    let blocked = hold(&mut blocker, report.lock_key()).await;

    let tx = locker.begin(&mut a).await.unwrap();
    let err = tx
        .lock_timeout(report, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(err.key_types(), [REPORT]);
    assert_eq!(
        err.to_string(),
        format!("timed out after 50ms waiting for 1 advisory lock(s) of type {REPORT}")
    );
    let batch = Batch::new().with(&Account { id: 7 }).with(&report);
    let err = tx
        .lock_batch_timeout(&batch, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(err.key_types(), [REPORT, ACCOUNT], "in the global order");
    assert!(
        err.to_string()
            .ends_with(&format!("2 advisory lock(s) of types {REPORT}, {ACCOUNT}")),
        "{err}"
    );
    tx.rollback().await.unwrap();

    // The session's own lock_timeout: the one-statement call.
    let tx = locker.begin(&mut a).await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '50ms'")
        .await
        .unwrap();
    let err = tx.lock(report).await.unwrap_err();
    assert!(err.is_timeout() && err.timeout().is_none(), "{err}");
    assert_eq!(err.key_types(), [REPORT]);
    assert!(
        err.to_string().contains(&format!("of type {REPORT};")),
        "{err}"
    );
    tx.rollback().await.unwrap();
    blocked.commit().await.unwrap();
}

/// A session lock's timeout names its key type too (the default form,
/// through the same engine, and the plain session-level form).
#[tokio::test(flavor = "multi_thread")]
async fn a_session_locks_timeout_names_the_key_type() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut blocker = db.connect().await;
    let report = Report { id: 8 };
    let blocked = hold(&mut blocker, report.lock_key()).await;
    for form in [
        lockkit::pg::SessionForm::Transaction,
        lockkit::pg::SessionForm::SessionLevel,
    ] {
        let err = lockkit::SessionLock::new(db.config())
            .form(form)
            .lock_timeout(report, Duration::from_millis(50))
            .await
            .expect_err("the key is held");
        assert!(err.is_timeout(), "{form:?}: {err}");
        if form == lockkit::pg::SessionForm::Transaction {
            assert_eq!(err.key_types(), [REPORT], "{form:?}: {err}");
            assert!(err.to_string().contains(REPORT), "{form:?}: {err}");
        }
    }
    blocked.commit().await.unwrap();
}

/// A budget error names the types held (most keys first) and the types
/// requested; the refused call sent nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_budget_error_names_the_key_types() {
    let db = TestServer::shared();
    let _log = db.guard();
    let mut a = db.connect().await;
    let observer = db.connect().await;
    let pid = backend_pid(&a).await;
    let config = Config::default().order_check(OrderCheck::Error).budget(3);
    let locker = locker(&a, config).await;

    let tx = locker.begin(&mut a).await.unwrap();
    let held = Batch::new()
        .with(&Report { id: 8 })
        .with(&Account { id: 8 })
        .with(&Account { id: 9 });
    let _ = tx.lock_batch(&held).await.unwrap();
    let more = Batch::new()
        .with(&Account { id: 9 })
        .with(&Account { id: 10 });
    let err = tx.lock_batch(&more).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExceeded, "{err}");
    assert_eq!(err.budget_counts(), Some((3, 1, 3)));
    assert_eq!(err.key_types(), [ACCOUNT]);
    assert_eq!(
        err.budget_held_types(),
        Some(&[(ACCOUNT, 2), (REPORT, 1)][..])
    );
    assert_eq!(
        err.to_string(),
        format!(
            "lock budget exceeded: 3 held (2 {ACCOUNT}, 1 {REPORT}) + 1 requested of type {ACCOUNT} > 3 allowed per transaction"
        )
    );
    assert_eq!(advisory_rows(&observer, pid).await, 3, "nothing sent");
    tx.rollback().await.unwrap();
}
