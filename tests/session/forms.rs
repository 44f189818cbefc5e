//! Shared mode, try and timeout for both session forms, on opened and on
//! pooled connections (the default form on opened connections is also
//! covered by dedicated.rs).

use std::time::Duration;

use lockkit::key::HashText;
use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, LockKey, Mode, SessionLock};
use lockkit_tests::observe::granted_elsewhere;
use lockkit_tests::support::bounded;
use lockkit_tests::TestServer;

use crate::pooler::pool_of;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-forms")]
struct Task {
    id: i64,
}

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/session-forms-pair", pair)]
struct Cell {
    id: i64,
}

/// Try, timeout and shared on `sessions`, on keys `base..base + 2`.
async fn modes(name: &str, sessions: &SessionLock, base: i64) {
    let observer = TestServer::shared().connect().await;
    let key = Task { id: base };
    let held = sessions.lock(key).await.unwrap();
    assert_eq!(held.mode(), Mode::Exclusive);
    assert!(granted_elsewhere(&observer, key.lock_key()).await, "{name}");
    assert_eq!(sessions.try_lock(key).await.unwrap().unwrap_err(), key);
    assert!(
        sessions.try_lock_shared(key).await.unwrap().is_err(),
        "{name}"
    );
    for err in [
        sessions
            .lock_timeout(key, Duration::from_millis(50))
            .await
            .unwrap_err(),
        sessions
            .lock_shared_timeout(key, Duration::from_millis(50))
            .await
            .unwrap_err(),
    ] {
        assert!(err.is_timeout(), "{name}: {err}");
    }
    assert!(held.release().await.unwrap(), "{name}");

    // Shared holders admit each other and exclude an exclusive one.
    let a = sessions.lock_shared(key).await.unwrap();
    let b = sessions
        .lock_shared_timeout(key, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(b.mode(), Mode::Shared);
    assert!(sessions.try_lock(key).await.unwrap().is_err(), "{name}");
    assert!(a.release().await.unwrap(), "{name}");
    assert!(sessions.try_lock(key).await.unwrap().is_err(), "{name}");
    drop(b);
    let c = sessions
        .lock_timeout(key, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(c.release().await.unwrap(), "{name}");

    // The pair key space and HashText keys.
    let pair = sessions.lock(Cell { id: base }).await.unwrap();
    assert!(matches!(pair.key(), LockKey::Pair(..)));
    assert!(sessions
        .try_lock_shared(Cell { id: base })
        .await
        .unwrap()
        .is_err());
    assert!(pair.release().await.unwrap(), "{name}");
    let text = format!("lockkit-tests/session-forms/{base}");
    let guard = sessions
        .try_lock(HashText(text.clone()))
        .await
        .unwrap()
        .unwrap();
    let raw: bool = observer
        .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&text])
        .await
        .unwrap()
        .get(0);
    assert!(!raw, "{name}: SQL on hashtext() is excluded");
    assert!(guard.release().await.unwrap(), "{name}");
}

#[tokio::test(flavor = "multi_thread")]
async fn try_timeout_and_shared_in_both_forms_opened_and_pooled() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool_of(db.config(), 4);
    let cases = [
        ("default, opened", SessionLock::new(db.config())),
        ("default, pooled", SessionLock::from_pool(pool.clone())),
        (
            "session-level, opened",
            SessionLock::new(db.config()).form(SessionForm::SessionLevel),
        ),
        (
            "session-level, pooled",
            SessionLock::from_pool(pool.clone()).form(SessionForm::SessionLevel),
        ),
    ];
    for (i, (name, sessions)) in cases.iter().enumerate() {
        modes(name, sessions, 10 * i as i64).await;
    }
    // The pool's connections came back free: every key can be taken.
    let direct = SessionLock::new(db.config());
    for i in 0..cases.len() as i64 {
        let guard = direct.try_lock(Task { id: 10 * i }).await.unwrap();
        assert!(guard.unwrap().release().await.unwrap());
    }
}

/// A server that refuses the set-up's `SET LOCAL
/// client_connection_check_interval` (`42704`, as PostgreSQL 13 does)
/// after one that took it (another host of the configuration, a restore
/// onto an older major): the call whose set-up it refused fails, nothing
/// held, and the next set-up asks the server again instead of assuming the
/// setting. A proxy stands in for the older server by renaming the setting
/// in the `SET LOCAL` form only; the form that asks the server's version
/// still finds it, so the set-ups alternate: no two calls in a row fail.
/// Both forms that hold a transaction: the default one (each lock a
/// connection of its own) and the multiplexed one (a new connection per
/// fresh clone). Keeping the flag after a `42704`
/// (`.ci/mutations "42704"`) fails it: every call fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_set_up_refused_for_want_of_the_client_check_asks_again() {
    use lockkit_tests::{Cut, Proxy};
    let db = TestServer::shared();
    let _log = db.guard();
    let observer = bounded("the observer's connection", db.connect()).await;
    for (form, id) in [
        (SessionForm::Transaction, 97_000),
        (SessionForm::Multiplexed, 97_100),
    ] {
        let proxy = Proxy::in_front_of(db);
        let sessions = SessionLock::new(proxy.config())
            .form(form)
            .keepalive(Duration::from_secs(60));
        // The first set-up asks, and sees the setting.
        let first = format!("{form:?}, the first lock");
        let guard = bounded(&first, sessions.lock(Task { id })).await.unwrap();
        assert!(bounded(&first, guard.release()).await.unwrap());
        let rewrite = Cut::Rewrite {
            from: "SET LOCAL client_connection_check_interval",
            to: "SET LOCAL client_connection_check_intervaX",
        };
        bounded(&format!("{form:?}, the rewrite"), proxy.cut(rewrite)).await;
        let mut failed_before = false;
        let mut failures = 0;
        for call in 1..=6 {
            let key = Task { id: id + call };
            // A fresh clone's multiplexed lock opens a connection of its own.
            let fresh = sessions.clone().connections(1);
            let what = format!("{form:?}, call {call}");
            match bounded(&what, fresh.lock(key)).await {
                Ok(guard) => {
                    assert!(bounded(&what, guard.release()).await.unwrap());
                    failed_before = false;
                }
                Err(e) => {
                    assert_eq!(e.code(), Some("42704"), "{form:?}, call {call}: {e}");
                    assert!(
                        !failed_before,
                        "{form:?}, call {call}: a second set-up in a row assumed the setting"
                    );
                    assert!(
                        !bounded(&what, granted_elsewhere(&observer, key.lock_key())).await,
                        "{form:?}, call {call}: held after the error"
                    );
                    failed_before = true;
                    failures += 1;
                }
            }
        }
        // The premise: the proxy did hide the setting.
        assert!(failures > 0, "{form:?}: no set-up was refused");
    }
}
