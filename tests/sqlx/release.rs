//! `Locker::transaction` releases its locks when its closure panics, as
//! seen from another session. (The conformance suite, tests/conformance,
//! drives sqlx through `lock_tx` on its own `Transaction`; this is the
//! closure form.)

use lockkit_sqlx::{AdvisoryKey, Config, OrderCheck};
use lockkit_tests::TestServer;

use crate::common::{locker, pool, released};

#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq)]
#[advisory_key(namespace = "lockkit-tests/sqlx-release")]
struct Res {
    id: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn released_when_the_holding_task_panics() {
    let db = TestServer::shared();
    let _log = db.guard();
    let pool = pool(db, 2).await;
    let locker = locker(&pool, Config::default().order_check(OrderCheck::Off)).await;
    let observer = db.connect().await;
    let key = Res { id: 10 };
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let task = {
        let (pool, locker) = (pool.clone(), locker.clone());
        tokio::spawn(async move {
            locker
                .transaction(&pool, |tx| {
                    Box::pin(async move {
                        let _ = tx.lock(key).await?;
                        held_tx.send(()).unwrap();
                        tokio::task::yield_now().await;
                        panic!("the holder panics");
                        #[allow(unreachable_code)]
                        Ok::<_, lockkit_sqlx::Error>(())
                    })
                })
                .await
        })
    };
    held_rx.await.unwrap();
    assert!(task.await.unwrap_err().is_panic());
    assert!(released(&observer, key.lock_key()).await);
}
