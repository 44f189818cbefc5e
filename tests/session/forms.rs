//! Shared mode, try and timeout for both session forms, on opened and on
//! pooled connections (the default form on opened connections is also
//! covered by dedicated.rs).

use std::time::Duration;

use lockkit::key::HashText;
use lockkit::pg::SessionForm;
use lockkit::{AdvisoryKey, LockKey, Mode, SessionLock};
use lockkit_tests::observe::granted_elsewhere;
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
