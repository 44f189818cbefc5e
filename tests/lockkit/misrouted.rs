//! A reply that is not the statement's own, which is what a client sees
//! when a transaction-mode pooler routes another client's reply to its
//! connection (the fleet's soak met it behind pgbouncer 1.18, on lockkit's
//! connections and on others), is `ErrorKind::UnexpectedReply`: never a
//! bare database error, and never a lock reported held. A proxy in front of
//! the real server puts a stray `NoData` before the lock statement's reply
//! (`Cut::StrayReply`).

use lockkit::{AdvisoryKey, Config, ErrorKind, LockClient, Locker, SessionForm, SessionLock};
use lockkit_tests::observe::granted_elsewhere;
use lockkit_tests::{Cut, Proxy, TestServer};
use tokio_postgres::NoTls;

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests.misrouted")]
struct Parcel {
    id: i64,
}

/// A transaction-scoped lock call, in each statement mode: the call fails
/// with `UnexpectedReply` and poisons the transaction, and once it is
/// rolled back nothing is held. Before the mapping, tokio-postgres's
/// "unexpected message from server" came back as `ErrorKind::Database`.
#[tokio::test(flavor = "multi_thread")]
async fn a_stray_reply_to_a_lock_call_is_an_unexpected_reply() {
    let db = TestServer::shared();
    let observer = db.connect().await;
    for (round, mode) in [
        lockkit::StatementMode::Unnamed,
        lockkit::StatementMode::Prepared,
    ]
    .into_iter()
    .enumerate()
    {
        let proxy = Proxy::in_front_of(db);
        let (client, connection) = proxy.config().connect(NoTls).await.unwrap();
        tokio::spawn(connection);
        let locker = Locker::new(&client, Config::default().statements(mode))
            .await
            .unwrap();
        let mut conn = LockClient::new(&locker, client);
        // Prepared mode prepares its statements at the first lock call.
        let warm = conn.begin().await.unwrap();
        drop(warm.lock(Parcel { id: 99 }).await.unwrap());
        warm.rollback().await.unwrap();

        let key = Parcel { id: round as i64 };
        let tx = conn.begin().await.unwrap();
        proxy.cut(Cut::StrayReply).await;
        let e = tx.lock(key).await.expect_err("a reply not its own");
        assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{mode:?}: {e:?}");
        assert!(tx.is_poisoned(), "{mode:?}");
        tx.rollback().await.unwrap();
        assert!(
            !granted_elsewhere(&observer, key.lock_key()).await,
            "{mode:?}: nothing held after the rollback"
        );
    }
}

/// A multiplexed session lock's take on a connection it already holds a
/// lock on: `UnexpectedReply`, the key not reported held.
#[tokio::test(flavor = "multi_thread")]
async fn a_stray_reply_to_a_session_lock_call_is_an_unexpected_reply() {
    let db = TestServer::shared();
    let proxy = Proxy::in_front_of(db);
    let sessions = SessionLock::new(proxy.config())
        .form(SessionForm::Multiplexed)
        .connections(1);
    let first = sessions
        .try_lock(Parcel { id: 10 })
        .await
        .unwrap()
        .expect("nobody else holds it");
    proxy.cut(Cut::StrayReply).await;
    let e = sessions
        .try_lock(Parcel { id: 11 })
        .await
        .expect_err("a reply not its own");
    assert_eq!(e.kind(), ErrorKind::UnexpectedReply, "{e:?}");
    drop(first);
}
